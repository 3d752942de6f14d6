"""``--method tqc``: Transform -> Quantize -> Codec KV compression search (KVServe,
"KVServe: Service-Aware KV Cache Compression for Communication-Efficient Disaggregated LLM
Serving", arXiv 2605.13734) on the shared runner (:mod:`kvtune.run.runner`).

Context: the model, the workload (prefilled samples, the uncompressed baseline), the space
(MixHQ heads calibrated when it needs them) and the ratio estimates of model-based optimizers;
the driver of a Ray run keeps it without the model and the workload (:meth:`TQCMethod.driver_view`).
Stages: ``search`` (the space at ``search_fidelity`` with ``settings.optimizer``), then
``refine`` (the search's Pareto set again at full fidelity, :func:`kvtune.methods.tqc.profile.refinement_order`),
then ``climb`` (up to ``climb_budget`` more full-fidelity evaluations, one at a time:
:mod:`kvtune.search.climb`).
Table: the Pareto front of the final-fidelity rows, gated on the 95 % interval's lower end
(:func:`kvtune.tables.run.interval_gate`), with the implicit ``"none"`` policy.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvtune.run.method import Compiled, Hooks, Method, ProfileRequest, Stage
from kvtune.methods.tqc.settings import ProfileSettings

log = logging.getLogger(__name__)


@dataclass
class TQCContext:
    """What :meth:`TQCMethod.prepare` builds once per run (``lm`` and ``workload`` are None in
    a :meth:`TQCMethod.driver_view`); ``times``: seconds by phase (``run.json``'s
    ``timing_seconds``)."""

    settings: ProfileSettings
    lm: Any
    workload: Any
    space: Any
    ratios: Any
    info: dict[str, Any]
    times: dict[str, float] = field(default_factory=dict)


class TQCMethod(Method):
    """The T/Q/C policy search (module docstring)."""

    name = "tqc"
    description = "KV compression search over Transform -> Quantize -> Codec policies"
    settings_class = ProfileSettings
    report_title = "kvtune profile"

    def settings_for(self, request: ProfileRequest) -> ProfileSettings:
        from kvtune.run.settings import parse_overrides

        return ProfileSettings(**{"out": str(request.out_folder), "reports": str(request.reports_folder),
                                  "run": request.run,
                                  "device": request.device, "seed": request.seed,
                                  **({"model": request.model} if request.model else {}),
                                  **parse_overrides(ProfileSettings, request.options)})

    def run_name(self, settings: ProfileSettings) -> str:
        from kvtune.methods.tqc.profile import default_run_name

        return default_run_name(settings)

    def check(self, settings: ProfileSettings) -> None:
        from kvtune.methods.tqc.profile import check_profile_settings

        check_profile_settings(settings)

    def setup_parts(self, settings: ProfileSettings, workers: int) -> int:
        """The workload's parts (:func:`kvtune.evaluate.workloads.workload_part_count`): with
        ``continuation``, one per worker up to one per forward batch of contexts."""
        from kvtune.evaluate.workloads import workload_part_count

        return workload_part_count(settings.workload, settings, workers)

    def check_workers(self, settings: ProfileSettings, workers: int) -> None:
        """Refuse ``workers`` contexts on this machine that do not fit in its memory
        (:func:`kvtune.methods.tqc.profile.check_profile_memory`).

        Raises:
            ConfigError: the message gives the estimate per worker and names the settings to lower.
        """
        from kvtune.evaluate.workloads import workload_sample_counts
        from kvtune.methods.tqc.profile import check_profile_memory

        n_full, _ = workload_sample_counts(settings.workload, settings)
        check_profile_memory(settings, n_full, workers=workers)

    def prepare_part(self, settings: ProfileSettings, run_dir: Path, hooks: Hooks, index: int, count: int,
                     **given: Any) -> tuple[Any, dict[str, Any]]:
        """Load the model (unless given as ``lm``) and build part ``index`` of ``count`` of the
        workload's prefill and baseline (:func:`kvtune.evaluate.workloads.build_workload_part`);
        returns the part and, for this worker's :meth:`prepare`, ``{"lm": model,
        "setup_started": perf_counter() when this began}`` (so the context's
        ``load_and_prefill`` time counts the part)."""
        import torch

        from kvtune.core.allocator import limit_heap_retention
        from kvtune.evaluate.model import load_model
        from kvtune.evaluate.workloads import build_workload_part

        t_start = time.perf_counter()
        torch.manual_seed(settings.seed)
        limit_heap_retention()
        hooks.on_stage("load model", 1)
        lm = given.get("lm") or load_model(settings.model, settings.device)
        hooks.on_progress(1)
        hooks.on_stage(f"prefill {settings.workload} samples (part {index + 1} of {count})", 0)
        part = build_workload_part(settings.workload, lm, settings=settings, index=index, count=count,
                                   progress=lambda n: hooks.on_progress(n))
        return part, {"lm": lm, "setup_started": t_start}

    def prepare(self, settings: ProfileSettings, run_dir: Path, hooks: Hooks, *, parts: Sequence[Any] | None = None,
                **given: Any) -> TQCContext:
        """Load the model (unless given as ``lm``), prefill the workload's samples and run its
        baseline (or assemble them from ``parts``: :meth:`prepare_part`), calibrate the space
        when it needs it and estimate the candidates' ratios (module docstring)."""
        import platform

        import torch

        from kvtune import __version__
        from kvtune.core.allocator import limit_heap_retention, release_free_memory
        from kvtune.evaluate.memory import ModelShape, estimate_profile_memory
        from kvtune.evaluate.model import load_model
        from kvtune.evaluate.ratio import estimate_ratios
        from kvtune.evaluate.workloads import make_workload, workload_sample_counts
        from kvtune.search.optimizers import OPTIMIZERS
        from kvtune.methods.tqc.profile import calibrated_space, runnable_space
        from kvtune.search.space import load_space

        torch.manual_seed(settings.seed)
        limit_heap_retention()  # freed prefill/baseline/batch tensors go back to the system
        t_start = given.get("setup_started", time.perf_counter())
        space = load_space(settings.space)
        n_full, _ = workload_sample_counts(settings.workload, settings)
        hooks.on_stage("load model", 1)
        lm = given.get("lm") or load_model(settings.model, settings.device)
        hooks.on_progress(1)
        hooks.on_stage(f"prefill {settings.workload} samples", n_full)
        wl = make_workload(settings.workload, lm, settings=settings, progress=lambda n: hooks.on_progress(n),
                           parts=parts)
        if wl.cheap_is_full:  # e.g. --samples equal to --cheap-samples: search at full, nothing to refine
            settings = dataclasses.replace(settings, search_fidelity="full")
        space, dropped = runnable_space(space, wl)
        for line in dropped:
            log.warning("space %s: %s", space.name, line)
        space = calibrated_space(space, lm, wl.calibration_ids(), run_dir, hooks.on_stage, hooks.on_progress,
                                 pca_ids=wl.pca_calibration_ids)  # windows apart from the evaluated ones
        ratios = None
        if getattr(OPTIMIZERS[settings.optimizer], "needs_ratios", True):  # model-based optimizers use them
            # the first candidates compile the codec kernels they use (minutes, once per kvtune version)
            hooks.on_stage("estimate ratios (the first ones compile the codec kernels if not cached)", len(space))
            ratios = estimate_ratios([c.config for c in space.candidates], wl.kv_sample(), progress=hooks.on_progress)
        info = {
            "settings": settings.to_dict(),
            "space": {"name": space.name, "path": str(space.path), "candidates": len(space), "left_out": dropped},
            "model_info": lm.describe(),
            "workload": settings.workload,
            "workload_info": wl.describe(),
            "versions": {"kvtune": __version__, "torch": torch.__version__, "python": platform.python_version()},
            "host": {"machine": platform.machine(), "threads": torch.get_num_threads()},
            "memory_estimate": estimate_profile_memory(
                ModelShape.from_config(lm.config), contexts=n_full, context_tokens=settings.context_tokens,
                continuation_tokens=settings.continuation_tokens, kv_dtype=settings.kv_dtype,
                workload=settings.workload).parts,
        }
        release_free_memory()
        ctx = TQCContext(settings=settings, lm=lm, workload=wl, space=space, ratios=ratios, info=info)
        ctx.times["load_and_prefill"] = time.perf_counter() - t_start
        return ctx

    def driver_view(self, context: TQCContext) -> TQCContext:
        """The context without the model and the workload: the settings (search at full
        fidelity when the workload's cheap samples are its full ones), the space with its
        calibrated MixHQ head scores, the ratio estimates, ``run.json``'s keys and the times."""
        return dataclasses.replace(context, lm=None, workload=None, times=dict(context.times))

    def context_fingerprint(self, context: TQCContext) -> str:
        """SHA-256 of the calibrated space's policy ids in order (they hold the MixHQ head
        scores and the PCA bases' digests)."""
        import hashlib

        return hashlib.sha256("\n".join(c.policy_id for c in context.space.candidates).encode()).hexdigest()

    def run_info(self, context: TQCContext) -> dict[str, Any]:
        return context.info

    def stages(self, context: TQCContext, stored: list[dict[str, Any]]) -> Iterator[Stage]:
        import pandas as pd

        from kvtune.search.optimizers import make_optimizer
        from kvtune.search.pareto import pareto_front
        from kvtune.methods.tqc.profile import done_by_fidelity, refinement_order
        from kvtune.run.loop import in_order

        t_started = time.perf_counter()
        st, space = context.settings, context.space
        done = done_by_fidelity(stored)
        fid = st.search_fidelity
        optimizer = make_optimizer(st.optimizer, space, seed=st.seed, ratios=context.ratios,
                                   device=search_device(st.device, context.lm))
        budget = len(space) if st.budget <= 0 else min(st.budget, len(space))
        yield Stage("search", space.candidates, optimizer, budget, done.get(fid, {}),
                    title=f"evaluate policies ({fid})")
        t_searched = time.perf_counter()
        context.times["search"] = t_searched - t_started
        if st.refine and fid != "full":
            front = pareto_front(pd.DataFrame(list(optimizer.told.values())))
            by_id = {c.policy_id: c for c in space.candidates}
            chosen = [by_id[pid] for pid in refinement_order(front, st.refine_budget, tuple(st.floors))]
            full = done.get("full", {})
            refine = in_order(chosen)
            yield Stage("refine", chosen, refine, len(chosen),
                        {c.policy_id: full[c.policy_id] for c in chosen if c.policy_id in full},
                        title="re-evaluate Pareto set (full)")
            context.times["refine"] = time.perf_counter() - t_searched
            t_refined = time.perf_counter()
            yield from self.climb(context, {r["policy_id"]: r for r in optimizer.told.values()},
                                  {**full, **{r["policy_id"]: r for r in refine.told.values()}}, stored)
            context.times["climb"] = time.perf_counter() - t_refined
        else:
            context.times["refine"] = time.perf_counter() - t_searched

    def climb(self, context: TQCContext, cheap: dict[str, dict[str, Any]], full: dict[str, dict[str, Any]],
              stored: list[dict[str, Any]]) -> Iterator[Stage]:
        """Floor climbing (:mod:`kvtune.search.climb`): after the refinement, up to
        ``settings.climb_budget`` more full-fidelity evaluations, one at a time, each picked
        from the results so far (``cheap`` and ``full``: trial rows by policy id; a resumed run
        counts its stored ``climb`` rows against the budget). Nothing without the up-front
        ratio estimates."""
        from kvtune.core.errors import SpaceError
        from kvtune.run.loop import in_order
        from kvtune.search.climb import MAX_GROUP, MIN_GAIN, climb_pick

        st, space = context.settings, context.space
        if st.climb_budget <= 0:
            return
        if context.ratios is None:
            log.warning("no floor climbing: --optimizer %s skips the up-front ratio estimates it needs", st.optimizer)
            return
        try:
            groups = space.precision_groups(max_size=MAX_GROUP)
        except SpaceError as exc:
            log.warning("no floor climbing: %s", exc)
            return
        position = {c.policy_id: i for i, c in enumerate(space.candidates)}
        full_at = {position[pid]: r for pid, r in full.items() if pid in position}
        cheap_at = {position[pid]: r for pid, r in cheap.items() if pid in position}
        used = sum(1 for r in stored if r.get("stage") == "climb")
        device = search_device(st.device, context.lm)
        for _ in range(used, st.climb_budget):
            pick = climb_pick(space, context.ratios, full_at, st.floors, cheap=cheap_at, groups=groups, device=device)
            if pick is None:
                log.info("floor climbing stops: no policy is expected to raise a floor's ratio by %.0f %%", 100 * MIN_GAIN)
                return
            cand = space.candidates[pick.index]
            step = in_order([cand])
            yield Stage("climb", [cand], step, 1,
                        title=(f"climb toward {100 * pick.floor:g} %: {pick.ratio:.2f}x, P(clears) {pick.probability:.2f} "
                               f"(best {pick.best_ratio:.2f}x) (full)"))
            full_at.update({pick.index: r for r in step.told.values()})

    def evaluate(self, context: TQCContext, candidate: Any, stage: Stage) -> dict[str, Any]:
        from kvtune.methods.tqc.profile import trial_record

        fid = context.settings.search_fidelity if stage.name == "search" else "full"
        return trial_record(stage.name, candidate, context.workload.evaluate(candidate.config, fidelity=fid),
                            context.ratios)

    def describe_row(self, row: dict[str, Any]) -> str:
        from kvtune.methods.tqc.profile import progress_line

        return progress_line(row)

    def finish(self, context: TQCContext) -> dict[str, Any]:
        return {"timing_seconds": dict(context.times)}

    def compile(self, run_dir: Path, info: dict[str, Any], records: list[dict[str, Any]],
                floors: Sequence[float] | None = None) -> Compiled:
        import pandas as pd

        from kvtune.search.pareto import pareto_front
        from kvtune.methods.tqc.profile import check_trials, run_settings, split_fidelities
        from kvtune.run.store import TrialStore

        settings = run_settings(info, run_dir / "run.json")
        trials = pd.DataFrame(records)
        check_trials(trials, run_dir / TrialStore.LOG)
        searched, final, fidelity_info = split_fidelities(trials, settings.search_fidelity)
        pareto = pareto_front(final)
        table = run_policy_table(pareto, run_dir, info, model=settings.model,
                                 floors=settings.floors if floors is None else tuple(floors))
        return Compiled(trials=trials, points=final, table=table, pareto=pareto, shown=searched,
                        info={"fidelity": fidelity_info, "trials": len(trials)})

    def compile_table(self, run_dir: Path, info: dict[str, Any], floors: Sequence[float] | None = None) -> Any:
        """From ``pareto.parquet`` (or, if that is missing, the Pareto front of
        ``trials.parquet``), so folders holding only the Parquet files recompile too; floors
        default to the run's configured ones, else 99/97/95/90 %.

        Raises:
            KvtuneError: settings of another method (:meth:`~kvtune.run.method.Method.stored_settings`),
                neither file exists, or one cannot be read (the message names it).
            TableError: see :func:`~kvtune.tables.policy_table.compile_policy_table`.
        """
        from kvtune.core.errors import KvtuneError
        from kvtune.search.pareto import pareto_front
        from kvtune.tables.policy_table import DEFAULT_FLOORS
        from kvtune.tables.run import read_run_frame

        self.stored_settings(run_dir, info)  # a run of another method never compiles as T/Q/C
        if (run_dir / "pareto.parquet").is_file():
            pareto = read_run_frame(run_dir / "pareto.parquet")
        elif (run_dir / "trials.parquet").is_file():
            pareto = pareto_front(read_run_frame(run_dir / "trials.parquet"))
        else:
            raise KvtuneError(f"{run_dir}: no policy_table.parquet, pareto.parquet or trials.parquet")
        settings = info.get("settings") or {}
        return run_policy_table(pareto, run_dir, info, model=str(settings.get("model") or "unknown"),
                                floors=tuple(floors) if floors is not None else
                                tuple(settings.get("floors") or DEFAULT_FLOORS))

    def reports_folder(self, info: dict[str, Any]) -> Path | None:
        return Path(ProfileSettings.from_dict(info["settings"]).reports)



