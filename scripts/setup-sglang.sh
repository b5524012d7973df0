#!/usr/bin/env bash
# Create .venv-sglang: SGLang 0.5.23's disaggregation layer on a CPU torch, plus kvferry[nixl,dev].
#
# A plain `pip install sglang==0.5.23` pulls a CUDA torch, sglang-kernel, flashinfer and ~4.5 GB of
# nvidia wheels. The transfer layer (disaggregation/*, mem_cache pools, plugins) needs none of them, so:
# CPU torch first, sglang with --no-deps, then only the packages its imports ask for, every one under a
# constraints file that holds torch where it is (an unpinned torchvision silently swaps in a CUDA torch).
#
# Where the core venv (.venv, scripts/setup.sh: torch, nixl, numpy, pytest, kvferry itself) exists, as
# under `make test`, this venv layers on it instead of installing those again: a .pth file adds .venv's
# site-packages behind this venv's own, and every package there is held at its version. pip never
# changes .venv from here (it does not uninstall outside its own environment); what this venv installs
# shadows .venv, never the reverse. KVFERRY_SGLANG_BASE="" builds a standalone venv instead.
# Each step prints the seconds since the start (docs/sglang.md has the timings).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${KVFERRY_SGLANG_VENV:-.venv-sglang}
BASE=${KVFERRY_SGLANG_BASE-.venv}
TORCH=${KVFERRY_TORCH-torch==2.13.0}
PIP="$VENV/bin/python -m pip"
START=$SECONDS
step() { echo "setup-sglang: $1 (at $((SECONDS - START)) s)"; }
# shellcheck source=scripts/venv-layer.sh
source scripts/venv-layer.sh   # site_of, layer_on

if [ -x "$VENV/bin/python" ] \
        && "$VENV/bin/python" -c "import sglang, kvferry, sglang_router, sgl_kernel" >/dev/null 2>&1; then
    exit 0   # set up already (as setup-vllm.sh checks its own)
fi
if [ ! -x "$VENV/bin/python" ]; then
    "$PY" -m venv "$VENV"
fi
CONSTRAINTS=$(mktemp)
trap 'rm -f "$CONSTRAINTS"' EXIT
LAYERED=0
if layer_on "$VENV" "$BASE" "import torch, nixl, kvferry"; then
    "$BASE/bin/python" -m pip freeze --exclude-editable 2>/dev/null | grep -v '^#' >"$CONSTRAINTS"
    LAYERED=1
    step "layered on $BASE (torch, nixl, kvferry from there)"
else
    # The CPU build of torch (PyPI's default wheel for Linux is a CUDA build). Where the CPU wheel is not
    # already on a local index, point KVFERRY_TORCH_INDEX at https://download.pytorch.org/whl/cpu.
    if ! "$VENV/bin/python" -c "import torch" >/dev/null 2>&1; then
        $PIP install -q "$TORCH" ${KVFERRY_TORCH_INDEX:+--extra-index-url "$KVFERRY_TORCH_INDEX"}
    fi
    echo "torch==$("$VENV/bin/python" -c 'import torch; print(torch.__version__)')" >"$CONSTRAINTS"
    step "torch installed"
fi
# 1. SGLang itself without its CUDA dependency tree, and the packages whose metadata would drag torch
#    along (their own small deps come in step 2).
$PIP install -q --no-deps sglang==0.5.23 "transformers==5.19.0" "tokenizers==0.23.2" "torchvision==0.28.0"
step "sglang, transformers, tokenizers, torchvision installed (no deps)"
# 2. What sglang.srt.disaggregation, mem_cache and plugins import, torch held in place; NIXL; and kvferry
#    itself (editable, with the dev tools) unless the core venv already provides it.
KVFERRY=()
if [ "$LAYERED" = 0 ]; then
    KVFERRY=("nixl==1.5.1" -e ".[nixl,dev,metrics]")
fi
$PIP install -q -c "$CONSTRAINTS" numpy pyzmq msgspec requests psutil setproctitle pydantic fastapi uvicorn \
    orjson pybase64 "triton==3.8.0" pillow tqdm IPython aiohttp sentencepiece compressed-tensors gguf \
    "apache-tvm-ffi==0.1.11" "openai==2.8.0" partial-json-parser einops prometheus_client dill \
    huggingface_hub safetensors regex pyyaml "${KVFERRY[@]}"
step "import deps installed"
# 2b. What a running server imports beyond the transfer layer (launch_server, the tokenizer manager,
#     grammar backends, the HTTP front end), and SGLang's router for PD serving
#     (`python -m sglang_router.launch_router --pd-disaggregation --mini-lb`). tests/test_sglang_server.py
#     starts real servers with these.
$PIP install -q -c "$CONSTRAINTS" anthropic "blobfile==3.0.0" easydict interegular \
    python-multipart "prometheus-client>=0.20.0" uvloop watchfiles xxhash zstandard tiktoken nvidia-ml-py \
    py-spy ninja scipy "llguidance>=1.7.6,<2" "xgrammar==0.2.7" "openai-harmony==0.0.4" jsonschema soundfile \
    "sglang-router==0.3.2"
step "server deps and sglang-router installed"
# 3. PyPI's torchvision is a CUDA build whose fake-op registrations fail against a CPU torch
#    ("operator torchvision::nms does not exist"); SGLang's configs import it. An empty module in its
#    place is enough for everything the transfer layer touches.
META=$("$VENV/bin/python" - <<'PY'
import importlib.util, pathlib
spec = importlib.util.find_spec("torchvision")
print(pathlib.Path(spec.origin).parent / "_meta_registrations.py")
PY
)
echo "# Emptied by scripts/setup-sglang.sh: the CUDA wheel's fake ops do not exist on a CPU torch." >"$META"
# 4. The project's `sgl_kernel` stand-in (tests/sgl_kernel_standin, docs/sglang.md): SGLang's CPU path imports
#    sgl_kernel at start-up and PyPI has no CPU build of it. A .pth line, so it follows the checkout.
echo "$(pwd -P)/tests/sgl_kernel_standin" >"$(site_of "$VENV")/_kvferry_sgl_kernel_standin.pth"
"$VENV/bin/python" -c "import sgl_kernel, sglang_router; assert sgl_kernel.STANDIN"
"$VENV/bin/python" -c "import torch, sglang.srt.disaggregation.nixl.conn, sglang.srt.disaggregation.decode, sglang.srt.mem_cache.deepseek_v4_memory_pool, sglang.srt.plugins, kvferry; print('sglang ok, torch', torch.__version__)"
step "done"
