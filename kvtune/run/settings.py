"""One settings style for every method: a frozen, versioned dataclass that round-trips
through JSON (``run.json``'s ``settings``), checked field by field when read back, and
settable from the command line as ``--set name=value``.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from typing import Any, ClassVar

from kvtune.core.errors import ConfigError, KvtuneError

__all__ = ["RunSettings", "parse_overrides", "same_type"]


def same_type(value: Any, default: Any) -> bool:
    """Whether a stored settings value has the type of the field's default (a list of
    numbers for a tuple of numbers, a list of strings for a tuple of strings; bools and
    numbers are not interchangeable; an int is accepted for a float; a field whose default is
    None takes any value its class checks itself)."""
    if default is None:
        return True
    if isinstance(default, tuple):
        if not isinstance(value, (list, tuple)):
            return False
        if default and all(isinstance(v, str) for v in default):
            return all(isinstance(v, str) for v in value)
        if default and all(isinstance(v, dict) for v in default):
            return all(isinstance(v, dict) for v in value)
        return all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value)
    if isinstance(default, bool) or isinstance(value, bool):
        return isinstance(value, bool) and isinstance(default, bool)
    if isinstance(default, float):
        return isinstance(value, (int, float))
    return isinstance(value, type(default))


_WANT = {bool: "true or false", int: "an integer", float: "a number", str: "a string", tuple: "a list of numbers",
         dict: "an object"}


class RunSettings:
    """Mixin of a method's settings dataclass: ``to_dict``/``from_dict`` with a version.

    Subclasses are dataclasses with a ``version: int`` field (default :attr:`VERSION`) and
    default values for every field (the default's type is the field's type).
    """

    VERSION: ClassVar[int] = 1
    READABLE_VERSIONS: ClassVar[tuple[int, ...]] = (1,)

    def to_dict(self) -> dict[str, Any]:
        """The settings as JSON-ready values (tuples as lists)."""
        return {k: (list(v) if isinstance(v, tuple) else v) for k, v in dataclasses.asdict(self).items()}

    @classmethod
    def check_dict(cls, d: Mapping[str, Any], what: str = "run settings") -> None:
        """Check a stored settings object: its version, unknown keys, value types.

        Raises:
            KvtuneError: the message names ``what`` and the offending key.
        """
        if not isinstance(d, Mapping):
            raise KvtuneError(f"{what} must be a JSON object")
        if isinstance(d.get("version"), bool) or d.get("version") not in cls.READABLE_VERSIONS:
            raise KvtuneError(f"{what} version {d.get('version')!r} is not one of {cls.READABLE_VERSIONS}; "
                              "re-run the profile")
        unknown = set(d) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise KvtuneError(f"{what} have unknown keys {sorted(unknown)}")
        for f in dataclasses.fields(cls):
            default = _default(f)
            if f.name in d and not same_type(d[f.name], default):
                raise KvtuneError(f"{what}: {f.name} = {d[f.name]!r} is not {_want(default)}")

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]):
        """Rebuild settings saved by :meth:`to_dict` (lists back to tuples).

        Raises:
            KvtuneError: see :meth:`check_dict`.
        """
        cls.check_dict(d)
        kwargs = {f.name: (tuple(d[f.name]) if isinstance(_default(f), tuple) else d[f.name])
                  for f in dataclasses.fields(cls) if f.name in d}
        kwargs["version"] = cls.VERSION
        return cls(**kwargs)


def _want(default: Any) -> str:
    """What a value of ``default``'s type is, for messages."""
    if isinstance(default, tuple) and default and all(isinstance(v, str) for v in default):
        return "a list of strings"
    return _WANT.get(type(default), "a valid value")


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        return f.default_factory()  # type: ignore[misc]
    return None


def parse_overrides(cls: type, options: Mapping[str, str]) -> dict[str, Any]:
    """``--set name=value`` texts converted to the types of ``cls``'s fields.

    Numbers, true/false and strings are written as they are; a list as comma-separated
    values (``ranks=32,64``) or as JSON (``floors=[0.99,0.9]``); an object as JSON.

    Raises:
        KvtuneError: an unknown name (the message lists the known ones) or a value that does
            not parse as the field's type.
    """
    fields = {f.name: f for f in dataclasses.fields(cls) if f.name != "version"}
    out: dict[str, Any] = {}
    for name, text in options.items():
        if name not in fields:
            raise KvtuneError(f"--set {name}: not a setting of this method; known: {', '.join(sorted(fields))}")
        default = _default(fields[name])
        try:
            value = _parse(text, default)
        except ValueError:
            raise KvtuneError(f"--set {name}={text}: expected {_want(default)}") from None
        out[name] = value
    return out


def _parse(text: str, default: Any) -> Any:
    if isinstance(default, bool):
        if text.lower() not in ("true", "false", "1", "0", "yes", "no"):
            raise ValueError(text)
        return text.lower() in ("true", "1", "yes")
    if isinstance(default, int):
        return int(text)
    if isinstance(default, float):
        return float(text)
    if isinstance(default, (tuple, dict)):
        if text.strip()[:1] in "[{":
            value = json.loads(text)
        else:
            items = [t.strip() for t in text.split(",") if t.strip()]
            kind = type(default[0]) if isinstance(default, tuple) and default else str
            value = [kind(t) if kind in (int, float) else t for t in items]
        if not same_type(value, default):
            raise ValueError(text)
        return tuple(value) if isinstance(default, tuple) else value
    return text


def check_floors(values: Any, name: str = "floors") -> tuple[float, ...]:
    """Accuracy floors as a tuple of floats, each a finite fraction in (0, 1].

    Args:
        values: a sequence of numbers (relative accuracies: 0.97 = 97 %).
        name: the setting's name, for the message.

    Raises:
        ConfigError: not a non-empty sequence of real numbers, or a value that is NaN, infinite,
            <= 0 or > 1 (no relative accuracy above 1.0 is ever reported, so no policy could
            reach it).
    """
    try:
        floors = tuple(values)
    except TypeError:
        raise ConfigError(f"{name} must be a list of fractions in (0, 1], got {values!r}") from None
    ok = bool(floors) and all(isinstance(f, (int, float)) and not isinstance(f, bool) and 0.0 < f <= 1.0
                              for f in floors)  # NaN fails both comparisons
    if not ok:
        raise ConfigError(f"{name} must be a non-empty list of fractions in (0, 1] (0.97 = 97 %), got {list(floors)}")
    return tuple(float(f) for f in floors)
