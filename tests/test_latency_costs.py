"""Measured transfer costs on top of the KVServe latency model (kvtune.tables.latency)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from kvtune.core.errors import ConfigError
from kvtune.tables import (
    TransferCosts,
    effective_bandwidth_bytes_per_s,
    fit_transfer_costs,
    transfer_seconds,
    transfer_seconds_with_costs,
)

V = np.array([23_592_960.0, 47_185_920.0, 23_592_960.0, 47_185_920.0, 23_592_960.0, 47_185_920.0])
CR = np.array([1.0, 1.0, 3.5, 3.5, 7.1, 5.0])
B = np.array([12.5e6, 125e6, 62.5e6, 250e6, 625e6, 1.25e9])  # 0.1 .. 10 Gbps in bytes/s
S_ENC = np.array([5.2e8, 6.0e8, 2.0e9, 2.4e9, 8.0e8, 1.1e9])
S_DEC = np.array([1.1e9, 1.4e9, 9.0e8, 1.0e9, 3.0e9, 2.0e9])


def test_default_costs_reduce_exactly_to_the_nominal_model():
    got = transfer_seconds_with_costs(V, B, S_ENC, S_DEC, CR)
    want = transfer_seconds(V, B, S_ENC, S_DEC, CR)
    assert np.array_equal(got, want)
    # scalar: 1 GB over 1 GB/s at cr 2 with 2 GB/s codecs each way = 0.5 + 0.5 + 0.5 s
    assert transfer_seconds_with_costs(1e9, 1e9, 2e9, 2e9, 2.0) == 1.5
    assert transfer_seconds_with_costs(1e9, 1e9, 2e9, 2e9, 2.0, TransferCosts()) == transfer_seconds(
        1e9, 1e9, 2e9, 2e9, 2.0)


def test_each_cost_term_adds_its_physical_time():
    # 1 GB of KV at cr 2 -> 0.5 GB on the wire; B_cpu 8 Gbps = 1 GB/s -> 0.5 s; s_move 4 GB/s -> 0.25 s
    costs = TransferCosts(fixed_s=0.01, wire_cpu_gbps=8.0, move_gb_per_s=4.0)
    assert transfer_seconds_with_costs(1e9, 1e9, 2e9, 2e9, 2.0, costs) == pytest.approx(1.5 + 0.01 + 0.5 + 0.25)
    # effective link rate 1 / (1/B + 1/B_cpu): 1 GB/s link and 1 GB/s CPUs -> 0.5 GB/s
    assert effective_bandwidth_bytes_per_s(1e9, costs) == pytest.approx(0.5e9)
    assert effective_bandwidth_bytes_per_s(1e9, TransferCosts()) == 1e9


def test_fit_recovers_the_constants_that_generated_the_times():
    true = TransferCosts(fixed_s=0.012, wire_cpu_gbps=9.8, move_gb_per_s=1.68)
    measured = transfer_seconds_with_costs(V, B, S_ENC, S_DEC, CR, true)
    nominal = transfer_seconds(V, B, S_ENC, S_DEC, CR)
    fit = fit_transfer_costs(measured, nominal, V / CR, V)
    assert fit.fixed_s == pytest.approx(0.012, rel=1e-9)
    assert fit.wire_cpu_gbps == pytest.approx(9.8, rel=1e-9)
    assert fit.move_gb_per_s == pytest.approx(1.68, rel=1e-9)


def test_fit_keeps_terms_non_negative_and_unused_terms_free():
    nominal = transfer_seconds(V, B, S_ENC, S_DEC, CR)
    # only a move cost generated the data: no fixed cost, no CPU wire cost
    measured = transfer_seconds_with_costs(V, B, S_ENC, S_DEC, CR, TransferCosts(move_gb_per_s=1.0))
    fit = fit_transfer_costs(measured, nominal, V / CR, V)
    assert fit.fixed_s == pytest.approx(0.0, abs=1e-12)
    assert fit.wire_cpu_gbps == math.inf or fit.wire_cpu_gbps > 1e6
    assert fit.move_gb_per_s == pytest.approx(1.0, rel=1e-9)
    # transfers faster than predicted would need negative costs: the fit clamps them to none
    fit = fit_transfer_costs(nominal * 0.5, nominal, V / CR, V)
    assert fit == TransferCosts()


@pytest.mark.parametrize(
    "kwargs, name",
    [
        ({"measured_s": [0.1, 0.2]}, "nominal_s has 3 values, measured_s has 2"),
        ({"measured_s": [0.1, 0.0, 0.3]}, "measured_s[1]"),
        ({"measured_s": [0.1, float("nan"), 0.3]}, "measured_s[1]"),
        ({"nominal_s": [0.1, 0.2, -0.3]}, "nominal_s[2]"),
        ({"nominal_s": [0.1, math.inf, 0.3]}, "nominal_s[1]"),
        ({"wire_bytes": [1e6, -1.0, 1e6]}, "wire_bytes[1]"),
        ({"kv_bytes": [1e6, 1e6]}, "kv_bytes has 2 values"),
        ({"kv_bytes": [[1e6, 1e6, 1e6]]}, "kv_bytes must be a non-empty 1-D"),
        ({"measured_s": []}, "measured_s must be a non-empty 1-D"),
    ],
)
def test_fit_refuses_bad_inputs_naming_the_argument(kwargs, name):
    args = {"measured_s": [0.1, 0.2, 0.3], "nominal_s": [0.05, 0.1, 0.2], "wire_bytes": [1e6, 2e6, 3e6],
            "kv_bytes": [2e6, 4e6, 6e6], **kwargs}
    with pytest.raises(ConfigError, match=name.replace("[", r"\[").replace("]", r"\]")):
        fit_transfer_costs(**args)


@pytest.mark.parametrize(
    "kwargs, name",
    [({"fixed_s": -0.1}, "fixed_s"), ({"fixed_s": math.inf}, "fixed_s"), ({"wire_cpu_gbps": 0.0}, "wire_cpu_gbps"),
     ({"move_gb_per_s": float("nan")}, "move_gb_per_s"), ({"move_gb_per_s": -1.0}, "move_gb_per_s")],
)
def test_costs_refuse_out_of_range_values(kwargs, name):
    with pytest.raises(ConfigError, match=name):
        TransferCosts(**kwargs)
