"""Device path of :func:`~kvtune.codecs.encode_kv` / :func:`~kvtune.codecs.decode_kv`: the
codec pipeline in torch operations on the device the KV lives on (a GPU serving machine).

KVServe ("KVServe: Service-Aware KV Cache Compression for Communication-Efficient
Disaggregated LLM Serving", arXiv 2605.13734, sec. 3) compresses the KV where it is produced:
copying a bfloat16 cache to the host before compressing it moves 2-8x more bytes over the
host link than the stream. This module runs transforms, quantizers and the ``bitpack`` codec
with vectorised torch operations on the tensors' own device, and writes **the same stream
bytes** as the CPU paths (the compiled kernels of :mod:`kvtune.codecs.fastpath` and the
reference pipeline of :mod:`kvtune.codecs.policy`); decoding gives the same tensors, on the
requested device.

Data movement: an encode copies nothing to the host but the finished sections -- one
device-to-host copy of every tensor's ``[state, meta_0, payload_0, ...]`` bytes, with one flag
byte per tensor for the input checks -- and a decode copies the stream's sections to the
device once. The per-tensor math (transforms, metadata, symbols, bit packing, range checks)
never synchronises with the host. The stream header, the segment plans
(:meth:`~kvtune.codecs.base.Quantizer.plan`, cached per policy, shape, layer and device) and
the CRC-32 of the stream are computed on the host.

Entropy codecs (``range``, ``zstd``): their coding is a sequential walk over the symbols, which
vectorised torch operations cannot express. Transforms and quantization run on the device,
the raw symbols come back in the one host copy (1 byte per symbol instead of ``bits / 8``), and
the codec's own :meth:`~kvtune.codecs.base.Codec.pack` / ``unpack`` runs on the CPU, tensors in
parallel (:func:`kvtune.codecs.threads.parallel_map`); on decode the symbols go to the device in
one copy. ``benchmarks/gpu_check.py`` measures that split (the ``cachegen`` preset).

Exactness. The float math is that of the reference components, which are written so that
every operation rounds the same way on every device: one elementwise operation per kernel
(no fused multiply-add: ``zero + q * scale`` is a multiply, then an add), IEEE division by
device tensors (:func:`kvtune.codecs.quantizers.div_exact`; CUDA would multiply by a rounded
reciprocal of a Python-number divisor), round-half-to-even (``torch.round``, the float16 /
bfloat16 / float8 casts, as the kernels), order-independent reductions (min, max, absmax), the
Walsh-Hadamard butterflies of :func:`kvtune.codecs.transforms.walsh_hadamard` (a fixed
sequence of adds), and float64 channel sums of ``affine`` added strictly in (batch, token)
order (one launch per token off the CPU, the slow part of ``affine`` on a GPU). NaN payloads
are outside the guarantee (refused at encode anyway). Bit-for-bit equality with the CPU
kernels is tested on the CPU (``tests/test_torchpath.py``, every preset and search-space
policies, three input dtypes) and, when CUDA is present, on the GPU by the same tests and by
``benchmarks/gpu_check.py``; a GPU run is what confirms the device's arithmetic.

Supported (:func:`supports`): transforms ``identity``, ``hadamard``, ``delta``, ``affine``;
block quantizers ``uniform``, ``none``, ``fp8`` and ``codebook`` (hence the ``uniform``, ``none``,
``mixhq``, ``fp8`` and ``codebook`` quantizers); any codec. A fitted (Lloyd) codebook is checked
on the host at decode (:func:`kvtune.codecs.codebook.check_levels`): one synchronisation per
such segment. The host is little-endian (metadata bytes are the tensors'
own bytes).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import warnings
from dataclasses import dataclass

import numpy as np
import torch

from kvtune.codecs.base import (
    BF16_BITS,
    MetaField,
    Segment,
    check_value_range,
    transform_min_bits,
    transform_state_nbytes,
)
from kvtune.codecs.bitpack import BitPack, packed_nbytes
from kvtune.codecs.codebook import CodebookQuantizer
from kvtune.codecs.fastpath import LayerDecodeError
from kvtune.codecs.fp8 import FP8Quantizer
from kvtune.codecs.kvtensors import DTYPE_MAX, NAME_DTYPES, NON_FINITE, to_output_dtype
from kvtune.codecs.quantizers import NoQuantizer, UniformQuantizer
from kvtune.codecs.select import is_selecting
from kvtune.codecs.threads import parallel_map
from kvtune.codecs.transforms import Affine, Delta, Hadamard, rotate, unrotate
from kvtune.core.errors import CorruptStreamError, KVInputError

__all__ = ["supports", "encode_tensors", "decode_tensors", "pack_bits", "unpack_bits"]

_TRANSFORMS = (Hadamard, Delta, Affine)
_BLOCKS = (UniformQuantizer, NoQuantizer, FP8Quantizer, CodebookQuantizer)
_OK, _NON_FINITE, _OUT_OF_RANGE = 0, 1, 2


@functools.lru_cache(maxsize=256)
def supports(config) -> bool:
    """Whether :func:`encode_tensors` / :func:`decode_tensors` can run ``config``: every
    transform is ``hadamard``, ``delta`` or ``affine`` and every block quantizer its K and V
    plans can use is ``uniform``, ``none``, ``fp8`` or ``codebook`` (exact types: a subclass may
    change the math). Any codec. A leading ``keep`` (:mod:`kvtune.codecs.select`) does not count:
    it runs before this path, on the tensors' device."""
    if any(type(t) not in _TRANSFORMS for t in config.transforms if not is_selecting(t)):
        return False
    floors = tuple(sorted({b for t in config.transforms for b in t.min_bits_values()}))
    for quant in (config.key, config.value):
        try:
            coders = [quant.coder(bits) for bits in quant.symbol_widths(floors)]
        except Exception:  # a quantizer that cannot list its widths
            return False
        if not coders or any(type(c) not in _BLOCKS for c in coders):
            return False
    return True


