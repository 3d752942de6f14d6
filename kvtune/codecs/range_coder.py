"""Entropy-coding codec C ``range``: range coding with per-channel / per-head / global models.

CacheGen (Liu et al., "CacheGen: KV Cache Compression and Streaming for Fast Large Language
Model Serving", SIGCOMM'24, sec. 5.2) entropy-codes quantized KV symbols with arithmetic
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

**Frequency tables** are estimated from the data being encoded and sent in the stream (their
bytes count in ``len(stream)``). Each group's counts ``c[s]`` (``n`` symbols per group) are
quantized to integers ``f[s]`` summing to exactly ``2**P``: ``f = round(c * 2**P / n)``
(``floor`` if rounding leaves no room), raised to 1 for every symbol that occurs, the residue
added to the most frequent symbol. Symbols that do not occur get ``f = 0``: they are never
encoded (constriction still gives them the smallest representable probability, so the
model stays valid). The precision ``P`` (1..15) is chosen per tensor to
minimize table bits + estimated payload bits. On the wire a table is a presence bitmap of
``G * 2**bits`` bits, then ``f - 1`` of every present symbol in ``w`` bits (``w`` = bit length
of the tensor's largest ``f - 1``)::

    table bytes = ceil(G * 2**bits / 8) + ceil(nnz * w / 8)        (see table_nbytes)

``nnz`` = number of (group, symbol) pairs that occur. Measured on real SmolLM2 KIVI symbols
of ``(1, 3, 1024, 64)`` tensors: 2-bit per_channel 32 + ~160 bytes (0.45 % of the payload),
per_head ~13 bytes; 4-bit per_channel ~710 bytes (0.75 %), per_head ~40 bytes. 8-bit
per_channel tables (~290 bytes per channel) outweigh their gain, so such tensors end up stored
raw: use per_head or global there. Tables estimated on a calibration set and stored with the
profile are not implemented: ``Codec.pack`` is not told the layer or K/V of its tensor.

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

Wire layout of one packed tensor (varint = unsigned LEB128, at most 5 bytes)::

    u8      kind: 0 = raw, 1 = range coded
    kind 0: the symbols exactly as the ``bitpack`` codec writes them (``ceil(count*bits/8)``
            bytes; ``2 * count`` raw little-endian bytes when ``bits == 16``)
    kind 1: u8      model (low nibble: 0 = global, 1 = per_head, 2 = per_channel)
                    | raw low bits L (high nibble)
            varint  layout: per_channel: D (channels); per_head: B, H; global: nothing
            u8      P: every group's frequencies sum to 2**P (1..15)
            u8      w: bits per stored ``f - 1`` value (0..15)
            bytes   table: presence bitmap, then the ``f - 1`` values (MSB first; each part
                    zero-padded to a byte, nonzero padding is rejected)
            bytes   the low L bits of every symbol, bit-packed (``ceil(count*L/8)`` bytes)
            varint  W: number of coder words
            bytes   W little-endian uint32 words of one RangeEncoder: first every fused row
                    (per_channel: channel tuple q; otherwise group g), then every unfused row

``bits == 16`` (the raw bfloat16 passthrough) is always stored raw (kind 0): an order-0 model
of 16-bit patterns would need a 65,536-entry table. Any tensor whose range-coded size would
not be smaller than its raw size (tiny or near-uniform tensors) is stored raw as well, so the
codec never costs more than ``bitpack`` + 1 byte.

Decoding checks every length and field against ``count`` (and ``shape`` when given) and the
table sums, turns any exception of the coder into :class:`~kvtune.errors.CorruptStreamError`,
and requires the range decoder to be exhausted after exactly ``count`` symbols. A flipped bit
inside the coder words may still decode to ``count`` wrong symbols (a range code has no
redundancy to notice it; ~4 % of single-bit flips in our tests): the outer stream's CRC32
catches those.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Sequence

import constriction
import numpy as np
import torch

from kvtune.codecs.base import Codec, param, register_codec
from kvtune.codecs.bitpack import RAW16, pack_bits, packed_nbytes, unpack_bits
from kvtune.errors import CorruptStreamError

__all__ = [
    "RangeCodec",
    "MODELS",
    "KIND_RAW",
    "KIND_RANGE",
    "MAX_PRECISION",
    "fusion_factor",
    "fuse_symbols",
    "unfuse_symbols",
    "quantize_counts",
    "table_nbytes",
    "RangeSections",
    "parse_sections",
    "encode_range",
]

MODELS = ("global", "per_head", "per_channel")
"""Model names; the index is the model nibble on the wire."""

KIND_RAW = 0
KIND_RANGE = 1
MAX_PRECISION = 15
"""Largest table precision ``P`` (frequencies sum to ``2**P``)."""

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


def _pack_uint(values: np.ndarray, width: int) -> bytes:
    """Pack integers ``0 <= v < 2**width`` (``width`` 0..16), MSB first, zero-padded to a byte."""
    if width == 0 or values.size == 0:
        return b""
    be = values.astype(">u2").view(np.uint8).reshape(-1, 2)
    return np.packbits(np.unpackbits(be, axis=1)[:, 16 - width :]).tobytes()


def _padding_is_zero(data: memoryview | bytes, nbits: int) -> bool:
    """Whether the bits after the first ``nbits`` of ``data`` (the zero padding) are all zero."""
    rem = nbits % 8
    return not rem or not data[len(data) - 1] & ((1 << (8 - rem)) - 1)


def _unpack_uint(data: memoryview | bytes, width: int, n: int) -> np.ndarray:
    """Inverse of :func:`_pack_uint`: ``n`` values, int64."""
    if width == 0 or n == 0:
        return np.zeros(n, dtype=np.int64)
    bitmat = np.unpackbits(np.frombuffer(data, dtype=np.uint8), count=n * width).reshape(n, width)
    full = np.zeros((n, 16), dtype=np.uint8)
    full[:, 16 - width :] = bitmat
    return np.packbits(full, axis=1).view(">u2").reshape(n).astype(np.int64)


def table_nbytes(num_groups: int, bits: int, nnz: int, width: int) -> int:
    """Bytes of the frequency tables of one tensor.

    ``ceil(G * 2**bits / 8)`` (presence bitmap) + ``ceil(nnz * w / 8)`` (the ``f - 1`` values).

    Args:
        num_groups: ``G``.
        bits: coded bits per symbol.
        nnz: number of (group, symbol) pairs that occur.
        width: ``w``, bits per stored value.
    """
    return -(-num_groups * (1 << bits) // 8) + -(-nnz * width // 8)


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


def quantize_counts(counts: np.ndarray, precision: int) -> np.ndarray | None:
    """Quantize per-group counts to integer frequencies summing to ``2**precision``.

    ``f = round(c * 2**P / n)`` (``floor`` when rounding leaves no room), at least 1 where
    ``c > 0`` and 0 where ``c == 0``; the residue goes to the group's most frequent symbol
    (lowest index on ties). At ``P = 15`` the floor variant always fits ``<= 256`` symbols.

    Args:
        counts: int64 ``(G, K)``; every row has the same positive sum ``n``.
        precision: ``P`` in 1..15.

    Returns:
        int64 ``(G, K)`` frequencies, or ``None`` when ``2**P`` cannot give every present
        symbol a frequency >= 1.
    """
    n = int(counts[0].sum())
    total = 1 << precision
    top = np.argmax(counts, axis=1)
    rows = np.arange(counts.shape[0])
    present = counts > 0
    for offset in (n // 2, 0):  # round to nearest, then floor
        f = (counts * total + offset) // n
        np.maximum(f, present, out=f)
        f[rows, top] += total - f.sum(axis=1)
        if (f[rows, top] >= 1).all():
            return f
    return None


def _precision_candidates(counts: np.ndarray) -> list[int]:
    """Table precisions to try, best first (then ``P = 15`` as the fallback).

    Candidates: every ``P`` from the smallest that can hold the most diverse group's symbols to
    ``bit_length(n - 1) + 1`` (enough to represent the counts exactly), capped at 15. Each is
    scored, all at once, by the bits it costs with the round-to-nearest tables of
    :func:`quantize_counts`: ``nnz * w`` table-value bits plus ``-sum c * log2(f / 2**P)``
    payload bits (what the range coder spends, up to its own 24-bit quantization).
    """
    g, k = counts.shape
    n = int(counts[0].sum())
    present = counts > 0
    per_group = present.sum(axis=1)
    c = counts[present]  # (nnz,), group-major: each group's entries are contiguous
    starts = np.zeros(g, dtype=np.intp)
    np.cumsum(per_group[:-1], out=starts[1:])
    top = starts + (np.cumsum(present, axis=1)[np.arange(g), np.argmax(counts, axis=1)] - 1)  # index in c
    p_need = max(1, int(per_group.max() - 1).bit_length())
    p_hi = min(MAX_PRECISION, max(p_need, (n - 1).bit_length() + 1))
    ps = np.arange(p_need, p_hi + 1)
    totals = (1 << ps)[:, None]
    f = np.maximum((c[None, :] * totals + n // 2) // n, 1)  # (nP, nnz), as quantize_counts
    f[:, top] += totals - np.add.reduceat(f, starts, axis=1)
    valid = (f[:, top] >= 1).all(axis=1)
    logf = np.log2(np.maximum(f, 1), dtype=np.float64)
    payload = ps * float(n * g) - (logf * c).sum(axis=1)
    table = c.size * np.ceil(logf.max(axis=1))  # w = bit_length(max f - 1)
    cost = np.where(valid, payload + table, np.inf)
    order = np.argsort(cost, kind="stable")
    return [int(p) for p in ps[order][valid[order]]] + [MAX_PRECISION]


def _build_table(counts: np.ndarray) -> tuple[int, np.ndarray, int]:
    """``(P, f, w)``: the chosen precision, the frequencies, the stored value width."""
    for p in _precision_candidates(counts):
        f = quantize_counts(counts, p)
        if f is not None:
            return p, f, int(f.max() - 1).bit_length()
    raise AssertionError("no table precision fits")  # unreachable: P = 15 (floor) always fits


def _fused_probs(f: np.ndarray) -> np.ndarray:
    """Product distributions: ``(Q, m, K)`` -> ``(Q, K**m)`` float64, index ``sum s_i K**i``."""
    q, m, _ = f.shape
    joint = f[:, m - 1, :].astype(np.float64)
    for i in range(m - 2, -1, -1):
        joint = (joint[:, :, None] * f[:, i, None, :]).reshape(q, -1)
    return joint


def _models(f: np.ndarray, lay: _Layout) -> tuple[list, list]:
    """constriction models of the fused rows and of the unfused rows, in coding order."""
    m = lay.m
    (f_rows, f_len), (r_rows, r_len) = lay.rows_shape()
    if lay.model == "per_channel":
        fused = _fused_probs(f[: f_rows * m].reshape(f_rows, m, -1)) if f_rows else ()
        rest = f[f_rows * m :].astype(np.float64)
    else:
        fused = _fused_probs(np.repeat(f[:, None, :], m, axis=1)) if f_len else ()
        rest = f.astype(np.float64) if r_len else ()
    return [_Categorical(p, perfect=False) for p in fused], [_Categorical(p, perfect=False) for p in rest]


# ----------------------------------------------------------------------------- parsing


@dataclass(frozen=True)
class RangeSections:
    """Byte accounting of one tensor packed by :class:`RangeCodec`.

    Attributes:
        kind: :data:`KIND_RAW` or :data:`KIND_RANGE`.
        header: bytes of kind, model, layout, ``P``, ``w`` and the word-count varint.
        table: bytes of the frequency tables (:func:`table_nbytes`).
        low_bits: bytes of the raw low bits (``coded_bits``), 0 when every bit is coded.
        payload: bytes of the coder words (kind 1) or of the raw symbols (kind 0).
        precision: ``P`` (0 for raw).
        width: ``w`` (0 for raw).
        raw_low_bits: ``L``.
        dims: the layout integers.
    """

    kind: int
    header: int
    table: int
    low_bits: int
    payload: int
    precision: int = 0
    width: int = 0
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
    freqs: np.ndarray | None = None
    low: memoryview | None = None
    words: np.ndarray | None = None
    raw: memoryview | None = None


def _parse(data, model: str, bits: int, low_bits: int, count: int, shape: Sequence[int] | None) -> _Parsed:
    """Validate and split a packed tensor; raise CorruptStreamError on any inconsistency."""
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
    if kind != KIND_RANGE or bits == RAW16 or count == 0:
        raise CorruptStreamError(f"range codec: payload kind {kind} is invalid for {count} symbols of {bits} bits")
    if len(buf) < 2:
        raise CorruptStreamError("range codec: data ends inside its header")
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
    if pos + 2 > len(buf):
        raise CorruptStreamError("range codec: data ends inside its header")
    precision, width = buf[pos], buf[pos + 1]
    pos += 2
    if not 1 <= precision <= MAX_PRECISION or width > MAX_PRECISION:
        raise CorruptStreamError(f"range codec: table precision {precision} or width {width} out of range")
    g, k = lay.num_groups, 1 << coded
    nbitmap = -(-g * k // 8)
    if pos + nbitmap > len(buf):
        raise CorruptStreamError("range codec: data ends inside the frequency table")
    present = np.unpackbits(np.frombuffer(buf[pos : pos + nbitmap], dtype=np.uint8), count=g * k).view(bool)
    nnz = int(np.count_nonzero(present))
    nvals = -(-nnz * width // 8)
    table_at = pos
    pos += nbitmap
    if pos + nvals > len(buf):
        raise CorruptStreamError("range codec: data ends inside the frequency table")
    if not (_padding_is_zero(buf[table_at:pos], g * k) and _padding_is_zero(buf[pos : pos + nvals], nnz * width)):
        raise CorruptStreamError("range codec: nonzero padding bits in the frequency table")
    freqs = np.zeros(g * k, dtype=np.int64)
    freqs[present] = _unpack_uint(buf[pos : pos + nvals], width, nnz) + 1
    freqs = freqs.reshape(g, k)
    pos += nvals
    table_len = pos - table_at
    if (freqs.sum(axis=1) != 1 << precision).any():
        raise CorruptStreamError("range codec: a frequency table does not sum to 2**P")
    nlow = packed_nbytes(count, low_bits)
    if pos + nlow > len(buf):
        raise CorruptStreamError("range codec: data ends inside the raw low bits")
    low = buf[pos : pos + nlow]
    if not _padding_is_zero(low, count * low_bits):
        raise CorruptStreamError("range codec: nonzero padding bits after the raw low bits")
    pos += nlow
    nwords, pos = _read_varint(buf, pos)
    if len(buf) - pos != 4 * nwords:
        raise CorruptStreamError(f"range codec: {len(buf) - pos} coder bytes follow the header, it says {4 * nwords}")
    words = np.frombuffer(buf[pos:], dtype="<u4").astype(np.uint32)
    header_len = len(buf) - table_len - nlow - 4 * nwords
    secs = RangeSections(KIND_RANGE, header_len, table_len, nlow, 4 * nwords, precision, width, low_bits, dims_t)
    return _Parsed(secs, lay, freqs, low, words)


def parse_sections(
    data: bytes | memoryview, *, model: str, bits: int, count: int, coded_bits: int = 0, shape: Sequence[int] | None = None
) -> RangeSections:
    """Byte accounting (header / table / low bits / payload) of a tensor packed by :class:`RangeCodec`.

    Raises:
        CorruptStreamError: as :meth:`RangeCodec.unpack`, for structural problems.
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

    The kind-1 encoding of :class:`RangeCodec`, without its raw fallback.

    Args:
        symbols: natural shape (last axis = channels, axis 1 = heads).
        bits: symbol width.
        model: one of :data:`MODELS`.
        coded_bits: see :class:`RangeCodec`.
        raw_limit: when given, return ``None`` as soon as the result is known (estimated from
            the tables, or measured) to take at least ``raw_limit + 1`` bytes.

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
    counts = _group_counts(rows, lay)
    precision, freqs, width = _build_table(counts)
    present = freqs > 0
    dims = b"".join(_varint(d) for d in lay.dims)
    head = bytes([KIND_RANGE, MODELS.index(model) | low << 4]) + dims + bytes([precision, width])
    table = np.packbits(present.reshape(-1)).tobytes() + _pack_uint(freqs[present] - 1, width)
    low_bytes = pack_bits(flat & np.uint8((1 << low) - 1), low) if low else b""
    if raw_limit is not None:
        payload_bits = precision * lay.count - float((np.log2(freqs[present]) * counts[present]).sum())
        if len(head) + len(table) + len(low_bytes) + 4 * math.ceil(payload_bits / 32) + 1 > raw_limit:
            return None
    fused_models, rest_models = _models(freqs, lay)
    enc = _RangeEncoder()
    for model_i, row in zip(fused_models, rows.fused):
        enc.encode(row, model_i)
    for model_i, row in zip(rest_models, rows.rest):
        enc.encode(row, model_i)
    words = enc.get_compressed()
    out = b"".join((head, table, low_bytes, _varint(int(words.size)), words.astype("<u4", copy=False).tobytes()))
    if raw_limit is not None and len(out) > raw_limit:
        return None
    return out


