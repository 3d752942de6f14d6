"""Worker threads of the codec fast path (:mod:`kvtune.codecs.fastpath`) and of the stream
checksum (:mod:`kvtune.codecs.checksum`).

:func:`parallel_map` shares a list of independent tasks (K and V tensors, checksum chunks)
between the calling thread and a small pool; the compiled kernels, zlib and isal release the
GIL, so the tasks run in parallel. The number of threads (:func:`num_threads`, default
``torch.get_num_threads()``) never changes any output.

With two threads or more, each of them runs its tasks with one OpenMP thread (threadpoolctl
sets the OpenMP thread count of the calling thread only, and restores it after): torch's
matrix products and element-wise ops inside the tasks (the ``pca`` projections, the ``keep``
scores) would otherwise each start a team of ``torch.get_num_threads()`` OpenMP threads, and
``n`` codec threads would run ``n**2`` threads on ``n`` cores. torch sets a thread's OpenMP
count on that thread's first torch op (to ``torch.set_num_threads``' value once it has been
called), so each thread runs that set-up before the limit, not inside it. Their results do not depend on
the OpenMP thread count (oneDNN's products split the rows between threads, torch's reductions
the outputs; the fast == reference tests check it).
"""

from __future__ import annotations

import functools
import itertools
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Sequence

import torch
from threadpoolctl import ThreadpoolController

__all__ = ["num_threads", "set_num_threads", "parallel_map"]

_threads: int | None = None
_pool: ThreadPoolExecutor | None = None
_pool_size = 0
_pool_lock = threading.Lock()


@functools.cache
def _openmp() -> ThreadpoolController:
    """The OpenMP runtimes loaded in this process (torch's ``libgomp`` among them), found once."""
    return ThreadpoolController()


def num_threads() -> int:
    """Worker threads of the fast path: :func:`set_num_threads`, else ``torch.get_num_threads()``."""
    return max(1, _threads if _threads is not None else torch.get_num_threads())


def set_num_threads(n: int | None) -> None:
    """Use ``n`` worker threads (``None``: follow ``torch.get_num_threads()``).

    Raises:
        TypeError: ``n`` is not an int or ``None``.
        ValueError: ``n < 1``.
    """
    global _threads
    if n is not None and (not isinstance(n, int) or isinstance(n, bool)):
        raise TypeError(f"the number of threads must be an int or None, got {n!r}")
    if n is not None and n < 1:
        raise ValueError(f"need at least one thread, got {n}")
    _threads = n


def parallel_map(fn: Callable[[Any], Any], items: Sequence[Any]) -> list[Any]:
    """``[fn(x) for x in items]``, shared between the calling thread and ``num_threads() - 1``
    pool threads.

    Every thread takes the next unclaimed item until none is left, the calling thread
    included, so a pool thread that the OS does not schedule (a loaded machine) delays the
    result by at most the one item it holds. Exceptions are raised in item order (the first
    failing item's), as a serial loop would. ``fn`` must not call :func:`parallel_map` itself.

    Concurrent calls (e.g. a serving engine decoding several streams at once) share one pool.
    It only grows, and work is submitted under the lock that replaces it, so no call submits to
    a pool another call has just shut down (whose queued work still runs).
    """
    n = min(num_threads(), len(items))
    if n <= 1:
        return [fn(x) for x in items]
    results: list[Any] = [None] * len(items)
    errors: list[BaseException | None] = [None] * len(items)
    counter = itertools.count()

    def work() -> None:
        # torch sets a thread's OpenMP count the first time that thread runs a torch op (to
        # torch.set_num_threads' value, if it was ever called): run that first, then limit it.
        torch.get_num_threads()
        with _openmp().limit(limits=1, user_api="openmp"):  # this thread's OpenMP teams: itself (module doc)
            while True:
                i = next(counter)  # atomic under the GIL
                if i >= len(items):
                    return
                try:
                    results[i] = fn(items[i])
                except BaseException as exc:  # re-raised below, in item order
                    errors[i] = exc

    global _pool, _pool_size
    with _pool_lock:
        if _pool is None or _pool_size < n - 1:
            if _pool is not None:
                _pool.shutdown(wait=False)
            _pool = ThreadPoolExecutor(max_workers=n - 1, thread_name_prefix="kvtune-codec")
            _pool_size = n - 1
        futures = [_pool.submit(work) for _ in range(n - 1)]
    work()
    for f in futures:
        f.result()
    for exc in errors:
        if exc is not None:
            raise exc
    return results
