"""Helpers shared by the benchmark scripts: the timing loop, and ``codecs.py`` loaded as a module
(its KV capture and PCA basis fitting)."""

from __future__ import annotations

import functools
import importlib.util
import sys
import time
from pathlib import Path


def best_seconds(fn, repeats: int) -> float:
    """Fastest of ``repeats`` timed calls of ``fn`` (seconds), after one untimed call."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


@functools.cache
def codecs_script():
    """``benchmarks/codecs.py`` as a module (``load_kv``, ``load_or_fit_basis``)."""
    spec = importlib.util.spec_from_file_location("bench_codecs", Path(__file__).with_name("codecs.py"))
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod
