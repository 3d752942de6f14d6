"""Rate against squared error of ``dp-alloc``'s three grids on the real PCA coefficients.

    OMP_NUM_THREADS=1 nice python benchmarks/ecsq_rate_distortion.py [--contexts 4] [--calib 4]
        [--tokens 1024] [--layers 0,3,...,27] [--out benchmarks/results/ecsq_rate_distortion.md]

The ``ecsq`` grid (:func:`kvtune.codecs.bitalloc.allocate_ecsq`) shares one uniform step per
layer for an entropy coder (Gish & Pierce, IEEE Trans. Inf. Theory 1968); ``gauss`` and
``minmax`` allocate fixed-rate widths (:func:`kvtune.codecs.bitalloc.allocate_bits`; KVTC, arXiv
2511.01815, sec. 3). What is measured, per kind (keys, values) over ``--layers`` of the default
model (SmolLM2-135M-Instruct):

* **Data**: the KV of ``--contexts`` essay windows of ``--tokens`` tokens, projected on a
  pre-RoPE PCA basis fitted on ``--calib`` other windows (the profile's calibration).
* **Rate**: bits per element = the per-component empirical entropy of the symbols (what the
  ``rans`` codec's per-channel model approaches) plus 32 bits of float16 mean and step per coded
  component and context; no sink tokens.
* **Distortion**: mean squared error per element of the coefficients (the basis is orthonormal,
  so it is also the KV's), dropped components counted at their full energy about 0.
* **Budgets**: ``gauss`` / ``minmax`` at 1-4.5 bits; ``ecsq`` at 0.5-4.5 bits of modelled
  entropy, coded by :class:`~kvtune.codecs.bitalloc.DPAlloc` exactly as a stream would.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
import torch

from kvtune.codecs.bitalloc import DPAlloc
from kvtune.codecs.pca import PCA, register_basis
from kvtune.evaluate.calibrate_pca import calibrate_pca_basis
from kvtune.evaluate.model import load_model
from kvtune.evaluate.workloads import make_workload
from kvtune.methods.tqc.settings import ProfileSettings

BUDGETS = {"gauss": (1, 1.5, 2, 2.5, 3, 3.5, 4, 4.5), "minmax": (1, 1.5, 2, 2.5, 3, 3.5, 4, 4.5),
           "ecsq": (0.5, 0.75, 1, 1.5, 2, 2.5, 3, 3.5, 4, 4.5)}


def entropy_bits(symbols: np.ndarray) -> float:
    """Sum over the columns of ``(tokens, n)`` uint8 ``symbols`` of tokens x their empirical entropy."""
    total = 0.0
    for col in symbols.T:
        p = np.bincount(col).astype(np.float64)
        p = p[p > 0] / col.size
        total += float(-(p * np.log2(p)).sum()) * col.size
    return total


def measure(q: DPAlloc, y: torch.Tensor, layer: int, kind: str) -> tuple[float, float]:
    """``(bits, squared error)`` summed over the tensor ``y`` ``(contexts, heads, tokens, dim)``."""
    bits = err = 0.0
    for b in range(y.shape[0]):
        x = y[b : b + 1]
        qt = q.quantize(x, layer=layer, kind=kind)
        for p in qt.parts:
            sym = np.asarray(p.symbols).reshape(p.segment.shape[2], p.segment.shape[3])
            bits += entropy_bits(sym) + 32 * p.segment.shape[3]
        err += float((q.dequantize(qt, layer=layer, kind=kind) - x).square().sum())
    return bits, err


def window_arguments(doc: str, out: str) -> argparse.Namespace:
    """The command line shared with ``benchmarks/ecsq_headroom.py``: ``--contexts``, ``--calib``,
    ``--tokens``, ``--layers`` and ``--out`` (default ``out``)."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--contexts", type=int, default=4)
    ap.add_argument("--calib", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--layers", default=",".join(str(i) for i in range(0, 30, 3)))
    ap.add_argument("--out", type=Path, default=Path(out))
    return ap.parse_args()


def calibrated_windows(args: argparse.Namespace):
    """``(model, workload, basis)``: the default model, ``args.contexts + args.calib`` essay windows
    of ``args.tokens`` tokens prefilled, and a pre-RoPE PCA basis fitted on the last ``args.calib``."""
    lm = load_model(ProfileSettings().model, "cpu")
    settings = ProfileSettings(contexts=args.contexts + args.calib, cheap_samples=args.contexts,
                               context_tokens=args.tokens, continuation_tokens=2)
    wl = make_workload("continuation", lm, settings=settings)
    return lm, wl, calibrate_pca_basis(lm, wl.cap.input_ids[args.contexts:, : args.tokens])


def main() -> None:
    args = window_arguments(__doc__, "benchmarks/results/ecsq_rate_distortion.md")
    t0 = time.perf_counter()
    _, wl, basis = calibrated_windows(args)
    digest = register_basis(basis)
    pca = PCA(basis=digest)
    layers = [int(v) for v in args.layers.split(",")]
    sums: dict[tuple[str, str, float], list[float]] = {}
    for layer in layers:
        for kind, x in zip(("key", "value"), wl.cap.kv[layer]):
            y = pca.forward(x[: args.contexts].float(), layer=layer, kind=kind)
            for grid, budgets in BUDGETS.items():
                for bits in budgets:
                    r = measure(DPAlloc(bits=bits, grid=grid, basis=digest), y, layer, kind)
                    acc = sums.setdefault((kind, grid, bits), [0.0, 0.0, 0.0])
                    acc[0] += r[0]
                    acc[1] += r[1]
                    acc[2] += y.numel()
        print(f"layer {layer} done, {time.perf_counter() - t0:.0f} s", flush=True)
    lines = ["# Rate against squared error of dp-alloc's grids (SmolLM2-135M-Instruct, real PCA coefficients)", "",
             f"`python benchmarks/ecsq_rate_distortion.py --contexts {args.contexts} --calib {args.calib} "
             f"--tokens {args.tokens} --layers {args.layers}` ({time.perf_counter() - t0:.0f} s). Bits per element: "
             "per-component empirical entropy of the symbols + float16 mean and step; MSE per coefficient.", ""]
    for kind in ("key", "value"):
        lines += [f"## {kind}s", "", "| grid | budget (bits) | bits / element | MSE |", "|---|---:|---:|---:|"]
        for (k, grid, bits), (b, e, n) in sorted(sums.items(), key=lambda kv: (kv[0][1], kv[0][2])):
            if k == kind:
                lines.append(f"| {grid} | {bits:g} | {b / n:.3f} | {e / n:.5f} |")
        lines.append("")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    main()
