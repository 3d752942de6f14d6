"""Per-layer states of a Llama-family decoder, and the consumer's own K/V projections.

SCD works on three kinds of per-layer, per-token states (SCD,
"Semantic Cache Distillation: Efficient State Transfer via Reuse and Selective Patching", arXiv 2606.07684):

- the residual stream entering layer l, ``h_l`` (``hidden``);
- the normalized pre-attention input ``x_l = input_layernorm(h_l)`` (``normed``), from which
  the layer computes its K/V;
- the layer's K and V before rotary position embedding (``k_pre``, ``v_pre``), each
  flattened over heads: ``(tokens, kv_heads * head_dim)``.

:func:`capture_states` reads all of them in one prefill through forward hooks;
:func:`kv_from_normed` and :func:`kv_from_pre` rebuild a layer's cache entries (post-RoPE K,
V; ``(1, kv_heads, tokens, head_dim)``) from a normalized input or from pre-RoPE K/V with the
model's own projections and rotary embedding, exactly as its attention module does.
:func:`run_layers` runs a contiguous block of decoder layers from a given residual stream
(DroidSpeak's partial recompute).

Supported: decoders whose layers have ``input_layernorm`` and ``self_attn.{k_proj, v_proj}``
(Llama, Mistral, Qwen2, SmolLM) with full attention. Models with sliding-window layers or
key norms (Gemma-3) raise :class:`~kvtune.core.errors.ModelLayoutError`.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

import torch

from kvtune.core.errors import ModelLayoutError
from kvtune.evaluate.model import KVLayers, LoadedModel, cache_to_kv, forward_cache


@dataclass
class LayerStates:
    """States of one prefill at batch 1, one list entry per layer.

    Attributes:
        hidden: ``(tokens, hidden_size)`` float32 residual input of each layer.
        normed: ``(tokens, hidden_size)`` float32 normalized pre-attention input.
        k_pre, v_pre: ``(tokens, kv_heads * head_dim)`` float32 K and V before RoPE.
        kv: the model's cache (post-RoPE), per layer ``(1, kv_heads, tokens, head_dim)``.
    """

    hidden: list[torch.Tensor]
    normed: list[torch.Tensor]
    k_pre: list[torch.Tensor]
    v_pre: list[torch.Tensor]
    kv: KVLayers


def decoder_layers(lm: LoadedModel) -> Any:
    """The ``nn.ModuleList`` of decoder layers.

    Raises:
        ModelLayoutError: no ``model.model.layers`` with ``input_layernorm`` and
            ``self_attn.k_proj/v_proj``, or layers kvtune's SCD cannot rebuild (sliding
            window, key norms).
    """
    inner = getattr(lm.model, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None or not all(
        hasattr(l, "input_layernorm") and hasattr(getattr(l, "self_attn", None), "k_proj") for l in layers
    ):
        raise ModelLayoutError(f"{lm.name}: SCD needs a Llama-style decoder (layers with input_layernorm and "
                               "self_attn.k_proj/v_proj)")
    if "sliding_attention" in lm.layer_types or any(hasattr(l.self_attn, "k_norm") for l in layers):
        raise ModelLayoutError(f"{lm.name}: SCD supports full-attention layers without key norms only")
    return layers


def check_same_architecture(producer: LoadedModel, consumer: LoadedModel) -> None:
    """Raise :class:`ModelLayoutError` unless both models have the same layer and KV geometry."""
    a = (producer.num_layers, producer.kv_heads, producer.head_dim, producer.config.hidden_size)
    b = (consumer.num_layers, consumer.kv_heads, consumer.head_dim, consumer.config.hidden_size)
    if a != b:
        raise ModelLayoutError(f"producer {producer.name} (layers, kv_heads, head_dim, hidden) = {a} but consumer "
                               f"{consumer.name} has {b}: SCD needs the same architecture")
    decoder_layers(producer)
    decoder_layers(consumer)


@torch.inference_mode()
def capture_states(lm: LoadedModel, ids: list[int]) -> LayerStates:
    """Prefill ``ids`` at batch 1 and capture every layer's states (see :class:`LayerStates`)."""
    layers = decoder_layers(lm)
    n = len(layers)
    hidden: list[Any] = [None] * n
    normed: list[Any] = [None] * n
    k_pre: list[Any] = [None] * n
    v_pre: list[Any] = [None] * n
    hooks = []

    def norm_hook(i):
        def hook(_mod, args, out):
            hidden[i] = args[0][0].detach().float().clone()
            normed[i] = out[0].detach().float().clone()
        return hook

    def proj_hook(store, i):
        def hook(_mod, _args, out):
            store[i] = out[0].detach().float().clone()
        return hook

    try:
        for i, layer in enumerate(layers):
            hooks.append(layer.input_layernorm.register_forward_hook(norm_hook(i)))
            hooks.append(layer.self_attn.k_proj.register_forward_hook(proj_hook(k_pre, i)))
            hooks.append(layer.self_attn.v_proj.register_forward_hook(proj_hook(v_pre, i)))
        x = torch.tensor([ids], dtype=torch.long, device=lm.device)
        out = lm.model(input_ids=x, use_cache=True, logits_to_keep=1)
    finally:
        for h in hooks:
            h.remove()
    kv = [(k.clone(), v.clone()) for k, v in cache_to_kv(forward_cache(out))]
    return LayerStates(hidden=hidden, normed=normed, k_pre=k_pre, v_pre=v_pre, kv=kv)


