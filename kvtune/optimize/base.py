"""The seam between search and evaluation: an ask/tell optimizer over discrete candidates.

An optimizer sees the candidate list once, proposes candidates with :meth:`Optimizer.ask`
and learns results through :meth:`Optimizer.tell`. It never proposes a candidate twice, and
``ask`` returns ``None`` when it has nothing left to propose (space exhausted or early stop).
The profile loop owns the budget, the evaluation and the trial store; resumed runs replay
stored results through :meth:`tell` before asking again.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Any

from kvtune.errors import ConfigError
from kvtune.space import Candidate

OPTIMIZERS: dict[str, type["Optimizer"]] = {}


def register_optimizer(name: str) -> Callable[[type["Optimizer"]], type["Optimizer"]]:
    """Class decorator adding an optimizer to :data:`OPTIMIZERS` under ``name``."""

    def deco(cls: type[Optimizer]) -> type[Optimizer]:
        cls.name = name
        OPTIMIZERS[name] = cls
        return cls

    return deco


class Optimizer(ABC):
    """Base class: proposes candidates, receives their results.

    Args:
        candidates: the whole discrete space, in enumeration order.
        seed: makes the proposal sequence reproducible.
    """

    name: str = "base"

    def __init__(self, candidates: Sequence[Candidate], *, seed: int = 0) -> None:
        self.candidates = list(candidates)
        self.seed = seed
        self.told: dict[int, dict[str, Any]] = {}

    @abstractmethod
    def ask(self) -> Candidate | None:
        """Next candidate to evaluate, never one already told; ``None`` when done."""

    def tell(self, candidate: Candidate, result: dict[str, Any]) -> None:
        """Record a finished evaluation (a trials row: ratio, relative accuracy, speeds...)."""
        self.told[candidate.index] = result

    @property
    def pending(self) -> list[Candidate]:
        """Candidates not yet told, in enumeration order."""
        return [c for c in self.candidates if c.index not in self.told]


def make_optimizer(name: str, candidates: Sequence[Candidate], *, seed: int = 0) -> Optimizer:
    """Instantiate a registered optimizer.

    Raises:
        ConfigError: unknown optimizer name (the message lists the known ones).
    """
    if name not in OPTIMIZERS:
        raise ConfigError(f"unknown optimizer {name!r}; known: {', '.join(sorted(OPTIMIZERS))}")
    return OPTIMIZERS[name](candidates, seed=seed)
