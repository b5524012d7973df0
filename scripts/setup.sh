#!/usr/bin/env bash
# Create .venv and install kvferry with NIXL, Mooncake's Transfer Engine and the dev tools.
#
# The Mooncake wheel links system libraries it does not bundle: libibverbs, librdmacm, libnuma (every
# InfiniBand/RoCE host has them) and libcurl. Where one is missing and apt-get can run (root, or sudo
# without a password), this installs them (Debian/Ubuntu names; ~12 s on a fresh machine: apt-get update
# ~8 s, the install ~5 s). Elsewhere it says what is missing and the Mooncake tests skip.
# KVFERRY_SYSTEM_PACKAGES=0 never touches the system.
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

missing_libs() {
    local lib known
    known=$(ldconfig -p 2>/dev/null || /sbin/ldconfig -p 2>/dev/null || true)   # grep -q in a pipe: SIGPIPE
    for lib in libibverbs.so.1 librdmacm.so.1 libnuma.so.1 libcurl.so.4; do
        grep -q "$lib" <<<"$known" || echo "$lib"
    done
}
if [ "${KVFERRY_SYSTEM_PACKAGES:-1}" != 0 ] && [ -n "$(missing_libs)" ]; then
    SUDO=""
    [ "$(id -u)" = 0 ] || { command -v sudo >/dev/null && sudo -n true 2>/dev/null && SUDO="sudo -n"; }
    if command -v apt-get >/dev/null && { [ "$(id -u)" = 0 ] || [ -n "$SUDO" ]; }; then
        echo "setup: installing the system libraries Mooncake's Transfer Engine needs ($(missing_libs | tr '\n' ' '))"
        $SUDO apt-get update -qq >/dev/null
        CURL=libcurl4
        apt-cache show libcurl4t64 >/dev/null 2>&1 && CURL=libcurl4t64   # Ubuntu 24.04's name
        DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq libibverbs1 librdmacm1 libnuma1 "$CURL" >/dev/null
    else
        echo "setup: missing $(missing_libs | tr '\n' ' ')and no apt-get to run as root: the Mooncake" \
             "transport cannot import here (its tests skip); install libibverbs1 librdmacm1 libnuma1 libcurl4"
    fi
fi
.venv/bin/python -m pip install -q -e ".[nixl,dev,metrics,mooncake]"
