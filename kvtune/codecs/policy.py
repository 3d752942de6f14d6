"""Compression policies (T -> Q -> C, the strategy space of KVServe, arXiv 2605.13734) and the
KV encode/decode entry points.

A :class:`PolicyConfig` composes transforms (applied in order, inverted in reverse), one
quantizer for keys, one for values, and a codec. It round-trips through JSON, has a stable
``policy_id`` (hash of its canonical JSON) and a compact ``label``. Calibration data a policy
needs at run time (``mixhq``'s per-head retrieval scores) is part of the configuration
(:meth:`PolicyConfig.with_head_scores`), so streams stay self-describing; a calibrated PCA
basis (``pca`` / ``dp-alloc``, :mod:`kvtune.codecs.pca`) is too large for that and is named by
its digest (:meth:`PolicyConfig.with_pca_basis`), the basis itself being a run artifact.

Per K or V tensor of layer ``l`` the pipeline is::

    for t in transforms:  state_t = t.fit(x); x = t.forward(x, state=state_t)
    floors = max over transforms of t.token_min_bits(tokens)      # e.g. delta anchors
    q = quantizer.quantize(x, layer=l, kind=k, min_bits=floors)   # one or more segments
    sections = [state bytes] + [meta_i bytes, codec.pack(symbols_i, bits_i)] per segment

:func:`encode_kv` turns a KV cache into one self-describing stream (:mod:`kvtune.codecs.stream`);
:func:`decode_kv` rebuilds the cache from the bytes alone. The compression ratio of a policy
is ``original_nbytes(kv) / len(stream)``: every byte that crosses the wire (payload,
scales/zero points, header, checksums) counts.

Example::

    >>> cfg = PolicyConfig.from_dict({
    ...     "transforms": ["hadamard"],
    ...     "key": {"name": "uniform", "bits": 2, "granularity": "per_channel", "group_size": 32},
    ...     "value": {"name": "uniform", "bits": 2, "granularity": "per_token", "group_size": 32},
    ...     "codec": "bitpack"})
    >>> cfg.label
    'hadamard|K:u2a/ch/g32|V:u2a/tok/g32|bitpack'
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import struct
from dataclasses import dataclass, field
from typing import Any, Mapping

import numpy as np
import torch

import kvtune.codecs.fp8  # noqa: F401  (registers the "fp8" quantizer)
import kvtune.codecs.mixhq  # noqa: F401  (registers the "mixhq" quantizer)
import kvtune.codecs.transforms  # noqa: F401  (registers the transforms)
from kvtune.codecs import fastpath, torchpath
from kvtune.codecs.bitalloc import check_pca_pairing, fill_dp_alloc  # registers "dp-alloc"
from kvtune.codecs.pca import KINDS, fill_pca_bases, missing_pca_ropes  # registers "pca"
from kvtune.codecs.select import (
    KeptPositions,
    check_selection,
    check_selection_chain,
    mask_positions,
    select_kv,
    selecting_transform,
    without_selection,
)
from kvtune.codecs.base import (
    Codec,
    MetaField,
    QuantizedSegment,
    QuantizedTensor,
    Quantizer,
    Transform,
    meta_from_bytes,
    meta_to_bytes,
    transform_min_bits,
    transform_state_nbytes,
)
from kvtune.codecs.bitpack import BitPack
from kvtune.codecs.kvtensors import DTYPE_NAMES, NAME_DTYPES, NON_FINITE, to_output_dtype
from kvtune.codecs.quantizers import NoQuantizer, UniformQuantizer
from kvtune.codecs.stream import (
    MAX_DIM,
    StreamHeader,
    TensorSections,
    check_checksum,
    read_header,
    section_views,
    selection_views,
    shape_problem,
    stream_head,
    write_stream,
    write_stream_in_place,
)
from kvtune.core.ids import config_policy_id
from kvtune.core.jsonio import canonical_json
from kvtune.core.errors import (
    ConfigError,
    CorruptStreamError,
    KVInputError,
    KVInputTypeError,
    KVStreamError,
    PolicyMismatchError,
)

__all__ = [
    "KVLayers",
    "PolicyConfig",
    "check_kv",
    "decode_device",
    "encode_kv",
    "decode_kv",
    "kept_positions",
    "original_nbytes",
    "POLICY_VERSIONS",
    "apply_transforms",
    "invert_transforms",
    "transform_min_bits",
    "IMPLS",
    "MAX_UNCONFIRMED_PLAN",
    "MAX_ELEMENTS_PER_BYTE",
    "check_claimed_sizes",
    "check_finite_metadata",
    "sections_problem",
]

KVLayers = list[tuple[torch.Tensor, torch.Tensor]]
"""One ``(K, V)`` pair per layer, each ``(batch, kv_heads, tokens, head_dim)`` floating tensor."""

POLICY_VERSIONS = (1,)
_TOP_KEYS = ("version", "transforms", "key", "value", "codec")


@dataclass(frozen=True, kw_only=True)
class PolicyConfig:
    """A compression policy: ``stream = C(Q(T(X)))`` with separate K and V quantizers.

    Canonical form: identity transforms are dropped (so ``["identity"]`` and ``[]`` are the
    same policy with the same ``policy_id``), and ``transforms`` is a tuple.

    Args:
        transforms: transforms applied in order on encode, inverted in reverse on decode.
        key: quantizer of the keys.
        value: quantizer of the values.
        codec: lossless packing of the symbols (default ``bitpack``).
        version: policy-config schema version (1).

    Raises:
        ConfigError: wrong component types, unsupported version, a token-selecting transform
            (``keep``) anywhere but first or more than once, or a codec that cannot pack one of
            the symbol widths the quantizers can emit (with the transforms' precision floors).
    """

    transforms: tuple[Transform, ...] = ()
    key: Quantizer
    value: Quantizer
    codec: Codec = field(default_factory=BitPack)
    version: int = 1

    def __post_init__(self) -> None:
        transforms = self.transforms
        if isinstance(transforms, Transform):
            transforms = (transforms,)
        if not isinstance(transforms, (tuple, list)) or not all(isinstance(t, Transform) for t in transforms):
            raise ConfigError(f"policy 'transforms' must be a sequence of Transform, got {self.transforms!r}")
        object.__setattr__(self, "transforms", tuple(t for t in transforms if not t.is_identity))
        for slot, base in (("key", Quantizer), ("value", Quantizer), ("codec", Codec)):
            if not isinstance(getattr(self, slot), base):
                raise ConfigError(f"policy {slot!r} must be a {base.__name__}, got {getattr(self, slot)!r}")
        if type(self.version) is not int or self.version not in POLICY_VERSIONS:  # 1.0 == 1 but is not the schema version
            raise ConfigError(f"policy 'version' = {self.version!r} is not supported; allowed: {POLICY_VERSIONS}")
        check_selection_chain(self.transforms)
        check_pca_pairing(self.transforms, {"key": self.key, "value": self.value})
        floors = tuple(sorted({b for t in self.transforms for b in t.min_bits_values()}))
        for slot in ("key", "value"):
            for bits in getattr(self, slot).symbol_widths(floors):
                if not self.codec.supports(bits):
                    raise ConfigError(f"policy 'codec' {self.codec.name!r} cannot pack the {bits}-bit symbols of {slot!r}")

    # ------------------------------------------------------------------ serialization

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "PolicyConfig":
        """Build a policy from a dict such as ``PolicyConfig.to_dict()`` returns.

        Components may be dicts ``{"name": ..., **params}`` or bare names (default
        parameters): ``"transforms": ["hadamard"]``, ``"codec": "bitpack"``. Defaults: no
        transforms, codec ``bitpack``, quantizer name ``uniform`` when a quantizer dict has no
        ``"name"``, version 1. ``"key"`` and ``"value"`` are required.

        Raises:
            ConfigError: unknown top-level key, missing quantizer, unknown component, unknown
                parameter or bad value; the message names the slot, the component, the key and
                the allowed values.
        """
        if not isinstance(d, Mapping):
            raise ConfigError(f"policy must be a mapping with keys {', '.join(_TOP_KEYS)}, got {d!r}")
        for k in d:
            if k not in _TOP_KEYS:
                raise ConfigError(f"policy: unknown key {k!r}; allowed: {', '.join(_TOP_KEYS)}")
        for k in ("key", "value"):
            if k not in d:
                raise ConfigError(f"policy: missing {k!r} quantizer")
        raw_t = d.get("transforms") or []
        if isinstance(raw_t, (str, Mapping)):
            raw_t = [s for s in raw_t.split("+") if s] if isinstance(raw_t, str) else [raw_t]
        if not isinstance(raw_t, (list, tuple)):
            raise ConfigError(f"policy 'transforms' must be a list of transforms, got {raw_t!r}")
        try:
            transforms = tuple(Transform.from_dict(t) for t in raw_t)
        except ConfigError as exc:
            raise ConfigError(f"policy 'transforms': {exc}") from None
        parts: dict[str, Any] = {}
        for slot, base, default in (("key", Quantizer, "uniform"), ("value", Quantizer, "uniform"), ("codec", Codec, "bitpack")):
            try:
                parts[slot] = base.from_dict(d.get(slot, default), default_name=default)
            except ConfigError as exc:
                raise ConfigError(f"policy {slot!r}: {exc}") from None
        return cls(transforms=transforms, version=d.get("version", 1), **parts)

    @classmethod
    def from_json(cls, text: str) -> "PolicyConfig":
        """Parse :meth:`to_json` output (or any JSON object :meth:`from_dict` accepts).

        Raises:
            ConfigError: invalid JSON or an invalid policy.
        """
        try:
            d = json.loads(text)
        except ValueError as exc:
            raise ConfigError(f"policy JSON is invalid: {exc}") from None
        except RecursionError:
            raise ConfigError("policy JSON is nested too deeply to parse") from None
        return cls.from_dict(d)

    def to_dict(self) -> dict[str, Any]:
        """Canonical dict with every parameter explicit (round-trips through :meth:`from_dict`)."""
        return {
            "version": self.version,
            "transforms": [t.to_dict() for t in self.transforms],
            "key": self.key.to_dict(),
            "value": self.value.to_dict(),
            "codec": self.codec.to_dict(),
        }

    def to_json(self) -> str:
        """Canonical JSON of :meth:`to_dict` (sorted keys, no whitespace)."""
        return canonical_json(self.to_dict())

    @functools.cached_property
    def policy_id(self) -> str:
        """First 12 hex characters of the SHA-256 of :meth:`to_json`
        (:func:`kvtune.core.ids.config_policy_id` of :meth:`to_dict`); stable across runs.
        Computed once per policy object (it is immutable)."""
        return config_policy_id(self.to_dict())

    @property
    def label(self) -> str:
        """Compact label, e.g. ``hadamard|K:u2a/ch/g32|V:u2a/tok/g32|bitpack``.

        Transforms are joined by ``+`` (``identity`` when there are none); quantizers read
        ``u{bits}{a=asymmetric|s=symmetric}/{tok|ch}[/g{group_size}][/s{sink}][/r{recent}]
        [/L{layers}:{bits}]``, ``mix{f}:{high}/{low}...``, ``fp8{format}[/tok]`` or ``bf16``.
        ``mixhq`` head scores are not in the label (they are in :attr:`policy_id`).
        """
        t = "+".join(x.short_label() for x in self.transforms) or "identity"
        return f"{t}|K:{self.key.short_label()}|V:{self.value.short_label()}|{self.codec.short_label()}"

    # ------------------------------------------------------------------ calibration

    @property
    def needs_head_scores(self) -> bool:
        """True when a quantizer ranks heads (``mixhq``) and has no scores yet."""
        return any(getattr(q, "head_scores", None) == () for q in (self.key, self.value))

    def with_head_scores(self, scores: Any) -> "PolicyConfig":
        """A copy in which every head-ranking quantizer (``mixhq``) gets ``scores``.

        Args:
            scores: per layer, one retrieval score per KV head (higher = more retrieval), for
                every layer of the model (absolute layer indices): nested lists or a
                ``(layers, kv_heads)`` tensor/array, e.g. from
                :func:`kvtune.evaluate.calibrate` . Other quantizers are unchanged.

        Returns:
            The new policy (a different :attr:`policy_id` when a quantizer uses the scores).

        Raises:
            ConfigError: scores that are not a list of lists of finite numbers.
        """
        return dataclasses.replace(self, key=self.key.with_head_scores(scores), value=self.value.with_head_scores(scores))

    @property
    def needs_codebooks(self) -> bool:
        """True when a quantizer has calibrated codebook levels (``codebook`` with
        ``levels="calibrated"``) and no codebooks yet."""
        return any(getattr(q, "needs_codebooks", False) for q in (self.key, self.value))

    def with_codebooks(self, codebooks: Mapping[str, Any]) -> "PolicyConfig":
        """A copy whose calibrated-codebook quantizers get their levels.

        Args:
            codebooks: ``{"key": table, "value": table}`` (either may be missing when its
                quantizer needs none); a table holds, per layer (absolute index), ``2**bits``
                float16 levels (:func:`kvtune.evaluate.calibrate_codebook.fit_codebooks`).

        Returns:
            The new policy (the levels are in its :attr:`policy_id` and travel with its streams).

        Raises:
            ConfigError: not a mapping; a table for a quantizer without calibrated levels, a
                missing or empty table, or levels that
                :func:`kvtune.codecs.codebook.check_codebooks` refuses.
        """
        if not isinstance(codebooks, Mapping):
            raise ConfigError(f"with_codebooks takes {{'key': table, 'value': table}}, got {type(codebooks).__name__}")
        out = {}
        for kind in KINDS:
            quant, table = getattr(self, kind), codebooks.get(kind)
            if table is None:
                if getattr(quant, "needs_codebooks", False):
                    raise ConfigError(f"with_codebooks: no {kind} codebooks for {quant.short_label()}")
                continue
            if getattr(quant, "levels", None) != "calibrated":
                raise ConfigError(f"with_codebooks: the {kind} quantizer {quant.short_label()} has no calibrated levels")
            out[kind] = quant.with_codebooks(table)
        return dataclasses.replace(self, **out)

    @property
    def needs_pca_basis(self) -> bool:
        """True when a ``pca`` transform has no basis yet (:mod:`kvtune.codecs.pca`)."""
        return bool(missing_pca_ropes(self.transforms))

    @property
    def pca_ropes_missing(self) -> frozenset[str]:
        """The ``rope`` modes (``"pre"``/``"post"``) of the ``pca`` transforms without a basis:
        the bases a calibration must fit for this policy."""
        return missing_pca_ropes(self.transforms)

    def with_pca_basis(self, bases: str | Mapping[str, str]) -> "PolicyConfig":
        """A copy whose basis-less ``pca`` transforms get a basis digest, and whose basis-less
        ``dp-alloc`` quantizers get the digest of the ``pca`` transform they follow.

        Args:
            bases: a :attr:`kvtune.codecs.pca.PCABasis.digest`, or a mapping ``rope mode ->
                digest`` (each ``pca`` transform takes the basis of its ``rope``).

        Returns:
            The new policy (a different :attr:`policy_id` when something was filled in).

        Raises:
            ConfigError: a digest that is not 64 hex digits.
        """
        transforms = fill_pca_bases(self.transforms, bases)
        return dataclasses.replace(self, transforms=transforms, key=fill_dp_alloc(self.key, transforms),
                                   value=fill_dp_alloc(self.value, transforms))

    # ------------------------------------------------------------------ presets

    @classmethod
    def kivi(
        cls, bits: int = 2, group_size: int = 32, *, recent_tokens: int = 0, transforms: tuple[Transform, ...] = ()
    ) -> "PolicyConfig":
        """KIVI-style policy (Liu et al. 2024, sec. 3): asymmetric ``bits``-bit keys per channel
        and values per token, both in groups of ``group_size``, bit-packed.

        KIVI keeps the most recent tokens in full precision (its residual window, 128 tokens
        in the paper's presets): pass ``recent_tokens=128`` for that; the default 0 has no window.
        """
        return cls(
            transforms=transforms,
            key=UniformQuantizer(bits=bits, granularity="per_channel", group_size=group_size, recent_tokens=recent_tokens),
            value=UniformQuantizer(bits=bits, granularity="per_token", group_size=group_size, recent_tokens=recent_tokens),
            codec=BitPack(),
        )

    @classmethod
    def uncompressed(cls) -> "PolicyConfig":
        """The "no compression" baseline: K and V sent as raw bfloat16 (16 bits per element)."""
        return cls(key=NoQuantizer(), value=NoQuantizer(), codec=BitPack())


# ---------------------------------------------------------------------- encode / decode


def original_nbytes(kv: KVLayers) -> int:
    """Bytes of ``kv`` in bfloat16: total number of K and V elements x 2.

    The compression ratio of a stream is ``original_nbytes(kv) / len(stream)``.
    """
    return sum(2 * (k.numel() + v.numel()) for k, v in kv)


def _all_finite(t: torch.Tensor) -> bool:
    """No NaN or inf in ``t``: the kernels' pass over the exponent bits where they can read
    ``t`` (:func:`kvtune.codecs.fastpath.all_finite`), else torch's ``aminmax`` (NaN propagates
    into it and +-inf is the max or min, so one reduction pass answers it: 8x cheaper than
    ``isfinite(t).all()`` on bf16 KV)."""
    if t.numel() == 0:
        return True
    fast = fastpath.all_finite(t)
    if fast is not None:
        return fast
    lo, hi = torch.aminmax(t)
    return bool(torch.isfinite(lo) & torch.isfinite(hi))


_shape_problem = functools.lru_cache(maxsize=1024)(shape_problem)
""":func:`kvtune.codecs.stream.shape_problem` of a tuple of ints, remembered (a cache repeats a
few shapes across its layers and requests)."""


def check_kv(kv: KVLayers, *, check_finite: bool = True) -> torch.dtype:
    """Validate a KV cache's structure, shapes (:func:`kvtune.codecs.stream.shape_problem`),
    dtypes and device and, with ``check_finite``, that no value is NaN or inf; return the
    common dtype (``bfloat16`` for an empty list).

    Raises:
        KVInputTypeError: not a list/tuple of ``(K, V)`` pairs (a ``TypeError`` as well).
        KVInputError: a tensor that is not 4-D ``(batch, kv_heads, tokens, head_dim)``, not dense
            (sparse, mkldnn), of a degenerate shape, on the meta device, of a dtype other than float32 / bfloat16 /
            float16, with NaN / inf (``check_finite``), or dtypes that differ between tensors.
    """
    if not isinstance(kv, (list, tuple)):
        raise KVInputTypeError(f"kv must be a list of (K, V) tensor pairs, got {type(kv).__name__}")
    dtypes = set()
    for i, pair in enumerate(kv):
        if not (isinstance(pair, (tuple, list)) and len(pair) == 2):
            raise KVInputTypeError(f"kv[{i}] must be a (K, V) pair, got {type(pair).__name__}")
        for name, t in zip("KV", pair):
            if not isinstance(t, torch.Tensor) or t.dim() != 4:
                raise KVInputError(f"kv[{i}] {name} must be a (batch, kv_heads, tokens, head_dim) tensor")
            if t.layout != torch.strided:
                raise KVInputError(f"kv[{i}] {name} has layout {t.layout}; a KV cache is a dense (strided) tensor")
            problem = _shape_problem(tuple(t.shape))
            if problem is not None:
                raise KVInputError(f"kv[{i}] {name} of shape {tuple(t.shape)} {problem}")
            if t.is_meta:
                raise KVInputError(f"kv[{i}] {name} is a meta tensor (no data)")
            if t.dtype not in DTYPE_NAMES:
                raise KVInputError(f"kv[{i}] {name} has dtype {t.dtype}; supported: float32, bfloat16, float16")
            if check_finite and not _all_finite(t):
                raise KVInputError(f"kv[{i}] {name} {NON_FINITE}")
            dtypes.add(t.dtype)
    if len(dtypes) > 1:
        raise KVInputError(f"all K/V tensors must share one dtype, got {sorted(map(str, dtypes))}")
    return dtypes.pop() if dtypes else torch.bfloat16


def _at(t: Transform, positions: torch.Tensor | None) -> dict[str, torch.Tensor]:
    """The ``positions`` keyword for a transform that uses them (:attr:`Transform.uses_positions`)."""
    return {"positions": positions} if t.uses_positions and positions is not None else {}


def apply_transforms(
    x: torch.Tensor, transforms: tuple[Transform, ...], *, layer: int, kind: str, positions: torch.Tensor | None = None
) -> tuple[torch.Tensor, list[dict[str, torch.Tensor]]]:
    """Fit and apply ``transforms`` in order to float32 ``x``; returns ``(y, states)``.

    ``positions``: int64 ``(batch, kv_heads, tokens)`` positions of ``x``'s rows (the kept
    tokens of a ``keep`` policy), given to the transforms that use them; ``None``: ``0 ..
    tokens - 1``."""
    states = []
    for t in transforms:
        state = t.fit(x, layer=layer, kind=kind)
        x = t.forward(x, layer=layer, kind=kind, state=state, **_at(t, positions))
        states.append(state)
    return x, states


def invert_transforms(
    y: torch.Tensor, transforms: tuple[Transform, ...], states: list[dict[str, torch.Tensor]], *, layer: int, kind: str,
    positions: torch.Tensor | None = None,
) -> torch.Tensor:
    """Undo :func:`apply_transforms` (in reverse order, with the same states and positions)."""
    for t, state in zip(reversed(transforms), reversed(states)):
        y = t.inverse(y, layer=layer, kind=kind, state=state, **_at(t, positions))
    return y


def _state_layouts(transforms: tuple[Transform, ...], shape: tuple[int, ...], layer: int, kind: str) -> list[tuple[MetaField, ...]]:
    return [t.state_layout(shape, layer=layer, kind=kind) for t in transforms]


def _encode_tensor(t: torch.Tensor, config: PolicyConfig, quant: Quantizer, layer: int, kind: str,
                   positions: torch.Tensor | None = None) -> list[bytes]:
    """One K or V tensor (rows at ``positions``, see :func:`apply_transforms`) -> its sections
    ``[state, meta_0, payload_0, ...]``."""
    x = t.detach().to("cpu", torch.float32)
    shape = tuple(x.shape)
    y, states = apply_transforms(x, config.transforms, layer=layer, kind=kind, positions=positions)
    layouts = _state_layouts(config.transforms, shape, layer, kind)
    out = [b"".join(meta_to_bytes(s, lay) for s, lay in zip(states, layouts))]
    q = quant.quantize(y, layer=layer, kind=kind, min_bits=transform_min_bits(config.transforms, shape[2]))
    for p in q.parts:
        out.append(meta_to_bytes(p.meta, p.segment.meta_layout))
        out.append(config.codec.pack(p.symbols, p.bits))
    return out


def _decode_tensor(
    sections: TensorSections, shape: tuple[int, ...], config: PolicyConfig, quant: Quantizer, layer: int, kind: str,
    positions: torch.Tensor | None = None,
) -> torch.Tensor:
    """The sections of one K or V tensor -> float32 tensor of ``shape``.

    A tensor without tokens carries no symbols: only its state length is checked (the plan of
    an empty tensor is empty; :func:`check_claimed_sizes` has checked that it records no
    segments), and nothing is planned, allocated or inverted from its shape.
    """
    need = transform_state_nbytes(config.transforms, shape, layer=layer, kind=kind)
    if len(sections.state) != need:
        raise CorruptStreamError(f"transform state section has {len(sections.state)} bytes, the policy needs {need}")
    if math.prod(shape) == 0:
        return torch.zeros(shape)
    layouts = _state_layouts(config.transforms, shape, layer, kind)
    states, pos = [], 0
    for lay in layouts:
        n = sum(f.nbytes for f in lay)
        states.append(meta_from_bytes(sections.state[pos : pos + n], lay))
        pos += n
    plan = quant.plan(shape, layer=layer, kind=kind, min_bits=transform_min_bits(config.transforms, shape[2]))
    if len(plan) != sections.num_segments:
        raise CorruptStreamError(f"{sections.num_segments} segments recorded, the policy needs {len(plan)}")
    parts = []
    for seg, meta, payload in zip(plan, sections.meta, sections.payload):
        symbols = config.codec.unpack(payload, seg.bits, seg.numel, shape=seg.shape)
        if not symbols.flags.writeable:
            symbols = symbols.copy()
        parts.append(QuantizedSegment(seg, torch.from_numpy(symbols).reshape(seg.shape), meta_from_bytes(meta, seg.meta_layout)))
    y = quant.dequantize(QuantizedTensor(shape, tuple(parts)), layer=layer, kind=kind)
    return invert_transforms(y, config.transforms, states, layer=layer, kind=kind, positions=positions)


IMPLS = ("auto", "fast", "reference", "torch")
"""Values of the ``impl`` argument of :func:`encode_kv` / :func:`decode_kv`."""


def _use_fast(impl: str, config: PolicyConfig) -> bool:
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {', '.join(IMPLS)}, got {impl!r}")
    if impl in ("reference", "torch"):
        return False
    ok = fastpath.supports(config)
    if impl == "fast" and not ok:
        reason = "the compiled kernels are not available" if not fastpath.available() else "a component has no kernel"
        raise ConfigError(f"policy {config.label}: no fast path ({reason}); use impl='auto' or 'reference'")
    return ok


def _use_torch(impl: str, config: PolicyConfig, off_cpu: bool) -> bool:
    """The device path (:mod:`kvtune.codecs.torchpath`): asked for, or ``auto`` with the data
    off the CPU and a policy it runs."""
    if impl == "torch":
        if not torchpath.supports(config):
            raise ConfigError(f"policy {config.label}: no torch path (a component has no device implementation); "
                              "use impl='auto' or 'reference'")
        return True
    return impl == "auto" and off_cpu and torchpath.supports(config)


def _off_cpu(kv: Any) -> bool:
    """Whether a tensor of ``kv`` (not validated yet) lives on a device other than the CPU."""
    pairs = kv if isinstance(kv, (list, tuple)) else ()
    return any(isinstance(t, torch.Tensor) and t.device.type not in ("cpu", "meta")
               for pair in pairs if isinstance(pair, (list, tuple)) for t in pair)


def encode_kv(kv: KVLayers, config: PolicyConfig, *, layer_offset: int = 0, impl: str = "auto") -> bytes:
    """Compress a KV cache into one self-describing stream.

    Args:
        kv: one ``(K, V)`` pair per layer, each ``(batch, kv_heads, tokens, head_dim)``,
            all of one dtype (float32, bfloat16 or float16), any device; layers may differ in
            shape.
        config: the policy.
        layer_offset: absolute index of ``kv[0]`` (when the stream carries a layer range);
            seeds of layer-dependent transforms use ``layer_offset + i``.
        impl: ``"auto"`` (the device path of :mod:`kvtune.codecs.torchpath` when a tensor is
            off the CPU, e.g. on a GPU, else compiled kernels when every component has one, see
            :mod:`kvtune.codecs.fastpath`), ``"fast"`` (require the kernels), ``"reference"``
            (the torch implementation of each component, on the CPU) or ``"torch"`` (the device
            path, on each tensor's device, the CPU included). All give the same bytes.

    Token selection: a policy whose first transform is ``keep`` (:mod:`kvtune.codecs.select`)
    first selects the tokens of every layer (K and V together), and the rest of the policy runs
    on the kept ``(batch, kv_heads, kept, head_dim)`` tensors on the same paths; the stream
    then records the kept shapes, the original token counts and the kept-token bitmasks.

    Returns:
        The stream bytes (format: :mod:`kvtune.codecs.stream`); deterministic.

    Raises:
        KVInputTypeError, KVInputError: malformed ``kv`` (:func:`check_kv`: not pairs of 4-D
            tensors, meta tensors, unsupported or mixed dtypes; a ``TypeError`` / ``ValueError``
            as well).
        TypeError, ValueError: a ``layer_offset`` that is not an int, negative, or that puts the
            last layer past :data:`kvtune.codecs.stream.MAX_DIM`.
        KVInputError (a ``ValueError``): a tensor with no batch, KV heads or channels (0 tokens
            are fine: an empty cache), beyond the format's limits
            (:func:`kvtune.codecs.stream.shape_problem`), with NaN / inf values, or with a
            value (after the transforms) beyond what its block of the policy represents
            (:attr:`Quantizer.value_limit`: 65504 for ``uniform``'s float16 scales and zero
            points, 32752 at 1 bit; ~3.39e38 for ``none``; ``65504 * fp8_max`` for scaled
            ``fp8``), on every dtype. Such values are refused, never clipped: finite float16
            input is always within range unless a transform (``hadamard``, ``delta``) or a
            1-bit group widens it; ``affine`` scales outlier channels into range.
        ConfigError: the policy cannot be applied to this cache, e.g. a ``mixhq`` quantizer
            without head scores or with scores for other layers / head counts.
    """
    if not isinstance(config, PolicyConfig):
        raise TypeError(f"config must be a PolicyConfig (PolicyConfig.from_dict for a dict), got {type(config).__name__}")
    fast = _use_fast(impl, config)
    on_device = _use_torch(impl, config, _off_cpu(kv))
    keep, inner = selecting_transform(config), without_selection(config)
    # the fast and device paths check finiteness inside their kernels, on the kept tokens only
    dtype = check_kv(kv, check_finite=not (fast or on_device) or keep is not None)
    if not isinstance(layer_offset, int) or isinstance(layer_offset, bool):
        raise TypeError(f"layer_offset must be an int, got {type(layer_offset).__name__}")
    if layer_offset < 0:
        raise ValueError(f"layer_offset must be >= 0, got {layer_offset}")
    if layer_offset + max(len(kv) - 1, 0) > MAX_DIM:  # the decoder refuses such a header
        raise ValueError(f"layer_offset {layer_offset} with {len(kv)} layers goes past the format's largest layer "
                         f"index {MAX_DIM}")
    selection = None
    if keep is not None:  # the rest of the policy runs on the kept tokens
        kv, selection = select_kv(kv, keep)
    shapes = [(tuple(k.shape), tuple(v.shape)) for k, v in kv]
    stream_fields = dict(policy_id=config.policy_id, layer_offset=layer_offset, dtype=DTYPE_NAMES[dtype], shapes=shapes,
                         source_tokens=None if selection is None else selection.source_tokens,
                         masks=None if selection is None else selection.masks)
    batch = fastpath.encode_plan(inner, shapes, layer_offset) if fast and not on_device else None
    if batch is not None:  # bit-packed block quantizers: every tensor straight into the stream
        if not batch.checked:  # the lengths are the plans': check them once per cache shape
            _check_encoded_sections(shapes, _zero_sections(batch.lengths), inner, layer_offset)
            batch.checked = True
        key = (config.policy_id, dtype)  # the header is a function of the batch's shapes and these
        head = batch.heads.get(key) if selection is None else None
        if head is None:
            # the policy's dict only here: a calibrated one (480 codebook levels) takes ~30 us to build
            head = stream_head(**stream_fields, policy=config.to_dict(), lengths=batch.lengths)
            if selection is None:
                batch.heads[key] = head
        return write_stream_in_place(head=head, nbytes=int(batch.nbytes.sum()), masks=stream_fields["masks"],
                                     write_sections=lambda buf: fastpath.encode_into(kv, batch, buf))
    crcs = None
    if on_device:
        sections = torchpath.encode_tensors(kv, inner, layer_offset)
    elif fast:
        positions = None if selection is None else selection.positions
        sections, crcs = fastpath.encode_tensors(kv, inner, layer_offset, positions)
    else:
        sections = []
        for i, (k, v) in enumerate(kv):
            layer = layer_offset + i
            pos = None if selection is None else selection.positions[i]
            sections.append((_encode_tensor(k, inner, inner.key, layer, "key", pos),
                             _encode_tensor(v, inner, inner.value, layer, "value", pos)))
    _check_encoded_sections(shapes, [tuple(TensorSections.from_flat(flat) for flat in pair) for pair in sections], inner,
                            layer_offset)
    return write_stream(**stream_fields, policy=config.to_dict(), sections=sections, crcs=crcs)


def _check_encoded_sections(shapes, sections, config: PolicyConfig, layer_offset: int) -> None:
    """Refuse to return a stream the decoder would refuse (:func:`sections_problem` of every
    tensor; ``sections`` per layer ``(K, V)`` :class:`TensorSections`).

    Raises:
        KVInputError: naming the first such tensor.
    """
    for i, (shape_pair, pair) in enumerate(zip(shapes, sections)):
        for name, shape, secs, quant, kind in zip("KV", shape_pair, pair, (config.key, config.value), KINDS):
            per_symbol = quant.elements_per_symbol(shape, layer=layer_offset + i, kind=kind)
            problem = sections_problem(shape, secs, config.codec, per_symbol)
            if problem is not None:
                raise KVInputError(f"kv[{i}] {name} of shape {shape} {problem}: the decoder would refuse the stream")


def _zero_sections(lengths) -> list[tuple[TensorSections, TensorSections]]:
    """Sections of the given lengths (per layer ``(K lengths, V lengths)``) over zero bytes:
    what :func:`sections_problem` reads of ``bitpack`` payloads, whose symbol bound is their
    length (:meth:`~kvtune.codecs.base.Codec.max_symbols`)."""
    zero = memoryview(bytes(max((n for pair in lengths for x in pair for n in x), default=0)))
    return [tuple(TensorSections.from_flat([zero[:n] for n in x]) for x in pair) for pair in lengths]


def decode_kv(
    stream: bytes | bytearray | memoryview,
    *,
    expect: PolicyConfig | None = None,
    impl: str = "auto",
    out: KVLayers | None = None,
    device: torch.device | str | None = None,
) -> KVLayers:
    """Decompress a stream written by :func:`encode_kv`, from its bytes alone.

    Args:
        stream: the stream bytes.
        expect: when given, the policy the caller expects the stream to use.
        impl: ``"auto"``, ``"fast"``, ``"reference"`` or ``"torch"``, as in :func:`encode_kv`
            (``auto`` decodes on the device path when ``device`` is not the CPU); all give the
            same tensors.
        out: optional preallocated ``(K, V)`` tensors to decode into (on ``device``, contiguous, the
            stream's shapes and dtype), e.g. the KV cache blocks of a serving engine; saves
            allocating (and page-faulting) fresh tensors. They are returned. Layers are
            written as they decode: after an error, ``out`` may hold some decoded layers and
            must not be used.

        device: where the tensors are returned (default: the CPU). A policy the device path
            does not run is decoded on the CPU and copied there.

    Returns:
        One ``(K, V)`` pair per layer on ``device``, with the shapes and dtype of the encoded
        input (with ``keep``, the kept tokens in their original order: ``(batch, kv_heads,
        kept, head_dim)``, which is also the shape ``out`` must have; their positions:
        :func:`kept_positions`); float16 values saturate at +-65504 (:func:`kvtune.codecs.kvtensors.to_output_dtype`),
        so a stream of finite float16 input never decodes to inf.

    Raises:
        TruncatedStreamError: the stream is cut short.
        CorruptStreamError: bad magic, checksum mismatch, inconsistent header/sections, a
            header claiming shapes its sections cannot hold (:func:`check_claimed_sizes`), or a
            selection block that disagrees with the policy (:func:`kvtune.codecs.select.check_selection`).
        StreamVersionError: unknown wire-format version.
        PolicyMismatchError: ``expect`` is given and the stream's policy id differs.
        KVStreamError: the (intact) stream names a policy this kvtune cannot build (e.g. a
            component that is not registered) or cannot apply to the recorded shapes.
        TypeError: ``expect`` is not a :class:`PolicyConfig`.
        ConfigError: ``impl`` ``"torch"`` for a ``keep`` stream whose transforms depend on
            positions (``pca`` with pre-RoPE keys: the fast and reference paths only), or
            ``"fast"`` for a policy the kernels do not run.
        KVInputError (a ``ValueError``): ``out`` does not match the stream (shapes, dtype,
            device, contiguity), requires grad, is a lazy negation view (``Tensor.is_neg``) or has
            tensors that overlap in memory; or
            ``device`` is not a usable device (:func:`decode_device`).
    """
    if expect is not None and not isinstance(expect, PolicyConfig):
        raise TypeError(f"expect must be a PolicyConfig or None, got {type(expect).__name__}")
    # the final checksum is verified below (the fast path takes it while decoding); any error
    # found first is reported as a checksum mismatch when the stream is damaged, as if checked first
    header = read_header(stream, verify_checksum=False)
    try:
        return _decode_read(stream, header, expect, impl, out, device)
    except Exception:
        check_checksum(stream, header)
        raise


def _header_policy(header: StreamHeader) -> PolicyConfig:
    """The policy a stream header carries, checked against the id it records."""
    try:
        config = PolicyConfig.from_dict(header.policy)
    except (ConfigError, TypeError, ValueError, OverflowError, RecursionError) as exc:
        raise KVStreamError(f"KV stream policy {header.policy_id} cannot be built here: {str(exc)[:500]}") from None
    if config.policy_id != header.policy_id:  # the id is the hash of the policy: they must agree
        raise CorruptStreamError(f"corrupt KV stream: header policy id {header.policy_id!r} is not the id "
                                 f"{config.policy_id!r} of the policy it carries")
    return config


_HEADER_FACTS: dict[tuple[bytes, Any], Any] = {}
_MAX_HEADER_FACTS = 256
_MAX_REMEMBERED_HEADER = 1 << 16
"""Longest header text (bytes) whose facts are remembered (~700 layers): the facts grow with
the layers, and a stream of thousands of layers amortizes its checks anyway."""


def _remembered(header: StreamHeader, fact: Any, compute):
    """``compute()``, remembered per header text and ``fact`` (a hashable name) when the header
    was read from a stream (:attr:`StreamHeader.text`): a serving engine's fixed-size chunks of
    one policy repeat their header byte for byte, and the checks and objects that follow from
    the header alone cost ~0.4 ms per 30-layer stream. A failure raises every time (exceptions
    are not remembered)."""
    if not header.text or len(header.text) > _MAX_REMEMBERED_HEADER:
        return compute()
    key = (header.text, fact)
    try:
        return _HEADER_FACTS[key]
    except KeyError:
        pass
    value = compute()
    if len(_HEADER_FACTS) >= _MAX_HEADER_FACTS:
        _HEADER_FACTS.clear()
    _HEADER_FACTS[key] = value
    return value


def kept_positions(stream: bytes | bytearray | memoryview) -> KeptPositions | None:
    """The kept positions and original token counts of a token-selected stream (a policy whose
    first transform is ``keep``, :mod:`kvtune.codecs.select`), or ``None`` for a stream
    without token selection: where the tokens that :func:`decode_kv` returns were in the
    context. Validates the stream as :func:`decode_kv` does before it decodes: the header and
    checksum (:func:`kvtune.codecs.read_header`), the policy against the id it records, and
    the selection block (:func:`kvtune.codecs.select.check_selection`).

    Returns:
        :class:`~kvtune.codecs.select.KeptPositions`: per layer the original token count and
        int64 ``(batch, kv_heads, kept)`` increasing positions.

    Raises:
        KVStreamError: the stream is truncated or corrupt (as :func:`decode_kv`), or names a
            policy this kvtune cannot build.
    """
    header = read_header(stream)
    config = _remembered(header, "policy", lambda: _header_policy(header))
    bits = check_selection(header, selection_views(stream, header), selecting_transform(config))
    if header.source_tokens is None:
        return None
    return KeptPositions(list(header.source_tokens), mask_positions(header, bits))


def _decode_read(stream, header: StreamHeader, expect: PolicyConfig | None, impl: str, out, device) -> KVLayers:
    """:func:`decode_kv` after :func:`kvtune.codecs.stream.read_header` (without its checksum,
    which every route below verifies before it returns or, but for the fast path, before it
    decodes)."""
    if expect is not None and header.policy_id != expect.policy_id:
        raise PolicyMismatchError(f"KV stream was encoded with policy {header.policy_id}, caller expects "
                                  f"{expect.policy_id}")
    config = _remembered(header, "policy", lambda: _header_policy(header))
    dtype = NAME_DTYPES[header.dtype]
    bits = check_selection(header, selection_views(stream, header), selecting_transform(config))
    # the kept tokens decode as any stream of the rest of the policy
    config = _remembered(header, "inner policy", lambda: without_selection(config))
    # the kept positions only for a transform that depends on them (e.g. pca un-rotating keys)
    positions = mask_positions(header, bits) if bits and any(t.uses_positions for t in config.transforms) else None
    check_claimed_sizes(header, None if config.codec.bounds_by_length else section_views(stream, header), config)
    device = decode_device(device)
    if out is not None:
        _check_out(out, header.shapes, dtype, device, stream if device.type == "cpu" else None)
    if positions is not None:
        if impl == "torch":  # the device path takes rows at 0 .. tokens - 1, not the kept positions
            raise ConfigError(f"policy {header.policy_id}: keep before a position-dependent transform has no "
                              "torch path; use impl='auto', 'fast' or 'reference'")
        if impl == "auto":  # the fast path, given the positions, or the reference
            impl = "fast" if fastpath.supports(config) else "reference"
    fast = device.type == "cpu" and not _use_torch(impl, config, False) and _use_fast(impl, config) \
        and _remembered(header, ("plausible sizes", config.policy_id), lambda: fastpath.sizes_plausible(header, config))
    if not fast:
        check_checksum(stream, header)
    if not (fast and fastpath.decode_plan(config, header, dtype) is not None):  # the batch kernels check it
        check_finite_metadata(stream, header)
    if _use_torch(impl, config, device.type != "cpu"):
        try:
            return torchpath.decode_tensors(stream, header, section_views(stream, header), config, device, out)
        except fastpath.LayerDecodeError as err:
            _raise_decode_error(header.policy_id, err.layer, err.exc)
    if device.type != "cpu":  # no device path for this policy: decode on the CPU, then move
        moved = [(k.to(device), v.to(device)) for k, v in decode_kv(stream, impl=impl)]
        if out is None:
            return moved
        for (ok, ov), (k, v) in zip(out, moved):
            ok.copy_(k)
            ov.copy_(v)
        return out
    if fast:
        try:
            return fastpath.decode_tensors(stream, header, None, config, out, positions, check_crc=True)
        except fastpath.LayerDecodeError as err:
            _raise_decode_error(header.policy_id, err.layer, err.exc)
    result: KVLayers = []
    for i, ((kshape, vshape), (ks, vs)) in enumerate(zip(header.shapes, section_views(stream, header))):
        layer = header.layer_offset + i
        try:
            pos = None if positions is None else positions[i]
            k = _decode_tensor(ks, kshape, config, config.key, layer, "key", pos)
            v = _decode_tensor(vs, vshape, config, config.value, layer, "value", pos)
        except Exception as exc:
            _raise_decode_error(header.policy_id, layer, exc)
        k, v = to_output_dtype(k, dtype), to_output_dtype(v, dtype)
        if out is None:
            result.append((k, v))
        else:
            out[i][0].copy_(k)
            out[i][1].copy_(v)
    return result if out is None else out


MAX_ELEMENTS_PER_BYTE = 4096
"""Most elements per byte of its sections a tensor may have when its quantizer codes fewer
symbols than elements (:meth:`~kvtune.codecs.base.Quantizer.elements_per_symbol` > 1, e.g.
``dp-alloc`` dropping components), whatever its payloads' symbol bounds (an rANS payload of
near-constant symbols may claim 1,024 per byte): a forged shape then allocates at most 16 KiB of
float32 output per byte of stream. Real KV stays far below (a SmolLM2 layer coding one component
of 192 over 1,024 tokens, with one bfloat16 sink token, has ~250)."""

MAX_UNCONFIRMED_PLAN = 1 << 20
"""Most heads + tokens of a K or V tensor whose payloads declare no symbol bound
(:meth:`~kvtune.codecs.base.Codec.max_symbols` is ``None``, e.g. range-coded ones) that the
decoder plans with no more evidence than its shape; a larger tensor needs at least one byte of
sections per 8 heads + tokens (the density of ``bitpack``). Plans are linear in heads + tokens
(per-head widths, per-token floors, segment indices: a few tens of MiB at this limit); the
codec confirms the symbol count only when it decodes a segment of the plan."""


def sections_problem(shape: tuple[int, ...], sections: TensorSections, codec: Codec, per_symbol: int = 1) -> str | None:
    """Why a non-empty K or V tensor of ``shape`` cannot be the one coded in ``sections`` with
    ``codec``, or ``None``: the rule that bounds what the decoder allocates from a claimed shape
    before the codec has confirmed it.

    When every payload bounds its symbols (:meth:`Codec.max_symbols`), the tensor has at most
    ``per_symbol`` times their sum of elements, and with ``per_symbol > 1`` at most
    :data:`MAX_ELEMENTS_PER_BYTE` per byte of its sections. Otherwise its heads + tokens (what a
    plan costs) are at most :data:`MAX_UNCONFIRMED_PLAN`, or 8 per byte of its sections (state,
    metadata, payloads).

    Args:
        shape: ``(batch, kv_heads, tokens, head_dim)`` with at least one element.
        sections: the tensor's sections (bytes or memoryviews).
        codec: the policy's codec.
        per_symbol: the quantizer's :meth:`~kvtune.codecs.base.Quantizer.elements_per_symbol`
            for the tensor (``dp-alloc`` drops components, whose elements have no symbols), >= 1.

    Raises:
        CorruptStreamError: a payload's own size declaration is malformed (from ``max_symbols``).
    """
    bounds = [codec.max_symbols(p) for p in sections.payload]
    nbytes = sum(len(x) for x in sections.flat())
    if per_symbol > 1 and math.prod(shape) > MAX_ELEMENTS_PER_BYTE * nbytes:
        return (f"claims {math.prod(shape)} elements; its {nbytes} section bytes allow at most "
                f"{MAX_ELEMENTS_PER_BYTE * nbytes} (MAX_ELEMENTS_PER_BYTE)")
    if None not in bounds:
        most, numel = per_symbol * sum(bounds), math.prod(shape)
        if numel > most:
            return (f"claims {numel} elements; its {sum(map(len, sections.payload))} payload bytes hold at most "
                    f"{most} with codec {codec.name!r}")
        return None
    allowed = max(MAX_UNCONFIRMED_PLAN, 8 * nbytes)
    if shape[1] + shape[2] > allowed:
        return (f"has {shape[1]} heads + {shape[2]} tokens; its {nbytes} section bytes, whose {codec.name!r} payloads "
                f"declare no symbol count, allow at most {allowed} (MAX_UNCONFIRMED_PLAN, or 8 per byte)")
    return None


def check_finite_metadata(stream: bytes | bytearray | memoryview, header: StreamHeader) -> None:
    """Refuse a stream whose float16 metadata or transform state holds a NaN or inf.

    Every metadata field and transform state is float16 (:class:`kvtune.codecs.base.MetaField`),
    and an encoder writes only finite ones (scales and zero points saturate at +-65504, as do
    ``affine``'s statistics). A forged stream with a NaN scale and a recomputed CRC used to decode
    to NaN tensors on every path; one pass over those sections
    (:func:`kvtune.codecs.fastpath.first_nonfinite_f16`; measured 0.25 ms for the 1.29 MB of
    metadata of a 6.8 MB ``kivi-2`` stream, about 2 % of its decode) refuses it. The fast path's
    batch route (:func:`kvtune.codecs.fastpath.decode_plan`) does the same check inside its
    decode kernels instead, while each tensor's metadata is in cache, and raises the same error.

    Args:
        stream: the stream bytes; header: its header (:func:`kvtune.codecs.stream.read_stream`,
            which checked that the sections fit in the stream).

    Raises:
        CorruptStreamError: naming the first such section's layer, K or V, and kind.
    """
    starts, ends, where = _remembered(header, "float16 ranges", lambda: _float16_ranges(header.header_nbytes, header.sections))
    bad = fastpath.first_nonfinite_f16(np.frombuffer(stream, dtype=np.uint8), starts, ends)
    if bad >= 0:
        i, name, what = where[bad]
        raise fastpath.nonfinite_float16_error(header.layer_offset + i, name, what)


def _float16_ranges(header_nbytes: int, sections: tuple) -> tuple[np.ndarray, np.ndarray, tuple]:
    """Byte ranges of every float16 section of a stream (transform state and metadata, wire
    order) as int64 ``(starts, ends)``, and per range ``(layer, "K"/"V", kind)``; a function of
    the header's section lengths alone, so remembered per header (:func:`_remembered`). The
    arrays are never handed out: callers only read them."""
    starts, ends, where = [], [], []
    pos = header_nbytes
    for i, lengths in enumerate(sections):
        for name, lens in zip("KV", lengths):
            for j, n in enumerate(lens.flat()):  # wire order: state, then (metadata, payload) per segment
                if j == 0 or j % 2:
                    starts.append(pos)
                    ends.append(pos + n)
                    where.append((i, name, "metadata" if j else "transform state"))
                pos += n
    return np.array(starts, np.int64), np.array(ends, np.int64), tuple(where)


def check_claimed_sizes(header: StreamHeader, sections: list[tuple[TensorSections, TensorSections]], config: PolicyConfig) -> None:
    """Refuse a stream whose header claims tensors its sections cannot hold, before anything
    is planned or allocated from the claimed shapes.

    Per K or V tensor: an empty one records no segment, a non-empty one at least one; its
    shape is one an encoder writes (:func:`kvtune.codecs.stream.shape_problem`: no zero batch,
    heads or head_dim, every dimension and the element count within the format's limits); a
    non-empty one passes :func:`sections_problem` (with ``bitpack``, at most 8 elements per
    payload byte; with ``zstd``, 8 per content byte its frames declare; with range-coded
    payloads, which declare no count, at most :data:`MAX_UNCONFIRMED_PLAN` heads + tokens or 8
    per section byte; times the quantizer's
    :meth:`~kvtune.codecs.base.Quantizer.elements_per_symbol` for the components ``dp-alloc``
    drops, then at most :data:`MAX_ELEMENTS_PER_BYTE` per section byte). The bounded claim then
    bounds everything the decoder allocates for the tensor before its codec confirms the symbol
    count of a segment (plans are linear in heads and tokens, the output in elements, allocated
    after every segment decoded); an empty tensor is neither planned nor allocated.

    Args:
        header: the stream header (:func:`kvtune.codecs.stream.read_stream`).
        sections: per layer the ``(K, V)`` sections as memoryviews, from the same call; or
            ``None`` with a codec whose bounds are the payloads' lengths
            (:attr:`~kvtune.codecs.base.Codec.bounds_by_length`: the header's lengths suffice,
            and the check runs once per distinct header).
        config: the policy the header carries.

    Raises:
        CorruptStreamError: the first tensor (layer order, K before V) that breaks a rule.
        KVStreamError: a quantizer that cannot plan the tensor (a ``dp-alloc`` basis not loaded,
            or of another geometry), as decoding the layer would say.
        ValueError: ``sections`` is ``None`` with a codec that reads its payloads to bound them.
    """
    if config.codec.bounds_by_length:  # a function of the header alone: checked once per header
        _remembered(header, ("claimed sizes", config.policy_id), lambda: _check_claimed_sizes(
            header, sections if sections is not None else _zero_sections([(k.flat(), v.flat()) for k, v in header.sections]),
            config))
    elif sections is None:
        raise ValueError(f"codec {config.codec.name!r} reads its payloads to bound them: pass the stream's sections")
    else:
        _check_claimed_sizes(header, sections, config)


def _check_claimed_sizes(header: StreamHeader, sections, config: PolicyConfig) -> bool:
    quants = (config.key, config.value)
    for i, (shapes, tensors, lengths) in enumerate(zip(header.shapes, sections, header.sections)):
        for name, shape, secs, lens, quant, kind in zip("KV", shapes, tensors, lengths, quants, KINDS):
            where = f"corrupt KV stream: layer {header.layer_offset + i} {name} of shape {shape}"
            numel = math.prod(shape)
            if bool(numel) != bool(lens.num_segments):  # plans partition a tensor: empty <=> no segments
                raise CorruptStreamError(f"{where} has {numel} elements but records {lens.num_segments} segments")
            problem = shape_problem(shape)  # before a quantizer plans from it
            if problem is not None:
                raise CorruptStreamError(f"{where} {problem}")
            if not numel:
                continue
            try:
                per_symbol = quant.elements_per_symbol(shape, layer=header.layer_offset + i, kind=kind)
            except ConfigError as exc:  # e.g. a basis not loaded: as decoding the layer would say
                _raise_decode_error(header.policy_id, header.layer_offset + i, exc)
            try:
                problem = sections_problem(shape, secs, config.codec, per_symbol)
            except CorruptStreamError as exc:
                problem = f"has a payload whose size declaration is malformed ({exc})"
            if problem is not None:
                raise CorruptStreamError(f"{where} {problem}")
    return True


def decode_device(device: torch.device | str | int | None) -> torch.device:
    """The device ``decode_kv(device=...)`` decodes to (None: the CPU), checked before decoding.

    Raises:
        KVInputError: not a device torch knows, the meta device (tensors without data), or a
            device this process cannot use (e.g. ``"cuda"`` without CUDA).
    """
    try:
        dev = torch.device("cpu" if device is None else device)
    except (RuntimeError, TypeError, ValueError) as exc:
        raise KVInputError(f"decode device {device!r} is not a device ({exc})") from None
    if dev.type == "meta":
        raise KVInputError("decode device 'meta' holds no data; decode to a real device")
    if dev.type != "cpu":
        try:
            torch.empty(0, device=dev)
        except (RuntimeError, AssertionError) as exc:  # torch asserts when built without the backend
            raise KVInputError(f"decode device {dev} cannot be used here ({exc})") from None
    return dev


def _check_out(out: KVLayers, shapes, dtype: torch.dtype, device: torch.device, stream=None) -> None:
    """``decode_kv(out=...)`` needs contiguous tensors on ``device`` of the stream's shapes and
    dtype, without autograd, no two of which share memory (one would overwrite the other), nor
    memory with the ``stream`` being decoded (CPU; decoding would overwrite its own input)."""
    if not isinstance(out, (list, tuple)) or len(out) != len(shapes):
        raise KVInputError(f"out must be a list of {len(shapes)} (K, V) pairs")
    spans = []
    on_cpu = device.type == "cpu"
    for i, (pair, kv_shapes) in enumerate(zip(out, shapes)):
        if not (isinstance(pair, (list, tuple)) and len(pair) == 2):
            raise KVInputError(f"out[{i}] must be a (K, V) pair")
        for name, t, shape in zip("KV", pair, kv_shapes):
            if not (isinstance(t, torch.Tensor) and t.shape == tuple(shape) and t.dtype == dtype and t.is_contiguous()
                    and (t.is_cpu if on_cpu else (t.device.type == device.type and device.index in (None, t.device.index)))):
                raise KVInputError(f"out[{i}] {name} must be a contiguous {dtype} tensor on {device} of shape {tuple(shape)}")
            if t.requires_grad:
                raise KVInputError(f"out[{i}] {name} requires grad; decode writes in place, pass a tensor without autograd")
            if t.is_neg():
                raise KVInputError(f"out[{i}] {name} is a lazy negation view (Tensor.is_neg): its memory would hold the "
                                   "negated values; pass a tensor that owns its values")
            if t.numel():
                start = t.data_ptr()
                spans.append((start, start + t.nbytes, i, name))
    if stream is not None and len(stream):
        view = np.frombuffer(stream, np.uint8)
        spans.append((view.ctypes.data, view.ctypes.data + view.size, -1, ""))
    spans.sort()
    for (_, end, *a), (start, _, *b) in zip(spans, spans[1:]):
        if start < end:
            what = [f"out[{i}] {name}" if i >= 0 else "the stream's buffer" for i, name in (a, b)]
            raise KVInputError(f"{what[0]} and {what[1]} overlap in memory; each decoded tensor needs its own buffer")


def _raise_decode_error(policy_id: str, layer: int, exc: BaseException):
    """Re-raise a per-layer decode failure as the typed stream error it stands for."""
    if isinstance(exc, CorruptStreamError):
        raise exc
    if isinstance(exc, ConfigError):
        raise KVStreamError(f"KV stream policy {policy_id} cannot decode layer {layer}: {exc}") from None
    if isinstance(exc, (ValueError, RuntimeError, LookupError, TypeError, ArithmeticError, struct.error)):
        raise CorruptStreamError(f"corrupt KV stream: layer {layer} does not decode ({exc})") from None
    raise exc
