"""Tests of kvtune.tables.controller: residual EWMA, epsilon-greedy, SLO screening, fallback,
violation decay, bandwidth estimation and per-chunk re-selection.

The hand table (same as in test_tables.py) at accuracy floor 0.90, x = 8 / Gbps in s/GB:

    none [0, 0.2)      above 40 Gbps        a = 0,   b = 1
    p1   [0.2, 0.4)    20 - 40 Gbps         a = 0.1, b = 0.5
    p2   [0.4, 1.6)    5 - 20 Gbps          a = 0.2, b = 0.25
    p3   [1.6, 6.4)    1.25 - 5 Gbps        a = 0.4, b = 0.125
    p4   [6.4, inf)    below 1.25 Gbps      a = 0.8, b = 0.0625

At 10 Gbps (x = 0.8): p2 0.4 s/GB; runners-up p3 0.5 and p1 0.5.
"""

from __future__ import annotations

import doctest
import json
import time

import pandas as pd
import pytest

import kvtune.tables.controller as controller_mod
import kvtune.core.units as units_mod
from kvtune.core.errors import KvtuneError, TableError
from kvtune.tables import compile_policy_table
from kvtune.tables.controller import Controller, ControllerConfig, Feedback

HAND = [
    ("p1", 0.999, 2.0, 20.0, 20.0),
    ("p2", 0.985, 4.0, 10.0, 10.0),
    ("p3", 0.960, 8.0, 5.0, 5.0),
    ("p4", 0.920, 16.0, 2.5, 2.5),
    ("p5", 0.995, 2.5, 4.0, 4.0),
]
GB = 1e9


@pytest.fixture(scope="module")
def table():
    df = pd.DataFrame(HAND, columns=["policy_id", "relative_accuracy", "compression_ratio", "encode_gbps", "decode_gbps"])
    df["label"] = "policy " + df["policy_id"]
    df["method"] = "tqc"
    df["config_json"] = [json.dumps({"name": p}) for p in df["policy_id"]]
    return compile_policy_table(df, model="m", workload="qa", device="cpu")


def true_time(policy, kv_bytes, bandwidth_gbps):
    """Noiseless simulated transfer: codec time from the profile + wire bytes / true bandwidth."""
    codec = policy.a_s_per_gb * kv_bytes / GB
    return codec + policy.b * kv_bytes * 8 / (bandwidth_gbps * 1e9), codec


def test_module_doctests():
    for mod in (controller_mod, units_mod):
        assert doctest.testmod(mod).failed == 0


# ------------------------------------------------------------------------------ residual EWMA


def test_residual_ewma_hand_values_paper_mode(table):
    ctl = Controller(table, q_min=0.9, epsilon=0.0, residual_alpha=0.5, estimate_bandwidth=False)
    d = ctl.decide(GB, bandwidth_gbps=10.0)
    assert d.policy_id == "p2" and d.predicted_s == pytest.approx(0.4) and d.corrected_s == pytest.approx(0.4)
    assert d.bandwidth_source == "given"
    # residual = measured - predicted (per GB); r <- r + 0.5 (sample - r), starting at 0
    obs = ctl.feedback(d, 0.6)
    assert obs.residual_s_per_gb == pytest.approx(0.2) and ctl.residual_s_per_gb("p2") == pytest.approx(0.1)
    ctl.feedback(ctl.decide(GB, bandwidth_gbps=10.0), 0.5)  # sample 0.1 -> r stays 0.1
    assert ctl.residual_s_per_gb("p2") == pytest.approx(0.1)
    # residuals are per GB: half a GB measured 0.1 s over its 0.2 s prediction -> sample 0.2 s/GB
    d = ctl.decide(0.5 * GB, bandwidth_gbps=10.0)
    assert d.predicted_s == pytest.approx(0.2) and d.corrected_s == pytest.approx(0.25)
    ctl.feedback(d, 0.3)  # sample (0.3 - 0.2) / 0.5 = 0.2 -> r = 0.15
    assert ctl.residual_s_per_gb("p2") == pytest.approx(0.15)
    # corrected p2 = 0.55 s > p3 and p1 (0.5 each, no residual yet): the controller moves away
    d = ctl.decide(GB, bandwidth_gbps=10.0)
    assert d.policy_id in {"p3", "p1"} and d.corrected_s == pytest.approx(0.5)
    by_id = {c.policy_id: c for c in d.candidates}
    assert by_id["p2"].predicted_s == pytest.approx(0.55) and by_id["p2"].status == "ok"
    ctl.feedback(d, 0.45)  # that runner-up is 0.05 s/GB faster than modeled: r = -0.025
    assert ctl.residual_s_per_gb(d.policy_id) == pytest.approx(-0.025)
    assert ctl.residual_s_per_gb("p4") == 0.0  # untouched policies have no residual


