"""The "kvtune" LMCache serde against the real lmcache package (0.5.6, installed with --no-deps):
factory lookup, LMCache's own allocator / MemoryObj / AsyncSerdeProcessor, variable-length
frames, bad input."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
from lmcache.v1.distributed.api import MemoryLayoutDesc, ObjectKey
from lmcache.v1.distributed.serde import SerdeConfig, create_serde_processor, get_registered_serde_types
from lmcache.v1.distributed.serde.utils import serialized_layout_desc
from lmcache.v1.memory_allocators.tensor_memory_allocator import TensorMemoryAllocator
from lmcache.v1.memory_management import MemoryFormat

import kvtune.serving.lmcache_plugin  # noqa: F401  (the adapter: importing it registers "kvtune")
from kvtune.codecs import decode_kv, encode_kv
from kvtune.core.errors import CorruptStreamError, KvtuneError, TruncatedStreamError
from kvtune.serving import AuthenticationError, ModelMismatchError, ServingPolicy
from kvtune.serving.auth import KEY_ENV, KEY_FILE_ENV
from kvtune.serving.lmcache import (
    KvtuneDeserializer,
    KvtuneSerializer,
    LayoutMismatchError,
    from_lmcache_layout,
    into_lmcache_layout,
)

ROOT = Path(__file__).resolve().parents[1]
RUN = ROOT / "profiles" / "example"  # SmolLM2-135M-Instruct: 30 layers, 3 KV heads, head_dim 64
LAYERS, HEADS, DIM, TOKENS = 30, 3, 64, 256  # 256 tokens: LMCache's default chunk size
KEY = ObjectKey(chunk_hash=b"\x01" * 32, model_name="smollm2-135m-instruct", kv_rank=0)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(autouse=True)
def no_key(monkeypatch):
    monkeypatch.delenv(KEY_ENV, raising=False)
    monkeypatch.delenv(KEY_FILE_ENV, raising=False)


@pytest.fixture
def allocator():
    return TensorMemoryAllocator(torch.zeros(96 << 20, dtype=torch.uint8))


def serde(bandwidth_gbps: float, **extra):
    config = {"table": str(RUN), "q_min": 0.97, "bandwidth_gbps": bandwidth_gbps, "controller": {"epsilon": 0.0}, **extra}
    return create_serde_processor(SerdeConfig(type="kvtune", kwargs=config))


def wait(query, task_id, timeout_s: float = 120.0):
    deadline = time.monotonic() + timeout_s
    while (result := query(task_id)) is None:
        assert time.monotonic() < deadline, "serde task did not finish"
        time.sleep(0.005)
    return result


def kv_object(allocator, t: torch.Tensor):
    obj = allocator.allocate(t.shape, t.dtype, fmt=MemoryFormat.KV_2LTD)
    obj.tensor.copy_(t)
    return obj


def store_then_load(allocator, processor, src):
    """LMCache's serde wrapper path: serialize into a temp of the estimated size (narrowed to the
    bytes written), persist those bytes, load them into a fresh temp of the estimated size
    (padded), deserialize into a KV object."""
    layout = serialized_layout_desc(MemoryLayoutDesc(shapes=[src.get_shape()], dtypes=[src.get_dtype()]), processor)
    temp = allocator.allocate(layout.shapes, layout.dtypes, fmt=MemoryFormat.BINARY_BUFFER)
    assert wait(processor.query_serialize_result, processor.submit_serialize([src], [temp], [KEY])) is True
    stored = bytes(temp.byte_array)  # what an L2 adapter persists: get_size() bytes
    loaded = allocator.allocate(layout.shapes, layout.dtypes, fmt=MemoryFormat.BINARY_BUFFER)
    loaded.tensor[: len(stored)].copy_(torch.frombuffer(bytearray(stored), dtype=torch.uint8))
    loaded.tensor[len(stored):].fill_(0xAB)  # padding after the frame
    dst = allocator.allocate(src.get_shape(), src.get_dtype(), fmt=MemoryFormat.KV_2LTD)
    ok = wait(processor.query_deserialize_result, processor.submit_deserialize([loaded], [dst], [KEY]))
    return stored, loaded, dst, ok


def lmcache_chunk(kv) -> torch.Tensor:
    """kvtune KV (per layer (1, H, T, D)) as an LMCache [2, L, T, H * D] tensor."""
    return torch.stack([torch.stack([k[0].permute(1, 0, 2).reshape(k.shape[2], -1) for k in pair]) for pair in kv], dim=1)


def synthetic_chunk(tokens: int = TOKENS, dtype=torch.float32, heads: int = HEADS) -> torch.Tensor:
    g = torch.Generator().manual_seed(3)
    return torch.randn(2, LAYERS, tokens, heads * DIM, generator=g).to(dtype)


def test_kvtune_is_registered_and_found_by_the_factory():
    assert "kvtune" in get_registered_serde_types()
    processor = serde(1.0)
    try:
        layout = MemoryLayoutDesc(shapes=[torch.Size([2, LAYERS, TOKENS, HEADS * DIM])], dtypes=[torch.bfloat16])
        bf16_bytes = 2 * LAYERS * TOKENS * HEADS * DIM * 2
        assert bf16_bytes < processor.estimate_serialized_size(layout) < 1.1 * bf16_bytes
    finally:
        processor.close()


def test_layout_conversion_is_exact_both_ways():
    t = synthetic_chunk(tokens=5, dtype=torch.bfloat16)
    kv = from_lmcache_layout(t, DIM)
    assert len(kv) == LAYERS and kv[0][0].shape == (1, HEADS, 5, DIM) and kv[0][0].is_contiguous()
    assert torch.equal(kv[7][1][0, 2, 4], t[1, 7, 4, 2 * DIM : 3 * DIM])  # V, layer 7, head 2, token 4
    assert torch.equal(lmcache_chunk(kv), t)
    back = torch.empty_like(t)
    into_lmcache_layout(kv, back)
    assert torch.equal(back, t)


def test_bad_factory_configs_are_typed_errors():
    with pytest.raises(KvtuneError, match=r"missing \['bandwidth_gbps'\], unknown \['bandwith'\]"):
        create_serde_processor(SerdeConfig(type="kvtune", kwargs={"table": str(RUN), "q_min": 0.97, "bandwith": 1}))
    with pytest.raises(KvtuneError, match="bandwidth_gbps must be > 0"):
        serde(0.0)


@pytest.mark.real_model
@pytest.mark.parametrize("bandwidth_gbps, policy_id", [(0.1, "48750b40bb5e"), (100.0, "none")])
def test_round_trip_of_real_kv_through_lmcaches_classes(real_capture, allocator, bandwidth_gbps, policy_id):
    kv = [(k[:, :, :TOKENS], v[:, :, :TOKENS]) for k, v in real_capture.context_kv(0)]  # first LMCache chunk
    chunk = lmcache_chunk(kv)
    assert chunk.shape == (2, LAYERS, TOKENS, HEADS * DIM) and chunk.dtype == torch.float32
    processor = serde(bandwidth_gbps)
    try:
        src = kv_object(allocator, chunk)
        stored, _, dst, ok = store_then_load(allocator, processor, src)
    finally:
        processor.close()
    assert ok is True
    policy = ServingPolicy.load(RUN, q_min=0.97)
    stream = encode_kv(from_lmcache_layout(chunk, DIM), policy.policy_config(policy_id))
    assert stored == len(stream).to_bytes(8, "little") + stream  # variable length: exactly the frame
    want = torch.empty_like(chunk)
    into_lmcache_layout(decode_kv(stream), want)
    assert torch.equal(dst.tensor, want)
    if policy_id == "none":
        assert torch.equal(want, chunk.to(torch.bfloat16).to(torch.float32))
    else:
        assert len(stored) < 2 * chunk.numel() / 3  # compressed well below bf16


def test_corrupted_frame_raises_a_typed_error_through_the_deserializer(allocator):
    processor = serde(0.1)
    try:
        src = kv_object(allocator, synthetic_chunk())
        stored, loaded, dst, ok = store_then_load(allocator, processor, src)
        assert ok is True
        flipped = len(stored) - 100
        loaded.tensor[flipped] ^= 0xFF  # one payload byte changed on the way (CRC mismatch)
        assert wait(processor.query_deserialize_result, processor.submit_deserialize([loaded], [dst], [KEY])) is False
    finally:
        processor.close()
    serializer = KvtuneSerializer(ServingPolicy.load(RUN, q_min=0.97), bandwidth_gbps=0.1)
    deserializer = KvtuneDeserializer(serializer)
    with pytest.raises(CorruptStreamError, match="checksum mismatch"):
        deserializer.deserialize(loaded, dst, KEY)
    loaded.tensor[flipped] ^= 0xFF
    deserializer.deserialize(loaded, dst, KEY)  # restored: decodes again
    loaded.tensor[:8].copy_(torch.tensor(list((len(loaded.tensor) - 7).to_bytes(8, "little")), dtype=torch.uint8))
    with pytest.raises(TruncatedStreamError, match="frame truncated"):
        deserializer.deserialize(loaded, dst, KEY)


def test_frames_for_another_layout_or_model_are_refused(allocator):
    serializer = KvtuneSerializer(ServingPolicy.load(RUN, q_min=0.97), bandwidth_gbps=1.0)
    src = kv_object(allocator, synthetic_chunk(tokens=32))
    temp = allocator.allocate(torch.Size([1 << 20]), torch.uint8, fmt=MemoryFormat.BINARY_BUFFER)
    n = serializer.serialize(src, temp, KEY)
    assert 8 < n < 2 * src.tensor.numel()
    other_tokens = allocator.allocate(torch.Size([2, LAYERS, 16, HEADS * DIM]), torch.float32, fmt=MemoryFormat.KV_2LTD)
    with pytest.raises(LayoutMismatchError, match=r"the LMCache object is \(2, 30, 16, 192\)"):
        KvtuneDeserializer(serializer).deserialize(temp, other_tokens, KEY)
    other_model = kv_object(allocator, synthetic_chunk(tokens=32, heads=2))
    with pytest.raises(ModelMismatchError, match=r"kv_heads 2 \(table: 3\)"):
        serializer.serialize(other_model, temp, KEY)
    bf16 = kv_object(allocator, synthetic_chunk(tokens=32, dtype=torch.bfloat16))
    with pytest.raises(ModelMismatchError, match="KV dtype bfloat16"):
        serializer.serialize(bf16, temp, KEY)
    lenient = KvtuneSerializer(ServingPolicy.load(RUN, q_min=0.97), bandwidth_gbps=1.0, allow_dtype_mismatch=True)
    assert lenient.serialize(bf16, temp, KEY) > 8


def test_keyed_serde_seals_and_refuses_unsealed_frames(allocator, monkeypatch):
    plain = serde(1.0)
    monkeypatch.setenv(KEY_ENV, "11" * 32)
    keyed = serde(1.0)
    try:
        src = kv_object(allocator, synthetic_chunk(tokens=32))
        stored, loaded, dst, ok = store_then_load(allocator, keyed, src)
        assert ok is True and stored[8:12] == b"KVTA"
        _, unsealed, _, ok_plain = store_then_load(allocator, plain, src)
        assert ok_plain is True
    finally:
        plain.close()
        keyed.close()
    keyed_deserializer = KvtuneDeserializer(KvtuneSerializer(ServingPolicy.load(RUN, q_min=0.97, key=bytes([0x11]) * 32),
                                                             bandwidth_gbps=1.0))
    with pytest.raises(AuthenticationError, match="not sealed"):
        keyed_deserializer.deserialize(unsealed, dst, KEY)
    keyed_deserializer.deserialize(loaded, dst, KEY)
