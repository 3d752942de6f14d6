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
                    "sections"     per layer [K lengths, V lengths]; each lengths list is
                                   [state, meta_0, payload_0, meta_1, payload_1, ...]
                                   (byte lengths; 1 + 2 * segments entries)
                    "source_tokens" only in streams of a token-selecting policy (``keep``,
                                   :mod:`kvtune.codecs.select`): per layer the original token
                                   count; "shapes" then hold the kept token counts
    10+H    4     header checksum: BLAKE2b-32 (4-byte digest) of bytes [0, 10+H)
    14+H    ...   sections, per layer in order: the K tensor's sections, then the V tensor's,
                  each: transform state, then per segment its metadata and its payload
    ...     ...   selection block, only with "source_tokens": per layer one bitmask of
                  batch x kv_heads rows of ceil(source_tokens / 8) bytes (least significant
                  bit first; bit t set when token t was kept), layer after layer
    end-4   4     CRC32 (zlib.crc32) of every byte before it

Sections of one K or V tensor::

    state        the transforms' state (e.g. ``affine``'s float16 scales), in transform order,
                 each transform's fields in its ``state_layout`` order; empty when no transform
                 carries state
    meta_i       segment i's quantizer metadata (e.g. float16 scale, zero), raw little-endian,
                 fields in the segment coder's ``block_meta_layout`` order
    payload_i    segment i's symbols packed by the policy's codec (``codec.pack(symbols, bits)``
                 with the segment's width and shape)

A segment is a rectangular slice (a set of KV heads x a set of tokens) coded with one symbol
width: e.g. bfloat16 sink/recent tokens, 8-bit delta anchors, high- and low-precision heads of
``mixhq``, or a layer's scheduled width (:class:`kvtune.codecs.base.Segment`). Which segments a
tensor has, their order, shapes, widths and metadata layouts are *not* stored: the decoder
re-derives them from the policy, the tensor shape and the layer index
(:meth:`kvtune.codecs.base.Quantizer.plan`: token classes ordered by their first token, and
inside a class the heads of one width ordered by their first head), then checks that the
recorded lengths agree. A plain one-width tensor has exactly one segment; an empty tensor has
none.

The header checksum is an addition to the minimal layout: it lets a decoder trust the
recorded lengths before using them, so a stream that is merely cut short is reported as
truncated while a stream whose header was altered is reported as corrupt. It is deliberately
not a CRC32: a CRC32 over a message followed by that message's own CRC32 is a constant, so
the final CRC would then be blind to the header.

The section lists changed from the Step-1 layout (``[K meta, K payload, V meta, V payload]``)
before any release, so the format version stays 1.

Decoding checks, in order: length of the fixed prefix (:class:`TruncatedStreamError`), magic
(:class:`CorruptStreamError`), version (:class:`StreamVersionError`), header length and
header checksum, the header JSON's nesting depth (at most :data:`MAX_HEADER_DEPTH`, scanned
before parsing), that it is canonical JSON (as :func:`kvtune.core.jsonio.canonical_json` writes it: no NaN or
infinity, no duplicate keys, no whitespace), its structure (keys; ``policy_id`` 12 hex digits;
``layer_offset`` and the layer indices in ``0..MAX_DIM``; shapes of four non-negative ints;
section lengths of non-negative ints), total length (shorter: truncated; longer: corrupt),
final checksum, then the expected policy (:class:`PolicyMismatchError`). Then
:func:`kvtune.codecs.decode_kv` checks, before it allocates anything from a claimed shape,
that every tensor's shape is one an encoder writes (:func:`shape_problem`) and fits its
section lengths (:func:`kvtune.codecs.policy.check_claimed_sizes`: e.g. at most 8 elements
per payload byte with ``bitpack``, per content byte its frames declare with ``zstd``; at most
:data:`~kvtune.codecs.policy.MAX_UNCONFIRMED_PLAN` heads + tokens, or 8 per section byte, when
range-coded payloads declare no count), and then per tensor the state length, the number of
segments, each segment's metadata length and its payload against the plan
(:class:`CorruptStreamError`), and whether the policy applies to the recorded shapes at all
(:class:`KVStreamError`, e.g. ``mixhq`` scores for another head count). A tensor without
tokens is not planned: only its state length is checked. Every failure on untrusted bytes is
a :class:`~kvtune.core.errors.KVStreamError`; no tensor is produced from a stream that fails any
check. Streams are deterministic: the same input and policy give the same bytes.