def test_residual_in_estimation_mode_learns_codec_error_only(table):
    ctl = Controller(table, q_min=0.9, epsilon=0.0, residual_alpha=0.5, bandwidth_alpha=1.0,
                     initial_bandwidth_gbps=10.0)
    d = ctl.decide(GB)
    assert d.policy_id == "p2" and d.bandwidth_source == "estimate"
    # codec took 0.3 s instead of 0.2 s; the wire ran at 8 Gbps (0.25 GB in 0.25 s)
    obs = ctl.feedback(d, 0.3 + 0.25, codec_s=0.3)
    assert obs.residual_s_per_gb == pytest.approx(0.1) and ctl.residual_s_per_gb("p2") == pytest.approx(0.05)
    assert obs.bandwidth_gbps_sample == pytest.approx(8.0) and ctl.bandwidth_gbps == pytest.approx(8.0)
    # without codec_s the residual is left alone and the whole deviation goes to the link:
    # predicted codec (0.2 + 0.05) V, so wire = 0.55 - 0.25 = 0.3 s for 0.25 GB -> 6.67 Gbps
    d = ctl.decide(GB)
    obs = ctl.feedback(d, 0.55)
    assert obs.residual_s_per_gb is None and ctl.residual_s_per_gb("p2") == pytest.approx(0.05)
    assert ctl.bandwidth_gbps == pytest.approx(0.25 * 8 / 0.3)


# ------------------------------------------------------------------------------ exploration


def test_epsilon_greedy_rate_and_uniform_alternatives(table):
    n = 5000
    ctl = Controller(table, q_min=0.9, epsilon=0.2, seed=7, estimate_bandwidth=False)
    picks = [ctl.decide(GB, bandwidth_gbps=10.0) for _ in range(n)]
    explored = [d for d in picks if d.explored]
    assert abs(len(explored) / n - 0.2) < 0.02  # binomial sd 0.0057
    assert all(d.policy_id == "p2" for d in picks if not d.explored)
    alt = pd.Series([d.policy_id for d in explored]).value_counts(normalize=True)
    assert set(alt.index) == {"p1", "p3"} and (alt - 0.5).abs().max() < 0.05
    # seeded: same sequence again; epsilon 0: greedy
    again = Controller(table, q_min=0.9, epsilon=0.2, seed=7, estimate_bandwidth=False)
    assert [again.decide(GB, bandwidth_gbps=10.0).policy_id for _ in range(200)] == [d.policy_id for d in picks[:200]]
    greedy = Controller(table, q_min=0.9, epsilon=0.0, estimate_bandwidth=False)
    assert {greedy.decide(GB, bandwidth_gbps=10.0).policy_id for _ in range(200)} == {"p2"}


def test_exploration_never_picks_no_gain_or_over_slo(table):
    # 100 Gbps: "none" optimal; runners-up p1, p5 have B* < 100 -> no_gain: nothing to explore
    ctl = Controller(table, q_min=0.99, epsilon=1.0, estimate_bandwidth=False)
    ds = [ctl.decide(GB, bandwidth_gbps=100.0) for _ in range(50)]
    assert {d.policy_id for d in ds} == {"none"} and not any(d.explored for d in ds)
    assert [c.status for c in ds[0].candidates] == ["chosen", "no_gain", "no_gain"]
    # 10 Gbps with an SLO only p2 meets (0.4 s < 0.45 s < 0.5 s): no exploration either
    ctl = Controller(table, q_min=0.9, epsilon=1.0, slo_s=0.45, estimate_bandwidth=False)
    ds = [ctl.decide(GB, bandwidth_gbps=10.0) for _ in range(50)]
    assert {d.policy_id for d in ds} == {"p2"} and not any(d.explored for d in ds)


