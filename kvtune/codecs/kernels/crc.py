"""CRC-32 (zlib's polynomial) of stream sections, and the combination of two CRCs.

Accelerates the integrity checksums of :mod:`kvtune.codecs.stream`: the fast path
(:mod:`kvtune.codecs.fastpath`) computes each section's CRC on the codec thread that wrote it
and combines them (:func:`crc32_combine`) instead of reading the stream again.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from .lowlevel import JIT


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


@njit(**JIT)
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


@njit(**JIT)
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


@njit(**JIT)
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
