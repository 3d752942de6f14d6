"""The device path (:mod:`kvtune.codecs.torchpath`) writes the bytes of the CPU kernels and
decodes to their tensors, for every preset and a spread of search-space policies.

Runs on the CPU (the torch operations of the device path, ``impl="torch"``); the ``device``
parameter also takes ``"cuda"`` when a GPU is present (skipped otherwise).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvtune.codecs import PolicyConfig, decode_kv, encode_kv, torchpath
from kvtune.codecs.bitpack import pack_bits as np_pack_bits
from kvtune.codecs.presets import read_presets
from kvtune.codecs.quantizers import UniformQuantizer
from kvtune.core.errors import ConfigError, CorruptStreamError, KVInputError

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SMOLLM_SHAPE = (1, 3, 257, 64)  # SmolLM2-135M: 3 KV heads, head_dim 64; 257 tokens (odd)
SMOLLM_LAYERS = 30
DTYPES = [torch.bfloat16, torch.float16, torch.float32]


@pytest.fixture(params=["cpu", "cuda"])
def device(request) -> str:
    if request.param == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    return request.param


def make_kv(layers: int, shape: tuple[int, ...], dtype: torch.dtype, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Synthetic KV that looks like a real one: per-channel scales, two outlier key channels
    (x20, as KVQuant sec. 3.1 reports for keys), values of unit scale, a drift along tokens."""
    g = torch.Generator().manual_seed(seed)
    kv = []
    for _ in range(layers):
        scales = 0.2 + 2 * torch.rand(shape[-1], generator=g)
        k = torch.randn(shape, generator=g) * scales
        k[..., [3, min(17, shape[-1] - 1)]] *= 20
        drift = torch.linspace(0, 1, shape[2])[None, None, :, None]
        v = torch.randn(shape, generator=g) + drift
        kv.append((k.to(dtype), v.to(dtype)))
    return kv


def head_scores(layers: int, heads: int, seed: int = 1) -> list[list[float]]:
    """Retrieval scores shaped like a calibration pass: mostly small, a few heads high."""
    g = torch.Generator().manual_seed(seed)
    s = torch.rand(layers, heads, generator=g) ** 4
    return s.tolist()


#: Presets with a device path: all but those that need a PCA basis (``kvtc-*``): basis-bound
#: components have no kernel nor device path (``kvtune.codecs.pca``; tested in tests/test_pca.py).
DEVICE_PRESETS = [n for n, p in read_presets().items() if not p.config().needs_pca_basis]


def preset_configs(layers: int, heads: int) -> dict[str, PolicyConfig]:
    out = {}
    for name, preset in read_presets().items():
        if name not in DEVICE_PRESETS:
            continue
        cfg = preset.config()
        cfg = cfg.with_head_scores(head_scores(layers, heads)) if cfg.needs_head_scores else cfg
        out[name] = cfg.with_codebooks({"key": CODEBOOKS[:layers], "value": CODEBOOKS[-layers:]}) if cfg.needs_codebooks else cfg
    return out


#: Calibrated 3-bit codebooks for ``kvquant-3c`` (float16 values; up to 40 layers, each its own).
CODEBOOKS = tuple(tuple(float(torch.tensor(v).half()) for v in (-1.0, -0.6 + 0.005 * i, -0.3, -0.05, 0.15, 0.4,
                                                                  0.65 - 0.004 * i, 1.0)) for i in range(40))


def on(kv, device):
    return [(k.to(device), v.to(device)) for k, v in kv]


