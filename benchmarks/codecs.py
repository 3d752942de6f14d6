"""Throughput of the codec library on real KV: every component and every preset, against memcpy.

    python benchmarks/codecs.py [--device auto|cpu|cuda] [--contexts 1] [--tokens 1024]
                                [--repeats 5] [--threads 2] [--out results.md]
                                [--kv cache.pt] [--only kivi-2,none] [--check] [--stages]
                                [--basis pca.safetensors]

What is measured (the latency axis of the profile: encode and decode throughput in GB/s of
original KV, after warm-up, median of repeats):

* **Data**: the KV cache of the default model (SmolLM2-135M-Instruct: 30 layers x
  ``(contexts, 3, tokens, 64)`` K and V) on ``--contexts`` real essay windows of ``--tokens``
  tokens, converted to bfloat16 as a serving system holds it. ``duo-like`` (MixHQ) uses real
  retrieval scores from :func:`kvtune.evaluate.calibrate.calibrate_head_scores` on the same
  contexts. ``--kv`` caches the captured KV and scores in a file for reruns. The ``kvtc-*``
  presets need a PCA basis: measured only with ``--basis`` (a basis file, fitted with
  :func:`kvtune.evaluate.calibrate_pca.calibrate_pca_basis` on 2 other essay windows and saved
  there when it does not exist).
* **Throughput**: GB/s of original bfloat16 KV (``kvtune.codecs.original_nbytes``) for
  :func:`~kvtune.codecs.encode_kv` (tensors -> stream bytes, checksums included) and
  :func:`~kvtune.codecs.decode_kv` (bytes -> bfloat16 tensors). Each case is warmed up once
  (that first call is reported separately: it includes loading or compiling the kernels and
  building the cached segment plans), then run ``--repeats`` times.
* **memcpy reference**: ``Tensor.copy_`` of every K and V tensor into preallocated tensors of
  the same shape and dtype, measured *between* the codec runs (one memcpy sample before each
  encode and each decode), so that both see the same machine load. A sample, of the memcpy and
  of a codec alike, is the median of :data:`BURST` back-to-back runs. Under CPU contention a
  multi-threaded copy can be slower than a single-threaded one (its OpenMP barrier waits for
  a descheduled thread); to stay conservative the reference is the faster of a 1-thread and a
  ``--threads``-thread copy. Ratios are medians over repeats of (codec GB/s / memcpy GB/s of
  the adjacent sample). A float32 memcpy of the same tensors is reported for information.
* **Threads**: ``torch.set_num_threads(--threads)``; the codec fast path uses as many
  threads (:func:`kvtune.codecs.fastpath.num_threads`).
* **Device**: on CUDA the KV and the memcpy reference live on the GPU; the codecs run on the
  CPU, so encode includes the device-to-host copy and decode returns CPU tensors.

* **Stages** (``--stages``): for each preset, where the time of one encode and one decode
  goes on the fast path (medians of ``--repeats``, in ms): encode = token selection (``keep``
  policies: :func:`kvtune.codecs.select.select_kv`; the rest of the policy runs on the kept
  tokens) + the codec threads' work (input check, kernels, per-tensor CRC:
  :func:`kvtune.codecs.fastpath.encode_into` into a preallocated buffer for bit-packed policies
  without transforms, one kernel call per thread; else
  :func:`kvtune.codecs.fastpath.encode_tensors`) + stream assembly (header, CRC combination,
  and the allocation of the stream, which ``encode_into`` writes in place
  (:func:`kvtune.codecs.stream.write_stream_in_place`), or the join of the sections into one
  ``bytes``, :func:`kvtune.codecs.stream.write_stream`) + the rest (input validation, policy,
  the first-call size check); decode = stream validation
  (:func:`kvtune.codecs.stream.read_header` without the final checksum) + the codec threads'
  work (:func:`kvtune.codecs.fastpath.decode_tensors`, which takes each tensor's CRC while
  decoding it and checks the stream's; the time of a separate CRC pass over the whole stream is
  shown beside it for reference) + the rest (policy, claimed sizes, metadata checks).

* **Decode into preallocated tensors**: :func:`~kvtune.codecs.decode_kv` with ``out=`` tensors
  allocated once per case (a serving engine decodes into its KV cache blocks, and the memcpy
  reference copies into preallocated tensors too). A plain decode also allocates its output,
  whose first touch page-faults: 0.4-1.7 ms of a 2-3 ms ``kivi-2`` decode of 1,024 tokens
  (``fastpath.decode_tensors`` with and without ``out``, one and two threads, 2-vCPU AMD EPYC,
  2026-12-03), varying from run to run with the allocator's state.

Targets (issue 16, on the 2-core development CPU): bit-packed presets encode at >= 40 % and
decode (into preallocated tensors) at >= 50 % of memcpy; range-coded presets at >= 3 % (issue
3); rANS-coded policies (``rans`` codec; each range-coded preset is also measured with
``rans``, plus KIVI-4 / KIVI-2 with ``rans``) at >= 10 % (issue 16).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

OMP_WAIT = os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
"""The OpenMP wait policy of torch's workers, set before torch loads libgomp (an
``OMP_WAIT_POLICY`` already in the environment wins). With libgomp's default a worker spins for
up to 300,000 iterations after each parallel region (``GOMP_SPINCOUNT``): after the memcpy
reference's 2-thread copies it took a core from the codec threads measured next, beyond the
first run of a burst. ``kvquant-3`` decoded into preallocated tensors (2 threads, medians of 25;
2-vCPU AMD EPYC Zen 5, 2026-12-05, one-off script) in 4.00 / 2.48 / 2.34 ms (first, second,
third run after a memcpy sample) with the default and 2.46 / 2.02 / 1.91 ms with ``PASSIVE``,
against 1.71-1.87 ms back to back; the reference's 1-thread copy does not use the workers."""

