"""Non-uniform (codebook) quantization of KV segments: NormalFloat or fitted Lloyd-Max levels.

Accelerates :class:`kvtune.codecs.codebook.CodebookQuantizer` (``quantize_block`` /
``dequantize_block``): groups of channels (per token) or of tokens (per channel) normalised by
a float16 absmax scale (or mid-range zero point and half-range scale), each value coded as the
nearest level of a sorted codebook -- the NF levels of QLoRA (arXiv 2305.14314, sec. 3.1) or a
Lloyd-Max codebook fitted on the segment (KVQuant, arXiv 2401.18079, sec. 3.3). Encode: the
count of codebook midpoints below each value; decode: a table lookup and a multiply (and an
add). Bit for bit the reference's IEEE operations; the Lloyd fit is the reference's exact
integer histogram arithmetic (:func:`kvtune.codecs.codebook.lloyd_from_histogram`).
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types, uintp
from numba.core import cgutils
from numba.extending import intrinsic

from .convert import f16_bits_to_f32, f32_to_f16_bits, fp16_round_up_bits, load_row
from .lowlevel import (HALF, INLINE, JIT, ONE, U8, ZERO, absmax, target_has_features, vminmax, vminmax_groups8,
                       vminmax_rows8)
from .quantize import U16, group_lanes, load_lanes, splat16, store16, store_rows

_u = uintp
_NB = 4096  # histogram bins over [-1, 1] (kvtune.codecs.codebook.HIST_BINS)
_ITERS = 16  # Lloyd iterations (kvtune.codecs.codebook.LLOYD_ITERS)
_ROWS = 32  # rows per block of the decoder's conversion
_BINS_BLOCK = 1024  # values per block of the Lloyd histogram's bin pass
PERMUTE = target_has_features("avx512f")
"""Whether the encoder of a given small codebook finds each symbol by a binary search whose
midpoints come from one register by ``vpermps`` (:func:`_vcode`), and the decoder looks up the
levels of a small codebook (8 levels or fewer) 16 lanes at a
time with one ``vpermps`` (AVX-512 F: the padded codebook in one register, the symbols as lane
indices), scales and converts them in the same registers and stores them straight into the
output row (:func:`_vdeq_levels16`), instead of a chain of 7 compares and selects per lane
(:func:`_level`), a pass for the scaling and one for the conversion of a block of rows
(:func:`.quantize.store_rows`). ``kvquant-3`` decoded into preallocated bfloat16 tensors (the
default model's 30 layers, medians of 40, the same tensors; 2-vCPU Zen 5, one-off script,
2026-12-05): 3.7 ms before, 2.8-3.1 with the lookups and scaling in registers, 2.2-2.3 with the
conversion too, on one thread; 2.0-2.1, 1.7, then 1.3-1.4 ms on two."""
_F32x16 = ir.VectorType(ir.FloatType(), 16)
_I32x16 = ir.VectorType(ir.IntType(32), 16)


@njit(**INLINE)
def _params(lo, hi, minmax, sf, zf, m):
    """float16 ``scale`` (``sf[m]``) and, when ``minmax``, ``zero`` (``zf[m]``) bits of a group
    with minimum ``lo`` and maximum ``hi`` (absmax: ``hi`` is the largest magnitude); returns
    them as float32 ``(scale, zero)``. References: the absmax / minmax branches of
    ``CodebookQuantizer.quantize_block``."""
    z = ZERO
    if minmax:
        z16 = f32_to_f16_bits((lo + hi) * HALF)
        z16 = np.int64(0) if z16 == 0x8000 else z16
        zf[m] = z16
        z = f16_bits_to_f32(z16)
        s16 = fp16_round_up_bits(max(hi - z, z - lo))
    else:
        s16 = fp16_round_up_bits(hi)
    sf[m] = s16
    return f16_bits_to_f32(s16), z


@njit(**INLINE)
def _params_many(lo, hi, n, minmax, ss, zz, sf, zf, m):
    """:func:`_params` of ``n`` groups at once: group ``i`` has ``lo[i]`` / ``hi[i]`` (absmax:
    ``hi[i]`` is its largest magnitude) and metadata index ``m + i``; its float32 scale and
    zero go to ``ss[i]`` / ``zz[i]``. The same values, in a loop that vectorizes (the float16
    conversions 8 or 16 lanes at a time; normalising a default-model K tensor, 5,376 groups,
    parameters included: 114 -> 48 us)."""
    mu = _u(m)
    if minmax:
        for i in range(_u(n)):
            z16 = f32_to_f16_bits((lo[i] + hi[i]) * HALF)
            z16 = np.int64(0) if z16 == 0x8000 else z16
            zf[mu + i] = z16
            z = f16_bits_to_f32(z16)
            s16 = fp16_round_up_bits(max(hi[i] - z, z - lo[i]))
            sf[mu + i] = s16
            ss[i] = f16_bits_to_f32(s16)
            zz[i] = z
    else:
        for i in range(_u(n)):
            s16 = fp16_round_up_bits(hi[i])
            sf[mu + i] = s16
            ss[i] = f16_bits_to_f32(s16)
            zz[i] = ZERO


@njit(**INLINE)
def _norm(v, s, z, minmax):
    """``(v - z) / s`` (``v / s`` unless ``minmax``), 0 where ``s == 0``."""
    if s > ZERO:
        return (v - z) / s if minmax else v / s
    return ZERO


@njit(**INLINE)
def _normalise_run(u, a, b, minmax, sf, zf, m):
    """Normalise the contiguous, non-empty group ``u[a:b]`` in place (per-token groups)."""
    ua, ub = _u(a), _u(b)
    if minmax:
        lo, hi = vminmax(u, ua, ub)
    else:
        lo, hi = ZERO, absmax(u, ua, ub)
    s, z = _params(lo, hi, minmax, sf, zf, m)
    for i in range(ua, ub):
        u[i] = _norm(u[i], s, z, minmax)


_GROUPS = 64  # groups per block of _normalise_tiled


@njit(**INLINE)
def _group_params(u, at, k, g, minmax, lo, hi, ss, zz, sf, zf, m):
    """The float32 ``(scale, zero)`` of ``k`` back-to-back groups of ``g`` values (a multiple
    of 8) of ``u`` from ``u[at]`` into ``ss[:k]`` / ``zz[:k]`` (:func:`_params_many`; their
    float16 bits at metadata index ``m`` on): min and max of 8 groups at a time
    (:func:`~.lowlevel.vminmax_groups8`; an absmax is ``max(|min|, |max|)``)."""
    k8 = k // 8 * 8
    for i in range(0, k8, 8):
        vminmax_groups8(u, at + i * g, g, lo, hi, i)
    for i in range(k8, k):
        lo[i], hi[i] = vminmax(u, _u(at + i * g), _u(at + i * g + g))
    if not minmax:
        for i in range(_u(k)):
            hi[i] = max(abs(lo[i]), abs(hi[i]))
    _params_many(lo, hi, k, minmax, ss, zz, sf, zf, m)


@njit(**INLINE)
def _normalise_tiled(u, ngroups, g, minmax, sf, zf):
    """Normalise ``ngroups`` back-to-back groups of ``g`` values (a multiple of 8) of ``u`` in
    place, group ``m`` getting metadata index ``m`` (per-token groups that tile the rows).

    Blocks of :data:`_GROUPS` groups: min and max of 8 groups at a time
    (:func:`~.lowlevel.vminmax_groups8`; an absmax is ``max(|min|, |max|)``), the parameters
    group by group, then each group's values in one branch-free loop. The same values as
    :func:`_normalise_run` on every group (finite inputs: the caller checked them)."""
    lo = np.empty(_GROUPS, np.float32)
    hi = np.empty(_GROUPS, np.float32)
    ss = np.empty(_GROUPS, np.float32)
    zz = np.empty(_GROUPS, np.float32)
    ug = _u(g)
    for m0 in range(0, ngroups, _GROUPS):
        k = min(_GROUPS, ngroups - m0)
        _group_params(u, m0 * g, k, g, minmax, lo, hi, ss, zz, sf, zf, m0)
        for i in range(k):
            a = _u((m0 + i) * g)
            s, z = ss[i], zz[i]
            if s > ZERO:
                for j in range(a, a + ug):
                    u[j] = (u[j] - z) / s
            else:
                for j in range(a, a + ug):
                    u[j] = ZERO


@njit(**INLINE)
def _column_params(u, base, n, d_n, minmax, sf, zf, m, lo, hi, ss, zz):
    """The float32 ``(scale, zero)`` of the ``d_n`` per-channel groups of ``n >= 1`` rows of
    ``d_n`` channels from ``u[base]`` into ``ss`` / ``zz`` (:func:`_params_many`; their float16
    bits at metadata index ``m`` on): min and max 8 channels at a time with register
    accumulators (:func:`~.lowlevel.vminmax_rows8`)."""
    dn = _u(d_n)
    b0 = _u(base)
    d8 = dn // U8 * U8 if minmax else _u(0)
    for d in range(_u(0), d8, U8):
        vminmax_rows8(u, b0 + d, d_n, n, lo, hi, d)
    for d in range(d8, dn):
        v = u[b0 + d]
        lo[d] = v
        hi[d] = abs(v) if not minmax else v
    for j in range(1, n):
        o = b0 + _u(j * d_n)
        if minmax:
            for d in range(d8, dn):
                lo[d] = min(lo[d], u[o + d])
                hi[d] = max(hi[d], u[o + d])
        else:
            for d in range(dn):
                hi[d] = max(hi[d], abs(u[o + d]))
    _params_many(lo, hi, d_n, minmax, ss, zz, sf, zf, m)


@njit(**INLINE)
def _normalise_columns(u, base, n, d_n, minmax, sf, zf, m, lo, hi, ss, zz):
    """Normalise ``n >= 1`` rows of ``d_n`` channels from ``u[base]`` in place, one group per
    channel (per-channel groups): min and max 8 channels at a time with register accumulators
    (:func:`~.lowlevel.vminmax_rows8`), the parameters in one vector loop
    (:func:`_params_many`), then the rows; the channel loops are contiguous."""
    dn = _u(d_n)
    b0 = _u(base)
    _column_params(u, base, n, d_n, minmax, sf, zf, m, lo, hi, ss, zz)
    for j in range(n):
        o = b0 + _u(j * d_n)
        for d in range(dn):  # computed, then selected: the loop vectorizes
            s = ss[d]
            v = (u[o + d] - zz[d]) / s if minmax else u[o + d] / s
            u[o + d] = v if s > ZERO else ZERO


@njit(**INLINE)
def _below(b, mid):
    """Whether bin ``b``'s centre ``(2b + 1 - NB) / NB`` (float64) is ``<= mid``."""
    return np.float64(2 * b + 1 - _NB) / _NB <= mid


