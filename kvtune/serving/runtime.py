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

from kvtune.codecs.policy import KVLayers, PolicyConfig, decode_kv, encode_kv, original_nbytes
from kvtune.codecs.stream import read_header
from kvtune.core.errors import KvtuneError, KVInputError, KVStreamError
from kvtune.serving.auth import key_id, seal, unseal
from kvtune.serving.artifacts import (
    ModelGeometry,
    ModelMismatchError,
    ServingArtifacts,
    load_artifacts,
    mixhq_problems,
    policy_configs,
)
from kvtune.tables.controller import ChunkedTransfer, Controller, ControllerConfig, Decision, Feedback, Observation
from kvtune.tables.policy_table import PolicyTable

__all__ = ["ChunkAssemblyError", "ChunkedEncoding", "EncodedKV", "ServingPolicy"]


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


def _seconds(name: str, value: Any) -> float:
    """``value`` as float seconds; KvtuneError unless finite and >= 0."""
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise KvtuneError(f"{name} must be a number of seconds, got {value!r}") from None
    if not (math.isfinite(v) and v >= 0):
        raise KvtuneError(f"{name} must be finite and >= 0 seconds, got {value!r}")
    return v


def _to_device(kv: KVLayers, device: torch.device | str | None) -> KVLayers:
    """``kv`` moved to ``device`` (unchanged when None)."""
    return kv if device is None else [(k.to(device), v.to(device)) for k, v in kv]


def _controller_config(q_min: float, slo_s: float | None, controller: ControllerConfig | Mapping[str, Any] | None) -> ControllerConfig:
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
    return ControllerConfig(q_min=q_min, slo_s=slo_s, **controller)


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
        KvtuneError: invalid controller settings.
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
            q_min: accuracy floor (fraction, e.g. 0.97): the table's bucket is the smallest
                floor >= ``q_min``.
            slo_s: transfer-time SLO in seconds (None = none).
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
                :func:`~kvtune.serving.artifacts.load_artifacts`.
        """
        artifacts = load_artifacts(table, model_info=model_info, head_scores=head_scores)
        config = _controller_config(q_min, slo_s, controller)
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
                message), MixHQ scores for another geometry, or a table with no recorded
                geometry (load the run folder, or pass ``model_info=`` to :meth:`load`).
        """
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
        if problems:
            raise ModelMismatchError(
                f"serving model does not match the policy table of {self.table.model!r} ({geo.source}): "
                + "; ".join(problems)
            )
        self._model = (num_layers, kv_heads, head_dim, dtype)

    def _check_kv(self, kv: KVLayers, layer_offset: int) -> None:
        """Refuse KV that does not fit the checked model (no-op before :meth:`check_model`)."""
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
            KVInputError: the KV has no elements, or cannot be coded (see
                :func:`kvtune.codecs.encode_kv`).
            ModelMismatchError: after :meth:`check_model`, KV of another geometry.
            KvtuneError: no bandwidth (no prior, no feedback yet and none given).
        """
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
            stream: the received bytes.
            device: where to return the tensors (default: CPU).
            out: optional preallocated CPU tensors to decode into (see
                :func:`kvtune.codecs.decode_kv`).

        Returns:
            One ``(K, V)`` pair per layer of the stream, in the encoded dtype.

        Raises:
            AuthenticationError: with a key, a stream that is not sealed, truncated, edited or
                sealed with another key (checked before any decoding; a
                :class:`~kvtune.core.errors.KVStreamError`).
            KVStreamError: a truncated, corrupted or undecodable stream (its subclasses).
        """
        return _to_device(decode_kv(self._payload(stream), out=out), device)

    def _payload(self, stream: bytes | bytearray | memoryview) -> bytes | bytearray | memoryview:
        """The kvtune stream inside ``stream``: authenticated and unframed with a key, as is
        without one."""
        return stream if self._key is None else unseal(stream, self._key)

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
            KvtuneError: a negative / non-finite time, or a chunk.
        """
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
            KvtuneError: ``chunk_layers`` < 1; KVInputError / ModelMismatchError as :meth:`encode`.
        """
        if isinstance(chunk_layers, bool) or not isinstance(chunk_layers, int) or chunk_layers < 1:
            raise KvtuneError(f"chunk_layers must be an int >= 1, got {chunk_layers!r}")
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

        Args:
            streams: every chunk's stream.
            device: where to return the tensors (default: CPU).

        Returns:
            The layers ``0..n-1`` in order.

        Raises:
            ChunkAssemblyError: the chunks do not cover layers ``0..n-1`` exactly once (or,
                after :meth:`check_model`, not all of the model's layers).
            AuthenticationError: with a key, a chunk that does not authenticate.
            KVStreamError: a chunk fails to decode.
        """
        parts = []
        for s in streams:
            payload = self._payload(s)
            h = read_header(payload)
            parts.append((h.layer_offset, h.num_layers, payload))
        parts.sort(key=lambda p: p[0])
        expected = 0
        for offset, n, _ in parts:
            if offset != expected:
                what = "missing" if offset > expected else "overlapping"
                raise ChunkAssemblyError(f"chunk streams: layers {min(offset, expected)}..{max(offset, expected) - 1} {what}")
            expected += n
        if self._model is not None and expected != self._model[0]:
            raise ChunkAssemblyError(f"chunk streams cover layers 0..{expected - 1}; the model has {self._model[0]}")
        kv: KVLayers = []
        for _, _, payload in parts:
            kv.extend(_to_device(decode_kv(payload), device))
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
