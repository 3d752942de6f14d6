"""Accuracy metrics of runs on decoded KV against the uncompressed run, with intervals.

All functions are pure: they take logits, targets or per-sample scores and return floats or
per-context tensors, so they can be tested on hand-made inputs.

Every workload reports relative accuracy = task score with decoded KV / task score with the
original KV on the same samples (the definition KVServe, arXiv 2605.13734, reports), with a
paired bootstrap 95 % interval over samples: :func:`bootstrap_relative_accuracy` for log-likelihood scores (continuation and the
teacher-forced cheap fidelity of qa/needle/summarize), :func:`bootstrap_ratio_of_means` for
mean task scores (F1, ROUGE-L, accuracy). :func:`report_relative_accuracy` gives the reported
column, :func:`spearman` the cheap-vs-full rank correlation of a re-evaluated Pareto set.

Relative accuracy (the number the search, the Pareto front and the tables use) is defined for
the ``continuation`` workload as a ratio of task scores, so that 1.0 means "as good as the original": the task
score of a run is the geometric-mean probability it assigns to the real continuation tokens,
``exp(-mean NLL) = 1 / perplexity``, so

    relative_accuracy = score(decoded KV) / score(original KV) = ppl_original / ppl_decoded.

1.0 means the decoded cache predicts the real text exactly as well as the original; a 20 %
perplexity increase gives 1 / 1.2 = 0.833.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from kvtune.evaluate.spool import DiskTensor


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
    return kl_from_logprobs(torch.log_softmax(base_logits.float(), dim=-1), torch.log_softmax(logits.float(), dim=-1))


def kl_from_logprobs(base_logp: torch.Tensor, logp: torch.Tensor) -> torch.Tensor:
    """KL(P_base || P) per position (nats) from log-probabilities: ``(..., vocab)`` float32
    -> ``(...)`` float32, clamped at 0 (rounding can make it slightly negative)."""
    return (base_logp.exp() * (base_logp - logp)).sum(-1).clamp_min(0.0)


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
        :func:`summarize_continuation` of :func:`continuation_token_stats` (the same numbers
        as a streamed evaluation that scores a few contexts at a time).
    """
    base = ContinuationBaseline.from_logits(base_logits, continuation_ids)
    return summarize_continuation(continuation_token_stats(base, logits))


@dataclass
class ContinuationBaseline:
    """What scoring a continuation run against the uncompressed run needs of the latter.

    Kept instead of the baseline logits (``(N, C, vocab)``): the log-probabilities are the
    same size, but the run on decoded KV is then scored a few contexts at a time and its
    logits are never all held (see :func:`continuation_token_stats`).

    Attributes:
        logp: ``(N, C, vocab)`` float32 log-softmax of the baseline logits (for the KL), in
            memory or spooled to disk (:class:`~kvtune.evaluate.spool.DiskTensor`; see
            :meth:`from_batches`).
        argmax: ``(N, C)`` int64 top-1 tokens of the baseline logits.
        targets: ``(N, C - 1)`` int64 continuation tokens 1..C-1 (position i predicts i + 1).
        nll: ``(N, C - 1)`` float32 baseline NLL (nats) of each target.
    """

    logp: "torch.Tensor | DiskTensor"
    argmax: torch.Tensor
    targets: torch.Tensor
    nll: torch.Tensor

    @classmethod
    def from_logits(cls, base_logits: torch.Tensor, continuation_ids: torch.Tensor) -> "ContinuationBaseline":
        """From ``(N, C, vocab)`` baseline logits and the ``(N, C)`` int64 continuation ids."""
        logp = torch.log_softmax(base_logits.float(), dim=-1)
        targets = continuation_ids[:, 1:]
        nll = -logp[:, :-1].gather(-1, targets.unsqueeze(-1)).squeeze(-1)
        return cls(logp=logp, argmax=base_logits.argmax(-1), targets=targets, nll=nll)

    def rows(self, start: int, stop: int) -> "ContinuationBaseline":
        """Contexts ``start:stop`` (views)."""
        return ContinuationBaseline(self.logp[start:stop], self.argmax[start:stop], self.targets[start:stop],
                                    self.nll[start:stop])

    _FIELDS = ("logp", "argmax", "targets", "nll")

    @classmethod
    def from_batches(cls, parts: Iterator["ContinuationBaseline"], n: int, *, spool: bool = False
                     ) -> "ContinuationBaseline":
        """The baseline of ``n`` contexts from the baselines of consecutive batches of them,
        copied into storage allocated once (never the batches and the whole at once); with
        ``spool`` the log-probabilities go to a temporary file
        (:class:`~kvtune.evaluate.spool.DiskTensor`) and only one batch is held at a time.

        Raises:
            ValueError: the batches do not hold exactly ``n`` contexts.
            SpoolError: the temporary file cannot hold them (``spool``).
        """
        from kvtune.evaluate.spool import DiskTensor

        out, filled = None, 0
        for part in parts:
            if out is None:
                out = cls(*(torch.empty((n, *getattr(part, f).shape[1:]), dtype=getattr(part, f).dtype)
                            if not (spool and f == "logp") else DiskTensor.empty((n, *part.logp.shape[1:]))
                            for f in cls._FIELDS))
            rows = part.argmax.shape[0]
            if filled + rows > n:
                raise ValueError(f"baseline batches hold more than {n} contexts")
            for f in cls._FIELDS:
                if isinstance(getattr(out, f), DiskTensor):
                    getattr(out, f).write(filled, getattr(part, f))
                else:
                    getattr(out, f)[filled : filled + rows].copy_(getattr(part, f))
            filled += rows
        if out is None or filled != n:
            raise ValueError(f"baseline batches hold {filled} contexts, not {n}")
        return out

    def loaded(self) -> "ContinuationBaseline":
        """This baseline with its log-probabilities in memory (read back when spooled)."""
        if isinstance(self.logp, torch.Tensor):
            return self
        return ContinuationBaseline(self.logp.read(), self.argmax, self.targets, self.nll)


