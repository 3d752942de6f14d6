"""Base classes and registries of the T -> Q -> C pipeline (brief, sec. 2).

A compression policy is ``bitstream = C(Q(T(X)))``:

* a :class:`Transform` reshapes the value distribution (e.g. a Hadamard rotation),
* a :class:`Quantizer` maps float values to small unsigned integer symbols plus metadata
  (scales, zero points),
* a :class:`Codec` packs the symbols losslessly into bytes.

Every component is a small frozen dataclass registered by name with a decorator
(:func:`register_transform`, :func:`register_quantizer`, :func:`register_codec`), in the style
of kvpress presses and torchao configs. Its dataclass fields are its parameters, declared with
:func:`param` so that values are validated on construction (a bad value raises
:class:`~kvtune.errors.ConfigError` naming the component, the parameter and the allowed
values). ``to_dict()``/``from_dict()`` round-trip a component through JSON.

Adding a component::

    @register_quantizer("my_quant")
    @dataclass(frozen=True)
    class MyQuantizer(Quantizer):
        bits: int = param(4, low=1, high=8, doc="bits per symbol")

        def quantize(self, x): ...
        def dequantize(self, q): ...
        def meta_layout(self, shape): ...

Tensor convention: KV tensors are ``(batch, kv_heads, tokens, head_dim)``; inside the pipeline
they are float32 on the CPU.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, ClassVar, Mapping, TypeVar

import numpy as np
import torch

from kvtune.errors import ConfigError, CorruptStreamError

__all__ = [
    "Component",
    "Transform",
    "Quantizer",
    "Codec",
    "QuantizedTensor",
    "MetaField",
    "TRANSFORMS",
    "QUANTIZERS",
    "CODECS",
    "register_transform",
    "register_quantizer",
    "register_codec",
    "param",
    "meta_to_bytes",
    "meta_from_bytes",
]

Shape = tuple[int, ...]


# ----------------------------------------------------------------------------- parameters


def param(
    default: Any,
    *,
    choices: tuple[Any, ...] | None = None,
    low: int | float | None = None,
    high: int | float | None = None,
    doc: str = "",
) -> Any:
    """Declare a validated component parameter (a dataclass field with a default).

    The parameter's type is the type of ``default`` (``bool``, ``int``, ``float`` or ``str``);
    ``bool`` is not accepted where an ``int`` is expected, an ``int`` is accepted (and
    converted) where a ``float`` is expected.

    Args:
        default: default value; also fixes the type.
        choices: allowed values, if the parameter is categorical.
        low: inclusive lower bound for numbers.
        high: inclusive upper bound for numbers.
        doc: one-line description (units included), shown in error messages' context.

    Returns:
        A :func:`dataclasses.field` carrying the validation rules in its metadata.
    """
    return field(
        default=default,
        metadata={"kvtune_param": True, "type": type(default), "choices": choices, "low": low, "high": high, "doc": doc},
    )


def _allowed_text(meta: Mapping[str, Any]) -> str:
    """Human-readable description of a parameter's allowed values."""
    if meta["choices"] is not None:
        return "one of " + ", ".join(repr(c) for c in meta["choices"])
    typ = meta["type"]
    kind = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}.get(typ, typ.__name__)
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
        """Canonical JSON-ready dict: ``{"name": ..., <every parameter>: value}``."""
        return {"name": self.name, **self.params()}

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
class Transform(Component):
    """T: an invertible map on float32 ``(batch, kv_heads, tokens, head_dim)`` tensors.

    Implementations must be deterministic functions of their parameters, ``layer`` and
    ``kind`` (the decoder re-derives everything from the stream header), and
    ``inverse(forward(x)) == x`` up to float32 rounding.
    """

    kind: ClassVar[str] = "transform"

    def forward(self, x: torch.Tensor, *, layer: int, kind: str) -> torch.Tensor:
        """Apply the transform.

        Args:
            x: float32 ``(batch, kv_heads, tokens, head_dim)``.
            layer: absolute transformer layer index (``layer_offset + i``).
            kind: ``"key"`` or ``"value"``.

        Returns:
            float32 tensor of the same shape.
        """
        raise NotImplementedError

    def inverse(self, y: torch.Tensor, *, layer: int, kind: str) -> torch.Tensor:
        """Undo :meth:`forward` (same arguments and shapes)."""
        raise NotImplementedError

    @property
    def is_identity(self) -> bool:
        """True when the transform is the identity map (dropped from canonical policies)."""
        return False


