"""Bad input to the serving runtime, the way a careless user or a hostile peer gives it: every
failure is a typed kvtune error (KvtuneError / KVStreamError family) raised before slow work,
never a bare TypeError / ValueError / AttributeError / RuntimeError, never garbage output."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from kvtune.codecs import PolicyConfig, decode_kv, encode_kv
from kvtune.core.errors import KvtuneError, KVInputError, KVStreamError, TableError
from kvtune.serving import ChunkAssemblyError, ModelMismatchError, ServingPolicy
from kvtune.tables import PolicyTable

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "profiles" / "example"
TABLE_JSON = EXAMPLE / "policy_table.json"
LAYERS, HEADS, DIM = 30, 3, 64  # SmolLM2-135M-Instruct, as recorded in profiles/example/run.json

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def kv_cache(tokens: int = 8, dtype=torch.float32, layers: int = LAYERS, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(1, HEADS, tokens, DIM, generator=g).to(dtype), torch.randn(1, HEADS, tokens, DIM, generator=g).to(dtype))
            for _ in range(layers)]


def load(**kw) -> ServingPolicy:
    kw.setdefault("controller", {"epsilon": 0.0})
    kw.setdefault("q_min", 0.97)
    return ServingPolicy.load(TABLE_JSON, **kw)


def chunk_streams(policy: ServingPolicy, kv) -> list[bytes]:
    chunks = policy.encode_chunks(kv, chunk_layers=8)
    out = []
    for enc in chunks:
        out.append(enc.stream)
        chunks.feedback(enc, transfer_s=0.001)
    return out


# ---------------------------------------------------------------------------- settings


@pytest.mark.parametrize("q_min", [0.0, -1.0, "x", None, True])
def test_q_min_outside_zero_one_or_not_a_number_is_refused(q_min):
    with pytest.raises(KvtuneError, match=r"q_min must be a number in \(0, 1\]"):
        load(q_min=q_min)


@pytest.mark.parametrize("slo_s", ["x", float("inf"), True])
def test_slo_that_is_not_a_finite_number_is_refused(slo_s):
    with pytest.raises(KvtuneError, match="slo_s must be a finite number"):
        load(slo_s=slo_s)
    with pytest.raises(KvtuneError, match="slo_s must be a finite number"):
        load(initial_bandwidth_gbps=1.0).encode_chunks(kv_cache(), chunk_layers=8, slo_s=slo_s)


@pytest.mark.parametrize("bandwidth", [float("inf"), "x", True, 0.0, -1.0, float("nan")])
def test_bandwidth_that_is_not_a_finite_positive_number_is_refused(bandwidth):
    with pytest.raises(KvtuneError, match="bandwidth_gbps must be > 0 and finite"):
        load(initial_bandwidth_gbps=bandwidth)
    with pytest.raises(KvtuneError, match="bandwidth_gbps must be > 0 and finite"):
        load().encode(kv_cache(), bandwidth_gbps=bandwidth)


def test_controller_settings_of_the_wrong_type_are_typed_errors():
    with pytest.raises(KvtuneError, match="controller settings"):
        load(controller={"epsilon": "x"})
    with pytest.raises(KvtuneError, match="controller settings"):
        load(controller={"cooldown_decisions": None})


def test_feedback_of_something_that_is_not_an_encoding_is_refused():
    with pytest.raises(KvtuneError, match="EncodedKV"):
        load().feedback("stream", transfer_s=0.1)


def test_zero_transfer_time_leaves_the_bandwidth_estimate_alone():
    policy = load(initial_bandwidth_gbps=1.0)
    enc = policy.encode(kv_cache())
    obs = policy.feedback(enc, transfer_s=0.0)
    assert obs.bandwidth_gbps_sample is None
    assert policy.bandwidth_gbps == pytest.approx(1.0)


# ---------------------------------------------------------------------------- table and run files


@pytest.mark.parametrize("spec", [None, 5, ["policy_table.json"]])
def test_a_table_argument_that_is_not_a_path_is_a_table_error(spec):
    with pytest.raises(TableError, match="policy table must be"):
        ServingPolicy.load(spec, q_min=0.97)


@pytest.mark.parametrize("model_info", ["abc", [30, 3, 64]])
def test_model_info_that_is_not_a_mapping_is_a_mismatch(model_info):
    with pytest.raises(ModelMismatchError, match="must be a mapping"):
        load(model_info=model_info)


def test_malformed_model_info_in_the_table_metadata_is_not_ignored(tmp_path):
    doc = json.loads(TABLE_JSON.read_text())
    doc["extra"]["model_info"] = "30 layers"
    path = tmp_path / "policy_table.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(ModelMismatchError, match=r"extra\.model_info.*must be a mapping"):
        ServingPolicy.load(path, q_min=0.97)


def test_run_json_whose_settings_are_not_an_object_is_a_typed_error(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    shutil.copy(TABLE_JSON, run / "policy_table.json")
    info = json.loads((EXAMPLE / "run.json").read_text())
    info["settings"] = ["not", "an", "object"]
    (run / "run.json").write_text(json.dumps(info))
    policy = ServingPolicy.load(run / "policy_table.json", q_min=0.97)  # another run's file: not used
    assert policy.geometry is None


def test_config_json_that_is_not_the_configuration_of_its_policy_id_is_refused(tmp_path):
    doc = json.loads(TABLE_JSON.read_text())
    victim = next(i for t in doc["tables"] if t["accuracy_floor"] == 0.97 for i in t["intervals"] if i["policy_id"] != "none")
    aggressive = PolicyConfig.kivi(1).to_json()
    for t in doc["tables"]:  # every copy of the policy (row and runner-up) edited alike
        for i in t["intervals"]:
            if i["policy_id"] == victim["policy_id"]:
                i["config_json"] = aggressive
            for r in i["runner_up_policies"]:
                if r["policy_id"] == victim["policy_id"]:
                    r["config_json"] = aggressive
    path = tmp_path / "policy_table.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(TableError, match=rf"policy {victim['policy_id']} .*config_json is the configuration of policy "
                                         rf"{PolicyConfig.kivi(1).policy_id}"):
        ServingPolicy.load(path, q_min=0.97)


def test_a_row_whose_config_json_disagrees_with_its_runner_up_copy_is_refused(tmp_path):
    doc = json.loads(TABLE_JSON.read_text())
    rows = next(t for t in doc["tables"] if t["accuracy_floor"] == 0.97)["intervals"]
    runner_ids = {r["policy_id"] for i in rows for r in i["runner_up_policies"]}
    victim = next(i for i in rows if i["policy_id"] != "none" and i["policy_id"] in runner_ids)
    victim["config_json"] = json.dumps({"key": {"name": "bogus"}, "value": {"name": "uniform"}})
    path = tmp_path / "policy_table.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(TableError, match=f"policy {victim['policy_id']}"):
        ServingPolicy.load(path, q_min=0.97)


# ---------------------------------------------------------------------------- KV handed to encode


@pytest.mark.parametrize("kv", ["abc", 5, torch.zeros(3), [torch.zeros(1, HEADS, 8, DIM)] * LAYERS,
                                [(torch.zeros(1, HEADS, 8, DIM),) * 3] * LAYERS, [("k", "v")]])
def test_kv_that_is_not_a_list_of_tensor_pairs_is_a_typed_error(kv):
    policy = load(initial_bandwidth_gbps=1.0)
    with pytest.raises(KVInputError):
        policy.encode(kv)
    with pytest.raises(KVInputError):
        policy.encode_chunks(kv, chunk_layers=8)
    policy.check_model(num_layers=LAYERS, kv_heads=HEADS, head_dim=DIM, dtype=torch.float32)
    with pytest.raises(KVInputError):
        policy.encode(kv)


@pytest.mark.parametrize("make, match", [
    (lambda: torch.ones(1, HEADS, 8, DIM, dtype=torch.int32), "dtype"),
    (lambda: torch.ones(1, HEADS, 8, DIM, dtype=torch.float64), "dtype"),
    (lambda: torch.ones(1, HEADS, 8, DIM, device="meta"), "meta tensor"),
    (lambda: torch.ones(HEADS, 8, DIM), "batch, kv_heads, tokens, head_dim"),
])
def test_kv_of_unsupported_dtype_device_or_rank_is_a_kv_input_error(make, match):
    policy = load(initial_bandwidth_gbps=1.0)
    with pytest.raises(KVInputError, match=match):
        policy.encode([(make(), make())] * LAYERS)
    with pytest.raises(KVInputError, match=match):
        encode_kv([(make(), make())], PolicyConfig.kivi(2))


def test_kv_mixing_dtypes_across_chunks_is_refused_before_the_first_chunk():
    kv = kv_cache()
    kv[20] = tuple(t.to(torch.bfloat16) for t in kv[20])  # in the third chunk of 8 layers
    policy = load(initial_bandwidth_gbps=1.0)
    with pytest.raises(KVInputError, match="share one dtype"):
        policy.encode_chunks(kv, chunk_layers=8)
    with pytest.raises(KVInputError, match="share one dtype"):
        policy.encode(kv)


# ---------------------------------------------------------------------------- streams handed to decode


@pytest.mark.parametrize("stream", ["abc", None, 5, [1, 2, 3]])
def test_a_stream_that_is_not_bytes_is_a_stream_error(stream):
    with pytest.raises(KVStreamError, match="bytes-like"):
        load().decode(stream)
    with pytest.raises(KVStreamError, match="bytes-like"):
        decode_kv(stream)


def test_a_non_contiguous_buffer_is_a_stream_error():
    stream = load().encode(kv_cache(), bandwidth_gbps=1.0).stream
    with pytest.raises(KVStreamError, match="contiguous"):
        load().decode(memoryview(stream)[::2])


@pytest.mark.parametrize("device, match", [("bogus", "device"), ("meta", "meta"), (7, "device")])
def test_decode_to_an_unusable_device_is_refused(device, match):
    policy = load()
    stream = policy.encode(kv_cache(), bandwidth_gbps=1.0).stream
    with pytest.raises(KVInputError, match=match):
        policy.decode(stream, device=device)
    with pytest.raises(KVInputError, match=match):
        decode_kv(stream, device=device)


def test_decode_passes_the_device_to_the_codecs(monkeypatch):
    """The runtime decodes on the requested device (the codecs' device path on a GPU), into
    ``out`` there; it does not decode on the CPU and copy afterwards."""
    import kvtune.serving.runtime as runtime

    seen = []

    def recording_decode_kv(stream, **kw):
        seen.append(kw.get("device"))
        return decode_kv(stream, **kw)

    monkeypatch.setattr(runtime, "decode_kv", recording_decode_kv)
    policy = load(initial_bandwidth_gbps=1.0)
    kv = kv_cache()
    stream = policy.encode(kv).stream
    out = [(torch.empty_like(k), torch.empty_like(v)) for k, v in kv]
    got = policy.decode(stream, device="cpu", out=out)
    assert all(g[0] is o[0] and g[1] is o[1] for g, o in zip(got, out))  # decoded into the caller's buffers
    assert all(torch.equal(a, b) for (a, _), (b, _) in zip(out, decode_kv(stream)))
    policy.decode_chunks(chunk_streams(policy, kv), device="cpu")
    assert seen and all(d == torch.device("cpu") for d in seen)


def test_chunk_streams_argument_checks():
    policy = load(initial_bandwidth_gbps=1.0)
    streams = chunk_streams(policy, kv_cache())
    with pytest.raises(ChunkAssemblyError, match="no chunk streams"):
        policy.decode_chunks([])
    for bad in (streams[0], None, "abc"):
        with pytest.raises(KVStreamError, match="chunk streams"):
            policy.decode_chunks(bad)


def test_chunks_of_two_transfers_of_different_dtypes_are_refused():
    policy = load(initial_bandwidth_gbps=1.0)
    a = chunk_streams(policy, kv_cache())
    b = chunk_streams(policy, kv_cache(dtype=torch.bfloat16, seed=1))
    with pytest.raises(ChunkAssemblyError, match="different transfers"):
        policy.decode_chunks([a[0], b[1], a[2], b[3]])


def test_after_check_model_a_stream_of_another_geometry_is_refused_before_decoding():
    policy = load()
    other = [(torch.randn(1, 2, 8, DIM), torch.randn(1, 2, 8, DIM)) for _ in range(LAYERS)]
    stream = encode_kv(other, PolicyConfig.uncompressed())
    assert len(policy.decode(stream)) == LAYERS  # unchecked: decodes whatever it is given
    policy.check_model(num_layers=LAYERS, kv_heads=HEADS, head_dim=DIM, dtype=torch.float32)
    with pytest.raises(ModelMismatchError, match=r"stream layer 0 K is \(1, 2, 8, 64\)"):
        policy.decode(stream)
    beyond = encode_kv(kv_cache(layers=4), PolicyConfig.uncompressed(), layer_offset=28)
    with pytest.raises(ModelMismatchError, match="layers 28..31; the model has 30"):
        policy.decode(beyond)


def test_check_model_arguments_are_checked():
    policy = load()
    with pytest.raises(ModelMismatchError, match="dtype must be a torch.dtype"):
        policy.check_model(num_layers=LAYERS, kv_heads=HEADS, head_dim=DIM, dtype="float32")
    with pytest.raises(ModelMismatchError, match="positive ints"):
        policy.check_model(num_layers="30", kv_heads=HEADS, head_dim=DIM, dtype=torch.float32)


# ---------------------------------------------------------------------------- out= buffers


def test_out_buffers_that_do_not_fit_are_kv_input_errors():
    kv = kv_cache(layers=2)
    stream = encode_kv(kv, PolicyConfig.kivi(2))
    for out in ([(torch.empty(1, HEADS, 4, DIM), torch.empty(1, HEADS, 8, DIM))] * 2,
                [(torch.empty(1, HEADS, 8, DIM, dtype=torch.float16),) * 2] * 2, "abc"):
        with pytest.raises(KVInputError, match="out"):
            decode_kv(stream, out=out)


def test_out_buffers_that_overlap_are_refused():
    """K and V of one layer in one tensor would decode V over K: garbage, silently."""
    kv = kv_cache(layers=2)
    stream = encode_kv(kv, PolicyConfig.kivi(2))
    shared = torch.empty(1, HEADS, 8, DIM)
    out = [(shared, shared), (torch.empty(1, HEADS, 8, DIM), torch.empty(1, HEADS, 8, DIM))]
    with pytest.raises(KVInputError, match="overlap"):
        decode_kv(stream, out=out)
    pool = torch.empty(4, 1, HEADS, 8, DIM)  # views of one pool that do not overlap are fine
    out = [(pool[0], pool[1]), (pool[2], pool[3])]
    got = decode_kv(stream, out=out)
    assert all(torch.equal(o, d) for pair_o, pair_d in zip(out, decode_kv(stream)) for o, d in zip(pair_o, pair_d))
    assert got[1][0] is out[1][0]
