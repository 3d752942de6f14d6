"""End-to-end CLI runs on a tiny random Llama (fast, offline): every output is written."""

from __future__ import annotations

import json

import pandas as pd
import pytest
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


@pytest.mark.parametrize(
    ("option", "value", "message"),
    [
        ("--kv-dtype", "float8", "--kv-dtype must be one of model, bfloat16, not 'float8'"),
        ("--device", "tpu", "--device must be auto, cpu or cuda, not 'tpu'"),
        ("--prompt-format", "fancy", "--prompt-format must be one of auto, chat, plain, not 'fancy'"),
    ],
)
def test_bad_kv_dtype_device_prompt_format_fail_before_loading_and_leave_no_folder(tmp_path, option, value, message):
    # the model path does not exist: reaching the model loader would give a different error
    res = runner.invoke(app, ["profile", option, value, "--model", str(tmp_path / "missing.gguf"),
                              "--run", "x", "--out", str(tmp_path / "profiles")])
    assert res.exit_code == 2 and message in " ".join(res.output.split()), res.output
    assert not (tmp_path / "profiles").exists()


def test_run_failing_before_its_first_file_leaves_no_empty_folder(tmp_path):
    res = runner.invoke(app, ["profile", "--model", str(tmp_path / "missing.gguf"), "--run", "x",
                              "--out", str(tmp_path / "profiles")])
    assert res.exit_code == 2 and "GGUF file not found" in res.output
    assert not (tmp_path / "profiles" / "x").exists()


def test_error_messages_keep_bracketed_values(tmp_path):
    res = runner.invoke(app, ["export", "tests/data/smollm2-default", "--floors", "nan", "--out", str(tmp_path / "t.json"),
                              "--format", "json"])
    assert res.exit_code == 2 and "got [nan]" in res.output


def _run_folder(tmp_path):
    """A small finished run folder (no model needed): run.json and four trial records."""
    from kvtune.settings import ProfileSettings

    run = tmp_path / "run"
    run.mkdir()
    settings = ProfileSettings(reports=str(tmp_path / "reports"), out=str(tmp_path), run="run").to_dict()
    (run / "run.json").write_text(json.dumps({"settings": settings}))
    recs = [{"trial": i, "policy_id": f"p{i}", "label": f"policy {i}", "method": "tqc", "config_json": "{}",
             "fidelity": "cheap", "relative_accuracy": 1.0 - 0.02 * i, "relative_accuracy_lo": 0.99 - 0.02 * i,
             "relative_accuracy_hi": 1.0, "compression_ratio": 2.0 + 2 * i, "encode_gbps": 0.5, "decode_gbps": 0.5}
            for i in range(4)]
    (run / "trials.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    return run, recs


def _rewrite_trials(run, recs):
    (run / "trials.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))


def _break_run_json(run, recs, text):
    (run / "run.json").write_bytes(text)


def _break_settings(run, recs):
    doc = json.loads((run / "run.json").read_text())
    doc["settings"]["budget"] = "forty"
    (run / "run.json").write_text(json.dumps(doc))


def _wrong_type(run, recs):
    recs[2]["relative_accuracy"] = "abc"
    _rewrite_trials(run, recs)


def _missing_column(run, recs):
    for r in recs:
        del r["compression_ratio"]
    _rewrite_trials(run, recs)


def _impossible_value(run, recs):
    recs[0]["relative_accuracy"] = 1e9
    _rewrite_trials(run, recs)


@pytest.mark.parametrize(
    ("breaker", "file", "message"),
    [
        (lambda run, recs: (run / "run.json").unlink(), "", "no run.json"),
        (lambda run, recs: _break_run_json(run, recs, b'{"x":'), "run.json", "cannot read run.json"),
        (lambda run, recs: _break_run_json(run, recs, b'{"settings": "caf\xe9"}'), "run.json", "cannot read run.json"),
        (lambda run, recs: _break_run_json(run, recs, b'[1, 2]'), "run.json", "must hold a JSON object"),
        (lambda run, recs: _break_run_json(run, recs, b'{"settings": 5}'), "run.json", "no 'settings' object"),
        (_break_settings, "run.json", "budget = 'forty' is not an integer"),
        (lambda run, recs: (run / "trials.jsonl").write_bytes(b'{"a": 1}\n\xff\xfe\n'), "trials.jsonl:2",
         "not UTF-8 text"),
        (_wrong_type, "trials.jsonl", "record 3 (policy p2): relative_accuracy = 'abc' is not a number"),
        (_missing_column, "trials.jsonl", "lack column(s) ['compression_ratio']"),
        (_impossible_value, "trials.jsonl", "relative_accuracy must be in [0, 2] (policy p0"),
    ],
)
def test_report_on_a_broken_run_folder_is_a_one_line_error(tmp_path, breaker, file, message):
    run, recs = _run_folder(tmp_path)
    breaker(run, recs)
    res = runner.invoke(app, ["report", str(run)])
    out = " ".join(res.output.split())  # rich may wrap long lines
    assert res.exit_code == 2, out
    assert out.startswith("error: ") and f"{run / file}" in out and message in out and "Traceback" not in out


def test_report_rebuilds_a_valid_run_folder(tmp_path):
    run, _ = _run_folder(tmp_path)
    res = runner.invoke(app, ["report", str(run)])
    assert res.exit_code == 0, res.output
    assert (tmp_path / "reports" / "run.html").is_file() and (run / "policy_table.json").is_file()


def test_select_on_a_run_folder_with_a_truncated_parquet_names_the_file(tmp_path):
    run, _ = _run_folder(tmp_path)
    assert runner.invoke(app, ["report", str(run)]).exit_code == 0
    (run / "policy_table.parquet").unlink()
    data = (run / "pareto.parquet").read_bytes()
    (run / "pareto.parquet").write_bytes(data[: len(data) // 2])
    res = runner.invoke(app, ["select", str(run), "--bandwidth", "1Gbps", "--q-min", "0.9"])
    out = " ".join(res.output.split())
    assert res.exit_code == 2 and f"{run / 'pareto.parquet'}: cannot read Parquet" in out, out
