"""Floor climbing: a few more full-fidelity evaluations after the refinement, aimed where a
policy table's accuracy floor is most likely to gain compression ratio.

The search runs at cheap fidelity and the refinement re-evaluates part of its Pareto set on
every sample. The two fidelities rank policies differently near a floor: a family can score
99.5 % on the 8 cheap contexts and end at 98.0-98.5 % (the interval's lower end, which the
tables gate on) on 24, and the policy that clears 99 % at full fidelity may never have been
refined, or never searched. Then the table's 99 % floor falls back to a much lower ratio
(3.55x instead of 7.4x in one default profile). Floor climbing closes that gap
with the constrained Bayesian optimization of the KVServe paper ("KVServe: Service-Aware KV
Cache Compression for Communication-Efficient Disaggregated LLM Serving", arXiv 2605.13734,
Bayesian Profiling Engine), run at full fidelity for every floor of the table at once:

1. **Surrogate.** One GP per family (the candidates sharing their categorical values,
   :meth:`~kvtune.search.space.SearchSpace.family`) with at least :data:`MIN_FAMILY_RESULTS`
   full-fidelity results (:func:`~kvtune.search.optimizers.gp.fit_gp`), on the warped
   feasibility score ``z = -log(1.01 - s)`` (:func:`~kvtune.search.optimizers.kvserve.warp_accuracy`;
   ``s`` the interval's lower end, :func:`~kvtune.search.optimizers.kvserve.feasibility_score`)
   of those results only, over the candidates' features alone
   (:func:`~kvtune.search.optimizers.gp.candidate_inputs` without the ratio column); its
   posterior std scaled by the leave-one-out calibration factor. Measured on a default profile
   whose 99 % floor had fallen to 3.55x: one GP over every family, with the cheap results (and
   a fidelity column) or with the ratio column, followed the cheap scores and the ratio, and
   gave the 7.44x policy that clears 99 % at full fidelity (lower end 99.3 %) a predicted lower
   end of 97.1-98.4 %; on the full results and the features alone it predicted 98.8 % and
   ranked that policy first, but gave families without full results the prior's mean (a
   2-bit policy that scored 89 % on the cheap samples: a 28 % chance of clearing 99 %).
2. **Monotone mean.** Each candidate's predicted mean is raised to the largest mean among the
   candidates at most as precise as it (:meth:`~kvtune.search.space.SearchSpace.precision_groups`):
   the GP alone can predict less accuracy for more bits where it extrapolates.
3. **Where.** At floor ``q`` only candidates not yet evaluated at full fidelity and at least as
   precise as a full-fidelity result below ``q`` (at its lower end) are scored: the climb
   starts from a policy that missed the floor and adds precision. Elsewhere the surrogate
   extrapolates: in a family evaluated at 4-bit keys only it reverted to the family's mean for
   2-bit keys and gave a policy that scores 86.7 % a 94 % chance of clearing 99 %.
   **Pruning.** A candidate at most as precise as a result that missed ``q`` scores 0 at
   ``q``: KVServe's precision rule, assuming accuracy is monotone in precision. Missed: a
   full-fidelity result below ``q`` at its lower end and its point estimate, or, for a policy
   without a full result, a cheap-fidelity one whose whole 95 % interval lies below ``q``
   (``relative_accuracy_hi``; the cheap score stands in for the full one there, as it does in
   the search).
4. **Score.** For floor ``q`` with best full-fidelity ratio ``r_q`` (1.0: sending the KV
   uncompressed), each candidate ``c`` rule 3 leaves scores the expected relative gain
   ``P(s_full(c) >= q) * max(CR(c) - r_q, 0) / r_q`` (constrained expected improvement,
   Gardner et al., "Bayesian Optimization with Inequality Constraints", ICML 2014, in units of
   the floor's ratio, so floors compare).
5. **Pick.** The candidate and floor of the largest score, when it reaches ``min_gain``; else
   nothing (each floor's ratio is as high as the model expects to get).

Each step is a pure function of the results it is given (the GP fit starts from the prior
modes, no random restarts), so a resumed run that has the same results picks the same policy.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvtune.search.optimizers.gp import candidate_inputs, fit_gp, normal_cdf, result_value
from kvtune.search.optimizers.kvserve import feasibility_score, warp_accuracy
from kvtune.search.space import SearchSpace

__all__ = ["ClimbPick", "best_full_ratio", "climb_pick", "family_posteriors", "floor_gains", "missed", "monotone_mean",
           "predicted_scores", "related"]

#: Smallest expected relative ratio gain worth a full-fidelity evaluation.
MIN_GAIN = 0.02

#: Full-fidelity results a family needs before its surrogate predicts anything.
MIN_FAMILY_RESULTS = 3

#: Most comparable candidates (one group of :meth:`~kvtune.search.space.SearchSpace.precision_groups`)
#: a space may have for climbing: the group's order takes ``m ** 2`` bytes (256 MiB here).
MAX_GROUP = 16384


@dataclass(frozen=True)
class ClimbPick:
    """The next policy to evaluate at full fidelity.

    Attributes:
        index: the candidate's position in ``space.candidates``.
        floor: the accuracy floor (fraction) it is expected to raise.
        probability: the surrogate's probability that its lower end clears ``floor`` at full
            fidelity.
        ratio: its compression ratio (the up-front estimate).
        best_ratio: the floor's best full-fidelity ratio so far (1.0: none but uncompressed).
        gain: ``probability * (ratio - best_ratio) / best_ratio``.
    """

    index: int
    floor: float
    probability: float
    ratio: float
    best_ratio: float
    gain: float


def best_full_ratio(full: Mapping[int, dict[str, Any]], floor: float) -> float:
    """Highest ``compression_ratio`` among full-fidelity results whose feasibility score
    clears ``floor`` (1.0, the uncompressed policy, when none does)."""
    ok = [result_value(r, "compression_ratio") for r in full.values() if feasibility_score(r) >= floor]
    return max([1.0, *(v for v in ok if np.isfinite(v))])


def monotone_mean(mean: np.ndarray, groups: Sequence[tuple[np.ndarray, np.ndarray]], chunk: int = 1024) -> np.ndarray:
    """``mean[b]`` raised to ``max(mean[a])`` over every ``a`` at most as precise as ``b``
    (``groups`` from :meth:`~kvtune.search.space.SearchSpace.precision_groups`; at most ``m x
    chunk`` float64 at a time for a group of ``m``).

    >>> monotone_mean(np.array([2.0, 1.0, 0.5]), [(np.array([0, 1]), np.array([[1, 1], [0, 1]], bool)),
    ...                                           (np.array([2]), np.ones((1, 1), bool))])
    array([2. , 2. , 0.5])
    """
    mean = np.asarray(mean, dtype=np.float64)
    out = mean.copy()
    for ix, order in groups:
        m = mean[ix][:, None]
        for s in range(0, len(ix), chunk):
            out[ix[s : s + chunk]] = np.where(order[:, s : s + chunk], m, -np.inf).max(0)
    return out


def related(groups: Sequence[tuple[np.ndarray, np.ndarray]], positions: Sequence[int], n: int, *,
            above: bool) -> np.ndarray:
    """``(n,)`` bool: candidates at least as precise (``above``) or at most as precise (not
    ``above``) as one of ``positions`` (``groups`` from
    :meth:`~kvtune.search.space.SearchSpace.precision_groups`; a position relates to itself)."""
    marked = np.zeros(n, dtype=bool)
    marked[np.asarray(list(positions), dtype=np.int64)] = True
    out = np.zeros(n, dtype=bool)
    for ix, order in groups:
        hit = marked[ix]
        if hit.any():
            out[ix] = order[hit].any(0) if above else order[:, hit].any(1)
    return out


def floor_gains(probability: np.ndarray, ratios: np.ndarray, best_ratio: float) -> np.ndarray:
    """Expected relative ratio gain ``P * max(CR - r, 0) / r`` of each candidate at one floor.

    Args:
        probability: ``(n,)`` probabilities of clearing the floor.
        ratios: ``(n,)`` compression ratios.
        best_ratio: the floor's best ratio so far, ``r`` (> 0).

    >>> floor_gains(np.array([0.5, 1.0, 0.9]), np.array([8.0, 3.0, 4.5]), 4.0).round(3)
    array([0.5  , 0.   , 0.112])
    """
    return np.asarray(probability) * np.maximum(np.asarray(ratios, dtype=np.float64) - best_ratio, 0.0) / best_ratio


def missed(full: Mapping[int, dict[str, Any]], cheap: Mapping[int, dict[str, Any]], floor: float) -> list[int]:
    """Positions of the results that missed ``floor`` (module docstring, rule 3): full-fidelity
    ones at their lower end and point estimate, cheap ones (of policies without a full result)
    at their interval's upper end."""
    out = [i for i, r in full.items()
           if feasibility_score(r) < floor and result_value(r, "relative_accuracy") < floor]
    return out + [i for i, r in cheap.items() if i not in full and result_value(r, "relative_accuracy_hi") < floor]


