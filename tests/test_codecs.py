"""Tests of the codec library: every registered transform x quantizer x codec, the wire format.

Inputs are synthetic heavy-tailed tensors (Student-t, 3 degrees of freedom, with a few outlier
channels scaled x20, as keys have); tests on real model KV live elsewhere. Presets are tested in
``test_presets.py``.
"""

from __future__ import annotations

import dataclasses

import hashlib
import importlib
import math
import re
import struct
import zlib

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
from kvtune.codecs import fastpath
from kvtune.codecs.base import BF16_BITS, plan_segments
from kvtune.codecs.bitpack import pack_bits, unpack_bits
from kvtune.codecs.codebook import CodebookQuantizer
from kvtune.codecs.fp8 import FP8Quantizer
from kvtune.codecs.bitalloc import DPAlloc
from kvtune.codecs.mixhq import MixHQ, rank_heads
from kvtune.codecs.pca import PCA, RopeSpec, fit_pca_basis, register_basis
from kvtune.codecs.rans import RansCodec
from kvtune.codecs.policy import apply_transforms, invert_transforms, transform_min_bits
from kvtune.codecs.presets import load_presets
from kvtune.codecs.select import Keep, select_kv, selecting_transform
from kvtune.codecs.stream import check_checksum, read_stream, stream_checksum, write_stream
from kvtune.codecs.transforms import (
    Affine,
    Delta,
    block_hadamard_matrix,
    delta_decode,
    delta_encode,
    power_of_two_blocks,
    random_signs,
)
from kvtune.core.errors import (
    ConfigError,
    CorruptStreamError,
    KVInputError,
    KVStreamError,
    PolicyMismatchError,
    StreamVersionError,
    TruncatedStreamError,
)

# Codec modules written alongside this library: tested here as soon as they exist, so that the
# registry (and the completeness check below) does not depend on test collection order.
for _module in ("kvtune.codecs.range_coder", "kvtune.codecs.zstd_codec", "kvtune.codecs.rans"):
    try:
        importlib.import_module(_module)
    except ImportError:
        pass


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # small tensors / tiny models


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
# a single token, and an empty layer; encoded at layer_offset 3 (layers 3..6)
MATRIX_SHAPES = [
    ((1, 2, 100, 64), (1, 2, 100, 64)),
    ((2, 1, 37, 96), (2, 1, 37, 96)),
    ((1, 2, 1, 64), (1, 2, 1, 64)),
    ((1, 2, 0, 64), (1, 2, 0, 64)),
]
MATRIX_OFFSET = 3

# per-layer retrieval scores for mixhq, layers 0..6 with the matrix's head counts at layers 3..6;
# at fraction 0.25 the top 3 of 13 heads are (2, 0), (5, 1), (4, 0): layer 3 is all low, layer
# 4 all high, layer 5 split, layer 6 all low.
SCORES = ((0.1, 0.5), (0.3, 0.2), (0.9, 0.05), (0.4, 0.6), (0.7,), (0.2, 0.8), (0.35, 0.1))
SPLIT_LAYER = 5  # two heads, one high one low

# ----------------------------------------------------------------------------- the matrix
# Every registered component must have examples here: registering a new one without adding it
# fails test_every_registered_component_is_in_the_matrix.

def _matrix_basis(key_rope: str) -> str:
    """A registered PCA basis for layers 0..6 with the matrix's geometry at layers 3..6 (fitted on
    other data than the matrix's), keys pre- or post-RoPE, the pre-RoPE one with per-layer
    sensitivities (for dp-alloc's model-wide budget); its digest."""
    shapes = [((1, 2, 120, 64),) * 2] * 3 + [tuple((1, s[1], 120, s[3]) for s in pair) for pair in MATRIX_SHAPES]
    rope = [RopeSpec((1.0 / 10000 ** (torch.arange(0, s[0][3], 2, dtype=torch.float64) / s[0][3])).float())
            for s in shapes]
    basis = fit_pca_basis([make_kv(shapes, seed=s) for s in (50, 60)], key_rope=key_rope,
                          rope=rope if key_rope == "pre" else ())
    if key_rope == "pre":
        basis = dataclasses.replace(basis, sensitivity=tuple((2.0**-i, 4.0**i) for i in range(len(shapes))))
    return register_basis(basis)


MATRIX_BASIS, MATRIX_BASIS_POST = _matrix_basis("pre"), _matrix_basis("post")
BASIS_BOUND = ("pca", "dp-alloc")
"""Components bound to a calibrated basis of fixed geometry: in the round-trip matrix (on the
matrix's shapes), not in the shape-generic tests (their own are in test_pca.py); compiled only
as KVTC-like policies (:data:`KVTC_POLICIES`), the fast path refuses other uses."""

TRANSFORM_EXAMPLES = {
    "identity": [Identity()],
    "hadamard": [Hadamard(), Hadamard(seed=7)],
    "delta": [Delta(), Delta(group_size=4, anchor_bits=8), Delta(group_size=32, anchor_bits=BF16_BITS)],
    "affine": [Affine(), Affine(statistic="absmax", shift=True)],
    "pca": [PCA(basis=MATRIX_BASIS), PCA(basis=MATRIX_BASIS_POST, rope="post")],
    "keep": [Keep(fraction=0.5, score="key-norm", sink_tokens=2, recent_tokens=4), Keep(window=8)],
}
TOKEN_SELECTING = ("keep",)
"""Transforms that shorten the tensors (first in a chain, K and V together): not in the
per-tensor transform tests; in the round-trip matrix, compared with the kept tokens (:func:`selected`)."""
def _calibrated_levels(bits: int, layers: int = 7) -> tuple[tuple[float, ...], ...]:
    """Per layer (0..6, the matrix's) a distinct sorted float16 codebook with end levels -1 and
    1: ``sign(t) |t|^(1 + l / 4)`` on an even grid (a layer's levels in another layer change
    the bytes)."""
    grid = torch.linspace(-1, 1, 2**bits, dtype=torch.float64)
    return tuple(tuple((grid.sign() * grid.abs() ** (1 + l / 4)).to(torch.float16).double().tolist())
                 for l in range(layers))


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
        # bfloat16 windows and layer schedules (layers 3 and 4 of the matrix are "shallow")
        UniformQuantizer(bits=2, granularity="per_channel", group_size=32, sink_tokens=4, recent_tokens=16),
        UniformQuantizer(bits=3, granularity="per_token", group_size=32, shallow_layers=5, shallow_bits=6),
        UniformQuantizer(bits=2, symmetric=True, granularity="per_token", group_size=16, recent_tokens=40,
                         shallow_layers=4, shallow_bits=BF16_BITS),
    ],
    "none": [NoQuantizer()],
    "mixhq": [
        MixHQ(head_scores=SCORES),
        MixHQ(fraction=0.5, high_bits=BF16_BITS, low_bits=1, granularity="per_channel", group_size=16,
              recent_tokens=8, head_scores=SCORES),
        MixHQ(fraction=1.0, high_bits=4, low_bits=3, symmetric=True, group_size=0, sink_tokens=2, head_scores=SCORES),
    ],
    "fp8": [FP8Quantizer(), FP8Quantizer(format="e5m2", scaled=True)],
    "codebook": [
        CodebookQuantizer(),  # Lloyd, min/max, 3 bits per token in groups of 32
        CodebookQuantizer(bits=2, normalize="absmax", granularity="per_channel", group_size=32, recent_tokens=16),
        CodebookQuantizer(bits=4, levels="nf", group_size=0, sink_tokens=2),
        CodebookQuantizer(bits=8, levels="nf", normalize="absmax", granularity="per_channel", group_size=7),
        # codebooks calibrated offline, per layer (KVQuant)
        CodebookQuantizer(bits=3, levels="calibrated", codebooks=_calibrated_levels(3)),
        CodebookQuantizer(bits=2, levels="calibrated", normalize="absmax", granularity="per_channel", group_size=16,
                          recent_tokens=8, codebooks=_calibrated_levels(2)),
    ],
    "dp-alloc": [DPAlloc(basis=MATRIX_BASIS), DPAlloc(bits=1.5, max_bits=4, grid="minmax", basis=MATRIX_BASIS),
                 DPAlloc(bits=8, basis=MATRIX_BASIS_POST), DPAlloc(bits=2.5, max_bits=6, grid="ecsq", basis=MATRIX_BASIS),
                 DPAlloc(bits=1.5, grid="ecsq", basis=MATRIX_BASIS, budget="model"),
                 DPAlloc(bits=2, max_bits=4, grid="minmax", basis=MATRIX_BASIS, budget="model")],
}
_OPTIONAL_CODECS = {  # codecs written alongside this library, with examples once registered
    "range": lambda cls: [cls(), cls(model="per_head")],
    "zstd": lambda cls: [cls()],
    "rans": lambda cls: [cls(), cls(model="per_head"), cls(model="global")],
}
CODEC_EXAMPLES = {"bitpack": [BitPack()]} | {
    name: examples(CODECS[name]) for name, examples in _OPTIONAL_CODECS.items() if name in CODECS
}

ALL_TRANSFORMS = [t for name, ts in TRANSFORM_EXAMPLES.items() if name not in BASIS_BOUND + TOKEN_SELECTING for t in ts]
ALL_QUANTIZERS = [q for name, qs in QUANTIZER_EXAMPLES.items() if name not in BASIS_BOUND for q in qs]
UNIFORM = QUANTIZER_EXAMPLES["uniform"]
PLAIN_UNIFORM = UNIFORM[:11]  # one width, no windows: the block kernel alone
ALL_CODECS = [c for cs in CODEC_EXAMPLES.values() for c in cs]
KIVI2_RECENT = PolicyConfig.kivi(2, recent_tokens=16)


def _transform_samples() -> list[PolicyConfig]:
    """Every quantizer without a transform, and every transform with a rotating third of the
    quantizers (each quantizer meets several transforms, K and V quantizers differ)."""
    n = len(ALL_QUANTIZERS)
    out = [PolicyConfig(key=q, value=q) for q in ALL_QUANTIZERS]
    for i, t in enumerate(t for t in ALL_TRANSFORMS if not t.is_identity):
        for j in range(i % 3, n, 3):
            out.append(PolicyConfig(transforms=(t,), key=ALL_QUANTIZERS[j], value=ALL_QUANTIZERS[(j + 1) % n]))
    return out


def _uses_basis(p: PolicyConfig) -> bool:
    return any(c.name in BASIS_BOUND for c in (*p.transforms, p.key, p.value))


def _kvtc_like(p: PolicyConfig) -> bool:
    """One pca transform, then dp-alloc (any grid) on K and V: the policies with a fast path."""
    return len(p.transforms) == 1 and type(p.transforms[0]) is PCA and all(type(q) is DPAlloc for q in (p.key, p.value))


def _basis_bound_samples() -> list[PolicyConfig]:
    """pca (pre and post RoPE) with dp-alloc, uniform, bfloat16 and fp8, after other transforms,
    with every codec."""
    pre, post = TRANSFORM_EXAMPLES["pca"]
    dp = QUANTIZER_EXAMPLES["dp-alloc"]
    out = [PolicyConfig(transforms=(pre,), key=dp[0], value=dp[1], codec=c) for c in ALL_CODECS]
    out += [
        PolicyConfig(transforms=(post,), key=dp[2], value=NoQuantizer()),
        PolicyConfig(transforms=(pre,), key=UNIFORM[1], value=QUANTIZER_EXAMPLES["fp8"][0]),
        PolicyConfig(transforms=(Hadamard(), pre), key=NoQuantizer(), value=dp[0], codec=ALL_CODECS[-1]),
        PolicyConfig(transforms=(Affine(shift=True), post), key=UNIFORM[11], value=UNIFORM[12]),
    ]
    return out


