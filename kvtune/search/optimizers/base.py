"""The seam between search and evaluation: an ask/tell optimizer over discrete candidates.

An optimizer sees the candidate list once, proposes candidates with :meth:`Optimizer.ask`
and learns results through :meth:`Optimizer.tell`. It never proposes a candidate twice, and
``ask`` returns ``None`` when it has nothing left to propose (space exhausted or early stop).
The profile loop owns the budget, the evaluation and the trial store; resumed runs replay
stored results through :meth:`tell` before asking again.
"""

from __future__ import annotations

import inspect
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

import numpy as np

from kvtune.core.registry import Registry
from kvtune.core.errors import ConfigError
from kvtune.search.space import Candidate, SearchSpace

OPTIMIZERS: Registry[type["Optimizer"]] = Registry("optimizer")


def register_optimizer(name: str) -> Callable[[type["Optimizer"]], type["Optimizer"]]:
    """Class decorator adding an optimizer to :data:`OPTIMIZERS` under ``name``."""

    def deco(cls: type[Optimizer]) -> type[Optimizer]:
        OPTIMIZERS.register(name, cls)  # a name clash: DuplicateNameError
        cls.name = name
        return cls

    return deco


class Optimizer(ABC):
    """Base class: proposes candidates, receives their results.

    Args:
        space: the discrete search space (candidates in enumeration order, their GP features,
            their families and precision order).
        seed: makes the proposal sequence reproducible.
        q_min: the accuracy floor (fraction) for constrained optimizers.
        ratios: ``(n_candidates,)`` float64 compression ratios measured up front (cheap: no
            model forward pass), or ``None`` when not available.
    """

    name: str = "base"

    def __init__(self, space: SearchSpace, *, seed: int = 0, q_min: float = 0.97,
                 ratios: np.ndarray | None = None) -> None:
        self.space = space
        self.candidates = list(space.candidates)
        self.seed = seed
        self.q_min = q_min
        self.ratios = None if ratios is None else np.asarray(ratios, dtype=np.float64)
        if self.ratios is not None and self.ratios.shape != (len(self.candidates),):
            raise ValueError(f"ratios has shape {self.ratios.shape}, expected ({len(self.candidates)},)")
        self.told: dict[int, dict[str, Any]] = {}

    @abstractmethod
    def ask(self) -> Candidate | None:
        """Next candidate to evaluate, never one already told; ``None`` when done."""

    def tell(self, candidate: Candidate, result: dict[str, Any]) -> None:
        """Record a finished evaluation (a trials row: ratio, relative accuracy, speeds...)."""
        self.told[candidate.index] = result

    def chronology(self) -> list[int]:
        """Indices of the told candidates in the order they were evaluated.

        That is the order of the results' ``trial`` numbers when every result has one (the
        profile loop writes them, so a resumed run that replays its trials in another order
        recovers the original order), else the order of :meth:`tell` calls.
        """
        order = list(self.told)
        trials = [self.told[i].get("trial") if isinstance(self.told[i], dict) else None for i in order]
        if order and all(isinstance(t, (int, float)) and not isinstance(t, bool) for t in trials):
            return [i for _, _, i in sorted(zip(trials, range(len(order)), order))]
        return order

    @property
    def pending(self) -> list[Candidate]:
        """Candidates not yet told, in enumeration order."""
        return [c for c in self.candidates if c.index not in self.told]


def make_optimizer(name: str, space: SearchSpace, *, seed: int = 0, q_min: float = 0.97,
                   ratios: np.ndarray | None = None, **options: Any) -> Optimizer:
    """Instantiate a registered optimizer (arguments as in :class:`Optimizer`).

    ``options`` are passed on as keyword arguments of the optimizer's constructor (its tuning
    knobs, e.g. ``n_init`` of ``mobo``); an option the optimizer does not take is a
    :class:`ConfigError`.

    Raises:
        ConfigError: unknown optimizer name (the message lists the known ones), or an option
            the optimizer does not take.
    """
    if name not in OPTIMIZERS:
        raise ConfigError(f"unknown optimizer {name!r}; known: {', '.join(sorted(OPTIMIZERS))}")
    cls = OPTIMIZERS[name]
    if options:
        accepted: set[str] = set()
        for klass in cls.__mro__:  # follow **kwargs up to the first constructor without them
            if "__init__" not in vars(klass):
                continue
            params = inspect.signature(klass.__init__).parameters
            accepted |= {k for k, p in params.items() if p.kind is not p.VAR_KEYWORD} - {"self", "space"}
            if not any(p.kind is p.VAR_KEYWORD for p in params.values()):
                break
        unknown = sorted(set(options) - accepted)
        if unknown:
            known = sorted(accepted - {"seed", "q_min", "ratios"})
            raise ConfigError(f"optimizer {name!r} takes no option(s) {unknown}; its options: {known}")
    return cls(space, seed=seed, q_min=q_min, ratios=ratios, **options)
