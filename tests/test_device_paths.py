"""The run's torch device through the GP optimizers, the workload codec step and the T/Q/C
method; device-agnostic code checked on the CPU, the CUDA cases where CUDA is present
(``benchmarks/gpu_check.py --sections profile`` runs the whole path on a GPU)."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from kvtune.codecs import decode_kv, encode_kv
from kvtune.codecs.presets import read_presets
from kvtune.core.errors import ConfigError
from kvtune.evaluate.workloads.base import encode_decode
from kvtune.search.optimizers import make_optimizer
from kvtune.search.optimizers.gp import compute_device, fit_gp
from kvtune.search.optimizers.replay import ReplayObjective
from kvtune.search.optimizers.synthetic import synthetic_problem

pytestmark = pytest.mark.usefixtures("one_torch_thread")

FAST = {"kvserve": {"n_init": 4, "maxiter": 50},
        "mobo": {"n_init": 4, "maxiter": 50, "mc_samples": 16, "prescreen": 32}}
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


@pytest.fixture(scope="module")
def small():
    space, table = synthetic_problem("small")
    replay = ReplayObjective(table)
    return space, replay, replay.ratios(space)


@pytest.fixture(params=["cpu", "cuda"])
def device(request) -> torch.device:
    if request.param == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    return torch.device(request.param)


def drive(opt, replay, steps: int) -> list[int]:
    """Ask (one, or a batch of 2 every third step), evaluate on the replay table, tell."""
    asked: list[int] = []
    for k in range(steps):
        batch = opt.ask_batch(2) if k % 3 == 2 else [opt.ask()]
        for cand in batch:
            if cand is None:
                return asked
            result = replay.evaluate(cand)
            result["trial"] = len(asked)
            opt.tell(cand, result)
            asked.append(cand.index)
    return asked


def gp_data(seed: int = 0):
    rng = np.random.default_rng(seed)
    x = rng.random((30, 3))
    y = np.column_stack([np.sin(4 * x[:, 0]) + x[:, 1], x.sum(1) ** 2])
    return x, y, rng.random((41, 3))


# ---------------------------------------------------------------- the device argument


def test_compute_device_accepts_the_cpu_and_refuses_unusable_devices():
    cpu = torch.device("cpu")
    assert compute_device(None) == cpu
    assert compute_device("cpu") == cpu
    assert compute_device(torch.device("cpu")) == cpu
    assert compute_device("auto") == torch.device("cuda" if torch.cuda.is_available() else "cpu")
    for meta in ("meta", torch.device("meta")):
        with pytest.raises(ConfigError, match="'meta' holds no data"):
            compute_device(meta)
    with pytest.raises(ConfigError, match="'gpu0' is not a torch device"):
        compute_device("gpu0")
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="cuda cannot be used here"):
            compute_device("cuda")


@pytest.mark.parametrize("name", ["mobo", "kvserve", "optuna-tpe", "random", "exhaustive"])
def test_every_optimizer_takes_the_device_and_refuses_meta(name, small):
    space, _, ratios = small
    assert make_optimizer(name, space, ratios=ratios, device="cpu").device == torch.device("cpu")
    assert make_optimizer(name, space, ratios=ratios).device == torch.device("cpu")
    with pytest.raises(ConfigError, match="meta"):
        make_optimizer(name, space, ratios=ratios, device=torch.device("meta"))


@pytest.mark.parametrize("name", ["mobo", "kvserve"])
def test_proposals_are_identical_with_device_cpu_or_omitted(name, small):
    space, replay, ratios = small
    runs = [drive(make_optimizer(name, space, seed=2, ratios=ratios, **FAST[name], **kw), replay, 10)
            for kw in ({}, {"device": "cpu"}, {"device": torch.device("cpu")})]
    assert len(runs[0]) == 13  # 10 steps, three of them batches of 2
    assert runs[1] == runs[0] and runs[2] == runs[0]


# ---------------------------------------------------------------- the GP on a device


def test_fit_gp_on_the_cpu_device_equals_the_default_fit():
    x, y, xq = gp_data()
    a, b = fit_gp(x, y, maxiter=40), fit_gp(x, y, maxiter=40, device="cpu")
    assert a.device == b.device == torch.device("cpu")
    for field in ("lengthscale", "noise", "constant", "chol", "alpha"):
        np.testing.assert_array_equal(getattr(a, field), getattr(b, field))
    np.testing.assert_array_equal(a.predict(xq)[0], b.predict(xq)[0])


def test_torch_prediction_equals_the_numpy_prediction():
    x, y, xq = gp_data(1)
    gp = fit_gp(x, y, maxiter=40)
    mean, std = gp.predict(xq)
    t_mean, t_std = gp.predict_torch(xq, batch=16)  # 41 rows: three batches, the last partial
    assert t_mean.shape == t_std.shape == (41, 2) and t_mean.dtype == np.float64
    np.testing.assert_allclose(t_mean, mean, rtol=0, atol=1e-10)
    np.testing.assert_allclose(t_std, std, rtol=1e-9, atol=1e-12)
    empty = gp.predict_torch(np.zeros((0, 3)))
    assert empty[0].shape == empty[1].shape == (0, 2)


def test_gp_device_is_kept_by_the_believer_and_the_botorch_model(device):
    x, y, xq = gp_data(2)
    gp = fit_gp(x, y, maxiter=40, device=device)
    assert gp.device == device and isinstance(gp.chol, np.ndarray)
    believer = gp.believe(xq[:3])
    assert believer.device == device and believer.x.shape == (33, 3)
    model = gp.to_botorch()
    assert all(p.device.type == device.type for p in model.parameters())
    with torch.no_grad():
        post = model.posterior(torch.as_tensor(xq, dtype=torch.float64, device=device))
    mean, std = gp.predict(xq)
    np.testing.assert_allclose(post.mean.cpu().numpy(), mean, atol=1e-8)
    np.testing.assert_allclose(post.variance.sqrt().cpu().numpy(), std, atol=1e-8)


@CUDA
def test_gp_fit_and_proposals_on_cuda_match_the_cpu(small):
    x, y, xq = gp_data(3)
    cpu, gpu = fit_gp(x, y, maxiter=40), fit_gp(x, y, maxiter=40, device="cuda")
    assert gpu.device.type == "cuda"
    # the device's arithmetic: its torch prediction against numpy on the same (GPU-fitted) GP
    np.testing.assert_allclose(gpu.predict(xq)[0], dataclasses.replace(gpu, device=torch.device("cpu")).predict(xq)[0],
                               rtol=0, atol=1e-9)
    # the fit itself: L-BFGS-B from the same start on gradients equal to rounding
    np.testing.assert_allclose(gpu.predict(xq)[0], cpu.predict(xq)[0], rtol=0, atol=1e-3)
    space, replay, ratios = small
    for name in ("mobo", "kvserve"):
        asked = drive(make_optimizer(name, space, seed=2, ratios=ratios, device="cuda", **FAST[name]), replay, 8)
        assert len(asked) == len(set(asked)) == 10


# ---------------------------------------------------------------- the workload's codec step


def test_encode_decode_runs_where_the_model_is(device):
    g = torch.Generator().manual_seed(0)
    host = [(torch.randn(1, 3, 37, 64, generator=g).to(torch.bfloat16),
             torch.randn(1, 3, 37, 64, generator=g).to(torch.bfloat16)) for _ in range(2)]
    lm = SimpleNamespace(device=device, layer_types=["full_attention"] * 2)
    config = read_presets()["quarot-4"].config()  # Hadamard rotation, 4-bit per-token
    kv = [(k.to(device), v.to(device)) for k, v in host]
    decoded, stream, t_enc, t_dec = encode_decode(lm, kv, config)
    assert stream == encode_kv(host, config)  # the CPU kernels' bytes, on either device
    assert t_enc > 0 and t_dec > 0
    expected = decode_kv(stream)
    for (k, v), (ek, ev) in zip(decoded, expected):
        assert k.device.type == v.device.type == device.type
        assert torch.equal(k.cpu(), ek) and torch.equal(v.cpu(), ev)


# ---------------------------------------------------------------- the T/Q/C method


def test_tqc_search_optimizer_gets_the_model_device(small, monkeypatch):
    import kvtune.search.optimizers as optimizers
    from kvtune.methods.tqc.method import TQCContext, TQCMethod
    from kvtune.methods.tqc.settings import ProfileSettings

    space, _, ratios = small
    seen = {}
    real = optimizers.make_optimizer

    def spy(*args, **kwargs):
        seen.update(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(optimizers, "make_optimizer", spy)
    sentinel = torch.device("cpu")
    ctx = TQCContext(settings=ProfileSettings(optimizer="random", refine=False), lm=SimpleNamespace(device=sentinel),
                     workload=None, space=space, ratios=ratios, info={})
    stage = next(TQCMethod().stages(ctx, []))
    assert seen["device"] is sentinel and stage.optimizer.device == torch.device("cpu")
    # a Ray driver holds no model (its context is the workers' driver_view): the driver's own device
    light = TQCMethod().driver_view(ctx)
    assert light.lm is None
    next(TQCMethod().stages(light, []))
    assert seen["device"] == torch.device("cuda" if torch.cuda.is_available() else "cpu")
