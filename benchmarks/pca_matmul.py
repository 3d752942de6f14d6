"""The ``pca`` transform's matrix products on real KV: oneDNN's linear against torch's ``matmul``.

Usage::

    python benchmarks/pca_matmul.py --basis pca.safetensors [--kv cache.pt] [--repeats 20] [--threads 1]

* **Data**: the KV of the default model (SmolLM2-135M-Instruct, 30 layers x K and V of
  ``(1, 3, 1024, 64)`` bfloat16) on one essay window, captured as ``benchmarks/codecs.py`` does
  (``--kv`` caches it), and a PCA basis fitted on other windows (``--basis``: loaded, or fitted
  and saved when absent, as ``benchmarks/codecs.py --basis`` does).
* **Measured**, on ``--threads`` torch threads, min over ``--repeats`` runs of all 60 tensors,
  on the ``(tokens, heads * head_dim)`` float32 rows the transform projects (keys pre-RoPE):
  the projection ``rows @ components.T`` and the reconstruction ``coefficients @ components +
  mean`` through :func:`kvtune.codecs.pca.linear` (oneDNN where torch has it) and through
  ``torch.matmul`` / ``torch.addmm`` (MKL's sgemm on x86 builds), in ms per cache and GFLOP/s,
  next to a float32 copy of the same rows (``Tensor.copy_``). The largest difference between
  the two routes' results is printed too (the codec uses one route on both sides).
* The load average is printed next to the figures; run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch

from kvtune.codecs import pca

from bench_common import best_seconds, codecs_script  # noqa: E402  (the folder of this script)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--basis", type=Path, required=True, help="PCA basis file (fitted and saved when absent)")
    ap.add_argument("--kv", type=Path, default=None, help="cache file for the captured KV")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    if args.repeats < 1 or args.threads < 1:
        ap.error("--repeats and --threads must be >= 1")
    torch.set_num_threads(args.threads)
    bench = codecs_script()
    kv = bench.load_kv("cpu", 1, 1024, args.kv)[0]
    basis = pca.lookup(bench.load_or_fit_basis(args.basis, 1, 1024))
    jobs = []
    for layer, (k, v) in enumerate(kv):
        for kind, x in (("key", k), ("value", v)):
            entry = basis.layer(layer, kind, int(x.shape[1]), int(x.shape[3]))
            x = x.float()
            if kind == "key" and basis.key_rope == "pre":
                x = pca.unrotate_keys(x, basis.rope[layer])
            b, h, t, d = x.shape
            rows = (x.permute(0, 2, 1, 3).reshape(b * t, h * d) - entry.mean).contiguous()
            jobs.append((rows, entry.components, entry.mean, torch.empty_like(rows)))
    flop = sum(2 * r.shape[0] * r.shape[1] * c.shape[0] for r, c, _, _ in jobs)
    routes = {
        "project, oneDNN linear": lambda: [pca.linear(r, c) for r, c, _, _ in jobs],
        "project, torch.matmul": lambda: [r @ c.T for r, c, _, _ in jobs],
        "reconstruct, oneDNN linear": lambda: [pca.linear(r, c.T, m) for r, c, m, _ in jobs],
        "reconstruct, torch.addmm": lambda: [torch.addmm(m, r, c) for r, c, m, _ in jobs],
    }
    copy = best_seconds(lambda: [o.copy_(r) for r, _, _, o in jobs], args.repeats)
    print(f"{len(jobs)} tensors of {tuple(jobs[0][0].shape)} float32 rows, {args.threads} thread(s), "
          f"oneDNN linear available: {pca.onednn_linear_available()}, load average {os.getloadavg()[0]:.2f}")
    print(f"float32 copy of the rows: {copy * 1e3:.2f} ms")
    for name, fn in routes.items():
        t = best_seconds(fn, args.repeats)
        print(f"{name:28s} {t * 1e3:7.2f} ms  {flop / t / 1e9:6.1f} GFLOP/s  {t / copy:5.1f}x the copy")
    diff = max(float((pca.linear(r, c) - r @ c.T).abs().max()) for r, c, _, _ in jobs)
    print(f"largest |oneDNN - matmul| of a projected coefficient: {diff:.3g}; load average {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
