"""BiCache configurations as policy-table rows (``method = "bicache"``), keyed by prefix ratio.

A fetched prefix cache (BiCache, "Enabling KV Caching of Shared Prefix for Diffusion Language
Models", arXiv 2606.07571) can itself be compressed, so its configurations are rows of the
same policy tables as KV compression, with another key (the prefix-ratio bucket), under the
latency model of KVServe ("KVServe: Service-Aware KV Cache Compression for
Communication-Efficient Disaggregated LLM Serving", arXiv 2605.13734). When the cached prefix
state lives in a remote store, a request at reuse depth ``d`` with codec policy ``p`` costs

    T(B) = compute_s(d) + decode_s(d, p) + wire_bytes(d, p) / B

(``compute_s``: measured encoder seconds per request at depth d; ``decode_s``: measured
payload decode seconds; the payload is encoded once when the prefix is stored, so encoding is
not per request). With the reference volume V = bf16 bytes of the full-depth prefix state
(``prefix_state_bf16_bytes(P, H, L)``, stored as ``kv_bytes_per_request``) and x = 1/B in s/GB,
this is the table's line ``T/V = a + b x`` with

    a = (compute_s + decode_s) / (V / 1e9)   [s/GB]      b = wire_bytes / V.

``d = 0`` (full recompute) sends nothing: ``b = 0``, relative accuracy 1.0; it plays the part
of ``"none"`` in TQC tables and is always a candidate, so every bandwidth has an answer.
Deeper reuse sends more bytes and saves more compute, so full recompute wins at low
bandwidth and deep reuse at high bandwidth; codecs move the lines' slopes.

Column conventions for these rows (schema 1, see :mod:`kvtune.tables.policy_table`):
``compression_ratio = V / wire_bytes`` (= 1/b; inf for d = 0), ``relative_accuracy`` = the
relative top-1 retrieval accuracy (point estimate, capped at 1.0 as in Sec. 6),
``encode_gbps``/``decode_gbps`` = payload codec throughputs in GB/s of the bf16 depth-d state
(inf for d = 0), and ``threshold_gbps = inf``: the TQC rule "pays iff B < B*" does not apply
(reuse pays *above* a bandwidth); that bandwidth is the extra column ``min_bandwidth_gbps``
(reuse at depth d beats full recompute iff the link is faster). Extra columns:
``reuse_depth``, ``codec``, ``prefix_ratio_lo``/``_hi``, ``wire_bytes``,
``compute_s_per_request``, ``decode_s``, ``kv_cosine``, ``embedding_cosine``,
``relative_accuracy_lo``/``_hi``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from typing import Any

import pandas as pd

from kvtune.core.ids import config_policy_id
from kvtune.core.errors import TableError
from kvtune.evaluate.metrics import report_relative_accuracy
from kvtune.tables.policy_table import DEFAULT_FLOORS, PolicyTable, compile_policy_table

__all__ = [
    "EXTRA_COLUMNS",
    "bicache_candidate",
    "bicache_policy_id",
    "compile_bicache_table",
    "line_for",
    "min_bandwidth_gbps",
]

METHOD = "bicache"
#: Extra per-row columns of BiCache table rows (kept by PolicyTable, saved in both formats).
EXTRA_COLUMNS = (
    "reuse_depth", "codec", "prefix_ratio_lo", "prefix_ratio_hi", "wire_bytes", "compute_s_per_request",
    "decode_s", "min_bandwidth_gbps", "kv_cosine", "embedding_cosine", "relative_accuracy_lo", "relative_accuracy_hi",
)


def line_for(compute_s: float, decode_s: float, wire_bytes: float, reference_bytes: float) -> tuple[float, float]:
    """``(a_s_per_gb, b)`` of a reuse configuration: ``a = (compute_s + decode_s) / (V/1e9)``,
    ``b = wire_bytes / V`` (V = ``reference_bytes``).

    >>> line_for(0.01, 0.0, 0.0, 1e6)
    (10.0, 0.0)
    """
    gb = reference_bytes / 1e9
    return (compute_s + decode_s) / gb, wire_bytes / reference_bytes


def min_bandwidth_gbps(compute_s: float, decode_s: float, wire_bytes: float, recompute_s: float) -> float:
    """Link Gbps above which reuse beats full recompute: ``8 wire_bytes / 1e9 / (recompute_s -
    compute_s - decode_s)``; inf when reuse saves no time, 0 when it sends nothing and saves time."""
    saved = recompute_s - compute_s - decode_s
    if saved <= 0:
        return math.inf
    return 8.0 * wire_bytes / 1e9 / saved


def bicache_policy_id(config: Mapping[str, Any]) -> str:
    """12-hex id of a BiCache configuration: :func:`kvtune.core.ids.config_policy_id` (sha256
    of its canonical JSON)."""
    return config_policy_id(config)


def bicache_candidate(
    *,
    bucket_key: str,
    ratio_lo: float,
    ratio_hi: float,
    depth: int,
    codec: str,
    codec_config: Mapping[str, Any] | None,
    model: str,
    prefix_tokens: int,
    reference_bytes: float,
    wire_bytes: float,
    compute_s: float,
    recompute_s: float,
    encode_s: float,
    decode_s: float,
    bf16_bytes: float,
    relative_accuracy: float,
    relative_accuracy_lo: float,
    relative_accuracy_hi: float,
    kv_cosine: float,
    embedding_cosine: float,
) -> dict[str, Any]:
    """One candidate row (the ``pareto`` frame of :func:`compile_bicache_table`).

    Args:
        depth: reuse depth d (0 = full recompute; then ``codec`` is ``"none"``).
        codec: codec policy name; ``codec_config`` its ``PolicyConfig.to_dict()``.
        reference_bytes: V, bytes (bf16 full-depth prefix state).
        wire_bytes: payload bytes sent at this depth and codec (0 for d = 0).
        compute_s, recompute_s: measured seconds per request at depth d and at d = 0.
        encode_s, decode_s: measured payload codec seconds (per prefix / per request).
        bf16_bytes: bf16 bytes of the depth-d state (codec throughputs are per these bytes).
        relative_accuracy*: relative retrieval accuracy and its interval (fractions).
        kv_cosine, embedding_cosine: quality (a) and (b), means.
    """
    cfg = {
        "method": METHOD, "model": model, "reuse_depth": int(depth), "codec": codec,
        "codec_policy": dict(codec_config) if codec_config else None, "prefix_tokens": int(prefix_tokens),
        "prefix_ratio": [float(ratio_lo), float(ratio_hi)],
    }
    a, b = line_for(compute_s, decode_s if depth else 0.0, wire_bytes if depth else 0.0, reference_bytes)
    label = "bicache d=0 (full recompute)" if depth == 0 else f"bicache d={depth} + {codec}"
    enc = bf16_bytes / 1e9 / encode_s if depth and encode_s > 0 else math.inf
    dec = bf16_bytes / 1e9 / decode_s if depth and decode_s > 0 else math.inf
    return {
        "policy_id": bicache_policy_id(cfg),
        "method": METHOD,
        "label": label,
        "config_json": json.dumps(cfg, sort_keys=True),
        "key": bucket_key,
        "a_s_per_gb": a,
        "b": b,
        "compression_ratio": math.inf if b == 0 else 1.0 / b,
        "relative_accuracy": 1.0 if depth == 0 else report_relative_accuracy(float(relative_accuracy)),
        "relative_accuracy_lo": 1.0 if depth == 0 else float(relative_accuracy_lo),
        "relative_accuracy_hi": 1.0 if depth == 0 else float(relative_accuracy_hi),
        "encode_gbps": enc,
        "decode_gbps": dec,
        "threshold_gbps": math.inf,
        "reuse_depth": int(depth),
        "codec": codec if depth else "none",
        "prefix_ratio_lo": float(ratio_lo),
        "prefix_ratio_hi": float(ratio_hi),
        "wire_bytes": float(wire_bytes if depth else 0.0),
        "compute_s_per_request": float(compute_s),
        "decode_s": float(decode_s if depth else 0.0),
        "min_bandwidth_gbps": 0.0 if depth == 0 else min_bandwidth_gbps(compute_s, decode_s, wire_bytes, recompute_s),
        "kv_cosine": float(kv_cosine),
        "embedding_cosine": float(embedding_cosine),
    }


def compile_bicache_table(
    candidates: pd.DataFrame,
    *,
    model: str,
    workload: str,
    device: str,
    floors: Sequence[float] = DEFAULT_FLOORS,
    n_runners_up: int = 2,
    metadata: Mapping[str, Any] | None = None,
) -> PolicyTable:
    """Lower envelope of the BiCache lines per (prefix-ratio key, accuracy floor): the shared
    compiler :func:`~kvtune.tables.policy_table.compile_policy_table` keyed by the ``key``
    column, without the implicit ``"none"`` and with the lines as given (``a_s_per_gb``,
    ``b``; module docstring).

    For every key and floor, the candidates are that key's rows with ``relative_accuracy >=
    floor`` (less 1e-12); the depth-0 row (full recompute, accuracy 1.0, ``b = 0``) is among
    them at every floor up to 1.0, so every bandwidth has an answer. Identical lines resolve to
    the higher accuracy, then the shallower depth, then the lower id. Rows follow
    :mod:`kvtune.tables.policy_table` schema 1 with ``method = "bicache"``, the key, and
    :data:`EXTRA_COLUMNS`.

    Raises:
        TableError: no candidates, a key without its depth-0 row, duplicate ids within a key,
            or bad floors (repeated floors count once).
    """
    if candidates.empty:
        raise TableError("no BiCache candidates to compile")
    keys_with_recompute = set(candidates.loc[candidates["reuse_depth"] == 0, "key"].astype(str))
    lacking = sorted(set(candidates["key"].astype(str)) - keys_with_recompute)
    if lacking:
        raise TableError(f"key {lacking[0]!r} has no depth-0 (full recompute) row")
    try:
        distinct = tuple(dict.fromkeys(float(f) for f in floors))
    except (TypeError, ValueError) as exc:
        raise TableError(f"accuracy floors must be numbers: {exc}") from None
    return compile_policy_table(candidates, floors=distinct, model=model, workload=workload, device=device,
                                n_runners_up=n_runners_up, metadata=metadata, key_column="key",
                                include_none=False, extra_columns=EXTRA_COLUMNS, given_lines=True,
                                prefer=("reuse_depth",), tolerance=1e-12)
