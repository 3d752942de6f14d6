"""The continuation workload's setup split in parts (kvtune.evaluate.workloads.parts): built on
several workers, assembled on each, bitwise the setup one process computes."""

from __future__ import annotations

import pytest
import torch

from kvtune.codecs import PolicyConfig
from kvtune.core.errors import KvtuneError
from kvtune.evaluate.model import load_model
from kvtune.evaluate.workloads import build_workload_part, make_workload, workload_part_count
from kvtune.evaluate.workloads.parts import PartError, batches_of_part
from kvtune.methods.tqc.method import TQCMethod
from kvtune.methods.tqc.settings import ProfileSettings

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def settings(tiny_text, **other) -> ProfileSettings:
    return ProfileSettings(**{"text": str(tiny_text), "contexts": 9, "context_tokens": 48, "continuation_tokens": 8,
                              "cheap_samples": 4, **other})


@pytest.fixture(scope="module")
def lm(tiny_model_dir):
    return load_model(str(tiny_model_dir), "cpu")


def parts_of(lm, st, count):
    return [build_workload_part("continuation", lm, settings=st, index=i, count=count) for i in range(count)]


def test_batches_of_a_part_are_every_count_th_forward_batch():
    assert batches_of_part(9, 4, 0, 2) == [(0, 4), (8, 9)]
    assert batches_of_part(9, 4, 1, 2) == [(4, 8)]
    assert batches_of_part(9, 4, 2, 3) == [(8, 9)]
    assert batches_of_part(3, 4, 1, 2) == []
    with pytest.raises(ValueError):
        batches_of_part(9, 4, 2, 2)


@pytest.mark.parametrize("contexts, workers, parts", [(9, 2, 2), (9, 5, 3), (3, 2, 1), (24, 2, 2), (24, 8, 6)])
def test_part_count_is_one_per_worker_up_to_one_per_forward_batch(tiny_text, contexts, workers, parts):
    st = settings(tiny_text, contexts=contexts)
    assert workload_part_count("continuation", st, workers) == parts
    assert TQCMethod().setup_parts(st, workers) == parts
    assert workload_part_count("boolq", st, workers) == 1  # its setup does not split


@pytest.mark.parametrize("kv_dtype, count", [("bfloat16", 2), ("model", 3)])
def test_a_setup_assembled_from_parts_is_bitwise_the_one_process_setup(lm, tiny_text, kv_dtype, count):
    st = settings(tiny_text, kv_dtype=kv_dtype)
    whole = make_workload("continuation", lm, settings=st)
    parts = parts_of(lm, st, count)
    assert [len(p) for p in parts] == ([2, 1] if count == 2 else [1, 1, 1])
    assembled = make_workload("continuation", lm, settings=st, parts=parts[::-1])  # any order
    assert torch.equal(assembled.cap.input_ids, whole.cap.input_ids)
    assert assembled.cap.dtype == whole.cap.dtype == torch.float32
    assert assembled.cap.kv[0][0].dtype == (torch.bfloat16 if kv_dtype == "bfloat16" else torch.float32)
    for (ka, va), (kw, vw) in zip(assembled.cap.kv, whole.cap.kv):
        assert torch.equal(ka, kw) and torch.equal(va, vw)
    for fidelity in ("full", "cheap"):
        a, w = assembled.baseline(fidelity).loaded(), whole.baseline(fidelity).loaded()
        for f in ("logp", "argmax", "targets", "nll"):
            assert torch.equal(getattr(a, f), getattr(w, f)), (fidelity, f)
        ra = assembled.evaluate(PolicyConfig.kivi(2), fidelity=fidelity)
        rw = whole.evaluate(PolicyConfig.kivi(2), fidelity=fidelity)
        for key in ("relative_accuracy_raw", "relative_accuracy_lo", "kl_mean", "nll", "nll_base", "compression_ratio"):
            assert ra[key] == rw[key], (fidelity, key)
        assert rw["kl_mean"] > 0.0 and rw["relative_accuracy_raw"] != 1.0  # kivi-2 changes the run


def test_parts_that_do_not_make_up_the_contexts_are_refused(lm, tiny_text):
    st = settings(tiny_text)
    first, second = parts_of(lm, st, 2)
    with pytest.raises(PartError, match="hold contexts 8:9 where context 4 of 9 was expected"):
        make_workload("continuation", lm, settings=st, parts=[first])
    with pytest.raises(PartError, match="hold contexts 4:8 where context 8 of 9 was expected"):
        make_workload("continuation", lm, settings=st, parts=[first, second, second])
    with pytest.raises(PartError, match="hold 8 of the 9 contexts"):
        make_workload("continuation", lm, settings=st, parts=[[first[0]], second])
    other = parts_of(lm, settings(tiny_text, context_tokens=40, continuation_tokens=16), 2)
    with pytest.raises(PartError, match="built from other token ids or context tokens \\(40, not 48"):
        make_workload("continuation", lm, settings=st, parts=other)  # the same 56 tokens, cut elsewhere
    with pytest.raises(PartError, match="KV of another dtype"):
        make_workload("continuation", lm, settings=st, parts=[first, parts_of(lm, settings(tiny_text, kv_dtype="model"), 2)[1]])
    with pytest.raises(KvtuneError, match="workload 'boolq': its setup does not split"):
        build_workload_part("boolq", lm, settings=st, index=0, count=2)


def test_tqc_prepare_from_parts_keeps_the_worker_s_model_and_gives_the_same_context(lm, tiny_model_dir, tiny_text,
                                                                                      tmp_path):
    from kvtune.run.method import Hooks

    st = settings(tiny_text, model=str(tiny_model_dir), out=str(tmp_path), reports=str(tmp_path), device="cpu")
    method = TQCMethod()
    built = [method.prepare_part(st, tmp_path, Hooks(), i, 2, lm=lm) for i in range(2)]
    assert all(given["lm"] is lm and sorted(given) == ["lm", "setup_started"] for _, given in built)
    ctx = method.prepare(st, tmp_path / "a", Hooks(), parts=[p for p, _ in built], **built[0][1])
    assert ctx.times["load_and_prefill"] > 0
    whole = method.prepare(st, tmp_path / "b", Hooks(), lm=lm)
    assert ctx.lm is lm
    assert [c.policy_id for c in ctx.space.candidates] == [c.policy_id for c in whole.space.candidates]
    assert ctx.ratios.tolist() == whole.ratios.tolist() and len(ctx.ratios) == len(whole.space)


def test_a_part_whose_arrays_hold_another_number_of_contexts_is_refused(lm, tiny_text):
    import dataclasses

    st = settings(tiny_text)
    first, second = parts_of(lm, st, 2)
    b = first[0]  # contexts 0:4
    kv = ((b.kv[0][0][:1], b.kv[0][1]), *b.kv[1:])  # one context's K: would broadcast over the four
    with pytest.raises(PartError, match="contexts 0:4.*layer 0 K"):
        make_workload("continuation", lm, settings=st, parts=[[dataclasses.replace(b, kv=kv), first[1]], second])
    baseline = {**b.baseline, "nll": b.baseline["nll"][:3]}
    with pytest.raises(PartError, match="contexts 0:4.*baseline nll"):
        make_workload("continuation", lm, settings=st, parts=[[dataclasses.replace(b, baseline=baseline), first[1]], second])
