"""Entropy-coding codec C ``range``: range coding with per-channel / per-head / global models.

CacheGen (Liu et al., "CacheGen: KV Cache Compression and Streaming for Fast Large Language
Model Serving", SIGCOMM'24, arXiv 2310.07240, sec. 5.2) entropy-codes quantized KV symbols with arithmetic
coding and probability models per (layer, channel). This codec does the same with the range
coder of the ``constriction`` library (``constriction.stream.queue.RangeEncoder``: 32-bit
words, 24-bit probability precision). ``pack`` is called once per K or V tensor of a layer,
so the models are per (layer, K/V, group); a group is

=============  ==========================================================================
model          one categorical distribution over the ``2**bits`` symbols per
=============  ==========================================================================
per_channel    index of the last axis (head_dim): ``G = shape[-1]`` groups
per_head       index of axis 1 (kv_heads), over all batches: ``G = shape[1]`` groups
               (inputs with fewer than 3 axes have one group)
global         tensor: ``G = 1``
=============  ==========================================================================

**Frequency tables** (format 2) are estimated from the data being encoded and sent in the
stream (their bytes count in ``len(stream)``). A group's model is a *level code* per symbol:
``q = 0`` for a symbol that does not occur (never encoded; constriction still gives it the
smallest representable probability, so the model stays valid), else the grid point nearest to
its frequency ``c / n``: weight ``2**(-(q - 1) / steps)`` with ``steps`` levels per octave
(1, 2, 4 or 8; :func:`count_levels`, :func:`level_weights`). The grid is 16 literal constants
times powers of two and the rounding boundaries are compared, not computed with a logarithm,
so every machine builds bit-identical models. The codes are sent as residuals: the pooled row
(the codes of the tensor's summed counts) against each code's left neighbour, then every
group's codes against the pooled row's; the zigzagged residuals are range coded with their own
histogram (sent as varints). The encoder tries every ``steps`` with per-group codes and with
the pooled row alone (one model for every group: the only sensible choice for small groups
over a large alphabet, such as CacheGen's 8-bit anchors) and keeps the one with the fewest
estimated table + payload bits. Measured on real SmolLM2 CacheGen symbols (30 layers of
``(1, 3, 1024, 64)`` K and V): 4-bit per-channel tables 0.36 % of their payloads (format 1:
1.09 %), 5-bit 0.75 % (1.79 %), 8-bit anchors 1.009x their pooled empirical entropy (format 1
stored them raw: 1.144x; their per-channel empirical entropy, ~300 samples per channel over 256
values, is ~10 % lower but no transmitted model reaches it); KIVI-4 per-channel 0.29 % (0.83 %).
Tables estimated on a calibration set and stored with the profile are not implemented:
``Codec.pack`` is not told the layer or K/V of its tensor.

**Symbol fusion (speed).** constriction's range decoder costs ~20-35 ns per coded symbol,
almost independent of the alphabet size up to 256, so ``m = max(1, 8 // bits)`` symbols are
coded as one super-symbol over ``2**(bits*m) <= 256`` values with the product distribution
of their models (1 bit: 8 symbols, 2 bits: 4, 3 or 4 bits: 2, 5..8 bits: 1). The code length
is unchanged (the product model's entropy is the sum of the parts') and the number of coder
steps drops ``m``-fold. The first symbol is the least significant digit:
``super = s_0 + K*s_1 + ... + K**(m-1)*s_(m-1)`` with ``K = 2**bits``. per_channel fuses ``m``
adjacent channels of one row (one fused model serves ``m`` channels); per_head and global
fuse ``m`` consecutive symbols of a group. The last ``D mod m`` channels (per_channel) or
``n mod m`` symbols of each group are coded unfused with their own group's model.

**coded_bits (speed/ratio knob).** With ``coded_bits = c > 0`` only the top ``min(c, bits)``
bits of each symbol are range coded; the remaining low bits are bit-packed raw (they are
close to uniform for uniform quantizers, so little is lost: on real SmolLM2 4-bit KIVI
symbols the per-channel entropy is 3.89/3.80 bits for K/V, 3.92/3.85 with the 2 low bits
raw). Fewer coded bits mean wider fusion and fewer coder steps: 4-bit symbols with
``coded_bits = 2`` decode ~1.5x faster. ``coded_bits = 0`` (default) codes every bit.

**Throughput** (2-core CPU, CPU time, real SmolLM2 KIVI symbols of a ``(1, 3, 1024, 64)`` x
2 x 30-layer KV, GB/s of the original bfloat16 bytes; memcpy ~6 GB/s): 2-bit encode 0.2-0.3,
decode 0.14-0.17; 4-bit encode 0.13-0.23, decode 0.08-0.10 (0.12-0.16 with
``coded_bits = 2``). The bound is constriction's decoder, ~30 M coded symbols per second.
Format 2 (measured interleaved with format 1 on the same loaded machine, load average
2.6-2.9, 2 threads, best of two runs):
KIVI-2 per-channel encode 0.195 vs 0.226 GB/s, decode 0.160 vs 0.168; the CacheGen preset
encode 0.068 vs 0.097, decode 0.078 vs 0.092 -- its 8-bit anchors are now range coded instead
of stored raw, and the table search costs ~1-2 ms per tensor.

Wire layout of one packed tensor (varint = unsigned LEB128, at most 5 bytes)::

    u8      kind: 0 = raw, 2 = range coded (1 = table format 1, refused: StreamVersionError)
    kind 0: the symbols exactly as the ``bitpack`` codec writes them (``ceil(count*bits/8)``
            bytes; ``2 * count`` raw little-endian bytes when ``bits == 16``)
    kind 2: u8      model (low nibble: 0 = global, 1 = per_head, 2 = per_channel)
                    | raw low bits L (high nibble)
            varint  layout: per_channel: D (channels); per_head: B, H; global: nothing
            u8      table form: index of ``steps`` in TABLE_STEPS (bits 0-1) | pooled (bit 2)
            u8      Q: the largest level code of the table (1..255)
            varint  R: the largest zigzagged residual (<= 2Q)
            varint  R + 1 residual counts (the histogram; the last one nonzero)
            varint  T, then T little-endian uint32 words: the residuals, range coded
            u32     CRC32 of (count as 8 bytes, bits as 1 byte, every byte above): an altered
                    header or table, or a payload decoded for another count, fails it
            bytes   the low L bits of every symbol, bit-packed (``ceil(count*L/8)`` bytes)
            varint  W, then W little-endian uint32 words of one RangeEncoder: first every
                    fused row (per_channel: channel tuple q; otherwise group g), then every
                    unfused row (one run over all rows when the table is pooled)

``bits == 16`` (the raw bfloat16 passthrough) is always stored raw (kind 0): an order-0 model
of 16-bit patterns would need a 65,536-entry table. Any tensor whose range-coded size would
not be smaller than its raw size (tiny or near-uniform tensors) is stored raw as well, so the
codec never costs more than ``bitpack`` + 1 byte.

Decoding checks every length and field against ``count`` (and ``shape`` when given) before
allocating what it sizes (``G * 2**bits <= MAX_TABLE_ENTRIES``, ``R <= 2Q``, word counts
against the bytes present), then the CRC, then that the table decodes to codes in ``0..Q``
(maximum exactly ``Q``), every group has a symbol and the decoded residuals have exactly the
histogram sent; it turns any exception of the coder into
:class:`~kvtune.core.errors.CorruptStreamError` and requires both range decoders to be exhausted. A flipped bit
inside the coder words may still decode to ``count`` wrong symbols (a range code has no
redundancy to notice it; ~4 % of single-bit flips in our tests): the outer stream's CRC32
catches those.
"""

