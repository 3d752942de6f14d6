"""The trial store never loses finished trials and survives a torn last line."""

from __future__ import annotations

import pandas as pd

from kvtune.atomic import atomic_write_text
from kvtune.store import TrialStore


def test_append_load_and_parquet(tmp_path):
    store = TrialStore(tmp_path / "run")
    store.append({"policy_id": "a", "compression_ratio": 2.0})
    store.append({"policy_id": "b", "compression_ratio": 4.0})
    assert [r["policy_id"] for r in store.load()] == ["a", "b"]
    df = pd.read_parquet(tmp_path / "run" / "trials.parquet")
    assert df["compression_ratio"].tolist() == [2.0, 4.0]


def test_torn_last_line_is_skipped_and_next_append_is_clean(tmp_path):
    store = TrialStore(tmp_path)
    store.append({"policy_id": "a"})
    with open(store.log_path, "a") as f:
        f.write('{"policy_id": "b", "compr')  # crash in the middle of a write
    assert [r["policy_id"] for r in store.load()] == ["a"]
    store.append({"policy_id": "c"})
    assert [r["policy_id"] for r in store.load()] == ["a", "c"]


def test_atomic_write_leaves_no_temp_files(tmp_path):
    atomic_write_text(tmp_path / "x.json", "{}")
    atomic_write_text(tmp_path / "x.json", '{"a": 1}')
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.json"]
    assert (tmp_path / "x.json").read_text() == '{"a": 1}'
