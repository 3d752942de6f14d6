"""Versioned piecewise policy table: which policy to use at bandwidth B and accuracy floor q.

KVServe (arXiv 2605.13734), piecewise policy table of its online controller. For each accuracy floor,
the candidates are the Pareto policies whose relative accuracy is >= the floor plus the
implicit uncompressed policy ``"none"``. Each candidate's per-volume transfer time is the line
``T/V = a + b * x`` with ``x = 1/B`` (seconds per GB, B in GB/s), ``a = 1/encode_gbps +
1/decode_gbps`` (s/GB) and ``b = 1/compression_ratio``; the table stores the lower envelope of
those lines, one row per interval of x. Online selection is a binary search on x.

The table is method-agnostic: a row only needs a policy id, a method name, a label, an opaque
``config_json`` and the measured numbers, so SCD or BiCache policies land in the same tables.

Schema version 1, one row per (accuracy floor, interval); columns (units in names):

================== ========= ==============================================================
column             dtype     meaning
================== ========= ==============================================================
schema_version     int       1
model              str       model the table was profiled for
workload           str       workload (qa, math, code, summarization, ...)
device             str       device the codec throughputs were measured on
accuracy_floor     float     minimum relative accuracy of every policy in this bucket
key                str       optional extra table key (default ``""`` = no extra key); see
                             "Extra table keys" below
x_lo_s_per_gb      float     interval start, x = 1/B in seconds per GB (inclusive); 0 first
x_hi_s_per_gb      float     interval end (exclusive); inf for the last interval
bandwidth_hi_gbps  float     link Gbps at x_lo (8 / x_lo; inf when x_lo = 0)
bandwidth_lo_gbps  float     link Gbps at x_hi (8 / x_hi; 0 when x_hi = inf)
policy_id          str       chosen policy ("none" = send uncompressed)
method             str       "tqc", "scd", "bicache", ... or "none"
label              str       human-readable policy
config_json        str       full policy configuration (opaque JSON)
a_s_per_gb         float     codec seconds per GB of original KV (1/enc + 1/dec)
b                  float     1 / compression_ratio
compression_ratio  float     bf16 bytes / stream bytes
relative_accuracy  float     fraction, 1.0 == 100 %
encode_gbps        float     encode throughput, GB/s of original KV (inf for "none")
decode_gbps        float     decode throughput, GB/s of original KV (inf for "none")
threshold_gbps     float     B* as link Gbps: compression pays iff B < B* (inf for "none",
                             which is always admissible)
runners_up         str       JSON list of the next 1-2 best policy ids at the interval's
                             midpoint (fallbacks for an online controller)
runner_up_policies str       JSON list of objects with the same numbers for each runner-up,
                             so a controller can use them without the trials frame
================== ========= ==============================================================

Gbps is 1e9 *bits* per second (links); GB/s is 1e9 *bytes* per second (throughputs,
``x``). Non-finite numbers are written to JSON as the strings ``"inf"``/``"-inf"``.

**Extra table keys.** One file can hold several tables of the same model, workload and
device that differ in one more dimension, e.g. BiCache's shared-prefix-ratio bucket. Each
row then carries a ``key`` string, and the intervals of every ``(key, accuracy_floor)`` pair
form one partition of ``[0, inf)`` in x. The key is opaque to kvtune and matched exactly by
:meth:`PolicyTable.select`; the convention is ``"<dimension>=<bucket>"``, e.g.
``"prefix_ratio=[0.25,0.5)"``. ``""`` (the default) means "no extra key"; TQC tables use only
that. The column is optional on load (files written before it existed read as ``key = ""``),
so adding keyed rows needs no new schema version. In JSON, each entry of ``tables`` has an
optional ``"key"`` next to ``"accuracy_floor"``.

**Metadata.** The header's ``extra`` object is free-form; kvtune reads one entry:
``kv_bytes_per_request`` (bytes of original bf16 KV of one profiled request), the default
volume of ``kvtune select`` (:data:`DEFAULT_KV_BYTES` = 1 GB when absent).
"""

from __future__ import annotations

import bisect
import json
import math
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import pandas as pd

from kvtune.core.errors import KvtuneError, TableError
from kvtune.core.jsonio import dec_float, enc_float, strict_dumps
from kvtune.core.atomic import atomic_path, atomic_write_text
from kvtune.tables.envelope import lower_envelope
from kvtune.tables.latency import (
    gbps_to_x_s_per_gb,
    line_coefficients,
    threshold_gbps,
    x_s_per_gb_to_gbps,
)

__all__ = [
    "COLUMNS",
    "DEFAULT_FLOORS",
    "NONE_POLICY_ID",
    "SCHEMA_VERSION",
    "SUPPORTED_SCHEMA_VERSIONS",
    "MAX_TABLE_BYTES",
    "DEFAULT_KV_BYTES",
    "DEFAULT_KEY",
    "OPTIONAL_COLUMNS",
    "CandidateTime",
    "PolicyEntry",
    "PolicyTable",
    "SelectedPolicy",
    "compile_policy_table",
    "envelope_rows",
]

SCHEMA_VERSION = 1
SUPPORTED_SCHEMA_VERSIONS = frozenset({1})
#: Largest policy table file :meth:`PolicyTable.load` reads, bytes (a profiled table is a few
#: hundred KB; the bound keeps a hostile or mistaken path from being read whole into memory).
MAX_TABLE_BYTES = 256 << 20
DEFAULT_FLOORS: tuple[float, ...] = (0.99, 0.97, 0.95, 0.90)
NONE_POLICY_ID = "none"
#: Default KV volume (bytes) of a selection when neither the caller nor the table's
#: ``kv_bytes_per_request`` metadata gives one: 1 GB.
DEFAULT_KV_BYTES = 1e9
#: Value of the optional ``key`` column meaning "no extra table key".
DEFAULT_KEY = ""
_FORMAT = "kvtune.policy_table"
_PARQUET_META_KEY = b"kvtune.policy_table"
_FLOOR_TOL = 1e-12  # q_min this close above a floor still maps to that floor
#: Largest relative accuracy a table row may hold: kvtune reports at most 1.0 and raw values
#: of other methods stay near it, so a larger value is a corrupt row, not a measurement.
MAX_RELATIVE_ACCURACY = 2.0

_META_COLUMNS = ("schema_version", "model", "workload", "device", "accuracy_floor")
_INTERVAL_COLUMNS = ("x_lo_s_per_gb", "x_hi_s_per_gb", "bandwidth_hi_gbps", "bandwidth_lo_gbps")
_POLICY_STR_COLUMNS = ("policy_id", "method", "label", "config_json")
_POLICY_FLOAT_COLUMNS = (
    "a_s_per_gb",
    "b",
    "compression_ratio",
    "relative_accuracy",
    "encode_gbps",
    "decode_gbps",
    "threshold_gbps",
)
_RUNNER_COLUMNS = ("runners_up", "runner_up_policies")
#: Columns of a schema-1 table, in order.
COLUMNS: tuple[str, ...] = (
    _META_COLUMNS + _INTERVAL_COLUMNS + _POLICY_STR_COLUMNS + _POLICY_FLOAT_COLUMNS + _RUNNER_COLUMNS
)
#: Optional columns with the default used when a file lacks them.
OPTIONAL_COLUMNS: dict[str, Any] = {"key": DEFAULT_KEY}
_FLOAT_COLUMNS = ("accuracy_floor",) + _INTERVAL_COLUMNS + _POLICY_FLOAT_COLUMNS
_STR_COLUMNS = ("model", "workload", "device", "key") + _POLICY_STR_COLUMNS + _RUNNER_COLUMNS
#: Canonical column order of a table's frame (extras follow).
_ORDER: tuple[str, ...] = _META_COLUMNS + ("key",) + COLUMNS[len(_META_COLUMNS):]
_PARETO_REQUIRED = (
    "policy_id",
    "label",
    "method",
    "config_json",
    "compression_ratio",
    "relative_accuracy",
    "encode_gbps",
    "decode_gbps",
)


# --------------------------------------------------------------------------------------------
# JSON helpers: finite floats as numbers, non-finite as strings, so files are strict JSON.


# (kvtune.core.jsonio: enc_float, dec_float, strict_dumps)


def _json_value(v: Any) -> Any:
    """Convert a cell of an extra column to a strict-JSON value."""
    if isinstance(v, (bool, np.bool_)):
        return bool(v)
    if isinstance(v, (int, np.integer)):
        return int(v)
    if isinstance(v, (float, np.floating)):
        return enc_float(v)
    if v is None:
        return None
    return str(v)