import numpy as np  # noqa: E402
import torch  # noqa: E402

from kvtune.codecs import PolicyConfig, decode_kv, encode_kv, fastpath, original_nbytes  # noqa: E402
from kvtune.codecs.base import CODECS  # noqa: E402
from kvtune.codecs.codebook import CodebookQuantizer  # noqa: E402
from kvtune.codecs.fp8 import FP8Quantizer  # noqa: E402
from kvtune.codecs.mixhq import MixHQ  # noqa: E402
from kvtune.codecs.pca import lookup  # noqa: E402
from kvtune.codecs.presets import load_presets  # noqa: E402
from kvtune.codecs.quantizers import NoQuantizer, UniformQuantizer  # noqa: E402
from kvtune.codecs.select import Keep  # noqa: E402
from kvtune.codecs.transforms import Affine, Delta, Hadamard  # noqa: E402

from bench_common import cpu_model  # noqa: E402  (the folder of this script)

TARGET_BITPACK = (0.40, 0.50)  # (encode, decode) fractions of memcpy
TARGET_RANGE = (0.03, 0.03)
TARGET_RANS = (0.10, 0.10)


# ----------------------------------------------------------------------------- data


def load_kv(device: str, contexts: int, tokens: int, cache: Path | None):
    """bfloat16 KV of the default model on real text, and per-(layer, KV head) retrieval scores."""
    if cache is not None and cache.is_file():
        blob = torch.load(cache)
        if blob["contexts"] == contexts and blob["tokens"] == tokens:
            print(f"KV and head scores from {cache}")
            kv = [(k.to(device), v.to(device)) for k, v in blob["kv"]]
            return kv, blob["scores"]
    from kvtune.evaluate.assets import read_texts
    from kvtune.evaluate.calibrate import calibrate_head_scores
    from kvtune.evaluate.capture import build_contexts, capture
    from kvtune.evaluate.model import load_model

    t0 = time.perf_counter()
    lm = load_model("smollm2-135m-instruct", device)
    ids = build_contexts(lm.tokenizer, read_texts("paul-graham-essays"), n_contexts=contexts,
                         context_tokens=tokens, continuation_tokens=2)
    with torch.inference_mode():
        cap = capture(lm, ids, tokens)
    kv = [(k.to(torch.bfloat16).contiguous(), v.to(torch.bfloat16).contiguous()) for k, v in cap.kv]
    scores = [list(s) for s in calibrate_head_scores(lm, ids[:, :tokens]).scores]
    print(f"captured {len(kv)} layers x {tuple(kv[0][0].shape)} K and V and calibrated head scores "
          f"in {time.perf_counter() - t0:.0f} s")
    if cache is not None:
        torch.save({"contexts": contexts, "tokens": tokens, "kv": [(k.cpu(), v.cpu()) for k, v in kv],
                    "scores": scores}, cache)
    return kv, scores


