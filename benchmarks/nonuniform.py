"""Non-uniform (codebook) quantization vs KIVI's uniform grid on the real model.

    OMP_NUM_THREADS=1 nice -n 10 python benchmarks/nonuniform.py [--contexts 8] [--tokens 1024]
        [--continuation 128] [--bits 2,3] [--out benchmarks/results/nonuniform.md]

The ``codebook`` quantizer (:mod:`kvtune.codecs.codebook`): NormalFloat levels (QLoRA,
arXiv 2305.14314, sec. 3.1) or a Lloyd-Max codebook fitted per tensor segment (KVQuant,
arXiv 2401.18079, sec. 3.3), against ``uniform`` (KIVI, arXiv 2402.02750). What is measured:

* **Model / data**: the default model (SmolLM2-135M-Instruct) and the continuation workload
  on the default essays, bfloat16 KV, ``--contexts`` windows of ``--tokens`` tokens (the
  workload's cheap fidelity: the continuation's likelihood on the decoded cache).
* **Grouping**: KIVI's for every quantizer: keys per channel, values per token, groups of 32,
  the last 128 tokens in bfloat16.
* **Policies**: at each ``--bits``: ``uniform`` (asymmetric: scale + zero point per group) and
  ``codebook`` with ``levels`` nf / lloyd x ``normalize`` absmax (one float16 per group) /
  minmax (two), i.e. which normalisation is better at which metadata cost.
* **Compression ratio**: bfloat16 KV bytes / stream bytes (every header, metadata and codebook
  byte) with the ``range`` codec (per-channel models) and with ``bitpack``. The decoded tensors
  do not depend on the codec (lossless), so the model runs once per quantizer (on the range-coded
  streams) and the bit-packed ratio comes from encoding the same contexts' KV.
* **Accuracy**: relative accuracy raw and its bootstrap 95 % lower bound, against the
  uncompressed cache, as the profile's search evaluates it.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from kvtune.codecs import PolicyConfig, encode_kv, original_nbytes  # noqa: E402
from kvtune.core.atomic import atomic_write_text  # noqa: E402
from kvtune.evaluate.model import load_model  # noqa: E402
from kvtune.evaluate.workloads import make_workload  # noqa: E402
from kvtune.methods.tqc.settings import ProfileSettings  # noqa: E402

KIVI_GROUPING = {"group_size": 32, "recent_tokens": 128}


def policy(quant: dict, codec: str) -> PolicyConfig:
    """``quant`` on keys per channel and values per token with KIVI's grouping, ``codec``."""
    spec = {**quant, **KIVI_GROUPING}
    return PolicyConfig.from_dict({"key": {**spec, "granularity": "per_channel"},
                                   "value": {**spec, "granularity": "per_token"},
                                   "codec": codec if codec == "bitpack" else {"name": codec, "model": "per_channel"}})


def quantizers(bits: int) -> list[tuple[str, dict]]:
    out = [(f"uniform {bits}b (KIVI)", {"name": "uniform", "bits": bits})]
    for levels in ("nf", "lloyd"):
        for normalize in ("absmax", "minmax"):
            out.append((f"codebook {bits}b {levels} {normalize}",
                        {"name": "codebook", "bits": bits, "levels": levels, "normalize": normalize}))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--continuation", type=int, default=128)
    ap.add_argument("--bits", default="2,3")
    ap.add_argument("--out", default="benchmarks/results/nonuniform.md")
    args = ap.parse_args()
    load0 = os.getloadavg()
    t0 = time.perf_counter()
    lm = load_model(ProfileSettings().model, "cpu")
    settings = ProfileSettings(contexts=args.contexts, cheap_samples=args.contexts, context_tokens=args.tokens,
                               continuation_tokens=args.continuation)
    wl = make_workload("continuation", lm, settings=settings)
    contexts = [wl.cap.context_kv(i) for i in range(wl.cap.num_contexts)]
    orig = sum(original_nbytes(kv) for kv in contexts)
    setup = time.perf_counter() - t0
    rows = []
    for bits in (int(b) for b in args.bits.split(",")):
        for name, quant in quantizers(bits):
            r = wl.evaluate(policy(quant, "range"), fidelity="cheap")
            packed = policy(quant, "bitpack")
            cr_bitpack = orig / sum(len(encode_kv(kv, packed)) for kv in contexts)
            rows.append((name, packed, r, cr_bitpack))
            print(f"{name:28s} CR range {r['compression_ratio']:5.2f}x bitpack {cr_bitpack:5.2f}x  "
                  f"acc {100 * r['relative_accuracy_raw']:6.2f}% (lo {100 * r['relative_accuracy_lo']:6.2f})  "
                  f"{r['eval_seconds']:.0f}s", flush=True)
    load1 = os.getloadavg()
    lines = [
        "# Non-uniform (codebook) vs uniform quantization on SmolLM2-135M-Instruct",
        "",
        f"`OMP_NUM_THREADS=1 nice -n 10 python benchmarks/nonuniform.py --contexts {args.contexts} --tokens {args.tokens} "
        f"--continuation {args.continuation} --bits {args.bits}`",
        "",
        f"Continuation workload (cheap fidelity), {args.contexts} contexts of {args.tokens} tokens (+{args.continuation} "
        f"scored), bfloat16 KV; setup (model load, prefill) {setup:.0f} s, total {time.perf_counter() - t0:.0f} s; "
        f"load average {load0[0]:.2f} at start, {load1[0]:.2f} at end (2 shared cores). KIVI grouping for every "
        "row: keys per channel, values per token, groups of 32, last 128 tokens bfloat16. Ratio = bf16 KV bytes / "
        "stream bytes (range: per-channel range coding; bitpack: dense); accuracy = relative accuracy raw "
        "(bootstrap 95 % lower bound), the same for both codecs (lossless).",
        "",
        "| quantizer | K label (bitpack policy) | ratio range | ratio bitpack | rel. accuracy % | lo % |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for name, cfg, r, cr_bitpack in rows:
        lines.append(f"| {name} | `{cfg.key.short_label()}` | {r['compression_ratio']:.2f} | {cr_bitpack:.2f} | "
                     f"{100 * r['relative_accuracy_raw']:.2f} | {100 * r['relative_accuracy_lo']:.2f} |")
    text = "\n".join([*lines, ""])
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out, text)  # a killed run leaves the previous table whole
    print(text)


if __name__ == "__main__":
    with torch.no_grad():
        main()
