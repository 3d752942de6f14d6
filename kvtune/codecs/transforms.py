"""Transforms T: invertible maps applied to K and V before quantization.

T is the first stage of the T -> Q -> C pipeline (:mod:`kvtune.codecs.base`; KVServe, arXiv
2605.13734).

* ``identity``: does nothing (the "no transform" point of the search space).
* ``hadamard``: randomized orthonormal Walsh-Hadamard rotation along ``head_dim``, as in
  QuaRot (Ashkboos et al., 2024, "QuaRot: Outlier-Free 4-Bit Inference in Rotated LLMs",
  sec. 3) and QuIP# (Tseng et al., 2024): ``y = (x * s) @ H`` with random +-1 signs ``s``
  and the Sylvester Hadamard matrix ``H`` scaled by ``1/sqrt(n)``. The rotation spreads
  outlier channels over all channels, which makes per-token quantization far more accurate.
* ``delta``: delta coding along tokens in groups (CacheGen, Liu et al., SIGCOMM'24, sec. 5.1):
  the first token of each group of ``group_size`` is the anchor, the others are stored as
  differences from it; nearby tokens are similar, so the deltas have a smaller range. The
  anchors may be coded with more bits than the deltas (``anchor_bits``).
* ``affine``: per-(layer, head, channel) scale (and optional shift) calibrated on the tensor
  being encoded (SmoothQuant, Xiao et al. 2023; KVQuant, Hooper et al. 2024, sec. 3): outlier
  channels are divided down so they stop dominating per-token quantization ranges. The scale
  and shift travel in the stream as float16 transform state.

Transforms compose in order (e.g. ``affine`` then ``hadamard``); the decoder inverts them in
reverse order with the state read from the stream.
"""

from __future__ import annotations

import functools
import hashlib
import math
from dataclasses import dataclass

from typing import Mapping

import numpy as np
import torch

from kvtune.codecs.base import BF16_BITS, MetaField, Transform, param, register_transform
from kvtune.codecs.quantizers import FP16_MAX, div_exact

__all__ = [
    "Identity",
    "Hadamard",
    "Delta",
    "Affine",
    "delta_encode",
    "delta_decode",
    "anchor_mask",
    "channel_stats",
    "power_of_two_blocks",
    "hadamard_matrix",
    "block_hadamard_matrix",
    "random_signs",
    "block_scales",
    "walsh_hadamard",
    "rotate",
    "unrotate",
]

_KINDS = ("key", "value")


@register_transform("identity")
@dataclass(frozen=True)
class Identity(Transform):
    """The identity transform: ``forward(x) = inverse(x) = x`` (no parameters)."""

    def forward(self, x: torch.Tensor, *, layer: int, kind: str, state=None) -> torch.Tensor:
        """Return ``x`` unchanged (float32 ``(batch, kv_heads, tokens, head_dim)``)."""
        return x

    def inverse(self, y: torch.Tensor, *, layer: int, kind: str, state=None) -> torch.Tensor:
        """Return ``y`` unchanged."""
        return y

    @property
    def is_identity(self) -> bool:
        return True


# ----------------------------------------------------------------------------- pure math


def power_of_two_blocks(n: int) -> tuple[int, ...]:
    """Split ``n`` into decreasing powers of two (its binary expansion): 96 -> (64, 32).

    A Hadamard matrix exists for every power-of-two size, so a block-diagonal matrix of these
    blocks is an orthonormal rotation of any dimension ``n`` (a size-1 block is ``[1]``).
    """
    if n < 0:
        raise ValueError(f"dimension must be >= 0, got {n}")
    return tuple(1 << b for b in reversed(range(n.bit_length())) if n >> b & 1)


@functools.lru_cache(maxsize=32)
def hadamard_matrix(n: int) -> torch.Tensor:
    """Orthonormal Sylvester-Walsh-Hadamard matrix of size ``n`` (a power of two), float32.

    ``H[i, j] = (-1)**popcount(i & j) / sqrt(n)``; ``H`` is symmetric and ``H @ H = I``.
    """
    if n <= 0 or n & (n - 1):
        raise ValueError(f"Hadamard size must be a power of two, got {n}")
    idx = torch.arange(n)
    and_bits = idx[:, None] & idx[None, :]
    parity = torch.zeros_like(and_bits)
    for b in range(max(n.bit_length() - 1, 0)):  # log2(n) iterations, not per element
        parity ^= (and_bits >> b) & 1
    return ((1 - 2 * parity).to(torch.float64) / math.sqrt(n)).to(torch.float32)