# --------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class PolicyEntry:
    """One candidate policy with the numbers the latency model needs.

    Attributes:
        policy_id: 12-hex id, or ``"none"`` for sending uncompressed.
        method: ``"tqc"``, ``"scd"``, ``"bicache"``, ... or ``"none"``.
        label: human-readable description.
        config_json: full configuration, opaque JSON string (``"{}"`` for "none").
        a_s_per_gb: codec seconds per GB of original KV (``1/encode_gbps + 1/decode_gbps``).
        b: ``1 / compression_ratio``.
        compression_ratio: bf16 bytes / stream bytes.
        relative_accuracy: fraction (1.0 == 100 %).
        encode_gbps, decode_gbps: throughputs in GB/s (1e9 bytes/s) of original KV.
        threshold_gbps: B* in link Gbps; the policy beats "none" iff bandwidth < B*.
    """

    policy_id: str
    method: str
    label: str
    config_json: str
    a_s_per_gb: float
    b: float
    compression_ratio: float
    relative_accuracy: float
    encode_gbps: float
    decode_gbps: float
    threshold_gbps: float

    def seconds_per_gb(self, bandwidth_gbps: float) -> float:
        """Predicted transfer seconds per GB of original KV at link ``bandwidth_gbps`` (Gbps):
        ``a + b * 8 / bandwidth_gbps`` (KVServe latency model)."""
        return self.a_s_per_gb + self.b * float(gbps_to_x_s_per_gb(bandwidth_gbps))

    def transfer_seconds(self, kv_bytes: float, bandwidth_gbps: float) -> float:
        """Predicted seconds to encode + send + decode ``kv_bytes`` bytes at ``bandwidth_gbps``."""
        return kv_bytes / 1e9 * self.seconds_per_gb(bandwidth_gbps)

    def pays_at(self, bandwidth_gbps: float) -> bool:
        """True iff this policy is faster than sending uncompressed at ``bandwidth_gbps``
        (``bandwidth_gbps < threshold_gbps``); always True for ``"none"``."""
        return self.policy_id == NONE_POLICY_ID or bandwidth_gbps < self.threshold_gbps

    def to_json_dict(self) -> dict[str, Any]:
        """Strict-JSON dict (non-finite floats as ``"inf"`` strings)."""
        out: dict[str, Any] = {c: getattr(self, c) for c in _POLICY_STR_COLUMNS}
        out.update({c: enc_float(getattr(self, c)) for c in _POLICY_FLOAT_COLUMNS})
        return out

    @classmethod
    def from_json_dict(cls, d: Mapping[str, Any]) -> PolicyEntry:
        """Inverse of :meth:`to_json_dict`; raises ``KeyError``/``ValueError`` when malformed."""
        kwargs: dict[str, Any] = {c: str(d[c]) for c in _POLICY_STR_COLUMNS}
        kwargs.update({c: dec_float(d[c], c) for c in _POLICY_FLOAT_COLUMNS})
        return cls(**kwargs)


def _none_entry() -> PolicyEntry:
    return PolicyEntry(
        policy_id=NONE_POLICY_ID,
        method="none",
        label="none (uncompressed)",
        config_json="{}",
        a_s_per_gb=0.0,
        b=1.0,
        compression_ratio=1.0,
        relative_accuracy=1.0,
        encode_gbps=math.inf,
        decode_gbps=math.inf,
        threshold_gbps=math.inf,
    )


#: Status of a candidate in :attr:`SelectedPolicy.candidates` / a controller decision.
STATUS_CHOSEN = "chosen"  # the returned policy
STATUS_OK = "ok"  # admissible and within the SLO, but slower than the chosen one
STATUS_OVER_SLO = "over_slo"  # predicted time > SLO
STATUS_NO_GAIN = "no_gain"  # a runner-up with bandwidth >= its B*: slower than uncompressed


class CandidateTime(NamedTuple):
    """One candidate policy of a selection with its predicted time and verdict.

    Attributes:
        policy: the candidate.
        predicted_s: predicted seconds to encode + send + decode the selection's KV volume.
        status: ``"chosen"``, ``"ok"`` (admissible, slower), ``"over_slo"`` (predicted time
            above the SLO) or ``"no_gain"`` (a runner-up at a bandwidth >= its threshold B*,
            i.e. predicted slower than sending uncompressed; KVServe drops those).
    """

    policy: PolicyEntry
    predicted_s: float
    status: str

    @property
    def policy_id(self) -> str:
        """Id of the candidate policy."""
        return self.policy.policy_id


class SelectedPolicy(NamedTuple):
    """Result of :meth:`PolicyTable.select`.

    Attributes:
        policy: the chosen policy: the fastest predicted candidate that meets the SLO, or the
            fastest one when none does (then ``slo_violated`` is True). Without an SLO this is
            the envelope's policy at this bandwidth and accuracy floor.
        accuracy_floor: the bucket used (smallest configured floor >= ``q_min``).
        q_min: the requested minimum relative accuracy (fraction).
        bandwidth_gbps: the queried link bandwidth (Gbps).
        x_s_per_gb: ``8 / bandwidth_gbps``, seconds per GB over the link.
        x_lo_s_per_gb, x_hi_s_per_gb: the interval of x that contains ``x_s_per_gb``.
        bandwidth_lo_gbps, bandwidth_hi_gbps: the same interval in link Gbps
            (``bandwidth_lo_gbps < bandwidth_gbps <= bandwidth_hi_gbps``).
        runners_up: policy ids of the next-best candidates in this interval (best first).
        alternatives: the same runners-up as :class:`PolicyEntry` objects.
        kv_bytes: KV volume V (bytes of original bf16 KV) the times are predicted for.
        slo_s: the transfer-time SLO in seconds, or None.
        slo_violated: True when even the chosen policy is predicted over ``slo_s``.
        key: the extra table key used (``""`` = none).
        envelope_policy: the interval's envelope (model-optimal) policy.
        predicted_times_s: predicted seconds for ``kv_bytes`` of the envelope policy then each
            runner-up (same order as :attr:`candidates`).
        statuses: status of each of them (see :class:`CandidateTime`).

    An immutable named tuple (cheap to build: :meth:`PolicyTable.select` runs in a few
    microseconds); :attr:`candidates` assembles the per-candidate view on access.
    """

    policy: PolicyEntry
    accuracy_floor: float
    q_min: float
    bandwidth_gbps: float
    x_s_per_gb: float
    x_lo_s_per_gb: float
    x_hi_s_per_gb: float
    bandwidth_lo_gbps: float
    bandwidth_hi_gbps: float
    runners_up: tuple[str, ...]
    alternatives: tuple[PolicyEntry, ...]
    kv_bytes: float = DEFAULT_KV_BYTES
    slo_s: float | None = None
    slo_violated: bool = False
    key: str = DEFAULT_KEY
    envelope_policy: PolicyEntry | None = None
    predicted_times_s: tuple[float, ...] = ()
    statuses: tuple[str, ...] = ()

    @property
    def candidates(self) -> tuple[CandidateTime, ...]:
        """The envelope policy then its runners-up, each with its predicted time for
        ``kv_bytes`` and its status (see :class:`CandidateTime`)."""
        env = self.envelope_policy if self.envelope_policy is not None else self.policy
        return tuple(
            CandidateTime(p, t, st)
            for p, t, st in zip((env, *self.alternatives), self.predicted_times_s, self.statuses, strict=True)
        )

    @property
    def policy_id(self) -> str:
        """Id of the chosen policy (``"none"`` = uncompressed)."""
        return self.policy.policy_id

    @property
    def method(self) -> str:
        """Method of the chosen policy."""
        return self.policy.method

    @property
    def label(self) -> str:
        """Label of the chosen policy."""
        return self.policy.label

    @property
    def config_json(self) -> str:
        """Configuration JSON of the chosen policy."""
        return self.policy.config_json

    @property
    def predicted_seconds_per_gb(self) -> float:
        """Predicted transfer seconds per GB of original KV at the queried bandwidth."""
        return self.policy.a_s_per_gb + self.policy.b * self.x_s_per_gb

    @property
    def predicted_seconds(self) -> float:
        """Predicted seconds to encode + send + decode ``kv_bytes`` with the chosen policy."""
        return self.kv_bytes * 1e-9 * self.predicted_seconds_per_gb

    @property
    def uncompressed_seconds(self) -> float:
        """Seconds to send ``kv_bytes`` uncompressed at the queried bandwidth (``V / B``)."""
        return self.kv_bytes * 1e-9 * self.x_s_per_gb

    @property
    def threshold_gbps(self) -> float:
        """B* of the chosen policy (link Gbps; inf for ``"none"``)."""
        return self.policy.threshold_gbps

    def reason(self) -> str:
        """Why this policy: the interval, the candidates and why others were dropped
        (multi-line plain text, used by ``kvtune select``)."""
        from kvtune.core.units import format_bytes, format_seconds

        lines = [
            f"accuracy floor {100 * self.accuracy_floor:g} % (smallest configured floor >= "
            f"q_min {100 * self.q_min:g} %)" + (f", table key {self.key!r}" if self.key else ""),
            f"{self.bandwidth_gbps:.4g} Gbps lies in the interval ({self.bandwidth_lo_gbps:.4g}, "
            f"{self.bandwidth_hi_gbps:.4g}] Gbps (x = 1/B in [{self.x_lo_s_per_gb:.4g}, "
            f"{self.x_hi_s_per_gb:.4g}) s/GB), where the envelope policy is {self.candidates[0].policy.label}"
            if self.candidates else "",
        ]
        what = {
            STATUS_CHOSEN: "chosen",
            STATUS_OK: "admissible, slower",
            STATUS_OVER_SLO: "dropped: predicted over the SLO",
            STATUS_NO_GAIN: "dropped: B >= B*, slower than uncompressed",
        }
        for k, c in enumerate(self.candidates):
            role = "optimal " if k == 0 else f"runner-up {k}"
            bstar = "inf" if math.isinf(c.policy.threshold_gbps) else f"{c.policy.threshold_gbps:.4g}"
            lines.append(
                f"  {role:<11} {c.policy.label} [{c.policy_id}]: {format_seconds(c.predicted_s)} for "
                f"{format_bytes(self.kv_bytes)}, B* {bstar} Gbps -> {what.get(c.status, c.status)}"
            )
        if self.slo_s is not None:
            lines.append(
                f"SLO {format_seconds(self.slo_s)}: "
                + ("VIOLATED - no candidate meets it; returning the fastest" if self.slo_violated else "met")
            )
        lines.append(
            f"uncompressed would take {format_seconds(self.uncompressed_seconds)}; chosen "
            f"{format_seconds(self.predicted_seconds)}"
        )
        return "\n".join(line for line in lines if line)


