"""Executors (kvtune.run.executors): in-process and Ray give the same trials and run.json keys,
the Ray driver building no context (no model loaded, no prepare: the actors build it and hand
the driver its light view and the files their prepare wrote); a worker killed mid-trial and a
driver killed with kill -9 lose nothing and repeat nothing; bad executor options are typed
errors before any model loads. One local Ray (2 CPUs) for the module."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import ray

from kvtune.core.errors import ConfigError
from kvtune.methods.tqc.method import TQCMethod
from kvtune.methods.tqc.settings import ProfileSettings
from kvtune.run.executors import make_executor
from kvtune.run.executors.base import InProcessExecutor, TrialPool
from kvtune.run.executors.base import ExecutorError
from kvtune.run.executors.ray_executor import (RayExecutor, TrialWorker, keep_files, placement, worker_files,
                                               written_files)
from kvtune.run.method import METHODS
from kvtune.run.runner import run_method
from kvtune.run.store import TrialStore

ROOT = Path(__file__).resolve().parents[1]
#: Columns compared between executors (the timing ones differ from run to run).
QUALITY = ("relative_accuracy_raw", "compression_ratio", "nll")

pytestmark = pytest.mark.usefixtures("one_torch_thread")
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # SlowTQC travels to the actors


@pytest.fixture(scope="module")
def local_ray():
    """A local Ray with 2 CPUs; yields its address (for a driver in another process)."""
    ray.init(num_cpus=2, include_dashboard=False, object_store_memory=150 * 2**20, logging_level="warning")
    yield ray.get_runtime_context().gcs_address
    ray.shutdown()


def tqc_settings(tiny_model_dir: Path, tiny_text: Path, root: Path, run: str, budget: int = 6,
                 **other: object) -> ProfileSettings:
    return ProfileSettings(**{"model": str(tiny_model_dir), "text": str(tiny_text), "contexts": 3, "context_tokens": 48,
                              "continuation_tokens": 8, "budget": budget, "optimizer": "random", "device": "cpu",
                              "out": str(root / "profiles"), "reports": str(root / "reports"), "run": run,
                              "refine": False, **other})


#: The tiny run's settings with MixHQ policies (their head calibration needs contexts over 69 tokens).
MIXHQ = {"space": "presets", "context_tokens": 80}


def driver_builds_nothing(monkeypatch, method_class: type) -> None:
    """From now on, this process (the driver) fails on loading a model or calling the
    method's ``prepare`` (Ray actors, other processes, are not patched)."""
    import kvtune.evaluate.model

    def refuse(*_a, **_k):
        raise AssertionError("the driver built the run's context")

    monkeypatch.setattr(kvtune.evaluate.model, "load_model", refuse)
    monkeypatch.setattr(method_class, "prepare", refuse)


def run_keys(run_dir: Path) -> list[str]:
    return sorted(json.loads((run_dir / "run.json").read_text()))


def tiny_cli_args(tiny_model_dir: Path, tiny_text: Path) -> list[str]:
    """``kvtune profile`` options of the tiny run of :func:`tqc_settings` (without budget and folders)."""
    return ["--model", str(tiny_model_dir), "--text", str(tiny_text), "--contexts", "3", "--context-tokens", "48",
            "--continuation-tokens", "8", "--optimizer", "random", "--no-refine", "--device", "cpu"]


def records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "trials.jsonl").read_text().splitlines() if line.strip()]


def quality(rows: list[dict]) -> dict[str, tuple[float, ...]]:
    return {r["policy_id"]: tuple(float(r[k]) for k in QUALITY) for r in rows}


def assert_recorded_once(rows: list[dict], n: int) -> None:
    assert sorted(r["trial"] for r in rows) == list(range(n))
    assert len({r["policy_id"] for r in rows}) == n


def assert_same_trials(a: list[dict], b: list[dict]) -> None:
    qa, qb = quality(a), quality(b)
    assert sorted(qa) == sorted(qb)
    for pid, values in qa.items():
        assert qb[pid] == pytest.approx(values, rel=1e-5, abs=1e-7), pid


