"""kvtune.serving runtime: a real policy table (profiles/example, SmolLM2-135M-Instruct) drives
encode / decode, the controller's choice follows the bandwidth learned from feedback, and a
table for another model is refused at start-up."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import torch

from kvtune.codecs import PolicyConfig, decode_kv, encode_kv, read_header
from kvtune.core.errors import KvtuneError, KVInputError, TableError
from kvtune.serving import (
    CalibrationError,
    ChunkAssemblyError,
    ModelMismatchError,
    ServingPolicy,
)
from kvtune.tables import PolicyTable, compile_policy_table

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "profiles" / "example"
TABLE_JSON = EXAMPLE / "policy_table.json"
LAYERS, HEADS, DIM = 30, 3, 64  # SmolLM2-135M-Instruct, as recorded in profiles/example/run.json

# Envelope policies of the example table's 0.97 bucket, high to low bandwidth (Gbps):
# none above 4.62; 4390fd4d495c in (4.33, 4.62]; f3097c94da6c in (0.585, 4.33];
# 056c94b1a525 in (0.558, 0.585]; 48750b40bb5e below 0.558.
EXPECTED_097 = {100.0: "none", 4.5: "4390fd4d495c", 2.0: "f3097c94da6c", 0.57: "056c94b1a525", 0.1: "48750b40bb5e"}

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def synthetic_kv(tokens: int = 128, dtype=torch.float32, layers: int = LAYERS, heads: int = HEADS, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(1, heads, tokens, DIM, generator=g).to(dtype), torch.randn(1, heads, tokens, DIM, generator=g).to(dtype))
        for _ in range(layers)
    ]


def load(q_min: float = 0.97, **kw) -> ServingPolicy:
    kw.setdefault("controller", {"epsilon": 0.0})
    return ServingPolicy.load(TABLE_JSON, q_min=q_min, **kw)


def test_importing_kvtune_serving_loads_no_profiling_stack():
    forbidden = ("transformers", "botorch", "gpytorch", "optuna", "plotly",
                 "kvtune.search", "kvtune.run", "kvtune.evaluate", "kvtune.methods", "lmcache")
    code = (
        "import sys, json, kvtune.serving\n"
        f"bad = sorted(m for m in sys.modules if any(m == f or m.startswith(f + '.') for f in {forbidden!r}))\n"
        "print(json.dumps(bad))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=240, check=True)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []


def test_geometry_comes_from_the_runs_run_json():
    geo = load().geometry
    assert (geo.num_layers, geo.kv_heads, geo.head_dim, geo.dtype) == (LAYERS, HEADS, DIM, "float32")
    assert geo.source == str(EXAMPLE / "run.json")


@pytest.mark.parametrize("spec", [TABLE_JSON, EXAMPLE / "policy_table.parquet", EXAMPLE])
def test_policy_follows_the_bandwidth(spec):
    policy = ServingPolicy.load(spec, q_min=0.97, controller={"epsilon": 0.0})
    kv = synthetic_kv(tokens=64)
    chosen = {bw: policy.encode(kv, bandwidth_gbps=bw).policy_id for bw in EXPECTED_097}
    assert chosen == EXPECTED_097


def test_lower_floor_selects_its_own_bucket():
    policy = load(q_min=0.9)
    kv = synthetic_kv(tokens=64)
    assert policy.encode(kv, bandwidth_gbps=0.1).policy_id == "4a72398b8b1c"
    assert policy.encode(kv, bandwidth_gbps=100.0).policy_id == "none"


def test_streams_are_the_tables_policies_byte_for_byte():
    policy = load()
    table = PolicyTable.load(TABLE_JSON)
    kv = synthetic_kv(tokens=96)
    for bw, pid in EXPECTED_097.items():
        enc = policy.encode(kv, bandwidth_gbps=bw)
        if pid == "none":
            config = PolicyConfig.uncompressed()
        else:
            config_json = table.select(bw, 0.97).config_json
            config = PolicyConfig.from_json(config_json)
            assert config.policy_id == pid  # the table's id is the configuration's id
        assert enc.stream == encode_kv(kv, config)
        assert read_header(enc.stream).policy_id == config.policy_id
        assert enc.kv_bytes == 2 * 2 * LAYERS * HEADS * 96 * DIM


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_round_trip_keeps_shapes_and_dtype(dtype):
    policy = load()
    kv = synthetic_kv(tokens=200, dtype=dtype)
    for bw in (100.0, 0.1):
        enc = policy.encode(kv, bandwidth_gbps=bw)
        out = policy.decode(enc.stream, device="cpu")
        want = decode_kv(enc.stream)
        assert len(out) == LAYERS
        for (k, v), (wk, wv), (ok, ov) in zip(kv, want, out):
            assert ok.shape == k.shape and ov.shape == v.shape and ok.dtype == dtype
            assert torch.equal(ok, wk) and torch.equal(ov, wv)
    none = policy.decode(policy.encode(kv, bandwidth_gbps=100.0).stream)
    # "none" sends bfloat16: exact for bfloat16 KV, bfloat16-rounded for float32 KV
    assert all(torch.equal(k2, k.to(torch.bfloat16).to(dtype)) for (k, _), (k2, _) in zip(kv, none))


def test_feedback_moves_the_bandwidth_estimate_and_the_choice():
    policy = load(initial_bandwidth_gbps=10.0)
    kv = synthetic_kv(tokens=64)
    first = policy.encode(kv)
    assert first.policy_id == "none" and first.decision.bandwidth_source == "estimate"
    transfer_s = first.wire_bytes * 8 / 1e9  # the link delivered 1 Gbps
    obs = policy.feedback(first, transfer_s=transfer_s, decode_s=0.0)
    assert obs.bandwidth_gbps_sample == pytest.approx(1.0)
    # EWMA of x = 1/B (s/GB), alpha 0.5: 0.8 + 0.5 * (8.0 - 0.8) = 4.4 s/GB -> 8 / 4.4 Gbps
    assert policy.bandwidth_gbps == pytest.approx(8 / 4.4)
    assert policy.encode(kv).policy_id == "f3097c94da6c"


def test_feedback_without_decode_time_uses_the_predicted_decode():
    policy = load(initial_bandwidth_gbps=2.0)
    kv = synthetic_kv(tokens=64)
    enc = policy.encode(kv)
    assert enc.policy_id == "f3097c94da6c"
    obs = policy.feedback(enc, transfer_s=enc.wire_bytes * 8 / 1e9)
    assert obs.bandwidth_gbps_sample == pytest.approx(1.0)  # the wire time is transfer_s alone
    p = enc.decision.policy
    predicted_codec = enc.encode_s + enc.kv_bytes / (p.decode_gbps * 1e9)
    gb = enc.kv_bytes * 1e-9
    # residual EWMA (alpha 0.2) of (codec_s - a V) / V, from 0
    assert policy.controller.residual_s_per_gb(p.policy_id) == pytest.approx(0.2 * (predicted_codec - p.a_s_per_gb * gb) / gb)


def test_bad_feedback_and_encode_inputs_are_typed_errors():
    policy = load()
    with pytest.raises(KvtuneError, match="no bandwidth"):
        policy.encode(synthetic_kv(tokens=8))
    enc = policy.encode(synthetic_kv(tokens=8), bandwidth_gbps=1.0)
    for bad in (-1.0, float("nan"), float("inf"), "x"):
        with pytest.raises(KvtuneError, match="transfer_s"):
            policy.feedback(enc, transfer_s=bad)
    with pytest.raises(KVInputError, match="no KV"):
        policy.encode(synthetic_kv(tokens=0), bandwidth_gbps=1.0)


def test_controller_settings_are_checked():
    with pytest.raises(KvtuneError, match=r"\['q_min'\] are arguments"):
        ServingPolicy.load(TABLE_JSON, q_min=0.97, controller={"q_min": 0.9})
    with pytest.raises(KvtuneError, match="unknown controller setting"):
        ServingPolicy.load(TABLE_JSON, q_min=0.97, controller={"epsilonn": 0.0})
    with pytest.raises(TableError, match="no accuracy floor >= q_min=0.999"):
        ServingPolicy.load(TABLE_JSON, q_min=0.999)


# ---------------------------------------------------------------------------- model checks


def test_check_model_accepts_the_profiled_model():
    load().check_model(num_layers=LAYERS, kv_heads=HEADS, head_dim=DIM, dtype=torch.float32)


def test_check_model_names_every_difference():
    with pytest.raises(ModelMismatchError) as err:
        load().check_model(num_layers=24, kv_heads=HEADS, head_dim=128, dtype=torch.bfloat16)
    msg = str(err.value)
    assert "num_layers 24 (table: 30)" in msg and "head_dim 128 (table: 64)" in msg
    assert "KV dtype bfloat16 (table profiled on float32 KV)" in msg and "kv_heads" not in msg


def test_dtype_mismatch_can_be_allowed_explicitly():
    policy = load()
    policy.check_model(num_layers=LAYERS, kv_heads=HEADS, head_dim=DIM, dtype=torch.bfloat16, allow_dtype_mismatch=True)
    with pytest.raises(ModelMismatchError, match="head_dim 32"):
        policy.check_model(num_layers=LAYERS, kv_heads=HEADS, head_dim=32, dtype=torch.bfloat16, allow_dtype_mismatch=True)


def test_after_check_model_kv_of_another_geometry_is_refused():
    policy = load()
    policy.check_model(num_layers=LAYERS, kv_heads=HEADS, head_dim=DIM, dtype=torch.float32)
    with pytest.raises(ModelMismatchError, match=r"kv\[0\] K is \(1, 2, 16, 64\)"):
        policy.encode(synthetic_kv(tokens=16, heads=2), bandwidth_gbps=1.0)
    with pytest.raises(ModelMismatchError, match="the model has 30"):
        policy.encode(synthetic_kv(tokens=16, layers=31), bandwidth_gbps=1.0)
    with pytest.raises(ModelMismatchError, match="bfloat16"):
        policy.encode(synthetic_kv(tokens=16, dtype=torch.bfloat16), bandwidth_gbps=1.0)


def test_a_table_without_geometry_cannot_pass_check_model(tmp_path):
    lone = tmp_path / "policy_table.json"
    shutil.copy(TABLE_JSON, lone)  # no run.json beside it
    policy = ServingPolicy.load(lone, q_min=0.97)
    assert policy.geometry is None
    with pytest.raises(ModelMismatchError, match="records no model geometry"):
        policy.check_model(num_layers=LAYERS, kv_heads=HEADS, head_dim=DIM, dtype=torch.float32)
    given = ServingPolicy.load(lone, q_min=0.97, model_info={"num_layers": 30, "kv_heads": 3, "head_dim": 64, "dtype": "bfloat16"})
    given.check_model(num_layers=LAYERS, kv_heads=HEADS, head_dim=DIM, dtype=torch.bfloat16)


def test_run_json_of_another_run_is_not_used(tmp_path):
    shutil.copy(TABLE_JSON, tmp_path / "policy_table.json")
    info = json.loads((EXAMPLE / "run.json").read_text())
    info["settings"]["run"] = "some-other-run"
    (tmp_path / "run.json").write_text(json.dumps(info))
    assert ServingPolicy.load(tmp_path / "policy_table.json", q_min=0.97).geometry is None


def test_run_json_of_another_model_is_a_mismatch(tmp_path):
    shutil.copytree(EXAMPLE, tmp_path / "run")
    info = json.loads((tmp_path / "run" / "run.json").read_text())
    info["model_info"]["model"] = "gemma-3-270m"
    (tmp_path / "run" / "run.json").write_text(json.dumps(info))
    with pytest.raises(ModelMismatchError, match="run of model 'gemma-3-270m', table of 'smollm2-135m-instruct'"):
        ServingPolicy.load(tmp_path / "run", q_min=0.97)


def test_bf16_run_records_bf16_kv(tmp_path):
    shutil.copytree(EXAMPLE, tmp_path / "run")
    info = json.loads((tmp_path / "run" / "run.json").read_text())
    info["settings"]["kv_dtype"] = "bfloat16"
    (tmp_path / "run" / "run.json").write_text(json.dumps(info))
    assert ServingPolicy.load(tmp_path / "run", q_min=0.97).geometry.dtype == "bfloat16"


# ---------------------------------------------------------------------------- calibration


def mixhq_table(method: str = "tqc") -> tuple[PolicyTable, PolicyConfig]:
    config = PolicyConfig.from_dict({
        "key": {"name": "mixhq", "fraction": 0.5, "high_bits": 8, "low_bits": 2},
        "value": {"name": "mixhq", "fraction": 0.5, "high_bits": 8, "low_bits": 2},
        "codec": "bitpack",
    })
    front = pd.DataFrame({
        "policy_id": [config.policy_id], "label": [config.label], "method": [method],
        "config_json": [config.to_json()], "relative_accuracy": [0.95], "compression_ratio": [3.0],
        "encode_gbps": [2.0], "decode_gbps": [2.0],
    })
    return compile_policy_table(front, floors=[0.9], model="m", workload="w", device="cpu"), config


def test_mixhq_policy_without_scores_fails_at_load():
    table, _ = mixhq_table()
    with pytest.raises(CalibrationError, match="mixhq policy without head scores"):
        ServingPolicy.load(table, q_min=0.9)


def test_mixhq_scores_from_the_run_folder(tmp_path):
    table, config = mixhq_table()
    run = tmp_path / "run"
    run.mkdir()
    table.with_metadata(run="run").to_json(run / "policy_table.json")
    scores = [[0.9, 0.1], [0.2, 0.8]]
    (run / "calibration.json").write_text(json.dumps({"head_scores": {"scores": scores}}))
    info = {"settings": {"run": "run"}, "model_info": {"model": "m", "num_layers": 2, "kv_heads": 2, "head_dim": DIM,
                                                        "dtype": "float32"}}
    (run / "run.json").write_text(json.dumps(info))
    policy = ServingPolicy.load(run, q_min=0.9, controller={"epsilon": 0.0})
    policy.check_model(num_layers=2, kv_heads=2, head_dim=DIM, dtype=torch.float32)
    kv = synthetic_kv(tokens=32, layers=2, heads=2)
    enc = policy.encode(kv, bandwidth_gbps=0.1)
    assert enc.policy_id == config.policy_id  # the table's id
    filled = config.with_head_scores(scores)
    assert enc.stream == encode_kv(kv, filled)  # the stream carries the calibrated policy
    with pytest.raises(ModelMismatchError, match="mixhq head scores for 2 layers"):
        ServingPolicy.load(run, q_min=0.9, model_info={"num_layers": 3, "kv_heads": 2, "head_dim": DIM,
                                                         "dtype": "float32"}).check_model(
            num_layers=3, kv_heads=2, head_dim=DIM, dtype=torch.float32)


def test_malformed_calibration_is_a_calibration_error(tmp_path):
    table, _ = mixhq_table()
    with pytest.raises(CalibrationError, match="head_scores"):
        ServingPolicy.load(table, q_min=0.9, head_scores=[["x"]])


def test_unservable_method_fails_at_load():
    table, _ = mixhq_table(method="scd")
    with pytest.raises(TableError, match="is a 'scd' policy"):
        ServingPolicy.load(table, q_min=0.9, head_scores=[[0.1, 0.2]])


# ---------------------------------------------------------------------------- chunks


def test_chunks_reselect_after_the_link_slows_down():
    policy = load(initial_bandwidth_gbps=10.0)
    kv = synthetic_kv(tokens=64)
    chunks = policy.encode_chunks(kv, chunk_layers=8)
    encoded = []
    for enc in chunks:
        encoded.append(enc)
        chunks.feedback(enc, transfer_s=enc.wire_bytes * 8 / 1e9, decode_s=0.0)  # 1 Gbps every time
    assert [(e.layer_offset, e.num_layers, e.chunk) for e in encoded] == [(0, 8, 0), (8, 8, 1), (16, 8, 2), (24, 6, 3)]
    # chunk 0 at the 10 Gbps prior: none; chunk 1 at the 1.82 Gbps estimate: the envelope
    # policy; later chunks: that interval's candidates, ranked with the codec residuals the
    # measured encode times taught (timing-dependent, so only the candidate set is fixed)
    assert [e.policy_id for e in encoded[:2]] == ["none", "f3097c94da6c"]
    assert {e.policy_id for e in encoded[2:]} <= {"f3097c94da6c", "056c94b1a525", "4390fd4d495c"}
    assert chunks.switches >= 1 and chunks.decisions == [e.decision for e in encoded]
    assert [e.kv_bytes for e in encoded] == [2 * 2 * n * HEADS * 64 * DIM for n in (8, 8, 8, 6)]
    assert [read_header(e.stream).layer_offset for e in encoded] == [0, 8, 16, 24]
    # x EWMA after four 1 Gbps samples from 0.8 s/GB: 8 - 7.2 / 2**4
    assert policy.bandwidth_gbps == pytest.approx(8 / (8 - 7.2 / 16))
    out = policy.decode_chunks([e.stream for e in reversed(encoded)])
    want = [layer for e in encoded for layer in decode_kv(e.stream)]
    assert len(out) == LAYERS
    assert all(torch.equal(a, c) and torch.equal(b, d) for (a, b), (c, d) in zip(out, want))


def test_chunk_streams_that_do_not_tile_the_layers_are_refused():
    policy = load()
    policy.check_model(num_layers=LAYERS, kv_heads=HEADS, head_dim=DIM, dtype=torch.float32)
    kv = synthetic_kv(tokens=8)
    streams = []
    chunks = policy.encode_chunks(kv, chunk_layers=10, slo_s=1.0)
    with pytest.raises(KvtuneError, match="no bandwidth"):
        next(chunks)
    policy = load(initial_bandwidth_gbps=1.0)
    policy.check_model(num_layers=LAYERS, kv_heads=HEADS, head_dim=DIM, dtype=torch.float32)
    chunks = policy.encode_chunks(kv, chunk_layers=10)
    for enc in chunks:
        streams.append(enc.stream)
        with pytest.raises(KvtuneError, match="call feedback"):
            next(chunks)
        with pytest.raises(KvtuneError, match="ChunkedEncoding.feedback"):
            policy.feedback(enc, transfer_s=0.01)
        chunks.feedback(enc, transfer_s=0.01)
    assert len(streams) == 3
    with pytest.raises(ChunkAssemblyError, match="layers 10..19 missing"):
        policy.decode_chunks([streams[0], streams[2]])
    with pytest.raises(ChunkAssemblyError, match="overlapping"):
        policy.decode_chunks(streams + [streams[1]])
    with pytest.raises(ChunkAssemblyError, match="the model has 30"):
        policy.decode_chunks(streams[:2])
    with pytest.raises(KvtuneError, match="chunk_layers"):
        policy.encode_chunks(kv, chunk_layers=0)


# ---------------------------------------------------------------------------- real KV


@pytest.mark.real_model
def test_real_kv_round_trip(real_capture):
    kv = real_capture.context_kv(0)
    policy = load()
    policy.check_model(num_layers=len(kv), kv_heads=kv[0][0].shape[1], head_dim=kv[0][0].shape[3], dtype=kv[0][0].dtype)
    for bw, pid in EXPECTED_097.items():
        enc = policy.encode(kv, bandwidth_gbps=bw)
        assert enc.policy_id == pid
        out = policy.decode(enc.stream)
        want = decode_kv(encode_kv(kv, policy.policy_config(pid)))
        assert all(torch.equal(a, c) and torch.equal(b, d) for (a, b), (c, d) in zip(out, want))
        if pid != "none":
            assert enc.kv_bytes / enc.wire_bytes > 2.5  # compressed (the table's ratios are 3.2-4.6)


def test_a_table_rebuilt_in_a_renamed_run_folder_still_finds_its_run_json(tmp_path, monkeypatch):
    """``kvtune report`` on a copied or renamed run folder names the run as ``run.json`` records
    it, so serving still takes the model's geometry from there."""
    import shutil

    from kvtune.methods import METHODS
    from kvtune.run.runner import finalize_run

    copy = tmp_path / "renamed"
    shutil.copytree(EXAMPLE, copy, ignore=shutil.ignore_patterns(".kvtune.lock"))
    monkeypatch.chdir(tmp_path)  # the report goes to the run's relative reports folder
    finalize_run(METHODS["tqc"], copy)
    table = json.loads((copy / "policy_table.json").read_text())
    assert table["extra"]["run"] == json.loads((EXAMPLE / "run.json").read_text())["settings"]["run"] != "renamed"
    geo = ServingPolicy.load(copy / "policy_table.json", q_min=0.97).geometry
    assert geo is not None and (geo.num_layers, geo.kv_heads, geo.head_dim) == (LAYERS, HEADS, DIM)
    info = json.loads((copy / "run.json").read_text())  # a run.json that records no name: the folder's
    del info["settings"]["run"]
    (copy / "run.json").write_text(json.dumps(info))
    finalize_run(METHODS["tqc"], copy)
    assert json.loads((copy / "policy_table.json").read_text())["extra"]["run"] == "renamed"
    assert ServingPolicy.load(copy / "policy_table.json", q_min=0.97).geometry is not None
