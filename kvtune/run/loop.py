"""The one ask/tell loop: any registered optimizer, a trial store, resume.

Used by every method that searches a space (T/Q/C policies, the SCD grid). Trials already in
the run folder are told to the optimizer first, so a resumed run continues the same search
and never evaluates a stored candidate again. Candidates can be asked in batches
(``batch=q``), the shape of a search whose trials run on several workers.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

__all__ = ["ask_tell", "evaluate_in_order", "in_order"]


def ask_tell(optimizer: Any, candidates: Iterable[Any], *, budget: int, done: Mapping[str, dict[str, Any]],
             evaluate: Callable[[Any], dict[str, Any]], on_record: Callable[[dict[str, Any]], None],
             batch: int = 1) -> int:
    """Tell ``optimizer`` the stored trials, then ask, evaluate and tell up to the budget.

    Candidates are asked in batches of up to ``batch`` (``optimizer.ask_batch(q)``, a
    sequential greedy batch: see :mod:`kvtune.search.optimizers.base`) and evaluated one after
    the other here; each result is recorded and told as it finishes, then the next batch is
    asked. With ``batch=1`` this is the one-at-a-time loop (``ask`` -> evaluate -> tell).

    Args:
        optimizer: a :class:`kvtune.search.optimizers.Optimizer` (``ask_batch(q, pending) ->
            list``, ``tell(candidate, record)``).
        candidates: the space's candidates (``policy_id`` attribute).
        budget: total evaluations wanted, stored ones included.
        done: stored trial records by ``policy_id`` (told, not evaluated again).
        evaluate: ``evaluate(candidate) -> trial record``.
        on_record: called with each new record before it is told (append it to the trial
            store there, so a kill after this point loses nothing).
        batch: the most candidates asked at once (>= 1).

    Returns:
        The number of candidates evaluated now.

    Raises:
        PendingError: ``batch`` is not an integer >= 1 (raised before anything is evaluated).
    """
    from kvtune.search.optimizers.base import PendingError

    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise PendingError(f"batch must be an integer >= 1, got {batch!r}")
    for cand in candidates:
        if cand.policy_id in done:
            optimizer.tell(cand, done[cand.policy_id])
    left = max(budget - len(done), 0)
    n = 0
    while n < left:
        asked = optimizer.ask_batch(min(batch, left - n))
        if not asked:
            break
        for cand, record in evaluate_in_order(asked, evaluate):
            on_record(record)
            optimizer.tell(cand, record)
            n += 1
    return n


def evaluate_in_order(asked: list[Any], evaluate: Callable[[Any], dict[str, Any]]) -> Iterator[tuple[Any, dict[str, Any]]]:
    """``(candidate, record)`` of each asked candidate as it finishes: here one after the
    other in the order asked (an executor running them in parallel yields them as they
    finish, in any order)."""
    for cand in asked:
        yield cand, evaluate(cand)


def in_order(candidates: Iterable[Any]) -> Any:
    """The ``exhaustive`` optimizer over a fixed list of candidates (asked in list order).

    ``candidates``: objects with distinct ``index`` values and a ``policy_id``.
    """
    from kvtune.search.optimizers import make_optimizer
    from kvtune.search.space import SearchSpace

    space = SearchSpace(name="list", path=Path("<list>"), description="a fixed list of candidates", parameters=[],
                        fixed={}, candidates=list(candidates))
    return make_optimizer("exhaustive", space)
