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
"""

from __future__ import annotations

import numba
import numpy as np
from numba import njit

from .crc import crc32_combine
from .finite import first_nonfinite_f16
from .lowlevel import JIT, address_as_voidptr, fetch_add
from .segments import SEG_META, SEG_META_LEN, decode_tensor, encode_tensor

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


@njit(**JIT)
def encode_batch(table, limits, segs, idx, buf, symbuf, lut8, books, results, counter):
    """:func:`encode_tensor` of every row of ``table`` not yet claimed from ``counter``.

    Reference: for each row ``i``, ``encode_tensor(x_i, limits[i], segs[rows_i], idx,
    buf[out_i : out_i + len_i], symbuf, lut8, books)``.

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
            bits, seen, crc = encode_tensor(x32, limits[i], rows, idx, out, symbuf, lut8, books)
        else:
            x16 = numba.carray(address_as_voidptr(table[i, ENC_X]), shape, np.uint16)
            bits, seen, crc = encode_tensor(x16, limits[i], rows, idx, out, symbuf, lut8, books)
        results[i, 0] = bits
        results[i, 1] = seen
        results[i, 2] = crc


@njit(**JIT)
def decode_batch(buf, table, segs, idx, luts, lut16, symbuf, books, crcs, finite, counter):
    """:func:`decode_tensor` (bit-packed sections) of every row of ``table`` not yet claimed
    from ``counter``, and the check that its float16 metadata is finite.

    Reference: for each row ``i``, ``crcs[i] = decode_tensor(buf[in_i : in_i + len_i],
    segs[rows_i], idx, luts, lut16, symbuf, y_i, kind_i, books)`` and ``finite[i] =
    first_nonfinite_f16(data_i, meta starts, meta ends) < 0`` over its segments' metadata
    sections (``SEG_META``, ``SEG_META_LEN`` of its rows, in ``data_i``).

    Args:
        buf: uint8 stream (read-only is fine); every row's section lengths already checked
            against its segment table.
        table: int64 ``(N, DEC_COLUMNS)``; every output stays alive during the call and no two
            overlap.
        segs, idx: as :func:`encode_batch`.
        luts, lut16, books: as :func:`decode_tensor`; symbuf: as :func:`encode_batch`.
        crcs: int64 ``(N,)``: the CRC-32 of each row's sections.
        finite: uint8 ``(N,)``: 1 when every float16 of the row's metadata is finite, else 0
            (its output then holds whatever the NaN / inf scales made of it).
        counter: as :func:`encode_batch`.
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
        finite[i] = first_nonfinite_f16(data, starts, starts + rows[:, SEG_META_LEN]) < 0
        if table[i, DEC_KIND] == 0:
            y32 = numba.carray(address_as_voidptr(table[i, DEC_OUT]), shape, np.float32)
            crcs[i] = decode_tensor(data, rows, idx, luts, lut16, symbuf, y32, 0, books)
        else:
            y16 = numba.carray(address_as_voidptr(table[i, DEC_OUT]), shape, np.uint16)
            crcs[i] = decode_tensor(data, rows, idx, luts, lut16, symbuf, y16, table[i, DEC_KIND], books)


@njit(**JIT)
def crc32_concat(crc, crcs, lengths):
    """CRC-32 of ``A + B_0 + B_1 + ...`` from ``crc = crc(A)``, ``crcs[i] = crc(B_i)`` and
    ``lengths[i] = len(B_i)`` (int64 arrays).

    Reference: ``zlib.crc32`` of the concatenation (a loop of :func:`crc32_combine`)."""
    for i in range(crcs.shape[0]):
        crc = crc32_combine(crc, crcs[i], lengths[i])
    return crc
