"""Reduced-rank ridge maps: the Reuse step of SCD (pure tensor math).

SCD ("Semantic Cache Distillation: Efficient State Transfer via Reuse and Selective Patching",
arXiv 2606.07684), "Reuse": for a layer, the consumer's K/V is reconstructed
from a low-rank projection of the producer's states, through a linear map fitted by ridge
least squares on calibration data. kvtune fits it as reduced-rank ridge regression:

    W     = argmin_W ||Xc W - Yc||^2 + lam ||W||^2 = (Xc^T Xc + lam I)^-1 Xc^T Yc
    V_r   = top-r right singular vectors of the fitted values Xc W      (d_out x r;
            eigenvectors of the d_out x d_out Gram matrix, so N does not enter the cost)
    code  = (x - mu_x) W V_r                                            (what is sent, r per token)
    y_hat = code V_r^T + mu_y                                           (consumer side)

with Xc, Yc the centred calibration inputs and targets. ``lam = ridge * trace(Xc^T Xc) / d_in``
(ridge is relative to the mean input energy, so one value suits every layer). With
``ridge = 0`` and targets that are an exact rank-r linear function of the inputs, the map is
recovered exactly; at ``r = d_out`` the map is the plain ridge solution.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvtune.core.errors import ConfigError


@dataclass
class LowRankMap:
    """A fitted rank-r affine map ``x -> ((x - mu_x) @ encoder) @ decoder + mu_y``.

    Attributes:
        mean_in: ``(d_in,)`` float32 input mean (producer side).
        encoder: ``(d_in, r)`` float32, ``W V_r`` (producer side).
        decoder: ``(r, d_out)`` float32, ``V_r^T`` (consumer side).
        mean_out: ``(d_out,)`` float32 target mean (consumer side).
    """

    mean_in: torch.Tensor
    encoder: torch.Tensor
    decoder: torch.Tensor
    mean_out: torch.Tensor

    @property
    def rank(self) -> int:
        return int(self.encoder.shape[1])

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """``(..., d_in)`` -> ``(..., r)`` code (dtype of ``x``)."""
        return (x - self.mean_in.to(x.dtype)) @ self.encoder.to(x.dtype)

    def decode(self, code: torch.Tensor) -> torch.Tensor:
        """``(..., r)`` -> ``(..., d_out)`` reconstruction (dtype of ``code``)."""
        return code @ self.decoder.to(code.dtype) + self.mean_out.to(code.dtype)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.decode(self.encode(x))

    def producer_nbytes(self) -> int:
        """Bytes of what the producer stores (mean_in + encoder, float32)."""
        return 4 * (self.mean_in.numel() + self.encoder.numel())

    def consumer_nbytes(self) -> int:
        """Bytes of what the consumer stores (decoder + mean_out, float32)."""
        return 4 * (self.decoder.numel() + self.mean_out.numel())

    def truncate(self, rank: int) -> "LowRankMap":
        """The same map at a lower rank (the first ``rank`` singular directions)."""
        if not 1 <= rank <= self.rank:
            raise ConfigError(f"cannot truncate a rank-{self.rank} map to rank {rank}")
        return LowRankMap(self.mean_in, self.encoder[:, :rank].contiguous(), self.decoder[:rank].contiguous(),
                          self.mean_out)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"mean_in": self.mean_in, "encoder": self.encoder, "decoder": self.decoder, "mean_out": self.mean_out}


def ridge_solution(x: torch.Tensor, y: torch.Tensor, ridge: float) -> torch.Tensor:
    """``(d_in, d_out)`` float64 ridge solution of centred ``x (N, d_in)`` onto centred ``y (N, d_out)``.

    ``lam = ridge * trace(x^T x) / d_in``; ``ridge = 0`` is ordinary least squares
    (minimum-norm solution via ``lstsq`` when ``x^T x`` is singular).
    """
    if ridge < 0:
        raise ConfigError(f"ridge must be >= 0, not {ridge}")
    x, y = x.double(), y.double()
    if ridge == 0:
        return torch.linalg.lstsq(x, y, driver="gelsd").solution
    g = x.T @ x
    lam = ridge * float(torch.diagonal(g).sum()) / g.shape[0]
    return torch.linalg.solve(g + lam * torch.eye(g.shape[0], dtype=g.dtype), x.T @ y)


def fit_low_rank_map(x: torch.Tensor, y: torch.Tensor, rank: int | None = None, *, ridge: float = 1e-4) -> LowRankMap:
    """Fit a reduced-rank ridge map from inputs ``x`` to targets ``y`` (see the module doc).

    Args:
        x: ``(N, d_in)`` calibration inputs (any float dtype; fitted in float64).
        y: ``(N, d_out)`` calibration targets.
        rank: r, ``1 <= r <= d_out``; None = ``d_out`` (full rank).
        ridge: relative ridge strength (>= 0).

    Returns:
        :class:`LowRankMap` in float32 whose singular directions are sorted by decreasing
        energy of the fitted values (so :meth:`LowRankMap.truncate` keeps the best ones).

    Raises:
        ConfigError: mismatched shapes, fewer than 2 samples, a rank out of range, or input rows
            that leave the ridge system singular (all rows equal: nothing to fit on).
    """
    if x.ndim != 2 or y.ndim != 2 or x.shape[0] != y.shape[0] or x.shape[0] < 2:
        raise ConfigError(f"fit_low_rank_map needs x (N, d_in) and y (N, d_out) with N >= 2, got {tuple(x.shape)} "
                          f"and {tuple(y.shape)}")
    d_out = y.shape[1]
    r = d_out if rank is None else int(rank)
    if not 1 <= r <= d_out:
        raise ConfigError(f"rank must be in [1, {d_out}], not {rank}")
    mx, my = x.double().mean(0), y.double().mean(0)
    xc, yc = x.double() - mx, y.double() - my
    if not bool(xc.abs().max() > 0):  # every row equal: lam = 0 and X^T X = 0, a singular system
        raise ConfigError(f"the {x.shape[0]} calibration rows are all equal (e.g. only the start token of each "
                          "window): nothing to fit a map on; use more calibration tokens")
    try:
        w = ridge_solution(xc, yc, ridge)
    except torch.linalg.LinAlgError as exc:
        raise ConfigError(f"the ridge system of {x.shape[0]} calibration rows x {x.shape[1]} inputs is singular "
                          f"({exc}); use more calibration tokens or a larger ridge") from None
    # right singular vectors of the fitted values Xc W = eigenvectors of the small
    # (d_out, d_out) Gram matrix W^T Xc^T Xc W, by decreasing eigenvalue
    fitted = xc @ w
    _, vecs = torch.linalg.eigh(fitted.T @ fitted)
    vr = vecs.flip(-1)[:, :r]  # (d_out, r)
    return LowRankMap(mean_in=mx.float(), encoder=(w @ vr).float(), decoder=vr.T.contiguous().float(),
                      mean_out=my.float())


def relative_error(y_hat: torch.Tensor, y: torch.Tensor) -> float:
    """``||y_hat - y||^2 / ||y - mean(y)||^2`` over all rows (0 = exact, 1 = no better than the mean)."""
    y = y.double()
    return float(((y_hat.double() - y) ** 2).sum() / ((y - y.mean(0)) ** 2).sum().clamp_min(1e-30))
