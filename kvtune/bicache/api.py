"""``run_bicache_profile``: the BiCache reuse-depth profile of an encoder, written to a run folder.

Steps (BiCache paper, Sec. 3-4; ``BRIEF.md`` Sec. 4):

1. load the encoder and build requests per prefix-ratio bucket
   (:mod:`kvtune.bicache.workload`), cache the shared prefix's state (prefix alone);
2. per bucket: quality at every depth vs full recompute, with the exact in-memory cache and
   with every codec policy of the payload (:mod:`kvtune.bicache.quality`);
3. per bucket: requests/s at every depth (:mod:`kvtune.bicache.throughput`);
4. the ratio -> depth table: per bucket the deepest d whose lower bootstrap bounds stay above
   every floor (:func:`kvtune.bicache.stats.choose_depth`);
5. ``method = "bicache"`` policy-table rows keyed by bucket (:mod:`kvtune.bicache.table`), from
   the admissible lines only (:func:`mark_admissible`: depth <= the bucket's chosen depth and
   the codec's own quality above the floors).

Files of the run folder (each written atomically):

==================== ===============================================================
run.json             settings, encoder geometry, prefix, data, timings, file list
depth_table.json/csv ratio bucket -> chosen depth, quality intervals at it, speedup
quality.parquet      bucket x depth x codec: kv/embedding cosine, retrieval, intervals
layer_cosine.parquet bucket x layer: prefix K/V/hidden cosine alone vs in context
throughput.parquet   bucket x depth: requests/s, seconds per batch, speedup
candidates.parquet   every (bucket, depth, codec) line before the envelope
policy_table.parquet the compiled table (also policy_table.json)
summary.md           the tables above in Markdown
==================== ===============================================================
"""

from __future__ import annotations

import dataclasses
import json
import platform
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd
import torch

from kvtune.atomic import atomic_write_parquet, atomic_write_text
from kvtune.bicache.adapters import EncoderAdapter, load_encoder
from kvtune.bicache.quality import EXACT, POOLINGS, encode_queries, measure_bucket_quality
from kvtune.bicache.state import prefix_state_bf16_bytes
from kvtune.bicache.stats import CRITERIA, choose_depth
from kvtune.bicache.table import bicache_candidate, compile_bicache_table
from kvtune.bicache.throughput import measure_throughput, token_layer_fraction
from kvtune.bicache.workload import (
    DEFAULT_BUCKETS,
    DEFAULT_INSTRUCTION,
    build_requests,
    instruction_prefix,
    parse_buckets,
    ratio_summary,
)
from kvtune.codecs import PolicyConfig
from kvtune.core.jsonio import jsonable, plain, strict_dumps
from kvtune.core.registry import Registry
from kvtune.errors import BiCacheError, KvtuneError
from kvtune.run.settings import RunSettings
from kvtune.run.folder import open_run_folder
from kvtune.store import TrialStore
from kvtune.tables.policy_table import DEFAULT_FLOORS, PolicyTable

__all__ = ["CODEC_POLICIES", "BiCacheResult", "BiCacheSettings", "compile_run_table", "mark_admissible",
           "run_bicache_profile"]

SETTINGS_VERSION = 1

#: Codec policies the cached prefix state can be sent with (name -> factory).
CODEC_POLICIES: Registry[Callable[[], PolicyConfig]] = Registry("BiCache codec policy", {
    "bf16": PolicyConfig.uncompressed,
    "kivi-8": lambda: PolicyConfig.kivi(8, 32),
    "kivi-4": lambda: PolicyConfig.kivi(4, 32),
    "kivi-2": lambda: PolicyConfig.kivi(2, 32),
})


