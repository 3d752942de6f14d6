"""Moving KV streams between serving instances: length-prefixed TCP frames and a directory store.

The transport of kvtune's disaggregated-serving connector (:mod:`kvtune.serving.vllm`): the
prefill instance sends each request's encoded KV stream to the decode instance over one TCP
connection (:class:`FrameClient` -> :class:`FrameServer`), or parks it in a pool of streams
(:class:`KVStore`, a directory; :class:`RemoteStore`, the same served over TCP by a
:class:`FrameServer`: the "KV parked in a remote pool" case of KVServe, "KVServe:
Service-Aware KV Cache Compression for Communication-Efficient Disaggregated LLM Serving",
arXiv 2605.13734, sec. 2). The transport moves opaque bytes; integrity of the KV itself is the
stream's CRC (:mod:`kvtune.codecs.stream`) and, with a shared key, its seal.

Frame layout (all integers little-endian)::

    offset  size  field
    0       4     magic b"KVTF"
    4       1     frame version = 1
    5       1     kind: 1 DATA (key + stream), 2 ACK (key), 3 NACK (key + UTF-8 reason),
                  4 GET (key), 5 HAS (key)
    6       2     key length K (u16), 1..MAX_KEY_BYTES, ASCII
    8       8     payload length N (u64), at most the receiver's ``max_frame_bytes``
    16      K     key (the request / prefix key, :data:`KEY_PATTERN`)
    16+K    N     payload

Every DATA frame is answered by an ACK once the receiver has stored the payload, or by a NACK
naming why it refused it; the sender's :meth:`FrameClient.send` returns only after the ACK, so
a sent stream is at the receiver when it returns. GET is answered by a DATA frame with the
stored stream or a NACK; HAS by an ACK (stored) or a NACK (not stored).

Run ``python -m kvtune.serving.transport DIR --host H --port P`` to serve the directory ``DIR``
as a pool (the consumer's ``store_path`` is then ``tcp://H:P``). A receiver checks magic, version, kind and
both lengths before it allocates anything for the payload; a connection closed or stalled
mid-frame (longer than ``timeout_s`` without progress) is a :class:`TransferInterruptedError`
and the partial frame is dropped.
"""

from __future__ import annotations

import logging
import os
import re
import select
import socket
import struct
import tempfile
import threading
from pathlib import Path
from typing import NamedTuple

from kvtune.core.atomic import atomic_write_bytes
from kvtune.core.errors import KvtuneError

__all__ = [
    "FRAME_MAGIC",
    "FRAME_VERSION",
    "FRAME_HEADER",
    "KIND_DATA",
    "KIND_ACK",
    "KIND_NACK",
    "KIND_GET",
    "KIND_HAS",
    "KEY_PATTERN",
    "MAX_KEY_BYTES",
    "DEFAULT_MAX_FRAME_BYTES",
    "TransportError",
    "FrameError",
    "TransferInterruptedError",
    "TransferRejectedError",
    "PrefixNotFoundError",
    "Frame",
    "check_key",
    "frame_header",
    "parse_frame_header",
    "read_frame",
    "write_frame",
    "FrameClient",
    "FrameServer",
    "KVStore",
    "RemoteStore",
    "open_store",
]

logger = logging.getLogger(__name__)

FRAME_MAGIC = b"KVTF"
FRAME_VERSION = 1
FRAME_HEADER = struct.Struct("<4sBBHQ")
"""magic, version, kind, key length, payload length: 16 bytes."""
KIND_DATA = 1
KIND_ACK = 2
KIND_NACK = 3
KIND_GET = 4
KIND_HAS = 5
_KINDS = (KIND_DATA, KIND_ACK, KIND_NACK, KIND_GET, KIND_HAS)
MAX_KEY_BYTES = 128
KEY_PATTERN = re.compile(r"^[0-9a-f]{16,128}$")
"""Keys are lowercase hex digests (:func:`kvtune.serving.vllm.prefix_key`): safe as file names."""
DEFAULT_MAX_FRAME_BYTES = 1 << 30
"""Largest payload a receiver accepts by default (1 GiB): the bf16 KV of ~40k tokens of
SmolLM2-135M, uncompressed."""
MAX_NACK_BYTES = 4096
_RECV_CHUNK = 1 << 20
_FIRST_PAYLOAD = 1 << 20  # a payload's first buffer; it doubles as bytes arrive (_recv_payload)


