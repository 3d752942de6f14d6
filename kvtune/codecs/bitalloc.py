"""The ``dp-alloc`` quantizer: bits allocated over PCA components under a per-layer or model-wide budget.

KVTC ("KV Cache Transform Coding for Compact Storage in LLM Inference", arXiv 2511.01815,
sec. 3) codes the PCA coefficients of the KV cache (:mod:`kvtune.codecs.pca`) with a bit
allocation across components under a fixed per-layer budget: components of large variance get
many bits, trailing ones zero (they are dropped and decode as the calibration mean). Here:

* :func:`allocate_bits`: the greedy allocation on the rate-distortion gain ``lambda_i *
  4**-b_i`` (adding one bit to a component of variance ``lambda_i`` coded with ``b_i`` bits
  removes ``3/4`` of its distortion ``lambda_i * 4**-b_i``; reverse water-filling in integer
  bits). It equals taking the ``B`` largest gains ``lambda_i * 4**-b`` over all components and
  ``b < max_bits``, ties to the lower component then the lower bit: a small pure function.
* :class:`DPAlloc` (``dp-alloc``): per layer and kind, ``B = max(1, round(bits * D))`` bits per
  token for the ``D`` components, allocated from the eigenvalues of the policy's basis. The
  components of one width form one segment (:class:`ComponentSegment`); each is quantized
  over the tokens with its own float16 mean and step (:class:`ComponentQuantizer`).

Why the quantizer names the basis itself (``basis``, the digest) instead of receiving the
allocation from the ``pca`` transform's state: the decoder plans a tensor's segments
(:meth:`~kvtune.codecs.base.Quantizer.plan`) from the policy, the shape, the layer and the kind
alone, before any transform runs; a digest parameter keeps the plan a function of those. The
policy checks that a ``dp-alloc`` quantizer follows a ``pca`` transform with the same basis
(:func:`check_pca_pairing`) and fills both from one calibration
(:meth:`~kvtune.codecs.PolicyConfig.with_pca_basis`).

**Entropy-coded allocation** (``grid = "ecsq"``). The greedy allocation above is the optimum
for *fixed-rate* codes (every component costs its width). Behind an entropy coder (``rans``,
``range``) the rate of a component is the entropy of its symbols, and the optimum is different:
one uniform step ``delta`` shared by every coded component of the layer (entropy-constrained
scalar quantization: a uniform quantizer followed by entropy coding is within 0.254 bits of the
rate-distortion bound at high rate, H. Gish and J. N. Pierce, "Asymptotically Efficient
Quantizing", IEEE Trans. Inf. Theory 14(5), 1968; equal step sizes across the coefficients of
an orthogonal transform are then optimal, V. K. Goyal, "Theoretical Foundations of Transform
Coding", IEEE Signal Processing Magazine 18(5), 2001, sec. "Entropy-coded quantization").
:func:`allocate_ecsq` picks ``delta`` so that the modelled entropy (a Gaussian coefficient of
variance ``lambda_i`` through a mid-tread quantizer of step ``delta``, :func:`ecsq_gaussian`)
sums to the budget, drops the components for which a bit buys less distortion than it does at
the shared slope (:data:`ECSQ_MIN_RATIO`), and gives every coded component an alphabet wide
enough for :data:`ECSQ_SPAN` standard deviations each side.

**One budget for the whole model** (``budget = "model"``). A per-layer budget spends the same
bits on every layer, but layers differ in how much an error in their KV costs the model: on
SmolLM2-135M the mean squared gradient of the continuation loss with respect to the value
coefficients falls ~400x from the first layers to the last, for keys it varies ~100x
(:func:`kvtune.evaluate.calibrate_pca.layer_sensitivity`, stored with the basis as
:attr:`~kvtune.codecs.pca.PCABasis.sensitivity`). To second order the loss grows by ``sum_l
s_l D_l`` (``s_l`` the layer's sensitivity, ``D_l`` its squared error; the diagonal Fisher
approximation that KVQuant, arXiv 2401.18079, sec. 3.2, uses to weigh quantization error), and
minimising that under one rate for all layers gives every layer the step ``delta_l = delta /
sqrt(s_l)`` (equal slope ``s_l delta_l**2``, the ECSQ optimum above applied across layers; for
the fixed-rate grids, the greedy allocation on the weighted gains ``s_l lambda_i 4**-b``).
:func:`allocate_across_layers` computes it; ``bits`` is then the average over all layers.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np
import torch

from kvtune.codecs.base import BF16_BITS, MetaField, Quantizer, Segment, Transform, param, register_quantizer
from kvtune.codecs.pca import KINDS, PCA, check_digest, lookup
from kvtune.codecs.quantizers import FP16_MAX, NoQuantizer, asymmetric_params, dequantize_affine, quantize_affine
from kvtune.core.errors import ConfigError
from kvtune.core.jsonio import is_finite_number

__all__ = [
    "DPAlloc",
    "ComponentQuantizer",
    "ComponentSegment",
    "allocate_bits",
    "allocate_ecsq",
    "allocate_across_layers",
    "at_least_one_component",
    "BUDGETS",
    "SENSITIVITY_RANGE",
    "ecsq_gaussian",
    "ecsq_entropy",
    "ECSQ_MIN_RATIO",
    "ECSQ_SPAN",
    "component_segments",
    "check_pca_pairing",
    "fill_dp_alloc",
    "GAUSSIAN_STEPS",
    "GRIDS",
    "token_sum",
]

GRIDS = ("gauss", "minmax", "ecsq")
"""``dp-alloc``'s per-component grids (:class:`ComponentQuantizer`)."""

