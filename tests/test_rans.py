"""Tests of the ``rans`` codec (kvtune.codecs.rans) and its kernels (kvtune.codecs.kernels.rans)."""

from __future__ import annotations

import dataclasses
import struct

import numpy as np
import pytest
import torch

from kvtune.codecs import PolicyConfig, decode_kv, encode_kv
from kvtune.codecs.base import CODECS, Codec
from kvtune.codecs.bitpack import packed_nbytes
from kvtune.codecs.quantizers import UniformQuantizer
from kvtune.codecs.rans import (
    KIND_RANS,
    KIND_RANS_V1,
    KIND_RANS_V2,
    KIND_RANS_V3,
    MAX_SYMBOLS_PER_BYTE,
    MAX_TABLE_MODELS,
    RansCodec,
    empirical_entropy_bits,
    encode_rans,
    layout_for_shape,
)
from kvtune.core.errors import CorruptStreamError, KVStreamError

MODELS = ("global", "per_head", "per_channel")


def laplace(shape, bits, seed=0, scale=None):
    """Discretized Laplace symbols centred mid-range (scale growing along the last axis)."""
    rng = np.random.default_rng(seed)
    k = 1 << bits
    d = shape[-1] if shape else 1
    s = scale if scale is not None else (0.5 + np.arange(d) / max(d - 1, 1)) * k / 8
    x = np.rint(k / 2 + rng.laplace(size=shape) * s)
    return np.clip(x, 0, k - 1).astype(np.uint8)


# ----------------------------------------------------------------------------- round trips


SHAPES = [(0,), (1,), (7,), (1, 3, 33, 5), (2, 3, 17, 64), (1, 2, 64, 64), (3, 1, 1)]


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("bits", range(1, 9))
def test_round_trip_matrix(model, bits):
    codec = RansCodec(model=model)
    for i, shape in enumerate(SHAPES):
        x = laplace(shape, bits, seed=i)
        data = codec.pack(x, bits)
        assert np.array_equal(codec.unpack(data, bits, x.size, shape=shape), x.reshape(-1)), shape
        assert len(data) <= 1 + packed_nbytes(x.size, bits)
        if x.size:  # the rANS form itself, even where raw is smaller
            forced = encode_rans(x, bits, model)
            assert forced[0] == KIND_RANS
            assert np.array_equal(codec.unpack(forced, bits, x.size, shape=shape), x.reshape(-1)), shape
    x16 = np.arange(100, dtype=np.uint16).reshape(1, 1, 10, 10)
    assert np.array_equal(codec.unpack(codec.pack(x16, 16), 16, 100), x16.reshape(-1))


def test_registered_deterministic_and_torch_input():
    assert CODECS["rans"] is RansCodec
    assert Codec.from_dict({"name": "rans", "model": "per_head"}) == RansCodec(model="per_head")
    x = laplace((1, 3, 64, 64), 4)
    assert RansCodec().pack(torch.from_numpy(x), 4) == RansCodec().pack(x, 4) == RansCodec().pack(x.copy(), 4)


def test_fusion_follows_the_run_length():
    assert layout_for_shape("per_channel", 2, (1, 3, 8, 64)).m == 4
    assert layout_for_shape("per_channel", 2, (1, 3, 8, 6)).m == 3
    assert layout_for_shape("per_channel", 4, (1, 3, 8, 5)).m == 1
    assert layout_for_shape("per_head", 1, (1, 3, 8, 6)).m == 8
    assert layout_for_shape("global", 3, (7,)).m == 1


# ----------------------------------------------------------------------------- size


