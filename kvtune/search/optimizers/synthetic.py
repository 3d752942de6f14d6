"""A synthetic search problem with a known answer, for testing and benchmarking optimizers.

The real replay table (``full.yaml`` evaluated exhaustively on the real model) is expensive
to produce; this module generates a stand-in with the same structure, so every optimizer can
be judged against the exhaustive answer in seconds:

* parameters: ``transforms`` (identity / hadamard / affine), ``key.bits`` and ``value.bits``
  in {2, 3, 4, 6, 8} (precision increasing), ``key.group_size`` and ``value.group_size`` in
  {32, 64, 128} (precision decreasing), ``codec`` (bitpack / range) and the conditional
  ``codec.model`` (per_channel / per_head, only when ``codec == range``) -- 3 x 5 x 3 x 5 x 3
  x 3 = 2,025 candidates at full size;
* ``compression_ratio`` = 16 bits / mean encoded bits per element, counting the fp16 scale
  and zero point of every group (32 / group_size bits), the affine transform's per-channel
  scales and the entropy coder's saving;
* ``relative_accuracy`` = ``exp(-(e_K + e_V))`` with ``e = A * 4**-bits * sqrt(group/32) *
  t(transform)``: a smooth function, monotone in the precision order, plus a small fixed noise
  per lossy configuration (a lossless codec never changes accuracy, as in the real
  evaluator); ``relative_accuracy_lo`` subtracts an interval half-width that grows with the
  loss;
* ``encode_gbps`` / ``decode_gbps`` from seconds-per-GB costs of the transform, the grouping
  and the codec (the range coder compresses better but is slower), with 5 % noise.

So the problem has a real 3-D front (accuracy vs ratio vs codec latency) and a unique best
feasible ratio at each accuracy floor, both computable exactly from the table.

>>> space, table = synthetic_problem(size="small", seed=0)
>>> len(space), len(table)
(144, 144)
"""

from __future__ import annotations

import hashlib
import itertools
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from kvtune.core.ids import policy_id
from kvtune.search.space import Candidate, Parameter, SearchSpace

__all__ = ["SIZES", "SyntheticPolicy", "synthetic_space", "synthetic_table", "synthetic_problem"]

_SIZES = {
    # name: (transforms, key bits, key groups, value bits, value groups)
    "full": (("identity", "hadamard", "affine"), (2, 3, 4, 6, 8), (32, 64, 128), (2, 3, 4, 6, 8), (32, 64, 128)),
    "medium": (("identity", "hadamard"), (2, 3, 4, 8), (32, 128), (2, 3, 4, 8), (32, 128)),
    "small": (("identity", "hadamard"), (2, 3, 4, 8), (32, 128), (2, 4, 8), (32,)),
}
#: Number of candidates of each size (x 3 codec variants: bitpack, range/per_channel, range/per_head).
SIZES = {"full": 2025, "medium": 384, "small": 144}


@dataclass(frozen=True)
class SyntheticPolicy:
    """Stand-in for :class:`~kvtune.codecs.PolicyConfig`: just an id and a label."""

    policy_id: str
    label: str


def _policy_id(params: dict) -> str:
    """:func:`kvtune.core.ids.policy_id` of ``k=v`` pairs sorted by key and joined by ``;``,
    16 hex characters (the ids of stored synthetic tables)."""
    return policy_id(";".join(f"{k}={params[k]}" for k in sorted(params)), length=16)


def synthetic_space(size: str = "full") -> SearchSpace:
    """The synthetic :class:`SearchSpace` (``full``: 2,025, ``medium``: 384, ``small``: 144
    candidates; see :data:`SIZES`).

    Candidates carry a :class:`SyntheticPolicy` as ``config`` (``policy_id`` and ``label``).
    """
    if size not in _SIZES:
        raise ValueError(f"size must be one of {sorted(_SIZES)}, got {size!r}")
    transforms, kbits, kgroups, vbits, vgroups = _SIZES[size]
    params = [
        Parameter("transforms", "categorical", transforms),
        Parameter("key.bits", "ordinal", kbits, precision="increasing"),
        Parameter("key.group_size", "ordinal", kgroups, precision="decreasing"),
        Parameter("value.bits", "ordinal", vbits, precision="increasing"),
        Parameter("value.group_size", "ordinal", vgroups, precision="decreasing"),
        Parameter("codec", "categorical", ("bitpack", "range")),
        Parameter("codec.model", "categorical", ("per_channel", "per_head"), when=(("codec", ("range",)),)),
    ]
    candidates: list[Candidate] = []
    seen: set[tuple] = set()
    for combo in itertools.product(*(p.values for p in params)):
        full = {p.key: v for p, v in zip(params, combo)}
        active = {p.key: full[p.key] for p in params if p.active(full)}
        key = tuple(sorted(active.items()))
        if key in seen:  # codec.model inactive: bitpack reached twice
            continue
        seen.add(key)
        label = " ".join(f"{k}={v}" for k, v in active.items())
        candidates.append(Candidate(index=len(candidates), params=active,
                                    config=SyntheticPolicy(_policy_id(active), label)))
    return SearchSpace(name=f"synthetic-{size}", path=Path(f"<synthetic-{size}>"),
                       description="synthetic problem with a known answer (kvtune.search.optimizers.synthetic)",
                       parameters=params, fixed={}, candidates=candidates)