# ----------------------------------------------------------------------------- cases


@dataclass
class Case:
    group: str  # "transform", "quantizer", "codec", "preset"
    name: str
    config: PolicyConfig
    target: tuple[float, float] | None = None  # (encode, decode) fractions of memcpy


def component_cases() -> list[Case]:
    """Each transform alone + uniform 4-bit; each quantizer with bitpack; each codec with KIVI-2 symbols."""
    u4 = UniformQuantizer(bits=4, granularity="per_token", group_size=32)
    cases = [Case("transform", "identity + u4", PolicyConfig(key=u4, value=u4))]
    for name, t in [("hadamard", Hadamard()), ("delta g10", Delta()), ("delta g10 a8", Delta(anchor_bits=8)),
                    ("affine rms", Affine()), ("affine absmax+shift", Affine(statistic="absmax", shift=True))]:
        cases.append(Case("transform", f"{name} + u4", PolicyConfig(transforms=(t,), key=u4, value=u4)))
    quants = [
        ("uniform 2b tok g32", UniformQuantizer(bits=2)),
        ("uniform 4b tok g32", u4),
        ("uniform 8b tok g32", UniformQuantizer(bits=8)),
        ("uniform 3b tok g32", UniformQuantizer(bits=3)),
        ("uniform 4b sym tok g64", UniformQuantizer(bits=4, symmetric=True, group_size=0)),
        ("uniform 2b ch g32", UniformQuantizer(bits=2, granularity="per_channel")),
        ("uniform 4b ch g32", UniformQuantizer(bits=4, granularity="per_channel")),
        ("uniform 2b ch g32 r128", UniformQuantizer(bits=2, granularity="per_channel", recent_tokens=128)),
        ("uniform 4b tok s4 r128 L2:8", UniformQuantizer(bits=4, sink_tokens=4, recent_tokens=128, shallow_layers=2)),
        ("none (bf16)", NoQuantizer()),
        ("fp8 e4m3", FP8Quantizer()),
        ("fp8 e5m2 scaled", FP8Quantizer(format="e5m2", scaled=True)),
        ("codebook 3b lloyd minmax tok g32", CodebookQuantizer(bits=3)),
        ("codebook 3b lloyd absmax tok g32", CodebookQuantizer(bits=3, normalize="absmax")),
        ("codebook 3b nf minmax tok g32", CodebookQuantizer(bits=3, levels="nf")),
        ("codebook 3b lloyd minmax ch g32", CodebookQuantizer(bits=3, granularity="per_channel")),
        ("codebook 2b lloyd minmax ch g32 r128", CodebookQuantizer(bits=2, granularity="per_channel", recent_tokens=128)),
        ("codebook 4b nf absmax ch g32", CodebookQuantizer(bits=4, levels="nf", normalize="absmax",
                                                           granularity="per_channel")),
    ]
    for name, q in quants:
        cases.append(Case("quantizer", name + " | bitpack", PolicyConfig(key=q, value=q)))
    cases.append(Case("quantizer", "mixhq 0.25 8/2 tok g32 | bitpack",
                      PolicyConfig(key=MixHQ(), value=MixHQ())))
    kivi2 = PolicyConfig.kivi(2)
    for spec in ["bitpack", {"name": "range", "model": "per_channel"}, {"name": "range", "model": "per_head"},
                 {"name": "range", "model": "per_channel", "coded_bits": 1}, {"name": "zstd"},
                 {"name": "rans", "model": "per_channel"}, {"name": "rans", "model": "per_head"}]:
        name = spec if isinstance(spec, str) else spec["name"]
        if name not in CODECS:
            continue
        codec = CODECS[name].from_dict(spec)
        cases.append(Case("codec", f"KIVI-2 symbols | {codec.short_label()}",
                          PolicyConfig(key=kivi2.key, value=kivi2.value, codec=codec)))
    return cases


