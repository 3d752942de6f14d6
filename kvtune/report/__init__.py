"""HTML report of a profiling run: a plot-data layer (:mod:`kvtune.report.plot_data`) and a
plotly renderer (:mod:`kvtune.report.html`)."""

from kvtune.report.html import render_report, write_report

__all__ = ["render_report", "write_report"]
