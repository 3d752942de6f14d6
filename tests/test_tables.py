"""Tests of kvtune.tables: latency model, lower envelope, compiled policy tables."""

from __future__ import annotations

import json
import math
import os

import numpy as np
import pandas as pd
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from kvtune.core.errors import KvtuneError, TableError
from kvtune.search.pareto import pareto_front
from kvtune.tables import (
    PolicyTable,
    bytes_per_s_to_gbps,
    compile_policy_table,
    gbps_to_bytes_per_s,
    gbps_to_x_s_per_gb,
    line_coefficients,
    locate_interval,
    lower_envelope,
    threshold_bandwidth,
    threshold_gbps,
    transfer_seconds,
    uncompressed_seconds,
    x_s_per_gb_to_gbps,
)
from kvtune.core.atomic import atomic_path

# ------------------------------------------------------------------------------ latency


def test_unit_conversions():
    assert gbps_to_bytes_per_s(8.0) == 1e9
    assert bytes_per_s_to_gbps(1.25e9) == 10.0
    assert gbps_to_x_s_per_gb(40.0) == 0.2
    assert x_s_per_gb_to_gbps(0.0) == math.inf
    assert x_s_per_gb_to_gbps(math.inf) == 0.0
    np.testing.assert_allclose(gbps_to_bytes_per_s(np.array([1.0, 100.0])), [1.25e8, 1.25e10])


def test_latency_closed_form_values():
    # cr = 4, 10 GB/s encode and decode: S = 5 GB/s, B* = 0.75 * 5 GB/s = 3.75 GB/s = 30 Gbps.
    assert threshold_bandwidth(4.0, 10e9, 10e9) == pytest.approx(3.75e9)
    assert threshold_gbps(4.0, 10.0, 10.0) == pytest.approx(30.0)
    # 1 GB at 10 Gbps (1.25e9 B/s): 0.1 s encode + 0.2 s wire + 0.1 s decode vs 0.8 s raw.
    assert transfer_seconds(1e9, 1.25e9, 10e9, 10e9, 4.0) == pytest.approx(0.4)
    assert uncompressed_seconds(1e9, 1.25e9) == pytest.approx(0.8)
    a, b = line_coefficients(4.0, 10.0, 10.0)
    assert (a, b) == (pytest.approx(0.2), 0.25)
    # At the threshold, both take the same time.
    bstar = threshold_bandwidth(4.0, 10e9, 10e9)
    assert transfer_seconds(1e9, bstar, 10e9, 10e9, 4.0) == pytest.approx(uncompressed_seconds(1e9, bstar))
    # cr <= 1 never pays: threshold 0
    assert threshold_bandwidth(1.0, 10e9, 10e9) == 0.0
    assert threshold_bandwidth(0.5, 10e9, 10e9) == 0.0


@settings(max_examples=250, deadline=None)
@given(
    ratio=st.floats(0.1, 64.0),
    enc=st.floats(1e6, 1e12),
    dec=st.floats(1e6, 1e12),
    bandwidth=st.floats(1e5, 1e12),
    volume=st.floats(1e3, 1e12),
)
def test_compression_pays_exactly_below_threshold(ratio, enc, dec, bandwidth, volume):
    bstar = threshold_bandwidth(ratio, enc, dec)
    # stay clear of the boundary, where rounding can go either way
    assume(abs(bandwidth - bstar) > 1e-7 * max(bandwidth, bstar))
    t_p = transfer_seconds(volume, bandwidth, enc, dec, ratio)
    t_none = uncompressed_seconds(volume, bandwidth)
    assert (t_p < t_none) == (bandwidth < bstar)
    if ratio <= 1.0:
        assert bstar == 0.0 and t_p > t_none


# ------------------------------------------------------------------------------ envelope


def test_lower_envelope_hand_example():
    # none (0, 1), p1 (0.1, 0.5), p2 (0.3, 0.2), p3 (1.0, 0.9) never wins.
    a = np.array([0.0, 0.1, 0.3, 1.0])
    b = np.array([1.0, 0.5, 0.2, 0.9])
    ivs = lower_envelope(a, b)
    assert [iv.index for iv in ivs] == [0, 1, 2]
    assert [iv.x_lo for iv in ivs] == pytest.approx([0.0, 0.2, 2 / 3])
    assert [iv.x_hi for iv in ivs] == pytest.approx([0.2, 2 / 3, math.inf])
    # runners-up at midpoints: x=0.1 -> p1 (0.15), p2 (0.32); x=0.433 -> none, p2 ...
    assert ivs[0].runners_up == (1, 2)
    assert ivs[1].runners_up == (2, 0)
    assert ivs[2].runners_up == (1, 0)  # probed at x = 2/3 + 1: p1 = 0.933, none = 1.67


def test_lower_envelope_ties_are_deterministic():
    # identical lines -> lowest index; parallel -> lowest a; same a -> smaller b from x > 0.
    a = np.array([0.5, 0.2, 0.2, 0.2, 0.0, 0.0])
    b = np.array([0.1, 0.3, 0.3, 0.6, 1.0, 2.0])
    ivs = lower_envelope(a, b)
    assert [iv.index for iv in ivs] == [4, 1, 0]
    assert ivs[0].x_lo == 0.0 and ivs[0].x_hi == pytest.approx(0.2 / 0.7)
    assert lower_envelope(np.array([1.0, 1.0]), np.array([1.0, 1.0]))[0].index == 0
    # a finite domain clips the last interval
    ivs = lower_envelope(a, b, x_max=2.0)  # line 0 takes over at x = 1.5
    assert [iv.index for iv in ivs] == [4, 1, 0] and ivs[-1].x_hi == 2.0
    assert ivs[-1].x_lo == pytest.approx(1.5)
    ivs = lower_envelope(a, b, x_max=1.0)
    assert [iv.index for iv in ivs] == [4, 1] and ivs[-1].x_hi == 1.0
    ivs = lower_envelope(a, b, x_max=0.1)
    assert [(iv.index, iv.x_hi) for iv in ivs] == [(4, 0.1)]


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("n", [1, 2, 5, 40, 300])
def test_lower_envelope_equals_brute_force_argmin(seed, n):
    rng = np.random.default_rng(seed * 1000 + n)
    a = rng.uniform(0.0, 1.0, n)
    b = rng.uniform(0.01, 1.0, n)
    if n > 2:
        a[0], b[0] = 0.0, 1.0  # the uncompressed line
    ivs = lower_envelope(a, b)
    # exact partition of [0, inf)
    assert ivs[0].x_lo == 0.0 and ivs[-1].x_hi == math.inf
    assert all(p.x_hi == q.x_lo for p, q in zip(ivs, ivs[1:], strict=False))
    assert all(iv.x_lo < iv.x_hi for iv in ivs)
    assert len({iv.index for iv in ivs}) == len(ivs)  # each line wins at most once
    xs = np.concatenate([np.linspace(0.0, 20.0, 20001), np.geomspace(20.0, 1e6, 200)])
    bps = np.array([iv.x_lo for iv in ivs[1:]])
    if bps.size:
        near = np.min(np.abs(xs[:, None] - bps[None, :]), axis=1) < 1e-9 * np.maximum(1.0, xs)
        xs = xs[~near]
    values = a[None, :] + b[None, :] * xs[:, None]
    brute = np.argmin(values, axis=1)
    got = np.array([ivs[locate_interval(ivs, x)].index for x in xs])
    np.testing.assert_array_equal(got, brute)
    # runners-up are the next best lines at the probe point, in order
    for iv in ivs:
        x = 0.5 * (iv.x_lo + iv.x_hi) if math.isfinite(iv.x_hi) else iv.x_lo + max(1.0, iv.x_lo)
        order = [int(i) for i in np.argsort(a + b * x, kind="stable") if i != iv.index]
        assert list(iv.runners_up) == order[: min(2, n - 1)]