def load_or_fit_basis(path: Path, contexts: int, tokens: int, calib: int = 2) -> str:
    """Digest of the registered PCA basis of ``path``; fitted first (pre-RoPE, joint) on ``calib``
    essay windows after the ``contexts`` measured ones and saved there when the file is absent."""
    from kvtune.codecs.pca import load_basis, register_basis, save_basis

    if not path.is_file():
        from kvtune.evaluate.assets import read_texts
        from kvtune.evaluate.calibrate_pca import calibrate_pca_basis
        from kvtune.evaluate.capture import build_contexts
        from kvtune.evaluate.model import load_model

        lm = load_model("smollm2-135m-instruct", "cpu")
        ids = build_contexts(lm.tokenizer, read_texts("paul-graham-essays"), n_contexts=contexts + calib,
                             context_tokens=tokens, continuation_tokens=2)
        save_basis(calibrate_pca_basis(lm, ids[contexts:, :tokens]), path)
        print(f"fitted a PCA basis on {calib} calibration windows -> {path}")
    return register_basis(load_basis(path))


def preset_cases(basis: str | None = None, kv=None) -> list[Case]:
    """Every preset (kvtc-* only with a PCA ``basis`` digest; kvquant-3c with codebooks fitted
    on ``kv``, the measured KV itself, when given: its speed does not depend on the levels'
    values, and a profile run fits them on other contexts); each range-coded one also with
    ``rans``; and PCA policies (with a basis): ``keep`` 0.85 (one choice for all heads)
    then ``kvtc-3`` rANS-coded, ``dp-alloc`` on the ecsq grid at K 1 / V 2.5 bits, and (with a
    basis that carries per-layer sensitivity) the model-wide budget at K 0.75 / V 2 bits."""
    out = []
    presets = load_presets(skip_unavailable=True)
    for name, cfg in presets.items():
        if cfg.needs_pca_basis:  # kvtc-*: a basis fitted on calibration KV (--basis)
            if basis is None:
                continue
            cfg = cfg.with_pca_basis(basis)
        if cfg.needs_codebooks:
            if kv is None:
                continue
            from kvtune.evaluate.calibrate_codebook import calibrate_codebooks

            cfg = calibrate_codebooks(cfg, [kv])
        target = TARGET_RANGE if cfg.codec.name == "range" else TARGET_BITPACK if cfg.codec.name == "bitpack" else None
        out.append(Case("preset", name, cfg, target))
        if cfg.codec.name == "range" and "rans" in CODECS:  # the same policy with the rANS codec
            rans = CODECS["rans"].from_dict({"name": "rans", "model": getattr(cfg.codec, "model", "per_channel")})
            out.append(Case("preset", f"{name} | rans", dataclasses.replace(cfg, codec=rans), TARGET_RANS))
    if basis is not None and "kvtc-3" in presets and "rans" in CODECS:
        cfg = presets["kvtc-3"].with_pca_basis(basis)
        keep = Keep(fraction=0.85, per_head=False)
        out.append(Case("preset", "keep 0.85 + kvtc-3 | rans",
                        dataclasses.replace(cfg, transforms=(keep, *cfg.transforms), codec=CODECS["rans"]()), TARGET_RANS))
        ecsq = {"name": "dp-alloc", "grid": "ecsq", "sink_tokens": 4}
        cfg = PolicyConfig.from_dict({"transforms": ["pca"], "key": {**ecsq, "bits": 1}, "value": {**ecsq, "bits": 2.5},
                                      "codec": "rans"}).with_pca_basis(basis)
        out.append(Case("preset", "pca + ecsq K 1 / V 2.5 | rans", cfg, TARGET_RANS))
        if lookup(basis).sensitivity:  # the default space's 97 % policy: one budget for the whole model
            model = {"name": "dp-alloc", "grid": "ecsq", "sink_tokens": 1, "budget": "model"}
            cfg = PolicyConfig.from_dict({"transforms": ["pca"], "key": {**model, "bits": 0.75},
                                          "value": {**model, "bits": 2}, "codec": "rans"}).with_pca_basis(basis)
            out.append(Case("preset", "pca + ecsq model K 0.75 / V 2 | rans", cfg, TARGET_RANS))
    kivi4, kivi2 = PolicyConfig.kivi(4), PolicyConfig.kivi(2)
    for label, base in (("KIVI-4", kivi4), ("KIVI-2", kivi2)):  # their symbols range- and rANS-coded per channel
        for codec, target in (("range", TARGET_RANGE), ("rans", TARGET_RANS)):
            if codec in CODECS:
                out.append(Case("preset", f"{label} | {codec}", dataclasses.replace(base, codec=CODECS[codec]()), target))
    return out


