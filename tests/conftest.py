"""Shared fixtures: tiny random Llama / Gemma-3 models (fast, offline) and the real default model (once per session)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "gemma: loads the real Gemma-3-270m (minutes on first use: dequantizes and caches it); "
        "deselect with -m 'not gemma'")


def _save_word_tokenizer(folder: Path, vocab_words: int, extra_words: tuple[str, ...]) -> dict[str, int]:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = [f"w{i}" for i in range(vocab_words)] + list(extra_words)
    vocab = {"<unk>": 0, "<eos>": 1, **{w: i + 2 for i, w in enumerate(words)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<eos>").save_pretrained(folder)
    return vocab


def make_tiny_llama(folder: Path, *, layers: int = 2, kv_heads: int = 2, head_dim: int = 16, vocab_words: int = 200,
                    extra_words: tuple[str, ...] = ()) -> Path:
    """Save a randomly initialised Llama with a whitespace word-level tokenizer to ``folder``.

    ``extra_words`` are added to the vocabulary after ``w0 .. w{vocab_words-1}`` (e.g. yes/no).
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    vocab = _save_word_tokenizer(folder, vocab_words, extra_words)
    heads = kv_heads * 2
    cfg = LlamaConfig(vocab_size=len(vocab), hidden_size=heads * head_dim, intermediate_size=64, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=1024)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(folder)
    return folder


def make_tiny_gemma3(folder: Path, *, sliding_window: int = 8, vocab_words: int = 200) -> Path:
    """Save a randomly initialised Gemma-3 text model mixing sliding-window and global layers.

    Four layers: sliding, sliding, global, sliding (window ``sliding_window`` tokens), one KV
    head of dim 16: the cache layout of Gemma-3-270m at toy size.
    """
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    vocab = _save_word_tokenizer(folder, vocab_words, ())
    cfg = Gemma3TextConfig(
        vocab_size=len(vocab), hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, sliding_window=sliding_window, query_pre_attn_scalar=16,
        layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
        max_position_embeddings=1024, pad_token_id=0, bos_token_id=None, eos_token_id=1,
    )
    torch.manual_seed(0)
    Gemma3ForCausalLM(cfg).save_pretrained(folder)
    return folder


def make_word_text(path: Path, *, words: int = 3000, vocab_words: int = 200, seed: int = 0) -> Path:
    """A .txt file of pseudo-words the tiny tokenizer knows (for fast CLI tests only)."""
    rng = random.Random(seed)
    path.write_text(" ".join(f"w{rng.randrange(vocab_words)}" for _ in range(words)))
    return path


@pytest.fixture(scope="module")
def one_torch_thread():
    """One torch intra-op thread for a module (``pytestmark = pytest.mark.usefixtures(...)``):
    with small tensors or tiny models it is faster and immune to OpenMP oversubscription on a
    shared 2-core machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def tiny_text(tmp_path_factory) -> Path:
    return make_word_text(tmp_path_factory.mktemp("text") / "words.txt")


@pytest.fixture(scope="session")
def tiny_gemma_dir(tmp_path_factory) -> Path:
    return make_tiny_gemma3(tmp_path_factory.mktemp("tiny-gemma3"))


@pytest.fixture(scope="session")
def real_lm():
    """SmolLM2-135M-Instruct from its wheel (downloaded once, cached), loaded once per session."""
    from kvtune.evaluate.model import load_model

    return load_model("smollm2-135m-instruct", "cpu")


@pytest.fixture(scope="session")
def real_capture(real_lm):
    """KV and baseline of 4 real essay contexts of 512 tokens + 64 continuation tokens."""
    from kvtune.evaluate.assets import read_texts
    from kvtune.evaluate.capture import build_contexts, capture

    ids = build_contexts(real_lm.tokenizer, read_texts("paul-graham-essays"), n_contexts=4, context_tokens=512,
                         continuation_tokens=64)
    return capture(real_lm, ids, 512)
