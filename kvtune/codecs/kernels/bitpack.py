"""Bit packing of quantized symbols (widths 1..8, most significant bit first).

Accelerates the ``bitpack`` codec (:func:`kvtune.codecs.bitpack.pack_bits` /
:func:`~kvtune.codecs.bitpack.unpack_bits`): the dense, non-entropy-coded layout of the
integer symbols of every quantized segment.
"""

from __future__ import annotations

import numpy as np
from numba import njit, uintp

from .lowlevel import INLINE, JIT, U1, U2, U3, U4, U5, U6, U7, U8

_u = uintp


_BYTES = np.uint64(0x00FF00FF00FF00FF)  # the low byte of every 16-bit lane
_HALVES = np.uint64(0x0000FFFF0000FFFF)  # the low half of every 32-bit lane
_WORD = np.uint64(0xFFFFFFFF)


@njit(**INLINE)
def _merge8(x, b):
    """The ``8b``-bit run of 8 ``b``-bit symbols (``b`` in 1..7) held one per byte of ``x``
    (symbol ``j`` in byte ``j``), symbol 0 in its top bits: pairs in the 16-bit lanes, then
    fours in the 32-bit lanes, then all eight (3 steps of two shifts, not 8 shifts and masks)."""
    x = ((x & _BYTES) << b) | ((x >> U8) & _BYTES)  # 16-bit lane k: symbol 2k above 2k + 1
    x = ((x & _HALVES) << (U2 * b)) | ((x >> np.uint64(16)) & _HALVES)  # 32-bit lane k: symbols 4k .. 4k + 3
    return ((x & _WORD) << (U4 * b)) | (x >> np.uint64(32))


@njit(**INLINE)
def _split8(w, b):
    """Inverse of :func:`_merge8`: symbol ``j`` of the ``8b``-bit run ``w`` into byte ``j``."""
    m4 = (U1 << (U4 * b)) - U1
    x = ((w >> (U4 * b)) & m4) | ((w & m4) << np.uint64(32))
    m2 = ((U1 << (U2 * b)) - U1) * np.uint64(0x0000000100000001)
    x = ((x >> (U2 * b)) & m2) | ((x & m2) << np.uint64(16))
    m1 = ((U1 << b) - U1) * np.uint64(0x0001000100010001)
    return ((x >> b) & m1) | ((x & m1) << U8)


@njit(**INLINE)
def _pack_groups(sym64, groups, b, out):
    """Groups ``0 .. groups - 1`` of 8 symbols (``sym64[c]``: symbol ``j`` in byte ``j``) into
    ``b`` bytes each of ``out`` (:func:`_merge8`, big-endian); returns the OR of the words. Called
    with a constant ``b`` (``U1``, ``U3``, ...: inlined once per width), so the loop vectorizes."""
    ub = _u(b)
    s64 = np.uint64(0)
    for c in range(groups):
        x = sym64[c]
        s64 |= x
        w = _merge8(x, b)
        for k in range(ub):
            out[c * ub + k] = np.uint8((w >> (U8 * (ub - U1 - k))) & np.uint64(0xFF))
    return s64


@njit(**INLINE)
def _unpack_groups(data, groups, b, out64):
    """Inverse of :func:`_pack_groups`: ``b`` big-endian bytes of ``data`` per group -> 8
    symbols in ``out64[c]`` (:func:`_split8`). Called with a constant ``b``, as it."""
    ub = _u(b)
    for c in range(groups):
        w = np.uint64(0)
        for k in range(ub):
            w = (w << U8) | np.uint64(data[c * ub + k])
        out64[c] = _split8(w, b)


