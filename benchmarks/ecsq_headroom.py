"""How much ratio is left beyond PCA + ``ecsq`` + per-component rANS: two upper bounds.

    OMP_NUM_THREADS=1 nice python benchmarks/ecsq_headroom.py [--contexts 4] [--calib 4]
        [--tokens 1024] [--layers 0,3,...,27] [--out benchmarks/results/ecsq_headroom.md]

On the default model (SmolLM2-135M-Instruct), with the KV of ``--contexts`` essay windows
projected on a pre-RoPE PCA basis fitted on ``--calib`` other windows (as
``benchmarks/ecsq_rate_distortion.py``):

1. **Context modelling across tokens.** The ``rans`` codec codes each component's symbols with
   one order-0 table (CacheGen, arXiv 2310.07240, sec. 5.2). CacheGen's delta coding and any
   context model exploit similarity between neighbouring tokens. For ``dp-alloc`` ``ecsq`` at
   the 97 % and 99 % policies' budgets (keys 1 / values 2.5 bits, keys 1.5 / values 3.5 bits),
   the script compares the per-component empirical entropy ``H(s_t)`` with ``H(s_t - s_{t-1})``
   (a delta coder) and with ``H(s_t | c_t)`` for the previous token's symbol as context:
   its sign about the component's centre (3 contexts) or its offset clipped to -3..3 (7).
   The conditional entropies ignore the tables a coder would send per context, so they bound
   the gain from above.
2. **An output-aware metric for values.** An error ``e`` in a value vector reaches the layer's
   output through ``W_o`` (grouped-query attention: the query heads sharing the KV head), so
   the error that matters is ``|| M^(1/2) e ||`` with ``M = sum_i W_o,i^T W_o,i`` over those
   heads, not ``|| e ||``. Whitening by ``M`` before the PCA (a weighted-metric PCA, as the
   activation-aware SVDs of ASVD, arXiv 2312.05821, and SVD-LLM, arXiv 2403.07378, weight
   theirs by the data; here the weight is the output projection) makes plain squared error in
   the new coefficients equal to that weighted error. The script quantizes the values'
   coefficients of both bases with one uniform step (ecsq), at steps spanning 0.5-7 bits per
   element, and reports the rate (per-component empirical entropy) each needs for equal
   weighted squared error.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np
import torch

from kvtune.codecs.bitalloc import DPAlloc
from kvtune.codecs.pca import PCA, register_basis

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ecsq_rate_distortion import calibrated_windows, window_arguments  # noqa: E402

POLICIES = ((1.0, 2.5), (1.5, 3.5))  # (key bits, value bits) of the 97 % and 99 % policies
STEPS = np.geomspace(0.01, 4.0, 24)  # uniform steps for the output-aware comparison


def column_entropy_bits(sym: np.ndarray) -> float:
    """Sum over the columns of int64 ``(tokens, n)`` ``sym`` of tokens x their empirical entropy."""
    total = 0.0
    for col in sym.T:
        _, counts = np.unique(col, return_counts=True)
        p = counts / col.size
        total -= float((counts * np.log2(p)).sum())
    return total


def conditional_bits(sym: np.ndarray, ctx: np.ndarray) -> float:
    """``sum_c n_c H(s | c)`` per column of ``(tokens, n)`` ``sym`` given same-shape ``ctx``."""
    total = 0.0
    for col, c in zip(sym.T, ctx.T):
        for v in np.unique(c):
            total += column_entropy_bits(col[c == v][:, None])
    return total


def context_rates(q: DPAlloc, y: torch.Tensor, layer: int, kind: str) -> np.ndarray:
    """``[H0, delta, sign context, 7 contexts]`` in bits, summed over the contexts of ``y``."""
    out = np.zeros(4)
    for b in range(y.shape[0]):
        for part in q.quantize(y[b : b + 1], layer=layer, kind=kind).parts:
            tokens, n = part.segment.shape[2], part.segment.shape[3]
            sym = np.asarray(part.symbols).reshape(tokens, n).astype(np.int64)
            mid = 1 << (part.segment.bits - 1)
            prev = np.vstack([np.full((1, n), mid), sym[:-1]]) - mid
            out += [column_entropy_bits(sym), column_entropy_bits(np.diff(sym, axis=0)),
                    conditional_bits(sym, np.sign(prev)), conditional_bits(sym, np.clip(prev, -3, 3))]
    return out


def output_metric(lm, layer: int, heads: int, head_dim: int) -> np.ndarray:
    """float64 ``(heads * head_dim,)^2`` block-diagonal ``M`` of the layer's values (module doc)."""
    attn = lm.model.model.layers[layer].self_attn
    wo = attn.o_proj.weight.detach().double().numpy()  # (hidden, query_heads * head_dim)
    group = wo.shape[1] // head_dim // heads
    m = np.zeros((heads * head_dim, heads * head_dim))
    for g in range(heads):
        for i in range(g * group, (g + 1) * group):
            w = wo[:, i * head_dim : (i + 1) * head_dim]
            m[g * head_dim : (g + 1) * head_dim, g * head_dim : (g + 1) * head_dim] += w.T @ w
    return m


