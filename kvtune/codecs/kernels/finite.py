"""Finiteness checks of the codec inputs (NaN / +-inf), without converting the data.

Accelerates the input check of :func:`kvtune.codecs.policy.encode_kv` on the fast path
(:mod:`kvtune.codecs.fastpath`): one read of the data at memory speed instead of
``torch.isfinite(x).all()``.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from .lowlevel import JIT


@njit(**JIT)
def _no_all_ones(flat, mask):
    """Whether no element of the 1-D unsigned integer array ``flat`` has every bit of ``mask``
    set: the max of ``flat & mask`` stays below ``mask`` -- an integer reduction the compiler
    vectorizes (one read of the data at memory speed)."""
    m = mask ^ mask
    for i in range(flat.size):
        e = flat[i] & mask
        m = e if e > m else m
    return m != mask


def all_finite_bf16(bits: np.ndarray) -> bool:
    """Whether no element of a bfloat16 array (its uint16 bits, any shape, C-contiguous) is NaN
    or +-inf: a bfloat16 is non-finite exactly when its 8 exponent bits are all ones.
    Reference: ``torch.isfinite(x).all()``."""
    return bool(_no_all_ones(bits.reshape(-1), np.uint16(0x7F80)))


def all_finite_f32(x: np.ndarray) -> bool:
    """Whether no element of a float32 array (any shape, C-contiguous) is NaN or +-inf
    (exponent bits of its uint32 view all ones, as :func:`all_finite_bf16`)."""
    return bool(_no_all_ones(x.reshape(-1).view(np.uint32), np.uint32(0x7F800000)))
