"""The runtime side of KVServe: a policy table drives real KV transfers.

KVServe ("KVServe: Service-Aware KV Cache Compression for Communication-Efficient Disaggregated
LLM Serving", arXiv 2605.13734, Service-Aware Online Controller) picks, for each transfer, the
policy of its offline table that minimises the predicted transfer time at the current bandwidth
under an accuracy floor and an SLO, corrects the predictions with measured residuals, and falls
back to a safer policy after repeated SLO violations. :class:`ServingPolicy` wires that
controller (:class:`kvtune.tables.Controller`) to the codecs:

1. start-up: :meth:`ServingPolicy.load` reads the table and its run files
   (:mod:`kvtune.serving.artifacts`), builds the runnable policy of every row the accuracy
   bucket can select, and :meth:`ServingPolicy.check_model` refuses a serving model of another
   geometry (:class:`ModelMismatchError`);
2. per transfer: :meth:`~ServingPolicy.encode` asks the controller for a policy for the KV's
   volume, encodes with :func:`kvtune.codecs.encode_kv` and times it;
   :meth:`~ServingPolicy.feedback` reports the measured wire (and decode) time, from which the
   controller estimates the bandwidth (an EWMA of ``x = 1/B``) and learns codec residuals:
   the bandwidth comes from the transfers themselves;
3. long transfers: :meth:`~ServingPolicy.encode_chunks` splits the layers into chunks and
   re-selects before each chunk from the previous chunks' feedback
   (:meth:`kvtune.tables.Controller.plan_chunks`); each chunk is a self-describing stream
   with its ``layer_offset`` and :meth:`~ServingPolicy.decode_chunks` reassembles them;
4. with a shared key (``key=``, e.g. :func:`kvtune.serving.auth.load_key`), every stream is
   sealed with HMAC-SHA256 (:mod:`kvtune.serving.auth`) and decoding refuses, before decoding
   anything, a stream that is unsealed, truncated, edited or sealed with another key.

KV layout at this API: ``list`` over layers of ``(K, V)``, each ``(batch, kv_heads, tokens,
head_dim)``, float32 / bfloat16 / float16, any device. Volumes are bytes of the KV in bfloat16
(:func:`kvtune.codecs.original_nbytes`, the ``V`` of the latency model), times are seconds,
bandwidths Gbps (1e9 bits/s). Controller calls (decisions, feedback) are serialised by a lock,
so one instance can serve several threads; a :class:`ChunkedEncoding` belongs to one transfer.
"""

from __future__ import annotations

import dataclasses
import math
import os
import threading
import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import torch

from kvtune.codecs.policy import KVLayers, PolicyConfig, check_kv, decode_device, decode_kv, encode_kv, original_nbytes
from kvtune.codecs.stream import StreamHeader, byte_view, read_header
from kvtune.core.errors import KvtuneError, KVInputError, KVStreamError
from kvtune.serving.auth import key_id, seal, unseal
from kvtune.serving.artifacts import (
    ModelGeometry,
    ModelMismatchError,
    ServingArtifacts,
    load_artifacts,
    codebook_problems,
    mixhq_problems,
    policy_configs,
)
from kvtune.tables.controller import ChunkedTransfer, Controller, ControllerConfig, Decision, Feedback, Observation
from kvtune.tables.policy_table import PolicyTable

__all__ = ["ChunkAssemblyError", "ChunkedEncoding", "EncodedKV", "ServingPolicy", "checked_gbps"]


class ChunkAssemblyError(KVStreamError):
    """Chunk streams do not cover one contiguous range of layers: a chunk is missing,
    repeated or overlaps another."""


@dataclass(frozen=True, slots=True)
class EncodedKV:
    """One encoded transfer (a whole KV cache or one chunk of layers).

    Attributes:
        stream: the bytes to send: a kvtune stream (:mod:`kvtune.codecs.stream`), sealed
            (:func:`kvtune.serving.auth.seal`) when the policy has a key.
        decision: the controller's :class:`~kvtune.tables.Decision` (policy, predictions).
        encode_s: measured encode seconds.
        kv_bytes: bytes of the encoded KV in bfloat16 (the latency model's ``V``).
        layer_offset: absolute index of the stream's first layer.
        num_layers: layers in the stream.
        chunk: chunk index within a :class:`ChunkedEncoding`, or None for a whole transfer.
    """

    stream: bytes
    decision: Decision
    encode_s: float
    kv_bytes: int
    layer_offset: int = 0
    num_layers: int = 0
    chunk: int | None = None

    @property
    def policy_id(self) -> str:
        """The table's id of the chosen policy (``"none"`` = uncompressed)."""
        return self.decision.policy_id

    @property
    def wire_bytes(self) -> int:
        """Bytes on the wire: ``len(stream)``."""
        return len(self.stream)