@njit(**INLINE)
def _first_above(mid):
    """The first bin whose centre is above ``mid`` (``NB`` when none is): the centre formula
    inverted, then corrected by the exact float64 comparison (a bin or two at most). Reference:
    the scan ``while b < NB and centre(b) <= mid: b += 1`` (centres increase with ``b``)."""
    c = (mid * _NB + _NB - 1.0) / 2.0 + 1.0
    b = np.int64(min(max(c, 0.0), np.float64(_NB))) if c == c else np.int64(0)
    while b > 0 and not _below(b - 1, mid):
        b -= 1
    while b < _NB and _below(b, mid):
        b += 1
    return b


@njit(**INLINE)
def _lloyd(u, n, init, out16):
    """Lloyd-Max levels of ``u[:n]`` from ``init`` (float64) as float16 bits in ``out16``.

    Reference: :func:`kvtune.codecs.codebook.fit_lloyd` (histogram, exact prefix sums, one
    float64 division per level, float64 -> float32 -> float16)."""
    half_bins = np.float32(_NB // 2)
    top = np.float32(_NB - 1)
    hist = np.zeros(_NB, np.int64)
    bins = np.empty(_BINS_BLOCK, np.int32)
    for a in range(0, n, _BINS_BLOCK):  # the bins of a block in a vector loop, then the counts
        m = _u(min(_BINS_BLOCK, n - a))
        ua = _u(a)
        for i in range(m):  # truncation of the clamped value: floor, then clamp (as the reference)
            bins[i] = np.int32(min(max((u[ua + i] + ONE) * half_bins, ZERO), top))
        for i in range(m):
            hist[_u(bins[i])] += 1  # unsigned: no wraparound test
    cw = np.zeros(_NB + 1, np.int64)
    cs = np.zeros(_NB + 1, np.int64)
    for b in range(_NB):
        cw[b + 1] = cw[b] + hist[b]
        cs[b + 1] = cs[b] + hist[b] * (2 * b + 1 - _NB)
    nl = init.shape[0]
    lev = init.copy()
    new = np.empty(nl, np.float64)
    for _ in range(_ITERS):
        lo = 0
        for i in range(nl):
            if i < nl - 1:
                hi = max(lo, _first_above(np.float64((lev[i] + lev[i + 1]) / 2.0)))
            else:
                hi = _NB
            w = cw[hi] - cw[lo]
            inner = 0 < i < nl - 1  # the end levels stay (pinned)
            new[i] = np.float64(cs[hi] - cs[lo]) / np.float64(w) / _NB if inner and w > 0 else lev[i]
            lo = hi
        for i in range(nl):
            lev[i] = new[i]
    for i in range(nl):
        out16[i] = f32_to_f16_bits(np.float32(lev[i]))


_BLOCK = 1024  # elements per block of the symbol pass


@njit(**INLINE)
def _symbols(u, n, lev, sym):
    """``sym[i]`` = number of midpoints ``(lev[k] + lev[k+1]) * 0.5`` below ``u[i]``
    (reference: :func:`kvtune.codecs.codebook.nearest_level`). Up to 8 levels: seven compares
    per element in one pass (a default-model K tensor at 3 bits: 42 -> 30 us); up to 16: one
    compare per midpoint, midpoint-major over blocks of :data:`_BLOCK` elements (vectorizable);
    more: a binary search per element."""
    nl = lev.shape[0]
    mids = np.full(max(nl - 1, 7), np.float32(np.inf))  # +inf past the last midpoint: never below
    for k in range(nl - 1):
        mids[k] = (lev[k] + lev[k + 1]) * HALF
    if nl <= 8:  # one pass, seven compares per element (the missing midpoints +inf)
        m0, m1, m2, m3, m4, m5, m6 = mids[0], mids[1], mids[2], mids[3], mids[4], mids[5], mids[6]
        for i in range(_u(n)):
            v = u[i]
            sym[i] = np.uint8(np.int32(v > m0) + np.int32(v > m1) + np.int32(v > m2) + np.int32(v > m3)
                              + np.int32(v > m4) + np.int32(v > m5) + np.int32(v > m6))
    elif nl <= 16:
        for a in range(0, n, _BLOCK):
            m = _u(min(_BLOCK, n - a))
            ua = _u(a)
            for i in range(m):
                sym[ua + i] = np.uint8(0)
            for k in range(nl - 1):
                mk = mids[k]
                for i in range(m):
                    sym[ua + i] += np.uint8(u[ua + i] > mk)
    else:
        for i in range(_u(n)):
            v = u[i]
            a, b = 0, nl - 1
            while a < b:  # first midpoint >= v
                c = (a + b) // 2
                if mids[c] < v:
                    a = c + 1
                else:
                    b = c
            sym[i] = np.uint8(a)


def _vcode(per_lane: bool):
    """An intrinsic for 16 lanes of a given codebook's symbols (8 levels or fewer;
    :func:`~.quantize.group_lanes`, ``extra`` the midpoints): ``dst[doff + i]`` = the number of
    the 7 sorted midpoints ``mids[:7]`` (float32, ``mids`` holds 16, +inf past the last
    midpoint) below ``u_i = (src[soff + i] - z) / s`` (0 where ``s`` is not positive).

    The reference's operations on a vector (a subtract, a division, ordered compares;
    :func:`_symbols`, :func:`kvtune.codecs.codebook.nearest_level`). The midpoints below ``u``
    are a prefix of the sorted midpoints, so their number is found by a binary search of three
    compares, the midpoints fetched by ``vpermps`` from one register (:data:`PERMUTE`); without
    AVX-512, seven compares and a sum."""

    def body(context, builder, v, z, sc, mids_type, mids):
        vf = v.type
        zero = ir.Constant(vf, [0.0] * 16)
        u = builder.select(builder.fcmp_ordered(">", sc, zero), builder.fdiv(builder.fsub(v, z), sc), zero)
        table = load_lanes(context, builder, mids_type, mids, types.int64, ir.Constant(ir.IntType(64), 0), ir.FloatType())

        def ci(c):
            return ir.Constant(_I32x16, [c] * 16)

        def above(t, c):  # c where u > t, else 0
            return builder.select(builder.fcmp_ordered(">", u, t), ci(c), ci(0))

        if PERMUTE:  # k = 4 [u > m3]; k += 2 [u > m(k+1)]; k += [u > m(k)]
            perm = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_F32x16, [_F32x16, _I32x16]),
                                                  "llvm.x86.avx512.permvar.sf.512")
            k = above(builder.call(perm, [table, ci(3)]), 4)
            k = builder.add(k, above(builder.call(perm, [table, builder.add(k, ci(1))]), 2))
            k = builder.add(k, above(builder.call(perm, [table, k]), 1))
        else:
            k = ci(0)
            for j in range(7):
                k = builder.add(k, above(builder.shuffle_vector(table, ir.Constant(vf, ir.Undefined), ci(j)), 1))
        return builder.trunc(k, ir.VectorType(ir.IntType(8), 16))

    return group_lanes(16, per_lane, body, _vcode.__doc__)


