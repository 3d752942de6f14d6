"""Fast path of :func:`~kvtune.codecs.encode_kv` / :func:`~kvtune.codecs.decode_kv`.

The reference pipeline (:mod:`kvtune.codecs.policy`) runs each component's torch code segment
by segment: clear, and the oracle. This module produces **the same stream bytes and the same
decoded tensors** with the compiled kernels of :mod:`kvtune.codecs.kernels`:

* no torch operation on the data (under CPU contention every multi-threaded torch op waits for
  a descheduled OpenMP thread; a bfloat16 tensor is read through its ``uint16`` bits),
* the segment plan of every ``(policy, layer, kind, shape)`` is computed once (by the
  reference :meth:`~kvtune.codecs.base.Quantizer.plan`) and cached with its index arrays,
* K and V tensors are independent tasks shared by the calling thread and a small thread pool
  (the kernels and zlib release the GIL); each task also computes the CRC32 of its sections
  while they are in cache, and the stream writer combines them
  (:func:`kvtune.codecs.kernels.crc32_combine`) instead of reading the stream again; the
  decoder does the same to verify the stream's checksum (``decode_tensors(check_crc=True)``),
* a ``bitpack`` tensor decodes in one kernel call (:func:`kvtune.codecs.kernels.decode_tensor`,
  CRC, segments), so a codec thread takes the GIL back once per tensor: with two threads, each
  re-take can wait for the other thread's Python,
* a ``bitpack`` policy of block quantizers (KIVI, ``fp8``, ``none``, MixHQ, codebooks, with
  or without ``hadamard`` / ``delta`` / ``affine`` transforms: QuaRot, CacheGen's deltas)
  goes further, the *batch route*: its section lengths follow from the plans alone, so the
  stream header is written first and every tensor is encoded straight into the stream's
  ``bytes`` (:func:`kvtune.codecs.newbytes.filled_bytes`, no join) and decoded straight into
  the output tensors, all tensors of the cache in one kernel call per codec thread, the threads
  claiming tensors from a shared atomic counter (:func:`encode_plan` / :func:`encode_into`,
  :func:`decode_plan` / :func:`decode_into`; :mod:`kvtune.codecs.kernels.batch`; transforms
  run inside the same calls, on a per-thread float32 work array, except a lone ``hadamard``
  before per-token quantization, which the quantizer applies to the rows it loads). The plans are stacked once
  per cache shape (encode) or stream header (decode); the decode kernels also check the
  float16 transform state and metadata while they are in cache (per tensor:
  :func:`kvtune.codecs.kernels.encode_tensor`, input check, segments, CRC, and
  :func:`~kvtune.codecs.kernels.decode_tensor`),
* metadata and payload are written straight into numpy buffers whose bytes are the sections.

Supported: transforms ``identity``, ``hadamard``, ``delta``, ``affine``; block quantizers
``uniform``, ``none``, ``fp8`` and ``codebook`` (hence the ``uniform``, ``none``, ``mixhq``,
``fp8`` and ``codebook`` quantizers, and any quantizer whose plan only uses those block
kernels); any codec (``bitpack`` has its own kernel; ``rans`` too, one call per tensor each way
that quantizes and codes every segment with its CRC, :func:`kvtune.codecs.kernels.rans_encode_tensor`,
or reads every payload with its CRC, :func:`kvtune.codecs.kernels.rans_unpack_tensor`, from the
plan's :class:`kvtune.codecs.rans.RansProgram`; other codecs receive the symbols as numpy
arrays). KVTC-like policies (one ``pca`` transform, after a ``keep`` or not, then ``dp-alloc``
on K and V, either grid) have their own path: the projection runs the ``pca``
transform's own torch code (float32 matrix products; after ``keep``, pre-RoPE keys are
un-rotated at the kept tokens' positions, as on the reference path) onto the leading components
the allocation keeps only, where :func:`kvtune.codecs.pca.leading_width` finds that the
truncated products give the full products' bits (the decoder likewise skips the components it
holds as 0), then every segment of the tensor is quantized by one kernel call
(:func:`kvtune.codecs.kernels.quantize_components`) and handed to the codec. Anything else -- a
newly registered component, a big-endian host, numba missing -- uses the reference path
(:func:`supports` says which). Select the implementation with ``impl=`` on
:func:`~kvtune.codecs.encode_kv` / :func:`~kvtune.codecs.decode_kv`.

Ranges: like the reference, encoding refuses a value beyond a segment's block range
(:func:`kvtune.codecs.base.check_value_range`, run only when the tensor's largest magnitude,
found by the same pass as the NaN / inf check, exceeds the plan's smallest limit), and a
float16 output saturates at +-65504 (:func:`kvtune.codecs.kvtensors.to_output_dtype`).

Threads: :func:`num_threads` (default: ``torch.get_num_threads()``). The output never depends
on it.
"""

from __future__ import annotations

import functools
import math
import sys
import threading
from dataclasses import dataclass, field
from typing import Mapping, Sequence

import numpy as np
import torch

from kvtune.codecs.base import (
    BF16_BITS,
    Quantizer,
    Segment,
    check_value_range,
    transform_min_bits,
    transform_state_nbytes,
)
from kvtune.codecs.bitalloc import GAUSSIAN_STEPS, DPAlloc
from kvtune.codecs.bitpack import BitPack
from kvtune.codecs.checksum import crc32
from kvtune.codecs.codebook import MAX_BITS, CodebookQuantizer, check_levels, nf_table
from kvtune.codecs.fp8 import FP8_DTYPES, FP8Quantizer, fp8_encode
from kvtune.codecs.kvtensors import NAME_DTYPES, NON_FINITE, to_output_dtype
from kvtune.codecs.pca import PCA, leading_width
from kvtune.codecs.quantizers import FP16_MAX, NoQuantizer, UniformQuantizer
from kvtune.codecs.rans import RansCodec, RansProgram, tensor_program
from kvtune.codecs.select import is_selecting
from kvtune.codecs.stream import check_checksum, section_views
from kvtune.codecs.threads import num_threads, parallel_map, set_num_threads
from kvtune.codecs.transforms import Affine, Delta, Hadamard, block_scales, power_of_two_blocks
from kvtune.core.errors import CorruptStreamError, KVInputError

try:  # numba is a dependency; without it everything still works on the reference path
    from kvtune.codecs import kernels as K
except ImportError:  # pragma: no cover - exercised only without numba
    K = None  # type: ignore[assignment]

__all__ = [
    "available",
    "supports",
    "num_threads",
    "set_num_threads",
    "encode_tensors",
    "decode_tensors",
    "BatchPlan",
    "encode_plan",
    "encode_into",
    "decode_plan",
    "decode_into",
    "sizes_plausible",
    "nonfinite_float16_error",
    "first_nonfinite_f16",
    "all_finite",
    "LayerDecodeError",
]

_OK_BYTEORDER = sys.byteorder == "little"


def available() -> bool:
    """Whether the compiled kernels can be used here (numba importable, little-endian host)."""
    return K is not None and _OK_BYTEORDER


# ----------------------------------------------------------------------------- plans

_SUPPORTED_TRANSFORMS = ("hadamard", "delta", "affine")


def _block_kind(coder: Quantizer) -> str | None:
    """Which kernel family codes a segment of this block quantizer (exact types only: a
    subclass may change the math)."""
    return {UniformQuantizer: "uniform", NoQuantizer: "bf16", FP8Quantizer: "fp8", CodebookQuantizer: "codebook"}.get(type(coder))


def _is_kvtc(config) -> bool:
    """One ``pca`` transform (after a leading ``keep``, if any), then ``dp-alloc`` on K and V
    (exact types; any grid)."""
    rest = [t for t in config.transforms if not is_selecting(t)]
    return (len(rest) == 1 and type(rest[0]) is PCA
            and all(type(q) is DPAlloc for q in (config.key, config.value)))


@functools.lru_cache(maxsize=256)
def supports(config) -> bool:
    """Whether :func:`encode_tensors` / :func:`decode_tensors` can run ``config``.

    True when the kernels are :func:`available`, and the policy is KVTC-like (:func:`_is_kvtc`)
    or every transform is a supported one and every block quantizer the K and V plans can use
    is ``uniform``, ``none``, ``fp8`` or ``codebook``. A leading ``keep``
    (:mod:`kvtune.codecs.select`) does not count: it runs before the kernels (``keep`` +
    ``pca`` gives the ``pca`` transform the kept tokens' positions, as the reference does).
    """
    if not available():
        return False
    if _is_kvtc(config):
        return True
    if any(type(t) not in (Hadamard, Delta, Affine) for t in config.transforms if not is_selecting(t)):
        return False
    floors = tuple(sorted({b for t in config.transforms for b in t.min_bits_values()}))
    for quant in (config.key, config.value):
        try:
            widths = quant.symbol_widths(floors)
            coders = {quant.coder(max(f, w)) for f in {0, *floors, *quant.window_widths()} for w in quant.head_widths()}
        except Exception:  # a quantizer that cannot even list its widths: leave it to the reference
            return False
        if any(_block_kind(c) is None for c in coders) or not widths:
            return False
    return True