class TransportError(KvtuneError):
    """A KV stream could not be moved between instances (the request is recomputed)."""


class FrameError(TransportError):
    """A frame header is malformed: wrong magic or version, unknown kind, a key that is not a
    hex digest, or a payload longer than the receiver accepts."""


class TransferInterruptedError(TransportError):
    """The connection closed, failed or stalled past the timeout in the middle of a frame."""


class TransferRejectedError(TransportError):
    """The receiver answered a DATA frame with a NACK (its reason is in the message)."""


class PrefixNotFoundError(TransportError):
    """The store holds no KV stream under the requested key."""


class Frame(NamedTuple):
    """One received frame: ``kind`` (:data:`KIND_DATA` ...), ``key`` (str), ``payload``
    (bytearray; empty for ACK)."""

    kind: int
    key: str
    payload: bytearray


def check_key(key: str) -> str:
    """Return ``key`` if it is a valid frame / store key (:data:`KEY_PATTERN`), else raise
    :class:`FrameError` naming it."""
    if not isinstance(key, str) or not KEY_PATTERN.match(key):
        raise FrameError(f"KV key must be 16-128 lowercase hex digits, got {str(key)[:80]!r}")
    return key


def frame_header(kind: int, key: str, payload_nbytes: int) -> bytes:
    """The 16-byte frame header plus the key, for a payload of ``payload_nbytes`` bytes.

    Raises:
        FrameError: unknown ``kind``, invalid ``key`` or negative length.
    """
    if kind not in _KINDS:
        raise FrameError(f"unknown frame kind {kind}")
    kb = check_key(key).encode("ascii")
    if payload_nbytes < 0:
        raise FrameError(f"payload length must be >= 0, got {payload_nbytes}")
    return FRAME_HEADER.pack(FRAME_MAGIC, FRAME_VERSION, kind, len(kb), payload_nbytes) + kb


def parse_frame_header(raw: bytes, max_frame_bytes: int) -> tuple[int, int, int]:
    """Check a 16-byte frame header; return ``(kind, key_nbytes, payload_nbytes)``.

    Raises:
        FrameError: wrong magic or version, unknown kind, key length outside
            ``1..MAX_KEY_BYTES``, payload longer than ``max_frame_bytes`` (or a NACK reason
            longer than :data:`MAX_NACK_BYTES`).
    """
    magic, version, kind, key_n, payload_n = FRAME_HEADER.unpack(raw)
    if magic != FRAME_MAGIC:
        raise FrameError(f"not a kvtune frame: magic {magic!r}, expected {FRAME_MAGIC!r}")
    if version != FRAME_VERSION:
        raise FrameError(f"frame version {version} is not supported (this kvtune reads {FRAME_VERSION})")
    if kind not in _KINDS:
        raise FrameError(f"unknown frame kind {kind}")
    if not 1 <= key_n <= MAX_KEY_BYTES:
        raise FrameError(f"frame key length {key_n} outside 1..{MAX_KEY_BYTES}")
    limit = max_frame_bytes if kind == KIND_DATA else (MAX_NACK_BYTES if kind == KIND_NACK else 0)
    if payload_n > limit:
        raise FrameError(f"frame payload of {payload_n} bytes exceeds the limit of {limit} bytes")
    return kind, key_n, payload_n


def _recv_into(sock: socket.socket, view: memoryview, what: str, before: int = 0, total: int | None = None) -> None:
    """Fill ``view`` from ``sock``; errors count ``before`` bytes received earlier of ``total``."""
    got, total = 0, len(view) if total is None else total
    while got < len(view):
        try:
            n = sock.recv_into(view[got:], min(len(view) - got, _RECV_CHUNK))
        except socket.timeout:
            raise TransferInterruptedError(f"{what}: timed out after {before + got} of {total} bytes") from None
        except OSError as exc:
            raise TransferInterruptedError(
                f"{what}: connection failed after {before + got} of {total} bytes: {exc}") from None
        if n == 0:
            raise TransferInterruptedError(f"{what}: connection closed after {before + got} of {total} bytes")
        got += n


