"""Tests of the reference presets (kvtune/search/spaces/presets.yaml): they load, encode, decode, and cost
the bits per element the published methods cost."""

from __future__ import annotations

import dataclasses
import importlib
import math
from pathlib import Path

import pytest
import torch

from kvtune.codecs import CODECS, BitPack, PolicyConfig, decode_kv, encode_kv, read_header
from kvtune.codecs.presets import (
    PRESETS_PATH,
    calibration_needs,
    check_calibrated,
    load_presets,
    missing_components,
    read_presets,
)
from kvtune.core.errors import ConfigError
from kvtune.evaluate.calibrate_codebook import calibrate_codebooks

try:  # the range codec is written alongside this library; the cachegen preset needs it
    importlib.import_module("kvtune.codecs.range_coder")
except ImportError:
    pass

NAMES = ["kivi-2", "kivi-4", "cachegen", "quarot-4", "duo-like", "kvtc-2", "kvtc-3", "kvquant-3", "kvquant-3c", "fp8",
         "none", "snapkv-like"]
SHAPE = (1, 3, 1024, 64)  # SmolLM2-135M: 3 KV heads, head_dim 64; 1,024 tokens
SCORES = [[0.1, 0.9, 0.3]]  # one layer: head 1 is the retrieval head (1 of 3 at fraction 0.25)

# payload + metadata + transform state, bits per element, one layer (layer 0) of SHAPE
EXPECTED_BITS = {
    # 896 quantized tokens at 2 bits + fp16 (scale, zero) per group of 32 = 3 bits, 128 recent tokens in bf16
    "kivi-2": (896 * 3 + 128 * 16) / 1024,
    "kivi-4": (896 * 5 + 128 * 16) / 1024,
    # 3 bits + fp16 (scale, zero) per group of 32 = 4 bits, 128 recent tokens in bf16, and a
    # codebook of 8 fp16 levels per K and per V tensor
    "kvquant-3": (896 * 4 + 128 * 16) / 1024 + 8 * 16 / (3 * 1024 * 64),
    # the same with codebooks calibrated offline: no levels in the stream
    "kvquant-3c": (896 * 4 + 128 * 16) / 1024,
    # Hadamard, then 4 bits + fp16 (scale, zero) per 64-channel token vector
    "quarot-4": 4 + 32 / 64,
    # 1 head at 8 bits, 2 at 2 bits, each + 1 bit of (scale, zero) per 32
    "duo-like": (9 + 3 + 3) / 3,
    "fp8": 8.0,
    "none": 16.0,
}
# cachegen with the range codec swapped for bitpack: layer 0 is shallow for K (< 10) and V (< 2):
# 103 anchors (tokens 0, 10, ..., 1020) at 8 bits, 921 deltas at 5 bits, fp16 scale per token vector
CACHEGEN_BITPACK_BITS = (103 * 8 + 921 * 5) / 1024 + 16 / 64


