"""Lower envelope of latency lines: the best policy for every link bandwidth.

KVServe (arXiv 2605.13734), piecewise policy table of the online controller: with ``x = 1/B``, the
per-volume transfer time of policy i is the line ``T_i/V = a_i + b_i * x``
(``a_i = 1/s_enc + 1/s_dec``, ``b_i = 1/cr_i``). The fastest policy at every x is the lower
envelope of these lines; it is piecewise constant in x with exact breakpoints, so it can be
computed offline and looked up online with a binary search on x.

Implementation: the convex-hull trick. Sort lines by slope (descending), keep the lowest
intercept per slope, and sweep with a stack, popping a line when its successor makes it
useless; O(n log n). The envelope is built over the whole real line and then clipped to
``[0, x_max)``.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

__all__ = ["Interval", "locate_interval", "lower_envelope"]


@dataclass(frozen=True, slots=True)
class Interval:
    """One piece of a lower envelope: line ``index`` is the minimum on ``[x_lo, x_hi)``.

    Attributes:
        x_lo: left end (inclusive), same unit as x (in kvtune tables: s/GB, x = 1/B).
        x_hi: right end (exclusive); ``inf`` for the last piece of an unbounded envelope.
        index: position of the winning line in the input arrays.
        runners_up: positions of the next-best lines (best first) at the interval's
            midpoint, or at ``x_lo + max(1, x_lo)`` when ``x_hi`` is inf.
    """

    x_lo: float
    x_hi: float
    index: int
    runners_up: tuple[int, ...] = ()

    def contains(self, x: float) -> bool:
        """True when ``x_lo <= x < x_hi``."""
        return self.x_lo <= x < self.x_hi


def _probe_x(x_lo: float, x_hi: float) -> float:
    """A point strictly inside ``[x_lo, x_hi)`` used to rank runners-up."""
    if np.isinf(x_hi):
        return x_lo + max(1.0, x_lo)
    return 0.5 * (x_lo + x_hi)


def _runners_up(a: np.ndarray, b: np.ndarray, x: float, winner: int, count: int) -> tuple[int, ...]:
    """Indices of the ``count`` lowest lines at ``x`` other than ``winner``.

    Ordered by value, then intercept, then index. Uses a partial sort so that the cost per
    interval is O(n) plus a sort of the (few) shortlisted lines.
    """
    count = max(0, int(count))
    n = a.shape[0]
    if count == 0 or n <= 1:
        return ()
    values = a + b * x
    k = min(count + 1, n)  # the winner is among the k smallest
    if n > k:
        cutoff = np.partition(values, k - 1)[k - 1]
        cand = np.flatnonzero(values <= cutoff)  # keeps every tie with the cutoff
    else:
        cand = np.arange(n)
    cand = cand[np.lexsort((cand, a[cand], values[cand]))]
    return tuple(int(i) for i in cand if i != winner)[:count]


def lower_envelope(
    a: np.ndarray,
    b: np.ndarray,
    *,
    x_max: float = np.inf,
    n_runners_up: int = 2,
) -> list[Interval]:
    """Lower envelope of the lines ``a_i + b_i * x`` over ``x in [0, x_max)``.

    Ties are broken deterministically: among parallel lines (equal ``b``) the lowest ``a``
    wins; among identical lines (equal ``a`` and ``b``) the lowest index wins. Lines that
    only touch the envelope at a single point get no interval. The intervals partition
    ``[0, x_max)`` exactly: sorted, ``x_lo`` of the first is 0, ``x_hi`` of each is the
    ``x_lo`` of the next, ``x_hi`` of the last is ``x_max``.

    Args:
        a: float array, shape ``(n,)``, finite intercepts (kvtune: codec seconds per GB,
            ``1/encode_gbps + 1/decode_gbps``).
        b: float array, shape ``(n,)``, finite slopes (kvtune: ``1/compression_ratio``).
        x_max: right end of the domain (> 0; kvtune uses inf, i.e. bandwidth down to 0).
        n_runners_up: how many next-best lines to list per interval (0..n-1).

    Returns:
        list of :class:`Interval`, left to right. Breakpoints are the exact intersections
        ``(a_j - a_i) / (b_i - b_j)`` (one float rounding), forced non-decreasing.

    Raises:
        ValueError: shapes differ, n == 0, non-finite coefficients, or ``x_max <= 0``.
    """
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    if a.ndim != 1 or a.shape != b.shape:
        raise ValueError(f"a and b must be 1-D arrays of equal length, got {a.shape} and {b.shape}")
    n = a.shape[0]
    if n == 0:
        raise ValueError("lower_envelope needs at least one line")
    if not (np.isfinite(a).all() and np.isfinite(b).all()):
        raise ValueError("line coefficients a and b must be finite")
    if not x_max > 0:
        raise ValueError(f"x_max must be > 0, got {x_max}")

    # Slope descending, then intercept ascending, then index ascending.
    order = np.lexsort((np.arange(n), a, -b))
    hull: list[int] = []
    last_b = None
    for i in order:
        i = int(i)
        if last_b is not None and b[i] == last_b:
            continue  # parallel to (and not below) the line just considered
        last_b = b[i]
        while len(hull) >= 2:
            l1, l2 = hull[-2], hull[-1]
            # l2 is useless iff x(l1, i) <= x(l1, l2); cross-multiplied (b1 > b2 > b_i).
            if (a[i] - a[l1]) * (b[l1] - b[l2]) <= (a[l2] - a[l1]) * (b[l1] - b[i]):
                hull.pop()
            else:
                break
        hull.append(i)

    # Breakpoints between consecutive hull lines, over the whole real line.
    k = len(hull)
    bps = np.empty(k + 1, dtype=np.float64)
    bps[0] = -np.inf
    bps[-1] = np.inf
    for j in range(k - 1):
        p, q = hull[j], hull[j + 1]
        bps[j + 1] = (a[q] - a[p]) / (b[p] - b[q])
    bps = np.maximum.accumulate(bps)  # guard against rounding making them non-monotone
    bps = np.clip(bps, 0.0, x_max)

    intervals: list[Interval] = []
    for j, line in enumerate(hull):
        lo, hi = float(bps[j]), float(bps[j + 1])
        if not lo < hi:
            continue
        intervals.append(Interval(lo, hi, line, _runners_up(a, b, _probe_x(lo, hi), line, n_runners_up)))
    return intervals


def locate_interval(intervals: Sequence[Interval], x: float) -> int:
    """Position in ``intervals`` of the piece containing ``x`` (binary search, O(log n)).

    Args:
        intervals: a partition as returned by :func:`lower_envelope`.
        x: query point (s/GB in kvtune tables), ``intervals[0].x_lo <= x``.

    Returns:
        the position ``k`` with ``x_lo[k] <= x < x_hi[k]``; ``x >= x_hi`` of the last piece
        maps to the last piece.

    Raises:
        ValueError: x is NaN or left of the first piece.
    """
    if np.isnan(x) or x < intervals[0].x_lo:
        raise ValueError(f"x={x} is outside the envelope's domain")
    los = [iv.x_lo for iv in intervals]
    return bisect.bisect_right(los, x) - 1
