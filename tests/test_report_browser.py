"""The HTML report in a real browser: headless Chromium loads it offline, runs plotly.js and the
table-sort script, and reports JavaScript errors and what rendered.

How: the test copies the report and injects (1) at the top of <head> a hook that records every
``error`` / ``unhandledrejection`` event and every ``console.error`` call into attributes of
<html>, and (2) before </body> a probe that, after load, clicks the Pareto table's "ratio"
header, records the resulting column, records per figure whether plotly rendered it
(``.js-plotly-plot`` with ``.main-svg`` layers, a WebGL canvas for the 3-D scatter), and throws
one deliberate error to prove the hook works. ``chromium --dump-dom`` after a virtual-time
budget returns the DOM with those attributes. Needs Debian's ``chromium`` (skipped without it).
"""

from __future__ import annotations

import html as html_lib
import json
import os
import re
import shutil
import subprocess

import numpy as np
import pandas as pd
import pytest

from kvtune.search.pareto import pareto_front
from kvtune.report.html import write_report
from kvtune.tables import compile_policy_table

CHROMIUM = os.environ.get("KVTUNE_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"

pytestmark = pytest.mark.skipif(
    not (os.path.isfile(CHROMIUM) and os.access(CHROMIUM, os.X_OK)),
    reason=f"headless Chromium not found at {CHROMIUM} (Debian package 'chromium'; or set KVTUNE_CHROMIUM)",
)

HOOK = """<script>
(function () {
  var errs = [], cons = [];
  function put() {
    document.documentElement.setAttribute("data-kv-errors", JSON.stringify(errs));
    document.documentElement.setAttribute("data-kv-console", JSON.stringify(cons));
  }
  window.addEventListener("error", function (e) { errs.push(String(e.message)); put(); });
  window.addEventListener("unhandledrejection", function (e) { errs.push("unhandled rejection: " + String(e.reason)); put(); });
  var orig = console.error;
  console.error = function () { cons.push(Array.prototype.join.call(arguments, " ")); put(); return orig.apply(console, arguments); };
  put();
})();
</script>"""

PROBE = """<script>
window.addEventListener("load", function () {
  setTimeout(function () {
    var root = document.documentElement, figs = {};
    document.querySelectorAll("div.plotly-graph-div").forEach(function (d) {
      figs[d.id] = {
        plotly: d.classList.contains("js-plotly-plot"),
        svg: d.querySelectorAll(".main-svg").length,
        canvas: d.querySelectorAll("canvas").length,
        traces: (d.data || []).length
      };
    });
    root.setAttribute("data-kv-figures", JSON.stringify(figs));
    var table = document.getElementById("kvtune-pareto-table"), col = -1;
    Array.prototype.forEach.call(table.tHead.rows[0].cells, function (th, i) {
      if (th.textContent.trim() === "ratio") { col = i; }
    });
    var head = table.tHead.rows[0].cells[col], out = {};
    head.click();
    out.asc = Array.prototype.map.call(table.tBodies[0].rows, function (r) { return r.cells[col].textContent; });
    head.click();
    out.desc = Array.prototype.map.call(table.tBodies[0].rows, function (r) { return r.cells[col].textContent; });
    out.dir = head.getAttribute("data-dir");
    root.setAttribute("data-kv-sort", JSON.stringify(out));
    root.setAttribute("data-kv-done", "1");
    setTimeout(function () { throw new Error("kvtune-probe"); }, 0);
  }, 1500);
});
</script>"""


def small_run(n: int = 24, seed: int = 0):
    """A small synthetic run: trials with components, two presets, a failed trial."""
    rng = np.random.default_rng(seed)
    bits = rng.integers(2, 9, n)
    trials = pd.DataFrame(
        {
            "trial": np.arange(n),
            "policy_id": [f"{i:012x}" for i in range(n)],
            "label": [f"hadamard|K:u{b}a/ch/g32|V:u{b}a/tok/g32|bitpack" for b in bits],
            "method": "tqc",
            "config_json": [json.dumps({"bits": int(b)}) for b in bits],
            "param.key.bits": bits,
            "param.transforms": "hadamard",
            "compression_ratio": 16.0 / bits * rng.uniform(0.8, 1.2, n),
            "relative_accuracy": 1.0 - 0.4 * np.exp(-0.7 * bits) * rng.uniform(0.5, 2.0, n),
            "encode_gbps": rng.uniform(0.5, 20.0, n),
            "decode_gbps": rng.uniform(0.5, 20.0, n),
            "kl_mean": rng.random(n),
            "preset": [None] * n,
        }
    )
    trials.loc[[3, 7], "preset"] = ["kivi-2", "kivi-4"]
    trials.loc[n - 1, ["relative_accuracy", "compression_ratio"]] = np.nan  # a failed trial
    pareto = pareto_front(trials)
    table = compile_policy_table(pareto, model="tiny", workload="qa", device="cpu")
    return trials, pareto, table


def _attr(dom: str, name: str):
    m = re.search(rf'<html[^>]*\s{name}="([^"]*)"', dom)
    assert m, f"attribute {name} missing: the probe did not run"
    return json.loads(html_lib.unescape(m.group(1)))


def _rendered_dom(page, tmp_path) -> str:
    """The DOM of report ``page`` after headless Chromium ran it with the error hook and probe."""
    text = page.read_text(encoding="utf-8")
    probe_page = tmp_path / "probe.html"
    probe_page.write_text(text.replace("<head>", "<head>" + HOOK, 1).replace("</body>", PROBE + "</body>", 1),
                          encoding="utf-8")
    profile = tmp_path / "chromium-profile"
    profile.mkdir()
    cmd = [
        CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync",
        "--disable-extensions", "--mute-audio", f"--user-data-dir={profile}",
        "--virtual-time-budget=6000", "--dump-dom", probe_page.as_uri(),
    ]
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        pytest.fail("headless Chromium did not finish within 120 s")
    dom = res.stdout
    assert res.returncode == 0 and "<html" in dom, f"chromium failed ({res.returncode}): {res.stderr[-2000:]}"
    return dom


def test_report_renders_in_headless_chromium(tmp_path):
    trials, pareto, table = small_run()
    page = write_report(trials, pareto, table, tmp_path / "report.html", title="browser test", run_config={"n": 24})
    dom = _rendered_dom(page, tmp_path)
    assert _attr(dom, "data-kv-done") == 1

    # no JavaScript error except the probe's own (which proves the hook was listening)
    errors = _attr(dom, "data-kv-errors")
    assert len(errors) == 1 and "kvtune-probe" in errors[0], errors
    assert _attr(dom, "data-kv-console") == []

    # every figure rendered by plotly
    figures = _attr(dom, "data-kv-figures")
    expected = ["kvtune-trials-3d", "kvtune-ratio-vs-accuracy", "kvtune-ratio-vs-latency", "kvtune-convergence",
                *(f"kvtune-envelope-{k}" for k in range(len(table.floors)))]
    assert list(figures) == expected
    for fid, info in figures.items():
        assert info["plotly"] and info["svg"] >= 1 and info["traces"] >= 1, (fid, info)
    assert figures["kvtune-trials-3d"]["canvas"] >= 1  # WebGL scene of the 3-D scatter
    assert figures["kvtune-trials-3d"]["traces"] == 3  # dominated, front, presets

    # header click sorts the Pareto table numerically, then reverses
    sort = _attr(dom, "data-kv-sort")
    values = [float(v) for v in sort["asc"]]
    assert len(values) == len(pareto) and values == sorted(values)
    assert [float(v) for v in sort["desc"]] == sorted(values, reverse=True) and sort["dir"] == "desc"


def test_keyed_table_report_renders_one_chart_per_key_and_floor(tmp_path):
    """BiCache-style tables are keyed (prefix-ratio buckets): one envelope chart per (key, floor)."""
    from kvtune.tables.policy_table import PolicyTable

    trials, pareto, _ = small_run()
    table = PolicyTable.combine([compile_policy_table(pareto, model="tiny", workload="qa", device="cpu", key=key,
                                                      floors=(0.99, 0.9)) for key in ("bucket=a", "bucket=b")])
    page = write_report(trials, pareto, table, tmp_path / "report.html", title="keyed", run_config={})
    assert page.read_text(encoding="utf-8").count("<h3>Accuracy floor") == 4
    dom = _rendered_dom(page, tmp_path)
    errors = _attr(dom, "data-kv-errors")
    assert len(errors) == 1 and "kvtune-probe" in errors[0], errors
    figures = _attr(dom, "data-kv-figures")
    assert list(figures)[4:] == [f"kvtune-envelope-{k}" for k in range(4)]
    assert all(info["plotly"] and info["traces"] >= 1 for info in figures.values())


@pytest.fixture(scope="module")
def method_reports(tmp_path_factory, tiny_model_dir, tiny_text):
    """``name -> report page`` of a tiny run of each registered method (made on first use)."""
    from tests.tiny_runs import report_path, tiny_method_run

    made = {}

    def report(name):
        if name not in made:
            made[name] = report_path(tiny_method_run(name, tmp_path_factory.mktemp(name), tiny_model_dir, tiny_text))
        return made[name]

    return report


@pytest.mark.parametrize("name, own", [
    ("tqc", ()),
    ("scd", ("kvtune-scd-accuracy-vs-payload", *(f"kvtune-scd-ttft-{k}" for k in range(4)))),
    ("bicache", ("kvtune-bicache-depth", "kvtune-bicache-quality-kv_cosine", "kvtune-bicache-quality-embedding_cosine",
                 "kvtune-bicache-quality-relative_retrieval", "kvtune-bicache-layer-cosine-key",
                 "kvtune-bicache-layer-cosine-value", "kvtune-bicache-throughput")),
])
def test_each_methods_report_renders_with_its_own_plots(name, own, method_reports, tmp_path):
    """A tiny run's report per method: no JavaScript error, every figure (the shared ones and the
    method's own, in page order) drawn by plotly with data."""
    dom = _rendered_dom(method_reports(name), tmp_path)
    assert _attr(dom, "data-kv-done") == 1
    errors = _attr(dom, "data-kv-errors")
    assert len(errors) == 1 and "kvtune-probe" in errors[0], errors
    assert _attr(dom, "data-kv-console") == []
    figures = _attr(dom, "data-kv-figures")
    shared = ["kvtune-trials-3d", "kvtune-ratio-vs-accuracy", "kvtune-ratio-vs-latency", "kvtune-convergence"]
    assert list(figures)[:4 + len(own)] == shared + list(own)
    assert [f for f in figures if f.startswith("kvtune-envelope-")]  # the policy table charts follow
    for fid, info in figures.items():
        assert info["plotly"] and info["svg"] >= 1 and info["traces"] >= 1, (fid, info)
    if name == "bicache":
        assert figures["kvtune-bicache-layer-cosine-key"]["traces"] == 1  # one heatmap
        assert figures["kvtune-bicache-throughput"]["traces"] == 2  # one line per bucket
