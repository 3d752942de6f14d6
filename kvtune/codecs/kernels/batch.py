"""Every K and V tensor of a cache in one call per codec thread.

:func:`encode_tensor` and :func:`decode_tensor` (:mod:`.segments`) code one tensor per call;
a 30-layer cache is 60 calls, and each call costs a codec thread a GIL hand-over and numba's
argument unboxing (~10 us together, against ~35 us of work per tensor of the default model).
The batch kernels run the same per-tensor kernels over a table of tensors instead: every thread
of one batch calls the kernel once, and the threads claim the next tensor from a shared atomic
counter (dynamic scheduling: a thread the OS deschedules delays the batch by one tensor at
most). The tensors themselves are separate allocations (a model's KV cache, a serving
engine's KV blocks), reached through their addresses in the table
(:func:`~.lowlevel.address_as_voidptr`); the stream is one uint8 buffer, addressed by offsets.

Tables are int64, one row per tensor, columns named by the ``ENC_*`` / ``DEC_*`` constants.

Transforms (``hadamard``, ``delta``, ``affine``; :mod:`.transforms`) run inside the same call: a
tensor is converted into the thread's float32 work array, transformed there in place (its
``affine`` state written into its state section) and encoded from it; a decoded tensor is
dequantized into the work array, transformed back and converted into its output. A lone
``hadamard`` before per-token quantization (QuaRot's KV cache) skips the work array: the
quantizer rotates each block of rows it loads, and the decoder rotates each row back before
converting it (one pass over the tensor each way instead of two). Each tensor's
transforms are rows of an int64 ``(N, transforms, TR_COLUMNS)`` program, named by the ``TR_*``
constants.
"""

from __future__ import annotations

import numba
import numpy as np
from numba import njit, uintp

from .convert import get_u16, put_u16, store_output, to_float32
from .crc import crc32_combine
from .finite import first_nonfinite_f16
from .lowlevel import INLINE, JIT, address_as_voidptr, fetch_add
from .segments import SEG_META, SEG_META_LEN, bad_codebook, decode_tensor, encode_tensor, per_token_only
from .transforms import (affine_fit, affine_rows, delta_load, delta_rows, delta_store, hadamard_load, hadamard_rows,
                         hadamard_store, unrolled)

_u = uintp

ENC_X, ENC_FLOAT32, ENC_B, ENC_H, ENC_T, ENC_D, ENC_SEG, ENC_NSEG, ENC_OUT, ENC_LEN = range(10)
ENC_COLUMNS = 10
"""Encode table columns: the input's address, 1 when it is float32 (else bfloat16 bits), its
shape ``(B, H, T, D)`` (C-contiguous), its first row and row count in the segment table, the
byte offset and length of its sections in the output buffer."""
DEC_IN, DEC_LEN, DEC_B, DEC_H, DEC_T, DEC_D, DEC_SEG, DEC_NSEG, DEC_OUT, DEC_KIND = range(10)
DEC_COLUMNS = 10
"""Decode table columns: the byte offset and length of the tensor's sections in the stream, its
shape ``(B, H, T, D)``, its first row and row count in the segment table, the address of its
C-contiguous output and the output kind (0 float32, 1 bfloat16 bits)."""
TR_KIND, TR_A, TR_B, TR_C = range(4)
TR_COLUMNS = 4
"""Transform program columns: the kind and three parameters. ``hadamard``: the offset of the
tensor's ``(H, D)`` signs in the stacked float32 signs, the offset and count of its blocks in
the stacked int64 block sizes (and float32 block scales); ``delta``: the group size;
``affine``: 1 for an RMS statistic (else absmax), 1 with a shift, the byte offset of its state
in the tensor's sections."""
TR_HADAMARD, TR_DELTA, TR_AFFINE = 0, 1, 2
BAD_STATE, BAD_META, BAD_PAYLOAD, BAD_CODEBOOK = 1, 2, 3, 4
"""Codes of :func:`decode_batch`'s ``bad``: a NaN / inf float16 in a tensor's transform state,
or in its metadata; a NaN / inf bfloat16 value or float8 symbol in a payload; a fitted
codebook that :func:`~.segments.bad_codebook` refuses."""


@njit(**INLINE)
def _affine_state(st16, h, d):
    """``(scale, shift)`` uint16 ``(H, D)`` views of the thread's float16 state scratch."""
    n = h * d
    return st16[:n].reshape((h, d)), st16[n : 2 * n].reshape((h, d))


@njit(**INLINE)
def _rotation(op, signs, blocks, scales, h, d):
    """A ``hadamard`` row's ``(signs (H, D), block sizes, block scales)`` in the stacked arrays."""
    so, bo, nb = op[TR_A], op[TR_B], op[TR_C]
    return signs[so : so + h * d].reshape((h, d)), blocks[bo : bo + nb], scales[bo : bo + nb]


