"""Whole-tensor encoding and decoding: every segment of one K or V tensor in one call.

Accelerates :func:`kvtune.codecs.policy.encode_kv` / ``decode_kv`` on the fast path
(:mod:`kvtune.codecs.fastpath`): for each segment of the tensor's plan (a quantizer applied to
a set of heads and tokens, :class:`kvtune.codecs.base.Segment`) the block quantizer's kernel
(:mod:`.quantize`, :mod:`.fp8`, or a bfloat16 copy), the float16 metadata
(:func:`kvtune.codecs.base.meta_to_bytes`) and, for the ``bitpack`` codec, the packed payload
(:mod:`.bitpack`). One call per tensor, so that a codec thread holds the GIL only to enter and
leave it.

A segment is one row of an int64 table of :data:`SEG_COLUMNS` columns, indexed by the
``SEG_*`` constants.
"""

from __future__ import annotations

import numpy as np
from numba import njit, types, uintp
from numba.extending import overload

from .bitpack import pack_bits, unpack_bits
from .codebook import codebook_dequantize, codebook_quantize
from .convert import bf16_bits_to_f32, f16_bits_to_f32, f32_to_bf16_bits, get_u16, put_u16, store_row
from .crc import crc32_update
from .finite import max_masked
from .fp8 import LANES as FP8_LANES
from .fp8 import bf16_from_e4m3_16, e4m3_from_bf16_16, fp8_dequantize, fp8_quantize
from .lowlevel import INLINE, JIT, U1, U2, u32_as_f32
from .quantize import consecutive, dequantize_per_channel, dequantize_per_token, quantize_per_channel, quantize_per_token
from .transforms import rotation_growth

_u = uintp

# ----------------------------------------------------------------------------- the segment table

SEG_KIND, SEG_BITS, SEG_A, SEG_G, SEG_B = 0, 1, 2, 3, 4
SEG_HEADS, SEG_NHEADS, SEG_TOKENS, SEG_NTOKENS = 5, 6, 7, 8
SEG_META, SEG_META_LEN, SEG_PAYLOAD, SEG_PAYLOAD_LEN, SEG_SYM, SEG_BOOK = 9, 10, 11, 12, 13, 14
SEG_COLUMNS = 15
"""Columns: kind (:data:`KIND_UNIFORM` / :data:`KIND_BF16` / :data:`KIND_FP8` /
:data:`KIND_CODEBOOK`), bits, A (uniform, codebook: per-token; fp8: e5m2), g (uniform, codebook:
group length), B (uniform: symmetric; fp8: scaled; codebook: 1 minmax + 2 Lloyd levels),
offset and count of the head indices and of the token indices in the index array, byte offset
and length of the metadata and of the payload section in the tensor's output buffer, byte
offset of the raw symbols in the symbol buffer (codecs other than bitpack), and for a codebook
segment without fitted levels the row of ``books`` that holds its levels (NF: ``bits``)."""
KIND_UNIFORM, KIND_BF16, KIND_FP8, KIND_CODEBOOK = 0, 1, 2, 3
CB_MINMAX, CB_LLOYD = 1, 2
"""Flags of a codebook segment's B column: mid-range zero points, fitted (transmitted) levels."""


@njit(**JIT)
def bad_codebook(data, segs):
    """Whether a fitted (Lloyd) codebook segment of ``segs`` (int64 ``(S, SEG_COLUMNS)``, the
    rows of one tensor whose sections are ``data``, uint8) holds a level that is not a number
    in ``[-1, 1]`` or a level below its predecessor: what
    :func:`kvtune.codecs.codebook.check_levels` refuses (the levels are the first ``2**bits``
    float16 of the segment's metadata; a caller raises with its message)."""
    for s in range(segs.shape[0]):
        if segs[s, SEG_KIND] != KIND_CODEBOOK or not segs[s, SEG_B] & CB_LLOYD:
            continue
        off = _u(segs[s, SEG_META])
        prev = np.float32(-1.0)
        for k in range(_u(1) << _u(segs[s, SEG_BITS])):
            v = f16_bits_to_f32(np.uint16(data[off + U2 * k]) | (np.uint16(data[off + U2 * k + U1]) << np.uint16(8)))
            if not (abs(v) <= np.float32(1.0)) or v < prev:  # NaN fails the first test
                return True
            prev = v
    return False


