"""Settings of a profiling run: a versioned dataclass that round-trips through JSON.

Kept free of heavy imports so that the CLI can take its defaults from here.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from kvtune.evaluate.assets import DEFAULT_MODEL, DEFAULT_TEXT
from kvtune.run.settings import RunSettings

SETTINGS_VERSION = 2
"""Version 2 added the workload fields (``workload``, ``data``, ``samples``, ``cheap_samples``,
``max_new_tokens``, ``kv_dtype``, ``prompt_format``, ``search_fidelity``, ``refine``,
``refine_budget``; later ``climb_budget``, which settings written before it load with its
default); version-1 settings load with their defaults, which reproduce a version-1 run (the
``continuation`` workload)."""
READABLE_VERSIONS = (1, 2)


@dataclass(frozen=True)
class ProfileSettings(RunSettings):
    """Everything that defines a T/Q/C profiling run (saved as ``run.json``; frozen, versioned and
    round-trips through JSON like every method's settings, :class:`kvtune.run.settings.RunSettings`;
    derive changed settings with :func:`dataclasses.replace`).

    Attributes:
        model: ``--model`` spec (asset name, ``.gguf`` path, HF folder or id).
        text: ``--text`` spec (asset name, ``.txt`` file or folder): the essays of the
            ``continuation`` and ``needle`` workloads.
        space: ``--space`` name or YAML path.
        budget: maximum number of policies the search evaluates (0 = the whole space). The
            default, 56 of the default space's 358, is where a replay of the search on that
            space's exhaustive table (``benchmarks/search_refine_replay.py``) found a policy
            projected to clear 99 % at 5.95-6.62x for each of 10 seeds, refinement included (with 40:
            3.20-6.62x, mean 5.47x).
        contexts: N contexts of the ``continuation`` workload (its full-fidelity sample count
            unless ``samples`` is set); context_tokens: T tokens per context (``continuation``,
            ``needle``: exactly; ``qa``, ``boolq``, ``summarize``: at most, longer passages
            are not used); continuation_tokens: C tokens scored (``continuation``).
        workload: ``--workload``, a name in :data:`kvtune.evaluate.workloads.WORKLOADS`.
        data: ``--data``, the dataset of ``qa``/``boolq``/``summarize``: a named data asset or
            a JSONL file ("" = the workload's default asset).
        samples: samples evaluated at full fidelity (0 = the workload's default).
        cheap_samples: samples evaluated at cheap fidelity, the first ones of the full set
            (0 = the workload's default).
        max_new_tokens: generation budget at full fidelity (0 = the workload's default).
        kv_dtype: ``bfloat16`` (the default: captured KV rounded to bf16, as a bf16 server
            holds it, and stored in bf16, half the memory; the uncompressed policy is then
            exactly lossless) or ``model`` (KV as the model computes it, float32 on CPU).
            Version-2 settings written before the default changed hold their value; version-1
            settings load as ``model``.
        prompt_format: ``auto`` (the chat template when the tokenizer has one), ``chat`` or
            ``plain``.
        search_fidelity: ``cheap`` (the workload's teacher-forced score on ``cheap_samples``)
            or ``full``: the fidelity the optimizer sees.
        refine: re-evaluate the search's Pareto set at full fidelity; the tables and the report
            then use the full-fidelity results (no effect when ``search_fidelity`` is ``full``).
        refine_budget: at most this many Pareto policies are re-evaluated (0 = all), in the
            order of :func:`kvtune.methods.tqc.profile.refinement_order`.
        climb_budget: after the refinement, at most this many more policies are evaluated
            at full fidelity, one at a time, where a table floor is most likely to gain ratio
            (:mod:`kvtune.search.climb`; 0 = none; no climbing with the ``random`` and
            ``exhaustive`` optimizers, which skip the up-front ratio estimates).
        optimizer: registered optimizer name.
        device: ``auto``, ``cpu`` or ``cuda``.
        seed: seeds the optimizer (and anything random) so runs reproduce.
        floors: accuracy floors (fractions) of the compiled policy table.
        run: run name (folder under ``out``).
    """

    model: str = DEFAULT_MODEL
    text: str = DEFAULT_TEXT
    space: str = "default"
    budget: int = 56
    contexts: int = 24
    context_tokens: int = 1024
    continuation_tokens: int = 128
    optimizer: str = "mobo"
    device: str = "auto"
    seed: int = 0
    floors: tuple[float, ...] = (0.99, 0.97, 0.95, 0.90)
    workload: str = "continuation"
    data: str = ""
    samples: int = 0
    cheap_samples: int = 0
    max_new_tokens: int = 0
    kv_dtype: str = "bfloat16"
    prompt_format: str = "auto"
    search_fidelity: str = "cheap"
    refine: bool = True
    refine_budget: int = 16
    climb_budget: int = 4
    run: str = ""
    out: str = "profiles"
    reports: str = "reports"
    version: int = SETTINGS_VERSION

    VERSION: ClassVar[int] = SETTINGS_VERSION
    READABLE_VERSIONS: ClassVar[tuple[int, ...]] = READABLE_VERSIONS

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ProfileSettings":
        """Rebuild settings saved by :meth:`to_dict`.

        Version-1 settings (before workloads) are upgraded: the new fields take their
        defaults, i.e. the ``continuation`` workload the run used.

        Raises:
            KvtuneError: an unreadable settings version, unknown keys, or a value of the wrong
                type (e.g. a string budget, floors that are not a list of numbers).
        """
        cls.check_dict(d)
        if d.get("version") == 1:  # version-1 runs evaluated every policy on all contexts, on float32 KV
            d = {"search_fidelity": "full", "kv_dtype": "model", **d}
        return super().from_dict(d)

    @property
    def run_dir(self) -> Path:
        return Path(self.out) / self.run

    @property
    def report_path(self) -> Path:
        return Path(self.reports) / f"{self.run}.html"
