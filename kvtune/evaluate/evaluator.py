"""Evaluation of one policy on captured real KV: the former entry point, kept for compatibility.

The evaluation itself now lives in the workloads (:mod:`kvtune.evaluate.workloads`):
:class:`ContinuationEvaluator` is a thin wrapper over the ``continuation`` workload that
evaluates every context of a :class:`~kvtune.evaluate.capture.Capture` at full fidelity,
which gives exactly the numbers this class gave before the workloads existed (plus the new
columns ``relative_accuracy_raw``, ``score``, ``score_base``, ``score_name``, ``workload``,
``fidelity`` and ``samples``; ``relative_accuracy`` is now reported as 1.0 when it is above
1.0 inside its interval).
"""

from __future__ import annotations

from typing import Any

from kvtune.codecs import PolicyConfig
from kvtune.evaluate.capture import Capture
from kvtune.evaluate.model import LoadedModel
from kvtune.evaluate.workloads.base import median_after_warmup
from kvtune.evaluate.workloads.continuation import ContinuationWorkload, roundtrip_contexts

__all__ = ["ContinuationEvaluator", "median_after_warmup", "roundtrip_contexts"]


class ContinuationEvaluator:
    """Scores policies on the ``continuation`` workload of a :class:`Capture`.

    Args:
        lm: the model the KV was captured from.
        cap: contexts, their KV and the baseline continuation logits.
    """

    workload = "continuation"

    def __init__(self, lm: LoadedModel, cap: Capture) -> None:
        self.lm = lm
        self.cap = cap
        self._workload = ContinuationWorkload(lm, settings=None, cap=cap)

    def evaluate(self, config: PolicyConfig) -> dict[str, Any]:
        """Evaluate one policy on all contexts (``fidelity="full"``); see
        :meth:`ContinuationWorkload.evaluate` for the row."""
        return self._workload.evaluate(config, fidelity="full")
