"""Tests of kvtune.report: one self-contained HTML file with every figure and table."""

from __future__ import annotations

import json
import re

import numpy as np
import pandas as pd
import plotly.offline
import pytest

from kvtune.pareto import pareto_front
from kvtune.report import plot_data
from kvtune.report.html import write_report
from kvtune.tables import compile_policy_table


def synthetic_trials(n: int = 30, seed: int = 0) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    bits = rng.integers(2, 9, n)
    return pd.DataFrame(
        {
            "policy_id": [f"{i:012x}" for i in range(n)],
            "label": [f"kivi<{b}b>&g{32 * (1 + i % 3)}" for i, b in enumerate(bits)],  # needs escaping
            "method": "tqc",
            "config_json": [json.dumps({"bits": int(b)}) for b in bits],
            "compression_ratio": 16.0 / bits * rng.uniform(0.8, 1.2, n),
            "relative_accuracy": 1.0 - 0.4 * np.exp(-0.7 * bits) * rng.uniform(0.5, 2.0, n),
            "encode_gbps": rng.uniform(0.5, 20.0, n),
            "decode_gbps": rng.uniform(0.5, 20.0, n),
            "kl_mean": rng.random(n),
            "top1_agreement": rng.random(n),
            "ppl_ratio": 1.0 + rng.random(n),
            "trial": np.arange(n),
        }
    )


@pytest.fixture(scope="module")
def inputs():
    trials = synthetic_trials()
    pareto = pareto_front(trials)
    table = compile_policy_table(pareto, model="SmolLM2-135M", workload="qa", device="cpu")
    return trials, pareto, table


def test_write_report_single_self_contained_file(tmp_path, inputs):
    trials, pareto, table = inputs
    out = write_report(
        trials, pareto, table, tmp_path / "sub" / "report.html",
        title="kvtune <test> report", run_config={"seed": 0, "floors": [0.99, 0.97]},
    )
    assert out == tmp_path / "sub" / "report.html"
    assert [p.name for p in (tmp_path / "sub").iterdir()] == ["report.html"]  # no temp left over
    page = out.read_text(encoding="utf-8")

    bundle = plotly.offline.get_plotlyjs()
    assert page.count(bundle) == 1  # plotly.js inline, exactly once
    assert not re.search(r"<script[^>]+src=", page)  # nothing fetched from a CDN

    n_figures = 3 + len(table.floors)
    assert page.count('class="plotly-graph-div"') == n_figures
    ids = re.findall(r'<div id="(kvtune-[a-z0-9-]+)" class="plotly-graph-div"', page)
    assert ids == [
        "kvtune-trials-3d", "kvtune-ratio-vs-accuracy", "kvtune-ratio-vs-latency",
        *(f"kvtune-envelope-{k}" for k in range(len(table.floors))),
    ]
    # 3-D scatter and both projections highlight exactly the Pareto points
    n_front, n_other = len(pareto), len(trials) - len(pareto)
    assert page.count(f'"name":"Pareto front ({n_front})"') == 1
    assert page.count(f'"name":"Pareto front (3-D) ({n_front})"') == 2
    assert page.count(f'"name":"dominated trials ({n_other})"') == 3

    # one Pareto table row per Pareto policy, label escaped
    section = page[page.index("<h2>Pareto policies"):page.index("<h2>Run configuration")]
    rows = re.findall(r"<tr><td>(.*?)</td><td>tqc</td><td>([0-9a-f]{12})</td>", section)
    assert [pid for _, pid in rows] == pareto["policy_id"].tolist()
    assert rows[0][0] == pareto["label"].iloc[0].replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
    assert "kvtune &lt;test&gt; report" in page
    assert "&quot;seed&quot;: 0" in page  # run config shown


def test_plot_data_layer(inputs):
    trials, pareto, table = inputs
    pts = plot_data.trial_points(trials, pareto)
    assert len(pts) == len(trials) and pts["on_front"].sum() == len(pareto)
    assert pts["accuracy_pct"].max() == pytest.approx(100 * trials["relative_accuracy"].max())
    # envelope curve for the loosest floor: a + b * 8 / B, continuous at the breakpoints
    floor = table.floors[-1]
    curve = plot_data.envelope_curve(table, floor)
    assert curve["bandwidth_gbps"].min() == pytest.approx(1.0)
    assert curve["bandwidth_gbps"].max() == pytest.approx(400.0)
    for bw, t in curve[["bandwidth_gbps", "seconds_per_gb"]].to_numpy()[::17]:
        assert t == pytest.approx(table.select(bw * (1 + 1e-9), floor).predicted_seconds_per_gb, rel=1e-6)
    ends = curve.groupby("segment")["seconds_per_gb"].agg(["first", "last"]).to_numpy()
    np.testing.assert_allclose(ends[:-1, 0], ends[1:, 1], rtol=1e-9)  # segments meet
    unc = plot_data.uncompressed_curve()
    np.testing.assert_allclose(unc["seconds_per_gb"], 8.0 / unc["bandwidth_gbps"])
