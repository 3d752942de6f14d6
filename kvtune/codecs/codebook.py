"""Non-uniform (codebook) quantization of KV tensors: NormalFloat and Lloyd-Max levels.

The ``codebook`` quantizer is a Q stage of the T -> Q -> C pipeline (:mod:`kvtune.codecs.base`;
KVServe, arXiv 2605.13734) that groups values like ``uniform`` (per token or per channel, in
groups of ``group_size``, bfloat16 sink / recent windows), normalises every group to
``[-1, 1]`` and codes each normalised value as the index of the **nearest level** of a sorted,
non-uniform codebook of ``2**bits`` levels in ``[-1, 1]``:

* ``levels = "nf"``: NormalFloat levels, the quantiles of N(0, 1) scaled to ``[-1, 1]`` with an
  exact zero (QLoRA, "QLoRA: Efficient Finetuning of Quantized LLMs", arXiv 2305.14314,
  sec. 3.1; :func:`nf_levels`). Data-free: nothing but the group scales travels.
* ``levels = "lloyd"``: a Lloyd-Max codebook (1-D k-means) fitted on the block's own normalised
  values (:func:`fit_lloyd`; the end levels stay at -1 and 1, the group extremes) and sent with
  it as ``2**bits`` float16 levels (``2 ** (bits + 1)`` bytes per block, counted in the stream
  size). Non-uniform datatypes fitted to the KV
  distribution are the point of KVQuant ("KVQuant: Towards 10 Million Context Length LLM
  Inference with KV Cache Quantization", arXiv 2401.18079, sec. 3.3).
* ``levels = "calibrated"``: one Lloyd-Max codebook per layer (and K or V), fitted **once,
  offline**, on calibration contexts, as KVQuant derives its datatypes offline from calibration
  data (sec. 3.3): :func:`fit_calibrated` pools the normalised values of
  every calibration context's layer into one histogram and runs the same Lloyd iterations. The
  levels are part of the policy (``codebooks[layer]``, float16 values, like ``mixhq``'s head
  scores; :meth:`kvtune.codecs.PolicyConfig.with_codebooks`), so nothing but the group scales
  travels per tensor and no encode pays for a fit. Blocks of another width than ``bits`` (a
  transform's floors, e.g. ``delta`` anchors) use the NF levels.

Normalisation (``normalize``):

* ``"absmax"``: ``u = x / scale``, ``scale`` = the group's largest magnitude rounded *up* to
  float16 (so ``|u| <= 1``); one float16 per group. Zero decodes to exactly zero on codebooks
  with a zero level (NF has one).
* ``"minmax"``: ``u = (x - zero) / scale`` with ``zero`` the group's mid-range (nearest
  float16) and ``scale`` the half-range rounded up to float16; two float16 per group.

Per element cost: ``bits + 16 * (1 + minmax) / group_length`` bits, plus ``16 * 2**bits`` bits per
block for Lloyd levels (3-bit, group 32, absmax: 3.5 bits + 128 bits per block).

Exactness. The three codec paths (this torch reference, the compiled kernels of
:mod:`kvtune.codecs.kernels.codebook`, the device path of :mod:`kvtune.codecs.torchpath`) write
the same bytes. Every float operation is one IEEE operation that rounds the same way
everywhere, and the Lloyd fit is exact integer arithmetic on a histogram until one final
division per level (see :func:`fit_lloyd`), so its result does not depend on summation order.

Calibrated codebooks are checked when the policy is built (:func:`check_codebooks`: finite,
within ``[-1, 1]``, non-decreasing, ``2**bits`` float16 values per layer), so a stream names
them through its policy and its policy id. Decoding validates a transmitted codebook: levels
that are not finite, lie outside ``[-1, 1]`` or are not in non-decreasing order raise
:class:`~kvtune.core.errors.CorruptStreamError` (:func:`check_levels`); a levels field of the
wrong size is a metadata section of the wrong length, which the stream reader refuses.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass
from typing import Mapping

import numpy as np
import torch

from kvtune.codecs.base import BF16_BITS, MetaField, Quantizer, Segment, param, register_quantizer
from kvtune.codecs.quantizers import (
    FP16_MAX,
    NoQuantizer,
    fp16_round_up,
    group,
    group_axis,
    ungroup,
    window_floors,
)
from kvtune.core.errors import ConfigError, CorruptStreamError

__all__ = [
    "CodebookQuantizer",
    "nf_levels",
    "nf_table",
    "fit_lloyd",
    "fit_calibrated",
    "check_codebooks",
    "lloyd_histogram",
    "lloyd_from_histogram",
    "check_levels",
    "nearest_level",
    "HIST_BINS",
    "LLOYD_ITERS",
    "MAX_BITS",
    "MAX_CODEBOOK_LAYERS",
]

HIST_BINS = 4096
"""Bins of the Lloyd fit's histogram over ``[-1, 1]`` (bin width ``2 / 4096``)."""
LLOYD_ITERS = 16
"""Lloyd iterations of :func:`fit_lloyd` (a fixed number: the fit is deterministic)."""
MAX_BITS = 8
"""Widest codebook: ``2**8`` levels."""
MAX_CODEBOOK_LAYERS = 4096
"""Most layers a calibrated ``codebooks`` table may cover (models have a few hundred at most):
the kernels give every distinct codebook a 2 KiB row (:mod:`kvtune.codecs.fastpath`), so a
forged policy cannot make a decoder allocate more than 8 MiB for them."""