def test_size_close_to_entropy_on_a_skewed_distribution():
    """p = (0.7, 0.2, 0.07, 0.03) over 2-bit symbols: H = 1.2449 bits; 200,000 symbols code
    within 0.8 % of their empirical entropy (31.1 KB): tables, header and the 32 lane states of a
    run of 50,000 super-symbols (128 bytes, 0.41 %) included."""
    rng = np.random.default_rng(1)
    x = rng.choice(4, p=[0.7, 0.2, 0.07, 0.03], size=(1, 1, 3125, 64)).astype(np.uint8)
    data = RansCodec(model="global").pack(x, 2)
    h = empirical_entropy_bits(x, 2, "global")
    assert abs(h / x.size - 1.2449) < 0.005
    assert h <= 8 * len(data) < 1.008 * h, 8 * len(data) / h


def test_constant_tensor_is_padded_to_bound_its_symbols():
    x = np.full((1, 2, 4096, 64), 3, np.uint8)
    data = RansCodec(model="per_head").pack(x, 2)
    assert data[0] == KIND_RANS
    assert x.size <= MAX_SYMBOLS_PER_BYTE * len(data) < x.size + 3 * MAX_SYMBOLS_PER_BYTE
    assert RansCodec().max_symbols(data) == MAX_SYMBOLS_PER_BYTE * len(data)
    assert np.array_equal(RansCodec(model="per_head").unpack(data, 2, x.size), x.reshape(-1))


@pytest.mark.real_model
@pytest.mark.parametrize("bits", [2, 4])
def test_real_kivi_symbols_within_1_percent_of_entropy(real_capture, bits):
    """KIVI keys (per-channel groups of 32) of real SmolLM2 KV, layers 0/10/20 of 4 contexts of
    512 tokens: the per-channel packed size (tables included) is within 1 % of the per-channel
    empirical entropy of the symbols."""
    q = UniformQuantizer(bits=bits, granularity="per_channel", group_size=32)
    total, entropy = 0, 0.0
    for layer in (0, 10, 20):
        x = q.quantize_block(real_capture.kv[layer][0].float())[0].numpy()
        data = RansCodec().pack(x, bits)
        assert np.array_equal(RansCodec().unpack(data, bits, x.size, shape=x.shape), x.reshape(-1))
        total += 8 * len(data)
        entropy += empirical_entropy_bits(x, bits, "per_channel")
    assert entropy < total < 1.01 * entropy, total / entropy


# ----------------------------------------------------------------------------- corruption


def sample(model="per_channel", bits=4):
    x = laplace((1, 2, 64, 64), bits, seed=5)
    return x, encode_rans(x, bits, model)


@pytest.mark.parametrize("model", MODELS)
def test_truncated_or_extended_data_raises(model):
    x, data = sample(model)
    codec = RansCodec(model=model)
    for cut in range(len(data)):
        with pytest.raises(CorruptStreamError):
            codec.unpack(data[:cut], 4, x.size, shape=x.shape)
    with pytest.raises(CorruptStreamError):
        codec.unpack(data + b"\x01\x00", 4, x.size, shape=x.shape)


@pytest.mark.parametrize("model", MODELS)
def test_bit_flips_raise_or_decode_count_symbols(model):
    """Every flip in the header and table fails the header CRC or a check; a flip in the coder
    words makes a lane end off its start state (almost always) and never crashes."""
    x, data = sample(model)
    codec = RansCodec(model=model)
    wrong = 0
    for i in range(len(data)):
        bad = bytearray(data)
        bad[i] ^= 1 << (i % 8)
        try:
            y = codec.unpack(bytes(bad), 4, x.size, shape=x.shape)
        except KVStreamError:
            continue
        assert y.shape == (x.size,)
        wrong += 1
    assert wrong <= 0.01 * len(data), wrong


def test_wrong_count_model_or_shape_raises():
    x, data = sample()
    with pytest.raises(CorruptStreamError):
        RansCodec().unpack(data, 4, x.size - 64)
    with pytest.raises(CorruptStreamError):
        RansCodec(model="per_head").unpack(data, 4, x.size)
    with pytest.raises(CorruptStreamError):
        RansCodec().unpack(data, 4, x.size, shape=(1, 2, 128, 32))
    with pytest.raises(CorruptStreamError):
        RansCodec().unpack(data, 3, x.size)


