"""Simulated cluster: wall time of an asynchronous search on W workers (issue 15).

Every candidate of the replay table (``benchmarks/data/full_replay.parquet``) carries the
measured wall time of its real evaluation (``eval_seconds``: one trial of the profile on the
default model, CPU; 0.85--16.6 s, mean 2.6 s). The simulation replays an asynchronous
search on ``W`` identical workers in simulated time:

* at the start the optimizer is asked for ``W`` candidates (``ask_batch(W)``);
* each asked candidate runs on a free worker for its ``eval_seconds``;
* whenever a worker frees, the finished results are told (in finish order, ``trial``
  numbers in tell order, as :func:`kvtune.search.optimizers.bench.run_optimizer` numbers
  them) and the optimizer is asked for as many candidates as there are free workers, with
  the running ones pending (``ask_batch(q, pending=running)``);
* a run ends when the target is reached, at ``--max-evals`` started evaluations, or when
  the optimizer has nothing to propose and nothing runs.

The driver's own time (the optimizer's ``ask_batch``, measured on this CPU) is handled two
ways (``--ask-time``): ``free`` -- asks take no simulated time (the simulated wall time is
evaluation time only, deterministic per seed) and the measured ask seconds are reported
next to it; ``charged`` -- the driver is one serial thread: each ask advances the simulated
clock by its measured duration before its candidates start, and results that finish during
an ask are told after it (realistic, but depends on the load of the CPU it ran on).

Scores per run: the simulated time (and evaluations told) at which the hypervolume of the
told trials reaches ``--target`` (0.99) of the exhaustive front's hypervolume
(:meth:`kvtune.search.optimizers.replay.ReplayObjective.hypervolume`, the benchmark's
normalization and reference point), and at which the exhaustive best feasible ratio at
``--q-min`` is found (the figure ``kvserve`` optimizes; recorded when it happens before the
run ends). Speedup = mean time to target on 1 worker / mean time on W workers.
``utilization`` = worker-seconds of the evaluations told by the end of the run / (W x its
simulated length); evaluations still running when the target is reached are not counted::

    OMP_NUM_THREADS=1 nice -n 19 python benchmarks/cluster_sim.py --optimizers mobo,kvserve,random \\
        --workers 1,8,32 --seeds 5 --out benchmarks/results/cluster_sim
    OMP_NUM_THREADS=1 nice -n 19 python benchmarks/cluster_sim.py --optimizers mobo,kvserve \
        --workers 1,8,32 --seeds 5 --ask-time charged --out benchmarks/results/cluster_sim_charged

Writes ``<out>.csv`` (one row per optimizer x workers x seed x ask-time mode) and
``<out>.md`` (summary).
"""

from __future__ import annotations

import argparse
import heapq
import math
import sys
import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # run from a checkout without installing


@dataclass(frozen=True)
class Told:
    """One finished evaluation: its key, when it started and finished on its worker and when
    the driver told it (``told_at >= finish``; equal unless an ask was running), in s of
    simulated time."""

    key: Hashable
    start: float
    finish: float
    told_at: float


@dataclass
class Trace:
    """What a simulated run did: the told evaluations in tell order, the measured seconds of
    each ask (real driver time) with its batch size, and why it ended."""

    told: list[Told] = field(default_factory=list)
    asks: list[tuple[float, int]] = field(default_factory=list)
    started: int = 0
    stop_reason: str = ""


def simulate_cluster(ask: Callable[[int, list], list], duration: Callable[[Any], float],
                     tell: Callable[[Any, Told], bool], *, workers: int, max_evals: int,
                     charge_ask: bool = False, key: Callable[[Any], Hashable] = lambda c: c,
                     timer: Callable[[], float] = time.perf_counter) -> Trace:
    """Event-driven simulation of an asynchronous ask/tell search on ``workers`` workers.

    Args:
        ask: ``ask(q, pending) -> candidates`` (at most ``q``; ``pending`` = the running ones,
            in start order); empty when there is nothing to propose now.
        duration: seconds of simulated time one candidate's evaluation takes (>= 0).
        tell: called with each finished candidate and its :class:`Told`, in finish order
            (ties in start order); returns True to end the run (target reached).
        workers: number of workers (>= 1).
        max_evals: the most evaluations started (>= 1).
        charge_ask: advance the simulated clock by each ask's measured duration (a serial
            driver); otherwise asks take no simulated time.
        key: identity of a candidate in the trace.
        timer: clock measuring the asks (seconds; ``time.perf_counter``).

    Returns:
        The :class:`Trace`; ``stop_reason`` is ``"target"``, ``"max_evals"`` or
        ``"exhausted"``.

    Raises:
        ValueError: ``workers`` or ``max_evals`` below 1, or a negative duration.
    """
    if workers < 1 or max_evals < 1:
        raise ValueError(f"workers and max_evals must be >= 1, got {workers} and {max_evals}")
    trace = Trace()
    running: list[tuple[float, int, Any, float]] = []  # heap of (finish, start order, candidate, start)
    now = 0.0
    while True:
        free = workers - len(running)
        q = min(free, max_evals - trace.started)
        if q > 0:
            pending = [item[2] for item in sorted(running, key=lambda r: r[1])]
            t0 = timer()
            batch = ask(q, pending)
            spent = timer() - t0
            trace.asks.append((spent, q))
            if charge_ask:
                now += spent
            for cand in batch[:q]:
                d = float(duration(cand))
                if not d >= 0.0:
                    raise ValueError(f"duration of {key(cand)!r} is {d}, must be >= 0")
                heapq.heappush(running, (now + d, trace.started, cand, now))
                trace.started += 1
        if not running:
            trace.stop_reason = "max_evals" if trace.started >= max_evals else "exhausted"
            return trace
        now = max(now, running[0][0])
        while running and running[0][0] <= now:  # everything finished by now is told
            finish, _, cand, start = heapq.heappop(running)
            event = Told(key(cand), start, finish, now)
            trace.told.append(event)
            if tell(cand, event):
                trace.stop_reason = "target"
                return trace


