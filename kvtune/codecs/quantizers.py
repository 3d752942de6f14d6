"""Quantizers Q: float32 KV tensors -> integer symbols + float16 metadata.

Q is the middle stage of the T -> Q -> C pipeline (:mod:`kvtune.codecs.base`; KVServe, arXiv
2605.13734).

* ``uniform``: round-to-nearest uniform integer quantization with per-group float16 scale
  (and zero point when asymmetric), grouped per token (along ``head_dim``) or per channel
  (along tokens). KIVI (Liu et al., 2024, "KIVI: A Tuning-Free Asymmetric 2bit Quantization
  for KV Cache", sec. 3) quantizes keys per channel in groups of 32 tokens and values per
  token; its cost is ``bits + 32/group_size`` bits per element (2-bit at group 32: 3 bits).
  Options: bfloat16 sink and recent-token windows (KIVI's residual window) and a layer
  schedule (shallow layers at other bits, as CacheGen).
* ``none``: no quantization; values pass through as bfloat16 (16 bits per element, no
  metadata). The "no compression" baseline.

Head-aware mixed precision (``mixhq``) lives in :mod:`kvtune.codecs.mixhq`, float8 casts
(``fp8``) in :mod:`kvtune.codecs.fp8`.

Grouping. For input ``x`` of shape ``(batch, kv_heads, tokens, head_dim)``:

=============  ============================  ==========================================
granularity    a group is                    metadata shape (each of scale, zero)
=============  ============================  ==========================================
per_token      ``group_size`` channels of    ``(batch, kv_heads, tokens, ceil(head_dim/g))``
               one token
per_channel    ``group_size`` tokens of      ``(batch, kv_heads, ceil(tokens/g), head_dim)``
               one channel
=============  ============================  ==========================================

``group_size = 0`` means the whole axis (one group per token, or per channel). When the axis
length is not a multiple of ``group_size`` the last group is shorter (ragged). Groups are
formed inside each segment (:class:`~kvtune.codecs.base.Segment`): with bfloat16 windows or
higher-precision anchor tokens the per-channel groups run over the remaining tokens only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kvtune.codecs.base import BF16_BITS, MetaField, Quantizer, param, register_quantizer

__all__ = [
    "UniformQuantizer",
    "NoQuantizer",
    "GroupedWindowsMixin",
    "window_floors",
    "group_axis",
    "group",
    "ungroup",
    "fp16_round_up",
    "div_exact",
    "asymmetric_params",
    "symmetric_params",
    "quantize_affine",
    "dequantize_affine",
    "FP16_MAX",
    "BF16_MAX",
]

FP16_MAX = 65504.0
"""Largest finite float16 value: the range of float16 scales and zero points."""
BF16_MAX = float(torch.finfo(torch.bfloat16).max)
"""Largest finite bfloat16 value (~3.39e38)."""
BF16_EXPONENT = 0x7F80
"""The exponent bits of a bfloat16 pattern: all set in a NaN or inf."""

# ----------------------------------------------------------------------------- pure math


def group_axis(granularity: str) -> int:
    """Tensor axis a group runs along: ``-1`` (head_dim) for per_token, ``-2`` (tokens) for per_channel."""
    return -1 if granularity == "per_token" else -2


def group(x: torch.Tensor, axis: int, group_size: int) -> torch.Tensor:
    """Split ``axis`` (of length ``n``) of ``x`` into ``(ceil(n/g), g)`` groups.

    A ragged last group is padded by repeating the axis' last element, which leaves every
    group's min, max and absmax unchanged. ``group_size = 0`` means one group of length ``n``,
    and so does any ``group_size >= n`` (the group is not padded to ``group_size``: a policy may
    set it up to ``2**31 - 1``, which would allocate that many elements per row).

    Returns:
        ``x`` with ``axis`` replaced by the two axes ``(num_groups, g)``: one more dimension,
        the group index at ``axis`` and the group members at ``axis + 1`` (non-negative axis).
    """
    axis = axis % x.dim()
    n = x.shape[axis]
    g = min(group_size or n, n) or 1
    num_groups = -(-n // g)
    if num_groups * g != n:
        idx = torch.arange(num_groups * g, device=x.device).clamp_(max=n - 1)
        x = x.index_select(axis, idx)
    return x.reshape(*x.shape[:axis], num_groups, g, *x.shape[axis + 1 :])


def ungroup(xg: torch.Tensor, axis: int, n: int) -> torch.Tensor:
    """Inverse of :func:`group`: merge the ``(num_groups, g)`` axes back and drop the padding.

    ``axis`` is the axis index in the *ungrouped* tensor (negative values count from its end).
    """
    ndim = xg.dim() - 1
    axis = axis % ndim
    merged = xg.reshape(*xg.shape[:axis], xg.shape[axis] * xg.shape[axis + 1], *xg.shape[axis + 2 :])
    return merged.narrow(axis, 0, n)


def fp16_round_up(x: torch.Tensor) -> torch.Tensor:
    """Smallest float16 value ``>= x`` (float32 in, float16 out), saturating at +-65504."""
    x = x.clamp(-FP16_MAX, FP16_MAX)
    h = x.to(torch.float16)
    up = torch.nextafter(h, torch.full_like(h, math.inf))
    return torch.where(h.to(torch.float32) < x, up, h)


def div_exact(x: torch.Tensor, divisor: float) -> torch.Tensor:
    """``x / divisor``, correctly rounded in ``x``'s dtype on every device.

    The divisor is a 0-dim tensor on ``x``'s device, not a Python number: CUDA divides a tensor
    by a Python number by multiplying with its rounded reciprocal (one ulp off for divisors such
    as 3 or 448), while the CPU -- and the compiled kernels (:mod:`kvtune.codecs.kernels`) --
    divide. The device codec path (:mod:`kvtune.codecs.torchpath`) relies on this.
    """
    return x / torch.full((), divisor, dtype=x.dtype, device=x.device)


def asymmetric_params(lo: torch.Tensor, hi: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Float16 ``(scale, zero)`` of asymmetric min/max quantization (KIVI, Liu et al. 2024, sec. 3).

    ``zero`` is the group minimum rounded *up* to float16, so the minimum always maps to
    symbol 0; ``scale = (max - zero) / (2**bits - 1)`` rounded to the nearest float16, so the
    maximum maps to symbol ``2**bits - 1``. Both together make quantize -> dequantize ->
    quantize reproduce the same symbols. A constant group gets ``scale = 0`` and decodes to
    ``zero`` (exactly the constant when it is a float16 value, e.g. any bfloat16 input).

    Signed zeros are canonical: a zero point or scale of ``-0`` is written as ``+0``. (A group
    holding both ``-0.0`` and ``+0.0`` has no well-defined signed minimum -- torch's vectorized
    and scalar min disagree -- so without this the stream bytes would depend on the kernel.)

    Args:
        lo, hi: float32 per-group min and max (same shape).
        bits: 1..8.

    Returns:
        ``(scale, zero)``, float16, same shape as ``lo``.
    """
    zero = fp16_round_up(lo)
    zero = torch.where(zero == 0, torch.zeros_like(zero), zero)  # canonical +0 (docstring)
    scale = _nonnegative(div_exact(hi - zero.to(torch.float32), 2**bits - 1)).to(torch.float16)
    return scale, zero


