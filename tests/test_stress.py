"""The stress workload end to end: clean runs verify every byte; injected faults are caught and localised."""

from __future__ import annotations

import importlib.util
import json
import multiprocessing
import threading
import time

import numpy as np
import pytest

from kvferry.layout.presets import get_preset
from kvferry.layout.spec import Layout
from kvferry.workload import WorkloadConfig, WorkloadResult, run_workload
from kvferry.workload.decode import DecodeLink, DecodeSide
from kvferry.workload.prefill import PrefillSide
from kvferry.workload.reuse import Held, announce_prefix
from kvferry.workload.sim import OutOfPages, RequestSpec, WorkloadSpec, build_schedule, pages_needed

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
    assert not _threads_left(before, within_s=0.5)


def _threads_left(before: set[threading.Thread], within_s: float) -> list[threading.Thread]:
    """The kvferry threads not in ``before`` still running ``within_s`` after the call (none: at once)."""
    give_up = time.monotonic() + within_s
    while (left := [t for t in set(threading.enumerate()) - before if t.name.startswith("kvferry-")]):
        if time.monotonic() > give_up:
            break
        time.sleep(0.01)
    return left


def test_deadline_while_decode_connects_leaves_no_thread_behind(monkeypatch: pytest.MonkeyPatch) -> None:
    """The deadline passes as the sides start (a loaded box): prefill says hello, sees "stop" and closes
    before decode's handshake reaches it. Decode reads no "stop" while it connects, so its connect must end
    by the run's deadline, not after the endpoint's 10 s handshake timeout: its two threads outlived the run
    by about 5 s (1 run in 40 of the test above, under 3 CPU hogs). Forced here: decode connects only once
    prefill has closed."""
    prefill_closed = threading.Event()
    close, connect = PrefillSide.close, DecodeLink.connect

    def close_then_tell(self: PrefillSide) -> None:
        close(self)
        prefill_closed.set()

    def connect_once_prefill_closed(self: DecodeLink, *args: object, **kwargs: object) -> None:
        assert prefill_closed.wait(30), "prefill never closed"
        connect(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(PrefillSide, "close", close_then_tell)
    monkeypatch.setattr(DecodeLink, "connect", connect_once_prefill_closed)  # local: decode is a thread here
    before = set(threading.enumerate())
    result = run_workload(small(timeout_s=0.5))
    assert result.error is not None and "deadline" in result.error, result.error
    assert not _threads_left(before, within_s=0.5)


@needs_nixl
@pytest.mark.nixl
@pytest.mark.parametrize("mode", ["push", "pull"])
def test_nixl_two_process_run_is_clean_and_reaps_its_processes(mode: str) -> None:
    result = run_workload(small(transport="nixl", mode=mode))
    assert_clean(result)
    assert result.to_dict()["mode"] == mode
    assert multiprocessing.active_children() == []


@needs_nixl
@pytest.mark.nixl
def test_nixl_two_process_run_catches_the_buffer0_fault() -> None:
    result = run_workload(small(transport="nixl", inject="buffer0-slots"))
    assert result.corrupted_pages > 0 and result.silent_corruptions == 0
    assert set(index_k_buffers()[1:]) <= set(result.corrupted_by_buffer)
    assert multiprocessing.active_children() == []


# -- --reuse-prefix: decode keeps each session's whole pages between turns ----------------------------------
# Turns add ~600 tokens, so every turn brings several new c4 pages after the kept ones; 256 MiB per side holds
# all four sessions' pages at once (no eviction: the figures below follow from the schedule alone).
REUSE = WorkloadSpec(num_sessions=4, num_turns=4, first_tokens=512, turn_tokens=600, max_tokens=4096)


def reuse(**overrides: object) -> WorkloadConfig:
    fields: dict[str, object] = {"workload": REUSE, "budget_bytes": 256 << 20, "reuse_prefix": True}
    return small(**{**fields, **overrides})


def expected_moved(layout: Layout, spec: WorkloadSpec) -> dict[int, tuple[int, int, int, int]]:
    """Per turn (pool pages moved, whole, bytes moved, whole), from the schedule: decode keeps, of each
    pool with pages of tokens and no window, the pages wholly before the prompt's last token."""
    prev: dict[int, int] = {}
    out: dict[int, list[int]] = {}
    for req in build_schedule(spec):
        row = out.setdefault(req.turn, [0, 0, 0, 0])
        for pool, n in pages_needed(layout, req.num_tokens).items():
            p = layout.pool(pool)
            kept = 0
            if req.session in prev and p.tokens_per_page and not p.window_tokens:
                kept = (prev[req.session] - 1) // p.tokens_per_page
            page_bytes = sum(b.page_bytes for b in p.buffers)
            row[0] += n - kept
            row[1] += n
            row[2] += (n - kept) * page_bytes
            row[3] += n * page_bytes
        prev[req.session] = req.num_tokens
    return {turn: (a, b, c, d) for turn, (a, b, c, d) in out.items()}


def buffer_pages(layout: Layout, spec: WorkloadSpec) -> int:
    """Buffer pages of every turn's whole prompt: what decode must check, kept pages included."""
    return sum(n * len(layout.pool(pool).buffers) for req in build_schedule(spec)
               for pool, n in pages_needed(layout, req.num_tokens).items())


def test_reuse_prefix_moves_only_what_decode_lacks_and_checks_the_kept_pages() -> None:
    config = reuse()
    result = run_workload(config)
    assert result.error is None and result.ok, result.first_failure
    assert result.requests == REUSE.num_requests and result.silent_corruptions == 0
    assert result.reuse["evictions"] == 0
    # Every position of every turn checked, the kept prefix pages too (they hold earlier turns' bytes).
    assert result.pages_verified == buffer_pages(config.layout(), REUSE)
    want = expected_moved(config.layout(), REUSE)
    got = {r["turn"]: (r["pages_moved"], r["pages_whole"], r["bytes_moved"], r["bytes_whole"])
           for r in result.per_turn}
    assert got == want
    assert all(moved < whole for moved, whole, _, _ in list(got.values())[1:])
    assert result.bytes == sum(r["bytes_moved"] for r in result.per_turn)
    assert [r["prefix_hits"] for r in result.per_turn] == [0] + [REUSE.num_sessions] * (REUSE.num_turns - 1)
    # Prefill sent both ways: the whole request (kvferry skips the prefix) and the suffix from its offset.
    assert result.reuse["whole_sends"] > 0 and result.reuse["suffix_sends"] > 0
    assert result.to_dict()["per_turn"][0]["moved_fraction"] == 1.0


def test_reuse_prefix_in_pull_mode_evicts_when_short_and_announces_tokens() -> None:
    # llama3_8b: one pool of pages of tokens, so decode announces its prefix as a token count; 48 MiB per
    # side holds about two sessions' pages, so decode evicts idle sessions and rechecks their pages first.
    config = reuse(preset="llama3_8b", knobs=(("num_layers", 2),), budget_bytes=48 << 20, mode="pull")
    assert announce_prefix(config.layout(), {"kv": 3}) == 48
    assert announce_prefix(get_preset("deepseek_v4", num_pages=8), {"c4": 2, "c128": 2}) == {"c4": 2, "c128": 2}
    result = run_workload(config)
    assert result.error is None and result.ok, result.first_failure
    assert result.reuse["evictions"] > 0 and result.reuse["pages_rechecked"] > 0
    assert result.pages_verified == buffer_pages(config.layout(), REUSE)
    assert sum(r["prefix_hits"] for r in result.per_turn) > 0
    assert result.bytes < sum(r["bytes_whole"] for r in result.per_turn)


def _overwrite_prefix(self: DecodeSide, spec: RequestSpec, new: dict[str, np.ndarray], held: Held
                      ) -> dict[str, int]:
    """A decode that forgets to say it holds the prefix: its kept pages are leased and written again."""
    pages, _ = held.joined(new, spec.index)
    self.link.announce(spec.request_id, pages)
    return {}


def _misplace_suffix(self: DecodeSide, spec: RequestSpec, new: dict[str, np.ndarray], held: Held
                     ) -> dict[str, int]:
    """A decode whose suffix pages go to the wrong places: after a prefix, the new pages rotated by one."""
    rotated = {p: np.roll(ids, 1) if p in held.pages else ids for p, ids in new.items()}
    self.link.announce(spec.request_id, rotated, prefix=announce_prefix(self.layout, held.counts))
    return held.counts


@pytest.mark.parametrize("fault", [_overwrite_prefix, _misplace_suffix], ids=["overwrite", "misplace"])
def test_reuse_prefix_byte_check_sees_overwritten_prefix_and_misplaced_suffix(
        monkeypatch: pytest.MonkeyPatch, fault: object) -> None:
    monkeypatch.setattr(DecodeSide, "_announce", fault)  # the local transport runs decode in this process
    result = run_workload(reuse())
    assert not result.ok and result.failed_requests == 0
    # kvferry wrote where it was told and its digests passed: only decode's byte check sees it, and only in
    # the pools decode keeps pages of (the sliding-window pool moves whole every turn).
    assert result.corrupted_pages > 0 and result.silent_corruptions == result.corrupted_pages
    assert {name.split(".")[0] for name in result.corrupted_by_buffer} <= {"c4", "c128"}


def test_stress_command_reports_moved_bytes_per_turn(capsys: pytest.CaptureFixture[str]) -> None:
    from kvferry.cli.main import main

    argv = ["stress", "--reuse-prefix", "--sessions", "3", "--turns", "3", "--first-tokens", "512",
            "--turn-tokens", "600", "--max-tokens", "4096", "--budget", "128MiB", "--transport", "local"]
    assert main([*argv, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["ok"] and data["reuse_prefix"] and [r["turn"] for r in data["per_turn"]] == [0, 1, 2]
    assert data["bytes"] == sum(r["bytes_moved"] for r in data["per_turn"])
    assert data["per_turn"][2]["bytes_moved"] < data["per_turn"][2]["bytes_whole"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "moved per turn" in out and "PASS" in out


@needs_nixl
@pytest.mark.nixl
@pytest.mark.parametrize("mode", ["push", "pull"])
def test_nixl_two_process_reuse_prefix_run_moves_what_decode_lacks(mode: str) -> None:
    config = reuse(transport="nixl", mode=mode)
    result = run_workload(config)
    assert result.error is None and result.ok, result.first_failure
    assert result.pages_verified == buffer_pages(config.layout(), REUSE)
    got = {r["turn"]: (r["pages_moved"], r["pages_whole"], r["bytes_moved"], r["bytes_whole"])
           for r in result.per_turn}
    assert got == expected_moved(config.layout(), REUSE)
    assert multiprocessing.active_children() == []
