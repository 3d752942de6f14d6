"""The one ask/tell loop: any registered optimizer, a trial store, resume.

Used by every method that searches a space (T/Q/C policies, the SCD grid). Trials already in
the run folder are told to the optimizer first, so a resumed run continues the same search
and never evaluates a stored candidate again. Candidates are evaluated by a
trial pool (:mod:`kvtune.run.executors`): in this process, or on several workers with the
running candidates as the optimizer's pending ones.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from kvtune.run.executors.base import InOrderPool, TrialPool

__all__ = ["ask_tell", "in_order"]


def ask_tell(optimizer: Any, candidates: Iterable[Any], *, budget: int, done: Mapping[str, dict[str, Any]],
             on_record: Callable[[dict[str, Any]], None], evaluate: Callable[[Any], dict[str, Any]] | None = None,
             batch: int = 1, pool: TrialPool | None = None) -> int:
    """Tell ``optimizer`` the stored trials, then ask, evaluate and tell up to the budget.

    Candidates are evaluated by ``pool`` (:class:`kvtune.run.executors.base.TrialPool`; by
    default ``evaluate`` in this process, up to ``batch`` asked at once). The loop keeps up to
    ``pool.slots`` candidates in flight: it asks ``optimizer.ask_batch(q, pending)`` (a
    sequential greedy batch: see :mod:`kvtune.search.optimizers.base`) with the running
    candidates as ``pending``, and records and tells each result as it finishes (order of
    completion). A pool whose results overlap (parallel workers) is topped up after every
    result; an in-order pool is asked a whole batch again once the last one is told. With one
    slot this is the one-at-a-time loop (``ask`` -> evaluate -> tell).

    Each candidate is recorded at most once: a pool returns each submitted candidate once, and
    a result for a candidate that is not in flight (a stale duplicate) is dropped.

    Args:
        optimizer: a :class:`kvtune.search.optimizers.Optimizer` (``ask_batch(q, pending) ->
            list``, ``tell(candidate, record)``).
        candidates: the space's candidates (``policy_id`` attribute).
        budget: total evaluations wanted, stored ones included.
        done: stored trial records by ``policy_id`` (told, not evaluated again).
        on_record: called with each new record before it is told (append it to the trial
            store there, so a kill after this point loses nothing; it may add keys, such as
            the ``trial`` number, which the optimizer is then told too).
        evaluate: ``evaluate(candidate) -> trial record`` (when no ``pool`` is given).
        batch: the most candidates asked at once by the default pool (>= 1).
        pool: evaluates the candidates instead of ``evaluate``.

    Returns:
        The number of candidates evaluated now.

    Raises:
        PendingError: ``batch`` is not an integer >= 1 (raised before anything is evaluated).
        ValueError: neither ``evaluate`` nor ``pool`` given.
        ExecutorError: see :meth:`TrialPool.next_finished`.
    """
    from kvtune.search.optimizers.base import PendingError

    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise PendingError(f"batch must be an integer >= 1, got {batch!r}")
    if pool is None:
        if evaluate is None:
            raise ValueError("ask_tell needs evaluate or pool")
        pool = InOrderPool(evaluate, batch)
    for cand in candidates:
        if cand.policy_id in done:
            optimizer.tell(cand, done[cand.policy_id])
    left = max(budget - len(done), 0)
    running: dict[str, Any] = {}  # policy_id -> candidate in flight
    n = 0
    while n < left:
        room = min(pool.slots, left - n) - len(running)
        if room > 0 and (pool.overlaps or not running):
            for cand in optimizer.ask_batch(room, list(running.values())):
                running[cand.policy_id] = cand
                pool.submit(cand)
        if not running:
            break
        cand, record = pool.next_finished()
        if running.pop(cand.policy_id, None) is None:
            continue
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
