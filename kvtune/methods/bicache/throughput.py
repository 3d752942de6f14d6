"""Measured encoder throughput with and without prefix reuse (requests per second).

BiCache ("Enabling KV Caching of Shared Prefix for Diffusion Language Models", arXiv 2606.07571),
Sec. 4 (the throughput gain of reuse; +36-98 % for diffusion LMs as summarized from that paper,
not re-measured here). For one bucket, one fixed batch of real requests is encoded at every reuse
depth; the depths are interleaved within each repeat (rotating the order) so that a change
in machine load hits all depths alike. Time = wall clock (``time.perf_counter``) of one
forward pass of the batch, after ``warmup`` untimed rounds; the median over ``repeats``.
Requests/s = batch size / median seconds. The prefix state is already in memory (fetching it
is the table's transfer term, not part of this number).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from typing import Any

import torch

from kvtune.methods.bicache.adapters import EncoderAdapter
from kvtune.methods.bicache.quality import pad_batch
from kvtune.methods.bicache.state import PrefixState
from kvtune.methods.bicache.workload import BiCacheRequest

__all__ = ["measure_throughput", "speedup", "token_layer_fraction"]


def speedup(requests_per_s: float, baseline_requests_per_s: float) -> float:
    """Throughput gain factor ``rps / rps_full_recompute`` (1.0 = no gain)."""
    return requests_per_s / baseline_requests_per_s


def token_layer_fraction(prefix_tokens: float, suffix_tokens: float, depth: int, num_layers: int) -> float:
    """Share of full recompute's token x layer evaluations done at reuse depth d (no timing noise):
    ``(d N + (L - d)(P + N)) / (L (P + N))``; it ignores attention's quadratic term.

    >>> token_layer_fraction(50, 50, 2, 4)
    0.75
    """
    P, N, L = float(prefix_tokens), float(suffix_tokens), float(num_layers)
    return (depth * N + (L - depth) * (P + N)) / (L * (P + N))


@torch.inference_mode()
def measure_throughput(
    adapter: EncoderAdapter,
    prefix_ids: Sequence[int],
    state: PrefixState,
    requests: Sequence[BiCacheRequest],
    *,
    depths: Sequence[int],
    batch_size: int = 8,
    repeats: int = 5,
    warmup: int = 1,
) -> list[dict[str, Any]]:
    """Requests/s at each depth for the first ``batch_size`` requests of a bucket.

    Returns:
        One dict per depth: ``depth``, ``batch_size``, ``seconds_per_batch`` (median),
        ``seconds_per_batch_min``/``_max``, ``requests_per_s``, ``compute_s_per_request``,
        ``speedup`` (vs depth 0, medians), ``speedup_min_time`` (the same from the fastest
        repeat of each depth: less sensitive to other jobs on the machine), ``repeats``,
        ``threads`` (torch intra-op threads).
    """
    batch = list(requests[:batch_size])
    ids, mask = pad_batch([r.suffix_ids for r in batch])
    ds = sorted(set(depths) | {0})
    times: dict[int, list[float]] = {d: [] for d in ds}
    for rep in range(warmup + repeats):
        order = ds[rep % len(ds):] + ds[: rep % len(ds)]
        for d in order:
            t0 = time.perf_counter()
            adapter.run(prefix_ids, ids, mask, depth=d, state=state if d else None)
            dt = time.perf_counter() - t0
            if rep >= warmup:
                times[d].append(dt)
    base_rps = len(batch) / statistics.median(times[0])
    base_min = min(times[0])
    rows = []
    for d in ds:
        med = statistics.median(times[d])
        rps = len(batch) / med
        rows.append({
            "depth": d,
            "batch_size": len(batch),
            "seconds_per_batch": med,
            "seconds_per_batch_min": min(times[d]),
            "seconds_per_batch_max": max(times[d]),
            "requests_per_s": rps,
            "compute_s_per_request": med / len(batch),
            "speedup": speedup(rps, base_rps),
            "speedup_min_time": base_min / min(times[d]),
            "repeats": repeats,
            "threads": torch.get_num_threads(),
        })
    return rows
