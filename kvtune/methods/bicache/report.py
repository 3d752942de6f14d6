"""The BiCache part of a run's HTML report: safe reuse depth, per-layer cosines, throughput gain.

BiCache ("Enabling KV Caching of Shared Prefix for Diffusion Language Models", arXiv
2606.07571) reuses a shared prefix's cached K/V in layers ``1..d``. Per prefix-ratio bucket the
report shows the chosen (safe) depth, the quality criteria vs depth against their floors (the
prefix-KV cosine threshold first), the per-layer cosine of the prefix K/V cached alone vs in
context (heatmaps), and the measured throughput gain per depth.

Plot data first (tidy DataFrames from the run's frames: ``depth_table``, ``quality``,
``layer_cosine``, ``throughput``), then figures (:mod:`kvtune.report.sections`); the display
tables (:func:`depth_rows`, :func:`pivot_rows`) are also the run's ``summary.md``.
"""

from __future__ import annotations

import html
from collections.abc import Mapping
from typing import Any

import pandas as pd

from kvtune.methods.bicache.quality import EXACT
from kvtune.methods.bicache.stats import CRITERIA
from kvtune.report.sections import ReportSection, figure_heatmap, figure_series

__all__ = ["bicache_sections", "depth_rows", "exact_quality", "layer_matrix", "pivot_rows", "throughput_gain"]


def _fmt_iv(m: float, lo: float, hi: float, digits: int = 3) -> str:
    return f"{m:.{digits}f} [{lo:.{digits}f}, {hi:.{digits}f}]"


def depth_rows(depth_table: pd.DataFrame) -> pd.DataFrame:
    """Display table (strings) of prefix ratio -> chosen reuse depth: per bucket the ratio
    range and mean, depth / layers, the quality intervals at that depth (95 % bootstrap), the
    requests/s of recompute and reuse, the gain and the share of token-layer evaluations."""
    cols = ["prefix ratio", "mean ratio", "depth", "KV cosine", "embedding cosine", "relative retrieval",
            "req/s recompute", "req/s reuse", "gain", "token-layers"]
    return pd.DataFrame([[
        f"[{r['prefix_ratio_lo']:.2f}, {r['prefix_ratio_hi']:.2f})", f"{r['ratio_mean']:.2f}",
        f"{r['chosen_depth']}/{r['num_layers']}", _fmt_iv(r["kv_cosine"], r["kv_cosine_lo"], r["kv_cosine_hi"]),
        _fmt_iv(r["embedding_cosine"], r["embedding_cosine_lo"], r["embedding_cosine_hi"], 4),
        _fmt_iv(r["relative_retrieval"], r["relative_retrieval_lo"], r["relative_retrieval_hi"]),
        f"{r['requests_per_s_recompute']:.1f}", f"{r['requests_per_s_reuse']:.1f}", f"{r['speedup']:.2f}x",
        f"{r['token_layer_fraction']:.2f}"] for r in depth_table.to_dict("records")], columns=cols)


def pivot_rows(frame: pd.DataFrame, columns: str, values: str, head: str, cell: str) -> pd.DataFrame:
    """Display table (strings) of ``frame`` pivoted to prefix-ratio keys x ``columns``
    (``head.format(column value)`` headers, ``cell.format(value)`` cells)."""
    piv = frame.pivot(index="key", columns=columns, values=values)
    return pd.DataFrame([[str(key), *(cell.format(v) for v in row.to_numpy())] for key, row in piv.iterrows()],
                        columns=["prefix ratio", *(head.format(c) for c in piv.columns)])


def exact_quality(quality: pd.DataFrame, depth_table: pd.DataFrame) -> pd.DataFrame:
    """Quality of the exact cache vs reuse depth, per bucket, with the bucket's chosen depth.

    Returns:
        Columns ``key``, ``depth`` (ascending per key), each criterion's held statistic
        (``CRITERIA[c].column()``: ``kv_cosine_lo``, ``embedding_cosine_lo``,
        ``relative_retrieval``), ``chosen_depth`` and ``hover`` (escaped HTML).
    """
    stats = [CRITERIA[c].column() for c in CRITERIA]
    ex = quality[quality["policy"].isin([EXACT, "recompute"])][["key", "depth", *stats]]
    chosen = dict(zip(depth_table["key"], depth_table["chosen_depth"], strict=True))
    out = ex.sort_values(["key", "depth"], kind="stable").reset_index(drop=True)
    out["chosen_depth"] = [int(chosen[k]) for k in out["key"]]
    out["hover"] = [
        f"<b>{html.escape(str(r['key']))}</b>, depth {int(r['depth'])} (safe depth {r['chosen_depth']})<br>"
        + "<br>".join(f"{html.escape(s)} {float(r[s]):.4f}" for s in stats)
        for r in out.to_dict("records")
    ]
    return out


def layer_matrix(layer_cosine: pd.DataFrame, kind: str) -> pd.DataFrame:
    """Bucket x layer matrix of the mean ``<kind>_cosine`` (``kind``: ``key``, ``value`` or
    ``hidden``) of the prefix state cached alone vs computed in context."""
    return layer_cosine.pivot(index="key", columns="layer", values=f"{kind}_cosine")


