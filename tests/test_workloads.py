"""Workloads on tiny random models (fast, offline): every workload x policy matrix, data errors,
scores, intervals, and KV injection for models mixing sliding-window and global layers."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import random

import pytest
import torch

from kvtune.codecs import PolicyConfig, decode_kv, encode_kv, original_nbytes
from kvtune.core.errors import KvtuneError
from kvtune.evaluate import metrics
from kvtune.evaluate.model import cache_to_kv, forward_cache, kv_to_cache, load_model
from kvtune.evaluate.workloads import WORKLOADS, DataError, Field, make_workload, read_jsonl, spearman
from kvtune.evaluate.workloads.base import PromptBuilder, target_nll
from kvtune.evaluate.workloads.scoring import best_f1, normalize_answer, rouge_l, token_f1
from kvtune.methods.tqc.settings import ProfileSettings

from conftest import make_tiny_llama, make_word_text

NONE = PolicyConfig.from_dict({"key": {"name": "none"}, "value": {"name": "none"}, "codec": "bitpack"})
KIVI8, KIVI2 = PolicyConfig.kivi(8), PolicyConfig.kivi(2)
ROW_KEYS = {
    "workload", "fidelity", "samples", "compression_ratio", "relative_accuracy", "relative_accuracy_raw",
    "relative_accuracy_lo", "relative_accuracy_hi", "score", "score_base", "score_name", "encode_gbps",
    "decode_gbps", "stream_bytes", "original_bytes", "bits_per_element", "eval_seconds",
}
_NLL = {"nll", "nll_base"}
EXTRA_KEYS = {  # workload -> (cheap-fidelity metrics, full-fidelity metrics)
    "continuation": ({"ppl_ratio", "kl_mean", "top1_agreement"} | _NLL,) * 2,
    "qa": (_NLL | {"ref_nll", "ref_nll_base"}, {"f1", "f1_base", "agreement_f1"}),
    "boolq": ({"accuracy", "accuracy_base", "p_correct", "p_correct_base", "p_same", "flip_rate"},) * 2,
    "needle": (_NLL, {"passkey_accuracy", "passkey_accuracy_base", "digit_accuracy"}),
    "summarize": (_NLL | {"ref_nll", "ref_nll_base"}, {"rouge_l", "rouge_l_base", "agreement_rouge_l"}),
}


def _words(rng: random.Random, n: int) -> str:
    return " ".join(f"w{rng.randrange(200)}" for _ in range(n))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny Llama that knows yes/no, an essay-like text, and JSONL data for the dataset workloads."""
    root = tmp_path_factory.mktemp("wl")
    model = make_tiny_llama(root / "model", extra_words=("yes", "no"))
    text = make_word_text(root / "words.txt", words=4000)
    rng = random.Random(0)
    files = {"qa": root / "qa.jsonl", "boolq": root / "boolq.jsonl", "summarize": root / "sum.jsonl"}
    with open(files["qa"], "w") as f:
        for i in range(8):
            f.write(json.dumps({"passage": _words(rng, 30 + 4 * i), "question": _words(rng, 4),
                                "answer": [_words(rng, 2), _words(rng, 3)]}) + "\n")
    with open(files["boolq"], "w") as f:
        for i in range(8):
            f.write(json.dumps({"passage": _words(rng, 30), "question": _words(rng, 4), "answer": ["true", False][i % 2]})
                    + "\n")
    with open(files["summarize"], "w") as f:
        for i in range(8):
            f.write(json.dumps({"document": _words(rng, 40), "summary": _words(rng, 6)}) + "\n")
    lm = load_model(str(model), "cpu")
    return lm, text, files


def _settings(tiny, name, **kw):
    lm, text, files = tiny
    base = dict(model=lm.name, text=str(text), workload=name, data=str(files.get(name, "")), samples=3,
                cheap_samples=2, context_tokens=64, continuation_tokens=8, max_new_tokens=4, kv_dtype="bfloat16")
    base.update(kw)
    return ProfileSettings(**base)


