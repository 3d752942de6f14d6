"""Tests of the codec library: every registered transform x quantizer x codec, the wire format.

Inputs are synthetic heavy-tailed tensors (Student-t, 3 degrees of freedom, with a few outlier
channels scaled x20, as keys have); tests on real model KV live elsewhere.
"""

from __future__ import annotations

import hashlib
import itertools
import math
import struct

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtune.codecs import (
    CODECS,
    QUANTIZERS,
    TRANSFORMS,
    BitPack,
    Hadamard,
    Identity,
    NoQuantizer,
    PolicyConfig,
    Quantizer,
    UniformQuantizer,
    decode_kv,
    encode_kv,
    original_nbytes,
    read_header,
)
from kvtune.codecs.bitpack import pack_bits, unpack_bits
from kvtune.codecs.stream import write_stream
from kvtune.codecs.transforms import block_hadamard_matrix, power_of_two_blocks, random_signs
from kvtune.errors import (
    ConfigError,
    CorruptStreamError,
    KVStreamError,
    PolicyMismatchError,
    StreamVersionError,
    TruncatedStreamError,
)

# ----------------------------------------------------------------------------- data


def heavy_tailed(shape, *, seed: int, outliers: tuple[int, ...] = (), scale: float = 20.0) -> torch.Tensor:
    """Student-t (df=3) float32 samples; channels in ``outliers`` (last axis) scaled by ``scale``."""
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(shape, generator=g)
    chi2 = torch.randn((3, *shape), generator=g).pow(2).sum(0)
    x = z / torch.sqrt(chi2 / 3.0)
    for c in outliers:
        if c < shape[-1]:
            x[..., c] *= scale
    return x


def make_kv(shapes, *, dtype=torch.float32, seed: int = 0):
    """KV layers of the given ``[(K shape, V shape), ...]``; keys carry outlier channels 3 and 17."""
    return [
        (
            heavy_tailed(ks, seed=seed + 2 * i, outliers=(3, 17)).to(dtype),
            heavy_tailed(vs, seed=seed + 2 * i + 1).to(dtype),
        )
        for i, (ks, vs) in enumerate(shapes)
    ]


# ragged token counts (100, 37 vs groups of 32/48), head_dim 96 (64 + 32 Hadamard blocks),
# a single token, and an empty layer
MATRIX_SHAPES = [
    ((1, 2, 100, 64), (1, 2, 100, 64)),
    ((2, 1, 37, 96), (2, 1, 37, 96)),
    ((1, 2, 1, 64), (1, 2, 1, 64)),
    ((1, 2, 0, 64), (1, 2, 0, 64)),
]

# ----------------------------------------------------------------------------- the matrix
# Every registered component must have examples here: registering a new one without adding it
# fails test_every_registered_component_is_in_the_matrix.

TRANSFORM_EXAMPLES = {
    "identity": [Identity()],
    "hadamard": [Hadamard(), Hadamard(seed=7)],
}
QUANTIZER_EXAMPLES = {
    "uniform": [
        UniformQuantizer(bits=1, granularity="per_token", group_size=0),
        UniformQuantizer(bits=2, granularity="per_channel", group_size=32),
        UniformQuantizer(bits=2, granularity="per_token", group_size=32),
        UniformQuantizer(bits=3, symmetric=True, granularity="per_channel", group_size=0),
        UniformQuantizer(bits=4, granularity="per_channel", group_size=48),
        UniformQuantizer(bits=4, symmetric=True, granularity="per_token", group_size=24),
        UniformQuantizer(bits=5, granularity="per_token", group_size=16),
        UniformQuantizer(bits=6, granularity="per_channel", group_size=7),
        UniformQuantizer(bits=7, symmetric=True, granularity="per_token", group_size=0),
        UniformQuantizer(bits=8, granularity="per_token", group_size=32),
        UniformQuantizer(bits=8, symmetric=True, granularity="per_channel", group_size=32),
    ],
    "none": [NoQuantizer()],
}
CODEC_EXAMPLES = {"bitpack": [BitPack()]}

ALL_TRANSFORMS = [t for ts in TRANSFORM_EXAMPLES.values() for t in ts]
ALL_QUANTIZERS = [q for qs in QUANTIZER_EXAMPLES.values() for q in qs]
UNIFORM = QUANTIZER_EXAMPLES["uniform"]
ALL_CODECS = [c for cs in CODEC_EXAMPLES.values() for c in cs]

