"""The run's trial store: nothing finished is ever lost.

Every finished trial is appended to ``trials.jsonl`` as one line, flushed and fsynced before
the next trial starts; ``trials.parquet`` is then rewritten from the whole log with an atomic
replace, so a reader never sees a half-written file. A run killed mid-trial loses only the
trial in flight: a truncated last line (a crash during the write) is dropped with a warning on
load and cut off before the next append. Any other unreadable line means the log was corrupted
or edited, and loading it is an error rather than a silent loss of that trial.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

import pandas as pd

from kvtune.core.atomic import atomic_write_parquet
from kvtune.core.errors import KvtuneError

log = logging.getLogger(__name__)


def _parse(raw: bytes) -> dict[str, Any] | str:
    """One log line as a record, or why it is not one."""
    try:
        rec = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        return "not UTF-8 text"
    except ValueError as exc:
        return f"not valid JSON ({exc})"
    return rec if isinstance(rec, dict) else f"not a JSON object (got {type(rec).__name__})"


class TrialStore:
    """Append-only log of trial records for one run folder.

    Args:
        run_dir: the run's folder (``profiles/<run>``); created if missing.
        table: refresh ``trials.parquet`` after each append (False for records that do not
            form a flat table, such as BiCache's one record per prefix-ratio bucket).
    """

    LOG = "trials.jsonl"
    TABLE = "trials.parquet"

    def __init__(self, run_dir: Path, *, table: bool = True) -> None:
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = self.run_dir / self.LOG
        self.table = table

    def load(self) -> list[dict[str, Any]]:
        """All complete records, in the order they were written.

        A last line without its newline that does not parse (a crash cut its write short: the
        trial in flight) is dropped with a logged warning. Blank lines are ignored.

        Raises:
            KvtuneError: any other line is not a JSON object (garbled, not UTF-8, a torn line
                that is no longer the last one); the message names the file and line number.
        """
        if not self.log_path.exists():
            return []
        lines = self.log_path.read_bytes().split(b"\n")
        records = []
        for no, raw in enumerate(lines, 1):
            if not raw.strip():
                continue
            rec = _parse(raw)
            if isinstance(rec, dict):
                records.append(rec)
            elif no == len(lines):  # no newline after it: the write was cut short by a crash
                log.warning("%s:%d: dropping a torn last line (a trial whose write was interrupted): %s",
                            self.log_path, no, rec)
            else:
                raise KvtuneError(f"{self.log_path}:{no}: line {no} is not a trial record: {rec}; the log was "
                                  "corrupted or edited (fix or delete that line)")
        return records

    def append(self, record: dict[str, Any]) -> None:
        """Durably append one trial, then refresh ``trials.parquet`` atomically.

        A torn last line left by a crash is cut off first, so it never ends up in the middle
        of the log.
        """
        line = json.dumps(record, sort_keys=True, default=float) + "\n"
        if self.log_path.exists() and self.log_path.stat().st_size:
            data = self.log_path.read_bytes()
            if not data.endswith(b"\n"):  # a crash cut the last line short, or only its newline
                cut = data.rfind(b"\n") + 1
                if isinstance(_parse(data[cut:]), dict):
                    line = "\n" + line
                else:
                    log.warning("%s: dropping a torn last line (a trial whose write was interrupted)", self.log_path)
                    with open(self.log_path, "rb+") as f:
                        f.truncate(cut)
                        f.flush()
                        os.fsync(f.fileno())
        with open(self.log_path, "a", encoding="utf-8") as f:
            f.write(line)
            f.flush()
            os.fsync(f.fileno())
        if self.table:
            self.write_table()

    def frame(self) -> pd.DataFrame:
        """The trials as a DataFrame (one row per record).

        Raises:
            KvtuneError: see :meth:`load`.
        """
        return pd.DataFrame(self.load())

    def write_table(self, frame: pd.DataFrame | None = None) -> Path:
        """Rewrite ``trials.parquet`` from the log (or from ``frame``, the log already loaded
        with :meth:`frame`); returns its path.

        Raises:
            KvtuneError: see :meth:`load`; or the records cannot form a table (a column whose
                values mix types, such as a number in one record and text in another).
        """
        import pyarrow as pa

        path = self.run_dir / self.TABLE
        try:
            atomic_write_parquet(self.frame() if frame is None else frame, path)
        except (pa.ArrowException, TypeError, ValueError) as exc:
            raise KvtuneError(f"{self.log_path}: the trial records cannot form {self.TABLE} "
                              f"(a column mixes value types?): {exc}") from None
        return path
