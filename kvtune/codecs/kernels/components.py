"""Per-component quantization kernels of the ``dp-alloc`` quantizer (KVTC-like presets).

KVTC ("KV Cache Transform Coding for Compact Storage in LLM Inference", arXiv 2511.01815,
sec. 3) quantizes each PCA component with its own width (:mod:`kvtune.codecs.bitalloc`). The
reference codes one :class:`~kvtune.codecs.bitalloc.ComponentSegment` (all components of one
width) at a time with torch; these kernels code every segment of one K or V tensor in one call,
bit for bit as :class:`~kvtune.codecs.bitalloc.ComponentQuantizer` (``grid = "gauss"``,
``"minmax"`` or ``"ecsq"``: the ``grid`` argument, :data:`GRID_CODES`) and
:class:`~kvtune.codecs.quantizers.NoQuantizer` (the bfloat16 sink tokens) do.

Arguments shared by both kernels:

* ``y``: float32 ``(batch, heads, tokens, head_dim)`` PCA coefficients (C order); component
  ``j`` is at head ``j // head_dim``, channel ``j % head_dim``.
* ``comp``: int64 ``(C,)`` the components of every segment, segment after segment, each in
  increasing order; ``start``: int64 ``(S + 1,)`` segment ``s`` holds ``comp[start[s]:start[s+1]]``;
  ``bits``: int64 ``(S,)`` its width (1..8).
* ``first``: the sink tokens (coded as bfloat16 coefficients in ``sink``, uint16 bit patterns
  ``(batch, heads, first, head_dim)``).
* ``meta``: uint16 float16 bit patterns, per segment ``s`` of ``n`` components at
  ``2 * batch * start[s]``: ``scale`` ``(batch, n)`` then ``zero`` ``(batch, n)`` (the wire order of
  the segment's metadata).
* ``sym``: uint8, per segment at ``batch * (tokens - first) * start[s]``: the symbols
  ``(batch, tokens - first, n)`` in C order (the segment's ``(batch, 1, tokens, n)`` block).

Gauss grid: statistics are float64 sums in token order (the reference sums with
``torch.cumsum``, which is sequential); float64 -> float16 goes through float32, as torch
converts. Minmax grid: the parameters of :func:`kvtune.codecs.quantizers.asymmetric_params`
(``zero`` the minimum rounded up to float16, ``+0`` for ``-0``; ``scale`` the float32 quotient
``(max - zero) / (2**bits - 1)`` clamped to ``[+0, 65504]``, to float16). Ecsq grid: ``zero`` as
for gauss; ``scale`` the larger of the planned ``step`` and the float32 quotient ``max |y -
zero| / (2**(bits - 1) - 1)``, clamped to 65504, to float16.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from .cachedir import kernel_cache_dir
from .convert import bf16_bits_to_f32, f16_bits_to_f32, f32_to_bf16_bits, f32_to_f16_bits, fp16_round_up_bits
from .lowlevel import F32_TINY, FP16_MAX, JIT

GRID_GAUSS, GRID_MINMAX, GRID_ECSQ = 0, 1, 2
GRID_CODES = {"gauss": GRID_GAUSS, "minmax": GRID_MINMAX, "ecsq": GRID_ECSQ}
"""The kernels' ``grid`` argument per :class:`~kvtune.codecs.bitalloc.ComponentQuantizer` grid."""