def kv_of(shape=SHAPE, layers: int = 1, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(layers):
        k = torch.randn(shape, generator=g)
        k[..., 3] *= 15  # an outlier channel, as keys have
        out.append((k, torch.randn(shape, generator=g)))
    return out


@pytest.fixture(scope="module")
def presets() -> dict[str, PolicyConfig]:
    return load_presets(skip_unavailable=True)


def _ready(cfg: PolicyConfig) -> PolicyConfig:
    """Head scores and codebooks (fitted on KV of another seed) filled in where needed."""
    cfg = cfg.with_head_scores(SCORES) if cfg.needs_head_scores else cfg
    return calibrate_codebooks(cfg, [kv_of(seed=1)])


def test_presets_file_lists_the_published_baselines():
    specs = read_presets()
    assert list(specs) == NAMES
    for spec in specs.values():
        assert spec.description and spec.reference and spec.line
    loaded = load_presets(skip_unavailable=True)
    assert list(loaded) == [n for n in NAMES if not missing_components(specs[n].policy)]
    if "range" in CODECS:
        assert list(load_presets()) == NAMES


def test_presets_round_trip_and_have_distinct_ids(presets):
    for cfg in presets.values():
        assert PolicyConfig.from_json(cfg.to_json()) == cfg
    assert len({c.policy_id for c in presets.values()}) == len(presets)
    assert presets["kivi-2"].label == "identity|K:u2a/ch/g32/r128|V:u2a/tok/g32/r128|bitpack"
    assert presets["quarot-4"].label == "hadamard|K:u4a/tok|V:u4a/tok|bitpack"
    assert presets["fp8"] == PolicyConfig.from_dict({"key": "fp8", "value": "fp8"})
    assert presets["none"] == PolicyConfig.uncompressed()
    assert presets["kivi-4"] == PolicyConfig.kivi(4, recent_tokens=128)


@pytest.mark.parametrize("name", list(EXPECTED_BITS))
def test_preset_bits_per_element(presets, name):
    cfg = _ready(presets[name])
    kv = kv_of()
    stream = encode_kv(kv, cfg)
    h = read_header(stream)
    n = h.num_elements
    assert n == 2 * math.prod(SHAPE)
    assert (h.payload_nbytes + h.meta_nbytes + h.state_nbytes) * 8 == EXPECTED_BITS[name] * n  # exact
    assert len(stream) == h.total_nbytes
    assert 8 * len(stream) / n == pytest.approx(EXPECTED_BITS[name] + 8 * (h.header_nbytes + 4) / n)
    assert h.header_nbytes < 1000
    (k2, v2), = decode_kv(stream, expect=cfg)
    assert k2.shape == v2.shape == SHAPE
    rel = float((v2 - kv[0][1]).norm() / kv[0][1].norm())
    # Gaussian values: 2 bits ~0.37, 3 bits ~0.15, 4 bits ~0.08
    assert rel < {"kivi-2": 0.45, "duo-like": 0.45, "kvquant-3": 0.17, "kvquant-3c": 0.17}.get(name, 0.12)


def test_kivi2_metadata_costs_one_bit_per_quantized_element(presets):
    q = presets["kivi-2"].key.quantize(kv_of()[0][0], layer=0, kind="key")
    bf16, body = q.parts  # class order: the body holds token 0; the recent window comes after it
    body, bf16 = (bf16, body) if bf16.bits == 2 else (body, bf16)
    assert body.bits == 2 and body.shape == (1, 3, 896, 64) and bf16.bits == 16 and bf16.shape == (1, 3, 128, 64)
    assert 8 * body.meta_nbytes / body.segment.numel == 1.0  # fp16 scale + zero per 32 tokens


def test_cachegen_structure_with_bitpack():
    spec = read_presets()["cachegen"]
    cfg = PolicyConfig.from_dict({**spec.policy, "codec": "bitpack"})
    h = read_header(encode_kv(kv_of(), cfg))
    assert (h.payload_nbytes + h.meta_nbytes) * 8 == CACHEGEN_BITPACK_BITS * h.num_elements
    # layer schedule: keys 5-bit below layer 10, values 5-bit below layer 2, 4-bit elsewhere
    small = (1, 3, 100, 64)  # anchors 0, 10, ..., 90; 90 deltas
    for offset in (0, 9):
        h = read_header(encode_kv(kv_of(small, layers=3), cfg, layer_offset=offset))
        for i, (k_sec, v_sec) in enumerate(h.sections):
            layer = offset + i
            key_bits, value_bits = (5 if layer < 10 else 4), (5 if layer < 2 else 4)
            # anchors (8 bits) first: they hold token 0
            assert k_sec.payload == (3 * 10 * 64, math.ceil(3 * 90 * 64 * key_bits / 8))
            assert v_sec.payload == (3 * 10 * 64, math.ceil(3 * 90 * 64 * value_bits / 8))


def test_cachegen_with_range_coding(presets):
    if "range" not in CODECS:
        pytest.skip("the 'range' codec (kvtune/codecs/range_coder.py, written concurrently) is not registered yet")
    cfg = presets["cachegen"]
    packed = dataclasses.replace(cfg, codec=BitPack())
    kv = kv_of(layers=2)
    stream, plain = encode_kv(kv, cfg), encode_kv(kv, packed)
    # range coding is lossless: the same tensors as the bit-packed variant, in fewer bytes
    for (k, v), (k2, v2) in zip(decode_kv(stream, expect=cfg), decode_kv(plain)):
        assert torch.equal(k, k2) and torch.equal(v, v2)
    h = read_header(stream)
    assert len(stream) == h.total_nbytes
    assert h.payload_nbytes < read_header(plain).payload_nbytes


def test_duo_like_needs_head_scores(presets):
    cfg = presets["duo-like"]
    assert cfg.needs_head_scores
    with pytest.raises(ConfigError, match="calibration"):
        encode_kv(kv_of(), cfg)
    ready = cfg.with_head_scores(SCORES)
    q = ready.value.quantize(kv_of()[0][1], layer=0, kind="value")
    assert q.bits_per_head().tolist() == [3.0, 9.0, 3.0]


def test_kvquant_3c_needs_codebooks_and_then_encodes_as_kvquant_3_without_levels(presets):
    cfg = presets["kvquant-3c"]
    assert cfg.label == "identity|K:cb3clm/ch/g32/r128|V:cb3clm/tok/g32/r128|bitpack"
    assert calibration_needs(cfg) == ["calibrated codebooks"]
    with pytest.raises(ConfigError, match="preset 'kvquant-3c' needs calibrated codebooks"):
        check_calibrated("kvquant-3c", cfg)
    with pytest.raises(ConfigError, match="calibrat"):
        encode_kv(kv_of(), cfg)
    ready = _ready(cfg)
    assert calibration_needs(ready) == [] and len(ready.key.codebooks) == len(ready.value.codebooks) == 1
    # the same groups and scales as the per-tensor fit: only the levels differ (and travel no more)
    kv = kv_of()
    per_tensor = read_header(encode_kv(kv, presets["kvquant-3"]))
    offline = read_header(encode_kv(kv, ready))
    assert per_tensor.meta_nbytes - offline.meta_nbytes == 2 * 8 * 2
    assert per_tensor.payload_nbytes == offline.payload_nbytes


def kvtc_basis(layers: int = 1, tokens: int = 512):
    """A pre-RoPE PCA basis fitted on :func:`kv_of` KV of SHAPE's geometry (other seed)."""
    from kvtune.codecs.pca import RopeSpec, fit_pca_basis, register_basis

    rope = (RopeSpec(1.0 / 10000 ** (torch.arange(0, SHAPE[3], 2, dtype=torch.float32) / SHAPE[3]), 1.0),) * layers
    basis = fit_pca_basis([kv_of((1, SHAPE[1], tokens, SHAPE[3]), layers=layers, seed=7)], key_rope="pre", rope=rope)
    register_basis(basis)
    return basis


@pytest.mark.skipif("range" not in CODECS, reason="the kvtc presets are range coded")
def test_kvtc_presets_need_a_pca_basis_and_then_cost_their_bits(presets):
    from kvtune.codecs.pca import BasisNotLoadedError

    kv = kv_of()
    errors, bits = {}, {}
    digest = kvtc_basis().digest
    for name, b in (("kvtc-2", 2), ("kvtc-3", 3)):
        cfg = presets[name]
        assert cfg.label == f"pca:pre|K:dp{b}/s4|V:dp{b}/s4|range" and calibration_needs(cfg) == ["a PCA basis (pre-RoPE keys)"]
        with pytest.raises(BasisNotLoadedError, match="without a basis"):
            encode_kv(kv, cfg)
        with pytest.raises(ConfigError, match=f"preset '{name}' needs a PCA basis \\(pre-RoPE keys\\).*--space presets"):
            check_calibrated(name, cfg)
        ready = cfg.with_pca_basis(digest)
        assert calibration_needs(ready) == [] and check_calibrated(name, ready) is ready
        stream = encode_kv(kv, ready)
        h = read_header(stream)
        # per token B = b * 192 bits over the 192 components, tokens 0-3 as bfloat16 coefficients; range coded
        # symbols never cost more than their width (plus the coder's tables)
        plain = read_header(encode_kv(kv, dataclasses.replace(ready, codec=BitPack())))
        # (each segment of one width is padded to whole bytes: < 1 byte for each of at most 8 widths)
        assert 0 <= plain.payload_nbytes * 8 - 2 * (4 * 192 * 16 + 1020 * b * 192) < 2 * 8 * 8
        assert h.payload_nbytes < plain.payload_nbytes
        bits[name] = 8 * len(stream) / h.num_elements
        (k2, v2), = decode_kv(stream, expect=ready)
        errors[name] = float((v2 - kv[0][1]).norm() / kv[0][1].norm())
    assert bits["kvtc-2"] < 2.1 and bits["kvtc-3"] < 3.1 and bits["kvtc-2"] < bits["kvtc-3"]
    assert errors["kvtc-3"] < errors["kvtc-2"] < 0.5  # isotropic Gaussian values: ~0.3 at 2 bits (no PCA gain)


def test_calibration_needs_name_head_scores_and_nothing_for_ready_presets(presets):
    assert calibration_needs(presets["duo-like"]) == ["MixHQ head scores"]
    with pytest.raises(ConfigError, match="preset 'duo-like' needs MixHQ head scores"):
        check_calibrated("duo-like", presets["duo-like"])
    assert [n for n, c in presets.items() if calibration_needs(c)] == [
        n for n in ("duo-like", "kvtc-2", "kvtc-3", "kvquant-3c") if n in presets]
    assert calibration_needs(_ready(presets["duo-like"])) == [] and calibration_needs(presets["kivi-2"]) == []


# ----------------------------------------------------------------------------- malformed files


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "p.yaml"
    path.write_text(text)
    return path


GOOD_ENTRY = """
  - name: a
    description: d
    reference: r
    policy: {key: {name: uniform, bits: 2}, value: none}
"""


@pytest.mark.parametrize(
    "text, expected",
    [
        ("version: 1\npresets:" + GOOD_ENTRY + "extra: 1\n", ["unknown key 'extra'"]),
        ("version: 2\npresets:" + GOOD_ENTRY, ["version"]),
        ("version: 1\npresets: []\n", ["non-empty list"]),
        ("version: 1\npresets:" + GOOD_ENTRY + GOOD_ENTRY, ["p.yaml:8", "duplicate", "'a'"]),
        ("version: 1\npresets:\n  - name: Bad Name\n    policy: {key: none, value: none}\n", ["p.yaml:3", "'name'"]),
        ("version: 1\npresets:\n  - name: a\n    polcy: {}\n", ["p.yaml:3", "'polcy'"]),
        ("version: 1\npresets:\n  - name: a\n    description: x\n", ["'policy'"]),
        ("version: 1\npresets:\n  - name: a\n    policy: {key: {name: uniform, bits: 9}, value: none}\n",
         ["p.yaml:3", "preset 'a'", "'bits'", "1..8"]),
        ("presets: [\n", ["cannot read"]),
    ],
)
def test_malformed_presets_raise_config_error_naming_the_place(tmp_path, text, expected):
    with pytest.raises(ConfigError) as info:
        load_presets(_write(tmp_path, text))
    for s in expected:
        assert s in str(info.value), (s, str(info.value))


def test_unavailable_components_are_skipped_only_on_request(tmp_path):
    path = _write(tmp_path, "version: 1\npresets:" + GOOD_ENTRY + """
  - name: b
    policy: {transforms: [wavelet], key: none, value: none, codec: {name: brotli}}
""")
    assert missing_components(read_presets(path)["b"].policy) == ["transform 'wavelet'", "codec 'brotli'"]
    assert list(load_presets(path, skip_unavailable=True)) == ["a"]
    with pytest.raises(ConfigError, match="not registered: transform 'wavelet', codec 'brotli'"):
        load_presets(path)


def test_default_path_is_the_repository_file():
    assert PRESETS_PATH.name == "presets.yaml" and PRESETS_PATH.parent.name == "spaces" and PRESETS_PATH.is_file()