class SlowTQC(TQCMethod):
    """T/Q/C whose trials take ``delay`` seconds and leave one file per evaluation started."""

    def __init__(self, marks: Path, delay: float) -> None:
        self.marks, self.delay = marks, delay

    def evaluate(self, context, candidate, stage):
        (self.marks / f"{candidate.policy_id}.{time.time_ns()}").touch()
        time.sleep(self.delay)
        return super().evaluate(context, candidate, stage)


class PidCalibratedTQC(TQCMethod):
    """T/Q/C whose contexts differ between processes (as if each worker calibrated its own way)."""

    def context_fingerprint(self, context):
        return f"{os.getpid():064d}"


class LastInFirstOut(TrialPool):
    """An overlapping pool of 2 slots finishing the newest candidate first; once, it also
    hands back a candidate already returned (a stale duplicate the loop must drop)."""

    overlaps, slots = True, 2

    def __init__(self) -> None:
        self.stack, self.returned, self.stale_sent = [], [], False

    def submit(self, candidate):
        self.stack.append(candidate)

    def next_finished(self):
        if len(self.returned) == 2 and not self.stale_sent:
            self.stale_sent = True
            return self.returned[0], {"policy_id": self.returned[0].policy_id, "stale": True}
        cand = self.stack.pop()
        self.returned.append(cand)
        return cand, {"policy_id": cand.policy_id}

    def __len__(self):
        return len(self.stack)


def test_ask_tell_tops_up_an_overlapping_pool_with_the_running_as_pending():
    from types import SimpleNamespace

    from kvtune.run.loop import ask_tell, in_order

    cands = [SimpleNamespace(index=i, params={}, policy_id=f"p{i}") for i in range(5)]
    opt = in_order(cands)
    asks, real = [], opt.ask_batch
    opt.ask_batch = lambda q, pending=(): asks.append((q, [c.index for c in pending])) or real(q, pending)
    recorded = []
    n = ask_tell(opt, cands, budget=5, done={}, on_record=recorded.append, pool=LastInFirstOut())
    assert n == 5
    assert asks == [(2, []), (1, [0]), (1, [0]), (1, [0])]  # topped up after each result, within the budget
    assert [r["policy_id"] for r in recorded] == ["p1", "p2", "p3", "p4", "p0"]  # completion order
    assert not any(r.get("stale") for r in recorded) and sorted(opt.told) == [0, 1, 2, 3, 4]


def test_tqc_inprocess_and_ray_record_the_same_trials(local_ray, tiny_model_dir, tiny_text, tmp_path,
                                                       monkeypatch):
    runs = {}
    for name, executor in [("inprocess", InProcessExecutor(2)), ("ray", RayExecutor(2))]:
        # calibrated MixHQ heads; 9 contexts: 3 forward batches, the setup splits in 2 parts on 2 workers
        st = tqc_settings(tiny_model_dir, tiny_text, tmp_path, name, **MIXHQ, contexts=9)
        if name == "ray":
            driver_builds_nothing(monkeypatch, TQCMethod)
        runs[name] = run_method(METHODS["tqc"], st, st.run_dir, executor=executor)
    a, b = records(runs["inprocess"].run_dir), records(runs["ray"].run_dir)
    assert_recorded_once(a, 6)
    assert_recorded_once(b, 6)
    assert_same_trials(a, b)  # same policy ids: the same head scores in the candidates
    info = runs["ray"].info["executor"]
    assert info["name"] == "ray" and info["workers"] == 2
    assert info["worker"] == {"num_cpus": 1.0, "num_gpus": 0, "threads": 1}  # 2 CPUs split between 2 actors
    assert info["setup_parts"] == 2
    for r in b:  # assembled from the parts, each actor's setup is bitwise the in-process one
        assert quality(b)[r["policy_id"]] == quality(a)[r["policy_id"]]
    assert run_keys(runs["ray"].run_dir) == run_keys(runs["inprocess"].run_dir)
    assert sorted(runs["ray"].info["timing_seconds"]) == ["load_and_prefill", "refine", "search"]
    # the actor's calibration.json came back to the run folder, with the scores the driver's space holds
    calibration = {n: json.loads((r.run_dir / "calibration.json").read_text()) for n, r in runs.items()}
    assert calibration["ray"] == calibration["inprocess"]
    view = runs["ray"].context
    assert view.lm is None and view.workload is None
    fingerprint = TQCMethod().context_fingerprint
    assert fingerprint(view) == fingerprint(runs["inprocess"].context) != fingerprint(
        dataclasses.replace(view, space=view.space.with_head_scores(
            [[round(1.0 - v, 4) for v in layer] for layer in calibration["ray"]["head_scores"]["scores"]])))
    assert [c.policy_id for c in view.space.candidates] == [c.policy_id for c in runs["inprocess"].context.space.candidates]


