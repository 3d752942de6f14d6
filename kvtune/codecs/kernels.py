"""Compiled kernels of the codec fast path (:mod:`kvtune.codecs.fastpath`), written with numba.

Every public kernel reproduces, bit for bit, a reference written with torch, numpy or zlib
(named in its docstring: a component of :mod:`kvtune.codecs`, or the library call).
``tests/test_kernels.py`` compares every public kernel of this module with its reference on
seeded random inputs and edge cases (empty inputs, lengths that are not a multiple of the
8-lane vector width or of the bit-packing unit, every width 1..8, saturating and extreme
values, NaN/inf where a kernel tests finiteness), and fails when a public kernel has no case;
``tests/test_codecs.py`` checks whole streams (fast path == reference path). Finite inputs are
covered by that guarantee; NaN payloads are not (torch itself converts NaN differently in its
vectorized and scalar paths).

Conventions:

* All kernels are serial, release the GIL (``nogil=True``) and are compiled once per input
  dtype and cached on disk (``cache=True``): the codec fast path parallelizes *across* K/V
  tensors with a small thread pool. (Measured on the 2-core development machine under load
  average 6-10: a ``prange`` launch costs ~0.1 ms with numba's workqueue layer and ~16 ms with
  the OpenMP layer -- the second thread is often descheduled and the barrier waits for it --
  while one tensor's serial kernel takes ~0.1-0.5 ms. Coarse, dynamically scheduled tasks do
  not wait for a descheduled thread.)
* IEEE semantics: ``fastmath=False`` everywhere, so no FMA contraction (the references are
  written as a separate multiply and add) and no reassociation. Min/max over a group is
  order-independent for non-NaN data except for the sign of a zero; the canonical ``+0`` zero
  point of :func:`kvtune.codecs.quantizers.asymmetric_params` removes that ambiguity.
* Integer bit manipulation is done in int64 (numba promotes small unsigned types in ways that
  can silently produce floats when mixed with signed ones).
* Tensors are ``(batch, heads, tokens, head_dim)`` numpy arrays; bfloat16 travels as its
  ``uint16`` bit pattern, float16 metadata as ``uint16`` bits. Segments select heads and
  tokens with int64 index arrays (:class:`kvtune.codecs.base.Segment`).

First-call cost: compiling every kernel for one input dtype takes ~20-40 s on a loaded 2-core
machine; with ``cache=True`` later processes load the machine code from ``__pycache__`` in
well under a second (see :func:`warm_up`).
"""

from __future__ import annotations

import math
import warnings

import numpy as np
from llvmlite import ir
from numba import njit, types, uintp
from numba.core import cgutils
from numba.core.errors import NumbaIRAssumptionWarning
from numba.extending import intrinsic, overload

__all__ = [
    "f32_to_f16_bits",
    "f32_to_f16_bits_soft",
    "f16_bits_to_f32",
    "f16_bits_to_f32_soft",
    "f32_to_bf16_bits",
    "fp16_round_up_bits",
    "quantize_per_token",
    "quantize_per_channel",
    "dequantize_per_token",
    "dequantize_per_channel",
    "fp8_quantize",
    "fp8_dequantize",
    "gather_bf16",
    "scatter_bf16",
    "all_finite_bf16",
    "all_finite_f32",
    "to_float32",
    "store_output",
    "hadamard_rows",
    "delta_rows",
    "affine_fit",
    "affine_rows",
    "pack_bits",
    "unpack_bits",
    "encode_segments",
    "decode_segments",
    "crc32_update",
    "crc32_combine",
    "warm_up",
]

# numba's internal SSA check warns on the inlined bf16 helpers (a pedantic notice about its own
# IR, not a problem in the kernels): keep it out of users' logs
warnings.filterwarnings("ignore", category=NumbaIRAssumptionWarning)

_JIT = dict(nogil=True, cache=True, fastmath=False, error_model="numpy")
_IL = dict(_JIT, inline="always")
_u = uintp
_U1 = np.uint64(1)  # uintp on the 64-bit platforms numba supports
_U2, _U3, _U4, _U5, _U6, _U7, _U8 = (np.uint64(i) for i in range(2, 9))
_FP16_MAX = np.float32(65504.0)
_F32_TINY = np.float32(np.finfo(np.float32).tiny)
_ZERO = np.float32(0.0)
_ONE = np.float32(1.0)
_TWO = np.float32(2.0)
_HALF = np.float32(0.5)
_mn = np.minimum  # elementwise min/max across arrays: faster than the builtin (which wins in
# scalar reduction chains, see _minmax)
_mx = np.maximum


# ----------------------------------------------------------------------------- bit casts


@intrinsic
def _u32_as_f32(typingctx, u):
    """Reinterpret the low 32 bits of an integer as a float32."""
    if not isinstance(u, types.Integer):
        return None
    sig = types.float32(u)

    def codegen(context, builder, signature, args):
        v = context.cast(builder, args[0], signature.args[0], types.uint32)
        return builder.bitcast(v, ir.FloatType())

    return sig, codegen


@intrinsic
def _f32_as_u32(typingctx, f):
    """The IEEE bit pattern of a float32, as uint32."""
    if f != types.float32:
        return None
    sig = types.uint32(f)

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.IntType(32))

    return sig, codegen


# ----------------------------------------------------------------------------- conversions
#
# Scalar helpers are inlined at numba-IR level (``inline="always"``): a call per group would
# cost more than the group's arithmetic. Inner loops index with ``uintp``: numba's negative-index
# wrap-around check on a signed computed index blocks vectorization (measured 5x slower).


@intrinsic
def _f2h_hw(typingctx, f):
    """float32 -> float16 bits by LLVM's ``fptrunc`` (F16C ``vcvtps2ph``: round to nearest even)."""
    if f != types.float32:
        return None
    sig = types.uint16(f)

    def codegen(context, builder, signature, args):
        return builder.bitcast(builder.fptrunc(args[0], ir.HalfType()), ir.IntType(16))

    return sig, codegen


@intrinsic
def _h2f_hw(typingctx, h):
    """float16 bits -> float32 by LLVM's ``fpext`` (exact)."""
    if not isinstance(h, types.Integer):
        return None
    sig = types.float32(h)

    def codegen(context, builder, signature, args):
        v = context.cast(builder, args[0], signature.args[0], types.uint16)
        return builder.fpext(builder.bitcast(v, ir.HalfType()), ir.FloatType())

    return sig, codegen


def _hardware_f16() -> bool:
    """Whether float16 conversions compile to instructions (x86 with F16C, or not x86: ARMv8 and
    others convert natively). Elsewhere LLVM would call a runtime helper, so the integer code
    below is used. tests/test_kernels.py compares both with torch's conversions: float16 -> float32
    on all 65,536 bit patterns, float32 -> float16 on every float16 value, every rounding midpoint
    and its two float32 neighbours, overflow bounds and random bit patterns."""
    import platform

    import llvmlite.binding as llvm

    if platform.machine().lower() not in ("x86_64", "amd64", "i386", "i686"):
        return True
    return bool(llvm.get_host_cpu_features().get("f16c", False))


_HW_F16 = _hardware_f16()


@njit(**_IL)
def f32_to_f16_bits(f):
    """float32 -> float16 bits, round to nearest even (``torch.Tensor.to(torch.float16)``).

    Overflow (>= 65520 in magnitude) gives +-inf; NaN gives a quiet NaN. With F16C: one
    instruction. Otherwise integer code without branches on the value (every case computed,
    one selected) so that loops over it vectorize; subnormal results use the float adder:
    ``|f| + 0.5`` rounds ``|f|`` to a multiple of ``2**-24`` (nearest even), and its low bits
    count those multiples.
    """
    if _HW_F16:
        return np.int64(_f2h_hw(np.float32(f)))
    return f32_to_f16_bits_soft(f)


@njit(**_IL)
def f32_to_f16_bits_soft(f):
    """:func:`f32_to_f16_bits` in integer code (the path without F16C), for any CPU."""
    x = np.int64(_f32_as_u32(np.float32(f)))
    sign = (x >> 16) & 0x8000
    a = x & 0x7FFFFFFF
    nrm = (a + (((15 - 127) << 23) + 0xFFF) + ((a >> 13) & 1)) >> 13
    sub = np.int64(_f32_as_u32(_u32_as_f32(a) + _HALF)) - 0x3F000000
    r = nrm if a >= 0x38800000 else sub
    r = np.int64(0x7C00) if a >= 0x477FF000 else r
    r = (0x7E00 | ((a >> 13) & 0x3FF)) if a > 0x7F800000 else r
    return sign | r


@njit(**_IL)
def f16_bits_to_f32(h):
    """float16 bits -> float32 (exact; F16C ``vcvtph2ps`` or branch-free integer code)."""
    if _HW_F16:
        return _h2f_hw(np.uint16(np.int64(h) & 0xFFFF))
    return f16_bits_to_f32_soft(h)


