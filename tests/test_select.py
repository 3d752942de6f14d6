"""Token selection (``keep``, kvtune.codecs.select): the transform, the stream's selection block,
the three codec paths, and the decode side (positions of the tokens that follow a pruned cache)."""

from __future__ import annotations

import dataclasses
import math
import struct
import zlib

import numpy as np
import pandas as pd
import pytest
import torch

from kvtune.codecs import PolicyConfig, decode_kv, encode_kv, read_header
from kvtune.codecs import kept_positions
from kvtune.codecs.select import Keep, select_kv, window_attention
from kvtune.core.errors import ConfigError, CorruptStreamError, KVStreamError, TableError

pytestmark = pytest.mark.usefixtures("one_torch_thread")

KIVI4 = {"key": {"bits": 4, "granularity": "per_channel", "group_size": 32},
         "value": {"bits": 4, "granularity": "per_token", "group_size": 32}}


def policy(*transforms, **extra) -> PolicyConfig:
    return PolicyConfig.from_dict({"transforms": list(transforms), **KIVI4, **extra})


def make_kv(shapes, seed=0, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(*k, generator=g).to(dtype), torch.randn(*v, generator=g).to(dtype)) for k, v in shapes]


SHAPES = [((1, 2, 100, 64),) * 2, ((2, 3, 37, 32), (2, 3, 37, 16)), ((1, 2, 5, 64),) * 2, ((1, 2, 0, 64),) * 2]
KEEP_NORM = {"name": "keep", "fraction": 0.5, "score": "key-norm", "sink_tokens": 2, "recent_tokens": 4}
KEEP_WIN = {"name": "keep", "fraction": 0.6, "score": "window-attention", "window": 8, "recent_tokens": 8}


# ----------------------------------------------------------------------------- the transform


def test_kept_count_rounds_and_keeps_sink_and_recent():
    k = Keep(fraction=0.7, sink_tokens=4, recent_tokens=32)
    assert [k.kept_count(t) for t in (0, 10, 36, 40, 100, 1000, 1001)] == [0, 10, 36, 36, 70, 700, 701]
    assert Keep(fraction=1.0).kept_count(513) == 513


def test_key_norm_keeps_the_lowest_norm_keys_per_head_plus_sink_and_recent():
    keep = Keep(fraction=0.5, score="key-norm", sink_tokens=1, recent_tokens=1)
    k = torch.ones(1, 2, 10, 4)
    norms = torch.tensor([[9, 1, 8, 2, 7, 3, 6, 4, 5, 9], [0, 5, 4, 3, 2, 1, 9, 9, 9, 0]], dtype=torch.float32)
    k = k * norms[None, :, :, None]
    pos = keep.select(k)
    assert pos.tolist() == [[[0, 1, 3, 5, 9], [0, 3, 4, 5, 9]]]  # per head: sink 0, recent 9, lowest norms


def test_window_attention_keeps_the_tokens_the_window_attends_to():
    keep = Keep(fraction=0.5, score="window-attention", sink_tokens=0, recent_tokens=2, window=2)
    k = torch.zeros(1, 1, 20, 8)
    k[0, 0, 18:, 0] = 4.0  # the window's keys (proxy queries) point along channel 0
    k[0, 0, 10, 0] = 4.0  # so does token 10: it draws the window's attention
    pos = keep.select(k)[0, 0].tolist()
    assert len(pos) == 10 and {18, 19} <= set(pos)
    assert {8, 9, 10, 11, 12} <= set(pos)  # token 10 and its max-pooled neighbours (kernel 5)


def window_attention_float64(k: torch.Tensor, window: int) -> torch.Tensor:
    """The window-attention scores written out row by row in float64 (module docstring)."""
    k = k.double()
    tokens, d = k.shape[-2:]
    w = min(window, tokens)
    mass = torch.zeros(k.shape[:-1], dtype=torch.float64)
    for r in range(tokens - w, tokens):  # a window row sees tokens 0..r
        p = torch.softmax(k[..., r:r + 1, :] @ k[..., : r + 1, :].transpose(-1, -2) / d**0.5, dim=-1)[..., 0, :]
        mass[..., : r + 1] += p
    mass /= torch.tensor([w if t < tokens - w else tokens - t for t in range(tokens)], dtype=torch.float64)
    padded = torch.nn.functional.pad(mass, (2, 2), value=-math.inf)
    return torch.stack([padded[..., i:i + tokens] for i in range(5)]).amax(dim=0)


