"""``mobo``: multi-objective Bayesian optimization of the whole 3-D Pareto front.

Objectives (as :mod:`kvtune.search.pareto`): relative accuracy (up), compression ratio (up), codec
latency ``1 / encode_gbps + 1 / decode_gbps`` in s/GB (down). Unlike ``kvserve`` there is no
accuracy floor: the search maximizes the hypervolume of the evaluated front, so one run serves
every floor of the policy table.

Rules (each a pure function of the seed and the set of results told, so runs resume exactly):

1. **Initial design.** The first ``n_init`` (default 8) proposals spread along the ratio axis:
   one seeded draw from each of ``n_init`` equal-count ratio strata
   (:func:`~kvtune.search.optimizers.gp.ratio_spread_design`); a seeded uniform sample without
   ``ratios``.
2. **Surrogates.** Independent GPs (BoTorch ``SingleTaskGP`` model and priors, one batch
   element per output, fitted by :func:`~kvtune.search.optimizers.gp.fit_gp`; equivalent to a
   ``ModelListGP`` of single-output GPs) over
   :func:`~kvtune.search.optimizers.gp.candidate_inputs`, on

   * accuracy, warped ``z = -log(1.01 - accuracy)`` (see :mod:`kvtune.search.optimizers.kvserve`);
   * ``log`` codec latency (throughputs span orders of magnitude);
   * the ratio is **not modeled** when ``ratios`` is known: it is exact and cheap, read back
     from the input's log-ratio column inside the acquisition's objective. Without
     ``ratios`` a third output models ``log`` ratio.

   At most ``max_train`` (default 300) observations are used (the non-dominated ones first,
   then the rest in index order). Cost control: hyperparameters are fitted (L-BFGS-B, at most
   ``maxiter`` = 60 iterations, from the prior modes) on at most ``fit_rows`` (default 120)
   of them -- the non-dominated ones, then a seeded sample -- and the posterior conditions
   on all.
3. **Acquisition.** BoTorch's ``qLogExpectedHypervolumeImprovement`` (batch size 1) against
   the front of the GP posterior means at the evaluated points (the usual plug-in for noisy
   observations), with a ``SobolQMCNormalSampler`` of ``mc_samples`` (default 32) seeded per
   step. ``acquisition="qlognehvi"`` uses ``qLogNoisyExpectedHypervolumeImprovement``
   instead (integrates over the noisy baseline; it builds a box decomposition per MC sample,
   which in 3-D costs several seconds per step with ~100 observations on 2 cores, over the
   2 s budget, hence not the default).
   **Accuracy axis** (``accuracy_axis``): ``"warped"`` (default) measures the hypervolume in
   the GP's warped accuracy ``z = -log(1.01 - accuracy)``, ``"linear"`` in accuracy itself.
   The policy tables read the front at floors of 90-99 %, where the linear axis gives little
   volume (0.97 -> 0.99 is 4 % of the span from the 0.5 reference to 1.0, 18 % when warped). On the
   replay table of ``full.yaml`` (2,064 candidates, 10 seeds, ``benchmarks/search_accuracy_axis.py``)
   the warped axis found, after 42 evaluations, policies with 0.82 / 0.87 of the best ratio
   clearing 97 / 99 % (linear: 0.66 / 0.49), for 0.95 instead of 0.98 of the exhaustive
   (linear) hypervolume.
   **Reference point** (objective space): accuracy 0.5 (``acc_ref``; its ``z`` on the warped
   axis), ratio 1.0 (no compression), latency 1.1 x the worst latency seen.
4. **Discrete maximization.** The acquisition is evaluated in one batch on the untold
   candidates, after a prescreen that keeps the ``prescreen`` (default 128) candidates with
   the largest *optimistic* hypervolume improvement (each GP output at mean + 2 std in its
   favourable direction; exact, computed on the box decomposition of the current front).
   Candidates with no optimistic improvement have (numerically) no expected improvement. The
   argmax is asked (ties: lowest index). If no candidate can improve even optimistically,
   the one with the largest summed posterior std is asked (pure exploration; with pending
   candidates, the std of the kriging believer of rule 5).

5. **Batch asks with pending candidates** (:meth:`~kvtune.search.optimizers.base.Optimizer.ask_batch`):
   a q-batch is built by sequential greedy maximization over the discrete set -- each pick
   is pending for the next, and pending candidates are never scored, so no candidate is
   asked twice (BoTorch's continuous ``optimize_acqf(..., sequential=True)`` returned
   identical points for ``qLogNEHVI`` given initial ``X_pending``, meta-pytorch/botorch
   issue #2983; with BoTorch 0.18.1 its reproduction gives distinct points, but kvtune does
   not rely on the acquisition to separate them). The surrogate is fitted once per set of
   told results. How pending candidates enter the acquisition:

   * ``qlognehvi``: as BoTorch ``X_pending`` (it integrates over their joint posterior
     with the candidate, caching a box decomposition per MC sample);
   * ``qlogehvi`` (default): passing ``X_pending`` to ``qLogExpectedHypervolumeImprovement``
     makes it score the joint hypervolume improvement of the candidate *and* every pending
     point, by inclusion-exclusion over their ``2 ** (p + 1) - 1`` subsets -- with 7
     pending points, 255 subsets per MC sample and box, gigabytes per call. Instead the
     pending points' results are fantasized by the posterior mean (kriging believer,
     :meth:`~kvtune.search.optimizers.gp.GaussianProcess.believe`): the GPs are conditioned on
     them (posterior std shrinks near them) and their predicted objective vectors join the
     front the improvement is measured against.

   The initial design counts pending candidates: the model takes over once told and pending
   results together reach ``n_init`` (and at least 2 are told). Without pending candidates
   every rule is exactly the one-at-a-time search above.

BoTorch JIT-compiles a fused C++ kernel for the acquisition on first use, behind a lock file
that a killed process leaves behind; :func:`~kvtune.search.optimizers.fused_kernel.load_fused_kernel`
loads it first so that a stale lock is removed (or the pure-Python path used) instead of
waiting forever.
"""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from kvtune.search.optimizers.base import Optimizer, register_optimizer
from kvtune.search.optimizers.fused_kernel import load_fused_kernel
from kvtune.search.optimizers.gp import (
    DTYPE,
    candidate_inputs,
    fit_gp,
    ratio_spread_design,
    result_value,
    step_rng,
    step_seed,
    torch_threads,
)
from kvtune.search.optimizers.kvserve import WARP_DELTA, warp_accuracy
from kvtune.search.pareto import non_dominated_mask
from kvtune.search.space import Candidate