@pytest.fixture(scope="module")
def built(tiny):
    """Every registered workload, built once on the tiny model (bf16-rounded KV)."""
    return {name: make_workload(name, tiny[0], settings=_settings(tiny, name)) for name in WORKLOADS}


@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_workload_matrix(built, name):
    wl = built[name]
    assert wl.name == name and len(wl.samples) == len(wl.kv) == 3
    for fidelity, n, extra in (("cheap", 2, EXTRA_KEYS[name][0]), ("full", 3, EXTRA_KEYS[name][1])):
        r8, r2, r0 = (wl.evaluate(cfg, fidelity=fidelity) for cfg in (KIVI8, KIVI2, NONE))
        for r in (r8, r2, r0):
            assert ROW_KEYS | extra <= set(r), sorted(ROW_KEYS | extra - set(r))
            assert r["workload"] == name and r["fidelity"] == fidelity and r["samples"] == n
            assert r["relative_accuracy_lo"] <= r["relative_accuracy_raw"] <= r["relative_accuracy_hi"] + 1e-12
            assert r["relative_accuracy"] == min(r["relative_accuracy_raw"], 1.0)
            assert r["original_bytes"] == sum(original_nbytes(kv) for kv in wl.kv[:n])
            assert r["encode_gbps"] > 0 and r["decode_gbps"] > 0
        # bf16-rounded KV through the bf16 "none" quantizer is bit-exact: the run equals the baseline
        assert r0["relative_accuracy_raw"] == r0["relative_accuracy_lo"] == r0["relative_accuracy_hi"] == 1.0
        assert r0["score"] == r0["score_base"]
        assert r0["compression_ratio"] < r8["compression_ratio"] < r2["compression_ratio"]
    # the decoded cache is really used: 2-bit KV moves the teacher-forced score
    assert wl.evaluate(KIVI2, fidelity="cheap")["relative_accuracy_raw"] != 1.0
    json.dumps(wl.describe())
    assert wl.describe()["samples"] == 3 and wl.describe()["cheap_samples"] == 2
    ids = wl.calibration_ids()
    assert ids.dtype == torch.long and ids.shape[0] == 2 and ids.shape[1] <= 64
    assert ids[0].tolist() == wl.samples[0].context_ids[: ids.shape[1]]
    sample, first = wl.kv_sample(), wl.kv[0]  # the continuation workload builds them from its bf16 capture
    assert len(sample) == len(first) == 2
    assert all(torch.equal(a, b) and a.dtype == b.dtype == torch.float32 for x, y in zip(sample, first)
               for a, b in zip(x, y))


def test_baselines_are_cached(built, monkeypatch):
    wl = built["qa"]
    first = wl.baseline("full")
    calls = []
    monkeypatch.setattr(type(wl), "run_sample", lambda self, *a: calls.append(a) or {"nll": 0.0, "answer": "", "f1": 0.0})
    assert wl.baseline("full") is first and wl.baseline("cheap") is wl.baseline("cheap")
    assert calls == []


def test_model_dtype_kv_is_nearly_lossless_through_bf16(tiny):
    """With the KV as computed (fp32), the bf16 'none' policy is lossy only by bf16 rounding."""
    wl = make_workload("qa", tiny[0], settings=_settings(tiny, "qa", kv_dtype="model", samples=2))
    r = wl.evaluate(NONE, fidelity="cheap")
    assert r["relative_accuracy_raw"] == pytest.approx(1.0, abs=1e-3)