def test_a_worker_reads_the_run_folders_calibration_and_hands_back_only_new_files(tiny_model_dir, tiny_text,
                                                                                   tmp_path):
    """What a resumed Ray run relies on: the run folder's calibration.json (worker_files) is the
    one the worker's context uses, and it is not handed back as a file of the worker's."""
    from kvtune.evaluate.calibrate_codebook import calibrate_codebooks
    from kvtune.search.space import load_space

    st = tqc_settings(tiny_model_dir, tiny_text, tmp_path, "x", **MIXHQ)
    first = TrialWorker(METHODS["tqc"], st, {}, {}, threads=1)
    made = first.handoff()
    # calibrated in its scratch folder: MixHQ head scores, and the PCA basis of the kvtc presets
    assert sorted(made.files) == ["calibration.json", "pca_basis.safetensors"]
    stored = json.loads(made.files["calibration.json"])
    scores = [[round(1.0 - v, 4) for v in layer] for layer in stored["head_scores"]["scores"]]  # other heads
    stored["head_scores"]["scores"] = scores
    given = {"calibration.json": json.dumps(stored).encode(), "pca_basis.safetensors": made.files["pca_basis.safetensors"]}
    second = TrialWorker(METHODS["tqc"], st, given, {}, threads=1)
    handoff = second.handoff()
    assert handoff.files == {}
    expected = load_space("presets").with_head_scores(scores).with_pca_basis(stored["pca_bases"]["pre"]["digest"])
    # kvquant-3c's codebooks: the ones recorded in the first worker's calibration.json, never refitted
    expected = expected.with_codebooks(lambda c: calibrate_codebooks(c, lambda: pytest.fail("refitted"), dict(stored["codebooks"])))
    assert not expected.needs_codebooks and len(stored["codebooks"]) == 2
    assert [c.policy_id for c in handoff.view.space.candidates] == [c.policy_id for c in expected.candidates]
    assert handoff.view.lm is None and handoff.view.workload is None
    for worker in (first, second):
        worker.shutdown()


def test_worker_files_come_back_without_replacing_stored_ones(tmp_path):
    scratch, run_dir = tmp_path / "scratch", tmp_path / "run"
    scratch.mkdir()
    run_dir.mkdir()
    (scratch / "run.json").write_bytes(b"{}")
    (scratch / "calibration.json").write_bytes(b"new")
    (scratch / "maps.pt").write_bytes(b"maps")
    (scratch / "sub").mkdir()
    (run_dir / "basis.safetensors").write_bytes(b"b" * 10)
    (run_dir / "big.json").write_bytes(b"{}" + b" " * 20)
    (run_dir / "notes.txt").write_bytes(b"x")
    assert worker_files(run_dir, limit=16) == {"basis.safetensors": b"b" * 10}  # JSON bounded, others left out
    assert sorted(worker_files(run_dir)) == ["basis.safetensors", "big.json"]
    assert worker_files(run_dir, tensors_limit=9) == {"big.json": b"{}" + b" " * 20}
    for name in ("basis.safetensors", "big.json", "notes.txt"):
        (run_dir / name).unlink()
    files = written_files(scratch, {"run.json": b"{}", "calibration.json": b"old"})
    assert files == {"calibration.json": b"new", "maps.pt": b"maps"}  # run.json unchanged, folders left out
    (run_dir / "calibration.json").write_bytes(b"old")
    assert keep_files(run_dir, files) == (["maps.pt"], ["calibration.json"])
    assert (run_dir / "calibration.json").read_bytes() == b"old" and (run_dir / "maps.pt").read_bytes() == b"maps"
    assert keep_files(run_dir, {"maps.pt": b"maps"}) == ([], [])  # the same bytes: nothing to do
    with pytest.raises(ExecutorError, match="maps.pt: 4 bytes written by the method's prepare, more than the 3"):
        written_files(scratch, {}, limit=3)


