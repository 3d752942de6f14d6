"""Latency model, lower envelope and piecewise policy tables (KVServe, arXiv 2605.13734).

* :mod:`kvtune.tables.latency` -- transfer-time model, bandwidth threshold B*, and the measured
  per-transfer costs (fixed cost, CPU wire-byte rate, paged-cache move rate) fitted to real
  transfers.
* :mod:`kvtune.tables.envelope` -- lower envelope of the lines ``a + b * x`` (x = 1/B).
* :mod:`kvtune.tables.policy_table` -- compile, save, load and query the versioned table.
* :mod:`kvtune.tables.controller` -- online controller: residual EWMA, epsilon-greedy,
  SLO fallback, bandwidth estimation and per-chunk re-selection.
* :mod:`kvtune.tables.run` -- compile / export the table of a profiling run folder.
* :mod:`kvtune.core.units` -- parse ``10Gbps``, ``200ms``, ``24MB``.
"""

from kvtune.tables.controller import ChunkedTransfer, Controller, ControllerConfig, Decision, Feedback, Observation
from kvtune.tables.envelope import Interval, locate_interval, lower_envelope
from kvtune.tables.latency import (
    TransferCosts,
    bytes_per_s_to_gbps,
    effective_bandwidth_bytes_per_s,
    fit_transfer_costs,
    gb_per_s_to_bytes_per_s,
    gbps_to_bytes_per_s,
    gbps_to_x_s_per_gb,
    line_coefficients,
    threshold_bandwidth,
    threshold_gbps,
    transfer_seconds,
    transfer_seconds_with_costs,
    uncompressed_seconds,
    x_s_per_gb_to_gbps,
)
from kvtune.tables.policy_table import (
    COLUMNS,
    DEFAULT_FLOORS,
    DEFAULT_KEY,
    DEFAULT_KV_BYTES,
    NONE_POLICY_ID,
    OPTIONAL_COLUMNS,
    SCHEMA_VERSION,
    CandidateTime,
    PolicyEntry,
    PolicyTable,
    SelectedPolicy,
    compile_policy_table,
)
from kvtune.core.units import UnitError, parse_bandwidth_gbps, parse_bytes, parse_duration_s

__all__ = [
    "COLUMNS",
    "DEFAULT_FLOORS",
    "DEFAULT_KEY",
    "DEFAULT_KV_BYTES",
    "NONE_POLICY_ID",
    "OPTIONAL_COLUMNS",
    "SCHEMA_VERSION",
    "CandidateTime",
    "ChunkedTransfer",
    "Controller",
    "ControllerConfig",
    "Decision",
    "Feedback",
    "Interval",
    "Observation",
    "PolicyEntry",
    "PolicyTable",
    "SelectedPolicy",
    "TransferCosts",
    "UnitError",
    "bytes_per_s_to_gbps",
    "compile_policy_table",
    "effective_bandwidth_bytes_per_s",
    "fit_transfer_costs",
    "gb_per_s_to_bytes_per_s",
    "gbps_to_bytes_per_s",
    "gbps_to_x_s_per_gb",
    "line_coefficients",
    "locate_interval",
    "lower_envelope",
    "parse_bandwidth_gbps",
    "parse_bytes",
    "parse_duration_s",
    "threshold_bandwidth",
    "threshold_gbps",
    "transfer_seconds",
    "transfer_seconds_with_costs",
    "uncompressed_seconds",
    "x_s_per_gb_to_gbps",
]
