"""Integration on the real default model (SmolLM2-135M-Instruct), real essays and real datasets,
and on the second real model (Gemma-3-270m, sliding-window + global layers).

The default model and the captured KV are shared by the whole session (see conftest.py).
Sample counts are small so that the file stays within a few minutes on 2 CPU cores.
Gemma tests are also marked ``gemma``: the first run dequantizes the GGUF (minutes) and caches
it; deselect them with ``-m "real_model and not gemma"``.
"""

from __future__ import annotations

import pytest
import torch

from kvtune.codecs import PolicyConfig, decode_kv, encode_kv, original_nbytes
from kvtune.evaluate.workloads import ContinuationWorkload
from kvtune.methods.tqc.settings import ProfileSettings

pytestmark = pytest.mark.real_model

NONE = PolicyConfig.from_dict({"key": {"name": "none"}, "value": {"name": "none"}, "codec": "bitpack"})


def _full_fidelity(lm, cap):
    """``evaluate(config)`` of the continuation workload on ``cap``, every context (full fidelity)."""
    wl = ContinuationWorkload(lm, settings=ProfileSettings(), cap=cap)
    return lambda config: wl.evaluate(config, fidelity="full")


def _uniform(bits, *, key_gran="per_channel", value_gran="per_token", transform="identity", group=32):
    return PolicyConfig.from_dict({
        "transforms": [transform],
        "key": {"name": "uniform", "bits": bits, "granularity": key_gran, "group_size": group},
        "value": {"name": "uniform", "bits": bits, "granularity": value_gran, "group_size": group},
        "codec": "bitpack",
    })


def test_capture_geometry(real_lm, real_capture):
    assert (real_lm.num_layers, real_lm.kv_heads, real_lm.head_dim) == (30, 3, 64)
    assert real_lm.layer_types == ["full_attention"] * 30 and real_lm.sliding_window is None
    assert len(real_capture.kv) == 30
    k, v = real_capture.kv[0]
    assert k.shape == v.shape == (4, 3, 512, 64) and k.dtype == torch.float32
    assert real_capture.baseline_logits.shape == (4, 64, 49152)


def test_roundtrip_on_real_kv(real_capture):
    kv = real_capture.context_kv(0)
    cfg = _uniform(8, key_gran="per_token", value_gran="per_token")
    stream = encode_kv(kv, cfg)
    out = decode_kv(stream, expect=cfg)
    assert len(out) == len(kv)
    for (k, v), (k2, v2) in zip(kv, out):
        assert k2.shape == k.shape and k2.dtype == k.dtype and v2.shape == v.shape and v2.dtype == v.dtype
        for x, y in ((k, k2), (v, v2)):  # per-token groups of 32 channels: error <= step / 2
            g = x.reshape(*x.shape[:-1], -1, 32)
            step = (g.amax(-1) - g.amin(-1)) / 255
            err = (x - y).abs().reshape(g.shape)
            # fp16 scale/zero add a relative error of ~1e-3 of the range on top of the half step
            assert (err <= step.unsqueeze(-1) * 0.5 + 2e-3 * g.abs().amax(-1, keepdim=True) + 1e-6).all()
    ratio = original_nbytes(kv) / len(stream)
    assert 1.6 < ratio < 2.0  # 8 bits + fp16 scale/zero per 32 elements = 9 bits -> 16/9 = 1.78x


def test_accuracy_ordering_on_real_model(real_lm, real_capture):
    evaluate = _full_fidelity(real_lm, real_capture)
    r8 = evaluate(_uniform(8))
    r4 = evaluate(_uniform(4))
    r2_tok = evaluate(_uniform(2, key_gran="per_token"))
    assert r8["relative_accuracy"] >= 0.995
    assert r8["top1_agreement"] > 0.97
    assert r4["relative_accuracy"] > 0.97
    # 2-bit per-token keys without rotation break the model (a first calibration measured ~5x perplexity)
    assert r2_tok["relative_accuracy"] < r4["relative_accuracy"] - 0.2
    assert r2_tok["kl_mean"] > 10 * r4["kl_mean"]
    assert r8["compression_ratio"] < r4["compression_ratio"] < r2_tok["compression_ratio"]
    assert r2_tok["relative_accuracy_lo"] <= r2_tok["relative_accuracy"] <= r2_tok["relative_accuracy_hi"]


def test_chat_prompt_split_matches_the_joint_tokenization(real_lm):
    """The compressed prefix is exactly template head + passage; separate tokenization equals joint."""
    from kvtune.evaluate.workloads.base import PromptBuilder

    pb = PromptBuilder(real_lm, "auto")
    assert pb.format == "chat"
    instruction = "\n\nAnswer the question about the text above with a short phrase.\nQuestion: Who is Mark?"
    prefix, decode = pb.split(chat_instruction=instruction, plain_instruction="")
    passage = "Mark Hunter, a high school student in Phoenix, starts a pirate radio station."
    full = real_lm.tokenizer.apply_chat_template([{"role": "user", "content": passage + instruction}], tokenize=False,
                                                 add_generation_prompt=True)
    assert prefix + pb.encode(passage) + decode == pb.encode(full)
    assert real_lm.tokenizer.decode(prefix).endswith("<|im_start|>user\n")
    assert real_lm.tokenizer.decode(decode).endswith("<|im_end|>\n<|im_start|>assistant\n")


