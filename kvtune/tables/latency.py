"""KVServe transfer-latency model and the bandwidth threshold (pure functions).

Source: "KVServe: Service-Aware KV Cache Compression for Communication-Efficient Disaggregated
LLM Serving" (arXiv 2605.13734), the analytical latency model of its online controller. For
KV volume V (bytes), link bandwidth B, encode and decode throughputs s_enc, s_dec of a policy
(bytes of *original* KV per second) and compression ratio cr::

    T_p(B)    = V / s_enc + V / (cr * B) + V / s_dec
    T_none(B) = V / B

Compression pays iff ``T_p < T_none`` iff ``B < B* = (1 - 1/cr) * S`` with
``1/S = 1/s_enc + 1/s_dec``. (A summary of the paper writes ``s / (1 - 1/cr)``; the algebra
gives ``(1 - 1/cr) * S``, which is what we implement and test.) B* does not depend on V.

Per unit volume, with ``x = 1/B``, ``T/V = a + b * x`` is a line: ``a = 1/s_enc + 1/s_dec``,
``b = 1/cr``; "no compression" is ``a = 0, b = 1``. :mod:`kvtune.tables.envelope` takes the
lower envelope of these lines.

Units: every argument carries its unit in its name. Link bandwidths are quoted by operators
in **Gbps = 1e9 bits/s**; codec throughputs in trials frames (``encode_gbps``) are in
**GB/s = 1e9 bytes/s** of original bf16 KV. Convert with the helpers below; never mix them.
All functions accept floats or numpy arrays (broadcasting) and return the same.

Measured transfers add costs the nominal model leaves out (:class:`TransferCosts`): a fixed
cost per transfer, a CPU rate for moving wire bytes (so the link behaves as
``1 / (1/B + 1/B_cpu)``) and the serving engine's paged-cache gather/scatter of the original
KV. :func:`transfer_seconds_with_costs` adds them to ``T_p``; :func:`fit_transfer_costs` fits
them to measured transfers (non-negative relative least squares).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import numpy as np

from kvtune.core.errors import ConfigError

__all__ = [
    "BITS_PER_BYTE",
    "BYTES_PER_GB",
    "TransferCosts",
    "bytes_per_s_to_gbps",
    "effective_bandwidth_bytes_per_s",
    "fit_transfer_costs",
    "gb_per_s_to_bytes_per_s",
    "gbps_to_bytes_per_s",
    "gbps_to_x_s_per_gb",
    "line_coefficients",
    "threshold_bandwidth",
    "threshold_gbps",
    "transfer_seconds",
    "transfer_seconds_with_costs",
    "uncompressed_seconds",
    "x_s_per_gb_to_gbps",
]

#: Bytes in one GB (decimal, as in "GB/s" throughputs).
BYTES_PER_GB = 1e9
#: Bits per byte.
BITS_PER_BYTE = 8


def _out(value):
    """Return a Python float for 0-d results, the array otherwise."""
    arr = np.asarray(value)
    return float(arr) if arr.ndim == 0 else arr


def gbps_to_bytes_per_s(gbps):
    """Link bandwidth in Gbps (1e9 *bits*/s) -> bytes/s: ``gbps * 1e9 / 8``.

    Args:
        gbps: float or array, gigabits per second.

    Returns:
        bytes per second (float or array).
    """
    return _out(np.asarray(gbps, dtype=np.float64) * 1e9 / BITS_PER_BYTE)


def bytes_per_s_to_gbps(bytes_per_s):
    """bytes/s -> link Gbps (1e9 bits/s): ``bytes_per_s * 8 / 1e9``. Inverse of
    :func:`gbps_to_bytes_per_s`."""
    return _out(np.asarray(bytes_per_s, dtype=np.float64) * BITS_PER_BYTE / 1e9)


def gb_per_s_to_bytes_per_s(gb_per_s):
    """Throughput in GB/s (1e9 *bytes*/s, e.g. ``encode_gbps`` of a trial) -> bytes/s."""
    return _out(np.asarray(gb_per_s, dtype=np.float64) * BYTES_PER_GB)


def gbps_to_x_s_per_gb(bandwidth_gbps):
    """Link Gbps -> table coordinate ``x = 1/B`` in seconds per GB (1e9 bytes).

    ``x = 8 / bandwidth_gbps``; ``inf`` Gbps -> 0, 0 Gbps -> inf.

    Args:
        bandwidth_gbps: float or array, link bandwidth in gigabits per second (>= 0).

    Returns:
        seconds to move one GB of (compressed or not) bytes over the link.
    """
    b = np.asarray(bandwidth_gbps, dtype=np.float64)
    with np.errstate(divide="ignore"):
        return _out(BITS_PER_BYTE / b)


def x_s_per_gb_to_gbps(x_s_per_gb):
    """Table coordinate ``x`` (s/GB) -> link Gbps: ``8 / x``; ``x = 0`` -> inf, inf -> 0.
    Inverse of :func:`gbps_to_x_s_per_gb`."""
    x = np.asarray(x_s_per_gb, dtype=np.float64)
    with np.errstate(divide="ignore"):
        return _out(BITS_PER_BYTE / x)


def transfer_seconds(kv_bytes, bandwidth_bytes_per_s, encode_bytes_per_s, decode_bytes_per_s, ratio):
    """Predicted seconds to encode, send and decode V bytes of KV with a policy (KVServe).

    ``T_p = V / s_enc + V / (cr * B) + V / s_dec``.

    Args:
        kv_bytes: V, bytes of original (bf16) KV.
        bandwidth_bytes_per_s: B, link bandwidth in bytes/s (> 0).
        encode_bytes_per_s: s_enc, bytes of original KV encoded per second (> 0; inf = free).
        decode_bytes_per_s: s_dec, bytes of original KV decoded per second (> 0; inf = free).
        ratio: cr, compression ratio (original bytes / stream bytes, > 0).

    Returns:
        seconds (float or array).
    """
    v = np.asarray(kv_bytes, dtype=np.float64)
    with np.errstate(divide="ignore"):
        t = (
            v / np.asarray(encode_bytes_per_s, dtype=np.float64)
            + v / (np.asarray(ratio, dtype=np.float64) * np.asarray(bandwidth_bytes_per_s, dtype=np.float64))
            + v / np.asarray(decode_bytes_per_s, dtype=np.float64)
        )
    return _out(t)


def uncompressed_seconds(kv_bytes, bandwidth_bytes_per_s):
    """Seconds to send V bytes of KV uncompressed: ``T_none = V / B`` (KVServe).

    Args:
        kv_bytes: V, bytes.
        bandwidth_bytes_per_s: B, bytes/s (> 0).

    Returns:
        seconds (float or array).
    """
    with np.errstate(divide="ignore"):
        return _out(
            np.asarray(kv_bytes, dtype=np.float64) / np.asarray(bandwidth_bytes_per_s, dtype=np.float64)
        )


def threshold_bandwidth(ratio, encode_bytes_per_s, decode_bytes_per_s):
    """Bandwidth threshold B* below which a policy beats sending uncompressed (KVServe).

    ``B* = (1 - 1/cr) * S`` with ``1/S = 1/s_enc + 1/s_dec``; ``T_p(B) < T_none(B)`` iff
    ``B < B*``, independently of the volume V. For ``cr <= 1`` compression never pays and
    B* is 0.0 (clamped; the formula would be <= 0). With infinite throughputs and ``cr > 1``
    B* is inf (always pays).

    Args:
        ratio: cr, compression ratio (> 0).
        encode_bytes_per_s: s_enc in bytes of original KV per second (> 0, inf allowed).
        decode_bytes_per_s: s_dec in bytes of original KV per second (> 0, inf allowed).

    Returns:
        B* in bytes/s (float or array, >= 0). Use :func:`bytes_per_s_to_gbps` for link Gbps.
    """
    cr = np.asarray(ratio, dtype=np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        inv_s = 1.0 / np.asarray(encode_bytes_per_s, dtype=np.float64) + 1.0 / np.asarray(
            decode_bytes_per_s, dtype=np.float64
        )
        gain = 1.0 - 1.0 / cr
        bstar = np.where(gain > 0, gain / inv_s, 0.0)
    return _out(bstar)


def threshold_gbps(ratio, encode_gbps, decode_gbps):
    """B* as link Gbps (1e9 bits/s) from codec throughputs in GB/s (1e9 bytes/s).

    Same as :func:`threshold_bandwidth` with the unit conversions of a trials frame:
    ``8 * (1 - 1/cr) / (1/encode_gbps + 1/decode_gbps)``; 0.0 when ``cr <= 1``.
    """
    bstar = threshold_bandwidth(
        ratio, gb_per_s_to_bytes_per_s(encode_gbps), gb_per_s_to_bytes_per_s(decode_gbps)
    )
    return bytes_per_s_to_gbps(bstar)


def line_coefficients(ratio, encode_gbps, decode_gbps):
    """Per-volume latency line ``T/V = a + b * x`` of a policy, ``x = 1/B`` in s/GB.

    Args:
        ratio: cr (> 0).
        encode_gbps: encode throughput, GB/s (1e9 bytes/s) of original KV (> 0, inf allowed).
        decode_gbps: decode throughput, GB/s (> 0, inf allowed).

    Returns:
        ``(a_s_per_gb, b)``: ``a = 1/encode_gbps + 1/decode_gbps`` seconds per GB of original
        KV; ``b = 1/cr`` (dimensionless). The uncompressed line is ``(0.0, 1.0)``.
    """
    with np.errstate(divide="ignore"):
        a = 1.0 / np.asarray(encode_gbps, dtype=np.float64) + 1.0 / np.asarray(decode_gbps, dtype=np.float64)
        b = 1.0 / np.asarray(ratio, dtype=np.float64)
    return _out(a), _out(b)


# ----------------------------------------------------------------------------- measured costs


@dataclass(frozen=True)
class TransferCosts:
    """Costs of a real transfer that the KVServe model ``T_p`` leaves out (all >= 0 seconds).

    Extends the analytical latency model of "KVServe: Service-Aware KV Cache Compression for
    Communication-Efficient Disaggregated LLM Serving" (arXiv 2605.13734, online controller),
    ``T_p = V/s_enc + V/(cr B) + V/s_dec``, with three terms measured on a serving machine::

        T = T_p + fixed_s + W / B_cpu + V / s_move,    W = V / cr (wire bytes)

    Attributes:
        fixed_s: seconds paid once per transfer whatever its size (connection round trip,
            acknowledgement, request bookkeeping); finite, >= 0.
        wire_cpu_gbps: ``B_cpu``, the rate (Gbps, 1e9 bits/s of wire bytes) at which the hosts'
            CPUs move the stream (socket copies, a receiver's spool write and read); with it the
            link behaves as the effective rate ``1 / (1/B + 1/B_cpu)``
            (:func:`effective_bandwidth_bytes_per_s`). > 0; ``inf`` = free.
        move_gb_per_s: ``s_move``, GB/s (1e9 bytes/s) of *original* KV moved between the
            engine's paged cache and a contiguous buffer (gather on the sender + scatter on the
            receiver). > 0; ``inf`` = free.

    The defaults (0, inf, inf) add nothing: :func:`transfer_seconds_with_costs` then equals
    :func:`transfer_seconds` exactly.

    Raises:
        ConfigError: a negative, NaN or infinite ``fixed_s``; a rate that is NaN or <= 0.
    """

    fixed_s: float = 0.0
    wire_cpu_gbps: float = math.inf
    move_gb_per_s: float = math.inf

    def __post_init__(self) -> None:
        if not (math.isfinite(self.fixed_s) and self.fixed_s >= 0):
            raise ConfigError(f"TransferCosts.fixed_s must be a finite number >= 0 seconds, got {self.fixed_s!r}")
        for name in ("wire_cpu_gbps", "move_gb_per_s"):
            value = getattr(self, name)
            if not value > 0:  # also refuses NaN
                raise ConfigError(f"TransferCosts.{name} must be > 0 (inf = free), got {value!r}")


def effective_bandwidth_bytes_per_s(bandwidth_bytes_per_s, costs: TransferCosts):
    """Link rate seen by a transfer once the CPUs' wire-byte rate is added: ``1 / (1/B + 1/B_cpu)``.

    Args:
        bandwidth_bytes_per_s: B, nominal link bandwidth in bytes/s (> 0), float or array.
        costs: :class:`TransferCosts` (its ``wire_cpu_gbps``; inf gives back B).

    Returns:
        bytes/s (float or array).
    """
    b = np.asarray(bandwidth_bytes_per_s, dtype=np.float64)
    if math.isinf(costs.wire_cpu_gbps):
        return _out(b)  # exactly B (1 / (1/B) may round)
    with np.errstate(divide="ignore"):
        return _out(1.0 / (1.0 / b + 1.0 / gbps_to_bytes_per_s(costs.wire_cpu_gbps)))


def transfer_seconds_with_costs(kv_bytes, bandwidth_bytes_per_s, encode_bytes_per_s, decode_bytes_per_s, ratio,
                                costs: TransferCosts = TransferCosts()):
    """KVServe's ``T_p`` plus the measured costs of :class:`TransferCosts`.

    ``T = V/s_enc + V/(cr B) + V/s_dec + fixed_s + (V/cr)/B_cpu + V/s_move`` (KVServe,
    arXiv 2605.13734, extended). With the default costs the result is exactly
    :func:`transfer_seconds` (each added term is 0.0).

    Args:
        kv_bytes: V, bytes of original (bf16) KV.
        bandwidth_bytes_per_s: B, nominal link bandwidth in bytes/s (> 0).
        encode_bytes_per_s: s_enc, bytes of original KV per second (> 0; inf = free or not on
            the critical path).
        decode_bytes_per_s: s_dec, bytes of original KV per second (> 0; inf = free).
        ratio: cr, compression ratio (original bytes / stream bytes, > 0).
        costs: :class:`TransferCosts` (default: none).

    Returns:
        seconds (float or array, broadcast over the arguments).
    """
    v = np.asarray(kv_bytes, dtype=np.float64)
    wire = v / np.asarray(ratio, dtype=np.float64)
    extra = (costs.fixed_s + wire / gbps_to_bytes_per_s(costs.wire_cpu_gbps)
             + v / gb_per_s_to_bytes_per_s(costs.move_gb_per_s))
    nominal = transfer_seconds(kv_bytes, bandwidth_bytes_per_s, encode_bytes_per_s, decode_bytes_per_s, ratio)
    return _out(np.asarray(nominal) + extra)


def _checked_vector(name: str, values, *, positive: bool) -> np.ndarray:
    arr = np.asarray(values, dtype=np.float64)
    if arr.ndim != 1 or arr.size == 0:
        raise ConfigError(f"fit_transfer_costs: {name} must be a non-empty 1-D sequence, got shape {arr.shape}")
    bad = ~np.isfinite(arr) | ((arr <= 0) if positive else (arr < 0))
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        need = "finite and > 0" if positive else "finite and >= 0"
        raise ConfigError(f"fit_transfer_costs: {name} must be {need}; {name}[{i}] = {arr[i]!r}")
    return arr


def _nnls_small(a: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Exact non-negative least squares ``min |a c - y|, c >= 0`` for a few columns: the best
    feasible unconstrained fit over every subset of columns (an optimum's support is one)."""
    n = a.shape[1]
    best, best_res = np.zeros(n), float(y @ y)
    for k in range(1, n + 1):
        for cols in itertools.combinations(range(n), k):
            sub, *_ = np.linalg.lstsq(a[:, cols], y, rcond=None)
            if (sub < 0).any():
                continue
            c = np.zeros(n)
            c[list(cols)] = sub
            r = a @ c - y
            res = float(r @ r)
            if res < best_res:
                best, best_res = c, res
    return best


