"""The cached state of a shared prefix, and its wire payload at a reuse depth.

BiCache ("Enabling KV Caching of Shared Prefix for Diffusion Language Models", arXiv 2606.07571,
Sec. 3, "prefix KV reuse"): a shared prefix (an
instruction, a system prompt) is run through the encoder *alone* once; its per-layer keys,
values and hidden states are cached. A later request ``prefix + suffix`` reuses them in the
layers ``1..d`` (the reuse depth) and recomputes everything above ``d``.

To continue above ``d`` the request needs, for the prefix tokens, the keys and values of
layers ``1..d`` (the suffix tokens attend to them) and the hidden state leaving layer ``d``
(the input of layer ``d + 1``). That is the payload a remote prefix store sends at depth d:
``d`` layers of K/V, optionally compressed with a T/Q/C policy, plus one hidden state in
bfloat16. Its bf16 size is ``P * H * 2 * (2 d + 1)`` bytes for ``d >= 1`` and 0 for ``d = 0``
(P prefix tokens, H hidden size).
"""

from __future__ import annotations

import struct
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvtune.codecs import PolicyConfig, decode_kv, encode_kv
from kvtune.core.errors import BiCacheError, KVStreamError

__all__ = [
    "PAYLOAD_MAGIC",
    "PayloadTiming",
    "PrefixState",
    "merge_states",
    "pack_prefix_state",
    "prefix_state_bf16_bytes",
    "unpack_prefix_state",
]

PAYLOAD_MAGIC = b"KVB1"
_HEADER = struct.Struct("<4sIIIQ")  # magic, depth, prefix tokens, hidden size, KV-stream bytes


@dataclass(frozen=True)
class PrefixState:
    """Per-layer state of the prefix tokens of one or more requests.

    Layer ``l`` is 1-indexed in the docs (``keys[l - 1]``). All tensors float32 on one device.

    Attributes:
        prefix_ids: the prefix token ids the state was computed for.
        keys: ``L`` tensors ``(B, heads, P, head_dim)``: K of layer ``l`` for the prefix tokens.
        values: ``L`` tensors ``(B, heads, P, head_dim)``: V of layer ``l``.
        hiddens: ``L + 1`` tensors ``(B, P, H)``: ``hiddens[0]`` is the embedding output,
            ``hiddens[l]`` the output of layer ``l``.
        depth: layers covered: ``keys``/``values`` of layers ``1..depth`` and ``hiddens[depth]``
            are valid. A state computed by the encoder has ``depth == L``; a state decoded from
            a payload of depth ``d`` has ``depth == d`` and holds only those tensors (the
            others are empty placeholders of shape ``(B, heads, 0, head_dim)`` / ``(B, 0, H)``).
    """

    prefix_ids: tuple[int, ...]
    keys: tuple[torch.Tensor, ...]
    values: tuple[torch.Tensor, ...]
    hiddens: tuple[torch.Tensor, ...]
    depth: int

    @property
    def num_layers(self) -> int:
        """L, the encoder's layer count."""
        return len(self.keys)

    @property
    def num_tokens(self) -> int:
        """P, prefix tokens."""
        return len(self.prefix_ids)

    @property
    def hidden_size(self) -> int:
        """H."""
        return int(self.hiddens[0].shape[-1])

    def check_covers(self, prefix_ids: Sequence[int], depth: int) -> None:
        """Raise :class:`BiCacheError` unless this state is for ``prefix_ids`` and covers ``depth``."""
        if tuple(int(t) for t in prefix_ids) != self.prefix_ids:
            raise BiCacheError(
                f"cached prefix state is for another prefix ({self.num_tokens} tokens, "
                f"first ids {list(self.prefix_ids[:4])}); recompute it for this prefix"
            )
        if not 0 <= depth <= self.depth:
            raise BiCacheError(f"reuse depth {depth} needs a state covering {depth} layers; this one covers {self.depth}")


def prefix_state_bf16_bytes(prefix_tokens: int, hidden_size: int, depth: int) -> int:
    """Bytes of the depth-``depth`` payload in bfloat16: ``P * H * 2 * (2 d + 1)``, 0 for d = 0.

    ``d`` layers of K and V (``2 d P H`` elements) plus the hidden state leaving layer d
    (``P H`` elements), 2 bytes each. With ``depth = L`` this is the reference volume V of
    BiCache table rows (``kv_bytes_per_request``).
    """
    if depth <= 0:
        return 0
    return int(prefix_tokens) * int(hidden_size) * 2 * (2 * int(depth) + 1)


def _hidden_to_bf16_bytes(h: torch.Tensor) -> bytes:
    return h.detach().to("cpu", torch.bfloat16).contiguous().view(torch.int16).numpy().tobytes()


def _hidden_from_bf16_bytes(data: bytes, shape: tuple[int, ...]) -> torch.Tensor:
    import numpy as np

    arr = np.frombuffer(data, dtype=np.int16).copy()
    return torch.from_numpy(arr).view(torch.bfloat16).reshape(shape).float()


@dataclass(frozen=True)
class PayloadTiming:
    """Measured seconds of one payload round trip (wall clock, ``time.perf_counter``)."""

    encode_s: float
    decode_s: float


