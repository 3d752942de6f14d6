"""The :class:`Workload` base class: real samples, their context KV, cached baselines, scoring.

A workload is the disaggregated-serving split of a real task. Each sample has

- a **context** (passage, document, essay window), prefilled once; its KV cache is what a
  prefill node would send, so it is what a policy encodes and decodes;
- a **decode-side prompt** (question, instruction, the chat template's assistant header) and
  the generated or teacher-forced answer tokens, which run on the decoded cache.

With a chat template, the user turn is ``context + instruction``; the template text before
the context belongs to the prefill side (it is part of the cached prefix), the rest of the
turn and the assistant header to the decode side, so the compressed prefix is exactly
``template prefix + context``.

Two fidelities (multi-fidelity search: cheap scores steer the search, full ones decide):

- ``"cheap"``: teacher-forced scores (log-likelihood of the reference) on the first
  ``cheap_samples`` samples; what the search evaluates;
- ``"full"``: the task score of generated outputs (F1, ROUGE-L, accuracy) on all
  ``samples``; for re-evaluating the final Pareto set.

Relative accuracy is always a ratio of task scores on the same samples, decoded KV over
original KV, with a paired bootstrap 95 % interval over samples
(:mod:`kvtune.evaluate.metrics`). Baseline outputs on the original KV are computed once per
workload and fidelity and reused for every policy.

Adding a workload means subclassing :class:`Workload`, implementing :meth:`build_samples`,
:meth:`run_sample` and :meth:`score`, and registering the class with :func:`register`.
"""

from __future__ import annotations

import inspect
import statistics
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar

import torch

from kvtune.codecs import PolicyConfig, decode_kv, encode_kv, original_nbytes
from kvtune.core.registry import Registry
from kvtune.codecs.select import selecting_transform
from kvtune.core.errors import ConfigError, KvtuneError
from kvtune.evaluate.workloads.settings import WorkloadSettings, checked_settings
from kvtune.evaluate.metrics import (
    bootstrap_ratio_of_means,
    bootstrap_relative_accuracy,
    ratio_of_means,
    report_relative_accuracy,
)
from kvtune.evaluate.model import (
    KV_DTYPES,
    KVLayers,
    LoadedModel,
    cache_to_kv,
    forward_cache,
    kv_to_cache,
    round_kv,
    start_tokens,
)

FIDELITIES = ("cheap", "full")
PROMPT_FORMATS = ("auto", "chat", "plain")

WORKLOADS: Registry[type["Workload"]] = Registry("workload")
"""Registry of workload classes by name (``--workload``)."""


def register(cls: type["Workload"]) -> type["Workload"]:
    """Class decorator adding a workload to :data:`WORKLOADS` under ``cls.name``."""
    return WORKLOADS.register(cls.name, cls)  # an empty name or a clash: DuplicateNameError


@dataclass
class Sample:
    """One item of a workload.

    Attributes:
        context_ids: prefill-side token ids (template prefix + context); their KV is sent.
        prompt_ids: decode-side token ids fed on top of the decoded cache before the answer
            (may be empty only for workloads that do not use it).
        targets: reference answers as token ids, scored teacher-forced after ``prompt_ids``.
        references: reference answers as text, for scores of generated outputs.
        label: a task label (BoolQ: the bool answer; needle: the passkey).
        meta: JSON-able details (source line, depth, ...).
    """

    context_ids: list[int]
    prompt_ids: list[int]
    targets: list[list[int]] = field(default_factory=list)
    references: list[str] = field(default_factory=list)
    label: Any = None
    meta: dict[str, Any] = field(default_factory=dict)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _encode_kwargs(lm: LoadedModel) -> dict[str, Any]:
    """Extra arguments of :func:`encode_kv` this codec library accepts (``layer_types`` once it does)."""
    params = inspect.signature(encode_kv).parameters
    return {"layer_types": lm.layer_types} if "layer_types" in params else {}


