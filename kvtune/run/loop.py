"""The one ask/tell loop: any registered optimizer, a trial store, resume.

Used by every method that searches a space (T/Q/C policies, the SCD grid). Trials already in
the run folder are told to the optimizer first, so a resumed run continues the same search
and never evaluates a stored candidate again.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

__all__ = ["ask_tell", "in_order"]


def ask_tell(optimizer: Any, candidates: Iterable[Any], *, budget: int, done: Mapping[str, dict[str, Any]],
             evaluate: Callable[[Any], dict[str, Any]], on_record: Callable[[dict[str, Any]], None]) -> int:
    """Tell ``optimizer`` the stored trials, then ask, evaluate and tell up to the budget.

    Args:
        optimizer: a :class:`kvtune.search.optimizers.Optimizer` (``ask() -> candidate | None``,
            ``tell(candidate, record)``).
        candidates: the space's candidates (``policy_id`` attribute).
        budget: total evaluations wanted, stored ones included.
        done: stored trial records by ``policy_id`` (told, not evaluated again).
        evaluate: ``evaluate(candidate) -> trial record``.
        on_record: called with each new record before it is told (append it to the trial
            store there, so a kill after this point loses nothing).

    Returns:
        The number of candidates evaluated now.
    """
    for cand in candidates:
        if cand.policy_id in done:
            optimizer.tell(cand, done[cand.policy_id])
    n = 0
    for _ in range(max(budget - len(done), 0)):
        cand = optimizer.ask()
        if cand is None:
            break
        record = evaluate(cand)
        on_record(record)
        optimizer.tell(cand, record)
        n += 1
    return n


def in_order(candidates: Iterable[Any]) -> Any:
    """The ``exhaustive`` optimizer over a fixed list of candidates (asked in list order).

    ``candidates``: objects with distinct ``index`` values and a ``policy_id``.
    """
    from kvtune.search.optimizers import make_optimizer
    from kvtune.search.space import SearchSpace

    space = SearchSpace(name="list", path=Path("<list>"), description="a fixed list of candidates", parameters=[],
                        fixed={}, candidates=list(candidates))
    return make_optimizer("exhaustive", space)
