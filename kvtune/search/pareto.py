"""Pareto front of evaluated compression policies, and exact hypervolume.

A policy is kept when no other policy is at least as good in every objective and strictly
better in one. kvtune's objectives (KVServe, arXiv 2605.13734, the 3-D Pareto candidate set of
its Bayesian Profiling Engine) are

* ``relative_accuracy`` -- maximize (fraction, 1.0 == 100 %),
* ``compression_ratio`` -- maximize (bf16 bytes / stream bytes),
* ``codec_seconds_per_gb`` -- minimize; seconds of encode + decode per GB (1e9 bytes) of
  original bf16 KV, ``1 / encode_gbps + 1 / decode_gbps`` with throughputs in GB/s.

The last one is exactly the intercept ``a`` of the per-volume latency line used by
:mod:`kvtune.tables`, so the front keeps every policy that can appear in a policy table.

>>> import numpy as np
>>> non_dominated_mask(np.array([[1.0, 3.0], [2.0, 2.0], [1.0, 1.0]]), [True, True]).tolist()
[True, True, False]
>>> hypervolume(np.array([[1.0, 3.0], [2.0, 2.0], [3.0, 1.0]]), [0.0, 0.0], [True, True])
6.0
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pandas as pd

from kvtune.core.errors import KvtuneError

__all__ = [
    "OBJECTIVE_COLUMNS",
    "OBJECTIVE_MAXIMIZE",
    "add_codec_latency",
    "best_ratio_per_floor",
    "hypervolume",
    "non_dominated_mask",
    "pareto_front",
]

#: Objective columns of :func:`pareto_front`, in order.
OBJECTIVE_COLUMNS: tuple[str, str, str] = (
    "relative_accuracy",
    "compression_ratio",
    "codec_seconds_per_gb",
)
#: Direction of each objective in :data:`OBJECTIVE_COLUMNS` (True = larger is better).
OBJECTIVE_MAXIMIZE: tuple[bool, bool, bool] = (True, True, False)


_BLOCK = 128  # points compared per vectorized step in non_dominated_mask


def _as_minimization(points: np.ndarray, maximize: Sequence[bool]) -> np.ndarray:
    """Return a float64 copy of ``points`` (n, m) with maximized columns negated."""
    pts = np.asarray(points, dtype=np.float64)
    if pts.ndim != 2:
        raise ValueError(f"points must be a 2-D array (n, m), got shape {pts.shape}")
    signs = np.asarray([bool(v) for v in maximize])
    if signs.shape != (pts.shape[1],):
        raise ValueError(
            f"maximize has {signs.size} entries but points have {pts.shape[1]} objectives"
        )
    return np.where(signs[None, :], -pts, pts)


def _dominated_sorted_2d(p: np.ndarray) -> np.ndarray:
    """Dominated flags for 2-D points (minimization) sorted lexicographically; O(n).

    Point i is dominated iff a point with smaller first coordinate has a second coordinate
    <= its own, or a point with the same first coordinate has a strictly smaller second one.
    """
    f0, f1 = p[:, 0], p[:, 1]
    n = f0.shape[0]
    starts = np.flatnonzero(np.r_[True, f0[1:] != f0[:-1]])  # first row of each f0 group
    group = np.cumsum(np.r_[True, f0[1:] != f0[:-1]]) - 1  # group id of each row
    cummin = np.minimum.accumulate(f1)
    before = np.full(starts.shape[0], np.inf)
    before[1:] = cummin[starts[1:] - 1]  # min f1 over all earlier groups
    group_min = f1[starts]  # rows are sorted by f1 within a group
    return (before[group] <= f1) | (f1 > group_min[group]) if n else np.zeros(0, dtype=bool)


def non_dominated_mask(points: np.ndarray, maximize: Sequence[bool]) -> np.ndarray:
    """Mask of the points that no other point Pareto-dominates.

    Point ``j`` dominates point ``i`` when ``j`` is at least as good as ``i`` in every
    objective and strictly better in at least one. **Duplicates are all kept**: equal
    copies do not dominate each other, so if a point is on the front every exact copy of it
    is too. Rows that contain NaN are never on the front and never dominate anything
    (a failed evaluation must not hide a real one); +-inf are ordinary values.

    Algorithm: sort lexicographically (a dominator always sorts strictly before the point it
    dominates), then sweep in blocks, comparing each block only with the front found so far
    and with itself (dominance is transitive, so that is enough). Cost O(n log n +
    n * |front| * m), vectorized: for n = 10,000 in 3-D about 0.1 s for random points, ~3 s
    in the worst case (every point on the front). 2-D uses an O(n log n) prefix-minimum
    sweep.

    Args:
        points: float array, shape ``(n, m)``, one row per candidate, one column per
            objective (any units).
        maximize: length ``m``; ``True`` where larger is better, ``False`` where smaller is.

    Returns:
        bool array, shape ``(n,)``; ``True`` for non-dominated rows.
    """
    pts = _as_minimization(points, maximize)
    n, m = pts.shape
    mask = np.zeros(n, dtype=bool)
    if n == 0:
        return mask
    finite_rows = ~np.isnan(pts).any(axis=1)
    idx = np.flatnonzero(finite_rows)
    if idx.size == 0:
        return mask
    if m > 0:
        # np.lexsort uses the last key as primary: pass columns reversed.
        idx = idx[np.lexsort(pts[idx].T[::-1])]
    sub = pts[idx]
    if m == 2:
        mask[idx[~_dominated_sorted_2d(sub)]] = True
        return mask
    front = np.empty_like(sub)
    size = 0
    for start in range(0, sub.shape[0], _BLOCK):
        blk = sub[start : start + _BLOCK]
        # A point can only be dominated by points sorted before it or in its own block; it
        # suffices to test the front so far plus the block (dominance is transitive).
        cand = np.concatenate([front[:size], blk]) if size else blk
        le = np.all(cand[None, :, :] <= blk[:, None, :], axis=2)
        lt = np.any(cand[None, :, :] < blk[:, None, :], axis=2)
        keep = ~np.any(le & lt, axis=1)
        k = int(keep.sum())
        front[size : size + k] = blk[keep]
        size += k
        mask[idx[start : start + _BLOCK][keep]] = True
    return mask


def add_codec_latency(trials: pd.DataFrame) -> pd.DataFrame:
    """Return a copy of ``trials`` with ``codec_seconds_per_gb`` added.

    ``codec_seconds_per_gb = 1 / encode_gbps + 1 / decode_gbps``: seconds spent encoding and
    decoding one GB (1e9 bytes) of original bf16 KV. ``encode_gbps`` / ``decode_gbps`` are
    throughputs in GB/s (giga*bytes*, not the link's gigabits). An infinite throughput costs
    0 s. This is the intercept ``a`` of the KVServe latency line ``T/V = a + x / cr``
    (KVServe, arXiv 2605.13734, analytical latency model of the online controller).

    Args:
        trials: DataFrame with float columns ``encode_gbps`` and ``decode_gbps`` (GB/s,
            > 0 or NaN for a failed trial); other columns are kept unchanged.

    Returns:
        A new DataFrame, same index and columns plus ``codec_seconds_per_gb`` (float64,
        seconds per GB; NaN where a throughput is NaN).

    Raises:
        KvtuneError: a throughput column is missing, or a throughput is <= 0.
    """
    missing = [c for c in ("encode_gbps", "decode_gbps") if c not in trials.columns]
    if missing:
        raise KvtuneError(f"trials frame lacks column(s) {missing} needed for codec latency")
    enc = pd.to_numeric(trials["encode_gbps"], errors="coerce").to_numpy(dtype=np.float64)
    dec = pd.to_numeric(trials["decode_gbps"], errors="coerce").to_numpy(dtype=np.float64)
    for name, arr in (("encode_gbps", enc), ("decode_gbps", dec)):
        bad = ~np.isnan(arr) & (arr <= 0)
        if bad.any():
            rows = trials.index[bad].tolist()[:5]
            raise KvtuneError(f"{name} must be > 0 GB/s; got {arr[bad][:5].tolist()} at rows {rows}")
    out = trials.copy()
    with np.errstate(divide="ignore"):
        out["codec_seconds_per_gb"] = 1.0 / enc + 1.0 / dec
    return out


def pareto_front(trials: pd.DataFrame) -> pd.DataFrame:
    """The 3-D Pareto front of evaluated policies (KVServe paper, Sec. "Pareto front").

    Objectives: ``relative_accuracy`` up, ``compression_ratio`` up, ``codec_seconds_per_gb``
    down (see :func:`add_codec_latency`). Equal copies of a front point are all kept; rows
    with NaN in an objective (failed trials) are dropped. The front is not bucketed by
    accuracy here: a policy table filters it per accuracy floor (a dominated policy can
    never be the fastest at any floor, so nothing is lost).

    Args:
        trials: one row per evaluated policy, with at least ``relative_accuracy``
            (fraction), ``compression_ratio`` (>= ~1), ``encode_gbps`` and ``decode_gbps``
            (GB/s of original KV). All other columns (``policy_id``, ``label``, ``method``,
            ``config_json``, ``kl_mean``, ``trial``, ...) are carried through.

    Returns:
        The non-dominated rows (original index kept) with the extra float column
        ``codec_seconds_per_gb`` (s/GB), sorted by accuracy descending, then ratio
        descending, then codec latency ascending.

    Raises:
        KvtuneError: a required column is missing or a throughput is <= 0.
    """
    missing = [c for c in ("relative_accuracy", "compression_ratio") if c not in trials.columns]
    if missing:
        raise KvtuneError(f"trials frame lacks objective column(s) {missing}")
    frame = add_codec_latency(trials)
    pts = np.column_stack(
        [pd.to_numeric(frame[c], errors="coerce").to_numpy(dtype=np.float64) for c in OBJECTIVE_COLUMNS]
    ) if len(frame) else np.empty((0, 3))
    mask = non_dominated_mask(pts, OBJECTIVE_MAXIMIZE)
    front = frame.loc[mask]
    return front.sort_values(
        list(OBJECTIVE_COLUMNS), ascending=[False, False, True], kind="mergesort"
    )


def _hv_2d(pts: np.ndarray, ref: np.ndarray) -> float:
    """Exact 2-D hypervolume (minimization) of points strictly below ``ref``."""
    if pts.shape[0] == 0:
        return 0.0
    order = np.lexsort((pts[:, 1], pts[:, 0]))
    x = pts[order, 0]
    y_min = np.minimum.accumulate(pts[order, 1])
    x_next = np.append(x[1:], ref[0])
    return float(np.sum((x_next - x) * (ref[1] - y_min)))


def _hv_rec(pts: np.ndarray, ref: np.ndarray) -> float:
    """Exact hypervolume by slicing along the last objective (minimization)."""
    m = pts.shape[1]
    if pts.shape[0] == 0:
        return 0.0
    if m == 1:
        return float(ref[0] - pts[:, 0].min())
    if m == 2:
        return _hv_2d(pts, ref)
    pts = pts[non_dominated_mask(pts, [False] * m)]
    pts = pts[np.argsort(pts[:, -1], kind="mergesort")]
    z = pts[:, -1]
    total = 0.0
    i = 0
    n = pts.shape[0]
    while i < n:
        j = i
        while j < n and z[j] == z[i]:
            j += 1
        z_next = z[j] if j < n else ref[-1]
        # Points with last coordinate <= z[i] cover the slab [z[i], z_next).
        total += (z_next - z[i]) * _hv_rec(pts[:j, :-1], ref[:-1])
        i = j
    return total


def hypervolume(
    points: np.ndarray, ref: Sequence[float], maximize: Sequence[bool]
) -> float:
    """Exact hypervolume dominated by ``points`` and bounded by ``ref``.

    The hypervolume is the measure of the union of the boxes spanned between each point and
    the reference point, counting only points strictly better than ``ref`` in every
    objective (others contribute nothing). Used for convergence plots of multi-objective
    search (compare runs with the same ``ref``). Exact for any input, including staircases
    and duplicates: 2-D is a sort-and-sweep in O(n log n); m >= 3 slices along the last
    objective and recurses (O(n^2 log n) in 3-D), fine for the few hundred points of a
    profiling run. NaN rows are ignored.

    Args:
        points: float array, shape ``(n, m)`` (m = 2 or 3 typical; any m >= 1 works).
        ref: length ``m``; the reference (worst acceptable) point, same units as points.
        maximize: length ``m``; ``True`` where larger is better.

    Returns:
        Hypervolume (float, product of the objectives' units); 0.0 if no point is strictly
        better than ``ref``.
    """
    pts = _as_minimization(points, maximize)
    r = _as_minimization(np.asarray(ref, dtype=np.float64)[None, :], maximize)[0]
    if r.shape[0] != pts.shape[1]:
        raise ValueError(f"ref has {r.shape[0]} entries, points have {pts.shape[1]} columns")
    if np.isnan(r).any() or np.isinf(r).any():
        raise ValueError(f"ref must be finite, got {list(ref)}")
    keep = ~np.isnan(pts).any(axis=1) & np.all(pts < r[None, :], axis=1)
    return float(_hv_rec(pts[keep], r))


def best_ratio_per_floor(trials: pd.DataFrame, floors: Sequence[float] = (0.99, 0.97, 0.95, 0.90)) -> dict[float, float | None]:
    """The highest ``compression_ratio`` among the ``trials`` whose relative accuracy's 95 %
    interval lower end (``relative_accuracy_lo``, a fraction; ``relative_accuracy`` where the
    frame has no interval) is at least each floor; ``None`` where no trial clears it.

    The caller picks the rows (e.g. one fidelity); rows with a NaN lower end never clear a
    floor. The same gate the policy tables apply per accuracy floor.
    """
    col = "relative_accuracy_lo" if "relative_accuracy_lo" in trials.columns else "relative_accuracy"
    lo = pd.to_numeric(trials[col], errors="coerce") if len(trials) else pd.Series(dtype=float)
    ratio = pd.to_numeric(trials["compression_ratio"], errors="coerce") if len(trials) else pd.Series(dtype=float)
    out: dict[float, float | None] = {}
    for floor in floors:
        ok = ratio[lo >= floor].dropna()
        out[float(floor)] = float(ok.max()) if len(ok) else None
    return out
