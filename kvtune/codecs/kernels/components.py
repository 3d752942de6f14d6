"""Per-component quantization kernels of the ``dp-alloc`` quantizer (KVTC-like presets).

KVTC ("KV Cache Transform Coding for Compact Storage in LLM Inference", arXiv 2511.01815,
sec. 3) quantizes each PCA component with its own width (:mod:`kvtune.codecs.bitalloc`). The
reference codes one :class:`~kvtune.codecs.bitalloc.ComponentSegment` (all components of one
width) at a time with torch; these kernels code every segment of one K or V tensor in one call,
bit for bit as :class:`~kvtune.codecs.bitalloc.ComponentQuantizer` (``grid = "gauss"``,
``"minmax"`` or ``"ecsq"``: the ``grid`` argument, :data:`GRID_CODES`) and
:class:`~kvtune.codecs.quantizers.NoQuantizer` (the bfloat16 sink tokens) do.

Arguments shared by both kernels:

* ``y``: float32 ``(batch, tokens, width)`` PCA coefficients in token rows (C order): column
  ``j`` is component ``j = head * head_dim + channel``; every component of a segment is
  ``< width`` (the projection computes the leading ``width`` only,
  :func:`kvtune.codecs.pca.leading_width`). The sink tokens' rows of ``y`` are not read.
* ``comp``: int64 ``(C,)`` the components of every segment, segment after segment, each in
  increasing order; ``start``: int64 ``(S + 1,)`` segment ``s`` holds ``comp[start[s]:start[s+1]]``;
  ``bits``: int64 ``(S,)`` its width (1..8).
* ``ysink``: float32 ``(batch, first, heads * head_dim)``, every coefficient of the ``first``
  sink tokens, coded as bfloat16 in ``sink``, uint16 bit patterns ``(batch, heads, first,
  head_dim)`` (the stream's layout).
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
    def _token_stats(y, b, first, grid, zd, lo, hi, acc):
        """Per component ``j`` (column of ``y``) of batch row ``b``, over tokens ``first ..``:
        grid minmax: ``lo`` / ``hi`` (float32) the minimum / maximum (0 without a token);
        else ``acc`` (float64) the sum in token order, or with ``zd`` given (not empty) the sum of
        ``(y - zd[j])**2`` in token order. Token-major loops over contiguous components: each
        component's sequence of operations is the per-component loop's, so the bits are too,
        while the vector lanes run 8 or 16 components' dependency chains at once."""
        _, t_, w_ = y.shape
        if grid == GRID_MINMAX:
            lo[:] = 0.0
            hi[:] = 0.0
            if t_ > first:
                lo[:] = y[b, first]
                hi[:] = y[b, first]
            for t in range(first + 1, t_):
                row = y[b, t]
                for c in range(w_):
                    lo[c] = min(lo[c], row[c])
                    hi[c] = max(hi[c], row[c])
            return
        acc[:] = 0.0
        for t in range(first, t_):
            row = y[b, t]
            if zd.shape[0]:
                for c in range(w_):
                    e = np.float64(row[c]) - zd[c]
                    acc[c] += e * e
            else:
                for c in range(w_):
                    acc[c] += np.float64(row[c])

    @njit(**JIT)
    def _max_deviation(y, b, first, zf, dev):
        """``dev[j]`` = the largest float32 ``|y - zf[j]|`` of component ``j`` over tokens
        ``first ..`` (0 without a token), token-major as :func:`_token_stats`."""
        _, t_, w_ = y.shape
        dev[:] = 0.0
        for t in range(first, t_):
            row = y[b, t]
            for c in range(w_):
                dev[c] = max(dev[c], abs(np.float32(row[c] - zf[c])))

    @njit(**JIT)
    def quantize_components(y, ysink, comp, start, bits, steps, grid, step, sink, meta, sym):
        """Quantize every segment of one tensor (module doc: arguments); ``steps``: float64
        ``(8,)`` Gaussian steps per width; ``grid``: :data:`GRID_CODES`; ``step``: the ecsq
        grid's planned step. Writes ``sink``, ``meta`` and ``sym``. The token statistics of
        every component are taken in token-major passes (:func:`_token_stats`), and the symbols
        written token after token: a component-major walk read one cache line per value
        (~1.5 ns each)."""
        b_, t_, w_ = y.shape
        _, h_, first, d_ = sink.shape
        for b in range(b_):
            for h in range(h_):
                for t in range(first):
                    for c in range(d_):
                        sink[b, h, t, c] = f32_to_bf16_bits(ysink[b, t, h * d_ + c])
        nt = t_ - first
        inv_n = max(nt, 1)
        width = np.zeros(w_, np.int64)  # each component's segment width (0: in no segment)
        for s in range(bits.shape[0]):
            for k in range(start[s], start[s + 1]):
                width[comp[k]] = bits[s]
        lo = np.empty(w_, np.float32)
        hi = np.empty(w_, np.float32)
        acc = np.empty(w_, np.float64)
        zd = np.zeros(w_, np.float64)
        zf = np.zeros(w_, np.float32)
        none = np.empty(0, np.float64)
        s16s = np.zeros(w_, np.int64)
        z16s = np.zeros(w_, np.int64)
        ncomp = start[bits.shape[0]]
        offs = np.empty(ncomp, np.uintp)  # component q's column
        for q in range(ncomp):
            offs[q] = comp[q]
        flat = y.reshape(-1)
        zeros = np.empty(ncomp, np.float32)
        invs = np.empty(ncomp, np.float32)
        for b in range(b_):
            _token_stats(y, b, first, grid, none, lo, hi, acc)
            for j in range(w_):
                w = width[j]
                if w == 0:
                    continue
                if grid == GRID_MINMAX:
                    z16 = fp16_round_up_bits(lo[j])
                    sf = min(np.float32(hi[j] - f16_bits_to_f32(z16)) / np.float32((1 << w) - 1), FP16_MAX)
                    s16s[j] = f32_to_f16_bits(sf) if sf > 0 else np.int64(0)
                else:
                    z = min(max(acc[j] / inv_n, -FP16_MAX), FP16_MAX)
                    z16 = f32_to_f16_bits(np.float32(z))
                    zf[j] = f16_bits_to_f32(z16)
                    zd[j] = np.float64(zf[j])
                z16s[j] = z16
            if grid == GRID_ECSQ:
                _max_deviation(y, b, first, zf, lo)
                for j in range(w_):
                    w = width[j]
                    if w:
                        reach = np.float32((1 << (w - 1)) - 1)
                        s16s[j] = f32_to_f16_bits(min(max(np.float32(lo[j] / reach), np.float32(step)), FP16_MAX))
            elif grid == GRID_GAUSS:
                _token_stats(y, b, first, grid, zd, lo, hi, acc)
                for j in range(w_):
                    w = width[j]
                    if w:
                        sd = min(np.sqrt(acc[j] / inv_n) * steps[w - 1], FP16_MAX)
                        s16s[j] = f32_to_f16_bits(np.float32(sd))
            for s in range(bits.shape[0]):  # metadata, and each component's zero and 1 / scale
                w = bits[s]
                n = start[s + 1] - start[s]
                mo = 2 * b_ * start[s]
                half = np.float32(1 << (w - 1)) if grid == GRID_ECSQ else np.float32(((1 << w) - 1) / 2.0)
                for k in range(n):
                    q = start[s] + k
                    j = comp[q]
                    s16, z16 = s16s[j], z16s[j]
                    meta[mo + b * n + k] = s16
                    meta[mo + b_ * n + b * n + k] = z16
                    scale = f16_bits_to_f32(s16)
                    zeros[q] = f16_bits_to_f32(z16) if grid == GRID_MINMAX else np.float32(f16_bits_to_f32(z16) - np.float32(scale * half))
                    invs[q] = np.float32(1.0) / max(scale, F32_TINY) if scale > 0 else np.float32(0.0)
            for s in range(bits.shape[0]):  # the symbols, token after token (whole cache lines of y)
                lo_s, n = start[s], start[s + 1] - start[s]
                top = np.float32((1 << bits[s]) - 1)
                base = b_ * nt * lo_s + b * nt * n
                off, zs, ivs = offs[lo_s : lo_s + n], zeros[lo_s : lo_s + n], invs[lo_s : lo_s + n]
                for t in range(nt):
                    out = sym[base + t * n : base + (t + 1) * n]
                    row = flat[(b * t_ + first + t) * w_ :]
                    for k in range(np.uintp(n)):  # unsigned: no negative-index wraparound in the loop
                        u = np.float32(np.float32(row[off[k]] - zs[k]) * ivs[k])
                        out[k] = np.uint8(min(max(np.float32(np.rint(u)), np.float32(0.0)), top))

    @njit(**JIT)
    def dequantize_components(sym, meta, comp, start, bits, grid, sink, ysink, y):
        """Inverse of :func:`quantize_components`: float32 ``y`` (module doc, C order) and
        ``ysink`` from ``sym``, ``meta`` and ``sink``; components in no segment are 0
        (``DPAlloc.dequantize``), and the sink tokens' rows of ``y`` hold their first
        ``width`` coefficients. Written token after token, as the symbols are stored."""
        b_, t_, w_ = y.shape
        _, h_, first, d_ = sink.shape
        nt = t_ - first
        for b in range(b_):
            for h in range(h_):
                for t in range(first):
                    for c in range(d_):
                        ysink[b, t, h * d_ + c] = bf16_bits_to_f32(sink[b, h, t, c])
            for t in range(first):
                y[b, t] = ysink[b, t, :w_]
        ncomp = start[bits.shape[0]]
        if ncomp < w_:  # components in no segment: 0
            for b in range(b_):
                y[b, first:] = 0.0
        flat = y.reshape(-1)
        for s in range(bits.shape[0]):
            lo, hi = start[s], start[s + 1]
            n = hi - lo
            half = np.float32(1 << (bits[s] - 1)) if grid == GRID_ECSQ else np.float32(((1 << bits[s]) - 1) / 2.0)
            mo = 2 * b_ * lo
            so = b_ * nt * lo
            off = np.empty(n, np.uintp)
            scales = np.empty(n, np.float32)
            zeros = np.empty(n, np.float32)
            for k in range(n):
                off[k] = comp[lo + k]
            for b in range(b_):
                for k in range(n):
                    scale = f16_bits_to_f32(meta[mo + b * n + k])
                    z = f16_bits_to_f32(meta[mo + b_ * n + b * n + k])
                    scales[k] = scale
                    zeros[k] = z if grid == GRID_MINMAX else np.float32(z - np.float32(scale * half))
                base = so + b * nt * n
                for t in range(nt):
                    row = flat[(b * t_ + first + t) * w_ :]
                    src = sym[base + t * n : base + (t + 1) * n]
                    for k in range(np.uintp(n)):  # unsigned: no negative-index wraparound in the loop
                        row[off[k]] = np.float32(zeros[k] + np.float32(np.float32(src[k]) * scales[k]))