# --------------------------------------------------------------------------------------------
# Compilation


_GIVEN_LINE_COLUMNS = ("a_s_per_gb", "b", "threshold_gbps")


def _candidate_entries(pareto: pd.DataFrame, *, given_lines: bool = False,
                       prefer: Sequence[str] = ()) -> list[tuple[PolicyEntry, int]]:
    """The candidate policies of ``pareto`` with their row positions, in preference order.

    Lines come from the codec throughputs (KVServe, :func:`~kvtune.tables.latency.line_coefficients`)
    or, with ``given_lines``, from the frame's ``a_s_per_gb``, ``b`` and ``threshold_gbps``
    (then ``compression_ratio`` may be inf: a line that sends nothing). Preference (identical
    lines resolve to the first): higher accuracy, then the ``prefer`` columns ascending, then
    higher ratio, lower ``a``, lower id.
    """
    required = _PARETO_REQUIRED + (_GIVEN_LINE_COLUMNS if given_lines else ()) + tuple(prefer)
    missing = [c for c in required if c not in pareto.columns]
    if missing:
        raise TableError(f"cannot compile policy table: Pareto frame lacks column(s) {missing}")
    ids = pareto["policy_id"].astype(str)
    if (ids == NONE_POLICY_ID).any():
        raise TableError(f"cannot compile policy table: policy_id {NONE_POLICY_ID!r} is reserved")
    dup = ids[ids.duplicated()].unique().tolist()
    if dup:
        raise TableError(
            f"cannot compile policy table: duplicate policy_id(s) {dup[:5]}; "
            "aggregate repeated trials of a policy before compiling"
        )
    num = {}
    for c in ("compression_ratio", "relative_accuracy", "encode_gbps", "decode_gbps",
              *(_GIVEN_LINE_COLUMNS if given_lines else ())):
        num[c] = pd.to_numeric(pareto[c], errors="coerce").to_numpy(dtype=np.float64)
        if np.isnan(num[c]).any():
            raise TableError(f"cannot compile policy table: column {c} has NaN or non-numeric values")
    cr = num["compression_ratio"]
    ok_cr = (cr > 0) & (np.isfinite(cr) | given_lines)
    if not ok_cr.all():
        i = int(np.flatnonzero(~ok_cr)[0])
        raise TableError(f"cannot compile policy table: compression_ratio must be "
                         f"{'> 0' if given_lines else 'finite and > 0'} (policy {ids.iloc[i]}: {cr[i]})")
    ra = num["relative_accuracy"]
    if not np.isfinite(ra).all():
        raise TableError("cannot compile policy table: relative_accuracy must be finite")
    if not ((ra >= 0) & (ra <= MAX_RELATIVE_ACCURACY)).all():
        i = int(np.flatnonzero(~((ra >= 0) & (ra <= MAX_RELATIVE_ACCURACY)))[0])
        raise TableError(f"cannot compile policy table: relative_accuracy must be in [0, {MAX_RELATIVE_ACCURACY:g}] "
                         f"(policy {ids.iloc[i]}: {ra[i]})")
    for c in ("encode_gbps", "decode_gbps"):
        if not (num[c] > 0).all():
            raise TableError(f"cannot compile policy table: {c} must be > 0 GB/s")
    if given_lines:
        a, b, thr = num["a_s_per_gb"], num["b"], num["threshold_gbps"]
        for c, v in (("a_s_per_gb", a), ("b", b)):
            if not (np.isfinite(v) & (v >= 0)).all():
                raise TableError(f"cannot compile policy table: {c} must be finite and >= 0")
    else:
        a, b = (np.atleast_1d(v) for v in line_coefficients(cr, num["encode_gbps"], num["decode_gbps"]))
        thr = np.atleast_1d(threshold_gbps(cr, num["encode_gbps"], num["decode_gbps"]))
    entries = [
        (PolicyEntry(
            policy_id=str(pid),
            method=str(method),
            label=str(label),
            config_json=str(cfg),
            a_s_per_gb=float(a[i]),
            b=float(b[i]),
            compression_ratio=float(cr[i]),
            relative_accuracy=float(ra[i]),
            encode_gbps=float(num["encode_gbps"][i]),
            decode_gbps=float(num["decode_gbps"][i]),
            threshold_gbps=float(thr[i]),
        ), i)
        for i, (pid, method, label, cfg) in enumerate(
            zip(ids, pareto["method"], pareto["label"], pareto["config_json"], strict=True)
        )
    ]
    ranks = [pareto[c].to_numpy() for c in prefer]
    # Identical lines resolve to the lowest index: prefer higher accuracy, then ratio.
    entries.sort(key=lambda ep: (-ep[0].relative_accuracy, *(r[ep[1]] for r in ranks), -ep[0].compression_ratio,
                                 ep[0].a_s_per_gb, ep[0].policy_id))
    return entries


def _gate_values(pareto: pd.DataFrame, entries: list[PolicyEntry], gate: str) -> np.ndarray:
    """Per entry (``"none"`` first, at 1.0) the value of column ``gate`` compared with the floors.

    Raises:
        TableError: ``gate`` is missing or not a finite number on some row.
    """
    if gate == "relative_accuracy":
        return np.array([e.relative_accuracy for e in entries])
    if gate not in pareto.columns:
        raise TableError(f"cannot compile policy table: gate column {gate!r} is missing")
    values = pd.to_numeric(pareto[gate], errors="coerce").to_numpy(dtype=float)
    if not np.isfinite(values).all():
        raise TableError(f"cannot compile policy table: gate column {gate!r} must be finite numbers")
    by_id = dict(zip(pareto["policy_id"].astype(str), values))
    return np.array([1.0 if e.policy_id == NONE_POLICY_ID else by_id[e.policy_id] for e in entries])


def _check_floors(floors: Iterable[float]) -> tuple[float, ...]:
    try:
        fl = [float(f) for f in floors]
    except (TypeError, ValueError) as exc:
        raise TableError(f"accuracy floors must be numbers: {exc}") from None
    if not fl:
        raise TableError("at least one accuracy floor is required")
    if any(not math.isfinite(f) or f <= 0 for f in fl):
        raise TableError(f"accuracy floors must be finite and > 0, got {fl}")
    if len(set(fl)) != len(fl):
        raise TableError(f"accuracy floors must be distinct, got {fl}")
    return tuple(sorted(fl, reverse=True))


