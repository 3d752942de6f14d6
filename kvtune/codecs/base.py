"""Base classes and registries of the T -> Q -> C pipeline.

The pipeline is the modular compression-strategy space of KVServe
("KVServe: Service-Aware KV Cache Compression for Communication-Efficient
Disaggregated LLM Serving", arXiv 2605.13734):
every policy picks one transform chain, one quantizer and one codec.

A compression policy is ``bitstream = C(Q(T(X)))``:

* a :class:`Transform` reshapes the value distribution (e.g. a Hadamard rotation); it may
  carry per-stream *state* calibrated on the data (e.g. per-channel scales) that travels in the
  stream, and may ask the quantizer for a minimum precision on some tokens (delta anchors),
* a :class:`Quantizer` maps float values to small unsigned integer symbols plus metadata
  (scales, zero points), in one or more :class:`Segment` s of one symbol width each (mixed
  precision across heads, layers and token windows),
* a :class:`Codec` packs the symbols of each segment losslessly into bytes.

Every component is a small frozen dataclass registered by name with a decorator
(:func:`register_transform`, :func:`register_quantizer`, :func:`register_codec`), in the style
of kvpress presses and torchao configs. Its dataclass fields are its parameters, declared with
:func:`param` so that values are validated on construction (a bad value raises
:class:`~kvtune.core.errors.ConfigError` naming the component, the parameter and the allowed
values). ``to_dict()``/``from_dict()`` round-trip a component through JSON.

Adding a component::

    @register_quantizer("my_quant")
    @dataclass(frozen=True)
    class MyQuantizer(Quantizer):
        bits: int = param(4, low=1, high=8, doc="bits per symbol")

        @property
        def symbol_bits(self): return self.bits
        def block_meta_layout(self, shape): ...          # metadata fields of one block
        def quantize_block(self, x): ...                 # -> (symbols, {name: tensor})
        def dequantize_block(self, symbols, meta, shape): ...

A quantizer that mixes widths overrides the *plan* hooks instead (:meth:`Quantizer.head_bits`,
:meth:`Quantizer.window_min_bits`, :meth:`Quantizer.coder`); the generic
:meth:`Quantizer.quantize` / :meth:`Quantizer.dequantize` cut the tensor into segments and run
each segment's single-width block kernel. See :class:`Quantizer`.

Tensor convention: KV tensors are ``(batch, kv_heads, tokens, head_dim)``; inside the pipeline
they are float32 on the CPU. ``layer`` is the absolute transformer layer index and ``kind`` is
``"key"`` or ``"value"``.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Mapping, Sequence, TypeVar

import numpy as np
import torch

from kvtune.core.registry import Registry
from kvtune.core.errors import ConfigError, CorruptStreamError, KVInputError

__all__ = [
    "Component",
    "Transform",
    "Quantizer",
    "Codec",
    "QuantizedTensor",
    "QuantizedSegment",
    "Segment",
    "MetaField",
    "TRANSFORMS",
    "QUANTIZERS",
    "CODECS",
    "register_transform",
    "register_quantizer",
    "register_codec",
    "param",
    "plan_segments",
    "check_value_range",
    "transform_min_bits",
    "transform_state_nbytes",
    "meta_to_bytes",
    "meta_from_bytes",
    "BF16_BITS",
]

Shape = tuple[int, ...]
Index = slice | torch.Tensor | None
"""A selection along one axis: ``None`` (everything), a ``slice`` (one run) or int64 indices."""

BF16_BITS = 16
"""Symbol width of raw bfloat16 passthrough (sink/recent windows, the ``none`` quantizer)."""


# ----------------------------------------------------------------------------- parameters


def param(
    default: Any,
    *,
    choices: tuple[Any, ...] | None = None,
    low: int | float | None = None,
    high: int | float | None = None,
    doc: str = "",
    elide_default: bool = False,
) -> Any:
    """Declare a validated component parameter (a dataclass field with a default).

    The parameter's type is the type of ``default`` (``bool``, ``int``, ``float``, ``str`` or
    ``tuple``); ``bool`` is not accepted where an ``int`` is expected, an ``int`` is accepted
    (and converted) where a ``float`` is expected, a list is accepted (and converted, nested
    lists included, to tuples) where a ``tuple`` is expected; element checks of tuples belong
    in :meth:`Component.validate`.

    Args:
        default: default value; also fixes the type.
        choices: allowed values, if the parameter is categorical.
        low: inclusive lower bound for numbers.
        high: inclusive upper bound for numbers.
        doc: one-line description (units included), shown in error messages' context.
        elide_default: leave the parameter out of :meth:`Component.to_dict` while it holds its
            default. Used for parameters added after policy ids were first published, so that
            policies which do not use them keep their ``policy_id``.

    Returns:
        A :func:`dataclasses.field` carrying the validation rules in its metadata.
    """
    return field(
        default=default,
        metadata={
            "kvtune_param": True,
            "type": type(default),
            "choices": choices,
            "low": low,
            "high": high,
            "doc": doc,
            "elide_default": elide_default,
        },
    )


def _freeze(value: Any) -> Any:
    """Nested lists/tuples -> nested tuples (hashable, so components stay hashable)."""
    if isinstance(value, (list, tuple)):
        return tuple(_freeze(v) for v in value)
    return value


def _thaw(value: Any) -> Any:
    """Nested tuples -> nested lists (the JSON-ready form used by ``to_dict``)."""
    if isinstance(value, tuple):
        return [_thaw(v) for v in value]
    return value


INT_PARAM_LIMIT = 2**63
"""Integer parameters lie in ``[-2**63, 2**63)`` (int64, what the kernels and torch index
with) unless their own ``low`` / ``high`` are tighter."""


def _allowed_text(meta: Mapping[str, Any]) -> str:
    """Human-readable description of a parameter's allowed values."""
    if meta["choices"] is not None:
        return "one of " + ", ".join(repr(c) for c in meta["choices"])
    typ = meta["type"]
    kind = {bool: "true or false", int: "an integer", float: "a number", str: "a string", tuple: "a list"}.get(
        typ, typ.__name__
    )
    low, high = meta["low"], meta["high"]
    if low is not None and high is not None:
        return f"{kind} in {low}..{high}"
    if low is not None:
        return f"{kind} >= {low}"
    if high is not None:
        return f"{kind} <= {high}"
    return kind


