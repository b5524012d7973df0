#!/usr/bin/env bash
# Create .venv and install kvferry with NIXL and the dev tools.
#
# `nixl` depends on torch. Unpinned, pip resolves a CUDA build of several GB; on a CPU-only machine a
# CPU build of torch is all NIXL's host-memory path needs, so it is installed first. Override with
# KVFERRY_TORCH="torch==X" (or KVFERRY_TORCH="" to keep what the environment resolves).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
TORCH=${KVFERRY_TORCH-torch==2.13.0}
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
if [ -n "$TORCH" ] && ! .venv/bin/python -c "import torch" >/dev/null 2>&1; then
    .venv/bin/python -m pip install -q "$TORCH"
fi
.venv/bin/python -m pip install -q -e ".[nixl,dev,metrics]"