POLICIES = [
    PolicyConfig(transforms=(t,), key=q, value=q, codec=c)
    for t, q, c in itertools.product(ALL_TRANSFORMS, ALL_QUANTIZERS, ALL_CODECS)
] + [
    PolicyConfig.kivi(2),
    PolicyConfig(transforms=(Hadamard(seed=1), Hadamard(seed=2)), key=UNIFORM[4], value=NoQuantizer()),
]


def _id(p: PolicyConfig) -> str:
    return p.label


def test_every_registered_component_is_in_the_matrix():
    assert set(TRANSFORMS) == set(TRANSFORM_EXAMPLES) == {"identity", "hadamard"}
    assert set(QUANTIZERS) == set(QUANTIZER_EXAMPLES) == {"uniform", "none"}
    assert set(CODECS) == set(CODEC_EXAMPLES) == {"bitpack"}


def reference_pipeline(x: torch.Tensor, cfg: PolicyConfig, quant: Quantizer, layer: int, kind: str) -> torch.Tensor:
    """In-memory T -> Q -> Q^-1 -> T^-1 without the codec and the stream."""
    y = x.to(torch.float32)
    for t in cfg.transforms:
        y = t.forward(y, layer=layer, kind=kind)
    y = quant.dequantize(quant.quantize(y))
    for t in reversed(cfg.transforms):
        y = t.inverse(y, layer=layer, kind=kind)
    return y.to(x.dtype)


# ----------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cfg", POLICIES, ids=_id)
def test_round_trip_preserves_structure_and_matches_in_memory_pipeline(cfg, dtype):
    kv = make_kv(MATRIX_SHAPES, dtype=dtype)
    stream = encode_kv(kv, cfg, layer_offset=3)
    out = decode_kv(stream, expect=cfg)
    assert len(out) == len(kv)
    for i, ((k, v), (k2, v2)) in enumerate(zip(kv, out)):
        for orig, dec, quant, kind in ((k, k2, cfg.key, "key"), (v, v2, cfg.value, "value")):
            assert dec.shape == orig.shape and dec.dtype == orig.dtype and dec.device.type == "cpu"
            assert torch.isfinite(dec).all()
            # the codec and the stream are lossless: decode == the in-memory lossy pipeline, bit for bit
            assert torch.equal(dec, reference_pipeline(orig, cfg, quant, 3 + i, kind))


def test_none_quantizer_is_lossless_on_bfloat16_and_rounds_float32_to_bfloat16():
    kv_bf = make_kv(MATRIX_SHAPES[:2], dtype=torch.bfloat16)
    out = decode_kv(encode_kv(kv_bf, PolicyConfig.uncompressed()))
    assert all(torch.equal(a, b) and torch.equal(c, d) for (a, c), (b, d) in zip(kv_bf, out))
    kv32 = make_kv(MATRIX_SHAPES[:1])
    (k2, _), = decode_kv(encode_kv(kv32, PolicyConfig.uncompressed()))
    assert k2.dtype == torch.float32
    assert torch.equal(k2, kv32[0][0].to(torch.bfloat16).to(torch.float32))


def test_float16_input_and_empty_kv_round_trip():
    kv = make_kv(MATRIX_SHAPES[:1], dtype=torch.float16)
    (k2, v2), = decode_kv(encode_kv(kv, PolicyConfig.kivi(8)))
    assert k2.dtype == v2.dtype == torch.float16
    assert float((k2.float() - kv[0][0].float()).norm() / kv[0][0].float().norm()) < 0.01
    assert decode_kv(encode_kv([], PolicyConfig.kivi(2))) == []


def test_quality_improves_with_bits_and_hadamard_helps_per_token_keys():
    kv = make_kv([((1, 2, 256, 64), (1, 2, 256, 64))])
    k = kv[0][0]

    def rel_err(cfg):
        (k2, _), = decode_kv(encode_kv(kv, cfg))
        return float((k2 - k).norm() / k.norm())

    errs = [rel_err(PolicyConfig.kivi(b)) for b in (2, 3, 4, 8)]
    assert errs == sorted(errs, reverse=True) and errs[-1] < 0.01
    tok2 = dict(key={"name": "uniform", "bits": 2, "granularity": "per_token"}, value="none")
    plain = rel_err(PolicyConfig.from_dict(tok2))
    rotated = rel_err(PolicyConfig.from_dict({**tok2, "transforms": ["hadamard"]}))
    assert rotated < 0.8 * plain  # the rotation spreads the outlier channels (QuaRot)