def assert_same_as_kernels(kv, cfg: PolicyConfig, device: str, *, layer_offset: int = 0) -> bytes:
    """Encode on the CPU kernels and on the device path; equal bytes; decode both ways; equal tensors."""
    expected = encode_kv(kv, cfg, layer_offset=layer_offset, impl="fast")
    got = encode_kv(on(kv, device), cfg, layer_offset=layer_offset, impl="torch")
    assert got == expected
    ref = decode_kv(expected, impl="fast")
    dec = decode_kv(expected, impl="torch", device=device)
    assert len(dec) == len(ref)
    for (rk, rv), (dk, dv) in zip(ref, dec):
        assert dk.device.type == device and dv.device.type == device
        assert dk.dtype == rk.dtype and torch.equal(dk.cpu(), rk) and torch.equal(dv.cpu(), rv)
    return got


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", DEVICE_PRESETS)
def test_every_preset_writes_the_kernels_bytes(name, dtype, device):
    """30 SmolLM2-shaped layers in bfloat16 (the serving dtype); 6 layers for the others,
    starting at layer 8 so that CacheGen's shallow-layer schedule has both widths."""
    layers, offset = (SMOLLM_LAYERS, 0) if dtype == torch.bfloat16 else (6, 8)
    cfg = preset_configs(offset + layers, SMOLLM_SHAPE[1])[name]
    assert torchpath.supports(cfg)
    stream = assert_same_as_kernels(make_kv(layers, SMOLLM_SHAPE, dtype), cfg, device, layer_offset=offset)
    assert decode_kv(stream, expect=cfg)  # a stream the CPU decodes


SEARCH_POLICIES = {
    "mixed-kv-fp8-scaled-key": {
        "key": {"name": "fp8", "format": "e5m2", "scaled": True},
        "value": {"name": "uniform", "bits": 3, "symmetric": True, "granularity": "per_channel", "group_size": 16},
    },
    "odd-groups-sink-recent": {
        "key": {"name": "uniform", "bits": 5, "granularity": "per_channel", "group_size": 7, "sink_tokens": 4, "recent_tokens": 9},
        "value": {"name": "uniform", "bits": 7, "granularity": "per_token", "group_size": 24},
    },
    "one-bit-whole-axis": {
        "key": {"name": "uniform", "bits": 1, "granularity": "per_channel", "group_size": 0},
        "value": {"name": "uniform", "bits": 6, "symmetric": True, "granularity": "per_token", "group_size": 0},
    },
    "hadamard-delta-anchors16": {
        "transforms": [{"name": "hadamard", "seed": 5}, {"name": "delta", "group_size": 6, "anchor_bits": 16}],
        "key": {"name": "uniform", "bits": 3, "granularity": "per_token", "group_size": 32, "shallow_layers": 2, "shallow_bits": 16},
        "value": {"name": "fp8", "format": "e4m3"},
    },
    "affine-rms-hadamard": {
        "transforms": [{"name": "affine"}, {"name": "hadamard", "seed": 3}],
        "key": {"name": "uniform", "bits": 3, "granularity": "per_token", "group_size": 32},
        "value": {"name": "uniform", "bits": 2, "granularity": "per_token", "group_size": 0},
    },
    "affine-absmax-shift-delta": {
        "transforms": [{"name": "affine", "statistic": "absmax", "shift": True}, {"name": "delta", "group_size": 8, "anchor_bits": 5}],
        "key": {"name": "uniform", "bits": 4, "granularity": "per_channel", "group_size": 32, "sink_tokens": 2},
        "value": {"name": "fp8", "format": "e5m2", "scaled": True},
    },
    "mixhq-bf16-heads-windows": {
        "key": {"name": "mixhq", "fraction": 0.4, "high_bits": 16, "low_bits": 1, "granularity": "per_channel", "group_size": 8,
                "recent_tokens": 5},
        "value": {"name": "mixhq", "fraction": 0.2, "high_bits": 6, "low_bits": 3, "symmetric": True, "sink_tokens": 1},
    },
    "range-per-token-model": {
        "transforms": [{"name": "delta", "group_size": 4}],
        "key": {"name": "uniform", "bits": 6, "granularity": "per_token", "group_size": 16},
        "value": {"name": "uniform", "bits": 2, "granularity": "per_channel", "group_size": 32},
        "codec": {"name": "range"},
    },
    "zstd-none-and-uniform": {
        "key": "none",
        "value": {"name": "uniform", "bits": 4, "granularity": "per_token", "group_size": 32},
        "codec": "zstd",
    },
}
SHAPES = {
    "odd-tokens": (1, 3, 37, 64),
    "tokens-below-group": (1, 2, 5, 64),
    "one-token": (1, 3, 1, 64),
    "batch2-head96": (2, 2, 19, 96),
}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", list(SHAPES), ids=str)
@pytest.mark.parametrize("name", list(SEARCH_POLICIES))
def test_search_space_policies_write_the_kernels_bytes(name, shape, dtype, device):
    cfg = PolicyConfig.from_dict(SEARCH_POLICIES[name])
    layers, shp = 3, SHAPES[shape]
    if cfg.needs_head_scores:
        cfg = cfg.with_head_scores(head_scores(layers + 1, shp[1]))
    assert_same_as_kernels(make_kv(layers, shp, dtype, seed=len(name)), cfg, device, layer_offset=1)


