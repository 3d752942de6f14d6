"""Run folders: safe names, the lock, removal of stale temp files and of folders nothing was written to."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from kvtune.core.errors import RunFolderError, RunLockedError
from kvtune.run.folder import LOCK_NAME, check_out_folder, check_run_name, open_run_folder, remove_stale_temps


@pytest.mark.parametrize("name", ["", ".", "..", "../x", "a/b", "a\\b", "x\x00y", "tab\there", "x" * 201])
def test_unsafe_run_names_are_rejected(name):
    with pytest.raises(RunFolderError, match="single folder name"):
        check_run_name(name)


@pytest.mark.parametrize("name", ["smollm2-default", "a.b_c-1", "run 1", "..x"])
def test_safe_run_names_pass(name):
    assert check_run_name(name) == name


def test_out_folder_below_a_file_is_rejected(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(RunFolderError, match="is a file, not a folder"):
        check_out_folder(tmp_path / "f" / "sub")
    assert check_out_folder(tmp_path / "new") == tmp_path / "new"


def test_only_temp_files_of_the_atomic_writer_are_removed(tmp_path):
    stale = [tmp_path / ".trials.parquet.ab12cd_4.tmp", tmp_path / "sub" / ".scd_maps.pt.zz99yy88.tmp"]
    keep = [tmp_path / "notes.tmp", tmp_path / ".hidden.tmp", tmp_path / "trials.parquet"]
    for p in stale + keep:
        p.parent.mkdir(exist_ok=True)
        p.write_bytes(b"")
    assert remove_stale_temps(tmp_path) == sorted(stale)
    assert all(p.exists() for p in keep) and not any(p.exists() for p in stale)


def test_a_folder_nothing_was_written_to_is_removed_with_its_new_parents(tmp_path):
    with open_run_folder(tmp_path / "out" / "run") as run:
        assert (run / LOCK_NAME).read_text() == f"{os.getpid()}\n"
    assert list(tmp_path.iterdir()) == []
    with open_run_folder(tmp_path / "out" / "run") as run:
        (run / "run.json").write_text("{}")
    assert sorted(p.name for p in (tmp_path / "out" / "run").iterdir()) == [LOCK_NAME, "run.json"]


def test_lock_is_reentrant_in_one_process_and_exclusive_across_processes(tmp_path):
    run = tmp_path / "run"
    code = ("import sys\nfrom kvtune.run.folder import open_run_folder\n"
            "try:\n    open_run_folder(sys.argv[1]).__enter__()\nexcept Exception as e:\n    print(type(e).__name__, e)\n")
    with open_run_folder(run):
        with open_run_folder(run):  # re-entrant (run_profile -> finalize_run)
            pass
        out = subprocess.run([sys.executable, "-c", code, str(run)], capture_output=True, text=True,
                             env={**os.environ, "PYTHONPATH": os.getcwd()}).stdout
        assert out.startswith("RunLockedError") and f"pid {os.getpid()}" in out and str(run) in out, out
    out = subprocess.run([sys.executable, "-c", code, str(run)], capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": os.getcwd()}).stdout
    assert out == ""  # released on exit


def test_opening_a_missing_folder_without_create_is_an_error(tmp_path):
    with pytest.raises(RunFolderError, match="no such run folder"):
        with open_run_folder(tmp_path / "missing", create=False):
            pass
    assert issubclass(RunLockedError, RunFolderError)