def test_scd_inprocess_and_ray_record_the_same_trials(local_ray, tiny_model_dir, tmp_path, monkeypatch):
    from tiny_runs import scd_pair_settings

    from kvtune.evaluate.model import load_model
    from kvtune.methods.scd.profile import SCDMethod

    lm = load_model(str(tiny_model_dir), "cpu")
    consumer, st = scd_pair_settings(lm, tmp_path)
    rows, keys = {}, {}
    for name, executor in [("inprocess", None), ("ray", RayExecutor(2))]:
        if name == "ray":
            driver_builds_nothing(monkeypatch, SCDMethod)
        res = run_method(METHODS["scd"], st, tmp_path / name, executor=executor, producer=lm, consumer=consumer)
        rows[name], keys[name] = records(res.run_dir), run_keys(res.run_dir)
    n = len(rows["inprocess"])
    assert n >= 5  # recompute, raw, raw+tqc, droidspeak and SCD configurations
    assert_recorded_once(rows["ray"], n)
    assert_same_trials(rows["inprocess"], rows["ray"])
    assert keys["ray"] == keys["inprocess"]
    for name in ("scd_maps.pt", "scd_calibration.json"):  # written by an actor's prepare, kept by the driver
        assert (tmp_path / "ray" / name).stat().st_size > 0, name
    assert res.context.pair.producer is None and res.context.pair.calibration is not None


def test_bicache_inprocess_and_ray_record_the_same_buckets(local_ray, tmp_path, monkeypatch):
    from tiny_runs import bicache_settings, make_qa_data, make_tiny_bert

    from kvtune.methods.bicache.adapters import load_encoder
    from kvtune.methods.bicache.api import BiCacheMethod

    model = make_tiny_bert(tmp_path / "tiny-bert")
    adapter, tokenizer = load_encoder(str(model))
    st = bicache_settings(model, make_qa_data(tmp_path / "qa.jsonl"))
    rows, keys = {}, {}
    for name, executor in [("inprocess", None), ("ray", RayExecutor(2))]:
        if name == "ray":
            driver_builds_nothing(monkeypatch, BiCacheMethod)
        res = run_method(METHODS["bicache"], st, tmp_path / name, executor=executor, adapter=adapter,
                         tokenizer=tokenizer)
        rows[name], keys[name] = records(res.run_dir), run_keys(res.run_dir)
    assert sorted(r["key"] for r in rows["ray"]) == sorted(r["key"] for r in rows["inprocess"])
    assert len(rows["ray"]) == 2 and keys["ray"] == keys["inprocess"]  # 2 prefix-ratio buckets
    quality = {name: {r["key"]: [(q["depth"], q["policy"], q["kv_cosine"]) for q in r["quality"]] for r in got}
               for name, got in rows.items()}
    for key, values in quality["inprocess"].items():
        assert [v[:2] for v in quality["ray"][key]] == [v[:2] for v in values], key
        assert [v[2] for v in quality["ray"][key]] == pytest.approx([v[2] for v in values], rel=1e-5, nan_ok=True), key
    assert res.context.adapter is None and res.context.state is None


