"""Streams with a forged header and re-computed checksums must fail fast with a typed error.

The header checksum (BLAKE2b) and the final CRC32 catch accidents, not forgers: anyone can edit
the header JSON and recompute both (:func:`forge`). Every such stream must raise a
:class:`~kvtune.core.errors.KVStreamError` subclass -- never ``RecursionError``, ``OverflowError``,
``MemoryError``, ``ValueError``, ``IndexError`` or ``struct.error`` -- quickly and without a
large allocation, on the fast path and on the reference path.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import resource
import struct
import subprocess
import sys
import time
import tracemalloc
import zlib
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

from kvtune.codecs import PolicyConfig, decode_kv, encode_kv, read_header
from kvtune.codecs import policy as policy_module
from kvtune.codecs.base import BF16_BITS
from kvtune.codecs.fp8 import FP8Quantizer
from kvtune.codecs.mixhq import MixHQ
from kvtune.codecs.quantizers import UniformQuantizer
from kvtune.codecs.range_coder import RangeCodec
from kvtune.codecs.stream import write_stream
from kvtune.codecs.transforms import Affine, Delta, Hadamard
from kvtune.codecs.zstd_codec import ZstdCodec
from kvtune.core.errors import ConfigError, CorruptStreamError, KVInputError, KVStreamError

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SHAPE = (1, 2, 40, 32)
SCORES = ((0.1, 0.9), (0.8, 0.3))
BASES = {
    # two segments per key tensor (2-bit body, bf16 recent window)
    "kivi": PolicyConfig.kivi(2, recent_tokens=8),
    # transform state, bf16 anchors and windows, mixed-precision heads
    "segments": PolicyConfig(
        transforms=(Affine(shift=True), Delta(group_size=8, anchor_bits=BF16_BITS), Hadamard()),
        key=UniformQuantizer(bits=2, granularity="per_channel", group_size=16, sink_tokens=2, recent_tokens=4),
        value=MixHQ(head_scores=SCORES, fraction=0.5),
    ),
}
# the same policies with codecs that bound no symbol count by their payload bytes (no
# Codec.max_symbols): the range coder (its 2-bit KIVI payloads are range coded, kind 2) and zstd
BASES.update({
    "kivi-range": dataclasses.replace(BASES["kivi"], codec=RangeCodec()),
    "segments-range": dataclasses.replace(BASES["segments"], codec=RangeCodec(model="per_head")),
    "kivi-zstd": dataclasses.replace(BASES["kivi"], codec=ZstdCodec()),
    "segments-zstd": dataclasses.replace(BASES["segments"], codec=ZstdCodec()),
})
MAX_SECONDS = 5.0  # a hang guard, not a timing: real failures take milliseconds, the old code 9-29 s
# per case (the memory bound below is the real check; tracemalloc and a loaded 2-core machine
# can stretch a millisecond case to ~1 s)
MAX_TRACED_BYTES = 16 << 20  # Python + numpy allocations while decoding one forged stream


def base_stream(name: str) -> bytes:
    g = torch.Generator().manual_seed(5)
    kv = [(torch.randn(SHAPE, generator=g), torch.randn(SHAPE, generator=g)) for _ in range(2)]
    return encode_kv(kv, BASES[name])


# ----------------------------------------------------------------------------- forging


def _dumps(h: Any) -> bytes:
    return json.dumps(h, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode("ascii")


def forge(stream: bytes, edit: Callable[[dict], Any]) -> bytes:
    """``stream`` with its header JSON edited and both checksums recomputed.

    ``edit`` receives the parsed header and returns the new header: a JSON value (written as
    canonical JSON; when it is a dict whose policy changed, its ``policy_id`` is recomputed
    where this library can build the policy, as a careful forger would) or raw ``bytes``.
    The sections after the header are kept.
    """
    hlen = struct.unpack_from("<I", stream, 6)[0]
    header = json.loads(stream[10 : 10 + hlen])
    old_policy = json.dumps(header["policy"], sort_keys=True)
    new = edit(header)
    if isinstance(new, dict) and isinstance(new.get("policy"), dict) and json.dumps(new["policy"], sort_keys=True) != old_policy:
        try:
            new["policy_id"] = PolicyConfig.from_dict(new["policy"]).policy_id
        except (ConfigError, RecursionError):
            pass
    hjson = new if isinstance(new, bytes) else _dumps(new)
    head = stream[:6] + struct.pack("<I", len(hjson)) + hjson
    head += hashlib.blake2b(head, digest_size=4).digest()
    body = head + stream[14 + hlen : -4]
    return body + struct.pack("<I", zlib.crc32(body))


def written(shapes, sections, policy=None, dtype="float32", layer_offset=0) -> Callable[[bytes], bytes]:
    """A case whose stream is assembled by the stream writer itself (sections of zero bytes
    of the given lengths), for consistent but impossible headers."""
    policy = policy or BASES["kivi"].to_dict()

    def build(_: bytes) -> bytes:
        return write_stream(policy=policy, policy_id=PolicyConfig.from_dict(policy).policy_id, layer_offset=layer_offset,
                            dtype=dtype, shapes=shapes, sections=[([bytes(n) for n in k], [bytes(n) for n in v]) for k, v in sections])

    return build


def edit(path: tuple, value: Any) -> Callable[[bytes], bytes]:
    """A case setting ``header[path[0]][path[1]]... = value``."""

    def apply(h: dict) -> dict:
        node = h
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value
        return h

    return lambda stream: forge(stream, apply)


def text_edit(old: bytes, new: bytes) -> Callable[[bytes], bytes]:
    """A case replacing bytes of the canonical header text (JSON the encoder never writes)."""
    return lambda stream: forge(stream, lambda h: _dumps(h).replace(old, new, 1))


def raw(text: bytes) -> Callable[[bytes], bytes]:
    return lambda stream: forge(stream, lambda h: text)


def nested(depth: int, leaf: Any = 1) -> Any:
    value = leaf
    for _ in range(depth):
        value = [value]
    return value


K_SHAPE, V_SHAPE = ("shapes", 0, 0), ("shapes", 1, 1)
K_SECTIONS = ("sections", 0, 0)
HUGE_INTS = [200_000_000, 2**31, 2**40, 2**62, 2**63, 2**70, 10**30]
BAD_VALUES = [-1, 2.0, True, "2", None, [2], {"a": 1}]

CASES: dict[str, Callable[[bytes], bytes]] = {
    # nesting: deeper than Python's recursion limit, and merely deeper than any real header
    "nested-list-100k": raw(b"[" * 100_000 + b"]" * 100_000),
    "nested-dict-100k": raw(b'{"a":' * 100_000 + b"1" + b"}" * 100_000),
    "nested-policy-100k": text_edit(b'"policy":{', b'"policy":{"x":' + b"[" * 100_000 + b"]" * 100_000 + b","),
    "nested-head-scores-200": edit(("policy", "key"), {"name": "mixhq", "head_scores": nested(200)}),
    "nested-shape-dim": edit((*K_SHAPE, 1), nested(50, 2)),
    # header structure
    **{f"header-{i}": raw(t) for i, t in enumerate([b"[]", b"1", b'"x"', b"null", b"{}", b"", b"\xff\xfe", b'{"a":1}'])},
    "missing-key": lambda s: forge(s, lambda h: {k: v for k, v in h.items() if k != "dtype"}),
    "extra-key": edit(("extra",), 1),
    "duplicate-key": text_edit(b'"dtype":"float32",', b'"dtype":"float32","dtype":"float32",'),
    "whitespace": text_edit(b'"dtype":', b'"dtype": '),
    "nan-literal": text_edit(b'"shapes":[[[1,', b'"shapes":[[[NaN,'),
    "infinity-literal": text_edit(b'"shapes":[[[1,', b'"shapes":[[[Infinity,'),
    "float-overflow-literal": text_edit(b'"shapes":[[[1,', b'"shapes":[[[1e999,'),
    "huge-int-literal": text_edit(b'"shapes":[[[1,', b'"shapes":[[[' + b"9" * 5000 + b","),
    "non-ascii": text_edit(b'"dtype":"float32"', b'"dtype":"float\xc3\xa932"'),
    # dimensions: K and V heads, tokens, head_dim, batch
    **{f"k-heads-{v!r}": edit((*K_SHAPE, 1), v) for v in HUGE_INTS + BAD_VALUES + [0]},
    **{f"v-heads-{v!r}": edit((*V_SHAPE, 1), v) for v in [200_000_000, 2**63, -1, 0, True]},
    **{f"tokens-{v!r}": edit((*K_SHAPE, 2), v) for v in HUGE_INTS + BAD_VALUES + [0]},
    **{f"head-dim-{v!r}": edit((*K_SHAPE, 3), v) for v in HUGE_INTS + BAD_VALUES + [0]},
    **{f"batch-{v!r}": edit((*K_SHAPE, 0), v) for v in [200_000_000, 2**63, -1, 0, 1.0]},
    "shape-rank-3": edit(K_SHAPE, [1, 2, 40]),
    "shape-rank-5": edit(K_SHAPE, [1, 2, 40, 32, 1]),
    "shape-not-list": edit(K_SHAPE, "1x2x40x32"),
    # impossible but internally consistent headers (sections as the lengths say)
    "affine-state-of-2e8-heads": written([((1, 200_000_000, 0, 32), (1, 2, 0, 32))], [([64], [128])],
                                         policy=BASES["segments"].to_dict()),
    "2e8-heads-one-token": written([((1, 200_000_000, 1, 1), (1, 1, 1, 1))], [([0, 4, 1], [0, 4, 1])]),
    "2e8-tokens-one-head": written([((1, 1, 200_000_000, 1), (1, 1, 1, 1))], [([0, 4, 1], [0, 4, 1])]),
    "1000-layers-of-2e8-heads": written([((1, 200_000_000, 1, 1), (1, 1, 1, 1))] * 1000, [([0, 4, 1], [0, 4, 1])] * 1000),
    "zero-heads": written([((1, 0, 8, 32), (1, 0, 8, 32))], [([0], [0])]),
    "zero-head-dim": written([((1, 2, 8, 0), (1, 2, 8, 0))], [([0, 0, 0], [0, 0, 0])]),
    "zero-batch": written([((0, 2, 8, 32), (0, 2, 8, 32))], [([0, 0, 0], [0, 0, 0])]),
    "bf16-window-of-2e8-tokens": written([((1, 1, 200_000_000, 1), (1, 1, 1, 1))], [([0, 0, 2], [0, 4, 1])],
                                         policy=PolicyConfig.kivi(2, recent_tokens=2**40).to_dict()),
    # layers and layer offset
    "shapes-longer-than-sections": lambda s: forge(s, lambda h: {**h, "shapes": h["shapes"] + h["shapes"][:1]}),
    "no-layers-but-sections": lambda s: forge(s, lambda h: {**h, "shapes": []}),
    "layers-not-list": edit(("shapes",), {"0": 1}),
    **{f"layer-offset-{v!r}": edit(("layer_offset",), v) for v in [2**31, 2**63, 10**30, -1, 1.5, True, "0", None]},
    # policy fields (the policy id is recomputed by the forger)
    **{f"bits-{v!r}": edit(("policy", "key", "bits"), v) for v in [0, 9, 2.5, True, "2", 10**30, -1, None]},
    **{f"group-size-{v!r}": edit(("policy", "key", "group_size"), v) for v in [-1, 2**31, 10**40, 1e3, None]},
    **{f"recent-tokens-{v!r}": edit(("policy", "key", "recent_tokens"), v) for v in [2**40, 2**63, 10**30, -8]},
    "shallow-bf16-layers-2**62": edit(("policy", "key"), {"name": "uniform", "shallow_layers": 2**62, "shallow_bits": 16}),
    "unknown-quantizer": edit(("policy", "key", "name"), "uniform2"),
    "unknown-codec": edit(("policy", "codec"), {"name": "brotli"}),
    "mixhq-20k-heads": edit(("policy", "key"), {"name": "mixhq", "head_scores": [[0.5] * 20_000] * 2}),
    "policy-not-dict": edit(("policy",), [1, 2]),
    "policy-id-wrong": edit(("policy_id",), "0" * 12),
    **{f"policy-id-{i}": edit(("policy_id",), v) for i, v in enumerate(["zz", 123, "0" * 10_000, None])},
    # section lengths
    **{f"state-length-{v!r}": edit((*K_SECTIONS, 0), v) for v in [-1, 1.5, True, 10**30, 2**64, "0", None, 1]},
    **{f"payload-length-{v!r}": edit((*K_SECTIONS, 2), v) for v in [-1, 2**63, 10**30, 0]},
    "lengths-moved-between-sections": lambda s: forge(s, lambda h: (h["sections"][0][0].__setitem__(1, h["sections"][0][0][1] + 1),
                                                                   h["sections"][0][0].__setitem__(2, h["sections"][0][0][2] - 1), h)[-1]),
    "lengths-even-count": edit(K_SECTIONS, [0, 1]),
    "lengths-empty": edit(K_SECTIONS, []),
    "lengths-extra-segments": lambda s: forge(s, lambda h: (h["sections"][0][0].extend([0, 0]), h)[-1]),
    "lengths-not-list": edit(("sections", 0), 7),
    # dtype names
    **{f"dtype-{v!r}": edit(("dtype",), v) for v in ["float64", "", "FLOAT32", "int8", ["float32"], None, 16, {"float32": 1}]},
}

# consistent streams of empty tensors with huge head counts: they decode (to empty tensors)
# without planning or allocating anything per head
EMPTY_HUGE = {
    "empty-tensor-2e8-heads": ([((1, 200_000_000, 0, 32), (1, 2, 0, 32))], [([0], [0])], BASES["kivi"]),
    "empty-tensor-2e8-head-dim": ([((1, 2, 0, 200_000_000), (1, 2, 0, 32))], [([0], [0])], BASES["kivi"]),
    "empty-tensors-2e8-heads-hadamard-mixhq": ([((7, 200_000_000, 0, 64), (1, 200_000_000, 0, 64))], [([0], [0])],
                                              PolicyConfig(transforms=(Hadamard(),), key=BASES["segments"].value,
                                                           value=BASES["segments"].value)),
}


def _decode_fails_typed(stream: bytes, impl: str) -> BaseException:
    try:
        decode_kv(stream, impl=impl)
    except KVStreamError as exc:
        return exc
    except BaseException as exc:  # noqa: BLE001 - the point of the test
        pytest.fail(f"{type(exc).__name__} instead of a KVStreamError: {exc!s:.300}")
    pytest.fail("a forged stream decoded")


@pytest.fixture(scope="module")
def bases() -> dict[str, bytes]:
    out = {name: base_stream(name) for name in BASES}
    for stream in out.values():  # warm up both paths (compiled kernels, plan caches)
        decode_kv(stream, impl="fast")
        decode_kv(stream, impl="reference")
    return out


def test_forge_recomputes_both_checksums(bases):
    stream = bases["kivi"]
    same = forge(stream, lambda h: h)
    assert same == stream
    moved = forge(stream, lambda h: {**h, "layer_offset": 5})
    assert read_header(moved).layer_offset == 5
    assert [k.shape for k, _ in decode_kv(moved)] == [SHAPE, SHAPE]


def float16_sections(stream: bytes) -> list[tuple[int, str, str, int]]:
    """``(layer, "K" | "V", "transform state" | "metadata", byte offset)`` of every non-empty
    float16 section of ``stream``, in wire order."""
    h = read_header(stream)
    out, pos = [], h.header_nbytes
    for i, lengths in enumerate(h.sections):
        for name, lens in zip("KV", lengths):
            for j, n in enumerate(lens.flat()):  # state, then (metadata, payload) per segment
                if n and (j == 0 or j % 2):
                    out.append((i, name, "metadata" if j else "transform state", pos))
                pos += n
    return out


@pytest.mark.parametrize("impl", ["fast", "reference", "torch"])
@pytest.mark.parametrize("base", ["kivi", "segments", "kivi-range"])
@pytest.mark.parametrize("value", [b"\x00\x7e", b"\x00\x7c", b"\x00\xfc"], ids=["nan", "inf", "-inf"])
def test_nonfinite_float16_metadata_with_a_valid_crc_is_corrupt(bases, base, impl, value):
    """Scales, zero points and transform states are finite float16 in every stream an encoder
    writes; a forged NaN / inf (CRC recomputed) used to decode to NaN tensors on every path."""
    stream = bases[base]
    sections = float16_sections(stream)
    for layer, name, what, off in (sections[0], sections[-1]):
        forged = bytearray(stream)
        forged[off + 2 : off + 4] = value  # the section's second float16
        body = bytes(forged[:-4])
        with pytest.raises(CorruptStreamError, match=f"layer {layer} {name} has a NaN or inf float16 in its {what}"):
            decode_kv(body + struct.pack("<I", zlib.crc32(body)), impl=impl)
    if base == "segments":  # the affine state and the metadata are both covered
        assert {what for _, _, what, _ in sections} == {"transform state", "metadata"}


def bfloat16_payloads(stream: bytes) -> list[tuple[int, str, int, int]]:
    """``(layer, "K" | "V", byte offset, length)`` of every bfloat16 payload of a ``bitpack``
    stream of :data:`BASES` (the payloads after an empty metadata section: bfloat16 windows and
    anchors have no metadata, every other segment of these policies has), in wire order."""
    h = read_header(stream)
    out, pos = [], h.header_nbytes
    for i, lengths in enumerate(h.sections):
        for name, lens in zip("KV", lengths):
            flat = lens.flat()
            for j, n in enumerate(flat):  # state, then (metadata, payload) per segment
                if j and j % 2 == 0 and n and flat[j - 1] == 0:
                    out.append((i, name, pos, n))
                pos += n
    return out


@pytest.mark.parametrize("impl", ["fast", "reference", "torch"])
@pytest.mark.parametrize("base", ["kivi", "segments"])
@pytest.mark.parametrize("value", [b"\xc0\x7f", b"\x80\x7f", b"\x80\xff", b"\x81\xff"],
                         ids=["nan", "inf", "-inf", "-nan"])
def test_nonfinite_bfloat16_payload_with_a_valid_crc_is_corrupt(bases, base, impl, value):
    """bfloat16 windows and anchors hold finite values in every stream an encoder writes (it
    refuses NaN / inf input); a forged NaN / inf there (CRC recomputed) used to decode into the
    output on every path."""
    stream = bases[base]
    payloads = bfloat16_payloads(stream)
    assert len(payloads) >= 4 and {name for _, name, _, _ in payloads} == {"K", "V"}
    for layer, name, off, n in (payloads[0], payloads[-1]):
        forged = bytearray(stream)
        forged[off + n - 2 : off + n] = value  # the payload's last value
        body = bytes(forged[:-4])
        with pytest.raises(CorruptStreamError, match=f"layer {layer} ({name} )?.*NaN or inf (bfloat16 )?value in (its|a) payload"):
            decode_kv(body + struct.pack("<I", zlib.crc32(body)), impl=impl)
        largest = bytearray(stream)  # the largest finite bfloat16 (0x7F7F) still decodes
        largest[off + n - 2 : off + n] = b"\x7f\x7f"
        body = bytes(largest[:-4])
        assert all(bool(torch.isfinite(t).all()) for kv in decode_kv(body + struct.pack("<I", zlib.crc32(body)), impl=impl)
                   for t in kv) or base == "segments"  # undoing the transforms may overflow a huge value


@pytest.mark.parametrize("impl", ["fast", "reference", "torch"])
@pytest.mark.parametrize("fmt, scaled, symbols", [("e4m3", False, (0x7F, 0xFF)), ("e5m2", True, (0x7C, 0xFC, 0x7E, 0xFF))])
def test_nonfinite_float8_symbol_with_a_valid_crc_is_corrupt(fmt, scaled, symbols, impl):
    """float8 symbols are finite in every stream an encoder writes (values beyond the format's
    range saturate, NaN / inf input is refused): a forged NaN / inf symbol (CRC recomputed) used
    to decode into the output on every path. A saturated value still decodes."""
    fp8 = FP8Quantizer(format=fmt, scaled=scaled)
    g = torch.Generator().manual_seed(0)
    kv = [(torch.randn(SHAPE, generator=g) * 1e3, torch.randn(SHAPE, generator=g)) for _ in range(2)]
    stream = encode_kv(kv, PolicyConfig(key=fp8, value=fp8))
    h = read_header(stream)
    pos = h.header_nbytes + sum(h.sections[0][0].flat())  # layer 0 V: [state, metadata, payload]
    flat = h.sections[0][1].flat()
    at = pos + flat[0] + flat[1] + 7  # V's 8th symbol
    for sym in symbols:
        forged = bytearray(stream)
        forged[at] = sym
        body = bytes(forged[:-4])
        with pytest.raises(CorruptStreamError, match="layer 0 (V )?.*NaN or inf (float8 [a-z0-9]+ )?value in (its|a) payload"):
            decode_kv(body + struct.pack("<I", zlib.crc32(body)), impl=impl)
    k = decode_kv(stream, impl=impl)[0][0]  # unscaled e4m3 keys of ~1e3 saturate at +-448
    assert bool(torch.isfinite(k).all()) and (scaled or float(k.abs().max()) == 448.0)


@pytest.mark.parametrize("impl", ["fast", "reference"])
@pytest.mark.parametrize("base", list(BASES))
@pytest.mark.parametrize("case", list(CASES))
def test_forged_header_fails_fast_with_a_typed_error(bases, case, base, impl):
    stream = CASES[case](bases[base])
    tracemalloc.start()
    t0 = time.perf_counter()
    try:
        _decode_fails_typed(stream, impl)
        seconds = time.perf_counter() - t0
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert seconds < MAX_SECONDS, f"{seconds:.2f} s"
    assert peak < MAX_TRACED_BYTES + 4 * len(stream), f"{peak / 2**20:.1f} MiB traced"


@pytest.mark.parametrize("impl", ["fast", "reference"])
@pytest.mark.parametrize("case", list(EMPTY_HUGE))
def test_empty_tensors_with_huge_head_counts_decode_without_allocating(case, impl):
    shapes, sections, cfg = EMPTY_HUGE[case]
    stream = written(shapes, sections, policy=cfg.to_dict())(b"")
    tracemalloc.start()
    t0 = time.perf_counter()
    try:
        out = decode_kv(stream, impl=impl)
        seconds = time.perf_counter() - t0
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert [(tuple(k.shape), tuple(v.shape)) for k, v in out] == shapes
    assert all(k.numel() == v.numel() == 0 for k, v in out)
    assert seconds < MAX_SECONDS and peak < MAX_TRACED_BYTES


def _rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def run_all_cases() -> None:
    """Decode every forged stream once per path and print the peak-RSS growth in MiB (run in a
    fresh process by the test below: the allocator's high-water mark sees torch's memory too)."""
    for name in BASES:
        stream = base_stream(name)
        decode_kv(stream, impl="fast")
        decode_kv(stream, impl="reference")
    start = _rss_mib()
    for shapes, sections, cfg in EMPTY_HUGE.values():
        for impl in ("fast", "reference"):
            decode_kv(written(shapes, sections, policy=cfg.to_dict())(b""), impl=impl)
    for name in BASES:
        stream = base_stream(name)
        for case in CASES.values():
            for impl in ("fast", "reference"):
                try:
                    decode_kv(case(stream), impl=impl)
                except KVStreamError:
                    pass
    print(f"RSS-GROWTH-MIB {_rss_mib() - start:.1f}")


@pytest.mark.skipif(sys.platform != "linux", reason="ru_maxrss units and RLIMIT_AS as on Linux")
def test_forged_headers_never_allocate_much_memory():
    """Every case in a fresh process whose address space is capped at 2 GiB above its start:
    the peak RSS may grow by at most 128 MiB (a header claiming 2e8 heads used to allocate
    ~1.9 GB, one claiming 2e8 heads and no tokens 8 GiB)."""
    tests = Path(__file__).parent
    code = (
        "import resource, sys; sys.path.insert(0, %r)\n"
        "import torch; torch.set_num_threads(1)\n"
        "import test_stream_bounds as t\n"
        "vm = int(open('/proc/self/status').read().split('VmSize:')[1].split()[0]) * 1024\n"
        "hard = resource.getrlimit(resource.RLIMIT_AS)[1]\n"
        "cap = vm + (2 << 30) if hard == resource.RLIM_INFINITY else min(vm + (2 << 30), hard)\n"
        "resource.setrlimit(resource.RLIMIT_AS, (cap, hard))\n"
        "t.run_all_cases()\n" % str(tests)
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    growth = float(res.stdout.split("RSS-GROWTH-MIB")[1].split()[0])
    assert growth < 128, f"peak RSS grew by {growth:.0f} MiB"


def test_unconfirmed_plans_are_bounded_alike_on_encode_and_decode(monkeypatch):
    """Range-coded payloads declare no symbol count: a tensor's heads + tokens may exceed
    MAX_UNCONFIRMED_PLAN only with 8 per section byte, and the encoder refuses to write what the
    decoder would refuse (here with the limit lowered to 64: 4097 heads + tokens of a constant
    tensor code in 26 bytes per tensor, which allow 208)."""
    cfg = PolicyConfig(key=UniformQuantizer(bits=2, granularity="per_channel", group_size=0),
                       value=UniformQuantizer(bits=2, granularity="per_channel", group_size=0), codec=RangeCodec(model="global"))
    kv = [(torch.zeros(1, 1, 4096, 1), torch.ones(1, 1, 4096, 1))]
    stream = encode_kv(kv, cfg)
    assert all(torch.equal(a, b) for pair, ref in zip(decode_kv(stream), kv) for a, b in zip(pair, ref))
    monkeypatch.setattr(policy_module, "MAX_UNCONFIRMED_PLAN", 64)
    for impl in ("fast", "reference"):
        with pytest.raises(KVInputError, match=r"kv\[0\] K .* 1 heads \+ 4096 tokens; its 26 section bytes"):
            encode_kv(kv, cfg, impl=impl)
        with pytest.raises(CorruptStreamError, match="layer 0 K .* allow at most 208"):
            decode_kv(stream, impl=impl)
    monkeypatch.setattr(policy_module, "MAX_UNCONFIRMED_PLAN", 4097)
    assert len(decode_kv(stream)) == 1 and encode_kv(kv, cfg) == stream


def test_header_facts_are_remembered_per_header_text_and_failures_are_not():
    """A repeated header reuses its checks (one header object per repeated header text); a
    forged header of the same policy claiming more elements than its payloads hold is refused
    every time, also after a valid stream of that policy decoded."""
    kv = [(torch.randn(1, 2, 40, 16).to(torch.bfloat16), torch.randn(1, 2, 40, 16).to(torch.bfloat16)) for _ in range(2)]
    stream = encode_kv(kv, PolicyConfig.kivi(2))
    for _ in range(2):
        for pair, ref in zip(decode_kv(stream), decode_kv(stream, impl="reference")):
            assert all(torch.equal(a, b) for a, b in zip(pair, ref))
    assert read_header(stream).text is read_header(stream).text

    def claim_more(h):
        h["shapes"][0][0][2] *= 64  # layer 0 K claims 64x its tokens
        return h

    forged = forge(stream, claim_more)
    for _ in range(2):
        with pytest.raises(CorruptStreamError, match="layer 0 K"):
            decode_kv(forged)
