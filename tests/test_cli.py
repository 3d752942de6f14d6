"""End-to-end CLI runs on a tiny random Llama (fast, offline): every output is written."""

from __future__ import annotations

import json

import pandas as pd
import pytest
from typer.testing import CliRunner

from kvtune.cli import app
from kvtune.tables.policy_table import PolicyTable

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
    assert "best ratio whose 95 % interval clears: 99 % " in res.output  # the floors the README quotes
    # the run folder and how to resume it are printed before the model loads, not only at the end
    before_load = res.output.index("load model")
    assert res.output.index(f"continue with: kvtune profile --resume {run}") < before_load


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
    res = runner.invoke(app, ["scd", "make-consumer", "--help"])
    assert res.exit_code == 0 and "--producer" in res.output
    for method in ("scd", "bicache"):  # their profiles are `kvtune profile --method X --set ...`
        assert runner.invoke(app, [method, "profile", "--help"]).exit_code == 2


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
    from kvtune.methods.tqc.settings import ProfileSettings

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


def _missing_model_run(tmp_path, run_name="x"):
    """A run folder whose settings name a missing model: reaching the model loader fails fast."""
    from kvtune.methods.tqc.settings import ProfileSettings

    run = tmp_path / "profiles" / run_name
    run.mkdir(parents=True)
    settings = ProfileSettings(model=str(tmp_path / "missing.gguf"), out=str(run.parent), run=run_name,
                               reports=str(tmp_path / "reports")).to_dict()
    (run / "run.json").write_text(json.dumps({"settings": settings}))
    return run


def test_resume_of_a_locked_run_folder_is_a_typed_error_naming_folder_and_pid(tmp_path):
    import fcntl
    import os

    run = _missing_model_run(tmp_path)
    with open(run / ".kvtune.lock", "w") as fh:  # another process's lock (flock: per open file)
        fh.write("4242\n")
        fh.flush()
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        res = runner.invoke(app, ["profile", "--resume", str(run)])
        out = " ".join(res.output.split())
        assert res.exit_code == 2 and f"run folder {run} is in use" in out and "pid 4242" in out, out
        res = runner.invoke(app, ["report", str(run)])
        assert res.exit_code == 2 and "pid 4242" in " ".join(res.output.split())
    assert os.path.exists(run / ".kvtune.lock")


@pytest.mark.parametrize("name", ["../../x", "a/b", "..", "a\\b", "\u00e9" * 120, ""])
def test_run_name_must_be_one_path_component(tmp_path, name):
    """A given --run is checked before anything else; an empty one too (leaving --run out is
    how to get the default name)."""
    res = runner.invoke(app, ["profile", "--model", str(tmp_path / "missing.gguf"), "--run", name,
                              "--out", str(tmp_path / "a" / "b")])
    out = " ".join(res.output.split())
    assert res.exit_code == 2 and f"--run {name!r}: a run name must be a single folder name" in out, out
    assert [p.name for p in tmp_path.iterdir()] == []


def test_out_naming_a_file_fails_before_loading_the_model(tmp_path):
    (tmp_path / "f").write_text("x")
    res = runner.invoke(app, ["profile", "--model", str(tmp_path / "missing.gguf"), "--run", "x",
                              "--out", str(tmp_path / "f")])
    out = " ".join(res.output.split())
    assert res.exit_code == 2 and f"--out {tmp_path / 'f'}: {tmp_path / 'f'} is a file, not a folder" in out, out


@pytest.mark.parametrize(("option", "value", "message"), [
    ("--text", "no-such-text", "--text 'no-such-text' is neither a named text asset"),
    ("--context-tokens", "100000", "--context-tokens 100000"),
])
def test_text_and_context_tokens_are_checked_before_the_model_loads(tmp_path, tiny_text, option, value, message):
    args = ["profile", "--model", str(tmp_path / "missing.gguf"), "--run", "x", "--out", str(tmp_path / "p"),
            "--text", str(tiny_text), "--contexts", "3", option, value]
    res = runner.invoke(app, args)
    out = " ".join(res.output.split())
    assert res.exit_code == 2 and message in out and "GGUF" not in out, out


def test_data_is_checked_before_the_model_loads(tmp_path):
    res = runner.invoke(app, ["profile", "--model", str(tmp_path / "missing.gguf"), "--run", "x", "--workload", "qa",
                              "--data", str(tmp_path / "none.jsonl"), "--out", str(tmp_path / "p")])
    out = " ".join(res.output.split())
    assert res.exit_code == 2 and "none.jsonl" in out and "GGUF" not in out, out