_vcode16 = _vcode(False)
_vcode16v = _vcode(True)


@njit(**INLINE)
def _blocked(per_token, g, d_n, nl, lloyd):
    """Whether :func:`_quantize_given` codes the segment: a given codebook (NF or calibrated)
    of 8 levels or fewer, 16-channel rows, and per-token groups of 16k channels that tile them."""
    return not lloyd and nl <= 8 and d_n % 16 == 0 and (not per_token or (g % 16 == 0 and d_n % g == 0))


@njit(**INLINE)
def _quantize_given(xf, nh, nt, d_n, heads, tokens, per_token, g, minmax, init, sym, sf, zf, nb):
    """Codebook quantization with a given codebook, a block of rows at a time
    (:func:`_blocked` cases; :func:`codebook_quantize`'s arguments, flattened): per-token, 32
    rows at a time; per-channel, one group of ``g`` tokens of a head at a time. Each block is
    loaded (converted to float32) while it fits in L1, its groups' parameters found, and its
    symbols written 16 lanes at a time by :func:`_vcode`: the same bytes as normalising the
    whole segment and coding it afterwards (the Lloyd fit needs the whole segment first), without
    a segment-sized float32 copy passing through L2 three times. ``kvquant-3c``'s quantization of
    a default-model tensor's body (layer 5, 896 tokens, one thread, medians of 200, one-off
    script, 2026-12-05, the same bytes): keys 51.2 -> 43.2 us, values 52.9 -> 42.9 us; without
    the binary search (seven compares) 48.3 and 51.4 us."""
    hs, ts = heads.shape[0], tokens.shape[0]
    dn = _u(d_n)
    mids = np.full(16, np.float32(np.inf))  # one register: vpermps' table
    for k in range(init.shape[0] - 1):
        mids[k] = (np.float32(init[k]) + np.float32(init[k + 1])) * HALF
    if per_token:
        ng = d_n // g
        blk = np.empty(_ROWS * d_n, np.float32)
        lo = np.empty(_ROWS * ng, np.float32)
        hi = np.empty(_ROWS * ng, np.float32)
        ss = np.empty(_ROWS * ng, np.float32)
        zz = np.zeros(_ROWS * ng, np.float32)  # absmax: no zero point
        nrows = nb * hs * ts
        b, h, t = 0, 0, 0  # the next row's batch, head index and token index
        for r0 in range(0, nrows, _ROWS):
            nr = min(_ROWS, nrows - r0)
            for r in range(nr):
                load_row(xf, _u(((b * nh + heads[h]) * nt + tokens[t]) * d_n), blk, _u(r * d_n), dn)
                t += 1
                if t == ts:
                    t, h = 0, h + 1
                    if h == hs:
                        h, b = 0, b + 1
            _group_params(blk, 0, nr * ng, g, minmax, lo, hi, ss, zz, sf, zf, r0 * ng)
            base = _u(r0 * d_n)
            for i in range(_u(nr * ng)):
                d0 = i * _u(g)
                for d in range(d0, d0 + _u(g), U16):
                    _vcode16(blk, d, zz[i], ss[i], mids, sym, base + d)
        return
    ng = (ts + g - 1) // g
    blk = np.empty(min(g, ts) * d_n, np.float32)
    lo = np.empty(d_n, np.float32)
    hi = np.empty(d_n, np.float32)
    ss = np.empty(d_n, np.float32)
    zz = np.zeros(d_n, np.float32)  # absmax: no zero point
    for bh in range(nb * hs):
        b, h = bh // hs, bh % hs
        for gi in range(ng):
            t0, t1 = gi * g, min(gi * g + g, ts)
            for j in range(t1 - t0):
                load_row(xf, _u(((b * nh + heads[h]) * nt + tokens[t0 + j]) * d_n), blk, _u(j * d_n), dn)
            _column_params(blk, 0, t1 - t0, d_n, minmax, sf, zf, (bh * ng + gi) * d_n, lo, hi, ss, zz)
            base = _u((bh * ts + t0) * d_n)
            for o in range(_u(0), _u((t1 - t0) * d_n), dn):
                for d in range(_u(0), dn, U16):
                    _vcode16v(blk, o + d, zz, ss, d, mids, sym, base + o + d)


