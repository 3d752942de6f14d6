"""Compression ratios for every candidate, measured before any model forward pass.

The Bayesian optimizers need each candidate's compression ratio up front (KVServe, "KVServe:
Service-Aware KV Cache Compression for Communication-Efficient Disaggregated LLM Serving",
arXiv 2605.13734: the compression ratio of a candidate is cheap and is measured for every
candidate) and read it as the ratio, so it must be exact wherever it can be.

Layers are grouped by everything that fixes the byte length of their sections apart from the
data: the K and V shapes, the quantizer plans (:meth:`~kvtune.codecs.Quantizer.plan`: the
segments' shapes, widths and metadata layouts at that layer, which is where layer schedules
such as ``shallow_layers`` and MixHQ's head ranking across all layers show up) and the
transforms' state layouts. Layers of one group are represented by encoding some of them with
their true layer index; every other layer takes the section lengths of the nearest encoded
layer of its group. The stream is then assembled with :func:`~kvtune.codecs.stream.write_stream`
from placeholder sections of those lengths, so its header (which lists every section length)
is the real one.

Token selection (``keep``, :mod:`kvtune.codecs.select`): the kept count is a function of the
token count, so the groups use the kept shapes' plans, and the stream gets every layer's
bitmask (a fixed length per layer), which keeps the estimate exact for bit-packed codecs.

* **Bit-packed codecs** (:data:`SIZE_EXACT_CODECS`): a section's length depends only on the
  group key, so one encoded layer per group gives the **exact** stream length: the estimate
  equals ``len(encode_kv(kv, config))``.
* **Entropy-coded codecs** (``range``, ``zstd``): lengths depend on the data, so this is a
  stratified sample estimate (about ``sample_layers`` layers encoded, at least one per group);
  its error against the full encode is reported per trial as ``ratio_estimate`` next to
  ``compression_ratio``.

Cost: one small plan per layer and candidate, one layer encode per group (bit-packed), and one
placeholder buffer of the stream's size.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from kvtune.codecs import PolicyConfig, encode_kv, original_nbytes, read_header
from kvtune.codecs.policy import transform_min_bits
from kvtune.codecs.select import selecting_transform, without_selection
from kvtune.codecs.stream import mask_nbytes, write_stream
from kvtune.evaluate.model import KVLayers

__all__ = ["SIZE_EXACT_CODECS", "sample_layer_indices", "layer_groups", "estimate_stream_bytes", "estimate_ratios"]

SIZE_EXACT_CODECS = ("bitpack",)
"""Codecs whose output length depends only on the symbols' shape and width (not their values)."""


def sample_layer_indices(num_layers: int, n: int) -> list[int]:
    """``n`` evenly spaced layer indices in ``[0, num_layers)``, first and last included."""
    if num_layers <= n:
        return list(range(num_layers))
    if n <= 1:
        return [0]
    return sorted({round(i * (num_layers - 1) / (n - 1)) for i in range(n)})


def _size_key(config: PolicyConfig, kv: KVLayers, layer: int) -> tuple[Any, ...]:
    """What fixes the section lengths of ``layer`` under a bit-packed codec (see the module
    docstring); with token selection (``keep``), the plans of the kept shapes."""
    keep, inner = selecting_transform(config), without_selection(config)
    key = []
    for t, quant, kind in ((kv[layer][0], inner.key, "key"), (kv[layer][1], inner.value, "value")):
        shape = tuple(int(s) for s in t.shape)
        if keep is not None:
            shape = (*shape[:2], keep.kept_count(shape[2]), shape[3])
        plan = quant.plan(shape, layer=layer, kind=kind, min_bits=transform_min_bits(inner.transforms, shape[2]))
        states = tuple(tr.state_layout(shape, layer=layer, kind=kind) for tr in inner.transforms)
        key.append((tuple(int(s) for s in t.shape), shape, tuple((s.shape, s.bits, s.meta_layout) for s in plan), states))
    return tuple(key)


