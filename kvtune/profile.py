"""``kvtune profile`` as a Python API: capture real KV, search policies, write every output.

A run lives in ``<out>/<run>/``:

- ``run.json``: the :class:`ProfileSettings`, model geometry, library versions, timings;
- ``trials.jsonl`` / ``trials.parquet``: one row per evaluated policy (see :mod:`kvtune.store`);
- ``pareto.parquet``: the 3-D non-dominated set (relative accuracy up, compression ratio up,
  codec seconds per GB down);
- ``policy_table.parquet`` / ``policy_table.json``: the lower envelope over x = 1/B of the Pareto
  policies, per accuracy floor (:mod:`kvtune.tables`);

and the report is ``<reports>/<run>.html``.
"""

from __future__ import annotations

import itertools
import json
import platform
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd
import torch

from kvtune import __version__
from kvtune.errors import KvtuneError
from kvtune.evaluate.calibrate import HeadScores, calibrate_head_scores
from kvtune.evaluate.metrics import spearman
from kvtune.assets import read_texts
from kvtune.evaluate.workloads import FIDELITIES, PROMPT_FORMATS, WORKLOADS, make_workload, workload_sample_counts
from kvtune.evaluate.workloads.data import resolve_data
from kvtune.evaluate.model import KV_DTYPES, load_model, resolve_device
from kvtune.evaluate.ratio import estimate_ratios
from kvtune.optimize import OPTIMIZERS, make_optimizer
from kvtune.pareto import non_dominated_mask, pareto_front
from kvtune.settings import ProfileSettings
from kvtune.report.html import write_report
from kvtune.space import load_space
from kvtune.atomic import atomic_write_parquet, atomic_write_text
from kvtune.run.loop import ask_tell
from kvtune.run.folder import check_out_folder, check_run_name, open_run_folder
from kvtune.store import TrialStore
from kvtune.tables.policy_table import compile_policy_table
from kvtune.tables.run import interval_gate, read_run_info, run_table_metadata

@dataclass
class ProfileResult:
    """What a finished run produced: its folder, report path and the frames written."""

    settings: ProfileSettings
    trials: pd.DataFrame
    pareto: pd.DataFrame
    table: Any
    files: dict[str, Path] = field(default_factory=dict)


def default_run_name(settings: ProfileSettings) -> str:
    """``<model>-<space>-<YYYYmmdd-HHMMSS>`` with path characters removed."""
    model = Path(settings.model).stem.replace("/", "_")
    return f"{model}-{Path(settings.space).stem}-{time.strftime('%Y%m%d-%H%M%S')}"


def load_settings(run_dir: Path) -> ProfileSettings:
    """Settings of an existing run, for ``--resume``.

    Raises:
        KvtuneError: the folder has no readable ``run.json`` (missing, not UTF-8 JSON, no
            valid ``settings``); the message names the file.
    """
    path = Path(run_dir) / "run.json"
    if not path.is_file():
        raise KvtuneError(f"--resume {run_dir}: no run.json there; is it a kvtune run folder?")
    return _run_settings(read_run_info(Path(run_dir)), path)


def _run_settings(run_info: dict[str, Any], path: Path) -> ProfileSettings:
    """The :class:`ProfileSettings` stored in a run's ``run.json`` (read from ``path``).

    Raises:
        KvtuneError: no ``settings`` object, or settings :meth:`ProfileSettings.from_dict`
            rejects; the message names the file.
    """
    if not isinstance(run_info.get("settings"), dict):
        raise KvtuneError(f"{path}: no 'settings' object; is it a kvtune run.json?")
    try:
        return ProfileSettings.from_dict(run_info["settings"])
    except KvtuneError as exc:
        raise KvtuneError(f"{path}: {exc}") from None


Hook = Callable[..., None]


def _noop(*_: Any, **__: Any) -> None:
    return None


