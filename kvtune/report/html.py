"""Self-contained HTML report of a profiling run (plotly, opens offline).

Rendering only: every number drawn comes from :mod:`kvtune.report.plot_data`. The page holds

1. a 3-D scatter of all trials (accuracy %, compression ratio, codec s/GB), Pareto points
   highlighted, presets marked with a diamond and their name, hover text with label,
   components (``param.*``) and numbers;
2. two 2-D projections (ratio vs accuracy, ratio vs codec latency), presets marked too;
3. search convergence: normalized hypervolume of the front found so far vs trial number
   (:func:`kvtune.report.plot_data.convergence`);
4. per accuracy floor, predicted transfer time per GB of KV vs link bandwidth (Gbps, log x
   from 1 to 400, widened downwards to show every breakpoint) along the policy-table
   envelope, colored by the chosen policy, with the uncompressed line and the breakpoints
   (KVServe latency model and piecewise table), and the floor's
   intervals as an HTML table;
5. the method's own sections (:meth:`kvtune.run.method.Method.report_sections`,
   :class:`kvtune.report.sections.ReportSection`): its figures and tables;
6. the Pareto policies as a table sortable by clicking a header (a few lines of inline
   JavaScript, no dependency);
7. the run configuration.

plotly.js is embedded inline exactly once (first figure, ``include_plotlyjs=True``); the
others use ``include_plotlyjs=False``. Figure div ids are fixed, so the same inputs give the
same file.
"""

from __future__ import annotations

import html
import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pandas as pd
import plotly.graph_objects as go

from kvtune.report import plot_data as pdl
from kvtune.core.atomic import atomic_write_text
from kvtune.report.sections import ReportSection
from kvtune.tables.policy_table import PolicyTable

__all__ = [
    "figure_convergence",
    "figure_envelope",
    "figure_projection",
    "figure_trials_3d",
    "render_report",
    "write_report",
]

_TEMPLATE = "plotly_white"
_FRONT_COLOR = "#d62728"
_OTHER_COLOR = "#9aa5b1"
_PRESET_COLOR = "#1d3557"

_CSS = """
body { font-family: system-ui, -apple-system, "Segoe UI", sans-serif; margin: 2rem auto;
       max-width: 1200px; color: #1f2933; padding: 0 1rem; }
h1 { font-size: 1.6rem; } h2 { font-size: 1.25rem; margin-top: 2.2rem; }
h3 { font-size: 1.05rem; margin-top: 1.6rem; }
table.kvtune { border-collapse: collapse; font-size: 0.85rem; margin: 0.6rem 0; }
table.kvtune th, table.kvtune td { border: 1px solid #d9e2ec; padding: 0.25rem 0.5rem;
       text-align: left; white-space: nowrap; }
table.kvtune th { background: #f0f4f8; }
table.sortable th { cursor: pointer; user-select: none; }
table.sortable th[data-dir="asc"]::after { content: " \\25B2"; }
table.sortable th[data-dir="desc"]::after { content: " \\25BC"; }
.fig { margin: 0.5rem 0 1rem 0; }
.note { color: #52606d; font-size: 0.85rem; }
pre { background: #f5f7fa; padding: 0.8rem; overflow-x: auto; font-size: 0.8rem; }
"""


# ------------------------------------------------------------------------------ figures


def figure_trials_3d(points: pd.DataFrame) -> go.Figure:
    """3-D scatter: x = accuracy %, y = compression ratio, z = codec s/GB.

    Args:
        points: output of :func:`kvtune.report.plot_data.trial_points`.
    """
    fig = go.Figure()
    for on_front, name, color, size in (
        (False, "dominated trials", _OTHER_COLOR, 3),
        (True, "Pareto front", _FRONT_COLOR, 6),
    ):
        sub = points[points["on_front"] == on_front]
        fig.add_trace(
            go.Scatter3d(
                x=sub["accuracy_pct"],
                y=sub["compression_ratio"],
                z=sub["codec_seconds_per_gb"],
                mode="markers",
                name=f"{name} ({len(sub)})",
                marker={"size": size, "color": color, "opacity": 0.95 if on_front else 0.5},
                text=sub["hover"],
                hovertemplate="%{text}<extra></extra>",
            )
        )
    presets = points[points["preset"] != ""]
    if len(presets):
        fig.add_trace(
            go.Scatter3d(
                x=presets["accuracy_pct"],
                y=presets["compression_ratio"],
                z=presets["codec_seconds_per_gb"],
                mode="markers+text",
                name=f"presets ({len(presets)})",
                marker={"size": 7, "color": _PRESET_COLOR, "symbol": "diamond"},
                text=[html.escape(p) for p in presets["preset"]],
                textposition="top center",
                hovertext=presets["hover"],
                hovertemplate="%{hovertext}<extra></extra>",
            )
        )
    fig.update_layout(
        template=_TEMPLATE,
        title="All trials: accuracy, compression ratio, codec latency",
        height=620,
        margin={"l": 0, "r": 0, "t": 50, "b": 0},
        scene={
            "xaxis_title": "relative accuracy (%)",
            "yaxis_title": "compression ratio (x)",
            "zaxis_title": "codec s/GB (enc + dec)",
        },
    )
    return fig