from __future__ import annotations

import functools
import math
import zlib
from dataclasses import dataclass
from typing import Sequence

import constriction
import numpy as np
import torch

from kvtune.codecs.base import Codec, param, register_codec
from kvtune.codecs.bitpack import RAW16, pack_bits, packed_nbytes, unpack_bits
from kvtune.core.errors import CorruptStreamError, StreamVersionError

__all__ = [
    "RangeCodec",
    "MODELS",
    "KIND_RAW",
    "KIND_RANGE",
    "KIND_RANGE_V1",
    "TABLE_STEPS",
    "MAX_LEVEL",
    "MAX_TABLE_ENTRIES",
    "fusion_factor",
    "fuse_symbols",
    "unfuse_symbols",
    "count_levels",
    "level_weights",
    "RangeSections",
    "parse_sections",
    "encode_range",
]

MODELS = ("global", "per_head", "per_channel")
"""Model names; the index is the model nibble on the wire."""

KIND_RAW = 0
KIND_RANGE_V1 = 1
"""Kind byte of range-coded payloads in the retired table format 1 (refused with StreamVersionError)."""
KIND_RANGE = 2
"""Kind byte of range-coded payloads in table format 2 (entropy-coded level tables)."""

_MAX_VARINT_BYTES = 5
_RangeEncoder = constriction.stream.queue.RangeEncoder
_RangeDecoder = constriction.stream.queue.RangeDecoder
_Categorical = constriction.stream.model.Categorical


# ----------------------------------------------------------------------------- small helpers


def _varint(value: int) -> bytes:
    """Unsigned LEB128 encoding of ``0 <= value < 2**35``."""
    if not 0 <= value < 1 << (7 * _MAX_VARINT_BYTES):
        raise ValueError(f"varint value {value} out of range")
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if not value:
            out.append(byte)
            return bytes(out)
        out.append(byte | 0x80)


def _read_varint(buf: memoryview, pos: int) -> tuple[int, int]:
    """Read one varint at ``pos``; return ``(value, new_pos)``.

    Raises:
        CorruptStreamError: the data ends inside the varint or it is longer than 5 bytes.
    """
    value = 0
    for i in range(_MAX_VARINT_BYTES):
        if pos >= len(buf):
            raise CorruptStreamError("range codec: data ends inside a length field")
        byte = buf[pos]
        pos += 1
        value |= (byte & 0x7F) << (7 * i)
        if not byte & 0x80:
            return value, pos
    raise CorruptStreamError("range codec: over-long length field")


def _padding_is_zero(data: memoryview | bytes, nbits: int) -> bool:
    """Whether the bits after the first ``nbits`` of ``data`` (the zero padding) are all zero."""
    rem = nbits % 8
    return not rem or not data[len(data) - 1] & ((1 << (8 - rem)) - 1)


def _as_numpy(symbols: torch.Tensor | np.ndarray) -> np.ndarray:
    if isinstance(symbols, torch.Tensor):
        return symbols.detach().cpu().contiguous().numpy()
    return np.ascontiguousarray(symbols)


# ----------------------------------------------------------------------------- symbol fusion


