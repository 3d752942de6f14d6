"""Tests of the entropy / general-purpose codecs: ``range`` (constriction range coder) and ``zstd``.

Symbols are synthetic: constant, uniform, and discretized Laplace with a scale that varies per
channel and a centre that varies per head (so per-channel, per-head and global models differ).
The end-to-end test goes through PolicyConfig / encode_kv / decode_kv on heavy-tailed KV.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtune.codecs import CODECS, Codec, PolicyConfig, decode_kv, encode_kv
from kvtune.codecs.bitpack import pack_bits, packed_nbytes
from kvtune.codecs.range_coder import (
    KIND_RANGE,
    KIND_RAW,
    MAX_PRECISION,
    RangeCodec,
    encode_range,
    fuse_symbols,
    fusion_factor,
    parse_sections,
    quantize_counts,
    table_nbytes,
    unfuse_symbols,
)
from kvtune.codecs.zstd_codec import ZstdCodec
from kvtune.errors import ConfigError, CorruptStreamError

MODELS = ("per_channel", "per_head", "global")
# odd counts and head dims (7, 9, 5: unfused remainders), 1-D and 2-D inputs (one head), one symbol
SHAPES = [(1, 3, 100, 64), (2, 3, 17, 7), (5,), (3, 5), (1, 1, 1, 1), (2, 2, 3, 3, 5), (1, 2, 1, 9)]


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # small tensors / tiny models


# ----------------------------------------------------------------------------- data


def laplace_symbols(shape, bits: int, *, seed: int, channel_scale: bool = True, head_shift: bool = True) -> np.ndarray:
    """Discretized Laplace symbols in ``0..2**bits-1`` centred mid-range. ``channel_scale``: the
    scale grows along the last axis (1/16 to 3/16 of the range, else 1/8); ``head_shift``: the
    centre moves up by 1/8 of the range per index of axis 1."""
    rng = np.random.default_rng(seed)
    k = 1 << bits
    d = shape[-1] if shape else 1
    scale = (0.5 + np.arange(d) / max(d - 1, 1)) * k / 8 if channel_scale else np.full(d, k / 8)
    centre = np.full(shape, k / 2)
    if head_shift and len(shape) >= 3:
        centre = centre + (np.arange(shape[1]) * k / 8).reshape(1, -1, *([1] * (len(shape) - 2)))
    x = np.round(centre + rng.laplace(0.0, 1.0, size=shape) * scale)
    return np.clip(x, 0, k - 1).astype(np.uint8)


def make_symbols(kind: str, shape, bits: int, *, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if kind == "constant":
        return np.full(shape, (1 << bits) - 1 if bits > 1 else 1, dtype=np.uint8)
    if kind == "uniform":
        return rng.integers(0, 1 << bits, size=shape).astype(np.uint8)
    return laplace_symbols(shape, bits, seed=seed)


def group_view(x: np.ndarray, model: str) -> np.ndarray:
    """``(G, n)``: the symbols of each model group in a row (independent of the codec's code)."""
    if model == "per_channel":
        return x.reshape(-1, x.shape[-1]).T
    if model == "per_head" and x.ndim >= 3:
        return np.moveaxis(x, 1, 0).reshape(x.shape[1], -1)
    return x.reshape(1, -1)


def entropy_bytes(x: np.ndarray, model: str, bits: int) -> float:
    """Sum over groups of ``n_g * H_g / 8``: the empirical order-0 entropy under the partition."""
    total = 0.0
    for row in group_view(x, model):
        p = np.bincount(row, minlength=1 << bits) / row.size
        p = p[p > 0]
        total += -(p * np.log2(p)).sum() * row.size / 8
    return total


def varint_len(v: int) -> int:
    return max(1, math.ceil(v.bit_length() / 7))


# ----------------------------------------------------------------------------- registry, params


def test_registered_and_validated():
    assert CODECS["range"] is RangeCodec and CODECS["zstd"] is ZstdCodec
    assert Codec.from_dict({"name": "range", "model": "per_head"}) == RangeCodec(model="per_head")
    assert RangeCodec().model == "per_channel" and ZstdCodec().level == 3
    with pytest.raises(ConfigError, match="model"):
        RangeCodec(model="per_token")
    with pytest.raises(ConfigError, match="coded_bits"):
        RangeCodec(coded_bits=9)
    with pytest.raises(ConfigError, match="level"):
        ZstdCodec(level=23)
    for c in (RangeCodec(), ZstdCodec()):
        assert c.supports(1) and c.supports(8) and c.supports(16)
        assert not c.supports(0) and not c.supports(9)


@pytest.mark.parametrize("codec", [RangeCodec(), ZstdCodec()], ids=["range", "zstd"])
def test_pack_rejects_bad_symbols(codec):
    with pytest.raises(ValueError, match="does not fit"):
        codec.pack(np.array([0, 4], dtype=np.uint8), 2)
    with pytest.raises(ValueError, match="uint8"):
        codec.pack(np.array([0, 1], dtype=np.int32), 2)
    with pytest.raises(ValueError):
        codec.pack(np.array([0, 1], dtype=np.uint8), 9)


# ----------------------------------------------------------------------------- fusion, tables


@pytest.mark.parametrize("bits", range(1, 9))
def test_fusion_is_exhaustively_exact(bits):
    m, k = fusion_factor(bits), 1 << bits
    assert m == max(1, 8 // bits) and k**m <= 256
    tuples = np.array(list(itertools.product(range(k), repeat=m)), dtype=np.uint8)  # every m-tuple
    sup = fuse_symbols(tuples, bits).reshape(-1)
    assert (sup.astype(int) == (tuples.astype(int) * k ** np.arange(m)).sum(axis=1)).all()  # s_0 least significant
    assert (unfuse_symbols(sup, bits).reshape(tuples.shape) == tuples).all()


@settings(max_examples=100, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    k=st.sampled_from([2, 4, 16, 256]),
    groups=st.integers(1, 3),
    n=st.sampled_from([1, 7, 100, 3072, 100_000]),
    precision=st.integers(1, MAX_PRECISION),
)
def test_quantize_counts_invariants(seed, k, groups, n, precision):
    rng = np.random.default_rng(seed)
    p = rng.dirichlet(np.full(k, 0.3), size=groups)  # skewed, many near-empty symbols
    c = np.stack([rng.multinomial(n, row) for row in p]).astype(np.int64)
    f = quantize_counts(c, precision)
    if precision == MAX_PRECISION:
        assert f is not None  # the floor variant always fits <= 256 symbols at P = 15
    if f is None:  # only when 2**P < n: otherwise no symbol needs raising to 1 and floor fits
        assert n > 1 << precision
        return
    assert (f.sum(axis=1) == 1 << precision).all()
    assert ((f >= 1) == (c > 0)).all()
    if (1 << precision) % n == 0:  # counts scale exactly: the table is the empirical distribution
        assert np.array_equal(f, c * ((1 << precision) // n))


def test_table_nbytes_formula():
    assert table_nbytes(64, 2, 256, 7) == 32 + 224
    assert table_nbytes(3, 8, 10, 5) == 96 + 7
    assert table_nbytes(1, 1, 1, 0) == 1


# ----------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("bits", list(range(1, 9)))
@pytest.mark.parametrize("model", MODELS)
def test_range_round_trip_exact(model, bits):
    codec = RangeCodec(model=model)
    for (i, shape), kind in itertools.product(enumerate(SHAPES), ("constant", "uniform", "laplace")):
        x = make_symbols(kind, shape, bits, seed=i)
        flat = x.reshape(-1)
        data = codec.pack(x, bits)
        for shp in (x.shape, None):  # the layout travels in the payload; shape only cross-checks
            y = codec.unpack(data, bits, x.size, shape=shp)
            assert y.dtype == np.uint8 and y.shape == (x.size,) and np.array_equal(y, flat), (shape, kind)
        assert len(data) <= 1 + packed_nbytes(x.size, bits)  # never worse than bitpack + 1 byte
        forced = encode_range(x, bits, model)  # the range-coded form even where raw is smaller
        assert forced[0] == KIND_RANGE
        assert np.array_equal(codec.unpack(forced, bits, x.size, shape=x.shape), flat), (shape, kind)
        assert np.array_equal(codec.unpack(memoryview(bytearray(forced)), bits, x.size), flat)


@pytest.mark.parametrize("model", MODELS)
def test_range_compresses_skewed_and_constant_data(model):
    codec = RangeCodec(model=model)
    x = laplace_symbols((1, 3, 512, 64), 4, seed=1)
    data = codec.pack(x, 4)
    assert data[0] == KIND_RANGE and len(data) < 0.92 * packed_nbytes(x.size, 4)
    assert len(data) < 1.02 * entropy_bytes(x, model, 4) + 400
    const = np.full((1, 3, 512, 64), 5, dtype=np.uint8)
    data = codec.pack(const, 4)
    groups = {"per_channel": 64, "per_head": 3, "global": 1}[model]
    # ~0 payload bits: header, a presence bit per (group, symbol), P = 1 so one 1-bit value per group
    assert data[0] == KIND_RANGE and len(data) <= 8 + table_nbytes(groups, 4, groups, 1) + 8
    assert np.array_equal(codec.unpack(data, 4, const.size, shape=const.shape), const.reshape(-1))


def test_range_uniform_and_tiny_data_fall_back_to_raw():
    codec = RangeCodec()
    x = np.random.default_rng(0).integers(0, 4, size=(1, 2, 64, 64)).astype(np.uint8)
    data = codec.pack(x, 2)
    assert data[0] == KIND_RAW and data[1:] == pack_bits(x.reshape(-1), 2)
    assert codec.pack(np.zeros((1, 2, 0, 64), dtype=np.uint8), 2) == bytes([KIND_RAW])
    assert codec.unpack(bytes([KIND_RAW]), 2, 0).shape == (0,)


@pytest.mark.parametrize("model", MODELS)
def test_range_16_bit_symbols_are_stored_raw(model):
    codec = RangeCodec(model=model)
    x = np.random.default_rng(0).integers(0, 1 << 16, size=(1, 2, 7, 5)).astype(np.uint16)
    data = codec.pack(x, 16)
    assert data == bytes([KIND_RAW]) + x.astype("<u2").tobytes()
    y = codec.unpack(data, 16, x.size, shape=x.shape)
    assert y.dtype == np.uint16 and np.array_equal(y, x.reshape(-1))


@pytest.mark.parametrize("coded_bits", [1, 2, 3])
@pytest.mark.parametrize("bits", [1, 2, 4, 8])
def test_coded_bits_round_trip_and_layout(bits, coded_bits):
    codec = RangeCodec(model="per_head", coded_bits=coded_bits)
    x = laplace_symbols((2, 3, 37, 24), bits, seed=bits)
    data = encode_range(x, bits, "per_head", coded_bits=coded_bits)
    low = max(0, bits - coded_bits)
    sec = parse_sections(data, model="per_head", bits=bits, count=x.size, coded_bits=coded_bits)
    assert sec.raw_low_bits == low and sec.low_bits == packed_nbytes(x.size, low)
    assert np.array_equal(codec.unpack(data, bits, x.size, shape=x.shape), x.reshape(-1))
    assert np.array_equal(codec.unpack(codec.pack(x, bits), bits, x.size), x.reshape(-1))
    if low:  # L is on the wire: a codec with another coded_bits refuses the data
        with pytest.raises(CorruptStreamError, match="raw low bits"):
            RangeCodec(model="per_head").unpack(data, bits, x.size)
    else:
        assert data == encode_range(x, bits, "per_head")


def test_torch_input_and_determinism():
    x = laplace_symbols((1, 3, 256, 64), 3, seed=5)
    for codec in (RangeCodec(), RangeCodec(model="per_head"), RangeCodec(model="global"), ZstdCodec(), ZstdCodec(level=12)):
        a = codec.pack(x, 3)
        assert codec.pack(x.copy(), 3) == a
        assert type(codec)(**codec.params()).pack(torch.from_numpy(x), 3) == a
        assert codec.pack(np.asfortranarray(x), 3) == a  # C order is what counts, not the memory layout
    assert RangeCodec().pack(x, 3) != RangeCodec(model="global").pack(x, 3)


# ----------------------------------------------------------------------------- entropy bound


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("model", MODELS)
def test_range_payload_within_2_percent_of_empirical_entropy(model, bits):
    """~1M skewed symbols: coder words within 2 % of sum_g n_g H_g / 8; tables accounted exactly."""
    x = laplace_symbols((1, 4, 4096, 64), bits, seed=bits)
    codec = RangeCodec(model=model)
    data = codec.pack(x, bits)
    sec = parse_sections(data, model=model, bits=bits, count=x.size, shape=x.shape)
    assert sec.kind == KIND_RANGE and sec.total == len(data) and sec.low_bits == 0
    h = entropy_bytes(x, model, bits)
    assert h <= sec.payload <= 1.02 * h, (sec.payload / h)  # a static code cannot beat the empirical entropy
    # table accounting, recomputed from the data: presence bitmap + (f - 1) of every present symbol
    groups = group_view(x, model)
    nnz = sum(int(np.count_nonzero(np.bincount(row, minlength=1 << bits))) for row in groups)
    assert 1 <= sec.width <= sec.precision <= MAX_PRECISION
    assert sec.table == table_nbytes(len(groups), bits, nnz, sec.width)
    dims = {"per_channel": (64,), "per_head": (1, 4), "global": ()}[model]
    assert sec.dims == dims
    assert sec.header == 2 + sum(varint_len(d) for d in dims) + 2 + varint_len(sec.payload // 4)
    assert len(data) <= 1.02 * h + sec.table + sec.header
    assert np.array_equal(codec.unpack(data, bits, x.size, shape=x.shape), x.reshape(-1))


def test_the_model_matching_the_data_wins():
    shifted = laplace_symbols((1, 4, 4096, 64), 4, seed=3, head_shift=False).astype(int) + 2 * (np.arange(64) % 4) - 3
    by_channel = np.clip(shifted, 0, 15).astype(np.uint8)  # centre and scale vary by channel, not by head
    sizes = {m: len(RangeCodec(model=m).pack(by_channel, 4)) for m in MODELS}
    assert sizes["per_channel"] < 0.97 * min(sizes["per_head"], sizes["global"])
    by_head = laplace_symbols((1, 4, 4096, 64), 4, seed=3, channel_scale=False)
    sizes = {m: len(RangeCodec(model=m).pack(by_head, 4)) for m in MODELS}
    assert sizes["per_head"] < sizes["per_channel"] and sizes["per_head"] < 0.97 * sizes["global"]
    assert max(sizes.values()) < packed_nbytes(by_head.size, 4)


# ----------------------------------------------------------------------------- corruption


def _coded(model="per_channel", bits=2, shape=(2, 3, 40, 24), coded_bits=0, seed=0):
    x = laplace_symbols(shape, bits, seed=seed)
    return x, encode_range(x, bits, model, coded_bits=coded_bits)


def _decodes_or_raises(codec, data, bits, count, shape=None) -> bool:
    """True if unpack raised CorruptStreamError; otherwise check the output is well-formed."""
    try:
        y = codec.unpack(data, bits, count, shape=shape)
    except CorruptStreamError:
        return True
    assert isinstance(y, np.ndarray) and y.shape == (count,)
    assert y.dtype == (np.uint16 if bits == 16 else np.uint8)
    assert bits == 16 or int(y.max(initial=0)) < 1 << bits
    return False


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("bits", [1, 2, 4, 8])
def test_range_every_header_or_table_bit_flip_is_detected(model, bits):
    x, data = _coded(model, bits)
    codec = RangeCodec(model=model)
    sec = parse_sections(data, model=model, bits=bits, count=x.size, shape=x.shape)
    vlen = varint_len(sec.payload // 4)
    head = sec.header - vlen
    rng = np.random.default_rng(bits)
    flips = [(i, b) for i in range(head) for b in range(8)]  # every bit of the header...
    table_bytes = range(head, head + sec.table)
    if len(table_bytes) > 200:  # ...and one bit of each table byte (at most 200 of them)
        table_bytes = rng.choice(table_bytes, size=200, replace=False)
    flips += [(int(i), int(rng.integers(8))) for i in table_bytes]
    for i, bit in flips:
        bad = bytearray(data)
        bad[i] ^= 1 << bit
        with pytest.raises(CorruptStreamError):
            codec.unpack(bytes(bad), bits, x.size, shape=x.shape)
    words_at = len(data) - sec.payload
    for i in range(words_at - vlen, words_at):  # ...and of the word-count varint
        bad = bytearray(data)
        bad[i] ^= 0x01
        with pytest.raises(CorruptStreamError):
            codec.unpack(bytes(bad), bits, x.size, shape=x.shape)


@pytest.mark.parametrize("model", MODELS)
def test_range_payload_bit_flips_mostly_detected_never_crash(model):
    x, data = _coded(model, 2, shape=(1, 3, 128, 32))
    codec = RangeCodec(model=model)
    sec = parse_sections(data, model=model, bits=2, count=x.size)
    start = len(data) - sec.payload
    rng = np.random.default_rng(1)
    positions = rng.integers(start, len(data), size=300)
    detected = 0
    for pos, bit in zip(positions, rng.integers(0, 8, size=300)):
        bad = bytearray(data)
        bad[pos] ^= 1 << int(bit)
        detected += _decodes_or_raises(codec, bytes(bad), 2, x.size, x.shape)
    # range codes carry no redundancy: the rest decodes to count wrong symbols (the stream CRC catches it)
    assert detected >= 0.8 * 300


@pytest.mark.parametrize("coded_bits", [0, 1])
@pytest.mark.parametrize("model", MODELS)
def test_range_truncated_or_extended_data_raises(model, coded_bits):
    x, data = _coded(model, 2, shape=(1, 2, 30, 16), coded_bits=coded_bits)
    codec = RangeCodec(model=model, coded_bits=coded_bits)
    assert np.array_equal(codec.unpack(data, 2, x.size, shape=x.shape), x.reshape(-1))
    for cut in range(len(data)):
        with pytest.raises(CorruptStreamError):
            codec.unpack(data[:cut], 2, x.size, shape=x.shape)
    for extra in (b"\x00", b"\x00" * 4, b"\xff" * 4):
        with pytest.raises(CorruptStreamError):
            codec.unpack(data + extra, 2, x.size, shape=x.shape)
    raw = codec.pack(np.zeros(5, dtype=np.uint8), 2)  # tiny: stored raw
    with pytest.raises(CorruptStreamError):
        codec.unpack(raw[:-1], 2, 5)


def test_range_mismatched_model_shape_or_count_raises():
    x, data = _coded("per_channel", 2, shape=(1, 2, 32, 16))
    with pytest.raises(CorruptStreamError, match="model"):
        RangeCodec(model="per_head").unpack(data, 2, x.size, shape=x.shape)
    with pytest.raises(CorruptStreamError, match="layout"):
        RangeCodec().unpack(data, 2, x.size, shape=(1, 2, 64, 8))
    with pytest.raises(CorruptStreamError):
        RangeCodec().unpack(data, 2, x.size - 16)
    with pytest.raises(CorruptStreamError):
        RangeCodec().unpack(data, 2, x.size + 16)
    with pytest.raises(CorruptStreamError):
        RangeCodec().unpack(data, 16, x.size)
    with pytest.raises(ValueError):
        RangeCodec().unpack(data, 2, x.size, shape=(1, 2, 32, 15))


@settings(max_examples=150, deadline=None)
@given(
    garbage=st.binary(max_size=120),
    model=st.sampled_from(MODELS),
    # plausible prefixes (kind 1, model byte, layout) so that parsing gets past the first checks
    prefix=st.sampled_from([b"", b"\x01\x02\x08", b"\x01\x01\x01\x02", b"\x01\x00"]),
)
def test_range_random_garbage_raises_or_decodes_count_symbols(garbage, model, prefix):
    codec = RangeCodec(model=model)
    _decodes_or_raises(codec, prefix + garbage, 2, 64, (1, 2, 4, 8))
    _decodes_or_raises(codec, prefix + garbage, 2, 64)
    _decodes_or_raises(codec, prefix + garbage, 16, 3)


@settings(max_examples=80, deadline=None)
@given(data=st.data(), model=st.sampled_from(MODELS), bits=st.sampled_from([1, 2, 3, 5]))
def test_range_random_mutations_raise_or_decode_count_symbols(data, model, bits):
    x, coded = _coded(model, bits, shape=(1, 2, 12, 8), seed=bits)
    bad = bytearray(coded)
    for _ in range(data.draw(st.integers(1, 3))):
        bad[data.draw(st.integers(0, len(bad) - 1))] = data.draw(st.integers(0, 255))
    _decodes_or_raises(RangeCodec(model=model), bytes(bad), bits, x.size, x.shape)


# ----------------------------------------------------------------------------- zstd


@pytest.mark.parametrize("bits", [*range(1, 9), 16])
def test_zstd_round_trip_exact(bits):
    codec = ZstdCodec()
    for i, shape in enumerate([(0,), (1,), (3, 5), *SHAPES]):
        if bits == 16:
            x = np.random.default_rng(i).integers(0, 1 << 16, size=shape).astype(np.uint16)
        else:
            x = make_symbols(("constant", "uniform", "laplace")[i % 3], shape, bits, seed=i)
        y = codec.unpack(codec.pack(x, bits), bits, x.size, shape=x.shape)
        assert y.dtype == x.dtype and np.array_equal(y, x.reshape(-1))


def test_zstd_beats_bitpack_on_redundant_data():
    rows = np.random.default_rng(0).integers(0, 16, size=(8, 64)).astype(np.uint8)
    x = np.tile(rows, (3 * 128, 1)).reshape(1, 3, 1024, 64)  # 8 distinct token rows, repeated
    for level in (1, 3, 19):
        data = ZstdCodec(level=level).pack(x, 4)
        assert len(data) < packed_nbytes(x.size, 4) / 20
        assert np.array_equal(ZstdCodec(level=level).unpack(data, 4, x.size), x.reshape(-1))


def test_zstd_corruption_raises():
    x = laplace_symbols((1, 3, 64, 64), 4, seed=0)
    codec = ZstdCodec()
    data = codec.pack(x, 4)
    for cut in range(len(data)):
        with pytest.raises(CorruptStreamError):
            codec.unpack(data[:cut], 4, x.size)
    with pytest.raises(CorruptStreamError):
        codec.unpack(data + b"\x00", 4, x.size)
    with pytest.raises(CorruptStreamError, match="need"):  # content size checked before decompressing
        codec.unpack(data, 4, x.size - 2)
    rng = np.random.default_rng(0)
    for pos in rng.integers(0, len(data), size=200):
        bad = bytearray(data)
        bad[pos] ^= 0xFF
        _decodes_or_raises(codec, bytes(bad), 4, x.size)


@settings(max_examples=150, deadline=None)
@given(garbage=st.binary(max_size=200), bits=st.sampled_from([1, 4, 8, 16]))
def test_zstd_random_garbage_raises_or_decodes_count_symbols(garbage, bits):
    _decodes_or_raises(ZstdCodec(), garbage, bits, 100)
    _decodes_or_raises(ZstdCodec(), b"\x28\xb5\x2f\xfd" + garbage, bits, 100)  # zstd magic first


# ----------------------------------------------------------------------------- end to end


def _heavy_tailed(shape, seed):
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(shape, generator=g)
    chi2 = torch.randn((3, *shape), generator=g).pow(2).sum(0)
    return z / torch.sqrt(chi2 / 3.0)


@pytest.mark.parametrize("bits", [2, 4])
def test_end_to_end_through_policy_and_stream(bits):
    """KIVI-style policies with each codec: the same reconstruction as bitpack. (2 layers here to
    keep the file fast; the quantizer dominates the time.)"""
    kv = [(_heavy_tailed((1, 3, 1024, 64), 2 * i), _heavy_tailed((1, 3, 1024, 64), 2 * i + 1)) for i in range(2)]
    base = {
        "key": {"name": "uniform", "bits": bits, "granularity": "per_channel", "group_size": 32},
        "value": {"name": "uniform", "bits": bits, "granularity": "per_token", "group_size": 32},
    }
    bitpack_cfg = PolicyConfig.from_dict({**base, "codec": "bitpack"})
    bitpack_stream = encode_kv(kv, bitpack_cfg)
    reference = decode_kv(bitpack_stream)
    for codec in ({"name": "range", "model": "per_channel"}, {"name": "range", "model": "global", "coded_bits": 2},
                  {"name": "zstd", "level": 3}):
        cfg = PolicyConfig.from_dict({**base, "codec": codec})
        stream = encode_kv(kv, cfg)
        out = decode_kv(stream, expect=cfg)
        for (k, v), (k2, v2) in zip(reference, out):  # lossless codec: same reconstruction as bitpack
            assert torch.equal(k, k2) and torch.equal(v, v2)
        if codec["name"] == "range":  # heavy-tailed KIVI symbols are skewed: entropy coding pays
            assert len(stream) < len(bitpack_stream)
