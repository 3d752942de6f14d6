"""float16 / bfloat16 <-> float32 conversions, and rows read or written in the tensor dtypes.

Accelerates the dtype handling of the whole codec path: the float16 metadata of every
quantizer (:mod:`kvtune.codecs.quantizers`, :mod:`kvtune.codecs.fp8`,
:mod:`kvtune.codecs.transforms`), bfloat16 inputs and the conversion of decoded tensors into
their output dtype (:mod:`kvtune.codecs.fastpath`). Each conversion rounds as torch does (to
nearest even); ``tests/test_kernels.py`` compares them with torch's conversions.

:func:`load_row`, :func:`store_row` and :func:`bf16_bits_to_f32` are helpers for the other
kernel modules, not kernels (tested through the kernels that use them); the others are
re-exported by :mod:`kvtune.codecs.kernels`.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types, uintp
from numba.extending import intrinsic, overload

from .lowlevel import FP16_MAX, HALF, INLINE, JIT, U1, U2, f32_as_u32, target_has_features, u32_as_f32

_u = uintp


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
    and its two float32 neighbours, overflow bounds and random bit patterns. On x86, F16C of
    numba's target CPU (:func:`~.lowlevel.target_has_features`: ``NUMBA_CPU_NAME=generic``
    has none)."""
    import platform

    if platform.machine().lower() not in ("x86_64", "amd64", "i386", "i686"):
        return True
    return target_has_features("f16c")


_HW_F16 = _hardware_f16()


@njit(**INLINE)
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


@njit(**INLINE)
def f32_to_f16_bits_soft(f):
    """:func:`f32_to_f16_bits` in integer code (the path without F16C), for any CPU."""
    x = np.int64(f32_as_u32(np.float32(f)))
    sign = (x >> 16) & 0x8000
    a = x & 0x7FFFFFFF
    nrm = (a + (((15 - 127) << 23) + 0xFFF) + ((a >> 13) & 1)) >> 13
    sub = np.int64(f32_as_u32(u32_as_f32(a) + HALF)) - 0x3F000000
    r = nrm if a >= 0x38800000 else sub
    r = np.int64(0x7C00) if a >= 0x477FF000 else r
    r = (0x7E00 | ((a >> 13) & 0x3FF)) if a > 0x7F800000 else r
    return sign | r


@njit(**INLINE)
def f16_bits_to_f32(h):
    """float16 bits -> float32 (exact; F16C ``vcvtph2ps`` or branch-free integer code)."""
    if _HW_F16:
        return _h2f_hw(np.uint16(np.int64(h) & 0xFFFF))
    return f16_bits_to_f32_soft(h)


@njit(**INLINE)
def f16_bits_to_f32_soft(h):
    """:func:`f16_bits_to_f32` in branch-free integer code (the path without F16C), for any CPU."""
    h = np.int64(h) & 0xFFFF
    sign = (h & 0x8000) << 16
    e = (h >> 10) & 0x1F
    m = h & 0x3FF
    nrm = sign | ((e + 112) << 23) | (m << 13)
    inf = sign | 0x7F800000 | (m << 13)
    sub = np.int64(f32_as_u32(np.float32(m) * np.float32(5.9604644775390625e-08))) | sign  # m * 2**-24
    r = sub if e == 0 else nrm
    r = inf if e == 0x1F else r
    return u32_as_f32(r)


@njit(**INLINE)
def f32_to_bf16_bits(f):
    """float32 -> bfloat16 bits, round to nearest even (torch's scalar conversion; NaN -> 0x7FC0)."""
    u = np.int64(f32_as_u32(np.float32(f)))
    r = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) & 0xFFFF
    return np.int64(0x7FC0) if (u & 0x7FFFFFFF) > 0x7F800000 else r


@njit(**INLINE)
def bf16_bits_to_f32(b):
    """bfloat16 bits (an integer) -> float32 (exact: the bits become the high half)."""
    return u32_as_f32(np.uint32(b) << np.uint32(16))


@njit(**INLINE)
def fp16_round_up_bits(x):
    """Smallest float16 ``>= x`` (saturating at +-65504), as bits, with ``-0`` made ``+0``.

    Reference: :func:`kvtune.codecs.quantizers.fp16_round_up` followed by the canonical
    zero of :func:`kvtune.codecs.quantizers.asymmetric_params`. Branch-free.
    """
    x = min(max(np.float32(x), -FP16_MAX), FP16_MAX)
    h = f32_to_f16_bits(x)
    up = np.int64(1) if (h & 0x7FFF) == 0 else (h - 1 if h & 0x8000 else h + 1)
    h = up if f16_bits_to_f32(h) < x else h
    return np.int64(0) if h == 0x8000 else h