def test_layers_of_different_shapes_and_an_empty_cache(device):
    cfg = PolicyConfig.from_dict(SEARCH_POLICIES["affine-absmax-shift-delta"])
    kv = make_kv(1, (1, 2, 40, 32), torch.float16) + make_kv(1, (1, 4, 0, 16), torch.float16) + make_kv(1, (1, 1, 3, 8), torch.float16)
    assert_same_as_kernels(kv, cfg, device)
    assert encode_kv([], cfg, impl="torch") == encode_kv([], cfg, impl="fast")
    assert decode_kv(encode_kv([], cfg), impl="torch", device=device) == []


@pytest.mark.parametrize("bits", range(1, 9))
@pytest.mark.parametrize("count", [0, 1, 7, 8, 9, 1001])
def test_bit_packing_equals_the_numpy_codec(bits, count):
    g = torch.Generator().manual_seed(bits * 1000 + count)
    sym = torch.randint(0, 2**bits, (count,), generator=g, dtype=torch.uint8)
    packed = torchpath.pack_bits(sym, bits)
    assert packed.dtype == torch.uint8 and packed.numpy().tobytes() == np_pack_bits(sym.numpy(), bits)
    assert torch.equal(torchpath.unpack_bits(packed, bits, count), sym)


def test_non_finite_and_out_of_range_inputs_raise_the_cpu_errors(device):
    cfg = PolicyConfig.kivi(2, recent_tokens=4)
    kv = make_kv(3, (1, 2, 20, 16), torch.float32)
    bad = [(k.clone(), v.clone()) for k, v in kv]
    bad[1][1][0, 1, 7, 3] = float("nan")
    bad[2][0][0, 0, 2, 2] = float("inf")
    messages = []
    for impl, data in (("fast", bad), ("torch", on(bad, device))):
        with pytest.raises(KVInputError) as err:
            encode_kv(data, cfg, impl=impl)
        messages.append(str(err.value))
    assert messages[0] == messages[1] and messages[0].startswith("kv[1] V has non-finite")
    huge = [(k.clone(), v.clone()) for k, v in kv]
    huge[2][0][0, 1, 3, 5] = 1e6  # beyond the float16 scales of uniform, in the quantized part
    messages = []
    for impl, data in (("fast", huge), ("torch", on(huge, device))):
        with pytest.raises(KVInputError) as err:
            encode_kv(data, cfg, impl=impl)
        messages.append(str(err.value))
    assert messages[0] == messages[1] and "layer 2 key" in messages[0] and "exceeds 65504" in messages[0]


