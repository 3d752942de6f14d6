"""Search benchmark: every optimizer against a replay table with a known answer.

Used by ``benchmarks/search.py`` (the command line) and the tests. For each optimizer and
seed, the optimizer is driven exactly as :func:`kvtune.methods.tqc.profile.run_profile` drives it (ask ->
evaluate -> tell, results carrying their ``trial`` number) against a
:class:`~kvtune.search.optimizers.replay.ReplayObjective`, up to the **largest** budget; smaller budgets
are read off the same run as prefixes (no optimizer here looks at the budget, so a run with
budget b is exactly the first b steps of a longer one). An optimizer that stops early simply
has fewer evaluations.

Metrics at each budget (fraction of the space, rounded up to whole evaluations):

* ``hv_ratio`` -- hypervolume of the evaluated trials / hypervolume of the whole table, in
  normalized objectives with a fixed reference point (:class:`~kvtune.search.optimizers.replay.HypervolumeSpec`:
  accuracy ref 0.5, ratio ref 1.0, latency normalized by the table's worst, ref 1.1);
* ``ratio_q<q>`` -- best feasible ratio found at floor ``q`` (``relative_accuracy_lo >= q``)
  / the exhaustive best; ``hit_q<q>`` -- 1 when it equals the exhaustive best exactly;
* ``overhead_s`` -- mean wall time of the optimizer per iteration (``ask`` + ``tell``, not
  the evaluation) over those evaluations (heavy imports are done before timing starts);
  ``overhead_max_s`` the slowest iteration.

``kvserve`` optimizes one floor, so it runs once per floor (``kvserve@0.97``, ...) and only its
own floor's ratio and hit are reported (the others are NaN).
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from kvtune.search.optimizers.base import make_optimizer
from kvtune.search.optimizers.replay import ReplayObjective, best_feasible_ratio
from kvtune.search.space import SearchSpace

__all__ = ["Run", "batch_comparison", "convergence", "run_optimizer", "run_search_benchmark", "summarize", "write_outputs"]

CONSTRAINED = {"kvserve"}


@dataclass
class Run:
    """One optimizer run: its evaluated trial rows (in order) and per-iteration overheads (s)."""

    label: str
    optimizer: str
    seed: int
    q_min: float | None
    trials: list[dict[str, Any]] = field(default_factory=list)
    overhead: list[float] = field(default_factory=list)
    stop_reason: str | None = None


def run_optimizer(name: str, space: SearchSpace, replay: ReplayObjective, *, seed: int, budget: int,
                  q_min: float = 0.97, ratios: np.ndarray | None = None, options: dict[str, Any] | None = None,
                  label: str | None = None, batch: int = 1) -> Run:
    """Drive one optimizer for up to ``budget`` evaluations against ``replay``, asking
    ``batch`` candidates at a time (``ask_batch``; all told before the next batch is asked,
    as :func:`kvtune.run.loop.ask_tell` does). The ask time of a batch is shared evenly by
    its candidates' overheads."""
    opt = make_optimizer(name, space, seed=seed, q_min=q_min, ratios=ratios, **(options or {}))
    run = Run(label=label or name, optimizer=name, seed=seed, q_min=q_min if name in CONSTRAINED else None)
    while len(run.trials) < budget:
        t0 = time.perf_counter()
        asked = opt.ask_batch(min(batch, budget - len(run.trials)))
        t_ask = time.perf_counter() - t0
        if not asked:
            run.stop_reason = getattr(opt, "stop_reason", None) or "optimizer returned None"
            break
        for cand in asked:
            result = replay.evaluate(cand)
            result["trial"] = len(run.trials)
            t0 = time.perf_counter()
            opt.tell(cand, result)
            run.overhead.append(t_ask / len(asked) + time.perf_counter() - t0)
            run.trials.append(result)
    return run


def _warm_up() -> None:
    """Import the heavy modules the optimizers load lazily, so the first iteration's overhead
    measures the optimizer, not Python imports."""
    import botorch.acquisition.multi_objective.logei  # noqa: F401
    import botorch.utils.multi_objective.box_decompositions.non_dominated  # noqa: F401
    import optuna.samplers  # noqa: F401
    import scipy.optimize  # noqa: F401


