"""SCD calibration: fit the per-layer Reuse and Patch maps on real calibration prefixes.

SCD ("Semantic Cache Distillation: Efficient State Transfer via Reuse and Selective Patching",
arXiv 2606.07684), "Reuse" and "Patch". Both models prefill the same
calibration token windows; per layer l, with N calibration tokens:

- Reuse map: producer's normalized pre-attention input ``x_l^A (N, hidden)`` -> consumer's
  pre-RoPE ``[K_l^B, V_l^B] (N, 2 * kv_heads * head_dim)``, fitted at full rank; a
  configuration truncates it to its rank r_l (:meth:`LowRankMap.truncate` is exactly the
  reduced-rank solution at r_l). The consumer applies RoPE itself.
- Patch map: producer's residual input ``h_l^A (N, hidden)`` -> consumer's residual input
  ``h_l^B``; the consumer then applies its own ``input_layernorm`` (so what it computes K/V
  from is its normalized pre-attention input, predicted) and its own K/V projections.
  A linear map straight to the normalized input would be equivalent to a Reuse map (K/V
  are linear in it); going through the consumer's RMSNorm makes Patch a different,
  non-linear predictor.

Transition layers are where the Reuse reconstruction error jumps: the error of the rank-r
map per layer (relative squared error on the calibration tokens, :func:`relative_error`) and
its increase over the previous layer; :meth:`SCDCalibration.transition_layers` ranks layers
by that jump.

Artifacts (:meth:`SCDCalibration.save`): ``scd_maps.pt`` (``torch.save`` of every map in
float32, loaded back with ``weights_only=True``) plus a JSON summary; :meth:`SCDCalibration.artifact_bytes` gives the bytes
each side must store (producer: encoders; consumer: decoders).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from kvtune.core.atomic import atomic_path, atomic_write_text
from kvtune.core.errors import ConfigError
from kvtune.evaluate.model import LoadedModel
from kvtune.methods.scd.lowrank import LowRankMap, fit_low_rank_map, relative_error
from kvtune.methods.scd.states import capture_states, check_same_architecture


@dataclass
class SCDCalibration:
    """Fitted maps of one producer/consumer pair.

    Attributes:
        reuse: per layer, full-rank :class:`LowRankMap` ``x^A (hidden) -> [K^B, V^B] pre-RoPE``.
        patch: per layer, full-rank :class:`LowRankMap` ``h^A (hidden) -> h^B (hidden)``.
        reuse_error: ``{rank: [per-layer relative error]}`` on the calibration tokens.
        patch_error: ``{rank: [per-layer relative error of the consumer K/V computed from the
            predicted residual]}``.
        kv_drift: per layer, relative error of using the producer's own pre-RoPE K/V as the
            consumer's (what ``raw`` transfer does).
        tokens: calibration tokens N.
        ridge: relative ridge strength used.
        meta: JSON-able provenance (models, data, windows).
    """

    reuse: list[LowRankMap]
    patch: list[LowRankMap]
    reuse_error: dict[int, list[float]] = field(default_factory=dict)
    patch_error: dict[int, list[float]] = field(default_factory=dict)
    kv_drift: list[float] = field(default_factory=list)
    tokens: int = 0
    ridge: float = 0.0
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def num_layers(self) -> int:
        return len(self.reuse)

    def transition_layers(self, rank: int, count: int) -> tuple[int, ...]:
        """The ``count`` layers whose rank-``rank`` Reuse error jumps most over the layer before
        (layer 0 jumps from 0), sorted ascending."""
        if count <= 0:
            return ()
        err = self.reuse_error.get(rank)
        if err is None:
            raise ConfigError(f"no calibration error at rank {rank}; known ranks {sorted(self.reuse_error)}")
        jumps = [err[0]] + [err[i] - err[i - 1] for i in range(1, len(err))]
        order = sorted(range(len(err)), key=lambda i: -jumps[i])
        return tuple(sorted(order[:count]))

    def artifact_bytes(self) -> dict[str, int]:
        """Bytes each side stores (float32 maps): ``producer``, ``consumer``, ``total``."""
        prod = sum(m.producer_nbytes() for m in self.reuse + self.patch)
        cons = sum(m.consumer_nbytes() for m in self.reuse + self.patch)
        return {"producer": prod, "consumer": cons, "total": prod + cons}

    def summary(self) -> dict[str, Any]:
        return {
            "tokens": self.tokens,
            "ridge": self.ridge,
            "num_layers": self.num_layers,
            "reuse_error": {str(r): v for r, v in self.reuse_error.items()},
            "patch_error": {str(r): v for r, v in self.patch_error.items()},
            "kv_drift": self.kv_drift,
            "artifact_bytes": self.artifact_bytes(),
            **self.meta,
        }

    def save(self, folder: Path) -> dict[str, Any]:
        """Write ``scd_maps.pt`` and ``scd_calibration.json`` atomically; return file sizes in bytes."""
        folder = Path(folder)
        state = {
            "reuse": [m.state_dict() for m in self.reuse],
            "patch": [m.state_dict() for m in self.patch],
            "summary": self.summary(),
        }
        with atomic_path(folder / "scd_maps.pt") as tmp:
            torch.save(state, tmp)
        atomic_write_text(folder / "scd_calibration.json", json.dumps(self.summary(), indent=2))
        return {"scd_maps.pt": (folder / "scd_maps.pt").stat().st_size,
                "scd_calibration.json": (folder / "scd_calibration.json").stat().st_size}

    @classmethod
    def load(cls, folder: Path) -> "SCDCalibration":
        state = torch.load(Path(folder) / "scd_maps.pt", weights_only=True)
        s = state["summary"]
        return cls(
            reuse=[LowRankMap(**d) for d in state["reuse"]],
            patch=[LowRankMap(**d) for d in state["patch"]],
            reuse_error={int(r): v for r, v in s["reuse_error"].items()},
            patch_error={int(r): v for r, v in s["patch_error"].items()},
            kv_drift=s["kv_drift"], tokens=s["tokens"], ridge=s["ridge"],
        )


def _kv_pre_from_hidden(consumer: LoadedModel, layer: int, hidden: torch.Tensor) -> torch.Tensor:
    """``(N, 2 * kv_heads * head_dim)`` consumer pre-RoPE [K, V] computed from a residual stream."""
    from kvtune.methods.scd.states import decoder_layers

    lay = decoder_layers(consumer)[layer]
    with torch.inference_mode():
        x = lay.input_layernorm(hidden.to(next(consumer.model.parameters()).dtype))
        return torch.cat([lay.self_attn.k_proj(x), lay.self_attn.v_proj(x)], dim=-1).float()


def calibrate(producer: LoadedModel, consumer: LoadedModel, windows: list[list[int]], *,
              ranks: tuple[int, ...] = (8, 16, 32, 64, 128), ridge: float = 1e-4,
              progress: Callable[[str], None] | None = None) -> SCDCalibration:
    """Fit the Reuse and Patch maps of every layer on calibration token windows.

    Args:
        producer, consumer: the pair (same architecture, see :func:`check_same_architecture`).
        windows: calibration token-id windows (each prefilled at batch 1, positions from 0).
        ranks: ranks at which per-layer errors are recorded (for transition layers and the report).
        ridge: relative ridge strength (see :func:`kvtune.methods.scd.lowrank.ridge_solution`).

    Returns:
        :class:`SCDCalibration`.

    Raises:
        ConfigError: the windows hold no more tokens (calibration rows) than the largest rank
            (a rank-r map needs more than r rows), or rows a map cannot be fitted on
            (:func:`~kvtune.methods.scd.lowrank.fit_low_rank_map`).
    """
    rows = sum(len(w) for w in windows)
    if ranks and rows <= max(ranks):
        raise ConfigError(f"{rows} calibration rows (tokens in {len(windows)} windows) are too few for rank "
                          f"{max(ranks)}: a rank-r map needs more than r rows")
    check_same_architecture(producer, consumer)
    prod = [capture_states(producer, w) for w in windows]
    cons = [capture_states(consumer, w) for w in windows]
    n_layers = producer.num_layers
    reuse, patch, drift = [], [], []
    reuse_err: dict[int, list[float]] = {r: [] for r in ranks}
    patch_err: dict[int, list[float]] = {r: [] for r in ranks}
    for layer in range(n_layers):
        x = torch.cat([s.normed[layer] for s in prod])
        h_a = torch.cat([s.hidden[layer] for s in prod])
        h_b = torch.cat([s.hidden[layer] for s in cons])
        y = torch.cat([torch.cat([s.k_pre[layer], s.v_pre[layer]], dim=-1) for s in cons])
        y_a = torch.cat([torch.cat([s.k_pre[layer], s.v_pre[layer]], dim=-1) for s in prod])
        drift.append(relative_error(y_a, y))
        m = fit_low_rank_map(x, y, ridge=ridge)
        p = fit_low_rank_map(h_a, h_b, ridge=ridge)
        reuse.append(m)
        patch.append(p)
        for r in ranks:
            if r <= m.rank:
                reuse_err[r].append(relative_error(m.truncate(r)(x), y))
            if r <= p.rank:
                patch_err[r].append(relative_error(_kv_pre_from_hidden(consumer, layer, p.truncate(r)(h_a)), y))
        if progress:
            progress(f"layer {layer}: drift {drift[-1]:.3f}, reuse err@{ranks[0]} {reuse_err[ranks[0]][-1]:.3f}")
    return SCDCalibration(
        reuse=reuse, patch=patch, reuse_error={r: v for r, v in reuse_err.items() if v},
        patch_error={r: v for r, v in patch_err.items() if v}, kv_drift=drift,
        tokens=sum(len(w) for w in windows), ridge=ridge,
        meta={"producer": producer.name, "consumer": consumer.name, "windows": len(windows),
              "window_tokens": [len(w) for w in windows]},
    )
