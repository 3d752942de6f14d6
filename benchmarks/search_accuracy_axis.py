"""Compare ``mobo``'s two hypervolume accuracy axes on a replay table with a known answer.

``mobo`` maximizes the hypervolume of the (accuracy, ratio, latency) front; its accuracy axis is
either accuracy itself (``linear``) or the GP's warped accuracy ``z = -log(1.01 - accuracy)``
(``warped``, the default; :mod:`kvtune.search.optimizers.mobo`, rule 3). Each axis runs for
``--seeds`` seeds at budgets of 2 % and 5 % of the space against the exhaustively evaluated
table, scored as in ``benchmarks/search.py``: hypervolume / the exhaustive one (linear axis,
normalized objectives) and the best ratio found whose interval clears 97 % and 99 % / the
exhaustive best (and the seeds that hit it)::

    python benchmarks/search_accuracy_axis.py --table benchmarks/data/full_replay.parquet \\
        --space kvtune/search/spaces/full.yaml --seeds 10 --out benchmarks/results/search_accuracy_axis.md
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without installing
sys.path.insert(0, str(ROOT / "benchmarks"))

AXES = ("linear", "warped")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--table", default=str(ROOT / "benchmarks/data/full_replay.parquet"))
    ap.add_argument("--space", default=str(ROOT / "kvtune/search/spaces/full.yaml"))
    ap.add_argument("--seeds", type=int, default=10)
    ap.add_argument("--budgets", default="0.02,0.05", help="fractions of the space, comma-separated")
    ap.add_argument("--out", type=Path, default=None, help="markdown summary to write")
    args = ap.parse_args(argv)

    import pandas as pd
    from search import markdown_table, replay_problem

    from kvtune.search.optimizers.bench import run_search_benchmark, summarize

    space, replay, desc = replay_problem(args.table, args.space)
    budgets = tuple(float(b) for b in args.budgets.split(",") if b.strip())
    load0 = os.getloadavg()
    frames = []
    for axis in AXES:
        t0 = time.perf_counter()
        res, _ = run_search_benchmark(space, replay, optimizers=["mobo"], seeds=args.seeds, budgets=budgets,
                                      options={"mobo": {"accuracy_axis": axis}})
        res["optimizer"] = f"mobo {axis}"
        frames.append(res)
        print(f"{axis}: {time.perf_counter() - t0:.0f} s", flush=True)
    table = summarize(pd.concat(frames, ignore_index=True))
    load1 = os.getloadavg()
    text = "\n".join([
        f"# mobo accuracy axis: {desc}",
        "",
        f"{args.seeds} seeds per axis; load average {load0[0]:.2f} at start, {load1[0]:.2f} at end "
        "(the overheads are wall time per ask + tell on a shared machine).",
        "",
        markdown_table(table),
        "",
    ])
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text, encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
