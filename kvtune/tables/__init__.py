"""Latency model, lower envelope and piecewise policy tables (KVServe, ``BRIEF.md`` Sec. 2).

* :mod:`kvtune.tables.latency` -- transfer-time model and bandwidth threshold B*.
* :mod:`kvtune.tables.envelope` -- lower envelope of the lines ``a + b * x`` (x = 1/B).
* :mod:`kvtune.tables.policy_table` -- compile, save, load and query the versioned table.
"""

from kvtune.tables.envelope import Interval, locate_interval, lower_envelope
from kvtune.tables.latency import (
    bytes_per_s_to_gbps,
    gb_per_s_to_bytes_per_s,
    gbps_to_bytes_per_s,
    gbps_to_x_s_per_gb,
    line_coefficients,
    threshold_bandwidth,
    threshold_gbps,
    transfer_seconds,
    uncompressed_seconds,
    x_s_per_gb_to_gbps,
)
from kvtune.tables.policy_table import (
    COLUMNS,
    DEFAULT_FLOORS,
    NONE_POLICY_ID,
    SCHEMA_VERSION,
    PolicyEntry,
    PolicyTable,
    SelectedPolicy,
    compile_policy_table,
)

__all__ = [
    "COLUMNS",
    "DEFAULT_FLOORS",
    "NONE_POLICY_ID",
    "SCHEMA_VERSION",
    "Interval",
    "PolicyEntry",
    "PolicyTable",
    "SelectedPolicy",
    "bytes_per_s_to_gbps",
    "compile_policy_table",
    "gb_per_s_to_bytes_per_s",
    "gbps_to_bytes_per_s",
    "gbps_to_x_s_per_gb",
    "line_coefficients",
    "locate_interval",
    "lower_envelope",
    "threshold_bandwidth",
    "threshold_gbps",
    "transfer_seconds",
    "uncompressed_seconds",
    "x_s_per_gb_to_gbps",
]
