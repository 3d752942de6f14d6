"""The invertible transforms applied before quantization, in place on float32 tensors.

Accelerates :mod:`kvtune.codecs.transforms`:

* :func:`hadamard_rows`: the randomized block Walsh-Hadamard rotation that spreads outlier
  channels before quantization, as QuaRot ("QuaRot: Outlier-Free 4-Bit Inference in Rotated
  LLMs", arXiv 2404.00456, sec. 3), with the butterflies unrolled in 16-lane vector registers;
* :func:`delta_rows`: delta coding of tokens against the anchor token of their group, as
  CacheGen ("CacheGen: KV Cache Compression and Streaming for Fast Large Language Model
  Serving", arXiv 2310.07240, sec. 5.1); :func:`delta_load` / :func:`delta_store` fuse it
  with the conversion from the input / into the output;
* :func:`affine_fit` / :func:`affine_rows`: per-(head, channel) normalization by a float16
  scale and shift.
"""

from __future__ import annotations

import math

import numpy as np
from llvmlite import ir
from numba import njit, types, uintp
from numba.core import cgutils
from numba.extending import intrinsic

from .convert import f16_bits_to_f32, f32_to_f16_bits, load_row, load_value, store_row, store_value
from .lowlevel import FP16_MAX, INLINE, JIT, U1, U8, ZERO, v8_ptr

_u = uintp


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
        ptr = v8_ptr(context, builder, signature, args)
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
        pa = v8_ptr(context, builder, signature, args)
        pb = v8_ptr(context, builder, types.void(signature.args[0], signature.args[2]), [args[0], args[2]])
        a = builder.load(pa, align=4)
        b = builder.load(pb, align=4)
        builder.store(builder.fadd(a, b), pa, align=4)
        builder.store(builder.fsub(a, b), pb, align=4)
        return context.get_dummy_value()

    return sig, codegen


def butterflies(builder, vs, lanes):
    """Codegen: the butterfly stages of one Walsh-Hadamard block held in the ``lanes``-lane
    float32 vectors ``vs`` (the block's values in order; ``lanes * len(vs)`` a power of two),
    unnormalized (no ``* 1/sqrt(n)``). Returns the new vectors.

    A stage inside a vector (strides 1, 2, 4, 8) is one shuffle (lane ``i`` takes lane
    ``i ^ stride``) and one ``llvm.fma(v, m, swapped)`` with ``m`` = +1 in the low lane of each
    pair (``a + b``) and -1 in the high one (``a - b``): a product with +-1 is exact, so the
    fused multiply-add rounds once, exactly as the reference's add or subtract. Stages across
    vectors (strides ``lanes``, ``2 * lanes``, ...) are a plain add and subtract."""
    i32 = ir.IntType(32)
    vt = ir.VectorType(ir.FloatType(), lanes)
    fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(vt, [vt, vt, vt]), f"llvm.fma.v{lanes}f32")
    stride = 1
    while stride < lanes:  # inside each vector
        perm = ir.Constant(ir.VectorType(i32, lanes), [ir.Constant(i32, i ^ stride) for i in range(lanes)])
        pm = ir.Constant(vt, [-1.0 if i & stride else 1.0 for i in range(lanes)])
        vs = [builder.call(fma, [v, pm, builder.shuffle_vector(v, v, perm)]) for v in vs]
        stride *= 2
    step, nv = 1, len(vs)
    while step < nv:  # across vectors
        out = list(vs)
        for i in range(nv):
            if not i & step:
                a, b = vs[i], vs[i + step]
                out[i], out[i + step] = builder.fadd(a, b), builder.fsub(a, b)
        vs = out
        step *= 2
    return vs


