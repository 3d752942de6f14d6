"""Fit the PCA basis of a model's KV cache on real calibration contexts.

The ``pca`` transform and the ``dp-alloc`` quantizer (:mod:`kvtune.codecs.pca`,
:mod:`kvtune.codecs.bitalloc`; KVTC, "KV Cache Transform Coding for Compact Storage in LLM
Inference", arXiv 2511.01815, sec. 3) need a basis fitted offline on calibration KV. This
module prefills the contexts with the model (:func:`kvtune.evaluate.capture.capture`), reads
the rotary embedding of every layer from the loaded Hugging Face model (so the codec library
stays model-agnostic: the basis carries the frequencies) and fits the basis.

It also measures each layer's **sensitivity** (:func:`layer_sensitivity`): the mean squared
gradient of the model's loss on the last tokens of each calibration window with respect to
the KV of the tokens before them, which ``dp-alloc``'s model-wide budget weighs each layer's
quantization error by (:func:`kvtune.codecs.bitalloc.allocate_across_layers`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from kvtune.codecs.pca import ROPE_MODES, BasisError, PCABasis, RopeSpec, fit_pca_basis
from kvtune.core.errors import ModelLayoutError
from kvtune.evaluate.model import LoadedModel, cache_to_kv, forward_cache, kv_to_cache

__all__ = ["model_rope", "calibrate_pca_basis", "kv_gradients", "layer_sensitivity", "sensitivity_windows",
           "SENSITIVITY_FLOOR"]

SENSITIVITY_FLOOR = 1e-6
"""Smallest sensitivity of a layer, relative to the largest of its kind: a layer whose KV the
calibration loss does not measurably depend on still gets a finite (coarse) step."""


def model_rope(lm: LoadedModel) -> tuple[RopeSpec, ...]:
    """Per layer, the rotary inverse frequencies and attention scaling the model applies to keys.

    Reads the model's one ``rotary_emb`` module: ``inv_freq`` (or ``<layer_type>_inv_freq`` for
    models with a rotary embedding per attention type) and ``attention_scaling`` (or
    ``<layer_type>_attention_scaling``; 1.0 when absent).

    Raises:
        ModelLayoutError: no or several rotary embedding modules, or no inverse frequencies.
    """
    mods = [m for name, m in lm.model.named_modules() if name.endswith("rotary_emb")]
    if len(mods) != 1:
        raise ModelLayoutError(f"pre-RoPE PCA needs the model's rotary embedding: found {len(mods)} 'rotary_emb' modules")
    rot = mods[0]
    specs = []
    for kind in lm.layer_types:
        inv = getattr(rot, f"{kind}_inv_freq", None)
        inv = getattr(rot, "inv_freq", None) if inv is None else inv
        if not isinstance(inv, torch.Tensor) or inv.dim() != 1:
            raise ModelLayoutError(f"the rotary embedding {type(rot).__name__} has no inverse frequencies for {kind}")
        scaling = getattr(rot, f"{kind}_attention_scaling", None)
        scaling = getattr(rot, "attention_scaling", 1.0) if scaling is None else scaling
        specs.append(RopeSpec(inv.detach().to("cpu", torch.float32).clone(), float(scaling)))
    return tuple(specs)


def kv_gradients(lm: LoadedModel, input_ids: torch.Tensor, context_tokens: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Gradient of the summed next-token loss of ``input_ids[:, context_tokens:]`` with respect
    to the KV cache of ``input_ids[:, :context_tokens]``, the cache held fixed (the
    continuation reads it; the prefill that made it is not differentiated).

    Args:
        lm: the model.
        input_ids: ``(1, T)`` int64, ``T >= context_tokens + 2`` (the loss scores the
            continuation's tokens after its first).
        context_tokens: tokens whose KV is differentiated, ``>= 1``.

    Returns:
        Per layer float32 ``(dL/dK, dL/dV)`` on the CPU, each ``(1, kv_heads, tokens, head_dim)``
        like the cache (post-RoPE keys; a sliding-window layer holds its last positions).

    Raises:
        BasisError: ``context_tokens`` or ``T`` out of range.
    """
    total = int(input_ids.shape[1])
    if input_ids.shape[0] != 1 or not 1 <= context_tokens <= total - 2:
        raise BasisError(f"kv_gradients: need one (1, T) context with 1 <= context_tokens <= T - 2; got "
                         f"{tuple(input_ids.shape)} and context_tokens = {context_tokens}")
    ids = input_ids.to(lm.device)
    with torch.inference_mode():
        kv = cache_to_kv(forward_cache(lm.model(input_ids=ids[:, :context_tokens], use_cache=True, logits_to_keep=1)))
    with torch.inference_mode(False), torch.enable_grad():
        leaves = [(k.clone().requires_grad_(True), v.clone().requires_grad_(True)) for k, v in kv]
        cache = kv_to_cache(leaves, lm.model.config, context_tokens=context_tokens)
        logits = lm.model(input_ids=ids[:, context_tokens:], cache=cache, use_cache=True).logits
        loss = torch.nn.functional.cross_entropy(logits[0, :-1].float(), ids[0, context_tokens + 1 :], reduction="sum")
        grads = torch.autograd.grad(loss, [t for pair in leaves for t in pair], allow_unused=True)
    out = []
    for i, (k, v) in enumerate(leaves):
        gk, gv = grads[2 * i], grads[2 * i + 1]
        out.append(tuple(torch.zeros(t.shape) if g is None else g.detach().to("cpu", torch.float32)
                         for g, t in ((gk, k), (gv, v))))
    return out


