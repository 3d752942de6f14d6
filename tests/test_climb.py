"""Floor climbing (kvtune.search.climb) and the space's vectorized precision order, on the
synthetic problem whose exhaustive table gives the answers."""

from __future__ import annotations

import doctest

import numpy as np
import pytest

from kvtune.search import climb as climb_mod
from kvtune.search.climb import best_full_ratio, climb_pick, family_posteriors, missed, predicted_scores
from kvtune.search.optimizers.kvserve import feasibility_score
from kvtune.search.optimizers.synthetic import synthetic_problem
from kvtune.search.space import load_space


@pytest.fixture(scope="module")
def small():
    space, table = synthetic_problem("small")
    return space, table.to_dict("records"), table["compression_ratio"].to_numpy()


def full_order(space) -> np.ndarray:
    """``space.precision_groups()`` as one ``(n, n)`` bool matrix."""
    n = len(space.candidates)
    out = np.zeros((n, n), dtype=bool)
    for ix, block in space.precision_groups():
        out[np.ix_(ix, ix)] = block
    return out


def test_module_doctests():
    assert doctest.testmod(climb_mod).failed == 0


@pytest.mark.parametrize("name", ["default", "synthetic"])
def test_precision_groups_are_at_most_as_precise_for_every_pair(name):
    space = load_space("default") if name == "default" else synthetic_problem("small")[0]
    order = full_order(space)
    c = space.candidates
    expected = np.array([[space.at_most_as_precise(a, b) for b in c] for a in c])
    assert order.shape == (len(c), len(c)) and (order == expected).all()
    assert order.sum() > 2 * len(c)  # not only the diagonal


def _family(space, transforms="hadamard", model="per_channel"):
    return [i for i, c in enumerate(space.candidates)
            if c.params["transforms"] == transforms and c.params.get("codec.model") == model]


def test_climbing_from_the_corners_of_a_family_reaches_each_floors_best_policy(small):
    """Start like a refinement that missed: a family's extreme policies at full fidelity (2 and
    8 bits: every one at or below 95.1 % or at most 1.93x). The exhaustive table's best ratios
    clearing 99 % and 97 % in that family are 3.26x and 3.68x; four picks reach both, each pick
    stays out of the pruned set, and then nothing is worth another evaluation."""
    space, rows, ratios = small
    fam = _family(space)
    corner = [i for i in fam if space.candidates[i].params["key.bits"] in (2, 8)
              and space.candidates[i].params["value.bits"] in (2, 8)]
    full = {i: rows[i] for i in corner}
    best = {q: max(rows[i]["compression_ratio"] for i in fam if rows[i]["relative_accuracy_lo"] >= q) for q in (0.99, 0.97)}
    assert best[0.99] == pytest.approx(3.26, abs=0.005) and best[0.97] == pytest.approx(3.68, abs=0.005)
    assert best_full_ratio(full, 0.99) == best_full_ratio(full, 0.97) == pytest.approx(1.93, abs=0.005)
    order = full_order(space)
    picks = []
    while (pick := climb_pick(space, ratios, full, (0.99, 0.97))) is not None:
        assert pick.index in fam and pick.index not in full
        assert not order[pick.index, missed(full, {}, pick.floor)].any()
        assert pick.best_ratio == best_full_ratio(full, pick.floor) and pick.gain >= climb_mod.MIN_GAIN
        full[pick.index] = rows[pick.index]
        picks.append(pick)
        assert len(picks) <= 8
    assert len(picks) == 4
    assert best_full_ratio(full, 0.99) == pytest.approx(best[0.99]) and best_full_ratio(full, 0.97) == pytest.approx(best[0.97])


def _start(space, rows, key_bits):
    """Full-fidelity results of the hadamard / per-channel family at ``key_bits`` and 2 or 8
    value bits."""
    return {i: rows[i] for i in _family(space) if space.candidates[i].params["key.bits"] in key_bits
            and space.candidates[i].params["value.bits"] in (2, 8)}


