"""The vector rANS coder loops of :mod:`.rans`: 32 lanes in two 512-bit vectors, as numba intrinsics.

rANS after J. Duda (arXiv 1311.2540, sec. 4), interleaved as in F. Giesen, "Interleaved entropy
coders" (arXiv 1402.3392): a run coded with :data:`GROUP` (32) lanes keeps its states in
:data:`VECTORS` vectors of 16 uint32, and one step codes the 32 super-symbols of a group, one per
lane. The stream is the one the scalar loops of :mod:`.rans` write (symbol ``i`` on lane
``i mod 32``, one 16-bit word per renormalisation, lane order inside a group), so either loop
decodes what the other encoded (the tests compare both with a pure Python coder):

* the encoder walks the groups backwards; the lanes of a vector that renormalise emit their
  low words with one compress-store (``vpcompressw`` on AVX-512 VBMI2, see
  :data:`REGISTER_COMPRESS`), lane 0 at the lowest address, below the words of the later lanes
  and groups;
* the decoder walks them forwards and reads the words of the lanes that renormalise with one
  expand-load (``llvm.masked.expandload``, ``vpexpandw``);
* the table entries of 16 lanes come in with 16 scalar loads in the encoder (faster than a
  gather there, see :func:`_load_each`) and with two gathers per vector in the decoder
  (``llvm.masked.gather``, ``vpgatherdd``: the slot's symbol, then its frequency and start),
  which makes a decoder step one long dependency chain; two vectors
  are two chains that overlap (one vector: 2.3 ns per super-symbol, two: 1.4, four: 1.4, on
  the 2-core Zen 5 of ``benchmarks/results``, measured with a one-off script).

Division: ``x // f`` with ``x < f 2**(32 - P)`` is estimated in float32 (``x`` rounded to
float32, then a correctly rounded division by ``f``: relative error below ``2**-23``, an absolute
error below ``2**(9 - P) < 1`` for ``P >= 10``) and corrected by one integer step, so the states
are the exact integers of the scalar coder. On a machine without AVX-512, LLVM emits the same
vector operations from narrower instructions (correct, slower).

The model of super-symbol ``i`` is ``(i // div) % mod`` (see :mod:`.rans`); each lane keeps its
``(i // div) % mod`` and ``i % div`` in two vectors, stepped by 32 symbols per group.
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from .lowlevel import target_has_features

VECTOR_LANES = 16
"""States per vector (one 512-bit vector of uint32)."""
VECTORS = 2
"""Vectors per group: each is its own dependency chain (two table gathers deep in the decoder),
so that one waits on its gathers while the other computes."""
GROUP = VECTOR_LANES * VECTORS
"""Lanes of a run coded in vectors: symbols per group."""
MIN_PREC = 10
"""Smallest probability precision of the float32 division estimate (see the module doc)."""
MAX_PREC = 15
"""Largest precision: a frequency must fit the 16-bit field of the packed ``freq << 16 | cum``
table entries."""

REGISTER_COMPRESS = target_has_features("avx512vbmi2", "avx512vl", "avx512bw")
"""Whether the encoder packs the renormalisation words in a register (``vpcompressw`` with a
register destination, then a store masked to the words' count) instead of with
``llvm.masked.compressstore`` (``vpcompressw`` with a memory destination). Zen 4 runs the
memory form as microcode: on the 2-core Zen 4 of ``benchmarks/results/codecs_s25.md`` the
encoder loop of one ``(1, 3, 1024, 64)`` tensor of CacheGen's 4-bit deltas (88,416
super-symbols) took 333 us with it and 84 us with the register form (1 thread, medians of
15, one-off script). Without AVX-512 VBMI2 the generic intrinsic stays (LLVM lowers it for
any target). The decoder's ``llvm.masked.expandload`` is left as it is: its register form
measured the same there."""

_I1, _I16, _I32, _I64, _F32 = ir.IntType(1), ir.IntType(16), ir.IntType(32), ir.IntType(64), ir.FloatType()
_VI = ir.VectorType(_I32, VECTOR_LANES)
_VF = ir.VectorType(_F32, VECTOR_LANES)
_VM = ir.VectorType(_I1, VECTOR_LANES)
_VW = ir.VectorType(_I16, VECTOR_LANES)


def _const(v: int):
    return ir.Constant(_VI, [v] * VECTOR_LANES)


def _splat(builder, scalar):
    """A run-time i32 in every lane."""
    v = builder.insert_element(ir.Constant(_VI, ir.Undefined), scalar, ir.Constant(_I32, 0))
    return builder.shuffle_vector(v, ir.Constant(_VI, ir.Undefined), ir.Constant(_VI, [0] * VECTOR_LANES))


def _data(context, builder, ty, val):
    return context.make_array(ty)(context, builder, val).data


def _fn(builder, name, ret, argtys):
    return cgutils.get_or_insert_function(builder.module, ir.FunctionType(ret, argtys), name)


def _gather(builder, base, index, byte_base=None):
    """The uint32 ``base[index[l]]`` of the 16 lanes; with ``byte_base`` (an ``i8*``), the 4
    bytes at ``byte_base + index[l]`` instead (unaligned: a narrower table read through 32-bit
    loads, which the caller masks and pads)."""
    src = byte_base if byte_base is not None else base
    ptrs = builder.gep(src, [index], source_etype=src.type.pointee)
    ptrs.type = ir.VectorType(_I32.as_pointer(), VECTOR_LANES)  # a vector of pointers (llvmlite has no vector GEP)
    fn = _fn(builder, "llvm.masked.gather.v16i32.v16p0", _VI, [ptrs.type, _I32, _VM, _VI])
    return builder.call(fn, [ptrs, ir.Constant(_I32, 1 if byte_base is not None else 4),
                             ir.Constant(_VM, [1] * VECTOR_LANES), ir.Constant(_VI, ir.Undefined)])


def _load_each(builder, base, index):
    """The uint32 ``base[index[l]]`` of the 16 lanes as 16 scalar loads inserted into a vector:
    the encoder's table lookups. On the 2-core Zen 5 of ``benchmarks/results`` the encoder loop
    of one CacheGen 4-bit delta tensor (88,416 super-symbols, 32 models x 256 entries) took
    40-41 us with it against 55-56 us with ``vpgatherdd`` (:func:`_gather`; same words, one
    thread, medians of 300, one-off script, 2026-12-05). The decoder, whose lookups lie on its
    states' dependency chain, measured the same either way (84 us) and keeps the gather."""
    v = ir.Constant(_VI, ir.Undefined)
    for lane in range(VECTOR_LANES):
        at = builder.sext(builder.extract_element(index, ir.Constant(_I32, lane)), _I64)
        v = builder.insert_element(v, builder.load(builder.gep(base, [at]), align=4), ir.Constant(_I32, lane))
    return v


