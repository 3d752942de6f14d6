"""Interleaved rANS kernels of the ``rans`` codec (:mod:`kvtune.codecs.rans`).

rANS after J. Duda, "Asymmetric numeral systems: entropy coding combining speed of Huffman
coding with compression rate of arithmetic coding" (arXiv 1311.2540, sec. 4) and F. Giesen,
"Interleaved entropy coders" (arXiv 1402.3392): 32-bit states (``L = 2**16 <= x < 2**32``),
32 of them for a run of ``lane_run`` super-symbols or more (:data:`LANE_RUN`, or a choice by
estimated size, :data:`WIDE_BITS`; the caller says which), coded in vectors by
:mod:`.rans_lanes`, else :data:`LANES` (4); 16-bit renormalisation (at most one word per symbol
in either direction, done without a branch), static frequency tables of :data:`PRECISION` bits.
Symbol ``i`` of a run uses lane ``i mod lanes``; the encoder walks the run backwards and pushes words on a stack, so the
decoder reads one forward stream: first the lanes' final states (two words each, high first),
then one word whenever a state drops below ``L``. Every lane starts encoding at ``L``, so a
decoder that ends with a state other than ``L`` has read a corrupt stream.

Models: ``freq`` / ``cum`` tables ``(models, alphabet)``; the symbol at position ``i`` of the
run uses model ``(i // div) % mod`` (per_channel: ``div = 1``, ``mod`` = fused channels; per_head:
``div`` = symbols per (batch, head) block, ``mod`` = heads; one model: ``mod = 1``). ``m``
adjacent input symbols of ``bits`` bits are fused into one coded super-symbol
``s_0 + s_1 2**bits + ...`` (first symbol least significant).

Division: ``x // f`` for ``x < 2**32`` is computed with a float64 reciprocal (float32 division
in the vector loops, :mod:`.rans_lanes`) and corrected by one integer step (the float estimate
is off by at most one), so results are exact integers on every machine. The decoder finds a slot's symbol in one lookup (a ``2**PRECISION``-entry
table per model, see :data:`PRECISION`). Indices are unsigned (``uintp``): numba checks signed indices for
negative wrap-around on every access.

Speed (``benchmarks/rans_kernels.py``, real KIVI symbols of the default model, one thread,
``benchmarks/results/rans_kernels.md``, the 2-core Zen 5): the vector loops take 0.9-1.0 ns per
coded super-symbol to encode and 1.4-1.5 ns to decode (4 scalar lanes: 2.6-2.9 ns), the whole
codec (counts, table choice, tables, checks) 1.8-3.8 ns. The first version took 14-23 ns to
encode and 23-36 ns to decode in its loops alone on an older Xeon (a bucketed symbol search,
branches on renormalisation, signed indices), measured with a one-off script. Symbols are
fused into super-symbols before the encoder loop and split after the decoder loop, in
vectorized passes (:func:`_fuse`, :func:`_unfuse`): a loop over the ``m`` digits per step
cost 3-4 ns per super-symbol more.
The kernels are serial, release the GIL and are cached as the other kernels
(:func:`.cachedir.kernel_cache_dir`); :func:`rans_normalize` and :func:`rans_fused_tables` are the integer
table arithmetic encoder and decoder share. The package re-exports them (its ``__all__``);
``tests/test_kernels.py`` compares them with a pure Python coder.
"""

from __future__ import annotations

import math
import sys

import numpy as np
from numba import njit

from .cachedir import kernel_cache_dir
from .column_counts import MAX_VECTOR_ALPHABET, column_counts
from .column_counts import WIDTH as COLUMN_WIDTH
from .crc import crc32_update
from .lowlevel import JIT
from .rans_lanes import GROUP, MAX_PREC, MIN_PREC, VECTOR_LANES, decode_groups, encode_groups


PRECISION = 13
"""Probability bits ``P``: every model's frequencies sum to ``2**P`` (``L = 2**16`` needs ``P <= 16``).

13 bits keep an 8-bit model's decoder table at 8 KiB, so that the 16-32 per-channel models of
a KIVI tensor fit the L2 cache (measured as fast as 12 bits). The rounding of fused tail
products to ``2**-P`` costs, against the level-coded models' ideal size: 0.47 / 0.17 / 0.06 /
0.03 % at 12 / 13 / 14 / 15 bits on skewed synthetic 2-bit symbols fused by 4, 0.04 % or less
(12 bits) on real KIVI symbols."""
LANES = 4
"""Interleaved states of a run shorter than :data:`LANE_RUN` super-symbols."""
LANE_RUN = 1 << 15
"""Runs of at least this many super-symbols are coded with :data:`.rans_lanes.GROUP` (32)
states, two vectors (:mod:`.rans_lanes`), for 56 more state words than 4 lanes (112 bytes, at
most 0.7 % of a run of 32,768 super-symbols of 4 bits or more)."""
NO_LANE_RUN = 1 << 62
"""A ``lane_run`` that no run reaches: 4 lanes for every run (the codec's kind-4 payloads)."""
WIDE_BITS = 89_600
"""A run whose estimated size (:func:`rans_choose_table`) is at least this many bits is coded
with 32 states in the codec's kind-6 payloads, whatever its length: the 112 bytes of extra
states then cost at most 1 % (8-bit CacheGen anchors: ~20,000 symbols of ~5.5 bits, where
4 lanes ran at ~2.8 ns per symbol)."""
PER_GROUP_DENSITY = 4
"""Per-group table forms of :data:`PER_GROUP_LARGE` entries or more are estimated only for
counts of at least this many symbols per entry (groups x symbols present in the pooled row):
sparser counts pay more for such a table than it saves, and estimating it is the slow part of
choosing. Over the 1,472 per-group-capable runs of eight rANS-coded policies on the default
model's real KV (CacheGen, KIVI-2/4, KVTC-2/3, three PCA + ECSQ budgets), per-group forms won
only from 5.6 symbols per entry on. CacheGen's 8-bit anchors (64 channels x 256 values) have
1.2; estimating their two per-group forms took about 70 of the 114 us of their coding (Zen 4,
one thread)."""
PER_GROUP_LARGE = 4096
"""Per-group tables of fewer entries (groups x alphabet) are always estimated: they are cheap to
estimate, and on few symbols their smaller code can beat the pooled one even when sparse."""
MAX_LANES = GROUP
"""The most states of any run (the scratch words a coder needs beyond one per symbol: 2 each)."""
RANS_L = 1 << 16
"""Lower bound of a normalized state."""
_U1 = np.uint64(1)
_U16 = np.uint64(16)
_LOW16 = np.uint64(0xFFFF)
_UP1 = np.uintp(1)
_MEMO = 4096  # counts below this reuse their grid position within rows of one total
_I32_LIMIT = 1 << 31  # table indices of the vector loops are int32 lanes
_BIG_ENDIAN = sys.byteorder == "big"