def run_profile(settings: ProfileSettings, *, resume: bool = False, on_stage: Hook = _noop,
                on_progress: Hook = _noop) -> ProfileResult:
    """Run (or resume) a profile and write all outputs.

    Stages: load the model; build the workload (``settings.workload``: load its real data,
    prefill every sample, cache the uncompressed baseline); calibrate MixHQ heads when the space
    needs them; estimate every candidate's compression ratio when the optimizer uses them;
    search at ``settings.search_fidelity`` (one trials row per policy, written as it finishes);
    re-evaluate the search's Pareto set at full fidelity (multi-fidelity, issue 6); then
    :func:`finalize_run`.

    Args:
        settings: the run's settings; ``settings.run`` is filled in when empty.
        resume: continue the trials already in the run folder (never re-evaluating a policy at
            a fidelity it already has).
        on_stage: ``on_stage(name, total)`` when a stage with ``total`` steps starts.
        on_progress: ``on_progress(n=1, info=str)`` after each step of the current stage.

    Raises:
        KvtuneError (and subclasses): bad settings, assets, data, spaces or models. Settings
            (fidelity, optimizer, ``kv_dtype``, ``prompt_format``, ``device``, workload and
            sample counts), the space, ``--text``/``--data``, the run name and the ``--out``
            and ``--reports`` folders are checked before the model loads; a run that fails
            before writing its first file leaves no folder behind.
        RunLockedError: another process is working on the run folder.
    """
    settings.run = check_run_name(settings.run or default_run_name(settings))
    check_out_folder(settings.out, "--out")
    check_out_folder(settings.reports, "--reports")
    run_dir = settings.run_dir
    if not resume and (run_dir / TrialStore.LOG).exists():
        raise KvtuneError(f"run folder {run_dir} already has trials; use --resume {run_dir} or another --run name")
    if settings.search_fidelity not in FIDELITIES:
        raise KvtuneError(f"--search-fidelity must be one of {', '.join(FIDELITIES)}, not {settings.search_fidelity!r}")
    if settings.optimizer not in OPTIMIZERS:
        raise KvtuneError(f"unknown optimizer {settings.optimizer!r}; known: {', '.join(sorted(OPTIMIZERS))}")
    if settings.kv_dtype not in KV_DTYPES:
        raise KvtuneError(f"--kv-dtype must be one of {', '.join(KV_DTYPES)}, not {settings.kv_dtype!r}")
    if settings.prompt_format not in PROMPT_FORMATS:
        raise KvtuneError(f"--prompt-format must be one of {', '.join(PROMPT_FORMATS)}, not {settings.prompt_format!r}")
    resolve_device(settings.device)  # unknown --device, or cuda without CUDA: fail before loading
    torch.manual_seed(settings.seed)
    t_start = time.perf_counter()
    space = load_space(settings.space)
    n_full, _ = workload_sample_counts(settings.workload, settings)  # bad workload/sizes: fail before loading
    check_workload_inputs(settings, n_full)
    with open_run_folder(run_dir):
        return _run_locked(settings, space, resume, t_start, on_stage, on_progress)


#: At most this many special tokens start every context (Gemma's ``<bos>``; see
#: :func:`kvtune.evaluate.capture.build_contexts`).
MAX_START_TOKENS = 4