@njit(**JIT)
def codebook_quantize(x, heads, tokens, per_token, g, minmax, lloyd, init, sym, levels, scale, zero):
    """Codebook quantization of ``x[:, heads][:, :, tokens]``.

    Reference: :meth:`kvtune.codecs.codebook.CodebookQuantizer.quantize_block`.

    Args:
        x: ``(B, H, T, D)`` float32 or uint16 (bfloat16 bits), C-contiguous.
        heads, tokens: int64 indices of the segment's heads and tokens.
        per_token: groups of ``g`` channels (else of ``g`` tokens per channel).
        g: group length (``D`` or the segment's token count for a whole axis).
        minmax: mid-range zero point and half-range scale (else absmax scale).
        lloyd: fit the codebook (written to ``levels``) starting from ``init``; else ``init``
            (rounded to float32) is the codebook.
        init: float64 ``(L,)`` NF levels.
        sym: out, uint8 ``(B, len(heads), len(tokens), D)``.
        levels: out, uint16 ``(L,)`` float16 bits of the fitted codebook (untouched unless ``lloyd``).
        scale, zero: out, uint16 float16 bits, ``(B, Hs, Ts, ceil(D / g))`` per token or
            ``(B, Hs, ceil(Ts / g), D)`` per channel (``zero`` untouched unless ``minmax``).
    """
    nb, nh, nt, d_n = x.shape
    hs, ts = heads.shape[0], tokens.shape[0]
    xf, sf, zf = x.reshape(-1), scale.reshape(-1), zero.reshape(-1)
    if _blocked(per_token, g, d_n, init.shape[0], lloyd):
        _quantize_given(xf, nh, nt, d_n, heads, tokens, per_token, g, minmax, init, sym.reshape(-1), sf, zf, nb)
        return
    n = nb * hs * ts * d_n
    dn = _u(d_n)
    u = np.empty(n, np.float32)
    r = 0
    for b in range(nb):
        for hi in range(hs):
            for ti in range(ts):
                load_row(xf, _u(((b * nh + heads[hi]) * nt + tokens[ti]) * d_n), u, _u(r * d_n), dn)
                r += 1
    if per_token and g % 8 == 0 and d_n % g == 0:  # whole groups of 8k values tile the rows
        _normalise_tiled(u, nb * hs * ts * (d_n // g), g, minmax, sf, zf)
    elif per_token:
        ng = (d_n + g - 1) // g
        for r in range(nb * hs * ts):
            o = r * d_n
            for gi in range(ng):
                _normalise_run(u, o + gi * g, o + min(gi * g + g, d_n), minmax, sf, zf, r * ng + gi)
    else:
        ng = (ts + g - 1) // g
        lo = np.empty(d_n, np.float32)
        hi = np.empty(d_n, np.float32)
        ss = np.empty(d_n, np.float32)
        zz = np.empty(d_n, np.float32)
        for bh in range(nb * hs):
            for gi in range(ng):
                t0, t1 = gi * g, min(gi * g + g, ts)
                _normalise_columns(u, (bh * ts + t0) * d_n, t1 - t0, d_n, minmax, sf, zf, (bh * ng + gi) * d_n,
                                   lo, hi, ss, zz)
    nl = init.shape[0]
    lev = np.empty(nl, np.float32)
    if lloyd:
        _lloyd(u, n, init, levels)
        for k in range(nl):
            lev[k] = f16_bits_to_f32(levels[k])
    else:
        for k in range(nl):
            lev[k] = np.float32(init[k])
    _symbols(u, n, lev, sym.reshape(-1))


@njit(**INLINE)
def _level(q, levels, small, l0, l1, l2, l3, l4, l5, l6, l7):
    """``levels[q]``: for ``small`` codebooks (8 levels or fewer, padded with their last into
    ``l0 .. l7``) a chain of compares and selects, which vectorizes (a default-model tensor's
    3-bit lookups and scaling, 88 -> 28 us in a one-off measurement); else a load. The decoder
    takes it where :func:`_vdeq_levels16` does not apply (no AVX-512, rows or per-token groups
    that are not whole 16-lane vectors)."""
    if not small:
        return levels[q]
    k = np.int32(q)
    x = l0
    x = l1 if k >= 1 else x
    x = l2 if k >= 2 else x
    x = l3 if k >= 3 else x
    x = l4 if k >= 4 else x
    x = l5 if k >= 5 else x
    x = l6 if k >= 6 else x
    return l7 if k >= 7 else x


@intrinsic
def _vdeq_levels16(typingctx, sym, soff, table, s, z, poff, blk, boff):
    """``blk[boff + i] = z + table[sym[soff + i]] * s`` for 16 lanes (a lookup, a multiply, then
    an add, as :meth:`kvtune.codecs.codebook.CodebookQuantizer.dequantize_block`; no add when
    ``z`` is None): uint8 symbols below 16, float32 ``table`` of 16 entries (one ``vpermps``;
    needs :data:`PERMUTE`); ``s`` and ``z`` float32 scalars (a per-token group's), or float32
    arrays read at ``s[poff + i]`` (per-channel groups); ``blk`` float32, or uint16 bfloat16
    bits (:func:`.quantize.store16`'s rounding)."""
    def f32_array(a):
        return isinstance(a, types.Array) and a.dtype == types.float32

    if not (isinstance(sym, types.Array) and sym.dtype == types.uint8 and f32_array(table)
            and isinstance(blk, types.Array) and blk.dtype in (types.float32, types.uint16)):
        return None
    add = z != types.none
    lanes = f32_array(s) and (f32_array(z) or not add)
    if not lanes and not (isinstance(s, types.Float) and (isinstance(z, types.Float) or not add)):
        return None
    sig = types.void(sym, soff, table, s, z, poff, blk, boff)

    def codegen(context, builder, signature, args):
        sa = signature.args

        f32 = ir.FloatType()

        def lanes_of(i):  # float32 array i at poff
            return load_lanes(context, builder, sa[i], args[i], sa[5], args[5], f32)

        def splat(i):
            return splat16(builder, context.cast(builder, args[i], sa[i], types.float32))

        idx = builder.zext(load_lanes(context, builder, sa[0], args[0], sa[1], args[1], ir.IntType(8)), _I32x16)
        table = load_lanes(context, builder, sa[2], args[2], types.int64, ir.Constant(ir.IntType(64), 0), f32)
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_F32x16, [_F32x16, _I32x16]),
                                            "llvm.x86.avx512.permvar.sf.512")
        v = builder.fmul(builder.call(fn, [table, idx]), lanes_of(3) if lanes else splat(3))
        if add:
            v = builder.fadd(lanes_of(4) if lanes else splat(4), v)
        store16(context, builder, v, sa[6], args[6], sa[7], args[7])
        return context.get_dummy_value()

    return sig, codegen


