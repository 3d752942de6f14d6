"""Wall time and peak memory of ``kvtune profile`` in one process and on 1 and 2 Ray workers.

Each configuration runs the same profile (by default the default one: SmolLM2-135M-Instruct,
24 essay contexts of 1024 tokens, budget 40, refinement) as its own ``kvtune profile``
process, one after the other, one torch thread per worker (``OMP_NUM_THREADS=1``):

- ``inprocess``: the default executor (trials one after the other in the profiling process);
- ``rayN``: ``--executor ray --workers N`` on a Ray started for it with ``ray start --head
  --num-cpus N`` (the "existing cluster" path of the README, on this machine).

Measured per configuration: wall time, the driver's peak resident memory (GNU time's
maximum RSS of the profiling process), the peak summed RSS of the Ray worker actors (sampled
every 0.25 s with psutil), the peak rise of the machine's used memory over its level before
the run (everything: driver, actors, Ray's own processes), the trials stored and the load
average before and after. Speedups are relative to the first configuration, measured in the
same run. Run it on a quiet machine::

    python benchmarks/scaling.py [--configs inprocess,ray1,ray2] [--out benchmarks/results/scaling]
                                 [-- extra kvtune profile options]

Writes ``<out>.csv`` and ``<out>.md``.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import psutil

TIME = "/usr/bin/time"


@dataclass
class Result:
    config: str
    workers: int
    wall_s: float
    driver_peak_rss_gb: float
    actors_peak_rss_gb: float
    machine_peak_rise_gb: float
    trials: int
    load_before: float
    load_after: float
    exit_code: int
    setup_s: float = float("nan")
    search_s: float = float("nan")
    refine_s: float = float("nan")
    setup_parts: int = 1


class MemorySampler(threading.Thread):
    """Peak summed RSS of Ray ``TrialWorker`` actors and peak rise of used memory, every ``period`` s.

    It also gives the actors this script's scheduling priority: Ray starts worker processes at
    nice 15, below the profiling process and below anything else running on the machine,
    which would make the Ray rows pay for every other process and the in-process row not."""

    def __init__(self, period: float = 0.25) -> None:
        super().__init__(daemon=True)
        self.period, self.stop = period, threading.Event()
        self.base_used = psutil.virtual_memory().used
        self.actors_peak = 0
        self.rise_peak = 0

    def run(self) -> None:
        while not self.stop.is_set():
            total = 0
            for p in psutil.process_iter(["cmdline", "memory_info"]):
                cmd = " ".join(p.info.get("cmdline") or [])
                if "TrialWorker" in cmd and p.info.get("memory_info") is not None:
                    total += p.info["memory_info"].rss
                    self.same_priority(p)
            self.actors_peak = max(self.actors_peak, total)
            self.rise_peak = max(self.rise_peak, psutil.virtual_memory().used - self.base_used)
            self.stop.wait(self.period)

    @staticmethod
    def same_priority(p: psutil.Process) -> None:
        """Set ``p``'s nice value to this process's (no-op when it is already)."""
        try:
            if p.nice() != os.nice(0):
                p.nice(os.nice(0))
        except (psutil.Error, OSError):  # gone, or not ours to change
            pass


def max_rss_gb(time_output: str) -> float:
    """GNU ``time -v``'s "Maximum resident set size (kbytes)" in GB (1e9 bytes); NaN when absent."""
    m = re.search(r"Maximum resident set size \(kbytes\): (\d+)", time_output)
    return int(m.group(1)) * 1024 / 1e9 if m else float("nan")


def timing(run_dir: Path) -> dict:
    """``run.json``'s ``timing_seconds`` and the executor's ``setup_parts`` ({} when missing)."""
    path = run_dir / "run.json"
    if not path.is_file():
        return {}
    info = json.loads(path.read_text())
    return {**(info.get("timing_seconds") or {}), "setup_parts": (info.get("executor") or {}).get("setup_parts")}


def stored_trials(run_dir: Path) -> int:
    """Records in ``trials.jsonl`` (0 when missing)."""
    log = run_dir / "trials.jsonl"
    return sum(1 for line in log.read_text().splitlines() if line.strip()) if log.is_file() else 0