def _make_wht(n: int, inverse: bool):
    """An intrinsic ``_wht(arr, off, signs, soff, c)``: the whole randomized Hadamard block of
    size ``n`` (8..256) on ``arr[off:off + n]`` held in vector registers of
    ``L = min(n, 16)`` lanes -- forward ``x * signs``, :func:`butterflies`, ``* c``;
    ``inverse``: butterflies, ``* c``, ``* signs`` -- the exact operation sequence of the
    reference, with no loop control."""
    lanes = min(n, 16)
    nv = n // lanes

    @intrinsic
    def _wht(typingctx, arr, off, signs, soff, c):
        if not (isinstance(arr, types.Array) and arr.dtype == types.float32):
            return None
        sig = types.void(arr, off, signs, soff, c)

        def codegen(context, builder, signature, args):
            sa = signature.args
            i32, i64, f32 = ir.IntType(32), ir.IntType(64), ir.FloatType()
            vt = ir.VectorType(f32, lanes)

            def ptr(i, j):
                ary = context.make_array(sa[i])(context, builder, args[i])
                k = context.cast(builder, args[j], sa[j], types.int64)
                return builder.bitcast(builder.gep(ary.data, [k]), vt.as_pointer())

            base, sbase = ptr(0, 1), ptr(2, 3)
            ptrs = [builder.gep(base, [ir.Constant(i64, k)]) for k in range(nv)]
            sptrs = [builder.gep(sbase, [ir.Constant(i64, k)]) for k in range(nv)]
            cf = context.cast(builder, args[4], sa[4], types.float32)
            cv = builder.shuffle_vector(builder.insert_element(ir.Constant(vt, ir.Undefined), cf, ir.Constant(i32, 0)),
                                        ir.Constant(vt, ir.Undefined), ir.Constant(ir.VectorType(i32, lanes), [0] * lanes))
            vs = [builder.load(p, align=4) for p in ptrs]
            if not inverse:
                vs = [builder.fmul(v, builder.load(sp, align=4)) for v, sp in zip(vs, sptrs)]
            vs = [builder.fmul(v, cv) for v in butterflies(builder, vs, lanes)]
            if inverse:
                vs = [builder.fmul(v, builder.load(sp, align=4)) for v, sp in zip(vs, sptrs)]
            for v, p in zip(vs, ptrs):
                builder.store(v, p, align=4)
            return context.get_dummy_value()

        return sig, codegen

    return _wht


_SIZES = (8, 16, 32, 64, 128, 256)
(_f8, _f16, _f32, _f64, _f128, _f256), (_i8, _i16, _i32, _i64, _i128, _i256) = (
    tuple(_make_wht(n, inv) for n in _SIZES) for inv in (False, True))


@njit(**INLINE)
def _wht_block(xf, off, n, sg, so, c, inverse):
    """Dispatch one power-of-two block of size ``n`` in 8..256 to its unrolled intrinsic."""
    if inverse:
        if n == 64:
            _i64(xf, off, sg, so, c)
        elif n == 128:
            _i128(xf, off, sg, so, c)
        elif n == 256:
            _i256(xf, off, sg, so, c)
        elif n == 32:
            _i32(xf, off, sg, so, c)
        elif n == 16:
            _i16(xf, off, sg, so, c)
        else:
            _i8(xf, off, sg, so, c)
    elif n == 64:
        _f64(xf, off, sg, so, c)
    elif n == 128:
        _f128(xf, off, sg, so, c)
    elif n == 256:
        _f256(xf, off, sg, so, c)
    elif n == 32:
        _f32(xf, off, sg, so, c)
    elif n == 16:
        _f16(xf, off, sg, so, c)
    else:
        _f8(xf, off, sg, so, c)


@njit(**INLINE)
def unrolled(blocks):
    """Whether every block size is in 8..256 (each block held in registers, :func:`rotate_row`)."""
    ok = True
    for k in range(blocks.shape[0]):
        ok = ok and 8 <= blocks[k] <= 256
    return ok


@njit(**INLINE)
def rotation_growth(blocks, scales):
    """An upper bound on ``max|rotated x| / max|x|`` for :func:`rotate_row`: a block of ``n``
    sums ``n`` values of magnitude at most ``max|x|``, then scales by ``1/sqrt(n)``, so
    ``max(n * scale)`` over the blocks, with a margin for the float32 roundings of the
    butterflies (at most 9 for a block of 256, each within ``2**-24`` of the sum's magnitude).
    """
    gr = 0.0
    for k in range(blocks.shape[0]):
        gr = max(gr, np.float64(blocks[k]) * np.float64(scales[k]))
    return gr * (1.0 + 2.0**-16)