def _kvtc_samples() -> list[PolicyConfig]:
    """KVTC-like policies (pca, then dp-alloc on K and V), which have their own fast path:
    pre-RoPE with sink tokens and every codec; post-RoPE with other widths; the min/max and
    ecsq grids."""
    pre, post = TRANSFORM_EXAMPLES["pca"]
    out = [PolicyConfig(transforms=(pre,), key=DPAlloc(basis=MATRIX_BASIS, sink_tokens=4),
                        value=DPAlloc(bits=3, basis=MATRIX_BASIS), codec=c) for c in ALL_CODECS]
    out.append(PolicyConfig(transforms=(post,), key=DPAlloc(bits=8, basis=MATRIX_BASIS_POST),
                            value=DPAlloc(bits=1.5, max_bits=4, basis=MATRIX_BASIS_POST, sink_tokens=200)))
    out.append(PolicyConfig(transforms=(pre,), key=DPAlloc(bits=2.5, grid="minmax", basis=MATRIX_BASIS, sink_tokens=4),
                            value=DPAlloc(bits=3, grid="minmax", basis=MATRIX_BASIS), codec=RansCodec()))
    out.append(PolicyConfig(transforms=(pre,), key=DPAlloc(bits=1.5, grid="ecsq", basis=MATRIX_BASIS, sink_tokens=4),
                            value=DPAlloc(bits=3, max_bits=5, grid="ecsq", basis=MATRIX_BASIS), codec=RansCodec()))
    out.append(PolicyConfig(transforms=(post,), key=DPAlloc(bits=6, grid="ecsq", basis=MATRIX_BASIS_POST),
                            value=DPAlloc(bits=0.5, grid="ecsq", basis=MATRIX_BASIS_POST), codec=BitPack()))
    dp = QUANTIZER_EXAMPLES["dp-alloc"]  # the model-wide budgets
    out.append(PolicyConfig(transforms=(pre,), key=dp[4], value=dataclasses.replace(dp[4], bits=2.5, sink_tokens=1),
                            codec=RansCodec()))
    out.append(PolicyConfig(transforms=(pre,), key=dp[5], value=dp[5], codec=BitPack()))
    return out


KVTC_POLICIES = _kvtc_samples()
KEEP_KVTC = PolicyConfig(transforms=(Keep(fraction=0.6, score="key-norm", sink_tokens=2, per_head=False),
                                     TRANSFORM_EXAMPLES["pca"][0]),
                         key=DPAlloc(bits=2, basis=MATRIX_BASIS, sink_tokens=4), value=DPAlloc(bits=3, basis=MATRIX_BASIS),
                         codec=RansCodec())
"""A KVTC-like policy after token selection: the fast path un-rotates the kept keys at their
positions, as the reference does (not in :data:`POLICIES`: the in-memory pipeline there has no
positions)."""

# every quantizer and every transform in a covering sample of combinations (bit-packed); every
# codec x a sample of quantizers and transforms; compositions of transforms
POLICIES = (
    _transform_samples()
    + [
        PolicyConfig(transforms=(t,), key=q, value=v, codec=c)
        for c in ALL_CODECS
        if c != BitPack()
        for t, q, v in [
            (Identity(), UNIFORM[1], UNIFORM[2]),
            (Hadamard(), UNIFORM[0], UNIFORM[9]),
            (Delta(group_size=4, anchor_bits=8), UNIFORM[12], QUANTIZER_EXAMPLES["mixhq"][1]),
            (Affine(), QUANTIZER_EXAMPLES["fp8"][1], NoQuantizer()),
        ]
    ]
    + [
        PolicyConfig.kivi(2),
        KIVI2_RECENT,
        PolicyConfig(transforms=(Hadamard(seed=1), Hadamard(seed=2)), key=UNIFORM[4], value=NoQuantizer()),
        # a lone rotation before per-token keys and values (QuaRot): fused into the kernels' row
        # loads, in 16-lane groups (the blocks of rows) and in groups of 24 (one row at a time)
        PolicyConfig(transforms=(Hadamard(seed=3),), key=UNIFORM[0], value=UNIFORM[6]),
        PolicyConfig(transforms=(Hadamard(),), key=UNIFORM[5], value=UNIFORM[8]),
        PolicyConfig(transforms=(Affine(), Hadamard()), key=UNIFORM[2], value=UNIFORM[5]),
        PolicyConfig(transforms=(Affine(shift=True), Delta(group_size=8, anchor_bits=BF16_BITS), Hadamard()),
                     key=UNIFORM[11], value=QUANTIZER_EXAMPLES["mixhq"][0]),
        PolicyConfig(transforms=(Delta(group_size=4, anchor_bits=3), Delta(group_size=6, anchor_bits=7)),
                     key=UNIFORM[1], value=QUANTIZER_EXAMPLES["fp8"][0]),
    ]
    + [  # token selection in front of other transforms, quantizers and codecs
        PolicyConfig(transforms=(TRANSFORM_EXAMPLES["keep"][0], Hadamard()), key=UNIFORM[1], value=UNIFORM[11]),
        PolicyConfig(transforms=(TRANSFORM_EXAMPLES["keep"][1],), key=QUANTIZER_EXAMPLES["fp8"][1], value=NoQuantizer()),
        PolicyConfig(transforms=(TRANSFORM_EXAMPLES["keep"][1], Delta(group_size=4, anchor_bits=8)), key=UNIFORM[12],
                     value=QUANTIZER_EXAMPLES["mixhq"][1], codec=ALL_CODECS[-1]),
    ]
    + _basis_bound_samples()
    + KVTC_POLICIES
)
# policies of components with compiled kernels (every one but BASIS_BOUND)
KERNEL_POLICIES = [p for p in POLICIES if not _uses_basis(p)]
# bfloat16 input on a sample (every policy runs on float32)
BF16_POLICIES = POLICIES[::5]


def _id(p: PolicyConfig) -> str:
    return p.label


def test_every_registered_component_is_in_the_matrix():
    assert set(TRANSFORMS) == set(TRANSFORM_EXAMPLES) == {"identity", "hadamard", "delta", "affine", "pca", "keep"}
    assert set(QUANTIZERS) == set(QUANTIZER_EXAMPLES) == {"uniform", "none", "mixhq", "fp8", "codebook", "dp-alloc"}
    assert set(CODECS) == set(CODEC_EXAMPLES) and "bitpack" in CODECS
    used = {(kind, c.name) for p in POLICIES for kind, c in
            [*(("transform", t) for t in p.transforms), ("quantizer", p.key), ("quantizer", p.value), ("codec", p.codec)]}
    registered = {("transform", n) for n in TRANSFORMS if n != "identity"} | {("quantizer", n) for n in QUANTIZERS} | {
        ("codec", n) for n in CODECS}
    assert registered <= used  # every component is exercised by the round-trip matrix


def selected(kv, cfg: PolicyConfig):
    """``kv`` as the rest of ``cfg`` codes it: its kept tokens when ``cfg`` starts with ``keep``."""
    keep = selecting_transform(cfg)
    return kv if keep is None else select_kv(kv, keep)[0]


def reference_pipeline(x: torch.Tensor, cfg: PolicyConfig, quant: Quantizer, layer: int, kind: str) -> torch.Tensor:
    """In-memory T -> Q -> Q^-1 -> T^-1 without the codec and the stream."""
    y, states = apply_transforms(x.to(torch.float32), cfg.transforms, layer=layer, kind=kind)
    q = quant.quantize(y, layer=layer, kind=kind, min_bits=transform_min_bits(cfg.transforms, x.shape[2]))
    y = quant.dequantize(q, layer=layer, kind=kind)
    return invert_transforms(y, cfg.transforms, states, layer=layer, kind=kind).to(x.dtype)


# ----------------------------------------------------------------------------- round trips


@pytest.mark.parametrize(
    "cfg, dtype",
    [(p, torch.float32) for p in POLICIES] + [(p, torch.bfloat16) for p in BF16_POLICIES],
    ids=lambda x: x.label if isinstance(x, PolicyConfig) else str(x).removeprefix("torch."),
)
def test_round_trip_preserves_structure_and_matches_in_memory_pipeline(cfg, dtype):
    kv = make_kv(MATRIX_SHAPES, dtype=dtype)
    stream = encode_kv(kv, cfg, layer_offset=MATRIX_OFFSET)
    out = decode_kv(stream, expect=cfg)
    assert len(out) == len(kv)
    h = read_header(stream)
    assert len(stream) == h.total_nbytes  # the reported size is everything that crosses the wire
    for i, ((k, v), (k2, v2)) in enumerate(zip(selected(kv, cfg), out)):
        for orig, dec, quant, kind in ((k, k2, cfg.key, "key"), (v, v2, cfg.value, "value")):
            assert dec.shape == orig.shape and dec.dtype == orig.dtype and dec.device.type == "cpu"
            assert torch.isfinite(dec).all()
            # the codec and the stream are lossless: decode == the in-memory lossy pipeline, bit for bit
            assert torch.equal(dec, reference_pipeline(orig, cfg, quant, MATRIX_OFFSET + i, kind))


@pytest.mark.parametrize(
    "cfg, dtype",
    [(p, torch.float32) for p in KERNEL_POLICIES + KVTC_POLICIES + [KEEP_KVTC]]
    + [(p, torch.float32) for p in POLICIES if _kvtc_like(p) and p not in KVTC_POLICIES]
    + [(p, torch.bfloat16) for p in BF16_POLICIES if not _uses_basis(p)] + [(p, torch.bfloat16) for p in KVTC_POLICIES + [KEEP_KVTC]],
    ids=lambda x: x.label if isinstance(x, PolicyConfig) else str(x).removeprefix("torch."),
)
def test_fast_path_writes_and_reads_the_reference_bytes(cfg, dtype):
    """The compiled fast path and the torch reference are interchangeable, byte for byte."""
    assert fastpath.supports(cfg)  # every built-in component has a kernel: nothing falls back silently
    kv = make_kv(MATRIX_SHAPES, dtype=dtype, seed=7)
    stream = encode_kv(kv, cfg, layer_offset=MATRIX_OFFSET, impl="fast")
    assert stream == encode_kv(kv, cfg, layer_offset=MATRIX_OFFSET, impl="reference")
    fast = decode_kv(stream, expect=cfg, impl="fast")
    ref = decode_kv(stream, expect=cfg, impl="reference")
    for (k1, v1), (k2, v2) in zip(fast, ref):
        assert torch.equal(k1, k2) and torch.equal(v1, v2)
    out = [(torch.empty_like(k), torch.empty_like(v)) for k, v in selected(kv, cfg)]
    into = decode_kv(stream, impl="fast", out=out)
    assert all(a[0] is b[0] and a[1] is b[1] for a, b in zip(into, out))  # decoded in place
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(out, ref))


@pytest.mark.parametrize("cfg", [p for p in POLICIES if _uses_basis(p) and not _kvtc_like(p)], ids=_id)
def test_basis_bound_policies_have_no_kernel_path_and_auto_is_the_reference(cfg):
    """pca / dp-alloc other than KVTC-like (:func:`_kvtc_like`) are pure torch: the fast path
    says so (impl="fast" is a typed error) and "auto" writes and reads the reference bytes."""
    assert not fastpath.supports(cfg)
    kv = make_kv(MATRIX_SHAPES, seed=7)
    with pytest.raises(ConfigError, match="no fast path"):
        encode_kv(kv, cfg, layer_offset=MATRIX_OFFSET, impl="fast")
    stream = encode_kv(kv, cfg, layer_offset=MATRIX_OFFSET)
    assert stream == encode_kv(kv, cfg, layer_offset=MATRIX_OFFSET, impl="reference")
    for (k1, v1), (k2, v2) in zip(decode_kv(stream, expect=cfg), decode_kv(stream, impl="reference")):
        assert torch.equal(k1, k2) and torch.equal(v1, v2)


