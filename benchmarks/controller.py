"""Simulation benchmark of the online controller: replay bandwidth traces against a profiled
policy table and compare total transfer time and SLO violations.

    python benchmarks/controller.py [--table profiles/smollm2-default/policy_table.parquet]
        [--family cpu|whatif|both] [--speedup 20] [--q-min 0.97] [--requests 100]
        [--kv-bytes 755MB] [--chunk-bytes 64MB] [--slo-factor 1.25] [--seed 0] [--out FILE.md]

Simulated transfer of V bytes of KV with policy p starting at time t (seconds):
encode ``V / s_enc`` (profiled throughput x lognormal noise, sigma 0.05), send ``b V`` bytes
through the trace's time-varying bandwidth (integrated slot by slot, then x lognormal noise,
sigma 0.10), decode ``V / s_dec`` (same codec noise). Requests run back to back; each
strategy replays the same trace on its own clock. The controller gets the measured total and
the measured codec time as feedback.

Trace families (seeded; a trace is bandwidth in Gbps per time slot, slot = 1/4 of one request
sent uncompressed at a typical bandwidth of the trace, so the link changes *during* transfers):

* ``cpu`` -- the table as profiled (this CPU's codecs run at 0.14-0.77 GB/s, so compression
  pays only below ~1 Gbps): bandwidth scaled into 0.05-5 Gbps: a step 5 -> 0.5 Gbps at half
  time, a log random walk in [0.05, 5], periodic congestion 3 -> 0.3 Gbps (30 % duty).
* ``whatif`` -- **hypothetical** codecs ``--speedup`` x faster (a GPU-like what-if, via
  :meth:`PolicyTable.with_codec_speedup`), on the paper's range: a step 50 -> 5 Gbps, a log
  random walk in [1, 100], periodic congestion 40 -> 4 Gbps.

Strategies (all use the accuracy bucket of ``--q-min``):

* ``oracle`` -- knows the future: before each chunk it simulates every candidate policy of the
  bucket on the true trace (noise-free) and takes the fastest (a per-chunk greedy lower bound);
* ``uncompressed`` -- always "none";
* ``best static`` -- the single policy with the lowest total in hindsight (named);
* ``KVServe-style, static nominal`` -- the paper's controller given a fixed bandwidth figure
  (the trace's maximum, a link's nominal rate): "trusting a static figure";
* ``KVServe-style, exact probe`` -- one policy per request, bandwidth measured exactly and for
  free at request start (optimistic: a real probe costs time and is noisy), residual EWMA,
  epsilon 0.05, SLO screening, fallback (``estimate_bandwidth=False``);
* ``kvtune, est. bandwidth`` -- one policy per request, bandwidth estimated from feedback;
* ``kvtune, chunked`` -- re-selection before every ``--chunk-bytes`` chunk with the estimated
  bandwidth and the SLO budget left.

SLO per request: ``--slo-factor`` x the fastest predicted time at the trace's median bandwidth.
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kvtune.tables import PolicyTable  # noqa: E402
from kvtune.tables.controller import Controller, Feedback  # noqa: E402
from kvtune.tables.policy_table import PolicyEntry  # noqa: E402
from kvtune.core.units import format_bytes, parse_bytes  # noqa: E402

DEFAULT_TABLE = ROOT / "profiles" / "smollm2-default" / "policy_table.parquet"
FALLBACK_TABLE = ROOT / "tests" / "data" / "smollm2-default" / "policy_table.parquet"
#: 32k-token context of SmolLM2-135M: 2 x 30 layers x 3 KV heads x 64 x 32768 tokens x 2 bytes
DEFAULT_KV = "755MB"

WIRE_NOISE = 0.10
CODEC_NOISE = 0.05


# ------------------------------------------------------------------------------ traces


@dataclass
class Trace:
    """Bandwidth in Gbps per slot of ``dt`` seconds; past the end the last value holds, or the
    trace repeats when ``periodic``."""

    name: str
    dt: float
    gbps: np.ndarray
    periodic: bool = False

    def slot(self, k: int) -> float:
        n = len(self.gbps)
        return float(self.gbps[k % n] if self.periodic else self.gbps[min(k, n - 1)])

    def at(self, t: float) -> float:
        return self.slot(int(t / self.dt))

    def send(self, t: float, nbytes: float) -> float:
        """Time (s) to push ``nbytes`` through the link starting at ``t`` (noise-free)."""
        k = int(t / self.dt)
        now, left = t, nbytes
        while True:
            slot_end = max((k + 1) * self.dt, now)
            rate = self.slot(k) * 1e9 / 8  # bytes/s
            cap = (slot_end - now) * rate
            if left <= cap:
                return now + left / rate - t
            left -= cap
            now = slot_end
            k += 1


def make_traces(family: str, kv_bytes: float, n_requests: int, seed: int) -> list[Trace]:
    """The three traces of a family. Slot lengths are 1/4 of one request sent uncompressed at
    a typical bandwidth of the trace, so the link changes during transfers:

    * step: ``hi`` until about half of the requests would be done uncompressed at ``hi``,
      then ``lo`` (slot: a request at ``hi``);
    * random walk: log-bandwidth steps N(0, 0.25) per slot, clipped to the range (slot: a
      request at the geometric middle of the range);
    * periodic congestion: ``cong[0]`` for 70 % of a period of 10 requests at that rate, then
      ``cong[1]``.
    """
    rng = np.random.default_rng(seed)

    def slot_s(gbps: float) -> float:
        return kv_bytes * 8 / (gbps * 1e9) / 4

    if family == "cpu":
        hi, lo, walk, cong = 5.0, 0.5, (0.05, 5.0), (3.0, 0.3)
    else:
        hi, lo, walk, cong = 50.0, 5.0, (1.0, 100.0), (40.0, 4.0)
    half = n_requests * 4 // 2
    step = np.r_[np.full(half, hi), np.full(1, lo)]  # holds lo afterwards
    horizon = 50_000
    logw = np.empty(horizon)
    logw[0] = math.log(math.sqrt(walk[0] * walk[1]))
    steps = rng.normal(0.0, 0.25, horizon)
    for k in range(1, horizon):
        logw[k] = min(max(logw[k - 1] + steps[k], math.log(walk[0])), math.log(walk[1]))
    period = 40  # slots = 10 requests at cong[0]
    periodic = np.where(np.arange(period) < int(0.7 * period), cong[0], cong[1])
    return [
        Trace(f"step {hi:g} -> {lo:g} Gbps", slot_s(hi), step),
        Trace(f"random walk {walk[0]:g}-{walk[1]:g} Gbps", slot_s(math.sqrt(walk[0] * walk[1])), np.exp(logw)),
        Trace(f"periodic congestion {cong[0]:g} -> {cong[1]:g} Gbps", slot_s(cong[0]), periodic, periodic=True),
    ]


# ------------------------------------------------------------------------------ simulation


class Link:
    """Simulated transfers on a trace, with seeded noise."""

    def __init__(self, trace: Trace, seed: int) -> None:
        self.trace = trace
        self.rng = np.random.default_rng(seed)

    def run(self, p: PolicyEntry, nbytes: float, t: float, *, noise: bool = True) -> tuple[float, float]:
        """(total seconds, codec seconds) of one transfer of ``nbytes`` of KV starting at ``t``."""
        f_codec = math.exp(self.rng.normal(0, CODEC_NOISE)) if noise else 1.0
        f_wire = math.exp(self.rng.normal(0, WIRE_NOISE)) if noise else 1.0
        enc = 0.0 if math.isinf(p.encode_gbps) else nbytes / (p.encode_gbps * 1e9) * f_codec
        dec = 0.0 if math.isinf(p.decode_gbps) else nbytes / (p.decode_gbps * 1e9) * f_codec
        wire = self.trace.send(t + enc, p.b * nbytes) * f_wire
        return enc + wire + dec, enc + dec


@dataclass
class Result:
    name: str
    total_s: float
    per_request: list[float]
    violations: int
    switches: int = 0
    note: str = ""


def bucket_policies(table: PolicyTable, q_min: float) -> list[PolicyEntry]:
    """Distinct policies (envelope + runners-up) of the accuracy bucket of ``q_min``."""
    floor = table.floor_for(q_min)
    seen: dict[str, PolicyEntry] = {}
    for bw in table.intervals(floor)["bandwidth_hi_gbps"]:
        sel = table.select(min(float(bw), 1e6) * (1 - 1e-9) if math.isfinite(bw) else 1e6, q_min)
        for p in (sel.envelope_policy, *sel.alternatives):
            seen.setdefault(p.policy_id, p)
    return list(seen.values())


def run_static(trace: Trace, p: PolicyEntry, n: int, v: float, slo: float, seed: int) -> Result:
    link, t, per = Link(trace, seed), 0.0, []
    for _ in range(n):
        dt, _ = link.run(p, v, t)
        per.append(dt)
        t += dt
    return Result(p.label, t, per, sum(x > slo for x in per))


def run_oracle(trace: Trace, pols: list[PolicyEntry], n: int, v: float, chunk: float, slo: float, seed: int) -> Result:
    link, t, per, switches, last = Link(trace, seed), 0.0, [], 0, None
    for _ in range(n):
        start, left = t, v
        while left > 0:
            size = min(chunk, left)
            best = min(pols, key=lambda p: link.run(p, size, t, noise=False)[0])
            if last is not None and best.policy_id != last:
                switches += 1
            last = best.policy_id
            dt, _ = link.run(best, size, t)
            t += dt
            left -= size
        per.append(t - start)
    return Result("oracle (knows the future, per chunk)", t, per, sum(x > slo for x in per), switches)


def run_controller(
    trace: Trace, table: PolicyTable, q_min: float, n: int, v: float, chunk: float, slo: float, seed: int,
    *, mode: str,
) -> Result:
    ctl = Controller(table, q_min=q_min, slo_s=slo, epsilon=0.05, seed=seed,
                     estimate_bandwidth=mode in ("estimate", "chunked"), initial_bandwidth_gbps=trace.at(0.0))
    nominal = float(np.max(trace.gbps))
    link, t, per, switches, last = Link(trace, seed), 0.0, [], 0, None
    for _ in range(n):
        start = t
        if mode == "chunked":
            plan = ctl.plan_chunks(v, chunk, slo_s=slo)
            d = plan.next_chunk()
            while d is not None:
                if last is not None and d.policy_id != last:
                    switches += 1
                last = d.policy_id
                dt, codec = link.run(d.policy, d.kv_bytes, t)
                t += dt
                d = plan.next_chunk(Feedback(dt, codec_s=codec))
        else:
            given = {"kvserve": trace.at(t), "static": nominal}.get(mode)
            d = ctl.decide(v, bandwidth_gbps=given)
            if last is not None and d.policy_id != last:
                switches += 1
            last = d.policy_id
            dt, codec = link.run(d.policy, v, t)
            ctl.feedback(d, dt, codec_s=codec)
            t += dt
        per.append(t - start)
    name = {
        "static": f"KVServe-style, static nominal {nominal:.3g} Gbps (1 policy/request)",
        "kvserve": "KVServe-style, exact probe at request start (1 policy/request)",
        "estimate": "kvtune, bandwidth estimated from feedback (1 policy/request)",
        "chunked": "kvtune, estimated bandwidth + re-selection per chunk",
    }[mode]
    return Result(name, t, per, sum(x > slo for x in per), switches, f"{ctl.fallbacks_entered} fallbacks")


def simulate(table: PolicyTable, trace: Trace, q_min: float, n: int, v: float, chunk: float, slo: float,
             seed: int) -> list[Result]:
    pols = bucket_policies(table, q_min)
    none = next(p for p in pols if p.policy_id == "none")
    statics = [run_static(trace, p, n, v, slo, seed) for p in pols]
    best = min(statics, key=lambda r: r.total_s)
    best = Result(f"best static in hindsight: {best.name}", best.total_s, best.per_request, best.violations)
    return [
        run_oracle(trace, pols, n, v, chunk, slo, seed),
        run_static(trace, none, n, v, slo, seed),
        best,
        run_controller(trace, table, q_min, n, v, chunk, slo, seed, mode="static"),
        run_controller(trace, table, q_min, n, v, chunk, slo, seed, mode="kvserve"),
        run_controller(trace, table, q_min, n, v, chunk, slo, seed, mode="estimate"),
        run_controller(trace, table, q_min, n, v, chunk, slo, seed, mode="chunked"),
    ]


def slo_for(table: PolicyTable, trace: Trace, q_min: float, v: float, factor: float) -> float:
    """SLO: ``factor`` x the fastest predicted time for ``v`` at the trace's median bandwidth."""
    med = float(np.median(trace.gbps))
    return factor * table.select(med, q_min, kv_bytes=v).predicted_seconds