@dataclass(frozen=True, kw_only=True)
class BiCacheSettings(RunSettings):
    """Everything a BiCache profile depends on (versioned; round-trips through JSON).

    Attributes:
        model: encoder asset name or folder (BERT family).
        data: QA dataset asset or JSONL path with ``passage``/``question``/``answer``.
        instruction: the shared instruction (prefix = ``[CLS]`` + its word pieces).
        buckets: prefix-ratio bucket edges (fractions, increasing).
        requests_per_bucket: requests drawn per bucket.
        depths: reuse depths to measure; empty = ``0..L``.
        codecs: names in :data:`CODEC_POLICIES` for the payload of table rows.
        floors: criterion name (:data:`~kvtune.bicache.stats.CRITERIA`) -> floor for the depth
            choice; applied to the lower 95 % bootstrap bound.
        table_floors: accuracy floors (relative retrieval accuracy) of the policy table.
        batch_size: requests per forward pass in the quality pass.
        throughput_batch: requests per timed forward pass.
        repeats: timed repeats per depth (median kept), after one warm-up round.
        pooling: document pooling, ``"suffix"`` (exclude the instruction) or ``"all"``.
        seed: request sampling and bootstrap seed.
        device: torch device.
        threads: torch intra-op threads (None = leave as is); 1 (default) keeps timings stable on a
            CPU shared with other jobs (measured: 2 threads next to another job gave depth-6
            reuse 0.9x, 1 thread 3x).
        workload: workload name stored in the table.
    """

    version: int = SETTINGS_VERSION
    model: str = "all-minilm-l6-v2"
    data: str = "narrativeqa"
    instruction: str = DEFAULT_INSTRUCTION
    buckets: tuple[float, ...] = DEFAULT_BUCKETS
    requests_per_bucket: int = 48
    depths: tuple[int, ...] = ()
    codecs: tuple[str, ...] = ("bf16", "kivi-8", "kivi-4", "kivi-2")
    floors: Mapping[str, float] = field(default_factory=lambda: {c.name: c.default_floor for c in CRITERIA.values()})
    table_floors: tuple[float, ...] = DEFAULT_FLOORS
    batch_size: int = 16
    throughput_batch: int = 8
    repeats: int = 7
    pooling: str = "suffix"
    seed: int = 0
    device: str = "cpu"
    threads: int | None = 1
    workload: str = "instructed-retrieval"

    def __post_init__(self) -> None:
        if self.version != SETTINGS_VERSION:
            raise BiCacheError(f"BiCache settings version {self.version} is not supported ({SETTINGS_VERSION})")
        unknown = [c for c in self.codecs if c not in CODEC_POLICIES]
        if unknown:
            raise BiCacheError(f"unknown codec policy {unknown[0]!r}; known: {sorted(CODEC_POLICIES)}")
        bad = [c for c in self.floors if c not in CRITERIA]
        if bad:
            raise BiCacheError(f"unknown quality criterion {bad[0]!r}; known: {sorted(CRITERIA)}")
        if self.pooling not in POOLINGS:
            raise BiCacheError(f"pooling must be one of {POOLINGS}, got {self.pooling!r}")
        if self.requests_per_bucket < 2 or self.batch_size < 1 or self.throughput_batch < 1 or self.repeats < 1:
            raise BiCacheError("requests_per_bucket >= 2, batch sizes >= 1 and repeats >= 1 are required")
        parse_buckets(self.buckets)
        object.__setattr__(self, "buckets", tuple(float(x) for x in self.buckets))
        object.__setattr__(self, "depths", tuple(int(d) for d in self.depths))
        object.__setattr__(self, "codecs", tuple(self.codecs))
        object.__setattr__(self, "table_floors", tuple(float(f) for f in self.table_floors))
        object.__setattr__(self, "floors", {str(k): float(v) for k, v in dict(self.floors).items()})

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> BiCacheSettings:
        """Build from :meth:`to_dict` output (:meth:`RunSettings.from_dict`, a missing version
        read as 1).

        Raises:
            BiCacheError: unknown keys, a value of the wrong type, or invalid settings.
        """
        names = {f.name for f in dataclasses.fields(cls)}
        extra = set(d) - names
        if extra:
            raise BiCacheError(f"unknown BiCache setting(s) {sorted(extra)}")
        try:
            return super().from_dict({"version": SETTINGS_VERSION, **d})
        except BiCacheError:
            raise
        except KvtuneError as exc:
            raise BiCacheError(f"BiCache {exc}") from None


