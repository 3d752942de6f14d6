"""A ``"kvtune"`` serde for LMCache: KV stored to (and loaded from) LMCache's L2 tier is encoded
with the policy a kvtune table selects.

LMCache ("LMCache: An Efficient KV Cache Layer for Enterprise-Scale LLM Inference", arXiv
2510.09665) keeps KV chunks in an L1 CPU tier and can persist them to L2 adapters (file system,
object stores, remote servers); an adapter's optional ``"serde"`` transforms every chunk on its
way to and from L2. Its serde plugin API (``lmcache.v1.distributed.serde``, checked against
``lmcache==0.5.6``): a sync :class:`~lmcache.v1.distributed.serde.Serializer` /
:class:`~lmcache.v1.distributed.serde.Deserializer` pair wrapped in an ``AsyncSerdeProcessor``,
built by a factory registered under a type name with ``register_serde_factory``.
:class:`KvtuneSerializer` selects a policy per chunk through
:class:`kvtune.serving.ServingPolicy` (KVServe, arXiv 2605.13734, Service-Aware Online
Controller: the table's policy for the configured link bandwidth and accuracy floor) and writes
a variable-length frame; LMCache narrows the stored object to the bytes actually written.

Importing this module registers the serde (idempotent). An LMCache L2 adapter selects it with::

    "serde": {"type": "kvtune", "table": "profiles/smollm2-default", "q_min": 0.97,
              "bandwidth_gbps": 1.0}

Factory keys: ``table`` (run folder or table file, required), ``q_min`` (required),
``bandwidth_gbps`` (the L2 link's Gbps, required), ``slo_s``, ``controller`` (dict of
:class:`~kvtune.tables.ControllerConfig` settings), ``model_info`` (geometry when the run does
not record it), ``allow_dtype_mismatch`` (bool), ``max_workers`` (serde threads, default 1).
With ``KVTUNE_KV_KEY_FILE`` / ``KVTUNE_KV_KEY`` set, frames are sealed and authenticated
(:mod:`kvtune.serving.auth`). The LMCache server must import this module before it builds its
adapters: run it through :mod:`kvtune.serving.lmcache_plugin`.

Layouts. A chunk's KV object is ``[2, num_layers, tokens, kv_heads * head_dim]`` (LMCache's
``KV_2LTD``: K then V), float32 / bfloat16 / float16; kvtune's is one ``(1, kv_heads, tokens,
head_dim)`` tensor per layer and K/V. A serialized object is ``u64 little-endian stream length``
then the kvtune stream (sealed when keyed); the load buffer may be longer (padding).
"""

from __future__ import annotations

import struct
from collections.abc import Mapping
from typing import Any

import torch
from lmcache.v1.distributed.api import MemoryLayoutDesc, ObjectKey
from lmcache.v1.distributed.serde.async_processor import AsyncSerdeProcessor
from lmcache.v1.distributed.serde.base import Deserializer, SerdeProcessor, Serializer
from lmcache.v1.distributed.serde.factory import get_registered_serde_types, register_serde_factory
from lmcache.v1.memory_management import MemoryObj

from kvtune.codecs.policy import KVLayers
from kvtune.core.errors import KvtuneError, KVStreamError, TruncatedStreamError
from kvtune.serving.artifacts import ModelMismatchError
from kvtune.serving.auth import OVERHEAD, load_key
from kvtune.serving.runtime import ServingPolicy

__all__ = [
    "SERDE_NAME",
    "KvtuneDeserializer",
    "KvtuneSerializer",
    "LayoutMismatchError",
    "create_serde",
    "from_lmcache_layout",
    "into_lmcache_layout",
    "register",
    "serialized_bound",
]

SERDE_NAME = "kvtune"
"""The ``"type"`` of the serde in an LMCache adapter's ``"serde"`` config."""
_LEN = struct.Struct("<Q")
_REQUIRED = ("table", "q_min", "bandwidth_gbps")
_KNOWN = (*_REQUIRED, "slo_s", "controller", "model_info", "allow_dtype_mismatch", "max_workers")


class LayoutMismatchError(KVStreamError):
    """A stored kvtune stream does not fit the LMCache object it is loaded into (another
    number of layers, tokens, heads or head size)."""


def _layout_dims(shape: tuple[int, ...], head_dim: int) -> tuple[int, int, int]:
    """``(layers, tokens, kv_heads)`` of a ``[2, L, T, H * D]`` object.

    Raises:
        ModelMismatchError: another rank, a first dimension other than 2, or a hidden size
            that is not a multiple of ``head_dim``.
    """
    if len(shape) != 4 or shape[0] != 2 or shape[3] % head_dim:
        raise ModelMismatchError(
            f"LMCache KV object of shape {tuple(shape)}; kvtune expects [2, layers, tokens, kv_heads * {head_dim}]"
        )
    return shape[1], shape[2], shape[3] // head_dim


