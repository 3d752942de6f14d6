"""The profiling methods (``kvtune profile --method NAME``), one package each.

Adding a method is one package here: a :class:`kvtune.run.method.Method` subclass (its
settings class, ``prepare``, ``stages``, ``evaluate``, ``compile``) and, in the package's
``__init__``, its registration ``register_method(MyMethod())``. Importing this package imports
every sub-package, so every method is registered; the shared runner (:mod:`kvtune.run.runner`)
does the run folder, lock, trial store with resume, ask/tell loop, Pareto, tables and report.

- :mod:`kvtune.methods.tqc`: Transform -> Quantize -> Codec KV compression search (KVServe);
- :mod:`kvtune.methods.scd`: cross-model KV transfer (Semantic Cache Distillation);
- :mod:`kvtune.methods.bicache`: shared-prefix reuse depth for bidirectional encoders (BiCache).
"""

from __future__ import annotations

import importlib
import pkgutil

from kvtune.run.method import METHODS, Method, register_method

__all__ = ["METHODS", "Method", "register_method"]

for _info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
    if _info.ispkg:
        importlib.import_module(f"{__name__}.{_info.name}")