BUDGETS = ("layer", "model")
"""``dp-alloc``'s budgets: the same bits in every layer, or one budget for the whole model spent
where the calibrated sensitivity says it buys most (:func:`allocate_across_layers`)."""

GAUSSIAN_STEPS = (1.5956, 0.9957, 0.5860, 0.3352, 0.1881, 0.1041, 0.0569, 0.0308)
"""Step (in standard deviations) of the mean-squared-error optimal uniform quantizer of a
Gaussian with ``2**b`` levels, ``b = 1..8`` (J. Max, "Quantizing for Minimum Distortion", IRE
Trans. Inf. Theory 1960, Table II; also Jayant & Noll, "Digital Coding of Waveforms", Table 4.1)."""


def _is_integer(v: Any) -> bool:
    """``v`` is an integer (a Python or numpy integer), not a bool."""
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def _float64(values: Any, who: str, what: str) -> torch.Tensor:
    """``values`` (numbers, nested sequences, a numpy array or a tensor) as a float64 tensor.

    Raises:
        ConfigError: naming ``who`` and ``what``, when they are not real numbers: strings,
            ragged lists, complex or boolean values, ints beyond the float range.
    """
    def bad(detail: str) -> ConfigError:
        return ConfigError(f"{who}: {what} must be real numbers ({detail})")

    if isinstance(values, torch.Tensor):
        if values.is_complex() or values.dtype == torch.bool:
            raise bad(f"got a {values.dtype} tensor")
        if values.layout != torch.strided or values.is_nested or values.is_meta:
            raise bad(f"got a {values.layout} tensor{' (nested)' if values.is_nested else ''}"
                      f"{' on the meta device' if values.is_meta else ''}; pass a dense one")
        try:
            return values.detach().to(torch.float64)
        except (RuntimeError, NotImplementedError) as exc:  # other dtypes torch cannot convert (quantized)
            raise bad(str(exc)) from None
    try:
        arr = np.asarray(values)
        if arr.dtype.kind == "O":  # Python ints beyond int64, Fractions: numbers; None, lists: not
            if not all(isinstance(v, numbers.Real) and not isinstance(v, bool) for v in arr.flat):
                raise bad("got objects that are not numbers")
        elif arr.dtype.kind not in "iuf":  # bools, complex, strings, dates
            raise bad(f"got {arr.dtype} values")
        return torch.from_numpy(arr.astype(np.float64))
    except (TypeError, ValueError, OverflowError) as exc:
        raise bad(str(exc)) from None


