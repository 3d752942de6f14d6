"""One settings style for every method: a frozen, versioned dataclass that round-trips
through JSON (``run.json``'s ``settings``), checked field by field when read back, and
settable from the command line as ``--set name=value``.
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from collections.abc import Mapping
from typing import Any, ClassVar

from kvtune.core.errors import ConfigError, KvtuneError

__all__ = ["RunSettings", "check_floors", "clip", "parse_overrides", "same_type"]


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
    """``--set name=value`` texts converted to the declared types of ``cls``'s fields.

    Numbers, true/false and strings are written as they are; a list as comma-separated
    values (``ranks=32,64``) or as JSON (``floors=[0.99,0.9]``), its items converted to the
    list's declared element type (``tuple[int, ...]``: integers) whatever the default holds;
    an object as JSON; ``none`` (or ``null``) for a field whose type allows None.

    Raises:
        KvtuneError: an unknown name (the message lists the known ones) or a value that does
            not parse as the field's type (the message quotes at most :data:`ECHO_CHARS`
            characters of it).
    """
    fields = {f.name: f for f in dataclasses.fields(cls) if f.name != "version"}
    hints = _type_hints(cls)
    out: dict[str, Any] = {}
    for name, text in options.items():
        if name not in fields:
            raise KvtuneError(f"--set {clip(name)}: not a setting of this method; known: {', '.join(sorted(fields))}")
        default = _default(fields[name])
        hint = hints.get(name, type(default))
        try:
            value = _parse(text, default, hint)
        except ValueError:
            raise KvtuneError(f"--set {name}={clip(text)}: expected {_want_hint(hint, default)}") from None
        out[name] = value
    return out


ECHO_CHARS = 80
"""At most this many characters of a bad value are quoted in an error message."""


def clip(text: str, limit: int = ECHO_CHARS) -> str:
    """``text`` cut to ``limit`` characters with ``…`` appended when it was longer (for messages)."""
    return text if len(text) <= limit else text[:limit] + "…"


def _type_hints(cls: type) -> dict[str, Any]:
    """The resolved field annotations of ``cls`` ({} when they cannot be resolved)."""
    try:
        return typing.get_type_hints(cls)
    except Exception:  # an annotation naming something not importable: fall back to the defaults
        return {}


def _optional(hint: Any) -> tuple[bool, Any]:
    """``(whether hint allows None, hint without None)``."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        return len(args) < len(typing.get_args(hint)), (args[0] if len(args) == 1 else typing.Any)
    return False, hint


def _element_type(hint: Any) -> Any:
    """The element type of ``tuple[X, ...]`` (None when it is not such a tuple)."""
    if typing.get_origin(hint) is tuple:
        args = typing.get_args(hint)
        return args[0] if args else None
    return None


_SCALARS = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}
_LISTS = {int: "a list of integers", float: "a list of numbers", str: "a list of strings", dict: "a list of objects"}


def _want_hint(hint: Any, default: Any) -> str:
    """What a value of the declared type ``hint`` is, for messages."""
    optional, hint = _optional(hint)
    want = _LISTS.get(_element_type(hint)) or _SCALARS.get(hint) or _want(default)
    return f"{want} or none" if optional else want


def _item(value: Any, element: Any) -> Any:
    """One list item converted to ``element`` (strings parsed; JSON values checked).

    Raises:
        ValueError: the item is not of that type.
    """
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if element is int and (isinstance(value, str) or (number and isinstance(value, int))):
        return int(value)
    if element is float and (isinstance(value, str) or number):
        return float(value)
    if element in (str, dict) and isinstance(value, element):
        return value
    raise ValueError(value)


def _parse(text: str, default: Any, hint: Any) -> Any:
    """``text`` as a value of the declared type ``hint`` (``default``'s type where ``hint`` says
    less). Raises ValueError when it does not parse."""
    optional, hint = _optional(hint)
    if optional and text.strip().lower() in ("none", "null"):
        return None
    kind = hint if hint in _SCALARS else type(default)
    if kind is bool:
        if text.lower() not in ("true", "false", "1", "0", "yes", "no"):
            raise ValueError(text)
        return text.lower() in ("true", "1", "yes")
    if kind is int:
        return int(text)
    if kind is float:
        return float(text)
    if isinstance(default, (tuple, dict, Mapping)) or typing.get_origin(hint) in (tuple, dict, Mapping):
        is_list = isinstance(default, tuple) or typing.get_origin(hint) is tuple
        if text.strip()[:1] in ("[", "{"):
            try:
                value = json.loads(text)
            except json.JSONDecodeError:
                raise ValueError(text) from None
            if is_list != isinstance(value, list):
                raise ValueError(text)
        else:
            value = [t.strip() for t in text.split(",") if t.strip()]
        element = _element_type(hint) if is_list else None
        if element is None and is_list and default:
            element = type(default[0])
        if element in _LISTS:
            return tuple(_item(v, element) for v in value)
        if not same_type(value, default):
            raise ValueError(text)
        return tuple(value) if is_list else value
    return text


def check_floors(values: Any, name: str = "floors") -> tuple[float, ...]:
    """Accuracy floors as a tuple of floats, each a finite fraction in (0, 1].

    Args:
        values: a sequence of numbers (relative accuracies: 0.97 = 97 %).
        name: the setting's name, for the message.

    Raises:
        ConfigError: not a non-empty sequence of real numbers, a value that is NaN, infinite,
            <= 0 or > 1 (no relative accuracy above 1.0 is ever reported, so no policy could
            reach it), or a value listed twice.
    """
    try:
        floors = tuple(values)
    except TypeError:
        raise ConfigError(f"{name} must be a list of fractions in (0, 1], got {values!r}") from None
    ok = bool(floors) and all(isinstance(f, (int, float)) and not isinstance(f, bool) and 0.0 < f <= 1.0
                              for f in floors)  # NaN fails both comparisons
    if not ok:
        raise ConfigError(f"{name} must be a non-empty list of fractions in (0, 1] (0.97 = 97 %), got {list(floors)}")
    if len(set(floors)) != len(floors):
        raise ConfigError(f"{name} must be distinct, got {list(floors)}")
    return tuple(float(f) for f in floors)