def layer_groups(config: PolicyConfig, kv: KVLayers) -> list[list[int]]:
    """Layers grouped by equal section-length determinants (shapes, plans, state layouts), in
    order of their first layer; under a bit-packed codec the layers of one group have sections
    of equal lengths.

    Raises:
        ConfigError: the policy cannot be planned (e.g. MixHQ without head scores).
    """
    groups: dict[tuple[Any, ...], list[int]] = {}
    for i in range(len(kv)):
        groups.setdefault(_size_key(config, kv, i), []).append(i)
    return list(groups.values())


def _proxies(groups: list[list[int]], per_group: Callable[[int], int]) -> dict[int, int]:
    """``{layer: encoded layer whose section lengths it takes}``: ``per_group(len(group))``
    evenly spaced layers of each group are encoded; the others take the nearest one."""
    proxy = {}
    for g in groups:
        picked = [g[j] for j in sample_layer_indices(len(g), per_group(len(g)))]
        for i in g:
            proxy[i] = min(picked, key=lambda p: (abs(p - i), p))
    return proxy


def estimate_stream_bytes(config: PolicyConfig, kv: KVLayers, *, sample_layers: int = 6) -> int:
    """``len(encode_kv(kv, config))`` (bytes), exact for bit-packed codecs, a stratified
    estimate for entropy-coded ones (see the module docstring).

    Args:
        config: the policy (MixHQ policies need their head scores).
        kv: per layer ``(K, V)``, each ``(batch, kv_heads, tokens, head_dim)``, one dtype.
        sample_layers: about how many layers an entropy-coded policy encodes (at least one per group).

    Raises:
        ConfigError / ValueError: as :func:`~kvtune.codecs.encode_kv` for this policy and KV.
    """
    groups = layer_groups(config, kv)
    if config.codec.name in SIZE_EXACT_CODECS:
        proxy = _proxies(groups, lambda size: 1)
    else:
        proxy = _proxies(groups, lambda size: max(1, round(sample_layers * size / len(kv))))
    lengths, shapes, header = {}, {}, None
    for i in sorted(set(proxy.values())):
        header = read_header(encode_kv([kv[i]], config, layer_offset=i))
        lengths[i] = tuple(t.flat() for t in header.sections[0])
        shapes[i] = header.shapes[0]  # the kept shapes with token selection (equal within a group)
    zeros = np.zeros(max(n for k, v in lengths.values() for n in (*k, *v)), dtype=np.uint8)
    sections = [tuple([zeros[:n] for n in t] for t in lengths[proxy[i]]) for i in range(len(kv))]
    selection = {}
    if header.source_tokens is not None:  # one bitmask per layer over its original tokens
        tokens = [int(k.shape[2]) for k, _ in kv]
        masks = [bytes(mask_nbytes(shapes[proxy[i]][0], tokens[i])) for i in range(len(kv))]
        selection = {"source_tokens": tokens, "masks": masks}
    stream = write_stream(
        policy=header.policy, policy_id=header.policy_id, layer_offset=0, dtype=header.dtype,
        shapes=[shapes[proxy[i]] for i in range(len(kv))], sections=sections,
        crcs=[tuple((0, sum(t)) for t in lengths[proxy[i]]) for i in range(len(kv))],  # the CRC is not needed
        **selection,
    )
    return len(stream)


def estimate_ratios(configs: Sequence[PolicyConfig], kv: KVLayers, *, sample_layers: int = 6,
                    progress: Callable[[int], None] | None = None) -> np.ndarray:
    """Compression ratio (original bytes / stream bytes) of every config on one context's KV:
    exact for bit-packed codecs, a stratified estimate for entropy-coded ones
    (:func:`estimate_stream_bytes`).

    Args:
        configs: the candidates' policies.
        kv: one context's KV, per layer ``(1, kv_heads, tokens, head_dim)``.
        sample_layers: about how many layers an entropy-coded policy encodes.
        progress: called with 1 after each candidate.

    Returns:
        ``(len(configs),)`` float64 ratios.
    """
    total = original_nbytes(kv)
    out = np.empty(len(configs))
    for j, config in enumerate(configs):
        out[j] = total / estimate_stream_bytes(config, kv, sample_layers=sample_layers)
        if progress:
            progress(1)
    return out
