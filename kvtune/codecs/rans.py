"""Entropy-coding codec C ``rans``: interleaved rANS with per-channel / per-head / global models.

The same models as the ``range`` codec (CacheGen, Liu et al., arXiv 2310.07240, sec. 5.2:
order-0 distributions per (layer, K/V, group), estimated from the data and sent in the stream;
:mod:`kvtune.codecs.range_coder` describes the groups ``per_channel`` / ``per_head`` /
``global`` and the level-code tables), coded with kvtune's own rANS
(:mod:`kvtune.codecs.kernels.rans`: Duda, arXiv 1311.2540; interleaved 32-bit states after
Giesen, arXiv 1402.3392: 32 for runs of 32,768 super-symbols or more and for runs whose
estimated size makes the 28 extra states cost at most 1 %, coded 16 lanes per 512-bit vector by
:mod:`kvtune.codecs.kernels.rans_lanes`, else 4; 16-bit words; 13-bit
probabilities) instead of constriction's range coder, so that coding runs in compiled loops without per-call overhead: one kernel call per
tensor each way (:func:`kvtune.codecs.kernels.rans_encode_symbols` /
:func:`~kvtune.codecs.kernels.rans_decode_symbols`: counts, table choice, tables, words), which
releases the GIL, so the codec threads of :mod:`kvtune.codecs.fastpath` run in parallel (with
the steps as separate calls, two threads decoded slower than one). The fast path goes further:
one call per tensor for all its segments (:class:`RansProgram`,
:func:`kvtune.codecs.kernels.rans_encode_tensor` / :func:`~kvtune.codecs.kernels.rans_unpack_tensor`),
whose payload decoder refuses exactly what :meth:`RansCodec.unpack_into` refuses and leaves the
error message to it.

**Models.** A group's distribution travels as level codes (:func:`~kvtune.codecs.range_coder.count_levels`,
``steps`` levels per octave; 0 = absent). The decoder turns them into integer weights
``floor(2**20 * 2**(-(q - 1)/steps))`` (at least 1) and normalizes them with integer arithmetic
(:func:`kvtune.codecs.kernels.rans.rans_normalize`): every present symbol gets frequency >= 1, the
frequencies sum to exactly ``2**13``, and encoder and decoder build the same tables on every
machine. The encoder picks the table form with the fewest estimated bits: per-group codes with
2 or 4 levels per octave, or one pooled row with 4 or 8.

**Symbol fusion.** ``m`` adjacent symbols (``m * bits <= 8``: the largest ``m <=``
:func:`~kvtune.codecs.range_coder.fusion_factor` that divides the group's run: ``D`` for
per_channel, the (batch, head) block for per_head, the tensor for global) are coded as one
super-symbol with the product distribution (first symbol least significant; per_channel fuses
adjacent channels, the fused model being the product of their models), so 2-bit symbols take a
quarter of the coder steps. Products are rounded to 13 bits (rare tail products to 1/2**13),
which costs a fraction of a percent on real KV (measured in ``tests/test_rans.py``).

**Tables on the wire.** The pooled row's codes are sent as zigzagged differences to their left
neighbour, then (per-group form) each group's codes of the pooled row's present symbols as
zigzagged differences to the pooled code; these residuals are rANS-coded with their own
histogram (u32 counts), as the ``range`` codec does with constriction.

Wire layout of one packed tensor (little-endian)::

    u8      kind: 0 = raw (as the ``bitpack`` codec; 16-bit patterns as <u2), 6 = rANS (5 and
                4 = the previous formats, still decoded: 5 takes 32 lanes for runs of 32,768
                super-symbols or more, 4 takes 4 lanes for every run; 3 = the retired 15-bit
                format, refused with StreamVersionError)
    kind 6: u8   model (bits 0-1: 0 global, 1 per_head, 2 per_channel) | steps index (bits 2-3,
                 into TABLE_STEPS) | pooled (bit 4) | the symbols on 32 lanes (bit 5, else 4;
                 kind 5 has no bit 5)
            u8   m: fusion factor
            u32  per_channel: D; per_head: B, H; global: nothing
            u16  R; then R + 1 u32 residual counts (the table histogram, the last one nonzero)
            u32  T; then T u16 words: the table residuals, rANS-coded
            u32  CRC32 of (count as 8 bytes, bits as 1 byte, every byte above)
            u32  W; then W u16 words: the symbols, rANS-coded, then zero words up to
                 ``ceil(count / MAX_SYMBOLS_PER_BYTE)`` bytes in all
            u32  CRC32 of the W words (kinds 5 and 6; kind 4 ends with the words)

The zero padding (only for near-constant tensors, below ~0.008 bits per symbol) makes every
payload at least ``count / MAX_SYMBOLS_PER_BYTE`` bytes long, so a payload bounds the symbols it
can hold (:meth:`RansCodec.max_symbols`) and a forged count is refused before anything is
allocated. A tensor whose rANS form would not be smaller than raw is stored raw (kind 0), and so is one
whose table would exceed the decoder's limit (:func:`table_fits`).

Decoding checks every field against ``count`` / ``shape`` and the bytes present before
allocating what it sizes (a per-group table has at most :data:`MAX_TABLE_MODELS` fused models),
then the header CRC and (kinds 5 and 6) the coder words' CRC, then that the table residuals decode
exactly to their histogram (codes in ``0..255``, every group with a present symbol), then the
symbols: every lane must end in the encoder's initial state and the padding must be zero. Any
failure raises :class:`~kvtune.core.errors.CorruptStreamError`. Without the words' CRC (kind 4),
a changed coder word often decodes to a few wrong symbols with every lane still ending in its
initial state (rANS carries no redundancy): 3-8 % of single-bit flips did on skewed synthetic
4- and 8-bit payloads in a fuzz run of 2026-12-03; a kvtune stream's own CRC catches them either way.
"""