def test_encode_rejects_malformed_kv():
    k = torch.zeros(1, 1, 4, 8)
    cfg = PolicyConfig.kivi(2)
    with pytest.raises(ValueError, match="dtype"):
        encode_kv([(k, k.to(torch.bfloat16))], cfg)
    with pytest.raises(ValueError, match="batch, kv_heads, tokens, head_dim"):
        encode_kv([(k[0], k[0])], cfg)
    with pytest.raises(ValueError, match="dtype"):
        encode_kv([(k.int(), k.int())], cfg)
    with pytest.raises(TypeError):
        encode_kv([(k,)], cfg)


# ----------------------------------------------------------------------------- quantizers


def _groups(n: int, g: int) -> list[slice]:
    g = g or n
    return [slice(s, min(s + g, n)) for s in range(0, n, g)] if n else []


def reference_error_bound(x: torch.Tensor, q: UniformQuantizer) -> torch.Tensor:
    """Per-element bound: half a step of the element's group, from the group's own min/max
    (or absmax), plus float16 rounding of the stored metadata (<= 2**-10 of the group magnitude)."""
    axis = -1 if q.granularity == "per_token" else -2
    levels = 2**q.bits - 1
    bound = torch.empty_like(x)
    for sl in _groups(x.shape[axis], q.group_size):
        idx = (..., sl) if axis == -1 else (..., sl, slice(None))
        xs = x[idx]
        lo, hi = xs.amin(dim=axis, keepdim=True), xs.amax(dim=axis, keepdim=True)
        mag = torch.maximum(lo.abs(), hi.abs())
        step = 2 * mag / levels if q.symmetric else (hi - lo) / levels
        bound[idx] = (step / 2 + 2**-10 * mag + 2**-9 * step + 1e-7).expand_as(xs)
    return bound


@pytest.mark.parametrize("quant", UNIFORM, ids=lambda q: q.short_label())
@pytest.mark.parametrize("shape", [(1, 2, 100, 64), (2, 1, 37, 96)])
def test_uniform_error_within_half_step_of_own_group(quant, shape):
    x = heavy_tailed(shape, seed=11, outliers=(3, 17))
    q = quant.quantize(x)
    assert q.symbols.shape == x.shape and q.symbols.dtype == torch.uint8
    assert int(q.symbols.max()) < 2**quant.bits
    err = (quant.dequantize(q) - x).abs()
    bound = reference_error_bound(x, quant)
    assert (err <= bound).all(), float((err - bound).max())


def test_8bit_asymmetric_error_is_half_a_step():
    quant = UniformQuantizer(bits=8, granularity="per_token", group_size=16)
    x = heavy_tailed((1, 4, 64, 64), seed=5, outliers=(3,))
    xg = x.reshape(1, 4, 64, 4, 16)
    step = ((xg.amax(-1, keepdim=True) - xg.amin(-1, keepdim=True)) / 255).expand_as(xg).reshape(x.shape)
    mag = xg.abs().amax(-1, keepdim=True).expand_as(xg).reshape(x.shape)
    err = (quant.dequantize(quant.quantize(x)) - x).abs()
    assert (err <= step / 2 + 2**-10 * mag + 1e-7).all()
    assert float((err / step).max()) > 0.4  # round-to-nearest: errors do reach ~half a step


def test_metadata_layout_and_kivi_cost():
    kivi_k = UniformQuantizer(bits=2, granularity="per_channel", group_size=32)
    q = kivi_k.quantize(heavy_tailed((1, 3, 100, 64), seed=1))
    assert q.meta["scale"].shape == q.meta["zero"].shape == (1, 3, 4, 64)  # ceil(100/32) token groups
    assert q.meta["scale"].dtype == torch.float16 and q.meta_nbytes == 2 * 2 * 3 * 4 * 64
    sym = UniformQuantizer(bits=3, symmetric=True, granularity="per_token", group_size=24)
    layout = sym.meta_layout((2, 1, 37, 96))
    assert [(f.name, f.shape, f.dtype) for f in layout] == [("scale", (2, 1, 37, 4), torch.float16)]


