"""Per-column symbol counts of a row-major symbol matrix with 512-bit byte compares.

The ``rans`` codec's per-channel models (CacheGen, arXiv 2310.07240, sec. 5.2: one probability
model per channel) start from a histogram of every channel's symbols: a flat uint8 array whose
column ``c`` of an ``(n // mod, mod)`` matrix is channel ``c``. Counting them one increment per
symbol costs about a cycle each (a load and a store per symbol, scalar), 42 us for the 176,832
five-bit delta symbols of one CacheGen K tensor on the development CPU (2-vCPU AMD EPYC Zen 5).

Here a block of up to 255 rows of 64 columns is counted for :data:`VALUES` symbol values at once:
one 64-byte row load, then per value a byte compare with the value and an add of 1 under the
compare's mask to a byte accumulator (``<64 x i8>``, kept in a register: 255 rows cannot
overflow it); each block's accumulators are then added to int32 tallies. An alphabet of ``k``
values takes ``ceil(k / VALUES)`` passes over the block (in L1), so the kernels use it only up
to :data:`MAX_VECTOR_ALPHABET` values: for 8-bit symbols the scalar increments stay faster
(183 against 47 us). LLVM lowers the compare and the masked add to ``vpcmpeqb`` / ``vpaddb``
on AVX-512 BW and to narrower vectors elsewhere (correct, slower).
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types, uintp
from numba.core import cgutils
from numba.extending import intrinsic

from .lowlevel import JIT

WIDTH = 64
"""Columns counted by one vector (bytes of a 512-bit register)."""
VALUES = 8
"""Symbol values counted in one pass over a block (one byte accumulator each)."""
BLOCK_ROWS = 255
"""Rows per block: a byte accumulator holds at most 255 increments."""
MAX_VECTOR_ALPHABET = 32
"""Largest alphabet counted with vectors (four passes of :data:`VALUES` over a block); larger
ones take one scalar increment per symbol."""

_I8, _I32, _I64 = ir.IntType(8), ir.IntType(32), ir.IntType(64)
_VB = ir.VectorType(_I8, WIDTH)
_SPLAT = ir.Constant(ir.VectorType(_I32, WIDTH), [0] * WIDTH)  # shuffle mask: lane 0 everywhere


@intrinsic
def _count_block(typingctx, sym, at, stride, rows, v0, acc):
    """Counts of the values ``v0 .. v0 + VALUES - 1`` in columns ``0 .. WIDTH - 1`` of the
    ``rows`` (at most :data:`BLOCK_ROWS`) rows ``sym[at + r stride : at + r stride + WIDTH]``,
    written to uint8 ``acc[j * WIDTH + c]`` (value ``v0 + j``, column ``c``; overwritten)."""
    if not (isinstance(sym, types.Array) and sym.dtype == types.uint8 and sym.layout == "C"
            and isinstance(acc, types.Array) and acc.dtype == types.uint8 and acc.layout == "C"):
        return None
    sig = types.void(sym, at, stride, rows, v0, acc)

    def codegen(context, builder, signature, args):
        sa = signature.args
        base = context.make_array(sa[0])(context, builder, args[0]).data
        out = builder.bitcast(context.make_array(sa[5])(context, builder, args[5]).data, _VB.as_pointer())
        at, stride, rows, v0 = (context.cast(builder, args[i], sa[i], types.int64) for i in (1, 2, 3, 4))
        zero, one = ir.Constant(_VB, [0] * WIDTH), ir.Constant(_VB, [1] * WIDTH)
        accs = [cgutils.alloca_once_value(builder, zero) for _ in range(VALUES)]  # promoted to registers
        first = builder.trunc(v0, _I8)
        values = []
        for j in range(VALUES):
            v = builder.add(first, ir.Constant(_I8, j))
            v = builder.insert_element(ir.Constant(_VB, ir.Undefined), v, ir.Constant(_I32, 0))
            values.append(builder.shuffle_vector(v, ir.Constant(_VB, ir.Undefined), _SPLAT))
        with cgutils.for_range(builder, rows) as loop:
            off = builder.add(at, builder.mul(loop.index, stride))
            row = builder.load(builder.bitcast(builder.gep(base, [off]), _VB.as_pointer()), align=1)
            for j in range(VALUES):  # a masked add: vpcmpeqb into a mask, vpaddb under it
                a = builder.load(accs[j])
                hit = builder.icmp_unsigned("==", row, values[j])
                builder.store(builder.select(hit, builder.add(a, one), a), accs[j])
        for j in range(VALUES):
            builder.store(builder.load(accs[j]), builder.gep(out, [ir.Constant(_I64, j)]), align=1)
        return context.get_dummy_value()

    return sig, codegen


@njit(**JIT)
def column_counts(sym, mod, k):
    """Histogram int64 ``(mod, k)`` of the columns of flat uint8 ``sym`` as an ``(n // mod,
    mod)`` matrix: ``out[c, v]`` is how many rows hold ``v`` in column ``c`` (symbols of ``k``
    or more are not counted). Requires ``mod`` a multiple of :data:`WIDTH`, ``n`` a multiple of
    ``mod`` and ``k <= 256``.

    Reference: ``np.add.at(out, (column, symbol), 1)`` over the symbols below ``k``, as
    :func:`.rans.rans_count_groups` counts with ``div = 1``; 4- and 5-bit symbols take a third
    to a half of its time (see the module doc)."""
    rows = sym.shape[0] // mod
    tally = np.zeros((k, mod), np.int32)  # value-major: the blocks' bytes add in contiguous runs
    acc = np.empty(VALUES * WIDTH, np.uint8)
    for r0 in range(0, rows, BLOCK_ROWS):
        nr = min(BLOCK_ROWS, rows - r0)
        for c0 in range(0, mod, WIDTH):
            for v0 in range(0, k, VALUES):
                _count_block(sym, r0 * mod + c0, mod, nr, v0, acc)
                for j in range(min(VALUES, k - v0)):
                    row = tally[v0 + j]
                    for c in range(uintp(WIDTH)):
                        row[uintp(c0) + c] += acc[uintp(j * WIDTH) + c]
    out = np.empty((mod, k), np.int64)
    for c in range(mod):
        for v in range(k):
            out[c, v] = tally[v, c]
    return out
