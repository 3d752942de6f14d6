"""The policy table of a profiling run folder: load, (re)compile with run metadata, export.

A run folder (``profiles/<run>/``, written by :mod:`kvtune.methods.tqc.profile`) holds ``run.json``,
``trials.parquet``, ``pareto.parquet`` and ``policy_table.parquet``/``.json``. This module
turns it into a :class:`~kvtune.tables.policy_table.PolicyTable` whose metadata records the
run name and the KV volume of one profiled request (``kv_bytes_per_request``, the default
volume of ``kvtune select``), and writes it in either format (``kvtune export``).
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pandas as pd

from kvtune.core.jsonio import enc_float
from kvtune.core.errors import KvtuneError
from kvtune.tables.policy_table import PolicyTable

__all__ = [
    "EXPORT_FORMATS",
    "export_run_table",
    "interval_gate",
    "kv_bytes_per_request",
    "load_run_table",
    "read_run_frame",
    "read_run_info",
    "resolve_table",
    "run_method",
    "run_name",
    "run_table_metadata",
    "selection_summary",
    "selection_text",
]

#: ``kvtune export --format`` choices -> file suffix.
EXPORT_FORMATS: dict[str, str] = {"parquet": ".parquet", "json": ".json"}


def read_run_info(run_dir: Path) -> dict[str, Any]:
    """The JSON object of ``<run_dir>/run.json``.

    Raises:
        KvtuneError: missing, unreadable, not JSON or not an object (the message names the file).
    """
    path = run_dir / "run.json"
    if not path.is_file():
        raise KvtuneError(f"{run_dir}: no run.json; is it a kvtune run folder?")
    try:
        info = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise KvtuneError(f"{path}: cannot read run.json ({exc})") from None
    if not isinstance(info, dict):
        raise KvtuneError(f"{path}: run.json must hold a JSON object")
    return info


def interval_gate(pareto: pd.DataFrame, run_info: dict[str, Any] | None = None) -> str:
    """The column a run's floors are gated on: ``relative_accuracy_lo`` (the lower end of the
    95 % interval, so a floor holds with confidence) when the trials have it, else the point
    estimate ``relative_accuracy``.

    Runs with version-1 settings (``run_info["settings"]["version"] == 1``) were compiled on
    the point estimate, before the interval gate existed; their tables recompile the same way.
    """
    settings = (run_info or {}).get("settings")
    if isinstance(settings, dict) and settings.get("version") == 1:
        return "relative_accuracy"
    return "relative_accuracy_lo" if "relative_accuracy_lo" in pareto.columns else "relative_accuracy"


def read_run_frame(path: Path) -> pd.DataFrame:
    """A Parquet file of a run folder as a DataFrame.

    Raises:
        KvtuneError: the file cannot be read (missing, truncated, not Parquet; the message
            names it).
    """
    try:
        return pd.read_parquet(path)
    except Exception as exc:  # pyarrow raises several types for truncated or corrupt files
        raise KvtuneError(f"{path}: cannot read Parquet ({exc})") from None


def kv_bytes_per_request(run_info: dict[str, Any]) -> float | None:
    """Bytes of original bf16 KV of one profiled request (one context), from ``run.json``.

    ``2 (K and V) x num_layers x kv_heads x head_dim x context_tokens x 2 bytes`` (the volume V
    of the KVServe latency model, "KVServe: Service-Aware KV Cache Compression for Communication-Efficient Disaggregated LLM Serving", arXiv 2605.13734); for SmolLM2-135M at 1,024 tokens: 2 x 30 x 3 x 64 x 1024 x 2 = 23,592,960 B.

    Returns:
        bytes (float), or None when the geometry or the context length is missing.
    """
    mi, st = run_info.get("model_info"), run_info.get("settings")
    mi, st = (mi if isinstance(mi, dict) else {}), (st if isinstance(st, dict) else {})
    dims = [mi.get("num_layers"), mi.get("kv_heads"), mi.get("head_dim"), st.get("context_tokens")]
    if not all(isinstance(d, int) and not isinstance(d, bool) and d > 0 for d in dims):
        return None
    layers, kv_heads, head_dim, tokens = dims
    return float(2 * layers * kv_heads * head_dim * tokens * 2)


def run_name(info: Any, folder: str) -> str:
    """The name of a run: what its ``run.json`` (``info``) records as ``settings.run``, else
    (missing, empty or not a string) the name of its ``folder``. Tables carry it, and serving
    pairs a table file with the ``run.json`` beside it when the two agree."""
    settings = info.get("settings") if isinstance(info, dict) else None
    recorded = settings.get("run") if isinstance(settings, dict) else None
    return recorded if isinstance(recorded, str) and recorded else folder


def run_table_metadata(run_dir: str | os.PathLike[str], run_info: dict[str, Any] | None = None) -> dict[str, Any]:
    """Metadata a run's table should carry: ``run`` (the name ``run.json`` records, so that a
    table rebuilt in a renamed or copied folder still finds its ``run.json``; the folder name
    when it records none), ``kv_bytes_per_request`` and ``context_tokens`` when known."""
    run_dir = Path(run_dir)
    info = read_run_info(run_dir) if run_info is None else run_info
    meta: dict[str, Any] = {"run": run_name(info, run_dir.name)}
    kvb = kv_bytes_per_request(info)
    if kvb is not None:
        meta["kv_bytes_per_request"] = kvb
        meta["context_tokens"] = int(info["settings"]["context_tokens"])
    return meta


def load_run_table(
    run_dir: str | os.PathLike[str],
    *,
    floors: Sequence[float] | None = None,
    recompile: bool = False,
) -> PolicyTable:
    """The policy table of a run folder, with the run's metadata.

    Without ``floors`` and ``recompile``, reads ``policy_table.parquet`` (rows unchanged;
    run metadata added where the file lacks it). Otherwise (or when that file is missing)
    compiles it again with the run's method (:meth:`kvtune.run.method.Method.compile_table`:
    T/Q/C from ``pareto.parquet`` or ``trials.parquet``, SCD and BiCache from the stored
    trials) for ``floors`` (default: the run's configured floors), gated like the run itself
    (:func:`interval_gate`: on the lower end of the 95 % interval when the trials have it).

    Args:
        run_dir: a run folder, e.g. ``profiles/smollm2-default``.
        floors: accuracy floors (fractions) to compile for; implies recompilation.
        recompile: recompile even if ``policy_table.parquet`` exists.

    Raises:
        KvtuneError: not a run folder, it has neither a table, a Pareto front nor trials, or
            its ``run.json`` or Parquet files cannot be read (the message names the file).
        TableError: the stored table is malformed, or the floors are invalid.
    """
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise KvtuneError(f"{run_dir}: not a folder (expected a run folder such as profiles/<run>)")
    info = read_run_info(run_dir)
    meta = run_table_metadata(run_dir, info)
    stored = run_dir / "policy_table.parquet"
    if floors is None and not recompile and stored.is_file():
        table = PolicyTable.load(stored)
        missing = {k: v for k, v in meta.items() if k not in table.metadata["extra"]}
        return table.with_metadata(**missing) if missing else table
    return run_method(info, run_dir).compile_table(run_dir, info, floors)


def run_method(info: dict[str, Any], run_dir: Path) -> Any:
    """The registered :class:`~kvtune.run.method.Method` of a run (``run.json``'s ``method``;
    runs written before methods were recorded are ``tqc``).

    Raises:
        KvtuneError: an unknown method (the message names the file and the known methods).
    """
    from kvtune.methods import METHODS

    name = info.get("method") or "tqc"
    if not isinstance(name, str) or name not in METHODS:
        raise KvtuneError(f"{run_dir / 'run.json'}: unknown method {name!r}; known: {METHODS.known()}")
    return METHODS[name]


def export_run_table(
    run_dir: str | os.PathLike[str],
    fmt: str,
    out: str | os.PathLike[str] | None = None,
    *,
    floors: Sequence[float] | None = None,
    recompile: bool = False,
) -> tuple[Path, PolicyTable]:
    """Write a run's policy table as Parquet or JSON, then re-load the file to check it.

    Args:
        run_dir: the run folder.
        fmt: ``"parquet"`` or ``"json"``.
        out: destination file, or a folder to write ``<run name>.policy_table.<parquet|json>``
            into; default: that file name in the current directory. A file's suffix must match
            ``fmt``.
        floors, recompile: see :func:`load_run_table`.

    Returns:
        ``(path written, the re-loaded table)``.

    Raises:
        KvtuneError: unknown format, suffix mismatch, a destination inside the run folder or an
            existing file that is not a policy table (nothing is overwritten), or any error of
            :func:`load_run_table`.
    """
    if fmt not in EXPORT_FORMATS:
        raise KvtuneError(f"unknown format {fmt!r}; use one of {sorted(EXPORT_FORMATS)}")
    run_dir = Path(run_dir)
    suffix = EXPORT_FORMATS[fmt]
    default_name = f"{run_dir.resolve().name}.policy_table{suffix}"
    path = Path(out) if out is not None else Path(default_name)
    if path.is_dir():  # --out names a folder: write the default file name inside it
        path = path / default_name
    if path.suffix.lower() != suffix and not (fmt == "parquet" and path.suffix.lower() == ".pq"):
        raise KvtuneError(f"--out {path}: suffix must be {suffix} for --format {fmt}")
    _check_export_target(path, run_dir)
    table = load_run_table(run_dir, floors=floors, recompile=recompile)
    written = table.to_parquet(path) if fmt == "parquet" else table.to_json(path)
    return written, PolicyTable.load(written)


def _check_export_target(path: Path, run_dir: Path) -> None:
    """Refuse an export destination that would replace stored data: a file inside the run
    folder (its settings, trials, front and own tables), or an existing file that is not a
    policy table.

    Raises:
        KvtuneError: naming the destination.
    """
    if path.parent.resolve() == run_dir.resolve():
        raise KvtuneError(f"--out {path}: inside the run folder, whose files the run owns (run.json, trials, "
                          "pareto.parquet, its policy tables); write the export elsewhere")
    if path.exists():
        try:
            PolicyTable.load(path)
        except Exception as exc:  # whatever a non-table file makes the loader raise
            raise KvtuneError(f"--out {path}: exists and is not a policy table ({exc}); refusing to overwrite it") from None


def resolve_table(spec: str | os.PathLike[str]) -> PolicyTable:
    """A policy table from a ``.parquet``/``.json`` file or a run folder (its table with the
    run's metadata, see :func:`load_run_table`).

    Raises:
        KvtuneError / TableError: not found or malformed.
    """
    p = Path(spec)
    if p.is_dir():
        return load_run_table(p)
    return PolicyTable.load(p)


def selection_summary(sel: Any, volume_source: str) -> dict[str, Any]:
    """A JSON-ready summary of a :class:`~kvtune.tables.policy_table.SelectedPolicy`
    (``kvtune select --json``): chosen policy, predicted seconds, B*, interval, candidates."""
    return {
        "policy_id": sel.policy_id,
        "method": sel.method,
        "label": sel.label,
        "config": json.loads(sel.config_json),
        "accuracy_floor": sel.accuracy_floor,
        "q_min": sel.q_min,
        "key": sel.key,
        "bandwidth_gbps": enc_float(sel.bandwidth_gbps),
        "interval_gbps": [enc_float(sel.bandwidth_lo_gbps), enc_float(sel.bandwidth_hi_gbps)],
        "kv_bytes": sel.kv_bytes,
        "kv_bytes_source": volume_source,
        "predicted_s": sel.predicted_seconds,
        "uncompressed_s": sel.uncompressed_seconds,
        "threshold_gbps": enc_float(sel.threshold_gbps),
        "slo_s": sel.slo_s,
        "slo_violated": sel.slo_violated,
        "candidates": [
            {
                "policy_id": c.policy_id,
                "label": c.policy.label,
                "predicted_s": c.predicted_s,
                "threshold_gbps": enc_float(c.policy.threshold_gbps),
                "status": c.status,
            }
            for c in sel.candidates
        ],
    }


def selection_text(sel: Any, table: PolicyTable, volume_source: str) -> str:
    """Plain-text answer of ``kvtune select``: the chosen policy, its predicted time for the
    KV volume (and where that volume came from), B*, the SLO verdict and the reason
    (:meth:`~kvtune.tables.policy_table.SelectedPolicy.reason`)."""
    from kvtune.core.units import format_bytes, format_seconds

    if sel.policy_id == "none":
        bstar = (
            f"n/a for uncompressed; at this floor compression pays only below {sel.bandwidth_lo_gbps:.4g} Gbps"
            if sel.bandwidth_lo_gbps > 0
            else "n/a for uncompressed; no compressed policy at this floor"
        )
    else:
        bstar = f"{sel.threshold_gbps:.4g} Gbps (compression pays iff bandwidth < B*)"
    lines = [
        f"table      {table.model} / {table.workload} / {table.device}",
        f"policy     {sel.label}  [{sel.policy_id}, method {sel.method}]",
        f"predicted  {format_seconds(sel.predicted_seconds)} for {format_bytes(sel.kv_bytes)} of KV at "
        f"{sel.bandwidth_gbps:.4g} Gbps ({volume_source}); uncompressed {format_seconds(sel.uncompressed_seconds)}",
        f"B*         {bstar}",
    ]
    if sel.slo_s is not None:
        verdict = "VIOLATED (no candidate meets it; fastest returned)" if sel.slo_violated else "met"
        lines.append(f"SLO        {format_seconds(sel.slo_s)}: {verdict}")
    lines += ["reason", *("  " + line for line in sel.reason().splitlines())]
    return "\n".join(lines)