__all__ = ["MOBOOptimizer", "codec_latency", "hypervolume_improvement"]


def codec_latency(result: dict[str, Any]) -> float:
    """``1 / encode_gbps + 1 / decode_gbps`` (s/GB); NaN when a throughput is missing or <= 0."""
    enc, dec = result_value(result, "encode_gbps"), result_value(result, "decode_gbps")
    if not (enc > 0 and dec > 0):
        return float("nan")
    return 1.0 / enc + 1.0 / dec


def hypervolume_improvement(points: np.ndarray, cell_lower: np.ndarray, cell_upper: np.ndarray) -> np.ndarray:
    """Exact hypervolume improvement of each point (maximization) given the cells of the
    non-dominated region of the current front (a box decomposition).

    Args:
        points: ``(n, m)`` candidate objective vectors.
        cell_lower, cell_upper: ``(c, m)`` cell bounds (upper may be ``inf``).

    Returns:
        ``(n,)`` volume of the part of ``[ref, point]`` not dominated by the front.
    """
    out = np.zeros(points.shape[0])
    for s in range(0, points.shape[0], 512):
        p = points[s : s + 512, None, :]
        ext = np.clip(np.minimum(p, cell_upper[None]) - cell_lower[None], 0.0, None)
        out[s : s + 512] = ext.prod(-1).sum(-1)
    return out