def _recv_payload(sock: socket.socket, n: int, what: str) -> bytearray:
    """``n`` bytes from ``sock`` in a buffer that grows as they arrive (from 1 MiB, doubling):
    a peer that announces a large frame and sends little of it holds little memory, where a
    buffer of the announced size would pin all of it per connection until the timeout."""
    buf = bytearray(min(n, _FIRST_PAYLOAD))
    got = 0
    while True:
        _recv_into(sock, memoryview(buf)[got:], what, got, n)
        got = len(buf)
        if got == n:
            return buf
        buf.extend(bytes(min(n, 2 * got) - got))  # realloc: large blocks grow in place (mremap)


def read_frame(sock: socket.socket, *, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
               timeout_s: float = 30.0, idle_timeout_s: float | None = None) -> Frame | None:
    """Read one frame from ``sock``; ``None`` when the peer closed cleanly between frames.

    Args:
        sock: a connected TCP socket.
        max_frame_bytes: largest DATA payload accepted; checked before anything is allocated. The
            payload's buffer grows as its bytes arrive (at most twice what was received).
        timeout_s: seconds without progress allowed once a frame has started.
        idle_timeout_s: seconds to wait for the first byte of a frame (None: forever).

    Returns:
        The :class:`Frame`, or None when the connection ended between frames (closed or reset).

    Raises:
        FrameError: a malformed header (see :func:`parse_frame_header`) or key.
        TransferInterruptedError: the connection closed, failed or stalled inside a frame.
    """
    head = bytearray(FRAME_HEADER.size)
    view = memoryview(head)
    sock.settimeout(idle_timeout_s)
    try:
        first = sock.recv_into(view, len(view))
    except socket.timeout:
        raise TransferInterruptedError(f"no frame within the idle timeout of {idle_timeout_s} s") from None
    except ConnectionResetError:
        return None  # the peer went away between frames: nothing was lost
    except OSError as exc:
        raise TransferInterruptedError(f"connection failed while waiting for a frame: {exc}") from None
    if first == 0:
        return None
    sock.settimeout(timeout_s)
    _recv_into(sock, view[first:], "frame header")
    kind, key_n, payload_n = parse_frame_header(bytes(head), max_frame_bytes)
    kb = bytearray(key_n)
    _recv_into(sock, memoryview(kb), "frame key")
    try:
        key = check_key(kb.decode("ascii"))
    except UnicodeDecodeError:
        raise FrameError("frame key is not ASCII") from None
    return Frame(kind, key, _recv_payload(sock, payload_n, f"frame payload of {key}"))


def write_frame(sock: socket.socket, kind: int, key: str, payload: bytes | bytearray | memoryview = b"") -> None:
    """Send one frame (header, key, payload) on ``sock``.

    Raises:
        FrameError: invalid kind or key.
        TransferInterruptedError: the connection failed or timed out while sending.
    """
    head = frame_header(kind, key, len(payload))
    try:
        sock.sendall(head)
        if len(payload):
            sock.sendall(payload)
    except socket.timeout:
        raise TransferInterruptedError(f"sending {key}: timed out") from None
    except OSError as exc:
        raise TransferInterruptedError(f"sending {key}: connection failed: {exc}") from None