def fit_transfer_costs(measured_s, nominal_s, wire_bytes, kv_bytes) -> TransferCosts:
    """Fit :class:`TransferCosts` to measured transfers (non-negative relative least squares).

    Model: ``measured = nominal + fixed_s + W / B_cpu + V / s_move`` (KVServe's ``T_p``,
    arXiv 2605.13734, plus the measured costs). Minimises ``sum(((pred - measured) /
    measured)^2)`` over ``fixed_s, 1/B_cpu, 1/s_move >= 0`` (exact NNLS over the three
    unknowns, numpy only): each transfer weighs by its relative error, so short transfers are
    not drowned by long ones. A term the data does not call for comes out 0 (``inf`` rate).

    Args:
        measured_s: measured transfer seconds, 1-D, finite and > 0.
        nominal_s: :func:`transfer_seconds` of the same transfers (seconds), 1-D, finite, > 0.
        wire_bytes: W, bytes each transfer put on the wire (stream bytes), 1-D, finite, >= 0.
        kv_bytes: V, bytes of original KV of each transfer, 1-D, finite, >= 0.

    Returns:
        the fitted :class:`TransferCosts`.

    Raises:
        ConfigError: an argument that is not a non-empty 1-D sequence, holds a NaN/inf or a
            value out of range (named with its index), or whose length differs from
            ``measured_s``'s.
    """
    t = _checked_vector("measured_s", measured_s, positive=True)
    nominal = _checked_vector("nominal_s", nominal_s, positive=True)
    wire = _checked_vector("wire_bytes", wire_bytes, positive=False)
    v = _checked_vector("kv_bytes", kv_bytes, positive=False)
    for name, arr in (("nominal_s", nominal), ("wire_bytes", wire), ("kv_bytes", v)):
        if arr.size != t.size:
            raise ConfigError(f"fit_transfer_costs: {name} has {arr.size} values, measured_s has {t.size}")
    design = np.column_stack([np.ones_like(t), wire / BYTES_PER_GB, v / BYTES_PER_GB]) / t[:, None]
    fixed, s_per_wire_gb, s_per_kv_gb = _nnls_small(design, (t - nominal) / t)
    return TransferCosts(
        fixed_s=float(fixed),
        wire_cpu_gbps=BITS_PER_BYTE / float(s_per_wire_gb) if s_per_wire_gb > 0 else math.inf,
        move_gb_per_s=1.0 / float(s_per_kv_gb) if s_per_kv_gb > 0 else math.inf,
    )