@dataclass(frozen=True)
class BiCacheResult:
    """What :func:`run_bicache_profile` wrote and measured.

    Attributes:
        run_dir: the run folder.
        depth_table: one row per bucket: ``key``, ``prefix_ratio_lo/hi``, ``chosen_depth``,
            quality intervals at it, ``requests_per_s_recompute``, ``requests_per_s_reuse``,
            ``speedup``.
        quality, layer_cosine, throughput, candidates: the frames also saved as Parquet.
        table: the compiled :class:`PolicyTable`.
    """

    run_dir: Path
    depth_table: pd.DataFrame
    quality: pd.DataFrame
    layer_cosine: pd.DataFrame
    throughput: pd.DataFrame
    candidates: pd.DataFrame
    table: PolicyTable


def _noop(*_: Any, **__: Any) -> None:
    return None


def run_bicache_profile(
    settings: BiCacheSettings,
    run_dir: str | Path,
    *,
    adapter: EncoderAdapter | None = None,
    tokenizer: Any = None,
    on_stage: Callable[[str], None] = _noop,
    resume: bool = False,
    reports: str | Path | None = None,
    on_trial: Callable[[str], None] = _noop,
) -> BiCacheResult:
    """Profile BiCache reuse on an encoder and write the run folder (see the module docstring).

    Each prefix-ratio bucket's measurements are appended to ``trials.jsonl`` as one record
    when the bucket is done; with ``resume`` the stored buckets are not measured again.

    Args:
        settings: what to measure.
        run_dir: output folder (created; files are replaced atomically).
        adapter, tokenizer: an already loaded encoder (tests pass a tiny one); default: load
            ``settings.model`` with :func:`~kvtune.bicache.adapters.load_encoder`.
        on_stage: called with a one-line progress message at each stage.
        resume: continue the buckets stored in ``run_dir`` (without it, stored trials are an
            error).
        reports: folder receiving the HTML report ``<run>.html`` (None: no report).
        on_trial: called with a bucket's key after its record is stored.

    Returns:
        :class:`BiCacheResult`.

    Raises:
        BiCacheError, AssetError, DataError: bad settings, model or data (a run that fails
            before writing its first file leaves no folder behind).
        RunLockedError: another process is working on ``run_dir``.
    """
    threads_before = torch.get_num_threads()
    if settings.threads:
        torch.set_num_threads(int(settings.threads))
    try:
        with open_run_folder(run_dir):
            if (Path(run_dir) / TrialStore.LOG).exists() and not resume:
                raise BiCacheError(f"run folder {run_dir} already has trials; resume it or use another run name")
            result = _run(settings, Path(run_dir), adapter, tokenizer, on_stage, on_trial, reports)
            if reports is not None:
                write_bicache_report(result.run_dir, Path(reports) / f"{Path(run_dir).name}.html")
            return result
    finally:
        torch.set_num_threads(threads_before)


