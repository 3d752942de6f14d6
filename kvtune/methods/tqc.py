"""``--method tqc``: Transform -> Quantize -> Codec KV compression search (KVServe, arXiv
2605.13734): :func:`kvtune.profile.run_profile` on the shared run machinery."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvtune.run.method import Method, ProfileRequest
from kvtune.settings import ProfileSettings


def _profile(req: ProfileRequest) -> Path:
    from kvtune.profile import load_settings, run_profile
    from kvtune.run.settings import parse_overrides

    if req.resume is not None:
        settings = load_settings(req.resume)
        settings.out, settings.run = str(req.resume.parent), req.resume.name
    else:
        settings = ProfileSettings(**{"out": str(req.out), "reports": str(req.reports), "run": req.run,
                                      "device": req.device, "seed": req.seed,
                                      **({"model": req.model} if req.model else {}),
                                      **parse_overrides(ProfileSettings, req.options)})
    result = run_profile(settings, resume=req.resume is not None, on_stage=req.on_stage, on_progress=req.on_progress)
    return result.settings.run_dir


def _compile_table(run_dir: Path, info: dict[str, Any], floors: Sequence[float] | None) -> Any:
    from kvtune.tables.run import compile_tqc_run_table

    return compile_tqc_run_table(run_dir, info, floors)


def _finalize(run_dir: Path) -> dict[str, Path]:
    from kvtune.profile import finalize_run

    return finalize_run(run_dir).files


METHOD = Method(name="tqc", description="KV compression search over Transform -> Quantize -> Codec policies",
                settings_class=ProfileSettings, profile=_profile, compile_table=_compile_table, finalize=_finalize)