# ----------------------------------------------------------------------------- timing


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


class Memcpy:
    """``copy_`` of every KV tensor into preallocated tensors of the same shape and dtype."""

    def __init__(self, kv, threads: int) -> None:
        self.src = [t for pair in kv for t in pair]
        self.dst = [torch.empty_like(t) for t in self.src]
        self.src32 = [t.float() for t in self.src]
        self.dst32 = [torch.empty_like(t) for t in self.src32]
        self.nbytes = sum(t.numel() * t.element_size() for t in self.src)
        self.threads = threads
        self.device = self.src[0].device.type

    def _time(self, src, dst, threads: int) -> float:
        torch.set_num_threads(threads)
        try:
            _sync(self.device)
            t0 = time.perf_counter()
            for s, d in zip(src, dst):
                d.copy_(s)
            _sync(self.device)
            return time.perf_counter() - t0
        finally:
            torch.set_num_threads(self.threads)

    def sample(self, reps: int = 3) -> tuple[float, float, float]:
        """GB/s of (1-thread copy, N-thread copy, best of both): median of ``reps`` each.

        The N-thread copies run first: torch's OpenMP workers keep spinning for a while after a
        parallel copy, and on a 2-vCPU machine the spinning worker takes a core from the codec
        run that follows the sample (measured, 2-vCPU AMD EPYC, 2026-12-03: a ``kivi-2`` encode
        took 4.76 ms right after three 2-thread copies, 3.96 ms 50 ms later and 3.78 ms right
        after three 1-thread copies, medians of 20)."""
        many = statistics.median(self._time(self.src, self.dst, self.threads) for _ in range(reps))
        one = statistics.median(self._time(self.src, self.dst, 1) for _ in range(reps))
        return self.nbytes / one / 1e9, self.nbytes / many / 1e9, self.nbytes / min(one, many) / 1e9

    def sample_fp32(self, reps: int = 3) -> float:
        """GB/s (of float32 bytes) of the float32 copy, best of 1 and N threads."""
        t = min(statistics.median(self._time(self.src32, self.dst32, th) for _ in range(reps))
                for th in {1, self.threads})
        return 2 * self.nbytes / t / 1e9


@dataclass
class Result:
    case: Case
    ratio: float
    bits_per_element: float
    first_encode_s: float
    first_decode_s: float
    enc_gbps: list[float] = field(default_factory=list)
    dec_gbps: list[float] = field(default_factory=list)
    enc_rel: list[float] = field(default_factory=list)
    dec_rel: list[float] = field(default_factory=list)
    into_gbps: list[float] = field(default_factory=list)
    into_rel: list[float] = field(default_factory=list)
    fast: bool = True

    @property
    def enc(self) -> float:
        return statistics.median(self.enc_gbps)

    @property
    def dec(self) -> float:
        return statistics.median(self.dec_gbps)

    @property
    def enc_pct(self) -> float:
        return 100 * statistics.median(self.enc_rel)

    @property
    def dec_pct(self) -> float:
        return 100 * statistics.median(self.dec_rel)

    @property
    def into(self) -> float:
        return statistics.median(self.into_gbps)

    @property
    def into_pct(self) -> float:
        return 100 * statistics.median(self.into_rel)

    @property
    def verdict(self) -> str:
        """The targets against memcpy into preallocated tensors: encode, and decode into
        preallocated tensors (``decode_kv(out=...)``, as a serving engine fills its KV blocks)."""
        t = self.case.target
        if t is None:
            return ""
        return "ok" if self.enc_pct >= 100 * t[0] and self.into_pct >= 100 * t[1] else "MISSED"


BURST = 3
"""Back-to-back runs per sample (``--burst``), of the memcpy reference and of a codec alike (the
median is the sample). Both are measured in the state their own previous run leaves behind: a codec run
right after a memcpy sample (47 MB of copy traffic, torch's OpenMP workers still spinning) was
much slower than the next one (``kivi-2`` encode 4.4-4.9 ms, then 2.6-3.0 ms; 2-vCPU AMD EPYC,
2026-12-03), a cost the memcpy reference, run back to back, never pays."""


