"""``--method scd``: cross-model KV transfer from a base producer to a fine-tuned consumer
(SCD, "Semantic Cache Distillation", arXiv 2606.07684): :func:`kvtune.scd.run_scd_profile`
on the shared run machinery (run folder, trial store with resume, one table compiler, report).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvtune.run.method import Method, ProfileRequest
from kvtune.scd.profile import SCDProfileSettings


def _profile(req: ProfileRequest) -> Path:
    from kvtune.assets import DEFAULT_MODEL
    from kvtune.run.folder import check_run_name
    from kvtune.run.settings import parse_overrides
    from kvtune.scd import ConsumerRecipe, make_consumer, run_scd_profile
    from kvtune.tables.run import read_run_info

    reports = req.reports
    if req.resume is not None:
        info = read_run_info(req.resume)
        reports = info.get("reports") or reports
        settings = SCDProfileSettings.from_dict(info.get("settings") or {})
        producer, consumer, run_dir = info["producer_spec"], info["consumer_spec"], req.resume
    else:
        overrides = {"device": "cpu" if req.device == "auto" else req.device, "seed": req.seed,
                     **parse_overrides(SCDProfileSettings, req.options)}
        settings = SCDProfileSettings(**overrides)
        producer = req.model or DEFAULT_MODEL
        run_dir = req.out / check_run_name(req.run or f"scd-{Path(producer).stem}")
        req.say("consumer: LoRA fine-tune of the producer (cached after the first run)")
        consumer = str(make_consumer(ConsumerRecipe(producer=producer), device=settings.device).path)
    run_scd_profile(producer, consumer, run_dir, settings=settings, progress=req.say, resume=req.resume is not None,
                    reports=reports)
    return run_dir


def _compile_table(run_dir: Path, info: dict[str, Any], floors: Sequence[float] | None) -> Any:
    from kvtune.scd.profile import compile_scd_table
    from kvtune.store import TrialStore

    return compile_scd_table(TrialStore(run_dir).frame(), info, floors)


def _finalize(run_dir: Path) -> dict[str, Path]:
    from kvtune.scd.profile import finalize_scd_run

    return finalize_scd_run(run_dir)


METHOD = Method(name="scd", description="cross-model KV transfer (SCD) from a producer to a fine-tuned consumer",
                settings_class=SCDProfileSettings, profile=_profile, compile_table=_compile_table,
                finalize=_finalize)
