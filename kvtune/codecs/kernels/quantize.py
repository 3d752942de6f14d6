"""Uniform (integer grid) quantization of KV segments, per token or per channel.

Accelerates :class:`kvtune.codecs.quantizers.UniformQuantizer` (``quantize_block`` /
``dequantize_block``): asymmetric or symmetric ``bits``-bit grids over groups of channels (per
token) or of tokens (per channel), with float16 scales and zero points -- the scheme of KIVI
("KIVI: A Tuning-Free Asymmetric 2bit Quantization for KV Cache", arXiv 2402.02750, sec. 3:
keys per channel, values per token). Bit for bit the reference's IEEE operations (a subtract,
a multiply, round to nearest even, clamp), on 8-lane vectors.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types, uintp
from numba.core import cgutils
from numba.extending import intrinsic

from .convert import f16_bits_to_f32, f32_to_f16_bits, fp16_round_up_bits, load_row, store_row
from .lowlevel import F32_TINY, FP16_MAX, INLINE, JIT, ONE, TWO, U8, ZERO, absmax, v8_ptr, vminmax

_u = uintp
_mn = np.minimum  # elementwise min/max across arrays: faster than the builtin (which wins in
# scalar reduction chains)
_mx = np.maximum


@njit(**INLINE)
def _scale_bits(s):
    """float32 -> float16 bits of ``where(clamp(s, 0, 65504) > 0, ., +0)`` (nearest even)."""
    s = min(np.float32(s), FP16_MAX)
    return f32_to_f16_bits(s) if s > ZERO else np.int64(0)


@njit(**INLINE)
def _params(lo, hi, n, bits, symmetric, s16, z16, zs, invs):
    """Group parameters of ``n`` groups from their min ``lo`` and max ``hi`` (absmax when
    ``symmetric``): float16 bits ``s16``/``z16`` and float32 ``zs`` (zero) and ``invs``
    (``1/scale``, 0 for a zero scale). References:
    :func:`~kvtune.codecs.quantizers.asymmetric_params`,
    :func:`~kvtune.codecs.quantizers.symmetric_params`,
    :func:`~kvtune.codecs.quantizers.quantize_affine`.

    Several short loops over at most three arrays each: LLVM vectorizes a loop only when it
    can check at run time that its arrays do not overlap, and gives up beyond a few arrays.
    """
    fq = np.float32((1 << bits) - 1)
    if symmetric:
        for i in range(n):
            s16[i] = _scale_bits((TWO * hi[i]) / fq)
        c = np.float32(-((1 << bits) - 1) / 2.0)
        for i in range(n):
            zs[i] = f16_bits_to_f32(s16[i]) * c
    else:
        for i in range(n):
            z16[i] = fp16_round_up_bits(lo[i])
        for i in range(n):
            zs[i] = f16_bits_to_f32(z16[i])
        for i in range(n):
            s16[i] = _scale_bits((hi[i] - zs[i]) / fq)
    for i in range(n):
        s = f16_bits_to_f32(s16[i])
        invs[i] = ONE / max(s, F32_TINY) if s > ZERO else ZERO


@njit(**INLINE)
def _sz(scale16, zero16, bits, symmetric):
    """float32 ``(scale, zero)`` of a group from its float16 metadata."""
    s = f16_bits_to_f32(scale16)
    if symmetric:
        return s, s * np.float32(-((1 << bits) - 1) / 2.0)
    return s, f16_bits_to_f32(zero16)


@njit(**INLINE)
def _quant(v, z, inv, fq):
    """``clamp(rint((v - z) * inv), 0, fq)`` as an integer (reference: ``quantize_affine``)."""
    u = np.rint((v - z) * inv)
    u = min(max(u, ZERO), fq)
    return np.uint8(u)


_ROWS = 32  # rows per block of the per-token kernel


@intrinsic
def _vquant8(typingctx, src, soff, z, inv, fq, dst, doff):
    """8 lanes of :func:`_quant`: ``dst[doff + i] = clamp(rint((src[soff + i] - z) * inv), 0, fq)``.

    A subtract, a multiply (two roundings, no FMA), ``llvm.rint`` (nearest even, as
    ``np.rint``/``torch.round``), max/min clamp, conversion to uint8: the reference's operations
    on a vector."""
    if not (isinstance(src, types.Array) and src.dtype == types.float32 and isinstance(dst, types.Array)
            and dst.dtype == types.uint8):
        return None
    sig = types.void(src, soff, z, inv, fq, dst, doff)

    def codegen(context, builder, signature, args):
        f32 = ir.FloatType()
        v8 = ir.VectorType(f32, 8)
        mod = builder.module
        ptr = v8_ptr(context, builder, types.void(signature.args[0], signature.args[1]), [args[0], args[1]])
        dary = context.make_array(signature.args[5])(context, builder, args[5])
        doff = context.cast(builder, args[6], signature.args[6], types.int64)
        dptr = builder.bitcast(builder.gep(dary.data, [doff]), ir.VectorType(ir.IntType(8), 8).as_pointer())

        def splat(val):
            return builder.shuffle_vector(
                builder.insert_element(ir.Constant(v8, ir.Undefined), val, ir.Constant(ir.IntType(32), 0)),
                ir.Constant(v8, ir.Undefined), ir.Constant(ir.VectorType(ir.IntType(32), 8), [0] * 8))

        rint = cgutils.get_or_insert_function(mod, ir.FunctionType(v8, [v8]), "llvm.rint.v8f32")
        vmax = cgutils.get_or_insert_function(mod, ir.FunctionType(v8, [v8, v8]), "llvm.maxnum.v8f32")
        vmin = cgutils.get_or_insert_function(mod, ir.FunctionType(v8, [v8, v8]), "llvm.minnum.v8f32")
        z, inv, fq = (context.cast(builder, a, t, types.float32) for a, t in zip(args[2:5], signature.args[2:5]))
        v = builder.load(ptr, align=4)
        u = builder.call(rint, [builder.fmul(builder.fsub(v, splat(z)), splat(inv))])
        u = builder.call(vmin, [builder.call(vmax, [u, ir.Constant(v8, [0.0] * 8)]), splat(fq)])
        builder.store(builder.fptoui(u, ir.VectorType(ir.IntType(8), 8)), dptr, align=1)
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def _vquant8v(typingctx, src, soff, zs, invs, poff, fq, dst, doff):
    """As :func:`_vquant8` with per-lane ``zs[poff + i]`` and ``invs[poff + i]`` (per-channel groups)."""
    if not (isinstance(src, types.Array) and src.dtype == types.float32 and isinstance(dst, types.Array)
            and dst.dtype == types.uint8):
        return None
    sig = types.void(src, soff, zs, invs, poff, fq, dst, doff)

    def codegen(context, builder, signature, args):
        f32 = ir.FloatType()
        v8 = ir.VectorType(f32, 8)
        mod = builder.module
        sa = signature.args
        ptr = v8_ptr(context, builder, types.void(sa[0], sa[1]), [args[0], args[1]])
        zp = v8_ptr(context, builder, types.void(sa[2], sa[4]), [args[2], args[4]])
        ip = v8_ptr(context, builder, types.void(sa[3], sa[4]), [args[3], args[4]])
        dary = context.make_array(sa[6])(context, builder, args[6])
        doff = context.cast(builder, args[7], sa[7], types.int64)
        dptr = builder.bitcast(builder.gep(dary.data, [doff]), ir.VectorType(ir.IntType(8), 8).as_pointer())
        fq = context.cast(builder, args[5], sa[5], types.float32)
        fqv = builder.shuffle_vector(
            builder.insert_element(ir.Constant(v8, ir.Undefined), fq, ir.Constant(ir.IntType(32), 0)),
            ir.Constant(v8, ir.Undefined), ir.Constant(ir.VectorType(ir.IntType(32), 8), [0] * 8))
        rint = cgutils.get_or_insert_function(mod, ir.FunctionType(v8, [v8]), "llvm.rint.v8f32")
        vmax = cgutils.get_or_insert_function(mod, ir.FunctionType(v8, [v8, v8]), "llvm.maxnum.v8f32")
        vmin = cgutils.get_or_insert_function(mod, ir.FunctionType(v8, [v8, v8]), "llvm.minnum.v8f32")
        v = builder.load(ptr, align=4)
        u = builder.call(rint, [builder.fmul(builder.fsub(v, builder.load(zp, align=4)), builder.load(ip, align=4))])
        u = builder.call(vmin, [builder.call(vmax, [u, ir.Constant(v8, [0.0] * 8)]), fqv])
        builder.store(builder.fptoui(u, ir.VectorType(ir.IntType(8), 8)), dptr, align=1)
        return context.get_dummy_value()

    return sig, codegen


@njit(**JIT)
def quantize_per_token(x, heads, tokens, g, bits, symmetric, sym, scale, zero):
    """Uniform quantization of ``x[:, heads][:, :, tokens]`` in groups of ``g`` channels.

    Reference: :meth:`kvtune.codecs.quantizers.UniformQuantizer.quantize_block` with
    ``granularity = "per_token"``. Works on blocks of 32 rows: load, min/max of every group,
    the groups' parameters (vectorized), then the symbols (one loop over the block's groups
    when they tile it in multiples of 8 values: no per-row bounds or scalar tails).

    Args:
        x: ``(B, H, T, D)`` float32 or uint16 (bfloat16 bits), C-contiguous.
        heads, tokens: int64 indices of the segment's heads and tokens.
        g: channels per group (``D`` for a whole row).
        bits: 1..8.
        symmetric: symmetric grid (``zero`` is left untouched).
        sym: out, uint8 ``(B, len(heads), len(tokens), D)``.
        scale, zero: out, uint16 float16 bits ``(B, len(heads), len(tokens), ceil(D / g))``.
    """
    nb, nh, nt, d_n = x.shape
    xf, sf, scf, zf = x.reshape(-1), sym.reshape(-1), scale.reshape(-1), zero.reshape(-1)
    hs, ts = heads.shape[0], tokens.shape[0]
    ng = scale.shape[3]
    nrows = nb * hs * ts
    fq = np.float32((1 << bits) - 1)
    dn = _u(d_n)
    blk = np.empty(_ROWS * d_n, np.float32)
    lo = np.empty(_ROWS * ng, np.float32)
    hi = np.empty(_ROWS * ng, np.float32)
    s16 = np.empty(_ROWS * ng, np.int32)
    z16 = np.empty(_ROWS * ng, np.int32)
    zs = np.empty(_ROWS * ng, np.float32)
    invs = np.empty(_ROWS * ng, np.float32)
    tiled = g % 8 == 0 and d_n % g == 0  # KIVI's g = 32, a whole row of 64 or 128: one flat loop
    ug = _u(g)
    b = hi_ = ti = 0  # (batch, head, token) of the next row to load
    for r0 in range(0, nrows, _ROWS):
        nr = min(_ROWS, nrows - r0)
        for r in range(nr):
            load_row(xf, _u(((b * nh + heads[hi_]) * nt + tokens[ti]) * d_n), blk, _u(r * d_n), dn)
            ti += 1
            if ti == ts:
                ti = 0
                hi_ += 1
                if hi_ == hs:
                    hi_ = 0
                    b += 1
        for r in range(nr):
            o = _u(r * d_n)
            for gi in range(ng):
                d0 = o + _u(gi * g)
                d1 = o + _u(min(gi * g + g, d_n))
                i = r * ng + gi
                if symmetric:
                    hi[i] = absmax(blk, d0, d1)
                else:
                    lo[i], hi[i] = vminmax(blk, d0, d1)
        _params(lo, hi, nr * ng, bits, symmetric, s16, z16, zs, invs)
        mo = _u(r0 * ng)
        for i in range(_u(nr * ng)):
            scf[mo + i] = s16[i]
        if not symmetric:
            for i in range(_u(nr * ng)):
                zf[mo + i] = z16[i]
        base = _u(r0 * d_n)
        if tiled:  # the block is nr * ng whole groups of g = 8k values, back to back
            for i in range(_u(nr * ng)):
                z, inv = zs[i], invs[i]
                d0 = i * ug
                for d in range(d0, d0 + ug, U8):
                    _vquant8(blk, d, z, inv, fq, sf, base + d)
            continue
        for r in range(nr):
            o = _u(r * d_n)
            for gi in range(ng):
                i = r * ng + gi
                z, inv = zs[i], invs[i]
                d0 = o + _u(gi * g)
                d1 = o + _u(min(gi * g + g, d_n))
                d8 = d0 + (d1 - d0) // U8 * U8
                for d in range(d0, d8, U8):
                    _vquant8(blk, d, z, inv, fq, sf, base + d)
                for d in range(d8, d1):
                    sf[base + d] = _quant(blk[d], z, inv, fq)


@njit(**JIT)
def quantize_per_channel(x, heads, tokens, g, bits, symmetric, sym, scale, zero):
    """Uniform quantization of ``x[:, heads][:, :, tokens]`` in groups of ``g`` tokens per channel.

    Reference: :meth:`kvtune.codecs.quantizers.UniformQuantizer.quantize_block` with
    ``granularity = "per_channel"``. Arguments as :func:`quantize_per_token`; ``scale`` and
    ``zero`` are ``(B, len(heads), ceil(len(tokens) / g), D)``.
    """
    nb, nh, nt, d_n = x.shape
    xf, sf, scf, zf = x.reshape(-1), sym.reshape(-1), scale.reshape(-1), zero.reshape(-1)
    hs, ts = heads.shape[0], tokens.shape[0]
    ng = scale.shape[2]
    fq = np.float32((1 << bits) - 1)
    dn = _u(d_n)
    blk = np.empty(min(g, ts) * d_n, np.float32)
    lo = np.empty(d_n, np.float32)
    hi = np.empty(d_n, np.float32)
    s16 = np.empty(d_n, np.int32)
    z16 = np.empty(d_n, np.int32)
    zs = np.empty(d_n, np.float32)
    invs = np.empty(d_n, np.float32)
    for b in range(nb):
        for h in range(hs):
            hrow = (b * nh + heads[h]) * nt
            for gi in range(ng):
                t0 = gi * g
                n = min(g, ts - t0)
                for j in range(n):
                    load_row(xf, _u((hrow + tokens[t0 + j]) * d_n), blk, _u(j * d_n), dn)
                if symmetric:
                    for d in range(dn):
                        hi[d] = abs(blk[d])
                    for j in range(1, n):
                        o = _u(j * d_n)
                        for d in range(dn):
                            hi[d] = _mx(hi[d], abs(blk[o + d]))
                else:
                    for d in range(dn):
                        lo[d] = blk[d]
                        hi[d] = blk[d]
                    for j in range(1, n):
                        o = _u(j * d_n)
                        for d in range(dn):
                            v = blk[o + d]
                            lo[d] = _mn(lo[d], v)
                            hi[d] = _mx(hi[d], v)
                _params(lo, hi, d_n, bits, symmetric, s16, z16, zs, invs)
                mo = _u(((b * hs + h) * ng + gi) * d_n)
                for d in range(dn):
                    scf[mo + d] = s16[d]
                if not symmetric:
                    for d in range(dn):
                        zf[mo + d] = z16[d]
                base = _u(((b * hs + h) * ts + t0) * d_n)
                d8 = dn // U8 * U8
                for j in range(n):
                    o = _u(j * d_n)
                    for d in range(_u(0), d8, U8):
                        _vquant8v(blk, o + d, zs, invs, d, fq, sf, base + o + d)
                    for d in range(d8, dn):
                        sf[base + o + d] = _quant(blk[o + d], zs[d], invs[d], fq)


@njit(**JIT)
def dequantize_per_token(sym, scale, zero, g, bits, symmetric, heads, tokens, out, kind):
    """``out[:, heads][:, :, tokens] = zero + sym * scale``, per-token groups.

    Reference: :meth:`kvtune.codecs.quantizers.UniformQuantizer.dequantize_block`
    (:func:`~kvtune.codecs.quantizers.dequantize_affine`: a multiply, then an add), then the
    conversion to the output dtype.

    Args:
        sym: uint8 ``(B, Hs, Ts, D)``; scale, zero: uint16 float16 bits ``(B, Hs, Ts, G)``.
        out: ``(B, H, T, D)`` float32, or uint16 bits of ``kind`` (1 bfloat16, 2 float16),
            written at the segment's heads and tokens.
    """
    nb, hs, ts, d_n = sym.shape
    nh, nt = out.shape[1], out.shape[2]
    sf, scf, zf, of = sym.reshape(-1), scale.reshape(-1), zero.reshape(-1), out.reshape(-1)
    ng = scale.shape[3]
    dn = _u(d_n)
    row = np.empty(d_n, np.float32)
    r = 0
    for b in range(nb):
        for hi in range(hs):
            for ti in range(ts):
                src = _u(r * d_n)
                for gi in range(ng):
                    m = _u(r * ng + gi)
                    s, z = _sz(scf[m], zf[m] if not symmetric else 0, bits, symmetric)
                    for d in range(_u(gi * g), _u(min(gi * g + g, d_n))):
                        v = np.float32(sf[src + d]) * s
                        row[d] = z + v
                store_row(of, _u(((b * nh + heads[hi]) * nt + tokens[ti]) * d_n), row, dn, kind)
                r += 1


@njit(**JIT)
def dequantize_per_channel(sym, scale, zero, g, bits, symmetric, heads, tokens, out, kind):
    """As :func:`dequantize_per_token` for per-channel groups (scale, zero ``(B, Hs, Gt, D)``)."""
    nb, hs, ts, d_n = sym.shape
    nh, nt = out.shape[1], out.shape[2]
    sf, scf, zf, of = sym.reshape(-1), scale.reshape(-1), zero.reshape(-1), out.reshape(-1)
    ng = scale.shape[2]
    dn = _u(d_n)
    ss = np.empty(d_n, np.float32)
    zz = np.empty(d_n, np.float32)
    row = np.empty(d_n, np.float32)
    for b in range(nb):
        for hi in range(hs):
            for gi in range(ng):
                m = _u(((b * hs + hi) * ng + gi) * d_n)
                for d in range(dn):
                    s, z = _sz(scf[m + d], zf[m + d] if not symmetric else 0, bits, symmetric)
                    ss[d] = s
                    zz[d] = z
                for ti in range(gi * g, min(gi * g + g, ts)):
                    src = _u(((b * hs + hi) * ts + ti) * d_n)
                    for d in range(dn):
                        v = np.float32(sf[src + d]) * ss[d]
                        row[d] = zz[d] + v
                    store_row(of, _u(((b * nh + heads[hi]) * nt + tokens[ti]) * d_n), row, dn, kind)