def _run(settings: BiCacheSettings, run_dir: Path, adapter: EncoderAdapter | None, tokenizer: Any,
         on_stage: Callable[[str], None], on_trial: Callable[[str], None], reports: str | Path | None
         ) -> BiCacheResult:
    t_start = time.perf_counter()
    if adapter is None:
        on_stage(f"loading encoder {settings.model}")
        adapter, tokenizer = load_encoder(settings.model, device=settings.device)
    elif tokenizer is None:
        raise BiCacheError("run_bicache_profile: pass the tokenizer with the adapter")
    L = adapter.num_layers
    depths = sorted(set(settings.depths) | {0}) if settings.depths else list(range(L + 1))
    if depths[-1] > L or depths[0] < 0:
        raise BiCacheError(f"depths {depths} outside 0..{L}")
    buckets = parse_buckets(settings.buckets)
    prefix = instruction_prefix(tokenizer, settings.instruction)
    P = len(prefix)
    on_stage(f"building requests: {len(buckets)} buckets x {settings.requests_per_bucket}, prefix {P} tokens")
    requests, data_info = build_requests(
        tokenizer, prefix, buckets, n_per_bucket=settings.requests_per_bucket, data=settings.data,
        seed=settings.seed, max_positions=adapter.max_positions,
    )
    state = adapter.prefix_state(prefix)
    policies: dict[str, PolicyConfig | None] = {EXACT: None}
    policies.update({name: CODEC_POLICIES[name]() for name in settings.codecs})
    reference_bytes = float(prefix_state_bf16_bytes(P, adapter.hidden_size, L))

    quality_rows, layer_rows, thr_rows, cand_rows, depth_rows = [], [], [], [], []
    frames = {"quality": quality_rows, "layer_cosine": layer_rows, "throughput": thr_rows, "candidates": cand_rows,
              "depth_table": depth_rows}
    store = TrialStore(run_dir, table=False)  # one record per finished bucket: a resumed run skips it
    if not store.log_path.exists():  # what --resume needs, before the first bucket
        atomic_write_text(run_dir / "run.json", strict_dumps(jsonable(
            {"method": "bicache", "settings": settings.to_dict(), "model_info": adapter.describe()}), indent=2))
    done = {r["key"]: r for r in store.load()}
    for b in buckets:
        if b.key in done:
            for name, rows in frames.items():
                rows += done[b.key][name]
            continue
        start = {name: len(rows) for name, rows in frames.items()}
        reqs = requests[b.key]
        summary = ratio_summary(reqs)
        on_stage(f"{b.key}: quality at depths {depths} x {len(policies)} cache variants ({len(reqs)} requests)")
        q_emb = encode_queries(adapter, [r.query_ids for r in reqs], batch_size=settings.batch_size)
        bq = measure_bucket_quality(
            adapter, prefix, state, reqs, q_emb, depths=depths, policies=policies,
            batch_size=settings.batch_size, pooling=settings.pooling, seed=settings.seed,
        )
        common = {"key": b.key, "prefix_ratio_lo": b.lo, "prefix_ratio_hi": b.hi, **summary}
        for row in bq.rows:
            row.update(common)
            if row["depth"] > 0 and row["policy"] != EXACT:
                row.update(bq.payload[(row["depth"], row["policy"])])
        quality_rows += bq.rows
        layer_rows += [{**common, **r} for r in bq.layer_rows]
        on_stage(f"{b.key}: throughput at depths {depths} (batch {settings.throughput_batch}, {settings.repeats} repeats)")
        thr = measure_throughput(adapter, prefix, state, reqs, depths=depths, batch_size=settings.throughput_batch,
                                 repeats=settings.repeats)
        for r in thr:
            r["token_layer_fraction"] = token_layer_fraction(P, summary["suffix_tokens_mean"], r["depth"], L)
        thr_rows += [{**common, **r} for r in thr]
        by_depth = {r["depth"]: r for r in thr}

        # ratio -> depth (exact cache, lower bounds)
        exact = {r["depth"]: r for r in bq.rows if r["policy"] in (EXACT, "recompute")}
        stats = {c: [exact[d][CRITERIA[c].column()] for d in depths] for c in settings.floors}
        chosen = choose_depth(depths, stats, settings.floors, use="criterion statistic")
        at = exact[chosen]
        drow = {**common, "chosen_depth": chosen, "num_layers": L, "requests": len(reqs)}
        for c in CRITERIA:
            drow.update({c: at[c], f"{c}_lo": at[f"{c}_lo"], f"{c}_hi": at[f"{c}_hi"]})
        drow.update({
            "top1_agreement": at["top1_agreement"],
            "retrieval_accuracy": at["retrieval_accuracy"],
            "retrieval_accuracy_base": at["retrieval_accuracy_base"],
            "requests_per_s_recompute": by_depth[0]["requests_per_s"],
            "requests_per_s_reuse": by_depth[chosen]["requests_per_s"],
            "speedup": by_depth[chosen]["speedup"],
            "speedup_min_time": by_depth[chosen]["speedup_min_time"],
            "token_layer_fraction": by_depth[chosen]["token_layer_fraction"],
        })
        depth_rows.append(drow)

        # table candidates
        recompute_s = by_depth[0]["compute_s_per_request"]
        for row in bq.rows:
            d, pname = row["depth"], row["policy"]
            if pname == EXACT:
                continue
            pay = bq.payload.get((d, pname), {"payload_bytes": 0.0, "encode_s": 0.0, "decode_s": 0.0})
            cand_rows.append(bicache_candidate(
                bucket_key=b.key, ratio_lo=b.lo, ratio_hi=b.hi, depth=d, codec=pname,
                codec_config=policies[pname].to_dict() if d and policies.get(pname) else None,
                model=settings.model, prefix_tokens=P, reference_bytes=reference_bytes,
                wire_bytes=pay["payload_bytes"], compute_s=by_depth[d]["compute_s_per_request"],
                recompute_s=recompute_s, encode_s=pay["encode_s"], decode_s=pay["decode_s"],
                bf16_bytes=float(prefix_state_bf16_bytes(P, adapter.hidden_size, d)),
                relative_accuracy=row["relative_retrieval"], relative_accuracy_lo=row["relative_retrieval_lo"],
                relative_accuracy_hi=row["relative_retrieval_hi"], kv_cosine=row["kv_cosine"],
                embedding_cosine=row["embedding_cosine"],
            ))
        store.append({"trial": len(store.load()), "key": b.key,
                      **{name: plain(rows[start[name]:]) for name, rows in frames.items()}})
        on_trial(b.key)

    quality = pd.DataFrame(quality_rows)
    layer_cos = pd.DataFrame(layer_rows)
    throughput = pd.DataFrame(thr_rows)
    candidates = pd.DataFrame(cand_rows)
    depth_table = pd.DataFrame(depth_rows)
    meta = {
        "kv_bytes_per_request": reference_bytes, "method": "bicache", "prefix_tokens": P,
        "reference_volume": "bf16 bytes of the full-depth prefix state (L layers of K/V + final hidden)",
        "run": run_dir.name,
    }
    candidates = mark_admissible(candidates, quality, depth_table, settings.floors)
    table = compile_bicache_table(candidates[candidates["admissible"]], model=settings.model,
                                  workload=settings.workload, device=settings.device, floors=settings.table_floors,
                                  metadata=meta)
    on_stage("writing run folder")
    atomic_write_parquet(quality, run_dir / "quality.parquet")
    atomic_write_parquet(layer_cos, run_dir / "layer_cosine.parquet")
    atomic_write_parquet(throughput, run_dir / "throughput.parquet")
    atomic_write_parquet(candidates, run_dir / "candidates.parquet")
    atomic_write_parquet(depth_table, run_dir / "depth_table.parquet")
    atomic_write_text(run_dir / "depth_table.csv", depth_table.to_csv(index=False))
    atomic_write_text(run_dir / "depth_table.json", strict_dumps(jsonable(depth_table.to_dict("records")), indent=2))
    table.to_parquet(run_dir / "policy_table.parquet")
    table.to_json(run_dir / "policy_table.json")
    info = {
        "method": "bicache",
        "settings": settings.to_dict(),
        "model_info": adapter.describe(),
        "prefix": {"tokens": P, "instruction": settings.instruction},
        "depths": depths,
        "data": data_info,
        "kv_bytes_per_request": reference_bytes,
        "torch_threads": torch.get_num_threads(),
        "platform": platform.platform(),
        "seconds": time.perf_counter() - t_start,
        "reports": None if reports is None else str(reports),
        "files": ["run.json", "depth_table.json", "depth_table.csv", "depth_table.parquet", "quality.parquet",
                  "layer_cosine.parquet", "throughput.parquet", "candidates.parquet", "policy_table.parquet",
                  "policy_table.json", "summary.md"],
    }
    atomic_write_text(run_dir / "summary.md", summary_markdown(depth_table, quality, throughput, layer_cos, settings))
    atomic_write_text(run_dir / "run.json", strict_dumps(jsonable(info), indent=2))
    return BiCacheResult(run_dir, depth_table, quality, layer_cos, throughput, candidates, table)