def _popcount(builder, mask):
    """Set lanes of a ``<16 x i1>`` mask, as i64."""
    bits = builder.bitcast(mask, _I16)
    return builder.zext(builder.call(_fn(builder, "llvm.ctpop.i16", _I16, [_I16]), [bits]), _I64)


def _load_lanes(builder, ptr, at, width):
    """16 consecutive integers of ``width`` bits at ``ptr[at]``, zero-extended (or truncated)
    to i32."""
    vty = ir.VectorType(ir.IntType(width), VECTOR_LANES)
    v = builder.load(builder.bitcast(builder.gep(ptr, [at]), vty.as_pointer()), align=width // 8)
    if width < 32:
        return builder.zext(v, _VI)
    return builder.trunc(v, _VI) if width > 32 else v


def _push_words(builder, words, ptr, mask):
    """Store the 16-bit ``words`` of the lanes set in ``mask`` at ``ptr``, packed, lane order."""
    if not REGISTER_COMPRESS:
        builder.call(_fn(builder, "llvm.masked.compressstore.v16i16", ir.VoidType(), [_VW, _I16.as_pointer(), _VM]),
                     [words, ptr, mask])
        return
    packed = builder.call(_fn(builder, "llvm.x86.avx512.mask.compress.v16i16", _VW, [_VW, _VW, _VM]),
                          [words, ir.Constant(_VW, [0] * VECTOR_LANES), mask])
    n = builder.trunc(_popcount(builder, mask), _I16)
    n = builder.shuffle_vector(builder.insert_element(ir.Constant(_VW, ir.Undefined), n, ir.Constant(_I32, 0)),
                               ir.Constant(_VW, ir.Undefined), ir.Constant(_VI, [0] * VECTOR_LANES))
    first = builder.icmp_unsigned("<", ir.Constant(_VW, list(range(VECTOR_LANES))), n)
    builder.call(_fn(builder, "llvm.masked.store.v16i16.p0", ir.VoidType(), [_VW, _I16.as_pointer(), _I32, _VM]),
                 [packed, ptr, ir.Constant(_I32, 2), first])


def _int_width(arr) -> int | None:
    if isinstance(arr, types.Array) and isinstance(arr.dtype, types.Integer) and arr.ndim == 1 and arr.layout == "C":
        return arr.dtype.bitwidth
    return None


def _u32_array(arr) -> bool:
    return isinstance(arr, types.Array) and arr.dtype == types.uint32 and arr.ndim == 1


def _model_vectors(builder, context, sa, args, k):
    """Per vector ``j``, its lanes' ``(model, count)`` vectors from int32 ``qc[32 j : 32 j + 16]``
    and ``qc[32 j + 16 : 32 j + 32]`` (arg ``k``)."""
    p = builder.bitcast(_data(context, builder, sa[k], args[k]), _VI.as_pointer())
    return [tuple(builder.load(builder.gep(p, [ir.Constant(_I32, 2 * j + h)]), align=4) for h in (0, 1))
            for j in range(VECTORS)]


def _params(builder, context, sa, args, k):
    """``(a, b, div, mod, ks, prec)`` as i32 from int64 ``params`` (arg ``k``)."""
    p = _data(context, builder, sa[k], args[k])
    return [builder.trunc(builder.load(builder.gep(p, [ir.Constant(_I64, j)])), _I32) for j in range(6)]


@intrinsic
def encode_groups(typingctx, fz, g_hi, states, qc, params, fc, out, pos):
    """Encode the groups ``g_hi - 1, ..., 0`` of 32 super-symbols ``fz[32 g : 32 g + 32]``
    (backwards), pushing words below ``out[pos]``; returns the new ``pos`` (int64).

    Args:
        fz: C-contiguous integer super-symbols (any width; values below ``ks``).
        states: uint32 ``(32,)`` lane states, updated in place.
        qc: int32 ``(64,)``: per vector ``j``, ``qc[32 j : 32 j + 16]`` the model ``(i // div) %
            mod`` and ``qc[32 j + 16 : 32 j + 32]`` the ``i % div`` of lane ``l = 16 j + k``'s
            symbol ``i = 32 (g_hi - 1) + l``.
        params: int64 ``(a, b, div, mod, ks, prec)``: ``a = (32 // div) % mod``, ``b = 32 % div``
            (one group's step of the model counters), ``ks`` symbols per model, ``prec`` in
            ``MIN_PREC..MAX_PREC``.
        fc: uint32 ``freq << 16 | cum`` per ``model * ks + symbol`` (every coded symbol has
            ``freq > 0``).
        out: uint16 word stack; ``pos`` >= 32 ``g_hi`` (at most one word per symbol).
    """
    if not (_int_width(fz) and _u32_array(states) and _u32_array(fc) and _int_width(out) == 16):
        return None
    sig = types.int64(fz, g_hi, states, qc, params, fc, out, pos)

    def codegen(context, builder, signature, args):
        sa = signature.args
        width = _int_width(sa[0])
        fzp = _data(context, builder, sa[0], args[0])
        stp = builder.bitcast(_data(context, builder, sa[2], args[2]), _VI.as_pointer())
        a, b, div, mod, ks, prec = (_splat(builder, v) for v in _params(builder, context, sa, args, 4))
        fcp, outp = (_data(context, builder, sa[k], args[k]) for k in (5, 6))
        models = _model_vectors(builder, context, sa, args, 3)
        xs = [cgutils.alloca_once_value(builder, builder.load(builder.gep(stp, [ir.Constant(_I32, k)]), align=4))
              for k in range(VECTORS)]
        qcs = [(cgutils.alloca_once_value(builder, q), cgutils.alloca_once_value(builder, c)) for q, c in models]
        posv = cgutils.alloca_once_value(builder, context.cast(builder, args[7], sa[7], types.int64))
        ghi = context.cast(builder, args[1], sa[1], types.int64)
        zero = _const(0)
        with cgutils.for_range(builder, ghi) as loop:
            g = builder.sub(builder.sub(ghi, loop.index), ir.Constant(_I64, 1))
            for k in reversed(range(VECTORS)):  # the last lanes' words go on the stack first
                xv, (qv, cv) = xs[k], qcs[k]
                x, q, c = builder.load(xv), builder.load(qv), builder.load(cv)
                at = builder.add(builder.mul(g, ir.Constant(_I64, GROUP)), ir.Constant(_I64, VECTOR_LANES * k))
                sym = _load_lanes(builder, fzp, at, width)
                t = builder.add(builder.mul(q, ks), sym)
                e = _load_each(builder, fcp, t)
                f = builder.lshr(e, _const(16))
                big = builder.icmp_unsigned(">=", builder.lshr(x, builder.sub(_const(32), prec)), f)
                pos = builder.sub(builder.load(posv), _popcount(builder, big))
                builder.store(pos, posv)
                _push_words(builder, builder.trunc(x, _VW), builder.gep(outp, [pos]), big)
                x = builder.select(big, builder.lshr(x, _const(16)), x)
                d = builder.fptoui(builder.fdiv(builder.uitofp(x, _VF), builder.uitofp(f, _VF)), _VI)
                r = builder.sub(x, builder.mul(d, f))
                neg = builder.icmp_signed("<", r, zero)
                d = builder.sub(d, builder.zext(neg, _VI))
                r = builder.add(r, builder.select(neg, f, zero))
                over = builder.icmp_signed(">=", r, f)
                d = builder.add(d, builder.zext(over, _VI))
                r = builder.sub(r, builder.select(over, f, zero))
                x = builder.add(builder.add(builder.shl(d, prec), r), builder.and_(e, _const(0xFFFF)))
                builder.store(x, xv)
                c = builder.sub(c, b)  # the lanes' models one group back
                borrow = builder.icmp_signed("<", c, zero)
                builder.store(builder.select(borrow, builder.add(c, div), c), cv)
                q = builder.sub(builder.sub(q, a), builder.zext(borrow, _VI))
                builder.store(builder.select(builder.icmp_signed("<", q, zero), builder.add(q, mod), q), qv)
        for k in range(VECTORS):
            builder.store(builder.load(xs[k]), builder.gep(stp, [ir.Constant(_I32, k)]), align=4)
        return builder.load(posv)

    return sig, codegen


@intrinsic
def decode_groups(typingctx, words, io, states, qc, params, fc, slots, out, g_lo, g_hi):
    """Decode the groups ``g_lo, g_lo + 1, ...`` of 32 super-symbols into ``out[32 g : 32 g +
    32]`` while ``g < g_hi`` and 32 more words can be read (``pos + 32 <= nw``); returns the
    groups decoded (int64).

    Args:
        words: uint16 stream; ``io``: int64 ``(pos, nw)``, ``pos`` updated in place.
        states: uint32 ``(32,)`` lane states, updated in place.
        qc, params: as :func:`encode_groups`, for lane ``l``'s symbol ``32 g_lo + l``.
        fc: uint32 ``freq << 16 | cum`` per ``model * ks + symbol``.
        slots: uint8 or uint16 symbol of every slot of every model (``model * 2**prec + slot``),
            with 4 elements of padding after the last (read by 32-bit gathers).
        out: uint8 or uint16 super-symbols (the caller checks ``ks`` fits them).
    """
    sw, ow = _int_width(slots), _int_width(out)
    if not (_int_width(words) == 16 and _u32_array(states) and _u32_array(fc) and sw in (8, 16) and ow in (8, 16)):
        return None
    sig = types.int64(words, io, states, qc, params, fc, slots, out, g_lo, g_hi)

    def codegen(context, builder, signature, args):
        sa = signature.args
        wp = _data(context, builder, sa[0], args[0])
        iop = _data(context, builder, sa[1], args[1])
        stp = builder.bitcast(_data(context, builder, sa[2], args[2]), _VI.as_pointer())
        a, b, div, mod, ks, prec = (_splat(builder, v) for v in _params(builder, context, sa, args, 4))
        fcp = _data(context, builder, sa[5], args[5])
        slotp = builder.bitcast(_data(context, builder, sa[6], args[6]), ir.IntType(8).as_pointer())
        outp = _data(context, builder, sa[7], args[7])
        models = _model_vectors(builder, context, sa, args, 3)
        xs = [cgutils.alloca_once_value(builder, builder.load(builder.gep(stp, [ir.Constant(_I32, k)]), align=4))
              for k in range(VECTORS)]
        qcs = [(cgutils.alloca_once_value(builder, q), cgutils.alloca_once_value(builder, c)) for q, c in models]
        posv = cgutils.alloca_once_value(builder, builder.load(iop))
        nw = builder.load(builder.gep(iop, [ir.Constant(_I64, 1)]))
        glo = context.cast(builder, args[8], sa[8], types.int64)
        ghi = context.cast(builder, args[9], sa[9], types.int64)
        gv = cgutils.alloca_once_value(builder, glo)
        pmask = builder.sub(builder.shl(_const(1), prec), _const(1))
        group = ir.Constant(_I64, GROUP)
        emask = _const((1 << sw) - 1)
        ovty = ir.VectorType(ir.IntType(ow), VECTOR_LANES)
        cond = builder.append_basic_block("rans_dec_cond")
        body = builder.append_basic_block("rans_dec_body")
        done = builder.append_basic_block("rans_dec_done")
        builder.branch(cond)
        builder.position_at_end(cond)
        g = builder.load(gv)
        room = builder.icmp_signed("<=", builder.add(builder.load(posv), group), nw)
        builder.cbranch(builder.and_(builder.icmp_signed("<", g, ghi), room), body, done)
        builder.position_at_end(body)
        for k in range(VECTORS):  # lane order: the first lanes' words come first
            xv, (qv, cv) = xs[k], qcs[k]
            x, q, c = builder.load(xv), builder.load(qv), builder.load(cv)
            slot = builder.and_(x, pmask)
            si = builder.add(builder.shl(q, prec), slot)
            if sw == 16:
                si = builder.shl(si, _const(1))
            s = builder.and_(_gather(builder, None, si, byte_base=slotp), emask)
            e = _gather(builder, fcp, builder.add(builder.mul(q, ks), s))
            x = builder.sub(builder.add(builder.mul(builder.lshr(e, _const(16)), builder.lshr(x, prec)), slot),
                            builder.and_(e, _const(0xFFFF)))
            small = builder.icmp_unsigned("<", x, _const(1 << 16))
            pos = builder.load(posv)
            w = builder.call(_fn(builder, "llvm.masked.expandload.v16i16", _VW, [_I16.as_pointer(), _VM, _VW]),
                             [builder.gep(wp, [pos]), small, ir.Constant(_VW, [0] * VECTOR_LANES)])
            builder.store(builder.select(small, builder.or_(builder.shl(x, _const(16)), builder.zext(w, _VI)), x), xv)
            builder.store(builder.add(pos, _popcount(builder, small)), posv)
            at = builder.add(builder.mul(g, group), ir.Constant(_I64, VECTOR_LANES * k))
            builder.store(builder.trunc(s, ovty), builder.bitcast(builder.gep(outp, [at]), ovty.as_pointer()), align=ow // 8)
            c = builder.add(c, b)  # the lanes' models one group on
            carry = builder.icmp_signed(">=", c, div)
            builder.store(builder.select(carry, builder.sub(c, div), c), cv)
            q = builder.add(builder.add(q, a), builder.zext(carry, _VI))
            builder.store(builder.select(builder.icmp_signed(">=", q, mod), builder.sub(q, mod), q), qv)
        builder.store(builder.add(g, ir.Constant(_I64, 1)), gv)
        builder.branch(cond)
        builder.position_at_end(done)
        for k in range(VECTORS):
            builder.store(builder.load(xs[k]), builder.gep(stp, [ir.Constant(_I32, k)]), align=4)
        builder.store(builder.load(posv), iop)
        return builder.sub(builder.load(gv), glo)

    return sig, codegen
