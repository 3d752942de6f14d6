"""float8 (e4m3fn / e5m2) quantization of KV segments, optionally scaled per token.

Accelerates :class:`kvtune.codecs.fp8.FP8Quantizer`: the float8 formats of "FP8 Formats for
Deep Learning" (Micikevicius et al., arXiv 2209.05433: E4M3 without infinities, largest value
448; E5M2, largest finite value 57344), converted exactly as torch's casts (c10's
``fp8e4m3fn_from_fp32_value`` / ``fp8e5m2_from_fp32_value``, round to nearest even, saturated
to the largest finite value first).
"""

from __future__ import annotations

import numpy as np
from numba import njit, uintp

from .convert import f16_bits_to_f32, fp16_round_up_bits, load_row, store_row
from .lowlevel import INLINE, JIT, ZERO, absmax, f32_as_u32, u32_as_f32

_u = uintp


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