def test_constant_groups_decode_exactly():
    x = heavy_tailed((1, 1, 64, 32), seed=2)
    x[0, 0, :32, 5] = 0.5  # a constant per-channel group
    x[0, 0, 40] = -3.25  # a constant per-token group
    x[0, 0, 41] = 0.0
    for quant in (
        UniformQuantizer(bits=2, granularity="per_channel", group_size=32),
        UniformQuantizer(bits=2, granularity="per_token", group_size=0),
        UniformQuantizer(bits=1, symmetric=True, granularity="per_token", group_size=8),
    ):
        y = quant.dequantize(quant.quantize(x))
        if quant.granularity == "per_channel":
            assert torch.equal(y[0, 0, :32, 5], x[0, 0, :32, 5])
            assert not torch.equal(y[0, 0, 32:, 5], x[0, 0, 32:, 5])
        else:
            assert torch.equal(y[0, 0, 41], x[0, 0, 41])  # all-zero group (also on the mid-rise symmetric grid)
            if not quant.symmetric:
                assert torch.equal(y[0, 0, 40], x[0, 0, 40])


@pytest.mark.parametrize("quant", ALL_QUANTIZERS, ids=lambda q: q.short_label())
def test_quantize_dequantize_quantize_is_idempotent(quant):
    x = heavy_tailed((2, 2, 70, 96), seed=3, outliers=(3, 17))
    q1 = quant.quantize(x)
    x1 = quant.dequantize(q1)
    q2 = quant.quantize(x1)
    assert torch.equal(q1.symbols, q2.symbols)
    assert q1.meta.keys() == q2.meta.keys() and all(torch.equal(q1.meta[k], q2.meta[k]) for k in q1.meta)
    assert torch.equal(quant.dequantize(q2), x1)


@pytest.mark.parametrize("bits", [6, 8])
def test_idempotent_on_groups_with_large_offset(bits):
    # groups whose range is small next to their magnitude: a float16 zero point rounded to
    # nearest would let the group minimum land on symbol >= 1 and drift on re-quantization
    offsets = torch.linspace(50, 300, 400).repeat_interleave(3)[:, None]
    ranges = torch.tensor([0.5, 2.0, 8.0]).repeat(400)[:, None]
    x = (offsets + ranges * torch.linspace(0, 1, 32)[None, :]).reshape(1, 1, 1200, 32)
    quant = UniformQuantizer(bits=bits, granularity="per_token", group_size=0)
    q1 = quant.quantize(x)
    assert torch.equal(quant.quantize(quant.dequantize(q1)).symbols, q1.symbols)
    assert (q1.symbols.amin(-1) == 0).all() and (q1.symbols.amax(-1) == 2**bits - 1).all()


def test_uniform_symbols_hit_both_ends_of_the_grid():
    quant = UniformQuantizer(bits=3, granularity="per_token", group_size=0)
    x = torch.tensor([[[[-1.0, -0.5, 0.0, 0.25, 2.5]]]])
    q = quant.quantize(x)
    assert q.symbols.flatten().tolist() == [0, 1, 2, 2, 7]  # step 0.5: (x + 1) / 0.5 rounded (2.5 -> 2)
    assert torch.equal(quant.dequantize(q), torch.tensor([[[[-1.0, -0.5, 0.0, 0.0, 2.5]]]]))


# ----------------------------------------------------------------------------- transforms


@pytest.mark.parametrize("n, blocks", [(1, (1,)), (7, (4, 2, 1)), (64, (64,)), (80, (64, 16)), (96, (64, 32)), (256, (256,))])
def test_block_hadamard_is_symmetric_orthonormal(n, blocks):
    assert power_of_two_blocks(n) == blocks
    h = block_hadamard_matrix(n).double()
    assert torch.allclose(h, h.T)
    assert torch.allclose(h @ h.T, torch.eye(n, dtype=torch.float64), atol=1e-6)
    first = blocks[0]
    assert torch.allclose(h[:first, :first].abs(), torch.full((first, first), 1 / math.sqrt(first), dtype=torch.float64))


@pytest.mark.parametrize("head_dim", [7, 64, 96, 128, 256])
@pytest.mark.parametrize("transform", ALL_TRANSFORMS, ids=lambda t: t.short_label())
def test_transform_inverse_and_norm(transform, head_dim):
    x = torch.randn(2, 3, 50, head_dim, generator=torch.Generator().manual_seed(head_dim))
    y = transform.forward(x, layer=4, kind="key")
    assert y.shape == x.shape and y.dtype == torch.float32
    torch.testing.assert_close(transform.inverse(y, layer=4, kind="key"), x, rtol=0, atol=1e-5)
    torch.testing.assert_close(y.norm(dim=-1), x.norm(dim=-1), rtol=1e-5, atol=1e-5)
    if isinstance(transform, Hadamard):
        assert not torch.allclose(y, x)
        # wrong layer or kind -> different signs -> not the inverse
        assert not torch.allclose(transform.inverse(y, layer=5, kind="key"), x, atol=1e-3)
        assert not torch.allclose(transform.inverse(y, layer=4, kind="value"), x, atol=1e-3)


