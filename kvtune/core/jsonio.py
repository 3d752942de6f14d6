"""Strict JSON helpers shared by every writer of kvtune files.

Strict JSON has no ``NaN``/``Infinity`` literals: kvtune writes non-finite floats as the
strings ``"nan"``, ``"inf"`` and ``"-inf"`` and reads them back with :func:`dec_float`.
Canonical JSON (sorted keys, no whitespace, ASCII) is what policy ids are hashed from.
"""

from __future__ import annotations

import json
import math
import numbers
from typing import Any

__all__ = ["canonical_json", "dec_float", "enc_float", "is_finite_number", "jsonable", "plain", "strict_dumps"]


def is_finite_number(v: Any) -> bool:
    """``v`` is a real number (an int or float, or a numpy integer or float; not a bool) that
    converts to a finite float."""
    if isinstance(v, bool) or not isinstance(v, numbers.Real):
        return False
    try:
        return math.isfinite(float(v))
    except OverflowError:  # an int beyond the float range
        return False


def enc_float(v: float) -> float | str:
    """A float as strict JSON: itself when finite, else ``"nan"``, ``"inf"`` or ``"-inf"``."""
    v = float(v)
    if math.isfinite(v):
        return v
    return "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf")


def dec_float(v: Any, what: str) -> float:
    """Inverse of :func:`enc_float` (numbers and the strings it writes).

    Raises:
        ValueError: ``v`` is a bool, not a number or string, or a string ``float`` rejects;
            the message names ``what``.
    """
    if isinstance(v, bool) or not isinstance(v, (int, float, str)):
        raise ValueError(f"{what}: expected a number, got {v!r}")
    return float(v)


def jsonable(obj: Any) -> Any:
    """``obj`` with non-finite floats encoded by :func:`enc_float`, numpy/torch scalars unwrapped
    (``.item()``), tuples as lists and keys as strings, recursively."""
    if isinstance(obj, float):
        return enc_float(obj)
    if isinstance(obj, dict):
        return {str(k): jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [jsonable(v) for v in obj]
    if hasattr(obj, "item") and not isinstance(obj, (str, bytes)):
        return jsonable(obj.item())
    return obj


def plain(obj: Any) -> Any:
    """``obj`` as plain Python values for :mod:`json` (numpy/torch scalars unwrapped with
    ``.item()``, tuples as lists, keys as strings), recursively; floats are kept as they are,
    non-finite ones included (unlike :func:`jsonable`)."""
    if isinstance(obj, dict):
        return {str(k): plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [plain(v) for v in obj]
    if hasattr(obj, "item") and not isinstance(obj, (str, bytes)):
        return obj.item()
    return obj


def strict_dumps(obj: Any, **kwargs: Any) -> str:
    """``json.dumps`` that refuses NaN/Infinity (``ValueError``); pass :func:`jsonable` output."""
    return json.dumps(obj, allow_nan=False, **kwargs)


def canonical_json(obj: Any) -> str:
    """Canonical JSON: sorted keys, no whitespace, ASCII only, no NaN (``ValueError``)."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)