from __future__ import annotations

import functools
import math
import struct
import zlib
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from kvtune.codecs.base import Codec, param, register_codec
from kvtune.codecs.bitpack import RAW16, pack_bits, packed_nbytes, unpack_bits
from kvtune.codecs import kernels as K
from kvtune.codecs.kernels import rans as KR
from kvtune.codecs.range_coder import KIND_RAW, MAX_LEVEL, MAX_TABLE_ENTRIES, MODELS, TABLE_STEPS, fusion_factor, level_weights
from kvtune.core.errors import CorruptStreamError, StreamVersionError

__all__ = [
    "RansCodec",
    "KIND_RANS",
    "KIND_RANS_V3",
    "KIND_RANS_V2",
    "KIND_RANS_V1",
    "MAX_SYMBOLS_PER_BYTE",
    "MAX_TABLE_MODELS",
    "WEIGHT_BITS",
    "RansLayout",
    "layout_for_shape",
    "level_to_weights",
    "encode_rans",
    "RansProgram",
    "tensor_program",
    "table_fits",
    "empirical_entropy_bits",
]

KIND_RANS = 6
"""Kind byte of rANS-coded payloads (13-bit tables; the symbols on 32 lanes when the form byte's
bit 5 says so: the encoder sets it for runs of 32,768 super-symbols or more,
:data:`kvtune.codecs.kernels.rans.LANE_RUN`, and for runs of an estimated
:data:`~kvtune.codecs.kernels.rans.WIDE_BITS` bits or more; the table residuals as kind 5)."""
KIND_RANS_V3 = 5
"""Kind byte of the rANS format of 2026-12-03 (32 lanes for runs of 32,768 super-symbols or
more, else 4), still decoded, and written by :func:`encode_rans` on request."""
KIND_RANS_V2 = 4
"""Kind byte of the rANS format before that (4 lanes for every run), still decoded, and written
by :func:`encode_rans` on request."""
KIND_RANS_V1 = 3
"""Kind byte of the retired rANS format with 15-bit tables (refused with StreamVersionError)."""
MAX_SYMBOLS_PER_BYTE = 1024
"""A rANS payload (kind 4 or 5) of ``n`` bytes holds at most ``MAX_SYMBOLS_PER_BYTE * n`` symbols (zero padding)."""
WEIGHT_BITS = 20
"""Integer weight of level code 1 (the largest): ``2**WEIGHT_BITS``."""
MAX_TABLE_MODELS = 4096
"""Most fused models of a per-group table: the decoder builds 8 KiB of slot table per model
(32 MiB here), so a short payload that declares more groups cannot make it allocate gigabytes.
The encoder codes layouts with more (never KV: channels and heads number in the hundreds) with
the pooled table."""

_LANE_RUNS = {KIND_RANS: (KR.LANE_RUN, -1), KIND_RANS_V3: (KR.LANE_RUN, KR.LANE_RUN),
              KIND_RANS_V2: (KR.NO_LANE_RUN, KR.NO_LANE_RUN)}
"""``lane_run`` of the table residuals and of the symbols per payload kind; -1 (kind 6): the
encoder chooses the symbols' lanes (:func:`kvtune.codecs.kernels.rans_encode_symbols`) and the
form byte's bit 5 tells the decoder."""
_GROUP_FORMS = ((1, False), (2, False), (2, True), (3, True))
"""(steps index, pooled) candidates; per-group forms are skipped when there is one group."""
_MAX_RESIDUAL = 2 * MAX_LEVEL  # zigzag of a code difference in -255..255


def _err(msg: str) -> CorruptStreamError:
    return CorruptStreamError(f"rans codec: {msg}")


# ----------------------------------------------------------------------------- layout