def pack_prefix_state(state: PrefixState, depth: int, policy: PolicyConfig) -> bytes:
    """Serialize the depth-``depth`` payload of a batch-1 prefix state.

    Layout: header ``<4sIIIQ`` (magic ``KVB1``, depth, P, H, KV-stream length), the
    :func:`kvtune.codecs.encode_kv` stream of layers ``1..d`` (K/V ``(1, heads, P, head_dim)``)
    under ``policy``, then the hidden state leaving layer ``d`` as raw bfloat16 ``(P, H)``.
    ``depth = 0`` gives the header alone (nothing to reuse).

    Raises:
        BiCacheError: depth outside ``0..state.depth`` or a batched state.
    """
    if not 0 <= depth <= state.depth:
        raise BiCacheError(f"cannot pack depth {depth}: the state covers {state.depth} layers")
    if state.hiddens[0].shape[0] != 1:
        raise BiCacheError("pack_prefix_state expects a batch-1 prefix state (the shared prefix computed alone)")
    P, H = state.num_tokens, state.hidden_size
    if depth == 0:
        return _HEADER.pack(PAYLOAD_MAGIC, 0, P, H, 0)
    kv = [(state.keys[i].detach().cpu(), state.values[i].detach().cpu()) for i in range(depth)]
    stream = encode_kv(kv, policy)
    return _HEADER.pack(PAYLOAD_MAGIC, depth, P, H, len(stream)) + stream + _hidden_to_bf16_bytes(state.hiddens[depth][0])


def unpack_prefix_state(
    payload: bytes, prefix_ids: Sequence[int], num_layers: int, *, policy: PolicyConfig | None = None,
    device: torch.device | str = "cpu",
) -> PrefixState:
    """Inverse of :func:`pack_prefix_state`: a depth-d :class:`PrefixState` (batch 1, float32).

    Raises:
        BiCacheError: bad magic, lengths that do not match, or a depth above ``num_layers``.
        KVStreamError: the embedded KV stream is corrupt (or of another policy than ``policy``).
    """
    if len(payload) < _HEADER.size:
        raise BiCacheError(f"prefix-state payload of {len(payload)} bytes is shorter than its header")
    magic, depth, P, H, n_kv = _HEADER.unpack_from(payload)
    if magic != PAYLOAD_MAGIC:
        raise BiCacheError(f"not a BiCache prefix-state payload (magic {magic!r})")
    if P != len(prefix_ids) or depth > num_layers:
        raise BiCacheError(f"payload for {P} prefix tokens / depth {depth} does not fit {len(prefix_ids)} tokens / {num_layers} layers")
    expect = _HEADER.size + n_kv + (P * H * 2 if depth else 0)
    if len(payload) != expect:
        raise BiCacheError(f"prefix-state payload has {len(payload)} bytes, its header says {expect}")
    keys: list[torch.Tensor] = []
    values: list[torch.Tensor] = []
    if depth:
        kv = decode_kv(memoryview(payload)[_HEADER.size:_HEADER.size + n_kv], expect=policy)
        keys = [k.float().to(device) for k, _ in kv]
        values = [v.float().to(device) for _, v in kv]
        heads, hd = keys[0].shape[1], keys[0].shape[3]
        hidden = _hidden_from_bf16_bytes(payload[_HEADER.size + n_kv:], (1, P, H)).to(device)
    else:
        heads, hd = 1, 0
        hidden = torch.zeros(1, P, H, device=device)  # unused at depth 0
    empty_kv = torch.zeros(1, heads, 0, hd, device=device)
    empty_h = torch.zeros(1, 0, H, device=device)
    keys += [empty_kv] * (num_layers - depth)
    values += [empty_kv] * (num_layers - depth)
    hiddens = [empty_h] * depth + [hidden] + [empty_h] * (num_layers - depth)
    return PrefixState(tuple(int(t) for t in prefix_ids), tuple(keys), tuple(values), tuple(hiddens), depth)


def roundtrip_prefix_state(state: PrefixState, depth: int, policy: PolicyConfig) -> tuple[PrefixState, int, PayloadTiming]:
    """Pack, then unpack, timing both: what a request sees after fetching from a remote store.

    Returns:
        ``(decoded state of depth d, payload bytes, timing)``.
    """
    t0 = time.perf_counter()
    payload = pack_prefix_state(state, depth, policy)
    t1 = time.perf_counter()
    dev = state.hiddens[0].device
    decoded = unpack_prefix_state(payload, state.prefix_ids, state.num_layers, policy=policy, device=dev)
    t2 = time.perf_counter()
    return decoded, len(payload), PayloadTiming(t1 - t0, t2 - t1)


def merge_states(shallow: PrefixState, deep: PrefixState, depth: int) -> PrefixState:
    """Layers ``1..depth`` from ``shallow`` and ``depth + 1..L`` (and the final hidden) from ``deep``.

    Used by the diffusion-LM loop: the shallow layers come from the cross-request prefix
    cache, the deep layers from the last in-request refresh. The result covers all L layers.

    Raises:
        BiCacheError: the states are for different prefixes or do not cover their parts.
    """
    if shallow.prefix_ids != deep.prefix_ids or shallow.num_layers != deep.num_layers:
        raise BiCacheError("cannot merge prefix states of different prefixes or encoders")
    if shallow.depth < depth or deep.depth < deep.num_layers:
        raise BiCacheError(f"merge needs the shallow state to cover {depth} layers and the deep one all layers")
    L = shallow.num_layers
    keys = tuple(shallow.keys[:depth]) + tuple(deep.keys[depth:])
    values = tuple(shallow.values[:depth]) + tuple(deep.values[depth:])
    hiddens = tuple(shallow.hiddens[:depth + 1]) + tuple(deep.hiddens[depth + 1:])
    if depth == 0:
        hiddens = tuple(deep.hiddens)
    return PrefixState(shallow.prefix_ids, keys, values, hiddens, L)