:func:`kvtune.codecs.decode_kv` reads with ``verify_checksum=False`` and verifies the final
checksum itself: its fast path takes each tensor's CRC-32 while decoding it (one read of the
stream instead of two) and compares the combination before it returns; the other paths check
it before decoding; and any error found on the way is reported as a checksum mismatch when the
stream is damaged. A caller therefore sees the errors in the order above.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
import re
import struct
from typing import Any, Callable, NamedTuple, Sequence

import numpy as np

from kvtune.codecs.checksum import crc32_combine, crc32_threaded
from kvtune.codecs.newbytes import filled_bytes
from kvtune.core.jsonio import canonical_json
from kvtune.core.errors import CorruptStreamError, KVStreamError, PolicyMismatchError, StreamVersionError, TruncatedStreamError

__all__ = [
    "MAGIC",
    "FORMAT_VERSION",
    "DTYPES",
    "MAX_HEADER_BYTES",
    "MAX_HEADER_DEPTH",
    "MAX_DIM",
    "MAX_TENSOR_ELEMENTS",
    "shape_problem",
    "byte_view",
    "StreamHeader",
    "TensorSections",
    "write_stream",
    "write_stream_in_place",
    "stream_head",
    "read_stream",
    "read_header",
    "section_views",
    "check_checksum",
    "stream_checksum",
    "selection_views",
    "mask_nbytes",
]

MAGIC = b"KVTN"
FORMAT_VERSION = 1
DTYPES = ("float32", "bfloat16", "float16")
_PREFIX = struct.Struct("<4sHI")
_CRC = struct.Struct("<I")
MAX_HEADER_BYTES = 1 << 26
"""A recorded header length above 64 MiB is treated as corruption."""
MAX_HEADER_DEPTH = 16
"""Deepest ``[`` / ``{`` nesting of the header JSON (an encoder writes 5: header, policy,
quantizer, ``head_scores``, one layer's scores); deeper headers are refused before parsing."""
MAX_DIM = 2**31 - 1
"""Largest batch, kv_heads, tokens or head_dim of a tensor, and largest layer index."""
MAX_TENSOR_ELEMENTS = 2**40
"""Most elements of one K or V tensor (4 TiB in float32; keeps every byte offset of the codecs
and kernels far from int64 overflow)."""
_POLICY_ID = re.compile(r"[0-9a-f]{12}")
_DEPTH_STEP = np.zeros(256, np.int8)
_DEPTH_STEP[list(b"[{")], _DEPTH_STEP[list(b"]}")] = 1, -1
_DEPTH_CHUNK = 1 << 14


class TensorSections(NamedTuple):
    """The sections of one K or V tensor: byte lengths (in :class:`StreamHeader`) or zero-copy
    memoryviews (from :func:`read_stream`).

    Attributes:
        state: the transforms' state.
        meta: per segment, the quantizer metadata.
        payload: per segment, the packed symbols.
    """

    state: Any
    meta: tuple[Any, ...]
    payload: tuple[Any, ...]

    @property
    def num_segments(self) -> int:
        """Number of segments."""
        return len(self.meta)

    def flat(self) -> list[Any]:
        """``[state, meta_0, payload_0, meta_1, payload_1, ...]`` (wire order)."""
        return [self.state, *(x for pair in zip(self.meta, self.payload) for x in pair)]

    @classmethod
    def from_flat(cls, items: Sequence[Any]) -> "TensorSections":
        """Inverse of :meth:`flat` (``items`` has odd length)."""
        return cls(items[0], tuple(items[1::2]), tuple(items[2::2]))


def _header_digest(data: bytes | memoryview) -> bytes:
    """4-byte BLAKE2b digest protecting the prefix and the JSON header."""
    return hashlib.blake2b(data, digest_size=_CRC.size).digest()


