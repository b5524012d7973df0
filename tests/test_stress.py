"""The stress workload end to end: clean runs verify every byte; injected faults are caught and localised."""

from __future__ import annotations

import importlib.util
import multiprocessing
import threading
import time

import pytest

from kvferry.layout.presets import get_preset
from kvferry.workload import WorkloadConfig, WorkloadResult, run_workload
from kvferry.workload.sim import OutOfPages, WorkloadSpec

needs_nixl = pytest.mark.skipif(importlib.util.find_spec("nixl") is None, reason="nixl is not installed")

# CI size: a dozen sessions, three turns, 128 MiB per side; prompts kept short so many are in flight.
SMALL = WorkloadSpec(num_sessions=12, num_turns=3, first_tokens=512, turn_tokens=128, max_tokens=4096)


def small(**overrides: object) -> WorkloadConfig:
    fields: dict[str, object] = {"workload": SMALL, "budget_bytes": 128 << 20, "transport": "local",
                                 "timeout_s": 120.0}
    fields.update(overrides)
    return WorkloadConfig(**fields)  # type: ignore[arg-type]


def assert_clean(result: WorkloadResult) -> None:
    assert result.error is None, result.error
    assert result.requests == result.requests_expected == SMALL.num_requests
    assert result.failed_requests == 0, result.first_failure
    assert result.corrupted_pages == 0 and result.corrupted_by_buffer == {}
    assert result.pages_verified > 0 and result.bytes > 0 and result.gbps > 0
    assert 0 < result.p50_ms <= result.p99_ms
    assert result.ok


def index_k_buffers(preset: str = "deepseek_v4") -> list[str]:
    layout = get_preset(preset, num_pages=8)
    return [b.name for b in layout.buffers if b.kind == "index_k"]


@pytest.mark.parametrize("mode", ["push", "pull"])
def test_local_run_is_clean(mode: str) -> None:
    result = run_workload(small(mode=mode))
    assert_clean(result)
    assert result.mode == mode
    assert result.layout["pools"][0]["pool"] == "c4"
    assert {r["kind"] for r in result.layout["pools"][0]["roles"]} == {"kv", "index_k"}


def test_buffer0_slot_fault_is_caught_and_named_at_the_index_k_buffers() -> None:
    result = run_workload(small(inject="buffer0-slots"))
    assert not result.ok
    assert result.corrupted_pages > 0
    assert result.silent_corruptions == 0, "full digests must fail every corrupted request"
    assert result.failed_requests > 0 and "PageMismatchError" in result.failures
    hit = list(result.corrupted_by_buffer)
    idx = index_k_buffers()
    # Buffer 0's slot count is right for every KV buffer before the first index-K buffer, and for that
    # one too (its block starts after buffers of buffer 0's size); from the second on, rows go astray.
    assert hit[0] == idx[1], hit[:3]
    assert set(idx[1:]) <= set(hit)
    assert not any(name.startswith("c4.kv.") for name in hit)


def test_flip_fault_is_localised_to_its_buffer() -> None:
    result = run_workload(small(inject="flip:c4.idx.L10"))
    assert list(result.corrupted_by_buffer) == ["c4.idx.L10"]
    assert result.failed_requests == SMALL.num_requests
    assert result.silent_corruptions == 0


def test_pull_mode_refuses_a_write_fault() -> None:
    from kvferry.errors import UsageError

    with pytest.raises(UsageError, match="in pull mode prefill writes nothing"):
        small(mode="pull", inject="buffer0-slots")


def test_workload_too_large_for_capacity_is_refused_before_starting() -> None:
    with pytest.raises(OutOfPages, match="largest prompt"):
        run_workload(small(budget_bytes=48 << 20, workload=WorkloadSpec(num_sessions=2, num_turns=2,
                                                                         first_tokens=8000)))


def test_deadline_ends_the_run_and_leaves_no_thread_behind() -> None:
    before = set(threading.enumerate())
    started = time.monotonic()
    result = run_workload(small(timeout_s=0.5, workload=WorkloadSpec(num_sessions=80, num_turns=40,
                                                                      max_tokens=4096)))
    assert time.monotonic() - started < 15
    assert result.error is not None and "deadline" in result.error
    assert not result.ok
    time.sleep(0.5)
    assert not [t for t in set(threading.enumerate()) - before if t.name.startswith("kvferry-")]


@needs_nixl
@pytest.mark.nixl
@pytest.mark.slow
@pytest.mark.parametrize("mode", ["push", "pull"])
def test_nixl_two_process_run_is_clean_and_reaps_its_processes(mode: str) -> None:
    result = run_workload(small(transport="nixl", mode=mode))
    assert_clean(result)
    assert result.to_dict()["mode"] == mode
    assert multiprocessing.active_children() == []


@needs_nixl
@pytest.mark.nixl
@pytest.mark.slow
def test_nixl_two_process_run_catches_the_buffer0_fault() -> None:
    result = run_workload(small(transport="nixl", inject="buffer0-slots"))
    assert result.corrupted_pages > 0 and result.silent_corruptions == 0
    assert set(index_k_buffers()[1:]) <= set(result.corrupted_by_buffer)
    assert multiprocessing.active_children() == []
