"""Float8 quantizer ``fp8``: cast to ``float8_e4m3fn`` or ``float8_e5m2`` (8 bits per element).

The trivial baseline of KV-cache compression (vLLM's ``kv_cache_dtype="fp8"``): every value is
rounded to the nearest float8 (round-to-nearest-even, torch's cast), after saturating to the
format's largest finite value (e4m3: +-448, e5m2: +-57344; torch's e5m2 cast would otherwise
give +-inf). The symbol is the float8 bit pattern (uint8).

Optional per-token scaling (``scaled = True``): each token's ``head_dim`` vector is divided by
``s = absmax / fp8_max`` (rounded *up* to float16, so the absmax maps to at most ``fp8_max``)
before the cast and multiplied back after it; ``s`` travels as float16 metadata of shape
``(batch, heads, tokens)`` (``16 / head_dim`` bits per element, 0.25 at head_dim 64). An
all-zero token gets ``s = 0`` and decodes to zeros. With scaling, a token whose absmax exceeds
``65504 * fp8_max`` (its scale would saturate) is refused at encode
(:attr:`FP8Quantizer.value_limit`); unscaled, values beyond ``fp8_max`` saturate as said above.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping

import torch

from kvtune.codecs.base import MetaField, Quantizer, param, register_quantizer
from kvtune.codecs.quantizers import FP16_MAX, div_exact, fp16_round_up

__all__ = ["FP8Quantizer", "FP8_DTYPES", "fp8_max", "fp8_encode", "fp8_decode", "fp8_token_scale"]

FP8_DTYPES: dict[str, torch.dtype] = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


def fp8_max(fmt: str) -> float:
    """Largest finite value of the format: 448 (e4m3) or 57344 (e5m2)."""
    return float(torch.finfo(FP8_DTYPES[fmt]).max)


def fp8_encode(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """float32 -> uint8 float8 bit patterns (saturating, round-to-nearest-even)."""
    m = fp8_max(fmt)
    return x.clamp(-m, m).to(FP8_DTYPES[fmt]).view(torch.uint8)


def fp8_decode(symbols: torch.Tensor, fmt: str) -> torch.Tensor:
    """uint8 float8 bit patterns -> float32 values."""
    return symbols.contiguous().view(FP8_DTYPES[fmt]).to(torch.float32)


def fp8_token_scale(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """float16 per-token scale ``absmax / fp8_max`` rounded up, shape ``x.shape[:-1]``."""
    return fp16_round_up(div_exact(x.abs().amax(dim=-1), fp8_max(fmt)))


@register_quantizer("fp8")
@dataclass(frozen=True)
class FP8Quantizer(Quantizer):
    """Cast to float8 (``e4m3`` or ``e5m2``), optionally with a float16 per-token absmax scale.

    Cost: 8 bits per element, plus ``16 / head_dim`` when ``scaled``. Quantize -> dequantize ->
    quantize is idempotent (the rescaled absmax maps back to ``fp8_max`` exactly).

    Args:
        format: ``"e4m3"`` (4 exponent bits, 3 mantissa bits, max 448) or ``"e5m2"``.
        scaled: divide each token by its absmax / fp8_max before the cast.
    """

    format: str = param("e4m3", choices=tuple(FP8_DTYPES), doc="float8 format")
    scaled: bool = param(False, doc="per-token float16 absmax scale")

    @property
    def symbol_bits(self) -> int:
        return 8

    @property
    def value_limit(self) -> float:
        """Scaled: ``65504 * fp8_max`` (the per-token float16 scale ``absmax / fp8_max`` must not
        saturate). Unscaled: none -- values beyond ``fp8_max`` saturate to it, the documented
        behaviour of the float8 cast (a NaN / inf is still refused)."""
        return FP16_MAX * fp8_max(self.format) if self.scaled else math.inf

    def block_meta_layout(self, shape: tuple[int, ...]) -> tuple[MetaField, ...]:
        """float16 ``scale`` of shape ``shape[:-1]`` when ``scaled``, else nothing."""
        return (MetaField("scale", tuple(shape[:-1]), torch.float16),) if self.scaled else ()

    def quantize_block(self, x: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """uint8 float8 patterns of ``x.shape`` (and the float16 ``scale`` when ``scaled``)."""
        x = x.to(torch.float32)
        if not self.scaled:
            return fp8_encode(x, self.format).contiguous(), {}
        if x.numel() == 0:
            return torch.zeros(x.shape, dtype=torch.uint8), {"scale": torch.zeros(x.shape[:-1], dtype=torch.float16)}
        scale16 = fp8_token_scale(x, self.format)
        s = scale16.to(torch.float32).unsqueeze(-1)
        y = torch.where(s > 0, x / torch.where(s > 0, s, torch.ones_like(s)), torch.zeros_like(x))
        return fp8_encode(y, self.format).contiguous(), {"scale": scale16}

    def dequantize_block(self, symbols: torch.Tensor, meta: Mapping[str, torch.Tensor], shape: tuple[int, ...]) -> torch.Tensor:
        """Float32 values ``fp8(symbols) [* scale]`` of shape ``shape``.

        Raises:
            ValueError: a NaN or inf symbol (e4m3: ``0x7F`` / ``0xFF``; e5m2: exponent bits all
                set): an encoder saturates and writes only finite ones, so it comes from a
                forged stream (the decoder reports it as a corrupt stream of its layer).
        """
        low = symbols.reshape(shape) & 0x7F
        if bool((low >= (0x7C if self.format == "e5m2" else 0x7F)).any()):
            raise ValueError(f"a NaN or inf float8 {self.format} value in a payload; an encoder writes only finite ones")
        x = fp8_decode(symbols.reshape(shape), self.format)
        if self.scaled:
            x = x * meta["scale"].to(torch.float32).reshape(tuple(shape[:-1])).unsqueeze(-1)
        return x

    def short_label(self) -> str:
        """``fp8e4m3`` (unscaled) or ``fp8e4m3/tok`` (per-token scale)."""
        return f"fp8{self.format}" + ("/tok" if self.scaled else "")