@functools.lru_cache(maxsize=32)
def block_hadamard_matrix(n: int) -> torch.Tensor:
    """Block-diagonal orthonormal Hadamard matrix ``(n, n)`` float32 for any ``n >= 1``.

    Blocks are :func:`power_of_two_blocks` of ``n`` (e.g. 96 = 64 + 32). The result is
    symmetric and its own inverse.
    """
    return torch.block_diag(*(hadamard_matrix(b) for b in power_of_two_blocks(n)))


@functools.lru_cache(maxsize=1024)
def random_signs(seed: int, layer: int, kind: str, heads: int, dim: int) -> torch.Tensor:
    """Deterministic random +-1 signs ``(heads, dim)`` float32 for one (layer, kind).

    Bits come from SHAKE-256 of ``"kvtune/hadamard/{seed}/{layer}/{kind}/{head}"``, so they
    are identical on every machine and library version (the decoder re-derives them from the
    stream header alone).
    """
    rows = []
    for head in range(heads):  # per head, not per element
        digest = hashlib.shake_256(f"kvtune/hadamard/{seed}/{layer}/{kind}/{head}".encode()).digest((dim + 7) // 8)
        bits = torch.frombuffer(bytearray(digest), dtype=torch.uint8)
        rows.append(((bits[:, None] >> torch.arange(8, dtype=torch.uint8)) & 1).reshape(-1)[:dim])
    if not rows:
        return torch.ones(0, dim)
    return 1.0 - 2.0 * torch.stack(rows).to(torch.float32)


def block_scales(n: int) -> tuple[float, ...]:
    """float32 ``1/sqrt(b)`` of every :func:`power_of_two_blocks` block ``b`` of ``n`` (the
    entries of :func:`block_hadamard_matrix`, so both descriptions give the same constants)."""
    return tuple(float(np.float32(1.0 / math.sqrt(b))) for b in power_of_two_blocks(n))


def walsh_hadamard(x: torch.Tensor) -> torch.Tensor:
    """Orthonormal block Walsh-Hadamard transform along the last axis, by butterflies.

    For each :func:`power_of_two_blocks` block of size ``n``: ``log2(n)`` stages with strides
    1, 2, 4, ..., n/2, each replacing every pair ``(a, b)`` by ``(a + b, a - b)``; then one
    multiply by float32 ``1/sqrt(n)``. Equal to ``x @ block_hadamard_matrix(d)`` in exact
    arithmetic; in float32 every element goes through the same fixed sequence of roundings, so
    the result is identical on every machine (a BLAS matmul sums in an order that depends on
    the library and the CPU). ``O(d log d)`` per row. The compiled kernel
    :func:`kvtune.codecs.kernels.hadamard_rows` performs the same operations.
    """
    d = x.shape[-1]
    lead = x.shape[:-1]
    parts = []
    offset = 0
    for n, c in zip(power_of_two_blocks(d), block_scales(d)):
        y = x[..., offset : offset + n]
        step = 1
        while step < n:
            y = y.reshape(*lead, n // (2 * step), 2, step)
            a, b = y[..., 0, :], y[..., 1, :]
            y = torch.stack((a + b, a - b), dim=-2)
            step *= 2
        parts.append(y.reshape(*lead, n) * c)
        offset += n
    return torch.cat(parts, dim=-1) if len(parts) != 1 else parts[0]


def rotate(x: torch.Tensor, signs: torch.Tensor) -> torch.Tensor:
    """``walsh_hadamard(x * signs[h])`` for ``x`` ``(batch, heads, tokens, dim)``, signs ``(heads, dim)``."""
    return walsh_hadamard(x * signs[None, :, None, :])


def unrotate(y: torch.Tensor, signs: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`rotate` (the block Hadamard matrix is symmetric and orthonormal):
    ``walsh_hadamard(y) * signs``."""
    return walsh_hadamard(y) * signs[None, :, None, :]


# ----------------------------------------------------------------------------- component


@register_transform("hadamard")
@dataclass(frozen=True)
class Hadamard(Transform):
    """Randomized orthonormal Hadamard rotation along ``head_dim`` (QuaRot, Ashkboos et al. 2024).

    ``forward(x)[b, h, t, :] = (x[b, h, t, :] * s[h]) @ H`` where ``s[h]`` are +-1 signs drawn
    per (``seed``, layer, kind, head) by :func:`random_signs` and ``H`` is the block-diagonal
    orthonormal Walsh-Hadamard matrix of :func:`block_hadamard_matrix` (blocks of powers of two
    when ``head_dim`` is not one, e.g. 96 = 64 + 32). The map is orthonormal (norms are
    preserved) and ``inverse(forward(x)) == x`` to float32 rounding (~1e-6 relative).

    Implemented as a fast Walsh-Hadamard transform (butterflies, ``O(head_dim log head_dim)``
    per row, :func:`walsh_hadamard`), which fixes the order of every float32 operation: the
    rotated values, hence the stream bytes, are the same on every machine.

    Args:
        seed: integer >= 0 selecting the random signs.
    """

    seed: int = param(0, low=0, doc="seed of the random +-1 signs")

    def signs(self, x_shape: tuple[int, ...], layer: int, kind: str) -> torch.Tensor:
        """The float32 ``(kv_heads, head_dim)`` +-1 signs for a tensor of ``x_shape``."""
        if kind not in _KINDS:
            raise ValueError(f"kind must be 'key' or 'value', got {kind!r}")
        if len(x_shape) != 4:
            raise ValueError(f"expected (batch, kv_heads, tokens, head_dim), got shape {tuple(x_shape)}")
        return random_signs(self.seed, int(layer), kind, int(x_shape[1]), int(x_shape[3]))

    def forward(self, x: torch.Tensor, *, layer: int, kind: str, state=None) -> torch.Tensor:
        """Rotate float32 ``(batch, kv_heads, tokens, head_dim)`` ``x``; returns the same shape."""
        if x.shape[-1] == 0:
            return x
        return rotate(x, self.signs(tuple(x.shape), layer, kind))

    def inverse(self, y: torch.Tensor, *, layer: int, kind: str, state=None) -> torch.Tensor:
        """Undo :meth:`forward` (``H`` is symmetric and orthonormal, signs square to one)."""
        if y.shape[-1] == 0:
            return y
        return unrotate(y, self.signs(tuple(y.shape), layer, kind))


# ----------------------------------------------------------------------------- delta coding


def anchor_mask(tokens: int, group_size: int) -> torch.Tensor:
    """bool ``(tokens,)``: True on anchors, the first token of each group (``t % group_size == 0``)."""
    return torch.arange(tokens) % group_size == 0


def delta_encode(x: torch.Tensor, group_size: int) -> torch.Tensor:
    """Delta coding along tokens (axis 2) of ``(batch, heads, tokens, dim)`` ``x``.

    ``y[t] = x[t] - x[a(t)]`` with ``a(t) = (t // g) * g`` the group's anchor, and
    ``y[a] = x[a]`` on anchors. Vectorized: one gather, one subtraction, one strided copy.
    """
    t = x.shape[2]
    anchors = x.index_select(2, torch.arange(t, device=x.device) // group_size * group_size)
    y = x - anchors
    y[:, :, ::group_size] = x[:, :, ::group_size]
    return y


def delta_decode(y: torch.Tensor, group_size: int) -> torch.Tensor:
    """Inverse of :func:`delta_encode`: ``x[t] = y[t] + y[a(t)]``, ``x[a] = y[a]``."""
    t = y.shape[2]
    x = y + y.index_select(2, torch.arange(t, device=y.device) // group_size * group_size)
    x[:, :, ::group_size] = y[:, :, ::group_size]
    return x


@register_transform("delta")
@dataclass(frozen=True)
class Delta(Transform):
    """Delta coding along tokens in groups, anchors optionally finer (CacheGen, sec. 5.1).

    Tokens ``0, g, 2g, ...`` (``g = group_size``) are anchors and pass unchanged; every other
    token ``t`` becomes ``x[t] - x[anchor(t)]``. With ``anchor_bits > 0`` the transform asks
    the quantizer for at least that many bits on anchor tokens (16 = bfloat16, exact for
    bfloat16 input): the quantizer codes them as a separate segment
    (:meth:`~kvtune.codecs.base.Transform.token_min_bits`). With ``anchor_bits = 0`` anchors
    use the same bits as the deltas.

    Note on error: the decoder adds the *decoded* anchor to each decoded delta, so a token's
    error is its delta's error plus its anchor's error; finer anchors bound the second term.

    Cost of finer anchors (CacheGen, arXiv 2310.07240, sec. 5.1-5.2): the anchor segment is
    packed by the policy's codec like any segment. Under the ``range`` codec its few tokens per
    channel (one in ``group_size``) are coded with one pooled table when per-channel tables would
    cost more than they save (8-bit anchors of 1024 tokens: within ~1 % of the segment's pooled
    empirical entropy, see :mod:`kvtune.codecs.range_coder`), not stored raw.

    Args:
        group_size: tokens per group (CacheGen uses 10), >= 2.
        anchor_bits: 0 (same as the deltas), 1..8, or 16 (bfloat16).
    """

    group_size: int = param(10, low=2, high=2**31 - 1, doc="tokens per delta group (the first is the anchor)")
    anchor_bits: int = param(0, choices=(0, *range(1, 9), BF16_BITS), doc="min bits of anchor tokens, 0 = as deltas")

    def forward(self, x: torch.Tensor, *, layer: int, kind: str, state=None) -> torch.Tensor:
        """Anchors unchanged, other tokens minus their group's anchor (same shape)."""
        return delta_encode(x, self.group_size)

    def inverse(self, y: torch.Tensor, *, layer: int, kind: str, state=None) -> torch.Tensor:
        """Add each group's anchor back."""
        return delta_decode(y, self.group_size)

    def token_min_bits(self, tokens: int) -> torch.Tensor | None:
        """``anchor_bits`` on anchors, 0 elsewhere (``None`` when ``anchor_bits == 0``)."""
        if not self.anchor_bits:
            return None
        return anchor_mask(tokens, self.group_size).to(torch.int64) * self.anchor_bits

    def min_bits_values(self) -> tuple[int, ...]:
        return (self.anchor_bits,) if self.anchor_bits else ()

    def short_label(self) -> str:
        """``delta:g{group_size}[/a{anchor_bits}]``, e.g. ``delta:g10/a8``."""
        return f"delta:g{self.group_size}" + (f"/a{self.anchor_bits}" if self.anchor_bits else "")


# ----------------------------------------------------------------------------- affine scaling


def channel_stats(x: torch.Tensor, statistic: str, shift: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Float16 per-(head, channel) ``(scale, shift)`` of ``(batch, heads, tokens, dim)`` ``x``.

    ``shift`` (if requested) is the channel mean over batch and tokens; ``scale`` is the RMS or
    the absmax of the shifted channel. Sums are float64, accumulated in (batch, token) order
    (:func:`_ordered_sum`), so the float16 results do not depend on how a library vectorizes a
    reduction (the compiled kernel :func:`kvtune.codecs.kernels.affine_fit` matches them). Channels whose statistic is 0, not finite or below the
    float16 range (all-zero channels, empty tensors) get ``scale = 1``; scales saturate at the
    float16 maximum.

    Returns:
        ``(scale, shift)`` float16 ``(heads, dim)``; ``shift`` is ``None`` when not requested.
    """
    b, h, t, d = x.shape
    n = b * t
    cols = x.permute(1, 3, 0, 2).reshape(h, d, n)  # per (head, channel): values in (batch, token) order
    mean = None
    if shift:
        mean = div_exact(_ordered_sum(cols), max(n, 1)).to(torch.float32).clamp(-FP16_MAX, FP16_MAX).to(torch.float16)
        cols = cols - mean.to(torch.float32)[:, :, None]
    if statistic == "rms":
        stat = div_exact(_ordered_sum(cols.double().square()), max(n, 1)).sqrt().to(torch.float32)
    else:
        stat = cols.abs().amax(dim=-1) if n else torch.zeros(h, d, device=x.device)
    scale = stat.clamp(max=FP16_MAX).to(torch.float16)
    scale = torch.where((scale > 0) & torch.isfinite(scale), scale, torch.ones_like(scale))
    return scale, mean


def _ordered_sum(cols: torch.Tensor) -> torch.Tensor:
    """float64 sums over the last axis, added strictly left to right.

    On the CPU ``cumsum`` is sequential; elsewhere (a CUDA scan adds in a tree order) the
    columns are added one by one, one kernel launch per column, so that every device rounds
    the same partial sums (:mod:`kvtune.codecs.torchpath`)."""
    cols = cols.double()
    n = cols.shape[-1]
    if n == 0:
        return torch.zeros(cols.shape[:-1], dtype=torch.float64, device=cols.device)
    if cols.device.type == "cpu":
        return cols.cumsum(dim=-1)[..., -1]
    acc = cols[..., 0].clone()
    for i in range(1, n):
        acc += cols[..., i]
    return acc


@register_transform("affine")
@dataclass(frozen=True)
class Affine(Transform):
    """Per-(layer, head, channel) affine normalization calibrated on the data being encoded.

    ``forward(x)[b, h, t, c] = (x[b, h, t, c] - shift[h, c]) / scale[h, c]`` with ``scale`` the
    channel's RMS (or absmax) and ``shift`` its mean (when ``shift = True``), computed over
    batch and tokens of this layer's K or V tensor (:func:`channel_stats`) and rounded to
    float16. Outlier channels (keys have a few channels x10-x100 larger, KVQuant sec. 3.1) are
    scaled down, so they no longer set the range of per-token quantization groups.

    Range: a channel statistic beyond the float16 range saturates ``scale`` at 65504 (and
    ``shift`` at +-65504); the decoder applies the same saturated values back, so the map stays
    invertible, and a channel of values around 1e6 is divided into the range of a float16-scaled
    quantizer (whatever still exceeds the quantizer's range is refused there).

    State (in the stream, counted in its size): float16 ``scale`` and, if ``shift``, ``shift``,
    each ``(kv_heads, head_dim)``: ``2 * kv_heads * head_dim`` bytes per tensor and statistic
    (384 bytes for 3 heads x 64 channels). Encoder and decoder use the float16 values, so
    ``inverse(forward(x))`` is ``x`` up to float32 rounding.

    Args:
        statistic: ``"rms"`` or ``"absmax"``.
        shift: also subtract the per-channel mean.
    """

    statistic: str = param("rms", choices=("rms", "absmax"), doc="per-channel scale statistic")
    shift: bool = param(False, doc="also subtract the per-channel mean")

    def state_layout(self, shape, *, layer: int, kind: str) -> tuple[MetaField, ...]:
        """float16 ``scale`` (and ``shift``) of shape ``(kv_heads, head_dim)``."""
        hd = (int(shape[1]), int(shape[3]))
        names = ("scale", "shift") if self.shift else ("scale",)
        return tuple(MetaField(n, hd, torch.float16) for n in names)

    def fit(self, x: torch.Tensor, *, layer: int, kind: str) -> dict[str, torch.Tensor]:
        """Float16 ``scale`` (and ``shift``) of ``x`` (:func:`channel_stats`)."""
        scale, mean = channel_stats(x.to(torch.float32), self.statistic, self.shift)
        return {"scale": scale} if mean is None else {"scale": scale, "shift": mean}

    @staticmethod
    def _parts(state: Mapping[str, torch.Tensor] | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        if state is None or "scale" not in state:
            raise ValueError("affine needs its state: call fit() on the encoder, read it from the stream on the decoder")
        scale = state["scale"].to(torch.float32)[None, :, None, :]
        shift = state.get("shift")
        return scale, None if shift is None else shift.to(torch.float32)[None, :, None, :]

    def forward(self, x: torch.Tensor, *, layer: int, kind: str, state=None) -> torch.Tensor:
        """``(x - shift) / scale`` per (head, channel)."""
        scale, shift = self._parts(state)
        return (x if shift is None else x - shift) / scale

    def inverse(self, y: torch.Tensor, *, layer: int, kind: str, state=None) -> torch.Tensor:
        """``y * scale + shift`` per (head, channel)."""
        scale, shift = self._parts(state)
        x = y * scale
        return x if shift is None else x + shift

    def short_label(self) -> str:
        """``affine:{rms|absmax}[/shift]``."""
        return f"affine:{self.statistic}" + ("/shift" if self.shift else "")
