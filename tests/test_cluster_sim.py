"""benchmarks/cluster_sim.py: the event-driven cluster simulation and its time-to-target,
on hand-made inputs with hand-computed answers."""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import numpy as np
import pytest

from kvtune.search.optimizers.replay import HypervolumeSpec

_PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "cluster_sim.py"
_SPEC = importlib.util.spec_from_file_location("cluster_sim", _PATH)
cluster_sim = importlib.util.module_from_spec(_SPEC)
sys.modules[_SPEC.name] = cluster_sim  # dataclasses look their module up
_SPEC.loader.exec_module(cluster_sim)


class FakeOptimizer:
    """Proposes "a", "b", "c", ... in order; records every ask's q and pending list."""

    def __init__(self, names: str) -> None:
        self.queue = list(names)
        self.calls: list[tuple[int, list[str]]] = []

    def ask(self, q: int, pending: list[str]) -> list[str]:
        self.calls.append((q, list(pending)))
        out, self.queue = self.queue[:q], self.queue[q:]
        return out


DURATIONS = {"a": 3.0, "b": 1.0, "c": 2.0, "d": 5.0, "e": 1.0}


def test_two_workers_run_in_finish_order_with_the_running_ones_pending():
    opt = FakeOptimizer("abcd")
    told = []
    trace = cluster_sim.simulate_cluster(opt.ask, DURATIONS.__getitem__, lambda c, e: told.append(e) and False,
                                         workers=2, max_evals=10)
    # a: 0..3 on worker 1; b: 0..1 on worker 2; c: 1..3; a and c finish at 3 (told in start
    # order), then d: 3..8; at 3 two workers are free but only d is left
    assert [(e.key, e.start, e.finish, e.told_at) for e in trace.told] == [
        ("b", 0.0, 1.0, 1.0), ("a", 0.0, 3.0, 3.0), ("c", 1.0, 3.0, 3.0), ("d", 3.0, 8.0, 8.0)]
    assert told == trace.told
    assert opt.calls == [(2, []), (1, ["a"]), (2, []), (2, [])]
    assert trace.started == 4 and trace.stop_reason == "exhausted"


def test_one_worker_is_serial_and_max_evals_caps_the_starts():
    opt = FakeOptimizer("abcde")
    trace = cluster_sim.simulate_cluster(opt.ask, DURATIONS.__getitem__, lambda c, e: False,
                                         workers=1, max_evals=3)
    assert [(e.key, e.finish) for e in trace.told] == [("a", 3.0), ("b", 4.0), ("c", 6.0)]
    assert trace.started == 3 and trace.stop_reason == "max_evals"


def test_tell_returning_true_ends_the_run_at_that_result():
    opt = FakeOptimizer("abcde")
    trace = cluster_sim.simulate_cluster(opt.ask, DURATIONS.__getitem__, lambda c, e: c == "c",
                                         workers=2, max_evals=10)
    assert [e.key for e in trace.told] == ["b", "a", "c"]
    assert trace.stop_reason == "target" and trace.started == 3  # ends before d is asked


def test_charged_asks_advance_the_clock_and_delay_the_tells():
    ticks = iter(np.arange(0.0, 100.0, 0.5))  # every ask measures exactly 0.5 s
    opt = FakeOptimizer("abc")
    trace = cluster_sim.simulate_cluster(opt.ask, DURATIONS.__getitem__, lambda c, e: False, workers=2,
                                         max_evals=10, charge_ask=True, timer=lambda: float(next(ticks)))
    # ask 1 (0..0.5): a 0.5..3.5, b 0.5..1.5; b told at 1.5, ask 2 (1.5..2.0): c 2.0..4.0;
    # a finishes 3.5, told at 3.5, ask 3 (3.5..4.0, nothing): c finished at 4.0 <= 4.0
    assert [(e.key, e.start, e.finish, e.told_at) for e in trace.told] == [
        ("b", 0.5, 1.5, 1.5), ("a", 0.5, 3.5, 3.5), ("c", 2.0, 4.0, 4.0)]
    assert [s for s, _ in trace.asks] == [0.5, 0.5, 0.5, 0.5]


def test_a_result_finishing_during_an_ask_is_told_when_the_ask_ends():
    ticks = iter([0.0, 0.0, 0.0, 2.5, 0.0, 0.0, 0.0, 0.0])  # the second ask takes 2.5 s
    opt = FakeOptimizer("bac")
    trace = cluster_sim.simulate_cluster(opt.ask, DURATIONS.__getitem__, lambda c, e: False, workers=2,
                                         max_evals=10, charge_ask=True, timer=lambda: next(ticks))
    # b 0..1, a 0..3; b told at 1, ask until 3.5 -> c 3.5..5.5; a (finished at 3) told at 3.5
    assert [(e.key, e.finish, e.told_at) for e in trace.told] == [("b", 1.0, 1.0), ("a", 3.0, 3.5), ("c", 5.5, 5.5)]


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="workers"):
        cluster_sim.simulate_cluster(lambda q, p: [], float, lambda c, e: False, workers=0, max_evals=1)
    with pytest.raises(ValueError, match="duration"):
        cluster_sim.simulate_cluster(lambda q, p: ["x"], lambda c: -1.0, lambda c, e: False, workers=1, max_evals=1)


