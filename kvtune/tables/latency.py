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
"""

from __future__ import annotations

import numpy as np

__all__ = [
    "BITS_PER_BYTE",
    "BYTES_PER_GB",
    "bytes_per_s_to_gbps",
    "gb_per_s_to_bytes_per_s",
    "gbps_to_bytes_per_s",
    "gbps_to_x_s_per_gb",
    "line_coefficients",
    "threshold_bandwidth",
    "threshold_gbps",
    "transfer_seconds",
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