@dataclass(frozen=True, eq=False)
class _Plan:
    """Everything the kernels need for one ``(policy, kind, shape, layer)``.

    Attributes:
        shape: the tensor shape.
        transforms: per transform ``(name, *kernel parameters)``.
        state_nbytes: bytes of the transforms' state section.
        segments: the reference plan's :class:`~kvtune.codecs.base.Segment` s.
        segs: int64 ``(S, SEG_COLUMNS)`` table (:data:`kvtune.codecs.kernels.SEG_COLUMNS`);
            metadata and payload offsets are those of the ``bitpack`` layout
            ``[state, meta_0, payload_0, meta_1, ...]``.
        idx: int64 head and token indices of all segments.
        nbytes: bytes of the tensor's sections with ``bitpack``.
        sym_nbytes: bytes of all segments' raw symbols (uint8, 2 per bfloat16 symbol).
        whole_bf16: the plan is one bfloat16 segment covering the tensor (a bfloat16 input is
            then its own payload).
        bounds: ``(start, end)`` of every section in the ``bitpack`` layout (wire order).
        max_bits: the widest symbol of the integer segments (0 when there are none).
        max_numel: elements of the largest segment.
        checks: per segment ``(bits, count, metadata bytes, bitpack payload bytes)``.
        value_limit: the smallest :attr:`~kvtune.codecs.base.Quantizer.value_limit` of the
            segments' coders.
        books: the policy's codebook levels for the kernels (:attr:`_Compiled.books`).
        rans: with the ``rans`` codec, the segments' rANS coding for
            :func:`kvtune.codecs.kernels.rans_encode_tensor` (:func:`kvtune.codecs.rans.tensor_program`).
    """

    shape: tuple[int, ...]
    transforms: tuple[tuple, ...]
    state_nbytes: int
    segments: tuple[Segment, ...]
    segs: np.ndarray
    idx: np.ndarray
    nbytes: int
    sym_nbytes: int
    whole_bf16: bool
    bounds: tuple[tuple[int, int], ...] = ()
    max_bits: int = 0
    max_numel: int = 0
    checks: tuple[tuple[int, int, int, int], ...] = ()
    value_limit: float = math.inf
    books: np.ndarray | None = None
    rans: RansProgram | None = None


@functools.lru_cache(maxsize=1)
def _fp8_luts() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Tables made by torch's own casts (so exact by construction), for e4m3fn and e5m2:
    float32 ``(2, 256)`` value of every float8 pattern, uint16 ``(2, 256)`` its bfloat16 bits,
    uint8 ``(2, 65536)`` the float8 symbol of every bfloat16 pattern (saturated as
    :func:`kvtune.codecs.fp8.fp8_encode`)."""
    values, bf16, symbols = [], [], []
    all_bf16 = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).to(torch.float32)
    for fmt in ("e4m3", "e5m2"):
        v = torch.arange(256, dtype=torch.uint8).view(FP8_DTYPES[fmt]).to(torch.float32)
        values.append(v.numpy())
        bf16.append(v.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16))
        symbols.append(fp8_encode(all_bf16, fmt).numpy())
    return (np.ascontiguousarray(np.stack(values), np.float32), np.ascontiguousarray(np.stack(bf16)),
            np.ascontiguousarray(np.stack(symbols)))


def _index(sel, n: int) -> np.ndarray:
    if sel is None:
        return np.arange(n, dtype=np.int64)
    if isinstance(sel, slice):
        return np.arange(n, dtype=np.int64)[sel]
    return sel.numpy().astype(np.int64)


def _segment_table(segments: Sequence[Segment], shape: tuple[int, ...], state_nbytes: int,
                   book_rows: Mapping[tuple[float, ...], int]):
    """``(segs, idx, nbytes, sym_nbytes)`` of :class:`_Plan`; ``book_rows`` maps calibrated
    codebook levels to their row of the policy's ``books`` (:class:`_Compiled`)."""
    rows, idx = [], []
    pos, sym_pos, ipos = state_nbytes, 0, 0
    for seg in segments:
        coder, kind = seg.coder, _block_kind(seg.coder)
        b, hs, ts, d = seg.shape
        heads, tokens = _index(seg.heads, shape[1]), _index(seg.tokens, shape[2])
        row = [0] * K.SEG_COLUMNS
        row[K.SEG_BITS] = seg.bits
        if kind == "uniform":
            row[K.SEG_KIND] = K.KIND_UNIFORM
            row[K.SEG_A] = int(coder.granularity == "per_token")
            row[K.SEG_G] = max(coder.group_size or (d if coder.granularity == "per_token" else ts), 1)
            row[K.SEG_B] = int(coder.symmetric)
        elif kind == "codebook":
            row[K.SEG_KIND] = K.KIND_CODEBOOK
            row[K.SEG_A] = int(coder.granularity == "per_token")
            row[K.SEG_G] = max(coder.group_size or (d if coder.granularity == "per_token" else ts), 1)
            row[K.SEG_B] = K.CB_MINMAX * (coder.normalize == "minmax") + K.CB_LLOYD * (coder.levels == "lloyd")
            row[K.SEG_BOOK] = book_rows[coder.codebooks[0]] if coder.levels == "calibrated" else seg.bits
        elif kind == "fp8":
            row[K.SEG_KIND] = K.KIND_FP8
            row[K.SEG_A] = int(coder.format == "e5m2")
            row[K.SEG_B] = int(coder.scaled)
        else:
            row[K.SEG_KIND] = K.KIND_BF16
        row[K.SEG_HEADS], row[K.SEG_NHEADS] = ipos, len(heads)
        row[K.SEG_TOKENS], row[K.SEG_NTOKENS] = ipos + len(heads), len(tokens)
        ipos += len(heads) + len(tokens)
        idx += [heads, tokens]
        meta = sum(f.nbytes for f in seg.meta_layout)
        count = seg.numel
        payload = 2 * count if seg.bits == BF16_BITS else (count * seg.bits + 7) // 8
        row[K.SEG_META], row[K.SEG_META_LEN] = pos, meta
        row[K.SEG_PAYLOAD], row[K.SEG_PAYLOAD_LEN] = pos + meta, payload
        row[K.SEG_SYM] = sym_pos
        pos += meta + payload
        sym_pos += 2 * count if seg.bits == BF16_BITS else count
        rows.append(row)
    segs = np.array(rows, dtype=np.int64).reshape(len(rows), K.SEG_COLUMNS)
    idx_arr = np.concatenate(idx) if idx else np.zeros(0, np.int64)
    return segs, idx_arr.astype(np.int64), pos, sym_pos


@dataclass(frozen=True, eq=False)
class _ComponentPlan:
    """A KVTC-like tensor's plan for :func:`kvtune.codecs.kernels.quantize_components`.

    Attributes:
        shape: the tensor shape.
        segments: the reference plan (``dp-alloc``: the bfloat16 sink segment, if any, then one
            :class:`~kvtune.codecs.bitalloc.ComponentSegment` per width).
        first: sink tokens; comp, start, bits: the kernels' component table (int64).
        checks: per segment ``(bits, count, metadata bytes)``.
        value_limit: the smallest block range of the segments.
        width: the leading components the projections compute
            (:func:`kvtune.codecs.pca.leading_width`).
    """

    shape: tuple[int, ...]
    segments: tuple[Segment, ...]
    first: int
    comp: np.ndarray
    start: np.ndarray
    bits: np.ndarray
    checks: tuple[tuple[int, int, int], ...]
    value_limit: float
    grid: int = 0  # the dp-alloc grid (kernels.GRID_CODES)
    step: float = 0.0  # the ecsq grid's planned step
    width: int = 0
    state_nbytes: int = 0  # the pca transform has no state


def _component_plan(segments: tuple[Segment, ...], shape: tuple[int, ...], grid: str) -> _ComponentPlan:
    b, h, t, d = shape
    first = segments[0].shape[2] if segments and segments[0].bits == BF16_BITS else 0
    comps = [s for s in segments if s.bits != BF16_BITS]
    idx = [(s.head_idx * d + s.chan_idx).numpy().astype(np.int64) for s in comps]
    comp = np.concatenate(idx) if idx else np.zeros(0, np.int64)
    start = np.cumsum([0] + [len(i) for i in idx]).astype(np.int64)
    checks = tuple((s.bits, s.numel, sum(f.nbytes for f in s.meta_layout)) for s in segments)
    width = leading_width(b, t, h * d, int(comp.max()) + 1 if comp.size else 0, first)
    return _ComponentPlan(shape, tuple(segments), first, comp, start, np.array([s.bits for s in comps], np.int64), checks,
                          min((s.coder.value_limit for s in segments), default=math.inf), K.GRID_CODES[grid],
                          next((s.coder.step for s in comps), 0.0), width)


_GAUSS = np.array(GAUSSIAN_STEPS, np.float64)


