"""Tests of kvtune.methods.bicache: reuse exactness, payloads, depth choice, tables, DLM loop, profile run.

Tiny randomly initialised BERT models (2 layers, hidden 32) keep the file fast; the tests
marked ``real_model`` load the real all-MiniLM-L6-v2 once per session.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from tests.tiny_runs import WORDS, bert_config, bicache_settings, make_qa_data, make_tiny_bert
from kvtune.methods.bicache import (
    BiCacheSettings,
    choose_depth,
    compile_bicache_table,
    pack_prefix_state,
    prefix_state_bf16_bytes,
    run_bicache_profile,
    unmask_loop,
    unpack_prefix_state,
)
from kvtune.methods.bicache.adapters import adapter_for, load_encoder
from kvtune.methods.bicache.dlm import tokens_per_step
from kvtune.methods.bicache.quality import EXACT, pad_batch
from kvtune.methods.bicache.state import merge_states, roundtrip_prefix_state
from kvtune.methods.bicache.stats import CRITERIA, bootstrap_mean, mean_pool, per_token_cosine, retrieval_hits
from kvtune.methods.bicache.table import bicache_candidate, line_for, min_bandwidth_gbps
from kvtune.methods.bicache.workload import best_window, parse_buckets, suffix_tokens_for_ratio
from kvtune.codecs import PolicyConfig
from kvtune.core.errors import BiCacheError, TableError
from kvtune.tables import PolicyTable

@pytest.fixture(scope="module")
def tiny_bert():
    from transformers import BertModel

    torch.manual_seed(0)
    model = BertModel(bert_config(), add_pooling_layer=False).eval()
    return model, adapter_for(model, name="tiny-bert")


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory) -> Path:
    """A tiny BERT + WordPiece tokenizer saved to a folder (what load_encoder reads)."""
    return make_tiny_bert(tmp_path_factory.mktemp("tiny-bert"))


@pytest.fixture(scope="module")
def tiny_data(tmp_path_factory) -> Path:
    """JSONL passage/question/answer records over 12 random-word stories."""
    return make_qa_data(tmp_path_factory.mktemp("data") / "qa.jsonl")


PREFIX = [2, 10, 11, 12, 13, 14, 15, 16]  # [CLS] + 7 instruction tokens


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # small tensors / tiny models


# ------------------------------------------------------------------------------ adapter exactness


def test_depth0_reproduces_full_recompute_exactly(tiny_bert):
    model, ad = tiny_bert
    suffix = torch.randint(5, 100, (3, 9), generator=torch.Generator().manual_seed(0))
    out = ad.run(PREFIX, suffix, depth=0)
    with torch.inference_mode():
        ref = model(input_ids=torch.cat([torch.tensor(PREFIX).expand(3, -1), suffix], 1)).last_hidden_state
    assert torch.equal(out.hidden, ref)


def test_depth_L_prefix_only_reproduces_cache_exactly(tiny_bert):
    _, ad = tiny_bert
    state = ad.prefix_state(PREFIX)
    empty = torch.zeros(1, 0, dtype=torch.long)
    out = ad.run(PREFIX, empty, depth=ad.num_layers, state=state, capture=True)
    assert torch.equal(out.hidden, state.hiddens[ad.num_layers])
    for a, b in zip(out.prefix_state.keys + out.prefix_state.values, state.keys + state.values, strict=True):
        assert torch.equal(a, b)
    # and the cache is the prefix run alone through full recompute
    assert torch.equal(ad.run(PREFIX, empty, depth=0).hidden, state.hiddens[-1])


def test_reuse_uses_cache_below_depth_and_recomputes_above(tiny_bert):
    _, ad = tiny_bert
    state = ad.prefix_state(PREFIX)
    suffix = torch.randint(5, 100, (2, 6), generator=torch.Generator().manual_seed(1))
    out = ad.run(PREFIX, suffix, depth=1, state=state, capture=True)
    assert torch.equal(out.prefix_state.keys[0][0], state.keys[0][0])
    # layer 2 starts from the cached h_1, so its prefix K equals the cache; its output sees the suffix
    assert torch.equal(out.prefix_state.keys[1][0], state.keys[1][0])
    assert not torch.allclose(out.prefix_state.hiddens[2][0], state.hiddens[2][0])
    assert not torch.allclose(out.hidden[:, : len(PREFIX)], state.hiddens[2].expand(2, -1, -1))
    # with the prefix state taken *in context*, reuse at any depth reproduces full recompute
    for b in range(2):
        full = ad.run(PREFIX, suffix[b:b + 1], depth=0, capture=True)
        for d in range(ad.num_layers + 1):
            again = ad.run(PREFIX, suffix[b:b + 1], depth=d, state=full.prefix_state)
            torch.testing.assert_close(again.hidden, full.hidden, rtol=1e-5, atol=1e-5)


def test_padding_does_not_change_requests(tiny_bert):
    _, ad = tiny_bert
    state = ad.prefix_state(PREFIX)
    seqs = [[20, 21, 22, 3], [30, 31, 32, 33, 34, 35, 3]]
    ids, mask = pad_batch(seqs)
    for d in (0, 1, 2):
        batched = ad.run(PREFIX, ids, mask, depth=d, state=state)
        for i, s in enumerate(seqs):
            alone = ad.run(PREFIX, torch.tensor([s]), depth=d, state=state)
            torch.testing.assert_close(batched.hidden[i, : len(PREFIX) + len(s)], alone.hidden[0], rtol=1e-5, atol=1e-5)


def test_adapter_rejects_bad_requests(tiny_bert):
    _, ad = tiny_bert
    state = ad.prefix_state(PREFIX)
    suffix = torch.tensor([[20, 3]])
    with pytest.raises(BiCacheError, match="outside"):
        ad.run(PREFIX, suffix, depth=3, state=state)
    with pytest.raises(BiCacheError, match="needs the cached prefix state"):
        ad.run(PREFIX, suffix, depth=1)
    with pytest.raises(BiCacheError, match="another prefix"):
        ad.run(PREFIX[:-1] + [99], suffix, depth=1, state=state)
    with pytest.raises(BiCacheError, match="positions"):
        ad.run(PREFIX, torch.zeros(1, 300, dtype=torch.long), depth=0)
    with pytest.raises(BiCacheError, match="no BiCache adapter"):
        adapter_for(type("M", (), {"config": type("C", (), {"model_type": "llama"})()})())


# ------------------------------------------------------------------------------ payload


def test_payload_roundtrip_sizes_and_errors(tiny_bert):
    _, ad = tiny_bert
    state = ad.prefix_state(PREFIX)
    P, H, L = len(PREFIX), ad.hidden_size, ad.num_layers
    assert prefix_state_bf16_bytes(P, H, 0) == 0
    assert prefix_state_bf16_bytes(P, H, 2) == P * H * 2 * 5
    bf16 = PolicyConfig.uncompressed()
    blob = pack_prefix_state(state, 2, bf16)
    assert len(blob) >= prefix_state_bf16_bytes(P, H, 2)  # + headers
    dec = unpack_prefix_state(blob, PREFIX, L, policy=bf16)
    assert dec.depth == 2
    torch.testing.assert_close(dec.keys[1], state.keys[1], rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(dec.hiddens[2], state.hiddens[2].to(torch.bfloat16).float())
    assert len(pack_prefix_state(state, 0, bf16)) < 64
    small, nbytes, timing = roundtrip_prefix_state(state, 1, PolicyConfig.kivi(4, 8))
    assert nbytes < len(pack_prefix_state(state, 1, bf16)) and timing.decode_s >= 0
    with pytest.raises(BiCacheError, match="magic"):
        unpack_prefix_state(b"XXXX" + blob[4:], PREFIX, L)
    with pytest.raises(BiCacheError, match="bytes"):
        unpack_prefix_state(blob[:-1], PREFIX, L)
    with pytest.raises(BiCacheError, match="covers"):
        dec.check_covers(PREFIX, 3)
    # a depth-2 decoded state runs requests at depth <= 2 only
    out = ad.run(PREFIX, torch.tensor([[20, 3]]), depth=2, state=dec)
    assert out.hidden.shape == (1, P + 2, H)


def test_merge_states_takes_shallow_then_deep(tiny_bert):
    _, ad = tiny_bert
    alone = ad.prefix_state(PREFIX)
    ctx = ad.run(PREFIX, torch.tensor([[20, 21, 3]]), depth=0, capture=True).prefix_state
    m = merge_states(alone, ctx, 1)
    assert m.keys[0] is alone.keys[0] and m.keys[1] is ctx.keys[1] and m.hiddens[2] is ctx.hiddens[2]


# ------------------------------------------------------------------------------ pure math


def test_depth_choice_is_deepest_contiguous_pass():
    depths = [0, 1, 2, 3, 4]
    q = {"kv_cosine": [1.0, 0.99, 0.96, 0.94, 0.97], "embedding_cosine": [1.0, 0.999, 0.995, 0.99, 0.99]}
    assert choose_depth(depths, q, {"kv_cosine": 0.95}) == 2  # 4 passes again but 3 broke the run
    assert choose_depth(depths, q, {"kv_cosine": 0.95, "embedding_cosine": 0.998}) == 1
    assert choose_depth(depths, q, {"kv_cosine": 0.995}) == 0
    assert choose_depth(depths, q, {}) == 4
    with pytest.raises(ValueError):
        choose_depth([1, 2], {"kv_cosine": [1, 1]}, {"kv_cosine": 0.9})
    with pytest.raises(ValueError):
        choose_depth(depths, q, {"relative_retrieval": 0.9})


def test_stats_helpers():
    a = torch.randn(2, 3, 5, 4)
    assert torch.allclose(per_token_cosine(a, a), torch.ones(2, 5, dtype=torch.float64))
    assert torch.allclose(per_token_cosine(a, -a), -torch.ones(2, 5, dtype=torch.float64))
    h = torch.tensor([[[1.0, 0.0], [3.0, 0.0], [100.0, 100.0]]])
    emb = mean_pool(h, torch.tensor([[True, True, False]]), normalize=False)
    assert emb.tolist() == [[2.0, 0.0]]
    iv = bootstrap_mean([1.0, 1.0, 1.0])
    assert (iv.mean, iv.lo, iv.hi) == (1.0, 1.0, 1.0)
    iv = bootstrap_mean(np.arange(100.0))
    assert iv.lo < iv.mean < iv.hi
    q = torch.eye(3)
    hits = retrieval_hits(q, torch.eye(3), ["a", "b", "c"], ["a", "b", "x"])
    assert hits.tolist() == [1.0, 1.0, 0.0]


def test_workload_helpers():
    assert suffix_tokens_for_ratio(73, 0.5) == 73
    assert suffix_tokens_for_ratio(10, 1.0) == 1
    assert [b.key for b in parse_buckets([0.2, 0.5, 0.8])] == ["prefix_ratio=[0.20,0.50)", "prefix_ratio=[0.50,0.80)"]
    with pytest.raises(BiCacheError):
        parse_buckets([0.5, 0.4])
    toks = "the cat sat on the mat while a dog ran far away from the red barn".split()
    assert best_window(toks, 4, {"barn"}) == len(toks) - 4
    assert best_window(toks[:3], 4, {"cat"}) == 0
    assert tokens_per_step(10, 4) == [3, 3, 2, 2]


# ------------------------------------------------------------------------------ tables


def _cand(key, depth, codec, a_s, wire, acc, *, ref=1e9):
    return bicache_candidate(
        bucket_key=key, ratio_lo=0.5, ratio_hi=0.8, depth=depth, codec=codec, codec_config=None, model="tiny",
        prefix_tokens=8, reference_bytes=ref, wire_bytes=wire, compute_s=a_s, recompute_s=10.0, encode_s=0.0,
        decode_s=0.0, bf16_bytes=wire, relative_accuracy=acc, relative_accuracy_lo=acc, relative_accuracy_hi=acc,
        kv_cosine=1.0, embedding_cosine=1.0,
    )


def test_bicache_table_rows_load_and_select(tmp_path):
    k1, k2 = "prefix_ratio=[0.50,0.80)", "prefix_ratio=[0.20,0.50)"
    # V = 1 GB: lines a + b x; d0: (10, 0); d2 bf16: (6, 0.5); d2 kivi-4: (6.5, 0.15), accuracy 0.96
    cands = pd.DataFrame([
        _cand(k1, 0, "none", 10.0, 0.0, 1.0),
        _cand(k1, 2, "bf16", 6.0, 0.5e9, 1.0),
        _cand(k1, 2, "kivi-4", 6.5, 0.15e9, 0.96),
        _cand(k2, 0, "none", 10.0, 0.0, 1.0),
        _cand(k2, 1, "bf16", 9.0, 0.2e9, 1.0),
    ])
    table = compile_bicache_table(cands, model="tiny", workload="instructed-retrieval", device="cpu",
                                  floors=(0.99, 0.95), metadata={"kv_bytes_per_request": 1e9})
    assert set(table.keys) == {k1, k2} and set(table.frame["method"]) == {"bicache"}
    for path in (tmp_path / "t.parquet", tmp_path / "t.json"):
        (table.to_parquet if path.suffix == ".parquet" else table.to_json)(path)
        loaded = PolicyTable.load(path)
        assert len(loaded) == len(table) and "reuse_depth" in loaded.frame.columns

        def pick(bw, q, key=k1):
            return loaded.select(bw, q, key=key).policy.label

        # x = 8 / Gbps; breakpoints at x = 1/0.35 (bf16 -> kivi) and 3.5/0.15 (kivi -> recompute)
        assert pick(100.0, 0.95) == "bicache d=2 + bf16"
        assert pick(1.0, 0.95) == "bicache d=2 + kivi-4"
        assert pick(0.1, 0.95) == "bicache d=0 (full recompute)"
        # kivi-4 (0.96) is not admissible at floor 0.99: bf16 until x = 8, then recompute
        assert pick(2.0, 0.99) == "bicache d=2 + bf16"
        assert pick(0.5, 0.99) == "bicache d=0 (full recompute)"
        assert pick(1000.0, 0.99, k2) == "bicache d=1 + bf16"
        sel = loaded.select(1.0, 0.95, key=k1)
        assert sel.predicted_seconds == pytest.approx(6.5 + 0.15 * 8.0)
    with pytest.raises(TableError):
        loaded.select(1.0, 0.95, key="prefix_ratio=[0.00,0.10)")
    with pytest.raises(TableError, match="depth-0"):
        compile_bicache_table(cands[cands["reuse_depth"] > 0], model="m", workload="w", device="cpu")


def fixed_bicache_candidates() -> pd.DataFrame:
    """Three prefix-ratio buckets x depths 0-3 x codecs, one accuracy 1e-13 below a floor (the
    compile tolerance admits it) and an identical twin of a line (ties resolve by id)."""
    rows = []
    V = 2e6
    for key, lo, hi in (("prefix_ratio=[0.20,0.50)", 0.2, 0.5), ("prefix_ratio=[0.50,0.80)", 0.5, 0.8),
                        ("prefix_ratio=[0.80,0.95)", 0.8, 0.95)):
        for depth in range(4):
            for codec, frac, dec_s, acc in (("bf16", 1.0, 0.0004, 1.0), ("kivi-4", 0.28, 0.0009, 0.975),
                                            ("kivi-2", 0.16, 0.0011, 0.95 - 1e-13)):
                if depth == 0 and codec != "bf16":
                    continue
                a_acc = 1.0 if depth == 0 else min(1.02, acc + 0.01 * (2 - depth) * lo)
                rows.append(bicache_candidate(
                    bucket_key=key, ratio_lo=lo, ratio_hi=hi, depth=depth, codec="none" if depth == 0 else codec,
                    codec_config=None if depth == 0 else {"codec": codec}, model="tiny", prefix_tokens=12,
                    reference_bytes=V, wire_bytes=V * depth / 3 * frac, compute_s=0.01 * (1 - lo * depth / 3),
                    recompute_s=0.01, encode_s=0.0005 * depth, decode_s=dec_s * depth, bf16_bytes=V * depth / 3,
                    relative_accuracy=a_acc, relative_accuracy_lo=a_acc - 0.02,
                    relative_accuracy_hi=min(a_acc + 0.01, 1.0), kv_cosine=1.0 - 0.01 * depth,
                    embedding_cosine=1.0 - 0.001 * depth))
    twin = dict(rows[2])
    twin.update(policy_id="0000twin0000", label="bicache d=1 + twin")
    rows.append(twin)
    return pd.DataFrame(rows)


def test_bicache_table_of_fixed_candidates_matches_the_recorded_table():
    """Recorded with the BiCache-only compile loop before BiCache moved onto the shared
    compiler (``tests/data/bicache_table_golden.json``): same rows, same order, same numbers."""
    table = compile_bicache_table(fixed_bicache_candidates(), model="tiny", workload="instructed-retrieval",
                                  device="cpu", floors=(0.99, 0.97, 0.95, 0.9), metadata={"kv_bytes_per_request": 2e6})
    golden = PolicyTable.load(Path(__file__).parent / "data" / "bicache_table_golden.json")
    pd.testing.assert_frame_equal(table.frame, golden.frame, check_exact=False, rtol=1e-12)
    envelope = table.frame[table.frame["key"] == "prefix_ratio=[0.50,0.80)"]
    assert list(envelope[envelope["accuracy_floor"] == 0.95]["label"]) == [
        "bicache d=3 + bf16", "bicache d=3 + kivi-4", "bicache d=2 + kivi-2", "bicache d=1 + kivi-2",
        "bicache d=0 (full recompute)"]  # d=2/d=1 kivi-2 sit 1e-13 below the floor: admitted
    first = table.frame[(table.frame["key"] == "prefix_ratio=[0.20,0.50)") & (table.frame["accuracy_floor"] == 0.97)]
    assert json.loads(first["runners_up"].iloc[-1])[0] == "0000twin0000"  # identical lines: lower id first
    assert table.metadata["extra"] == golden.metadata["extra"]


def test_line_and_min_bandwidth():
    assert line_for(0.01, 0.0, 0.0, 1e6) == (10.0, 0.0)
    a, b = line_for(0.002, 0.001, 5e5, 1e6)
    assert a == pytest.approx(3.0) and b == 0.5
    # saves 0.5 s by sending 1 GB: pays above 16 Gbps
    assert min_bandwidth_gbps(0.4, 0.1, 1e9, 1.0) == pytest.approx(16.0)
    assert min_bandwidth_gbps(1.0, 0.1, 1e9, 1.0) == math.inf


# ------------------------------------------------------------------------------ diffusion-LM path


@pytest.fixture(scope="module")
def tiny_mlm():
    from transformers import BertForMaskedLM

    torch.manual_seed(2)
    model = BertForMaskedLM(bert_config()).eval()
    return model, adapter_for(model, name="tiny-mlm")


def _reference_llada(model, prefix, own, gen_length, steps, mask_id):
    """Plain LLaDA greedy loop on the transformers model itself (full recompute each step)."""
    x = torch.full((gen_length,), mask_id, dtype=torch.long)
    for k in tokens_per_step(gen_length, steps):
        ids = torch.cat([torch.tensor(prefix), torch.tensor(own, dtype=torch.long), x]).unsqueeze(0)
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0, len(prefix) + len(own):]
        logits[:, mask_id] = -torch.inf
        conf, pred = torch.softmax(logits, -1).max(-1)
        conf = torch.where(x == mask_id, conf, torch.full_like(conf, -1.0))
        idx = torch.topk(conf, k).indices
        x[idx] = pred[idx]
    return x


def test_dlm_loop_without_reuse_matches_plain_llada(tiny_mlm):
    model, ad = tiny_mlm
    ref = _reference_llada(model, PREFIX, [40, 41], 8, 4, 4)
    res = unmask_loop(ad, PREFIX, gen_length=8, steps=4, mask_token_id=4, depth=0, refresh_every=1, request_ids=[40, 41])
    assert torch.equal(res.tokens, ref)
    assert res.refresh_steps == (0, 1, 2, 3) and res.compute_fraction == 1.0
    assert (res.tokens != 4).all()


def test_dlm_loop_reuse_and_refresh_mechanics(tiny_mlm):
    _, ad = tiny_mlm
    state = ad.prefix_state(PREFIX)
    L, P, N = ad.num_layers, len(PREFIX), 2 + 12
    res = unmask_loop(ad, PREFIX, gen_length=12, steps=6, mask_token_id=4, depth=1, prefix_state=state,
                      refresh_every=4, request_ids=[40, 41])
    assert res.refresh_steps == (0, 4)
    assert (res.tokens != 4).all()
    refresh = 1 * N + (L - 1) * (P + N)
    assert res.token_layers == 2 * refresh + 4 * L * N
    assert res.token_layers_full == 6 * L * (P + N) and res.compute_fraction < 1
    # refreshing every step at depth d = one reuse run per step
    every = unmask_loop(ad, PREFIX, gen_length=12, steps=6, mask_token_id=4, depth=1, prefix_state=state,
                        refresh_every=1, request_ids=[40, 41])
    assert every.refresh_steps == tuple(range(6))
    with pytest.raises(BiCacheError):
        unmask_loop(ad, PREFIX, gen_length=4, steps=2, mask_token_id=4, refresh_every=0)
    with pytest.raises(BiCacheError):
        unmask_loop(ad, PREFIX, gen_length=2, steps=4, mask_token_id=4)


# ------------------------------------------------------------------------------ profile run


def test_settings_roundtrip_and_validation():
    s = BiCacheSettings(buckets=(0.2, 0.6, 0.9), codecs=("bf16",), floors={"kv_cosine": 0.9})
    assert BiCacheSettings.from_dict(json.loads(json.dumps(s.to_dict()))) == s
    with pytest.raises(BiCacheError, match="codec"):
        BiCacheSettings(codecs=("nope",))
    with pytest.raises(BiCacheError, match="criterion"):
        BiCacheSettings(floors={"nope": 1.0})
    with pytest.raises(BiCacheError, match="unknown BiCache setting"):
        BiCacheSettings.from_dict({"bogus": 1})


@pytest.fixture(scope="module")
def tiny_run(tiny_folder, tiny_data, tmp_path_factory):
    ad, tok = load_encoder(str(tiny_folder))
    settings = bicache_settings(tiny_folder, tiny_data)
    out = tmp_path_factory.mktemp("runs") / "tiny"
    return run_bicache_profile(settings, out, adapter=ad, tokenizer=tok), settings


def test_profile_writes_run_folder(tiny_run):
    res, _ = tiny_run
    for name in json.loads((res.run_dir / "run.json").read_text())["files"]:
        assert (res.run_dir / name).is_file(), name
    assert list(res.depth_table["key"]) == ["prefix_ratio=[0.30,0.60)", "prefix_ratio=[0.60,0.90)"]
    assert set(res.quality["depth"]) == {0, 1, 2}
    assert set(res.quality["policy"]) == {"recompute", EXACT, "bf16", "kivi-4"}
    assert set(res.throughput["depth"]) == {0, 1, 2} and (res.throughput["requests_per_s"] > 0).all()
    r = res.quality[(res.quality["depth"] == 0)]
    assert (r["embedding_cosine"] == 1.0).all() and (r["relative_retrieval"] == 1.0).all()
    summary = (res.run_dir / "summary.md").read_text()
    assert "Prefix ratio -> reuse depth" in summary


def test_chosen_depth_never_violates_floor_on_calibration_data(tiny_run):
    res, settings = tiny_run
    q = res.quality[res.quality["policy"].isin([EXACT, "recompute"])]
    for row in res.depth_table.to_dict("records"):
        sub = q[q["key"] == row["key"]].set_index("depth")
        d = row["chosen_depth"]
        for crit, floor in settings.floors.items():
            for dd in range(d + 1):  # the chosen depth and every shallower one
                assert sub.loc[dd, CRITERIA[crit].column()] >= floor
                assert sub.loc[dd, crit] >= floor
        if d + 1 in sub.index:  # deepest: the next depth breaks some floor
            assert any(sub.loc[d + 1, CRITERIA[c].column()] < f for c, f in settings.floors.items())


def test_profile_table_rows_load_and_select(tiny_run):
    res, _ = tiny_run
    table = PolicyTable.load(res.run_dir / "policy_table.parquet")
    again = PolicyTable.load(res.run_dir / "policy_table.json")
    assert len(table) == len(again) and set(table.keys) == set(res.depth_table["key"])
    assert set(table.frame["method"]) == {"bicache"}
    assert table.kv_bytes_per_request == res.candidates["compression_ratio"][res.candidates["reuse_depth"] == 1].iloc[0] * \
        res.candidates["wire_bytes"][res.candidates["reuse_depth"] == 1].iloc[0]
    for key in table.keys:
        slow = table.select(1e-6, 0.9, key=key)  # a crawling link: fetching never pays
        assert slow.policy.label == "bicache d=0 (full recompute)"
        fast = table.select(1e9, 0.9, key=key)
        c = res.candidates
        cands = c[(c["key"] == key) & (c["relative_accuracy"] >= 0.9) & c["admissible"]]
        chosen = int(res.depth_table.set_index("key").loc[key, "chosen_depth"])
        assert cands["reuse_depth"].max() <= chosen  # deeper than the safe depth never enters the table
        assert fast.policy.a_s_per_gb == pytest.approx(cands["a_s_per_gb"].min())


def test_compile_run_table_recompiles_from_saved_frames(tiny_run):
    from kvtune.methods.bicache.api import compile_run_table

    res, _ = tiny_run
    before = PolicyTable.load(res.run_dir / "policy_table.parquet")
    again = compile_run_table(res.run_dir)
    pd.testing.assert_frame_equal(before.frame, again.frame)
    with pytest.raises(BiCacheError):
        compile_run_table(res.run_dir / "missing")


def test_cli_profile_on_tiny_model(tiny_folder, tiny_data, tmp_path):
    from typer.testing import CliRunner

    from kvtune.cli import app

    res = CliRunner().invoke(app, [
        "profile", "--method", "bicache", "--model", str(tiny_folder), "--set", f"data={tiny_data}",
        "--out", str(tmp_path), "--reports", str(tmp_path / "reports"), "--run", "r", "--set", "buckets=0.4,0.9",
        "--set", "requests_per_bucket=4",
        "--set", "codecs=bf16", "--set", "repeats=1", "--set", 'floors={"kv_cosine": 0.9}',
    ])
    assert res.exit_code == 0, res.output
    assert (tmp_path / "r" / "policy_table.parquet").is_file()
    assert (tmp_path / "reports" / "r.html").is_file()  # not in the working tree's reports/
    bad = CliRunner().invoke(app, ["profile", "--method", "bicache", "--model", str(tiny_folder), "--set", "codecs=nope",
                                   "--out", str(tmp_path)])
    assert bad.exit_code == 2 and "unknown codec" in bad.output


@pytest.mark.parametrize("kind", ["missing", "empty folder", "file"])
def test_cli_profile_with_a_bad_model_path_is_a_typed_error_and_leaves_no_run_folder(tmp_path, kind):
    from typer.testing import CliRunner

    from kvtune.cli import app

    model = tmp_path / "model"
    if kind == "empty folder":
        model.mkdir()
    elif kind == "file":
        model.write_text("not a model")
    res = CliRunner().invoke(app, ["profile", "--method", "bicache", "--model", str(model), "--out", str(tmp_path / "p"),
                                   "--run", "r"])
    out = " ".join(res.output.split())
    assert res.exit_code == 2 and f"--model {str(model)!r}" in out and "Traceback" not in out, (out, res.exception)
    assert not (tmp_path / "p").exists()


class _Killed(Exception):
    """Stands in for kill -9 in the middle of a run."""


def test_profile_resumes_after_a_kill_and_its_folder_answers_select_export_report(tiny_folder, tiny_data, tmp_path):
    from typer.testing import CliRunner

    from kvtune.cli import app

    ad, tok = load_encoder(str(tiny_folder))
    settings = BiCacheSettings(
        model=str(tiny_folder), data=str(tiny_data), instruction=" ".join(WORDS[:15]), buckets=(0.3, 0.6, 0.9),
        requests_per_bucket=6, codecs=("bf16",), batch_size=4, throughput_batch=4, repeats=1,
        floors={"kv_cosine": 0.9}, table_floors=(0.99, 0.9),
    )
    run = tmp_path / "profiles" / "bc"

    def kill(key):
        raise _Killed(key)

    with pytest.raises(_Killed):
        run_bicache_profile(settings, run, adapter=ad, tokenizer=tok, on_trial=kill)
    first = [json.loads(line) for line in (run / "trials.jsonl").read_text().splitlines()]
    assert [r["key"] for r in first] == ["prefix_ratio=[0.30,0.60)"]
    assert json.loads((run / "run.json").read_text())["method"] == "bicache"
    with pytest.raises(BiCacheError, match="already has trials"):
        run_bicache_profile(settings, run, adapter=ad, tokenizer=tok)
    done = []
    res = run_bicache_profile(settings, run, adapter=ad, tokenizer=tok, resume=True, reports=tmp_path / "reports",
                              on_trial=done.append)
    assert done == ["prefix_ratio=[0.60,0.90)"]  # the stored bucket is not measured again
    assert list(res.depth_table["key"]) == ["prefix_ratio=[0.30,0.60)", "prefix_ratio=[0.60,0.90)"]
    kept = res.throughput[res.throughput["key"] == "prefix_ratio=[0.30,0.60)"]
    assert kept["requests_per_s"].tolist() == [r["requests_per_s"] for r in first[0]["throughput"]]
    assert "plotly" in (tmp_path / "reports" / "bc.html").read_text()
    cli = CliRunner()
    sel = cli.invoke(app, ["select", str(run), "--bandwidth", "10Gbps", "--q-min", "0.9", "--json",
                           "--key", "prefix_ratio=[0.30,0.60)"])
    assert sel.exit_code == 0, sel.output
    assert json.loads(sel.output)["method"] == "bicache"
    out = tmp_path / "bc.parquet"
    exp = cli.invoke(app, ["export", str(run), "--out", str(out), "--recompile"])
    assert exp.exit_code == 0, exp.output
    pd.testing.assert_frame_equal(PolicyTable.load(out).frame, res.table.frame)
    rep = cli.invoke(app, ["report", str(run)])
    assert rep.exit_code == 0 and "report" in rep.output, rep.output
    assert (tmp_path / "reports" / "bc.html").is_file()


def test_kvtune_profile_method_bicache_shares_the_common_options_and_resumes(tiny_folder, tiny_data, tmp_path):
    from typer.testing import CliRunner

    from kvtune.cli import app

    cli = CliRunner()
    common = ["profile", "--method", "bicache", "--model", str(tiny_folder), "--out", str(tmp_path / "p"),
              "--reports", str(tmp_path / "r"), "--run", "b", "--device", "cpu"]
    res = cli.invoke(app, [*common, "--set", f"data={tiny_data}", "--set", "buckets=0.4,0.9",
                           "--set", "requests_per_bucket=4", "--set", "codecs=bf16", "--set", "repeats=1",
                           "--set", 'floors={"kv_cosine": 0.9}'])
    assert res.exit_code == 0, (res.output, res.exception)
    run = tmp_path / "p" / "b"
    assert (run / "policy_table.parquet").is_file() and (tmp_path / "r" / "b.html").is_file()
    info = json.loads((run / "run.json").read_text())
    assert info["method"] == "bicache" and info["settings"]["buckets"] == [0.4, 0.9]
    again = cli.invoke(app, ["profile", "--resume", str(run)])  # finished: nothing is measured again
    assert again.exit_code == 0, again.output
    assert len((run / "trials.jsonl").read_text().splitlines()) == 1
    bad = cli.invoke(app, [*common, "--set", "nope=1"])
    out = " ".join(bad.output.split())
    assert bad.exit_code == 2 and "--set nope: not a setting of this method; known:" in out and "buckets" in out
    bad = cli.invoke(app, [*common, "--set", "repeats=many"])
    assert bad.exit_code == 2 and "--set repeats=many: expected an integer" in " ".join(bad.output.split())


# ------------------------------------------------------------------------------ real encoder


@pytest.fixture(scope="session")
def minilm():
    return load_encoder("all-minilm-l6-v2")


@pytest.mark.real_model
def test_minilm_reuse_exactness_and_shallow_stability(minilm):
    ad, tok = minilm
    prefix = [tok.cls_token_id, *tok("Represent this story passage for retrieval:", add_special_tokens=False)["input_ids"]]
    suffix = tok("Mark Hunter is a high school student in Phoenix who runs a pirate radio station.",
                 add_special_tokens=False)["input_ids"] + [tok.sep_token_id]
    with torch.inference_mode():
        ref = ad.model(input_ids=torch.tensor([prefix + suffix])).last_hidden_state
    assert torch.equal(ad.run(prefix, torch.tensor([suffix]), depth=0).hidden, ref)
    state = ad.prefix_state(prefix)
    ctx = ad.run(prefix, torch.tensor([suffix]), depth=0, capture=True).prefix_state
    key_cos = [float(per_token_cosine(state.keys[l], ctx.keys[l]).mean()) for l in range(ad.num_layers)]
    assert key_cos[0] == pytest.approx(1.0, abs=1e-6)  # layer-1 K depends on the token and position only
    assert min(key_cos) < 0.999  # deeper layers see the suffix
    empty = torch.zeros(1, 0, dtype=torch.long)
    assert torch.equal(ad.run(prefix, empty, depth=ad.num_layers, state=state).hidden, state.hiddens[-1])


def test_report_plot_data_of_the_tiny_run(tiny_run):
    from kvtune.methods.bicache.report import exact_quality, layer_matrix, pivot_rows, throughput_gain

    res, _ = tiny_run
    q = exact_quality(res.quality, res.depth_table)
    assert list(q.columns[:5]) == ["key", "depth", "kv_cosine_lo", "embedding_cosine_lo", "relative_retrieval"]
    assert len(q) == 2 * 3 and (q[q["depth"] == 0]["embedding_cosine_lo"] == 1.0).all()
    m = layer_matrix(res.layer_cosine, "key")
    assert list(m.index) == list(res.depth_table["key"]) and list(m.columns) == [1, 2]
    gain = throughput_gain(res.throughput, res.depth_table)
    assert (gain[gain["depth"] == 0]["speedup"] == 1.0).all()
    piv = pivot_rows(res.throughput, "depth", "speedup", "d={}", "{:.2f}x")
    assert list(piv.columns) == ["prefix ratio", "d=0", "d=1", "d=2"] and list(piv["d=0"]) == ["1.00x", "1.00x"]
