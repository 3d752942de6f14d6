"""float8 (e4m3fn / e5m2) quantization of KV segments, optionally scaled per token.

Accelerates :class:`kvtune.codecs.fp8.FP8Quantizer`: the float8 formats of "FP8 Formats for
Deep Learning" (Micikevicius et al., arXiv 2209.05433: E4M3 without infinities, largest value
448; E5M2, largest finite value 57344), converted exactly as torch's casts (c10's
``fp8e4m3fn_from_fp32_value`` / ``fp8e5m2_from_fp32_value``, round to nearest even, saturated
to the largest finite value first).
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types, uintp
from numba.core import cgutils
from numba.extending import intrinsic

from .convert import f16_bits_to_f32, fp16_round_up_bits, load_row, store_row
from .lowlevel import INLINE, JIT, ZERO, absmax, f32_as_u32, u32_as_f32

_u = uintp
LANES = 16
"""Elements per call of :func:`e4m3_from_bf16_16` / :func:`bf16_from_e4m3_16`."""


def _lanes_ptr(context, builder, ary_ty, ary, off_ty, off, elem):
    """``<16 x elem>*`` to ``ary[off]``."""
    a = context.make_array(ary_ty)(context, builder, ary)
    i = context.cast(builder, off, off_ty, types.int64)
    return builder.bitcast(builder.gep(a.data, [i]), ir.VectorType(elem, LANES).as_pointer())


def _splat(c, width=32):
    return ir.Constant(ir.VectorType(ir.IntType(width), LANES), [c] * LANES)


@intrinsic
def e4m3_from_bf16_16(typingctx, src, soff, dst, doff):
    """``dst[doff + i] = e4m3(clamp(bf16(src[soff + i]), -448, 448))`` for 16 lanes: the
    branch-free c10 conversion of :func:`_fp8_e4m3_bits` on 32-bit integer lanes (numba's int64
    arithmetic would halve the vector width). ``src``: uint16 bfloat16 bits, finite values
    (the inputs are checked before encoding); ``dst``: uint8."""
    if not (isinstance(src, types.Array) and src.dtype == types.uint16 and isinstance(dst, types.Array)
            and dst.dtype == types.uint8):
        return None
    sig = types.void(src, soff, dst, doff)

    def codegen(context, builder, signature, args):
        sa = signature.args
        i16, i32, f32 = ir.IntType(16), ir.IntType(32), ir.FloatType()
        vi, vf = ir.VectorType(i32, LANES), ir.VectorType(f32, LANES)
        raw = builder.load(_lanes_ptr(context, builder, sa[0], args[0], sa[1], args[1], i16), align=2)
        f = builder.bitcast(builder.shl(builder.zext(raw, vi), _splat(16)), vf)
        m = ir.Constant(vf, [448.0] * LANES)
        mod = builder.module
        vmin = cgutils.get_or_insert_function(mod, ir.FunctionType(vf, [vf, vf]), "llvm.minnum.v16f32")
        vmax = cgutils.get_or_insert_function(mod, ir.FunctionType(vf, [vf, vf]), "llvm.maxnum.v16f32")
        f = builder.call(vmin, [builder.call(vmax, [f, builder.fneg(m)]), m])
        bits = builder.bitcast(f, vi)
        sign = builder.and_(bits, _splat(-0x80000000))
        fb = builder.xor(bits, sign)
        denorm = _splat(141 << 23)
        sub = builder.sub(builder.bitcast(builder.fadd(builder.bitcast(fb, vf), builder.bitcast(denorm, vf)), vi), denorm)
        odd = builder.and_(builder.lshr(fb, _splat(20)), _splat(1))
        nrm = builder.lshr(builder.add(builder.add(fb, _splat(((7 - 127) << 23) + 0x7FFFF)), odd), _splat(20))
        res = builder.select(builder.icmp_signed("<", fb, _splat(121 << 23)), sub, nrm)
        res = builder.select(builder.icmp_signed(">=", fb, _splat(1087 << 20)), _splat(0x7F), res)
        res = builder.or_(builder.and_(res, _splat(0xFF)), builder.lshr(sign, _splat(24)))
        out = builder.trunc(res, ir.VectorType(ir.IntType(8), LANES))
        builder.store(out, _lanes_ptr(context, builder, sa[2], args[2], sa[3], args[3], ir.IntType(8)), align=1)
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def bf16_from_e4m3_16(typingctx, src, soff, nan_pos, nan_neg, dst, doff):
    """``dst[doff + i]`` = the bfloat16 bits of the e4m3fn value ``src[soff + i]`` for 16
    lanes: normal values by moving the fields (exponent + 120, mantissa << 4), subnormals
    ``m * 2**-9`` through an exact float32 product, the NaN patterns (0x7F, 0xFF) as
    ``nan_pos`` / ``nan_neg`` (the bits torch's cast gives them, from its table). ``src``:
    uint8; ``dst``: uint16."""
    if not (isinstance(src, types.Array) and src.dtype == types.uint8 and isinstance(dst, types.Array)
            and dst.dtype == types.uint16):
        return None
    sig = types.void(src, soff, nan_pos, nan_neg, dst, doff)

    def codegen(context, builder, signature, args):
        sa = signature.args
        i8, i16, i32, f32 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.FloatType()
        vi, vf = ir.VectorType(i32, LANES), ir.VectorType(f32, LANES)
        x = builder.zext(builder.load(_lanes_ptr(context, builder, sa[0], args[0], sa[1], args[1], i8), align=1), vi)
        sign = builder.shl(builder.and_(x, _splat(0x80)), _splat(8))
        e = builder.and_(builder.lshr(x, _splat(3)), _splat(0xF))
        m = builder.and_(x, _splat(7))
        nrm = builder.or_(builder.shl(builder.add(e, _splat(120)), _splat(7)), builder.shl(m, _splat(4)))
        tiny = builder.fmul(builder.sitofp(m, vf), ir.Constant(vf, [2.0 ** -9] * LANES))
        sub = builder.lshr(builder.bitcast(tiny, vi), _splat(16))
        r = builder.or_(builder.select(builder.icmp_signed("==", e, _splat(0)), sub, nrm), sign)

        def lane(k):
            v = context.cast(builder, args[k], sa[k], types.int64)
            v = builder.trunc(v, i32)
            return builder.shuffle_vector(builder.insert_element(ir.Constant(vi, ir.Undefined), v, ir.Constant(i32, 0)),
                                          ir.Constant(vi, ir.Undefined), ir.Constant(ir.VectorType(i32, LANES), [0] * LANES))

        r = builder.select(builder.icmp_signed("==", x, _splat(0x7F)), lane(2), r)
        r = builder.select(builder.icmp_signed("==", x, _splat(0xFF)), lane(3), r)
        builder.store(builder.trunc(r, ir.VectorType(i16, LANES)),
                      _lanes_ptr(context, builder, sa[4], args[4], sa[5], args[5], i16), align=2)
        return context.get_dummy_value()

    return sig, codegen


@njit(**INLINE)
def _fp8_e4m3_bits(f):
    """float32 (already clamped to +-448) -> float8_e4m3fn bits (c10's fp8e4m3fn_from_fp32_value),
    written without branches on the value so that it vectorizes."""
    fb0 = np.int64(f32_as_u32(np.float32(f)))
    sign = fb0 & 0x80000000
    fb = fb0 ^ sign
    denorm = np.int64(141) << 23
    sub = (np.int64(f32_as_u32(u32_as_f32(fb) + u32_as_f32(denorm))) - denorm) & 0xFF
    nrm = ((fb + ((7 - 127) << 23) + 0x7FFFF + ((fb >> 20) & 1)) >> 20) & 0xFF
    res = sub if fb < (121 << 23) else nrm
    res = np.int64(0x7F) if fb >= (1087 << 20) else res
    return res | (sign >> 24)


@njit(**INLINE)
def _fp8_e5m2_bits(f):
    """float32 (already clamped to +-57344) -> float8_e5m2 bits (c10's fp8e5m2_from_fp32_value)."""
    fb0 = np.int64(f32_as_u32(np.float32(f)))
    sign = fb0 & 0x80000000
    fb = fb0 ^ sign
    denorm = np.int64(134) << 23
    sub = (np.int64(f32_as_u32(u32_as_f32(fb) + u32_as_f32(denorm))) - denorm) & 0xFF
    nrm = ((fb + ((15 - 127) << 23) + 0xFFFFF + ((fb >> 21) & 1)) >> 21) & 0xFF
    res = sub if fb < (113 << 23) else nrm
    special = np.int64(0x7F) if fb > (255 << 23) else np.int64(0x7C)
    res = special if fb >= (143 << 23) else res
    return res | (sign >> 24)


@njit(**INLINE)
def _fp8_bits(v, e5m2, m):
    if v > m:
        v = m
    if v < -m:
        v = -m
    return _fp8_e5m2_bits(v) if e5m2 else _fp8_e4m3_bits(v)


@njit(**JIT)
def fp8_quantize(x, heads, tokens, e5m2, fmax, scaled, sym, scale):
    """float8 symbols of ``x[:, heads][:, :, tokens]``, optionally per-token scaled.

    Reference: :meth:`kvtune.codecs.fp8.FP8Quantizer.quantize_block`.

    Args:
        x: ``(B, H, T, D)`` float32 or uint16 (bfloat16 bits).
        e5m2: format e5m2 (else e4m3fn).
        fmax: the format's largest finite value (448 or 57344).
        scaled: divide each token by ``fp16_round_up(absmax / fmax)`` first.
        sym: out uint8 ``(B, Hs, Ts, D)``; scale: out uint16 ``(B, Hs, Ts)`` (when ``scaled``).
    """
    nb, nh, nt, d_n = x.shape
    xf, sf, scf = x.reshape(-1), sym.reshape(-1), scale.reshape(-1)
    m = np.float32(fmax)
    dn = _u(d_n)
    row = np.empty(d_n, np.float32)
    r = 0
    for b in range(nb):
        for hi in range(heads.shape[0]):
            for ti in range(tokens.shape[0]):
                load_row(xf, _u(((b * nh + heads[hi]) * nt + tokens[ti]) * d_n), row, _u(0), dn)
                dst = _u(r * d_n)
                if scaled:
                    s16 = fp16_round_up_bits(absmax(row, _u(0), dn) / m)
                    scf[_u(r)] = s16
                    s = f16_bits_to_f32(s16)
                    for d in range(dn):
                        v = row[d] / s if s > ZERO else ZERO
                        sf[dst + d] = _fp8_bits(v, e5m2, m)
                elif e5m2:
                    for d in range(dn):
                        sf[dst + d] = _fp8_bits(row[d], True, m)
                else:
                    for d in range(dn):
                        sf[dst + d] = _fp8_bits(row[d], False, m)
                r += 1


@njit(**JIT)
def fp8_dequantize(sym, scale, lut, scaled, heads, tokens, out, kind):
    """``out[:, heads][:, :, tokens] = lut[sym] (* scale per token)``, converted as
    :func:`~kvtune.codecs.kernels.dequantize_per_token`.

    ``lut`` is the float32 value of every float8 bit pattern (made by torch, so exact).
    Reference: :meth:`kvtune.codecs.fp8.FP8Quantizer.dequantize_block`.
    """
    nb, hs, ts, d_n = sym.shape
    nh, nt = out.shape[1], out.shape[2]
    sf, scf, of = sym.reshape(-1), scale.reshape(-1), out.reshape(-1)
    dn = _u(d_n)
    row = np.empty(d_n, np.float32)
    r = 0
    for b in range(nb):
        for hi in range(hs):
            for ti in range(ts):
                src = _u(r * d_n)
                if scaled:
                    s = f16_bits_to_f32(scf[_u(r)])
                    for d in range(dn):
                        row[d] = lut[sf[src + d]] * s
                else:
                    for d in range(dn):
                        row[d] = lut[sf[src + d]]
                store_row(of, _u(((b * nh + heads[hi]) * nt + tokens[ti]) * d_n), row, dn, kind)
                r += 1
