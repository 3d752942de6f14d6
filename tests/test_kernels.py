"""Every public kernel of :mod:`kvtune.codecs.kernels` against its plain torch/numpy/zlib reference.

One test (or a few) per kernel, on seeded random inputs plus edge cases: empty inputs, lengths
that are not a multiple of the 8-lane vector width or of the bit-packing unit, every symbol
width 1..8, saturating and extreme values, NaN/inf where a kernel tests finiteness. Each test
registers the kernels it covers in ``COVERED`` (decorator :func:`covers`);
:func:`test_every_public_kernel_has_a_case` fails when a public kernel has none. Whole
streams (fast path == reference path) are tested in ``test_codecs.py``.
"""

from __future__ import annotations

import ast
import importlib
import math
import pkgutil
import struct
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
from numba import njit

from kvtune.codecs import kernels as K
from kvtune.codecs.kernels import rans as KR
from kvtune.codecs.kernels import rans_lanes
from kvtune.codecs.kernels.quantize import store_rows
from kvtune.codecs.kernels.transforms import rotation_growth
from kvtune.codecs.base import meta_to_bytes
from kvtune.codecs.bitpack import pack_bits, unpack_bits
from kvtune.codecs.codebook import CodebookQuantizer, nf_table
from kvtune.codecs.fp8 import FP8_DTYPES, FP8Quantizer, fp8_encode
from kvtune.codecs.quantizers import NoQuantizer, UniformQuantizer, fp16_round_up
from kvtune.codecs.transforms import (
    Affine,
    block_scales,
    channel_stats,
    delta_decode,
    delta_encode,
    power_of_two_blocks,
    random_signs,
    rotate,
    unrotate,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")

COVERED: set[str] = set()


def covers(*names: str):
    """Register the kernels a test compares with their reference."""
    COVERED.update(names)
    return lambda fn: fn


def kernel_modules() -> list:
    """Every module of the :mod:`kvtune.codecs.kernels` package that holds kernels or their helpers
    (``cachedir``, which only chooses numba's cache folder, has its own test below)."""
    return [importlib.import_module(f"{K.__name__}.{m.name}") for m in pkgutil.iter_modules(K.__path__)
            if m.name != "cachedir"]


def imported_from_siblings(modules: list) -> set[str]:
    """Names that a module of the package imports from another module of the package."""
    names = set()
    for mod in modules:
        for node in ast.walk(ast.parse(Path(mod.__file__).read_text())):
            if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith(K.__name__)):
                names.update(a.name for a in node.names)
    return names


def test_every_public_kernel_has_a_case():
    """Adding a public function to a module of the kernels package without a case here fails
    (and a case for a kernel that no longer exists fails too). The kernels are the functions
    the package's ``__all__`` lists (its public face, re-exported from their modules); any other
    public function of a module must be a helper that another module of the package imports."""
    kernels = {n for n in K.__all__ if callable(getattr(K, n))}
    assert kernels - COVERED == set(), "kernels without a reference case"
    assert COVERED - kernels == set(), "cases for kernels that do not exist"
    modules = kernel_modules()
    shared = imported_from_siblings(modules)
    defined = set()
    for mod in modules:
        public = {n for n, o in vars(mod).items()
                  if not n.startswith("_") and callable(o) and getattr(o, "__module__", None) == mod.__name__}
        defined |= public
        assert public - kernels <= shared, f"{mod.__name__}: public functions neither kernels nor shared helpers"
        assert all(getattr(K, n) is getattr(mod, n) for n in public & kernels), f"{mod.__name__}: re-export is a copy"
    assert kernels <= defined, "kernels in __all__ that no module of the package defines"


# ----------------------------------------------------------------------------- helpers


def bits16(t: torch.Tensor) -> np.ndarray:
    """uint16 bit patterns of a bfloat16/float16 tensor."""
    return t.contiguous().view(torch.int16).numpy().view(np.uint16)


def bf16_bits(x: torch.Tensor) -> np.ndarray:
    return bits16(x.to(torch.bfloat16))


