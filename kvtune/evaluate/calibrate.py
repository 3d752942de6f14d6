"""Calibration of head-aware mixed precision (MixHQ): which KV heads retrieve from far back.

DuoAttention (Xiao et al., 2024, sec. 3) splits attention heads into *retrieval* heads, which
attend to distant context, and *streaming* heads, which look only at the first "sink" tokens
and a recent window. MixHQ (KVServe, "Service-Aware KV Cache Compression for
Communication-Efficient Disaggregated LLM Serving", arXiv 2605.13734, modular strategy space) keeps every head but
gives retrieval heads high precision and streaming heads very low precision. The split is decided by a score
measured here on real text:

    score(layer, kv_head) = mean over query heads of the group and over late queries q of the
                            attention mass on keys k with  sink <= k < q - window

i.e. the share of attention a head puts outside the sink tokens and the local window. The
scores travel in the policy configuration, so the same heads get the same bits at run time.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvtune.core.errors import ConfigError
from kvtune.evaluate.model import LoadedModel

DEFAULT_SINK_TOKENS = 4
DEFAULT_WINDOW_TOKENS = 64


def distant_mask(tokens: int, *, sink: int, window: int) -> torch.Tensor:
    """``(tokens, tokens)`` bool mask of (query q, key k) pairs with ``sink <= k < q - window``."""
    q = torch.arange(tokens).unsqueeze(1)
    k = torch.arange(tokens).unsqueeze(0)
    return (k >= sink) & (k < q - window)


def retrieval_scores(attn: torch.Tensor, *, kv_heads: int, sink: int = DEFAULT_SINK_TOKENS,
                     window: int = DEFAULT_WINDOW_TOKENS) -> torch.Tensor:
    """Per-KV-head share of attention mass outside the sink tokens and the local window.

    Args:
        attn: ``(batch, q_heads, tokens, tokens)`` attention probabilities (rows sum to 1) of
            one layer; ``q_heads`` must be a multiple of ``kv_heads`` (grouped-query attention:
            query heads ``g * q_heads/kv_heads ...`` share KV head ``g``).
        kv_heads: number of KV heads.
        sink, window: the streaming-head pattern (first ``sink`` keys, last ``window`` keys).

    Returns:
        ``(kv_heads,)`` float32 in [0, 1]: the mean distant mass over the batch, the group's
        query heads and the queries that have any distant key (q > sink + window).

    Raises:
        ValueError: shapes that do not fit (non-square attention, q_heads % kv_heads != 0, or
            too few tokens to have any distant key).
    """
    b, hq, tq, tk = attn.shape
    if tq != tk or hq % kv_heads:
        raise ValueError(f"attention of shape {tuple(attn.shape)} does not fit {kv_heads} KV heads")
    if tq <= sink + window + 1:
        raise ValueError(f"{tq} tokens leave no distant keys for sink={sink}, window={window}")
    mask = distant_mask(tq, sink=sink, window=window).to(attn.device)
    mass = (attn.float() * mask).sum(-1)[:, :, sink + window + 1 :]  # (b, hq, late queries)
    per_q_head = mass.mean(dim=(0, 2))
    return per_q_head.reshape(kv_heads, hq // kv_heads).mean(dim=1).cpu()


@dataclass(frozen=True)
class HeadScores:
    """Retrieval scores of every (layer, KV head), with how they were measured.

    Attributes:
        scores: ``scores[layer][kv_head]``, floats in [0, 1] rounded to 4 decimals.
        sink_tokens, window_tokens: the streaming pattern the scores were measured against.
        tokens: calibration tokens per context; contexts: how many contexts.
    """

    scores: tuple[tuple[float, ...], ...]
    sink_tokens: int
    window_tokens: int
    tokens: int
    contexts: int

    def to_dict(self) -> dict:
        return {"scores": [list(s) for s in self.scores], "sink_tokens": self.sink_tokens,
                "window_tokens": self.window_tokens, "tokens": self.tokens, "contexts": self.contexts}

    @classmethod
    def from_dict(cls, d: dict) -> "HeadScores":
        return cls(scores=tuple(tuple(float(v) for v in s) for s in d["scores"]), sink_tokens=int(d["sink_tokens"]),
                   window_tokens=int(d["window_tokens"]), tokens=int(d["tokens"]), contexts=int(d["contexts"]))


@torch.inference_mode()
def calibrate_head_scores(lm: LoadedModel, input_ids: torch.Tensor, *, sink: int = DEFAULT_SINK_TOKENS,
                          window: int = DEFAULT_WINDOW_TOKENS) -> HeadScores:
    """Run the model with eager attention on real contexts and score every KV head.

    Args:
        lm: the model (its attention implementation is switched to ``eager`` for the pass,
            which materializes attention probabilities, and restored afterwards).
        input_ids: ``(N, T)`` real token ids (e.g. the first contexts of the run).

    Returns:
        :class:`HeadScores` with ``num_layers x kv_heads`` scores.
    """
    if input_ids.shape[-1] <= sink + window + 1:
        raise ConfigError(f"MixHQ head calibration needs contexts longer than {sink + window + 1} tokens "
                          f"(sink {sink} + window {window} + 1), got {input_ids.shape[-1]}; use longer "
                          "--context-tokens or a space without mixhq policies")
    model = lm.model
    previous = model.config._attn_implementation
    model.set_attn_implementation("eager")
    try:
        totals = torch.zeros(lm.num_layers, lm.kv_heads)
        for row in input_ids:
            out = model(input_ids=row.unsqueeze(0).to(lm.device), output_attentions=True, use_cache=False)
            for layer, attn in enumerate(out.attentions):
                totals[layer] += retrieval_scores(attn, kv_heads=lm.kv_heads, sink=sink, window=window)
    finally:
        model.set_attn_implementation(previous)
    mean = totals / input_ids.shape[0]
    scores = tuple(tuple(round(float(v), 4) for v in layer) for layer in mean)
    return HeadScores(scores=scores, sink_tokens=sink, window_tokens=window, tokens=int(input_ids.shape[1]),
                      contexts=int(input_ids.shape[0]))
