"""Executors: where a run's trials are evaluated (``kvtune profile --executor NAME``).

- :mod:`kvtune.run.executors.base`: the interface (:class:`~kvtune.run.executors.base.Executor`,
  its per-stage :class:`~kvtune.run.executors.base.TrialPool`) and the in-process executor
  (the default);
- :mod:`kvtune.run.executors.ray_executor`: Ray actors, one per GPU or N on the CPUs.

:func:`make_executor` builds one from the command line's options.
"""

from __future__ import annotations

from kvtune.core.errors import ConfigError
from kvtune.run.executors.base import Executor, InProcessExecutor, check_workers

__all__ = ["EXECUTORS", "make_executor"]

#: ``--executor`` names.
EXECUTORS = ("inprocess", "ray")


def make_executor(name: str = "inprocess", workers: int = 1, address: str | None = None) -> Executor:
    """The executor ``name`` with ``workers`` workers (``address``: an existing Ray cluster).

    Nothing is started or connected here (:meth:`Executor.check` connects, before any model
    loads).

    Raises:
        ConfigError: an unknown ``name`` (the message lists the known ones), ``workers`` not an
            integer >= 1, or an ``address`` with an executor other than ``ray``.
    """
    if name not in EXECUTORS:
        raise ConfigError(f"unknown --executor {name!r}; known: {', '.join(EXECUTORS)}")
    check_workers(workers)
    if name == "inprocess":
        if address:
            raise ConfigError(f"--ray-address {address} is for --executor ray (the executor is {name!r})")
        return InProcessExecutor(workers)
    from kvtune.run.executors.ray_executor import RayExecutor

    return RayExecutor(workers, address=address or None)
