"""Pure helpers of :mod:`kvtune.methods.tqc.profile` (the end-to-end runs are in test_cli.py)."""

from __future__ import annotations

import pandas as pd

from kvtune.methods.tqc.profile import refinement_order, split_fidelities


def test_refinement_order_covers_every_floor_then_the_2d_front_by_ratio():
    front = pd.DataFrame({
        "policy_id": ["a", "b", "c", "d", "e", "f", "g"],
        "relative_accuracy": [0.99, 0.95, 0.90, 0.93, 0.999, 0.80, 0.70],
        "compression_ratio": [3.0, 4.0, 5.0, 3.5, 2.0, 6.0, 7.0],
    })
    # 2-D front: e (2.0x, 99.9 %), a, b, c, f, g; d (3.5x, 93 %) is dominated by b.
    # Best per floor (0.99, 0.97, 0.95, 0.90): a, (a again), b, c; second best: e, -, -, -;
    # then the rest of the 2-D front by ratio (g, f), then d.
    assert refinement_order(front, 0) == ["a", "b", "c", "e", "g", "f", "d"]
    assert refinement_order(front, 3) == ["a", "b", "c"]
    # a single floor of 0.9: its two best, then by ratio
    assert refinement_order(front, 0, floors=(0.9,)) == ["c", "b", "g", "f", "a", "e", "d"]
    # no floor met by anything: plain ratio order of the 2-D front
    assert refinement_order(front, 0, floors=(1.0,)) == ["g", "f", "c", "b", "a", "e", "d"]
    assert refinement_order(front.iloc[:0], 3) == []


def test_refinement_order_reserves_per_floor_the_best_policy_whose_lower_end_clears_it():
    """The shape of a real default run: PCA policies led the 2-D front at search fidelity (99.0 %
    on 8 contexts) and fell to 97.9 % on 24, while 4x uniform / codebook policies whose lower
    ends already cleared 97 % sat off the 2-D front and were never refined."""
    front = pd.DataFrame({
        "policy_id": ["e", "c3", "cb4", "u4", "p5", "p7", "p9"],
        "relative_accuracy": [1.0, 0.9954, 0.9828, 0.9801, 0.9902, 0.9840, 0.9782],
        "relative_accuracy_lo": [1.0, 0.9915, 0.9745, 0.9704, 0.9750, 0.9650, 0.9550],
        "compression_ratio": [1.83, 3.20, 3.9976, 3.9985, 5.63, 7.86, 9.29],
    })
    # best per floor (0.99, 0.97): p5, p9; safe per floor: c3 (99 %), then u4 (97 %: p5 is taken,
    # u4 has the higher ratio of the two 4x ones); second best per floor: (c3), p7; then the rest
    # of the 2-D front by ratio (e), then cb4
    assert refinement_order(front, 0, floors=(0.99, 0.97)) == ["p5", "p9", "c3", "u4", "p7", "e", "cb4"]
    assert refinement_order(front, 4, floors=(0.99, 0.97)) == ["p5", "p9", "c3", "u4"]
    # without lower ends the 4x policies come last (the order before the safe picks)
    assert refinement_order(front.drop(columns="relative_accuracy_lo"), 4, floors=(0.99, 0.97)) == ["p5", "p9", "c3", "p7"]


def test_refinement_order_reserves_the_fastest_policy_per_floor_and_bandwidth():
    """The shape of default-s13: slow PCA policies (0.1 GB/s codecs) fill the 2-D front at every
    floor, and the fast uniform ones a table picks at 1-5 Gbps sit on the 3-D front only."""
    front = pd.DataFrame({
        "policy_id": ["p6", "p8", "p10", "p12", "u26", "u43", "u46"],
        "relative_accuracy": [0.998, 0.990, 0.975, 0.960, 0.996, 0.971, 0.966],
        "compression_ratio": [5.95, 8.33, 10.35, 12.70, 2.56, 4.26, 4.57],
        "encode_gbps": [0.11, 0.09, 0.09, 0.10, 1.06, 1.83, 1.75],
        "decode_gbps": [0.10, 0.12, 0.14, 0.08, 1.53, 2.82, 2.41],
    })
    # step 1: p8 (99 %), p10 (97 %), p12 (95 % and 90 %); step 3, seconds per GB at 1 Gbps = 1/enc +
    # 1/dec + 8/cr: u26 (99 %: 3.73 s against p6's 20.4 s), u43 (97 %), u46 (95 %; 90 %: u46 again);
    # at 5 Gbps the same; then p6 (the rest of the 2-D front)
    assert refinement_order(front, 0, floors=(0.99, 0.97, 0.95, 0.90)) == ["p8", "p10", "p12", "u26", "u43", "u46", "p6"]
    assert refinement_order(front, 5, floors=(0.99, 0.97, 0.95, 0.90)) == ["p8", "p10", "p12", "u26", "u43"]
    # without codec speeds the fast ones come last, after the whole 2-D front, by ratio
    assert refinement_order(front.drop(columns=["encode_gbps", "decode_gbps"]), 5) == ["p8", "p10", "p12", "p6", "u46"]


