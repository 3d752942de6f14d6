"""``kvtune scd ...``: thin Typer commands over :mod:`kvtune.methods.scd`.

Mounted by the main CLI with ``app.add_typer(kvtune.methods.scd.cli.app, name="scd")``; also
runnable alone: ``python -m kvtune.methods.scd.cli make-consumer``.
"""

from __future__ import annotations

import json
import time

import typer
from rich.console import Console

from kvtune.core.errors import KvtuneError
from kvtune.methods.scd.consumer import ConsumerRecipe

app = typer.Typer(help="Semantic Cache Distillation: cross-model KV transfer (producer -> fine-tuned consumer).",
                  no_args_is_help=True, add_completion=False)
console = Console(width=None if Console().is_terminal else 160)


_R = ConsumerRecipe()  # the defaults of make-consumer are the recipe's


def _fail(exc: Exception) -> None:
    console.print(f"[bold red]error:[/] {exc}")
    raise typer.Exit(code=2)


@app.command("make-consumer")
def make_consumer_cmd(
    producer: str = typer.Option("smollm2-135m-instruct", help="Producer model (asset, .gguf, HF folder or id)."),
    data: str = typer.Option("xsum", help="Domain data: data asset or JSONL file with a 'document' field."),
    steps: int = typer.Option(_R.steps, min=1, help="LoRA optimizer steps."),
    batch_size: int = typer.Option(_R.batch_size, min=1, help="Sequences per step."),
    seq_tokens: int = typer.Option(_R.seq_tokens, min=8, help="Tokens per training sequence."),
    lora_rank: int = typer.Option(_R.lora_rank, min=1, help="LoRA rank."),
    lora_alpha: float = typer.Option(_R.lora_alpha, help="LoRA alpha (scale alpha / rank)."),
    learning_rate: float = typer.Option(_R.learning_rate, "--lr", help="Peak AdamW learning rate."),
    first_layer: int = typer.Option(_R.first_layer, min=0, help="Only layers from this one up get adapters (0 = all)."),
    target_modules: str = typer.Option("q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj",
                                       help="Comma-separated module names that get LoRA adapters."),
    holdout_fraction: float = typer.Option(0.2, help="Fraction of records held out for evaluation."),
    seed: int = typer.Option(0, help="Seed of the LoRA init and the window order."),
    heldout_windows: int = typer.Option(16, min=1, help="Held-out windows for the perplexity comparison."),
    force: bool = typer.Option(False, help="Retrain even if the cached consumer exists."),
    device: str = typer.Option("cpu", help="auto, cpu or cuda."),
    as_json: bool = typer.Option(False, "--json", help="Print the consumer info as JSON."),
) -> None:
    """Fine-tune the producer with LoRA on domain text, merge, cache it; print its path and perplexities."""
    from kvtune.methods.scd.consumer import ConsumerRecipe, make_consumer

    try:
        recipe = ConsumerRecipe(producer=producer, data=data, holdout_fraction=holdout_fraction, steps=steps,
                                batch_size=batch_size, seq_tokens=seq_tokens, lora_rank=lora_rank,
                                lora_alpha=lora_alpha, learning_rate=learning_rate, seed=seed,
                                first_layer=first_layer,
                                target_modules=tuple(t.strip() for t in target_modules.split(",") if t.strip()))
        t0 = time.perf_counter()
        with console.status("fine-tuning the consumer") as status:
            def step_done(s: int, loss: float) -> None:
                line = f"step {s + 1}/{steps}: loss {loss:.3f} ({time.perf_counter() - t0:.0f} s)"
                if console.is_terminal:
                    status.update(line)
                elif (s + 1) % 8 == 0 or s + 1 == steps:  # a log file gets a line every 8 steps
                    console.print(line)

            info = make_consumer(recipe, device=device, heldout_windows=heldout_windows, force=force,
                                 progress=step_done)
    except KvtuneError as exc:
        _fail(exc)
        return
    if as_json:
        console.print_json(json.dumps({k: v for k, v in info.to_json_dict().items() if k != "losses"}))
        return
    console.print(f"consumer: {info.path}" + (" (cached)" if info.cached else
                                               f" (trained in {info.train_seconds:.0f} s, "
                                               f"{time.perf_counter() - t0:.0f} s in all)"))
    console.print(f"held-out perplexity: producer {info.producer_ppl:.2f}, consumer {info.consumer_ppl:.2f} "
                  f"({info.heldout_windows} windows of {recipe.seq_tokens} tokens)")


if __name__ == "__main__":  # pragma: no cover
    app()