def test_continuation_full_matches_the_former_evaluator(tiny):
    """The continuation workload at full fidelity, on a given capture, computes exactly the numbers
    of the former ContinuationEvaluator (perplexity ratio, KL, bootstrap interval, ratio)."""
    from kvtune.evaluate.assets import read_texts
    from kvtune.evaluate.capture import build_contexts, capture, continuation_logits
    from kvtune.evaluate.workloads import ContinuationWorkload

    lm, text, _ = tiny
    ids = build_contexts(lm.tokenizer, read_texts(str(text)), n_contexts=3, context_tokens=48, continuation_tokens=8)
    cap = capture(lm, ids, 48)
    row = ContinuationWorkload(lm, settings=_settings(tiny, "continuation"), cap=cap).evaluate(KIVI2, fidelity="full")
    from kvtune.evaluate.workloads.continuation import roundtrip_contexts

    decoded, st = roundtrip_contexts(cap, KIVI2, lm)
    for i in range(3):  # each row (decoded straight into the buffers) is decode_kv of the context's stream
        want = decode_kv(encode_kv(cap.context_kv(i), KIVI2))
        for (k, v), (wk, wv) in zip(decoded, want):
            assert torch.equal(k[i : i + 1], wk) and torch.equal(v[i : i + 1], wv)
    ref = metrics.continuation_scores(cap.baseline_logits, continuation_logits(lm, cap, decoded), cap.continuation_ids)
    lo, hi = metrics.bootstrap_relative_accuracy(ref["per_context_nll_delta"])
    assert row["relative_accuracy_raw"] == ref["relative_accuracy"] and row["kl_mean"] == ref["kl_mean"]
    assert (row["relative_accuracy_lo"], row["relative_accuracy_hi"]) == (lo, hi)
    assert row["compression_ratio"] == st["original_bytes"] / st["stream_bytes"] and row["fidelity"] == "full"
    wl = make_workload("continuation", lm, settings=_settings(tiny, "continuation", samples=3, context_tokens=48,
                                                              kv_dtype="model"))
    assert torch.equal(wl.cap.input_ids, ids)
    assert wl.evaluate(KIVI2, fidelity="full")["relative_accuracy_raw"] == row["relative_accuracy_raw"]


def test_sample_selection_is_deterministic_and_bounded(tiny):
    lm = tiny[0]
    a = make_workload("summarize", lm, settings=_settings(tiny, "summarize"))
    b = make_workload("summarize", lm, settings=_settings(tiny, "summarize"))
    assert [s.context_ids for s in a.samples] == [s.context_ids for s in b.samples]
    assert all(len(s.context_ids) <= 64 for s in a.samples)
    with pytest.raises(DataError, match=r"only 0 records fit, 3 requested; raise --context-tokens"):
        make_workload("summarize", lm, settings=_settings(tiny, "summarize", context_tokens=20))
    with pytest.raises(DataError, match="only 8 records fit, 9 requested"):
        make_workload("boolq", lm, settings=_settings(tiny, "boolq", samples=9))


def test_needle_hides_the_key_at_several_depths(tiny):
    wl = make_workload("needle", tiny[0], settings=_settings(tiny, "needle", samples=5, context_tokens=96))
    depths = [s.meta["depth"] for s in wl.samples]
    assert depths == [0.1, 0.3, 0.5, 0.7, 0.9]
    keys = [s.label for s in wl.samples]
    assert len(set(keys)) == 5 and all(len(k) == 5 and k.isdigit() for k in keys)
    pos = [s.meta["needle_position"] / len(s.context_ids) for s in wl.samples]
    assert pos == sorted(pos) and all(len(s.context_ids) == 96 for s in wl.samples)


def test_settings_errors(tiny):
    lm = tiny[0]
    with pytest.raises(KvtuneError, match="unknown workload 'nope'; known workloads: continuation"):
        make_workload("nope", lm, settings=_settings(tiny, "qa"))
    with pytest.raises(KvtuneError, match="--kv-dtype must be one of model, bfloat16"):
        make_workload("qa", lm, settings=_settings(tiny, "qa", kv_dtype="fp8"))
    with pytest.raises(KvtuneError, match="has no chat template"):
        make_workload("qa", lm, settings=_settings(tiny, "qa", prompt_format="chat"))
    with pytest.raises(DataError, match="neither a named dataset"):
        make_workload("qa", lm, settings=_settings(tiny, "qa", data="/no/such.jsonl"))
    with pytest.raises(DataError, match="is a text asset, not a dataset"):
        make_workload("qa", lm, settings=_settings(tiny, "qa", data="paul-graham-essays"))
    with pytest.raises(KvtuneError, match="fidelity must be one of cheap, full"):
        make_workload("boolq", lm, settings=_settings(tiny, "boolq")).evaluate(KIVI8, fidelity="medium")


