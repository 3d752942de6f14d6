"""Why one budget for the whole model: per layer vs model-wide, with and without the sensitivity.

    OMP_NUM_THREADS=1 nice python benchmarks/layer_budget.py [--fidelity full]
        [--budgets 1/2,0.75/2,1/2.5] [--out benchmarks/results/layer_budget.md]

On the default model and workload (SmolLM2-135M-Instruct, continuation on the default essays, the
profile's contexts and calibration windows), ``pca`` + ``dp-alloc`` on the ``ecsq`` grid with one
bf16 sink token, rANS coded, at each ``K/V`` pair of ``--budgets`` (bits of modelled entropy):

* ``layer``: the same budget in every layer (``budget="layer"``);
* ``model, unweighted``: one budget over all layers with every layer's sensitivity set to 1
  (one step for the whole model: plain squared error, summed over layers);
* ``model``: one budget over all layers, each layer's distortion weighted by its calibrated
  sensitivity (:func:`kvtune.evaluate.calibrate_pca.layer_sensitivity`; ``budget="model"``).

Real streams (every byte counted) and the workload's relative accuracy with its 95 % interval;
also the per-layer sensitivities relative to their mean.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from pathlib import Path

import torch

from kvtune.codecs import PolicyConfig
from kvtune.codecs.pca import register_basis
from kvtune.core.atomic import atomic_write_text
from kvtune.evaluate.calibrate_pca import calibrate_pca_basis
from kvtune.evaluate.model import load_model
from kvtune.evaluate.workloads import make_workload
from kvtune.methods.tqc.settings import ProfileSettings


def policy(digest: str, key_bits: float, value_bits: float, budget: str) -> PolicyConfig:
    quant = {"name": "dp-alloc", "grid": "ecsq", "sink_tokens": 1, "budget": budget}
    return PolicyConfig.from_dict({"transforms": ["pca"], "key": {**quant, "bits": key_bits},
                                   "value": {**quant, "bits": value_bits}, "codec": "rans"}).with_pca_basis(digest)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fidelity", default="full", choices=["cheap", "full"])
    ap.add_argument("--budgets", default="1/2,0.75/2,1/2.5", help="comma-separated key/value bits")
    ap.add_argument("--out", default="benchmarks/results/layer_budget.md")
    args = ap.parse_args()
    budgets = [tuple(float(b) for b in pair.split("/")) for pair in args.budgets.split(",")]
    t0 = time.perf_counter()
    settings = ProfileSettings()
    lm = load_model(settings.model, "cpu")
    wl = make_workload("continuation", lm, settings=settings)
    basis = calibrate_pca_basis(lm, wl.pca_calibration_ids(), key_rope="pre")
    weighted = register_basis(basis)
    flat = register_basis(dataclasses.replace(basis, sensitivity=((1.0, 1.0),) * len(basis.layers)))
    setup = time.perf_counter() - t0
    print(f"setup {setup:.0f} s", flush=True)
    rows = []
    for kb, vb in budgets:
        for name, digest, budget in (("layer", weighted, "layer"), ("model, unweighted", flat, "model"),
                                     ("model", weighted, "model")):
            r = wl.evaluate(policy(digest, kb, vb, budget), fidelity=args.fidelity)
            rows.append((kb, vb, name, r))
            print(f"K {kb:g} / V {vb:g}  {name:18s} {r['compression_ratio']:6.2f}x  {100 * r['relative_accuracy_raw']:6.2f} % "
                  f"({100 * r['relative_accuracy_lo']:.2f}-{100 * r['relative_accuracy_hi']:.2f})", flush=True)
    sens = torch.tensor(basis.sensitivity, dtype=torch.float64)
    rel = sens / sens.mean(0)
    lines = [
        "# One dp-alloc budget per layer or for the whole model",
        "",
        f"`OMP_NUM_THREADS=1 nice python benchmarks/layer_budget.py --fidelity {args.fidelity} --budgets {args.budgets}`",
        "",
        f"SmolLM2-135M-Instruct, continuation workload, {wl.num_samples(args.fidelity)} contexts, bfloat16 KV; "
        f"`pca` (pre-RoPE keys, basis and sensitivities from the profile's 4 calibration windows) + `dp-alloc` "
        f"ecsq, 1 sink token, rANS; real streams (setup incl. model load, prefill and calibration: {setup:.0f} s).",
        "",
        "| keys / values (bits) | budget | compression ratio | relative accuracy % (95 % interval) |",
        "|---|---|---:|---|",
    ]
    for kb, vb, name, r in rows:
        lines.append(f"| {kb:g} / {vb:g} | {name} | {r['compression_ratio']:.2f} | {100 * r['relative_accuracy_raw']:.2f} "
                     f"({100 * r['relative_accuracy_lo']:.2f}-{100 * r['relative_accuracy_hi']:.2f}) |")
    lines += ["", "Sensitivity per layer relative to the mean of its kind (layers 0..L-1):", "",
              "| kind | " + " | ".join(str(i) for i in range(len(rel))) + " |", "|---|" + "---:|" * len(rel)]
    for j, kind in enumerate(("key", "value")):
        lines.append(f"| {kind} | " + " | ".join(f"{v:.2f}" for v in rel[:, j].tolist()) + " |")
    atomic_write_text(Path(args.out), "\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    main()
