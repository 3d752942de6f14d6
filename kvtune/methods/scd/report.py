"""The SCD part of a run's HTML report: quality vs payload and predicted TTFT per transfer family.

SCD ("Semantic Cache Distillation: Efficient State Transfer via Reuse and Selective Patching",
arXiv 2606.07684) competes with four other ways to give the consumer its KV: ``recompute``,
``raw`` (the producer's KV as it is), ``raw+tqc`` (compressed by a T/Q/C policy) and
``droidspeak`` (reuse all but a recomputed block of layers). A *family* is one of those
methods, and for SCD one code width (``scd bf16 codes``, ``scd 4-bit codes``...), so the
ranks of one width form a curve.

Plot data first (tidy DataFrames from the trial rows, :func:`quality_points`,
:func:`family_ttft`), then figures (:mod:`kvtune.report.sections`); the display tables
(:func:`configuration_rows`, :func:`front_rows`) are also the run's ``summary.md``.

Units: bytes; seconds (``ttft_ms`` in milliseconds); link bandwidth in Gbps (1e9 bits/s);
accuracies in percent.
"""

from __future__ import annotations

import html
import json
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pandas as pd

from kvtune.report.sections import ReportSection, figure_series

__all__ = ["configuration_rows", "family_ttft", "front_rows", "quality_points", "scd_sections", "transfer_family"]

#: Link bandwidths of the TTFT charts, Gbps (log grid).
TTFT_RANGE_GBPS: tuple[float, float] = (0.1, 400.0)


def _config(text: Any) -> dict[str, Any]:
    try:
        cfg = json.loads(str(text))
    except ValueError:
        return {}
    return cfg if isinstance(cfg, dict) else {}


def transfer_family(trials: pd.DataFrame) -> pd.Series:
    """The family of each trial row: its ``method``, and for ``scd`` the code width
    (``"scd bf16 codes"`` for 16 bits, ``"scd <b>-bit codes"`` otherwise; rows stored before
    code widths existed are bf16)."""
    out = []
    for method, cfg in zip(trials["method"].astype(str), trials["config_json"], strict=True):
        if method == "scd":
            bits = int(_config(cfg).get("code_bits", 16))
            out.append("scd bf16 codes" if bits == 16 else f"scd {bits}-bit codes")
        else:
            out.append(method)
    return pd.Series(out, index=trials.index, dtype=object)


def _accuracy(trials: pd.DataFrame, column: str) -> np.ndarray:
    """Percent values of ``column``, falling back to ``relative_accuracy`` on rows without it."""
    base = pd.to_numeric(trials["relative_accuracy"], errors="coerce")
    if column in trials.columns:
        base = pd.to_numeric(trials[column], errors="coerce").fillna(base)
    return 100.0 * base.to_numpy(dtype=float)


def quality_points(trials: pd.DataFrame) -> pd.DataFrame:
    """Relative accuracy vs payload per configuration, one row each, by family then payload.

    Args:
        trials: SCD trial rows (:func:`kvtune.methods.scd.profile.trial_row`).

    Returns:
        Columns ``family``, ``label`` (str), ``payload_bytes`` (float, bytes sent per prefix),
        ``compression_ratio`` (KV bytes / payload), ``accuracy_pct`` (the unclipped estimate
        ``relative_accuracy_raw``, %), ``accuracy_lo_pct``/``accuracy_hi_pct`` (95 % paired
        bootstrap interval, %; the estimate where a row has none), ``rank`` (SCD rank, 0 for
        other methods), ``code_bits`` (SCD code width, 0 otherwise) and ``hover`` (escaped HTML).
    """
    cfgs = [_config(c) for c in trials["config_json"]]
    out = pd.DataFrame({
        "family": transfer_family(trials).to_numpy(),
        "label": trials["label"].astype(str).to_numpy(),
        "payload_bytes": pd.to_numeric(trials["payload_bytes"], errors="coerce").to_numpy(dtype=float),
        "compression_ratio": pd.to_numeric(trials["compression_ratio"], errors="coerce").to_numpy(dtype=float),
        "accuracy_pct": _accuracy(trials, "relative_accuracy_raw"),
        "accuracy_lo_pct": _accuracy(trials, "relative_accuracy_lo"),
        "accuracy_hi_pct": _accuracy(trials, "relative_accuracy_hi"),
        "rank": [max(c.get("ranks") or [0]) if c.get("method") == "scd" else 0 for c in cfgs],
        "code_bits": [int(c.get("code_bits", 16)) if c.get("method") == "scd" else 0 for c in cfgs],
    })
    out["hover"] = [
        f"<b>{html.escape(r.label)}</b><br>{html.escape(r.family)}<br>payload {r.payload_bytes:,.0f} B "
        f"(ratio {r.compression_ratio:.3g}x)<br>relative accuracy {r.accuracy_pct:.2f} % "
        f"[{r.accuracy_lo_pct:.2f}, {r.accuracy_hi_pct:.2f}]"
        for r in out.itertuples()
    ]
    return out.sort_values(["family", "payload_bytes"], kind="stable").reset_index(drop=True)


