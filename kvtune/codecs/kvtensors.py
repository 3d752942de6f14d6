"""The KV tensors the codecs accept and produce: dtypes and their wire names, and the checks
shared by the reference pipeline (:mod:`kvtune.codecs.policy`) and the fast path
(:mod:`kvtune.codecs.fastpath`), so that both refuse the same inputs with the same messages.
"""

from __future__ import annotations

import torch

__all__ = ["DTYPE_NAMES", "NAME_DTYPES", "NON_FINITE"]

DTYPE_NAMES: dict[torch.dtype, str] = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
"""Supported KV dtypes and their names in the stream header (:data:`kvtune.codecs.stream.DTYPES`)."""

NAME_DTYPES: dict[str, torch.dtype] = {v: k for k, v in DTYPE_NAMES.items()}
"""Inverse of :data:`DTYPE_NAMES`."""

NON_FINITE = "has non-finite values (NaN or inf); a KV cache with them cannot be quantized meaningfully"
"""Tail of the error raised for a KV tensor with NaN / inf (same text on both paths)."""