def run_config(config: str, extra: list[str], scratch: Path, port: int) -> Result:
    workers = 0 if config == "inprocess" else int(config.removeprefix("ray"))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "RAY_USAGE_STATS_ENABLED": "0"}
    out = scratch / config
    cmd = [TIME, "-v", sys.executable, "-m", "kvtune.cli", "profile", "--run", f"scaling-{config}",
           "--out", str(out / "profiles"), "--reports", str(out / "reports"), *extra]
    if workers:
        subprocess.run(["ray", "start", "--head", f"--port={port}", f"--num-cpus={workers}", "--num-gpus=0",
                        "--include-dashboard=false", "--disable-usage-stats"], check=True, env=env,
                       stdout=subprocess.DEVNULL)
        cmd += ["--executor", "ray", "--workers", str(workers), "--ray-address", "auto"]  # the head just started
    sampler = MemorySampler()
    load_before = os.getloadavg()[0]
    sampler.start()
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    finally:
        wall = time.perf_counter() - t0
        sampler.stop.set()
        sampler.join()
        if workers:
            subprocess.run(["ray", "stop", "--force"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    if proc.returncode:
        print(proc.stdout[-3000:], proc.stderr[-3000:], file=sys.stderr)
    return Result(config=config, workers=max(workers, 1), wall_s=round(wall, 1),
                  driver_peak_rss_gb=round(max_rss_gb(proc.stderr), 3),
                  actors_peak_rss_gb=round(sampler.actors_peak / 1e9, 3),
                  machine_peak_rise_gb=round(sampler.rise_peak / 1e9, 3),
                  trials=stored_trials(out / "profiles" / f"scaling-{config}"),
                  load_before=round(load_before, 2), load_after=round(os.getloadavg()[0], 2),
                  exit_code=proc.returncode, **phases(timing(out / "profiles" / f"scaling-{config}")))


def phases(t: dict) -> dict:
    """Result fields from :func:`timing`: setup (a worker's prepare), search and refine seconds, setup parts."""
    nan = float("nan")
    return {"setup_s": round(t.get("load_and_prefill", nan), 1), "search_s": round(t.get("search", nan), 1),
            "refine_s": round(t.get("refine", nan), 1), "setup_parts": int(t.get("setup_parts") or 1)}


def markdown(results: list[Result], extra: list[str]) -> str:
    ref = results[0].wall_s
    lines = [f"# kvtune profile: wall time and memory by executor ({psutil.cpu_count()} CPUs, "
             f"{psutil.virtual_memory().total / 2**30:.0f} GiB)", "",
             f"Profile options: `{' '.join(extra) or '(defaults)'}`; one torch thread per worker.", "",
             "| config | workers | wall (s) | speedup vs " + results[0].config + " | driver peak RSS (GB) | "
             "actors peak RSS (GB) | machine peak rise (GB) | trials | setup / search / refine (s) | setup parts | "
             "load before/after |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r.config} | {r.workers} | {r.wall_s:.0f} | {ref / r.wall_s:.2f}x | {r.driver_peak_rss_gb:.2f} | "
                     f"{r.actors_peak_rss_gb:.2f} | {r.machine_peak_rise_gb:.2f} | {r.trials} | "
                     f"{r.setup_s:.0f} / {r.search_s:.0f} / {r.refine_s:.0f} | {r.setup_parts} | "
                     f"{r.load_before:.1f} / {r.load_after:.1f} |")
    lines += ["", "Setup: a worker's context (load, prefill, baseline, calibration, ratio estimates; with "
              "setup parts > 1 each worker built one part and assembled all); search and refine: the "
              "driver's stages, wall time."]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", default="inprocess,ray1,ray2", help="inprocess and/or rayN, in order")
    parser.add_argument("--out", default="benchmarks/results/scaling", help="output path without suffix")
    parser.add_argument("--port", type=int, default=6391, help="port of the Ray head this script starts")
    parser.add_argument("extra", nargs="*", help="options passed to kvtune profile (after --)")
    args = parser.parse_args()
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    bad = [c for c in configs if c != "inprocess" and not re.fullmatch(r"ray[1-9]\d*", c)]
    if bad or not configs:
        parser.error(f"--configs: expected inprocess or rayN, got {bad or configs}")
    if not Path(TIME).is_file() or shutil.which("ray") is None:
        parser.error(f"needs GNU time at {TIME} and the ray CLI on PATH")
    results = []
    with tempfile.TemporaryDirectory(prefix="kvtune-scaling-") as scratch:
        for config in configs:
            r = run_config(config, args.extra, Path(scratch), args.port)
            print(json.dumps(asdict(r)), flush=True)
            results.append(r)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.with_suffix(".csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(asdict(results[0])))
        w.writeheader()
        w.writerows(asdict(r) for r in results)
    out.with_suffix(".md").write_text(markdown(results, args.extra))
    print(markdown(results, args.extra))
    return 0 if all(r.exit_code == 0 for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