# degenerate but meaningful shapes (one head, one token, no tokens, one channel, batch 2), encoded
# at layer MATRIX_OFFSET where mixhq's scores have 2 heads; and shapes that are no KV cache
DEGENERATE_SHAPES = [(1, 2, 1, 1), (1, 2, 0, 16), (2, 2, 3, 1), (1, 2, 1, 16), (1, 2, 0, 1)]
REFUSED_SHAPES = {(0, 2, 8, 16): "batch = 0", (1, 0, 8, 16): "kv_heads = 0", (1, 2, 8, 0): "head_dim = 0"}


@pytest.mark.parametrize("impl", ["fast", "reference"])
@pytest.mark.parametrize("cfg", KERNEL_POLICIES, ids=_id)
def test_every_component_round_trips_degenerate_shapes_and_refuses_empty_axes(cfg, impl):
    """Every registered component (the matrix) on tiny and empty shapes: they encode, decode to
    the in-memory pipeline's tensors on both paths, with the same bytes; shapes with no batch,
    heads or channels are refused at encode with a typed error (an ``affine`` stream of 0 heads
    used to encode and then fail to decode). Basis-bound components: test_pca.py."""
    for shape in DEGENERATE_SHAPES:
        kv = make_kv([(shape, shape)], seed=11)
        stream = encode_kv(kv, cfg, layer_offset=MATRIX_OFFSET, impl=impl)
        assert stream == encode_kv(kv, cfg, layer_offset=MATRIX_OFFSET, impl="reference" if impl == "fast" else "fast")
        (k2, v2), = decode_kv(stream, expect=cfg, impl=impl)
        (k, v), = selected(kv, cfg)
        assert k.shape[:2] + k.shape[3:] == shape[:2] + shape[3:]
        for orig, dec, quant, kind in ((k, k2, cfg.key, "key"), (v, v2, cfg.value, "value")):
            assert dec.shape == orig.shape and torch.equal(dec, reference_pipeline(orig, cfg, quant, MATRIX_OFFSET, kind))
    assert decode_kv(encode_kv([], cfg, impl=impl), impl=impl) == []  # no layers
    for shape, what in REFUSED_SHAPES.items():
        kv = [(torch.zeros(shape), torch.zeros(shape))]
        with pytest.raises(KVInputError, match=re.escape(f"kv[0] K of shape {shape} has {what}")):
            encode_kv(kv, cfg, layer_offset=MATRIX_OFFSET, impl=impl)


@pytest.mark.parametrize("cfg, offset", [(PolicyConfig.kivi(2), 0), (KVTC_POLICIES[0], MATRIX_OFFSET)], ids=["kivi-2", "kvtc"])
@pytest.mark.parametrize("threads", [1, 3])
def test_fast_path_output_does_not_depend_on_threads(threads, cfg, offset):
    kv = make_kv(MATRIX_SHAPES, seed=3)
    before = fastpath.num_threads()
    try:
        fastpath.set_num_threads(threads)
        assert encode_kv(kv, cfg, impl="fast", layer_offset=offset) == encode_kv(kv, cfg, impl="reference", layer_offset=offset)
    finally:
        fastpath.set_num_threads(before)


def test_impl_argument_is_validated():
    kv = make_kv(MATRIX_SHAPES[:1])
    with pytest.raises(ValueError, match="impl"):
        encode_kv(kv, PolicyConfig.kivi(2), impl="turbo")
    stream = encode_kv(kv, PolicyConfig.kivi(2))
    with pytest.raises(ValueError, match="out"):
        decode_kv(stream, out=[(torch.empty(1), torch.empty(1))] * 5)


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


@pytest.mark.parametrize("quant", PLAIN_UNIFORM, ids=lambda q: q.short_label())
@pytest.mark.parametrize("shape", [(1, 2, 100, 64), (2, 1, 37, 96)])
def test_uniform_error_within_half_step_of_own_group(quant, shape):
    x = heavy_tailed(shape, seed=11, outliers=(3, 17))
    symbols, meta = quant.quantize_block(x)
    assert symbols.shape == x.shape and symbols.dtype == torch.uint8
    assert int(symbols.max()) < 2**quant.bits
    q = quant.quantize(x, layer=0, kind="key")  # one whole-tensor segment, same as the block kernel
    assert len(q.parts) == 1 and q.parts[0].segment.is_whole and torch.equal(q.parts[0].symbols, symbols)
    err = (quant.dequantize_block(symbols, meta, x.shape) - x).abs()
    bound = reference_error_bound(x, quant)
    assert (err <= bound).all(), float((err - bound).max())


def test_8bit_asymmetric_error_is_half_a_step():
    quant = UniformQuantizer(bits=8, granularity="per_token", group_size=16)
    x = heavy_tailed((1, 4, 64, 64), seed=5, outliers=(3,))
    xg = x.reshape(1, 4, 64, 4, 16)
    step = ((xg.amax(-1, keepdim=True) - xg.amin(-1, keepdim=True)) / 255).expand_as(xg).reshape(x.shape)
    mag = xg.abs().amax(-1, keepdim=True).expand_as(xg).reshape(x.shape)
    err = (quant.dequantize_block(*quant.quantize_block(x), x.shape) - x).abs()
    assert (err <= step / 2 + 2**-10 * mag + 1e-7).all()
    assert float((err / step).max()) > 0.4  # round-to-nearest: errors do reach ~half a step


def test_metadata_layout_and_kivi_cost():
    kivi_k = UniformQuantizer(bits=2, granularity="per_channel", group_size=32)
    q = kivi_k.quantize(heavy_tailed((1, 3, 100, 64), seed=1), layer=0, kind="key")
    (part,) = q.parts
    assert part.meta["scale"].shape == part.meta["zero"].shape == (1, 3, 4, 64)  # ceil(100/32) token groups
    assert part.meta["scale"].dtype == torch.float16 and q.meta_nbytes == 2 * 2 * 3 * 4 * 64
    sym = UniformQuantizer(bits=3, symmetric=True, granularity="per_token", group_size=24)
    layout = sym.block_meta_layout((2, 1, 37, 96))
    assert [(f.name, f.shape, f.dtype) for f in layout] == [("scale", (2, 1, 37, 4), torch.float16)]
    assert sym.meta_layout((2, 1, 37, 96), layer=0, kind="value") == (layout,)
    # with a 28-token recent window the per-channel groups run over the first 72 tokens only
    win = UniformQuantizer(bits=2, granularity="per_channel", group_size=32, recent_tokens=28)
    assert [[(f.name, f.shape) for f in lay] for lay in win.meta_layout((1, 3, 100, 64), layer=0, kind="key")] == [
        [("scale", (1, 3, 3, 64)), ("zero", (1, 3, 3, 64))],
        [],
    ]


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
        y = quant.dequantize_block(*quant.quantize_block(x), x.shape)
        if quant.granularity == "per_channel":
            assert torch.equal(y[0, 0, :32, 5], x[0, 0, :32, 5])
            assert not torch.equal(y[0, 0, 32:, 5], x[0, 0, 32:, 5])
        else:
            assert torch.equal(y[0, 0, 41], x[0, 0, 41])  # all-zero group (also on the mid-rise symmetric grid)
            if not quant.symmetric:
                assert torch.equal(y[0, 0, 40], x[0, 0, 40])


# a codebook fitted to the data (Lloyd) is refitted on the reconstruction, so it is no fixed
# point; its round trips and error are tested in test_codebook.py
@pytest.mark.parametrize("floors", [None, "anchors"])
@pytest.mark.parametrize("quant", [q for q in ALL_QUANTIZERS if getattr(q, "levels", None) != "lloyd"],
                         ids=lambda q: q.short_label())
def test_quantize_dequantize_quantize_is_idempotent(quant, floors):
    x = heavy_tailed((2, 2, 70, 96), seed=3, outliers=(3, 17))
    min_bits = Delta(group_size=8, anchor_bits=6).token_min_bits(70) if floors else None
    kw = dict(layer=SPLIT_LAYER, kind="key")
    q1 = quant.quantize(x, min_bits=min_bits, **kw)
    x1 = quant.dequantize(q1, **kw)
    q2 = quant.quantize(x1, min_bits=min_bits, **kw)
    assert len(q1.parts) == len(q2.parts) >= 1
    for a, b in zip(q1.parts, q2.parts):
        assert a.bits == b.bits and torch.equal(a.symbols, b.symbols)
        assert a.meta.keys() == b.meta.keys() and all(torch.equal(a.meta[k], b.meta[k]) for k in a.meta)
    assert torch.equal(quant.dequantize(q2, **kw), x1)


@pytest.mark.parametrize("bits", [6, 8])
def test_idempotent_on_groups_with_large_offset(bits):
    # groups whose range is small next to their magnitude: a float16 zero point rounded to
    # nearest would let the group minimum land on symbol >= 1 and drift on re-quantization
    offsets = torch.linspace(50, 300, 400).repeat_interleave(3)[:, None]
    ranges = torch.tensor([0.5, 2.0, 8.0]).repeat(400)[:, None]
    x = (offsets + ranges * torch.linspace(0, 1, 32)[None, :]).reshape(1, 1, 1200, 32)
    quant = UniformQuantizer(bits=bits, granularity="per_token", group_size=0)
    s1, m1 = quant.quantize_block(x)
    assert torch.equal(quant.quantize_block(quant.dequantize_block(s1, m1, x.shape))[0], s1)
    assert (s1.amin(-1) == 0).all() and (s1.amax(-1) == 2**bits - 1).all()


def test_uniform_symbols_hit_both_ends_of_the_grid():
    quant = UniformQuantizer(bits=3, granularity="per_token", group_size=0)
    x = torch.tensor([[[[-1.0, -0.5, 0.0, 0.25, 2.5]]]])
    symbols, meta = quant.quantize_block(x)
    assert symbols.flatten().tolist() == [0, 1, 2, 2, 7]  # step 0.5: (x + 1) / 0.5 rounded (2.5 -> 2)
    assert torch.equal(quant.dequantize_block(symbols, meta, x.shape), torch.tensor([[[[-1.0, -0.5, 0.0, 0.0, 2.5]]]]))


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
    state = transform.fit(x, layer=4, kind="key")
    assert [(f.name, f.shape, f.dtype) for f in transform.state_layout(x.shape, layer=4, kind="key")] == [
        (k, tuple(v.shape), v.dtype) for k, v in state.items()
    ]
    y = transform.forward(x, layer=4, kind="key", state=state)
    assert y.shape == x.shape and y.dtype == torch.float32
    torch.testing.assert_close(transform.inverse(y, layer=4, kind="key", state=state), x, rtol=1e-6, atol=1e-5)
    if isinstance(transform, (Identity, Hadamard)):  # orthonormal
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
    assert h.state_nbytes == 0
    assert h.layer_offset == 7 and h.dtype == "float32" and h.policy_id == cfg.policy_id
    assert h.policy == cfg.to_dict() and h.num_layers == 4
    for (ks, vs), (k_sec, v_sec) in zip(h.shapes, h.sections):
        if ks[2] == 0:  # an empty tensor has no segments
            assert k_sec.flat() == v_sec.flat() == [0]
            continue
        (km,), (kp,), (vm,), (vp,) = k_sec.meta, k_sec.payload, v_sec.meta, v_sec.payload
        assert kp == math.ceil(math.prod(ks) * 3 / 8) and vp == math.ceil(math.prod(vs) * 3 / 8)
        b, hh, t, d = ks
        assert km == 2 * 2 * b * hh * math.ceil(t / 32) * d  # per-channel: scale + zero per 32 tokens
        assert vm == 2 * 2 * b * hh * t * math.ceil(d / 32)  # per-token: scale + zero per 32 channels
    assert original_nbytes(kv) == 2 * sum(math.prod(k) + math.prod(v) for k, v in h.shapes)