def compile_policy_table(
    pareto: pd.DataFrame,
    *,
    floors: Sequence[float] = DEFAULT_FLOORS,
    model: str,
    workload: str,
    device: str,
    n_runners_up: int = 2,
    metadata: Mapping[str, Any] | None = None,
    key: str = DEFAULT_KEY,
    include_none: bool = True,
    gate: str = "relative_accuracy",
    key_column: str | None = None,
    extra_columns: Sequence[str] = (),
    given_lines: bool = False,
    prefer: Sequence[str] = (),
    tolerance: float = 0.0,
) -> PolicyTable:
    """Compile the piecewise policy table from a Pareto front (KVServe, piecewise table).

    For every floor q: candidates are the rows with ``gate >= q`` (by default the point
    estimate ``relative_accuracy``; kvtune profiles gate on ``relative_accuracy_lo``, the lower
    end of the 95 % interval, so a floor holds with confidence) plus the
    implicit ``"none"`` policy (a = 0, b = 1, relative accuracy 1.0); the table rows are the
    intervals of the lower envelope of ``a + b * x`` over ``x = 1/B in [0, inf)`` s/GB.
    Among identical lines the one with higher accuracy (then ratio, then id) wins; "none"
    wins ties with an identical compressed line. Every floor covers all bandwidths, since
    "none" is always a candidate.

    Args:
        pareto: output of :func:`kvtune.search.pareto.pareto_front` (any frame with
            ``policy_id``, ``label``, ``method``, ``config_json``, ``compression_ratio``,
            ``relative_accuracy``, ``encode_gbps`` and ``decode_gbps`` in GB/s works;
            dominated rows never reach the envelope anyway).
        floors: accuracy floors (fractions), e.g. ``(0.99, 0.97, 0.95, 0.90)``.
        model, workload, device: what the table was profiled for (stored in every row).
        n_runners_up: next-best policies listed per interval (KVServe uses 1-2).
        metadata: extra JSON-serializable key/values stored with the table (kvtune reads
            ``kv_bytes_per_request``, see the module docstring).
        gate: the column compared with the floors (a fraction, like ``relative_accuracy``).
        key: extra table key of every row (``""`` = none; see "Extra table keys"). Tables
            compiled with different keys are merged with :meth:`PolicyTable.combine`.
        include_none: add the implicit ``"none"`` policy (send the original KV as it is,
            relative accuracy 1.0). False for tables whose reference is not the original KV
            sent uncompressed, e.g. SCD, where the consumer cannot receive its own KV and the
            full-quality candidate is ``recompute`` (a row of ``pareto``); every floor must
            then be reached by some row of ``pareto``.
        key_column: a column of ``pareto`` keying the table (BiCache: the prefix-ratio bucket):
            the rows of each distinct value (as a string, ascending) are compiled as one table
            with that key (``key`` must then stay ``""``).
        extra_columns: columns of ``pareto`` copied into the rows of each policy (kept by
            :class:`PolicyTable` and saved in both formats).
        given_lines: take each policy's line from the columns ``a_s_per_gb``, ``b`` and
            ``threshold_gbps`` instead of deriving it from ``compression_ratio`` and the codec
            throughputs (BiCache: ``a`` = compute + decode seconds per GB, ``b = 0`` for full
            recompute, whose ratio is inf).
        prefer: columns ranking identical lines after accuracy (ascending; BiCache:
            ``reuse_depth``, the shallower reuse first).
        tolerance: slack of the floor comparison (a gate value ``tolerance`` below a floor
            still reaches it).

    Returns:
        :class:`PolicyTable` with rows sorted by key, floor (descending), then ``x_lo_s_per_gb``.

    Raises:
        TableError: missing columns, NaN or non-positive numbers, duplicate or reserved
            policy ids (within one key), bad floors, empty model/workload/device, a floor no
            candidate reaches (without ``include_none``), or ``key`` with ``key_column``.
    """
    for name, value in (("model", model), ("workload", workload), ("device", device)):
        if not isinstance(value, str) or not value:
            raise TableError(f"cannot compile policy table: {name} must be a non-empty string")
    fl = _check_floors(floors)
    if not isinstance(key, str):
        raise TableError(f"cannot compile policy table: key must be a string, got {key!r}")
    missing = [c for c in (*extra_columns, *([key_column] if key_column else [])) if c not in pareto.columns]
    if missing:
        raise TableError(f"cannot compile policy table: Pareto frame lacks column(s) {missing}")
    if key_column is not None and key != DEFAULT_KEY:
        raise TableError("cannot compile policy table: pass either key or key_column, not both")
    groups = [(key, pareto)] if key_column is None else \
        [(str(k), g) for k, g in pareto.groupby(pareto[key_column].astype(str), sort=True)]
    header = {"schema_version": SCHEMA_VERSION, "model": model, "workload": workload, "device": device}
    rows: list[dict[str, Any]] = []
    for group_key, group in groups:
        found = _candidate_entries(group, given_lines=given_lines, prefer=prefer)
        entries = ([_none_entry()] if include_none else []) + [e for e, _ in found]
        extras = None
        if extra_columns:  # the implicit "none" has no values of its own
            extras = [dict.fromkeys(extra_columns)] * include_none + [
                {c: group[c].iloc[i] for c in extra_columns} for _, i in found]
        always = (np.arange(len(entries)) == 0) & include_none
        rows += envelope_rows(entries, _gate_values(group, entries, gate), fl, always=always, key=group_key,
                              header=header, extras=extras, n_runners_up=n_runners_up, tolerance=tolerance)
    return PolicyTable(pd.DataFrame(rows, columns=[*_ORDER, *extra_columns]), metadata=metadata)


def envelope_rows(
    entries: Sequence[PolicyEntry],
    gate: np.ndarray,
    floors: Sequence[float],
    *,
    header: Mapping[str, Any],
    key: str = DEFAULT_KEY,
    always: np.ndarray | None = None,
    extras: Sequence[Mapping[str, Any]] | None = None,
    n_runners_up: int = 2,
    tolerance: float = 0.0,
) -> list[dict[str, Any]]:
    """The floor -> lower envelope -> table rows loop every policy table is compiled with
    (KVServe piecewise table; T/Q/C, SCD and BiCache tables alike).

    For each floor, the candidates are the entries whose ``gate`` value is at least
    ``floor - tolerance`` (plus those marked ``always``); the rows are the intervals of the
    lower envelope of ``a + b * x`` over ``x = 1/B`` s/GB, each with its runners-up. Identical
    lines resolve to the lowest entry index, so order ``entries`` by preference.

    Args:
        entries: candidate policies (with their line ``a_s_per_gb``, ``b``).
        gate: per entry, the value compared with the floors (fraction).
        floors: accuracy floors, in the order the rows are wanted.
        header: columns copied into every row (``schema_version``, ``model``, ...).
        key: the extra table key of the rows.
        always: per entry, admitted at every floor (the implicit ``"none"``, BiCache's depth 0).
        extras: per entry, extra columns added to its rows.
        n_runners_up: next-best policies listed per interval.
        tolerance: slack of the floor comparison.

    Raises:
        TableError: no entry is admitted at some floor.
    """
    a = np.array([e.a_s_per_gb for e in entries], dtype=np.float64)
    b = np.array([e.b for e in entries], dtype=np.float64)
    gate = np.asarray(gate, dtype=np.float64)
    always = np.zeros(len(entries), dtype=bool) if always is None else np.asarray(always, dtype=bool)
    rows: list[dict[str, Any]] = []
    for floor in floors:
        sel = np.flatnonzero((gate >= floor - tolerance) | always)
        if not len(sel):
            raise TableError(f"cannot compile policy table: no policy reaches accuracy floor {floor} "
                             "(and include_none is False)")
        for iv in lower_envelope(a[sel], b[sel], n_runners_up=n_runners_up):
            i = int(sel[iv.index])
            e = entries[i]
            runners = [entries[int(sel[r])] for r in iv.runners_up]
            rows.append(
                {
                    **header,
                    "accuracy_floor": floor,
                    "key": key,
                    "x_lo_s_per_gb": iv.x_lo,
                    "x_hi_s_per_gb": iv.x_hi,
                    "bandwidth_hi_gbps": float(x_s_per_gb_to_gbps(iv.x_lo)),
                    "bandwidth_lo_gbps": float(x_s_per_gb_to_gbps(iv.x_hi)),
                    **{c: getattr(e, c) for c in _POLICY_STR_COLUMNS + _POLICY_FLOAT_COLUMNS},
                    "runners_up": strict_dumps([r.policy_id for r in runners]),
                    "runner_up_policies": strict_dumps([r.to_json_dict() for r in runners]),
                    **(extras[i] if extras is not None else {}),
                }
            )
    return rows


# --------------------------------------------------------------------------------------------
# The table


def _fail(source: str, problem: str) -> TableError:
    return TableError(f"{source}: {problem}")


