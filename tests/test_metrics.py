"""Continuation metrics against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from kvtune.evaluate import metrics


def test_token_nll_hand_value():
    logits = torch.tensor([[[0.0, math.log(3.0)]]])  # p = [0.25, 0.75]
    assert metrics.token_nll(logits, torch.tensor([[1]])).item() == pytest.approx(-math.log(0.75))
    assert metrics.token_nll(logits, torch.tensor([[0]])).item() == pytest.approx(-math.log(0.25))


def test_kl_and_top1_hand_values():
    p = torch.log(torch.tensor([[[0.5, 0.5]]]))
    q = torch.log(torch.tensor([[[0.9, 0.1]]]))
    expected = 0.5 * math.log(0.5 / 0.9) + 0.5 * math.log(0.5 / 0.1)
    assert metrics.kl_divergence(p, q).item() == pytest.approx(expected, rel=1e-5)
    assert metrics.kl_divergence(q, q).item() == pytest.approx(0.0, abs=1e-7)
    a = torch.tensor([[[1.0, 2.0], [3.0, 0.0]]])
    b = torch.tensor([[[0.0, 5.0], [0.0, 3.0]]])
    assert metrics.top1_agreement(a, b).tolist() == [[1.0, 0.0]]


def test_relative_accuracy_is_perplexity_ratio():
    torch.manual_seed(0)
    base = torch.randn(3, 6, 11)
    worse = base + 0.7 * torch.randn(3, 6, 11)
    ids = torch.randint(0, 11, (3, 6))
    s = metrics.continuation_scores(base, worse, ids)
    ppl_base = math.exp(metrics.token_nll(base[:, :-1], ids[:, 1:]).mean().item())
    ppl = math.exp(metrics.token_nll(worse[:, :-1], ids[:, 1:]).mean().item())
    assert s["relative_accuracy"] == pytest.approx(ppl_base / ppl, rel=1e-5)
    assert s["ppl_ratio"] == pytest.approx(ppl / ppl_base, rel=1e-5)
    same = metrics.continuation_scores(base, base, ids)
    assert same["relative_accuracy"] == pytest.approx(1.0) and same["kl_mean"] == pytest.approx(0.0, abs=1e-6)
    assert same["top1_agreement"] == 1.0


def test_bootstrap_interval_brackets_point_and_shrinks_with_agreement():
    delta = torch.tensor([0.01, 0.03, 0.02, 0.05, 0.00, 0.04])
    lo, hi = metrics.bootstrap_relative_accuracy(delta)
    point = math.exp(-delta.mean().item())
    assert lo < point < hi
    assert hi <= math.exp(-delta.min().item()) + 1e-9 and lo >= math.exp(-delta.max().item()) - 1e-9
    lo2, hi2 = metrics.bootstrap_relative_accuracy(torch.full((6,), 0.02))
    assert lo2 == pytest.approx(hi2) == pytest.approx(math.exp(-0.02))