def search_device(device: str, lm: Any) -> Any:
    """Where the driver's optimizer fits its Gaussian processes: the model's device when the
    driver holds the model, else (trials on Ray workers) CUDA if ``--device`` allows it and
    this process sees a GPU, else the CPU."""
    import torch

    if lm is not None:
        return lm.device
    return torch.device("cuda" if device in ("auto", "cuda") and torch.cuda.is_available() else "cpu")


def run_policy_table(pareto: Any, run_dir: Path, info: dict[str, Any], *, model: str, floors: Sequence[float]) -> Any:
    """The T/Q/C policy table of a run's Pareto rows: with the implicit ``"none"``, workload and
    device from ``run.json``, the run's metadata (:func:`kvtune.tables.run.run_table_metadata`)
    and floors gated by :func:`kvtune.tables.run.interval_gate`.

    Raises:
        TableError: see :func:`~kvtune.tables.policy_table.compile_policy_table`.
    """
    from kvtune.tables.policy_table import compile_policy_table
    from kvtune.tables.run import interval_gate, run_table_metadata

    model_info = info.get("model_info")
    return compile_policy_table(pareto, floors=floors, model=model, workload=str(info.get("workload") or "continuation"),
                                device=str((model_info if isinstance(model_info, dict) else {}).get("device") or "cpu"),
                                metadata=run_table_metadata(run_dir, info), gate=interval_gate(pareto, info))