# ---------------------------------------------------------------------- user JSONL errors


QA_FIELDS = (Field("passage", "str"), Field("question", "str"), Field("answer", "str_list"))


@pytest.mark.parametrize("line, message", [
    ('{"passage": "p", "question": "q"}', "line 2: field 'answer' is missing"),
    ('{"passage": "p", "question": 3, "answer": "a"}', "line 2: field 'question' must be a string, got int"),
    ('{"passage": "  ", "question": "q", "answer": "a"}', "line 2: field 'passage' is an empty string"),
    ('{"passage": "p", "question": "q", "answer": []}', "line 2: field 'answer' must be a string or a non-empty list"),
    ('{"passage": "p", "question": "q", "answer": ["a", 1]}', "line 2: field 'answer' item 1 must be a non-empty string"),
    ('{"passage": "p", "question": "q", "answer": "a"', "line 2: not valid JSON"),
    ('["p", "q", "a"]', "line 2: a record must be a JSON object, got list"),
])
def test_jsonl_errors_name_file_line_and_field(tmp_path, line, message):
    path = tmp_path / "user.jsonl"
    path.write_text('{"passage": "p", "question": "q", "answer": ["a"]}\n' + line + "\n")
    with pytest.raises(DataError) as err:
        read_jsonl(path, QA_FIELDS)
    assert str(err.value).startswith(f"{path}, line 2") and message in str(err.value)


def test_jsonl_reading_converts_fields(tmp_path):
    path = tmp_path / "b.jsonl"
    path.write_text('{"passage": "p", "question": "q", "answer": "Yes"}\n\n{"passage": "p", "question": "q", "answer": false}\n')
    recs = read_jsonl(path, (Field("passage", "str"), Field("question", "str"), Field("answer", "bool")))
    assert [(r["_line"], r["answer"]) for r in recs] == [(1, True), (3, False)]
    path.write_text('{"passage": "p", "question": "q", "answer": "maybe"}\n')
    with pytest.raises(DataError, match=r"line 1: field 'answer' must be true/false"):
        read_jsonl(path, (Field("answer", "bool"),))
    path.write_text("\n\n")
    with pytest.raises(DataError, match="no records"):
        read_jsonl(path, QA_FIELDS)


def test_bad_user_data_stops_the_workload(tiny, tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"document": "w1 w2", "summary": "w3"}\n{"document": "w1 w2"}\n')
    with pytest.raises(DataError, match=rf"{path}, line 2: field 'summary' is missing"):
        make_workload("summarize", tiny[0], settings=_settings(tiny, "summarize", data=str(path)))


# ---------------------------------------------------------------------- prompts


def test_chat_prompt_split_keeps_the_template_prefix_on_the_prefill_side(tiny):
    lm = tiny[0]
    lm.tokenizer.chat_template = "{% for m in messages %}<s> {{ m['role'] }} : {{ m['content'] }} </s> {% endfor %}" \
                                 "{% if add_generation_prompt %}<s> assistant : {% endif %}"
    try:
        pb = PromptBuilder(lm, "auto")
        assert pb.format == "chat"
        prefix, decode = pb.split(chat_instruction=" w5 w6", plain_instruction="unused", answer_prefix=" w7")
        full = lm.tokenizer.apply_chat_template([{"role": "user", "content": "w1 w2 w3 w5 w6"}], tokenize=False,
                                                add_generation_prompt=True)
        assert prefix + pb.encode("w1 w2 w3") + decode == pb.encode(full + " w7")
        assert prefix == pb.encode("<s> user :") and decode == pb.encode(" w5 w6 </s> <s> assistant : w7")
        assert PromptBuilder(lm, "plain").format == "plain"
    finally:
        lm.tokenizer.chat_template = None


