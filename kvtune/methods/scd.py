"""``--method scd``: cross-model KV transfer from a base producer to a fine-tuned consumer
(SCD, "Semantic Cache Distillation: Efficient State Transfer via Reuse and Selective
Patching", arXiv 2606.07684): :class:`kvtune.scd.profile.SCDMethod` on the shared runner."""

from __future__ import annotations

from kvtune.scd.profile import SCDMethod

METHOD = SCDMethod()
