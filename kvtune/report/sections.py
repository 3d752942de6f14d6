"""A method's own part of the HTML report: sections of plotly figures and display tables.

A registered method (:meth:`kvtune.run.method.Method.report_sections`) returns
:class:`ReportSection` s; :func:`kvtune.report.html.render_report` draws them after the
shared charts. Each section's numbers come from a plot-data function of the method (a tidy
DataFrame, as in :mod:`kvtune.report.plot_data`); the figure builders here only draw such
frames, and :func:`markdown_table` writes a display frame as Markdown so a run's
``summary.md`` and its report show the same tables.
"""

from __future__ import annotations

import html
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import pandas as pd
import plotly.graph_objects as go

__all__ = ["ReportSection", "figure_heatmap", "figure_series", "markdown_table"]

_TEMPLATE = "plotly_white"
_PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
            "#bcbd22", "#17becf")


@dataclass(frozen=True)
class ReportSection:
    """One titled section of a method's report.

    Attributes:
        title: the section heading (plain text).
        note: an explanatory paragraph (plain text, escaped when rendered).
        figures: ``(div id, plotly figure)`` pairs; div ids are unique in the page and fixed,
            so the same run gives the same file.
        tables: ``(caption, frame)`` pairs; the frame's cells are shown as text (format them
            first, as :func:`markdown_table` writes them).
    """

    title: str
    note: str = ""
    figures: tuple[tuple[str, Any], ...] = ()
    tables: tuple[tuple[str, pd.DataFrame], ...] = ()


def markdown_table(frame: pd.DataFrame) -> list[str]:
    """Lines of a Markdown table of ``frame`` (header, ``|---|`` rule, one line per row; cells
    as ``str``)."""
    lines = ["| " + " | ".join(str(c) for c in frame.columns) + " |", "|" + "---|" * len(frame.columns)]
    lines += ["| " + " | ".join(str(v) for v in row) + " |" for row in frame.itertuples(index=False, name=None)]
    return lines


def figure_series(
    data: pd.DataFrame,
    *,
    x: str,
    y: str,
    group: str,
    title: str,
    x_title: str,
    y_title: str,
    hover: str | None = None,
    error: tuple[str, str] | None = None,
    mode: str = "lines+markers",
    log_x: bool = False,
    log_y: bool = False,
    hlines: Sequence[tuple[float, str]] = (),
    height: int = 460,
) -> go.Figure:
    """One trace per value of ``data[group]`` (in order of appearance), ``y`` against ``x``.

    Args:
        data: tidy frame, already sorted along ``x`` within each group.
        hover: column of HTML hover text (escaped by the caller).
        error: ``(lo, hi)`` columns drawn as asymmetric error bars around ``y``.
        hlines: ``(y value, label)`` horizontal reference lines (floors, thresholds).
    """
    fig = go.Figure()
    for k, (name, sub) in enumerate(data.groupby(group, sort=False)):
        trace: dict[str, Any] = {
            "x": sub[x], "y": sub[y], "mode": mode, "name": html.escape(str(name)),
            "line": {"color": _PALETTE[k % len(_PALETTE)]}, "marker": {"color": _PALETTE[k % len(_PALETTE)], "size": 8},
        }
        if hover is not None:
            trace.update(text=sub[hover], hovertemplate="%{text}<extra></extra>")
        if error is not None:
            trace["error_y"] = {"type": "data", "symmetric": False, "array": sub[error[1]] - sub[y],
                                "arrayminus": sub[y] - sub[error[0]], "thickness": 1}
        fig.add_trace(go.Scatter(**trace))
    for value, label in hlines:
        fig.add_hline(y=value, line={"color": "#7b8794", "dash": "dot", "width": 1},
                      annotation_text=html.escape(label), annotation_position="bottom right")
    fig.update_layout(template=_TEMPLATE, title=title, height=height,
                      xaxis={"title": x_title, "type": "log" if log_x else "linear"},
                      yaxis={"title": y_title, "type": "log" if log_y else "linear"})
    return fig


def figure_heatmap(
    matrix: pd.DataFrame,
    *,
    title: str,
    x_title: str,
    y_title: str,
    z_title: str,
    height: int = 420,
) -> go.Figure:
    """A heatmap of ``matrix`` (rows on y, columns on x), each cell's value printed and on hover."""
    z = matrix.to_numpy(dtype=float)
    fig = go.Figure(go.Heatmap(
        z=z, x=[str(c) for c in matrix.columns], y=[html.escape(str(i)) for i in matrix.index],
        colorscale="Viridis", colorbar={"title": {"text": z_title}},
        text=[[f"{v:.4f}" for v in row] for row in z], texttemplate="%{text}",
        hovertemplate=f"{html.escape(y_title)} %{{y}}<br>{html.escape(x_title)} %{{x}}<br>"
                      f"{html.escape(z_title)} %{{z:.5f}}<extra></extra>",
    ))
    fig.update_layout(template=_TEMPLATE, title=title, height=height, xaxis={"title": x_title, "type": "category"},
                      yaxis={"title": y_title, "type": "category"})
    return fig
