"""The shared runner: every method's run, resume, table compile and report, written once.

:func:`run_method` takes a registered :class:`~kvtune.run.method.Method`, its settings and a
run folder, and does, for every method alike:

1. lock the folder (:func:`kvtune.run.folder.open_run_folder`); stored trials without
   ``resume`` are an error; a resume of a complete run returns its stored outputs
   (:func:`complete_run_result`, no model); then check the settings (before any model loads);
   and the executor's (:meth:`kvtune.run.executors.base.Executor.check`: e.g. the Ray cluster
   is reachable);
2. start the executor (:meth:`~kvtune.run.executors.base.Executor.start`): it builds the
   method's context where the trials are evaluated (in-process: ``method.prepare`` here; Ray:
   in every actor at once, the driver loading no model and keeping the actor's
   :meth:`~kvtune.run.method.Method.driver_view`); then write ``run.json`` (``method``,
   ``settings``, ``reports``, ``executor`` and the method's
   :meth:`~kvtune.run.method.Method.run_info`);
3. for each of ``method.stages(context, stored)``: the ask/tell loop
   (:func:`kvtune.run.loop.ask_tell`) on the executor's pool, each new row numbered
   (``trial``, in order of completion), appended to ``trials.jsonl``
   (:class:`kvtune.run.store.TrialStore`) and told to the stage's optimizer; then
   ``method.finish(context)`` and the workers are released;
4. :func:`finalize_run`: compile, Pareto front, write every output.

:func:`finalize_run` is also ``kvtune report`` on any run folder; recompiling alone is :meth:`~kvtune.run.method.Method.compile_table` (``kvtune export --floors`` and ``kvtune select``
on a folder without a table).
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

from kvtune.core.atomic import atomic_write_parquet, atomic_write_text
from kvtune.core.jsonio import jsonable, strict_dumps
from kvtune.core.errors import ConfigError, KvtuneError
from kvtune.run.executors.base import Executor, InProcessExecutor, RunJob, Workers
from kvtune.run.folder import open_run_folder
from kvtune.run.loop import ask_tell
from kvtune.run.method import Compiled, Hooks, Method, ProfileRequest
from kvtune.run.store import TrialStore

__all__ = ["RunResult", "check_resume_request", "complete_run_result", "finalize_run", "report_file",
           "run_is_complete", "run_method", "run_request", "settings_digest", "stored_trial_count", "write_run_info"]


@dataclass
class RunResult:
    """What a finished run produced.

    Attributes:
        run_dir: the run folder; settings: its settings; info: its ``run.json``.
        trials: the flat trial rows (None for nested rows); pareto: the front; table: the table.
        files: written files by role; compiled: the method's :class:`Compiled`;
        context: the method's context as the driver held it (its
            :meth:`~kvtune.run.method.Method.driver_view` when the trials ran on remote
            workers; None after :func:`finalize_run` alone).
    """

    run_dir: Path
    settings: Any
    info: dict[str, Any]
    trials: pd.DataFrame | None
    pareto: pd.DataFrame
    table: Any
    files: dict[str, Path] = field(default_factory=dict)
    compiled: Compiled | None = None
    context: Any = None


def write_run_info(run_dir: Path, info: dict[str, Any]) -> Path:
    """Write ``run.json`` atomically (strict JSON: NaN/inf as strings)."""
    return atomic_write_text(run_dir / "run.json", strict_dumps(jsonable(info), indent=2, default=str))


def _previous_info(run_dir: Path) -> dict[str, Any]:
    """The ``run.json`` of a run being resumed ({} when it has none yet)."""
    from kvtune.tables.run import read_run_info

    return read_run_info(run_dir) if (run_dir / "run.json").is_file() else {}


def run_method(method: Method, settings: Any, run_dir: str | Path, *, resume: bool = False,
               reports: str | Path | None = None, hooks: Hooks = Hooks(), executor: Executor | None = None,
               **given: Any) -> RunResult:
    """Run (or resume) ``method`` into ``run_dir`` and write every output (module docstring).

    Args:
        settings: an instance of ``method.settings_class``.
        resume: continue the trials stored in ``run_dir`` (never evaluating a stored candidate
            of a stage again).
        reports: folder receiving ``<run>.html`` (None: ``<run_dir>/report.html``).
        executor: where trials are evaluated (None: :class:`InProcessExecutor`, one at a
            time); a resume may use another executor or workers count than the run began with.
        given: passed to :meth:`Method.prepare` (already loaded models; a Ray worker gets a
            pickled copy, the driver itself then uses none).

    A resume of a complete run (:func:`run_is_complete`) evaluates nothing and loads no model:
    it returns the stored outputs (:func:`complete_run_result`), writing again only those
    that are missing.

    Raises:
        KvtuneError (and subclasses): bad settings or an executor that cannot run (before
            anything loads: e.g. an unreachable Ray cluster), trials stored without ``resume``,
            a worker that fails (:class:`~kvtune.run.executors.base.ExecutorError`), or the
            method's own errors.
        RunLockedError: another process is working on the run folder.
    """
    run_dir = Path(run_dir)
    executor = executor or InProcessExecutor()
    t_start = time.perf_counter()
    with open_run_folder(run_dir):  # a folder nothing was written to is removed again
        store = TrialStore(run_dir, table=method.flat_trials)
        if store.log_path.exists() and not resume:
            raise KvtuneError(f"run folder {run_dir} already has trials; use --resume {run_dir} or another --run name")
        stored = store.load()
        previous = _previous_info(run_dir) if resume else {}
        if resume and run_is_complete(previous, len(stored)):  # nothing to evaluate: load no model, read no input
            hooks.say(f"{run_dir}: the run is complete ({len(stored)} trial records); nothing to resume")
            return complete_run_result(method, run_dir, previous, stored)
        previous.pop("complete", None)
        method.check(settings)
        executor.check(method, settings)
        if not resume:  # before the slow part: where the run lives, and how to continue it
            hooks.say(f"run folder: {run_dir} (if interrupted, continue with: kvtune profile --resume {run_dir})")
        workers = executor.start(RunJob(method, settings, run_dir, given, hooks))
        try:
            context = workers.context
            # a resume keeps what run.json held (timings, trial counts) until finalize replaces it
            info = {**previous, "method": method.name, "settings": settings.to_dict(), **method.run_info(context),
                    "reports": None if reports is None else str(reports), "executor": executor.describe()}
            write_run_info(run_dir, info)
            _run_stages(method, context, store, stored, hooks, workers)
            info.update(method.finish(context))
        finally:
            workers.close()
        hooks.on_stage("pareto + tables + report", 1)
        info["total_seconds"] = time.perf_counter() - t_start
        info["complete"] = settings_digest(info["settings"])
        result = finalize_run(method, run_dir, info=info)
        hooks.on_progress(1)
    result.context = context
    return result


def run_is_complete(info: dict[str, Any], records: int) -> bool:
    """Whether a run's ``run.json`` (``info``) says every stage ran for the settings it holds
    now (``complete``: :func:`settings_digest` of them; a run whose stored settings were
    edited since, e.g. a larger budget, is not complete) and its outputs were written from
    exactly the ``records`` trial records its log holds (``trial_records``)."""
    settings = info.get("settings")
    if not isinstance(settings, dict) or info.get("complete") != settings_digest(settings):
        return False
    return isinstance(info.get("trial_records"), int) and info["trial_records"] == records


def settings_digest(settings: dict[str, Any]) -> str:
    """16 hex characters of the SHA-256 of the settings' canonical JSON (``run.json``'s ``complete``)."""
    from kvtune.core.ids import policy_id
    from kvtune.core.jsonio import canonical_json

    return policy_id(canonical_json(jsonable(settings)), length=16)


def report_file(method: Method, run_dir: Path, info: dict[str, Any]) -> Path:
    """Where the run's HTML report goes: ``<reports folder>/<run>.html`` or ``<run_dir>/report.html``."""
    folder = method.reports_folder(info)
    return folder / f"{run_dir.name}.html" if folder is not None else run_dir / "report.html"