_AXIS_TITLES = {
    "accuracy_pct": "relative accuracy (%)",
    "compression_ratio": "compression ratio (x)",
    "codec_seconds_per_gb": "codec seconds per GB of KV (enc + dec)",
}


def figure_projection(points: pd.DataFrame, x: str, y: str, *, title: str) -> go.Figure:
    """2-D projection of the trials; Pareto points highlighted.

    Args:
        points: output of :func:`kvtune.report.plot_data.trial_points`.
        x, y: column names of ``points`` (``accuracy_pct``, ``compression_ratio`` or
            ``codec_seconds_per_gb``).
        title: figure title.
    """
    fig = go.Figure()
    for on_front, name, color, size in (
        (False, "dominated trials", _OTHER_COLOR, 6),
        (True, "Pareto front (3-D)", _FRONT_COLOR, 9),
    ):
        sub = points[points["on_front"] == on_front]
        fig.add_trace(
            go.Scatter(
                x=sub[x],
                y=sub[y],
                mode="markers",
                name=f"{name} ({len(sub)})",
                marker={"size": size, "color": color, "opacity": 0.95 if on_front else 0.55},
                text=sub["hover"],
                hovertemplate="%{text}<extra></extra>",
            )
        )
    presets = points[points["preset"] != ""]
    if len(presets):
        fig.add_trace(
            go.Scatter(
                x=presets[x],
                y=presets[y],
                mode="markers+text",
                name=f"presets ({len(presets)})",
                marker={"size": 12, "color": "rgba(0,0,0,0)", "symbol": "diamond-open",
                        "line": {"color": _PRESET_COLOR, "width": 2}},
                text=[html.escape(p) for p in presets["preset"]],
                textposition="top center",
                hovertext=presets["hover"],
                hovertemplate="%{hovertext}<extra></extra>",
            )
        )
    fig.update_layout(
        template=_TEMPLATE,
        title=title,
        height=460,
        xaxis_title=_AXIS_TITLES.get(x, x),
        yaxis_title=_AXIS_TITLES.get(y, y),
    )
    return fig


def figure_convergence(conv: pd.DataFrame) -> go.Figure:
    """Normalized hypervolume of the front found so far vs trial number.

    Args:
        conv: output of :func:`kvtune.report.plot_data.convergence`.
    """
    fig = go.Figure()
    fig.add_trace(
        go.Scatter(
            x=conv["trial"],
            y=conv["hypervolume"],
            mode="lines",
            line={"shape": "hv", "color": "#1f77b4", "width": 2},
            name="hypervolume so far",
            customdata=conv["front_size"],
            hovertemplate="trial %{x}: hypervolume %{y:.4f}, front %{customdata} points<extra></extra>",
        )
    )
    up = conv[conv["improved"]]
    fig.add_trace(
        go.Scatter(
            x=up["trial"],
            y=up["hypervolume"],
            mode="markers",
            marker={"size": 7, "color": _FRONT_COLOR},
            name=f"trial enlarged the front ({len(up)})",
            customdata=up["front_size"],
            hovertemplate="trial %{x}: hypervolume %{y:.4f}, front %{customdata} points<extra></extra>",
        )
    )
    fig.update_layout(
        template=_TEMPLATE,
        title="Search convergence: hypervolume of the Pareto front found so far",
        height=420,
        xaxis_title="trial",
        yaxis={"title": "normalized hypervolume (0-1)", "rangemode": "tozero"},
    )
    return fig