def test_worker_killed_mid_trial_loses_and_repeats_nothing(local_ray, tiny_model_dir, tiny_text, tmp_path):
    marks = tmp_path / "marks"
    marks.mkdir()
    st = tqc_settings(tiny_model_dir, tiny_text, tmp_path, "killed-worker", contexts=9)  # a split setup
    executor = RayExecutor(2)
    started = {}
    real_start = executor.start

    def start(job):
        started["workers"] = real_start(job)
        return started["workers"]

    executor.start = start
    log = st.run_dir / "trials.jsonl"

    def started_twice() -> bool:
        ids = [p.name.split(".")[0] for p in marks.iterdir()]
        return len(ids) > len(set(ids))

    def killer():
        # first kill: Ray restarts the actor and retries its trial on it; once that retry has
        # started, the second kill is for good: the trial goes to the other actor
        while not log.exists() or not log.read_text().strip():
            time.sleep(0.05)
        time.sleep(0.5)  # both actors are 0.5 s into 2 s trials
        ray.kill(started["workers"].live[0], no_restart=False)
        while not started_twice():
            time.sleep(0.05)
        time.sleep(0.5)
        ray.kill(started["workers"].live[0], no_restart=True)

    thread = threading.Thread(target=killer, daemon=True)
    thread.start()
    res = run_method(SlowTQC(marks, delay=2.0), st, st.run_dir, executor=executor)
    thread.join(timeout=5)
    rows = records(res.run_dir)
    assert_recorded_once(rows, 6)
    starts = sorted(p.name.split(".")[0] for p in marks.iterdir())
    assert len(starts) == 6 + 2  # the killed trial was started 3 times (killed twice), every other once
    assert sorted(starts.count(pid) for pid in set(starts)) == [1, 1, 1, 1, 1, 3]
    assert len(res.trials) == 6
    assert res.info["executor"]["setup_parts"] == 2  # the restarted actor built its whole context alone