def rate_at_equal_error(x: np.ndarray, mean: np.ndarray, fwd: np.ndarray, inv: np.ndarray, half: np.ndarray,
                        unit: float) -> tuple[np.ndarray, np.ndarray]:
    """Per step of :data:`STEPS` times ``unit``: (bits per element, weighted squared error per
    token) of rows ``x`` coded as ``round((x - mean) fwd^T / step)``, decoded as ``mean + q step inv``."""
    rates, errs = [], []
    y = (x - mean) @ fwd.T
    for step in STEPS * unit:
        q = np.round(y / step)
        e = (x - mean - (q * step) @ inv) @ half
        rates.append(column_entropy_bits(q.astype(np.int64)) / x.size)
        errs.append(float((e * e).sum()) / x.shape[0])
    return np.array(rates), np.array(errs)


def main() -> None:
    args = window_arguments(__doc__, "benchmarks/results/ecsq_headroom.md")
    t0 = time.perf_counter()
    lm, wl, basis = calibrated_windows(args)
    digest = register_basis(basis)
    pca = PCA(basis=digest)
    layers = [int(v) for v in args.layers.split(",")]
    ctx = {(kb, vb, kind): np.zeros(4) for kb, vb in POLICIES for kind in ("key", "value")}
    gains = []
    for layer in layers:
        for kind, x in zip(("key", "value"), wl.cap.kv[layer]):
            y = pca.forward(x[: args.contexts].float(), layer=layer, kind=kind)
            for kb, vb in POLICIES:
                q = DPAlloc(bits=kb if kind == "key" else vb, grid="ecsq", basis=digest)
                ctx[(kb, vb, kind)] += context_rates(q, y, layer, kind)
        # output-aware basis for the values
        entry = basis.layers[layer][1]
        heads, head_dim = entry.heads, entry.head_dim
        u, lam, mean = entry.components.double().numpy(), entry.eigenvalues.double().numpy(), entry.mean.double().numpy()
        m = output_metric(lm, layer, heads, head_dim)
        ev, vec = np.linalg.eigh(m)
        half, inv_half = vec @ np.diag(np.sqrt(ev)) @ vec.T, vec @ np.diag(1 / np.sqrt(ev)) @ vec.T
        lw, uw = np.linalg.eigh(half @ (u.T @ np.diag(lam) @ u) @ half)
        uw = uw[:, np.argsort(lw)[::-1]].T
        v = wl.cap.kv[layer][1][: args.contexts].double()
        rows = v.permute(0, 2, 1, 3).reshape(-1, heads * head_dim).numpy()
        r0, e0 = rate_at_equal_error(rows, mean, u, u, half, 1.0)
        # the whitened coefficients are sqrt(M) larger: steps in the same proportion
        r1, e1 = rate_at_equal_error(rows, mean, uw @ half, (inv_half @ uw.T).T, half, float(np.sqrt(ev.mean())))
        lo, hi = max(e0.min(), e1.min()), min(e0.max(), e1.max())  # errors both bases reach
        for target in np.geomspace(lo * 2, hi / 2, 5):
            a = np.interp(np.log(target), np.log(e0), r0)  # errors grow with the step
            b = np.interp(np.log(target), np.log(e1), r1)
            gains.append((layer, a, b))
        print(f"layer {layer} done, {time.perf_counter() - t0:.0f} s", flush=True)
    lines = ["# Headroom beyond PCA + ecsq + per-component rANS (SmolLM2-135M-Instruct, real KV)", "",
             f"`python benchmarks/ecsq_headroom.py --contexts {args.contexts} --calib {args.calib} --tokens "
             f"{args.tokens} --layers {args.layers}` ({time.perf_counter() - t0:.0f} s).", "",
             "## Context modelling across tokens (rate relative to order-0 per component)", "",
             "| policy (K / V bits) | kind | order-0 kB | delta coding | previous sign (3 ctx) | previous offset (7 ctx) |",
             "|---|---|---:|---:|---:|---:|"]
    for (kb, vb, kind), (h0, dl, sg, c7) in ctx.items():
        lines.append(f"| {kb:g} / {vb:g} | {kind} | {h0 / 8e3:.1f} | {dl / h0:.3f} | {sg / h0:.3f} | {c7 / h0:.3f} |")
    lines += ["", "## Values: output-aware basis against the plain basis (bits per element at equal "
              "W_o-weighted squared error)", "", "| layer | plain | output-aware | change |", "|---:|---:|---:|---:|"]
    for layer, a, b in gains:
        lines.append(f"| {layer} | {a:.3f} | {b:.3f} | {b / a - 1:+.1%} |")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    main()