@njit(**JIT)
def pack_bits(sym, bits, out):
    """Pack flat, C-contiguous uint8 ``sym`` (values ``< 2**bits``), MSB first, into ``out`` (``ceil(n*bits/8)`` bytes).

    Reference: :func:`kvtune.codecs.bitpack.pack_bits`. Returns the OR of all
    symbols (the caller rejects symbols that do not fit). Widths 2 and 4 read the symbols as
    little-endian 32- / 16-bit words (4 / 2 symbols, one output byte each: shifts and ORs that
    vectorize, ~1.5-2x faster than gathering bytes); the others merge every 8 symbols into
    ``bits`` bytes in three steps (:func:`_merge8`), in a loop compiled once per width
    (:func:`_pack_groups`): with the width a constant the loop vectorizes, and width 1 runs it
    too. Per default-model tensor (196,608 symbols), one thread, against one loop for every
    width (``benchmarks/bitpack.py``, Zen 5, 2026-12-05): 3-bit 23.1 -> 5.0 us to pack and
    29.5 -> 5.7 us to unpack (:func:`_split8`), 5-7-bit 23 -> 6.7-7.7 us and 29.6 -> 7.2-12.9 us,
    1-bit 8.7 -> 3.1 and 4.0 -> 3.1 us.
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
        full = n // U2
        w16 = sym[: full * U2].view(np.uint16)  # symbols 2i, 2i + 1 in the low, high byte
        s16 = np.uint16(0)
        for i in range(full):
            v = w16[i]
            s16 |= v
            out[i] = np.uint8(((v << np.uint16(4)) | (v >> np.uint16(8))) & np.uint16(0xFF))
        seen = np.uint8(s16 & np.uint16(0xFF)) | np.uint8(s16 >> np.uint16(8))
    elif bits == 2:
        full = n // U4
        w32 = sym[: full * U4].view(np.uint32)  # symbols 4i .. 4i + 3 in bytes 0 .. 3
        s32 = np.uint32(0)
        for i in range(full):
            v = w32[i]
            s32 |= v
            out[i] = np.uint8(((v << np.uint32(6)) | (v >> np.uint32(4)) | (v >> np.uint32(14)) | (v >> np.uint32(24)))
                              & np.uint32(0xFF))
        s16 = s32 | (s32 >> np.uint32(16))
        seen = np.uint8((s16 | (s16 >> np.uint32(8))) & np.uint32(0xFF))
    elif bits == 1:
        full = n // U8
        s64 = _pack_groups(sym[: full * U8].view(np.uint64), full, U1, out)
        for k in range(U8):
            seen |= np.uint8((s64 >> (U8 * k)) & np.uint64(0xFF))
    else:
        b = np.uint64(bits)
        ub = _u(bits)
        full = n // U8
        sym64 = sym[: full * U8].view(np.uint64)
        if bits == 3:
            s64 = _pack_groups(sym64, full, U3, out)
        elif bits == 5:
            s64 = _pack_groups(sym64, full, U5, out)
        elif bits == 6:
            s64 = _pack_groups(sym64, full, U6, out)
        else:
            s64 = _pack_groups(sym64, full, U7, out)
        for k in range(U8):
            seen |= np.uint8((s64 >> (U8 * k)) & np.uint64(0xFF))
        rem = n - U8 * full
        if rem:
            w = np.uint64(0)
            for j in range(U8):
                v = sym[U8 * full + j] if j < rem else np.uint8(0)
                seen |= v
                w = (w << b) | np.uint64(v)
            for k in range((rem * ub + U7) // U8):
                out[full * ub + k] = np.uint8((w >> (U8 * (b - U1 - k))) & np.uint64(0xFF))
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


@njit(**JIT)
def unpack_bits(data, bits, out):
    """Inverse of :func:`pack_bits`: ``len(out)`` symbols from ``data`` (length already checked).

    Reference: :func:`kvtune.codecs.bitpack.unpack_bits`."""
    n = _u(out.shape[0])
    if bits == 8:
        for i in range(n):
            out[i] = data[i]
        return
    if bits == 4:
        full = n // U2
        for i in range(full):
            v = data[i]
            out[U2 * i] = v >> np.uint8(4)
            out[U2 * i + U1] = v & np.uint8(15)
    elif bits == 2:
        full = n // U4
        for i in range(full):
            v = data[i]
            out[U4 * i] = v >> np.uint8(6)
            out[U4 * i + U1] = (v >> np.uint8(4)) & np.uint8(3)
            out[U4 * i + U2] = (v >> np.uint8(2)) & np.uint8(3)
            out[U4 * i + U3] = v & np.uint8(3)
    elif bits == 1:
        full = n // U8
        _unpack_groups(data, full, U1, out[: full * U8].view(np.uint64))
    else:
        b = np.uint64(bits)
        ub = _u(bits)
        mask = np.uint64((1 << bits) - 1)
        full = n // U8
        out64 = out[: full * U8].view(np.uint64)
        if bits == 3:
            _unpack_groups(data, full, U3, out64)
        elif bits == 5:
            _unpack_groups(data, full, U5, out64)
        elif bits == 6:
            _unpack_groups(data, full, U6, out64)
        else:
            _unpack_groups(data, full, U7, out64)
        rem = n - U8 * full
        if rem:
            w = np.uint64(0)
            nbytes = _u(data.shape[0]) - full * ub
            for k in range(ub):
                byte = data[full * ub + k] if k < nbytes else np.uint8(0)
                w = (w << U8) | np.uint64(byte)
            for j in range(rem):
                out[U8 * full + j] = np.uint8((w >> (b * (U7 - j))) & mask)
        return
    per = _u(8 // bits)
    rem = n - full * per
    if rem:
        v = data[full]
        mask8 = np.uint8((1 << bits) - 1)
        for j in range(rem):
            out[full * per + j] = (v >> np.uint8(bits * (per - U1 - j))) & mask8
