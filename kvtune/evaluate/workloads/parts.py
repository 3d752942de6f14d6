"""A workload's setup split across workers: each builds a part, every one assembles the whole.

A profile's setup is mostly the prefill of its contexts and the uncompressed baseline run on
them (187 s of the default profile's 200 s on one CPU thread). With ``--executor ray
--workers N`` every worker needs the whole of it; instead of each one computing it all, worker
``i`` computes the batches ``b`` with ``b % parts == i`` (:class:`CapturedBatch`), the parts
travel through Ray's object store (numpy arrays: shared, not copied, between the actors of one
machine), and each worker assembles the capture and the baseline from all of them
(:func:`assemble_capture`, :func:`assemble_baseline`).

Batches are the workload's own forward batches (prefill and continuation alike), so an
assembled setup is bitwise the one a single process computes.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from kvtune.core.errors import KvtuneError
from kvtune.evaluate.capture import Capture
from kvtune.evaluate.metrics import ContinuationBaseline

__all__ = ["CapturedBatch", "PartError", "array_to_tensor", "assemble_baseline", "assemble_capture",
           "batches_of_part", "layout", "ordered_batches", "rows_problem", "tensor_to_array"]


class PartError(KvtuneError):
    """Setup parts that do not make up this run's contexts (missing, overlapping or other
    token ids: parts built with other settings)."""


def tensor_to_array(t: torch.Tensor) -> np.ndarray:
    """A CPU tensor as a numpy array sharing its memory; bfloat16 (no numpy dtype) as its
    int16 bit pattern (:func:`array_to_tensor` reads it back)."""
    t = t.detach().cpu().contiguous()
    return t.view(torch.int16).numpy() if t.dtype == torch.bfloat16 else t.numpy()


def array_to_tensor(a: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """The tensor of ``dtype`` that :func:`tensor_to_array` turned into ``a`` (sharing its
    memory; ``a`` may be read-only, e.g. in Ray's object store: never write to the result)."""
    with warnings.catch_warnings():  # a read-only buffer is fine: the result is only read
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        t = torch.from_numpy(a)
    return t.view(torch.bfloat16) if dtype == torch.bfloat16 else t


@dataclass(frozen=True)
class CapturedBatch:
    """The prefill KV and the baseline of contexts ``start:stop`` (one forward batch).

    Attributes:
        start, stop: context indices.
        input_ids: ``(stop - start, T + C)`` int64 token ids; context_tokens: T.
        kv: per layer ``(K, V)`` arrays ``(stop - start, kv_heads, tokens, head_dim)`` in the
            storage dtype (:func:`tensor_to_array`).
        storage_dtype: the stored KV's torch dtype name (``"bfloat16"``, ``"float32"``...).
        model_dtype: the dtype the KV is used in.
        baseline: the :class:`~kvtune.evaluate.metrics.ContinuationBaseline` fields as arrays:
            ``logp`` ``(n, C, vocab)`` float32, ``argmax`` ``(n, C)`` and ``targets``
            ``(n, C - 1)`` int64, ``nll`` ``(n, C - 1)`` float32.
    """

    start: int
    stop: int
    input_ids: np.ndarray
    context_tokens: int
    kv: tuple[tuple[np.ndarray, np.ndarray], ...]
    storage_dtype: str
    model_dtype: str
    baseline: dict[str, np.ndarray]

    @classmethod
    def of(cls, start: int, cap: Capture, base: ContinuationBaseline) -> "CapturedBatch":
        """Contexts ``start:start + cap.num_contexts`` from their capture and baseline."""
        storage = cap.kv[0][0].dtype
        model = cap.dtype or storage
        base = base.loaded()
        return cls(start=start, stop=start + cap.num_contexts, input_ids=cap.input_ids.numpy(),
                   context_tokens=cap.context_tokens,
                   kv=tuple((tensor_to_array(k), tensor_to_array(v)) for k, v in cap.kv),
                   storage_dtype=str(storage).removeprefix("torch."), model_dtype=str(model).removeprefix("torch."),
                   baseline={f: tensor_to_array(getattr(base, f)) for f in ("logp", "argmax", "targets", "nll")})

    def baseline_rows(self) -> ContinuationBaseline:
        """The batch's baseline as tensors (sharing the arrays' memory)."""
        b = self.baseline
        return ContinuationBaseline(logp=array_to_tensor(b["logp"], torch.float32),
                                    argmax=array_to_tensor(b["argmax"], torch.int64),
                                    targets=array_to_tensor(b["targets"], torch.int64),
                                    nll=array_to_tensor(b["nll"], torch.float32))


def batches_of_part(n: int, batch_size: int, index: int, count: int) -> list[tuple[int, int]]:
    """``(start, stop)`` of the batches of part ``index`` of ``count``: batch ``b`` (contexts
    ``b * batch_size`` onwards, ``n`` in all) belongs to part ``b % count``.

    Raises:
        ValueError: ``count < 1`` or ``index`` not in ``range(count)``.
    """
    if count < 1 or not 0 <= index < count:
        raise ValueError(f"part {index} of {count}")
    return [(a, min(a + batch_size, n)) for b, a in enumerate(range(0, n, batch_size)) if b % count == index]


def layout(b: CapturedBatch) -> tuple:
    """What every batch of one setup shares: T, the dtypes and each layer's K and V shapes
    without the context dimension."""
    return (b.context_tokens, b.storage_dtype, b.model_dtype, tuple((k.shape[1:], v.shape[1:]) for k, v in b.kv))


def rows_problem(b: CapturedBatch) -> str | None:
    """Which of ``b``'s arrays does not hold one row per context ``start:stop`` (KV along its
    context axis, the baseline arrays along their first), or ``None``."""
    n = b.stop - b.start
    arrays = [(f"layer {i} {kind}", a) for i, pair in enumerate(b.kv) for kind, a in zip("KV", pair)]
    arrays += [(f"baseline {f}", b.baseline.get(f)) for f in ("logp", "argmax", "targets", "nll")]
    for name, a in arrays:
        if not isinstance(a, np.ndarray) or a.ndim == 0 or a.shape[0] != n:
            return f"{name} holds {getattr(a, 'shape', None)}, not {n} rows"
    return None


def ordered_batches(parts: Iterable[Sequence[CapturedBatch]], input_ids: torch.Tensor,
                    context_tokens: int) -> list[CapturedBatch]:
    """The batches of all ``parts`` in context order, checked to hold exactly the contexts
    ``input_ids`` ``(N, T + C)`` once each, cut at ``context_tokens`` (T), with one KV layout.

    Raises:
        PartError: a context missing or held twice, token ids other than ``input_ids``, another
            T, arrays without one row per context (:func:`rows_problem`), or batches whose KV
            dtypes or shapes differ.
    """
    batches = sorted((b for part in parts for b in part), key=lambda b: b.start)
    n, at = int(input_ids.shape[0]), 0
    for b in batches:
        if b.start != at or b.stop > n or b.stop <= b.start:
            raise PartError(f"setup parts hold contexts {b.start}:{b.stop} where context {at} of {n} was expected")
        if b.context_tokens != context_tokens or not np.array_equal(b.input_ids, input_ids[b.start : b.stop].numpy()):
            raise PartError(f"setup part with contexts {b.start}:{b.stop} was built from other token ids or "
                            f"context tokens ({b.context_tokens}, not {context_tokens}: other settings or data)")
        problem = rows_problem(b)
        if problem:
            raise PartError(f"setup part with contexts {b.start}:{b.stop}: {problem}")
        if layout(b) != layout(batches[0]):
            raise PartError(f"setup part with contexts {b.start}:{b.stop} holds KV of another dtype or shape "
                            f"than contexts 0:{batches[0].stop}")
        at = b.stop
    if at != n:
        raise PartError(f"setup parts hold {at} of the {n} contexts")
    return batches


def assemble_capture(batches: Sequence[CapturedBatch], input_ids: torch.Tensor, context_tokens: int,
                     device: torch.device | str = "cpu") -> Capture:
    """The :class:`~kvtune.evaluate.capture.Capture` of all contexts (without baseline logits)
    from :func:`ordered_batches`' batches: KV storage allocated once on ``device`` (the
    model's, where :func:`~kvtune.evaluate.capture.capture` keeps it), each batch copied in."""
    first = batches[0]
    storage, model = getattr(torch, first.storage_dtype), getattr(torch, first.model_dtype)
    n = int(input_ids.shape[0])
    kv = [(torch.empty((n, *k.shape[1:]), dtype=storage, device=device),
           torch.empty((n, *v.shape[1:]), dtype=storage, device=device)) for k, v in first.kv]
    for b in batches:
        for (sk, sv), (k, v) in zip(kv, b.kv):
            sk[b.start : b.stop].copy_(array_to_tensor(k, storage))
            sv[b.start : b.stop].copy_(array_to_tensor(v, storage))
    return Capture(input_ids=input_ids, context_tokens=context_tokens, kv=kv, baseline_logits=torch.empty(0),
                   dtype=model)


def assemble_baseline(batches: Sequence[CapturedBatch], *, spool: bool = True) -> ContinuationBaseline:
    """The baseline of all contexts from :func:`ordered_batches`' batches (log-probabilities
    spooled to disk with ``spool``: :meth:`~kvtune.evaluate.metrics.ContinuationBaseline.from_batches`).

    Raises:
        SpoolError: the temporary file cannot hold them.
    """
    return ContinuationBaseline.from_batches((b.baseline_rows() for b in batches), batches[-1].stop, spool=spool)