class FrameClient:
    """The sending end: one persistent TCP connection to a :class:`FrameServer`.

    Args:
        host, port: the server's address.
        timeout_s: seconds without progress before a request (or its answer) is abandoned.
        connect_timeout_s: seconds allowed to connect.
        max_frame_bytes: largest DATA payload accepted in an answer (:meth:`get`).

    A failed request closes the connection; the next one reconnects. Requests of several
    threads are serialised.
    """

    def __init__(self, host: str, port: int, *, timeout_s: float = 30.0, connect_timeout_s: float = 5.0,
                 max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> None:
        self.host, self.port = str(host), int(port)
        self.timeout_s = float(timeout_s)
        self.connect_timeout_s = float(connect_timeout_s)
        self.max_frame_bytes = int(max_frame_bytes)
        self._sock: socket.socket | None = None
        self._lock = threading.Lock()

    def _connection(self) -> socket.socket:
        sock = self._sock
        if sock is not None:
            readable, _, _ = select.select([sock], [], [], 0)
            if readable:  # the peer closed (or sent junk) while idle: start over
                self.close()
                sock = None
        if sock is None:
            try:
                sock = socket.create_connection((self.host, self.port), timeout=self.connect_timeout_s)
            except OSError as exc:
                raise TransferInterruptedError(f"cannot connect to the KV peer {self.host}:{self.port}: {exc}") from None
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._sock = sock
        sock.settimeout(self.timeout_s)
        return sock

    def request(self, kind: int, key: str, payload: bytes | bytearray | memoryview = b"") -> Frame:
        """Send one frame and return the server's answer (ACK, NACK or DATA) for ``key``.

        Raises:
            FrameError: invalid key, or a malformed answer or one for another key.
            TransferInterruptedError: connection failure or timeout (the connection is closed).
        """
        with self._lock:
            try:
                sock = self._connection()
                write_frame(sock, kind, key, payload)
                answer = read_frame(sock, max_frame_bytes=self.max_frame_bytes, timeout_s=self.timeout_s,
                                    idle_timeout_s=self.timeout_s)
            except TransportError:
                self.close()
                raise
            if answer is None:
                self.close()
                raise TransferInterruptedError(f"{key}: the peer closed the connection before its answer")
            if answer.key != key:
                self.close()
                raise FrameError(f"{key}: the peer answered for {answer.key}")
            return answer

    def send(self, key: str, payload: bytes | bytearray | memoryview) -> None:
        """Send ``payload`` under ``key`` and wait for the receiver's ACK.

        Raises:
            FrameError, TransferInterruptedError: see :meth:`request`.
            TransferRejectedError: the receiver answered with a NACK.
        """
        answer = self.request(KIND_DATA, key, payload)
        if answer.kind == KIND_NACK:
            raise TransferRejectedError(f"the receiver refused {key}: {answer.payload.decode('utf-8', 'replace')}")
        if answer.kind != KIND_ACK:
            self.close()
            raise FrameError(f"sending {key}: expected an ACK, got frame kind {answer.kind}")

    def close(self) -> None:
        """Close the connection (the next request reconnects)."""
        sock, self._sock = self._sock, None
        if sock is not None:
            try:
                sock.close()
            except OSError:
                pass


class FrameServer:
    """The receiving end: serves a :class:`KVStore` over TCP.

    DATA frames are stored (answered ACK, or NACK with the error's text when the store refuses
    them), GET frames answered with the stored stream (or a NACK), HAS frames with ACK / NACK.
    Malformed or interrupted frames are logged (their typed error) and their connection closed;
    the server keeps serving other and later connections.

    Args:
        host, port: address to listen on (port 0: any free port, see :attr:`port`).
        store: where received streams go and requested ones come from.
        max_frame_bytes: largest payload accepted.
        timeout_s: seconds without progress inside a frame before the connection is dropped.
        idle_timeout_s: seconds an idle connection is kept.
    """

    def __init__(self, host: str, port: int, store: "KVStore", *, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
                 timeout_s: float = 30.0, idle_timeout_s: float = 3600.0) -> None:
        self.store = store
        self.max_frame_bytes = int(max_frame_bytes)
        self.timeout_s = float(timeout_s)
        self.idle_timeout_s = float(idle_timeout_s)
        self._listener = socket.create_server((host, int(port)))
        self._listener.settimeout(0.5)
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._accept_loop, name="kvtune-frame-server", daemon=True)
        self._thread.start()

    @property
    def port(self) -> int:
        """The TCP port the server listens on."""
        return int(self._listener.getsockname()[1])

    def _accept_loop(self) -> None:
        while not self._closed.is_set():
            try:
                conn, peer = self._listener.accept()
            except socket.timeout:
                continue
            except OSError:
                break
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            threading.Thread(target=self._serve, args=(conn, peer), name="kvtune-frame-conn", daemon=True).start()

    def _answer(self, frame: Frame, peer) -> tuple[int, bytes | bytearray]:
        try:
            if frame.kind == KIND_DATA:
                self.store.put(frame.key, frame.payload)
                return KIND_ACK, b""
            if frame.kind == KIND_GET:
                return KIND_DATA, self.store.get(frame.key)
            return (KIND_ACK, b"") if self.store.contains(frame.key) else (KIND_NACK, b"not stored")
        except KvtuneError as exc:
            if frame.kind == KIND_DATA:
                logger.warning("kvtune: refused KV stream %s from %s: %s: %s", frame.key, peer, type(exc).__name__, exc)
            return KIND_NACK, f"{type(exc).__name__}: {exc}".encode("utf-8")[:MAX_NACK_BYTES]

    def _serve(self, conn: socket.socket, peer) -> None:
        with conn:
            while not self._closed.is_set():
                try:
                    frame = read_frame(conn, max_frame_bytes=self.max_frame_bytes, timeout_s=self.timeout_s,
                                       idle_timeout_s=self.idle_timeout_s)
                except TransportError as exc:
                    logger.warning("kvtune: dropped a KV frame from %s: %s: %s", peer, type(exc).__name__, exc)
                    return
                if frame is None:
                    return
                if frame.kind not in (KIND_DATA, KIND_GET, KIND_HAS):
                    logger.warning("kvtune: unexpected frame kind %d from %s; closing", frame.kind, peer)
                    return
                kind, payload = self._answer(frame, peer)
                try:
                    conn.settimeout(self.timeout_s)
                    write_frame(conn, kind, frame.key, payload)
                except TransportError as exc:
                    logger.warning("kvtune: could not answer %s: %s", peer, exc)
                    return

    def close(self) -> None:
        """Stop accepting connections (connections in progress end at their next frame)."""
        self._closed.set()
        try:
            self._listener.close()
        except OSError:
            pass
        self._thread.join(timeout=2.0)


