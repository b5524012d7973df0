"""Property tests: every page lands exactly once, nothing outside its buffer, nothing overlaps."""

from __future__ import annotations

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from kvferry import Buffer, KVMemory, Layout, Pool, plan_transfer

from .conftest import fill_random, memmove_plan, snapshot

# Odd sizes included on purpose: an off-by-one in page arithmetic shows at 1, 3, 4097 bytes, not at 4096.
PAGE_BYTES = st.one_of(st.integers(1, 64), st.sampled_from([131, 132, 256, 656, 4095, 4097]),
                       st.integers(1, 65536))


@st.composite
def layouts_pair(draw: st.DrawFn) -> tuple[Layout, Layout]:
    """Same shape on both sides, capacities drawn per buffer and per side."""
    num_pools = draw(st.integers(1, 3))
    src_pools, dst_pools = [], []
    for p in range(num_pools):
        num_bufs = draw(st.integers(1, 4))
        src_bufs, dst_bufs = [], []
        for b in range(num_bufs):
            pb = draw(PAGE_BYTES)
            cap_hi = max(1, min(24, (1 << 20) // pb))
            name = f"p{p}.b{b}"
            src_bufs.append(Buffer(name, pb, draw(st.integers(1, cap_hi)), layer=b))
            dst_bufs.append(Buffer(name, pb, draw(st.integers(1, cap_hi)), layer=b))
        src_pools.append(Pool(f"p{p}", src_bufs, 64))
        dst_pools.append(Pool(f"p{p}", dst_bufs, 64))
    return Layout(src_pools), Layout(dst_pools)


@st.composite
def page_lists(draw: st.DrawFn, src_cap: int, dst_cap: int) -> tuple[np.ndarray, np.ndarray]:
    """Source pages (may repeat) and unique destination pages, often in runs."""
    n = draw(st.integers(0, min(src_cap, dst_cap)))
    dst = draw(st.permutations(range(dst_cap)))[:n]
    if draw(st.booleans()):
        dst = sorted(dst)  # long runs on the destination side
    if draw(st.booleans()):
        start = draw(st.integers(0, src_cap - n))
        src = list(range(start, start + n))  # one source run
    else:
        src = draw(st.lists(st.integers(0, src_cap - 1), min_size=n, max_size=n))
    return np.array(src, dtype=np.int64), np.array(dst, dtype=np.int64)


def joint_runs(src: np.ndarray, dst: np.ndarray) -> int:
    """Oracle, written the slow obvious way."""
    runs = 0
    for i in range(len(src)):
        if i == 0 or src[i] != src[i - 1] + 1 or dst[i] != dst[i - 1] + 1:
            runs += 1
    return runs


@given(data=st.data())
def test_plan_moves_every_page_once_and_nothing_else(data: st.DataObject) -> None:
    src_layout, dst_layout = data.draw(layouts_pair())
    src, dst = KVMemory.allocate(src_layout), KVMemory.allocate(dst_layout)
    fill_random(src, 1)
    fill_random(dst, 2)
    before = snapshot(dst)
    pools = data.draw(st.lists(st.sampled_from([p.name for p in src_layout.pools]), unique=True))
    pages = {name: data.draw(page_lists(src_layout.pool(name).min_pages, dst_layout.pool(name).min_pages))
             for name in pools}
    all_bufs = [b.name for p in pools for b in src_layout.pool(p).buffers]
    subset = data.draw(st.none() | st.lists(st.sampled_from(all_bufs), unique=True) if all_bufs else st.none())

    plan = plan_transfer(src, dst, pages, buffers=subset)
    memmove_plan(plan)

    expected = {k: v.copy() for k, v in before.items()}
    moved = set()
    for pool, (s, d) in pages.items():
        for buf in src_layout.pool(pool).buffers:
            if subset is not None and buf.name not in subset:
                continue
            expected[buf.name][d] = src.array(buf.name)[s]
            moved.add(buf.name)
    for name, arr in expected.items():
        np.testing.assert_array_equal(dst.array(name), arr, err_msg=f"buffer {name}")

    # Row count is the minimum: joint runs x buffers moved, pool by pool.
    want_rows = sum(joint_runs(s, d) * sum(1 for b in src_layout.pool(p).buffers if b.name in moved)
                    for p, (s, d) in pages.items())
    assert plan.num_descriptors == want_rows
    assert plan.nbytes == sum(len(s) * sum(b.page_bytes for b in src_layout.pool(p).buffers if b.name in moved)
                              for p, (s, d) in pages.items())
    _assert_rows_inside_buffers_and_disjoint(plan, src, dst)


def _assert_rows_inside_buffers_and_disjoint(plan, src: KVMemory, dst: KVMemory) -> None:
    for mem, descs, which in ((src, plan.src_descs, "src_page"), (dst, plan.dst_descs, "dst_page")):
        for i, (addr, length, _dev) in enumerate(descs.tolist()):
            row = plan.row(i)
            region = mem.region(row.buffer)
            assert region.address <= addr and addr + length <= region.end, f"row {i} leaves {row.buffer}"
            assert length == row.nbytes > 0
            assert addr == region.address + getattr(row, which) * mem.layout.buffer(row.buffer).page_bytes
    order = np.argsort(plan.dst_descs[:, 0], kind="stable")
    starts, lens = plan.dst_descs[order, 0], plan.dst_descs[order, 1]
    assert (starts[:-1] + lens[:-1] <= starts[1:]).all(), "destination rows overlap"


@given(data=st.data())
def test_page_selectors_index_the_same_bytes_as_the_rows(data: st.DataObject) -> None:
    src_layout, dst_layout = data.draw(layouts_pair())
    src, dst = KVMemory.allocate(src_layout), KVMemory.allocate(dst_layout)
    pool = src_layout.pools[0].name
    s, d = data.draw(page_lists(src_layout.pools[0].min_pages, dst_layout.pools[0].min_pages))
    plan = plan_transfer(src, dst, {pool: (s, d)})
    src_idx, dst_idx = plan.page_selectors()
    sd, dd = src.page_descs(), dst.page_descs()
    bufs = src_layout.pools[0].buffers
    assert len(src_idx) == len(dst_idx) == len(s) * len(bufs)
    want_src = np.array([src.address(b.name) + p * b.page_bytes for b in bufs for p in s], dtype=np.uint64)
    want_dst = np.array([dst.address(b.name) + p * b.page_bytes for b in bufs for p in d], dtype=np.uint64)
    np.testing.assert_array_equal(sd[src_idx, 0] if len(src_idx) else want_src, want_src)
    np.testing.assert_array_equal(dd[dst_idx, 0] if len(dst_idx) else want_dst, want_dst)