# ------------------------------------------------------------------------------ SLO screening


def test_slo_filtering_uses_corrected_times(table):
    ctl = Controller(table, q_min=0.9, epsilon=0.0, slo_s=0.45, residual_alpha=1.0, estimate_bandwidth=False)
    d = ctl.decide(GB, bandwidth_gbps=10.0)
    assert d.policy_id == "p2" and not d.predicted_violation
    assert [c.status for c in d.candidates] == ["chosen", "over_slo", "over_slo"]
    ctl.feedback(d, 0.6)  # p2 is 0.2 s/GB slower than modeled -> corrected 0.6 > SLO
    # SLO 0.55: p2 (0.6) now over, the runners-up (0.5) within -> the faster runner-up
    d = ctl.decide(GB, bandwidth_gbps=10.0, slo_s=0.55)
    assert d.policy_id in {"p3", "p1"} and not d.predicted_violation
    assert {c.policy_id: c.status for c in d.candidates}["p2"] == "over_slo"
    # nobody within 0.3 s: the fastest corrected one, flagged
    d = ctl.decide(GB, bandwidth_gbps=10.0, slo_s=0.3)
    assert d.predicted_violation and d.corrected_s == pytest.approx(0.5)


# ------------------------------------------------------------------------------ fallback and decay


def test_fallback_after_k_violations_and_recovery_after_cooldown(table):
    ctl = Controller(table, q_min=0.9, epsilon=0.0, slo_s=0.45, violation_limit=3, violation_decay=0.5,
                     cooldown_decisions=4, fallback_bandwidth_factor=0.25, estimate_bandwidth=False)
    for k in range(3):
        d = ctl.decide(GB, bandwidth_gbps=10.0)
        assert d.policy_id == "p2" and not d.fallback and not d.predicted_violation  # 0.4 s predicted
        obs = ctl.feedback(d, 0.5)  # measured over the 0.45 s SLO: unexpected
        assert obs.violated and obs.counted and obs.entered_fallback == (k == 2)
    assert ctl.in_fallback and ctl.cooldown_left == 4 and ctl.violations == 0.0 and ctl.fallbacks_entered == 1
    # cool-down: the envelope policy at 0.25 x 10 = 2.5 Gbps (p3: smaller slope, safer when the
    # link is slower than believed), no exploration
    fallback = [ctl.decide(GB, bandwidth_gbps=10.0) for _ in range(4)]
    assert all(d.fallback and d.policy_id == "p3" and d.bandwidth_gbps == 2.5 for d in fallback)
    assert [c.policy_id for c in fallback[0].candidates] == ["p3"]
    obs = ctl.feedback(fallback[0], 5.0)  # violations during the cool-down are not counted
    assert obs.violated and not obs.counted and ctl.violations == 0.0
    # recovered
    d = ctl.decide(GB, bandwidth_gbps=10.0)
    assert not d.fallback and d.policy_id == "p2" and not ctl.in_fallback
    # above B* even at the pessimistic bandwidth the fallback is "none"
    ctl2 = Controller(table, q_min=0.9, epsilon=0.0, slo_s=0.05, violation_limit=1, cooldown_decisions=1,
                      fallback_bandwidth_factor=0.5, estimate_bandwidth=False)
    ctl2.feedback(ctl2.decide(GB, bandwidth_gbps=200.0), 1.0)  # "none" predicted 0.04 s, took 1 s
    d = ctl2.decide(GB, bandwidth_gbps=200.0)
    assert d.fallback and d.policy_id == "none"