def figure_envelope(
    curve: pd.DataFrame,
    uncompressed: pd.DataFrame,
    breakpoints: list[float],
    colors: Mapping[str, str],
    *,
    accuracy_floor: float,
    key: str = "",
) -> go.Figure:
    """Predicted transfer seconds per GB of KV vs link Gbps for one accuracy floor.

    Args:
        curve: :func:`kvtune.report.plot_data.envelope_curve` for this floor.
        uncompressed: :func:`kvtune.report.plot_data.uncompressed_curve`.
        breakpoints: :func:`kvtune.report.plot_data.breakpoints_gbps` for this floor.
        colors: :func:`kvtune.report.plot_data.policy_colors`.
        accuracy_floor: fraction, for the title.
        key: the extra table key, for the title (``""``: none).
    """
    fig = go.Figure()
    fig.add_trace(
        go.Scatter(
            x=uncompressed["bandwidth_gbps"],
            y=uncompressed["seconds_per_gb"],
            mode="lines",
            name="uncompressed (8 / B)",
            line={"color": "#7b8794", "dash": "dash", "width": 1.5},
            hovertemplate="uncompressed<br>%{x:.3g} Gbps: %{y:.4g} s/GB<extra></extra>",
        )
    )
    for _, seg in curve.groupby("segment", sort=True):
        pid = str(seg["policy_id"].iloc[0])
        label = str(seg["label"].iloc[0])
        name = label if pid == label else f"{label} [{pid}]"
        fig.add_trace(
            go.Scatter(
                x=seg["bandwidth_gbps"],
                y=seg["seconds_per_gb"],
                mode="lines",
                name=html.escape(name),
                line={"color": colors.get(pid, "#000000"), "width": 4},
                hovertemplate=(
                    f"{html.escape(name)}<br>%{{x:.3g}} Gbps: %{{y:.4g}} s/GB<extra></extra>"
                ),
            )
        )
    for bw in breakpoints:
        fig.add_vline(x=bw, line={"color": "#bcccdc", "dash": "dot", "width": 1})
    fig.update_layout(
        template=_TEMPLATE,
        title=(
            f"Accuracy floor {100 * accuracy_floor:g} %{f', {key}' if key else ''}: predicted transfer time per GB of KV "
            "(encode + wire + decode)"
        ),
        height=460,
        xaxis={"type": "log", "title": "link bandwidth (Gbps)"},
        yaxis={"type": "log", "title": "seconds per GB of original KV"},
        legend={"title": {"text": "policy on the envelope"}},
    )
    return fig


# ------------------------------------------------------------------------------ page


_SORT_JS = """
(function () {
  function key(cell) {
    var s = cell.textContent.trim();
    var n = s === "inf" ? Infinity : s === "-inf" ? -Infinity : s === "" ? NaN : Number(s);
    return isNaN(n) ? s : n;
  }
  function cmp(x, y) {
    var nx = typeof x === "number", ny = typeof y === "number";
    if (nx && ny) { return x < y ? -1 : x > y ? 1 : 0; }
    if (nx !== ny) { return nx ? -1 : 1; }
    return String(x).localeCompare(String(y));
  }
  document.querySelectorAll("table.sortable").forEach(function (table) {
    var heads = table.tHead.rows[0].cells;
    Array.prototype.forEach.call(heads, function (th, i) {
      th.title = "click to sort";
      th.addEventListener("click", function () {
        var asc = th.getAttribute("data-dir") !== "asc";
        Array.prototype.forEach.call(heads, function (h) { h.removeAttribute("data-dir"); });
        th.setAttribute("data-dir", asc ? "asc" : "desc");
        var body = table.tBodies[0];
        var rows = Array.prototype.slice.call(body.rows);
        rows.sort(function (a, b) {
          var c = cmp(key(a.cells[i]), key(b.cells[i]));
          return asc ? c : -c;
        });
        rows.forEach(function (r) { body.appendChild(r); });
      });
    });
  });
})();
"""


def _html_table(frame: pd.DataFrame, *, sortable: bool = False, table_id: str | None = None) -> str:
    head = "".join(f"<th>{html.escape(str(c))}</th>" for c in frame.columns)
    body = "\n".join(
        "<tr>" + "".join(f"<td>{html.escape(str(v))}</td>" for v in row) + "</tr>"
        for row in frame.itertuples(index=False, name=None)
    )
    cls = "kvtune sortable" if sortable else "kvtune"
    ident = f' id="{html.escape(table_id)}"' if table_id else ""
    return f'<table class="{cls}"{ident}>\n<thead><tr>{head}</tr></thead>\n<tbody>\n{body}\n</tbody>\n</table>'


def _fig_div(fig: go.Figure, div_id: str, *, first: bool) -> str:
    return (
        '<div class="fig">'
        + fig.to_html(
            full_html=False,
            include_plotlyjs=True if first else False,
            div_id=div_id,
            default_width="100%",
            default_height=f"{int(fig.layout.height or 460)}px",
            config={"displaylogo": False, "responsive": True},
        )
        + "</div>"
    )