@njit(**JIT)
def codebook_dequantize(sym, levels, scale, zero, per_token, g, minmax, heads, tokens, out, kind):
    """``out[:, heads][:, :, tokens] = levels[sym] * scale (+ zero)``.

    Reference: :meth:`kvtune.codecs.codebook.CodebookQuantizer.dequantize_block` (a lookup, a
    multiply, then an add), then the conversion to the output dtype.

    Args:
        sym: uint8 ``(B, Hs, Ts, D)``, values ``< len(levels)``.
        levels: float32 ``(L,)`` codebook (validated by the caller).
        scale, zero: uint16 float16 bits as :func:`codebook_quantize`.
        per_token, g, minmax: as :func:`codebook_quantize`.
        out: ``(B, H, T, D)`` float32, or uint16 bits of ``kind`` (1 bfloat16, 2 float16),
            written at the segment's heads and tokens.
    """
    nb, hs, ts, d_n = sym.shape
    nh, nt = out.shape[1], out.shape[2]
    sf, scf, zf, of = sym.reshape(-1), scale.reshape(-1), zero.reshape(-1), out.reshape(-1)
    dn = _u(d_n)
    blk = np.empty(_ROWS * d_n, np.float32)  # rows reconstructed here, converted _ROWS at a time
    dst = np.empty(_ROWS, np.int64)
    ss = np.empty(d_n, np.float32)
    zz = np.zeros(d_n, np.float32)
    ng = (d_n + g - 1) // g if per_token else (ts + g - 1) // g
    nl = levels.shape[0]
    small = nl <= 8
    pad = np.empty(16, np.float32)  # lanes 8-15 of the vpermps table: never indexed (symbols < 8)
    for k in range(16):
        pad[k] = levels[min(k, nl - 1)]
    vector = (PERMUTE and small and kind != 2 and d_n % 16 == 0
              and (not per_token or (g % 16 == 0 and d_n % g == 0)))  # float16 output: through the block
    l0, l1, l2, l3, l4, l5, l6, l7 = pad[0], pad[1], pad[2], pad[3], pad[4], pad[5], pad[6], pad[7]
    r = 0
    for b in range(nb):
        for hi in range(hs):
            for ti in range(ts):
                k = r % _ROWS
                dst[k] = ((b * nh + heads[hi]) * nt + tokens[ti]) * d_n
                src = _u(r * d_n)
                o = _u(k * d_n)
                r += 1
                if not per_token and ti % g == 0:  # the channels' scales for this group of tokens
                    m = _u(((b * hs + hi) * ng + ti // g) * d_n)
                    for d in range(dn):
                        ss[d] = f16_bits_to_f32(scf[m + d])
                    if minmax:
                        for d in range(dn):
                            zz[d] = f16_bits_to_f32(zf[m + d])
                if vector:  # lookups, scaling and conversion 16 lanes at a time, into the output row
                    row = _u(dst[k])
                    if per_token:
                        for gi in range(ng):
                            m = r * ng - ng + gi
                            s = f16_bits_to_f32(scf[m])
                            if minmax:
                                z = f16_bits_to_f32(zf[m])
                                for d in range(_u(gi * g), _u(gi * g + g), _u(16)):
                                    _vdeq_levels16(sf, src + d, pad, s, z, 0, of, row + d)
                            else:
                                for d in range(_u(gi * g), _u(gi * g + g), _u(16)):
                                    _vdeq_levels16(sf, src + d, pad, s, None, 0, of, row + d)
                    elif minmax:
                        for d in range(_u(0), dn, _u(16)):
                            _vdeq_levels16(sf, src + d, pad, ss, zz, d, of, row + d)
                    else:
                        for d in range(_u(0), dn, _u(16)):
                            _vdeq_levels16(sf, src + d, pad, ss, None, d, of, row + d)
                    continue
                else:
                    for d in range(dn):  # the row's levels first: this loop vectorizes on its own
                        blk[o + d] = _level(sf[src + d], levels, small, l0, l1, l2, l3, l4, l5, l6, l7)
                    if per_token:
                        for gi in range(ng):
                            m = r * ng - ng + gi
                            s = f16_bits_to_f32(scf[m])
                            d0, d1 = _u(gi * g), _u(min(gi * g + g, d_n))
                            if minmax:
                                z = f16_bits_to_f32(zf[m])
                                for d in range(d0, d1):
                                    v = blk[o + d] * s
                                    blk[o + d] = z + v
                            else:
                                for d in range(d0, d1):
                                    blk[o + d] = blk[o + d] * s
                    elif minmax:
                        for d in range(dn):
                            v = blk[o + d] * ss[d]
                            blk[o + d] = zz[d] + v
                    else:
                        for d in range(dn):
                            blk[o + d] = blk[o + d] * ss[d]
                if k == _ROWS - 1 or r == nb * hs * ts:
                    store_rows(blk, dst, k + 1, d_n, False, of, kind)