def render(results: list[Result], trace: Trace, slo: float, n: int) -> list[str]:
    oracle = results[0].total_s
    lines = [
        f"**{trace.name}** (slot {trace.dt * 1e3:.0f} ms), SLO {slo:.3g} s per request, {n} requests",
        "",
        "| strategy | total (s) | vs oracle | mean / request (s) | p95 / request (s) | SLO violations | policy switches |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        lines.append(
            f"| {r.name}{' (' + r.note + ')' if r.note else ''} | {r.total_s:.1f} | {100 * (r.total_s / oracle - 1):+.1f} % "
            f"| {np.mean(r.per_request):.3g} | {np.percentile(r.per_request, 95):.3g} | {r.violations} "
            f"({100 * r.violations / n:.0f} %) | {r.switches} |"
        )
    return lines + [""]


def _settings() -> str:
    from dataclasses import fields

    from kvtune.tables.controller import ControllerConfig

    cfg = ControllerConfig(epsilon=0.05)
    keep = ("epsilon", "residual_alpha", "bandwidth_alpha", "violation_limit", "violation_decay",
            "cooldown_decisions", "fallback_bandwidth_factor")
    return ", ".join(f"{f.name} {getattr(cfg, f.name):g}" for f in fields(cfg) if f.name in keep)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--table", type=Path, default=DEFAULT_TABLE if DEFAULT_TABLE.is_file() else FALLBACK_TABLE)
    ap.add_argument("--family", choices=["cpu", "whatif", "both"], default="both")
    ap.add_argument("--speedup", type=float, default=20.0, help="codec speedup of the hypothetical what-if family")
    ap.add_argument("--q-min", type=float, default=0.97)
    ap.add_argument("--requests", type=int, default=100)
    ap.add_argument("--kv-bytes", default=DEFAULT_KV, help="KV volume per request (default: 32k tokens of SmolLM2-135M)")
    ap.add_argument("--chunk-bytes", default="64MB")
    ap.add_argument("--slo-factor", type=float, default=1.25)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None, help="also write the tables as markdown here")
    args = ap.parse_args(argv)
    v, chunk = parse_bytes(args.kv_bytes), parse_bytes(args.chunk_bytes)
    base = PolicyTable.load(args.table)
    families = ["cpu", "whatif"] if args.family == "both" else [args.family]
    out = [
        f"# Controller simulation: `{args.table.name}` ({base.model}, {base.workload}), q_min {args.q_min}, "
        f"{format_bytes(v)} of KV per request, chunks of {format_bytes(chunk)}, seed {args.seed}",
        "",
        f"Noise: wire time x lognormal(sigma {WIRE_NOISE}), codec time x lognormal(sigma {CODEC_NOISE}). "
        "Totals are sums over back-to-back requests; 'vs oracle' is relative to the per-chunk oracle "
        "(a greedy per-chunk choice with perfect knowledge of the trace, not a strict lower bound).",
        "",
        f"Controllers: {_settings()}; every controller starts from the true bandwidth at t = 0.",
        "",
    ]
    for fam in families:
        table = base if fam == "cpu" else base.with_codec_speedup(args.speedup)
        title = (
            f"## Measured CPU codecs ({base.device}), bandwidth scaled to 0.05-5 Gbps"
            if fam == "cpu"
            else f"## HYPOTHETICAL: codecs x{args.speedup:g} faster (GPU-like what-if), paper's 5-50 Gbps range"
        )
        out += [title, ""]
        for k, trace in enumerate(make_traces(fam, v, args.requests, args.seed)):
            slo = slo_for(table, trace, args.q_min, v, args.slo_factor)
            results = simulate(table, trace, args.q_min, args.requests, v, chunk, slo, args.seed + k)
            out += render(results, trace, slo, args.requests)
    text = "\n".join(out)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
