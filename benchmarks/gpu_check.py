"""GPU check: the codecs' device path against the CPU kernels (bytes, throughput next to device
memcpy) and a small profile run end to end on the GPU.

    python benchmarks/gpu_check.py [--sections codec,profile] [--device cuda|cpu] [--layers 30]
                                   [--batch 1] [--tokens 2048] [--repeats 5] [--only kivi]
                                   [--model smollm2-135m-instruct] [--steps 12]

Section ``codec``: for each preset of ``kvtune/search/spaces/presets.yaml`` (``duo-like`` with synthetic head
scores) on a synthetic SmolLM2-135M-shaped KV cache (``--layers`` x ``(batch, 3, tokens, 64)``
K and V in bfloat16, per-channel scales and outlier key channels):

* **bytes**: the stream :func:`~kvtune.codecs.encode_kv` writes with ``impl="torch"`` from the
  KV on ``--device`` equals the stream of the CPU kernels (``impl="fast"``) on a host copy,
  and :func:`~kvtune.codecs.decode_kv` with ``impl="torch", device=--device`` returns tensors
  equal (``torch.equal``) to the kernels' decode. Any difference: exit status 1.
* **throughput**: GB/s of original bfloat16 KV (:func:`kvtune.codecs.original_nbytes`),
  median of ``--repeats`` after one warm-up call: encode = device tensors -> stream bytes on
  the host (checksums included); decode = stream bytes on the host -> tensors on the device
  (synchronised). Next to each, **memcpy** = ``Tensor.copy_`` of every K and V tensor into
  preallocated tensors on the same device, sampled right before each codec run (same load),
  and the median ratio codec / memcpy.
* **range codec** (``cachegen``): its entropy coder runs on the CPU (sequential), after
  transforms and quantization on the device. The row ``cachegen[device part]`` times the same
  policy with ``bitpack`` (device work + copy of packed bytes), so the difference is the
  host coder's share.

Section ``profile`` (CUDA only: without CUDA the script exits with status 2 and says so, before
any work): the path of ``kvtune profile --device cuda`` on a small scale --

* **model and capture**: ``--model`` (default the profile default; its assets must be in the
  kvtune cache, this machine may be offline) loaded on the GPU; the ``continuation`` workload
  with 2 contexts of 256 tokens (``kv_dtype = bfloat16``) prefilled there, so the captured KV is
  on the GPU;
* **codec on the device**: 2 policies (``quarot-4``, ``kivi-2``) evaluated through
  :meth:`~kvtune.evaluate.workloads.base.Workload.evaluate` (encode and decode on the GPU, see
  :func:`~kvtune.evaluate.workloads.base.encode_decode`); for each captured context the stream
  written from the GPU KV equals the stream of a CPU copy, and the GPU decode equals the CPU
  decode (``torch.equal``);
* **optimizer on the device**: ``mobo`` and ``kvserve`` with ``device="cuda"`` (GP fit,
  posterior, BoTorch acquisition on the GPU) and with ``device="cpu"``, ``--steps`` asks each on
  the synthetic replay table (:func:`kvtune.search.optimizers.synthetic.synthetic_problem`,
  ``"small"``; driven by :func:`kvtune.search.optimizers.bench.run_optimizer`): mean seconds of
  a model-based ask and tell, proposals distinct, the GPU GP's torch prediction equal to its
  numpy prediction (max abs difference < 1e-9), and how many proposals agree with the CPU run
  (printed; rounding may change a near tie, so not a failure).

Any failed check: exit status 1. The load average (``os.getloadavg``) is printed with the
timings. Runs in well under 5 minutes on one GPU at the defaults (the first CPU-kernel call
compiles or loads the numba kernels).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from kvtune.codecs import PolicyConfig, decode_kv, encode_kv, original_nbytes  # noqa: E402
from kvtune.codecs.presets import read_presets  # noqa: E402
from kvtune.evaluate.assets import DEFAULT_MODEL  # noqa: E402

SECTIONS = ("codec", "profile")
PROFILE_POLICIES = ("quarot-4", "kivi-2")
N_INIT = 4  # initial design of the optimizers in the profile section

HEADS, HEAD_DIM = 3, 64  # SmolLM2-135M-Instruct


def synthetic_kv(layers: int, batch: int, tokens: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """bfloat16 KV shaped like SmolLM2's: per-channel scales, two x20 outlier key channels."""
    g = torch.Generator().manual_seed(seed)
    shape = (batch, HEADS, tokens, HEAD_DIM)
    kv = []
    for _ in range(layers):
        k = torch.randn(shape, generator=g) * (0.2 + 2 * torch.rand(HEAD_DIM, generator=g))
        k[..., [3, 17]] *= 20
        v = torch.randn(shape, generator=g)
        kv.append((k.to(torch.bfloat16), v.to(torch.bfloat16)))
    return kv


