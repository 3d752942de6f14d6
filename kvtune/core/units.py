"""Parse human quantities with units: link bandwidths, durations and byte volumes.

Used by ``kvtune select`` and the benchmarks; every parser returns one canonical unit:

* :func:`parse_bandwidth_gbps` -> link **Gbps** (1e9 bits/s). Bit rates: ``bps``, ``Kbps``,
  ``Mbps``, ``Gbps``, ``Tbps`` (also ``Gb/s`` style). Byte rates: ``B/s``, ``KB/s``, ``MB/s``,
  ``GB/s``, ``TB/s`` (also ``GBps``), x 8. Binary byte rates ``KiB/s``, ``MiB/s``, ``GiB/s``.
* :func:`parse_duration_s` -> **seconds**. ``ns``, ``us``, ``ms``, ``s``, ``min``.
* :func:`parse_bytes` -> **bytes** (float). Decimal ``B``, ``KB``, ``MB``, ``GB``, ``TB``
  (powers of 1000, as in every throughput kvtune reports in GB/s); binary ``KiB``, ``MiB``, ``GiB``, ``TiB``.

A number without a unit is rejected (``"10"`` could be Gbps or GB/s: a factor of 8), and so is
any unit not listed; the error names the accepted units. Case matters where it changes the
meaning (``Gb`` bits vs ``GB`` bytes); ``gbps``/``GBPS``-style spellings of the bit rates are
accepted, ``GBps`` means bytes.

>>> parse_bandwidth_gbps("10Gbps"), parse_bandwidth_gbps("500 Mbps"), parse_bandwidth_gbps("1.25GB/s")
(10.0, 0.5, 10.0)
>>> parse_duration_s("200ms"), parse_bytes("24MB"), parse_bytes("1GiB")
(0.2, 24000000.0, 1073741824.0)
"""

from __future__ import annotations

import math
import re

from kvtune.core.errors import KvtuneError

__all__ = ["UnitError", "format_bytes", "format_seconds", "parse_bandwidth_gbps", "parse_bytes", "parse_duration_s"]


class UnitError(KvtuneError):
    """A quantity could not be parsed (no number, no unit, unknown unit, out of range)."""


_NUM = re.compile(r"^\s*([+-]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?)\s*([A-Za-z/]*)\s*$")

# bandwidth unit -> Gbps per unit
_BIT_RATES = {"bps": 1e-9, "kbps": 1e-6, "mbps": 1e-3, "gbps": 1.0, "tbps": 1e3}
_BIT_RATES_SLASH = {"b/s": 1e-9, "kb/s": 1e-6, "mb/s": 1e-3, "gb/s": 1.0, "tb/s": 1e3}
_BYTE_RATES = {
    "B/s": 8e-9, "KB/s": 8e-6, "kB/s": 8e-6, "MB/s": 8e-3, "GB/s": 8.0, "TB/s": 8e3,
    "Bps": 8e-9, "KBps": 8e-6, "kBps": 8e-6, "MBps": 8e-3, "GBps": 8.0, "TBps": 8e3,
    "KiB/s": 8 * 2**10 / 1e9, "MiB/s": 8 * 2**20 / 1e9, "GiB/s": 8 * 2**30 / 1e9,
}
_DURATIONS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "sec": 1.0, "min": 60.0}
_BYTES = {
    "B": 1.0, "KB": 1e3, "kB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12,
    "KiB": 2.0**10, "MiB": 2.0**20, "GiB": 2.0**30, "TiB": 2.0**40,
}

BANDWIDTH_UNITS = "bps, Kbps, Mbps, Gbps, Tbps (bits/s) or B/s, KB/s, MB/s, GB/s, TB/s, KiB/s, MiB/s, GiB/s (bytes/s)"
DURATION_UNITS = "ns, us, ms, s, min"
BYTE_UNITS = "B, KB, MB, GB, TB (powers of 1000) or KiB, MiB, GiB, TiB (powers of 1024)"