def mark_admissible(candidates: pd.DataFrame, quality: pd.DataFrame, depth_table: pd.DataFrame,
                    floors: Mapping[str, float]) -> pd.DataFrame:
    """Add the bool column ``admissible``: a (bucket, depth, codec) line may enter the table iff
    its depth is at most the bucket's chosen depth and its own quality (after the codec round
    trip) passes the same floors as the depth choice (:data:`~kvtune.bicache.stats.CRITERIA`
    statistics). Full recompute is always admissible.

    The table's accuracy axis (relative retrieval accuracy) alone is too coarse to keep deep
    reuse out: on all-MiniLM-L6-v2 top-1 retrieval stayed at 100 % of full recompute at depths
    whose embedding cosine fell to 0.98.
    """
    chosen = dict(zip(depth_table["key"], depth_table["chosen_depth"], strict=True))
    q = quality.set_index(["key", "depth", "policy"])
    ok = []
    for r in candidates.to_dict("records"):
        d = int(r["reuse_depth"])
        if d == 0:
            ok.append(True)
            continue
        row = q.loc[(r["key"], d, r["codec"])]
        passes = all(float(row[CRITERIA[c].column()]) >= f for c, f in floors.items())
        ok.append(bool(passes and d <= chosen[r["key"]]))
    return candidates.assign(admissible=ok)


