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
import logging
from typing import Callable, Sequence

import torch

from kvtune.codecs.base import check_value_range, transform_min_bits
from kvtune.codecs.codebook import HIST_BINS, fit_calibrated
from kvtune.codecs.policy import PolicyConfig, apply_transforms, check_kv
from kvtune.codecs.select import is_selecting
from kvtune.core.errors import ConfigError, KVInputError, KVInputTypeError
from kvtune.core.jsonio import canonical_json

__all__ = ["codebook_key", "fit_codebooks", "calibrate_codebooks"]

log = logging.getLogger(__name__)

KVLayers = Sequence[tuple[torch.Tensor, torch.Tensor]]
Table = tuple[tuple[float, ...], ...]


def _fitted_transforms(config: PolicyConfig) -> tuple:
    return tuple(t for t in config.transforms if not is_selecting(t))


def _quantizer(config: PolicyConfig, kind: str):
    if kind not in ("key", "value"):
        raise ConfigError(f"kind must be 'key' or 'value', got {kind!r}")
    return getattr(config, kind)


def codebook_key(config: PolicyConfig, kind: str) -> str:
    """16 hex digits naming what the ``kind`` (``"key"``/``"value"``) codebooks of ``config``
    depend on: its transforms other than token selection and its quantizer without codebooks.
    Policies that differ only in what they keep share their codebooks (a run fits them once).

    Raises:
        ConfigError: ``kind`` is neither ``"key"`` nor ``"value"``.
    """
    quant = _quantizer(config, kind)
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
        ConfigError: a bad ``kind``, a ``kind`` quantizer without calibrated levels, no contexts,
            contexts without layers or with different layer counts. A layer whose contexts hold
            no value outside the bfloat16 windows gets the NF levels (:func:`fit_calibrated` of
            an empty histogram), with a warning.
        KVInputTypeError, KVInputError: a context that is not a KV cache
            (:func:`kvtune.codecs.check_kv`: structure, shapes, dtypes), or a NaN / inf, or a
            value its quantizer cannot code (after the transforms); the message names the
            context or the layer.
    """
    quant = _quantizer(config, kind)
    if getattr(quant, "levels", None) != "calibrated":
        raise ConfigError(f"fit_codebooks: the {kind} quantizer {quant.short_label()} has no calibrated levels")
    contexts = list(contexts)
    if not contexts:
        raise ConfigError("fit_codebooks needs at least one calibration context")
    for i, kv in enumerate(contexts):
        try:
            check_kv(kv)
        except (KVInputError, KVInputTypeError) as exc:
            raise type(exc)(f"calibration context {i}: {exc}") from None
    layers = len(contexts[0])
    if any(len(kv) != layers for kv in contexts):
        raise ConfigError(f"fit_codebooks: calibration contexts have {sorted({len(kv) for kv in contexts})} layers")
    if not layers:
        raise ConfigError("fit_codebooks: the calibration contexts have no layers")
    transforms = _fitted_transforms(config)
    counts = [torch.zeros(HIST_BINS, dtype=torch.int64) for _ in range(layers)]
    for kv in contexts:
        for layer, pair in enumerate(kv):
            x = pair[0 if kind == "key" else 1].detach().to("cpu", torch.float32)
            shape = tuple(x.shape)
            y, _ = apply_transforms(x, transforms, layer=layer, kind=kind)
            floors = transform_min_bits(transforms, shape[2])
            segments = quant.calibration_segments(shape, layer=layer, kind=kind, min_bits=floors)
            check_value_range(segments, y, layer=layer, kind=kind)
            for seg in segments:
                counts[layer] += seg.coder.block_histogram(seg.take(y))
    empty = [layer for layer, c in enumerate(counts) if not int(c.sum())]
    if empty:  # e.g. contexts no longer than the recent window: nothing is quantized on them either
        log.warning("calibrated %s codebooks of %s: the calibration contexts have no value outside the bfloat16 "
                    "windows in %d layer(s) (first: %d); those layers get the NF levels", kind, quant.short_label(),
                    len(empty), empty[0])
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
        ConfigError, KVInputTypeError, KVInputError: as :func:`fit_codebooks`; ConfigError for a
            cached table that the quantizer refuses (:meth:`PolicyConfig.with_codebooks`).
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