def test_predicted_means_never_fall_with_precision(small):
    """The family GP alone predicts a lower score for a more precise policy on 17 pairs of the
    4- and 8-bit start (4 of the corner start); the monotone mean on none."""
    space, rows, _ = small
    order = full_order(space)
    for key_bits, raw_violations in [((4, 8), 17), ((2, 8), 4)]:
        scored = {i: feasibility_score(r) for i, r in _start(space, rows, key_bits).items()}
        raw, _ = family_posteriors(space, scored)
        mean, _ = predicted_scores(space, scored)
        fam = _family(space)
        pairs = [(a, b) for a in fam for b in fam if order[a, b] and a != b]
        assert sum(raw[a] > raw[b] + 1e-9 for a, b in pairs) == raw_violations
        assert not any(mean[a] > mean[b] for a, b in pairs)
        assert (mean >= raw).all() and np.isneginf(mean[_family(space, "identity")]).all()  # no results there


def test_picks_start_from_a_miss(small):
    """From results at 4- and 8-bit keys only, the surrogate knows nothing of 2- and 3-bit keys;
    every pick is at least as precise as a result below its floor, and two picks reach the
    family's best ratios at 99 % (3.26x) and 97 % (3.68x)."""
    space, rows, ratios = small
    full = _start(space, rows, (4, 8))
    order = full_order(space)
    picks = []
    while (pick := climb_pick(space, ratios, full, (0.99, 0.97))) is not None and len(picks) < 8:
        below = [i for i, r in full.items() if feasibility_score(r) < pick.floor]
        assert order[below, pick.index].any()
        full[pick.index] = rows[pick.index]
        picks.append(pick.index)
    assert len(picks) == 2
    assert best_full_ratio(full, 0.99) == pytest.approx(3.26, abs=0.005)
    assert best_full_ratio(full, 0.97) == pytest.approx(3.68, abs=0.005)


def test_no_pick_without_a_family_of_three_results_or_anything_left(small):
    space, rows, ratios = small
    fam = _family(space)
    assert climb_pick(space, ratios, {i: rows[i] for i in fam[:2]}, (0.99,)) is None  # 2 results: no surrogate
    mixed = {i: rows[i] for i in fam[:2] + _family(space, "identity")[:1]}  # 3 results, no family with 3
    assert climb_pick(space, ratios, mixed, (0.99,)) is None
    assert climb_pick(space, ratios, {i: r for i, r in enumerate(rows)}, (0.99,)) is None  # all evaluated
    with pytest.raises(ValueError, match="ratios has shape"):
        climb_pick(space, ratios[:-1], {}, (0.99,))
    for bad in (len(rows), -1):
        with pytest.raises(ValueError, match=f"result position {bad} is not one of the space's"):
            climb_pick(space, ratios, {**{i: rows[i] for i in fam[:3]}, bad: rows[0]}, (0.99,))


def test_a_ratio_that_is_not_finite_is_never_picked(small):
    space, rows, ratios = small
    full = _start(space, rows, (2, 8))
    pick = climb_pick(space, ratios, full, (0.99, 0.97))
    for bad in (np.nan, np.inf):
        changed = ratios.copy()
        changed[pick.index] = bad
        other = climb_pick(space, changed, full, (0.99, 0.97))
        assert other is not None and other.index != pick.index and np.isfinite(other.gain)


def test_failed_trials_count_as_evaluated_but_not_as_results(small):
    space, rows, ratios = small
    fam = _family(space)
    failed = {i: {"relative_accuracy": float("nan"), "compression_ratio": float("nan")} for i in fam}
    assert climb_pick(space, ratios, failed, (0.99,)) is None


def test_missed_takes_full_results_below_at_both_ends_and_cheap_ones_below_at_the_upper_end():
    full = {0: {"relative_accuracy": 0.985, "relative_accuracy_lo": 0.98},  # missed
            1: {"relative_accuracy": 0.992, "relative_accuracy_lo": 0.985},  # noise may hide a pass: kept
            2: {"relative_accuracy": 0.995, "relative_accuracy_lo": 0.991}}  # cleared
    cheap = {3: {"relative_accuracy": 0.95, "relative_accuracy_hi": 0.97},  # the whole interval below 99 %
             4: {"relative_accuracy": 0.985, "relative_accuracy_hi": 0.995},
             5: {"relative_accuracy": 0.9}}  # no interval: not used
    assert missed(full, cheap, 0.99) == [0, 3]
    assert missed(full, cheap, 0.96) == []
    # a policy's own full result outranks its cheap one: 2 cleared at full fidelity
    assert missed(full, {**cheap, 2: {"relative_accuracy": 0.98, "relative_accuracy_hi": 0.985}}, 0.99) == [0, 3]