def test_segments_and_state_in_the_stream():
    # affine state (scale + shift), delta anchors in bf16, a bf16 recent window, a layer schedule
    cfg = PolicyConfig(
        transforms=(Affine(shift=True), Delta(group_size=10, anchor_bits=BF16_BITS)),
        key=UniformQuantizer(bits=2, granularity="per_channel", group_size=32, recent_tokens=20),
        value=UniformQuantizer(bits=3, granularity="per_token", group_size=32, shallow_layers=1, shallow_bits=5),
    )
    kv = make_kv([((1, 3, 100, 64), (1, 3, 100, 64))] * 2)
    h = read_header(encode_kv(kv, cfg))
    anchors = 10  # tokens 0, 10, ..., 90
    for layer, (k_sec, v_sec) in enumerate(h.sections):
        assert k_sec.state == v_sec.state == 2 * 2 * 3 * 64  # float16 scale + shift per (head, channel)
        # keys: one bf16 class (anchors 0, 10, ..., 70 + recent window 80..99; first, as it holds
        # token 0), then the 2-bit body (the other 72 tokens)
        body = 80 - 8
        assert k_sec.num_segments == 2
        assert k_sec.payload == (3 * (100 - body) * 64 * 2, math.ceil(3 * body * 64 * 2 / 8))
        assert k_sec.meta == (0, 2 * 2 * 3 * math.ceil(body / 32) * 64)
        # values: anchor tokens in bf16 first (class order = first token), then the rest
        bits = 5 if layer == 0 else 3
        assert v_sec.payload == (3 * anchors * 64 * 2, math.ceil(3 * 90 * 64 * bits / 8))
        assert v_sec.meta == (0, 2 * 2 * 3 * 90 * 2)
    assert h.state_nbytes == 4 * 2 * 2 * 3 * 64


def test_stream_sections_of_an_empty_cache():
    h = read_header(encode_kv([], PolicyConfig.kivi(2)))
    assert h.sections == () and h.num_elements == 0


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
        (_with("value", group_size=-1), ["'group_size'", "0..2147483647"]),
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
        (_with("key", recent_tokens=-1), ["'recent_tokens'", ">= 0"]),
        (_with("key", shallow_bits=9), ["'shallow_bits'", "16"]),
        ({**KIVI_HADAMARD, "key": {"name": "mixhq", "fraction": 1.5}}, ["'mixhq'", "'fraction'", "0.0..1.0"]),
        ({**KIVI_HADAMARD, "key": {"name": "mixhq", "head_scores": "high"}}, ["'head_scores'", "list"]),
        ({**KIVI_HADAMARD, "value": {"name": "fp8", "format": "e3m4"}}, ["'fp8'", "'format'", "'e4m3'", "'e5m2'"]),
        ({**KIVI_HADAMARD, "transforms": [{"name": "delta", "anchor_bits": 9}]}, ["'delta'", "'anchor_bits'", "16"]),
        ({**KIVI_HADAMARD, "transforms": [{"name": "delta", "group_size": 1}]}, ["'group_size'", "2..2147483647"]),
        ({**KIVI_HADAMARD, "transforms": [{"name": "affine", "statistic": "std"}]}, ["'affine'", "'statistic'", "'rms'"]),
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


GOOD_POLICIES = {
    "kivi4-hadamard": PolicyConfig.kivi(4, transforms=(Hadamard(),)),
    # transform state, bf16 anchors and windows, mixed-precision heads: several segments per tensor
    "segments": PolicyConfig(
        transforms=(Affine(shift=True), Delta(group_size=8, anchor_bits=BF16_BITS), Hadamard()),
        key=UniformQuantizer(bits=2, granularity="per_channel", group_size=32, sink_tokens=2, recent_tokens=16),
        value=MixHQ(head_scores=SCORES, recent_tokens=4),
    ),
    # PCA + dp-alloc on the ecsq grid, rANS coded: a bf16 sink segment, then one segment per width
    "ecsq": PolicyConfig(transforms=(TRANSFORM_EXAMPLES["pca"][0],), codec=RansCodec(),
                         key=DPAlloc(bits=1.5, grid="ecsq", basis=MATRIX_BASIS, sink_tokens=1),
                         value=DPAlloc(bits=2.5, grid="ecsq", basis=MATRIX_BASIS)),
}


@pytest.fixture(scope="module", params=list(GOOD_POLICIES))
def good_stream(request):
    cfg = GOOD_POLICIES[request.param]
    kv = make_kv(MATRIX_SHAPES[:2])
    return cfg, encode_kv(kv, cfg, layer_offset=MATRIX_OFFSET)


def _flip(data: bytes, pos: int) -> bytes:
    b = bytearray(data)
    b[pos] ^= 0xFF
    return bytes(b)


def test_good_stream_decodes_with_and_without_expectation(good_stream):
    cfg, stream = good_stream
    assert len(decode_kv(stream)) == 2 and len(decode_kv(stream, expect=cfg)) == 2
    assert len(decode_kv(memoryview(stream))) == 2