def test_lower_envelope_rejects_bad_input():
    with pytest.raises(ValueError):
        lower_envelope(np.array([]), np.array([]))
    with pytest.raises(ValueError):
        lower_envelope(np.array([0.0, np.nan]), np.array([1.0, 0.5]))
    with pytest.raises(ValueError):
        lower_envelope(np.array([0.0]), np.array([1.0, 0.5]))


# ------------------------------------------------------------------------------ tables

# Hand-built Pareto front: (id, accuracy, ratio, enc GB/s, dec GB/s) -> line (a, b)
HAND = [
    ("p1", 0.999, 2.0, 20.0, 20.0),  # a = 0.1, b = 0.5
    ("p2", 0.985, 4.0, 10.0, 10.0),  # a = 0.2, b = 0.25
    ("p3", 0.960, 8.0, 5.0, 5.0),  # a = 0.4, b = 0.125
    ("p4", 0.920, 16.0, 2.5, 2.5),  # a = 0.8, b = 0.0625
    ("p5", 0.995, 2.5, 4.0, 4.0),  # a = 0.5, b = 0.4
]


def hand_pareto() -> pd.DataFrame:
    df = pd.DataFrame(HAND, columns=["policy_id", "relative_accuracy", "compression_ratio", "encode_gbps", "decode_gbps"])
    df["label"] = "policy " + df["policy_id"]
    df["method"] = "tqc"
    df["config_json"] = [json.dumps({"name": p, "bits": i + 2}) for i, p in enumerate(df["policy_id"])]
    return df


def random_trials(seed: int = 0, n: int = 80) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    bits = rng.integers(2, 9, n)
    return pd.DataFrame(
        {
            "policy_id": [f"{i:012x}" for i in range(n)],
            "label": [f"kivi-{b}b" for b in bits],
            "method": "tqc",
            "config_json": [json.dumps({"bits": int(b)}) for b in bits],
            "compression_ratio": 16.0 / bits * rng.uniform(0.8, 1.2, n),
            "relative_accuracy": 1.0 - 0.4 * np.exp(-0.7 * bits) * rng.uniform(0.5, 2.0, n),
            "encode_gbps": rng.uniform(0.5, 20.0, n),
            "decode_gbps": rng.uniform(0.5, 20.0, n),
            "kl_mean": rng.random(n),
            "top1_agreement": rng.random(n),
            "ppl_ratio": 1.0 + rng.random(n),
            "trial": np.arange(n),
        }
    )


@pytest.fixture(scope="module")
def hand_table() -> PolicyTable:
    return compile_policy_table(hand_pareto(), model="SmolLM2-135M", workload="qa", device="cpu")


def test_compiled_hand_table_has_expected_intervals(hand_table):
    t = hand_table
    assert t.floors == (0.99, 0.97, 0.95, 0.90)
    expected = {
        # floor: [(policy, x_lo, x_hi)] with x in s/GB
        0.99: [("none", 0.0, 0.2), ("p1", 0.2, 4.0), ("p5", 4.0, math.inf)],
        0.97: [("none", 0.0, 0.2), ("p1", 0.2, 0.4), ("p2", 0.4, math.inf)],
        0.95: [("none", 0.0, 0.2), ("p1", 0.2, 0.4), ("p2", 0.4, 1.6), ("p3", 1.6, math.inf)],
        0.90: [("none", 0.0, 0.2), ("p1", 0.2, 0.4), ("p2", 0.4, 1.6), ("p3", 1.6, 6.4), ("p4", 6.4, math.inf)],
    }
    for floor, rows in expected.items():
        iv = t.intervals(floor)
        assert iv["policy_id"].tolist() == [r[0] for r in rows]
        assert iv["x_lo_s_per_gb"].tolist() == pytest.approx([r[1] for r in rows])
        assert iv["x_hi_s_per_gb"].tolist() == pytest.approx([r[2] for r in rows])
        # Gbps view of the same breakpoints: 8 / x
        assert iv["bandwidth_hi_gbps"].tolist() == pytest.approx([8 / r[1] if r[1] else math.inf for r in rows])
        assert iv["bandwidth_lo_gbps"].tolist() == pytest.approx([8 / r[2] for r in rows])
    frame = t.frame
    assert (frame["schema_version"] == 1).all() and (frame["model"] == "SmolLM2-135M").all()
    p1 = frame[frame["policy_id"] == "p1"].iloc[0]
    assert p1["a_s_per_gb"] == pytest.approx(0.1) and p1["b"] == 0.5
    # the first breakpoint is p1's threshold B* = 8 (1 - 1/2) / 0.1 = 40 Gbps
    assert p1["threshold_gbps"] == pytest.approx(40.0)
    none = frame[frame["policy_id"] == "none"].iloc[0]
    assert (none["a_s_per_gb"], none["b"], none["method"]) == (0.0, 1.0, "none")
    assert json.loads(frame.iloc[0]["runners_up"]) == ["p1", "p5"]


@pytest.mark.parametrize(
    ("bandwidth_gbps", "q_min", "policy_id", "floor"),
    [
        (100.0, 0.99, "none", 0.99),
        (10.0, 0.99, "p1", 0.99),
        (40.0, 0.99, "p1", 0.99),  # exactly at a breakpoint (x = 0.2): intervals are [x_lo, x_hi)
        (1.0, 0.99, "p5", 0.99),
        (10.0, 0.97, "p2", 0.97),
        (30.0, 0.96, "p1", 0.97),  # q_min 0.96 -> bucket 0.97
        (3.0, 0.95, "p3", 0.95),
        (1.0, 0.90, "p4", 0.90),
        (1.0, 0.5, "p4", 0.90),
        (math.inf, 0.9, "none", 0.90),
    ],
)
def test_select_hand_table(hand_table, bandwidth_gbps, q_min, policy_id, floor):
    sel = hand_table.select(bandwidth_gbps, q_min)
    assert sel.policy_id == policy_id
    assert sel.accuracy_floor == floor
    assert sel.bandwidth_lo_gbps < bandwidth_gbps <= sel.bandwidth_hi_gbps
    assert len(sel.runners_up) == 2 and sel.runners_up == tuple(p.policy_id for p in sel.alternatives)