@njit(**INLINE)
def _cb_meta(meta, m, nb, hs, ts, d_n, per_token, g, flags, bits):
    """Views of a codebook segment's metadata scratch: ``(levels, scale, zero)`` (wire order
    ``[levels if Lloyd][scale][zero if minmax]``, :meth:`CodebookQuantizer.block_meta_layout`)."""
    nl = (1 << bits) if flags & CB_LLOYD else 0
    rest = m - nl
    half = rest // 2 if flags & CB_MINMAX else rest
    shape = (nb, hs, ts, (d_n + g - 1) // g) if per_token else (nb, hs, (ts + g - 1) // g, d_n)
    return meta[:nl], meta[nl : nl + half].reshape(shape), meta[m - half : m].reshape(shape)


@njit(**INLINE)
def _meta_scratch(segs, nb, d_n):
    """Elements of the uint16 metadata scratch: the largest segment's metadata (an unscaled
    fp8 segment still needs a dummy ``(B, Hs, Ts)`` view)."""
    n = 1
    for s in range(segs.shape[0]):
        n = max(n, segs[s, SEG_META_LEN] // 2)
        if segs[s, SEG_KIND] == KIND_FP8:
            n = max(n, nb * segs[s, SEG_NHEADS] * segs[s, SEG_NTOKENS])
    return n


def _put_bf16(x, heads, tokens, out, off):  # pragma: no cover - replaced by the overload below
    raise NotImplementedError


@overload(_put_bf16, inline="always")
def _put_bf16_impl(x, heads, tokens, out, off):
    """Little-endian bfloat16 bits of ``x[:, heads][:, :, tokens]`` into ``out[off:]`` (bytes):
    a copy for bfloat16-bits input, round to nearest even for float32."""

    def impl(x, heads, tokens, out, off):
        nb, nh, nt, d_n = x.shape
        xf = x.reshape(-1)
        dn = _u(d_n)
        o = _u(off)
        for b in range(nb):
            for hi in range(heads.shape[0]):
                for ti in range(tokens.shape[0]):
                    src = _u(((b * nh + heads[hi]) * nt + tokens[ti]) * d_n)
                    for d in range(dn):
                        v = _bf16_bits_of(xf[src + d])
                        out[o + U2 * d] = np.uint8(v & 0xFF)
                        out[o + U2 * d + U1] = np.uint8(v >> 8)
                    o += U2 * dn

    return impl


def _bf16_bits_of(v):  # pragma: no cover - replaced by the overload below
    raise NotImplementedError


@overload(_bf16_bits_of, inline="always")
def _bf16_bits_of_impl(v):
    if v == types.uint16:
        return lambda v: np.int64(v)
    if v == types.float32:
        return lambda v: f32_to_bf16_bits(v)
    return None


_MAGNITUDE16 = np.uint16(0x7FFF)
"""The bits of a bfloat16 pattern without its sign."""
_BF16_NONFINITE = np.uint16(0x7F80)
"""The smallest magnitude pattern of a non-finite bfloat16 (inf; NaNs are above it)."""
_E4M3_NAN, _E5M2_NONFINITE = np.uint8(0x7F), np.uint8(0x7C)
"""The smallest magnitude pattern of a non-finite float8: e4m3 has no inf (0x7F is its NaN),
e5m2's inf is 0x7C (its NaNs are above it)."""


@njit(**INLINE)
def _le16(data, o):
    """The little-endian uint16 at byte offset ``o`` of uint8 ``data``."""
    return np.uint16(data[o]) | (np.uint16(data[o + U1]) << np.uint16(8))


@njit(**INLINE)
def _copy_bf16(data, o, of, dst, n, mag):
    """``of[dst:dst + n]`` = the ``n`` little-endian uint16 at byte offset ``o`` of ``data``;
    returns ``mag`` raised to the largest magnitude pattern copied (as :func:`_get_bf16`)."""
    for d in range(n):
        v = _le16(data, o + U2 * d)
        of[dst + d] = v
        e = np.uint16(v & _MAGNITUDE16)
        mag = e if e > mag else mag
    return mag


def _get_bf16(data, off, heads, tokens, out, kind):  # pragma: no cover - replaced by the overload below
    raise NotImplementedError


@overload(_get_bf16, inline="always")
def _get_bf16_impl(data, off, heads, tokens, out, kind):
    """Little-endian bfloat16 bits from ``data[off:]`` into ``out[:, heads][:, :, tokens]``: a
    copy into bfloat16 output (uint16 ``out``, ``kind`` 1), else converted as
    :func:`~kvtune.codecs.kernels.convert.store_row`. Returns the largest magnitude pattern
    copied (the bits without the sign, as :func:`~.finite.max_magnitude_bf16`: ``>= 0x7F80`` is
    a NaN or inf), a max reduction in the same loop. Into bfloat16, a head whose tokens are
    consecutive is one run of ``out``, copied by one loop instead of one per row: the ``none``
    preset's decode into preallocated tensors, two threads, 1.28-1.41 -> 1.04-1.22 ms."""
    if out.dtype == types.uint16:

        def impl(data, off, heads, tokens, out, kind):
            nb, nh, nt, d_n = out.shape
            of = out.reshape(-1)
            dn = _u(d_n)
            o = _u(off)
            row = np.empty(d_n, np.float32)
            mag = np.uint16(0)
            ts = tokens.shape[0]
            run = ts > 0 and consecutive(tokens)
            for b in range(nb):
                for hi in range(heads.shape[0]):
                    if kind == 1 and run:  # the head's rows are one run of out: one loop
                        n = _u(ts * d_n)
                        mag = _copy_bf16(data, o, of, _u(((b * nh + heads[hi]) * nt + tokens[0]) * d_n), n, mag)
                        o += U2 * n
                        continue
                    for ti in range(ts):
                        dst = _u(((b * nh + heads[hi]) * nt + tokens[ti]) * d_n)
                        if kind == 1:
                            mag = _copy_bf16(data, o, of, dst, dn, mag)
                        else:
                            for d in range(dn):
                                v = _le16(data, o + U2 * d)
                                row[d] = bf16_bits_to_f32(v)
                                e = np.uint16(v & _MAGNITUDE16)
                                mag = e if e > mag else mag
                            store_row(of, dst, row, dn, kind)
                        o += U2 * dn
            return mag

        return impl
    if out.dtype == types.float32:

        def impl(data, off, heads, tokens, out, kind):
            nb, nh, nt, d_n = out.shape
            of = out.reshape(-1)
            dn = _u(d_n)
            o = _u(off)
            mag = np.uint16(0)
            for b in range(nb):
                for hi in range(heads.shape[0]):
                    for ti in range(tokens.shape[0]):
                        dst = _u(((b * nh + heads[hi]) * nt + tokens[ti]) * d_n)
                        for d in range(dn):
                            v = _le16(data, o + U2 * d)
                            of[dst + d] = bf16_bits_to_f32(v)
                            e = np.uint16(v & _MAGNITUDE16)
                            mag = e if e > mag else mag
                        o += U2 * dn
            return mag

        return impl
    return None


def _fp8_encode(x, heads, tokens, e5m2, scaled, sym, sc, lut8):  # pragma: no cover - overloaded
    raise NotImplementedError


@overload(_fp8_encode, inline="always")
def _fp8_encode_impl(x, heads, tokens, e5m2, scaled, sym, sc, lut8):
    """float8 symbols of a segment. Unscaled bfloat16 input: e4m3 16 lanes at a time
    (:func:`~.fp8.e4m3_from_bf16_16`, the c10 conversion), e5m2 and the last ``D mod 16``
    channels by a lookup in ``lut8`` (the symbol of every bfloat16 pattern, made by torch's own
    cast, so exact); otherwise :func:`~kvtune.codecs.kernels.fp8_quantize`."""
    if x.dtype == types.uint16:

        def impl(x, heads, tokens, e5m2, scaled, sym, sc, lut8):
            if scaled:
                fp8_quantize(x, heads, tokens, e5m2, 57344.0 if e5m2 else 448.0, scaled, sym, sc)
                return
            lut = lut8[1 if e5m2 else 0]
            nb, nh, nt, d_n = x.shape
            xf, sf = x.reshape(-1), sym.reshape(-1)
            dn = _u(d_n)
            dv = _u(0 if e5m2 else d_n // FP8_LANES * FP8_LANES)  # e4m3: 16 lanes at a time, then the table
            o = _u(0)
            for b in range(nb):
                for hi in range(heads.shape[0]):
                    for ti in range(tokens.shape[0]):
                        src = _u(((b * nh + heads[hi]) * nt + tokens[ti]) * d_n)
                        for d in range(_u(0), dv, _u(FP8_LANES)):
                            e4m3_from_bf16_16(xf, src + d, sf, o + d)
                        for d in range(dv, dn):
                            sf[o + d] = lut[xf[src + d]]
                        o += dn

        return impl

    def impl(x, heads, tokens, e5m2, scaled, sym, sc, lut8):
        fp8_quantize(x, heads, tokens, e5m2, 57344.0 if e5m2 else 448.0, scaled, sym, sc)

    return impl


def _fp8_decode(sym, sc, luts, lut16, scaled, e5m2, heads, tokens, out, kind):  # pragma: no cover
    raise NotImplementedError


@overload(_fp8_decode, inline="always")
def _fp8_decode_impl(sym, sc, luts, lut16, scaled, e5m2, heads, tokens, out, kind):
    """Reconstruction of a float8 segment. Unscaled into bfloat16 output: e4m3 16 lanes at a
    time (:func:`~.fp8.bf16_from_e4m3_16`, its NaN bits from ``lut16``), e5m2 and the last
    ``D mod 16`` channels by a lookup in ``lut16`` (the bfloat16 bits of every float8 value,
    made by torch); otherwise :func:`~kvtune.codecs.kernels.fp8_dequantize`."""
    if out.dtype == types.uint16:

        def impl(sym, sc, luts, lut16, scaled, e5m2, heads, tokens, out, kind):
            if scaled or kind != 1:
                fp8_dequantize(sym, sc, luts[1 if e5m2 else 0], scaled, heads, tokens, out, kind)
                return
            lut = lut16[1 if e5m2 else 0]
            nb, hs, ts, d_n = sym.shape
            nh, nt = out.shape[1], out.shape[2]
            sf, of = sym.reshape(-1), out.reshape(-1)
            dn = _u(d_n)
            dv = _u(0 if e5m2 else d_n // FP8_LANES * FP8_LANES)  # e4m3: 16 lanes at a time, then the table
            nan_pos, nan_neg = lut[0x7F], lut[0xFF]
            o = _u(0)
            for b in range(nb):
                for hi in range(hs):
                    for ti in range(ts):
                        dst = _u(((b * nh + heads[hi]) * nt + tokens[ti]) * d_n)
                        for d in range(_u(0), dv, _u(FP8_LANES)):
                            bf16_from_e4m3_16(sf, o + d, nan_pos, nan_neg, of, dst + d)
                        for d in range(dv, dn):
                            of[dst + d] = lut[sf[o + d]]
                        o += dn

        return impl

    def impl(sym, sc, luts, lut16, scaled, e5m2, heads, tokens, out, kind):
        fp8_dequantize(sym, sc, luts[1 if e5m2 else 0], scaled, heads, tokens, out, kind)

    return impl


@njit(**INLINE)
def per_token_only(segs):
    """Whether every segment of the table is per-token uniform (a rotation can be fused into
    its quantizer, :func:`encode_segments`'s ``rot``)."""
    ok = True
    for s in range(segs.shape[0]):
        ok = ok and segs[s, SEG_KIND] == KIND_UNIFORM and segs[s, SEG_A] != 0
    return ok


@njit(**JIT)
def encode_segments(x, segs, idx, out, symbuf, pack, lut8, books, rot=None):
    """Quantize every segment of one tensor; write metadata and (if ``pack``) packed payloads.

    Reference: per segment, the block quantizer's ``quantize_block`` on
    ``x[:, heads][:, :, tokens]`` (:class:`~kvtune.codecs.quantizers.UniformQuantizer`,
    :class:`~kvtune.codecs.quantizers.NoQuantizer`, :class:`~kvtune.codecs.fp8.FP8Quantizer`),
    :func:`kvtune.codecs.base.meta_to_bytes` and :func:`kvtune.codecs.bitpack.pack_bits`.

    Args:
        x: ``(B, H, T, D)`` float32 or uint16 (bfloat16 bits), after the transforms.
        segs: int64 ``(S, SEG_COLUMNS)`` segment table; idx: int64 head and token indices.
        out: uint8 buffer of the tensor's sections; metadata (float16, little-endian) and, when
            ``pack``, the bit-packed payloads (:func:`~kvtune.codecs.kernels.pack_bits`; bfloat16
            as little-endian words) are written at the table's offsets.
        symbuf: uint8 scratch; when not ``pack``, each segment's symbols are left at its
            ``SEG_SYM`` offset (uint8, or little-endian uint16 for bfloat16) for another codec.
        pack: bit-pack into ``out`` (the ``bitpack`` codec).
        lut8: uint8 ``(2, 65536)``: the e4m3 and e5m2 symbol of every bfloat16 pattern.
        books: float64 ``(R, 256)``, ``R >= 9``: a codebook segment without fitted levels takes
            the first ``2**bits`` entries of row ``SEG_BOOK`` (rows ``b < 9``: the ``2**b`` NF
            levels, :func:`kvtune.codecs.codebook.nf_table`; further rows: calibrated levels of
            a layer).
        rot: ``None``, or a Hadamard rotation of ``x`` fused into the quantizer's row loads
            (:func:`~.quantize.quantize_per_token`): the same bytes as rotating ``x`` first.
            Only for tables of per-token uniform segments (:func:`per_token_only`).

    Returns:
        The OR of every symbol of widths 1..8 (the caller checks that they fit).

    Raises:
        ValueError: ``rot`` with a segment that is not per-token uniform.
    """
    nb, nh, nt, d_n = x.shape
    meta = np.empty(_meta_scratch(segs, nb, d_n), np.uint16)
    seen = np.int64(0)
    for s in range(segs.shape[0]):
        kind, bits = segs[s, SEG_KIND], segs[s, SEG_BITS]
        hs, ts = segs[s, SEG_NHEADS], segs[s, SEG_NTOKENS]
        heads = idx[segs[s, SEG_HEADS] : segs[s, SEG_HEADS] + hs]
        tokens = idx[segs[s, SEG_TOKENS] : segs[s, SEG_TOKENS] + ts]
        n = nb * hs * ts * d_n
        so = 0 if pack else segs[s, SEG_SYM]
        if rot is not None and not (kind == KIND_UNIFORM and segs[s, SEG_A]):
            raise ValueError("a fused rotation needs per-token uniform segments")
        if kind == KIND_BF16:
            if pack:
                _put_bf16(x, heads, tokens, out, segs[s, SEG_PAYLOAD])
            else:
                _put_bf16(x, heads, tokens, symbuf, so)
            continue
        sym = symbuf[so : so + n].reshape((nb, hs, ts, d_n))
        m = segs[s, SEG_META_LEN] // 2
        if kind == KIND_UNIFORM:
            g, symmetric = segs[s, SEG_G], segs[s, SEG_B] != 0
            half = m if symmetric else m // 2
            if segs[s, SEG_A]:
                ng = (d_n + g - 1) // g
                sc = meta[:half].reshape((nb, hs, ts, ng))
                ze = meta[m - half : m].reshape((nb, hs, ts, ng))
                quantize_per_token(x, heads, tokens, g, bits, symmetric, sym, sc, ze, rot)
            else:
                ng = (ts + g - 1) // g
                sc = meta[:half].reshape((nb, hs, ng, d_n))
                ze = meta[m - half : m].reshape((nb, hs, ng, d_n))
                quantize_per_channel(x, heads, tokens, g, bits, symmetric, sym, sc, ze)
        elif kind == KIND_CODEBOOK:
            per_token, g, flags = segs[s, SEG_A] != 0, segs[s, SEG_G], segs[s, SEG_B]
            lv, sc, ze = _cb_meta(meta, m, nb, hs, ts, d_n, per_token, g, flags, bits)
            codebook_quantize(x, heads, tokens, per_token, g, flags & CB_MINMAX != 0, flags & CB_LLOYD != 0,
                              books[segs[s, SEG_BOOK], : 1 << bits], sym, lv, sc, ze)
        else:
            e5m2, scaled = segs[s, SEG_A] != 0, segs[s, SEG_B] != 0
            sc = meta[: max(m, nb * hs * ts)].reshape((nb, hs, ts))
            _fp8_encode(x, heads, tokens, e5m2, scaled, sym, sc, lut8)
        put_u16(meta, m, out, _u(segs[s, SEG_META]))
        if pack:
            po = segs[s, SEG_PAYLOAD]
            seen |= pack_bits(sym.reshape(-1), bits, out[po : po + segs[s, SEG_PAYLOAD_LEN]])
    return seen


@njit(**JIT)
def decode_segments(data, segs, idx, luts, lut16, symbuf, packed, out, kind, books, rot=None):
    """Inverse of :func:`encode_segments`: reconstruct every segment of one tensor into ``out``.

    Reference: per segment, :func:`kvtune.codecs.bitpack.unpack_bits`,
    :func:`kvtune.codecs.base.meta_from_bytes` and the block quantizer's ``dequantize_block``,
    converted to the output dtype and written at the segment's heads and tokens.

    Args:
        data: uint8 sections of the tensor (lengths already checked against the table).
        segs, idx: as :func:`encode_segments`.
        luts: float32 ``(2, 256)`` values of the e4m3 and e5m2 bit patterns.
        lut16: uint16 ``(2, 256)``: their bfloat16 bits.
        symbuf: the symbols of each segment at its ``SEG_SYM`` offset when not ``packed``;
            scratch otherwise.
        packed: the payloads in ``data`` are bit-packed (``bitpack``).
        out: ``(B, H, T, D)`` float32, or uint16 bits of ``kind`` (1 bfloat16, 2 float16).
        books: the NF and calibrated levels, as :func:`encode_segments`. Fitted codebooks are taken as they
            are: the caller validates them (:func:`kvtune.codecs.codebook.check_levels`).
        rot: ``None``, or the rotation to undo on each row before its conversion
            (:func:`~.quantize.dequantize_per_token`), as :func:`encode_segments`'s.

    Returns:
        Whether every bfloat16 value and float8 symbol is finite (an encoder writes only finite
        ones, float8 saturating; a NaN or inf there comes from a forged stream, and the caller
        refuses it). The uniform and codebook kinds cannot make a NaN or inf from finite float16
        metadata, which the caller checks.

    Raises:
        ValueError: ``rot`` with a segment that is not per-token uniform.
    """
    nb, nh, nt, d_n = out.shape
    meta = np.empty(_meta_scratch(segs, nb, d_n), np.uint16)
    mag = np.uint16(0)
    for s in range(segs.shape[0]):
        sk, bits = segs[s, SEG_KIND], segs[s, SEG_BITS]
        hs, ts = segs[s, SEG_NHEADS], segs[s, SEG_NTOKENS]
        heads = idx[segs[s, SEG_HEADS] : segs[s, SEG_HEADS] + hs]
        tokens = idx[segs[s, SEG_TOKENS] : segs[s, SEG_TOKENS] + ts]
        n = nb * hs * ts * d_n
        so = 0 if packed else segs[s, SEG_SYM]
        if rot is not None and not (sk == KIND_UNIFORM and segs[s, SEG_A]):
            raise ValueError("a fused rotation needs per-token uniform segments")
        if sk == KIND_BF16:
            src = data if packed else symbuf
            e = _get_bf16(src, segs[s, SEG_PAYLOAD] if packed else so, heads, tokens, out, kind)
            mag = e if e > mag else mag
            continue
        sym = symbuf[so : so + n]
        if packed:
            po = segs[s, SEG_PAYLOAD]
            unpack_bits(data[po : po + segs[s, SEG_PAYLOAD_LEN]], bits, sym)
        sym4 = sym.reshape((nb, hs, ts, d_n))
        m = segs[s, SEG_META_LEN] // 2
        get_u16(data, _u(segs[s, SEG_META]), m, meta)
        if sk == KIND_UNIFORM:
            g, symmetric = segs[s, SEG_G], segs[s, SEG_B] != 0
            half = m if symmetric else m // 2
            if segs[s, SEG_A]:
                ng = (d_n + g - 1) // g
                sc = meta[:half].reshape((nb, hs, ts, ng))
                ze = meta[m - half : m].reshape((nb, hs, ts, ng))
                dequantize_per_token(sym4, sc, ze, g, bits, symmetric, heads, tokens, out, kind, rot)
            else:
                ng = (ts + g - 1) // g
                sc = meta[:half].reshape((nb, hs, ng, d_n))
                ze = meta[m - half : m].reshape((nb, hs, ng, d_n))
                dequantize_per_channel(sym4, sc, ze, g, bits, symmetric, heads, tokens, out, kind)
        elif sk == KIND_CODEBOOK:
            per_token, g, flags = segs[s, SEG_A] != 0, segs[s, SEG_G], segs[s, SEG_B]
            lv, sc, ze = _cb_meta(meta, m, nb, hs, ts, d_n, per_token, g, flags, bits)
            nl = 1 << bits
            lev = np.empty(nl, np.float32)
            for k in range(nl):
                lev[k] = f16_bits_to_f32(lv[k]) if flags & CB_LLOYD else np.float32(books[segs[s, SEG_BOOK], k])
            codebook_dequantize(sym4, lev, sc, ze, per_token, g, flags & CB_MINMAX != 0, heads, tokens, out, kind)
        else:
            e5m2, scaled = segs[s, SEG_A] != 0, segs[s, SEG_B] != 0
            if max_masked(sym, np.uint8(0x7F)) >= (_E5M2_NONFINITE if e5m2 else _E4M3_NAN):
                mag = _BF16_NONFINITE  # a NaN / inf symbol: not finite (the caller raises)
            sc = meta[: max(m, nb * hs * ts)].reshape((nb, hs, ts))
            _fp8_decode(sym4, sc, luts, lut16, scaled, e5m2, heads, tokens, out, kind)
    return mag < _BF16_NONFINITE


def _magnitude(x):  # pragma: no cover - replaced by the overload below
    """``(bits, value, finite)`` of the largest ``|x|`` (:func:`kvtune.codecs.kernels.max_magnitude_bf16`
    / ``max_magnitude_f32``); in compiled code only."""
    raise NotImplementedError


@overload(_magnitude, inline="always")
def _magnitude_impl(x):
    if x.dtype == types.uint16:

        def impl(x):
            bits = np.int64(max_masked(x.reshape(-1), np.uint16(0x7FFF)))
            return bits, u32_as_f32(np.uint32(bits) << np.uint32(16)), bits < _BF16_NONFINITE

        return impl
    if x.dtype == types.float32:

        def impl(x):
            bits = np.int64(max_masked(x.reshape(-1).view(np.uint32), np.uint32(0x7FFFFFFF)))
            return bits, u32_as_f32(np.uint32(bits)), bits < 0x7F800000

        return impl
    return None


@njit(**JIT)
def encode_tensor(x, limit, segs, idx, out, symbuf, lut8, books, rot=None):
    """The whole ``bitpack`` encode of one K or V tensor (without transforms, or with a fused
    rotation ``rot``) in one call: the
    input check, :func:`encode_segments` and the CRC-32 of the sections (a codec thread then
    releases and re-takes the GIL once per tensor, not once per step: with two threads each
    re-take may wait for the other thread's Python).

    Reference: :func:`kvtune.codecs.kernels.max_magnitude_bf16` (``max_magnitude_f32`` for
    float32 ``x``), then :func:`encode_segments` with ``pack`` and :func:`crc32_update` of
    ``out`` from 0.

    Args:
        x: ``(B, H, T, D)`` uint16 (bfloat16 bits) or float32; limit: the largest magnitude the
            plan's blocks take without a per-segment check (float64; ``inf`` to skip it).
        segs, idx, out, symbuf, lut8, books, rot: as :func:`encode_segments` (``pack`` is
            true). With ``rot``, ``limit`` applies to the rotated values: ``x``'s magnitude
            times :func:`~.transforms.rotation_growth` (a bound) is checked against it.

    Returns:
        ``(magnitude, seen, crc)``: ``magnitude`` the largest ``|x|`` as bits (as
        ``max_magnitude_*``); when it is a NaN / inf or its value exceeds ``limit``, nothing is
        written and ``seen`` is -1 (the caller checks the value ranges, then calls again with
        ``limit = inf``); else ``seen`` as :func:`encode_segments` and ``crc`` the CRC-32 of
        ``out``.
    """
    bits, value, finite = _magnitude(x)
    bound = np.float64(value)
    if rot is not None:
        bound *= rotation_growth(rot[1], rot[2])
    if not (finite and bound <= limit):
        return bits, np.int64(-1), np.int64(0)
    seen = encode_segments(x, segs, idx, out, symbuf, True, lut8, books, rot)
    return bits, seen, crc32_update(0, out)


@njit(**JIT)
def decode_tensor(data, segs, idx, luts, lut16, symbuf, out, kind, books, rot=None):
    """The whole ``bitpack`` decode of one K or V tensor in one call: the CRC-32 of its sections
    ``data`` (while they are read anyway; the caller combines the tensors' CRCs into the
    stream's, :func:`crc32_combine`), then :func:`decode_segments` with ``packed``.

    Reference: :func:`crc32_update` of ``data`` from 0, then :func:`decode_segments`.
    Arguments as :func:`decode_segments`. Returns ``(crc, finite)``: the CRC-32 of ``data`` and
    :func:`decode_segments`'s answer.
    """
    crc = crc32_update(0, data)
    finite = decode_segments(data, segs, idx, luts, lut16, symbuf, True, out, kind, books, rot)
    return crc, finite