def test_driver_killed_then_resumed_with_one_worker(local_ray, tiny_model_dir, tiny_text, tmp_path):
    run_dir = tmp_path / "profiles" / "driver"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    cli = [sys.executable, "-m", "kvtune.cli", "profile"]
    ray_opts = ["--executor", "ray", "--ray-address", local_ray]
    args = [*tiny_cli_args(tiny_model_dir, tiny_text), "--budget", "16", "--out", str(tmp_path / "profiles"),
            "--reports", str(tmp_path / "reports"), "--run", "driver"]
    proc = subprocess.Popen([*cli, *args, *ray_opts, "--workers", "2"], env=env, cwd=tmp_path,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    log = run_dir / "trials.jsonl"
    deadline = time.monotonic() + 150
    while (not log.exists() or log.read_bytes().count(b"\n") < 3) and proc.poll() is None:  # 3 whole lines
        assert time.monotonic() < deadline, "no 3 trials stored in time"
        time.sleep(0.02)
    if proc.poll() is not None:
        pytest.fail(f"the driver exited ({proc.returncode}) before 3 trials were stored:\n"
                    f"{proc.stderr.read().decode()[-3000:]}")
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    before = TrialStore(run_dir).load()  # as the resume reads it: a last line the kill cut short is dropped
    assert 3 <= len(before) < 16, proc.stderr.read().decode()[-2000:]
    done = subprocess.run([*cli, "--resume", str(run_dir), *ray_opts, "--workers", "1"], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    after = records(run_dir)
    assert after[:len(before)] == before  # nothing stored was touched
    assert_recorded_once(after, 16)
    info = json.loads((run_dir / "run.json").read_text())
    assert info["executor"]["workers"] == 1 and info["trial_records"] == 16


@pytest.mark.parametrize("args, message", [
    (["--workers", "0"], "--workers must be an integer >= 1, got 0"),
    (["--executor", "nope"], "unknown --executor 'nope'; known: inprocess, ray"),
    (["--ray-address", "127.0.0.1:9"], "--ray-address 127.0.0.1:9 is for --executor ray"),
    (["--executor", "ray", "--ray-address", "127.0.0.1:1"], "--ray-address 127.0.0.1:1: cannot reach 127.0.0.1:1"),
    (["--executor", "ray", "--ray-address", "nohost"], "expected host:port"),
])
def test_bad_executor_options_are_config_errors_before_any_model_loads(args, message, tiny_model_dir, tiny_text,
                                                                        tmp_path, monkeypatch):
    from typer.testing import CliRunner

    import kvtune.evaluate.model
    from kvtune.cli import app

    def no_load(*_a, **_k):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(kvtune.evaluate.model, "load_model", no_load)
    res = CliRunner().invoke(app, ["profile", *tiny_cli_args(tiny_model_dir, tiny_text),
                                   "--out", str(tmp_path / "p"), "--reports", str(tmp_path / "r"), "--run", "x", *args])
    assert res.exit_code == 2, res.output
    assert message in " ".join(res.output.split())
    assert not (tmp_path / "p" / "x").exists()


def test_make_executor_and_placement_refuse_what_cannot_run():
    with pytest.raises(ConfigError, match="--workers must be an integer >= 1, got True"):
        make_executor("ray", True)
    assert placement({"CPU": 2.0}, 4, "auto").num_cpus == 0.5  # more actors than CPUs: fractional shares
    assert placement({"CPU": 16.0, "GPU": 8.0}, 8, "auto") == placement({"CPU": 16.0, "GPU": 8.0}, 8, "cuda")
    assert placement({"CPU": 16.0, "GPU": 8.0}, 8, "auto").num_gpus == 1
    assert placement({"CPU": 16.0, "GPU": 8.0}, 3, "cpu").threads == 5
    with pytest.raises(ConfigError, match="has 8 GPU\\(s\\) and a worker takes one"):
        placement({"CPU": 16.0, "GPU": 8.0}, 9, "cuda")
    with pytest.raises(ConfigError, match="has 0 GPU"):
        placement({"CPU": 16.0}, 1, "cuda")


def test_an_explicit_address_failure_says_how_token_authentication_is_set(monkeypatch):
    from kvtune.run.executors.ray_executor import auth_hint

    monkeypatch.delenv("RAY_AUTH_MODE", raising=False)
    hint = auth_hint("10.0.0.5:6379")
    assert "RAY_AUTH_MODE=token" in hint and "ray get-auth-token" in hint
    assert auth_hint(None) == auth_hint("auto") == ""  # a local Ray finds its own mode
    monkeypatch.setenv("RAY_AUTH_MODE", "token")
    assert auth_hint("10.0.0.5:6379") == ""  # already set: the failure is something else


def test_workers_of_a_ray_on_this_machine_that_do_not_fit_are_refused_before_any_starts(local_ray, tiny_model_dir,
                                                                                      tiny_text, tmp_path, monkeypatch):
    import kvtune.evaluate.memory as memory
    from kvtune.methods.tqc.profile import check_profile_memory

    st = tqc_settings(tiny_model_dir, tiny_text, tmp_path, "memory")
    estimate = check_profile_memory(st, 3)
    monkeypatch.setattr(memory, "available_memory", lambda: int(estimate.total * 1.5))  # one context fits, two do not
    METHODS["tqc"].check(st)
    RayExecutor(1).check(METHODS["tqc"], st)
    with pytest.raises(ConfigError, match="per worker x 2 workers.*or use fewer --workers"):
        RayExecutor(2).check(METHODS["tqc"], st)


def test_workers_whose_prepare_wrote_other_calibration_files_stop_the_run(local_ray, tiny_model_dir, tiny_text,
                                                                         tmp_path):
    st = tqc_settings(tiny_model_dir, tiny_text, tmp_path, "differs")
    with pytest.raises(ExecutorError, match="workers calibrated differently \\(context fingerprints 0000"):
        run_method(PidCalibratedTQC(), st, st.run_dir, executor=RayExecutor(2))
    assert not (st.run_dir / "trials.jsonl").exists() or not (st.run_dir / "trials.jsonl").read_text().strip()