@njit(**_IL)
def f16_bits_to_f32_soft(h):
    """:func:`f16_bits_to_f32` in branch-free integer code (the path without F16C), for any CPU."""
    h = np.int64(h) & 0xFFFF
    sign = (h & 0x8000) << 16
    e = (h >> 10) & 0x1F
    m = h & 0x3FF
    nrm = sign | ((e + 112) << 23) | (m << 13)
    inf = sign | 0x7F800000 | (m << 13)
    sub = np.int64(_f32_as_u32(np.float32(m) * np.float32(5.9604644775390625e-08))) | sign  # m * 2**-24
    r = sub if e == 0 else nrm
    r = inf if e == 0x1F else r
    return _u32_as_f32(r)


@njit(**_IL)
def f32_to_bf16_bits(f):
    """float32 -> bfloat16 bits, round to nearest even (torch's scalar conversion; NaN -> 0x7FC0)."""
    u = np.int64(_f32_as_u32(np.float32(f)))
    r = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) & 0xFFFF
    return np.int64(0x7FC0) if (u & 0x7FFFFFFF) > 0x7F800000 else r


@njit(**_IL)
def _bf16_to_f32(b):
    return _u32_as_f32(np.uint32(b) << np.uint32(16))


@njit(**_IL)
def fp16_round_up_bits(x):
    """Smallest float16 ``>= x`` (saturating at +-65504), as bits, with ``-0`` made ``+0``.

    Reference: :func:`kvtune.codecs.quantizers.fp16_round_up` followed by the canonical
    zero of :func:`kvtune.codecs.quantizers.asymmetric_params`. Branch-free.
    """
    x = min(max(np.float32(x), -_FP16_MAX), _FP16_MAX)
    h = f32_to_f16_bits(x)
    up = np.int64(1) if (h & 0x7FFF) == 0 else (h - 1 if h & 0x8000 else h + 1)
    h = up if f16_bits_to_f32(h) < x else h
    return np.int64(0) if h == 0x8000 else h


@njit(**_IL)
def _scale_bits(s):
    """float32 -> float16 bits of ``where(clamp(s, 0, 65504) > 0, ., +0)`` (nearest even)."""
    s = min(np.float32(s), _FP16_MAX)
    return f32_to_f16_bits(s) if s > _ZERO else np.int64(0)


# ----------------------------------------------------------------------------- row access


def _load(xf, off, row, roff, n):  # pragma: no cover - replaced by the overload below
    raise NotImplementedError


@overload(_load, inline="always")
def _load_impl(xf, off, row, roff, n):
    """``row[roff:roff + n] = float32(xf[off:off + n])`` for float32 or bfloat16-bits (uint16) ``xf``."""
    if xf.dtype == types.uint16:

        def impl(xf, off, row, roff, n):
            for d in range(n):
                row[roff + d] = _u32_as_f32(np.uint32(xf[off + d]) << np.uint32(16))

        return impl
    if xf.dtype == types.float32:

        def impl(xf, off, row, roff, n):
            for d in range(n):
                row[roff + d] = xf[off + d]

        return impl
    return None


def _store(of, off, row, n, kind):  # pragma: no cover - replaced by the overload below
    raise NotImplementedError


@overload(_store, inline="always")
def _store_impl(of, off, row, n, kind):
    """``of[off:off + n] = row[:n]`` converted: float32 ``of`` as is; uint16 ``of`` as
    bfloat16 bits (``kind`` 1) or float16 bits (``kind`` 2), rounding to nearest even."""
    if of.dtype == types.float32:

        def impl(of, off, row, n, kind):
            for d in range(n):
                of[off + d] = row[d]

        return impl
    if of.dtype == types.uint16:

        def impl(of, off, row, n, kind):
            if kind == 1:
                for d in range(n):
                    of[off + d] = f32_to_bf16_bits(row[d])
            else:
                for d in range(n):
                    of[off + d] = f32_to_f16_bits(row[d])

        return impl
    return None


def _hreduce(builder, v, vop, sop):
    """Horizontal min or max of an 8-lane vector: three shuffle + op steps (a tree), then one
    scalar op on lanes 0 and 1."""
    i32 = ir.IntType(32)
    for width in (4, 2):
        mask = ir.Constant(ir.VectorType(i32, 8), [ir.Constant(i32, i + width if i < width else i) for i in range(8)])
        v = builder.call(vop, [v, builder.shuffle_vector(v, v, mask)])
    return builder.call(sop, [builder.extract_element(v, ir.Constant(i32, 0)), builder.extract_element(v, ir.Constant(i32, 1))])


@intrinsic
def _vminmax(typingctx, arr, start, stop):
    """``(min, max)`` of float32 ``arr[start:stop]`` (non-empty): 8-lane vector min/max over the
    whole 8-element chunks, then a scalar tail, all with ``llvm.minnum``/``llvm.maxnum``
    (numba's loop vectorizer does not vectorize these reductions). Exact: a min/max does not
    depend on the order (up to the sign of a zero, made canonical by the callers)."""
    if not (isinstance(arr, types.Array) and arr.dtype == types.float32 and arr.ndim == 1):
        return None
    sig = types.UniTuple(types.float32, 2)(arr, start, stop)

    def codegen(context, builder, signature, args):
        ary = context.make_array(signature.args[0])(context, builder, args[0])
        data = ary.data
        i64, f32 = ir.IntType(64), ir.FloatType()
        v8 = ir.VectorType(f32, 8)
        lo_i = context.cast(builder, args[1], signature.args[1], types.int64)
        hi_i = context.cast(builder, args[2], signature.args[2], types.int64)
        mod = builder.module

        def fn(name, ret, argtys):
            return cgutils.get_or_insert_function(mod, ir.FunctionType(ret, argtys), name)

        vmin, vmax = fn("llvm.minnum.v8f32", v8, [v8, v8]), fn("llvm.maxnum.v8f32", v8, [v8, v8])
        smin, smax = fn("llvm.minnum.f32", f32, [f32, f32]), fn("llvm.maxnum.f32", f32, [f32, f32])
        first = builder.load(builder.gep(data, [lo_i]))
        lo = cgutils.alloca_once_value(builder, first)
        hi = cgutils.alloca_once_value(builder, first)
        eight = ir.Constant(i64, 8)
        nvec = builder.udiv(builder.sub(hi_i, lo_i), eight)
        vend = builder.add(lo_i, builder.mul(nvec, eight))
        with builder.if_then(builder.icmp_unsigned(">", nvec, ir.Constant(i64, 0))):
            v0 = builder.load(builder.bitcast(builder.gep(data, [lo_i]), v8.as_pointer()), align=4)
            vlo = cgutils.alloca_once_value(builder, v0)
            vhi = cgutils.alloca_once_value(builder, v0)
            with cgutils.for_range_slice(builder, builder.add(lo_i, eight), vend, eight, inc=True) as (idx, _):
                v = builder.load(builder.bitcast(builder.gep(data, [idx]), v8.as_pointer()), align=4)
                builder.store(builder.call(vmin, [builder.load(vlo), v]), vlo)
                builder.store(builder.call(vmax, [builder.load(vhi), v]), vhi)
            builder.store(_hreduce(builder, builder.load(vlo), vmin, smin), lo)
            builder.store(_hreduce(builder, builder.load(vhi), vmax, smax), hi)
        with cgutils.for_range_slice(builder, vend, hi_i, ir.Constant(i64, 1), inc=True) as (idx, _):
            v = builder.load(builder.gep(data, [idx]))
            builder.store(builder.call(smin, [builder.load(lo), v]), lo)
            builder.store(builder.call(smax, [builder.load(hi), v]), hi)
        return context.make_tuple(builder, signature.return_type, [builder.load(lo), builder.load(hi)])

    return sig, codegen


@njit(**_IL)
def _minmax(row, d0, d1):
    """Min and max of ``row[d0:d1]`` (non-empty) with 8 independent chains (the order of a
    min/max reduction does not change its value)."""
    lo = row[d0]
    hi = row[d0]
    if d1 - d0 >= _U8:
        l0, l1, l2, l3 = row[d0], row[d0 + _U1], row[d0 + _U2], row[d0 + _U3]
        l4, l5, l6, l7 = row[d0 + _U4], row[d0 + _U5], row[d0 + _U6], row[d0 + _U7]
        h0, h1, h2, h3, h4, h5, h6, h7 = l0, l1, l2, l3, l4, l5, l6, l7
        k = d0 + _U8
        while k + _U8 <= d1:
            v0, v1, v2, v3 = row[k], row[k + _U1], row[k + _U2], row[k + _U3]
            v4, v5, v6, v7 = row[k + _U4], row[k + _U5], row[k + _U6], row[k + _U7]
            l0, l1, l2, l3 = min(l0, v0), min(l1, v1), min(l2, v2), min(l3, v3)
            l4, l5, l6, l7 = min(l4, v4), min(l5, v5), min(l6, v6), min(l7, v7)
            h0, h1, h2, h3 = max(h0, v0), max(h1, v1), max(h2, v2), max(h3, v3)
            h4, h5, h6, h7 = max(h4, v4), max(h5, v5), max(h6, v6), max(h7, v7)
            k += _U8
        lo = min(min(min(l0, l1), min(l2, l3)), min(min(l4, l5), min(l6, l7)))
        hi = max(max(max(h0, h1), max(h2, h3)), max(max(h4, h5), max(h6, h7)))
        d0 = k
    for d in range(d0, d1):
        v = row[d]
        lo = min(lo, v)
        hi = max(hi, v)
    return lo, hi