def throughput_gain(throughput: pd.DataFrame, depth_table: pd.DataFrame) -> pd.DataFrame:
    """Measured throughput gain per bucket and depth: columns ``key``, ``depth``, ``speedup``
    (median requests/s at the depth / at full recompute), ``requests_per_s`` and ``hover``."""
    chosen = dict(zip(depth_table["key"], depth_table["chosen_depth"], strict=True))
    out = throughput[["key", "depth", "speedup", "requests_per_s"]].sort_values(["key", "depth"], kind="stable")
    out = out.reset_index(drop=True)
    out["hover"] = [f"<b>{html.escape(str(r['key']))}</b>, depth {int(r['depth'])}"
                    f"{' (safe depth)' if int(r['depth']) == int(chosen[r['key']]) else ''}<br>"
                    f"{r['requests_per_s']:.1f} req/s, gain {r['speedup']:.2f}x" for r in out.to_dict("records")]
    return out


def summary_tables(frames: Mapping[str, pd.DataFrame]) -> tuple[tuple[str, pd.DataFrame], ...]:
    """The ``(caption, display frame)`` tables of ``summary.md`` and the report, in order."""
    ex = frames["quality"][frames["quality"]["policy"].isin([EXACT, "recompute"])]
    return (
        ("Prefix ratio -> reuse depth", depth_rows(frames["depth_table"])),
        ("Throughput gain by depth (requests/s with reuse / full recompute)",
         pivot_rows(frames["throughput"], "depth", "speedup", "d={}", "{:.2f}x")),
        ("Quality by depth (exact cache): embedding cosine, lower bound",
         pivot_rows(ex, "depth", "embedding_cosine_lo", "d={}", "{:.4f}")),
        ("Prefix key cosine per layer, prefix alone vs in context (mean)",
         pivot_rows(frames["layer_cosine"], "layer", "key_cosine", "L{}", "{:.3f}")),
    )


def bicache_sections(frames: Mapping[str, pd.DataFrame], floors: Mapping[str, float]) -> list[ReportSection]:
    """The BiCache report sections: safe depth per bucket (div ``kvtune-bicache-depth``),
    criteria vs depth with their floors (``kvtune-bicache-quality-<criterion>``), per-layer
    key/value cosine heatmaps (``kvtune-bicache-layer-cosine-key``/``-value``), throughput gain
    (``kvtune-bicache-throughput``), and the ``summary.md`` tables.

    Args:
        frames: the run's ``depth_table``, ``quality``, ``layer_cosine`` and ``throughput``.
        floors: the depth choice's floors, criterion name -> floor.
    """
    dt = frames["depth_table"].sort_values("key", kind="stable")
    floor_text = ", ".join(f"{CRITERIA[c].column()} >= {f:g}" for c, f in floors.items())
    depth = figure_series(
        dt.assign(series="safe reuse depth", hover=[
            f"<b>{html.escape(str(r['key']))}</b><br>depth {r['chosen_depth']}/{r['num_layers']}<br>"
            f"kv_cosine_lo {r['kv_cosine_lo']:.4f}, embedding_cosine_lo {r['embedding_cosine_lo']:.4f}"
            for r in dt.to_dict("records")]),
        x="key", y="chosen_depth", group="series", hover="hover",
        title=f"Safe reuse depth per prefix-ratio bucket ({floor_text})",
        x_title="prefix-ratio bucket", y_title="reuse depth d (layers)")
    quality = exact_quality(frames["quality"], frames["depth_table"])
    per_criterion = tuple(
        (f"kvtune-bicache-quality-{c}", figure_series(
            quality, x="depth", y=CRITERIA[c].column(), group="key", hover="hover",
            title=f"{CRITERIA[c].column()} vs reuse depth (exact cache), floor {floors[c]:g}",
            x_title="reuse depth d", y_title=CRITERIA[c].column(), hlines=[(floors[c], f"floor {floors[c]:g}")]))
        for c in floors)
    heat = tuple(
        (f"kvtune-bicache-layer-cosine-{kind}", figure_heatmap(
            layer_matrix(frames["layer_cosine"], kind), x_title="layer", y_title="prefix-ratio bucket",
            z_title=f"{kind} cosine", title=f"Prefix {kind} cosine per layer, cached alone vs in context (mean)"))
        for kind in ("key", "value"))
    gain = figure_series(throughput_gain(frames["throughput"], frames["depth_table"]), x="depth", y="speedup",
                         group="key", hover="hover", hlines=[(1.0, "full recompute")],
                         title="Measured throughput gain vs reuse depth", x_title="reuse depth d",
                         y_title="requests/s with reuse / full recompute")
    return [
        ReportSection("BiCache: safe reuse depth per prefix-ratio bucket",
                      note="The deepest depth whose criteria (95 % bootstrap lower bounds for the cosines) stay above "
                           f"every floor: {floor_text}.",
                      figures=(("kvtune-bicache-depth", depth), *per_criterion)),
        ReportSection("BiCache: per-layer cosine of the reused prefix KV",
                      note="Mean cosine of the prefix's keys/values when the prefix is encoded alone (the cache) vs "
                           "inside each request (full recompute), per layer and bucket.",
                      figures=heat),
        ReportSection("BiCache: measured throughput gain",
                      figures=(("kvtune-bicache-throughput", gain),), tables=summary_tables(frames)),
    ]


def summary_markdown_lines(frames: Mapping[str, Any]) -> list[str]:
    """``summary.md``'s tables as Markdown sections (``## caption``, blank, table)."""
    from kvtune.report.sections import markdown_table

    lines: list[str] = []
    for k, (caption, frame) in enumerate(summary_tables(frames)):
        lines += ([] if k == 0 else [""]) + [f"## {caption}", "", *markdown_table(frame)]
    return lines
