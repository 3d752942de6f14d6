"""Device codec check: throughput of the torch device path next to device memcpy, and its bytes
against the CPU kernels, for every preset.

    python benchmarks/gpu_check.py [--device cuda|cpu] [--layers 30] [--batch 1] [--tokens 2048]
                                   [--repeats 5] [--only kivi]

For each preset of ``kvtune/search/spaces/presets.yaml`` (``duo-like`` with synthetic head
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

The load average (``os.getloadavg``) is printed with the timings. Runs in well under 5 minutes
on one GPU at the defaults (the first CPU-kernel call compiles or loads the numba kernels).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from kvtune.codecs import PolicyConfig, decode_kv, encode_kv, original_nbytes  # noqa: E402
from kvtune.codecs.presets import read_presets  # noqa: E402

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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--only", default=None, help="substring of the preset names to run")
    args = ap.parse_args(argv)
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
        print(f"MISMATCH against the CPU kernels: {', '.join(failures)}")
        return 1
    print("all streams and decodes equal to the CPU kernels")
    return 0


if __name__ == "__main__":
    sys.exit(main())
