"""Every segment of one K or V tensor quantized and rANS-coded in one call: the fast path's
per-tensor entry for policies of block quantizers with the ``rans`` codec (CacheGen's models,
arXiv 2310.07240, sec. 5.2, coded with the interleaved rANS of :mod:`.rans`).

:func:`rans_encode_tensor` runs, without the GIL, what the fast path did with one call per step
and per segment: the segments' quantization (:func:`.segments.encode_segments`, symbols left in
a scratch buffer), each segment's rANS payload as :meth:`kvtune.codecs.rans.RansCodec.pack`
writes it (:func:`.rans.rans_encode_bytes`; stored raw, kind 0, when that is not smaller, and
always for bfloat16 segments), and the CRC-32 of the tensor's sections in wire order. The
per-segment arguments come stacked in a :class:`kvtune.codecs.rans.RansProgram` (rows of
:data:`PR_COLUMNS` columns, indexed by the ``PR_*`` constants), built once per tensor plan.
"""

from __future__ import annotations

import numpy as np
from numba import njit, uintp

from .bitpack import pack_bits, unpack_bits
from .crc import crc32_update
from .lowlevel import INLINE, JIT
from .rans import header_crc_seed, rans_decode_payload, rans_encode_bytes
from .segments import SEG_META, SEG_META_LEN, encode_segments

(PR_BITS, PR_COUNT, PR_SYM, PR_M, PR_CDIV, PR_CMOD, PR_GROUPS, PR_CODER, PR_CG, PR_CG_ROWS, PR_CP, PR_DIMS,
 PR_NDIMS, PR_FORMS, PR_NFORMS, PR_RAW, PR_PAY) = range(17)
"""Columns of a program row: the segment's bits (16: stored raw), symbol count, symbol offset in
the scratch buffer; the layout's fusion ``m`` (0: stored raw, its table would be too large),
symbol-group ``(div, mod)`` and groups; the offsets in the pool of the coder's four ``(div,
mod)`` values, of the per-group fused-model table (and its rows), of the pooled one, of the
layout dims (and their count) and of the candidate table forms (their steps, pooled flags and
form bytes, ``PR_NFORMS`` each); the raw payload's size; the payload's offset in the payload
buffer."""
PR_COLUMNS = 17
"""Columns of a program row."""


@njit(**INLINE)
def _copy(src, a, dst, b, n):
    """``dst[b:b + n] = src[a:a + n]`` (uint8) on ``uintp`` indices, which LLVM vectorizes
    (signed indices keep a wraparound test in the loop)."""
    ua, ub = uintp(a), uintp(b)
    for i in range(uintp(n)):
        dst[ub + i] = src[ua + i]