def _check_value(meta: Mapping[str, Any], value: Any) -> tuple[bool, Any]:
    """Return ``(ok, normalized_value)`` for one parameter value against its rules."""
    typ = meta["type"]
    if typ is bool:
        ok = isinstance(value, bool)
    elif typ is int:
        ok = isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))
        value = int(value) if ok else value
    elif typ is float:
        ok = isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, (bool, np.bool_))
        value = float(value) if ok else value
        ok = ok and math.isfinite(value)
    elif typ is tuple:
        ok = isinstance(value, (list, tuple))
        value = _freeze(value) if ok else value
    else:
        ok = isinstance(value, typ)
    if not ok:
        return False, value
    if meta["choices"] is not None and value not in meta["choices"]:
        return False, value
    if meta["low"] is not None and value < meta["low"]:
        return False, value
    if meta["high"] is not None and value > meta["high"]:
        return False, value
    if typ is int and not -INT_PARAM_LIMIT <= value < INT_PARAM_LIMIT:
        return False, value
    return True, value


# ----------------------------------------------------------------------------- components


@dataclass(frozen=True)
class Component:
    """A named, parameterized, JSON-serializable pipeline component.

    Subclasses are frozen dataclasses whose fields (declared with :func:`param`) are the
    parameters. Construction validates every parameter and then calls :meth:`validate` for
    cross-parameter rules.

    Raises:
        ConfigError: on construction, when a parameter value is invalid; the message names
            the component, the parameter and the allowed values.
    """

    name: ClassVar[str] = ""
    kind: ClassVar[str] = "component"
    registry: ClassVar[dict[str, type["Component"]]] = {}

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            meta = f.metadata
            if not meta.get("kvtune_param"):
                continue
            ok, value = _check_value(meta, getattr(self, f.name))
            if not ok:
                raise ConfigError(
                    f"{self.kind} {self.name!r}: parameter {f.name!r} = {getattr(self, f.name)!r} is invalid; "
                    f"allowed: {_allowed_text(meta)}"
                )
            object.__setattr__(self, f.name, value)
        self.validate()

    def validate(self) -> None:
        """Cross-parameter checks; raise :class:`ConfigError` naming the parameter. Default: none."""

    @classmethod
    def param_names(cls) -> tuple[str, ...]:
        """Names of the parameters (dataclass fields), in declaration order."""
        return tuple(f.name for f in dataclasses.fields(cls))

    def params(self) -> dict[str, Any]:
        """All parameters with their values (defaults included)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    def to_dict(self) -> dict[str, Any]:
        """Canonical JSON-ready dict: ``{"name": ..., <every parameter>: value}``.

        Parameters declared with ``elide_default=True`` are left out while they hold their
        default (:func:`param`); tuples are written as lists.
        """
        out: dict[str, Any] = {"name": self.name}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.metadata.get("elide_default") and value == f.default:
                continue
            out[f.name] = _thaw(value)
        return out

    @classmethod
    def from_dict(cls: type[_C], spec: Mapping[str, Any] | str, *, default_name: str | None = None) -> _C:
        """Build a component from ``{"name": ..., **params}`` or from a bare name string.

        Called on a base class (``Quantizer.from_dict``) the ``name`` selects the registered
        subclass; called on a registered subclass the ``name`` may be omitted.

        Args:
            spec: the dict (or a bare name for default parameters).
            default_name: the name used when ``spec`` has no ``"name"`` key.

        Raises:
            ConfigError: unknown component name, unknown parameter key, or bad value; the
                message names the component, the key and the allowed values.
        """
        if isinstance(spec, str):
            spec = {"name": spec}
        if not isinstance(spec, Mapping):
            raise ConfigError(f"{cls.kind}: expected a name or a mapping with a 'name' key, got {spec!r}")
        spec = dict(spec)
        name = spec.pop("name", None)
        if cls.name:  # a concrete, registered class
            target: type[Component] = cls
            if name is not None and name != cls.name:
                raise ConfigError(f"{cls.kind} {cls.name!r}: got 'name' = {name!r}")
        else:
            name = default_name if name is None else name
            if name is None:
                raise ConfigError(f"{cls.kind}: missing 'name'; allowed: {', '.join(sorted(cls.registry))}")
            if not isinstance(name, str) or name not in cls.registry:
                raise ConfigError(f"unknown {cls.kind} {name!r}; allowed: {', '.join(sorted(cls.registry))}")
            target = cls.registry[name]
        allowed = target.param_names()
        for key in spec:
            if key not in allowed:
                raise ConfigError(
                    f"{target.kind} {target.name!r}: unknown parameter {key!r}; allowed: "
                    f"{', '.join(('name',) + allowed)}"
                )
        return target(**spec)  # type: ignore[return-value]

    def short_label(self) -> str:
        """Compact human-readable label: the name, plus parameters that differ from defaults."""
        diff = [
            f"{f.name}={getattr(self, f.name)}"
            for f in dataclasses.fields(self)
            if getattr(self, f.name) != f.default
        ]
        return self.name + (f"({','.join(diff)})" if diff else "")


_C = TypeVar("_C", bound=Component)


@dataclass(frozen=True)
class MetaField:
    """One metadata tensor of a quantized block or a transform state: its name, shape and dtype
    (bytes on the wire)."""

    name: str
    shape: Shape
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        """Size in bytes."""
        return math.prod(self.shape) * torch.empty((), dtype=self.dtype).element_size()


@dataclass(frozen=True)
class Transform(Component):
    """T: an invertible map on float32 ``(batch, kv_heads, tokens, head_dim)`` tensors.

    Life cycle of one K or V tensor (:func:`kvtune.codecs.policy.encode_kv`)::

        state = t.fit(x, layer=l, kind=k)                 # encoder only; {} when stateless
        y = t.forward(x, layer=l, kind=k, state=state)    # state bytes travel in the stream
        ...
        x_hat = t.inverse(y_hat, layer=l, kind=k, state=state)   # decoder, state from the stream

    Implementations must be deterministic functions of their parameters, ``layer``, ``kind``
    and ``state`` (the decoder re-derives everything else from the stream header), and
    ``inverse(forward(x)) == x`` up to float32 rounding.

    State: :meth:`fit` calibrates tensors on the data being encoded (e.g. per-channel scales)
    and returns them *already rounded to their wire dtype*, so that encoder and decoder use the
    same values; :meth:`state_layout` gives their names, shapes and dtypes. Their bytes count in
    the stream size.

    Precision floors: :meth:`token_min_bits` may ask the quantizer to code some tokens with at
    least a given number of bits (delta coding's anchors); see :meth:`Quantizer.plan`.

    Positions: a transform whose :attr:`uses_positions` is true depends on the token positions
    of the rows (e.g. ``pca`` un-rotating RoPE'd keys); its :meth:`forward` and :meth:`inverse`
    also take ``positions``, int64 ``(batch, kv_heads, tokens)``, or ``None`` for rows at
    positions ``0 .. tokens - 1``. After token selection (``keep``) the rows are the kept
    tokens, at their original positions (:func:`kvtune.codecs.policy.apply_transforms`).
    """

    kind: ClassVar[str] = "transform"
    uses_positions: ClassVar[bool] = False
    mixes_heads: ClassVar[bool] = False
    """True when an output channel depends on several KV heads of the same token (``pca``
    across heads): token selection must then keep the same tokens in every head."""

    def state_layout(self, shape: Shape, *, layer: int, kind: str) -> tuple[MetaField, ...]:
        """Wire layout of the state for an input of ``shape`` (default: no state).

        Must depend only on the parameters, ``shape``, ``layer`` and ``kind``.
        """
        return ()

    def fit(self, x: torch.Tensor, *, layer: int, kind: str) -> dict[str, torch.Tensor]:
        """Calibrate the state on float32 ``(batch, kv_heads, tokens, head_dim)`` ``x``.

        Returns:
            ``{name: tensor}`` in the shapes and dtypes of :meth:`state_layout` (default ``{}``).
        """
        return {}

    def forward(
        self, x: torch.Tensor, *, layer: int, kind: str, state: Mapping[str, torch.Tensor] | None = None
    ) -> torch.Tensor:
        """Apply the transform.

        Args:
            x: float32 ``(batch, kv_heads, tokens, head_dim)``.
            layer: absolute transformer layer index (``layer_offset + i``).
            kind: ``"key"`` or ``"value"``.
            state: the output of :meth:`fit` (required by stateful transforms, ignored by the
                others).

        Returns:
            float32 tensor of the same shape.
        """
        raise NotImplementedError

    def inverse(
        self, y: torch.Tensor, *, layer: int, kind: str, state: Mapping[str, torch.Tensor] | None = None
    ) -> torch.Tensor:
        """Undo :meth:`forward` (same arguments and shapes)."""
        raise NotImplementedError

    def token_min_bits(self, tokens: int) -> torch.Tensor | None:
        """Minimum symbol width per token the quantizer must honour, or ``None`` (no constraint).

        Returns:
            int64 ``(tokens,)``: 0 (no floor), 1..8, or 16 (bfloat16).
        """
        return None

    def min_bits_values(self) -> tuple[int, ...]:
        """The non-zero values :meth:`token_min_bits` can return (for codec compatibility checks)."""
        return ()

    @property
    def is_identity(self) -> bool:
        """True when the transform is the identity map (dropped from canonical policies)."""
        return False


def transform_min_bits(transforms: Sequence[Transform], tokens: int) -> torch.Tensor | None:
    """Per-token precision floors the transforms ask for: the elementwise max of their
    :meth:`Transform.token_min_bits` (int64 ``(tokens,)``), or ``None`` when none asks."""
    floors = None
    for t in transforms:
        f = t.token_min_bits(tokens)
        if f is not None:
            floors = f if floors is None else torch.maximum(floors, f)
    return floors


def transform_state_nbytes(transforms: Sequence[Transform], shape: Shape, *, layer: int, kind: str) -> int:
    """Bytes of the transforms' state for a tensor of ``shape`` (the sum of their
    :meth:`Transform.state_layout` sizes): the length of the tensor's state section. Computed
    from the layouts alone, without allocating anything of ``shape``."""
    return sum(f.nbytes for t in transforms for f in t.state_layout(shape, layer=layer, kind=kind))


# ----------------------------------------------------------------------------- segments


def _as_index(mask: torch.Tensor) -> Index:
    """Compact selection of the True positions of a 1-D bool ``mask``: ``None`` (all of them),
    a ``slice`` (one contiguous run) or increasing int64 indices."""
    idx = torch.nonzero(mask).flatten()
    n = idx.numel()
    if n == mask.numel():
        return None
    if n and int(idx[-1]) - int(idx[0]) + 1 == n:
        return slice(int(idx[0]), int(idx[-1]) + 1)
    return idx


def _index_tensor(index: Index, n: int) -> torch.Tensor:
    """int64 indices of a selection along an axis of length ``n``."""
    if index is None:
        return torch.arange(n)
    if isinstance(index, slice):
        return torch.arange(n)[index]
    return index


@dataclass(frozen=True, eq=False)
class Segment:
    """A rectangular slice ``x[:, heads][:, :, tokens]`` of a K/V tensor, coded with one width.

    A quantizer's :meth:`Quantizer.plan` partitions a ``(batch, kv_heads, tokens, head_dim)``
    tensor into segments (every element in exactly one); each segment is quantized by the
    single-width block kernel of its ``coder`` and carries its own metadata and payload in the
    stream. The plan is a deterministic function of the policy, the shape, the layer and the
    kind, so the decoder re-derives it instead of reading it.

    Attributes:
        heads: selection along ``kv_heads`` (``None`` = all, a ``slice``, or int64 indices).
        tokens: selection along ``tokens`` (same forms).
        shape: ``(batch, selected heads, selected tokens, head_dim)``.
        coder: the block quantizer of this slice; ``coder.symbol_bits`` is the segment's width.
    """

    heads: Index
    tokens: Index
    shape: Shape
    coder: "Quantizer"

    @property
    def bits(self) -> int:
        """Symbol width: 1..8, or 16 for raw bfloat16."""
        return self.coder.symbol_bits

    @property
    def numel(self) -> int:
        """Number of elements (symbols) in the segment."""
        return math.prod(self.shape)

    @property
    def is_whole(self) -> bool:
        """True when the segment is the whole tensor."""
        return self.heads is None and self.tokens is None

    @property
    def meta_layout(self) -> tuple[MetaField, ...]:
        """The coder's metadata fields for this segment's shape (wire order)."""
        return self.coder.block_meta_layout(self.shape)

    def head_indices(self, heads: int) -> torch.Tensor:
        """int64 indices of the selected heads out of ``heads``."""
        return _index_tensor(self.heads, heads)

    def take(self, x: torch.Tensor) -> torch.Tensor:
        """The segment's slice of ``x`` (a view when the selections are slices)."""
        if self.heads is not None:
            x = x[:, self.heads]
        if self.tokens is not None:
            x = x[:, :, self.tokens]
        return x

    def put(self, out: torch.Tensor, y: torch.Tensor) -> None:
        """Write the segment ``y`` (shape :attr:`shape`) into its place in ``out`` (in place)."""
        h, t = self.heads, self.tokens
        if isinstance(h, torch.Tensor) and isinstance(t, torch.Tensor):
            out[:, h[:, None], t[None, :]] = y  # adjacent advanced indices keep their place
        else:
            out[:, slice(None) if h is None else h, slice(None) if t is None else t] = y


def plan_segments(
    shape: Shape,
    head_bits: Sequence[int],
    token_min_bits: torch.Tensor | None,
    coder: Callable[[int], "Quantizer"],
) -> tuple[Segment, ...]:
    """Partition a ``(batch, kv_heads, tokens, head_dim)`` tensor into single-width segments.

    Element ``(h, t)`` gets width ``max(head_bits[h], token_min_bits[t])``. Tokens whose
    per-head width vectors are equal form one token class (e.g. sink and recent tokens, both
    bfloat16, are one class); inside a class, heads of equal width form one segment. Classes
    are ordered by their first token, segments inside a class by their first head, so the plan
    is deterministic. Empty tensors have no segments.

    Args:
        shape: the tensor shape.
        head_bits: width per KV head (1..8 or 16), ``len == kv_heads``.
        token_min_bits: int64 ``(tokens,)`` floors (0 = none) or ``None``.
        coder: width -> block quantizer of that width.

    Returns:
        The segments.

    Raises:
        ValueError: ``head_bits`` or ``token_min_bits`` do not match ``shape``.
    """
    b, h, t, d = shape
    if len(head_bits) != h:
        raise ValueError(f"{len(head_bits)} head widths for {h} kv heads")
    if token_min_bits is None and len(set(head_bits)) == 1 and t:  # one width: the whole tensor
        return (Segment(None, None, tuple(shape), coder(int(head_bits[0]))),)
    floors = torch.zeros(t, dtype=torch.int64) if token_min_bits is None else token_min_bits.to(torch.int64)
    if tuple(floors.shape) != (t,):
        raise ValueError(f"token_min_bits has shape {tuple(floors.shape)}, expected ({t},)")
    classes: dict[tuple[int, ...], torch.Tensor] = {}
    for f in torch.unique(floors).tolist():  # a handful of distinct floors, not per token
        widths = tuple(max(int(f), int(w)) for w in head_bits)
        mask = floors == f
        classes[widths] = classes[widths] | mask if widths in classes else mask
    ordered = sorted(classes.items(), key=lambda item: int(torch.argmax(item[1].to(torch.uint8))))
    segments = []
    for widths, mask in ordered:
        tokens, ntok = _as_index(mask), int(mask.sum())
        for w in dict.fromkeys(widths):  # distinct widths in first-head order
            hmask = torch.tensor([x == w for x in widths], dtype=torch.bool)
            segments.append(Segment(_as_index(hmask), tokens, (b, int(hmask.sum()), ntok, d), coder(w)))
    return tuple(segments)


def check_value_range(segments: Sequence[Segment], x: torch.Tensor, *, layer: int, kind: str) -> None:
    """Refuse a tensor that a segment's block kernel cannot represent.

    Args:
        segments: the plan of ``x`` (:meth:`Quantizer.plan`).
        x: ``(batch, kv_heads, tokens, head_dim)`` values the quantizer would code (after the
            transforms), float32 or bfloat16.
        layer, kind: where ``x`` belongs (for the message).

    Raises:
        KVInputError: a segment holds a value whose magnitude exceeds its coder's
            :attr:`Quantizer.value_limit`, or a NaN / inf; the message names the layer, the
            kind, the block and the limit.
    """
    for seg in segments:
        limit = seg.coder.value_limit
        part = seg.take(x)
        amax = float(part.abs().amax()) if part.numel() else 0.0
        if not amax <= limit:  # NaN fails too
            # the input is finite (checked first): inf / NaN here is a transform's float32 overflow
            what = f"a value of magnitude {amax:g}" if math.isfinite(amax) else "a value that overflows float32 (inf / NaN)"
            raise KVInputError(
                f"layer {layer} {kind}: {what} (after the transforms) exceeds {limit:g}, "
                f"the largest the {seg.coder.short_label()} block represents (beyond it its float16 or bfloat16 "
                f"numbers would saturate and decode garbage); scale the KV cache or use a policy that represents it "
                f"(e.g. the 'affine' transform)"
            )


@dataclass(frozen=True, eq=False)
class QuantizedSegment:
    """The quantized data of one :class:`Segment`.

    Attributes:
        segment: where the data belongs and which block kernel produced it.
        symbols: integer symbols of shape ``segment.shape``: ``torch.uint8`` with values
            ``< 2**bits`` when ``bits <= 8``; ``torch.uint16`` raw 16-bit patterns (bfloat16
            bits) when ``bits == 16``.
        meta: metadata tensors in ``segment.meta_layout`` order (e.g. float16 ``scale`` and
            ``zero``); their bytes travel with the payload and count in the stream size.
    """

    segment: Segment
    symbols: torch.Tensor
    meta: dict[str, torch.Tensor]

    @property
    def bits(self) -> int:
        """Bits per symbol."""
        return self.segment.bits

    @property
    def shape(self) -> Shape:
        """Shape of the segment."""
        return self.segment.shape

    @property
    def meta_nbytes(self) -> int:
        """Bytes of metadata (scales, zero points)."""
        return sum(t.numel() * t.element_size() for t in self.meta.values())

    @property
    def payload_bits(self) -> int:
        """Bits of the densely packed symbols: ``numel * bits`` (entropy codecs may use fewer)."""
        return self.segment.numel * self.bits


@dataclass(frozen=True, eq=False)
class QuantizedTensor:
    """The output of :meth:`Quantizer.quantize`: the segments of one K or V tensor.

    Attributes:
        shape: shape of the quantized tensor ``(batch, kv_heads, tokens, head_dim)``.
        parts: one :class:`QuantizedSegment` per segment of the plan, in plan order.
    """

    shape: Shape
    parts: tuple[QuantizedSegment, ...]

    @property
    def numel(self) -> int:
        """Number of quantized elements."""
        return math.prod(self.shape)

    @property
    def meta_nbytes(self) -> int:
        """Bytes of metadata over all segments."""
        return sum(p.meta_nbytes for p in self.parts)

    def bits_per_element(self) -> float:
        """Densely packed payload + metadata bits per element (no header, no entropy coding)."""
        return (sum(p.payload_bits for p in self.parts) + 8 * self.meta_nbytes) / max(self.numel, 1)

    def bits_per_head(self) -> torch.Tensor:
        """float64 ``(kv_heads,)``: payload + metadata bits per element of each KV head.

        A segment's metadata is attributed evenly to its heads (every quantizer here keeps its
        metadata per head, so this is exact for them).
        """
        heads = self.shape[1]
        per_head_elems = math.prod(self.shape) / max(heads, 1)
        bits = torch.zeros(heads, dtype=torch.float64)
        for p in self.parts:
            idx = p.segment.head_indices(heads)
            if idx.numel():
                bits.index_add_(0, idx, torch.full((idx.numel(),), (p.payload_bits + 8 * p.meta_nbytes) / idx.numel(), dtype=torch.float64))
        return bits / max(per_head_elems, 1)


@dataclass(frozen=True)
class Quantizer(Component):
    """Q: float32 ``(batch, kv_heads, tokens, head_dim)`` tensor -> segments of integer symbols
    + metadata, and back.

    Two levels, so that mixed precision is one mechanism rather than a special case per method:

    * **Block kernel** (single symbol width; pure, small, a target for fused kernels):
      :attr:`symbol_bits`, :meth:`block_meta_layout`, :meth:`quantize_block`,
      :meth:`dequantize_block`. Every concrete width-``b`` quantizer implements these.
    * **Plan** (which slices get which width): :meth:`head_bits` (per KV head, may depend on
      the layer), :meth:`window_min_bits` (per token, e.g. bfloat16 sink/recent windows) and
      :meth:`coder` (the block quantizer for a width). :meth:`plan` combines them, plus the
      floors transforms ask for (``min_bits``), with :func:`plan_segments`.

    :meth:`quantize` / :meth:`dequantize` are generic: cut by the plan, run each segment's
    block kernel, reassemble. A plain quantizer (one width everywhere) has a one-segment plan.
    """

    kind: ClassVar[str] = "quantizer"

    # ------------------------------------------------------------------ block kernel

    @property
    def symbol_bits(self) -> int:
        """Bits per symbol of this quantizer's block kernel (1..8, or 16 for raw passthrough)."""
        raise NotImplementedError

    @property
    def value_limit(self) -> float:
        """The largest magnitude this block kernel codes faithfully (default: no limit).

        A block whose values go beyond it would decode garbage (e.g. float16 scales and zero
        points that saturate at 65504), so :meth:`quantize` refuses it
        (:func:`check_value_range`); a quantizer whose metadata cannot hold every float32 value
        overrides this.
        """
        return math.inf

    def block_meta_layout(self, shape: Shape) -> tuple[MetaField, ...]:
        """Metadata fields (name, shape, dtype, wire order) of one block of ``shape``.

        The decoder uses it to split a segment's metadata bytes, so it must depend only on the
        parameters and ``shape``.
        """
        raise NotImplementedError

    def quantize_block(self, x: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Quantize one float32 ``(batch, heads, tokens, head_dim)`` block with :attr:`symbol_bits`.

        Returns:
            ``(symbols, meta)``: symbols of ``x.shape`` (uint8, or uint16 for 16 bits) and the
            metadata tensors of :meth:`block_meta_layout`.
        """
        raise NotImplementedError

    def dequantize_block(self, symbols: torch.Tensor, meta: Mapping[str, torch.Tensor], shape: Shape) -> torch.Tensor:
        """Float32 reconstruction of shape ``shape`` from one block's symbols and metadata."""
        raise NotImplementedError

    # ------------------------------------------------------------------ plan hooks

    def head_bits(self, heads: int, *, layer: int, kind: str) -> tuple[int, ...]:
        """Width of every KV head in ``layer`` (default: :attr:`symbol_bits` everywhere)."""
        return (self.symbol_bits,) * heads

    def head_widths(self) -> tuple[int, ...]:
        """Every value :meth:`head_bits` can return (for codec compatibility checks)."""
        return (self.symbol_bits,)

    def window_min_bits(self, tokens: int) -> torch.Tensor | None:
        """The quantizer's own per-token floors (e.g. 16 on bfloat16 windows), or ``None``."""
        return None

    def window_widths(self) -> tuple[int, ...]:
        """The non-zero values :meth:`window_min_bits` can return."""
        return ()

    def coder(self, bits: int) -> "Quantizer":
        """The block quantizer used for segments of width ``bits`` (default: ``self`` for
        :attr:`symbol_bits`, the ``none`` quantizer for 16).

        Raises:
            ValueError: a width this quantizer cannot produce.
        """
        if bits == self.symbol_bits:
            return self
        if bits == BF16_BITS:
            return QUANTIZERS["none"]()
        raise ValueError(f"{self.kind} {self.name!r} has no {bits}-bit block kernel")

    def with_head_scores(self, scores: tuple[tuple[float, ...], ...]) -> "Quantizer":
        """A copy that uses per-(layer, kv_head) calibration scores; default: ``self`` (unused)."""
        return self

    def elements_per_symbol(self, shape: Shape, *, layer: int, kind: str) -> int:
        """The most tensor elements one coded symbol stands for in ``layer`` / ``kind`` (``shape``:
        ``(batch, kv_heads, tokens, head_dim)``; only ``kv_heads`` and ``head_dim`` may be used).

        The decoder's size rule (:func:`kvtune.codecs.policy.sections_problem`) lets a tensor
        have this many elements per symbol its payloads can hold (>= 1). Default 1: every
        element is a symbol.
        """
        return 1

    # ------------------------------------------------------------------ generic

    def symbol_widths(self, floors: tuple[int, ...] = ()) -> tuple[int, ...]:
        """Every symbol width a stream of this quantizer can contain, given transform floors."""
        levels = {0, *floors, *self.window_widths()}
        return tuple(sorted({self.coder(max(f, w)).symbol_bits for f in levels for w in self.head_widths()}))

    def plan(
        self, shape: Shape, *, layer: int, kind: str, min_bits: torch.Tensor | None = None
    ) -> tuple[Segment, ...]:
        """The segments of a tensor of ``shape`` in ``layer`` (see :func:`plan_segments`).

        Args:
            shape: ``(batch, kv_heads, tokens, head_dim)``.
            layer: absolute layer index.
            kind: ``"key"`` or ``"value"``.
            min_bits: int64 ``(tokens,)`` floors asked by the transforms, or ``None``.

        Raises:
            ConfigError: the quantizer cannot be applied (e.g. missing calibration scores).
        """
        shape = tuple(int(s) for s in shape)
        floors = self.window_min_bits(shape[2])
        if min_bits is not None:
            floors = min_bits if floors is None else torch.maximum(floors, min_bits.to(torch.int64))
        return plan_segments(shape, self.head_bits(shape[1], layer=layer, kind=kind), floors, self.coder)

    def meta_layout(
        self, shape: Shape, *, layer: int, kind: str, min_bits: torch.Tensor | None = None
    ) -> tuple[tuple[MetaField, ...], ...]:
        """Metadata fields of every segment of the plan, in plan order."""
        return tuple(s.meta_layout for s in self.plan(shape, layer=layer, kind=kind, min_bits=min_bits))

    def quantize(
        self, x: torch.Tensor, *, layer: int, kind: str, min_bits: torch.Tensor | None = None
    ) -> QuantizedTensor:
        """Quantize float32 ``(batch, kv_heads, tokens, head_dim)`` ``x``, segment by segment.

        Args:
            x: the tensor (after the transforms).
            layer: absolute layer index (layer schedules, head rankings).
            kind: ``"key"`` or ``"value"``.
            min_bits: per-token floors asked by the transforms (:meth:`Transform.token_min_bits`).

        Raises:
            KVInputError: a segment holds a value beyond its block's :attr:`value_limit` (or a
                NaN / inf, e.g. from a transform's float32 overflow).
        """
        shape = tuple(x.shape)
        x = x.to(torch.float32)
        parts = []
        plan = self.plan(shape, layer=layer, kind=kind, min_bits=min_bits)
        check_value_range(plan, x, layer=layer, kind=kind)
        for seg in plan:
            symbols, meta = seg.coder.quantize_block(seg.take(x))
            parts.append(QuantizedSegment(seg, symbols, {k: v.contiguous() for k, v in meta.items()}))
        return QuantizedTensor(shape, tuple(parts))

    def dequantize(self, q: QuantizedTensor, *, layer: int, kind: str) -> torch.Tensor:
        """Float32 reconstruction of shape ``q.shape`` (the plan travels in ``q``'s segments)."""
        if len(q.parts) == 1 and q.parts[0].segment.is_whole:
            p = q.parts[0]
            return p.segment.coder.dequantize_block(p.symbols, p.meta, p.shape)
        out = (torch.empty if q.parts else torch.zeros)(q.shape, dtype=torch.float32)
        for p in q.parts:
            p.segment.put(out, p.segment.coder.dequantize_block(p.symbols, p.meta, p.shape))
        return out


@dataclass(frozen=True)
class Codec(Component):
    """C: lossless packing of integer symbols into bytes."""

    kind: ClassVar[str] = "codec"
    bounds_by_length: ClassVar[bool] = False
    """Whether :meth:`max_symbols` reads nothing of a payload but its length; the decoder then
    checks the sizes a stream header claims once per distinct header
    (:func:`kvtune.codecs.policy.check_claimed_sizes`)."""

    def supports(self, bits: int) -> bool:
        """Whether the codec can pack symbols of this width."""
        raise NotImplementedError

    def max_symbols(self, payload: bytes | memoryview) -> int | None:
        """The most symbols (of any width the codec packs) that one packed ``payload`` can
        decode to, read from its own bytes, or ``None`` when the payload declares no such bound.

        The decoder sums it over the payloads of a K or V tensor and compares the sum with the
        number of elements the stream header claims for the tensor before it plans or allocates
        anything from the claimed shape (:func:`kvtune.codecs.policy.check_claimed_sizes`), so
        that a forged header cannot make it allocate more than the stream's bytes justify.
        Dense codecs bound it by the payload's length (``bitpack``: 8 one-bit symbols per
        byte); ``zstd`` by the content size its frame declares. The default, ``None``, suits
        entropy coders whose payloads do not record their symbol count (a near-constant tensor
        codes in a few bytes): the decoder then plans at most
        :data:`kvtune.codecs.policy.MAX_UNCONFIRMED_PLAN` heads + tokens, or 8 per byte of the
        tensor's sections, before the codec's :meth:`unpack` confirms the count.

        Raises:
            CorruptStreamError: the payload's own declaration is malformed.
        """
        return None

    def pack(self, symbols: torch.Tensor | np.ndarray, bits: int) -> bytes:
        """Pack symbols into bytes.

        Args:
            symbols: ``uint8`` symbols ``< 2**bits`` (``bits`` in 1..8) or ``uint16`` raw
                patterns (``bits == 16``), any shape; packed in C (row-major) order. The shape
                is available to codecs with per-channel models.
            bits: symbol width.

        Returns:
            The packed bytes.
        """
        raise NotImplementedError

    def unpack(self, data: bytes | memoryview, bits: int, count: int, *, shape: Shape | None = None) -> np.ndarray:
        """Inverse of :meth:`pack`.

        Args:
            data: the packed bytes.
            bits: symbol width used by :meth:`pack`.
            count: number of symbols.
            shape: the symbols' shape, when known (for codecs with per-channel models).

        Returns:
            A flat ``(count,)`` array, ``uint8`` (or ``uint16`` for ``bits == 16``).

        Raises:
            CorruptStreamError: when ``data`` cannot hold exactly ``count`` symbols.
        """
        raise NotImplementedError

    def unpack_into(self, data: bytes | memoryview, bits: int, count: int, out: np.ndarray, *,
                    shape: Shape | None = None) -> None:
        """:meth:`unpack` into ``out``: the symbols' bytes (native byte order for ``bits ==
        16``), so ``out`` is uint8 of ``count`` elements (``2 * count`` when ``bits == 16``).
        Codecs that decode straight into it (``rans``) override this; the default copies
        :meth:`unpack`'s array.

        Raises:
            CorruptStreamError: as :meth:`unpack`.
            ValueError: as :meth:`unpack`, or ``out`` is not uint8 of that many elements.
        """
        raw = np.ascontiguousarray(self.unpack(data, bits, count, shape=shape)).reshape(-1).view(np.uint8)
        if (not isinstance(out, np.ndarray) or out.dtype != np.uint8 or out.shape != raw.shape
                or not out.flags.c_contiguous or not out.flags.writeable):
            raise ValueError(f"codec {self.name!r}: out must be a writeable C-contiguous uint8 array of shape "
                             f"{raw.shape}, got {getattr(out, 'dtype', type(out).__name__)} {getattr(out, 'shape', '')}")
        out[...] = raw


# ----------------------------------------------------------------------------- registries

TRANSFORMS: Registry[type[Transform]] = Registry("transform")
QUANTIZERS: Registry[type[Quantizer]] = Registry("quantizer")
CODECS: Registry[type[Codec]] = Registry("codec")
Transform.registry = TRANSFORMS  # type: ignore[assignment]
Quantizer.registry = QUANTIZERS  # type: ignore[assignment]
Codec.registry = CODECS  # type: ignore[assignment]


def _registrar(base: type[Component], registry: Registry, name: str):
    def decorate(cls):
        if not (isinstance(cls, type) and issubclass(cls, base) and dataclasses.is_dataclass(cls)):
            raise TypeError(f"@register_{base.kind}({name!r}) needs a dataclass subclass of {base.__name__}")
        registry.register(name, cls)  # a name clash: DuplicateNameError
        cls.name = name
        return cls

    return decorate


def register_transform(name: str):
    """Class decorator: register a :class:`Transform` dataclass under ``name``."""
    return _registrar(Transform, TRANSFORMS, name)


def register_quantizer(name: str):
    """Class decorator: register a :class:`Quantizer` dataclass under ``name``."""
    return _registrar(Quantizer, QUANTIZERS, name)


def register_codec(name: str):
    """Class decorator: register a :class:`Codec` dataclass under ``name``."""
    return _registrar(Codec, CODECS, name)


# ----------------------------------------------------------------------------- metadata bytes

_WIRE_DTYPES: dict[torch.dtype, str] = {torch.float16: "<f2", torch.float32: "<f4", torch.uint8: "u1"}


def meta_to_bytes(meta: Mapping[str, torch.Tensor], layout: tuple[MetaField, ...]) -> bytes:
    """Serialize metadata tensors in ``layout`` order as little-endian raw bytes.

    Raises:
        ValueError: when a tensor is missing or its shape/dtype differs from the layout.
    """
    parts = []
    for f in layout:
        t = meta[f.name]
        if tuple(t.shape) != f.shape or t.dtype != f.dtype:
            raise ValueError(f"metadata {f.name!r}: got {tuple(t.shape)} {t.dtype}, layout says {f.shape} {f.dtype}")
        parts.append(t.detach().cpu().contiguous().numpy().astype(_WIRE_DTYPES[f.dtype], copy=False).tobytes())
    return b"".join(parts)


def meta_from_bytes(data: bytes | memoryview, layout: tuple[MetaField, ...]) -> dict[str, torch.Tensor]:
    """Inverse of :func:`meta_to_bytes`.

    Raises:
        CorruptStreamError: when ``len(data)`` differs from the layout's total size.
    """
    expected = sum(f.nbytes for f in layout)
    if len(data) != expected:
        raise CorruptStreamError(f"metadata section has {len(data)} bytes, the policy needs {expected}")
    out: dict[str, torch.Tensor] = {}
    offset = 0
    for f in layout:
        arr = np.frombuffer(data, dtype=_WIRE_DTYPES[f.dtype], count=math.prod(f.shape), offset=offset)
        out[f.name] = torch.from_numpy(arr.copy()).reshape(f.shape)
        offset += f.nbytes
    return out
