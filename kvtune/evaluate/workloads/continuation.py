"""``continuation``: long-form essays, teacher-forced continuation (the workload of step 1).

Each sample is a window of ``context_tokens`` real essay tokens (prefill side, compressed)
followed by ``continuation_tokens`` held-out tokens fed teacher-forced on the decode side.
The task score is the geometric-mean probability of the real continuation tokens,
``exp(-mean NLL) = 1 / perplexity``, so relative accuracy is the perplexity ratio
``ppl_original / ppl_decoded`` (:mod:`kvtune.evaluate.metrics`); KL divergence and top-1
agreement against the original run are reported with it.

The continuation is teacher-forced at both fidelities: ``cheap`` only uses fewer contexts.
Contexts are batched (all have the same length), so this workload keeps its own
:meth:`evaluate`; ``full`` on a capture of N contexts gives exactly the numbers of the
former ``ContinuationEvaluator``.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from kvtune.evaluate.assets import read_texts
from kvtune.codecs import PolicyConfig, original_nbytes
from kvtune.core.errors import KvtuneError
from kvtune.evaluate.capture import Capture, build_calibration_contexts, build_contexts, capture, logits_on_cache
from kvtune.evaluate.metrics import (
    ContinuationBaseline,
    bootstrap_relative_accuracy,
    continuation_token_stats,
    summarize_continuation,
)
from kvtune.evaluate.model import KVLayers, LoadedModel
from kvtune.codecs.select import selecting_transform
from kvtune.evaluate.workloads.base import Sample, Workload, checked_kv_dtype, check_selection_fits, encode_decode, register
from kvtune.evaluate.workloads.parts import (
    CapturedBatch,
    assemble_baseline,
    assemble_capture,
    batches_of_part,
    ordered_batches,
)
from kvtune.evaluate.workloads.settings import WorkloadSettings, checked_settings


def roundtrip_contexts(cap: Capture, config: PolicyConfig, lm: LoadedModel) -> tuple[KVLayers, dict[str, Any]]:
    """Encode and decode every context's KV of ``cap`` through ``config``, one stream per context.

    Returns:
        ``(decoded, stats)``: decoded per-layer ``(N, kv_heads, tokens, head_dim)`` tensors on
        the model's device in the model dtype (``tokens``: the kept ones with ``keep``), and
        stats with ``stream_bytes``,
        ``original_bytes`` (bf16 size of the same KV), and ``encode_gbps``/``decode_gbps``
        lists (one per context).
    """
    buffers = DecodeBuffers.like(cap, cap.num_contexts, lm.device)
    stats = RoundtripStats()
    for i in range(cap.num_contexts):
        stats.add(lm, cap.context_kv(i), config, buffers, i)
    return buffers.rows(cap.num_contexts), stats.as_dict()


@dataclass
class RoundtripStats:
    """Bytes and codec speeds of a policy's round trips, one context at a time."""

    stream_bytes: int = 0
    original_bytes: int = 0
    encode_gbps: list[float] = field(default_factory=list)
    decode_gbps: list[float] = field(default_factory=list)

    def add(self, lm: LoadedModel, kv: KVLayers, config: PolicyConfig, buffers: "DecodeBuffers", row: int) -> None:
        """Encode ``kv`` (one context, model dtype), decode it from the bytes alone into row
        ``row`` of ``buffers``, count it.

        A policy that keeps every token decodes straight into the row (``decode_kv(out=...)``,
        as a serving engine fills its KV cache blocks): the timed decode is the one the codec
        benchmark judges, and no copy follows it. A token-selecting one (``keep``) decodes
        fresh ``(1, kv_heads, kept, head_dim)`` tensors, copied into the row's first ``kept``
        tokens after the timing. Measured (2-vCPU AMD EPYC Zen 5, 2026-12-05): on bf16 KV of the
        default model, 8 copies of one context in turn, ``kivi-2`` encoded / decoded at 11.9 /
        16.8 GB/s into fresh tensors, 7.0 / 10.8 GB/s with a copy after each round trip and 12.9
        / 17.9 GB/s into the buffers (one-off script, 2 threads); inside a profile (``--space
        presets``, 8 contexts, float32 KV) no gain showed: the bit-packed presets without
        ``keep`` measured 2.4-6.7 GB/s to encode and 4.4-10.0 GB/s to decode in one run of the
        copying code and two of this one, in no order.
        """
        out = buffers.row(row) if selecting_transform(config) is None else None
        decoded, stream, t_enc, t_dec = encode_decode(lm, kv, config, out=out)
        if out is None:
            buffers.put(row, decoded)
        b = original_nbytes(kv)
        self.encode_gbps.append(b / t_enc / 1e9)
        self.decode_gbps.append(b / t_dec / 1e9)
        self.stream_bytes += len(stream)
        self.original_bytes += b

    def as_dict(self) -> dict[str, Any]:
        return {"stream_bytes": self.stream_bytes, "original_bytes": self.original_bytes,
                "encode_gbps": self.encode_gbps, "decode_gbps": self.decode_gbps}