class KVStore:
    """KV streams kept as files of one directory, one per key (a local spool or a shared pool).

    Writes are atomic (a reader sees the whole stream or nothing); reads are bounded by
    ``max_entry_bytes`` before anything is allocated. A later :meth:`put` of the same key
    replaces the entry (the key names the prompt prefix, so both hold KV of the same tokens).

    Args:
        root: the directory (created if missing).
        max_entry_bytes: largest entry :meth:`get` reads.
        durable: fsync each entry before it becomes visible (a shared pool); False for a
            local spool that only hands streams from one process to another.
    """

    SUFFIX = ".kvt"

    def __init__(self, root: str | os.PathLike[str], *, max_entry_bytes: int = DEFAULT_MAX_FRAME_BYTES,
                 durable: bool = True) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.max_entry_bytes = int(max_entry_bytes)
        self.durable = bool(durable)

    def path(self, key: str) -> Path:
        """File of ``key`` (:class:`FrameError` for an invalid key)."""
        return self.root / f"{check_key(key)}{self.SUFFIX}"

    def contains(self, key: str) -> bool:
        """Whether an entry for ``key`` exists."""
        return self.path(key).is_file()

    def put(self, key: str, data: bytes | bytearray | memoryview) -> Path:
        """Store ``data`` under ``key`` atomically; returns the file.

        Raises:
            FrameError: invalid key, or ``data`` longer than ``max_entry_bytes``.
        """
        if len(data) > self.max_entry_bytes:
            raise FrameError(f"KV stream {key} of {len(data)} bytes exceeds the store limit of {self.max_entry_bytes}")
        dest = self.path(key)
        if self.durable:
            return atomic_write_bytes(dest, data)
        fd, tmp = tempfile.mkstemp(prefix=f".{dest.name}.", suffix=".tmp", dir=self.root)
        try:
            with os.fdopen(fd, "wb") as fh:
                fh.write(data)
            os.replace(tmp, dest)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        return dest

    def get(self, key: str) -> bytearray:
        """The entry of ``key``.

        Raises:
            PrefixNotFoundError: no entry for ``key``.
            FrameError: invalid key, or an entry larger than ``max_entry_bytes`` (nothing is
                read).
            TransferInterruptedError: the file shrank while it was read.
        """
        p = self.path(key)
        try:
            fh = open(p, "rb")
        except FileNotFoundError:
            raise PrefixNotFoundError(f"no KV stream for {key} in the store {self.root}") from None
        with fh:
            size = os.fstat(fh.fileno()).st_size
            if size > self.max_entry_bytes:
                raise FrameError(f"store entry {p} has {size} bytes, over the limit of {self.max_entry_bytes}")
            buf = bytearray(size)
            got = fh.readinto(buf)
            if got != size:
                raise TransferInterruptedError(f"store entry {p} shrank while read ({got} of {size} bytes)")
        return buf

    def remove(self, key: str) -> None:
        """Delete the entry of ``key`` if present."""
        try:
            self.path(key).unlink()
        except FileNotFoundError:
            pass