# ----------------------------------------------------------------------------- the codec


@register_codec("range")
@dataclass(frozen=True)
class RangeCodec(Codec):
    """Range coding with order-0 models estimated from the data (CacheGen, SIGCOMM'24, sec. 5.2).

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
        lay, freqs, words = parsed.layout, parsed.freqs, parsed.words
        assert lay is not None and freqs is not None and words is not None and parsed.low is not None
        (f_rows, f_len), (r_rows, r_len) = lay.rows_shape()
        fused_models, rest_models = _models(freqs, lay)
        rows = _Rows(np.empty((f_rows, f_len), dtype=np.uint8), np.empty((r_rows, r_len), dtype=np.uint8))
        try:
            dec = _RangeDecoder(words)
            for i, model in enumerate(fused_models):
                rows.fused[i] = dec.decode(model, f_len)
            for i, model in enumerate(rest_models):
                rows.rest[i] = dec.decode(model, r_len)
            exhausted = dec.maybe_exhausted()
        except Exception as exc:  # constriction reports invalid data with AssertionError
            raise CorruptStreamError(f"range codec: coder words do not decode ({type(exc).__name__}: {exc})") from None
        if not exhausted:
            raise CorruptStreamError("range codec: coder words left over after decoding every symbol")
        out = _ungroup_matrix(_join_rows(rows, lay), lay)
        if low:
            out = (out << np.uint8(low)) | unpack_bits(parsed.low, low, count)
        return out
