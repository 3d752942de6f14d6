"""The codec worker threads (:mod:`kvtune.codecs.threads`)."""

from __future__ import annotations

import threading

import pytest

from kvtune.codecs import threads


def run_concurrently(body, args: list, codec_threads: int) -> None:
    """``body(arg)`` for every arg at once, one Python thread each, with ``codec_threads``
    codec threads; re-raises (as an assertion) the first failure of any of them."""
    before = threads.num_threads()
    threads.set_num_threads(codec_threads)
    errors: list[BaseException] = []

    def loop(arg) -> None:
        try:
            body(arg)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    try:
        workers = [threading.Thread(target=loop, args=(arg,)) for arg in args]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
    finally:
        threads.set_num_threads(before)
    assert not errors, repr(errors[0])


def test_concurrent_calls_of_different_sizes_share_the_pool_safely():
    """Calls with different task counts used to resize the shared pool by shutting it down
    while another call was about to submit to it: ``RuntimeError: cannot schedule new futures
    after shutdown`` (3 of 400 concurrent decodes of a 1-layer and a 3-layer stream)."""

    def body(size: int) -> None:
        for _ in range(400):
            assert threads.parallel_map(lambda x: 2 * x, list(range(size))) == [2 * i for i in range(size)]

    run_concurrently(body, [2, 3, 6, 2], codec_threads=4)


def test_parallel_map_raises_the_first_failing_items_error_in_order():
    def fn(x: int) -> int:
        if x in (3, 5):
            raise ValueError(f"item {x}")
        return x

    before = threads.num_threads()
    threads.set_num_threads(3)
    try:
        with pytest.raises(ValueError, match="item 3"):
            threads.parallel_map(fn, list(range(8)))
        assert threads.parallel_map(fn, [0, 1, 2]) == [0, 1, 2]
    finally:
        threads.set_num_threads(before)


@pytest.mark.parametrize("n, error", [(2.5, TypeError), ("2", TypeError), (True, TypeError), (0, ValueError)])
def test_set_num_threads_refuses_what_is_no_thread_count(n, error):
    before = threads.num_threads()
    with pytest.raises(error):
        threads.set_num_threads(n)
    assert threads.num_threads() == before


def test_concurrent_encodes_and_decodes_from_several_threads_give_the_serial_streams():
    """``encode_kv`` of a bit-packed policy writes every tensor straight into its stream from
    one kernel call per codec thread (the threads share a counter per call), ``decode_kv``
    decodes the same way and checks the stream CRC from per-tensor CRCs: four threads encoding
    and decoding different caches at once, through the shared codec pool, get exactly the
    streams and tensors of a serial run."""
    import torch

    from kvtune.codecs import PolicyConfig, decode_kv, encode_kv

    cfg = PolicyConfig.kivi(2)
    gen = torch.Generator().manual_seed(5)
    caches = [[(torch.randn(1, 2, t, 16, generator=gen).to(torch.bfloat16),
                torch.randn(1, 2, t, 16, generator=gen).to(torch.bfloat16)) for _ in range(3)] for t in (40, 72, 130, 9)]
    want = [encode_kv(kv, cfg) for kv in caches]
    decoded = [decode_kv(s) for s in want]

    def body(i: int) -> None:
        for _ in range(60):
            stream = encode_kv(caches[i], cfg)
            assert stream == want[i]
            for (k, v), (k2, v2) in zip(decode_kv(stream), decoded[i]):
                assert torch.equal(k, k2) and torch.equal(v, v2)

    run_concurrently(body, list(range(len(caches))), codec_threads=2)


_OPENMP_CHECK = """
import threading, time
import torch
from kvtune.codecs import threads

torch.set_num_threads(2)  # as the CLI's --threads does, before any codec thread exists
threads.set_num_threads(2)

def task(_):
    time.sleep(0.02)  # long enough that both threads take tasks
    return threading.get_ident(), torch.get_num_threads()

for _ in range(2):  # the pool's threads new, then reused
    seen = threads.parallel_map(task, range(8))
    assert len({ident for ident, _ in seen}) == 2, seen
    assert [count for _, count in seen] == [1] * 8, seen
    assert torch.get_num_threads() == 2
outside = []
other = threading.Thread(target=lambda: outside.append(torch.get_num_threads()))
other.start()
other.join()
assert outside == [2], outside
threads.set_num_threads(1)
assert [count for _, count in threads.parallel_map(task, range(3))] == [2] * 3
print("ok")
"""


def test_codec_threads_run_their_tasks_with_one_openmp_thread_each():
    """With two codec threads or more every task (the calling thread's too) sees one OpenMP
    thread, so torch ops inside it start no team of their own, also in threads that run their
    first torch op inside the task (torch then sets the thread's OpenMP count to
    ``torch.set_num_threads``' value); the calling thread's OpenMP count comes back after the
    call, and other threads' never change. One codec thread leaves the count alone. Runs in a
    fresh interpreter: the pool's threads must be new."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", _OPENMP_CHECK], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]
