"""The KV tensors the codecs accept and produce: dtypes and their wire names, and the checks
shared by the reference pipeline (:mod:`kvtune.codecs.policy`) and the fast path
(:mod:`kvtune.codecs.fastpath`), so that both refuse the same inputs with the same messages.
"""

from __future__ import annotations

import torch

from kvtune.codecs.quantizers import BF16_MAX, FP16_MAX

__all__ = ["DTYPE_NAMES", "NAME_DTYPES", "NON_FINITE", "DTYPE_MAX", "to_output_dtype"]

DTYPE_NAMES: dict[torch.dtype, str] = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
"""Supported KV dtypes and their names in the stream header (:data:`kvtune.codecs.stream.DTYPES`)."""

NAME_DTYPES: dict[str, torch.dtype] = {v: k for k, v in DTYPE_NAMES.items()}
"""Inverse of :data:`DTYPE_NAMES`."""

NON_FINITE = "has non-finite values (NaN or inf); a KV cache with them cannot be quantized meaningfully"
"""Tail of the error raised for a KV tensor with NaN / inf (same text on both paths)."""

DTYPE_MAX: dict[torch.dtype, float] = {torch.float32: float(torch.finfo(torch.float32).max), torch.bfloat16: BF16_MAX,
                                       torch.float16: FP16_MAX}
"""Largest finite value of each supported dtype."""


def to_output_dtype(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A decoded float32 tensor in the dtype of the encoded input.

    float16 saturates at +-65504: the input was a finite float16, so moving a decoded value
    that lies beyond (bfloat16 rounding of 65504 is 65536; a float16 scale rounded up can
    overshoot) to the nearest finite float16 only brings it closer to the input, where a plain
    cast would give inf. Other dtypes are a plain cast.
    """
    if dtype == torch.float16:
        x = x.clamp(-FP16_MAX, FP16_MAX)
    return x.to(dtype)