# ----------------------------------------------------------------------------- bit packing


@functools.lru_cache(maxsize=64)
def _shifts(bits: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """int64 left shifts of 8 symbols (MSB first) in a ``8 * bits``-bit word, and right
    shifts of its ``bits`` bytes (big-endian), on ``device``."""
    sym = bits * (7 - torch.arange(8, dtype=torch.int64))
    byte = 8 * (bits - 1 - torch.arange(bits, dtype=torch.int64))
    return sym.to(device), byte.to(device)


def pack_bits(symbols: torch.Tensor, bits: int) -> torch.Tensor:
    """The bytes of :func:`kvtune.codecs.bitpack.pack_bits` as a uint8 tensor on the symbols' device.

    Eight symbols make one ``8 * bits``-bit word (MSB first, shifted and summed in int64), whose
    ``bits`` bytes are written big-endian; the tail is zero-padded.

    Args:
        symbols: flat uint8 tensor, values ``< 2**bits`` (not checked: the quantizers clamp).
        bits: 1..8.

    Returns:
        ``ceil(n * bits / 8)`` uint8 bytes.
    """
    n = symbols.numel()
    if bits == 8:
        return symbols.reshape(-1)
    pad = (-n) % 8
    a = symbols.reshape(-1)
    if pad:
        a = torch.cat((a, a.new_zeros(pad)))
    sym_shift, byte_shift = _shifts(bits, a.device)
    words = (a.reshape(-1, 8).to(torch.int64) << sym_shift).sum(dim=1)
    out = ((words[:, None] >> byte_shift) & 0xFF).to(torch.uint8).reshape(-1)
    return out[: packed_nbytes(n, bits)]


def unpack_bits(data: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """Inverse of :func:`pack_bits`: ``count`` uint8 symbols from the uint8 tensor ``data``
    (whose length the caller has checked: ``ceil(count * bits / 8)``), on its device."""
    if bits == 8:
        return data
    groups = -(-count // 8)
    body = data.new_zeros(groups * bits)
    body[: data.numel()] = data
    sym_shift, byte_shift = _shifts(bits, data.device)
    words = (body.reshape(groups, bits).to(torch.int64) << byte_shift).sum(dim=1)
    return ((words[:, None] >> sym_shift) & ((1 << bits) - 1)).to(torch.uint8).reshape(-1)[:count]


# ----------------------------------------------------------------------------- plans


@dataclass(frozen=True, eq=False)
class _Plan:
    """One ``(policy, kind, shape, layer, device)``: the reference plan's segments with their
    head / token indices on the device, and the byte lengths of the tensor's sections.

    Attributes:
        segments: :class:`~kvtune.codecs.base.Segment` s (index tensors on the device).
        state_layouts: per transform, its state fields.
        state_nbytes: bytes of the state section.
        meta_nbytes: per segment, bytes of its metadata.
        payload_nbytes: per segment, bytes of its ``bitpack`` payload.
        check_range: whether encoding must check values against the coders' limits (the
            transforms may widen the range, or the input dtype exceeds the smallest limit).
    """

    segments: tuple[Segment, ...]
    state_layouts: tuple[tuple[MetaField, ...], ...]
    state_nbytes: int
    meta_nbytes: tuple[int, ...]
    payload_nbytes: tuple[int, ...]
    check_range: bool


def _on(index, device: torch.device):
    return index.to(device) if isinstance(index, torch.Tensor) else index


@functools.lru_cache(maxsize=1024)
def _plan(config, kind: str, shape: tuple[int, ...], layer: int, device: torch.device, dtype: torch.dtype) -> _Plan:
    quant = config.key if kind == "key" else config.value
    segments = quant.plan(shape, layer=layer, kind=kind, min_bits=transform_min_bits(config.transforms, shape[2]))
    layouts = tuple(t.state_layout(shape, layer=layer, kind=kind) for t in config.transforms)
    limit = min((s.coder.value_limit for s in segments), default=math.inf)
    return _Plan(
        segments=tuple(dataclasses.replace(s, heads=_on(s.heads, device), tokens=_on(s.tokens, device)) for s in segments),
        state_layouts=layouts,
        state_nbytes=sum(f.nbytes for lay in layouts for f in lay),
        meta_nbytes=tuple(sum(f.nbytes for f in s.meta_layout) for s in segments),
        payload_nbytes=tuple(2 * s.numel if s.bits == BF16_BITS else packed_nbytes(s.numel, s.bits) for s in segments),
        check_range=bool(config.transforms) or DTYPE_MAX[dtype] > limit,
    )


@functools.lru_cache(maxsize=1024)
def _signs(t: Hadamard, shape: tuple[int, ...], layer: int, kind: str, device: torch.device) -> torch.Tensor:
    """The rotation's +-1 signs (:func:`kvtune.codecs.transforms.random_signs`) on ``device``."""
    return t.signs(shape, layer, kind).to(device)


# ----------------------------------------------------------------------------- bytes


def _field_bytes(tensors, layout: tuple[MetaField, ...]) -> list[torch.Tensor]:
    """Little-endian bytes of each field of ``layout`` (as :func:`kvtune.codecs.base.meta_to_bytes`)."""
    return [tensors[f.name].to(f.dtype).contiguous().view(torch.uint8).reshape(-1) for f in layout]


def _fields(data: torch.Tensor, layout: tuple[MetaField, ...]) -> dict[str, torch.Tensor]:
    """Inverse of :func:`_field_bytes` on a uint8 tensor of the right length (a copy: section
    offsets are not aligned to the field's element size)."""
    out, pos = {}, 0
    for f in layout:
        out[f.name] = data[pos : pos + f.nbytes].clone().view(f.dtype).reshape(f.shape)
        pos += f.nbytes
    return out


# ----------------------------------------------------------------------------- transforms


def _forward(x: torch.Tensor, config, layer: int, kind: str) -> tuple[torch.Tensor, list[dict[str, torch.Tensor]]]:
    """:func:`kvtune.codecs.policy.apply_transforms` with the rotation's signs on ``x``'s device."""
    states = []
    for t in config.transforms:
        if isinstance(t, Hadamard):
            x, state = rotate(x, _signs(t, tuple(x.shape), layer, kind, x.device)), {}
        else:
            state = t.fit(x, layer=layer, kind=kind)
            x = t.forward(x, layer=layer, kind=kind, state=state)
        states.append(state)
    return x, states


def _inverse(y: torch.Tensor, config, states, layer: int, kind: str) -> torch.Tensor:
    """:func:`kvtune.codecs.policy.invert_transforms` with the signs on ``y``'s device."""
    for t, state in zip(reversed(config.transforms), reversed(states)):
        if isinstance(t, Hadamard):
            y = unrotate(y, _signs(t, tuple(y.shape), layer, kind, y.device))
        else:
            y = t.inverse(y, layer=layer, kind=kind, state=state)
    return y


# ----------------------------------------------------------------------------- encode


def _encode_tensor(t: torch.Tensor, config, kind: str, layer: int, bitpack: bool) -> tuple[list[torch.Tensor], torch.Tensor]:
    """One K or V tensor -> its sections as uint8 device tensors (payloads bit-packed, or the
    raw symbols for another codec) and a uint8 flag: 0 ok, 1 NaN / inf, 2 a value beyond a
    segment's range (checked later, on the host, without a synchronisation here)."""
    shape = tuple(t.shape)
    plan = _plan(config, kind, shape, layer, t.device, t.dtype)
    flag = torch.where(torch.isfinite(t).all(), _OK, _NON_FINITE).to(torch.uint8)
    y, states = _forward(t.detach().to(torch.float32), config, layer, kind)
    out = [b for st, lay in zip(states, plan.state_layouts) for b in _field_bytes(st, lay)]
    out = [torch.cat(out) if out else t.new_zeros(0, dtype=torch.uint8)]
    in_range = torch.ones((), dtype=torch.bool, device=t.device)
    for seg in plan.segments:
        part = seg.take(y)
        if plan.check_range:
            in_range &= part.abs().amax() <= seg.coder.value_limit  # NaN fails
        symbols, meta = seg.coder.quantize_block(part)
        m = _field_bytes(meta, seg.meta_layout)
        out.append(torch.cat(m) if m else t.new_zeros(0, dtype=torch.uint8))
        flat = symbols.contiguous().reshape(-1)
        if seg.bits == BF16_BITS:
            out.append(flat.view(torch.uint8))
        else:
            out.append(pack_bits(flat, seg.bits) if bitpack else flat)
    flag = torch.where((flag == _OK) & ~in_range, _OUT_OF_RANGE, flag).to(torch.uint8)
    return out, flag


def _raise_input_error(kv, config, layer_offset: int, index: int, j: int, flag: int) -> None:
    """The error the CPU paths raise for tensor ``kv[index][j]`` (error path: on the host)."""
    name, kind = "KV"[j], ("key", "value")[j]
    if flag == _NON_FINITE:
        raise KVInputError(f"kv[{index}] {name} {NON_FINITE}")
    t = kv[index][j]
    layer = layer_offset + index
    plan = _plan(config, kind, tuple(t.shape), layer, t.device, t.dtype)
    y, _ = _forward(t.detach().to(torch.float32), config, layer, kind)
    segments = [dataclasses.replace(s, heads=_on(s.heads, "cpu"), tokens=_on(s.tokens, "cpu")) for s in plan.segments]
    check_value_range(segments, y.cpu(), layer=layer, kind=kind)
    raise AssertionError("the device range check and check_value_range disagree")  # pragma: no cover


def encode_tensors(kv, config, layer_offset: int) -> list[tuple[list, list]]:
    """Sections of every tensor of ``kv`` (validated by the caller), computed on each tensor's
    device.

    Args:
        kv: one ``(K, V)`` pair per layer, each ``(batch, kv_heads, tokens, head_dim)``
            float32 / bfloat16 / float16, on any device (one device for all is the fast case;
            each tensor is coded where it lives).
        config: a policy that :func:`supports` accepts.
        layer_offset: absolute index of ``kv[0]``.

    Returns:
        Per layer ``(K sections, V sections)``, each ``[state, meta_0, payload_0, ...]`` as
        memoryviews of one host buffer, as :func:`kvtune.codecs.stream.write_stream` takes them.

    Raises:
        KVInputError: the first tensor (layer order, K before V) with a NaN / inf, or with a
            value beyond its block's range (:func:`kvtune.codecs.base.check_value_range`'s
            message), as the CPU paths.
    """
    bitpack = type(config.codec) is BitPack
    tensors = [(t, i, j) for i, pair in enumerate(kv) for j, t in enumerate(pair)]
    pieces, flags = [], []
    for t, i, j in tensors:
        secs, flag = _encode_tensor(t, config, ("key", "value")[j], layer_offset + i, bitpack)
        pieces.append(secs)
        flags.append(flag)
    host = _to_host(pieces, flags)
    nflags = len(flags)
    for (t, i, j), flag in zip(tensors, host[len(host) - nflags :].tolist()):
        if flag != _OK:
            _raise_input_error(kv, config, layer_offset, i, j, flag)
    sections, pos = [], 0
    view = memoryview(host)
    for secs in pieces:
        flat = []
        for p in secs:
            flat.append(view[pos : pos + p.numel()])
            pos += p.numel()
        sections.append(flat)
    if not bitpack:
        jobs = [(flat, config, ("key", "value")[j], t, layer_offset + i) for flat, (t, i, j) in zip(sections, tensors)]
        sections = parallel_map(_pack_on_host, jobs)
    return [(sections[2 * i], sections[2 * i + 1]) for i in range(len(kv))]


def _to_host(pieces: list[list[torch.Tensor]], flags: list[torch.Tensor]) -> np.ndarray:
    """Every section and then every flag byte in one host array: one copy when the tensors
    share a device (else one per tensor)."""
    if not flags:
        return np.zeros(0, np.uint8)
    if len({f.device for f in flags}) == 1:
        return torch.cat([s for secs in pieces for s in secs] + [torch.stack(flags)]).cpu().numpy()
    parts = [torch.cat(secs).cpu() for secs in pieces]
    return torch.cat(parts + [torch.stack([f.cpu() for f in flags])]).numpy()


def _pack_on_host(job) -> list:
    """Sections of a tensor coded by an entropy codec: the raw symbols, packed on the CPU."""
    flat, config, kind, t, layer = job
    plan = _plan(config, kind, tuple(t.shape), layer, t.device, t.dtype)
    out = [flat[0]]
    for seg, meta, raw in zip(plan.segments, flat[1::2], flat[2::2]):
        sym = np.frombuffer(raw, dtype="<u2" if seg.bits == BF16_BITS else np.uint8).reshape(seg.shape)
        out += [meta, config.codec.pack(sym, seg.bits)]
    return out


# ----------------------------------------------------------------------------- decode


def _check_lengths(plan: _Plan, sections, bitpack: bool) -> None:
    """The checks of the CPU paths, in their order, with their messages."""
    if len(sections.state) != plan.state_nbytes:
        raise CorruptStreamError(f"transform state section has {len(sections.state)} bytes, the policy needs {plan.state_nbytes}")
    if len(plan.segments) != len(sections.meta):
        raise CorruptStreamError(f"{len(sections.meta)} segments recorded, the policy needs {len(plan.segments)}")
    for seg, mlen, plen, meta, payload in zip(plan.segments, plan.meta_nbytes, plan.payload_nbytes, sections.meta, sections.payload):
        if bitpack and len(payload) != plen:
            if seg.bits == BF16_BITS:
                raise CorruptStreamError(f"raw 16-bit payload has {len(payload)} bytes, {seg.numel} symbols need {plen}")
            raise CorruptStreamError(f"bit-packed payload has {len(payload)} bytes, {seg.numel} symbols of {seg.bits} bits need {plen}")
        if len(meta) != mlen:
            raise CorruptStreamError(f"metadata section has {len(meta)} bytes, the policy needs {mlen}")


def _host_symbols(plan: _Plan, sections, codec) -> list[np.ndarray]:
    """Symbols of every segment decoded by an entropy codec on the CPU (as uint8 bytes),
    metadata lengths checked in the order of the CPU paths."""
    out = []
    for seg, mlen, meta, payload in zip(plan.segments, plan.meta_nbytes, sections.meta, sections.payload):
        sym = codec.unpack(payload, seg.bits, seg.numel, shape=seg.shape)
        if len(meta) != mlen:
            raise CorruptStreamError(f"metadata section has {len(meta)} bytes, the policy needs {mlen}")
        out.append(np.ascontiguousarray(sym).reshape(-1).view(np.uint8))
    return out


def _decode_tensor(job, body: torch.Tensor, symbols: torch.Tensor | None) -> torch.Tensor:
    """One K or V tensor from its sections (offsets into ``body``) on ``body``'s device."""
    plan, config, kind, layer, shape, dtype, spans, sym_spans = job
    if plan is None:  # no tokens: nothing coded
        return torch.zeros(shape, dtype=dtype, device=body.device)
    state = body[spans[0][0] : spans[0][1]]
    states, pos = [], 0
    for lay in plan.state_layouts:
        n = sum(f.nbytes for f in lay)
        states.append(_fields(state[pos : pos + n], lay))
        pos += n
    whole = len(plan.segments) == 1 and plan.segments[0].is_whole
    y = None if whole else torch.empty(shape, dtype=torch.float32, device=body.device)
    for k, seg in enumerate(plan.segments):
        (ma, mb), (pa, pb) = spans[1 + 2 * k], spans[2 + 2 * k]
        if symbols is not None:
            sa, sb = sym_spans[k]
            raw = symbols[sa:sb]
        else:
            raw = body[pa:pb]
        if seg.bits == BF16_BITS:
            sym = raw.clone().view(torch.uint16)
        else:
            sym = raw if symbols is not None else unpack_bits(raw, seg.bits, seg.numel)
        part = seg.coder.dequantize_block(sym.reshape(seg.shape), _fields(body[ma:mb], seg.meta_layout), seg.shape)
        if whole:
            y = part
        else:
            seg.put(y, part)
    y = _inverse(y, config, states, layer, kind)
    return to_output_dtype(y, dtype)


def decode_tensors(stream, header, sections, config, device: torch.device, out=None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Decode every tensor of a validated stream (see :func:`kvtune.codecs.decode_kv`) on ``device``.

    The stream's sections are copied to ``device`` once (and, with an entropy codec, the
    symbols it decodes on the CPU, once); every check of the CPU paths on section lengths runs
    on the host first, in layer order (K before V).

    Args:
        stream: the stream bytes; header, sections: from :func:`kvtune.codecs.stream.read_stream`
            (sizes already checked by :func:`kvtune.codecs.policy.check_claimed_sizes`).
        config: the stream's policy (:func:`supports` accepts it).
        device: where the tensors are decoded.
        out: optional ``(K, V)`` tensors on ``device`` of the stream's shapes and dtype
            (checked by the caller), written and returned.

    Returns:
        One ``(K, V)`` pair per layer on ``device``, in the stream's dtype.

    Raises:
        LayerDecodeError: the first layer whose sections do not decode (the caller re-raises
            it as the typed stream error).
    """
    bitpack = type(config.codec) is BitPack
    dtype = NAME_DTYPES[header.dtype]
    jobs, host_syms, pos, sym_pos = [], [], 0, 0
    for i, ((kshape, vshape), (ks, vs), (kl, vl)) in enumerate(zip(header.shapes, sections, header.sections)):
        layer = header.layer_offset + i
        for secs, lengths, shape, kind in ((ks, kl, kshape, "key"), (vs, vl, vshape, "value")):
            shape = tuple(shape)
            try:
                if math.prod(shape):
                    plan = _plan(config, kind, shape, layer, device, dtype)
                    _check_lengths(plan, secs, bitpack)
                    syms = [] if bitpack else _host_symbols(plan, secs, config.codec)
                else:  # no tokens: only the state travels, nothing is planned (as the CPU paths)
                    plan, syms = None, []
                    need = transform_state_nbytes(config.transforms, shape, layer=layer, kind=kind)
                    if len(secs.state) != need:
                        raise CorruptStreamError(f"transform state section has {len(secs.state)} bytes, the policy needs {need}")
            except Exception as exc:
                raise LayerDecodeError(layer, exc) from None
            spans = []
            for n in (lengths.state, *(x for pair in zip(lengths.meta, lengths.payload) for x in pair)):
                spans.append((pos, pos + n))
                pos += n
            sym_spans = []
            for s in syms:
                sym_spans.append((sym_pos, sym_pos + s.size))
                sym_pos += s.size
            host_syms += syms
            jobs.append((plan, config, kind, layer, shape, dtype, spans, sym_spans))
    body = _to_device(np.frombuffer(stream, dtype=np.uint8)[header.header_nbytes : header.header_nbytes + pos], device)
    symbols = None if bitpack else _to_device(np.concatenate(host_syms) if host_syms else np.zeros(0, np.uint8), device)
    result = []
    for n, job in enumerate(jobs):
        try:
            t = _decode_tensor(job, body, symbols)
        except Exception as exc:
            raise LayerDecodeError(job[3], exc) from None
        if out is not None:
            out[n // 2][n % 2].copy_(t)
        result.append(t)
    return out if out is not None else [(result[2 * i], result[2 * i + 1]) for i in range(len(jobs) // 2)]


def _to_device(arr: np.ndarray, device: torch.device) -> torch.Tensor:
    """A uint8 tensor of ``arr`` (a read-only view of the stream) on ``device``: one copy."""
    with warnings.catch_warnings():  # torch warns about read-only buffers; nothing writes to it
        warnings.simplefilter("ignore", UserWarning)
        t = torch.from_numpy(arr)
    return t.to(device, copy=True)
