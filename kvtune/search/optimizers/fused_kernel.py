"""BoTorch's fused qLogEHVI C++ kernel, loaded without ever waiting on a stale lock.

Which call builds it: constructing BoTorch's ``qLogExpectedHypervolumeImprovement`` (or
``qLogNoisyExpectedHypervolumeImprovement``; :mod:`botorch.acquisition.multi_objective.logei`)
calls ``_try_load_fused_kernel()`` once per process. Unless a prebuilt ``logei_fused_ext`` is
importable, that JIT-compiles ``botorch/csrc/logei_fused.cpp`` with
``torch.utils.cpp_extension.load(name="logei_fused_ext", ...)``, and torch's ``_jit_compile``
guards the build folder ``$TORCH_EXTENSIONS_DIR/logei_fused_ext`` (default
``~/.cache/torch_extensions/py311_cpu/...``) with ``torch.utils.file_baton.FileBaton``: it
creates ``<build folder>/lock`` with ``O_EXCL``, builds or checks the build, and deletes the
file; any other process polls while the file exists, forever. The lock is taken on every first
load of a process, not only on the first compile (~7 s on a free machine, about a minute on a
busy 2-core one), so a process killed in that window (Ctrl-C, OOM killer) leaves a file that
makes every later ``mobo`` run hang, with no CPU use and no output.

:func:`load_fused_kernel`, called before the acquisition is built, takes that call over:

1. kvtune owns the build folder: :func:`extensions_root` under the kvtune cache, set as
   ``TORCH_EXTENSIONS_DIR`` for the duration of the load only;
2. kvtune processes serialize on an ``fcntl.flock`` of ``<root>/logei_fused_ext.kvtune-lock``.
   The operating system drops such a lock when its holder dies, so it cannot go stale, and
   while holding it a torch ``lock`` file in the build folder can only be the leftover of a
   killed process: it is removed, with a warning;
3. a kvtune process that cannot take the flock within ``timeout`` seconds (another one is
   compiling, or hangs) skips the fused kernel for its lifetime, with a warning: BoTorch then
   uses its pure-Python implementation (same values, ~1.5-3x slower acquisition).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import sys
import time
import warnings
from collections.abc import Iterator
from pathlib import Path

import torch

from kvtune.evaluate.assets import cache_root

__all__ = ["EXTENSION", "LOCK_TIMEOUT_S", "extensions_root", "load_fused_kernel"]

EXTENSION = "logei_fused_ext"
"""Name BoTorch builds the kernel under (the build folder's name)."""
LOCK_TIMEOUT_S = 120.0
"""Default wait for another kvtune process's build before falling back to pure Python (s)."""


def extensions_root() -> Path:
    """kvtune's ``TORCH_EXTENSIONS_DIR``: ``<cache>/torch_extensions/py<major><minor>-torch<version>``
    (a torch upgrade builds afresh instead of loading a kernel built against another torch)."""
    return cache_root() / "torch_extensions" / f"py{sys.version_info.major}{sys.version_info.minor}-torch{torch.__version__}"


def _take_flock(handle, timeout: float) -> bool:
    """Exclusive ``flock`` on an open file within ``timeout`` seconds (polled every 0.1 s)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.1)


@contextlib.contextmanager
def _environ(name: str, value: str) -> Iterator[None]:
    """Set an environment variable for the duration of the block, then restore it."""
    before = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = before


def load_fused_kernel(timeout: float = LOCK_TIMEOUT_S) -> bool:
    """Load BoTorch's fused qLogEHVI kernel once per process (see the module docstring).

    Args:
        timeout: seconds to wait for another kvtune process that is building the kernel.

    Returns:
        True when the fused kernel is in use, False when BoTorch uses its pure-Python path
        (no compiler, a BoTorch without the kernel, or the wait timed out; warned).
    """
    from botorch.acquisition.multi_objective import logei

    loader = getattr(logei, "_try_load_fused_kernel", None)
    if loader is None:  # a BoTorch without the fused kernel
        return False
    if logei._load_attempted:
        return logei._C is not None
    root = extensions_root()
    stale = root / EXTENSION / "lock"
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f"{EXTENSION}.kvtune-lock", "a") as handle:
        if not _take_flock(handle, timeout):
            warnings.warn(f"another kvtune process has held {handle.name} for {timeout:.0f} s while building BoTorch's "
                          "fused qLogEHVI kernel; this run uses BoTorch's pure-Python path (slower acquisition)",
                          stacklevel=2)
            logei._load_attempted = True  # never wait on torch's lock file in this process
            return False
        try:
            if stale.exists():
                warnings.warn(f"removed {stale}: a torch extension build lock left by a killed process", stacklevel=2)
                stale.unlink(missing_ok=True)
            with _environ("TORCH_EXTENSIONS_DIR", str(root)):
                loader()
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
    return logei._C is not None
