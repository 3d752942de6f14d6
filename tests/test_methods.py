"""The shared matrix every registered method passes: settings style, registration, protocol."""

from __future__ import annotations

import dataclasses
import json

import pytest

from kvtune.core.errors import KvtuneError
from kvtune.methods import METHODS
from kvtune.run.method import Method
from kvtune.run.settings import RunSettings, parse_overrides


def test_the_three_methods_are_registered_by_their_own_packages():
    assert {"tqc", "scd", "bicache"} <= set(METHODS)
    for name, method in METHODS.items():
        assert type(method).__module__.startswith(f"kvtune.methods.{name}."), (name, type(method).__module__)


@pytest.mark.parametrize("name", sorted(METHODS))  # a new method package is covered without edits here
def test_settings_are_frozen_versioned_and_round_trip_through_json(name):
    cls = METHODS[name].settings_class
    assert issubclass(cls, RunSettings) and dataclasses.is_dataclass(cls)
    settings = cls()
    stored = json.loads(json.dumps(settings.to_dict()))
    assert stored["version"] == cls.VERSION and cls.from_dict(stored) == settings
    with pytest.raises(dataclasses.FrozenInstanceError):
        settings.version = 99
    assert dataclasses.replace(settings, seed=7).seed == 7


@pytest.mark.parametrize("name", sorted(METHODS))  # a new method package is covered without edits here
def test_set_options_come_from_the_settings_class(name):
    cls = METHODS[name].settings_class
    assert parse_overrides(cls, {"seed": "3"}) == {"seed": 3}
    with pytest.raises(KvtuneError, match="not a setting of this method; known: .*seed"):
        parse_overrides(cls, {"no_such_setting": "1"})


@pytest.mark.parametrize("name", sorted(METHODS))  # a new method package is covered without edits here
def test_methods_supply_context_stages_evaluate_and_compile(name):
    method = METHODS[name]
    for hook in ("prepare", "stages", "evaluate", "compile"):
        assert getattr(type(method), hook) is not getattr(Method, hook), (name, hook)


#: The div ids of the figures a tiny run of each method must add to the report (T/Q/C adds none).
OWN_FIGURES = {
    "tqc": (),
    "scd": ("kvtune-scd-accuracy-vs-payload", "kvtune-scd-ttft-0", "kvtune-scd-ttft-1"),
    "bicache": ("kvtune-bicache-depth", "kvtune-bicache-quality-kv_cosine", "kvtune-bicache-layer-cosine-key",
                "kvtune-bicache-layer-cosine-value", "kvtune-bicache-throughput"),
}


@pytest.mark.parametrize("name", sorted(METHODS))  # a new method package needs a tiny run in tests/tiny_runs.py
def test_every_method_reports_its_own_sections_on_a_tiny_run(name, tmp_path, tiny_model_dir, tiny_text):
    import html

    from kvtune.run.runner import finalize_run
    from kvtune.tables.run import read_run_info
    from tests.tiny_runs import report_path, tiny_method_run

    method = METHODS[name]
    run_dir = tiny_method_run(name, tmp_path, tiny_model_dir, tiny_text)
    info = read_run_info(run_dir)
    compiled = method.compile_stored(run_dir, info)
    sections = method.report_sections(run_dir, info, compiled)
    ids = [div for s in sections for div, _ in s.figures]
    assert set(OWN_FIGURES[name]) <= set(ids) and len(ids) == len(set(ids))
    assert (name == "tqc") == (not sections)  # T/Q/C's charts are the shared ones
    report = report_path(run_dir)
    page = report.read_text(encoding="utf-8")
    for section in sections:
        assert f"<h2>{html.escape(section.title)}</h2>" in page
        assert all(f'id="{div}"' in page for div, _ in section.figures)
        assert all(f"<h3>{html.escape(caption)}</h3>" in page for caption, _ in section.tables)
    report.unlink()  # `kvtune report` on the folder draws the same sections again, without a model
    again = finalize_run(method, run_dir).files["report"].read_text(encoding="utf-8")
    assert [d for d in ids if f'id="{d}"' in again] == ids
    # a cut log never replaces the outputs with less (BiCache keeps no trials.parquet to compare)
    log = run_dir / "trials.jsonl"
    lines = log.read_text(encoding="utf-8").splitlines(keepends=True)
    assert len(lines) >= 2 and read_run_info(run_dir)["trial_records"] == len(lines)
    table = (run_dir / "policy_table.json").read_bytes()
    log.write_text(lines[0], encoding="utf-8")
    with pytest.raises(KvtuneError, match="holds 1 trial records but .* counted"):
        finalize_run(method, run_dir)
    assert (run_dir / "policy_table.json").read_bytes() == table


