"""``run_bicache_profile``: the BiCache reuse-depth profile of an encoder, written to a run folder.

Steps (BiCache, "Enabling KV Caching of Shared Prefix for Diffusion Language Models",
arXiv 2606.07571, Sec. 3-4), on the shared runner (:mod:`kvtune.run.runner`): step 1 is
:meth:`BiCacheMethod.prepare`, steps 2-3 evaluate one bucket (:func:`measure_bucket`, one
trial row per bucket), steps 4-5 :meth:`BiCacheMethod.compile`:

1. load the encoder and build requests per prefix-ratio bucket
   (:mod:`kvtune.methods.bicache.workload`), cache the shared prefix's state (prefix alone);
2. per bucket: quality at every depth vs full recompute, with the exact in-memory cache and
   with every codec policy of the payload (:mod:`kvtune.methods.bicache.quality`);
3. per bucket: requests/s at every depth (:mod:`kvtune.methods.bicache.throughput`);
4. the ratio -> depth table: per bucket the deepest d whose lower bootstrap bounds stay above
   every floor (:func:`kvtune.methods.bicache.stats.choose_depth`);
5. ``method = "bicache"`` policy-table rows keyed by bucket (:mod:`kvtune.methods.bicache.table`), from
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
import platform
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd
import torch

from kvtune.methods.bicache.adapters import EncoderAdapter, load_encoder
from kvtune.methods.bicache.quality import EXACT, POOLINGS, encode_queries, measure_bucket_quality
from kvtune.methods.bicache.state import prefix_state_bf16_bytes
from kvtune.methods.bicache.stats import CRITERIA, choose_depth
from kvtune.methods.bicache.table import bicache_candidate, compile_bicache_table
from kvtune.methods.bicache.throughput import measure_throughput, token_layer_fraction
from kvtune.methods.bicache.workload import (
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
from kvtune.core.errors import BiCacheError, ConfigError, KvtuneError
from kvtune.run.settings import RunSettings, check_floors
from kvtune.run.method import Compiled, Hooks, Method, ProfileRequest, Stage
from kvtune.run.store import TrialStore
from kvtune.tables.policy_table import DEFAULT_FLOORS, PolicyTable
from kvtune.tables.run import run_name

__all__ = ["CODEC_POLICIES", "BiCacheMethod", "BiCacheResult", "BiCacheSettings", "compile_run_table",
           "mark_admissible", "measure_bucket", "run_bicache_profile"]

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
        floors: criterion name (:data:`~kvtune.methods.bicache.stats.CRITERIA`) -> floor for the depth
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
        try:
            object.__setattr__(self, "table_floors", check_floors(self.table_floors, "table_floors"))
        except ConfigError as exc:
            raise BiCacheError(str(exc)) from None
        bad_floor = [(k, v) for k, v in dict(self.floors).items()
                     if not isinstance(v, (int, float)) or isinstance(v, bool) or not -1.0 <= v <= 1.0]
        if bad_floor:
            raise BiCacheError(f"floors: {bad_floor[0][0]!r} must be a number in [-1, 1], got {bad_floor[0][1]!r}")
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


@dataclass
class BiCacheContext:
    """What :meth:`BiCacheMethod.prepare` builds once per run: the encoder, the shared prefix
    and its cached state, the requests per bucket and the codec policies (a
    :meth:`BiCacheMethod.driver_view` has no encoder, state or requests)."""

    settings: BiCacheSettings
    adapter: EncoderAdapter
    depths: list[int]
    buckets: list[Any]
    prefix: list[int]
    state: Any
    requests: dict[str, list[Any]]
    policies: dict[str, PolicyConfig | None]
    reference_bytes: float
    info: dict[str, Any]
    say: Callable[[str], None]
    threads_before: int


@dataclass(frozen=True)
class BucketCandidate:
    """One prefix-ratio bucket as a candidate of the ``buckets`` stage (id = its key)."""

    index: int
    bucket: Any

    @property
    def policy_id(self) -> str:
        return self.bucket.key


class BiCacheMethod(Method):
    """``--method bicache`` on the shared runner (:mod:`kvtune.run.runner`).

    Candidates: the prefix-ratio buckets (a fixed list, ``exhaustive``); a bucket's trial row
    holds all its measurements (quality, per-layer cosine, throughput, depth choice, table
    lines). Table: :func:`~kvtune.methods.bicache.table.compile_bicache_table` over the admissible
    lines (:func:`mark_admissible`), keyed by bucket, no implicit ``"none"``.
    """

    name = "bicache"
    description = "shared-prefix KV reuse depth for bidirectional encoders (BiCache)"
    settings_class = BiCacheSettings
    flat_trials = False
    report_title = "kvtune BiCache profile"

    def settings_for(self, request: ProfileRequest) -> BiCacheSettings:
        from kvtune.run.settings import parse_overrides

        return BiCacheSettings(**{"seed": request.seed, "device": "cpu" if request.device == "auto" else request.device,
                                  **({"model": request.model} if request.model else {}),
                                  **parse_overrides(BiCacheSettings, request.options)})

    def run_name(self, settings: BiCacheSettings) -> str:
        return f"bicache-{Path(settings.model).name}"

    def prepare(self, settings: BiCacheSettings, run_dir: Path, hooks: Hooks, **given: Any) -> BiCacheContext:
        threads_before = torch.get_num_threads()
        if settings.threads:
            torch.set_num_threads(int(settings.threads))
        adapter, tokenizer, say = given.get("adapter"), given.get("tokenizer"), hooks.say
        if adapter is None:
            say(f"loading encoder {settings.model}")
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
        say(f"building requests: {len(buckets)} buckets x {settings.requests_per_bucket}, prefix {P} tokens")
        requests, data_info = build_requests(
            tokenizer, prefix, buckets, n_per_bucket=settings.requests_per_bucket, data=settings.data,
            seed=settings.seed, max_positions=adapter.max_positions,
        )
        policies: dict[str, PolicyConfig | None] = {EXACT: None}
        policies.update({name: CODEC_POLICIES[name]() for name in settings.codecs})
        reference_bytes = float(prefix_state_bf16_bytes(P, adapter.hidden_size, L))
        info = {"model_info": adapter.describe(), "prefix": {"tokens": P, "instruction": settings.instruction},
                "depths": depths, "data": data_info, "kv_bytes_per_request": reference_bytes,
                "torch_threads": torch.get_num_threads(), "platform": platform.platform(), "files": list(FILES)}
        return BiCacheContext(settings=settings, adapter=adapter, depths=depths, buckets=buckets, prefix=prefix,
                              state=adapter.prefix_state(prefix), requests=requests, policies=policies,
                              reference_bytes=reference_bytes, info=info, say=say, threads_before=threads_before)

    def driver_view(self, context: BiCacheContext) -> BiCacheContext:
        """The context without the encoder, the prefix state and the requests: the settings,
        the buckets (the candidates), the policies and ``run.json``'s keys."""
        return dataclasses.replace(context, adapter=None, state=None, requests={})

    def run_info(self, context: BiCacheContext) -> dict[str, Any]:
        return context.info

    def close(self, context: BiCacheContext) -> None:
        torch.set_num_threads(context.threads_before)

    def stages(self, context: BiCacheContext, stored: list[dict[str, Any]]) -> Iterator[Stage]:
        from kvtune.run.loop import in_order

        cands = [BucketCandidate(i, b) for i, b in enumerate(context.buckets)]
        by_key = {r["key"]: r for r in stored}
        yield Stage("buckets", cands, in_order(cands), len(cands),
                    {c.policy_id: by_key[c.policy_id] for c in cands if c.policy_id in by_key},
                    title="measure prefix-ratio buckets")

    def describe_row(self, row: dict[str, Any]) -> str:
        return str(row["key"])

    def evaluate(self, context: BiCacheContext, candidate: BucketCandidate, stage: Stage) -> dict[str, Any]:
        return measure_bucket(context, candidate.bucket)

    def compile(self, run_dir: Path, info: dict[str, Any], records: list[dict[str, Any]],
                floors: Sequence[float] | None = None) -> Compiled:
        if info.get("method") != "bicache":
            raise BiCacheError(f"{run_dir}: run.json is not a BiCache run")
        settings = BiCacheSettings.from_dict(info["settings"])
        frames = {name: pd.DataFrame([row for r in records for row in r[name]]) for name in FRAMES}
        meta = {
            "kv_bytes_per_request": float(info["kv_bytes_per_request"]), "method": "bicache",
            "prefix_tokens": int(info["prefix"]["tokens"]),
            "reference_volume": "bf16 bytes of the full-depth prefix state (L layers of K/V + final hidden)",
            "run": run_name(info, run_dir.name),
        }
        candidates = mark_admissible(frames["candidates"], frames["quality"], frames["depth_table"], settings.floors)
        lines = candidates[candidates["admissible"]].reset_index(drop=True)
        table = compile_bicache_table(lines, model=settings.model, workload=settings.workload, device=settings.device,
                                      floors=settings.table_floors if floors is None else tuple(floors), metadata=meta)
        depth_table = frames["depth_table"]
        return Compiled(
            trials=None, points=lines, table=table,
            frames={"quality.parquet": frames["quality"], "layer_cosine.parquet": frames["layer_cosine"],
                    "throughput.parquet": frames["throughput"], "candidates.parquet": candidates,
                    "depth_table.parquet": depth_table},
            texts={"depth_table.csv": depth_table.to_csv(index=False),
                   "depth_table.json": strict_dumps(jsonable(depth_table.to_dict("records")), indent=2),
                   "summary.md": summary_markdown(depth_table, frames["quality"], frames["throughput"],
                                                  frames["layer_cosine"], settings)})

    def report_sections(self, run_dir: Path, info: dict[str, Any], compiled: Compiled) -> list[Any]:
        """Safe reuse depth per bucket (with the floors), per-layer prefix K/V cosine heatmaps,
        throughput gain and the ``summary.md`` tables (:func:`kvtune.methods.bicache.report.bicache_sections`)."""
        from kvtune.methods.bicache.report import bicache_sections

        frames = {name: compiled.frames[f"{name}.parquet"] for name in ("depth_table", "quality", "layer_cosine",
                                                                        "throughput")}
        return bicache_sections(frames, BiCacheSettings.from_dict(info["settings"]).floors)


