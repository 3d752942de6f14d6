"""The one registry type of kvtune: codec components, optimizers, workloads, SCD transfer
methods, BiCache adapters and run methods are all :class:`Registry` instances.

A registry is a read-mostly ``dict`` from name to object (usually a class), so ``name in
REGISTRY``, ``sorted(REGISTRY)`` and ``REGISTRY[name]`` work as before; what it adds is that
registering a name twice with a different object is an error (:class:`DuplicateNameError`),
and looking up an unknown name raises :class:`UnknownNameError` listing the known names.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, Generic, TypeVar

from kvtune.core.errors import RegistryError

__all__ = ["DuplicateNameError", "Registry", "UnknownNameError"]

T = TypeVar("T")


class UnknownNameError(RegistryError, KeyError):
    """A name that is not registered (also a ``KeyError``, so dict-style callers still work)."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class DuplicateNameError(RegistryError, ValueError):
    """A name registered twice with different objects."""


class Registry(dict, Generic[T]):
    """Name -> object registry with typed errors.

    Args:
        kind: what the registry holds, for messages (``"optimizer"``, ``"workload"``).
        items: initial ``(name, object)`` pairs (registered in order, so clashes are errors).

    Raises:
        DuplicateNameError: an initial name appears twice with different objects.
    """

    def __init__(self, kind: str, items: Iterable[tuple[str, T]] | dict[str, T] = ()) -> None:
        super().__init__()
        self.kind = kind
        for name, obj in dict(items).items() if isinstance(items, dict) else items:
            self.register(name, obj)

    def register(self, name: str, obj: T) -> T:
        """Register ``obj`` under ``name``; return ``obj``. Registering the same object again is
        a no-op (a module imported twice).

        Raises:
            DuplicateNameError: ``name`` is empty or not a string, or already holds another object.
        """
        if not isinstance(name, str) or not name:
            raise DuplicateNameError(f"{self.kind} name must be a non-empty string, got {name!r}")
        old = dict.get(self, name)
        if old is not None and old is not obj:
            raise DuplicateNameError(f"{self.kind} {name!r} is already registered ({_describe(old)}); "
                                     f"cannot register {_describe(obj)} under the same name")
        dict.__setitem__(self, name, obj)
        return obj

    def decorator(self, *names: str) -> Callable[[T], T]:
        """A class decorator registering the class under each of ``names``."""

        def deco(obj: T) -> T:
            for name in names:
                self.register(name, obj)
            return obj

        return deco

    def known(self) -> str:
        """The registered names, sorted and comma-separated (for messages)."""
        return ", ".join(sorted(self))

    def __getitem__(self, name: str) -> T:
        try:
            return dict.__getitem__(self, name)
        except (KeyError, TypeError):
            raise UnknownNameError(f"unknown {self.kind} {name!r}; known: {self.known()}") from None

    def __setitem__(self, name: str, obj: T) -> None:
        self.register(name, obj)

    def update(self, *args: Any, **kwargs: Any) -> None:  # type: ignore[override]
        for name, obj in dict(*args, **kwargs).items():
            self.register(name, obj)

    def setdefault(self, name: str, obj: T) -> T:  # type: ignore[override]
        return dict.get(self, name) or self.register(name, obj)

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}, [{self.known()}])"


def _describe(obj: Any) -> str:
    return getattr(obj, "__qualname__", None) or repr(obj)
