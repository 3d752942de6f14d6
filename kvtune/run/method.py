"""What a profiling method supplies to the shared run machinery.

A method (T/Q/C compression ``tqc``, SCD cross-model transfer ``scd``, BiCache shared-prefix
reuse ``bicache``) is one module in :mod:`kvtune.methods` registering a :class:`Method`:
its settings class, how to run (or resume) a profile into a run folder, and how to rebuild
its policy table and report from a finished run folder. The run folder itself (name, lock,
``run.json`` with ``method`` and ``settings``, ``trials.jsonl`` with resume), the ask/tell
loop (:mod:`kvtune.run.loop`), the table compiler (:mod:`kvtune.tables.policy_table`),
``select``, ``export`` and ``report`` are shared.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["Method", "ProfileRequest"]


def _noop(*_: Any, **__: Any) -> None:
    return None


@dataclass(frozen=True)
class ProfileRequest:
    """The options every ``kvtune profile --method X`` shares, plus the method's own settings.

    Attributes:
        model: ``--model`` (None: the method's default model).
        out: folder receiving the run folder; reports: folder receiving the HTML report.
        run: run name ("" = the method's default name); resume: a run folder to continue.
        device: ``auto``, ``cpu`` or ``cuda``; seed: seeds every random choice.
        options: the method's settings as ``name -> text`` (``--set name=value``), converted
            with :func:`kvtune.run.settings.parse_overrides`.
        on_stage: ``on_stage(name, total)``; on_progress: ``on_progress(n=1, info="")``;
        say: one-line messages.
    """

    model: str | None = None
    out: Path = Path("profiles")
    reports: Path = Path("reports")
    run: str = ""
    resume: Path | None = None
    device: str = "auto"
    seed: int = 0
    options: Mapping[str, str] = field(default_factory=dict)
    on_stage: Callable[..., None] = _noop
    on_progress: Callable[..., None] = _noop
    say: Callable[[str], None] = _noop


@dataclass(frozen=True)
class Method:
    """A registered profiling method.

    Attributes:
        name: ``--method`` value, also the ``method`` of its ``run.json``.
        description: one line for ``--help``.
        settings_class: the method's settings (a frozen, versioned dataclass with
            ``to_dict``/``from_dict``); its field names are the ``--set`` names.
        profile: ``profile(request) -> run folder``: run or resume (``request.resume``) a
            profile, writing trials, ``run.json``, the policy table and the HTML report.
        compile_table: ``compile_table(run_dir, run_info, floors) -> PolicyTable``: the run's
            table compiled again from its stored trials (``floors`` None: the run's floors);
            used by ``export --floors/--recompile`` and ``select`` on a folder without a table.
        finalize: ``finalize(run_dir) -> files``: rebuild the table and the report from the
            stored trials (``kvtune report``); returns ``{name: path}``.
        table_floors: names of the settings field holding the table's floors.
    """

    name: str
    description: str
    settings_class: type
    profile: Callable[[ProfileRequest], Path]
    compile_table: Callable[[Path, dict[str, Any], Sequence[float] | None], Any]
    finalize: Callable[[Path], dict[str, Path]]