def fusion_factor(bits: int) -> int:
    """Symbols coded per super-symbol: ``m = max(1, 8 // bits)`` (alphabet ``2**(bits*m) <= 256``)."""
    return max(1, 8 // bits)


@functools.lru_cache(maxsize=16)
def _fusion_constants(bits: int) -> tuple[np.dtype, int, int]:
    """``(word dtype, multiplier, shift)`` of the multiply-gather for width ``bits``.

    The ``m`` symbols of a super-symbol sit in the bytes of one little-endian ``8m``-bit word
    ``sum s_i 2**(8i)``; multiplying by ``M = sum_i 2**(8m - 8 + (bits - 8) i)`` moves ``s_i``
    to bit ``8m - 8 + bits*i``, and the cross terms land either above the word (dropped) or
    below ``8m - 8`` at distinct positions (no carries), so ``(word * M) >> (8m - 8)`` is the
    super-symbol. Verified exhaustively in the tests.
    """
    m = fusion_factor(bits)
    dtype = np.dtype(f"<u{m}")
    mult = sum(1 << (8 * m - 8 + (bits - 8) * i) for i in range(m))
    return dtype, mult, 8 * m - 8


def _spread(sup: np.ndarray, bits: int) -> np.ndarray:
    """Super-symbols -> ``<u{m}`` words whose byte ``i`` is digit ``i`` (inverse of the gather).

    ``OR_i (x << (8 - bits) i)`` puts digit ``i`` (bits ``bits*i ...``) at bit ``8i``; the mask
    keeps the low ``bits`` bits of every byte. Shifted copies are OR-ed, so no carries.
    """
    m = fusion_factor(bits)
    dtype = np.dtype(f"<u{m}")
    x = sup.astype(dtype)
    out = x.copy()
    for i in range(1, m):  # m - 1 <= 7 vectorized shift-or operations
        out |= x << dtype.type((8 - bits) * i)
    out &= dtype.type(int.from_bytes(bytes([(1 << bits) - 1] * m), "little"))
    return out


def fuse_symbols(sym: np.ndarray, bits: int) -> np.ndarray:
    """``(..., L * m)`` uint8 symbols -> ``(..., L)`` uint8 super-symbols (first symbol least significant)."""
    m = fusion_factor(bits)
    if m == 1:
        return sym
    dtype, mult, shift = _fusion_constants(bits)
    words = np.ascontiguousarray(sym).view(dtype)
    return ((words * dtype.type(mult)) >> dtype.type(shift)).astype(np.uint8)


def unfuse_symbols(sup: np.ndarray, bits: int) -> np.ndarray:
    """Inverse of :func:`fuse_symbols`: ``(..., L)`` super-symbols (``< 256``) -> ``(..., L * m)`` uint8."""
    if fusion_factor(bits) == 1:
        return np.ascontiguousarray(sup, dtype=np.uint8)
    return np.ascontiguousarray(_spread(sup, bits)).view(np.uint8)


# ----------------------------------------------------------------------------- layouts


@dataclass(frozen=True)
class _Layout:
    """How ``count`` symbols split into groups (``bits`` = coded bits)."""

    model: str
    bits: int
    count: int
    dims: tuple[int, ...]  # per_channel: (D,); per_head: (B, H); global: ()

    @property
    def m(self) -> int:
        return fusion_factor(self.bits)

    @property
    def num_groups(self) -> int:
        return self.dims[0] if self.model == "per_channel" else self.dims[1] if self.model == "per_head" else 1

    @property
    def group_size(self) -> int:
        return self.count // self.num_groups

    def rows_shape(self) -> tuple[tuple[int, int], tuple[int, int]]:
        """Shapes of the fused rows and of the unfused rows (see :func:`_split_rows`)."""
        m = self.m
        if self.model == "per_channel":
            d = self.dims[0]
            r = self.count // d
            return (d // m, r), (d % m, r)
        g, n = self.num_groups, self.group_size
        return (g, n // m), (g, n % m)


def _layout_for_shape(model: str, bits: int, shape: Sequence[int]) -> _Layout:
    shape = tuple(int(s) for s in shape)
    if model == "per_channel":
        dims: tuple[int, ...] = (shape[-1] if shape else 1,)
    elif model == "per_head":
        dims = (shape[0], shape[1]) if len(shape) >= 3 else (1, 1)
    else:
        dims = ()
    return _Layout(model, bits, math.prod(shape), dims)


def _group_matrix(flat: np.ndarray, lay: _Layout) -> np.ndarray:
    """Flat symbols -> ``(R, D)`` (per_channel) or ``(G, n)`` (per_head, global)."""
    if lay.model == "per_channel":
        return flat.reshape(-1, lay.dims[0])
    if lay.model == "per_head":
        b, h = lay.dims
        if b == 1:
            return flat.reshape(h, -1)
        return np.ascontiguousarray(flat.reshape(b, h, -1).transpose(1, 0, 2)).reshape(h, -1)
    return flat.reshape(1, -1)


def _ungroup_matrix(mat: np.ndarray, lay: _Layout) -> np.ndarray:
    """Inverse of :func:`_group_matrix`: flat symbols in C order."""
    if lay.model == "per_head" and lay.dims[0] > 1:
        b, h = lay.dims
        return np.ascontiguousarray(mat.reshape(h, b, -1).transpose(1, 0, 2)).reshape(-1)
    return mat.reshape(-1)


@dataclass(frozen=True)
class _Rows:
    """Coded rows in coding order: ``fused`` ``(F, L)`` super-symbols (row i uses fused model i),
    ``rest`` ``(U, L2)`` unfused symbols (row j uses unfused model j); int32 when encoding (what
    constriction reads), uint8 when decoding (every value is ``< 256``)."""

    fused: np.ndarray
    rest: np.ndarray


def _split_rows(mat: np.ndarray, lay: _Layout) -> _Rows:
    m = lay.m
    (f_rows, _), (r_rows, r_len) = lay.rows_shape()
    if lay.model == "per_channel":
        sup = fuse_symbols(mat[:, : f_rows * m], lay.bits)  # (R, Q)
        return _Rows(np.ascontiguousarray(sup.T, dtype=np.int32), np.ascontiguousarray(mat[:, f_rows * m :].T, dtype=np.int32))
    n = mat.shape[1]
    sup = fuse_symbols(mat[:, : n - r_len], lay.bits)  # (G, n // m)
    return _Rows(sup.astype(np.int32), np.ascontiguousarray(mat[:, n - r_len :], dtype=np.int32))


def _join_rows(rows: _Rows, lay: _Layout) -> np.ndarray:
    """Inverse of :func:`_split_rows`: the uint8 group matrix."""
    (f_rows, f_len), (r_rows, r_len) = lay.rows_shape()
    if lay.model == "per_channel":
        m = lay.m
        if m == 1:
            main = np.ascontiguousarray(rows.fused.T, dtype=np.uint8)
        else:  # expand (Q, R) super-symbols to (Q, R) words of m symbols, then transpose whole words
            main = np.ascontiguousarray(_spread(rows.fused, lay.bits).T).view(np.uint8)  # (R, Q*m)
        if not r_rows:
            return main
        mat = np.empty((lay.count // lay.dims[0], lay.dims[0]), dtype=np.uint8)
        mat[:, : main.shape[1]] = main
        mat[:, main.shape[1] :] = rows.rest.T
        return mat
    main = unfuse_symbols(rows.fused, lay.bits)  # (G, f_len*m)
    if not r_len:
        return main
    return np.concatenate([main, rows.rest.astype(np.uint8)], axis=1)


def _row_hist(rows: np.ndarray, k: int) -> np.ndarray:
    """Histogram of every row of int32 ``rows`` over ``0..k-1``: int64 ``(rows, k)``."""
    nrows, length = rows.shape
    if nrows == 0 or length == 0:
        return np.zeros((nrows, k), dtype=np.int64)
    if nrows == 1:
        return np.bincount(rows.reshape(-1), minlength=k).reshape(1, k)
    idx = rows + (np.arange(nrows, dtype=np.int32) * k)[:, None]
    return np.bincount(idx.reshape(-1), minlength=nrows * k).reshape(nrows, k)


def _group_counts(rows: _Rows, lay: _Layout) -> np.ndarray:
    """Symbol counts per group, int64 ``(G, 2**bits)``.

    Fused rows are counted as super-symbols (``1/m`` of the work), then marginalized with
    integer sums (no BLAS: a multi-threaded BLAS call on a tiny matrix can take milliseconds on
    a busy CPU).
    """
    m, k = lay.m, 1 << lay.bits
    (f_rows, f_len), (r_rows, r_len) = lay.rows_shape()
    rest = _row_hist(rows.rest, k)
    if f_rows and f_len:
        joint = _row_hist(rows.fused, k**m)  # (F, K**m); super-symbol x = sum_i s_i K**i
        marg = np.empty((f_rows, m, k), dtype=np.int64)
        for i in range(m):  # digit i is the middle axis of (F, K**(m-1-i), K, K**i)
            marg[:, i, :] = joint.reshape(f_rows, k ** (m - 1 - i), k, k**i).sum(axis=(1, 3))
    else:
        marg = np.zeros((f_rows, m, k), dtype=np.int64)
    if lay.model == "per_channel":
        return np.concatenate([marg.reshape(-1, k), rest])
    counts = marg.sum(axis=1)
    return counts + rest if r_len else counts


# ----------------------------------------------------------------------------- tables

TABLE_STEPS = (1, 2, 4, 8)
"""Levels per octave of the table's probability grid; the index is the ``steps`` field."""
MAX_LEVEL = 255
"""Largest level code (level 1 = weight 1; each level below is ``2**(-1/steps)`` times smaller)."""
MAX_TABLE_ENTRIES = 1 << 24
"""Largest ``groups * 2**bits`` a payload may declare (a larger one is rejected before allocating)."""

# 2**(-j/16) for j = 0..15, as literals: weights and level boundaries are these constants times
# powers of two (np.ldexp, exact), so encoder and decoder build bit-identical tables on every
# machine without calling a math library.
_GRID16 = np.array([
    1.0, 0.9576032806985737, 0.9170040432046712, 0.8781260801866497, 0.8408964152537145, 0.8052451659746271,
    0.7711054127039704, 0.7384130729697497, 0.7071067811865476, 0.6771277734684463, 0.6484197773255048,
    0.620928906036742, 0.5946035575013605, 0.5693943173783458, 0.5452538663326288, 0.5221368912137069,
])


def _grid(u: np.ndarray) -> np.ndarray:
    """``2**(-u/16)`` for non-negative integers ``u``, exactly as the constants above."""
    u = np.asarray(u, dtype=np.int64)
    return np.ldexp(_GRID16[u & 15], -(u >> 4))


def level_weights(levels: np.ndarray, steps: int) -> np.ndarray:
    """float64 model weights of level codes: 0 (symbol absent) -> 0, ``q >= 1`` -> ``2**(-(q-1)/steps)``.

    The range coder normalizes each group's weights (constriction's ``Categorical``).
    """
    q = np.asarray(levels, dtype=np.int64)
    return np.where(q > 0, _grid(np.maximum(q - 1, 0) * (16 // steps)), 0.0)


_GRID_POINTS = (2 * (MAX_LEVEL - 2) + 1) * 8
"""1/16-octave grid points needed: the last level boundary of ``steps = 1`` is point 4056."""


@functools.lru_cache(maxsize=1)
def _neg_grid() -> np.ndarray:
    """``-2**(-u/16)`` for ``u = 1.._GRID_POINTS`` (increasing)."""
    return -_grid(np.arange(1, _GRID_POINTS + 1))


def _grid_position(counts: np.ndarray) -> np.ndarray:
    """``U = #{u >= 1 : 2**(-u/16) > c/n}`` per entry (``n`` = the row's total): where each
    frequency lies on the 1/16-octave grid, by comparison only."""
    ratio = counts / counts.sum(axis=1, keepdims=True)
    return np.searchsorted(_neg_grid(), -ratio.reshape(-1), side="left").reshape(counts.shape)


def _levels_at(pos: np.ndarray, present: np.ndarray, steps: int) -> np.ndarray:
    """Level codes for ``steps`` from grid positions: level boundaries of ``steps`` are the grid
    points ``(2j + 1) * h`` (``h = 8 / steps``), and ``(U + h) // 2h`` of them lie above ``c/n``."""
    h = 8 // steps
    return np.where(present, np.minimum((pos + h) // (2 * h), MAX_LEVEL - 1) + 1, 0)


def count_levels(counts: np.ndarray, steps: int) -> np.ndarray:
    """Level codes of per-group counts: the nearest grid point to each symbol's frequency.

    ``q = 0`` where ``c == 0``; else ``q = 1 + round(steps * log2(n / c))`` (capped at
    :data:`MAX_LEVEL`), ``n`` the row's total, with rounding boundaries (the points
    ``2**(-(j + 1/2)/steps)``) on the exact grid: no logarithm is computed, so the codes are the
    same on every machine.

    Args:
        counts: int64 ``(G, K)``, every row with a positive sum.
        steps: levels per octave (one of :data:`TABLE_STEPS`).

    Returns:
        int64 ``(G, K)`` codes in ``0..MAX_LEVEL``.
    """
    return _levels_at(_grid_position(counts), counts > 0, steps)


def _zigzag(r: np.ndarray) -> np.ndarray:
    return np.where(r >= 0, 2 * r, -2 * r - 1)


def _unzigzag(z: np.ndarray) -> np.ndarray:
    return np.where(z & 1, -(z >> 1) - 1, z >> 1)


@dataclass(frozen=True)
class _Table:
    """The model of one tensor: level codes (``pooled``: one row for every group)."""

    steps: int  # index into TABLE_STEPS
    pooled: bool
    pool: np.ndarray  # (K,) codes of the pooled counts
    levels: np.ndarray  # (G, K) codes the groups use ((1, K) = pool when pooled)
    residuals: np.ndarray  # zigzagged, in coding order
    payload_bits: float  # estimated coder bits of the symbols
    cost_bits: float  # plus the estimated table bits

    @property
    def weights(self) -> np.ndarray:
        return _level_tables()[0][self.steps][self.levels]


_HALF_STEPS = np.array([8 // s for s in TABLE_STEPS])
_GROUP_STEPS = (1, 2)
"""Indices of the steps tried for per-group tables (2 and 4 levels per octave: on real KV the
others never won, and per-group candidates are the encoder's costliest part)."""
_ZZ_BINS = 2 * MAX_LEVEL + 1  # zigzagged residuals of codes in 0..255


@functools.lru_cache(maxsize=1)
def _level_tables() -> tuple[np.ndarray, np.ndarray]:
    """``(S, 256)`` weight and ``-log2`` weight of every level code, per step of :data:`TABLE_STEPS`."""
    q = np.arange(MAX_LEVEL + 1)
    weights = np.stack([level_weights(q, s) for s in TABLE_STEPS])
    neg_log2 = np.stack([np.where(q > 0, (q - 1) / s, 0.0) for s in TABLE_STEPS])
    return weights, neg_log2


def _levels_all(pos: np.ndarray, present: np.ndarray) -> np.ndarray:
    """:func:`_levels_at` for every step at once: ``(S, *pos.shape)``."""
    h = _HALF_STEPS.reshape(-1, *([1] * pos.ndim))
    return np.where(present, np.minimum((pos + h) // (2 * h), MAX_LEVEL - 1) + 1, 0)


def _hist_bits(hist: np.ndarray) -> np.ndarray:
    """Estimated bits of coding residuals with their own histogram, per row of ``hist``
    ``(rows, _ZZ_BINS)``: the empirical entropy, the histogram's varints (up to its last nonzero
    count) and a word of coder padding when there is anything to code."""
    n = hist.sum(axis=1, keepdims=True)
    used = np.arange(_ZZ_BINS) <= (_ZZ_BINS - 1 - np.argmax(hist[:, ::-1] > 0, axis=1))[:, None]
    varint_bytes = used.sum(axis=1) + sum(np.count_nonzero((hist >> s) & used, axis=1) for s in (7, 14, 21, 28))
    entropy = (hist * np.log2(np.where(hist > 0, n / np.maximum(hist, 1), 1.0))).sum(axis=1)
    return entropy + 8 * varint_bytes + np.where(used.sum(axis=1) > 1, 32, 0)


def _row_bincount(values: np.ndarray, weights: np.ndarray | None = None) -> np.ndarray:
    """Histogram over ``0.._ZZ_BINS-1`` of every row of ``values`` ``(rows, n)``: ``(rows, _ZZ_BINS)``."""
    rows = values.shape[0]
    flat = (values + (np.arange(rows) * _ZZ_BINS)[:, None]).reshape(-1)
    w = None if weights is None else np.broadcast_to(weights, values.shape).reshape(-1)
    return np.bincount(flat, weights=w, minlength=rows * _ZZ_BINS).reshape(rows, _ZZ_BINS).astype(np.int64)


def _build_table(counts: np.ndarray) -> _Table:
    """The cheapest table for ``counts`` ``(G, K)``: every step of :data:`TABLE_STEPS` with one
    pooled row (the only form when ``G == 1``), the steps :data:`_GROUP_STEPS` with per-group
    codes, scored by
    the estimated table bits plus payload bits (ties: the first of step 0 pooled, step 0
    per-group, step 1 pooled, ...). Work is proportional to the present (group, symbol) pairs:
    a group's code for an absent symbol is 0, so its residual is known from the pooled row."""
    weights, neg_log2 = _level_tables()
    steps = np.arange(len(TABLE_STEPS))[:, None]
    n = counts.sum(axis=1)
    pooled_counts = counts.sum(axis=0)
    has = np.flatnonzero(pooled_counts)
    pc = pooled_counts[has]
    pool = np.zeros((len(TABLE_STEPS), counts.shape[1]), dtype=np.int64)
    pool[:, has] = _levels_all(np.searchsorted(_neg_grid(), -(pc / n.sum()), side="left"), True)
    z_pool = _zigzag(np.diff(pool, prepend=0, axis=-1))  # (S, K)
    hist_pool = _row_bincount(z_pool)
    wp, nlp = weights[steps, pool[:, has]], neg_log2[steps, pool[:, has]]
    payload = [(pc * nlp).sum(axis=1) + n.sum() * np.log2(wp.sum(axis=1))]
    table = [_hist_bits(hist_pool)]
    if counts.shape[0] > 1:
        g_idx, s_idx = np.nonzero(counts)
        c = counts[g_idx, s_idx]
        gs = np.array(_GROUP_STEPS)
        lev = np.zeros((len(TABLE_STEPS), c.size), dtype=np.int64)
        lev[gs] = _levels_all(np.searchsorted(_neg_grid(), -(c / n[g_idx]), side="left"), True)[gs]  # (S, nnz)
        w, nl = weights[gs[:, None], lev[gs]], neg_log2[gs[:, None], lev[gs]]
        row_w = np.stack([np.bincount(g_idx, weights=wi, minlength=counts.shape[0]) for wi in w])
        group_payload = np.full(len(TABLE_STEPS), np.inf)
        group_payload[gs] = (c * nl).sum(axis=1) + (n * np.log2(row_w)).sum(axis=1)
        payload.append(group_payload)
        absent = (counts.shape[0] - np.bincount(s_idx, minlength=counts.shape[1]))[has]  # groups without the symbol
        hist = hist_pool[gs] + _row_bincount(_zigzag(lev[gs] - pool[gs][:, s_idx])) + _row_bincount(2 * pool[gs][:, has] - 1, absent)
        group_table = np.full(len(TABLE_STEPS), np.inf)
        group_table[gs] = _hist_bits(hist)
        table.append(group_table)
    payload_bits, table_bits = np.stack(payload, axis=1), np.stack(table, axis=1)  # (S, forms)
    best = int(np.argmin((payload_bits + table_bits).reshape(-1)))
    i, form = divmod(best, payload_bits.shape[1])
    if form == 0:
        levels, z = pool[i][None, :], z_pool[i]
    else:
        levels = np.zeros(counts.shape, dtype=np.int64)
        levels[g_idx, s_idx] = lev[i]
        z = np.concatenate([z_pool[i], _zigzag(levels[:, has] - pool[i, has]).reshape(-1)])
    return _Table(i, form == 0, pool[i], levels, z, float(payload_bits[i, form]), float(payload_bits[i, form] + table_bits[i, form]))


def _encode_table(table: _Table) -> bytes:
    """Wire bytes of a table, from the ``steps`` byte to the table words (see the module docstring)."""
    q_max = max(int(table.levels.max()), int(table.pool.max()))
    hist = np.bincount(table.residuals)
    out = [bytes([table.steps | (4 if table.pooled else 0), q_max]), _varint(hist.size - 1)]
    out += [_varint(int(h)) for h in hist]
    if hist.size > 1:
        enc = _RangeEncoder()
        enc.encode(table.residuals.astype(np.int32), _Categorical(hist.astype(np.float64), perfect=False))
        words = enc.get_compressed()
    else:
        words = np.zeros(0, dtype=np.uint32)
    out += [_varint(int(words.size)), words.astype("<u4", copy=False).tobytes()]
    return b"".join(out)


def _fused_probs(f: np.ndarray) -> np.ndarray:
    """Product distributions: ``(Q, m, K)`` -> ``(Q, K**m)`` float64, index ``sum s_i K**i``."""
    q, m, _ = f.shape
    joint = f[:, m - 1, :].astype(np.float64)
    for i in range(m - 2, -1, -1):
        joint = (joint[:, :, None] * f[:, i, None, :]).reshape(q, -1)
    return joint


def _runs(w: np.ndarray, lay: _Layout, pooled: bool) -> tuple[list, list]:
    """Coding runs ``(model, rows)`` of the fused rows and of the unfused rows, in coding order:
    one run per row, or one run over every row when the table is pooled (``w`` has one row)."""
    m = lay.m
    (f_rows, f_len), (r_rows, r_len) = lay.rows_shape()
    if pooled:
        fused = [(_Categorical(_fused_probs(np.repeat(w[:, None, :], m, axis=1))[0], perfect=False), f_rows)] if f_rows and f_len else []
        rest = [(_Categorical(w[0], perfect=False), r_rows)] if r_rows and r_len else []
        return fused, rest
    if lay.model == "per_channel":
        fp = _fused_probs(w[: f_rows * m].reshape(f_rows, m, -1)) if f_rows else ()
        rp = w[f_rows * m :]
    else:
        fp = _fused_probs(np.repeat(w[:, None, :], m, axis=1)) if f_len else ()
        rp = w if r_len else ()
    return [(_Categorical(p, perfect=False), 1) for p in fp], [(_Categorical(p, perfect=False), 1) for p in rp]


# ----------------------------------------------------------------------------- parsing


@dataclass(frozen=True)
class RangeSections:
    """Byte accounting of one tensor packed by :class:`RangeCodec`.

    Attributes:
        kind: :data:`KIND_RAW` or :data:`KIND_RANGE`.
        header: bytes of kind, model, layout, the ``steps``/``Q``/``R`` fields, the two
            word-count varints and the header CRC32.
        table: bytes of the frequency table: residual histogram and table coder words.
        low_bits: bytes of the raw low bits (``coded_bits``), 0 when every bit is coded.
        payload: bytes of the coder words (kind 2) or of the raw symbols (kind 0).
        steps: levels per octave of the table (0 for raw).
        pooled: one table shared by every group.
        raw_low_bits: ``L``.
        dims: the layout integers.
    """

    kind: int
    header: int
    table: int
    low_bits: int
    payload: int
    steps: int = 0
    pooled: bool = False
    raw_low_bits: int = 0
    dims: tuple[int, ...] = ()

    @property
    def total(self) -> int:
        """``len(data)``."""
        return self.header + self.table + self.low_bits + self.payload


@dataclass(frozen=True)
class _Parsed:
    sections: RangeSections
    layout: _Layout | None = None
    weights: np.ndarray | None = None
    low: memoryview | None = None
    words: np.ndarray | None = None
    raw: memoryview | None = None


def _header_crc(head: bytes | memoryview, count: int, bits: int) -> int:
    """CRC32 of the symbol count and width (8 + 1 bytes, little-endian) followed by the header and
    table bytes: a payload decoded for another count or width fails it as surely as an altered byte."""
    return zlib.crc32(head, zlib.crc32(count.to_bytes(8, "little") + bytes([bits])))


def _need(buf: memoryview, pos: int, n: int, what: str) -> None:
    if n < 0 or pos + n > len(buf):
        raise CorruptStreamError(f"range codec: data ends inside {what}")


def _read_words(buf: memoryview, pos: int, what: str) -> tuple[np.ndarray, int]:
    """A varint word count, then that many little-endian uint32 words (length checked first)."""
    n, pos = _read_varint(buf, pos)
    _need(buf, pos, 4 * n, what)
    return np.frombuffer(buf[pos : pos + 4 * n], dtype="<u4").astype(np.uint32), pos + 4 * n


def _decode_table(hist: np.ndarray, words: np.ndarray, pooled: bool, q_max: int, groups: int, k: int) -> np.ndarray:
    """Level codes ``(G', K)`` from the table's residual histogram and words; raise
    CorruptStreamError unless they decode to codes in ``0..q_max`` (maximum exactly ``q_max``),
    every group has a symbol, and the decoded residuals have exactly the histogram sent."""
    total = int(hist.sum())
    dec = None
    if hist.size > 1:
        model = _Categorical(hist.astype(np.float64), perfect=False)
        dec = _RangeDecoder(words)
    elif words.size:
        raise CorruptStreamError("range codec: table words present for a constant table")

    def take(n: int) -> np.ndarray:
        if dec is None:
            return np.zeros(n, dtype=np.int64)
        return np.asarray(dec.decode(model, n), dtype=np.int64)

    try:
        if total < k:
            raise CorruptStreamError("range codec: the table histogram counts fewer entries than the table has")
        z_pool = take(k)
        pool = np.cumsum(_unzigzag(z_pool))
        if pool.min() < 0 or pool.max() > q_max or not pool.any():
            raise CorruptStreamError("range codec: a pooled table code is out of range")
        z = z_pool
        if pooled:
            levels = pool[None, :]
        else:
            present = pool > 0
            n_rest = groups * int(present.sum())
            if total != k + n_rest:
                raise CorruptStreamError("range codec: the table histogram does not count the table's entries")
            z_rest = take(n_rest)
            levels = np.zeros((groups, k), dtype=np.int64)
            levels[:, present] = pool[present] + _unzigzag(z_rest).reshape(groups, -1)
            z = np.concatenate([z_pool, z_rest])
        exhausted = dec is None or dec.maybe_exhausted()
    except CorruptStreamError:
        raise
    except Exception as exc:  # constriction reports invalid data with AssertionError
        raise CorruptStreamError(f"range codec: table words do not decode ({type(exc).__name__}: {exc})") from None
    if not exhausted:
        raise CorruptStreamError("range codec: table words left over after decoding the table")
    if z.size != total or not np.array_equal(np.bincount(z, minlength=hist.size), hist):
        raise CorruptStreamError("range codec: the decoded table does not match its histogram")
    if levels.min() < 0 or max(levels.max(), pool.max()) != q_max or not (levels > 0).any(axis=1).all():
        raise CorruptStreamError("range codec: a table code is out of range or a group has no symbol")
    return levels


def _parse(data, model: str, bits: int, low_bits: int, count: int, shape: Sequence[int] | None) -> _Parsed:
    """Validate and split a packed tensor; raise CorruptStreamError on any inconsistency
    (StreamVersionError for a range-coded payload of the retired table format 1)."""
    buf = memoryview(data).cast("B")
    if len(buf) < 1:
        raise CorruptStreamError("range codec: empty payload (no kind byte)")
    kind = buf[0]
    if kind == KIND_RAW:
        expected = 2 * count if bits == RAW16 else packed_nbytes(count, bits)
        if len(buf) - 1 != expected:
            raise CorruptStreamError(
                f"range codec: raw payload has {len(buf) - 1} bytes, {count} symbols of {bits} bits need {expected}"
            )
        return _Parsed(RangeSections(KIND_RAW, 1, 0, 0, expected), raw=buf[1:])
    if kind == KIND_RANGE_V1:
        raise StreamVersionError(
            "range codec: payload in table format 1 (written by kvtune before range format 2, which "
            "entropy-codes the tables); this version reads format 2 only: re-encode the KV"
        )
    if kind != KIND_RANGE or bits == RAW16 or count == 0:
        raise CorruptStreamError(f"range codec: payload kind {kind} is invalid for {count} symbols of {bits} bits")
    _need(buf, 1, 1, "its header")
    model_id, got_low = buf[1] & 0x0F, buf[1] >> 4
    if model_id >= len(MODELS) or MODELS[model_id] != model or got_low != low_bits:
        raise CorruptStreamError(
            f"range codec: payload says model #{model_id} with {got_low} raw low bits, the policy says {model!r} with {low_bits}"
        )
    pos = 2
    dims = []
    for _ in range({"per_channel": 1, "per_head": 2, "global": 0}[model]):
        v, pos = _read_varint(buf, pos)
        dims.append(v)
    dims_t = tuple(dims)
    divisor = math.prod(dims_t)
    if divisor == 0 or count % divisor:
        raise CorruptStreamError(f"range codec: layout {dims_t} does not divide {count} symbols")
    coded = bits - low_bits
    if shape is not None and _layout_for_shape(model, coded, shape).dims != dims_t:
        raise CorruptStreamError(f"range codec: payload layout {dims_t} does not match the tensor shape {tuple(shape)}")
    lay = _Layout(model, coded, count, dims_t)
    g, k = lay.num_groups, 1 << coded
    if g * k > MAX_TABLE_ENTRIES:
        raise CorruptStreamError(f"range codec: {g} groups x {k} symbols exceed the table limit {MAX_TABLE_ENTRIES}")
    _need(buf, pos, 2, "its header")
    form, q_max = buf[pos], buf[pos + 1]
    pos += 2
    if form & ~7 or form & 3 >= len(TABLE_STEPS) or q_max == 0:
        raise CorruptStreamError(f"range codec: table form {form} or top level {q_max} out of range")
    steps, pooled = TABLE_STEPS[form & 3], bool(form & 4)
    r_max, pos = _read_varint(buf, pos)
    if r_max > 2 * q_max:
        raise CorruptStreamError(f"range codec: table residual bound {r_max} exceeds 2 * {q_max}")
    table_at = pos
    hist = np.zeros(r_max + 1, dtype=np.int64)
    for i in range(r_max + 1):
        hist[i], pos = _read_varint(buf, pos)
    if hist[-1] == 0:
        raise CorruptStreamError("range codec: the table histogram ends with a zero count")
    hist_end = pos
    table_words, pos = _read_words(buf, pos, "the table words")
    _need(buf, pos, 4, "the header checksum")
    if _header_crc(buf[:pos], count, bits) != int.from_bytes(buf[pos : pos + 4], "little"):
        raise CorruptStreamError(
            f"range codec: header checksum mismatch (altered header or table bytes, or the payload was not "
            f"written for {count} symbols of {bits} bits)"
        )
    crc_end = pos + 4
    levels = _decode_table(hist, table_words, pooled, q_max, g, k)
    nlow = packed_nbytes(count, low_bits)
    _need(buf, crc_end, nlow, "the raw low bits")
    low = buf[crc_end : crc_end + nlow]
    if not _padding_is_zero(low, count * low_bits):
        raise CorruptStreamError("range codec: nonzero padding bits after the raw low bits")
    words, end = _read_words(buf, crc_end + nlow, "the coder words")
    if end != len(buf):
        raise CorruptStreamError(f"range codec: {len(buf) - end} bytes follow the coder words")
    table_len = (hist_end - table_at) + 4 * table_words.size
    header_len = len(buf) - table_len - nlow - 4 * words.size
    secs = RangeSections(KIND_RANGE, header_len, table_len, nlow, 4 * words.size, steps, pooled, low_bits, dims_t)
    return _Parsed(secs, lay, level_weights(levels, steps), low, words)


def parse_sections(
    data: bytes | memoryview, *, model: str, bits: int, count: int, coded_bits: int = 0, shape: Sequence[int] | None = None
) -> RangeSections:
    """Byte accounting (header / table / low bits / payload) of a tensor packed by :class:`RangeCodec`.

    Raises:
        CorruptStreamError, StreamVersionError: as :meth:`RangeCodec.unpack`.
    """
    return _parse(data, model, bits, _raw_low_bits(bits, coded_bits), count, shape).sections


def _raw_low_bits(bits: int, coded_bits: int) -> int:
    """``L``: low bits stored raw for symbols of ``bits`` bits under ``coded_bits``."""
    if bits == RAW16 or coded_bits == 0:
        return 0
    return max(0, bits - coded_bits)


# ----------------------------------------------------------------------------- encode


def encode_range(
    symbols: np.ndarray, bits: int, model: str, *, coded_bits: int = 0, raw_limit: int | None = None
) -> bytes | None:
    """Range-code uint8 ``symbols`` (any non-empty shape, values ``< 2**bits``, bits 1..8).

    The kind-2 encoding of :class:`RangeCodec`, without its raw fallback.

    Args:
        symbols: natural shape (last axis = channels, axis 1 = heads).
        bits: symbol width.
        model: one of :data:`MODELS`.
        coded_bits: see :class:`RangeCodec`.
        raw_limit: when given, return ``None`` as soon as the result is known (estimated from
            the table, or measured) to take at least ``raw_limit + 1`` bytes.

    Returns:
        The packed bytes, or ``None`` (see ``raw_limit``).
    """
    low = _raw_low_bits(bits, coded_bits)
    coded = bits - low
    lay = _layout_for_shape(model, coded, symbols.shape)
    if lay.count == 0:
        raise ValueError("range codec: nothing to encode")
    flat = symbols.reshape(-1)
    rows = _split_rows(_group_matrix(flat >> np.uint8(low) if low else flat, lay), lay)
    table = _build_table(_group_counts(rows, lay))
    dims = b"".join(_varint(d) for d in lay.dims)
    head = bytes([KIND_RANGE, MODELS.index(model) | low << 4]) + dims + _encode_table(table)
    head += _header_crc(head, lay.count, bits).to_bytes(4, "little")
    low_bytes = pack_bits(flat & np.uint8((1 << low) - 1), low) if low else b""
    if raw_limit is not None and len(head) + len(low_bytes) + 4 * math.ceil(table.payload_bits / 32) + 1 > raw_limit:
        return None
    fused_runs, rest_runs = _runs(table.weights, lay, table.pooled)
    enc = _RangeEncoder()
    for runs, mat in ((fused_runs, rows.fused), (rest_runs, rows.rest)):
        i = 0
        for model_i, n in runs:
            enc.encode(mat[i : i + n].reshape(-1), model_i)
            i += n
    words = enc.get_compressed()
    out = b"".join((head, low_bytes, _varint(int(words.size)), words.astype("<u4", copy=False).tobytes()))
    if raw_limit is not None and len(out) > raw_limit:
        return None
    return out


# ----------------------------------------------------------------------------- the codec


@register_codec("range")
@dataclass(frozen=True)
class RangeCodec(Codec):
    """Range coding with order-0 models estimated from the data (CacheGen, arXiv 2310.07240, sec. 5.2).

    The module docstring gives the wire layout, the table encoding and its byte cost.

    Args:
        model: ``"per_channel"`` (one distribution per index of the last axis, as CacheGen),
            ``"per_head"`` (per index of axis 1) or ``"global"`` (one per tensor).
        coded_bits: range-code only the top ``coded_bits`` bits of each symbol and bit-pack the
            rest (0 = code every bit); a speed/ratio knob.

    Example::

        >>> import numpy as np
        >>> c = RangeCodec(model="per_head")
        >>> x = np.random.default_rng(0).integers(0, 2, size=(1, 2, 512, 64)).astype(np.uint8) * 3
        >>> data = c.pack(x, 2)
        >>> len(data) < x.size * 2 // 8          # ~1 bit per symbol instead of 2
        True
        >>> bool((c.unpack(data, 2, x.size, shape=x.shape) == x.reshape(-1)).all())
        True
    """

    model: str = param("per_channel", choices=MODELS, doc="probability model granularity")
    coded_bits: int = param(0, low=0, high=8, doc="top bits per symbol that are range coded (0 = all)")

    def supports(self, bits: int) -> bool:
        """Widths 1..8 (range coded) and 16 (stored raw)."""
        return 1 <= bits <= 8 or bits == RAW16

    def max_symbols(self, payload: bytes | memoryview) -> int | None:
        """``8 *`` the bytes after the kind byte of a raw payload (kind 0: bit-packed, a symbol
        takes at least one bit; 0 for an empty payload); ``None`` for any other kind.

        A range-coded payload (kind 2) does not record how many symbols it holds: its header
        checksum covers the count it was written for, so :meth:`unpack` confirms a claimed
        count before decoding, but no count can be read from it.
        """
        if len(payload) == 0:
            return 0
        return 8 * (len(payload) - 1) if payload[0] == KIND_RAW else None

    def pack(self, symbols: torch.Tensor | np.ndarray, bits: int) -> bytes:
        """Range-code ``symbols`` (any shape, C order; last axis = channels, axis 1 = heads).

        Returns:
            The packed bytes, deterministic. Stored raw (kind 0) when ``bits == 16`` or when
            range coding would not be smaller.

        Raises:
            ValueError: wrong dtype, a symbol ``>= 2**bits``, or an unsupported width.
        """
        a = _as_numpy(symbols)
        flat = a.reshape(-1)
        if bits == RAW16:
            return bytes([KIND_RAW]) + flat.astype("<u2", copy=False).tobytes()
        if not 1 <= bits <= 8:
            raise ValueError(f"range codec: bit width must be 1..8 or 16, got {bits}")
        if a.dtype != np.uint8:
            raise ValueError(f"{bits}-bit symbols must be uint8, got {a.dtype}")
        if flat.size and int(flat.max()) >> bits:
            raise ValueError(f"symbol {int(flat.max())} does not fit in {bits} bits")
        coded = None
        if flat.size:
            coded = encode_range(a, bits, self.model, coded_bits=self.coded_bits, raw_limit=packed_nbytes(flat.size, bits))
        return coded if coded is not None else bytes([KIND_RAW]) + pack_bits(flat, bits)

    def unpack(self, data, bits: int, count: int, *, shape=None) -> np.ndarray:
        """Decode ``count`` symbols: a flat uint8 array (uint16 when ``bits == 16``).

        ``shape`` is optional (the layout travels in the payload) but must agree with it.

        Raises:
            CorruptStreamError: the data cannot decode to exactly ``count`` symbols: bad kind
                or model byte, a layout inconsistent with ``count``/``shape``, a table that does
                not sum to ``2**P``, lengths that do not add up, coder words that do not decode
                or are not exhausted after ``count`` symbols.
            ValueError: unsupported ``bits``, negative ``count``, ``shape`` not holding ``count``.
        """
        if not self.supports(bits):
            raise ValueError(f"range codec: bit width must be 1..8 or 16, got {bits}")
        if count < 0:
            raise ValueError(f"count must be >= 0, got {count}")
        if shape is not None and math.prod(shape) != count:
            raise ValueError(f"shape {tuple(shape)} does not hold {count} symbols")
        low = _raw_low_bits(bits, self.coded_bits)
        parsed = _parse(data, self.model, bits, low, count, shape)
        if parsed.raw is not None:
            if bits == RAW16:
                return np.frombuffer(parsed.raw, dtype="<u2", count=count).astype(np.uint16)
            return unpack_bits(parsed.raw, bits, count)
        lay, weights, words = parsed.layout, parsed.weights, parsed.words
        assert lay is not None and weights is not None and words is not None and parsed.low is not None
        (f_rows, f_len), (r_rows, r_len) = lay.rows_shape()
        fused_runs, rest_runs = _runs(weights, lay, parsed.sections.pooled)
        rows = _Rows(np.empty((f_rows, f_len), dtype=np.uint8), np.empty((r_rows, r_len), dtype=np.uint8))
        try:
            dec = _RangeDecoder(words)
            for runs, mat, length in ((fused_runs, rows.fused, f_len), (rest_runs, rows.rest, r_len)):
                i = 0
                for model, n in runs:
                    mat[i : i + n] = np.asarray(dec.decode(model, n * length)).reshape(n, length)
                    i += n
            exhausted = dec.maybe_exhausted()
        except Exception as exc:  # constriction reports invalid data with AssertionError
            raise CorruptStreamError(f"range codec: coder words do not decode ({type(exc).__name__}: {exc})") from None
        if not exhausted:
            raise CorruptStreamError("range codec: coder words left over after decoding every symbol")
        out = _ungroup_matrix(_join_rows(rows, lay), lay)
        if low:
            out = (out << np.uint8(low)) | unpack_bits(parsed.low, low, count)
        return out
