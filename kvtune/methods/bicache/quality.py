"""Quality of prefix reuse at each depth vs full recompute, per prefix-ratio bucket.

BiCache ("Enabling KV Caching of Shared Prefix for Diffusion Language Models", arXiv 2606.07571),
Sec. 3 (profiling the reuse depth). For every request of a
bucket and every reuse depth ``d`` (and, for table rows, every codec policy the cached prefix
state is sent with), three numbers against full recompute of the same request:

(a) ``kv_cosine``: for each layer whose prefix K/V the suffix sees stale, the mean over
    prefix tokens of the cosine between the cached prefix K (and V) -- computed with the
    prefix alone, after the codec round trip if any -- and the prefix K (V) of full
    recompute; the request's value is the minimum over those layers and over K/V (1.0 at
    ``d = 0``). The stale layers are ``1..min(d + 1, L)``: layer ``d + 1`` is recomputed from
    the cached hidden state leaving layer d, so its prefix K/V equal the cached ones too
    (hence depth ``L - 1`` and ``L`` give the suffix identical outputs).
(b) ``embedding_cosine``: cosine of the final embedding (masked mean pooling, L2-normalized,
    as sentence-transformers does for all-MiniLM-L6-v2) with full recompute's.
(c) ``relative_retrieval``: top-1 retrieval accuracy of the bucket's questions against the
    bucket's passage windows embedded with reuse, divided by the accuracy with full
    recompute (paired bootstrap over questions); also ``top1_agreement``, the fraction of
    questions whose top-1 window is the same as with full recompute.

Every interval is a 95 % percentile bootstrap over requests (seeded).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kvtune.methods.bicache.adapters import EncoderAdapter
from kvtune.methods.bicache.state import PrefixState, roundtrip_prefix_state
from kvtune.methods.bicache.stats import bootstrap_mean, mean_pool, per_token_cosine, retrieval_hits
from kvtune.methods.bicache.workload import BiCacheRequest
from kvtune.codecs import PolicyConfig
from kvtune.evaluate.metrics import bootstrap_ratio_of_means, ratio_of_means

__all__ = ["EXACT", "POOLINGS", "BucketQuality", "encode_queries", "layer_cosines", "measure_bucket_quality", "pad_batch"]

#: Policy name of the in-memory float32 cache (no wire, no codec).
EXACT = "exact"
#: Pooling modes: which tokens the document embedding averages. "suffix" excludes the shared
#: instruction (INSTRUCTOR's convention), "all" is plain sentence-transformers mean pooling.
POOLINGS = ("suffix", "all")


def pad_batch(seqs: Sequence[Sequence[int]], pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad token sequences -> ``ids (B, N_max)`` long and ``mask (B, N_max)`` bool."""
    n = max((len(s) for s in seqs), default=0)
    ids = torch.full((len(seqs), n), pad_id, dtype=torch.long)
    mask = torch.zeros(len(seqs), n, dtype=torch.bool)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.as_tensor(list(s), dtype=torch.long)
        mask[i, : len(s)] = True
    return ids, mask


def _pool_mask(mask: torch.Tensor, prefix_tokens: int, pooling: str) -> torch.Tensor:
    if pooling == "all":
        return mask
    m = mask.clone()
    m[:, :prefix_tokens] = False
    return m


@torch.inference_mode()
def encode_queries(adapter: EncoderAdapter, queries: Sequence[Sequence[int]], *, batch_size: int = 32) -> torch.Tensor:
    """Embed questions on their own (full recompute, mean pooling over all tokens) -> ``(Q, H)``."""
    out = []
    for i in range(0, len(queries), batch_size):
        chunk = queries[i:i + batch_size]
        ids, mask = pad_batch([q[1:] for q in chunk])
        r = adapter.run([chunk[0][0]], ids, mask, depth=0)
        out.append(mean_pool(r.hidden, r.attention_mask))
    return torch.cat(out)


@torch.inference_mode()
def layer_cosines(cached: PrefixState, full: PrefixState) -> dict[str, np.ndarray]:
    """Per-layer mean cosine of the cached prefix K / V / layer output vs in-context ones.

    Args:
        cached: batch-1 state of the prefix alone (depth L).
        full: batch-B state captured from full recompute of B requests.

    Returns:
        ``{"key": (B, L), "value": (B, L), "hidden": (B, L)}`` per-request means over prefix tokens.
    """
    B = full.keys[0].shape[0]
    L = cached.num_layers
    res = {k: np.zeros((B, L)) for k in ("key", "value", "hidden")}
    for l in range(L):
        res["key"][:, l] = per_token_cosine(cached.keys[l].expand(B, -1, -1, -1), full.keys[l]).mean(1).numpy()
        res["value"][:, l] = per_token_cosine(cached.values[l].expand(B, -1, -1, -1), full.values[l]).mean(1).numpy()
        res["hidden"][:, l] = per_token_cosine(cached.hiddens[l + 1].expand(B, -1, -1), full.hiddens[l + 1]).mean(1).numpy()
    return res


@dataclass
class BucketQuality:
    """Quality measurements of one bucket.

    Attributes:
        rows: one dict per (depth, policy) with ``depth``, ``policy``, the means and 95 %
            intervals of ``kv_cosine``, ``embedding_cosine``, ``relative_retrieval``,
            ``top1_agreement``, and ``retrieval_accuracy`` / ``retrieval_accuracy_base``.
        layer_rows: one dict per layer with the mean key/value/hidden cosine of the prefix
            computed alone vs in context (the curve of issue 8).
        payload: per (depth, policy): payload bytes and measured encode/decode seconds.
    """

    rows: list[dict[str, Any]]
    layer_rows: list[dict[str, Any]]
    payload: dict[tuple[int, str], dict[str, float]]