def _entry_problem(e: PolicyEntry) -> tuple[str, str] | None:
    """The first impossible value of a policy's numbers or configuration as
    ``(column, problem)``, or None when the policy is plausible.

    Checks: no NaN; ``a_s_per_gb`` finite and >= 0; ``b`` finite, >= 0 and equal to
    ``1 / compression_ratio``; ``compression_ratio`` > 0 (inf allowed: BiCache's reuse
    without a payload); ``relative_accuracy`` in ``[0, MAX_RELATIVE_ACCURACY]``; throughputs
    > 0; ``threshold_gbps`` >= 0; ``config_json`` a JSON object.
    """
    for c in _POLICY_FLOAT_COLUMNS:
        if math.isnan(getattr(e, c)):
            return c, "is NaN"
    if not (math.isfinite(e.a_s_per_gb) and e.a_s_per_gb >= 0):
        return "a_s_per_gb", f"= {e.a_s_per_gb!r} must be finite and >= 0 s/GB"
    if not (math.isfinite(e.b) and e.b >= 0):
        return "b", f"= {e.b!r} must be finite and >= 0"
    if not e.compression_ratio > 0:
        return "compression_ratio", f"= {e.compression_ratio!r} must be > 0"
    if not math.isclose(e.b, 1.0 / e.compression_ratio, rel_tol=1e-6):
        return "b", f"= {e.b!r} does not equal 1 / compression_ratio ({1.0 / e.compression_ratio:.6g})"
    if not 0.0 <= e.relative_accuracy <= MAX_RELATIVE_ACCURACY:
        return "relative_accuracy", f"= {e.relative_accuracy!r} is outside [0, {MAX_RELATIVE_ACCURACY:g}]"
    for c in ("encode_gbps", "decode_gbps"):
        if not getattr(e, c) > 0:
            return c, f"= {getattr(e, c)!r} must be > 0 GB/s"
    if not e.threshold_gbps >= 0:
        return "threshold_gbps", f"= {e.threshold_gbps!r} must be >= 0 Gbps"
    try:
        cfg = json.loads(e.config_json)
    except ValueError as exc:
        return "config_json", f"is not valid JSON ({exc})"
    if not isinstance(cfg, dict):
        return "config_json", f"must be a JSON object (a policy configuration), got {e.config_json[:60]!r}"
    return None


def _validate_frame(frame: pd.DataFrame, source: str) -> pd.DataFrame:
    """Check a schema-1 frame and return a normalized copy (typed, canonical order)."""
    if not isinstance(frame, pd.DataFrame):
        raise _fail(source, f"expected a DataFrame, got {type(frame).__name__}")
    if "schema_version" in frame.columns and len(frame):
        try:
            versions = sorted({int(v) for v in frame["schema_version"]})
        except (TypeError, ValueError):
            raise _fail(source, "schema_version must be an integer") from None
        unknown = [v for v in versions if v not in SUPPORTED_SCHEMA_VERSIONS]
        if unknown:
            raise _fail(
                source,
                f"unknown schema_version {unknown[0]} (this kvtune reads "
                f"{sorted(SUPPORTED_SCHEMA_VERSIONS)})",
            )
    missing = [c for c in COLUMNS if c not in frame.columns]
    if missing:
        raise _fail(source, f"missing column(s) {missing}")
    if len(frame) == 0:
        raise _fail(source, "table has no rows")
    out = frame.reset_index(drop=True).copy()
    for c, default in OPTIONAL_COLUMNS.items():
        if c not in out.columns:
            out[c] = default
    out["schema_version"] = out["schema_version"].astype("int64")
    for c in _FLOAT_COLUMNS:
        vals = pd.to_numeric(out[c], errors="coerce")
        if vals.isna().any():
            r = int(np.flatnonzero(vals.isna().to_numpy())[0])
            raise _fail(source, f"row {r}: column {c} has a missing, NaN or non-numeric value ({out[c].iloc[r]!r})")
        out[c] = vals.astype("float64")
    for c in _STR_COLUMNS:
        if out[c].isna().any():
            raise _fail(source, f"column {c} has missing values")
        out[c] = out[c].astype(str)
    for c in ("model", "workload", "device"):
        vals = out[c].unique()
        if len(vals) != 1 or not vals[0]:
            raise _fail(source, f"column {c} must hold one non-empty value, got {list(vals)[:3]}")
    if (out["policy_id"] == "").any():
        raise _fail(source, "empty policy_id")
    floors = out["accuracy_floor"].to_numpy()
    if not (np.isfinite(floors) & (floors > 0)).all():
        raise _fail(source, "accuracy_floor must be finite and > 0")
    for r, row in enumerate(out[list(_POLICY_STR_COLUMNS + _POLICY_FLOAT_COLUMNS)].to_dict("records")):
        bad = _entry_problem(PolicyEntry(**row))
        if bad:
            raise _fail(source, f"row {r} (accuracy_floor {out['accuracy_floor'].iloc[r]:g}, policy "
                                f"{row['policy_id']}): column {bad[0]} {bad[1]}")

    for (key, floor), grp in out.groupby(["key", "accuracy_floor"], sort=False):
        lo = grp["x_lo_s_per_gb"].to_numpy()
        hi = grp["x_hi_s_per_gb"].to_numpy()
        where = f"accuracy_floor {floor:g}" + (f", key {key!r}" if key else "")
        if lo[0] != 0.0:
            raise _fail(source, f"{where}: first interval starts at x={lo[0]} s/GB, not 0")
        if hi[-1] != np.inf:
            raise _fail(source, f"{where}: last interval ends at x={hi[-1]} s/GB, not inf")
        if np.isinf(hi[:-1]).any():
            k = int(np.flatnonzero(np.isinf(hi[:-1]))[0])
            raise _fail(
                source,
                f"{where}: interval {k} ends at x=inf but is not the last one "
                "(is the table for this floor stored twice? duplicate rows)",
            )
        if not (lo < hi).all():
            k = int(np.flatnonzero(~(lo < hi))[0])
            raise _fail(
                source,
                f"{where}: non-monotone breakpoints: interval {k} has x_lo={lo[k]} >= x_hi={hi[k]}",
            )
        if not np.isfinite(lo).all() or not np.isfinite(hi[:-1]).all():
            raise _fail(source, f"{where}: non-finite breakpoint before the last interval")
        if not (np.diff(lo) > 0).all():
            k = int(np.flatnonzero(~(np.diff(lo) > 0))[0])
            raise _fail(
                source,
                f"{where}: non-monotone breakpoints: interval {k + 1} starts at x={lo[k + 1]} "
                f"<= start of interval {k} (x={lo[k]})",
            )
        joins = hi[:-1] != lo[1:]
        if joins.any():
            k = int(np.flatnonzero(joins)[0])
            kind = "gap" if hi[k] < lo[k + 1] else "overlap"
            raise _fail(
                source,
                f"{where}: {kind} between interval {k} (x_hi={hi[k]}) and {k + 1} (x_lo={lo[k + 1]})",
            )
        for col, x in (("bandwidth_hi_gbps", lo), ("bandwidth_lo_gbps", hi)):
            expect = np.asarray(x_s_per_gb_to_gbps(x), dtype=np.float64)
            got = grp[col].to_numpy()
            if not np.allclose(got, expect, rtol=1e-9, atol=0.0):
                raise _fail(source, f"{where}: {col} does not equal 8 / x (Gbps from s/GB)")
        acc = grp["relative_accuracy"].to_numpy()
        low = (acc < floor - _FLOOR_TOL) & (grp["policy_id"].to_numpy() != NONE_POLICY_ID)
        if low.any():
            pid = grp["policy_id"].to_numpy()[low][0]
            raise _fail(source, f"{where}: policy {pid} has relative_accuracy below the floor")
    for r, (ids_s, pols_s) in enumerate(zip(out["runners_up"], out["runner_up_policies"], strict=True)):
        try:
            ids = json.loads(ids_s)
            pols = [PolicyEntry.from_json_dict(p) for p in json.loads(pols_s)]
        except (ValueError, KeyError, TypeError) as exc:
            raise _fail(source, f"row {r}: malformed runners_up/runner_up_policies ({exc})") from None
        if not isinstance(ids, list) or ids != [p.policy_id for p in pols]:
            raise _fail(source, f"row {r}: runners_up does not match runner_up_policies")
        floor = float(out["accuracy_floor"].iloc[r])
        for k, p in enumerate(pols):
            bad = _entry_problem(p)
            if bad:
                raise _fail(source, f"row {r}: runner_up_policies[{k}] (policy {p.policy_id}): {bad[0]} {bad[1]}")
            if p.relative_accuracy < floor - _FLOOR_TOL and p.policy_id != NONE_POLICY_ID:
                raise _fail(source, f"row {r} (accuracy_floor {floor:g}): runner_up_policies[{k}] (policy "
                                    f"{p.policy_id}) has relative_accuracy {p.relative_accuracy:g}, below the floor")

    # Canonical order: key ascending ("" first), floor descending, then stored order (x).
    key_rank = {k: i for i, k in enumerate(sorted(out["key"].unique()))}
    order = np.lexsort(
        (np.arange(len(out)), -out["accuracy_floor"].to_numpy(), out["key"].map(key_rank).to_numpy())
    )
    out = out.iloc[order].reset_index(drop=True)
    extras = [c for c in out.columns if c not in _ORDER]
    return out[list(_ORDER) + extras]