def _encode_components(t: torch.Tensor, plan: _ComponentPlan, comp: _Compiled, kind: str, layer: int,
                       positions: torch.Tensor | None) -> tuple[list, int, int]:
    """A KVTC-like tensor -> ``(sections, crc32, bytes)``: the ``pca`` transform of the leading
    components the plan keeps (:meth:`~kvtune.codecs.pca.PCA.forward_leading`, torch, the
    reference's bits, with the rows' ``positions`` after ``keep``), the range check, one
    quantization kernel call, then the codec per segment."""
    pca = comp.config.transforms[0]
    x = t.detach().to("cpu")
    x = x.to(torch.float32) if x.dtype == torch.float64 else x
    y, ysink = pca.forward_leading(x, plan.width, plan.first, layer=layer, kind=kind, positions=positions)
    yn, sn = y.numpy(), ysink.numpy()
    if not max(_magnitude(yn)[1], _magnitude(sn)[1]) <= plan.value_limit:  # NaN too
        check_value_range(plan.segments, pca.forward(x.to(torch.float32), layer=layer, kind=kind, positions=positions),
                          layer=layer, kind=kind)
    b, h, tokens, d = plan.shape
    nt = tokens - plan.first
    sink = np.empty((b, h, plan.first, d), np.uint16)
    meta = np.empty(2 * b * int(plan.start[-1]), np.uint16)
    sym = np.empty(b * nt * int(plan.start[-1]), np.uint8)
    K.quantize_components(yn, sn, plan.comp, plan.start, plan.bits, _GAUSS, plan.grid, plan.step, sink, meta, sym)
    codec = comp.config.codec
    sections = [b""]
    if plan.first:
        sections += [b"", codec.pack(sink, BF16_BITS)]
    segs = plan.segments[1:] if plan.first else plan.segments
    for s, seg in enumerate(segs):
        lo, hi = int(plan.start[s]), int(plan.start[s + 1])
        sections.append(memoryview(meta[2 * b * lo : 2 * b * hi].view(np.uint8)))
        sections.append(codec.pack(sym[b * nt * lo : b * nt * hi].reshape(seg.shape), seg.bits))
    crc, n = 0, 0
    for sec in sections:
        crc = crc32(sec, crc)
        n += len(sec)
    return sections, crc, n


def _decode_components(sections, plan: _ComponentPlan, comp: _Compiled, kind: str, layer: int, dtype, dest, positions):
    """Inverse of :func:`_encode_components` (the reference's checks, in its order). Every
    segment is decoded (its codec checking the count against its payload) before anything is
    allocated from the claimed shape, as on the reference path: a stream whose ``dp-alloc``
    drops most components has many elements per byte, yet decodes here. A NaN or inf in the
    bfloat16 sink tokens raises CorruptStreamError (:func:`nonfinite_payload_error`)."""
    codec = comp.config.codec
    b, h, tokens, d = plan.shape
    nt = tokens - plan.first
    decoded = []
    for seg, (bits, count, mlen), mbytes, payload in zip(plan.segments, plan.checks, sections.meta, sections.payload):
        symbols = codec.unpack(payload, bits, count, shape=seg.shape)
        if len(mbytes) != mlen:
            raise CorruptStreamError(f"metadata section has {len(mbytes)} bytes, the policy needs {mlen}")
        decoded.append((bits, mbytes, symbols))
    sink = np.zeros((b, h, plan.first, d), np.uint16)
    meta = np.empty(2 * b * int(plan.start[-1]), np.uint16)
    sym = np.empty(b * nt * int(plan.start[-1]), np.uint8)
    s = 0
    for bits, mbytes, symbols in decoded:
        if bits == BF16_BITS:
            sink[...] = symbols.reshape(sink.shape)
            if not K.all_finite_bf16(sink):
                raise nonfinite_payload_error(layer, "K" if kind == "key" else "V")
            continue
        lo, hi = int(plan.start[s]), int(plan.start[s + 1])
        meta[2 * b * lo : 2 * b * hi] = np.frombuffer(mbytes, "<u2")
        sym[b * nt * lo : b * nt * hi] = symbols.reshape(-1)
        s += 1
    del decoded
    y = np.empty((b, tokens, plan.width), np.float32)
    ysink = np.empty((b, plan.first, h * d), np.float32)
    K.dequantize_components(sym, meta, plan.comp, plan.start, plan.bits, plan.grid, sink, ysink, y)
    pca = comp.config.transforms[0]
    x = pca.inverse_leading(torch.from_numpy(y), torch.from_numpy(ysink), plan.shape, layer=layer, kind=kind,
                            positions=positions)
    if dest is None:
        return to_output_dtype(x, dtype).contiguous()
    dest.copy_(x if dest.dtype == dtype and dtype != torch.float16 else to_output_dtype(x, dtype))  # copy_ rounds as .to
    return dest


_MAX_PLANS = 1024
"""Plans cached per policy (each is linear in the tensor's heads and tokens)."""
_MAX_BATCHES = 64
"""Batch plans cached per policy (cache shapes to encode, stream headers to decode)."""
_MAX_BATCH_TENSORS = 4096
"""Tensors of the batch plans cached per policy, all plans together (a plan keeps ~1-10 KB per
tensor: segment rows and head / token indices): streams of thousands of layers, or many
distinct headers, do not pile up memory."""
_MISSING = object()


def _books(config) -> tuple[np.ndarray, dict[tuple[float, ...], int]]:
    """``(books, rows)``: the NF levels (:func:`~kvtune.codecs.codebook.nf_table`, rows 0-8)
    followed by every distinct calibrated codebook of ``config``'s quantizers (read-only float64
    ``(R, 256)``), and the row of each calibrated codebook."""
    rows: dict[tuple[float, ...], int] = {}
    extra = []
    for quant in (config.key, config.value):
        for levels in getattr(quant, "codebooks", ()):
            if levels not in rows:
                rows[levels] = MAX_BITS + 1 + len(extra)
                extra.append(np.pad(np.array(levels, np.float64), (0, 2**MAX_BITS - len(levels))))
    if not extra:
        return nf_table(), rows
    books = np.vstack([nf_table(), *extra])
    books.setflags(write=False)
    return books, rows


def _batch_books(batch) -> np.ndarray:
    """The codebook levels of a batch plan's policy (its tensor plans share them)."""
    return batch.plans[0].books if batch.plans else nf_table()


class _Compiled:
    """Per-policy cache of tensor plans, and the policy's codebook levels (:attr:`books`)."""

    def __init__(self, config) -> None:
        self.config = config
        self.books, self.book_rows = _books(config)
        self.plans: dict[tuple, _Plan] = {}
        self.batches: dict[tuple, BatchPlan | None] = {}
        self.batch_tensors = 0
        self.bitpack = type(config.codec) is BitPack
        self.kvtc = _is_kvtc(config)

    def plan(self, kind: str, shape: tuple[int, ...], layer: int) -> _Plan:
        key = (kind, shape, layer)
        p = self.plans.get(key)
        if p is None:
            if len(self.plans) >= _MAX_PLANS:  # many shapes (e.g. streams of other requests): start over
                self.plans.clear()
            p = self.plans[key] = self._build(kind, shape, layer)  # a race only builds it twice
        return p

    def warm(self, tensors) -> None:
        """Build the missing plans of a KVTC-like policy for ``tensors`` (``(kind, shape,
        layer)`` items) on the calling thread, one after another, before the codec threads run.
        Their ``dp-alloc`` bit allocations are small torch operations that hold the GIL, so two
        codec threads making them at once took longer than one thread: the first encode in a
        process of ``benchmarks/codecs.py``'s per-layer ``pca + ecsq K 1 / V 2.5`` policy on the
        default model's KV (numba's start-up included) took 2.9-3.0 s on two threads and 2.0-2.5 s
        on one; 1.9 s on two with this pass (2026-12-04, one-off script). An error is left for
        the tasks to raise, in their order."""
        if not self.kvtc:
            return
        for kind, shape, layer in tensors:
            if math.prod(shape) and (kind, shape, layer) not in self.plans:
                try:
                    self.plan(kind, shape, layer)
                except Exception:  # raised again by the task that needs the plan, in order
                    return

    def batch(self, key: tuple, build) -> BatchPlan | None:
        """The batch plan cached under ``key`` (``build()`` makes it the first time; ``None``:
        the batch route does not apply). At most :data:`_MAX_BATCHES` plans and
        :data:`_MAX_BATCH_TENSORS` tensors are kept per policy (a larger plan is used once)."""
        b = self.batches.get(key, _MISSING)
        if b is not _MISSING:
            return b
        b = build()
        n = 0 if b is None else len(b.plans)
        if n <= _MAX_BATCH_TENSORS:
            if len(self.batches) >= _MAX_BATCHES or self.batch_tensors + n > _MAX_BATCH_TENSORS:
                self.batches.clear()
                self.batch_tensors = 0
            self.batches[key] = b
            self.batch_tensors += n
        return b

    def _build(self, kind: str, shape: tuple[int, ...], layer: int) -> _Plan | _ComponentPlan:
        cfg = self.config
        quant = cfg.key if kind == "key" else cfg.value
        if self.kvtc:
            return _component_plan(quant.plan(shape, layer=layer, kind=kind), shape, quant.grid)
        ops = []
        state_nbytes = 0
        for t in cfg.transforms:
            state_nbytes += sum(f.nbytes for f in t.state_layout(shape, layer=layer, kind=kind))
            if isinstance(t, Hadamard):
                signs = t.signs(shape, layer, kind).numpy().astype(np.float32)
                blocks = np.array(power_of_two_blocks(shape[3]), dtype=np.int64)
                ops.append(("hadamard", signs, blocks, np.array(block_scales(shape[3]), dtype=np.float32)))
            elif isinstance(t, Delta):
                ops.append(("delta", t.group_size))
            elif isinstance(t, Affine):
                ops.append(("affine", t.statistic == "rms", t.shift))
        segments = quant.plan(shape, layer=layer, kind=kind, min_bits=transform_min_bits(cfg.transforms, shape[2]))
        segs, idx, nbytes, sym_nbytes = _segment_table(segments, shape, state_nbytes, self.book_rows)
        whole = len(segments) == 1 and segments[0].is_whole and segments[0].bits == BF16_BITS
        bounds = [(0, state_nbytes)]
        for row in segs.tolist():
            bounds.append((row[K.SEG_META], row[K.SEG_META] + row[K.SEG_META_LEN]))
            bounds.append((row[K.SEG_PAYLOAD], row[K.SEG_PAYLOAD] + row[K.SEG_PAYLOAD_LEN]))
        max_bits = max((s.bits for s in segments if s.bits != BF16_BITS), default=0)
        max_numel = max((s.numel for s in segments), default=0)
        checks = tuple((s.bits, s.numel, row[K.SEG_META_LEN], row[K.SEG_PAYLOAD_LEN]) for s, row in zip(segments, segs.tolist()))
        value_limit = min((s.coder.value_limit for s in segments), default=math.inf)
        rans = None
        if type(cfg.codec) is RansCodec:
            rans = tensor_program(cfg.codec.model, [(s.bits, tuple(s.shape), row[K.SEG_SYM])
                                                    for s, row in zip(segments, segs.tolist())])
        return _Plan(shape, tuple(ops), state_nbytes, tuple(segments), segs, idx, nbytes, sym_nbytes, whole,
                     tuple(bounds), max_bits, max_numel, checks, value_limit, self.books, rans)