def family_ttft(trials: pd.DataFrame, floors: Sequence[float], gate: str, *,
                bandwidth_range_gbps: tuple[float, float] = TTFT_RANGE_GBPS, points: int = 64) -> pd.DataFrame:
    """Predicted TTFT of the fastest configuration of each family that reaches each floor, vs
    link bandwidth: ``min over configurations of latency_a_s + payload_bytes * 8 / (B * 1e9)``
    (:func:`kvtune.methods.scd.methods.ttft_seconds`).

    Args:
        trials: SCD trial rows.
        floors: accuracy floors (fractions), e.g. the policy table's.
        gate: the column held to the floors (the table's, :func:`kvtune.tables.run.interval_gate`).
        bandwidth_range_gbps: ``(low, high)`` link Gbps; points: log-grid size.

    Returns:
        Columns ``floor`` (fraction), ``family``, ``bandwidth_gbps`` (ascending per floor and
        family), ``ttft_ms`` (ms), ``label`` (the fastest configuration there) and ``hover``.
        A family with no configuration at a floor has no rows for it.
    """
    fam = transfer_family(trials).to_numpy()
    gate_v = pd.to_numeric(trials[gate], errors="coerce").to_numpy(dtype=float)
    a = pd.to_numeric(trials["latency_a_s"], errors="coerce").to_numpy(dtype=float)
    payload = pd.to_numeric(trials["payload_bytes"], errors="coerce").to_numpy(dtype=float)
    labels = trials["label"].astype(str).to_numpy()
    bw = np.geomspace(*bandwidth_range_gbps, max(2, int(points)))
    frames = []
    for floor in floors:
        for family in dict.fromkeys(fam):
            sel = np.flatnonzero((fam == family) & (gate_v >= floor) & np.isfinite(a) & np.isfinite(payload))
            if not len(sel):
                continue
            t = a[sel][:, None] + payload[sel][:, None] * 8.0 / (bw[None, :] * 1e9)
            best = t.argmin(axis=0)
            lab = labels[sel][best]
            ms = 1e3 * t[best, np.arange(len(bw))]
            frames.append(pd.DataFrame({
                "floor": float(floor), "family": family, "bandwidth_gbps": bw, "ttft_ms": ms, "label": lab,
                "hover": [f"{html.escape(family)}: {html.escape(s)}<br>{b:.3g} Gbps: {v:.4g} ms"
                          for s, b, v in zip(lab, bw, ms, strict=True)],
            }))
    cols = ["floor", "family", "bandwidth_gbps", "ttft_ms", "label", "hover"]
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(columns=cols)