def _split(text: str, what: str, units: str, example: str) -> tuple[float, str]:
    if not isinstance(text, str):
        text = str(text)
    m = _NUM.match(text.replace("µ", "u"))
    if not m:
        raise UnitError(f"cannot parse {what} {text!r}: expected a number followed by a unit, e.g. {example} (units: {units})")
    value, unit = float(m.group(1)), m.group(2)
    if not unit:
        raise UnitError(f"{what} {text!r} has no unit; write e.g. {example} (units: {units})")
    return value, unit


def parse_bandwidth_gbps(text: str) -> float:
    """A link bandwidth with unit -> link Gbps (1e9 bits/s); must be > 0 and finite.

    Raises:
        UnitError: no number, no unit, unknown unit, or value <= 0.
    """
    value, unit = _split(text, "bandwidth", BANDWIDTH_UNITS, "10Gbps or 1.25GB/s")
    low = unit.lower()
    if unit in _BYTE_RATES:
        factor = _BYTE_RATES[unit]
    elif low in _BIT_RATES and not re.fullmatch(r"[KMGT]?Bps", unit):
        factor = _BIT_RATES[low]
    elif low in _BIT_RATES_SLASH and unit[-3] == "b":  # "Gb/s": lowercase b = bits
        factor = _BIT_RATES_SLASH[low]
    else:
        hint = f" ({unit} is a volume; did you mean {unit}/s?)" if unit in _BYTES else ""
        raise UnitError(f"unknown bandwidth unit {unit!r} in {text!r}{hint}; use {BANDWIDTH_UNITS}")
    gbps = value * factor
    if not (math.isfinite(gbps) and gbps > 0):
        raise UnitError(f"bandwidth must be > 0 and finite, got {text!r}")
    return gbps


def parse_duration_s(text: str) -> float:
    """A duration with unit -> seconds; must be > 0 and finite.

    Raises:
        UnitError: no number, no unit, unknown unit, or value <= 0.
    """
    value, unit = _split(text, "duration", DURATION_UNITS, "200ms or 1.5s")
    if unit not in _DURATIONS:
        raise UnitError(f"unknown duration unit {unit!r} in {text!r}; use {DURATION_UNITS}")
    s = value * _DURATIONS[unit]
    if not (math.isfinite(s) and s > 0):
        raise UnitError(f"duration must be > 0 and finite, got {text!r}")
    return s


def parse_bytes(text: str) -> float:
    """A data volume with unit -> bytes (float); must be > 0 and finite.

    Raises:
        UnitError: no number, no unit, unknown unit (e.g. ``Gb``: bits are not a volume
            here), or value <= 0.
    """
    value, unit = _split(text, "volume", BYTE_UNITS, "24MB or 1GiB")
    if unit not in _BYTES:
        hint = " (bits? volumes are in bytes)" if unit.lower().endswith("b") and unit[-1] == "b" else ""
        raise UnitError(f"unknown volume unit {unit!r} in {text!r}{hint}; use {BYTE_UNITS}")
    n = value * _BYTES[unit]
    if not (math.isfinite(n) and n > 0):
        raise UnitError(f"volume must be > 0 and finite, got {text!r}")
    return n


def format_seconds(seconds: float) -> str:
    """Short human duration: ``"37.8 ms"``, ``"1.23 s"``, ``"12 us"``."""
    s = float(seconds)
    if not math.isfinite(s):
        return str(s)
    if abs(s) >= 1.0:
        return f"{s:.3g} s"
    if abs(s) >= 1e-3:
        return f"{s * 1e3:.3g} ms"
    return f"{s * 1e6:.3g} us"


def format_bytes(n: float) -> str:
    """Short human volume in decimal units: ``"23.6 MB"``, ``"1 GB"``."""
    v = float(n)
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if abs(v) >= scale:
            return f"{v / scale:.3g} {unit}"
    return f"{v:.0f} B"
