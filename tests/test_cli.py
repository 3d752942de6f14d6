"""End-to-end CLI runs on a tiny random Llama (fast, offline): every output is written."""

from __future__ import annotations

import json

import pandas as pd
from typer.testing import CliRunner

from kvtune.cli import app

runner = CliRunner()


def _profile(tmp_path, tiny_model_dir, tiny_text, *extra):
    args = ["profile", "--model", str(tiny_model_dir), "--text", str(tiny_text), "--contexts", "3",
            "--context-tokens", "48", "--continuation-tokens", "8", "--budget", "6", "--device", "cpu",
            "--out", str(tmp_path / "profiles"), "--reports", str(tmp_path / "reports"), "--run", "tiny", *extra]
    return runner.invoke(app, args)


def test_profile_writes_all_outputs(tmp_path, tiny_model_dir, tiny_text):
    res = _profile(tmp_path, tiny_model_dir, tiny_text)
    assert res.exit_code == 0, res.output
    run = tmp_path / "profiles" / "tiny"
    trials = pd.read_parquet(run / "trials.parquet")
    assert len(trials) == 6 and trials["policy_id"].is_unique
    assert {"compression_ratio", "relative_accuracy", "encode_gbps", "decode_gbps", "kl_mean", "config_json"} <= set(trials)
    assert (trials["compression_ratio"] > 1.5).all()
    pareto = pd.read_parquet(run / "pareto.parquet")
    assert 1 <= len(pareto) <= 6 and set(pareto["policy_id"]) <= set(trials["policy_id"])
    assert len(pd.read_parquet(run / "policy_table.parquet")) >= 1
    assert json.loads((run / "policy_table.json").read_text())
    settings = json.loads((run / "run.json").read_text())["settings"]
    assert settings["budget"] == 6 and settings["context_tokens"] == 48
    html = (tmp_path / "reports" / "tiny.html").read_text()
    assert "plotly" in html.lower()
    assert "Pareto front" in res.output


def test_cheap_search_then_full_refinement_of_the_pareto_set(tmp_path, tiny_model_dir, tiny_text):
    res = _profile(tmp_path, tiny_model_dir, tiny_text, "--cheap-samples", "2")
    assert res.exit_code == 0, res.output
    run = tmp_path / "profiles" / "tiny"
    trials = pd.read_parquet(run / "trials.parquet")
    cheap, full = trials[trials["fidelity"] == "cheap"], trials[trials["fidelity"] == "full"]
    assert len(cheap) == 6 and (cheap["samples"] == 2).all() and (cheap["stage"] == "search").all()
    assert len(full) >= 1 and (full["samples"] == 3).all() and (full["stage"] == "refine").all()
    pareto = pd.read_parquet(run / "pareto.parquet")
    assert set(pareto["policy_id"]) <= set(full["policy_id"]) <= set(cheap["policy_id"])
    assert (pareto["fidelity"] == "full").all()
    info = json.loads((run / "run.json").read_text())["fidelity"]
    assert info["search"] == "cheap" and info["final"] == "full" and info["refined"] == len(full)
    assert "Spearman rank correlation" in (tmp_path / "reports" / "tiny.html").read_text()
    # resuming a finished run evaluates nothing again
    assert runner.invoke(app, ["profile", "--resume", str(run)]).exit_code == 0
    assert len(pd.read_parquet(run / "trials.parquet")) == len(trials)


def test_resume_continues_without_repeating(tmp_path, tiny_model_dir, tiny_text):
    assert _profile(tmp_path, tiny_model_dir, tiny_text).exit_code == 0
    run = tmp_path / "profiles" / "tiny"
    first = pd.read_parquet(run / "trials.parquet")["policy_id"].tolist()
    settings = json.loads((run / "run.json").read_text())
    settings["settings"]["budget"] = 9
    (run / "run.json").write_text(json.dumps(settings))
    res = runner.invoke(app, ["profile", "--resume", str(run)])
    assert res.exit_code == 0, res.output
    ids = pd.read_parquet(run / "trials.parquet")["policy_id"].tolist()
    assert ids[:6] == first and len(ids) == 9 and len(set(ids)) == 9


def test_existing_run_without_resume_is_refused(tmp_path, tiny_model_dir, tiny_text):
    assert _profile(tmp_path, tiny_model_dir, tiny_text).exit_code == 0
    res = _profile(tmp_path, tiny_model_dir, tiny_text)
    assert res.exit_code == 2 and "already has trials" in res.output


def test_bad_inputs_are_one_line_errors(tmp_path, tiny_model_dir, tiny_text):
    res = _profile(tmp_path, tiny_model_dir, tiny_text, "--space", "nope")
    assert res.exit_code == 2 and "no space of that name" in res.output
    res = runner.invoke(app, ["profile", "--model", str(tmp_path / "missing.gguf"), "--run", "x", "--out", str(tmp_path)])
    assert res.exit_code == 2 and "GGUF file not found" in res.output
    res = _profile(tmp_path, tiny_model_dir, tiny_text, "--context-tokens", "100000")
    assert res.exit_code == 2 and "fewer than 3 contexts" in res.output


def test_unknown_method_lists_the_known_ones():
    res = runner.invoke(app, ["profile", "--method", "nope"])
    assert res.exit_code == 2 and "unknown --method 'nope'" in res.output and "bicache" in res.output


def test_method_subcommands_are_mounted():
    res = runner.invoke(app, ["bicache", "profile", "--help"])
    assert res.exit_code == 0 and "--run" in res.output


def test_unknown_workload_fails_before_loading_the_model(tmp_path):
    # the model path does not exist: reaching the model loader would give a different error
    res = runner.invoke(app, ["profile", "--workload", "bogus", "--model", str(tmp_path / "missing.gguf"),
                              "--run", "x", "--out", str(tmp_path)])
    assert res.exit_code == 2 and "unknown workload 'bogus'" in res.output and "continuation" in res.output


def test_error_messages_keep_bracketed_values(tmp_path):
    res = runner.invoke(app, ["export", "tests/data/smollm2-default", "--floors", "nan", "--out", str(tmp_path / "t.json"),
                              "--format", "json"])
    assert res.exit_code == 2 and "got [nan]" in res.output