@njit(**_IL)
def _absmax(row, d0, d1):
    m = _ZERO
    for d in range(d0, d1):
        m = max(m, abs(row[d]))
    return m


@njit(**_IL)
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
            s16[i] = _scale_bits((_TWO * hi[i]) / fq)
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
        invs[i] = _ONE / max(s, _F32_TINY) if s > _ZERO else _ZERO


@njit(**_IL)
def _sz(scale16, zero16, bits, symmetric):
    """float32 ``(scale, zero)`` of a group from its float16 metadata."""
    s = f16_bits_to_f32(scale16)
    if symmetric:
        return s, s * np.float32(-((1 << bits) - 1) / 2.0)
    return s, f16_bits_to_f32(zero16)


@njit(**_IL)
def _quant(v, z, inv, fq):
    """``clamp(rint((v - z) * inv), 0, fq)`` as an integer (reference: ``quantize_affine``)."""
    u = np.rint((v - z) * inv)
    u = min(max(u, _ZERO), fq)
    return np.uint8(u)


_ROWS = 32  # rows per block of the per-token kernel


# ----------------------------------------------------------------------------- uniform quantizer


@njit(**_JIT)
def quantize_per_token(x, heads, tokens, g, bits, symmetric, sym, scale, zero):
    """Uniform quantization of ``x[:, heads][:, :, tokens]`` in groups of ``g`` channels.

    Reference: :meth:`kvtune.codecs.quantizers.UniformQuantizer.quantize_block` with
    ``granularity = "per_token"``. Works on blocks of 32 rows: load, min/max of every group,
    the groups' parameters (vectorized), then the symbols.

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
    b = hi_ = ti = 0  # (batch, head, token) of the next row to load
    for r0 in range(0, nrows, _ROWS):
        nr = min(_ROWS, nrows - r0)
        for r in range(nr):
            _load(xf, _u(((b * nh + heads[hi_]) * nt + tokens[ti]) * d_n), blk, _u(r * d_n), dn)
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
                    hi[i] = _absmax(blk, d0, d1)
                else:
                    lo[i], hi[i] = _vminmax(blk, d0, d1)
        _params(lo, hi, nr * ng, bits, symmetric, s16, z16, zs, invs)
        mo = _u(r0 * ng)
        for i in range(_u(nr * ng)):
            scf[mo + i] = s16[i]
        if not symmetric:
            for i in range(_u(nr * ng)):
                zf[mo + i] = z16[i]
        base = _u(r0 * d_n)
        for r in range(nr):
            o = _u(r * d_n)
            for gi in range(ng):
                i = r * ng + gi
                z, inv = zs[i], invs[i]
                d0 = o + _u(gi * g)
                d1 = o + _u(min(gi * g + g, d_n))
                d8 = d0 + (d1 - d0) // _U8 * _U8
                for d in range(d0, d8, _U8):
                    _vquant8(blk, d, z, inv, fq, sf, base + d)
                for d in range(d8, d1):
                    sf[base + d] = _quant(blk[d], z, inv, fq)


@njit(**_JIT)
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
                    _load(xf, _u((hrow + tokens[t0 + j]) * d_n), blk, _u(j * d_n), dn)
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
                d8 = dn // _U8 * _U8
                for j in range(n):
                    o = _u(j * d_n)
                    for d in range(_u(0), d8, _U8):
                        _vquant8v(blk, o + d, zs, invs, d, fq, sf, base + o + d)
                    for d in range(d8, dn):
                        sf[base + o + d] = _quant(blk[o + d], zs[d], invs[d], fq)


@njit(**_JIT)
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
                _store(of, _u(((b * nh + heads[hi]) * nt + tokens[ti]) * d_n), row, dn, kind)
                r += 1


@njit(**_JIT)
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
                    _store(of, _u(((b * nh + heads[hi]) * nt + tokens[ti]) * d_n), row, dn, kind)


# ----------------------------------------------------------------------------- float8


@njit(**_IL)
def _fp8_e4m3_bits(f):
    """float32 (already clamped to +-448) -> float8_e4m3fn bits (c10's fp8e4m3fn_from_fp32_value),
    written without branches on the value so that it vectorizes."""
    fb0 = np.int64(_f32_as_u32(np.float32(f)))
    sign = fb0 & 0x80000000
    fb = fb0 ^ sign
    denorm = np.int64(141) << 23
    sub = (np.int64(_f32_as_u32(_u32_as_f32(fb) + _u32_as_f32(denorm))) - denorm) & 0xFF
    nrm = ((fb + ((7 - 127) << 23) + 0x7FFFF + ((fb >> 20) & 1)) >> 20) & 0xFF
    res = sub if fb < (121 << 23) else nrm
    res = np.int64(0x7F) if fb >= (1087 << 20) else res
    return res | (sign >> 24)


@njit(**_IL)
def _fp8_e5m2_bits(f):
    """float32 (already clamped to +-57344) -> float8_e5m2 bits (c10's fp8e5m2_from_fp32_value)."""
    fb0 = np.int64(_f32_as_u32(np.float32(f)))
    sign = fb0 & 0x80000000
    fb = fb0 ^ sign
    denorm = np.int64(134) << 23
    sub = (np.int64(_f32_as_u32(_u32_as_f32(fb) + _u32_as_f32(denorm))) - denorm) & 0xFF
    nrm = ((fb + ((15 - 127) << 23) + 0xFFFFF + ((fb >> 21) & 1)) >> 21) & 0xFF
    res = sub if fb < (113 << 23) else nrm
    special = np.int64(0x7F) if fb > (255 << 23) else np.int64(0x7C)
    res = special if fb >= (143 << 23) else res
    return res | (sign >> 24)


@njit(**_IL)
def _fp8_bits(v, e5m2, m):
    if v > m:
        v = m
    if v < -m:
        v = -m
    return _fp8_e5m2_bits(v) if e5m2 else _fp8_e4m3_bits(v)


@njit(**_JIT)
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
                _load(xf, _u(((b * nh + heads[hi]) * nt + tokens[ti]) * d_n), row, _u(0), dn)
                dst = _u(r * d_n)
                if scaled:
                    s16 = fp16_round_up_bits(_absmax(row, _u(0), dn) / m)
                    scf[_u(r)] = s16
                    s = f16_bits_to_f32(s16)
                    for d in range(dn):
                        v = row[d] / s if s > _ZERO else _ZERO
                        sf[dst + d] = _fp8_bits(v, e5m2, m)
                elif e5m2:
                    for d in range(dn):
                        sf[dst + d] = _fp8_bits(row[d], True, m)
                else:
                    for d in range(dn):
                        sf[dst + d] = _fp8_bits(row[d], False, m)
                r += 1


@njit(**_JIT)
def fp8_dequantize(sym, scale, lut, scaled, heads, tokens, out, kind):
    """``out[:, heads][:, :, tokens] = lut[sym] (* scale per token)``, converted as
    :func:`dequantize_per_token`.

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
                _store(of, _u(((b * nh + heads[hi]) * nt + tokens[ti]) * d_n), row, dn, kind)
                r += 1


# ----------------------------------------------------------------------------- bfloat16 segments


@njit(**_JIT)
def gather_bf16(x, heads, tokens, out):
    """bfloat16 bits of ``x[:, heads][:, :, tokens]`` (``out`` uint16 ``(B, Hs, Ts, D)``).

    Reference: :meth:`kvtune.codecs.quantizers.NoQuantizer.quantize_block`.
    """
    nb, nh, nt, d_n = x.shape
    xf, of = x.reshape(-1), out.reshape(-1)
    dn = _u(d_n)
    row = np.empty(d_n, np.float32)
    r = 0
    for b in range(nb):
        for hi in range(heads.shape[0]):
            for ti in range(tokens.shape[0]):
                _load(xf, _u(((b * nh + heads[hi]) * nt + tokens[ti]) * d_n), row, _u(0), dn)
                _store(of, _u(r * d_n), row, dn, 1)
                r += 1


@njit(**_JIT)
def scatter_bf16(sym, heads, tokens, out, kind):
    """``out[:, heads][:, :, tokens] = bfloat16 bits sym``, converted as :func:`dequantize_per_token`."""
    nb, hs, ts, d_n = sym.shape
    nh, nt = out.shape[1], out.shape[2]
    sf, of = sym.reshape(-1), out.reshape(-1)
    dn = _u(d_n)
    row = np.empty(d_n, np.float32)
    r = 0
    for b in range(nb):
        for hi in range(hs):
            for ti in range(ts):
                _load(sf, _u(r * d_n), row, _u(0), dn)
                _store(of, _u(((b * nh + heads[hi]) * nt + tokens[ti]) * d_n), row, dn, kind)
                r += 1


@njit(**_JIT)
def _no_all_ones(flat, mask):
    """Whether no element of the 1-D unsigned integer array ``flat`` has every bit of ``mask``
    set: the max of ``flat & mask`` stays below ``mask`` -- an integer reduction the compiler
    vectorizes (one read of the data at memory speed)."""
    m = mask ^ mask
    for i in range(flat.size):
        e = flat[i] & mask
        m = e if e > m else m
    return m != mask


def all_finite_bf16(bits: np.ndarray) -> bool:
    """Whether no element of a bfloat16 array (its uint16 bits, any shape, C-contiguous) is NaN
    or +-inf: a bfloat16 is non-finite exactly when its 8 exponent bits are all ones.
    Reference: ``torch.isfinite(x).all()``."""
    return bool(_no_all_ones(bits.reshape(-1), np.uint16(0x7F80)))


def all_finite_f32(x: np.ndarray) -> bool:
    """Whether no element of a float32 array (any shape, C-contiguous) is NaN or +-inf
    (exponent bits of its uint32 view all ones, as :func:`all_finite_bf16`)."""
    return bool(_no_all_ones(x.reshape(-1).view(np.uint32), np.uint32(0x7F800000)))


@njit(**_JIT)
def to_float32(x, out):
    """``out = float32(x)`` for a C-contiguous float32 or bfloat16-bits array (any shape).
    Reference: ``torch.Tensor.to(torch.float32)`` (exact)."""
    xf, of = x.reshape(-1), out.reshape(-1)
    _load(xf, _u(0), of, _u(0), _u(xf.shape[0]))


@njit(**_JIT)
def store_output(y, kind, out):
    """Convert float32 ``y`` (any shape, C order) into ``out`` (bits of ``kind``: 1 bfloat16,
    2 float16), rounding to nearest even as ``torch.Tensor.to``."""
    a, o = y.reshape(-1), out.reshape(-1)
    _store(o, _u(0), a, _u(a.shape[0]), kind)


# ----------------------------------------------------------------------------- transforms


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
        ptr = _v8_ptr(context, builder, types.void(signature.args[0], signature.args[1]), [args[0], args[1]])
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
        ptr = _v8_ptr(context, builder, types.void(sa[0], sa[1]), [args[0], args[1]])
        zp = _v8_ptr(context, builder, types.void(sa[2], sa[4]), [args[2], args[4]])
        ip = _v8_ptr(context, builder, types.void(sa[3], sa[4]), [args[3], args[4]])
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


def _v8_ptr(context, builder, signature, args):
    """Pointer to ``arr[i]`` (float32 array ``args[0]``, index ``args[1]``) as ``<8 x float>*``."""
    ary = context.make_array(signature.args[0])(context, builder, args[0])
    i = context.cast(builder, args[1], signature.args[1], types.int64)
    return builder.bitcast(builder.gep(ary.data, [i]), ir.VectorType(ir.FloatType(), 8).as_pointer())


@intrinsic
def _wht8(typingctx, arr, off):
    """In place: the first three butterfly stages (strides 1, 2, 4) on ``arr[off:off + 8]``.

    Each stage pairs lane ``i`` with lane ``i ^ stride``: one shuffle, an add for the low lane
    of every pair (``a + b``), a subtract for the high lane (``a - b``, computed as
    ``swapped - v``), a select. The same IEEE operations as the reference butterfly."""
    if not (isinstance(arr, types.Array) and arr.dtype == types.float32 and arr.ndim == 1):
        return None
    sig = types.void(arr, off)

    def codegen(context, builder, signature, args):
        ptr = _v8_ptr(context, builder, signature, args)
        i32 = ir.IntType(32)
        v = builder.load(ptr, align=4)
        for stride in (1, 2, 4):
            perm = ir.Constant(ir.VectorType(i32, 8), [ir.Constant(i32, i ^ stride) for i in range(8)])
            sw = builder.shuffle_vector(v, v, perm)
            low = ir.Constant(ir.VectorType(ir.IntType(1), 8), [ir.Constant(ir.IntType(1), not (i & stride)) for i in range(8)])
            v = builder.select(low, builder.fadd(v, sw), builder.fsub(sw, v))
        builder.store(v, ptr, align=4)
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def _wht_pair8(typingctx, arr, p, q):
    """In place, 8 lanes: ``(arr[p+i], arr[q+i]) <- (a + b, a - b)`` (a later butterfly stage)."""
    if not (isinstance(arr, types.Array) and arr.dtype == types.float32 and arr.ndim == 1):
        return None
    sig = types.void(arr, p, q)

    def codegen(context, builder, signature, args):
        pa = _v8_ptr(context, builder, signature, args)
        pb = _v8_ptr(context, builder, types.void(signature.args[0], signature.args[2]), [args[0], args[2]])
        a = builder.load(pa, align=4)
        b = builder.load(pb, align=4)
        builder.store(builder.fadd(a, b), pa, align=4)
        builder.store(builder.fsub(a, b), pb, align=4)
        return context.get_dummy_value()

    return sig, codegen


def _make_wht(n: int):
    """An intrinsic ``_wht(arr, off, signs, soff, c, inverse)``: the whole randomized Hadamard
    block of size ``n`` (8..256) on ``arr[off:off + n]`` held in ``n / 8`` vector registers --
    forward ``x * signs``, butterflies, ``* c``; inverse butterflies, ``* c``, ``* signs`` --
    the exact operation sequence of the reference, with no loop control."""
    nv = n // 8

    @intrinsic
    def _wht(typingctx, arr, off, signs, soff, c, inverse):
        if not (isinstance(arr, types.Array) and arr.dtype == types.float32):
            return None
        sig = types.void(arr, off, signs, soff, c, inverse)

        def codegen(context, builder, signature, args):
            sa = signature.args
            i32, i64 = ir.IntType(32), ir.IntType(64)
            v8 = ir.VectorType(ir.FloatType(), 8)
            base = _v8_ptr(context, builder, types.void(sa[0], sa[1]), [args[0], args[1]])
            sbase = _v8_ptr(context, builder, types.void(sa[2], sa[3]), [args[2], args[3]])
            ptrs = [builder.gep(base, [ir.Constant(i64, k)]) for k in range(nv)]
            sptrs = [builder.gep(sbase, [ir.Constant(i64, k)]) for k in range(nv)]
            cf = context.cast(builder, args[4], sa[4], types.float32)
            cv = builder.shuffle_vector(builder.insert_element(ir.Constant(v8, ir.Undefined), cf, ir.Constant(i32, 0)),
                                        ir.Constant(v8, ir.Undefined), ir.Constant(ir.VectorType(i32, 8), [0] * 8))
            inv = context.cast(builder, args[5], sa[5], types.boolean)
            vs = [builder.load(p, align=4) for p in ptrs]
            signed = [builder.fmul(v, builder.load(sp, align=4)) for v, sp in zip(vs, sptrs)]
            vs = [builder.select(inv, v, sv) for v, sv in zip(vs, signed)]
            for stride in (1, 2, 4):  # inside each vector
                perm = ir.Constant(ir.VectorType(i32, 8), [ir.Constant(i32, i ^ stride) for i in range(8)])
                low = ir.Constant(ir.VectorType(ir.IntType(1), 8), [ir.Constant(ir.IntType(1), not (i & stride)) for i in range(8)])
                out = []
                for v in vs:
                    sw = builder.shuffle_vector(v, v, perm)
                    out.append(builder.select(low, builder.fadd(v, sw), builder.fsub(sw, v)))
                vs = out
            step = 1
            while step < nv:  # across vectors (strides 8, 16, ...)
                out = list(vs)
                for i in range(nv):
                    if not i & step:
                        a, b = vs[i], vs[i + step]
                        out[i], out[i + step] = builder.fadd(a, b), builder.fsub(a, b)
                vs = out
                step *= 2
            vs = [builder.fmul(v, cv) for v in vs]
            unsigned = vs
            signed = [builder.fmul(v, builder.load(sp, align=4)) for v, sp in zip(vs, sptrs)]
            vs = [builder.select(inv, sv, v) for v, sv in zip(unsigned, signed)]
            for v, p in zip(vs, ptrs):
                builder.store(v, p, align=4)
            return context.get_dummy_value()

        return sig, codegen

    return _wht


_wht8v, _wht16v, _wht32v, _wht64v, _wht128v, _wht256v = (_make_wht(n) for n in (8, 16, 32, 64, 128, 256))


@njit(**_IL)
def _wht_block(xf, off, n, sg, so, c, inverse):
    """Dispatch one power-of-two block of size ``n`` in 8..256 to its unrolled intrinsic."""
    if n == 64:
        _wht64v(xf, off, sg, so, c, inverse)
    elif n == 128:
        _wht128v(xf, off, sg, so, c, inverse)
    elif n == 256:
        _wht256v(xf, off, sg, so, c, inverse)
    elif n == 32:
        _wht32v(xf, off, sg, so, c, inverse)
    elif n == 16:
        _wht16v(xf, off, sg, so, c, inverse)
    else:
        _wht8v(xf, off, sg, so, c, inverse)


@njit(**_JIT)
def hadamard_rows(x, signs, blocks, scales, inverse):
    """In-place randomized block Walsh-Hadamard rotation along the last axis of float32 ``x``.

    Forward: ``x * signs[h]``, then a butterfly (``a + b``, ``a - b``; strides 1, 2, 4, ...)
    in every power-of-two block, then ``* scales[block]``. Inverse: butterfly, scale, signs.
    Reference: :func:`kvtune.codecs.transforms.rotate` / :func:`~kvtune.codecs.transforms.unrotate`.

    Args:
        x: float32 ``(B, H, T, D)``, modified in place.
        signs: float32 ``(H, D)`` of +-1.
        blocks: int64 block sizes (powers of two summing to ``D``, decreasing).
        scales: float32 ``1/sqrt(block)`` per block.
        inverse: apply the inverse rotation.
    """
    nb, nh, nt, d_n = x.shape
    xf, sg = x.reshape(-1), signs.reshape(-1)
    dn = _u(d_n)
    unrolled = True
    for k in range(blocks.shape[0]):
        unrolled = unrolled and 8 <= blocks[k] <= 256
    if unrolled:  # every block in registers (head_dim 64, 96 = 64 + 32, 128, 256, ...)
        for b in range(nb):
            for h in range(nh):
                for t in range(nt):
                    o = _u(((b * nh + h) * nt + t) * d_n)
                    off = _u(0)
                    for k in range(blocks.shape[0]):
                        _wht_block(xf, o + off, blocks[k], sg, _u(h * d_n) + off, scales[k], inverse)
                        off += _u(blocks[k])
        return
    for b in range(nb):
        for h in range(nh):
            so = _u(h * d_n)
            for t in range(nt):
                o = _u(((b * nh + h) * nt + t) * d_n)
                if not inverse:
                    for d in range(dn):
                        xf[o + d] = xf[o + d] * sg[so + d]
                off = o
                for k in range(blocks.shape[0]):
                    n = _u(blocks[k])
                    c = scales[k]
                    step = _U1
                    if n >= _U8:  # strides 1, 2, 4 inside every 8 lanes, as vectors
                        for i in range(off, off + n, _U8):
                            _wht8(xf, i)
                        step = _U8
                    while step < n:
                        i = off
                        while i < off + n:
                            if step >= _U8:
                                for j in range(i, i + step, _U8):
                                    _wht_pair8(xf, j, j + step)
                            else:
                                for j in range(i, i + step):
                                    a = xf[j]
                                    bb = xf[j + step]
                                    xf[j] = a + bb
                                    xf[j + step] = a - bb
                            i += step + step
                        step = step + step
                    for d in range(off, off + n):
                        xf[d] = xf[d] * c
                    off += n
                if inverse:
                    for d in range(dn):
                        xf[o + d] = xf[o + d] * sg[so + d]


@njit(**_JIT)
def delta_rows(x, g, inverse):
    """In-place delta coding along tokens in groups of ``g`` (anchors unchanged).

    Forward ``x[t] -= x[anchor(t)]``; inverse ``x[t] += x[anchor(t)]``.
    Reference: :func:`kvtune.codecs.transforms.delta_encode` / :func:`~kvtune.codecs.transforms.delta_decode`.
    """
    nb, nh, nt, d_n = x.shape
    xf = x.reshape(-1)
    dn = _u(d_n)
    for bh in range(nb * nh):
        for t in range(nt):
            a = (t // g) * g
            if a == t:
                continue
            o = _u((bh * nt + t) * d_n)
            ao = _u((bh * nt + a) * d_n)
            if inverse:
                for d in range(dn):
                    xf[o + d] = xf[o + d] + xf[ao + d]
            else:
                for d in range(dn):
                    xf[o + d] = xf[o + d] - xf[ao + d]


@njit(**_JIT)
def affine_fit(x, rms, shift, scale16, shift16):
    """Per-(head, channel) float16 ``scale`` (RMS or absmax) and ``shift`` (mean) of float32 ``x``.

    Sums run in float64 over (batch, token) in order. Reference:
    :func:`kvtune.codecs.transforms.channel_stats`. ``scale16``/``shift16`` are uint16 ``(H, D)``.
    """
    nb, nh, nt, d_n = x.shape
    xf = x.reshape(-1)
    n = nb * nt
    dn = _u(d_n)
    mean = np.zeros(d_n, np.float32)
    acc = np.zeros(d_n, np.float64)
    for h in range(nh):
        if shift:
            acc[:] = 0.0
            for b in range(nb):
                for t in range(nt):
                    o = _u(((b * nh + h) * nt + t) * d_n)
                    for d in range(dn):
                        acc[d] += np.float64(xf[o + d])
            for d in range(dn):
                m = np.float32(acc[d] / max(n, 1))
                if m > _FP16_MAX:
                    m = _FP16_MAX
                if m < -_FP16_MAX:
                    m = -_FP16_MAX
                shift16[h, d] = f32_to_f16_bits(m)
                mean[d] = f16_bits_to_f32(shift16[h, d])
        acc[:] = 0.0
        for b in range(nb):
            for t in range(nt):
                o = _u(((b * nh + h) * nt + t) * d_n)
                if rms:
                    for d in range(dn):
                        v = np.float64(xf[o + d] - mean[d])
                        acc[d] += v * v
                else:
                    for d in range(dn):
                        acc[d] = max(acc[d], np.float64(abs(xf[o + d] - mean[d])))
        for d in range(dn):
            st = np.float32(math.sqrt(acc[d] / max(n, 1))) if rms else np.float32(acc[d])
            if st > _FP16_MAX:
                st = _FP16_MAX
            s16 = f32_to_f16_bits(st)
            sv = f16_bits_to_f32(s16)
            if not (sv > _ZERO and sv < np.inf):
                s16 = np.int64(0x3C00)  # 1.0
            scale16[h, d] = s16


@njit(**_JIT)
def affine_rows(x, scale16, shift16, has_shift, inverse):
    """In place: forward ``(x - shift) / scale``; inverse ``x * scale + shift`` (two roundings).

    Reference: :meth:`kvtune.codecs.transforms.Affine.forward` / ``inverse``.
    """
    nb, nh, nt, d_n = x.shape
    xf = x.reshape(-1)
    dn = _u(d_n)
    sc = np.empty(d_n, np.float32)
    sh = np.zeros(d_n, np.float32)
    for h in range(nh):
        for d in range(dn):
            sc[d] = f16_bits_to_f32(scale16[h, d])
            if has_shift:
                sh[d] = f16_bits_to_f32(shift16[h, d])
        for b in range(nb):
            for t in range(nt):
                o = _u(((b * nh + h) * nt + t) * d_n)
                if inverse and has_shift:
                    for d in range(dn):
                        v = xf[o + d] * sc[d]
                        xf[o + d] = v + sh[d]
                elif inverse:
                    for d in range(dn):
                        xf[o + d] = xf[o + d] * sc[d]
                elif has_shift:
                    for d in range(dn):
                        xf[o + d] = (xf[o + d] - sh[d]) / sc[d]
                else:
                    for d in range(dn):
                        xf[o + d] = xf[o + d] / sc[d]


# ----------------------------------------------------------------------------- bit packing


@njit(**_JIT)
def pack_bits(sym, bits, out):
    """Pack flat uint8 ``sym`` (values ``< 2**bits``), MSB first, into ``out`` (``ceil(n*bits/8)`` bytes).

    Reference: :func:`kvtune.codecs.bitpack.pack_bits`. Returns the OR of all
    symbols (the caller rejects symbols that do not fit). Widths 1, 2 and 4 fill whole bytes;
    the others assemble every 8 symbols (``bits`` bytes) in a 64-bit word.
    """
    n = _u(sym.shape[0])
    seen = np.uint8(0)
    if bits == 8:
        for i in range(n):
            v = sym[i]
            out[i] = v
            seen |= v
        return np.int64(seen)
    if bits == 4:
        full = n // _U2
        for i in range(full):
            a, c = sym[_U2 * i], sym[_U2 * i + _U1]
            seen |= a | c
            out[i] = (a << np.uint8(4)) | c
    elif bits == 2:
        full = n // _U4
        for i in range(full):
            a, b, c, d = sym[_U4 * i], sym[_U4 * i + _U1], sym[_U4 * i + _U2], sym[_U4 * i + _U3]
            seen |= a | b | c | d
            out[i] = (a << np.uint8(6)) | (b << np.uint8(4)) | (c << np.uint8(2)) | d
    elif bits == 1:
        full = n // _U8
        for i in range(full):
            o = _U8 * i
            w = np.uint8(0)
            for j in range(_U8):
                v = sym[o + j]
                seen |= v
                w = (w << np.uint8(1)) | v
            out[i] = w
    else:
        b = np.uint64(bits)
        ub = _u(bits)
        full = n // _U8
        for c in range(full):
            o = c * _U8
            w = np.uint64(0)
            for j in range(_U8):
                v = sym[o + j]
                seen |= v
                w = (w << b) | np.uint64(v)
            for k in range(ub):
                out[c * ub + k] = np.uint8((w >> (_U8 * (b - _U1 - k))) & np.uint64(0xFF))
        rem = n - _U8 * full
        if rem:
            w = np.uint64(0)
            for j in range(_U8):
                v = sym[_U8 * full + j] if j < rem else np.uint8(0)
                seen |= v
                w = (w << b) | np.uint64(v)
            for k in range((rem * ub + _U7) // _U8):
                out[full * ub + k] = np.uint8((w >> (_U8 * (b - _U1 - k))) & np.uint64(0xFF))
        return np.int64(seen)
    per = _u(8 // bits)
    rem = n - full * per
    if rem:  # the last, partial byte (widths 1, 2, 4)
        w = np.uint8(0)
        for j in range(per):
            v = sym[full * per + j] if j < rem else np.uint8(0)
            seen |= v
            w = (w << np.uint8(bits)) | v
        out[full] = w
    return np.int64(seen)


@njit(**_JIT)
def unpack_bits(data, bits, out):
    """Inverse of :func:`pack_bits`: ``len(out)`` symbols from ``data`` (length already checked).

    Reference: :func:`kvtune.codecs.bitpack.unpack_bits`."""
    n = _u(out.shape[0])
    if bits == 8:
        for i in range(n):
            out[i] = data[i]
        return
    if bits == 4:
        full = n // _U2
        for i in range(full):
            v = data[i]
            out[_U2 * i] = v >> np.uint8(4)
            out[_U2 * i + _U1] = v & np.uint8(15)
    elif bits == 2:
        full = n // _U4
        for i in range(full):
            v = data[i]
            out[_U4 * i] = v >> np.uint8(6)
            out[_U4 * i + _U1] = (v >> np.uint8(4)) & np.uint8(3)
            out[_U4 * i + _U2] = (v >> np.uint8(2)) & np.uint8(3)
            out[_U4 * i + _U3] = v & np.uint8(3)
    elif bits == 1:
        full = n // _U8
        for i in range(full):
            v = data[i]
            for j in range(_U8):
                out[_U8 * i + j] = (v >> np.uint8(_U7 - j)) & np.uint8(1)
    else:
        b = np.uint64(bits)
        ub = _u(bits)
        mask = np.uint64((1 << bits) - 1)
        full = n // _U8
        for c in range(full):
            w = np.uint64(0)
            for k in range(ub):
                w = (w << _U8) | np.uint64(data[c * ub + k])
            for j in range(_U8):
                out[c * _U8 + j] = np.uint8((w >> (b * (_U7 - j))) & mask)
        rem = n - _U8 * full
        if rem:
            w = np.uint64(0)
            nbytes = _u(data.shape[0]) - full * ub
            for k in range(ub):
                byte = data[full * ub + k] if k < nbytes else np.uint8(0)
                w = (w << _U8) | np.uint64(byte)
            for j in range(rem):
                out[_U8 * full + j] = np.uint8((w >> (b * (_U7 - j))) & mask)
        return
    per = _u(8 // bits)
    rem = n - full * per
    if rem:
        v = data[full]
        mask8 = np.uint8((1 << bits) - 1)
        for j in range(rem):
            out[full * per + j] = (v >> np.uint8(bits * (per - _U1 - j))) & mask8


# ----------------------------------------------------------------------------- whole tensors
#
# One call per K or V tensor runs every segment of its plan, so that a codec thread holds the
# GIL only to enter and leave it. A segment is one row of an int64 table:

SEG_KIND, SEG_BITS, SEG_A, SEG_G, SEG_B = 0, 1, 2, 3, 4
SEG_HEADS, SEG_NHEADS, SEG_TOKENS, SEG_NTOKENS = 5, 6, 7, 8
SEG_META, SEG_META_LEN, SEG_PAYLOAD, SEG_PAYLOAD_LEN, SEG_SYM = 9, 10, 11, 12, 13
SEG_COLUMNS = 14
"""Columns: kind (:data:`KIND_UNIFORM` / :data:`KIND_BF16` / :data:`KIND_FP8`), bits, A
(uniform: per-token; fp8: e5m2), g (uniform group length), B (uniform: symmetric; fp8: scaled),
offset and count of the head indices and of the token indices in the index array, byte offset
and length of the metadata and of the payload section in the tensor's output buffer, byte
offset of the raw symbols in the symbol buffer (codecs other than bitpack)."""
KIND_UNIFORM, KIND_BF16, KIND_FP8 = 0, 1, 2


@njit(**_IL)
def _put_u16(vals, n, out, off):
    """Little-endian bytes of ``vals[:n]`` (uint16) into ``out[off:off + 2n]``."""
    for i in range(_u(n)):
        v = vals[i]
        out[off + _U2 * i] = np.uint8(v & 0xFF)
        out[off + _U2 * i + _U1] = np.uint8(v >> 8)


@njit(**_IL)
def _get_u16(data, off, n, vals):
    """``vals[:n]`` = little-endian uint16 from ``data[off:off + 2n]``."""
    for i in range(_u(n)):
        vals[i] = np.uint16(data[off + _U2 * i]) | (np.uint16(data[off + _U2 * i + _U1]) << np.uint16(8))


@njit(**_IL)
def _meta_scratch(segs, nb, d_n):
    """Elements of the uint16 metadata scratch: the largest segment's metadata (an unscaled
    fp8 segment still needs a dummy ``(B, Hs, Ts)`` view)."""
    n = 1
    for s in range(segs.shape[0]):
        n = max(n, segs[s, SEG_META_LEN] // 2)
        if segs[s, SEG_KIND] == KIND_FP8:
            n = max(n, nb * segs[s, SEG_NHEADS] * segs[s, SEG_NTOKENS])
    return n


def _put_bf16(x, heads, tokens, out, off):  # pragma: no cover - replaced by the overload below
    raise NotImplementedError


@overload(_put_bf16, inline="always")
def _put_bf16_impl(x, heads, tokens, out, off):
    """Little-endian bfloat16 bits of ``x[:, heads][:, :, tokens]`` into ``out[off:]`` (bytes):
    a copy for bfloat16-bits input, round to nearest even for float32."""

    def impl(x, heads, tokens, out, off):
        nb, nh, nt, d_n = x.shape
        xf = x.reshape(-1)
        dn = _u(d_n)
        o = _u(off)
        for b in range(nb):
            for hi in range(heads.shape[0]):
                for ti in range(tokens.shape[0]):
                    src = _u(((b * nh + heads[hi]) * nt + tokens[ti]) * d_n)
                    for d in range(dn):
                        v = _bf16_bits_of(xf[src + d])
                        out[o + _U2 * d] = np.uint8(v & 0xFF)
                        out[o + _U2 * d + _U1] = np.uint8(v >> 8)
                    o += _U2 * dn

    return impl


def _bf16_bits_of(v):  # pragma: no cover - replaced by the overload below
    raise NotImplementedError


@overload(_bf16_bits_of, inline="always")
def _bf16_bits_of_impl(v):
    if v == types.uint16:
        return lambda v: np.int64(v)
    if v == types.float32:
        return lambda v: f32_to_bf16_bits(v)
    return None


def _get_bf16(data, off, heads, tokens, out, kind):  # pragma: no cover - replaced by the overload below
    raise NotImplementedError


@overload(_get_bf16, inline="always")
def _get_bf16_impl(data, off, heads, tokens, out, kind):
    """Little-endian bfloat16 bits from ``data[off:]`` into ``out[:, heads][:, :, tokens]``: a
    copy into bfloat16 output (uint16 ``out``, ``kind`` 1), else converted as :func:`_store`."""
    if out.dtype == types.uint16:

        def impl(data, off, heads, tokens, out, kind):
            nb, nh, nt, d_n = out.shape
            of = out.reshape(-1)
            dn = _u(d_n)
            o = _u(off)
            row = np.empty(d_n, np.float32)
            for b in range(nb):
                for hi in range(heads.shape[0]):
                    for ti in range(tokens.shape[0]):
                        dst = _u(((b * nh + heads[hi]) * nt + tokens[ti]) * d_n)
                        if kind == 1:
                            for d in range(dn):
                                of[dst + d] = np.uint16(data[o + _U2 * d]) | (np.uint16(data[o + _U2 * d + _U1]) << np.uint16(8))
                        else:
                            for d in range(dn):
                                row[d] = _bf16_to_f32(np.uint16(data[o + _U2 * d]) | (np.uint16(data[o + _U2 * d + _U1]) << np.uint16(8)))
                            _store(of, dst, row, dn, kind)
                        o += _U2 * dn

        return impl
    if out.dtype == types.float32:

        def impl(data, off, heads, tokens, out, kind):
            nb, nh, nt, d_n = out.shape
            of = out.reshape(-1)
            dn = _u(d_n)
            o = _u(off)
            for b in range(nb):
                for hi in range(heads.shape[0]):
                    for ti in range(tokens.shape[0]):
                        dst = _u(((b * nh + heads[hi]) * nt + tokens[ti]) * d_n)
                        for d in range(dn):
                            of[dst + d] = _bf16_to_f32(np.uint16(data[o + _U2 * d]) | (np.uint16(data[o + _U2 * d + _U1]) << np.uint16(8)))
                        o += _U2 * dn

        return impl
    return None


def _fp8_encode(x, heads, tokens, e5m2, scaled, sym, sc, lut8):  # pragma: no cover - overloaded
    raise NotImplementedError


@overload(_fp8_encode, inline="always")
def _fp8_encode_impl(x, heads, tokens, e5m2, scaled, sym, sc, lut8):
    """float8 symbols of a segment. Unscaled bfloat16 input: a lookup in ``lut8`` (the symbol of
    every bfloat16 pattern, made by torch's own cast, so exact); otherwise :func:`fp8_quantize`."""
    if x.dtype == types.uint16:

        def impl(x, heads, tokens, e5m2, scaled, sym, sc, lut8):
            if scaled:
                fp8_quantize(x, heads, tokens, e5m2, 57344.0 if e5m2 else 448.0, scaled, sym, sc)
                return
            lut = lut8[1 if e5m2 else 0]
            nb, nh, nt, d_n = x.shape
            xf, sf = x.reshape(-1), sym.reshape(-1)
            dn = _u(d_n)
            o = _u(0)
            for b in range(nb):
                for hi in range(heads.shape[0]):
                    for ti in range(tokens.shape[0]):
                        src = _u(((b * nh + heads[hi]) * nt + tokens[ti]) * d_n)
                        for d in range(dn):
                            sf[o + d] = lut[xf[src + d]]
                        o += dn

        return impl

    def impl(x, heads, tokens, e5m2, scaled, sym, sc, lut8):
        fp8_quantize(x, heads, tokens, e5m2, 57344.0 if e5m2 else 448.0, scaled, sym, sc)

    return impl


def _fp8_decode(sym, sc, luts, lut16, scaled, e5m2, heads, tokens, out, kind):  # pragma: no cover
    raise NotImplementedError


@overload(_fp8_decode, inline="always")
def _fp8_decode_impl(sym, sc, luts, lut16, scaled, e5m2, heads, tokens, out, kind):
    """Reconstruction of a float8 segment. Unscaled into bfloat16 output: a lookup in ``lut16``
    (the bfloat16 bits of every float8 value, made by torch); otherwise :func:`fp8_dequantize`."""
    if out.dtype == types.uint16:

        def impl(sym, sc, luts, lut16, scaled, e5m2, heads, tokens, out, kind):
            if scaled or kind != 1:
                fp8_dequantize(sym, sc, luts[1 if e5m2 else 0], scaled, heads, tokens, out, kind)
                return
            lut = lut16[1 if e5m2 else 0]
            nb, hs, ts, d_n = sym.shape
            nh, nt = out.shape[1], out.shape[2]
            sf, of = sym.reshape(-1), out.reshape(-1)
            dn = _u(d_n)
            o = _u(0)
            for b in range(nb):
                for hi in range(hs):
                    for ti in range(ts):
                        dst = _u(((b * nh + heads[hi]) * nt + tokens[ti]) * d_n)
                        for d in range(dn):
                            of[dst + d] = lut[sf[o + d]]
                        o += dn

        return impl

    def impl(sym, sc, luts, lut16, scaled, e5m2, heads, tokens, out, kind):
        fp8_dequantize(sym, sc, luts[1 if e5m2 else 0], scaled, heads, tokens, out, kind)

    return impl


@njit(**_JIT)
def encode_segments(x, segs, idx, out, symbuf, pack, lut8):
    """Quantize every segment of one tensor; write metadata and (if ``pack``) packed payloads.

    Reference: per segment, the block quantizer's ``quantize_block`` on
    ``x[:, heads][:, :, tokens]`` (:class:`~kvtune.codecs.quantizers.UniformQuantizer`,
    :class:`~kvtune.codecs.quantizers.NoQuantizer`, :class:`~kvtune.codecs.fp8.FP8Quantizer`),
    :func:`kvtune.codecs.base.meta_to_bytes` and :func:`kvtune.codecs.bitpack.pack_bits`.

    Args:
        x: ``(B, H, T, D)`` float32 or uint16 (bfloat16 bits), after the transforms.
        segs: int64 ``(S, SEG_COLUMNS)`` segment table; idx: int64 head and token indices.
        out: uint8 buffer of the tensor's sections; metadata (float16, little-endian) and, when
            ``pack``, the bit-packed payloads (:func:`pack_bits`; bfloat16 as little-endian
            words) are written at the table's offsets.
        symbuf: uint8 scratch; when not ``pack``, each segment's symbols are left at its
            ``SEG_SYM`` offset (uint8, or little-endian uint16 for bfloat16) for another codec.
        pack: bit-pack into ``out`` (the ``bitpack`` codec).
        lut8: uint8 ``(2, 65536)``: the e4m3 and e5m2 symbol of every bfloat16 pattern.

    Returns:
        The OR of every symbol of widths 1..8 (the caller checks that they fit).
    """
    nb, nh, nt, d_n = x.shape
    meta = np.empty(_meta_scratch(segs, nb, d_n), np.uint16)
    seen = np.int64(0)
    for s in range(segs.shape[0]):
        kind, bits = segs[s, SEG_KIND], segs[s, SEG_BITS]
        hs, ts = segs[s, SEG_NHEADS], segs[s, SEG_NTOKENS]
        heads = idx[segs[s, SEG_HEADS] : segs[s, SEG_HEADS] + hs]
        tokens = idx[segs[s, SEG_TOKENS] : segs[s, SEG_TOKENS] + ts]
        n = nb * hs * ts * d_n
        so = 0 if pack else segs[s, SEG_SYM]
        if kind == KIND_BF16:
            if pack:
                _put_bf16(x, heads, tokens, out, segs[s, SEG_PAYLOAD])
            else:
                _put_bf16(x, heads, tokens, symbuf, so)
            continue
        sym = symbuf[so : so + n].reshape((nb, hs, ts, d_n))
        m = segs[s, SEG_META_LEN] // 2
        if kind == KIND_UNIFORM:
            g, symmetric = segs[s, SEG_G], segs[s, SEG_B] != 0
            half = m if symmetric else m // 2
            if segs[s, SEG_A]:
                ng = (d_n + g - 1) // g
                sc = meta[:half].reshape((nb, hs, ts, ng))
                ze = meta[m - half : m].reshape((nb, hs, ts, ng))
                quantize_per_token(x, heads, tokens, g, bits, symmetric, sym, sc, ze)
            else:
                ng = (ts + g - 1) // g
                sc = meta[:half].reshape((nb, hs, ng, d_n))
                ze = meta[m - half : m].reshape((nb, hs, ng, d_n))
                quantize_per_channel(x, heads, tokens, g, bits, symmetric, sym, sc, ze)
        else:
            e5m2, scaled = segs[s, SEG_A] != 0, segs[s, SEG_B] != 0
            sc = meta[: max(m, nb * hs * ts)].reshape((nb, hs, ts))
            _fp8_encode(x, heads, tokens, e5m2, scaled, sym, sc, lut8)
        _put_u16(meta, m, out, _u(segs[s, SEG_META]))
        if pack:
            po = segs[s, SEG_PAYLOAD]
            seen |= pack_bits(sym.reshape(-1), bits, out[po : po + segs[s, SEG_PAYLOAD_LEN]])
    return seen


@njit(**_JIT)
def decode_segments(data, segs, idx, luts, lut16, symbuf, packed, out, kind):
    """Inverse of :func:`encode_segments`: reconstruct every segment of one tensor into ``out``.

    Reference: per segment, :func:`kvtune.codecs.bitpack.unpack_bits`,
    :func:`kvtune.codecs.base.meta_from_bytes` and the block quantizer's ``dequantize_block``,
    converted to the output dtype and written at the segment's heads and tokens.

    Args:
        data: uint8 sections of the tensor (lengths already checked against the table).
        segs, idx: as :func:`encode_segments`.
        luts: float32 ``(2, 256)`` values of the e4m3 and e5m2 bit patterns.
        lut16: uint16 ``(2, 256)``: their bfloat16 bits.
        symbuf: the symbols of each segment at its ``SEG_SYM`` offset when not ``packed``;
            scratch otherwise.
        packed: the payloads in ``data`` are bit-packed (``bitpack``).
        out: ``(B, H, T, D)`` float32, or uint16 bits of ``kind`` (1 bfloat16, 2 float16).
    """
    nb, nh, nt, d_n = out.shape
    meta = np.empty(_meta_scratch(segs, nb, d_n), np.uint16)
    for s in range(segs.shape[0]):
        sk, bits = segs[s, SEG_KIND], segs[s, SEG_BITS]
        hs, ts = segs[s, SEG_NHEADS], segs[s, SEG_NTOKENS]
        heads = idx[segs[s, SEG_HEADS] : segs[s, SEG_HEADS] + hs]
        tokens = idx[segs[s, SEG_TOKENS] : segs[s, SEG_TOKENS] + ts]
        n = nb * hs * ts * d_n
        so = 0 if packed else segs[s, SEG_SYM]
        if sk == KIND_BF16:
            if packed:
                _get_bf16(data, segs[s, SEG_PAYLOAD], heads, tokens, out, kind)
            else:
                _get_bf16(symbuf, so, heads, tokens, out, kind)
            continue
        sym = symbuf[so : so + n]
        if packed:
            po = segs[s, SEG_PAYLOAD]
            unpack_bits(data[po : po + segs[s, SEG_PAYLOAD_LEN]], bits, sym)
        sym4 = sym.reshape((nb, hs, ts, d_n))
        m = segs[s, SEG_META_LEN] // 2
        _get_u16(data, _u(segs[s, SEG_META]), m, meta)
        if sk == KIND_UNIFORM:
            g, symmetric = segs[s, SEG_G], segs[s, SEG_B] != 0
            half = m if symmetric else m // 2
            if segs[s, SEG_A]:
                ng = (d_n + g - 1) // g
                sc = meta[:half].reshape((nb, hs, ts, ng))
                ze = meta[m - half : m].reshape((nb, hs, ts, ng))
                dequantize_per_token(sym4, sc, ze, g, bits, symmetric, heads, tokens, out, kind)
            else:
                ng = (ts + g - 1) // g
                sc = meta[:half].reshape((nb, hs, ng, d_n))
                ze = meta[m - half : m].reshape((nb, hs, ng, d_n))
                dequantize_per_channel(sym4, sc, ze, g, bits, symmetric, heads, tokens, out, kind)
        else:
            e5m2, scaled = segs[s, SEG_A] != 0, segs[s, SEG_B] != 0
            sc = meta[: max(m, nb * hs * ts)].reshape((nb, hs, ts))
            _fp8_decode(sym4, sc, luts, lut16, scaled, e5m2, heads, tokens, out, kind)


# ----------------------------------------------------------------------------- CRC32


def _crc_tables() -> np.ndarray:
    """Slicing-by-16 tables of the CRC-32 of zlib (reflected polynomial 0xEDB88320)."""
    t = np.zeros((16, 256), dtype=np.uint32)
    for i in range(256):
        c = i
        for _ in range(8):
            c = (c >> 1) ^ 0xEDB88320 if c & 1 else c >> 1
        t[0, i] = c
    for k in range(1, 16):
        t[k] = (t[k - 1] >> 8) ^ t[0][t[k - 1] & 0xFF]
    return t


_CRC_T = _crc_tables()


@njit(**_JIT)
def crc32_update(crc, data):
    """``zlib.crc32(data, crc)`` for a 1-D uint8 array (slicing-by-16)."""
    t = _CRC_T
    c = np.uint32(crc) ^ np.uint32(0xFFFFFFFF)
    n = data.shape[0]
    i = 0
    while i + 16 <= n:
        w0 = c ^ (np.uint32(data[i]) | (np.uint32(data[i + 1]) << np.uint32(8))
                  | (np.uint32(data[i + 2]) << np.uint32(16)) | (np.uint32(data[i + 3]) << np.uint32(24)))
        c = (t[15, w0 & np.uint32(0xFF)] ^ t[14, (w0 >> np.uint32(8)) & np.uint32(0xFF)]
             ^ t[13, (w0 >> np.uint32(16)) & np.uint32(0xFF)] ^ t[12, w0 >> np.uint32(24)]
             ^ t[11, data[i + 4]] ^ t[10, data[i + 5]] ^ t[9, data[i + 6]] ^ t[8, data[i + 7]]
             ^ t[7, data[i + 8]] ^ t[6, data[i + 9]] ^ t[5, data[i + 10]] ^ t[4, data[i + 11]]
             ^ t[3, data[i + 12]] ^ t[2, data[i + 13]] ^ t[1, data[i + 14]] ^ t[0, data[i + 15]])
        i += 16
    while i < n:
        c = t[0, (c ^ np.uint32(data[i])) & np.uint32(0xFF)] ^ (c >> np.uint32(8))
        i += 1
    return np.int64(c ^ np.uint32(0xFFFFFFFF))


@njit(**_JIT)
def _gf2_multmodp(a, b):
    """Multiply two polynomials modulo the CRC polynomial (zlib's multmodp, reflected)."""
    m = np.int64(1) << 31
    p = np.int64(0)
    while True:
        if a & m:
            p ^= b
            if (a & (m - 1)) == 0:
                break
        m >>= 1
        b = (b >> 1) ^ 0xEDB88320 if b & 1 else b >> 1
    return p


@njit(**_JIT)
def crc32_combine(crc1, crc2, len2):
    """CRC of ``A + B`` from ``crc(A)``, ``crc(B)`` and ``len(B)`` (zlib's crc32_combine)."""
    if len2 <= 0:
        return crc1
    # x^(8 * len2) mod p, by squaring x^(2^k)
    xp = np.int64(1) << 30  # x^1 in reflected form
    p = np.int64(1) << 31  # x^0
    n = np.int64(len2) * 8
    while n:
        if n & 1:
            p = _gf2_multmodp(xp, p)
        xp = _gf2_multmodp(xp, xp)
        n >>= 1
    return _gf2_multmodp(p, crc1) ^ crc2


# ----------------------------------------------------------------------------- warm-up


def warm_up() -> float:
    """Compile (or load from the on-disk cache) the kernels with the argument types the fast
    path (:mod:`kvtune.codecs.fastpath`) uses. Not a kernel itself: its test checks that every
    kernel it lists ends up compiled.

    Returns:
        Seconds spent: a few minutes on a loaded 2-core machine the first time after an edit
        of this file (about a minute when idle), about a second once cached (reading the cache
        files and linking).
    """
    import time

    start = time.perf_counter()
    shape = (1, 2, 8, 8)
    seg = np.zeros((1, SEG_COLUMNS), np.int64)
    seg[0] = (KIND_UNIFORM, 4, 1, 8, 0, 0, 2, 2, 8, 0, 64, 64, 64, 0)  # 2 heads x 8 tokens x 8, groups of 8
    idx = np.array([0, 1, *range(8)], np.int64)
    out = np.zeros(128, np.uint8)
    sym = np.zeros(128, np.uint8)
    luts = np.zeros((2, 256), np.float32)
    for x in (np.ones(shape, np.float32), np.full(shape, 0x3F80, np.uint16)):
        encode_segments(x, seg, idx, out, sym, True, np.zeros((2, 65536), np.uint8))
    ro = out.copy()
    ro.flags.writeable = False
    for data in (out, ro):
        for y, kind in ((np.zeros(shape, np.float32), 0), (np.zeros(shape, np.uint16), 1)):
            decode_segments(data, seg, idx, luts, np.zeros((2, 256), np.uint16), sym, True, y, kind)
    y = np.ones(shape, np.float32)
    to_float32(np.full(shape, 0x3F80, np.uint16), y)
    to_float32(np.ones(shape, np.float32), y)
    store_output(y, 1, np.empty(shape, np.uint16))
    hadamard_rows(y, np.ones((2, 8), np.float32), np.array([8], np.int64), np.ones(1, np.float32), False)
    delta_rows(y, 4, False)
    s16 = np.zeros((2, 8), np.uint16)
    affine_fit(y, True, True, s16, s16.copy())
    affine_rows(y, s16, s16, True, False)
    crc32_combine(1, 2, 5)
    return time.perf_counter() - start
