"""Dense bit-packing codec C: ``bits`` bits per symbol, no entropy coding.

C is the lossless last stage of the T -> Q -> C pipeline (the modular strategy space of KVServe,
"KVServe: Service-Aware KV Cache Compression for Communication-Efficient
Disaggregated LLM Serving", arXiv 2605.13734);
this codec is its baseline: every other codec is measured against its size.

Wire layout: symbols in C (row-major) order, each written most-significant bit first, bits
concatenated across byte boundaries (the bit order of :func:`numpy.packbits`); the last byte
is zero-padded. ``count`` symbols of width ``bits`` take exactly ``ceil(count * bits / 8)``
bytes. Example: 2-bit symbols ``[1, 2, 3, 0]`` -> ``0b01_10_11_00`` = ``0x6C``.

16-bit symbols (the ``none`` quantizer's raw bfloat16 patterns, dtype uint16) are stored as
raw little-endian 16-bit words: 2 bytes per symbol. This is the chosen convention for
"symbols wider than a byte": quantizers with ``bits <= 8`` emit uint8, the raw 16-bit
passthrough emits uint16, and the codec dispatches on ``bits``.

Everything is vectorized numpy: width 8 is a copy, width 1 uses ``packbits``, widths 2 and 4
shift/or several symbols per byte (and unpack with a 256-entry table), widths 3, 5, 6 and 7
assemble each run of 8 symbols into ``bits`` bytes through a big-endian 64-bit word.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch

from kvtune.codecs.base import Codec, register_codec
from kvtune.core.errors import CorruptStreamError

__all__ = ["BitPack", "pack_bits", "unpack_bits", "packed_nbytes"]

RAW16 = 16


def packed_nbytes(count: int, bits: int) -> int:
    """Bytes taken by ``count`` symbols of width ``bits``: ``ceil(count * bits / 8)``."""
    return (count * bits + 7) // 8


@functools.lru_cache(maxsize=8)
def _shifts64(bits: int) -> np.ndarray:
    """Left shifts placing 8 symbols of ``bits`` bits MSB-first in the low ``8 * bits`` bits of a u64."""
    return (bits * (7 - np.arange(8))).astype(np.uint64)


@functools.lru_cache(maxsize=8)
def _byte_table(bits: int) -> np.ndarray:
    """256-entry table: for each byte value, its ``8 // bits`` symbols (MSB first) as one
    ``8 // bits``-byte word, so that ``np.take(table, bytes).view(np.uint8)`` unpacks."""
    per = 8 // bits
    shifts = (8 - bits * (np.arange(per) + 1)).astype(np.uint8)
    table = (np.arange(256, dtype=np.uint8)[:, None] >> shifts[None, :]) & np.uint8((1 << bits) - 1)
    return np.ascontiguousarray(table).view(f"V{per}").reshape(256)


def _as_numpy(symbols: torch.Tensor | np.ndarray) -> np.ndarray:
    if isinstance(symbols, torch.Tensor):
        symbols = symbols.detach().cpu().contiguous().numpy()
    return np.ascontiguousarray(symbols).reshape(-1)


def pack_bits(symbols: np.ndarray, bits: int) -> bytes:
    """Pack flat uint8 ``symbols`` (values ``< 2**bits``, ``bits`` in 1..8) densely, MSB first.

    Returns:
        ``ceil(len(symbols) * bits / 8)`` bytes.

    Raises:
        ValueError: when a symbol does not fit in ``bits`` bits or ``bits`` is out of range.
    """
    if not 1 <= bits <= 8:
        raise ValueError(f"bit width must be 1..8, got {bits}")
    a = np.asarray(symbols, dtype=np.uint8).reshape(-1)
    n = a.size
    if bits < 8 and n and int(a.max()) >> bits:
        raise ValueError(f"symbol {int(a.max())} does not fit in {bits} bits")
    if bits == 8:
        return a.tobytes()
    if bits == 1:
        return np.packbits(a).tobytes()
    if 8 % bits == 0:  # 2 or 4: several whole symbols per byte
        per = 8 // bits
        pad = (-n) % per
        if pad:
            a = np.concatenate([a, np.zeros(pad, dtype=np.uint8)])
        a = a.reshape(-1, per)
        out = a[:, 0] << np.uint8(8 - bits)
        for i in range(1, per):  # per <= 4 iterations, vectorized over all bytes
            out |= a[:, i] << np.uint8(8 - bits * (i + 1))
        return out.tobytes()
    # 3, 5, 6, 7: eight symbols fill exactly `bits` bytes; assemble them in a big-endian u64
    pad = (-n) % 8
    if pad:
        a = np.concatenate([a, np.zeros(pad, dtype=np.uint8)])
    cols = a.reshape(-1, 8)
    shifts = _shifts64(bits)
    words = cols[:, 0].astype(np.uint64) << shifts[0]
    for i in range(1, 8):  # 8 column operations, each vectorized over all words
        words |= cols[:, i].astype(np.uint64) << shifts[i]
    out = words.astype(">u8").view(np.uint8).reshape(-1, 8)[:, 8 - bits :]
    return out.tobytes()[: packed_nbytes(n, bits)]