def test_a_failed_resume_keeps_what_run_json_held(tmp_path, tiny_model_dir, tiny_text, monkeypatch):
    """run.json is written when a resume starts; a resume failing later must not leave it poorer
    (it lost fidelity, timings and trial counts)."""
    import kvtune.run.runner as runner
    from kvtune.methods.tqc.settings import ProfileSettings
    from kvtune.tables.run import read_run_info
    from tests.tiny_runs import tiny_method_run

    run_dir = tiny_method_run("tqc", tmp_path, tiny_model_dir, tiny_text)
    before = read_run_info(run_dir)
    assert {"fidelity", "trials", "trial_records", "total_seconds", "complete"} <= set(before)
    runner.write_run_info(run_dir, {k: v for k, v in before.items() if k != "complete"})  # a complete run is not
    # evaluated again (test_run_inputs.py): resume one that did not get to say it is complete

    def fail(*_, **__):
        raise KvtuneError("finalize failed")

    monkeypatch.setattr(runner, "finalize_run", fail)
    settings = ProfileSettings.from_dict(before["settings"])
    with pytest.raises(KvtuneError, match="finalize failed"):
        runner.run_method(METHODS["tqc"], settings, run_dir, resume=True)
    after = read_run_info(run_dir)
    assert {k: after[k] for k in ("fidelity", "trials", "trial_records")} == \
        {k: before[k] for k in ("fidelity", "trials", "trial_records")}


@pytest.mark.parametrize("method, floors_name, bad", [
    ("tqc", "floors", "nan,0.9"), ("tqc", "floors", "1.5"), ("tqc", "floors", "0.99,0.99"), ("scd", "floors", "nan,0.9"),
    ("scd", "floors", "0"), ("scd", "floors", "0.97,0.9,0.97"),
    ("bicache", "table_floors", "nan"), ("bicache", "table_floors", "1.5"),
    ("bicache", "floors", '{"kv_cosine": "abc"}'), ("bicache", "floors", '{"kv_cosine": null}'),
])
def test_bad_floors_are_refused_before_anything_loads(tmp_path, method, floors_name, bad):
    """Floors used to be checked only after every trial ran (or raised a bare ValueError/TypeError)."""
    from typer.testing import CliRunner

    from kvtune.cli import app

    args = ["profile", "--method", method, "--model", str(tmp_path / "missing"), "--out", str(tmp_path / "p"),
            "--run", "r"]
    if method == "tqc":  # tqc has its own flags; check the settings directly
        from kvtune.methods.tqc.profile import check_profile_settings
        from kvtune.methods.tqc.settings import ProfileSettings

        floors = tuple(float(x) for x in bad.split(","))
        with pytest.raises(KvtuneError, match="floors must be (a non-empty list of fractions|distinct)"):
            check_profile_settings(ProfileSettings(floors=floors))
        return
    res = CliRunner().invoke(app, [*args, "--set", f"{floors_name}={bad}"])
    assert res.exit_code == 2 and "Traceback" not in res.output, res.output
    assert floors_name in " ".join(res.output.split())
    assert not (tmp_path / "p" / "r").exists()


def test_resume_with_set_values_is_refused_not_ignored(tmp_path):
    """`--resume <folder> --set ranks=8` used to exit 0 with the --set values silently ignored."""
    from pathlib import Path

    from kvtune.run.method import ProfileRequest
    from kvtune.run.runner import run_request

    req = ProfileRequest(resume=Path(tmp_path / "some-run"), options={"ranks": "8", "budget": "3"})
    with pytest.raises(KvtuneError, match=r"--set budget, ranks cannot change them"):
        run_request(METHODS["scd"], req)


@pytest.mark.parametrize("name,bad", [("budget", -1), ("refine_budget", -2), ("climb_budget", -1), ("climb_budget", 1.5),
                                      ("climb_budget", True), ("refine_budget", "4")])
def test_negative_or_non_integer_tqc_budgets_are_refused_before_anything_loads(name, bad):
    """The CLI's ``min=0`` guards only its own flags; settings from Python or an edited run.json
    reach the same check."""
    from kvtune.methods.tqc.profile import check_profile_settings
    from kvtune.methods.tqc.settings import ProfileSettings

    with pytest.raises(KvtuneError, match=rf"^{name} \(--{name.replace('_', '-')}\) must be an integer >= 0"):
        check_profile_settings(ProfileSettings(**{name: bad}))
    check_profile_settings(ProfileSettings(**{name: 0}))