class _Interval:
    """Precomputed lookup record of one table row (plain Python floats: fastest to bisect)."""

    __slots__ = ("x_lo", "x_hi", "bw_lo", "bw_hi", "policy", "alts", "runner_ids", "cands")

    def __init__(self, row: Mapping[str, Any]) -> None:
        self.x_lo = float(row["x_lo_s_per_gb"])
        self.x_hi = float(row["x_hi_s_per_gb"])
        self.bw_lo = float(row["bandwidth_lo_gbps"])
        self.bw_hi = float(row["bandwidth_hi_gbps"])
        self.policy = PolicyEntry(
            **{c: str(row[c]) for c in _POLICY_STR_COLUMNS},
            **{c: float(row[c]) for c in _POLICY_FLOAT_COLUMNS},
        )
        self.alts = tuple(PolicyEntry.from_json_dict(p) for p in json.loads(row["runner_up_policies"]))
        self.runner_ids = tuple(p.policy_id for p in self.alts)
        # (entry, a, b, threshold_gbps) of the envelope policy then its runners-up
        self.cands = tuple((e, e.a_s_per_gb, e.b, e.threshold_gbps) for e in (self.policy, *self.alts))


class PolicyTable:
    """A compiled, versioned policy table (KVServe piecewise table) plus its metadata.

    Build it with :func:`compile_policy_table` or :meth:`PolicyTable.load`. Construction
    validates the frame (see :meth:`load` for the checks) and precomputes, per
    ``(key, accuracy floor)``, the list of interval starts in x and one record per interval
    with its policy and runners-up as Python floats, so that :meth:`select` is a dictionary
    lookup, a bisect and a few float operations (about 2-4 us on a 2-core CPU; see
    ``benchmarks/selector.py``).

    Args:
        frame: a schema-1 table (columns :data:`COLUMNS`, optional ``key``, extra columns are
            kept).
        metadata: extra JSON-serializable key/values (stored in files; kvtune reads only
            ``kv_bytes_per_request``).
        source: name used in error messages (a file path when loaded).

    Raises:
        TableError: the frame is malformed.
    """

    def __init__(
        self,
        frame: pd.DataFrame,
        *,
        metadata: Mapping[str, Any] | None = None,
        source: str = "<in-memory policy table>",
    ) -> None:
        self._frame = _validate_frame(frame, source)
        self._metadata = dict(metadata or {})
        try:
            strict_dumps(self._metadata)
        except (TypeError, ValueError) as exc:
            raise _fail(source, f"metadata is not JSON-serializable: {exc}") from None
        kvb = self._metadata.get("kv_bytes_per_request")
        if kvb is not None:
            if isinstance(kvb, bool) or not isinstance(kvb, (int, float)) or not (math.isfinite(kvb) and kvb > 0):
                raise _fail(source, f"metadata kv_bytes_per_request must be a number > 0, got {kvb!r}")
        self._kv_default = float(kvb) if kvb is not None else DEFAULT_KV_BYTES
        first = self._frame.iloc[0]
        self._model = str(first["model"])
        self._workload = str(first["workload"])
        self._device = str(first["device"])
        self._floors = tuple(sorted({float(f) for f in self._frame["accuracy_floor"]}, reverse=True))
        self._keys = tuple(dict.fromkeys(self._frame["key"].astype(str)))
        self._key_floors: dict[str, tuple[float, ...]] = {}
        self._floor_cache: dict[tuple[str, float], float] = {}
        self._lookup: dict[tuple[str, float], tuple[list[float], list[_Interval]]] = {}
        for (key, floor), grp in self._frame.groupby(["key", "accuracy_floor"], sort=False):
            recs = [_Interval(row) for row in grp.to_dict("records")]
            self._lookup[(str(key), float(floor))] = ([r.x_lo for r in recs], recs)
            self._key_floors.setdefault(str(key), ())
            self._key_floors[str(key)] += (float(floor),)

    # ---------------------------------------------------------------- properties

    @property
    def frame(self) -> pd.DataFrame:
        """A copy of the rows (one per key x floor x interval), columns ``COLUMNS`` + ``key``
        + extras."""
        return self._frame.copy()

    @property
    def schema_version(self) -> int:
        """Schema version of the table (1)."""
        return SCHEMA_VERSION

    @property
    def model(self) -> str:
        """Model the table was profiled for."""
        return self._model

    @property
    def workload(self) -> str:
        """Workload the table was profiled for."""
        return self._workload

    @property
    def device(self) -> str:
        """Device the codec throughputs were measured on."""
        return self._device

    @property
    def floors(self) -> tuple[float, ...]:
        """Configured accuracy floors (fractions, union over keys), descending."""
        return self._floors

    @property
    def keys(self) -> tuple[str, ...]:
        """Extra table keys present (``("",)`` for an unkeyed table), sorted."""
        return self._keys

    @property
    def kv_bytes_per_request(self) -> float | None:
        """Bytes of original KV of one profiled request (metadata), or None if unknown."""
        v = self._metadata.get("kv_bytes_per_request")
        return None if v is None else float(v)

    @property
    def default_kv_bytes(self) -> float:
        """KV volume (bytes) used by :meth:`select` when none is given:
        :attr:`kv_bytes_per_request` if known, else :data:`DEFAULT_KV_BYTES` (1 GB)."""
        return self._kv_default

    @property
    def metadata(self) -> dict[str, Any]:
        """Header of the table: format, schema_version, model, workload, device, floors and
        the extra metadata given at construction (under ``"extra"``)."""
        return {
            "format": _FORMAT,
            "schema_version": SCHEMA_VERSION,
            "model": self._model,
            "workload": self._workload,
            "device": self._device,
            "floors": list(self._floors),
            "extra": dict(self._metadata),
        }

    def __len__(self) -> int:
        return len(self._frame)

    def __repr__(self) -> str:
        keys = "" if self._keys == (DEFAULT_KEY,) else f", keys={list(self._keys)}"
        return (
            f"PolicyTable(model={self._model!r}, workload={self._workload!r}, "
            f"device={self._device!r}, floors={list(self._floors)}{keys}, rows={len(self)})"
        )

    def with_metadata(self, **extra: Any) -> PolicyTable:
        """A copy of the table with ``extra`` merged into its metadata (same rows)."""
        return PolicyTable(self._frame, metadata={**self._metadata, **extra})

    def with_codec_speedup(self, factor: float) -> PolicyTable:
        """What-if table: the same policies with encode and decode throughputs x ``factor``
        (e.g. GPU codecs instead of the profiling CPU). **Hypothetical**: the device name
        gains ``"x<factor> codec speed (hypothetical)"`` and the metadata
        ``codec_speedup``.

        Exact for the envelope: every line ``a + b x`` becomes ``a / f + b x``, whose
        minimum at x is the original minimum at ``f x``, so breakpoints in x are divided by f
        (bandwidths multiplied by f), ``a`` divided, throughputs and B* multiplied. The
        runners-up of each interval are kept.

        Args:
            factor: throughput multiplier (> 0).

        Raises:
            KvtuneError: factor not > 0 or not finite.
        """
        f = float(factor)
        if not (math.isfinite(f) and f > 0):
            raise KvtuneError(f"codec speedup factor must be finite and > 0, got {factor}")
        out = self._frame.copy()
        for c in ("x_lo_s_per_gb", "x_hi_s_per_gb", "a_s_per_gb"):
            out[c] = out[c] / f
        for c in ("bandwidth_lo_gbps", "bandwidth_hi_gbps", "encode_gbps", "decode_gbps", "threshold_gbps"):
            out[c] = out[c] * f

        def scale(js: str) -> str:
            pols = json.loads(js)
            for p in pols:
                p["a_s_per_gb"] = enc_float(dec_float(p["a_s_per_gb"], "a_s_per_gb") / f)
                for c in ("encode_gbps", "decode_gbps", "threshold_gbps"):
                    p[c] = enc_float(dec_float(p[c], c) * f)
            return strict_dumps(pols)

        out["runner_up_policies"] = out["runner_up_policies"].map(scale)
        out["device"] = f"{self._device} x{f:g} codec speed (hypothetical)"
        return PolicyTable(out, metadata={**self._metadata, "codec_speedup": f})

    @classmethod
    def combine(cls, tables: Sequence[PolicyTable]) -> PolicyTable:
        """Merge tables that differ only in their extra ``key`` into one table.

        Args:
            tables: tables of the same model, workload and device, with disjoint
                ``(key, accuracy_floor)`` pairs.

        Returns:
            One table; metadata merged left to right.

        Raises:
            TableError: different model/workload/device, or a repeated (key, floor).
        """
        if not tables:
            raise TableError("combine needs at least one table")
        frames, meta = [], {}
        for t in tables:
            frames.append(t._frame)
            meta.update(t._metadata)
        seen: set[tuple[str, float]] = set()
        for t in tables:
            dup = seen & set(t._lookup)
            if dup:
                raise TableError(f"combine: (key, accuracy_floor) {sorted(dup)[0]} appears in two tables")
            seen |= set(t._lookup)
        return cls(pd.concat(frames, ignore_index=True), metadata=meta, source="<combined policy table>")

    def _check_key(self, key: str) -> str:
        if key not in self._key_floors:
            raise TableError(f"table key {key!r} not in the policy table (keys: {list(self._keys)})")
        return key

    def intervals(self, accuracy_floor: float, *, key: str = DEFAULT_KEY) -> pd.DataFrame:
        """Rows of one floor (and table key), left to right in x (high to low bandwidth).

        Raises:
            TableError: the key or the floor is not in the table.
        """
        self._check_key(key)
        floor = self._exact_floor(accuracy_floor, key)
        f = self._frame
        return f[(f["accuracy_floor"] == floor) & (f["key"] == key)].reset_index(drop=True)

    def floor_for(self, q_min: float, *, key: str = DEFAULT_KEY) -> float:
        """The accuracy bucket for a requested minimum accuracy: the smallest configured floor
        >= ``q_min`` (with a 1e-12 tolerance).

        Raises:
            TableError: q_min is NaN, the key is unknown, or every floor is below ``q_min``.
        """
        cached = self._floor_cache.get((key, q_min))
        if cached is not None:
            return cached
        q = float(q_min)
        if math.isnan(q):
            raise TableError("q_min is NaN")
        floors = self._key_floors.get(key)
        if floors is None:
            self._check_key(key)
        best = None
        for f in floors:  # few floors: a loop beats min() over a generator
            if f >= q - _FLOOR_TOL and (best is None or f < best):
                best = f
        if best is None:
            raise TableError(
                f"no accuracy floor >= q_min={q:g} in the policy table for {self._model}/"
                f"{self._workload}/{self._device} (floors: {list(floors)})"
            )
        if len(self._floor_cache) < 4096:  # q_min values repeat: memoize (bounded)
            self._floor_cache[(key, q_min)] = best
        return best

    def _exact_floor(self, accuracy_floor: float, key: str = DEFAULT_KEY) -> float:
        for f in self._key_floors.get(key, ()):
            if abs(f - float(accuracy_floor)) <= _FLOOR_TOL:
                return f
        raise TableError(f"accuracy floor {accuracy_floor} not in table (floors: {list(self._floors)})")

    # ---------------------------------------------------------------- selection

    def select(
        self,
        bandwidth_gbps: float,
        q_min: float,
        *,
        workload: str | None = None,
        slo_s: float | None = None,
        kv_bytes: float | None = None,
        key: str = DEFAULT_KEY,
    ) -> SelectedPolicy:
        """The policy to use at link bandwidth ``bandwidth_gbps`` with accuracy >= ``q_min``
        (KVServe online step without feedback: bucket, binary search on x = 1/B, screen the
        envelope policy and its runners-up).

        Steps: bucket = smallest floor >= ``q_min``; interval = bisect of ``x = 8 /
        bandwidth_gbps`` among the interval starts; candidates = the interval's envelope
        policy then its runners-up; a runner-up with ``bandwidth_gbps >= B*`` is dropped
        (``"no_gain"``: slower than uncompressed; the envelope policy is never dropped); a
        candidate whose predicted time ``(a + b x) V`` exceeds ``slo_s`` is dropped
        (``"over_slo"``); the fastest remaining one is chosen. When none meets the SLO the
        fastest admissible one is returned with ``slo_violated=True``. With the static model
        the envelope policy is always the fastest, so the SLO only sets the flag and the
        statuses; :class:`kvtune.tables.controller.Controller` adds measured residuals.

        Intervals are half-open in x, ``[x_lo, x_hi)``, i.e. ``(bandwidth_lo, bandwidth_hi]``
        in Gbps: a bandwidth exactly at a breakpoint selects the interval on its
        lower-bandwidth side (both policies predict the same time there).

        Args:
            bandwidth_gbps: link bandwidth in Gbps (1e9 bits/s), > 0; inf allowed.
            q_min: minimum relative accuracy (fraction, e.g. 0.97).
            workload: if given, must equal :attr:`workload` (guards against using a table
                profiled for another workload).
            slo_s: transfer-time SLO in seconds for ``kv_bytes`` (None = no SLO).
            kv_bytes: KV volume V in bytes of original bf16 KV; default
                :attr:`default_kv_bytes`.
            key: extra table key (``""`` = none).

        Returns:
            :class:`SelectedPolicy`.

        Raises:
            TableError: workload mismatch, unknown key, or no configured floor >= ``q_min``.
            KvtuneError: bandwidth is NaN or <= 0, q_min is NaN or negative, or kv_bytes /
                slo_s not > 0.
        """
        bw = float(bandwidth_gbps)
        if not bw > 0:
            raise KvtuneError(f"bandwidth_gbps must be > 0, got {bandwidth_gbps}")
        if not float(q_min) >= 0:
            raise KvtuneError(f"q_min must be a relative accuracy >= 0 (a fraction such as 0.97), got {q_min}")
        if workload is not None and workload != self._workload:
            raise TableError(
                f"workload {workload!r} does not match the table's workload {self._workload!r} "
                f"(model {self._model}); profile that workload or drop the workload filter"
            )
        floor = self.floor_for(q_min, key=key)
        los, recs = self._lookup[(key, floor)]
        x = 8.0 / bw
        iv = recs[bisect.bisect_right(los, x) - 1]
        v = self._kv_default if kv_bytes is None else float(kv_bytes)
        if not v > 0:
            raise KvtuneError(f"kv_bytes must be > 0, got {kv_bytes}")
        if slo_s is not None and not float(slo_s) > 0:
            raise KvtuneError(f"slo_s must be > 0 seconds, got {slo_s}")
        gb = v * 1e-9
        times = []
        best = -1
        best_t = math.inf
        fallback = 0  # fastest admissible when nothing meets the SLO
        fallback_t = math.inf
        statuses = []
        for k, (e, a, b, thr) in enumerate(iv.cands):
            t = (a + b * x) * gb
            times.append(t)
            if k and bw >= thr:
                statuses.append(STATUS_NO_GAIN)
                continue
            if t < fallback_t:
                fallback, fallback_t = k, t
            if slo_s is not None and t > slo_s:
                statuses.append(STATUS_OVER_SLO)
                continue
            statuses.append(STATUS_OK)
            if t < best_t:
                best, best_t = k, t
        violated = best < 0
        if violated:
            best = fallback
        statuses[best] = STATUS_CHOSEN
        return tuple.__new__(
            SelectedPolicy,
            (
                iv.cands[best][0],
                floor,
                float(q_min),
                bw,
                x,
                iv.x_lo,
                iv.x_hi,
                iv.bw_lo,
                iv.bw_hi,
                iv.runner_ids,
                iv.alts,
                v,
                None if slo_s is None else float(slo_s),
                violated,
                key,
                iv.policy,
                tuple(times),
                tuple(statuses),
            ),
        )

    # ---------------------------------------------------------------- files

    def to_parquet(self, path: str | os.PathLike[str]) -> Path:
        """Write the table to Parquet atomically; the header (:attr:`metadata`) goes into the
        file's key-value metadata under ``kvtune.policy_table``. Returns the path."""
        import pyarrow as pa
        import pyarrow.parquet as pq

        tbl = pa.Table.from_pandas(self._frame, preserve_index=False)
        meta = dict(tbl.schema.metadata or {})
        meta[_PARQUET_META_KEY] = strict_dumps(self.metadata).encode()
        tbl = tbl.replace_schema_metadata(meta)
        with atomic_path(path) as tmp:
            pq.write_table(tbl, tmp)
        return Path(path)

    def to_json(self, path: str | os.PathLike[str]) -> Path:
        """Write a human-readable, strict-JSON file atomically; returns the path.

        Layout: the header (:attr:`metadata` plus ``units``), then ``tables``: one object per
        (extra ``key``, accuracy floor) with its ``intervals`` left to right in x, each with breakpoints both
        as ``x_*_s_per_gb`` (1/B) and ``bandwidth_*_gbps``, the policy's numbers, and its
        runners-up as a list of ids and a list of objects. Non-finite numbers are the strings
        ``"inf"``/``"-inf"``.
        """
        doc = self.metadata
        doc["units"] = {
            "x_*_s_per_gb": "x = 1/B: seconds per GB (1e9 bytes) over the link; interval [x_lo, x_hi)",
            "bandwidth_*_gbps": "link gigabits per second (1e9 bits/s) = 8 / x",
            "a_s_per_gb": "codec seconds per GB of original KV = 1/encode_gbps + 1/decode_gbps",
            "b": "1 / compression_ratio; predicted seconds per GB of KV = a + b * x",
            "encode_gbps, decode_gbps": "GB/s (1e9 bytes/s) of original bf16 KV",
            "threshold_gbps": "compression pays iff link Gbps < threshold_gbps",
            "relative_accuracy, accuracy_floor": "fraction, 1.0 == 100 %",
        }
        per_row = [c for c in self._frame.columns if c not in _META_COLUMNS and c != "key"]
        tables = []
        for (key, floor), grp in self._frame.groupby(["key", "accuracy_floor"], sort=False):
            intervals = []
            for row in grp.to_dict("records"):
                item: dict[str, Any] = {}
                for c in per_row:
                    v = row[c]
                    if c in _RUNNER_COLUMNS:
                        item[c] = json.loads(v)
                    elif c in _FLOAT_COLUMNS:
                        item[c] = enc_float(v)
                    else:
                        item[c] = _json_value(v)
                intervals.append(item)
            tables.append({"accuracy_floor": float(floor), "key": str(key), "intervals": intervals})
        doc["tables"] = tables
        return atomic_write_text(path, json.dumps(doc, indent=2, allow_nan=False) + "\n")

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> PolicyTable:
        """Load a table written by :meth:`to_parquet` (``.parquet``/``.pq``) or :meth:`to_json`
        (``.json``), chosen by suffix, and validate it.

        Checks: readable file of that format; known ``schema_version``; all :data:`COLUMNS`
        present; no missing values; one model/workload/device; per floor the intervals start
        at x = 0, end at inf, have ``x_lo < x_hi`` (monotone breakpoints) and no gaps or
        overlaps; Gbps columns equal ``8 / x``; policies meet their floor; runners-up parse and meet it too;
        every policy (chosen or runner-up) has plausible numbers and a JSON-object
        ``config_json`` (see :func:`_entry_problem`: no NaN, ``a >= 0``, ``b = 1 /
        compression_ratio >= 0``, ``compression_ratio > 0``, relative accuracy in ``[0, 2]``,
        throughputs > 0, ``threshold_gbps >= 0``).

        Raises:
            TableError: naming the file and the problem (and the row and column of a bad
                value); also for a file over :data:`MAX_TABLE_BYTES` (checked before reading)
                and for JSON nested too deeply to parse.
        """
        p = Path(path)
        src = str(p)
        suffix = p.suffix.lower()
        if not p.exists():
            raise _fail(src, "file not found")
        if suffix not in (".parquet", ".pq", ".json"):
            raise _fail(src, f"unknown policy table suffix {p.suffix!r} (use .parquet or .json, or a run folder)")
        if not p.is_file():
            raise _fail(src, "not a file")
        size = p.stat().st_size
        if size > MAX_TABLE_BYTES:
            raise _fail(src, f"file is {size} bytes, more than a policy table's limit of {MAX_TABLE_BYTES}")
        try:
            if suffix == ".json":
                frame, extra, header_floors = _read_json(p)
            else:
                frame, extra, header_floors = _read_parquet(p)
            table = cls(frame, metadata=extra, source=src)
        except RecursionError:
            raise _fail(src, "JSON nested too deeply (a header, config_json or runner-up list)") from None
        if header_floors is not None and sorted(map(float, header_floors)) != sorted(table.floors):
            raise _fail(
                src, f"header floors {header_floors} do not match the rows' floors {list(table.floors)}"
            )
        return table


