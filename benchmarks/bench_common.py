"""Helpers shared by the benchmark scripts: the timing loop, the CPU's name, the command line of
the scripts that time kernels on the captured KV, and ``codecs.py`` loaded as a module (its KV
capture and PCA basis fitting)."""

from __future__ import annotations

import argparse
import functools
import importlib.util
import platform
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


def cpu_model() -> str:
    """The CPU as a results file names it: ``/proc/cpuinfo``'s model name and family on Linux
    (AMD's EPYC VMs report only "AMD EPYC"; family 25 is Zen 3 / Zen 4, 26 is Zen 5), else
    :func:`platform.processor` or the machine type."""
    fields = {}
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                key, _, value = line.partition(":")
                if not key.strip() and fields:
                    break  # the end of the first processor's block
                fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    if fields.get("model name"):
        family = f", family {fields['cpu family']}" if fields.get("cpu family") else ""
        return f"{fields['model name']}{family} ({platform.machine()})"
    return platform.processor() or platform.machine()


def kv_kernel_args(doc: str, repeats: int) -> argparse.Namespace:
    """``--kv`` (the KV cache file of ``codecs.py``), ``--repeats`` (default ``repeats``, at
    least 1) and ``--out`` (a markdown report), parsed from the command line; the first
    paragraph of ``doc`` is the description."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("--kv", type=Path, help="cache file for the captured KV (the format of benchmarks/codecs.py)")
    ap.add_argument("--repeats", type=int, default=repeats)
    ap.add_argument("--out", type=Path, help="write the markdown report here")
    args = ap.parse_args()
    if args.repeats < 1:
        ap.error("--repeats must be >= 1")
    return args


@functools.cache
def codecs_script():
    """``benchmarks/codecs.py`` as a module (``load_kv``, ``load_or_fit_basis``)."""
    spec = importlib.util.spec_from_file_location("bench_codecs", Path(__file__).with_name("codecs.py"))
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod
