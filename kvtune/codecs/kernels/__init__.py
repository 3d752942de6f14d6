"""Compiled kernels of the codec fast path (:mod:`kvtune.codecs.fastpath`), written with numba.

One module per component of :mod:`kvtune.codecs` that the kernels accelerate:

* :mod:`.quantize`: uniform per-token / per-channel quantization (``UniformQuantizer``, KIVI);
* :mod:`.fp8`: float8 quantization (``FP8Quantizer``);
* :mod:`.codebook`: non-uniform NF / Lloyd-Max codebook quantization (``CodebookQuantizer``);
* :mod:`.bf16`: bfloat16 pass-through segments (``NoQuantizer``);
* :mod:`.transforms`: Hadamard rotation, delta coding, affine normalization
  (:mod:`kvtune.codecs.transforms`);
* :mod:`.bitpack`: bit packing of symbols (the ``bitpack`` codec);
* :mod:`.components`: per-component quantization of ``dp-alloc`` (KVTC-like presets);
* :mod:`.rans`: interleaved rANS coding and its integer tables (the ``rans`` codec);
  :mod:`.rans_lanes`: its coder loops on 512-bit vectors (32 lanes, long runs);
  :mod:`.column_counts`: the per-channel symbol counts its tables start from, in byte vectors;
* :mod:`.segments`: every segment of one K or V tensor in one call;
  :mod:`.rans_segments`: the same with each segment's symbols rANS-coded (the ``rans`` codec);
* :mod:`.batch`: every tensor of a cache in one call per codec thread, transforms included (the
  fast path's entry for bit-packed policies of block quantizers);
* :mod:`.finite`: finiteness and largest-magnitude checks of the inputs; :mod:`.crc`: CRC-32 of stream sections;
* :mod:`.convert`: float16 / bfloat16 conversions and row access in the tensor dtypes;
* :mod:`.lowlevel`: compile options, constants, bit casts and vector intrinsics they share;
* :mod:`.warmup`: :func:`warm_up`.

This package's namespace is their public face: it re-exports every kernel (and the segment
table's ``SEG_*`` / ``KIND_*`` constants) and its ``__all__`` is the one list of them (the
kernel modules have none of their own; a public function of a kernel module that is not listed
here is a helper for the other modules), so callers write
``from kvtune.codecs import kernels as K`` and ``K.encode_segments(...)``.

Every public kernel reproduces, bit for bit, a reference written with torch, numpy or zlib
(named in its docstring: a component of :mod:`kvtune.codecs`, or the library call).
``tests/test_kernels.py`` compares every kernel listed in ``__all__`` with its reference on
seeded random inputs and edge cases (empty inputs, lengths that are not a multiple of the
8-lane vector width or of the bit-packing unit, every width 1..8, saturating and extreme
values, NaN/inf where a kernel tests finiteness), and fails when a public kernel has no case;
``tests/test_codecs.py`` checks whole streams (fast path == reference path). Finite inputs are
covered by that guarantee; NaN payloads are not (torch itself converts NaN differently in its
vectorized and scalar paths).

Conventions:

* All kernels are serial, release the GIL (``nogil=True``) and are compiled once per input
  dtype and cached on disk (``cache=True``): the codec fast path parallelizes *across* K/V
  tensors with a small thread pool. (Measured on the 2-core development machine under load
  average 6-10: a ``prange`` launch costs ~0.1 ms with numba's workqueue layer and ~16 ms with
  the OpenMP layer -- the second thread is often descheduled and the barrier waits for it --
  while one tensor's serial kernel takes ~0.1-0.5 ms. Coarse, dynamically scheduled tasks do
  not wait for a descheduled thread.)
* IEEE semantics: ``fastmath=False`` everywhere, so no FMA contraction (the references are
  written as a separate multiply and add) and no reassociation. Min/max over a group is
  order-independent for non-NaN data except for the sign of a zero; the canonical ``+0`` zero
  point of :func:`kvtune.codecs.quantizers.asymmetric_params` removes that ambiguity.
* Integer bit manipulation is done in int64 (numba promotes small unsigned types in ways that
  can silently produce floats when mixed with signed ones).
* Tensors are ``(batch, heads, tokens, head_dim)`` numpy arrays; bfloat16 travels as its
  ``uint16`` bit pattern, float16 metadata as ``uint16`` bits. Segments select heads and
  tokens with int64 index arrays (:class:`kvtune.codecs.base.Segment`).

First-call cost: compiling every kernel for one input dtype takes ~20-40 s on a loaded 2-core
machine; with ``cache=True`` later processes load the machine code from ``__pycache__`` in
well under a second (see :func:`warm_up`).

Cache: kernels are cached on disk under one folder per digest of this package's sources
(:mod:`.cachedir`), so editing or upgrading any kernel module never leaves a caller running
the stale machine code of a helper it inlined.
"""

from __future__ import annotations

from .cachedir import kernel_cache_dir

with kernel_cache_dir():  # every kernel module is compiled/cached under one source digest
    from .batch import (
        DEC_COLUMNS,
        DEC_B,
        DEC_D,
        DEC_H,
        DEC_IN,
        DEC_KIND,
        DEC_LEN,
        DEC_NSEG,
        DEC_OUT,
        DEC_SEG,
        DEC_T,
        ENC_B,
        ENC_COLUMNS,
        ENC_D,
        ENC_FLOAT32,
        ENC_H,
        ENC_LEN,
        ENC_NSEG,
        ENC_OUT,
        ENC_SEG,
        ENC_T,
        ENC_X,
        BAD_CODEBOOK,
        BAD_META,
        BAD_PAYLOAD,
        BAD_STATE,
        TR_A,
        TR_AFFINE,
        TR_B,
        TR_C,
        TR_COLUMNS,
        TR_DELTA,
        TR_HADAMARD,
        TR_KIND,
        crc32_concat,
        decode_batch,
        encode_batch,
    )
    from .bf16 import gather_bf16, scatter_bf16
    from .bitpack import pack_bits, unpack_bits
    from .convert import (
        f16_bits_to_f32,
        f16_bits_to_f32_soft,
        f32_to_bf16_bits,
        f32_to_f16_bits,
        f32_to_f16_bits_soft,
        fp16_round_up_bits,
        store_output,
        to_float32,
    )
    from .components import GRID_CODES, dequantize_components, quantize_components
    from .codebook import codebook_dequantize, codebook_quantize
    from .column_counts import column_counts
    from .crc import CRC32_CLMUL, CRC32_VPCLMUL, crc32_combine, crc32_update
    from .finite import all_finite_bf16, all_finite_f32, first_nonfinite_f16, max_magnitude_bf16, max_magnitude_f32
    from .fp8 import fp8_dequantize, fp8_quantize
    from .rans import (
        rans_choose_table,
        rans_decode_payload,
        rans_encode_bytes,
        rans_encode_payload,
        rans_payload_bytes,
        rans_decode_symbols,
        rans_encode_symbols,
        rans_level_weights,
        rans_count_groups,
        rans_decode,
        rans_decoder_tables,
        rans_encode,
        rans_form_bits,
        rans_fused_tables,
        rans_normalize,
    )
    from .rans_segments import (
        PR_BITS,
        PR_CDIV,
        PR_CG,
        PR_CG_ROWS,
        PR_CMOD,
        PR_CODER,
        PR_COLUMNS,
        PR_COUNT,
        PR_CP,
        PR_DIMS,
        PR_FORMS,
        PR_GROUPS,
        PR_M,
        PR_NDIMS,
        PR_NFORMS,
        PR_PAY,
        PR_RAW,
        PR_SYM,
        LIM_LANE_RUN,
        LIM_MAX_LEVEL,
        LIM_MAX_RESIDUAL,
        LIM_MAX_TABLE_ENTRIES,
        LIM_MAX_TABLE_MODELS,
        LIM_NO_LANE_RUN,
        LIM_PER_BYTE,
        LIM_PREC,
        LIM_STEPS,
        LIM_WEIGHT_BITS,
        rans_encode_tensor,
        rans_pack_segments,
        rans_unpack_payload,
        rans_unpack_tensor,
    )
    from .quantize import dequantize_per_channel, dequantize_per_token, quantize_per_channel, quantize_per_token
    from .segments import (
        CB_LLOYD,
        CB_MINMAX,
        KIND_CODEBOOK,
        KIND_BF16,
        KIND_FP8,
        KIND_UNIFORM,
        SEG_A,
        SEG_B,
        SEG_BITS,
        SEG_COLUMNS,
        SEG_G,
        SEG_HEADS,
        SEG_KIND,
        SEG_META,
        SEG_META_LEN,
        SEG_NHEADS,
        SEG_NTOKENS,
        SEG_PAYLOAD,
        SEG_PAYLOAD_LEN,
        SEG_SYM,
        SEG_BOOK,
        SEG_TOKENS,
        decode_segments,
        decode_tensor,
        encode_segments,
        encode_tensor,
    )
    from .transforms import (
        affine_fit,
        affine_rows,
        delta_load,
        delta_rows,
        delta_store,
        hadamard_load,
        hadamard_rows,
        hadamard_store,
    )
    from .warmup import warm_up

__all__ = [
    "f32_to_f16_bits",
    "f32_to_f16_bits_soft",
    "f16_bits_to_f32",
    "f16_bits_to_f32_soft",
    "f32_to_bf16_bits",
    "fp16_round_up_bits",
    "quantize_per_token",
    "quantize_per_channel",
    "dequantize_per_token",
    "dequantize_per_channel",
    "fp8_quantize",
    "fp8_dequantize",
    "codebook_quantize",
    "codebook_dequantize",
    "gather_bf16",
    "scatter_bf16",
    "all_finite_bf16",
    "all_finite_f32",
    "first_nonfinite_f16",
    "max_magnitude_bf16",
    "max_magnitude_f32",
    "to_float32",
    "store_output",
    "hadamard_rows",
    "hadamard_load",
    "hadamard_store",
    "delta_rows",
    "delta_load",
    "delta_store",
    "affine_fit",
    "affine_rows",
    "quantize_components",
    "dequantize_components",
    "pack_bits",
    "unpack_bits",
    "rans_normalize",
    "rans_fused_tables",
    "rans_decoder_tables",
    "rans_count_groups",
    "column_counts",
    "rans_choose_table",
    "rans_level_weights",
    "rans_encode_symbols",
    "rans_decode_payload",
    "rans_encode_payload",
    "rans_encode_bytes",
    "rans_payload_bytes",
    "rans_decode_symbols",
    "rans_form_bits",
    "rans_encode",
    "rans_decode",
    "encode_segments",
    "encode_tensor",
    "rans_pack_segments",
    "rans_encode_tensor",
    "rans_unpack_payload",
    "rans_unpack_tensor",
    "decode_segments",
    "decode_tensor",
    "encode_batch",
    "decode_batch",
    "crc32_concat",
    "crc32_update",
    "crc32_combine",
    "CRC32_CLMUL",
    "CRC32_VPCLMUL",
    "warm_up",
    "SEG_KIND",
    "SEG_BITS",
    "SEG_A",
    "SEG_G",
    "SEG_B",
    "SEG_HEADS",
    "SEG_NHEADS",
    "SEG_TOKENS",
    "SEG_NTOKENS",
    "SEG_META",
    "SEG_META_LEN",
    "SEG_PAYLOAD",
    "SEG_PAYLOAD_LEN",
    "SEG_SYM",
    "SEG_BOOK",
    "SEG_COLUMNS",
    "PR_BITS",
    "PR_COUNT",
    "PR_SYM",
    "PR_M",
    "PR_CDIV",
    "PR_CMOD",
    "PR_GROUPS",
    "PR_CODER",
    "PR_CG",
    "PR_CG_ROWS",
    "PR_CP",
    "PR_DIMS",
    "PR_NDIMS",
    "PR_FORMS",
    "PR_NFORMS",
    "PR_RAW",
    "PR_PAY",
    "PR_COLUMNS",
    "LIM_MAX_LEVEL",
    "LIM_WEIGHT_BITS",
    "LIM_PREC",
    "LIM_MAX_RESIDUAL",
    "LIM_MAX_TABLE_ENTRIES",
    "LIM_MAX_TABLE_MODELS",
    "LIM_PER_BYTE",
    "LIM_LANE_RUN",
    "LIM_NO_LANE_RUN",
    "LIM_STEPS",
    "KIND_UNIFORM",
    "KIND_BF16",
    "KIND_FP8",
    "KIND_CODEBOOK",
    "CB_MINMAX",
    "CB_LLOYD",
    "GRID_CODES",
    "ENC_X",
    "ENC_FLOAT32",
    "ENC_B",
    "ENC_H",
    "ENC_T",
    "ENC_D",
    "ENC_SEG",
    "ENC_NSEG",
    "ENC_OUT",
    "ENC_LEN",
    "ENC_COLUMNS",
    "DEC_IN",
    "DEC_LEN",
    "DEC_B",
    "DEC_H",
    "DEC_T",
    "DEC_D",
    "DEC_SEG",
    "DEC_NSEG",
    "DEC_OUT",
    "DEC_KIND",
    "DEC_COLUMNS",
    "TR_KIND",
    "TR_A",
    "TR_B",
    "TR_C",
    "TR_COLUMNS",
    "TR_HADAMARD",
    "TR_DELTA",
    "TR_AFFINE",
    "BAD_STATE",
    "BAD_META",
    "BAD_PAYLOAD",
    "BAD_CODEBOOK",
]
