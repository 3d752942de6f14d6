"""Where numba caches the compiled kernels: one folder per version of this package's sources.

numba invalidates a cached kernel only when *its own* source file changes, yet a kernel carries
the machine code of everything it calls (the inlined helpers of :mod:`.lowlevel` and
:mod:`.convert`; :mod:`.segments` calls the kernels of :mod:`.quantize`, :mod:`.fp8` and
:mod:`.bitpack`). With the default cache beside the sources, editing or upgrading a helper
module would leave its callers running stale code. So the kernels are cached under
``<base>/<digest>``, where the digest covers every source file of this package and the numba
version: any change to any of them starts a fresh cache, and an unchanged package reuses its
cache across processes. ``<base>`` is ``$NUMBA_CACHE_DIR`` when set, else
``<kvtune cache>/numba`` (``$KVTUNE_CACHE`` or the platform user cache dir).

numba reads ``numba.config.CACHE_DIR`` (public, documented as ``NUMBA_CACHE_DIR``) when a
``cache=True`` function is decorated, so :func:`kernel_cache_dir` sets it only while the kernel
modules are imported and restores it afterwards: other numba users in the process keep theirs.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numba

from kvtune.core.paths import cache_root

__all__ = ["kernel_cache_dir", "sources_digest"]


def sources_digest(folder: Path = Path(__file__).parent) -> str:
    """16 hex digits of sha256 over the numba version and every ``*.py`` file in ``folder``
    (names and bytes, in name order)."""
    h = hashlib.sha256(numba.__version__.encode())
    for path in sorted(folder.glob("*.py")):
        h.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()[:16]


@contextmanager
def kernel_cache_dir() -> Iterator[Path]:
    """Point numba's disk cache at ``<base>/<sources_digest()>`` for the ``with`` block.

    Yields:
        The cache folder used (created by numba when it first writes).
    """
    previous = numba.config.CACHE_DIR
    base = Path(previous) if previous else cache_root() / "numba"
    folder = base / sources_digest()
    numba.config.CACHE_DIR = str(folder)
    try:
        yield folder
    finally:
        numba.config.CACHE_DIR = previous