# A few samples per workload: each builds in seconds and the 8-bit policy costs one codec round
# trip per sample. ``context_tokens`` is reduced so prefill stays cheap.
REAL_SIZES = {
    "continuation": dict(samples=2, cheap_samples=2, context_tokens=512, continuation_tokens=64),
    "qa": dict(samples=2, cheap_samples=2, context_tokens=512, max_new_tokens=6),
    "boolq": dict(samples=4, cheap_samples=4, context_tokens=384),
    "needle": dict(samples=2, cheap_samples=2, context_tokens=512),
    "summarize": dict(samples=2, cheap_samples=2, context_tokens=512, max_new_tokens=8),
}
TOLERANCE = 0.002  # resolution of an interval that is a few hundredths of a point wide


@pytest.mark.parametrize("name", list(REAL_SIZES))
def test_eight_bit_policy_is_within_its_interval_of_100_percent(real_lm, name):
    """Per workload: KIVI-8 on real data is lossless within its paired-bootstrap interval, and
    2-bit per-token keys (no rotation) measurably are not, at the cheap fidelity the search uses."""
    from kvtune.evaluate.workloads import make_workload
    from kvtune.methods.tqc.settings import ProfileSettings

    # float32 KV as captured (the sizes and tolerance were set with it; with the bf16 default, boolq's
    # 4-sample interval for 8 bits ends 0.0003 below 100 % + TOLERANCE)
    wl = make_workload(name, real_lm, settings=ProfileSettings(workload=name, kv_dtype="model", **REAL_SIZES[name]))
    r8 = wl.evaluate(_uniform(8), fidelity="cheap")
    assert r8["relative_accuracy_lo"] - TOLERANCE <= 1.0 <= r8["relative_accuracy_hi"] + TOLERANCE, r8
    assert r8["relative_accuracy"] <= 1.0 and 1.6 < r8["compression_ratio"] < 1.8
    r2 = wl.evaluate(_uniform(2, key_gran="per_token"), fidelity="cheap")
    assert r2["relative_accuracy_hi"] < r8["relative_accuracy_lo"], (r2, r8)
    if name == "needle":  # one generative check: 8-bit KV retrieves the same keys as the original
        full = wl.evaluate(_uniform(8), fidelity="full")
        assert full["passkey_accuracy_base"] == 1.0 and full["relative_accuracy_raw"] == 1.0, full


# ---------------------------------------------------------------------- second model: Gemma-3-270m


@pytest.fixture(scope="module")
def gemma_lm():
    from kvtune.evaluate.model import load_model

    return load_model("gemma-3-270m", "cpu")


@pytest.mark.gemma
def test_gemma_identity_round_trip_reproduces_its_logits(gemma_lm):
    """Sliding layers (window 512) send only their last 511 positions; injecting the captured KV
    gives the logits of the model's own cache exactly, and the bf16 round trip of bf16 KV too."""
    from kvtune.evaluate.assets import read_texts
    from kvtune.evaluate.capture import build_contexts, capture, continuation_logits
    from kvtune.evaluate.model import forward_cache

    lm = gemma_lm
    assert (lm.num_layers, lm.kv_heads, lm.head_dim, lm.sliding_window) == (18, 1, 256, 512)
    assert [i for i, t in enumerate(lm.layer_types) if t == "full_attention"] == [5, 11, 17]
    ids = build_contexts(lm.tokenizer, read_texts("paul-graham-essays"), n_contexts=1, context_tokens=600,
                         continuation_tokens=16)
    cap = capture(lm, ids, 600)
    assert [k.shape[-2] for k, _ in cap.kv] == lm.kv_tokens(600) == [511 if t == "sliding_attention" else 600
                                                                      for t in lm.layer_types]
    with torch.inference_mode():
        out = lm.model(input_ids=ids[:, :600], use_cache=True)
        own = lm.model(input_ids=ids[:, 600:], cache=forward_cache(out), use_cache=True).logits
        one_pass = lm.model(input_ids=ids, logits_to_keep=16).logits
    assert torch.equal(cap.baseline_logits, own)
    assert torch.allclose(cap.baseline_logits, one_pass, atol=1e-3, rtol=1e-4)
    # bf16-rounded KV through the bf16 "none" policy decodes bit-exactly and continues identically
    cap16 = capture(lm, ids, 600, kv_dtype="bfloat16")
    decoded = decode_kv(encode_kv(cap16.context_kv(0), NONE), expect=NONE)
    assert all(torch.equal(a, b) for (a, _), (b, _) in zip(decoded, cap16.kv))
    assert torch.equal(continuation_logits(lm, cap16, decoded), cap16.baseline_logits)
    r8 = _full_fidelity(lm, cap)(_uniform(8))
    assert r8["relative_accuracy_raw"] > 0.99 and r8["original_bytes"] == original_nbytes(cap.kv)
