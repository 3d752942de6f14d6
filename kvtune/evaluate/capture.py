"""Real contexts and their KV caches, captured once per run.

Each candidate policy then costs only its own encode/decode plus one continuation forward
pass on the decoded cache (the disaggregated-serving split: prefill builds the KV cache, it
crosses the wire compressed, decode continues from it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvtune.core.errors import KvtuneError
from kvtune.evaluate.model import (
    KVLayers,
    LoadedModel,
    cache_to_kv,
    forward_cache,
    kv_to_cache,
    start_tokens,
)


@dataclass
class Capture:
    """Prefill KV caches and the baseline continuation of N real contexts.

    Attributes:
        input_ids: ``(N, T + C)`` int64 token ids: T context tokens then C continuation tokens.
        context_tokens: T.
        kv: per-layer ``(K, V)`` storage, each ``(N, kv_heads, tokens, head_dim)``; ``tokens``
            is T, or fewer for a sliding-window layer (the positions it keeps). Held in the
            model dtype, or in bfloat16 for ``kv_dtype="bfloat16"`` (the values are bf16
            already: half the memory, nothing lost); :meth:`context_kv` and
            :meth:`batch_kv` give them in the model dtype.
        baseline_logits: ``(N, C, vocab)`` float32 logits of the continuation run on the
            original (uncompressed) cache (position i predicts continuation token i + 1), or
            an empty tensor when the capture was made without them.
        dtype: the model dtype the KV is used in (None: the storage dtype).
    """

    input_ids: torch.Tensor
    context_tokens: int
    kv: KVLayers
    baseline_logits: torch.Tensor
    dtype: torch.dtype | None = None

    @property
    def num_contexts(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def continuation_ids(self) -> torch.Tensor:
        """``(N, C)`` continuation tokens fed on the decode side."""
        return self.input_ids[:, self.context_tokens :]

    def batch_kv(self, start: int, stop: int) -> KVLayers:
        """KV of contexts ``start:stop``: per layer ``(stop - start, kv_heads, tokens, head_dim)``
        in the model dtype (views when stored in it, copies otherwise)."""
        dtype = self.dtype or self.kv[0][0].dtype
        return [(k[start:stop].to(dtype), v[start:stop].to(dtype)) for k, v in self.kv]

    def context_kv(self, i: int) -> KVLayers:
        """KV of context ``i`` alone: per layer ``(1, kv_heads, tokens, head_dim)`` in the model
        dtype (see :meth:`batch_kv`)."""
        return self.batch_kv(i, i + 1)

    def subset(self, n: int) -> "Capture":
        """The first ``n`` contexts (KV views; the baseline logits are *not* sliced: recompute
        them with :func:`continuation_logits` so that batching matches the evaluated runs)."""
        return Capture(input_ids=self.input_ids[:n], context_tokens=self.context_tokens,
                       kv=[(k[:n], v[:n]) for k, v in self.kv], baseline_logits=torch.empty(0), dtype=self.dtype)

    @property
    def kv_nbytes(self) -> int:
        """Bytes of the stored KV."""
        return sum(t.numel() * t.element_size() for layer in self.kv for t in layer)


def token_stream(tokenizer, documents: list[tuple[str, str]]) -> list[int]:
    """The documents' token ids in the given order, each followed by the EOS token (when the
    tokenizer has one): the text :func:`build_contexts` cuts its windows from."""
    sep = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    stream: list[int] = []
    for _, text in documents:
        stream.extend(tokenizer(text, add_special_tokens=False)["input_ids"])
        stream.extend(sep)
    return stream


def window_starts(stream_tokens: int, n_windows: int, window: int) -> list[int]:
    """Start offsets of :func:`build_contexts`' windows: ``n_windows`` windows of ``window``
    tokens at evenly spaced offsets of a stream of ``stream_tokens`` tokens (the first at 0;
    with ``n_windows * window <= stream_tokens`` they never overlap)."""
    stride = (stream_tokens - window) // max(n_windows - 1, 1)
    return [i * stride for i in range(n_windows)]


def build_contexts(
    tokenizer, documents: list[tuple[str, str]], *, n_contexts: int, context_tokens: int,
    continuation_tokens: int,
) -> torch.Tensor:
    """Cut ``n_contexts`` windows of ``context_tokens + continuation_tokens`` real tokens.

    Documents are tokenized in name order and joined with the EOS token; windows start at
    evenly spaced offsets of that stream, so contexts span different documents and the run is
    deterministic. When the tokenizer starts every text with special tokens (Gemma's
    ``<bos>``; SmolLM2 has none), each window starts with them too (they count in
    ``context_tokens``): such models degrade badly without them.

    Returns:
        ``(n_contexts, context_tokens + continuation_tokens)`` int64 tensor.

    Raises:
        KvtuneError: the text is too short for the requested windows (the message gives the
            number of tokens available).
    """
    if n_contexts < 1 or context_tokens < 1 or continuation_tokens < 2:
        raise KvtuneError("need --contexts >= 1, --context-tokens >= 1 and --continuation-tokens >= 2")
    stream = token_stream(tokenizer, documents)
    head = start_tokens(tokenizer)
    window = context_tokens + continuation_tokens - len(head)
    if window < continuation_tokens + 1:
        raise KvtuneError(f"--context-tokens {context_tokens} is too short for the tokenizer's {len(head)} start tokens")
    if len(stream) < n_contexts * window:
        raise KvtuneError(
            f"the text has {len(stream)} tokens, fewer than {n_contexts} contexts x {window} tokens; "
            "use fewer or shorter contexts, or more text"
        )
    rows = [head + stream[s : s + window] for s in window_starts(len(stream), n_contexts, window)]
    return torch.tensor(rows, dtype=torch.long)


def gap_window_starts(stream_tokens: int, taken: list[int], taken_window: int, n_windows: int,
                      window: int) -> list[int]:
    """Start offsets of ``n_windows`` windows of ``window`` tokens that share no position with
    the windows ``[t, t + taken_window)`` for ``t`` in ``taken`` (sorted, non-overlapping):
    the free stretches (between those windows and after the last) are cut into slots of
    ``window`` tokens, and ``n_windows`` slots evenly spread over them are returned, in order.

    Returns:
        The starts (an empty list for ``n_windows == 0``).

    Raises:
        KvtuneError: fewer than ``n_windows`` slots fit (the message names ``--contexts`` and
            ``--context-tokens``); ``n_windows < 0`` or ``window < 1``.
    """
    if n_windows < 0 or window < 1:
        raise KvtuneError(f"need >= 0 calibration windows of >= 1 token, got {n_windows} x {window}")
    edges = [t + taken_window for t in taken]
    ends = taken[1:] + [stream_tokens]
    slots = [a + j * window for a, b in zip(edges, ends) for j in range(max(b - a, 0) // window)]
    if len(slots) < n_windows:
        raise KvtuneError(
            f"the text has {stream_tokens} tokens: beside the {len(taken)} evaluation windows of {taken_window} "
            f"tokens there is room for {len(slots)} calibration windows of {window} tokens, not {n_windows}; "
            "use fewer --contexts or a shorter --context-tokens / --continuation-tokens, or more text")
    return [slots[j * len(slots) // n_windows] for j in range(n_windows)]


def build_calibration_contexts(
    tokenizer, documents: list[tuple[str, str]], *, n_contexts: int, context_tokens: int,
    continuation_tokens: int, calibration_contexts: int, calibration_tokens: int,
) -> torch.Tensor:
    """Calibration windows that share no token of the text with :func:`build_contexts`' windows.

    ``calibration_contexts`` windows of ``calibration_tokens`` tokens (start tokens included,
    as in :func:`build_contexts`) placed in the text between and after the evaluation windows
    of ``build_contexts(tokenizer, documents, n_contexts=..., context_tokens=...,
    continuation_tokens=...)`` (:func:`gap_window_starts`). For calibrations that must not see
    the evaluated text, e.g. the PCA basis of KVTC ("KV Cache Transform Coding for Compact
    Storage in LLM Inference", arXiv 2511.01815, sec. 3), fitted once on data apart from the
    evaluation.

    Returns:
        ``(calibration_contexts, calibration_tokens)`` int64 tensor.

    Raises:
        KvtuneError: the text cannot hold the evaluation windows, or not these calibration
            windows beside them (the message names ``--contexts`` and ``--context-tokens``), or
            ``calibration_tokens`` not longer than the tokenizer's start tokens.
    """
    stream = token_stream(tokenizer, documents)
    head = start_tokens(tokenizer)
    window = context_tokens + continuation_tokens - len(head)
    calib = calibration_tokens - len(head)
    if calib < 1:
        raise KvtuneError(f"calibration windows of {calibration_tokens} tokens are too short for the tokenizer's "
                          f"{len(head)} start tokens")
    if n_contexts < 1 or window < 1 or len(stream) < n_contexts * window:
        raise KvtuneError(f"the text has {len(stream)} tokens, fewer than {n_contexts} contexts x {window} tokens; "
                          "use fewer --contexts or a shorter --context-tokens, or more text")
    taken = window_starts(len(stream), n_contexts, window)
    starts = gap_window_starts(len(stream), taken, window, calibration_contexts, calib)
    return torch.tensor([head + stream[s : s + calib] for s in starts], dtype=torch.long).reshape(len(starts), -1)


#: Storage dtype of captured KV per ``--kv-dtype`` (None: the model's own dtype).
STORAGE_DTYPES = {"model": None, "bfloat16": torch.bfloat16}


@torch.inference_mode()
def capture(lm: LoadedModel, input_ids: torch.Tensor, context_tokens: int, *, batch_size: int = 4,
            progress=None, kv_dtype: str = "model", baseline: bool = True) -> Capture:
    """Run prefill on the contexts, keep their KV, and compute the baseline continuation.

    The KV of each prefill batch is copied into storage allocated once for all contexts
    (no per-batch list joined at the end, which held the KV twice).

    Args:
        lm: the loaded model.
        input_ids: ``(N, T + C)`` from :func:`build_contexts`.
        context_tokens: T.
        batch_size: contexts per prefill forward pass (memory vs speed).
        progress: optional callable ``advance(n)`` called after each batch.
        kv_dtype: ``model`` keeps the captured KV as computed; ``bfloat16`` rounds it to
            bfloat16 values before the baseline runs (so the uncompressed bf16 policy is
            exactly lossless) and stores it in bfloat16.
        baseline: compute ``baseline_logits`` (``(N, C, vocab)`` float32); False leaves them
            empty (a caller keeping a compact baseline of its own).

    Returns:
        A :class:`Capture`; its KV stays on the model's device. Sliding-window layers hold
        only the positions their cache keeps (``lm.kv_tokens(T)``).

    Raises:
        KvtuneError: ``kv_dtype`` is not one of :data:`~kvtune.evaluate.model.KV_DTYPES`.
    """
    if kv_dtype not in STORAGE_DTYPES:
        raise KvtuneError(f"--kv-dtype must be one of {', '.join(STORAGE_DTYPES)}, not {kv_dtype!r}")
    n = input_ids.shape[0]
    store: KVLayers = []
    model_dtype = None
    for start in range(0, n, batch_size):
        ids = input_ids[start : start + batch_size, :context_tokens].to(lm.device)
        out = lm.model(input_ids=ids, use_cache=True, logits_to_keep=1)
        layers = cache_to_kv(forward_cache(out))
        if not store:
            model_dtype = layers[0][0].dtype
            dtype = STORAGE_DTYPES[kv_dtype] or model_dtype
            store = [(k.new_empty((n, *k.shape[1:]), dtype=dtype), v.new_empty((n, *v.shape[1:]), dtype=dtype))
                     for k, v in layers]
        for (sk, sv), (k, v) in zip(store, layers):
            sk[start : start + ids.shape[0]].copy_(k)  # to bf16: round to nearest even, as Tensor.to
            sv[start : start + ids.shape[0]].copy_(v)
        del out, layers
        if progress:
            progress(ids.shape[0])
    cap = Capture(input_ids=input_ids, context_tokens=context_tokens, kv=store, baseline_logits=torch.empty(0),
                  dtype=model_dtype)
    if baseline:
        cap.baseline_logits = continuation_logits(lm, cap, cap.kv)
    return cap


@torch.inference_mode()
def continuation_logits(lm: LoadedModel, cap: Capture, kv: KVLayers, *, batch_size: int = 8) -> torch.Tensor:
    """Logits of the continuation tokens run on top of the given (possibly decoded) cache.

    Args:
        kv: per layer ``(N, kv_heads, tokens, head_dim)``, same shapes as ``cap.kv`` (any float
            dtype: each batch is converted to the model's dtype).

    Returns:
        ``(N, C, vocab)`` float32 logits on the CPU.
    """
    return logits_on_cache(lm, kv, cap.continuation_ids, cap.context_tokens, batch_size=batch_size)


@torch.inference_mode()
def logits_on_cache(lm: LoadedModel, kv: KVLayers, continuation_ids: torch.Tensor, context_tokens: int, *,
                    batch_size: int = 8, selected: bool = False) -> torch.Tensor:
    """Logits of ``continuation_ids`` ``(N, C)`` int64 run on top of the cache ``kv`` (per layer
    ``(N, kv_heads, tokens, head_dim)``, built from ``context_tokens`` tokens), ``batch_size``
    contexts per forward pass.

    With ``selected``, ``kv`` holds a token selection (``keep``, :mod:`kvtune.codecs.select`):
    ``tokens`` may be fewer than ``context_tokens``. The continuation then gets its true
    positions explicitly (``position_ids = context_tokens + i``, for RoPE), as kvpress does for
    pruned caches, while the causal mask covers the kept entries and the new tokens (the cache
    length gives the query offset).

    Returns:
        ``(N, C, vocab)`` float32 logits on the CPU.

    Raises:
        ConfigError: ``selected`` on a model with sliding-window layers (:func:`kv_to_cache`).
    """
    outs = []
    dtype = next(lm.model.parameters()).dtype
    extra = {}
    if selected:
        extra["position_ids"] = context_tokens + torch.arange(continuation_ids.shape[1], device=lm.device)[None]
    for start in range(0, continuation_ids.shape[0], batch_size):
        part = [(k[start : start + batch_size].to(dtype), v[start : start + batch_size].to(dtype)) for k, v in kv]
        cache = kv_to_cache(part, lm.model.config, context_tokens=context_tokens, selected=selected)
        ids = continuation_ids[start : start + batch_size].to(lm.device)
        logits = lm.model(input_ids=ids, cache=cache, use_cache=True, **extra).logits
        outs.append(logits.float().cpu())
        del cache, logits
    return outs[0] if len(outs) == 1 else torch.cat(outs)
