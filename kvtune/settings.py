"""Settings of a profiling run: a versioned dataclass that round-trips through JSON.

Kept free of heavy imports so that the CLI can take its defaults from here.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvtune.assets import DEFAULT_MODEL, DEFAULT_TEXT
from kvtune.errors import KvtuneError

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
