"""Drives two vLLM CPU instances joined by kvtune's connector; run with the vLLM venv's python.

Used by ``tests/test_vllm_connector.py`` (which runs it through a subprocess, because vLLM
lives in its own venv, ``scripts/vllm-venv.sh``) and by ``benchmarks/serving_e2e.py``. Not a
test module itself.

``python tests/vllm_driver.py scenario --model DIR --text FILE --work DIR --out FILE``
starts a consumer (decode) and a producer (prefill) instance in this process (each engine runs
in its own processes), with a fault-injecting TCP proxy between them, and runs the connector
scenario (canary, lossy policy, zeroed-KV control, corrupted stream, dropped connection), then
a keyed store-mode instance (store miss, prefix fetch, forged entries); it writes one JSON
document with every step's tokens and the connector's transfer records. The checks are the
test's; this script only records.

``python tests/vllm_driver.py serve --model DIR --role ROLE --extra JSON`` runs one instance
driven over stdin/stdout (see :func:`serve`), for the benchmark.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import struct
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

FRAME_HEADER = struct.Struct("<4sBBHQ")  # as kvtune.serving.transport.FRAME_HEADER


class FaultProxy:
    """A TCP relay between the producer and the consumer's receiver that can damage the next
    KV frame: ``arm("corrupt")`` flips one payload byte (the stream's CRC must catch it),
    ``arm("drop")`` forwards half of the payload and closes both connections."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.fault: str | None = None
        self.log: list[str] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def arm(self, fault: str) -> None:
        self.fault = fault

    def _accept(self) -> None:
        while True:
            try:
                src, _ = self.listener.accept()
            except OSError:
                return
            dst = socket.create_connection(("127.0.0.1", self.target_port))
            threading.Thread(target=self._forward, args=(src, dst), daemon=True).start()
            threading.Thread(target=self._back, args=(dst, src), daemon=True).start()

    @staticmethod
    def _exact(sock: socket.socket, n: int) -> bytes:
        buf = bytearray()
        while len(buf) < n:
            chunk = sock.recv(min(n - len(buf), 1 << 20))
            if not chunk:
                raise ConnectionError("closed")
            buf += chunk
        return bytes(buf)

    def _forward(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while True:
                head = self._exact(src, FRAME_HEADER.size)
                key_n, payload_n = FRAME_HEADER.unpack(head)[3], FRAME_HEADER.unpack(head)[4]
                key = self._exact(src, key_n)
                payload = bytearray(self._exact(src, payload_n))
                fault, self.fault = self.fault, None
                if fault == "corrupt":
                    payload[len(payload) // 2] ^= 0x01
                    self.log.append(f"corrupted {key.decode()}")
                if fault == "drop":
                    dst.sendall(head + key + payload[: len(payload) // 2])
                    self.log.append(f"dropped {key.decode()}")
                    raise ConnectionError("dropped on purpose")
                dst.sendall(head + key + payload)
        except (OSError, ConnectionError):
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                s.close()

    @staticmethod
    def _back(src: socket.socket, dst: socket.socket) -> None:
        try:
            while True:
                chunk = src.recv(1 << 16)
                if not chunk:
                    break
                dst.sendall(chunk)
        except OSError:
            pass
        for s in (src, dst):
            try:
                s.close()
            except OSError:
                pass


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_llm(model: str, role: str, extra: dict, *, dtype: str, cores: str, prefix_caching: bool, max_model_len: int):
    """One vLLM instance with kvtune's connector in ``role`` (``None``: no connector)."""
    from vllm import LLM
    from vllm.config import KVTransferConfig

    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = cores
    kw = {}
    if role is not None:
        kw["kv_transfer_config"] = KVTransferConfig(
            kv_connector="KvtuneConnector", kv_connector_module_path="kvtune.serving.vllm", kv_role=role,
            kv_load_failure_policy="recompute", kv_connector_extra_config=extra)
    return LLM(model=model, dtype=dtype, enforce_eager=True, max_model_len=max_model_len,
               enable_prefix_caching=prefix_caching, disable_log_stats=True, **kw)


def generate(llm, ids: list[int], max_tokens: int, params: dict | None = None) -> tuple[list[int], float]:
    """Greedy tokens for the prompt ``ids`` and the wall seconds it took."""
    from vllm import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens,
                        extra_args={"kv_transfer_params": params} if params else None)
    t0 = time.perf_counter()
    out = llm.generate([{"prompt_token_ids": ids}], sp, use_tqdm=False)
    return list(out[0].outputs[0].token_ids), time.perf_counter() - t0


class Records:
    """New lines of a connector metrics file since the last call."""

    def __init__(self, path: Path) -> None:
        self.path, self.seen = path, 0

    def new(self) -> list[dict]:
        if not self.path.exists():
            return []
        lines = self.path.read_text().splitlines()
        out = [json.loads(x) for x in lines[self.seen:]]
        self.seen = len(lines)
        return out


def forge_store(store: Path, prompts: dict, block_size: int) -> None:
    """Park forged entries in the store: a valid but unsealed stream for E's first blocks and
    one sealed with another key for F's (zeros: if either were used, the output would show)."""
    import torch

    from kvtune.codecs import encode_kv
    from kvtune.codecs.presets import load_presets
    from kvtune.serving.auth import seal
    from kvtune.serving.transport import KVStore
    from kvtune.serving.vllm import movable_tokens, prefix_key

    pool = KVStore(store)
    for name in ("E", "F"):
        n = movable_tokens(len(prompts[name]), block_size)
        kv = [(torch.zeros(1, 3, n, 64, dtype=torch.bfloat16),) * 2 for _ in range(30)]
        stream = encode_kv(kv, load_presets()["none"])
        pool.put(prefix_key(prompts[name][:n]), stream if name == "E" else seal(stream, os.urandom(32)))


def scenario(args) -> dict:
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(args.model)
    words = Path(args.text).read_text().split()
    ids = tok(" ".join(words[:3000]))["input_ids"]
    if len(ids) < 6 * args.prompt_tokens:
        raise SystemExit(f"--text has {len(ids)} tokens; the scenario needs {6 * args.prompt_tokens}")
    n = args.prompt_tokens
    # two different real-text prompts, and C / D for the store: D starts with all of C
    prompts = {"A": ids[:n], "B": ids[n:2 * n], "C": ids[2 * n:3 * n], "D": ids[2 * n:3 * n + n // 3],
               "E": ids[4 * n:5 * n], "F": ids[5 * n:6 * n]}  # E, F: forged store entries
    recv_port = free_port()
    proxy = FaultProxy(recv_port)
    store = work / "store"
    common = {"timeout_s": 20.0}
    cons_metrics, prod_metrics = work / "consumer.jsonl", work / "producer.jsonl"
    t0 = time.perf_counter()
    consumer = make_llm(args.model, "kv_consumer", {**common, "mode": "p2p", "peer_host": "127.0.0.1",
                        "peer_port": recv_port, "spool_path": str(work / "spool"), "metrics_path": str(cons_metrics)},
                        dtype=args.dtype, cores="0", prefix_caching=False, max_model_len=args.max_model_len)
    t1 = time.perf_counter()
    producer = make_llm(args.model, "kv_producer", {**common, "mode": "p2p", "policy": "none", "peer_host": "127.0.0.1",
                        "peer_port": proxy.port, "metrics_path": str(prod_metrics), "debug_dump_dir": str(work / "dump")},
                        dtype=args.dtype, cores="1", prefix_caching=False, max_model_len=args.max_model_len)
    t2 = time.perf_counter()
    cons_rec, prod_rec = Records(cons_metrics), Records(prod_metrics)
    steps: list[dict] = []

    def step(name: str, prompt: str, *, policy=None, zero=False, fault=None, plain_tokens=None) -> dict:
        if fault:
            proxy.arm(fault)
        p_params = {"kvtune_policy": policy} if policy else None
        p_tokens, p_s = generate(producer, prompts[prompt], plain_tokens or 1, p_params)
        c_params = {"kvtune_debug_zero_kv": True} if zero else None
        c_tokens, c_s = generate(consumer, prompts[prompt], args.gen_tokens, c_params)
        rec = {"name": name, "prompt": prompt, "policy": policy or "none", "zero": zero, "fault": fault,
               "producer_tokens": p_tokens, "producer_s": p_s, "tokens": c_tokens, "consumer_s": c_s,
               "saves": prod_rec.new(), "loads": cons_rec.new()}
        steps.append(rec)
        print(json.dumps({k: rec[k] for k in ("name", "producer_s", "consumer_s")}), flush=True)
        return rec

    step("canary", "A", plain_tokens=args.gen_tokens)
    step("lossy", "B", policy=args.lossy_policy, plain_tokens=args.gen_tokens)
    step("zero_control", "B", policy=args.lossy_policy, zero=True)
    step("corrupt", "A", fault="corrupt")
    step("after_corrupt", "B")
    step("drop", "A", fault="drop")
    step("after_drop", "B")
    plain = {name: generate(producer, prompts[name], args.gen_tokens)[0] for name in ("C", "D", "E", "F")}
    t3 = time.perf_counter()
    # store mode: one instance that both parks its prompts' KV in the store and fetches
    # prefixes, with a shared key: its own (sealed) streams load, forged entries are refused
    key_file = work / "kv.key"
    key_file.write_bytes(os.urandom(32))
    forge_store(store, prompts, args.block_size)
    store_metrics = work / "store.jsonl"
    both = make_llm(args.model, "kv_both", {**common, "mode": "store", "policy": args.store_policy,
                    "store_path": str(store), "metrics_path": str(store_metrics), "key_file": str(key_file)},
                    dtype=args.dtype, cores="0", prefix_caching=False, max_model_len=args.max_model_len)
    t4 = time.perf_counter()
    store_rec = Records(store_metrics)
    for name, prompt in (("store_miss", "C"), ("store_fetch", "D"), ("forged_unsealed", "E"), ("forged_other_key", "F")):
        tokens, secs = generate(both, prompts[prompt], args.gen_tokens)
        recs = store_rec.new()
        steps.append({"name": name, "prompt": prompt, "policy": args.store_policy, "tokens": tokens, "consumer_s": secs,
                      "plain_tokens": plain[prompt], "saves": [r for r in recs if r["event"] == "save"],
                      "loads": [r for r in recs if r["event"] == "load"]})
        print(json.dumps({"name": name, "consumer_s": secs}), flush=True)
    t5 = time.perf_counter()
    return {"prompts": prompts, "steps": steps, "proxy_log": proxy.log, "store": str(store),
            "timings": {"consumer_start_s": t1 - t0, "producer_start_s": t2 - t1, "p2p_steps_s": t3 - t2,
                        "store_start_s": t4 - t3, "store_steps_s": t5 - t4, "loadavg": os.getloadavg()}}


def serve(args) -> int:
    """One instance driven over stdin/stdout (JSON lines) by ``benchmarks/serving_e2e.py``.

    Requests: ``{"op": "generate", "ids": [...], "max_tokens": n, "params": {...},
    "prompt_logprobs": bool}`` (params: the request's ``kv_transfer_params``) -> ``{"tokens",
    "ttft_s", "total_s", "records", "prompt_logprobs"}`` (records: the connector's new metrics
    lines; prompt_logprobs: per prompt position the log-probability of the real token, None
    where the engine did not compute it, e.g. loaded KV); ``{"op": "quit"}``. The first line written is
    ``READY``. vLLM's own output goes to stderr (this process's stdout carries replies only).
    """
    reply = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # everything else (vLLM logs, engine processes) writes to stderr
    extra = json.loads(args.extra)
    llm = make_llm(args.model, args.role, extra, dtype=args.dtype, cores=args.cores,
                   prefix_caching=args.prefix_caching, max_model_len=args.max_model_len)
    records = Records(Path(extra["metrics_path"])) if extra.get("metrics_path") else None
    reply.write("READY\n")
    for line in sys.stdin:
        req = json.loads(line)
        if req.get("op") == "quit":
            break
        tokens, ttft, total, plp = generate_timed(llm, req["ids"], req["max_tokens"], req.get("params") or None,
                                                  prompt_logprobs=bool(req.get("prompt_logprobs")))
        reply.write(json.dumps({"tokens": tokens, "ttft_s": ttft, "total_s": total, "prompt_logprobs": plp,
                                "records": records.new() if records else []}) + "\n")
    return 0


def generate_timed(llm, ids: list[int], max_tokens: int, params: dict | None, *,
                   prompt_logprobs: bool = False) -> tuple[list[int], float, float, list | None]:
    """Greedy tokens, seconds to the first output token and to the last, through the engine's
    step loop (what ``LLM.generate`` does, with the first token timed), and with
    ``prompt_logprobs`` the log-probability of each real prompt token (None where not computed).
    Prompt logprobs keep the connector's loaded tokens (``skip_reading_prefix_cache=False``)."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    # detokenize=False: vLLM 0.32 crashes detokenizing the placeholder ids of prompt positions
    # it did not compute (the loaded ones); the ids are all we need
    extra = {"prompt_logprobs": 0, "skip_reading_prefix_cache": False, "detokenize": False} if prompt_logprobs else {}
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, output_kind=RequestOutputKind.CUMULATIVE,
                        extra_args={"kv_transfer_params": params} if params else None, **extra)
    engine = llm.llm_engine
    rid = f"bench-{time.monotonic_ns()}"
    t0 = time.perf_counter()
    engine.add_request(rid, {"prompt_token_ids": ids}, sp)
    ttft, tokens, plp = None, [], None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id != rid or not out.outputs:
                continue
            if ttft is None and len(out.outputs[0].token_ids):
                ttft = time.perf_counter() - t0
            if out.finished:
                tokens = list(out.outputs[0].token_ids)
                if prompt_logprobs and out.prompt_logprobs is not None:
                    plp = [None if d is None or tok not in d else float(d[tok].logprob)
                           for tok, d in zip(ids, out.prompt_logprobs)]
    return tokens, ttft, time.perf_counter() - t0, plp


def layouts(args) -> dict:
    """Per ISA of vLLM's CPU attention kernels this CPU runs (``vec``, ``vec16``, ``amx`` with
    AMX tiles): the block layout kvtune probes with the real cache-write kernel, and whether a
    request written by that kernel is gathered back exactly and scattered into the same bytes."""
    import torch
    from vllm import _custom_ops as ops

    from kvtune.serving.paged import gather_blocks, probe_layout, scatter_blocks

    isas = ["vec", "vec16"] + (["amx"] if torch.cpu._is_amx_tile_supported() else [])
    h, bs, d, nb, tokens, blocks = 3, 32, 64, 4, 80, [2, 0, 3]
    out = {}
    for isa in isas:
        def write(key, value, key_cache, value_cache, slots, isa=isa):
            ops.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, slots, isa)

        layout = probe_layout(write, kv_heads=h, block_size=bs, head_dim=d, dtype=torch.bfloat16)
        g = torch.Generator().manual_seed(0)
        k, v = (torch.randn(tokens, h, d, generator=g).to(torch.bfloat16) for _ in range(2))
        cache = torch.zeros(nb, h, bs, 2 * d, dtype=torch.bfloat16)
        view = cache.view(nb, h, 2 * bs, d)
        slots = torch.tensor([blocks[t // bs] * bs + t % bs for t in range(tokens)])
        write(k, v, view[:, :, :bs], view[:, :, bs:], slots)
        gk, gv = gather_blocks(cache, blocks, tokens, layout)
        other = torch.zeros_like(cache)
        scatter_blocks(other, blocks[:2], gk, gv, 0, 2 * bs, layout)
        same = bool(torch.equal(other[blocks[0]], cache[blocks[0]]) and torch.equal(other[blocks[1]], cache[blocks[1]]))
        out[isa] = {"layout": repr(layout), "gathered": bool(torch.equal(gk[0], k.transpose(0, 1))
                                                              and torch.equal(gv[0], v.transpose(0, 1))),
                    "scattered": same}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    sc = sub.add_parser("scenario", help="the connector test scenario")
    sc.add_argument("--model", required=True)
    sc.add_argument("--text", required=True)
    sc.add_argument("--work", required=True)
    sc.add_argument("--out", required=True)
    sc.add_argument("--dtype", default="bfloat16")
    sc.add_argument("--prompt-tokens", type=int, default=300)
    sc.add_argument("--gen-tokens", type=int, default=20)
    sc.add_argument("--lossy-policy", default="kivi-2")
    sc.add_argument("--store-policy", default="none")
    sc.add_argument("--block-size", type=int, default=128)
    sc.add_argument("--max-model-len", type=int, default=2048)
    ly = sub.add_parser("layouts", help="probe the paged block layout of every ISA this CPU runs")
    ly.add_argument("--out", required=True)
    sv = sub.add_parser("serve", help="one instance driven over stdin/stdout (benchmarks/serving_e2e.py)")
    sv.add_argument("--model", required=True)
    sv.add_argument("--role", required=True, choices=("kv_producer", "kv_consumer", "kv_both"))
    sv.add_argument("--extra", required=True, help="kv_connector_extra_config as JSON")
    sv.add_argument("--cores", default="0")
    sv.add_argument("--dtype", default="bfloat16")
    sv.add_argument("--prefix-caching", action="store_true")
    sv.add_argument("--max-model-len", type=int, default=4608)
    args = ap.parse_args(argv)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    if args.cmd == "serve":
        return serve(args)
    result = layouts(args) if args.cmd == "layouts" else scenario(args)
    tmp = Path(args.out + ".tmp")
    tmp.write_text(json.dumps(result))
    tmp.replace(args.out)
    # vLLM's engine processes are shut down at exit
    return 0


if __name__ == "__main__":
    sys.exit(main())