def test_split_fidelities_pairs_cheap_and_full_rows():
    trials = pd.DataFrame({
        "policy_id": ["a", "b", "c", "a", "b"],
        "fidelity": ["cheap", "cheap", "cheap", "full", "full"],
        "relative_accuracy_raw": [0.9, 0.8, 0.7, 0.95, 0.85],
    })
    searched, final, info = split_fidelities(trials, "cheap")
    assert searched["policy_id"].tolist() == ["a", "b", "c"] and final["policy_id"].tolist() == ["a", "b"]
    assert info == {"search": "cheap", "final": "full", "refined": 2, "paired": 2, "spearman_relative_accuracy": 1.0,
                    "full": 2, "climbed": 0}
    trials = pd.concat([trials.assign(stage=["search"] * 3 + ["refine"] * 2), pd.DataFrame(
        {"policy_id": ["d"], "fidelity": ["full"], "relative_accuracy_raw": [0.99], "stage": ["climb"]})])
    _, final, info = split_fidelities(trials, "cheap")  # a climbed policy the search never saw
    assert final["policy_id"].tolist() == ["a", "b", "d"]
    assert info["refined"] == 2 and info["paired"] == 2 and info["full"] == 3 and info["climbed"] == 1
    trials.loc[trials["policy_id"] == "d", "policy_id"] = "c"  # a climbed policy the search had seen
    _, _, info = split_fidelities(trials, "cheap")
    assert info["refined"] == 2 and info["paired"] == 3 and info["climbed"] == 1
    searched, final, info = split_fidelities(trials.iloc[:3], "cheap")  # nothing refined yet
    assert final is searched and info["final"] == "cheap" and info["spearman_relative_accuracy"] is None


def test_example_profile_recompiles_to_its_stored_outputs_exactly(tmp_path):
    """profiles/example was written by the code before the shared run skeleton: recompiling its
    Pareto front and tables from its trials with today's code gives the same files."""
    import json
    import shutil
    from pathlib import Path

    from kvtune.methods import METHODS
    from kvtune.run.runner import finalize_run
    from kvtune.tables.policy_table import PolicyTable

    example = Path(__file__).parent.parent / "profiles" / "example"
    info = json.loads((example / "run.json").read_text())
    run = tmp_path / info["settings"]["run"]  # the folder name is recorded in the table metadata
    shutil.copytree(example, run)
    for name in ("pareto.parquet", "policy_table.parquet", "policy_table.json"):
        (run / name).unlink()
    info["settings"]["reports"] = str(tmp_path / "reports")
    (run / "run.json").write_text(json.dumps(info, indent=2))
    finalize_run(METHODS["tqc"], run)
    pd.testing.assert_frame_equal(pd.read_parquet(run / "pareto.parquet"), pd.read_parquet(example / "pareto.parquet"))
    pd.testing.assert_frame_equal(pd.read_parquet(run / "trials.parquet"), pd.read_parquet(example / "trials.parquet"))
    new, old = PolicyTable.load(run / "policy_table.parquet"), PolicyTable.load(example / "policy_table.parquet")
    pd.testing.assert_frame_equal(new.frame, old.frame)
    assert new.metadata == old.metadata
    assert (run / "policy_table.json").read_text() == (example / "policy_table.json").read_text()
    assert (tmp_path / "reports" / f"{run.name}.html").is_file()
