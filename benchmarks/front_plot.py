"""Compare the fronts of profile runs at one fidelity: a plot and the best ratio per accuracy floor.

Usage::

    python benchmarks/front_plot.py --run before=profiles/default-s7 --run after=profiles/default-s8 \\
        --run ablation=profiles/front-ablation-full --out benchmarks/results/front_issue16

Reads each run's ``trials.parquet`` (the rows evaluated at ``--fidelity``, default ``full``;
``cheap`` for runs searched and not refined at cheap fidelity), writes
``<out>/front.svg`` (compression ratio, log scale, against relative accuracy with its 95 %
bootstrap interval; the 97 % and 99 % floors drawn) and ``<out>/front.md`` (per run, the best
ratio whose interval's lower end clears 99 / 97 / 95 / 90 %, and every policy at that fidelity),
and copies each ``trials.parquet`` next to them as ``<name>.trials.parquet`` so the figures can
be redrawn. Writes are atomic.
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import pandas as pd

from kvtune.core.atomic import atomic_write_text
from kvtune.search.pareto import best_ratio_per_floor

FLOORS = (0.99, 0.97, 0.95, 0.90)


def fidelity_rows(trials: Path, fidelity: str = "full") -> pd.DataFrame:
    """The rows of a run's trials evaluated at ``fidelity``, sorted by compression ratio."""
    t = pd.read_parquet(trials)
    return t[t["fidelity"] == fidelity].sort_values("compression_ratio").reset_index(drop=True)


def markdown(runs: dict[str, pd.DataFrame], fidelity: str = "full") -> str:
    lines = [f"# Fronts at {fidelity} fidelity", "", "Best compression ratio whose 95 % interval's lower end clears each floor:", "",
             "| run | " + " | ".join(f"{int(f * 100)} %" for f in FLOORS) + " |", "|---|" + "---|" * len(FLOORS)]
    for name, rows in runs.items():
        cells = ["-" if r is None else f"{r:.2f}x" for r in best_ratio_per_floor(rows, FLOORS).values()]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    for name, rows in runs.items():
        lines += ["", f"## {name}", "", "| policy | ratio | relative accuracy % (95 % interval) | encode / decode GB/s |",
                  "|---|---:|---|---|"]
        for _, r in rows.iterrows():
            label = str(r["label"]).replace("|", "\\|")
            lines.append(f"| `{label}` | {r.compression_ratio:.2f} | {100 * r.relative_accuracy:.2f} "
                         f"({100 * r.relative_accuracy_lo:.2f}-{100 * r.relative_accuracy_hi:.2f}) | "
                         f"{r.encode_gbps:.3f} / {r.decode_gbps:.3f} |")
    return "\n".join(lines) + "\n"


def plot(runs: dict[str, pd.DataFrame], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for (name, rows), marker in zip(runs.items(), "osD^v"):
        y = 100 * rows["relative_accuracy"]
        err = [y - 100 * rows["relative_accuracy_lo"], 100 * rows["relative_accuracy_hi"] - y]
        ax.errorbar(rows["compression_ratio"], y, yerr=err, fmt=marker, capsize=2, label=name, alpha=0.8)
    for f in (0.97, 0.99):
        ax.axhline(100 * f, color="grey", lw=0.8, ls="--")
    ax.set_xscale("log")
    ax.set_xlabel("compression ratio (bf16 KV bytes / stream bytes)")
    ax.set_ylabel("relative accuracy, % (95 % interval)")
    ax.set_ylim(bottom=max(80.0, min(100 * r["relative_accuracy_lo"].min() for r in runs.values()) - 1))
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    tmp = path.with_suffix(".tmp.svg")
    fig.savefig(tmp)
    tmp.replace(path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--run", action="append", required=True, help="NAME=RUN_FOLDER (repeatable)")
    ap.add_argument("--out", type=Path, required=True, help="output folder")
    ap.add_argument("--fidelity", choices=("full", "cheap"), default="full", help="the trials' fidelity to compare")
    args = ap.parse_args()
    runs = {}
    for spec in args.run:
        name, sep, folder = spec.partition("=")
        if not sep or not (Path(folder) / "trials.parquet").is_file():
            ap.error(f"--run {spec!r}: expected NAME=RUN_FOLDER holding trials.parquet")
        runs[name] = fidelity_rows(Path(folder) / "trials.parquet", args.fidelity)
        if runs[name].empty:
            ap.error(f"--run {spec!r}: no trials at {args.fidelity} fidelity (see --fidelity)")
    args.out.mkdir(parents=True, exist_ok=True)
    for spec in args.run:
        name, _, folder = spec.partition("=")
        shutil.copyfile(Path(folder) / "trials.parquet", args.out / f"{name}.trials.parquet")
    plot(runs, args.out / "front.svg")
    text = markdown(runs, args.fidelity)
    atomic_write_text(args.out / "front.md", text)
    print(text)


if __name__ == "__main__":
    main()