def symmetric_params(absmax: torch.Tensor, bits: int) -> torch.Tensor:
    """Float16 ``scale`` of symmetric quantization: ``2 * absmax / (2**bits - 1)`` (nearest).

    The grid ``(q - (2**bits - 1) / 2) * scale``, ``q = 0 .. 2**bits - 1``, is symmetric
    about zero and spans ``[-absmax, absmax]`` (a mid-rise grid: with an even number of levels
    zero itself is not a level; 1 bit gives ``+-absmax``). An all-zero group gets scale 0.
    """
    return _nonnegative(div_exact(2.0 * absmax, 2**bits - 1)).to(torch.float16)


def _nonnegative(s: torch.Tensor) -> torch.Tensor:
    """``clamp(s, 0, 65504)`` with ``-0`` (and NaN) mapped to ``+0``."""
    s = s.clamp(max=FP16_MAX)
    return torch.where(s > 0, s, torch.zeros_like(s))


def quantize_affine(xg: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int) -> torch.Tensor:
    """Round-to-nearest symbols ``clamp(round((x - zero) / scale), 0, 2**bits - 1)`` as uint8.

    ``scale``/``zero`` are float32 and broadcast against ``xg``; where ``scale == 0`` the
    symbol is ``round(-zero * 0) = 0`` (constant group).
    """
    inv = torch.where(scale > 0, 1.0 / scale.clamp_min(torch.finfo(torch.float32).tiny), torch.zeros_like(scale))
    u = (xg - zero) * inv
    return u.round_().clamp_(0, 2**bits - 1).to(torch.uint8)


