"""Tests of kvtune.report: one self-contained HTML file with every figure and table."""

from __future__ import annotations

import json
import re

import numpy as np
import pandas as pd
import plotly.offline
import pytest

from kvtune.search.pareto import pareto_front
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

    n_figures = 4 + len(table.floors)
    assert page.count('class="plotly-graph-div"') == n_figures
    ids = re.findall(r'<div id="(kvtune-[a-z0-9-]+)" class="plotly-graph-div"', page)
    assert ids == [
        "kvtune-trials-3d", "kvtune-ratio-vs-accuracy", "kvtune-ratio-vs-latency", "kvtune-convergence",
        *(f"kvtune-envelope-{k}" for k in range(len(table.floors))),
    ]
    assert '<table class="kvtune sortable" id="kvtune-pareto-table">' in page
    assert page.count('table.sortable') >= 1 and "querySelectorAll(\"table.sortable\")" in page
    assert '"name":"presets' not in page  # no preset rows in these trials
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


def test_presets_are_marked(tmp_path):
    trials = synthetic_trials()
    trials["preset"] = None
    trials.loc[[2, 5], "preset"] = ["kivi-2", "kivi-4"]
    extra = trials.iloc[[0]].assign(policy_id="feedfacecafe", method="preset", label="cachegen", preset=None)
    trials = pd.concat([trials, extra], ignore_index=True)
    names = plot_data.preset_names(trials)
    assert names.tolist().count("") == len(trials) - 3
    assert names.iloc[2] == "kivi-2" and names.iloc[5] == "kivi-4" and names.iloc[-1] == "cachegen"
    pareto = pareto_front(trials)
    pts = plot_data.trial_points(trials, pareto)
    assert sorted(pts.loc[pts["preset"] != "", "preset"]) == ["cachegen", "kivi-2", "kivi-4"]
    assert "preset <b>kivi-2</b>" in pts.loc[pts["preset"] == "kivi-2", "hover"].iloc[0]
    table = compile_policy_table(pareto, model="m", workload="qa", device="cpu")
    page = write_report(trials, pareto, table, tmp_path / "r.html", title="t", run_config={}).read_text()
    # one preset trace in the 3-D plot and in each projection, diamonds with text labels
    assert page.count('"name":"presets (3)"') == 3
    assert page.count('"symbol":"diamond"') == 1 and page.count('"symbol":"diamond-open"') == 2
    assert '"text":["kivi-2","kivi-4","cachegen"]' in page
    assert "3 presets (diamonds)" in page


def test_hover_shows_components_and_threshold():
    trials = synthetic_trials(8)
    trials["param.key.bits"] = [2, 3, 4, 8, 2, 3, 4, 8]
    trials["param.transforms"] = "hadamard"
    pts = plot_data.trial_points(trials, pareto_front(trials))
    hover = pts["hover"].iloc[0]
    assert "key.bits=2, transforms=hadamard" in hover and "pays below B* =" in hover
    assert np.isfinite(pts["threshold_gbps"]).all()


def test_convergence_hypervolume():
    from kvtune.search.pareto import hypervolume

    trials = synthetic_trials(40, seed=3).sample(frac=1.0, random_state=0)  # rows out of trial order
    conv = plot_data.convergence(trials)
    assert conv["trial"].tolist() == list(range(40))
    hv = conv["hypervolume"].to_numpy()
    assert (np.diff(hv) >= -1e-15).all() and 0 < hv[-1] <= 1
    assert conv["front_size"].iloc[-1] == len(pareto_front(trials))
    assert conv["improved"].iloc[0] and (np.diff(hv)[~conv["improved"].to_numpy()[1:]] == 0).all()
    # final value == hypervolume of all trials in the documented normalized loss space
    f = trials.sort_values("trial")
    acc, cr = f["relative_accuracy"].to_numpy(), f["compression_ratio"].to_numpy()
    lat = (1 / f["encode_gbps"] + 1 / f["decode_gbps"]).to_numpy()
    loss = np.column_stack([
        (acc.max() - acc) / (acc.max() - acc.min()),
        (cr.max() - cr) / (cr.max() - cr.min()),
        (lat - lat.min()) / (lat.max() - lat.min()),
    ])
    assert hv[-1] == pytest.approx(hypervolume(loss, [1.1] * 3, [False] * 3) / 1.1**3, rel=1e-12)
    # a closed-form case: one trial at the best corner of every objective -> 1.0 after it
    corner = trials.iloc[[0]].assign(
        relative_accuracy=acc.max(), compression_ratio=cr.max(), encode_gbps=1e9, decode_gbps=1e9, trial=99
    )
    bounds = {
        "relative_accuracy": (acc.min(), acc.max()),
        "compression_ratio": (cr.min(), cr.max()),
        "codec_seconds_per_gb": (lat.max(), 2e-9),
    }
    conv2 = plot_data.convergence(pd.concat([trials, corner]), bounds=bounds)
    assert conv2["hypervolume"].iloc[-1] == pytest.approx(1.0)
    # failed trials (NaN) count as trials but add nothing
    failed = trials.iloc[[1]].assign(relative_accuracy=np.nan, trial=100)
    conv3 = plot_data.convergence(pd.concat([trials, failed]))
    assert len(conv3) == 41 and conv3["hypervolume"].iloc[-1] == conv3["hypervolume"].iloc[-2]


def test_pareto_rows_preset_column_only_when_presets():
    trials = synthetic_trials()
    pareto = pareto_front(trials)
    assert "preset" not in plot_data.pareto_rows(pareto).columns
    pareto = pareto.assign(preset=[None] * (len(pareto) - 1) + ["kivi-4"])
    rows = plot_data.pareto_rows(pareto)
    assert list(rows.columns[:4]) == ["policy", "method", "policy_id", "preset"] and rows["preset"].iloc[-1] == "kivi-4"