def _metrics(run: Run, replay: ReplayObjective, n: int, q_mins: Sequence[float], hv_full: float,
             best: dict[float, float]) -> dict[str, Any]:
    trials = run.trials[:n]
    frame = pd.DataFrame(trials)
    row: dict[str, Any] = {"optimizer": run.label, "seed": run.seed, "evals": len(trials),
                           "hv_ratio": replay.hypervolume(frame) / hv_full if len(frame) and hv_full > 0 else 0.0}
    for q in q_mins:
        if run.q_min is not None and not math.isclose(run.q_min, q):
            row[f"ratio_q{q:g}"], row[f"hit_q{q:g}"] = float("nan"), float("nan")
            continue
        found = best_feasible_ratio(frame, q) if len(frame) else float("nan")
        ratio = found / best[q] if np.isfinite(found) else 0.0
        row[f"ratio_q{q:g}"] = ratio
        row[f"hit_q{q:g}"] = float(np.isfinite(found) and math.isclose(found, best[q], rel_tol=1e-12))
    row["overhead_s"] = float(np.mean(run.overhead[:n])) if run.overhead[:n] else 0.0
    row["overhead_max_s"] = float(np.max(run.overhead[:n])) if run.overhead[:n] else 0.0
    return row


def run_search_benchmark(space: SearchSpace, replay: ReplayObjective, *, optimizers: Sequence[str],
                         seeds: int | Sequence[int] = 10, budgets: Sequence[float] = (0.01, 0.02, 0.05, 0.1),
                         q_mins: Sequence[float] = (0.97, 0.99), use_ratios: bool = True,
                         options: dict[str, dict[str, Any]] | None = None,
                         progress: Callable[[str], None] | None = None,
                         batches: Sequence[int] = (1,)) -> tuple[pd.DataFrame, list[Run]]:
    """Run every optimizer for every seed and score it at every budget.

    Args:
        space: the search space (the replay table must cover it).
        replay: the fully evaluated table.
        optimizers: registered names; ``kvserve`` runs once per floor in ``q_mins``.
        seeds: number of seeds (0..n-1) or explicit seeds.
        budgets: fractions of the space (each rounded up to whole evaluations, at least 1).
        q_mins: accuracy floors for the best-ratio metrics.
        use_ratios: give the optimizers the up-front ratios (from the table).
        options: per-optimizer constructor options.
        progress: called with a one-line message after each run.
        batches: batch sizes ``q`` to run each optimizer with (:func:`run_optimizer`); with
            more than one, labels get a `` q=<q>`` suffix.

    Returns:
        ``(results, runs)``: one row per (optimizer, seed, budget) with the metrics of the
        module docstring plus ``budget`` (fraction), ``budget_evals``, ``batch`` and
        ``variant`` (the label without the batch suffix); and the raw runs.
    """
    _warm_up()
    seed_list = list(range(seeds)) if isinstance(seeds, int) else list(seeds)
    n_budget = {b: max(1, math.ceil(b * len(space))) for b in budgets}
    max_budget = max(n_budget.values())
    ratios = replay.ratios(space) if use_ratios else None
    hv_full = replay.exhaustive_hypervolume()
    best = {q: replay.best_feasible_ratio(q) for q in q_mins}
    rows, runs = [], []
    for name in optimizers:
        variants = [(f"{name}@{q:g}", q) for q in q_mins] if name in CONSTRAINED else [(name, q_mins[0])]
        for (base_label, q), batch in itertools.product(variants, batches):
            label = base_label if len(batches) == 1 else f"{base_label} q={batch}"
            for seed in seed_list:
                t0 = time.perf_counter()
                run = run_optimizer(name, space, replay, seed=seed, budget=max_budget, q_min=q, ratios=ratios,
                                    options=(options or {}).get(name), label=label, batch=batch)
                runs.append(run)
                for b, n in n_budget.items():
                    rows.append({**_metrics(run, replay, n, q_mins, hv_full, best), "budget": b, "budget_evals": n,
                                 "batch": batch, "variant": base_label})
                if progress:
                    last = rows[-1]
                    progress(f"{label} seed {seed}: {len(run.trials)} evals, hv {last['hv_ratio']:.3f}, "
                             f"{np.mean(run.overhead) if run.overhead else 0:.2f} s/iter, "
                             f"{time.perf_counter() - t0:.0f} s")
    return pd.DataFrame(rows), runs