def recompile_run_table(run_dir: str | Path, *, floors: Sequence[float] | None = None
                        ) -> tuple[PolicyTable, pd.DataFrame]:
    """The policy table of a BiCache run folder compiled again from its saved candidates,
    quality and depth table (no re-measurement, nothing written), with
    :func:`mark_admissible`.

    Args:
        floors: table accuracy floors (default: the run's ``table_floors``).

    Returns:
        ``(table, candidates with the admissible column)``.

    Raises:
        BiCacheError: the folder is not a BiCache run.
    """
    run_dir = Path(run_dir)
    try:
        info = json.loads((run_dir / "run.json").read_text(encoding="utf-8"))
        candidates = pd.read_parquet(run_dir / "candidates.parquet")
        quality = pd.read_parquet(run_dir / "quality.parquet")
        depth_table = pd.read_parquet(run_dir / "depth_table.parquet")
    except (OSError, ValueError) as exc:
        raise BiCacheError(f"{run_dir}: not a readable BiCache run folder ({exc})") from None
    if info.get("method") != "bicache":
        raise BiCacheError(f"{run_dir}: run.json is not a BiCache run")
    settings = BiCacheSettings.from_dict(info["settings"])
    candidates = mark_admissible(candidates.drop(columns="admissible", errors="ignore"), quality, depth_table,
                                 settings.floors)
    meta = {
        "kv_bytes_per_request": float(info["kv_bytes_per_request"]), "method": "bicache",
        "prefix_tokens": int(info["prefix"]["tokens"]),
        "reference_volume": "bf16 bytes of the full-depth prefix state (L layers of K/V + final hidden)",
        "run": run_dir.name,
    }
    table = compile_bicache_table(candidates[candidates["admissible"]], model=settings.model,
                                  workload=settings.workload, device=settings.device,
                                  floors=settings.table_floors if floors is None else tuple(floors), metadata=meta)
    return table, candidates


def compile_run_table(run_dir: str | Path) -> PolicyTable:
    """Recompile ``policy_table.{parquet,json}`` of a BiCache run folder from its saved
    candidates, quality and depth table (:func:`recompile_run_table`) and write them.

    Raises:
        BiCacheError: the folder is not a BiCache run.
    """
    run_dir = Path(run_dir)
    table, candidates = recompile_run_table(run_dir)
    atomic_write_parquet(candidates, run_dir / "candidates.parquet")
    table.to_parquet(run_dir / "policy_table.parquet")
    table.to_json(run_dir / "policy_table.json")
    return table


def write_bicache_report(run_dir: str | Path, path: str | Path) -> Path:
    """The HTML report of a BiCache run (:func:`kvtune.report.html.write_report`): every
    admissible (bucket, depth, codec) line as a trial, their Pareto front, the per-key and
    per-floor table intervals, and ``run.json``.

    Raises:
        BiCacheError: the folder is not a BiCache run.
    """
    from kvtune.pareto import pareto_front
    from kvtune.report.html import write_report

    run_dir = Path(run_dir)
    table, candidates = recompile_run_table(run_dir)
    lines = candidates[candidates["admissible"]].reset_index(drop=True)
    info = json.loads((run_dir / "run.json").read_text(encoding="utf-8"))
    return write_report(lines, pareto_front(lines), table, path, title=f"kvtune BiCache profile: {run_dir.name}",
                        run_config=info)


