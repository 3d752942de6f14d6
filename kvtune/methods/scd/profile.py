"""Profile SCD and its baselines on a producer/consumer pair and write one policy table.

:func:`run_scd_profile` is the Python API behind ``kvtune profile --method scd``.
Steps:

1. Load the pair (same architecture), split the domain data (:func:`domain_split`):
   calibration windows from the training split, evaluation windows (prefix + continuation)
   from the held-out split; both cut by :func:`kvtune.evaluate.capture.build_contexts`.
2. Calibrate the SCD maps (:func:`kvtune.methods.scd.calibration.calibrate`) on the calibration
   prefixes; choose the DroidSpeak block of each length by offline profiling on the first
   ``profile_contexts`` calibration windows (the start with the best relative accuracy).
3. Evaluate every configuration (:meth:`SCDMethod.stages`): for each evaluation prefix the
   method's :class:`~kvtune.methods.scd.methods.Transfer`, then the consumer's teacher-forced
   continuation on that cache. Quality = relative accuracy vs ``recompute``
   (``ppl_recompute / ppl_method``, paired bootstrap 95 % interval over prefixes,
   :mod:`kvtune.evaluate.metrics`).
   Steps 1-2 are :meth:`SCDMethod.prepare`; step 3 the runner's stages (baselines, then the SCD
   grid explored by ``settings.optimizer``).
4. Latency of a request = ``a + b / B`` with ``a`` = median producer + consumer seconds per
   prefix (after a warm-up prefix) and ``b`` = mean payload bytes. In the policy table
   (per volume V = bytes of the consumer's KV in bf16): ``compression_ratio = V / payload``,
   ``encode_gbps = V / producer_seconds / 1e9``, ``decode_gbps = V / consumer_seconds / 1e9``
   (inf when the side does no work), so ``T/V = a_s_per_gb + x / compression_ratio`` with
   ``x = 8 / bandwidth_gbps`` is the same line. The table has no implicit ``"none"`` policy
   (the consumer cannot receive its own KV; ``recompute`` is the full-quality candidate).

Outputs in the run folder (all written atomically; :mod:`kvtune.run.runner` writes the common
ones): ``run.json`` (settings, pair, calibration, timings, artifact bytes, the front summary),
``trials.jsonl``/``trials.parquet`` (one row per configuration), ``pareto.parquet``,
``policy_table.parquet``/``.json``, ``summary.md`` (the README table) and the calibration
artifacts ``scd_maps.pt`` and ``scd_calibration.json``.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Callable, ClassVar

import pandas as pd
import torch

from kvtune.codecs import original_nbytes
from kvtune.core.errors import ConfigError, KvtuneError
from kvtune.core.ids import policy_id
from kvtune.evaluate.capture import build_contexts, logits_on_cache
from kvtune.evaluate.metrics import bootstrap_relative_accuracy, continuation_scores, report_relative_accuracy
from kvtune.evaluate.model import KVLayers, LoadedModel, load_model
from kvtune.evaluate.workloads.base import median_after_warmup
from kvtune.methods.scd.calibration import SCDCalibration, calibrate
from kvtune.methods.scd.consumer import domain_split
from kvtune.methods.scd.methods import (
    SCD,
    DroidSpeak,
    Pair,
    PrefixContext,
    Raw,
    RawTQC,
    Recompute,
    TransferMethod,
    prefix_context,
    ttft_seconds,
)
from kvtune.run.loop import ask_tell
from kvtune.run.method import Compiled, Hooks, Method, ProfileRequest, Stage
from kvtune.run.runner import RunResult
from kvtune.run.settings import RunSettings
from kvtune.methods.scd.states import check_same_architecture

REPORT_BANDWIDTHS_GBPS = (1.0, 10.0, 100.0)


@dataclass(frozen=True)
class SCDProfileSettings(RunSettings):
    """Sizes and search grid of an SCD profile (defaults: the small real-pair run); saved as
    ``settings`` in ``run.json`` (:class:`kvtune.run.settings.RunSettings`). Values are checked
    when the settings are built (:func:`check_scd_settings`, a ``ConfigError`` naming
    ``--set name=value``), so before any model loads.

    Attributes:
        data: data asset / JSONL with ``document`` (domain text; split as the consumer's).
        holdout_fraction: must match the consumer recipe's, so evaluation text is unseen.
        calib_windows, calib_tokens: calibration prefixes (training split).
        contexts, context_tokens, continuation_tokens: evaluation prefixes (held-out split)
            and the teacher-forced continuation scored on the consumer.
        profile_contexts: calibration windows used to pick the DroidSpeak block.
        ranks: uniform SCD ranks searched.
        patch_counts: numbers of patched transition layers searched.
        code_bits: widths of the SCD codes searched (16 = bfloat16, fewer = quantized by
            the T/Q/C pipeline, :func:`kvtune.methods.scd.methods.code_policy`).
        optimizer: registered optimizer (:data:`kvtune.search.optimizers.OPTIMIZERS`) that explores the
            SCD grid (rank x patch count x code bits); the baselines are always evaluated.
        budget: SCD configurations to evaluate (0 = as many as the optimizer proposes).
        q_min: accuracy floor of constrained optimizers (``kvserve``).
        seed: optimizer seed.
        droidspeak_lengths: recomputed block lengths searched.
        droidspeak_stride: step between candidate block starts in the offline profiling.
        tqc_presets: preset names (``kvtune/search/spaces/presets.yaml``) for ``raw+tqc``.
        tqc_policies: extra T/Q/C policies as ``PolicyConfig.to_dict()`` dicts (e.g. a
            profile's Pareto set), labelled by policy id.
        ridge: relative ridge of the maps.
        floors: accuracy floors of the table.
        device: ``cpu`` / ``cuda`` / ``auto``.
        producer: ``--model`` spec of the producer ("" = the default model).
        consumer: ``--model`` spec of the consumer ("" = the LoRA fine-tune of the producer made
            by :func:`kvtune.methods.scd.consumer.make_consumer`, cached after the first run).
        version: settings version (2: floors gated on the interval's lower end; 1: on the
            point estimate, still readable).
    """

    data: str = "xsum"
    holdout_fraction: float = 0.2
    calib_windows: int = 16
    calib_tokens: int = 256
    contexts: int = 16
    context_tokens: int = 256
    continuation_tokens: int = 64
    profile_contexts: int = 4
    ranks: tuple[int, ...] = (32, 64, 128, 192, 256, 384)
    patch_counts: tuple[int, ...] = (0, 2)
    code_bits: tuple[int, ...] = (16, 8, 4)
    optimizer: str = "exhaustive"
    budget: int = 0
    q_min: float = 0.95
    seed: int = 0
    droidspeak_lengths: tuple[int, ...] = (2, 4, 8)
    droidspeak_stride: int = 2
    tqc_presets: tuple[str, ...] = ("kivi-4", "kivi-2")
    tqc_policies: tuple[dict, ...] = ()
    ridge: float = 1e-4
    floors: tuple[float, ...] = (0.99, 0.97, 0.95, 0.90)
    device: str = "cpu"
    producer: str = ""
    consumer: str = ""
    version: int = 2

    VERSION: ClassVar[int] = 2
    READABLE_VERSIONS: ClassVar[tuple[int, ...]] = (1, 2)

    def __post_init__(self) -> None:
        """Check the values (:func:`check_scd_settings`) whenever settings are built.

        Raises:
            ConfigError: see :func:`check_scd_settings`.
        """
        check_scd_settings(self)


# ---------------------------------------------------------------------------- evaluation


def _stack(kvs: list[KVLayers]) -> KVLayers:
    """Per-context caches ``(1, h, T, d)`` -> one batched cache ``(N, h, T, d)``."""
    return [(torch.cat([kv[l][0] for kv in kvs]), torch.cat([kv[l][1] for kv in kvs])) for l in range(len(kvs[0]))]


@dataclass
class MethodResult:
    """Measured numbers of one configuration on the evaluation prefixes."""

    method: TransferMethod
    scores: dict[str, Any]
    payload_bytes: float
    kv_bytes: float
    producer_seconds: float
    consumer_seconds: float
    eval_seconds: float
    artifact_bytes: int = 0


def evaluate_method(pair: Pair, method: TransferMethod, contexts: list[PrefixContext], continuation: torch.Tensor,
                    base_logits: torch.Tensor | None) -> tuple[MethodResult, torch.Tensor]:
    """Run ``method`` on every prefix and score the consumer's continuation against ``base_logits``.

    Returns:
        ``(MethodResult, logits)``; with ``base_logits=None`` the method's own logits are
        the reference (used for ``recompute``).
    """
    t0 = time.perf_counter()
    transfers = [method.transfer(pair, c) for c in contexts]
    kv = _stack([t.kv for t in transfers])
    logits = logits_on_cache(pair.consumer, kv, continuation, contexts[0].tokens)
    scores = continuation_scores(base_logits if base_logits is not None else logits, logits, continuation)
    res = MethodResult(
        method=method, scores=scores,
        payload_bytes=statistics.mean(t.payload_bytes for t in transfers),
        kv_bytes=statistics.mean(original_nbytes(c.producer.kv) for c in contexts),
        producer_seconds=median_after_warmup([t.producer_seconds for t in transfers]),
        consumer_seconds=median_after_warmup([t.consumer_seconds for t in transfers]),
        eval_seconds=time.perf_counter() - t0,
        artifact_bytes=method.artifact_bytes(pair),
    )
    return res, logits


def _gbps(kv_bytes: float, seconds: float) -> float:
    return math.inf if seconds <= 0 else kv_bytes / seconds / 1e9


def trial_row(res: MethodResult, bandwidths: tuple[float, ...] = REPORT_BANDWIDTHS_GBPS) -> dict[str, Any]:
    """One trials row (policy-table columns plus SCD details and TTFT at ``bandwidths``).

    Units: bytes, seconds, GB/s (1e9 bytes/s) for throughputs, Gbps (1e9 bits/s) for links.
    """
    sc = res.scores
    raw = float(sc["relative_accuracy"])
    lo, hi = bootstrap_relative_accuracy(sc["per_context_nll_delta"])
    cfg = res.method.config_json()
    row = {
        "policy_id": policy_id(cfg),
        "method": res.method.name,
        "label": res.method.label(),
        "config_json": cfg,
        "relative_accuracy": report_relative_accuracy(raw),
        "relative_accuracy_raw": raw,
        "relative_accuracy_lo": lo,
        "relative_accuracy_hi": hi,
        "ppl_ratio": float(sc["ppl_ratio"]),
        "kl_mean": float(sc["kl_mean"]),
        "top1_agreement": float(sc["top1_agreement"]),
        "nll": float(sc["nll"]),
        "nll_recompute": float(sc["nll_base"]),
        "payload_bytes": res.payload_bytes,
        "kv_bytes": res.kv_bytes,
        "compression_ratio": res.kv_bytes / res.payload_bytes,
        "producer_seconds": res.producer_seconds,
        "consumer_seconds": res.consumer_seconds,
        "latency_a_s": res.producer_seconds + res.consumer_seconds,
        "latency_b_bytes": res.payload_bytes,
        "encode_gbps": _gbps(res.kv_bytes, res.producer_seconds),
        "decode_gbps": _gbps(res.kv_bytes, res.consumer_seconds),
        "artifact_bytes": res.artifact_bytes,
        "eval_seconds": res.eval_seconds,
    }
    for bw in bandwidths:
        row[f"ttft_s_at_{bw:g}gbps"] = ttft_seconds(res.producer_seconds, res.consumer_seconds, res.payload_bytes, bw)
    return row


# ---------------------------------------------------------------------------- the search


def tqc_methods(settings: SCDProfileSettings) -> list[RawTQC]:
    """``raw+tqc`` configurations: the named presets, then the extra policies."""
    from kvtune.codecs import PolicyConfig
    from kvtune.codecs.presets import load_presets

    out: list[RawTQC] = []
    if settings.tqc_presets:
        presets = load_presets(skip_unavailable=True)
        for name in settings.tqc_presets:
            if name not in presets:
                raise KvtuneError(f"unknown T/Q/C preset {name!r}; known: {', '.join(presets)}")
            out.append(RawTQC(policy=presets[name].to_dict(), policy_name=name))
    for d in settings.tqc_policies:
        cfg = PolicyConfig.from_dict(d)
        out.append(RawTQC(policy=cfg.to_dict(), policy_name=cfg.policy_id))
    return out


def scd_methods(cal: SCDCalibration, settings: SCDProfileSettings) -> list[SCD]:
    """SCD grid: every uniform rank x every patch count (patched = the rank's transition
    layers) x every code width."""
    out = []
    d_out = cal.reuse[0].rank
    for r in settings.ranks:
        if r > d_out:
            continue
        for n in settings.patch_counts:
            if n and r not in cal.reuse_error:
                continue
            for bits in settings.code_bits:
                out.append(SCD.uniform(cal.num_layers, r, cal.transition_layers(r, n) if n else (), code_bits=bits))
    return out


@dataclass(frozen=True)
class TransferPolicy:
    """A candidate's ``config`` in an SCD run: the transfer method, its id and label."""

    method: TransferMethod

    @property
    def policy_id(self) -> str:
        return policy_id(self.method.config_json())

    @property
    def label(self) -> str:
        return self.method.label()

    needs_head_scores = False
    needs_codebooks = False


def scd_space(methods: list[SCD]) -> Any:
    """The SCD grid as a :class:`~kvtune.search.space.SearchSpace` for the shared optimizers.

    Parameters: ``rank`` (ordinal, more is more precise), ``patches`` (ordinal, number of
    patched layers, no precision direction), ``code_bits`` (ordinal, more is more precise).
    """
    from kvtune.search.space import Candidate, Parameter, SearchSpace

    def params(m: SCD) -> dict[str, Any]:
        return {"rank": max(m.ranks), "patches": len(m.patch_layers), "code_bits": m.code_bits}

    values = {k: tuple(sorted({params(m)[k] for m in methods})) for k in ("rank", "patches", "code_bits")}
    parameters = [Parameter("rank", "ordinal", values["rank"], precision="increasing"),
                  Parameter("patches", "ordinal", values["patches"], precision="none"),
                  Parameter("code_bits", "ordinal", values["code_bits"], precision="increasing")]
    cands = [Candidate(index=i, params=params(m), config=TransferPolicy(m)) for i, m in enumerate(methods)]
    return SearchSpace(name="scd", path=Path("<scd grid>"), description="SCD rank x patch count x code bits",
                       parameters=parameters, fixed={}, candidates=cands)


def choose_droidspeak_blocks(pair: Pair, contexts: list[PrefixContext], continuation: torch.Tensor,
                             lengths: tuple[int, ...], progress: Callable[[str], None] | None = None,
                             *, stride: int = 1) -> tuple[list[DroidSpeak], dict[str, Any]]:
    """DroidSpeak's offline profiling: for each block length, the start with the best relative accuracy.

    Candidate starts are ``0, stride, 2 * stride, ...`` (and the last possible start).

    Returns:
        ``(chosen configurations, {length: {start: relative accuracy}})``.
    """
    base, base_logits = evaluate_method(pair, Recompute(), contexts, continuation, None)
    n = pair.consumer.num_layers
    chosen, profile = [], {}
    for length in lengths:
        if length > n:
            continue
        acc = {}
        for start in sorted(set(range(0, n - length + 1, max(1, stride))) | {n - length}):
            res, _ = evaluate_method(pair, DroidSpeak(start=start, length=length), contexts, continuation, base_logits)
            acc[start] = float(res.scores["relative_accuracy"])
        best = max(acc, key=lambda s: (acc[s], -s))
        chosen.append(DroidSpeak(start=best, length=length))
        profile[str(length)] = {"best_start": best, "relative_accuracy_by_start": acc}
        if progress:
            progress(f"droidspeak length {length}: best start {best} ({acc[best]:.4f})")
    return chosen, profile


def _enough_documents(docs: list[str], tokens: int, chars_per_token: float = 6.0) -> list[tuple[str, str]]:
    """The first documents holding about ``tokens`` tokens (assuming at most ``chars_per_token``
    characters per token, so there are enough), as ``(name, text)`` pairs for build_contexts."""
    out, chars = [], 0
    for i, d in enumerate(docs):
        out.append((f"{i:06d}", d))
        chars += len(d)
        if chars >= tokens * chars_per_token:
            break
    return out


def _windows(tok: Any, docs: list[str], st: SCDProfileSettings, role: str) -> torch.Tensor:
    """``(n, prefix + continuation_tokens)`` windows of the ``calib`` (``calib_windows`` x
    ``calib_tokens``) or ``eval`` (``contexts`` x ``context_tokens``) prefixes, from the first
    documents that suffice (all documents when the estimate falls short).

    Raises:
        KvtuneError: the documents are too short, or the prefix leaves no token after the
            tokenizer's start tokens; the message names the SCD settings (``--set``).
    """
    from kvtune.evaluate.capture import start_tokens

    n_name, t_name = ("calib_windows", "calib_tokens") if role == "calib" else ("contexts", "context_tokens")
    n, t, c = getattr(st, n_name), getattr(st, t_name), st.continuation_tokens
    names = f"--set {n_name}={n}, --set {t_name}={t}, --set continuation_tokens={c}"
    head = len(start_tokens(tok))
    if t <= head:
        raise ConfigError(f"--set {t_name}={t}: the tokenizer starts every prefix with {head} special tokens; "
                          f"use more than {head}")
    try:
        try:
            return build_contexts(tok, _enough_documents(docs, n * (t + c)), n_contexts=n, context_tokens=t,
                                  continuation_tokens=c)
        except KvtuneError:
            return build_contexts(tok, _enough_documents(docs, 10 ** 12), n_contexts=n, context_tokens=t,
                                  continuation_tokens=c)
    except KvtuneError as exc:
        raise type(exc)(f"SCD {role} windows ({names}) from --set data={st.data}: {exc}") from None


def _split_windows(ids: torch.Tensor, context_tokens: int) -> tuple[list[list[int]], torch.Tensor]:
    return [r[:context_tokens].tolist() for r in ids], ids[:, context_tokens:]


def check_scd_settings(st: SCDProfileSettings) -> None:
    """Fail on settings that cannot work; run whenever :class:`SCDProfileSettings` are built
    (``--set`` values, a stored ``run.json``), so before any model loads. Pure value checks:
    nothing here depends on the machine (a stored run reads back anywhere).

    Raises:
        ConfigError: the message names the setting as ``--set name=value``: an unknown
            optimizer or T/Q/C preset, code bits outside :data:`kvtune.methods.scd.methods.CODE_BITS`,
            a negative budget, counts and token lengths below 1 (``continuation_tokens`` below
            2), ``holdout_fraction`` outside (0, 1), no rank or a rank below 1, a negative patch
            count, DroidSpeak lengths or stride below 1, a ``ridge`` that is not a finite number
            > 0, ``q_min`` or ``floors`` that are not fractions in (0, 1], or fewer calibration
            rows (``calib_windows x calib_tokens``) than the largest rank needs.
    """
    from kvtune.codecs import PolicyConfig
    from kvtune.codecs.presets import calibration_needs, load_presets
    from kvtune.methods.scd.methods import CODE_BITS
    from kvtune.run.settings import check_floors
    from kvtune.search.optimizers import OPTIMIZERS

    def refuse(name: str, why: str) -> None:
        raise ConfigError(f"--set {name}={_shown(getattr(st, name))}: {why}")

    if st.optimizer not in OPTIMIZERS:
        refuse("optimizer", f"unknown optimizer {st.optimizer!r}; known: {', '.join(sorted(OPTIMIZERS))}")
    if not st.code_bits or any(b not in CODE_BITS for b in st.code_bits):
        refuse("code_bits", f"SCD code bits must be among {', '.join(map(str, CODE_BITS))}")
    if st.budget < 0:
        refuse("budget", "budget must be >= 0 (0 = no limit)")
    for name in ("calib_windows", "calib_tokens", "contexts", "context_tokens", "profile_contexts",
                 "droidspeak_stride"):
        if getattr(st, name) < 1:
            refuse(name, "must be >= 1")
    if st.continuation_tokens < 2:
        refuse("continuation_tokens", "must be >= 2 (the first continuation token is the prefix's last logit)")
    if not 0.0 < st.holdout_fraction < 1.0:  # NaN fails too
        refuse("holdout_fraction", "must be in (0, 1) (the fraction of documents held out for evaluation)")
    if not st.ranks:
        refuse("ranks", "give at least one rank")
    if min(st.ranks) < 1:
        refuse("ranks", "every rank must be >= 1")
    if not st.patch_counts or min(st.patch_counts) < 0:
        refuse("patch_counts", "give patch counts >= 0 (0 = no layer patched)")
    if st.droidspeak_lengths and min(st.droidspeak_lengths) < 1:
        refuse("droidspeak_lengths", "every DroidSpeak block length must be >= 1")
    if not (math.isfinite(st.ridge) and st.ridge > 0):
        refuse("ridge", "must be a finite number > 0 (relative to the mean input energy; 1e-4 by default)")
    if not 0.0 < st.q_min <= 1.0:
        refuse("q_min", "must be a fraction in (0, 1] (0.95 = 95 % relative accuracy)")
    try:
        check_floors(st.floors, "floors")
    except ConfigError as exc:
        raise ConfigError(f"--set floors={_shown(st.floors)}: {exc}") from None
    rows = st.calib_windows * st.calib_tokens
    if rows <= max(st.ranks):
        refuse("calib_tokens", f"calib_windows x calib_tokens = {st.calib_windows} x {st.calib_tokens} = {rows} "
                               f"calibration rows are too few for rank {max(st.ranks)} (a rank-r map needs more than r "
                               "rows); raise calib_windows or calib_tokens, or lower ranks")
    if st.tqc_presets:
        presets = load_presets(skip_unavailable=True)
        unknown = [n for n in st.tqc_presets if n not in presets]
        if unknown:
            refuse("tqc_presets", f"unknown T/Q/C preset {unknown[0]!r}; known: {', '.join(presets)}")
        uncalibrated = [n for n in st.tqc_presets if calibration_needs(presets[n])]
        if uncalibrated:
            refuse("tqc_presets", f"preset {uncalibrated[0]!r} needs {' and '.join(calibration_needs(presets[uncalibrated[0]]))} "
                                  "from a calibration pass, which the scd method does not run")
    for i, d in enumerate(st.tqc_policies):
        try:
            PolicyConfig.from_dict(d)
        except (KvtuneError, KeyError, TypeError, ValueError) as exc:
            raise ConfigError(f"--set tqc_policies: policy {i} is not a T/Q/C policy: {exc}") from None


def _shown(value: Any) -> str:
    """A setting's value as ``--set`` takes it (lists comma-separated), clipped for messages."""
    from kvtune.run.settings import clip

    return clip(",".join(map(str, value)) if isinstance(value, tuple) else str(value))


@dataclass
class SCDContext:
    """What :meth:`SCDMethod.prepare` builds once per run: the pair with its calibration, the
    evaluation prefixes and the reference (``recompute``) result and logits (a
    :meth:`SCDMethod.driver_view` keeps the calibration only)."""

    settings: SCDProfileSettings
    pair: Pair
    specs: dict[str, str]
    contexts: list[PrefixContext]
    continuation: torch.Tensor
    base: MethodResult
    base_logits: torch.Tensor
    baselines: list[TransferMethod]
    info: dict[str, Any]
    say: Callable[[str], None]


def transfer_candidates(methods: Sequence[TransferMethod]) -> list[Any]:
    """Transfer configurations as search candidates (``index``, ``policy_id``, ``config``)."""
    from kvtune.search.space import Candidate

    return [Candidate(index=i, params={}, config=TransferPolicy(m)) for i, m in enumerate(methods)]


def scd_stage(methods: list[SCD], settings: SCDProfileSettings, stored: Mapping[str, dict[str, Any]]) -> Stage:
    """The SCD grid as one ask/tell :class:`~kvtune.run.method.Stage` explored by
    ``settings.optimizer`` (``done``: the stored rows of SCD configurations)."""
    from kvtune.search.optimizers import make_optimizer

    space = scd_space(methods)
    opt = make_optimizer(settings.optimizer, space, seed=settings.seed, q_min=settings.q_min)
    done = {pid: row for pid, row in stored.items() if row.get("method") == "scd"}
    return Stage("scd", space.candidates, opt, min(settings.budget or len(space), len(space)), done,
                 title=f"SCD grid ({settings.optimizer})")


def search_scd(pair: Pair, methods: list[SCD], contexts: list[PrefixContext], continuation: torch.Tensor,
               base_logits: torch.Tensor, settings: SCDProfileSettings) -> list[MethodResult]:
    """Explore the SCD grid with ``settings.optimizer`` outside a run folder (the shared
    ask/tell loop, :func:`kvtune.run.loop.ask_tell`, on :func:`scd_stage`).

    Returns:
        The configurations evaluated, in evaluation order.

    Raises:
        ConfigError: unknown optimizer.
    """
    if not methods:
        return []
    stage = scd_stage(methods, settings, {})
    results: list[MethodResult] = []

    def evaluate(cand: Any) -> dict[str, Any]:
        res, _ = evaluate_method(pair, cand.config.method, contexts, continuation, base_logits)
        results.append(res)
        return {**trial_row(res), "trial": len(results) - 1}

    ask_tell(stage.optimizer, stage.candidates, budget=stage.budget, done={}, evaluate=evaluate,
             on_record=lambda _row: None)
    return results


class SCDMethod(Method):
    """``--method scd`` on the shared runner (:mod:`kvtune.run.runner`).

    Context (:meth:`prepare`): the pair, calibration, DroidSpeak blocks, evaluation prefixes and
    the ``recompute`` reference. Stages: ``baselines`` (recompute, raw, raw+tqc, droidspeak; a
    fixed list) and ``scd`` (the grid, ``settings.optimizer``). Table: :func:`compile_scd_table`.
    """

    name = "scd"
    description = "cross-model KV transfer (SCD) from a producer to a fine-tuned consumer"
    settings_class = SCDProfileSettings
    report_title = "kvtune SCD profile"

    def settings_for(self, request: ProfileRequest) -> SCDProfileSettings:
        from kvtune.run.settings import parse_overrides

        return SCDProfileSettings(**{"device": "cpu" if request.device == "auto" else request.device,
                                     "seed": request.seed, **({"producer": request.model} if request.model else {}),
                                     **parse_overrides(SCDProfileSettings, request.options)})

    def run_name(self, settings: SCDProfileSettings) -> str:
        from kvtune.evaluate.assets import DEFAULT_MODEL

        return f"scd-{Path(settings.producer or DEFAULT_MODEL).stem}"

    def model_spec(self, info: Mapping[str, Any]) -> str | None:
        """The producer's ``--model`` spec (``producer_spec``, else the settings' ``producer``,
        else the default model)."""
        from kvtune.evaluate.assets import DEFAULT_MODEL

        return info.get("producer_spec") or (info.get("settings") or {}).get("producer") or DEFAULT_MODEL

    def prepare(self, settings: SCDProfileSettings, run_dir: Path, hooks: Hooks, **given: Any) -> SCDContext:
        from kvtune.evaluate.assets import DEFAULT_MODEL
        from kvtune.tables.run import read_run_info

        st, say = settings, hooks.say
        old = read_run_info(run_dir) if (run_dir / "run.json").is_file() else {}  # a resumed run's pair
        producer = given.get("producer") or st.producer or old.get("producer_spec") or DEFAULT_MODEL
        consumer = given.get("consumer") or st.consumer or old.get("consumer_spec")
        if not consumer:
            from kvtune.methods.scd.consumer import ConsumerRecipe, make_consumer

            say("consumer: LoRA fine-tune of the producer (cached after the first run)")
            consumer = str(make_consumer(ConsumerRecipe(producer=producer), device=st.device).path)
        prod = producer if isinstance(producer, LoadedModel) else load_model(producer, st.device)
        cons = consumer if isinstance(consumer, LoadedModel) else load_model(consumer, st.device)
        check_same_architecture(prod, cons)
        specs = {"producer_spec": producer if isinstance(producer, str) else prod.name,
                 "consumer_spec": consumer if isinstance(consumer, str) else cons.name}
        train_docs, held_docs, source = domain_split(st.data, st.holdout_fraction)
        tok = prod.tokenizer
        calib_ids = _windows(tok, train_docs, st, "calib")
        eval_ids = _windows(tok, held_docs, st, "eval")
        calib_prefixes, calib_cont = _split_windows(calib_ids, st.calib_tokens)
        eval_prefixes, eval_cont = _split_windows(eval_ids, st.context_tokens)

        say(f"calibrating on {len(calib_prefixes)} x {st.calib_tokens} tokens")
        t0 = time.perf_counter()
        cal = calibrate(prod, cons, calib_prefixes, ranks=tuple(sorted(set(st.ranks))), ridge=st.ridge)
        calib_seconds = time.perf_counter() - t0
        pair = Pair(producer=prod, consumer=cons, calibration=cal)
        artifact_files = cal.save(run_dir)

        t0 = time.perf_counter()
        k = max(1, min(st.profile_contexts, len(calib_prefixes)))
        prof_ctx = [prefix_context(prod, p) for p in calib_prefixes[:k]]
        ds_methods, ds_profile = choose_droidspeak_blocks(pair, prof_ctx, calib_cont[:k], st.droidspeak_lengths, say,
                                                          stride=st.droidspeak_stride)
        droidspeak_seconds = time.perf_counter() - t0
        contexts = [prefix_context(prod, p) for p in eval_prefixes]
        base, base_logits = evaluate_method(pair, Recompute(), contexts, eval_cont, None)
        info = {**specs, "producer": prod.describe(), "consumer": cons.describe(), "data": source.describe(),
                "calibration_tokens": cal.tokens, "calibration_seconds": calib_seconds,
                "calibration_artifact_bytes": cal.artifact_bytes(), "calibration_files_bytes": artifact_files,
                "droidspeak_profile": ds_profile, "droidspeak_profile_seconds": droidspeak_seconds,
                "kv_bytes_per_request": base.kv_bytes, "report_bandwidths_gbps": list(REPORT_BANDWIDTHS_GBPS)}
        return SCDContext(settings=st, pair=pair, specs=specs, contexts=contexts, continuation=eval_cont, base=base,
                          base_logits=base_logits, baselines=[Recompute(), Raw(), *tqc_methods(st), *ds_methods],
                          info=info, say=say)

    def driver_view(self, context: SCDContext) -> SCDContext:
        """The context without the models, the evaluation prefixes and the reference: the
        settings, the calibration (the SCD grid is built from it), the baselines and
        ``run.json``'s keys."""
        import dataclasses

        return dataclasses.replace(context, pair=Pair(producer=None, consumer=None, calibration=context.pair.calibration),
                                   contexts=[], continuation=None, base=None, base_logits=None)

    def run_info(self, context: SCDContext) -> dict[str, Any]:
        return context.info

    def stages(self, context: SCDContext, stored: list[dict[str, Any]]) -> Iterator[Stage]:
        from kvtune.run.loop import in_order

        by_id = {r["policy_id"]: r for r in stored}
        cands = transfer_candidates(context.baselines)
        yield Stage("baselines", cands, in_order(cands), len(cands),
                    {c.policy_id: by_id[c.policy_id] for c in cands if c.policy_id in by_id})
        methods = scd_methods(context.pair.calibration, context.settings)
        if methods:
            yield scd_stage(methods, context.settings, by_id)

    def evaluate(self, context: SCDContext, candidate: Any, stage: Stage) -> dict[str, Any]:
        method = candidate.config.method
        if isinstance(method, Recompute):
            return trial_row(context.base)
        res, _ = evaluate_method(context.pair, method, context.contexts, context.continuation, context.base_logits)
        context.say(f"{method.label()}: relative accuracy {res.scores['relative_accuracy']:.4f}, "
                    f"payload {res.payload_bytes / 1e6:.3f} MB")
        return trial_row(res)

    def compile(self, run_dir: Path, info: dict[str, Any], records: list[dict[str, Any]],
                floors: Sequence[float] | None = None) -> Compiled:
        trials = pd.DataFrame(records)
        front = front_summary(trials)
        table = compile_scd_table(trials, info, floors)
        return Compiled(trials=trials, points=trials, table=table, info={"front": front},
                        texts={"summary.md": summary_markdown(trials, {**info, "front": front})})

    def report_sections(self, run_dir: Path, info: dict[str, Any], compiled: Compiled) -> list[Any]:
        """Quality vs payload and predicted TTFT vs bandwidth per transfer family, and the
        ``summary.md`` tables (:func:`kvtune.methods.scd.report.scd_sections`)."""
        from kvtune.methods.scd.report import scd_sections
        from kvtune.tables.run import interval_gate

        trials = compiled.trials
        return scd_sections(trials, info, compiled.table.floors, interval_gate(trials, info),
                            info.get("report_bandwidths_gbps", list(REPORT_BANDWIDTHS_GBPS)))


def run_scd_profile(producer: str | LoadedModel, consumer: str | LoadedModel, out_dir: str | Path, *,
                    settings: SCDProfileSettings | None = None,
                    progress: Callable[[str], None] | None = None, resume: bool = False,
                    reports: str | Path | None = None, on_trial: Callable[[dict[str, Any]], None] | None = None
                    ) -> RunResult:
    """Profile recompute, raw, raw+tqc, droidspeak and scd on a pair and write the run folder
    (:func:`kvtune.run.runner.run_method` with :class:`SCDMethod`).

    Every evaluated configuration is appended to the run folder's trial store
    (``trials.jsonl``) as it finishes; with ``resume`` the stored configurations are not
    evaluated again (``recompute`` is re-run for its logits, the reference of every score,
    but not stored twice) and the SCD search continues.

    Args:
        producer, consumer: ``--model`` specs (or loaded models) with the same architecture;
            the consumer is typically :func:`kvtune.methods.scd.consumer.make_consumer`'s folder.
        out_dir: run folder (created); see the module docstring for the files.
        settings: :class:`SCDProfileSettings`.
        progress: optional ``progress(message)``.
        resume: continue the trials stored in ``out_dir``.
        reports: folder receiving the HTML report ``<run>.html`` (None: ``<out_dir>/report.html``).
        on_trial: called with each new trial row after it is stored.

    Returns:
        :class:`~kvtune.run.runner.RunResult` (``trials``, ``table``, ``info`` = ``run.json``,
        ``context.pair.calibration`` = the fitted maps, ``files``).

    Raises:
        ModelLayoutError: the models differ in architecture or are not Llama-style.
        ConfigError: settings that cannot work are refused when built (:func:`check_scd_settings`),
            before any model loads.
        KvtuneError: data too short, unknown preset, trials stored without ``resume``, ...
        RunLockedError: another process is working on ``out_dir``.
    """
    from kvtune.run.method import METHODS
    from kvtune.run.runner import run_method

    hooks = Hooks(say=progress or (lambda _m: None), on_trial=on_trial or (lambda _r: None))
    return run_method(METHODS["scd"], settings or SCDProfileSettings(), out_dir, resume=resume, reports=reports,
                      hooks=hooks, producer=producer, consumer=consumer)


def compile_scd_table(trials: pd.DataFrame, run: Mapping[str, Any], floors: Sequence[float] | None = None) -> Any:
    """The SCD policy table of a run's trials: no implicit ``"none"`` (``recompute`` is the
    full-quality candidate), model ``producer -> consumer``, workload ``continuation:<data>``.

    Floors are gated on the lower end of the 95 % paired-bootstrap interval
    (``relative_accuracy_lo``, :func:`kvtune.tables.run.interval_gate`) like the T/Q/C tables,
    so a floor holds with confidence; runs with version-1 settings were compiled on the point
    estimate and recompile the same way.

    Args:
        trials: the run's trial rows (:func:`trial_row`).
        run: the run's ``run.json`` dict (``producer``/``consumer`` with ``model`` and
            ``device``, ``settings`` with ``data`` and ``floors``, ``kv_bytes_per_request``).
        floors: accuracy floors (default: the run's).

    Raises:
        TableError: see :func:`kvtune.tables.policy_table.compile_policy_table`.
    """
    from kvtune.tables.policy_table import compile_policy_table
    from kvtune.tables.run import interval_gate

    st = run["settings"]
    prod, cons = run["producer"]["model"], run["consumer"]["model"]
    return compile_policy_table(trials, floors=tuple(floors if floors is not None else st["floors"]),
                                model=f"{prod} -> {cons}", workload=f"continuation:{st['data']}",
                                device=str(run["consumer"]["device"]), include_none=False,
                                metadata={"kv_bytes_per_request": float(run["kv_bytes_per_request"]), "method": "scd",
                                          "producer": prod, "consumer": cons},
                                gate=interval_gate(trials, dict(run)))


# ---------------------------------------------------------------------------- reporting


def front_summary(trials: pd.DataFrame, floors: tuple[float, ...] = (0.99, 0.95, 0.90),
                  bandwidths: tuple[float, ...] = REPORT_BANDWIDTHS_GBPS) -> list[dict[str, Any]]:
    """At each (bandwidth, floor): the fastest qualifying configuration, the fastest SCD and
    non-SCD ones, and the speed-ups over recompute and of SCD over the best alternative.

    A configuration qualifies at floor q when ``relative_accuracy >= q`` (the point estimate,
    as the policy table uses it; the intervals are in the trials). Returns one dict per
    (bandwidth, floor) with ``best_label``, ``best_method``, ``ttft_s``, ``speedup_vs_recompute``,
    ``best_non_scd_label``, ``speedup_vs_best_non_scd`` (>1 when SCD wins), etc.
    """
    rows = []
    rec = trials[trials["method"] == "recompute"]
    for bw in bandwidths:
        col = f"ttft_s_at_{bw:g}gbps"
        for q in floors:
            ok = trials[trials["relative_accuracy"] >= q]
            if ok.empty:
                continue
            best = ok.loc[ok[col].idxmin()]
            other = ok[ok["method"] != "scd"]
            scd = ok[ok["method"] == "scd"]
            alt = other.loc[other[col].idxmin()] if not other.empty else None
            best_scd = scd.loc[scd[col].idxmin()] if not scd.empty else None
            rows.append({
                "bandwidth_gbps": bw, "floor": q, "best_label": best["label"], "best_method": best["method"],
                "ttft_s": float(best[col]),
                "speedup_vs_recompute": float(rec[col].iloc[0] / best[col]) if not rec.empty else math.nan,
                "best_non_scd_label": None if alt is None else alt["label"],
                "best_non_scd_ttft_s": math.nan if alt is None else float(alt[col]),
                "best_scd_label": None if best_scd is None else best_scd["label"],
                "best_scd_ttft_s": math.nan if best_scd is None else float(best_scd[col]),
                "scd_speedup_vs_best_non_scd": (math.nan if alt is None or best_scd is None
                                                else float(alt[col] / best_scd[col])),
            })
    return rows


def summary_markdown(trials: pd.DataFrame, run: dict[str, Any]) -> str:
    """The README/closing-note tables (also in the HTML report): per configuration quality
    (interval), payload, TTFT at 1/10/100 Gbps; then the fastest configuration per bandwidth
    and floor (:mod:`kvtune.methods.scd.report`)."""
    from kvtune.methods.scd.report import configuration_rows, front_rows
    from kvtune.report.sections import markdown_table

    bws = run.get("report_bandwidths_gbps", list(REPORT_BANDWIDTHS_GBPS))
    lines = [*markdown_table(configuration_rows(trials, bws)), "", *markdown_table(front_rows(run.get("front", [])))]
    return "\n".join(lines) + "\n"