def _check_header(header: Mapping[str, Any], src: str) -> None:
    if header.get("format", _FORMAT) != _FORMAT:
        raise _fail(src, f"not a kvtune policy table (format={header.get('format')!r})")
    if "schema_version" not in header:
        raise _fail(src, "header lacks schema_version")
    version = header["schema_version"]
    if isinstance(version, bool) or not isinstance(version, int) or version not in SUPPORTED_SCHEMA_VERSIONS:
        raise _fail(
            src,
            f"unknown schema_version {version!r} (this kvtune reads {sorted(SUPPORTED_SCHEMA_VERSIONS)})",
        )


def _read_parquet(p: Path) -> tuple[pd.DataFrame, dict[str, Any], list[Any] | None]:
    import pyarrow.parquet as pq

    src = str(p)
    try:
        tbl = pq.read_table(p)
    except Exception as exc:  # pyarrow raises several types for corrupt files
        raise _fail(src, f"cannot read Parquet ({exc})") from None
    raw = (tbl.schema.metadata or {}).get(_PARQUET_META_KEY)
    extra: dict[str, Any] = {}
    floors = None
    if raw is not None:
        try:
            header = json.loads(raw)
        except ValueError:
            raise _fail(src, "malformed kvtune header in Parquet metadata") from None
        if not isinstance(header, dict):
            raise _fail(src, "malformed kvtune header in Parquet metadata")
        _check_header(header, src)
        extra = dict(header.get("extra") or {})
        floors = _header_floors(header, src)
    frame = tbl.to_pandas()
    return frame, extra, floors


