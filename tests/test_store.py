"""The trial store never loses finished trials and survives a torn last line."""

from __future__ import annotations

import logging

import pandas as pd
import pytest

from kvtune.core.atomic import atomic_write_text
from kvtune.core.errors import KvtuneError
from kvtune.run.store import TrialStore


def test_append_load_and_parquet(tmp_path):
    store = TrialStore(tmp_path / "run")
    store.append({"policy_id": "a", "compression_ratio": 2.0})
    store.append({"policy_id": "b", "compression_ratio": 4.0})
    assert [r["policy_id"] for r in store.load()] == ["a", "b"]
    df = pd.read_parquet(tmp_path / "run" / "trials.parquet")
    assert df["compression_ratio"].tolist() == [2.0, 4.0]


def test_torn_last_line_is_skipped_and_next_append_is_clean(tmp_path, caplog):
    store = TrialStore(tmp_path)
    store.append({"policy_id": "a"})
    with open(store.log_path, "a") as f:
        f.write('{"policy_id": "b", "compr')  # crash in the middle of a write
    with caplog.at_level(logging.WARNING, logger="kvtune.run.store"):
        assert [r["policy_id"] for r in store.load()] == ["a"]
    assert "torn last line" in caplog.text
    store.append({"policy_id": "c"})
    assert [r["policy_id"] for r in store.load()] == ["a", "c"]
    assert store.log_path.read_text().count("\n") == 2  # the torn bytes were cut off, not kept mid-log


def test_complete_last_line_without_newline_is_kept(tmp_path):
    store = TrialStore(tmp_path)
    store.log_path.write_text('{"policy_id": "a"}')
    store.append({"policy_id": "b"})
    assert [r["policy_id"] for r in store.load()] == ["a", "b"]


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        (b'{"policy_id": "b", "compr', "not valid JSON"),  # torn, but no longer the last line
        (b"[1, 2]", "not a JSON object"),
        (b"\xff\xfe", "not UTF-8"),
    ],
)
def test_bad_middle_line_is_an_error_naming_file_and_line(tmp_path, bad, message):
    store = TrialStore(tmp_path)
    store.log_path.write_bytes(b'{"policy_id": "a"}\n' + bad + b'\n{"policy_id": "c"}\n')
    with pytest.raises(KvtuneError, match=message) as info:
        store.load()
    assert f"{store.log_path}:2: line 2" in str(info.value)
    with pytest.raises(KvtuneError):  # also never silently rewritten into trials.parquet
        store.write_table()


def test_atomic_write_leaves_no_temp_files(tmp_path):
    atomic_write_text(tmp_path / "x.json", "{}")
    atomic_write_text(tmp_path / "x.json", '{"a": 1}')
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.json"]
    assert (tmp_path / "x.json").read_text() == '{"a": 1}'
