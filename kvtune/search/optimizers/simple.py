"""Baseline optimizers: exhaustive enumeration and uniform random sampling.

Pending candidates (a batch ask while others are being evaluated) are simply skipped: the
proposal order does not depend on results, so a batch of ``q`` is the next ``q`` free
candidates of that order.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from kvtune.search.optimizers.base import Optimizer, register_optimizer
from kvtune.search.space import Candidate


@register_optimizer("exhaustive")
class ExhaustiveOptimizer(Optimizer):
    """Every candidate, in enumeration order (the ground truth for benchmarks)."""

    needs_ratios = False

    def propose(self, pending: Sequence[Candidate]) -> Candidate | None:
        free = self.free_candidates(pending)
        return free[0] if free else None


@register_optimizer("random")
class RandomOptimizer(Optimizer):
    """Uniform sampling without replacement; the order is a fixed permutation (of positions in
    the candidate list) drawn from the seed."""

    needs_ratios = False

    def __init__(self, space, **kwargs) -> None:
        super().__init__(space, **kwargs)
        self._order = list(range(len(self.candidates)))
        random.Random(self.seed).shuffle(self._order)

    def propose(self, pending: Sequence[Candidate]) -> Candidate | None:
        busy = {c.index for c in pending}
        for position in self._order:
            cand = self.candidates[position]
            if cand.index not in self.told and cand.index not in busy:
                return cand
        return None
