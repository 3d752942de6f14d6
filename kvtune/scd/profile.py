"""Profile SCD and its baselines on a producer/consumer pair and write one policy table.

:func:`run_scd_profile` is the Python API behind ``kvtune profile --method scd`` and
``kvtune scd profile``. Steps:

1. Load the pair (same architecture), split the domain data (:func:`domain_split`):
   calibration windows from the training split, evaluation windows (prefix + continuation)
   from the held-out split; both cut by :func:`kvtune.evaluate.capture.build_contexts`.
2. Calibrate the SCD maps (:func:`kvtune.scd.calibration.calibrate`) on the calibration
   prefixes; choose the DroidSpeak block of each length by offline profiling on the first
   ``profile_contexts`` calibration windows (the start with the best relative accuracy).
3. Evaluate every configuration (:func:`candidate_methods`): for each evaluation prefix the
   method's :class:`~kvtune.scd.methods.Transfer`, then the consumer's teacher-forced
   continuation on that cache. Quality = relative accuracy vs ``recompute``
   (``ppl_recompute / ppl_method``, paired bootstrap 95 % interval over prefixes,
   :mod:`kvtune.evaluate.metrics`).
4. Latency of a request = ``a + b / B`` with ``a`` = median producer + consumer seconds per
   prefix (after a warm-up prefix) and ``b`` = mean payload bytes. In the policy table
   (per volume V = bytes of the consumer's KV in bf16): ``compression_ratio = V / payload``,
   ``encode_gbps = V / producer_seconds / 1e9``, ``decode_gbps = V / consumer_seconds / 1e9``
   (inf when the side does no work), so ``T/V = a_s_per_gb + x / compression_ratio`` with
   ``x = 8 / bandwidth_gbps`` is the same line. The table has no implicit ``"none"`` policy
   (the consumer cannot receive its own KV; ``recompute`` is the full-quality candidate).

Outputs in ``out_dir`` (all written atomically): ``scd_trials.parquet`` and ``.csv`` (one row
per configuration), ``scd_policy_table.parquet`` and ``.json``, ``scd_maps.pt`` and
``scd_calibration.json`` (calibration artifacts), ``scd_run.json`` (settings, pair, timings,
artifact bytes, TTFT at the report bandwidths) and ``scd_summary.md`` (the README table).
"""

from __future__ import annotations

import itertools
import json
import math
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from collections.abc import Mapping, Sequence
from typing import Any, Callable

import pandas as pd
import torch

