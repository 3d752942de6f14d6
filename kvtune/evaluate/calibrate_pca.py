"""Fit the PCA basis of a model's KV cache on real calibration contexts.

The ``pca`` transform and the ``dp-alloc`` quantizer (:mod:`kvtune.codecs.pca`,
:mod:`kvtune.codecs.bitalloc`; KVTC, "KV Cache Transform Coding for Compact Storage in LLM
Inference", arXiv 2511.01815, sec. 3) need a basis fitted offline on calibration KV. This
module prefills the contexts with the model (:func:`kvtune.evaluate.capture.capture`), reads
the rotary embedding of every layer from the loaded Hugging Face model (so the codec library
stays model-agnostic: the basis carries the frequencies) and fits the basis.
"""

from __future__ import annotations

from typing import Any

import torch

from kvtune.codecs.pca import PCABasis, RopeSpec, fit_pca_basis
from kvtune.core.errors import ModelLayoutError
from kvtune.evaluate.model import LoadedModel

__all__ = ["model_rope", "calibrate_pca_basis"]


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


@torch.inference_mode()
def calibrate_pca_basis(lm: LoadedModel, input_ids: torch.Tensor, *, key_rope: str = "pre", mode: str = "joint",
                        info: dict[str, Any] | None = None) -> PCABasis:
    """Prefill ``input_ids`` and fit a :class:`~kvtune.codecs.pca.PCABasis` on their KV.

    Args:
        lm: the model.
        input_ids: ``(N, T)`` int64 calibration contexts (e.g. a workload's
            ``calibration_ids()``); every token is a calibration sample of every layer.
        key_rope: ``"pre"`` (keys un-rotated with :func:`model_rope`) or ``"post"``.
        mode: ``"joint"`` (across KV heads) or ``"per_head"``.
        info: extra provenance stored in the basis.

    Raises:
        ModelLayoutError: ``key_rope="pre"`` on a model whose rotary embedding cannot be read.
        BasisError: no tokens, or a bad mode.
    """
    from kvtune.evaluate.capture import capture

    rope = model_rope(lm) if key_rope == "pre" else ()
    cap = capture(lm, input_ids, int(input_ids.shape[1]), baseline=False)
    contexts = [cap.context_kv(i) for i in range(cap.num_contexts)]
    meta = {"model": lm.name, "contexts": int(input_ids.shape[0]), "tokens": int(input_ids.shape[1]), **(info or {})}
    return fit_pca_basis(contexts, mode=mode, key_rope=key_rope, rope=rope, info=meta)