#: The per-bucket frames of a BiCache trial row.
FRAMES = ("quality", "layer_cosine", "throughput", "candidates", "depth_table")
#: The files of a BiCache run folder (module docstring).
FILES = ("run.json", "depth_table.json", "depth_table.csv", "depth_table.parquet", "quality.parquet",
         "layer_cosine.parquet", "throughput.parquet", "candidates.parquet", "policy_table.parquet",
         "policy_table.json", "summary.md")


def measure_bucket(ctx: BiCacheContext, b: Any) -> dict[str, Any]:
    """One bucket's trial row: ``key`` and the rows of every frame in :data:`FRAMES`
    (quality at every depth and codec, per-layer cosines, throughput, the chosen depth and the
    table lines)."""
    settings, adapter, prefix, depths, policies = ctx.settings, ctx.adapter, ctx.prefix, ctx.depths, ctx.policies
    L, P = adapter.num_layers, len(prefix)
    reqs = ctx.requests[b.key]
    summary = ratio_summary(reqs)
    ctx.say(f"{b.key}: quality at depths {depths} x {len(policies)} cache variants ({len(reqs)} requests)")
    q_emb = encode_queries(adapter, [r.query_ids for r in reqs], batch_size=settings.batch_size)
    bq = measure_bucket_quality(
        adapter, prefix, ctx.state, reqs, q_emb, depths=depths, policies=policies,
        batch_size=settings.batch_size, pooling=settings.pooling, seed=settings.seed,
    )
    common = {"key": b.key, "prefix_ratio_lo": b.lo, "prefix_ratio_hi": b.hi, **summary}
    for row in bq.rows:
        row.update(common)
        if row["depth"] > 0 and row["policy"] != EXACT:
            row.update(bq.payload[(row["depth"], row["policy"])])
    ctx.say(f"{b.key}: throughput at depths {depths} (batch {settings.throughput_batch}, {settings.repeats} repeats)")
    thr = measure_throughput(adapter, prefix, ctx.state, reqs, depths=depths, batch_size=settings.throughput_batch,
                             repeats=settings.repeats)
    for r in thr:
        r["token_layer_fraction"] = token_layer_fraction(P, summary["suffix_tokens_mean"], r["depth"], L)
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

    # table candidates
    recompute_s = by_depth[0]["compute_s_per_request"]
    cand_rows = []
    for row in bq.rows:
        d, pname = row["depth"], row["policy"]
        if pname == EXACT:
            continue
        pay = bq.payload.get((d, pname), {"payload_bytes": 0.0, "encode_s": 0.0, "decode_s": 0.0})
        cand_rows.append(bicache_candidate(
            bucket_key=b.key, ratio_lo=b.lo, ratio_hi=b.hi, depth=d, codec=pname,
            codec_config=policies[pname].to_dict() if d and policies.get(pname) else None,
            model=settings.model, prefix_tokens=P, reference_bytes=ctx.reference_bytes,
            wire_bytes=pay["payload_bytes"], compute_s=by_depth[d]["compute_s_per_request"],
            recompute_s=recompute_s, encode_s=pay["encode_s"], decode_s=pay["decode_s"],
            bf16_bytes=float(prefix_state_bf16_bytes(P, adapter.hidden_size, d)),
            relative_accuracy=row["relative_retrieval"], relative_accuracy_lo=row["relative_retrieval_lo"],
            relative_accuracy_hi=row["relative_retrieval_hi"], kv_cosine=row["kv_cosine"],
            embedding_cosine=row["embedding_cosine"],
        ))
    return {"key": b.key, **plain({"quality": bq.rows, "layer_cosine": [{**common, **r} for r in bq.layer_rows],
                                   "throughput": [{**common, **r} for r in thr], "candidates": cand_rows,
                                   "depth_table": [drow]})}


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
    """Profile BiCache reuse on an encoder and write the run folder (see the module docstring)
    with the shared runner (:func:`kvtune.run.runner.run_method`, :class:`BiCacheMethod`).

    Each prefix-ratio bucket's measurements are appended to ``trials.jsonl`` as one record
    when the bucket is done; with ``resume`` the stored buckets are not measured again.

    Args:
        settings: what to measure.
        run_dir: output folder (created; files are replaced atomically).
        adapter, tokenizer: an already loaded encoder (tests pass a tiny one); default: load
            ``settings.model`` with :func:`~kvtune.methods.bicache.adapters.load_encoder`.
        on_stage: called with a one-line progress message at each stage.
        resume: continue the buckets stored in ``run_dir`` (without it, stored trials are an
            error).
        reports: folder receiving the HTML report ``<run>.html`` (None: ``<run_dir>/report.html``).
        on_trial: called with a bucket's key after its record is stored.

    Returns:
        :class:`BiCacheResult`.

    Raises:
        BiCacheError, AssetError, DataError: bad settings, model or data, trials stored without
            ``resume`` (a run that fails before writing its first file leaves no folder behind).
        RunLockedError: another process is working on ``run_dir``.
    """
    from kvtune.run.method import METHODS
    from kvtune.run.runner import run_method

    if (Path(run_dir) / TrialStore.LOG).exists() and not resume:
        raise BiCacheError(f"run folder {run_dir} already has trials; resume it or use another run name")
    res = run_method(METHODS["bicache"], settings, run_dir, resume=resume, reports=reports,
                     hooks=Hooks(say=on_stage, on_trial=lambda row: on_trial(row["key"])), adapter=adapter,
                     tokenizer=tokenizer)
    f = res.compiled.frames
    return BiCacheResult(Path(run_dir), f["depth_table.parquet"], f["quality.parquet"], f["layer_cosine.parquet"],
                         f["throughput.parquet"], f["candidates.parquet"], res.table)