@dataclass(frozen=True)
class MetaField:
    """One metadata tensor of a quantized tensor: its name, shape and dtype (bytes on the wire)."""

    name: str
    shape: Shape
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        """Size in bytes."""
        return math.prod(self.shape) * torch.empty((), dtype=self.dtype).element_size()


@dataclass(frozen=True, eq=False)
class QuantizedTensor:
    """The output of :meth:`Quantizer.quantize`.

    Attributes:
        symbols: integer symbols of shape ``shape`` (the input's shape). dtype ``torch.uint8``
            with values ``< 2**bits`` when ``bits <= 8``; dtype ``torch.uint16`` holding raw
            16-bit patterns (e.g. bfloat16 bits) when ``bits == 16``.
        bits: bits per symbol: 1..8, or 16 for raw 16-bit passthrough.
        meta: metadata tensors in :meth:`Quantizer.meta_layout` order (e.g. float16 ``scale``
            and ``zero``); their bytes are sent with the payload and count in the stream size.
        shape: shape of the quantized tensor ``(batch, kv_heads, tokens, head_dim)``.
    """

    symbols: torch.Tensor
    bits: int
    meta: dict[str, torch.Tensor]
    shape: Shape

    @property
    def numel(self) -> int:
        """Number of quantized elements."""
        return math.prod(self.shape)

    @property
    def meta_nbytes(self) -> int:
        """Bytes of metadata (scales, zero points)."""
        return sum(t.numel() * t.element_size() for t in self.meta.values())


@dataclass(frozen=True)
class Quantizer(Component):
    """Q: float32 tensor -> integer symbols + metadata, and back."""

    kind: ClassVar[str] = "quantizer"

    @property
    def symbol_bits(self) -> int:
        """Bits per symbol this quantizer emits (1..8, or 16 for raw passthrough)."""
        raise NotImplementedError

    def quantize(self, x: torch.Tensor) -> QuantizedTensor:
        """Quantize float32 ``(batch, kv_heads, tokens, head_dim)`` ``x``."""
        raise NotImplementedError

    def dequantize(self, q: QuantizedTensor) -> torch.Tensor:
        """Reconstruct a float32 tensor of shape ``q.shape`` from ``q``."""
        raise NotImplementedError

    def meta_layout(self, shape: Shape) -> tuple[MetaField, ...]:
        """The metadata tensors (name, shape, dtype, in wire order) for an input of ``shape``.

        The decoder uses it to split the metadata bytes of a section, so it must depend only on
        the parameters and ``shape``.
        """
        raise NotImplementedError


@dataclass(frozen=True)
class Codec(Component):
    """C: lossless packing of integer symbols into bytes."""

    kind: ClassVar[str] = "codec"

    def supports(self, bits: int) -> bool:
        """Whether the codec can pack symbols of this width."""
        raise NotImplementedError

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


# ----------------------------------------------------------------------------- registries

TRANSFORMS: dict[str, type[Transform]] = {}
QUANTIZERS: dict[str, type[Quantizer]] = {}
CODECS: dict[str, type[Codec]] = {}
Transform.registry = TRANSFORMS  # type: ignore[assignment]
Quantizer.registry = QUANTIZERS  # type: ignore[assignment]
Codec.registry = CODECS  # type: ignore[assignment]


def _registrar(base: type[Component], registry: dict[str, Any], name: str):
    def decorate(cls):
        if not (isinstance(cls, type) and issubclass(cls, base) and dataclasses.is_dataclass(cls)):
            raise TypeError(f"@register_{base.kind}({name!r}) needs a dataclass subclass of {base.__name__}")
        if name in registry and registry[name] is not cls:
            raise ValueError(f"{base.kind} {name!r} is already registered ({registry[name].__qualname__})")
        cls.name = name
        registry[name] = cls
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
