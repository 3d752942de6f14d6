"""The C allocator's hold on freed memory (glibc on Linux).

glibc serves allocations below its mmap threshold from heaps it keeps after they are freed,
and raises that threshold (up to 32 MiB) each time a larger mapped block is freed, so a
process that allocates and frees tensors of a few MB to a few hundred MB (a profile's
prefill, baseline and per-trial batches) ends up holding gigabytes it no longer uses: the
default profile's resident memory was ~1 GB above its live tensors. Fixing the threshold
at 1 MiB maps every larger tensor on its own and returns it to the system when freed.
Elsewhere (macOS, musl) these functions do nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools

__all__ = ["MMAP_THRESHOLD", "limit_heap_retention", "release_free_memory"]

#: Allocations of at least this many bytes get their own mapping (returned when freed).
MMAP_THRESHOLD = 1 << 20
_M_MMAP_THRESHOLD = -3  # mallopt parameter number in glibc's malloc.h


@functools.cache
def _glibc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
    except OSError:
        return None
    return libc if libc is not None and hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else None


def limit_heap_retention(threshold: int = MMAP_THRESHOLD) -> bool:
    """Fix glibc's mmap threshold at ``threshold`` bytes for this process (module docstring).

    Returns:
        True when glibc accepted it; False where there is no glibc (nothing changed).
    """
    libc = _glibc()
    return bool(libc is not None and libc.mallopt(_M_MMAP_THRESHOLD, int(threshold)) == 1)


def release_free_memory() -> bool:
    """Give freed heap memory back to the system (glibc ``malloc_trim(0)``).

    Returns:
        True when memory was released; False when there was none or no glibc.
    """
    libc = _glibc()
    return bool(libc is not None and libc.malloc_trim(0) == 1)