@dataclass(frozen=True)
class RansLayout:
    """How ``count`` symbols split into groups and fused models.

    Attributes:
        model: one of :data:`~kvtune.codecs.range_coder.MODELS`.
        dims: per_channel ``(D,)``; per_head ``(B, H)``; global ``()``.
        count: symbols.
        m: fusion factor.
    """

    model: str
    dims: tuple[int, ...]
    count: int
    m: int

    @property
    def groups(self) -> int:
        """Groups with their own distribution."""
        return self.dims[0] if self.model == "per_channel" else self.dims[1] if self.model == "per_head" else 1

    @property
    def run(self) -> int:
        """Symbols of one group that are consecutive in C order (the fusion must divide it)."""
        if self.model == "per_channel":
            return self.dims[0]
        if self.model == "per_head":
            return self.count // (self.dims[0] * self.dims[1])
        return self.count

    def count_args(self) -> tuple[int, int]:
        """``(div, mod)`` of the symbols' groups for :func:`kvtune.codecs.kernels.rans.rans_count_groups`."""
        if self.model == "per_channel":
            return 1, self.dims[0]
        if self.model == "per_head":
            return self.run, self.dims[1]
        return 1, 1

    def coder_args(self, pooled: bool) -> tuple[int, int, np.ndarray]:
        """``(div, mod, comp)`` of the super-symbols' fused models (see the kernels)."""
        m = self.m
        if pooled:
            return 1, 1, np.zeros((1, m), np.int64)
        if self.model == "per_channel":
            nq = self.dims[0] // m
            return 1, nq, np.arange(nq * m, dtype=np.int64).reshape(nq, m)
        if self.model == "per_head":
            h = self.dims[1]
            return self.run // m, h, np.repeat(np.arange(h, dtype=np.int64)[:, None], m, axis=1)
        return 1, 1, np.zeros((1, m), np.int64)


def _largest_fusion(bits: int, run: int) -> int:
    return max(m for m in range(1, fusion_factor(bits) + 1) if run % m == 0)


def layout_for_shape(model: str, bits: int, shape: Sequence[int]) -> RansLayout:
    """The layout of symbols of ``shape`` (C order) under ``model`` with the largest fusion.

    Raises:
        ValueError: unknown model.
    """
    if model not in MODELS:
        raise ValueError(f"rans codec: model must be one of {MODELS}, got {model!r}")
    return _layout(model, bits, tuple(int(s) for s in shape))


@functools.lru_cache(maxsize=1024)
def _layout(model: str, bits: int, shape: tuple[int, ...]) -> RansLayout:
    """:func:`layout_for_shape` of a checked model and a tuple shape (one per tensor shape of a
    policy; cached: it ran for every tensor each way)."""
    count = math.prod(shape)
    heads = (shape[0], shape[1]) if len(shape) >= 3 else (1, 1)  # fewer than 3 axes: one head group
    dims = {"per_channel": (shape[-1] if shape else 1,), "per_head": heads, "global": ()}[model]
    lay = RansLayout(model, dims, count, 1)
    return RansLayout(model, dims, count, _largest_fusion(bits, lay.run) if count else 1)


# ----------------------------------------------------------------------------- tables


def level_to_weights(levels: np.ndarray, steps: int) -> np.ndarray:
    """Integer weights int64 of level codes: 0 -> 0, ``q >= 1`` -> ``max(1, floor(2**20 * 2**(-(q-1)/steps)))``.

    Exact on every machine: the float weights of :func:`~kvtune.codecs.range_coder.level_weights`
    are exact grid constants times powers of two, scaled here by a power of two.
    """
    q = np.asarray(levels, dtype=np.int64)
    w = np.floor(np.ldexp(level_weights(q, steps), WEIGHT_BITS)).astype(np.int64)
    return np.where(q > 0, np.maximum(w, 1), 0)


_NEG_GRID = -level_weights(np.arange(2, (2 * (MAX_LEVEL - 2) + 1) * 8 + 2), 16)
"""``-2**(-u/16)``, ``u = 1 ..`` the last level boundary (the grid of ``count_levels``)."""
_GRID16 = level_weights(np.arange(1, 17), 16)
_FORM_STEPS = np.array([TABLE_STEPS[si] for si, _ in _GROUP_FORMS], np.int64)
_FORM_POOLED = np.array([pooled for _, pooled in _GROUP_FORMS], np.int64)
_ALL_FORMS = np.arange(len(_GROUP_FORMS))
_POOLED_FORMS = np.flatnonzero(_FORM_POOLED)
_FORM_CHOICES = tuple((f, _FORM_STEPS[f], _FORM_POOLED[f]) for f in (_ALL_FORMS, _POOLED_FORMS))
"""``(forms, their steps, their pooled flags)``: every form, or (too many models for a
per-group table) the pooled ones."""


