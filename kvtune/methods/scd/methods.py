"""Ways a consumer gets its KV for a prefix the producer has prefilled (SCD and its baselines).

SCD ("Semantic Cache Distillation: Efficient State Transfer via Reuse and Selective Patching",
arXiv 2606.07684) and its baselines,
among them DroidSpeak (arXiv 2411.02820). Every method is a small frozen dataclass
registered in :data:`METHODS` by name; :meth:`TransferMethod.transfer` turns one context's
:class:`PrefixContext` (the producer's states, the token ids) into a :class:`Transfer`: the
consumer-side cache, the bytes that crossed the wire and the seconds of extra work on each
side. Latency of a transfer over a link of B bytes/s is then the line

    T(B) = a + b / B,    a = producer_seconds + consumer_seconds,  b = payload_bytes

(:func:`ttft_seconds`); recompute sends only the token ids (int32, 4 bytes per token).

========== ===========================================================================
method     what crosses the wire / what the consumer does
========== ===========================================================================
recompute  token ids; the consumer prefills the prefix itself (quality reference)
raw        the producer's KV in bf16; used as-is (payload = full KV)
raw+tqc    the producer's KV through a T/Q/C policy (:mod:`kvtune.codecs`)
droidspeak the producer's KV (bf16) of every layer outside a contiguous block
           [start, start + length), plus the producer's residual stream (bf16) at the
           block's entry; the consumer runs its own layers of the block from it
scd        per layer a rank-r_l code of the producer's normalized input (Reuse), or at
           patched layers a rank-r code of its residual stream (Patch), in bf16 or through a
           T/Q/C policy (:func:`code_policy`); the consumer decodes with the calibration
           maps and applies RoPE / its own norm + projections
========== ===========================================================================
"""

from __future__ import annotations

import json
import time
from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass, field
from typing import Any, ClassVar

import torch

from kvtune.codecs import PolicyConfig, original_nbytes
from kvtune.core.registry import Registry
from kvtune.core.errors import ConfigError
from kvtune.evaluate.model import KVLayers, LoadedModel, round_kv
from kvtune.methods.scd.calibration import SCDCalibration
from kvtune.methods.scd.states import LayerStates, capture_states, kv_from_hidden, kv_from_pre, rotary, run_layers

TOKEN_ID_BYTES = 4
"""Bytes per token id on the wire (int32)."""

CODE_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}
"""dtype of SCD codes and DroidSpeak hidden states on the wire."""

METHODS: Registry[type["TransferMethod"]] = Registry("SCD transfer method")
"""Registry of transfer methods by name (the ``method`` column of tables)."""


def register_method(cls: type["TransferMethod"]) -> type["TransferMethod"]:
    """Class decorator adding a method to :data:`METHODS` under ``cls.name``."""
    return METHODS.register(cls.name, cls)  # an empty name or a clash: DuplicateNameError


@dataclass
class PrefixContext:
    """One prefix as both sides see it.

    Attributes:
        ids: the prefix token ids (T).
        producer: the producer's :class:`LayerStates` of its own prefill (it has them anyway).
    """

    ids: list[int]
    producer: LayerStates

    @property
    def tokens(self) -> int:
        return len(self.ids)


@dataclass
class Transfer:
    """Result of moving one prefix to the consumer.

    Attributes:
        kv: the consumer's cache, per layer ``(1, kv_heads, T, head_dim)``.
        payload_bytes: bytes that crossed the wire.
        producer_seconds: producer work beyond its own prefill (encoding), seconds.
        consumer_seconds: consumer work before the cache is usable (decode / recompute), seconds.
    """

    kv: KVLayers
    payload_bytes: int
    producer_seconds: float = 0.0
    consumer_seconds: float = 0.0


