"""Shared pieces of the model-based optimizers: inputs, seeds, initial designs, GP fitting.

Everything here is a pure function of its arguments (the GP fit is deterministic: no random
restarts), which is what makes the optimizers resumable: an optimizer's next proposal depends
only on its seed and the *set* of results told so far, never on the history of calls, so a
resumed run that replays stored trials continues exactly like an uninterrupted one.

Shapes: ``n`` candidates, ``d`` input dimensions, ``k`` observations, ``m`` outputs.

Device: the GP fit, the posterior, the predictions and the BoTorch model run on a torch device
(:func:`compute_device`; default the CPU), in float64 everywhere; what they return (numpy
arrays, :class:`GaussianProcess` fields) is on the host. On the CPU the computation is the
numpy / scipy one (predictions) and the torch one (fit) it always was, so proposals do not
depend on whether the device is given. Off the CPU the same formulas run in torch on the
device (:meth:`GaussianProcess.predict_torch`); they agree with the CPU to rounding, not bit
for bit.
"""

from __future__ import annotations

import contextlib
import functools
import math
import warnings
from dataclasses import dataclass
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from kvtune.core.errors import ConfigError
from kvtune.search.space import SearchSpace

__all__ = ["GaussianProcess", "torch_threads", "candidate_inputs", "compute_device", "exp_decay", "fit_gp",
           "gp_posterior", "normal_cdf", "ratio_spread_design", "result_value", "space_features", "standardization",
           "step_rng", "step_seed"]

DTYPE = torch.float64
CPU = torch.device("cpu")


def compute_device(device: torch.device | str | None) -> torch.device:
    """The torch device the model-based optimizers compute on, checked before any work.

    Args:
        device: ``None`` (the CPU), ``"auto"`` (CUDA when torch sees it, else the CPU), or
            anything :class:`torch.device` accepts (``"cpu"``, ``"cuda"``, ``"cuda:1"``, a
            ``torch.device``).

    Returns:
        The device.

    Raises:
        ConfigError: not a device torch knows, the ``meta`` device (tensors without data: a GP
            cannot be fitted there), or a device this process cannot use (e.g. ``"cuda"``
            without CUDA).
    """
    if device is None:
        return CPU
    if isinstance(device, str) and device == "auto":
        return torch.device("cuda") if torch.cuda.is_available() else CPU
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError, ValueError) as exc:
        raise ConfigError(f"optimizer device {device!r} is not a torch device ({exc})") from None
    if dev.type == "meta":
        raise ConfigError("optimizer device 'meta' holds no data: the Gaussian processes need a real device "
                          "(cpu or cuda)")
    if dev.type != "cpu":
        try:
            torch.zeros(1, dtype=DTYPE, device=dev)
        except (RuntimeError, AssertionError) as exc:  # torch asserts when built without the backend
            raise ConfigError(f"optimizer device {dev} cannot be used here ({exc})") from None
    return dev


@contextlib.contextmanager
def torch_threads(n: int = 1) -> Iterator[None]:
    """Run the block with ``torch.set_num_threads(n)``, restoring the previous count after.

    The optimizers' tensors are tiny (hundreds of rows): with more than one intra-op thread,
    thread hand-off dominates, and on a busy 2-core machine a GP fit was measured ~10x slower
    with 2 threads than with 1.
    """
    old = torch.get_num_threads()
    if old == n:
        yield
        return
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


def result_value(result: dict[str, Any], key: str) -> float:
    """``float(result[key])``, or NaN when missing, None or not a number."""
    v = result.get(key)
    try:
        v = float(v)
    except (TypeError, ValueError):
        return float("nan")
    return v


def step_seed(seed: int, step: int, tag: int = 0) -> int:
    """A 32-bit seed derived from the optimizer seed, the number of results told and a tag."""
    return int(np.random.SeedSequence([int(seed) & 0xFFFFFFFF, int(step), int(tag)]).generate_state(1)[0])


def step_rng(seed: int, step: int, tag: int = 0) -> np.random.Generator:
    """``numpy`` generator of :func:`step_seed`."""
    return np.random.default_rng(step_seed(seed, step, tag))


def space_features(space: SearchSpace) -> np.ndarray:
    """``space.features()``, or an ``(n, 0)`` array for a space without parameters."""
    if not space.parameters:
        return np.zeros((len(space.candidates), 0))
    return space.features()