def selection_unsupported(lm: LoadedModel, config: PolicyConfig, *, workload: str, supported: bool) -> str | None:
    """Why a token-selecting policy (``keep``, :mod:`kvtune.codecs.select`) cannot be evaluated
    here, or ``None`` (always ``None`` for other policies): a workload that does not run
    shortened caches at their true positions (``supported`` False), or a model with
    sliding-window layers (their cache keeps the last positions, which a selection cannot
    shorten consistently; Gemma-3). The reason does not name the policy."""
    if selecting_transform(config) is None:
        return None
    if not supported:
        return f"workload {workload!r} does not evaluate token selection (keep); use the continuation workload"
    if "sliding_attention" in lm.layer_types:
        return f"token selection (keep) is not supported on {lm.name!r}, which has sliding-window layers"
    return None


def check_selection_fits(lm: LoadedModel, config: PolicyConfig, *, workload: str, supported: bool) -> None:
    """Refuse what :func:`selection_unsupported` names, before anything is encoded.

    Raises:
        ConfigError: naming the policy and the reason.
    """
    reason = selection_unsupported(lm, config, workload=workload, supported=supported)
    if reason is not None:
        raise ConfigError(f"policy {config.label}: {reason}")


def encode_decode(lm: LoadedModel, kv: KVLayers, config: PolicyConfig,
                  out: KVLayers | None = None) -> tuple[KVLayers, bytes, float, float]:
    """Encode ``kv`` with ``config``, decode it from the bytes alone (into ``out`` when given:
    preallocated contiguous tensors on ``lm.device`` of the decoded shapes and dtype, see
    :func:`~kvtune.codecs.decode_kv`), time both.

    Both run where the data is: with ``kv`` on a GPU, :func:`encode_kv` takes the device path
    of :mod:`kvtune.codecs.torchpath` (``impl="auto"``), and :func:`decode_kv` decodes onto
    ``lm.device`` there as well (a policy without a device implementation is decoded on the
    CPU and copied); on the CPU, the CPU codecs (compiled kernels or the reference). The
    stream bytes are the same either way. The timings include the device work (the device
    is synchronised around them).

    Returns:
        ``(decoded on lm.device, stream, encode_seconds, decode_seconds)``.
    """
    _sync(lm.device)
    t0 = time.perf_counter()
    stream = encode_kv(kv, config, **_encode_kwargs(lm))
    t1 = time.perf_counter()
    decoded = decode_kv(stream, expect=config, device=lm.device, out=out)
    _sync(lm.device)
    t2 = time.perf_counter()
    return decoded, stream, t1 - t0, t2 - t1


def median_after_warmup(values: list[float]) -> float:
    """Median of measurements after dropping the first (warm-up) one when there are several."""
    return statistics.median(values[1:] if len(values) > 1 else values)


@torch.inference_mode()
def prefill_kv(lm: LoadedModel, context_ids: list[int]) -> KVLayers:
    """Prefill one context at batch 1 and return its cache, per layer ``(1, kv_heads, tokens, head_dim)``.

    Sliding-window layers return only the positions their cache keeps (see
    :meth:`LoadedModel.kv_tokens`).
    """
    ids = torch.tensor([context_ids], dtype=torch.long, device=lm.device)
    out = lm.model(input_ids=ids, use_cache=True, logits_to_keep=1)
    return [(k.clone(), v.clone()) for k, v in cache_to_kv(forward_cache(out))]


