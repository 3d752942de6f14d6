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
from typing import Any, Callable

import torch

from kvtune.evaluate.assets import read_texts
from kvtune.codecs import PolicyConfig, original_nbytes
from kvtune.core.errors import KvtuneError
from kvtune.evaluate.capture import Capture, build_contexts, capture, continuation_logits
from kvtune.evaluate.metrics import bootstrap_relative_accuracy, continuation_scores
from kvtune.evaluate.model import KVLayers, LoadedModel
from kvtune.evaluate.workloads.base import Sample, Workload, checked_kv_dtype, encode_decode, register
from kvtune.evaluate.workloads.settings import WorkloadSettings, checked_settings


def roundtrip_contexts(cap: Capture, config: PolicyConfig, lm: LoadedModel) -> tuple[KVLayers, dict[str, Any]]:
    """Encode and decode every context's KV of ``cap`` through ``config``, one stream per context.

    Returns:
        ``(decoded, stats)``: decoded per-layer ``(N, kv_heads, tokens, head_dim)`` tensors on
        the model's device in the capture dtype, and stats with ``stream_bytes``,
        ``original_bytes`` (bf16 size of the same KV), and ``encode_gbps``/``decode_gbps``
        lists (one per context).
    """
    enc, dec, stream_bytes, orig_bytes = [], [], 0, 0
    per_context: list[KVLayers] = []
    for i in range(cap.num_contexts):
        kv_i = cap.context_kv(i)
        decoded, stream, t_enc, t_dec = encode_decode(lm, kv_i, config)
        b = original_nbytes(kv_i)
        enc.append(b / t_enc / 1e9)
        dec.append(b / t_dec / 1e9)
        stream_bytes += len(stream)
        orig_bytes += b
        per_context.append(decoded)
    merged = [
        (torch.cat([c[l][0] for c in per_context]), torch.cat([c[l][1] for c in per_context]))
        for l in range(len(per_context[0]))
    ]
    return merged, {"stream_bytes": stream_bytes, "original_bytes": orig_bytes, "encode_gbps": enc, "decode_gbps": dec}


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
    """

    name = "continuation"
    description = "essay windows, teacher-forced continuation (perplexity ratio, KL, top-1 agreement)"
    default_samples = 24
    default_cheap_samples = 8
    score_names = {"cheap": "continuation_token_prob", "full": "continuation_token_prob"}

    def __init__(self, lm: LoadedModel, *, settings: WorkloadSettings, progress: Callable[[int], None] | None = None,
                 cap: Capture | None = None) -> None:
        self.lm = lm
        self.settings = checked_settings(settings)
        self.kv_dtype = checked_kv_dtype(settings.kv_dtype)
        self.max_new_tokens = 0
        self.source = None
        self.prompt_format = None
        self.stop_ids: set[int] = set()
        t0 = time.perf_counter()
        if cap is None:
            self.n_full, self.n_cheap = self.sample_counts(settings)
            ids = build_contexts(lm.tokenizer, read_texts(settings.text), n_contexts=self.n_full,
                                 context_tokens=settings.context_tokens, continuation_tokens=settings.continuation_tokens)
            cap = capture(lm, ids, settings.context_tokens, progress=progress, kv_dtype=self.kv_dtype)
        else:
            self.n_full = cap.num_contexts
            self.n_cheap = min(self.default_cheap_samples, self.n_full)
        self.cap = cap
        self._caps: dict[str, Capture] = {"full": cap}
        t = cap.context_tokens
        self.samples = [Sample(context_ids=row[:t].tolist(), prompt_ids=row[t:].tolist()) for row in cap.input_ids]
        self.kv = [cap.context_kv(i) for i in range(cap.num_contexts)]
        self._baselines = {}
        self.setup_seconds = time.perf_counter() - t0

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

    def capture_for(self, fidelity: str) -> Capture:
        """The capture evaluated at ``fidelity``, with its baseline logits (computed once)."""
        self._check_fidelity(fidelity)
        n = self.num_samples(fidelity)
        key = "full" if n == self.n_full else "cheap"
        if key not in self._caps:
            sub = self.cap.subset(n)
            sub.baseline_logits = continuation_logits(self.lm, sub, sub.kv)
            self._caps[key] = sub
        return self._caps[key]

    def baseline(self, fidelity: str) -> Any:
        return self.capture_for(fidelity).baseline_logits

    def evaluate(self, config: PolicyConfig, *, fidelity: str = "cheap") -> dict[str, Any]:
        """Evaluate one policy (see :meth:`Workload.evaluate`); adds ``ppl_ratio``, ``kl_mean``,
        ``top1_agreement``, ``nll`` and ``nll_base``."""
        t0 = time.perf_counter()
        cap = self.capture_for(fidelity)
        decoded, st = roundtrip_contexts(cap, config, self.lm)
        logits = continuation_logits(self.lm, cap, decoded)
        del decoded
        scores = continuation_scores(cap.baseline_logits, logits, cap.continuation_ids)
        lo, hi = bootstrap_relative_accuracy(scores.pop("per_context_nll_delta"))
        metrics = {
            "relative_accuracy_raw": scores.pop("relative_accuracy"),
            "relative_accuracy_lo": lo,
            "relative_accuracy_hi": hi,
            "score": math.exp(-scores["nll"]),
            "score_base": math.exp(-scores["nll_base"]),
            **scores,
        }
        return self._row(fidelity, cap.num_contexts, metrics, st["encode_gbps"], st["decode_gbps"],
                         st["stream_bytes"], st["original_bytes"], t0)

    def describe(self) -> dict[str, Any]:
        d = super().describe()
        d.update({"text": self.settings.text,
                  "continuation_tokens": int(self.cap.input_ids.shape[1] - self.cap.context_tokens)})
        return d