def complete_run_result(method: Method, run_dir: Path, info: dict[str, Any], records: list[dict[str, Any]]
                        ) -> RunResult:
    """The result of a complete run from its stored trials, compiled in memory (no model);
    when any output file is missing, :func:`finalize_run` writes them all again.

    Raises:
        KvtuneError: see :func:`finalize_run`.
    """
    compiled = method.compile_stored(run_dir, info, records=records)
    files = {"run": run_dir / "run.json", "pareto": run_dir / "pareto.parquet",
             "policy_table": run_dir / "policy_table.parquet", "policy_table_json": run_dir / "policy_table.json",
             **{name.split(".")[0]: run_dir / name for name in compiled.frames},
             **{name.replace(".", "_"): run_dir / name for name in compiled.texts},
             "report": report_file(method, run_dir, info)}
    if compiled.trials is not None:
        files["trials"] = run_dir / TrialStore.TABLE
    if not all(p.is_file() for p in files.values()):
        return finalize_run(method, run_dir, info=info)
    return RunResult(run_dir=run_dir, settings=method.stored_settings(run_dir, info), info=info,
                     trials=compiled.trials, pareto=compiled.pareto, table=compiled.table, files=files,
                     compiled=compiled)


def _run_stages(method: Method, context: Any, store: TrialStore, stored: list[dict[str, Any]], hooks: Hooks,
                workers: Workers) -> None:
    """Every stage's ask/tell loop on ``workers``' pools; new rows are numbered after the
    stored ones, in order of completion."""
    numbers = itertools.count(len(stored))

    def on_record(row: dict[str, Any]) -> None:
        row["trial"] = next(numbers)  # told to the optimizer with its number (its chronology)
        store.append(row)
        hooks.on_progress(1, info=method.describe_row(row))
        hooks.on_trial(row)

    for stage in method.stages(context, stored):
        hooks.on_stage(stage.title or stage.name, max(stage.budget - len(stage.done), 0))
        ask_tell(stage.optimizer, stage.candidates, budget=stage.budget, done=stage.done, on_record=on_record,
                 pool=workers.pool(stage))


