"""mobo never hangs on the lock file torch leaves when a process is killed while BoTorch's fused
qLogEHVI kernel is being built or loaded (kvtune.search.optimizers.fused_kernel)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from kvtune.evaluate import assets
from kvtune.search.optimizers import fused_kernel

ROOT = Path(__file__).resolve().parents[1]

# The first model-based ask of mobo on a small synthetic problem. The C++ compile itself is replaced by an
# error (what a machine without a compiler gives) so that the test measures the lock handling, not gcc.
FIRST_ASK = textwrap.dedent("""
    import time, warnings
    import torch.utils.cpp_extension as ce
    assert hasattr(ce, "_write_ninja_file_and_build_library")
    def no_compiler(**kw):
        raise RuntimeError("no C++ compiler in this test")
    ce._write_ninja_file_and_build_library = no_compiler
    from kvtune.search.optimizers import make_optimizer
    from kvtune.search.optimizers.replay import ReplayObjective
    from kvtune.search.optimizers.synthetic import synthetic_problem
    space, table = synthetic_problem("small")
    replay = ReplayObjective(table)
    opt = make_optimizer("mobo", space, ratios=replay.ratios(space), n_init=3, maxiter=20, mc_samples=8, prescreen=16)
    for _ in range(3):
        c = opt.ask()
        opt.tell(c, replay.evaluate(c))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        c = opt.ask()
    print("ASKED", c.index)
    for w in caught:
        print("WARNING", w.message)
""")


def test_mobo_first_model_step_does_not_wait_on_a_stale_build_lock(tmp_path):
    """A stale ``lock`` in the build folder used to make every later mobo run wait forever."""
    env = {**os.environ, assets.CACHE_ENV: str(tmp_path / "cache"), "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    root = subprocess.run([sys.executable, "-c", "from kvtune.search.optimizers.fused_kernel import extensions_root as r; print(r())"],
                          env=env, capture_output=True, text=True, check=True).stdout.strip()
    stale = Path(root) / fused_kernel.EXTENSION / "lock"
    stale.parent.mkdir(parents=True)
    stale.write_text("")
    env["TORCH_EXTENSIONS_DIR"] = root  # where torch builds without kvtune's help, too
    try:
        proc = subprocess.run([sys.executable, "-c", FIRST_ASK], env=env, capture_output=True, text=True, timeout=180)
    except subprocess.TimeoutExpired:
        pytest.fail(f"mobo's first model-based ask waited on {stale} for 180 s")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "ASKED" in proc.stdout and not stale.exists()
    assert f"WARNING removed {stale}: a torch extension build lock left by a killed process" in proc.stdout


def test_a_build_lock_held_too_long_falls_back_to_pure_python(tmp_path, monkeypatch):
    """Another kvtune process holding the build for longer than the timeout: pure-Python path, with a warning."""
    import fcntl

    from botorch.acquisition.multi_objective import logei

    monkeypatch.setenv(assets.CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.setattr(logei, "_load_attempted", False)
    monkeypatch.setattr(logei, "_C", None)
    calls = []
    monkeypatch.setattr(logei, "_try_load_fused_kernel", lambda: calls.append("load"))
    root = fused_kernel.extensions_root()
    root.mkdir(parents=True)
    with open(root / f"{fused_kernel.EXTENSION}.kvtune-lock", "a") as other:
        fcntl.flock(other, fcntl.LOCK_EX)  # "another process" (a separate open file description)
        start = time.monotonic()
        with pytest.warns(UserWarning, match=r"kvtune-lock for 0 s .* uses BoTorch's pure-Python path"):
            assert fused_kernel.load_fused_kernel(timeout=0.3) is False
        assert time.monotonic() - start < 5
    assert logei._load_attempted and calls == []  # BoTorch will not try (and wait) again in this process
    assert fused_kernel.load_fused_kernel() is False  # and kvtune does not retry either