def render_report(
    trials: pd.DataFrame,
    pareto: pd.DataFrame,
    table: PolicyTable,
    *,
    title: str,
    run_config: Mapping[str, Any],
    sections: Sequence[ReportSection] = (),
) -> str:
    """Build the report page as one HTML string (see :func:`write_report`)."""
    points = pdl.trial_points(trials, pareto)
    colors = pdl.policy_colors(table)
    figures: list[tuple[str, str, go.Figure]] = [
        ("kvtune-trials-3d", "", figure_trials_3d(points)),
        (
            "kvtune-ratio-vs-accuracy",
            "",
            figure_projection(points, "accuracy_pct", "compression_ratio", title="Compression ratio vs accuracy"),
        ),
        (
            "kvtune-ratio-vs-latency",
            "",
            figure_projection(
                points, "codec_seconds_per_gb", "compression_ratio", title="Compression ratio vs codec latency"
            ),
        ),
        ("kvtune-convergence", "", figure_convergence(pdl.convergence(trials))),
    ]
    bw_range = pdl.bandwidth_range_for(table)
    unc = pdl.uncompressed_curve(bandwidth_range_gbps=bw_range)
    panels = envelope_panels(table)
    for k, (key, floor) in enumerate(panels):
        fig = figure_envelope(
            pdl.envelope_curve(table, floor, bandwidth_range_gbps=bw_range, key=key),
            unc,
            pdl.breakpoints_gbps(table, floor, bandwidth_range_gbps=bw_range, key=key),
            colors,
            accuracy_floor=floor,
            key=key,
        )
        intervals = _html_table(pdl.interval_rows(table, floor, key))
        figures.append((f"kvtune-envelope-{k}", intervals, fig))

    divs = [_fig_div(fig, div_id, first=(i == 0)) for i, (div_id, _, fig) in enumerate(figures)]
    n_front = int(points["on_front"].sum())
    n_presets = int((points["preset"] != "").sum())
    n_fixed = 4  # 3-D, two projections, convergence; then one envelope chart per (key, floor)
    esc = html.escape
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en">',
        "<head>",
        '<meta charset="utf-8">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        f"<title>{esc(title)}</title>",
        f"<style>{_CSS}</style>",
        "</head>",
        "<body>",
        f"<h1>{esc(title)}</h1>",
        (
            f'<p>Model <b>{esc(table.model)}</b>, workload <b>{esc(table.workload)}</b>, device '
            f"<b>{esc(table.device)}</b>. {len(trials)} trials, {len(points)} plotted, "
            f"{n_front} on the 3-D Pareto front (accuracy up, ratio up, codec latency down)"
            + (f", {n_presets} presets (diamonds)" if n_presets else "")
            + ". "
            f"Accuracy floors: {esc(', '.join(f'{100 * f:g} %' for f in table.floors))}.</p>"
        ),
        '<p class="note">Codec latency = 1/encode_gbps + 1/decode_gbps seconds per GB (1e9 bytes) '
        "of original bf16 KV. Link bandwidths are in Gbps (1e9 bits/s). Predicted transfer time "
        "per GB of KV = a + b &middot; 8/B (KVServe latency model); compression pays iff B &lt; B* "
        "= 8 (1 - 1/cr) / a Gbps.</p>",
        _fidelity_note(run_config.get("fidelity")),
        "<h2>Trials</h2>",
        divs[0],
        "<h2>Projections</h2>",
        divs[1],
        divs[2],
        "<h2>Search convergence</h2>",
        '<p class="note">Hypervolume of the Pareto front of trials 0..t, objectives mapped to '
        "losses in [0, 1] (0 = the run's best accuracy / ratio / codec latency, 1 = its worst), "
        "reference point (1.1, 1.1, 1.1), divided by the reference box 1.1&sup3;. It compares "
        "trials within this run.</p>",
        divs[3],
        *(part for k, section in enumerate(sections) for part in _section_html(section, k)),
        "<h2>Policy table: transfer time vs bandwidth</h2>",
    ]
    for (_, intervals, _), div, (key, floor) in zip(figures[n_fixed:], divs[n_fixed:], panels, strict=True):
        parts += [f"<h3>Accuracy floor {100 * floor:g} %{esc(f', {key}' if key else '')}</h3>", div, intervals]
    parts += [
        f"<h2>Pareto policies ({len(pareto)})</h2>",
        '<p class="note">Click a column header to sort.</p>',
        _html_table(pdl.pareto_rows(pareto), sortable=True, table_id="kvtune-pareto-table"),
        f"<script>{_SORT_JS}</script>",
        "<h2>Run configuration</h2>",
        f"<pre>{esc(json.dumps(dict(run_config), indent=2, sort_keys=True, default=str))}</pre>",
        "</body>",
        "</html>",
    ]
    return "\n".join(parts) + "\n"


