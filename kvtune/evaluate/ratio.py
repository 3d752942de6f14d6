"""Cheap compression ratios for every candidate, measured before any model forward pass.

The Bayesian optimizers need each candidate's compression ratio up front (KVServe: "the
compression ratio CR(c) is cheap and is measured for every candidate"). It is measured by an
exact encode of a sample: a few evenly spaced layers of one real context, each encoded with
its true layer index (layer schedules and head scores depend on it). The bytes of the sampled
layers' sections are scaled to all layers and one stream header is added:

    est_stream_bytes = header_bytes + sections_bytes(sampled) * L / n_sampled

For bit-packed policies the section sizes depend only on shapes, so the estimate is exact up to
the header; for entropy-coded policies it is a sample estimate (its error against the full
encode is reported per trial as ``ratio_estimate`` next to ``compression_ratio``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from kvtune.codecs import PolicyConfig, encode_kv, original_nbytes, read_header
from kvtune.evaluate.model import KVLayers


def sample_layer_indices(num_layers: int, n: int) -> list[int]:
    """``n`` evenly spaced layer indices in ``[0, num_layers)``, first and last included."""
    if num_layers <= n:
        return list(range(num_layers))
    return sorted({round(i * (num_layers - 1) / (n - 1)) for i in range(n)})


def estimate_stream_bytes(config: PolicyConfig, kv: KVLayers, layers: Sequence[int]) -> float:
    """Estimated ``len(encode_kv(kv, config))`` from encodes of ``layers`` only (bytes)."""
    sections, header = 0, 0
    for i in layers:
        h = read_header(encode_kv([kv[i]], config, layer_offset=i))
        sections += h.state_nbytes + h.meta_nbytes + h.payload_nbytes
        header = max(header, h.header_nbytes + h.checksum_nbytes)
    return header + sections * len(kv) / len(layers)


def estimate_ratios(configs: Sequence[PolicyConfig], kv: KVLayers, *, sample_layers: int = 6,
                    progress: Callable[[int], None] | None = None) -> np.ndarray:
    """Compression ratio (bf16 bytes / stream bytes) of every config on one context's KV.

    Args:
        configs: the candidates' policies.
        kv: one context's KV, per layer ``(1, kv_heads, tokens, head_dim)``.
        sample_layers: layers encoded per candidate.
        progress: called with 1 after each candidate.

    Returns:
        ``(len(configs),)`` float64 ratios.
    """
    layers = sample_layer_indices(len(kv), sample_layers)
    total = original_nbytes(kv)
    out = np.empty(len(configs))
    for j, config in enumerate(configs):
        out[j] = total / estimate_stream_bytes(config, kv, layers)
        if progress:
            progress(1)
    return out
