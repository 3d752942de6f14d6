"""Workloads: real tasks whose context KV crosses the wire compressed (``--workload``).

Each workload is one small class in :data:`WORKLOADS` (kvpress-style registry):

============== =============================== ============================ =========================================
name           data (default)                  full-fidelity score          cheap-fidelity score (teacher-forced)
============== =============================== ============================ =========================================
continuation   essays (``--text``)             perplexity ratio             same, fewer contexts
qa             NarrativeQA (``narrativeqa``)   generated answer F1          likelihood of the original run's answer
boolq          BoolQ (``boolq``)               yes/no accuracy              p(the original run's yes/no decision)
needle         essays + random 5-digit key     passkey retrieval accuracy   likelihood of the passkey
summarize      XSum (``xsum``)                 ROUGE-L of generated summary likelihood of the original run's summary
============== =============================== ============================ =========================================

Cheap scores of generative tasks use the original run's own output, not the reference:
on SmolLM2-135M the references' likelihood rose with a broken cache (see
:class:`~kvtune.evaluate.workloads.base.OwnAnswerMixin`); references are still reported.

Example::

    >>> from kvtune.methods.tqc.settings import ProfileSettings
    >>> wl = make_workload("qa", lm, settings=ProfileSettings(workload="qa"))  # doctest: +SKIP
    >>> row = wl.evaluate(PolicyConfig.kivi(4), fidelity="cheap")               # doctest: +SKIP
    >>> row["relative_accuracy_lo"], row["compression_ratio"]                   # doctest: +SKIP

See :mod:`kvtune.evaluate.workloads.base` for what one evaluation does and
:mod:`kvtune.evaluate.workloads.data` for the JSONL format of user data.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Callable

from kvtune.core.errors import KvtuneError
from kvtune.evaluate.metrics import spearman
from kvtune.evaluate.model import LoadedModel
from kvtune.evaluate.workloads.base import FIDELITIES, PROMPT_FORMATS, WORKLOADS, Sample, Workload, register
from kvtune.evaluate.workloads.data import DataError, Field, read_jsonl
from kvtune.evaluate.workloads.settings import WorkloadSettings

# imported in the order the registry lists them (``--workload`` help, error messages)
from kvtune.evaluate.workloads.continuation import ContinuationWorkload  # isort: skip
from kvtune.evaluate.workloads.qa import QAWorkload  # isort: skip
from kvtune.evaluate.workloads.boolq import BoolQWorkload  # isort: skip
from kvtune.evaluate.workloads.needle import NeedleWorkload  # isort: skip
from kvtune.evaluate.workloads.summarize import SummarizeWorkload  # isort: skip

__all__ = [
    "WORKLOADS",
    "FIDELITIES",
    "PROMPT_FORMATS",
    "Workload",
    "Sample",
    "register",
    "make_workload",
    "workload_sample_counts",
    "workload_part_count",
    "build_workload_part",
    "spearman",
    "DataError",
    "Field",
    "read_jsonl",
    "WorkloadSettings",
    "ContinuationWorkload",
    "QAWorkload",
    "BoolQWorkload",
    "NeedleWorkload",
    "SummarizeWorkload",
]


def _workload_class(name: str) -> type[Workload]:
    if name not in WORKLOADS:
        raise KvtuneError(f"unknown workload {name!r}; known workloads: {', '.join(WORKLOADS)}")
    return WORKLOADS[name]


def workload_sample_counts(name: str, settings: WorkloadSettings) -> tuple[int, int]:
    """``(full, cheap)`` sample counts the workload will use with these settings (for progress bars).

    Raises:
        KvtuneError: unknown workload, invalid counts, or settings without the workload fields.
    """
    return _workload_class(name).sample_counts(settings)


def make_workload(name: str, lm: LoadedModel, *, settings: WorkloadSettings,
                  progress: Callable[[int], None] | None = None, parts: Sequence[Any] | None = None) -> Workload:
    """Build a workload: load its data, prefill every sample, compute the cheap baseline.

    Args:
        name: a key of :data:`WORKLOADS`.
        lm: the loaded model.
        settings: the run settings (a :class:`~kvtune.methods.tqc.settings.ProfileSettings` has the
            :class:`~kvtune.evaluate.workloads.settings.WorkloadSettings` fields).
        progress: optional ``progress(n)`` called after each prefilled sample
            (``workload_sample_counts(name, settings)[0]`` calls in total).
        parts: the setup built in parts on several workers (:func:`build_workload_part`),
            assembled instead of computed.

    Raises:
        KvtuneError: unknown workload, bad settings, ``parts`` for a workload whose setup does
            not split; DataError: bad data; AssetError: assets; PartError: parts of other settings.
    """
    cls = _workload_class(name)
    if parts is None:
        return cls(lm, settings=settings, progress=progress)
    if not hasattr(cls, "build_part"):
        raise KvtuneError(f"workload {name!r}: its setup does not split into parts")
    return cls(lm, settings=settings, progress=progress, parts=parts)


def workload_part_count(name: str, settings: WorkloadSettings, workers: int) -> int:
    """Parts the workload's setup splits into for ``workers`` workers (1: not split;
    :mod:`kvtune.evaluate.workloads.parts`).

    Raises:
        KvtuneError: unknown workload, invalid counts.
    """
    return _workload_class(name).part_count(settings, workers)


def build_workload_part(name: str, lm: LoadedModel, *, settings: WorkloadSettings, index: int, count: int,
                        progress: Callable[[int], None] | None = None) -> Any:
    """Part ``index`` of ``count`` of the workload's setup (e.g.
    :meth:`ContinuationWorkload.build_part`), for :func:`make_workload`'s ``parts``.

    Raises:
        KvtuneError: unknown workload, or one whose setup does not split
            (``workload_part_count(...) == 1``).
    """
    cls = _workload_class(name)
    if not hasattr(cls, "build_part"):
        raise KvtuneError(f"workload {name!r}: its setup does not split into parts")
    return cls.build_part(lm, settings, index, count, progress)