# Accuracy model: error weights of keys and values and the transforms' error multipliers.
_A_KEY, _A_VALUE = 2.4, 1.2
_T_KEY = {"identity": 1.0, "hadamard": 0.3, "affine": 0.55}
_T_VALUE = {"identity": 1.0, "hadamard": 0.55, "affine": 0.8}
# Bits saved per element by the entropy coder, and codec / transform costs in s/GB.
_RANGE_SAVING = {"per_channel": 0.45, "per_head": 0.30}
_ENC_S = {"bitpack": 0.25, "per_channel": 3.2, "per_head": 2.2}
_DEC_S = {"bitpack": 0.2, "per_channel": 3.6, "per_head": 2.5}
_TRANSFORM_S = {"identity": 0.0, "hadamard": 0.45, "affine": 0.12}


def _element_bits(bits: int, group: int, codec_model: str | None, *, key: bool) -> float:
    """Encoded bits per element of keys or values: payload - entropy-coder saving + the fp16
    scale and zero point per group (keys also store a 2-byte channel-order entry per group,
    and their outlier channels make entropy coding save 10 % less)."""
    saving = _RANGE_SAVING[codec_model] * bits / (bits + 1) * (0.9 if key else 1.0) if codec_model else 0.0
    return bits - saving + (48.0 if key else 32.0) / group


def synthetic_table(space: SearchSpace, *, seed: int = 0, noise: float = 0.002) -> pd.DataFrame:
    """Evaluate every candidate of a :func:`synthetic_space` (the exhaustive "replay table").

    Args:
        space: a space from :func:`synthetic_space`.
        seed: seeds the accuracy and throughput noise.
        noise: standard deviation of the accuracy noise (fraction), drawn once per lossy
            configuration (transform, bits, group sizes), shared by its codecs.

    Returns:
        One row per candidate, in enumeration order: ``policy_id``, ``label``,
        ``relative_accuracy``, ``relative_accuracy_lo``, ``relative_accuracy_hi`` (fractions),
        ``compression_ratio``, ``encode_gbps``, ``decode_gbps`` (GB/s of original bf16 KV).
    """
    rows = []
    for c in space.candidates:
        p = c.params
        tr = p["transforms"]
        kb, kg = p["key.bits"], p["key.group_size"]
        vb, vg = p["value.bits"], p["value.group_size"]
        model = p.get("codec.model")
        lossy = (tr, kb, kg, vb, vg)
        lossy_seed = int.from_bytes(hashlib.sha256(f"{seed}:{lossy}".encode()).digest()[:8], "little")
        lrng = np.random.default_rng(lossy_seed)
        crng = np.random.default_rng(int(c.policy_id, 16) ^ seed)
        e_k = _A_KEY * 4.0 ** (-kb) * math.sqrt(kg / 32) * _T_KEY[tr]
        e_v = _A_VALUE * 4.0 ** (-vb) * math.sqrt(vg / 32) * _T_VALUE[tr]
        acc = math.exp(-(e_k + e_v)) + noise * float(lrng.standard_normal())
        half = 0.003 + 0.15 * max(0.0, 1.0 - acc)
        extra = 0.06 if tr == "affine" else 0.0
        bits = (_element_bits(kb, kg, model, key=True) + _element_bits(vb, vg, model, key=False)) / 2 + extra
        ratio = 16.0 / bits
        codec_key = model or "bitpack"
        group_s = 0.05 * (32 / min(kg, vg))
        enc_s = (_ENC_S[codec_key] + _TRANSFORM_S[tr] + group_s) * float(np.exp(0.05 * crng.standard_normal()))
        dec_s = (_DEC_S[codec_key] + _TRANSFORM_S[tr] + group_s) * float(np.exp(0.05 * crng.standard_normal()))
        rows.append({"policy_id": c.policy_id, "label": c.config.label, "relative_accuracy": acc,
                     "relative_accuracy_lo": acc - half, "relative_accuracy_hi": acc + half,
                     "compression_ratio": ratio, "encode_gbps": 1.0 / enc_s, "decode_gbps": 1.0 / dec_s})
    return pd.DataFrame(rows)


def synthetic_problem(size: str = "full", *, seed: int = 0) -> tuple[SearchSpace, pd.DataFrame]:
    """``(space, exhaustive table)`` of the synthetic problem (see the module docstring)."""
    space = synthetic_space(size)
    return space, synthetic_table(space, seed=seed)
