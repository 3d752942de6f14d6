"""How much memory a T/Q/C profile needs, estimated before the model loads.

A profile holds, for the whole run (N contexts of T tokens, C continuation tokens, a model
with L layers, H KV heads of dimension D, vocabulary V, P parameters):

- the **model**: ``P * 4`` bytes (weights in float32 on the CPU);
- the **captured KV** of every context: ``N * L * 2 * H * T * D * s`` bytes, ``s`` = 2 with
  ``--kv-dtype bfloat16`` (the default: stored in bf16), 4 with ``model`` (float32);

and, one at a time, the working set of either **prefill** (a batch of 4 contexts: their
float32 cache and the attention scores of one layer) or **one evaluation batch** (4 decoded
contexts in float32, the model's cache with the continuation appended, the batch's logits and
one log-softmax, the batch's rows of the baseline, the codec's copies of one context). On top
comes the Python runtime (torch, transformers, BoTorch imported: about 0.4 GB).

The **baseline** of the ``continuation`` workload, the uncompressed run's log-probabilities at
every continuation position (``N * C * V * 4`` bytes: exact KL needs the whole distribution),
is kept on disk in an unlinked temporary file (:mod:`kvtune.evaluate.spool`), one batch read
back per evaluation batch: it takes page cache, which the system reclaims, not resident memory.

So resident memory grows linearly with contexts (captured KV), with context tokens (KV and
the working set), with continuation tokens and vocabulary (working set) and with model size
(weights, and the KV through L * H * D); the spooled baseline grows with contexts,
continuation tokens and vocabulary. :func:`estimate_profile_memory` adds these up and
:func:`check_memory_fits` refuses a run that cannot fit, memory or temporary disk, before the
model loads. With Ray workers every worker holds its own copy (the driver holds none).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvtune.core.errors import ConfigError

__all__ = ["ModelShape", "MemoryEstimate", "RUNTIME_BYTES", "available_memory", "check_memory_fits",
           "estimate_profile_memory", "free_temporary_disk", "model_shape"]

#: Resident bytes of the Python runtime with torch, transformers and BoTorch imported
#: (measured 0.38 GiB on CPU; rounded up).
RUNTIME_BYTES = 400 * 2**20

#: Contexts per prefill and per evaluation batch (:func:`kvtune.evaluate.capture.capture`,
#: :attr:`kvtune.evaluate.workloads.continuation.ContinuationWorkload.batch_size`).
BATCH = 4


@dataclass(frozen=True)
class ModelShape:
    """What memory depends on in a model's configuration.

    Attributes:
        layers: decoder layers L; kv_heads: H; head_dim: D; heads: query heads;
        vocab: V; parameters: P (count).
    """

    layers: int
    kv_heads: int
    head_dim: int
    heads: int
    vocab: int
    parameters: int

    @classmethod
    def from_config(cls, config: Any) -> "ModelShape":
        """From a transformers config (text config of multimodal ones); P counted on the meta
        device (nothing allocated).

        Raises:
            ValueError, KeyError, AttributeError: a config without the decoder fields.
        """
        import torch
        from transformers import AutoModelForCausalLM

        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        heads = int(text.num_attention_heads)
        head_dim = int(getattr(text, "head_dim", None) or text.hidden_size // heads)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        return cls(layers=int(text.num_hidden_layers), kv_heads=int(getattr(text, "num_key_value_heads", heads)),
                   head_dim=head_dim, heads=heads, vocab=int(text.vocab_size),
                   parameters=sum(p.numel() for p in model.parameters()))


def model_shape(spec: str) -> ModelShape | None:
    """The :class:`ModelShape` of ``--model`` from its configuration alone (no weights read),
    or None when that cannot be had cheaply (a Hugging Face id not on disk, an unreadable
    file): the model's load then reports the problem."""
    from kvtune.evaluate.model import converted_dir, model_source

    try:
        from transformers import AutoConfig

        folder = converted_dir(spec)
        if folder is not None and (folder / "config.json").is_file():
            config = AutoConfig.from_pretrained(str(folder))
        else:
            src, kwargs = model_source(spec)
            if not Path(src).exists():
                return None
            config = AutoConfig.from_pretrained(src, **kwargs)
        return ModelShape.from_config(config)
    except Exception:  # any failure here is the load's to report, with its own message
        return None


