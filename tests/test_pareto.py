"""Tests of kvtune.search.pareto: non-domination against brute force, exact hypervolume."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pandas as pd
import pytest

from kvtune.core.errors import KvtuneError
from kvtune.search.pareto import add_codec_latency, best_ratio_per_floor, hypervolume, non_dominated_mask, pareto_front


def brute_force_mask(points: np.ndarray, maximize) -> np.ndarray:
    """O(n^2) definition: i is kept iff no j is >= in all objectives and > in one."""
    sign = np.where(np.asarray(maximize), 1.0, -1.0)
    q = points * sign  # larger is better everywhere
    n = len(q)
    keep = np.ones(n, dtype=bool)
    for i in range(n):
        if np.isnan(q[i]).any():
            keep[i] = False
            continue
        for j in range(n):
            if j == i or np.isnan(q[j]).any():
                continue
            if np.all(q[j] >= q[i]) and np.any(q[j] > q[i]):
                keep[i] = False
                break
    return keep


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("m", [2, 3])
@pytest.mark.parametrize("kind", ["continuous", "ties"])
def test_non_dominated_mask_matches_brute_force(seed, m, kind):
    rng = np.random.default_rng(1000 * seed + 10 * m + (kind == "ties"))
    n = 150
    if kind == "ties":
        pts = rng.integers(0, 6, size=(n, m)).astype(float)  # many ties and exact duplicates
    else:
        pts = rng.normal(size=(n, m))
        pts[: n // 5] = pts[n // 5 : 2 * (n // 5)]  # exact duplicate block
    maximize = [bool(v) for v in rng.integers(0, 2, size=m)]
    got = non_dominated_mask(pts, maximize)
    want = brute_force_mask(pts, maximize)
    assert got.dtype == bool and got.shape == (n,)
    np.testing.assert_array_equal(got, want)


def test_duplicates_are_all_kept_and_nan_rows_dropped():
    pts = np.array([[1.0, 1.0], [1.0, 1.0], [0.0, 2.0], [0.5, 0.5], [np.nan, 9.0], [9.0, np.nan]])
    got = non_dominated_mask(pts, [True, True])
    assert got.tolist() == [True, True, True, False, False, False]


def test_non_dominated_mask_small_known_case_minimize():
    # minimize both: (1,3), (2,2), (3,1) are a front; (3,3) is dominated by (2,2).
    pts = np.array([[1, 3], [2, 2], [3, 1], [3, 3]], dtype=float)
    assert non_dominated_mask(pts, [False, False]).tolist() == [True, True, True, False]
    # maximize both: only (3,3) survives.
    assert non_dominated_mask(pts, [True, True]).tolist() == [False, False, False, True]


def test_non_dominated_mask_empty_and_shape_errors():
    assert non_dominated_mask(np.empty((0, 3)), [True, True, False]).shape == (0,)
    with pytest.raises(ValueError):
        non_dominated_mask(np.ones((4, 2)), [True, True, True])


# --------------------------------------------------------------------------- hypervolume


def test_hypervolume_2d_staircase_closed_form():
    pts = np.array([[1.0, 3.0], [2.0, 2.0], [3.0, 1.0]])
    assert hypervolume(pts, [0.0, 0.0], [True, True]) == 6.0
    # Same staircase mirrored for minimization with ref (4, 4): area 1*3 + 1*2 + 1*1 = 6.
    assert hypervolume(4.0 - pts, [4.0, 4.0], [False, False]) == 6.0


@pytest.mark.parametrize("n", [1, 2, 3, 5, 8])
def test_hypervolume_2d_staircase_general(n):
    # points (i, n+1-i), i = 1..n: area = sum_i (n+1-i) = n (n+1) / 2
    pts = np.array([[i, n + 1 - i] for i in range(1, n + 1)], dtype=float)
    assert hypervolume(pts, [0, 0], [True, True]) == n * (n + 1) / 2


@pytest.mark.parametrize("n", [1, 2, 3, 4, 6])
def test_hypervolume_3d_staircase_closed_form(n):
    # Points with i + j + k = n + 2, i, j, k >= 1: the union of their boxes is the set of unit
    # cells (a, b, c), a, b, c >= 1, a + b + c <= n + 2: C(n + 2, 3) cells.
    pts = np.array(
        [(i, j, n + 2 - i - j) for i in range(1, n + 1) for j in range(1, n + 2 - i)], dtype=float
    )
    assert hypervolume(pts, [0, 0, 0], [True, True, True]) == math.comb(n + 2, 3)


def test_hypervolume_3d_three_corners():
    pts = np.array([[3, 1, 1], [1, 3, 1], [1, 1, 3]], dtype=float)
    # inclusion-exclusion: 3 * 3 - 3 * 1 + 1 = 7
    assert hypervolume(pts, [0, 0, 0], [True, True, True]) == 7.0
    # mixed directions: negate the last objective and its reference
    pts2 = pts.copy()
    pts2[:, 2] *= -1
    assert hypervolume(pts2, [0, 0, 0], [True, True, False]) == 7.0


def test_hypervolume_ignores_points_not_better_than_ref_and_duplicates():
    pts = np.array([[2.0, 2.0], [2.0, 2.0], [5.0, -1.0], [-1.0, 5.0], [1.0, 1.0]])
    assert hypervolume(pts, [0.0, 0.0], [True, True]) == 4.0
    assert hypervolume(np.array([[-1.0, -1.0]]), [0.0, 0.0], [True, True]) == 0.0


def brute_force_cells(pts: np.ndarray, ref: np.ndarray) -> int:
    """Count unit cells dominated by integer points (maximize, integer ref)."""
    hi = pts.max(axis=0).astype(int)
    ranges = [range(int(ref[d]), int(hi[d])) for d in range(pts.shape[1])]
    count = 0
    for cell in itertools.product(*ranges):
        upper = np.asarray(cell, dtype=float) + 1.0  # the cell [c, c+1) is covered iff p >= c+1
        if np.any(np.all(pts >= upper, axis=1)):
            count += 1
    return count


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("m", [2, 3])
def test_hypervolume_matches_cell_count_on_integer_points(seed, m):
    rng = np.random.default_rng(seed + 50 * m)
    pts = rng.integers(1, 8, size=(25, m)).astype(float)
    ref = np.zeros(m)
    assert hypervolume(pts, ref, [True] * m) == brute_force_cells(pts, ref)


# --------------------------------------------------------------------------- pareto_front


def _frame() -> pd.DataFrame:
    rows = [
        # id,   acc,   cr,  enc,  dec
        ("a", 0.99, 4.0, 10.0, 10.0),  # front: latency 0.2
        ("b", 0.99, 3.0, 10.0, 10.0),  # dominated by a (lower ratio)
        ("c", 0.95, 8.0, 5.0, 5.0),  # front: best ratio
        ("d", 0.99, 4.0, 20.0, 20.0),  # front: dominates a? same acc/cr, latency 0.1 < 0.2 -> yes
        ("e", 1.00, 2.0, 2.0, 2.0),  # front: best accuracy
        ("f", 0.94, 7.0, 5.0, 5.0),  # dominated by c
        ("g", float("nan"), 50.0, 100.0, 100.0),  # failed trial: never on the front
        ("h", 0.99, 4.0, 20.0, 20.0),  # exact copy of d: kept too
    ]
    df = pd.DataFrame(rows, columns=["policy_id", "relative_accuracy", "compression_ratio", "encode_gbps", "decode_gbps"])
    df["label"] = "L-" + df["policy_id"]
    df["kl_mean"] = np.arange(len(df), dtype=float)
    return df


def test_pareto_front_known_set_and_latency_column():
    front = pareto_front(_frame())
    assert sorted(front["policy_id"]) == ["c", "d", "e", "h"]
    lat = dict(zip(front["policy_id"], front["codec_seconds_per_gb"], strict=True))
    assert lat["d"] == pytest.approx(0.1)
    assert lat["c"] == pytest.approx(0.4)
    assert lat["e"] == pytest.approx(1.0)
    # extra columns and original index carried through; sorted by accuracy descending
    assert front["kl_mean"].tolist() == [4.0, 3.0, 7.0, 2.0]
    assert front.index.tolist() == [4, 3, 7, 2]


def test_pareto_front_matches_brute_force_on_random_trials():
    rng = np.random.default_rng(7)
    n = 300
    df = pd.DataFrame(
        {
            "relative_accuracy": rng.choice([0.9, 0.95, 0.97, 0.99, 1.0], size=n),
            "compression_ratio": rng.choice([2.0, 4.0, 5.33, 8.0], size=n),
            "encode_gbps": rng.choice([1.0, 2.0, 5.0], size=n),
            "decode_gbps": rng.choice([1.0, 2.0, 5.0], size=n),
        }
    )
    front = pareto_front(df)
    lat = 1 / df["encode_gbps"] + 1 / df["decode_gbps"]
    pts = np.column_stack([df["relative_accuracy"], df["compression_ratio"], lat])
    want = np.flatnonzero(brute_force_mask(pts, [True, True, False]))
    assert sorted(front.index) == want.tolist()


def test_add_codec_latency_rejects_non_positive_throughput():
    df = _frame()
    df.loc[0, "decode_gbps"] = 0.0
    with pytest.raises(KvtuneError, match="decode_gbps"):
        add_codec_latency(df)
    with pytest.raises(KvtuneError, match="compression_ratio"):
        pareto_front(df.drop(columns=["compression_ratio"]))


def test_best_ratio_per_floor_gates_on_the_interval_lower_end():
    trials = pd.DataFrame({"compression_ratio": [2.5, 3.5, 6.0, 9.0, 12.0],
                           "relative_accuracy": [0.998, 0.99, 0.985, 0.96, 0.93],
                           "relative_accuracy_lo": [0.995, 0.985, 0.972, 0.951, float("nan")]})
    assert best_ratio_per_floor(trials) == {0.99: 2.5, 0.97: 6.0, 0.95: 9.0, 0.90: 9.0}  # NaN never clears
    assert best_ratio_per_floor(trials.drop(columns="relative_accuracy_lo"), (0.99, 0.95)) == {0.99: 3.5, 0.95: 9.0}
    assert best_ratio_per_floor(trials.iloc[:0], (0.97,)) == {0.97: None}
