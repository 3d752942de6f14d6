"""Bidirectional-encoder adapters: run a request with the shared prefix reused up to depth d.

BiCache ("Enabling KV Caching of Shared Prefix for Diffusion Language Models", arXiv 2606.07571),
Sec. 3. A request is ``prefix + suffix`` (token ids);
every token attends to every other token. With reuse depth ``d``:

* layers ``1..d``: only the suffix tokens are computed; their attention uses the prefix's
  keys/values of that layer *from the cache* (the prefix computed alone) and the suffix's own;
* the prefix's hidden state entering layer ``d + 1`` is taken from the cache as well;
* layers ``d + 1..L``: every token (prefix and suffix) is computed normally.

``d = 0`` is full recompute; ``d = L`` with an empty suffix returns the cache unchanged. The
skipped work is the prefix tokens' projections, attention and feed-forward in layers ``1..d``.

An adapter exposes three primitives per layer (embedding, K/V projection, the rest of the
layer given K/V) and the generic :meth:`EncoderAdapter.run` builds reuse on them, so the
same interface serves sentence encoders and the diffusion-LM loop (:mod:`kvtune.methods.bicache.dlm`).
Adapters are registered by ``config.model_type`` in :data:`ADAPTERS`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from kvtune.methods.bicache.state import PrefixState
from kvtune.core.registry import Registry
from kvtune.core.errors import BiCacheError, ModelLayoutError

__all__ = ["ADAPTERS", "BertFamilyAdapter", "EncoderAdapter", "ReuseOutput", "load_encoder", "register_adapter"]


@dataclass(frozen=True)
class ReuseOutput:
    """Result of :meth:`EncoderAdapter.run`.

    Attributes:
        hidden: ``(B, P + N, H)`` float32 last hidden states (prefix rows first).
        attention_mask: ``(B, P + N)`` bool, False at suffix padding.
        prefix_state: when ``capture=True``, the prefix's K/V/hidden per layer *as used in this
            run* (cached ones in layers ``<= d``, recomputed ones above), batch ``B``; else None.
        depth: the reuse depth used.
    """

    hidden: torch.Tensor
    attention_mask: torch.Tensor
    prefix_state: PrefixState | None
    depth: int


class EncoderAdapter(ABC):
    """A bidirectional transformer seen as embedding + L layers with explicit K/V.

    Subclasses implement :meth:`embed`, :meth:`project_kv` and :meth:`finish_layer`; the reuse
    logic in :meth:`run` is shared. All tensors float32 on :attr:`device`.
    """

    num_layers: int
    num_heads: int
    head_dim: int
    hidden_size: int
    max_positions: int
    device: torch.device
    model_type: str = ""
    name: str = ""

    @abstractmethod
    def embed(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Token + position (+ type) embeddings: ``ids (B, T)`` long, ``positions (T,)`` long
        (absolute index in the request) -> ``(B, T, H)``."""

    @abstractmethod
    def project_kv(self, layer: int, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of 0-based ``layer`` for inputs ``h (B, T, H)`` -> two
        ``(B, heads, T, head_dim)``."""

    @abstractmethod
    def finish_layer(self, layer: int, h_q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     mask: torch.Tensor) -> torch.Tensor:
        """The rest of layer ``layer`` for query rows ``h_q (B, Tq, H)`` attending to ``k, v
        (B, heads, Tk, head_dim)`` with key mask ``mask (B, Tk)`` bool -> ``(B, Tq, H)``."""

    # ------------------------------------------------------------------ shared logic

    def positions(self, start: int, count: int) -> torch.Tensor:
        """Absolute positions ``start .. start + count - 1`` (long, ``(count,)``)."""
        return torch.arange(start, start + count, device=self.device)

    def _layer(self, layer: int, h_q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        if h_q.shape[1] == 0:
            return h_q
        return self.finish_layer(layer, h_q, k, v, mask)

    @torch.inference_mode()
    def prefix_state(self, prefix_ids: Sequence[int]) -> PrefixState:
        """Run the prefix alone (full recompute, batch 1) and cache every layer's K/V and hidden.

        Returns:
            :class:`PrefixState` with ``depth = L``.
        """
        empty = torch.zeros(1, 0, dtype=torch.long, device=self.device)
        out = self.run(prefix_ids, empty, depth=0, capture=True)
        assert out.prefix_state is not None
        return out.prefix_state

    @torch.inference_mode()
    def run(
        self,
        prefix_ids: Sequence[int],
        suffix_ids: torch.Tensor,
        suffix_mask: torch.Tensor | None = None,
        *,
        depth: int = 0,
        state: PrefixState | None = None,
        capture: bool = False,
    ) -> ReuseOutput:
        """Encode ``prefix + suffix`` for a batch of requests sharing ``prefix_ids``.

        Args:
            prefix_ids: the shared prefix, P >= 1 token ids (e.g. ``[CLS]`` + instruction).
            suffix_ids: ``(B, N)`` long, each request's own tokens, right-padded.
            suffix_mask: ``(B, N)`` bool, False at padding (default: all True).
            depth: reuse depth d in ``0..L``; 0 = full recompute.
            state: the cached prefix state (required for ``d >= 1``; must cover ``d`` layers).
            capture: also return the prefix's per-layer K/V/hidden as used in this run.

        Returns:
            :class:`ReuseOutput`.

        Raises:
            BiCacheError: depth outside ``0..L``, missing or mismatching state, empty prefix,
                or a request longer than the encoder's positions.
        """
        L = self.num_layers
        if not 0 <= depth <= L:
            raise BiCacheError(f"reuse depth {depth} outside 0..{L} for {self.name or self.model_type}")
        P = len(prefix_ids)
        if P == 0:
            raise BiCacheError("the shared prefix must hold at least one token")
        suffix_ids = suffix_ids.to(self.device)
        B, N = suffix_ids.shape
        if P + N > self.max_positions:
            raise BiCacheError(f"request of {P + N} tokens exceeds the encoder's {self.max_positions} positions")
        smask = torch.ones(B, N, dtype=torch.bool, device=self.device) if suffix_mask is None else suffix_mask.to(self.device).bool()
        mask = torch.cat([torch.ones(B, P, dtype=torch.bool, device=self.device), smask], dim=1)
        pre = torch.as_tensor(list(prefix_ids), dtype=torch.long, device=self.device).unsqueeze(0).expand(B, P)
        cap_k: list[torch.Tensor] = []
        cap_v: list[torch.Tensor] = []
        cap_h: list[torch.Tensor] = []
        if depth == 0:
            h = self.embed(torch.cat([pre, suffix_ids], dim=1), self.positions(0, P + N))
            if capture:
                cap_h.append(h[:, :P])
        else:
            if state is None:
                raise BiCacheError(f"reuse depth {depth} needs the cached prefix state (EncoderAdapter.prefix_state)")
            state.check_covers(prefix_ids, depth)
            hs = self.embed(suffix_ids, self.positions(P, N))
            for layer in range(depth):
                ks, vs = self.project_kv(layer, hs)
                k = torch.cat([state.keys[layer].expand(B, -1, -1, -1), ks], dim=2)
                v = torch.cat([state.values[layer].expand(B, -1, -1, -1), vs], dim=2)
                hs = self._layer(layer, hs, k, v, mask)
                if capture:
                    cap_k.append(state.keys[layer].expand(B, -1, -1, -1))
                    cap_v.append(state.values[layer].expand(B, -1, -1, -1))
            if capture:
                cap_h = [state.hiddens[i].expand(B, -1, -1) for i in range(depth + 1)]
            h = torch.cat([state.hiddens[depth].expand(B, -1, -1), hs], dim=1)
        for layer in range(depth, L):
            k, v = self.project_kv(layer, h)
            h = self._layer(layer, h, k, v, mask)
            if capture:
                cap_k.append(k[:, :, :P])
                cap_v.append(v[:, :, :P])
                cap_h.append(h[:, :P])
        captured = None
        if capture:
            captured = PrefixState(tuple(int(t) for t in prefix_ids), tuple(cap_k), tuple(cap_v), tuple(cap_h), L)
        return ReuseOutput(h, mask, captured, depth)

    def describe(self) -> dict[str, Any]:
        """Geometry for run records."""
        return {
            "name": self.name, "model_type": self.model_type, "num_layers": self.num_layers,
            "num_heads": self.num_heads, "head_dim": self.head_dim, "hidden_size": self.hidden_size,
            "max_positions": self.max_positions,
        }


class BertFamilyAdapter(EncoderAdapter):
    """BERT-family encoders of transformers (post-LayerNorm layers with ``attention.self.query
    /key/value``, ``attention.output``, ``intermediate``, ``output``): BERT, MiniLM,
    sentence-transformers BERT encoders. Accepts a ``BertModel`` or a model with a ``.bert``
    base and an MLM head ``.cls`` (``BertForMaskedLM``, used by the diffusion-LM path).

    The layer math mirrors transformers' ``BertLayer`` (eval mode, no dropout), with
    ``torch.nn.functional.scaled_dot_product_attention`` and a boolean key mask.
    """

    model_type = "bert"

    def __init__(self, model: Any, *, name: str = "") -> None:
        base = getattr(model, "bert", model)
        for attr in ("embeddings", "encoder"):
            if not hasattr(base, attr):
                raise ModelLayoutError(f"{type(model).__name__} has no .{attr}: not a BERT-family encoder")
        cfg = base.config
        if getattr(cfg, "position_embedding_type", "absolute") not in ("absolute", None):
            raise ModelLayoutError(f"position_embedding_type {cfg.position_embedding_type!r} is not supported (absolute only)")
        model.eval()
        self.model = model
        self.base = base
        self.mlm_head = getattr(model, "cls", None)
        self.layers = base.encoder.layer
        self.num_layers = len(self.layers)
        self.num_heads = int(cfg.num_attention_heads)
        self.hidden_size = int(cfg.hidden_size)
        self.head_dim = self.hidden_size // self.num_heads
        self.max_positions = int(cfg.max_position_embeddings)
        self.device = next(base.parameters()).device
        self.name = name or str(getattr(cfg, "_name_or_path", "") or "bert")
        self.config = cfg

    def embed(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.base.embeddings(input_ids=ids, position_ids=positions.unsqueeze(0).expand(ids.shape[0], -1),
                                    token_type_ids=torch.zeros_like(ids))

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        return x.view(B, T, self.num_heads, self.head_dim).transpose(1, 2)

    def project_kv(self, layer: int, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        att = self.layers[layer].attention.self
        return self._heads(att.key(h)), self._heads(att.value(h))

    def finish_layer(self, layer: int, h_q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     mask: torch.Tensor) -> torch.Tensor:
        lay = self.layers[layer]
        q = self._heads(lay.attention.self.query(h_q))
        ctx = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None, None, :])
        ctx = ctx.transpose(1, 2).reshape(h_q.shape)
        a = lay.attention.output(ctx, h_q)  # dense, residual, LayerNorm
        return lay.output(lay.intermediate(a), a)

    def mlm_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Masked-LM logits ``(B, T, vocab)`` for hidden states ``(B, T, H)``.

        Raises:
            ModelLayoutError: the model has no MLM head (a plain encoder).
        """
        if self.mlm_head is None:
            raise ModelLayoutError(f"{self.name}: no masked-LM head (load a *ForMaskedLM model for the diffusion loop)")
        return self.mlm_head(hidden)


#: ``config.model_type`` -> adapter class. Add a family with :func:`register_adapter`.
ADAPTERS: Registry[type[EncoderAdapter]] = Registry("BiCache adapter (model_type)")


def register_adapter(*model_types: str) -> Callable[[type[EncoderAdapter]], type[EncoderAdapter]]:
    """Class decorator: register an adapter for transformers ``model_type`` names."""

    return ADAPTERS.decorator(*model_types)


register_adapter("bert")(BertFamilyAdapter)


def adapter_for(model: Any, *, name: str = "") -> EncoderAdapter:
    """The registered adapter wrapping a loaded transformers model.

    Raises:
        BiCacheError: no adapter for the model's ``model_type``.
    """
    mt = str(getattr(model.config, "model_type", ""))
    if mt not in ADAPTERS:
        raise BiCacheError(f"no BiCache adapter for model_type {mt!r}; supported: {sorted(ADAPTERS)}")
    return ADAPTERS[mt](model, name=name)


def load_encoder(spec: str, *, device: str = "cpu", masked_lm: bool = False) -> tuple[EncoderAdapter, Any]:
    """Load a bidirectional encoder and its tokenizer: a named model asset or a local folder.

    Args:
        spec: asset name (e.g. ``all-minilm-l6-v2``) or a folder ``AutoModel.from_pretrained`` reads.
        device: torch device.
        masked_lm: load ``AutoModelForMaskedLM`` (the diffusion-LM path needs the MLM head).

    Returns:
        ``(adapter, tokenizer)``.

    Raises:
        AssetError: a named asset cannot be fetched or verified.
        BiCacheError: no adapter for the model family, the path does not exist, is a file,
            or holds no loadable model and tokenizer.
    """
    from transformers import AutoModel, AutoModelForMaskedLM, AutoTokenizer

    from kvtune.evaluate.assets import ASSETS, resolve_asset

    if spec in ASSETS:
        path = resolve_asset(spec)
    else:
        path = Path(spec).expanduser()
        if not path.exists():
            known = ", ".join(a.name for a in ASSETS.values() if a.kind == "model")
            raise BiCacheError(f"--model {spec!r} is neither a model asset ({known}) nor an existing folder")
    if not path.is_dir():
        raise BiCacheError(f"--model {spec!r}: {path} is a file; expected a Hugging Face model folder")
    cls = AutoModelForMaskedLM if masked_lm else AutoModel
    try:
        model = cls.from_pretrained(str(path), attn_implementation="sdpa").to(device).float().eval()
        tok = AutoTokenizer.from_pretrained(str(path))
    except (OSError, ValueError, KeyError) as exc:  # no config.json / weights / tokenizer files there
        raise BiCacheError(f"--model {spec!r}: cannot load a model from {path} "
                           f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})") from None
    return adapter_for(model, name=spec), tok
