"""Where a run's trials are evaluated: the executor interface and the in-process executor.

The driver (:func:`kvtune.run.runner.run_method`) keeps the optimizer, the trial store (the
record of truth), the Pareto front and the report; an :class:`Executor` evaluates the
candidates it is handed. Per run it is started once (:meth:`Executor.start`, with the method,
its settings and the run folder: a :class:`RunJob`): it builds the method's context where the
trials are evaluated and hands the driver :attr:`Workers.context`, what the method's
:meth:`~kvtune.run.method.Method.stages`, :meth:`~kvtune.run.method.Method.run_info` and
:meth:`~kvtune.run.method.Method.finish` read. Per stage it gives a :class:`TrialPool`:
``submit(candidate)`` starts an evaluation, ``next_finished()`` returns the next
``(candidate, trial row)`` to finish. The ask/tell loop (:func:`kvtune.run.loop.ask_tell`)
keeps up to :attr:`TrialPool.slots` candidates in flight, asking the optimizer with the
running ones as pending candidates.

Executors: :class:`InProcessExecutor` (the default: the driver builds the full context with
:meth:`~kvtune.run.method.Method.prepare` and evaluates one trial after the other) and
:class:`kvtune.run.executors.ray_executor.RayExecutor` (Ray actors that each build the context
and evaluate trials in parallel; the driver loads no model and gets the light
:meth:`~kvtune.run.method.Method.driver_view` of an actor's context).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvtune.core.errors import ConfigError, KvtuneError

__all__ = ["Executor", "ExecutorError", "InOrderPool", "InProcessExecutor", "RunJob", "TrialPool", "Workers",
           "check_workers"]


class ExecutorError(KvtuneError):
    """An executor cannot go on: every worker died, or one candidate killed every worker it
    was sent to (the message names it)."""


@dataclass(frozen=True)
class RunJob:
    """What an executor needs to evaluate a run's trials.

    Attributes:
        method: the registered :class:`~kvtune.run.method.Method`.
        settings: its settings (picklable: workers build the context from them).
        run_dir: the run folder (on the driver's machine; locked by the driver).
        given: the objects passed to ``prepare`` besides the settings (already loaded models).
        hooks: the run's :class:`~kvtune.run.method.Hooks` (progress while the context is
            built); None: no progress.
    """

    method: Any
    settings: Any
    run_dir: Path
    given: Mapping[str, Any] = field(default_factory=dict)
    hooks: Any = None

    @property
    def run_hooks(self) -> Any:
        """:attr:`hooks`, or silent :class:`~kvtune.run.method.Hooks` when None."""
        from kvtune.run.method import Hooks

        return Hooks() if self.hooks is None else self.hooks


class TrialPool(ABC):
    """The candidates of one stage being evaluated.

    Attributes:
        slots: the most candidates worth keeping in flight (the workers able to take one).
        overlaps: True when results come in while others still run (the loop then tops the
            pool up after each result); False when a batch is evaluated whole, in order,
            before the next is asked.
    """

    slots: int = 1
    overlaps: bool = False

    @abstractmethod
    def submit(self, candidate: Any) -> None:
        """Start evaluating ``candidate`` (``policy_id``, ``index``, ``config``)."""

    @abstractmethod
    def next_finished(self) -> tuple[Any, dict[str, Any]]:
        """Block until a submitted candidate finishes; ``(candidate, trial row)``. Each
        submitted candidate is returned exactly once.

        Raises:
            ExecutorError: the candidate cannot be evaluated by any worker left.
            KvtuneError (and others): the method's own errors while evaluating.
        """

    @abstractmethod
    def __len__(self) -> int:
        """Candidates submitted and not returned yet."""


class InOrderPool(TrialPool):
    """Evaluates submitted candidates one after the other, in the order submitted, with
    ``evaluate(candidate) -> trial row`` in this process (``slots``: the batch asked at once)."""

    overlaps = False

    def __init__(self, evaluate: Callable[[Any], dict[str, Any]], slots: int = 1) -> None:
        self.evaluate = evaluate
        self.slots = slots
        self.queue: deque[Any] = deque()

    def submit(self, candidate: Any) -> None:
        self.queue.append(candidate)

    def next_finished(self) -> tuple[Any, dict[str, Any]]:
        cand = self.queue.popleft()
        return cand, self.evaluate(cand)

    def __len__(self) -> int:
        return len(self.queue)


class Workers(ABC):
    """An executor started for one run: a :class:`TrialPool` per stage, then :meth:`close`.

    Attributes:
        context: what the driver passes to the method's ``stages``, ``run_info``, ``finish``:
            the full context (in-process) or the :meth:`~kvtune.run.method.Method.driver_view`
            of a worker's context (remote workers).
    """

    context: Any = None

    @abstractmethod
    def pool(self, stage: Any) -> TrialPool:
        """The pool evaluating candidates of ``stage`` (a :class:`~kvtune.run.method.Stage`)."""

    def close(self) -> None:
        """Release the workers (idempotent)."""


class Executor(ABC):
    """Evaluates a run's trials; chosen with ``kvtune profile --executor NAME --workers N``.

    Args:
        workers: how many candidates are evaluated at once (>= 1).

    Raises:
        ConfigError: ``workers`` is not an integer >= 1.
    """

    name: str = ""

    def __init__(self, workers: int = 1) -> None:
        self.workers = check_workers(workers)

    def check(self, method: Any, settings: Any) -> None:
        """Fail before any model loads when the executor cannot run ``method`` with
        ``settings`` (typed errors); called by the runner right after the settings' own check."""

    @abstractmethod
    def start(self, job: RunJob) -> Workers:
        """Build the method's context where the trials are evaluated and return the started
        :class:`Workers` (their :attr:`Workers.context` is the driver's).

        Raises:
            KvtuneError (and subclasses): the method's own ``prepare`` errors;
                :class:`ExecutorError` when a remote worker cannot build its context.
        """

    def describe(self) -> dict[str, Any]:
        """What ``run.json`` records about the executor of the last (resumed) session."""
        return {"name": self.name, "workers": self.workers}


def check_workers(workers: Any) -> int:
    """``workers`` if it is an integer >= 1.

    Raises:
        ConfigError: anything else (the message names ``--workers``).
    """
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise ConfigError(f"--workers must be an integer >= 1, got {workers!r}")
    return workers


class InProcessExecutor(Executor):
    """Trials evaluated in the driver's process with the driver's context, one after the other
    (``workers``: the candidates asked at once, a batch evaluated in order; 1 is the
    one-at-a-time search)."""

    name = "inprocess"

    def start(self, job: RunJob) -> Workers:
        """``method.prepare`` in this process, into the run folder itself."""
        context = job.method.prepare(job.settings, job.run_dir, job.run_hooks, **dict(job.given))
        return InProcessWorkers(job.method, context, self.workers)


class InProcessWorkers(Workers):
    """:class:`InProcessExecutor` started for one run: pools evaluating with the full
    ``context``; :meth:`close` is the method's ``close(context)``."""

    def __init__(self, method: Any, context: Any, slots: int) -> None:
        self.method = method
        self.context = context
        self.slots = slots
        self.closed = False

    def pool(self, stage: Any) -> TrialPool:
        method, context = self.method, self.context
        return InOrderPool(lambda cand: method.evaluate(context, cand, stage), self.slots)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.method.close(self.context)
