"""What a profiling method supplies to the shared runner (:mod:`kvtune.run.runner`).

A method (T/Q/C compression ``tqc``, SCD cross-model transfer ``scd``, BiCache shared-prefix
reuse ``bicache``) is one package in :mod:`kvtune.methods` holding a :class:`Method` subclass
and its registration (:func:`register_method`, in the package's ``__init__``). It declares:

- ``settings_class``: its frozen, versioned settings (:class:`kvtune.run.settings.RunSettings`);
- :meth:`Method.prepare`: build the run's context once (load models, capture, calibrate)
  where the trials are evaluated: in the driver's process, or in each remote worker;
- :meth:`Method.driver_view`: the light, picklable part of that context the driver needs
  when the trials are evaluated remotely (what ``stages``, ``run_info`` and ``finish`` read);
- :meth:`Method.stages`: its candidates, as one or more ask/tell :class:`Stage` s (a fixed list
  uses the ``exhaustive`` optimizer);
- :meth:`Method.evaluate`: ``evaluate(context, candidate, stage) -> trial row``;
- :meth:`Method.compile`: the rows its Pareto front and table are built on, the table
  (floors, keys, ``include_none``, extra columns) and any extra frames;
- :meth:`Method.report_sections` (optional): its own sections of the HTML report (plots
  and tables drawn from the compiled frames).

The runner does the rest, the same way for every method: the run folder and its lock,
``run.json``, the trial store with resume, the ask/tell loop, Pareto, the table files and the
HTML report.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

from kvtune.core.registry import Registry

__all__ = ["DEFAULT_OUT", "DEFAULT_REPORTS", "METHODS", "Compiled", "Hooks", "Method", "ProfileRequest", "Stage",
           "register_method"]


def _noop(*_: Any, **__: Any) -> None:
    return None


@dataclass(frozen=True)
class Hooks:
    """Progress callbacks of a run.

    Attributes:
        on_stage: ``on_stage(name, total)`` when a stage with ``total`` steps starts.
        on_progress: ``on_progress(n=1, info="")`` after each step of the current stage.
        say: one-line messages.
        on_trial: called with each new trial row after it is stored.
    """

    on_stage: Callable[..., None] = _noop
    on_progress: Callable[..., None] = _noop
    say: Callable[[str], None] = _noop
    on_trial: Callable[[dict[str, Any]], None] = _noop


@dataclass(frozen=True)
class ProfileRequest:
    """The options every ``kvtune profile --method X`` shares, plus the method's own settings.

    Attributes:
        model: ``--model`` (None: the method's default model).
        out: folder receiving the run folder (None: :data:`DEFAULT_OUT`); reports: folder
            receiving the HTML report (None: :data:`DEFAULT_REPORTS`).
        run: run name ("" = the method's default name); resume: a run folder to continue
            (``model``, ``out``, ``reports`` and ``run``, when given, must agree with it).
        device: ``auto``, ``cpu`` or ``cuda``; seed: seeds every random choice.
        options: the method's settings as ``name -> text`` (``--set name=value``), converted
            with :func:`kvtune.run.settings.parse_overrides`.
        hooks: progress callbacks.
    """

    model: str | None = None
    out: Path | None = None
    reports: Path | None = None
    run: str = ""
    resume: Path | None = None
    device: str = "auto"
    seed: int = 0
    options: Mapping[str, str] = field(default_factory=dict)
    hooks: Hooks = Hooks()

    @property
    def out_folder(self) -> Path:
        """``out``, or :data:`DEFAULT_OUT` when not given."""
        return DEFAULT_OUT if self.out is None else self.out

    @property
    def reports_folder(self) -> Path:
        """``reports``, or :data:`DEFAULT_REPORTS` when not given."""
        return DEFAULT_REPORTS if self.reports is None else self.reports


DEFAULT_OUT = Path("profiles")
"""Folder receiving new run folders when ``--out`` is not given."""
DEFAULT_REPORTS = Path("reports")
"""Folder receiving HTML reports when ``--reports`` is not given."""


@dataclass(frozen=True)
class Stage:
    """One ask/tell pass over some of a method's candidates.

    Attributes:
        name: the stage (``search``, ``refine``, ``baselines``, ``buckets``...), passed to
            :meth:`Method.evaluate` and shown as progress.
        candidates: the candidates (each with ``policy_id`` and ``index``).
        optimizer: a :class:`kvtune.search.optimizers.Optimizer` over them.
        budget: total evaluations wanted in this stage, stored ones included.
        done: this stage's stored trial rows by ``policy_id`` (told, not evaluated again).
        title: the progress line of the stage (default: ``name``).
    """

    name: str
    candidates: Sequence[Any]
    optimizer: Any
    budget: int
    done: Mapping[str, dict[str, Any]] = field(default_factory=dict)
    title: str = ""


@dataclass
class Compiled:
    """What :meth:`Method.compile` derives from a run's stored trials (nothing written yet).

    Attributes:
        trials: the trial rows as a flat frame (``trials.parquet``), or None when the rows
            are nested (BiCache's one record per bucket).
        points: the rows the Pareto front is built on (also the report's trials).
        table: the :class:`~kvtune.tables.policy_table.PolicyTable`.
        frames: extra Parquet files ``{file name: frame}``.
        texts: extra text files ``{file name: text}``.
        info: keys added to ``run.json``.
        pareto: the front of ``points`` (filled in by the runner when None).
        shown: the report's trial rows (None: ``points``).
    """

    trials: pd.DataFrame | None
    points: pd.DataFrame
    table: Any
    frames: dict[str, pd.DataFrame] = field(default_factory=dict)
    texts: dict[str, str] = field(default_factory=dict)
    info: dict[str, Any] = field(default_factory=dict)
    pareto: pd.DataFrame | None = None
    shown: pd.DataFrame | None = None


class Method:
    """A registered profiling method; subclass it in ``kvtune/methods/<name>/``.

    Class attributes:
        name: ``--method`` value, also the ``method`` of its ``run.json``.
        description: one line for ``--help``.
        settings_class: the settings dataclass; its field names are the ``--set`` names.
        flat_trials: trial rows form a flat table (``trials.parquet`` is kept up to date).
        report_title: the report's title prefix.
    """

    name: str = ""
    description: str = ""
    settings_class: type = object
    flat_trials: bool = True
    report_title: str = "kvtune profile"

    # ------------------------------------------------------------------ settings and names

    def settings_for(self, request: ProfileRequest) -> Any:
        """The settings of a new run from the common options and ``--set`` values."""
        from kvtune.run.settings import parse_overrides

        return self.settings_class(**parse_overrides(self.settings_class, request.options))

    def run_name(self, settings: Any) -> str:
        """Default run folder name."""
        return self.name

    def check(self, settings: Any) -> None:
        """Fail before any model loads on settings that cannot work (typed errors)."""

    def check_workers(self, settings: Any, workers: int) -> None:
        """Fail before any model loads when ``workers`` processes on this machine, each
        building a context, cannot fit (an executor calls it for the workers it starts here;
        :meth:`check` covers one). Default: nothing to check."""

    def stored_settings(self, run_dir: Path, info: Mapping[str, Any]) -> Any:
        """The settings stored in a run's ``run.json`` (``info``), read as this method's.

        Raises:
            KvtuneError (or the settings class's subclass of it): no ``settings`` object, keys
                that are not settings of this method (the run belongs to another method: was
                ``run.json``'s ``method`` edited?), or values the settings class refuses; the
                message names the file.
        """
        import dataclasses

        from kvtune.core.errors import KvtuneError

        path = Path(run_dir) / "run.json"
        stored = info.get("settings")
        if not isinstance(stored, dict):
            raise KvtuneError(f"{path}: no 'settings' object; is it a kvtune run.json?")
        foreign = sorted(set(stored) - {f.name for f in dataclasses.fields(self.settings_class)})
        if foreign:
            raise KvtuneError(f"{path}: its settings are not {self.name} settings (keys {foreign} are not {self.name} "
                              f"settings; was its 'method' {info.get('method')!r} edited?)")
        try:
            return self.settings_class.from_dict(stored)
        except KvtuneError as exc:
            raise type(exc)(f"{path}: {exc}") from None

    # ------------------------------------------------------------------ the run

    def prepare(self, settings: Any, run_dir: Path, hooks: Hooks, *, parts: Sequence[Any] | None = None,
                **given: Any) -> Any:
        """Build the run's context once (load models, build requests, capture, calibrate).

        ``given``: already loaded objects (tests pass tiny models; a worker passes what its
        :meth:`prepare_part` returned). Runs with the folder locked (in-process), or in a
        remote worker with ``run_dir`` its scratch folder holding copies of the run folder's
        JSON files (the files it writes there are then copied into the run folder:
        :mod:`kvtune.run.executors.ray_executor`). ``parts``: every part of
        :meth:`prepare_part` (built on several workers), used instead of computing them.
        """
        raise NotImplementedError

    def setup_parts(self, settings: Any, workers: int) -> int:
        """Parts the setup of a run on ``workers`` workers splits into: each worker builds one
        (:meth:`prepare_part`) and then its context from all of them (``prepare(parts=...)``).
        1 (this default): not split, each worker runs :meth:`prepare` alone."""
        return 1

    def prepare_part(self, settings: Any, run_dir: Path, hooks: Hooks, index: int, count: int,
                     **given: Any) -> tuple[Any, dict[str, Any]]:
        """Part ``index`` of ``count`` (:meth:`setup_parts`) of the setup: ``(part, given)``,
        the part (picklable, sent to every worker) and objects for this worker's own
        :meth:`prepare` (e.g. the model it loaded).

        Raises:
            NotImplementedError: a method whose setup does not split.
        """
        raise NotImplementedError(f"method {self.name!r}: its setup does not split into parts")

    def driver_view(self, context: Any) -> Any:
        """What the driver keeps of a context built by a remote worker: everything
        :meth:`stages`, :meth:`run_info`, :meth:`finish` and :meth:`describe_row` read, nothing
        only :meth:`evaluate` needs (models, captured KV, baselines). It is pickled back to the
        driver, which never calls :meth:`evaluate` or :meth:`close` on it.

        Default: the context itself (for a method whose context is already light); a method
        whose context holds models returns a copy without them.
        """
        return context

    def context_fingerprint(self, context: Any) -> str:
        """A digest of what a candidate means in this context (e.g. T/Q/C: the policy ids of
        the calibrated space): remote workers whose fingerprints differ would evaluate the
        driver's candidates with other calibrations, and the run stops. Default: "" (nothing
        calibrated per worker)."""
        return ""

    def run_info(self, context: Any) -> dict[str, Any]:
        """Keys of ``run.json`` known once the context is built (written before the first
        trial); ``context`` may be a :meth:`driver_view`."""
        return {}

    def stages(self, context: Any, stored: list[dict[str, Any]]) -> Iterator[Stage]:
        """The ask/tell stages, in order; ``stored``: the trial rows already in the store;
        ``context`` may be a :meth:`driver_view`.

        A generator: a later stage may depend on the trials of an earlier one (they are in
        the store by the time it is asked for).
        """
        raise NotImplementedError

    def evaluate(self, context: Any, candidate: Any, stage: Stage) -> dict[str, Any]:
        """One trial row for ``candidate`` (the runner adds its ``trial`` number when it stores the row, in order of completion)."""
        raise NotImplementedError

    def describe_row(self, row: dict[str, Any]) -> str:
        """One progress line for a finished trial row."""
        return str(row.get("label") or row.get("policy_id") or "")

    def finish(self, context: Any) -> dict[str, Any]:
        """Keys added to ``run.json`` after the last stage (timings, calibration summary...);
        ``context`` may be a :meth:`driver_view`."""
        return {}

    def close(self, context: Any) -> None:
        """Release what :meth:`prepare` set up (threads, files)."""

    # ------------------------------------------------------------------ outputs

    def compile(self, run_dir: Path, info: dict[str, Any], records: list[dict[str, Any]],
                floors: Sequence[float] | None = None) -> Compiled:
        """Derive the table (and extra outputs) from the stored rows; ``floors`` None: the run's.

        Raises:
            KvtuneError: rows that cannot be compiled (the runner adds the trial log's name).
        """
        raise NotImplementedError

    def compile_stored(self, run_dir: Path, info: dict[str, Any], floors: Sequence[float] | None = None, *,
                       records: list[dict[str, Any]] | None = None) -> Compiled:
        """:meth:`compile` of the rows in ``<run_dir>/trials.jsonl`` (``records``: those rows,
        already loaded by the caller), with the Pareto front of its points filled in.

        Raises:
            KvtuneError: settings of another method (:meth:`stored_settings`), no trials, or
                rows that do not compile; the message names the file.
        """
        from kvtune.core.errors import KvtuneError
        from kvtune.search.pareto import pareto_front
        from kvtune.run.store import TrialStore

        self.stored_settings(run_dir, info)  # a run of another method never compiles as this one
        store = TrialStore(run_dir, table=False)
        if records is None:
            records = store.load()
        if not records:
            raise KvtuneError(f"{run_dir}: no finished trials yet")
        try:
            compiled = self.compile(run_dir, info, records, floors)
        except KeyError as exc:
            raise KvtuneError(f"{store.log_path}: trial records lack column {exc}") from None
        except KvtuneError as exc:
            if str(store.log_path) in str(exc):
                raise
            raise type(exc)(f"{store.log_path}: {exc}") from None
        if compiled.pareto is None:
            compiled.pareto = pareto_front(compiled.points)
        return compiled

    def compile_table(self, run_dir: Path, info: dict[str, Any], floors: Sequence[float] | None = None) -> Any:
        """The run's table compiled again (``kvtune export --floors/--recompile``, ``select`` on a
        folder without a table); nothing written. Default: from the stored trials."""
        return self.compile_stored(run_dir, info, floors).table

    def report_sections(self, run_dir: Path, info: dict[str, Any], compiled: Compiled) -> list[Any]:
        """The method's own sections of the HTML report
        (:class:`kvtune.report.sections.ReportSection` s, drawn after the shared charts), from
        the compiled run (``compiled.points``, ``compiled.trials``, ``compiled.frames``,
        ``compiled.table``); default none. Needs no model.

        Raises:
            KvtuneError: stored rows lack what a section draws (the runner adds the run folder).
        """
        return []

    def model_spec(self, info: Mapping[str, Any]) -> str | None:
        """The ``--model`` spec a run was made with (its ``run.json`` settings' ``model``;
        None when it records none), compared with a ``--model`` given with ``--resume``."""
        model = (info.get("settings") or {}).get("model")
        return model if isinstance(model, str) else None

    def reports_folder(self, info: dict[str, Any]) -> Path | None:
        """Where the run's report goes (``<folder>/<run>.html``); None: ``<run_dir>/report.html``."""
        reports = info.get("reports")
        return Path(reports) if isinstance(reports, str) else None


METHODS: Registry[Method] = Registry("method")
"""``--method`` name -> :class:`Method`; filled when :mod:`kvtune.methods` is imported (each
method package registers itself)."""


def register_method(method: Method) -> Method:
    """Add ``method`` to :data:`METHODS` under ``method.name``; return it.

    Raises:
        DuplicateNameError: another method already has that name.
    """
    return METHODS.register(method.name, method)
