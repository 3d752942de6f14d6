"""The ``bitpack`` kernels alone on real KV symbols: every width 1-8, against a memcpy.

Usage::

    python benchmarks/bitpack.py [--kv cache.pt] [--repeats 50] [--out report.md]

* **Data**: the KV of the default model (SmolLM2-135M-Instruct, 30 layers x K and V of
  ``(1, 3, 1024, 64)`` bfloat16) on one essay window, captured as ``benchmarks/codecs.py`` does
  (``--kv`` caches it, the same file format), quantized per token in groups of 32 at each width
  (:class:`~kvtune.codecs.quantizers.UniformQuantizer`): 196,608 uint8 symbols per tensor.
* **Measured**, one thread (each kernel call is single-threaded; the codec threads run one per
  tensor), fastest of ``--repeats`` runs over all 60 tensors:
  :func:`kvtune.codecs.kernels.pack_bits` (symbols -> packed bytes, with the OR of the symbols
  that the caller checks) and :func:`kvtune.codecs.kernels.unpack_bits`, in us per tensor, in
  Gsymbols/s and as % of a memcpy of the same symbol bytes (``numpy.copyto`` into a preallocated
  array) measured in the same run. Every packed stream is checked against the reference
  (:func:`kvtune.codecs.bitpack.pack_bits`) and unpacked back to its symbols first.
* The load average is printed next to the figures; run it on a quiet machine.
"""

from __future__ import annotations

import os

import numpy as np
import torch

from kvtune.codecs import bitpack
from kvtune.codecs import kernels as K
from kvtune.codecs.quantizers import UniformQuantizer
from kvtune.core.atomic import atomic_write_text

from bench_common import best_seconds, codecs_script, cpu_model, kv_kernel_args  # noqa: E402  (the folder of this script)


def symbols(kv, bits: int) -> list[np.ndarray]:
    """Flat uint8 symbols of every K and V tensor, per-token groups of 32 at ``bits`` bits."""
    q = UniformQuantizer(bits=bits, granularity="per_token", group_size=32)
    return [np.ascontiguousarray(q.quantize_block(x.float())[0].to(torch.uint8).numpy().reshape(-1))
            for layer in kv for x in layer]


def measure(kv, bits: int, repeats: int) -> dict[str, float]:
    """Seconds per pass over all tensors: pack, unpack and the memcpy of the symbols."""
    syms = symbols(kv, bits)
    packed = [np.zeros((s.size * bits + 7) // 8, np.uint8) for s in syms]
    back = [np.empty_like(s) for s in syms]
    for s, p, b in zip(syms, packed, back):
        K.pack_bits(s, bits, p)
        if p.tobytes() != bitpack.pack_bits(s, bits):
            raise AssertionError(f"{bits}-bit kernel packing differs from the reference")
        K.unpack_bits(p, bits, b)
        if not np.array_equal(b, s):
            raise AssertionError(f"{bits}-bit unpacking does not give the symbols back")

    def pack():
        for s, p in zip(syms, packed):
            K.pack_bits(s, bits, p)

    def unpack():
        for p, b in zip(packed, back):
            K.unpack_bits(p, bits, b)

    def copy():
        for s, b in zip(syms, back):
            np.copyto(b, s)

    return {"pack": best_seconds(pack, repeats), "unpack": best_seconds(unpack, repeats),
            "memcpy": best_seconds(copy, repeats), "tensors": len(syms), "symbols": sum(s.size for s in syms)}


def main() -> None:
    args = kv_kernel_args(__doc__, repeats=50)
    torch.set_num_threads(1)
    kv = codecs_script().load_kv("cpu", 1, 1024, args.kv)[0]
    load0 = os.getloadavg()
    rows = []
    for bits in range(1, 9):
        m = measure(kv, bits, args.repeats)
        n, per = m["symbols"], m["tensors"]
        rows.append(f"| {bits} | {m['pack'] / per * 1e6:.1f} | {n / m['pack'] / 1e9:.1f} | "
                    f"{100 * m['memcpy'] / m['pack']:.0f} | {m['unpack'] / per * 1e6:.1f} | "
                    f"{n / m['unpack'] / 1e9:.1f} | {100 * m['memcpy'] / m['unpack']:.0f} | "
                    f"{m['memcpy'] / per * 1e6:.1f} |")
        print(rows[-1], flush=True)
    load1 = os.getloadavg()
    text = "\n".join([
        "# bitpack kernels on real KV symbols",
        "",
        f"- data: {len(kv)} layers x K and V of {tuple(kv[0][0].shape)}, quantized per token in groups of 32",
        f"- machine: {cpu_model()}, {os.cpu_count()} CPUs, one thread, torch {torch.__version__}",
        f"- load average (1/5/15 min): {'/'.join(f'{x:.2f}' for x in load0)} at start, "
        f"{'/'.join(f'{x:.2f}' for x in load1)} at end",
        f"- fastest of {args.repeats} passes over all tensors; % memcpy = memcpy time of the same symbol bytes "
        "(numpy.copyto) / kernel time",
        "",
        "| bits | pack us / tensor | pack Gsym/s | pack % memcpy | unpack us / tensor | unpack Gsym/s "
        "| unpack % memcpy | memcpy us / tensor |",
        "|---|---|---|---|---|---|---|---|",
        *rows,
        "",
    ])
    print(text)
    if args.out:
        atomic_write_text(args.out, text)


if __name__ == "__main__":
    main()