def test_select_errors(hand_table):
    with pytest.raises(TableError, match="no accuracy floor"):
        hand_table.select(10.0, 0.995)
    with pytest.raises(KvtuneError):
        hand_table.select(0.0, 0.9)
    with pytest.raises(KvtuneError):
        hand_table.select(float("nan"), 0.9)


def brute_force_choice(pareto: pd.DataFrame, floor: float, bandwidths_gbps: np.ndarray):
    """Fastest of "none" + Pareto rows with accuracy >= floor, by direct evaluation of
    a + x / cr (x = 8 / Gbps); returns (policy ids, seconds per GB) per bandwidth."""
    cand = pareto[pareto["relative_accuracy"] >= floor]
    ids = np.array(["none", *cand["policy_id"]])
    a = np.r_[0.0, 1 / cand["encode_gbps"] + 1 / cand["decode_gbps"]]
    b = np.r_[1.0, 1 / cand["compression_ratio"]]
    x = 8.0 / np.asarray(bandwidths_gbps)
    times = a[None, :] + b[None, :] * x[:, None]
    best = np.argmin(times, axis=1)
    return ids[best], times[np.arange(len(x)), best]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_select_matches_brute_force_argmin(seed):
    trials = random_trials(seed)
    pareto = pareto_front(trials)
    table = compile_policy_table(pareto, model="m", workload="w", device="d")
    rng = np.random.default_rng(seed)
    bandwidths = np.r_[1.0, 2.5, 5.0, 10.0, 25.0, 40.0, 100.0, 200.0, 400.0, rng.uniform(0.5, 500.0, 40)]
    for q_min, floor in [(0.99, 0.99), (0.97, 0.97), (0.951, 0.97), (0.95, 0.95), (0.9, 0.9), (0.0, 0.9)]:
        best_ids, best_t = brute_force_choice(pareto, floor, bandwidths)
        for bw, best, t_best in zip(bandwidths, best_ids, best_t, strict=True):
            sel = table.select(bw, q_min)
            assert sel.accuracy_floor == floor
            assert sel.predicted_seconds_per_gb == pytest.approx(t_best, rel=1e-12)
            assert sel.policy_id == best
    # the table is not trivial: at low bandwidth some compressed policy wins
    assert table.select(1.0, 0.9).policy_id != "none"


def test_roundtrip_parquet_and_json_select_identically(tmp_path):
    pareto = pareto_front(random_trials(3))
    table = compile_policy_table(
        pareto, model="SmolLM2-135M", workload="qa", device="cpu", metadata={"run": "r1"}
    )
    pq_path = table.to_parquet(tmp_path / "table.parquet")
    js_path = table.to_json(tmp_path / "table.json")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["table.json", "table.parquet"]  # no temp files
    doc = json.loads(js_path.read_text())
    assert doc["schema_version"] == 1 and [t["accuracy_floor"] for t in doc["tables"]] == [0.99, 0.97, 0.95, 0.9]
    assert doc["tables"][0]["intervals"][0]["bandwidth_hi_gbps"] == "inf"
    for path in (pq_path, js_path):
        loaded = PolicyTable.load(path)
        pd.testing.assert_frame_equal(loaded.frame, table.frame)
        assert loaded.metadata == table.metadata
        for bw in [1.0, 3.3, 12.0, 47.0, 100.0, 399.0]:
            for q in [0.99, 0.96, 0.9]:
                assert loaded.select(bw, q) == table.select(bw, q)


# ------------------------------------------------------------------------------ malformed


def _rewrite_json(src, dst, edit):
    doc = json.loads(src.read_text())
    edit(doc)
    dst.write_text(json.dumps(doc))
    return dst


def test_malformed_json_tables_raise_table_error(tmp_path, hand_table):
    good = hand_table.to_json(tmp_path / "good.json")

    def bump_version(doc):
        doc["schema_version"] = 2

    def drop_column(doc):
        del doc["tables"][0]["intervals"][1]["b"]

    def non_monotone(doc):
        ivs = doc["tables"][3]["intervals"]  # floor 0.90: 5 intervals
        ivs[2]["x_lo_s_per_gb"], ivs[2]["x_hi_s_per_gb"] = ivs[2]["x_hi_s_per_gb"], ivs[2]["x_lo_s_per_gb"]

    def gap(doc):
        ivs = doc["tables"][2]["intervals"]
        ivs[1]["x_hi_s_per_gb"] = 0.3  # next interval starts at 0.4
        ivs[1]["bandwidth_lo_gbps"] = 8 / 0.3

    def floor_as_list(doc):
        doc["tables"][1]["accuracy_floor"] = [doc["tables"][1]["accuracy_floor"]]

    def floor_as_text(doc):
        doc["tables"][1]["accuracy_floor"] = "0.97"

    def floor_as_bool(doc):
        doc["tables"][1]["accuracy_floor"] = True

    def nan_in_runner_up(doc):  # Python's json writes and reads the token NaN
        iv = next(iv for t in doc["tables"] for iv in t["intervals"] if iv["runner_up_policies"])
        iv["runner_up_policies"][0]["b"] = float("nan")

    cases = [
        (bump_version, "unknown schema_version 2"),
        (drop_column, r"missing column.*'b'"),
        (non_monotone, "non-monotone"),
        (gap, "gap"),
        (floor_as_list, r"'accuracy_floor' must be a number, got \[0.97\]"),
        (floor_as_text, "'accuracy_floor' must be a number, got '0.97'"),
        (floor_as_bool, "'accuracy_floor' must be a number, got True"),
        (nan_in_runner_up, "runner_up_policies holds a NaN or infinite number"),
    ]
    for edit, message in cases:
        bad = _rewrite_json(good, tmp_path / f"bad_{edit.__name__}.json", edit)
        with pytest.raises(TableError, match=message) as info:
            PolicyTable.load(bad)
        assert str(bad) in str(info.value)


