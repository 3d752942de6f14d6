"""MixHQ calibration: retrieval scores on hand-made attention patterns with known answers."""

from __future__ import annotations

import pytest
import torch

from kvtune.evaluate.calibrate import distant_mask, retrieval_scores


def _pattern(tokens: int, kind: str) -> torch.Tensor:
    """(tokens, tokens) causal attention rows: 'stream' = sink + last 2 tokens, 'retrieve' = uniform."""
    a = torch.zeros(tokens, tokens)
    for q in range(tokens):
        if kind == "retrieve":
            a[q, : q + 1] = 1.0 / (q + 1)
        else:
            keys = sorted({0, max(q - 1, 0), q})
            a[q, keys] = 1.0 / len(keys)
    return a


def test_distant_mask_small_case():
    m = distant_mask(6, sink=1, window=2)
    # query 4 may look at keys 1 (k >= 1 and k < 4 - 2); query 5 at keys 1, 2
    assert m[4].nonzero().flatten().tolist() == [1]
    assert m[5].nonzero().flatten().tolist() == [1, 2]
    assert not m[:4].any()


def test_streaming_head_scores_zero_and_retrieval_head_high():
    t = 64
    stream, retrieve = _pattern(t, "stream"), _pattern(t, "retrieve")
    # 4 query heads, 2 KV heads (GQA groups of 2): KV head 0 streams, KV head 1 retrieves
    attn = torch.stack([stream, stream, retrieve, retrieve]).unsqueeze(0)
    s = retrieval_scores(attn, kv_heads=2, sink=1, window=4)
    assert s[0].item() == pytest.approx(0.0, abs=1e-7)
    # uniform rows: mass on keys 1..q-5 is (q-5)/(q+1); average over q = 6..63
    expected = sum((q - 5) / (q + 1) for q in range(6, t)) / (t - 6)
    assert s[1].item() == pytest.approx(expected, rel=1e-5)


def test_mixed_group_averages_its_query_heads():
    t = 40
    attn = torch.stack([_pattern(t, "stream"), _pattern(t, "retrieve")]).unsqueeze(0)
    both = retrieval_scores(attn, kv_heads=1, sink=1, window=4)
    alone = retrieval_scores(attn[:, 1:], kv_heads=1, sink=1, window=4)
    assert both.item() == pytest.approx(alone.item() / 2, rel=1e-6)


def test_bad_shapes_raise():
    with pytest.raises(ValueError, match="does not fit"):
        retrieval_scores(torch.rand(1, 3, 10, 10), kv_heads=2)
    with pytest.raises(ValueError, match="no distant keys"):
        retrieval_scores(torch.rand(1, 2, 10, 10), kv_heads=2, sink=4, window=8)


def test_contexts_too_short_for_calibration_are_a_config_error():
    from types import SimpleNamespace

    from kvtune.core.errors import ConfigError
    from kvtune.evaluate.calibrate import calibrate_head_scores

    lm = SimpleNamespace(model=None)  # the length check comes before any model call
    with pytest.raises(ConfigError, match="longer than 69 tokens.*--context-tokens"):
        calibrate_head_scores(lm, torch.zeros(2, 64, dtype=torch.long), sink=4, window=64)