@torch.inference_mode()
def target_nll(lm: LoadedModel, kv: KVLayers, context_tokens: int, prompt_ids: list[int],
               targets: list[list[int]]) -> list[float]:
    """Teacher-forced mean NLL per token (nats) of each target after ``prompt_ids`` on cache ``kv``.

    All targets run in one forward pass (the cache repeated along the batch, targets padded
    on the right, which causal attention never sees).

    Args:
        kv: the context cache, per layer ``(1, kv_heads, tokens, head_dim)``.
        context_tokens: the context length behind ``kv``.
        prompt_ids: decode-side prompt, at least one token.
        targets: token ids of each reference, each non-empty.

    Returns:
        One mean NLL per target.
    """
    if not prompt_ids or not targets or not all(targets):
        raise ValueError("target_nll needs a non-empty prompt and non-empty targets")
    b, lmax = len(targets), max(len(t) for t in targets)
    rows = [prompt_ids + t + [t[-1]] * (lmax - len(t)) for t in targets]
    ids = torch.tensor(rows, dtype=torch.long, device=lm.device)
    cache = kv_to_cache([(k.expand(b, -1, -1, -1), v.expand(b, -1, -1, -1)) for k, v in kv], lm.model.config,
                        context_tokens=context_tokens)
    logits = lm.model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=lmax + 1).logits[:, :lmax]
    logp = torch.log_softmax(logits.float(), dim=-1)
    tgt = ids[:, len(prompt_ids):]
    nll = -logp.gather(-1, tgt.unsqueeze(-1)).squeeze(-1)
    return [float(nll[j, : len(t)].mean()) for j, t in enumerate(targets)]


@torch.inference_mode()
def next_token_logits(lm: LoadedModel, kv: KVLayers, context_tokens: int, prompt_ids: list[int]) -> torch.Tensor:
    """``(vocab,)`` float32 logits of the token after ``prompt_ids`` on cache ``kv``."""
    cache = kv_to_cache(kv, lm.model.config, context_tokens=context_tokens)
    ids = torch.tensor([prompt_ids], dtype=torch.long, device=lm.device)
    return lm.model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1).logits[0, -1].float().cpu()


@torch.inference_mode()
def greedy_generate(lm: LoadedModel, kv: KVLayers, context_tokens: int, prompt_ids: list[int], *,
                    max_new_tokens: int, stop_ids: set[int], stop_at_newline: bool = True,
                    include_stop: bool = False) -> list[int]:
    """Greedy decoding on cache ``kv`` after ``prompt_ids``.

    Stops after ``max_new_tokens``, at a stop token (EOS / end of turn; returned only with
    ``include_stop``), or, with ``stop_at_newline``, once the text generated so far has a
    newline after some non-blank text.

    Returns:
        The generated token ids.
    """
    cache = kv_to_cache(kv, lm.model.config, context_tokens=context_tokens)
    ids = torch.tensor([prompt_ids], dtype=torch.long, device=lm.device)
    out: list[int] = []
    for _ in range(max_new_tokens):
        logits = lm.model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1).logits
        tok = int(logits[0, -1].argmax())
        if tok in stop_ids:
            if include_stop:
                out.append(tok)
            break
        out.append(tok)
        if stop_at_newline:
            text = lm.tokenizer.decode(out, skip_special_tokens=True)
            if "\n" in text.lstrip():
                break
        ids = torch.tensor([[tok]], dtype=torch.long, device=lm.device)
    return out


def first_line(text: str) -> str:
    """The first non-blank line of a generated text, stripped."""
    return text.strip().split("\n", 1)[0].strip()


def stop_token_ids(lm: LoadedModel) -> set[int]:
    """EOS and end-of-turn token ids of the model (those that exist in its vocabulary)."""
    tok = lm.tokenizer
    ids: set[int] = set()
    for source in (tok.eos_token_id, getattr(getattr(lm.model, "generation_config", None), "eos_token_id", None)):
        if isinstance(source, int):
            ids.add(source)
        elif isinstance(source, (list, tuple)):
            ids.update(int(i) for i in source)
    vocab = tok.get_vocab()
    for name in ("<|im_end|>", "<end_of_turn>", "<|eot_id|>", "<|endoftext|>", "</s>"):
        if name in vocab:
            ids.add(int(vocab[name]))
    return ids


