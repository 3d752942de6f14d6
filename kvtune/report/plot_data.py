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

from kvtune.search.pareto import OBJECTIVE_COLUMNS, OBJECTIVE_MAXIMIZE, add_codec_latency, hypervolume, non_dominated_mask
from kvtune.tables.latency import gbps_to_x_s_per_gb, threshold_gbps
from kvtune.tables.policy_table import NONE_POLICY_ID, PolicyTable

__all__ = [
    "BANDWIDTH_RANGE_GBPS",
    "HV_REFERENCE_LOSS",
    "breakpoints_gbps",
    "convergence",
    "preset_names",
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


def preset_names(trials: pd.DataFrame) -> pd.Series:
    """Preset name of each trial, ``""`` for searched (non-preset) policies.

    A trial is a preset when its ``preset`` column (optional, string, null for non-presets)
    holds a name, or when its ``method`` is ``"preset"`` (then the name is its ``label``).

    Returns:
        str Series aligned with ``trials.index``.
    """
    out = pd.Series([""] * len(trials), index=trials.index, dtype=object)
    if "preset" in trials.columns:
        col = trials["preset"]
        named = col.notna() & (col.astype(str).str.strip() != "")
        out[named] = col[named].astype(str)
    if "method" in trials.columns:
        by_method = (trials["method"].astype(str) == "preset") & (out == "")
        out[by_method] = _text_col(trials, "label")[by_method]
    return out


def _components(frame: pd.DataFrame) -> list[str]:
    """Hover lines listing each trial's ``param.*`` components (method-agnostic), escaped."""
    cols = [c for c in frame.columns if c.startswith("param.")]
    if not cols:
        return [""] * len(frame)
    out = []
    for values in frame[cols].itertuples(index=False, name=None):
        items = [
            f"{html.escape(c[len('param.'):])}={html.escape(str(v))}"
            for c, v in zip(cols, values, strict=True)
            if v is not None and not (isinstance(v, float) and math.isnan(v))
        ]
        out.append("<br>".join(", ".join(items[k : k + 3]) for k in range(0, len(items), 3)))
    return out


def trial_points(trials: pd.DataFrame, pareto: pd.DataFrame) -> pd.DataFrame:
    """One row per plottable trial, flagged when it is on the Pareto front.

    Membership is by ``policy_id`` when both frames have it, otherwise by index (as
    returned by :func:`kvtune.search.pareto.pareto_front`). Trials with a non-finite accuracy,
    ratio or codec latency (failed evaluations) are dropped.

    Args:
        trials: trials frame (``relative_accuracy``, ``compression_ratio``, ``encode_gbps``,
            ``decode_gbps``; ``policy_id``, ``label``, ``method`` optional).
        pareto: the Pareto rows of ``trials``.

    Returns:
        DataFrame with columns ``policy_id``, ``label``, ``method`` (str), ``accuracy_pct``
        (float, %), ``compression_ratio`` (float), ``codec_seconds_per_gb`` (float, s/GB),
        ``encode_gbps``, ``decode_gbps`` (float, GB/s), ``threshold_gbps`` (float, link Gbps
        B*), ``on_front`` (bool), ``preset`` (str, ``""`` unless a preset, see
        :func:`preset_names`), ``hover`` (str, HTML-escaped multi-line text for tooltips:
        label, id, method, preset, ``param.*`` components, numbers, front membership).
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
            "preset": preset_names(frame),
            "components": _components(frame),
        },
        index=frame.index,
    )
    with np.errstate(divide="ignore", invalid="ignore"):
        out["threshold_gbps"] = np.atleast_1d(
            threshold_gbps(out["compression_ratio"].to_numpy(float), out["encode_gbps"].to_numpy(float),
                           out["decode_gbps"].to_numpy(float))
        ) if len(out) else np.empty(0)
    finite = np.isfinite(out[["accuracy_pct", "compression_ratio", "codec_seconds_per_gb"]]).all(axis=1)
    out = out[finite].copy()
    out["hover"] = [
        "<br>".join(
            line
            for line in [
                f"<b>{html.escape(r.label)}</b>",
                f"preset <b>{html.escape(r.preset)}</b>" if r.preset else "",
                f"id {html.escape(r.policy_id)} ({html.escape(r.method)})",
                r.components,
                f"accuracy {r.accuracy_pct:.2f} %",
                f"ratio {r.compression_ratio:.3g}x",
                f"codec {r.codec_seconds_per_gb:.3g} s/GB "
                f"(enc {_fmt(r.encode_gbps, 3)} GB/s, dec {_fmt(r.decode_gbps, 3)} GB/s)",
                f"pays below B* = {_fmt(r.threshold_gbps, 3)} Gbps",
                "Pareto front" if r.on_front else "dominated",
            ]
            if line
        )
        for r in out.itertuples()
    ]
    return out.drop(columns=["components"]).reset_index(drop=True)


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
    key: str = "",
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
        key: the extra table key (``""``: an unkeyed table).

    Returns:
        DataFrame with columns ``segment`` (int, interval position), ``policy_id``,
        ``label``, ``method`` (str), ``bandwidth_gbps`` (float, Gbps, ascending within a
        segment), ``seconds_per_gb`` (float, s/GB of original KV).
    """
    lo_range, hi_range = (float(v) for v in bandwidth_range_gbps)
    rows = []
    for k, iv in table.intervals(accuracy_floor, key=key).iterrows():
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
    key: str = "",
) -> list[float]:
    """Breakpoints of one floor's (and table key's) envelope in link Gbps that fall strictly
    inside the range, ascending."""
    lo, hi = bandwidth_range_gbps
    bws = table.intervals(accuracy_floor, key=key)["bandwidth_lo_gbps"].to_numpy(dtype=float)
    return sorted(float(v) for v in bws if lo < v < hi)