def ttft_seconds(producer_seconds: float, consumer_seconds: float, payload_bytes: float, bandwidth_gbps: float) -> float:
    """Predicted seconds until the consumer's cache is ready: ``a + b / B``.

    Args:
        producer_seconds, consumer_seconds: measured compute on each side (seconds).
        payload_bytes: bytes sent.
        bandwidth_gbps: link bandwidth in Gbps (1e9 bits/s).
    """
    return producer_seconds + consumer_seconds + payload_bytes * 8.0 / (bandwidth_gbps * 1e9)


@dataclass
class Pair:
    """The producer/consumer pair and what the methods need from calibration."""

    producer: LoadedModel
    consumer: LoadedModel
    calibration: SCDCalibration | None = None


class TransferMethod(ABC):
    """A way to give the consumer its KV for a prefix (one row of a policy table)."""

    name: ClassVar[str] = ""

    @abstractmethod
    def transfer(self, pair: Pair, ctx: PrefixContext) -> Transfer:
        """Move one prefix; see :class:`Transfer`."""

    def artifact_bytes(self, pair: Pair) -> int:
        """Bytes of calibration artifacts this configuration needs on both sides (0 for most)."""
        return 0

    def config_dict(self) -> dict[str, Any]:
        """JSON-able configuration (``method`` plus the dataclass fields)."""
        return {"method": self.name, **{k: _jsonable(v) for k, v in asdict(self).items()}}

    def config_json(self) -> str:
        return json.dumps(self.config_dict(), sort_keys=True)

    def label(self) -> str:
        return self.name


def _jsonable(v: Any) -> Any:
    if isinstance(v, tuple):
        return list(v)
    return v


def _bf16(kv: KVLayers) -> KVLayers:
    return round_kv(kv, "bfloat16")


@register_method
@dataclass(frozen=True)
class Recompute(TransferMethod):
    """The consumer prefills the prefix itself; only token ids cross the wire."""

    name: ClassVar[str] = "recompute"

    def transfer(self, pair: Pair, ctx: PrefixContext) -> Transfer:
        from kvtune.evaluate.workloads.base import prefill_kv

        t0 = time.perf_counter()
        kv = prefill_kv(pair.consumer, ctx.ids)
        return Transfer(kv=kv, payload_bytes=TOKEN_ID_BYTES * ctx.tokens, consumer_seconds=time.perf_counter() - t0)


@register_method
@dataclass(frozen=True)
class Raw(TransferMethod):
    """The producer's KV in bf16, used as-is by the consumer."""

    name: ClassVar[str] = "raw"

    def transfer(self, pair: Pair, ctx: PrefixContext) -> Transfer:
        kv = ctx.producer.kv
        return Transfer(kv=_bf16(kv), payload_bytes=original_nbytes(kv))


@register_method
@dataclass(frozen=True)
class RawTQC(TransferMethod):
    """The producer's KV through a T/Q/C compression policy (``kvtune.codecs``).

    Attributes:
        policy: the policy as a ``PolicyConfig.to_dict()`` dict.
        policy_name: a short name for labels (preset name or policy id).
    """

    name: ClassVar[str] = "raw+tqc"
    policy: dict = field(default_factory=dict)
    policy_name: str = ""

    def __hash__(self) -> int:
        return hash((self.name, json.dumps(self.policy, sort_keys=True)))

    def transfer(self, pair: Pair, ctx: PrefixContext) -> Transfer:
        from kvtune.evaluate.workloads.base import encode_decode

        cfg = PolicyConfig.from_dict(self.policy)
        decoded, stream, t_enc, t_dec = encode_decode(pair.consumer, _bf16(ctx.producer.kv), cfg)
        return Transfer(kv=decoded, payload_bytes=len(stream), producer_seconds=t_enc, consumer_seconds=t_dec)

    def label(self) -> str:
        return f"raw+tqc {self.policy_name}"