class PromptBuilder:
    """Splits a task prompt into the prefill side (template prefix + context) and the decode side.

    Args:
        lm: the model (its tokenizer and chat template).
        prompt_format: ``auto`` (the chat template when the tokenizer has one), ``chat`` or ``plain``.

    Raises:
        KvtuneError: ``chat`` requested but the tokenizer has no chat template, or an unknown format.
    """

    _SENTINEL = "KVTUNECONTEXTSENTINEL"

    def __init__(self, lm: LoadedModel, prompt_format: str = "auto") -> None:
        if prompt_format not in PROMPT_FORMATS:
            raise KvtuneError(f"--prompt-format must be one of {', '.join(PROMPT_FORMATS)}, not {prompt_format!r}")
        has_template = bool(getattr(lm.tokenizer, "chat_template", None))
        if prompt_format == "chat" and not has_template:
            raise KvtuneError(f"--prompt-format chat: the tokenizer of {lm.name!r} has no chat template")
        self.tokenizer = lm.tokenizer
        self.format = "chat" if (prompt_format == "chat" or (prompt_format == "auto" and has_template)) else "plain"

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` without special tokens."""
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def split(self, *, chat_instruction: str, plain_instruction: str, answer_prefix: str = "") -> tuple[list[int], list[int]]:
        """``(prefix_ids, decode_ids)`` around a context.

        Chat: the user turn is ``context + chat_instruction``; ``prefix_ids`` is the rendered
        template up to the context, ``decode_ids`` the rest of the turn, the assistant
        header and ``answer_prefix``. Plain: ``prefix_ids`` is the tokenizer's BOS (if it
        adds one, see :func:`~kvtune.evaluate.model.start_tokens`) and ``decode_ids`` is
        ``plain_instruction + answer_prefix``.

        The full prompt is then ``prefix_ids + encode(context) + decode_ids``.
        """
        if self.format == "plain":
            return start_tokens(self.tokenizer), self.encode(plain_instruction + answer_prefix)
        messages = [{"role": "user", "content": self._SENTINEL + chat_instruction}]
        try:
            rendered = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        except Exception as exc:  # templates raise arbitrary errors (jinja, missing roles)
            raise KvtuneError(f"the chat template failed ({type(exc).__name__}: {exc}); use --prompt-format plain") from exc
        if not isinstance(rendered, str) or rendered.count(self._SENTINEL) != 1:
            raise KvtuneError("the chat template does not keep the user text verbatim; use --prompt-format plain")
        head, tail = rendered.split(self._SENTINEL)
        return self.encode(head), self.encode(tail + answer_prefix)


def checked_kv_dtype(kv_dtype: str) -> str:
    """``kv_dtype`` when it is one of :data:`KV_DTYPES`.

    Raises:
        KvtuneError: any other value (the message lists the accepted ones).
    """
    if kv_dtype not in KV_DTYPES:
        raise KvtuneError(f"--kv-dtype must be one of {', '.join(KV_DTYPES)}, not {kv_dtype!r}")
    return kv_dtype


class Workload(ABC):
    """A real task whose context KV crosses the wire compressed (see the module docstring).

    Subclasses set the class attributes and implement :meth:`build_samples`,
    :meth:`run_sample` and :meth:`score`.

    Args:
        lm: the loaded model.
        settings: the run settings, e.g. a :class:`kvtune.methods.tqc.settings.ProfileSettings`; the fields
            of :class:`~kvtune.evaluate.workloads.settings.WorkloadSettings` are read.
        progress: optional ``progress(n)`` called after each prefilled sample.

    Attributes:
        samples: the full-fidelity samples (the cheap ones are the first ``cheap_samples``).
        kv: each sample's context KV (what crosses the wire), per layer ``(1, kv_heads, tokens, head_dim)``.
    """

    name: ClassVar[str] = ""
    description: ClassVar[str] = ""
    default_data: ClassVar[str] = ""
    default_samples: ClassVar[int] = 16
    default_cheap_samples: ClassVar[int] = 8
    default_max_new_tokens: ClassVar[int] = 0
    score_names: ClassVar[dict[str, str]] = {"cheap": "", "full": ""}
    #: Whether :meth:`evaluate` runs token-selecting policies (``keep``) on shortened caches.
    evaluates_selection: ClassVar[bool] = False

    def __init__(self, lm: LoadedModel, *, settings: WorkloadSettings,
                 progress: Callable[[int], None] | None = None) -> None:
        self.lm = lm
        self.settings = checked_settings(settings)
        self.kv_dtype = checked_kv_dtype(settings.kv_dtype)
        self.n_full, self.n_cheap = self.sample_counts(settings)
        self.max_new_tokens = settings.max_new_tokens or self.default_max_new_tokens
        self.source: Any = None
        self.prompt_format: str | None = None
        self.stop_ids = stop_token_ids(lm)
        self.passed_over = {"empty_context": 0, "too_long": 0}
        self._baselines: dict[str, list[Any]] = {}
        self.setup_seconds = 0.0
        t0 = time.perf_counter()
        self.samples: list[Sample] = self.build_samples()
        if len(self.samples) != self.n_full:
            raise KvtuneError(f"workload {self.name!r} built {len(self.samples)} samples instead of {self.n_full}")
        self.kv: list[KVLayers] = []
        for s in self.samples:
            self.kv.append(round_kv(prefill_kv(lm, s.context_ids), self.kv_dtype))
            if progress:
                progress(1)
        self.baseline("cheap")
        self.setup_seconds = time.perf_counter() - t0

    # ------------------------------------------------------------------ sizes

    @classmethod
    def sample_counts(cls, settings: WorkloadSettings) -> tuple[int, int]:
        """``(full, cheap)`` sample counts from settings (0 = the workload's defaults).

        Raises:
            KvtuneError: negative counts, or settings without the workload fields.
        """
        settings = checked_settings(settings)
        full = settings.samples or cls.default_samples
        cheap = settings.cheap_samples or min(cls.default_cheap_samples, full)
        if full < 1 or cheap < 1:
            raise KvtuneError(f"workload {cls.name!r}: --samples and --cheap-samples must be >= 1 (0 = default)")
        return full, min(cheap, full)

    def num_samples(self, fidelity: str) -> int:
        """Samples evaluated at ``fidelity``."""
        self._check_fidelity(fidelity)
        return self.n_cheap if fidelity == "cheap" else self.n_full

    @property
    def cheap_is_full(self) -> bool:
        """True when both fidelities run the same score on the same samples (nothing to refine)."""
        return self.n_cheap == self.n_full and self.score_names["cheap"] == self.score_names["full"]

    @staticmethod
    def _check_fidelity(fidelity: str) -> None:
        if fidelity not in FIDELITIES:
            raise KvtuneError(f"fidelity must be one of {', '.join(FIDELITIES)}, not {fidelity!r}")

    # ------------------------------------------------------------------ subclass hooks

    @abstractmethod
    def build_samples(self) -> list[Sample]:
        """Load the data and return exactly ``self.n_full`` tokenized samples (deterministic)."""

    @abstractmethod
    def run_sample(self, sample: Sample, kv: KVLayers, fidelity: str) -> dict[str, Any]:
        """Run the decode side of one sample on cache ``kv``; return its raw outputs."""

    @abstractmethod
    def score(self, base: list[dict[str, Any]], out: list[dict[str, Any]], fidelity: str) -> dict[str, Any]:
        """Compare per-sample outputs on decoded KV (``out``) with the baseline (``base``).

        Returns:
            ``relative_accuracy_raw``, ``relative_accuracy_lo``, ``relative_accuracy_hi``,
            ``score``, ``score_base`` and any workload-specific metrics.
        """

    def fit_context(self, ids: list[int], budget: int) -> list[int] | None:
        """``ids`` when a context can be a sample (non-empty, at most ``budget`` tokens), else None;
        records passed over are counted in ``describe()["records_passed_over"]``."""
        if not ids:
            self.passed_over["empty_context"] += 1
            return None
        if len(ids) > budget:
            self.passed_over["too_long"] += 1
            return None
        return ids

    # ------------------------------------------------------------------ evaluation

    def baseline(self, fidelity: str) -> list[dict[str, Any]]:
        """Per-sample outputs on the original KV at ``fidelity``, computed once and cached."""
        self._check_fidelity(fidelity)
        if fidelity not in self._baselines:
            n = self.num_samples(fidelity)
            self._baselines[fidelity] = [
                self.run_sample(s, kv, fidelity) for s, kv in zip(self.samples[:n], self.kv[:n])
            ]
        return self._baselines[fidelity]

    def policy_problem(self, config: PolicyConfig) -> str | None:
        """Why :meth:`evaluate` would refuse ``config`` on this workload and model, or ``None``
        (:func:`selection_unsupported`: ``keep`` where shortened caches are not evaluated); the
        reason does not name the policy."""
        return selection_unsupported(self.lm, config, workload=self.name, supported=self.evaluates_selection)

    def evaluate(self, config: PolicyConfig, *, fidelity: str = "cheap") -> dict[str, Any]:
        """Evaluate one policy at ``fidelity``.

        Every sample's context KV (all layers) is encoded into one stream, decoded from the
        bytes alone, and the decode side of the sample runs on the decoded cache.

        Returns:
            A trials row: ``workload``, ``fidelity``, ``samples``, ``compression_ratio`` (bf16
            bytes / stream bytes, summed over samples), ``relative_accuracy`` (see
            :func:`~kvtune.evaluate.metrics.report_relative_accuracy`),
            ``relative_accuracy_raw``, ``relative_accuracy_lo/hi`` (paired bootstrap 95 %
            over samples), ``score`` / ``score_base`` / ``score_name`` (the task score the
            ratio is taken of), workload-specific metrics, ``encode_gbps`` / ``decode_gbps``
            (GB/s of original bf16 KV, 1 GB = 1e9 bytes; median over samples after the
            first, warm-up, sample), ``stream_bytes``, ``original_bytes``,
            ``bits_per_element`` and ``eval_seconds``.

        Raises:
            ConfigError: a token-selecting policy (``keep``), which only the continuation
                workload evaluates (:func:`check_selection_fits`), before any encoding.
        """
        check_selection_fits(self.lm, config, workload=self.name, supported=self.evaluates_selection)
        t0 = time.perf_counter()
        base = self.baseline(fidelity)
        n = self.num_samples(fidelity)
        outs, enc, dec, stream_bytes, orig_bytes = [], [], [], 0, 0
        for s, kv in zip(self.samples[:n], self.kv[:n]):
            decoded, stream, t_enc, t_dec = encode_decode(self.lm, kv, config)
            b = original_nbytes(kv)
            enc.append(b / t_enc / 1e9)
            dec.append(b / t_dec / 1e9)
            stream_bytes += len(stream)
            orig_bytes += b
            outs.append(self.run_sample(s, decoded, fidelity))
            del decoded
        metrics = self.score(base, outs, fidelity)
        return self._row(fidelity, n, metrics, enc, dec, stream_bytes, orig_bytes, t0)

    def _row(self, fidelity: str, n: int, metrics: dict[str, Any], enc_gbps: list[float], dec_gbps: list[float],
             stream_bytes: int, orig_bytes: int, t0: float) -> dict[str, Any]:
        raw = metrics.pop("relative_accuracy_raw")
        lo, hi = metrics.pop("relative_accuracy_lo"), metrics.pop("relative_accuracy_hi")
        return {
            "workload": self.name,
            "fidelity": fidelity,
            "samples": n,
            "compression_ratio": orig_bytes / stream_bytes,
            "relative_accuracy": report_relative_accuracy(raw),
            "relative_accuracy_raw": raw,
            "relative_accuracy_lo": lo,
            "relative_accuracy_hi": hi,
            "score_name": self.score_names[fidelity],
            **metrics,
            "encode_gbps": median_after_warmup(enc_gbps),
            "decode_gbps": median_after_warmup(dec_gbps),
            "stream_bytes": stream_bytes,
            "original_bytes": orig_bytes,
            "bits_per_element": 16.0 * stream_bytes / orig_bytes,
            "eval_seconds": time.perf_counter() - t0,
        }

    # ------------------------------------------------------------------ accessors for the search

    def describe(self) -> dict[str, Any]:
        """JSON-able description of the workload for ``run.json``: samples, tokens, data and pins."""
        lengths = [len(s.context_ids) for s in self.samples]
        sent = [sum(int(k.shape[-2]) for k, _ in kv) // max(len(kv), 1) for kv in self.kv]
        return {
            "workload": self.name,
            "description": self.description,
            "samples": self.n_full,
            "cheap_samples": self.n_cheap,
            "score": dict(self.score_names),
            "context_tokens": {"min": min(lengths), "median": statistics.median(lengths), "max": max(lengths),
                               "total": sum(lengths)},
            "kv_positions_per_layer_mean": statistics.mean(sent),
            "kv_dtype": self.kv_dtype,
            "max_new_tokens": self.max_new_tokens,
            "layer_types": sorted(set(self.lm.layer_types)),
            "setup_seconds": round(self.setup_seconds, 2),
            "prompt_format": self.prompt_format,
            "records_passed_over": dict(getattr(self, "passed_over", {})),
            **(self.source.describe() if self.source is not None else {}),
        }

    @classmethod
    def part_count(cls, settings: WorkloadSettings, workers: int) -> int:
        """Parts the setup splits into for ``workers`` workers, each built on one of them
        (:mod:`kvtune.evaluate.workloads.parts`); 1 (this default): not split, each worker
        builds it all."""
        return 1

    def calibration_ids(self, *, contexts: int = 2, max_tokens: int = 1024) -> torch.Tensor:
        """``(N, T)`` int64 real context ids for calibration passes (MixHQ head scores).

        The first ``contexts`` samples' contexts, cut to a common length ``T <= max_tokens``.
        These contexts are also evaluated; the MixHQ head calibration keeps using them (other
        ids would change existing runs' head scores and so their policy ids).
        """
        ctx = [s.context_ids for s in self.samples[:contexts]]
        t = min(max_tokens, *(len(c) for c in ctx))
        return torch.tensor([c[:t] for c in ctx], dtype=torch.long)

    def pca_calibration_ids(self, *, contexts: int = 4, max_tokens: int = 1024) -> torch.Tensor:
        """``(N, T)`` int64 context ids to fit a PCA basis on (``pca`` / ``dp-alloc`` policies).

        KVTC ("KV Cache Transform Coding for Compact Storage in LLM Inference", arXiv
        2511.01815, sec. 3) fits the basis once per model on data apart from the evaluation. A
        workload that can cut such contexts from its text overrides this (``continuation``:
        ``contexts`` windows of ``min(max_tokens, --context-tokens)`` tokens sharing no token
        with the evaluated windows); this default returns :meth:`calibration_ids` (the first
        2 evaluated contexts, whatever ``contexts`` and ``max_tokens`` say): a basis fitted
        on contexts that are also evaluated, which flatters the accuracy of ``pca`` policies.
        """
        return self.calibration_ids()

    def kv_sample(self) -> KVLayers:
        """The first sample's context KV, all layers, for cheap compression-ratio estimates."""
        return self.kv[0]


class OwnAnswerMixin:
    """Cheap fidelity of a generative workload: likelihood of the original run's own answer.

    The teacher-forced likelihood of the *reference* answer is a poor proxy on small models:
    on SmolLM2-135M, NarrativeQA references get ~0.04 probability per token, and a cache
    broken by 2-bit per-token keys (5x continuation perplexity) made them *more* likely (ratio
    1.24). What the decode side should preserve is what the model does with the original
    cache, so the cheap score is the teacher-forced likelihood of the answer greedily generated
    on the original KV (with its stop token), computed once per run; the reference likelihood
    is still reported (``ref_nll``, ``ref_nll_base``).

    Subclasses provide ``max_new_tokens`` and ``stop_ids`` (from :class:`Workload`).
    """

    def own_answer(self, sample: Sample, kv: KVLayers) -> list[int]:
        """The answer generated on the original KV ``kv`` (cached in ``sample.meta``)."""
        if "own_answer_ids" not in sample.meta:
            ids = greedy_generate(self.lm, kv, len(sample.context_ids), sample.prompt_ids,
                                  max_new_tokens=self.max_new_tokens, stop_ids=self.stop_ids, include_stop=True)
            sample.meta["own_answer_ids"] = ids or list(sample.targets[0])
        return sample.meta["own_answer_ids"]

    def baseline(self, fidelity: str) -> list[dict[str, Any]]:
        if fidelity == "cheap" and "cheap" not in self._baselines:
            for s, kv in zip(self.samples[: self.n_cheap], self.kv):
                self.own_answer(s, kv)
        return super().baseline(fidelity)

    def cheap_outputs(self, sample: Sample, kv: KVLayers) -> dict[str, Any]:
        """Teacher-forced NLL of the own answer and (mean over references) of the references."""
        own = sample.meta["own_answer_ids"]
        nlls = target_nll(self.lm, kv, len(sample.context_ids), sample.prompt_ids, [own, *sample.targets])
        return {"nll": nlls[0], "ref_nll": sum(nlls[1:]) / len(nlls[1:])}

    @staticmethod
    def cheap_score(base: list[dict[str, Any]], out: list[dict[str, Any]]) -> dict[str, Any]:
        res = nll_relative([b["nll"] for b in base], [o["nll"] for o in out])
        res["ref_nll"] = sum(o["ref_nll"] for o in out) / len(out)
        res["ref_nll_base"] = sum(b["ref_nll"] for b in base) / len(base)
        return res


# ---------------------------------------------------------------------- shared scoring recipes


def nll_relative(base_nll: list[float], nll: list[float]) -> dict[str, Any]:
    """Relative accuracy of a teacher-forced log-likelihood score.

    The score of a run is the geometric-mean probability per reference token,
    ``exp(-mean NLL)`` (mean over samples of each sample's mean NLL per token), so the ratio
    is ``exp(-mean(nll - base_nll))``: the same definition as the continuation workload.
    """
    b, d = torch.tensor(base_nll, dtype=torch.float64), torch.tensor(nll, dtype=torch.float64)
    delta = d - b
    lo, hi = bootstrap_relative_accuracy(delta)
    return {
        "relative_accuracy_raw": float(torch.exp(-delta.mean())),
        "relative_accuracy_lo": lo,
        "relative_accuracy_hi": hi,
        "score": float(torch.exp(-d.mean())),
        "score_base": float(torch.exp(-b.mean())),
        "nll": float(d.mean()),
        "nll_base": float(b.mean()),
    }


def mean_relative(base_scores: list[float], scores: list[float]) -> dict[str, Any]:
    """Relative accuracy of a mean per-sample task score: ``mean(scores) / mean(base_scores)``."""
    b, a = torch.tensor(base_scores, dtype=torch.float64), torch.tensor(scores, dtype=torch.float64)
    lo, hi = bootstrap_ratio_of_means(a, b)
    return {
        "relative_accuracy_raw": ratio_of_means(a, b),
        "relative_accuracy_lo": lo,
        "relative_accuracy_hi": hi,
        "score": float(a.mean()),
        "score_base": float(b.mean()),
    }