@register_optimizer("mobo")
class MOBOOptimizer(Optimizer):
    """Multi-objective BO over (accuracy, ratio, -latency); see the module docstring.

    Args:
        space, seed, q_min, ratios, device: as :class:`~kvtune.search.optimizers.base.Optimizer`
            (``q_min`` is not used: the whole front is searched; the GPs, the box decomposition
            and the acquisition run on ``device``).
        n_init: initial design size.
        mc_samples: quasi-MC samples of the acquisition.
        prescreen: candidates scored by the acquisition each step (cost control).
        acquisition: ``"qlogehvi"`` (default) or ``"qlognehvi"``.
        accuracy_axis: ``"warped"`` (default) or ``"linear"``: the hypervolume's accuracy axis
            (module docstring, rule 3).
        acc_ref: accuracy of the reference point (finite; below ``1 + WARP_DELTA`` on the warped
            axis; above 1 no candidate improves the hypervolume: pure exploration).
        max_train: cap on the GPs' training set.
        fit_rows: cap on the rows the GP hyperparameters are fitted on (cost control).
        maxiter: L-BFGS-B iteration cap of each GP fit.

    Raises:
        ValueError: an unknown ``acquisition`` or ``accuracy_axis``, or an ``acc_ref`` that is not
            finite or (warped axis) not below ``1 + WARP_DELTA``.
    """

    def __init__(self, space, *, seed: int = 0, q_min: float = 0.97, ratios: np.ndarray | None = None,
                 device=None, n_init: int = 8, mc_samples: int = 32, prescreen: int = 128,
                 acquisition: str = "qlogehvi", accuracy_axis: str = "warped",
                 acc_ref: float = 0.5, max_train: int = 300, fit_rows: int = 120, maxiter: int = 60) -> None:
        super().__init__(space, seed=seed, q_min=q_min, ratios=ratios, device=device)
        if acquisition not in ("qlogehvi", "qlognehvi"):
            raise ValueError(f"acquisition must be 'qlogehvi' or 'qlognehvi', got {acquisition!r}")
        if accuracy_axis not in ("linear", "warped"):
            raise ValueError(f"accuracy_axis must be 'linear' or 'warped', got {accuracy_axis!r}")
        if not (isinstance(acc_ref, (int, float)) and math.isfinite(acc_ref)):
            raise ValueError(f"acc_ref must be a finite accuracy, got {acc_ref!r}")
        if accuracy_axis == "warped" and acc_ref >= 1.0 + WARP_DELTA:
            raise ValueError(f"acc_ref {acc_ref:g} has no warped value (the warp is -log({1 + WARP_DELTA:g} - "
                             f"accuracy)): use one below {1 + WARP_DELTA:g}, or accuracy_axis='linear'")
        self.accuracy_axis = accuracy_axis
        self.n_init, self.mc_samples, self.prescreen = int(n_init), int(mc_samples), int(prescreen)
        self.acquisition, self.acc_ref = acquisition, float(acc_ref)
        self.max_train, self.fit_rows, self.maxiter = int(max_train), int(fit_rows), int(maxiter)
        self._x = candidate_inputs(space, self.ratios)
        if self.ratios is not None:
            lr = np.log(np.maximum(self.ratios, 1e-12))
            self._log_ratio_range = (float(lr.min()), float(lr.max()))
        self._design = ratio_spread_design(self.n_init, len(self.candidates), self.ratios, step_rng(seed, 0, tag=11))
        self._obs: dict[int, tuple[float, float, float]] = {}  # index -> (accuracy, ratio, latency)
        self._surrogate_cache: tuple | None = None  # (GP, training indices) of the told results

    def tell(self, candidate: Candidate, result: dict[str, Any]) -> None:
        super().tell(candidate, result)
        acc = result_value(result, "relative_accuracy")
        ratio = float(self.ratios[candidate.index]) if self.ratios is not None else result_value(result, "compression_ratio")
        lat = codec_latency(result)
        if np.isfinite(acc) and np.isfinite(ratio) and ratio > 0 and np.isfinite(lat):
            self._obs[candidate.index] = (acc, ratio, lat)
        self._surrogate_cache = None

    def propose(self, pending: Sequence[Candidate]) -> Candidate | None:
        free = self.free(pending)
        if not free:
            return None
        busy = [c.index for c in pending]
        if len(self._obs) < 2 or len(self._obs) + len(busy) < max(self.n_init, 2):
            taken = set(self.told) | set(busy)
            for i in self._design:
                if i not in taken:
                    return self.candidates[i]
            rng = step_rng(self.seed, len(self.told) + len(busy), tag=12)
            return self.candidates[free[int(rng.integers(len(free)))]]
        with torch_threads(1):
            return self.candidates[self._model_step(np.asarray(free), np.asarray(busy, dtype=np.int64))]

    # ------------------------------------------------------------------ model-based step

    def _objectives(self, mean_out: np.ndarray, x: np.ndarray) -> np.ndarray:
        """Model outputs (warped accuracy, log latency[, log ratio]) -> objective space
        ``(accuracy, ratio, -latency)``, the accuracy on ``accuracy_axis`` (warped: the model's
        output itself); numpy twin of the MC objective."""
        acc = mean_out[:, 0] if self.accuracy_axis == "warped" else 1.0 + WARP_DELTA - np.exp(-mean_out[:, 0])
        ratio = np.exp(mean_out[:, 2]) if self.ratios is None else self._ratio_from_x(x)
        return np.column_stack([acc, ratio, -np.exp(mean_out[:, 1])])

    def _ratio_from_x(self, x):
        lo, hi = self._log_ratio_range
        mod = torch if isinstance(x, torch.Tensor) else np
        return mod.exp(lo + x[..., -1] * (hi - lo))

    def _surrogate(self):
        """GPs of the told results and the indices they are trained on; cached until the next
        :meth:`tell`."""
        if self._surrogate_cache is None:
            obs = sorted(self._obs)
            vals = np.array([self._obs[i] for i in obs])  # (k, 3): acc, ratio, latency
            if len(obs) > self.max_train:
                nd = non_dominated_mask(vals, (True, True, False))
                order = [i for i, f in zip(obs, nd) if f] + [i for i, f in zip(obs, nd) if not f]
                obs = sorted(order[: self.max_train])
                vals = np.array([self._obs[i] for i in obs])
            idx = np.asarray(obs)
            y = [warp_accuracy(vals[:, 0]), np.log(vals[:, 2])]
            if self.ratios is None:
                y.append(np.log(vals[:, 1]))
            gp = fit_gp(self._x[idx], np.column_stack(y), maxiter=self.maxiter, hyper_rows=self._hyper_rows(vals),
                        device=self.device)
            self._surrogate_cache = (gp, idx)
        return self._surrogate_cache

    def _model_step(self, free: np.ndarray, busy: np.ndarray) -> int:
        """The free candidate of largest acquisition value given the pending ones (``busy``)."""
        base, idx = self._surrogate()
        vals = np.array([self._obs[i] for i in idx])
        acc_ref = float(warp_accuracy(self.acc_ref)) if self.accuracy_axis == "warped" else self.acc_ref
        ref = np.array([acc_ref, 1.0, -1.1 * float(vals[:, 2].max())])
        believer = busy.size > 0 and self.acquisition == "qlogehvi"
        gp = base.believe(self._x[busy]) if believer else base

        # current front: posterior means at the evaluated (and, for the believer, pending) points
        front_x = self._x[np.concatenate([idx, busy])] if believer else self._x[idx]
        mean_obs, _ = gp.predict(front_x)
        front = self._objectives(mean_obs, front_x)
        front = front[np.all(front > ref, axis=1)]
        front = front[non_dominated_mask(front, (True, True, True))] if len(front) else front

        from botorch.utils.multi_objective.box_decompositions.non_dominated import FastNondominatedPartitioning

        t_ref = torch.as_tensor(ref, dtype=DTYPE, device=self.device)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            y_front = torch.as_tensor(front, dtype=DTYPE, device=self.device).reshape(-1, 3)
            partitioning = FastNondominatedPartitioning(ref_point=t_ref, Y=y_front)
            cells = partitioning.get_hypercell_bounds().cpu().numpy()  # (2, c, 3)

        # prescreen by optimistic hypervolume improvement
        mean, std = gp.predict(self._x[free])
        optimistic = mean + 2.0 * std * np.array([1.0, -1.0, 1.0][: mean.shape[1]])
        hvi = hypervolume_improvement(self._objectives(optimistic, self._x[free]), cells[0], cells[1])
        if not np.any(hvi > 0):  # pure exploration; the std of the believer spreads a batch out
            if busy.size and not believer:
                std = base.believe(self._x[busy]).predict(self._x[free])[1]
            return int(free[int(np.argmax(std.sum(1)))])
        order = np.lexsort((free, -hvi))  # largest optimistic HVI first, ties by index
        keep = np.sort(order[: min(self.prescreen, int((hvi > 0).sum()))])
        x_pending = None if believer or busy.size == 0 else self._x[busy]
        scores = self._acquisition_values(gp, idx, partitioning, t_ref, self._x[free[keep]],
                                          len(self.told) + busy.size, x_pending)
        return int(free[keep[int(np.argmax(scores))]])

    def _hyper_rows(self, vals: np.ndarray) -> np.ndarray | None:
        """Rows the GP hyperparameters are fitted on when there are more than ``fit_rows``
        observations: the non-dominated ones, then a seeded sample of the rest."""
        k = vals.shape[0]
        if k <= self.fit_rows:
            return None
        nd = np.flatnonzero(non_dominated_mask(vals, (True, True, False)))
        rest = np.setdiff1d(np.arange(k), nd)
        rest = step_rng(self.seed, k, tag=14).permutation(rest)
        return np.sort(np.concatenate([nd, rest])[: self.fit_rows])

    def _acquisition_values(self, gp, idx, partitioning, t_ref, x_cand: np.ndarray, step: int,
                            x_pending: np.ndarray | None = None) -> np.ndarray:
        from botorch.acquisition.multi_objective.logei import (
            qLogExpectedHypervolumeImprovement,
            qLogNoisyExpectedHypervolumeImprovement,
        )
        from botorch.acquisition.multi_objective.objective import GenericMCMultiOutputObjective
        from botorch.sampling import SobolQMCNormalSampler

        known_ratio, warped = self.ratios is not None, self.accuracy_axis == "warped"
        on_device = functools.partial(torch.as_tensor, dtype=DTYPE, device=self.device)

        def objective(samples: torch.Tensor, X: torch.Tensor | None = None) -> torch.Tensor:
            acc = samples[..., 0] if warped else 1.0 + WARP_DELTA - torch.exp(-samples[..., 0])
            ratio = torch.exp(samples[..., 2]) if not known_ratio else self._ratio_from_x(X).expand(samples.shape[:-1])
            return torch.stack([acc, ratio, -torch.exp(samples[..., 1])], dim=-1)

        load_fused_kernel()  # before BoTorch's own load, which may wait on a stale lock forever
        model = gp.to_botorch()
        sampler = SobolQMCNormalSampler(sample_shape=torch.Size([self.mc_samples]), seed=step_seed(self.seed, step, tag=13))
        with warnings.catch_warnings(), torch.no_grad():
            warnings.simplefilter("ignore")
            if self.acquisition == "qlognehvi":
                acqf = qLogNoisyExpectedHypervolumeImprovement(
                    model=model, ref_point=t_ref, X_baseline=on_device(self._x[idx]),
                    sampler=sampler, objective=GenericMCMultiOutputObjective(objective), prune_baseline=True,
                    cache_root=False, X_pending=None if x_pending is None else on_device(x_pending))
            else:
                acqf = qLogExpectedHypervolumeImprovement(
                    model=model, ref_point=t_ref, partitioning=partitioning, sampler=sampler,
                    objective=GenericMCMultiOutputObjective(objective))
            tx = on_device(x_cand).unsqueeze(1)  # (n, q=1, d)
            return torch.cat([acqf(tx[s : s + 256]) for s in range(0, tx.shape[0], 256)]).cpu().numpy()
