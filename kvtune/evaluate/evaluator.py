"""Evaluation of one policy on captured real KV: bytes, accuracy and codec throughput.

For every context the policy encodes the context's whole KV cache (all layers) into one
stream, as a prefill node would before sending it, and decodes it back from the bytes alone.
The decoded caches run the real continuation on the model, scored against the run on the
original cache (:mod:`kvtune.evaluate.metrics`). Encode and decode are timed on every context;
the first context is the warm-up and the median of the rest is reported.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch

from kvtune.codecs import PolicyConfig, decode_kv, encode_kv, original_nbytes
from kvtune.evaluate.capture import Capture, continuation_logits
from kvtune.evaluate.metrics import bootstrap_relative_accuracy, continuation_scores
from kvtune.evaluate.model import KVLayers, LoadedModel


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_after_warmup(seconds: list[float]) -> float:
    """Median of timings after dropping the first (warm-up) one when there are several."""
    return statistics.median(seconds[1:] if len(seconds) > 1 else seconds)


def roundtrip_contexts(cap: Capture, config: PolicyConfig, device: torch.device) -> tuple[KVLayers, dict[str, Any]]:
    """Encode and decode every context's KV through ``config``.

    Returns:
        ``(decoded, stats)``: decoded per-layer ``(N, kv_heads, T, head_dim)`` tensors on
        ``device`` in the capture dtype, and stats with ``stream_bytes`` (sum of
        ``len(stream)`` over contexts), ``original_bytes`` (bf16 size of the same KV),
        ``encode_seconds``/``decode_seconds`` lists (one per context).
    """
    enc_s, dec_s, stream_bytes, orig_bytes = [], [], 0, 0
    per_context: list[KVLayers] = []
    for i in range(cap.num_contexts):
        kv_i = cap.context_kv(i)
        _sync(device)
        t0 = time.perf_counter()
        stream = encode_kv(kv_i, config)
        t1 = time.perf_counter()
        decoded = decode_kv(stream, expect=config)
        decoded = [(k.to(device), v.to(device)) for k, v in decoded]
        _sync(device)
        t2 = time.perf_counter()
        enc_s.append(t1 - t0)
        dec_s.append(t2 - t1)
        stream_bytes += len(stream)
        orig_bytes += original_nbytes(kv_i)
        per_context.append(decoded)
    merged = [
        (torch.cat([c[l][0] for c in per_context]), torch.cat([c[l][1] for c in per_context]))
        for l in range(len(per_context[0]))
    ]
    return merged, {
        "stream_bytes": stream_bytes,
        "original_bytes": orig_bytes,
        "encode_seconds": enc_s,
        "decode_seconds": dec_s,
    }


class ContinuationEvaluator:
    """Scores policies on the ``continuation`` workload of a :class:`Capture`.

    Args:
        lm: the model the KV was captured from.
        cap: contexts, their KV and the baseline continuation logits.
    """

    workload = "continuation"

    def __init__(self, lm: LoadedModel, cap: Capture) -> None:
        self.lm = lm
        self.cap = cap

    def evaluate(self, config: PolicyConfig) -> dict[str, Any]:
        """Evaluate one policy.

        Returns:
            A trials row: ``compression_ratio`` (bf16 bytes / stream bytes), ``relative_accuracy``
            (fraction; see :mod:`kvtune.evaluate.metrics`) with its paired-bootstrap 95 %
            interval ``relative_accuracy_lo/hi``, ``ppl_ratio``, ``kl_mean`` (nats),
            ``top1_agreement``, ``encode_gbps``/``decode_gbps`` (GB/s of original bf16 KV,
            1 GB = 1e9 bytes; median over contexts after warm-up), ``stream_bytes``,
            ``original_bytes``, ``bits_per_element`` and ``eval_seconds``.
        """
        t0 = time.perf_counter()
        decoded, st = roundtrip_contexts(self.cap, config, self.lm.device)
        logits = continuation_logits(self.lm, self.cap, decoded)
        del decoded
        scores = continuation_scores(self.cap.baseline_logits, logits, self.cap.continuation_ids)
        lo, hi = bootstrap_relative_accuracy(scores.pop("per_context_nll_delta"))
        per_ctx_bytes = st["original_bytes"] / self.cap.num_contexts
        return {
            "compression_ratio": st["original_bytes"] / st["stream_bytes"],
            **scores,
            "relative_accuracy_lo": lo,
            "relative_accuracy_hi": hi,
            "encode_gbps": per_ctx_bytes / median_after_warmup(st["encode_seconds"]) / 1e9,
            "decode_gbps": per_ctx_bytes / median_after_warmup(st["decode_seconds"]) / 1e9,
            "stream_bytes": st["stream_bytes"],
            "original_bytes": st["original_bytes"],
            "bits_per_element": 16.0 * st["stream_bytes"] / st["original_bytes"],
            "eval_seconds": time.perf_counter() - t0,
        }
