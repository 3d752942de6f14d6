"""CRC32 of KV streams (:mod:`kvtune.codecs.stream`) and of their sections (the fast path
computes each tensor's CRC while its bytes are in cache, :mod:`kvtune.codecs.fastpath`).

Values are always those of ``zlib.crc32``. They are computed by, in order of preference: the
compiled kernel :func:`kvtune.codecs.kernels.crc32_update` where it folds with carry-less
multiplication (x86-64 with ``pclmul``, :data:`kvtune.codecs.kernels.CRC32_CLMUL`; ~4x
zlib 1.2.13), ``isal`` (optional, carry-less multiply as well) when it is installed, else zlib.
"""

from __future__ import annotations

import sys
import zlib

import numpy as np

from kvtune.codecs.threads import num_threads, parallel_map

try:  # ISA-L's CRC32: same values as zlib
    from isal.isal_zlib import crc32 as _crc32_impl
except ImportError:  # pragma: no cover - depends on the environment
    _crc32_impl = zlib.crc32

try:  # numba is a dependency; without it CRCs are computed on one thread and never combined
    from kvtune.codecs import kernels
except ImportError:  # pragma: no cover - exercised only without numba
    kernels = None  # type: ignore[assignment]
else:
    if kernels.CRC32_CLMUL and sys.byteorder == "little":

        def _crc32_impl(data: memoryview, value: int = 0) -> int:
            return int(kernels.crc32_update(value, np.frombuffer(data, np.uint8)))

__all__ = ["crc32", "crc32_threaded", "crc32_combine", "can_combine"]

_SPLIT_BYTES = 1 << 21  # inputs of at least 2 MiB are split over the codec threads
_CHUNK_BYTES = 1 << 20  # ... in chunks of about 1 MiB, taken in turn by whichever thread is free


def can_combine() -> bool:
    """Whether :func:`crc32_combine` is available (compiled kernels importable, little-endian host)."""
    return kernels is not None and sys.byteorder == "little"


def _bytes_view(data: bytes | bytearray | memoryview | np.ndarray) -> memoryview:
    if isinstance(data, np.ndarray):
        return memoryview(data.reshape(-1).view(np.uint8))
    return memoryview(data).cast("B")


def crc32(data: bytes | bytearray | memoryview | np.ndarray, value: int = 0) -> int:
    """``zlib.crc32(data, value)`` on the calling thread (safe inside :func:`parallel_map` tasks)."""
    return _crc32_impl(_bytes_view(data), value)


def crc32_threaded(data: bytes | bytearray | memoryview | np.ndarray, value: int = 0) -> int:
    """``zlib.crc32(data, value)``; inputs of 2 MiB or more are split in chunks of about 1 MiB
    shared by the codec threads (:func:`kvtune.codecs.threads.num_threads`; a thread the OS
    does not schedule then holds up at most one chunk) and the parts combined with
    :func:`crc32_combine`. Must not be called from a :func:`parallel_map` task."""
    mv = _bytes_view(data)
    n = len(mv)
    threads = num_threads()
    if threads > 1 and n >= _SPLIT_BYTES and can_combine():
        chunks = max(threads, n // _CHUNK_BYTES)
        cut = [n * i // chunks for i in range(chunks + 1)]
        parts = parallel_map(lambda i: _crc32_impl(mv[cut[i] : cut[i + 1]]), list(range(chunks)))
        crc = value
        for i, c in enumerate(parts):
            crc = crc32_combine(crc, c, cut[i + 1] - cut[i])
        return crc
    return _crc32_impl(mv, value)


def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """CRC32 of ``A + B`` from ``crc(A)``, ``crc(B)`` and ``len(B)`` (needs the compiled kernels,
    :func:`can_combine`)."""
    return int(kernels.crc32_combine(crc1, crc2, len2))
