"""Interleaved rANS kernels of the ``rans`` codec (:mod:`kvtune.codecs.rans`).

rANS after J. Duda, "Asymmetric numeral systems: entropy coding combining speed of Huffman
coding with compression rate of arithmetic coding" (arXiv 1311.2540, sec. 4) and F. Giesen,
"Interleaved entropy coders" (arXiv 1402.3392): :data:`LANES` 32-bit states
(``L = 2**16 <= x < 2**32``), 16-bit renormalisation (at most one word per symbol in either
direction, done without a branch), static frequency tables of :data:`PRECISION` bits. Symbol ``i`` of a run uses lane
``i mod LANES``; the encoder walks the run backwards and pushes words on a stack, so the
decoder reads one forward stream: first the lanes' final states (two words each, high first),
then one word whenever a state drops below ``L``. Every lane starts encoding at ``L``, so a
decoder that ends with a state other than ``L`` has read a corrupt stream.

Models: ``freq`` / ``cum`` tables ``(models, alphabet)``; the symbol at position ``i`` of the
run uses model ``(i // div) % mod`` (per_channel: ``div = 1``, ``mod`` = fused channels; per_head:
``div`` = symbols per (batch, head) block, ``mod`` = heads; one model: ``mod = 1``). ``m``
adjacent input symbols of ``bits`` bits are fused into one coded super-symbol
``s_0 + s_1 2**bits + ...`` (first symbol least significant).

Division: ``x // f`` for ``x < 2**32`` is computed with a float64 reciprocal and corrected by
one integer step (the float estimate is off by at most one), so results are exact integers on
every machine. The decoder finds a slot's symbol in one lookup (a ``2**PRECISION``-entry
table per model, see :data:`PRECISION`). Indices are unsigned (``uintp``): numba checks signed indices for
negative wrap-around on every access.

Speed (``benchmarks/rans_kernels.py``, real KIVI symbols of the default model, one thread,
``benchmarks/results/rans_kernels.md``): the coder loops take about 5-7 ns per coded
super-symbol each way, the whole codec (counts, tables, checks) 6-13 ns. The first version
took 14-23 ns to encode and 23-36 ns to decode in its loops alone (a bucketed symbol search,
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

import numpy as np
from numba import njit

from .cachedir import kernel_cache_dir
from .lowlevel import JIT


PRECISION = 13
"""Probability bits ``P``: every model's frequencies sum to ``2**P`` (``L = 2**16`` needs ``P <= 16``).

