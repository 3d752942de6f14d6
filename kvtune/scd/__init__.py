"""Semantic Cache Distillation (SCD): cross-model KV transfer from a producer to a consumer.

``BRIEF.md`` sec. 3. One concept per module:

- :mod:`kvtune.scd.consumer`: the reproducible LoRA consumer (``make_consumer``);
- :mod:`kvtune.scd.lowrank`: reduced-rank ridge maps (the Reuse math);
- :mod:`kvtune.scd.states`: per-layer states of a Llama-style decoder and its own K/V projections;
- :mod:`kvtune.scd.calibration`: fitting the Reuse / Patch maps, transition layers, artifacts;
- :mod:`kvtune.scd.methods`: ``recompute``, ``raw``, ``raw+tqc``, ``droidspeak``, ``scd`` (registry ``METHODS``);
- :mod:`kvtune.scd.profile`: ``run_scd_profile``, the trials and the policy table;
- :mod:`kvtune.scd.cli`: the ``kvtune scd`` Typer sub-app.
"""

from kvtune.scd.consumer import ConsumerInfo, ConsumerRecipe, make_consumer
from kvtune.scd.methods import METHODS, Pair, Transfer, TransferMethod, register_method
from kvtune.scd.profile import SCDMethod, SCDProfileSettings, run_scd_profile

__all__ = [
    "ConsumerInfo",
    "ConsumerRecipe",
    "make_consumer",
    "METHODS",
    "Pair",
    "Transfer",
    "TransferMethod",
    "register_method",
    "SCDMethod",
    "SCDProfileSettings",
    "run_scd_profile",
]