def test_forged_huge_count_is_refused_before_allocating():
    x, data = sample()
    with pytest.raises(CorruptStreamError, match="cannot hold"):
        RansCodec().unpack(data, 4, 2**40)
    # a forged payload claiming 2**40 symbols through a layout: refused by the byte bound first
    forged = bytearray(data)
    struct.pack_into("<I", forged, 3, 2**31)
    with pytest.raises(CorruptStreamError):
        RansCodec().unpack(bytes(forged), 4, 2**40)


def test_stream_header_claiming_more_than_the_payloads_bound_is_refused():
    kv = [(torch.randn(1, 2, 64, 64), torch.randn(1, 2, 64, 64))]
    cfg = dataclasses.replace(PolicyConfig.kivi(2), codec=RansCodec())
    stream = encode_kv(kv, cfg)
    out = decode_kv(stream)
    assert out[0][0].shape == (1, 2, 64, 64)
    from kvtune.codecs.policy import sections_problem
    from kvtune.codecs.stream import read_stream

    header, sections = read_stream(stream)
    assert sections_problem((1, 2, 64, 64), sections[0][0], cfg.codec) is None
    assert sections_problem((1 << 20, 2, 1 << 14, 64), sections[0][0], cfg.codec) is not None


@pytest.mark.parametrize("bits", [2, 4])
def test_end_to_end_through_policy_and_stream(bits):
    g = torch.Generator().manual_seed(0)
    kv = [(torch.randn(1, 3, 100, 64, generator=g), torch.randn(1, 3, 100, 64, generator=g)) for _ in range(2)]
    base = PolicyConfig.kivi(bits)
    ref = decode_kv(encode_kv(kv, base))
    for model in MODELS:
        cfg = dataclasses.replace(base, codec=RansCodec(model=model))
        stream = encode_kv(kv, cfg)
        assert len(stream) < len(encode_kv(kv, base))
        for (k, v), (k2, v2) in zip(decode_kv(stream), ref):
            assert torch.equal(k, k2) and torch.equal(v, v2)


@pytest.mark.parametrize("model", MODELS)
def test_payloads_of_the_previous_lane_formats_still_decode(model):
    """Kind 4 (4 lanes for every run, before 2026-12-03) and kind 5 (32 lanes for runs of
    32,768 super-symbols or more) decode as before. On a long run kinds 5 and 6 take 32 lanes
    (the same words; kind 6 says so in the form byte's bit 5) and kind 4 differs by the 56 more
    state words of each long run at most."""
    x = laplace((1, 3, 2048, 64), 2, seed=5)  # 98,304 super-symbols of 4 fused 2-bit symbols
    new, v3, old = (encode_rans(x, 2, model, kind=k) for k in (KIND_RANS, KIND_RANS_V3, KIND_RANS_V2))
    assert (new[0], v3[0], old[0]) == (KIND_RANS, KIND_RANS_V3, KIND_RANS_V2) and new[1:] != old[1:]
    assert new[1] == v3[1] | 32 and len(new) == len(v3) and new[-4:] == v3[-4:]  # the words' CRC: the same words
    assert 0 < len(new) - len(old) <= 2 * 56
    for data in (new, v3, old):
        assert np.array_equal(RansCodec(model=model).unpack(data, 2, x.size, shape=x.shape), x.reshape(-1))
    with pytest.raises(ValueError, match="writes kind"):
        encode_rans(x, 2, model, kind=KIND_RANS_V1)