def dequantize_affine(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """``zero + q * scale`` in float32 (``scale``/``zero`` float32, broadcast against ``q``).

    A rounded multiply, then a rounded add -- deliberately not ``torch.addcmul``, which fuses
    them (FMA) on CPUs that have it and not elsewhere, so decoded values would depend on the
    machine.
    """
    return zero + q.to(torch.float32) * scale


# ----------------------------------------------------------------------------- shared plan pieces


def window_floors(tokens: int, sink_tokens: int, recent_tokens: int) -> torch.Tensor | None:
    """int64 ``(tokens,)`` floors: 16 (bfloat16) on the first ``sink_tokens`` and the last
    ``recent_tokens`` tokens, 0 elsewhere; ``None`` when both windows are empty.

    The windows may overlap (short tensors); such tokens are simply bfloat16.
    """
    if not (sink_tokens or recent_tokens):
        return None
    floors = torch.zeros(tokens, dtype=torch.int64)
    floors[:sink_tokens] = BF16_BITS
    if recent_tokens:
        floors[max(tokens - recent_tokens, 0) :] = BF16_BITS
    return floors


class GroupedWindowsMixin:
    """Plan pieces shared by quantizers with uniform grouped block kernels and bfloat16 windows.

    Expects the dataclass fields ``symmetric``, ``granularity``, ``group_size``,
    ``sink_tokens`` and ``recent_tokens``. Contributes :meth:`coder` (a plain
    :class:`UniformQuantizer` of the requested width with the same grouping, or bfloat16 for
    16) and the sink/recent windows (:meth:`window_min_bits`).
    """

    symmetric: bool
    granularity: str
    group_size: int
    sink_tokens: int
    recent_tokens: int

    def coder(self, bits: int) -> Quantizer:
        """Block quantizer of width ``bits``: uniform with this grouping, or bfloat16 for 16."""
        if bits == BF16_BITS:
            return NoQuantizer()
        return UniformQuantizer(bits=bits, symmetric=self.symmetric, granularity=self.granularity, group_size=self.group_size)

    def window_min_bits(self, tokens: int) -> torch.Tensor | None:
        """16 on the sink and recent windows (:func:`window_floors`)."""
        return window_floors(tokens, self.sink_tokens, self.recent_tokens)

    def window_widths(self) -> tuple[int, ...]:
        return (BF16_BITS,) if (self.sink_tokens or self.recent_tokens) else ()

    def _grouping_label(self) -> str:
        """``{a|s}/{tok|ch}[/g{group_size}][/s{sink}][/r{recent}]``."""
        gran = "tok" if self.granularity == "per_token" else "ch"
        grp = f"/g{self.group_size}" if self.group_size else ""
        win = (f"/s{self.sink_tokens}" if self.sink_tokens else "") + (f"/r{self.recent_tokens}" if self.recent_tokens else "")
        return f"{'s' if self.symmetric else 'a'}/{gran}{grp}{win}"


# ----------------------------------------------------------------------------- components


@register_quantizer("uniform")
@dataclass(frozen=True)
class UniformQuantizer(GroupedWindowsMixin, Quantizer):
    """Uniform round-to-nearest integer quantization with float16 per-group metadata.

    Asymmetric (default): ``x ~ zero + q * scale`` with ``zero``/``scale`` from the group's
    min/max (KIVI, Liu et al. 2024, sec. 3); metadata ``scale`` and ``zero``, float16 each.
    Symmetric: ``x ~ (q - (2**b - 1)/2) * scale`` from the group's absmax; metadata ``scale``
    only. See :func:`asymmetric_params`, :func:`symmetric_params` and the module docstring for
    groups and metadata shapes.

    Per element cost: ``bits + 16 * (1 + asymmetric) / group_length`` bits, where
    ``group_length`` is ``group_size`` (or the axis length when 0); e.g. 2-bit asymmetric
    at ``group_size = 32`` costs 3 bits.

    Error: ``|x - x_hat| <= scale / 2`` plus float16 rounding of the metadata
    (``<= 2**-10 * max|x|`` of the group) for every element.

    Full-precision windows: the first ``sink_tokens`` tokens (attention sinks, StreamingLLM)
    and the last ``recent_tokens`` tokens (KIVI's residual window, 128 in KIVI) are sent as
    bfloat16 (16 bits, no metadata) in a separate segment; the groups of the quantized part run
    over the remaining tokens only (with per-channel groups of 32 on 1024 tokens and
    ``recent_tokens = 128``: 28 groups over tokens 0..895).

    Layer schedule: layers with absolute index ``< shallow_layers`` use ``shallow_bits``
    instead of ``bits`` (CacheGen, Liu et al. SIGCOMM'24, sec. 5.2: shallow layers are more
    sensitive, so they get finer quantization); ``shallow_bits = 16`` keeps them in bfloat16.

    Symbols: uint8 of each segment's shape.

    Range: every value a quantized segment codes (after the transforms) must lie within
    +-65504, the float16 range of ``scale`` and ``zero`` (+-32752 at 1 bit, where one scale spans
    the whole group); :meth:`quantize` refuses a tensor with a value beyond it with
    :class:`~kvtune.core.errors.KVInputError` naming the layer and the limit, instead of letting the
    metadata saturate (:attr:`value_limit`). bfloat16 windows hold any bfloat16 value.

    Args:
        bits: bits per symbol, 1..8.
        symmetric: symmetric grid around zero (scale only) instead of min/max (scale + zero).
        granularity: ``"per_token"`` (groups along head_dim) or ``"per_channel"`` (groups
            along tokens).
        group_size: elements per group along the grouping axis; 0 = the whole axis.
        sink_tokens: first tokens kept in bfloat16.
        recent_tokens: last tokens kept in bfloat16.
        shallow_layers: number of leading layers that use ``shallow_bits`` (0 = no schedule).
        shallow_bits: width of those layers, 1..8 or 16.
    """

    bits: int = param(4, low=1, high=8, doc="bits per symbol")
    symmetric: bool = param(False, doc="symmetric grid (scale only) instead of min/max")
    granularity: str = param("per_token", choices=("per_token", "per_channel"), doc="grouping axis")
    group_size: int = param(32, low=0, high=2**31 - 1, doc="elements per group along the axis, 0 = whole axis")
    sink_tokens: int = param(0, low=0, doc="first tokens kept in bfloat16", elide_default=True)
    recent_tokens: int = param(0, low=0, doc="last tokens kept in bfloat16", elide_default=True)
    shallow_layers: int = param(0, low=0, doc="layers with index < this use shallow_bits", elide_default=True)
    shallow_bits: int = param(8, choices=(*range(1, 9), BF16_BITS), doc="bits of the shallow layers", elide_default=True)

    @property
    def symbol_bits(self) -> int:
        return self.bits

    @property
    def value_limit(self) -> float:
        """65504 (the float16 maximum; 32752 at 1 bit): within it the group minimum rounded up
        (``zero``) and ``scale`` -- ``(max - zero) / (2**bits - 1)``, or ``2 * absmax / (2**bits
        - 1)`` when symmetric, at most ``2 * 65504 / (2**bits - 1)`` -- are finite float16 values
        that do not saturate."""
        return FP16_MAX if self.bits >= 2 else FP16_MAX / 2

    # ------------------------------------------------------------------ plan

    def head_bits(self, heads: int, *, layer: int, kind: str) -> tuple[int, ...]:
        """``shallow_bits`` for layers ``< shallow_layers``, else ``bits``, on every head."""
        return ((self.shallow_bits if layer < self.shallow_layers else self.bits),) * heads

    def head_widths(self) -> tuple[int, ...]:
        return (self.bits, self.shallow_bits) if self.shallow_layers else (self.bits,)

    # ------------------------------------------------------------------ block kernel

    def _num_groups(self, shape: tuple[int, ...]) -> tuple[int, tuple[int, ...]]:
        axis = group_axis(self.granularity) % len(shape)
        n = shape[axis]
        g = self.group_size or n
        num_groups = -(-n // g) if g else 0
        meta_shape = tuple(shape[:axis]) + (num_groups,) + tuple(shape[axis + 1 :])
        return axis, meta_shape

    def block_meta_layout(self, shape: tuple[int, ...]) -> tuple[MetaField, ...]:
        """float16 ``scale`` (and ``zero`` if asymmetric) of the shape given in the module table."""
        _, meta_shape = self._num_groups(tuple(shape))
        names = ("scale",) if self.symmetric else ("scale", "zero")
        return tuple(MetaField(n, meta_shape, torch.float16) for n in names)

    def quantize_block(self, x: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """uint8 symbols of ``x.shape`` and float16 ``scale`` (+ ``zero``) per group."""
        shape = tuple(x.shape)
        axis, _ = self._num_groups(shape)
        x = x.to(torch.float32)
        if x.numel() == 0:
            return torch.zeros(shape, dtype=torch.uint8), {f.name: torch.zeros(f.shape, dtype=f.dtype) for f in self.block_meta_layout(shape)}
        xg = group(x, axis, self.group_size)  # (..., G, g, ...): members on axis + 1
        red = axis + 1
        if self.symmetric:
            scale16 = symmetric_params(xg.abs().amax(dim=red), self.bits)
            scale = scale16.to(torch.float32)
            zero = scale * (-(2**self.bits - 1) / 2.0)
            meta = {"scale": scale16}
        else:
            lo, hi = torch.aminmax(xg, dim=red)
            scale16, zero16 = asymmetric_params(lo, hi, self.bits)
            scale, zero = scale16.to(torch.float32), zero16.to(torch.float32)
            meta = {"scale": scale16, "zero": zero16}
        q = quantize_affine(xg, scale.unsqueeze(red), zero.unsqueeze(red), self.bits)
        return ungroup(q, axis, shape[axis]).contiguous(), meta

    def dequantize_block(self, symbols: torch.Tensor, meta, shape: tuple[int, ...]) -> torch.Tensor:
        """Float32 reconstruction of ``shape`` from uint8 symbols and float16 metadata."""
        shape = tuple(shape)
        if math.prod(shape) == 0:
            return torch.zeros(shape, dtype=torch.float32)
        axis, _ = self._num_groups(shape)
        red = axis + 1
        scale = meta["scale"].to(torch.float32)
        zero = scale * (-(2**self.bits - 1) / 2.0) if self.symmetric else meta["zero"].to(torch.float32)
        qg = group(symbols.reshape(shape), axis, self.group_size)
        xg = dequantize_affine(qg, scale.unsqueeze(red), zero.unsqueeze(red))
        return ungroup(xg, axis, shape[axis]).contiguous()

    def short_label(self) -> str:
        """``u{bits}{a|s}/{tok|ch}[/g{group_size}][/s{sink}][/r{recent}][/L{n}:{bits}]``,
        e.g. ``u2a/ch/g32/r128`` or ``u4s/tok/L10:5``."""
        sched = f"/L{self.shallow_layers}:{self.shallow_bits}" if self.shallow_layers else ""
        return f"u{self.bits}{self._grouping_label()}{sched}"


@register_quantizer("none")
@dataclass(frozen=True)
class NoQuantizer(Quantizer):
    """No quantization: values are sent as bfloat16 (16 bits per element, no metadata).

    Symbols are the raw bfloat16 bit patterns as ``torch.uint16`` of the input's shape,
    ``bits = 16``; a codec stores them as raw little-endian 16-bit words. Reconstruction is
    the input rounded to bfloat16 (exact for bfloat16 inputs). The "no compression" baseline,
    and the block kernel of every bfloat16 segment (sink/recent windows, 16-bit anchors).
    float32 values beyond the bfloat16 range (~3.39e38) would round to inf and are refused
    (:attr:`value_limit`); float16 input near 65504 may round up to 65536 in bfloat16, which
    the decoder saturates back to 65504 in a float16 output
    (:func:`kvtune.codecs.kvtensors.to_output_dtype`).
    """

    @property
    def symbol_bits(self) -> int:
        return BF16_BITS

    @property
    def value_limit(self) -> float:
        """The bfloat16 maximum (~3.39e38): larger float32 values would round to inf."""
        return BF16_MAX

    def block_meta_layout(self, shape: tuple[int, ...]) -> tuple[MetaField, ...]:
        """No metadata."""
        return ()

    def quantize_block(self, x: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """bfloat16 bit patterns (uint16, same shape as ``x``), no metadata."""
        return x.to(torch.bfloat16).contiguous().view(torch.uint16), {}

    def dequantize_block(self, symbols: torch.Tensor, meta, shape: tuple[int, ...]) -> torch.Tensor:
        """Float32 values of the bfloat16 patterns, shape ``shape``.

        Raises:
            ValueError: a NaN or inf pattern (all 8 exponent bits set): an encoder writes only
                finite values, so the symbols come from a forged stream (the decoder reports
                it as a corrupt stream of its layer).
        """
        bits = symbols.reshape(shape).contiguous().view(torch.int16)
        if bool(((bits & BF16_EXPONENT) == BF16_EXPONENT).any()):
            raise ValueError("a NaN or inf bfloat16 value in a payload; an encoder writes only finite ones")
        return bits.view(torch.bfloat16).to(torch.float32)

    def short_label(self) -> str:
        return "bf16"