def _finite_number(value: Any) -> float | None:
    """``value`` as a finite float, or None when it is not a finite real number (bools and
    strings are not numbers here)."""
    if isinstance(value, (bool, str, bytes)):
        return None
    try:
        v = float(value)
    except (TypeError, ValueError):
        return None
    return v if math.isfinite(v) else None


def _seconds(name: str, value: Any) -> float:
    """``value`` as float seconds; KvtuneError unless a finite number >= 0."""
    v = _finite_number(value)
    if v is None or v < 0:
        raise KvtuneError(f"{name} must be finite and >= 0 seconds, got {value!r}")
    return v


def checked_gbps(value: Any, name: str = "bandwidth_gbps") -> float:
    """A link bandwidth argument in Gbps as a float.

    Raises:
        KvtuneError: not a finite number > 0 (a string, a bool, None, 0, negative, NaN, inf).
    """
    v = _finite_number(value)
    if v is None or v <= 0:
        raise KvtuneError(f"{name} must be > 0 and finite (a number of Gbps), got {value!r}")
    return v


def _checked_slo(value: Any, name: str = "slo_s") -> float | None:
    """An SLO argument in seconds: None (no SLO) or a finite number > 0."""
    if value is None:
        return None
    v = _finite_number(value)
    if v is None or v <= 0:
        raise KvtuneError(f"{name} must be a finite number of seconds > 0, or None for no SLO; got {value!r}")
    return v


def _checked_q_min(value: Any) -> float:
    """The accuracy floor argument: a fraction in (0, 1]."""
    v = _finite_number(value)
    if v is None or not 0.0 < v <= 1.0:
        raise KvtuneError(f"q_min must be a number in (0, 1] (a relative accuracy, e.g. 0.97), got {value!r}")
    return v


def _controller_config(q_min: Any, slo_s: Any, controller: ControllerConfig | Mapping[str, Any] | None) -> ControllerConfig:
    q_min, slo_s = _checked_q_min(q_min), _checked_slo(slo_s)
    if controller is None:
        return ControllerConfig(q_min=q_min, slo_s=slo_s)
    if isinstance(controller, ControllerConfig):
        return dataclasses.replace(controller, q_min=q_min, slo_s=slo_s)
    if not isinstance(controller, Mapping):
        raise KvtuneError(f"controller must be a ControllerConfig, a dict or None, got {type(controller).__name__}")
    clash = sorted({"q_min", "slo_s"} & set(controller))
    if clash:
        raise KvtuneError(f"controller settings {clash} are arguments of ServingPolicy.load; pass them there")
    known = {f.name for f in dataclasses.fields(ControllerConfig)}
    unknown = sorted(set(controller) - known)
    if unknown:
        raise KvtuneError(f"unknown controller setting(s) {unknown}; known: {sorted(known - {'q_min', 'slo_s'})}")
    try:
        return ControllerConfig(q_min=q_min, slo_s=slo_s, **controller)
    except (TypeError, ValueError) as exc:  # a value of the wrong type fails its range check
        raise KvtuneError(f"controller settings {dict(controller)!r}: a value of the wrong type ({exc})") from None