@functools.lru_cache(maxsize=128)
def _compiled(config) -> _Compiled:
    return _Compiled(config)


# ----------------------------------------------------------------------------- encode


def _input_array(t: torch.Tensor) -> np.ndarray:
    """A C-contiguous numpy view of ``t``: bfloat16 as its uint16 bits, float32 as is, float16
    converted to float32 (exact); a copy when ``t`` is off the CPU, strided or a lazy negation
    view (``Tensor.is_neg``)."""
    t = t.detach()
    if t.is_neg():  # a lazy negation view: its memory holds -t
        t = t.resolve_neg()
    if t.device.type != "cpu":
        t = t.cpu()
    if not t.is_contiguous():
        t = t.contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(np.uint16)
    if t.dtype == torch.float32:
        return t.numpy()
    return t.numpy().astype(np.float32)


def _apply_transforms(x: np.ndarray, plan: _Plan, out: np.ndarray) -> np.ndarray:
    """float32 working copy of ``x`` with the transforms applied; their state is written to
    ``out[:plan.state_nbytes]`` (float16, little-endian, transform order)."""
    y = _work(x.shape)
    ops = plan.transforms
    if ops[0][0] == "delta":  # converted and delta coded in one pass
        K.delta_load(x, y, ops[0][1])
        ops = ops[1:]
    else:
        K.to_float32(x, y)
    h, d = x.shape[1], x.shape[3]
    pos = 0
    for op in ops:
        name = op[0]
        if name == "hadamard":
            K.hadamard_rows(y, op[1], op[2], op[3], False)
        elif name == "delta":
            K.delta_rows(y, op[1], False)
        else:  # affine
            rms, shift = op[1], op[2]
            st = np.empty((2 if shift else 1, h, d), np.uint16)
            K.affine_fit(y, rms, shift, st[0], st[-1])
            K.affine_rows(y, st[0], st[-1], shift, False)
            out[pos : pos + st.nbytes] = st.reshape(-1).view(np.uint8)
            pos += st.nbytes
    return y


def _magnitude(x: np.ndarray) -> tuple[bool, float]:
    """``(finite, amax)`` of a bfloat16-bits or float32 array in one pass
    (:func:`kvtune.codecs.kernels.max_magnitude_bf16` / ``max_magnitude_f32``): whether no
    value is NaN or inf, and the largest ``|x|`` (NaN or inf when one is)."""
    return _magnitude_of(x.dtype, K.max_magnitude_bf16(x) if x.dtype == np.uint16 else K.max_magnitude_f32(x))


def _magnitude_of(dtype, bits: int) -> tuple[bool, float]:
    """``(finite, amax)`` from the magnitude bits of a bfloat16-bits (uint16) or float32 array."""
    if dtype == np.uint16:
        return bits < 0x7F80, float(np.array([bits << 16], np.uint32).view(np.float32)[0])
    return bits < 0x7F800000, float(np.array([bits], np.uint32).view(np.float32)[0])


def _check_value_range(x: np.ndarray, amax: float, plan: _Plan, layer: int, kind: str) -> None:
    """Refuse values beyond a segment's block range, as the reference does
    (:func:`kvtune.codecs.base.check_value_range`, which words the error): the per-segment
    check runs only when the largest magnitude ``amax`` of ``x`` exceeds the smallest limit of
    the plan (or is NaN)."""
    if amax <= plan.value_limit:
        return
    y = torch.from_numpy(x.view(np.int16)).view(torch.bfloat16).float() if x.dtype == np.uint16 else torch.from_numpy(x)
    check_value_range(plan.segments, y, layer=layer, kind=kind)


_local = threading.local()
_TORCH_OF = {np.dtype(np.uint8): torch.uint8, np.dtype(np.uint16): torch.int16, np.dtype(np.float32): torch.float32}


def _empty(shape, dtype, *, zero: bool = False) -> np.ndarray:
    """A new numpy array whose memory comes from torch's CPU allocator.

    Measured: 60 fresh 384 KB numpy arrays cost ~9 ms in page faults (glibc maps and unmaps
    each one), the same through torch ~1 ms; decoded tensors are torch tensors anyway.
    """
    t = (torch.zeros if zero else torch.empty)(shape, dtype=_TORCH_OF[np.dtype(dtype)])
    return t.numpy().view(dtype)


def _scratch(nbytes: int) -> np.ndarray:
    """A per-thread uint8 scratch buffer of at least ``nbytes`` (reused across calls)."""
    buf = getattr(_local, "scratch", None)
    if buf is None or buf.size < nbytes:
        buf = _local.scratch = np.empty(max(nbytes, 1 << 16), np.uint8)
    return buf


def _state_scratch(n: int) -> np.ndarray:
    """A per-thread uint16 scratch of at least ``n`` elements (``affine`` state, reused)."""
    buf = getattr(_local, "state", None)
    if buf is None or buf.size < n:
        buf = _local.state = np.empty(max(n, 1 << 10), np.uint16)
    return buf


def _work(shape: tuple[int, ...]) -> np.ndarray:
    """A per-thread float32 working array of ``shape`` (the transforms' buffer, reused)."""
    n = math.prod(shape)
    buf = getattr(_local, "work", None)
    if buf is None or buf.size < n:
        buf = _local.work = np.empty(max(n, 1 << 14), np.float32)
    return buf[:n].reshape(shape)


def _encode_checked(x: np.ndarray, bits: int, plan: _Plan, kind: str, layer: int, index: int, out: np.ndarray):
    """After :func:`kvtune.codecs.kernels.encode_tensor` wrote nothing (its magnitude ``bits``
    were a NaN / inf or beyond ``plan.value_limit``; :func:`encode_into`): raise for a NaN / inf
    or a value beyond a segment's range, as the per-tensor route does, else encode with no
    limit. Returns the kernel's ``(magnitude, seen, crc)``.

    Raises:
        KVInputError: ``kv[index]``'s K or V has a NaN / inf, or a value out of range.
    """
    finite, amax = _magnitude_of(x.dtype, int(bits))
    if not finite:
        raise KVInputError(f"kv[{index}] {'K' if kind == 'key' else 'V'} {NON_FINITE}")
    _check_value_range(x, amax, plan, layer, kind)
    return K.encode_tensor(x, math.inf, plan.segs, plan.idx, out, _scratch(plan.max_numel), _fp8_luts()[2], plan.books)


