"""Memory of a profile: the estimate, the refusal before loading, the allocator settings."""

from __future__ import annotations

import sys

import pytest

from kvtune.core.allocator import limit_heap_retention, release_free_memory
from kvtune.core.errors import ConfigError
from kvtune.evaluate import memory
from kvtune.evaluate.memory import MemoryEstimate, ModelShape, check_memory_fits, estimate_profile_memory, model_shape

#: SmolLM2-135M-Instruct: 30 layers, 3 KV heads of 64, 9 query heads, vocabulary 49152.
SMOLLM2 = ModelShape(layers=30, kv_heads=3, head_dim=64, heads=9, vocab=49152, parameters=134_515_008)


def test_the_default_profile_estimate_adds_up_its_parts():
    est = estimate_profile_memory(SMOLLM2, contexts=24, context_tokens=1024, continuation_tokens=128,
                                  kv_dtype="bfloat16")
    per_token = 30 * 2 * 3 * 64
    assert est.parts["captured_kv"] == 24 * per_token * 1024 * 2 == 566_231_040
    assert est.disk == 24 * 128 * 49152 * 4 == 603_979_776  # the baseline's log-probabilities, spooled
    assert est.parts["baseline"] == 24 * 128 * 20  # what stays in memory of it
    assert est.parts["model"] == 134_515_008 * 4
    evaluation = 4 * per_token * 1024 * 4 + 4 * per_token * 1152 * 4 + 3 * 4 * 128 * 49152 * 4 + 3 * per_token * 1024 * 4
    assert est.parts["working_set"] == evaluation  # larger than prefill (4 x 1024^2 x 9 heads of scores + KV)
    assert est.total == sum(est.parts.values()) and 2.3e9 < est.total < 2.4e9
    assert est.describe().endswith("(+ 0.60 GB of baseline on disk)")
    # float32 KV doubles the captured KV; other workloads keep no logit baseline and model-dtype KV
    f32 = estimate_profile_memory(SMOLLM2, contexts=24, context_tokens=1024, continuation_tokens=128, kv_dtype="model")
    assert f32.parts["captured_kv"] == 2 * est.parts["captured_kv"]
    qa = estimate_profile_memory(SMOLLM2, contexts=24, context_tokens=1024, continuation_tokens=128,
                                 kv_dtype="bfloat16", workload="qa")
    assert qa.parts["baseline"] == qa.disk == 0 and qa.parts["captured_kv"] == f32.parts["captured_kv"]


def test_memory_grows_linearly_with_contexts_and_tokens():
    def kv_and_baseline(**kw):
        e = estimate_profile_memory(SMOLLM2, kv_dtype="bfloat16", **kw)
        return e.parts["captured_kv"] + e.parts["baseline"] + e.disk

    base = kv_and_baseline(contexts=24, context_tokens=1024, continuation_tokens=128)
    assert kv_and_baseline(contexts=48, context_tokens=1024, continuation_tokens=128) == 2 * base
    twice_t = kv_and_baseline(contexts=24, context_tokens=2048, continuation_tokens=128)
    assert twice_t - base == 566_231_040  # the KV doubles, the baseline does not move


def test_a_run_that_cannot_fit_is_refused_naming_the_settings():
    est = MemoryEstimate({"runtime": 4 * 10**8, "model": 6 * 10**8, "captured_kv": 10**9, "baseline": 10**9,
                          "working_set": 10**9})
    check_memory_fits(est, 4 * 10**9, kv_dtype="bfloat16")  # fits: no error
    with pytest.raises(ConfigError, match=r"about 4\.0 GB: runtime 0\.40, model 0\.60, captured kv 1\.00.*but 3\.0 GB "
                                          r"of memory is available; lower --contexts") as info:
        check_memory_fits(est, 3 * 10**9, kv_dtype="bfloat16")
    assert "--kv-dtype" not in str(info.value)
    with pytest.raises(ConfigError, match="--kv-dtype bfloat16"):
        check_memory_fits(est, 3 * 10**9, kv_dtype="model")
    with pytest.raises(ConfigError, match="per worker x 2 workers.*fewer --workers"):
        check_memory_fits(est, 5 * 10**9, kv_dtype="bfloat16", workers=2)
    spooled = MemoryEstimate(est.parts, disk=2 * 10**9)
    check_memory_fits(spooled, 4 * 10**9, kv_dtype="bfloat16", free_disk=2 * 10**9)
    with pytest.raises(ConfigError, match=r"spools 2\.0 GB .* 1\.0 GB free; point \$TMPDIR"):
        check_memory_fits(spooled, 4 * 10**9, kv_dtype="bfloat16", free_disk=10**9)


def test_model_shape_reads_the_configuration_only(tiny_model_dir):
    shape = model_shape(str(tiny_model_dir))
    assert (shape.layers, shape.kv_heads, shape.head_dim, shape.heads) == (2, 2, 16, 4)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert shape.parameters == sum(p.numel() for p in model.parameters())
    assert shape.vocab == model.config.vocab_size
    assert model_shape("nobody/not-a-local-model") is None  # a Hugging Face id: the load reports what it finds


def test_profile_refuses_before_loading_the_model(tiny_model_dir, tiny_text, tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from kvtune.cli import app
    import kvtune.evaluate.model as model_module

    monkeypatch.setattr(memory, "available_memory", lambda: 10**6)
    loads = []
    monkeypatch.setattr(model_module, "load_model", lambda *a, **k: loads.append(a))
    res = CliRunner().invoke(app, ["profile", "--model", str(tiny_model_dir), "--text", str(tiny_text),
                                   "--contexts", "3", "--context-tokens", "32", "--continuation-tokens", "8",
                                   "--budget", "2", "--out", str(tmp_path / "p"), "--reports", str(tmp_path / "r")])
    assert res.exit_code != 0 and "memory is available; lower --contexts" in " ".join(res.output.split()), res.output
    assert loads == [] and not (tmp_path / "p").exists()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator")
def test_glibc_takes_the_allocator_settings():
    assert limit_heap_retention() is True
    assert isinstance(release_free_memory(), bool)
