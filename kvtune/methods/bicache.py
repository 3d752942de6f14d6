"""``--method bicache``: shared-prefix reuse depth for bidirectional encoders (BiCache,
"Enabling KV Caching of Shared Prefix for Diffusion Language Models", arXiv 2606.07571):
:func:`kvtune.bicache.api.run_bicache_profile` on the shared run machinery."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvtune.bicache.api import BiCacheSettings
from kvtune.run.method import Method, ProfileRequest


def _profile(req: ProfileRequest) -> Path:
    from kvtune.bicache.api import run_bicache_profile
    from kvtune.run.folder import check_run_name
    from kvtune.run.settings import parse_overrides
    from kvtune.tables.run import read_run_info

    reports = req.reports
    if req.resume is not None:
        info = read_run_info(req.resume)
        settings = BiCacheSettings.from_dict(info.get("settings") or {})
        run_dir, reports = req.resume, info.get("reports") or reports
    else:
        overrides = {"seed": req.seed, "device": "cpu" if req.device == "auto" else req.device,
                     **({"model": req.model} if req.model else {}), **parse_overrides(BiCacheSettings, req.options)}
        settings = BiCacheSettings(**overrides)
        run_dir = req.out / check_run_name(req.run or f"bicache-{Path(settings.model).name}")
    run_bicache_profile(settings, run_dir, on_stage=req.say, reports=reports, resume=req.resume is not None)
    return run_dir


def _compile_table(run_dir: Path, info: dict[str, Any], floors: Sequence[float] | None) -> Any:
    from kvtune.bicache.api import recompile_run_table

    return recompile_run_table(run_dir, floors=floors)[0]


def _finalize(run_dir: Path) -> dict[str, Path]:
    from kvtune.bicache.api import finalize_bicache_run

    return finalize_bicache_run(run_dir)


METHOD = Method(name="bicache", description="shared-prefix KV reuse depth for bidirectional encoders (BiCache)",
                settings_class=BiCacheSettings, profile=_profile, compile_table=_compile_table, finalize=_finalize)
