"""bfloat16 pass-through segments (heads or tokens kept at full bfloat16 precision).

Accelerates :class:`kvtune.codecs.quantizers.NoQuantizer` (``quantize_block`` /
``dequantize_block``): the "no compression" baseline and every bfloat16 segment of a
mixed-precision plan (sink and recent-token windows -- KIVI's full-precision residual window,
arXiv 2402.02750 -- and 16-bit anchors).
"""

from __future__ import annotations

import numpy as np
from numba import njit, uintp

from .convert import load_row, store_row
from .lowlevel import JIT

_u = uintp


@njit(**JIT)
def gather_bf16(x, heads, tokens, out):
    """bfloat16 bits of ``x[:, heads][:, :, tokens]`` (``out`` uint16 ``(B, Hs, Ts, D)``).

    Reference: :meth:`kvtune.codecs.quantizers.NoQuantizer.quantize_block`.
    """
    nb, nh, nt, d_n = x.shape
    xf, of = x.reshape(-1), out.reshape(-1)
    dn = _u(d_n)
    row = np.empty(d_n, np.float32)
    r = 0
    for b in range(nb):
        for hi in range(heads.shape[0]):
            for ti in range(tokens.shape[0]):
                load_row(xf, _u(((b * nh + heads[hi]) * nt + tokens[ti]) * d_n), row, _u(0), dn)
                store_row(of, _u(r * d_n), row, dn, 1)
                r += 1


@njit(**JIT)
def scatter_bf16(sym, heads, tokens, out, kind):
    """``out[:, heads][:, :, tokens] = bfloat16 bits sym``, converted as
    :func:`~kvtune.codecs.kernels.dequantize_per_token`."""
    nb, hs, ts, d_n = sym.shape
    nh, nt = out.shape[1], out.shape[2]
    sf, of = sym.reshape(-1), out.reshape(-1)
    dn = _u(d_n)
    row = np.empty(d_n, np.float32)
    r = 0
    for b in range(nb):
        for hi in range(hs):
            for ti in range(ts):
                load_row(sf, _u(r * d_n), row, _u(0), dn)
                store_row(of, _u(((b * nh + heads[hi]) * nt + tokens[ti]) * d_n), row, dn, kind)
                r += 1
