"""Semantic Cache Distillation (SCD): cross-model KV transfer from a producer to a consumer.

SCD, "Semantic Cache Distillation: Efficient State Transfer via Reuse and Selective Patching",
arXiv 2606.07684. One concept per module:

- :mod:`kvtune.methods.scd.consumer`: the reproducible LoRA consumer (``make_consumer``);
- :mod:`kvtune.methods.scd.lowrank`: reduced-rank ridge maps (the Reuse math);
- :mod:`kvtune.methods.scd.states`: per-layer states of a Llama-style decoder and its own K/V projections;
- :mod:`kvtune.methods.scd.calibration`: fitting the Reuse / Patch maps, transition layers, artifacts;
- :mod:`kvtune.methods.scd.methods`: ``recompute``, ``raw``, ``raw+tqc``, ``droidspeak``, ``scd`` (registry ``METHODS``);
- :mod:`kvtune.methods.scd.profile`: ``run_scd_profile``, the trials and the policy table;
- :mod:`kvtune.methods.scd.cli`: the ``kvtune scd`` Typer sub-app.
"""

from kvtune.methods.scd.consumer import ConsumerInfo, ConsumerRecipe, make_consumer
from kvtune.methods.scd.methods import METHODS, Pair, Transfer, TransferMethod, register_method
from kvtune.methods.scd.profile import SCDMethod, SCDProfileSettings, run_scd_profile
from kvtune.run.method import register_method as register_run_method

METHOD = register_run_method(SCDMethod())

__all__ = [
    "METHOD",
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