@dataclasses.dataclass(frozen=True)
class StreamHeader:
    """The decoded header of a stream plus its byte accounting.

    Attributes:
        version: wire-format version.
        policy: the policy configuration dict.
        policy_id: the policy's id as recorded by the encoder.
        layer_offset: absolute index of the stream's first layer.
        dtype: original dtype name (``"float32"``, ``"bfloat16"`` or ``"float16"``).
        shapes: per layer ``(K shape, V shape)``, each ``(batch, kv_heads, tokens, head_dim)``.
        sections: per layer ``(K, V)`` :class:`TensorSections` of byte lengths.
        header_nbytes: bytes before the first section (prefix + JSON + header checksum).
        source_tokens: per layer the original token count of a token-selecting policy's stream
            (the ``shapes`` then hold the kept counts), else ``None``.
        text: the header's JSON bytes as read (empty for a header built otherwise). Every
            field above is a function of them, and :func:`read_stream` hands out the same
            object for a repeated header, so a cache of facts derived from the header alone
            (plans, size checks) keys on it and hashes it once.
    """

    version: int
    policy: dict[str, Any]
    policy_id: str
    layer_offset: int
    dtype: str
    shapes: tuple[tuple[tuple[int, ...], tuple[int, ...]], ...]
    sections: tuple[tuple[TensorSections, TensorSections], ...]
    header_nbytes: int

    checksum_nbytes: int = _CRC.size
    source_tokens: tuple[int, ...] | None = None
    text: bytes = dataclasses.field(default=b"", compare=False, repr=False)

    @property
    def num_layers(self) -> int:
        """Number of layers in the stream."""
        return len(self.shapes)

    # the byte counts below are computed once per header object (cached_property: a frozen
    # dataclass's fields never change); a decode reads the total several times

    def _tensors(self) -> list[TensorSections]:
        return [t for pair in self.sections for t in pair]

    @functools.cached_property
    def state_nbytes(self) -> int:
        """Bytes of transform state (e.g. ``affine`` scales) over all tensors."""
        return sum(t.state for t in self._tensors())

    @functools.cached_property
    def meta_nbytes(self) -> int:
        """Bytes of quantizer metadata (scales, zero points) over all segments."""
        return sum(sum(t.meta) for t in self._tensors())

    @functools.cached_property
    def payload_nbytes(self) -> int:
        """Bytes of packed symbols over all segments."""
        return sum(sum(t.payload) for t in self._tensors())

    @functools.cached_property
    def selection_nbytes(self) -> int:
        """Bytes of the kept-token bitmasks (0 without token selection)."""
        if self.source_tokens is None:
            return 0
        return sum(mask_nbytes(k, t) for (k, _), t in zip(self.shapes, self.source_tokens))

    @functools.cached_property
    def total_nbytes(self) -> int:
        """Total stream length in bytes: header + state + metadata + payload + selection masks +
        final checksum."""
        return (self.header_nbytes + self.state_nbytes + self.meta_nbytes + self.payload_nbytes
                + self.selection_nbytes + self.checksum_nbytes)

    @property
    def num_elements(self) -> int:
        """Number of K and V elements carried."""
        return sum(math.prod(k) + math.prod(v) for k, v in self.shapes)