def as_float(bits: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    return torch.from_numpy(bits.view(np.int16).copy()).view(dtype).to(torch.float32)


def student_t(shape, seed: int, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(shape, generator=g)
    chi2 = torch.randn((3, *shape), generator=g).pow(2).sum(0)
    return z / torch.sqrt(chi2 / 3.0) * scale


def with_extremes(x: torch.Tensor) -> torch.Tensor:
    """Plant saturating and degenerate rows: the float16 maximum and beyond, a zero row, a
    constant row, tiny values (when there are enough rows)."""
    x = x.clone()
    if x.numel() == 0:
        return x
    flat = x.reshape(-1, x.shape[-1])
    if flat.shape[0] >= 5:
        flat[0, 0] = 1e6
        flat[1, :] = 0.0
        flat[2, :] = 3.25
        flat[3, :] *= 1e-30
        flat[4, -1] = -65504.0
    return x


def idx(a) -> np.ndarray:
    return np.asarray(a, dtype=np.int64)


# (B, H, T, D) shapes: D a multiple of 8 and not (13), one token, no tokens
SHAPES = [(2, 3, 37, 64), (1, 2, 9, 13), (1, 3, 1, 16), (1, 2, 0, 16)]
SELECTIONS = [(None, None), ([2, 0], [0, 3, 4]), ([1], [5, 1, 2, 8])]


def selection(shape, sel):
    heads = idx(range(shape[1]) if sel[0] is None else [h for h in sel[0] if h < shape[1]])
    tokens = idx(range(shape[2]) if sel[1] is None else [t for t in sel[1] if t < shape[2]])
    return heads, tokens


def pick(x: torch.Tensor, heads, tokens) -> torch.Tensor:
    return x[:, torch.from_numpy(heads)][:, :, torch.from_numpy(tokens)]


def kernel_input(x: torch.Tensor, dtype: str) -> tuple[np.ndarray, torch.Tensor]:
    """The kernel's view of ``x`` (float32 array or bfloat16 bits) and the float32 values the
    reference sees."""
    if dtype == "bf16":
        xb = x.to(torch.bfloat16)
        return bits16(xb).copy(), xb.to(torch.float32)
    return x.numpy().copy(), x


OUT_KINDS = [(0, torch.float32), (1, torch.bfloat16), (2, torch.float16)]


def out_array(shape, kind: int) -> np.ndarray:
    """A sentinel-filled output buffer (so that writes outside the segment are caught)."""
    if kind == 0:
        return np.full(shape, -7.0, np.float32)
    return np.full(shape, 0x1234, np.uint16)


def expected_out(shape, kind: int, dtype, heads, tokens, values: torch.Tensor) -> np.ndarray:
    """The sentinel buffer with ``values`` converted to ``dtype`` written at ``heads`` x ``tokens``."""
    out = out_array(shape, kind)
    conv = values.to(dtype)
    arr = conv.numpy() if kind == 0 else bits16(conv)
    out[np.ix_(range(shape[0]), heads, tokens, range(shape[3]))] = arr
    return out


# ----------------------------------------------------------------------------- scalar conversions


@njit(cache=False)
def _map_f2h(x, out, soft):
    for i in range(x.size):
        out[i] = K.f32_to_f16_bits_soft(x[i]) if soft else K.f32_to_f16_bits(x[i])


@njit(cache=False)
def _map_h2f(h, out, soft):
    for i in range(h.size):
        out[i] = K.f16_bits_to_f32_soft(h[i]) if soft else K.f16_bits_to_f32(h[i])


@njit(cache=False)
def _map_bf16(x, out):
    for i in range(x.size):
        out[i] = K.f32_to_bf16_bits(x[i])


@njit(cache=False)
def _map_round_up(x, out):
    for i in range(x.size):
        out[i] = K.fp16_round_up_bits(x[i])


def f16_boundary_inputs(seed: int = 0) -> np.ndarray:
    """float32 inputs that decide float16 rounding: every float16 value, every midpoint between
    neighbours and the float32 values on either side of it, the overflow threshold, random bit
    patterns (NaN excluded: tested separately)."""
    allh = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.float16).to(torch.float32).numpy()
    finite = np.unique(allh[np.isfinite(allh)]).astype(np.float64)
    mids = ((finite[1:] + finite[:-1]) / 2).astype(np.float32)  # exact: 12 significant bits
    up, down = np.nextafter(mids, np.float32(np.inf)), np.nextafter(mids, np.float32(-np.inf))
    special = np.array([65504, 65519.99, 65520, -65520, 1e30, -1e30, np.inf, -np.inf, 0.0, -0.0, 2**-25, -(2**-25),
                        2**-24, 1.5 * 2**-25, np.finfo(np.float32).max, np.finfo(np.float32).tiny], np.float32)
    rnd = np.random.default_rng(seed).integers(0, 2**32, size=200_000, dtype=np.uint64).astype(np.uint32).view(np.float32)
    x = np.concatenate([allh, mids, up, down, special, rnd]).astype(np.float32)
    return x[~np.isnan(x)]


@covers("f32_to_f16_bits", "f32_to_f16_bits_soft")
@pytest.mark.parametrize("soft", [False, True], ids=["default", "soft"])
def test_f32_to_f16_matches_torch(soft):
    x = f16_boundary_inputs()
    out = np.empty(x.size, np.int64)
    _map_f2h(x, out, soft)
    ref = bits16(torch.from_numpy(x).to(torch.float16)).astype(np.int64)
    bad = np.flatnonzero(out != ref)
    assert bad.size == 0, (x[bad[:5]], out[bad[:5]], ref[bad[:5]])
    nan = np.array([np.nan, -np.nan], np.float32)
    nan = np.concatenate([nan, np.array([0x7F800001, 0xFFC00000, 0x7FFFFFFF], np.uint32).view(np.float32)])
    res = np.empty(nan.size, np.int64)
    _map_f2h(nan, res, soft)
    assert (((res >> 10) & 0x1F) == 0x1F).all() and ((res & 0x3FF) != 0).all() and (res & 0x200).all()  # quiet NaN


@covers("f16_bits_to_f32", "f16_bits_to_f32_soft")
@pytest.mark.parametrize("soft", [False, True], ids=["default", "soft"])
def test_f16_to_f32_exhaustive(soft):
    h = np.arange(65536, dtype=np.int64)
    out = np.empty(65536, np.float32)
    _map_h2f(h, out, soft)
    ref = torch.from_numpy(h.astype(np.uint16).view(np.int16)).view(torch.float16).to(torch.float32).numpy()
    nan = np.isnan(ref)
    assert nan.sum() == 2 * 1023 and np.isnan(out[nan]).all()
    assert np.array_equal(out[~nan].view(np.uint32), ref[~nan].view(np.uint32))  # bit exact, signed zeros included


@covers("f32_to_bf16_bits")
def test_f32_to_bf16_matches_torch_and_nan_is_canonical():
    x = f16_boundary_inputs(seed=1)
    bf = np.arange(65536, dtype=np.uint32) << 16  # every bfloat16 value and its rounding midpoints
    extra = np.concatenate([bf, bf + 0x8000, bf + 0x7FFF, bf + 0x8001]).astype(np.uint32).view(np.float32)
    x = np.concatenate([x, extra[~np.isnan(extra)]])
    out = np.empty(x.size, np.int64)
    _map_bf16(x, out)
    ref = bits16(torch.from_numpy(x).to(torch.bfloat16)).astype(np.int64)
    assert np.array_equal(out, ref)
    nan = np.array([0x7F800001, 0xFFFFFFFF, 0x7FC00000], np.uint32).view(np.float32)
    res = np.empty(3, np.int64)
    _map_bf16(nan, res)
    assert (res == 0x7FC0).all()


@njit(cache=False)
def _store_rows_bf16(blk, out):
    dst = np.zeros(1, np.int64)
    store_rows(blk, dst, blk.size // 16, 16, True, out, 1)


def test_the_16_lane_bf16_store_matches_f32_to_bf16_bits():
    """The decoders' vector store into bfloat16 output (``store_rows`` and the dequantizers'
    stores, one conversion, ``vcvtneps2bf16`` where the CPU has AVX512-BF16) gives the bits of
    the scalar reference on every bfloat16 value, its rounding midpoints and neighbours,
    subnormals and random patterns; a vector holding a NaN or a subnormal among normal values
    converts as the reference too (NaN as 0x7FC0; the instruction alone would flush subnormals
    and keep NaN payloads)."""
    bf = np.arange(65536, dtype=np.uint32) << 16
    x = np.concatenate([bf, bf + 0x8000, bf + 0x7FFF, bf + 0x8001]).astype(np.uint32).view(np.float32)
    rnd = np.random.default_rng(7).integers(0, 2**32, size=100_000, dtype=np.uint64).astype(np.uint32).view(np.float32)
    lone = np.full((4, 16), 1.5, np.float32)  # one odd lane among normal ones
    lone[0, 3], lone[1, 15] = np.nan, np.float32(1e-39)
    lone[2, 0] = np.array([0x7F800001], np.uint32).view(np.float32)[0]
    x = np.concatenate([x, rnd, lone.reshape(-1)])
    x = np.concatenate([x, np.zeros(-x.size % 16, np.float32)])
    want = np.empty(x.size, np.int64)
    _map_bf16(x, want)
    got = np.empty(x.size, np.uint16)
    _store_rows_bf16(x, got)
    assert np.array_equal(got.astype(np.int64), want)
    assert np.isnan(x).sum() > 1000 and (want[np.isnan(x)] == 0x7FC0).all()


@covers("fp16_round_up_bits")
def test_fp16_round_up_matches_reference():
    x = f16_boundary_inputs(seed=2)
    x = x[np.isfinite(x)]
    out = np.empty(x.size, np.int64)
    _map_round_up(x, out)
    ref = fp16_round_up(torch.from_numpy(x))
    ref = torch.where(ref == 0, torch.zeros_like(ref), ref)  # the canonical +0 of asymmetric_params
    assert np.array_equal(out, bits16(ref).astype(np.int64))


# ----------------------------------------------------------------------------- uniform quantizer


def uniform_cases():
    for shape in SHAPES:
        for gran in ("per_token", "per_channel"):
            for group in (0, 5, 32):
                for symmetric in (False, True):
                    yield shape, gran, group, symmetric


@covers("quantize_per_token", "quantize_per_channel")
@pytest.mark.parametrize("dtype", ["f32", "bf16"])
@pytest.mark.parametrize("bits", range(1, 9))
def test_uniform_quantize_matches_quantize_block(bits, dtype):
    for n, (shape, gran, group, symmetric) in enumerate(uniform_cases()):
        sel = SELECTIONS[n % len(SELECTIONS)]
        x = with_extremes(student_t(shape, seed=n, scale=3.0))
        xk, xref = kernel_input(x, dtype)
        heads, tokens = selection(shape, sel)
        q = UniformQuantizer(bits=bits, symmetric=symmetric, granularity=gran, group_size=group)
        sym_ref, meta_ref = q.quantize_block(pick(xref, heads, tokens))
        b, hs, ts, d = shape[0], len(heads), len(tokens), shape[3]
        sym = np.full((b, hs, ts, d), 0xEE, np.uint8)
        if gran == "per_token":
            g = group or d
            mshape = (b, hs, ts, -(-d // g))
            scale, zero = np.zeros(mshape, np.uint16), np.zeros(mshape, np.uint16)
            K.quantize_per_token(xk, heads, tokens, g, bits, symmetric, sym, scale, zero)
        else:
            g = max(group or ts, 1)
            mshape = (b, hs, -(-ts // g), d)
            scale, zero = np.zeros(mshape, np.uint16), np.zeros(mshape, np.uint16)
            K.quantize_per_channel(xk, heads, tokens, g, bits, symmetric, sym, scale, zero)
        case = (shape, gran, group, symmetric, sel)
        assert np.array_equal(sym, sym_ref.numpy()), case
        assert np.array_equal(scale, bits16(meta_ref["scale"]).reshape(mshape)), case
        if not symmetric:
            assert np.array_equal(zero, bits16(meta_ref["zero"]).reshape(mshape)), case
        assert int(sym.max(initial=0)) < 1 << bits


def random_f16_bits(shape, rng, *, nonneg: bool) -> np.ndarray:
    """float16 bit patterns of finite values (scales non-negative, including zero)."""
    v = rng.standard_normal(shape).astype(np.float32) * 2.0 ** rng.integers(-12, 6, size=shape)
    v = np.abs(v) if nonneg else v
    v.reshape(-1)[:2] = 0.0 if v.size >= 2 else v.reshape(-1)[:2]
    return bits16(torch.from_numpy(v).to(torch.float16)).copy()


@covers("dequantize_per_token", "dequantize_per_channel")
@pytest.mark.parametrize("bits", range(1, 9))
def test_uniform_dequantize_matches_dequantize_block(bits):
    rng = np.random.default_rng(bits)
    for n, (shape, gran, group, symmetric) in enumerate(uniform_cases()):
        heads, tokens = selection(shape, SELECTIONS[n % len(SELECTIONS)])
        b, hs, ts, d = shape[0], len(heads), len(tokens), shape[3]
        sym = rng.integers(0, 1 << bits, size=(b, hs, ts, d)).astype(np.uint8)
        q = UniformQuantizer(bits=bits, symmetric=symmetric, granularity=gran, group_size=group)
        g = (group or d) if gran == "per_token" else max(group or ts, 1)
        mshape = (b, hs, ts, -(-d // g)) if gran == "per_token" else (b, hs, -(-ts // g), d)
        scale = random_f16_bits(mshape, rng, nonneg=True)
        zero = random_f16_bits(mshape, rng, nonneg=False)
        meta = {"scale": torch.from_numpy(scale.view(np.int16)).view(torch.float16)}
        if not symmetric:
            meta["zero"] = torch.from_numpy(zero.view(np.int16)).view(torch.float16)
        ref = q.dequantize_block(torch.from_numpy(sym), meta, (b, hs, ts, d))
        fn = K.dequantize_per_token if gran == "per_token" else K.dequantize_per_channel
        for kind, dtype in OUT_KINDS:
            out = out_array(shape, kind)
            fn(sym, scale, zero, g, bits, symmetric, heads, tokens, out, kind)
            assert np.array_equal(out, expected_out(shape, kind, dtype, heads, tokens, ref)), (shape, gran, group, kind)


# ----------------------------------------------------------------------------- codebooks


def codebook_cases():
    for n, (shape, gran, group, minmax) in enumerate(uniform_cases()):
        yield shape, gran, group, "minmax" if minmax else "absmax", ("nf", "lloyd")[n % 2]
        yield shape, gran, group, "absmax" if minmax else "minmax", ("lloyd", "nf")[n % 2]


def codebook_groups(shape, gran, group, hs, ts):
    """``(g, metadata shape)`` of a codebook block of ``(B, hs, ts, D)``, as the fast path's table."""
    b, d = shape[0], shape[3]
    g = max(group or (d if gran == "per_token" else ts), 1)
    return g, ((b, hs, ts, -(-d // g)) if gran == "per_token" else (b, hs, -(-ts // g), d))


@covers("codebook_quantize")
@pytest.mark.parametrize("dtype", ["f32", "bf16"])
@pytest.mark.parametrize("bits", [2, 3, 4, 5, 8])
def test_codebook_quantize_matches_quantize_block(bits, dtype):
    """NF and fitted Lloyd codebooks, absmax and min/max groups, with the saturating and
    degenerate rows of :func:`with_extremes`: symbols, levels, scales and zero points."""
    for n, (shape, gran, group, normalize, levels) in enumerate(codebook_cases()):
        x = with_extremes(student_t(shape, seed=n, scale=3.0))
        xk, xref = kernel_input(x, dtype)
        heads, tokens = selection(shape, SELECTIONS[n % len(SELECTIONS)])
        q = CodebookQuantizer(bits=bits, levels=levels, normalize=normalize, granularity=gran, group_size=group)
        sym_ref, meta_ref = q.quantize_block(pick(xref, heads, tokens))
        b, hs, ts, d = shape[0], len(heads), len(tokens), shape[3]
        g, mshape = codebook_groups(shape, gran, group, hs, ts)
        sym = np.full((b, hs, ts, d), 0xEE, np.uint8)
        scale, zero = np.zeros(mshape, np.uint16), np.zeros(mshape, np.uint16)
        lv = np.zeros(1 << bits, np.uint16)
        K.codebook_quantize(xk, heads, tokens, gran == "per_token", g, normalize == "minmax", levels == "lloyd",
                            nf_table()[bits, : 1 << bits], sym, lv, scale, zero)
        case = (shape, gran, group, normalize, levels)
        assert np.array_equal(sym, sym_ref.numpy()), case
        assert np.array_equal(scale, bits16(meta_ref["scale"]).reshape(mshape)), case
        if normalize == "minmax":
            assert np.array_equal(zero, bits16(meta_ref["zero"]).reshape(mshape)), case
        if levels == "lloyd":
            assert np.array_equal(lv, bits16(meta_ref["levels"])), case
        assert int(sym.max(initial=0)) < 1 << bits


@covers("codebook_dequantize")
@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_codebook_dequantize_matches_dequantize_block(bits):
    """Random symbols, scales, zero points and sorted float16 codebooks in [-1, 1], into every
    output dtype."""
    rng = np.random.default_rng(bits)
    for n, (shape, gran, group, normalize, _) in enumerate(codebook_cases()):
        heads, tokens = selection(shape, SELECTIONS[n % len(SELECTIONS)])
        b, hs, ts, d = shape[0], len(heads), len(tokens), shape[3]
        sym = rng.integers(0, 1 << bits, size=(b, hs, ts, d)).astype(np.uint8)
        q = CodebookQuantizer(bits=bits, levels="lloyd", normalize=normalize, granularity=gran, group_size=group)
        g, mshape = codebook_groups(shape, gran, group, hs, ts)
        lv16 = torch.from_numpy(np.sort(rng.uniform(-1, 1, 1 << bits))).to(torch.float16)
        scale = random_f16_bits(mshape, rng, nonneg=True)
        zero = random_f16_bits(mshape, rng, nonneg=False)
        meta = {"levels": lv16, "scale": torch.from_numpy(scale.view(np.int16)).view(torch.float16)}
        if normalize == "minmax":
            meta["zero"] = torch.from_numpy(zero.view(np.int16)).view(torch.float16)
        ref = q.dequantize_block(torch.from_numpy(sym), meta, (b, hs, ts, d))
        for kind, dtype in OUT_KINDS:
            out = out_array(shape, kind)
            K.codebook_dequantize(sym, lv16.float().numpy(), scale, zero, gran == "per_token", g, normalize == "minmax",
                                  heads, tokens, out, kind)
            assert np.array_equal(out, expected_out(shape, kind, dtype, heads, tokens, ref)), (shape, gran, group, kind)


# ----------------------------------------------------------------------------- float8


@covers("fp8_quantize")
@pytest.mark.parametrize("dtype", ["f32", "bf16"])
@pytest.mark.parametrize("fmt, scaled", [("e4m3", False), ("e5m2", False), ("e4m3", True), ("e5m2", True)])
def test_fp8_quantize_matches_quantize_block(fmt, scaled, dtype):
    for n, shape in enumerate(SHAPES):
        x = with_extremes(student_t(shape, seed=10 + n, scale=100.0))  # beyond 448: saturates (unscaled e4m3)
        xk, xref = kernel_input(x, dtype)
        heads, tokens = selection(shape, SELECTIONS[n % len(SELECTIONS)])
        sym_ref, meta = FP8Quantizer(format=fmt, scaled=scaled).quantize_block(pick(xref, heads, tokens))
        b, hs, ts, d = shape[0], len(heads), len(tokens), shape[3]
        sym = np.full((b, hs, ts, d), 0xEE, np.uint8)
        sc = np.zeros((b, hs, ts), np.uint16)
        fmax = float(torch.finfo(FP8_DTYPES[fmt]).max)
        K.fp8_quantize(xk, heads, tokens, fmt == "e5m2", fmax, scaled, sym, sc)
        assert np.array_equal(sym, sym_ref.numpy()), (shape, fmt, scaled)
        if scaled:
            assert np.array_equal(sc, bits16(meta["scale"])), (shape, fmt)


@covers("fp8_dequantize")
@pytest.mark.parametrize("fmt, scaled", [("e4m3", False), ("e5m2", False), ("e4m3", True), ("e5m2", True)])
def test_fp8_dequantize_matches_dequantize_block(fmt, scaled):
    rng = np.random.default_rng(3)
    lut = torch.arange(256, dtype=torch.uint8).view(FP8_DTYPES[fmt]).to(torch.float32).numpy()
    finite = np.flatnonzero(np.isfinite(lut)).astype(np.uint8)  # every finite pattern (NaN payloads: not covered)
    for n, shape in enumerate(SHAPES):
        heads, tokens = selection(shape, SELECTIONS[n % len(SELECTIONS)])
        b, hs, ts, d = shape[0], len(heads), len(tokens), shape[3]
        sym = rng.choice(finite, size=(b, hs, ts, d)).astype(np.uint8)
        sc = random_f16_bits((b, hs, ts), rng, nonneg=True)
        meta = {"scale": torch.from_numpy(sc.view(np.int16)).view(torch.float16)} if scaled else {}
        ref = FP8Quantizer(format=fmt, scaled=scaled).dequantize_block(torch.from_numpy(sym), meta, (b, hs, ts, d))
        for kind, dtype in OUT_KINDS:
            out = out_array(shape, kind)
            K.fp8_dequantize(sym, sc, lut, scaled, heads, tokens, out, kind)
            assert np.array_equal(out, expected_out(shape, kind, dtype, heads, tokens, ref)), (shape, kind)


# ----------------------------------------------------------------------------- bfloat16 segments


@covers("gather_bf16")
@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_gather_bf16_matches_no_quantizer(dtype):
    for n, shape in enumerate(SHAPES):
        x = with_extremes(student_t(shape, seed=20 + n, scale=1e38 if n == 0 else 1.0))  # n = 0: overflow to inf
        xk, xref = kernel_input(x, dtype)
        heads, tokens = selection(shape, SELECTIONS[n % len(SELECTIONS)])
        ref, _ = NoQuantizer().quantize_block(pick(xref, heads, tokens))
        out = np.zeros((shape[0], len(heads), len(tokens), shape[3]), np.uint16)
        K.gather_bf16(xk, heads, tokens, out)
        assert np.array_equal(out, ref.numpy().view(np.uint16)), shape


@covers("scatter_bf16")
def test_scatter_bf16_matches_no_quantizer():
    rng = np.random.default_rng(4)
    for n, shape in enumerate(SHAPES):
        heads, tokens = selection(shape, SELECTIONS[n % len(SELECTIONS)])
        seg = (shape[0], len(heads), len(tokens), shape[3])
        sym = bf16_bits(torch.from_numpy(rng.standard_normal(seg).astype(np.float32) * 1e5))  # beyond float16: inf
        ref = NoQuantizer().dequantize_block(torch.from_numpy(sym.view(np.int16)), {}, seg)
        for kind, dtype in OUT_KINDS:
            out = out_array(shape, kind)
            K.scatter_bf16(sym.copy(), heads, tokens, out, kind)
            assert np.array_equal(out, expected_out(shape, kind, dtype, heads, tokens, ref)), (shape, kind)


@covers("all_finite_bf16", "all_finite_f32")
@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 33, 1000])
def test_all_finite_matches_isfinite(n):
    rng = np.random.default_rng(n)
    for bad in (None, np.nan, np.inf, -np.inf, 3e38):
        for pos in ((0, n - 1, n // 2) if n else (0,)):
            x = torch.from_numpy(rng.standard_normal(n).astype(np.float32) * 1e3)
            if bad is not None and n:
                x[pos] = bad
            for arr, fn, t in ((x.numpy(), K.all_finite_f32, x), (bf16_bits(x), K.all_finite_bf16, x.to(torch.bfloat16))):
                assert fn(arr) == bool(torch.isfinite(t).all()), (n, bad, pos, fn.__name__)
    x = np.zeros((2, 3, 5), np.float32)  # any shape
    x[1, 2, 4] = np.nan
    assert not K.all_finite_f32(x) and K.all_finite_f32(np.zeros((2, 3, 5), np.float32))


@covers("first_nonfinite_f16")
def test_first_nonfinite_f16_finds_the_first_range_with_a_nan_or_inf():
    rng = np.random.default_rng(5)
    values = [np.float16(x) for x in (rng.standard_normal(40) * 1e3)] + [np.float16(65504), np.float16(-0.0)]
    for bad in (None, np.nan, -np.nan, np.inf, -np.inf):
        for pos in (0, 17, 41):
            v = np.array(values, np.float16)
            if bad is not None:
                v[pos] = bad
            buf = np.concatenate([np.frombuffer(b"\x7c\x7e", np.uint8), v.view(np.uint8)])  # 2 bytes outside
            starts = np.array([0, 2, 2 + 36], np.int64)  # [NaN bytes] excluded below, [0:18), [18:42)
            ends = np.array([0, 2 + 36, 2 + 84], np.int64)
            ranges = [buf[a:b].view(np.float16) for a, b in zip(starts, ends)]
            ref = next((r for r, x in enumerate(ranges) if not torch.isfinite(torch.from_numpy(x.astype(np.float32))).all()), -1)
            assert K.first_nonfinite_f16(buf, starts, ends) == ref, (bad, pos)
    assert K.first_nonfinite_f16(np.zeros(0, np.uint8), np.zeros(0, np.int64), np.zeros(0, np.int64)) == -1


def test_crc32_folds_with_clmul_on_x86_hosts_that_have_it():
    """The fast CRC is not silently off on the development machines (x86-64 with pclmul; the
    512-bit fold with vpclmulqdq and AVX-512)."""
    import platform

    import llvmlite.binding as llvm

    x86 = platform.machine().lower() in ("x86_64", "amd64")
    features = llvm.get_host_cpu_features() if x86 else {}
    from numba.core import config

    if config.CPU_NAME is None and config.CPU_FEATURES is None:
        assert K.CRC32_CLMUL == bool(features.get("pclmul", False))
        assert K.CRC32_VPCLMUL == bool(K.CRC32_CLMUL and features.get("vpclmulqdq", False) and features.get("avx512f", False))


@covers("max_magnitude_bf16", "max_magnitude_f32")
@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 33, 1000])
def test_max_magnitude_matches_abs_amax(n):
    """The bit pattern of ``x.abs().amax()``; at or above inf's pattern exactly when a value is
    NaN or inf (then ``isfinite`` is False), for bfloat16 bits and float32."""
    rng = np.random.default_rng(n)
    for bad in (None, np.nan, -np.nan, np.inf, -np.inf, 3e38, -65504.0, 0.0):
        for pos in ((0, n - 1, n // 2) if n else (0,)):
            x = torch.from_numpy(rng.standard_normal(n).astype(np.float32) * 1e3)
            if bad is not None and n:
                x[pos] = bad
            for arr, fn, t, inf in ((x.numpy(), K.max_magnitude_f32, x, 0x7F800000),
                                    (bf16_bits(x), K.max_magnitude_bf16, x.to(torch.bfloat16), 0x7F80)):
                got = fn(arr)
                finite = bool(torch.isfinite(t).all())
                assert (got < inf) == finite, (n, bad, pos, fn.__name__)
                if finite:
                    ref = float(t.abs().amax()) if n else 0.0
                    shift = 16 if inf == 0x7F80 else 0
                    assert float(np.array([got << shift], np.uint32).view(np.float32)[0]) == ref, (n, bad, pos)
    x = np.zeros((2, 3, 5), np.float32)  # any shape; the sign does not count
    x[1, 2, 4] = -2.5
    assert K.max_magnitude_f32(x) == int(np.float32(2.5).view(np.uint32))


@covers("to_float32")
@pytest.mark.parametrize("n", [0, 1, 13, 64])
def test_to_float32_matches_torch(n):
    x = with_extremes(student_t((1, 2, 5, n), seed=n, scale=10.0)) if n else torch.zeros(1, 2, 5, 0)
    for xk, ref in ((x.numpy().copy(), x), (bf16_bits(x).copy(), x.to(torch.bfloat16).to(torch.float32))):
        out = np.full(x.shape, -1.0, np.float32)
        K.to_float32(xk, out)
        assert np.array_equal(out.view(np.uint32), ref.numpy().view(np.uint32))


@covers("store_output")
@pytest.mark.parametrize("n", [0, 1, 13, 64])
def test_store_output_matches_torch(n):
    y = student_t((1, 2, 5, n), seed=n, scale=3e4)  # float16 overflow to inf on the tails
    if n:
        y.reshape(-1)[0] = float("inf")
        y.reshape(-1)[-1] = 65519.99
    for kind, dtype in OUT_KINDS[1:]:
        out = np.zeros(y.shape, np.uint16)
        K.store_output(y.numpy().copy(), kind, out)
        assert np.array_equal(out, bits16(y.to(dtype)))


# ----------------------------------------------------------------------------- transforms


@covers("hadamard_rows")
@pytest.mark.parametrize("d", [8, 13, 16, 48, 64, 96, 128, 256, 512, 1])
def test_hadamard_rows_matches_rotate(d):
    """head_dim 8..256 (16 = one 16-lane vector, 48 = 32 + 16, 96 = 64 + 32): every block in
    registers; 13 (8 + 4 + 1), 512, 1: the loop path."""
    x = with_extremes(student_t((2, 3, 5, d), seed=d))
    signs = random_signs(0, 2, "key", 3, d)
    blocks, scales = idx(power_of_two_blocks(d)), np.array(block_scales(d), np.float32)
    fwd = x.numpy().copy()
    K.hadamard_rows(fwd, signs.numpy(), blocks, scales, False)
    ref = rotate(x, signs).numpy()
    assert np.array_equal(fwd.view(np.uint32), ref.view(np.uint32))
    inv = fwd.copy()
    K.hadamard_rows(inv, signs.numpy(), blocks, scales, True)
    assert np.array_equal(inv.view(np.uint32), unrotate(torch.from_numpy(ref), signs).numpy().view(np.uint32))
    empty = np.zeros((1, 3, 0, d), np.float32)
    K.hadamard_rows(empty, signs.numpy(), blocks, scales, False)


@covers("hadamard_load", "hadamard_store")
@pytest.mark.parametrize("d", [8, 64, 96, 13])
@pytest.mark.parametrize("t", [0, 1, 31, 32, 77])
def test_hadamard_load_and_store_match_convert_then_rotate(d, t):
    """Row chunks of 32 tokens (t = 31, 32, 77 cross chunk and head boundaries); 13: the loop path."""
    x = with_extremes(student_t((2, 3, t, d), seed=d + t))
    signs = random_signs(1, 3, "value", 3, d)
    blocks, scales = idx(power_of_two_blocks(d)), np.array(block_scales(d), np.float32)
    ref = rotate(x.to(torch.bfloat16).float(), signs).numpy()
    for src in (bits16(x.to(torch.bfloat16)), x.to(torch.bfloat16).float().numpy()):
        y = np.full(x.shape, np.nan, np.float32)
        K.hadamard_load(src, y, signs.numpy(), blocks, scales)
        assert np.array_equal(y.view(np.uint32), ref.view(np.uint32))
    back = unrotate(torch.from_numpy(ref), signs)
    for kind, dtype in ((1, torch.bfloat16), (2, torch.float16)):
        out = np.zeros(x.shape, np.uint16)
        K.hadamard_store(ref.copy(), signs.numpy(), blocks, scales, kind, out)
        assert np.array_equal(out, bits16(back.to(dtype)))
    out32 = np.zeros(x.shape, np.float32)
    K.hadamard_store(ref.copy(), signs.numpy(), blocks, scales, 0, out32)
    assert np.array_equal(out32.view(np.uint32), back.numpy().view(np.uint32))


ROTATED_SHAPES = [(2, 3, 77, 64), (1, 3, 37, 48), (1, 2, 5, 16), (1, 2, 0, 64), (1, 2, 4, 32), (1, 2, 33, 128),
                  (1, 1, 3, 256)]
"""Shapes whose Hadamard blocks are held in registers (64; 48 = 32 + 16; 16; 32; 128; 256): 77,
37 and 33 tokens cross the per-token kernels' blocks of 32 rows and the heads."""


def rotation_of(shape, seed: int = 0):
    """``(signs (H, D), blocks, scales)`` of a randomized Hadamard rotation for ``shape`` and its
    fused form ``rot`` (signs flattened), as the kernels take them."""
    signs = random_signs(seed, 1, "key", shape[1], shape[3]).numpy()
    blocks, scales = idx(power_of_two_blocks(shape[3])), np.array(block_scales(shape[3]), np.float32)
    return (signs, blocks, scales), (signs.reshape(-1).copy(), blocks, scales)


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
@pytest.mark.parametrize("bits", [1, 4, 8])
def test_a_fused_rotation_quantizes_as_rotate_then_quantize(bits, dtype):
    """``quantize_per_token(..., rot)`` on ``x`` gives the symbols and metadata of
    ``quantize_per_token`` on ``hadamard_rows(float32(x))``, for every head and token
    selection (consecutive tokens take the kernel's one-run blocks, the others its per-row
    addressing)."""
    for n, shape in enumerate(ROTATED_SHAPES):
        (signs, blocks, scales), rot = rotation_of(shape, n)
        xk, _ = kernel_input(with_extremes(student_t(shape, seed=n, scale=3.0)), dtype)
        y = np.zeros(shape, np.float32)
        K.to_float32(xk, y)
        K.hadamard_rows(y, signs, blocks, scales, False)
        for sel in (*SELECTIONS, (None, [4, 5, 6, 7]), ([2, 1], None)):
            heads, tokens = selection(shape, sel)
            for g, symmetric in ((shape[3], False), (16, True), (8, False)):
                b, hs, ts, d = shape[0], len(heads), len(tokens), shape[3]
                mshape = (b, hs, ts, -(-d // g))
                got = [np.full((b, hs, ts, d), 0xEE, np.uint8), np.zeros(mshape, np.uint16), np.zeros(mshape, np.uint16)]
                want = [a.copy() for a in got]
                K.quantize_per_token(xk, heads, tokens, g, bits, symmetric, *got, rot)
                K.quantize_per_token(y, heads, tokens, g, bits, symmetric, *want)
                for a, w in zip(got, want):
                    assert np.array_equal(a, w), (shape, sel, g, symmetric)


@pytest.mark.parametrize("bits", [2, 4])
def test_a_fused_rotation_dequantizes_as_dequantize_then_rotate_back(bits):
    """``dequantize_per_token(..., rot)`` writes what dequantizing into float32, rotating back
    (``hadamard_rows`` inverse) and converting gives, and leaves other rows alone: groups of
    16k channels (the blocks of rows) and of 8 (one row at a time), every output kind."""
    rng = np.random.default_rng(bits)
    for n, shape in enumerate(ROTATED_SHAPES):
        (signs, blocks, scales), rot = rotation_of(shape, n + 1)
        for sel in (*SELECTIONS, (None, [4, 5, 6, 7])):
            heads, tokens = selection(shape, sel)
            b, hs, ts, d = shape[0], len(heads), len(tokens), shape[3]
            for g, symmetric in ((d, False), (16, True), (8, False)):
                mshape = (b, hs, ts, -(-d // g))
                sym = rng.integers(0, 1 << bits, size=(b, hs, ts, d)).astype(np.uint8)
                scale, zero = random_f16_bits(mshape, rng, nonneg=True), random_f16_bits(mshape, rng, nonneg=False)
                y = np.zeros(shape, np.float32)
                K.dequantize_per_token(sym, scale, zero, g, bits, symmetric, heads, tokens, y, 0)
                K.hadamard_rows(y, signs, blocks, scales, True)
                rows = torch.from_numpy(y)[:, torch.from_numpy(heads)][:, :, torch.from_numpy(tokens)]
                for kind, dtype in OUT_KINDS:
                    out = out_array(shape, kind)
                    K.dequantize_per_token(sym, scale, zero, g, bits, symmetric, heads, tokens, out, kind, rot)
                    want = expected_out(shape, kind, dtype, heads, tokens, rows)
                    assert np.array_equal(out.view(np.uint8), want.view(np.uint8)), (shape, sel, g, kind)


def test_a_fused_rotation_dequantizes_extreme_float16_metadata_as_the_reference():
    """The decoder's in-register rows (one group, one Hadamard block: bfloat16 bits converted
    without a subnormal check) on the smallest float16 scale (a subnormal, 2**-24), the
    largest (65504) and zero points of -65504 and +-2**-24: the reference's bits."""
    shape = (1, 2, 6, 64)
    (signs, blocks, scales), rot = rotation_of(shape, 3)
    heads, tokens = idx(range(2)), idx(range(6))
    sym = np.zeros(shape, np.uint8)
    sym[..., 5] = 1
    sym[0, 1, 3:] = 15
    mshape = (1, 2, 6, 1)
    scale = np.array([0x0001, 0x7BFF, 0x0001, 0x7BFF, 0x0000, 0x3C00] * 2, np.uint16).reshape(mshape)
    zero = np.array([0x0000, 0xFBFF, 0x8001, 0x0001, 0x7BFF, 0x8000] * 2, np.uint16).reshape(mshape)
    for symmetric in (False, True):
        y = np.zeros(shape, np.float32)
        K.dequantize_per_token(sym, scale, zero, 64, 4, symmetric, heads, tokens, y, 0)
        K.hadamard_rows(y, signs, blocks, scales, True)
        assert np.isfinite(y).all() and not ((y != 0) & (np.abs(y) < np.finfo(np.float32).tiny)).any()
        for kind, dtype in OUT_KINDS:
            out = out_array(shape, kind)
            K.dequantize_per_token(sym, scale, zero, 64, 4, symmetric, heads, tokens, out, kind, rot)
            want = expected_out(shape, kind, dtype, heads, tokens, torch.from_numpy(y))
            assert np.array_equal(out.view(np.uint8), want.view(np.uint8)), (symmetric, kind)


def test_rotation_growth_bounds_the_rotated_magnitude():
    """A row equal to ``amax * signs`` sums to ``sqrt(n) * amax`` in one output of each block:
    the bound holds with its margin, and is not loose by more than the margin."""
    for shape in ROTATED_SHAPES[:3]:
        (signs, blocks, scales), rot = rotation_of(shape)
        amax = np.float32(3.7)
        x = np.broadcast_to(signs[None, :, None, :] * amax, shape).astype(np.float32).copy()
        x[:, :, 1::2] *= student_t(x[:, :, 1::2].shape, seed=1).clamp(-1, 1).numpy()
        growth = rotation_growth(blocks, scales)
        K.hadamard_rows(x, signs, blocks, scales, False)
        peak = float(np.abs(x).max())
        assert peak <= growth * amax and peak >= growth * amax / (1 + 2.0**-14), shape


def test_encode_tensor_with_a_fused_rotation_checks_the_rotated_bound():
    """With ``rot``, ``limit`` is compared with the input's magnitude times the rotation's
    growth: just below it nothing is written (``seen`` -1), with no limit the bytes are those of
    the rotated copy; a per-channel segment with ``rot`` is a ValueError."""
    shape = (1, 3, 40, 64)
    (signs, blocks, scales), rot = rotation_of(shape)
    xk, _ = kernel_input(student_t(shape, seed=3, scale=3.0), "bf16")
    per_tok = UniformQuantizer(bits=4, granularity="per_token", group_size=0)
    segs, ix, n, _ = build_table(shape, [(per_tok, 4, [0, 1, 2], list(range(40)), [K.KIND_UNIFORM, 4, 1, 64, 0])])
    y = np.zeros(shape, np.float32)
    K.to_float32(xk, y)
    K.hadamard_rows(y, signs, blocks, scales, False)
    lut8, books = fp8_luts()[2], BOOKS
    want, got = np.zeros(n, np.uint8), np.full(n, 0xAB, np.uint8)
    K.encode_tensor(y, math.inf, segs, ix, want, np.zeros(n * 8, np.uint8), lut8, books)
    amax = float(torch.from_numpy(xk.view(np.int16)).view(torch.bfloat16).float().abs().max())
    bound = amax * rotation_growth(blocks, scales)
    _, seen, _ = K.encode_tensor(xk, np.nextafter(bound, 0.0), segs, ix, got, np.zeros(n * 8, np.uint8), lut8, books, rot)
    assert seen == -1 and (got == 0xAB).all()
    _, seen, crc = K.encode_tensor(xk, bound, segs, ix, got, np.zeros(n * 8, np.uint8), lut8, books, rot)
    assert seen > 0 and np.array_equal(got, want) and crc == zlib.crc32(want.tobytes())
    per_ch = UniformQuantizer(bits=4, granularity="per_channel", group_size=8)
    segs2, ix2, n2, _ = build_table(shape, [(per_ch, 4, [0], list(range(40)), [K.KIND_UNIFORM, 4, 0, 8, 0])])
    with pytest.raises(ValueError, match="per-token"):
        K.encode_segments(xk, segs2, ix2, np.zeros(n2, np.uint8), np.zeros(n2 * 8, np.uint8), True, lut8, books, rot)
    with pytest.raises(ValueError, match="per-token"):
        K.decode_segments(np.zeros(n2, np.uint8), segs2, ix2, *fp8_luts()[:2], np.zeros(n2 * 8, np.uint8), True,
                          np.zeros(shape, np.uint16), 1, books, rot)


@covers("delta_rows")
@pytest.mark.parametrize("t, g", [(37, 10), (10, 10), (5, 10), (1, 2), (0, 4), (16, 2)])
def test_delta_rows_matches_delta_coding(t, g):
    x = student_t((2, 3, t, 13), seed=t)
    y = x.numpy().copy()
    K.delta_rows(y, g, False)
    ref = delta_encode(x, g)
    assert np.array_equal(y.view(np.uint32), ref.numpy().view(np.uint32))
    K.delta_rows(y, g, True)
    assert np.array_equal(y.view(np.uint32), delta_decode(ref, g).numpy().view(np.uint32))


@covers("delta_load", "delta_store")
@pytest.mark.parametrize("t, g", [(37, 10), (10, 10), (5, 10), (1, 2), (0, 4), (16, 2)])
@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_fused_delta_kernels_match_delta_rows_and_the_conversions(t, g, dtype):
    """``delta_load`` = ``to_float32`` then ``delta_rows``; ``delta_store`` = ``delta_rows``
    (inverse) then ``store_output``, bit for bit, for every output kind (float16 overflow to inf
    included), leaving its input as it was."""
    x, _ = kernel_input(with_extremes(student_t((2, 3, t, 13), seed=t, scale=4e3)), dtype)
    want = np.zeros(x.shape, np.float32)
    K.to_float32(x, want)
    K.delta_rows(want, g, False)
    got = np.full(x.shape, np.nan, np.float32)
    K.delta_load(x, got, g)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
    inverse = want.copy()
    K.delta_rows(inverse, g, True)
    for kind, _ in OUT_KINDS:
        expect, out = out_array(x.shape, kind), out_array(x.shape, kind)
        K.store_output(inverse, kind, expect)
        K.delta_store(got, g, kind, out)
        assert np.array_equal(out.view(np.uint8), expect.view(np.uint8)), kind
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32))  # the input is untouched


@covers("affine_fit")
@pytest.mark.parametrize("statistic, shift", [("rms", False), ("rms", True), ("absmax", False), ("absmax", True)])
def test_affine_fit_matches_channel_stats(statistic, shift):
    for shape in [(2, 3, 37, 13), (1, 2, 1, 64), (1, 2, 0, 8)]:
        x = student_t(shape, seed=shape[2], scale=5.0)
        if shape[2] > 2:
            x[..., 0] = 0.0  # zero channel: scale 1
            x[..., 1] *= 1e5  # beyond the float16 range: saturates
            x[0, 0, 0, 2] = 1e38  # RMS overflow in float32 but not float64
        scale16, shift16 = np.zeros(shape[1::2], np.uint16), np.zeros(shape[1::2], np.uint16)
        K.affine_fit(x.numpy().copy(), statistic == "rms", shift, scale16, shift16)
        s_ref, m_ref = channel_stats(x, statistic, shift)
        assert np.array_equal(scale16, bits16(s_ref)), shape
        if shift:
            assert np.array_equal(shift16, bits16(m_ref)), shape


@covers("affine_rows")
@pytest.mark.parametrize("has_shift", [False, True])
def test_affine_rows_matches_affine(has_shift):
    rng = np.random.default_rng(5)
    for shape in [(2, 3, 37, 13), (1, 2, 1, 64), (1, 2, 0, 8)]:
        x = student_t(shape, seed=shape[3], scale=5.0)
        hd = (shape[1], shape[3])
        state = {"scale": torch.from_numpy(random_f16_bits(hd, rng, nonneg=True).view(np.int16)).view(torch.float16).clamp_min(1e-3)}
        if has_shift:
            state["shift"] = torch.from_numpy(random_f16_bits(hd, rng, nonneg=False).view(np.int16)).view(torch.float16)
        s16 = bits16(state["scale"]).copy()
        m16 = bits16(state["shift"]).copy() if has_shift else np.zeros(hd, np.uint16)
        aff = Affine(shift=has_shift)
        y = x.numpy().copy()
        K.affine_rows(y, s16, m16, has_shift, False)
        ref = aff.forward(x, layer=0, kind="key", state=state)
        assert np.array_equal(y.view(np.uint32), ref.numpy().view(np.uint32))
        K.affine_rows(y, s16, m16, has_shift, True)
        back = aff.inverse(ref, layer=0, kind="key", state=state)
        assert np.array_equal(y.view(np.uint32), back.numpy().view(np.uint32))


# ----------------------------------------------------------------------------- bit packing


@covers("pack_bits", "unpack_bits")
@pytest.mark.parametrize("bits", range(1, 9))
@pytest.mark.parametrize("n", [0, 1, 3, 7, 8, 9, 15, 16, 17, 63, 1001])
def test_pack_unpack_bits_match_bitpack(bits, n):
    rng = np.random.default_rng(bits * 1000 + n)
    sym = rng.integers(0, 1 << bits, size=n).astype(np.uint8)
    if n:
        sym[-1] = (1 << bits) - 1  # the largest symbol in the last, partial unit
    ref = pack_bits(sym, bits)
    out = np.zeros(len(ref), np.uint8)
    seen = K.pack_bits(sym, bits, out)
    assert out.tobytes() == ref and seen == int(np.bitwise_or.reduce(sym, initial=0))
    back = np.full(n, 0xEE, np.uint8)
    K.unpack_bits(np.frombuffer(ref, np.uint8), bits, back)
    assert np.array_equal(back, unpack_bits(ref, bits, n)) and np.array_equal(back, sym)
    if bits < 8 and n:
        bad = sym.copy()
        bad[n // 2] = 1 << bits  # does not fit: reported through the OR
        assert K.pack_bits(bad, bits, np.zeros(len(ref), np.uint8)) >> bits


# ----------------------------------------------------------------------------- whole tensors


def fp8_luts():
    """As the fast path builds them with torch: float32 value and bfloat16 bits of every float8
    pattern, and the float8 symbol of every bfloat16 pattern."""
    vals, b16, syms = [], [], []
    all_bf16 = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).to(torch.float32)
    for fmt in ("e4m3", "e5m2"):
        v = torch.arange(256, dtype=torch.uint8).view(FP8_DTYPES[fmt]).to(torch.float32)
        vals.append(v.numpy())
        b16.append(bits16(v.to(torch.bfloat16)))
        syms.append(fp8_encode(all_bf16, fmt).numpy())
    return np.stack(vals), np.stack(b16), np.stack(syms)


CAL_LEVELS = (-1.0, -0.5625, -0.25, -0.0625, 0.125, 0.375, 0.6875, 1.0)
"""A calibrated 3-bit codebook (float16 values), row 9 of :data:`BOOKS`."""
BOOKS = np.vstack([nf_table(), np.pad(np.array(CAL_LEVELS), (0, 256 - len(CAL_LEVELS)))])
"""The NF levels (rows 0-8) and one calibrated codebook, as the fast path stacks a policy's."""


def segment_plan(shape):
    """Segments of one tensor (B, 3, 26, D): (coder, bits, heads, tokens, leading columns of the
    kernel table's row, and its SEG_BOOK when not ``bits``)."""
    per_tok = UniformQuantizer(bits=4, granularity="per_token", group_size=8)
    per_ch = UniformQuantizer(bits=3, symmetric=True, granularity="per_channel", group_size=4)
    e5 = FP8Quantizer(format="e5m2", scaled=True)
    e4 = FP8Quantizer(format="e4m3")
    lloyd = CodebookQuantizer(bits=3, levels="lloyd", normalize="minmax", granularity="per_channel", group_size=2)
    nf = CodebookQuantizer(bits=4, levels="nf", normalize="absmax", granularity="per_token", group_size=8)
    cal = CodebookQuantizer(bits=3, levels="calibrated", normalize="minmax", granularity="per_token", group_size=4,
                            codebooks=(CAL_LEVELS,))
    d = shape[3]
    return [
        (per_tok, 4, [0, 2], list(range(0, 10)), [K.KIND_UNIFORM, 4, 1, 8, 0]),
        (per_ch, 3, [1], list(range(0, 10)), [K.KIND_UNIFORM, 3, 0, 4, 1]),
        (NoQuantizer(), 16, [0, 1, 2], list(range(10, 13)), [K.KIND_BF16, 16, 0, 0, 0]),
        (e5, 8, [0, 1, 2], list(range(13, 17)), [K.KIND_FP8, 8, 1, 0, 1]),
        (e4, 8, [2, 0], list(range(17, 20)), [K.KIND_FP8, 8, 0, 0, 0]),
        (per_tok, 7, [1], [], [K.KIND_UNIFORM, 7, 1, 8, 0]),  # an empty segment
        (lloyd, 3, [1, 2], list(range(20, 23)), [K.KIND_CODEBOOK, 3, 0, 2, K.CB_MINMAX + K.CB_LLOYD]),
        (nf, 4, [0, 1, 2], list(range(23, 26)), [K.KIND_CODEBOOK, 4, 1, 8, 0]),
        (lloyd, 3, [0], list(range(20, 23)), [K.KIND_CODEBOOK, 3, 0, 2, K.CB_MINMAX + K.CB_LLOYD]),
        (cal, 3, [1], list(range(17, 20)), [K.KIND_CODEBOOK, 3, 1, 4, K.CB_MINMAX, 9]),  # levels in BOOKS' row 9
    ][: 10 if d else 0]


def build_table(shape, plan):
    """The kernel's int64 segment table and index array, and per segment (meta, payload) offsets
    in the bitpack layout [meta_0, payload_0, meta_1, ...]."""
    rows, index, pos, sym_pos = [], [], 0, 0
    for coder, bits, heads, tokens, head_cols in plan:
        seg = (shape[0], len(heads), len(tokens), shape[3])
        count = math.prod(seg)
        meta = sum(f.nbytes for f in coder.block_meta_layout(seg))
        payload = 2 * count if bits == 16 else (count * bits + 7) // 8
        book = head_cols[5] if len(head_cols) > 5 else bits
        row = head_cols[:5] + [len(index), len(heads), len(index) + len(heads), len(tokens), pos, meta, pos + meta,
                               payload, sym_pos, book]
        index += heads + tokens
        rows.append(row)
        pos += meta + payload
        sym_pos += 2 * count if bits == 16 else count
    return np.array(rows, np.int64).reshape(-1, K.SEG_COLUMNS), idx(index), pos, sym_pos


@covers("encode_segments", "decode_segments")
@pytest.mark.parametrize("tokens", [[3, 4, 5, 6], [5, 1, 2, 8], [2, 4, 3, 5], [7]])
def test_bfloat16_segments_decode_into_their_heads_and_tokens(tokens):
    """A bfloat16 pass-through segment is written back at its heads and tokens, into bfloat16
    and float32 outputs, whether its tokens are one run (one copy loop per head) or not (a
    permutation of a run included), and nothing else is touched."""
    shape = (2, 3, 9, 16)
    x = student_t(shape, seed=7, scale=5.0).to(torch.bfloat16)
    heads = [2, 0]
    segs, index, nbytes, _ = build_table(shape, [(NoQuantizer(), 16, heads, tokens, [K.KIND_BF16, 16, 0, 0, 0])])
    out = np.zeros(nbytes, np.uint8)
    xk = bits16(x).copy()
    luts, lut16, lut8 = fp8_luts()
    K.encode_segments(xk, segs, index, out, np.zeros(x.numel(), np.uint8), True, lut8, BOOKS)
    h, t = torch.tensor(heads), torch.tensor(tokens)
    for kind, dtype in OUT_KINDS[:2]:
        y = out_array(shape, kind)
        before = y.copy()
        assert K.decode_segments(out, segs, index, luts, lut16, np.zeros(x.numel(), np.uint8), True, y, kind, BOOKS)
        want = expected_out(shape, kind, dtype, idx(heads), idx(tokens), x[:, h][:, :, t].float())
        assert np.array_equal(y.view(np.uint8), want.view(np.uint8)), kind
        assert not np.array_equal(y, before)


@covers("encode_segments", "decode_segments")
def test_unscaled_e4m3_segments_cast_every_bfloat16_and_every_float8_as_torch():
    """The 16-lane e4m3 conversions (bfloat16 input, bfloat16 output) on every finite bfloat16
    pattern (saturating beyond +-448) and every float8 pattern (NaNs included), against
    torch's casts; 80 channels: five vectors per row, no table tail."""
    bits = np.arange(65536, dtype=np.uint16)
    finite = bits[(bits & 0x7F80) != 0x7F80]
    x = np.resize(finite, 4 * 80 * 205).reshape(1, 4, 205, 80)  # every pattern, the rest repeats
    seg = [(FP8Quantizer(format="e4m3"), 8, [0, 1, 2, 3], list(range(205)), [K.KIND_FP8, 8, 0, 0, 0])]
    segs, index, nbytes, _ = build_table(x.shape, seg)
    luts, lut16, lut8 = fp8_luts()
    out = np.zeros(nbytes, np.uint8)
    K.encode_segments(x, segs, index, out, np.zeros(x.size, np.uint8), True, lut8, BOOKS)
    want = fp8_encode(torch.from_numpy(x.view(np.int16)).view(torch.bfloat16).float(), "e4m3")
    assert np.array_equal(out, want.numpy().reshape(-1))
    codes = np.resize(np.arange(256, dtype=np.uint8), nbytes)
    y = np.zeros(x.shape, np.uint16)
    K.decode_segments(codes, segs, index, luts, lut16, np.zeros(x.size, np.uint8), True, y, 1, BOOKS)
    cast = torch.from_numpy(codes).view(FP8_DTYPES["e4m3"]).to(torch.float32).to(torch.bfloat16)  # as dequantize_block
    assert np.array_equal(y.reshape(-1), bits16(cast))


@covers("encode_segments", "decode_segments")
@pytest.mark.parametrize("dtype", ["f32", "bf16"])
@pytest.mark.parametrize("d", [16, 13, 40, 0])
def test_encode_decode_segments_match_the_reference_segments(dtype, d):
    """A tensor split into nine segments (per-token and per-channel uniform, bfloat16, scaled
    e5m2, unscaled e4m3, an empty one, per-channel Lloyd / min-max and per-token NF codebooks):
    the sections are the reference quantizers' metadata and bit-packed symbols; decoding
    rebuilds each segment's dequantized values in place."""
    shape = (2, 3, 26, d)
    x = with_extremes(student_t(shape, seed=d, scale=50.0))
    xk, xref = kernel_input(x, dtype)
    plan = segment_plan(shape)
    segs, index, nbytes, sym_nbytes = build_table(shape, plan)
    luts, lut16, lut8 = fp8_luts()
    expected, decoded_ref = [], []
    for coder, bits, heads, tokens, _ in plan:
        sel = pick(xref, idx(heads), idx(tokens))
        sym, meta = coder.quantize_block(sel)
        layout = coder.block_meta_layout(tuple(sel.shape))
        payload = sym.numpy().astype("<u2").tobytes() if bits == 16 else pack_bits(sym.numpy(), bits)
        expected.append(meta_to_bytes(meta, layout) + payload)
        decoded_ref.append(coder.dequantize_block(sym, meta, tuple(sel.shape)))
    out = np.zeros(max(nbytes, 1), np.uint8)
    symbuf = np.zeros(max(sym_nbytes, 1), np.uint8)
    seen = K.encode_segments(xk, segs, index, out, symbuf, True, lut8, BOOKS)
    assert out[:nbytes].tobytes() == b"".join(expected)
    assert seen < 256
    # not packed: each segment's raw symbols at its SEG_SYM offset, metadata as before
    out2 = np.zeros_like(out)
    symbuf2 = np.zeros_like(symbuf)
    K.encode_segments(xk, segs, index, out2, symbuf2, False, lut8, BOOKS)
    for s, (coder, bits, heads, tokens, _) in enumerate(plan):
        m0, ml = segs[s, K.SEG_META], segs[s, K.SEG_META_LEN]
        assert out2[m0 : m0 + ml].tobytes() == expected[s][:ml]
        n = shape[0] * len(heads) * len(tokens) * d * (2 if bits == 16 else 1)
        so = segs[s, K.SEG_SYM]
        got = symbuf2[so : so + n]
        want = expected[s][ml:] if bits == 16 else unpack_bits(expected[s][ml:], bits, n).tobytes()
        assert got.tobytes() == want, s
    for kind, odtype in OUT_KINDS:
        ref_out = out_array(shape, kind)
        for (coder, bits, heads, tokens, _), vals in zip(plan, decoded_ref):
            ref_out[np.ix_(range(shape[0]), heads, tokens, range(d))] = (
                vals.to(odtype).numpy() if kind == 0 else bits16(vals.to(odtype)))
        for packed, data, sbuf in ((True, out, np.zeros_like(symbuf)), (False, out2, symbuf2.copy())):
            got = out_array(shape, kind)
            K.decode_segments(data, segs, index, luts, lut16, sbuf, packed, got, kind, BOOKS)
            assert np.array_equal(got, ref_out), (kind, packed)


@covers("encode_tensor")
@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_encode_tensor_is_check_then_segments_then_crc(dtype):
    """One call = the magnitude check (``max_magnitude_*``), then ``encode_segments`` (packed)
    and zlib's CRC-32 of the sections; a NaN, an inf or a magnitude beyond ``limit`` returns
    ``seen = -1`` with the magnitude and writes nothing."""
    shape = (2, 3, 26, 16)
    x = with_extremes(student_t(shape, seed=3, scale=50.0))
    xk, _ = kernel_input(x, dtype)
    segs, index, nbytes, _ = build_table(shape, segment_plan(shape))
    lut8 = fp8_luts()[2]
    want = np.zeros(nbytes, np.uint8)
    seen_want = K.encode_segments(xk, segs, index, want, np.zeros(nbytes * 8, np.uint8), True, lut8, BOOKS)
    magnitude = K.max_magnitude_bf16(xk) if dtype == "bf16" else K.max_magnitude_f32(xk)
    amax = float(x.abs().max().to(torch.bfloat16 if dtype == "bf16" else torch.float32))
    for limit in (math.inf, amax, 2 * amax):
        out = np.zeros(nbytes, np.uint8)
        bits, seen, crc = K.encode_tensor(xk, limit, segs, index, out, np.zeros(nbytes * 8, np.uint8), lut8, BOOKS)
        assert (bits, seen, crc) == (magnitude, seen_want, zlib.crc32(want.tobytes()))
        assert np.array_equal(out, want)
    out = np.zeros(nbytes, np.uint8)
    bits, seen, crc = K.encode_tensor(xk, np.nextafter(amax, 0.0), segs, index, out, np.zeros(nbytes * 8, np.uint8),
                                      lut8, BOOKS)
    assert (bits, seen, crc) == (magnitude, -1, 0) and not out.any()
    for bad in (np.nan, np.inf, -np.inf):
        y = x.clone()
        y[1, 2, 5, 3] = bad
        yk, _ = kernel_input(y, dtype)
        bits, seen, _ = K.encode_tensor(yk, math.inf, segs, index, out, np.zeros(nbytes * 8, np.uint8), lut8, BOOKS)
        assert seen == -1 and bits >= (0x7F80 if dtype == "bf16" else 0x7F800000) and not out.any()


@covers("decode_tensor")
def test_decode_tensor_is_crc_then_packed_segments():
    """One call = zlib's CRC-32 of the sections, then ``decode_segments`` (packed): the same
    output, into every output kind."""
    shape = (2, 3, 26, 16)
    x = with_extremes(student_t(shape, seed=4, scale=50.0))
    xk, _ = kernel_input(x, "bf16")
    segs, index, nbytes, _ = build_table(shape, segment_plan(shape))
    luts, lut16, lut8 = fp8_luts()
    data = np.zeros(nbytes, np.uint8)
    K.encode_segments(xk, segs, index, data, np.zeros(nbytes * 8, np.uint8), True, lut8, BOOKS)
    for kind, _ in OUT_KINDS:
        want, got = out_array(shape, kind), out_array(shape, kind)
        assert K.decode_segments(data, segs, index, luts, lut16, np.zeros(nbytes * 8, np.uint8), True, want, kind, BOOKS)
        crc, finite = K.decode_tensor(data, segs, index, luts, lut16, np.zeros(nbytes * 8, np.uint8), got, kind, BOOKS)
        assert crc == zlib.crc32(data.tobytes()) and finite and np.array_equal(got, want), kind


@covers("decode_segments", "decode_tensor")
@pytest.mark.parametrize("packed", [True, False])
def test_a_nan_or_inf_in_a_bfloat16_or_float8_segment_is_reported(packed):
    """``finite`` is false exactly when a bfloat16 segment holds a NaN or inf pattern (exponent
    bits all set, either sign) or a float8 segment a NaN or inf symbol, into every output kind;
    the largest finite values and a NaN pattern in another segment's payload bytes (a 4-bit
    code, not a bfloat16) are not."""
    shape = (2, 3, 26, 16)
    xk, _ = kernel_input(student_t(shape, seed=6, scale=5.0), "bf16")
    segs, index, nbytes, _ = build_table(shape, segment_plan(shape))
    luts, lut16, lut8 = fp8_luts()
    data = np.zeros(nbytes, np.uint8)
    sym = np.zeros(nbytes * 8, np.uint8)
    K.encode_segments(xk, segs, index, data, sym, True, lut8, BOOKS)
    if not packed:  # the symbols at their SEG_SYM offsets, as another codec hands them over
        K.encode_segments(xk, segs, index, np.zeros(nbytes, np.uint8), sym, False, lut8, BOOKS)
    bf16 = int(np.flatnonzero(segs[:, K.SEG_KIND] == K.KIND_BF16)[0])
    at = segs[bf16, K.SEG_PAYLOAD if packed else K.SEG_SYM] + 2 * 37  # the segment's 38th value
    cases = {0x7FC0: False, 0x7F80: False, 0xFF80: False, 0xFFC1: False, 0x7F7F: True, 0xFF7F: True}
    for pattern, finite in cases.items():
        for kind, _ in OUT_KINDS:
            d, sb = data.copy(), sym.copy()
            (d if packed else sb)[at : at + 2] = (pattern & 0xFF, pattern >> 8)
            got = K.decode_segments(d, segs, index, luts, lut16, sb, packed, out_array(shape, kind), kind, BOOKS)
            assert got == finite, (hex(pattern), kind)
            if packed:
                assert K.decode_tensor(d, segs, index, luts, lut16, sb, out_array(shape, kind), kind, BOOKS)[1] == finite
    other = data.copy()  # 0x7FC0 bytes in the first (4-bit uniform) segment's payload: codes, not values
    po = segs[0, K.SEG_PAYLOAD]
    other[po : po + 2] = (0xC0, 0x7F)
    assert K.decode_segments(other, segs, index, luts, lut16, sym, True, out_array(shape, 1), 1, BOOKS)
    # float8 symbols: e5m2 inf / NaN (exponent bits all set) and e4m3's NaN are reported,
    # their largest finite symbols are not
    for fp8 in np.flatnonzero(segs[:, K.SEG_KIND] == K.KIND_FP8):
        e5m2 = bool(segs[fp8, K.SEG_A])
        cases = {0x7C: False, 0xFE: False, 0x7B: True, 0xFB: True} if e5m2 else {0x7F: False, 0xFF: False, 0x7E: True}
        at = segs[fp8, K.SEG_PAYLOAD if packed else K.SEG_SYM] + 5
        for symbol, finite in cases.items():
            d, sb = data.copy(), sym.copy()
            (d if packed else sb)[at] = symbol
            got = K.decode_segments(d, segs, index, luts, lut16, sb, packed, out_array(shape, 1), 1, BOOKS)
            assert got == finite, (e5m2, hex(symbol))


def stacked_tables(shapes, columns: int, seg_col: int, nseg_col: int):
    """Segment tables of tensors of ``shapes`` stacked as the batch kernels take them (index
    offsets rebased), a row table with each tensor's rows filled in, and the per-tensor tables."""
    tables = [build_table(shape, segment_plan(shape)) for shape in shapes]
    rows, index, table = [], [], np.zeros((len(shapes), columns), np.int64)
    for i, (segs, idx, _, _) in enumerate(tables):
        r = segs.copy()
        r[:, K.SEG_HEADS] += sum(len(x) for x in index)
        r[:, K.SEG_TOKENS] += sum(len(x) for x in index)
        table[i, seg_col], table[i, nseg_col] = sum(len(x) for x in rows), len(r)
        rows.append(r)
        index.append(idx)
    return np.concatenate(rows), np.concatenate(index), table, tables


BATCH_SHAPES = [(2, 3, 26, 16), (1, 3, 26, 8), (2, 3, 26, 24), (1, 3, 26, 16)]


def no_transforms(n: int) -> tuple:
    """The transform arguments of ``encode_batch`` / ``decode_batch`` for ``n`` rows without
    transforms (programs of length 0; one-element scratch)."""
    return (np.zeros((n, 0, K.TR_COLUMNS), np.int64), np.zeros(0, np.float32), np.zeros(0, np.int64),
            np.zeros(0, np.float32), np.zeros(1, np.float32), np.zeros(1, np.uint16))


def run_threads(n: int, fn) -> None:
    """``fn()`` in ``n`` Python threads at once (the kernels release the GIL)."""
    import threading

    threads = [threading.Thread(target=fn) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


@covers("encode_batch")
@pytest.mark.parametrize("dtype", ["bf16", "f32"])
@pytest.mark.parametrize("threads", [1, 3])
def test_encode_batch_is_encode_tensor_per_row(dtype, threads):
    """Every row = ``encode_tensor`` of its tensor into its range of the output, whichever
    thread claims it; a row whose magnitude exceeds its limit writes nothing and reports -1."""
    segs, index, table, tables = stacked_tables(BATCH_SHAPES, K.ENC_COLUMNS, K.ENC_SEG, K.ENC_NSEG)
    xs = [kernel_input(with_extremes(student_t(shape, seed=10 + i, scale=30.0)), dtype)[0]
          for i, shape in enumerate(BATCH_SHAPES)]
    sizes = np.array([t[2] for t in tables], np.int64)
    limits = np.array([math.inf, math.inf, 1e-3, math.inf])  # row 2 is beyond its limit
    table[:, K.ENC_X] = [x.ctypes.data for x in xs]
    table[:, K.ENC_FLOAT32] = dtype == "f32"
    table[:, K.ENC_B : K.ENC_D + 1] = BATCH_SHAPES
    table[:, K.ENC_OUT], table[:, K.ENC_LEN] = np.cumsum(sizes) - sizes, sizes
    lut8 = fp8_luts()[2]
    want, want_results = np.zeros(sizes.sum(), np.uint8), []
    for (tab, idx, n, _), x, start, limit in zip(tables, xs, table[:, K.ENC_OUT], limits):
        want_results.append(K.encode_tensor(x, limit, tab, idx, want[start : start + n], np.zeros(n * 8, np.uint8),
                                            lut8, BOOKS))
    assert want_results[2][1] == -1
    buf, results, counter = np.zeros(sizes.sum(), np.uint8), np.zeros((len(xs), 3), np.int64), np.zeros(1, np.int64)
    run_threads(threads, lambda: K.encode_batch(table, limits, segs, index, buf, np.zeros(sizes.max() * 8, np.uint8),
                                                lut8, BOOKS, results, counter, *no_transforms(len(xs))))
    assert np.array_equal(buf, want) and results.tolist() == [list(map(int, r)) for r in want_results]
    assert counter[0] >= len(xs)  # every thread left after the last row


@covers("decode_batch")
@pytest.mark.parametrize("kind", [0, 1])
@pytest.mark.parametrize("threads", [1, 3])
def test_decode_batch_is_decode_tensor_per_row(kind, threads):
    """Every row = ``decode_tensor`` of its range of a read-only stream into its own output,
    whichever thread claims it, and the finiteness of its float16 metadata
    (``first_nonfinite_f16`` over its metadata sections: ``BAD_META`` when not) and of its
    bfloat16 payloads (``BAD_PAYLOAD``)."""
    segs, index, table, tables = stacked_tables(BATCH_SHAPES, K.DEC_COLUMNS, K.DEC_SEG, K.DEC_NSEG)
    sizes = np.array([t[2] for t in tables], np.int64)
    stream = np.zeros(sizes.sum() + 5, np.uint8)  # 5 bytes before the first tensor (a header)
    starts = 5 + np.cumsum(sizes) - sizes
    luts, lut16, lut8 = fp8_luts()
    for i, ((tab, idx, n, _), shape, start) in enumerate(zip(tables, BATCH_SHAPES, starts)):
        x = kernel_input(with_extremes(student_t(shape, seed=20 + i, scale=30.0)), "bf16")[0]
        K.encode_segments(x, tab, idx, stream[start : start + n], np.zeros(n * 8, np.uint8), True, lut8, BOOKS)
    stream.flags.writeable = False
    outs = [out_array(shape, kind) for shape in BATCH_SHAPES]
    want = [out_array(shape, kind) for shape in BATCH_SHAPES]
    want_crcs = [K.decode_tensor(stream[a : a + n], tab, idx, luts, lut16, np.zeros(n * 8, np.uint8), w, kind, BOOKS)[0]
                 for (tab, idx, n, _), a, w in zip(tables, starts, want)]
    table[:, K.DEC_IN], table[:, K.DEC_LEN] = starts, sizes
    table[:, K.DEC_B : K.DEC_D + 1] = BATCH_SHAPES
    table[:, K.DEC_OUT] = [o.ctypes.data for o in outs]
    table[:, K.DEC_KIND] = kind
    crcs, bad, counter = np.zeros(len(outs), np.int64), np.full(len(outs), 9, np.uint8), np.zeros(1, np.int64)
    run_threads(threads, lambda: K.decode_batch(stream, table, segs, index, luts, lut16, np.zeros(sizes.max() * 8, np.uint8),
                                                BOOKS, crcs, bad, counter, *no_transforms(len(outs))))
    assert crcs.tolist() == want_crcs and all(np.array_equal(o, w) for o, w in zip(outs, want))
    assert bad.tolist() == [0, 0, 0, 0]
    # a NaN scale in row 2's last metadata section (float16 0x7E00, little-endian): only row 2 is flagged
    forged = stream.copy()
    tab = tables[2][0]
    at = starts[2] + tab[-1, K.SEG_META] + tab[-1, K.SEG_META_LEN] - 2
    forged[at : at + 2] = (0x00, 0x7E)
    counter[0] = 0
    K.decode_batch(forged, table, segs, index, luts, lut16, np.zeros(sizes.max() * 8, np.uint8), BOOKS, crcs, bad,
                   counter, *no_transforms(len(outs)))
    assert bad.tolist() == [0, 0, K.BAD_META, 0]
    # and a bfloat16 NaN in row 1's bfloat16 segment (its first value): BAD_PAYLOAD for row 1
    tab = tables[1][0]
    at = starts[1] + tab[np.flatnonzero(tab[:, K.SEG_KIND] == K.KIND_BF16)[0], K.SEG_PAYLOAD]
    forged[at : at + 2] = (0xC0, 0x7F)
    counter[0] = 0
    K.decode_batch(forged, table, segs, index, luts, lut16, np.zeros(sizes.max() * 8, np.uint8), BOOKS, crcs, bad,
                   counter, *no_transforms(len(outs)))
    assert bad.tolist() == [0, K.BAD_PAYLOAD, K.BAD_META, 0]


def transform_programs(shapes, state: list[int], order=("hadamard", "delta", "affine")):
    """Per tensor the program of ``hadamard``, ``delta`` (groups of 5 tokens) and ``affine``
    (RMS with a shift, its state at byte 0) in ``order``, as the batch kernels take it, and each
    tensor's signs."""
    ops = np.zeros((len(shapes), 3, K.TR_COLUMNS), np.int64)
    signs, blocks, scales = [], [], []
    for i, shape in enumerate(shapes):
        h, d = shape[1], shape[3]
        ops[i, order.index("hadamard")] = (K.TR_HADAMARD, sum(s.size for s in signs), sum(len(b) for b in blocks),
                                           len(power_of_two_blocks(d)))
        ops[i, order.index("delta")] = (K.TR_DELTA, 5, 0, 0)
        ops[i, order.index("affine")] = (K.TR_AFFINE, 1, 1, 0)
        signs.append(random_signs(i, 3, "key", h, d).numpy())
        blocks.append(idx(power_of_two_blocks(d)))
        scales.append(np.array(block_scales(d), np.float32))
        state.append(2 * h * d * 2)
    return ops, signs, np.concatenate([s.reshape(-1) for s in signs]), np.concatenate(blocks), np.concatenate(scales)


@covers("encode_batch", "decode_batch")
@pytest.mark.parametrize("kind", [0, 1])
@pytest.mark.parametrize("order", [("hadamard", "delta", "affine"), ("delta", "hadamard", "affine")])
def test_batch_kernels_run_transform_programs(kind, order):
    """With a transform program, encode = transforms on a float32 copy (the affine state written
    first in the tensor's sections), then ``encode_tensor``; decode = ``decode_tensor`` into
    float32, the transforms undone last first, then the output conversion; a NaN in a
    tensor's transform state gives ``BAD_STATE``. A leading ``hadamard`` or ``delta`` runs fused
    with the conversions; the reference runs every step on its own."""
    state = []
    ops, signs, flat_signs, blocks, scales = transform_programs(BATCH_SHAPES, state, order)
    k = order.index("hadamard")

    def rotate(y, i, inverse):
        K.hadamard_rows(y, signs[i], blocks[ops[i, k, 2] : ops[i, k, 2] + ops[i, k, 3]],
                        scales[ops[i, k, 2] : ops[i, k, 2] + ops[i, k, 3]], inverse)
    segs, index, enc, tables = stacked_tables(BATCH_SHAPES, K.ENC_COLUMNS, K.ENC_SEG, K.ENC_NSEG)
    starts = np.array([0] + [len(t[0]) for t in tables]).cumsum()[:-1]
    for i, (a, n) in enumerate(zip(starts, [len(t[0]) for t in tables])):  # sections move past the state
        segs[a : a + n, K.SEG_META] += state[i]
        segs[a : a + n, K.SEG_PAYLOAD] += state[i]
    sizes = np.array([t[2] + st for t, st in zip(tables, state)], np.int64)
    xs = [kernel_input(student_t(shape, seed=30 + i, scale=3.0), "bf16")[0] for i, shape in enumerate(BATCH_SHAPES)]
    enc[:, K.ENC_X] = [x.ctypes.data for x in xs]
    enc[:, K.ENC_B : K.ENC_D + 1] = BATCH_SHAPES
    enc[:, K.ENC_OUT], enc[:, K.ENC_LEN] = np.cumsum(sizes) - sizes, sizes
    luts, lut16, lut8 = fp8_luts()
    want = np.zeros(sizes.sum(), np.uint8)
    for i, ((tab, ix, n, _), x, start) in enumerate(zip(tables, xs, enc[:, K.ENC_OUT])):
        h, d = x.shape[1], x.shape[3]
        y = np.zeros(x.shape, np.float32)
        K.to_float32(x, y)
        sc, sh = np.zeros((h, d), np.uint16), np.zeros((h, d), np.uint16)
        for name in order:
            if name == "hadamard":
                rotate(y, i, False)
            elif name == "delta":
                K.delta_rows(y, 5, False)
            else:
                K.affine_fit(y, True, True, sc, sh)
                K.affine_rows(y, sc, sh, True, False)
        out = want[start : start + n + state[i]]
        out[: state[i]] = np.concatenate([sc.reshape(-1), sh.reshape(-1)]).view(np.uint8)
        t = tab.copy()
        t[:, K.SEG_META] += state[i]
        t[:, K.SEG_PAYLOAD] += state[i]
        K.encode_tensor(y, math.inf, t, ix, out, np.zeros(n * 8, np.uint8), lut8, BOOKS)
    buf, results, counter = np.zeros(sizes.sum(), np.uint8), np.zeros((len(xs), 3), np.int64), np.zeros(1, np.int64)
    work = np.zeros(max(math.prod(s) for s in BATCH_SHAPES), np.float32)
    args = (ops, flat_signs, blocks, scales, work, np.zeros(2 * max(s[1] * s[3] for s in BATCH_SHAPES), np.uint16))
    K.encode_batch(enc, np.full(len(xs), math.inf), segs, index, buf, np.zeros(sizes.max() * 8, np.uint8), lut8, BOOKS,
                   results, counter, *args)
    assert np.array_equal(buf, want) and results[:, 2].tolist() == [
        zlib.crc32(want[a : a + n].tobytes()) for a, n in zip(enc[:, K.ENC_OUT], sizes)]
    # decode it back
    dec = np.zeros((len(xs), K.DEC_COLUMNS), np.int64)
    dec[:, K.DEC_SEG : K.DEC_NSEG + 1] = enc[:, K.ENC_SEG : K.ENC_NSEG + 1]
    dec[:, K.DEC_IN], dec[:, K.DEC_LEN] = enc[:, K.ENC_OUT], sizes
    dec[:, K.DEC_B : K.DEC_D + 1] = BATCH_SHAPES
    outs = [out_array(shape, kind) for shape in BATCH_SHAPES]
    dec[:, K.DEC_OUT] = [o.ctypes.data for o in outs]
    dec[:, K.DEC_KIND] = kind
    crcs, bad, counter = np.zeros(len(outs), np.int64), np.full(len(outs), 9, np.uint8), np.zeros(1, np.int64)
    K.decode_batch(want, dec, segs, index, luts, lut16, np.zeros(sizes.max() * 8, np.uint8), BOOKS, crcs, bad, counter,
                   *args)
    for i, ((tab, ix, n, _), start, got) in enumerate(zip(tables, enc[:, K.ENC_OUT], outs)):
        h, d = got.shape[1], got.shape[3]
        data = want[start : start + n + state[i]]
        t = tab.copy()
        t[:, K.SEG_META] += state[i]
        t[:, K.SEG_PAYLOAD] += state[i]
        y = np.zeros(got.shape, np.float32)
        K.decode_tensor(data, t, ix, luts, lut16, np.zeros(n * 8, np.uint8), y, 0, BOOKS)
        st = data[: state[i]].view(np.uint16).reshape(2, h, d)
        for name in reversed(order):
            if name == "hadamard":
                rotate(y, i, True)
            elif name == "delta":
                K.delta_rows(y, 5, True)
            else:
                K.affine_rows(y, st[0], st[1], True, True)
        expect = out_array(got.shape, kind)
        K.store_output(y, kind, expect)
        covered = np.ones(got.shape, bool)
        covered[:, 1, 17:20] = False  # no segment of segment_plan codes these rows (not delta anchors either)
        assert np.array_equal(got[covered], expect[covered]), i
    assert bad.tolist() == [0, 0, 0, 0]
    forged = want.copy()
    forged[enc[1, K.ENC_OUT] + 1] = 0x7C  # the first float16 of tensor 1's state: +inf
    counter[0] = 0
    K.decode_batch(forged, dec, segs, index, luts, lut16, np.zeros(sizes.max() * 8, np.uint8), BOOKS, crcs, bad, counter,
                   *args)
    assert bad.tolist() == [0, K.BAD_STATE, 0, 0]


@covers("crc32_concat")
def test_crc32_concat_is_the_crc_of_the_concatenation():
    rng = np.random.default_rng(5)
    parts = [rng.integers(0, 256, n, dtype=np.uint8).tobytes() for n in (0, 1, 17, 4096, 0, 3)]
    head = b"KVTN header"
    crcs = np.array([zlib.crc32(p) for p in parts], np.int64)
    lengths = np.array([len(p) for p in parts], np.int64)
    assert K.crc32_concat(zlib.crc32(head), crcs, lengths) == zlib.crc32(head + b"".join(parts))
    assert K.crc32_concat(0, crcs[:0], lengths[:0]) == 0


# ----------------------------------------------------------------------------- CRC32


# ----------------------------------------------------------------------------- rANS (the ``rans`` codec)


def ref_normalize(w: list[int], prec: int) -> list[int]:
    total = sum(w)
    f = [max(1, (v << prec) // total) if v else 0 for v in w]
    fix_sum(f, (1 << prec) - sum(f))
    return f


def fix_sum(f: list[int], diff: int) -> None:
    if diff > 0:
        f[f.index(max(f))] += diff
    while diff < 0:
        j = f.index(max(f))
        take = min(-diff, f[j] - 1)
        if take <= 0:
            break
        f[j] -= take
        diff += take


def ref_tables(weights: np.ndarray, comp: np.ndarray, bits: int, prec: int):
    """Pure-python fused_tables."""
    m = comp.shape[1]
    pc = min(prec, 62 // m)
    cf = [ref_normalize([int(v) for v in row], pc) for row in weights]
    sh = m * pc - prec
    freqs = []
    for q in range(comp.shape[0]):
        row = []
        for x in range(1 << (bits * m)):
            p = 1
            for j in range(m):
                p *= cf[comp[q, j]][(x >> (bits * j)) & ((1 << bits) - 1)]
            row.append(max(1, (p + ((1 << sh) >> 1)) >> sh) if p else 0)
        fix_sum(row, (1 << prec) - sum(row))
        freqs.append(row)
    return freqs


def ref_encode(sym, bits, m, div, mod, freqs, prec, lane_run=KR.LANE_RUN) -> list[int]:
    """Pure-python interleaved rANS (exact integer division): the coded u16 words (32 lanes for
    a run of ``lane_run`` super-symbols or more, else 4)."""
    cums = [[sum(r[:s]) for s in range(len(r))] for r in freqs]
    n = len(sym) // m
    lanes = 32 if n >= lane_run else 4  # the lanes of a run of n super-symbols
    states = [KR.RANS_L] * lanes
    stack = []
    for i in range(n - 1, -1, -1):
        s = sum(int(sym[i * m + j]) << (bits * j) for j in range(m))
        q = (i // div) % mod
        f, c = freqs[q][s], cums[q][s]
        x = states[i % lanes]
        if x >= f << (32 - prec):
            stack.append(x & 0xFFFF)
            x >>= 16
        states[i % lanes] = ((x // f) << prec) + x % f + c
    for x in reversed(states):
        stack += [x & 0xFFFF, x >> 16]
    return stack[::-1]


def ref_decode(words, n, bits, m, div, mod, freqs, prec, lane_run=KR.LANE_RUN) -> list[int]:
    cums = [[sum(r[:s]) for s in range(len(r))] for r in freqs]
    lanes = 32 if n >= lane_run else 4
    states = [(words[2 * j] << 16) | words[2 * j + 1] for j in range(lanes)]
    pos, out = 2 * lanes, []
    for i in range(n):
        q = (i // div) % mod
        x = states[i % lanes]
        slot = x & ((1 << prec) - 1)
        s = max(t for t in range(len(freqs[q])) if freqs[q][t] and cums[q][t] <= slot)
        x = freqs[q][s] * (x >> prec) + slot - cums[q][s]
        if x < KR.RANS_L:
            x = (x << 16) | words[pos]
            pos += 1
        states[i % lanes] = x
        out += [(s >> (bits * j)) & ((1 << bits) - 1) for j in range(m)]
    assert states == [KR.RANS_L] * lanes and pos == len(words)
    return out


@covers("rans_normalize", "rans_fused_tables", "rans_decoder_tables", "rans_encode", "rans_decode")
@pytest.mark.parametrize("bits, m, mod, div, n", [(4, 2, 3, 1, 37), (2, 4, 2, 5, 40), (1, 8, 1, 1, 64), (8, 1, 2, 1, 9), (3, 1, 1, 1, 1),
                                                  (2, 3, 2, 1, 11), (1, 5, 1, 2, 12),
                                                  # 32 lanes (n >= LANE_RUN), in vectors: models that step by less
                                                  # than, exactly and more than a group; a partial last group
                                                  (2, 4, 16, 1, 1 << 15), (4, 2, 3, 1, (1 << 15) + 5),
                                                  (2, 4, 5, 7, (1 << 15) + 13), (8, 1, 2, 40, (1 << 15) + 16),
                                                  (1, 8, 1, 1, (1 << 15) + 31), (2, 4, 32, 1, (1 << 15) + 32)])
def test_rans_kernels_match_the_pure_python_coder(bits, m, mod, div, n):
    rng = np.random.default_rng(bits)
    k = 1 << bits
    groups = mod * m
    weights = rng.integers(0, 1 << 20, size=(groups, k)) * (rng.random((groups, k)) < 0.7)
    weights[:, 0] += 1  # every group has a symbol
    comp = np.arange(groups, dtype=np.int64).reshape(mod, m)
    freq, cum = K.rans_fused_tables(weights.astype(np.int64), comp, bits, KR.PRECISION)
    ref = ref_tables(weights, comp, bits, KR.PRECISION)
    assert freq.tolist() == ref
    assert (freq.sum(axis=1) == 1 << KR.PRECISION).all() and (cum[:, -1] == 1 << KR.PRECISION).all()
    # symbols drawn from each position's model support
    sym = np.zeros(n * m, np.uint8)
    for i in range(n):
        q = (i // div) % mod
        s = int(rng.choice(np.flatnonzero(freq[q])))
        for j in range(m):
            sym[i * m + j] = (s >> (bits * j)) & (k - 1)
    out = np.empty(n + 2 * KR.MAX_LANES, np.uint16)
    start = K.rans_encode(sym, bits, m, div, mod, freq, cum, KR.PRECISION, out)
    words = out[start:]
    assert words.tolist() == ref_encode(sym, bits, m, div, mod, ref, KR.PRECISION)  # byte-identical
    assert ref_decode(words.tolist(), n, bits, m, div, mod, ref, KR.PRECISION) == sym.tolist()
    slots = np.zeros((mod << KR.PRECISION) + 4, np.uint8)  # padded for the vector loop
    fc = K.rans_decoder_tables(freq, cum, KR.PRECISION, slots)
    assert [[int(slots[(q << KR.PRECISION) + j]) for j in range(1 << KR.PRECISION)] for q in range(mod)] == [
        [s for s, f in enumerate(row) for _ in range(f)] for row in ref]  # the symbol of every slot
    assert (fc >> 16).tolist() == freq.reshape(-1).tolist() and (fc & 0xFFFF).tolist() == cum[:, :-1].reshape(-1).tolist()
    for table in (slots, slots[: mod << KR.PRECISION].copy()):  # unpadded: the scalar loop
        dec = np.empty(n * m, np.uint8)
        assert K.rans_decode(words, bits, m, div, mod, fc, table, KR.PRECISION, dec) == words.size
        assert np.array_equal(dec, sym)
    # the other lane count: 4 lanes for every run (kind 4), 32 lanes for any run (a kind-6 flag)
    for lane_run in ((KR.NO_LANE_RUN,) if n >= KR.LANE_RUN else (0,)):
        start = K.rans_encode(sym, bits, m, div, mod, freq, cum, KR.PRECISION, out, lane_run)
        other = out[start:].copy()
        assert other.size != words.size or not np.array_equal(other, words)
        assert other.tolist() == ref_encode(sym, bits, m, div, mod, ref, KR.PRECISION, lane_run=lane_run)
        assert ref_decode(other.tolist(), n, bits, m, div, mod, ref, KR.PRECISION, lane_run=lane_run) == sym.tolist()
        for table in (slots, slots[: mod << KR.PRECISION].copy()):
            dec = np.empty(n * m, np.uint8)
            assert K.rans_decode(other, bits, m, div, mod, fc, table, KR.PRECISION, dec, lane_run) == other.size
            assert np.array_equal(dec, sym)


_GENERIC_RUN = """
import sys, numpy as np
from kvtune.codecs import kernels as K
from kvtune.codecs.kernels import rans as KR, rans_lanes
a = np.load(sys.argv[1])
out = np.empty(a["sym"].size + 2 * KR.MAX_LANES, np.uint16)
mine = out[K.rans_encode(a["sym"], 4, 2, 1, 3, a["freq"], a["cum"], KR.PRECISION, out):]
print(rans_lanes.REGISTER_COMPRESS, np.array_equal(mine, a["words"]))
"""


@pytest.mark.skipif(not rans_lanes.REGISTER_COMPRESS, reason="the host encoder already takes the generic compress-store")
def test_vector_encoder_writes_the_same_words_without_the_register_compress(tmp_path):
    """The vector encoder's two ways to push renormalisation words (``vpcompressw`` into a
    register and a masked store on AVX-512 VBMI2; ``llvm.masked.compressstore`` for any other
    target) write the same words: the same run encoded here and in a process whose numba target
    is ``generic`` (no AVX-512)."""
    import os
    import subprocess
    import sys

    rng = np.random.default_rng(3)
    bits, m, mod, n = 4, 2, 3, KR.LANE_RUN + 5
    weights = rng.integers(1, 1 << 20, size=(mod * m, 1 << bits)).astype(np.int64)
    freq, cum = K.rans_fused_tables(weights, np.arange(mod * m, dtype=np.int64).reshape(mod, m), bits, KR.PRECISION)
    sym = rng.integers(0, 1 << bits, size=n * m).astype(np.uint8)
    out = np.empty(n + 2 * KR.MAX_LANES, np.uint16)
    words = out[K.rans_encode(sym, bits, m, 1, mod, freq, cum, KR.PRECISION, out):]
    assert words.tolist() == ref_encode(sym, bits, m, 1, mod, freq.tolist(), KR.PRECISION)
    np.savez(tmp_path / "run.npz", sym=sym, freq=freq, cum=cum, words=words)
    res = subprocess.run([sys.executable, "-c", _GENERIC_RUN, str(tmp_path / "run.npz")],
                         env={**os.environ, "NUMBA_CPU_NAME": "generic"}, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == ["False", "True"]


def numpy_form_bits(counts, steps, pooled):
    """``rans_form_bits`` in numpy: levels of the pooled row (and of every group unless pooled),
    payload ``sum c (q - 1) / steps + n log2(sum w)``, residual entropy + 32 bits per entry."""
    from kvtune.codecs.range_coder import count_levels, level_weights

    zig = lambda r: np.where(r >= 0, 2 * r, -2 * r - 1)  # noqa: E731
    pool = count_levels(counts.sum(axis=0, keepdims=True), steps)[0]
    z = zig(np.diff(pool, prepend=0))
    if pooled:
        rows, levels = counts.sum(axis=0, keepdims=True), pool[None, :]
    else:
        rows, levels = counts, count_levels(counts, steps)
        z = np.concatenate([z, zig(levels[:, pool > 0] - pool[pool > 0]).reshape(-1)])
    payload = float((rows * (levels - 1)).sum()) / steps + float((rows.sum(axis=1) * np.log2(level_weights(levels, steps).sum(axis=1))).sum())
    hist = np.bincount(z)
    nz = hist[hist > 0]
    return payload + float((nz * np.log2(z.size / nz)).sum()) + 32 * hist.size


@covers("rans_form_bits")
@pytest.mark.parametrize("groups, k", [(1, 2), (5, 16), (64, 4), (3, 256)])
def test_rans_form_bits_matches_numpy(groups, k):
    from kvtune.codecs.range_coder import MAX_LEVEL, TABLE_STEPS, level_weights

    neg_grid = -level_weights(np.arange(2, (2 * (MAX_LEVEL - 2) + 1) * 8 + 2), 16)
    grid16 = level_weights(np.arange(1, 17), 16)
    rng = np.random.default_rng(groups * k)
    counts = (rng.geometric(0.3, size=(groups, k)) - 1) * (rng.random((groups, k)) < 0.8)
    counts[:, 0] += 1
    counts[-1, -1] = 10**6  # a dominant symbol: long level codes elsewhere
    for steps in TABLE_STEPS[:3]:
        for pooled in (False, True):
            got = K.rans_form_bits(counts.astype(np.int64), neg_grid, grid16, steps, pooled, MAX_LEVEL)
            assert got == pytest.approx(numpy_form_bits(counts, steps, pooled), rel=1e-12)


@covers("rans_choose_table")
@pytest.mark.parametrize("groups, k", [(1, 4), (5, 16), (64, 4), (3, 256), (64, 256)])
def test_rans_choose_table_matches_numpy(groups, k):
    """The chosen form is the one of fewest estimated bits (first of equals); per-group forms
    only for several groups, and for tables of ``PER_GROUP_LARGE`` entries or more only with
    ``PER_GROUP_DENSITY`` symbols per entry; its levels are ``count_levels``' codes and its
    residuals the zigzagged differences described in the doc."""
    from kvtune.codecs.range_coder import MAX_LEVEL, TABLE_STEPS, count_levels, level_weights

    neg_grid = -level_weights(np.arange(2, (2 * (MAX_LEVEL - 2) + 1) * 8 + 2), 16)
    grid16 = level_weights(np.arange(1, 17), 16)
    forms = [(1, 0), (2, 0), (2, 1), (3, 1)]
    steps, pooled = (np.array(c, np.int64) for c in zip(*[(TABLE_STEPS[si], p) for si, p in forms]))
    zig = lambda r: np.where(r >= 0, 2 * r, -2 * r - 1)  # noqa: E731
    rng = np.random.default_rng(groups * k + 1)
    chosen = set()
    for trial in range(6):
        counts = (rng.geometric(0.2 + 0.2 * (trial % 4), size=(groups, k)) - 1) * (rng.random((groups, k)) < 0.8)
        counts[:, 0] += 1
        if trial >= 4:  # dense, and every group's distribution shifted: per-group tables can pay
            counts = np.stack([np.roll(row, i) for i, row in enumerate(counts)]) * 25
        counts = counts.astype(np.int64)
        present = (counts.sum(axis=0) > 0).sum()
        dense = groups * k < KR.PER_GROUP_LARGE or counts.sum() >= KR.PER_GROUP_DENSITY * groups * present  # small or dense
        bits = [K.rans_form_bits(counts, neg_grid, grid16, st, bool(po), MAX_LEVEL) if po or (groups > 1 and dense) else np.inf
                for st, po in zip(steps, pooled)]
        want = int(np.argmin(bits))
        chosen.add((bool(dense), bool(pooled[want])))
        form, levels, res, est = K.rans_choose_table(counts, neg_grid, grid16, steps, pooled, MAX_LEVEL)
        assert form == want and est == bits[want]
        pool = count_levels(counts.sum(axis=0, keepdims=True), int(steps[want]))[0]
        expect_levels = pool[None, :] if pooled[want] else count_levels(counts, int(steps[want]))
        assert np.array_equal(levels, expect_levels)
        expect_res = zig(np.diff(pool, prepend=0))
        if not pooled[want]:
            expect_res = np.concatenate([expect_res, zig(expect_levels[:, pool > 0] - pool[pool > 0]).reshape(-1)])
        assert np.array_equal(res, expect_res)
    if groups > 1:
        assert (True, False) in chosen  # dense (or a small table), shifted groups: a per-group form
    if groups * k >= KR.PER_GROUP_LARGE:
        assert (False, True) in chosen  # a large table of sparse counts: pooled


@covers("rans_level_weights", "rans_encode_symbols", "rans_decode_symbols", "rans_encode_payload",
        "rans_decode_payload", "rans_payload_bytes", "rans_encode_bytes")
@pytest.mark.parametrize("model, bits, shape", [("per_channel", 2, (1, 3, 40, 64)), ("per_head", 4, (1, 2, 33, 8)),
                                                ("global", 3, (2, 1, 5, 7)), ("per_channel", 8, (1, 1, 9, 16))])
def test_rans_payload_kernels_match_their_steps(model, bits, shape):
    """One call == the steps it fuses: counts, table choice, residual words (a one-model
    coder over the zigzagged residuals), level weights (``level_to_weights``), fused tables and
    the symbols' words; the decoder inverts it and reports a forged table as status 3. The
    payload encoder returns the same words with their CRC32 and the largest symbol, and codes
    nothing when a symbol is too wide; the payload's bytes are those of a struct-built layout
    (with and without zero padding and the words' CRC); the payload decoder reads the words at odd byte offsets
    of a payload, checks their CRC32 (status 10 on a mismatch, none when it is -1) and decodes
    the same symbols. The one-call encoder gives the payload encoder's bytes, with the form
    byte of the chosen form, and nothing when a symbol is too wide."""
    from kvtune.codecs.range_coder import MAX_LEVEL, TABLE_STEPS
    from kvtune.codecs import rans as R

    rng = np.random.default_rng(bits)
    x = np.minimum(rng.geometric(0.45, size=shape) - 1, (1 << bits) - 1).astype(np.uint8)
    flat = x.reshape(-1)
    lay = R.layout_for_shape(model, bits, shape)
    coder, cg, cp = R._coder_plan(lay)
    enc_args = (flat, bits, lay.m, *lay.count_args(), lay.groups, coder, cg, cp, R._NEG_GRID, R._GRID16, R._FORM_STEPS,
                R._FORM_POOLED, MAX_LEVEL, R.WEIGHT_BITS, KR.PRECISION)
    form, hist, twords, words, wide = K.rans_encode_symbols(*enc_args)
    counts = K.rans_count_groups(flat, *lay.count_args(), lay.groups, 1 << bits)
    f2, levels, res, est = K.rans_choose_table(counts, R._NEG_GRID, R._GRID16, R._FORM_STEPS, R._FORM_POOLED, MAX_LEVEL)
    assert form == f2 and np.array_equal(hist, np.bincount(res)) and not wide  # runs shorter than LANE_RUN
    assert est < KR.WIDE_BITS  # so the kind-6 rule (lane_run < 0) keeps 4 lanes too
    chose = K.rans_encode_symbols(*enc_args, KR.LANE_RUN, -1)
    top, f3, h3, tw3, w3, wide3, crc = K.rans_encode_payload(*enc_args)
    assert (top, f3, wide3) == (int(flat.max()), form, wide) and crc == zlib.crc32(words.astype("<u2").tobytes())
    assert np.array_equal(h3, hist) and np.array_equal(tw3, twords) and np.array_equal(w3, words)
    for count, tail in ((flat.size, True), (1024 * (8 * (words.size + twords.size + hist.size) + 200), True),
                        (flat.size, False)):
        got = K.rans_payload_bytes(6, 0x25, lay.m, np.array(lay.dims, np.int64), hist, twords, words, crc, count, bits,
                                   tail, 1024).tobytes()
        head = (bytes([6, 0x25, lay.m]) + struct.pack(f"<{len(lay.dims)}I", *lay.dims)
                + struct.pack(f"<H{hist.size}I", hist.size - 1, *hist.tolist())
                + struct.pack(f"<I{twords.size}H", twords.size, *twords.tolist()))
        head += struct.pack("<I", zlib.crc32(head, zlib.crc32(count.to_bytes(8, "little") + bytes([bits]))))
        body = words.astype("<u2").tobytes()
        pad = max(0, -(-(-(-count // 1024) - len(head) - 4 - len(body) - 4 * tail) // 2))
        body += bytes(2 * pad)
        want = head + struct.pack("<I", words.size + pad) + body + (struct.pack("<I", zlib.crc32(body)) if tail else b"")
        assert got == want and (pad > 0) == (count > flat.size), (count, tail)
    form_bytes = np.arange(len(R._FORM_STEPS), dtype=np.int64) + 0x40  # any distinct bytes
    one_call = K.rans_encode_bytes(*enc_args[:13], form_bytes, *enc_args[13:], KR.LANE_RUN, KR.LANE_RUN, 6,
                                   np.array(lay.dims, np.int64), True, 1024)
    assert one_call[0] == top and one_call[1].tobytes() == K.rans_payload_bytes(
        6, 0x40 + form, lay.m, np.array(lay.dims, np.int64), hist, twords, words, crc, flat.size, bits, True, 1024).tobytes()
    wider = flat.copy()
    wider[-1] = 1 << bits if bits < 8 else 255
    refused = K.rans_encode_payload(wider, *enc_args[1:])
    refused_bytes = K.rans_encode_bytes(wider, *enc_args[1:13], form_bytes, *enc_args[13:], KR.LANE_RUN, KR.LANE_RUN, 6,
                                        np.array(lay.dims, np.int64), True, 1024)
    assert refused_bytes[0] == refused[0] and (bits == 8) == (refused_bytes[1].size > 0)
    assert refused[0] == (1 << bits if bits < 8 else 255)
    assert bits == 8 or (refused[3].size == 0 and refused[4].size == 0 and refused[6] == 0)
    assert not chose[4] and np.array_equal(chose[3], words) and np.array_equal(chose[2], twords)
    si, pooled = R._GROUP_FORMS[form]
    weights = K.rans_level_weights(levels, TABLE_STEPS[si], R._GRID16, R.WEIGHT_BITS)
    assert np.array_equal(weights, R.level_to_weights(levels, TABLE_STEPS[si]))
    tb = max(1, int(hist.size - 1).bit_length())
    w = np.zeros((1, 1 << tb), np.int64)
    w[0, : hist.size] = hist
    tf, tc = K.rans_fused_tables(w, np.zeros((1, 1), np.int64), tb, KR.PRECISION)
    assert twords.tolist() == ref_encode(res, tb, 1, 1, 1, tf.tolist(), KR.PRECISION)
    div, mod, comp = lay.coder_args(pooled)
    freq, cum = K.rans_fused_tables(weights, comp, bits, KR.PRECISION)
    assert words.tolist() == ref_encode(flat, bits, lay.m, div, mod, freq.tolist(), KR.PRECISION)
    out = np.empty(flat.size, np.uint8)
    args = (bits, lay.m, lay.groups, TABLE_STEPS[si], pooled, coder, cg, cp, R._GRID16, MAX_LEVEL, R.WEIGHT_BITS, KR.PRECISION, out)
    assert K.rans_decode_symbols(hist, twords, words, *args) == 0
    assert np.array_equal(out, flat)
    forged = hist.copy()
    forged[0] += 1  # the table words no longer decode to this histogram
    assert K.rans_decode_symbols(forged, twords, words, *args) in (1, 3)
    assert K.rans_decode_symbols(hist, twords, words[:-1], *args) == 8
    tw8, w8 = twords.astype("<u2").tobytes(), words.astype("<u2").tobytes()
    payload = np.frombuffer(b"\x07" + tw8 + b"\x09" * 3 + w8 + b"\x05", np.uint8)  # both runs at odd offsets
    at = (1, twords.size, 4 + len(tw8), words.size)
    out[:] = 0
    assert K.rans_decode_payload(payload, *at, zlib.crc32(w8), hist, *args) == 0
    assert np.array_equal(out, flat)
    assert K.rans_decode_payload(payload, *at, zlib.crc32(w8) ^ 1, hist, *args) == 10
    assert KR.DECODE_ERRORS[10].startswith("coder words checksum mismatch")
    out[:] = 0
    assert K.rans_decode_payload(payload, *at, -1, hist, *args) == 0 and np.array_equal(out, flat)


def test_rans_payload_kernels_take_32_lanes_for_a_short_run_of_many_bits():
    """``lane_run < 0`` (kind 6): a run shorter than LANE_RUN whose estimated size reaches
    WIDE_BITS (20,000 8-bit symbols of ~7.9 bits, as CacheGen's anchors) is coded on 32 lanes,
    the words those of the pure-python coder on 32 lanes, and decodes with ``lane_run = 0``; the
    same run of 4-bit symbols (~3.9 bits: under WIDE_BITS) keeps 4 lanes."""
    from kvtune.codecs.range_coder import MAX_LEVEL, TABLE_STEPS
    from kvtune.codecs import rans as R

    for bits, wide_expected in ((8, True), (4, False)):
        shape = (1, 3, 104, 64)
        flat = np.random.default_rng(bits).integers(0, 1 << bits, math.prod(shape)).astype(np.uint8)
        lay = R.layout_for_shape("per_channel", bits, shape)
        coder, cg, cp = R._coder_plan(lay)
        assert flat.size // lay.m < KR.LANE_RUN
        form, hist, twords, words, wide = K.rans_encode_symbols(
            flat, bits, lay.m, *lay.count_args(), lay.groups, coder, cg, cp, R._NEG_GRID, R._GRID16, R._FORM_STEPS,
            R._FORM_POOLED, MAX_LEVEL, R.WEIGHT_BITS, KR.PRECISION, KR.LANE_RUN, -1)
        assert wide == wide_expected
        si, pooled = R._GROUP_FORMS[form]
        counts = K.rans_count_groups(flat, *lay.count_args(), lay.groups, 1 << bits)
        levels = K.rans_choose_table(counts, R._NEG_GRID, R._GRID16, R._FORM_STEPS, R._FORM_POOLED, MAX_LEVEL)[1]
        div, mod, comp = lay.coder_args(pooled)
        freq, _ = K.rans_fused_tables(R.level_to_weights(levels, TABLE_STEPS[si]), comp, bits, KR.PRECISION)
        lane_run = 0 if wide else KR.NO_LANE_RUN
        assert words.tolist() == ref_encode(flat, bits, lay.m, div, mod, freq.tolist(), KR.PRECISION, lane_run=lane_run)
        out = np.empty(flat.size, np.uint8)
        assert K.rans_decode_symbols(hist, twords, words, bits, lay.m, lay.groups, TABLE_STEPS[si], pooled, coder, cg, cp,
                                     R._GRID16, MAX_LEVEL, R.WEIGHT_BITS, KR.PRECISION, out, KR.LANE_RUN, lane_run) == 0
        assert np.array_equal(out, flat)


@covers("rans_count_groups")
@pytest.mark.parametrize("div, mod, n", [(1, 1, 0), (1, 1, 37), (1, 5, 40), (7, 3, 42), (4, 2, 64)])
def test_rans_count_groups_matches_bincount(div, mod, n):
    k = 16
    sym = np.random.default_rng(n).integers(0, k, n).astype(np.uint8)
    group = (np.arange(n) // div) % mod
    expected = np.zeros((mod, k), np.int64)
    np.add.at(expected, (group, sym), 1)
    assert np.array_equal(K.rans_count_groups(sym, div, mod, mod, k), expected)


@covers("column_counts")
@pytest.mark.parametrize("mod, k, rows", [(64, 2, 1), (64, 16, 255), (64, 32, 256), (128, 5, 700), (192, 17, 511),
                                          (64, 16, 0)])
def test_column_counts_match_bincount(mod, k, rows):
    """Per-column counts in byte vectors == ``np.add.at`` over (column, symbol), across the
    255-row blocks of the byte accumulators (one column holding the same value on every row
    of 700) and with symbols of ``k`` or more, which are not counted."""
    rng = np.random.default_rng(mod + k + rows)
    sym = rng.integers(0, k + 3, (rows, mod)).astype(np.uint8)
    sym[:, 1] = k - 1  # a counter that every row increments
    expected = np.zeros((mod, k), np.int64)
    inside = sym < k
    np.add.at(expected, (np.nonzero(inside)[1], sym[inside]), 1)
    got = K.column_counts(sym.reshape(-1), mod, k)
    assert got.shape == (mod, k) and np.array_equal(got, expected)
    assert got[1, k - 1] == rows


def component_case(shape, first, seed):
    """PCA-like coefficients (variance falling over the components; a constant component, a
    huge-mean one) and a component table of three segments (widths 1, 3, 8) with dropped ones."""
    b, h, t, d = shape
    rng = np.random.default_rng(seed)
    y = rng.standard_normal(shape).astype(np.float32) * np.linspace(30, 0.01, h * d, dtype=np.float32).reshape(1, h, 1, d)
    y[:, 0, :, 1] = 0.75  # constant: scale 0
    y[:, -1, :, -1] += 30000.0  # mean beyond float16 precision
    perm = rng.permutation(h * d)
    n1, n3 = (h * d) // 3, (h * d) // 4
    segs = [np.sort(perm[:n1]), np.sort(perm[n1 : n1 + n3]), np.sort(perm[n1 + n3 : -2])]
    return y, segs, (1, 3, 8), first


@covers("quantize_components", "dequantize_components")
@pytest.mark.parametrize("grid, step", [("gauss", 0.0), ("minmax", 0.0), ("ecsq", 1.5), ("ecsq", 1e-3), ("ecsq", 60000.0)])
@pytest.mark.parametrize("shape, first", [((1, 3, 33, 16), 4), ((2, 2, 7, 8), 0), ((1, 2, 5, 4), 5), ((1, 1, 1, 8), 0)])
def test_quantize_components_matches_component_quantizer(shape, first, grid, step):
    """Same symbols, metadata and reconstruction as the reference, every grid; ecsq with a step
    that some components' deviations widen (1.5), all do (1e-3) and none does (60000)."""
    from kvtune.codecs.bitalloc import GAUSSIAN_STEPS, ComponentQuantizer

    y, segs, widths, first = component_case(shape, first, seed=sum(shape))
    widths = (3, 5, 8) if grid == "ecsq" else widths  # ecsq: 3 bits and up (a level each side)
    b, h, t, d = shape
    nt = t - first
    comp = np.concatenate(segs).astype(np.int64)
    start = np.cumsum([0] + [len(s) for s in segs]).astype(np.int64)
    bits = np.array(widths, np.int64)
    sink = np.empty((b, h, first, d), np.uint16)
    meta = np.empty(2 * b * comp.size, np.uint16)
    sym = np.empty(b * nt * comp.size, np.uint8)
    hz, cz = divmod(int(segs[0][0]), d)  # a coded component whose minimum is -0: its zero point is +0
    y[:, hz, :, cz] = np.abs(y[:, hz, :, cz])
    y[:, hz, -1, cz] = -0.0
    rows = np.ascontiguousarray(y.transpose(0, 2, 1, 3).reshape(b, t, h * d))  # the kernels' token rows
    width = int(comp.max()) + 1  # the leading components a projection computes
    coeffs, ysink = rows[:, :, :width].copy(), rows[:, :first].copy()
    coeffs[:, :first] = np.nan  # the sink tokens' rows are not read: they come from ysink
    K.quantize_components(coeffs, ysink, comp, start, bits, np.array(GAUSSIAN_STEPS), K.GRID_CODES[grid], step, sink, meta,
                          sym)
    x = torch.from_numpy(y)
    assert np.array_equal(sink, bf16_bits(x[:, :, :first]))
    expected = np.zeros(shape, np.float32)
    expected[:, :, :first] = x[:, :, :first].to(torch.bfloat16).float().numpy()
    for s, (idx, w) in enumerate(zip(segs, widths)):
        block = x[:, idx // d, first:, idx % d].permute(1, 2, 0).unsqueeze(1)  # ComponentSegment.take
        q, m = ComponentQuantizer(bits=w, grid=grid, step=step).quantize_block(block)
        lo, hi = int(start[s]), int(start[s + 1])
        assert np.array_equal(sym[b * nt * lo : b * nt * hi], q.numpy().reshape(-1))
        ref_meta = np.concatenate([m["scale"].numpy().view(np.uint16).reshape(-1), m["zero"].numpy().view(np.uint16).reshape(-1)])
        assert np.array_equal(meta[2 * b * lo : 2 * b * hi], ref_meta)
        deq = ComponentQuantizer(bits=w, grid=grid, step=step).dequantize_block(q, m, tuple(block.shape))
        expected[:, idx // d, first:, idx % d] = deq[:, 0].permute(2, 0, 1).numpy()
    expected_rows = expected.transpose(0, 2, 1, 3).reshape(b, t, h * d)
    got, got_sink = np.full((b, t, width), np.nan, np.float32), np.full((b, first, h * d), np.nan, np.float32)
    K.dequantize_components(sym, meta, comp, start, bits, K.GRID_CODES[grid], sink, got_sink, got)
    assert np.array_equal(got.view(np.uint32), expected_rows[:, :, :width].view(np.uint32))  # dropped components: 0
    assert np.array_equal(got_sink.view(np.uint32), expected_rows[:, :first].view(np.uint32))


@covers("crc32_update", "crc32_combine")
@pytest.mark.parametrize("n", [0, 1, 15, 16, 17, 31, 63, 64, 65, 79, 80, 127, 128, 129, 191, 192, 255, 256, 257, 271,
                               272, 511, 512, 513, 767, 768, 1000, 4099, 1 << 17])
def test_crc32_matches_zlib(n):
    """Around the carry-less folding's boundaries (64 bytes to start the 128-bit fold, 64-byte
    steps; 256 bytes and 256-byte steps for the 512-bit one; 16-byte blocks, then a byte tail),
    on writable and read-only arrays and slices at odd offsets."""
    rng = np.random.default_rng(n)
    a = rng.integers(0, 256, size=n).astype(np.uint8)
    b = rng.integers(0, 256, size=(n * 7) % 61).astype(np.uint8)
    for seed in (0, 0xFFFFFFFF, 0x12345678):
        assert K.crc32_update(seed, a) == zlib.crc32(a.tobytes(), seed)
    ro = a.copy()
    ro.flags.writeable = False
    assert K.crc32_update(7, ro) == zlib.crc32(a.tobytes(), 7)
    if n > 3:
        assert K.crc32_update(0, a[3:]) == zlib.crc32(a[3:].tobytes())  # unaligned start
    ca, cb = zlib.crc32(a.tobytes()), zlib.crc32(b.tobytes())
    assert K.crc32_combine(ca, cb, b.size) == zlib.crc32(a.tobytes() + b.tobytes())
    assert K.crc32_combine(ca, 0, 0) == ca


@covers("warm_up")
def test_warm_up_compiles_the_fast_path_kernels():
    seconds = K.warm_up()
    assert 0.0 <= seconds < 3600.0
    for fn in (K.encode_segments, K.decode_segments, K.to_float32, K.store_output, K.hadamard_rows, K.delta_rows,
               K.delta_load, K.delta_store, K.affine_fit, K.affine_rows, K.crc32_combine, K.quantize_components, K.dequantize_components,
               K.encode_batch, K.decode_batch, K.crc32_concat):
        assert fn.signatures, fn.__name__
    assert len(K.crc32_update.signatures) >= 2  # writable sections and read-only streams
    assert len(K.encode_segments.signatures) >= 2  # float32 and bfloat16-bits inputs


def test_kernels_are_cached_under_a_digest_of_every_kernel_source(tmp_path):
    """Editing any kernel module (a helper that others inline included) changes the cache folder."""
    import shutil

    from kvtune.codecs.kernels import cachedir

    pkg = Path(cachedir.__file__).parent
    digest = cachedir.sources_digest()
    assert Path(K.quantize_per_token._cache._cache_path).parent.name == digest
    assert Path(K.encode_segments._cache._cache_path).parent.name == digest
    copy = tmp_path / "kernels"
    shutil.copytree(pkg, copy, ignore=shutil.ignore_patterns("__pycache__"))
    assert cachedir.sources_digest(copy) == digest
    helper = copy / "lowlevel.py"
    helper.write_text(helper.read_text() + "\n# edited\n")
    assert cachedir.sources_digest(copy) != digest


@covers("rans_pack_segments", "rans_unpack_payload")
@pytest.mark.parametrize("model", ["per_channel", "per_head", "global"])
def test_rans_segment_kernels_match_the_codec(model):
    """Per segment, :func:`rans_pack_segments` writes the bytes of ``RansCodec.pack``: rANS-coded
    (skewed symbols), raw when rANS is not smaller (uniform 8-bit symbols), 16-bit symbols raw,
    an empty segment as its kind byte; a too-wide symbol stops it with that segment's number.
    :func:`rans_unpack_payload` decodes each payload back to the codec's symbols."""
    from kvtune.codecs.rans import RansCodec, tensor_program

    rng = np.random.default_rng(3)
    shapes = [(1, 3, 40, 64), (1, 2, 33, 8), (1, 3, 9, 16), (1, 2, 0, 64), (1, 3, 17, 64)]
    widths = [2, 4, 8, 3, 16]
    syms = [np.minimum(rng.geometric(0.45, size=shapes[0]) - 1, 3).astype(np.uint8),
            np.minimum(rng.geometric(0.3, size=shapes[1]) - 1, 15).astype(np.uint8),
            rng.integers(0, 256, size=shapes[2], dtype=np.uint8),  # incompressible: stored raw
            np.zeros(shapes[3], np.uint8),
            rng.integers(0, 65536, size=shapes[4], dtype=np.uint16)]
    raw = [s.reshape(-1).view(np.uint8) for s in syms]  # 16-bit symbols as their little-endian bytes
    offsets = np.cumsum([0] + [r.size for r in raw])
    symbuf = np.concatenate(raw)
    prog = tensor_program(model, [(b, s.shape, int(o)) for b, s, o in zip(widths, syms, offsets)])
    pay = np.zeros(prog.payload_nbytes, np.uint8)
    lengths = np.zeros(len(syms), np.int64)
    assert K.rans_pack_segments(symbuf, *prog.args, pay, lengths) == 0
    codec = RansCodec(model=model)
    rows = prog.args[0]
    for s, (b, x) in enumerate(zip(widths, syms)):
        at = int(rows[s, K.PR_PAY])
        got = pay[at : at + lengths[s]]
        assert got.tobytes() == codec.pack(x, b), (s, b)
        out = np.zeros(2 * x.size if b == 16 else x.size, np.uint8)
        dims = prog.decode_args[0][rows[s, K.PR_DIMS] : rows[s, K.PR_DIMS] + rows[s, K.PR_NDIMS]]
        assert K.rans_unpack_payload(got, b, x.size, *prog.decode_args[1:2], dims, *prog.decode_args[2:], out)
        assert np.array_equal(out, raw[s])
    assert got[0] == 0 and widths[2] == 8 and lengths[2] == 1 + syms[2].size  # the raw fallback was taken
    wide = symbuf.copy()
    wide[offsets[1] + 5] = 16  # a 5th bit in the 4-bit segment
    assert K.rans_pack_segments(wide, *prog.args, pay, lengths) == 2


@covers("rans_encode_tensor", "rans_unpack_tensor")
@pytest.mark.parametrize("model", ["per_channel", "global"])
def test_rans_tensor_kernels_give_the_reference_streams(model):
    """The fast path codes a ``rans`` policy's tensors with :func:`rans_encode_tensor` and reads
    them with :func:`rans_unpack_tensor`: the stream bytes and the decoded tensors are the
    reference pipeline's (per-token and per-channel uniform segments, a bfloat16 window,
    CacheGen's deltas, shallow layers at 5 bits)."""
    from kvtune.codecs import PolicyConfig, decode_kv, encode_kv

    g = torch.Generator().manual_seed(7)
    kv = [(torch.randn(1, 2, 70, 32, generator=g).to(torch.bfloat16), torch.randn(1, 2, 70, 32, generator=g).to(torch.bfloat16))
          for _ in range(3)]
    policies = [
        {"key": {"name": "uniform", "bits": 2, "granularity": "per_channel", "group_size": 32, "recent_tokens": 16},
         "value": {"name": "uniform", "bits": 4, "granularity": "per_token", "group_size": 32, "recent_tokens": 16}},
        {"transforms": [{"name": "delta", "group_size": 10, "anchor_bits": 8}],
         "key": {"name": "uniform", "bits": 4, "symmetric": True, "granularity": "per_token", "group_size": 0,
                 "shallow_layers": 2, "shallow_bits": 5},
         "value": {"name": "uniform", "bits": 4, "symmetric": True, "granularity": "per_token", "group_size": 0}},
    ]
    for policy in policies:
        config = PolicyConfig.from_dict({**policy, "codec": {"name": "rans", "model": model}})
        fast = encode_kv(kv, config, impl="fast")
        assert fast == encode_kv(kv, config, impl="reference")
        for (k1, v1), (k2, v2) in zip(decode_kv(fast, impl="fast"), decode_kv(fast, impl="reference")):
            assert torch.equal(k1, k2) and torch.equal(v1, v2)
    assert K.rans_encode_tensor.signatures and K.rans_unpack_tensor.signatures  # the route the fast path took
