"""The settings a workload reads, as a typed protocol.

Workloads are built from a run's :class:`kvtune.methods.tqc.settings.ProfileSettings`, which has these
fields (and more). The protocol names only what the workloads read, so this package does not
import :mod:`kvtune.methods.tqc.settings` (which sits above the evaluation layer), and a settings object
that lacks a field, or holds a value of the wrong type, is refused when the workload is built
instead of being read through a silent default.
"""

from __future__ import annotations

from typing import Protocol, get_type_hints, runtime_checkable

from kvtune.core.errors import KvtuneError

__all__ = ["WorkloadSettings", "checked_settings"]


@runtime_checkable
class WorkloadSettings(Protocol):
    """What a workload reads from the run settings (see :class:`kvtune.methods.tqc.settings.ProfileSettings`
    for their meaning and defaults).

    Attributes:
        text: ``--text`` essays (``continuation``, ``needle``).
        data: ``--data`` dataset (``qa``, ``boolq``, ``summarize``; ``""`` = the default asset).
        samples, cheap_samples: samples at full / cheap fidelity (0 = the workload's default).
        contexts: legacy ``--contexts`` (``continuation``'s full count when ``samples`` is 0).
        context_tokens: context length in tokens; continuation_tokens: scored tokens.
        max_new_tokens: generation budget at full fidelity (0 = the workload's default).
        kv_dtype: ``model`` or ``bfloat16``; prompt_format: ``auto``, ``chat`` or ``plain``.
    """

    text: str
    data: str
    samples: int
    cheap_samples: int
    contexts: int
    context_tokens: int
    continuation_tokens: int
    max_new_tokens: int
    kv_dtype: str
    prompt_format: str


def checked_settings(settings: object) -> WorkloadSettings:
    """``settings`` itself, once every :class:`WorkloadSettings` field is present with its type.

    Raises:
        KvtuneError: a field is missing or of another type (a bool is not an int); the message
            names every such field.
    """
    wrong = []
    for name, kind in get_type_hints(WorkloadSettings).items():
        value = getattr(settings, name, None)
        if not isinstance(value, kind) or isinstance(value, bool):
            wrong.append(f"{name} ({kind.__name__}, got {value!r})")
    if wrong:
        raise KvtuneError(f"workload settings {type(settings).__name__}: missing or mistyped {', '.join(wrong)}")
    return settings  # type: ignore[return-value]  # checked field by field above
