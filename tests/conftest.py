"""Shared fixtures: a tiny random Llama (fast, offline) and the real default model (once per session)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch


def make_tiny_llama(folder: Path, *, layers: int = 2, kv_heads: int = 2, head_dim: int = 16, vocab_words: int = 200) -> Path:
    """Save a randomly initialised Llama with a whitespace word-level tokenizer to ``folder``."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<eos>": 1, **{f"w{i}": i + 2 for i in range(vocab_words)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<eos>").save_pretrained(folder)
    heads = kv_heads * 2
    cfg = LlamaConfig(vocab_size=len(vocab), hidden_size=heads * head_dim, intermediate_size=64, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=1024)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(folder)
    return folder


def make_word_text(path: Path, *, words: int = 3000, vocab_words: int = 200, seed: int = 0) -> Path:
    """A .txt file of pseudo-words the tiny tokenizer knows (for fast CLI tests only)."""
    rng = random.Random(seed)
    path.write_text(" ".join(f"w{rng.randrange(vocab_words)}" for _ in range(words)))
    return path


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def tiny_text(tmp_path_factory) -> Path:
    return make_word_text(tmp_path_factory.mktemp("text") / "words.txt")


@pytest.fixture(scope="session")
def real_lm():
    """SmolLM2-135M-Instruct from its wheel (downloaded once, cached), loaded once per session."""
    from kvtune.evaluate.model import load_model

    return load_model("smollm2-135m-instruct", "cpu")


@pytest.fixture(scope="session")
def real_capture(real_lm):
    """KV and baseline of 4 real essay contexts of 512 tokens + 64 continuation tokens."""
    from kvtune.assets import read_texts
    from kvtune.evaluate.capture import build_contexts, capture

    ids = build_contexts(real_lm.tokenizer, read_texts("paul-graham-essays"), n_contexts=4, context_tokens=512,
                         continuation_tokens=64)
    return capture(real_lm, ids, 512)
