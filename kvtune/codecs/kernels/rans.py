"""Interleaved rANS kernels of the ``rans`` codec (:mod:`kvtune.codecs.rans`).

rANS after J. Duda, "Asymmetric numeral systems: entropy coding combining speed of Huffman
coding with compression rate of arithmetic coding" (arXiv 1311.2540, sec. 4) and F. Giesen,
"Interleaved entropy coders" (arXiv 1402.3392): :data:`LANES` 32-bit states
(``L = 2**16 <= x < 2**32``), 16-bit renormalisation (at most one word per symbol in either
direction), static frequency tables of :data:`PRECISION` bits. Symbol ``i`` of a run uses lane
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
every machine. The kernels are serial, release the GIL and are cached as the other kernels
(:func:`.cachedir.kernel_cache_dir`); :func:`rans_normalize` and :func:`rans_fused_tables` are the integer
table arithmetic encoder and decoder share. The package re-exports them (its ``__all__``);
``tests/test_kernels.py`` compares them with a pure Python coder.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from .cachedir import kernel_cache_dir
from .lowlevel import JIT


PRECISION = 15
"""Probability bits ``P``: every model's frequencies sum to ``2**P`` (``L = 2**16`` needs ``P <= 16``)."""
LANES = 4
"""Interleaved states."""
RANS_L = 1 << 16
"""Lower bound of a normalized state."""
BUCKET_BITS = 12
"""The decoder finds a slot's symbol from a ``2**BUCKET_BITS``-entry table per model, then a short scan."""

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
    def rans_decoder_tables(freq, cum, prec):
        """Flat decoder tables of :func:`rans_fused_tables`' output ``(M, ks)``: int64 ``freq << 16 |
        cum`` ``(M * ks,)`` and uint16 buckets ``(M * 2**BUCKET_BITS,)``: per model and bucket, the
        symbol holding the bucket's first slot (``b << (prec - BUCKET_BITS)``)."""
        nm, ks = freq.shape
        nb = 1 << BUCKET_BITS
        sh = prec - BUCKET_BITS
        tab = np.empty(nm * ks, np.int64)
        bk = np.empty(nm * nb, np.uint16)
        for q in range(nm):
            for x in range(ks):
                tab[q * ks + x] = (freq[q, x] << 16) | cum[q, x]
            s = 0
            for b in range(nb):
                start = b << sh
                while cum[q, s + 1] <= start:
                    s += 1
                bk[q * nb + b] = s
        return tab, bk

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

    @njit(inline="always")
    def _fused(sym, base, m, bits):
        s = np.int64(0)
        for j in range(m):
            s |= np.int64(sym[base + j]) << (bits * j)
        return s

    @njit(inline="always")
    def _prev_model(q, c, div, mod):
        if c == 0:
            return (q - 1 if q > 0 else mod - 1), div - 1
        return q, c - 1

    @njit(inline="always")
    def _next_model(q, c, div, mod):
        c += 1
        if c == div:
            q += 1
            return (0 if q == mod else q), 0
        return q, c

    @njit(inline="always")
    def _put(out, s, base, m, bits, dmask):
        for j in range(m):
            out[base + j] = (s >> (bits * j)) & dmask

    @njit(inline="always")
    def _enc1(x, f, c, inv, prec, out, pos):
        if x >= (f << (32 - prec)):
            pos -= 1
            out[pos] = x & 0xFFFF
            x >>= 16
        d = np.int64(np.float64(x) * inv)
        r = x - d * f
        if r < 0:
            d -= 1
            r += f
        elif r >= f:
            d += 1
            r -= f
        return (d << prec) + r + c, pos

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
        nm, ks = freq.shape
        fl = freq.reshape(-1)
        cl = np.empty(nm * ks, np.int64)
        inv = np.empty(nm * ks, np.float64)
        for q in range(nm):
            for x in range(ks):
                cl[q * ks + x] = cum[q, x]
                inv[q * ks + x] = 1.0 / np.float64(max(freq[q, x], 1))
        n = sym.shape[0] // m
        pos = out.shape[0]
        x0 = x1 = x2 = x3 = np.int64(RANS_L)
        q = ((n - 1) // div) % mod if n else 0
        c = (n - 1) % div if n else 0
        i = n - 1
        while i >= 0 and (i & 3) != 3:  # the tail: lanes i & 3 of the last partial block
            t = q * ks + _fused(sym, i * m, m, bits)
            if i & 3 == 0:
                x0, pos = _enc1(x0, fl[t], cl[t], inv[t], prec, out, pos)
            elif i & 3 == 1:
                x1, pos = _enc1(x1, fl[t], cl[t], inv[t], prec, out, pos)
            else:
                x2, pos = _enc1(x2, fl[t], cl[t], inv[t], prec, out, pos)
            q, c = _prev_model(q, c, div, mod)
            i -= 1
        while i >= 0:  # whole blocks of 4: lanes 3, 2, 1, 0
            t = q * ks + _fused(sym, i * m, m, bits)
            x3, pos = _enc1(x3, fl[t], cl[t], inv[t], prec, out, pos)
            q, c = _prev_model(q, c, div, mod)
            t = q * ks + _fused(sym, (i - 1) * m, m, bits)
            x2, pos = _enc1(x2, fl[t], cl[t], inv[t], prec, out, pos)
            q, c = _prev_model(q, c, div, mod)
            t = q * ks + _fused(sym, (i - 2) * m, m, bits)
            x1, pos = _enc1(x1, fl[t], cl[t], inv[t], prec, out, pos)
            q, c = _prev_model(q, c, div, mod)
            t = q * ks + _fused(sym, (i - 3) * m, m, bits)
            x0, pos = _enc1(x0, fl[t], cl[t], inv[t], prec, out, pos)
            q, c = _prev_model(q, c, div, mod)
            i -= 4
        for x in (x3, x2, x1, x0):
            pos -= 2
            out[pos] = x >> 16
            out[pos + 1] = x & 0xFFFF
        return pos

    @njit(inline="always")
    def _dec1(x, tab, tb, bk, bb, prec, bsh, words, pos, nw):
        slot = x & ((np.int64(1) << prec) - 1)
        s = np.int64(bk[bb + (slot >> bsh)])
        e = tab[tb + s]
        while (e & 0xFFFF) + (e >> 16) <= slot:
            s += 1
            e = tab[tb + s]
        x = (e >> 16) * (x >> prec) + slot - (e & 0xFFFF)
        if x < RANS_L:
            if pos >= nw:
                return x, s, nw + 1  # sticky: every later read fails too
            x = (x << 16) | np.int64(words[pos])
            pos += 1
        return x, s, pos

    @njit(**JIT)
    def rans_decode(words, bits, m, div, mod, tab, bk, prec, out):
        """Inverse of :func:`rans_encode`: fill ``out`` (``n * m`` symbols) from uint16 ``words``;
        ``tab``/``bk``: :func:`rans_decoder_tables`.

        Returns:
            Words consumed (``>= 0``), or ``-1`` when the words run out, a state read is not
            normalized, or a lane does not end at ``RANS_L`` (corrupt data); ``out`` is then
            garbage and must be discarded.
        """
        nw = words.shape[0]
        if nw < 2 * LANES:
            return -1
        st = np.empty(LANES, np.int64)
        for lane in range(LANES):
            st[lane] = (np.int64(words[2 * lane]) << 16) | np.int64(words[2 * lane + 1])
            if st[lane] < RANS_L:
                return -1
        x0, x1, x2, x3 = st[0], st[1], st[2], st[3]
        pos = 2 * LANES
        n = out.shape[0] // m
        ks = tab.shape[0] // mod
        nb = 1 << BUCKET_BITS
        bsh = prec - BUCKET_BITS
        dmask = (1 << bits) - 1
        q = 0
        c = 0
        i = 0
        while i + 4 <= n:
            x0, s, pos = _dec1(x0, tab, q * ks, bk, q * nb, prec, bsh, words, pos, nw)
            _put(out, s, i * m, m, bits, dmask)
            q, c = _next_model(q, c, div, mod)
            x1, s, pos = _dec1(x1, tab, q * ks, bk, q * nb, prec, bsh, words, pos, nw)
            _put(out, s, (i + 1) * m, m, bits, dmask)
            q, c = _next_model(q, c, div, mod)
            x2, s, pos = _dec1(x2, tab, q * ks, bk, q * nb, prec, bsh, words, pos, nw)
            _put(out, s, (i + 2) * m, m, bits, dmask)
            q, c = _next_model(q, c, div, mod)
            x3, s, pos = _dec1(x3, tab, q * ks, bk, q * nb, prec, bsh, words, pos, nw)
            _put(out, s, (i + 3) * m, m, bits, dmask)
            q, c = _next_model(q, c, div, mod)
            if pos > nw:
                return -1
            i += 4
        while i < n:
            if i & 3 == 0:
                x0, s, pos = _dec1(x0, tab, q * ks, bk, q * nb, prec, bsh, words, pos, nw)
            elif i & 3 == 1:
                x1, s, pos = _dec1(x1, tab, q * ks, bk, q * nb, prec, bsh, words, pos, nw)
            else:
                x2, s, pos = _dec1(x2, tab, q * ks, bk, q * nb, prec, bsh, words, pos, nw)
            _put(out, s, i * m, m, bits, dmask)
            q, c = _next_model(q, c, div, mod)
            if pos > nw:
                return -1
            i += 1
        if x0 != RANS_L or x1 != RANS_L or x2 != RANS_L or x3 != RANS_L:
            return -1
        return pos