@njit(**INLINE)
def rotate_row(xf, o, sg, so, blocks, scales, inverse):
    """The rotation of the float32 row ``xf[o:o + D]`` in place, block by block (signs
    ``sg[so:]``), as :func:`hadamard_rows` rotates each row: only for blocks that pass
    :func:`unrolled`. Offsets ``uintp``; in compiled code (an inlined function)."""
    off = _u(0)
    for k in range(blocks.shape[0]):
        _wht_block(xf, o + off, blocks[k], sg, so + off, scales[k], inverse)
        off += _u(blocks[k])


@njit(**JIT)
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
    if unrolled(blocks):  # every block in registers (head_dim 64, 96 = 64 + 32, 128, 256, ...)
        for b in range(nb):
            for h in range(nh):
                for t in range(nt):
                    rotate_row(xf, _u(((b * nh + h) * nt + t) * d_n), sg, _u(h * d_n), blocks, scales, inverse)
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
                    step = U1
                    if n >= U8:  # strides 1, 2, 4 inside every 8 lanes, as vectors
                        for i in range(off, off + n, U8):
                            _wht8(xf, i)
                        step = U8
                    while step < n:
                        i = off
                        while i < off + n:
                            if step >= U8:
                                for j in range(i, i + step, U8):
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


_CHUNK = 32  # rows converted (rotated) per pass of hadamard_load (hadamard_store): 8 KiB at head_dim 64


@njit(**JIT)
def hadamard_load(x, y, signs, blocks, scales):
    """``y = float32(x)`` rotated forward as :func:`hadamard_rows`, :data:`_CHUNK` rows at a
    time: the rows are rotated right after their conversion, while they are in L1 (one pass
    over ``y`` instead of two). Reference: :func:`~kvtune.codecs.kernels.to_float32` then :func:`hadamard_rows`.

    Args:
        x: ``(B, H, T, D)`` float32 or uint16 (bfloat16 bits), C-contiguous.
        y: float32 of the same shape, C-contiguous (not ``x``).
        signs, blocks, scales: as :func:`hadamard_rows`.
    """
    nb, nh, nt, d_n = x.shape
    xf, yf, sg = x.reshape(-1), y.reshape(-1), signs.reshape(-1)
    if not unrolled(blocks):
        load_row(xf, _u(0), yf, _u(0), _u(xf.shape[0]))
        hadamard_rows(y, signs, blocks, scales, False)
        return
    for bh in range(nb * nh):
        so = _u(bh % nh * d_n)
        for r0 in range(bh * nt, bh * nt + nt, _CHUNK):
            r1 = min(r0 + _CHUNK, bh * nt + nt)
            load_row(xf, _u(r0 * d_n), yf, _u(r0 * d_n), _u((r1 - r0) * d_n))
            for r in range(r0, r1):
                rotate_row(yf, _u(r * d_n), sg, so, blocks, scales, False)


@njit(**JIT)
def hadamard_store(y, signs, blocks, scales, kind, out):
    """Rotate float32 ``y`` back in place as :func:`hadamard_rows` (``inverse``) and convert it
    into ``out``, :data:`_CHUNK` rows at a time (stored right after their rotation, while they
    are in L1). Reference: :func:`hadamard_rows` then ``out[...] = y`` (float32 ``out``) or
    :func:`~kvtune.codecs.kernels.store_output` (uint16 ``out`` of ``kind`` 1 bfloat16 or 2
    float16 bits).

    Args:
        y: float32 ``(B, H, T, D)``, C-contiguous, modified.
        signs, blocks, scales: as :func:`hadamard_rows`.
        kind: the output kind (ignored for float32 ``out``).
        out: float32 or uint16 of ``y``'s shape, C-contiguous (not ``y``).
    """
    nb, nh, nt, d_n = y.shape
    yf, of, sg = y.reshape(-1), out.reshape(-1), signs.reshape(-1)
    if not unrolled(blocks):
        hadamard_rows(y, signs, blocks, scales, True)
        store_row(of, _u(0), yf, _u(yf.shape[0]), kind)
        return
    for bh in range(nb * nh):
        so = _u(bh % nh * d_n)
        for r0 in range(bh * nt, bh * nt + nt, _CHUNK):
            r1 = min(r0 + _CHUNK, bh * nt + nt)
            for r in range(r0, r1):
                rotate_row(yf, _u(r * d_n), sg, so, blocks, scales, True)
            store_row(of, _u(r0 * d_n), yf[r0 * d_n : r1 * d_n], _u((r1 - r0) * d_n), kind)