def test_report_never_replaces_stored_trials_with_fewer(tmp_path):
    run, recs = _run_folder(tmp_path)
    assert runner.invoke(app, ["report", str(run)]).exit_code == 0
    _rewrite_trials(run, recs[:2])  # the log was cut
    res = runner.invoke(app, ["report", str(run)])
    out = " ".join(res.output.split())
    assert res.exit_code == 2 and f"{run / 'trials.jsonl'}" in out and "4" in out and "2" in out, out
    assert len(pd.read_parquet(run / "trials.parquet")) == 4


def test_report_of_an_older_run_folder_counts_its_trials_too(tmp_path):
    """A run.json without ``trial_records`` (folders written before it) still guards the stored
    outputs: a cut log with no trials.parquet to compare is refused by run.json's ``trials``."""
    import json

    run, recs = _run_folder(tmp_path)
    assert runner.invoke(app, ["report", str(run)]).exit_code == 0
    info = json.loads((run / "run.json").read_text())
    assert info["trials"] == 4
    del info["trial_records"]
    (run / "run.json").write_text(json.dumps(info))
    (run / "trials.parquet").unlink()
    _rewrite_trials(run, recs[:2])
    before = {p.name: p.read_bytes() for p in run.iterdir() if p.suffix in (".parquet", ".json")}
    res = runner.invoke(app, ["report", str(run)])
    out = " ".join(res.output.split())
    assert res.exit_code == 2 and "counted 4 trials" in out and "nothing was rewritten" in out, out
    assert {p.name: p.read_bytes() for p in run.iterdir() if p.suffix in (".parquet", ".json")} == before


def test_report_validates_before_writing_anything(tmp_path):
    run, recs = _run_folder(tmp_path)
    assert runner.invoke(app, ["report", str(run)]).exit_code == 0
    before = {p.name: p.read_bytes() for p in run.iterdir() if p.suffix in (".parquet", ".json")}
    recs.append({**recs[0], "trial": 4, "policy_id": "p4", "encode_gbps": 0.0})
    _rewrite_trials(run, recs)
    res = runner.invoke(app, ["report", str(run)])
    out = " ".join(res.output.split())
    assert res.exit_code == 2 and f"{run / 'trials.jsonl'}" in out and "encode_gbps" in out, out
    assert {p.name: p.read_bytes() for p in run.iterdir() if p.suffix in (".parquet", ".json")} == before


def test_report_removes_stale_temp_files_of_a_killed_run(tmp_path):
    run, _ = _run_folder(tmp_path)
    (run / ".trials.parquet.ab12cd34.tmp").write_bytes(b"")
    assert runner.invoke(app, ["report", str(run)]).exit_code == 0
    assert not list(run.glob("*.tmp")) and not list(run.glob(".*.tmp"))


def test_export_out_naming_a_folder_writes_inside_it(tmp_path):
    run, _ = _run_folder(tmp_path)
    assert runner.invoke(app, ["report", str(run)]).exit_code == 0
    dest = tmp_path / "exports.json"
    dest.mkdir()
    res = runner.invoke(app, ["export", str(run), "--format", "json", "--out", str(dest)])
    assert res.exit_code == 0, res.output
    assert PolicyTable.load(dest / "run.policy_table.json").metadata["extra"]["run"] == "run"


def _gate_run_folder(tmp_path):
    """Run folder whose p1 meets a 0.97 floor by its point estimate (0.98) but not its lower end (0.965)."""
    run, recs = _run_folder(tmp_path)
    for r in recs:
        r["relative_accuracy_lo"] = r["relative_accuracy"] - 0.015
    _rewrite_trials(run, recs)
    assert runner.invoke(app, ["report", str(run)]).exit_code == 0
    (run / "policy_table.parquet").unlink()
    return run


def test_export_recompile_gates_floors_on_the_interval_lower_end(tmp_path):
    run = _gate_run_folder(tmp_path)
    for extra in (["--floors", "0.97"], ["--recompile"]):
        dest = tmp_path / f"t{len(extra)}.json"
        res = runner.invoke(app, ["export", str(run), "--format", "json", "--out", str(dest), *extra])
        assert res.exit_code == 0, res.output
        frame = PolicyTable.load(dest).frame
        at97 = set(frame.loc[(frame["accuracy_floor"] - 0.97).abs() < 1e-9, "policy_id"])
        assert at97 and "p1" not in at97 and at97 <= {"p0", "none"}, frame