# ----------------------------------------------------------------------------- NormalFloat


@functools.lru_cache(maxsize=None)
def _nf_levels64(bits: int) -> tuple[float, ...]:
    """The NF levels of ``bits`` as Python floats (computed once on the CPU, float64)."""
    half = 2 ** (bits - 1)
    # offset: between the quantile centres of 2**bits - 1 and 2**bits levels (bitsandbytes'
    # create_normal_map; 0.9677083 for 4 bits)
    offset = 0.5 * ((1 - 1 / (2 * (2**bits - 1))) + (1 - 1 / (2 * 2**bits)))
    ndtri = torch.special.ndtri
    pos = ndtri(torch.linspace(offset, 0.5, half + 1, dtype=torch.float64)[:-1])
    neg = -ndtri(torch.linspace(offset, 0.5, half, dtype=torch.float64)[:-1])
    v = torch.cat((pos, torch.zeros(1, dtype=torch.float64), neg)).sort().values
    return tuple((v / v.max()).tolist())


def nf_levels(bits: int) -> torch.Tensor:
    """NormalFloat levels of ``bits`` bits (QLoRA, arXiv 2305.14314, sec. 3.1).

    ``2**(bits-1)`` positive and ``2**(bits-1) - 1`` negative quantiles of N(0, 1) at evenly
    spaced probabilities, plus an exact zero, divided by the largest (so ``l_0 = -1`` and
    ``l_last = 1``: the extreme negative quantile mirrors the extreme positive one); for 4 bits
    the NF4 datatype of bitsandbytes.

    Args:
        bits: 2..8.

    Returns:
        float64 ``(2**bits,)``, increasing, on the CPU.

    Raises:
        ValueError: ``bits`` outside 2..8.
    """
    if not 2 <= bits <= MAX_BITS:
        raise ValueError(f"NF levels exist for 2..{MAX_BITS} bits, not {bits}")
    return torch.tensor(_nf_levels64(bits), dtype=torch.float64)


@functools.lru_cache(maxsize=1)
def nf_table() -> np.ndarray:
    """float64 ``(MAX_BITS + 1, 2**MAX_BITS)``: row ``b`` holds :func:`nf_levels` of ``b`` bits
    (``b >= 2``) in its first ``2**b`` entries, zeros elsewhere. What the compiled kernels get."""
    table = np.zeros((MAX_BITS + 1, 2**MAX_BITS), np.float64)
    for b in range(2, MAX_BITS + 1):
        table[b, : 2**b] = nf_levels(b).numpy()
    table.setflags(write=False)
    return table


# ----------------------------------------------------------------------------- Lloyd-Max