def test_inconsistent_sections_raise_the_cpu_errors(device):
    """A stream whose recorded lengths disagree with the plan: the same typed error and message
    as the kernels (built by re-writing an intact stream's sections with valid checksums)."""
    from kvtune.codecs.stream import read_stream, write_stream

    cfg = PolicyConfig.kivi(4)
    stream = encode_kv(make_kv(2, (1, 2, 33, 32), torch.bfloat16), cfg)
    header, sections = read_stream(stream)
    flat = [[list(map(bytes, t.flat())) for t in pair] for pair in sections]
    flat[1][1][2] = flat[1][1][2][:-1]  # layer 1 V: payload one byte short
    flat[1][1][1] = flat[1][1][1] + b"\x00"  # and metadata one byte long (the payload is checked first)
    forged = write_stream(policy=header.policy, policy_id=header.policy_id, layer_offset=0, dtype=header.dtype,
                          shapes=header.shapes, sections=[tuple(p) for p in flat])
    messages = []
    for impl, dev in (("fast", "cpu"), ("torch", device)):
        with pytest.raises(CorruptStreamError) as err:
            decode_kv(forged, impl=impl, device=dev)
        messages.append(str(err.value))
    assert messages[0] == messages[1] and messages[0].startswith("bit-packed payload has 1055 bytes")


def test_decode_into_out_and_device_argument(device):
    cfg = preset_configs(2, 3)["kivi-2"]
    kv = make_kv(2, (1, 3, 140, 64), torch.float16)
    stream = encode_kv(on(kv, device), cfg)  # impl="auto": the device path off the CPU
    assert stream == encode_kv(kv, cfg)
    out = [(torch.empty_like(k, device=device), torch.empty_like(v, device=device)) for k, v in kv]
    res = decode_kv(stream, impl="torch", device=device, out=out)
    assert res is out
    for (ok, ov), (rk, rv) in zip(out, decode_kv(stream)):
        assert torch.equal(ok.cpu(), rk) and torch.equal(ov.cpu(), rv)
    with pytest.raises(ValueError, match="out"):
        decode_kv(stream, impl="torch", device=device, out=[(k.float(), v) for k, v in out])


def test_device_path_refuses_overlapping_out_and_the_meta_device(device):
    cfg = preset_configs(2, 3)["kivi-2"]
    kv = make_kv(2, (1, 3, 40, 64), torch.float32)
    stream = encode_kv(kv, cfg)
    shared = torch.empty(1, 3, 40, 64, device=device)
    out = [(shared, shared), (torch.empty_like(shared), torch.empty_like(shared))]
    with pytest.raises(KVInputError, match="out\\[0\\] K and out\\[0\\] V overlap"):
        decode_kv(stream, impl="torch", device=device, out=out)
    with pytest.raises(KVInputError, match="meta"):
        decode_kv(stream, impl="torch", device="meta")  # tensors without data: garbage, refused


def test_components_without_a_device_implementation():
    class Sub(UniformQuantizer):  # an unregistered block kernel may change the math: no device path
        def coder(self, bits):
            return self

    cfg = PolicyConfig(key=Sub(bits=4), value=UniformQuantizer(bits=4))
    assert not torchpath.supports(cfg)
    kv = make_kv(1, (1, 2, 8, 16), torch.float32)
    with pytest.raises(ConfigError, match="no torch path"):
        encode_kv(kv, cfg, impl="torch")
    assert torchpath.supports(dataclasses.replace(cfg, key=UniformQuantizer(bits=4)))


@pytest.mark.real_model
def test_real_captured_kv_writes_the_kernels_bytes(real_lm):
    """SmolLM2-135M-Instruct's KV of one essay context (300 tokens): every preset."""
    from kvtune.evaluate.assets import read_texts
    from kvtune.evaluate.capture import build_contexts, capture

    ids = build_contexts(real_lm.tokenizer, read_texts("paul-graham-essays"), n_contexts=1, context_tokens=300,
                         continuation_tokens=4)
    kv = [(k.contiguous(), v.contiguous()) for k, v in capture(real_lm, ids, 300).kv]
    assert len(kv) == SMOLLM_LAYERS and tuple(kv[0][0].shape) == (1, 3, 300, 64)
    for name, cfg in preset_configs(len(kv), kv[0][0].shape[1]).items():
        assert_same_as_kernels(kv, cfg, "cpu")
