"""Plot-data layer of the kvtune report: plain DataFrames, no plotting library.

Each function turns trials, a Pareto front or a policy table into a tidy DataFrame that a
renderer (plotly in :mod:`kvtune.report.html`; matplotlib or a notebook elsewhere) draws
without further computation -- Optuna's pattern of one data layer feeding every backend.

Units: ``accuracy_pct`` is percent; ``codec_seconds_per_gb`` and ``seconds_per_gb`` are seconds
per GB (1e9 bytes) of original bf16 KV; ``bandwidth_gbps`` is link gigabits per second;
``encode_gbps``/``decode_gbps`` are GB/s (1e9 bytes/s) of original KV.
"""

from __future__ import annotations

import html
import json
import math

import numpy as np
import pandas as pd

from kvtune.pareto import add_codec_latency
from kvtune.tables.latency import gbps_to_x_s_per_gb, threshold_gbps
from kvtune.tables.policy_table import NONE_POLICY_ID, PolicyTable

__all__ = [
    "BANDWIDTH_RANGE_GBPS",
    "breakpoints_gbps",
    "envelope_curve",
    "interval_rows",
    "pareto_rows",
    "policy_colors",
    "trial_points",
    "uncompressed_curve",
]

#: Bandwidth axis of the transfer-time charts, link Gbps (log scale).
BANDWIDTH_RANGE_GBPS: tuple[float, float] = (1.0, 400.0)

_PALETTE = (
    "#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd",
    "#8c564b", "#e377c2", "#bcbd22", "#17becf", "#aec7e8",
    "#ffbb78", "#98df8a", "#ff9896", "#c5b0d5", "#c49c94",
)
_NONE_COLOR = "#222222"


def _fmt(v: object, digits: int = 4) -> str:
    try:
        f = float(v)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return str(v)
    if math.isnan(f):
        return "n/a"
    if math.isinf(f):
        return "inf" if f > 0 else "-inf"
    return f"{f:.{digits}g}"


def _text_col(frame: pd.DataFrame, col: str, default: str = "") -> pd.Series:
    if col in frame.columns:
        return frame[col].astype(str)
    return pd.Series([default] * len(frame), index=frame.index, dtype=object)


def trial_points(trials: pd.DataFrame, pareto: pd.DataFrame) -> pd.DataFrame:
    """One row per plottable trial, flagged when it is on the Pareto front.

    Membership is by ``policy_id`` when both frames have it, otherwise by index (as
    returned by :func:`kvtune.pareto.pareto_front`). Trials with a non-finite accuracy,
    ratio or codec latency (failed evaluations) are dropped.

    Args:
        trials: trials frame (``relative_accuracy``, ``compression_ratio``, ``encode_gbps``,
            ``decode_gbps``; ``policy_id``, ``label``, ``method`` optional).
        pareto: the Pareto rows of ``trials``.

    Returns:
        DataFrame with columns ``policy_id``, ``label``, ``method`` (str), ``accuracy_pct``
        (float, %), ``compression_ratio`` (float), ``codec_seconds_per_gb`` (float, s/GB),
        ``encode_gbps``, ``decode_gbps`` (float, GB/s), ``on_front`` (bool), ``hover``
        (str, HTML-escaped multi-line text for tooltips).
    """
    frame = trials if "codec_seconds_per_gb" in trials.columns else add_codec_latency(trials)
    if "policy_id" in frame.columns and "policy_id" in pareto.columns:
        on_front = frame["policy_id"].astype(str).isin(set(pareto["policy_id"].astype(str)))
    else:
        on_front = pd.Series(frame.index.isin(pareto.index), index=frame.index)
    out = pd.DataFrame(
        {
            "policy_id": _text_col(frame, "policy_id"),
            "label": _text_col(frame, "label"),
            "method": _text_col(frame, "method"),
            "accuracy_pct": 100.0 * pd.to_numeric(frame["relative_accuracy"], errors="coerce"),
            "compression_ratio": pd.to_numeric(frame["compression_ratio"], errors="coerce"),
            "codec_seconds_per_gb": pd.to_numeric(frame["codec_seconds_per_gb"], errors="coerce"),
            "encode_gbps": pd.to_numeric(frame["encode_gbps"], errors="coerce"),
            "decode_gbps": pd.to_numeric(frame["decode_gbps"], errors="coerce"),
            "on_front": on_front.to_numpy(dtype=bool),
        },
        index=frame.index,
    )
    finite = np.isfinite(out[["accuracy_pct", "compression_ratio", "codec_seconds_per_gb"]]).all(axis=1)
    out = out[finite].copy()
    out["hover"] = [
        "<br>".join(
            [
                f"<b>{html.escape(r.label)}</b>",
                f"id {html.escape(r.policy_id)} ({html.escape(r.method)})",
                f"accuracy {r.accuracy_pct:.2f} %",
                f"ratio {r.compression_ratio:.3g}x",
                f"codec {r.codec_seconds_per_gb:.3g} s/GB "
                f"(enc {_fmt(r.encode_gbps, 3)} GB/s, dec {_fmt(r.decode_gbps, 3)} GB/s)",
                "Pareto front" if r.on_front else "dominated",
            ]
        )
        for r in out.itertuples()
    ]
    return out.reset_index(drop=True)


