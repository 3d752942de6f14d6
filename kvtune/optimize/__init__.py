"""Ask/tell optimizers over a discrete candidate set (see :mod:`kvtune.optimize.base`)."""

from kvtune.optimize.base import OPTIMIZERS, Optimizer, make_optimizer, register_optimizer
from kvtune.optimize import simple as _simple  # noqa: F401  (registers random, exhaustive)

__all__ = ["OPTIMIZERS", "Optimizer", "make_optimizer", "register_optimizer"]