with kernel_cache_dir():

    @njit(**JIT)
    def _fix_sum(f, diff):
        """Make ``f`` sum to its target: add a deficit ``diff > 0`` to the largest entry (first
        among equals); take an excess from the largest entries, keeping every entry >= 1."""
        if diff > 0:
            f[np.argmax(f)] += diff
        while diff < 0:
            j = np.argmax(f)
            take = min(-diff, f[j] - 1)
            if take <= 0:
                break
            f[j] -= take
            diff += take

    @njit(**JIT)
    def rans_normalize(w, prec, out):
        """Integer weights ``w`` (int64 ``(K,)``, >= 0, some > 0) -> frequencies ``out`` (int64
        ``(K,)``) summing to exactly ``2**prec``: ``max(1, floor(w 2**prec / sum w))`` for
        ``w > 0``, 0 for ``w == 0``, the rounding difference given to (taken from) the largest.
        Requires ``sum w < 2**(63 - prec)`` and at most ``2**prec`` positive weights."""
        total = np.int64(0)
        for v in w:
            total += v
        got = np.int64(0)
        for i in range(w.shape[0]):
            f = np.int64(0)
            if w[i] > 0:
                f = max(np.int64(1), (w[i] << prec) // total)
            out[i] = f
            got += f
        _fix_sum(out, (np.int64(1) << prec) - got)

    @njit(**JIT)
    def rans_fused_tables(weights, comp, bits, prec):
        """Frequency and cumulative tables of fused models.

        Args:
            weights: int64 ``(G, K)`` integer weights per group (``K = 2**bits``; 0 = absent).
            comp: int64 ``(M, m)``: fused model ``q`` is the product of the distributions of
                groups ``comp[q, 0]`` (least significant digit) ... ``comp[q, m-1]``.
            bits: digit width; ``prec``: probability bits of the result.

        Returns:
            ``(freq, cum)``: int64 ``(M, K**m)`` summing to ``2**prec`` per row, and int64
            ``(M, K**m + 1)`` prefix sums. Each group is first normalized to
            ``2**pc`` (``pc = min(prec, 62 // m)``, :func:`rans_normalize`), the exact integer products
            (summing to ``2**(m pc)``) are rounded to ``prec`` bits (nonzero ones to at least 1)
            and the sum is fixed as in :func:`rans_normalize`.
        """
        g, k = weights.shape
        nm, m = comp.shape
        pc = min(prec, 62 // m)
        comp_f = np.zeros((g, k), np.int64)
        for i in range(g):
            rans_normalize(weights[i], pc, comp_f[i])
        ks = 1 << (bits * m)
        freq = np.empty((nm, ks), np.int64)  # every entry is written below
        cum = np.empty((nm, ks + 1), np.int64)
        sh = m * pc - prec
        half = (np.int64(1) << sh) >> 1
        prod = np.empty(ks, np.int64)
        wide = np.empty(ks, np.int64)
        uk = np.uintp(k)
        for q in range(nm):
            # the products, one digit at a time from the most significant: index hi * k + lo
            # appends digit j below the digits so far (vectorized inner loops)
            prod[:k] = comp_f[comp[q, m - 1]]
            size = np.uintp(k)
            for j in range(m - 2, -1, -1):
                fj = comp_f[comp[q, j]]
                for hi in range(size):
                    a = prod[hi]
                    at = hi * uk
                    for lo in range(uk):
                        wide[at + lo] = a * fj[lo]
                size *= uk
                prod[:size] = wide[:size]
            row = freq[q]
            got = np.int64(0)
            for x in range(np.uintp(ks)):  # branch-free (vectorized): p = 0 rounds to 0 (half < 2**sh)
                p = prod[x]
                v = max(np.int64(p > 0), (p + half) >> sh)
                row[x] = v
                got += v
            _fix_sum(row, (np.int64(1) << prec) - got)
            c = np.int64(0)
            for x in range(ks):
                cum[q, x] = c
                c += row[x]
            cum[q, ks] = c
        return freq, cum

    @njit(**JIT)
    def rans_decoder_tables(freq, cum, prec, slots):
        """Decoder tables of :func:`rans_fused_tables`' output ``(M, ks)``.

        Args:
            slots: output, uint8 (``ks <= 256``) or uint16 ``(M * 2**prec + 4,)``: the symbol of
                every slot of every model, then 4 elements of padding (the vector decoder reads
                32 bits per slot; without the padding :func:`rans_decode` takes the scalar loop).

        Returns:
            uint32 ``(M * ks,)``: ``freq << 16 | cum`` per model and symbol.
        """
        nm, ks = freq.shape
        ns = 1 << prec
        fc = np.empty(nm * ks, np.uint32)
        for q in range(nm):
            for x in range(ks):
                fc[q * ks + x] = (freq[q, x] << 16) | cum[q, x]
                a = q * ns + cum[q, x]
                slots[a : a + freq[q, x]] = x
        return fc

    @njit(inline="always")
    def _zig(r):
        return 2 * r if r >= 0 else -2 * r - 1

    @njit(**JIT)
    def _grid_positions(counts, neg_grid):
        """Grid position of every count's frequency: ``searchsorted(neg_grid, -(c / n))`` for the
        grid of :func:`rans_form_bits`, ``n`` the row's total (0 where ``c == 0``). The level code of every table form follows from it
        (:func:`_levels_of`), so it is searched once per table choice, not once per form."""
        g, k = counts.shape
        size = neg_grid.shape[0]
        pos = np.zeros((g, k), np.int64)
        memo = np.empty(_MEMO, np.int64)  # position of count c for the row total memo_n[c]: rows
        memo_n = np.full(_MEMO, -1, np.int64)  # of one total (per_channel) repeat small counts
        for i in range(g):
            total = counts[i].sum()
            n = np.float64(total)
            for s in range(k):
                c = counts[i, s]
                if c > 0:
                    if c < _MEMO and memo_n[c] == total:
                        pos[i, s] = memo[c]
                        continue
                    v = -(c / n)
                    # entry j is -2**(-(j + 1)/16): about floor(-16 log2 p) entries lie below -p;
                    # then the exact comparisons of a binary search, from that guess
                    at = min(max(np.int64(-16.0 * math.log2(-v)), np.int64(0)), size)
                    while at > 0 and not neg_grid[at - 1] < v:
                        at -= 1
                    while at < size and neg_grid[at] < v:
                        at += 1
                    pos[i, s] = at
                    if c < _MEMO:
                        memo[c] = at
                        memo_n[c] = total
        return pos

    @njit(inline="always")
    def _log2(v):
        """``log2`` of a power of two ``v >= 1``, as int64."""
        sh = np.int64(0)
        while (np.int64(1) << sh) < v:
            sh += 1
        return sh

    @njit(**JIT)
    def _levels_of(row, pos, h, max_level, out):
        """Level codes of one count row from its grid positions (``count_levels`` of
        :mod:`kvtune.codecs.range_coder`, ``h = 8 // steps``, a power of two: ``(pos + h) //
        (2 h)`` is a shift)."""
        sh = _log2(2 * h)
        for s in range(row.shape[0]):
            out[s] = 0
            if row[s] > 0:
                out[s] = min((pos[s] + h) >> sh, max_level - 1) + 1

    @njit(**JIT)
    def _halvings(n):
        """float64 ``2**-e`` for ``e = 0..n-1`` (exact: halving a normal float64)."""
        out = np.empty(n, np.float64)
        v = 1.0
        for e in range(n):
            out[e] = v
            v *= 0.5
        return out

    @njit(**JIT)
    def _row_cost(row, lev, grid16, steps, p2):
        """Bits of the symbols of ``row`` under level codes ``lev``: ``sum c (q - 1) / steps +
        n log2(sum of the weights 2**(-(q - 1) / steps))``; ``p2``: :func:`_halvings`, enough
        for ``(q - 1) 16 / steps / 16``."""
        shift = 16 // steps
        num = np.int64(0)
        n = np.int64(0)
        w = 0.0
        for s in range(row.shape[0]):
            if lev[s] > 0:
                u = (lev[s] - 1) * shift
                w += grid16[u & 15] * p2[u >> 4]
                num += row[s] * (lev[s] - 1)
                n += row[s]
        return num / steps + (n * np.log2(w) if n else 0.0)

    @njit(**JIT)
    def _form_bits(counts, pos, pc, pool_pos, grid16, steps, pooled, max_level, p2, hist, pool):
        """:func:`rans_form_bits` from the grid positions of ``counts`` (``pos``) and of their
        pooled row ``pc`` (``pool_pos``), with scratch: ``p2`` (:func:`_halvings`, at least
        ``max_level`` entries), ``hist`` (int64 ``2 max_level + 2`` zeros, left zero) and
        ``pool`` (int64 ``(K,)``). A group's level codes, their cost (:func:`_row_cost`'s sums
        in its order) and their residuals come from one pass over its row, the common zero
        residual counted in a register (a ``(64, 16)`` count table: 4.7 -> about 2.5 us per
        per-group form, one-off script)."""
        g, k = counts.shape
        h = 8 // steps
        sh = _log2(2 * h)
        shift = 16 // steps
        _levels_of(pc, pool_pos, h, max_level, pool)
        top = np.int64(0)
        prev = np.int64(0)
        for s in range(k):
            z = _zig(pool[s] - prev)
            hist[z] += 1
            top = max(top, z)
            prev = pool[s]
        if pooled:
            bits = _row_cost(pc, pool, grid16, steps, p2)
        else:
            bits = 0.0
            zeros = np.int64(0)
            for i in range(g):
                row, prow = counts[i], pos[i]
                num = np.int64(0)
                n = np.int64(0)
                w = 0.0
                for s in range(k):
                    q = np.int64(0)
                    c = row[s]
                    if c > 0:  # _levels_of and _row_cost of this entry
                        q = min((prow[s] + h) >> sh, max_level - 1) + 1
                        u = (q - 1) * shift
                        w += grid16[u & 15] * p2[u >> 4]
                        num += c * (q - 1)
                        n += c
                    if pool[s] > 0:
                        z = _zig(q - pool[s])
                        if z == 0:
                            zeros += 1
                        else:
                            hist[z] += 1
                            top = max(top, z)
                bits += num / steps + (n * np.log2(w) if n else 0.0)
            hist[0] += zeros
        total = np.int64(0)
        for j in range(top + 1):
            total += hist[j]
        size = 0
        for j in range(top + 1):
            if hist[j] > 0:
                bits += hist[j] * np.log2(total / hist[j])
                size = j + 1
            hist[j] = 0
        return bits + 32 * size

    @njit(**JIT)
    def _form_scratch(max_level, k):
        """``(p2, hist, pool)`` of :func:`_form_bits` (steps >= 1)."""
        return _halvings(max_level + 1), np.zeros(2 * max_level + 2, np.int64), np.empty(k, np.int64)

    @njit(**JIT)
    def rans_form_bits(counts, neg_grid, grid16, steps, pooled, max_level):
        """Estimated bits of ``counts`` (int64 ``(G, K)``, every row with a symbol) coded with
        one table form of the ``rans`` codec: level codes with ``steps`` levels per octave,
        per group or pooled (one row), the payload at its ideal cost plus the table (order-0
        entropy of the zigzagged residuals and 32 bits per histogram entry).

        Args:
            neg_grid: float64 ``-2**(-u/16)``, ``u = 1, 2, ...`` (increasing); ``grid16``:
                float64 ``2**(-j/16)``, ``j = 0..15``; ``max_level``: the largest level code.
        """
        pc = counts.sum(axis=0).reshape(1, -1)
        p2, hist, pool = _form_scratch(max_level, counts.shape[1])
        return _form_bits(counts, _grid_positions(counts, neg_grid), pc[0], _grid_positions(pc, neg_grid)[0],
                          grid16, steps, pooled, max_level, p2, hist, pool)

    @njit(**JIT)
    def rans_choose_table(counts, neg_grid, grid16, form_steps, form_pooled, max_level):
        """The table form of the fewest estimated bits (:func:`rans_form_bits`; first of equals)
        and its level codes and residuals. Per-group forms are candidates when there are
        several groups, and for a table of :data:`PER_GROUP_LARGE` entries or more only with at
        least :data:`PER_GROUP_DENSITY` symbols per entry (groups x symbols present in the
        pooled row).

        Args:
            counts: int64 ``(G, K)``, every row with a symbol.
            form_steps, form_pooled: int64 ``(F,)``: the candidate forms' levels per octave and
                whether they are pooled.

        Returns:
            ``(form, levels, residuals, bits)``: the form's index; int64 level codes ``(G, K)``
            (``(1, K)`` pooled) as :func:`kvtune.codecs.range_coder.count_levels` gives them; int64
            residuals in coding order: the zigzagged differences of the pooled row's codes to
            their left neighbour, then (per-group) every group's codes of the pooled row's present
            symbols as zigzagged differences to the pooled code; the form's estimated size
            in bits (float64).
        """
        g, k = counts.shape
        pcs = counts.sum(axis=0).reshape(1, -1)
        pc = pcs[0]
        present = 0
        for s in range(k):
            present += pc[s] > 0
        per_group = g > 1 and (g * k < PER_GROUP_LARGE or pc.sum() >= PER_GROUP_DENSITY * g * present)
        pos = _grid_positions(counts, neg_grid) if per_group else np.empty((0, k), np.int64)  # unread: pooled only
        pool_pos = _grid_positions(pcs, neg_grid)[0]
        best, best_bits = -1, np.inf
        p2, hist, scratch = _form_scratch(max_level, k)
        for f in range(form_steps.shape[0]):
            if not per_group and not form_pooled[f]:
                continue
            bits = _form_bits(counts, pos, pc, pool_pos, grid16, form_steps[f], form_pooled[f] != 0, max_level, p2, hist,
                              scratch)
            if bits < best_bits:
                best, best_bits = f, bits
        h = 8 // form_steps[best]
        pool = np.empty(k, np.int64)
        _levels_of(pc, pool_pos, h, max_level, pool)
        pooled = form_pooled[best] != 0
        levels = np.empty((1 if pooled else g, k), np.int64)
        res = np.empty(k + (0 if pooled else g * present), np.int64)
        prev = np.int64(0)
        for s in range(k):
            res[s] = _zig(pool[s] - prev)
            prev = pool[s]
        if pooled:
            levels[0] = pool
            return best, levels, res, best_bits
        j = k
        for i in range(g):
            _levels_of(counts[i], pos[i], h, max_level, levels[i])
            for s in range(k):
                if pool[s] > 0:
                    res[j] = _zig(levels[i, s] - pool[s])
                    j += 1
        return best, levels, res, best_bits

    @njit(**JIT)
    def rans_count_groups(sym, div, mod, groups, k):
        """Histogram int64 ``(groups, k)`` of flat ``sym``: symbol ``i`` belongs to group
        ``(i // div) % mod`` (``groups == mod``)."""
        n = sym.shape[0]
        if div == 1:  # per_channel / global: group = column of an (n // mod, mod) matrix
            # int32 counters on uintp indices: the 32 x 256 counts of fused 4-bit symbols fit in
            # 32 KB of L1 (one tensor of CacheGen's deltas, 88,416 super-symbols: 37-42 -> 30 us
            # with the conversion, medians of 301, one-off script; 5- and 8-bit symbols: same)
            c32 = np.zeros(groups * k, np.int32)
            um, uk = np.uintp(mod), np.uintp(k)
            for r in range(np.uintp(n) // um):
                o = r * um
                for c in range(um):
                    c32[c * uk + np.uintp(sym[o + c])] += 1
            return c32.astype(np.int64).reshape((groups, k))
        out = np.zeros((groups, k), np.int64)
        blocks = n // div
        part = np.zeros((4, k), np.int64)  # four sub-histograms: no store-to-load chain on one counter
        for b in range(blocks):
            part[:] = 0
            o = b * div
            j = 0
            while j + 4 <= div:
                part[0, sym[o + j]] += 1
                part[1, sym[o + j + 1]] += 1
                part[2, sym[o + j + 2]] += 1
                part[3, sym[o + j + 3]] += 1
                j += 4
            while j < div:
                part[0, sym[o + j]] += 1
                j += 1
            q = b % mod
            for v in range(k):
                out[q, v] += part[0, v] + part[1, v] + part[2, v] + part[3, v]
        return out

    @njit(inline="always")
    def _columns_in_vectors(n, bits, div, mod):
        """Whether :func:`.column_counts.column_counts` counts ``n`` symbols of ``bits`` bits
        grouped by ``(div, mod)``: per channel (``div == 1``) on whole rows of a multiple of
        64 channels, alphabets of at most 32 values. Per 4-bit CacheGen delta tensor (176,832
        symbols, 64 channels) 10.5 us, against 34.5 us for the counts of the fused super-symbols
        split into digits; 5-bit: 20 against 42 us (one thread, Zen 5, one-off script)."""
        return (div == 1 and mod % COLUMN_WIDTH == 0 and mod > 0 and n % mod == 0
                and (1 << bits) <= MAX_VECTOR_ALPHABET)

    @njit(**JIT)
    def _digit_counts(fused, comp, bits, groups):
        """Group counts int64 ``(groups, 2**bits)`` from counts of super-symbols per fused model
        (int64 ``(M, 2**(bits m))``): digit ``j`` of model ``q``'s super-symbols is a symbol of
        group ``comp[q, j]`` (:func:`rans_fused_tables`)."""
        nm, ks = fused.shape
        m = comp.shape[1]
        mask = (1 << bits) - 1
        out = np.zeros((groups, 1 << bits), np.int64)
        for q in range(nm):
            row = fused[q]
            for x in range(ks):  # one pass over the super-symbols: each adds to its m digits
                # (32 models x 256 fused 4-bit symbols: 11.5 -> 5.9 us against sums per digit)
                v = row[x]
                if v:
                    for j in range(m):
                        out[comp[q, j], (x >> (bits * j)) & mask] += v
        return out

    @njit(**JIT)
    def _fuse(sym, bits, m, out):
        """Super-symbols ``out[i] = sym[i m] + sym[i m + 1] 2**bits + ...``.

        ``m`` = 2 (3- and 4-bit symbols) and 4 (2-bit) are written out with loop-invariant shifts,
        which LLVM vectorizes: 4.5x faster than the loop over ``j`` on real 2-bit symbols,
        measured with a one-off script (48 vs 214 us per 196,608 symbols). Other fusions (1-bit
        symbols, shorter runs) take that loop.
        """
        n = np.uintp(out.shape[0])
        b = np.uint16(bits)
        if m == 1:
            for i in range(n):
                out[i] = sym[i]
        elif m == 2:
            for i in range(n):
                k = i * np.uintp(2)
                out[i] = np.uint16(sym[k]) | (np.uint16(sym[k + _UP1]) << b)
        elif m == 4:
            for i in range(n):
                k = i * np.uintp(4)
                out[i] = (np.uint16(sym[k]) | (np.uint16(sym[k + _UP1]) << b)
                          | (np.uint16(sym[k + np.uintp(2)]) << (b + b)) | (np.uint16(sym[k + np.uintp(3)]) << (b + b + b)))
        else:
            um = np.uintp(m)
            for i in range(n):
                k = i * um
                s = np.uint16(0)
                for j in range(um):
                    s |= np.uint16(sym[k + j]) << np.uint16(bits * j)
                out[i] = s

    @njit(**JIT)
    def _unfuse(fz, bits, m, out):
        """Inverse of :func:`_fuse`: ``out[i m + j] = (fz[i] >> (bits j)) & (2**bits - 1)``."""
        n = np.uintp(fz.shape[0])
        b = np.uint16(bits)
        mask = np.uint16((1 << bits) - 1)
        if m == 2:
            for i in range(n):
                k = i * np.uintp(2)
                v = np.uint16(fz[i])
                out[k] = v & mask
                out[k + _UP1] = (v >> b) & mask
        elif m == 4:
            for i in range(n):
                k = i * np.uintp(4)
                v = np.uint16(fz[i])
                out[k] = v & mask
                out[k + _UP1] = (v >> b) & mask
                out[k + np.uintp(2)] = (v >> (b + b)) & mask
                out[k + np.uintp(3)] = (v >> (b + b + b)) & mask
        else:
            um = np.uintp(m)
            for i in range(n):
                k = i * um
                v = np.uint16(fz[i])
                for j in range(um):
                    out[k + j] = (v >> np.uint16(bits * j)) & mask

    @njit(inline="always")
    def _enc1(x, f, c, inv, xmax, prec):
        """One encoder step on scalars: ``(new state, the low word, 1 if that word is emitted)``."""
        big = np.uint64(x >= xmax)
        word = x & _LOW16
        x >>= big << np.uint64(4)
        xi = np.int64(x)
        fi = np.int64(f)
        d = np.int64(np.float64(xi) * inv)
        r = xi - d * fi
        if r < 0:
            d -= 1
            r += fi
        elif r >= fi:
            d += 1
            r -= fi
        return (np.uint64(d) << prec) + np.uint64(r) + c, word, big

    @njit(inline="always")
    def _prev_model(q, c, div, mod):
        if c == 0:
            return (q - _U1 if q > 0 else mod - _U1), div - _U1
        return q, c - _U1

    @njit(**JIT)
    def rans_encode(sym, bits, m, div, mod, freq, cum, prec, out, lane_run=LANE_RUN):
        """rANS-encode flat ``sym`` (``n * m`` symbols, fused ``m`` at a time) into ``out``.

        Args:
            sym: uint8 or uint16 symbols; ``bits``/``m``: fusion (``m = 1``: none).
            div, mod: model of super-symbol ``i`` is ``(i // div) % mod`` (see the module doc).
            freq, cum: tables of :func:`rans_fused_tables`; every coded super-symbol must have
                ``freq > 0`` (the caller builds the tables from the symbols' own counts).
            prec: probability bits of the tables (at most :data:`.rans_lanes.MAX_PREC`: a
                frequency fills 16 bits of a table entry).
            out: uint16 scratch of at least ``n + 2 * MAX_LANES`` words.
            lane_run: the run takes 32 lanes if it has at least this many super-symbols, else 4
                (:func:`_lanes_of`; :data:`LANE_RUN` in kind-5 payloads, :data:`NO_LANE_RUN`
                in kind-4 ones, 0: 32 lanes always).

        Returns:
            ``start``: the coded words are ``out[start:]`` (lane states first).

        Raises:
            ValueError: ``out`` is shorter than ``n`` plus 2 words per lane, or ``prec > 15``.
        """
        n = sym.shape[0] // m
        if out.shape[0] < n + 2 * _lanes_of(n, lane_run):
            raise ValueError("rans_encode: out has fewer than n + 2 * lanes words")
        if prec > MAX_PREC:
            raise ValueError("rans_encode: prec above 15 (a frequency fills 16 bits of a table entry)")
        if m == 1:
            return _encode_loop(sym, div, mod, freq, cum, prec, out, lane_run)
        fz = np.empty(n, np.uint16)
        _fuse(sym, bits, m, fz)
        return _encode_loop(fz, div, mod, freq, cum, prec, out, lane_run)

    @njit(inline="always")
    def _lanes_of(n, lane_run):
        """Interleaved states of a run of ``n`` super-symbols: 32 from ``lane_run`` on, else 4."""
        return GROUP if n >= lane_run else LANES

    @njit(**JIT)
    def _vector_plan(g, div, mod, ks, prec):
        """``(qc, params)`` of :func:`.rans_lanes.encode_groups` / ``decode_groups`` for group ``g``."""
        qc = np.empty(2 * GROUP, np.int32)
        for lane in range(GROUP):
            i = GROUP * g + lane
            at = 2 * VECTOR_LANES * (lane // VECTOR_LANES) + lane % VECTOR_LANES
            qc[at] = (i // div) % mod
            qc[at + VECTOR_LANES] = i % div
        params = np.array([(GROUP // div) % mod, GROUP % div, div, mod, ks, prec], np.int64)
        return qc, params

    @njit(**JIT)
    def _encode_loop(fz, div, mod, freq, cum, prec, out, lane_run):
        """The coder loop of :func:`rans_encode` on the super-symbols ``fz``."""
        nm, ks = freq.shape
        n = fz.shape[0]
        lanes = _lanes_of(n, lane_run)
        ulanes = np.uint64(lanes)
        fc = np.empty(nm * ks, np.uint32)  # freq << 16 | cum: one table for the vector and the scalar steps
        for q in range(nm):
            for x in range(ks):
                fc[q * ks + x] = (freq[q, x] << 16) | cum[q, x]
        up, uks, udiv, umod = np.uint64(prec), np.uint64(ks), np.uint64(div), np.uint64(mod)
        xs = np.uint64(32 - prec)
        pos = np.uint64(out.shape[0])
        st = np.full(lanes, RANS_L, np.uint64)
        q = np.uint64(((n - 1) // div) % mod if n else 0)
        c = np.uint64((n - 1) % div if n else 0)
        i = np.uint64(n)
        # the vector loop indexes the table with int32 lanes
        vector = lanes == GROUP and MIN_PREC <= prec <= MAX_PREC and nm * ks < _I32_LIMIT
        while i and (i % ulanes or not vector):  # the last partial group (every group without vectors)
            i -= _U1
            e = np.uint64(fc[q * uks + np.uint64(fz[i])])
            f = e >> _U16
            lane = i % ulanes
            st[lane], w, b = _enc1(st[lane], f, e & _LOW16, 1.0 / np.float64(f), f << xs, up)
            out[pos - _U1] = w  # written always, kept when b: no branch on renormalisation
            pos -= b
            q, c = _prev_model(q, c, udiv, umod)
        if i:  # whole groups, backwards, in vectors
            g = np.int64(i) // GROUP
            qc, params = _vector_plan(g - 1, div, mod, ks, prec)
            st32 = st.astype(np.uint32)
            pos = np.uint64(encode_groups(fz, g, st32, qc, params, fc, out, np.int64(pos)))
            st[:] = st32
        for lane in range(lanes - 1, -1, -1):
            pos -= np.uint64(2)
            out[pos] = st[lane] >> _U16
            out[pos + _U1] = st[lane] & _LOW16
        return np.int64(pos)

    @njit(inline="always")
    def _dec1(x, fc, fb, slots, sb, pmask, prec, words, pos, last):
        """One decoder step: ``(new state, symbol, words read so far)``; reads are clamped to
        the last word (the caller checks ``pos`` at the end), renormalisation has no branch."""
        slot = x & pmask
        s = np.uint64(slots[sb + slot])
        e = np.uint64(fc[fb + s])
        x = (e >> _U16) * (x >> prec) + slot - (e & _LOW16)
        small = np.uint64(x < np.uint64(RANS_L))
        w = np.uint64(words[min(pos, last)])
        x = (x << (small << np.uint64(4))) | (w & (np.uint64(0) - small))
        return x, s, pos + small

    @njit(inline="always")
    def _next_model(q, c, div, mod):
        c += 1
        if c == div:
            q += 1
            return (0 if q == mod else q), 0
        return q, c

    @njit(**JIT)
    def _decode_loop(words, div, mod, fc, slots, prec, out, lane_run):
        """The coder loop of :func:`rans_decode`: super-symbol ``i`` into ``out[i]``."""
        nw = words.shape[0]
        n = out.shape[0]
        lanes = _lanes_of(n, lane_run)
        if nw < 2 * lanes:
            return -1
        st = np.empty(lanes, np.uint64)
        for lane in range(lanes):
            st[lane] = (np.uint64(words[2 * lane]) << _U16) | np.uint64(words[2 * lane + 1])
            if st[lane] < RANS_L:
                return -1
        pos = np.uint64(2 * lanes)
        last = np.uint64(nw - 1)
        uks = np.uint64(fc.shape[0] // mod)
        ns = _U1 << np.uint64(prec)
        pmask = ns - _U1
        up = np.uint64(prec)
        ulanes = np.uint64(lanes)
        i = np.uint64(0)
        padded = slots.shape[0] >= (mod << prec) + 4  # the vector loop's 32-bit slot reads stay inside
        small = (mod << prec) + 4 < _I32_LIMIT // 2  # and its int32 lane indices (2-byte slots: x2) do not wrap
        if lanes == GROUP and MIN_PREC <= prec <= MAX_PREC and n >= GROUP and padded and small:
            qc, params = _vector_plan(0, div, mod, fc.shape[0] // mod, prec)
            io = np.array([2 * lanes, nw], np.int64)
            st32 = st.astype(np.uint32)
            done = decode_groups(words, io, st32, qc, params, fc, slots, out, 0, n // GROUP)
            st[:] = st32
            pos = np.uint64(io[0])
            i = np.uint64(done * GROUP)
        q = np.int64((i // np.uint64(div)) % np.uint64(mod))
        c = np.int64(i % np.uint64(div))
        un = np.uint64(n)
        while i < un:  # after the vectors (or without them): one symbol at a time
            uq = np.uint64(q)
            lane = i % ulanes
            st[lane], s, pos = _dec1(st[lane], fc, uq * uks, slots, uq * ns, pmask, up, words, pos, last)
            out[i] = s
            q, c = _next_model(q, c, div, mod)
            i += _U1
        if pos > np.uint64(nw):
            return -1
        for lane in range(lanes):
            if st[lane] != RANS_L:
                return -1
        return np.int64(pos)

    @njit(**JIT)
    def rans_decode(words, bits, m, div, mod, fc, slots, prec, out, lane_run=LANE_RUN):
        """Inverse of :func:`rans_encode`: fill ``out`` (``n * m`` symbols) from uint16 ``words``;
        ``fc``/``slots``: :func:`rans_decoder_tables`; ``lane_run``: as :func:`rans_encode`.

        The coder loop stores one super-symbol per step and :func:`_unfuse` splits them after it
        (vectorized), rather than ``m`` shifted stores inside the loop.

        Returns:
            Words consumed (``>= 0``), or ``-1`` when the words run out, a state read is not
            normalized, or a lane does not end at ``RANS_L`` (corrupt data); ``out`` is then
            garbage and must be discarded.
        """
        if m == 1:
            return _decode_loop(words, div, mod, fc, slots, prec, out, lane_run)
        fz = np.empty(out.shape[0] // m, np.uint16)
        used = _decode_loop(words, div, mod, fc, slots, prec, fz, lane_run)
        if used >= 0:
            _unfuse(fz, bits, m, out)
        return used

    @njit(**JIT)
    def _bit_length(v):
        n = 0
        while v:
            v >>= 1
            n += 1
        return n

    @njit(**JIT)
    def _residual_model(hist, prec):
        """``(bits, freq, cum)`` of the one-model table over the residual alphabet (``hist``
        padded to ``2**bits`` entries)."""
        tbits = max(1, _bit_length(hist.shape[0] - 1))
        w = np.zeros((1, 1 << tbits), np.int64)
        w[0, : hist.shape[0]] = hist
        freq, cum = rans_fused_tables(w, np.zeros((1, 1), np.int64), tbits, prec)
        return tbits, freq, cum

    @njit(**JIT)
    def rans_level_weights(levels, steps, grid16, weight_bits):
        """Integer weights int64 of level codes (``levels`` int64 ``(G, K)``): 0 -> 0, ``q >= 1``
        -> ``max(1, floor(2**weight_bits * 2**(-(q - 1)/steps)))``, computed exactly from the
        1/16-octave grid ``grid16`` (float64 ``2**(-j/16)``, ``j = 0..15``) by power-of-two
        scaling (:func:`kvtune.codecs.rans.level_to_weights` in numpy)."""
        g, k = levels.shape
        top = np.int64(0)
        for i in range(g):
            for s in range(k):
                top = max(top, levels[i, s])
        of_level = np.zeros(top + 1, np.int64)  # the weight of each level code present, once
        shift = 16 // steps
        for q in range(1, top + 1):
            u = (q - 1) * shift
            of_level[q] = max(np.int64(1), np.int64(math.floor(math.ldexp(grid16[u & 15], weight_bits - (u >> 4)))))
        out = np.empty((g, k), np.int64)
        for i in range(g):
            for s in range(k):
                out[i, s] = of_level[levels[i, s]]
        return out

    @njit(**JIT)
    def rans_encode_symbols(flat, bits, m, count_div, count_mod, groups, coder, comp_group, comp_pooled,
                            neg_grid, grid16, form_steps, form_pooled, max_level, weight_bits, prec,
                            table_lane_run=LANE_RUN, lane_run=LANE_RUN):
        """The whole rANS coding of one tensor's symbols, in one call without the GIL: the
        super-symbols (:func:`_fuse`), group counts (per channel in byte vectors,
        :func:`.column_counts.column_counts`, where :func:`_columns_in_vectors`; else
        :func:`rans_count_groups` of the super-symbols, split into digits by
        :func:`_digit_counts`, or of the symbols when ``m = 1``),
        the table form (:func:`rans_choose_table`), the residuals' histogram and words, and the
        super-symbols' words.

        Args:
            flat: uint8 symbols ``< 2**bits``; ``m``: fusion.
            count_div, count_mod, groups: the symbols' groups (:func:`rans_count_groups`).
            coder: int64 ``(4,)``: ``(div, mod)`` of the super-symbols' models per group, then
                pooled; ``comp_group`` / ``comp_pooled``: their ``comp`` (:func:`rans_fused_tables`).
            neg_grid, grid16, form_steps, form_pooled, max_level: as :func:`rans_choose_table`.
            weight_bits: integer weight of level code 1 is ``2**weight_bits``.
            table_lane_run, lane_run: as :func:`rans_encode`, of the table residuals' run and of
                the symbols' run; ``lane_run < 0``: 32 lanes for the symbols from
                :data:`LANE_RUN` super-symbols on or when the chosen form's estimated size is
                at least :data:`WIDE_BITS` (kind-6 payloads).

        Returns:
            ``(form, hist, table words, words, wide)``: int64 histogram of the residuals, uint16
            words, whether the symbols' run took 32 lanes.
        """
        fz = np.empty(flat.shape[0] // m if m > 1 else 0, np.uint16)
        if m > 1:
            _fuse(flat, bits, m, fz)
        if _columns_in_vectors(flat.shape[0], bits, count_div, count_mod):
            counts = column_counts(flat, count_mod, 1 << bits)
        elif m == 1:
            counts = rans_count_groups(flat, count_div, count_mod, groups, 1 << bits)
        else:  # half or a quarter of the increments: count super-symbols, then split their digits
            fused = rans_count_groups(fz, coder[0], coder[1], coder[1], 1 << (bits * m))
            counts = _digit_counts(fused, comp_group, bits, groups)
        form, levels, res, est = rans_choose_table(counts, neg_grid, grid16, form_steps, form_pooled, max_level)
        if lane_run < 0:
            lane_run = 0 if est >= WIDE_BITS else LANE_RUN
        nh = 0
        for r in res:
            nh = max(nh, r + 1)
        hist = np.zeros(nh, np.int64)
        for r in res:
            hist[r] += 1
        tbits, tfreq, tcum = _residual_model(hist, prec)
        tout = np.empty(res.shape[0] + 2 * MAX_LANES, np.uint16)
        tstart = rans_encode(res, tbits, 1, 1, 1, tfreq, tcum, prec, tout, table_lane_run)
        pooled = form_pooled[form] != 0
        weights = rans_level_weights(levels, form_steps[form], grid16, weight_bits)
        comp = comp_pooled if pooled else comp_group
        div = coder[2] if pooled else coder[0]
        mod = coder[3] if pooled else coder[1]
        freq, cum = rans_fused_tables(weights, comp, bits, prec)
        out = np.empty(flat.shape[0] // m + 2 * MAX_LANES, np.uint16)
        n = flat.shape[0] // m
        if m == 1:
            start = _encode_loop(flat, div, mod, freq, cum, prec, out, lane_run)
        else:
            start = _encode_loop(fz, div, mod, freq, cum, prec, out, lane_run)
        return form, hist, tout[tstart:], out[start:], _lanes_of(n, lane_run) == GROUP

    @njit(**JIT)
    def _unrans_into(words, bits, m, div, mod, freq, cum, prec, out, lane_run):
        """Decode into ``out``: words consumed, or -1 (see :func:`rans_decode`)."""
        nm, ks = freq.shape
        if ks <= 256:
            slots8 = np.zeros((nm << prec) + 4, np.uint8)  # padded: the vector loop reads 32 bits per slot
            fc = rans_decoder_tables(freq, cum, prec, slots8)
            return rans_decode(words, bits, m, div, mod, fc, slots8, prec, out, lane_run)
        slots16 = np.zeros((nm << prec) + 4, np.uint16)
        fc = rans_decoder_tables(freq, cum, prec, slots16)
        return rans_decode(words, bits, m, div, mod, fc, slots16, prec, out, lane_run)

    DECODE_ERRORS = (
        "",
        "the table words do not decode (the words run out, or a state is off at the end)",
        "words follow the table words",
        "the decoded table does not match its histogram",
        "a pooled table code is out of range",
        "the table histogram does not count the pooled row's entries",
        "the table histogram does not count the table's entries",
        "a table code is out of range or a group has no symbol",
        "the coder words do not decode (the words run out, or a state is off at the end)",
        "words follow the coder words and are not zero padding",
        "coder words checksum mismatch (altered or truncated words)",
    )
    """Messages of the status codes of :func:`rans_decode_symbols` and
    :func:`rans_decode_payload` (0 = no error)."""

    @njit(**JIT)
    def rans_decode_symbols(hist, twords, words, bits, m, groups, steps, pooled, coder, comp_group, comp_pooled,
                            grid16, max_level, weight_bits, prec, out, table_lane_run=LANE_RUN, lane_run=LANE_RUN):
        """Inverse of :func:`rans_encode_symbols` after the caller has read and checked the
        header (its checksum, and the histogram's total between ``2**bits`` and
        ``2**bits * (groups + 1)``, which bounds what this allocates): the level codes from the
        table words, every check of the table, the fused models and the symbols, in one call
        without the GIL.

        Args:
            hist: int64 residual histogram; ``twords`` / ``words``: uint16 table and coder words.
            groups: groups of the layout; ``steps``: levels per octave; ``pooled``: the form.
            out: uint8 ``(count,)``, filled with the symbols.
            table_lane_run, lane_run: as :func:`rans_encode`, of the table residuals' run and of
                the symbols' run (0 / :data:`NO_LANE_RUN` for a kind-6 payload's flag).

        Returns:
            0, or the index of the failed check in :data:`DECODE_ERRORS` (``out`` is then garbage).
        """
        k = 1 << bits
        total = 0
        for v in hist:
            total += v
        tbits, tfreq, tcum = _residual_model(hist, prec)
        z = np.empty(total, np.uint16)
        used = _unrans_into(twords, tbits, 1, 1, 1, tfreq, tcum, prec, z, table_lane_run)
        if used < 0:
            return 1
        if used != twords.shape[0]:
            return 2
        seen = np.zeros(hist.shape[0], np.int64)
        for v in z:
            if v >= hist.shape[0]:
                return 3
            seen[v] += 1
        for j in range(hist.shape[0]):
            if seen[j] != hist[j]:
                return 3
        pool = np.empty(k, np.int64)
        acc = np.int64(0)
        present = 0
        for s in range(k):
            zz = np.int64(z[s])
            acc += -(zz >> 1) - 1 if zz & 1 else zz >> 1
            if acc < 0 or acc > max_level:
                return 4
            pool[s] = acc
            present += acc > 0
        if present == 0:
            return 4
        if pooled:
            if total != k:
                return 5
            levels = np.empty((1, k), np.int64)
            levels[0] = pool
        else:
            if total != k + groups * present:
                return 6
            levels = np.zeros((groups, k), np.int64)
            j = k
            for i in range(groups):
                any_symbol = False
                for s in range(k):
                    if pool[s] > 0:
                        zz = np.int64(z[j])
                        j += 1
                        q = pool[s] + (-(zz >> 1) - 1 if zz & 1 else zz >> 1)
                        if q < 0 or q > max_level:
                            return 7
                        levels[i, s] = q
                        any_symbol = any_symbol or q > 0
                if not any_symbol:
                    return 7
        weights = rans_level_weights(levels, steps, grid16, weight_bits)
        comp = comp_pooled if pooled else comp_group
        div = coder[2] if pooled else coder[0]
        mod = coder[3] if pooled else coder[1]
        freq, cum = rans_fused_tables(weights, comp, bits, prec)
        used = _unrans_into(words, bits, m, div, mod, freq, cum, prec, out, lane_run)
        if used < 0:
            return 8
        for j in range(used, words.shape[0]):
            if words[j] != 0:
                return 9
        return 0

    @njit(**JIT)
    def _le_words(payload, at, n):
        """``n`` little-endian uint16 words of uint8 ``payload`` from byte ``at`` (any alignment):
        a byte loop on ``uintp`` indices, which LLVM vectorizes (88,416 words: 4 us, against
        55 us for a slice assignment and 107 us for words assembled from their bytes, one-off
        script), swapped on a big-endian host."""
        out = np.empty(n, np.uint16)
        dst = out.view(np.uint8)
        a = np.uintp(at)
        for i in range(np.uintp(2 * n)):
            dst[i] = payload[a + i]
        return _swapped(out) if _BIG_ENDIAN else out

    @njit(**JIT)
    def _swapped(words):
        """A copy of uint16 ``words`` with their two bytes swapped (little-endian <-> big-endian)."""
        out = np.empty_like(words)
        for i in range(words.shape[0]):
            out[i] = (words[i] >> np.uint16(8)) | (words[i] << np.uint16(8))
        return out

    @njit(**JIT)
    def rans_decode_payload(payload, tw_at, nt, w_at, nw, words_crc, hist, bits, m, groups, steps, pooled, coder,
                            comp_group, comp_pooled, grid16, max_level, weight_bits, prec, out,
                            table_lane_run=LANE_RUN, lane_run=LANE_RUN):
        """:func:`rans_decode_symbols` on the words of a payload as it lies in the stream: the
        ``nt`` table words at byte ``tw_at`` and the ``nw`` coder words at byte ``w_at`` of uint8
        ``payload`` (little-endian, any alignment; the caller has checked that they lie inside
        it), copied into aligned arrays here, without the GIL; the coder words' CRC32 is checked
        against ``words_crc`` first unless it is negative (kind 4 has none).

        Returns:
            0, or the index of the failed check in :data:`DECODE_ERRORS`.
        """
        if words_crc >= 0 and crc32_update(0, payload[w_at : w_at + 2 * nw]) != words_crc:
            return 10
        return rans_decode_symbols(hist, _le_words(payload, tw_at, nt), _le_words(payload, w_at, nw), bits, m, groups,
                                   steps, pooled, coder, comp_group, comp_pooled, grid16, max_level, weight_bits,
                                   prec, out, table_lane_run, lane_run)

    @njit(**JIT)
    def _words_crc(words):
        """CRC32 of uint16 ``words`` as little-endian bytes (zlib's value)."""
        return crc32_update(0, (_swapped(words) if _BIG_ENDIAN else words).view(np.uint8))

    @njit(**JIT)
    def rans_encode_payload(flat, bits, m, count_div, count_mod, groups, coder, comp_group, comp_pooled,
                            neg_grid, grid16, form_steps, form_pooled, max_level, weight_bits, prec,
                            table_lane_run=LANE_RUN, lane_run=LANE_RUN):
        """:func:`rans_encode_symbols` after checking that every symbol of ``flat`` fits in
        ``bits`` (the counts index by symbol), with the CRC32 of the coder words, in one call
        without the GIL.

        Returns:
            ``(largest symbol, form, hist, table words, words, wide, words CRC32)``; when the
            largest symbol is ``>= 2**bits`` nothing is coded (the other items are empty / 0).
        """
        top = np.uint8(0)
        for i in range(np.uintp(flat.shape[0])):
            top = max(top, flat[i])
        if np.int64(top) >> bits:
            return (np.int64(top), np.int64(0), np.zeros(0, np.int64), np.zeros(0, np.uint16),
                    np.zeros(0, np.uint16), False, np.int64(0))
        form, hist, twords, words, wide = rans_encode_symbols(
            flat, bits, m, count_div, count_mod, groups, coder, comp_group, comp_pooled, neg_grid, grid16, form_steps,
            form_pooled, max_level, weight_bits, prec, table_lane_run, lane_run)
        return np.int64(top), np.int64(form), hist, twords, words, wide, _words_crc(words)

    @njit(**JIT)
    def rans_encode_bytes(flat, bits, m, count_div, count_mod, groups, coder, comp_group, comp_pooled, neg_grid, grid16,
                          form_steps, form_pooled, form_bytes, max_level, weight_bits, prec, table_lane_run, lane_run,
                          kind, dims, tail, per_byte):
        """:func:`rans_encode_payload` then :func:`rans_payload_bytes`, in one call without the GIL:
        the wire bytes of one rANS payload (arguments as theirs; ``form_bytes``: int64 form byte
        of each candidate form, to which bit 5 is added when the symbols took 32 lanes by the
        encoder's choice, ``lane_run < 0``).

        Returns:
            ``(largest symbol, uint8 payload)``; the payload is empty when the largest symbol is
            ``>= 2**bits`` (nothing coded).
        """
        top, form, hist, twords, words, wide, words_crc = rans_encode_payload(
            flat, bits, m, count_div, count_mod, groups, coder, comp_group, comp_pooled, neg_grid, grid16, form_steps,
            form_pooled, max_level, weight_bits, prec, table_lane_run, lane_run)
        if top >> bits:
            return top, np.zeros(0, np.uint8)
        form_byte = form_bytes[form] | (np.int64(32) if wide and lane_run < 0 else np.int64(0))
        return top, rans_payload_bytes(kind, form_byte, m, dims, hist, twords, words, words_crc, flat.shape[0], bits,
                                       tail, per_byte)

    @njit(**JIT)
    def _put_le(buf, at, value, nbytes):
        """Write the low ``nbytes`` bytes of ``value`` little-endian at ``buf[at]``; returns the next offset."""
        for i in range(nbytes):
            buf[at + i] = np.uint8((value >> (8 * i)) & 0xFF)
        return at + nbytes

    @njit(**JIT)
    def header_crc_seed(count, bits):
        """The CRC32 a payload's header checksum starts from: ``zlib.crc32`` of ``count`` as 8
        little-endian bytes and ``bits`` as 1 (so a header moved to another tensor fails)."""
        pre = np.empty(9, np.uint8)
        _put_le(pre, 0, count, 8)
        pre[8] = np.uint8(bits)
        return crc32_update(0, pre)

    @njit(**JIT)
    def rans_payload_bytes(kind, form_byte, m, dims, hist, twords, words, words_crc, count, bits, tail, per_byte):
        """The wire bytes of one rANS payload (:mod:`kvtune.codecs.rans`: kind, form byte, ``m``,
        the u32 ``dims``, the table histogram and words, the header CRC32 over those bytes
        seeded with the CRC32 of ``count`` as 8 bytes and ``bits`` as 1, the coder words with
        zero words up to ``ceil(count / per_byte)`` bytes in all, and, when ``tail``, the CRC32
        of the words and padding, continued from ``words_crc``, the CRC32 of ``words``).

        Args:
            dims: int64 layout dims; hist: int64 residual histogram (u32 on the wire);
                twords, words: uint16 table and coder words.

        Returns:
            uint8 array of the payload.
        """
        nh, nt, nw, nd = hist.shape[0], twords.shape[0], words.shape[0], dims.shape[0]
        head = 3 + 4 * nd + 2 + 4 * nh + 4 + 2 * nt
        size = head + 4 + 4 + 2 * nw + (4 if tail else 0)
        need = -(-count // per_byte)
        pad = max(0, -(-(need - size) // 2))
        out = np.empty(size + 2 * pad, np.uint8)
        out[0], out[1], out[2] = np.uint8(kind), np.uint8(form_byte), np.uint8(m)
        at = 3
        for d in dims:
            at = _put_le(out, at, d, 4)
        at = _put_le(out, at, nh - 1, 2)
        for v in hist:
            at = _put_le(out, at, v, 4)
        at = _put_le(out, at, nt, 4)
        for w in twords:
            at = _put_le(out, at, w, 2)
        at = _put_le(out, at, crc32_update(header_crc_seed(count, bits), out[:head]), 4)
        at = _put_le(out, at, nw + pad, 4)
        w_at = np.uintp(at)
        src = (_swapped(words) if _BIG_ENDIAN else words).view(np.uint8)
        for i in range(np.uintp(2 * nw)):  # a byte copy on uintp indices, which LLVM vectorizes
            out[w_at + i] = src[i]
        at += 2 * nw
        for i in range(2 * pad):
            out[at + i] = 0
        if tail:
            crc = crc32_update(words_crc, out[at : at + 2 * pad]) if pad else words_crc
            _put_le(out, at + 2 * pad, crc, 4)
        return out
