"""``kvtune profile`` as a Python API: capture real KV, search policies, write every output.

A run lives in ``<out>/<run>/``:

- ``run.json``: the :class:`ProfileSettings`, model geometry, library versions, timings;
- ``trials.jsonl`` / ``trials.parquet``: one row per evaluated policy (see :mod:`kvtune.run.store`);
- ``pareto.parquet``: the 3-D non-dominated set (relative accuracy up, compression ratio up,
  codec seconds per GB down);
- ``policy_table.parquet`` / ``policy_table.json``: the lower envelope over x = 1/B of the Pareto
  policies, per accuracy floor (:mod:`kvtune.tables`);

and the report is ``<reports>/<run>.html``.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pandas as pd
import torch

from kvtune.core.errors import ConfigError, KvtuneError
from kvtune.evaluate.calibrate import HeadScores, calibrate_head_scores
from kvtune.evaluate.memory import (
    MemoryEstimate,
    check_memory_fits,
    estimate_profile_memory,
    model_shape,
)
from kvtune.evaluate.metrics import spearman
from kvtune.evaluate.assets import read_texts
from kvtune.evaluate.workloads import FIDELITIES, PROMPT_FORMATS, WORKLOADS, workload_sample_counts
from kvtune.evaluate.workloads.data import resolve_data
from kvtune.evaluate.model import KV_DTYPES, resolve_device
from kvtune.search.optimizers import OPTIMIZERS
from kvtune.search.pareto import non_dominated_mask
from kvtune.methods.tqc.settings import ProfileSettings
from kvtune.search.space import load_space
from kvtune.core.atomic import atomic_write_text
from kvtune.run.folder import check_out_folder, check_run_name
from kvtune.run.runner import RunResult
from kvtune.run.store import TrialStore
from kvtune.run.settings import check_floors
from kvtune.tables.latency import gbps_to_x_s_per_gb, line_coefficients
from kvtune.tables.run import read_run_info


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
    return run_settings(read_run_info(Path(run_dir)), path)


def run_settings(run_info: dict[str, Any], path: Path) -> ProfileSettings:
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
                on_progress: Hook = _noop, say: Hook = _noop, executor: Any = None) -> RunResult:
    """Run (or resume) a profile and write all outputs.

    Stages: load the model; build the workload (``settings.workload``: load its real data,
    prefill every sample, cache the uncompressed baseline); calibrate MixHQ heads when the space
    needs them; estimate every candidate's compression ratio when the optimizer uses them;
    search at ``settings.search_fidelity`` (one trials row per policy, written as it finishes);
    re-evaluate the search's Pareto set at full fidelity (multi-fidelity, issue 6) and climb
    toward the table's floors (:mod:`kvtune.search.climb`); then
    :func:`kvtune.run.runner.finalize_run` (the shared runner,
    :func:`kvtune.run.runner.run_method`, with the ``tqc`` method).

    Args:
        settings: the run's settings (frozen; ``run`` "" = :func:`default_run_name`, the
            result's ``settings`` hold the name used).
        resume: continue the trials already in the run folder (never re-evaluating a policy at
            a fidelity it already has).
        on_stage: ``on_stage(name, total)`` when a stage with ``total`` steps starts.
        on_progress: ``on_progress(n=1, info=str)`` after each step of the current stage.
        say: ``say(message)``: one-line messages (e.g. that a resumed run is already complete).
        executor: where trials are evaluated (:mod:`kvtune.run.executors`; None: in this
            process, one at a time).

    Raises:
        KvtuneError (and subclasses): bad settings, assets, data, spaces or models. Settings
            (fidelity, optimizer, ``kv_dtype``, ``prompt_format``, ``device``, workload and
            sample counts), the space, ``--text``/``--data``, the run name and the ``--out``
            and ``--reports`` folders are checked before the model loads; a run that fails
            before writing its first file leaves no folder behind.
        RunLockedError: another process is working on the run folder.
    """
    from kvtune.run.method import METHODS
    from kvtune.run.method import Hooks
    from kvtune.run.runner import run_method

    method = METHODS["tqc"]
    settings = dataclasses.replace(settings, run=check_run_name(settings.run or default_run_name(settings)))
    check_out_folder(settings.out, "--out")
    check_out_folder(settings.reports, "--reports")
    if not resume and (settings.run_dir / TrialStore.LOG).exists():
        raise KvtuneError(f"run folder {settings.run_dir} already has trials; use --resume {settings.run_dir} "
                          "or another --run name")
    return run_method(method, settings, settings.run_dir, resume=resume, reports=settings.reports,
                      hooks=Hooks(on_stage=on_stage, on_progress=on_progress, say=say), executor=executor)


def check_profile_settings(settings: ProfileSettings) -> None:
    """Check a T/Q/C run's settings, space and inputs before the model loads.

    Raises:
        KvtuneError (and subclasses): the budgets (integers >= 0), fidelity, optimizer,
            ``kv_dtype``, ``prompt_format``, ``device``, workload and sample counts, the space (and ``context_tokens`` long
            enough for its MixHQ head calibration, :func:`check_head_calibration`),
            ``--text``/``--data``, and the memory the run needs (:func:`check_profile_memory`).
    """
    check_floors(settings.floors, "floors")
    for name in ("budget", "refine_budget", "climb_budget"):
        value = getattr(settings, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise KvtuneError(f"{name} (--{name.replace('_', '-')}) must be an integer >= 0, not {value!r}")
    if settings.search_fidelity not in FIDELITIES:
        raise KvtuneError(f"--search-fidelity must be one of {', '.join(FIDELITIES)}, not {settings.search_fidelity!r}")
    if settings.optimizer not in OPTIMIZERS:
        raise KvtuneError(f"unknown optimizer {settings.optimizer!r}; known: {', '.join(sorted(OPTIMIZERS))}")
    if settings.kv_dtype not in KV_DTYPES:
        raise KvtuneError(f"--kv-dtype must be one of {', '.join(KV_DTYPES)}, not {settings.kv_dtype!r}")
    if settings.prompt_format not in PROMPT_FORMATS:
        raise KvtuneError(f"--prompt-format must be one of {', '.join(PROMPT_FORMATS)}, not {settings.prompt_format!r}")
    resolve_device(settings.device)  # unknown --device, or cuda without CUDA: fail before loading
    check_head_calibration(load_space(settings.space), settings)
    n_full, _ = workload_sample_counts(settings.workload, settings)  # bad workload/sizes: fail before loading
    check_workload_inputs(settings, n_full)
    check_profile_memory(settings, n_full)


def check_profile_memory(settings: ProfileSettings, n_full: int, workers: int = 1) -> MemoryEstimate | None:
    """Estimate the run's peak memory from the model's configuration and refuse it when it
    (times ``workers`` processes on this machine) exceeds the memory available now
    (:mod:`kvtune.evaluate.memory`); None when the model's configuration cannot be read
    without loading it (its load reports why).

    Raises:
        ConfigError: the run cannot fit; the message names the settings to lower.
    """
    shape = model_shape(settings.model)
    if shape is None:
        return None
    estimate = estimate_profile_memory(shape, contexts=n_full, context_tokens=settings.context_tokens,
                                       continuation_tokens=settings.continuation_tokens, kv_dtype=settings.kv_dtype,
                                       workload=settings.workload)
    check_memory_fits(estimate, kv_dtype=settings.kv_dtype, workers=workers)
    return estimate


def check_head_calibration(space: Any, settings: ProfileSettings) -> None:
    """A space with MixHQ policies calibrates head scores on the run's contexts
    (:func:`kvtune.evaluate.calibrate.calibrate_head_scores`), which must be longer than the
    streaming pattern's sink + window + 1 tokens: found here, before the model loads and
    prefills (workloads whose contexts are at most ``context_tokens`` long are checked again
    on their real contexts).

    Raises:
        ConfigError: ``--context-tokens`` too short for a space that needs head scores.
    """
    from kvtune.core.errors import ConfigError
    from kvtune.evaluate.calibrate import DEFAULT_SINK_TOKENS, DEFAULT_WINDOW_TOKENS

    limit = DEFAULT_SINK_TOKENS + DEFAULT_WINDOW_TOKENS + 1
    if space.needs_head_scores and settings.context_tokens <= limit:
        raise ConfigError(f"--space {settings.space} has MixHQ policies; with --context-tokens {settings.context_tokens} "
                          f"their head calibration cannot run: it needs contexts longer than {limit} tokens (sink "
                          f"{DEFAULT_SINK_TOKENS} + window {DEFAULT_WINDOW_TOKENS} + 1); use longer contexts or a "
                          "space without mixhq policies")


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


REFINE_BANDWIDTHS_GBPS = (1.0, 5.0)
"""Link bandwidths (Gbps) at which :func:`refinement_order` reserves each floor's fastest
policy: where a policy table stops picking the highest-ratio policies (their codecs cost more
than the bytes they save) and starts picking fast ones."""


def refinement_order(front: pd.DataFrame, limit: int, floors: tuple[float, ...] = (0.99, 0.97, 0.95, 0.90),
                     per_floor: int = 2, bandwidths_gbps: tuple[float, ...] = REFINE_BANDWIDTHS_GBPS) -> list[str]:
    """Which search-fidelity Pareto policies to re-evaluate at full fidelity, most useful first.

    Only the 2-D accuracy / compression-ratio front can be picked by a policy table at some
    floor when codec speeds are alike, and each floor needs its own candidates. So:

    1. for every floor, its highest-ratio 2-D-front policy whose search accuracy meets the
       floor (highest floor first);
    2. when the front has interval lower ends (``relative_accuracy_lo``): for every floor, the
       highest-ratio policy of the whole front whose *lower end* already clears the floor (the
       one most likely to clear it at full fidelity too: the search's few samples can rank a
       family too high, e.g. PCA policies that scored 99.0 % on 8 contexts and 97.9 % on 24);
    3. when the front has codec speeds (``encode_gbps``, ``decode_gbps``, GB/s): for every floor
       and every bandwidth of ``bandwidths_gbps``, the policy of the whole front meeting the
       floor with the shortest predicted transfer, ``V/s_enc + V/(cr B) + V/s_dec`` (KVServe,
       arXiv 2605.13734; :func:`kvtune.tables.latency.line_coefficients`): when high-ratio
       policies with slow codecs fill the 2-D front, the fast ones a table picks at 1-5 Gbps
       would otherwise fall past ``limit``;
    4. the floors' next best 2-D-front policies as in step 1, up to ``per_floor`` per floor;
    5. the rest of the 2-D front, by compression ratio, highest first;
    6. the rest of the 3-D front (kept there by a faster codec), by ratio.

    Each id once; at most ``limit`` ids (``limit <= 0``: all).

    Args:
        front: the search's 3-D Pareto front (``policy_id``, ``relative_accuracy``,
            ``compression_ratio``, optionally ``relative_accuracy_lo``, ``encode_gbps`` and
            ``decode_gbps``; fractions).
        floors: the accuracy floors (fractions) of the policy table.
        per_floor: policies reserved per floor in steps 1 and 4.
        bandwidths_gbps: the link bandwidths of step 3 (Gbps).
    """
    if front.empty:
        return []
    pts = front[["relative_accuracy", "compression_ratio"]].to_numpy(dtype=float)
    on_2d = non_dominated_mask(pts, maximize=[True, True])
    ordered = front.assign(_2d=on_2d).sort_values(["_2d", "compression_ratio"], ascending=[False, False], kind="stable")
    flat = ordered[ordered["_2d"]]
    high_first = sorted(floors, reverse=True)
    by_floor = [[str(p) for p in flat.loc[flat["relative_accuracy"] >= q, "policy_id"]] for q in high_first]
    safe = [[] for _ in high_first]
    if "relative_accuracy_lo" in front.columns:
        by_ratio = front.sort_values("compression_ratio", ascending=False, kind="stable")
        safe = [[str(p) for p in by_ratio.loc[by_ratio["relative_accuracy_lo"] >= q, "policy_id"]] for q in high_first]
    ids: list[str] = []

    def first_new(cands: list[str]) -> None:
        for p in cands:
            if p not in ids:
                ids.append(p)
                return

    for cands in by_floor:
        first_new(cands[:1])
    for cands in safe:
        first_new(cands)
    if {"encode_gbps", "decode_gbps"} <= set(front.columns):
        a, b = line_coefficients(front["compression_ratio"], front["encode_gbps"], front["decode_gbps"])
        for q in high_first:
            meets = front["relative_accuracy"] >= q
            for bw in bandwidths_gbps:
                seconds_per_gb = pd.Series(a + b * gbps_to_x_s_per_gb(bw), index=front.index)[meets]
                first_new([str(front.loc[seconds_per_gb.idxmin(), "policy_id"])] if len(seconds_per_gb) else [])
    for rank in range(1, per_floor):
        for cands in by_floor:
            first_new(cands[rank : rank + 1])
    ids += [str(p) for p in ordered["policy_id"] if str(p) not in ids]
    return ids if limit <= 0 else ids[:limit]


def done_by_fidelity(rows: list[dict[str, Any]]) -> dict[str, dict[str, dict[str, Any]]]:
    """Stored trials as ``{fidelity: {policy_id: row}}`` (rows of version-1 runs are ``full``)."""
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for r in rows:
        out.setdefault(r.get("fidelity") or "full", {})[r["policy_id"]] = r
    return out


def trial_record(stage: str, cand, result: dict[str, Any], ratios) -> dict[str, Any]:
    """One trials row (the runner adds its ``trial`` number): the candidate's identity and
    parameters, then the evaluation result."""
    return {
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


def progress_line(record: dict[str, Any]) -> str:
    return (f"{record['label']}  CR {record['compression_ratio']:.2f}x  "
            f"acc {100 * record['relative_accuracy']:.1f}% (lo {100 * record['relative_accuracy_lo']:.1f})")


#: Run-folder files of the PCA bases, by the ``rope`` mode of their keys.
PCA_BASIS_FILES = {"pre": "pca_basis.safetensors", "post": "pca_basis_post.safetensors"}


#: Largest ``calibration.json`` :func:`read_calibration` reads (16 MiB).
MAX_CALIBRATION_BYTES = 16 << 20


def read_calibration(path: Path) -> dict[str, Any]:
    """The run's ``calibration.json`` as a dict (``{}`` when absent).

    Raises:
        KvtuneError: larger than :data:`MAX_CALIBRATION_BYTES` (checked before reading),
            unreadable, not JSON (or nested too deeply to parse), or not an object; the message
            names the file.
    """
    if not path.is_file():
        return {}
    try:
        size = path.stat().st_size
        if size > MAX_CALIBRATION_BYTES:
            raise KvtuneError(f"{path}: {size} bytes; the run's calibration is at most {MAX_CALIBRATION_BYTES}")
        with path.open("rb") as fh:
            doc = json.loads(fh.read(MAX_CALIBRATION_BYTES + 1))
    except (OSError, ValueError, RecursionError) as exc:
        raise KvtuneError(f"{path}: cannot read the run's calibration ({exc})") from None
    if not isinstance(doc, dict):
        raise KvtuneError(f"{path}: not a JSON object")
    return doc


def runnable_space(space, workload) -> tuple[Any, list[str]]:
    """``space`` without the candidates ``workload`` cannot evaluate on its model
    (:meth:`~kvtune.evaluate.workloads.base.Workload.policy_problem`: e.g. token selection,
    ``keep``, on a workload or model that does not run shortened caches), and one line per
    kind of dropped candidate saying why (empty when none is dropped).

    Raises:
        SpaceError: no candidate is left (the message names the space).
    """
    problems = {c.policy_id: workload.policy_problem(c.config) for c in space.candidates}
    if not any(problems.values()):
        return space, []
    reasons: dict[str, int] = {}
    for why in problems.values():
        if why is not None:
            reasons[why] = reasons.get(why, 0) + 1
    kept = space.subset([pid for pid, p in problems.items() if p is None])
    return kept, [f"{n} candidate(s) left out: {why}" for why, n in reasons.items()]


def calibrated_space(space, lm, calibration_ids: torch.Tensor, run_dir: Path, on_stage: Hook, on_progress: Hook,
                     *, pca_ids: torch.Tensor | Callable[[], torch.Tensor] | None = None):
    """Fill the space's calibration data from ``calibration.json`` or new calibration passes:
    MixHQ head scores, and PCA bases for ``pca`` / ``dp-alloc`` policies
    (:func:`calibrated_pca_bases`).

    The data is stored with the run, so a resumed run (and a serving system reading the
    tables) uses the same; scores travel inside every MixHQ policy's configuration, a basis by
    its digest. Entries already in ``calibration.json`` are read back, never recomputed or
    replaced; new ones are added to it (atomic writes).

    Args:
        calibration_ids: ``(N, T)`` int64 contexts of the MixHQ head calibration (the
            workload's :meth:`~kvtune.evaluate.workloads.base.Workload.calibration_ids`: the
            first evaluated contexts, kept so that existing runs keep their head scores).
        pca_ids: the contexts the PCA bases are fitted on, or a function returning them
            (called only when a basis is fitted): the workload's
            :meth:`~kvtune.evaluate.workloads.base.Workload.pca_calibration_ids`, contexts
            apart from the evaluated ones (KVTC, arXiv 2511.01815, sec. 3); None:
            ``calibration_ids``.
    """
    if space.needs_head_scores:
        path = run_dir / "calibration.json"
        doc = read_calibration(path)
        if "head_scores" in doc:
            scores = HeadScores.from_dict(doc["head_scores"])
        else:
            on_stage("calibrate MixHQ heads", 1)
            scores = calibrate_head_scores(lm, calibration_ids)
            atomic_write_text(path, json.dumps({**doc, "head_scores": scores.to_dict()}, indent=1))
            on_progress(1)
        space = space.with_head_scores(scores.scores)
    if space.needs_pca_basis:
        space = space.with_pca_basis(calibrated_pca_bases(sorted(space.pca_ropes_missing), lm,
                                                          calibration_ids if pca_ids is None else pca_ids,
                                                          run_dir, on_stage, on_progress))
    if space.needs_codebooks:
        space = space.with_codebooks(codebook_calibrator(lm, calibration_ids if pca_ids is None else pca_ids, run_dir,
                                                         on_stage, on_progress))
    return space


def codebook_calibrator(lm, calibration_ids: torch.Tensor | Callable[[], torch.Tensor], run_dir: Path,
                        on_stage: Hook = _noop, on_progress: Hook = _noop) -> Callable:
    """``PolicyConfig -> PolicyConfig`` filling a policy's calibrated codebooks
    (:func:`kvtune.evaluate.calibrate_codebook.calibrate_codebooks`) from the run's
    ``calibration.json`` (``codebooks.<codebook_key>``: per layer the float16 levels) or, for
    the missing ones, from the KV of ``calibration_ids`` (``(N, T)`` int64 contexts, or a
    function returning them; prefilled once, on the first missing codebook), each new one
    added to ``calibration.json`` at once (atomic; a recorded one is never refitted).

    Raises:
        KvtuneError: an unreadable ``calibration.json``, or a ``codebooks`` entry that is not an
            object (never silently replaced by a new fit); ConfigError: a recorded table that
            the quantizer refuses or that does not cover the model's layers (an edited file;
            the message names the file and the entry); as
            :func:`~kvtune.evaluate.calibrate_codebook.fit_codebooks` for a new fit.
    """
    from kvtune.codecs.codebook import check_codebooks
    from kvtune.evaluate.calibrate_codebook import calibrate_codebooks, codebook_key
    from kvtune.evaluate.capture import capture

    path = run_dir / "calibration.json"

    @functools.cache
    def contexts():
        ids = calibration_ids() if callable(calibration_ids) else calibration_ids
        on_stage("capture KV for codebook calibration", 1)
        cap = capture(lm, ids, int(ids.shape[1]), baseline=False)
        on_progress(1)
        return [cap.context_kv(i) for i in range(cap.num_contexts)]

    def calibrate(config):
        doc = read_calibration(path)
        recorded = doc.get("codebooks", {})
        if not isinstance(recorded, dict):
            raise KvtuneError(f"{path}: codebooks must be an object mapping codebook keys to per-layer levels, "
                              f"got {type(recorded).__name__}")
        for kind in ("key", "value"):
            quant = getattr(config, kind)
            name = codebook_key(config, kind) if getattr(quant, "needs_codebooks", False) else None
            if name in recorded:
                try:
                    table = check_codebooks(recorded[name], quant.bits)
                except ConfigError as exc:
                    raise ConfigError(f"{path}: codebooks.{name} ({kind} codebooks of {config.label}): {exc}") from None
                if len(table) != lm.num_layers:
                    raise ConfigError(f"{path}: codebooks.{name} ({kind} codebooks of {config.label}) cover "
                                      f"{len(table)} layers; the model has {lm.num_layers}")
        cache = dict(recorded)
        config = calibrate_codebooks(config, contexts, cache)
        new = {k: [list(row) for row in v] for k, v in cache.items() if k not in recorded}
        if new:
            atomic_write_text(path, json.dumps({**doc, "codebooks": {**recorded, **new}}, indent=1))
        return config

    return calibrate


def calibrated_pca_bases(ropes, lm, calibration_ids: torch.Tensor | Callable[[], torch.Tensor], run_dir: Path,
                         on_stage: Hook = _noop, on_progress: Hook = _noop) -> dict[str, str]:
    """The run's PCA basis for each ``rope`` mode in ``ropes``, registered in this process
    (:func:`kvtune.codecs.pca.register_basis`); returns ``{rope: digest}``.

    A basis recorded in ``calibration.json`` (``pca_bases.<rope>``: ``digest``, ``file``) is
    read back from its file and checked against the digest. Otherwise it is fitted on
    ``calibration_ids`` (``(N, T)`` int64, or a function returning them, called once and only
    when a basis is fitted; :func:`kvtune.evaluate.calibrate_pca.calibrate_pca_basis`, across KV
    heads, keys pre- or post-RoPE), written to :data:`PCA_BASIS_FILES` ``[rope]`` (atomic; an
    existing file of that name is read instead, never replaced) and recorded in
    ``calibration.json``.

    Raises:
        KvtuneError: an unreadable ``calibration.json``; BasisError: a basis file that is
            malformed or not the recorded digest.
    """
    from kvtune.codecs.pca import load_basis, register_basis, save_basis
    from kvtune.evaluate.calibrate_pca import calibrate_pca_basis

    path = run_dir / "calibration.json"
    out = {}
    ids = functools.cache(calibration_ids if callable(calibration_ids) else lambda: calibration_ids)
    for rope in ropes:
        doc = read_calibration(path)
        entry = pca_basis_record(doc, rope, path)
        if entry is not None:
            basis = load_basis(run_dir / Path(entry["file"]).name, expect=entry["digest"])
        else:
            file = run_dir / PCA_BASIS_FILES[rope]
            if file.is_file():
                basis = load_basis(file)
            else:
                on_stage(f"fit PCA basis ({rope}-RoPE keys)", 1)
                basis = calibrate_pca_basis(lm, ids(), key_rope=rope)
                save_basis(basis, file)
                on_progress(1)
            bases = {**(doc.get("pca_bases") or {}), rope: {"digest": basis.digest, "file": file.name,
                                                          "mode": basis.mode}}
            atomic_write_text(path, json.dumps({**doc, "pca_bases": bases}, indent=1))
        out[rope] = register_basis(basis)
    return out


def pca_basis_record(doc: dict[str, Any], rope: str, path: Path) -> dict[str, str] | None:
    """The ``pca_bases.<rope>`` record of a run's calibration ``doc`` (read from ``path``), or
    None when there is none; a record is an object with string ``digest`` and ``file`` (the
    file's name is taken in the run folder).

    Raises:
        KvtuneError: ``pca_bases`` is not an object, or the record is malformed (it is never
            silently replaced by a new fit); the message names the file and the record.
    """
    bases = doc.get("pca_bases")
    if bases is None:
        return None
    if not isinstance(bases, dict):
        raise KvtuneError(f"{path}: pca_bases must be an object mapping rope modes to {{digest, file}}, "
                          f"got {type(bases).__name__}")
    entry = bases.get(rope)
    if entry is None:
        return None
    if not (isinstance(entry, dict) and isinstance(entry.get("digest"), str) and isinstance(entry.get("file"), str)):
        raise KvtuneError(f"{path}: pca_bases.{rope} must be an object with string 'digest' and 'file', got {entry!r}"[:300])
    return entry


def split_fidelities(trials: pd.DataFrame, search_fidelity: str) -> tuple[pd.DataFrame, pd.DataFrame, dict[str, Any]]:
    """Split a run's trials into the search rows and the rows the final Pareto front is built on.

    With a cheap search and a refinement, the final rows are the full-fidelity re-evaluations
    of the search's Pareto set; otherwise they are the search rows themselves.

    Returns:
        ``(searched, final, info)``; ``info`` has ``search``, ``final`` (fidelity names),
        ``refined`` (0 until there are full-fidelity rows), ``spearman_relative_accuracy``
        (None until then), and, once there are: ``full`` (their number), ``climbed`` (of
        them, those of the ``climb`` stage, :mod:`kvtune.search.climb`), ``refined`` (the
        others), ``paired`` (policies evaluated at both fidelities) and
        ``spearman_relative_accuracy``, the rank correlation of their cheap and full relative
        accuracies (None below 2). Runs written before climbing existed hold ``refined`` =
        the paired count and no ``paired``.
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
    climbed = int((full["stage"] == "climb").sum()) if "stage" in full else 0
    info.update(final="full", refined=len(full) - climbed, paired=len(both),
                spearman_relative_accuracy=None if rho != rho else round(rho, 4), full=len(full), climbed=climbed)
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


