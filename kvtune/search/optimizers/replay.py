"""Replay objective: answer evaluations from a table of fully evaluated candidates.

Evaluating a candidate on the real model takes seconds to minutes; a *replay table* holds the
result of every candidate of a space, evaluated once (``kvtune/search/spaces/full.yaml`` on the
default model, ``benchmarks/data/full_replay.parquet``), so optimizers can be compared in
seconds against the exhaustive answer (the BoTorch habit: benchmark problems carry their known
optimum).

The table has one row per candidate: ``policy_id`` plus the trial result columns
``relative_accuracy`` (fraction), optionally ``relative_accuracy_lo`` (lower bound of its 95 %
interval), ``compression_ratio``, ``encode_gbps`` and ``decode_gbps`` (GB/s of original KV).

Hypervolumes here use **normalized objectives with a fixed reference point** (documented in
:class:`HypervolumeSpec`): accuracy as is, compression ratio as is, codec latency
(``1 / encode_gbps + 1 / decode_gbps``, s/GB) divided by the table's largest latency; the
reference point is (accuracy 0.5, ratio 1.0 = no compression, latency 1.1 x the table's
worst). A ratio of hypervolumes (found / exhaustive) does not depend on the per-objective
scaling, only on the reference point, which is fixed per table.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from kvtune.core.errors import KvtuneError
from kvtune.search.pareto import hypervolume, non_dominated_mask
from kvtune.search.space import Candidate, SearchSpace

__all__ = ["REQUIRED_COLUMNS", "HypervolumeSpec", "ReplayObjective", "best_feasible_ratio", "objective_points"]

#: Columns a replay table must have.
REQUIRED_COLUMNS = ("policy_id", "relative_accuracy", "compression_ratio", "encode_gbps", "decode_gbps")


def objective_points(frame: pd.DataFrame) -> np.ndarray:
    """``(n, 3)`` float64 objectives of trial rows: accuracy (up), ratio (up), codec latency
    in s/GB (down; ``1/encode_gbps + 1/decode_gbps``). NaN where a value is missing."""
    def col(name: str) -> np.ndarray:
        if name not in frame.columns:
            return np.full(len(frame), np.nan)
        return pd.to_numeric(frame[name], errors="coerce").to_numpy(dtype=np.float64)

    with np.errstate(divide="ignore", invalid="ignore"):
        lat = 1.0 / col("encode_gbps") + 1.0 / col("decode_gbps")
    return np.column_stack([col("relative_accuracy"), col("compression_ratio"), lat])


def best_feasible_ratio(frame: pd.DataFrame, q_min: float, *, use_lo: bool = True) -> float:
    """Largest ``compression_ratio`` among rows whose accuracy reaches ``q_min``.

    Feasibility is ``relative_accuracy_lo >= q_min`` when ``use_lo`` and the column exists
    (the lower end of the 95 % interval must clear the floor), else ``relative_accuracy >=
    q_min``. Returns NaN when no row is feasible.
    """
    if frame.empty:
        return float("nan")
    col = "relative_accuracy_lo" if use_lo and "relative_accuracy_lo" in frame.columns else "relative_accuracy"
    acc = pd.to_numeric(frame[col], errors="coerce").to_numpy(dtype=np.float64)
    ratio = pd.to_numeric(frame["compression_ratio"], errors="coerce").to_numpy(dtype=np.float64)
    ok = acc >= q_min
    return float(ratio[ok].max()) if ok.any() else float("nan")


@dataclass(frozen=True)
class HypervolumeSpec:
    """Normalization and reference point of benchmark hypervolumes.

    Objectives (accuracy up, ratio up, latency down) are mapped to
    ``(accuracy, ratio, latency / latency_scale)`` and measured against ``ref =
    (acc_ref, ratio_ref, latency_ref)`` in those normalized units.

    Attributes:
        latency_scale: s/GB; the replay table's largest codec latency.
        acc_ref: accuracy reference (fraction), default 0.5.
        ratio_ref: ratio reference, default 1.0 (no compression).
        latency_ref: normalized latency reference, default 1.1 (10 % worse than the worst).
    """

    latency_scale: float
    acc_ref: float = 0.5
    ratio_ref: float = 1.0
    latency_ref: float = 1.1

    @classmethod
    def for_table(cls, table: pd.DataFrame) -> "HypervolumeSpec":
        lat = objective_points(table)[:, 2]
        lat = lat[np.isfinite(lat)]
        if lat.size == 0:
            raise KvtuneError("replay table has no finite codec latency; cannot normalize hypervolume")
        return cls(latency_scale=float(lat.max()))

    def normalize(self, points: np.ndarray) -> np.ndarray:
        out = np.array(points, dtype=np.float64, copy=True)
        out[:, 2] = out[:, 2] / self.latency_scale
        return out

    def hypervolume(self, frame_or_points: pd.DataFrame | np.ndarray) -> float:
        """Hypervolume of trial rows (or raw ``(n, 3)`` objective points) in normalized units."""
        pts = objective_points(frame_or_points) if isinstance(frame_or_points, pd.DataFrame) else frame_or_points
        if len(pts) == 0:
            return 0.0
        pts = self.normalize(np.asarray(pts, dtype=np.float64))
        pts = pts[non_dominated_mask(pts, (True, True, False))]
        return hypervolume(pts, (self.acc_ref, self.ratio_ref, self.latency_ref), (True, True, False))


class ReplayObjective:
    """Answers ``evaluate(candidate)`` by ``policy_id`` lookup in a fully evaluated table.

    Args:
        table: one row per candidate (see the module docstring); ``policy_id`` must be unique.

    Raises:
        KvtuneError: a required column is missing or a ``policy_id`` appears twice.

    >>> from kvtune.search.optimizers.synthetic import synthetic_problem
    >>> space, table = synthetic_problem("small")
    >>> replay = ReplayObjective(table)
    >>> replay.evaluate(space.candidates[0])["policy_id"] == space.candidates[0].policy_id
    True
    """

    def __init__(self, table: pd.DataFrame, *, source: str = "<table>") -> None:
        missing = [c for c in REQUIRED_COLUMNS if c not in table.columns]
        if missing:
            raise KvtuneError(f"replay table {source} lacks column(s) {missing}; needs {list(REQUIRED_COLUMNS)}")
        dup = table["policy_id"][table["policy_id"].duplicated()].tolist()
        if dup:
            raise KvtuneError(f"replay table {source} lists policy_id {dup[0]!r} more than once")
        self.source = source
        self.table = table.reset_index(drop=True)
        self._rows = {pid: i for i, pid in enumerate(self.table["policy_id"])}
        self.hv_spec = HypervolumeSpec.for_table(self.table)

    @classmethod
    def from_parquet(cls, path: str | Path) -> "ReplayObjective":
        """Load a replay table from Parquet.

        Raises:
            KvtuneError: the file does not exist or is not a readable table with the columns.
        """
        path = Path(path)
        if not path.is_file():
            raise KvtuneError(f"replay table {path} not found (evaluate the space exhaustively first, or use --synthetic)")
        try:
            table = pd.read_parquet(path)
        except Exception as exc:  # pyarrow raises several types for unreadable files
            raise KvtuneError(f"replay table {path} is not readable Parquet: {exc}") from exc
        return cls(table, source=str(path))

    def __len__(self) -> int:
        return len(self.table)

    def evaluate(self, candidate: Candidate) -> dict[str, Any]:
        """The stored trial row of ``candidate`` (a fresh dict).

        Raises:
            KvtuneError: ``candidate.policy_id`` is not in the table.
        """
        pid = candidate.policy_id
        row = self._rows.get(pid)
        if row is None:
            raise KvtuneError(f"policy_id {pid!r} (candidate #{candidate.index}) is not in replay table {self.source}; "
                              "was the table made from this search space?")
        return {k: (v.item() if isinstance(v, np.generic) else v) for k, v in self.table.iloc[row].to_dict().items()}

    def rows_for(self, space: SearchSpace) -> pd.DataFrame:
        """The table's rows in ``space`` enumeration order.

        Raises:
            KvtuneError: a candidate of the space is missing from the table.
        """
        missing = [c for c in space.candidates if c.policy_id not in self._rows]
        if missing:
            raise KvtuneError(f"{len(missing)} candidate(s) of space {space.name!r} are not in replay table "
                              f"{self.source} (first: #{missing[0].index} {missing[0].policy_id})")
        return self.table.iloc[[self._rows[c.policy_id] for c in space.candidates]].reset_index(drop=True)

    def ratios(self, space: SearchSpace) -> np.ndarray:
        """``(n_candidates,)`` compression ratios in ``space`` order (what the profile measures
        up front)."""
        return self.rows_for(space)["compression_ratio"].to_numpy(dtype=np.float64)

    def exhaustive_hypervolume(self) -> float:
        """Hypervolume of the whole table's front (normalized, see :class:`HypervolumeSpec`)."""
        return self.hv_spec.hypervolume(self.table)

    def hypervolume(self, trials: pd.DataFrame | list[dict[str, Any]]) -> float:
        """Hypervolume of evaluated trial rows, same normalization and reference point."""
        frame = pd.DataFrame(trials) if not isinstance(trials, pd.DataFrame) else trials
        return self.hv_spec.hypervolume(frame)

    def best_feasible_ratio(self, q_min: float, *, use_lo: bool = True) -> float:
        """Exhaustive best ratio at accuracy floor ``q_min`` (see :func:`best_feasible_ratio`)."""
        return best_feasible_ratio(self.table, q_min, use_lo=use_lo)
