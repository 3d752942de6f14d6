"""Small pure functions for BiCache quality numbers: cosines, pooling, bootstrap, depth choice.

BiCache ("Enabling KV Caching of Shared Prefix for Diffusion Language Models", arXiv 2606.07571),
Sec. 3-4: the reuse depth of a prefix-ratio bucket is
the deepest ``d`` whose quality, measured against full recompute, stays above a threshold
(the paper uses prefix-KV cosine similarity, 0.95-0.97). kvtune checks several quality
criteria at once and decides on the lower end of a bootstrap interval, so the chosen depth
is safe on the calibration data with margin.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

__all__ = [
    "CRITERIA",
    "Criterion",
    "Interval",
    "bootstrap_mean",
    "choose_depth",
    "mean_pool",
    "per_token_cosine",
    "retrieval_hits",
]

def per_token_cosine(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Cosine similarity per (request, token) of two per-layer tensors.

    Args:
        a, b: ``(B, heads, T, head_dim)`` (K or V; heads are concatenated) or ``(B, T, H)``.

    Returns:
        ``(B, T)`` float64 cosines (1.0 where both vectors are zero).
    """
    if a.dim() == 4:
        a = a.transpose(1, 2).flatten(2)
        b = b.transpose(1, 2).flatten(2)
    a, b = a.double(), b.double()
    num = (a * b).sum(-1)
    den = a.norm(dim=-1) * b.norm(dim=-1)
    return torch.where(den > 0, num / den.clamp_min(1e-300), torch.ones_like(num))

def mean_pool(hidden: torch.Tensor, mask: torch.Tensor, *, normalize: bool = True) -> torch.Tensor:
    """Masked mean pooling (sentence-transformers "mean tokens"), then L2 normalization.

    Args:
        hidden: ``(B, T, H)``.
        mask: ``(B, T)`` bool, True at the tokens to pool.

    Returns:
        ``(B, H)`` float32 embeddings (unit norm when ``normalize``).
    """
    m = mask.to(hidden.dtype).unsqueeze(-1)
    emb = (hidden * m).sum(1) / m.sum(1).clamp_min(1.0)
    return torch.nn.functional.normalize(emb, dim=-1) if normalize else emb

def retrieval_hits(queries: torch.Tensor, docs: torch.Tensor, query_groups: Sequence, doc_groups: Sequence) -> np.ndarray:
    """Top-1 retrieval hits: query i hits when its most similar document has its group.

    Args:
        queries: ``(Q, H)`` unit-norm embeddings.
        docs: ``(D, H)`` unit-norm embeddings.
        query_groups, doc_groups: group label (e.g. story id) of each query / document.

    Returns:
        ``(Q,)`` float64 array of 0/1 hits.
    """
    sims = queries.double() @ docs.double().T
    top = sims.argmax(dim=1).tolist()
    return np.array([1.0 if doc_groups[j] == query_groups[i] else 0.0 for i, j in enumerate(top)])

@dataclass(frozen=True)
class Interval:
    """A point estimate with a bootstrap interval (percentile, two-sided)."""

    mean: float
    lo: float
    hi: float

    def as_dict(self, prefix: str) -> dict[str, float]:
        """``{prefix: mean, prefix_lo: lo, prefix_hi: hi}``."""
        return {prefix: self.mean, f"{prefix}_lo": self.lo, f"{prefix}_hi": self.hi}

def bootstrap_mean(values: Sequence[float] | np.ndarray, *, resamples: int = 2000, confidence: float = 0.95,
                   seed: int = 0) -> Interval:
    """Mean of per-request values with a percentile bootstrap interval over requests.

    Returns:
        :class:`Interval`; with fewer than two values the interval is the point.
    """
    x = np.asarray(values, dtype=np.float64)
    if x.size == 0:
        return Interval(math.nan, math.nan, math.nan)
    m = float(x.mean())
    if x.size < 2:
        return Interval(m, m, m)
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, x.size, size=(resamples, x.size))
    means = x[idx].mean(axis=1)
    alpha = (1.0 - confidence) / 2
    lo, hi = np.quantile(means, [alpha, 1 - alpha])
    return Interval(m, float(lo), float(hi))

@dataclass(frozen=True)
class Criterion:
    """A quality criterion of the depth choice.

    Attributes:
        name: column stem in the quality frame (``<name>``, ``<name>_lo``, ``<name>_hi``).
        default_floor: the floor used when the caller gives none.
        description: one line for reports.
        statistic: which number is held to the floor: ``"lo"`` (lower end of the 95 %
            bootstrap interval) or ``"mean"`` (point estimate).
    """

    name: str
    default_floor: float
    description: str
    statistic: str = "lo"

    def column(self) -> str:
        """Quality-frame column compared with the floor (``name`` or ``name_lo``)."""
        return self.name if self.statistic == "mean" else f"{self.name}_{self.statistic}"

#: Quality criteria, by name. Floors: BiCache's prefix-KV cosine threshold (0.95-0.97 in the
#: paper), a final-embedding cosine of 0.99, and a relative retrieval accuracy of 0.97. The
#: cosines are held to the lower bootstrap bound; the retrieval ratio to its point estimate,
#: because with tens of questions one flipped top-1 moves that ratio's lower bound by ~7 %
#: (measured on all-MiniLM-L6-v2: 41 hits of 48, one lost -> 0.977 [0.929, 1.0]), while
#: reuse gained as often as it lost.
CRITERIA: dict[str, Criterion] = {
    c.name: c
    for c in (
        Criterion("kv_cosine", 0.95, "min over stale layers of the mean prefix K and V cosine vs full recompute"),
        Criterion("embedding_cosine", 0.99, "cosine of the final (mean-pooled) embedding vs full recompute"),
        Criterion("relative_retrieval", 0.97, "top-1 retrieval accuracy / accuracy with full recompute", "mean"),
    )
}

def choose_depth(
    depths: Sequence[int],
    quality: Mapping[str, Sequence[float]],
    floors: Mapping[str, float],
    *,
    use: str = "lo",
) -> int:
    """The deepest reuse depth whose quality stays above every floor at it and every shallower depth.

    Args:
        depths: the depths measured, e.g. ``[0, 1, ..., L]`` (0 must be among them).
        quality: per criterion name, the statistic at each depth (aligned with ``depths``),
            e.g. the lower bootstrap bound.
        floors: per criterion name, the floor; criteria absent from ``floors`` are ignored.
        use: label of the statistic, kept for error messages.

    Returns:
        The chosen depth; 0 (full recompute, quality 1 by definition) when depth 1 fails.

    Raises:
        ValueError: depth 0 missing, or a floor's criterion missing from ``quality``.
    """
    order = sorted(range(len(depths)), key=lambda i: depths[i])
    if not depths or depths[order[0]] != 0:
        raise ValueError("depth 0 (full recompute) must be among the measured depths")
    for name in floors:
        if name not in quality or len(quality[name]) != len(depths):
            raise ValueError(f"criterion {name!r} ({use}) is missing or not aligned with the depths")
    chosen = 0
    for i in order:
        ok = all(float(quality[n][i]) >= float(f) for n, f in floors.items())
        if not ok:
            break
        chosen = int(depths[i])
    return chosen