def allocate_bits(eigenvalues: Sequence[float] | torch.Tensor, total_bits: int, max_bits: int) -> tuple[int, ...]:
    """Greedy integer bit allocation across components (see the module docstring).

    Args:
        eigenvalues: per component variance ``lambda_i`` (negative values count as 0).
        total_bits: the budget ``B`` (bits per token over all components); capped at
            ``len(eigenvalues) * max_bits``.
        max_bits: most bits of one component (1..8).

    Returns:
        Bits per component, summing to ``min(B, D * max_bits)``.

    Raises:
        ConfigError: ``max_bits`` outside 1..8 (a Python or numpy integer), a ``total_bits``
            that is not a finite number, eigenvalues that are not real numbers, or a NaN one.
    """
    if not _is_integer(max_bits) or not 1 <= max_bits <= 8:
        raise ConfigError(f"allocate_bits: max_bits = {max_bits!r} must be an integer in 1..8")
    if not (_is_integer(total_bits) or is_finite_number(total_bits)):  # an int may exceed the float range
        raise ConfigError(f"allocate_bits: total_bits = {total_bits!r} must be a finite number")
    max_bits = int(max_bits)
    lam = _float64(eigenvalues, "allocate_bits", "eigenvalues").reshape(-1)
    if bool(lam.isnan().any()):
        raise ConfigError("allocate_bits: eigenvalues must not be NaN")
    lam = lam.clamp_min(0)
    d = lam.numel()
    take = max(0, min(int(total_bits), d * max_bits))
    gains = lam[:, None] * torch.pow(4.0, -torch.arange(max_bits, dtype=torch.float64))  # exact power-of-two scaling
    order = torch.argsort(-gains.reshape(-1), stable=True)[:take]  # ties: lower (component, bit) first
    return tuple(int(b) for b in torch.bincount(order // max_bits, minlength=d))


ECSQ_SPAN = 8
"""Standard deviations each side of the mean that an ``ecsq`` component's planned alphabet
covers (a request whose coefficients reach further widens that component's step instead of
clipping: :class:`ComponentQuantizer`)."""

ECSQ_MIN_RATIO = 0.46
"""Smallest ``sigma / delta`` at which ``ecsq`` codes a component: below it, the distortion a
coded Gaussian component removes per bit, ``(sigma**2 - D) / H``, is less than the slope
``delta**2 * ln(2) / 6`` of the components coded at high rate (:func:`ecsq_gaussian`; the two
cross at 0.46), so the bits go further elsewhere and the component is dropped."""

_HIGH_RATE = 8.0  # sigma / delta above which the high-rate entropy formula is used
_GAUSS_DIFF_ENTROPY = 0.5 * math.log2(2 * math.pi * math.e)  # bits, unit-variance Gaussian


_ENTROPY_CELLS = (4, 8, 16, 32, int(math.ceil(_HIGH_RATE * 9)) + 2)
"""Cell ranges ``-c .. c`` of the entropy sums: :func:`ecsq_gaussian` takes the last (ratio 8,
9 standard deviations and more), :func:`ecsq_entropy` for each ratio the smallest that covers
``ceil(9 ratio) + 2`` cells each side."""


def _cells(low: torch.Tensor, cells: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Cells ``j = -cells .. cells`` of ``round(x / delta)`` for ``x ~ N(0, (low delta)**2)``,
    float64 ``low`` ``(n, 1)``: ``(j, a, b, p)``, the cell edges ``a, b`` in standard deviations
    and the cell probabilities ``p`` ``(n, 2 cells + 1)``."""
    j = torch.arange(-cells, cells + 1, dtype=torch.float64)
    a, b = (j - 0.5) / low, (j + 0.5) / low
    p = (0.5 * torch.erfc(-b / math.sqrt(2)) - 0.5 * torch.erfc(-a / math.sqrt(2))).clamp_min(0)
    return j, a, b, p


def _entropy_bits(p: torch.Tensor) -> torch.Tensor:
    """Entropy (bits) of each row of cell probabilities ``p`` ``(n, cells)``: ``(n,)``."""
    return -(p * torch.log2(torch.where(p > 0, p, torch.ones_like(p)))).sum(1)


def ecsq_gaussian(ratio: Sequence[float] | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Entropy and distortion of a zero-mean Gaussian through a mid-tread uniform quantizer.

    A coefficient ``x ~ N(0, sigma**2)`` is coded as ``q = round(x / delta)`` and decoded as
    ``q * delta`` (no clamping), ``ratio = sigma / delta``.

    Args:
        ratio: float64-convertible, any shape; values > 0.

    Returns:
        ``(entropy, distortion)``: float64 of ``ratio``'s shape: the entropy of ``q`` in bits and
        the mean squared error in units of ``delta**2``; exact sums over the quantizer's cells
        from the Gaussian CDF up to ratio 8, the high-rate forms ``log2(ratio) + log2(2 pi e) / 2
        + 1 / (24 ln 2 ratio**2)`` (the cell-width correction) and ``1 / 12`` above it (within
        1e-5 bits there).

    Raises:
        ConfigError: a ratio that is not a finite positive number.
    """
    r = _float64(ratio, "ecsq_gaussian", "ratios sigma / delta")
    if not bool(torch.isfinite(r).all()) or bool((r <= 0).any()):
        raise ConfigError("ecsq_gaussian: ratios sigma / delta must be finite and > 0")
    flat = r.reshape(-1, 1)
    low = flat.clamp(max=_HIGH_RATE)
    j, a, b, p = _cells(low, _ENTROPY_CELLS[-1])  # +-9 standard deviations and more

    def pdf(z: torch.Tensor) -> torch.Tensor:
        return torch.exp(-0.5 * z * z) / math.sqrt(2 * math.pi)

    m1 = low * (pdf(a) - pdf(b))  # E[x / delta ; cell]
    m2 = low * low * (p - (b * pdf(b) - a * pdf(a)))  # E[(x / delta)**2 ; cell]
    dist = (m2 - 2 * j * m1 + j * j * p).sum(1)
    ent = _entropy_bits(p)
    high = flat[:, 0] > _HIGH_RATE
    ent = torch.where(high, torch.log2(flat[:, 0]) + _GAUSS_DIFF_ENTROPY + 1 / (24 * math.log(2)) / flat[:, 0] ** 2, ent)
    dist = torch.where(high, torch.full_like(dist, 1 / 12), dist)
    return ent.reshape(r.shape), dist.reshape(r.shape)


def ecsq_entropy(ratio: Sequence[float] | torch.Tensor) -> torch.Tensor:
    """The entropy half of :func:`ecsq_gaussian`, faster: float64 of ``ratio``'s shape, bits.

    The same formulas, with each ratio's cell sum over ``-c .. c`` for the smallest ``c`` in
    :data:`_ENTROPY_CELLS` that covers 9 of its standard deviations each side (the cells beyond
    hold probabilities below ``1e-18``) instead of the 147 cells that ratio 8 needs: a Gaussian
    component coded at a few bits has a ratio near 1 and needs about 13. Within a few units in
    the last place of :func:`ecsq_gaussian` (``tests/test_pca.py``); :func:`allocate_ecsq`
    bisects on it (its ``delta`` is rounded to 7 significant bits, so such differences do not
    move a plan). The model-wide allocation of the default space's 97 % policy, 5,760
    components: 1.1-1.7 s -> about 0.2 s per K or V.

    Raises:
        ConfigError: a ratio that is not a finite positive number.
    """
    r = _float64(ratio, "ecsq_entropy", "ratios sigma / delta")
    if not bool(torch.isfinite(r).all()) or bool((r <= 0).any()):
        raise ConfigError("ecsq_entropy: ratios sigma / delta must be finite and > 0")
    flat = r.reshape(-1)
    out = torch.empty_like(flat)
    high = flat > _HIGH_RATE
    top = flat[high]
    out[high] = torch.log2(top) + _GAUSS_DIFF_ENTROPY + 1 / (24 * math.log(2)) / top**2
    need = (flat * 9).ceil() + 2
    below = 0
    for c in _ENTROPY_CELLS:
        rows = ~high & (need > below) & (need <= c)
        below = c
        if bool(rows.any()):
            out[rows] = _entropy_bits(_cells(flat[rows].reshape(-1, 1), c)[3])
    return out.reshape(r.shape)


def _round_step(delta: float) -> float:
    """``delta`` rounded to 7 significant bits (exact float operations), so that encoder and
    decoder machines whose ``erf`` differ in the last place still plan the same widths."""
    m, e = math.frexp(delta)
    return math.ldexp(round(math.ldexp(m, 7)), e - 7)


def allocate_ecsq(eigenvalues: Sequence[float] | torch.Tensor, total_bits: float, max_bits: int
                  ) -> tuple[tuple[int, ...], float]:
    """Entropy-constrained allocation across components (see the module docstring).

    Finds the step ``delta`` (to 7 significant bits) at which the modelled entropy of the coded
    components, ``sum ecsq_entropy(sigma_i / delta)`` (:func:`ecsq_gaussian`'s entropy) over ``sigma_i >= ECSQ_MIN_RATIO *
    delta`` (``sigma_i = sqrt(lambda_i)``), meets ``total_bits`` (bisection on ``log2 delta``),
    then gives each coded component the width ``1 + ceil(log2(L_i + 1))`` for ``L_i =
    ceil(ECSQ_SPAN * sigma_i / delta)`` levels each side of the mean, clamped to
    ``3..max_bits``; dropped components get 0.

    Args:
        eigenvalues: per component variance ``lambda_i`` (negative values count as 0).
        total_bits: the entropy budget in bits per token over all components, > 0.
        max_bits: most bits of one component's alphabet (3..8).

    Returns:
        ``(widths, delta)``: bits per component and the step. All-zero eigenvalues give all-zero
        widths and ``delta = 1``.

    Raises:
        ConfigError: ``max_bits`` outside 3..8 (a Python or numpy integer), a ``total_bits``
            that is not a positive finite number, eigenvalues that are not real numbers, or a
            NaN or +inf one.
    """
    if not _is_integer(max_bits) or not 3 <= max_bits <= 8:
        raise ConfigError(f"allocate_ecsq: max_bits = {max_bits!r} must be an integer in 3..8")
    if not (is_finite_number(total_bits) and total_bits > 0):
        raise ConfigError(f"allocate_ecsq: total_bits = {total_bits!r} must be a finite number > 0")
    max_bits, total_bits = int(max_bits), float(total_bits)
    lam = _float64(eigenvalues, "allocate_ecsq", "eigenvalues").reshape(-1)
    if bool(lam.isnan().any()) or bool((lam == math.inf).any()):
        raise ConfigError("allocate_ecsq: eigenvalues must not be NaN or +inf")
    sigma = [math.sqrt(v) for v in lam.clamp_min(0).tolist()]
    top = max(sigma, default=0.0)
    if top == 0.0:
        return (0,) * len(sigma), 1.0
    sig = torch.tensor(sigma, dtype=torch.float64)

    def entropy(delta: float) -> float:
        coded = sig[sig >= ECSQ_MIN_RATIO * delta]
        return float(ecsq_entropy(coded / delta).sum()) if coded.numel() else 0.0

    lo, hi = math.log2(top) - 40.0, math.log2(top) + 4.0  # entropy(2**lo) > any budget; 2**hi codes nothing
    for _ in range(40):  # 44 octaves to 4e-11 of one, far below the 7-bit rounding
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if entropy(2.0**mid) > total_bits else (lo, mid)
    delta = _round_step(2.0**hi)
    widths = []
    for s in sigma:
        if s < ECSQ_MIN_RATIO * delta:
            widths.append(0)
            continue
        levels = math.ceil(ECSQ_SPAN * s / delta)
        widths.append(min(max(1 + levels.bit_length(), 3), max_bits))  # bit_length(L) = ceil(log2(L + 1))
    return tuple(widths), delta


def token_sum(x: torch.Tensor) -> torch.Tensor:
    """Sum of float64 ``x`` ``(batch, 1, tokens, n)`` over the tokens (axis 2, kept), added in
    token order (``torch.cumsum`` is sequential; ``torch.sum`` may pair terms differently by
    shape and machine), so that the compiled kernel
    (:func:`kvtune.codecs.kernels.quantize_components`) reproduces it bit for bit. Zero when
    there are no tokens."""
    if x.shape[2] == 0:
        return x.new_zeros((*x.shape[:2], 1, *x.shape[3:]))
    return x.cumsum(dim=2)[:, :, -1:]


@dataclass(frozen=True)
class ComponentQuantizer(Quantizer):
    """Block kernel of ``dp-alloc``: each component (last axis) of a ``(batch, 1, tokens, n)``
    block quantized over its tokens with ``bits`` bits.

    ``grid = "gauss"``: per (batch row, component) ``zero`` = the mean over the tokens,
    ``scale`` = ``GAUSSIAN_STEPS[bits - 1]`` times the standard deviation about that mean, both
    float16; a mid-rise grid ``x ~ zero + (q - (2**bits - 1) / 2) * scale``, ``q = 0 ..
    2**bits - 1``; values beyond the grid clamp to its end levels (the MSE-optimal trade for
    Gaussian coefficients). ``grid = "minmax"``: the asymmetric min/max grid of ``uniform``
    (:func:`~kvtune.codecs.quantizers.asymmetric_params`: ``x ~ zero + q * scale``, ``zero`` the
    minimum), which never clips outlier tokens. ``grid = "ecsq"`` (entropy-coded allocation,
    module docstring): ``zero`` the mean as for ``gauss``, a mid-tread grid ``x ~ zero + (q -
    2**(bits - 1)) * scale`` whose ``scale`` is the planned ``step``, widened to ``m / (2**(bits
    - 1) - 1)`` when the largest deviation ``m = max |x - zero|`` (float32) would not fit, so it
    never clips either (float16, rounded to nearest). A constant component decodes to its value
    (rounded to float16). Not registered: it is only reached through :meth:`DPAlloc.coder`.

    Range: magnitudes up to 32752 (:attr:`value_limit`), so the float16 mean and step never
    saturate.

    The fast path codes every segment of a tensor (either grid) in one call of
    :func:`kvtune.codecs.kernels.quantize_components` (same bytes; the Gaussian grid's statistics summed in token
    order by :func:`token_sum`).
    """

    bits: int = param(4, low=1, high=8, doc="bits per symbol")
    grid: str = param("gauss", choices=GRIDS, doc="per-component grid")
    step: float = param(0.0, low=0.0, high=FP16_MAX, doc="ecsq: the planned step (the smallest scale)")

    def validate(self) -> None:
        if self.grid == "ecsq" and self.bits < 2:
            raise ConfigError("ComponentQuantizer: the ecsq grid needs bits >= 2 (a level each side of the mean)")

    @property
    def symbol_bits(self) -> int:
        return self.bits

    @property
    def value_limit(self) -> float:
        """32752: the float16 mean stays finite and the step (at most 1.6 standard deviations) too."""
        return FP16_MAX / 2

    def block_meta_layout(self, shape: tuple[int, ...]) -> tuple[MetaField, ...]:
        """float16 ``scale`` and ``zero`` of shape ``(batch, 1, 1, n)``."""
        meta = (int(shape[0]), int(shape[1]), 1, int(shape[3]))
        return (MetaField("scale", meta, torch.float16), MetaField("zero", meta, torch.float16))

    def _grid(self, scale16: torch.Tensor, zero16: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scale = scale16.to(torch.float32)
        if self.grid == "minmax":
            return scale, zero16.to(torch.float32)
        half = 2.0 ** (self.bits - 1) if self.grid == "ecsq" else (2**self.bits - 1) / 2.0
        return scale, zero16.to(torch.float32) - scale * half

    def quantize_block(self, x: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """uint8 symbols of ``x.shape`` and the float16 ``scale`` / ``zero`` per component."""
        x = x.to(torch.float32)
        if self.grid == "minmax":
            if x.shape[2] == 0:
                lo = hi = torch.zeros((*x.shape[:2], 1, x.shape[3]))
            else:
                lo, hi = torch.aminmax(x, dim=2, keepdim=True)
            scale16, zero16 = asymmetric_params(lo, hi, self.bits)
            return quantize_affine(x, *self._grid(scale16, zero16), self.bits).contiguous(), {"scale": scale16, "zero": zero16}
        tokens = max(int(x.shape[2]), 1)
        zero16 = (token_sum(x.double()) / tokens).clamp(-FP16_MAX, FP16_MAX).to(torch.float16)
        if self.grid == "ecsq":
            dev = (x - zero16.to(torch.float32)).abs()
            dev = dev.amax(dim=2, keepdim=True) if x.shape[2] else torch.zeros_like(zero16, dtype=torch.float32)
            wide = dev / torch.tensor(2.0 ** (self.bits - 1) - 1, dtype=torch.float32)
            scale16 = torch.maximum(wide, torch.tensor(self.step, dtype=torch.float32)).clamp(max=FP16_MAX).to(torch.float16)
        else:
            std = (token_sum((x.double() - zero16.double()).square()) / tokens).sqrt()
            scale16 = (std * GAUSSIAN_STEPS[self.bits - 1]).clamp(max=FP16_MAX).to(torch.float16)
        scale, zero = self._grid(scale16, zero16)
        return quantize_affine(x, scale, zero, self.bits).contiguous(), {"scale": scale16, "zero": zero16}

    def dequantize_block(self, symbols: torch.Tensor, meta, shape: tuple[int, ...]) -> torch.Tensor:
        """Float32 reconstruction on the grid (class docstring), shape ``shape``."""
        scale, zero = self._grid(meta["scale"], meta["zero"])
        return dequantize_affine(symbols.reshape(shape), scale, zero).contiguous()

    def short_label(self) -> str:
        return f"pc{self.bits}" + {"gauss": "", "minmax": "m", "ecsq": "e"}[self.grid]


@dataclass(frozen=True, eq=False)
class ComponentSegment(Segment):
    """A segment of chosen components (the tokens of :attr:`tokens`, a slice or ``None`` for
    all) of a ``(batch, kv_heads, tokens, head_dim)`` tensor of PCA coefficients: component
    ``j`` sits at head ``j // head_dim``, channel ``j % head_dim`` (:mod:`kvtune.codecs.pca`).
    Its data is ``(batch, 1, tokens, n)``, the components on the last axis in increasing order.

    Attributes:
        head_idx, chan_idx: int64 ``(n,)`` head and channel of each component.
    """

    head_idx: torch.Tensor = None  # type: ignore[assignment]
    chan_idx: torch.Tensor = None  # type: ignore[assignment]

    @property
    def is_whole(self) -> bool:
        return False

    def head_indices(self, heads: int) -> torch.Tensor:
        """The distinct heads holding the segment's components."""
        return torch.unique(self.head_idx)

    def take(self, x: torch.Tensor) -> torch.Tensor:
        """``(batch, 1, tokens, n)``: the segment's components of ``x``."""
        t = slice(None) if self.tokens is None else self.tokens
        return x[:, self.head_idx, t, self.chan_idx].permute(1, 2, 0).unsqueeze(1)

    def put(self, out: torch.Tensor, y: torch.Tensor) -> None:
        """Write ``(batch, 1, tokens, n)`` ``y`` at the segment's components of ``out`` (in place)."""
        t = slice(None) if self.tokens is None else self.tokens
        out[:, self.head_idx, t, self.chan_idx] = y[:, 0].permute(2, 0, 1)


def component_segments(shape: tuple[int, ...], widths: Sequence[int], coder, *, first_token: int = 0
                       ) -> tuple[ComponentSegment, ...]:
    """One :class:`ComponentSegment` per distinct non-zero width (ascending), holding the
    components of that width over tokens ``first_token ..``; zero-width components are in no
    segment (none at all when no token is left).

    Args:
        shape: ``(batch, kv_heads, tokens, head_dim)`` with ``kv_heads * head_dim == len(widths)``.
        widths: bits per component.
        coder: width -> block quantizer.
        first_token: tokens before it are left to other segments (bfloat16 sinks).
    """
    b, h, t, d = shape
    if first_token >= t:
        return ()
    tokens = slice(first_token, t) if first_token else None
    w = torch.as_tensor(widths, dtype=torch.int64)
    out = []
    for bits in sorted({int(v) for v in widths if v > 0}):
        idx = torch.nonzero(w == bits).flatten()
        out.append(ComponentSegment(None, tokens, (b, 1, t - first_token, idx.numel()), coder(bits), idx // d, idx % d))
    return tuple(out)


SENSITIVITY_RANGE = 1e12
"""Largest ratio between two layers' sensitivities :func:`allocate_across_layers` honours: the
sensitivities are divided by the largest, and smaller ones raised to ``1 / SENSITIVITY_RANGE``
(a layer a trillion times less sensitive than another already codes almost nothing)."""


MAX_PLANNED_STEP = 65024.0
"""Largest ``ecsq`` step :func:`allocate_across_layers` plans (the largest 7-significant-bit
number a float16 holds; a layer this coarse codes one component, at about zero bits)."""


def allocate_across_layers(eigenvalues: Sequence[Sequence[float] | torch.Tensor], sensitivity: Sequence[float],
                           bits: float, max_bits: int, grid: str) -> tuple[tuple[tuple[int, ...], float], ...]:
    """One bit budget for all layers, spent by weighted distortion (the module docstring).

    Layer ``l``'s eigenvalues are scaled by its sensitivity ``s_l`` (divided by the largest,
    floored at ``1 / SENSITIVITY_RANGE``: only ratios matter); one allocation runs over the
    components of all layers together (:func:`allocate_ecsq` with ``bits * sum_l D_l`` bits for
    ``grid="ecsq"``, else :func:`allocate_bits` with ``max(1, round(bits * sum_l D_l))``); an
    ``ecsq`` layer's step is the shared one divided by ``sqrt(s_l)``, rounded to 7 significant
    bits like every planned step, at most :data:`MAX_PLANNED_STEP`.

    Args:
        eigenvalues: per layer (at least one), the ``D_l`` component variances.
        sensitivity: per layer ``s_l``, a finite number > 0.
        bits: average bits per element over all layers' components, finite and > 0.
        max_bits: most bits of one component.
        grid: one of :data:`GRIDS`.

    Returns:
        Per layer ``(widths, step)`` as :func:`allocate_ecsq` (step 0.0 for the fixed-rate grids).

    Raises:
        ConfigError: no layers, another number of sensitivities than layers, a sensitivity that
            is not a finite number > 0, a ``bits`` that is not a finite number > 0 (or whose
            budget over all components overflows), an unknown ``grid``, eigenvalues that are not
            real numbers, or what :func:`allocate_ecsq` / :func:`allocate_bits` raise.
    """
    try:  # sequences, arrays or tensors with a row per layer, generators
        eigenvalues, sensitivity = list(eigenvalues), list(sensitivity)
    except (TypeError, RuntimeError) as exc:  # RuntimeError: a tensor that cannot be iterated (nested)
        raise ConfigError(f"allocate_across_layers: eigenvalues and sensitivity must be per-layer sequences ({exc})") \
            from None
    if not eigenvalues or len(sensitivity) != len(eigenvalues) \
            or not all(is_finite_number(v) and v > 0 for v in sensitivity):
        raise ConfigError(f"allocate_across_layers: need one finite sensitivity > 0 per layer (>= 1 layer, got "
                          f"{len(eigenvalues)}), got {str(sensitivity)[:200]}")
    if not (is_finite_number(bits) and bits > 0) or grid not in GRIDS:
        raise ConfigError(f"allocate_across_layers: bits = {bits!r} must be a finite number > 0 and grid = {grid!r} "
                          f"one of {GRIDS}")
    bits = float(bits)  # the budget in float64 whatever the caller's type (a float16 bits would round it)
    top = max(float(v) for v in sensitivity)
    weights = [max(float(v) / top, 1.0 / SENSITIVITY_RANGE) for v in sensitivity]
    lams = [_float64(e, "allocate_across_layers", "eigenvalues").reshape(-1) for e in eigenvalues]
    weighted = torch.cat([lam * w for lam, w in zip(lams, weights)])
    total = bits * weighted.numel()
    if not math.isfinite(total):
        raise ConfigError(f"allocate_across_layers: bits = {bits!r} times {weighted.numel()} components is beyond "
                          "the float range")
    if grid == "ecsq":
        widths, delta = allocate_ecsq(weighted, total, max_bits)
        steps = [min(_round_step(delta / math.sqrt(w)), MAX_PLANNED_STEP) for w in weights]
    else:
        widths, steps = allocate_bits(weighted, max(1, round(total)), max_bits), [0.0] * len(lams)
    out, start = [], 0
    for lam, step in zip(lams, steps):
        out.append((tuple(widths[start : start + lam.numel()]), step))
        start += lam.numel()
    return tuple(out)


def at_least_one_component(widths: tuple[int, ...], min_width: int) -> tuple[int, ...]:
    """``widths`` with the first component (the largest eigenvalue) given ``min_width`` bits when
    the allocation codes none: a non-empty tensor needs a segment (the stream format records
    at least one per tensor), and the decoder's size rule one coded symbol per ``D`` elements
    (:meth:`DPAlloc.elements_per_symbol`)."""
    if not widths or any(widths):
        return widths
    return (min_width,) + widths[1:]


@functools.lru_cache(maxsize=64)
def _model_allocation(digest: str, kind: str, grid: str, bits: float, max_bits: int
                      ) -> tuple[tuple[tuple[int, ...], float], ...]:
    """Every layer's ``(widths, step)`` under one model-wide budget (:func:`allocate_across_layers`), cached."""
    basis = lookup(digest)
    eig = [pair[KINDS.index(kind)].eigenvalues for pair in basis.layers]
    return allocate_across_layers(eig, basis.layer_sensitivity(kind), bits, max_bits, grid)


@functools.lru_cache(maxsize=4096)
def _layer_allocation(digest: str, layer: int, kind: str, heads: int, head_dim: int, grid: str, bits: float,
                      max_bits: int) -> tuple[tuple[int, ...], float]:
    """``(widths, step)`` of one layer and kind (:meth:`DPAlloc.allocation`), cached."""
    eig = lookup(digest).layer(layer, kind, heads, head_dim).eigenvalues
    d = heads * head_dim
    if grid == "ecsq":
        return allocate_ecsq(eig, bits * d, max_bits)
    return allocate_bits(eig, max(1, round(bits * d)), max_bits), 0.0


@register_quantizer("dp-alloc")
@dataclass(frozen=True)
class DPAlloc(Quantizer):
    """Per-layer bit allocation over PCA components (KVTC, arXiv 2511.01815, sec. 3; see the
    module docstring). Use after a ``pca`` transform with the same ``basis``.

    Cost per element: ``bits`` (the budget, to rounding: ``round(bits * D)`` bits per token of a
    layer; with the ``ecsq`` grid the modelled entropy-coded rate, ``bits * D`` bits per token,
    :func:`allocate_ecsq`) plus 4 metadata bytes per coded component and batch row (float16
    mean and step), i.e. ``32 * coded / (tokens * D)`` bits; dropped components cost nothing.

    Args:
        bits: average bits per element (per coefficient), > 0 and ``<= max_bits``.
        max_bits: most bits of one component, 1..8.
        basis: the :attr:`~kvtune.codecs.pca.PCABasis.digest` whose eigenvalues drive the
            allocation; ``""`` until calibration fills it in.
        grid: ``"gauss"`` (MSE-optimal step for Gaussian coefficients, clamps outliers),
            ``"minmax"`` (min/max grid, never clamps) or ``"ecsq"`` (one step per layer for an
            entropy coder, never clamps; ``max_bits`` >= 3): :class:`ComponentQuantizer`.
        sink_tokens: the first tokens (attention sinks, whose KV are outliers that would set
            every component's range or be clamped) kept as bfloat16 coefficients, outside the
            per-component statistics; 16 bits per element on those tokens.
        budget: ``"layer"`` (``bits`` in every layer) or ``"model"`` (``bits`` on average over
            all layers, spent by the basis' per-layer sensitivity: :func:`allocate_across_layers`;
            the basis must carry :attr:`~kvtune.codecs.pca.PCABasis.sensitivity`).

    Raises:
        ConfigError: on construction, a bad parameter; on use, a missing basis
            (:class:`~kvtune.codecs.pca.BasisNotLoadedError`), a tensor the basis does not cover,
            a ``"model"`` budget on a basis without sensitivity, or per-token floors from a
            transform (``dp-alloc`` plans per component, not per token).
    """

    bits: float = param(2.0, low=0.0, high=8.0, doc="average bits per element (per-layer budget)")
    max_bits: int = param(8, low=1, high=8, doc="most bits of one component")
    basis: str = param("", doc="sha256 digest of the PCA basis ('' = filled in by calibration)")
    grid: str = param("gauss", choices=GRIDS, doc="per-component grid (ComponentQuantizer)")
    sink_tokens: int = param(0, low=0, high=2**31 - 1, doc="first tokens kept in bfloat16 (all coefficients)")
    budget: str = param("layer", choices=BUDGETS, elide_default=True,
                        doc="bits per layer ('layer') or on average over the model ('model')")

    def validate(self) -> None:
        if not 0 < self.bits <= self.max_bits:
            raise ConfigError(f"quantizer 'dp-alloc': parameter 'bits' = {self.bits} must be > 0 and <= max_bits "
                              f"= {self.max_bits}")
        if self.grid == "ecsq" and self.max_bits < 3:
            raise ConfigError(f"quantizer 'dp-alloc': grid 'ecsq' needs max_bits >= 3, got {self.max_bits}")
        check_digest(self.basis, "quantizer 'dp-alloc': parameter 'basis'")

    @property
    def symbol_bits(self) -> int:
        """The widest width (``max_bits``); segments are coded by :meth:`coder`."""
        return self.max_bits

    def coder(self, bits: int, step: float = 0.0) -> Quantizer:
        """The :class:`ComponentQuantizer` of ``bits`` (1..``max_bits``; 3.. for ``ecsq``, whose
        planned ``step`` the tensor's plan passes).

        Raises:
            ValueError: another width.
        """
        if bits == BF16_BITS and self.sink_tokens:
            return NoQuantizer()
        if not (3 if self.grid == "ecsq" else 1) <= bits <= self.max_bits:
            raise ValueError(f"dp-alloc has no {bits}-bit block kernel")
        return ComponentQuantizer(bits=bits, grid=self.grid, step=step)

    def head_widths(self) -> tuple[int, ...]:
        return tuple(range(3 if self.grid == "ecsq" else 1, self.max_bits + 1))

    def window_widths(self) -> tuple[int, ...]:
        return (BF16_BITS,) if self.sink_tokens else ()

    def allocation(self, shape: tuple[int, ...], *, layer: int, kind: str) -> tuple[tuple[int, ...], float]:
        """Bits per component of a tensor of ``shape`` at ``layer`` / ``kind`` and the ``ecsq``
        step (:func:`allocate_ecsq`; 0 for the other grids, :func:`allocate_bits`; with
        ``budget="model"``, the layer's share of :func:`allocate_across_layers`), at least one
        component coded (:func:`at_least_one_component`)."""
        if self.budget == "model":
            lookup(self.basis).layer(int(layer), kind, int(shape[1]), int(shape[3]))  # the tensor's geometry
            widths, step = _model_allocation(self.basis, kind, self.grid, self.bits, self.max_bits)[int(layer)]
        else:
            widths, step = _layer_allocation(self.basis, int(layer), kind, int(shape[1]), int(shape[3]), self.grid,
                                             self.bits, self.max_bits)
        return at_least_one_component(widths, self.head_widths()[0]), step

    def widths(self, shape: tuple[int, ...], *, layer: int, kind: str) -> tuple[int, ...]:
        """Bits per component of a tensor of ``shape`` at ``layer`` / ``kind`` (:meth:`allocation`)."""
        return self.allocation(shape, layer=layer, kind=kind)[0]

    def elements_per_symbol(self, shape: tuple[int, ...], *, layer: int, kind: str) -> int:
        """``ceil(D / c)`` for the ``c >= 1`` coded components of ``D`` (dropped components have
        no symbols; sink tokens code every element).

        Raises:
            ConfigError: as :meth:`allocation`.
        """
        coded = sum(1 for w in self.widths(shape, layer=layer, kind=kind) if w)
        return -(-int(shape[1]) * int(shape[3]) // max(coded, 1))

    def plan(self, shape, *, layer: int, kind: str, min_bits: torch.Tensor | None = None) -> tuple[Segment, ...]:
        """The first ``sink_tokens`` tokens as one bfloat16 segment (every coefficient), then one
        segment per width in use over the other tokens (:func:`component_segments`); none for an
        empty tensor.

        Raises:
            ConfigError: per-token floors (``min_bits`` with a non-zero value), or a basis that
                is missing or does not cover the tensor.
        """
        shape = tuple(int(s) for s in shape)
        if min_bits is not None and bool((min_bits > 0).any()):
            raise ConfigError("dp-alloc codes whole components and takes no per-token precision floors "
                              "(use it after 'pca' without 'delta' anchors)")
        widths, step = self.allocation(shape, layer=layer, kind=kind)
        if shape[2] == 0:
            return ()
        sink = min(self.sink_tokens, shape[2])
        head = (Segment(None, slice(0, sink), (shape[0], shape[1], sink, shape[3]), NoQuantizer()),) if sink else ()
        return head + component_segments(shape, widths, functools.partial(self.coder, step=step), first_token=sink)

    def dequantize(self, q, *, layer: int, kind: str) -> torch.Tensor:
        """Float32 reconstruction; dropped (0-bit) components decode as 0, the calibration mean
        once the ``pca`` transform is inverted."""
        out = torch.zeros(q.shape, dtype=torch.float32)
        for p in q.parts:
            p.segment.put(out, p.segment.coder.dequantize_block(p.symbols, p.meta, p.shape))
        return out

    def short_label(self) -> str:
        """``dp{bits}[/m{max_bits}][/minmax|/ecsq][/s{sink_tokens}][/model]``, e.g. ``dp1.5`` or ``dp2/m4/s4``."""
        return (f"dp{self.bits:g}" + (f"/m{self.max_bits}" if self.max_bits != 8 else "")
                + ("" if self.grid == "gauss" else f"/{self.grid}") + (f"/s{self.sink_tokens}" if self.sink_tokens else "")
                + ("/model" if self.budget == "model" else ""))


# ----------------------------------------------------------------------------- policy rules


def check_pca_pairing(transforms: Sequence[Transform], quantizers: Mapping[str, Quantizer]) -> None:
    """A ``dp-alloc`` quantizer must code the coefficients of a ``pca`` transform of the same
    basis: the last transform is ``pca`` and its ``basis`` equals the quantizer's.

    Args:
        transforms: the policy's transforms, in order.
        quantizers: slot name -> quantizer.

    Raises:
        ConfigError: naming the slot.
    """
    last = transforms[-1] if transforms else None
    for slot, quant in quantizers.items():
        if not isinstance(quant, DPAlloc):
            continue
        if not isinstance(last, PCA):
            raise ConfigError(f"policy {slot!r}: dp-alloc allocates bits over PCA components; the last transform "
                              f"must be 'pca', got {None if last is None else last.name!r}")
        if last.basis != quant.basis:
            raise ConfigError(f"policy {slot!r}: dp-alloc basis {quant.basis[:12] or '(none)'} differs from the pca "
                              f"transform's {last.basis[:12] or '(none)'}")


def fill_dp_alloc(quant: Quantizer, transforms: Sequence[Transform]) -> Quantizer:
    """``quant`` with the basis of the last transform when it is a basis-less ``dp-alloc`` and
    that transform is ``pca``; otherwise ``quant`` unchanged."""
    if isinstance(quant, DPAlloc) and not quant.basis and transforms and isinstance(transforms[-1], PCA):
        return dataclasses.replace(quant, basis=transforms[-1].basis)
    return quant