def finalize_bicache_run(run_dir: str | Path) -> dict[str, Path]:
    """``kvtune report`` of a BiCache run: the tables (:func:`compile_run_table`) and the HTML
    report, to ``<reports>/<run>.html`` when ``run.json`` records ``reports``, else
    ``<run_dir>/report.html``.

    Raises:
        BiCacheError: the folder is not a finished BiCache run.
    """
    run_dir = Path(run_dir)
    with open_run_folder(run_dir, create=False):
        recompile_run_table(run_dir)  # everything checked before anything is written
        compile_run_table(run_dir)
        reports = json.loads((run_dir / "run.json").read_text(encoding="utf-8")).get("reports")
        path = Path(reports) / f"{run_dir.name}.html" if isinstance(reports, str) else run_dir / "report.html"
        return {"policy_table": run_dir / "policy_table.parquet", "policy_table_json": run_dir / "policy_table.json",
                "report": write_bicache_report(run_dir, path)}


def _fmt_iv(m: float, lo: float, hi: float, digits: int = 3) -> str:
    return f"{m:.{digits}f} [{lo:.{digits}f}, {hi:.{digits}f}]"



def _pivot_table(frame: pd.DataFrame, columns: str, values: str, head: str, cell: str) -> list[str]:
    """Markdown rows of ``frame`` pivoted to prefix-ratio keys x ``columns``."""
    piv = frame.pivot(index="key", columns=columns, values=values)
    lines = ["| prefix ratio | " + " | ".join(head.format(c) for c in piv.columns) + " |",
             "|---|" + "---|" * len(piv.columns)]
    for key, row in piv.iterrows():
        lines.append(f"| {key} | " + " | ".join(cell.format(v) for v in row.to_numpy()) + " |")
    return lines


def summary_markdown(depth_table: pd.DataFrame, quality: pd.DataFrame, throughput: pd.DataFrame,
                     layer_cos: pd.DataFrame, settings: BiCacheSettings) -> str:
    """Human-readable Markdown of a run: ratio -> depth, throughput, per-layer cosines."""
    floors = ", ".join(f"{CRITERIA[k].column()} >= {v:g}" for k, v in settings.floors.items())
    lines = [
        "# BiCache profile", "",
        f"model `{settings.model}`, data `{settings.data}`, {settings.requests_per_bucket} requests per bucket, "
        f"floors (`_lo` = lower end of the 95 % bootstrap interval): {floors}. "
        "Intervals: 95 % bootstrap over requests. Gain: median requests/s at the depth / at full "
        "recompute (one thread, batch of 8 real requests); 'token-layers' = share of full recompute's "
        "token x layer evaluations.", "",
        "## Prefix ratio -> reuse depth", "",
        "| prefix ratio | mean ratio | depth | KV cosine | embedding cosine | relative retrieval | req/s recompute | req/s reuse | gain | token-layers |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in depth_table.to_dict("records"):
        lines.append(
            f"| [{r['prefix_ratio_lo']:.2f}, {r['prefix_ratio_hi']:.2f}) | {r['ratio_mean']:.2f} | {r['chosen_depth']}/{r['num_layers']} "
            f"| {_fmt_iv(r['kv_cosine'], r['kv_cosine_lo'], r['kv_cosine_hi'])} "
            f"| {_fmt_iv(r['embedding_cosine'], r['embedding_cosine_lo'], r['embedding_cosine_hi'], 4)} "
            f"| {_fmt_iv(r['relative_retrieval'], r['relative_retrieval_lo'], r['relative_retrieval_hi'])} "
            f"| {r['requests_per_s_recompute']:.1f} | {r['requests_per_s_reuse']:.1f} | {r['speedup']:.2f}x "
            f"| {r['token_layer_fraction']:.2f} |"
        )
    lines += ["", "## Throughput gain by depth (requests/s with reuse / full recompute)", ""]
    lines += _pivot_table(throughput, "depth", "speedup", "d={}", "{:.2f}x")
    lines += ["", "## Quality by depth (exact cache): embedding cosine, lower bound", ""]
    ex = quality[quality["policy"].isin([EXACT, "recompute"])]
    lines += _pivot_table(ex, "depth", "embedding_cosine_lo", "d={}", "{:.4f}")
    lines += ["", "## Prefix key cosine per layer, prefix alone vs in context (mean)", ""]
    lines += _pivot_table(layer_cos, "layer", "key_cosine", "L{}", "{:.3f}")
    return "\n".join(lines) + "\n"
