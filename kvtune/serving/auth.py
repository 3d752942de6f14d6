"""Authentication of KV streams that cross machines: HMAC-SHA256 with a shared key.

A kvtune stream's checksums (BLAKE2b over the header, CRC32 over everything) catch corruption,
not forgery: anyone who edits a stream can recompute them, and the edited stream decodes. When
both sides share a secret key, :func:`seal` appends an HMAC-SHA256 tag (RFC 2104, Python's
:mod:`hmac`) over a framing header and the whole stream, and :func:`unseal` refuses, before
anything is decoded, a frame that is not sealed, is cut short, was edited, or was sealed with
another key. Tags are compared in constant time (:func:`hmac.compare_digest`).

Frame layout (integers little-endian)::

    offset  size  field
    0       4     magic b"KVTA"
    4       2     frame version (u16) = 1
    6       8     key id: the first 8 bytes of SHA-256(key), so a wrong key is named
                  without revealing the key
    14      8     payload length N (u64)
    22      32    tag = HMAC-SHA256(key, bytes [0, 22) + payload)
    54      N     payload (the kvtune stream)

Keys come from the environment (:func:`load_key`): ``KVTUNE_KV_KEY_FILE`` (path of a file whose
bytes are the key) or ``KVTUNE_KV_KEY`` (the key as hex); at least :data:`MIN_KEY_BYTES` bytes,
at most :data:`MAX_KEY_BYTES`. Key bytes never appear in messages, logs or reprs; only the key
id does.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import struct
from pathlib import Path

from kvtune.core.errors import ConfigError, KVStreamError

__all__ = [
    "FRAME_MAGIC",
    "FRAME_VERSION",
    "KEY_ENV",
    "KEY_FILE_ENV",
    "MAX_KEY_BYTES",
    "MIN_KEY_BYTES",
    "OVERHEAD",
    "AuthenticationError",
    "KeyConfigError",
    "is_sealed",
    "key_id",
    "load_key",
    "seal",
    "unseal",
]

FRAME_MAGIC = b"KVTA"
FRAME_VERSION = 1
KEY_FILE_ENV = "KVTUNE_KV_KEY_FILE"
KEY_ENV = "KVTUNE_KV_KEY"
MIN_KEY_BYTES = 16
"""Shortest key accepted (128 bits)."""
MAX_KEY_BYTES = 4096
"""Longest key accepted; a key file is not read beyond this."""
_HEAD = struct.Struct("<4sH8sQ")
_TAG_BYTES = hashlib.sha256().digest_size
OVERHEAD = _HEAD.size + _TAG_BYTES
"""Bytes a sealed frame adds to its payload (54)."""


class AuthenticationError(KVStreamError):
    """A stream that must be authenticated is not: not a sealed frame, truncated, edited, or
    sealed with another key. Nothing of it is decoded."""


class KeyConfigError(ConfigError):
    """The stream key cannot be used: an unreadable, empty, too short or too long key file,
    a ``KVTUNE_KV_KEY`` that is not hex, or both variables set."""


def _checked_key(key: bytes | bytearray) -> bytes:
    if not isinstance(key, (bytes, bytearray)):
        raise KeyConfigError(f"the stream key must be bytes, got {type(key).__name__}")
    if not MIN_KEY_BYTES <= len(key) <= MAX_KEY_BYTES:
        raise KeyConfigError(f"the stream key has {len(key)} bytes; use {MIN_KEY_BYTES} to {MAX_KEY_BYTES}")
    return bytes(key)


def key_id(key: bytes | bytearray) -> bytes:
    """The 8-byte public id of a key: the first 8 bytes of its SHA-256.

    Raises:
        KeyConfigError: not bytes, or a length outside ``[MIN_KEY_BYTES, MAX_KEY_BYTES]``.
    """
    return hashlib.sha256(_checked_key(key)).digest()[:8]


def seal(stream: bytes | bytearray | memoryview, key: bytes | bytearray) -> bytes:
    """Frame ``stream`` with the key id and its HMAC-SHA256 tag (layout in the module docstring).

    Args:
        stream: the payload (any bytes; normally a kvtune stream).
        key: the shared key.

    Returns:
        ``len(stream) + OVERHEAD`` bytes.

    Raises:
        KeyConfigError: an unusable key.
    """
    k = _checked_key(key)
    head = _HEAD.pack(FRAME_MAGIC, FRAME_VERSION, hashlib.sha256(k).digest()[:8], len(stream))
    mac = hmac.new(k, head, hashlib.sha256)
    mac.update(stream)
    return b"".join((head, mac.digest(), stream))


def is_sealed(data: bytes | bytearray | memoryview) -> bool:
    """True when ``data`` starts like a sealed frame (magic only; proves nothing)."""
    return bytes(memoryview(data)[: len(FRAME_MAGIC)]) == FRAME_MAGIC


def unseal(data: bytes | bytearray | memoryview, key: bytes | bytearray) -> memoryview:
    """Check a sealed frame and return its payload (a zero-copy view into ``data``).

    Args:
        data: the received frame.
        key: the shared key.

    Returns:
        The payload, only when the tag verifies.

    Raises:
        AuthenticationError: not a sealed frame (e.g. a bare kvtune stream), another frame
            version, a key id other than this key's (both ids are named), a length that
            disagrees with the frame (truncated or padded), or a tag mismatch (edited).
        KeyConfigError: an unusable key.
    """
    k = _checked_key(key)
    mv = memoryview(data).cast("B")
    if len(mv) < _HEAD.size + _TAG_BYTES:
        if is_sealed(mv):
            raise AuthenticationError(f"sealed KV stream truncated: {len(mv)} bytes, the frame header alone needs {OVERHEAD}")
        raise AuthenticationError("KV stream is not sealed (no authentication frame); refusing it")
    magic, version, kid, length = _HEAD.unpack_from(mv, 0)
    if magic != FRAME_MAGIC:
        raise AuthenticationError("KV stream is not sealed (no authentication frame); refusing it")
    if version != FRAME_VERSION:
        raise AuthenticationError(f"sealed KV stream has frame version {version}; this kvtune reads {FRAME_VERSION}")
    mine = hashlib.sha256(k).digest()[:8]
    if kid != mine:
        raise AuthenticationError(f"KV stream sealed with key id {kid.hex()}, this side's key id is {mine.hex()}")
    body = len(mv) - OVERHEAD
    if body != length:
        what = "truncated" if body < length else "longer than its frame"
        raise AuthenticationError(f"sealed KV stream {what}: {body} payload bytes, the frame says {length}")
    mac = hmac.new(k, mv[: _HEAD.size], hashlib.sha256)
    mac.update(mv[OVERHEAD:])
    if not hmac.compare_digest(mac.digest(), bytes(mv[_HEAD.size : OVERHEAD])):
        raise AuthenticationError("KV stream authentication failed: tag mismatch (the stream was altered)")
    return mv[OVERHEAD:]


def _key_from_file(path_text: str) -> bytes:
    path = Path(path_text).expanduser()
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_KEY_BYTES + 1)  # bounded: never read a large file whole
    except OSError as exc:
        raise KeyConfigError(f"{KEY_FILE_ENV}={path}: cannot read the key file ({exc.strerror or type(exc).__name__})") from None
    if len(raw) > MAX_KEY_BYTES:
        raise KeyConfigError(f"{KEY_FILE_ENV}={path}: the key file is larger than {MAX_KEY_BYTES} bytes")
    if len(raw) < MIN_KEY_BYTES:
        raise KeyConfigError(f"{KEY_FILE_ENV}={path}: the key file has {len(raw)} bytes; a key needs at least {MIN_KEY_BYTES}")
    return raw


def load_key() -> bytes | None:
    """The stream key from the environment, or None when none is configured.

    ``KVTUNE_KV_KEY_FILE``: path of a file whose bytes (all of them, as-is, newline included)
    are the key. ``KVTUNE_KV_KEY``: the key as hex digits. Setting both, or setting one to an
    empty string, is an error (a misconfigured key must not silently disable authentication).

    Raises:
        KeyConfigError: see above, and keys outside ``[MIN_KEY_BYTES, MAX_KEY_BYTES]``. The
            message never contains key material.
    """
    path, text = os.environ.get(KEY_FILE_ENV), os.environ.get(KEY_ENV)
    if path is not None and text is not None:
        raise KeyConfigError(f"both {KEY_FILE_ENV} and {KEY_ENV} are set; set one")
    if path is not None:
        if not path:
            raise KeyConfigError(f"{KEY_FILE_ENV} is set but empty")
        return _key_from_file(path)
    if text is None:
        return None
    try:
        key = bytes.fromhex(text.strip())
    except ValueError:
        raise KeyConfigError(f"{KEY_ENV} is not a hex string ({len(text)} characters)") from None
    if not MIN_KEY_BYTES <= len(key) <= MAX_KEY_BYTES:
        raise KeyConfigError(f"{KEY_ENV} decodes to {len(key)} bytes; use {MIN_KEY_BYTES} to {MAX_KEY_BYTES}")
    return key