@njit(**INLINE)
def _fused_rotation(ops, blocks, rows):
    """Whether a tensor's transform program ``ops`` is one ``hadamard`` that its per-token
    segments ``rows`` can apply to each block of rows they load (:func:`encode_tensor`'s
    ``rot``), so that no float32 work array is written and read back."""
    if ops.shape[0] != 1 or ops[0, TR_KIND] != TR_HADAMARD:
        return False
    return unrolled(blocks[ops[0, TR_B] : ops[0, TR_B] + ops[0, TR_C]]) and per_token_only(rows)


@njit(**INLINE)
def _flat_rotation(op, signs, blocks, scales, n):
    """A ``hadamard`` row's ``(signs (n = H D,), block sizes, block scales)``, as the kernels'
    ``rot``."""
    so, bo, nb = op[TR_A], op[TR_B], op[TR_C]
    return signs[so : so + n], blocks[bo : bo + nb], scales[bo : bo + nb]


@njit(**INLINE)
def _encode_row(x, limit, rows, idx, out, symbuf, lut8, books, ops, signs, blocks, scales, work, st16):
    """One tensor of :func:`encode_batch`: as it is, with a fused rotation, or transformed in
    the float32 work array first. Returns :func:`encode_tensor`'s ``(magnitude, seen, crc)``."""
    if ops.shape[0] == 0:
        return encode_tensor(x, limit, rows, idx, out, symbuf, lut8, books)
    if _fused_rotation(ops, blocks, rows):
        rot = _flat_rotation(ops[0], signs, blocks, scales, x.shape[1] * x.shape[3])
        return encode_tensor(x, limit, rows, idx, out, symbuf, lut8, books, rot)
    w = work[: x.size].reshape(x.shape)
    _forward(x, w, ops, signs, blocks, scales, out, st16)
    return encode_tensor(w, limit, rows, idx, out, symbuf, lut8, books)


@njit(**INLINE)
def _decode_row(data, rows, idx, luts, lut16, symbuf, books, y, kind, ops, signs, blocks, scales, work, st16):
    """One tensor of :func:`decode_batch` into ``y`` (float32, or uint16 bits of ``kind``): as
    it is, with a fused rotation, or into the float32 work array, its transforms then undone.
    Returns :func:`decode_tensor`'s ``(crc, finite)``."""
    if ops.shape[0] == 0:
        return decode_tensor(data, rows, idx, luts, lut16, symbuf, y, kind, books)
    if _fused_rotation(ops, blocks, rows):
        rot = _flat_rotation(ops[0], signs, blocks, scales, y.shape[1] * y.shape[3])
        return decode_tensor(data, rows, idx, luts, lut16, symbuf, y, kind, books, rot)
    w = work[: y.size].reshape(y.shape)
    crc, finite = decode_tensor(data, rows, idx, luts, lut16, symbuf, w, 0, books)
    _inverse(w, ops, signs, blocks, scales, data, st16, y, kind)
    return crc, finite


@njit(**JIT)
def _forward(x, w, ops, signs, blocks, scales, out, st16):
    """Convert ``x`` into its float32 work array ``w`` and apply its transform program ``ops``
    in order, writing each ``affine`` state (scale, then shift: little-endian float16) into
    ``out`` (a leading ``hadamard`` rotates each row as it is converted,
    :func:`~.transforms.hadamard_load`, a leading ``delta`` codes it, :func:`~.transforms.delta_load`). Reference: :func:`kvtune.codecs.fastpath`
    ``_apply_transforms``."""
    h, d = w.shape[1], w.shape[3]
    first = 1
    if ops[0, TR_KIND] == TR_HADAMARD:
        sg, bl, sc = _rotation(ops[0], signs, blocks, scales, h, d)
        hadamard_load(x, w, sg, bl, sc)
    elif ops[0, TR_KIND] == TR_DELTA:
        delta_load(x, w, ops[0, TR_A])
    else:
        first = 0
        to_float32(x, w)
    for k in range(first, ops.shape[0]):
        kind = ops[k, TR_KIND]
        if kind == TR_HADAMARD:
            sg, bl, sc = _rotation(ops[k], signs, blocks, scales, h, d)
            hadamard_rows(w, sg, bl, sc, False)
        elif kind == TR_DELTA:
            delta_rows(w, ops[k, TR_A], False)
        else:
            shift = ops[k, TR_B] != 0
            sc, sh = _affine_state(st16, h, d)
            affine_fit(w, ops[k, TR_A] != 0, shift, sc, sh)
            affine_rows(w, sc, sh, shift, False)
            put_u16(st16, (2 if shift else 1) * h * d, out, _u(ops[k, TR_C]))