def test_target_nll_batches_references_like_single_runs(tiny):
    lm = tiny[0]
    ctx = list(range(2, 30))
    from kvtune.evaluate.workloads.base import prefill_kv

    kv = prefill_kv(lm, ctx)
    both = target_nll(lm, kv, len(ctx), [5, 6], [[7, 8, 9], [10]])
    singles = [target_nll(lm, kv, len(ctx), [5, 6], [t])[0] for t in ([7, 8, 9], [10])]
    assert both == pytest.approx(singles, abs=1e-5)
    with torch.inference_mode():  # hand computation from a full forward pass
        logits = lm.model(input_ids=torch.tensor([ctx + [5, 6, 10]])).logits[0, -2]
    assert singles[1] == pytest.approx(-torch.log_softmax(logits, -1)[10].item(), abs=1e-5)


# ---------------------------------------------------------------------- sliding-window layers


def test_sliding_window_layers_send_only_their_window_and_inject_exactly(tiny_gemma_dir):
    lm = load_model(str(tiny_gemma_dir), "cpu")
    assert lm.layer_types == ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"]
    assert lm.sliding_window == 8 and lm.kv_tokens(20) == [7, 7, 20, 7] and lm.kv_tokens(5) == [5, 5, 5, 5]
    assert lm.describe()["layer_types"] == lm.layer_types
    ids = torch.randint(2, 200, (1, 28), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        full = lm.model(input_ids=ids).logits[:, 20:]
        out = lm.model(input_ids=ids[:, :20], use_cache=True)
        kv = [(k.clone(), v.clone()) for k, v in cache_to_kv(forward_cache(out))]
        assert [k.shape[-2] for k, _ in kv] == [7, 7, 20, 7]
        original = lm.model(input_ids=ids[:, 20:], cache=forward_cache(out), use_cache=True).logits
        injected = lm.model(input_ids=ids[:, 20:], cache=kv_to_cache(kv, lm.model.config, context_tokens=20),
                            use_cache=True).logits
        assert torch.equal(injected, original)
        assert torch.allclose(injected, full, atol=1e-5)
        from transformers import DynamicCache  # without the context length, positions and masks go wrong

        naive = lm.model(input_ids=ids[:, 20:], cache=DynamicCache(ddp_cache_data=kv, config=lm.model.config),
                         use_cache=True).logits
        assert (naive - full).abs().max() > 1e-2


def test_workloads_on_a_sliding_window_model(tiny_gemma_dir, tiny):
    lm = load_model(str(tiny_gemma_dir), "cpu")
    _, text, _ = tiny
    st = ProfileSettings(model=str(tiny_gemma_dir), text=str(text), workload="continuation", samples=2,
                         cheap_samples=2, context_tokens=24, continuation_tokens=8, kv_dtype="bfloat16")
    wl = make_workload("continuation", lm, settings=st)
    assert [k.shape[-2] for k, _ in wl.kv[0]] == [7, 7, 24, 7]
    r = wl.evaluate(NONE, fidelity="cheap")
    assert r["relative_accuracy_raw"] == 1.0
    assert r["original_bytes"] == 2 * 2 * (7 + 7 + 24 + 7) * 16 * 2 * 1  # 2 ctx x (K+V) x positions x dim x bf16
    assert wl.evaluate(KIVI2, fidelity="cheap")["relative_accuracy_raw"] != 1.0
    st = dataclasses.replace(st, workload="needle", max_new_tokens=3, context_tokens=96)
    needle = make_workload("needle", lm, settings=st)
    assert needle.evaluate(NONE, fidelity="full")["relative_accuracy_raw"] == 1.0


# ---------------------------------------------------------------------- scores and intervals


def test_squad_f1_and_normalization_hand_values():
    assert normalize_answer("The  Cat, sat!") == "cat sat"
    assert token_f1("the cat sat", "a cat sat down") == pytest.approx(2 * (2 / 2) * (2 / 3) / (2 / 2 + 2 / 3))
    assert token_f1("dog", "cat") == 0.0 and token_f1("", "") == 1.0 and token_f1("the", "cat") == 0.0
    assert best_f1("cat", ["dog", "a cat"]) == 1.0


def test_rouge_l_hand_value():
    # LCS("the cat sat", "the cat sat on the mat") = 3: P = 1, R = 0.5, F = 2/3
    assert rouge_l("the cat sat", "the cat sat on the mat") == pytest.approx(2 / 3)
    assert rouge_l("cats running", "the cat runs") == pytest.approx(2 * (2 / 2) * (2 / 3) / (1 + 2 / 3))  # stemming


def test_ratio_of_means_and_its_bootstrap():
    a, b = torch.tensor([0.5, 1.0, 0.0, 1.0]), torch.tensor([1.0, 1.0, 0.0, 1.0])
    assert metrics.ratio_of_means(a, b) == pytest.approx(2.5 / 3)
    assert metrics.ratio_of_means(torch.zeros(3), torch.zeros(3)) == 1.0
    assert metrics.ratio_of_means(torch.ones(3), torch.zeros(3)) == math.inf
    lo, hi = metrics.bootstrap_ratio_of_means(a, b)
    assert lo < 2.5 / 3 < hi <= 1.0
    lo, hi = metrics.bootstrap_ratio_of_means(b, b)
    assert lo == hi == 1.0
    # gemma-3-270m needle: baseline found 1 passkey of 4, the decoded cache 3 (raw ratio 3.0);
    # resamples missing the baseline's hit are x / 0: the interval is [1, inf], never NaN
    lo, hi = metrics.bootstrap_ratio_of_means(torch.tensor([1.0, 1.0, 1.0, 0.0]), torch.tensor([1.0, 0.0, 0.0, 0.0]))
    assert lo == 1.0 and hi == math.inf


def test_relative_accuracy_above_one_is_reported_as_one():
    assert metrics.report_relative_accuracy(1.004) == 1.0 and metrics.report_relative_accuracy(1.0) == 1.0
    assert metrics.report_relative_accuracy(0.97) == 0.97


def test_spearman():
    assert spearman([0.9, 0.8, 0.7], [0.95, 0.85, 0.6]) == pytest.approx(1.0)
    assert spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    assert spearman([1, 2, 3, 4], [1, 3, 2, 4]) == pytest.approx(0.8)  # 1 - 6*2/(4*15)
    assert math.isnan(spearman([1, 1, 1], [1, 2, 3])) and math.isnan(spearman([1], [2]))
    with pytest.raises(ValueError, match="3 cheap scores but 2 full"):
        spearman([1, 2, 3], [1, 2])


def test_settings_round_trip_and_version_1_upgrade():
    s = ProfileSettings(workload="qa", data="x.jsonl", samples=10, cheap_samples=4, kv_dtype="bfloat16")
    assert ProfileSettings.from_dict(json.loads(json.dumps(s.to_dict()))) == s
    v1 = {k: v for k, v in ProfileSettings().to_dict().items()
          if k not in {"workload", "data", "samples", "cheap_samples", "max_new_tokens", "kv_dtype", "prompt_format"}}
    v1["version"] = 1
    up = ProfileSettings.from_dict(v1)
    # version-1 runs captured float32 KV: they keep it though the default is now bfloat16
    assert up == ProfileSettings(kv_dtype="model") and up.workload == "continuation" and up.version == 2
    with pytest.raises(KvtuneError, match="version 3 is not one of"):
        ProfileSettings.from_dict({**s.to_dict(), "version": 3})


def test_empty_contexts_are_passed_over_and_counted(tiny, tmp_path):
    path = tmp_path / "qa.jsonl"
    rows = [{"passage": "w1 w2 w3", "question": "w4", "answer": "w5"}, {"passage": " ", "question": "w4", "answer": "w5"},
            {"passage": "w6 w7", "question": "w8", "answer": ["w9"]}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    wl = make_workload("qa", tiny[0], settings=_settings(tiny, "qa", data=str(path), samples=2, cheap_samples=1))
    assert wl.describe()["records_passed_over"] == {"empty_context": 1, "too_long": 0}
    assert sorted(s.meta["line"] for s in wl.samples) == [1, 3]
    assert wl.describe()["sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()


def test_generative_cheap_fidelity_scores_the_original_runs_own_answer(built):
    """qa/summarize cheap: the likelihood of the answer generated on the original KV (with its stop)."""
    from kvtune.evaluate.workloads.base import greedy_generate

    wl = built["qa"]
    s, kv = wl.samples[0], wl.kv[0]
    own = s.meta["own_answer_ids"]
    assert own == greedy_generate(wl.lm, kv, len(s.context_ids), s.prompt_ids, max_new_tokens=wl.max_new_tokens,
                                  stop_ids=wl.stop_ids, include_stop=True)
    base = wl.baseline("cheap")[0]
    assert base["nll"] == pytest.approx(target_nll(wl.lm, kv, len(s.context_ids), s.prompt_ids, [own])[0], abs=1e-5)
    refs = target_nll(wl.lm, kv, len(s.context_ids), s.prompt_ids, s.targets)
    assert base["ref_nll"] == pytest.approx(sum(refs) / len(refs), abs=1e-5)


def test_boolq_scores_hand_values(built):
    wl = built["boolq"]
    base = [{"p_yes": 0.8, "p_correct": 0.8, "correct": 1.0}, {"p_yes": 0.3, "p_correct": 0.3, "correct": 0.0}]
    out = [{"p_yes": 0.6, "p_correct": 0.6, "correct": 1.0}, {"p_yes": 0.6, "p_correct": 0.6, "correct": 1.0}]
    cheap = wl.score(base, out, "cheap")  # own decision: yes, then no -> p_same 0.6 and 0.4 vs 0.8 and 0.7
    assert cheap["relative_accuracy_raw"] == pytest.approx((0.6 + 0.4) / (0.8 + 0.7))
    assert cheap["flip_rate"] == 0.5 and cheap["p_correct"] == pytest.approx(0.6)
    full = wl.score(base, out, "full")  # accuracy 2/2 vs 1/2
    assert full["relative_accuracy_raw"] == pytest.approx(2.0) and full["accuracy_base"] == 0.5


class _BosTokenizer:
    """A character tokenizer that starts every text with BOS (id 1), like Gemma's."""

    bos_token_id, eos_token_id = 1, 2

    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": ([1] if add_special_tokens else []) + [ord(c) for c in text]}


def test_context_windows_start_with_bos_when_the_tokenizer_uses_one(tiny):
    from kvtune.evaluate.capture import build_contexts
    from kvtune.evaluate.model import start_tokens

    ids = build_contexts(_BosTokenizer(), [("a", "abcdefghij" * 10)], n_contexts=2, context_tokens=10,
                         continuation_tokens=4)
    assert ids.shape == (2, 14) and ids[:, 0].tolist() == [1, 1] and ids[0, 1:4].tolist() == [97, 98, 99]
    assert start_tokens(_BosTokenizer()) == [1] and start_tokens(tiny[0].tokenizer) == []


def test_workloads_read_typed_settings_without_silent_defaults():
    """Settings lacking a workload field (or holding a mistyped one) are refused by name; they used to be
    read through getattr defaults (a settings object without ``kv_dtype`` silently meant ``model``)."""
    from types import SimpleNamespace

    from kvtune.evaluate.workloads import WorkloadSettings, workload_sample_counts

    full = ProfileSettings(samples=3, cheap_samples=2)
    assert isinstance(full, WorkloadSettings) and workload_sample_counts("qa", full) == (3, 2)
    assert workload_sample_counts("continuation", ProfileSettings(contexts=5)) == (5, 5)
    partial = SimpleNamespace(samples=3, cheap_samples=2)
    with pytest.raises(KvtuneError, match=r"missing or mistyped text \(str, got None\), data .*kv_dtype .*prompt_format"):
        workload_sample_counts("qa", partial)
    with pytest.raises(KvtuneError, match=r"mistyped samples \(int, got True\)$"):
        workload_sample_counts("continuation", dataclasses.replace(full, samples=True))