def _encode_one(task) -> tuple[list, int, int]:
    """One K or V tensor -> ``(sections, crc32 of their concatenation, total bytes)``."""
    t, comp, kind, layer, index, positions = task
    x = _input_array(t)
    finite, amax = _magnitude(x)
    if not finite:
        raise KVInputError(f"kv[{index}] {'K' if kind == 'key' else 'V'} {NON_FINITE}")
    plan = comp.plan(kind, x.shape, layer)
    if isinstance(plan, _ComponentPlan):
        return _encode_components(t, plan, comp, kind, layer, positions)
    if comp.bitpack and plan.whole_bf16 and not plan.transforms and x.dtype == np.uint16:
        payload = x.reshape(-1).view(np.uint8)  # a bfloat16 tensor is its own payload
        return [b"", b"", payload], crc32(payload), payload.size
    out = _empty(plan.nbytes, np.uint8)  # the bitpack layout; other codecs use its state and metadata bytes
    if plan.transforms:
        x = _apply_transforms(x, plan, out)
        # deltas of finite values are at most twice the largest (float32 rounding is monotone):
        # that bound spares a pass over the work array unless it reaches the plan's limit
        if not (all(op[0] == "delta" for op in plan.transforms) and 2.0 * amax <= plan.value_limit):
            amax = _magnitude(x)[1]
    _check_value_range(x, amax, plan, layer, kind)
    if comp.bitpack:
        seen = K.encode_segments(x, plan.segs, plan.idx, out, _scratch(plan.max_numel), True, _fp8_luts()[2], plan.books)
        if seen >> plan.max_bits:  # cannot happen: the kernels clamp every symbol
            raise AssertionError(f"kernel emitted a symbol wider than {plan.max_bits} bits")
        view = memoryview(out)
        return [view[a:b] for a, b in plan.bounds], crc32(out), out.size
    symbuf = np.empty(max(plan.sym_nbytes, 1), np.uint8)
    if plan.rans is not None:  # quantization, every segment's rANS payload and the CRC: one call
        pay = np.empty(plan.rans.payload_nbytes, np.uint8)
        lengths = np.empty(len(plan.segments), np.int64)
        status, crc = K.rans_encode_tensor(x, plan.segs, plan.idx, out, symbuf, _fp8_luts()[2], plan.books,
                                           plan.state_nbytes, *plan.rans.args, pay, lengths)
        if status:  # cannot happen: the kernels clamp every symbol
            raise AssertionError(f"kernel emitted a symbol wider than segment {status - 1}'s bits")
        view, pview = memoryview(out), memoryview(pay)
        sections = [view[: plan.state_nbytes]]
        n = plan.state_nbytes
        for (a, b), at, length in zip(plan.bounds[1::2], plan.rans.args[0][:, K.PR_PAY].tolist(), lengths.tolist()):
            sections += (view[a:b], pview[at : at + length])
            n += b - a + length
        return sections, int(crc), n
    K.encode_segments(x, plan.segs, plan.idx, out, symbuf, False, _fp8_luts()[2], plan.books)
    view = memoryview(out)
    sections = [view[: plan.state_nbytes]]
    codec = comp.config.codec
    for seg, row, (a, b) in zip(plan.segments, plan.segs.tolist(), plan.bounds[1::2]):
        so, count = row[K.SEG_SYM], seg.numel
        if seg.bits == BF16_BITS:
            sym = symbuf[so : so + 2 * count].view(np.uint16).reshape(seg.shape)
        else:
            sym = symbuf[so : so + count].reshape(seg.shape)
        sections.append(view[a:b])
        sections.append(codec.pack(sym, seg.bits))
    crc, n = 0, 0
    for sec in sections:
        crc = crc32(sec, crc)
        n += len(sec)
    return sections, crc, n


def encode_tensors(kv, config, layer_offset: int, positions: Sequence[torch.Tensor] | None = None) -> tuple[list, list]:
    """Sections of every tensor of ``kv``, with their CRCs.

    ``positions``: per layer, the int64 ``(batch, kv_heads, tokens)`` positions of the rows (the
    kept tokens after ``keep``, :class:`kvtune.codecs.select.Selection`), for the transforms that
    use them (``pca`` with pre-RoPE keys); ``None``: ``0 .. tokens - 1``.

    Each task first checks its tensor for NaN / inf and finds its largest magnitude (for the
    value limits) with one vectorized integer pass over its bits
    (:func:`kvtune.codecs.kernels.max_magnitude_bf16`), on the codec threads.

    Raises:
        KVInputError: a tensor has a NaN or inf (the first such tensor in layer order, K before V).

    Returns:
        ``(sections, crcs)``: per layer ``(K sections, V sections)`` and per layer
        ``((K crc, K bytes), (V crc, V bytes))``.
    """
    comp = _compiled(config)
    tasks = []
    for i, (k, v) in enumerate(kv):
        pos = None if positions is None else positions[i]
        tasks.append((k, comp, "key", layer_offset + i, i, pos))
        tasks.append((v, comp, "value", layer_offset + i, i, pos))
    comp.warm((kind, tuple(t.shape), layer) for t, _, kind, layer, _, _ in tasks)
    results = parallel_map(_encode_one, tasks)
    sections = [(results[2 * i][0], results[2 * i + 1][0]) for i in range(len(kv))]
    crcs = [((results[2 * i][1], results[2 * i][2]), (results[2 * i + 1][1], results[2 * i + 1][2])) for i in range(len(kv))]
    return sections, crcs


# ----------------------------------------------------------------------------- batches
#
# A bit-packed policy of block quantizers (and row transforms) codes every tensor with one
# kernel call whose output sizes follow from the plan alone; the batch route runs all of a cache's tensors in one kernel
# call per codec thread (:mod:`kvtune.codecs.kernels.batch`): encoding straight into the stream
# (its section lengths are known before any data is coded), decoding straight into the output
# tensors. Per cache shape (encode) or stream header (decode) the plans, their stacked segment
# tables and the row table are built once.


@dataclass
class BatchPlan:
    """The plans of every tensor of one cache, stacked for the batch kernels.

    Attributes:
        plans: per tensor (layer order, K before V) its :class:`_Plan`.
        table: int64 row table (:data:`kvtune.codecs.kernels.ENC_COLUMNS` or ``DEC_COLUMNS``)
            with everything but the tensors' addresses filled in.
        segs, idx: the plans' segment tables stacked (index offsets rebased) and their indices.
        nbytes: int64 ``(N,)`` bytes of each tensor's sections.
        max_numel: elements of the largest segment (the symbol scratch).
        lengths: per layer ``(K lengths, V lengths)``, each ``[state, meta_0, payload_0, ...]``.
        layer_offset: absolute index of the first layer.
        ops, signs, blocks, scales: the transform programs (int64 ``(N, transforms,
            TR_COLUMNS)``, :data:`kvtune.codecs.kernels.TR_COLUMNS`) and the stacked float32
            Hadamard signs, int64 block sizes and float32 block scales they point into.
        work_numel: elements of the largest tensor with transforms (the float32 work array).
        state_numel: float16 values of the largest ``affine`` state (``2 H D``; its scratch).
        comp: the policy's compiled plans (the per-tensor route's, for a tensor whose checks
            fail on the batch route).
        checked: the encoder has checked these lengths against what a decoder accepts (once).
        heads: stream headers made for this batch, by ``(policy id, dtype)`` (the encoder's).
    """

    plans: tuple[_Plan, ...]
    table: np.ndarray
    segs: np.ndarray
    idx: np.ndarray
    nbytes: np.ndarray
    max_numel: int
    lengths: list
    layer_offset: int
    ops: np.ndarray
    signs: np.ndarray
    blocks: np.ndarray
    scales: np.ndarray
    work_numel: int
    state_numel: int
    comp: "_Compiled | None" = None
    checked: bool = False
    heads: dict = field(default_factory=dict)

    def kernel_args(self) -> tuple:
        """The transform arguments of :func:`kvtune.codecs.kernels.encode_batch` /
        ``decode_batch``, with this thread's float32 work array and float16 state scratch."""
        return (self.ops, self.signs, self.blocks, self.scales, _work((max(self.work_numel, 1),)),
                _state_scratch(self.state_numel))


def _stack(plans: Sequence[_Plan], layer_offset: int, columns: int, seg_col: int, nseg_col: int) -> BatchPlan:
    """A :class:`BatchPlan` of ``plans`` with the segment rows and transform programs filled in."""
    segs, idx, pos, row = [], [], 0, 0
    table = np.zeros((len(plans), columns), np.int64)
    for i, plan in enumerate(plans):
        rows = plan.segs.copy()
        rows[:, K.SEG_HEADS] += pos
        rows[:, K.SEG_TOKENS] += pos
        table[i, seg_col] = row
        table[i, nseg_col] = len(rows)
        segs.append(rows)
        idx.append(plan.idx)
        pos += len(plan.idx)
        row += len(rows)
    lengths = [(_lengths(plans[i]), _lengths(plans[i + 1])) for i in range(0, len(plans), 2)]
    ops, signs, blocks, scales = _programs(plans)
    return BatchPlan(tuple(plans), table, np.concatenate(segs) if segs else np.zeros((0, K.SEG_COLUMNS), np.int64),
                     np.concatenate(idx) if idx else np.zeros(0, np.int64),
                     np.array([p.nbytes for p in plans], np.int64), max((p.max_numel for p in plans), default=0), lengths,
                     layer_offset, ops, signs, blocks, scales,
                     max((math.prod(p.shape) for p in plans if p.transforms), default=0),
                     2 * max((p.shape[1] * p.shape[3] for p in plans if p.transforms), default=0))