def test_malformed_parquet_tables_raise_table_error(tmp_path, hand_table):
    frame = hand_table.frame
    v2 = frame.assign(schema_version=2)
    v2.to_parquet(tmp_path / "v2.parquet")
    frame.drop(columns=["runners_up"]).to_parquet(tmp_path / "missing.parquet")
    order = list(range(len(frame)))
    assert frame["policy_id"].iloc[12:14].tolist() == ["p2", "p3"]  # floor 0.90
    order[12], order[13] = 13, 12  # p3's interval stored before p2's
    frame.iloc[order].to_parquet(tmp_path / "order.parquet")
    (tmp_path / "garbage.parquet").write_bytes(b"not parquet at all")
    for name, message in [
        ("v2.parquet", "unknown schema_version 2"),
        ("missing.parquet", r"missing column.*runners_up"),
        ("order.parquet", "non-monotone"),
        ("garbage.parquet", "cannot read Parquet"),
    ]:
        with pytest.raises(TableError, match=message) as info:
            PolicyTable.load(tmp_path / name)
        assert name in str(info.value)
    (tmp_path / "table.csv").write_text("policy_id\np1\n")
    with pytest.raises(TableError, match="suffix"):
        PolicyTable.load(tmp_path / "table.csv")


def _first_compressed(doc):
    return next(iv for t in doc["tables"] for iv in t["intervals"] if iv["policy_id"] != "none")


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("a_s_per_gb", -0.5, r"column a_s_per_gb = -0.5 must be finite and >= 0"),
        ("b", -0.25, r"column b = -0.25 must be finite and >= 0"),
        ("b", 1e9, r"column b = 1000000000.0 does not equal 1 / compression_ratio"),
        ("compression_ratio", 0, r"column compression_ratio = 0.0 must be > 0"),
        ("relative_accuracy", 5.0, r"column relative_accuracy = 5.0 is outside \[0, 2\]"),
        ("relative_accuracy", -0.1, r"column relative_accuracy = -0.1 is outside"),
        ("relative_accuracy", "nan", r"row \d+: column relative_accuracy has a missing, NaN"),
        ("encode_gbps", -1.0, r"column encode_gbps = -1.0 must be > 0"),
        ("config_json", "{bad", r"column config_json is not valid JSON"),
        ("config_json", "[1, 2]", r"column config_json must be a JSON object"),
    ],
)
def test_impossible_policy_rows_are_rejected_on_load(tmp_path, hand_table, field, value, message):
    good = hand_table.to_json(tmp_path / "good.json")
    bad = _rewrite_json(good, tmp_path / "bad.json", lambda doc: _first_compressed(doc).update({field: value}))
    with pytest.raises(TableError, match=message) as info:
        PolicyTable.load(bad)
    assert str(bad) in str(info.value) and "row " in str(info.value)


def test_deeply_nested_json_is_a_table_error(tmp_path, hand_table):
    good = hand_table.to_json(tmp_path / "good.json")
    deep = "[" * 100_000 + "]" * 100_000
    nested_config = _rewrite_json(good, tmp_path / "deep_config.json", lambda doc: _first_compressed(doc).update({"config_json": deep}))
    with pytest.raises(TableError, match="nested too deeply"):
        PolicyTable.load(nested_config)
    nested_doc = tmp_path / "deep_doc.json"
    nested_doc.write_text('{"format": "kvtune.policy_table", "schema_version": 1, "extra": ' + deep + "}")
    with pytest.raises(TableError, match="nested too deeply"):
        PolicyTable.load(nested_doc)


def test_missing_table_files_are_not_found_whatever_their_suffix(tmp_path):
    for name in ("nothing", "t.json", "t.parquet", "t.csv"):
        with pytest.raises(TableError, match=f"{name}: file not found"):
            PolicyTable.load(tmp_path / name)
    (tmp_path / "t.json").mkdir()
    with pytest.raises(TableError, match="t.json: not a file"):
        PolicyTable.load(tmp_path / "t.json")
    (tmp_path / "t.csv").write_text("a,b")
    with pytest.raises(TableError, match="unknown policy table suffix '.csv'"):
        PolicyTable.load(tmp_path / "t.csv")


def test_table_files_over_the_size_limit_are_refused_before_reading(tmp_path, hand_table, monkeypatch):
    import kvtune.tables.policy_table as policy_table

    path = hand_table.to_json(tmp_path / "t.json")
    monkeypatch.setattr(policy_table, "MAX_TABLE_BYTES", path.stat().st_size - 1)
    monkeypatch.setattr(policy_table, "_read_json", lambda p: pytest.fail("read a file over the limit"))
    with pytest.raises(TableError, match=rf"file is {path.stat().st_size} bytes, more than .* limit of"):
        PolicyTable.load(path)


def test_impossible_runner_up_and_parquet_rows_are_rejected_on_load(tmp_path, hand_table):
    good = hand_table.to_json(tmp_path / "good.json")

    def bad_runner(doc):
        iv = next(iv for t in doc["tables"] for iv in t["intervals"] if iv["runner_up_policies"])
        iv["runner_up_policies"][0]["a_s_per_gb"] = -1.0

    bad = _rewrite_json(good, tmp_path / "bad_runner.json", bad_runner)
    with pytest.raises(TableError, match=r"row \d+: runner_up_policies\[0\] .*a_s_per_gb = -1.0 must be"):
        PolicyTable.load(bad)

    def runner_below_floor(doc):  # a plausible policy, but it does not meet its table's floor
        t = next(t for t in doc["tables"] if any(iv["runner_up_policies"] for iv in t["intervals"]))
        iv = next(iv for iv in t["intervals"] if iv["runner_up_policies"])
        iv["runner_up_policies"][0]["relative_accuracy"] = t["accuracy_floor"] - 0.05

    bad = _rewrite_json(good, tmp_path / "low_runner.json", runner_below_floor)
    with pytest.raises(TableError, match=r"runner_up_policies\[0\] \(policy \w+\) has relative_accuracy .* below the floor"):
        PolicyTable.load(bad)
    frame = hand_table.frame
    frame.loc[frame["policy_id"] == "p2", "b"] = -0.25
    frame.to_parquet(tmp_path / "neg_b.parquet")
    with pytest.raises(TableError, match=r"neg_b.parquet: row \d+ \(accuracy_floor 0.97, policy p2\): column b = -0.25"):
        PolicyTable.load(tmp_path / "neg_b.parquet")


def test_compile_rejects_bad_pareto():
    df = hand_pareto()
    with pytest.raises(TableError, match="duplicate"):
        compile_policy_table(pd.concat([df, df.iloc[:1]]), model="m", workload="w", device="d")
    with pytest.raises(TableError, match="reserved"):
        compile_policy_table(df.assign(policy_id=["none", "a", "b", "c", "d"]), model="m", workload="w", device="d")
    with pytest.raises(TableError, match="config_json"):
        compile_policy_table(df.drop(columns=["config_json"]), model="m", workload="w", device="d")


def test_atomic_path_leaves_original_on_failure(tmp_path):
    dest = tmp_path / "t.json"
    dest.write_text("old")
    with pytest.raises(RuntimeError):
        with atomic_path(dest) as tmp:
            tmp.write_text("half")
            raise RuntimeError("crash mid-write")
    assert dest.read_text() == "old"
    assert os.listdir(tmp_path) == ["t.json"]