@functools.lru_cache(maxsize=256)
def _coder_plan(lay: RansLayout) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(coder, comp_group, comp_pooled)`` of the payload kernels for ``lay``: ``coder`` =
    int64 ``(div, mod)`` per group then pooled (see :meth:`RansLayout.coder_args`)."""
    dg, mg, cg = lay.coder_args(False)
    dp, mp, cp = lay.coder_args(True)
    return np.array([dg, mg, dp, mp], np.int64), cg, cp


# ----------------------------------------------------------------------------- encode


def _header_crc(head: bytes | memoryview, count: int, bits: int) -> int:
    return zlib.crc32(head, zlib.crc32(count.to_bytes(8, "little") + bytes([bits])))


def encode_rans(symbols: np.ndarray, bits: int, model: str, kind: int = KIND_RANS) -> bytes:
    """rANS-code uint8 ``symbols`` (any non-empty shape, values ``< 2**bits``, bits 1..8): the
    kind-6 encoding of :class:`RansCodec` (``kind=KIND_RANS_V3`` / ``KIND_RANS_V2``: the
    previous formats, which kvtune versions of 2026-12-03 / before read), without its raw
    fallback (module doc: wire layout). The coding and the payload's bytes take one kernel call
    (:func:`kvtune.codecs.kernels.rans_encode_bytes`), whose other arguments are computed once
    per shape.

    Raises:
        ValueError: nothing to encode, ``kind`` is not a rANS kind this version writes, or the
            symbols are not uint8 below ``2**bits`` (checked by the kernel before it counts).
    """
    if kind not in _LANE_RUNS:
        raise ValueError(f"rans codec: writes kind {KIND_RANS}, {KIND_RANS_V3} or {KIND_RANS_V2}, not {kind}")
    if model not in MODELS:
        raise ValueError(f"rans codec: model must be one of {MODELS}, got {model!r}")
    args = _encode_args(model, bits, tuple(int(s) for s in symbols.shape), kind)
    if args is None:
        raise ValueError("rans codec: nothing to encode")
    flat = np.ascontiguousarray(symbols).reshape(-1)
    if flat.dtype != np.uint8:
        raise ValueError(f"rans codec: {bits}-bit symbols must be uint8, got {flat.dtype}")
    top, payload = KR.rans_encode_bytes(flat, *args)
    if top >> bits:
        raise ValueError(f"rans codec: symbol {top} does not fit in {bits} bits (symbols must be below {1 << bits})")
    return payload.tobytes()


@functools.lru_cache(maxsize=1024)
def _encode_args(model: str, bits: int, shape: tuple[int, ...], kind: int) -> tuple | None:
    """The arguments of :func:`kvtune.codecs.kernels.rans_encode_bytes` after the symbols, for
    symbols of ``shape`` (a checked model and kind; ``None``: no symbols). Cached: one per
    tensor shape and width of a policy; the per-call work of an encode was mostly this."""
    lay = _layout(model, bits, shape)
    if lay.count == 0:
        return None
    coder, comp_group, comp_pooled = _coder_plan(lay)
    forms, form_steps, form_pooled = _FORM_CHOICES[int(coder[1] > MAX_TABLE_MODELS)]
    form_bytes = np.array([MODELS.index(model) | _GROUP_FORMS[f][0] << 2 | int(_GROUP_FORMS[f][1]) << 4 for f in forms],
                          np.int64)
    table_run, run = _LANE_RUNS[kind]
    return (bits, lay.m, *lay.count_args(), lay.groups, coder, comp_group, comp_pooled, _NEG_GRID, _GRID16, form_steps,
            form_pooled, form_bytes, MAX_LEVEL, WEIGHT_BITS, KR.PRECISION, table_run, run, kind,
            np.array(lay.dims, np.int64), kind != KIND_RANS_V2, MAX_SYMBOLS_PER_BYTE)


@dataclass(frozen=True, eq=False)
class RansProgram:
    """The rANS coding of every segment of one tensor plan, as
    :func:`kvtune.codecs.kernels.rans_encode_tensor` reads it: the arguments
    :func:`encode_rans` would pass for each segment, stacked, so that one kernel call codes a
    whole tensor (the codec's :meth:`RansCodec.pack`, raw fallback included, without per-segment
    Python). Built once per plan (:func:`tensor_program`).

    Attributes:
        args: the kernel's arguments after the tensor's: int64 ``(S, PR_COLUMNS)`` rows
            (:data:`kvtune.codecs.kernels.PR_COLUMNS`), the int64 pool they index (each
            segment's coder ``(div, mod)`` pairs, fused-model tables, layout dims and candidate
            table forms), then the constants of :func:`kvtune.codecs.kernels.rans_encode_bytes`.
        payload_nbytes: bytes of the payload buffer: every segment's raw size (kind byte
            included), the most :meth:`RansCodec.pack` writes.
        decode_args: the arguments of :func:`kvtune.codecs.kernels.rans_unpack_tensor` after
            the rows: the pool, the model's index in :data:`~kvtune.codecs.range_coder.MODELS`,
            the decoder's limits (``LIM_*``) and the level grid.
    """

    args: tuple
    payload_nbytes: int
    decode_args: tuple = ()


def tensor_program(model: str, segments: Sequence[tuple[int, tuple[int, ...], int]]) -> RansProgram:
    """The :class:`RansProgram` of a tensor's segments, each ``(bits, shape, symbol offset)``:
    ``bits`` 1..8 or 16 (stored raw), the offset of its symbols in the tensor's symbol buffer
    (uint8; little-endian uint16 for 16 bits). Segment ``s``'s payload goes at the sum of the
    earlier segments' raw sizes. A segment whose table would exceed what the decoder accepts
    (:func:`table_fits`) is stored raw, as :meth:`RansCodec.pack` stores it.

    Raises:
        ValueError: unknown model, or bits outside 1..8 and 16.
    """
    if model not in MODELS:
        raise ValueError(f"rans codec: model must be one of {MODELS}, got {model!r}")
    rows, pool = [], []

    def put(*arrays) -> int:  # the offset in the pool of the first array; the others follow it
        at = sum(len(p) for p in pool)
        pool.extend(np.asarray(x, np.int64).reshape(-1) for x in arrays)
        return at

    pay = 0
    for bits, shape, sym in segments:
        count = math.prod(shape)
        if bits == RAW16:
            raw = 1 + 2 * count
        elif 1 <= bits <= 8:
            raw = 1 + packed_nbytes(count, bits)
        else:
            raise ValueError(f"rans codec: bit width must be 1..8 or 16, got {bits}")
        row = [0] * K.PR_COLUMNS
        row[K.PR_BITS], row[K.PR_COUNT], row[K.PR_SYM], row[K.PR_RAW], row[K.PR_PAY] = bits, count, sym, raw, pay
        if bits != RAW16 and count:
            shape = tuple(int(d) for d in shape)
            dims = _layout(model, bits, shape).dims
            row[K.PR_DIMS], row[K.PR_NDIMS] = put(dims), len(dims)  # the decoder checks every payload's
            if table_fits(model, bits, shape):
                _, m, cdiv, cmod, groups, coder, comp_group, comp_pooled, _, _, steps, pooled, form_bytes = \
                    _encode_args(model, bits, shape, KIND_RANS)[:13]
                row[K.PR_M], row[K.PR_CDIV], row[K.PR_CMOD], row[K.PR_GROUPS] = m, cdiv, cmod, groups
                row[K.PR_CODER] = put(coder)
                row[K.PR_CG], row[K.PR_CG_ROWS], row[K.PR_CP] = put(comp_group), len(comp_group), put(comp_pooled)
                row[K.PR_FORMS], row[K.PR_NFORMS] = put(steps, pooled, form_bytes), len(steps)
        rows.append(row)
        pay += raw
    table_run, run = _LANE_RUNS[KIND_RANS]
    rows_arr = np.array(rows, np.int64).reshape(len(rows), K.PR_COLUMNS)
    pool_arr = np.concatenate(pool) if pool else np.zeros(0, np.int64)
    args = (rows_arr, pool_arr, _NEG_GRID, _GRID16, MAX_LEVEL, WEIGHT_BITS, KR.PRECISION, table_run, run, KIND_RANS,
            MAX_SYMBOLS_PER_BYTE)
    limits = np.zeros(K.LIM_STEPS + len(TABLE_STEPS), np.int64)
    for i, v in ((K.LIM_MAX_LEVEL, MAX_LEVEL), (K.LIM_WEIGHT_BITS, WEIGHT_BITS), (K.LIM_PREC, KR.PRECISION),
                 (K.LIM_MAX_RESIDUAL, _MAX_RESIDUAL), (K.LIM_MAX_TABLE_ENTRIES, MAX_TABLE_ENTRIES),
                 (K.LIM_MAX_TABLE_MODELS, MAX_TABLE_MODELS), (K.LIM_PER_BYTE, MAX_SYMBOLS_PER_BYTE),
                 (K.LIM_LANE_RUN, KR.LANE_RUN), (K.LIM_NO_LANE_RUN, KR.NO_LANE_RUN)):
        limits[i] = v
    limits[K.LIM_STEPS :] = TABLE_STEPS
    return RansProgram(args, pay, (pool_arr, MODELS.index(model), limits, _GRID16))


def table_fits(model: str, bits: int, shape: Sequence[int]) -> bool:
    """Whether symbols of ``bits`` and ``shape`` can be rANS-coded with a table the decoder
    accepts: at most :data:`~kvtune.codecs.range_coder.MAX_TABLE_ENTRIES` groups x symbols (a
    per-channel model of a head_dim beyond 65,536 at 8 bits is not; :meth:`RansCodec.pack` stores
    such symbols raw)."""
    return _layout(model, bits, tuple(int(d) for d in shape)).groups << bits <= MAX_TABLE_ENTRIES


# ----------------------------------------------------------------------------- decode


class _Reader:
    """Bounds-checked little-endian reads from a memoryview."""

    def __init__(self, buf: memoryview) -> None:
        self.buf, self.pos = buf, 0

    def take(self, n: int, what: str) -> memoryview:
        if n < 0 or self.pos + n > len(self.buf):
            raise _err(f"data ends inside {what}")
        out = self.buf[self.pos : self.pos + n]
        self.pos += n
        return out

    def uint(self, fmt: str, what: str) -> int:
        return struct.unpack(fmt, self.take(struct.calcsize(fmt), what))[0]


@functools.lru_cache(maxsize=1024)
def _check_layout(model: str, bits: int, m: int, dims: tuple[int, ...], count: int, shape) -> RansLayout:
    """The layout a payload header declares, checked against ``count`` and the tuple ``shape``
    (or ``None``); cached: one per tensor shape and width of a policy, for every tensor decoded."""
    divisor = math.prod(dims)
    if divisor == 0 or count % divisor:
        raise _err(f"layout {dims} does not divide {count} symbols")
    lay = RansLayout(model, dims, count, m)
    if not 1 <= m <= fusion_factor(bits) or lay.run % m:
        raise _err(f"fusion {m} is invalid for {bits}-bit symbols in runs of {lay.run}")
    if shape is not None and layout_for_shape(model, bits, shape).dims != dims:
        raise _err(f"payload layout {dims} does not match the tensor shape {tuple(shape)}")
    if lay.groups << bits > MAX_TABLE_ENTRIES:
        raise _err(f"{lay.groups} groups x {1 << bits} symbols exceed the table limit {MAX_TABLE_ENTRIES}")
    return lay


def decode_rans(data, model: str, bits: int, count: int, shape=None, out: np.ndarray | None = None) -> np.ndarray:
    """Decode a kind-6, 5 or 4 payload (the kind byte included) to ``count`` flat uint8 symbols,
    written into ``out`` (uint8 ``(count,)``, C-contiguous) when given, else a new array.

    Raises:
        CorruptStreamError: any inconsistency (see the module doc).
        StreamVersionError: a payload of the retired 15-bit format (kind 3).
        ValueError: ``out`` is not a C-contiguous uint8 array of ``count`` elements.
    """
    if out is not None and (not isinstance(out, np.ndarray) or out.dtype != np.uint8 or out.shape != (count,)
                            or not out.flags.c_contiguous or not out.flags.writeable):
        raise ValueError(f"rans codec: out must be a writeable C-contiguous uint8 array of shape ({count},), got "
                         f"{getattr(out, 'dtype', type(out).__name__)} {getattr(out, 'shape', '')}")
    buf = memoryview(data).cast("B")
    if count > MAX_SYMBOLS_PER_BYTE * len(buf):
        raise _err(f"{len(buf)} bytes cannot hold {count} symbols (at most {MAX_SYMBOLS_PER_BYTE} per byte)")
    rd = _Reader(buf)
    kind, form, m = rd.take(3, "the header")
    if kind == KIND_RANS_V1:
        raise StreamVersionError("rans codec: payload in the 15-bit table format (written by kvtune before the "
                                 "13-bit tables of 2026-12-02); this version reads the 13-bit format only: re-encode the KV")
    if kind not in _LANE_RUNS or bits == RAW16 or count == 0:
        raise _err(f"payload kind {kind} is invalid for {count} symbols of {bits} bits")
    model_id, si, pooled = form & 3, (form >> 2) & 3, bool(form & 16)
    table_run, run = _LANE_RUNS[kind]
    if run < 0:  # kind 6, bit 5: the symbols on 32 lanes
        run = 0 if form & 32 else KR.NO_LANE_RUN
        form &= ~32
    if form >> 5 or model_id >= len(MODELS) or MODELS[model_id] != model:
        raise _err(f"payload form byte {form} does not say model {model!r}")
    ndims = {"per_channel": 1, "per_head": 2, "global": 0}[model]
    dims = struct.unpack(f"<{ndims}I", rd.take(4 * ndims, "the layout"))
    lay = _check_layout(model, bits, m, dims, count, None if shape is None else tuple(shape))
    nhist = rd.uint("<H", "the table histogram length") + 1
    if nhist > _MAX_RESIDUAL + 1:
        raise _err(f"table histogram of {nhist} entries exceeds {_MAX_RESIDUAL + 1}")
    counts = struct.unpack(f"<{nhist}I", rd.take(4 * nhist, "the table histogram"))  # Python ints: no numpy reductions
    if counts[-1] == 0:
        raise _err("the table histogram ends with a zero count")
    nt = rd.uint("<I", "the table word count")
    tw_at = rd.pos
    rd.take(2 * nt, "the table words")
    crc_at = rd.pos
    if rd.uint("<I", "the header checksum") != _header_crc(buf[:crc_at], count, bits):
        raise _err(f"header checksum mismatch (altered header or table, or not written for {count} symbols of {bits} bits)")
    k = 1 << bits
    total = sum(counts)
    if total > k * (lay.groups + 1):
        raise _err(f"the table histogram counts {total} entries, a table has at most {k * (lay.groups + 1)}")
    if total < k:
        raise _err("the table histogram counts fewer entries than the pooled row has")
    coder, comp_group, comp_pooled = _coder_plan(lay)
    if not pooled and coder[1] > MAX_TABLE_MODELS:
        raise _err(f"a per-group table of {coder[1]} fused models exceeds {MAX_TABLE_MODELS}")
    nw = rd.uint("<I", "the coder word count")
    w_at = rd.pos
    rd.take(2 * nw, "the coder words")
    words_crc = -1 if kind == KIND_RANS_V2 else rd.uint("<I", "the coder words checksum")
    if rd.pos != len(buf):
        raise _err(f"{len(buf) - rd.pos} bytes follow the coder words")
    if out is None:
        out = np.empty(count, np.uint8)
    # the words' checksum, their copy into aligned arrays and the decode: one call without the GIL
    status = KR.rans_decode_payload(np.frombuffer(buf, np.uint8), tw_at, nt, w_at, nw, words_crc,
                                    np.array(counts, np.int64), bits, m, lay.groups, TABLE_STEPS[si], pooled, coder,
                                    comp_group, comp_pooled, _GRID16, MAX_LEVEL, WEIGHT_BITS, KR.PRECISION, out,
                                    table_run, run)
    if status:
        raise _err(KR.DECODE_ERRORS[status])
    return out


def empirical_entropy_bits(symbols: np.ndarray, bits: int, model: str) -> float:
    """Order-0 empirical entropy (bits) of ``symbols`` under ``model``'s groups: ``sum_g n_g H(p_g)``
    with ``p_g`` the group's symbol frequencies (the size an ideal coder with free tables reaches)."""
    lay = layout_for_shape(model, bits, symbols.shape)
    counts = KR.rans_count_groups(np.ascontiguousarray(symbols).reshape(-1), *lay.count_args(), lay.groups, 1 << bits)
    n = counts.sum(axis=1, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        return float(np.where(counts > 0, counts * np.log2(n / np.maximum(counts, 1)), 0.0).sum())


# ----------------------------------------------------------------------------- the codec


def _checked_flat(a: np.ndarray, bits: int) -> np.ndarray:
    """``a`` flattened, after checking that it holds symbols of width ``bits`` (ValueError if not)."""
    if bits != RAW16 and not 1 <= bits <= 8:
        raise ValueError(f"rans codec: bit width must be 1..8 or 16, got {bits}")
    flat = a.reshape(-1)
    if bits == RAW16 and a.dtype not in (np.uint16, np.int16):
        raise ValueError(f"rans codec: 16-bit symbols must be uint16 (or int16) patterns, got {a.dtype}")
    if bits != RAW16 and a.dtype != np.uint8:
        raise ValueError(f"rans codec: {bits}-bit symbols must be uint8 below {1 << bits}, got {a.dtype}")
    return flat  # their range: checked by the coding kernel (encode_rans) before anything is counted


def _as_numpy(symbols: torch.Tensor | np.ndarray) -> np.ndarray:
    if isinstance(symbols, torch.Tensor):
        return symbols.detach().cpu().contiguous().numpy()
    return np.ascontiguousarray(symbols)


@register_codec("rans")
@dataclass(frozen=True)
class RansCodec(Codec):
    """Interleaved rANS with order-0 models estimated from the data (the models of CacheGen,
    arXiv 2310.07240, sec. 5.2; rANS after Duda, arXiv 1311.2540).

    The module docstring gives the wire layout and the table encoding.

    Args:
        model: ``"per_channel"`` (one distribution per index of the last axis),
            ``"per_head"`` (per index of axis 1) or ``"global"`` (one per tensor).

    Example::

        >>> import numpy as np
        >>> x = np.random.default_rng(0).choice(16, p=[0.5] + [0.5 / 15] * 15, size=(1, 3, 256, 64)).astype(np.uint8)
        >>> packed = RansCodec().pack(x, 4)
        >>> round(8 * len(packed) / x.size, 2)    # bits per symbol (64 tables included); entropy 2.95
        2.99
        >>> np.array_equal(RansCodec().unpack(packed, 4, x.size, shape=x.shape), x.reshape(-1))
        True
    """

    model: str = param("per_channel", choices=MODELS, doc="probability model granularity")

    def supports(self, bits: int) -> bool:
        """Widths 1..8 (rANS-coded) and 16 (stored raw)."""
        return 1 <= bits <= 8 or bits == RAW16

    def max_symbols(self, payload: bytes | memoryview) -> int:
        """The most symbols ``payload`` can hold: ``8 *`` the bytes after the kind byte of a raw
        payload, :data:`MAX_SYMBOLS_PER_BYTE` ``*`` its length for a rANS payload (the encoder pads
        shorter ones; the retired kind 3 too, so that its decode reports the version), 0 for an
        empty payload or an unknown kind."""
        if len(payload) == 0:
            return 0
        if payload[0] == KIND_RAW:
            return 8 * (len(payload) - 1)
        return MAX_SYMBOLS_PER_BYTE * len(payload) if payload[0] in (KIND_RANS, KIND_RANS_V3, KIND_RANS_V2, KIND_RANS_V1) else 0

    def pack(self, symbols: torch.Tensor | np.ndarray, bits: int) -> bytes:
        """rANS-code ``symbols`` (any shape, C order; last axis = channels, axis 1 = heads).

        Returns:
            The packed bytes, deterministic. Stored raw (kind 0) when ``bits == 16``, when
            rANS would not be smaller, or when its table would exceed the decoder's limit
            (:func:`table_fits`).

        Raises:
            ValueError: wrong dtype, a symbol ``>= 2**bits``, or an unsupported width.
        """
        a = _as_numpy(symbols)
        flat = _checked_flat(a, bits)
        if bits == RAW16:
            return bytes([KIND_RAW]) + flat.astype("<u2", copy=False).tobytes()
        raw_len = 1 + packed_nbytes(flat.size, bits)
        if flat.size and table_fits(self.model, bits, a.shape):
            coded = encode_rans(a, bits, self.model)
            if len(coded) < raw_len:
                return coded
        return bytes([KIND_RAW]) + pack_bits(flat, bits)

    def unpack(self, data, bits: int, count: int, *, shape=None) -> np.ndarray:
        """Decode ``count`` symbols: a flat uint8 array (uint16 when ``bits == 16``).

        Raises:
            CorruptStreamError: the data cannot decode to exactly ``count`` symbols (module doc).
            ValueError: unsupported ``bits``, negative ``count``, ``shape`` not holding ``count``.
        """
        buf, count = self._checked_payload(data, bits, count, shape)
        if buf[0] != KIND_RAW:
            return decode_rans(buf, self.model, bits, count, shape)
        expected = 2 * count if bits == RAW16 else packed_nbytes(count, bits)
        if len(buf) - 1 != expected:
            raise _err(f"raw payload has {len(buf) - 1} bytes, {count} symbols of {bits} bits need {expected}")
        if bits == RAW16:
            return np.frombuffer(buf[1:], dtype="<u2", count=count).astype(np.uint16)
        return unpack_bits(buf[1:], bits, count)

    def unpack_into(self, data, bits: int, count: int, out: np.ndarray, *, shape=None) -> None:
        """:meth:`unpack` into uint8 ``out`` (``count`` elements; ``2 * count`` when ``bits ==
        16``); a rANS payload decodes straight into it (the fast path's symbol buffer).

        Raises:
            CorruptStreamError: as :meth:`unpack`.
            ValueError: as :meth:`unpack`, or ``out`` is not C-contiguous uint8 of that size.
        """
        buf, count = self._checked_payload(data, bits, count, shape)
        if buf[0] == KIND_RAW or bits == RAW16:
            super().unpack_into(buf, bits, count, out, shape=shape)
        else:
            decode_rans(buf, self.model, bits, count, shape, out=out)

    def _checked_payload(self, data, bits: int, count: int, shape) -> tuple[memoryview, int]:
        """``(data as bytes, count as an int)`` after :meth:`unpack`'s argument checks
        (ValueError), with a kind byte (CorruptStreamError)."""
        if isinstance(count, bool) or not isinstance(count, (int, np.integer)):
            raise ValueError(f"rans codec: count must be an integer, got {count!r}")
        count = int(count)
        if not isinstance(data, (bytes, bytearray, memoryview, np.ndarray)):
            raise ValueError(f"rans codec: data must be bytes-like, got {type(data).__name__}")
        problem = (None if self.supports(bits) else f"bit width must be 1..8 or 16, got {bits}") or (
            f"count must be >= 0, got {count}" if count < 0 else None) or (
            f"shape {tuple(shape)} does not hold {count} symbols" if shape is not None and math.prod(shape) != count else None)
        if problem:
            raise ValueError(f"rans codec: {problem}")
        try:
            buf = memoryview(data).cast("B")
        except (TypeError, ValueError) as exc:  # e.g. a strided array
            raise ValueError(f"rans codec: data must be contiguous bytes ({exc})") from None
        if len(buf) < 1:
            raise _err("empty payload (no kind byte)")
        return buf, count