def pareto_rows(pareto: pd.DataFrame) -> pd.DataFrame:
    """Display table of Pareto policies (strings, already formatted, not escaped).

    Columns: policy, method, policy_id, preset (only when some row is a preset), accuracy %,
    ratio, encode GB/s, decode GB/s, codec s/GB, B* Gbps (bandwidth threshold, ``8 (1 - 1/cr) / (1/enc + 1/dec)``), and
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
    presets = preset_names(frame)
    if (presets != "").any():
        out.insert(3, "preset", presets.to_numpy())
    for col in ("kl_mean", "top1_agreement", "ppl_ratio"):
        if col in frame.columns:
            out[col] = [_fmt(v) for v in frame[col]]
    if "trial" in frame.columns:
        out["trial"] = frame["trial"].astype(str).to_numpy()
    return out


#: Reference point of :func:`convergence` in normalized loss space (0 = best value seen in the
#: run, 1 = worst), one entry per objective: the nadir plus 10 % of each range.
HV_REFERENCE_LOSS: tuple[float, float, float] = (1.1, 1.1, 1.1)


def convergence(
    trials: pd.DataFrame,
    *,
    bounds: dict[str, tuple[float, float]] | None = None,
) -> pd.DataFrame:
    """Search convergence: hypervolume of the Pareto front found so far vs trial number.

    Objectives (:data:`kvtune.search.pareto.OBJECTIVE_COLUMNS`): relative accuracy up, compression
    ratio up, codec seconds per GB down. Each is mapped to a *loss* in [0, 1]:
    ``(best - v) / (best - worst)`` with ``best``/``worst`` the best and worst finite values
    over all trials of the run (or ``bounds[col] = (worst, best)``), so 0 is the run's best and
    1 its worst. The hypervolume (:func:`kvtune.search.pareto.hypervolume`, exact) of the losses of
    trials ``0..t`` w.r.t. the reference point :data:`HV_REFERENCE_LOSS` = (1.1, 1.1, 1.1) is
    divided by the reference box ``1.1^3``, so it lies in [0, 1]; it never decreases. With
    run-specific bounds, values compare trials of one run; pass the same ``bounds`` to
    compare runs. Failed trials (NaN objective) count as trials but add nothing.

    Args:
        trials: trials frame; order by ``trial`` when present, else row order.
        bounds: optional ``{column: (worst, best)}`` per objective column.

    Returns:
        DataFrame, one row per trial in order: ``trial`` (int), ``hypervolume`` (float,
        normalized, in [0, 1]), ``front_size`` (int, Pareto points so far), ``improved``
        (bool, this trial enlarged the front).
    """
    frame = trials if "codec_seconds_per_gb" in trials.columns else add_codec_latency(trials)
    if "trial" in frame.columns:
        frame = frame.sort_values("trial", kind="mergesort")
    pts = np.column_stack(
        [pd.to_numeric(frame[c], errors="coerce").to_numpy(dtype=np.float64) for c in OBJECTIVE_COLUMNS]
    ) if len(frame) else np.empty((0, 3))
    loss = np.empty_like(pts)
    for j, (col, maximize) in enumerate(zip(OBJECTIVE_COLUMNS, OBJECTIVE_MAXIMIZE, strict=True)):
        v = pts[:, j]
        fin = v[np.isfinite(v)]
        if bounds and col in bounds:
            worst, best = (float(b) for b in bounds[col])
        elif fin.size:
            best, worst = (fin.max(), fin.min()) if maximize else (fin.min(), fin.max())
        else:
            best = worst = 0.0
        span = best - worst
        loss[:, j] = (best - v) / span if span != 0 else np.where(np.isfinite(v), 0.0, np.nan)
    ref = np.asarray(HV_REFERENCE_LOSS, dtype=np.float64)
    box = float(np.prod(ref))
    trial_ids = (
        frame["trial"].to_numpy() if "trial" in frame.columns else np.arange(len(frame))
    )
    hv, sizes, improved = [], [], []
    front = np.empty((0, 3))
    current = 0.0
    for k in range(len(frame)):
        p = loss[k]
        grew = False
        if np.isfinite(p).all():
            cand = np.vstack([front, p[None, :]])
            mask = non_dominated_mask(cand, [False, False, False])
            if mask[-1]:
                grew = True
                front = cand[mask]
                current = hypervolume(front, ref, [False, False, False]) / box
        hv.append(current)
        sizes.append(len(front))
        improved.append(grew)
    return pd.DataFrame(
        {
            "trial": np.asarray(trial_ids, dtype=np.int64),
            "hypervolume": np.asarray(hv, dtype=np.float64),
            "front_size": np.asarray(sizes, dtype=np.int64),
            "improved": np.asarray(improved, dtype=bool),
        }
    )


def interval_rows(table: PolicyTable, accuracy_floor: float, key: str = "") -> pd.DataFrame:
    """Display table of one floor's (and table key's) intervals (strings): bandwidth range in
    Gbps, x range in s/GB, policy, ratio, accuracy %, codec s/GB, B* Gbps, runners-up. High
    bandwidth first."""
    iv = table.intervals(accuracy_floor, key=key)
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