def test_a_cheap_result_far_below_the_floor_prunes_its_less_precise_family(small):
    """From the corner start a 99 % floor has a pick; with a cheap result of every policy of the
    family whose interval ends below 99 % (upper end 98.5 %), none is left."""
    space, rows, ratios = small
    fam = _family(space)
    corner = [i for i in fam if space.candidates[i].params["key.bits"] in (2, 8)
              and space.candidates[i].params["value.bits"] in (2, 8)]
    full = {i: rows[i] for i in corner}
    assert climb_pick(space, ratios, full, (0.99,)) is not None
    low = {i: {"relative_accuracy": 0.98, "relative_accuracy_hi": 0.985} for i in fam}
    assert climb_pick(space, ratios, full, (0.99,), cheap=low) is None
    assert climb_pick(space, ratios, full, (0.99,), cheap={i: low[i] for i in fam[:3]}) is not None


def _climb_stages(space, rows, ratios, full, stored, **settings):
    """Drive :meth:`TQCMethod.climb` as the runner does: evaluate each stage's one candidate
    from the synthetic table and tell it; returns the positions evaluated."""
    from kvtune.methods.tqc.method import TQCContext, TQCMethod
    from kvtune.methods.tqc.settings import ProfileSettings

    ctx = TQCContext(settings=ProfileSettings(device="cpu", floors=(0.99, 0.97), **settings), lm=None,
                     workload=None, space=space, ratios=ratios, info={})
    by_id = {space.candidates[i].policy_id: rows[i] for i in full}
    picked = []
    for stage in TQCMethod().climb(ctx, {}, by_id, stored):
        assert stage.name == "climb" and stage.budget == 1 and len(stage.candidates) == 1
        cand = stage.optimizer.ask()
        stage.optimizer.tell(cand, rows[cand.index])
        picked.append(cand.index)
    return picked


def test_the_profile_climbs_within_its_budget_and_a_resume_counts_stored_climbs(small):
    space, rows, ratios = small
    fam = _family(space)
    corner = [i for i in fam if space.candidates[i].params["key.bits"] in (2, 8)
              and space.candidates[i].params["value.bits"] in (2, 8)]
    first = _climb_stages(space, rows, ratios, corner, [], climb_budget=2)
    assert len(first) == 2
    assert _climb_stages(space, rows, ratios, corner, [], climb_budget=8) == first + [
        p for p in _climb_stages(space, rows, ratios, corner + first, [{"stage": "climb"}] * 2, climb_budget=8)]
    # a resumed run with one stored climb (and its row among the full results) makes one more
    assert _climb_stages(space, rows, ratios, corner + first[:1], [{"stage": "climb"}], climb_budget=2) == first[1:]
    assert _climb_stages(space, rows, ratios, corner, [], climb_budget=0) == []
    assert _climb_stages(space, rows, ratios.copy() * 0 + 1, corner, [], climb_budget=2) == []  # nothing to gain


def test_the_profile_says_why_it_does_not_climb(small, caplog, monkeypatch):
    space, rows, ratios = small
    corner = list(_start(space, rows, (2, 8)))
    with caplog.at_level("WARNING"):
        assert _climb_stages(space, rows, None, corner, [], climb_budget=2) == []
    assert "skips the up-front ratio estimates" in caplog.text
    monkeypatch.setattr(climb_mod, "MAX_GROUP", 8)  # the family's 24 comparable candidates are too many
    with caplog.at_level("WARNING"):
        assert _climb_stages(space, rows, ratios, corner, [], climb_budget=2) == []
    assert "more than 8 comparable candidates" in caplog.text
