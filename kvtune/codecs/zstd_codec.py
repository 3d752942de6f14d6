"""General-purpose lossless baseline codec C ``zstd``: dense bit-packing, then Zstandard.

A general-purpose compressor is the baseline that an entropy coder with KV-specific models
(``range``, after CacheGen, arXiv 2310.07240, sec. 5.2) has to beat to be worth its cost. The
symbols are first bit-packed exactly as the ``bitpack`` codec does
(:func:`kvtune.codecs.bitpack.pack_bits`; ``bits == 16`` raw patterns as little-endian 16-bit
words), then compressed as one Zstandard frame (python-zstandard,
single-threaded, so the output is deterministic for a given zstd library version and level).

Wire layout: exactly one zstd frame with the content size in its header, no zstd checksum
(the outer stream has a CRC32). Decoding first reads the frame's content size and requires
it to be at most :data:`MAX_EXPANSION` times the frame's length (the most a zstd frame can
expand: RFC 8878 sec. 3.1.1.2, a block decodes to at most 128 KiB and takes at least 4 bytes)
and to equal the packed size implied by ``count`` and ``bits`` (``ceil(count * bits / 8)``, or
``2 * count``) before decompressing with that size as the output bound and no trailing data
allowed; every failure raises :class:`~kvtune.core.errors.CorruptStreamError`. The declared content
size also bounds the symbols a payload can hold (:meth:`ZstdCodec.max_symbols`), which the
decoder checks against the stream header's claimed shapes before it allocates anything.

Zstandard works on bytes: it finds repeated byte strings (LZ matches) and Huffman-codes
literals with tables built per block; it has no notion of channels or heads. Still, on real
SmolLM2-135M KIVI symbols (keys per channel, values per token, groups of 32;
``(1, 3, 1024, 64)`` x 30 layers) level 3 reaches 1.72 bits per 2-bit symbol and 3.84 per
4-bit symbol, slightly better than the order-0 ``range`` models (1.73 / 3.88), because the
values contain repeats an order-0 model cannot see (the keys do not: there ``range`` wins), at
4-10x the speed. On tiny tensors the ~10-byte frame header can make it larger than ``bitpack``.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np
import torch
import zstandard

from kvtune.codecs.base import Codec, param, register_codec
from kvtune.codecs.bitpack import RAW16, pack_bits, packed_nbytes, unpack_bits
from kvtune.core.errors import CorruptStreamError

__all__ = ["MAX_EXPANSION", "ZstdCodec", "frame_content_size"]

MAX_EXPANSION = 1 << 15
"""Most content bytes per frame byte: a zstd block decodes to at most 128 KiB (Block_Maximum_Size)
and takes at least 4 bytes (a 3-byte block header and one RLE byte), RFC 8878 sec. 3.1.1.2."""

_local = threading.local()  # zstd contexts are not thread-safe: one per thread and level


def _compressor(level: int) -> zstandard.ZstdCompressor:
    cache = _local.__dict__.setdefault("compressors", {})
    if level not in cache:
        cache[level] = zstandard.ZstdCompressor(level=level, write_content_size=True, write_checksum=False, threads=0)
    return cache[level]


def _decompressor() -> zstandard.ZstdDecompressor:
    if not hasattr(_local, "decompressor"):
        _local.decompressor = zstandard.ZstdDecompressor()
    return _local.decompressor


def frame_content_size(data: bytes | memoryview) -> int:
    """The content size (bytes) declared in the header of the zstd frame ``data``.

    Raises:
        CorruptStreamError: ``data`` does not start with a zstd frame header, the header
            declares no content size, or one above ``MAX_EXPANSION * len(data)`` (more than
            any frame of that length decompresses to).
    """
    try:
        size = zstandard.frame_content_size(data)
    except zstandard.ZstdError as exc:
        raise CorruptStreamError(f"zstd codec: not a zstd frame ({exc})") from None
    if size < 0:
        raise CorruptStreamError("zstd codec: the frame header declares no content size")
    if size > MAX_EXPANSION * len(data):
        raise CorruptStreamError(f"zstd codec: a frame of {len(data)} bytes declares {size} content bytes; "
                                 f"at most {MAX_EXPANSION} per frame byte decompress from it")
    return size


@register_codec("zstd")
@dataclass(frozen=True)
class ZstdCodec(Codec):
    """Bit-pack the symbols, then compress them with Zstandard at ``level``.

    Args:
        level: zstd compression level; 1..22 trade speed for ratio (19+ are slow), negative
            levels (down to -7) are zstd's fast modes. Default 3 (zstd's default).

    Example::

        >>> import numpy as np
        >>> x = np.zeros((1, 2, 256, 64), dtype=np.uint8)
        >>> data = ZstdCodec().pack(x, 2)
        >>> len(data) < x.size * 2 // 8
        True
        >>> bool((ZstdCodec().unpack(data, 2, x.size) == 0).all())
        True
    """

    level: int = param(3, low=-7, high=22, doc="zstd compression level")

    def supports(self, bits: int) -> bool:
        """Widths 1..8 and 16 (the packed bytes of :mod:`kvtune.codecs.bitpack`)."""
        return 1 <= bits <= 8 or bits == RAW16

    def max_symbols(self, payload: bytes | memoryview) -> int:
        """``8 *`` the content size the frame declares (:func:`frame_content_size`): a packed
        symbol takes at least one bit.

        Raises:
            CorruptStreamError: as :func:`frame_content_size`.
        """
        return 8 * frame_content_size(payload)

    def pack(self, symbols: torch.Tensor | np.ndarray, bits: int) -> bytes:
        """Bit-pack ``symbols`` (any shape, C order) and compress them into one zstd frame.

        Raises:
            ValueError: wrong dtype, a symbol ``>= 2**bits``, or an unsupported width.
        """
        if isinstance(symbols, torch.Tensor):
            symbols = symbols.detach().cpu().contiguous().numpy()
        a = np.ascontiguousarray(symbols).reshape(-1)
        if bits == RAW16:
            raw = a.astype("<u2", copy=False).tobytes()
        elif 1 <= bits <= 8:
            if a.dtype != np.uint8:
                raise ValueError(f"{bits}-bit symbols must be uint8, got {a.dtype}")
            raw = pack_bits(a, bits)
        else:
            raise ValueError(f"zstd codec: bit width must be 1..8 or 16, got {bits}")
        return _compressor(self.level).compress(raw)

    def unpack(self, data, bits: int, count: int, *, shape=None) -> np.ndarray:
        """Decompress and unpack ``count`` symbols: flat uint8 (uint16 when ``bits == 16``).

        Raises:
            CorruptStreamError: not one valid zstd frame, a frame content size other than the
                packed size of ``count`` symbols (or beyond :data:`MAX_EXPANSION` times the
                frame's length), trailing bytes, or a frame that does not decompress to exactly
                that size.
        """
        if not self.supports(bits):
            raise ValueError(f"zstd codec: bit width must be 1..8 or 16, got {bits}")
        if count < 0:
            raise ValueError(f"count must be >= 0, got {count}")
        expected = 2 * count if bits == RAW16 else packed_nbytes(count, bits)
        size = frame_content_size(data)
        if size != expected:
            raise CorruptStreamError(f"zstd codec: frame holds {size} bytes, {count} symbols of {bits} bits need {expected}")
        try:
            raw = _decompressor().decompress(data, max_output_size=expected, allow_extra_data=False)
        except zstandard.ZstdError as exc:
            raise CorruptStreamError(f"zstd codec: frame does not decompress ({exc})") from None
        if len(raw) != expected:
            raise CorruptStreamError(f"zstd codec: frame decompressed to {len(raw)} bytes, expected {expected}")
        if bits == RAW16:
            return np.frombuffer(raw, dtype="<u2", count=count).astype(np.uint16)
        return unpack_bits(raw, bits, count)