@njit(**INLINE)
def put_u16(vals, n, out, off):
    """Little-endian bytes of ``vals[:n]`` (uint16) into ``out[off:off + 2n]``."""
    for i in range(_u(n)):
        v = vals[i]
        out[off + U2 * i] = np.uint8(v & 0xFF)
        out[off + U2 * i + U1] = np.uint8(v >> 8)


@njit(**INLINE)
def get_u16(data, off, n, vals):
    """``vals[:n]`` = little-endian uint16 from ``data[off:off + 2n]``."""
    for i in range(_u(n)):
        vals[i] = np.uint16(data[off + U2 * i]) | (np.uint16(data[off + U2 * i + U1]) << np.uint16(8))


def load_value(xf, i):  # pragma: no cover - replaced by the overload below
    """float32 of ``xf[i]`` for a 1-D float32 or bfloat16-bits (uint16) ``xf``; in compiled code
    only (an inlined overload: loops over it vectorize)."""
    raise NotImplementedError


@overload(load_value, inline="always")
def _load_value_impl(xf, i):
    if xf.dtype == types.uint16:
        return lambda xf, i: u32_as_f32(np.uint32(xf[i]) << np.uint32(16))
    if xf.dtype == types.float32:
        return lambda xf, i: xf[i]
    return None


def store_value(of, i, v, kind):  # pragma: no cover - replaced by the overload below
    """``of[i] = v`` converted as :func:`store_row` does (float32 ``of`` as is; uint16 ``of``:
    bfloat16 bits for ``kind`` 1, float16 bits otherwise); in compiled code only (an inlined
    overload: loops over it vectorize, the ``kind`` test moved out of them)."""
    raise NotImplementedError


@overload(store_value, inline="always")
def _store_value_impl(of, i, v, kind):
    if of.dtype == types.float32:

        def impl(of, i, v, kind):
            of[i] = v

        return impl
    if of.dtype == types.uint16:

        def impl(of, i, v, kind):
            of[i] = f32_to_bf16_bits(v) if kind == 1 else f32_to_f16_bits(v)

        return impl
    return None


def load_row(xf, off, row, roff, n):  # pragma: no cover - replaced by the overload below
    """``row[roff:roff + n] = float32(xf[off:off + n])`` for 1-D float32 or bfloat16-bits (uint16)
    ``xf``, offsets ``uintp``; in compiled code only (an inlined overload)."""
    raise NotImplementedError


@overload(load_row, inline="always")
def _load_row_impl(xf, off, row, roff, n):
    """The loop for the dtype of ``xf``: bfloat16 bits shifted into the high half, or a copy."""
    if xf.dtype == types.uint16:

        def impl(xf, off, row, roff, n):
            for d in range(n):
                row[roff + d] = u32_as_f32(np.uint32(xf[off + d]) << np.uint32(16))

        return impl
    if xf.dtype == types.float32:

        def impl(xf, off, row, roff, n):
            for d in range(n):
                row[roff + d] = xf[off + d]

        return impl
    return None


def store_row(of, off, row, n, kind):  # pragma: no cover - replaced by the overload below
    """``of[off:off + n] = row[:n]`` converted: float32 ``of`` as is; uint16 ``of`` as
    bfloat16 bits (``kind`` 1) or float16 bits (``kind`` 2), rounding to nearest even (1-D
    arrays, offsets ``uintp``); in compiled code only (an inlined overload)."""
    raise NotImplementedError


@overload(store_row, inline="always")
def _store_row_impl(of, off, row, n, kind):
    """The loops for the dtype of ``of`` (and, for uint16, for the ``kind``): a copy, or a
    conversion of every element."""
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


@njit(**JIT)
def to_float32(x, out):
    """``out = float32(x)`` for a C-contiguous float32 or bfloat16-bits array (any shape).
    Reference: ``torch.Tensor.to(torch.float32)`` (exact)."""
    xf, of = x.reshape(-1), out.reshape(-1)
    load_row(xf, _u(0), of, _u(0), _u(xf.shape[0]))


@njit(**JIT)
def store_output(y, kind, out):
    """Convert float32 ``y`` (any shape, C order) into ``out``: uint16 bits of ``kind`` (1
    bfloat16, 2 float16), rounding to nearest even as ``torch.Tensor.to``, or a copy into
    float32 ``out`` (``kind`` ignored)."""
    a, o = y.reshape(-1), out.reshape(-1)
    store_row(o, _u(0), a, _u(a.shape[0]), kind)