def stored_trial_count(path: Path) -> int:
    """Rows of a stored ``trials.parquet`` (0 when it is missing or unreadable)."""
    import pyarrow.parquet as pq

    try:
        return int(pq.read_metadata(path).num_rows)
    except Exception:  # missing, truncated or not Parquet: nothing good to keep
        return 0


def finalize_run(method: Method, run_dir: str | Path, *, info: dict[str, Any] | None = None) -> RunResult:
    """Derive every output of a run from its trial store and write it: ``trials.parquet``
    (flat rows), ``pareto.parquet``, the method's extra frames and texts,
    ``policy_table.parquet``/``.json``, ``run.json`` and the HTML report. Everything is
    derived and checked in memory first; files are written only when all of it succeeded.
    Needs no model.

    Raises:
        KvtuneError: not a run folder, no ``run.json``, no trials, or trials that do not
            compile (the message names the file); a log holding fewer trial records than the
            last finalize counted (``trial_records`` in ``run.json``), or fewer trial rows than
            its ``trials`` or a ``trials.parquet`` holds (the log was cut: nothing is rewritten).
    """
    from kvtune.report.html import write_report
    from kvtune.tables.run import read_run_info

    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise KvtuneError(f"{run_dir}: not a folder (expected a run folder such as profiles/<run>)")
    with open_run_folder(run_dir, create=False):
        if info is None:
            info = read_run_info(run_dir)
        settings = method.stored_settings(run_dir, info)
        store = TrialStore(run_dir)
        stored_records = store.load()
        records = len(stored_records)
        counted = info.get("trial_records")
        if isinstance(counted, int) and records < counted:  # every method, whatever its frames
            raise KvtuneError(f"{store.log_path} holds {records} trial records but {run_dir / 'run.json'} counted "
                              f"{counted} when its outputs were last written: the log was cut or edited; restore "
                              "it (nothing was rewritten)")
        compiled = method.compile_stored(run_dir, info, records=stored_records)  # the log is read once
        sections = method.report_sections(run_dir, {**info, **compiled.info}, compiled)
        files: dict[str, Path] = {"run": run_dir / "run.json"}
        if compiled.trials is not None:
            stored = stored_trial_count(run_dir / TrialStore.TABLE)
            if len(compiled.trials) < stored:
                raise KvtuneError(f"{store.log_path} holds {len(compiled.trials)} trial records but "
                                  f"{run_dir / TrialStore.TABLE} holds {stored}: the log was cut or edited; "
                                  "restore it (nothing was rewritten)")
            rows = info.get("trials")  # the trial rows of the last finalize (run folders older than trial_records)
            if isinstance(rows, int) and not isinstance(rows, bool) and len(compiled.trials) < rows:
                raise KvtuneError(f"{store.log_path} holds {len(compiled.trials)} trial records but "
                                  f"{run_dir / 'run.json'} counted {rows} trials when its outputs were last written: "
                                  "the log was cut or edited; restore it (nothing was rewritten)")
            files["trials"] = store.write_table(compiled.trials)
        files["pareto"] = atomic_write_parquet(compiled.pareto, run_dir / "pareto.parquet")
        for name, frame in compiled.frames.items():
            files[name.split(".")[0]] = atomic_write_parquet(frame, run_dir / name)
        for name, text in compiled.texts.items():
            files[name.replace(".", "_")] = atomic_write_text(run_dir / name, text)
        files["policy_table"] = compiled.table.to_parquet(run_dir / "policy_table.parquet")
        files["policy_table_json"] = compiled.table.to_json(run_dir / "policy_table.json")
        info.update(compiled.info)
        info["trial_records"] = records
        write_run_info(run_dir, info)
        files["report"] = write_report(compiled.points if compiled.shown is None else compiled.shown, compiled.pareto,
                                       compiled.table, report_file(method, run_dir, info),
                                       title=f"{method.report_title}: {run_dir.name}", run_config=info, sections=sections)
    return RunResult(run_dir=run_dir, settings=settings, info=info, trials=compiled.trials, pareto=compiled.pareto,
                     table=compiled.table, files=files, compiled=compiled)


