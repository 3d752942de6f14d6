"""Low-level building blocks shared by the kernel modules of :mod:`kvtune.codecs.kernels`.

Compile options, numeric constants, float32 <-> integer bit casts, a pointer to 8 float32 lanes,
8-lane vector min/max reductions, raw addresses and an atomic counter, as numba intrinsics (LLVM IR written directly where
numba's loop vectorizer does not produce it). None of them is a kernel of its own (the package does
not re-export them): each is exercised through the kernels that use it
(``tests/test_kernels.py`` compares those with their references).

Scalar helpers are inlined at numba-IR level (:data:`INLINE`): a call per group would cost more
than the group's arithmetic. Inner loops index with ``uintp``: numba's negative-index
wrap-around check on a signed computed index blocks vectorization (measured 5x slower).
"""

from __future__ import annotations

import platform
import warnings

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils, config
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
    "vminmax_groups8",
    "vminmax_rows8",
    "absmax",
    "address_as_voidptr",
    "fetch_add",
    "target_has_features",
]

def target_has_features(*features: str) -> bool:
    """Whether numba compiles the kernels for an x86-64 CPU with all these LLVM features (e.g.
    ``"pclmul"``, ``"avx512bf16"``): the host CPU, unless ``NUMBA_CPU_NAME`` /
    ``NUMBA_CPU_FEATURES`` choose another target (then only features that target names count;
    a named CPU without a feature list gives no guarantee). A kernel that emits an instruction
    of a feature the target lacks would abort the process in LLVM, so every such choice asks
    here."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return False
    if config.CPU_FEATURES is not None:
        return all(f"+{f}" in config.CPU_FEATURES.split(",") for f in features)
    if config.CPU_NAME not in (None, "host"):  # a portable target: no guarantee
        return False
    try:
        import llvmlite.binding as llvm

        host = llvm.get_host_cpu_features()
        return all(bool(host.get(f, False)) for f in features)
    except Exception:  # pragma: no cover - llvmlite without host feature detection
        return False


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


def _select_min(builder, a, b):
    """``a < b ? a : b`` lane by lane: one ``minps`` on x86. Equal to ``llvm.minnum`` on
    non-NaN lanes (up to the sign of a zero), without its NaN fix-ups (3 instructions per op)."""
    return builder.select(builder.fcmp_ordered("<", a, b), a, b)


def _select_max(builder, a, b):
    """``a > b ? a : b`` lane by lane (``maxps``); as :func:`_select_min`."""
    return builder.select(builder.fcmp_ordered(">", a, b), a, b)


def _tree8(builder, vecs, vop):
    """Lane ``k`` of the result = min (or max, by ``vop``: :func:`_select_min` or
    :func:`_select_max`) of the 8 lanes of ``vecs[k]``: a
    transposing tree of 7 vector ops and 14 shuffles for 8 reductions (one at a time takes 3
    ops, 3 shuffles and 2 extracts each, in a dependent chain)."""
    i32 = ir.IntType(32)

    def halves(a, b, lo_idx, hi_idx):
        mask = lambda idx: ir.Constant(ir.VectorType(i32, 8), [ir.Constant(i32, i) for i in idx])  # noqa: E731
        return vop(builder, builder.shuffle_vector(a, b, mask(lo_idx)), builder.shuffle_vector(a, b, mask(hi_idx)))

    quads = [halves(vecs[i], vecs[i + 1], (0, 1, 2, 3, 8, 9, 10, 11), (4, 5, 6, 7, 12, 13, 14, 15)) for i in (0, 2, 4, 6)]
    pairs = [halves(quads[i], quads[i + 1], (0, 1, 4, 5, 8, 9, 12, 13), (2, 3, 6, 7, 10, 11, 14, 15)) for i in (0, 2)]
    return halves(pairs[0], pairs[1], (0, 2, 4, 6, 8, 10, 12, 14), (1, 3, 5, 7, 9, 11, 13, 15))


@intrinsic
def vminmax_groups8(typingctx, arr, start, g, lo, hi, out):
    """Min and max of 8 consecutive groups of ``g`` float32 values: group ``k`` is
    ``arr[start + k*g : start + (k+1)*g]``; ``lo[out + k]``, ``hi[out + k]`` receive them.

    ``g`` must be a positive multiple of 8 (the caller checks) and the values finite (the
    quantizers' inputs are: NaN and inf are refused before). Each group is reduced on 8-lane
    vectors (:func:`_select_min`, :func:`_select_max`), then the 8 groups together by a
    transposing tree (:func:`_tree8`). Exact: order does not change a min or max (the sign of a
    zero aside, made canonical by the callers)."""
    ok = all(isinstance(a, types.Array) and a.dtype == types.float32 and a.ndim == 1 for a in (arr, lo, hi))
    if not ok:
        return None
    sig = types.void(arr, start, g, lo, hi, out)

    def codegen(context, builder, signature, args):
        sa = signature.args
        data = context.make_array(sa[0])(context, builder, args[0]).data
        i64, f32 = ir.IntType(64), ir.FloatType()
        v8 = ir.VectorType(f32, 8)
        start_i, g_i, out_i = (context.cast(builder, args[i], sa[i], types.int64) for i in (1, 2, 5))
        eight = ir.Constant(i64, 8)

        def load(idx):
            return builder.load(builder.bitcast(builder.gep(data, [idx]), v8.as_pointer()), align=4)

        los, his = [], []
        for k in range(8):
            g0 = builder.add(start_i, builder.mul(g_i, ir.Constant(i64, k)))
            first = load(g0)
            acc_lo = cgutils.alloca_once_value(builder, first)
            acc_hi = cgutils.alloca_once_value(builder, first)
            with cgutils.for_range_slice(builder, builder.add(g0, eight), builder.add(g0, g_i), eight, inc=True) as (idx, _):
                v = load(idx)
                builder.store(_select_min(builder, builder.load(acc_lo), v), acc_lo)
                builder.store(_select_max(builder, builder.load(acc_hi), v), acc_hi)
            los.append(builder.load(acc_lo))
            his.append(builder.load(acc_hi))
        for res, arg in ((_tree8(builder, los, _select_min), 3), (_tree8(builder, his, _select_max), 4)):
            dst = context.make_array(sa[arg])(context, builder, args[arg]).data
            builder.store(res, builder.bitcast(builder.gep(dst, [out_i]), v8.as_pointer()), align=4)
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def vminmax_rows8(typingctx, arr, start, stride, n, lo, hi, at):
    """Per-lane min and max of ``n >= 1`` rows of 8 float32 lanes: row ``j`` is
    ``arr[start + j*stride : start + j*stride + 8]``; ``lo[at:at + 8]`` and ``hi[at:at + 8]``
    receive them (the per-channel groups of a block of tokens).

    Four independent accumulator pairs (rows ``j mod 4``) kept in registers, combined at the
    end: a running min through memory, one row at a time, waits on store-to-load forwarding at
    every row. Finite values only, exact: as :func:`vminmax_groups8`."""
    ok = all(isinstance(a, types.Array) and a.dtype == types.float32 and a.ndim == 1 for a in (arr, lo, hi))
    if not ok:
        return None
    sig = types.void(arr, start, stride, n, lo, hi, at)

    def codegen(context, builder, signature, args):
        sa = signature.args
        data = context.make_array(sa[0])(context, builder, args[0]).data
        i64 = ir.IntType(64)
        v8 = ir.VectorType(ir.FloatType(), 8)
        start_i, stride_i, n_i, at_i = (context.cast(builder, args[i], sa[i], types.int64) for i in (1, 2, 3, 6))

        def load(row):
            idx = builder.add(start_i, builder.mul(row, stride_i))
            return builder.load(builder.bitcast(builder.gep(data, [idx]), v8.as_pointer()), align=4)

        first = load(ir.Constant(i64, 0))
        accs = [(cgutils.alloca_once_value(builder, first), cgutils.alloca_once_value(builder, first)) for _ in range(4)]
        four = ir.Constant(i64, 4)
        n4 = builder.mul(builder.udiv(n_i, four), four)
        with cgutils.for_range_slice(builder, ir.Constant(i64, 0), n4, four, inc=True) as (row, _):
            for k, (alo, ahi) in enumerate(accs):
                v = load(builder.add(row, ir.Constant(i64, k)))
                builder.store(_select_min(builder, builder.load(alo), v), alo)
                builder.store(_select_max(builder, builder.load(ahi), v), ahi)
        alo, ahi = accs[0]
        with cgutils.for_range_slice(builder, n4, n_i, ir.Constant(i64, 1), inc=True) as (row, _):
            v = load(row)
            builder.store(_select_min(builder, builder.load(alo), v), alo)
            builder.store(_select_max(builder, builder.load(ahi), v), ahi)
        lo4, hi4 = [builder.load(a) for a, _ in accs], [builder.load(h) for _, h in accs]
        rlo = _select_min(builder, _select_min(builder, lo4[0], lo4[1]), _select_min(builder, lo4[2], lo4[3]))
        rhi = _select_max(builder, _select_max(builder, hi4[0], hi4[1]), _select_max(builder, hi4[2], hi4[3]))
        for res, arg in ((rlo, 4), (rhi, 5)):
            builder.store(res, v8_ptr(context, builder, types.void(sa[arg], sa[6]), [args[arg], args[6]]), align=4)
        return context.get_dummy_value()

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


# ----------------------------------------------------------------------------- addresses and atomics


@intrinsic
def address_as_voidptr(typingctx, addr):
    """An integer memory address (``Tensor.data_ptr()``, ``ndarray.ctypes.data``) as a ``void*``
    for ``numba.carray``: the batch kernels reach the K / V tensors of a whole cache, each its
    own allocation, through one int64 table. The caller keeps the memory alive and sized."""
    if not isinstance(addr, types.Integer):
        return None
    sig = types.voidptr(addr)

    def codegen(context, builder, signature, args):
        v = context.cast(builder, args[0], signature.args[0], types.int64)
        return builder.inttoptr(v, cgutils.voidptr_t)

    return sig, codegen


@intrinsic
def fetch_add(typingctx, counter, n):
    """Atomically add ``n`` to ``counter[0]`` (a C-contiguous int64 array) and return its old
    value: the threads of one batch call claim the next tensor from a shared counter."""
    if not (isinstance(counter, types.Array) and counter.dtype == types.int64 and isinstance(n, types.Integer)):
        return None
    sig = types.int64(counter, n)

    def codegen(context, builder, signature, args):
        ary = context.make_array(signature.args[0])(context, builder, args[0])
        v = context.cast(builder, args[1], signature.args[1], types.int64)
        return builder.atomic_rmw("add", ary.data, v, "seq_cst")

    return sig, codegen
