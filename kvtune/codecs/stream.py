"""The kvtune KV bitstream, wire-format version 1.

One stream carries the KV cache of one request for a contiguous range of layers, and decodes
from its bytes alone (the header holds the full policy configuration). Layout, all integers
little-endian::

    offset  size  field
    0       4     magic b"KVTN"
    4       2     format version (u16) = 1
    6       4     header length H (u32), bytes of the JSON below
    10      H     header: canonical JSON (sorted keys, no spaces, ASCII) with
                    "policy"       policy configuration dict (PolicyConfig.to_dict())
                    "policy_id"    12 hex chars, PolicyConfig.policy_id
                    "layer_offset" absolute index of the first layer
                    "dtype"        original dtype: "float32" | "bfloat16" | "float16"
                    "shapes"       per layer [K shape, V shape], each [batch, kv_heads, tokens, head_dim]
                    "sections"     per layer [K meta, K payload, V meta, V payload] byte lengths
    10+H    4     header checksum: BLAKE2b-32 (4-byte digest) of bytes [0, 10+H)
    14+H    ...   sections, per layer in order: K metadata, K payload, V metadata, V payload
    end-4   4     CRC32 (zlib.crc32) of every byte before it

The header checksum is an addition to the minimal layout: it lets a decoder trust the
recorded lengths before using them, so a stream that is merely cut short is reported as
truncated while a stream whose header was altered is reported as corrupt. It is deliberately
not a CRC32: a CRC32 over a message followed by that message's own CRC32 is a constant, so
the final CRC would then be blind to the header.

Decoding checks, in order: length of the fixed prefix (:class:`TruncatedStreamError`), magic
(:class:`CorruptStreamError`), version (:class:`StreamVersionError`), header length and
header checksum, JSON structure, total length (shorter: truncated; longer: corrupt), final
checksum, then the expected policy (:class:`PolicyMismatchError`). No tensor is produced
from a stream that fails any check. Streams are deterministic: the same input and policy give
the same bytes.
"""

from __future__ import annotations

import hashlib
import json
import math
import struct
import zlib
from dataclasses import dataclass
from typing import Any, Sequence

from kvtune.errors import CorruptStreamError, PolicyMismatchError, StreamVersionError, TruncatedStreamError

__all__ = [
    "MAGIC",
    "FORMAT_VERSION",
    "DTYPES",
    "StreamHeader",
    "canonical_json",
    "write_stream",
    "read_stream",
    "read_header",
]

MAGIC = b"KVTN"
FORMAT_VERSION = 1
DTYPES = ("float32", "bfloat16", "float16")
_PREFIX = struct.Struct("<4sHI")
_CRC = struct.Struct("<I")
MAX_HEADER_BYTES = 1 << 26  # 64 MiB: a longer recorded header length is treated as corruption
SECTIONS_PER_LAYER = 4  # K meta, K payload, V meta, V payload


def _header_digest(data: bytes | memoryview) -> bytes:
    """4-byte BLAKE2b digest protecting the prefix and the JSON header."""
    return hashlib.blake2b(data, digest_size=_CRC.size).digest()