def first_reached(times: Sequence[float], values: Sequence[float], target: float) -> tuple[float, int]:
    """``(time, n)``: the first ``times[i]`` with ``values[i] >= target`` and ``n = i + 1``
    (the number of values up to it); ``(nan, 0)`` when never reached."""
    for i, (t, v) in enumerate(zip(times, values)):
        if v >= target:
            return float(t), i + 1
    return float("nan"), 0


class HypervolumeTracker:
    """Running hypervolume of points added one at a time, with a benchmark
    :class:`~kvtune.search.optimizers.replay.HypervolumeSpec` (objectives: accuracy up, ratio
    up, codec latency in s/GB down; raw units). Recomputes only when a point is not weakly
    dominated by the current front (a dominated point adds no volume)."""

    def __init__(self, spec) -> None:
        self.spec = spec
        self.front = np.empty((0, 3))
        self.value = 0.0

    def add(self, point: np.ndarray) -> float:
        """Add one ``(3,)`` raw objective point; returns the hypervolume of all points so far.
        A point with a NaN objective adds nothing."""
        from kvtune.search.pareto import non_dominated_mask

        p = np.asarray(point, dtype=np.float64)
        if not np.all(np.isfinite(p)):
            return self.value
        if len(self.front) and np.any((self.front[:, 0] >= p[0]) & (self.front[:, 1] >= p[1])
                                      & (self.front[:, 2] <= p[2])):
            return self.value
        pts = np.vstack([self.front, p])
        self.front = pts[non_dominated_mask(pts, (True, True, False))]
        self.value = self.spec.hypervolume(self.front)
        return self.value


def run_cluster(name: str, space, replay, *, seed: int, workers: int, max_evals: int, target: float,
                q_min: float, charge_ask: bool, ratios: np.ndarray | None) -> dict[str, Any]:
    """Simulate optimizer ``name`` (seed ``seed``) on ``workers`` workers against ``replay``;
    one result row (see the module docstring). Ends at the hypervolume target."""
    import pandas as pd

    from kvtune.search.optimizers.base import make_optimizer
    from kvtune.search.optimizers.replay import objective_points

    opt = make_optimizer(name, space, seed=seed, q_min=q_min, ratios=ratios)
    hv_target = target * replay.exhaustive_hypervolume()
    best = replay.best_feasible_ratio(q_min)
    tracker = HypervolumeTracker(replay.hv_spec)
    rows: dict[int, dict[str, Any]] = {}
    hv_curve: list[float] = []
    hit_at: list[tuple[float, int]] = []

    def duration(cand) -> float:
        rows[cand.index] = replay.evaluate(cand)
        return rows[cand.index]["eval_seconds"]

    def tell(cand, event: Told) -> bool:
        result = rows.pop(cand.index)
        result["trial"] = len(hv_curve)
        opt.tell(cand, result)
        hv_curve.append(tracker.add(objective_points(pd.DataFrame([result]))[0]))
        acc = result.get("relative_accuracy_lo", result["relative_accuracy"])
        if not hit_at and acc >= q_min and math.isclose(result["compression_ratio"], best, rel_tol=1e-12):
            hit_at.append((event.told_at, len(hv_curve)))
        return hv_curve[-1] >= hv_target

    t0 = time.perf_counter()
    trace = simulate_cluster(lambda q, pending: opt.ask_batch(q, pending), duration, tell, workers=workers,
                             max_evals=max_evals, charge_ask=charge_ask, key=lambda c: c.index)
    wall = time.perf_counter() - t0
    t_hv, n_hv = first_reached([e.told_at for e in trace.told], hv_curve, hv_target)
    asks = np.array([s for s, _ in trace.asks]) if trace.asks else np.zeros(1)
    busy = sum(e.finish - e.start for e in trace.told)
    end = trace.told[-1].told_at if trace.told else 0.0
    return {"optimizer": name, "workers": workers, "seed": seed, "ask_time": "charged" if charge_ask else "free",
            "t_hv_s": t_hv, "n_hv": n_hv, "reached": bool(n_hv), "hv_final": hv_curve[-1] / hv_target * target
            if hv_curve else 0.0, "t_hit_s": hit_at[0][0] if hit_at else float("nan"),
            "n_hit": hit_at[0][1] if hit_at else 0, "told": len(trace.told), "started": trace.started,
            "sim_end_s": end, "utilization": busy / (workers * end) if end > 0 else float("nan"),
            "asks": len(trace.asks), "ask_total_s": float(asks.sum()), "ask_mean_s": float(asks.mean()),
            "ask_max_s": float(asks.max()), "stop": trace.stop_reason, "real_s": wall}