def family_posteriors(space: SearchSpace, scored: Mapping[int, float], *, maxiter: int = 60,
                      device: Any = None) -> tuple[np.ndarray, np.ndarray]:
    """Per-family GP posterior of the warped score at every candidate (module docstring, rule 1).

    Args:
        space: the search space.
        scored: feasibility scores (fractions) of the full-fidelity results, by position.

    Returns:
        ``mean, std``: ``(n,)`` float64; ``-inf`` and 1 where the candidate's family has fewer
        than :data:`MIN_FAMILY_RESULTS` scored results (no prediction).
    """
    n = len(space.candidates)
    mean, std = np.full(n, -np.inf), np.ones(n)
    families: dict[tuple, list[int]] = {}
    for pos, c in enumerate(space.candidates):
        families.setdefault(space.family(c), []).append(pos)
    x = candidate_inputs(space, None)
    for members in families.values():
        seen = [i for i in members if i in scored]
        if len(seen) < MIN_FAMILY_RESULTS:
            continue
        gp = fit_gp(x[seen], warp_accuracy([scored[i] for i in seen])[:, None], maxiter=maxiter, device=device)
        m, sd = gp.predict(x[members])
        mean[members], std[members] = m[:, 0], sd[:, 0] * gp.loo_scale()[0]
    return mean, std