def test_short_runs_of_many_bits_take_32_lanes():
    """Kind 6 codes a run shorter than 32,768 super-symbols on 32 lanes when its estimated size
    makes the extra states cost at most 1 % (8-bit CacheGen-like anchors: at most the 112 bytes
    of 28 more states than kind 5's 4 lanes, less the words their higher bits save; under 1 %
    of the payload); a run of few bits keeps 4 lanes (the same words as kind 5). A form byte
    whose bit 5 is flipped fails the header CRC."""
    rng = np.random.default_rng(6)
    anchors = np.clip(rng.normal(128, 40, size=(1, 3, 103, 64)), 0, 255).astype(np.uint8)
    for x, bits, wide in ((anchors, 8, True), (laplace((1, 3, 103, 64), 2, seed=6), 2, False)):
        new, v3 = encode_rans(x, bits, "per_channel"), encode_rans(x, bits, "per_channel", kind=KIND_RANS_V3)
        assert bool(new[1] & 32) == wide
        if wide:
            assert 0 < len(new) - len(v3) <= 112 and len(new) - len(v3) < 0.01 * len(v3)
        else:  # the same words (their CRC ends the payload); the header CRC covers the kind byte
            assert new[1] == v3[1] and len(new) == len(v3) and new[-4:] == v3[-4:]
        for data in (new, v3):
            assert np.array_equal(RansCodec().unpack(data, bits, x.size, shape=x.shape), x.reshape(-1))
        forged = bytearray(new)
        forged[1] ^= 32
        with pytest.raises(CorruptStreamError, match="header checksum mismatch"):
            RansCodec().unpack(bytes(forged), bits, x.size, shape=x.shape)


def test_a_changed_coder_word_fails_its_checksum():
    """Kinds 5 and 6 end with the CRC32 of its coder words: a flipped bit anywhere in them (or in the
    CRC) raises, where rANS alone often decodes a few wrong symbols with every lane ending well."""
    x = np.random.default_rng(4).choice(4, p=[0.7, 0.2, 0.07, 0.03], size=(1, 3, 2048, 64)).astype(np.uint8)
    data = RansCodec().pack(x, 2)
    assert data[0] == KIND_RANS
    for at in range(len(data) - 2000, len(data), 37):
        forged = bytearray(data)
        forged[at] ^= 1 << (at % 8)
        with pytest.raises(CorruptStreamError, match="coder words checksum mismatch"):
            RansCodec().unpack(bytes(forged), 2, x.size, shape=x.shape)
    with pytest.raises(CorruptStreamError, match="ends inside the coder words checksum"):
        RansCodec().unpack(data[:-2], 2, x.size, shape=x.shape)


def test_per_group_tables_are_bounded_before_the_decoder_builds_them():
    """A layout of more than MAX_TABLE_MODELS fused models (here 5,000 heads) is coded with the
    pooled table; a header that claims per-group tables for it (header CRC recomputed) is
    refused before 5,000 x 8 KiB of decoder tables are allocated."""
    import struct
    import zlib

    x = np.random.default_rng(5).choice(4, p=[0.6, 0.3, 0.05, 0.05], size=(1, MAX_TABLE_MODELS + 904, 4, 8)).astype(np.uint8)
    data = encode_rans(x, 2, "per_head")
    assert data[1] & 16  # pooled
    assert np.array_equal(RansCodec(model="per_head").unpack(data, 2, x.size, shape=x.shape), x.reshape(-1))
    nhist = struct.unpack_from("<H", data, 11)[0] + 1
    nt = struct.unpack_from("<I", data, 13 + 4 * nhist)[0]
    crc_at = 17 + 4 * nhist + 2 * nt
    head = bytearray(data[:crc_at])
    head[1] &= ~16  # claim per-group tables
    crc = zlib.crc32(bytes(head), zlib.crc32(x.size.to_bytes(8, "little") + bytes([2])))
    forged = bytes(head) + struct.pack("<I", crc) + data[crc_at + 4 :]
    with pytest.raises(CorruptStreamError, match=f"per-group table of {x.shape[1]} fused models exceeds {MAX_TABLE_MODELS}"):
        RansCodec(model="per_head").unpack(forged, 2, x.size, shape=x.shape)


