"""Shared fixtures and strategies for kvferry's tests."""

from __future__ import annotations

import ctypes
import os
import sys

import numpy as np
import pytest
from hypothesis import HealthCheck, settings

from kvferry import Buffer, KVMemory, Layout, Pool, TransferPlan

# CI runs on 2 cores: keep property tests meaningful but bounded; `KVFERRY_HYPOTHESIS=thorough` digs deeper.
settings.register_profile("ci", max_examples=60, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile("thorough", max_examples=1000, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.load_profile(os.environ.get("KVFERRY_HYPOTHESIS", "ci"))


def memmove_plan(plan: TransferPlan) -> None:
    """Execute a plan with plain memmove, the simplest possible executor (no transport involved)."""
    for (s, n, _), (d, _, _) in zip(plan.src_descs.tolist(), plan.dst_descs.tolist()):
        ctypes.memmove(d, s, n)


def fill_random(mem: KVMemory, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    for buf in mem.layout.buffers:
        arr = mem.array(buf.name)
        arr[...] = rng.integers(0, 256, size=arr.shape, dtype=np.uint8)


def snapshot(mem: KVMemory) -> dict[str, np.ndarray]:
    return {b.name: mem.array(b.name).copy() for b in mem.layout.buffers}


@pytest.fixture
def salad_layout() -> Layout:
    """The motivating case: a c4 pool whose bf16 index-K buffer has fewer pages than its KV buffer."""
    return Layout([
        Pool("c4", [
            Buffer("c4.kv.L0", 64 * 584, 40, "fp8_e4m3", "kv", 0),
            Buffer("c4.idx.L0", 64 * 256, 24, "bf16", "index_k", 0),
            Buffer("c4.kv.L1", 64 * 584, 40, "fp8_e4m3", "kv", 1),
            Buffer("c4.idx.L1", 64 * 256, 24, "bf16", "index_k", 1),
        ], tokens_per_page=256),
        Pool("c128", [Buffer("c128.kv.L0", 2 * 584, 16, "fp8_e4m3", "kv", 0)], tokens_per_page=256),
    ])


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """Tables the engine suites collected while they ran (tests/test_sglang.py's backend comparison, the SGLang
    server tests' timings), printed once at the end whatever order the tests ran in."""
    for module in ("tests.test_sglang", "tests.test_sglang_server", "tests.test_sglang_server_faults",
                   "tests.test_sglang_server_page_sizes"):
        lines = getattr(sys.modules.get(module), "report_lines", lambda: [])()
        if lines:
            terminalreporter.section(f"{module.rsplit('.', 1)[1]}: report")
            for line in lines:
                terminalreporter.write_line(line)
