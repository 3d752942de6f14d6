"""Optuna samplers behind kvtune's ask/tell seam: ``optuna-tpe``, ``optuna-nsga2``, ``optuna-gp``.

All three are **multi-objective** over (relative accuracy up, compression ratio up, codec
latency ``1/encode_gbps + 1/decode_gbps`` s/GB down), like ``mobo``: TPE as MOTPE, NSGA-II,
and Optuna's GP sampler with its log-EHVI acquisition. A result missing one of these values is
told to Optuna as a failed trial.

Search space. One Optuna distribution per space parameter: a ``CategoricalDistribution`` of
the values for categorical parameters, an ``IntDistribution`` over the value *index* for
ordinal and float parameters (so the samplers see the order). Every parameter is always
sampled; a suggestion is turned into a candidate by applying the space's ``when`` conditions
(inactive parameters dropped, exactly as :func:`kvtune.search.space.load_space` does). Told trials
carry every parameter too: an inactive one is recorded at its first value (index 0), so all
trials share one search space (which the GP sampler and NSGA-II need). A space without
parameters is searched as one integer parameter, the candidate index.

No repeats. Optuna suggests the same point again in a discrete space, and may suggest a
combination that is not a candidate (forbidden, or de-duplicated by policy id). Such a
suggestion is mapped to the **nearest untold candidate** by squared Euclidean distance of
the space embedding (:meth:`~kvtune.search.space.SearchSpace.features`; ties: lowest index), and
Optuna is told the candidate actually evaluated. So no candidate is ever evaluated twice.

Pending candidates (a batch ask while others are being evaluated) are added to the rebuilt
study as ``RUNNING`` trials after the told ones -- what Optuna holds when ``study.ask()`` was
called several times before ``tell`` -- so each sampler treats them as it does running
trials (TPE's default constant liar, NSGA-II's generation bookkeeping), and a suggestion that
lands on a pending candidate is mapped to the nearest free one like a repeat. A batch of
``q`` is ``q`` such asks, each pick running for the next.

Determinism and resume. Each ``ask`` rebuilds an in-memory study from the told results (in
evaluation order, :meth:`~kvtune.search.optimizers.base.Optimizer.chronology`) with a sampler seeded
by (seed, number of results told and pending), then asks it once. The proposal is therefore
a pure function of the seed, the told results and the pending candidates: a resumed run
continues exactly. NSGA-II's
generation bookkeeping is reproduced when the trials are rebuilt (population size 20 by
default: with budgets of 20-200 evaluations Optuna's default of 50 leaves at most 4
generations). Rebuilding costs O(trials) per ask, negligible next to an evaluation.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np

from kvtune.search.optimizers.base import Optimizer, register_optimizer
from kvtune.search.optimizers.gp import result_value, space_features, step_seed, torch_threads
from kvtune.search.optimizers.mobo import codec_latency
from kvtune.search.space import Candidate

__all__ = ["OptunaOptimizer", "OptunaTPEOptimizer", "OptunaNSGA2Optimizer", "OptunaGPOptimizer"]

_INDEX_PARAM = "candidate"


class OptunaOptimizer(Optimizer):
    """Base class of the Optuna-backed optimizers (see the module docstring).

    Subclasses implement :meth:`make_sampler`.

    Args:
        space, seed, q_min, ratios, device: as :class:`~kvtune.search.optimizers.base.Optimizer`
            (``q_min`` unused: the samplers search the whole front; ``device`` checked, unused:
            Optuna's samplers run on the CPU).
        n_startup_trials: random trials before the model-based samplers (TPE, GP) start.
    """

    def __init__(self, space, *, seed: int = 0, q_min: float = 0.97, ratios: np.ndarray | None = None,
                 device=None, n_startup_trials: int = 10) -> None:
        super().__init__(space, seed=seed, q_min=q_min, ratios=ratios, device=device)
        from optuna.distributions import CategoricalDistribution, IntDistribution

        self.n_startup_trials = int(n_startup_trials)
        self._params = list(space.parameters)
        if self._params:
            self._distributions = {
                p.key: CategoricalDistribution(list(p.values)) if p.type == "categorical"
                else IntDistribution(0, len(p.values) - 1)
                for p in self._params
            }
        else:
            self._distributions = {_INDEX_PARAM: IntDistribution(0, max(len(self.candidates) - 1, 0))}
        self._lookup = {self._key(c.params): c.index for c in self.candidates}
        self._features = space_features(space)

    # ------------------------------------------------------------------ encoding

    @staticmethod
    def _key(params: dict[str, Any]) -> tuple:
        return tuple(sorted((k, repr(v)) for k, v in params.items()))

    def _encode(self, candidate: Candidate) -> dict[str, Any]:
        """Optuna parameters of a candidate (inactive parameters at their first value)."""
        if not self._params:
            return {_INDEX_PARAM: candidate.index}
        out: dict[str, Any] = {}
        for p in self._params:
            value = candidate.params.get(p.key, p.values[0])
            out[p.key] = value if p.type == "categorical" else p.values.index(value)
        return out

    def _assignment(self, suggested: dict[str, Any]) -> dict[str, Any]:
        """Suggested Optuna parameters -> the active ``{key: value}`` assignment."""
        full = dict(self.space.fixed)
        for p in self._params:
            v = suggested[p.key]
            full[p.key] = v if p.type == "categorical" else p.values[int(v)]
        return {p.key: full[p.key] for p in self._params if p.active(full)}

    def _resolve(self, suggested: dict[str, Any], pending: Sequence[Candidate] = ()) -> int:
        """Candidate index for a suggestion: itself if it is a free candidate (neither told nor
        pending), else the nearest free one (embedding distance; ties: lowest index)."""
        free = np.array(self.free(pending))
        if not self._params:
            target = int(suggested[_INDEX_PARAM])
            return int(free[np.argmin(np.abs(free - target))])
        active = self._assignment(suggested)
        idx = self._lookup.get(self._key(active))
        if idx is not None and idx in set(free.tolist()):
            return idx
        emb = np.concatenate([p.embed(active.get(p.key)) for p in self._params])
        dist = ((self._features[free] - emb) ** 2).sum(1)
        return int(free[int(np.argmin(dist))])

    def _values(self, index: int, result: dict[str, Any]) -> list[float] | None:
        acc = result_value(result, "relative_accuracy")
        ratio = float(self.ratios[index]) if self.ratios is not None else result_value(result, "compression_ratio")
        lat = codec_latency(result)
        vals = [acc, ratio, lat]
        return vals if all(np.isfinite(vals)) else None

    # ------------------------------------------------------------------ sampler + study

    def make_sampler(self, seed: int):
        """The Optuna sampler for one ask, seeded with ``seed``."""
        raise NotImplementedError

    def _system_attrs(self, sampler, complete: list[bool], running: int) -> list[dict[str, Any]]:
        """System attributes of the rebuilt told trials (``complete`` flags, in evaluation
        order) followed by ``running`` pending ones."""
        return [{} for _ in range(len(complete) + running)]

    def propose(self, pending: Sequence[Candidate]) -> Candidate | None:
        if len(self.told) + len(pending) >= len(self.candidates):
            return None
        import optuna
        from optuna.trial import TrialState, create_trial

        optuna.logging.set_verbosity(optuna.logging.WARNING)
        order = self.chronology()
        values = [self._values(i, self.told[i]) for i in order]
        seed = step_seed(self.seed, len(self.told) + len(pending), tag=21)
        with warnings.catch_warnings(), torch_threads(1):
            warnings.simplefilter("ignore")
            sampler = self.make_sampler(seed)
            attrs = self._system_attrs(sampler, [v is not None for v in values], len(pending))
            study = optuna.create_study(directions=["maximize", "maximize", "minimize"], sampler=sampler)
            told = [(self.candidates[i], v, TrialState.COMPLETE if v is not None else TrialState.FAIL)
                    for i, v in zip(order, values)]
            study.add_trials([
                create_trial(params=self._encode(c), distributions=self._distributions, values=v, state=state,
                             system_attrs=a)
                for (c, v, state), a in zip([*told, *((c, None, TrialState.RUNNING) for c in pending)], attrs)
            ])
            trial = study.ask(self._distributions)
            return self.candidates[self._resolve(trial.params, pending)]


@register_optimizer("optuna-tpe")
class OptunaTPEOptimizer(OptunaOptimizer):
    """Optuna's (multi-objective) TPE sampler, multivariate."""

    def make_sampler(self, seed: int):
        from optuna.samplers import TPESampler

        return TPESampler(seed=seed, n_startup_trials=self.n_startup_trials, multivariate=True)


@register_optimizer("optuna-nsga2")
class OptunaNSGA2Optimizer(OptunaOptimizer):
    """Optuna's NSGA-II sampler (population ``population_size``, default 20)."""

    def __init__(self, space, *, population_size: int = 20, **kwargs: Any) -> None:
        super().__init__(space, **kwargs)
        self.population_size = int(population_size)

    def make_sampler(self, seed: int):
        from optuna.samplers import NSGAIISampler

        return NSGAIISampler(seed=seed, population_size=self.population_size)

    def _system_attrs(self, sampler, complete: list[bool], running: int) -> list[dict[str, Any]]:
        """Generation of each rebuilt trial, as NSGA-II would have assigned it when the trial
        started: the current generation until it holds ``population_size`` complete trials
        (running trials count as not complete, as in Optuna)."""
        key = sampler._get_generation_key()
        gen, count, out = 0, 0, []
        for ok in [*complete, *([False] * running)]:
            if count >= self.population_size:
                gen, count = gen + 1, 0
            out.append({key: gen})
            count += int(ok)
        return out


@register_optimizer("optuna-gp")
class OptunaGPOptimizer(OptunaOptimizer):
    """Optuna's GP sampler (log-EHVI for several objectives)."""

    def make_sampler(self, seed: int):
        from optuna.samplers import GPSampler

        return GPSampler(seed=seed, n_startup_trials=self.n_startup_trials)