# ------------------------------------------------------------------------------ latency, Gbps view

@settings(max_examples=300, deadline=None)
@given(
    ratio=st.floats(0.5, 32.0),
    enc_gb_s=st.floats(0.01, 100.0),
    dec_gb_s=st.floats(0.01, 100.0),
    bandwidth_gbps=st.floats(0.001, 1000.0),
)
def test_policy_entry_pays_exactly_below_threshold_gbps(ratio, enc_gb_s, dec_gb_s, bandwidth_gbps):
    """Same property in the units of a table row: a + b x < x  iff  Gbps < threshold_gbps."""
    from kvtune.tables import PolicyEntry

    a, b = line_coefficients(ratio, enc_gb_s, dec_gb_s)
    entry = PolicyEntry("p", "tqc", "p", "{}", a, b, ratio, 0.99, enc_gb_s, dec_gb_s,
                        threshold_gbps(ratio, enc_gb_s, dec_gb_s))
    assume(abs(bandwidth_gbps - entry.threshold_gbps) > 1e-7 * bandwidth_gbps)
    faster = entry.seconds_per_gb(bandwidth_gbps) < 8.0 / bandwidth_gbps
    assert faster == entry.pays_at(bandwidth_gbps) == (bandwidth_gbps < entry.threshold_gbps)


@settings(max_examples=25, deadline=None)
@given(ratio=st.floats(1.01, 32.0), enc_gb_s=st.floats(0.01, 100.0), dec_gb_s=st.floats(0.01, 100.0),
       factor=st.floats(0.01, 100.0))
def test_one_policy_table_compresses_exactly_below_threshold(ratio, enc_gb_s, dec_gb_s, factor):
    """A one-policy table switches from "none" to the policy exactly at B*."""
    df = pd.DataFrame([("p", 0.99, ratio, enc_gb_s, dec_gb_s)],
                      columns=["policy_id", "relative_accuracy", "compression_ratio", "encode_gbps", "decode_gbps"])
    df["label"], df["method"], df["config_json"] = "p", "tqc", "{}"
    table = compile_policy_table(df, floors=[0.99], model="m", workload="w", device="d")
    bstar = threshold_gbps(ratio, enc_gb_s, dec_gb_s)
    bw = bstar * factor
    assume(abs(factor - 1.0) > 1e-6)
    assert (table.select(bw, 0.99).policy_id == "p") == (bw < bstar)


# ------------------------------------------------------------------------------ floors, keys, metadata


def test_floors_are_configurable(hand_table):
    t = compile_policy_table(hand_pareto(), floors=[0.9, 0.9995], model="m", workload="w", device="d")
    assert t.floors == (0.9995, 0.9)
    assert t.intervals(0.9995)["policy_id"].tolist() == ["none"]  # only "none" reaches 99.95 %
    assert t.select(1.0, 0.95).accuracy_floor == 0.9995  # smallest floor >= q_min
    for bad in ([], [0.9, 0.9], [float("nan")], [-0.1], ["x"]):
        with pytest.raises(TableError):
            compile_policy_table(hand_pareto(), floors=bad, model="m", workload="w", device="d")


def test_floors_can_gate_on_the_interval_lower_bound():
    pareto = hand_pareto()
    point = compile_policy_table(pareto, floors=[0.99], model="m", workload="w", device="d")
    assert set(point.intervals(0.99)["policy_id"]) >= {"p1", "p5"}  # point estimates 99.9 %, 99.5 %
    pareto["relative_accuracy_lo"] = [0.995, 0.980, 0.950, 0.900, 0.985]  # p5's interval reaches below 99 %
    lo = compile_policy_table(pareto, floors=[0.99], model="m", workload="w", device="d", gate="relative_accuracy_lo")
    assert "p5" not in set(lo.intervals(0.99)["policy_id"]) and "p1" in set(lo.intervals(0.99)["policy_id"])
    with pytest.raises(TableError, match="gate column 'nope'"):
        compile_policy_table(pareto, model="m", workload="w", device="d", gate="nope")
    pareto.loc[0, "relative_accuracy_lo"] = float("nan")
    with pytest.raises(TableError, match="finite"):
        compile_policy_table(pareto, model="m", workload="w", device="d", gate="relative_accuracy_lo")


def test_extra_key_column_is_optional_and_keys_tables(tmp_path, hand_table):
    assert hand_table.keys == ("",) and (hand_table.frame["key"] == "").all()
    # a file written before the column existed loads with key ""
    legacy = hand_table.frame.drop(columns=["key"])
    legacy.to_parquet(tmp_path / "legacy.parquet")
    assert PolicyTable.load(tmp_path / "legacy.parquet").keys == ("",)
    # two prefix-ratio buckets in one table: same format, selected by key
    low = compile_policy_table(hand_pareto(), model="m", workload="w", device="d", key="prefix_ratio=[0,0.5)")
    front = hand_pareto()
    front["compression_ratio"] *= 2  # the other bucket compresses better
    high = compile_policy_table(front, floors=[0.95], model="m", workload="w", device="d", key="prefix_ratio=[0.5,1]")
    both = PolicyTable.combine([low, high])
    assert both.keys == ("prefix_ratio=[0,0.5)", "prefix_ratio=[0.5,1]") and both.floors == (0.99, 0.97, 0.95, 0.9)
    for path in (both.to_parquet(tmp_path / "k.parquet"), both.to_json(tmp_path / "k.json")):
        loaded = PolicyTable.load(path)
        pd.testing.assert_frame_equal(loaded.frame, both.frame)
        for key, table in (("prefix_ratio=[0,0.5)", low), ("prefix_ratio=[0.5,1]", high)):
            for bw in (1.0, 10.0, 30.0, 100.0):
                assert loaded.select(bw, 0.95, key=key).policy_id == table.select(bw, 0.95, key=key).policy_id
    # 3 Gbps (x = 8/3 s/GB): p3 (0.4 + x/8) in the low bucket, p2 (0.2 + x/8) with doubled ratios
    assert both.select(3.0, 0.95, key="prefix_ratio=[0,0.5)").policy_id == "p3"
    assert both.select(3.0, 0.95, key="prefix_ratio=[0.5,1]").policy_id == "p2"
    with pytest.raises(TableError, match="table key 'nope' not in"):
        both.select(10.0, 0.95, key="nope")
    with pytest.raises(TableError, match="no accuracy floor"):
        both.select(10.0, 0.99, key="prefix_ratio=[0.5,1]")  # that bucket has only 95 %
    with pytest.raises(TableError, match="appears in two tables"):
        PolicyTable.combine([low, low])
    doc = json.loads((tmp_path / "k.json").read_text())
    assert [t["key"] for t in doc["tables"]] == ["prefix_ratio=[0,0.5)"] * 4 + ["prefix_ratio=[0.5,1]"]