def test_hadamard_spreads_a_spike_evenly():
    h = Hadamard()
    x = torch.zeros(1, 2, 1, 64)
    x[..., 3] = 8.0
    assert torch.allclose(h.forward(x, layer=0, kind="key").abs(), torch.ones(1, 2, 1, 64))
    x96 = torch.zeros(1, 1, 1, 96)
    x96[..., 70] = 8.0  # in the 32-wide block
    y = h.forward(x96, layer=0, kind="value").abs()[0, 0, 0]
    assert torch.allclose(y[64:], torch.full((32,), 8 / math.sqrt(32))) and torch.all(y[:64] == 0)


def test_hadamard_signs_are_pinned():
    # the decoder on another machine must derive the same signs: pinned values (SHAKE-256 based)
    s = random_signs(0, 0, "key", 2, 16)
    assert s[0].int().tolist() == [-1, -1, 1, -1, 1, 1, 1, 1, 1, -1, 1, -1, 1, 1, 1, -1]
    assert not torch.equal(random_signs(0, 1, "key", 1, 16), s[:1])
    assert not torch.equal(random_signs(1, 0, "key", 1, 16), s[:1])
    assert not torch.equal(random_signs(0, 0, "value", 1, 16), s[:1])


# ----------------------------------------------------------------------------- bitpack


@pytest.mark.parametrize("bits", range(1, 9))
@pytest.mark.parametrize("count", [0, 1, 3, 7, 8, 9, 1001, 4097])
def test_bitpack_exact_for_every_width(bits, count):
    rng = np.random.default_rng(bits * 10_000 + count)
    a = rng.integers(0, 2**bits, size=count, dtype=np.uint8)
    data = BitPack().pack(torch.from_numpy(a), bits)
    assert len(data) == math.ceil(count * bits / 8)
    out = BitPack().unpack(data, bits, count)
    assert out.dtype == np.uint8 and np.array_equal(out, a)


@settings(max_examples=60, deadline=None, derandomize=True)
@given(bits=st.integers(1, 8), data=st.lists(st.integers(0, 255), max_size=300))
def test_bitpack_property(bits, data):
    a = np.array(data, dtype=np.uint8) & np.uint8(2**bits - 1)
    assert np.array_equal(unpack_bits(pack_bits(a, bits), bits, a.size), a)


def test_bitpack_bit_order_and_raw16():
    assert pack_bits(np.array([1, 2, 3, 0], np.uint8), 2) == bytes([0b01101100])
    assert pack_bits(np.array([5, 3], np.uint8), 3) == bytes([0b10101100])
    assert pack_bits(np.array([1, 0, 1], np.uint8), 1) == bytes([0b10100000])
    assert pack_bits(np.array([0xA, 0x5, 0xF], np.uint8), 4) == bytes([0xA5, 0xF0])
    raw = np.array([0x3F80, 0xC000, 1], dtype=np.uint16)  # bf16 1.0, -2.0, tiny
    data = BitPack().pack(raw, 16)
    assert data == bytes([0x80, 0x3F, 0x00, 0xC0, 0x01, 0x00])
    assert np.array_equal(BitPack().unpack(data, 16, 3), raw)


def test_bitpack_rejects_bad_input():
    with pytest.raises(ValueError, match="does not fit"):
        pack_bits(np.array([4], np.uint8), 2)
    with pytest.raises(CorruptStreamError):
        unpack_bits(b"\x00\x00", 3, 6)  # 6 symbols x 3 bits need 3 bytes
    with pytest.raises(CorruptStreamError):
        BitPack().unpack(b"\x00", 16, 1)


# ----------------------------------------------------------------------------- stream accounting