class DecodeBuffers:
    """Decoded KV of up to ``rows`` contexts, allocated once and refilled for every policy.

    A token-selecting policy (``keep``) decodes fewer tokens than the capture holds: its rows
    fill the first ``kept`` tokens of each layer and :meth:`rows` gives views of that length.

    Attributes:
        kv: per layer ``(rows, kv_heads, tokens, head_dim)`` in the model dtype on the model's device.
        lengths: per layer the tokens of the rows last put (the capture's at first).
    """

    def __init__(self, kv: KVLayers) -> None:
        self.kv = kv
        self.lengths = [int(k.shape[2]) for k, _ in kv]

    @classmethod
    def like(cls, cap: Capture, rows: int, device: torch.device) -> "DecodeBuffers":
        """Buffers shaped like ``cap``'s KV with ``rows`` contexts (model dtype, on ``device``)."""
        dtype = cap.dtype or cap.kv[0][0].dtype
        return cls([(torch.empty((rows, *k.shape[1:]), dtype=dtype, device=device),
                     torch.empty((rows, *v.shape[1:]), dtype=dtype, device=device)) for k, v in cap.kv])

    def put(self, row: int, decoded: KVLayers) -> None:
        """Copy one context's decoded KV (per layer ``(1, kv_heads, tokens, head_dim)``, at most
        the buffer's tokens) into the first ``tokens`` positions of ``row``; the rows read
        together by :meth:`rows` must have been put with the same lengths."""
        for i, ((bk, bv), (k, v)) in enumerate(zip(self.kv, decoded)):
            t = int(k.shape[2])
            bk[row, :, :t].copy_(k[0])
            bv[row, :, :t].copy_(v[0])
            self.lengths[i] = t

    def row(self, row: int) -> KVLayers:
        """Row ``row`` whole, per layer ``(1, kv_heads, tokens, head_dim)`` contiguous views to
        decode into (``decode_kv(out=...)``); every layer's length becomes the buffer's tokens,
        so the rows read together by :meth:`rows` must all be filled this way."""
        self.lengths = [int(k.shape[2]) for k, _ in self.kv]
        return [(k[row : row + 1], v[row : row + 1]) for k, v in self.kv]

    def rows(self, n: int) -> KVLayers:
        """The first ``n`` rows, each layer cut to its last put length (views)."""
        return [(k[:n, :, :t], v[:n, :, :t]) for (k, v), t in zip(self.kv, self.lengths)]


class LazyContexts(Sequence):
    """``workload.kv``: each context's KV in the model dtype, built on access from the capture
    (per layer ``(1, kv_heads, tokens, head_dim)``; copies when the capture stores bf16)."""

    def __init__(self, cap: Capture) -> None:
        self.cap = cap

    def __len__(self) -> int:
        return self.cap.num_contexts

    def __getitem__(self, i):  # type: ignore[override]
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        if not -len(self) <= i < len(self):
            raise IndexError(i)
        return self.cap.context_kv(i % len(self))


