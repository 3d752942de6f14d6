"""Bad input to the shared run CLI (``kvtune profile --method X --set name=value``, ``--resume``,
``kvtune export --recompile``), found by a break-it pass: each is a typed error naming the option
and its value, raised before any model loads."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from kvtune.cli import app
from kvtune.core.errors import ConfigError, KvtuneError
from kvtune.methods import METHODS
from kvtune.run.settings import parse_overrides

runner = CliRunner()


class ModelLoaded(Exception):
    """Raised by the stubbed model loaders: the command got past every settings check."""


def _no_models(monkeypatch) -> None:
    """Make every model loader (and every method's ``prepare``) raise :class:`ModelLoaded`."""
    import kvtune.evaluate.model as model
    import kvtune.methods.scd.profile as scd_profile

    def boom(*_a, **_k):
        raise ModelLoaded

    monkeypatch.setattr(model, "load_model", boom)
    monkeypatch.setattr(scd_profile, "load_model", boom)
    for method in METHODS.values():
        monkeypatch.setattr(type(method), "prepare", boom)


# ------------------------------------------------------------------------------ SCD settings


SCD_BAD = [
    ("tqc_presets", "zzz", r"--set tqc_presets=zzz: unknown T/Q/C preset 'zzz'"),
    ("droidspeak_lengths", "0", r"--set droidspeak_lengths=0: .*>= 1"),
    ("ranks", "0", r"--set ranks=0: .*>= 1"),
    ("ranks", "-4", r"--set ranks=-4: .*>= 1"),
    ("ranks", "", r"--set ranks=: .*at least one rank"),
    ("ridge", "-1", r"--set ridge=-1.0: .*finite number > 0"),
    ("ridge", "0", r"--set ridge=0.0: .*finite number > 0"),
    ("ridge", "nan", r"--set ridge=nan: .*finite number > 0"),
    ("patch_counts", "-1", r"--set patch_counts=-1: .*>= 0"),
    ("droidspeak_stride", "0", r"--set droidspeak_stride=0: .*>= 1"),
    ("q_min", "nan", r"--set q_min=nan: .*fraction in \(0, 1\]"),
    ("q_min", "1.5", r"--set q_min=1.5: .*fraction in \(0, 1\]"),
    ("contexts", "0", r"--set contexts=0: .*>= 1"),
    ("calib_windows", "0", r"--set calib_windows=0: .*>= 1"),
    ("context_tokens", "0", r"--set context_tokens=0: .*>= 1"),
    ("calib_tokens", "-3", r"--set calib_tokens=-3: .*>= 1"),
    ("continuation_tokens", "1", r"--set continuation_tokens=1: .*>= 2"),
    ("profile_contexts", "0", r"--set profile_contexts=0: .*>= 1"),
    ("holdout_fraction", "2", r"--set holdout_fraction=2.0: .*in \(0, 1\)"),
    ("holdout_fraction", "0", r"--set holdout_fraction=0.0: .*in \(0, 1\)"),
    ("tqc_presets", "kivi-4,kvtc-2", r"--set tqc_presets=kivi-4,kvtc-2: preset 'kvtc-2' needs a PCA basis \(pre-RoPE keys\)"),
    ("tqc_presets", "duo-like", r"--set tqc_presets=duo-like: preset 'duo-like' needs MixHQ head scores"),
]


@pytest.mark.parametrize("name, text, match", SCD_BAD)
def test_scd_settings_are_checked_when_built(name, text, match):
    """Found only after the models loaded (tqc_presets, droidspeak_lengths, ranks, ridge < 0),
    accepted silently (patch_counts, droidspeak_stride, ridge 0/nan, q_min nan), or reported
    with the T/Q/C flag names (--contexts) or as a data split problem (holdout_fraction)."""
    from kvtune.methods.scd.profile import SCDProfileSettings

    extra = {"optimizer": "kvserve"} if name == "q_min" else {}
    with pytest.raises(ConfigError, match=match):
        SCDProfileSettings(**extra, **parse_overrides(SCDProfileSettings, {name: text}))


@pytest.mark.parametrize("name, text, match", [SCD_BAD[0], SCD_BAD[1], SCD_BAD[3], SCD_BAD[5], SCD_BAD[12],
                                               SCD_BAD[18]])
def test_scd_cli_refuses_bad_settings_before_any_model_loads(tmp_path, monkeypatch, name, text, match):
    _no_models(monkeypatch)
    res = runner.invoke(app, ["profile", "--method", "scd", "--model", str(tmp_path / "missing"), "--set",
                              f"consumer={tmp_path / 'missing'}", "--out", str(tmp_path / "p"), "--run", "r",
                              "--set", f"{name}={text}"])
    assert res.exit_code == 2, (res.output, res.exception)  # a loaded model ends with ModelLoaded (exit 1)
    assert "error" in res.output and f"--set {name}=" in " ".join(res.output.split()), res.output
    assert not (tmp_path / "p").exists()  # droidspeak_lengths=0 left a folder with calibration files, no run.json


def test_scd_calibration_rows_are_checked_against_the_largest_rank_up_front():
    """2 windows x 1 token gave 2 calibration rows (identical start tokens): a torch LinAlgError
    traceback out of fit_low_rank_map after the models loaded."""
    from kvtune.methods.scd.profile import SCDProfileSettings

    with pytest.raises(ConfigError, match=r"calib_windows x calib_tokens = 2 x 1 = 2 calibration rows .* rank 64"):
        SCDProfileSettings(calib_windows=2, calib_tokens=1, ranks=(8, 64))
    SCDProfileSettings(calib_windows=5, calib_tokens=13, ranks=(8, 64))  # 65 rows > rank 64


def test_low_rank_fit_of_degenerate_rows_is_a_typed_error():
    from kvtune.methods.scd.lowrank import fit_low_rank_map

    y = torch.randn(3, 4, generator=torch.Generator().manual_seed(0))
    with pytest.raises(ConfigError, match=r"3 calibration rows .* all equal"):
        fit_low_rank_map(torch.ones(3, 8), y)


def test_scd_calibration_refuses_fewer_rows_than_a_rank(tiny_lm):
    from kvtune.methods.scd.calibration import calibrate

    with pytest.raises(ConfigError, match=r"4 calibration rows .* rank 8"):
        calibrate(tiny_lm, tiny_lm, [[5, 6], [7, 8]], ranks=(2, 8))


@pytest.fixture(scope="module")
def tiny_lm(tiny_model_dir):
    from kvtune.evaluate.model import load_model

    return load_model(str(tiny_model_dir), "cpu")


# ------------------------------------------------------------------------------ --set parsing


def test_set_list_items_are_parsed_by_the_declared_element_type():
    """A list setting whose default is empty kept its items as strings (depths=1,2 -> ['1', '2'])."""
    from kvtune.methods.bicache import BiCacheSettings
    from kvtune.methods.scd.profile import SCDProfileSettings

    assert parse_overrides(BiCacheSettings, {"depths": "1,2"}) == {"depths": (1, 2)}
    assert parse_overrides(BiCacheSettings, {"depths": "[3, 0]"}) == {"depths": (3, 0)}
    assert parse_overrides(SCDProfileSettings, {"ranks": "32,64", "floors": "0.9"}) == \
        {"ranks": (32, 64), "floors": (0.9,)}
    with pytest.raises(KvtuneError, match=r"--set depths=1.5,2: expected a list of integers"):
        parse_overrides(BiCacheSettings, {"depths": "1.5,2"})
    with pytest.raises(KvtuneError, match=r"--set ranks=\[1.5\]: expected a list of integers"):
        parse_overrides(SCDProfileSettings, {"ranks": "[1.5]"})


def test_set_none_for_a_setting_that_allows_it():
    from kvtune.methods.bicache import BiCacheSettings

    assert parse_overrides(BiCacheSettings, {"threads": "none"}) == {"threads": None}
    assert parse_overrides(BiCacheSettings, {"threads": "2"}) == {"threads": 2}
    with pytest.raises(KvtuneError, match=r"--set seed=none: expected an integer"):
        parse_overrides(BiCacheSettings, {"seed": "none"})


def test_set_errors_clip_long_values():
    from kvtune.methods.scd.profile import SCDProfileSettings

    with pytest.raises(KvtuneError) as info:
        parse_overrides(SCDProfileSettings, {"budget": "9" * 5000})
    assert len(str(info.value)) < 200 and "9" * 80 + "…" in str(info.value)


# ------------------------------------------------------------------------------ --resume


def _scd_run_folder(root: Path) -> Path:
    """A run folder whose run.json says scd (settings only; enough for the option checks)."""
    from kvtune.methods.scd.profile import SCDProfileSettings

    run = root / "profiles" / "scd-run"
    run.mkdir(parents=True)
    info = {"method": "scd", "settings": SCDProfileSettings(producer="prod-model").to_dict(),
            "producer_spec": "prod-model"}
    (run / "run.json").write_text(json.dumps(info))
    return run


@pytest.mark.parametrize("extra, message", [
    (["--method", "bicache"], "--resume {run} is a scd run; --method bicache"),
    (["--method", "tqc"], "--resume {run} is a scd run; --method tqc"),
    (["--run", "other"], "--run other"),
    (["--out", "elsewhere"], "--out elsewhere"),
    (["--model", "another-model"], "--model another-model"),
])
def test_resume_options_that_disagree_with_the_run_are_refused(tmp_path, monkeypatch, extra, message):
    """`--method bicache --resume <scd run>` ran as scd; --run/--out/--model were silently ignored."""
    _no_models(monkeypatch)
    run = _scd_run_folder(tmp_path)
    res = runner.invoke(app, ["profile", "--resume", str(run), *extra])
    assert res.exit_code == 2 and "error" in res.output, (res.output, res.exception)
    assert message.format(run=run) in " ".join(res.output.split()), res.output


def test_resume_with_a_seed_of_its_own_is_refused(tmp_path, monkeypatch):
    _no_models(monkeypatch)
    run = _scd_run_folder(tmp_path)
    res = runner.invoke(app, ["profile", "--resume", str(run), "--seed", "3"])
    assert res.exit_code == 2 and "--seed 3 (the run's: 0)" in " ".join(res.output.split()), res.output


def test_tqc_options_with_another_method_are_refused_not_ignored(tmp_path, monkeypatch):
    """`kvtune profile --method scd --budget 5` ran with SCD's own budget, the flag silently ignored."""
    _no_models(monkeypatch)
    res = runner.invoke(app, ["profile", "--method", "scd", "--budget", "5", "--contexts", "3", "--out",
                              str(tmp_path / "p"), "--run", "r"])
    assert res.exit_code == 2, (res.output, res.exception)
    assert "--budget, --contexts: options of --method tqc" in " ".join(res.output.split()), res.output
    assert not (tmp_path / "p").exists()


@pytest.mark.parametrize("extra", [[], ["--method", "scd"], ["--run", "scd-run"], ["--model", "prod-model"],
                                   ["--seed", "0"]])
def test_resume_options_that_agree_with_the_run_pass(tmp_path, monkeypatch, extra):
    _no_models(monkeypatch)
    run = _scd_run_folder(tmp_path)
    res = runner.invoke(app, ["profile", "--resume", str(run), "--out", str(run.parent), *extra])
    assert isinstance(res.exception, ModelLoaded), res.output  # got past every check


def test_tqc_resume_refuses_its_own_options_when_they_disagree(tmp_path, monkeypatch):
    """T/Q/C flags given with --resume were silently replaced by the stored settings."""
    _no_models(monkeypatch)
    run = tmp_path / "profiles" / "smollm2-default"
    shutil.copytree("tests/data/smollm2-default", run)
    res = runner.invoke(app, ["profile", "--resume", str(run), "--budget", "7", "--context-tokens", "1024"])
    assert res.exit_code == 2 and "--budget 7" in " ".join(res.output.split()), res.output
    assert "--context-tokens" not in res.output  # agrees with the run: not an error


@pytest.mark.parametrize("name", sorted(METHODS))  # a new method package needs a tiny run in tests/tiny_runs.py
def test_resume_of_a_complete_run_loads_no_model(name, tmp_path, tiny_model_dir, tiny_text, monkeypatch):
    """Resuming a finished run reloaded the models and recalibrated; it now reports the run is
    complete and rewrites only missing outputs."""
    from kvtune.run.runner import run_request
    from kvtune.run.method import Hooks, ProfileRequest
    from tests.tiny_runs import report_path, tiny_method_run

    run_dir = tiny_method_run(name, tmp_path, tiny_model_dir, tiny_text)
    report = report_path(run_dir)
    table = (run_dir / "policy_table.json").read_bytes()
    _no_models(monkeypatch)
    said: list[str] = []
    before = report.stat().st_mtime_ns
    res = run_request(METHODS[name], ProfileRequest(resume=run_dir, hooks=Hooks(say=said.append)))
    assert any("complete" in s for s in said) and report.stat().st_mtime_ns == before  # nothing rewritten
    assert res.run_dir == run_dir and len(res.table.frame) > 0
    report.unlink()
    (run_dir / "policy_table.json").unlink()
    run_request(METHODS[name], ProfileRequest(resume=run_dir, hooks=Hooks(say=said.append)))
    assert report.is_file() and (run_dir / "policy_table.json").read_bytes() == table


def test_resume_of_a_complete_run_from_the_cli(tmp_path, tiny_model_dir, tiny_text, monkeypatch):
    from tests.tiny_runs import tiny_method_run

    run_dir = tiny_method_run("tqc", tmp_path, tiny_model_dir, tiny_text)
    _no_models(monkeypatch)
    res = runner.invoke(app, ["profile", "--resume", str(run_dir)])
    assert res.exit_code == 0 and "complete" in res.output, (res.output, res.exception)


# ------------------------------------------------------------------------------ export --recompile


@pytest.mark.parametrize("stored, claimed", [("scd", "tqc"), ("tqc", "scd"), ("scd", "bicache")])
def test_recompile_refuses_settings_of_another_method(tmp_path, stored, claimed):
    """A run.json whose 'method' was edited compiled its table with the wrong method."""
    from kvtune.methods.scd.profile import SCDProfileSettings
    from kvtune.methods.tqc.settings import ProfileSettings

    run = tmp_path / "run"
    shutil.copytree("tests/data/smollm2-default", run)
    info = json.loads((run / "run.json").read_text())
    info["settings"] = (SCDProfileSettings() if stored == "scd" else ProfileSettings()).to_dict()
    info["method"] = claimed
    (run / "run.json").write_text(json.dumps(info))
    res = runner.invoke(app, ["export", str(run), "--recompile", "--format", "json", "--out", str(tmp_path / "t.json")])
    assert res.exit_code == 2, res.output
    text = " ".join(res.output.split())
    assert f"are not {claimed} settings" in text and str(run / "run.json") in text, text
    assert not (tmp_path / "t.json").exists()


# ------------------------------------------------------------------------------ tqc --space presets


def test_tqc_presets_space_with_too_short_contexts_is_refused_before_the_model_loads(tiny_text):
    """MixHQ head calibration refused --context-tokens 8 only after the model loaded and prefilled."""
    from kvtune.methods.tqc.profile import check_profile_settings
    from kvtune.methods.tqc.settings import ProfileSettings

    with pytest.raises(ConfigError, match=r"--space presets .* --context-tokens 69 .* longer than 69"):
        check_profile_settings(ProfileSettings(space="presets", text=str(tiny_text), context_tokens=69, contexts=2,
                                               continuation_tokens=8, device="cpu"))
    check_profile_settings(ProfileSettings(space="presets", text=str(tiny_text), context_tokens=70, contexts=2,
                                           continuation_tokens=8, device="cpu"))
    check_profile_settings(ProfileSettings(space="default", text=str(tiny_text), context_tokens=16, contexts=2,
                                           continuation_tokens=8, device="cpu"))  # no MixHQ: no constraint