def lloyd_histogram(u: torch.Tensor) -> torch.Tensor:
    """int64 ``(HIST_BINS,)`` counts of normalised values ``u`` (float32, any shape) in
    :data:`HIST_BINS` equal bins over ``[-1, 1]``: bin ``clamp(floor((u + 1) * 2048), 0, 4095)``
    (float32 arithmetic; values beyond ``[-1, 1]`` land in the end bins)."""
    b = ((u.reshape(-1).to(torch.float32) + 1.0) * (HIST_BINS / 2)).floor_().clamp_(0, HIST_BINS - 1)
    return torch.bincount(b.to(torch.int64), minlength=HIST_BINS)


def lloyd_from_histogram(counts: torch.Tensor, init: torch.Tensor, iters: int = LLOYD_ITERS) -> torch.Tensor:
    """Lloyd-Max levels of a histogram (1-D k-means of the bin centres, weighted by the counts).

    Bin ``b``'s centre is ``c_b = (2b + 1 - B) / B`` (``B`` = :data:`HIST_BINS`). Each
    iteration assigns every bin to its nearest level -- bin ``b`` to the number of midpoints
    ``m_k = (l_k + l_{k+1}) / 2`` below ``c_b``, the rule the quantizer applies to values -- and
    moves each inner level to the mean centre of its bins (a level without bins stays). The
    first and last level stay where ``init`` puts them (``-1`` and ``1`` in :func:`fit_lloyd`):
    the group extremes, on which KV outliers sit, keep decoding exactly as on a uniform grid
    (measured on SmolLM2: with free end levels the fitted codebook loses accuracy against
    ``uniform``, ``benchmarks/results/nonuniform_free_ends.md``). Sums are exact
    int64 prefix sums of ``counts * (2b + 1 - B)``; each mean is one float64 division, so the
    result is the same on every device and in every summation order. Levels stay sorted.

    Args:
        counts: int64 ``(HIST_BINS,)``.
        init: float64 ``(L,)`` sorted starting levels (the NF levels in :func:`fit_lloyd`).
        iters: number of iterations.

    Returns:
        float64 ``(L,)`` levels on ``counts``' device.
    """
    dev = counts.device
    nb = HIST_BINS
    k = torch.arange(nb, dtype=torch.int64, device=dev) * 2 + 1 - nb
    centres = k.to(torch.float64) / nb
    zero = torch.zeros(1, dtype=torch.int64, device=dev)
    cw = torch.cat((zero, torch.cumsum(counts, 0)))
    cs = torch.cat((zero, torch.cumsum(counts * k, 0)))
    end = torch.full((1,), nb, dtype=torch.int64, device=dev)
    lev = init.to(device=dev, dtype=torch.float64)
    inner = torch.ones_like(lev, dtype=torch.bool)
    inner[[0, -1]] = False
    for _ in range(iters):
        mids = (lev[:-1] + lev[1:]) / 2
        bounds = torch.cat((zero, torch.searchsorted(centres, mids, right=True), end))
        w = cw[bounds[1:]] - cw[bounds[:-1]]
        s = cs[bounds[1:]] - cs[bounds[:-1]]
        lev = torch.where(inner & (w > 0), s.to(torch.float64) / w.to(torch.float64) / nb, lev)
    return lev


def fit_lloyd(u: torch.Tensor, bits: int) -> torch.Tensor:
    """The float16 Lloyd-Max codebook of normalised values ``u`` (KVQuant, arXiv 2401.18079,
    sec. 3.3: non-uniform datatypes fitted to the data).

    :func:`lloyd_histogram` of ``u``, then :data:`LLOYD_ITERS` iterations of
    :func:`lloyd_from_histogram` from the NF levels (whose end levels -1 and 1 stay), rounded
    float64 -> float32 -> float16.
    One pass over ``u``; the iterations run on 4096 bins whatever the size of ``u``.

    Args:
        u: float32 values in ``[-1, 1]``, any shape (empty: the NF levels).
        bits: 2..8.

    Returns:
        float16 ``(2**bits,)`` non-decreasing levels in ``[-1, 1]``, on ``u``'s device.
    """
    lev = lloyd_from_histogram(lloyd_histogram(u), nf_levels(bits))
    return lev.to(torch.float32).to(torch.float16)