@njit(**JIT)
def rans_pack_segments(symbuf, rows, pool, neg_grid, grid16, max_level, weight_bits, prec, table_lane_run, lane_run,
                       kind, per_byte, pay, lengths):
    """Each segment's payload, as :meth:`kvtune.codecs.rans.RansCodec.pack` writes it, at the
    row's ``PR_PAY`` offset of uint8 ``pay``; its length in ``lengths[s]``.

    Reference: per row, ``RansCodec(model).pack(symbols, bits)`` of the row's symbols in
    ``symbuf`` (uint8; bits 16: little-endian uint16 bytes), with the arguments of
    :func:`kvtune.codecs.rans.encode_rans` (``rows``, ``pool`` and the constants:
    :func:`kvtune.codecs.rans.tensor_program`).

    Returns:
        0, or ``s + 1`` when row ``s`` holds a symbol of ``2**bits`` or more (nothing is
        written for it or after it).
    """
    for s in range(rows.shape[0]):
        bits, count, so = rows[s, PR_BITS], rows[s, PR_COUNT], rows[s, PR_SYM]
        at, raw, m = rows[s, PR_PAY], rows[s, PR_RAW], rows[s, PR_M]
        if bits == 16 or count == 0:  # stored raw: the kind byte, then the little-endian words
            pay[at] = 0
            _copy(symbuf, so, pay, at + 1, raw - 1)
            lengths[s] = raw
            continue
        flat = symbuf[so : so + count]
        n = raw
        if m > 0:
            nq, f, nf = rows[s, PR_CG_ROWS], rows[s, PR_FORMS], rows[s, PR_NFORMS]
            comp_group = pool[rows[s, PR_CG] : rows[s, PR_CG] + nq * m].copy().reshape((nq, m))
            comp_pooled = pool[rows[s, PR_CP] : rows[s, PR_CP] + m].copy().reshape((1, m))
            top, payload = rans_encode_bytes(flat, bits, m, rows[s, PR_CDIV], rows[s, PR_CMOD], rows[s, PR_GROUPS],
                                             pool[rows[s, PR_CODER] : rows[s, PR_CODER] + 4].copy(), comp_group,
                                             comp_pooled, neg_grid, grid16, pool[f : f + nf].copy(),
                                             pool[f + nf : f + 2 * nf].copy(), pool[f + 2 * nf : f + 3 * nf].copy(),
                                             max_level, weight_bits, prec, table_lane_run, lane_run, kind,
                                             pool[rows[s, PR_DIMS] : rows[s, PR_DIMS] + rows[s, PR_NDIMS]].copy(),
                                             True, per_byte)
            if top >> bits:
                return s + 1
            n = payload.shape[0]
            if n < raw:
                _copy(payload, 0, pay, at, n)
        if n >= raw:  # rANS is not smaller, or its table is too large: raw, as bitpack
            if pack_bits(flat, bits, pay[at + 1 : at + raw]) >> bits:
                return s + 1
            pay[at] = 0
            n = raw
        lengths[s] = n
    return 0


@njit(**JIT)
def rans_encode_tensor(x, segs, idx, out, symbuf, lut8, books, state_nbytes, rows, pool, neg_grid, grid16, max_level,
                       weight_bits, prec, table_lane_run, lane_run, kind, per_byte, pay, lengths):
    """Quantize every segment of one tensor and rANS-code its symbols, in one call.

    Reference: :func:`.segments.encode_segments` without packing (metadata into ``out`` at the
    segment table's offsets, symbols into ``symbuf``), then :func:`rans_pack_segments`, then
    ``zlib.crc32`` of the sections in wire order: ``out[:state_nbytes]``, then per segment its
    metadata ``out[SEG_META:SEG_META + SEG_META_LEN]`` and its payload.

    Args:
        x, segs, idx, out, symbuf, lut8, books: as :func:`.segments.encode_segments`.
        state_nbytes: bytes of the transform state at the start of ``out``.
        rows .. per_byte: the :class:`kvtune.codecs.rans.RansProgram` of the plan.
        pay: uint8 payload buffer (the program's ``payload_nbytes``); lengths: int64 ``(S,)``,
            out: the payloads' lengths.

    Returns:
        ``(status, crc)``: status as :func:`rans_pack_segments` (the CRC is then 0).
    """
    encode_segments(x, segs, idx, out, symbuf, False, lut8, books)
    status = rans_pack_segments(symbuf, rows, pool, neg_grid, grid16, max_level, weight_bits, prec, table_lane_run,
                                lane_run, kind, per_byte, pay, lengths)
    if status:
        return status, np.int64(0)
    crc = crc32_update(0, out[:state_nbytes])
    for s in range(segs.shape[0]):
        a = segs[s, SEG_META]
        crc = crc32_update(crc, out[a : a + segs[s, SEG_META_LEN]])
        b = rows[s, PR_PAY]
        crc = crc32_update(crc, pay[b : b + lengths[s]])
    return status, np.int64(crc)


(LIM_MAX_LEVEL, LIM_WEIGHT_BITS, LIM_PREC, LIM_MAX_RESIDUAL, LIM_MAX_TABLE_ENTRIES, LIM_MAX_TABLE_MODELS, LIM_PER_BYTE,
 LIM_LANE_RUN, LIM_NO_LANE_RUN, LIM_STEPS) = range(10)
