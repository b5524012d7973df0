#!/usr/bin/env bash
# Create .venv-smg (or $KVFERRY_SMG_VENV): smg 1.13.0, the SGLang Model Gateway (a Rust binary in its wheel),
# for tests/test_smg.py and docs/deploy.md's smg section. A venv of its own: sglang-router 0.3.2 (in
# .venv-sglang) installs a command named `smg` too. Its dependencies are small (grpcio, pyyaml,
# setproctitle); about 20 s here (2026-12-05).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${KVFERRY_SMG_VENV:-.venv-smg}
SMG=${KVFERRY_SMG_PIN:-smg==1.13.0}
if [ -x "$VENV/bin/smg" ]; then
    exit 0
fi
"$PY" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q "$SMG"
"$VENV/bin/smg" launch --help >/dev/null