@register_method
@dataclass(frozen=True)
class DroidSpeak(TransferMethod):
    """Reuse the producer's KV except a contiguous block of layers the consumer recomputes.

    The producer sends its residual stream entering layer ``start`` (``(T, hidden)`` in
    ``wire_dtype``); the consumer runs its own layers ``start .. start + length - 1`` from it.

    Attributes:
        start, length: the recomputed block.
        wire_dtype: dtype of the hidden state on the wire (``bfloat16``).
    """

    name: ClassVar[str] = "droidspeak"
    start: int = 0
    length: int = 4
    wire_dtype: str = "bfloat16"

    def transfer(self, pair: Pair, ctx: PrefixContext) -> Transfer:
        n = pair.consumer.num_layers
        if not (0 <= self.start and self.length >= 1 and self.start + self.length <= n):
            raise ConfigError(f"droidspeak block [{self.start}, {self.start + self.length}) is outside 0..{n}")
        stop = self.start + self.length
        kept = [kv for i, kv in enumerate(ctx.producer.kv) if not self.start <= i < stop]
        dt = CODE_DTYPES[self.wire_dtype]
        h = ctx.producer.hidden[self.start].to(dt)
        payload = original_nbytes(kept) + h.numel() * h.element_size()
        t0 = time.perf_counter()
        block = run_layers(pair.consumer, h.float(), self.start, stop)
        secs = time.perf_counter() - t0
        raw = _bf16(ctx.producer.kv)
        kv = raw[: self.start] + block + raw[stop:]
        return Transfer(kv=kv, payload_bytes=payload, consumer_seconds=secs)

    def label(self) -> str:
        return f"droidspeak layers {self.start}-{self.start + self.length - 1}"


CODE_BITS = (16, 8, 6, 4, 3, 2)
"""Widths of SCD codes on the wire: 16 = bfloat16, else :func:`code_policy`."""


def code_policy(bits: int) -> PolicyConfig:
    """The T/Q/C policy that carries SCD codes at ``bits`` (< 16) bits per coefficient.

    The codes of all layers travel as one KV stream (:func:`kvtune.codecs.encode_kv`): layer
    l's code ``(T, r_l)`` is split into a "key" half ``(1, 1, T, ceil(r_l/2))`` and a "value"
    half. Code coefficients are coordinates along the map's principal directions, so their
    scale differs per coefficient and little per token: asymmetric uniform quantization per
    channel (one scale and zero per coefficient and group of 32 tokens, as KIVI keys), packed
    densely (``bitpack``).

    Raises:
        ConfigError: ``bits`` not in :data:`CODE_BITS`.
    """
    if bits not in CODE_BITS or bits == 16:
        raise ConfigError(f"SCD code bits must be one of {', '.join(map(str, CODE_BITS))}; got {bits}")
    q = {"name": "uniform", "bits": bits, "granularity": "per_channel", "group_size": 32}
    return PolicyConfig.from_dict({"key": q, "value": q, "codec": "bitpack"})


