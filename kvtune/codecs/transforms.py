"""Transforms T: invertible maps applied to K and V before quantization (brief, sec. 2).

* ``identity``: does nothing (the "no transform" point of the search space).
* ``hadamard``: randomized orthonormal Walsh-Hadamard rotation along ``head_dim``, as in
  QuaRot (Ashkboos et al., 2024, "QuaRot: Outlier-Free 4-Bit Inference in Rotated LLMs",
  sec. 3) and QuIP# (Tseng et al., 2024): ``y = (x * s) @ H`` with random +-1 signs ``s``
  and the Sylvester Hadamard matrix ``H`` scaled by ``1/sqrt(n)``. The rotation spreads
  outlier channels over all channels, which makes per-token quantization far more accurate.
"""

from __future__ import annotations

import functools
import hashlib
import math
from dataclasses import dataclass

import torch

from kvtune.codecs.base import Transform, param, register_transform

__all__ = [
    "Identity",
    "Hadamard",
    "power_of_two_blocks",
    "hadamard_matrix",
    "block_hadamard_matrix",
    "random_signs",
]

_KINDS = ("key", "value")


@register_transform("identity")
@dataclass(frozen=True)
class Identity(Transform):
    """The identity transform: ``forward(x) = inverse(x) = x`` (no parameters)."""

    def forward(self, x: torch.Tensor, *, layer: int, kind: str) -> torch.Tensor:
        """Return ``x`` unchanged (float32 ``(batch, kv_heads, tokens, head_dim)``)."""
        return x

    def inverse(self, y: torch.Tensor, *, layer: int, kind: str) -> torch.Tensor:
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


def rotate(x: torch.Tensor, signs: torch.Tensor, matrix: torch.Tensor) -> torch.Tensor:
    """``(x * signs[h]) @ matrix`` for ``x`` ``(batch, heads, tokens, dim)``, signs ``(heads, dim)``."""
    return torch.matmul(x * signs[None, :, None, :], matrix)


def unrotate(y: torch.Tensor, signs: torch.Tensor, matrix: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`rotate` for a symmetric orthonormal ``matrix``: ``(y @ matrix) * signs``."""
    return torch.matmul(y, matrix) * signs[None, :, None, :]


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

    Implemented as one dense matmul with a cached ``(head_dim, head_dim)`` matrix
    (``O(head_dim**2)`` per row, but a single BLAS call: ~0.3 ms for a ``(1, 3, 1024, 64)``
    tensor on a 2-core CPU; fine for ``head_dim <= 256``).

    Args:
        seed: integer >= 0 selecting the random signs.
    """

    seed: int = param(0, low=0, doc="seed of the random +-1 signs")

    def _parts(self, x: torch.Tensor, layer: int, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
        if kind not in _KINDS:
            raise ValueError(f"kind must be 'key' or 'value', got {kind!r}")
        if x.dim() != 4:
            raise ValueError(f"expected (batch, kv_heads, tokens, head_dim), got shape {tuple(x.shape)}")
        heads, dim = x.shape[1], x.shape[3]
        return random_signs(self.seed, int(layer), kind, heads, dim), block_hadamard_matrix(dim)

    def forward(self, x: torch.Tensor, *, layer: int, kind: str) -> torch.Tensor:
        """Rotate float32 ``(batch, kv_heads, tokens, head_dim)`` ``x``; returns the same shape."""
        if x.shape[-1] == 0:
            return x
        signs, matrix = self._parts(x, layer, kind)
        return rotate(x, signs, matrix)

    def inverse(self, y: torch.Tensor, *, layer: int, kind: str) -> torch.Tensor:
        """Undo :meth:`forward` (``H`` is symmetric and orthonormal, signs square to one)."""
        if y.shape[-1] == 0:
            return y
        signs, matrix = self._parts(y, layer, kind)
        return unrotate(y, signs, matrix)