def _read_json(p: Path) -> tuple[pd.DataFrame, dict[str, Any], list[Any] | None]:
    src = str(p)
    try:
        doc = json.loads(p.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise _fail(src, f"cannot read JSON ({exc})") from None
    if not isinstance(doc, dict):
        raise _fail(src, "top level must be a JSON object")
    _check_header(doc, src)
    for key in ("model", "workload", "device", "tables"):
        if key not in doc:
            raise _fail(src, f"missing header field {key!r}")
    if not isinstance(doc["tables"], list) or not doc["tables"]:
        raise _fail(src, "'tables' must be a non-empty list")
    rows: list[dict[str, Any]] = []
    seen: set[tuple[Any, Any]] = set()
    for t in doc["tables"]:
        if not isinstance(t, dict) or "accuracy_floor" not in t or not isinstance(t.get("intervals"), list):
            raise _fail(src, "each entry of 'tables' needs 'accuracy_floor' and a list 'intervals'")
        if not isinstance(t.get("key", DEFAULT_KEY), str):
            raise _fail(src, f"table 'key' must be a string, got {t.get('key')!r}")
        if not isinstance(t["accuracy_floor"], (int, float)) or isinstance(t["accuracy_floor"], bool):
            raise _fail(src, f"'accuracy_floor' must be a number, got {t['accuracy_floor']!r}")
        ident = (t.get("key", DEFAULT_KEY), t["accuracy_floor"])
        if ident in seen:
            raise _fail(src, f"duplicate table for accuracy_floor {ident[1]} and key {ident[0]!r}")
        seen.add(ident)
        for k, item in enumerate(t["intervals"]):
            if not isinstance(item, dict):
                raise _fail(src, "each interval must be a JSON object")
            missing = [c for c in COLUMNS if c not in _META_COLUMNS and c not in item]
            if missing:
                raise _fail(
                    src,
                    f"missing column(s) {missing} in interval {k} of accuracy_floor "
                    f"{t['accuracy_floor']}",
                )
            row: dict[str, Any] = {
                "schema_version": doc["schema_version"],
                "model": doc["model"],
                "workload": doc["workload"],
                "device": doc["device"],
                "accuracy_floor": t["accuracy_floor"],
                "key": t.get("key", DEFAULT_KEY),
            }
            for c, v in item.items():
                if c in _RUNNER_COLUMNS:
                    try:
                        row[c] = strict_dumps(v)
                    except ValueError:  # Python's json reads NaN / Infinity tokens; a table never holds them
                        raise _fail(src, f"interval {k} of accuracy_floor {t['accuracy_floor']}: {c} holds a NaN "
                                         "or infinite number (write inf as the string \"inf\")") from None
                elif c in _FLOAT_COLUMNS:
                    try:
                        row[c] = dec_float(v, c)
                    except ValueError as exc:
                        raise _fail(src, str(exc)) from None
                else:
                    row[c] = v
            rows.append(row)
    frame = pd.DataFrame(rows)
    extra = doc.get("extra") or {}
    if not isinstance(extra, dict):
        raise _fail(src, "'extra' must be a JSON object")
    return frame, dict(extra), _header_floors(doc, src)


def _header_floors(header: Mapping[str, Any], src: str) -> list[Any] | None:
    floors = header.get("floors")
    if floors is None:
        return None
    if not isinstance(floors, list) or not all(
        isinstance(f, (int, float)) and not isinstance(f, bool) for f in floors
    ):
        raise _fail(src, f"header 'floors' must be a list of numbers, got {floors!r}")
    return floors