def mark_admissible(
candidates: pd.DataFrame, quality: pd.DataFrame, depth_table: pd.DataFrame,
                    floors: Mapping[str, float]) -> pd.DataFrame:
    """Add the bool column ``admissible``: a (bucket, depth, codec) line may enter the table iff
    its depth is at most the bucket's chosen depth and its own quality (after the codec round
    trip) passes the same floors as the depth choice (:data:`~kvtune.methods.bicache.stats.CRITERIA`
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


def compile_run_table(run_dir: str | Path, floors: Sequence[float] | None = None) -> PolicyTable:
    """The policy table of a BiCache run folder compiled again from its stored bucket records
    (no re-measurement, nothing written; :meth:`BiCacheMethod.compile`).

    Raises:
        BiCacheError: the folder is not a readable BiCache run.
    """
    from kvtune.run.method import METHODS
    from kvtune.tables.run import read_run_info

    run_dir = Path(run_dir)
    try:
        info = read_run_info(run_dir)
    except KvtuneError as exc:
        raise BiCacheError(f"{run_dir}: not a readable BiCache run folder ({exc})") from None
    if info.get("method") != "bicache":
        raise BiCacheError(f"{run_dir}: run.json is not a BiCache run")
    return METHODS["bicache"].compile_table(run_dir, info, floors)


def summary_markdown(depth_table: pd.DataFrame, quality: pd.DataFrame, throughput: pd.DataFrame,
                     layer_cos: pd.DataFrame, settings: BiCacheSettings) -> str:
    """Human-readable Markdown of a run: ratio -> depth, throughput, per-layer cosines (the
    tables of the HTML report, :func:`kvtune.methods.bicache.report.summary_tables`)."""
    from kvtune.methods.bicache.report import summary_markdown_lines

    floors = ", ".join(f"{CRITERIA[k].column()} >= {v:g}" for k, v in settings.floors.items())
    lines = [
        "# BiCache profile", "",
        f"model `{settings.model}`, data `{settings.data}`, {settings.requests_per_bucket} requests per bucket, "
        f"floors (`_lo` = lower end of the 95 % bootstrap interval): {floors}. "
        "Intervals: 95 % bootstrap over requests. Gain: median requests/s at the depth / at full "
        "recompute (one thread, batch of 8 real requests); 'token-layers' = share of full recompute's "
        "token x layer evaluations.", "",
        *summary_markdown_lines({"depth_table": depth_table, "quality": quality, "throughput": throughput,
                                 "layer_cosine": layer_cos}),
    ]
    return "\n".join(lines) + "\n"