def test_stream_length_is_header_plus_sections_plus_checksum():
    kv = make_kv(MATRIX_SHAPES)
    cfg = PolicyConfig.kivi(3, transforms=(Hadamard(),))
    stream = encode_kv(kv, cfg, layer_offset=7)
    h = read_header(stream)
    assert len(stream) == h.total_nbytes == h.header_nbytes + h.meta_nbytes + h.payload_nbytes + 4
    assert h.layer_offset == 7 and h.dtype == "float32" and h.policy_id == cfg.policy_id
    assert h.policy == cfg.to_dict() and h.num_layers == 4
    for (ks, vs), (km, kp, vm, vp) in zip(h.shapes, h.sections):
        assert kp == math.ceil(math.prod(ks) * 3 / 8) and vp == math.ceil(math.prod(vs) * 3 / 8)
        b, hh, t, d = ks
        assert km == 2 * 2 * b * hh * math.ceil(t / 32) * d  # per-channel: scale + zero per 32 tokens
        assert vm == 2 * 2 * b * hh * t * math.ceil(d / 32)  # per-token: scale + zero per 32 channels
    assert original_nbytes(kv) == 2 * sum(math.prod(k) + math.prod(v) for k, v in h.shapes)


@pytest.mark.parametrize(
    "cfg, bits_per_element",
    [
        (PolicyConfig.from_dict({"key": {"bits": 2, "group_size": 32}, "value": {"bits": 2, "group_size": 32}}), 3.0),
        (PolicyConfig.kivi(2), 3.0),
        (PolicyConfig.kivi(4, group_size=64), 4.5),
        (PolicyConfig.from_dict({"key": {"bits": 3, "symmetric": True, "group_size": 16}, "value": {"bits": 3, "symmetric": True, "group_size": 16}}), 4.0),
        (PolicyConfig.uncompressed(), 16.0),
    ],
    ids=lambda x: x.label if isinstance(x, PolicyConfig) else str(x),
)
def test_bits_per_element_on_a_large_tensor(cfg, bits_per_element):
    kv = make_kv([((1, 4, 2048, 128), (1, 4, 2048, 128))])
    stream = encode_kv(kv, cfg)
    h = read_header(stream)
    n = h.num_elements
    assert (h.payload_nbytes + h.meta_nbytes) * 8 == bits_per_element * n  # exact
    assert h.header_nbytes + 4 < 1000
    assert bits_per_element <= 8 * len(stream) / n < bits_per_element + 8 * 1000 / n
    assert original_nbytes(kv) / len(stream) == pytest.approx(16 / bits_per_element, rel=1e-3)


def test_streams_are_deterministic():
    kv = make_kv(MATRIX_SHAPES)
    cfg = PolicyConfig.kivi(2, transforms=(Hadamard(seed=3),))
    a = encode_kv(kv, cfg)
    b = encode_kv([(k.clone(), v.clone()) for k, v in kv], PolicyConfig.from_dict(cfg.to_dict()))
    assert a == b
    assert encode_kv(kv, cfg, layer_offset=1) != a  # layer-dependent Hadamard signs
    assert encode_kv(kv, PolicyConfig.kivi(2, transforms=(Hadamard(seed=4),))) != a


# ----------------------------------------------------------------------------- policy config

KIVI_HADAMARD = {
    "transforms": [{"name": "hadamard", "seed": 0}],
    "key": {"name": "uniform", "bits": 2, "granularity": "per_channel", "group_size": 32},
    "value": {"name": "uniform", "bits": 2, "granularity": "per_token", "group_size": 32},
    "codec": {"name": "bitpack"},
}


def test_policy_label_id_and_canonical_dict():
    cfg = PolicyConfig.from_dict(KIVI_HADAMARD)
    assert cfg.label == "hadamard|K:u2a/ch/g32|V:u2a/tok/g32|bitpack"
    assert cfg.policy_id == "46d08cde433f"  # pinned: stored profiles refer to policy ids
    assert cfg.to_dict() == {
        "version": 1,
        "transforms": [{"name": "hadamard", "seed": 0}],
        "key": {"name": "uniform", "bits": 2, "symmetric": False, "granularity": "per_channel", "group_size": 32},
        "value": {"name": "uniform", "bits": 2, "symmetric": False, "granularity": "per_token", "group_size": 32},
        "codec": {"name": "bitpack"},
    }
    assert cfg == PolicyConfig.kivi(2, transforms=(Hadamard(),))
    assert PolicyConfig.uncompressed().label == "identity|K:bf16|V:bf16|bitpack"