def test_payloads_of_the_15_bit_format_are_refused_with_a_version_error():
    """Kind 3 (15-bit tables, before 2026-12-02) stops the decode with the typed version error,
    through the codec and through decode_kv on both paths (the stream's checksums valid)."""
    import zlib

    from kvtune.codecs.stream import read_header
    from kvtune.core.errors import StreamVersionError

    x = np.random.default_rng(3).choice(4, p=[0.7, 0.2, 0.07, 0.03], size=(1, 2, 64, 16)).astype(np.uint8)
    data = RansCodec().pack(x, 2)
    assert data[0] == KIND_RANS
    with pytest.raises(StreamVersionError, match="15-bit table format"):
        RansCodec().unpack(bytes([KIND_RANS_V1]) + data[1:], 2, x.size, shape=x.shape)
    cfg = PolicyConfig.from_dict({"key": {"name": "uniform", "bits": 2, "granularity": "per_channel"},
                                  "value": {"name": "uniform", "bits": 2}, "codec": {"name": "rans"}})
    g = torch.Generator().manual_seed(0)
    kv = [(torch.randn(1, 2, 256, 64, generator=g), torch.randn(1, 2, 256, 64, generator=g))]
    stream = bytearray(encode_kv(kv, cfg))
    h = read_header(bytes(stream))
    at = h.header_nbytes + sum(h.sections[0][0].flat()[:2])
    assert stream[at] == KIND_RANS
    stream[at] = KIND_RANS_V1
    stream[-4:] = zlib.crc32(bytes(stream[:-4])).to_bytes(4, "little")
    for impl in ("fast", "reference"):
        with pytest.raises(StreamVersionError, match="15-bit table format"):
            decode_kv(bytes(stream), impl=impl)


def _fields(data: bytes, model: str) -> dict:
    """Byte offsets of a rANS payload's fields (the module doc's wire layout)."""
    nd = {"per_channel": 1, "per_head": 2, "global": 0}[model]
    at = 3 + 4 * nd
    nhist = struct.unpack_from("<H", data, at)[0] + 1
    nt_at = at + 2 + 4 * nhist
    nt = struct.unpack_from("<I", data, nt_at)[0]
    crc_at = nt_at + 4 + 2 * nt
    return {"dims": 3, "nhist": at, "hist": at + 2, "nt": nt_at, "crc": crc_at, "nw": crc_at + 4}


def _reseal(data: bytearray, model: str, count: int, bits: int) -> bytes:
    """``data`` with its header CRC recomputed (a forged header that passes the CRC)."""
    import zlib

    try:
        at = _fields(bytes(data), model)["crc"]
    except struct.error:
        return bytes(data)
    if at + 4 > len(data):
        return bytes(data)
    data[at : at + 4] = struct.pack("<I", zlib.crc32(bytes(data[:at]), zlib.crc32(count.to_bytes(8, "little") + bytes([bits]))))
    return bytes(data)