def test_predicted_violations_do_not_trigger_the_fallback(table):
    # SLO 0.3 s: even p2 (0.4 s) is predicted over it; measured violations were expected
    ctl = Controller(table, q_min=0.9, epsilon=0.0, slo_s=0.3, violation_limit=2, estimate_bandwidth=False)
    for _ in range(10):
        d = ctl.decide(GB, bandwidth_gbps=10.0)
        assert d.predicted_violation
        obs = ctl.feedback(d, 0.5)
        assert obs.violated and not obs.counted
    assert ctl.fallbacks_entered == 0 and ctl.violations == 0.0


def test_violation_count_decays(table):
    ctl = Controller(table, q_min=0.9, epsilon=0.0, slo_s=0.45, violation_limit=3, violation_decay=0.5,
                     estimate_bandwidth=False)
    expected = 0.0
    for measured in [0.5, 0.4, 0.5, 0.4, 0.5, 0.4, 0.5, 0.4, 0.5]:  # violate, meet, ...
        ctl.feedback(ctl.decide(GB, bandwidth_gbps=10.0), measured)
        expected = expected + 1 if measured > 0.45 else expected * 0.5
        assert ctl.violations == pytest.approx(expected)
    assert ctl.violations < 2.0 and not ctl.in_fallback and ctl.fallbacks_entered == 0
    # without decay the same sequence triggers the fallback at the third violation
    sticky = Controller(table, q_min=0.9, epsilon=0.0, slo_s=0.45, violation_limit=3, violation_decay=1.0,
                        estimate_bandwidth=False)
    for measured in [0.5, 0.4, 0.5, 0.4, 0.5]:
        sticky.feedback(sticky.decide(GB, bandwidth_gbps=10.0), measured)
    assert sticky.fallbacks_entered == 1


# ------------------------------------------------------------------------------ bandwidth estimation


@pytest.mark.parametrize("with_codec_time", [True, False])
def test_bandwidth_estimate_converges_on_noiseless_feed(table, with_codec_time):
    true_bw = 3.0
    ctl = Controller(table, q_min=0.9, epsilon=0.1, seed=1, initial_bandwidth_gbps=50.0, bandwidth_alpha=0.3)
    history = []
    for _ in range(60):
        d = ctl.decide(0.2 * GB)
        measured, codec = true_time(d.policy, d.kv_bytes, true_bw)
        obs = ctl.feedback(d, measured, codec_s=codec if with_codec_time else None)
        assert obs.bandwidth_gbps_sample == pytest.approx(true_bw, rel=1e-9)  # every sample exact
        history.append(ctl.bandwidth_gbps)
    # EWMA of x: error shrinks by (1 - 0.3) per feedback
    assert abs(history[-1] - true_bw) / true_bw < 1e-8
    x_err = [abs(8 / h - 8 / true_bw) for h in history[:10]]
    assert all(b == pytest.approx(0.7 * a, rel=1e-6) for a, b in zip(x_err, x_err[1:]))
    # and the choice follows: 3 Gbps is in p3's interval
    assert ctl.decide(0.2 * GB).policy_id in {"p3", "p2", "p4"}
    assert Controller(table, q_min=0.9, epsilon=0.0, initial_bandwidth_gbps=3.0).decide(GB).policy_id == "p3"


def test_decide_needs_a_bandwidth(table):
    with pytest.raises(KvtuneError, match="no bandwidth"):
        Controller(table, q_min=0.9).decide(GB)
    with pytest.raises(KvtuneError, match="no bandwidth"):
        Controller(table, q_min=0.9, estimate_bandwidth=False, initial_bandwidth_gbps=10.0).decide(GB)
    # the first feedback alone seeds the estimate
    ctl = Controller(table, q_min=0.9, epsilon=0.0)
    d = ctl.decide(GB, bandwidth_gbps=10.0)
    ctl.feedback(d, *true_time(d.policy, GB, 4.0)[:1])
    assert ctl.bandwidth_gbps == pytest.approx(4.0)


# ------------------------------------------------------------------------------ chunks


