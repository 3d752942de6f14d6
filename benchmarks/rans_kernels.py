"""The ``rans`` codec alone on real KV symbols: ns per coded super-symbol, bytes against entropy.

Usage::

    python benchmarks/rans_kernels.py [--kv cache.pt] [--repeats 10] [--out report.md]

* **Data**: the KV of the default model (SmolLM2-135M-Instruct, 30 layers x K and V of
  ``(1, 3, 1024, 64)`` bfloat16) on one essay window, captured as ``benchmarks/codecs.py`` does
  (``--kv`` caches it, the same file format), quantized as KIVI does (keys per channel, values
  per token, groups of 32) to 2 and 4 bits, without KIVI's bfloat16 window so that every token is
  coded.
* **Measured**, one thread, min over ``--repeats`` runs of all 60 tensors:
  :meth:`~kvtune.codecs.rans.RansCodec.pack` and :meth:`~kvtune.codecs.rans.RansCodec.unpack`
  (per-channel models: counts, table choice, tables, coded words and their checks; the
  per-tensor Python included), in ns per coded super-symbol (2-bit symbols fuse 4 per coder step,
  4-bit ones 2) and as % of a ``memcpy`` of the same symbol bytes (``numpy.copyto``) measured next
  to them; payload bytes against the order-0 empirical entropy of the per-channel groups
  (:func:`~kvtune.codecs.rans.empirical_entropy_bits`). Also the coder loops alone
  (:func:`kvtune.codecs.kernels.rans_encode`, and :func:`~kvtune.codecs.kernels.rans_decoder_tables`
  + :func:`~kvtune.codecs.kernels.rans_decode`) on per-channel tables at 4 levels per octave,
  which is where the rest of the time is not.
* The load average is printed next to the figures; run it on a quiet machine.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch

from kvtune.codecs import kernels as K
from kvtune.codecs.quantizers import UniformQuantizer
from kvtune.codecs.rans import RansCodec, empirical_entropy_bits, layout_for_shape, level_to_weights
from kvtune.codecs.range_coder import TABLE_STEPS, count_levels
from kvtune.core.atomic import atomic_write_text

from bench_common import best_seconds, codecs_script, kv_kernel_args  # noqa: E402  (the folder of this script)


def _load_kv(cache: Path | None):
    """The KV of ``benchmarks/codecs.py`` (one 1,024-token context), loaded through that script."""
    return codecs_script().load_kv("cpu", 1, 1024, cache)[0]


def kivi_symbols(kv, bits: int) -> list[np.ndarray]:
    """uint8 symbols of every K (per channel) and V (per token) tensor, groups of 32."""
    out = []
    for k, v in kv:
        for x, gran in ((k, "per_channel"), (v, "per_token")):
            sym, _ = UniformQuantizer(bits=bits, granularity=gran, group_size=32).quantize_block(x.float())
            out.append(sym.to(torch.uint8).numpy())
    return out


def coder_loops(symbols: list[np.ndarray], bits: int):
    """Encode and decode closures running only the coder loops of every tensor (tables built once)."""
    prec = K.rans.PRECISION
    jobs = []
    for s in symbols:
        lay = layout_for_shape("per_channel", bits, s.shape)
        flat = s.reshape(-1)
        counts = K.rans_count_groups(flat, *lay.count_args(), lay.groups, 1 << bits)
        div, mod, comp = lay.coder_args(False)
        freq, cum = K.rans_fused_tables(level_to_weights(count_levels(counts, TABLE_STEPS[2]), TABLE_STEPS[2]), comp, bits, prec)
        out = np.empty(flat.size // lay.m + 2 * K.rans.MAX_LANES, np.uint16)
        words = out[K.rans_encode(flat, bits, lay.m, div, mod, freq, cum, prec, out):].copy()
        jobs.append((flat, lay.m, div, mod, freq, cum, out, words, np.empty_like(flat)))

    def encode():
        for flat, m, div, mod, freq, cum, out, _, _ in jobs:
            K.rans_encode(flat, bits, m, div, mod, freq, cum, prec, out)

    def decode():
        for flat, m, div, mod, freq, cum, _, words, dst in jobs:
            slots = np.zeros((freq.shape[0] << prec) + 4, np.uint8)  # padded: the vector loop
            fc = K.rans_decoder_tables(freq, cum, prec, slots)
            assert K.rans_decode(words, bits, m, div, mod, fc, slots, prec, dst) == words.size

    return encode, decode


def measure(symbols: list[np.ndarray], bits: int, repeats: int) -> dict[str, float]:
    codec = RansCodec(model="per_channel")
    packed = [codec.pack(s, bits) for s in symbols]
    for s, p in zip(symbols, packed):  # lossless, or the figures mean nothing
        assert np.array_equal(codec.unpack(p, bits, s.size, shape=s.shape), s.reshape(-1))
    steps = sum(s.size // layout_for_shape("per_channel", bits, s.shape).m for s in symbols)
    dst = [np.empty_like(s) for s in symbols]
    enc = best_seconds(lambda: [codec.pack(s, bits) for s in symbols], repeats)
    dec = best_seconds(lambda: [codec.unpack(p, bits, s.size, shape=s.shape) for s, p in zip(symbols, packed)], repeats)
    copy = best_seconds(lambda: [np.copyto(d, s) for d, s in zip(dst, symbols)], repeats)
    loop_enc, loop_dec = coder_loops(symbols, bits)
    enc_loop, dec_loop = best_seconds(loop_enc, repeats), best_seconds(loop_dec, repeats)
    entropy = sum(empirical_entropy_bits(s, bits, "per_channel") for s in symbols) / 8
    return {"symbols": sum(s.size for s in symbols), "steps": steps, "encode_s": enc, "decode_s": dec, "copy_s": copy, "encode_loop_s": enc_loop, "decode_loop_s": dec_loop,
            "bytes": sum(len(p) for p in packed), "entropy_bytes": entropy}


def report(rows: dict[int, dict[str, float]], load: tuple[float, ...]) -> str:
    lines = ["# rans codec on real KIVI symbols (one thread)", "",
             f"- load average (1/5/15 min) at start: {load[0]:.2f}/{load[1]:.2f}/{load[2]:.2f}",
             "- ns per coded super-symbol; % memcpy = memcpy time of the symbol bytes / codec time", "",
             "| symbols | coder steps | encode ns/step | decode ns/step | encode % memcpy | decode % memcpy | bytes / entropy | coder loops alone, encode / decode ns/step |",
             "|---|---|---|---|---|---|---|---|"]
    for bits, r in rows.items():
        lines.append(f"| KIVI {bits}-bit, {r['symbols'] / 1e6:.1f} M | {r['steps'] / 1e6:.2f} M | "
                     f"{1e9 * r['encode_s'] / r['steps']:.1f} | {1e9 * r['decode_s'] / r['steps']:.1f} | "
                     f"{100 * r['copy_s'] / r['encode_s']:.1f} | {100 * r['copy_s'] / r['decode_s']:.1f} | "
                     f"{r['bytes'] / r['entropy_bytes']:.4f} | {1e9 * r['encode_loop_s'] / r['steps']:.1f} / "
                     f"{1e9 * r['decode_loop_s'] / r['steps']:.1f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    args = kv_kernel_args(__doc__, repeats=10)
    torch.set_num_threads(1)
    load = os.getloadavg()
    kv = _load_kv(args.kv)
    rows = {bits: measure(kivi_symbols(kv, bits), bits, args.repeats) for bits in (2, 4)}
    text = report(rows, load)
    print(text)
    if args.out:
        atomic_write_text(args.out, text)


if __name__ == "__main__":
    main()