def fit_calibrated(counts: torch.Tensor, bits: int) -> tuple[float, ...]:
    """The calibrated codebook of a layer: :func:`fit_lloyd` on a histogram pooled over
    calibration contexts (KVQuant, arXiv 2401.18079, sec. 3.3: datatypes fitted offline).

    Args:
        counts: int64 ``(HIST_BINS,)``, the sum of :func:`lloyd_histogram` over the layer's
            calibration blocks (:meth:`CodebookQuantizer.block_histogram`); all zeros gives the
            NF levels.
        bits: 2..8.

    Returns:
        ``2**bits`` non-decreasing float16 values in ``[-1, 1]`` as Python floats (what
        ``codebooks[layer]`` holds), the end levels ``-1`` and ``1``, no negative zero.
    """
    lev = lloyd_from_histogram(counts.cpu(), nf_levels(bits))
    return tuple(v + 0.0 for v in lev.to(torch.float32).to(torch.float16).to(torch.float64).tolist())  # -0.0 -> 0.0


def check_codebooks(codebooks: object, bits: int) -> tuple[tuple[float, ...], ...]:
    """Validate calibrated codebooks (:attr:`CodebookQuantizer.codebooks`) and return them as
    tuples of floats, a negative zero made ``0.0`` (the two would be one codebook to a
    hash or an equality test, yet decode to different bits).

    Args:
        codebooks: per layer, a sequence of ``2**bits`` numbers (at most
            :data:`MAX_CODEBOOK_LAYERS` layers).
        bits: the quantizer's width.

    Raises:
        ConfigError: not a sequence of sequences of numbers; more layers than
            :data:`MAX_CODEBOOK_LAYERS`; a layer with another number of levels; a level that
            is not finite (or an integer beyond the float range), lies outside ``[-1, 1]``, is
            not a float16 value, or is below the level before it. The message names the layer
            and level.
    """
    if not isinstance(codebooks, (tuple, list)):
        raise ConfigError(f"codebooks must be a list of per-layer lists of levels, got {type(codebooks).__name__}")
    if len(codebooks) > MAX_CODEBOOK_LAYERS:
        raise ConfigError(f"codebooks cover {len(codebooks)} layers; at most {MAX_CODEBOOK_LAYERS}")
    out = []
    for i, row in enumerate(codebooks):
        if not isinstance(row, (tuple, list)) or len(row) != 2**bits:
            raise ConfigError(f"codebooks[{i}] must be a list of {2**bits} levels ({bits} bits), got {str(row)[:80]}")
        if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in row):
            raise ConfigError(f"codebooks[{i}] must hold numbers, got {str(row)[:80]}")
        for k, v in enumerate(row):
            if isinstance(v, int) and not -1 <= v <= 1:  # before float(): a huge int overflows it
                raise ConfigError(f"codebooks[{i}][{k}] is {str(v)[:40]}: levels must be float16 values within [-1, 1]")
        vals = tuple(float(v) + 0.0 for v in row)
        for k, v in enumerate(vals):
            if not -1.0 <= v <= 1.0 or float(np.float16(v)) != v:
                raise ConfigError(f"codebooks[{i}][{k}] is {v!r}: levels must be float16 values within [-1, 1]")
            if k and v < vals[k - 1]:
                raise ConfigError(f"codebooks[{i}][{k}] ({v!r}) is below level {k - 1} ({vals[k - 1]!r}): levels must be sorted")
        out.append(vals)
    return tuple(out)


