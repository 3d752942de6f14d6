"""Accuracy metrics of a continuation run on decoded KV against the uncompressed run.

All functions are pure: they take logits and targets and return floats or per-context
tensors, so they can be tested on hand-made inputs.

Relative accuracy (the number the search, the Pareto front and the tables use) is defined for
the ``continuation`` workload as a ratio of task scores, as the brief's section 6 asks: the task
score of a run is the geometric-mean probability it assigns to the real continuation tokens,
``exp(-mean NLL) = 1 / perplexity``, so

    relative_accuracy = score(decoded KV) / score(original KV) = ppl_original / ppl_decoded.

1.0 means the decoded cache predicts the real text exactly as well as the original; a 20 %
perplexity increase gives 1 / 1.2 = 0.833.
"""

from __future__ import annotations

import torch


def token_nll(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Negative log-likelihood of each target token (nats).

    Args:
        logits: ``(N, L, vocab)`` float logits; position i predicts ``targets[:, i]``.
        targets: ``(N, L)`` int64 token ids.

    Returns:
        ``(N, L)`` float32 NLL.
    """
    logp = torch.log_softmax(logits.float(), dim=-1)
    return -logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def kl_divergence(base_logits: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """KL(P_base || P) per position (nats), ``(N, L, vocab)`` -> ``(N, L)`` float32."""
    lp = torch.log_softmax(base_logits.float(), dim=-1)
    lq = torch.log_softmax(logits.float(), dim=-1)
    return (lp.exp() * (lp - lq)).sum(-1).clamp_min(0.0)


def top1_agreement(base_logits: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """1.0 where both runs' argmax tokens agree, else 0.0: ``(N, L, vocab)`` -> ``(N, L)``."""
    return (base_logits.argmax(-1) == logits.argmax(-1)).float()


def continuation_scores(base_logits: torch.Tensor, logits: torch.Tensor, continuation_ids: torch.Tensor) -> dict:
    """All continuation metrics of one policy, with per-context values for intervals.

    Args:
        base_logits: ``(N, C, vocab)`` logits of the run on the original KV.
        logits: ``(N, C, vocab)`` logits of the run on the decoded KV.
        continuation_ids: ``(N, C)`` the real continuation tokens; logits at position i are
            scored against token i + 1, so C - 1 tokens per context are scored.

    Returns:
        dict with ``relative_accuracy`` (see module doc), ``ppl_ratio`` (ppl_decoded /
        ppl_original), ``kl_mean`` (nats per position), ``top1_agreement`` (fraction),
        ``nll_base`` and ``nll`` (mean nats per token), and ``per_context_nll_delta``
        (``(N,)`` tensor: mean NLL increase per context).
    """
    targets = continuation_ids[:, 1:]
    nll_base = token_nll(base_logits[:, :-1], targets)
    nll = token_nll(logits[:, :-1], targets)
    delta = (nll - nll_base).mean()
    return {
        "relative_accuracy": float(torch.exp(-delta)),
        "ppl_ratio": float(torch.exp(delta)),
        "kl_mean": float(kl_divergence(base_logits, logits).mean()),
        "top1_agreement": float(top1_agreement(base_logits, logits).mean()),
        "nll_base": float(nll_base.mean()),
        "nll": float(nll.mean()),
        "per_context_nll_delta": (nll - nll_base).mean(dim=1),
    }


def bootstrap_relative_accuracy(per_context_nll_delta: torch.Tensor, *, resamples: int = 2000,
                                confidence: float = 0.95, seed: int = 0) -> tuple[float, float]:
    """Paired bootstrap interval of the relative accuracy over contexts.

    The pairing is by context: each resample draws contexts with replacement and uses the same
    contexts' NLL difference (decoded minus original), so shared difficulty cancels.

    Args:
        per_context_nll_delta: ``(N,)`` mean NLL increase per context (nats/token).

    Returns:
        ``(low, high)`` bounds of ``exp(-mean delta)`` at the given confidence.
    """
    d = per_context_nll_delta.double().cpu()
    n = d.shape[0]
    if n < 2:
        v = float(torch.exp(-d.mean()))
        return v, v
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, n, (resamples, n), generator=g)
    ra = torch.exp(-d[idx].mean(dim=1))
    alpha = (1.0 - confidence) / 2
    lo, hi = torch.quantile(ra, torch.tensor([alpha, 1 - alpha], dtype=torch.float64))
    return float(lo), float(hi)
