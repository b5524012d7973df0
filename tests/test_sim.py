"""The workload model: page allocators, sessions and schedules, page content and its check."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvferry.errors import LayoutError
from kvferry.layout import Buffer, Layout, Pool, shape_difference
from kvferry.layout.presets import get_preset
from kvferry.workload.sim import (
    OutOfPages,
    PageAllocator,
    WorkloadSpec,
    build_schedule,
    check_pages,
    fill_pages,
    page_keys,
    pages_needed,
    session_tokens,
    windows_for,
)


# -- allocator ---------------------------------------------------------------------------------------------
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 12)), max_size=80), st.integers(0, 3))
def test_allocator_never_hands_out_a_live_page(ops: list[tuple[bool, int]], seed: int) -> None:
    alloc = PageAllocator(40, seed=seed)
    live: list[np.ndarray] = []
    for do_alloc, n in ops:
        if do_alloc and alloc.can_allocate(n):
            pages = alloc.allocate(n)
            held = np.concatenate(live) if live else np.zeros(0, dtype=np.int64)
            assert len(np.unique(pages)) == n
            assert not np.isin(pages, held).any()
            assert ((pages >= 0) & (pages < 40)).all()
            live.append(pages)
        elif live:
            alloc.free(live.pop(n % len(live)))
        assert alloc.num_live == sum(len(p) for p in live)


def test_allocator_reuses_freed_pages_after_exhaustion() -> None:
    alloc = PageAllocator(8)
    first = alloc.allocate(8)
    assert not alloc.can_allocate(1)
    with pytest.raises(OutOfPages, match="1 pages asked, 0 free of 8"):
        alloc.allocate(1)
    alloc.free(first[:3])
    again = alloc.allocate(3)
    assert sorted(again) == sorted(first[:3])


def test_allocator_fragments_runs_when_pages_are_freed_out_of_order() -> None:
    alloc = PageAllocator(64)
    chunks = [alloc.allocate(4) for _ in range(16)]
    for chunk in chunks[::2]:  # every other request finishes first
        alloc.free(chunk)
    pages = alloc.allocate(12)
    breaks = int((np.diff(pages) != 1).sum())
    assert breaks >= 2, f"expected fragmented runs, got {pages}"


def test_allocator_refuses_double_free_and_foreign_pages() -> None:
    alloc = PageAllocator(8)
    pages = alloc.allocate(2)
    alloc.free(pages)
    with pytest.raises(ValueError, match="not live"):
        alloc.free(pages)
    with pytest.raises(ValueError, match="not live or repeated"):
        alloc.free(np.array([5, 5]))


def test_allocators_with_different_seeds_hand_out_different_pages() -> None:
    a, b = PageAllocator(256, seed=1), PageAllocator(256, seed=2)
    assert not np.array_equal(a.allocate(16), b.allocate(16))


# -- sessions ----------------------------------------------------------------------------------------------
def test_sessions_grow_turn_by_turn_within_limits() -> None:
    spec = WorkloadSpec(num_sessions=30, num_turns=6, max_tokens=4000)
    tokens = session_tokens(spec)
    assert tokens.shape == (30, 6)
    assert (np.diff(tokens, axis=1) >= 0).all()
    assert tokens.min() >= spec.min_tokens and tokens.max() <= 4000
    assert (tokens[:, -1] > tokens[:, 0]).mean() > 0.9  # prompts really extend


def test_schedule_is_turn_major_complete_and_deterministic() -> None:
    spec = WorkloadSpec(num_sessions=12, num_turns=3, seed=7)
    schedule = build_schedule(spec)
    assert len(schedule) == spec.num_requests
    assert [r.index for r in schedule] == list(range(36))
    assert [r.turn for r in schedule] == sorted(r.turn for r in schedule)
    assert {(r.session, r.turn) for r in schedule} == {(s, t) for s in range(12) for t in range(3)}
    assert len({r.request_id for r in schedule}) == 36
    assert build_schedule(spec) == schedule
    assert build_schedule(WorkloadSpec(num_sessions=12, num_turns=3, seed=8)) != schedule


def test_workload_spec_refuses_nonsense() -> None:
    with pytest.raises(ValueError, match="num_sessions"):
        WorkloadSpec(num_sessions=0)
    with pytest.raises(ValueError, match="min_tokens"):
        WorkloadSpec(min_tokens=100, max_tokens=10)


# -- pages per pool ----------------------------------------------------------------------------------------
def _mixed_layout() -> Layout:
    return Layout([
        Pool("full", [Buffer("L0.k", 64, 32)], tokens_per_page=16),
        Pool("swa", [Buffer("swa.L0", 64, 32)], tokens_per_page=64),
        Pool("state", [Buffer("L1.ssm", 128, 4, kind="state")], tokens_per_page=None),
    ])


@pytest.mark.parametrize(("tokens", "full", "swa"), [(1, 1, 1), (16, 1, 1), (17, 2, 1), (128, 8, 2),
                                                      (129, 9, 3), (192, 12, 2), (1000, 63, 3)])
def test_pages_needed_per_pool_kind(tokens: int, full: int, swa: int) -> None:
    need = pages_needed(_mixed_layout(), tokens, {"swa": 128})
    assert need == {"full": full, "swa": swa, "state": 1}


def test_pages_needed_without_window_counts_whole_context() -> None:
    assert pages_needed(_mixed_layout(), 1000)["swa"] == 16


def test_preset_windows() -> None:
    assert windows_for("deepseek_v4") == {"swa": 128} == windows_for("gpt_oss")
    assert windows_for("llama3_8b") == {}
    layout = get_preset("deepseek_v4", num_pages=64)
    assert pages_needed(layout, 1024) == {"c4": 4, "c128": 4, "swa": 2}  # the layout carries the window
    assert pages_needed(layout, 1000, windows_for("deepseek_v4"))["swa"] == 3  # window straddles 3 pages
    assert pages_needed(layout, 1000, {"swa": 64})["swa"] == 2  # an explicit window overrides the layout's


def test_window_is_part_of_the_shape_and_the_manifest() -> None:
    layout = get_preset("gpt_oss", num_pages=8)
    again = Layout.from_manifest(layout.to_manifest())
    assert again.pool("swa").window_tokens == 128 and again.pool("full").window_tokens is None
    assert again.shape_fingerprint == layout.shape_fingerprint
    unwindowed = Layout([Pool(p.name, p.buffers, p.tokens_per_page) for p in layout.pools])
    assert unwindowed.shape_fingerprint != layout.shape_fingerprint
    assert shape_difference(layout, unwindowed) == "pool 'swa': window_tokens differs: local 128, remote None"
    # Pools without a window keep version 2's three-element encoding, which older peers decode.
    pools = msgspec.msgpack.decode(unwindowed.to_manifest())["pools"]
    assert [len(p) for p in pools] == [3, 3]
    assert Layout.from_manifest(unwindowed.to_manifest()) == unwindowed
    with pytest.raises(LayoutError, match="state pool .* has no window"):
        Pool("state", [Buffer("s", 8, 2)], None, 128)


# -- page content ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("page_bytes", [16384, 1168, 1001])
def test_fill_then_check_is_clean_and_any_flipped_byte_is_caught(page_bytes: int) -> None:
    view = np.zeros((40, page_bytes), dtype=np.uint8)
    pages = np.array([7, 3, 30, 31, 0])
    keys = page_keys(0, 5, np.array([2]), len(pages))[0]
    fill_pages(view, pages, keys)
    assert not check_pages(view, pages, keys).any()
    view[30, page_bytes - 1] ^= 0x01
    assert check_pages(view, pages, keys).tolist() == [False, False, True, False, False]


def test_keys_differ_by_request_buffer_and_position() -> None:
    keys = page_keys(0, 1, np.array([0, 1]), 4)
    assert len(np.unique(keys)) == 8
    assert not np.isin(page_keys(0, 2, np.array([0, 1]), 4), keys).any()
    assert not np.isin(page_keys(1, 1, np.array([0, 1]), 4), keys).any()
    assert np.array_equal(page_keys(0, 1, np.array([1]), 4)[0], keys[1])


def test_check_catches_stale_swapped_and_zero_pages() -> None:
    view = np.zeros((8, 4096), dtype=np.uint8)
    pages = np.array([1, 2, 3])
    old = page_keys(0, 1, np.array([0]), 3)[0]
    new = page_keys(0, 2, np.array([0]), 3)[0]
    fill_pages(view, pages, old)                          # an earlier request's bytes
    fill_pages(view, pages[:1], new[:1])                  # only page 1 was rewritten
    view[[2, 3]] = view[[3, 2]]                           # and two pages landed swapped
    assert check_pages(view, pages, new).tolist() == [False, True, True]
    assert check_pages(view, np.array([5]), new[:1]).all()  # a page never written (zeros)
