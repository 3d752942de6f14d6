"""Tiny runs of every registered method (seconds on a CPU), shared by the method, SCD, BiCache
and report tests: the tiny Llama of ``tests/conftest.py`` (T/Q/C; SCD with a perturbed copy as
consumer) and a tiny BERT with a WordPiece vocabulary (BiCache)."""

from __future__ import annotations

import copy
import json
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvtune.evaluate.model import LoadedModel, load_model

#: Words of the tiny BERT's vocabulary (after the 5 special tokens).
WORDS = [f"w{i}" for i in range(120)]


def finetuned(lm: LoadedModel, seed: int, scale: float = 0.05) -> LoadedModel:
    """A consumer with every weight matrix perturbed (a stand-in for a fine-tune)."""
    model = copy.deepcopy(lm.model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 2:
                p.add_(scale * p.std() * torch.randn(p.shape, generator=g))
    return LoadedModel(name="consumer-ft", model=model, tokenizer=lm.tokenizer, device=lm.device)


def scd_pair_settings(lm: LoadedModel, folder: Path, **settings: Any) -> tuple[LoadedModel, Any]:
    """A consumer perturbed from ``lm``, domain data written to ``folder`` and small SCD
    settings (``settings`` override them)."""
    from kvtune.methods.scd.profile import SCDProfileSettings

    rng = np.random.default_rng(0)
    data = folder / "docs.jsonl"
    data.write_text("\n".join(json.dumps({"document": " ".join(f"w{i}" for i in rng.integers(0, 200, 120))})
                              for _ in range(60)))
    consumer = finetuned(lm, seed=4, scale=0.2)
    st = SCDProfileSettings(**{"data": str(data), "calib_windows": 4, "calib_tokens": 32, "contexts": 4,
                               "context_tokens": 32, "continuation_tokens": 8, "profile_contexts": 2,
                               "ranks": (8, 64), "patch_counts": (0, 1), "droidspeak_lengths": (1,),
                               "tqc_presets": ("kivi-4",), **settings})
    return consumer, st


def bert_config(**kw: Any) -> Any:
    """The tiny BERT's configuration: 2 layers, hidden 32, 4 heads."""
    from transformers import BertConfig

    return BertConfig(vocab_size=len(WORDS) + 5, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                      intermediate_size=64, max_position_embeddings=256, **kw)


def make_tiny_bert(folder: Path) -> Path:
    """A tiny BERT + WordPiece tokenizer saved to ``folder`` (what ``load_encoder`` reads)."""
    from transformers import BertModel, BertTokenizerFast

    folder.mkdir(parents=True, exist_ok=True)
    vocab = folder / "vocab.txt"
    vocab.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS]) + "\n")
    BertTokenizerFast(vocab_file=str(vocab), do_lower_case=True).save_pretrained(folder)
    torch.manual_seed(1)
    BertModel(bert_config(), add_pooling_layer=False).save_pretrained(folder)
    return folder


def make_qa_data(path: Path) -> Path:
    """JSONL passage/question/answer records over 12 random-word stories."""
    rng = random.Random(0)
    lines = []
    for _ in range(12):
        passage = " ".join(rng.choice(WORDS) for _ in range(160))
        for _ in range(3):
            words = passage.split()
            i = rng.randrange(len(words) - 6)
            lines.append(json.dumps({"passage": passage, "question": " ".join(words[i:i + 5]), "answer": words[i + 5]}))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    return path


def bicache_settings(model: Path, data: Path) -> Any:
    """Small BiCache settings: 2 buckets x 8 requests, bf16 and kivi-4 payloads, one repeat."""
    from kvtune.methods.bicache import BiCacheSettings

    return BiCacheSettings(
        model=str(model), data=str(data), instruction=" ".join(WORDS[:15]), buckets=(0.3, 0.6, 0.9),
        requests_per_bucket=8, codecs=("bf16", "kivi-4"), batch_size=4, throughput_batch=4, repeats=1,
        floors={"kv_cosine": 0.9, "embedding_cosine": 0.98, "relative_retrieval": 0.9}, table_floors=(0.99, 0.9),
    )


def tiny_method_run(name: str, root: Path, tiny_model_dir: Path, tiny_text: Path) -> Path:
    """The run folder of a tiny run of registered method ``name`` under ``root`` (its report is
    ``<root>/reports/<run>.html`` for T/Q/C, ``<run folder>/report.html`` otherwise).

    Raises:
        KeyError: a method without a tiny run here (add one when registering a method).
    """
    torch.set_num_threads(1)
    if name == "tqc":
        from kvtune.methods.tqc.profile import run_profile
        from kvtune.methods.tqc.settings import ProfileSettings

        settings = ProfileSettings(model=str(tiny_model_dir), text=str(tiny_text), contexts=3, context_tokens=48,
                                   continuation_tokens=8, budget=6, device="cpu", out=str(root / "profiles"),
                                   reports=str(root / "reports"), run="tiny", refine=False)
        return run_profile(settings).run_dir
    if name == "scd":
        from kvtune.methods.scd.profile import run_scd_profile

        lm = load_model(str(tiny_model_dir), "cpu")
        consumer, st = scd_pair_settings(lm, root)
        return run_scd_profile(lm, consumer, root / "scd-run", settings=st).run_dir
    if name == "bicache":
        from kvtune.methods.bicache import run_bicache_profile
        from kvtune.methods.bicache.adapters import load_encoder

        model = make_tiny_bert(root / "tiny-bert")
        adapter, tokenizer = load_encoder(str(model))
        return run_bicache_profile(bicache_settings(model, make_qa_data(root / "qa.jsonl")), root / "bicache-run",
                                   adapter=adapter, tokenizer=tokenizer).run_dir
    raise KeyError(f"no tiny run for method {name!r} in tests/tiny_runs.py")


def report_path(run_dir: Path) -> Path:
    """The HTML report a run wrote (``run.json``'s ``reports`` folder, else the run folder)."""
    info = json.loads((run_dir / "run.json").read_text())
    reports = info.get("reports") or (info.get("settings") or {}).get("reports")
    path = Path(reports) / f"{run_dir.name}.html" if reports else run_dir / "report.html"
    return path if path.is_file() else run_dir / "report.html"