def configuration_rows(trials: pd.DataFrame, bandwidths: Sequence[float]) -> pd.DataFrame:
    """Display table (strings): per configuration its method, label, relative accuracy with
    the 95 % interval, payload bytes, ratio, ``a`` (s) and the TTFT at each bandwidth (ms)."""
    rows = []
    for _, r in trials.iterrows():
        row = {
            "method": str(r["method"]), "configuration": str(r["label"]),
            "relative accuracy [95 % CI]": f"{100 * r['relative_accuracy_raw']:.2f} % "
                                           f"[{100 * r['relative_accuracy_lo']:.2f}, {100 * r['relative_accuracy_hi']:.2f}]",
            "payload bytes": f"{r['payload_bytes']:,.0f}", "ratio": f"{r['compression_ratio']:.1f}",
            "a (s)": f"{r['latency_a_s']:.4f}",
        }
        row.update({f"TTFT @ {b:g} Gbps (ms)": f"{1e3 * r[f'ttft_s_at_{b:g}gbps']:.2f}" for b in bandwidths})
        rows.append(row)
    return pd.DataFrame(rows)


def front_rows(front: Sequence[Mapping[str, Any]]) -> pd.DataFrame:
    """Display table (strings) of :func:`kvtune.methods.scd.profile.front_summary`: per
    (bandwidth, floor) the fastest configuration, its TTFT, the speed-up over recompute, the
    best non-SCD and SCD configurations and SCD's gain."""
    cols = ["bandwidth (Gbps)", "floor", "fastest", "TTFT (ms)", "x recompute", "best non-SCD", "best SCD", "SCD gain"]
    return pd.DataFrame([[f"{f['bandwidth_gbps']:g}", f"{f['floor']:.2f}", f"{f['best_label']}",
                          f"{1e3 * f['ttft_s']:.2f}", f"{f['speedup_vs_recompute']:.2f}", f"{f['best_non_scd_label']}",
                          f"{f['best_scd_label']}", f"{f['scd_speedup_vs_best_non_scd']:.2f}"] for f in front],
                        columns=cols)


def scd_sections(trials: pd.DataFrame, info: Mapping[str, Any], floors: Sequence[float], gate: str,
                 bandwidths: Sequence[float]) -> list[ReportSection]:
    """The SCD report sections: relative accuracy vs payload per family (div
    ``kvtune-scd-accuracy-vs-payload``), predicted TTFT vs bandwidth per family at each floor
    (``kvtune-scd-ttft-<k>``, floors in ``floors`` order), and the configuration and
    fastest-per-bandwidth tables of ``summary.md``."""
    points = quality_points(trials)
    quality = figure_series(points, x="payload_bytes", y="accuracy_pct", group="family", hover="hover",
                            error=("accuracy_lo_pct", "accuracy_hi_pct"), log_x=True,
                            title="Relative accuracy vs payload per transfer family (SCD: one curve per code width)",
                            x_title="payload bytes per prefix (log)", y_title="relative accuracy vs recompute (%)",
                            hlines=[(100.0 * f, f"floor {100 * f:g} %") for f in floors])
    curves = family_ttft(trials, floors, gate)
    ttft = []
    for k, floor in enumerate(floors):
        sub = curves[curves["floor"] == floor]
        ttft.append((f"kvtune-scd-ttft-{k}", figure_series(
            sub, x="bandwidth_gbps", y="ttft_ms", group="family", hover="hover", mode="lines", log_x=True, log_y=True,
            title=f"Accuracy floor {100 * floor:g} %: predicted TTFT of each family's fastest configuration",
            x_title="link bandwidth (Gbps)", y_title="time to first token (ms)")))
    return [
        ReportSection(
            "SCD transfer methods: quality vs payload",
            note="Relative accuracy = ppl_recompute / ppl_method on the held-out continuation, with the 95 % "
                 "paired-bootstrap interval over prefixes; payload = mean bytes sent per prefix.",
            figures=(("kvtune-scd-accuracy-vs-payload", quality),)),
        ReportSection(
            "SCD transfer methods: predicted TTFT vs bandwidth",
            note=f"TTFT = producer + consumer seconds + payload * 8 / B; per family the fastest configuration "
                 f"whose {gate} reaches the floor (the policy table's gate).",
            figures=tuple(ttft),
            tables=(("Configurations: quality, payload, predicted TTFT", configuration_rows(trials, bandwidths)),
                    ("Fastest configuration per bandwidth and floor", front_rows(info.get("front") or [])))),
    ]