def test_select_slo_workload_and_volume(hand_table):
    # 10 Gbps, floor 0.90: p2 (a 0.2, b 0.25) optimal; x = 0.8 -> 0.4 s/GB
    sel = hand_table.select(10.0, 0.9)
    assert sel.kv_bytes == 1e9 and sel.predicted_seconds == pytest.approx(0.4)
    assert sel.uncompressed_seconds == pytest.approx(0.8)
    assert sel.slo_s is None and not sel.slo_violated
    assert [c.status for c in sel.candidates][0] == "chosen"
    # runners-up p3 (0.4 + 0.1 = 0.5 s/GB) and p1 (0.1 + 0.4 = 0.5): admissible, slower
    assert {c.policy_id: round(c.predicted_s, 9) for c in sel.candidates} == {"p2": 0.4, "p3": 0.5, "p1": 0.5}
    # SLO between the optimal and the runners-up: runners-up dropped, optimal met
    sel = hand_table.select(10.0, 0.9, slo_s=0.045, kv_bytes=100e6)
    assert sel.policy_id == "p2" and sel.predicted_seconds == pytest.approx(0.04) and not sel.slo_violated
    assert [c.status for c in sel.candidates] == ["chosen", "over_slo", "over_slo"]
    # SLO no one meets: fastest returned, flagged
    sel = hand_table.select(10.0, 0.9, slo_s=0.01, kv_bytes=100e6)
    assert sel.policy_id == "p2" and sel.slo_violated
    assert "VIOLATED" in sel.reason() and "over the SLO" in sel.reason()
    # a runner-up at B >= its B* is dropped as no_gain: at 100 Gbps "none" wins; p1's B* is 40
    sel = hand_table.select(100.0, 0.99)
    assert sel.policy_id == "none" and [c.status for c in sel.candidates] == ["chosen", "no_gain", "no_gain"]
    assert "B >= B*" in sel.reason()
    # workload must match
    assert hand_table.select(10.0, 0.9, workload="qa").policy_id == "p2"
    with pytest.raises(TableError, match="workload 'math' does not match the table's workload 'qa'"):
        hand_table.select(10.0, 0.9, workload="math")
    with pytest.raises(KvtuneError, match="kv_bytes"):
        hand_table.select(10.0, 0.9, kv_bytes=0)
    with pytest.raises(KvtuneError, match="slo_s"):
        hand_table.select(10.0, 0.9, slo_s=-1)


def test_kv_bytes_metadata_is_the_default_volume(tmp_path):
    t = compile_policy_table(hand_pareto(), model="m", workload="w", device="d",
                             metadata={"kv_bytes_per_request": 24e6})
    assert t.kv_bytes_per_request == 24e6 and t.select(10.0, 0.9).kv_bytes == 24e6
    assert PolicyTable.load(t.to_json(tmp_path / "t.json")).default_kv_bytes == 24e6
    with pytest.raises(TableError, match="kv_bytes_per_request"):
        compile_policy_table(hand_pareto(), model="m", workload="w", device="d",
                             metadata={"kv_bytes_per_request": "24MB"})


def test_malformed_key_in_json(tmp_path, hand_table):
    good = hand_table.to_json(tmp_path / "good.json")

    def numeric_key(doc):
        doc["tables"][0]["key"] = 3

    def duplicate_table(doc):  # same (key, floor) twice: breakpoints overlap
        doc["tables"].append(doc["tables"][0])

    for edit, message in [(numeric_key, "'key' must be a string"), (duplicate_table, "duplicate table")]:
        bad = _rewrite_json(good, tmp_path / f"bad_{edit.__name__}.json", edit)
        with pytest.raises(TableError, match=message):
            PolicyTable.load(bad)
    # the same in a frame (Parquet): rows of one floor stored twice
    frame = hand_table.frame
    doubled = pd.concat([frame, frame[frame["accuracy_floor"] == 0.99]])
    doubled.to_parquet(tmp_path / "doubled.parquet")
    with pytest.raises(TableError, match="duplicate rows"):
        PolicyTable.load(tmp_path / "doubled.parquet")


# ------------------------------------------------------------------------------ units

from kvtune.core.units import UnitError, parse_bandwidth_gbps, parse_bytes, parse_duration_s  # noqa: E402


@pytest.mark.parametrize(
    ("text", "gbps"),
    [("10Gbps", 10.0), ("10 gbps", 10.0), ("10Gb/s", 10.0), ("500Mbps", 0.5), ("1.25GB/s", 10.0),
     ("1.25GBps", 10.0), ("100MB/s", 0.8), ("2Tbps", 2000.0), ("1e3Mbps", 1.0), ("1GiB/s", 8 * 2**30 / 1e9)],
)
def test_parse_bandwidth(text, gbps):
    assert parse_bandwidth_gbps(text) == pytest.approx(gbps)


def test_parse_durations_and_bytes():
    assert parse_duration_s("200ms") == pytest.approx(0.2)
    assert parse_duration_s("1.5s") == 1.5 and parse_duration_s("250us") == pytest.approx(250e-6)
    assert parse_bytes("24MB") == 24e6 and parse_bytes("1GB") == 1e9 and parse_bytes("512B") == 512
    assert parse_bytes("1KiB") == 1024 and parse_bytes("2MiB") == 2 * 2**20 and parse_bytes("1GiB") == 2**30


@pytest.mark.parametrize(
    ("parser", "text", "message"),
    [
        (parse_bandwidth_gbps, "10", "has no unit"),
        (parse_bandwidth_gbps, "10GB", r"GB is a volume; did you mean GB/s"),
        (parse_bandwidth_gbps, "fast", "cannot parse bandwidth"),
        (parse_bandwidth_gbps, "0Gbps", "must be > 0"),
        (parse_bandwidth_gbps, "10 furlongs", "unknown bandwidth unit 'furlongs'"),
        (parse_duration_s, "200", "has no unit"),
        (parse_duration_s, "3h", "unknown duration unit 'h'"),
        (parse_duration_s, "-1s", "must be > 0"),
        (parse_bytes, "24Mb", r"bits\? volumes are in bytes"),
        (parse_bytes, "24", "has no unit"),
        (parse_bytes, "0MB", "must be > 0"),
    ],
)
def test_unit_parsing_errors(parser, text, message):
    with pytest.raises(UnitError, match=message):
        parser(text)
    assert issubclass(UnitError, KvtuneError)


# ------------------------------------------------------------------------------ the real run: export, select, CLI

from pathlib import Path  # noqa: E402

from typer.testing import CliRunner  # noqa: E402

from kvtune.cli import app  # noqa: E402
from kvtune.tables.run import export_run_table, load_run_table  # noqa: E402

REAL_RUN = Path(__file__).parent / "data" / "smollm2-default"  # frozen copy of profiles/smollm2-default
cli = CliRunner()


