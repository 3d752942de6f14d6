"""Finiteness and magnitude checks of the codec inputs (NaN / +-inf, the largest magnitude),
without converting the data.

Accelerates the input checks of :func:`kvtune.codecs.policy.encode_kv` on the fast path
(:mod:`kvtune.codecs.fastpath`): one read of the data at memory speed answers both "is every
value finite" (``torch.isfinite(x).all()``) and "what is the largest ``|x|``"
(``x.abs().amax()``, for the quantizers' value limits,
:func:`kvtune.codecs.base.check_value_range`), instead of one pass each. And the decoder's check
that a stream's float16 metadata is finite (:func:`first_nonfinite_f16`).
"""

from __future__ import annotations

import numpy as np
from numba import njit, uintp

from .lowlevel import JIT


@njit(**JIT)
def max_masked(flat, mask):
    """The largest ``flat[i] & mask`` of a 1-D unsigned integer array (0 when empty): an integer
    max reduction the compiler vectorizes (``vpmaxuw`` on 16 lanes for uint16).

    Each masked value is cast back to the array's dtype: numba computes ``uint16 & uint16`` in
    int64, and a 64-bit max reduction runs on 4 lanes (measured 4x slower: 32 us against
    7.5 us for one 384 KiB K tensor in cache; 18 GB/s from memory)."""
    m = flat.dtype.type(0)
    for i in range(uintp(flat.size)):
        e = flat.dtype.type(flat[i] & mask)
        m = e if e > m else m
    return m


def max_magnitude_bf16(bits: np.ndarray) -> int:
    """The largest magnitude of a bfloat16 array (its uint16 bits, any shape, C-contiguous), as
    the bfloat16 bit pattern of that magnitude (the bits without the sign; 0 when empty).

    A pattern ``>= 0x7F80`` means a NaN or inf (all 8 exponent bits set; NaN patterns are above
    inf's); below it, ``float32`` of ``pattern << 16`` is ``abs(x).amax()``.
    Reference: ``x.abs().amax()`` and ``torch.isfinite(x).all()``.
    """
    return int(max_masked(bits.reshape(-1), np.uint16(0x7FFF)))


def max_magnitude_f32(x: np.ndarray) -> int:
    """The largest magnitude of a float32 array (any shape, C-contiguous) as a float32 bit
    pattern without the sign (0 when empty); ``>= 0x7F800000`` means a NaN or inf. As
    :func:`max_magnitude_bf16`."""
    return int(max_masked(x.reshape(-1).view(np.uint32), np.uint32(0x7FFFFFFF)))


def all_finite_bf16(bits: np.ndarray) -> bool:
    """Whether no element of a bfloat16 array (its uint16 bits, any shape, C-contiguous) is NaN
    or +-inf: a bfloat16 is non-finite exactly when its 8 exponent bits are all ones.
    Reference: ``torch.isfinite(x).all()``."""
    return max_magnitude_bf16(bits) < 0x7F80


def all_finite_f32(x: np.ndarray) -> bool:
    """Whether no element of a float32 array (any shape, C-contiguous) is NaN or +-inf
    (exponent bits of its uint32 view all ones, as :func:`all_finite_bf16`)."""
    return max_magnitude_f32(x) < 0x7F800000


@njit(**JIT)
def first_nonfinite_f16(buf, starts, ends):
    """Index of the first byte range ``buf[starts[r]:ends[r]]`` of little-endian float16 values
    that holds a NaN or +-inf, or -1 when every one is finite.

    A float16 is non-finite exactly when its 5 exponent bits are all ones: bits 2..6 of its
    high (second) byte. Reference: ``not torch.isfinite(torch.frombuffer(section,
    dtype=torch.float16)).all()`` per range.

    Args:
        buf: uint8 bytes (a whole stream).
        starts, ends: int64 byte offsets of the ranges (even lengths).
    """
    for r in range(starts.shape[0]):
        m = np.uint8(0)
        for i in range(uintp(starts[r] + 1), uintp(ends[r]), uintp(2)):  # a max reduction: no branch per value
            e = np.uint8(buf[i] & np.uint8(0x7C))
            m = e if e > m else m
        if m == 0x7C:
            return r
    return -1
