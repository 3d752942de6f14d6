"""Ask/tell optimizers over a discrete candidate set (see :mod:`kvtune.search.optimizers.base`).

Registered names (:data:`OPTIMIZERS`): ``exhaustive``, ``random`` (:mod:`.simple`),
``kvserve`` (constrained BO, :mod:`.kvserve`), ``mobo`` (multi-objective BO, :mod:`.mobo`),
``optuna-tpe``, ``optuna-nsga2``, ``optuna-gp`` (:mod:`.optuna_samplers`).
"""

from kvtune.search.optimizers.base import OPTIMIZERS, Optimizer, make_optimizer, register_optimizer
from kvtune.search.optimizers import simple as _simple  # noqa: F401  (registers random, exhaustive)
from kvtune.search.optimizers import kvserve as _kvserve  # noqa: F401  (registers kvserve)
from kvtune.search.optimizers import mobo as _mobo  # noqa: F401  (registers mobo)
from kvtune.search.optimizers import optuna_samplers as _optuna  # noqa: F401  (registers optuna-tpe, -nsga2, -gp)

__all__ = ["OPTIMIZERS", "Optimizer", "make_optimizer", "register_optimizer"]