def test_select_on_a_run_folder_without_a_table_gates_on_the_interval_lower_end(tmp_path):
    run = _gate_run_folder(tmp_path)
    res = runner.invoke(app, ["select", str(run), "--bandwidth", "1Mbps", "--q-min", "0.97", "--json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.output)["policy_id"] == "p0"


@pytest.mark.parametrize("q", ["-1", "nan", "3"])
def test_select_rejects_a_q_min_that_is_not_a_fraction(q):
    res = runner.invoke(app, ["select", "tests/data/smollm2-default", "--bandwidth", "1Gbps", "--q-min", q])
    out = " ".join(res.output.split())
    assert res.exit_code == 2 and "q_min" in out.replace("-", "_") and "Traceback" not in out, out


class _Killed(Exception):
    """Stands in for kill -9 in the middle of a run."""


def test_run_holds_its_folder_lock_and_resumes_after_a_kill_without_repeating_or_losing_trials(
        tmp_path, tiny_model_dir, tiny_text):
    import fcntl
    import os

    from kvtune.methods.tqc.profile import load_settings, run_profile
    from kvtune.methods.tqc.settings import ProfileSettings

    settings = ProfileSettings(model=str(tiny_model_dir), text=str(tiny_text), contexts=3, context_tokens=48,
                               continuation_tokens=8, budget=6, device="cpu", out=str(tmp_path / "profiles"),
                               reports=str(tmp_path / "reports"), run="tiny", refine=False)
    run = tmp_path / "profiles" / "tiny"
    seen = {"trials": 0, "locked": []}

    def kill_after_three(n=1, info=""):
        if not info:  # not a trial
            return
        fd = os.open(run / ".kvtune.lock", os.O_RDWR)
        try:  # another process (another open file) cannot take the lock while the run works
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            seen["locked"].append(False)
        except BlockingIOError:
            seen["locked"].append(True)
        finally:
            os.close(fd)
        seen["trials"] += 1
        if seen["trials"] == 3:
            raise _Killed

    with pytest.raises(_Killed):
        run_profile(settings, on_progress=kill_after_three)
    assert seen["locked"] == [True, True, True]
    first = pd.read_parquet(run / "trials.parquet")
    assert len(first) == 3
    run_profile(load_settings(run), resume=True)
    trials = pd.read_parquet(run / "trials.parquet")
    assert trials["policy_id"].tolist()[:3] == first["policy_id"].tolist()
    assert len(trials) == 6 and trials["policy_id"].is_unique and trials["trial"].tolist() == list(range(6))


def test_a_run_killed_with_sigkill_resumes_without_repeating_or_losing_trials(tmp_path, tiny_model_dir, tiny_text):
    import os
    import signal
    import subprocess
    import sys
    import time

    run = tmp_path / "profiles" / "tiny"
    args = [sys.executable, "-m", "kvtune.cli", "profile", "--model", str(tiny_model_dir), "--text", str(tiny_text),
            "--contexts", "3", "--context-tokens", "48", "--continuation-tokens", "8", "--budget", "8",
            "--device", "cpu", "--no-refine", "--out", str(tmp_path / "profiles"), "--reports",
            str(tmp_path / "reports"), "--run", "tiny"]
    env = {**os.environ, "PYTHONPATH": os.getcwd(), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(args, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    log = run / "trials.jsonl"
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and proc.poll() is None:
        if log.exists() and len(log.read_bytes().splitlines()) >= 2:
            break
        time.sleep(0.05)
    assert proc.poll() is None, "the run finished before it could be killed"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    before = []
    for line in log.read_bytes().splitlines():
        try:
            before.append(json.loads(line)["policy_id"])
        except ValueError:  # a line the kill cut short: dropped on resume
            pass
    assert len(before) >= 2
    res = runner.invoke(app, ["profile", "--resume", str(run)])  # the kernel released the lock
    assert res.exit_code == 0, res.output
    trials = pd.read_parquet(run / "trials.parquet")
    ids = trials["policy_id"].tolist()
    assert len(ids) == 8 and len(set(ids)) == 8 and ids[:len(before)] == before
    assert trials["trial"].tolist() == list(range(8))
    assert not list(run.glob(".*.tmp"))


@pytest.mark.parametrize("terminal, width", [(False, 60), (True, 60), (True, 100)])
def test_progress_lines_do_not_wrap(monkeypatch, terminal, width):
    """A long trial description stays on one line: whole in a log (any width), cut with an
    ellipsis to a live bar's terminal width (left out where the bar fills the line)."""
    import io
    import re

    from rich.console import Console

    import kvtune.cli as cli

    out = io.StringIO()
    monkeypatch.setattr(cli, "console", Console(file=out, width=width, force_terminal=terminal, color_system=None))
    info = "policy " + "kivi-4 | rans " * 12
    with cli._progress_hooks() as (on_stage, on_progress):
        on_stage("evaluate candidates", 2)
        on_progress(1, info)
    text = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", out.getvalue())
    lines = [line for line in re.split(r"[\r\n]", text) if line.strip()]
    if terminal:
        assert lines and all(len(line) <= width for line in lines)
        assert "evaluate candidates" in lines[-1] and "1/2" in lines[-1]
        assert ("policy kivi-4 | r…" in lines[-1]) == (width == 100)
    else:
        assert [re.sub(r"^\[[0-9:]{8}\] ", "", line) for line in lines] == [
            "evaluate candidates (2)", f"  evaluate candidates 1/2 0s {info}"]


CLIMB_SPACE = """\
version: 2
name: climb
description: one family of uniform K/V widths, for floor climbing
parameters:
  transforms: {type: categorical, values: [identity]}
  kv.name: {type: categorical, values: [uniform]}
  key.bits: {type: ordinal, values: [2, 3, 4, 8], precision: increasing}
  value.bits: {type: ordinal, values: [2, 3, 4, 8], precision: increasing}
"""


def test_floor_climbing_adds_full_fidelity_rows_within_its_budget_and_resume_adds_none(tmp_path, tiny_model_dir,
                                                                                      tiny_text):
    """On the tiny model the refinement leaves the 99 % floor at 2.85x (K2/V4 and K4/V2 bits);
    K2/V2 misses it (lower end 98.98 %), and the climb's one pick, K2/V3, clears it at 3.13x."""
    space = tmp_path / "climb.yaml"
    space.write_text(CLIMB_SPACE)
    args = ("--cheap-samples", "2", "--space", str(space), "--refine-budget", "3")
    res = _profile(tmp_path, tiny_model_dir, tiny_text, *args, "--climb-budget", "2")
    assert res.exit_code == 0, res.output
    run = tmp_path / "profiles" / "tiny"
    trials = pd.read_parquet(run / "trials.parquet")
    refined, climbed = trials[trials["stage"] == "refine"], trials[trials["stage"] == "climb"]
    assert len(refined) == 3 and len(climbed) == 1 and (climbed["fidelity"] == "full").all()
    assert (climbed["samples"] == 3).all() and not set(climbed["policy_id"]) & set(refined["policy_id"])
    row = climbed.iloc[0]
    assert "K:u2a" in row["label"] and "V:u3a" in row["label"] and row["relative_accuracy_lo"] >= 0.99
    assert refined.loc[refined["relative_accuracy_lo"] >= 0.99, "compression_ratio"].max() == pytest.approx(2.854, abs=1e-3)
    assert row["compression_ratio"] == pytest.approx(3.134, abs=1e-3)
    assert "clears: 99 % 3.13x" in res.output
    info = json.loads((run / "run.json").read_text())
    assert "climb" in info["timing_seconds"] and info["fidelity"]["climbed"] == 1 and info["fidelity"]["full"] == 4
    assert "floor climbing evaluated 1 more policy there" in (tmp_path / "reports" / "tiny.html").read_text()
    assert runner.invoke(app, ["profile", "--resume", str(run)]).exit_code == 0  # complete: nothing more
    assert len(pd.read_parquet(run / "trials.parquet")) == len(trials)
    # the summary reads the run's own floors (edited in run.json: the run resumes, nothing to climb)
    info["settings"].update(floors=[0.995, 0.9], climb_budget=0)
    (run / "run.json").write_text(json.dumps(info))
    res = runner.invoke(app, ["profile", "--resume", str(run)])
    assert res.exit_code == 0, res.output
    assert "clears: 99.5 % " in res.output and ", 90 % " in res.output and "97 %" not in res.output
    # without climbing the floor stays at the refinement's 2.85x
    res = _profile(tmp_path / "no-climb", tiny_model_dir, tiny_text, *args, "--climb-budget", "0")
    assert res.exit_code == 0, res.output
    trials = pd.read_parquet(tmp_path / "no-climb" / "profiles" / "tiny" / "trials.parquet")
    assert "climb" not in set(trials["stage"]) and "clears: 99 % 2.85x" in res.output