from kvtune.atomic import atomic_write_parquet, atomic_write_text
from kvtune.codecs import original_nbytes
from kvtune.errors import KvtuneError
from kvtune.core.ids import policy_id
from kvtune.core.jsonio import jsonable, strict_dumps
from kvtune.evaluate.capture import build_contexts, logits_on_cache
from kvtune.evaluate.metrics import bootstrap_relative_accuracy, continuation_scores, report_relative_accuracy
from kvtune.evaluate.model import KVLayers, LoadedModel, load_model
from kvtune.evaluate.workloads.base import median_after_warmup
from kvtune.scd.calibration import SCDCalibration, calibrate
from kvtune.scd.consumer import domain_split
from kvtune.scd.methods import (
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
from kvtune.run.folder import open_run_folder
from kvtune.run.loop import ask_tell
from kvtune.run.settings import RunSettings
from kvtune.store import TrialStore
from kvtune.scd.states import check_same_architecture

REPORT_BANDWIDTHS_GBPS = (1.0, 10.0, 100.0)


@dataclass(frozen=True)
class SCDProfileSettings(RunSettings):
    """Sizes and search grid of an SCD profile (defaults: the small real-pair run); saved as
    ``settings`` in ``run.json`` (:class:`kvtune.run.settings.RunSettings`).

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
            the T/Q/C pipeline, :func:`kvtune.scd.methods.code_policy`).
        optimizer: registered optimizer (:data:`kvtune.optimize.OPTIMIZERS`) that explores the
            SCD grid (rank x patch count x code bits); the baselines are always evaluated.
        budget: SCD configurations to evaluate (0 = as many as the optimizer proposes).
        q_min: accuracy floor of constrained optimizers (``kvserve``).
        seed: optimizer seed.
        droidspeak_lengths: recomputed block lengths searched.
        droidspeak_stride: step between candidate block starts in the offline profiling.
        tqc_presets: preset names (``search_spaces/presets.yaml``) for ``raw+tqc``.
        tqc_policies: extra T/Q/C policies as ``PolicyConfig.to_dict()`` dicts (e.g. a
            profile's Pareto set), labelled by policy id.
        ridge: relative ridge of the maps.
        floors: accuracy floors of the table.
        device: ``cpu`` / ``cuda`` / ``auto``.
        version: settings version (1).
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
    version: int = 1


@dataclass
class SCDProfileResult:
    """What :func:`run_scd_profile` returns.

    Attributes:
        trials: one row per configuration (see :func:`trial_row`).
        table: the compiled :class:`~kvtune.tables.policy_table.PolicyTable`.
        calibration: the fitted maps.
        run: the ``scd_run.json`` dict.
        paths: written files by role.
    """

    trials: pd.DataFrame
    table: Any
    calibration: SCDCalibration
    run: dict[str, Any]
    paths: dict[str, Path] = field(default_factory=dict)


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
class _SCDPolicy:
    """A candidate's ``config`` in the SCD search space: the method, its id and label."""

    method: SCD

    @property
    def policy_id(self) -> str:
        return policy_id(self.method.config_json())

    @property
    def label(self) -> str:
        return self.method.label()

    needs_head_scores = False


def scd_space(methods: list[SCD]) -> Any:
    """The SCD grid as a :class:`~kvtune.space.SearchSpace` for the shared optimizers.

    Parameters: ``rank`` (ordinal, more is more precise), ``patches`` (ordinal, number of
    patched layers, no precision direction), ``code_bits`` (ordinal, more is more precise).
    """
    from kvtune.space import Candidate, Parameter, SearchSpace

    def params(m: SCD) -> dict[str, Any]:
        return {"rank": max(m.ranks), "patches": len(m.patch_layers), "code_bits": m.code_bits}

    values = {k: tuple(sorted({params(m)[k] for m in methods})) for k in ("rank", "patches", "code_bits")}
    parameters = [Parameter("rank", "ordinal", values["rank"], precision="increasing"),
                  Parameter("patches", "ordinal", values["patches"], precision="none"),
                  Parameter("code_bits", "ordinal", values["code_bits"], precision="increasing")]
    cands = [Candidate(index=i, params=params(m), config=_SCDPolicy(m)) for i, m in enumerate(methods)]
    return SearchSpace(name="scd", path=Path("<scd grid>"), description="SCD rank x patch count x code bits",
                       parameters=parameters, fixed={}, candidates=cands)


def search_scd(pair: Pair, methods: list[SCD], contexts: list[PrefixContext], continuation: torch.Tensor,
               base_logits: torch.Tensor, settings: SCDProfileSettings,
               progress: Callable[[str], None] | None = None, *, done: Mapping[str, dict[str, Any]] | None = None,
               on_record: Callable[[dict[str, Any]], None] | None = None) -> list[MethodResult]:
    """Explore the SCD grid with ``settings.optimizer`` (the shared ask/tell loop,
    :func:`kvtune.run.loop.ask_tell`).

    Each proposal is evaluated on every prefix and told back as its trials row
    (:func:`trial_row`: relative accuracy with interval, ratio, encode/decode GB/s).

    Args:
        done: stored trial rows by policy id (a resumed run): told, not evaluated again.
        on_record: called with each new row before it is told (append it to the trial store).

    Returns:
        The configurations evaluated now, in evaluation order.

    Raises:
        ConfigError: unknown optimizer.
    """
    from kvtune.optimize import make_optimizer

    if not methods:
        return []
    space = scd_space(methods)
    opt = make_optimizer(settings.optimizer, space, seed=settings.seed, q_min=settings.q_min)
    done = {pid: row for pid, row in (done or {}).items() if row.get("method") == "scd"}
    budget = min(settings.budget or len(space), len(space))
    results: list[MethodResult] = []

    def evaluate(cand: Any) -> dict[str, Any]:
        res, _ = evaluate_method(pair, cand.config.method, contexts, continuation, base_logits)
        results.append(res)
        if progress:
            progress(f"[{settings.optimizer} {len(done) + len(results)}/{budget}] {cand.config.label}: relative "
                     f"accuracy {res.scores['relative_accuracy']:.4f}, payload {res.payload_bytes / 1e6:.3f} MB")
        return {**trial_row(res), "trial": len(done) + len(results) - 1}

    ask_tell(opt, space.candidates, budget=budget, done=done, evaluate=evaluate, on_record=on_record or _ignore)
    return results


def _ignore(*_: Any) -> None:
    return None


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


def _windows(tok: Any, docs: list[str], need: int, n: int, context_tokens: int, continuation_tokens: int
             ) -> torch.Tensor:
    """``(n, context_tokens + continuation_tokens)`` windows from the first documents that suffice
    (all documents when the estimate falls short)."""
    try:
        return build_contexts(tok, _enough_documents(docs, need), n_contexts=n, context_tokens=context_tokens,
                              continuation_tokens=continuation_tokens)
    except KvtuneError:
        return build_contexts(tok, _enough_documents(docs, 10 ** 12), n_contexts=n, context_tokens=context_tokens,
                              continuation_tokens=continuation_tokens)


def _split_windows(ids: torch.Tensor, context_tokens: int) -> tuple[list[list[int]], torch.Tensor]:
    return [r[:context_tokens].tolist() for r in ids], ids[:, context_tokens:]


def _check_settings(st: SCDProfileSettings) -> None:
    """Fail before any model loads on settings that cannot work."""
    from kvtune.errors import ConfigError
    from kvtune.optimize import OPTIMIZERS
    from kvtune.scd.methods import CODE_BITS

    if st.optimizer not in OPTIMIZERS:
        raise ConfigError(f"unknown optimizer {st.optimizer!r}; known: {', '.join(sorted(OPTIMIZERS))}")
    bad = [b for b in st.code_bits if b not in CODE_BITS]
    if bad or not st.code_bits:
        raise ConfigError(f"SCD code bits must be among {', '.join(map(str, CODE_BITS))}; got {list(st.code_bits)}")
    if st.budget < 0:
        raise ConfigError(f"budget must be >= 0 (0 = no limit); got {st.budget}")


def run_scd_profile(producer: str | LoadedModel, consumer: str | LoadedModel, out_dir: str | Path, *,
                    settings: SCDProfileSettings | None = None,
                    progress: Callable[[str], None] | None = None, resume: bool = False,
                    reports: str | Path | None = None, on_trial: Callable[[dict[str, Any]], None] | None = None
                    ) -> SCDProfileResult:
    """Profile recompute, raw, raw+tqc, droidspeak and scd on a pair and write the policy table.

    Every evaluated configuration is appended to the run folder's trial store
    (``trials.jsonl``, :class:`kvtune.store.TrialStore`) as it finishes; with ``resume`` the
    stored configurations are not evaluated again (``recompute`` is re-run for its logits,
    the reference of every score, but not stored twice) and the SCD search continues.

    Args:
        producer, consumer: ``--model`` specs (or loaded models) with the same architecture;
            the consumer is typically :func:`kvtune.scd.consumer.make_consumer`'s folder.
        out_dir: run folder (created); see the module docstring for the files.
        settings: :class:`SCDProfileSettings`.
        progress: optional ``progress(message)``.
        resume: continue the trials stored in ``out_dir``.
        reports: folder receiving the HTML report ``<run>.html`` (None: no report).
        on_trial: called with each new trial row after it is stored.

    Returns:
        :class:`SCDProfileResult`.

    Raises:
        ModelLayoutError: the models differ in architecture or are not Llama-style.
        ConfigError: unknown optimizer, bad code bits or budget (before any model loads).
        KvtuneError: data too short, unknown preset, trials stored without ``resume``, ...
        RunLockedError: another process is working on ``out_dir``.
    """
    st = settings or SCDProfileSettings()
    _check_settings(st)
    with open_run_folder(out_dir):
        store = TrialStore(Path(out_dir))
        if store.log_path.exists() and not resume:
            raise KvtuneError(f"run folder {out_dir} already has trials; resume it or use another run name")
        return _run_scd_locked(producer, consumer, Path(out_dir), st, progress or (lambda _m: None), store,
                               reports, on_trial or _ignore)


def _run_scd_locked(producer: str | LoadedModel, consumer: str | LoadedModel, out: Path, st: SCDProfileSettings,
                    say: Callable[[str], None], store: TrialStore, reports: str | Path | None,
                    on_trial: Callable[[dict[str, Any]], None]) -> SCDProfileResult:
    """:func:`run_scd_profile` with its run folder locked."""
    t_start = time.perf_counter()
    done = {r["policy_id"]: r for r in store.load()}
    numbers = itertools.count(len(done))

    def keep(row: dict[str, Any]) -> None:
        row["trial"] = next(numbers)
        store.append(row)
        on_trial(row)

    prod = producer if isinstance(producer, LoadedModel) else load_model(producer, st.device)
    cons = consumer if isinstance(consumer, LoadedModel) else load_model(consumer, st.device)
    check_same_architecture(prod, cons)
    specs = {"producer_spec": producer if isinstance(producer, str) else prod.name,
             "consumer_spec": consumer if isinstance(consumer, str) else cons.name}
    if not store.log_path.exists():  # what --resume needs, before the first trial
        atomic_write_text(out / "run.json", strict_dumps(jsonable(
            {"method": "scd", "settings": st.to_dict(), **specs, "producer": prod.describe(),
             "consumer": cons.describe()}), indent=2, default=str))
    train_docs, held_docs, source = domain_split(st.data, st.holdout_fraction)
    tok = prod.tokenizer
    calib_need = st.calib_windows * (st.calib_tokens + st.continuation_tokens)
    eval_need = st.contexts * (st.context_tokens + st.continuation_tokens)
    calib_ids = _windows(tok, train_docs, calib_need, st.calib_windows, st.calib_tokens, st.continuation_tokens)
    eval_ids = _windows(tok, held_docs, eval_need, st.contexts, st.context_tokens, st.continuation_tokens)
    calib_prefixes, calib_cont = _split_windows(calib_ids, st.calib_tokens)
    eval_prefixes, eval_cont = _split_windows(eval_ids, st.context_tokens)

    say(f"calibrating on {len(calib_prefixes)} x {st.calib_tokens} tokens")
    t0 = time.perf_counter()
    cal = calibrate(prod, cons, calib_prefixes, ranks=tuple(sorted(set(st.ranks))), ridge=st.ridge)
    calib_seconds = time.perf_counter() - t0
    pair = Pair(producer=prod, consumer=cons, calibration=cal)

    t0 = time.perf_counter()
    k = max(1, min(st.profile_contexts, len(calib_prefixes)))
    prof_ctx = [prefix_context(prod, p) for p in calib_prefixes[:k]]
    ds_methods, ds_profile = choose_droidspeak_blocks(pair, prof_ctx, calib_cont[:k], st.droidspeak_lengths, say,
                                                      stride=st.droidspeak_stride)
    droidspeak_seconds = time.perf_counter() - t0

    contexts = [prefix_context(prod, p) for p in eval_prefixes]
    baselines: list[TransferMethod] = [Raw(), *tqc_methods(st), *ds_methods]
    base, base_logits = evaluate_method(pair, Recompute(), contexts, eval_cont, None)
    if policy_id(Recompute().config_json()) not in done:
        keep(trial_row(base))
    for m in baselines:
        if policy_id(m.config_json()) in done:
            continue
        res, _ = evaluate_method(pair, m, contexts, eval_cont, base_logits)
        keep(trial_row(res))
        say(f"{m.label()}: relative accuracy {res.scores['relative_accuracy']:.4f}, "
            f"payload {res.payload_bytes / 1e6:.3f} MB")
    search_scd(pair, scd_methods(cal, st), contexts, eval_cont, base_logits, st, say, done=done, on_record=keep)
    trials = store.frame()

    artifact_files = cal.save(out)
    kv_bytes = float(trials["kv_bytes"].iloc[0])
    run = {
        "method": "scd",
        **specs,
        "producer": prod.describe(),
        "consumer": cons.describe(),
        "settings": st.to_dict(),
        "data": source.describe(),
        "calibration_tokens": cal.tokens,
        "calibration_seconds": calib_seconds,
        "calibration_artifact_bytes": cal.artifact_bytes(),
        "calibration_files_bytes": artifact_files,
        "droidspeak_profile": ds_profile,
        "droidspeak_profile_seconds": droidspeak_seconds,
        "kv_bytes_per_request": kv_bytes,
        "report_bandwidths_gbps": list(REPORT_BANDWIDTHS_GBPS),
        "front": front_summary(trials),
        "total_seconds": time.perf_counter() - t_start,
        "reports": None if reports is None else str(reports),
    }
    table = compile_scd_table(trials, run)
    paths = {
        "trials": atomic_write_parquet(trials, out / "scd_trials.parquet"),
        "trials_csv": atomic_write_text(out / "scd_trials.csv", trials.to_csv(index=False)),
        "table": table.to_parquet(out / "scd_policy_table.parquet"),
        "table_json": table.to_json(out / "scd_policy_table.json"),
        "policy_table": table.to_parquet(out / "policy_table.parquet"),
        "policy_table_json": table.to_json(out / "policy_table.json"),
        "maps": out / "scd_maps.pt",
        "calibration": out / "scd_calibration.json",
    }
    text = strict_dumps(jsonable(run), indent=2, default=str)
    paths["run"] = atomic_write_text(out / "run.json", text)
    paths["scd_run"] = atomic_write_text(out / "scd_run.json", text)
    paths["summary"] = atomic_write_text(out / "scd_summary.md", summary_markdown(trials, run))
    if reports is not None:
        paths["report"] = write_scd_report(trials, table, run, _report_path(out, run), title=out.name)
    return SCDProfileResult(trials=trials, table=table, calibration=cal, run=run, paths=paths)


def compile_scd_table(trials: pd.DataFrame, run: Mapping[str, Any], floors: Sequence[float] | None = None) -> Any:
    """The SCD policy table of a run's trials: no implicit ``"none"`` (``recompute`` is the
    full-quality candidate), floors gated on the point estimate, model ``producer -> consumer``,
    workload ``continuation:<data>``.

    Args:
        trials: the run's trial rows (:func:`trial_row`).
        run: the run's ``run.json`` dict (``producer``/``consumer`` with ``model`` and
            ``device``, ``settings`` with ``data`` and ``floors``, ``kv_bytes_per_request``).
        floors: accuracy floors (default: the run's).

    Raises:
        TableError: see :func:`kvtune.tables.policy_table.compile_policy_table`.
    """
    from kvtune.tables.policy_table import compile_policy_table

    st = run["settings"]
    prod, cons = run["producer"]["model"], run["consumer"]["model"]
    return compile_policy_table(trials, floors=tuple(floors if floors is not None else st["floors"]),
                                model=f"{prod} -> {cons}", workload=f"continuation:{st['data']}",
                                device=str(run["consumer"]["device"]), include_none=False,
                                metadata={"kv_bytes_per_request": float(run["kv_bytes_per_request"]), "method": "scd",
                                          "producer": prod, "consumer": cons})


def finalize_scd_run(run_dir: str | Path) -> dict[str, Path]:
    """Rebuild an SCD run's policy tables and HTML report from its stored trials
    (``kvtune report``). The report goes to ``<reports>/<run>.html`` (the ``reports`` folder
    recorded in ``run.json``), or ``<run_dir>/report.html`` when none was recorded. The table
    is compiled before anything is written.

    Raises:
        KvtuneError: not a finished SCD run folder, or trials that do not compile (the
            message names the trial log).
    """
    from kvtune.tables.run import read_run_info

    out = Path(run_dir)
    with open_run_folder(out, create=False):
        run = read_run_info(out)
        store = TrialStore(out)
        trials = store.frame()
        if trials.empty or "front" not in run:
            raise KvtuneError(f"{out}: not a finished SCD run (no trials or an incomplete run.json)")
        try:
            table = compile_scd_table(trials, run)
        except (KeyError, KvtuneError) as exc:
            raise KvtuneError(f"{store.log_path}: {exc}") from None
        return {"trials": store.write_table(trials),
                "policy_table": table.to_parquet(out / "policy_table.parquet"),
                "policy_table_json": table.to_json(out / "policy_table.json"),
                "report": write_scd_report(trials, table, run, _report_path(out, run), title=out.name)}


def _report_path(run_dir: Path, run: Mapping[str, Any]) -> Path:
    reports = run.get("reports")
    return Path(reports) / f"{run_dir.name}.html" if isinstance(reports, str) else run_dir / "report.html"


def write_scd_report(trials: pd.DataFrame, table: Any, run: Mapping[str, Any], path: Path, *, title: str) -> Path:
    """The HTML report of an SCD run (:func:`kvtune.report.html.write_report`): every
    configuration, the 3-D Pareto front, the per-floor tables and the run settings."""
    from kvtune.pareto import pareto_front
    from kvtune.report.html import write_report

    return write_report(trials, pareto_front(trials), table, path, title=f"kvtune SCD profile: {title}",
                        run_config=run)


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
    """The README/closing-note table: per configuration quality (interval), payload, TTFT at 1/10/100 Gbps."""
    bws = run.get("report_bandwidths_gbps", list(REPORT_BANDWIDTHS_GBPS))
    head = ("| method | configuration | relative accuracy [95 % CI] | payload bytes | ratio | a (s) | "
            + " | ".join(f"TTFT @ {b:g} Gbps (ms)" for b in bws) + " |")
    lines = [head, "|" + "---|" * (6 + len(bws))]
    for _, r in trials.iterrows():
        lines.append(
            f"| {r['method']} | {r['label']} | {100 * r['relative_accuracy_raw']:.2f} % "
            f"[{100 * r['relative_accuracy_lo']:.2f}, {100 * r['relative_accuracy_hi']:.2f}] | "
            f"{r['payload_bytes']:,.0f} | {r['compression_ratio']:.1f} | {r['latency_a_s']:.4f} | "
            + " | ".join(f"{1e3 * r[f'ttft_s_at_{b:g}gbps']:.2f}" for b in bws) + " |")
    lines.append("")
    lines.append("| bandwidth (Gbps) | floor | fastest | TTFT (ms) | x recompute | best non-SCD | best SCD | SCD gain |")
    lines.append("|---|---|---|---|---|---|---|---|")
    for f in run.get("front", []):
        lines.append(
            f"| {f['bandwidth_gbps']:g} | {f['floor']:.2f} | {f['best_label']} | {1e3 * f['ttft_s']:.2f} | "
            f"{f['speedup_vs_recompute']:.2f} | {f['best_non_scd_label']} | {f['best_scd_label']} | "
            f"{f['scd_speedup_vs_best_non_scd']:.2f} |")
    return "\n".join(lines) + "\n"