def run_case(case: Case, kv, scores, memcpy: Memcpy, repeats: int, device: str, check: bool, burst: int = BURST) -> Result:
    cfg = case.config.with_head_scores(scores) if case.config.needs_head_scores else case.config
    nbytes = original_nbytes(kv)
    t0 = time.perf_counter()
    stream = encode_kv(kv, cfg)
    t1 = time.perf_counter()
    out = decode_kv(stream)
    t2 = time.perf_counter()
    if check:
        ref = encode_kv(kv, cfg, impl="reference")
        assert ref == stream, f"{case.name}: fast and reference streams differ"
        for (k, v), (k2, v2) in zip(decode_kv(stream, impl="reference"), out):
            assert torch.equal(k, k2) and torch.equal(v, v2), f"{case.name}: decoded tensors differ"
    numel = sum(k.numel() + v.numel() for k, v in kv)
    res = Result(case, nbytes / len(stream), 8 * len(stream) / numel, t1 - t0, t2 - t1, fast=fastpath.supports(cfg))
    into = [(torch.empty_like(k), torch.empty_like(v)) for k, v in out]  # the decoded shapes (kept tokens too)
    for _ in range(repeats):
        for gbps, rel, run in ((res.enc_gbps, res.enc_rel, lambda: encode_kv(kv, cfg)),
                               (res.dec_gbps, res.dec_rel, lambda: decode_kv(stream)),
                               (res.into_gbps, res.into_rel, lambda: decode_kv(stream, out=into))):
            mc = memcpy.sample(burst)[2]
            t = _burst(run, device, burst)
            gbps.append(nbytes / t / 1e9)
            rel.append(nbytes / t / 1e9 / mc)
    return res