@njit(**JIT)
def _inverse(w, ops, signs, blocks, scales, data, st16, y, kind):
    """Undo a tensor's transform program ``ops`` (last first) on its float32 decode ``w``, each
    ``affine`` reading its state from ``data``, and convert it into ``y`` (float32, or uint16
    bits of ``kind``; a leading ``hadamard`` rotates each row back as it is stored,
    :func:`~.transforms.hadamard_store`, a leading ``delta`` is undone as it is stored,
    :func:`~.transforms.delta_store`). Reference: :func:`kvtune.codecs.fastpath`
    ``_invert_transforms``, then the conversion."""
    h, d = w.shape[1], w.shape[3]
    last = 1 if ops[0, TR_KIND] == TR_HADAMARD or ops[0, TR_KIND] == TR_DELTA else 0
    for k in range(ops.shape[0] - 1, last - 1, -1):
        op = ops[k, TR_KIND]
        if op == TR_HADAMARD:
            sg, bl, sc = _rotation(ops[k], signs, blocks, scales, h, d)
            hadamard_rows(w, sg, bl, sc, True)
        elif op == TR_DELTA:
            delta_rows(w, ops[k, TR_A], True)
        else:
            shift = ops[k, TR_B] != 0
            get_u16(data, _u(ops[k, TR_C]), (2 if shift else 1) * h * d, st16)
            sc, sh = _affine_state(st16, h, d)
            affine_rows(w, sc, sh if shift else sc, shift, True)
    if ops[0, TR_KIND] == TR_HADAMARD:
        sg, bl, sc = _rotation(ops[0], signs, blocks, scales, h, d)
        hadamard_store(w, sg, bl, sc, kind, y)
    elif ops[0, TR_KIND] == TR_DELTA:
        delta_store(w, ops[0, TR_A], kind, y)
    else:
        store_output(w, kind, y)


@njit(**JIT)
def encode_batch(table, limits, segs, idx, buf, symbuf, lut8, books, results, counter, ops, signs, blocks, scales,
                 work, st16):
    """:func:`encode_tensor` of every row of ``table`` not yet claimed from ``counter``, after
    its transforms.

    Reference: for each row ``i``, ``encode_tensor(x_i, limits[i], segs[rows_i], idx,
    buf[out_i : out_i + len_i], symbuf, lut8, books)``; with transforms (``ops[i]`` not empty),
    ``x_i`` is first converted to float32 and transformed in order
    (:func:`~.transforms.hadamard_rows`, :func:`~.transforms.delta_rows`,
    :func:`~.transforms.affine_fit` then :func:`~.transforms.affine_rows`, whose state is
    written into the tensor's sections before its CRC is taken), as the fast path's per-tensor
    route does.

    Args:
        table: int64 ``(N, ENC_COLUMNS)``; every input stays alive and unchanged during the call.
        limits: float64 ``(N,)``: each tensor's ``limit`` (as :func:`encode_tensor`).
        segs: int64 segment tables of all tensors, stacked (each tensor's head and token offsets
            index ``idx``); idx: int64 indices of all of them.
        buf: uint8 output; the rows' ranges do not overlap.
        symbuf: uint8 scratch of at least the largest segment's element count, this thread's own.
        lut8, books: as :func:`encode_tensor`.
        results: int64 ``(N, 3)``: row ``i`` gets ``(magnitude, seen, crc)`` of
            :func:`encode_tensor`.
        counter: int64 ``(1,)``, 0 before the first thread of the batch starts; threads calling
            with the same counter share the rows.
        ops: int64 ``(N, transforms, TR_COLUMNS)`` transform programs (``(N, 0, TR_COLUMNS)``:
            none); signs: float32 stacked Hadamard signs; blocks: int64 stacked block sizes;
            scales: float32 their scales.
        work: float32 scratch of at least the largest transformed tensor's element count, and
            st16: uint16 scratch of ``2 H D`` elements, both this thread's own.

    With transforms, ``magnitude`` (and the limit check) is that of the transformed tensor: a
    NaN / inf input makes it non-finite too. A lone ``hadamard`` before per-token segments is
    fused into their row loads (:func:`_fused_rotation`; the same bytes): ``magnitude`` is
    then the input's and the limit check that of its bound after the rotation
    (:func:`encode_tensor`'s ``rot``).
    """
    n = table.shape[0]
    while True:
        i = fetch_add(counter, 1)
        if i >= n:
            return
        shape = (table[i, ENC_B], table[i, ENC_H], table[i, ENC_T], table[i, ENC_D])
        rows = segs[table[i, ENC_SEG] : table[i, ENC_SEG] + table[i, ENC_NSEG]]
        out = buf[table[i, ENC_OUT] : table[i, ENC_OUT] + table[i, ENC_LEN]]
        if table[i, ENC_FLOAT32]:
            x32 = numba.carray(address_as_voidptr(table[i, ENC_X]), shape, np.float32)
            bits, seen, crc = _encode_row(x32, limits[i], rows, idx, out, symbuf, lut8, books, ops[i], signs, blocks,
                                          scales, work, st16)
        else:
            x16 = numba.carray(address_as_voidptr(table[i, ENC_X]), shape, np.uint16)
            bits, seen, crc = _encode_row(x16, limits[i], rows, idx, out, symbuf, lut8, books, ops[i], signs, blocks,
                                          scales, work, st16)
        results[i, 0] = bits
        results[i, 1] = seen
        results[i, 2] = crc


