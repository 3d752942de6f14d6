"""The seam between search and evaluation: an ask/tell optimizer over discrete candidates.

An optimizer sees the candidate list once, proposes candidates with :meth:`Optimizer.ask`
(one) or :meth:`Optimizer.ask_batch` (up to ``q`` while others are still being evaluated,
the *pending* candidates) and learns results through :meth:`Optimizer.tell`, in any order.
It never proposes a candidate twice: not one already told, not a pending one, not twice in
one batch (:meth:`Optimizer.ask_batch` checks every proposal). ``ask`` returns ``None`` and
``ask_batch`` an empty list when there is nothing to propose (space exhausted or early stop;
with candidates pending, possibly only until their results are told). The profile loop (or
an executor) owns the budget, the evaluation and the trial store; resumed runs replay stored
results through :meth:`tell` before asking again.

A batch is built by *sequential greedy* selection: each optimizer implements
:meth:`Optimizer.propose` (the next candidate given the pending ones), and ``ask_batch(q,
pending)`` calls it ``q`` times, each time with the candidates chosen so far added to the
pending ones. Each optimizer documents how it accounts for pending candidates (``mobo``:
BoTorch ``X_pending`` or a kriging believer; ``kvserve``: fantasized results and tentative
pruning; Optuna: ``RUNNING`` trials; ``random``/``exhaustive``: skipped).
"""

from __future__ import annotations

import inspect
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from kvtune.core.registry import Registry
from kvtune.core.errors import ConfigError, KvtuneError
from kvtune.search.optimizers.gp import compute_device
from kvtune.search.space import Candidate, SearchSpace

OPTIMIZERS: Registry[type["Optimizer"]] = Registry("optimizer")


class PendingError(KvtuneError, ValueError):
    """A batch ask with a bad ``q`` or bad pending candidates (not of this space, repeated,
    or already told), or an optimizer that proposed a candidate it must not (a defect)."""


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
        device: the torch device of the run (``--device``), where the model-based optimizers
            (``mobo``, ``kvserve``) fit their Gaussian processes and score acquisitions; the
            others ignore it. ``None`` (default): the CPU. Proposals are returned on the host.

    Raises:
        ConfigError: an unusable ``device`` (:func:`~kvtune.search.optimizers.gp.compute_device`:
            not a device, ``meta``, or CUDA without CUDA), before anything is fitted.
    """

    name: str = "base"

    def __init__(self, space: SearchSpace, *, seed: int = 0, q_min: float = 0.97,
                 ratios: np.ndarray | None = None, device: torch.device | str | None = None) -> None:
        self.device = compute_device(device)
        self.space = space
        self.candidates = list(space.candidates)
        self.by_index = {c.index: c for c in self.candidates}
        self.seed = seed
        self.q_min = q_min
        self.ratios = None if ratios is None else np.asarray(ratios, dtype=np.float64)
        if self.ratios is not None and self.ratios.shape != (len(self.candidates),):
            raise ValueError(f"ratios has shape {self.ratios.shape}, expected ({len(self.candidates)},)")
        self.told: dict[int, dict[str, Any]] = {}

    def ask(self) -> Candidate | None:
        """Next candidate to evaluate (nothing pending), never one already told; ``None`` when
        done. Same as ``ask_batch(1)``."""
        batch = self.ask_batch(1)
        return batch[0] if batch else None

    def ask_batch(self, q: int, pending: Sequence[Candidate] = ()) -> list[Candidate]:
        """Up to ``q`` candidates to evaluate while ``pending`` ones are being evaluated.

        Sequential greedy: the ``j``-th is :meth:`propose` given ``pending`` plus the ``j - 1``
        chosen before it. The batch is shorter than ``q`` (possibly empty) when the optimizer
        has nothing more to propose now; with candidates pending, asking again after their
        results are told may give more.

        Args:
            q: the most candidates wanted (>= 1).
            pending: candidates asked earlier whose results are not told yet (any order).

        Returns:
            Distinct candidates, none told, none pending.

        Raises:
            PendingError: ``q < 1``; a pending candidate that is not one of this space's, is
                listed twice or is already told; or (a defect of the optimizer) a proposal
                that is told, pending or already in the batch.
        """
        if isinstance(q, bool) or not isinstance(q, int) or q < 1:
            raise PendingError(f"q must be an integer >= 1, got {q!r}")
        busy = self._checked_pending(pending)
        chosen: list[Candidate] = []
        for _ in range(q):
            cand = self.propose([*busy, *chosen])
            if cand is None:
                break
            if cand.index in self.told or any(cand.index == c.index for c in (*busy, *chosen)):
                raise PendingError(f"optimizer {self.name!r} proposed candidate #{cand.index} again "
                                   "(told, pending or already in the batch)")
            chosen.append(cand)
        return chosen

    @abstractmethod
    def propose(self, pending: Sequence[Candidate]) -> Candidate | None:
        """Next candidate given the ``pending`` ones (asked, results not told): neither told
        nor pending; ``None`` when there is nothing to propose now. Called by
        :meth:`ask_batch`, which checks ``pending`` first."""

    def _checked_pending(self, pending: Sequence[Candidate]) -> list[Candidate]:
        out, seen = [], set()
        for cand in pending:
            i = getattr(cand, "index", None)
            known = self.by_index.get(i) if isinstance(i, int) else None
            if known is None or (known is not cand and known.params != getattr(cand, "params", None)):
                raise PendingError(f"pending candidate {cand!r} is not a candidate of space {self.space.name!r}")
            if i in seen:
                raise PendingError(f"pending candidate #{i} is listed twice")
            if i in self.told:
                raise PendingError(f"pending candidate #{i} is already told (a told result is not pending)")
            seen.add(i)
            out.append(known)
        return out

    def free_candidates(self, pending: Sequence[Candidate] = ()) -> list[Candidate]:
        """The candidates neither told nor pending, in the space's order.

        A candidate's ``index`` is its identity, not its position in :attr:`candidates` (a list
        of a space's candidates, e.g. the Pareto set a refinement stage re-evaluates, keeps the
        space's indices)."""
        busy = {c.index for c in pending}
        return [c for c in self.candidates if c.index not in self.told and c.index not in busy]

    def free(self, pending: Sequence[Candidate] = ()) -> list[int]:
        """Indices (``Candidate.index``) of the candidates neither told nor pending, in order."""
        return [c.index for c in self.free_candidates(pending)]

    def tell(self, candidate: Candidate, result: dict[str, Any]) -> None:
        """Record a finished evaluation (a trials row: ratio, relative accuracy, speeds...).

        Results may be told in any order (e.g. as parallel evaluations finish); optimizers
        that depend on the order read it from :meth:`chronology`."""
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



def make_optimizer(name: str, space: SearchSpace, *, seed: int = 0, q_min: float = 0.97,
                   ratios: np.ndarray | None = None, device: torch.device | str | None = None,
                   **options: Any) -> Optimizer:
    """Instantiate a registered optimizer (arguments as in :class:`Optimizer`).

    ``options`` are passed on as keyword arguments of the optimizer's constructor (its tuning
    knobs, e.g. ``n_init`` of ``mobo``); an option the optimizer does not take is a
    :class:`ConfigError`.

    Raises:
        ConfigError: unknown optimizer name (the message lists the known ones), an option
            the optimizer does not take, or an unusable ``device``.
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
            known = sorted(accepted - {"seed", "q_min", "ratios", "device"})
            raise ConfigError(f"optimizer {name!r} takes no option(s) {unknown}; its options: {known}")
    return cls(space, seed=seed, q_min=q_min, ratios=ratios, device=device, **options)