def candidate_inputs(space: SearchSpace, ratios: np.ndarray | None) -> np.ndarray:
    """GP inputs of every candidate: ``(n, d)`` float64 in [0, 1].

    :func:`space_features` (one-hot categoricals, min-max numerics, zeros for inactive
    parameters), plus -- when ``ratios`` is known -- one column ``log(ratio) / log(max
    ratio)`` (the cheap, exact compression ratio is a strong predictor of accuracy). A space
    without parameters gets one column of zeros.
    """
    x = space_features(space)
    if ratios is not None and len(ratios):
        lr = np.log(np.maximum(np.asarray(ratios, dtype=np.float64), 1e-12))
        lo, hi = float(lr.min()), float(lr.max())
        col = np.zeros_like(lr) if hi == lo else (lr - lo) / (hi - lo)
        x = np.column_stack([x, col])
    if x.shape[1] == 0:
        x = np.zeros((len(space.candidates), 1))
    return x


def ratio_spread_design(n_points: int, n_candidates: int, ratios: np.ndarray | None,
                        rng: np.random.Generator) -> list[int]:
    """Initial design spread along the ratio axis.

    Candidates are sorted by ratio and cut into ``n_points`` strata of equal count; one
    candidate is drawn uniformly from each stratum (so the design covers the ratio quantiles
    (j + U) / n_points). Returned from the highest-ratio stratum down. Without ratios: a
    uniform sample without replacement.

    Returns:
        Candidate indices (at most ``min(n_points, n_candidates)``, distinct).
    """
    n_points = min(n_points, n_candidates)
    if n_points <= 0:
        return []
    if ratios is None:
        return [int(i) for i in rng.choice(n_candidates, size=n_points, replace=False)]
    order = np.argsort(-np.asarray(ratios), kind="stable")
    strata = np.array_split(order, n_points)
    return [int(s[rng.integers(len(s))]) for s in strata]