13 bits keep an 8-bit model's decoder table at 8 KiB, so that the 16-32 per-channel models of
a KIVI tensor fit the L2 cache (measured as fast as 12 bits). The rounding of fused tail
products to ``2**-P`` costs, against the level-coded models' ideal size: 0.47 / 0.17 / 0.06 /
0.03 % at 12 / 13 / 14 / 15 bits on skewed synthetic 2-bit symbols fused by 4, 0.04 % or less
(12 bits) on real KIVI symbols."""
LANES = 4
"""Interleaved states."""
RANS_L = 1 << 16
"""Lower bound of a normalized state."""
_U1 = np.uint64(1)
_U16 = np.uint64(16)
_LOW16 = np.uint64(0xFFFF)
_UP1 = np.uintp(1)

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
        freq = np.zeros((nm, ks), np.int64)
        cum = np.zeros((nm, ks + 1), np.int64)
        sh = m * pc - prec
        half = (np.int64(1) << sh) >> 1
        mask = k - 1
        for q in range(nm):
            row = freq[q]
            got = np.int64(0)
            for x in range(ks):
                p = np.int64(1)
                for j in range(m):
                    p *= comp_f[comp[q, j], (x >> (bits * j)) & mask]
                if p > 0:
                    v = max(np.int64(1), (p + half) >> sh)
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
            slots: output, uint8 (``ks <= 256``) or uint16 ``(M * 2**prec,)``: the symbol of
                every slot of every model.

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
    def _level_row(row, neg_grid, h, max_level, out):
        """Level codes of one count row (``count_levels`` of :mod:`kvtune.codecs.range_coder`)."""
        n = np.float64(row.sum())
        for s in range(row.shape[0]):
            out[s] = 0
            if row[s] > 0:
                pos = np.searchsorted(neg_grid, -(row[s] / n))
                out[s] = min((pos + h) // (2 * h), max_level - 1) + 1

    @njit(**JIT)
    def _row_cost(row, lev, grid16, steps):
        """Bits of the symbols of ``row`` under level codes ``lev``: ``sum c (q - 1) / steps +
        n log2(sum of the weights 2**(-(q - 1) / steps))``."""
        shift = 16 // steps
        num = np.int64(0)
        n = np.int64(0)
        w = 0.0
        for s in range(row.shape[0]):
            if lev[s] > 0:
                u = (lev[s] - 1) * shift
                w += grid16[u & 15] * 2.0 ** -(u >> 4)
                num += row[s] * (lev[s] - 1)
                n += row[s]
        return num / steps + (n * np.log2(w) if n else 0.0)

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
        g, k = counts.shape
        h = 8 // steps
        pc = counts.sum(axis=0)
        pool = np.empty(k, np.int64)
        _level_row(pc, neg_grid, h, max_level, pool)
        hist = np.zeros(2 * max_level + 2, np.int64)
        prev = np.int64(0)
        for s in range(k):
            hist[_zig(pool[s] - prev)] += 1
            prev = pool[s]
        if pooled:
            bits = _row_cost(pc, pool, grid16, steps)
        else:
            bits = 0.0
            lev = np.empty(k, np.int64)
            for i in range(g):
                _level_row(counts[i], neg_grid, h, max_level, lev)
                bits += _row_cost(counts[i], lev, grid16, steps)
                for s in range(k):
                    if pool[s] > 0:
                        hist[_zig(lev[s] - pool[s])] += 1
        total = hist.sum()
        size = 0
        for j in range(hist.shape[0]):
            if hist[j] > 0:
                bits += hist[j] * np.log2(total / hist[j])
                size = j + 1
        return bits + 32 * size

    @njit(**JIT)
    def rans_choose_table(counts, neg_grid, grid16, form_steps, form_pooled, max_level):
        """The table form of the fewest estimated bits (:func:`rans_form_bits`; first of equals;
        per-group forms only when there are several groups) and its level codes and residuals.

        Args:
            counts: int64 ``(G, K)``, every row with a symbol.
            form_steps, form_pooled: int64 ``(F,)``: the candidate forms' levels per octave and
                whether they are pooled.

        Returns:
            ``(form, levels, residuals)``: the form's index; int64 level codes ``(G, K)``
            (``(1, K)`` pooled) as :func:`kvtune.codecs.range_coder.count_levels` gives them; int64
            residuals in coding order: the zigzagged differences of the pooled row's codes to
            their left neighbour, then (per-group) every group's codes of the pooled row's present
            symbols as zigzagged differences to the pooled code.
        """
        g, k = counts.shape
        best, best_bits = -1, np.inf
        for f in range(form_steps.shape[0]):
            if g == 1 and not form_pooled[f]:
                continue
            bits = rans_form_bits(counts, neg_grid, grid16, form_steps[f], form_pooled[f] != 0, max_level)
            if bits < best_bits:
                best, best_bits = f, bits
        h = 8 // form_steps[best]
        pool = np.empty(k, np.int64)
        _level_row(counts.sum(axis=0), neg_grid, h, max_level, pool)
        present = 0
        for s in range(k):
            present += pool[s] > 0
        pooled = form_pooled[best] != 0
        levels = np.empty((1 if pooled else g, k), np.int64)
        res = np.empty(k + (0 if pooled else g * present), np.int64)
        prev = np.int64(0)
        for s in range(k):
            res[s] = _zig(pool[s] - prev)
            prev = pool[s]
        if pooled:
            levels[0] = pool
            return best, levels, res
        j = k
        for i in range(g):
            _level_row(counts[i], neg_grid, h, max_level, levels[i])
            for s in range(k):
                if pool[s] > 0:
                    res[j] = _zig(levels[i, s] - pool[s])
                    j += 1
        return best, levels, res

    @njit(**JIT)
    def rans_count_groups(sym, div, mod, groups, k):
        """Histogram int64 ``(groups, k)`` of flat ``sym``: symbol ``i`` belongs to group
        ``(i // div) % mod`` (``groups == mod``)."""
        out = np.zeros((groups, k), np.int64)
        flat = out.reshape(-1)
        n = sym.shape[0]
        if div == 1:  # per_channel / global: group = column of an (n // mod, mod) matrix
            rows = n // mod
            for r in range(rows):
                o = r * mod
                for c in range(mod):
                    flat[c * k + sym[o + c]] += 1
            return out
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
    def rans_encode(sym, bits, m, div, mod, freq, cum, prec, out):
        """rANS-encode flat ``sym`` (``n * m`` symbols, fused ``m`` at a time) into ``out``.

        Args:
            sym: uint8 or uint16 symbols; ``bits``/``m``: fusion (``m = 1``: none).
            div, mod: model of super-symbol ``i`` is ``(i // div) % mod`` (see the module doc).
            freq, cum: tables of :func:`rans_fused_tables`; every coded super-symbol must have
                ``freq > 0`` (the caller builds the tables from the symbols' own counts).
            prec: probability bits of the tables.
            out: uint16 scratch of at least ``n + 2 * LANES`` words.

        Returns:
            ``start``: the coded words are ``out[start:]`` (lane states first).
        """
        if m == 1:
            return _encode_loop(sym, div, mod, freq, cum, prec, out)
        fz = np.empty(sym.shape[0] // m, np.uint16)
        _fuse(sym, bits, m, fz)
        return _encode_loop(fz, div, mod, freq, cum, prec, out)

    @njit(**JIT)
    def _encode_loop(fz, div, mod, freq, cum, prec, out):
        """The coder loop of :func:`rans_encode` on the super-symbols ``fz``."""
        nm, ks = freq.shape
        tf = np.empty(nm * ks, np.uint64)
        tc = np.empty(nm * ks, np.uint64)
        tx = np.empty(nm * ks, np.uint64)
        ti = np.empty(nm * ks, np.float64)
        for q in range(nm):
            for x in range(ks):
                f = freq[q, x]
                tf[q * ks + x] = f
                tc[q * ks + x] = cum[q, x]
                tx[q * ks + x] = np.uint64(f) << np.uint64(32 - prec)
                ti[q * ks + x] = 1.0 / np.float64(max(f, 1))
        n = fz.shape[0]
        up, uks, udiv, umod = np.uint64(prec), np.uint64(ks), np.uint64(div), np.uint64(mod)
        pos = np.uint64(out.shape[0])
        x0 = x1 = x2 = x3 = np.uint64(RANS_L)
        q = np.uint64(((n - 1) // div) % mod if n else 0)
        c = np.uint64((n - 1) % div if n else 0)
        i = np.uint64(n)
        while i & np.uint64(3):  # the tail: lanes (n - 1) & 3 .. 0 of the last partial block
            i -= _U1
            t = q * uks + np.uint64(fz[i])
            lane = i & np.uint64(3)
            if lane == 2:
                x2, w, b = _enc1(x2, tf[t], tc[t], ti[t], tx[t], up)
            elif lane == 1:
                x1, w, b = _enc1(x1, tf[t], tc[t], ti[t], tx[t], up)
            else:
                x0, w, b = _enc1(x0, tf[t], tc[t], ti[t], tx[t], up)
            out[pos - _U1] = w  # written always, kept when b: no branch on renormalisation
            pos -= b
            q, c = _prev_model(q, c, udiv, umod)
        while i:  # whole blocks of 4: lanes 3, 2, 1, 0
            i -= np.uint64(4)
            t = q * uks + np.uint64(fz[i + np.uint64(3)])
            x3, w, b = _enc1(x3, tf[t], tc[t], ti[t], tx[t], up)
            out[pos - _U1] = w
            pos -= b
            q, c = _prev_model(q, c, udiv, umod)
            t = q * uks + np.uint64(fz[i + np.uint64(2)])
            x2, w, b = _enc1(x2, tf[t], tc[t], ti[t], tx[t], up)
            out[pos - _U1] = w
            pos -= b
            q, c = _prev_model(q, c, udiv, umod)
            t = q * uks + np.uint64(fz[i + _U1])
            x1, w, b = _enc1(x1, tf[t], tc[t], ti[t], tx[t], up)
            out[pos - _U1] = w
            pos -= b
            q, c = _prev_model(q, c, udiv, umod)
            t = q * uks + np.uint64(fz[i])
            x0, w, b = _enc1(x0, tf[t], tc[t], ti[t], tx[t], up)
            out[pos - _U1] = w
            pos -= b
            q, c = _prev_model(q, c, udiv, umod)
        for x in (x3, x2, x1, x0):
            pos -= np.uint64(2)
            out[pos] = x >> _U16
            out[pos + _U1] = x & _LOW16
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
    def _decode_loop(words, div, mod, fc, slots, prec, out):
        """The coder loop of :func:`rans_decode`: super-symbol ``i`` into ``out[i]``."""
        nw = words.shape[0]
        if nw < 2 * LANES:
            return -1
        st = np.empty(LANES, np.uint64)
        for lane in range(LANES):
            st[lane] = (np.uint64(words[2 * lane]) << _U16) | np.uint64(words[2 * lane + 1])
            if st[lane] < RANS_L:
                return -1
        x0, x1, x2, x3 = st[0], st[1], st[2], st[3]
        pos = np.uint64(2 * LANES)
        last = np.uint64(nw - 1)
        n = np.uint64(out.shape[0])
        uks = np.uint64(fc.shape[0] // mod)
        ns = _U1 << np.uint64(prec)
        pmask = ns - _U1
        up = np.uint64(prec)
        q = 0
        c = 0
        i = np.uint64(0)
        while i + np.uint64(4) <= n:
            uq = np.uint64(q)
            x0, s, pos = _dec1(x0, fc, uq * uks, slots, uq * ns, pmask, up, words, pos, last)
            out[i] = s
            q, c = _next_model(q, c, div, mod)
            uq = np.uint64(q)
            x1, s, pos = _dec1(x1, fc, uq * uks, slots, uq * ns, pmask, up, words, pos, last)
            out[i + _U1] = s
            q, c = _next_model(q, c, div, mod)
            uq = np.uint64(q)
            x2, s, pos = _dec1(x2, fc, uq * uks, slots, uq * ns, pmask, up, words, pos, last)
            out[i + np.uint64(2)] = s
            q, c = _next_model(q, c, div, mod)
            uq = np.uint64(q)
            x3, s, pos = _dec1(x3, fc, uq * uks, slots, uq * ns, pmask, up, words, pos, last)
            out[i + np.uint64(3)] = s
            q, c = _next_model(q, c, div, mod)
            i += np.uint64(4)
        while i < n:
            uq = np.uint64(q)
            lane = i & np.uint64(3)
            if lane == 0:
                x0, s, pos = _dec1(x0, fc, uq * uks, slots, uq * ns, pmask, up, words, pos, last)
            elif lane == 1:
                x1, s, pos = _dec1(x1, fc, uq * uks, slots, uq * ns, pmask, up, words, pos, last)
            else:
                x2, s, pos = _dec1(x2, fc, uq * uks, slots, uq * ns, pmask, up, words, pos, last)
            out[i] = s
            q, c = _next_model(q, c, div, mod)
            i += _U1
        if pos > np.uint64(nw) or x0 != RANS_L or x1 != RANS_L or x2 != RANS_L or x3 != RANS_L:
            return -1
        return np.int64(pos)

    @njit(**JIT)
    def rans_decode(words, bits, m, div, mod, fc, slots, prec, out):
        """Inverse of :func:`rans_encode`: fill ``out`` (``n * m`` symbols) from uint16 ``words``;
        ``fc``/``slots``: :func:`rans_decoder_tables`.

        The coder loop stores one super-symbol per step and :func:`_unfuse` splits them after it
        (vectorized), rather than ``m`` shifted stores inside the loop.

        Returns:
            Words consumed (``>= 0``), or ``-1`` when the words run out, a state read is not
            normalized, or a lane does not end at ``RANS_L`` (corrupt data); ``out`` is then
            garbage and must be discarded.
        """
        if m == 1:
            return _decode_loop(words, div, mod, fc, slots, prec, out)
        fz = np.empty(out.shape[0] // m, np.uint16)
        used = _decode_loop(words, div, mod, fc, slots, prec, fz)
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
        out = np.zeros((g, k), np.int64)
        shift = 16 // steps
        for i in range(g):
            for s in range(k):
                q = levels[i, s]
                if q > 0:
                    u = (q - 1) * shift
                    out[i, s] = max(np.int64(1), np.int64(math.floor(math.ldexp(grid16[u & 15], weight_bits - (u >> 4)))))
        return out

    @njit(**JIT)
    def rans_encode_symbols(flat, bits, m, count_div, count_mod, groups, coder, comp_group, comp_pooled,
                            neg_grid, grid16, form_steps, form_pooled, max_level, weight_bits, prec):
        """The whole rANS coding of one tensor's symbols, in one call without the GIL: group
        counts (:func:`rans_count_groups`), the table form (:func:`rans_choose_table`), the
        residuals' histogram and words, the super-symbols (:func:`_fuse`) and their words.

        Args:
            flat: uint8 symbols ``< 2**bits``; ``m``: fusion.
            count_div, count_mod, groups: the symbols' groups (:func:`rans_count_groups`).
            coder: int64 ``(4,)``: ``(div, mod)`` of the super-symbols' models per group, then
                pooled; ``comp_group`` / ``comp_pooled``: their ``comp`` (:func:`rans_fused_tables`).
            neg_grid, grid16, form_steps, form_pooled, max_level: as :func:`rans_choose_table`.
            weight_bits: integer weight of level code 1 is ``2**weight_bits``.

        Returns:
            ``(form, hist, table words, words)``: int64 histogram of the residuals, uint16 words.
        """
        counts = rans_count_groups(flat, count_div, count_mod, groups, 1 << bits)
        form, levels, res = rans_choose_table(counts, neg_grid, grid16, form_steps, form_pooled, max_level)
        nh = 0
        for r in res:
            nh = max(nh, r + 1)
        hist = np.zeros(nh, np.int64)
        for r in res:
            hist[r] += 1
        tbits, tfreq, tcum = _residual_model(hist, prec)
        tout = np.empty(res.shape[0] + 2 * LANES, np.uint16)
        tstart = rans_encode(res, tbits, 1, 1, 1, tfreq, tcum, prec, tout)
        pooled = form_pooled[form] != 0
        weights = rans_level_weights(levels, form_steps[form], grid16, weight_bits)
        comp = comp_pooled if pooled else comp_group
        div = coder[2] if pooled else coder[0]
        mod = coder[3] if pooled else coder[1]
        freq, cum = rans_fused_tables(weights, comp, bits, prec)
        out = np.empty(flat.shape[0] // m + 2 * LANES, np.uint16)
        start = rans_encode(flat, bits, m, div, mod, freq, cum, prec, out)
        return form, hist, tout[tstart:], out[start:]

    @njit(**JIT)
    def _unrans_into(words, bits, m, div, mod, freq, cum, prec, out):
        """Decode into ``out``: words consumed, or -1 (see :func:`rans_decode`)."""
        nm, ks = freq.shape
        if ks <= 256:
            slots8 = np.empty(nm << prec, np.uint8)
            fc = rans_decoder_tables(freq, cum, prec, slots8)
            return rans_decode(words, bits, m, div, mod, fc, slots8, prec, out)
        slots16 = np.empty(nm << prec, np.uint16)
        fc = rans_decoder_tables(freq, cum, prec, slots16)
        return rans_decode(words, bits, m, div, mod, fc, slots16, prec, out)

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
    )
    """Messages of the status codes of :func:`rans_decode_symbols` (0 = no error)."""

    @njit(**JIT)
    def rans_decode_symbols(hist, twords, words, bits, m, groups, steps, pooled, coder, comp_group, comp_pooled,
                            grid16, max_level, weight_bits, prec, out):
        """Inverse of :func:`rans_encode_symbols` after the caller has read and checked the
        header (its checksum, and the histogram's total between ``2**bits`` and
        ``2**bits * (groups + 1)``, which bounds what this allocates): the level codes from the
        table words, every check of the table, the fused models and the symbols, in one call
        without the GIL.

        Args:
            hist: int64 residual histogram; ``twords`` / ``words``: uint16 table and coder words.
            groups: groups of the layout; ``steps``: levels per octave; ``pooled``: the form.
            out: uint8 ``(count,)``, filled with the symbols.

        Returns:
            0, or the index of the failed check in :data:`DECODE_ERRORS` (``out`` is then garbage).
        """
        k = 1 << bits
        total = 0
        for v in hist:
            total += v
        tbits, tfreq, tcum = _residual_model(hist, prec)
        z = np.empty(total, np.uint16)
        used = _unrans_into(twords, tbits, 1, 1, 1, tfreq, tcum, prec, z)
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
        used = _unrans_into(words, bits, m, div, mod, freq, cum, prec, out)
        if used < 0:
            return 8
        for j in range(used, words.shape[0]):
            if words[j] != 0:
                return 9
        return 0