class ServingPolicy:
    """Per-transfer policy selection, encode and decode from a policy table (see the module
    docstring). Build it with :meth:`load`.

    Args:
        artifacts: what :func:`kvtune.serving.artifacts.load_artifacts` loaded.
        config: controller settings (``q_min``, ``slo_s``, ``epsilon``, ...).
        initial_bandwidth_gbps: bandwidth prior (Gbps) used until the first feedback; without
            it every :meth:`encode` before the first feedback needs ``bandwidth_gbps``.
        key: shared stream key (bytes, 16 to 4096) to seal and authenticate streams, or None.
            Never shown in reprs or messages (only its id, :func:`kvtune.serving.auth.key_id`).

    Raises:
        KeyConfigError: an unusable key.
        TableError: no accuracy bucket for ``q_min``, or a selectable policy the runtime cannot
            encode (another method, unparsable configuration).
        CalibrationError: a selectable ``mixhq`` policy without head scores.
        KvtuneError: invalid controller settings, or an ``initial_bandwidth_gbps`` that is
            not a finite number > 0.
    """

    def __init__(
        self,
        artifacts: ServingArtifacts,
        config: ControllerConfig,
        *,
        initial_bandwidth_gbps: float | None = None,
        key: bytes | None = None,
    ) -> None:
        self._key_id = None if key is None else key_id(key)
        self._key = None if key is None else bytes(key)
        self._artifacts = artifacts
        if initial_bandwidth_gbps is not None:
            initial_bandwidth_gbps = checked_gbps(initial_bandwidth_gbps, "initial_bandwidth_gbps")
        self._controller = Controller(artifacts.table, config, initial_bandwidth_gbps=initial_bandwidth_gbps)
        self._configs = policy_configs(artifacts.table, config.q_min, key=config.key, head_scores=artifacts.head_scores)
        self._lock = threading.Lock()
        self._model: tuple[int, int, int, torch.dtype] | None = None

    @classmethod
    def load(
        cls,
        table: str | os.PathLike[str] | PolicyTable,
        *,
        q_min: float,
        slo_s: float | None = None,
        key: bytes | None = None,
        controller: ControllerConfig | Mapping[str, Any] | None = None,
        initial_bandwidth_gbps: float | None = None,
        model_info: Mapping[str, Any] | None = None,
        head_scores: Any = None,
    ) -> ServingPolicy:
        """Load a table (file, run folder or :class:`~kvtune.tables.PolicyTable`) and its run
        files, and build the runtime.

        Args:
            table: ``policy_table.json`` / ``.parquet``, a run folder, or a loaded table.
            q_min: accuracy floor, a fraction in (0, 1] (e.g. 0.97): the table's bucket is the
                smallest floor >= ``q_min``.
            slo_s: transfer-time SLO in seconds, finite and > 0 (None = none).
            key: shared stream key (see the class), e.g. ``kvtune.serving.auth.load_key()``.
            controller: further :class:`~kvtune.tables.ControllerConfig` settings (a config
                or a dict such as ``{"epsilon": 0.0}``; ``q_min``/``slo_s`` come from the
                arguments above).
            initial_bandwidth_gbps: bandwidth prior in Gbps (see the class).
            model_info: geometry of the profiled model (``num_layers``, ``kv_heads``,
                ``head_dim``, ``dtype``) when the table and run do not record it.
            head_scores: MixHQ head scores when the run's ``calibration.json`` is not beside
                the table.

        Raises:
            TableError, CalibrationError, ModelMismatchError, KeyConfigError, KvtuneError: see
                the class and
                :func:`~kvtune.serving.artifacts.load_artifacts`; KvtuneError also for a
                ``q_min`` outside (0, 1] or an ``slo_s`` that is not a finite number > 0
                (checked before the table is read).
        """
        config = _controller_config(q_min, slo_s, controller)
        artifacts = load_artifacts(table, model_info=model_info, head_scores=head_scores)
        return cls(artifacts, config, initial_bandwidth_gbps=initial_bandwidth_gbps, key=key)

    # ------------------------------------------------------------------ state

    @property
    def table(self) -> PolicyTable:
        """The policy table."""
        return self._artifacts.table

    @property
    def geometry(self) -> ModelGeometry | None:
        """The profiled model's KV geometry, or None when nothing records it."""
        return self._artifacts.geometry

    @property
    def controller(self) -> Controller:
        """The underlying controller (residuals, fallback state, bandwidth estimate)."""
        return self._controller

    @property
    def key_id(self) -> str | None:
        """Hex id of the stream key (:func:`kvtune.serving.auth.key_id`), or None without a key."""
        return None if self._key_id is None else self._key_id.hex()

    @property
    def bandwidth_gbps(self) -> float | None:
        """Current bandwidth estimate in Gbps (prior or learned from feedback), or None."""
        return self._controller.bandwidth_gbps

    @property
    def policies(self) -> Mapping[str, PolicyConfig]:
        """Read-only map of every selectable table policy id to its runnable policy."""
        return MappingProxyType(self._configs)

    def policy_config(self, policy_id: str) -> PolicyConfig:
        """The runnable policy behind a table policy id.

        Raises:
            KvtuneError: the id is not selectable at this accuracy bucket.
        """
        try:
            return self._configs[policy_id]
        except KeyError:
            raise KvtuneError(f"policy {policy_id!r} is not selectable here; known: {sorted(self._configs)}") from None

    def __repr__(self) -> str:
        c = self._controller.config
        return (f"ServingPolicy(table={self.table!r}, q_min={c.q_min}, slo_s={c.slo_s}, "
                f"policies={len(self._configs)}, key_id={self.key_id})")

    # ------------------------------------------------------------------ start-up check

    def check_model(
        self,
        *,
        num_layers: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        allow_dtype_mismatch: bool = False,
    ) -> None:
        """Check that the serving model matches the profiled one; call once at start-up.

        After a successful check, :meth:`encode` also refuses KV of another geometry.

        Args:
            num_layers, kv_heads, head_dim: the serving model's KV geometry.
            dtype: the serving KV cache's dtype.
            allow_dtype_mismatch: accept a KV dtype other than the one the accuracies were
                measured on (e.g. serving bfloat16 KV with a table profiled on float32 KV;
                the profiled accuracies then hold only approximately).

        Raises:
            ModelMismatchError: a geometry or dtype difference (all differences in one
                message), MixHQ scores for another geometry, a table with no recorded
                geometry (load the run folder, or pass ``model_info=`` to :meth:`load`), or
                arguments that are not positive ints and a ``torch.dtype``.
        """
        dims = {"num_layers": num_layers, "kv_heads": kv_heads, "head_dim": head_dim}
        bad = sorted(k for k, v in dims.items() if isinstance(v, bool) or not isinstance(v, int) or v <= 0)
        if bad:
            raise ModelMismatchError(f"check_model: {bad} must be positive ints, got {[dims[k] for k in bad]}")
        if not isinstance(dtype, torch.dtype):
            raise ModelMismatchError(f"check_model: dtype must be a torch.dtype (e.g. torch.bfloat16), got {dtype!r}")
        geo = self.geometry
        if geo is None:
            raise ModelMismatchError(
                f"policy table of {self.table.model!r} records no model geometry (layers, kv_heads, head_dim, "
                "dtype): load it from its run folder (run.json) or pass model_info= to ServingPolicy.load"
            )
        problems = geo.problems(num_layers=num_layers, kv_heads=kv_heads, head_dim=head_dim, dtype=dtype)
        if allow_dtype_mismatch:
            problems = [p for p in problems if not p.startswith("KV dtype")]
        problems += mixhq_problems(self._configs, num_layers=num_layers, kv_heads=kv_heads)
        problems += codebook_problems(self._configs, num_layers=num_layers)
        if problems:
            raise ModelMismatchError(
                f"serving model does not match the policy table of {self.table.model!r} ({geo.source}): "
                + "; ".join(problems)
            )
        self._model = (num_layers, kv_heads, head_dim, dtype)

    def _check_kv(self, kv: KVLayers, layer_offset: int) -> None:
        """Refuse malformed KV (:func:`kvtune.codecs.check_kv`: structure, ranks, dtypes,
        device; values are checked while encoding) and, after :meth:`check_model`, KV that
        does not fit the checked model."""
        check_kv(kv, check_finite=False)
        if self._model is None:
            return
        layers, heads, dim, dtype = self._model
        if layer_offset + len(kv) > layers:
            raise ModelMismatchError(f"KV of layers {layer_offset}..{layer_offset + len(kv) - 1}; the model has {layers}")
        for i, (k, v) in enumerate(kv):
            for name, t in (("K", k), ("V", v)):
                if t.dim() != 4 or t.shape[1] != heads or t.shape[3] != dim or t.dtype != dtype:
                    raise ModelMismatchError(
                        f"kv[{i}] {name} is {tuple(t.shape)} {t.dtype}; the checked model has (batch, {heads}, "
                        f"tokens, {dim}) {dtype}"
                    )

    # ------------------------------------------------------------------ transfers

    def _encode_with(self, kv: KVLayers, decision: Decision, *, layer_offset: int, chunk: int | None) -> EncodedKV:
        config = self._configs[decision.policy_id]
        t0 = time.perf_counter()
        stream = encode_kv(kv, config, layer_offset=layer_offset)
        if self._key is not None:
            stream = seal(stream, self._key)
        encode_s = time.perf_counter() - t0
        return EncodedKV(stream, decision, encode_s, original_nbytes(kv), layer_offset, len(kv), chunk)

    def encode(self, kv: KVLayers, *, bandwidth_gbps: float | None = None) -> EncodedKV:
        """Choose a policy for ``kv`` and encode it.

        Args:
            kv: the KV cache (see the module docstring for the layout).
            bandwidth_gbps: link bandwidth for this decision (Gbps); default the estimate
                learned from :meth:`feedback` (or the prior).

        Returns:
            :class:`EncodedKV`; send ``.stream``, then call :meth:`feedback`.

        Raises:
            KVInputError: the KV is malformed (not ``(K, V)`` pairs of 4-D float32 /
                bfloat16 / float16 tensors of one dtype, :func:`kvtune.codecs.check_kv`), has
                no elements, or cannot be coded (see :func:`kvtune.codecs.encode_kv`); checked
                before the controller decides.
            ModelMismatchError: after :meth:`check_model`, KV of another geometry.
            KvtuneError: no bandwidth (no prior, no feedback yet and none given), or a
                ``bandwidth_gbps`` that is not a finite number > 0.
        """
        if bandwidth_gbps is not None:
            bandwidth_gbps = checked_gbps(bandwidth_gbps)
        self._check_kv(kv, 0)
        volume = original_nbytes(kv)
        if volume <= 0:
            raise KVInputError("no KV to encode: the cache has no elements")
        with self._lock:
            decision = self._controller.decide(volume, bandwidth_gbps=bandwidth_gbps)
        return self._encode_with(kv, decision, layer_offset=0, chunk=None)

    def decode(
        self, stream: bytes | bytearray | memoryview, *, device: torch.device | str | None = None, out: KVLayers | None = None
    ) -> KVLayers:
        """Decode any kvtune stream (it names its own policy); with a key, only a sealed one
        that authenticates.

        Args:
            stream: the received bytes (any contiguous bytes-like buffer).
            device: where to decode (default: CPU): on a GPU, the codecs' device path decodes
                there (:func:`kvtune.codecs.decode_kv` with ``device=``).
            out: optional preallocated tensors on ``device`` to decode into (see
                :func:`kvtune.codecs.decode_kv`); they are returned.

        Returns:
            One ``(K, V)`` pair per layer of the stream, in the encoded dtype.

        Raises:
            AuthenticationError: with a key, a stream that is not sealed, truncated, edited or
                sealed with another key (checked before any decoding; a
                :class:`~kvtune.core.errors.KVStreamError`).
            KVStreamError: not a bytes-like buffer, or a truncated, corrupted or undecodable
                stream (its subclasses).
            ModelMismatchError: after :meth:`check_model`, a stream whose header records
                layers, KV heads or head size the model does not have (before decoding).
            KVInputError: an unusable ``device`` or ``out`` (see :func:`kvtune.codecs.decode_kv`).
        """
        dev = decode_device(device)
        payload = self._payload(stream)
        if self._model is not None:
            self._check_header(read_header(payload))
        return decode_kv(payload, out=out, device=dev)

    def _payload(self, stream: bytes | bytearray | memoryview) -> memoryview:
        """The kvtune stream inside ``stream``: authenticated and unframed with a key, as is
        (a byte view, :func:`kvtune.codecs.stream.byte_view`) without one."""
        return byte_view(stream) if self._key is None else unseal(stream, self._key)

    def _check_header(self, h: StreamHeader) -> None:
        """After :meth:`check_model`, refuse a stream whose recorded layers or shapes are not
        the model's (no-op before)."""
        if self._model is None:
            return
        layers, heads, dim, _ = self._model
        if h.layer_offset + h.num_layers > layers:
            raise ModelMismatchError(f"stream of layers {h.layer_offset}..{h.layer_offset + h.num_layers - 1}; "
                                     f"the model has {layers}")
        for i, pair in enumerate(h.shapes):
            for name, shape in zip("KV", pair):
                if shape[1] != heads or shape[3] != dim:
                    raise ModelMismatchError(f"stream layer {h.layer_offset + i} {name} is {tuple(shape)}; the checked "
                                             f"model has (batch, {heads}, tokens, {dim})")

    def _feedback_args(self, encoded: EncodedKV, transfer_s: float, decode_s: float | None) -> Feedback:
        """The controller's :class:`~kvtune.tables.Feedback` of one transfer: the codec time
        is the measured encode plus the measured decode (or, when not measured, the decode
        time the table predicts), so the wire time the bandwidth is learned from is exactly
        ``transfer_s``."""
        wire = _seconds("transfer_s", transfer_s)
        p = encoded.decision.policy
        if decode_s is None:
            dec = 0.0 if math.isinf(p.decode_gbps) else encoded.kv_bytes / (p.decode_gbps * 1e9)
        else:
            dec = _seconds("decode_s", decode_s)
        codec = encoded.encode_s + dec
        return Feedback(codec + wire, codec_s=codec, wire_bytes=float(encoded.wire_bytes))

    def feedback(self, encoded: EncodedKV, *, transfer_s: float, decode_s: float | None = None) -> Observation:
        """Report a transfer's measured times; updates the bandwidth estimate (sample ``x =
        transfer_s / GB on the wire``), the policy's codec residual and the SLO state.

        Args:
            encoded: what :meth:`encode` returned (not a chunk: chunks report to their
                :class:`ChunkedEncoding`).
            transfer_s: seconds on the wire (send start to last byte received), >= 0.
            decode_s: measured decode seconds, if known.

        Returns:
            The controller's :class:`~kvtune.tables.Observation`.

        Raises:
            KvtuneError: a negative / non-finite time, a chunk, or not an :class:`EncodedKV`.
        """
        if not isinstance(encoded, EncodedKV):
            raise KvtuneError(f"feedback needs the EncodedKV that encode() returned, got {type(encoded).__name__}")
        if encoded.chunk is not None:
            raise KvtuneError("feedback of a chunk goes to its ChunkedEncoding.feedback")
        fb = self._feedback_args(encoded, transfer_s, decode_s)
        with self._lock:
            return self._controller.feedback(encoded.decision, fb.measured_s, codec_s=fb.codec_s, wire_bytes=fb.wire_bytes)

    # ------------------------------------------------------------------ chunks

    def encode_chunks(self, kv: KVLayers, *, chunk_layers: int, slo_s: float | None = None) -> ChunkedEncoding:
        """Plan a long transfer in chunks of ``chunk_layers`` layers, re-selecting the policy
        before each chunk (:meth:`kvtune.tables.Controller.plan_chunks`).

        Args:
            kv: the KV cache.
            chunk_layers: layers per chunk (> 0; the last chunk may have fewer).
            slo_s: SLO of the whole transfer (default the configured one); each chunk gets its
                share of the budget left.

        Returns:
            A :class:`ChunkedEncoding`: iterate it for the chunks and report each one's
            :meth:`~ChunkedEncoding.feedback` before asking for the next.

        Raises:
            KvtuneError: ``chunk_layers`` < 1, or an ``slo_s`` that is not a finite number > 0;
                KVInputError / ModelMismatchError as :meth:`encode` (the whole cache is checked
                before the first chunk: e.g. one dtype across every chunk).
        """
        if isinstance(chunk_layers, bool) or not isinstance(chunk_layers, int) or chunk_layers < 1:
            raise KvtuneError(f"chunk_layers must be an int >= 1, got {chunk_layers!r}")
        if slo_s is not None:
            slo_s = _checked_slo(slo_s)
        self._check_kv(kv, 0)
        groups = [kv[i : i + chunk_layers] for i in range(0, len(kv), chunk_layers)]
        sizes = [original_nbytes(g) for g in groups]
        if sum(sizes) <= 0:
            raise KVInputError("no KV to encode: the cache has no elements")
        slo = self._controller.config.slo_s if slo_s is None else slo_s
        plan = self._controller.plan_chunks(float(sum(sizes)), float(sizes[0]), slo_s=slo)
        return ChunkedEncoding(self, groups, sizes, chunk_layers, plan)

    def decode_chunks(
        self, streams: Iterable[bytes | bytearray | memoryview], *, device: torch.device | str | None = None
    ) -> KVLayers:
        """Decode the chunk streams of one transfer, in any order, into one KV cache.

        Every chunk is authenticated (with a key) and its header checked before any chunk is
        decoded. Chunks of one transfer share the KV dtype and batch size; chunks of two
        transfers that agree on both (and tile the layers) cannot be told apart from the
        streams, which carry no transfer id: the transport keeps transfers apart.

        Args:
            streams: a list (any iterable but a bytes-like) of every chunk's stream.
            device: where to decode (default: CPU), as :meth:`decode`.

        Returns:
            The layers ``0..n-1`` in order.

        Raises:
            ChunkAssemblyError: no chunks, chunks that do not cover layers ``0..n-1`` exactly
                once (or, after :meth:`check_model`, not all of the model's layers), or chunks
                of different dtypes or batch sizes (different transfers).
            AuthenticationError: with a key, a chunk that does not authenticate.
            KVStreamError: ``streams`` is not an iterable of bytes-like chunks, or a chunk
                fails to decode.
            ModelMismatchError: after :meth:`check_model`, a chunk of another geometry.
            KVInputError: an unusable ``device``.
        """
        dev = decode_device(device)
        if streams is None or isinstance(streams, (bytes, bytearray, memoryview, str)):
            raise KVStreamError(f"decode_chunks needs a list of chunk streams, got {type(streams).__name__}")
        parts = []
        for s in streams:
            payload = self._payload(s)
            h = read_header(payload)
            self._check_header(h)
            parts.append((h.layer_offset, h.num_layers, payload, h))
        if not parts:
            raise ChunkAssemblyError("no chunk streams to assemble")
        kinds = sorted({(h.dtype, shape[0]) for *_, h in parts for pair in h.shapes for shape in pair})
        if len(kinds) > 1:
            raise ChunkAssemblyError(f"chunk streams of different transfers: (dtype, batch) {kinds}")
        parts.sort(key=lambda p: p[0])
        expected = 0
        for offset, n, *_ in parts:
            if offset != expected:
                what = "missing" if offset > expected else "overlapping"
                raise ChunkAssemblyError(f"chunk streams: layers {min(offset, expected)}..{max(offset, expected) - 1} {what}")
            expected += n
        if self._model is not None and expected != self._model[0]:
            raise ChunkAssemblyError(f"chunk streams cover layers 0..{expected - 1}; the model has {self._model[0]}")
        kv: KVLayers = []
        for _, _, payload, _ in parts:
            kv.extend(decode_kv(payload, device=dev))
        return kv


