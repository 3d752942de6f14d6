"""Benchmark the search optimizers against a replay table with a known answer (issue 4).

Every optimizer runs for ``--seeds`` seeds at budgets of ``--budgets`` (fractions of the
space) against a table of fully evaluated candidates, and is scored on

(a) hypervolume of the evaluated trials / hypervolume of the exhaustive front (normalized
    objectives, fixed reference point: accuracy 0.5, ratio 1.0, latency 1.1 x the table's
    worst, latency divided by the table's worst -- :class:`kvtune.search.optimizers.replay.HypervolumeSpec`);
(b) best feasible ratio found at each ``--q-mins`` floor (``relative_accuracy_lo >= q``) /
    the exhaustive best, and the number of seeds that hit the exhaustive best exactly;
(c) optimizer wall time per iteration (ask + tell, excluding the evaluation).

Real table (once ``kvtune/search/spaces/full.yaml`` has been evaluated exhaustively)::

    python benchmarks/search.py --table benchmarks/data/full_replay.parquet \\
        --space kvtune/search/spaces/full.yaml --seeds 10 --budgets 0.01,0.02,0.05,0.1 \\
        --out benchmarks/results/search

(MixHQ head scores from ``benchmarks/data/full_replay_calibration.json``, next to the table.)
The default space of session 15 (`benchmarks/spaces/default_s15.yaml`: every `dp-alloc` budget per
layer) has its own table (every candidate at the profile's cheap search fidelity,
from an exhaustive run; its PCA basis digest in
``benchmarks/data/default_replay_calibration.json``)::

    python benchmarks/search.py --table benchmarks/data/default_replay.parquet \\
        --space benchmarks/spaces/default_s15.yaml --optimizers mobo,random --seeds 10 --budgets 0.1117,0.1564 \\
        --out benchmarks/results/search_default

(40 and 56 evaluations: the profile's search budget, and that plus its 16 refinement slots.)

Synthetic problem with a known answer (2,025 candidates, :mod:`kvtune.search.optimizers.synthetic`)::

    python benchmarks/search.py --synthetic --seeds 10 --out benchmarks/results/synthetic

Batch asks (``--batch 1,4,8``): each optimizer also runs asking ``q`` candidates at a time
(``ask_batch``, all told before the next batch), at the same numbers of evaluations; the
script prints and writes (``<out>_batch.md``) the mean hypervolume relative to ``q = 1`` and
the hits at each floor per batch size::

    python benchmarks/search.py --optimizers mobo,kvserve,random --q-mins 0.97 --batch 1,4,8 \
        --seeds 10 --budgets 0.02,0.05 --out benchmarks/results/search_batch

Writes ``<out>.csv`` (one row per optimizer x seed x budget), ``<out>.md`` (summary table) and
``<out>.html`` (convergence plot, plotly, opens offline).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without installing

DEFAULT_OPTIMIZERS = "mobo,kvserve,random,optuna-tpe,optuna-nsga2,optuna-gp"


def _floats(text: str) -> list[float]:
    return [float(v) for v in text.split(",") if v.strip()]


def markdown_table(frame) -> str:
    """A pandas frame as a Markdown table (floats to 3 decimals; no tabulate needed)."""
    def cell(v) -> str:
        return f"{v:.3f}" if isinstance(v, float) else str(v)

    rows = [" | ".join(map(str, frame.columns)), " | ".join("---" for _ in frame.columns)]
    rows += [" | ".join(cell(v) for v in r) for r in frame.itertuples(index=False)]
    return "\n".join(f"| {r} |" for r in rows)


def replay_problem(table: str, space_path: str, calibration: str | None = None):
    """``(space, replay, description)`` of a real replay table and the space it was made from.

    A space with MixHQ or PCA candidates gets the head scores and the PCA basis digests of
    ``calibration`` (a run's ``calibration.json``; default: ``<table stem>_calibration.json``
    next to the table); both are part of the policy ids. PCA candidates of a calibration without
    ``pca_bases`` keep no digest, so the table (made before the space had them) leaves them out. The
    space is cut to the candidates the table holds (:meth:`SearchSpace.subset`): a table
    evaluated before the space file gained candidates still replays its own.

    Raises:
        KvtuneError: the calibration file is missing or not a kvtune calibration.json, or the
            space/table cannot be loaded.
    """
    from kvtune.core.errors import KvtuneError
    from kvtune.search.optimizers.replay import ReplayObjective
    from kvtune.search.space import load_space

    space = load_space(space_path)
    if space.needs_head_scores or space.needs_pca_basis:
        import json

        from kvtune.evaluate.calibrate import HeadScores

        cal = Path(calibration) if calibration else Path(table).with_name(Path(table).stem + "_calibration.json")
        if not cal.is_file():
            raise KvtuneError(f"space {space.name} has calibrated (MixHQ or PCA) candidates: pass --calibration "
                              f"(the run's calibration.json); {cal} does not exist")
        try:
            doc = json.loads(cal.read_text(encoding="utf-8"))
            if space.needs_head_scores:
                space = space.with_head_scores(HeadScores.from_dict(doc["head_scores"]).scores)
            if space.needs_pca_basis and "pca_bases" in doc:  # digests only: a replay never encodes
                digests = {rope: doc["pca_bases"][rope]["digest"] for rope in space.pca_ropes_missing}
                space = space.with_pca_basis(digests)
        except (ValueError, KeyError, TypeError) as exc:
            raise KvtuneError(f"{cal}: not a kvtune calibration.json with what {space.name} needs ({exc!r})") from None
    replay = ReplayObjective.from_parquet(table)
    # candidates the space gained after the table was evaluated (full.yaml's dp-alloc branch) are
    # left out: the replay answers the table's own candidates
    n_space = len(space)
    space = space.subset(replay.table["policy_id"])
    left = f", {n_space - len(space)} not in the table left out" if len(space) < n_space else ""
    return space, replay, f"{Path(table).name} on {space.name} ({len(space)} candidates{left})"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    src = parser.add_argument_group("problem")
    src.add_argument("--table", default="benchmarks/data/full_replay.parquet",
                     help="replay table (Parquet: policy_id + trial result columns)")
    src.add_argument("--space", default="kvtune/search/spaces/full.yaml", help="search space the table was made from")
    src.add_argument("--calibration", default=None,
                     help="calibration.json of the run that made the table (MixHQ head scores; their values are "
                          "part of the policy ids); default: <table stem>_calibration.json when it exists")
    src.add_argument("--synthetic", action="store_true",
                     help="use the generated synthetic problem instead of --table/--space")
    src.add_argument("--synthetic-size", default="full", choices=["full", "medium", "small"])
    src.add_argument("--synthetic-seed", type=int, default=0)
    parser.add_argument("--optimizers", default=DEFAULT_OPTIMIZERS, help=f"comma-separated (default {DEFAULT_OPTIMIZERS})")
    parser.add_argument("--seeds", type=int, default=10)
    parser.add_argument("--budgets", default="0.01,0.02,0.05,0.1", help="fractions of the space")
    parser.add_argument("--q-mins", default="0.97,0.99", help="accuracy floors for the best-ratio metric")
    parser.add_argument("--batch", default="1", help="comma-separated batch sizes q (default 1)")
    parser.add_argument("--no-ratios", action="store_true", help="do not give optimizers the up-front ratios")
    parser.add_argument("--out", default="benchmarks/results/search", help="output path without suffix")
    args = parser.parse_args(argv)

    from kvtune.core.errors import KvtuneError
    from kvtune.search.optimizers import OPTIMIZERS
    from kvtune.search.optimizers.bench import run_search_benchmark, summarize, write_outputs
    from kvtune.search.optimizers.replay import ReplayObjective

    try:
        if args.synthetic:
            from kvtune.search.optimizers.synthetic import synthetic_problem

            space, table = synthetic_problem(args.synthetic_size, seed=args.synthetic_seed)
            replay = ReplayObjective(table, source=f"<synthetic {args.synthetic_size}>")
            problem = f"synthetic-{args.synthetic_size} ({len(space)} candidates)"
        else:
            space, replay, problem = replay_problem(args.table, args.space, args.calibration)
        names = [n.strip() for n in args.optimizers.split(",") if n.strip()]
        unknown = [n for n in names if n not in OPTIMIZERS]
        if unknown:
            raise KvtuneError(f"unknown optimizer(s) {unknown}; known: {', '.join(sorted(OPTIMIZERS))}")
        q_mins = _floats(args.q_mins)
        try:
            batches = [int(v) for v in args.batch.split(",") if v.strip()]
        except ValueError:
            raise KvtuneError(f"--batch takes comma-separated integers >= 1, got {args.batch!r}") from None
        if not batches or min(batches) < 1:
            raise KvtuneError(f"--batch takes comma-separated integers >= 1, got {args.batch!r}")
        t0 = time.perf_counter()
        results, runs = run_search_benchmark(space, replay, optimizers=names, seeds=args.seeds,
                                             budgets=_floats(args.budgets), q_mins=q_mins,
                                             use_ratios=not args.no_ratios,
                                             progress=lambda msg: print(msg, flush=True), batches=batches)
    except KvtuneError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    best = ", ".join(f"q={q:g}: {replay.best_feasible_ratio(q):.4f}" for q in q_mins)
    notes = (f"Problem: {problem}. Exhaustive hypervolume {replay.exhaustive_hypervolume():.4f} "
             f"(normalized units); exhaustive best feasible ratio {best}. {args.seeds} seeds; "
             f"wall time {time.perf_counter() - t0:.0f} s.")
    paths = write_outputs(results, runs, replay, args.out, title=f"kvtune search benchmark: {problem}",
                          q_mins=q_mins, notes=notes)
    print(summarize(results).to_string(index=False))
    if len(batches) > 1:
        import os

        from kvtune.search.optimizers.bench import batch_comparison

        table = batch_comparison(results)
        load = " ".join(f"{v:.2f}" for v in os.getloadavg())
        md = Path(args.out).with_name(Path(args.out).name + "_batch.md")
        md.write_text(f"# Batch asks: {problem}\n\n{notes} Batch sizes {batches}; load average at the end "
                      f"{load} (1, 5, 15 min).\n\n" + markdown_table(table) + "\n")
        print(table.to_string(index=False))
        paths["batch"] = str(md)
    print("wrote", ", ".join(paths.values()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
