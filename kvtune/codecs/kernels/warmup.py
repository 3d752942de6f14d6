"""Compilation (or loading from numba's on-disk cache) of the kernels the fast path uses."""

from __future__ import annotations

import numpy as np

from .batch import DEC_COLUMNS, ENC_COLUMNS, TR_COLUMNS, crc32_concat, decode_batch, encode_batch
from .components import dequantize_components, quantize_components
from .convert import store_output, to_float32
from .crc import crc32_combine, crc32_update
from .finite import max_magnitude_bf16, max_magnitude_f32
from .segments import KIND_UNIFORM, SEG_COLUMNS, decode_segments, encode_segments
from .transforms import affine_fit, affine_rows, delta_load, delta_rows, delta_store, hadamard_rows


def warm_up() -> float:
    """Compile (or load from the on-disk cache) the kernels with the argument types the fast
    path (:mod:`kvtune.codecs.fastpath`) uses. Not a kernel itself: its test checks that every
    kernel it lists ends up compiled.

    Returns:
        Seconds spent: a few minutes on a loaded 2-core machine the first time after an edit
        of the kernel modules (about a minute when idle), about a second once cached (reading the cache
        files and linking).
    """
    import time

    start = time.perf_counter()
    shape = (1, 2, 8, 8)
    seg = np.zeros((1, SEG_COLUMNS), np.int64)
    seg[0] = (KIND_UNIFORM, 4, 1, 8, 0, 0, 2, 2, 8, 0, 64, 64, 64, 0, 0)  # 2 heads x 8 tokens x 8, groups of 8
    idx = np.array([0, 1, *range(8)], np.int64)
    out = np.zeros(128, np.uint8)
    sym = np.zeros(128, np.uint8)
    luts = np.zeros((2, 256), np.float32)
    books = np.zeros((9, 256), np.float64)
    for x in (np.ones(shape, np.float32), np.full(shape, 0x3F80, np.uint16)):
        encode_segments(x, seg, idx, out, sym, True, np.zeros((2, 65536), np.uint8), books)
    ro = out.copy()
    ro.flags.writeable = False
    for data in (out, ro):
        for y, kind in ((np.zeros(shape, np.float32), 0), (np.zeros(shape, np.uint16), 1)):
            decode_segments(data, seg, idx, luts, np.zeros((2, 256), np.uint16), sym, True, y, kind, books)
    # the batch route (one call per codec thread): an empty table compiles the kernels
    none = np.zeros((0, ENC_COLUMNS), np.int64)
    ops = (np.zeros((0, 0, TR_COLUMNS), np.int64), np.zeros(0, np.float32), np.zeros(0, np.int64), np.zeros(0, np.float32),
           np.zeros(1, np.float32), np.zeros(1, np.uint16))
    encode_batch(none, np.zeros(0), seg, idx, out, sym, np.zeros((2, 65536), np.uint8), books, np.zeros((0, 3), np.int64),
                 np.zeros(1, np.int64), *ops)
    for data in (out, ro):
        decode_batch(data, np.zeros((0, DEC_COLUMNS), np.int64), seg, idx, luts, np.zeros((2, 256), np.uint16), sym, books,
                     np.zeros(0, np.int64), np.zeros(0, np.uint8), np.zeros(1, np.int64), *ops)
    crc32_concat(0, np.zeros(1, np.int64), np.zeros(1, np.int64))
    y = np.ones(shape, np.float32)
    to_float32(np.full(shape, 0x3F80, np.uint16), y)
    to_float32(np.ones(shape, np.float32), y)
    store_output(y, 1, np.empty(shape, np.uint16))
    hadamard_rows(y, np.ones((2, 8), np.float32), np.array([8], np.int64), np.ones(1, np.float32), False)
    delta_rows(y, 4, False)
    for x in (np.full(shape, 0x3F80, np.uint16), np.ones(shape, np.float32)):
        delta_load(x, y, 4)
    for o, kind in ((np.empty(shape, np.uint16), 1), (np.empty(shape, np.float32), 0)):
        delta_store(y, 4, kind, o)
    s16 = np.zeros((2, 8), np.uint16)
    affine_fit(y, True, True, s16, s16.copy())
    affine_rows(y, s16, s16, True, False)
    crc32_combine(1, 2, 5)
    ro = out.copy()
    ro.flags.writeable = False  # streams being decoded are read-only buffers
    for data in (out, ro):
        crc32_update(0, data)
    max_magnitude_bf16(np.zeros(shape, np.uint16))
    max_magnitude_f32(y)
    comp, bounds, bits = np.arange(16, dtype=np.int64), np.array([0, 16], np.int64), np.array([2], np.int64)
    sink, meta, sym = np.zeros((1, 2, 2, 8), np.uint16), np.zeros(32, np.uint16), np.zeros(96, np.uint8)
    rows, ysink = np.ones((1, 8, 16), np.float32), np.ones((1, 2, 16), np.float32)  # token rows, sink tokens
    quantize_components(rows, ysink, comp, bounds, bits, np.ones(8), 0, 0.0, sink, meta, sym)  # dp-alloc (KVTC-like policies)
    dequantize_components(sym, meta, comp, bounds, bits, 0, sink, ysink, rows)
    return time.perf_counter() - start