def _programs(plans: Sequence[_Plan]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The plans' transforms as kernel programs: ``(ops, signs, blocks, scales)`` of
    :class:`BatchPlan` (every plan of a policy has the same transforms)."""
    nops = max((len(p.transforms) for p in plans), default=0)
    ops = np.zeros((len(plans), nops, K.TR_COLUMNS), np.int64)
    signs, blocks, scales = [], [], []
    nsigns = nblocks = 0
    for i, plan in enumerate(plans):
        h, d = plan.shape[1], plan.shape[3]
        state = 0
        for k, op in enumerate(plan.transforms):
            if op[0] == "hadamard":
                ops[i, k] = (K.TR_HADAMARD, nsigns, nblocks, len(op[2]))
                signs.append(op[1].reshape(-1))
                blocks.append(op[2])
                scales.append(op[3])
                nsigns += op[1].size
                nblocks += len(op[2])
            elif op[0] == "delta":
                ops[i, k] = (K.TR_DELTA, op[1], 0, 0)
            else:  # affine: (rms, shift), its state at this offset of the tensor's sections
                ops[i, k] = (K.TR_AFFINE, op[1], op[2], state)
                state += (2 if op[2] else 1) * h * d * 2

    def cat(parts, dtype):
        return np.concatenate(parts).astype(dtype) if parts else np.zeros(0, dtype)

    return ops, cat(signs, np.float32), cat(blocks, np.int64), cat(scales, np.float32)


def _lengths(plan: _Plan) -> list[int]:
    return [b - a for a, b in plan.bounds]


def _batchable(plan) -> bool:
    """A plan the batch kernels code: block quantizers, sections in one piece, and no
    transforms or transforms on a tensor that is not empty."""
    return isinstance(plan, _Plan) and (not plan.transforms or math.prod(plan.shape) > 0) and all(
        a == b for (_, a), (b, _) in zip(plan.bounds, plan.bounds[1:])) and plan.bounds[-1][1] == plan.nbytes


def encode_plan(config, shapes: Sequence[tuple[tuple[int, ...], tuple[int, ...]]], layer_offset: int) -> BatchPlan | None:
    """The batch plan to encode a cache of ``shapes`` (per layer ``(K shape, V shape)``) with a
    ``bitpack`` policy of block quantizers (:func:`encode_into`), or ``None`` when the batch
    route does not apply (another codec, a transform other than ``hadamard``, ``delta`` and
    ``affine``, KVTC-like, the kernels unavailable, an empty tensor with transforms, or a plan
    that cannot be built: the per-tensor route then reports why)."""
    comp = _compiled(config)
    if not _batch_policy(comp):
        return None
    key = ("encode", tuple(shapes), layer_offset)
    return comp.batch(key, lambda: _encode_plan(comp, shapes, layer_offset))


def _batch_policy(comp: _Compiled) -> bool:
    """A policy the batch kernels can run: ``bitpack``, block quantizers, and ``hadamard``,
    ``delta`` or ``affine`` transforms only (exact types)."""
    config = comp.config
    return (available() and comp.bitpack and not comp.kvtc
            and all(type(t) in (Hadamard, Delta, Affine) for t in config.transforms))


def _encode_plan(comp: _Compiled, shapes, layer_offset: int) -> BatchPlan | None:
    try:
        plans = [comp.plan(kind, tuple(shape), layer_offset + i)
                 for i, pair in enumerate(shapes) for kind, shape in zip(("key", "value"), pair)]
    except Exception:
        return None
    if not all(_batchable(p) for p in plans):
        return None
    batch = _stack(plans, layer_offset, K.ENC_COLUMNS, K.ENC_SEG, K.ENC_NSEG)
    batch.comp = comp
    t = batch.table
    t[:, K.ENC_B : K.ENC_D + 1] = [p.shape for p in plans] if plans else 0
    t[:, K.ENC_LEN] = batch.nbytes
    t[:, K.ENC_OUT] = np.cumsum(batch.nbytes) - batch.nbytes
    return batch


def encode_into(kv, batch: BatchPlan, buf: np.ndarray) -> int:
    """Encode every tensor of ``kv`` (CPU tensors of the shapes ``batch`` was planned for) into
    ``buf`` (uint8, ``batch.nbytes.sum()`` bytes: their sections in stream order), one kernel
    call per codec thread (:func:`kvtune.codecs.kernels.encode_batch`).

    The same checks and errors as :func:`encode_tensors`, in the same order: a tensor with a
    NaN / inf, or beyond its plan's value range (after its transforms), raises (the first in
    layer order, K before V).

    Returns:
        The CRC-32 of ``buf``.

    Raises:
        KVInputError: a NaN / inf or an out-of-range value.
    """
    flat = [t for pair in kv for t in pair]
    arrays = [t if t.device.type == "cpu" and t.is_contiguous() and t.dtype in _BATCH_INPUTS and not t.is_neg()
              else _input_array(t) for t in flat]  # kept alive until the kernels are done
    table = batch.table.copy()
    table[:, K.ENC_X] = [a.data_ptr() if isinstance(a, torch.Tensor) else a.ctypes.data for a in arrays]
    table[:, K.ENC_FLOAT32] = [a.dtype in (torch.float32, np.float32) for a in arrays]
    limits = np.array([p.value_limit for p in batch.plans], np.float64)
    results = np.empty((len(flat), 3), np.int64)
    counter = np.zeros(1, np.int64)
    lut8, books = _fp8_luts()[2], _batch_books(batch)

    def work(_) -> None:
        K.encode_batch(table, limits, batch.segs, batch.idx, buf, _scratch(batch.max_numel), lut8, books, results, counter,
                       *batch.kernel_args())

    parallel_map(work, range(min(num_threads(), len(flat))))
    for i in np.flatnonzero(results[:, 1] < 0).tolist():  # a NaN / inf, or a magnitude to check per segment
        out = buf[table[i, K.ENC_OUT] : table[i, K.ENC_OUT] + table[i, K.ENC_LEN]]
        kind, layer, plan = ("key", "value")[i % 2], batch.layer_offset + i // 2, batch.plans[i]
        if plan.transforms:  # the per-tensor route checks the input, then the transformed range
            sections, crc, _ = _encode_one((flat[i], batch.comp, kind, layer, i // 2, None))
            out[:] = np.frombuffer(b"".join(sections), np.uint8)
            results[i, 1:] = (0, crc)
        else:
            results[i] = _encode_checked(_input_array(flat[i]), results[i, 0], plan, kind, layer, i // 2, out)
    if any(seen >> plan.max_bits for seen, plan in zip(results[:, 1].tolist(), batch.plans)):
        raise AssertionError("kernel emitted a symbol wider than its segment's bits")  # cannot happen: they clamp
    return int(K.crc32_concat(0, results[:, 2], batch.nbytes))


_BATCH_INPUTS = (torch.bfloat16, torch.float32)


def decode_plan(config, header, dtype: torch.dtype) -> BatchPlan | None:
    """The batch plan to decode a stream with this ``header`` (of a ``bitpack`` policy without
    transforms, into ``dtype`` float32 or bfloat16; :func:`decode_into`), or ``None`` when the
    batch route does not apply (also: an empty tensor, section lengths that disagree with the
    plans; the per-tensor route then reports any error).
    Cached per header text (:attr:`kvtune.codecs.stream.StreamHeader.text`)."""
    comp = _compiled(config)
    if not (header.text and dtype in _BATCH_KINDS and _batch_policy(comp)):
        return None
    return comp.batch(("decode", header.text), lambda: _decode_plan(comp, header))


def _decode_plan(comp: _Compiled, header) -> BatchPlan | None:
    plans, starts, pos = [], [], header.header_nbytes
    for i, (shapes, lengths) in enumerate(zip(header.shapes, header.sections)):
        for kind, shape, lens in zip(("key", "value"), shapes, lengths):
            if not math.prod(shape):
                return None
            try:
                plan = comp.plan(kind, tuple(shape), header.layer_offset + i)
            except Exception:
                return None
            if not _batchable(plan) or lens.flat() != _lengths(plan):
                return None
            plans.append(plan)
            starts.append(pos)
            pos += plan.nbytes
    if not plans:
        return None
    batch = _stack(plans, header.layer_offset, K.DEC_COLUMNS, K.DEC_SEG, K.DEC_NSEG)
    t = batch.table
    t[:, K.DEC_B : K.DEC_D + 1] = [p.shape for p in plans]
    t[:, K.DEC_IN] = starts
    t[:, K.DEC_LEN] = batch.nbytes
    return batch


_BATCH_KINDS = {torch.float32: 0, torch.bfloat16: 1}


def decode_into(buf: np.ndarray, batch: BatchPlan, dtype: torch.dtype, out=None) -> tuple[list, np.ndarray]:
    """Decode every tensor of a stream (``buf``, its uint8 bytes, whose header ``batch`` was
    planned for) into ``out`` (per layer ``(K, V)`` contiguous CPU tensors of ``dtype``, already
    checked) or new tensors, one kernel call per codec thread
    (:func:`kvtune.codecs.kernels.decode_batch`).

    Returns:
        ``(tensors, crcs, bad)``: per layer ``(K, V)``; int64 ``(N,)`` the CRC-32 of each
        tensor's sections and uint8 ``(N,)`` 0, or :data:`kvtune.codecs.kernels.BAD_STATE` /
        ``BAD_META`` / ``BAD_PAYLOAD`` when its float16 transform state / metadata or a
        payload (bfloat16 value, float8 symbol) holds a NaN or inf (layer order, K before V).

    Raises:
        Whatever a kernel raises (the caller re-decodes on the per-tensor route, which names the
        layer).
    """
    if out is None:
        out = [(torch.empty(batch.plans[2 * i].shape, dtype=dtype), torch.empty(batch.plans[2 * i + 1].shape, dtype=dtype))
               for i in range(len(batch.plans) // 2)]
    table = batch.table.copy()
    table[:, K.DEC_OUT] = [t.data_ptr() for pair in out for t in pair]
    table[:, K.DEC_KIND] = _BATCH_KINDS[dtype]
    crcs = np.empty(len(table), np.int64)
    bad = np.empty(len(table), np.uint8)
    counter = np.zeros(1, np.int64)
    luts, books = _fp8_luts(), _batch_books(batch)

    def work(_) -> None:
        K.decode_batch(buf, table, batch.segs, batch.idx, luts[0], luts[1], _scratch(batch.max_numel), books, crcs,
                       bad, counter, *batch.kernel_args())

    parallel_map(work, range(min(num_threads(), len(table))))
    return out, crcs, bad


# ----------------------------------------------------------------------------- decode

_OUT_KIND = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_FLOAT16 = _OUT_KIND[torch.float16]


def _decode_one(task) -> tuple[torch.Tensor, int]:
    """Sections of one K or V tensor -> ``(the decoded tensor in dtype, CRC-32 of its sections)``
    (the reference pipeline's tensor decode in :mod:`kvtune.codecs.policy` followed by
    ``.to(dtype)``), with the same checks in the same order; written into ``dest`` when given.
    The CRC is taken while the bytes are read (in the ``bitpack`` kernel call itself)."""
    sections, data, shape, comp, kind, layer, dtype, dest, positions = task
    if math.prod(shape) == 0:  # no tokens: only the state travels; nothing to plan (as the reference)
        need = transform_state_nbytes(comp.config.transforms, shape, layer=layer, kind=kind)
        if len(sections.state) != need:
            raise CorruptStreamError(f"transform state section has {len(sections.state)} bytes, the policy needs {need}")
        return (dest if dest is not None else torch.zeros(shape, dtype=dtype)), crc32(data)
    plan = comp.plan(kind, shape, layer)
    if len(sections.state) != plan.state_nbytes:
        raise CorruptStreamError(f"transform state section has {len(sections.state)} bytes, the policy needs {plan.state_nbytes}")
    if len(plan.segments) != len(sections.meta):
        raise CorruptStreamError(f"{len(sections.meta)} segments recorded, the policy needs {len(plan.segments)}")
    if isinstance(plan, _ComponentPlan):
        crc = crc32(data)
        return _decode_components(sections, plan, comp, kind, layer, dtype, dest, positions), crc
    return _decode_planned(sections, data, shape, plan, comp, dtype, dest, layer, kind)


def _decode_planned(sections, data, shape, plan: _Plan, comp: _Compiled, dtype, dest,
                    layer: int, kind: str) -> tuple[torch.Tensor, int]:
    """:func:`_decode_one` of a tensor with a block-quantizer plan (:class:`_Plan`): ``layer``'s
    K or V (``kind`` ``"key"`` / ``"value"``). Raises CorruptStreamError on a NaN / inf in a
    bfloat16 payload or a float8 NaN / inf symbol (:func:`nonfinite_payload_error`)."""
    crc = None
    segs = plan.segs
    if comp.bitpack:
        symbuf = _scratch(plan.max_numel)
        for (bits, count, mlen, plen), meta, payload in zip(plan.checks, sections.meta, sections.payload):
            if len(payload) != plen:
                if bits == BF16_BITS:
                    raise CorruptStreamError(f"raw 16-bit payload has {len(payload)} bytes, {count} symbols need {plen}")
                raise CorruptStreamError(f"bit-packed payload has {len(payload)} bytes, {count} symbols of {bits} bits need {plen}")
            if len(meta) != mlen:
                raise CorruptStreamError(f"metadata section has {len(meta)} bytes, the policy needs {mlen}")
    else:
        symbuf = np.empty(max(plan.sym_nbytes, 1), np.uint8)
        segs = segs.copy()
        status = -1
        if plan.rans is not None and all(len(m) == c[2] for m, c in zip(sections.meta, plan.checks)):
            # every payload and the CRC in one call; a payload it refuses is decoded below, which raises
            status, crc = K.rans_unpack_tensor(data, plan.state_nbytes, segs, np.array([len(p) for p in sections.payload], np.int64),
                                               plan.rans.args[0], *plan.rans.decode_args, symbuf)
        if status:
            _unpack_sections(sections, data, plan, comp.config.codec, symbuf, segs)
            if status > 0:
                raise AssertionError(f"rans_unpack_tensor refused segment {status - 1}, which the codec decodes")
            crc = crc32(data)
    _check_codebooks(plan, sections.meta)
    out_kind = _OUT_KIND[dtype]
    # dequantize straight into the output, except float16, which saturates (to_output_dtype)
    direct = not plan.transforms and out_kind != _FLOAT16
    if dest is not None:
        result = dest
        target = dest.numpy() if out_kind == 0 else dest.view(torch.int16).numpy().view(np.uint16)
        if not plan.segments:
            target[...] = 0
    else:
        result = None
        target = _empty(shape, np.float32 if out_kind == 0 else np.uint16, zero=not plan.segments)
    y = target if direct else _work(shape)
    luts = _fp8_luts()
    finite = True
    if crc is None:  # bitpack: the CRC and every segment in one kernel call
        crc, finite = K.decode_tensor(data, segs, plan.idx, luts[0], luts[1], symbuf, y, out_kind if direct else 0,
                                      plan.books)
    elif plan.segments:
        finite = K.decode_segments(data, segs, plan.idx, luts[0], luts[1], symbuf, False, y, out_kind if direct else 0,
                                   plan.books)
    if not finite:
        raise nonfinite_payload_error(layer, "K" if kind == "key" else "V")
    if not direct and plan.transforms[:1] and plan.transforms[0][0] == "delta" and out_kind != _FLOAT16:
        _invert_transforms(y, plan, sections.state, keep_first=True)
        K.delta_store(y, plan.transforms[0][1], out_kind, target)  # undone while converted, one pass
    elif not direct:
        if plan.transforms:
            _invert_transforms(y, plan, sections.state)
        if out_kind == _FLOAT16:
            np.clip(y, -FP16_MAX, FP16_MAX, out=y)
        if out_kind == 0:
            target[...] = y
        else:
            K.store_output(y, out_kind, target)
    if result is not None:
        return result, int(crc)
    if out_kind == 0:
        return torch.from_numpy(target), int(crc)
    return torch.from_numpy(target.view(np.int16)).view(dtype), int(crc)


def _unpack_sections(sections, data, plan: _Plan, codec, symbuf: np.ndarray, segs: np.ndarray) -> None:
    """Each segment's payload into ``symbuf`` with the codec's own ``unpack_into``, and its
    metadata offset in ``data`` into ``segs``, checking each metadata length after its payload
    (the reference's order of errors).

    Raises:
        CorruptStreamError: a payload the codec refuses, or a metadata section of another length
            than the plan's.
    """
    pos = plan.state_nbytes
    for seg, (bits, count, mlen, _), row, meta, payload in zip(plan.segments, plan.checks, segs, sections.meta, sections.payload):
        so = row[K.SEG_SYM]
        codec.unpack_into(payload, bits, count, symbuf[so : so + (2 * count if bits == BF16_BITS else count)],
                          shape=seg.shape)
        if len(meta) != mlen:
            raise CorruptStreamError(f"metadata section has {len(meta)} bytes, the policy needs {mlen}")
        row[K.SEG_META] = pos
        pos += len(meta) + len(payload)


def _check_codebooks(plan: _Plan, metas) -> None:
    """Refuse a forged Lloyd codebook before the kernels index with it, as the reference's
    ``dequantize_block`` does (:func:`kvtune.codecs.codebook.check_levels`; the metadata
    lengths are already checked: the levels are the section's first ``2**bits`` float16)."""
    for seg, meta in zip(plan.segments, metas):
        if type(seg.coder) is CodebookQuantizer and seg.coder.levels == "lloyd":
            check_levels(torch.from_numpy(np.frombuffer(meta, "<f2", count=2**seg.bits).copy()))


def _invert_transforms(y: np.ndarray, plan: _Plan, state, keep_first: bool = False) -> None:
    """Undo ``plan``'s transforms on ``y`` in place, last first (all but the first one when
    ``keep_first``); ``affine`` states read from ``state``."""
    h, d = plan.shape[1], plan.shape[3]
    states = []
    pos = 0
    for op in plan.transforms:
        if op[0] == "affine":
            n = (2 if op[2] else 1) * h * d
            states.append(np.frombuffer(state, dtype="<u2", count=n, offset=pos).astype(np.uint16).reshape(-1, h, d))
            pos += 2 * n
        else:
            states.append(None)
    first = 1 if keep_first else 0
    for op, st in zip(reversed(plan.transforms[first:]), reversed(states[first:])):
        name = op[0]
        if name == "hadamard":
            K.hadamard_rows(y, op[1], op[2], op[3], True)
        elif name == "delta":
            K.delta_rows(y, op[1], True)
        else:
            K.affine_rows(y, st[0], st[-1], op[2], True)


def sizes_plausible(header, config=None) -> bool:
    """Whether every tensor of a stream has at most 8 elements per byte of its sections, or
    ``config`` (the stream's policy) is KVTC-like.

    The fast path allocates its plans (index arrays) and outputs from the header's shapes
    before it reads the sections, so a corrupt header claiming ``10**12`` tokens would fail
    with ``MemoryError``. A bit-packed symbol takes at least one bit, so no ``bitpack`` stream
    breaks this bound; an entropy-coded stream of near-constant data may, and then decodes on
    the reference path, which checks every section length before it allocates. A KVTC-like
    policy's fast decode does the same (:func:`_decode_components`; its plans are a function of
    the basis, not of the tokens), so its streams, which drop whole components and may hold many
    elements per byte, always qualify.
    """
    if config is not None and available() and _is_kvtc(config):
        return True
    for (kshape, vshape), (kl, vl) in zip(header.shapes, header.sections):
        for shape, lengths in ((kshape, kl), (vshape, vl)):
            nbytes = lengths.state + sum(lengths.meta) + sum(lengths.payload)
            if math.prod(shape) > 8 * nbytes:
                return False
    return True


def nonfinite_float16_error(layer: int, name: str, what: str) -> CorruptStreamError:
    """The error for a NaN / inf float16 in ``layer``'s K or V (``name``) ``what`` (its
    ``"metadata"`` or ``"transform state"``): an encoder writes only finite ones."""
    return CorruptStreamError(f"corrupt KV stream: layer {layer} {name} has a NaN or inf float16 in its {what} "
                              "(an encoder writes only finite ones)")


def nonfinite_payload_error(layer: int, name: str) -> CorruptStreamError:
    """The error for a NaN / inf value in a payload of ``layer``'s K or V (``name``): a
    bfloat16 one (a ``none`` tensor, a window, sink tokens) or a float8 symbol, which an encoder
    writes only from finite input (float8 saturates)."""
    return CorruptStreamError(f"corrupt KV stream: layer {layer} {name} has a NaN or inf value in its payload "
                              "(an encoder writes only finite ones)")


def first_nonfinite_f16(buf: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> int:
    """Index of the first byte range ``buf[starts[r]:ends[r]]`` of little-endian float16 values
    holding a NaN or inf, or -1 (:func:`kvtune.codecs.kernels.first_nonfinite_f16`; numpy when
    the kernels are not :func:`available`)."""
    if available():
        return int(K.first_nonfinite_f16(buf, starts, ends))
    for r, (a, b) in enumerate(zip(starts.tolist(), ends.tolist())):
        if ((buf[a + 1 : b : 2] & 0x7C) == 0x7C).any():
            return r
    return -1


def all_finite(t: torch.Tensor) -> bool | None:
    """Whether no value of ``t`` is NaN or inf, read by the kernels
    (:func:`kvtune.codecs.kernels.all_finite_bf16`, ``all_finite_f32``: one pass over the
    exponent bits) for a contiguous bfloat16 or float32 tensor on the CPU; ``None`` for any other
    tensor, or when the kernels are not :func:`available`. One default-model K or V tensor
    (393 KB of bfloat16), one thread: about 2.5 us, against about 25 us for torch's
    ``aminmax``."""
    if not available() or t.device.type != "cpu" or not t.is_contiguous() or t.is_neg():
        return None
    if t.dtype == torch.bfloat16:
        return bool(K.all_finite_bf16(t.detach().view(torch.int16).numpy().view(np.uint16)))
    if t.dtype == torch.float32:
        return bool(K.all_finite_f32(t.detach().numpy()))
    return None


def decode_tensors(stream, header, sections, config, out=None, positions=None,
                   check_crc: bool = False) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Decode every tensor of a validated stream (see :func:`kvtune.codecs.decode_kv`), into
    the tensors of ``out`` when given (already checked by the caller); ``positions`` as in
    :func:`encode_tensors` (from the stream's selection masks); ``sections`` from
    :func:`kvtune.codecs.stream.read_stream`, or ``None`` (made here when a route needs them).

    A policy of the batch route (:func:`decode_plan`) decodes in one kernel call per codec
    thread (:func:`decode_into`), which also checks that its float16 transform state and
    metadata are finite (the caller
    skips its own pass, :func:`kvtune.codecs.policy.check_finite_metadata`, when
    :func:`decode_plan` gives a batch); anything else tensor by tensor.

    ``check_crc``: also verify the stream's final CRC-32 (:func:`kvtune.codecs.stream.check_checksum`)
    from the CRCs the tasks take of their tensors' sections while they decode them, combined
    with the header's and the selection masks' (:func:`kvtune.codecs.checksum.crc32_combine`):
    one read of the stream instead of two, for a caller that read it with
    ``verify_checksum=False``. A mismatch is raised after every task ran, before any result is
    returned.

    Raises the first error in layer order (K before V), as the reference path does, wrapped in
    :class:`LayerDecodeError`; CorruptStreamError on a checksum mismatch (``check_crc``), then
    (batch route) on a NaN / inf float16 in the metadata, as
    :func:`kvtune.codecs.policy.check_finite_metadata` words it.
    """
    comp = _compiled(config)
    dtype = NAME_DTYPES[header.dtype]
    buf = np.frombuffer(stream, dtype=np.uint8)
    batch = decode_plan(config, header, dtype)
    if batch is not None:
        decoded, crcs, bad = decode_into(buf, batch, dtype, out)
        if check_crc:
            end = header.header_nbytes + int(batch.nbytes.sum())
            check_checksum(buf, header, _combined_crc(buf, header, end, crcs, batch.nbytes))
        if bad.any():  # in the reference's order: non-finite float16 anywhere first, then tensor by tensor
            early = np.flatnonzero((bad == K.BAD_STATE) | (bad == K.BAD_META))
            i = int(early[0] if early.size else np.flatnonzero(bad)[0])
            layer, name = header.layer_offset + i // 2, "KV"[i % 2]
            if bad[i] == K.BAD_PAYLOAD:
                raise nonfinite_payload_error(layer, name)
            if bad[i] == K.BAD_CODEBOOK:  # the per-tensor route's error, from the reference's check
                try:
                    _check_codebooks(batch.plans[i], section_views(stream, header)[i // 2][i % 2].meta)
                except CorruptStreamError as exc:
                    raise LayerDecodeError(layer, exc) from None
                raise AssertionError("decode_batch flagged a codebook that check_levels accepts")
            raise nonfinite_float16_error(layer, name, "transform state" if bad[i] == K.BAD_STATE else "metadata")
        return decoded
    if sections is None:
        sections = section_views(stream, header)
    tasks = []
    pos = header.header_nbytes
    for i, ((kshape, vshape), (ks, vs), (kl, vl)) in enumerate(zip(header.shapes, sections, header.sections)):
        layer = header.layer_offset + i
        for j, (secs, lengths, shape, kind) in enumerate(((ks, kl, kshape, "key"), (vs, vl, vshape, "value"))):
            n = lengths.state + sum(lengths.meta) + sum(lengths.payload)
            dest = None if out is None else out[i][j]
            rows = None if positions is None else positions[i]
            tasks.append((secs, buf[pos : pos + n], tuple(shape), comp, kind, layer, dtype, dest, rows))
            pos += n

    comp.warm((task[4], task[2], task[5]) for task in tasks)

    def run(task):
        try:
            return _decode_one(task), None
        except Exception as exc:  # re-raised in order below
            return None, exc

    results = parallel_map(run, tasks)
    decoded = []
    for i in range(len(header.shapes)):
        for j in (0, 1):
            _, exc = results[2 * i + j]
            if exc is not None:
                raise LayerDecodeError(header.layer_offset + i, exc)
        decoded.append((results[2 * i][0][0], results[2 * i + 1][0][0]))
    if check_crc:
        crc = _combined_crc(buf, header, pos, [r[0][1] for r in results], [len(t[1]) for t in tasks])
        check_checksum(buf, header, crc)
    return decoded if out is None else out


def _combined_crc(buf: np.ndarray, header, end: int, crcs: list[int], lengths: list[int]) -> int:
    """CRC-32 of ``buf[:total - 4]`` from the tensors' CRCs: the header's, each tensor's
    combined in stream order, then the selection masks' (``buf[end:total - 4]``)."""
    crc = int(K.crc32_concat(crc32(buf[: header.header_nbytes]), np.asarray(crcs, np.int64), np.asarray(lengths, np.int64)))
    return crc32(buf[end : header.total_nbytes - header.checksum_nbytes], crc)


class LayerDecodeError(Exception):
    """Carries the layer index of a decode failure to :func:`kvtune.codecs.decode_kv`, which
    re-raises it as the typed stream error it stands for.

    Attributes:
        layer: absolute index of the layer that failed.
        exc: the exception of its K or V tensor.
    """

    def __init__(self, layer: int, exc: BaseException) -> None:
        super().__init__(layer, exc)
        self.layer = layer
        self.exc = exc
