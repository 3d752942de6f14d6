"""The run's trial store: nothing finished is ever lost.

Every finished trial is appended to ``trials.jsonl`` as one line, flushed and fsynced before
the next trial starts; ``trials.parquet`` is then rewritten from the whole log with an atomic
replace, so a reader never sees a half-written file. A run killed mid-trial loses only the
trial in flight; a truncated last line (a crash during the write) is ignored on load.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pandas as pd

from kvtune.atomic import atomic_write_parquet


class TrialStore:
    """Append-only log of trial records for one run folder.

    Args:
        run_dir: the run's folder (``profiles/<run>``); created if missing.
    """

    LOG = "trials.jsonl"
    TABLE = "trials.parquet"

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = self.run_dir / self.LOG

    def load(self) -> list[dict[str, Any]]:
        """All complete records, in the order they were written."""
        if not self.log_path.exists():
            return []
        records = []
        for line in self.log_path.read_text(encoding="utf-8").splitlines():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                continue  # a line cut short by a crash during its write
        return records

    def append(self, record: dict[str, Any]) -> None:
        """Durably append one trial, then refresh ``trials.parquet`` atomically."""
        line = json.dumps(record, sort_keys=True, default=float) + "\n"
        if self.log_path.exists() and self.log_path.stat().st_size:
            with open(self.log_path, "rb") as f:
                f.seek(-1, os.SEEK_END)
                if f.read(1) != b"\n":  # a crash cut the last line: end it so it stays alone
                    line = "\n" + line
        with open(self.log_path, "a", encoding="utf-8") as f:
            f.write(line)
            f.flush()
            os.fsync(f.fileno())
        self.write_table()

    def frame(self) -> pd.DataFrame:
        """The trials as a DataFrame (one row per record)."""
        return pd.DataFrame(self.load())

    def write_table(self) -> Path:
        """Rewrite ``trials.parquet`` from the log; returns its path."""
        path = self.run_dir / self.TABLE
        atomic_write_parquet(self.frame(), path)
        return path