def continuation_token_stats(base: ContinuationBaseline, logits: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per-position scores of the run on decoded KV against ``base``, one context at a time
    (temporaries of ``C * vocab`` floats, not ``N * C * vocab``).

    Args:
        base: the baseline of the same N contexts (read back from disk when spooled).
        logits: ``(N, C, vocab)`` logits of the run on the decoded KV.

    Returns:
        ``nll`` ``(N, C - 1)`` and ``nll_base`` ``(N, C - 1)`` (nats), ``kl`` ``(N, C)`` (nats,
        KL(P_base || P)), ``top1`` ``(N, C)`` (1.0 where both runs' argmax agree); float32.
        Concatenating the stats of consecutive context slices gives those of the whole.
    """
    base = base.loaded()
    nll, kl = [], []
    for i in range(logits.shape[0]):
        lq = torch.log_softmax(logits[i : i + 1].float(), dim=-1)
        nll.append(-lq[:, :-1].gather(-1, base.targets[i : i + 1].unsqueeze(-1)).squeeze(-1))
        kl.append(kl_from_logprobs(base.logp[i : i + 1], lq))
    return {"nll": torch.cat(nll), "nll_base": base.nll, "kl": torch.cat(kl),
            "top1": (base.argmax == logits.argmax(-1)).float()}


def summarize_continuation(stats: dict[str, torch.Tensor]) -> dict:
    """Continuation metrics from :func:`continuation_token_stats` (of all N contexts).

    Returns:
        dict with ``relative_accuracy`` (see module doc), ``ppl_ratio`` (ppl_decoded /
        ppl_original), ``kl_mean`` (nats per position), ``top1_agreement`` (fraction),
        ``nll_base`` and ``nll`` (mean nats per token), and ``per_context_nll_delta``
        (``(N,)`` tensor: mean NLL increase per context).
    """
    nll, nll_base = stats["nll"], stats["nll_base"]
    delta = (nll - nll_base).mean()
    return {
        "relative_accuracy": float(torch.exp(-delta)),
        "ppl_ratio": float(torch.exp(delta)),
        "kl_mean": float(stats["kl"].mean()),
        "top1_agreement": float(stats["top1"].mean()),
        "nll_base": float(nll_base.mean()),
        "nll": float(nll.mean()),
        "per_context_nll_delta": (nll - nll_base).mean(dim=1),
    }


def percentile_interval(values: torch.Tensor, confidence: float) -> tuple[float, float]:
    """Two-sided percentile interval of bootstrap replicates ``values`` (``(R,)`` float64).

    Linear interpolation between order statistics, except when some replicates are ``inf``
    (a ratio over a zero baseline): interpolating with inf gives NaN, so the order statistics
    on either side are taken instead and ``high`` may be ``inf`` (unbounded). Never NaN.
    """
    alpha = (1.0 - confidence) / 2
    if torch.isinf(values).any():
        ordered = values.sort().values
        last = ordered.shape[0] - 1
        return float(ordered[math.floor(alpha * last)]), float(ordered[math.ceil((1 - alpha) * last)])
    lo, hi = torch.quantile(values, torch.tensor([alpha, 1 - alpha], dtype=torch.float64))
    return float(lo), float(hi)


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
    return percentile_interval(ra, confidence)


# ---------------------------------------------------------------------- task-score ratios


def ratio_of_means(scores: torch.Tensor, base_scores: torch.Tensor) -> float:
    """``mean(scores) / mean(base_scores)``: the relative accuracy of a mean task score.

    A zero baseline has no meaningful ratio: 0 / 0 counts as 1.0 (neither run scores, so
    nothing measurable was lost) and x / 0 with x > 0 as ``inf``.

    Args:
        scores: ``(N,)`` per-sample task scores with decoded KV (e.g. F1, accuracy).
        base_scores: ``(N,)`` the same samples' scores with the original KV.
    """
    num, den = float(scores.double().mean()), float(base_scores.double().mean())
    if den == 0.0:
        return 1.0 if num == 0.0 else math.inf
    return num / den


def bootstrap_ratio_of_means(scores: torch.Tensor, base_scores: torch.Tensor, *, resamples: int = 2000,
                             confidence: float = 0.95, seed: int = 0) -> tuple[float, float]:
    """Paired bootstrap interval of :func:`ratio_of_means` over samples.

    Each resample draws samples with replacement and takes both runs' scores of the same
    samples, so per-sample difficulty cancels.

    Args:
        scores, base_scores: ``(N,)`` paired per-sample scores.

    Returns:
        ``(low, high)`` percentile bounds at ``confidence`` (resamples with a zero baseline
        follow the 0/0 = 1 rule of :func:`ratio_of_means`; ``high`` is ``inf`` when more
        than ``(1 - confidence) / 2`` of the resamples have x / 0; never NaN).
    """
    a, b = scores.double().cpu(), base_scores.double().cpu()
    n = a.shape[0]
    if n < 2:
        v = ratio_of_means(a, b)
        return v, v
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, n, (resamples, n), generator=g)
    num, den = a[idx].mean(dim=1), b[idx].mean(dim=1)
    ra = torch.where(den == 0, torch.where(num == 0, 1.0, math.inf), num / den.where(den != 0, 1.0))
    return percentile_interval(ra, confidence)


def report_relative_accuracy(raw: float) -> float:
    """The ``relative_accuracy`` column: ``min(raw, 1.0)``.

    A relative accuracy above 100 % is noise, not a gain: a decoded cache holds
    no more information than the original. kvtune reports such values as exactly 1.0, also
    when the bootstrap interval lies wholly above 1.0 (it resamples contexts, not the token
    noise inside them; KIVI-8 on 4 essay windows measured 1.0005 [1.00002, 1.0011]). The raw
    value stays in ``relative_accuracy_raw`` and the bounds ``relative_accuracy_lo/hi`` are
    not changed, so the search's feasibility test on the lower bound sees the measurement.
    """
    return min(raw, 1.0)


def spearman(cheap_scores, full_scores) -> float:
    """Spearman rank correlation between the cheap- and full-fidelity scores of the same policies.

    Used by the report to show how well the cheap fidelity that drove the search ranks the
    final Pareto set. Ties get average ranks.

    Args:
        cheap_scores, full_scores: equal-length sequences of floats (e.g. ``relative_accuracy``).

    Returns:
        rho in [-1, 1]; ``nan`` when fewer than 2 policies or either side is constant.

    Raises:
        ValueError: the sequences differ in length.
    """
    from scipy.stats import spearmanr

    a = [float(x) for x in cheap_scores]
    b = [float(x) for x in full_scores]
    if len(a) != len(b):
        raise ValueError(f"spearman: {len(a)} cheap scores but {len(b)} full scores")
    if len(a) < 2 or len(set(a)) < 2 or len(set(b)) < 2:
        return math.nan
    return float(spearmanr(a, b).statistic)