def predicted_scores(space: SearchSpace, scored: Mapping[int, float], groups=None, *, maxiter: int = 60,
                     device: Any = None) -> tuple[np.ndarray, np.ndarray]:
    """Rules 1 and 2 of the module docstring: :func:`family_posteriors` with each mean raised
    by :func:`monotone_mean` (``groups``: :meth:`~kvtune.search.space.SearchSpace.precision_groups`,
    computed when None).

    Returns:
        ``mean, std``: ``(n,)`` float64 of the warped score; a candidate at most as precise as
        another never has the larger mean.
    """
    groups = space.precision_groups() if groups is None else groups
    mean, std = family_posteriors(space, scored, maxiter=maxiter, device=device)
    return monotone_mean(mean, groups), std


def climb_pick(space: SearchSpace, ratios: np.ndarray, full: Mapping[int, dict[str, Any]], floors: Sequence[float],
               *, cheap: Mapping[int, dict[str, Any]] | None = None, groups=None, min_gain: float = MIN_GAIN,
               maxiter: int = 60, device: Any = None) -> ClimbPick | None:
    """The next full-fidelity evaluation of floor climbing (module docstring), or None (fewer
    than :data:`MIN_FAMILY_RESULTS` scored results, every candidate evaluated, or no score reaching ``min_gain``).

    Args:
        space: the search space.
        ratios: ``(n,)`` up-front compression ratio estimates of its candidates (a candidate
            whose estimate is not finite is never picked).
        full: full-fidelity results by candidate position in ``space.candidates`` (trial
            records: ``relative_accuracy``, ``relative_accuracy_lo``, ``compression_ratio``;
            failed ones, without a finite score, only count as evaluated).
        floors: the table's accuracy floors (fractions).
        cheap: cheap-fidelity results by position (``relative_accuracy_hi``), for pruning only.
        groups: ``space.precision_groups()`` (computed when None; pass it to reuse it).
        min_gain: smallest expected relative gain worth an evaluation.
        maxiter: L-BFGS-B iteration cap of the GP fit.
        device: where the GP is fitted (:func:`~kvtune.search.optimizers.gp.compute_device`).

    Raises:
        ValueError: ``ratios`` does not have one entry per candidate, or a position of ``full``
            or ``cheap`` is not one of the space's.
    """
    n = len(space.candidates)
    ratios = np.asarray(ratios, dtype=np.float64)
    if ratios.shape != (n,):
        raise ValueError(f"ratios has shape {ratios.shape}, the space {n} candidates")
    bad = [i for i in (*full, *(cheap or {})) if isinstance(i, bool) or not isinstance(i, (int, np.integer)) or not 0 <= i < n]
    if bad:
        raise ValueError(f"result position {bad[0]!r} is not one of the space's {n} candidates")
    ratios = np.where(np.isfinite(ratios), ratios, 0.0)
    scored = {i: feasibility_score(r) for i, r in full.items()}
    scored = {i: s for i, s in scored.items() if np.isfinite(s)}
    open_ = np.ones(n, dtype=bool)
    open_[list(full)] = False
    if len(scored) < MIN_FAMILY_RESULTS or not open_.any():
        return None
    groups = space.precision_groups() if groups is None else groups
    mean, std = predicted_scores(space, scored, groups, maxiter=maxiter, device=device)
    best: ClimbPick | None = None
    for q in sorted(floors, reverse=True):
        r_q = best_full_ratio(full, q)
        p = normal_cdf((mean - warp_accuracy(q)) / std)
        below = [i for i, v in scored.items() if v < q]
        allowed = open_ & related(groups, below, n, above=True) & ~related(groups, missed(full, cheap or {}, q), n,
                                                                          above=False)
        gains = np.where(allowed, floor_gains(p, ratios, r_q), 0.0)
        j = int(np.argmax(gains))
        if gains[j] >= min_gain and (best is None or gains[j] > best.gain):
            best = ClimbPick(index=j, floor=float(q), probability=float(p[j]), ratio=float(ratios[j]), best_ratio=r_q,
                             gain=float(gains[j]))
    return best