def summarize(results: pd.DataFrame) -> pd.DataFrame:
    """Per (optimizer, budget): mean and min ``hv_ratio``, mean ``ratio_q*``, number of seeds
    with ``hit_q* == 1`` (of the seeds run), mean evaluations and mean/max overhead."""
    q_cols = sorted(c for c in results.columns if c.startswith("ratio_q"))
    agg: dict[str, Any] = {"seeds": ("seed", "nunique"), "evals": ("evals", "mean"),
                           "hv_mean": ("hv_ratio", "mean"), "hv_min": ("hv_ratio", "min")}
    for c in q_cols:
        q = c[len("ratio_q"):]
        agg[f"ratio_q{q}_mean"] = (c, "mean")
        agg[f"hits_q{q}"] = (f"hit_q{q}", lambda s: float("nan") if s.isna().all() else int(s.sum()))
    agg["overhead_s"] = ("overhead_s", "mean")
    agg["overhead_max_s"] = ("overhead_max_s", "max")
    return results.groupby(["optimizer", "budget"], sort=False).agg(**agg).reset_index()


def batch_comparison(results: pd.DataFrame) -> pd.DataFrame:
    """Per (variant, budget, batch): mean evaluations, mean ``hv_ratio``, that mean relative to
    the same variant and budget at batch 1 (``hv_vs_q1``; NaN without a batch-1 run), and the
    hits at each floor (``hits_q<q>``, summed over seeds; NaN where not reported)."""
    hit_cols = sorted(c for c in results.columns if c.startswith("hit_q"))
    agg: dict[str, Any] = {"seeds": ("seed", "nunique"), "evals": ("evals", "mean"), "hv_mean": ("hv_ratio", "mean")}
    for c in hit_cols:
        agg["hits_" + c[len("hit_"):]] = (c, lambda s: float("nan") if s.isna().all() else int(s.sum()))
    out = results.groupby(["variant", "budget", "batch"], sort=False).agg(**agg).reset_index()
    ref = out[out["batch"] == 1].set_index(["variant", "budget"])["hv_mean"]
    keys = pd.MultiIndex.from_frame(out[["variant", "budget"]])
    out.insert(5, "hv_vs_q1", out["hv_mean"].to_numpy() / ref.reindex(keys).to_numpy())
    return out


def convergence(runs: list[Run], replay: ReplayObjective, *, step: int = 5,
                q_mins: Sequence[float] = (0.97,)) -> pd.DataFrame:
    """Long table of the curves: mean/min/max over seeds of ``hv_ratio`` (and the best-ratio
    fraction at each floor) after every ``step`` evaluations, per optimizer."""
    hv_full = replay.exhaustive_hypervolume()
    best = {q: replay.best_feasible_ratio(q) for q in q_mins}
    rows = []
    for run in runs:
        n_max = len(run.trials)
        for n in sorted({*range(step, n_max + 1, step), n_max}):
            if n == 0:
                continue
            m = _metrics(run, replay, n, q_mins, hv_full, best)
            rows.append({"optimizer": run.label, "seed": run.seed, "evals": n, "hv_ratio": m["hv_ratio"],
                         **{f"ratio_q{q:g}": m[f"ratio_q{q:g}"] for q in q_mins}})
    frame = pd.DataFrame(rows)
    if frame.empty:
        return frame
    # a run that stopped early keeps its final value at later evaluation counts
    full = []
    grid = sorted(frame["evals"].unique())
    for (label, seed), g in frame.groupby(["optimizer", "seed"], sort=False):
        g = g.set_index("evals").reindex(grid).ffill().reset_index()
        g["optimizer"], g["seed"] = label, seed
        full.append(g)
    return pd.concat(full, ignore_index=True)


def _rgba(hex_color: str, alpha: float) -> str:
    r, g, b = (int(hex_color[i : i + 2], 16) for i in (1, 3, 5))
    return f"rgba({r},{g},{b},{alpha})"