class RemoteStore:
    """A :class:`KVStore` served by a :class:`FrameServer` elsewhere, with the same calls.

    Args:
        host, port: the server.
        max_entry_bytes: largest entry :meth:`get` accepts (checked before allocating).
        timeout_s: seconds without progress before a request is abandoned.
    """

    def __init__(self, host: str, port: int, *, max_entry_bytes: int = DEFAULT_MAX_FRAME_BYTES,
                 timeout_s: float = 30.0) -> None:
        self.client = FrameClient(host, port, timeout_s=timeout_s, max_frame_bytes=max_entry_bytes)
        self.root = f"tcp://{host}:{port}"

    def contains(self, key: str) -> bool:
        """Whether the pool holds ``key`` (one round trip; False when the pool is unreachable).

        Raises:
            FrameError: an invalid key.
        """
        try:
            return self.client.request(KIND_HAS, check_key(key)).kind == KIND_ACK
        except TransferInterruptedError as exc:
            logger.warning("kvtune: KV pool %s unreachable: %s", self.root, exc)
            return False

    def get(self, key: str) -> bytearray:
        """The entry of ``key``.

        Raises:
            PrefixNotFoundError: the pool does not hold it.
            FrameError: an invalid key, or an entry over ``max_entry_bytes``.
            TransferInterruptedError: the connection failed or stalled.
        """
        answer = self.client.request(KIND_GET, check_key(key))
        if answer.kind == KIND_DATA:
            return answer.payload
        reason = answer.payload.decode("utf-8", "replace")
        if "PrefixNotFoundError" in reason:
            raise PrefixNotFoundError(f"no KV stream for {key} in the pool {self.root}")
        raise FrameError(f"the pool {self.root} refused {key}: {reason}")

    def put(self, key: str, data: bytes | bytearray | memoryview) -> str:
        """Store ``data`` under ``key`` in the pool (returns once stored).

        Raises:
            FrameError, TransferInterruptedError, TransferRejectedError: see :meth:`FrameClient.send`.
        """
        self.client.send(key, data)
        return f"{self.root}/{key}"

    def remove(self, key: str) -> None:
        """Pools keep their entries (a no-op here)."""


def open_store(spec: str, *, max_entry_bytes: int = DEFAULT_MAX_FRAME_BYTES, timeout_s: float = 30.0):
    """A :class:`RemoteStore` for ``tcp://host:port``, else a :class:`KVStore` of the directory
    ``spec``.

    Raises:
        FrameError: a ``tcp://`` address without a valid port.
    """
    if spec.startswith("tcp://"):
        host, sep, port = spec[len("tcp://"):].rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise FrameError(f"KV pool address must be tcp://host:port, got {spec!r}")
        return RemoteStore(host, int(port), max_entry_bytes=max_entry_bytes, timeout_s=timeout_s)
    return KVStore(spec, max_entry_bytes=max_entry_bytes)


def main(argv: list[str] | None = None) -> int:
    """Serve a directory as a KV pool: ``python -m kvtune.serving.transport DIR --host H --port P``."""
    import argparse

    ap = argparse.ArgumentParser(description="Serve a directory of kvtune KV streams as a pool over TCP.")
    ap.add_argument("root", help="the pool directory")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=18700)
    ap.add_argument("--max-entry-bytes", type=int, default=DEFAULT_MAX_FRAME_BYTES)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    server = FrameServer(args.host, args.port, KVStore(args.root, max_entry_bytes=args.max_entry_bytes),
                         max_frame_bytes=args.max_entry_bytes)
    print(f"serving {args.root} on {args.host}:{server.port}", flush=True)
    try:
        threading.Event().wait()
    except KeyboardInterrupt:
        pass
    finally:
        server.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