@torch.inference_mode()
def measure_bucket_quality(
    adapter: EncoderAdapter,
    prefix_ids: Sequence[int],
    state: PrefixState,
    requests: Sequence[BiCacheRequest],
    query_emb: torch.Tensor,
    *,
    depths: Sequence[int],
    policies: Mapping[str, PolicyConfig | None],
    batch_size: int = 16,
    pooling: str = "suffix",
    seed: int = 0,
    codec_repeats: int = 3,
) -> BucketQuality:
    """Measure (a), (b), (c) for every depth x policy on one bucket's requests.

    Args:
        adapter, prefix_ids, state: the encoder, the shared prefix and its cached state (depth L).
        requests: the bucket's requests.
        query_emb: ``(len(requests), H)`` question embeddings (:func:`encode_queries`).
        depths: reuse depths (0 = full recompute is always measured and is the reference).
        policies: name -> codec policy of the prefix-state payload, or None for the exact
            in-memory cache (:data:`EXACT`).
        batch_size: requests per forward pass.
        pooling: one of :data:`POOLINGS`.
        seed: bootstrap seed.
        codec_repeats: payload round trips per (depth, policy); the median time is kept.
    """
    P = len(prefix_ids)
    n = len(requests)
    batches = [list(range(i, min(n, i + batch_size))) for i in range(0, n, batch_size)]
    padded = [pad_batch([requests[j].suffix_ids for j in b]) for b in batches]
    base_emb, base_kv = [], []
    for ids, mask in padded:
        r = adapter.run(prefix_ids, ids, mask, depth=0, capture=True)
        base_emb.append(mean_pool(r.hidden, _pool_mask(r.attention_mask, P, pooling)))
        base_kv.append(r.prefix_state)
    base = torch.cat(base_emb)
    stories = [q.story for q in requests]
    hits0 = retrieval_hits(query_emb, base, stories, stories)
    top0 = (query_emb.double() @ base.double().T).argmax(1)

    # the issue-8 curve: prefix alone vs in context, per layer
    per_layer = [layer_cosines(state, kv) for kv in base_kv]
    layer_rows = []
    for l in range(state.num_layers):
        row: dict[str, Any] = {"layer": l + 1}
        for kind in ("key", "value", "hidden"):
            vals = np.concatenate([pl[kind][:, l] for pl in per_layer])
            row.update(bootstrap_mean(vals, seed=seed).as_dict(f"{kind}_cosine"))
        layer_rows.append(row)

    rows: list[dict[str, Any]] = []
    ones = np.ones(n)
    rows.append(_row(0, "recompute", ones, ones, hits0, hits0, ones, seed))
    payload: dict[tuple[int, str], dict[str, float]] = {}
    for d in sorted(x for x in set(depths) if x > 0):
        for pname, policy in policies.items():
            if policy is None:
                used = state
            else:
                times = []
                for _ in range(max(1, codec_repeats)):
                    used, nbytes, timing = roundtrip_prefix_state(state, d, policy)
                    times.append(timing)
                payload[(d, pname)] = {
                    "payload_bytes": float(nbytes),
                    "encode_s": float(np.median([t.encode_s for t in times])),
                    "decode_s": float(np.median([t.decode_s for t in times])),
                }
            embs, kv_req = [], []
            for (ids, mask), kv in zip(padded, base_kv, strict=True):
                r = adapter.run(prefix_ids, ids, mask, depth=d, state=used)
                embs.append(mean_pool(r.hidden, _pool_mask(r.attention_mask, P, pooling)))
                B = ids.shape[0]
                worst = torch.full((B,), 1.0, dtype=torch.float64)
                for l in range(min(d + 1, state.num_layers)):
                    k_used = used.keys[l] if l < d else state.keys[l]  # layer d+1: K/V of the cached h_d
                    v_used = used.values[l] if l < d else state.values[l]
                    kc = per_token_cosine(k_used.expand(B, -1, -1, -1), kv.keys[l]).mean(1)
                    vc = per_token_cosine(v_used.expand(B, -1, -1, -1), kv.values[l]).mean(1)
                    worst = torch.minimum(worst, torch.minimum(kc, vc))
                kv_req.append(worst.numpy())
            emb = torch.cat(embs)
            emb_cos = (emb.double() * base.double()).sum(-1).numpy()
            hits = retrieval_hits(query_emb, emb, stories, stories)
            agree = ((query_emb.double() @ emb.double().T).argmax(1) == top0).double().numpy()
            rows.append(_row(d, pname, np.concatenate(kv_req), emb_cos, hits, hits0, agree, seed))
    return BucketQuality(rows, layer_rows, payload)


def _row(depth: int, policy: str, kv_cos: np.ndarray, emb_cos: np.ndarray, hits: np.ndarray, hits0: np.ndarray,
         agree: np.ndarray, seed: int) -> dict[str, Any]:
    rel = ratio_of_means(torch.as_tensor(hits), torch.as_tensor(hits0))
    lo, hi = bootstrap_ratio_of_means(torch.as_tensor(hits), torch.as_tensor(hits0), seed=seed)
    row: dict[str, Any] = {"depth": depth, "policy": policy, "requests": int(len(hits))}
    row.update(bootstrap_mean(kv_cos, seed=seed).as_dict("kv_cosine"))
    row.update(bootstrap_mean(emb_cos, seed=seed).as_dict("embedding_cosine"))
    row.update({"relative_retrieval": rel, "relative_retrieval_lo": lo, "relative_retrieval_hi": hi})
    row.update(bootstrap_mean(agree, seed=seed).as_dict("top1_agreement"))
    row["retrieval_accuracy"] = float(hits.mean())
    row["retrieval_accuracy_base"] = float(hits0.mean())
    row["embedding_cosine_min"] = float(np.min(emb_cos))
    return row