def test_policy_bare_strings_defaults_and_identity_canonicalization():
    short = PolicyConfig.from_dict({"transforms": ["hadamard"], "key": {"bits": 2, "granularity": "per_channel"},
                                    "value": {"name": "uniform", "bits": 2}, "codec": "bitpack"})
    assert short == PolicyConfig.from_dict(KIVI_HADAMARD) and short.policy_id == "46d08cde433f"
    plain = PolicyConfig.from_dict({"key": "uniform", "value": "none"})
    assert plain.codec == BitPack() and plain.transforms == () and plain.key == UniformQuantizer()
    with_identity = PolicyConfig.from_dict({"transforms": ["identity"], "key": "uniform", "value": "none"})
    assert with_identity == plain and with_identity.policy_id == plain.policy_id
    assert PolicyConfig.from_dict({"transforms": "identity+hadamard", "key": "uniform", "value": "none"}).transforms == (Hadamard(),)


@pytest.mark.parametrize("cfg", POLICIES, ids=_id)
def test_policy_round_trips_through_dict_and_json(cfg):
    again = PolicyConfig.from_dict(cfg.to_dict())
    assert again == cfg and again.policy_id == cfg.policy_id and again.label == cfg.label
    assert PolicyConfig.from_json(cfg.to_json()) == cfg
    assert len(cfg.policy_id) == 12 and int(cfg.policy_id, 16) >= 0


def test_policy_ids_are_distinct_across_the_matrix():
    assert len({p.policy_id for p in POLICIES}) == len(POLICIES)


def _with(slot: str, **changes):
    d = {k: (dict(v) if isinstance(v, dict) else list(v)) for k, v in KIVI_HADAMARD.items()}
    d[slot].update(changes)
    return d


@pytest.mark.parametrize(
    "d, expected",
    [
        (_with("key", bits=9), ["'key'", "uniform", "'bits'", "1..8"]),
        (_with("key", bits=0), ["'bits'", "1..8"]),
        (_with("value", bits="2"), ["'value'", "'bits'", "integer"]),
        (_with("key", bits=True), ["'bits'"]),
        (_with("key", bits=2.5), ["'bits'"]),
        (_with("key", granularity="per_head"), ["'granularity'", "'per_token'", "'per_channel'"]),
        (_with("value", group_size=-1), ["'group_size'", ">= 0"]),
        (_with("key", symmetric="yes"), ["'symmetric'", "true or false"]),
        (_with("key", bitz=2), ["'bitz'", "allowed", "bits", "group_size"]),
        (_with("key", name="unifrom"), ["'unifrom'", "none", "uniform"]),
        (_with("codec", name="zip"), ["'codec'", "'zip'", "bitpack"]),
        (_with("codec", level=3), ["'level'", "bitpack"]),
        ({**KIVI_HADAMARD, "transforms": [{"name": "hadamrd"}]}, ["'hadamrd'", "hadamard", "identity"]),
        ({**KIVI_HADAMARD, "transforms": [{"name": "hadamard", "seed": -1}]}, ["'seed'", ">= 0"]),
        ({**KIVI_HADAMARD, "keys": {}}, ["'keys'", "transforms", "value"]),
        ({k: v for k, v in KIVI_HADAMARD.items() if k != "value"}, ["'value'", "missing"]),
        ({**KIVI_HADAMARD, "version": 2}, ["'version'"]),
        ({**KIVI_HADAMARD, "key": 4}, ["'key'", "name"]),
    ],
)
def test_bad_configs_raise_config_error_naming_the_key(d, expected):
    with pytest.raises(ConfigError) as info:
        PolicyConfig.from_dict(d)
    for s in expected:
        assert s in str(info.value), (s, str(info.value))


def test_components_validate_on_construction():
    with pytest.raises(ConfigError, match="'bits'"):
        UniformQuantizer(bits=0)
    with pytest.raises(ConfigError, match="'granularity'"):
        UniformQuantizer(granularity="per_head")
    with pytest.raises(ConfigError, match="from_json|JSON"):
        PolicyConfig.from_json("{not json")


# ----------------------------------------------------------------------------- corrupted streams


@pytest.fixture(scope="module")
def good_stream():
    cfg = PolicyConfig.kivi(4, transforms=(Hadamard(),))
    kv = make_kv(MATRIX_SHAPES[:2])
    return cfg, encode_kv(kv, cfg)


def _flip(data: bytes, pos: int) -> bytes:
    b = bytearray(data)
    b[pos] ^= 0xFF
    return bytes(b)


def test_good_stream_decodes_with_and_without_expectation(good_stream):
    cfg, stream = good_stream
    assert len(decode_kv(stream)) == 2 and len(decode_kv(stream, expect=cfg)) == 2
    assert len(decode_kv(memoryview(stream))) == 2


