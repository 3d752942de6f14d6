"""The search engine: kvserve's acquisition and pruning, mobo, the Optuna samplers, resume,
the replay objective and the benchmark, on small synthetic problems with known answers."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pandas as pd
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtune.core.errors import ConfigError, KvtuneError
from kvtune.search.optimizers import OPTIMIZERS, make_optimizer
from kvtune.search.optimizers.gp import candidate_inputs, fit_gp
from kvtune.search.optimizers.kvserve import KVServeOptimizer, kvserve_acquisition, warp_accuracy
from kvtune.search.optimizers.replay import HypervolumeSpec, ReplayObjective, best_feasible_ratio
from kvtune.search.optimizers.synthetic import synthetic_problem
from kvtune.search.pareto import hypervolume
from kvtune.search.space import Candidate, Parameter, SearchSpace

# Fast settings for the model-based optimizers (small initial designs, few GP iterations).
FAST = {
    "kvserve": {"n_init": 4, "maxiter": 50},
    "mobo": {"n_init": 4, "maxiter": 50, "mc_samples": 16, "prescreen": 32},
    "optuna-tpe": {"n_startup_trials": 4},
    "optuna-nsga2": {"population_size": 4},
    "optuna-gp": {"n_startup_trials": 3},
}


@pytest.fixture(scope="module")
def small():
    space, table = synthetic_problem("small")
    replay = ReplayObjective(table)
    return space, replay, replay.ratios(space)


def _drive(opt, replay, n, *, start=0):
    """Ask/evaluate/tell ``n`` times as the profile loop does; returns the asked indices."""
    asked = []
    for k in range(start, start + n):
        c = opt.ask()
        if c is None:
            break
        result = replay.evaluate(c)
        result["trial"] = k
        opt.tell(c, result)
        asked.append(c.index)
    return asked


# ---------------------------------------------------------------- kvserve acquisition


def test_kvserve_acquisition_hand_computed():
    # alpha = CR / max CR * Phi((mu - q) / sd) + lambda * (sd - min sd) / (max sd - min sd)
    mean = np.array([0.98, 0.96, 0.99])
    std = np.array([0.01, 0.02, 0.005])
    ratios = np.array([4.0, 6.0, 3.0])
    alpha = kvserve_acquisition(mean, std, ratios, 0.97, 0.2)
    phi_1, phi_m05, phi_4 = 0.8413447460685429, 0.3085375387259869, 0.9999683287581669
    expected = [4 / 6 * phi_1 + 0.2 * (0.005 / 0.015), 1.0 * phi_m05 + 0.2 * 1.0, 0.5 * phi_4 + 0.0]
    np.testing.assert_allclose(alpha, expected, rtol=0, atol=1e-12)
    assert expected == pytest.approx([0.6275631641, 0.5085375387, 0.4999841644], abs=1e-9)


def test_kvserve_acquisition_degenerate_std():
    # zero std: P is a step at the threshold; equal stds give sigma_norm = 0
    alpha = kvserve_acquisition(np.array([0.98, 0.96]), np.zeros(2), np.array([2.0, 4.0]), 0.97, 1.0)
    np.testing.assert_allclose(alpha, [0.5, 0.0])


# ---------------------------------------------------------------- kvserve pruning


@st.composite
def small_spaces(draw):
    """Random small spaces: a categorical, 1-3 numeric parameters with random precision
    directions, optionally one conditional numeric; plus ratios and told results."""
    params = [Parameter("transforms", "categorical", tuple(["identity", "hadamard"][: draw(st.integers(1, 2))]))]
    for k in range(draw(st.integers(1, 3))):
        n_values = draw(st.integers(1, 3))
        params.append(Parameter(f"p{k}", "ordinal", tuple(range(1, n_values + 1)),
                                precision=draw(st.sampled_from(["increasing", "decreasing", "none"]))))
    if draw(st.booleans()):
        params.append(Parameter("cond", "ordinal", (1, 2), precision=draw(st.sampled_from(["increasing", "none"])),
                                when=(("transforms", ("hadamard",)),)))
    cands, seen = [], set()
    for combo in itertools.product(*(p.values for p in params)):
        full = {p.key: v for p, v in zip(params, combo)}
        active = {p.key: full[p.key] for p in params if p.active(full)}
        key = tuple(sorted(active.items()))
        if key not in seen:
            seen.add(key)
            cands.append(Candidate(index=len(cands), params=active, config=None))
    space = SearchSpace(name="h", path=None, description="", parameters=params, fixed={}, candidates=cands)
    n = len(cands)
    ratios = np.array(draw(st.lists(st.sampled_from([1.5, 2.0, 3.0, 4.0, 6.0]), min_size=n, max_size=n)))
    told = draw(st.lists(st.integers(0, n - 1), unique=True, max_size=n))
    results = {}
    for i in told:
        acc = draw(st.sampled_from([0.5, 0.9, 0.965, 0.97, 0.975, 0.99, 1.0]))
        res = {"relative_accuracy": acc, "compression_ratio": float(ratios[i])}
        if draw(st.booleans()):
            res["relative_accuracy_lo"] = acc - draw(st.sampled_from([0.0, 0.004, 0.01]))
        results[i] = res
    return space, ratios, results


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(small_spaces())
def test_pruning_never_removes_what_it_should_not(problem):
    space, ratios, results = problem
    q = 0.97
    opt = KVServeOptimizer(space, seed=0, q_min=q, ratios=ratios)
    for i, res in results.items():
        opt.tell(space.candidates[i], res)
    score = {i: r.get("relative_accuracy_lo", r["relative_accuracy"]) for i, r in results.items()}
    feasible = [i for i, s in score.items() if s >= q]
    infeasible = [i for i, s in score.items() if s < q and results[i]["relative_accuracy"] < q]
    r_star = max((ratios[i] for i in feasible), default=-math.inf)

    def allowed(a: int) -> bool:
        by_ratio = ratios[a] <= r_star
        by_precision = any(space.at_most_as_precise(space.candidates[a], space.candidates[b]) for b in infeasible)
        return by_ratio or by_precision

    pruned = opt.pruned
    assert not set(pruned) & set(results), "a told candidate is reported pruned"
    for a in pruned:
        assert allowed(a), f"#{a} {space.candidates[a].params} pruned ({pruned[a]}) without a rule allowing it"
    # and the rules are applied completely: everything they allow is pruned
    untold = [c.index for c in space.candidates if c.index not in results]
    assert {a for a in untold if allowed(a)} == set(pruned)
    assert set(opt.active()) == set(untold) - set(pruned)


def test_pruning_rules_on_a_known_case():
    params = [Parameter("bits", "ordinal", (2, 4, 8), precision="increasing"),
              Parameter("group", "ordinal", (32, 128), precision="decreasing")]
    cands = [Candidate(i, {"bits": b, "group": g}, None) for i, (b, g) in enumerate(itertools.product((2, 4, 8), (32, 128)))]
    space = SearchSpace(name="k", path=None, description="", parameters=params, fixed={}, candidates=cands)
    # index: 0 (2,32) 1 (2,128) 2 (4,32) 3 (4,128) 4 (8,32) 5 (8,128)
    ratios = np.array([6.0, 7.0, 3.5, 3.8, 1.9, 2.0])
    opt = KVServeOptimizer(space, seed=0, q_min=0.97, ratios=ratios)
    # (4, 32) infeasible: prunes every candidate at most as precise: (2,32), (2,128), (4,128)
    opt.tell(cands[2], {"relative_accuracy": 0.95, "relative_accuracy_lo": 0.94})
    assert set(opt.pruned) == {0, 1, 3}
    # (8, 128) feasible at ratio 2.0: prunes (8, 32) at ratio 1.9 -> nothing left
    opt.tell(cands[5], {"relative_accuracy": 0.99, "relative_accuracy_lo": 0.985})
    assert set(opt.pruned) == {0, 1, 3, 4}
    assert opt.ask() is None and "pruned" in opt.stop_reason
    # lo below the floor but the point estimate above it: infeasible, yet prunes nothing
    opt2 = KVServeOptimizer(space, seed=0, q_min=0.97, ratios=ratios)
    opt2.tell(cands[4], {"relative_accuracy": 0.975, "relative_accuracy_lo": 0.96})
    assert opt2.pruned == {} and opt2.best_feasible_ratio == -math.inf


# ---------------------------------------------------------------- every optimizer


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_budget_and_no_repeats_with_real_results(name, small):
    space, replay, ratios = small
    opt = make_optimizer(name, space, seed=1, ratios=ratios, **FAST.get(name, {}))
    budget = 7
    asked = _drive(opt, replay, budget)
    assert len(asked) <= budget and len(set(asked)) == len(asked)
    assert set(asked) == set(opt.told)


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_resume_continues_like_an_uninterrupted_run(name, small):
    space, replay, ratios = small
    n, k = 7, 4
    full = make_optimizer(name, space, seed=4, ratios=ratios, **FAST.get(name, {}))
    order = _drive(full, replay, n)
    assert len(order) == n
    # a resumed run: the first k stored trials replayed in enumeration order (as run_profile does)
    resumed = make_optimizer(name, space, seed=4, ratios=ratios, **FAST.get(name, {}))
    for i in sorted(order[:k]):
        result = replay.evaluate(space.candidates[i])
        result["trial"] = order.index(i)
        resumed.tell(space.candidates[i], result)
    assert _drive(resumed, replay, n - k, start=k) == order[k:]


def test_make_optimizer_rejects_unknown_options(small):
    space, _, _ = small
    with pytest.raises(ConfigError, match="n_init"):
        make_optimizer("kvserve", space, warmup=3)
    assert make_optimizer("mobo", space, n_init=3).n_init == 3


# ---------------------------------------------------------------- known answers


def test_kvserve_finds_the_best_feasible_ratio(small):
    space, replay, ratios = small
    q = 0.97
    best = replay.best_feasible_ratio(q)
    for seed in (0, 1):
        opt = make_optimizer("kvserve", space, seed=seed, q_min=q, ratios=ratios, maxiter=50)
        _drive(opt, replay, 25)  # 17 % of the 144 candidates
        found = best_feasible_ratio(pd.DataFrame([opt.told[i] for i in opt.told]), q)
        assert found == pytest.approx(best, rel=1e-12), f"seed {seed}: {found} vs exhaustive {best}"
        assert opt.best_feasible_ratio == pytest.approx(best, rel=1e-12)


def test_mobo_hypervolume_beats_random(small):
    space, replay, ratios = small
    hv = {"mobo": [], "random": []}
    for seed in (0, 1):
        for name in hv:
            opt = make_optimizer(name, space, seed=seed, ratios=ratios, **FAST.get(name, {}))
            _drive(opt, replay, 10)
            hv[name].append(replay.hypervolume([opt.told[i] for i in opt.told]) / replay.exhaustive_hypervolume())
    assert np.mean(hv["mobo"]) > np.mean(hv["random"]) + 0.05, hv


def test_mobo_accuracy_axis_maps_the_warped_model_output(small):
    """The GP models z = -log(1.01 - accuracy); the hypervolume's accuracy axis is accuracy itself
    (``linear``) or z (``warped``, the default); a bad axis or reference accuracy is refused."""
    space, _, ratios = small
    z = warp_accuracy(np.array([0.99, 0.5]))
    out = np.column_stack([z, np.log([0.2, 0.4])])  # (warped accuracy, log latency)
    x = candidate_inputs(space, ratios)[:2]
    linear = make_optimizer("mobo", space, ratios=ratios, accuracy_axis="linear")._objectives(out, x)
    warped = make_optimizer("mobo", space, ratios=ratios)._objectives(out, x)  # the default
    np.testing.assert_allclose(linear[:, 0], [0.99, 0.5], rtol=1e-12)
    np.testing.assert_allclose(warped[:, 0], [-math.log(0.02), -math.log(0.51)], rtol=1e-12)
    np.testing.assert_allclose(warped[:, 1:], linear[:, 1:])  # ratio from the inputs, -latency
    np.testing.assert_allclose(linear[:, 1], ratios[:2], rtol=1e-9)
    np.testing.assert_allclose(linear[:, 2], [-0.2, -0.4], rtol=1e-12)
    with pytest.raises(ValueError, match="accuracy_axis"):
        make_optimizer("mobo", space, accuracy_axis="log")
    for bad in (float("nan"), float("inf"), 1.01, 2.0):  # z(2.0) would be NaN: a degenerate reference point
        with pytest.raises(ValueError, match="acc_ref"):
            make_optimizer("mobo", space, acc_ref=bad)
    assert make_optimizer("mobo", space, acc_ref=2.0, accuracy_axis="linear").acc_ref == 2.0  # pure exploration


# ---------------------------------------------------------------- optuna seam


def test_optuna_maps_repeats_to_the_nearest_untold_candidate(small):
    space, replay, ratios = small
    opt = make_optimizer("optuna-tpe", space, seed=0)
    # every candidate round-trips through its Optuna encoding (conditional codec.model included)
    assert all(opt._resolve(opt._encode(c)) == c.index for c in space.candidates)
    target = space.candidates[10]
    opt.tell(target, replay.evaluate(target))
    again = opt._resolve(opt._encode(target))
    feats = space.features()
    dist = ((feats - feats[10]) ** 2).sum(1)
    dist[10] = np.inf
    assert again == int(np.argmin(dist)) and again != 10
    # an inactive parameter's value does not matter: bitpack with either codec.model is bitpack
    bitpack = next(c for c in space.candidates if c.params["codec"] == "bitpack")
    enc = opt._encode(bitpack)
    enc["codec.model"] = "per_head"
    assert opt._resolve(enc) == bitpack.index


# ---------------------------------------------------------------- GP, replay, benchmark


def test_gp_posterior_matches_botorch():
    import torch

    rng = np.random.default_rng(0)
    x = rng.random((25, 3))
    y = np.column_stack([np.sin(4 * x[:, 0]) + x[:, 1], x.sum(1)])
    gp = fit_gp(x, y, maxiter=50)
    xq = rng.random((7, 3))
    mean, std = gp.predict(xq)
    with torch.no_grad():
        post = gp.to_botorch().posterior(torch.as_tensor(xq))
    np.testing.assert_allclose(mean, post.mean.numpy(), atol=1e-8)
    np.testing.assert_allclose(std, post.variance.sqrt().numpy(), atol=1e-8)
    assert np.all(gp.loo_scale() >= 1.0)


def test_replay_objective(tmp_path, small):
    space, replay, ratios = small
    path = tmp_path / "t.parquet"
    replay.table.to_parquet(path)
    loaded = ReplayObjective.from_parquet(path)
    c = space.candidates[3]
    assert loaded.evaluate(c)["compression_ratio"] == pytest.approx(ratios[3])
    stranger = Candidate(index=0, params={}, config=type("P", (), {"policy_id": "feedbeef"})())
    with pytest.raises(KvtuneError, match="feedbeef.*not in replay table"):
        loaded.evaluate(stranger)
    with pytest.raises(KvtuneError, match="not found"):
        ReplayObjective.from_parquet(tmp_path / "missing.parquet")
    with pytest.raises(KvtuneError, match="lacks column"):
        ReplayObjective(replay.table.drop(columns=["encode_gbps"]))


def test_replay_hypervolume_and_best_ratio_closed_form():
    # two policies: latencies 1/1 + 1/1 = 2 s/GB and 1/2 + 1/2 = 1 s/GB; worst = 2
    table = pd.DataFrame({"policy_id": ["a", "b"], "relative_accuracy": [0.9, 0.7],
                          "relative_accuracy_lo": [0.88, 0.69], "compression_ratio": [3.0, 5.0],
                          "encode_gbps": [1.0, 2.0], "decode_gbps": [1.0, 2.0]})
    replay = ReplayObjective(table)
    assert replay.hv_spec == HypervolumeSpec(latency_scale=2.0)
    # normalized: a = (0.9, 3, 1.0), b = (0.7, 5, 0.5); ref (0.5, 1, 1.1)
    box_a = 0.4 * 2 * 0.1
    box_b = 0.2 * 4 * 0.6
    overlap = 0.2 * 2 * 0.1
    assert replay.exhaustive_hypervolume() == pytest.approx(box_a + box_b - overlap, rel=1e-12)
    assert replay.exhaustive_hypervolume() == pytest.approx(
        hypervolume(np.array([[0.9, 3, 1.0], [0.7, 5, 0.5]]), [0.5, 1, 1.1], [True, True, False]))
    assert replay.best_feasible_ratio(0.85) == 3.0
    assert replay.best_feasible_ratio(0.89) != replay.best_feasible_ratio(0.89, use_lo=False)
    assert math.isnan(replay.best_feasible_ratio(0.95))


def test_benchmark_exhaustive_is_the_known_answer(small):
    from kvtune.search.optimizers.bench import run_search_benchmark, summarize

    space, replay, _ = small
    results, runs = run_search_benchmark(space, replay, optimizers=["exhaustive", "random"], seeds=1,
                                         budgets=(0.1, 1.0), q_mins=(0.97,))
    full = results[(results.optimizer == "exhaustive") & (results.budget == 1.0)].iloc[0]
    assert full["evals"] == len(space) and full["hv_ratio"] == pytest.approx(1.0) and full["hit_q0.97"] == 1.0
    part = results[(results.optimizer == "random") & (results.budget == 0.1)].iloc[0]
    assert part["evals"] == math.ceil(0.1 * len(space)) and 0 < part["hv_ratio"] < 1
    assert set(summarize(results).optimizer) == {"exhaustive", "random"}