def from_lmcache_layout(t: torch.Tensor, head_dim: int) -> KVLayers:
    """An LMCache ``[2, L, T, H * D]`` tensor as kvtune KV: per layer ``(K, V)``, each a
    contiguous ``(1, H, T, D)`` copy in the same dtype.

    Raises:
        ModelMismatchError: see :func:`_layout_dims`.
    """
    layers, tokens, heads = _layout_dims(tuple(t.shape), head_dim)
    return [
        tuple(t[kind, layer].reshape(tokens, heads, head_dim).permute(1, 0, 2).unsqueeze(0).contiguous() for kind in (0, 1))
        for layer in range(layers)
    ]


def into_lmcache_layout(kv: KVLayers, dst: torch.Tensor) -> None:
    """Write kvtune KV (per layer ``(1, H, T, D)`` K and V) into an LMCache ``[2, L, T, H * D]``
    tensor (cast to its dtype).

    Raises:
        LayoutMismatchError: the shapes do not correspond.
    """
    layers = len(kv)
    shapes = {tuple(t.shape) for pair in kv for t in pair}
    if len(shapes) != 1:
        raise LayoutMismatchError(f"stream layers have different shapes {sorted(shapes)}")
    batch, heads, tokens, dim = shapes.pop()
    want = (2, layers, tokens, heads * dim)
    if batch != 1 or tuple(dst.shape) != want:
        raise LayoutMismatchError(f"stream holds {layers} layers of {(batch, heads, tokens, dim)}; "
                                  f"the LMCache object is {tuple(dst.shape)} (needs {want})")
    for layer, pair in enumerate(kv):
        for kind, t in enumerate(pair):
            dst[kind, layer].view(tokens, heads, dim).copy_(t[0].permute(1, 0, 2))


def serialized_bound(layout: MemoryLayoutDesc, policy: ServingPolicy) -> int:
    """Upper bound (bytes) of a serialized object of ``layout``: the length prefix, the seal,
    the bfloat16 volume plus 5 % (the controller never picks a policy with ``b >= 1`` other
    than ``"none"``, whose payload is exactly the bfloat16 volume) and a header allowance (4 KiB,
    twice the longest policy JSON, 256 bytes per layer)."""
    elements = sum(int(torch.Size(s).numel()) for s in layout.shapes)
    layers = max((int(s[1]) for s in layout.shapes if len(s) == 4), default=1)
    longest = max(len(c.to_json()) for c in policy.policies.values())
    header = 4096 + 2 * longest + 256 * layers
    return _LEN.size + OVERHEAD + int(2 * elements * 1.05) + header


class KvtuneSerializer(Serializer):
    """Encode an LMCache KV object with the policy the table selects (see the module docstring).

    Args:
        policy: the serving runtime (table, controller, key).
        bandwidth_gbps: link Gbps of the L2 tier, used for every decision.
        allow_dtype_mismatch: passed to :meth:`ServingPolicy.check_model`.
    """

    def __init__(self, policy: ServingPolicy, *, bandwidth_gbps: float, allow_dtype_mismatch: bool = False) -> None:
        self._policy = policy
        self._bandwidth = float(bandwidth_gbps)
        self._allow_dtype_mismatch = bool(allow_dtype_mismatch)
        self._checked: set[tuple[tuple[int, ...], torch.dtype]] = set()

    @property
    def policy(self) -> ServingPolicy:
        """The serving runtime."""
        return self._policy

    def check_layout(self, shape: tuple[int, ...], dtype: torch.dtype) -> int:
        """Check a ``[2, L, T, H * D]`` layout against the table's model once per (shape,
        dtype); returns ``head_dim``.

        Raises:
            ModelMismatchError: the table records no geometry, or the layout does not match it.
        """
        geo = self._policy.geometry
        if geo is None:
            raise ModelMismatchError(f"policy table of {self._policy.table.model!r} records no model geometry; "
                                     "give the serde a run folder or 'model_info'")
        if (shape, dtype) not in self._checked:
            layers, _, heads = _layout_dims(shape, geo.head_dim)
            self._policy.check_model(num_layers=layers, kv_heads=heads, head_dim=geo.head_dim, dtype=dtype,
                                     allow_dtype_mismatch=self._allow_dtype_mismatch)
            self._checked.add((shape, dtype))
        return geo.head_dim

    def serialize(self, src: MemoryObj, dst: MemoryObj, key: ObjectKey) -> int:
        """Encode ``src`` (``[2, L, T, H * D]``) into ``dst`` (uint8); returns the bytes written.

        Raises:
            ModelMismatchError: a layout of another model; KvtuneError: the frame exceeds
            ``dst`` (an estimate too small); KVInputError: KV the codecs refuse.
        """
        t = src.tensor
        if t is None:
            raise KvtuneError("kvtune serde: the source MemoryObj needs a tensor")
        head_dim = self.check_layout(tuple(t.shape), t.dtype)
        enc = self._policy.encode(from_lmcache_layout(t.cpu(), head_dim), bandwidth_gbps=self._bandwidth)
        out = memoryview(dst.byte_array).cast("B")  # ctypes "<B" views refuse slice assignment
        n = _LEN.size + enc.wire_bytes
        if n > len(out):
            raise KvtuneError(f"kvtune serde: a {n}-byte frame does not fit the {len(out)}-byte buffer")
        out[: _LEN.size] = _LEN.pack(enc.wire_bytes)
        out[_LEN.size : n] = enc.stream
        return n

    def estimate_serialized_size(self, layout_desc: MemoryLayoutDesc) -> int:
        """Upper bound of the frame size (:func:`serialized_bound`)."""
        return serialized_bound(layout_desc, self._policy)