def summarize_cluster(frame):
    """Per (ask_time, optimizer, workers): seeds, seeds reaching the hypervolume target, mean
    simulated time to it and evaluations told by then (over the seeds that reached it),
    ``speedup`` = mean time at 1 worker / mean time at W (same optimizer and mode; NaN
    without a 1-worker row), mean time to the best-ratio hit and seeds with a hit, and the
    measured ask seconds (mean total per run, mean per ask). ``t_bound_mean``: mean over the
    seeds that reached the target of ``max(time to target, total ask seconds)`` -- a lower
    bound on the wall time of a serial driver that spends the measured ask time (it cannot
    end before its evaluations nor before its asks); ``speedup_bound`` the same ratio as
    ``speedup`` on it; ``hit_speedup`` the same ratio on ``t_hit_mean`` (means over the seeds
    that hit, which may differ between worker counts)."""
    import pandas as pd

    keys = ["ask_time", "optimizer", "workers"]
    frame = frame.assign(t_bound_s=np.fmax(frame["t_hv_s"], frame["ask_total_s"]).where(frame["reached"]))
    g = frame.groupby(keys, sort=False)
    out = g.agg(seeds=("seed", "nunique"), reached=("reached", "sum"),
                t_hv_mean=("t_hv_s", "mean"), t_hv_max=("t_hv_s", "max"), n_hv_mean=("n_hv", lambda s: s[s > 0].mean()),
                hit=("n_hit", lambda s: int((s > 0).sum())), t_hit_mean=("t_hit_s", "mean"),
                told_mean=("told", "mean"), utilization=("utilization", "mean"),
                ask_total_s=("ask_total_s", "mean"), ask_mean_s=("ask_mean_s", "mean"),
                t_bound_mean=("t_bound_s", "mean")).reset_index()
    index = pd.MultiIndex.from_frame(out[["ask_time", "optimizer"]])
    one = out[out["workers"] == 1].set_index(["ask_time", "optimizer"])
    out.insert(6, "speedup", one["t_hv_mean"].reindex(index).to_numpy() / out["t_hv_mean"].to_numpy())
    out["speedup_bound"] = one["t_bound_mean"].reindex(index).to_numpy() / out["t_bound_mean"].to_numpy()
    out["hit_speedup"] = one["t_hit_mean"].reindex(index).to_numpy() / out["t_hit_mean"].to_numpy()
    return out


def write_summary(out: Path, header: str, frame, footer: str = "") -> None:
    """Write ``<out>.csv`` (the rows) and ``<out>.md`` (``header``, the summary table,
    ``footer``), each atomically (a temporary file renamed over it)."""
    import os

    from benchmarks.search import markdown_table

    frame.to_csv(out.with_suffix(".csv.tmp"), index=False)
    os.replace(out.with_suffix(".csv.tmp"), out.with_suffix(".csv"))
    md = out.with_suffix(".md.tmp")
    md.write_text(header.rstrip("\n") + "\n\n" + markdown_table(summarize_cluster(frame)) + "\n"
                  + (f"\n{footer.strip(chr(10))}\n" if footer.strip() else ""))
    os.replace(md, out.with_suffix(".md"))


