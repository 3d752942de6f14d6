"""Uniform (integer grid) quantization of KV segments, per token or per channel.

Accelerates :class:`kvtune.codecs.quantizers.UniformQuantizer` (``quantize_block`` /
``dequantize_block``): asymmetric or symmetric ``bits``-bit grids over groups of channels (per
token) or of tokens (per channel), with float16 scales and zero points -- the scheme of KIVI
("KIVI: A Tuning-Free Asymmetric 2bit Quantization for KV Cache", arXiv 2402.02750, sec. 3:
keys per channel, values per token). Bit for bit the reference's IEEE operations (a subtract,
a multiply, round to nearest even, clamp), on 8- and 16-lane vectors (LLVM IR written directly:
numba's loop vectorizer leaves short per-group loops mostly scalar, with a set-up cost per loop).
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types, uintp
from numba.core import cgutils
from numba.extending import intrinsic

from .convert import f16_bits_to_f32, f32_to_f16_bits, fp16_round_up_bits, load_row, store_row
from .lowlevel import (F32_TINY, FP16_MAX, INLINE, JIT, ONE, TWO, U8, ZERO, absmax, target_has_features, vminmax,
                       vminmax_groups8, vminmax_rows8)
from .transforms import butterflies, rotate_row

_u = uintp
U16 = np.uint64(16)
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


_ROWS = 32  # rows per block of the per-token kernels


@njit(**INLINE)
def consecutive(tokens):
    """Whether the token indices are consecutive (a block of rows within one head is then one
    run of rows of the tensor, :func:`_block_rows`); true for none or one."""
    run = True
    for k in range(1, tokens.shape[0]):
        run &= tokens[k] == tokens[0] + k
    return run


@njit(**INLINE)
def _wrap(b, hi, ti, hs, ts):
    """``(b, hi, ti)`` with a token index one past the last token moved to the next head (and
    the next batch row after the last head)."""
    if ti == ts:
        ti = 0
        hi += 1
        if hi == hs:
            hi = 0
            b += 1
    return b, hi, ti


@njit(**INLINE)
def _block_rows(pos, nr, heads, tokens, run, nh, nt, d_n, src, head):
    """The next ``nr`` rows of a segment (``heads`` x ``tokens`` of a ``(B, nh, nt, d_n)``
    tensor, batch-major) from ``pos = (b, head index, token index)``: their element offsets
    into ``src`` and heads into ``head`` (only ``src[0]`` when they are one run of rows, a
    block within one head of ``run`` tokens: no per-row work). Returns ``(next pos, whether
    the rows are one run)``."""
    b, hi, ti = pos
    hs, ts = heads.shape[0], tokens.shape[0]
    contiguous = True
    if run and ti + nr <= ts:
        src[0] = ((b * nh + heads[hi]) * nt + tokens[ti]) * d_n
        head[:nr] = heads[hi]
        return _wrap(b, hi, ti + nr, hs, ts), contiguous
    for r in range(nr):
        src[r] = ((b * nh + heads[hi]) * nt + tokens[ti]) * d_n
        head[r] = heads[hi]
        contiguous &= src[r] == src[0] + r * d_n
        b, hi, ti = _wrap(b, hi, ti + 1, hs, ts)
    return (b, hi, ti), contiguous


def group_lanes(lanes: int, per_lane: bool, body, doc: str):
    """A numba intrinsic that codes ``lanes`` float32 values of one group (or, ``per_lane``,
    of ``lanes`` per-channel groups) into ``lanes`` uint8 symbols:
    ``f(src, soff, z, s, extra, dst, doff)`` with one group's scalar ``z`` and ``s``, or
    ``f(src, soff, zs, ss, poff, extra, dst, doff)`` with ``zs[poff + i]`` / ``ss[poff + i]``
    per lane. It loads ``src[soff : soff + lanes]`` (float32 array), ``z`` and ``s`` as
    ``<lanes x float>`` vectors and stores ``body(context, builder, v, z, s, extra_type,
    extra)`` (a ``<lanes x i8>``) at ``dst[doff]`` (uint8 array). The plumbing of
    :func:`_vquant` and of the codebook coder (:mod:`.codebook`); ``doc`` is the intrinsic's
    docstring."""

    def typer(src, soff, *rest):
        dst = rest[-2]
        if not (isinstance(src, types.Array) and src.dtype == types.float32 and isinstance(dst, types.Array)
                and dst.dtype == types.uint8):
            return None
        sig = types.void(src, soff, *rest)

        def codegen(context, builder, signature, args):
            sa = signature.args
            i32 = ir.IntType(32)
            vf = ir.VectorType(ir.FloatType(), lanes)

            def ptr(i, j, ty):  # ty* to array args[i] at index args[j]
                ary = context.make_array(sa[i])(context, builder, args[i])
                idx = context.cast(builder, args[j], sa[j], types.int64)
                return builder.bitcast(builder.gep(ary.data, [idx]), ty.as_pointer())

            def splat(i):
                val = context.cast(builder, args[i], sa[i], types.float32)
                return builder.shuffle_vector(builder.insert_element(ir.Constant(vf, ir.Undefined), val, ir.Constant(i32, 0)),
                                              ir.Constant(vf, ir.Undefined), ir.Constant(ir.VectorType(i32, lanes), [0] * lanes))

            if per_lane:
                z, s = builder.load(ptr(2, 4, vf), align=4), builder.load(ptr(3, 4, vf), align=4)
                xi, di, do = 5, 6, 7
            else:
                z, s, xi, di, do = splat(2), splat(3), 4, 5, 6
            v = builder.load(ptr(0, 1, vf), align=4)
            out = body(context, builder, v, z, s, sa[xi], args[xi])
            builder.store(out, ptr(di, do, ir.VectorType(ir.IntType(8), lanes)), align=1)
            return context.get_dummy_value()

        return sig, codegen

    if per_lane:
        def f(typingctx, src, soff, zs, ss, poff, extra, dst, doff):
            return typer(src, soff, zs, ss, poff, extra, dst, doff)
    else:
        def f(typingctx, src, soff, z, s, extra, dst, doff):
            return typer(src, soff, z, s, extra, dst, doff)
    f.__doc__ = doc
    return intrinsic(f)


def _vquant(lanes: int, per_lane: bool):
    """An intrinsic for ``lanes`` lanes of :func:`_quant` (:func:`group_lanes`, ``s`` the
    inverse scale ``inv``, ``extra`` the largest symbol ``fq``):
    ``dst[doff + i] = clamp(rint((src[soff + i] - z) * inv), 0, fq)``.

    A subtract, a multiply (two roundings, no FMA), ``llvm.rint`` (nearest even, as
    ``np.rint``/``torch.round``), max/min clamp, conversion to uint8: the reference's operations
    on a vector (16 lanes fill an AVX-512 register; LLVM splits them into two on AVX2)."""

    def body(context, builder, v, z, inv, fq_type, fq):
        vf = v.type
        name = f"v{lanes}f32"
        mod = builder.module
        rint = cgutils.get_or_insert_function(mod, ir.FunctionType(vf, [vf]), f"llvm.rint.{name}")
        vmax = cgutils.get_or_insert_function(mod, ir.FunctionType(vf, [vf, vf]), f"llvm.maxnum.{name}")
        vmin = cgutils.get_or_insert_function(mod, ir.FunctionType(vf, [vf, vf]), f"llvm.minnum.{name}")
        top = context.cast(builder, fq, fq_type, types.float32)
        top = builder.shuffle_vector(builder.insert_element(ir.Constant(vf, ir.Undefined), top, ir.Constant(ir.IntType(32), 0)),
                                     ir.Constant(vf, ir.Undefined), ir.Constant(ir.VectorType(ir.IntType(32), lanes), [0] * lanes))
        u = builder.call(rint, [builder.fmul(builder.fsub(v, z), inv)])
        u = builder.call(vmin, [builder.call(vmax, [u, ir.Constant(vf, [0.0] * lanes)]), top])
        return builder.fptoui(u, ir.VectorType(ir.IntType(8), lanes))

    return group_lanes(lanes, per_lane, body, _vquant.__doc__)


_vquant8 = _vquant(8, False)
_vquant16 = _vquant(16, False)
_vquant8v = _vquant(8, True)
_vquant16v = _vquant(16, True)


def _deq_store(context, builder, u, s, z, out_ty, out_arg, ooff_ty, ooff):
    """``out[ooff:ooff + 16] = z + float32(u) * s`` (a multiply, then an add: the reference's
    two roundings) for 16 uint8 lanes ``u`` (``s``, ``z``: 16-lane float32), stored as
    :func:`store16`."""
    v = builder.fadd(z, builder.fmul(builder.uitofp(u, ir.VectorType(ir.FloatType(), 16)), s))
    store16(context, builder, v, out_ty, out_arg, ooff_ty, ooff)


def store16(context, builder, v, out_ty, out_arg, ooff_ty, ooff):
    """``out[ooff:ooff + 16] = v`` (16-lane float32): float32 ``out`` as is, or uint16 ``out``
    of bfloat16 bits rounded to nearest even with NaN as 0x7FC0
    (:func:`~kvtune.codecs.kernels.convert.f32_to_bf16_bits`).

    With AVX512-BF16 (:data:`HW_BF16`) one ``vcvtneps2bf16`` converts the 16 lanes instead of
    nine integer operations: the same rounding for every finite normal value, zero and inf; it
    flushes subnormal inputs to zero and keeps a NaN's sign and payload, so a vector holding
    either (one ``vfpclassps``; never, for decoded values) takes the integer code instead.
    Measured on one ``(1, 3, 1024, 64)`` tensor, one thread, AMD EPYC (Zen 5): 4-bit per-token
    dequantization into bfloat16 14.4-15.9 -> 10.0-10.6 us, the whole tensor decode
    (:func:`~.segments.decode_tensor`) 19.5-19.8 -> 15.8-16.5 us, ``quarot-4``'s 40-43 -> 35-40
    us (the README's codec speed notes)."""
    _store16_rows(context, builder, [v], out_ty, out_arg, [context.cast(builder, ooff, ooff_ty, types.int64)])


def _store16_rows(context, builder, vs, out_ty, out_arg, offs, checked=True):
    """:func:`store16` of several 16-lane float32 vectors ``vs`` at the int64 offsets ``offs``
    (LLVM values) with one check for subnormal and NaN lanes across all of them (one branch
    instead of one per vector), or none when ``checked`` is false: for values that cannot be
    subnormal or NaN, where ``vcvtneps2bf16`` alone gives the reference's bits.

    A row of 4 vectors rotated and stored in registers (:func:`_make_deq_rotated`) measured
    47.8 us per default-model tensor with a branch per vector, 28.3 with one per row and 24.9
    with none (one thread): the branches kept LLVM from interleaving the conversions with the
    arithmetic."""
    f32, i16 = ir.FloatType(), ir.IntType(16)
    v16 = ir.VectorType(f32, 16)
    ary = context.make_array(out_ty)(context, builder, out_arg)
    if out_ty.dtype == types.float32:
        for v, o in zip(vs, offs):
            builder.store(v, builder.bitcast(builder.gep(ary.data, [o]), v16.as_pointer()), align=4)
        return
    v16i = ir.VectorType(i16, 16)
    ptrs = [builder.bitcast(builder.gep(ary.data, [o]), v16i.as_pointer()) for o in offs]
    if not HW_BF16:
        for v, p in zip(vs, ptrs):
            builder.store(_bf16_bits16(builder, v), p, align=2)
        return
    mod = builder.module
    cvt = cgutils.get_or_insert_function(mod, ir.FunctionType(ir.VectorType(_BFloat(), 16), [v16]),
                                         "llvm.x86.avx512bf16.cvtneps2bf16.512")
    if not checked:
        for v, p in zip(vs, ptrs):
            builder.store(builder.bitcast(builder.call(cvt, [v]), v16i), p, align=2)
        return
    i1v = ir.VectorType(ir.IntType(1), 16)
    fpclass = cgutils.get_or_insert_function(mod, ir.FunctionType(i1v, [v16, ir.IntType(32)]), "llvm.x86.avx512.fpclass.ps.512")
    odd = None
    for v in vs:
        m = builder.bitcast(builder.call(fpclass, [v, ir.Constant(ir.IntType(32), _NAN_OR_SUBNORMAL)]), i16)
        odd = m if odd is None else builder.or_(odd, m)
    rare = builder.icmp_unsigned("!=", odd, ir.Constant(i16, 0))
    with builder.if_else(rare, likely=False) as (slow, fast):
        with slow:
            for v, p in zip(vs, ptrs):
                builder.store(_bf16_bits16(builder, v), p, align=2)
        with fast:
            for v, p in zip(vs, ptrs):
                builder.store(builder.bitcast(builder.call(cvt, [v]), v16i), p, align=2)


def _bf16_bits16(builder, v):
    """Codegen: the bfloat16 bits (16-lane int16) of float32 ``v`` by integer operations: round
    to nearest even, NaN as 0x7FC0 (the reference, :func:`~.convert.f32_to_bf16_bits`)."""
    vi = ir.VectorType(ir.IntType(32), 16)

    def splat(c):
        return ir.Constant(vi, [c] * 16)

    bits = builder.bitcast(v, vi)
    lsb = builder.and_(builder.lshr(bits, splat(16)), splat(1))
    r = builder.lshr(builder.add(builder.add(bits, splat(0x7FFF)), lsb), splat(16))
    nan = builder.icmp_unsigned(">", builder.and_(bits, splat(0x7FFFFFFF)), splat(0x7F800000))
    return builder.trunc(builder.select(nan, splat(0x7FC0), r), ir.VectorType(ir.IntType(16), 16))


class _BFloat(ir.Type):
    """LLVM's ``bfloat`` type, which llvmlite's IR builder does not define (only the textual IR
    name is needed: the ``vcvtneps2bf16`` intrinsic returns ``<16 x bfloat>``)."""

    def _to_string(self) -> str:
        return "bfloat"

    def __eq__(self, other) -> bool:
        return isinstance(other, _BFloat)

    def __hash__(self) -> int:
        return hash("bfloat")


_NAN_OR_SUBNORMAL = 0x01 | 0x20 | 0x80
"""``vfpclassps`` test bits: quiet NaN, subnormal, signaling NaN."""


HW_BF16 = target_has_features("avx512bf16", "avx512dq")
"""Whether :func:`store16` converts with ``vcvtneps2bf16`` (AVX512-BF16) and classifies with
``vfpclassps`` (AVX512-DQ): numba's target CPU has both. numba caches kernels per target CPU,
so the choice is made once per target."""


def load_lanes(context, builder, ary_ty, ary_arg, off_ty, off, elem, n=16):
    """Codegen: the ``n`` elements of LLVM type ``elem`` at ``array[off]`` as one vector load."""
    ary = context.make_array(ary_ty)(context, builder, ary_arg)
    o = context.cast(builder, off, off_ty, types.int64)
    return builder.load(builder.bitcast(builder.gep(ary.data, [o]), ir.VectorType(elem, n).as_pointer()),
                        align=elem.width // 8 if isinstance(elem, ir.IntType) else 4)


def splat16(builder, val):
    """Codegen: the scalar ``val`` in all 16 lanes of a vector."""
    v = ir.VectorType(val.type, 16)
    return builder.shuffle_vector(builder.insert_element(ir.Constant(v, ir.Undefined), val, ir.Constant(ir.IntType(32), 0)),
                                  ir.Constant(v, ir.Undefined), ir.Constant(ir.VectorType(ir.IntType(32), 16), [0] * 16))


def _deq_out_ok(out):
    return isinstance(out, types.Array) and out.dtype in (types.float32, types.uint16)


@intrinsic
def _vdeq16(typingctx, sym, soff, s, z, out, ooff):
    """16 lanes of the reconstruction ``z + sym * s`` (one group's ``s``, ``z``), written to
    float32 ``out`` or as bfloat16 bits to uint16 ``out`` (:func:`_deq_store`)."""
    if not (isinstance(sym, types.Array) and sym.dtype == types.uint8 and _deq_out_ok(out)):
        return None
    sig = types.void(sym, soff, s, z, out, ooff)

    def codegen(context, builder, signature, args):
        sa = signature.args
        u = load_lanes(context, builder, sa[0], args[0], sa[1], args[1], ir.IntType(8))
        sv, zv = (splat16(builder, context.cast(builder, args[i], sa[i], types.float32)) for i in (2, 3))
        _deq_store(context, builder, u, sv, zv, sa[4], args[4], sa[5], args[5])
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def _vdeq16v(typingctx, sym, soff, ss, zz, poff, out, ooff):
    """As :func:`_vdeq16` with per-lane ``ss[poff + i]`` and ``zz[poff + i]`` (per-channel groups)."""
    if not (isinstance(sym, types.Array) and sym.dtype == types.uint8 and _deq_out_ok(out)):
        return None
    sig = types.void(sym, soff, ss, zz, poff, out, ooff)

    def codegen(context, builder, signature, args):
        sa = signature.args
        u = load_lanes(context, builder, sa[0], args[0], sa[1], args[1], ir.IntType(8))
        sv = load_lanes(context, builder, sa[2], args[2], sa[4], args[4], ir.FloatType())
        zv = load_lanes(context, builder, sa[3], args[3], sa[4], args[4], ir.FloatType())
        _deq_store(context, builder, u, sv, zv, sa[5], args[5], sa[6], args[6])
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def _vstore16(typingctx, src, soff, out, ooff):
    """16 float32 lanes ``src[soff:soff + 16]`` written to float32 ``out`` or as bfloat16 bits
    to uint16 ``out`` (:func:`store16`: round to nearest even, NaN as 0x7FC0), in compiled
    code (a vector load, the conversion, a vector store)."""
    if not (isinstance(src, types.Array) and src.dtype == types.float32 and _deq_out_ok(out)):
        return None
    sig = types.void(src, soff, out, ooff)

    def codegen(context, builder, signature, args):
        sa = signature.args
        v = load_lanes(context, builder, sa[0], args[0], sa[1], args[1], ir.FloatType())
        store16(context, builder, v, sa[2], args[2], sa[3], args[3])
        return context.get_dummy_value()

    return sig, codegen


@njit(**JIT)
def quantize_per_token(x, heads, tokens, g, bits, symmetric, sym, scale, zero, rot=None):
    """Uniform quantization of ``x[:, heads][:, :, tokens]`` in groups of ``g`` channels.

    Reference: :meth:`kvtune.codecs.quantizers.UniformQuantizer.quantize_block` with
    ``granularity = "per_token"``. Works on blocks of 32 rows: load (one copy when the rows
    are consecutive in ``x``; with ``rot``, each row then rotated in place while the block is
    in L1), min/max of every group (8 groups at a time,
    :func:`~kvtune.codecs.kernels.lowlevel.vminmax_groups8`, when groups of 8k values tile the
    rows; a symmetric group's absmax is the larger magnitude of its min and max: CacheGen's
    deltas, 118-122 -> 58-62 us per tensor, one thread), the groups' parameters (vectorized),
    then the symbols (one loop over the block's
    groups when they tile it, 16 lanes at a time when ``g`` is a multiple of 16: no per-row
    bounds or scalar tails).

    Args:
        x: ``(B, H, T, D)`` float32 or uint16 (bfloat16 bits), C-contiguous.
        heads, tokens: int64 indices of the segment's heads and tokens.
        g: channels per group (``D`` for a whole row).
        bits: 1..8.
        symmetric: symmetric grid (``zero`` is left untouched).
        sym: out, uint8 ``(B, len(heads), len(tokens), D)``.
        scale, zero: out, uint16 float16 bits ``(B, len(heads), len(tokens), ceil(D / g))``.
        rot: ``None``, or the randomized Hadamard rotation ``(signs, blocks, scales)`` to
            apply to ``x`` first (as :func:`~.transforms.hadamard_rows`, whose arguments they
            are, with ``signs`` flattened to ``H * D``; blocks that pass
            :func:`~.transforms.unrolled`): the symbols of the rotated ``x`` without a rotated
            copy of it. A rotation of one block per row (16..256 channels) is applied as each
            row is loaded (:func:`_make_load_rotated`).
    """
    nb, nh, nt, d_n = x.shape
    xf, sf, scf, zf = x.reshape(-1), sym.reshape(-1), scale.reshape(-1), zero.reshape(-1)
    hs, ts = heads.shape[0], tokens.shape[0]
    ng = scale.shape[3]
    nrows = nb * hs * ts
    fq = np.float32((1 << bits) - 1)
    dn = _u(d_n)
    blk = np.empty(_ROWS * d_n, np.float32)
    src = np.empty(_ROWS, np.int64)
    head = np.empty(_ROWS, np.int64)
    lo = np.empty(_ROWS * ng, np.float32)
    hi = np.empty(_ROWS * ng, np.float32)
    s16 = np.empty(_ROWS * ng, np.int32)
    z16 = np.empty(_ROWS * ng, np.int32)
    zs = np.empty(_ROWS * ng, np.float32)
    invs = np.empty(_ROWS * ng, np.float32)
    tiled = g % 8 == 0 and d_n % g == 0  # KIVI's g = 32, a whole row of 64 or 128: one flat loop
    ug = _u(g)
    run = consecutive(tokens)
    one_block = rot is not None and _whole_row_block(rot[1], d_n)
    pos = (0, 0, 0)  # (batch, head index, token index) of the next row to load
    for r0 in range(0, nrows, _ROWS):
        nr = min(_ROWS, nrows - r0)
        pos, contiguous = _block_rows(pos, nr, heads, tokens, run, nh, nt, d_n, src, head)
        if one_block:  # load, convert and rotate each row in registers
            signs, blocks, bscales = rot
            for r in range(nr):
                o = _u(src[0] + r * d_n if contiguous else src[r])
                _load_rotated_row(xf, o, signs, _u(head[r] * d_n), bscales[0], blk, _u(r * d_n), d_n)
        elif contiguous:
            load_row(xf, _u(src[0]), blk, _u(0), _u(nr * d_n))
        else:
            for r in range(nr):
                load_row(xf, _u(src[r]), blk, _u(r * d_n), dn)
        if rot is not None and not one_block:
            signs, blocks, bscales = rot
            for r in range(nr):
                rotate_row(blk, _u(r * d_n), signs, _u(head[r] * d_n), blocks, bscales, False)
        n8 = 0
        if tiled:  # 8 whole groups at a time, reduced together
            n8 = nr * ng // 8 * 8
            for i in range(0, n8, 8):
                vminmax_groups8(blk, i * g, g, lo, hi, i)
            if symmetric:  # the absmax: the larger magnitude of the two (finite values)
                for i in range(n8):
                    hi[i] = max(abs(lo[i]), abs(hi[i]))
        for i in range(n8, nr * ng):
            r, gi = i // ng, i % ng
            d0 = _u(r * d_n + gi * g)
            d1 = _u(r * d_n + min(gi * g + g, d_n))
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
                if g % 16 == 0:
                    for d in range(d0, d0 + ug, U16):
                        _vquant16(blk, d, z, inv, fq, sf, base + d)
                else:
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
    ``zero`` are ``(B, len(heads), ceil(len(tokens) / g), D)``. Per group of ``g`` tokens: load
    (one copy when the tokens are consecutive), per-channel min/max 8 channels at a time with
    register accumulators (:func:`~kvtune.codecs.kernels.lowlevel.vminmax_rows8`), parameters,
    symbols 16 channels at a time.
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
                contiguous = True  # consecutive tokens: one load (no per-row loop set-up)
                for j in range(n):
                    contiguous &= tokens[t0 + j] == tokens[t0] + j
                if contiguous:
                    load_row(xf, _u((hrow + tokens[t0]) * d_n), blk, _u(0), _u(n * d_n))
                else:
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
                    d8 = dn // U8 * U8
                    for d in range(_u(0), d8, U8):
                        vminmax_rows8(blk, d, d_n, n, lo, hi, d)
                    for d in range(d8, dn):
                        lo[d] = blk[d]
                        hi[d] = blk[d]
                    for j in range(1, n):
                        o = _u(j * d_n)
                        for d in range(d8, dn):
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
                d16 = dn // U16 * U16
                for j in range(n):
                    o = _u(j * d_n)
                    for d in range(_u(0), d16, U16):
                        _vquant16v(blk, o + d, zs, invs, d, fq, sf, base + o + d)
                    for d in range(d16, d8, U8):
                        _vquant8v(blk, o + d, zs, invs, d, fq, sf, base + o + d)
                    for d in range(d8, dn):
                        sf[base + o + d] = _quant(blk[o + d], zs[d], invs[d], fq)


@njit(**INLINE)
def store_rows(blk, dst, nr, d_n, contiguous, of, kind):
    """Convert the first ``nr`` rows of the float32 block ``blk`` (``nr * D``) into ``of``
    (float32, or uint16 bits of ``kind`` as :func:`~.convert.store_row`): row ``r`` at element
    offset ``dst[r]``, or ``dst[0] + r * D`` when ``contiguous``. 16 lanes at a time
    (:func:`_vstore16`) unless the output is float16 or ``D`` is not a multiple of 16. A block
    converted this way, against a conversion loop per row straight into the output: the
    codebook decoder 130 -> 114 us per-channel, 122 -> 91 us per-token on one default-model
    tensor (one thread)."""
    dn = _u(d_n)
    vec = kind != 2 and d_n % 16 == 0
    if contiguous and vec:
        for d in range(_u(0), _u(nr * d_n), U16):
            _vstore16(blk, d, of, _u(dst[0]) + d)
        return
    for r in range(nr):
        o = _u(r * d_n)
        dr = _u(dst[0] + r * d_n if contiguous else dst[r])
        if vec:
            for d in range(_u(0), dn, U16):
                _vstore16(blk, o + d, of, dr + d)
        else:
            store_row(of, dr, blk[o : o + dn], dn, kind)


def _make_load_rotated(n: int):
    """An intrinsic ``f(x, xoff, signs, soff, c, blk, boff)`` for a row of ``n`` channels
    (16..256) rotated by one Hadamard block of ``n``: ``x[xoff:xoff + n]`` (float32, or
    bfloat16 bits shifted into float32) times ``signs[soff:soff + n]``, put through
    :func:`~.transforms.butterflies`, times ``c``, stored into ``blk[boff:]``: the reference's
    operations (:func:`~.transforms.hadamard_rows`, forward) in registers, without the
    converted copy that a separate rotation loads and stores again.

    The product with a sign of +-1 is exact, so it is done as an XOR of the sign bit (off the
    multiply units the butterflies use): the same float for every input but a NaN, whose sign
    only it changes (the encoder refuses non-finite input before quantizing, and the symbols
    do not depend on a NaN's sign). One default-model tensor quantized with its rotation,
    one thread: 44.7 us with a converted copy rotated in place, 42.5 with the rows rotated as
    they are loaded, 39.6-40.0 with the XOR."""
    nv = n // 16

    @intrinsic
    def _load_rotated(typingctx, x, xoff, signs, soff, c, blk, boff):
        if not (isinstance(x, types.Array) and x.dtype in (types.float32, types.uint16)
                and isinstance(blk, types.Array) and blk.dtype == types.float32):
            return None
        sig = types.void(x, xoff, signs, soff, c, blk, boff)

        def codegen(context, builder, signature, args):
            sa = signature.args
            f32, i64 = ir.FloatType(), ir.IntType(64)
            vt, vi = ir.VectorType(f32, 16), ir.VectorType(ir.IntType(32), 16)
            xo, so, bo = (context.cast(builder, args[i], sa[i], types.int64) for i in (1, 3, 6))
            cv = splat16(builder, context.cast(builder, args[4], sa[4], types.float32))
            sign = ir.Constant(vi, [-(1 << 31)] * 16)

            def at(o, k):
                return builder.add(o, ir.Constant(i64, 16 * k))

            vs = []
            for k in range(nv):
                if sa[0].dtype == types.uint16:
                    u = load_lanes(context, builder, sa[0], args[0], types.int64, at(xo, k), ir.IntType(16))
                    v = builder.bitcast(builder.shl(builder.zext(u, vi), ir.Constant(vi, [16] * 16)), vt)
                else:
                    v = load_lanes(context, builder, sa[0], args[0], types.int64, at(xo, k), f32)
                sg = builder.bitcast(load_lanes(context, builder, sa[2], args[2], types.int64, at(so, k), f32), vi)
                vs.append(builder.bitcast(builder.xor(builder.bitcast(v, vi), builder.and_(sg, sign)), vt))
            vs = [builder.fmul(v, cv) for v in butterflies(builder, vs, 16)]
            _store16_rows(context, builder, vs, sa[5], args[5], [at(bo, k) for k in range(nv)])
            return context.get_dummy_value()

        return sig, codegen

    return _load_rotated


_lr16, _lr32, _lr64, _lr128, _lr256 = (_make_load_rotated(n) for n in (16, 32, 64, 128, 256))


@njit(**INLINE)
def _load_rotated_row(xf, src, signs, soff, c, blk, boff, d_n):
    """Dispatch one row of ``d_n`` channels (a power of two in 16..256) to its
    :func:`_make_load_rotated` intrinsic."""
    if d_n == 64:
        _lr64(xf, src, signs, soff, c, blk, boff)
    elif d_n == 128:
        _lr128(xf, src, signs, soff, c, blk, boff)
    elif d_n == 256:
        _lr256(xf, src, signs, soff, c, blk, boff)
    elif d_n == 32:
        _lr32(xf, src, signs, soff, c, blk, boff)
    else:
        _lr16(xf, src, signs, soff, c, blk, boff)


def _make_deq_rotated(n: int):
    """An intrinsic ``f(sym, soff, s, z, sgc, hoff, out, ooff)`` for a row of ``n`` channels
    (16..256) in one group (scale ``s``, zero ``z``) rotated back by one Hadamard block of
    ``n``: the row is dequantized (``z + float32(sym[soff:soff + n]) * s``, a multiply then an
    add), put through :func:`~.transforms.butterflies`, multiplied by ``sgc[hoff:hoff + n]``
    and stored into ``out[ooff:]`` (:func:`store16`), all in registers.

    ``sgc`` is the block scale times the signs: the reference multiplies by the scale ``c``,
    then by the sign ``+-1``, and ``fl(fl(y c) s) = fl(y (c s))`` because rounding to nearest
    even is symmetric in sign, so one multiply gives the same floats.

    The bfloat16 conversion is unchecked (:func:`_store16_rows`): every value is zero or at
    least ``2**-29`` in magnitude, never subnormal. ``s`` and ``z`` are float16 values (or
    ``z = s * -(2**bits - 1) / 2``), multiples of ``2**-25``; so are their sums and roundings
    in float32, and the butterflies' sums; the block scale ``c >= 1/16``. A NaN or inf scale
    or zero comes only from a stream that the decoder refuses (``BAD_META``), whatever was
    written; finite ones give finite rows (``|value| <= 65504 * 256 * 256``)."""
    nv = n // 16

    @intrinsic
    def _deq_rotated(typingctx, sym, soff, s, z, sgc, hoff, out, ooff):
        if not (isinstance(sym, types.Array) and sym.dtype == types.uint8 and _deq_out_ok(out)):
            return None
        sig = types.void(sym, soff, s, z, sgc, hoff, out, ooff)

        def codegen(context, builder, signature, args):
            sa = signature.args
            f32, u8, i64 = ir.FloatType(), ir.IntType(8), ir.IntType(64)
            vt = ir.VectorType(f32, 16)
            sv, zv = (splat16(builder, context.cast(builder, args[i], sa[i], types.float32)) for i in (2, 3))
            so, ho, oo = (context.cast(builder, args[i], sa[i], types.int64) for i in (1, 5, 7))
            vs = []
            for k in range(nv):
                u = load_lanes(context, builder, sa[0], args[0], types.int64, builder.add(so, ir.Constant(i64, 16 * k)), u8)
                vs.append(builder.fadd(zv, builder.fmul(builder.uitofp(u, vt), sv)))
            vs = [builder.fmul(v, load_lanes(context, builder, sa[4], args[4], types.int64,
                                             builder.add(ho, ir.Constant(i64, 16 * k)), f32))
                  for k, v in enumerate(butterflies(builder, vs, 16))]
            offs = [builder.add(oo, ir.Constant(i64, 16 * k)) for k in range(nv)]
            _store16_rows(context, builder, vs, sa[6], args[6], offs, checked=False)
            return context.get_dummy_value()

        return sig, codegen

    return _deq_rotated


_dr16, _dr32, _dr64, _dr128, _dr256 = (_make_deq_rotated(n) for n in (16, 32, 64, 128, 256))


@njit(**INLINE)
def _deq_rotated_row(sf, src, s, z, sgc, hoff, of, dst, d_n):
    """Dispatch one row of ``d_n`` channels (a power of two in 16..256) to its
    :func:`_make_deq_rotated` intrinsic."""
    if d_n == 64:
        _dr64(sf, src, s, z, sgc, hoff, of, dst)
    elif d_n == 128:
        _dr128(sf, src, s, z, sgc, hoff, of, dst)
    elif d_n == 256:
        _dr256(sf, src, s, z, sgc, hoff, of, dst)
    elif d_n == 32:
        _dr32(sf, src, s, z, sgc, hoff, of, dst)
    else:
        _dr16(sf, src, s, z, sgc, hoff, of, dst)


@njit(**INLINE)
def _whole_row_block(blocks, d_n):
    """Whether a rotation is one Hadamard block over the whole row of ``d_n`` channels
    (16..256): the in-register rows of :func:`_make_load_rotated` and
    :func:`_make_deq_rotated`."""
    return blocks.shape[0] == 1 and blocks[0] == d_n and 16 <= d_n <= 256


@njit(**INLINE)
def _one_block(blocks, d_n, ng, kind):
    """Whether rows are one group, their rotation :func:`_whole_row_block` and the output
    float32 or bfloat16: :func:`_make_deq_rotated`'s case (QuaRot's KV cache: one group per
    head)."""
    return ng == 1 and _whole_row_block(blocks, d_n) and kind != 2


@njit(**INLINE)
def _deq_rotated_rows(sf, scf, zf, bits, symmetric, nb, heads, tokens, nh, nt, d_n, of, signs, c):
    """:func:`_dequantize_rotated` for :func:`_one_block` rows: every row in registers
    (:func:`_make_deq_rotated`), from its symbols to its output."""
    sgc = np.empty(signs.shape[0], np.float32)
    for i in range(signs.shape[0]):
        sgc[i] = signs[i] * c
    r = 0
    for b in range(nb):
        for hi in range(heads.shape[0]):
            hoff = _u(heads[hi] * d_n)
            for ti in range(tokens.shape[0]):
                s, z = _sz(scf[r], zf[r] if not symmetric else 0, bits, symmetric)
                dst = _u(((b * nh + heads[hi]) * nt + tokens[ti]) * d_n)
                _deq_rotated_row(sf, _u(r * d_n), s, z, sgc, hoff, of, dst, d_n)
                r += 1


@njit(**INLINE)
def _dequantize_rotated(sym, scale, zero, g, bits, symmetric, heads, tokens, out, kind, rot):
    """:func:`dequantize_per_token` with ``rot`` for groups of 16k channels tiling the rows,
    in blocks of :data:`_ROWS` rows: dequantized into a float32 block, each row rotated back,
    the block converted into ``out`` (one pass when its rows are one run of ``out``). Rows of
    a block are independent, so their work overlaps (a single row buffer measured 1.7x slower:
    each row's rotation waited for the previous row's stores). Rows of one group rotated by
    one block (:func:`_one_block`, QuaRot's) skip the block: each row goes from its symbols to
    its output in registers (:func:`_deq_rotated_rows`): 29.6 -> 24.0-25.2 us per
    default-model tensor into bfloat16, 39.3 -> 20.7-22.1 into float32 (one thread)."""
    nb, hs, ts, d_n = sym.shape
    nh, nt = out.shape[1], out.shape[2]
    sf, scf, zf, of = sym.reshape(-1), scale.reshape(-1), zero.reshape(-1), out.reshape(-1)
    ng = scale.shape[3]
    ug = _u(g)
    signs, blocks, bscales = rot
    if _one_block(blocks, d_n, ng, kind):
        _deq_rotated_rows(sf, scf, zf, bits, symmetric, nb, heads, tokens, nh, nt, d_n, of, signs, bscales[0])
        return
    blk = np.empty(_ROWS * d_n, np.float32)
    dst = np.empty(_ROWS, np.int64)
    head = np.empty(_ROWS, np.int64)
    run = consecutive(tokens)
    pos = (0, 0, 0)
    nrows = nb * hs * ts
    for r0 in range(0, nrows, _ROWS):
        nr = min(_ROWS, nrows - r0)
        pos, contiguous = _block_rows(pos, nr, heads, tokens, run, nh, nt, d_n, dst, head)
        base = _u(r0 * d_n)
        for i in range(_u(nr * ng)):
            m = _u(r0 * ng) + i
            s, z = _sz(scf[m], zf[m] if not symmetric else 0, bits, symmetric)
            for d in range(i * ug, i * ug + ug, U16):
                _vdeq16(sf, base + d, s, z, blk, d)
        for r in range(nr):
            rotate_row(blk, _u(r * d_n), signs, _u(head[r] * d_n), blocks, bscales, True)
        store_rows(blk, dst, nr, d_n, contiguous, of, kind)


@njit(**JIT)
def dequantize_per_token(sym, scale, zero, g, bits, symmetric, heads, tokens, out, kind, rot=None):
    """``out[:, heads][:, :, tokens] = zero + sym * scale``, per-token groups.

    Reference: :meth:`kvtune.codecs.quantizers.UniformQuantizer.dequantize_block`
    (:func:`~kvtune.codecs.quantizers.dequantize_affine`: a multiply, then an add), then the
    conversion to the output dtype.

    Args:
        sym: uint8 ``(B, Hs, Ts, D)``; scale, zero: uint16 float16 bits ``(B, Hs, Ts, G)``.
        out: ``(B, H, T, D)`` float32, or uint16 bits of ``kind`` (1 bfloat16, 2 float16),
            written at the segment's heads and tokens.
        rot: ``None``, or a rotation as :func:`quantize_per_token`'s, undone on each float32
            row (:func:`~.transforms.hadamard_rows` with ``inverse``) before its conversion.
    """
    nb, hs, ts, d_n = sym.shape
    nh, nt = out.shape[1], out.shape[2]
    sf, scf, zf, of = sym.reshape(-1), scale.reshape(-1), zero.reshape(-1), out.reshape(-1)
    ng = scale.shape[3]
    dn = _u(d_n)
    row = np.empty(d_n, np.float32)
    vec = g % 16 == 0 and d_n % g == 0  # whole 16-lane chunks
    if vec and rot is not None:
        _dequantize_rotated(sym, scale, zero, g, bits, symmetric, heads, tokens, out, kind, rot)
        return
    direct = vec and kind != 2  # into out, converted by the vector code
    r = 0
    for b in range(nb):
        for hi in range(hs):
            for ti in range(ts):
                src = _u(r * d_n)
                if direct:
                    dst = _u(((b * nh + heads[hi]) * nt + tokens[ti]) * d_n)
                    for gi in range(ng):
                        m = _u(r * ng + gi)
                        s, z = _sz(scf[m], zf[m] if not symmetric else 0, bits, symmetric)
                        for d in range(_u(gi * g), _u(gi * g + g), U16):
                            _vdeq16(sf, src + d, s, z, of, dst + d)
                    r += 1
                    continue
                for gi in range(ng):
                    m = _u(r * ng + gi)
                    s, z = _sz(scf[m], zf[m] if not symmetric else 0, bits, symmetric)
                    for d in range(_u(gi * g), _u(min(gi * g + g, d_n))):
                        v = np.float32(sf[src + d]) * s
                        row[d] = z + v
                if rot is not None:
                    signs, blocks, bscales = rot
                    rotate_row(row, _u(0), signs, _u(heads[hi] * d_n), blocks, bscales, True)
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
    vec = kind != 2 and d_n % 16 == 0  # whole 16-lane chunks
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
                    if vec:
                        dst = _u(((b * nh + heads[hi]) * nt + tokens[ti]) * d_n)
                        for d in range(_u(0), dn, U16):
                            _vdeq16v(sf, src + d, ss, zz, d, of, dst + d)
                        continue
                    for d in range(dn):
                        v = np.float32(sf[src + d]) * ss[d]
                        row[d] = zz[d] + v
                    store_row(of, _u(((b * nh + heads[hi]) * nt + tokens[ti]) * d_n), row, dn, kind)