def check_levels(levels: torch.Tensor) -> None:
    """Refuse a codebook read from a stream that would decode garbage.

    Args:
        levels: float16 or float32 ``(L,)``.

    Raises:
        CorruptStreamError: a level is NaN / inf or outside ``[-1, 1]``, or the levels decrease;
            the message names the first bad level.
    """
    lv = levels.to(torch.float32)
    bad = ~(lv.abs() <= 1)  # NaN fails too
    if bool(bad.any()):
        i = int(torch.nonzero(bad)[0])
        raise CorruptStreamError(f"codebook level {i} is {float(lv[i])!r}: levels must be finite and within [-1, 1]")
    down = lv[1:] < lv[:-1]
    if bool(down.any()):
        i = int(torch.nonzero(down)[0]) + 1
        raise CorruptStreamError(f"codebook level {i} ({float(lv[i])!r}) is below level {i - 1} ({float(lv[i - 1])!r}): "
                                 f"levels must be sorted")


def nearest_level(u: torch.Tensor, levels: torch.Tensor) -> torch.Tensor:
    """uint8 index of the nearest level of sorted float32 ``levels`` for every float32 ``u``:
    the number of midpoints ``(l_k + l_{k+1}) * 0.5`` (float32) strictly below ``u`` (a value on
    a midpoint takes the lower level)."""
    mids = (levels[:-1] + levels[1:]) * 0.5
    return torch.searchsorted(mids, u.contiguous()).to(torch.uint8)


# ----------------------------------------------------------------------------- the quantizer