@njit(**JIT)
def decode_batch(buf, table, segs, idx, luts, lut16, symbuf, books, crcs, bad, counter, ops, signs, blocks, scales,
                 work, st16):
    """:func:`decode_tensor` (bit-packed sections) of every row of ``table`` not yet claimed
    from ``counter``, its transforms undone, and the check that its float16 transform state
    and metadata are finite.

    Reference: for each row ``i``, ``crcs[i] = decode_tensor(buf[in_i : in_i + len_i],
    segs[rows_i], idx, luts, lut16, symbuf, y_i, kind_i, books)``; with transforms, decoded
    into float32, the transforms undone last first, then converted into ``y_i``
    (:func:`~.convert.store_output`), as the fast path's per-tensor route does. ``bad[i]``:
    :data:`BAD_STATE` when ``first_nonfinite_f16`` finds a NaN / inf in its transform state
    (the first ``state_len`` bytes of ``data_i``), else :data:`BAD_META` when it finds one in
    its segments' metadata sections (``SEG_META``, ``SEG_META_LEN`` of its rows), else
    :data:`BAD_CODEBOOK` when :func:`~.segments.bad_codebook` refuses a fitted codebook of its
    rows (the row was decoded with it: levels are values, never indices), else
    :data:`BAD_PAYLOAD` when a bfloat16 or float8 segment decodes a NaN / inf (:func:`decode_tensor`'s
    ``finite``), else 0.

    Args:
        buf: uint8 stream (read-only is fine); every row's section lengths already checked
            against its segment table.
        table: int64 ``(N, DEC_COLUMNS)``; every output stays alive during the call and no two
            overlap.
        segs, idx: as :func:`encode_batch`.
        luts, lut16, books: as :func:`decode_tensor`; symbuf: as :func:`encode_batch`.
        crcs: int64 ``(N,)``: the CRC-32 of each row's sections.
        bad: uint8 ``(N,)``, as above (a bad row's output holds whatever the NaN / inf made of
            it).
        counter, ops, signs, blocks, scales, work, st16: as :func:`encode_batch`.
    """
    n = table.shape[0]
    while True:
        i = fetch_add(counter, 1)
        if i >= n:
            return
        shape = (table[i, DEC_B], table[i, DEC_H], table[i, DEC_T], table[i, DEC_D])
        rows = segs[table[i, DEC_SEG] : table[i, DEC_SEG] + table[i, DEC_NSEG]]
        data = buf[table[i, DEC_IN] : table[i, DEC_IN] + table[i, DEC_LEN]]
        starts = rows[:, SEG_META]
        bad[i] = BAD_META if first_nonfinite_f16(data, starts, starts + rows[:, SEG_META_LEN]) >= 0 else 0
        if ops.shape[1]:
            if first_nonfinite_f16(data, starts[:1] * 0, starts[:1]) >= 0:  # the state: up to the first metadata
                bad[i] = BAD_STATE
        if table[i, DEC_KIND] == 0:
            y32 = numba.carray(address_as_voidptr(table[i, DEC_OUT]), shape, np.float32)
            crcs[i], finite = _decode_row(data, rows, idx, luts, lut16, symbuf, books, y32, 0, ops[i], signs, blocks,
                                          scales, work, st16)
        else:
            y16 = numba.carray(address_as_voidptr(table[i, DEC_OUT]), shape, np.uint16)
            crcs[i], finite = _decode_row(data, rows, idx, luts, lut16, symbuf, books, y16, table[i, DEC_KIND], ops[i],
                                          signs, blocks, scales, work, st16)
        if bad[i] == 0 and bad_codebook(data, rows):  # in the reference's order: before the payloads
            bad[i] = BAD_CODEBOOK
        if not finite and bad[i] == 0:
            bad[i] = BAD_PAYLOAD


@njit(**JIT)
def crc32_concat(crc, crcs, lengths):
    """CRC-32 of ``A + B_0 + B_1 + ...`` from ``crc = crc(A)``, ``crcs[i] = crc(B_i)`` and
    ``lengths[i] = len(B_i)`` (int64 arrays).

    Reference: ``zlib.crc32`` of the concatenation (a loop of :func:`crc32_combine`)."""
    for i in range(crcs.shape[0]):
        crc = crc32_combine(crc, crcs[i], lengths[i])
    return crc
