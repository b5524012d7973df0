#!/usr/bin/env bash
# Create .venv-sglang: SGLang 0.5.23's disaggregation layer on a CPU torch, plus kvferry[nixl,dev].
#
# A plain `pip install sglang==0.5.23` pulls a CUDA torch, sglang-kernel, flashinfer and ~4.5 GB of
# nvidia wheels. The transfer layer (disaggregation/*, mem_cache pools, plugins) needs none of them, so:
# CPU torch first, sglang with --no-deps, then only the packages its imports ask for, every one under a
# constraints file that holds torch where it is (an unpinned torchvision silently swaps in a CUDA torch).
# Time on a 2-core machine, empty venv to done: 1.5 min idle, 4.8 min under load (docs/sglang.md).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${KVFERRY_SGLANG_VENV:-.venv-sglang}
TORCH=${KVFERRY_TORCH-torch==2.13.0}
PIP="$VENV/bin/python -m pip"
if [ ! -x "$VENV/bin/python" ]; then
    "$PY" -m venv "$VENV"
fi
$PIP install -q --upgrade pip >/dev/null 2>&1 || true
# 1. The CPU build of torch (PyPI's default wheel for Linux is a CUDA build). Where the CPU wheel is not
#    already on a local index, point KVFERRY_TORCH_INDEX at https://download.pytorch.org/whl/cpu.
if ! "$VENV/bin/python" -c "import torch" >/dev/null 2>&1; then
    $PIP install -q "$TORCH" ${KVFERRY_TORCH_INDEX:+--extra-index-url "$KVFERRY_TORCH_INDEX"}
fi
CONSTRAINTS=$(mktemp)
trap 'rm -f "$CONSTRAINTS"' EXIT
echo "torch==$("$VENV/bin/python" -c 'import torch; print(torch.__version__)')" >"$CONSTRAINTS"
# 2. SGLang itself, without its CUDA dependency tree.
$PIP install -q --no-deps sglang==0.5.23
# 3. What sglang.srt.disaggregation, mem_cache and plugins import, torch held in place.
$PIP install -q -c "$CONSTRAINTS" numpy pyzmq msgspec requests psutil setproctitle pydantic fastapi uvicorn \
    orjson pybase64 "triton==3.8.0" pillow tqdm IPython aiohttp sentencepiece compressed-tensors gguf \
    "apache-tvm-ffi==0.1.11" "openai==2.8.0" partial-json-parser einops prometheus_client dill
# 4. Packages whose metadata would drag torch along: no deps, their own small deps by hand.
$PIP install -q --no-deps "transformers==5.19.0" "tokenizers==0.23.2" "torchvision==0.28.0"
$PIP install -q -c "$CONSTRAINTS" huggingface_hub safetensors regex pyyaml
# 5. PyPI's torchvision is a CUDA build whose fake-op registrations fail against a CPU torch
#    ("operator torchvision::nms does not exist"); SGLang's configs import it. An empty module in its
#    place is enough for everything the transfer layer touches.
META=$("$VENV/bin/python" - <<'PY'
import importlib.util, pathlib
spec = importlib.util.find_spec("torchvision")
print(pathlib.Path(spec.origin).parent / "_meta_registrations.py")
PY
)
echo "# Emptied by scripts/setup-sglang.sh: the CUDA wheel's fake ops do not exist on a CPU torch." >"$META"
# 6. NIXL and kvferry itself (editable, with the dev tools).
$PIP install -q -c "$CONSTRAINTS" "nixl==1.5.1"
$PIP install -q -c "$CONSTRAINTS" -e ".[nixl,dev]"
"$VENV/bin/python" -c "import torch, sglang.srt.disaggregation.nixl.conn, sglang.srt.disaggregation.decode, sglang.srt.mem_cache.deepseek_v4_memory_pool, sglang.srt.plugins, kvferry; print('sglang ok, torch', torch.__version__)"