def _meta_shape(shape: tuple[int, ...], granularity: str, group_size: int) -> tuple[int, tuple[int, ...]]:
    """``(axis, shape of one per-group metadata field)`` of a block of ``shape``."""
    axis = group_axis(granularity) % len(shape)
    n = shape[axis]
    g = group_size or n
    num_groups = -(-n // g) if g else 0
    return axis, tuple(shape[:axis]) + (num_groups,) + tuple(shape[axis + 1 :])


@register_quantizer("codebook")
@dataclass(frozen=True)
class CodebookQuantizer(Quantizer):
    """Nearest-level quantization to a non-uniform codebook, per group (module docstring).

    Block kernel: normalise each group (``absmax``: ``u = x / scale``; ``minmax``:
    ``u = (x - zero) / scale``; float32 division, ``u = 0`` where ``scale == 0``), code ``u`` as
    :func:`nearest_level` of the codebook (NF: :func:`nf_levels` rounded to float32; Lloyd:
    :func:`fit_lloyd` of the block's ``u``; calibrated: the layer's ``codebooks`` entry, which
    :meth:`plan` puts into the block coder), decode ``levels[q] * scale`` (``+ zero``: a multiply,
    then an add).

    Metadata of a block of shape ``(B, H, T, D)`` (wire order): ``levels`` float16
    ``(2**bits,)`` (Lloyd only), ``scale`` float16 and (``minmax``) ``zero`` float16 of the
    shape of the ``uniform`` quantizer's (per_token: ``(B, H, T, ceil(D/g))``; per_channel:
    ``(B, H, ceil(T/g), D)``).

    Windows: the first ``sink_tokens`` and last ``recent_tokens`` tokens travel as bfloat16 in
    their own segment (KIVI's residual window, arXiv 2402.02750); the codebook is fitted on the
    quantized segment only.

    Range: values must lie within +-65504 (float16 scales and zero points);
    :meth:`~kvtune.codecs.base.Quantizer.quantize` refuses others with
    :class:`~kvtune.core.errors.KVInputError`.

    Args:
        bits: bits per symbol, 2..8 (``2**bits`` levels).
        levels: ``"lloyd"`` (fitted, sent per block; default), ``"nf"`` (NormalFloat,
            data-free) or ``"calibrated"`` (fitted offline per layer, in ``codebooks``).
        normalize: ``"minmax"`` (scale and zero point; default) or ``"absmax"`` (scale).
            The defaults are the measured best on SmolLM2's KV
            (``benchmarks/results/nonuniform.md``: 3-bit Lloyd / min-max 100.0 % relative
            accuracy against 99.0 % for KIVI's uniform grid at the same size; absmax and NF
            lose accuracy).
        granularity: ``"per_token"`` (groups along head_dim) or ``"per_channel"`` (along tokens).
        group_size: elements per group along the axis; 0 = the whole axis.
        sink_tokens, recent_tokens: first / last tokens kept in bfloat16.
        codebooks: with ``levels="calibrated"``, per layer (absolute index) the ``2**bits``
            float16 levels of :func:`fit_calibrated`, filled in by
            :meth:`kvtune.codecs.PolicyConfig.with_codebooks`; empty until then (planning a
            tensor raises :class:`ConfigError`).

    Raises:
        ConfigError: on construction, a parameter out of range, or ``codebooks`` that
            :func:`check_codebooks` refuses or that come without ``levels="calibrated"``; when
            planning, a calibrated quantizer without a codebook for the layer.
        CorruptStreamError: on decode, a Lloyd codebook that :func:`check_levels` refuses.
    """

    bits: int = param(3, low=2, high=MAX_BITS, doc="bits per symbol")
    levels: str = param("lloyd", choices=("nf", "lloyd", "calibrated"),
                        doc="codebook: NormalFloat, Lloyd-Max fitted per block, or calibrated per layer")
    normalize: str = param("minmax", choices=("absmax", "minmax"), doc="group normalisation")
    granularity: str = param("per_token", choices=("per_token", "per_channel"), doc="grouping axis")
    group_size: int = param(32, low=0, high=2**31 - 1, doc="elements per group along the axis, 0 = whole axis")
    sink_tokens: int = param(0, low=0, doc="first tokens kept in bfloat16", elide_default=True)
    recent_tokens: int = param(0, low=0, doc="last tokens kept in bfloat16", elide_default=True)
    codebooks: tuple = param((), doc="calibrated float16 levels per layer (levels='calibrated')", elide_default=True)

    def validate(self) -> None:
        if self.codebooks and self.levels != "calibrated":
            raise ConfigError(f"quantizer 'codebook': parameter 'codebooks' goes with levels='calibrated', not {self.levels!r}")
        try:
            object.__setattr__(self, "codebooks", check_codebooks(self.codebooks, self.bits))
        except ConfigError as exc:
            raise ConfigError(f"quantizer 'codebook': parameter 'codebooks': {exc}") from None

    @property
    def symbol_bits(self) -> int:
        return self.bits

    # ------------------------------------------------------------------ calibration

    @property
    def needs_codebooks(self) -> bool:
        """True for ``levels="calibrated"`` without codebooks yet."""
        return self.levels == "calibrated" and not self.codebooks

    def with_codebooks(self, codebooks) -> "CodebookQuantizer":
        """A copy with calibrated ``codebooks`` (per layer, ``2**bits`` float16 levels; nested
        lists, or a ``(layers, 2**bits)`` tensor or array).

        Raises:
            ConfigError: no layers, codebooks that :func:`check_codebooks` refuses, or a
                quantizer whose levels are not ``"calibrated"``.
        """
        if hasattr(codebooks, "tolist"):  # a (layers, 2**bits) tensor or array
            codebooks = codebooks.tolist()
        if isinstance(codebooks, (tuple, list)) and not codebooks:
            raise ConfigError("with_codebooks: codebooks for 0 layers")
        return dataclasses.replace(self, codebooks=codebooks)

    def calibration_segments(self, shape, *, layer: int, kind: str,
                             min_bits: torch.Tensor | None = None) -> tuple[Segment, ...]:
        """The segments of a tensor's plan whose :meth:`block_histogram` s make the layer's
        calibrated codebook: those of width :attr:`bits` (the others are bfloat16 windows or
        NF blocks). Their coders hold no levels: for histograms only."""
        return tuple(s for s in super().plan(shape, layer=layer, kind=kind, min_bits=min_bits)
                     if type(s.coder) is CodebookQuantizer and s.coder.levels == "calibrated")

    @property
    def value_limit(self) -> float:
        """65504: the float16 range of ``scale`` (and ``zero``)."""
        return FP16_MAX

    # ------------------------------------------------------------------ plan

    def coder(self, bits: int) -> Quantizer:
        """Block quantizer of width ``bits``: this codebook and grouping without windows, or
        bfloat16 for 16."""
        if bits == BF16_BITS:
            return NoQuantizer()
        if not 2 <= bits <= MAX_BITS:
            raise ValueError(f"quantizer 'codebook' has no {bits}-bit block kernel")
        levels = "nf" if self.levels == "calibrated" and bits != self.bits else self.levels
        return CodebookQuantizer(bits=bits, levels=levels, normalize=self.normalize,
                                 granularity=self.granularity, group_size=self.group_size)

    def plan(self, shape, *, layer: int, kind: str, min_bits: torch.Tensor | None = None) -> tuple[Segment, ...]:
        """:meth:`Quantizer.plan`; with calibrated levels, the blocks of width :attr:`bits` get a
        coder holding ``codebooks[layer]`` (a one-entry ``codebooks``).

        Raises:
            ConfigError: calibrated levels without codebooks, or codebooks that do not cover
                ``layer``.
        """
        segments = super().plan(shape, layer=layer, kind=kind, min_bits=min_bits)
        if self.levels != "calibrated":
            return segments
        if not self.codebooks:
            raise ConfigError("codebook levels='calibrated' need codebooks from a calibration pass "
                              "(kvtune.evaluate.calibrate_codebook.calibrate_codebooks), set with PolicyConfig.with_codebooks; "
                              "this policy has none")
        if not 0 <= layer < len(self.codebooks):
            raise ConfigError(f"calibrated codebooks cover layers 0..{len(self.codebooks) - 1}; got layer {layer}")
        coder = dataclasses.replace(self.coder(self.bits), codebooks=(self.codebooks[layer],))
        return tuple(dataclasses.replace(s, coder=coder) if s.bits == self.bits and type(s.coder) is CodebookQuantizer
                     else s for s in segments)

    def window_min_bits(self, tokens: int) -> torch.Tensor | None:
        """16 on the sink and recent windows (:func:`~kvtune.codecs.quantizers.window_floors`)."""
        return window_floors(tokens, self.sink_tokens, self.recent_tokens)

    def window_widths(self) -> tuple[int, ...]:
        return (BF16_BITS,) if (self.sink_tokens or self.recent_tokens) else ()

    # ------------------------------------------------------------------ block kernel

    def block_meta_layout(self, shape: tuple[int, ...]) -> tuple[MetaField, ...]:
        """``levels`` (Lloyd), ``scale`` and (minmax) ``zero``, float16 (class docstring)."""
        _, meta_shape = _meta_shape(tuple(shape), self.granularity, self.group_size)
        out = (MetaField("levels", (2**self.bits,), torch.float16),) if self.levels == "lloyd" else ()
        out += (MetaField("scale", meta_shape, torch.float16),)
        if self.normalize == "minmax":
            out += (MetaField("zero", meta_shape, torch.float16),)
        return out

    def quantize_block(self, x: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """uint8 symbols of ``x.shape`` and the float16 metadata of :meth:`block_meta_layout`.

        Raises:
            ConfigError: a calibrated block coder without its layer's levels (use :meth:`plan`).
        """
        shape = tuple(x.shape)
        x = x.to(torch.float32)
        if x.numel() == 0:
            meta = {f.name: torch.zeros(f.shape, dtype=f.dtype, device=x.device) for f in self.block_meta_layout(shape)}
            if self.levels == "lloyd":
                meta["levels"] = fit_lloyd(x, self.bits)
            return torch.zeros(shape, dtype=torch.uint8, device=x.device), meta
        u, meta = self._normalized(x)
        if self.levels == "lloyd":
            meta["levels"] = fit_lloyd(u, self.bits)
        return nearest_level(u, self._levels32(meta, x.device)).contiguous(), meta

    def block_histogram(self, x: torch.Tensor) -> torch.Tensor:
        """int64 ``(HIST_BINS,)``: :func:`lloyd_histogram` of the normalised values of a block
        ``x`` (float32 ``(batch, heads, tokens, head_dim)``), the statistic a calibrated codebook
        is fitted on (:func:`fit_calibrated`)."""
        if x.numel() == 0:
            return torch.zeros(HIST_BINS, dtype=torch.int64)
        return lloyd_histogram(self._normalized(x.to(torch.float32))[0]).cpu()

    def _normalized(self, x: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """float32 ``u`` of ``x.shape`` (non-empty) and the float16 ``scale`` (and ``zero``)."""
        shape = tuple(x.shape)
        axis, _ = _meta_shape(shape, self.granularity, self.group_size)
        xg = group(x, axis, self.group_size)
        red = axis + 1
        if self.normalize == "absmax":
            scale16 = fp16_round_up(xg.abs().amax(dim=red))
            meta = {"scale": scale16}
            centred = xg
        else:
            lo, hi = torch.aminmax(xg, dim=red)
            zero16 = ((lo + hi) * 0.5).to(torch.float16)
            zero16 = torch.where(zero16 == 0, torch.zeros_like(zero16), zero16)  # canonical +0
            zero = zero16.to(torch.float32)
            scale16 = fp16_round_up(torch.maximum(hi - zero, zero - lo))
            scale16 = torch.where(scale16 > 0, scale16, torch.zeros_like(scale16))  # canonical +0
            meta = {"scale": scale16, "zero": zero16}
            centred = xg - zero.unsqueeze(red)
        scale = scale16.to(torch.float32).unsqueeze(red)
        u = torch.where(scale > 0, centred / scale, torch.zeros_like(centred))
        return ungroup(u, axis, shape[axis]), meta

    def _levels32(self, meta: Mapping[str, torch.Tensor], device: torch.device) -> torch.Tensor:
        """float32 codebook of a block: its ``levels`` field, the layer's calibrated levels, or
        the NF levels."""
        if self.levels == "lloyd":
            return meta["levels"].to(torch.float32)
        if self.levels == "calibrated":
            if len(self.codebooks) != 1:
                raise ConfigError("a calibrated codebook block needs its layer's levels: take the block coders "
                                  "from CodebookQuantizer.plan (after PolicyConfig.with_codebooks)")
            return torch.tensor(self.codebooks[0], dtype=torch.float32, device=device)
        return nf_levels(self.bits).to(torch.float32).to(device)

    def dequantize_block(self, symbols: torch.Tensor, meta, shape: tuple[int, ...]) -> torch.Tensor:
        """Float32 reconstruction of ``shape``: ``levels[q] * scale`` (+ ``zero``).

        Raises:
            CorruptStreamError: a Lloyd ``levels`` field that :func:`check_levels` refuses.
        """
        shape = tuple(shape)
        if self.levels == "lloyd":
            check_levels(meta["levels"])
        if math.prod(shape) == 0:
            return torch.zeros(shape, dtype=torch.float32, device=symbols.device)
        axis, _ = _meta_shape(shape, self.granularity, self.group_size)
        red = axis + 1
        lev = self._levels32(meta, symbols.device)
        qg = group(symbols.reshape(shape), axis, self.group_size)
        xg = lev[qg.to(torch.int64)] * meta["scale"].to(torch.float32).unsqueeze(red)
        if self.normalize == "minmax":
            xg = meta["zero"].to(torch.float32).unsqueeze(red) + xg
        return ungroup(xg, axis, shape[axis]).contiguous()

    def short_label(self) -> str:
        """``cb{bits}{nf|ll|cl}[m]/{tok|ch}[/g{group_size}][/s{sink}][/r{recent}]``, e.g.
        ``cb3ll/ch/g32/r128`` (``m``: minmax normalisation; ``cl``: calibrated levels, which are
        in :attr:`policy_id`, not in the label)."""
        gran = "tok" if self.granularity == "per_token" else "ch"
        grp = f"/g{self.group_size}" if self.group_size else ""
        win = (f"/s{self.sink_tokens}" if self.sink_tokens else "") + (f"/r{self.recent_tokens}" if self.recent_tokens else "")
        norm = "m" if self.normalize == "minmax" else ""
        lev = {"nf": "nf", "lloyd": "ll", "calibrated": "cl"}[self.levels]
        return f"cb{self.bits}{lev}{norm}/{gran}{grp}{win}"