def check_workload_inputs(settings: ProfileSettings, n_full: int) -> None:
    """Check ``--text`` / ``--data`` and the context sizes before the model loads.

    Workloads with data ``fields`` (qa, boolq, summarize) read and validate their dataset;
    the others read their ``--text`` documents. For ``continuation``, the text must hold
    ``n_full`` windows of ``context_tokens + continuation_tokens`` tokens; no tokenizer yields
    more tokens than the text has UTF-8 bytes, so too little text is found here already (the
    exact count is checked again once the tokenizer is loaded).

    Raises:
        AssetError, DataError: missing or unreadable text / data.
        KvtuneError: the text is certainly too short for the requested contexts.
    """
    cls = WORKLOADS[settings.workload]
    fields = getattr(cls, "fields", None)
    if fields is not None:
        resolve_data(settings.data or cls.default_data, fields, workload=cls.name)
        return
    docs = read_texts(settings.text)
    if cls.name != "continuation":
        return
    upper = sum(len(t.encode("utf-8")) for _, t in docs) + len(docs)  # + one separator per document
    window = settings.context_tokens + settings.continuation_tokens - MAX_START_TOKENS
    if upper < n_full * window:
        raise KvtuneError(
            f"--context-tokens {settings.context_tokens}: the text {settings.text!r} has at most {upper} tokens, "
            f"fewer than {n_full} contexts x {settings.context_tokens + settings.continuation_tokens} tokens; "
            "use fewer or shorter contexts, or more text")


def _run_locked(settings: ProfileSettings, space, resume: bool, t_start: float, on_stage: Hook,
                on_progress: Hook) -> ProfileResult:
    """The part of :func:`run_profile` that runs while the run folder is locked (the trials
    are read under the lock, so no other process appends to them meanwhile)."""
    run_dir = settings.run_dir
    log_exists = (run_dir / TrialStore.LOG).exists()
    if not resume and log_exists:
        raise KvtuneError(f"run folder {run_dir} already has trials; use --resume {run_dir} or another --run name")
    done = _done_by_fidelity(TrialStore(run_dir).load()) if log_exists else {}
    n_full, _ = workload_sample_counts(settings.workload, settings)
    on_stage("load model", 1)
    lm = load_model(settings.model, settings.device)
    on_progress(1)
    on_stage(f"prefill {settings.workload} samples", n_full)
    wl = make_workload(settings.workload, lm, settings=settings, progress=lambda n: on_progress(n))
    if wl.cheap_is_full:  # e.g. --samples equal to --cheap-samples: search at full, nothing to refine
        settings.search_fidelity = "full"
    space = _calibrated(space, lm, wl.calibration_ids(), run_dir, on_stage, on_progress)
    ratios = None
    if getattr(OPTIMIZERS[settings.optimizer], "needs_ratios", True):  # model-based optimizers use them
        on_stage("estimate ratios", len(space))
        ratios = estimate_ratios([c.config for c in space.candidates], wl.kv_sample(), progress=on_progress)
    t_capture = time.perf_counter() - t_start

    run_info = {
        "settings": settings.to_dict(),
        "space": {"name": space.name, "path": str(space.path), "candidates": len(space)},
        "model_info": lm.describe(),
        "workload": settings.workload,
        "workload_info": wl.describe(),
        "versions": {"kvtune": __version__, "torch": torch.__version__, "python": platform.python_version()},
        "host": {"machine": platform.machine(), "threads": torch.get_num_threads()},
    }
    atomic_write_text(run_dir / "run.json", json.dumps(run_info, indent=2))
    store = TrialStore(run_dir)

    fid = settings.search_fidelity
    searched = done.get(fid, {})
    optimizer = make_optimizer(settings.optimizer, space, seed=settings.seed, ratios=ratios)
    budget = len(space) if settings.budget <= 0 else min(settings.budget, len(space))
    trial = sum(len(rows) for rows in done.values())
    on_stage(f"evaluate policies ({fid})", max(budget - len(searched), 0))

    def on_record(record: dict[str, Any]) -> None:
        store.append(record)
        on_progress(1, info=_info(record))

    numbers = itertools.count(trial)  # trial numbers continue those stored
    trial += ask_tell(optimizer, space.candidates, budget=budget, done=searched, on_record=on_record,
                      evaluate=lambda cand: _record(next(numbers), "search", cand,
                                                    wl.evaluate(cand.config, fidelity=fid), ratios))
    t_search = time.perf_counter() - t_start - t_capture

    if settings.refine and fid != "full":
        front = pareto_front(pd.DataFrame(list(optimizer.told.values())))
        by_id = {c.policy_id: c for c in space.candidates}
        chosen = refinement_order(front, settings.refine_budget, tuple(settings.floors))
        todo = [pid for pid in chosen if pid not in done.get("full", {})]
        on_stage("re-evaluate Pareto set (full)", len(todo))
        for pid in todo:
            cand = by_id[pid]
            record = _record(trial, "refine", cand, wl.evaluate(cand.config, fidelity="full"), ratios)
            store.append(record)
            trial += 1
            on_progress(1, info=_info(record))

    on_stage("pareto + tables + report", 1)
    run_info["timing_seconds"] = {"load_and_prefill": t_capture, "search": t_search,
                                  "refine": time.perf_counter() - t_start - t_capture - t_search}
    result = finalize_run(run_dir, run_info=run_info)
    on_progress(1)
    return result


