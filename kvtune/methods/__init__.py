"""The registry of profiling methods (``kvtune profile --method NAME``).

A method is one module in this package defining a :class:`kvtune.run.method.Method` as
``METHOD``, plus its line in :func:`_register_builtin`; the run machinery (run folder, lock, trial store, tables, report, CLI)
is shared. Method modules import their heavy dependencies lazily, so listing the methods is
cheap.
"""

from __future__ import annotations

from kvtune.core.registry import Registry
from kvtune.run.method import Method

__all__ = ["METHODS", "Method", "register_method"]

METHODS: Registry[Method] = Registry("method")
"""``--method`` name -> :class:`~kvtune.run.method.Method`."""


def register_method(method: Method) -> Method:
    """Add ``method`` to :data:`METHODS` under ``method.name`` (a clash: DuplicateNameError)."""
    return METHODS.register(method.name, method)


def _register_builtin() -> None:
    from kvtune.methods import bicache, scd, tqc

    for module in (tqc, scd, bicache):
        register_method(module.METHOD)


_register_builtin()