@register
class ContinuationWorkload(Workload):
    """Teacher-forced continuation of real essay windows.

    Data: ``--text`` (a named text asset, a ``.txt`` file or a folder of them); windows of
    ``context_tokens + continuation_tokens`` tokens at evenly spaced offsets of the
    concatenated documents (:func:`~kvtune.evaluate.capture.build_contexts`).

    Samples: ``--samples`` (default: ``--contexts``, 24); cheap: the first
    ``--cheap-samples`` (default 8).

    Row metrics: ``ppl_ratio``, ``kl_mean`` (nats per position), ``top1_agreement``,
    ``nll`` / ``nll_base`` (nats per token); ``score`` = ``exp(-nll)``.

    Memory: the captured KV (bf16 storage with ``kv_dtype="bfloat16"``), and per evaluation
    one batch of :attr:`batch_size` decoded contexts (a buffer allocated once), its logits and
    its rows of the baseline's log-probabilities, which are kept in an unlinked temporary file
    (``N * C * vocab * 4`` bytes, :mod:`kvtune.evaluate.spool`); see :mod:`kvtune.evaluate.memory`. ``cap``: an existing capture to use (its baseline logits,
    if any, are not used: the baseline is computed in this workload's batches). ``parts``: the
    setup built in parts by :meth:`build_part` (on several workers), assembled instead of
    computed (:mod:`kvtune.evaluate.workloads.parts`; raises its ``PartError`` when they do
    not make up these settings' contexts).
    """

    name = "continuation"
    description = "essay windows, teacher-forced continuation (perplexity ratio, KL, top-1 agreement)"
    default_samples = 24
    default_cheap_samples = 8
    #: Contexts per continuation forward pass (baseline and evaluations alike).
    batch_size = 4
    score_names = {"cheap": "continuation_token_prob", "full": "continuation_token_prob"}
    evaluates_selection = True

    def __init__(self, lm: LoadedModel, *, settings: WorkloadSettings, progress: Callable[[int], None] | None = None,
                 cap: Capture | None = None, parts: Sequence[Sequence[CapturedBatch]] | None = None) -> None:
        self.lm = lm
        self.settings = checked_settings(settings)
        self.kv_dtype = checked_kv_dtype(settings.kv_dtype)
        self.max_new_tokens = 0
        self.source = None
        self.prompt_format = None
        self.stop_ids: set[int] = set()
        self._baselines: dict[str, ContinuationBaseline] = {}
        t0 = time.perf_counter()
        if cap is None:
            self.n_full, self.n_cheap = self.sample_counts(settings)
            ids = self.context_ids(lm, settings)
            if parts is None:
                cap = capture(lm, ids, settings.context_tokens, batch_size=self.batch_size, progress=progress,
                              kv_dtype=self.kv_dtype, baseline=False)
            else:
                batches = ordered_batches(parts, ids, settings.context_tokens)
                cap = assemble_capture(batches, ids, settings.context_tokens, lm.device)
                self._baselines["full"] = assemble_baseline(batches)
                if progress:
                    progress(self.n_full)
        else:
            self.n_full = cap.num_contexts
            self.n_cheap = min(self.default_cheap_samples, self.n_full)
        self.cap = cap
        t = cap.context_tokens
        self.samples = [Sample(context_ids=row[:t].tolist(), prompt_ids=row[t:].tolist()) for row in cap.input_ids]
        self.kv = LazyContexts(cap)
        self._buffers = DecodeBuffers.like(cap, min(self.batch_size, cap.num_contexts), lm.device)
        self.baseline("full")
        self.setup_seconds = time.perf_counter() - t0

    @staticmethod
    def context_ids(lm: LoadedModel, settings: WorkloadSettings) -> torch.Tensor:
        """``(N, T + C)`` int64 token ids of the run's contexts (:func:`~kvtune.evaluate.capture.build_contexts`
        on ``--text``; N from :meth:`sample_counts`).

        Raises:
            KvtuneError: see :func:`~kvtune.evaluate.capture.build_contexts`; AssetError: the text.
        """
        n_full, _ = ContinuationWorkload.sample_counts(settings)
        return build_contexts(lm.tokenizer, read_texts(settings.text), n_contexts=n_full,
                              context_tokens=settings.context_tokens, continuation_tokens=settings.continuation_tokens)

    @classmethod
    def part_count(cls, settings: WorkloadSettings, workers: int) -> int:
        """Parts the setup splits into for ``workers`` workers: one per forward batch at most
        (:mod:`kvtune.evaluate.workloads.parts`)."""
        n_full, _ = cls.sample_counts(settings)
        return max(1, min(workers, -(-n_full // cls.batch_size)))

    @classmethod
    @torch.inference_mode()
    def build_part(cls, lm: LoadedModel, settings: WorkloadSettings, index: int, count: int,
                   progress: Callable[[int], None] | None = None) -> list[CapturedBatch]:
        """Part ``index`` of ``count`` of the setup (:mod:`kvtune.evaluate.workloads.parts`):
        the prefill KV and the baseline of the forward batches ``b`` with ``b % count == index``,
        computed exactly as :meth:`__init__` computes them; ``parts=`` of :meth:`__init__`
        assembles all parts.

        Raises:
            KvtuneError: bad settings (see :meth:`context_ids`); ValueError: ``index`` not in ``range(count)``.
        """
        settings = checked_settings(settings)
        kv_dtype = checked_kv_dtype(settings.kv_dtype)
        ids = cls.context_ids(lm, settings)
        out = []
        for a, b in batches_of_part(int(ids.shape[0]), cls.batch_size, index, count):
            cap = capture(lm, ids[a:b], settings.context_tokens, batch_size=cls.batch_size, progress=progress,
                          kv_dtype=kv_dtype, baseline=False)
            logits = logits_on_cache(lm, cap.batch_kv(0, b - a), cap.continuation_ids, cap.context_tokens,
                                     batch_size=cls.batch_size)
            out.append(CapturedBatch.of(a, cap, ContinuationBaseline.from_logits(logits, cap.continuation_ids)))
            del cap, logits
        return out

    @classmethod
    def sample_counts(cls, settings: WorkloadSettings) -> tuple[int, int]:
        """``(full, cheap)``: ``--samples`` (or the legacy ``--contexts``) and ``--cheap-samples``.

        Raises:
            KvtuneError: counts below 1, or settings without the workload fields.
        """
        settings = checked_settings(settings)
        full = settings.samples or settings.contexts or cls.default_samples
        cheap = settings.cheap_samples or min(cls.default_cheap_samples, full)
        if full < 1 or cheap < 1:
            raise KvtuneError("workload 'continuation': --samples and --cheap-samples must be >= 1 (0 = default)")
        return full, min(cheap, full)

    def build_samples(self) -> list[Sample]:  # pragma: no cover - built in __init__ from the capture
        return self.samples

    def run_sample(self, sample: Sample, kv: KVLayers, fidelity: str) -> dict[str, Any]:  # pragma: no cover
        raise NotImplementedError("the continuation workload scores contexts in batches; use evaluate()")

    def score(self, base, out, fidelity):  # pragma: no cover - see run_sample
        raise NotImplementedError

    def baseline(self, fidelity: str) -> ContinuationBaseline:
        """The baseline of the contexts evaluated at ``fidelity`` (computed once per run).

        The cheap contexts are the first ones of the full set, run in the same batches of
        :attr:`batch_size`, so their baseline is a slice of the full one whenever the cheap
        count is a multiple of the batch size (else it is computed on its own batches, the
        batches its evaluations run in)."""
        self._check_fidelity(fidelity)
        n = self.num_samples(fidelity)
        key = "full" if n == self.n_full else "cheap"
        if key not in self._baselines:
            if key == "cheap" and n % self.batch_size == 0 and "full" in self._baselines:
                self._baselines[key] = self._baselines["full"].rows(0, n)
            else:
                parts = (ContinuationBaseline.from_logits(logits, self.cap.continuation_ids[a:b])
                         for a, b, logits in self._batch_logits(n, self.cap.batch_kv))
                self._baselines[key] = ContinuationBaseline.from_batches(parts, n, spool=True)
        return self._baselines[key]

    def _batch_logits(self, n: int, batch_kv: Callable[[int, int], KVLayers], *, selected: bool = False):
        """``(start, stop, logits)`` of the continuation run on ``batch_kv(start, stop)``, batch by
        batch (``selected``: the caches hold a token selection, see :func:`logits_on_cache`)."""
        for a in range(0, n, self.batch_size):
            b = min(a + self.batch_size, n)
            logits = logits_on_cache(self.lm, batch_kv(a, b), self.cap.continuation_ids[a:b], self.cap.context_tokens,
                                     batch_size=self.batch_size, selected=selected)
            yield a, b, logits

    def evaluate(self, config: PolicyConfig, *, fidelity: str = "cheap") -> dict[str, Any]:
        """Evaluate one policy (see :meth:`Workload.evaluate`); adds ``ppl_ratio``, ``kl_mean``,
        ``top1_agreement``, ``nll`` and ``nll_base``.

        Contexts go :attr:`batch_size` at a time: each one's KV is encoded, decoded into a
        buffer allocated once per run, the batch's continuation runs on the buffer, and its
        scores are kept per position (the logits of one batch at a time are held). A
        token-selecting policy (``keep``) runs the continuation on the kept tokens at their
        true positions (:func:`~kvtune.evaluate.capture.logits_on_cache`).

        Raises:
            ConfigError: ``keep`` on a model with sliding-window layers, before any encoding.
        """
        check_selection_fits(self.lm, config, workload=self.name, supported=self.evaluates_selection)
        t0 = time.perf_counter()
        base = self.baseline(fidelity)
        n = self.num_samples(fidelity)
        rt = RoundtripStats()

        def decoded(a: int, b: int) -> KVLayers:
            for row, i in enumerate(range(a, b)):
                rt.add(self.lm, self.cap.context_kv(i), config, self._buffers, row)
            return self._buffers.rows(b - a)

        selected = selecting_transform(config) is not None
        parts = [continuation_token_stats(base.rows(a, b), logits)
                 for a, b, logits in self._batch_logits(n, decoded, selected=selected)]
        scores = summarize_continuation({k: torch.cat([p[k] for p in parts]) for k in parts[0]})
        lo, hi = bootstrap_relative_accuracy(scores.pop("per_context_nll_delta"))
        metrics = {
            "relative_accuracy_raw": scores.pop("relative_accuracy"),
            "relative_accuracy_lo": lo,
            "relative_accuracy_hi": hi,
            "score": math.exp(-scores["nll"]),
            "score_base": math.exp(-scores["nll_base"]),
            **scores,
        }
        return self._row(fidelity, n, metrics, rt.encode_gbps, rt.decode_gbps, rt.stream_bytes, rt.original_bytes, t0)

    def pca_calibration_ids(self, *, contexts: int = 4, max_tokens: int = 1024) -> torch.Tensor:
        """``(contexts, min(max_tokens, T))`` int64 windows of ``--text`` that share no token with
        the evaluated windows (:func:`~kvtune.evaluate.capture.build_calibration_contexts`): the
        PCA basis is fitted apart from the evaluation (KVTC, arXiv 2511.01815, sec. 3). A
        capture given to the constructor that is not :func:`~kvtune.evaluate.capture.build_contexts`'
        windows of these settings falls back to :meth:`Workload.pca_calibration_ids` (its
        windows' places in the text are unknown).

        Raises:
            KvtuneError: the text cannot hold these windows beside the evaluated ones (the
                message names ``--contexts`` and ``--context-tokens``).
        """
        t, docs = self.cap.context_tokens, read_texts(self.settings.text)
        shape = dict(n_contexts=self.n_full, context_tokens=t,
                     continuation_tokens=int(self.cap.input_ids.shape[1]) - t)
        if not torch.equal(build_contexts(self.lm.tokenizer, docs, **shape), self.cap.input_ids):
            return super().pca_calibration_ids(contexts=contexts, max_tokens=max_tokens)
        return build_calibration_contexts(self.lm.tokenizer, docs, **shape, calibration_contexts=contexts,
                                          calibration_tokens=min(max_tokens, t))

    def kv_sample(self) -> KVLayers:
        """The first context's KV (model dtype), for cheap compression-ratio estimates."""
        return self.cap.context_kv(0)

    def describe(self) -> dict[str, Any]:
        d = super().describe()
        d.update({"text": self.settings.text,
                  "continuation_tokens": int(self.cap.input_ids.shape[1] - self.cap.context_tokens)})
        return d