def test_flipped_payload_byte_is_corrupt(good_stream):
    _, stream = good_stream
    h = read_header(stream)
    for pos in (h.header_nbytes, h.header_nbytes + h.meta_nbytes // 2, len(stream) - 10, len(stream) - 1):
        with pytest.raises(CorruptStreamError):
            decode_kv(_flip(stream, pos))


def test_flipped_header_byte_is_corrupt(good_stream):
    _, stream = good_stream
    h = read_header(stream)
    for pos in (12, 40, h.header_nbytes - 6, h.header_nbytes - 2):  # JSON and header checksum
        with pytest.raises(CorruptStreamError):
            decode_kv(_flip(stream, pos))


def test_truncated_stream(good_stream):
    _, stream = good_stream
    h = read_header(stream)
    for cut in (0, 3, 4, 9, 10, 50, h.header_nbytes - 1, h.header_nbytes, h.header_nbytes + 1, len(stream) // 2, len(stream) - 4, len(stream) - 1):
        with pytest.raises(TruncatedStreamError):
            decode_kv(stream[:cut])


def test_trailing_bytes_are_corrupt(good_stream):
    _, stream = good_stream
    with pytest.raises(CorruptStreamError, match="unexpected bytes"):
        decode_kv(stream + b"\x00")


def test_bad_magic_and_wrong_version(good_stream):
    _, stream = good_stream
    with pytest.raises(CorruptStreamError, match="magic"):
        decode_kv(b"KVTX" + stream[4:])
    with pytest.raises(CorruptStreamError, match="magic"):
        decode_kv(b"GZ")
    for version in (0, 2, 65535):
        with pytest.raises(StreamVersionError, match=str(version)):
            decode_kv(stream[:4] + struct.pack("<H", version) + stream[6:])


def test_wrong_expected_policy(good_stream):
    cfg, stream = good_stream
    with pytest.raises(PolicyMismatchError, match=cfg.policy_id):
        decode_kv(stream, expect=PolicyConfig.kivi(4))


def test_no_single_byte_flip_ever_decodes(good_stream):
    _, stream = good_stream
    for pos in np.linspace(0, len(stream) - 1, 60).astype(int):
        with pytest.raises(KVStreamError):
            decode_kv(_flip(stream, int(pos)))


def _authentic_stream(policy: dict, sections, shapes, dtype="float32") -> bytes:
    """A stream with valid checksums but content chosen by the test."""
    return write_stream(policy=policy, policy_id="000000000000", layer_offset=0, dtype=dtype, shapes=shapes, sections=sections)


def test_intact_but_inconsistent_streams_never_decode():
    cfg = PolicyConfig.kivi(2)
    shape = (1, 1, 32, 32)
    meta = bytes(2 * 2 * 32)  # one token group x 32 channels x (scale, zero) x fp16
    payload = bytes(32 * 32 * 2 // 8)
    ok = _authentic_stream(cfg.to_dict(), [(meta, payload, bytes(2 * 2 * 32), payload)], [(shape, shape)])
    (k, v), = decode_kv(ok)
    assert torch.equal(k, torch.zeros(shape))
    with pytest.raises(CorruptStreamError, match="metadata"):
        decode_kv(_authentic_stream(cfg.to_dict(), [(meta[:-2], payload, meta, payload)], [(shape, shape)]))
    with pytest.raises(CorruptStreamError, match="payload"):
        decode_kv(_authentic_stream(cfg.to_dict(), [(meta, payload + b"\x00", meta, payload)], [(shape, shape)]))
    unknown = {**cfg.to_dict(), "codec": {"name": "brotli"}}
    with pytest.raises(KVStreamError, match="brotli"):
        decode_kv(_authentic_stream(unknown, [(meta, payload, meta, payload)], [(shape, shape)]))
    # a tampered header whose header checksum was recomputed is still caught by the final checksum
    good = encode_kv(make_kv(MATRIX_SHAPES[:1]), cfg)
    hlen = struct.unpack_from("<I", good, 6)[0]
    header = good[10 : 10 + hlen].replace(b'"layer_offset":0', b'"layer_offset":1')
    head = good[:10] + header
    forged = head + hashlib.blake2b(head, digest_size=4).digest() + good[14 + hlen :]
    with pytest.raises(CorruptStreamError, match="checksum"):
        decode_kv(forged)