"""Indices of the decoder's int64 ``limits`` (:class:`kvtune.codecs.rans.RansProgram`): the
largest level code, the weight bits, the probability bits, the largest table residual, the most
table entries and per-group fused models, symbols per byte, the two lane runs, then the four
table steps (levels per octave)."""
KIND_RAW, KIND_RANS_V1, KIND_RANS_V2, KIND_RANS_V3, KIND_RANS = 0, 3, 4, 5, 6
"""Payload kind bytes (:mod:`kvtune.codecs.rans`)."""


@njit(**INLINE)
def _u32(buf, at):
    """The little-endian u32 at ``buf[at]``."""
    return (np.int64(buf[at]) | np.int64(buf[at + 1]) << 8 | np.int64(buf[at + 2]) << 16
            | np.int64(buf[at + 3]) << 24)


@njit(**JIT)
def rans_unpack_payload(buf, bits, count, model_id, dims, limits, grid16, out):
    """Decode one ``rans`` payload (the kind byte included) into uint8 ``out``: ``count``
    symbols, or ``2 * count`` little-endian bytes for 16-bit symbols; whether the codec accepts
    it. Accepts exactly what :meth:`kvtune.codecs.rans.RansCodec.unpack_into` accepts for
    symbols of a tensor whose layout dims are ``dims`` (its checks of
    :func:`kvtune.codecs.rans.decode_rans`, then :func:`.rans.rans_decode_payload`), so a caller
    can leave the error message to it; a refused payload leaves ``out`` garbage.

    Args:
        buf: uint8 payload; bits: 1..8 or 16; model_id: index of the codec's model in
            :data:`kvtune.codecs.range_coder.MODELS` (0 global, 1 per_head, 2 per_channel).
        dims: int64 layout dims the tensor's shape gives (:func:`kvtune.codecs.rans.layout_for_shape`).
        limits: int64, indexed by the ``LIM_*`` constants; grid16: as :func:`.rans.rans_level_weights`.
    """
    n = buf.shape[0]
    if n < 1:
        return False
    kind = buf[0]
    if kind == KIND_RAW or bits == 16:
        need = 2 * count if bits == 16 else (count * bits + 7) // 8
        if kind != KIND_RAW or n - 1 != need:
            return False
        if bits == 16:
            _copy(buf, 1, out, 0, need)
        else:
            unpack_bits(buf[1:], bits, out[:count])
        return True
    if count > limits[LIM_PER_BYTE] * n or n < 3 or count == 0:
        return False
    if kind != KIND_RANS and kind != KIND_RANS_V3 and kind != KIND_RANS_V2:
        return False
    form, m = np.int64(buf[1]), np.int64(buf[2])
    table_run, run = limits[LIM_LANE_RUN], limits[LIM_LANE_RUN]
    if kind == KIND_RANS_V2:
        table_run, run = limits[LIM_NO_LANE_RUN], limits[LIM_NO_LANE_RUN]
    elif kind == KIND_RANS:
        run = 0 if form & 32 else limits[LIM_NO_LANE_RUN]
        form &= ~np.int64(32)
    if form >> 5 or (form & 3) != model_id:
        return False
    nd = dims.shape[0]
    at = 3 + 4 * nd
    if at > n:
        return False
    for i in range(nd):
        if _u32(buf, 3 + 4 * i) != dims[i]:
            return False
    groups, grun = np.int64(1), count
    if model_id == 2:
        groups, grun = dims[0], dims[0]
    elif model_id == 1:
        groups, grun = dims[1], count // (dims[0] * dims[1]) if dims[0] * dims[1] else 0
    divisor = np.int64(1)
    for i in range(nd):
        divisor *= dims[i]
    if divisor == 0 or count % divisor or m < 1 or m > max(1, 8 // bits) or grun % m:
        return False
    k = np.int64(1) << bits
    if groups << bits > limits[LIM_MAX_TABLE_ENTRIES]:
        return False
    if at + 2 > n:
        return False
    nhist = (np.int64(buf[at]) | np.int64(buf[at + 1]) << 8) + 1
    at += 2
    if nhist > limits[LIM_MAX_RESIDUAL] + 1 or at + 4 * nhist + 4 > n:
        return False
    hist = np.empty(nhist, np.int64)
    total = np.int64(0)
    for i in range(nhist):
        hist[i] = _u32(buf, at + 4 * i)
        total += hist[i]
    at += 4 * nhist
    if hist[nhist - 1] == 0:
        return False
    nt = _u32(buf, at)
    at += 4
    tw_at = at
    if at + 2 * nt + 4 > n:
        return False
    at += 2 * nt
    if _u32(buf, at) != crc32_update(header_crc_seed(count, bits), buf[:at]):
        return False
    at += 4
    if total > k * (groups + 1) or total < k:
        return False
    pooled = (form & 16) != 0
    coder = np.ones(4, np.int64)
    comp_group = np.zeros((1, m), np.int64)
    if model_id == 2:
        nq = dims[0] // m
        coder[1] = nq
        comp_group = np.empty((nq, m), np.int64)
        for q in range(nq):
            for j in range(m):
                comp_group[q, j] = q * m + j
    elif model_id == 1:
        coder[0], coder[1] = grun // m, dims[1]
        comp_group = np.empty((dims[1], m), np.int64)
        for q in range(dims[1]):
            for j in range(m):
                comp_group[q, j] = q
    if not pooled and coder[1] > limits[LIM_MAX_TABLE_MODELS]:
        return False
    if at + 4 > n:
        return False
    nw = _u32(buf, at)
    at += 4
    w_at = at
    if at + 2 * nw > n:
        return False
    at += 2 * nw
    words_crc = np.int64(-1)
    if kind != KIND_RANS_V2:
        if at + 4 > n:
            return False
        words_crc = _u32(buf, at)
        at += 4
    if at != n:
        return False
    status = rans_decode_payload(buf, tw_at, nt, w_at, nw, words_crc, hist, bits, m, groups,
                                 limits[LIM_STEPS + ((form >> 2) & 3)], pooled, coder, comp_group,
                                 np.zeros((1, m), np.int64), grid16, limits[LIM_MAX_LEVEL], limits[LIM_WEIGHT_BITS],
                                 limits[LIM_PREC], out[:count], table_run, run)
    return status == 0


@njit(**JIT)
def rans_unpack_tensor(data, state_nbytes, segs, plens, rows, pool, model_id, limits, grid16, symbuf):
    """Every ``rans`` payload of one tensor's sections into its symbol buffer, and the CRC-32
    of the sections, in one call.

    Reference: per segment, :meth:`kvtune.codecs.rans.RansCodec.unpack_into` of its payload
    into ``symbuf`` at the segment's ``SEG_SYM`` offset, then ``zlib.crc32(data)``.

    Args:
        data: uint8 sections of the tensor: the state (``state_nbytes``), then per segment its
            metadata (``SEG_META_LEN`` bytes, already checked) and its payload (``plens[s]``).
        segs: the plan's segment table; ``SEG_META`` is set to each metadata's offset in
            ``data`` (for :func:`.segments.decode_segments`).
        rows, pool: the plan's :class:`kvtune.codecs.rans.RansProgram` rows and pool (bits,
            count, symbol offset, layout dims).
        model_id, limits, grid16: as :func:`rans_unpack_payload`.

    Returns:
        ``(status, crc)``: status 0, or ``s + 1`` for the first segment whose payload the codec
        refuses (nothing after it is decoded).
    """
    crc = np.int64(crc32_update(0, data))
    pos = np.int64(state_nbytes)
    for s in range(segs.shape[0]):
        segs[s, SEG_META] = pos
        a = pos + segs[s, SEG_META_LEN]
        pos = a + plens[s]
        bits, count, so = rows[s, PR_BITS], rows[s, PR_COUNT], rows[s, PR_SYM]
        dims = pool[rows[s, PR_DIMS] : rows[s, PR_DIMS] + rows[s, PR_NDIMS]]
        if not rans_unpack_payload(data[a:pos], bits, count, model_id, dims, limits, grid16,
                                   symbuf[so : so + (2 * count if bits == 16 else count)]):
            return np.int64(s + 1), crc
    return np.int64(0), crc
