"""The bug kvferry exists for, as a regression test.

A NIXL sender built one flat per-page descriptor list over all buffers and computed the flat index of
(buffer b, page p) as ``b * num_slots + p`` with ``num_slots = kv_data_lens[0] // kv_item_lens[0]``, the
slot count of buffer 0. When a bf16 index-K buffer has a different page count than the KV buffer, every
buffer after it is indexed into the wrong block: its pages are written to the wrong addresses.
"""

from __future__ import annotations

import numpy as np

from kvferry import KVMemory, Layout, plan_transfer

from .conftest import fill_random, memmove_plan


def buggy_flat_index(mem: KVMemory, buffer_pos: int, pages: np.ndarray) -> np.ndarray:
    regions = mem.regions
    num_slots = regions[0].nbytes // mem.layout.buffers[0].page_bytes  # buffer 0's slot count, for all
    return buffer_pos * num_slots + pages


def test_buffer0_slot_count_points_at_the_wrong_descriptor(salad_layout: Layout) -> None:
    mem = KVMemory.allocate(salad_layout)
    descs = mem.page_descs()
    pages = np.array([3, 4, 20], dtype=np.int64)
    for pos, buf in enumerate(salad_layout.buffers[:4]):
        want = np.array([mem.address(buf.name) + p * buf.page_bytes for p in pages], dtype=np.uint64)
        got_buggy = descs[buggy_flat_index(mem, pos, pages), 0]
        if pos == 0 or pos == 1:
            # Blocks 0 and 1 start where buffer 0's capacity says; the bug is invisible here...
            np.testing.assert_array_equal(got_buggy, want)
        else:
            # ...and from the first buffer after a differently sized one, every address is wrong.
            assert (got_buggy != want).all(), buf.name


def test_kvferry_selectors_and_rows_hit_the_right_pages(salad_layout: Layout) -> None:
    src = KVMemory.allocate(salad_layout)
    dst = KVMemory.allocate(salad_layout.with_capacities({"c4.idx.L0": 30, "c4.idx.L1": 30}))
    fill_random(src, 7)
    s, d = np.array([3, 4, 20, 21]), np.array([10, 11, 2, 23])
    plan = plan_transfer(src, dst, {"c4": (s, d)})
    src_idx, dst_idx = plan.page_selectors()
    sd, dd = src.page_descs(), dst.page_descs()
    for k, buf in enumerate(salad_layout.pool("c4").buffers):
        block = slice(k * len(s), (k + 1) * len(s))
        np.testing.assert_array_equal(sd[src_idx[block], 0], src.address(buf.name) + s * buf.page_bytes)
        np.testing.assert_array_equal(dd[dst_idx[block], 0], dst.address(buf.name) + d * buf.page_bytes)
    memmove_plan(plan)
    for buf in salad_layout.pool("c4").buffers:
        np.testing.assert_array_equal(dst.array(buf.name)[d], src.array(buf.name)[s], err_msg=buf.name)
    untouched = np.setdiff1d(np.arange(24), d)
    assert not dst.array("c4.idx.L1")[untouched].any()
    assert plan.num_descriptors == 3 * 4  # joint runs: 3,4->10,11 | 20->2 | 21->23


def test_row_count_is_joint_runs_times_buffers(salad_layout: Layout) -> None:
    src = KVMemory.allocate(salad_layout)
    dst = KVMemory.allocate(salad_layout)
    # Joint runs: [0,1,2]->[5,6,7], [3]->[9] (dst breaks), [7,8]->[10,11] (src breaks)
    plan = plan_transfer(src, dst, {"c4": ([0, 1, 2, 3, 7, 8], [5, 6, 7, 9, 10, 11])})
    assert plan.num_descriptors == 3 * 4
    rows = list(plan.rows())
    assert [(r.buffer, r.src_page, r.dst_page, r.num_pages) for r in rows[:3]] == [
        ("c4.kv.L0", 0, 5, 3), ("c4.kv.L0", 3, 9, 1), ("c4.kv.L0", 7, 10, 2)]
    assert plan.buffer_rows("c4.idx.L0") == slice(3, 6)
    assert rows[4].nbytes == 64 * 256 and rows[4].buffer == "c4.idx.L0"