@njit(**JIT)
def delta_rows(x, g, inverse):
    """In-place delta coding along tokens in groups of ``g`` (anchors unchanged).

    Forward ``x[t] -= x[anchor(t)]``; inverse ``x[t] += x[anchor(t)]``. Each anchor row is
    copied to a row of its own first: loops that read and write the same array do not
    vectorize (~49 against ~12 us for a ``(1, 3, 1024, 64)`` tensor, 2026-12-03). Not
    :func:`delta_load` / :func:`delta_store` with ``x`` passed twice, which give the same
    values: with two array arguments that may alias, their loops stay scalar (~50 us).
    Reference: :func:`kvtune.codecs.transforms.delta_encode` / :func:`~kvtune.codecs.transforms.delta_decode`.
    """
    nb, nh, nt, d_n = x.shape
    xf = x.reshape(-1)
    dn = _u(d_n)
    anchor = np.empty(d_n, np.float32)
    for bh in range(nb * nh):
        for t in range(nt):
            o = _u((bh * nt + t) * d_n)
            if t % g == 0:
                for d in range(dn):
                    anchor[d] = xf[o + d]
            elif inverse:
                for d in range(dn):
                    xf[o + d] = xf[o + d] + anchor[d]
            else:
                for d in range(dn):
                    xf[o + d] = xf[o + d] - anchor[d]


@njit(**JIT)
def delta_load(x, y, g):
    """``y = float32(x)`` delta coded as :func:`delta_rows` (forward), in one pass: each group's
    anchor row, converted, is kept in a row of its own that the group's other rows subtract
    (~11 us for a ``(1, 3, 1024, 64)`` bfloat16 tensor against ~58 us for the conversion then
    :func:`delta_rows`, whose in-place loops do not vectorize; 2026-12-03). ``x``: float32 or
    bfloat16 bits, C-contiguous, the shape of float32 ``y``. Reference:
    :func:`~kvtune.codecs.kernels.to_float32` then :func:`delta_rows` (the same float32
    subtractions: a bfloat16 to float32 conversion is exact)."""
    nb, nh, nt, d_n = y.shape
    xf, yf = x.reshape(-1), y.reshape(-1)
    dn = _u(d_n)
    anchor = np.empty(d_n, np.float32)
    for bh in range(nb * nh):
        for t in range(nt):
            o = _u((bh * nt + t) * d_n)
            if t % g == 0:
                for d in range(dn):
                    v = load_value(xf, o + d)
                    anchor[d] = v
                    yf[o + d] = v
            else:
                for d in range(dn):
                    yf[o + d] = load_value(xf, o + d) - anchor[d]


@njit(**JIT)
def delta_store(y, g, kind, out):
    """Undo :func:`delta_rows` on float32 ``y`` while converting it into ``out`` (float32, or
    uint16 bits of ``kind``: 1 bfloat16, 2 float16 as :func:`~kvtune.codecs.kernels.store_output`),
    in one pass, ``y`` left as it is (~15 us for a ``(1, 3, 1024, 64)`` tensor against ~58 us
    for the two passes; 2026-12-03). Reference: :func:`delta_rows` (inverse) then
    :func:`~kvtune.codecs.kernels.store_output` (the same float32 additions and roundings)."""
    nb, nh, nt, d_n = y.shape
    yf, of = y.reshape(-1), out.reshape(-1)
    dn = _u(d_n)
    for bh in range(nb * nh):
        for t in range(nt):
            o = _u((bh * nt + t) * d_n)
            ao = _u((bh * nt + t // g * g) * d_n)
            if ao == o:
                for d in range(dn):
                    store_value(of, o + d, yf[o + d], kind)
            else:
                for d in range(dn):
                    store_value(of, o + d, yf[o + d] + yf[ao + d], kind)


@njit(**JIT)
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
                if m > FP16_MAX:
                    m = FP16_MAX
                if m < -FP16_MAX:
                    m = -FP16_MAX
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
            if st > FP16_MAX:
                st = FP16_MAX
            s16 = f32_to_f16_bits(st)
            sv = f16_bits_to_f32(s16)
            if not (sv > ZERO and sv < np.inf):
                s16 = np.int64(0x3C00)  # 1.0
            scale16[h, d] = s16


@njit(**JIT)
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