def test_real_run_table_loads_with_run_metadata():
    table = load_run_table(REAL_RUN)
    assert table.model == "smollm2-135m-instruct" and table.workload == "continuation"
    # 2 (K, V) x 30 layers x 3 KV heads x 64 head_dim x 1024 tokens x 2 bytes
    assert table.kv_bytes_per_request == 2 * 30 * 3 * 64 * 1024 * 2 == 23_592_960
    stored = PolicyTable.load(REAL_RUN / "policy_table.parquet")
    pd.testing.assert_frame_equal(table.frame, stored.frame)
    recompiled = load_run_table(REAL_RUN, recompile=True)
    pd.testing.assert_frame_equal(recompiled.frame, stored.frame)  # same envelope from pareto.parquet
    custom = load_run_table(REAL_RUN, floors=[0.98, 0.9])
    assert custom.floors == (0.98, 0.9)


@pytest.mark.parametrize("fmt", ["parquet", "json"])
def test_cli_export_both_formats_and_reload(tmp_path, fmt):
    out = tmp_path / f"table.{fmt}"
    res = cli.invoke(app, ["export", str(REAL_RUN), "--format", fmt, "--out", str(out)])
    assert res.exit_code == 0, res.output
    assert f"wrote {out}" in res.output and "re-loaded and validated" in res.output
    loaded = PolicyTable.load(out)
    pd.testing.assert_frame_equal(loaded.frame, PolicyTable.load(REAL_RUN / "policy_table.parquet").frame)
    assert loaded.kv_bytes_per_request == 23_592_960 and loaded.metadata["extra"]["run"] == "smollm2-default"
    # floors from the CLI recompile
    res = cli.invoke(app, ["export", str(REAL_RUN), "--format", fmt, "--out", str(out), "--floors", "0.98,0.9"])
    assert res.exit_code == 0, res.output
    assert PolicyTable.load(out).floors == (0.98, 0.9)


def test_cli_export_errors(tmp_path):
    res = cli.invoke(app, ["export", str(REAL_RUN), "--format", "csv"])
    assert res.exit_code == 2 and "unknown format 'csv'" in res.output
    res = cli.invoke(app, ["export", str(REAL_RUN), "--format", "json", "--out", str(tmp_path / "t.parquet")])
    assert res.exit_code == 2 and "suffix must be .json" in res.output
    res = cli.invoke(app, ["export", str(tmp_path), "--format", "json"])
    assert res.exit_code == 2 and "no run.json" in res.output
    res = cli.invoke(app, ["export", str(REAL_RUN), "--floors", "high"])
    assert res.exit_code == 2 and "--floors" in res.output


def test_cli_export_never_overwrites_stored_data(tmp_path):
    """An export into the run folder (over its settings, trials, front or own tables) or over an
    existing file that is not a policy table is refused, and the file keeps its bytes; an
    existing policy table elsewhere is replaced (the reload test writes twice)."""
    import shutil

    run = tmp_path / "run"
    shutil.copytree(REAL_RUN, run)
    for name, fmt in (("run.json", "json"), ("trials.parquet", "parquet"), ("pareto.parquet", "parquet"),
                      ("policy_table.json", "json"), ("new.json", "json")):
        before = (run / name).read_bytes() if (run / name).exists() else None
        res = cli.invoke(app, ["export", str(run), "--format", fmt, "--out", str(run / name), "--floors", "0.9"])
        assert res.exit_code == 2 and "inside the run folder" in res.output, (name, res.output)
        assert (run / name).read_bytes() == before if before is not None else not (run / name).exists()
    notes = tmp_path / "notes.json"
    notes.write_text('{"mine": 1}')
    res = cli.invoke(app, ["export", str(run), "--format", "json", "--out", str(notes)])
    assert res.exit_code == 2 and "is not a policy table" in res.output and notes.read_text() == '{"mine": 1}'


def test_default_export_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    path, table = export_run_table(REAL_RUN, "json")
    assert path == Path("smollm2-default.policy_table.json") and (tmp_path / path).is_file()


# On this CPU the real codecs run at 0.14-0.77 GB/s, so compression pays only below ~0.9-1.06 Gbps:
# at every bandwidth >= 1 Gbps the table says "none", and the reason lists why the compressed
# runners-up were dropped (B >= B*).
@pytest.mark.parametrize("gbps", [1, 5, 10, 25, 50, 100])
def test_cli_select_real_table(gbps):
    res = cli.invoke(app, ["select", str(REAL_RUN / "policy_table.parquet"), "--bandwidth", f"{gbps}Gbps",
                           "--q-min", "0.97"])
    assert res.exit_code == 0, res.output
    out = res.output
    assert "policy     none (uncompressed)  [none, method none]" in out
    # default volume: 1 GB (that file has no kv_bytes_per_request); time = 8 / Gbps seconds
    expected = 8.0 / gbps
    assert "default 1 GB" in out
    assert f"{gbps:.4g} Gbps lies in the interval (0.9919, inf] Gbps" in out
    assert "compression pays only below 0.9919 Gbps" in out
    assert out.count("dropped: B >= B*, slower than uncompressed") == 2
    sel = PolicyTable.load(REAL_RUN / "policy_table.parquet").select(gbps, 0.97)
    assert sel.predicted_seconds == pytest.approx(expected)
    from kvtune.core.units import format_seconds

    assert f"predicted  {format_seconds(expected)} for 1 GB of KV" in out


def test_cli_select_real_run_low_bandwidth_slo_and_json():
    # a run folder: volume = the profiled request (23.6 MB); below B* a compressed policy wins
    res = cli.invoke(app, ["select", str(REAL_RUN), "--bandwidth", "500Mbps", "--q-min", "0.97", "--slo", "200ms"])
    assert res.exit_code == 0, res.output
    assert "[5cb123e71e13, method tqc]" in res.output and "23.6 MB of KV" in res.output
    assert "B*         0.9919 Gbps" in res.output and "VIOLATED" in res.output  # 234 ms > 200 ms
    res = cli.invoke(app, ["select", str(REAL_RUN), "--bandwidth", "0.5Gbps", "--q-min", "0.97", "--slo", "1s",
                           "--kv-bytes", "24MB", "--json"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.output)
    assert doc["policy_id"] == "5cb123e71e13" and doc["kv_bytes"] == 24e6 and doc["kv_bytes_source"] == "--kv-bytes"
    assert doc["slo_violated"] is False and doc["candidates"][0]["status"] == "chosen"
    assert doc["predicted_s"] < doc["uncompressed_s"] == pytest.approx(24e6 * 8 / 0.5e9)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--bandwidth", "10", "--q-min", "0.97"], "bandwidth '10' has no unit"),
        (["--bandwidth", "10GB", "--q-min", "0.97"], "did you mean GB/s"),
        (["--bandwidth", "10Gbps", "--q-min", "0.97", "--slo", "fast"], "cannot parse duration 'fast'"),
        (["--bandwidth", "10Gbps", "--q-min", "0.97", "--kv-bytes", "24Mb"], "volumes are in bytes"),
        (["--bandwidth", "10Gbps", "--q-min", "0.97", "--workload", "qa"],
         "workload 'qa' does not match the table's workload 'continuation'"),
        (["--bandwidth", "10Gbps", "--q-min", "0.999"], "no accuracy floor >= q_min=0.999"),
        (["--bandwidth", "10Gbps", "--q-min", "0"], "--q-min must be a relative accuracy in (0, 1], e.g. 0.97; got 0"),
        (["--bandwidth", "10Gbps", "--q-min", "97"], "--q-min must be a relative accuracy in (0, 1], e.g. 0.97; got 97"),
        (["--bandwidth", "10Gbps", "--q-min", "nan"], "--q-min must be a relative accuracy in (0, 1], e.g. 0.97; got nan"),
    ],
)
def test_cli_select_errors(args, message):
    res = cli.invoke(app, ["select", str(REAL_RUN / "policy_table.parquet"), *args])
    assert res.exit_code == 2, res.output
    assert message in " ".join(res.output.split())  # rich may wrap long lines


