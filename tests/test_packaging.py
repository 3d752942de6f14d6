"""A regular (non-editable) install carries the bundled search spaces and presets.

The spaces used to live next to the package (``search_spaces/`` at the repository root), so a
``pip install .`` could not find ``--space default``. This builds the wheel from a copy of the
sources (about 5 s), checks its members, installs it into a folder and loads the spaces from
there, in a process started outside the repository.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SPACES = ("default.yaml", "full.yaml", "presets.yaml")


def _build_wheel(tmp_path: Path) -> Path:
    src = tmp_path / "src"
    shutil.copytree(ROOT / "kvtune", src / "kvtune", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    out = tmp_path / "dist"
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", str(src), "--no-deps", "--no-build-isolation",
                           "--disable-pip-version-check", "-q", "-w", str(out)], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    (wheel,) = out.glob("kvtune-*.whl")
    return wheel


def test_the_wheel_ships_the_spaces_and_an_install_loads_them(tmp_path):
    wheel = _build_wheel(tmp_path)
    with zipfile.ZipFile(wheel) as zf:
        members = set(zf.namelist())
    assert {f"kvtune/search/spaces/{name}" for name in SPACES} <= members
    site = tmp_path / "site"
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--disable-pip-version-check", "-q",
                           "--target", str(site), str(wheel)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    probe = ("import kvtune, kvtune.search.space as s, kvtune.codecs.presets as p; "
             "print(kvtune.__file__); print(s.SPACES_DIR); print(p.PRESETS_PATH); "
             "print(len(s.load_space('default')), len(s.load_space('presets')), len(p.load_presets(skip_unavailable=True)))")
    env = {**os.environ, "PYTHONPATH": str(site), "OMP_NUM_THREADS": "1"}
    run = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=tmp_path, env=env,
                         timeout=300)
    assert run.returncode == 0, run.stderr
    init, spaces_dir, presets_path, counts = run.stdout.strip().splitlines()
    assert Path(init).is_relative_to(site) and Path(spaces_dir) == site / "kvtune" / "search" / "spaces"
    assert Path(presets_path) == site / "kvtune" / "search" / "spaces" / "presets.yaml"
    assert counts.split()[:2] == ["358", "12"] and int(counts.split()[2]) >= 6