def test_first_reached():
    assert cluster_sim.first_reached([1.0, 2.0, 4.0, 7.0], [0.5, 0.98, 0.99, 1.0], 0.99) == (4.0, 3)
    t, n = cluster_sim.first_reached([1.0, 2.0], [0.5, 0.6], 0.99)
    assert math.isnan(t) and n == 0


def test_hypervolume_tracker_matches_hand_computed_volumes():
    spec = HypervolumeSpec(latency_scale=1.0)  # reference (accuracy 0.5, ratio 1.0, latency 1.1)
    tracker = cluster_sim.HypervolumeTracker(spec)
    assert tracker.add(np.array([1.0, 2.0, 0.1])) == pytest.approx(0.5 * 1.0 * 1.0)
    assert tracker.add(np.array([0.9, 1.5, 0.5])) == pytest.approx(0.5)  # dominated
    assert tracker.add(np.array([0.6, np.nan, 0.1])) == pytest.approx(0.5)  # missing objective
    # adds [0.5, 0.6] x [2, 3] x [0.1, 1.1]: 0.1 * 1 * 1
    assert tracker.add(np.array([0.6, 3.0, 0.1])) == pytest.approx(0.6)
    assert len(tracker.front) == 2
    pts = np.array([[1.0, 2.0, 0.1], [0.9, 1.5, 0.5], [0.6, 3.0, 0.1]])
    assert tracker.value == pytest.approx(spec.hypervolume(pts))


def test_summary_speedups_against_one_worker():
    import pandas as pd

    nan = float("nan")
    rows = [  # (optimizer, workers, seed, t_hv_s, n_hv, ask_total_s, t_hit_s)
        ("m", 1, 0, 100.0, 50, 10.0, 60.0), ("m", 1, 1, 300.0, 70, 20.0, nan),
        ("m", 8, 0, 20.0, 60, 30.0, 10.0), ("m", 8, 1, 30.0, 80, 20.0, 20.0),
        ("m", 32, 0, 10.0, 90, 40.0, nan), ("m", 32, 1, nan, 0, 50.0, nan)]
    frame = pd.DataFrame([{"ask_time": "free", "optimizer": o, "workers": w, "seed": s, "t_hv_s": t, "n_hv": n,
                           "reached": n > 0, "n_hit": 0 if np.isnan(h) else 5, "t_hit_s": h, "told": n,
                           "utilization": 1.0, "ask_total_s": a, "ask_mean_s": a / 10}
                          for o, w, s, t, n, a, h in rows])
    out = cluster_sim.summarize_cluster(frame).set_index("workers")
    assert out.loc[1, "t_hv_mean"] == 200.0 and out.loc[8, "t_hv_mean"] == 25.0
    assert out.loc[8, "speedup"] == pytest.approx(8.0) and out.loc[32, "speedup"] == pytest.approx(20.0)
    assert out.loc[32, "reached"] == 1 and out.loc[32, "n_hv_mean"] == 90.0 and out.loc[8, "n_hv_mean"] == 70.0
    # bound: max(t, asks) over reached seeds: W=1 (100, 300) -> 200; W=8 (30, 30) -> 30; W=32 (40) -> 40
    assert out.loc[8, "t_bound_mean"] == 30.0 and out.loc[32, "t_bound_mean"] == 40.0
    assert out.loc[8, "speedup_bound"] == pytest.approx(200 / 30) and out.loc[32, "speedup_bound"] == pytest.approx(5.0)
    assert out.loc[1, "hit"] == 1 and out.loc[8, "hit"] == 2 and out.loc[32, "hit"] == 0
    assert out.loc[8, "hit_speedup"] == pytest.approx(60 / 15) and np.isnan(out.loc[32, "hit_speedup"])


def test_resummarize_keeps_the_text_around_the_table(tmp_path):
    import pandas as pd

    frame = pd.DataFrame([{"ask_time": "free", "optimizer": "m", "workers": w, "seed": 0, "t_hv_s": t, "n_hv": 10,
                           "reached": True, "n_hit": 0, "t_hit_s": float("nan"), "told": 10, "utilization": 1.0,
                           "ask_total_s": 1.0, "ask_mean_s": 0.1} for w, t in [(1, 40.0), (8, 5.0)]])
    out = tmp_path / "sim"
    frame.to_csv(out.with_suffix(".csv"), index=False)
    out.with_suffix(".md").write_text("# Title\n\nNotes above.\n\n| old | table |\n| --- | --- |\n| 1 | 2 |\n\nNotes below.\n")
    assert cluster_sim.resummarize(out) == 0
    text = out.with_suffix(".md").read_text()
    assert text.startswith("# Title\n\nNotes above.\n\n| ask_time | optimizer | workers |")
    assert text.endswith("\n\nNotes below.\n") and "| old |" not in text
    assert "| free | m | 8 | 1 | 1 | 5.000 | 8.000 |" in text  # speedup 40 / 5
