"""``kvtune bicache ...``: a thin Typer sub-app over :func:`kvtune.bicache.api.run_bicache_profile`.

Mount it with ``app.add_typer(bicache_app, name="bicache")``; run standalone with
``python -m kvtune.bicache.cli profile ...``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from rich.console import Console

from kvtune.errors import KvtuneError
from kvtune.run.folder import check_run_name

app = typer.Typer(help="BiCache: shared-prefix KV reuse for bidirectional encoders (reuse-depth profile).",
                  no_args_is_help=True, add_completion=False)
console = Console(width=None if Console().is_terminal else 160)


@app.callback()
def _root() -> None:
    """BiCache commands."""


def _floats(text: str, what: str) -> tuple[float, ...]:
    try:
        return tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise KvtuneError(f"--{what} {text!r}: expected comma-separated numbers") from None


def _floors(text: str) -> dict[str, float]:
    out = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, _, value = part.partition("=")
        try:
            out[name.strip()] = float(value)
        except ValueError:
            raise KvtuneError(f"--floors {text!r}: expected name=value pairs such as kv_cosine=0.95") from None
    return out


@app.command("profile")
def profile(
    model: str = typer.Option("all-minilm-l6-v2", help="Encoder: named model asset or a BERT-family folder."),
    data: str = typer.Option("narrativeqa", help="QA dataset asset or JSONL (passage/question/answer)."),
    out: Path = typer.Option(Path("profiles"), help="Folder that receives the run folder."),
    run: str = typer.Option("", help="Run name (default: bicache-<model>)."),
    buckets: str = typer.Option("0.15,0.30,0.45,0.60,0.75,0.90", help="Prefix-ratio bucket edges."),
    requests: int = typer.Option(48, min=2, help="Requests per bucket."),
    depths: str = typer.Option("", help="Reuse depths to measure (default 0..L)."),
    codecs: str = typer.Option("bf16,kivi-8,kivi-4,kivi-2", help="Codec policies of the prefix-state payload."),
    floors: str = typer.Option("kv_cosine=0.95,embedding_cosine=0.99,relative_retrieval=0.97",
                               help="Depth-choice floors on the lower 95 % bound, name=value."),
    table_floors: str = typer.Option("0.99,0.97,0.95,0.90", help="Policy-table accuracy floors."),
    repeats: int = typer.Option(7, min=1, help="Timed repeats per depth."),
    threads: int = typer.Option(1, min=0, help="torch threads (0 = leave as is); 1 gives stable timings on a shared CPU."),
    pooling: str = typer.Option("suffix", help="Document pooling: suffix (exclude the instruction) or all."),
    seed: int = typer.Option(0, help="Sampling and bootstrap seed."),
) -> None:
    """Profile the prefix-ratio -> reuse-depth table, throughput and method=bicache table rows."""
    from kvtune.bicache.api import BiCacheSettings, run_bicache_profile

    try:
        settings = BiCacheSettings(
            model=model, data=data, buckets=_floats(buckets, "buckets"), requests_per_bucket=requests,
            depths=tuple(int(d) for d in _floats(depths, "depths")), codecs=tuple(c.strip() for c in codecs.split(",") if c.strip()),
            floors=_floors(floors), table_floors=_floats(table_floors, "table-floors"), repeats=repeats,
            threads=threads or None, pooling=pooling, seed=seed,
        )
        name = check_run_name(run or f"bicache-{Path(model).name}")
        result = run_bicache_profile(settings, out / name, on_stage=lambda m: console.print(f"[dim]{m}[/]"))
    except KvtuneError as exc:
        console.print(f"[bold red]error:[/] {exc}")
        raise typer.Exit(code=2) from None
    console.print((result.run_dir / "summary.md").read_text(encoding="utf-8"))
    console.print(f"run folder: {result.run_dir}")


if __name__ == "__main__":  # pragma: no cover
    app()
