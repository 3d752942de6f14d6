"""``kvserve``: the constrained Bayesian-optimization search of the KVServe paper.

Goal: the candidate with the **largest compression ratio whose accuracy clears the floor**
``q_min`` (KVServe, "Service-Aware KV Cache Compression for Communication-Efficient
Disaggregated LLM Serving", arXiv 2605.13734, Bayesian Profiling Engine), in as few evaluations as
possible. One number per floor, not a Pareto front (``mobo`` does that).

Rules, each a pure function of the seed and the told results (so a resumed run that replays
its trials asks exactly what the uninterrupted run would have asked):

1. **Feasibility score.** ``s = relative_accuracy_lo`` (the lower end of the 95 % interval)
   when the result has it, else ``relative_accuracy``; a candidate is feasible iff ``s >=
   q_min``. Results without either (failed trials) are ignored by the model and the pruning.
2. **Surrogate.** A GP (:mod:`kvtune.search.optimizers.gp`: BoTorch's ``SingleTaskGP`` model and
   priors) on the warped score ``z = -log(1 + delta - s)`` (``delta = 0.01``; ``s`` clipped
   at ``1 + 3 delta / 4``) over ``space.features()`` (one-hot categoricals, min-max numerics).
   Quantization error shrinks ~4x per extra bit, so ``log(1 - accuracy)`` is close to
   additive in the features; the warp is monotone, so ``P(s >= q_min) = P(z >= z_q)``
   exactly. The posterior std is multiplied by the GP's leave-one-out calibration factor
   (:meth:`~kvtune.search.optimizers.gp.GaussianProcess.loo_scale`, >= 1). At most ``max_train``
   observations (the highest-ratio ones; lower ratios are pruned anyway) are used.
3. **Acquisition** (:func:`kvserve_acquisition`)::

       alpha(c) = CR(c) / CR_max * P(s(c) >= q_min) + lambda_t * sigma_norm(c)

   over the *active* set (untold, unpruned candidates): ``P`` from the GP posterior (latent
   mean and calibrated std), ``sigma_norm`` the posterior std min-max normalized to [0, 1]
   over the active set, ``CR_max`` the largest active ratio (so ``lambda_t`` is in units of
   it and does not depend on the ratio range; the argmax is that of ``CR * P + lambda_t *
   CR_max * sigma_norm``). **Schedule**: ``lambda_t = lambda0 * 0.5 ** (t / half_life)``
   with ``t`` the number of observations beyond the initial design; defaults ``lambda0 =
   0.3``, ``half_life = 15`` (exploration weight 0.15 after 15 model-based steps, 0.075 after
   30). The argmax is asked (ties: lowest index).
4. **Cold start.** The first ``n_init`` (default 6) proposals spread along the ratio axis:
   one candidate drawn (seeded) from each of ``n_init`` equal-count ratio strata, highest
   first (:func:`~kvtune.search.optimizers.gp.ratio_spread_design`); pruned ones are skipped.
5. **Bidirectional pruning** (:attr:`KVServeOptimizer.pruned`):

   * *ratio rule* -- a feasible result at ratio ``r`` prunes every active candidate with ratio
     ``<= r``: it can no longer be the best feasible ratio. This is exact for the constrained
     objective, across families (not only within one, as the paper states it), and needs
     the up-front ``ratios`` (disabled without them);
   * *precision rule* -- an infeasible result at ``b`` whose point estimate
     ``relative_accuracy`` is also below ``q_min`` prunes every active ``a`` with
     ``space.at_most_as_precise(a, b)`` (same family, no parameter more precise): assuming
     accuracy is monotone in precision, ``a`` is infeasible too. Requiring the point estimate
     (not only the interval's lower end) to miss the floor keeps evaluation noise from
     pruning the answer: a result with ``lo < q_min <= relative_accuracy`` is not feasible
     and prunes nothing. (On the synthetic benchmark, pruning on ``lo`` alone removed the
     exhaustive best at ``q_min = 0.99`` in 3 of 5 seeds.) Monotonicity remains an assumption.

6. **Early stop** (``ask`` returns ``None``, reason in :attr:`KVServeOptimizer.stop_reason`)
   when every active candidate is pruned, or when all of these hold: a feasible result
   exists, at best ratio ``r*``; the remaining ratio span is small -- ``max ratio / r* - 1 <=
   span_tol`` over the active candidates the GP still gives at least ``p_stop`` probability
   of being feasible (span 0 when there are none: candidates the model is sure fail do not
   keep the search alive); and failures repeat -- the last ``repeat_failures`` results were
   all infeasible (in evaluation order, :meth:`~kvtune.search.optimizers.base.Optimizer.chronology`).
   Defaults ``span_tol = 0``, ``p_stop = 1e-4``, ``repeat_failures = 5``. On the synthetic
   2,025-candidate problem the paper-like ``span_tol = 0.02, p_stop = 0.02,
   repeat_failures = 3`` stopped after 20-45 evaluations but missed the exact best ratio at
   ``q_min = 0.99`` in 4 of 10 seeds (the GP is over-confident that near-threshold candidates
   fail). On the real replay table (``benchmarks/data/full_replay.parquet``) ``p_stop =
   0.005`` still stopped 2 of 10 seeds at ``q_min = 0.97`` while the best candidate (interval
   lower end 0.974) was untold; ``1e-4`` hits it in 9/10 seeds there (10/10 on the synthetic
   problem at both floors, 70 evaluations on average).

7. **Batch asks with pending candidates** (:meth:`~kvtune.search.optimizers.base.Optimizer.ask_batch`;
   sequential greedy, each pick pending for the next). A pending candidate is never asked
   again, and its result is *fantasized* by the GP posterior mean (kriging believer,
   :meth:`~kvtune.search.optimizers.gp.GaussianProcess.believe`): the GP is conditioned on
   that mean with its hyperparameters kept (the calibration factor stays the one of the real
   observations), so the posterior std shrinks near pending candidates and a batch spreads
   out. The pruning rules are applied to the fantasized results *tentatively*: a pending
   candidate predicted feasible (mean ``>=`` the warped floor) excludes the active
   candidates of ratio ``<=`` its own, one predicted infeasible excludes those at most as
   precise as itself; excluded candidates are not asked while the prediction stands (a
   pending result that would prune them if the prediction were true) but are not pruned:
   :attr:`KVServeOptimizer.pruned` and the early stop see only told results. When every
   candidate left is pending or tentatively excluded the batch is short (possibly empty);
   the caller asks again once results are told. During the cold start (no model yet) pending
   candidates are only skipped. Without pending candidates every rule is exactly the
   one-at-a-time search above.

Without ``ratios`` (not measured up front): ``CR(c)`` is the GP posterior mean of the log
ratio of told results (a second output), exponentiated; the ratio rule and the span test are
disabled; the cold start is a seeded uniform sample.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from kvtune.search.optimizers.base import Optimizer, register_optimizer
from kvtune.search.optimizers.gp import (
    candidate_inputs,
    exp_decay,
    fit_gp,
    normal_cdf,
    ratio_spread_design,
    result_value,
    step_rng,
    torch_threads,
)
from kvtune.search.space import Candidate

__all__ = ["KVServeOptimizer", "feasibility_score", "kvserve_acquisition", "warp_accuracy"]

#: Offset of the accuracy warp ``z = -log(1 + WARP_DELTA - s)``.
WARP_DELTA = 0.01


def warp_accuracy(s: np.ndarray | float, delta: float = WARP_DELTA) -> np.ndarray:
    """``z = -log(max(1 + delta - s, delta / 4))``: monotone increasing in accuracy ``s``."""
    return -np.log(np.maximum(1.0 + delta - np.asarray(s, dtype=np.float64), delta / 4))


def feasibility_score(result: dict[str, Any]) -> float:
    """``relative_accuracy_lo`` if present and finite, else ``relative_accuracy``, else NaN."""
    lo = result_value(result, "relative_accuracy_lo")
    return lo if np.isfinite(lo) else result_value(result, "relative_accuracy")


def kvserve_acquisition(mean: np.ndarray, std: np.ndarray, ratios: np.ndarray, threshold: float,
                        lam: float) -> np.ndarray:
    """KVServe acquisition over a candidate set.

    ``alpha = CR / max(CR) * P + lam * sigma_norm`` with ``P = Phi((mean - threshold) / std)``
    (``P = 1[mean >= threshold]`` where ``std == 0``) and ``sigma_norm = (std - min std) /
    (max std - min std)`` (zeros when all stds are equal).

    Args:
        mean, std: ``(n,)`` posterior mean and standard deviation of the (warped) accuracy.
        ratios: ``(n,)`` compression ratios ``CR``.
        threshold: the floor in the same units as ``mean``.
        lam: exploration weight ``lambda_t``.

    Returns:
        ``(n,)`` float64 acquisition values.

    >>> kvserve_acquisition(np.array([0.98, 0.96]), np.array([0.01, 0.02]), np.array([4.0, 8.0]), 0.97, 0.5).round(4)
    array([0.4207, 0.8085])
    """
    mean = np.asarray(mean, dtype=np.float64)
    std = np.asarray(std, dtype=np.float64)
    cr = np.asarray(ratios, dtype=np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        z = (mean - threshold) / std
    p = np.where(std > 0, normal_cdf(np.nan_to_num(z)), (mean >= threshold).astype(np.float64))
    span = std.max() - std.min() if std.size else 0.0
    sigma_norm = (std - std.min()) / span if span > 0 else np.zeros_like(std)
    cr_max = cr.max() if cr.size else 1.0
    return cr / cr_max * p + lam * sigma_norm


@register_optimizer("kvserve")
class KVServeOptimizer(Optimizer):
    """Constrained BO (KVServe): maximize the ratio subject to accuracy >= ``q_min``.

    See the module docstring for every rule and threshold.

    Args:
        space, seed, q_min, ratios, device: as :class:`~kvtune.search.optimizers.base.Optimizer`
            (the GP is fitted and evaluated on ``device``).
        n_init: initial design size (ratio-spread).
        lambda0, half_life: exploration schedule ``lambda_t = lambda0 * 0.5 ** (t / half_life)``.
        span_tol, repeat_failures, p_stop: early-stop thresholds.
        max_train: cap on the GP's training set (cost control).
        maxiter: L-BFGS-B iteration cap of each GP fit.
    """

    def __init__(self, space, *, seed: int = 0, q_min: float = 0.97, ratios: np.ndarray | None = None,
                 device=None, n_init: int = 6, lambda0: float = 0.3, half_life: float = 15.0,
                 span_tol: float = 0.0, repeat_failures: int = 5, p_stop: float = 1e-4, max_train: int = 300,
                 maxiter: int = 100, ratio_feature: bool = False) -> None:
        super().__init__(space, seed=seed, q_min=q_min, ratios=ratios, device=device)
        self.n_init, self.lambda0, self.half_life = int(n_init), float(lambda0), float(half_life)
        self.span_tol, self.repeat_failures, self.p_stop = float(span_tol), int(repeat_failures), float(p_stop)
        self.max_train, self.maxiter = int(max_train), int(maxiter)
        n = len(self.candidates)
        self._x = candidate_inputs(space, self.ratios if ratio_feature else None)
        self._design = ratio_spread_design(self.n_init, n, self.ratios, step_rng(seed, 0, tag=1))
        self._scores: dict[int, float] = {}
        self._best_feasible = -np.inf  # best feasible ratio r* (known-ratio units)
        self._precision_pruned: dict[int, int] = {}  # pruned index -> infeasible index that pruned it
        self._families: dict[tuple, list[int]] | None = None
        self.stop_reason: str | None = None
        self._surrogate_cache: tuple | None = None  # (GP, LOO scale) of the told results

    # ------------------------------------------------------------------ bookkeeping

    def _family_members(self) -> dict[tuple, list[int]]:
        if self._families is None:
            fam: dict[tuple, list[int]] = {}
            for c in self.candidates:
                fam.setdefault(self.space.family(c), []).append(c.index)
            self._families = fam
        return self._families

    def _ratio_of(self, index: int, result: dict[str, Any]) -> float:
        if self.ratios is not None:
            return float(self.ratios[index])
        return result_value(result, "compression_ratio")

    def tell(self, candidate: Candidate, result: dict[str, Any]) -> None:
        """Record a result and apply the pruning rules (module docstring, rule 5)."""
        super().tell(candidate, result)
        self._surrogate_cache = None
        s = feasibility_score(result)
        if not np.isfinite(s):
            return
        i = candidate.index
        self._scores[i] = s
        if s >= self.q_min:
            r = self._ratio_of(i, result)
            if self.ratios is not None and np.isfinite(r):
                self._best_feasible = max(self._best_feasible, r)
        elif not result_value(result, "relative_accuracy") >= self.q_min:  # NaN counts as below
            for a in self._at_most_as_precise(i):
                self._precision_pruned.setdefault(a, i)

    def _at_most_as_precise(self, b: int) -> list[int]:
        """Other candidates of ``b``'s family with no parameter more precise than ``b``'s."""
        cb = self.candidates[b]
        return [a for a in self._family_members().get(self.space.family(cb), [])
                if a != b and self.space.at_most_as_precise(self.candidates[a], cb)]

    @property
    def best_feasible_ratio(self) -> float:
        """Largest ratio among feasible results (``-inf`` if none, or without known ratios)."""
        return float(self._best_feasible)

    @property
    def pruned(self) -> dict[int, str]:
        """Untold candidates excluded by bidirectional pruning: ``{index: reason}``.

        ``reason`` is ``"ratio <= r*"`` (ratio rule) or ``"at most as precise as #b"``
        (precision rule, ``b`` an infeasible result)."""
        out: dict[int, str] = {}
        if self.ratios is not None and np.isfinite(self._best_feasible):
            for i in np.flatnonzero(self.ratios <= self._best_feasible):
                if int(i) not in self.told:
                    out[int(i)] = f"ratio <= {self._best_feasible:.6g}"
        for a, b in self._precision_pruned.items():
            if a not in self.told and a not in out:
                out[a] = f"at most as precise as #{b}"
        return out

    def active(self) -> list[int]:
        """Untold, unpruned candidate indices (ascending)."""
        pruned = self.pruned
        return [c.index for c in self.candidates if c.index not in self.told and c.index not in pruned]

    # ------------------------------------------------------------------ asking

    def propose(self, pending: Sequence[Candidate]) -> Candidate | None:
        active = self.active()
        if not active:
            self.stop_reason = "every remaining candidate is pruned"
            return None
        busy = {c.index for c in pending}
        free = [i for i in active if i not in busy]
        if not free:
            return None  # all that is left is pending
        obs = sorted(self._scores)
        if len(obs) < self.n_init or len(obs) < 2:
            free_set = set(free)
            for i in self._design:
                if i in free_set:
                    return self.candidates[i]
            rng = step_rng(self.seed, len(self.told) + len(busy), tag=2)
            return self.candidates[free[int(rng.integers(len(free)))]]
        with torch_threads(1):
            return self._model_step(free, obs, [c.index for c in pending])

    def _surrogate(self, obs: list[int]):
        """GP of the told scores (and log ratios without ``ratios``) and its LOO calibration
        factor; cached until the next :meth:`tell`."""
        if self._surrogate_cache is None:
            if len(obs) > self.max_train:  # keep the highest-ratio observations
                key = self.ratios if self.ratios is not None else np.zeros(len(self.candidates))
                obs = sorted(sorted(obs, key=lambda i: (-key[i], i))[: self.max_train])
            idx = np.asarray(obs)
            z = warp_accuracy([self._scores[i] for i in obs])
            if self.ratios is None:
                lr = np.array([np.log(max(result_value(self.told[i], "compression_ratio"), 1e-12)) for i in obs])
                ok = np.isfinite(lr)
                y = np.column_stack([z, np.where(ok, lr, np.nanmean(lr[ok]) if ok.any() else 0.0)])
            else:
                y = z[:, None]
            gp = fit_gp(self._x[idx], y, maxiter=self.maxiter, device=self.device)
            self._surrogate_cache = (gp, gp.loo_scale())
        return self._surrogate_cache

    def _tentatively_excluded(self, pending: list[int], feasible: np.ndarray) -> set[int]:
        """Candidates the pruning rules would remove if each pending candidate's predicted
        feasibility (``feasible``, ``(p,)`` bool) were its result (module docstring, rule 7)."""
        out: set[int] = set()
        for b, ok in zip(pending, feasible):
            if ok and self.ratios is not None:
                out.update(int(i) for i in np.flatnonzero(self.ratios <= self.ratios[b]))
            elif not ok:
                out.update(self._at_most_as_precise(b))
        return out

    def _model_step(self, active: list[int], obs: list[int], pending: list[int]) -> Candidate | None:
        gp, loo = self._surrogate(obs)
        threshold = float(warp_accuracy(self.q_min))
        if pending:
            mean_p, _ = gp.predict(self._x[pending])
            excluded = self._tentatively_excluded(pending, mean_p[:, 0] >= threshold)
            active = [i for i in active if i not in excluded]
            if not active:
                return None
            gp = gp.believe(self._x[pending])
        act = np.asarray(active)
        mean, std = gp.predict(self._x[act])
        std = std * loo[None, :]  # calibrated: inflate an over-confident posterior
        cr = self.ratios[act] if self.ratios is not None else np.exp(mean[:, 1])
        t = len(self._scores) - self.n_init
        lam = exp_decay(self.lambda0, self.half_life, t)
        alpha = kvserve_acquisition(mean[:, 0], std[:, 0], cr, threshold, lam)
        p = normal_cdf((mean[:, 0] - threshold) / np.maximum(std[:, 0], 1e-12))
        if self._should_stop(act, p):
            return None
        best = int(np.argmax(alpha))
        return self.candidates[int(act[best])]

    def _should_stop(self, act: np.ndarray, p: np.ndarray) -> bool:
        """Early-stop test (module docstring, rule 6); sets :attr:`stop_reason` when it fires."""
        if self.ratios is None or not np.isfinite(self._best_feasible):
            return False
        recent = [i for i in self.chronology() if i in self._scores][-self.repeat_failures :]
        if len(recent) < self.repeat_failures or any(self._scores[i] >= self.q_min for i in recent):
            return False
        r_star = self._best_feasible
        plausible = act[p >= self.p_stop]
        span = float(self.ratios[plausible].max()) / r_star - 1.0 if plausible.size else 0.0
        if span <= self.span_tol:
            self.stop_reason = (f"early stop: r* = {r_star:.4g}, ratio span of the {plausible.size} plausible "
                                f"candidates {span:.2%} <= {self.span_tol:.0%}, last {self.repeat_failures} "
                                f"results infeasible")
            return True
        return False