def write_outputs(results: pd.DataFrame, runs: list[Run], replay: ReplayObjective, out: str, *,
                  title: str, q_mins: Sequence[float] = (0.97, 0.99), notes: str = "") -> dict[str, str]:
    """Write ``<out>.csv`` (per seed), ``<out>.md`` (summary), ``<out>.html`` (plotly
    convergence plot, plotly.js embedded, ~5 MB), ``<out>_curves.csv`` (the curves) and
    ``<out>.svg`` (the same plot, static; needs matplotlib). Returns the paths by kind."""
    from pathlib import Path

    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    base = Path(out)
    base.parent.mkdir(parents=True, exist_ok=True)
    paths = {"csv": str(base.with_suffix(".csv")), "md": str(base.with_suffix(".md")), "html": str(base.with_suffix(".html"))}
    results.to_csv(paths["csv"], index=False)
    summary = summarize(results)
    lines = [f"# {title}", "", notes, "", "| optimizer | budget | evals | HV / exhaustive (mean, min) | "
             + " | ".join(f"best ratio / exhaustive @ q={q:g} (mean) | hits @ {q:g}" for q in q_mins)
             + " | overhead s/iter (mean, max) |",
             "|---|---|---|---|" + "---|---|" * len(q_mins) + "---|"]
    for _, r in summary.iterrows():
        cells = [r["optimizer"], f"{r['budget']:.0%}", f"{r['evals']:.0f}", f"{r['hv_mean']:.3f}, {r['hv_min']:.3f}"]
        for q in q_mins:
            hits = r[f"hits_q{q:g}"]
            cells += [f"{r[f'ratio_q{q:g}_mean']:.3f}" if np.isfinite(r[f"ratio_q{q:g}_mean"]) else "-",
                      "-" if not np.isfinite(hits) else f"{int(hits)}/{int(r['seeds'])}"]
        cells.append(f"{r['overhead_s']:.2f}, {r['overhead_max_s']:.2f}")
        lines.append("| " + " | ".join(cells) + " |")
    Path(paths["md"]).write_text("\n".join(lines) + "\n")

    curves = convergence(runs, replay, q_mins=q_mins[:1])
    fig = make_subplots(rows=1, cols=2, subplot_titles=(
        "hypervolume / exhaustive (mean over seeds, band = min..max)",
        f"best feasible ratio / exhaustive at q={q_mins[0]:g} (mean over seeds)"))
    palette = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#17becf"]
    for k, (label, g) in enumerate(curves.groupby("optimizer", sort=False)):
        color = palette[k % len(palette)]
        agg = g.groupby("evals")["hv_ratio"].agg(["mean", "min", "max"]).reset_index()
        fig.add_trace(go.Scatter(x=agg["evals"], y=agg["max"], line=dict(width=0), showlegend=False,
                                 hoverinfo="skip", legendgroup=label), row=1, col=1)
        fig.add_trace(go.Scatter(x=agg["evals"], y=agg["min"], line=dict(width=0), fill="tonexty",
                                 fillcolor=_rgba(color, 0.15), showlegend=False, hoverinfo="skip",
                                 legendgroup=label), row=1, col=1)
        fig.add_trace(go.Scatter(x=agg["evals"], y=agg["mean"], name=label, line=dict(color=color),
                                 legendgroup=label), row=1, col=1)
        col = f"ratio_q{q_mins[0]:g}"
        if g[col].notna().any():
            r = g.groupby("evals")[col].mean().reset_index()
            fig.add_trace(go.Scatter(x=r["evals"], y=r[col], name=label, line=dict(color=color), showlegend=False,
                                     legendgroup=label), row=1, col=2)
    fig.update_xaxes(title_text="evaluations")
    fig.update_layout(title=title, template="plotly_white", height=480, width=1200)
    fig.write_html(paths["html"], include_plotlyjs=True, div_id="convergence")
    paths["curves"] = str(base.with_name(base.name + "_curves.csv"))
    curves.to_csv(paths["curves"], index=False)
    svg = write_convergence_svg(curves, str(base.with_suffix(".svg")), title=title, q_min=q_mins[0])
    if svg:
        paths["svg"] = svg
    return paths


def write_convergence_svg(curves: pd.DataFrame, path: str, *, title: str, q_min: float) -> str | None:
    """The convergence plot of :func:`write_outputs` as a static SVG (for a README), drawn with
    matplotlib when it is installed (``pip install kvtune[bench]``); ``None`` without it."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2), constrained_layout=True)
    col = f"ratio_q{q_min:g}"
    for label, g in curves.groupby("optimizer", sort=False):
        agg = g.groupby("evals")["hv_ratio"].agg(["mean", "min", "max"]).reset_index()
        (line,) = axes[0].plot(agg["evals"], agg["mean"], label=label, lw=1.6)
        axes[0].fill_between(agg["evals"], agg["min"], agg["max"], color=line.get_color(), alpha=0.12, lw=0)
        if col in g and g[col].notna().any():
            r = g.groupby("evals")[col].mean().reset_index()
            axes[1].plot(r["evals"], r[col], label=label, lw=1.6, color=line.get_color())
    axes[0].set_title("hypervolume / exhaustive (mean; band min..max over seeds)", fontsize=10)
    axes[1].set_title(f"best feasible ratio / exhaustive at q_min = {q_min:g} (mean over seeds)", fontsize=10)
    for ax in axes:
        ax.set_xlabel("evaluations")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8, loc="lower right")
    fig.suptitle(title, fontsize=11)
    fig.savefig(path, format="svg", metadata={"Date": None})  # no timestamp: reruns diff cleanly
    plt.close(fig)
    return path