def resummarize(out: Path) -> int:
    """Rebuild ``<out>.md``'s table from ``<out>.csv``, keeping the text above and below it."""
    import pandas as pd

    frame = pd.read_csv(out.with_suffix(".csv"))
    lines = out.with_suffix(".md").read_text().splitlines()
    rows = [i for i, ln in enumerate(lines) if ln.startswith("|")]
    first, last = (rows[0], rows[-1] + 1) if rows else (len(lines), len(lines))
    write_summary(out, "\n".join(lines[:first]), frame, "\n".join(lines[last:]))
    print(summarize_cluster(frame).to_string(index=False))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--table", default="benchmarks/data/full_replay.parquet")
    parser.add_argument("--space", default="kvtune/search/spaces/full.yaml")
    parser.add_argument("--optimizers", default="mobo,kvserve,random")
    parser.add_argument("--workers", default="1,8,32")
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--target", type=float, default=0.99, help="fraction of the exhaustive hypervolume")
    parser.add_argument("--q-min", type=float, default=0.97, help="floor of the best-ratio hit (and kvserve's)")
    parser.add_argument("--max-evals", type=int, default=2064, help="most evaluations started per run")
    parser.add_argument("--ask-time", default="free", help="comma-separated: free, charged")
    parser.add_argument("--out", default="benchmarks/results/cluster_sim")
    parser.add_argument("--resummarize", action="store_true",
                        help="rebuild the table of <out>.md from <out>.csv (keeps the md's text above it); no run")
    args = parser.parse_args(argv)
    if args.resummarize:
        return resummarize(Path(args.out))

    import os

    import pandas as pd

    from benchmarks.search import replay_problem
    from kvtune.core.errors import KvtuneError
    from kvtune.search.optimizers import OPTIMIZERS

    try:
        names = [n.strip() for n in args.optimizers.split(",") if n.strip()]
        unknown = [n for n in names if n not in OPTIMIZERS]
        if unknown:
            raise KvtuneError(f"unknown optimizer(s) {unknown}; known: {', '.join(sorted(OPTIMIZERS))}")
        try:
            counts = [int(v) for v in args.workers.split(",") if v.strip()]
        except ValueError:
            raise KvtuneError(f"--workers takes comma-separated integers >= 1, got {args.workers!r}") from None
        modes = [m.strip() for m in args.ask_time.split(",") if m.strip()]
        if not counts or min(counts) < 1 or args.max_evals < 1 or not 0 < args.target <= 1:
            raise KvtuneError("--workers (integers >= 1), --max-evals (>= 1) and --target (0..1] are out of range")
        if not modes or set(modes) - {"free", "charged"}:
            raise KvtuneError(f"--ask-time takes free and/or charged, got {args.ask_time!r}")
        space, replay, problem = replay_problem(args.table, args.space)
        if "eval_seconds" not in replay.table.columns:
            raise KvtuneError(f"replay table {args.table} has no eval_seconds column (measured trial times)")
    except KvtuneError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    ratios = replay.ratios(space)
    for name in names:  # a discarded short run: lazy imports and first-call costs out of the timings
        run_cluster(name, space, replay, seed=10**6, workers=2, max_evals=12, target=args.target,
                    q_min=args.q_min, charge_ask=False, ratios=ratios)
    load0 = " ".join(f"{v:.2f}" for v in os.getloadavg())
    t0 = time.perf_counter()
    rows = []
    for mode in modes:
        for name in names:
            for w in counts:
                for seed in range(args.seeds):
                    row = run_cluster(name, space, replay, seed=seed, workers=w, max_evals=args.max_evals,
                                      target=args.target, q_min=args.q_min, charge_ask=mode == "charged",
                                      ratios=ratios)
                    rows.append(row)
                    print(f"{mode} {name} W={w} seed {seed}: t_hv {row['t_hv_s']:.1f} s after {row['n_hv']} evals, "
                          f"hit {row['t_hit_s']:.1f} s, {row['told']} told, stop {row['stop']}, "
                          f"asks {row['ask_total_s']:.1f} s, real {row['real_s']:.0f} s", flush=True)
    frame = pd.DataFrame(rows)
    summary = summarize_cluster(frame)
    wall = time.perf_counter() - t0
    load1 = " ".join(f"{v:.2f}" for v in os.getloadavg())
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    sec = replay.table["eval_seconds"]
    notes = (f"Problem: {problem}; measured trial times eval_seconds: mean {sec.mean():.2f} s, median "
             f"{sec.median():.2f} s, min {sec.min():.2f} s, max {sec.max():.2f} s (exhaustive serial sum "
             f"{sec.sum():.0f} s). Target: hypervolume {args.target:g} x exhaustive "
             f"({replay.exhaustive_hypervolume():.4f}); hit: exhaustive best feasible ratio at q = {args.q_min:g} "
             f"({replay.best_feasible_ratio(args.q_min):.4f}). Seeds 0..{args.seeds - 1}; at most "
             f"{args.max_evals} evaluations per run; ask time {', '.join(modes)}. Wall time {wall:.0f} s; load "
             f"average {load0} at the start, {load1} at the end (1, 5, 15 min).")
    write_summary(out, f"# Simulated cluster: {problem}\n\n{notes}", frame)
    print(summary.to_string(index=False))
    print("wrote", out.with_suffix(".csv"), out.with_suffix(".md"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