def refinement_order(front: pd.DataFrame, limit: int, floors: tuple[float, ...] = (0.99, 0.97, 0.95, 0.90),
                     per_floor: int = 2) -> list[str]:
    """Which search-fidelity Pareto policies to re-evaluate at full fidelity, most useful first.

    Only the 2-D accuracy / compression-ratio front can be picked by a policy table at some
    floor when codec speeds are alike, and each floor needs its own candidates. So:

    1. for every floor, its highest-ratio 2-D-front policies whose search accuracy meets the
       floor, taken round-robin over the floors (highest floor first), up to ``per_floor``
       per floor (a second one in case the first misses the floor at full fidelity);
    2. the rest of the 2-D front, by compression ratio, highest first;
    3. the rest of the 3-D front (kept there by a faster codec), by ratio.

    At most ``limit`` ids (``limit <= 0``: all).

    Args:
        front: the search's 3-D Pareto front (``policy_id``, ``relative_accuracy``,
            ``compression_ratio``).
        floors: the accuracy floors (fractions) of the policy table.
        per_floor: policies reserved per floor in step 1.
    """
    if front.empty:
        return []
    pts = front[["relative_accuracy", "compression_ratio"]].to_numpy(dtype=float)
    on_2d = non_dominated_mask(pts, maximize=[True, True])
    ordered = front.assign(_2d=on_2d).sort_values(["_2d", "compression_ratio"], ascending=[False, False], kind="stable")
    flat = ordered[ordered["_2d"]]
    ids: list[str] = []
    by_floor = [[str(p) for p in flat.loc[flat["relative_accuracy"] >= q, "policy_id"]] for q in sorted(floors, reverse=True)]
    for rank in range(per_floor):
        for cands in by_floor:
            if len(cands) > rank and cands[rank] not in ids:
                ids.append(cands[rank])
    ids += [str(p) for p in ordered["policy_id"] if str(p) not in ids]
    return ids if limit <= 0 else ids[:limit]


def _done_by_fidelity(rows: list[dict[str, Any]]) -> dict[str, dict[str, dict[str, Any]]]:
    """Stored trials as ``{fidelity: {policy_id: row}}`` (rows of version-1 runs are ``full``)."""
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for r in rows:
        out.setdefault(r.get("fidelity") or "full", {})[r["policy_id"]] = r
    return out


def _record(trial: int, stage: str, cand, result: dict[str, Any], ratios) -> dict[str, Any]:
    """One trials row: the candidate's identity and parameters, then the evaluation result."""
    return {
        "trial": trial,
        "stage": stage,
        "policy_id": cand.policy_id,
        "label": cand.config.label,
        "method": "tqc",
        "config_json": cand.config.to_json(),
        "preset": cand.params.get("preset"),
        **{f"param.{k}": v for k, v in cand.params.items()},
        "ratio_estimate": None if ratios is None else float(ratios[cand.index]),
        **result,
    }


def _info(record: dict[str, Any]) -> str:
    return (f"{record['label']}  CR {record['compression_ratio']:.2f}x  "
            f"acc {100 * record['relative_accuracy']:.1f}% (lo {100 * record['relative_accuracy_lo']:.1f})")