def unpack_bits(data: bytes | memoryview | np.ndarray, bits: int, count: int) -> np.ndarray:
    """Inverse of :func:`pack_bits`: a new flat uint8 array of ``count`` symbols.

    Raises:
        CorruptStreamError: when ``len(data) != ceil(count * bits / 8)``.
    """
    if not 1 <= bits <= 8:
        raise ValueError(f"bit width must be 1..8, got {bits}")
    buf = np.frombuffer(data, dtype=np.uint8) if not isinstance(data, np.ndarray) else data.reshape(-1)
    expected = packed_nbytes(count, bits)
    if buf.size != expected:
        raise CorruptStreamError(f"bit-packed payload has {buf.size} bytes, {count} symbols of {bits} bits need {expected}")
    if bits == 8:
        return buf.copy()
    if bits == 1:
        return np.unpackbits(buf, count=count)
    if 8 % bits == 0:  # 2 or 4: one table lookup per byte
        return np.take(_byte_table(bits), buf).view(np.uint8)[:count]
    groups = -(-count // 8)
    padded = np.zeros((groups, 8), dtype=np.uint8)
    body = np.zeros(groups * bits, dtype=np.uint8)
    body[: buf.size] = buf
    padded[:, 8 - bits :] = body.reshape(groups, bits)
    words = padded.view(">u8").reshape(groups)
    shifts, mask = _shifts64(bits), np.uint64((1 << bits) - 1)
    out = np.empty((groups, 8), dtype=np.uint8)
    for i in range(8):  # 8 column operations, each vectorized over all words
        out[:, i] = (words >> shifts[i]) & mask
    return out.reshape(-1)[:count]


@register_codec("bitpack")
@dataclass(frozen=True)
class BitPack(Codec):
    """Dense bit-packing: exactly ``bits`` bits per symbol, ``ceil(count * bits / 8)`` bytes.

    The "no entropy coding" codec of KIVI-style pipelines (the entropy-coded alternative is
    CacheGen, Liu et al., SIGCOMM'24). Widths 1..8 are bit-packed (uint8 symbols); width 16
    (uint16 symbols, the ``none`` quantizer) is stored as raw little-endian 16-bit words.
    """

    bounds_by_length: ClassVar[bool] = True

    def supports(self, bits: int) -> bool:
        """Widths 1..8 and 16."""
        return 1 <= bits <= 8 or bits == RAW16

    def max_symbols(self, payload: bytes | memoryview) -> int:
        """``8 * len(payload)``: a symbol takes at least one bit."""
        return 8 * len(payload)

    def pack(self, symbols: torch.Tensor | np.ndarray, bits: int) -> bytes:
        """Pack symbols (any shape, C order) of width ``bits``; see :func:`pack_bits`."""
        a = _as_numpy(symbols)
        if bits == RAW16:
            return a.astype("<u2", copy=False).tobytes()
        if a.dtype != np.uint8:
            raise ValueError(f"{bits}-bit symbols must be uint8, got {a.dtype}")
        return pack_bits(a, bits)

    def unpack(self, data, bits: int, count: int, *, shape=None) -> np.ndarray:
        """Flat ``(count,)`` uint8 symbols (uint16 when ``bits == 16``).

        Raises:
            CorruptStreamError: when ``data`` does not hold exactly ``count`` symbols.
        """
        if bits == RAW16:
            if len(data) != 2 * count:
                raise CorruptStreamError(f"raw 16-bit payload has {len(data)} bytes, {count} symbols need {2 * count}")
            return np.frombuffer(data, dtype="<u2", count=count).astype(np.uint16)
        return unpack_bits(data, bits, count)