def run_request(method: Method, request: ProfileRequest, executor: Executor | None = None) -> RunResult:
    """``kvtune profile --method X``: a new run from the common options and ``--set`` values
    (folder ``<out>/<run or the method's default name>``), or ``request.resume``'s run with
    its stored settings (:func:`check_resume_request` first); ``executor``: see
    :func:`run_method`.

    Raises:
        KvtuneError: see :func:`run_method`; an unsafe run name, a bad ``--set``, a resume
            folder without a readable ``run.json``.
        ConfigError: ``--set`` values with a resume; see :func:`check_resume_request`.
    """
    from kvtune.run.folder import check_out_folder, check_run_name
    from kvtune.tables.run import read_run_info

    if request.resume is not None:
        if request.options:
            raise ConfigError(f"--resume {request.resume} continues with the settings stored in its run.json; "
                              f"--set {', '.join(sorted(request.options))} cannot change them (start a new --run)")
        info = read_run_info(request.resume)
        check_resume_request(method, request, info)
        settings = method.stored_settings(request.resume, info)
        reports = info.get("reports") or request.reports
        return run_method(method, settings, request.resume, resume=True, reports=reports, hooks=request.hooks,
                          executor=executor)
    settings = method.settings_for(request)
    check_out_folder(request.out_folder, "--out")
    check_out_folder(request.reports_folder, "--reports")
    run_dir = request.out_folder / check_run_name(request.run or method.run_name(settings))
    return run_method(method, settings, run_dir, reports=request.reports_folder, hooks=request.hooks,
                      executor=executor)


def check_resume_request(method: Method, request: ProfileRequest, info: dict[str, Any]) -> None:
    """A ``--resume`` continues its run as stored: what the request gives besides the folder
    must agree with the run, never be silently ignored.

    Args:
        method: the method asked for (``--method``, or the run's own when not given).
        request: ``resume`` is the run folder; ``model``, ``out``, ``reports``, ``run`` are
            checked when given (not None / not ""); ``options`` (``--set``) are refused by
            :func:`run_request` before the folder is read.
        info: the run's ``run.json``.

    Raises:
        ConfigError: the run was made by another method, or a ``--model``,
            ``--out``, ``--reports`` or ``--run`` that differs from the run's.
    """
    run_dir = Path(request.resume)
    made_by = info.get("method") or "tqc"
    if made_by != method.name:
        raise ConfigError(f"--resume {run_dir} is a {made_by} run; --method {method.name} cannot continue it "
                          f"(leave --method out)")
    reports = method.reports_folder(info)
    checks = [("--run", request.run or None, run_dir.name, False),
              ("--out", request.out, run_dir.parent, True),
              ("--reports", request.reports, "(its run folder)" if reports is None else reports, reports is not None),
              ("--model", request.model, method.model_spec(info), True)]
    for flag, given, stored, path_like in checks:
        if given is None or stored is None or _same(given, stored, path_like):
            continue
        raise ConfigError(f"--resume {run_dir} continues a run with {flag} {stored}; {flag} {given} disagrees "
                          "(leave it out, or start a new --run)")


def _same(given: Any, stored: Any, path_like: bool) -> bool:
    """Equal as given, or (``path_like``) naming the same existing or future path."""
    if str(given) == str(stored):
        return True
    return path_like and Path(given).expanduser().resolve() == Path(stored).expanduser().resolve()