class ChunkedEncoding(Iterator[EncodedKV]):
    """The chunks of one long transfer (see :meth:`ServingPolicy.encode_chunks`).

    Loop::

        chunks = policy.encode_chunks(kv, chunk_layers=8)
        for enc in chunks:
            t = send(enc.stream)
            chunks.feedback(enc, transfer_s=t)

    Each chunk's policy is decided when the chunk is requested, from the bandwidth estimated
    with every earlier chunk's feedback and the SLO budget left.

    Attributes:
        plan: the controller's :class:`~kvtune.tables.ChunkedTransfer` (decisions, elapsed).
    """

    def __init__(self, owner: ServingPolicy, groups: list[KVLayers], sizes: list[int], chunk_layers: int,
                 plan: ChunkedTransfer) -> None:
        self._owner = owner
        self._groups = groups
        self._sizes = sizes
        self._chunk_layers = chunk_layers
        self.plan = plan
        self._next = 0
        self._pending: EncodedKV | None = None
        self._ready: Decision | None = None

    @property
    def decisions(self) -> list[Decision]:
        """Decisions made so far, one per chunk."""
        return self.plan.decisions

    @property
    def switches(self) -> int:
        """Policy changes between consecutive chunks."""
        return self.plan.switches

    def __next__(self) -> EncodedKV:
        if self._pending is not None:
            raise KvtuneError(f"chunk {self._pending.chunk}: call feedback() before asking for the next chunk")
        if self._next >= len(self._groups):
            raise StopIteration
        with self._owner._lock:
            decision = self._ready if self._ready is not None else self.plan.next_chunk()
        self._ready = None
        i = self._next
        enc = self._owner._encode_with(self._groups[i], decision, layer_offset=i * self._chunk_layers, chunk=i)
        self._next += 1
        self._pending = enc
        return enc

    def feedback(self, encoded: EncodedKV, *, transfer_s: float, decode_s: float | None = None) -> None:
        """Report a chunk's measured times (as :meth:`ServingPolicy.feedback`); the next chunk's
        policy is decided with them.

        Raises:
            KvtuneError: not the chunk awaiting feedback, or bad times.
        """
        if self._pending is None or encoded is not self._pending:
            raise KvtuneError("feedback: this is not the chunk awaiting feedback")
        fb = self._owner._feedback_args(encoded, transfer_s, decode_s)
        if self._next < len(self._sizes):
            self.plan.chunk_bytes = float(self._sizes[self._next])  # next chunk = exactly its layers
        with self._owner._lock:
            self._ready = self.plan.next_chunk(fb)
        self._pending = None