def policies(layers: int, only: str | None) -> dict[str, PolicyConfig]:
    g = torch.Generator().manual_seed(1)
    scores = (torch.rand(layers, HEADS, generator=g) ** 4).tolist()
    out = {}
    for name, preset in read_presets().items():
        if only and only not in name:
            continue
        cfg = preset.config()
        if cfg.needs_pca_basis:  # kvtc-*: no device path (kvtune.codecs.pca), and no basis without a run
            continue
        out[name] = cfg.with_head_scores(scores) if cfg.needs_head_scores else cfg
        if cfg.codec.name == "range":
            out[f"{name}[device part]"] = PolicyConfig.from_dict({**out[name].to_dict(), "codec": "bitpack"})
    return out


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device: torch.device) -> float:
    sync(device)
    t0 = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - t0


def memcpy_s(kv, dst, device) -> float:
    def run():
        for (k, v), (dk, dv) in zip(kv, dst):
            dk.copy_(k)
            dv.copy_(v)

    return timed(run, device)


def same_decode(a, b) -> bool:
    return len(a) == len(b) and all(torch.equal(x.cpu(), y.cpu()) for pa, pb in zip(a, b) for x, y in zip(pa, pb))


def codec_section(args) -> list[str]:
    """The preset table (module docstring, section ``codec``); returns the failed checks."""
    device = torch.device(args.device)
    host_kv = synthetic_kv(args.layers, args.batch, args.tokens)
    kv = [(k.to(device), v.to(device)) for k, v in host_kv]
    dst = [(torch.empty_like(k), torch.empty_like(v)) for k, v in kv]
    nbytes = original_nbytes(kv)
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"device {device} ({gpu}), torch {torch.__version__}, {args.layers} layers x ({args.batch}, {HEADS}, "
          f"{args.tokens}, {HEAD_DIM}) bfloat16 K and V = {nbytes / 1e6:.1f} MB, {args.repeats} repeats, "
          f"torch threads {torch.get_num_threads()}")
    print(f"{'policy':<22} {'ratio':>6} {'enc GB/s':>9} {'dec GB/s':>9} {'memcpy GB/s':>11} "
          f"{'enc/memcpy':>10} {'dec/memcpy':>10} {'bytes':>5} {'load avg':>14}")
    failures = []
    for name, cfg in policies(args.layers, args.only).items():
        stream = encode_kv(kv, cfg, impl="torch")  # warm-up: plans, caches
        decoded = decode_kv(stream, impl="torch", device=device)
        expected = encode_kv(host_kv, cfg, impl="fast")
        ok = stream == expected and same_decode(decoded, decode_kv(expected, impl="fast"))
        if not ok:
            failures.append(name)
        enc, dec, mem_e, mem_d = [], [], [], []
        for _ in range(args.repeats):
            mem_e.append(memcpy_s(kv, dst, device))
            enc.append(timed(lambda: encode_kv(kv, cfg, impl="torch"), device))
            mem_d.append(memcpy_s(kv, dst, device))
            dec.append(timed(lambda: decode_kv(stream, impl="torch", device=device), device))
        gbs = lambda s: nbytes / s / 1e9  # noqa: E731
        enc_ratio = statistics.median(m / e for m, e in zip(mem_e, enc))
        dec_ratio = statistics.median(m / d for m, d in zip(mem_d, dec))
        load = "/".join(f"{x:.2f}" for x in os.getloadavg())
        print(f"{name:<22} {nbytes / len(stream):6.2f} {gbs(statistics.median(enc)):9.3f} {gbs(statistics.median(dec)):9.3f} "
              f"{gbs(statistics.median(mem_e + mem_d)):11.2f} {enc_ratio:10.4f} {dec_ratio:10.4f} "
              f"{'ok' if ok else 'DIFF':>5} {load:>14}", flush=True)
    if failures:
        return [f"codec: {name} differs from the CPU kernels" for name in failures]
    print("all streams and decodes equal to the CPU kernels")
    return []


def capture_and_evaluate(model: str, device: torch.device) -> list[str]:
    """Model and KV capture on ``device``, two policies through the workload, bytes against the CPU."""
    from kvtune.evaluate.model import load_model
    from kvtune.evaluate.workloads import make_workload
    from kvtune.methods.tqc.settings import ProfileSettings

    failures = []
    settings = ProfileSettings(model=model, device=device.type, contexts=2, samples=2, cheap_samples=2,
                               context_tokens=256, continuation_tokens=64, kv_dtype="bfloat16")
    t0 = time.perf_counter()
    lm = load_model(settings.model, settings.device)
    t1 = time.perf_counter()
    wl = make_workload("continuation", lm, settings=settings)
    t2 = time.perf_counter()
    kv_devices = {t.device.type for kv in wl.kv for pair in kv for t in pair}
    print(f"model {lm.name} on {lm.device} in {t1 - t0:.1f} s; {len(wl.kv)} contexts x "
          f"{wl.describe()['context_tokens']['max']} tokens captured on {sorted(kv_devices)} in {t2 - t1:.1f} s")
    if lm.device.type != device.type or kv_devices != {device.type}:
        failures.append(f"profile: model on {lm.device}, captured KV on {sorted(kv_devices)} (expected {device})")
    presets = read_presets()
    for name in PROFILE_POLICIES:
        cfg = presets[name].config()
        row = wl.evaluate(cfg, fidelity="cheap")
        same = True
        for kv in wl.kv:
            host = [(k.cpu(), v.cpu()) for k, v in kv]
            stream, expected = encode_kv(kv, cfg), encode_kv(host, cfg)
            same &= stream == expected and same_decode(decode_kv(stream, device=lm.device), decode_kv(expected))
        if not same:
            failures.append(f"profile: {name} bytes or decode differ between {device} and the CPU")
        print(f"  {name:<10} ratio {row['compression_ratio']:6.2f}  rel.acc {row['relative_accuracy_raw']:.4f}  "
              f"enc {row['encode_gbps']:8.3f} GB/s  dec {row['decode_gbps']:8.3f} GB/s  "
              f"eval {row['eval_seconds']:.2f} s  bytes {'ok' if same else 'DIFF'}", flush=True)
    return failures