@pytest.mark.parametrize("impl", ["fast", "reference"])
def test_flipped_payload_byte_is_corrupt(good_stream, impl):
    _, stream = good_stream
    h = read_header(stream)
    for pos in (h.header_nbytes, h.header_nbytes + (h.state_nbytes + h.meta_nbytes) // 2, len(stream) - 10, len(stream) - 1):
        with pytest.raises(CorruptStreamError):
            decode_kv(_flip(stream, pos), impl=impl)


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


@pytest.mark.parametrize("impl", ["fast", "reference"])
def test_header_policy_must_hash_to_the_recorded_policy_id(impl):
    """A header whose policy was swapped (checksums recomputed: the stream writer itself
    assembles it from a real stream's sections) must not decode with the wrong policy."""
    from kvtune.codecs.stream import read_stream, write_stream

    kivi = PolicyConfig.kivi(2)
    swapped = PolicyConfig.from_dict({**kivi.to_dict(), "transforms": [{"name": "hadamard"}]})
    header, sections = read_stream(encode_kv(make_kv(MATRIX_SHAPES[:1]), kivi, impl=impl))
    stream = write_stream(policy=swapped.to_dict(), policy_id=kivi.policy_id, layer_offset=header.layer_offset,
                          dtype=header.dtype, shapes=header.shapes,
                          sections=[tuple(t.flat() for t in pair) for pair in sections])
    for expect in (None, kivi):
        with pytest.raises(CorruptStreamError, match="policy id"):
            decode_kv(stream, expect=expect, impl=impl)


@pytest.mark.parametrize("impl", ["fast", "reference"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_kv_is_refused_at_encode(bad, dtype, impl):
    for policy in (PolicyConfig.kivi(2), PolicyConfig.uncompressed()):  # bfloat16 passes through whole
        for where in ((0, 0, 3, 3), (-1, -1, -1, -1)):  # the last element: the vector loop's tail
            kv = make_kv(MATRIX_SHAPES[:2], dtype=dtype)
            kv[1][1][where] = bad
            with pytest.raises(ValueError, match=r"kv\[1\] V has non-finite values"):
                encode_kv(kv, policy, impl=impl)
            kv[1][1][where] = 0.0
            encode_kv(kv, policy, impl=impl)  # finite again: accepted


def test_finite_check_reads_exponent_bits():
    from kvtune.codecs import kernels

    x = torch.tensor([0.0, -3.5, 3.3895e38, -3.3895e38, 1e-40], dtype=torch.bfloat16)  # bf16 max, a subnormal
    assert kernels.all_finite_bf16(x.view(torch.int16).numpy().view(np.uint16))
    assert kernels.all_finite_f32(x.float().numpy())
    for bad in (float("nan"), float("inf"), float("-inf")):
        y = torch.cat([x, torch.tensor([bad]).to(torch.bfloat16)])
        assert not kernels.all_finite_bf16(y.view(torch.int16).numpy().view(np.uint16))
        assert not kernels.all_finite_f32(y.float().numpy())
    assert kernels.all_finite_f32(np.zeros(0, np.float32))


def test_fastpath_all_finite_reads_cpu_bf16_and_float32_and_declines_the_rest():
    """``fastpath.all_finite`` answers for contiguous bfloat16 / float32 CPU tensors (a NaN or
    inf anywhere, the last element included, is found) and returns None for float16, strided
    and lazily negated tensors, which ``check_kv`` then checks with torch."""
    from kvtune.codecs import fastpath

    for dtype in (torch.bfloat16, torch.float32):
        x = torch.linspace(-3.0, 3.0, 4 * 37, dtype=dtype).reshape(1, 4, 37, 1)
        assert fastpath.all_finite(x) is True
        for bad in (float("nan"), float("inf"), float("-inf")):
            y = x.clone()
            y.view(-1)[-1] = bad
            assert fastpath.all_finite(y) is False
    x = torch.ones(2, 3, 4, 8)
    assert fastpath.all_finite(x.half()) is None
    assert fastpath.all_finite(x.transpose(1, 2)) is None
    neg = torch.complex(x, x).conj().imag  # a lazy negation view: its memory holds -x
    assert neg.is_neg() and fastpath.all_finite(neg) is None


def test_layer_offset_must_be_an_int():
    kv = make_kv(MATRIX_SHAPES[:1])
    for bad in (1.0, "1", True):
        with pytest.raises(TypeError, match="layer_offset must be an int"):
            encode_kv(kv, PolicyConfig.kivi(2), layer_offset=bad)


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
        decode_kv(stream, expect=PolicyConfig.kivi(3))


@pytest.mark.parametrize("impl", ["auto", "reference"])
def test_a_flip_after_the_header_is_reported_as_a_checksum_mismatch(good_stream, impl):
    """The fast path verifies the stream CRC while decoding (``read_stream(verify_checksum=False)``),
    yet a damaged stream reports the checksum first, as the reference path does, whatever check a
    flipped metadata or payload byte would trip first (e.g. a NaN float16 scale), into ``out``
    tensors too; ``read_stream`` without the checksum accepts it and ``check_checksum`` refuses it."""
    _, stream = good_stream
    h = read_header(stream)
    out = [(torch.empty_like(k), torch.empty_like(v)) for k, v in decode_kv(stream)]
    for pos in np.linspace(h.header_nbytes, len(stream) - 1, 25).astype(int):
        bad = _flip(stream, int(pos))
        with pytest.raises(CorruptStreamError, match="checksum mismatch"):
            decode_kv(bad, impl=impl)
        with pytest.raises(CorruptStreamError, match="checksum mismatch"):
            decode_kv(bad, impl=impl, out=out)
        header, _ = read_stream(bad, verify_checksum=False)
        assert header == h
        with pytest.raises(CorruptStreamError, match="checksum mismatch"):
            check_checksum(bad, header)
    check_checksum(stream, h)
    assert stream_checksum(stream, h) == zlib.crc32(stream[:-4])


def test_no_single_byte_flip_ever_decodes(good_stream):
    _, stream = good_stream
    for pos in np.linspace(0, len(stream) - 1, 60).astype(int):
        with pytest.raises(KVStreamError):
            decode_kv(_flip(stream, int(pos)))


def _authentic_stream(policy: dict, sections, shapes, dtype="float32") -> bytes:
    """A stream with valid checksums but content chosen by the test."""
    try:  # the id a real encoder records: the hash of the policy (decode checks it)
        policy_id = PolicyConfig.from_dict(policy).policy_id
    except ConfigError:  # a policy this library cannot build: any id
        policy_id = "000000000000"
    return write_stream(policy=policy, policy_id=policy_id, layer_offset=0, dtype=dtype, shapes=shapes, sections=sections)


@pytest.mark.parametrize("impl", ["fast", "reference"])
def test_header_claiming_huge_shapes_fails_before_allocating(impl):
    """A header whose shapes need terabytes is refused by the shape limits or the section-length
    checks, before anything is planned or allocated from it."""
    cfg = PolicyConfig.kivi(2)
    meta, payload = bytes(2 * 2 * 32), bytes(32 * 32 * 2 // 8)
    for tokens in (10**12, 2**62):
        shape = (1, 1, tokens, 32)
        stream = _authentic_stream(cfg.to_dict(), [([b"", meta, payload], [b"", meta, payload])], [(shape, shape)])
        with pytest.raises(CorruptStreamError, match=r"payload|metadata|segments|allowed: 0\.\.2147483647"):
            decode_kv(stream, impl=impl)


def test_decode_argument_types_are_checked(good_stream):
    _, stream = good_stream
    with pytest.raises(TypeError, match="expect must be a PolicyConfig"):
        decode_kv(stream, expect=PolicyConfig.kivi(2).to_dict())
    kv = decode_kv(stream)
    out = [(torch.empty_like(k).requires_grad_(), torch.empty_like(v)) for k, v in kv]
    with pytest.raises(ValueError, match=r"out\[0\] K requires grad"):
        decode_kv(stream, out=out)
    with pytest.raises(TypeError, match="config must be a PolicyConfig"):
        encode_kv(kv, PolicyConfig.kivi(2).to_dict())
    with pytest.raises(ValueError, match="meta tensor"):
        encode_kv([(torch.empty(1, 2, 8, 16, device="meta"),) * 2], PolicyConfig.kivi(2))


def test_out_of_range_integers_are_config_errors():
    with pytest.raises(ConfigError, match="version"):
        PolicyConfig.from_dict({"key": "uniform", "value": "uniform", "version": 1.0})
    for spec in ({"name": "uniform", "group_size": 2**31}, {"name": "uniform", "group_size": 2**63},
                 {"name": "uniform", "recent_tokens": 2**64 + 1}, {"name": "mixhq", "group_size": 10**30}):
        with pytest.raises(ConfigError, match="group_size|recent_tokens"):
            PolicyConfig.from_dict({"key": spec, "value": "uniform"})
    with pytest.raises(ConfigError, match="seed"):
        PolicyConfig.from_dict({"transforms": [{"name": "hadamard", "seed": 2**64 + 5}], "key": "uniform", "value": "uniform"})


def test_intact_but_inconsistent_streams_never_decode():
    cfg = PolicyConfig.kivi(2)
    shape = (1, 1, 32, 32)
    meta = bytes(2 * 2 * 32)  # one token group x 32 channels x (scale, zero) x fp16
    payload = bytes(32 * 32 * 2 // 8)

    def one_layer(policy, k_parts, v_parts=(b"", meta, payload)):
        return _authentic_stream(policy, [(list(k_parts), list(v_parts))], [(shape, shape)])

    (k, v), = decode_kv(one_layer(cfg.to_dict(), [b"", meta, payload]))
    assert torch.equal(k, torch.zeros(shape))
    with pytest.raises(CorruptStreamError, match="metadata"):
        decode_kv(one_layer(cfg.to_dict(), [b"", meta[:-2], payload]))
    with pytest.raises(CorruptStreamError, match="payload"):
        decode_kv(one_layer(cfg.to_dict(), [b"", meta, payload + b"\x00"]))
    with pytest.raises(CorruptStreamError, match="segments"):
        decode_kv(one_layer(cfg.to_dict(), [b"", meta, payload, b"", b""]))
    with pytest.raises(CorruptStreamError, match="segments"):
        decode_kv(one_layer(cfg.to_dict(), [b""]))
    with pytest.raises(CorruptStreamError, match="state"):
        decode_kv(one_layer(cfg.to_dict(), [b"\x00\x00", meta, payload]))
    affine = PolicyConfig(transforms=(Affine(),), key=cfg.key, value=cfg.value).to_dict()
    with pytest.raises(CorruptStreamError, match="state"):
        decode_kv(one_layer(affine, [b"", meta, payload]))
    unknown = {**cfg.to_dict(), "codec": {"name": "brotli"}}
    with pytest.raises(KVStreamError, match="brotli"):
        decode_kv(one_layer(unknown, [b"", meta, payload]))
    # an intact stream whose policy cannot be applied to its shapes: mixhq scores for 1 head
    mix = PolicyConfig(key=MixHQ(head_scores=((0.5, 0.1),)), value=cfg.value).to_dict()
    with pytest.raises(KVStreamError, match="2 heads"):
        decode_kv(one_layer(mix, [b"", meta, payload]))
    # a tampered header whose header checksum was recomputed is still caught by the final checksum
    good = encode_kv(make_kv(MATRIX_SHAPES[:1]), cfg)
    hlen = struct.unpack_from("<I", good, 6)[0]
    header = good[10 : 10 + hlen].replace(b'"layer_offset":0', b'"layer_offset":1')
    head = good[:10] + header
    forged = head + hashlib.blake2b(head, digest_size=4).digest() + good[14 + hlen :]
    with pytest.raises(CorruptStreamError, match="checksum"):
        decode_kv(forged)


# ----------------------------------------------------------------------------- segments (plan)


@settings(max_examples=80, deadline=None, derandomize=True)
@given(
    heads=st.integers(0, 5),
    tokens=st.integers(0, 40),
    head_bits=st.data(),
    sink=st.integers(0, 6),
    recent=st.integers(0, 12),
    anchor=st.sampled_from([None, (3, 4), (5, 8), (7, 16)]),
)
def test_plan_partitions_the_tensor_with_the_right_widths(heads, tokens, head_bits, sink, recent, anchor):
    hb = head_bits.draw(st.lists(st.sampled_from([1, 2, 4, 8, 16]), min_size=heads, max_size=heads))
    floors = torch.zeros(tokens, dtype=torch.int64)
    if anchor:
        floors = Delta(group_size=anchor[0], anchor_bits=anchor[1]).token_min_bits(tokens)
    windows = UniformQuantizer(sink_tokens=sink, recent_tokens=recent).window_min_bits(tokens)
    if windows is not None:
        floors = torch.maximum(floors, windows)
    segs = plan_segments((1, heads, tokens, 3), hb, floors, UniformQuantizer().coder)
    width = torch.zeros(heads, tokens, dtype=torch.int64)
    count = torch.zeros(heads, tokens, dtype=torch.int64)
    for s in segs:
        h_idx, t_idx = s.head_indices(heads), torch.arange(tokens)[s.tokens if s.tokens is not None else slice(None)]
        assert s.shape == (1, h_idx.numel(), t_idx.numel(), 3) and s.numel > 0
        count[h_idx[:, None], t_idx[None, :]] += 1
        width[h_idx[:, None], t_idx[None, :]] = s.bits
    assert (count == 1).all()  # a partition: every element in exactly one segment
    expect = torch.maximum(torch.tensor(hb, dtype=torch.int64)[:, None], floors[None, :]) if heads and tokens else width
    assert torch.equal(width, expect)
    # no two segments share (token class, width): minimal for the structure
    assert len({(str(s.tokens), s.bits) for s in segs}) == len(segs)


def test_segment_take_and_put_are_inverse():
    x = torch.arange(2 * 4 * 9 * 3, dtype=torch.float32).reshape(2, 4, 9, 3)
    segs = plan_segments(x.shape, (2, 8, 2, 16), Delta(group_size=3, anchor_bits=4).token_min_bits(9), UniformQuantizer().coder)
    out = torch.full_like(x, float("nan"))
    for s in segs:
        s.put(out, s.take(x))
    assert torch.equal(out, x)


# ----------------------------------------------------------------------------- windows and schedules


def test_sink_and_recent_tokens_are_exact_bfloat16():
    x = heavy_tailed((1, 3, 1024, 64), seed=21, outliers=(3,))
    quant = UniformQuantizer(bits=2, granularity="per_channel", group_size=32, sink_tokens=4, recent_tokens=128)
    cfg = PolicyConfig(key=quant, value=quant)
    (k2, _), = decode_kv(encode_kv([(x, x)], cfg))
    bf = x.to(torch.bfloat16).float()
    assert torch.equal(k2[:, :, :4], bf[:, :, :4]) and torch.equal(k2[:, :, -128:], bf[:, :, -128:])
    assert not torch.equal(k2[:, :, 4:-128], bf[:, :, 4:-128])
    q = quant.quantize(x, layer=0, kind="key")
    assert [(p.bits, p.shape) for p in q.parts] == [(16, (1, 3, 132, 64)), (2, (1, 3, 892, 64))]
    # bf16 window: 16 bits, body: 2 bits + (scale, zero) per 32 tokens = 3 bits (892 = 27 groups + 28)
    body_meta = 2 * 2 * 3 * 28 * 64
    assert q.bits_per_element() == (132 * 3 * 64 * 16 + 892 * 3 * 64 * 2 + 8 * body_meta) / x.numel()
    # windows longer than the tensor: all bf16
    (s2, _), = decode_kv(encode_kv([(x[:, :, :100], x[:, :, :100])], cfg))
    assert torch.equal(s2, bf[:, :, :100])


def test_layer_schedule_uses_shallow_bits_below_shallow_layers():
    quant = UniformQuantizer(bits=2, granularity="per_token", group_size=32, shallow_layers=3, shallow_bits=6)
    kv = make_kv([((1, 2, 64, 64), (1, 2, 64, 64))] * 3)
    h = read_header(encode_kv(kv, PolicyConfig(key=quant, value=NoQuantizer()), layer_offset=1))
    # absolute layers 1, 2 are shallow (6 bits), layer 3 is not (2 bits)
    assert [k.payload for k, _ in h.sections] == [(2 * 64 * 64 * 6 // 8,)] * 2 + [(2 * 64 * 64 * 2 // 8,)]
    assert quant.head_bits(3, layer=2, kind="key") == (6, 6, 6) and quant.head_bits(3, layer=3, kind="key") == (2, 2, 2)
    bf = UniformQuantizer(bits=2, shallow_layers=1, shallow_bits=BF16_BITS)
    x = heavy_tailed((1, 2, 10, 64), seed=1)
    assert torch.equal(bf.dequantize(bf.quantize(x, layer=0, kind="value"), layer=0, kind="value"), x.bfloat16().float())
    assert bf.symbol_widths() == (2, 16)


def test_new_uniform_parameters_keep_old_policy_ids_and_labels():
    # sink/recent/schedule are left out of the canonical dict at their defaults
    cfg = PolicyConfig.from_dict(KIVI_HADAMARD)
    assert "recent_tokens" not in cfg.to_dict()["key"] and cfg.policy_id == "46d08cde433f"
    win = PolicyConfig.kivi(2, recent_tokens=128)
    assert win.to_dict()["key"]["recent_tokens"] == 128 and win.policy_id != PolicyConfig.kivi(2).policy_id
    assert win.label == "identity|K:u2a/ch/g32/r128|V:u2a/tok/g32/r128|bitpack"
    sched = UniformQuantizer(bits=4, symmetric=True, group_size=0, sink_tokens=4, shallow_layers=10, shallow_bits=5)
    assert sched.short_label() == "u4s/tok/s4/L10:5"
    assert UniformQuantizer.from_dict(sched.to_dict()) == sched


# ----------------------------------------------------------------------------- delta


def test_delta_encode_decode_and_anchor_floors():
    x = torch.randn(2, 3, 23, 8, generator=torch.Generator().manual_seed(0))
    y = delta_encode(x, 5)
    anchors = torch.arange(23) // 5 * 5
    assert torch.equal(y[:, :, ::5], x[:, :, ::5])
    torch.testing.assert_close(y[:, :, 7], x[:, :, 7] - x[:, :, 5], rtol=0, atol=0)
    torch.testing.assert_close(delta_decode(y, 5), x, rtol=1e-6, atol=1e-6)
    assert torch.equal(x.index_select(2, anchors)[:, :, ::5], x[:, :, ::5])
    assert Delta(group_size=5).token_min_bits(23) is None
    floors = Delta(group_size=5, anchor_bits=8).token_min_bits(23)
    assert floors.tolist() == [8 if t % 5 == 0 else 0 for t in range(23)]


def test_delta_with_bf16_anchors_keeps_anchors_exact():
    x = heavy_tailed((1, 3, 1024, 64), seed=4)
    cfg = PolicyConfig(transforms=(Delta(group_size=10, anchor_bits=BF16_BITS),),
                       key=UniformQuantizer(bits=2, granularity="per_token"), value=UniformQuantizer(bits=2))
    (k2, _), = decode_kv(encode_kv([(x, x)], cfg))
    assert torch.equal(k2[:, :, ::10], x[:, :, ::10].bfloat16().float())
    assert not torch.equal(k2[:, :, 1::10], x[:, :, 1::10].bfloat16().float())
    # anchors are a 16-bit segment, the deltas a 2-bit one: 103 anchors, 921 deltas
    k_sec = read_header(encode_kv([(x, x)], cfg)).sections[0][0]
    assert k_sec.payload == (3 * 103 * 64 * 2, 3 * 921 * 64 * 2 // 8)


def test_delta_anchor_bits_are_a_floor_not_a_cap():
    x = heavy_tailed((1, 2, 40, 32), seed=5)
    floors = Delta(group_size=10, anchor_bits=4).token_min_bits(40)
    q8 = UniformQuantizer(bits=8).quantize(x, layer=0, kind="key", min_bits=floors)
    assert [p.bits for p in q8.parts] == [8]  # anchors already get 8 bits: one segment
    q2 = UniformQuantizer(bits=2).quantize(x, layer=0, kind="key", min_bits=floors)
    assert [p.bits for p in q2.parts] == [4, 2]
    fp8 = FP8Quantizer().quantize(x, layer=0, kind="key", min_bits=floors)
    assert [p.bits for p in fp8.parts] == [8]


# ----------------------------------------------------------------------------- affine


def test_affine_state_is_the_float16_channel_statistic_and_inverts_exactly():
    x = heavy_tailed((2, 3, 50, 16), seed=6, outliers=(3,))
    for statistic, shift in (("rms", False), ("absmax", True)):
        t = Affine(statistic=statistic, shift=shift)
        state = t.fit(x, layer=0, kind="key")
        xd = x.double()
        mean = xd.mean(dim=(0, 2))
        centered = xd - (state["shift"].double()[None, :, None, :] if shift else 0)
        stat = centered.square().mean(dim=(0, 2)).sqrt() if statistic == "rms" else centered.abs().amax(dim=(0, 2))
        assert state["scale"].dtype == torch.float16 and state["scale"].shape == (3, 16)
        assert torch.equal(state["scale"], stat.to(torch.float16))
        if shift:
            assert torch.equal(state["shift"], mean.to(torch.float16))
        y = t.forward(x, layer=0, kind="key", state=state)
        torch.testing.assert_close(t.inverse(y, layer=0, kind="key", state=state), x, rtol=1e-6, atol=1e-6)
        with pytest.raises(ValueError, match="state"):
            t.forward(x, layer=0, kind="key")
    # zero channels and empty tensors get scale 1 (no division by zero)
    z = torch.zeros(1, 2, 5, 4)
    assert torch.equal(Affine().fit(z, layer=0, kind="key")["scale"], torch.ones(2, 4, dtype=torch.float16))
    assert torch.equal(Affine(shift=True).fit(z[:, :, :0], layer=0, kind="key")["scale"], torch.ones(2, 4, dtype=torch.float16))


def test_affine_state_travels_in_the_stream_and_helps_per_token_keys():
    kv = make_kv([((1, 4, 256, 64), (1, 4, 256, 64))])
    k = kv[0][0]
    tok = UniformQuantizer(bits=3, granularity="per_token", group_size=0)

    normal = [c for c in range(64) if c not in (3, 17)]  # make_kv's outlier channels are 3 and 17

    def rel_err(cfg):
        stream = encode_kv(kv, cfg)
        (k2, _), = decode_kv(stream)
        err = k2 - k
        return float(err.norm() / k.norm()), float(err[..., normal].norm() / k[..., normal].norm()), read_header(stream)

    plain, plain_normal, _ = rel_err(PolicyConfig(key=tok, value=tok))
    scaled, scaled_normal, h = rel_err(PolicyConfig(transforms=(Affine(),), key=tok, value=tok))
    assert h.state_nbytes == 2 * (4 * 64 * 2)  # K and V: float16 scale per (head, channel)
    assert len(encode_kv(kv, PolicyConfig(transforms=(Affine(),), key=tok, value=tok))) == h.total_nbytes
    # the x20 outlier channels no longer set every token's range: the other channels gain most
    assert scaled < plain and scaled_normal < 0.3 * plain_normal


# ----------------------------------------------------------------------------- mixhq


def test_mixhq_top_fraction_of_heads_by_score_gets_high_bits():
    g = torch.Generator().manual_seed(9)
    scores = torch.rand(4, 4, generator=g)  # 4 layers x 4 kv heads, N = 16
    quant = MixHQ(fraction=0.25, high_bits=8, low_bits=2, granularity="per_token", group_size=32).with_head_scores(scores)
    top = set(torch.argsort(scores.flatten(), descending=True)[:4].tolist())  # 0.25 * 16 = 4 heads
    x = heavy_tailed((1, 4, 64, 64), seed=2)
    for layer in range(4):
        bits = quant.quantize(x, layer=layer, kind="key").bits_per_head()
        expect = [9.0 if layer * 4 + h in top else 3.0 for h in range(4)]  # width + 1 bit of (scale, zero)/32
        assert bits.tolist() == expect
    # through the stream: the same heads, payload per segment
    h = read_header(encode_kv([(x, x)] * 4, PolicyConfig(key=quant, value=quant)))
    n_high = [sum(layer * 4 + i in top for i in range(4)) for layer in range(4)]
    for layer, (k_sec, _) in enumerate(h.sections):
        assert sorted(k_sec.payload) == sorted(
            p for p in (n_high[layer] * 64 * 64, (4 - n_high[layer]) * 64 * 64 * 2 // 8) if p)


def test_mixhq_ranking_is_global_deterministic_and_nested():
    scores = ((0.5, 0.5, 0.1), (0.5, 0.9, 0.5))  # ties at 0.5
    assert rank_heads(scores, 0.5) == ((True, True, False), (False, True, False))  # 3 of 6: 0.9, then ties by (layer, head)
    assert rank_heads(scores, 0.0) == ((False,) * 3, (False,) * 3)
    assert rank_heads(scores, 1.0) == ((True,) * 3, (True,) * 3)
    assert rank_heads(scores, 0.25) == ((True, False, False), (False, True, False))  # floor(1.5 + 0.5) = 2
    sets = [{(l, h) for l, row in enumerate(rank_heads(scores, f)) for h, v in enumerate(row) if v} for f in (0.1, 0.4, 0.7, 1.0)]
    assert all(a <= b for a, b in zip(sets, sets[1:]))
    # the scores travel in the policy: the decoder ranks the same heads
    cfg = PolicyConfig(key=MixHQ(fraction=0.5), value=NoQuantizer()).with_head_scores(scores)
    again = PolicyConfig.from_json(cfg.to_json())
    assert again == cfg and again.key.head_bits(3, layer=1, kind="key") == (2, 8, 2)


def test_mixhq_needs_scores_and_checks_their_shape():
    cfg = PolicyConfig(key=MixHQ(), value=MixHQ())
    assert cfg.needs_head_scores and not cfg.with_head_scores([[1.0, 2.0]]).needs_head_scores
    kv = make_kv([((1, 2, 8, 16), (1, 2, 8, 16))])
    with pytest.raises(ConfigError, match="mixhq needs head scores from a calibration pass"):
        encode_kv(kv, cfg)
    with pytest.raises(ConfigError, match="layer 1"):
        encode_kv(kv, cfg.with_head_scores([[1.0, 2.0]]), layer_offset=1)
    with pytest.raises(ConfigError, match="3 heads"):
        encode_kv(kv, cfg.with_head_scores([[1.0, 2.0, 3.0]]))
    for bad in ([[1.0, float("nan")]], [1.0, 2.0], [["a"]], [[True]]):
        with pytest.raises(ConfigError, match="head_scores"):
            cfg.with_head_scores(bad)
    with pytest.raises(ConfigError, match="low_bits"):
        MixHQ(high_bits=2, low_bits=4)


def test_with_head_scores_only_touches_head_ranking_quantizers():
    kivi = PolicyConfig.kivi(2)
    assert kivi.with_head_scores([[0.1]]) == kivi and not kivi.needs_head_scores
    mixed = PolicyConfig(key=MixHQ(), value=UniformQuantizer(bits=3))
    filled = mixed.with_head_scores(torch.tensor([[0.25, 0.75]]))
    assert filled.key.head_scores == ((0.25, 0.75),) and filled.value == mixed.value
    assert filled.policy_id != mixed.policy_id and filled.label == mixed.label
    assert filled.to_dict()["key"]["head_scores"] == [[0.25, 0.75]]


# ----------------------------------------------------------------------------- fp8


@pytest.mark.parametrize("fmt, dtype", [("e4m3", torch.float8_e4m3fn), ("e5m2", torch.float8_e5m2)])
def test_fp8_equals_torch_float8_cast(fmt, dtype):
    x = heavy_tailed((1, 2, 64, 64), seed=8, outliers=(3,))
    quant = FP8Quantizer(format=fmt)
    symbols, meta = quant.quantize_block(x)
    assert symbols.dtype == torch.uint8 and meta == {} and quant.symbol_bits == 8
    assert torch.equal(symbols, x.to(dtype).view(torch.uint8))
    (k2, _), = decode_kv(encode_kv([(x, x)], PolicyConfig(key=quant, value=quant)))
    assert torch.equal(k2, x.to(dtype).float())
    # saturation instead of inf / NaN
    big = torch.tensor([1e9, -1e9, 0.0]).reshape(1, 1, 1, 3)
    m = torch.finfo(dtype).max
    assert quant.dequantize_block(*quant.quantize_block(big), big.shape).flatten().tolist() == [m, -m, 0.0]


def test_fp8_scaled_uses_a_float16_per_token_scale():
    x = heavy_tailed((1, 2, 64, 64), seed=8, outliers=(3,)) * 1e-3
    quant = FP8Quantizer(format="e4m3", scaled=True)
    q = quant.quantize(x, layer=0, kind="value")
    assert q.parts[0].meta["scale"].shape == (1, 2, 64) and q.bits_per_element() == 8 + 16 / 64
    y = quant.dequantize(q, layer=0, kind="value")
    # every token's absmax lands on the top of the float8 range
    assert torch.equal(q.parts[0].symbols.view(torch.float8_e4m3fn).float().abs().amax(-1), torch.full((1, 2, 64), 448.0))
    assert float((y - x).norm() / x.norm()) < 0.05
    unscaled = FP8Quantizer().dequantize_block(*FP8Quantizer().quantize_block(x), x.shape)
    assert float((y - x).norm()) < float((unscaled - x).norm())  # tiny values: the scale pays off
    z = torch.zeros(1, 1, 2, 8)
    assert torch.equal(quant.dequantize(quant.quantize(z, layer=0, kind="key"), layer=0, kind="key"), z)


# ----------------------------------------------------------------------------- import graph


def _codec_imports() -> dict[str, set[str]]:
    """``{module: kvtune modules it imports}`` for every module of kvtune.codecs, counting
    imports inside functions too (a lazy import still closes a circle)."""
    import ast
    from pathlib import Path

    import kvtune

    root = Path(kvtune.__file__).parent
    modules = {".".join(("kvtune", *p.relative_to(root).with_suffix("").parts)).removesuffix(".__init__"): p
               for p in root.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        if not name.startswith("kvtune.codecs."):
            continue
        edges = graph.setdefault(name, set())
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                edges |= {a.name for a in node.names if a.name in modules}
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("kvtune"):
                for a in node.names:
                    assert not a.name.startswith("_"), f"{name} imports the private name {a.name} from {node.module}"
                    full = f"{node.module}.{a.name}"
                    edges.add(full if full in modules else node.module)
        edges.discard(name)
    return graph


def test_codec_modules_import_each_other_without_circles_or_private_names():
    graph = _codec_imports()
    assert {"kvtune.codecs.policy", "kvtune.codecs.fastpath", "kvtune.codecs.stream"} <= set(graph)
    done: set[str] = set()

    def visit(module: str, path: tuple[str, ...]) -> None:
        assert module not in path, "import circle: " + " -> ".join(path[path.index(module):] + (module,))
        if module in done:
            return
        for dep in graph.get(module, ()):
            visit(dep, path + (module,))
        done.add(module)

    for module in graph:
        visit(module, ())


# ----------------------------------------------------------------------------- value range

FP16_MAX = 65504.0
RANGE_POLICIES = {
    "kivi-2": PolicyConfig.kivi(2),
    "u8-per-token": PolicyConfig.from_dict({"key": {"bits": 8}, "value": {"bits": 8, "granularity": "per_channel"}}),
    "u1-symmetric": PolicyConfig.from_dict({"key": {"bits": 1, "symmetric": True}, "value": {"bits": 1}}),
    "fp8-scaled": PolicyConfig(key=FP8Quantizer(scaled=True), value=FP8Quantizer(format="e5m2", scaled=True)),  # V: e5m2
    "mixhq": PolicyConfig(key=QUANTIZER_EXAMPLES["mixhq"][0], value=QUANTIZER_EXAMPLES["mixhq"][2]),
    "none": PolicyConfig.uncompressed(),
    "hadamard-delta": PolicyConfig(transforms=(Delta(group_size=4), Hadamard()), key=UNIFORM[2], value=UNIFORM[9]),
}
# the largest magnitude each policy's blocks code faithfully (float16 scales / zero points;
# bfloat16 for "none"; 1-bit groups span at most 65504 in one float16 scale)
RANGE_LIMITS = {"kivi-2": FP16_MAX, "u8-per-token": FP16_MAX, "u1-symmetric": FP16_MAX / 2, "fp8-scaled": FP16_MAX * 57344,
                "mixhq": FP16_MAX, "none": float(torch.finfo(torch.bfloat16).max), "hadamard-delta": FP16_MAX}


def _range_kv(dtype, value: float):
    """Layers 3 and 4 (mixhq's scores give them 2 and 1 heads) with ``value`` in layer 4's V."""
    kv = make_kv([((1, 2, 40, 64), (1, 2, 40, 64)), ((1, 1, 40, 64), (1, 1, 40, 64))], dtype=dtype, seed=21)
    kv[1][1][0, 0, 7, 5] = value
    return kv


@pytest.mark.parametrize("impl", ["fast", "reference"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", list(RANGE_POLICIES))
def test_values_beyond_what_a_quantizer_represents_are_refused_at_encode(name, dtype, impl):
    """A finite value beyond a block's range is refused with a typed error naming the layer,
    K/V and the limit (float16 scales used to saturate: 3e38 decoded to ~4e6), on both paths;
    the same value inside the range round-trips."""
    cfg, limit = RANGE_POLICIES[name], RANGE_LIMITS[name]
    big = float(torch.finfo(dtype).max)
    for value in (big, -big, 3e38, 1e6, -70000.0):
        stored = float(torch.tensor(value, dtype=dtype))
        kv = _range_kv(dtype, value)
        spread = 8 if name == "hadamard-delta" else 1  # a rotation spreads one spike over 64 channels: /sqrt(64)
        if abs(stored) / spread <= limit:
            continue
        with pytest.raises(KVInputError, match=r"layer 4 value: .*exceeds " + re.escape(f"{limit:g}")):
            encode_kv(kv, cfg, layer_offset=MATRIX_OFFSET, impl=impl)
    inside = 0.9 * min(limit, big) if name != "hadamard-delta" else 1000.0
    kv = _range_kv(dtype, inside)
    stream = encode_kv(kv, cfg, layer_offset=MATRIX_OFFSET, impl=impl)
    assert stream == encode_kv(kv, cfg, layer_offset=MATRIX_OFFSET, impl="reference")
    (_, v1), = decode_kv(stream, impl=impl)[1:]
    assert torch.isfinite(v1).all()
    assert float(v1[0, 0, 7, 5]) == pytest.approx(float(kv[1][1][0, 0, 7, 5]), rel=0.55)


@pytest.mark.parametrize("impl", ["fast", "reference"])
@pytest.mark.parametrize("name", list(RANGE_POLICIES))
def test_float16_extremes_decode_finite_and_close(name, impl):
    """Finite float16 inputs at +-65504 decode to finite float16 values (bfloat16 rounding
    and float16 scales rounded up used to overflow to inf), or -- where a transform or a 1-bit
    group pushes them beyond a block's range -- are refused at encode."""
    cfg = RANGE_POLICIES[name]
    kv = make_kv([((1, 2, 40, 64), (1, 2, 40, 64))], dtype=torch.float16, seed=4)
    for t in kv[0]:
        t[0, 0, :, 0] = FP16_MAX
        t[0, 1, 3, :] = -FP16_MAX
        t[0, 0, 10:20, 7] = 65000.0
    if name in ("u1-symmetric", "hadamard-delta"):
        with pytest.raises(KVInputError, match=re.escape(f"{RANGE_LIMITS[name]:g}")):
            encode_kv(kv, cfg, layer_offset=MATRIX_OFFSET, impl=impl)
        return
    stream = encode_kv(kv, cfg, layer_offset=MATRIX_OFFSET, impl=impl)
    (k, v), = decode_kv(stream, impl=impl)
    (k_ref, v_ref), = decode_kv(stream, impl="reference")
    assert torch.equal(k, k_ref) and torch.equal(v, v_ref)
    for orig, dec in ((kv[0][0], k), (kv[0][1], v)):
        assert dec.dtype == torch.float16 and torch.isfinite(dec).all()
        big = orig.abs() >= 65000
        err = (dec.float() - orig.float())[big].abs().max()
        assert err <= {"kivi-2": 3 * FP16_MAX / 3 / 2 + 64}.get(name, 0.01 * FP16_MAX), float(err)


def test_affine_represents_values_beyond_float16_exactly_enough():
    """``affine`` divides a channel by its (saturated) float16 scale, so a channel of 1e6 values
    fits the quantizer's float16 range and round-trips (the scale is applied back exactly)."""
    kv = make_kv([((1, 2, 40, 64), (1, 2, 40, 64))], seed=9)
    kv[0][0][..., 3] = 1e6 + 1e4 * kv[0][0][..., 3]
    cfg = PolicyConfig(transforms=(Affine(statistic="absmax"),), key=UNIFORM[9], value=UNIFORM[9])
    for impl in ("fast", "reference"):
        (k, _), = decode_kv(encode_kv(kv, cfg, impl=impl), impl=impl)
        assert torch.allclose(k[..., 3], kv[0][0][..., 3], rtol=5e-3)


# ----------------------------------------------------------------------------- limits found by fuzzing (2026-12-03)


def test_a_group_size_beyond_the_axis_is_one_group_on_every_path():
    """``group_size`` may be up to 2**31 - 1: the reference and device paths used to pad every
    row to it (``group``), allocating ~17 GB for a 25 KB stream the fast path writes in
    milliseconds. A group longer than its axis is one group of the whole axis."""
    from kvtune.codecs.quantizers import group

    x = torch.arange(12.0).reshape(1, 2, 3, 2)
    assert group(x, 2, 2**31 - 1).shape == (1, 2, 1, 3, 2) and torch.equal(group(x, 2, 3), group(x, 2, 2**31 - 1))
    huge = UniformQuantizer(bits=2, granularity="per_channel", group_size=2**31 - 1, recent_tokens=4)
    cfg = PolicyConfig(key=huge, value=UniformQuantizer(bits=3, granularity="per_token", group_size=2**31 - 1))
    kv = make_kv([((1, 2, 40, 16), (1, 2, 40, 16))], dtype=torch.bfloat16)
    stream = encode_kv(kv, cfg)
    assert encode_kv(kv, cfg, impl="reference") == stream == encode_kv(kv, cfg, impl="torch")
    for (k, v), (k2, v2) in zip(decode_kv(stream, impl="reference"), decode_kv(stream, impl="fast")):
        assert torch.equal(k, k2) and torch.equal(v, v2)


def test_encode_refuses_a_layer_offset_the_decoder_would_refuse():
    kv = make_kv([((1, 2, 8, 16), (1, 2, 8, 16))] * 2)
    last = 2**31 - 2  # the largest first layer for 2 layers (layers 0 .. 2**31 - 1)
    assert read_header(encode_kv(kv, PolicyConfig.kivi(2), layer_offset=last)).layer_offset == last
    for bad in (last + 1, 2**40):
        with pytest.raises(ValueError, match="largest layer index"):
            encode_kv(kv, PolicyConfig.kivi(2), layer_offset=bad)


def test_checksum_helpers_refuse_a_header_of_a_longer_stream():
    short = encode_kv(make_kv([((1, 2, 8, 16), (1, 2, 8, 16))]), PolicyConfig.kivi(2))
    long_header = read_header(encode_kv(make_kv([((1, 2, 64, 16), (1, 2, 64, 16))]), PolicyConfig.kivi(2)))
    with pytest.raises(TruncatedStreamError):
        stream_checksum(short, long_header)
    with pytest.raises(TruncatedStreamError):
        check_checksum(short, long_header)


@pytest.mark.parametrize("impl", ["auto", "reference"])
def test_out_tensors_in_the_streams_own_buffer_are_refused_and_out_is_returned(impl):
    """Decoding into tensors that alias the stream being read would overwrite its input (the
    fast path then saw a checksum mismatch on an intact stream): refused before decoding. With
    valid ``out``, every path returns that very list."""
    kv = make_kv([((1, 2, 8, 16), (1, 2, 8, 16))], dtype=torch.bfloat16)
    stream = bytearray(encode_kv(kv, PolicyConfig.kivi(2)))
    alias = torch.frombuffer(stream, dtype=torch.bfloat16, count=2 * 8 * 16, offset=64).view(1, 2, 8, 16)
    with pytest.raises(KVInputError, match="stream's buffer"):
        decode_kv(stream, impl=impl, out=[(alias, torch.empty(1, 2, 8, 16, dtype=torch.bfloat16))])
    out = [(torch.empty(1, 2, 8, 16, dtype=torch.bfloat16), torch.empty(1, 2, 8, 16, dtype=torch.bfloat16))]
    assert decode_kv(bytes(stream), impl=impl, out=out) is out


# ----------------------------------------------------------------------------- the batch route
# (bit-packed policies without transforms: one kernel call per codec thread, straight into the
# stream bytes and the output tensors; kvtune.codecs.fastpath.encode_plan / decode_plan)


def test_batch_route_takes_strided_and_float16_inputs_and_gives_the_reference_bytes():
    from kvtune.codecs import fastpath
    from kvtune.codecs.stream import read_header

    cfg = PolicyConfig.kivi(2)
    for dtype in (torch.bfloat16, torch.float32, torch.float16):
        kv = make_kv(MATRIX_SHAPES[:3], dtype=dtype)
        wide = kv[1][0].transpose(2, 3).contiguous().transpose(2, 3)  # the same values, strided
        kv[1] = (wide, kv[1][1])
        assert not kv[1][0].is_contiguous()
        shapes = [(tuple(k.shape), tuple(v.shape)) for k, v in kv]
        assert fastpath.encode_plan(cfg, shapes, 3) is not None  # the batch route, not the per-tensor one
        stream = encode_kv(kv, cfg, layer_offset=3, impl="fast")
        assert stream == encode_kv(kv, cfg, layer_offset=3, impl="reference")
        header = read_header(stream)
        if dtype != torch.float16:  # float16 output saturates: decoded tensor by tensor
            assert fastpath.decode_plan(cfg, header, dtype) is not None
        for pair, ref in zip(decode_kv(stream, impl="fast"), decode_kv(stream, impl="reference")):
            assert all(torch.equal(a, b) for a, b in zip(pair, ref))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_batch_route_reports_the_first_bad_tensor_in_layer_order(dtype):
    """A NaN in layer 2's V and a value beyond float16 scales in layer 1's K: the batch route
    names layer 1's K, the first bad tensor (the reference checks every tensor's finiteness
    before it codes any); with only the NaN left, both name layer 2's V."""
    cfg = PolicyConfig.kivi(2)
    kv = make_kv(MATRIX_SHAPES[:3], dtype=dtype)
    kv[2][1][0, 0, 0, 1] = float("nan")
    if dtype == torch.float32:
        kv[1][0][1, 0, 2, 3] = 1e30
        with pytest.raises(KVInputError, match=r"layer 4 key: a value of magnitude 1e\+30"):
            encode_kv(kv, cfg, layer_offset=3, impl="fast")
        kv[1][0][1, 0, 2, 3] = 0.0
    for impl in ("fast", "reference"):
        with pytest.raises(KVInputError, match=r"kv\[2\] V has non-finite values"):
            encode_kv(kv, cfg, layer_offset=3, impl=impl)


def test_a_rotation_that_overflows_float32_is_named_in_the_range_error():
    """Finite input whose rotation overflows float32 (every value the largest bfloat16): the
    range error says so on both paths, instead of printing a magnitude of nan."""
    big = torch.finfo(torch.bfloat16).max
    kv = [(torch.full((1, 2, 40, 32), big, dtype=torch.bfloat16), torch.randn(1, 2, 40, 32).bfloat16())]
    cfg = PolicyConfig.from_dict(dict(transforms=["hadamard"], key=dict(name="uniform", bits=4),
                                      value=dict(name="uniform", bits=4)))
    for impl in ("fast", "reference"):
        with pytest.raises(KVInputError, match=r"layer 0 key: a value that overflows float32 \(inf / NaN\)"):
            encode_kv(kv, cfg, impl=impl)


@pytest.mark.parametrize("transforms", [["hadamard"], ["delta", "hadamard"], [{"name": "affine", "shift": True}]])
def test_batch_route_with_transforms_raises_as_the_reference(transforms):
    """With transforms on the batch route the range check sees the transformed tensor: a value
    beyond float16 scales after the transforms, or a NaN, raises the reference's error; with
    both (in different tensors) the first bad tensor in layer order is named, as on the
    per-tensor fast route."""
    cfg = PolicyConfig.from_dict(dict(transforms=transforms, key=dict(name="uniform", bits=2, granularity="per_channel"),
                                      value=dict(name="uniform", bits=2), codec="bitpack"))
    assert fastpath.encode_plan(cfg, MATRIX_SHAPES[:3], 3) is not None
    kv = make_kv(MATRIX_SHAPES[:3], dtype=torch.float32)
    assert encode_kv(kv, cfg, layer_offset=3, impl="fast") == encode_kv(kv, cfg, layer_offset=3, impl="reference")

    def error(impl):
        with pytest.raises(KVInputError) as info:
            encode_kv(kv, cfg, layer_offset=3, impl=impl)
        return str(info.value)

    kv[1][0][0, 0, 2, 3] = 1e38
    huge = error("reference")
    assert error("fast") == huge and "layer 4 key: a value of magnitude" in huge
    kv[2][1][0, 0, 0, 1] = float("nan")
    assert error("fast") == huge
    kv[1][0][0, 0, 2, 3] = 0.0
    assert error("fast") == error("reference") and "kv[2] V has non-finite values" in error("fast")


QUAROT_LIKE = [p for p in POLICIES if len(p.transforms) == 1 and isinstance(p.transforms[0], Hadamard)
               and all(isinstance(q, UniformQuantizer) and q.granularity == "per_token" and not (q.sink_tokens or q.recent_tokens)
                       for q in (p.key, p.value))
               and p.codec == BitPack()]
"""Policies whose every segment the batch kernels rotate in their row loads (no bfloat16 windows)."""


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("cfg", QUAROT_LIKE + [load_presets()["quarot-4"]], ids=_id)
def test_batch_route_fuses_a_lone_rotation_and_gives_the_reference_bytes(cfg, dtype):
    """A lone ``hadamard`` before per-token keys and values is fused into the batch kernels'
    row loads (no float32 work array): the reference's stream, its decode (fresh and into
    preallocated tensors), and its errors for a value beyond float16 scales after the rotation
    and for a NaN."""
    shapes = MATRIX_SHAPES[:3]
    assert fastpath.encode_plan(cfg, shapes, 3) is not None  # the batch route, not the per-tensor one
    kv = make_kv(shapes, dtype=dtype, seed=11)
    stream = encode_kv(kv, cfg, layer_offset=3, impl="fast")
    assert stream == encode_kv(kv, cfg, layer_offset=3, impl="reference")
    assert fastpath.decode_plan(cfg, read_header(stream), dtype) is not None
    ref = decode_kv(stream, impl="reference")
    out = [(torch.empty_like(k), torch.empty_like(v)) for k, v in kv]
    for got in (decode_kv(stream, impl="fast"), decode_kv(stream, impl="fast", out=out)):
        assert all(torch.equal(a, b) for pair, rpair in zip(got, ref) for a, b in zip(pair, rpair))

    def error(impl):
        with pytest.raises(KVInputError) as info:
            encode_kv(kv, cfg, layer_offset=3, impl=impl)
        return str(info.value)

    if dtype == torch.float32:
        kv[1][1][0, 0, 2, 3] = 3e38
        assert error("fast") == error("reference") and "layer 4 value: a value of magnitude" in error("fast")
        kv[1][1][0, 0, 2, 3] = 0.0
    kv[2][0][0, 1, 0, 5] = float("nan")
    assert error("fast") == error("reference") and "kv[2] K has non-finite values" in error("fast")


def test_the_in_place_stream_writer_gives_the_joined_stream():
    """write_stream_in_place (sections written where they end up) == write_stream (sections
    joined), with and without the selection block; a failing producer leaves nothing behind."""
    import zlib

    from kvtune.codecs.stream import stream_head, write_stream, write_stream_in_place

    rng = np.random.default_rng(3)
    shapes = [((1, 2, 9, 4), (1, 2, 9, 4)), ((1, 2, 5, 4), (1, 2, 5, 4))]
    sections = [tuple([rng.integers(0, 256, n, dtype=np.uint8).tobytes() for n in lens] for lens in ([0, 6, 3], [2, 1, 4, 5, 0]))
                for _ in shapes]
    fields = dict(policy=PolicyConfig.kivi(2).to_dict(), policy_id=PolicyConfig.kivi(2).policy_id, layer_offset=2,
                  dtype="bfloat16", shapes=shapes)
    lengths = [[[len(b) for b in parts] for parts in pair] for pair in sections]
    body = b"".join(b for pair in sections for parts in pair for b in parts)

    def write(buf):
        buf[:] = np.frombuffer(body, np.uint8)
        return zlib.crc32(body)

    for selection in ({}, dict(source_tokens=[12, 9], masks=[bytes([0xFF, 0x01] * 2), bytes([0x1F, 0] * 2)])):
        want = write_stream(**fields, sections=sections, **selection)
        head = stream_head(**fields, lengths=lengths, **selection)
        got = write_stream_in_place(head=head, nbytes=len(body), write_sections=write, masks=selection.get("masks"))
        assert type(got) is bytes and got == want

    def fail(buf):
        raise KVInputError("producer failed")

    with pytest.raises(KVInputError, match="producer failed"):
        write_stream_in_place(head=stream_head(**fields, lengths=lengths), nbytes=len(body), write_sections=fail)


def test_filled_bytes_is_a_new_bytes_object_with_what_fill_wrote():
    from kvtune.codecs.newbytes import IN_PLACE, filled_bytes

    assert IN_PLACE  # CPython: no copy
    a = filled_bytes(5, lambda v: v.__setitem__(slice(None), [1, 2, 3, 4, 5]))
    b = filled_bytes(5, lambda v: v.__setitem__(slice(None), [1, 2, 3, 4, 5]))
    assert type(a) is bytes and a == bytes([1, 2, 3, 4, 5]) and a is not b and hash(a) == hash(b"\1\2\3\4\5")
    assert filled_bytes(0, lambda v: None) == b""
    with pytest.raises(ValueError, match="cannot have -1 bytes"):
        filled_bytes(-1, lambda v: None)
    with pytest.raises(ZeroDivisionError):
        filled_bytes(3, lambda v: 1 / 0)


def test_lazy_negation_views_encode_their_values_and_are_refused_as_out():
    """A tensor with the negative bit set (``torch._neg_view``: its memory holds ``-x``) encodes
    as ``x`` on every path; as an ``out=`` tensor it is refused (decode would write into its
    memory)."""
    cfg = PolicyConfig.kivi(2)
    for dtype in (torch.bfloat16, torch.float32):
        kv = make_kv(MATRIX_SHAPES[:2], dtype=dtype)
        lazy = [(torch._neg_view(-k), v) for k, v in kv]
        assert lazy[0][0].is_neg() and lazy[0][0].is_contiguous()
        want = encode_kv(kv, cfg, impl="reference")
        for impl in ("fast", "reference"):
            assert encode_kv(lazy, cfg, impl=impl) == want
        out = [(torch._neg_view(torch.empty_like(k)), torch.empty_like(v)) for k, v in decode_kv(want)]
        for impl in ("fast", "reference"):
            with pytest.raises(KVInputError, match=r"out\[0\] K is a lazy negation view"):
                decode_kv(want, out=out, impl=impl)


def test_sparse_kv_is_refused_with_a_typed_error():
    k = make_kv(MATRIX_SHAPES[:1])[0][0]
    for impl in ("fast", "reference"):
        with pytest.raises(KVInputError, match=r"kv\[0\] K has layout torch.sparse_coo"):
            encode_kv([(k.to_sparse(), k)], PolicyConfig.kivi(2), impl=impl)
