"""Low-level building blocks shared by the kernel modules of :mod:`kvtune.codecs.kernels`.

Compile options, numeric constants, float32 <-> integer bit casts, a pointer to 8 float32 lanes
and 8-lane vector min/max reductions, as numba intrinsics (LLVM IR written directly where
numba's loop vectorizer does not produce it). None of them is a kernel of its own (the package does
not re-export them): each is exercised through the kernels that use it
(``tests/test_kernels.py`` compares those with their references).

Scalar helpers are inlined at numba-IR level (:data:`INLINE`): a call per group would cost more
than the group's arithmetic. Inner loops index with ``uintp``: numba's negative-index
wrap-around check on a signed computed index blocks vectorization (measured 5x slower).
"""

from __future__ import annotations

import warnings

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.core.errors import NumbaIRAssumptionWarning
from numba.extending import intrinsic

__all__ = [
    "JIT",
    "INLINE",
    "U1",
    "U2",
    "U3",
    "U4",
    "U5",
    "U6",
    "U7",
    "U8",
    "FP16_MAX",
    "F32_TINY",
    "ZERO",
    "ONE",
    "TWO",
    "HALF",
    "u32_as_f32",
    "f32_as_u32",
    "v8_ptr",
    "vminmax",
    "absmax",
]

# numba's internal SSA check warns on the inlined bf16 helpers (a pedantic notice about its own
# IR, not a problem in the kernels): keep it out of users' logs
warnings.filterwarnings("ignore", category=NumbaIRAssumptionWarning)

JIT = dict(nogil=True, cache=True, fastmath=False, error_model="numpy")
"""``njit`` options of every kernel: releases the GIL, cached on disk, IEEE semantics."""
INLINE = dict(JIT, inline="always")
"""``njit`` options of the scalar helpers: :data:`JIT`, inlined at numba-IR level."""
U1 = np.uint64(1)  # uintp on the 64-bit platforms numba supports
U2, U3, U4, U5, U6, U7, U8 = (np.uint64(i) for i in range(2, 9))
FP16_MAX = np.float32(65504.0)
F32_TINY = np.float32(np.finfo(np.float32).tiny)
ZERO = np.float32(0.0)
ONE = np.float32(1.0)
TWO = np.float32(2.0)
HALF = np.float32(0.5)


# ----------------------------------------------------------------------------- bit casts


@intrinsic
def u32_as_f32(typingctx, u):
    """Reinterpret the low 32 bits of an integer as a float32."""
    if not isinstance(u, types.Integer):
        return None
    sig = types.float32(u)

    def codegen(context, builder, signature, args):
        v = context.cast(builder, args[0], signature.args[0], types.uint32)
        return builder.bitcast(v, ir.FloatType())

    return sig, codegen


@intrinsic
def f32_as_u32(typingctx, f):
    """The IEEE bit pattern of a float32, as uint32."""
    if f != types.float32:
        return None
    sig = types.uint32(f)

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.IntType(32))

    return sig, codegen


# ----------------------------------------------------------------------------- vectors and reductions


def _hreduce(builder, v, vop, sop):
    """Horizontal min or max of an 8-lane vector: three shuffle + op steps (a tree), then one
    scalar op on lanes 0 and 1."""
    i32 = ir.IntType(32)
    for width in (4, 2):
        mask = ir.Constant(ir.VectorType(i32, 8), [ir.Constant(i32, i + width if i < width else i) for i in range(8)])
        v = builder.call(vop, [v, builder.shuffle_vector(v, v, mask)])
    return builder.call(sop, [builder.extract_element(v, ir.Constant(i32, 0)), builder.extract_element(v, ir.Constant(i32, 1))])


@intrinsic
def vminmax(typingctx, arr, start, stop):
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


@njit(**INLINE)
def absmax(row, d0, d1):
    """Largest ``|row[d]|`` for ``d`` in ``d0..d1`` (0 for an empty range), float32."""
    m = ZERO
    for d in range(d0, d1):
        m = max(m, abs(row[d]))
    return m


def v8_ptr(context, builder, signature, args):
    """Pointer to ``arr[i]`` (float32 array ``args[0]``, index ``args[1]``) as ``<8 x float>*``,
    for the code generators of intrinsics (``signature`` and ``args`` as numba passes them)."""
    ary = context.make_array(signature.args[0])(context, builder, args[0])
    i = context.cast(builder, args[1], signature.args[1], types.int64)
    return builder.bitcast(builder.gep(ary.data, [i]), ir.VectorType(ir.FloatType(), 8).as_pointer())