def _burst(fn, device: str, n: int) -> float:
    """Median seconds of ``n`` back-to-back calls of ``fn``."""
    times = []
    for _ in range(n):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _median_ms(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def stage_times(case: Case, kv, scores, memcpy: Memcpy, repeats: int) -> dict[str, float] | None:
    """Milliseconds (medians of ``repeats``) of one encode and one decode of ``case`` and of
    their fast-path stages (see the module docstring), and of the memcpy reference; None when
    the policy does not run on the fast path or the KV is not on the CPU."""
    from kvtune.codecs.checksum import crc32_threaded
    from kvtune.codecs.kvtensors import DTYPE_NAMES
    from kvtune.codecs.select import select_kv, selecting_transform, without_selection
    from kvtune.codecs.stream import read_header, stream_head, write_stream, write_stream_in_place

    cfg = case.config.with_head_scores(scores) if case.config.needs_head_scores else case.config
    if not fastpath.supports(cfg) or kv[0][0].device.type != "cpu":
        return None
    stream = encode_kv(kv, cfg)
    header = read_header(stream)
    # as encode_kv / decode_kv: a keep policy selects the tokens first, and the codec threads
    # run the rest of the policy on the kept ones (with their positions, the same both ways)
    keep, inner = selecting_transform(cfg), without_selection(cfg)
    kv_in, positions, selection = kv, None, None
    if keep is not None:
        kv_in, selection = select_kv(kv, keep)
        positions = selection.positions
    shapes = [(tuple(k.shape), tuple(v.shape)) for k, v in kv_in]
    fields = dict(policy=cfg.to_dict(), policy_id=cfg.policy_id, layer_offset=0, dtype=DTYPE_NAMES[kv[0][0].dtype],
                  shapes=shapes, source_tokens=None if selection is None else selection.source_tokens,
                  masks=None if selection is None else selection.masks)
    batch = fastpath.encode_plan(inner, shapes, 0)
    if batch is not None:  # one kernel call per codec thread, straight into the stream
        buf = np.empty(int(batch.nbytes.sum()), np.uint8)
        threads = lambda: fastpath.encode_into(kv_in, batch, buf)  # noqa: E731
        assembly = lambda: write_stream_in_place(head=stream_head(**fields, lengths=batch.lengths),  # noqa: E731
                                                 nbytes=int(batch.nbytes.sum()), masks=fields["masks"],
                                                 write_sections=lambda b: 0)
    else:
        secs, crcs = fastpath.encode_tensors(kv_in, inner, 0, positions)  # held for the assembly below
        threads = lambda: fastpath.encode_tensors(kv_in, inner, 0, positions)  # noqa: E731
        assembly = lambda: write_stream(**fields, sections=secs, crcs=crcs)  # noqa: E731
    body = memoryview(stream)[: len(stream) - header.checksum_nbytes]
    out = {
        "memcpy": 1e3 * memcpy.nbytes / memcpy.sample()[2] / 1e9,
        "encode": _median_ms(lambda: encode_kv(kv, cfg), repeats),
        "selection": _median_ms(lambda: select_kv(kv, keep), repeats) if keep is not None else 0.0,
        "encode threads": _median_ms(threads, repeats),
        "assembly": _median_ms(assembly, repeats),
        "decode": _median_ms(lambda: decode_kv(stream), repeats),
        "validation": _median_ms(lambda: read_header(stream, verify_checksum=False), repeats),
        "crc": _median_ms(lambda: crc32_threaded(body), repeats),
        "decode threads": _median_ms(lambda: fastpath.decode_tensors(stream, header, None, inner, positions=positions,
                                                                     check_crc=True), repeats),
    }
    out["encode rest"] = out["encode"] - out["selection"] - out["encode threads"] - out["assembly"]
    out["decode rest"] = out["decode"] - out["validation"] - out["decode threads"]
    return out


def stage_table(stages: list[tuple[str, dict[str, float]]]) -> list[str]:
    lines = ["| preset | memcpy ms | encode ms | token selection | codec threads | assembly | rest | decode ms | "
             "validation | codec threads with CRC (a separate CRC pass) | rest |", "|" + "---|" * 11]
    for name, t in stages:
        lines.append(f"| {name} | {t['memcpy']:.2f} | {t['encode']:.2f} | {t['selection']:.2f} | {t['encode threads']:.2f} | "
                     f"{t['assembly']:.2f} | {t['encode rest']:.2f} | {t['decode']:.2f} | {t['validation']:.2f} | "
                     f"{t['decode threads']:.2f} ({t['crc']:.2f}) | {t['decode rest']:.2f} |")
    return lines


# ----------------------------------------------------------------------------- report


def table(results: list[Result]) -> list[str]:
    head = ("| group | case | encode GB/s | encode % memcpy | decode GB/s | decode % memcpy | decode into preallocated "
            "GB/s | % memcpy | ratio | bits/elem | first call s (enc/dec) | target |")
    lines = [head, "|" + "---|" * 12]
    for r in results:
        target = (f"{100 * r.case.target[0]:.0f} / {100 * r.case.target[1]:.0f} % {r.verdict}"
                  if r.case.target is not None else "")
        path = "" if r.fast else " (reference path)"
        lines.append(
            f"| {r.case.group} | {r.case.name}{path} | {r.enc:.3f} | {r.enc_pct:.1f} | {r.dec:.3f} | {r.dec_pct:.1f} | "
            f"{r.into:.3f} | {r.into_pct:.1f} | {r.ratio:.2f} | {r.bits_per_element:.2f} | {r.first_encode_s:.2f} / {r.first_decode_s:.2f} | {target} |"
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    ap.add_argument("--contexts", type=int, default=1)
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--burst", type=int, default=BURST, help=f"back-to-back runs per sample (default {BURST}; 1: the "
                    "codec runs right after the memcpy sample, as before 2026-12-03)")
    ap.add_argument("--threads", type=int, default=2, help="torch and codec threads (default 2)")
    ap.add_argument("--out", type=Path, default=None, help="write the markdown report here")
    ap.add_argument("--kv", type=Path, default=None, help="cache file for the captured KV and head scores")
    ap.add_argument("--only", default=None,
                    help="run only cases whose name contains one of these comma-separated texts")
    ap.add_argument("--stages", action="store_true", help="also time the stages of each preset's encode and decode")
    ap.add_argument("--check", action="store_true", help="also check fast == reference bytes for every case")
    ap.add_argument("--basis", type=Path, default=None,
                    help="PCA basis file for the kvtc-* presets (fitted on 2 other windows and saved when absent)")
    args = ap.parse_args(argv)

    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    torch.set_num_threads(args.threads)
    fastpath.set_num_threads(args.threads)
    load_before = os.getloadavg()
    kv, scores = load_kv(device, args.contexts, args.tokens, args.kv)
    nbytes = original_nbytes(kv)

    from kvtune.codecs import kernels

    t0 = time.perf_counter()
    kernels.warm_up()
    warm = time.perf_counter() - t0

    memcpy = Memcpy(kv, args.threads)
    basis = load_or_fit_basis(args.basis, args.contexts, args.tokens) if args.basis else None
    cases = component_cases() + preset_cases(basis, kv)
    if args.only:
        wanted = [w for w in args.only.split(",") if w]
        cases = [c for c in cases if any(w in c.name for w in wanted)]
        if not cases:
            raise SystemExit(f"--only {args.only!r} matches no case name (e.g. 'kivi-4', 'quarot-4', 'KIVI-2 | rans')")
    results = []
    mc_samples = []
    for case in cases:
        r = run_case(case, kv, scores, memcpy, args.repeats, device, args.check, args.burst)
        results.append(r)
        mc_samples.append(memcpy.sample())
        print(f"{case.group:9s} {case.name:40s} enc {r.enc:6.3f} GB/s {r.enc_pct:5.1f}%  dec {r.dec:6.3f} GB/s "
              f"{r.dec_pct:5.1f}%  into {r.into:6.3f} GB/s {r.into_pct:5.1f}%  ratio {r.ratio:5.2f}  {r.verdict}",
              flush=True)
    stages = []
    if args.stages:
        for case in cases:
            t = stage_times(case, kv, scores, memcpy, args.repeats) if case.group == "preset" else None
            if t is not None:
                stages.append((case.name, t))
    fp32 = memcpy.sample_fp32()
    load_after = os.getloadavg()

    mc1 = statistics.median(s[0] for s in mc_samples)
    mcn = statistics.median(s[1] for s in mc_samples)
    shape = tuple(kv[0][0].shape)
    lines = [
        "# kvtune codec throughput",
        "",
        f"- data: SmolLM2-135M-Instruct KV, {len(kv)} layers x K and V of {shape} bfloat16 "
        f"({nbytes / 1e6:.1f} MB), {args.contexts} context(s) of {args.tokens} tokens of paul-graham-essays",
        f"- machine: {cpu_model()}, {os.cpu_count()} CPUs, device {device}, "
        f"torch {torch.__version__}, {args.threads} thread(s)",
        f"- load average (1/5/15 min): {load_before[0]:.2f}/{load_before[1]:.2f}/{load_before[2]:.2f} at start, "
        f"{load_after[0]:.2f}/{load_after[1]:.2f}/{load_after[2]:.2f} at end",
        f"- memcpy reference (bf16 KV, copy_ into preallocated tensors, medians): "
        f"{mc1:.2f} GB/s with 1 thread, {mcn:.2f} GB/s with {args.threads}; the faster is used per sample. "
        f"float32 copy of the same tensors: {fp32:.2f} GB/s (of float32 bytes)",
        f"- OMP_WAIT_POLICY={OMP_WAIT} (torch's OpenMP workers; PASSIVE unless set: see the script)",
        f"- kernels ready in {warm:.1f} s (compile on first use after an edit, else loaded from the numba cache)",
        f"- {args.repeats} repeats after one warm-up call per case, each the median of {args.burst} back-to-back runs "
        "(the memcpy samples too); GB/s of original bf16 KV, medians; "
        "% memcpy = median over repeats of codec GB/s / adjacent memcpy GB/s; decode allocates fresh output tensors, "
        "decode into preallocated fills tensors allocated once (decode_kv(out=...), as a serving engine fills its KV "
        "blocks and as the memcpy reference copies)",
        "",
        *table(results),
        "",
    ]
    missed = [r for r in results if r.verdict == "MISSED"]
    lines.append("Targets (encode, and decode into preallocated tensors): bit-packed presets >= 40 % of memcpy to "
                 "encode and >= 50 % to decode, range-coded presets >= 3 %, rANS-coded >= 10 %: "
                 + ("all met." if not missed else "missed by " + ", ".join(r.case.name for r in missed) + "."))
    if stages:
        lines += ["", "Stages of one encode and one decode (ms, medians; fast path, see the module docstring):", "",
                  *stage_table(stages)]
    text = "\n".join(lines) + "\n"
    print()
    print(text)
    if args.out:
        args.out.write_text(text)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
