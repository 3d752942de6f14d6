"""Head-aware mixed precision ``mixhq``: the MixHQ quantizer of KVServe
("KVServe: Service-Aware KV Cache Compression for Communication-Efficient
Disaggregated LLM Serving", arXiv 2605.13734).

DuoAttention (Xiao et al., 2024, "DuoAttention: Efficient Long-Context LLM Inference with
Retrieval and Streaming Heads", sec. 3) observes that only a fraction of attention heads,
*retrieval heads*, attend to distant context; the others, *streaming heads*, look at the first
"sink" tokens and a recent window. DuoAttention keeps the full KV cache only for retrieval
heads and *drops* the distant tokens of streaming heads (keeping sink + recent). MixHQ keeps
every token of every head but spends the bits where they matter: the top fraction ``f`` of KV
heads by a retrieval score get ``high_bits``, the rest ``low_bits`` (down to 1).

Ranking. ``head_scores[layer][kv_head]`` (higher = more retrieval) comes from a calibration pass
on real data (:mod:`kvtune.evaluate.calibrate`) and is stored in the policy, so the stream is
self-describing and the same heads get the same bits at run time. Heads are ranked *globally*
over all ``(layer, kv_head)`` pairs by descending score; ties go to the lower layer, then the
lower head (a stable sort of the layer-major list). The top ``floor(f * N + 0.5)`` heads of the
``N`` pairs are high precision (:func:`rank_heads`).

Each head's tokens are quantized with the ``uniform`` block kernel at its width, with this
quantizer's grouping; like ``uniform``, optional bfloat16 sink/recent windows apply to every
head. In the stream the high and low heads of a layer are separate segments.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass
from typing import Any

import torch

from kvtune.codecs.base import BF16_BITS, Quantizer, param, register_quantizer
from kvtune.codecs.quantizers import GroupedWindowsMixin
from kvtune.core.errors import ConfigError

__all__ = ["MixHQ", "rank_heads", "normalize_head_scores"]

HeadScores = tuple[tuple[float, ...], ...]


def normalize_head_scores(scores: Any) -> HeadScores:
    """Per-layer per-KV-head scores -> a tuple of per-layer tuples of finite floats.

    Args:
        scores: nested sequences (``[[0.1, 0.7, 0.2], ...]``), a ``(layers, kv_heads)`` tensor
            or array, or an already normalized tuple.

    Raises:
        ConfigError: not a sequence of sequences of finite numbers.
    """
    if hasattr(scores, "tolist"):
        scores = scores.tolist()
    if not isinstance(scores, (list, tuple)):
        raise ConfigError(f"head_scores must be a list of per-layer lists of numbers, got {type(scores).__name__}")
    out = []
    for i, row in enumerate(scores):
        if hasattr(row, "tolist"):
            row = row.tolist()
        if not isinstance(row, (list, tuple)):
            raise ConfigError(f"head_scores[{i}] must be a list of per-head numbers, got {row!r}")
        vals = []
        for v in row:
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise ConfigError(f"head_scores[{i}] has {v!r}; scores must be finite numbers")
            vals.append(float(v))
        out.append(tuple(vals))
    return tuple(out)


@functools.lru_cache(maxsize=64)
def rank_heads(scores: HeadScores, fraction: float) -> tuple[tuple[bool, ...], ...]:
    """Which ``(layer, kv_head)`` pairs are high precision: the top ``floor(f * N + 0.5)`` by score.

    Args:
        scores: normalized per-layer per-head scores (layers may have different head counts).
        fraction: ``f`` in [0, 1].

    Returns:
        Per layer, per head: ``True`` for high precision. Ties are broken by (layer, head)
        order, so the result is deterministic.
    """
    lengths = [len(row) for row in scores]
    flat = torch.tensor([s for row in scores for s in row], dtype=torch.float64)
    n_high = math.floor(fraction * flat.numel() + 0.5)
    order = torch.argsort(-flat, stable=True)
    high = torch.zeros(flat.numel(), dtype=torch.bool)
    high[order[:n_high]] = True
    return tuple(tuple(part.tolist()) for part in torch.split(high, lengths))


@register_quantizer("mixhq")
@dataclass(frozen=True)
class MixHQ(GroupedWindowsMixin, Quantizer):
    """Head-aware mixed precision: top ``fraction`` of KV heads by retrieval score at
    ``high_bits``, the others at ``low_bits`` (see the module docstring).

    Per element cost of a head: its width plus the uniform metadata (``16 * (1 + asymmetric) /
    group_length`` bits); e.g. with 3 heads, ``fraction = 0.25`` (1 head), 8/2 bits, asymmetric
    per-token groups of 32: ``(9 + 3 + 3) / 3 = 5`` bits per element.

    Args:
        fraction: share of all (layer, kv_head) pairs that get ``high_bits``, in [0, 1].
        high_bits: width of retrieval heads, 1..8 or 16 (bfloat16).
        low_bits: width of streaming heads, 1..8 (``<= high_bits``).
        symmetric, granularity, group_size: the uniform grouping (as ``uniform``).
        sink_tokens, recent_tokens: bfloat16 windows on every head (as ``uniform``).
        head_scores: per layer, one score per KV head (higher = more retrieval); filled in from
            a calibration pass by :meth:`~kvtune.codecs.PolicyConfig.with_head_scores`.
            Encoding with no scores raises :class:`ConfigError`.
    """

    fraction: float = param(0.25, low=0.0, high=1.0, doc="share of KV heads at high_bits")
    high_bits: int = param(8, choices=(*range(1, 9), BF16_BITS), doc="bits of retrieval heads")
    low_bits: int = param(2, low=1, high=8, doc="bits of streaming heads")
    symmetric: bool = param(False, doc="symmetric grid (scale only) instead of min/max")
    granularity: str = param("per_token", choices=("per_token", "per_channel"), doc="grouping axis")
    group_size: int = param(32, low=0, high=2**31 - 1, doc="elements per group along the axis, 0 = whole axis")
    sink_tokens: int = param(0, low=0, doc="first tokens kept in bfloat16")
    recent_tokens: int = param(0, low=0, doc="last tokens kept in bfloat16")
    head_scores: tuple = param((), doc="per-layer tuples of per-KV-head retrieval scores (calibration)")

    def validate(self) -> None:
        if self.low_bits > self.high_bits:
            raise ConfigError(
                f"quantizer 'mixhq': parameter 'low_bits' = {self.low_bits} exceeds 'high_bits' = {self.high_bits}"
            )
        try:
            object.__setattr__(self, "head_scores", normalize_head_scores(self.head_scores))
        except ConfigError as exc:
            raise ConfigError(f"quantizer 'mixhq': parameter 'head_scores': {exc}") from None

    @property
    def symbol_bits(self) -> int:
        """The widest width (retrieval heads); blocks are coded by :meth:`coder`."""
        return self.high_bits

    def head_widths(self) -> tuple[int, ...]:
        return (self.high_bits, self.low_bits)

    def head_bits(self, heads: int, *, layer: int, kind: str) -> tuple[int, ...]:
        """``high_bits`` for the heads of ``layer`` ranked in the top fraction, else ``low_bits``.

        Raises:
            ConfigError: no scores, or scores that do not cover ``layer`` with ``heads`` heads.
        """
        if not self.head_scores:
            raise ConfigError(
                "mixhq needs head scores from a calibration pass (kvtune.evaluate.calibrate), set with "
                "PolicyConfig.with_head_scores(scores); this policy has none"
            )
        if not 0 <= layer < len(self.head_scores):
            raise ConfigError(f"mixhq head_scores cover layers 0..{len(self.head_scores) - 1}; got layer {layer}")
        if len(self.head_scores[layer]) != heads:
            raise ConfigError(
                f"mixhq head_scores give layer {layer} {len(self.head_scores[layer])} heads; the tensor has {heads}"
            )
        high = rank_heads(self.head_scores, self.fraction)[layer]
        return tuple(self.high_bits if h else self.low_bits for h in high)

    def with_head_scores(self, scores: Any) -> "MixHQ":
        """A copy with ``head_scores = scores`` (normalized by :func:`normalize_head_scores`)."""
        return dataclasses.replace(self, head_scores=normalize_head_scores(scores))

    def short_label(self) -> str:
        """``mix{fraction}:{high}/{low}{a|s}/{tok|ch}[/g{group_size}][/s{sink}][/r{recent}]``,
        e.g. ``mix0.25:8/2a/tok/g32``."""
        return f"mix{self.fraction:g}:{self.high_bits}/{self.low_bits}{self._grouping_label()}"
