"""Tests of kvtune.methods.scd: low-rank maps, state capture and rebuild, transfer methods, mixed-method tables."""

from __future__ import annotations

import copy
import json
import math

import numpy as np
import pandas as pd
import pytest
import torch

from tests.tiny_runs import finetuned, scd_pair_settings
from kvtune.core.errors import ConfigError, KvtuneError, ModelLayoutError, TableError
from kvtune.evaluate.model import LoadedModel, load_model
from kvtune.methods.scd.calibration import calibrate
from kvtune.methods.scd.consumer import ConsumerRecipe, consumer_dir, is_held_out, lr_at, token_windows
from kvtune.methods.scd.lowrank import fit_low_rank_map, relative_error
from kvtune.methods.scd.methods import (
    METHODS,
    SCD,
    DroidSpeak,
    Pair,
    Raw,
    Recompute,
    prefix_context,
    ttft_seconds,
)
from kvtune.methods.scd.states import capture_states, check_same_architecture, run_layers
from kvtune.tables import PolicyTable, compile_policy_table

# ------------------------------------------------------------------------------ low-rank maps


def test_low_rank_map_recovers_known_linear_map():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(300, 12, generator=g, dtype=torch.float64)
    a = torch.randn(12, 3, generator=g, dtype=torch.float64) @ torch.randn(3, 8, generator=g, dtype=torch.float64)
    bias = torch.randn(8, generator=g, dtype=torch.float64)
    y = x @ a + bias
    m = fit_low_rank_map(x, y, rank=3, ridge=0.0)
    assert m.rank == 3
    torch.testing.assert_close((m.encoder @ m.decoder).double(), a, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(m(x.float()).double(), y, atol=1e-4, rtol=1e-5)
    # a lower rank loses exactly the energy of the dropped directions; the full rank is exact too
    assert relative_error(m.truncate(2)(x.float()), y) > 1e-3
    full = fit_low_rank_map(x, y, ridge=0.0)
    assert full.rank == 8
    torch.testing.assert_close(full(x.float()).double(), y, atol=1e-4, rtol=1e-5)


def test_low_rank_map_ridge_shrinks_and_rejects_bad_input():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(50, 6, generator=g)
    y = x @ torch.randn(6, 4, generator=g)
    strong = fit_low_rank_map(x, y, ridge=10.0)
    exact = fit_low_rank_map(x, y, ridge=0.0)
    assert strong.encoder.norm() < exact.encoder.norm()
    with pytest.raises(ConfigError):
        fit_low_rank_map(x, y, rank=5)
    with pytest.raises(ConfigError):
        fit_low_rank_map(x, y[:10])
    with pytest.raises(ConfigError):
        exact.truncate(0)


def test_low_rank_bytes():
    m = fit_low_rank_map(torch.randn(40, 10), torch.randn(40, 6), rank=4)
    assert m.producer_nbytes() == 4 * (10 + 10 * 4)
    assert m.consumer_nbytes() == 4 * (4 * 6 + 6)


# ------------------------------------------------------------------------------ tiny pair


def _with_new_last_kv_projections(lm: LoadedModel, seed: int) -> LoadedModel:
    """A consumer that differs from ``lm`` only in the last layer's k_proj / v_proj weights.

    Its residual stream equals the producer's (the last layer's K/V change nothing the
    prefix's own states depend on), so its pre-RoPE K/V are an exact linear function of the
    producer's normalized inputs in every layer.
    """
    model = copy.deepcopy(lm.model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        attn = model.model.layers[-1].self_attn
        for proj in (attn.k_proj, attn.v_proj):
            proj.weight.add_(0.5 * torch.randn(proj.weight.shape, generator=g))
    return LoadedModel(name="consumer-kv", model=model, tokenizer=lm.tokenizer, device=lm.device)


@pytest.fixture(scope="module")
def tiny_lm(tiny_model_dir):
    return load_model(str(tiny_model_dir), "cpu")


def _windows(n: int, tokens: int, seed: int = 0, vocab: int = 200) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, vocab, (n, tokens), generator=g).tolist()


def test_capture_states_and_run_layers_rebuild_the_models_own_cache(tiny_lm):
    ids = _windows(1, 20)[0]
    s = capture_states(tiny_lm, ids)
    n = tiny_lm.num_layers
    assert len(s.hidden) == len(s.normed) == len(s.k_pre) == n
    assert s.k_pre[0].shape == (20, tiny_lm.kv_heads * tiny_lm.head_dim)
    rebuilt = run_layers(tiny_lm, s.hidden[0], 0, n)
    for (k, v), (k2, v2) in zip(s.kv, rebuilt):
        torch.testing.assert_close(k2, k, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(v2, v, atol=1e-5, rtol=1e-5)


def _assert_same_kv(got, want, atol=1e-4):
    for (k, v), (k2, v2) in zip(want, got):
        torch.testing.assert_close(k2, k, atol=atol, rtol=1e-4)
        torch.testing.assert_close(v2, v, atol=atol, rtol=1e-4)


def test_full_rank_scd_reproduces_consumer_kv_on_calibration_data(tiny_lm):
    # A genuinely different consumer (every weight matrix perturbed); with no more calibration
    # tokens than input dimensions (hidden 64), the full-rank affine map interpolates them.
    consumer = finetuned(tiny_lm, seed=3, scale=0.3)
    windows = _windows(2, 30)
    cal = calibrate(tiny_lm, consumer, windows, ranks=(8,), ridge=0.0)
    d_out = 2 * tiny_lm.kv_heads * tiny_lm.head_dim
    assert cal.reuse[0].rank == d_out
    assert min(cal.kv_drift) > 0.01  # the producer's raw KV is not the consumer's
    pair = Pair(tiny_lm, consumer, cal)
    method = SCD.uniform(tiny_lm.num_layers, d_out, code_dtype="float32")
    for ids in windows:
        got = method.transfer(pair, prefix_context(tiny_lm, ids))
        _assert_same_kv(got.kv, capture_states(consumer, ids).kv)
        assert got.payload_bytes == 4 * d_out * len(ids) * tiny_lm.num_layers
    # and the raw transfer is far from it
    raw = Raw().transfer(pair, prefix_context(tiny_lm, windows[0])).kv
    assert (raw[0][0] - capture_states(consumer, windows[0]).kv[0][0]).abs().max() > 1e-2


def test_full_rank_scd_generalizes_when_the_consumer_kv_is_linear(tiny_lm):
    consumer = _with_new_last_kv_projections(tiny_lm, seed=3)
    cal = calibrate(tiny_lm, consumer, _windows(4, 40), ranks=(8,), ridge=0.0)
    pair = Pair(tiny_lm, consumer, cal)
    method = SCD.uniform(tiny_lm.num_layers, 2 * tiny_lm.kv_heads * tiny_lm.head_dim, code_dtype="float32")
    ids = _windows(1, 25, seed=9)[0]  # not a calibration window
    _assert_same_kv(method.transfer(pair, prefix_context(tiny_lm, ids)).kv, capture_states(consumer, ids).kv)


def test_quantized_scd_codes_go_through_the_tqc_pipeline(tiny_lm):
    from kvtune.codecs import decode_kv
    from kvtune.methods.scd.methods import code_policy

    consumer = finetuned(tiny_lm, seed=3, scale=0.3)
    windows = _windows(2, 40)
    cal = calibrate(tiny_lm, consumer, windows, ranks=(8,), ridge=0.0)
    pair = Pair(tiny_lm, consumer, cal)
    d_out = 2 * tiny_lm.kv_heads * tiny_lm.head_dim
    ctx = prefix_context(tiny_lm, windows[0])
    exact = SCD.uniform(tiny_lm.num_layers, d_out, code_dtype="float32").transfer(pair, ctx)
    bf16 = SCD.uniform(tiny_lm.num_layers, d_out).transfer(pair, ctx)
    errors = {}
    for bits in (8, 4):
        got = SCD.uniform(tiny_lm.num_layers, d_out, code_bits=bits).transfer(pair, ctx)
        # payload: the T/Q/C stream of every layer's code (bits per coefficient + per-group metadata + header)
        assert bits * d_out * 40 * tiny_lm.num_layers / 8 < got.payload_bytes < bf16.payload_bytes
        errors[bits] = max(relative_error(k2.reshape(-1, k.shape[-1]), k.reshape(-1, k.shape[-1]))
                           for (k, _), (k2, _) in zip(exact.kv, got.kv))
    # squared relative error; 4 fewer bits = 16x the step, ~256x the squared error (measured 2e-5 vs 5.4e-3)
    assert errors[8] < 1e-4 and 100 * errors[8] < errors[4] < 0.02
    with pytest.raises(ConfigError, match="code bits"):
        SCD.uniform(tiny_lm.num_layers, 8, code_bits=5).transfer(pair, ctx)
    with pytest.raises(ConfigError, match="code bits"):
        code_policy(16)
    # the 16-bit configuration keeps the id it had before code_bits existed
    assert "code_bits" not in json.loads(SCD.uniform(2, 8).config_json())
    assert json.loads(SCD.uniform(2, 8, code_bits=4).config_json())["code_bits"] == 4
    assert "4-bit codes" in SCD.uniform(2, 8, code_bits=4).label()


def test_scd_grid_is_searched_by_the_shared_optimizers(tiny_lm):
    from kvtune.methods.scd.profile import SCDProfileSettings, scd_methods, scd_space, search_scd, evaluate_method

    consumer = finetuned(tiny_lm, seed=3, scale=0.3)
    windows = _windows(3, 24)
    cal = calibrate(tiny_lm, consumer, windows, ranks=(4, 8), ridge=1e-3)
    pair = Pair(tiny_lm, consumer, cal)
    st = SCDProfileSettings(ranks=(4, 8), patch_counts=(0,), code_bits=(16, 8))
    methods = scd_methods(cal, st)
    assert [(m.ranks[0], m.code_bits) for m in methods] == [(4, 16), (4, 8), (8, 16), (8, 8)]
    space = scd_space(methods)
    assert len(space) == 4 and len({c.policy_id for c in space.candidates}) == 4
    assert space.at_most_as_precise(space.candidates[1], space.candidates[2])  # r4 8-bit <= r8 16-bit
    contexts = [prefix_context(tiny_lm, w[:16]) for w in windows]
    cont = torch.tensor([w[16:] for w in windows])
    _, base_logits = evaluate_method(pair, Recompute(), contexts, cont, None)
    every = search_scd(pair, methods, contexts, cont, base_logits, st)
    assert sorted(r.method.label() for r in every) == sorted(m.label() for m in methods)
    for opt in ("random", "mobo"):
        some = search_scd(pair, methods, contexts, cont, base_logits,
                          SCDProfileSettings(ranks=(4, 8), patch_counts=(0,), code_bits=(16, 8), optimizer=opt, budget=2))
        assert len(some) == 2 and some[0].method != some[1].method


@pytest.mark.parametrize("change, match", [({"optimizer": "simplex"}, "unknown optimizer"),
                                           ({"code_bits": (16, 5)}, "code bits"), ({"budget": -1}, "budget")])
def test_scd_profile_rejects_bad_settings_before_loading_models(change, match):
    from kvtune.methods.scd.profile import SCDProfileSettings, run_scd_profile

    with pytest.raises(ConfigError, match=match):  # model names that do not exist: never loaded
        run_scd_profile("no-such-model", "no-such-model", "/nonexistent/out", settings=SCDProfileSettings(**change))


def test_patch_of_identical_models_is_exact_and_droidspeak_full_block_is_recompute(tiny_lm):
    windows = _windows(3, 40, seed=5)
    cal = calibrate(tiny_lm, tiny_lm, windows, ranks=(8,), ridge=0.0)
    pair = Pair(tiny_lm, tiny_lm, cal)
    n = tiny_lm.num_layers
    hidden = tiny_lm.config.hidden_size
    ctx = prefix_context(tiny_lm, windows[0])
    patched = SCD.uniform(n, 2 * tiny_lm.kv_heads * tiny_lm.head_dim, tuple(range(n)), patch_rank=hidden,
                          code_dtype="float32").transfer(pair, ctx)
    block = DroidSpeak(start=0, length=n, wire_dtype="float32").transfer(pair, ctx)
    for (k, v), (kp, vp), (kd, vd) in zip(ctx.producer.kv, patched.kv, block.kv):
        torch.testing.assert_close(kp, k, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(kd, k, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(vd, v, atol=1e-4, rtol=1e-4)
    assert patched.payload_bytes == 4 * hidden * 40 * n
    assert block.payload_bytes == 4 * hidden * 40


def test_methods_payloads_and_registry(tiny_lm):
    consumer = finetuned(tiny_lm, seed=1)
    ids = _windows(1, 32, seed=2)[0]
    pair = Pair(tiny_lm, consumer)
    ctx = prefix_context(tiny_lm, ids)
    kv_bytes = sum(2 * (k.numel() + v.numel()) for k, v in ctx.producer.kv)
    rec = Recompute().transfer(pair, ctx)
    assert rec.payload_bytes == 4 * 32 and rec.consumer_seconds > 0
    for (k, _), (k2, _) in zip(capture_states(consumer, ids).kv, rec.kv):
        torch.testing.assert_close(k2, k)
    assert Raw().transfer(pair, ctx).payload_bytes == kv_bytes
    ds = DroidSpeak(start=1, length=1).transfer(pair, ctx)
    per_layer = kv_bytes // tiny_lm.num_layers
    assert ds.payload_bytes == kv_bytes - per_layer + 2 * 32 * tiny_lm.config.hidden_size
    with pytest.raises(ConfigError):
        DroidSpeak(start=1, length=5).transfer(pair, ctx)
    with pytest.raises(ConfigError):
        SCD.uniform(tiny_lm.num_layers, 4).transfer(pair, ctx)  # no calibration
    assert set(METHODS) == {"recompute", "raw", "raw+tqc", "droidspeak", "scd"}
    assert json.loads(SCD.uniform(2, 8, (1,)).config_json())["patch_layers"] == [1]
    assert ttft_seconds(0.1, 0.2, 1.25e9, 10.0) == pytest.approx(1.3)


def test_architecture_mismatch_is_a_typed_error(tiny_lm, tmp_path):
    from tests.conftest import make_tiny_llama

    other = load_model(str(make_tiny_llama(tmp_path / "m", layers=3)), "cpu")
    with pytest.raises(ModelLayoutError):
        check_same_architecture(tiny_lm, other)


def test_tiny_gemma_is_rejected(tiny_gemma_dir):
    lm = load_model(str(tiny_gemma_dir), "cpu")
    with pytest.raises(ModelLayoutError):
        capture_states(lm, [2, 3, 4])


def test_run_scd_profile_end_to_end_on_tiny_pair(tiny_lm, tmp_path):
    from kvtune.methods.scd.profile import run_scd_profile

    consumer, st = scd_pair_settings(tiny_lm, tmp_path)
    res = run_scd_profile(tiny_lm, consumer, tmp_path / "run", settings=st)
    methods = set(res.trials["method"])
    assert methods == {"recompute", "raw", "raw+tqc", "droidspeak", "scd"}
    rec = res.trials[res.trials["method"] == "recompute"].iloc[0]
    assert rec["relative_accuracy_raw"] == pytest.approx(1.0)
    assert (res.trials["relative_accuracy_lo"] <= res.trials["relative_accuracy_raw"] + 1e-12).all()
    for name in ("trials.parquet", "policy_table.parquet", "policy_table.json", "scd_maps.pt",
                 "scd_calibration.json", "run.json", "summary.md", "pareto.parquet"):
        assert (tmp_path / "run" / name).is_file()
    assert not list((tmp_path / "run").glob("scd_*.parquet")) and not (tmp_path / "run" / "scd_run.json").exists()
    assert res.info["calibration_artifact_bytes"]["total"] > 0
    table = PolicyTable.load(tmp_path / "run" / "policy_table.parquet")
    assert "none" not in set(table.frame["policy_id"]) if hasattr(table, "frame") else True
    sel = table.select(1000.0, 0.99)
    assert sel.method in methods


# ------------------------------------------------------------------------------ mixed-method tables


def _mixed_front() -> pd.DataFrame:
    """Hand-made SCD-style front (per volume V = 1 GB): recompute (slow, exact, token ids only),
    raw (free, 90 %), kivi-4 over raw (92 %), droidspeak (96 %), scd (97.5 %, 12x)."""
    inf = math.inf
    rows = [
        # policy_id, method, accuracy, ratio, encode GB/s, decode GB/s
        ("rec000000000", "recompute", 1.0, 5760.0, inf, 2.0),   # a = 0.5 s/GB
        ("raw000000000", "raw", 0.90, 1.0, inf, inf),           # a = 0, b = 1
        ("tqc000000000", "raw+tqc", 0.92, 3.5, 20.0, 20.0),      # a = 0.1, b = 0.286
        ("ds0000000000", "droidspeak", 0.96, 1.1, inf, 10.0),    # a = 0.1, b = 0.909
        ("scd000000000", "scd", 0.975, 12.0, 10.0, 10.0),        # a = 0.2, b = 0.083
    ]
    return pd.DataFrame([
        {"policy_id": p, "method": m, "label": m, "config_json": json.dumps({"method": m}),
         "relative_accuracy": acc, "compression_ratio": cr, "encode_gbps": e, "decode_gbps": d}
        for p, m, acc, cr, e, d in rows
    ])


@pytest.mark.parametrize("fmt", ["parquet", "json"])
def test_mixed_method_table_loads_and_selects(tmp_path, fmt):
    table = compile_policy_table(_mixed_front(), floors=(0.99, 0.97, 0.95, 0.90), model="A -> B",
                                 workload="continuation:xsum", device="cpu", include_none=False,
                                 metadata={"kv_bytes_per_request": 1e9})
    path = tmp_path / f"t.{fmt}"
    (table.to_parquet if fmt == "parquet" else table.to_json)(path)
    loaded = PolicyTable.load(path)
    # floor 0.99: only recompute qualifies, at every bandwidth
    for gbps in (0.1, 10.0, 1e4):
        assert loaded.select(gbps, 0.99).method == "recompute"
    # floor 0.97: scd (a=0.2 + 0.083 x) vs recompute (a=0.5 + 0.0002 x): scd until x ~ 3.6 s/GB
    assert loaded.select(100.0, 0.97).method == "scd"   # x = 0.08
    assert loaded.select(1.0, 0.97).method == "recompute"  # x = 8
    # floor 0.90: raw (free) at high bandwidth, tqc in the middle, scd at low bandwidth
    assert loaded.select(1e4, 0.90).method == "raw"
    assert loaded.select(8.0 / 0.3, 0.90).method == "raw+tqc"  # x = 0.3: raw 0.3, tqc 0.186, scd 0.225
    assert loaded.select(8.0 / 2.0, 0.90).method == "scd"   # x = 2: scd 0.367, tqc 0.671, recompute 0.5003
    assert "none" not in {loaded.select(b, q).policy_id for b in (0.1, 1.0, 10.0, 1e4) for q in (0.9, 0.99)}
    t = loaded.select(1.0, 0.99, kv_bytes=2e9)
    assert t.predicted_seconds == pytest.approx((0.5 + 8.0 / 5760.0) * 2.0)


def test_table_without_none_needs_a_candidate_per_floor():
    front = _mixed_front()
    front = front[front["method"] != "recompute"]
    with pytest.raises(TableError):
        compile_policy_table(front, floors=(0.99,), model="m", workload="w", device="cpu", include_none=False)
    # the default keeps the implicit uncompressed policy, as before
    t = compile_policy_table(front, floors=(0.99,), model="m", workload="w", device="cpu")
    assert t.select(1e4, 0.99).policy_id == "none"


# ------------------------------------------------------------------------------ consumer recipe


def test_consumer_recipe_digest_split_and_schedule(tmp_path):
    a, b = ConsumerRecipe(), ConsumerRecipe(steps=61)
    assert a.digest() == ConsumerRecipe().digest() and a.digest() != b.digest()
    assert consumer_dir(a, tmp_path).name.endswith(a.digest()[:16])
    assert consumer_dir(a, tmp_path) != consumer_dir(b, tmp_path)
    held = [is_held_out(i, 0.2) for i in range(1, 2001)]
    assert 0.15 < sum(held) / len(held) < 0.25
    assert held == [is_held_out(i, 0.2) for i in range(1, 2001)]
    assert lr_at(0, 100, 1.0) == pytest.approx(0.1)
    assert lr_at(10, 100, 1.0) == pytest.approx(1.0)
    assert lr_at(99, 100, 1.0) == pytest.approx(0.1, abs=0.01)
    with pytest.raises(ConfigError):
        ConsumerRecipe(holdout_fraction=1.5)
    with pytest.raises(ConfigError):
        ConsumerRecipe(steps=0)


def test_token_windows(tiny_lm):
    w = token_windows(tiny_lm.tokenizer, ["w1 w2 w3", "w4 w5"], 3, 10)
    assert w.shape == (2, 3)  # 3 + 1 EOS + 2 + 1 EOS = 7 tokens -> two windows of 3


def test_make_consumer_on_tiny_model(tiny_model_dir, tmp_path):
    pytest.importorskip("peft")
    from kvtune.methods.scd.consumer import make_consumer

    rng = np.random.default_rng(1)
    data = tmp_path / "docs.jsonl"
    data.write_text("\n".join(json.dumps({"document": " ".join(f"w{i}" for i in rng.integers(0, 20, 80))})
                              for _ in range(40)))
    recipe = ConsumerRecipe(producer=str(tiny_model_dir), data=str(data), steps=8, batch_size=2, seq_tokens=16,
                            lora_rank=4, lora_alpha=8.0, learning_rate=1e-2, first_layer=0)
    info = make_consumer(recipe, root=tmp_path / "consumers", heldout_windows=4)
    assert not info.cached and info.path.is_dir() and (info.path / "config.json").is_file()
    assert info.consumer_ppl < info.producer_ppl  # a skewed word distribution is learnable
    again = make_consumer(recipe, root=tmp_path / "consumers")
    assert again.cached and again.consumer_ppl == info.consumer_ppl
    consumer = load_model(str(info.path), "cpu")
    check_same_architecture(load_model(str(tiny_model_dir), "cpu"), consumer)


def test_scd_cli_help_and_typed_errors(tmp_path):
    from typer.testing import CliRunner

    from kvtune.cli import app as main_app
    from kvtune.methods.scd.cli import app

    runner = CliRunner()
    res = runner.invoke(app, ["--help"])
    assert res.exit_code == 0 and "make-consumer" in res.output
    scd = ["profile", "--method", "scd", "--out", str(tmp_path / "p")]  # the SCD profile is kvtune profile --method scd
    res = runner.invoke(main_app, [*scd, "--set", f"consumer={tmp_path}", "--set", "ranks=a,b"])
    assert res.exit_code == 2 and "--set ranks=a,b" in res.output
    res = runner.invoke(main_app, [*scd, "--set", f"consumer={tmp_path / 'missing'}", "--model", str(tmp_path / "nope")])
    assert res.exit_code == 2 and "error" in res.output and not (tmp_path / "p").exists()


def test_scd_artifact_bytes_count_the_truncated_maps(tiny_lm):
    cal = calibrate(tiny_lm, finetuned(tiny_lm, seed=2), _windows(2, 40), ranks=(8,))
    pair = Pair(tiny_lm, tiny_lm, cal)
    hidden, d_out, n = tiny_lm.config.hidden_size, 2 * tiny_lm.kv_heads * tiny_lm.head_dim, tiny_lm.num_layers
    reuse = 4 * (hidden + hidden * 8 + 8 * d_out + d_out)
    patch = 4 * (hidden + hidden * 8 + 8 * hidden + hidden)
    assert SCD.uniform(n, 8).artifact_bytes(pair) == n * reuse
    assert SCD.uniform(n, 8, (1,)).artifact_bytes(pair) == (n - 1) * reuse + patch
    assert Raw().artifact_bytes(pair) == 0


class _Killed(Exception):
    """Stands in for kill -9 in the middle of a run."""


def test_scd_run_resumes_after_a_kill_and_its_folder_answers_select_export_report(tiny_lm, tmp_path):
    from typer.testing import CliRunner

    from kvtune.cli import app
    from kvtune.methods.scd.profile import SCDProfileSettings, run_scd_profile

    consumer, st = scd_pair_settings(tiny_lm, tmp_path, optimizer="random", budget=3)
    assert SCDProfileSettings.from_dict(json.loads(json.dumps(st.to_dict()))) == st
    run = tmp_path / "profiles" / "scd-tiny"
    seen = []

    def kill_after_four(row):
        seen.append(row["policy_id"])
        if len(seen) == 4:  # recompute, raw, kivi-4, droidspeak stored; the SCD search not begun
            raise _Killed

    with pytest.raises(_Killed):
        run_scd_profile(tiny_lm, consumer, run, settings=st, on_trial=kill_after_four)
    stored = [json.loads(line)["policy_id"] for line in (run / "trials.jsonl").read_text().splitlines()]
    assert stored == seen and json.loads((run / "run.json").read_text())["method"] == "scd"
    with pytest.raises(KvtuneError, match="already has trials"):
        run_scd_profile(tiny_lm, consumer, run, settings=st)
    res = run_scd_profile(tiny_lm, consumer, run, settings=st, resume=True, reports=tmp_path / "reports",
                          on_trial=lambda row: seen.append(row["policy_id"]))
    ids = res.trials["policy_id"].tolist()
    assert ids[:4] == stored and len(ids) == 4 + 3 and len(set(ids)) == len(ids) and ids == seen
    assert res.trials["trial"].tolist() == list(range(7))
    assert set(res.trials["method"]) == {"recompute", "raw", "raw+tqc", "droidspeak", "scd"}
    assert (tmp_path / "reports" / "scd-tiny.html").read_text().count("plotly") > 0
    cli = CliRunner()
    sel = cli.invoke(app, ["select", str(run), "--bandwidth", "10Gbps", "--q-min", "0.9", "--json"])
    assert sel.exit_code == 0, sel.output
    assert json.loads(sel.output)["method"] in {"recompute", "raw", "raw+tqc", "droidspeak", "scd"}
    out = tmp_path / "scd.json"
    exp = cli.invoke(app, ["export", str(run), "--format", "json", "--out", str(out), "--recompile"])
    assert exp.exit_code == 0, exp.output
    pd.testing.assert_frame_equal(PolicyTable.load(out).frame, res.table.frame)
    rep = cli.invoke(app, ["report", str(run)])
    assert rep.exit_code == 0 and "report" in rep.output, rep.output
    pd.testing.assert_frame_equal(PolicyTable.load(run / "policy_table.parquet").frame, res.table.frame)


@pytest.mark.parametrize("version, scd_at_97", [(2, False), (1, True)])
def test_scd_table_gates_floors_on_the_interval_lower_end(version, scd_at_97):
    """SCD rows carry a paired-bootstrap interval: a configuration whose point estimate meets a
    floor but whose interval's lower end does not is kept out (settings version 2); version-1
    runs recompile on the point estimate, as they were written."""
    from kvtune.methods.scd.profile import compile_scd_table

    front = _mixed_front()
    front["relative_accuracy_lo"] = front["relative_accuracy"] - 0.001
    front.loc[front["method"] == "scd", "relative_accuracy_lo"] = 0.96  # point 0.975, lower end below 0.97
    run = {"settings": {"version": version, "floors": [0.97], "data": "xsum"}, "kv_bytes_per_request": 1e9,
           "producer": {"model": "A"}, "consumer": {"model": "B", "device": "cpu"}}
    ids = set(compile_scd_table(front, run).frame["policy_id"])
    assert ("scd000000000" in ids) is scd_at_97
    assert "rec000000000" in ids


def test_report_plot_data_families_and_fastest_ttft_per_floor():
    from kvtune.methods.scd.report import family_ttft, quality_points, transfer_family

    trials = pd.DataFrame({
        "method": ["recompute", "raw", "scd", "scd", "scd"],
        "label": ["recompute", "raw", "scd r=8", "scd r=64", "scd r=8, 4-bit codes"],
        "config_json": [json.dumps({"method": "recompute"}), json.dumps({"method": "raw"}),
                        json.dumps({"method": "scd", "ranks": [8, 8]}), json.dumps({"method": "scd", "ranks": [64, 64]}),
                        json.dumps({"method": "scd", "ranks": [8, 8], "code_bits": 4})],
        "payload_bytes": [0.0, 1e6, 1e5, 4e5, 3e4], "compression_ratio": [math.inf, 1.0, 10.0, 2.5, 33.0],
        "relative_accuracy": [1.0, 1.0, 0.96, 0.995, 0.93], "relative_accuracy_lo": [1.0, 1.0, 0.95, 0.99, 0.92],
        "latency_a_s": [0.05, 0.001, 0.004, 0.004, 0.005],
    })
    assert list(transfer_family(trials)) == ["recompute", "raw", "scd bf16 codes", "scd bf16 codes", "scd 4-bit codes"]
    pts = quality_points(trials)
    assert list(pts[pts["family"] == "scd bf16 codes"]["rank"]) == [8, 64]  # by payload
    assert pts.set_index("label").loc["scd r=8, 4-bit codes", "code_bits"] == 4
    curves = family_ttft(trials, (0.99, 0.95), "relative_accuracy_lo", bandwidth_range_gbps=(1.0, 100.0), points=3)
    at = curves.set_index(["floor", "family", "bandwidth_gbps"])
    # floor 0.99: only r=64 qualifies among bf16 codes: 4 ms + 4e5 B * 8 / 1 Gbps = 7.2 ms
    assert at.loc[(0.99, "scd bf16 codes", 1.0), "ttft_ms"] == pytest.approx(7.2)
    # floor 0.95: r=8 too; 4 ms + 0.8 ms at 1 Gbps; the 4-bit family (lo 0.92) has no curve
    assert at.loc[(0.95, "scd bf16 codes", 1.0), "label"] == "scd r=8"
    assert at.loc[(0.95, "scd bf16 codes", 1.0), "ttft_ms"] == pytest.approx(4.8)
    assert "scd 4-bit codes" not in set(curves["family"])
    assert at.loc[(0.99, "recompute", 100.0), "ttft_ms"] == pytest.approx(50.0)