def canonical_json(obj: Any) -> str:
    """Canonical JSON text: sorted keys, no whitespace, ASCII only."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)


@dataclass(frozen=True)
class StreamHeader:
    """The decoded header of a stream plus its byte accounting.

    Attributes:
        version: wire-format version.
        policy: the policy configuration dict.
        policy_id: the policy's id as recorded by the encoder.
        layer_offset: absolute index of the stream's first layer.
        dtype: original dtype name (``"float32"``, ``"bfloat16"`` or ``"float16"``).
        shapes: per layer ``(K shape, V shape)``, each ``(batch, kv_heads, tokens, head_dim)``.
        sections: per layer ``(K meta, K payload, V meta, V payload)`` lengths in bytes.
        header_nbytes: bytes before the first section (prefix + JSON + header checksum).
    """

    version: int
    policy: dict[str, Any]
    policy_id: str
    layer_offset: int
    dtype: str
    shapes: tuple[tuple[tuple[int, ...], tuple[int, ...]], ...]
    sections: tuple[tuple[int, int, int, int], ...]
    header_nbytes: int

    checksum_nbytes: int = _CRC.size

    @property
    def num_layers(self) -> int:
        """Number of layers in the stream."""
        return len(self.shapes)

    @property
    def meta_nbytes(self) -> int:
        """Bytes of quantizer metadata (scales, zero points) over all sections."""
        return sum(s[0] + s[2] for s in self.sections)

    @property
    def payload_nbytes(self) -> int:
        """Bytes of packed symbols over all sections."""
        return sum(s[1] + s[3] for s in self.sections)

    @property
    def total_nbytes(self) -> int:
        """Total stream length in bytes: header + metadata + payload + final checksum."""
        return self.header_nbytes + self.meta_nbytes + self.payload_nbytes + self.checksum_nbytes

    @property
    def num_elements(self) -> int:
        """Number of K and V elements carried."""
        return sum(math.prod(k) + math.prod(v) for k, v in self.shapes)


def write_stream(
    *,
    policy: dict[str, Any],
    policy_id: str,
    layer_offset: int,
    dtype: str,
    shapes: Sequence[tuple[Sequence[int], Sequence[int]]],
    sections: Sequence[Sequence[bytes]],
) -> bytes:
    """Assemble a version-1 stream (see the module docstring for the layout).

    Args:
        policy: policy configuration dict (JSON-serializable).
        policy_id: the policy's id.
        layer_offset: absolute index of the first layer.
        dtype: original dtype name, one of :data:`DTYPES`.
        shapes: per layer ``(K shape, V shape)``.
        sections: per layer the four byte strings ``(K meta, K payload, V meta, V payload)``.

    Returns:
        The stream bytes.
    """
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    if len(shapes) != len(sections) or any(len(s) != SECTIONS_PER_LAYER for s in sections):
        raise ValueError("need one (K meta, K payload, V meta, V payload) section group per layer")
    header = {
        "policy": policy,
        "policy_id": policy_id,
        "layer_offset": int(layer_offset),
        "dtype": dtype,
        "shapes": [[list(map(int, k)), list(map(int, v))] for k, v in shapes],
        "sections": [[len(b) for b in group] for group in sections],
    }
    hjson = canonical_json(header).encode("ascii")
    head = _PREFIX.pack(MAGIC, FORMAT_VERSION, len(hjson)) + hjson
    head += _header_digest(head)
    parts = [head, *(b for group in sections for b in group)]
    crc = 0
    for p in parts:
        crc = zlib.crc32(p, crc)
    return b"".join(parts + [_CRC.pack(crc)])


def _bad(msg: str) -> CorruptStreamError:
    return CorruptStreamError(f"corrupt KV stream: {msg}")


def _shape(x: Any) -> tuple[int, ...]:
    if not (isinstance(x, list) and len(x) == 4 and all(type(d) is int and d >= 0 for d in x)):
        raise _bad(f"bad tensor shape {x!r} in header")
    return tuple(x)


def _parse_header(hjson: bytes, header_nbytes: int, version: int) -> StreamHeader:
    try:
        h = json.loads(hjson.decode("ascii"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise _bad(f"header is not valid JSON ({exc})") from None
    keys = {"policy", "policy_id", "layer_offset", "dtype", "shapes", "sections"}
    if not isinstance(h, dict) or set(h) != keys:
        raise _bad(f"header keys must be {sorted(keys)}")
    if not isinstance(h["policy"], dict) or not isinstance(h["policy_id"], str):
        raise _bad("bad policy in header")
    if type(h["layer_offset"]) is not int or h["layer_offset"] < 0:
        raise _bad(f"bad layer_offset {h['layer_offset']!r}")
    if h["dtype"] not in DTYPES:
        raise _bad(f"unknown dtype {h['dtype']!r} (known: {', '.join(DTYPES)})")
    shapes, sections = h["shapes"], h["sections"]
    if not (isinstance(shapes, list) and isinstance(sections, list) and len(shapes) == len(sections)):
        raise _bad("'shapes' and 'sections' must be lists of equal length")
    out_shapes = []
    for pair in shapes:
        if not (isinstance(pair, list) and len(pair) == 2):
            raise _bad(f"bad per-layer shapes {pair!r}")
        out_shapes.append((_shape(pair[0]), _shape(pair[1])))
    out_sections = []
    for group in sections:
        if not (
            isinstance(group, list)
            and len(group) == SECTIONS_PER_LAYER
            and all(type(n) is int and n >= 0 for n in group)
        ):
            raise _bad(f"bad section lengths {group!r}")
        out_sections.append(tuple(group))
    return StreamHeader(
        version=version,
        policy=h["policy"],
        policy_id=h["policy_id"],
        layer_offset=h["layer_offset"],
        dtype=h["dtype"],
        shapes=tuple(out_shapes),
        sections=tuple(out_sections),  # type: ignore[arg-type]
        header_nbytes=header_nbytes,
    )


def read_stream(
    data: bytes | bytearray | memoryview, *, expect_policy_id: str | None = None
) -> tuple[StreamHeader, list[tuple[memoryview, memoryview, memoryview, memoryview]]]:
    """Validate a stream and split it into its header and per-layer sections.

    Args:
        data: the stream bytes.
        expect_policy_id: when given, the policy id the caller expects.

    Returns:
        ``(header, sections)``; ``sections[i]`` is ``(K meta, K payload, V meta, V payload)``
        as zero-copy memoryviews into ``data``.

    Raises:
        TruncatedStreamError: the stream is shorter than its prefix, header or recorded
            section lengths.
        CorruptStreamError: bad magic, header or final checksum mismatch, malformed header,
            trailing bytes.
        StreamVersionError: the format version is not one this kvtune reads.
        PolicyMismatchError: ``expect_policy_id`` differs from the stream's policy id.
    """
    mv = memoryview(data).cast("B")
    n = len(mv)
    if n < _PREFIX.size:
        if bytes(mv[: len(MAGIC)]) != MAGIC[: min(n, len(MAGIC))]:
            raise _bad("bad magic")
        raise TruncatedStreamError(f"KV stream truncated: {n} bytes, the fixed prefix alone needs {_PREFIX.size}")
    magic, version, hlen = _PREFIX.unpack_from(mv, 0)
    if magic != MAGIC:
        raise _bad(f"bad magic {magic!r} (expected {MAGIC!r})")
    if version != FORMAT_VERSION:
        raise StreamVersionError(f"KV stream format version {version}; this kvtune reads version {FORMAT_VERSION}")
    if hlen > MAX_HEADER_BYTES:
        raise _bad(f"implausible header length {hlen}")
    hend = _PREFIX.size + hlen
    header_nbytes = hend + _CRC.size
    if n < header_nbytes:
        raise TruncatedStreamError(f"KV stream truncated: {n} bytes, the header needs {header_nbytes}")
    if bytes(mv[hend:header_nbytes]) != _header_digest(mv[:hend]):
        raise _bad("header checksum mismatch")
    header = _parse_header(bytes(mv[_PREFIX.size : hend]), header_nbytes, version)
    total = header.total_nbytes
    if n < total:
        raise TruncatedStreamError(f"KV stream truncated: {n} bytes, header and section lengths say {total}")
    if n > total:
        raise _bad(f"{n - total} unexpected bytes after the end of the stream ({total} bytes)")
    (crc,) = _CRC.unpack_from(mv, total - _CRC.size)
    if zlib.crc32(mv[: total - _CRC.size]) != crc:
        raise _bad("checksum mismatch")
    if expect_policy_id is not None and header.policy_id != expect_policy_id:
        raise PolicyMismatchError(
            f"KV stream was encoded with policy {header.policy_id}, caller expects {expect_policy_id}"
        )
    sections = []
    pos = header_nbytes
    for group in header.sections:
        views = []
        for length in group:
            views.append(mv[pos : pos + length])
            pos += length
        sections.append(tuple(views))
    return header, sections  # type: ignore[return-value]


def read_header(data: bytes | bytearray | memoryview) -> StreamHeader:
    """Validate a stream (all checks of :func:`read_stream`) and return its header.

    Useful for byte accounting: ``len(data) == h.header_nbytes + h.meta_nbytes +
    h.payload_nbytes + h.checksum_nbytes``.
    """
    return read_stream(data)[0]