def mask_nbytes(shape: Sequence[int], source_tokens: int) -> int:
    """Bytes of one layer's kept-token bitmask: ``batch * kv_heads`` rows of
    ``ceil(source_tokens / 8)`` bytes (``shape`` is the layer's K shape)."""
    return int(shape[0]) * int(shape[1]) * (-(-int(source_tokens) // 8))


def write_stream(
    *,
    policy: dict[str, Any],
    policy_id: str,
    layer_offset: int,
    dtype: str,
    shapes: Sequence[tuple[Sequence[int], Sequence[int]]],
    sections: Sequence[tuple[Sequence[bytes], Sequence[bytes]]],
    crcs: Sequence[tuple[tuple[int, int], tuple[int, int]]] | None = None,
    source_tokens: Sequence[int] | None = None,
    masks: Sequence[bytes] | None = None,
) -> bytes:
    """Assemble a version-1 stream (see the module docstring for the layout).

    Args:
        policy: policy configuration dict (JSON-serializable).
        policy_id: the policy's id.
        layer_offset: absolute index of the first layer.
        dtype: original dtype name, one of :data:`DTYPES`.
        shapes: per layer ``(K shape, V shape)``.
        sections: per layer ``(K parts, V parts)``, each a sequence of byte strings (or 1-D
            uint8 arrays) ``[state, meta_0, payload_0, meta_1, payload_1, ...]`` (odd length).
        crcs: optional per layer ``((K crc, K bytes), (V crc, V bytes))``: the CRC32 and the
            length of the concatenation of each tensor's parts, when the caller computed them
            already (the fast path does, while the data is in cache); combined, not recomputed.
        source_tokens: per layer the original token count, for a token-selecting policy
            (``shapes`` then hold the kept counts); ``None`` otherwise (no selection block).
        masks: per layer the kept-token bitmask (:func:`mask_nbytes` bytes each), with
            ``source_tokens``.

    Returns:
        The stream bytes.

    Raises:
        ValueError: an unknown ``dtype``, sections not ``(K parts, V parts)`` of odd length per
            layer, or ``source_tokens`` and ``masks`` that do not go together.
    """
    if len(shapes) != len(sections) or any(
        len(pair) != 2 or any(len(parts) % 2 != 1 for parts in pair) for pair in sections
    ):
        raise ValueError("need per layer (K parts, V parts), each [state, meta_0, payload_0, ...]")
    lengths = [[[len(b) for b in parts] for parts in pair] for pair in sections]
    head = stream_head(policy=policy, policy_id=policy_id, layer_offset=layer_offset, dtype=dtype, shapes=shapes,
                       lengths=lengths, source_tokens=source_tokens, masks=masks)
    parts = [head, *(b for pair in sections for tensor in pair for b in tensor)]
    tail = list(masks or ())
    if crcs is None:
        crc = 0
        for p in parts + tail:
            crc = crc32_threaded(p, crc)
    else:
        crc = crc32_threaded(head)
        for pair in crcs:
            for tensor_crc, nbytes in pair:
                crc = crc32_combine(crc, tensor_crc, nbytes)
        for m in tail:
            crc = crc32_threaded(m, crc)
    return b"".join(parts + tail + [_CRC.pack(crc)])


def write_stream_in_place(
    *,
    head: bytes,
    nbytes: int,
    write_sections: Callable[[np.ndarray], int],
    masks: Sequence[bytes] | None = None,
) -> bytes:
    """:func:`write_stream` for a producer that writes the sections where they end up
    (:func:`kvtune.codecs.newbytes.filled_bytes`: the stream is never copied).

    Args:
        head: the stream's prefix, header and header checksum (:func:`stream_head`, whose
            ``lengths`` add up to ``nbytes`` and whose ``source_tokens`` go with ``masks``).
        nbytes: bytes of all the sections.
        write_sections: called once with a writable uint8 array of ``nbytes`` bytes (valid only
            during the call); writes every section in wire order and returns the CRC-32 of them
            all.
        masks: as :func:`write_stream`.

    Returns:
        The stream bytes, as :func:`write_stream` would assemble them from the same sections.

    Raises:
        Whatever ``write_sections`` raises.
    """
    tail = list(masks or ())
    start, end = len(head), len(head) + nbytes

    def fill(buf: np.ndarray) -> None:
        buf[:start] = np.frombuffer(head, np.uint8)
        crc = crc32_combine(crc32_threaded(head), write_sections(buf[start:end]), nbytes)
        pos = end
        for m in tail:
            buf[pos : pos + len(m)] = np.frombuffer(m, np.uint8)
            crc = crc32_threaded(m, crc)
            pos += len(m)
        buf[pos:] = np.frombuffer(_CRC.pack(crc), np.uint8)

    return filled_bytes(end + sum(map(len, tail)) + _CRC.size, fill)


def stream_head(
    *,
    policy: dict[str, Any],
    policy_id: str,
    layer_offset: int,
    dtype: str,
    shapes: Sequence[tuple[Sequence[int], Sequence[int]]],
    lengths: Sequence[Sequence[Sequence[int]]],
    source_tokens: Sequence[int] | None = None,
    masks: Sequence[bytes] | None = None,
) -> bytes:
    """The prefix, JSON header and header checksum of a stream (everything before its
    sections). Arguments as :func:`write_stream`, but ``lengths``: per layer ``(K lengths, V
    lengths)``, each ``[state, meta_0, payload_0, ...]`` (byte lengths); ``masks`` are only
    checked here.

    Raises:
        ValueError: an unknown ``dtype``, or ``source_tokens`` and ``masks`` that do not go
            together (one bitmask of :func:`mask_nbytes` bytes per layer, or neither).
    """
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    if (source_tokens is None) != (masks is None) or (masks is not None and not (
            len(masks) == len(source_tokens) == len(shapes)
            and all(len(m) == mask_nbytes(k, t) for m, (k, _), t in zip(masks, shapes, source_tokens)))):
        raise ValueError("need source_tokens and one bitmask of batch x kv_heads x ceil(tokens / 8) bytes per layer, or neither")
    header = {
        "policy": policy,
        "policy_id": policy_id,
        "layer_offset": int(layer_offset),
        "dtype": dtype,
        "shapes": [[list(map(int, k)), list(map(int, v))] for k, v in shapes],
        "sections": [[[int(n) for n in x] for x in pair] for pair in lengths],
    }
    if source_tokens is not None:
        header["source_tokens"] = [int(t) for t in source_tokens]
    hjson = canonical_json(header).encode("ascii")
    head = _PREFIX.pack(MAGIC, FORMAT_VERSION, len(hjson)) + hjson
    return head + _header_digest(head)


def _bad(msg: str) -> CorruptStreamError:
    return CorruptStreamError(f"corrupt KV stream: {msg}")


def shape_problem(shape: Any) -> str | None:
    """Why ``shape`` cannot be the shape of a K or V tensor in a stream, or ``None`` if it can.

    A shape is four ints ``(batch, kv_heads, tokens, head_dim)`` with ``batch``, ``kv_heads``
    and ``head_dim`` in ``1..MAX_DIM``, ``tokens`` in ``0..MAX_DIM`` (an empty cache has no
    tokens; a tensor without heads or channels is no KV cache) and at most
    :data:`MAX_TENSOR_ELEMENTS` elements. The encoder refuses other shapes and the decoder
    treats them as corruption (:func:`kvtune.codecs.policy.check_claimed_sizes`), so both
    apply this one rule.
    """
    if not (isinstance(shape, (list, tuple)) and len(shape) == 4 and all(type(d) is int for d in shape)):
        return "must be 4 integers (batch, kv_heads, tokens, head_dim)"
    for name, d, low in zip(("batch", "kv_heads", "tokens", "head_dim"), shape, (1, 1, 0, 1)):
        if not low <= d <= MAX_DIM:
            return f"has {name} = {d}; allowed: {low}..{MAX_DIM}"
    if math.prod(shape) > MAX_TENSOR_ELEMENTS:
        return f"has {math.prod(shape)} elements; at most {MAX_TENSOR_ELEMENTS} per tensor"
    return None


def _shape(x: Any) -> tuple[int, ...]:
    """Four non-negative ints; their limits (:func:`shape_problem`) are checked by the decoder
    after the section lengths, which refuse most impossible shapes more precisely."""
    if not (isinstance(x, list) and len(x) == 4 and all(type(d) is int and d >= 0 for d in x)):
        raise _bad(f"bad tensor shape {_clip(x)} in header")
    return tuple(x)


def _clip(x: Any, limit: int = 80) -> str:
    """``repr(x)`` cut to ``limit`` characters (forged headers may hold huge values)."""
    try:
        text = canonical_json(x)
    except ValueError:  # NaN / inf
        text = "a non-finite number"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _nesting_depth(text: bytes) -> int:
    """Deepest ``[`` / ``{`` nesting of JSON ``text``, brackets inside strings not counted.

    Linear time without recursion (the json module recurses once per level, so a deep enough
    text raises ``RecursionError`` there), in chunks of :data:`_DEPTH_CHUNK` bytes: a quote
    opens or closes a string unless an odd number of backslashes precedes it.
    """
    depth = deepest = 0
    in_string, backslashes = 0, 0  # carried across chunks: inside a string; trailing backslash run
    for start in range(0, len(text), _DEPTH_CHUNK):
        c = np.frombuffer(text, np.uint8, count=min(_DEPTH_CHUNK, len(text) - start), offset=start)
        idx = np.arange(len(c))
        last_plain = np.maximum.accumulate(np.where(c != ord("\\"), idx, -1 - backslashes))
        run_before = idx - 1 - np.concatenate(([-1 - backslashes], last_plain[:-1]))
        quote = (c == ord('"')) & (run_before % 2 == 0)
        inside = (np.cumsum(quote) - quote + in_string) % 2
        levels = np.cumsum(_DEPTH_STEP[c] * (inside == 0), dtype=np.int64) + depth
        deepest, depth = max(deepest, int(levels.max())), int(levels[-1])
        in_string = (in_string + int(quote.sum())) % 2
        backslashes = len(c) - 1 - int(last_plain[-1])
    return deepest


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not allowed")


def _is_int(x: Any, low: int, high: int) -> bool:
    return type(x) is int and low <= x <= high


def _parse_header(hjson: bytes, header_nbytes: int, version: int) -> StreamHeader:
    depth = _nesting_depth(hjson)
    if depth > MAX_HEADER_DEPTH:
        raise _bad(f"header JSON nests {depth} levels deep; at most {MAX_HEADER_DEPTH}")
    try:
        h = json.loads(hjson.decode("ascii"), parse_constant=_reject_constant)
        canonical = canonical_json(h).encode("ascii") == hjson
    except (UnicodeDecodeError, ValueError) as exc:
        raise _bad(f"header is not valid JSON ({str(exc)[:200]})") from None
    if not canonical:  # also rules out duplicate keys, whitespace, non-canonical numbers
        raise _bad("header is not canonical JSON (sorted keys, no whitespace), as every encoder writes it")
    keys = {"policy", "policy_id", "layer_offset", "dtype", "shapes", "sections"}
    if not isinstance(h, dict) or set(h) - {"source_tokens"} != keys:
        raise _bad(f"header keys must be {sorted(keys)} (and 'source_tokens' with token selection)")
    if not isinstance(h["policy"], dict):
        raise _bad("bad policy in header")
    if not (isinstance(h["policy_id"], str) and _POLICY_ID.fullmatch(h["policy_id"])):
        raise _bad(f"bad policy_id {_clip(h['policy_id'])} (12 hex digits)")
    if not isinstance(h["dtype"], str) or h["dtype"] not in DTYPES:
        raise _bad(f"unknown dtype {_clip(h['dtype'])} (known: {', '.join(DTYPES)})")
    shapes, sections = h["shapes"], h["sections"]
    if not (isinstance(shapes, list) and isinstance(sections, list) and len(shapes) == len(sections)):
        raise _bad("'shapes' and 'sections' must be lists of equal length")
    if not _is_int(h["layer_offset"], 0, MAX_DIM - max(len(shapes) - 1, 0)):
        raise _bad(f"bad layer_offset {_clip(h['layer_offset'])} for {len(shapes)} layers (layers 0..{MAX_DIM})")
    out_shapes = []
    for pair in shapes:
        if not (isinstance(pair, list) and len(pair) == 2):
            raise _bad(f"bad per-layer shapes {_clip(pair)}")
        out_shapes.append((_shape(pair[0]), _shape(pair[1])))
    out_sections = []
    for pair in sections:
        if not (
            isinstance(pair, list)
            and len(pair) == 2
            and all(
                isinstance(lengths, list) and len(lengths) % 2 == 1 and all(type(n) is int and n >= 0 for n in lengths)
                for lengths in pair
            )
        ):
            raise _bad(f"bad section lengths {_clip(pair)}")
        out_sections.append((TensorSections.from_flat(pair[0]), TensorSections.from_flat(pair[1])))
    source_tokens = _source_tokens(h.get("source_tokens"), out_shapes) if "source_tokens" in h else None
    return StreamHeader(
        version=version,
        policy=h["policy"],
        policy_id=h["policy_id"],
        layer_offset=h["layer_offset"],
        dtype=h["dtype"],
        shapes=tuple(out_shapes),
        sections=tuple(out_sections),  # type: ignore[arg-type]
        header_nbytes=header_nbytes,
        source_tokens=source_tokens,
        text=hjson,
    )


_HEADER_CACHE = 64
"""Parsed headers kept by :func:`_parsed_header` (most recently used first)."""


@functools.lru_cache(maxsize=_HEADER_CACHE)
def _parse_header_cached(hjson: bytes, header_nbytes: int, version: int) -> tuple[StreamHeader, str]:
    header = _parse_header(hjson, header_nbytes, version)
    return header, canonical_json(header.policy)


def _parsed_header(hjson: bytes, header_nbytes: int, version: int) -> StreamHeader:
    """:func:`_parse_header`, remembered for the last :data:`_HEADER_CACHE` distinct header
    texts: streams of one policy and one shape (a serving engine's fixed-size KV chunks) repeat
    their header byte for byte, and its checks and parse cost ~0.2 ms, about 7 % of decoding a
    1024-token ``kivi-2`` stream of the default model. A header is a pure function of its bytes;
    the parse is only ever reused for the very same bytes (which passed the header digest), and
    each call gets its own ``policy`` dict (the cached header stays untouched). A malformed header
    raises every time (exceptions are not cached)."""
    header, policy_json = _parse_header_cached(hjson, header_nbytes, version)
    return dataclasses.replace(header, policy=json.loads(policy_json))


def _source_tokens(x: Any, shapes: list[tuple[tuple[int, ...], tuple[int, ...]]]) -> tuple[int, ...]:
    """The header's ``source_tokens``: one int per layer in ``0..MAX_DIM``, not fewer than the
    layer's kept tokens, whose K and V agree in batch, heads and tokens (they share a selection)."""
    if not (isinstance(x, list) and len(x) == len(shapes) and all(_is_int(t, 0, MAX_DIM) for t in x)):
        raise _bad(f"bad source_tokens {_clip(x)} (one token count per layer)")
    for i, ((k, v), t) in enumerate(zip(shapes, x)):
        if k[:3] != v[:3] or k[2] > t:
            raise _bad(f"layer {i} of a token-selected stream: K {list(k)} and V {list(v)} must agree in batch, "
                       f"heads and tokens, at most the {t} source tokens")
    return tuple(x)


def byte_view(data: bytes | bytearray | memoryview) -> memoryview:
    """A flat unsigned-byte view of received data (no copy): anything with the buffer protocol
    (bytes, bytearray, memoryview, a numpy array), C-contiguous; a multi-byte view is read as
    its bytes.

    Raises:
        KVStreamError: ``data`` is not bytes-like (e.g. a ``str`` or None) or not contiguous.
    """
    try:
        mv = memoryview(data)
    except TypeError:
        raise KVStreamError(f"a KV stream must be bytes-like (bytes, bytearray, memoryview), got {type(data).__name__}") from None
    if not mv.c_contiguous:
        raise KVStreamError("a KV stream must be a contiguous buffer, got a strided memoryview (copy it with bytes())")
    return mv.cast("B")


def read_stream(
    data: bytes | bytearray | memoryview, *, expect_policy_id: str | None = None, verify_checksum: bool = True
) -> tuple[StreamHeader, list[tuple[TensorSections, TensorSections]]]:
    """Validate a stream and split it into its header and per-layer sections.

    Args:
        data: the stream bytes.
        expect_policy_id: when given, the policy id the caller expects.
        verify_checksum: check the final CRC-32 here (a pass over the whole stream). ``False``
            leaves it to the caller, who must call :func:`check_checksum` (or compare
            :func:`stream_checksum` with a CRC it computed while reading the sections) before
            trusting any section, and on any error found first: the fast decode path computes
            each tensor's CRC while its bytes are in cache.

    Returns:
        ``(header, sections)``; ``sections[i]`` is ``(K, V)`` :class:`TensorSections` of
        zero-copy memoryviews into ``data``.

    Raises:
        TruncatedStreamError: the stream is shorter than its prefix, header or recorded
            section lengths.
        CorruptStreamError: bad magic, header or final checksum mismatch, malformed header
            (too deeply nested, not canonical JSON, wrong keys or types, out-of-range
            ``layer_offset``), trailing bytes.
        StreamVersionError: the format version is not one this kvtune reads.
        PolicyMismatchError: ``expect_policy_id`` differs from the stream's policy id.
        KVStreamError: ``data`` is not a contiguous bytes-like buffer (:func:`byte_view`).
    """
    mv = byte_view(data)
    header = _checked_header(mv, expect_policy_id, verify_checksum)
    return header, section_views(mv, header)


def _checked_header(mv: memoryview, expect_policy_id: str | None, verify_checksum: bool) -> StreamHeader:
    """Every check of :func:`read_stream` on the flat byte view ``mv``; the header."""
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
    header = _parsed_header(bytes(mv[_PREFIX.size : hend]), header_nbytes, version)
    total = header.total_nbytes
    if n < total:
        raise TruncatedStreamError(f"KV stream truncated: {n} bytes, header and section lengths say {total}")
    if n > total:
        raise _bad(f"{n - total} unexpected bytes after the end of the stream ({total} bytes)")
    if verify_checksum:
        check_checksum(mv, header)
    if expect_policy_id is not None and header.policy_id != expect_policy_id:
        raise PolicyMismatchError(
            f"KV stream was encoded with policy {header.policy_id}, caller expects {expect_policy_id}"
        )
    return header


def section_views(data: bytes | bytearray | memoryview, header: StreamHeader) -> list[tuple[TensorSections, TensorSections]]:
    """The sections of a stream that :func:`read_stream` / :func:`read_header` accepted with
    ``header``: per layer ``(K, V)`` :class:`TensorSections` of zero-copy memoryviews into ``data``.

    Raises:
        TruncatedStreamError: ``data`` is shorter than ``header`` says (another stream's header).
    """
    mv = byte_view(data)
    if len(mv) < header.total_nbytes:
        raise TruncatedStreamError(f"KV stream truncated: {len(mv)} bytes, header and section lengths say "
                                   f"{header.total_nbytes}")
    sections = []
    pos = header.header_nbytes
    for pair in header.sections:
        tensors = []
        for lengths in pair:
            views = []
            for length in lengths.flat():
                views.append(mv[pos : pos + length])
                pos += length
            tensors.append(TensorSections.from_flat(views))
        sections.append((tensors[0], tensors[1]))
    return sections


def stream_checksum(data: bytes | bytearray | memoryview, header: StreamHeader) -> int:
    """The final CRC-32 recorded in a stream that :func:`read_stream` accepted with ``header``
    (its last 4 bytes, little-endian): ``zlib.crc32`` of every byte before them.

    Raises:
        TruncatedStreamError: ``data`` is shorter than ``header`` says.
    """
    mv = byte_view(data)
    if len(mv) < header.total_nbytes:  # another stream's header
        raise TruncatedStreamError(f"KV stream truncated: {len(mv)} bytes, header and section lengths say "
                                   f"{header.total_nbytes}")
    return _CRC.unpack_from(mv, header.total_nbytes - _CRC.size)[0]


def check_checksum(data: bytes | bytearray | memoryview, header: StreamHeader, crc: int | None = None) -> None:
    """Refuse a stream whose final CRC-32 does not match its bytes: ``crc`` (the CRC of every
    byte before the final checksum, computed by the caller) or, when ``None``, computed here
    (:func:`kvtune.codecs.checksum.crc32_threaded`).

    Raises:
        CorruptStreamError: ``corrupt KV stream: checksum mismatch``.
        TruncatedStreamError: ``data`` is shorter than ``header`` says (a header of another stream).
    """
    mv = byte_view(data)
    expected = stream_checksum(mv, header)
    if crc is None:
        crc = crc32_threaded(mv[: header.total_nbytes - _CRC.size])
    if crc != expected:
        raise _bad("checksum mismatch")


def selection_views(data: bytes | bytearray | memoryview, header: StreamHeader) -> list[memoryview]:
    """Per layer the kept-token bitmask of a stream that :func:`read_stream` accepted with
    ``header`` (zero-copy views; an empty list without token selection)."""
    if header.source_tokens is None:
        return []
    mv = byte_view(data)
    pos = header.total_nbytes - header.checksum_nbytes - header.selection_nbytes
    out = []
    for (kshape, _), tokens in zip(header.shapes, header.source_tokens):
        n = mask_nbytes(kshape, tokens)
        out.append(mv[pos : pos + n])
        pos += n
    return out


def read_header(data: bytes | bytearray | memoryview, *, verify_checksum: bool = True) -> StreamHeader:
    """Validate a stream (all checks of :func:`read_stream`, ``verify_checksum`` as there) and
    return its header, without the section views (:func:`section_views`).

    Useful for byte accounting: ``len(data) == h.header_nbytes + h.state_nbytes +
    h.meta_nbytes + h.payload_nbytes + h.checksum_nbytes``.

    Raises:
        As :func:`read_stream`.
    """
    return _checked_header(byte_view(data), None, verify_checksum)
