#!/usr/bin/env bash
# Set up both engine venvs at once: .venv-vllm (scripts/setup-vllm.sh) and .venv-sglang
# (scripts/setup-sglang.sh). Both layer on .venv and write nothing outside their own venv, and most of
# their time is pip waiting on downloads and disk, so side by side on 2 cores they take about as long as
# the longer one alone: 115 s on a fresh clone against about 235 s one after the other (2026-12-03).
# A venv already set up is left alone (each script checks its own imports first). Each line of output
# says whose it is; the exit status is 1 when either failed, and its log says why.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || bash scripts/setup.sh

run() {   # NAME CMD...: the command's output, each line prefixed, and its own exit status
    local name=$1
    shift
    set +e
    "$@" 2>&1 | sed -u "s/^/[$name] /"
    local rc=${PIPESTATUS[0]}
    set -e
    [ "$rc" = 0 ] || echo "[$name] failed with exit status $rc"
    return "$rc"
}

START=$SECONDS
run setup-vllm bash scripts/setup-vllm.sh &
VLLM=$!
run setup-sglang bash scripts/setup-sglang.sh &
SGLANG=$!
RC=0
wait "$VLLM" || RC=1
wait "$SGLANG" || RC=1
echo "setup-engines: $([ "$RC" = 0 ] && echo done || echo FAILED) in $((SECONDS - START)) s"
exit "$RC"
