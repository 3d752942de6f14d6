"""Baseline optimizers: exhaustive enumeration and uniform random sampling."""

from __future__ import annotations

import random

from kvtune.search.optimizers.base import Optimizer, register_optimizer
from kvtune.search.space import Candidate


@register_optimizer("exhaustive")
class ExhaustiveOptimizer(Optimizer):
    """Every candidate, in enumeration order (the ground truth for benchmarks)."""

    needs_ratios = False

    def ask(self) -> Candidate | None:
        pending = self.pending
        return pending[0] if pending else None


@register_optimizer("random")
class RandomOptimizer(Optimizer):
    """Uniform sampling without replacement; the order is a fixed permutation of the seed."""

    needs_ratios = False

    def __init__(self, space, **kwargs) -> None:
        super().__init__(space, **kwargs)
        self._order = list(range(len(self.candidates)))
        random.Random(self.seed).shuffle(self._order)

    def ask(self) -> Candidate | None:
        for i in self._order:
            if i not in self.told:
                return self.candidates[i]
        return None