def _section_html(section: ReportSection, k: int) -> list[str]:
    """The HTML of a method's section ``k``: heading, note, figures, captioned tables
    (table ids ``kvtune-section-<k>-table-<j>``)."""
    parts = [f"<h2>{html.escape(section.title)}</h2>"]
    if section.note:
        parts.append(f'<p class="note">{html.escape(section.note)}</p>')
    parts += [_fig_div(fig, div_id, first=False) for div_id, fig in section.figures]
    for j, (caption, frame) in enumerate(section.tables):
        parts += [f"<h3>{html.escape(caption)}</h3>", _html_table(frame, table_id=f"kvtune-section-{k}-table-{j}")]
    return parts


def _fidelity_note(info: Mapping[str, Any] | None) -> str:
    """One paragraph on multi-fidelity: what the search saw, what the tables use, Spearman rho."""
    if not info or info.get("search") == info.get("final"):
        return ""
    rho = info.get("spearman_relative_accuracy")
    rho_text = "n/a (fewer than 2 policies)" if rho is None else f"{rho:.3f}"
    climbed = int(info.get("climbed") or 0)
    climb_text = (f", and floor climbing evaluated {climbed} more {'policy' if climbed == 1 else 'policies'} there"
                  if climbed else "")
    return (
        f'<p class="note">Multi-fidelity: the search evaluated policies at <b>{html.escape(str(info["search"]))}</b> '
        f"fidelity (the trial charts show those values); part of its Pareto set was re-evaluated at "
        f"<b>{html.escape(str(info['final']))}</b> fidelity{climb_text}, and the Pareto table and policy tables use "
        f"those results. Spearman rank correlation of cheap vs full relative accuracy over the "
        f"{int(info.get('paired', info.get('refined', 0)))} policies evaluated at both: <b>{rho_text}</b>.</p>"
    )


def envelope_panels(table: PolicyTable) -> list[tuple[str, float]]:
    """The ``(key, floor)`` pairs the report draws an envelope chart for: every floor of an
    unkeyed table; for a keyed table (BiCache prefix-ratio buckets) every key's floors, key by
    key."""
    present = set(zip(table.frame["key"].astype(str), table.frame["accuracy_floor"].astype(float))) \
        if "key" in table.frame else {("", f) for f in table.floors}
    return [(key, floor) for key in table.keys for floor in table.floors if (key, floor) in present]


def write_report(
    trials: pd.DataFrame,
    pareto: pd.DataFrame,
    table: PolicyTable,
    path: str | os.PathLike[str],
    *,
    title: str,
    run_config: Mapping[str, Any],
    sections: Sequence[ReportSection] = (),
) -> Path:
    """Write the self-contained HTML report of a profiling run, atomically.

    The file embeds plotly.js once (about 5 MB) and opens offline in any browser. Figures:
    a 3-D trials scatter, two 2-D projections, the search convergence (hypervolume vs trial),
    and one transfer-time-vs-bandwidth chart per accuracy floor of ``table``
    (4 + len(envelope_panels(table)) plotly divs: one per floor, per key of a keyed table),
    then the method's ``sections`` (their figures and tables); plus HTML tables of the Pareto
    policies (sortable by header click) and of each floor's intervals, and the run
    configuration as JSON.

    Args:
        trials: all evaluated policies (``relative_accuracy`` fraction, ``compression_ratio``,
            ``encode_gbps``/``decode_gbps`` GB/s; ``policy_id``, ``label``, ``method``;
            optional ``trial`` (order of the convergence plot), ``param.*`` (shown on hover)
            and ``preset`` (preset name, null for searched policies; rows with
            ``method == "preset"`` count as presets too).
        pareto: the Pareto rows (:func:`kvtune.search.pareto.pareto_front`).
        table: the compiled :class:`~kvtune.tables.policy_table.PolicyTable`.
        path: destination ``.html`` file (parent directories are created).
        title: page title.
        run_config: run settings shown verbatim (JSON; non-JSON values via ``str``).
        sections: the method's own sections, after the search convergence chart.

    Returns:
        The path written.
    """
    page = render_report(trials, pareto, table, title=title, run_config=run_config, sections=sections)
    return atomic_write_text(path, page)
