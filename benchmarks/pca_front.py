"""Compression / accuracy of the calibrated PCA front (``pca`` + ``dp-alloc``) on the real model.

    OMP_NUM_THREADS=1 nice python benchmarks/pca_front.py [--contexts 8] [--calib 4]
        [--tokens 1024] [--continuation 128] [--bits 1,1.5,2,3,4] [--sink N [--sink-only]]
        [--out benchmarks/results/pca_front.md]

KVTC ("KV Cache Transform Coding for Compact Storage in LLM Inference", arXiv 2511.01815,
sec. 3): a PCA basis per layer across the KV heads, keys fitted pre-RoPE, greedy bit allocation
over components, entropy coding. What is measured:

* **Model / data**: the default model (SmolLM2-135M-Instruct, 30 layers x 3 KV heads x 64) and
  the continuation workload on the default essays, bfloat16 KV (the profile's defaults), with
  ``--contexts + --calib`` windows of ``--tokens`` tokens: the first ``--contexts`` are the
  evaluation contexts (the workload's cheap fidelity), the last ``--calib`` (distinct text) are
  the calibration contexts the basis is fitted on (:func:`kvtune.evaluate.calibrate_pca.calibrate_pca_basis`).
* **Compression ratio**: bfloat16 KV bytes / real stream bytes (every header and metadata byte),
  as the profile reports it.
* **Accuracy**: the continuation workload's relative accuracy (raw, and the bootstrap lower bound
  ``lo``) against the uncompressed cache, as the profile's search evaluates it.
* **Policies**: ``PolicyConfig.kivi(4)`` (reference) and KIVI-2; ``pca`` + ``dp-alloc`` at each
  ``--bits`` with ``range`` and ``bitpack``; variants at 2 bits: post-RoPE keys, per-head bases,
  the min/max grid; ``pca`` + bfloat16 (the transform alone: ~lossless). ``--sink N`` adds
  ``dp-alloc`` with the first N tokens (attention sinks) as bfloat16 coefficients, pre- and
  post-RoPE (``--sink-only``: only those and the references).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from kvtune.codecs import PolicyConfig
from kvtune.codecs.pca import register_basis
from kvtune.evaluate.calibrate_pca import calibrate_pca_basis
from kvtune.evaluate.model import load_model
from kvtune.evaluate.workloads import make_workload
from kvtune.methods.tqc.settings import ProfileSettings


def pca_policy(bits: float | None, codec: str, *, rope: str = "pre", grid: str = "gauss", sink: int = 0) -> PolicyConfig:
    """``pca(rope)`` then ``dp-alloc(bits, grid, sink)`` on K and V (bfloat16 when ``bits`` is None)."""
    quant = {"name": "none"} if bits is None else {"name": "dp-alloc", "bits": bits, "grid": grid, "sink_tokens": sink}
    return PolicyConfig.from_dict({"transforms": [{"name": "pca", "rope": rope}], "key": quant, "value": quant,
                                   "codec": codec})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", type=int, default=8)
    ap.add_argument("--calib", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--continuation", type=int, default=128)
    ap.add_argument("--bits", default="1,1.5,2,3,4")
    ap.add_argument("--sink", type=int, default=0, help="also run dp-alloc with this many bfloat16 sink tokens")
    ap.add_argument("--sink-only", action="store_true", help="only the references and the --sink cases")
    ap.add_argument("--out", default="benchmarks/results/pca_front.md")
    args = ap.parse_args()
    t0 = time.perf_counter()
    lm = load_model(ProfileSettings().model, "cpu")
    settings = ProfileSettings(contexts=args.contexts + args.calib, cheap_samples=args.contexts,
                               context_tokens=args.tokens, continuation_tokens=args.continuation)
    wl = make_workload("continuation", lm, settings=settings)
    calib_ids = wl.cap.input_ids[args.contexts:, : args.tokens]
    digests = {}
    fits = (("pre", "joint"), ("post", "joint")) if args.sink_only else (("pre", "joint"), ("post", "joint"), ("pre", "per_head"))
    for rope, mode in fits:
        basis = calibrate_pca_basis(lm, calib_ids, key_rope=rope, mode=mode)
        digests[(rope, mode)] = register_basis(basis)
    setup = time.perf_counter() - t0

    cases: list[tuple[str, PolicyConfig]] = [("kivi-4 (reference)", PolicyConfig.kivi(4)), ("kivi-2", PolicyConfig.kivi(2))]
    bits_list = [float(b) for b in args.bits.split(",")]
    if args.sink:
        for bits in bits_list:
            for rope in ("pre", "post"):
                cases.append((f"pca {rope}-RoPE + dp-alloc {bits:g} sink {args.sink}",
                              pca_policy(bits, "range", rope=rope, sink=args.sink).with_pca_basis(digests[(rope, "joint")])))
        cases.append((f"pca + dp-alloc 2 minmax sink {args.sink}",
                      pca_policy(2, "range", grid="minmax", sink=args.sink).with_pca_basis(digests[("pre", "joint")])))
    if args.sink_only:
        bits_list = []
    else:
        cases.append(("pca + bf16", pca_policy(None, "bitpack").with_pca_basis(digests[("pre", "joint")])))
    for bits in bits_list:
        for codec in ("range", "bitpack"):
            cases.append((f"pca + dp-alloc {bits:g}", pca_policy(bits, codec).with_pca_basis(digests[("pre", "joint")])))
    cases += [] if args.sink_only else [
        ("pca post-RoPE + dp-alloc 2", pca_policy(2, "range", rope="post").with_pca_basis(digests[("post", "joint")])),
        ("pca per-head + dp-alloc 2", pca_policy(2, "range").with_pca_basis(digests[("pre", "per_head")])),
        ("pca + dp-alloc 2 minmax", pca_policy(2, "range", grid="minmax").with_pca_basis(digests[("pre", "joint")])),
    ]
    rows = []
    for name, cfg in cases:
        r = wl.evaluate(cfg, fidelity="cheap")
        rows.append((name, cfg, r))
        print(f"{name:34s} {cfg.codec.name:8s} CR {r['compression_ratio']:6.2f}x  acc {100 * r['relative_accuracy_raw']:6.2f}% "
              f"(lo {100 * r['relative_accuracy_lo']:6.2f})  {r['eval_seconds']:.0f}s", flush=True)

    lines = [
        "# PCA front (pca + dp-alloc) on SmolLM2-135M-Instruct",
        "",
        f"`OMP_NUM_THREADS=1 nice python benchmarks/pca_front.py --contexts {args.contexts} --calib {args.calib} "
        f"--tokens {args.tokens} --continuation {args.continuation} --bits {args.bits}"
        + (f" --sink {args.sink}" if args.sink else "") + (" --sink-only" if args.sink_only else "") + "`",
        "",
        f"Continuation workload, {args.contexts} evaluation contexts of {args.tokens} tokens (+{args.continuation} "
        f"scored), bfloat16 KV; bases fitted on {args.calib} other contexts of {args.tokens} tokens "
        f"(setup incl. model load, prefill and {len(fits)} fits: {setup:.0f} s). Ratio = bf16 KV bytes / stream bytes; "
        "accuracy = relative accuracy raw (bootstrap lower bound).",
        "",
        "| policy | codec | label | compression ratio | rel. accuracy % | lo % | bits/elem |",
        "|---|---|---|---:|---:|---:|---:|",
    ]
    for name, cfg, r in rows:
        lines.append(f"| {name} | {cfg.codec.name} | `{cfg.label}` | {r['compression_ratio']:.2f} | "
                     f"{100 * r['relative_accuracy_raw']:.2f} | {100 * r['relative_accuracy_lo']:.2f} | "
                     f"{r['bits_per_element']:.3f} |")
    lines += ["", "Bases: " + ", ".join(f"{rope}/{mode} `{d[:12]}`" for (rope, mode), d in digests.items()), ""]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    main()