@pytest.mark.parametrize("model", MODELS)
def test_the_payload_kernel_accepts_exactly_what_the_codec_accepts(model):
    """The fast path's one-call decoder (``kernels.rans_unpack_payload``) leaves error messages to
    the codec, so it must refuse exactly the payloads ``RansCodec.unpack_into`` refuses and decode
    the others to the same symbols: real payloads of kinds 6, 5 and 4 and raw ones, truncated or
    extended, with every byte flipped, and with forged header fields whose CRC is recomputed
    (form byte, fusion, dims, histogram length and counts, word counts)."""
    from kvtune.codecs import kernels as K
    from kvtune.codecs.rans import tensor_program

    codec = RansCodec(model=model)
    cases = []
    for bits, shape, kind in ((4, (1, 2, 64, 64), KIND_RANS), (2, (1, 3, 40, 32), KIND_RANS_V3), (3, (2, 2, 24, 16), KIND_RANS_V2),
                              (8, (1, 1, 8, 16), KIND_RANS)):
        x = laplace(shape, bits, seed=bits)
        cases.append((bits, x, encode_rans(x, bits, model, kind=kind)))
    x8 = np.random.default_rng(1).integers(0, 256, size=(1, 1, 8, 16), dtype=np.uint8)
    cases.append((8, x8, codec.pack(x8, 8)))  # stored raw
    x16 = np.random.default_rng(2).integers(0, 65536, size=(1, 1, 4, 8), dtype=np.uint16)
    cases.append((16, x16, codec.pack(x16, 16)))
    checked = accepted = 0
    for bits, x, data in cases:
        count = x.size
        prog = tensor_program(model, [(bits, x.shape, 0)])
        rows, (pool, model_id, limits, grid16) = prog.args[0], prog.decode_args
        dims = pool[rows[0, K.PR_DIMS] : rows[0, K.PR_DIMS] + rows[0, K.PR_NDIMS]]
        size = 2 * count if bits == 16 else count
        variants = [data[:cut] for cut in range(len(data))] + [data + b"\x00\x00", data + b"\x01"]
        for i in range(len(data)):
            bad = bytearray(data)
            bad[i] ^= 1 << (i % 8)
            variants.append(bytes(bad))
        if data[0] != 0:
            f = _fields(data, model)
            edits = [(1, v) for v in range(256)] + [(2, v) for v in range(10)] + [(0, v) for v in (3, 4, 5, 6, 7)]
            edits += [(f["dims"] + j, v) for j in range(4 * (3 if model == "per_head" else 1)) for v in (0, 1, 2, 255)]
            edits += [(f["nhist"], v) for v in (0, 1, 2, 255)] + [(f["hist"] + j, v) for j in (0, 4, 8) for v in (0, 1, 255)]
            edits += [(f["nt"], v) for v in (0, 1, 255)] + [(f["nw"], v) for v in (0, 1, 255)]
            for at, v in edits:
                if at < len(data):
                    bad = bytearray(data)
                    bad[at] = v
                    variants.append(_reseal(bad, model, count, bits))
        for v in variants:
            want = np.zeros(size, np.uint8)
            try:
                codec.unpack_into(v, bits, count, want, shape=x.shape)
                ok = True
            except KVStreamError:
                ok = False
            got = np.zeros(size, np.uint8)
            assert K.rans_unpack_payload(np.frombuffer(v, np.uint8), bits, count, model_id, dims, limits, grid16, got) == ok, v[:8]
            assert not ok or np.array_equal(got, want)
            checked += 1
            accepted += ok
    assert checked > 3000 and accepted > len(cases)  # some forged payloads are valid (e.g. another table form byte)


@pytest.mark.parametrize("model, shape", [("per_channel", (1, 1, 2, 65537)), ("per_head", (1, 65537, 1, 2))])
def test_symbols_whose_table_would_exceed_the_decoder_limit_are_stored_raw(model, shape):
    """More than 2**24 groups x symbols (8-bit symbols of a head_dim beyond 65,536, per channel,
    or of more than 65,536 heads, per head): the decoder refuses such a table, so the encoder
    stores the symbols raw, and the stream decodes (the codec and the fast path's kernels)."""
    from kvtune.codecs import kernels as K
    from kvtune.codecs.rans import table_fits, tensor_program

    x = laplace(shape, 8, seed=1)
    assert not table_fits(model, 8, shape) and table_fits(model, 7, shape)
    codec = RansCodec(model=model)
    data = codec.pack(x, 8)
    assert data[0] == 0 and len(data) == 1 + x.size
    assert np.array_equal(codec.unpack(data, 8, x.size, shape=shape), x.reshape(-1))
    prog = tensor_program(model, [(8, shape, 0)])
    pay = np.zeros(prog.payload_nbytes, np.uint8)
    lengths = np.zeros(1, np.int64)
    assert K.rans_pack_segments(x.reshape(-1), *prog.args, pay, lengths) == 0 and pay.tobytes() == data
    with pytest.raises(CorruptStreamError, match="table limit"):  # a rANS payload is refused, as before
        codec.unpack(encode_rans(x, 8, model), 8, x.size, shape=shape)
