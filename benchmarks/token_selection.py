"""Token selection (``keep``) on the real model: accuracy and ratio with and without it.

    OMP_NUM_THREADS=1 nice -n 10 python benchmarks/token_selection.py [--contexts 8] [--calib 4]
        [--tokens 1024] [--continuation 64] [--fraction 0.7] [--out benchmarks/results/token_selection.md]

What is measured (issue 16, item 4):

* **Model / data**: the default model (SmolLM2-135M-Instruct) and the continuation workload on
  the default essays, bfloat16 KV, ``--contexts`` evaluation contexts (the cheap fidelity) of
  ``--tokens`` tokens; a PCA basis for the ``kvtc-3`` preset fitted on ``--calib`` other windows
  (:func:`kvtune.evaluate.calibrate_pca.calibrate_pca_basis`, pre-RoPE keys, across heads).
* **Policies**: the presets ``kivi-4`` and ``kvtc-3`` alone, then each behind ``keep``
  (``--fraction``, 4 sink and 32 recent tokens) with every score of
  :data:`kvtune.codecs.select.SCORES`: ``key-norm`` (lowest L2 norm keys, arXiv 2406.11430) and
  ``window-attention`` (SnapKV-like attention mass from the last 32 keys as proxy queries,
  arXiv 2404.14469 sec. 4).
* **Ratio**: bfloat16 KV bytes / real stream bytes (the kept-token masks included);
  **accuracy**: the workload's relative accuracy (raw and the bootstrap lower bound).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import time
from pathlib import Path
from typing import Any

import torch

from kvtune.codecs import PolicyConfig
from kvtune.codecs.pca import register_basis
from kvtune.codecs.presets import load_presets
from kvtune.codecs.select import SCORES, Keep
from kvtune.core.atomic import atomic_write_bytes
from kvtune.evaluate.calibrate_pca import calibrate_pca_basis
from kvtune.evaluate.model import load_model
from kvtune.evaluate.workloads import make_workload
from kvtune.methods.tqc.settings import ProfileSettings


def with_keep(cfg: PolicyConfig, keep: Keep) -> PolicyConfig:
    """``cfg`` with ``keep`` in front of its transforms."""
    return dataclasses.replace(cfg, transforms=(keep, *cfg.transforms))


def workload_and_basis(args: argparse.Namespace) -> tuple[Any, str]:
    """The continuation workload over the evaluation then calibration windows on the default
    model, and the digest of kvtc-3's PCA basis (pre-RoPE, across heads) fitted on the latter."""
    lm = load_model(ProfileSettings().model, "cpu")
    wl = make_workload("continuation", lm, settings=ProfileSettings(
        contexts=args.contexts + args.calib, cheap_samples=args.contexts, context_tokens=args.tokens,
        continuation_tokens=args.continuation))
    calibration = wl.cap.input_ids[args.contexts:, : args.tokens]
    return wl, register_basis(calibrate_pca_basis(lm, calibration, key_rope="pre"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", type=int, default=8)
    ap.add_argument("--calib", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--continuation", type=int, default=64)
    ap.add_argument("--fraction", type=float, default=0.7)
    ap.add_argument("--out", default="benchmarks/results/token_selection.md")
    args = ap.parse_args()
    t0 = time.perf_counter()
    wl, digest = workload_and_basis(args)
    setup = time.perf_counter() - t0
    presets = load_presets(skip_unavailable=True)
    bases = {"kivi-4": presets["kivi-4"], "kvtc-3": presets["kvtc-3"].with_pca_basis(digest)}
    rows = []
    for name, base in bases.items():
        cases = [(name, "-", base)] + [(name, score, with_keep(base, Keep(fraction=args.fraction, score=score)))
                                      for score in SCORES]
        for preset, score, cfg in cases:
            r = wl.evaluate(cfg, fidelity="cheap")
            rows.append((preset, score, cfg, r))
            print(f"{preset:8s} keep {score:17s} CR {r['compression_ratio']:6.2f}x  acc {100 * r['relative_accuracy_raw']:6.2f}% "
                  f"(lo {100 * r['relative_accuracy_lo']:6.2f})  {r['eval_seconds']:.0f}s", flush=True)
    load = os.getloadavg()
    lines = [
        "# Token selection (keep) on SmolLM2-135M-Instruct",
        "",
        f"`OMP_NUM_THREADS=1 nice -n 10 python benchmarks/token_selection.py --contexts {args.contexts} --calib "
        f"{args.calib} --tokens {args.tokens} --continuation {args.continuation} --fraction {args.fraction}`",
        "",
        f"Continuation workload, {args.contexts} evaluation contexts of {args.tokens} tokens (+{args.continuation} "
        f"scored), bfloat16 KV; kvtc-3's PCA basis (pre-RoPE, across heads) fitted on {args.calib} other contexts "
        f"(setup incl. model load, prefill and fit: {setup:.0f} s; total {time.perf_counter() - t0:.0f} s; "
        f"load average at the end {load[0]:.2f} / {load[1]:.2f} / {load[2]:.2f}). keep: fraction {args.fraction}, "
        "4 sink and 32 recent tokens. Ratio = bf16 KV bytes / stream bytes (kept-token masks included); "
        "accuracy = relative accuracy raw (bootstrap lower bound).",
        "",
        "| preset | keep score | label | compression ratio | rel. accuracy % | lo % |",
        "|---|---|---|---:|---:|---:|",
    ]
    for preset, score, cfg, r in rows:
        label = cfg.label.replace("|", "\\|")  # a Markdown table cell
        lines.append(f"| {preset} | {score} | `{label}` | {r['compression_ratio']:.2f} | "
                     f"{100 * r['relative_accuracy_raw']:.2f} | {100 * r['relative_accuracy_lo']:.2f} |")
    lines += ["", f"Basis: pre/joint `{digest[:12]}`", ""]
    text = "\n".join(lines)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(out, text.encode())  # a killed run leaves the previous table whole
    print(text)


if __name__ == "__main__":
    with torch.inference_mode():
        main()