def test_cli_select_json_with_malformed_config_json_is_a_one_line_error(tmp_path):
    doc = json.loads(PolicyTable.load(REAL_RUN / "policy_table.parquet").to_json(tmp_path / "good.json").read_text())
    for t in doc["tables"]:
        for iv in t["intervals"]:
            if iv["policy_id"] != "none":
                iv["config_json"] = "{not json"  # was a JSONDecodeError traceback from select --json
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(doc))
    res = cli.invoke(app, ["select", str(bad), "--bandwidth", "500Mbps", "--q-min", "0.97", "--json"])
    assert res.exit_code == 2, res.output
    out = " ".join(res.output.split())
    assert "error:" in out and "column config_json is not valid JSON" in out and "Traceback" not in out


def test_codec_speedup_what_if_equals_recompiling_a_faster_front():
    pareto = pareto_front(random_trials(5))
    base = compile_policy_table(pareto, model="m", workload="w", device="cpu")
    fast = base.with_codec_speedup(20.0)
    ref = compile_policy_table(
        pareto.assign(encode_gbps=pareto["encode_gbps"] * 20, decode_gbps=pareto["decode_gbps"] * 20),
        model="m", workload="w", device="cpu",
    )
    assert fast.device == "cpu x20 codec speed (hypothetical)" and fast.metadata["extra"]["codec_speedup"] == 20.0
    cols = ["accuracy_floor", "policy_id", "x_lo_s_per_gb", "x_hi_s_per_gb", "bandwidth_lo_gbps", "a_s_per_gb",
            "threshold_gbps", "encode_gbps"]
    pd.testing.assert_frame_equal(fast.frame[cols], ref.frame[cols], rtol=1e-12)
    for bw in (1.0, 5.0, 20.0, 50.0, 100.0, 400.0):
        for q in fast.floors:
            a, b = fast.select(bw, q), ref.select(bw, q)
            assert a.policy_id == b.policy_id and a.predicted_seconds == pytest.approx(b.predicted_seconds)
            slow = base.select(bw / 20, q)  # the same interval of the original table
            assert a.runners_up == slow.runners_up and a.policy_id == slow.policy_id
            assert [p.a_s_per_gb * 20 for p in a.alternatives] == pytest.approx([p.a_s_per_gb for p in slow.alternatives])
    with pytest.raises(KvtuneError):
        base.with_codec_speedup(0.0)


def test_keyed_compile_with_extra_columns_equals_per_key_tables_combined():
    """``key_column`` compiles each key's rows as one table (what ``key=`` does per key), and
    ``extra_columns`` ride along (empty for the implicit "none")."""
    front = pd.DataFrame({
        "policy_id": ["p1", "p2", "p3", "p4"], "label": ["a", "b", "c", "d"], "method": "tqc",
        "config_json": "{}", "compression_ratio": [4.0, 8.0, 3.0, 6.0],
        "relative_accuracy": [0.99, 0.95, 1.0, 0.97], "encode_gbps": [5.0, 2.0, 8.0, 1.5],
        "decode_gbps": [5.0, 2.0, 8.0, 1.5], "bucket": ["x", "x", "y", "y"], "bits": [4, 2, 5, 3],
    })
    keyed = compile_policy_table(front, model="m", workload="w", device="cpu", floors=(0.99, 0.95),
                                 key_column="bucket", extra_columns=("bits",))
    parts = [compile_policy_table(front[front["bucket"] == k], model="m", workload="w", device="cpu",
                                  floors=(0.99, 0.95), key=k) for k in ("x", "y")]
    combined = PolicyTable.combine(parts).frame
    assert keyed.keys == ("x", "y")
    pd.testing.assert_frame_equal(keyed.frame.drop(columns="bits"), combined)
    bits = dict(zip(keyed.frame["policy_id"], keyed.frame["bits"]))
    assert bits["none"] is None or math.isnan(bits["none"])
    want = {"p1": 4, "p2": 2, "p3": 5, "p4": 3}
    assert {p: v for p, v in bits.items() if p != "none"} == {p: want[p] for p in bits if p != "none"}
    assert len(bits) > 2  # some compressed policies reached the envelope
    with pytest.raises(TableError, match="either key or key_column"):
        compile_policy_table(front, model="m", workload="w", device="cpu", key="x", key_column="bucket")
    with pytest.raises(TableError, match=r"lacks column\(s\) \['nope'\]"):
        compile_policy_table(front, model="m", workload="w", device="cpu", extra_columns=("nope",))


def test_given_lines_admit_a_line_that_sends_nothing():
    """``given_lines``: the frame's own ``a``/``b`` (inf ratio for b = 0), not the codec line."""
    front = pd.DataFrame({
        "policy_id": ["r", "s"], "label": ["recompute", "send"], "method": "bicache", "config_json": "{}",
        "compression_ratio": [math.inf, 2.0], "relative_accuracy": [1.0, 1.0], "encode_gbps": math.inf,
        "decode_gbps": math.inf, "a_s_per_gb": [10.0, 2.0], "b": [0.0, 0.5], "threshold_gbps": math.inf,
    })
    table = compile_policy_table(front, model="m", workload="w", device="cpu", floors=(0.9,), include_none=False,
                                 given_lines=True)
    assert list(table.frame["policy_id"]) == ["s", "r"]
    assert table.frame["x_hi_s_per_gb"].iloc[0] == pytest.approx(16.0)  # 2 + 0.5 x = 10
    with pytest.raises(TableError, match="compression_ratio must be finite"):
        compile_policy_table(front, model="m", workload="w", device="cpu", include_none=False)