@pytest.mark.parametrize("shape, window", [((2, 3, 50, 16), 8), ((1, 2, 6, 8), 32), ((4, 7, 64), 64)])
def test_window_attention_scores_equal_the_float64_formula(shape, window):
    k = torch.randn(*shape, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    got = window_attention(k, window)
    assert got.dtype == torch.float32 and got.shape == shape[:-1]
    torch.testing.assert_close(got.double(), window_attention_float64(k, window), rtol=2e-6, atol=1e-9)
    stacked = window_attention(torch.stack([k, k.flip(-2)]), window)  # leading dims are independent
    torch.testing.assert_close(stacked[0], got, rtol=0, atol=0)
    torch.testing.assert_close(stacked[1], window_attention(k.flip(-2), window), rtol=0, atol=0)


def test_huge_keys_are_scored_in_float64_and_their_streams_decode():
    """Finite bfloat16 keys of 1e30: a float32 window product would overflow (NaN scores, and a
    selection without its sink tokens, which the decoder refuses)."""
    k = torch.randn(1, 2, 60, 64, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16) * 1e30
    got = window_attention(k, 16)
    assert got.dtype == torch.float64 and not bool(got.isnan().any())
    torch.testing.assert_close(got, window_attention_float64(k, 16), rtol=1e-12, atol=0)
    cfg = policy({"name": "keep", "fraction": 0.5, "window": 16}, key={"name": "none"}, value={"name": "none"})
    stream = encode_kv([(k, k)], cfg)
    assert torch.equal(kept_positions(stream).positions[0], Keep(fraction=0.5, window=16).select(k))
    assert decode_kv(stream)[0][0].shape == (1, 2, 36, 64)  # 30 kept, at least 4 sink + 32 recent


def test_a_huge_head_does_not_change_the_other_heads_scores():
    k = torch.randn(2, 1, 36, 5, generator=torch.Generator().manual_seed(6)).to(torch.bfloat16)
    mixed = torch.cat([k, torch.full_like(k, 1e30)], dim=1)  # head 1 is scored in float64
    got = window_attention(mixed, 8)
    assert got.dtype == torch.float64
    assert torch.equal(got[:, :1], window_attention(k, 8).double())  # head 0 as on its own, in float32
    keep = Keep(fraction=0.5, window=8, sink_tokens=0, recent_tokens=0)
    assert torch.equal(keep.select(mixed)[:, :1], keep.select(k))


def test_float64_keys_beyond_float64_products_are_scored_without_overflow():
    """float64 keys past ~1e154 (a direct call: encode_kv refuses float64 KV): their window
    products would overflow float64 too; the logits are formed from scaled keys. At such sizes
    the softmax is a hard max, the same as for the keys scaled by an exact power of two to 1e100."""
    k = torch.randn(2, 3, 50, 64, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    k = k / k.abs().amax()
    reference = window_attention(torch.ldexp(k, torch.tensor(330.0, dtype=torch.float64)), 8)  # ~2e99: float64 products
    for exp in (600, 900, 1023):
        got = window_attention(torch.ldexp(k, torch.tensor(float(exp), dtype=torch.float64)), 8)
        assert got.dtype == torch.float64 and bool(torch.isfinite(got).all())
        assert torch.equal(got, reference)
    mixed = k.clone()
    mixed[0, 0, 3, 5] = torch.finfo(torch.float64).max  # one head with the largest float64
    got = window_attention(mixed, 8)
    assert bool(torch.isfinite(got).all()) and float(got[0, 0, 3]) > 0
    assert torch.equal(got[1], window_attention(k, 8)[1].double())  # the other rows in float32, unchanged
    for window in (0, -1, 2.0, True):
        with pytest.raises(ValueError, match="window must be an integer >= 1"):
            window_attention(k, window)
    for bad in (math.inf, -math.inf, math.nan):  # a direct call with a non-finite key: NaN in its matrix only
        odd = k.clone()
        odd[0, 1, 4, 2] = bad
        got = window_attention(odd, 8)
        assert bool(got[0, 1].isnan().any()) and torch.equal(got[1], window_attention(k, 8)[1].to(got.dtype))


def test_nan_scores_rank_last_and_the_forced_tokens_stay():
    class NaNScores(Keep):
        def scores(self, k):
            s = torch.arange(k.shape[-2], dtype=torch.float32).expand(*k.shape[:-1]).clone()
            s[..., ::2] = math.nan
            return s

    pos = NaNScores(fraction=0.5, sink_tokens=1, recent_tokens=1).select(torch.zeros(1, 1, 10, 4))
    assert pos.tolist() == [[[0, 3, 5, 7, 9]]]  # sink 0, recent 9, then the best non-NaN scores 7, 5, 3


def test_selection_does_not_depend_on_the_codec_threads():
    from kvtune.codecs.threads import set_num_threads

    kv = make_kv([((1, 3, 300, 64),) * 2] * 6, seed=4)
    keep = Keep(fraction=0.6, window=32)
    try:
        runs = []
        for n in (1, 2):
            set_num_threads(n)
            runs.append(select_kv(kv, keep)[1])
    finally:
        set_num_threads(None)
    assert runs[0].masks == runs[1].masks and all(torch.equal(a, b) for a, b in zip(runs[0].positions, runs[1].positions))
    assert all(p.shape == (1, 3, 180) for p in runs[0].positions)


def test_keep_must_be_first_and_once():
    with pytest.raises(ConfigError, match="must be the first transform"):
        policy("hadamard", "keep")
    with pytest.raises(ConfigError, match="must be the first transform"):
        policy("keep", "keep")
    with pytest.raises(ConfigError, match="fraction"):
        policy({"name": "keep", "fraction": 0.0})
    assert policy("keep", "hadamard").transforms[0] == Keep()


def test_streams_without_keep_have_no_selection_block():
    """A policy without keep writes the header keys of before (tests/test_stream_golden.py pins
    its bytes); with keep, the header adds source_tokens and the id differs."""
    plain = policy("hadamard")
    kv = make_kv(SHAPES[:1])
    assert read_header(encode_kv(kv, plain)).source_tokens is None
    assert b"source_tokens" not in encode_kv(kv, plain)
    with_keep = policy(KEEP_NORM, "hadamard")
    assert read_header(encode_kv(kv, with_keep)).source_tokens == (100,)
    assert with_keep.policy_id != plain.policy_id


# ----------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("keep", [KEEP_NORM, KEEP_WIN], ids=["key-norm", "window"])
@pytest.mark.parametrize("rest", [[], ["hadamard"], [{"name": "delta", "group_size": 4, "anchor_bits": 8}]],
                         ids=["alone", "hadamard", "delta"])
def test_round_trip_shapes_positions_and_equal_bytes_on_every_path(keep, rest):
    cfg = policy(keep, *rest)
    kv = make_kv(SHAPES)
    streams = {impl: encode_kv(kv, cfg, layer_offset=2, impl=impl) for impl in ("reference", "fast", "torch")}
    assert streams["reference"] == streams["fast"] == streams["torch"]
    stream = streams["reference"]
    kept, sel = select_kv(kv, Keep.from_dict(keep))
    inner = dataclasses.replace(cfg, transforms=cfg.transforms[1:])
    # the kept tokens code exactly as the rest of the policy codes them on their own
    plain = decode_kv(encode_kv(kept, inner, layer_offset=2, impl="reference"))
    decoded = {impl: decode_kv(stream, expect=cfg, impl=impl) for impl in ("reference", "fast", "torch")}
    positions = kept_positions(stream)
    assert positions.source_tokens == [100, 37, 5, 0]
    keep_t = Keep.from_dict(keep)
    for i, ((k, v), (kk, kv_)) in enumerate(zip(kv, kept)):
        n = keep_t.kept_count(k.shape[2])
        assert kk.shape == (*k.shape[:2], n, k.shape[3]) and kv_.shape == (*v.shape[:2], n, v.shape[3])
        pos = positions.positions[i]
        assert pos.shape == (k.shape[0], k.shape[1], n)
        assert torch.equal(pos, keep_t.select(k).cpu())
        assert (pos.diff(dim=-1) > 0).all()  # original order
        assert torch.equal(kk, torch.gather(k, 2, pos[..., None].expand(-1, -1, -1, k.shape[3])))
        for impl, out in decoded.items():
            assert out[i][0].shape == kk.shape and out[i][1].shape == kv_.shape
            assert torch.equal(out[i][0], plain[i][0]) and torch.equal(out[i][1], plain[i][1]), impl
    h = read_header(stream)
    assert h.selection_nbytes == sum(b * hh * -(-t // 8) for (b, hh, _, _), t in
                                     [(s[0], t) for s, t in zip(SHAPES, [100, 37, 5, 0])])
    assert len(stream) == h.total_nbytes
    assert len(stream) < len(encode_kv(kv, inner, layer_offset=2))
    # decode into preallocated tensors of the kept shapes
    out = [(torch.empty_like(k), torch.empty_like(v)) for k, v in decoded["reference"]]
    for impl in ("reference", "fast"):
        into = decode_kv(stream, out=out, impl=impl)
        assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(into, decoded["reference"]))


def test_keeping_every_token_decodes_like_the_policy_without_keep():
    kv = make_kv(SHAPES[:2])
    inner = policy("hadamard")
    assert policy({"name": "keep", "fraction": 1.0}, "hadamard").policy_id == inner.policy_id  # the identity
    cfg = policy({"name": "keep", "fraction": 0.5, "recent_tokens": 100}, "hadamard")  # every token forced
    for (a, b), (c, d) in zip(decode_kv(encode_kv(kv, cfg)), decode_kv(encode_kv(kv, inner))):
        assert torch.equal(a, c) and torch.equal(b, d)
    assert [p[0, 0].tolist() for p in kept_positions(encode_kv(kv, cfg)).positions] == [list(range(100)), list(range(37))]
    assert kept_positions(encode_kv(kv, inner)) is None


def test_out_with_the_original_shapes_is_refused():
    kv = make_kv(SHAPES[:1])
    stream = encode_kv(kv, policy(KEEP_NORM))
    with pytest.raises(ValueError, match="shape"):
        decode_kv(stream, out=[(torch.empty_like(k), torch.empty_like(v)) for k, v in kv])


def test_ratio_estimate_counts_the_masks_exactly():
    from kvtune.evaluate.ratio import estimate_stream_bytes

    kv = make_kv([((1, 3, 200, 64),) * 2] * 5)
    for keep in (KEEP_NORM, KEEP_WIN):
        cfg = policy(keep, key={"bits": 4, "granularity": "per_channel", "group_size": 32, "recent_tokens": 16})
        assert estimate_stream_bytes(cfg, kv) == len(encode_kv(kv, cfg))


# ----------------------------------------------------------------------------- corrupt masks


def reseal(data: bytes) -> bytes:
    """Recompute the final CRC32 (a forged stream that passes the checksum)."""
    return data[:-4] + struct.pack("<I", zlib.crc32(data[:-4]))


@pytest.fixture(scope="module")
def selected_stream():
    return encode_kv(make_kv(SHAPES[:2]), policy(KEEP_NORM))


def mask_offset(stream: bytes) -> int:
    h = read_header(stream)
    return h.total_nbytes - h.checksum_nbytes - h.selection_nbytes


def test_flipped_mask_bit_fails_the_crc(selected_stream):
    bad = bytearray(selected_stream)
    bad[mask_offset(selected_stream) + 3] ^= 0x10
    with pytest.raises(CorruptStreamError, match="checksum"):
        decode_kv(bytes(bad))


@pytest.mark.parametrize("edit, match", [
    (lambda m: m.__setitem__(3, m[3] ^ 0x10), "keeps .* tokens in a row"),  # one bit more or less: popcount
    (lambda m: m.__setitem__(0, m[0] & 0xFE), "keeps .* tokens in a row"),  # sink dropped: popcount first
    (lambda m: (m.__setitem__(0, m[0] & 0xFE), m.__setitem__(5, m[5] | (0xFF ^ m[5]) & -(0xFF ^ m[5]))), "sink or recent"),
])
def test_forged_masks_are_corrupt_with_a_valid_crc(selected_stream, edit, match):
    data = bytearray(selected_stream)
    off = mask_offset(selected_stream)
    row = -(-100 // 8)
    mask = data[off : off + row]
    edit(mask)
    data[off : off + row] = mask
    forged = reseal(bytes(data))
    for impl in ("reference", "fast"):
        with pytest.raises(CorruptStreamError, match=match):
            decode_kv(forged, impl=impl)
    with pytest.raises(CorruptStreamError, match=match):
        kept_positions(forged)


def test_layers_of_one_geometry_are_checked_together_and_the_first_faulty_layer_is_named():
    kv = make_kv([((1, 2, 100, 64),) * 2] * 4, seed=3)
    stream = encode_kv(kv, policy(KEEP_NORM), layer_offset=3)
    keep = Keep.from_dict(KEEP_NORM)
    assert [p.tolist() for p in kept_positions(stream).positions] == [keep.select(k).tolist() for k, _ in kv]
    off, row = mask_offset(stream), -(-100 // 8)

    def forge(edits):  # {layer index in the stream: edit of its first head's mask bits}
        data = bytearray(stream)
        for i, edit in edits.items():
            at = off + i * 2 * row
            bits = np.unpackbits(np.frombuffer(bytes(data[at : at + row]), np.uint8), bitorder="little")
            edit(bits)
            data[at : at + row] = np.packbits(bits, bitorder="little").tobytes()
        return reseal(bytes(data))

    def popcount(bits):
        bits[50] ^= 1

    def sink(bits):  # the same popcount, the first sink token swapped for a dropped one
        dropped = int(np.nonzero(bits[:96] == 0)[0][0])
        bits[0], bits[dropped] = 0, 1

    for edits, match in (({2: popcount}, "layer 5 selection mask keeps .* tokens in a row"),
                         ({3: popcount, 1: sink}, "layer 4 selection mask drops a sink or recent token"),
                         ({0: sink, 1: popcount}, "layer 3 selection mask drops a sink")):
        forged = forge(edits)
        for impl in ("reference", "fast"):
            with pytest.raises(CorruptStreamError, match=match):
                decode_kv(forged, impl=impl)
        with pytest.raises(CorruptStreamError, match=match):
            kept_positions(forged)


def test_mask_bits_beyond_the_tokens_are_corrupt():
    kv = make_kv([((1, 1, 12, 8),) * 2])
    stream = encode_kv(kv, policy({"name": "keep", "fraction": 0.5, "score": "key-norm", "sink_tokens": 0,
                                   "recent_tokens": 0}, key={"name": "none"}, value={"name": "none"}))
    data = bytearray(stream)
    off = mask_offset(stream)
    bits = np.unpackbits(np.frombuffer(bytes(data[off : off + 2]), np.uint8), bitorder="little")
    first = int(np.nonzero(bits)[0][0])
    bits[first], bits[13] = 0, 1  # same popcount, one bit in the padding
    data[off : off + 2] = np.packbits(bits, bitorder="little").tobytes()
    with pytest.raises(CorruptStreamError, match="beyond its 12 tokens"):
        decode_kv(reseal(bytes(data)))


def test_shared_head_selection_keeps_one_choice_and_a_forged_per_head_mask_is_corrupt():
    kv = make_kv([((1, 2, 16, 8),) * 2])
    stream = encode_kv(kv, policy({"name": "keep", "fraction": 0.5, "score": "key-norm", "sink_tokens": 0,
                                   "recent_tokens": 0, "per_head": False}, key={"name": "none"}, value={"name": "none"}))
    pos = kept_positions(stream).positions[0]
    assert torch.equal(pos[:, 0], pos[:, 1])
    norms = kv[0][0].double().square().sum(-1).sum(1)[0]  # heads' scores summed: lowest summed norms kept
    assert pos[0, 0].tolist() == sorted(torch.argsort(norms)[:8].tolist())
    data = bytearray(stream)
    off = mask_offset(stream)
    bits = np.unpackbits(np.frombuffer(bytes(data[off + 2 : off + 4]), np.uint8), bitorder="little")  # head 1
    on, off_bit = int(np.nonzero(bits)[0][0]), int(np.nonzero(bits == 0)[0][0])
    bits[on], bits[off_bit] = 0, 1  # same popcount, another token than head 0
    data[off + 2 : off + 4] = np.packbits(bits, bitorder="little").tobytes()
    with pytest.raises(CorruptStreamError, match="other tokens in other heads"):
        decode_kv(reseal(bytes(data)))


def test_truncated_or_missing_selection_block():
    stream = encode_kv(make_kv(SHAPES[:1]), policy(KEEP_NORM))
    with pytest.raises(KVStreamError, match="truncated"):
        decode_kv(stream[:-10])
    with pytest.raises(KVStreamError, match="truncated"):  # cut and resealed: the lengths no longer add up
        decode_kv(reseal(stream[:-8] + stream[-4:]))


def forge_header(stream: bytes, edit, tail: bytes | None = None) -> bytes:
    """Rewrite the header JSON with ``edit`` and the selection block with ``tail`` (when given),
    with a valid header digest and CRC: a forged stream."""
    import hashlib
    import json

    from kvtune.core.jsonio import canonical_json

    _, hlen = struct.unpack_from("<HI", stream, 4)
    h = json.loads(stream[10 : 10 + hlen])
    body = stream[10 + hlen + 4 : -4] if tail is None else stream[10 + hlen + 4 : mask_offset(stream)] + tail
    edit(h)
    hjson = canonical_json(h).encode()
    head = b"KVTN" + struct.pack("<HI", 1, len(hjson)) + hjson
    head += hashlib.blake2b(head, digest_size=4).digest()
    return reseal(head + body + bytes(4))


@pytest.mark.parametrize("edit, tail, match", [
    (lambda h: h.pop("source_tokens"), b"", "selects tokens but the stream has no selection block"),
    (lambda h: h.__setitem__("source_tokens", [10**12]), None, "bad source_tokens"),
    (lambda h: h.__setitem__("source_tokens", [40]), None, "at most the 40 source tokens"),
    (lambda h: h.__setitem__("source_tokens", [98]), None, "50 tokens recorded, the policy keeps 49 of 98"),
    (lambda h: h.__setitem__("source_tokens", [120]), None, "truncated"),  # 15-byte mask rows: the stream is too short
    (lambda h: h.__setitem__("source_tokens", "x"), None, "bad source_tokens"),
    (lambda h: h["shapes"][0][1].__setitem__(2, 49), None, "must agree in batch, heads and tokens"),
])
def test_forged_source_tokens_are_corrupt(edit, tail, match):
    stream = encode_kv(make_kv(SHAPES[:1]), policy(KEEP_NORM))
    with pytest.raises(KVStreamError, match=match):
        decode_kv(forge_header(stream, edit, tail))


def test_a_structural_fault_of_a_later_layer_does_not_hide_an_earlier_layers_bit_fault():
    def fewer_tokens(h):  # layer 1 claims 14 source tokens (same 2-byte rows; the policy keeps 7, 8 recorded)
        h["source_tokens"][1] = 14

    def no_heads(h):  # layer 1 forged to 0 KV heads (so no mask)
        for kind in (0, 1):
            h["shapes"][1][kind][1] = 0

    for edit, layer1_mask in ((fewer_tokens, True), (no_heads, False)):
        for per_head in (True, False):
            stream = encode_kv(make_kv([((1, 2, 16, 32),) * 2] * 2), policy({**KEEP_NORM, "per_head": per_head}))
            off = mask_offset(stream)
            first = bytearray(stream[off : off + 4])  # layer 0's two rows of 2 bytes
            first[1] ^= 0x01  # token 8 flipped: a popcount fault in layer 0
            forged = forge_header(stream, edit, bytes(first) + (stream[off + 4 : -4] if layer1_mask else b""))
            for read in (lambda d: decode_kv(d, impl="reference"), lambda d: decode_kv(d, impl="fast"), kept_positions):
                with pytest.raises(CorruptStreamError, match="layer 0 selection mask keeps"):
                    read(forged)


def test_a_layer_without_batch_is_corrupt_and_layers_without_tokens_allocate_nothing():
    stream = encode_kv(make_kv([((1, 2, 16, 32),) * 2] * 2), policy(KEEP_NORM))

    def no_batch(h):
        for kind in (0, 1):
            h["shapes"][1][kind][0] = 0

    layer0 = stream[mask_offset(stream) : mask_offset(stream) + 4]  # layer 1's mask goes with its batch
    for read in (decode_kv, kept_positions):
        with pytest.raises(CorruptStreamError, match="layer 1 K shape .* has batch = 0"):
            read(forge_header(stream, no_batch, layer0))
    empty = encode_kv(make_kv([((1, 2, 0, 32),) * 2] * 2), policy(KEEP_NORM))

    def vast(h):  # 2**20 x 2**20 rows of 0 bytes: nothing to check, no array of that many rows
        for layer in (0, 1):
            for kind in (0, 1):
                h["shapes"][layer][kind][:2] = [2**20, 2**20]

    kept = kept_positions(forge_header(empty, vast))
    assert kept.source_tokens == [0, 0]
    assert [tuple(p.shape) for p in kept.positions] == [(2**20, 2**20, 0)] * 2


def test_kept_positions_checks_the_policy_against_its_id():
    stream = encode_kv(make_kv(SHAPES[:1]), policy(KEEP_NORM))

    def no_sinks(h):  # the policy edited, its id kept
        h["policy"]["transforms"][0]["sink_tokens"] = 0

    with pytest.raises(CorruptStreamError, match="is not the id"):
        kept_positions(forge_header(stream, no_sinks))


def test_selection_block_without_keep_is_corrupt():
    plain = encode_kv(make_kv(SHAPES[:1]), policy("hadamard"))
    forged = forge_header(plain, lambda h: h.__setitem__("source_tokens", [100]), bytes(26))
    with pytest.raises(CorruptStreamError, match="does not select tokens but the stream has a selection block"):
        decode_kv(forged)


# ----------------------------------------------------------------------------- serving


def test_serving_tables_refuse_keep_policies():
    from kvtune.serving import ServingPolicy
    from kvtune.serving.artifacts import selection_problem
    from kvtune.tables import compile_policy_table

    cfg = policy(KEEP_NORM)
    assert "selects tokens (keep)" in selection_problem(cfg) and selection_problem(policy("hadamard")) is None
    front = pd.DataFrame({
        "policy_id": [cfg.policy_id], "label": [cfg.label], "method": ["tqc"], "config_json": [cfg.to_json()],
        "relative_accuracy": [0.95], "compression_ratio": [3.0], "encode_gbps": [2.0], "decode_gbps": [2.0],
    })
    table = compile_policy_table(front, floors=[0.9], model="m", workload="w", device="cpu")
    with pytest.raises(TableError, match="selects tokens"):
        ServingPolicy.load(table, q_min=0.9)


# ----------------------------------------------------------------------------- decode side


@pytest.fixture(scope="module")
def one_head_lm(tmp_path_factory):
    """A tiny random Llama with one layer and one KV head: one selection per context, which a
    2-D attention mask over the full cache can express."""
    from conftest import make_tiny_llama
    from kvtune.evaluate.model import load_model

    return load_model(str(make_tiny_llama(tmp_path_factory.mktemp("one-head"), layers=1, kv_heads=1)), "cpu")


@torch.inference_mode()
def test_pruned_cache_continuation_equals_masking_the_dropped_tokens(one_head_lm):
    """The real expected value: the continuation on the kept cache (decoded from the stream) at
    positions T + i equals the continuation on the full cache with an attention mask hiding
    exactly the dropped tokens."""
    from kvtune.evaluate.capture import logits_on_cache
    from kvtune.evaluate.model import cache_to_kv, forward_cache, kv_to_cache

    lm = one_head_lm
    t, c = 40, 6
    ids = torch.randint(3, 200, (2, t + c), generator=torch.Generator().manual_seed(3))
    kv = [(k.clone(), v.clone()) for k, v in cache_to_kv(forward_cache(lm.model(input_ids=ids[:, :t], use_cache=True)))]
    cfg = policy({"name": "keep", "fraction": 0.5, "score": "window-attention", "sink_tokens": 2, "recent_tokens": 3,
                  "window": 4}, key={"name": "none"}, value={"name": "none"})
    streams = [encode_kv([(k[j : j + 1], v[j : j + 1]) for k, v in kv], cfg) for j in range(2)]  # one per context
    decoded = [decode_kv(s) for s in streams]
    short = [(torch.cat([d[0][0] for d in decoded]), torch.cat([d[0][1] for d in decoded]))]
    assert short[0][0].shape == (2, 1, 20, 16)
    got = logits_on_cache(lm, short, ids[:, t:], t, selected=True)
    mask = torch.zeros(2, t + c, dtype=torch.long)
    mask[:, t:] = 1
    for j, s in enumerate(streams):
        kept = kept_positions(s).positions[0][0, 0]
        assert kept.numel() == 20 and kept[:2].tolist() == [0, 1] and kept[-3:].tolist() == [37, 38, 39]
        mask[j, kept] = 1
    assert not torch.equal(mask[0], mask[1])  # each context keeps its own tokens
    full = [(k.bfloat16().float(), v.bfloat16().float()) for k, v in kv]  # the none quantizer's bf16 rounding
    cache = kv_to_cache(full, lm.model.config, context_tokens=t)
    want = lm.model(input_ids=ids[:, t:], cache=cache, attention_mask=mask, use_cache=True).logits.float()
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    # without the true positions (the cache length, kept + i, as RoPE positions) the logits differ
    plain = kv_to_cache([(k.clone(), v.clone()) for k, v in short], lm.model.config, context_tokens=20)
    wrong = lm.model(input_ids=ids[:, t:], cache=plain, use_cache=True).logits.float()
    err_right, err_wrong = (got - want).abs().max(), (wrong - want).abs().max()
    assert err_wrong > 1e-4 and err_wrong > 20 * err_right, (err_wrong, err_right)
    with pytest.raises(Exception, match="full-attention layer holds 20 positions"):
        kv_to_cache(short, lm.model.config, context_tokens=t)  # not marked as a selection: refused


def test_continuation_with_everything_kept_scores_like_no_selection(tiny_model_dir, tiny_text):
    """The evaluation of a keep that keeps every token + P equals that of P (same logits, same accuracy);
    the ratio pays only the masks; keep 0.5 changes the logits and shortens the stream."""
    from kvtune.evaluate.model import load_model
    from kvtune.evaluate.workloads import make_workload
    from kvtune.methods.tqc.settings import ProfileSettings

    lm = load_model(str(tiny_model_dir), "cpu")
    wl = make_workload("continuation", lm, settings=ProfileSettings(
        text=str(tiny_text), contexts=4, cheap_samples=4, context_tokens=48, continuation_tokens=8))
    base = policy("hadamard")
    every = policy({"name": "keep", "fraction": 0.5, "recent_tokens": 48}, "hadamard")  # all 48 tokens forced
    half = policy({"name": "keep", "fraction": 0.5, "recent_tokens": 8}, "hadamard")
    r0, r1, r2 = (wl.evaluate(c, fidelity="cheap") for c in (base, every, half))
    for key in ("relative_accuracy_raw", "kl_mean", "top1_agreement", "nll"):
        assert r1[key] == r0[key], key
    # per context: the longer header (keep in the policy, source_tokens) and 2 layers x 2 heads x 6 mask bytes
    h0, h1 = (read_header(encode_kv(wl.cap.context_kv(0), c)) for c in (base, every))
    assert h1.selection_nbytes == 2 * 2 * 6 and h1.payload_nbytes == h0.payload_nbytes
    assert r1["stream_bytes"] - r0["stream_bytes"] == 4 * (h1.header_nbytes - h0.header_nbytes + 24)
    assert r2["stream_bytes"] < 0.7 * r0["stream_bytes"] and r2["kl_mean"] != r0["kl_mean"]
    # after the shorter rows of keep 0.5, a policy that keeps every token decodes into whole rows again
    r3 = wl.evaluate(base, fidelity="cheap")
    for key in ("relative_accuracy_raw", "kl_mean", "top1_agreement", "nll", "stream_bytes"):
        assert r3[key] == r0[key], key


def test_keep_is_refused_on_sliding_window_models_and_other_workloads(tiny_gemma_dir, tiny_model_dir, tiny_text):
    from kvtune.evaluate.model import load_model
    from kvtune.evaluate.workloads.base import check_selection_fits

    cfg = policy(KEEP_NORM)
    gemma = load_model(str(tiny_gemma_dir), "cpu")
    with pytest.raises(ConfigError, match="sliding-window layers"):
        check_selection_fits(gemma, cfg, workload="continuation", supported=True)
    check_selection_fits(gemma, policy("hadamard"), workload="continuation", supported=True)  # others pass
    llama = load_model(str(tiny_model_dir), "cpu")
    with pytest.raises(ConfigError, match="does not evaluate token selection"):
        check_selection_fits(llama, cfg, workload="qa", supported=False)


def test_a_profile_leaves_out_the_keep_candidates_its_model_cannot_evaluate(tiny_gemma_dir, tiny_model_dir, tiny_text,
                                                                           tmp_path):
    """On a sliding-window model the default-like space keeps its other candidates (a run
    would otherwise fail on its first keep trial); on a llama every candidate stays."""
    from kvtune.evaluate.model import load_model
    from kvtune.evaluate.workloads import make_workload
    from kvtune.methods.tqc.profile import runnable_space
    from kvtune.methods.tqc.settings import ProfileSettings
    from kvtune.search.space import load_space

    path = tmp_path / "s.yaml"
    path.write_text("version: 2\nname: s\nfixed: {kv.name: uniform, codec: bitpack}\nparameters:\n"
                    "  kv.bits: [2, 4]\n  keep.fraction: {type: float, values: [0.5, 1.0]}\n")
    space = load_space(path)
    settings = ProfileSettings(text=str(tiny_text), contexts=2, cheap_samples=2, context_tokens=48, continuation_tokens=8)
    gemma = make_workload("continuation", load_model(str(tiny_gemma_dir), "cpu"), settings=settings)
    kept, why = runnable_space(space, gemma)
    assert len(space) == 4 and [c.config.transforms for c in kept.candidates] == [(), ()]
    assert len(why) == 1 and why[0].startswith("2 candidate(s) left out") and "sliding-window" in why[0]
    llama = make_workload("continuation", load_model(str(tiny_model_dir), "cpu"), settings=settings)
    assert runnable_space(space, llama) == (space, [])


def test_snapkv_like_preset_is_kivi4_behind_keep():
    from kvtune.codecs.presets import load_presets

    presets = load_presets(skip_unavailable=True)
    snap, kivi = presets["snapkv-like"], presets["kivi-4"]
    assert snap.transforms == (Keep(fraction=0.7, score="window-attention", sink_tokens=4, recent_tokens=32, window=32),)
    assert (snap.key, snap.value, snap.codec) == (kivi.key, kivi.value, kivi.codec)
    kv = make_kv([((1, 3, 1024, 64),) * 2])
    h = read_header(encode_kv(kv, snap))
    assert h.shapes[0][0] == (1, 3, 717, 64) and h.source_tokens == (1024,) and h.selection_nbytes == 3 * 128