@dataclass
class GaussianProcess:
    """Independent exact GPs (one per output column), fitted by :func:`fit_gp`.

    The model is BoTorch's default ``SingleTaskGP`` (ARD RBF kernel with unit outputscale on
    standardized outputs, constant mean, Gaussian noise, and the dimension-scaled priors of
    Hvarfner et al. 2024: lengthscale ~ LogNormal(sqrt(2) + log(d) / 2, sqrt(3)), noise ~
    LogNormal(-4, 1), lengthscale >= 0.025, noise >= 1e-4); :meth:`to_botorch` returns it as a
    BoTorch model for the acquisition functions. Only the hyperparameter fit and the plain
    posterior are re-implemented here, with one small autograd closure instead of GPyTorch's
    general machinery: that is ~10x cheaper per L-BFGS step on a 2-core CPU, which is what keeps
    an optimizer step under the 2 s budget.

    Attributes:
        x: ``(k, d)`` training inputs; y: ``(k, m)`` training outputs (original units).
        y_mean, y_std: ``(m,)`` standardization (``y_std`` with ddof=1, as ``Standardize``).
        lengthscale: ``(m, d)``; noise: ``(m,)`` (standardized units); constant: ``(m,)``.
        chol: ``(m, k, k)`` Cholesky factors of ``K + noise I``; alpha: ``(m, k)`` weights.
        device: where :meth:`predict`, :meth:`believe` and :meth:`to_botorch` compute (the
            arrays above are on the host whatever it is).
    """

    x: np.ndarray
    y: np.ndarray
    y_mean: np.ndarray
    y_std: np.ndarray
    lengthscale: np.ndarray
    noise: np.ndarray
    constant: np.ndarray
    chol: np.ndarray
    alpha: np.ndarray
    device: torch.device = CPU

    def predict(self, xq: np.ndarray, *, batch: int = 2048) -> tuple[np.ndarray, np.ndarray]:
        """Latent posterior mean and standard deviation at ``xq`` (``(n, d)``).

        Computed with numpy / scipy on the CPU, or with :meth:`predict_torch` when
        :attr:`device` is another device.

        Returns:
            ``mean, std``: ``(n, m)`` float64, original output units (noise excluded).
        """
        if self.device.type != "cpu":
            return self.predict_torch(xq, batch=batch)
        from scipy.linalg import solve_triangular

        xq = np.asarray(xq, dtype=np.float64)
        m = self.y.shape[1]
        mean = np.empty((xq.shape[0], m))
        std = np.empty((xq.shape[0], m))
        for j in range(m):
            ls = self.lengthscale[j]
            xa, xb = self.x / ls, xq / ls
            for s in range(0, xq.shape[0], batch):
                b = xb[s : s + batch]
                sq = (xa * xa).sum(1)[:, None] + (b * b).sum(1)[None, :] - 2.0 * xa @ b.T
                kx = np.exp(-0.5 * np.maximum(sq, 0.0))  # (k, nb)
                mu = self.constant[j] + kx.T @ self.alpha[j]
                v = solve_triangular(self.chol[j], kx, lower=True)
                var = np.maximum(1.0 - (v * v).sum(0), 1e-12)
                mean[s : s + batch, j] = self.y_mean[j] + self.y_std[j] * mu
                std[s : s + batch, j] = self.y_std[j] * np.sqrt(var)
        return mean, std

    def predict_torch(self, xq: np.ndarray, *, batch: int = 2048) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`predict` in float64 torch operations on :attr:`device`, every output at once.

        Same formulas (RBF cross-covariance, triangular solve against :attr:`chol`); equal to
        the numpy result to rounding. ``batch`` query rows go to the device at a time.

        Returns:
            ``mean, std``: ``(n, m)`` float64 numpy arrays on the host.
        """
        dev = self.device
        t = functools.partial(torch.as_tensor, dtype=DTYPE, device=dev)
        ls = t(self.lengthscale)[:, None, :]  # (m, 1, d)
        xa, chol, alpha = t(self.x)[None] / ls, t(self.chol), t(self.alpha)  # (m, k, d), (m, k, k), (m, k)
        const, y_mean, y_std = t(self.constant)[:, None], t(self.y_mean)[:, None], t(self.y_std)[:, None]
        xq = np.asarray(xq, dtype=np.float64)
        means, stds = [], []
        with torch.no_grad():
            for s in range(0, xq.shape[0], batch):
                xb = t(xq[s : s + batch])[None] / ls  # (m, nb, d)
                sq = (xa * xa).sum(-1)[:, :, None] + (xb * xb).sum(-1)[:, None, :] - 2.0 * xa @ xb.transpose(1, 2)
                kx = torch.exp(-0.5 * sq.clamp_min(0.0))  # (m, k, nb)
                mu = const + torch.einsum("mkn,mk->mn", kx, alpha)
                v = torch.linalg.solve_triangular(chol, kx, upper=False)
                var = (1.0 - (v * v).sum(1)).clamp_min(1e-12)
                means.append((y_mean + y_std * mu).T)
                stds.append((y_std * var.sqrt()).T)
        m = self.y.shape[1]
        if not means:
            return np.empty((0, m)), np.empty((0, m))
        return torch.cat(means).cpu().numpy(), torch.cat(stds).cpu().numpy()

    def loo_scale(self) -> np.ndarray:
        """Calibration factor of each output: RMS of the leave-one-out z-scores, at least 1.

        Closed form (Rasmussen & Williams eq. 5.12): with ``A = (K + noise I)^-1``, the LOO
        residual of point ``i`` is ``(A y)_i / A_ii`` with variance ``1 / A_ii``, so its z-score
        is ``(A y)_i / sqrt(A_ii)``. A well-calibrated GP has RMS ~1; a larger value means the
        posterior std is too small by about that factor.

        Returns:
            ``(m,)`` float64, each >= 1.
        """
        from scipy.linalg import cho_solve

        k = self.x.shape[0]
        out = np.ones(self.y.shape[1])
        if k < 3:
            return out
        for j in range(self.y.shape[1]):
            a_diag = np.diag(cho_solve((self.chol[j], True), np.eye(k)))
            z = self.alpha[j] / np.sqrt(np.maximum(a_diag, 1e-300))
            out[j] = max(1.0, float(np.sqrt(np.mean(z * z))))
        return out

    def believe(self, xq: np.ndarray) -> "GaussianProcess":
        """Kriging believer: the GP conditioned on its own posterior mean at ``xq`` (``(p, d)``),
        hyperparameters kept (Ginsbourger, Le Riche & Carraro, "Kriging is well-suited to
        parallelize optimization", 2010). The mean is (nearly) unchanged; the std shrinks
        near ``xq``, so a batch built on it spreads out. Outputs are standardized again over
        the augmented data, as :meth:`to_botorch` would.
        """
        xq = np.asarray(xq, dtype=np.float64)
        if xq.shape[0] == 0:
            return self
        mean, _ = self.predict(xq)
        return gp_posterior(np.vstack([self.x, xq]), np.vstack([self.y, mean]), self.lengthscale, self.noise,
                            self.constant, device=self.device)

    def to_botorch(self):
        """The same model as a BoTorch ``SingleTaskGP`` (float64, eval mode) on :attr:`device`,
        for acquisitions.

        Its posterior equals :meth:`predict` (tested on the CPU)."""
        from botorch.models import SingleTaskGP
        from botorch.models.transforms.outcome import Standardize

        m = self.y.shape[1]
        t = functools.partial(torch.as_tensor, dtype=DTYPE, device=self.device)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = SingleTaskGP(t(self.x), t(self.y), outcome_transform=Standardize(m=m)).to(self.device)
            ls = t(self.lengthscale)
            model.covar_module.lengthscale = ls.reshape(model.covar_module.lengthscale.shape)
            noise = t(self.noise)
            model.likelihood.noise = noise.reshape(model.likelihood.noise.shape)
            const = t(self.constant)
            model.mean_module.constant.data = const.reshape(model.mean_module.constant.shape)
        model.eval()
        return model


_MIN_LENGTHSCALE, _MIN_NOISE = 2.5e-2, 1e-4


def fit_gp(x: np.ndarray, y: np.ndarray, *, maxiter: int = 100, hyper_rows: np.ndarray | None = None,
           device: torch.device | str | None = None) -> GaussianProcess:
    """Maximum-a-posteriori fit of independent GPs (see :class:`GaussianProcess`).

    L-BFGS-B over (log lengthscales, log noise, constant mean) of every output at once,
    starting from the prior modes (deterministic: no random restarts), capped at ``maxiter``
    iterations and stopped at a relative loss change of 1e-5 (measured: half the iterations of
    scipy's default tolerance, same held-out error). Outputs are standardized first; a
    constant output gets unit scale.

    Args:
        x: ``(k, d)`` inputs in [0, 1].
        y: ``(k,)`` or ``(k, m)`` observations.
        maxiter: L-BFGS-B iteration cap (cost control).
        hyper_rows: if given, the hyperparameters are fitted on these rows only (cost control:
            each L-BFGS step is O(rows^2 d)); the posterior then conditions on all ``k`` rows.
        device: where the loss, its gradient and the posterior are computed
            (:func:`compute_device`; default the CPU). L-BFGS-B itself runs on the host (scipy).

    Returns:
        The fitted :class:`GaussianProcess`, whose :attr:`~GaussianProcess.device` is ``device``.

    Raises:
        ConfigError: an unusable ``device`` (:func:`compute_device`).
    """
    from scipy.optimize import minimize

    dev = compute_device(device)

    x = np.asarray(x, dtype=np.float64)
    y = np.asarray(y, dtype=np.float64)
    if y.ndim == 1:
        y = y[:, None]
    k, d = x.shape
    m = y.shape[1]
    y_mean, y_std = standardization(y)
    ys_all = torch.as_tensor((y - y_mean) / y_std, dtype=DTYPE, device=dev).T  # (m, k)
    tx_all = torch.as_tensor(x, dtype=DTYPE, device=dev)
    rows = np.arange(k) if hyper_rows is None else np.asarray(hyper_rows, dtype=np.int64)
    ys, tx = ys_all[:, rows], tx_all[rows]
    diff2 = (tx[:, None, :] - tx[None, :, :]) ** 2  # (rows, rows, d)
    eye = torch.eye(len(rows), dtype=DTYPE, device=dev)
    loc, scale = math.sqrt(2.0) + 0.5 * math.log(max(d, 1)), math.sqrt(3.0)

    def unpack(th):
        return th[: m * d].view(m, d), th[m * d : m * d + m], th[m * d + m :]

    def loss_and_grad(theta: np.ndarray) -> tuple[float, np.ndarray]:
        th = torch.tensor(theta, dtype=DTYPE, device=dev, requires_grad=True)
        log_ls, log_noise, const = unpack(th)
        kmat = torch.exp(-0.5 * torch.einsum("ijd,md->mij", diff2, torch.exp(-2.0 * log_ls)))
        kmat = kmat + torch.exp(log_noise)[:, None, None] * eye
        chol, info = torch.linalg.cholesky_ex(kmat)
        if int(info.max()) > 0:
            return 1e10, np.zeros_like(theta)
        r = (ys - const[:, None]).unsqueeze(-1)
        a = torch.cholesky_solve(r, chol)
        nll = 0.5 * (r * a).sum() + torch.log(torch.diagonal(chol, dim1=-2, dim2=-1)).sum()
        # negative log densities of the LogNormal priors (constants dropped)
        prior = ((log_ls - loc) ** 2 / (2 * scale**2) + log_ls).sum() + ((log_noise + 4.0) ** 2 / 2 + log_noise).sum()
        loss = nll + prior
        loss.backward()
        return float(loss.item()), th.grad.cpu().numpy().astype(np.float64)

    theta0 = np.r_[np.full(m * d, max(loc - scale**2, math.log(_MIN_LENGTHSCALE))), np.full(m, -5.0), np.zeros(m)]
    bounds = ([(math.log(_MIN_LENGTHSCALE), math.log(1e3))] * (m * d) + [(math.log(_MIN_NOISE), 0.0)] * m
              + [(-5.0, 5.0)] * m)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        res = minimize(loss_and_grad, theta0, jac=True, method="L-BFGS-B", bounds=bounds,
                       options={"maxiter": maxiter, "ftol": 1e-5})
    theta = res.x if np.all(np.isfinite(res.x)) and res.fun < 1e10 else theta0
    with torch.no_grad():
        log_ls, log_noise, const = unpack(torch.as_tensor(theta, dtype=DTYPE))
    return gp_posterior(x, y, torch.exp(log_ls).numpy(), torch.exp(log_noise).numpy(), const.numpy(), device=dev)


def standardization(y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(mean, std)`` of each column of ``(k, m)`` outputs as BoTorch's ``Standardize``
    computes them (std with ddof=1; 1 for one row or a constant column)."""
    k, m = y.shape
    y_mean = y.mean(0)
    y_std = y.std(0, ddof=1) if k > 1 else np.ones(m)
    return y_mean, np.where(np.isfinite(y_std) & (y_std > 0), y_std, 1.0)


def gp_posterior(x: np.ndarray, y: np.ndarray, lengthscale: np.ndarray, noise: np.ndarray,
                 constant: np.ndarray, *, device: torch.device | str | None = None) -> GaussianProcess:
    """The :class:`GaussianProcess` of given hyperparameters conditioned on ``(x, y)``.

    Args:
        x: ``(k, d)`` inputs; y: ``(k, m)`` outputs (standardized here, as by :func:`fit_gp`).
        lengthscale: ``(m, d)``; noise, constant: ``(m,)`` (standardized units).
        device: where the Cholesky factors are computed (:func:`compute_device`; default the
            CPU); the result's arrays are on the host.

    Raises:
        ConfigError: an unusable ``device``.
    """
    dev = compute_device(device)
    x = np.asarray(x, dtype=np.float64)
    y = np.asarray(y, dtype=np.float64)
    y_mean, y_std = standardization(y)
    t = functools.partial(torch.as_tensor, dtype=DTYPE, device=dev)
    with torch.no_grad():
        tx = t(x)
        ls, nz, const = (t(np.asarray(a, dtype=np.float64)) for a in (lengthscale, noise, constant))
        diff2 = (tx[:, None, :] - tx[None, :, :]) ** 2
        kmat = (torch.exp(-0.5 * torch.einsum("ijd,md->mij", diff2, ls**-2))
                + nz[:, None, None] * torch.eye(len(x), dtype=DTYPE, device=dev))
        chol = torch.linalg.cholesky(kmat)
        ys = t((y - y_mean) / y_std).T
        alpha = torch.cholesky_solve((ys - const[:, None]).unsqueeze(-1), chol).squeeze(-1)
    host = lambda a: a.cpu().numpy()  # noqa: E731
    return GaussianProcess(x=x, y=y, y_mean=y_mean, y_std=y_std, lengthscale=host(ls), noise=host(nz),
                           constant=host(const), chol=host(chol), alpha=host(alpha), device=dev)


def normal_cdf(z: np.ndarray) -> np.ndarray:
    """Standard normal CDF, elementwise."""
    from scipy.special import ndtr

    return ndtr(np.asarray(z, dtype=np.float64))


def exp_decay(lambda0: float, half_life: float, t: float) -> float:
    """``lambda0 * 0.5 ** (t / half_life)`` (``t`` clipped at 0)."""
    return float(lambda0 * math.pow(0.5, max(t, 0.0) / half_life))