class KvtuneDeserializer(Deserializer):
    """Decode a frame written by :class:`KvtuneSerializer` into an LMCache KV object.

    Args:
        serializer: its serializer (shares the policy and the layout check).
    """

    def __init__(self, serializer: KvtuneSerializer) -> None:
        self._serializer = serializer

    def deserialize(self, src: MemoryObj, dst: MemoryObj, key: ObjectKey) -> None:
        """Decode ``src`` (uint8 frame, possibly padded) into ``dst`` (``[2, L, T, H * D]``).

        Raises:
            TruncatedStreamError: the buffer is shorter than its length prefix says.
            AuthenticationError, CorruptStreamError, ... (KVStreamError): a bad stream.
            LayoutMismatchError: a stream for another layout; ModelMismatchError: a ``dst``
            layout of another model.
        """
        out = dst.tensor
        if out is None:
            raise KvtuneError("kvtune serde: the destination MemoryObj needs a tensor")
        self._serializer.check_layout(tuple(out.shape), out.dtype)
        mv = memoryview(src.byte_array).cast("B")
        if len(mv) < _LEN.size:
            raise TruncatedStreamError(f"kvtune serde frame truncated: {len(mv)} bytes")
        (n,) = _LEN.unpack_from(mv, 0)
        if n > len(mv) - _LEN.size:
            raise TruncatedStreamError(f"kvtune serde frame truncated: {len(mv) - _LEN.size} bytes, the frame says {n}")
        into_lmcache_layout(self._serializer.policy.decode(mv[_LEN.size : _LEN.size + n]), out)


def create_serde(kwargs: Mapping[str, Any]) -> SerdeProcessor:
    """LMCache serde factory of ``"kvtune"`` (keys in the module docstring).

    Raises:
        KvtuneError: missing or unknown keys; TableError / CalibrationError /
            ModelMismatchError / KeyConfigError: see :meth:`ServingPolicy.load` and
            :func:`kvtune.serving.auth.load_key`.
    """
    missing = [k for k in _REQUIRED if k not in kwargs]
    unknown = sorted(set(kwargs) - set(_KNOWN))
    if missing or unknown:
        raise KvtuneError(f"kvtune serde config: missing {missing}, unknown {unknown}; keys: {list(_KNOWN)}")
    bw = float(kwargs["bandwidth_gbps"])
    if not bw > 0:
        raise KvtuneError(f"kvtune serde config: bandwidth_gbps must be > 0, got {kwargs['bandwidth_gbps']!r}")
    policy = ServingPolicy.load(
        str(kwargs["table"]), q_min=float(kwargs["q_min"]), slo_s=kwargs.get("slo_s"), key=load_key(),
        controller=kwargs.get("controller"), model_info=kwargs.get("model_info"),
    )
    serializer = KvtuneSerializer(policy, bandwidth_gbps=bw, allow_dtype_mismatch=bool(kwargs.get("allow_dtype_mismatch", False)))
    return AsyncSerdeProcessor(serializer, KvtuneDeserializer(serializer), max_workers=int(kwargs.get("max_workers", 1)))


def register() -> None:
    """Register :func:`create_serde` with LMCache's serde factory as ``"kvtune"`` (idempotent)."""
    if SERDE_NAME not in get_registered_serde_types():
        register_serde_factory(SERDE_NAME, create_serde)


register()