def _split_code(code: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(T, r)`` -> the two halves as ``(1, 1, T, .)`` tensors (the KV layout of a stream)."""
    h = (code.shape[1] + 1) // 2
    return code[:, :h].reshape(1, 1, code.shape[0], h), code[:, h:].reshape(1, 1, code.shape[0], -1)


@register_method
@dataclass(frozen=True)
class SCD(TransferMethod):
    """Semantic Cache Distillation: Reuse codes per layer, Patch codes at transition layers.

    Attributes:
        ranks: per-layer Reuse rank r_l (``len == num_layers``), code ``(T, r_l)``.
        patch_layers: layers that are patched instead (rank ``patch_rank``).
        patch_rank: rank of the Patch code.
        code_dtype: dtype of codes on the wire when ``code_bits == 16`` (``bfloat16``;
            ``float32`` for exactness tests).
        code_bits: 16 = codes in ``code_dtype``; fewer = codes quantized by the T/Q/C
            pipeline with :func:`code_policy` (payload = the stream's bytes).
    """

    name: ClassVar[str] = "scd"
    ranks: tuple[int, ...] = ()
    patch_layers: tuple[int, ...] = ()
    patch_rank: int = 64
    code_dtype: str = "bfloat16"
    code_bits: int = 16

    @classmethod
    def uniform(cls, num_layers: int, rank: int, patch_layers: tuple[int, ...] = (), *, patch_rank: int | None = None,
                code_dtype: str = "bfloat16", code_bits: int = 16) -> "SCD":
        """Every layer at ``rank``; patched layers at ``patch_rank`` (default ``rank``)."""
        return cls(ranks=(rank,) * num_layers, patch_layers=tuple(sorted(patch_layers)),
                   patch_rank=rank if patch_rank is None else patch_rank, code_dtype=code_dtype, code_bits=code_bits)

    def config_dict(self) -> dict[str, Any]:
        d = super().config_dict()
        if self.code_bits == 16:  # configurations from before code_bits keep their ids
            d.pop("code_bits", None)
        return d

    def transfer(self, pair: Pair, ctx: PrefixContext) -> Transfer:
        cal = pair.calibration
        if cal is None:
            raise ConfigError("the scd method needs calibration maps (run calibrate first)")
        if len(self.ranks) != cal.num_layers:
            raise ConfigError(f"scd config has {len(self.ranks)} ranks for {cal.num_layers} layers")
        cons = pair.consumer
        half = cons.kv_heads * cons.head_dim
        rope = rotary(cons, ctx.tokens)
        patched = set(self.patch_layers)
        maps = [(cal.patch[layer] if layer in patched else cal.reuse[layer]).truncate(
            self.patch_rank if layer in patched else self.ranks[layer]) for layer in range(cal.num_layers)]
        # producer: one code per layer, then onto the wire
        t0 = time.perf_counter()
        codes = [m.encode(ctx.producer.hidden[layer] if layer in patched else ctx.producer.normed[layer])
                 for layer, m in enumerate(maps)]
        if self.code_bits == 16:
            dt = CODE_DTYPES[self.code_dtype]
            wire = [c.to(dt) for c in codes]
            payload = sum(c.numel() * c.element_size() for c in wire)
        else:
            from kvtune.codecs import decode_kv, encode_kv

            stream = encode_kv([_split_code(c) for c in codes], code_policy(self.code_bits))
            payload = len(stream)
        t1 = time.perf_counter()
        # consumer: codes back, then its KV through the maps
        if self.code_bits != 16:
            wire = [torch.cat([k.reshape(k.shape[2], -1), v.reshape(v.shape[2], -1)], dim=1) for k, v in decode_kv(stream)]
        kv: KVLayers = []
        for layer, (m, code) in enumerate(zip(maps, wire)):
            y = m.decode(code.float())
            if layer in patched:
                kv.append(kv_from_hidden(cons, layer, y, rope))
            else:
                kv.append(kv_from_pre(cons, layer, y[:, :half], y[:, half:], rope))
        t2 = time.perf_counter()
        return Transfer(kv=kv, payload_bytes=payload, producer_seconds=t1 - t0, consumer_seconds=t2 - t1)

    def artifact_bytes(self, pair: Pair) -> int:
        """Bytes of the truncated maps this configuration uses (float32, producer + consumer side)."""
        cal = pair.calibration
        if cal is None:
            return 0
        total = 0
        for layer in range(cal.num_layers):
            patch = layer in self.patch_layers
            m = (cal.patch[layer] if patch else cal.reuse[layer]).truncate(
                self.patch_rank if patch else self.ranks[layer])
            total += m.producer_nbytes() + m.consumer_nbytes()
        return total

    def label(self) -> str:
        rs = sorted(set(self.ranks))
        r = str(rs[0]) if len(rs) == 1 else f"{min(rs)}-{max(rs)}"
        patch = f", patch {list(self.patch_layers)}@{self.patch_rank}" if self.patch_layers else ""
        bits = f", {self.code_bits}-bit codes" if self.code_bits != 16 else ""
        return f"scd r={r}{patch}{bits}"


def prefix_context(producer: LoadedModel, ids: list[int]) -> PrefixContext:
    """The producer's prefill of ``ids`` with every layer's states (:func:`capture_states`)."""
    return PrefixContext(ids=list(ids), producer=capture_states(producer, list(ids)))