def _calibrated(space, lm, calibration_ids: torch.Tensor, run_dir: Path, on_stage: Hook, on_progress: Hook):
    """Fill MixHQ head scores into the space from ``calibration.json`` or a new calibration pass.

    The scores are stored with the run, so a resumed run (and a serving system reading the
    tables) uses the same heads; they also travel inside every MixHQ policy's configuration.
    """
    if not space.needs_head_scores:
        return space
    path = run_dir / "calibration.json"
    if path.is_file():
        scores = HeadScores.from_dict(json.loads(path.read_text())["head_scores"])
    else:
        on_stage("calibrate MixHQ heads", 1)
        scores = calibrate_head_scores(lm, calibration_ids)
        atomic_write_text(path, json.dumps({"head_scores": scores.to_dict()}, indent=1))
        on_progress(1)
    return space.with_head_scores(scores.scores)


def split_fidelities(trials: pd.DataFrame, search_fidelity: str) -> tuple[pd.DataFrame, pd.DataFrame, dict[str, Any]]:
    """Split a run's trials into the search rows and the rows the final Pareto front is built on.

    With a cheap search and a refinement, the final rows are the full-fidelity re-evaluations
    of the search's Pareto set; otherwise they are the search rows themselves.

    Returns:
        ``(searched, final, info)``; ``info`` has ``search``, ``final`` (fidelity names),
        ``refined`` (policies evaluated at both) and ``spearman_relative_accuracy``: the rank
        correlation of the cheap and full relative accuracies over those policies (NaN below 2).
    """
    fid = trials["fidelity"].fillna("full") if "fidelity" in trials else pd.Series("full", index=trials.index)
    searched = trials[fid == search_fidelity]
    full = trials[fid == "full"]
    info: dict[str, Any] = {"search": search_fidelity, "final": search_fidelity, "refined": 0,
                            "spearman_relative_accuracy": None}
    if search_fidelity == "full" or full.empty:
        return searched, searched, info
    both = searched.merge(full, on="policy_id", suffixes=("_cheap", "_full"))
    rho = spearman(both["relative_accuracy_raw_cheap"].tolist(), both["relative_accuracy_raw_full"].tolist())
    info.update(final="full", refined=len(both), spearman_relative_accuracy=None if rho != rho else round(rho, 4))
    return searched, full, info


#: Trial columns every run's outputs are derived from, and those of them that hold numbers.
_TRIAL_COLUMNS = ("policy_id", "label", "method", "config_json", "relative_accuracy", "compression_ratio",
                  "encode_gbps", "decode_gbps")
_TRIAL_NUMBERS = ("relative_accuracy", "relative_accuracy_lo", "relative_accuracy_hi", "relative_accuracy_raw",
                  "compression_ratio", "encode_gbps", "decode_gbps")


def check_trials(trials: pd.DataFrame, source: Path) -> None:
    """Check the trial records a run's outputs are built from.

    Every record needs ``policy_id``, ``label``, ``method`` and ``config_json`` strings and
    numbers (NaN allowed: a failed trial, left off the Pareto front) for relative accuracy
    (and its ``_lo``/``_hi``/``_raw`` variants when present), compression ratio and throughputs.

    Raises:
        KvtuneError: a column is missing, or a record holds a value of the wrong type; the
            message names ``source`` (the trial log), the record (1-based) and the column.
    """
    missing = [c for c in _TRIAL_COLUMNS if c not in trials.columns]
    if missing:
        raise KvtuneError(f"{source}: trial records lack column(s) {missing}")
    for i, row in enumerate(trials.to_dict("records"), 1):
        for c in _TRIAL_COLUMNS[:4]:
            if not isinstance(row[c], str):
                raise KvtuneError(f"{source}: record {i}: {c} = {row[c]!r} is not a string")
        for c in _TRIAL_NUMBERS:
            v = row.get(c)
            if c in row and (isinstance(v, bool) or not isinstance(v, (int, float))):
                raise KvtuneError(f"{source}: record {i} (policy {row['policy_id']}): {c} = {v!r} is not a number")


