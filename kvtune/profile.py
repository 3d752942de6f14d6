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

import dataclasses
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
from kvtune.assets import DEFAULT_MODEL, DEFAULT_TEXT, read_texts
from kvtune.errors import KvtuneError
from kvtune.evaluate.capture import build_contexts, capture
from kvtune.evaluate.evaluator import ContinuationEvaluator
from kvtune.evaluate.model import load_model
from kvtune.optimize import make_optimizer
from kvtune.pareto import pareto_front
from kvtune.report.html import write_report
from kvtune.space import load_space
from kvtune.atomic import atomic_write_parquet, atomic_write_text
from kvtune.store import TrialStore
from kvtune.tables.policy_table import compile_policy_table

SETTINGS_VERSION = 1


@dataclass
class ProfileSettings:
    """Everything that defines a profiling run (saved as ``run.json``; round-trips through JSON).

    Attributes:
        model: ``--model`` spec (asset name, ``.gguf`` path, HF folder or id).
        text: ``--text`` spec (asset name, ``.txt`` file or folder).
        space: ``--space`` name or YAML path.
        budget: maximum number of policies evaluated (0 = the whole space).
        contexts: N contexts; context_tokens: T tokens each; continuation_tokens: C tokens scored.
        optimizer: registered optimizer name.
        device: ``auto``, ``cpu`` or ``cuda``.
        seed: seeds the optimizer (and anything random) so runs reproduce.
        floors: accuracy floors (fractions) of the compiled policy table.
        run: run name (folder under ``out``).
    """

    model: str = DEFAULT_MODEL
    text: str = DEFAULT_TEXT
    space: str = "default"
    budget: int = 40
    contexts: int = 8
    context_tokens: int = 1024
    continuation_tokens: int = 128
    optimizer: str = "random"
    device: str = "auto"
    seed: int = 0
    floors: tuple[float, ...] = (0.99, 0.97, 0.95, 0.90)
    run: str = ""
    out: str = "profiles"
    reports: str = "reports"
    version: int = SETTINGS_VERSION

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["floors"] = list(self.floors)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ProfileSettings":
        """Rebuild settings saved by :meth:`to_dict`.

        Raises:
            KvtuneError: another settings version, or unknown keys.
        """
        if d.get("version") != SETTINGS_VERSION:
            raise KvtuneError(f"run settings version {d.get('version')!r} is not {SETTINGS_VERSION}; re-run the profile")
        unknown = set(d) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise KvtuneError(f"run settings have unknown keys {sorted(unknown)}")
        d = dict(d)
        d["floors"] = tuple(d.get("floors", cls.floors))
        return cls(**d)

    @property
    def run_dir(self) -> Path:
        return Path(self.out) / self.run

    @property
    def report_path(self) -> Path:
        return Path(self.reports) / f"{self.run}.html"


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
        KvtuneError: the folder has no readable ``run.json``.
    """
    path = Path(run_dir) / "run.json"
    if not path.is_file():
        raise KvtuneError(f"--resume {run_dir}: no run.json there; is it a kvtune run folder?")
    return ProfileSettings.from_dict(json.loads(path.read_text())["settings"])


Hook = Callable[..., None]


def _noop(*_: Any, **__: Any) -> None:
    return None


def run_profile(settings: ProfileSettings, *, resume: bool = False, on_stage: Hook = _noop,
                on_progress: Hook = _noop) -> ProfileResult:
    """Run (or resume) a profile and write all outputs.

    Args:
        settings: the run's settings; ``settings.run`` is filled in when empty.
        resume: continue the trials already in the run folder (never re-evaluating a policy).
        on_stage: ``on_stage(name, total)`` when a stage with ``total`` steps starts.
        on_progress: ``on_progress(n=1, info=str)`` after each step of the current stage.

    Raises:
        KvtuneError (and subclasses): bad settings, assets, spaces or models.
    """
    settings.run = settings.run or default_run_name(settings)
    run_dir = settings.run_dir
    if not resume and (run_dir / TrialStore.LOG).exists():
        raise KvtuneError(f"run folder {run_dir} already has trials; use --resume {run_dir} or another --run name")
    torch.manual_seed(settings.seed)
    t_start = time.perf_counter()
    space = load_space(settings.space)
    store = TrialStore(run_dir)
    done = {r["policy_id"]: r for r in store.load()}

    on_stage("load model", 1)
    lm = load_model(settings.model, settings.device)
    on_progress(1)
    docs = read_texts(settings.text)
    ids = build_contexts(lm.tokenizer, docs, n_contexts=settings.contexts, context_tokens=settings.context_tokens,
                         continuation_tokens=settings.continuation_tokens)
    on_stage("prefill + baseline", settings.contexts)
    cap = capture(lm, ids, settings.context_tokens, progress=lambda n: on_progress(n))
    evaluator = ContinuationEvaluator(lm, cap)
    t_capture = time.perf_counter() - t_start

    run_info = {
        "settings": settings.to_dict(),
        "space": {"name": space.name, "path": str(space.path), "candidates": len(space)},
        "model_info": lm.describe(),
        "workload": evaluator.workload,
        "versions": {"kvtune": __version__, "torch": torch.__version__, "python": platform.python_version()},
        "host": {"machine": platform.machine(), "threads": torch.get_num_threads()},
    }
    atomic_write_text(run_dir / "run.json", json.dumps(run_info, indent=2))

    optimizer = make_optimizer(settings.optimizer, space.candidates, seed=settings.seed)
    for cand in space.candidates:
        if cand.policy_id in done:
            optimizer.tell(cand, done[cand.policy_id])
    budget = len(space) if settings.budget <= 0 else min(settings.budget, len(space))
    remaining = max(budget - len(done), 0)
    on_stage("evaluate policies", remaining)
    for _ in range(remaining):
        cand = optimizer.ask()
        if cand is None:
            break
        result = evaluator.evaluate(cand.config)
        record = {
            "trial": len(optimizer.told),
            "policy_id": cand.policy_id,
            "label": cand.config.label,
            "method": "tqc",
            "config_json": cand.config.to_json(),
            **{f"param.{k}": v for k, v in cand.params.items()},
            **result,
        }
        store.append(record)
        optimizer.tell(cand, record)
        on_progress(1, info=f"{record['label']}  CR {record['compression_ratio']:.2f}x  "
                            f"acc {100 * record['relative_accuracy']:.1f}%")

    on_stage("pareto + tables + report", 1)
    trials = store.frame()
    files = {"run": run_dir / "run.json", "trials": store.write_table()}
    pareto = pareto_front(trials)
    files["pareto"] = run_dir / "pareto.parquet"
    atomic_write_parquet(pareto, files["pareto"])
    table = compile_policy_table(pareto, floors=settings.floors, model=settings.model,
                                 workload=evaluator.workload, device=str(lm.device))
    files["policy_table"] = run_dir / "policy_table.parquet"
    files["policy_table_json"] = run_dir / "policy_table.json"
    table.to_parquet(files["policy_table"])
    table.to_json(files["policy_table_json"])
    run_info["timing_seconds"] = {"load_and_capture": t_capture, "total": time.perf_counter() - t_start}
    run_info["trials"] = len(trials)
    atomic_write_text(run_dir / "run.json", json.dumps(run_info, indent=2))
    files["report"] = write_report(trials, pareto, table, settings.report_path,
                                   title=f"kvtune profile: {settings.run}", run_config=run_info)
    on_progress(1)
    return ProfileResult(settings=settings, trials=trials, pareto=pareto, table=table, files=files)