def optimizer_steps(steps: int, device: torch.device) -> list[str]:
    """``mobo`` and ``kvserve`` asks with the GPs on ``device`` and on the CPU (synthetic replay
    table), and a GP fitted on ``device`` predicting alike in torch and numpy."""
    from kvtune.search.optimizers.bench import run_optimizer
    from kvtune.search.optimizers.gp import candidate_inputs, fit_gp
    from kvtune.search.optimizers.replay import ReplayObjective
    from kvtune.search.optimizers.synthetic import synthetic_problem

    failures = []
    space, table = synthetic_problem("small")
    replay = ReplayObjective(table)
    ratios = replay.ratios(space)
    x = candidate_inputs(space, ratios)
    y = np.array([replay.evaluate(c)["relative_accuracy"] for c in space.candidates[:48]])
    t0 = time.perf_counter()
    gp = fit_gp(x[:48], y, device=device)
    fit_s = time.perf_counter() - t0
    numpy_mean = dataclasses.replace(gp, device=torch.device("cpu")).predict(x)[0]
    diff = float(np.abs(gp.predict_torch(x)[0] - numpy_mean).max())
    print(f"  GP fit on {gp.device} (48 points) {fit_s:.2f} s; torch vs numpy prediction max abs diff {diff:.2e}")
    if gp.device.type != device.type or not diff < 1e-9:
        failures.append(f"profile: GP on {gp.device}, torch vs numpy prediction differ by {diff:.2e}")
    for name in ("mobo", "kvserve"):
        asked, seconds = {}, {}
        for dev in (device.type, "cpu"):
            run = run_optimizer(name, space, replay, seed=0, budget=steps, ratios=ratios,
                                options={"device": dev, "n_init": N_INIT})
            asked[dev] = [r["policy_id"] for r in run.trials]
            model_based = run.overhead[N_INIT:]  # after the initial design
            seconds[dev] = statistics.mean(model_based) if model_based else float("nan")
        on = asked[device.type]
        agree = sum(a == b for a, b in zip(on, asked["cpu"]))
        distinct = len(set(on)) == len(on) == steps
        if not distinct:
            failures.append(f"profile: {name} on {device} asked {on} (expected {steps} distinct)")
        print(f"  {name:<8} {seconds[device.type]:.3f} s per model-based ask on {device}, "
              f"{seconds['cpu']:.3f} s on cpu; "
              f"{agree}/{len(asked['cpu'])} proposals equal to the CPU run; distinct {distinct}", flush=True)
    return failures


def profile_section(args) -> list[str]:
    """The profile path on the GPU (module docstring, section ``profile``); returns the failed checks."""
    print(f"profile path on {torch.cuda.get_device_name(0)}: load average "
          f"{'/'.join(f'{x:.2f}' for x in os.getloadavg())}")
    cuda = torch.device("cuda")
    failures = capture_and_evaluate(args.model, cuda)
    return failures + optimizer_steps(args.steps, cuda)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated, of {', '.join(SECTIONS)}")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                    help="device of the codec section (the profile section always runs on cuda)")
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--only", default=None, help="substring of the preset names to run")
    ap.add_argument("--model", default=DEFAULT_MODEL, help="model of the profile section (cached asset or path)")
    ap.add_argument("--steps", type=int, default=12, help=f"optimizer asks per optimizer and device (> {N_INIT})")
    args = ap.parse_args(argv)
    sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = sorted(set(sections) - set(SECTIONS))
    if unknown or not sections:
        ap.error(f"--sections: unknown {unknown or 'empty'}; choose from {', '.join(SECTIONS)}")
    if args.steps <= N_INIT:
        ap.error(f"--steps must be >= {N_INIT + 1} (the model-based asks start after {N_INIT})")
    needs_cuda = "profile" in sections or torch.device(args.device).type == "cuda"
    if needs_cuda and not torch.cuda.is_available():
        print("gpu_check: CUDA is not available (torch.cuda.is_available() is False): the profile section and "
              "--device cuda need a GPU; on a CPU-only machine run --sections codec --device cpu", file=sys.stderr)
        return 2
    failures = []
    for section in sections:
        failures += codec_section(args) if section == "codec" else profile_section(args)
    if failures:
        print("FAILED:\n  " + "\n  ".join(failures))
        return 1
    print(f"gpu_check: every check passed ({', '.join(sections)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