def rotary(lm: LoadedModel, tokens: int, *, offset: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(cos, sin, position_ids)`` of positions ``offset .. offset + tokens - 1`` from the model's rotary module."""
    inner = lm.model.model
    pos = torch.arange(offset, offset + tokens, device=lm.device).unsqueeze(0)
    dummy = torch.zeros(1, tokens, 1, device=lm.device, dtype=next(lm.model.parameters()).dtype)
    cos, sin = inner.rotary_emb(dummy, position_ids=pos)
    return cos, sin, pos


def _apply_rope(attn: Any, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on keys ``(1, kv_heads, T, head_dim)`` with the attention module's own function."""
    fn = getattr(sys.modules[type(attn).__module__], "apply_rotary_pos_emb", None)
    if fn is None:
        raise ModelLayoutError(f"{type(attn).__name__}: no apply_rotary_pos_emb in its module")
    _, k_rot = fn(k, k, cos, sin)
    return k_rot


def kv_from_pre(lm: LoadedModel, layer: int, k_pre: torch.Tensor, v_pre: torch.Tensor,
                rope: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Cache entries of ``layer`` from pre-RoPE K/V.

    Args:
        k_pre, v_pre: ``(tokens, kv_heads * head_dim)``.
        rope: :func:`rotary` output for the same tokens.

    Returns:
        ``(K, V)``, each ``(1, kv_heads, tokens, head_dim)`` in the model dtype, K rotated.
    """
    attn = decoder_layers(lm)[layer].self_attn
    t = k_pre.shape[0]
    dtype = next(lm.model.parameters()).dtype
    k = k_pre.to(lm.device, dtype).view(1, t, lm.kv_heads, lm.head_dim).transpose(1, 2)
    v = v_pre.to(lm.device, dtype).view(1, t, lm.kv_heads, lm.head_dim).transpose(1, 2).contiguous()
    return _apply_rope(attn, k, rope[0], rope[1]).contiguous(), v


@torch.inference_mode()
def kv_from_normed(lm: LoadedModel, layer: int, normed: torch.Tensor,
                   rope: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Cache entries of ``layer`` computed by the model's own K/V projections from ``normed (tokens, hidden)``."""
    attn = decoder_layers(lm)[layer].self_attn
    x = normed.to(lm.device, next(lm.model.parameters()).dtype)
    return kv_from_pre(lm, layer, attn.k_proj(x), attn.v_proj(x), rope)


@torch.inference_mode()
def kv_from_hidden(lm: LoadedModel, layer: int, hidden: torch.Tensor,
                   rope: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Cache entries of ``layer`` from a residual stream ``(tokens, hidden)``: the model's own
    ``input_layernorm``, then its K/V projections and RoPE."""
    norm = decoder_layers(lm)[layer].input_layernorm
    return kv_from_normed(lm, layer, norm(hidden.to(lm.device, next(lm.model.parameters()).dtype)), rope)


@torch.inference_mode()
def run_layers(lm: LoadedModel, hidden: torch.Tensor, start: int, stop: int) -> KVLayers:
    """Run decoder layers ``start .. stop - 1`` from the residual stream entering ``start``.

    Args:
        hidden: ``(tokens, hidden_size)`` residual input of layer ``start`` (positions 0..T-1).

    Returns:
        Cache entries of those layers, ``(1, kv_heads, tokens, head_dim)`` each, in order.
    """
    from transformers.masking_utils import create_causal_mask

    layers = decoder_layers(lm)
    t = hidden.shape[0]
    h = hidden.to(lm.device, next(lm.model.parameters()).dtype).unsqueeze(0)
    rope = rotary(lm, t)
    mask = create_causal_mask(config=lm.model.config, inputs_embeds=h, attention_mask=None, cache=None,
                              position_ids=rope[2])
    out: KVLayers = []
    for i in range(start, stop):
        layer = layers[i]
        out.append(kv_from_hidden(lm, i, h[0], rope))
        if i + 1 < stop:
            h = layer(h, attention_mask=mask, position_embeddings=rope[:2], position_ids=rope[2])
            if isinstance(h, tuple):
                h = h[0]
    return out