def finalize_run(run_dir: Path, *, run_info: dict[str, Any] | None = None) -> ProfileResult:
    """Derive every output of a run from its trial store: Pareto front, policy tables, report.

    Used at the end of :func:`run_profile` and by ``kvtune report`` to rebuild the outputs of
    an existing run (for example after changing floors or the report). Needs no model.

    Raises:
        KvtuneError: the folder has no readable ``run.json`` (missing, not UTF-8 JSON, bad
            settings), no trials, or trials that cannot be read or turned into a front and a
            table (see :meth:`TrialStore.load` and :func:`check_trials`); the message names
            the file.
    """
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise KvtuneError(f"{run_dir}: not a folder (expected a run folder such as profiles/<run>)")
    with open_run_folder(run_dir, create=False):
        return _finalize_locked(run_dir, run_info)


def stored_trial_count(path: Path) -> int:
    """Rows of a stored ``trials.parquet`` (0 when it is missing or unreadable)."""
    import pyarrow.parquet as pq

    try:
        return int(pq.read_metadata(path).num_rows)
    except Exception:  # missing, truncated or not Parquet: nothing good to keep
        return 0


def _finalize_locked(run_dir: Path, run_info: dict[str, Any] | None) -> ProfileResult:
    """:func:`finalize_run` with the folder locked: everything is derived and checked in
    memory first; files are written only when all of it succeeded."""
    if run_info is None:
        run_info = read_run_info(run_dir)
    settings = _run_settings(run_info, run_dir / "run.json")
    store = TrialStore(run_dir)
    trials = store.frame()
    if trials.empty:
        raise KvtuneError(f"{run_dir}: no finished trials yet")
    check_trials(trials, store.log_path)
    model_info = run_info.get("model_info")
    try:
        searched, final, fidelity_info = split_fidelities(trials, settings.search_fidelity)
        pareto = pareto_front(final)
        table = compile_policy_table(pareto, floors=settings.floors, model=settings.model,
                                     workload=str(run_info.get("workload") or "continuation"),
                                     device=str((model_info if isinstance(model_info, dict) else {}).get("device")
                                                or "cpu"),
                                     metadata=run_table_metadata(run_dir, run_info),
                                     gate=interval_gate(pareto, run_info))
    except KeyError as exc:
        raise KvtuneError(f"{store.log_path}: trial records lack column {exc}") from None
    except KvtuneError as exc:
        raise type(exc)(f"{store.log_path}: {exc}") from None
    stored = stored_trial_count(run_dir / TrialStore.TABLE)
    if len(trials) < stored:
        raise KvtuneError(f"{store.log_path} holds {len(trials)} trial records but {run_dir / TrialStore.TABLE} "
                          f"holds {stored}: the log was cut or edited; restore it (nothing was rewritten)")
    files = {"run": run_dir / "run.json", "trials": store.write_table(trials)}
    files["pareto"] = atomic_write_parquet(pareto, run_dir / "pareto.parquet")
    run_info["fidelity"] = fidelity_info
    files["policy_table"] = run_dir / "policy_table.parquet"
    files["policy_table_json"] = run_dir / "policy_table.json"
    table.to_parquet(files["policy_table"])
    table.to_json(files["policy_table_json"])
    run_info["trials"] = len(trials)
    atomic_write_text(run_dir / "run.json", json.dumps(run_info, indent=2))
    report_path = Path(settings.reports) / f"{run_dir.name}.html"
    files["report"] = write_report(searched, pareto, table, report_path,
                                   title=f"kvtune profile: {run_dir.name}", run_config=run_info)
    return ProfileResult(settings=settings, trials=trials, pareto=pareto, table=table, files=files)
