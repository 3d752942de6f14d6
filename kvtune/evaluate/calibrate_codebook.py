"""Offline calibration of non-uniform codebooks: ``codebook`` quantizers with ``levels="calibrated"``.

KVQuant ("KVQuant: Towards 10 Million Context Length LLM Inference with KV Cache Quantization",
arXiv 2401.18079, sec. 3.3) fits its non-uniform datatypes once, offline, per layer, on
calibration data, so that quantizing at run time is a nearest-level search and nothing else.
Here a layer's K (or V) codebook is the Lloyd-Max codebook of the normalised values of that
layer over every calibration context, pooled into one histogram
(:func:`kvtune.codecs.codebook.fit_calibrated`, the same exact integer arithmetic as the
per-tensor ``lloyd`` fit): the values are those the quantizer sees when it encodes, after the
policy's transforms (a ``hadamard`` rotation changes them) and in the same groups, outside the
bfloat16 windows. Token selection (``keep``) is left out: it drops tokens, it does not change
the values of those it keeps.

Without sensitivity weighting (KVQuant, sec. 3.2) and dense-and-sparse outliers (sec. 3.4): the
fit weighs every value alike, and the group extremes stay exact (the end levels are -1 and 1).
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Callable, Sequence

import torch

from kvtune.codecs.base import transform_min_bits
from kvtune.codecs.codebook import HIST_BINS, fit_calibrated
from kvtune.codecs.policy import PolicyConfig, apply_transforms
from kvtune.codecs.select import is_selecting
from kvtune.core.errors import ConfigError
from kvtune.core.jsonio import canonical_json

__all__ = ["codebook_key", "fit_codebooks", "calibrate_codebooks"]

KVLayers = Sequence[tuple[torch.Tensor, torch.Tensor]]
Table = tuple[tuple[float, ...], ...]


def _fitted_transforms(config: PolicyConfig) -> tuple:
    return tuple(t for t in config.transforms if not is_selecting(t))


def codebook_key(config: PolicyConfig, kind: str) -> str:
    """16 hex digits naming what the ``kind`` (``"key"``/``"value"``) codebooks of ``config``
    depend on: its transforms other than token selection and its quantizer without codebooks.
    Policies that differ only in what they keep share their codebooks (a run fits them once)."""
    quant = getattr(config, kind)
    doc = {"kind": kind, "transforms": [t.to_dict() for t in _fitted_transforms(config)],
           "quantizer": dataclasses.replace(quant, codebooks=()).to_dict()}
    return hashlib.sha256(canonical_json(doc).encode()).hexdigest()[:16]


@torch.inference_mode()
def fit_codebooks(config: PolicyConfig, kind: str, contexts: Sequence[KVLayers]) -> Table:
    """The calibrated ``kind`` codebooks of ``config``, one per layer.

    Args:
        config: a policy whose ``kind`` quantizer is a ``codebook`` with ``levels="calibrated"``.
        kind: ``"key"`` or ``"value"``.
        contexts: calibration KV caches (contexts apart from the evaluated ones), each a list
            over the model's layers (absolute index from 0) of ``(K, V)`` tensors ``(batch,
            kv_heads, tokens, head_dim)`` of any float dtype, on any device.

    Returns:
        Per layer ``2**bits`` float16 levels, as :meth:`PolicyConfig.with_codebooks` takes them.

    Raises:
        ConfigError: no contexts, contexts with different layer counts, or a ``kind`` quantizer
            without calibrated levels.
    """
    quant = getattr(config, kind)
    if getattr(quant, "levels", None) != "calibrated":
        raise ConfigError(f"fit_codebooks: the {kind} quantizer {quant.short_label()} has no calibrated levels")
    if not contexts:
        raise ConfigError("fit_codebooks needs at least one calibration context")
    layers = len(contexts[0])
    if any(len(kv) != layers for kv in contexts):
        raise ConfigError(f"fit_codebooks: calibration contexts have {sorted({len(kv) for kv in contexts})} layers")
    transforms = _fitted_transforms(config)
    counts = [torch.zeros(HIST_BINS, dtype=torch.int64) for _ in range(layers)]
    for kv in contexts:
        for layer, pair in enumerate(kv):
            x = pair[0 if kind == "key" else 1].detach().to("cpu", torch.float32)
            shape = tuple(x.shape)
            y, _ = apply_transforms(x, transforms, layer=layer, kind=kind)
            floors = transform_min_bits(transforms, shape[2])
            for seg in quant.calibration_segments(shape, layer=layer, kind=kind, min_bits=floors):
                counts[layer] += seg.coder.block_histogram(seg.take(y))
    return tuple(fit_calibrated(c, quant.bits) for c in counts)


def calibrate_codebooks(config: PolicyConfig, contexts: Sequence[KVLayers] | Callable[[], Sequence[KVLayers]],
                        cache: dict[str, Table] | None = None) -> PolicyConfig:
    """``config`` with its missing calibrated codebooks fitted (:func:`fit_codebooks`).

    Args:
        config: any policy (returned as it is when it needs no codebooks).
        contexts: calibration KV caches, as :func:`fit_codebooks`, or a function returning
            them (called only when a codebook is fitted).
        cache: ``{codebook_key: table}`` of codebooks already fitted on the same contexts
            (read, and completed with the new ones); None: fit every one.

    Raises:
        ConfigError: as :func:`fit_codebooks`.
    """
    if not config.needs_codebooks:
        return config
    tables = {}
    for kind in ("key", "value"):
        if getattr(getattr(config, kind), "needs_codebooks", False):
            name = codebook_key(config, kind)
            table = None if cache is None else cache.get(name)
            if table is None:
                table = fit_codebooks(config, kind, contexts() if callable(contexts) else contexts)
                if cache is not None:
                    cache[name] = table
            tables[kind] = table
    return config.with_codebooks(tables)