def policy_colors(table: PolicyTable) -> dict[str, str]:
    """A stable color per policy id appearing in the table ("none" is near-black).

    Returns:
        dict policy_id -> CSS hex color, the same for a policy in every floor's chart.
    """
    colors: dict[str, str] = {NONE_POLICY_ID: _NONE_COLOR}
    k = 0
    for pid in table.frame["policy_id"]:
        if pid not in colors:
            colors[pid] = _PALETTE[k % len(_PALETTE)]
            k += 1
    return colors


def bandwidth_range_for(table: PolicyTable) -> tuple[float, float]:
    """Plot range in link Gbps: 1-400 Gbps, widened downwards to show every breakpoint.

    On a slow codec device compression pays only below ~1 Gbps; a fixed 1-400 Gbps axis would
    then show nothing but the uncompressed line.
    """
    bws = table.frame["bandwidth_lo_gbps"].to_numpy(dtype=float)
    finite = bws[np.isfinite(bws) & (bws > 0)]
    low = min([BANDWIDTH_RANGE_GBPS[0], *(finite / 3.0)])
    return max(low, 1e-3), BANDWIDTH_RANGE_GBPS[1]


def envelope_curve(
    table: PolicyTable,
    accuracy_floor: float,
    *,
    bandwidth_range_gbps: tuple[float, float] = BANDWIDTH_RANGE_GBPS,
    points_per_interval: int = 48,
) -> pd.DataFrame:
    """Predicted transfer time per GB of KV along the table's envelope, per interval.

    For each interval of the floor that overlaps the bandwidth range, samples
    ``seconds_per_gb = a + b * 8 / bandwidth_gbps`` (KVServe latency model, x = 1/B) on a
    log grid that includes the interval's ends, so segments meet at the breakpoints.

    Args:
        table: compiled policy table.
        accuracy_floor: one of ``table.floors``.
        bandwidth_range_gbps: ``(low, high)`` link Gbps, > 0.
        points_per_interval: samples per interval (>= 2).

    Returns:
        DataFrame with columns ``segment`` (int, interval position), ``policy_id``,
        ``label``, ``method`` (str), ``bandwidth_gbps`` (float, Gbps, ascending within a
        segment), ``seconds_per_gb`` (float, s/GB of original KV).
    """
    lo_range, hi_range = (float(v) for v in bandwidth_range_gbps)
    rows = []
    for k, iv in table.intervals(accuracy_floor).iterrows():
        lo = max(float(iv["bandwidth_lo_gbps"]), lo_range)
        hi = min(float(iv["bandwidth_hi_gbps"]), hi_range)
        if not lo < hi:
            continue
        bw = np.geomspace(lo, hi, max(2, int(points_per_interval)))
        t = float(iv["a_s_per_gb"]) + float(iv["b"]) * np.asarray(gbps_to_x_s_per_gb(bw))
        rows.append(
            pd.DataFrame(
                {
                    "segment": int(k),
                    "policy_id": str(iv["policy_id"]),
                    "label": str(iv["label"]),
                    "method": str(iv["method"]),
                    "bandwidth_gbps": bw,
                    "seconds_per_gb": t,
                }
            )
        )
    if not rows:
        return pd.DataFrame(
            columns=["segment", "policy_id", "label", "method", "bandwidth_gbps", "seconds_per_gb"]
        )
    return pd.concat(rows, ignore_index=True)


