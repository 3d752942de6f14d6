"""vLLM's paged KV blocks on the CPU: where each key and value element of a block lives.

The connector (:mod:`kvtune.serving.vllm`) copies a request's KV cache out of the engine's paged
blocks before it encodes them, and back into the blocks of another instance after it decodes
them. vLLM's CPU attention backend keeps one tensor per layer, ``(num_blocks, kv_heads,
block_size, 2 * head_dim)``, viewed as ``(num_blocks, kv_heads, 2 * block_size, head_dim)``: per
block and KV head, ``block_size * head_dim`` key elements followed by as many value elements.
Inside each half the order depends on the ISA of the attention kernels: token-major, channel-major
(the keys of the ``vec`` kernels), or packed in pairs for AMX tiles (the ``amx`` kernels store
keys as channel pairs of each token, values as token pairs of each channel). Rather than
hard-code each ISA, :func:`probe_layout` lets the engine's own cache-write kernel store known
values once and records each half as a permutation (:class:`PagedLayout`).

No vLLM import here: these are torch functions, tested without the engine.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from kvtune.serving.artifacts import ModelMismatchError

__all__ = ["PagedLayout", "paged_geometry", "probe_layout", "gather_blocks", "scatter_blocks"]

MAX_PROBE = 256
"""Largest block size and head size :func:`probe_layout` handles: its probe values (token and
channel indices) must be exact in bfloat16."""


def paged_geometry(layer_cache: torch.Tensor) -> tuple[int, int, int, int]:
    """``(num_blocks, kv_heads, block_size, head_dim)`` of one layer of the CPU backend's
    cache ``(num_blocks, kv_heads, block_size, 2 * head_dim)``.

    Raises:
        ModelMismatchError: not a 4-D tensor with an even last dimension.
    """
    if layer_cache.dim() != 4 or layer_cache.shape[-1] % 2:
        raise ModelMismatchError(f"unsupported paged KV layout {tuple(layer_cache.shape)}: expected "
                                 "(num_blocks, kv_heads, block_size, 2 * head_dim) of the CPU attention backend")
    nb, h, bs, c2 = layer_cache.shape
    return int(nb), int(h), int(bs), int(c2 // 2)


@dataclass(frozen=True, eq=False)
class PagedLayout:
    """The order of the key half and of the value half of one block of one KV head.

    Attributes:
        key_order, value_order: int64 ``(block_size * head_dim,)``, a permutation: the logical
            index ``token * head_dim + channel`` of the element stored at each memory position
            of the half; ``None`` for token-major (the identity).
        block_size, head_dim: the geometry the orders were probed for.
    """

    key_order: torch.Tensor | None
    value_order: torch.Tensor | None
    block_size: int
    head_dim: int

    def describe(self, order: torch.Tensor | None) -> str:
        """``"token-major"``, ``"channel-major"`` or ``"packed"`` (any other permutation)."""
        if order is None:
            return "token-major"
        bs, d = self.block_size, self.head_dim
        channel_major = torch.arange(bs * d).view(bs, d).t().reshape(-1)
        return "channel-major" if torch.equal(order, channel_major) else "packed"

    def __repr__(self) -> str:
        return f"PagedLayout(keys {self.describe(self.key_order)}, values {self.describe(self.value_order)})"


def probe_layout(write: Callable[..., None], *, kv_heads: int, block_size: int, head_dim: int,
                 dtype: torch.dtype) -> PagedLayout:
    """Find the engine's block layout by letting its own cache-write kernel store known values.

    Two writes of one block: every element set to its token index, then to its channel index;
    together they name the ``(token, channel)`` held at each memory position of each half.

    Args:
        write: ``(key, value, key_cache, value_cache, slot_mapping) -> None``, the engine's
            kernel (``vllm._custom_ops.cpu_attn_reshape_and_cache`` bound to the layers' ISA);
            ``key``/``value`` are ``(tokens, kv_heads, head_dim)``.
        kv_heads, block_size, head_dim: the cache's geometry; dtype: its dtype.

    Returns:
        The :class:`PagedLayout`.

    Raises:
        ModelMismatchError: a block or head larger than :data:`MAX_PROBE`, or the kernel stores
            a half in an order that is not one permutation of its elements, the same for every
            KV head (an element written twice or never, or heads laid out differently).
    """
    h, bs, d = kv_heads, block_size, head_dim
    if bs > MAX_PROBE or d > MAX_PROBE:
        raise ModelMismatchError(f"cannot probe blocks of {bs} tokens x {d} channels (at most {MAX_PROBE} each)")
    cache = torch.zeros(1, h, bs, 2 * d, dtype=dtype)
    view = cache.view(1, h, 2 * bs, d)
    kc, vc = view[:, :, :bs], view[:, :, bs:]
    slots = torch.arange(bs, dtype=torch.long)
    seen = []
    for pattern in (torch.arange(bs).view(bs, 1, 1), torch.arange(d).view(1, 1, d)):
        x = pattern.expand(bs, h, d).to(dtype).contiguous()
        write(x, x, kc, vc, slots)
        seen.append(view[0].to(torch.float32).clone())  # (h, 2bs, d) in memory order
    identity = torch.arange(bs * d)
    orders = []
    for name, rows in (("key", slice(0, bs)), ("value", slice(bs, 2 * bs))):
        tok, chan = seen[0][:, rows].reshape(h, bs * d), seen[1][:, rows].reshape(h, bs * d)
        in_range = bool(((tok >= 0) & (tok < bs) & (chan >= 0) & (chan < d)).all())
        order = (tok * d + chan).to(torch.int64)
        if not in_range or not bool((order == order[0]).all()) or \
                not torch.equal(torch.sort(order[0]).values, identity):
            raise ModelMismatchError(f"the engine stores {name} blocks in a layout kvtune cannot read "
                                     "(not one permutation of each block's tokens and channels)")
        orders.append(None if torch.equal(order[0], identity) else order[0])
    return PagedLayout(orders[0], orders[1], bs, d)


def _kv_view(layer_cache: torch.Tensor) -> torch.Tensor:
    nb, h, bs, d = paged_geometry(layer_cache)
    return layer_cache.view(nb, h, 2 * bs, d)


def _to_logical(part: torch.Tensor, order: torch.Tensor | None) -> torch.Tensor:
    """``(n, h, bs, d)`` memory-order elements of one half -> logical ``(n, h, bs, d)``."""
    if order is None:
        return part
    n, h, bs, d = part.shape
    out = torch.empty(n, h, bs * d, dtype=part.dtype)
    out.index_copy_(2, order, part.reshape(n, h, bs * d))  # logical[order[p]] = memory[p]
    return out.view(n, h, bs, d)


def _to_memory(part: torch.Tensor, order: torch.Tensor | None) -> torch.Tensor:
    """Inverse of :func:`_to_logical`: logical ``(n, h, bs, d)`` -> memory order, contiguous."""
    if order is None:
        return part.contiguous()
    n, h, bs, d = part.shape
    return part.reshape(n, h, bs * d).index_select(2, order).view(n, h, bs, d)  # memory[p] = logical[order[p]]


def _check_layout(layout: PagedLayout, bs: int, d: int) -> None:
    if (layout.block_size, layout.head_dim) != (bs, d):
        raise ModelMismatchError(f"the block layout was probed for blocks of {layout.block_size} tokens x "
                                 f"{layout.head_dim} channels, the cache has {bs} x {d}")


def gather_blocks(layer_cache: torch.Tensor, block_ids: list[int], tokens: int,
                  layout: PagedLayout) -> tuple[torch.Tensor, torch.Tensor]:
    """Copy the first ``tokens`` tokens of a request out of one paged layer.

    Args:
        layer_cache: ``(num_blocks, kv_heads, block_size, 2 * head_dim)`` (CPU backend).
        block_ids: the request's blocks in token order (at least ``ceil(tokens / block_size)``).
        tokens: how many tokens.
        layout: the block layout (:func:`probe_layout`).

    Returns:
        ``(K, V)``, each ``(1, kv_heads, tokens, head_dim)``, contiguous, the cache's dtype.

    Raises:
        ModelMismatchError: the cache's geometry is not the one ``layout`` was probed for.
    """
    _, h, bs, d = paged_geometry(layer_cache)
    _check_layout(layout, bs, d)
    nblk = -(-tokens // bs)
    idx = torch.as_tensor(block_ids[:nblk], dtype=torch.long)
    blocks = _kv_view(layer_cache).index_select(0, idx)  # (nblk, h, 2bs, d), memory order
    out = []
    for rows, order in ((slice(0, bs), layout.key_order), (slice(bs, 2 * bs), layout.value_order)):
        x = _to_logical(blocks[:, :, rows], order)  # (nblk, h, bs, d)
        out.append(x.permute(1, 0, 2, 3).reshape(h, nblk * bs, d)[:, :tokens].unsqueeze(0).contiguous())
    return out[0], out[1]


def scatter_blocks(layer_cache: torch.Tensor, block_ids: list[int], k: torch.Tensor, v: torch.Tensor,
                   start: int, end: int, layout: PagedLayout) -> None:
    """Write tokens ``[start, end)`` of ``(K, V)`` into a request's blocks of one paged layer.

    Args:
        layer_cache: ``(num_blocks, kv_heads, block_size, 2 * head_dim)`` (CPU backend).
        block_ids: the request's blocks in token order.
        k, v: ``(1, kv_heads, >= end, head_dim)``.
        start, end: token range; both multiples of the block size.
        layout: the block layout (:func:`probe_layout`).

    Raises:
        ModelMismatchError: ``k``/``v`` do not fit the cache (heads, head size, tokens), the
            range is not block-aligned, or the cache's geometry is not the one ``layout`` was
            probed for.
    """
    _, h, bs, d = paged_geometry(layer_cache)
    _check_layout(layout, bs, d)
    if start % bs or end % bs or not 0 <= start <= end:
        raise ModelMismatchError(f"token range [{start}, {end}) is not aligned to blocks of {bs}")
    for name, t in (("K", k), ("V", v)):
        if t.dim() != 4 or t.shape[0] != 1 or t.shape[1] != h or t.shape[3] != d or t.shape[2] < end:
            raise ModelMismatchError(f"{name} of shape {tuple(t.shape)} does not fit the engine's cache "
                                     f"(1, {h}, >= {end}, {d})")
    nblk = (end - start) // bs
    if nblk == 0:
        return
    first = start // bs
    idx = torch.as_tensor(block_ids[first:first + nblk], dtype=torch.long)
    view = _kv_view(layer_cache)
    for t, rows, order in ((k, slice(0, bs), layout.key_order), (v, slice(bs, 2 * bs), layout.value_order)):
        part = t[0, :, start:end].to(layer_cache.dtype).reshape(h, nblk, bs, d).permute(1, 0, 2, 3)  # (nblk, h, bs, d)
        view[:, :, rows].index_copy_(0, idx, _to_memory(part, order))
