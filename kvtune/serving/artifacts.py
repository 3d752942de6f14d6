"""What a serving process loads once at start-up: the policy table, the geometry of the model it
was profiled on, and the runnable codec policy behind every table row it may select.

KVServe ("KVServe: Service-Aware KV Cache Compression for Communication-Efficient Disaggregated
LLM Serving", arXiv 2605.13734, Service-Aware Online Controller) selects, per transfer, a policy
of an offline table; this module turns that table into what the runtime needs before the first
request, so that every problem (a malformed policy, a MixHQ policy without its calibration, a
table profiled for another model) is a typed error at start-up, never at the first encode.

Sources, in order of precedence:

* the table: a ``.json`` / ``.parquet`` file (:meth:`kvtune.tables.PolicyTable.load`) or a run
  folder (``profiles/<run>/`` with ``policy_table.parquet`` or ``.json``);
* the run's ``run.json`` (``model_info``: ``num_layers``, ``kv_heads``, ``head_dim``, ``dtype``;
  ``settings.kv_dtype``): the run folder itself, or the folder of a table file whose ``run.json``
  names the same run as the table's metadata (``extra.run``);
* the run's ``calibration.json`` (MixHQ head scores, written by the profiler), same folder, and
  the PCA basis files it names (``pca_basis*.safetensors``, loaded and registered for ``pca`` /
  ``dp-alloc`` policies, :mod:`kvtune.codecs.pca`);
* explicit arguments override both (``model_info=``, ``head_scores=``).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvtune.codecs.kvtensors import DTYPE_NAMES
from kvtune.codecs.policy import PolicyConfig
from kvtune.codecs.pca import PCA, BasisError, BasisNotLoadedError, lookup
from kvtune.codecs.select import selecting_transform
from kvtune.core.errors import ConfigError, KvtuneError, TableError
from kvtune.tables.policy_table import NONE_POLICY_ID, PolicyTable
from kvtune.tables.run import run_name

__all__ = [
    "MAX_RUN_FILE_BYTES",
    "SERVABLE_METHODS",
    "CalibrationError",
    "ModelGeometry",
    "ModelMismatchError",
    "ServingArtifacts",
    "load_artifacts",
    "mixhq_problems",
    "codebook_problems",
    "policy_configs",
    "selection_problem",
    "basis_problem",
]

#: Largest ``run.json`` / ``calibration.json`` read (bytes); a larger file is refused unread.
MAX_RUN_FILE_BYTES = 16 << 20
#: Table methods a :class:`~kvtune.serving.runtime.ServingPolicy` can encode with
#: :func:`kvtune.codecs.encode_kv` ("none" is sent as raw bfloat16).
SERVABLE_METHODS = ("tqc", NONE_POLICY_ID)
_TABLE_FILES = ("policy_table.parquet", "policy_table.json")


class ModelMismatchError(KvtuneError):
    """The serving model (or a KV cache handed to the runtime) does not match the model the
    policy table was profiled for: number of layers, KV heads, head dimension or KV dtype, or
    the table records no model geometry to check against."""


class CalibrationError(ConfigError):
    """A policy needs calibration data the serving process does not have (a ``mixhq`` policy
    without head scores), or the calibration file is unreadable or malformed."""


@dataclass(frozen=True)
class ModelGeometry:
    """KV geometry of the model a table was profiled on.

    Attributes:
        num_layers: layers with a KV cache.
        kv_heads: KV heads per layer.
        head_dim: channels per head.
        dtype: KV dtype name the accuracies were measured on (``"float32"``, ``"bfloat16"``
            or ``"float16"``): ``bfloat16`` when the run rounded its KV (``--kv-dtype
            bfloat16``), else the model's dtype.
        source: where it was read (file name or ``"model_info="``), for error messages.
    """

    num_layers: int
    kv_heads: int
    head_dim: int
    dtype: str
    source: str

    @classmethod
    def from_mapping(cls, info: Mapping[str, Any], source: str, *, kv_dtype: str | None = None) -> ModelGeometry:
        """Geometry from a ``model_info`` mapping (``num_layers``, ``kv_heads``, ``head_dim``,
        ``dtype``); ``kv_dtype="bfloat16"`` overrides ``dtype``.

        Raises:
            ModelMismatchError: not a mapping, a field missing or not a positive int, or an
                unknown dtype.
        """
        if not isinstance(info, Mapping):
            raise ModelMismatchError(f"{source}: model geometry must be a mapping with num_layers, kv_heads, head_dim, "
                                     f"dtype; got {type(info).__name__}")
        dims = {k: info.get(k) for k in ("num_layers", "kv_heads", "head_dim")}
        bad = [k for k, v in dims.items() if isinstance(v, bool) or not isinstance(v, int) or v <= 0]
        if bad:
            raise ModelMismatchError(f"{source}: model geometry field(s) {bad} missing or not positive ints")
        dtype = "bfloat16" if kv_dtype == "bfloat16" else info.get("dtype")
        if dtype not in DTYPE_NAMES.values():
            raise ModelMismatchError(f"{source}: KV dtype {dtype!r} is not one of {sorted(DTYPE_NAMES.values())}")
        return cls(dims["num_layers"], dims["kv_heads"], dims["head_dim"], str(dtype), source)

    def problems(self, *, num_layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> list[str]:
        """Human-readable differences between this geometry and a serving model's (empty when
        they match)."""
        out = [
            f"{name} {got} (table: {want})"
            for name, got, want in (
                ("num_layers", num_layers, self.num_layers),
                ("kv_heads", kv_heads, self.kv_heads),
                ("head_dim", head_dim, self.head_dim),
            )
            if got != want
        ]
        name = DTYPE_NAMES.get(dtype, str(dtype))
        if name != self.dtype:
            out.append(f"KV dtype {name} (table profiled on {self.dtype} KV)")
        return out


@dataclass(frozen=True)
class ServingArtifacts:
    """Everything loaded at start-up (see :func:`load_artifacts`).

    Attributes:
        table: the policy table.
        geometry: the profiled model's geometry, or None when no source records it.
        head_scores: MixHQ head scores (``[layer][kv_head]``) or None.
        run_dir: the run folder the run files were read from, or None.
        pca_bases: digests of the PCA bases loaded from the run folder and registered in this
            process (:mod:`kvtune.codecs.pca`), for ``pca`` / ``dp-alloc`` policies.
    """

    table: PolicyTable
    geometry: ModelGeometry | None
    head_scores: tuple[tuple[float, ...], ...] | None
    run_dir: Path | None
    pca_bases: tuple[str, ...] = ()


def _read_small_json(path: Path, error: type[KvtuneError]) -> Any:
    """The JSON value of a run file of at most :data:`MAX_RUN_FILE_BYTES`."""
    try:
        size = path.stat().st_size
        if size > MAX_RUN_FILE_BYTES:
            raise error(f"{path}: {size} bytes; a run file is at most {MAX_RUN_FILE_BYTES}")
        return json.loads(path.read_bytes())
    except (OSError, ValueError, RecursionError) as exc:  # RecursionError: JSON nested too deeply
        raise error(f"{path}: cannot read JSON ({exc})") from None


def _table_and_run_dir(spec: str | os.PathLike[str] | PolicyTable) -> tuple[PolicyTable, Path | None]:
    if isinstance(spec, PolicyTable):
        return spec, None
    if not isinstance(spec, (str, os.PathLike)):
        raise TableError(f"the policy table must be a file or run folder path or a PolicyTable, got {type(spec).__name__}")
    p = Path(spec)
    if p.is_dir():
        for name in _TABLE_FILES:
            if (p / name).is_file():
                return PolicyTable.load(p / name), p
        raise TableError(f"{p}: no {' or '.join(_TABLE_FILES)} in this folder (export the run's table first)")
    table = PolicyTable.load(p)
    run = table.metadata["extra"].get("run")
    info_path = p.parent / "run.json"
    if run is not None and info_path.is_file():
        if run_name(_read_small_json(info_path, ModelMismatchError), p.parent.name) == run:
            return table, p.parent
    return table, None


def _geometry(table: PolicyTable, run_dir: Path | None, model_info: Mapping[str, Any] | None) -> ModelGeometry | None:
    if model_info is not None:
        return ModelGeometry.from_mapping(model_info, "model_info=")
    extra = table.metadata["extra"].get("model_info")
    if extra is not None:
        return ModelGeometry.from_mapping(extra, "the table's metadata (extra.model_info)")
    if run_dir is None or not (run_dir / "run.json").is_file():
        return None
    path = run_dir / "run.json"
    info = _read_small_json(path, ModelMismatchError)
    mi = info.get("model_info") if isinstance(info, dict) else None
    if not isinstance(mi, Mapping):
        return None
    if mi.get("model") not in (None, table.model):
        raise ModelMismatchError(f"{path}: run of model {mi.get('model')!r}, table of {table.model!r}")
    settings = info.get("settings") if isinstance(info.get("settings"), dict) else {}
    return ModelGeometry.from_mapping(mi, str(path), kv_dtype=settings.get("kv_dtype"))


def _head_scores(run_dir: Path | None, head_scores: Any) -> tuple[tuple[float, ...], ...] | None:
    from kvtune.codecs.mixhq import normalize_head_scores

    source = "head_scores="
    if head_scores is None:
        path = None if run_dir is None else run_dir / "calibration.json"
        if path is None or not path.is_file():
            return None
        doc = _read_small_json(path, CalibrationError)
        head_scores = doc.get("head_scores", {}).get("scores") if isinstance(doc, dict) else None
        if head_scores is None:
            raise CalibrationError(f"{path}: no head_scores.scores")
        source = str(path)
    try:
        return normalize_head_scores(head_scores)
    except ConfigError as exc:
        raise CalibrationError(f"{source}: {exc}") from None


def load_pca_bases(run_dir: Path | None) -> tuple[str, ...]:
    """Load and register the PCA bases ``calibration.json`` records (``pca_bases.<rope>``:
    ``digest``, ``file`` in the run folder); their digests."""
    from kvtune.codecs.pca import load_basis, register_basis

    path = None if run_dir is None else run_dir / "calibration.json"
    if path is None or not path.is_file():
        return ()
    doc = _read_small_json(path, CalibrationError)
    entries = doc.get("pca_bases") if isinstance(doc, dict) else None
    if entries is None:
        return ()
    if not isinstance(entries, dict) or not all(isinstance(e, dict) and isinstance(e.get("digest"), str)
                                                and isinstance(e.get("file"), str) for e in entries.values()):
        raise CalibrationError(f"{path}: pca_bases must map rope modes to {{digest, file}} objects")
    digests = []
    for entry in entries.values():
        try:
            basis = load_basis(run_dir / Path(entry["file"]).name, expect=entry["digest"])
        except BasisError as exc:
            raise CalibrationError(f"{path}: {exc}") from None
        digests.append(register_basis(basis))
    return tuple(digests)


def pca_problems(config: PolicyConfig) -> list[str]:
    """Digests of the PCA bases ``config`` names that are not registered in this process."""
    from kvtune.codecs.pca import registered_digests

    named = {getattr(c, "basis", "") for c in (*config.transforms, config.key, config.value)} - {""}
    return sorted(named - set(registered_digests()))


def load_artifacts(
    table: str | os.PathLike[str] | PolicyTable,
    *,
    model_info: Mapping[str, Any] | None = None,
    head_scores: Any = None,
) -> ServingArtifacts:
    """Load a policy table and the run files that belong to it (see the module docstring).

    Args:
        table: a table file (``.json``/``.parquet``), a run folder, or a loaded table.
        model_info: geometry of the profiled model (``num_layers``, ``kv_heads``,
            ``head_dim``, ``dtype``), overriding what the run records.
        head_scores: MixHQ scores ``[layer][kv_head]`` (nested lists or a ``(layers,
            kv_heads)`` tensor), overriding the run's ``calibration.json``.

    Raises:
        TableError: the table is missing or malformed, or ``table`` is not a path or table.
        ModelMismatchError: ``run.json`` belongs to another model or its geometry is malformed;
            ``model_info`` or the table's ``extra.model_info`` is malformed.
        CalibrationError: the calibration file or ``head_scores`` is malformed, or a PCA basis
            file it names is missing, malformed or not the recorded digest.
    """
    tbl, run_dir = _table_and_run_dir(table)
    return ServingArtifacts(tbl, _geometry(tbl, run_dir, model_info), _head_scores(run_dir, head_scores), run_dir,
                            load_pca_bases(run_dir))


def selection_problem(config: PolicyConfig) -> str | None:
    """Why ``config`` cannot be served, as token selection (``keep``, :mod:`kvtune.codecs.select`),
    or ``None``: the connector writes decoded KV into vLLM's paged cache, one slot per context
    position, which cannot hold a shortened cache."""
    if selecting_transform(config) is None:
        return None
    return (f"policy {config.label} selects tokens (keep): its decoded cache holds fewer positions than the "
            "context, and vLLM's paged KV cache (which the connector fills) holds every position; serve a policy "
            "without keep")


def basis_problem(config: PolicyConfig) -> str | None:
    """Why ``config`` cannot encode in this process for want of a PCA basis, or ``None``: a
    ``pca`` transform without a basis (never calibrated), naming one that is not loaded
    (:func:`kvtune.serving.load_pca_bases` loads a run's), or a ``dp-alloc`` model-wide budget
    on a basis without per-layer sensitivity. Found when a policy is set up, not at its first
    transfer."""
    for t in config.transforms:
        if not isinstance(t, PCA):
            continue
        if not t.basis:
            return f"policy {config.label} has a pca transform without a basis: calibrate it in a profile run"
        try:
            basis = lookup(t.basis)
        except BasisNotLoadedError as exc:
            return f"policy {config.label}: {exc}"
        for quant, kind in ((config.key, "key"), (config.value, "value")):
            if getattr(quant, "budget", "layer") == "model":
                try:
                    basis.layer_sensitivity(kind)
                except BasisError as exc:
                    return f"policy {config.label}: {exc}"
    return None


def policy_configs(
    table: PolicyTable, q_min: float, *, key: str = "", head_scores: tuple[tuple[float, ...], ...] | None = None
) -> dict[str, PolicyConfig]:
    """The runnable :class:`~kvtune.codecs.PolicyConfig` of every policy the accuracy bucket of
    ``q_min`` can select (envelope policies and their runners-up), by table policy id.

    ``"none"`` maps to :meth:`PolicyConfig.uncompressed` (raw bfloat16: exact for bfloat16 KV,
    rounded for float32/float16 KV). A ``mixhq`` policy whose configuration carries no head
    scores gets ``head_scores``; its stream then names the filled-in policy's own id (the id
    covers the scores), while decisions keep the table's id.

    Raises:
        TableError: a policy of a method other than :data:`SERVABLE_METHODS`, a configuration
            that does not parse or is not the configuration of its ``policy_id`` (an edited
            table: the id is the hash of the configuration), a policy listed with two different
            configurations (as a row and as a runner-up), or no bucket for ``q_min`` / ``key``.
        CalibrationError: a ``mixhq`` policy without head scores and none given, or a ``pca``
            policy whose basis is not loaded (:func:`pca_problems`).
        TableError: also a token-selecting (``keep``) policy (:func:`selection_problem`).
    """
    floor = table.floor_for(q_min, key=key)
    rows = table.intervals(floor, key=key)
    entries: dict[str, tuple[str, str, str]] = {}
    for row in rows.to_dict("records"):
        listed = [(row["policy_id"], row["method"], row["label"], row["config_json"])]
        listed += [(p["policy_id"], p["method"], p["label"], p["config_json"]) for p in json.loads(row["runner_up_policies"])]
        for pid, *entry in listed:
            if entries.setdefault(pid, tuple(entry)) != tuple(entry):
                raise TableError(f"policy {pid} is listed twice with different method/label/config_json (an edited table)")
    out: dict[str, PolicyConfig] = {}
    for pid, (method, label, config_json) in entries.items():
        if pid == NONE_POLICY_ID:
            out[pid] = PolicyConfig.uncompressed()
            continue
        if method not in SERVABLE_METHODS:
            raise TableError(
                f"policy {pid} ({label}) is a {method!r} policy; the serving runtime encodes only "
                f"{list(SERVABLE_METHODS)} policies (profile with the tqc method, or pick another floor/key)"
            )
        try:
            config = PolicyConfig.from_json(config_json)
        except (ConfigError, TypeError, ValueError, OverflowError, RecursionError) as exc:
            raise TableError(f"policy {pid} ({label}): configuration does not parse: {str(exc)[:500]}") from None
        if config.policy_id != pid:
            raise TableError(f"policy {pid} ({label}): its config_json is the configuration of policy {config.policy_id} "
                             "(an edited table: a policy id is the hash of its configuration)")
        problem = selection_problem(config)
        if problem is not None:
            raise TableError(f"policy {pid}: {problem} (profile a table without keep, or pick another floor/key)")
        if config.needs_head_scores:
            if head_scores is None:
                raise CalibrationError(
                    f"policy {pid} ({label}) is a mixhq policy without head scores, and no calibration was "
                    "found: keep the run's calibration.json beside the table (or load the run folder), or "
                    "pass head_scores="
                )
            config = config.with_head_scores(head_scores)
        if config.needs_codebooks:
            raise CalibrationError(
                f"policy {pid} ({label}) has calibrated codebook levels without their codebooks: a profile run "
                "stores them in each policy's configuration, so this table was not written by one (fill them in "
                "with PolicyConfig.with_codebooks)")
        missing = pca_problems(config)
        if missing:
            raise CalibrationError(
                f"policy {pid} ({label}) uses PCA basis {missing[0]}, which is not loaded: keep the run's "
                "calibration.json and pca_basis*.safetensors beside the table (or load the run folder), or "
                "register it with kvtune.codecs.pca.register_basis(load_basis(path))")
        out[pid] = config
    return out


def codebook_problems(configs: Mapping[str, PolicyConfig], *, num_layers: int) -> list[str]:
    """Policies whose calibrated codebooks (``codebook`` with ``levels="calibrated"``) do not
    cover exactly ``num_layers`` layers (empty when all do or none has them)."""
    out = []
    for pid, config in configs.items():
        for slot in ("key", "value"):
            books = getattr(getattr(config, slot), "codebooks", None)
            if books and len(books) != num_layers:
                out.append(f"policy {pid} has {slot} codebooks for {len(books)} layers")
    return out


def mixhq_problems(configs: Mapping[str, PolicyConfig], *, num_layers: int, kv_heads: int) -> list[str]:
    """Policies whose MixHQ head scores do not cover ``num_layers`` x ``kv_heads`` (empty when
    all do or none uses scores)."""
    out = []
    for pid, config in configs.items():
        for slot in ("key", "value"):
            scores = getattr(getattr(config, slot), "head_scores", None)
            if scores and (len(scores) != num_layers or any(len(row) != kv_heads for row in scores)):
                shape = f"{len(scores)} layers x {sorted({len(r) for r in scores})} heads"
                out.append(f"policy {pid} has mixhq head scores for {shape}")
    return out