def uncompressed_curve(
    *, bandwidth_range_gbps: tuple[float, float] = BANDWIDTH_RANGE_GBPS, points: int = 96
) -> pd.DataFrame:
    """Transfer time per GB of KV sent uncompressed: ``8 / bandwidth_gbps`` seconds.

    Returns:
        DataFrame with ``bandwidth_gbps`` (Gbps, log grid) and ``seconds_per_gb`` (s/GB).
    """
    bw = np.geomspace(*bandwidth_range_gbps, max(2, int(points)))
    return pd.DataFrame({"bandwidth_gbps": bw, "seconds_per_gb": np.asarray(gbps_to_x_s_per_gb(bw))})


def breakpoints_gbps(
    table: PolicyTable,
    accuracy_floor: float,
    *,
    bandwidth_range_gbps: tuple[float, float] = BANDWIDTH_RANGE_GBPS,
) -> list[float]:
    """Breakpoints of one floor's envelope in link Gbps that fall strictly inside the range,
    ascending."""
    lo, hi = bandwidth_range_gbps
    bws = table.intervals(accuracy_floor)["bandwidth_lo_gbps"].to_numpy(dtype=float)
    return sorted(float(v) for v in bws if lo < v < hi)


def pareto_rows(pareto: pd.DataFrame) -> pd.DataFrame:
    """Display table of Pareto policies (strings, already formatted, not escaped).

    Columns: policy, method, policy_id, accuracy %, ratio, encode GB/s, decode GB/s,
    codec s/GB, B* Gbps (bandwidth threshold, ``8 (1 - 1/cr) / (1/enc + 1/dec)``), and
    ``kl_mean``, ``top1_agreement``, ``ppl_ratio``, ``trial`` when present. Order: as given.
    """
    frame = pareto if "codec_seconds_per_gb" in pareto.columns else add_codec_latency(pareto)
    cr = pd.to_numeric(frame["compression_ratio"], errors="coerce").to_numpy(dtype=float)
    enc = pd.to_numeric(frame["encode_gbps"], errors="coerce").to_numpy(dtype=float)
    dec = pd.to_numeric(frame["decode_gbps"], errors="coerce").to_numpy(dtype=float)
    bstar = np.atleast_1d(threshold_gbps(cr, enc, dec)) if len(frame) else np.empty(0)
    out = pd.DataFrame(
        {
            "policy": _text_col(frame, "label").to_numpy(),
            "method": _text_col(frame, "method").to_numpy(),
            "policy_id": _text_col(frame, "policy_id").to_numpy(),
            "accuracy %": [_fmt(100.0 * float(v), 5) for v in frame["relative_accuracy"]],
            "ratio": [_fmt(v) for v in cr],
            "encode GB/s": [_fmt(v) for v in enc],
            "decode GB/s": [_fmt(v) for v in dec],
            "codec s/GB": [_fmt(v) for v in frame["codec_seconds_per_gb"]],
            "B* Gbps": [_fmt(v) for v in bstar],
        }
    )
    for col in ("kl_mean", "top1_agreement", "ppl_ratio"):
        if col in frame.columns:
            out[col] = [_fmt(v) for v in frame[col]]
    if "trial" in frame.columns:
        out["trial"] = frame["trial"].astype(str).to_numpy()
    return out


def interval_rows(table: PolicyTable, accuracy_floor: float) -> pd.DataFrame:
    """Display table of one floor's intervals (strings): bandwidth range in Gbps, x range in
    s/GB, policy, ratio, accuracy %, codec s/GB, B* Gbps, runners-up. High bandwidth first."""
    iv = table.intervals(accuracy_floor)
    return pd.DataFrame(
        {
            "bandwidth Gbps": [
                f"{_fmt(lo)} .. {_fmt(hi)}" for lo, hi in zip(iv["bandwidth_lo_gbps"], iv["bandwidth_hi_gbps"], strict=True)
            ],
            "x = 1/B s/GB": [
                f"[{_fmt(lo)}, {_fmt(hi)})" for lo, hi in zip(iv["x_lo_s_per_gb"], iv["x_hi_s_per_gb"], strict=True)
            ],
            "policy": iv["label"].astype(str).to_numpy(),
            "policy_id": iv["policy_id"].astype(str).to_numpy(),
            "ratio": [_fmt(v) for v in iv["compression_ratio"]],
            "accuracy %": [_fmt(100.0 * v, 5) for v in iv["relative_accuracy"]],
            "codec s/GB": [_fmt(v) for v in iv["a_s_per_gb"]],
            "B* Gbps": [_fmt(v) for v in iv["threshold_gbps"]],
            "runners-up": [", ".join(json.loads(s)) for s in iv["runners_up"]],
        }
    )