def test_chunk_reselection_switches_policy_when_bandwidth_crosses_breakpoints(table):
    # 2 GB in 0.25 GB chunks; the link is 30 Gbps (p1's interval) for the first 2 chunks,
    # then 3 Gbps (p3's interval). With bandwidth_alpha = 1 the estimate follows the last chunk.
    ctl = Controller(table, q_min=0.9, epsilon=0.0, bandwidth_alpha=1.0, initial_bandwidth_gbps=30.0)
    plan = ctl.plan_chunks(2 * GB, 0.25 * GB)
    seen, d, k = [], plan.next_chunk(), 0
    while d is not None:
        bw = 30.0 if k < 2 else 3.0
        seen.append((d.policy_id, round(d.bandwidth_gbps, 6)))
        measured, codec = true_time(d.policy, d.kv_bytes, bw)
        d = plan.next_chunk(Feedback(measured, codec_s=codec))
        k += 1
    assert seen == [("p1", 30.0), ("p1", 30.0), ("p1", 30.0)] + [("p3", 3.0)] * 5
    assert plan.done and plan.switches == 1 and len(plan.decisions) == 8
    assert sum(x.kv_bytes for x in plan.decisions) == pytest.approx(2 * GB)
    # back up above 40 Gbps: re-selects "none" on the next chunk
    plan = ctl.plan_chunks(0.5 * GB, 0.25 * GB)
    d = plan.next_chunk()
    assert d.policy_id == "p3"
    d = plan.next_chunk(true_time(d.policy, d.kv_bytes, 100.0)[0])  # a plain float is a Feedback too
    assert d.policy_id == "none"
    assert plan.next_chunk(true_time(d.policy, d.kv_bytes, 100.0)[0]) is None and plan.done


def test_chunk_slo_budget_is_shared(table):
    ctl = Controller(table, q_min=0.9, epsilon=0.0, initial_bandwidth_gbps=10.0)
    plan = ctl.plan_chunks(1.0 * GB, 0.25 * GB, slo_s=0.8)
    d = plan.next_chunk()
    assert d.slo_s == pytest.approx(0.2)  # 0.8 s x 0.25 / 1.0
    d = plan.next_chunk(0.35)  # slow chunk: 0.45 s left for 0.75 GB
    assert d.slo_s == pytest.approx(0.45 / 3)
    with pytest.raises(KvtuneError, match="feedback for the previous chunk"):
        plan.next_chunk()
    d = plan.next_chunk(0.5)  # budget exhausted: tiny SLO, every candidate over, fastest taken
    assert d.slo_s < 1e-9 and d.predicted_violation
    with pytest.raises(KvtuneError, match="no chunk is pending"):
        ctl.plan_chunks(GB, GB).next_chunk(0.1)


# ------------------------------------------------------------------------------ settings, overhead


def test_config_validation_and_table_context(table):
    for bad in ({"epsilon": 1.5}, {"residual_alpha": 0.0}, {"violation_decay": 0.0}, {"fallback_bandwidth_factor": 2.0},
                {"cooldown_decisions": -1}, {"slo_s": 0.0}):
        with pytest.raises(KvtuneError):
            Controller(table, **bad)
    with pytest.raises(KvtuneError, match="unknown setting"):
        Controller(table, q_minimum=0.9)
    with pytest.raises(TableError, match="workload 'math' does not match"):
        Controller(table, q_min=0.9, workload="math")
    with pytest.raises(TableError, match="no accuracy floor"):
        Controller(table, q_min=0.999)
    cfg = ControllerConfig(q_min=0.95, epsilon=0.0)
    assert Controller(table, cfg, slo_s=0.1).config == ControllerConfig(q_min=0.95, epsilon=0.0, slo_s=0.1)


def test_decision_overhead_is_far_below_a_millisecond(table):
    ctl = Controller(table, q_min=0.9, epsilon=0.05, slo_s=1.0, initial_bandwidth_gbps=10.0)
    n = 2000
    t0 = time.perf_counter()
    for _ in range(n):
        d = ctl.decide(GB)
        ctl.feedback(d, d.predicted_s, codec_s=d.codec_s)
    per = (time.perf_counter() - t0) / n
    assert per < 1e-3  # published KVServe overhead < 1 ms; typically ~30-60 us here