def sensitivity_windows(input_ids: torch.Tensor, *, target_tokens: int = 128, skip_tokens: int = 4
                        ) -> tuple[int, int, int, int]:
    """``(windows, tokens, scored, context)`` of :func:`layer_sensitivity` on ``(N, T)`` ``input_ids``.

    Raises:
        BasisError: ``target_tokens < 1``, ``skip_tokens < 0``, no window, or windows too short
            to leave a context after ``skip_tokens`` and the scored tokens.
    """
    n, total = (int(v) for v in input_ids.shape)
    if target_tokens < 1 or skip_tokens < 0:
        raise BasisError(f"layer_sensitivity: target_tokens = {target_tokens} must be >= 1 and skip_tokens = "
                         f"{skip_tokens} >= 0")
    target = max(2, min(target_tokens, total // 8))
    context = total - target
    if n < 1 or context <= skip_tokens:
        raise BasisError(f"layer_sensitivity: {n} windows of {total} tokens leave no context after the "
                         f"{skip_tokens} skipped tokens and {target} scored ones")
    return n, total, target, context


def layer_sensitivity(lm: LoadedModel, input_ids: torch.Tensor, *, key_rope: str = "pre", target_tokens: int = 128,
                      skip_tokens: int = 4) -> tuple[tuple[float, float], ...]:
    """Per layer ``(key, value)`` sensitivity of the model's loss to errors in its KV.

    Each calibration window's last ``max(2, min(target_tokens, T // 8))`` tokens are scored
    (next-token cross-entropy, summed) on the KV of the tokens before them
    (:func:`kv_gradients`); a layer's sensitivity is the mean over windows, tokens after the
    first ``skip_tokens`` (attention sinks, which ``dp-alloc`` keeps in bfloat16) and channels of
    the squared gradient: to second order (diagonal Fisher, KVQuant, arXiv 2401.18079, sec.
    3.2) the loss grows by the sensitivity times the squared error of one coefficient. PCA
    coefficients share it (the basis is orthonormal); with ``key_rope="pre"`` the rotary
    channels' squared gradients are multiplied by the RoPE attention scaling squared (the
    error of a pre-RoPE coefficient reaches the cache scaled by it). Layers below
    :data:`SENSITIVITY_FLOOR` of the largest of their kind are raised to it.

    Args:
        lm: the model.
        input_ids: ``(N, T)`` int64 calibration windows, ``T >= skip_tokens + 3``.
        key_rope: ``"pre"`` or ``"post"``, as the basis the sensitivity goes with.
        target_tokens: most scored tokens per window, >= 1.
        skip_tokens: first tokens left out of the mean, >= 0.

    Returns:
        One ``(key, value)`` pair of floats > 0 per layer.

    Raises:
        BasisError: bad arguments or windows too short (:func:`sensitivity_windows`), an unknown
            ``key_rope``, or no layer of a kind with a non-zero gradient.
        ModelLayoutError: ``key_rope="pre"`` on a model whose rotary embedding cannot be read.
    """
    n, total, target, context = sensitivity_windows(input_ids, target_tokens=target_tokens, skip_tokens=skip_tokens)
    if key_rope not in ROPE_MODES:
        raise BasisError(f"layer_sensitivity: key_rope = {key_rope!r} must be one of {ROPE_MODES}")
    rope = model_rope(lm) if key_rope == "pre" else None
    sums: list[list[float]] = []
    counts: list[list[int]] = []
    for i in range(n):
        for layer, pair in enumerate(kv_gradients(lm, input_ids[i : i + 1], context)):
            if layer == len(sums):
                sums.append([0.0, 0.0])
                counts.append([0, 0])
            for j, g in enumerate(pair):
                g = g[:, :, skip_tokens:].double() if g.shape[2] == context else g.double()  # sliding: last positions
                sq = g.square()
                if j == 0 and rope is not None:
                    r = 2 * rope[layer].inv_freq.numel()
                    sq[..., :r] *= rope[layer].scaling ** 2
                sums[layer][j] += float(sq.sum())
                counts[layer][j] += sq.numel()
    means = [[s / max(c, 1) for s, c in zip(row, cnt)] for row, cnt in zip(sums, counts)]
    tops = [max(row[j] for row in means) for j in (0, 1)]
    if not all(t > 0 for t in tops):
        raise BasisError("layer_sensitivity: the calibration loss has no gradient with respect to the KV")
    return tuple(tuple(max(row[j], SENSITIVITY_FLOOR * tops[j]) for j in (0, 1)) for row in means)


@torch.inference_mode()
def calibrate_pca_basis(lm: LoadedModel, input_ids: torch.Tensor, *, key_rope: str = "pre", mode: str = "joint",
                        info: dict[str, Any] | None = None, sensitivity: bool = True) -> PCABasis:
    """Prefill ``input_ids`` and fit a :class:`~kvtune.codecs.pca.PCABasis` on their KV.

    Args:
        lm: the model.
        input_ids: ``(N, T)`` int64 calibration contexts (e.g. a workload's
            ``calibration_ids()``); every token is a calibration sample of every layer.
        key_rope: ``"pre"`` (keys un-rotated with :func:`model_rope`) or ``"post"``.
        mode: ``"joint"`` (across KV heads) or ``"per_head"``.
        info: extra provenance stored in the basis.
        sensitivity: also measure :func:`layer_sensitivity` on the same windows (stored as
            :attr:`~kvtune.codecs.pca.PCABasis.sensitivity`, for ``dp-alloc``'s ``budget="model"``).

    Raises:
        ModelLayoutError: ``key_rope="pre"`` on a model whose rotary embedding cannot be read.
        BasisError: no tokens, a bad mode, or (``sensitivity``) windows too short for it.
    """
    from kvtune.evaluate.capture import capture

    if sensitivity:
        sensitivity_windows(input_ids)  # windows long enough, before the slow work
    rope = model_rope(lm) if key_rope == "pre" else ()
    cap = capture(lm, input_ids, int(input_ids.shape[1]), baseline=False)
    contexts = [cap.context_kv(i) for i in range(cap.num_contexts)]
    meta = {"model": lm.name, "contexts": int(input_ids.shape[0]), "tokens": int(input_ids.shape[1]), **(info or {})}
    basis = fit_pca_basis(contexts, mode=mode, key_rope=key_rope, rope=rope, info=meta)
    del cap, contexts
    if not sensitivity:
        return basis
    with torch.inference_mode(False):
        return dataclasses.replace(basis, sensitivity=layer_sensitivity(lm, input_ids, key_rope=key_rope))