@dataclass(frozen=True)
class MemoryEstimate:
    """Estimated peak resident bytes of one process profiling (module docstring).

    Attributes:
        parts: resident bytes by part: ``runtime``, ``model``, ``captured_kv``, ``baseline``
            (what stays in memory of it) and ``working_set`` (the larger of prefill and one
            evaluation batch).
        disk: bytes of the baseline spooled to the temporary folder.
    """

    parts: dict[str, int]
    disk: int = 0

    @property
    def total(self) -> int:
        """Bytes."""
        return sum(self.parts.values())

    def describe(self) -> str:
        """``"2.9 GB: runtime 0.42, model 0.54, ..."`` (GB = 1e9 bytes)."""
        text = f"{self.total / 1e9:.1f} GB: " + ", ".join(f"{k.replace('_', ' ')} {v / 1e9:.2f}"
                                                          for k, v in self.parts.items())
        return text + (f" (+ {self.disk / 1e9:.2f} GB of baseline on disk)" if self.disk else "")


def estimate_profile_memory(shape: ModelShape, *, contexts: int, context_tokens: int, continuation_tokens: int,
                            kv_dtype: str, workload: str = "continuation") -> MemoryEstimate:
    """Peak resident bytes of a profile of ``contexts`` contexts (module docstring).

    Other workloads than ``continuation`` hold per-sample KV in the model dtype and a small
    baseline (answers, scores); their context length is at most ``context_tokens``.
    """
    per_token = shape.layers * 2 * shape.kv_heads * shape.head_dim  # KV elements per token
    stored = 2 if kv_dtype == "bfloat16" and workload == "continuation" else 4
    t, c, n = context_tokens, continuation_tokens, contexts
    batch = min(BATCH, n)
    prefill = batch * per_token * t * 4 + batch * shape.heads * t * t * 4
    logits = batch * c * shape.vocab * 4
    continuation = workload == "continuation"
    evaluation = (batch * per_token * t * 4  # decoded contexts
                  + batch * per_token * (t + c) * 4  # the cache with the continuation appended
                  + (3 if continuation else 2) * logits  # logits, one log-softmax (+ the baseline's rows)
                  + 3 * per_token * t * 4)  # the codec's copies of one context
    return MemoryEstimate({
        "runtime": RUNTIME_BYTES,
        "model": shape.parameters * 4,
        "captured_kv": n * per_token * t * stored,
        "baseline": n * c * 20 if continuation else 0,  # per position: argmax, target (int64), NLL (float32)
        "working_set": max(prefill, evaluation),
    }, disk=n * c * shape.vocab * 4 if continuation else 0)


def available_memory() -> int:
    """Bytes of memory available to a new process now (``MemAvailable``)."""
    import psutil

    return int(psutil.virtual_memory().available)


def free_temporary_disk() -> int:
    """Free bytes in the temporary folder (``$TMPDIR``) where baselines are spooled."""
    import shutil
    import tempfile

    return int(shutil.disk_usage(tempfile.gettempdir()).free)


def check_memory_fits(estimate: MemoryEstimate, available: int | None = None, *, kv_dtype: str,
                      workers: int = 1, free_disk: int | None = None) -> None:
    """Refuse a run whose estimate (times ``workers`` processes on this machine) exceeds
    ``available`` bytes of memory (None: :func:`available_memory` now) or ``free_disk`` bytes
    of temporary disk (None: :func:`free_temporary_disk`).

    Raises:
        ConfigError: the message gives the estimate by part and names the settings to lower.
    """
    need = estimate.total * workers
    available = available_memory() if available is None else available
    free_disk = free_temporary_disk() if free_disk is None and estimate.disk else free_disk or 0
    if estimate.disk * workers > free_disk:
        raise ConfigError(f"this run spools {estimate.disk * workers / 1e9:.1f} GB of baseline log-probabilities to "
                          f"the temporary folder, which has {free_disk / 1e9:.1f} GB free; point $TMPDIR at a larger "
                          "disk, or lower --contexts or --continuation-tokens")
    if need <= available:
        return
    per = f" per worker x {workers} workers" if workers > 1 else ""
    dtype = "" if kv_dtype == "bfloat16" else ", or --kv-dtype bfloat16 (halves the captured KV)"
    raise ConfigError(f"this run needs about {estimate.describe()}{per}, but {available / 1e9:.1f} GB of memory "
                      f"is available; lower --contexts (or --samples: captured KV and baseline grow with it), "
                      f"--context-tokens or --continuation-tokens{dtype}"
                      + (", or use fewer --workers" if workers > 1 else ""))