with kernel_cache_dir():

    @njit(**JIT)
    def quantize_components(y, comp, start, bits, first, steps, grid, step, sink, meta, sym):
        """Quantize every segment of one tensor (module doc: arguments); ``steps``: float64
        ``(8,)`` Gaussian steps per width; ``grid``: :data:`GRID_CODES`; ``step``: the ecsq
        grid's planned step. Writes ``sink``, ``meta`` and ``sym``."""
        b_, h_, t_, d_ = y.shape
        for b in range(b_):
            for h in range(h_):
                for t in range(first):
                    for c in range(d_):
                        sink[b, h, t, c] = f32_to_bf16_bits(y[b, h, t, c])
        nt = t_ - first
        inv_n = max(nt, 1)
        for s in range(bits.shape[0]):
            lo, hi = start[s], start[s + 1]
            n = hi - lo
            w = bits[s]
            mo = 2 * b_ * lo
            so = b_ * nt * lo
            half = np.float32(1 << (w - 1)) if grid == GRID_ECSQ else np.float32(((1 << w) - 1) / 2.0)
            top = np.float32((1 << w) - 1)
            reach = np.float32((1 << (w - 1)) - 1)
            for b in range(b_):
                for k in range(n):
                    j = comp[lo + k]
                    h, c = j // d_, j % d_
                    if grid == GRID_MINMAX:
                        vlo = vhi = np.float32(0.0)  # no token: a zero grid, as the reference
                        if nt:
                            vlo = vhi = y[b, h, first, c]
                        for t in range(first + 1, t_):
                            v = y[b, h, t, c]
                            vlo = min(vlo, v)
                            vhi = max(vhi, v)
                        z16 = fp16_round_up_bits(vlo)
                        sf = min(np.float32(vhi - f16_bits_to_f32(z16)) / top, FP16_MAX)
                        s16 = f32_to_f16_bits(sf) if sf > 0 else np.int64(0)
                    else:
                        acc = 0.0
                        for t in range(first, t_):
                            acc += np.float64(y[b, h, t, c])
                        z = min(max(acc / inv_n, -FP16_MAX), FP16_MAX)
                        z16 = f32_to_f16_bits(np.float32(z))
                        if grid == GRID_ECSQ:
                            zf = f16_bits_to_f32(z16)
                            dev = np.float32(0.0)
                            for t in range(first, t_):
                                dev = max(dev, abs(np.float32(y[b, h, t, c] - zf)))
                            sf = min(max(np.float32(dev / reach), np.float32(step)), FP16_MAX)
                            s16 = f32_to_f16_bits(sf)
                        else:
                            zd = np.float64(f16_bits_to_f32(z16))
                            acc = 0.0
                            for t in range(first, t_):
                                e = np.float64(y[b, h, t, c]) - zd
                                acc += e * e
                            sd = min(np.sqrt(acc / inv_n) * steps[w - 1], FP16_MAX)
                            s16 = f32_to_f16_bits(np.float32(sd))
                    meta[mo + b * n + k] = s16
                    meta[mo + b_ * n + b * n + k] = z16
                    scale = f16_bits_to_f32(s16)
                    zero = f16_bits_to_f32(z16) if grid == GRID_MINMAX else np.float32(f16_bits_to_f32(z16) - np.float32(scale * half))
                    inv = np.float32(1.0) / max(scale, F32_TINY) if scale > 0 else np.float32(0.0)
                    base = so + b * nt * n + k
                    for t in range(nt):
                        u = np.float32(np.float32(y[b, h, first + t, c] - zero) * inv)
                        u = min(max(np.float32(np.rint(u)), np.float32(0.0)), top)
                        sym[base + t * n] = np.uint8(u)

    @njit(**JIT)
    def dequantize_components(sym, meta, comp, start, bits, first, grid, sink, y):
        """Inverse of :func:`quantize_components`: float32 ``y`` (module doc) from ``sym``,
        ``meta`` and ``sink``; components in no segment are 0 (``DPAlloc.dequantize``)."""
        b_, h_, t_, d_ = y.shape
        nt = t_ - first
        y[...] = 0.0
        for b in range(b_):
            for h in range(h_):
                for t in range(first):
                    for c in range(d_):
                        y[b, h, t, c] = bf16_bits_to_f32(sink[b, h, t, c])
        for s in range(bits.shape[0]):
            lo, hi = start[s], start[s + 1]
            n = hi - lo
            half = np.float32(1 << (bits[s] - 1)) if grid == GRID_ECSQ else np.float32(((1 << bits[s]) - 1) / 2.0)
            mo = 2 * b_ * lo
            so = b_ * nt * lo
            for b in range(b_):
                for k in range(n):
                    j = comp[lo + k]
                    h, c = j // d_, j % d_
                    scale = f16_bits_to_f32(meta[mo + b * n + k])
                    z = f16_bits_to_f32(meta[mo + b_ * n + b * n + k])
                    zero = z if grid == GRID_MINMAX else np.float32(z - np.float32(scale * half))
                    base = so + b * nt * n + k
                    for t in range(nt):
                        y[b, h, first + t, c] = np.float32(zero + np.float32(np.float32(sym[base + t * n]) * scale))
