"""The planner's and the transports' fast paths, each checked against the slow obvious way.

* rows: ``TransferPlan.fill_rows`` has three ways to write rows (matrix product for small pools, broadcast
  per buffer, one template per buffer kind); each must give exactly the rows computed from the regions
  in a Python loop;
* a few pages: page validation and joint runs switch to Python lists below ``FEW_PAGES``; both paths must
  accept and refuse the same inputs with the same message, and give the same runs;
* the transports' region check: for plans the planner built, runs are checked instead of rows. It may
  only accept what the row check accepts, and ``check_plan_in_regions`` must refuse every plan whose
  rows leave a region (tampered runs, foreign vectors, subclasses), whichever path it takes.
"""

from __future__ import annotations

import itertools
from unittest import mock

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvferry import Buffer, KVMemory, Layout, PlanError, Pool, TransportError, plan_transfer
from kvferry.layout.memory import Region
from kvferry.plan import pages as pages_mod
from kvferry.plan import planner
from kvferry.plan.planner import PoolPlan, TransferPlan, joint_runs
from kvferry.transport import base
from kvferry.transport.base import RowBuffer, check_plan_in_regions, check_rows_in_regions

# Few page sizes on purpose: buffers of one kind (page size, device) share a template row.
PAGE_BYTES = st.sampled_from([1, 3, 64, 131, 4096, 4097])


@st.composite
def bound_pair(draw: st.DrawFn, remote: bool = True) -> tuple[KVMemory, KVMemory]:
    """Same shape on both sides, capacities and devices drawn per buffer and side, regions with gaps."""
    num_pools = draw(st.integers(1, 3))
    sides: list[list[Pool]] = [[], []]
    for p in range(num_pools):
        shape = [draw(PAGE_BYTES) for _ in range(draw(st.integers(1, 7)))]
        for side in sides:
            bufs = [Buffer(f"p{p}.b{i}", pb, draw(st.integers(1, 40)), layer=i) for i, pb in enumerate(shape)]
            side.append(Pool(f"p{p}", bufs, 64))
    out = []
    for k, pools in enumerate(sides):
        layout = Layout(pools)
        addr, regions = (k + 1) << 40, []
        for b in layout.buffers:
            addr += draw(st.integers(0, 3)) * 4096  # gaps between regions, sometimes none
            regions.append(Region(b.name, addr, b.nbytes, "cuda", draw(st.integers(0, 1))))
            addr += b.nbytes
        out.append(KVMemory(layout, regions, remote=True))
    return out[0], out[1]


@st.composite
def requests(draw: st.DrawFn, src: KVMemory, dst: KVMemory, max_pages: int = 60) -> dict:
    """pool -> (source pages, unique destination pages), runs likely."""
    req = {}
    for pool in draw(st.lists(st.sampled_from([p.name for p in src.layout.pools]), unique=True, min_size=1)):
        src_cap, dst_cap = src.layout.pool(pool).min_pages, dst.layout.pool(pool).min_pages
        n = draw(st.integers(0, min(src_cap, dst_cap, max_pages)))
        dst_pages = draw(st.permutations(range(dst_cap)))[:n]
        if draw(st.booleans()):
            dst_pages = sorted(dst_pages)
        if draw(st.booleans()):
            start = draw(st.integers(0, src_cap - n))
            src_pages = list(range(start, start + n))
        else:
            src_pages = draw(st.lists(st.integers(0, src_cap - 1), min_size=n, max_size=n))
        req[pool] = (src_pages, dst_pages)
    return req


def reference_rows(plan: TransferPlan) -> tuple[np.ndarray, np.ndarray]:
    """Rows the slow obvious way: Python loops over pools, buffers and runs, addresses from the regions."""
    out: list[list[list[int]]] = [[], []]
    for pool_plan in plan.pools:
        for gid in pool_plan.buffer_ids.tolist():
            for start_s, start_d, n in zip(*pool_plan.runs.tolist()):
                for k, (mem, start) in enumerate(((plan.src_memory, start_s), (plan.dst_memory, start_d))):
                    region, page = mem.regions[gid], mem.layout.buffers[gid].page_bytes
                    out[k].append([region.address + start * page, n * page, region.device_id])
    return tuple(np.array(rows, dtype=np.uint64).reshape(-1, 3) for rows in out)


FILL_PATHS = {  # (planner._MATMUL_MAX_ROWS, planner._TEMPLATE_MIN_ROWS) forcing each way
    "matmul": (1 << 62, 1 << 62), "broadcast": (-1, 1 << 62), "template": (-1, 0)}


def _draw_plan(data: st.DataObject) -> TransferPlan:
    """A planned request between a drawn pair of memories, over all buffers or a drawn subset of them."""
    src, dst = data.draw(bound_pair())
    req = data.draw(requests(src, dst))
    names = [b.name for b in src.layout.buffers]
    subset = data.draw(st.none() | st.lists(st.sampled_from(names), unique=True, min_size=1))
    return plan_transfer(src, dst, req, buffers=subset)


@given(data=st.data())
def test_every_fill_path_gives_the_reference_rows(data: st.DataObject) -> None:
    plan = _draw_plan(data)
    want_src, want_dst = reference_rows(plan)
    np.testing.assert_array_equal(plan.src_descs, want_src)
    np.testing.assert_array_equal(plan.dst_descs, want_dst)
    for path, (matmul_max, template_min) in FILL_PATHS.items():
        with mock.patch.object(planner, "_MATMUL_MAX_ROWS", matmul_max), \
                mock.patch.object(planner, "_TEMPLATE_MIN_ROWS", template_min):
            got = np.full((2, plan.num_descriptors, 3), 7, dtype=np.uint64)
            plan.fill_rows(got[0], got[1])
        np.testing.assert_array_equal(got[0], want_src, err_msg=path)
        np.testing.assert_array_equal(got[1], want_dst, err_msg=path)


def test_fill_rows_refuses_a_wrong_buffer() -> None:
    layout = Layout([Pool("p", [Buffer("b", 64, 8)], 64)])
    plan = plan_transfer(KVMemory.allocate(layout), KVMemory.allocate(layout), {"p": ([0, 3], [1, 2])})
    good = np.empty((2, 3), dtype=np.uint64)
    for bad in (np.empty((3, 3), np.uint64), np.empty((2, 3), np.int64), np.empty((3, 2), np.uint64).T):
        with pytest.raises(PlanError, match="fill_rows needs"):
            plan.fill_rows(bad, good)


def test_row_buffer_reuses_one_buffer_and_passes_other_plans_through() -> None:
    layout = Layout([Pool("p", [Buffer("a", 64, 50), Buffer("b", 96, 50)], 64)])
    src, dst = KVMemory.allocate(layout), KVMemory.allocate(layout)
    rows = RowBuffer()
    rng = np.random.default_rng(1)
    for n in (5, 40, 3, 50, 1):
        plan = plan_transfer(src, dst, {"p": (rng.permutation(50)[:n], rng.permutation(50)[:n])})
        got_src, got_dst = rows.rows(plan)
        np.testing.assert_array_equal(got_src, plan.src_descs)
        np.testing.assert_array_equal(got_dst, plan.dst_descs)
    assert rows._buf.shape[1] >= 100  # grown once to the largest plan, kept

    class Foreign(TransferPlan):
        pass

    foreign = Foreign(plan.src_memory, plan.dst_memory, plan.pools)
    assert rows.rows(foreign)[0] is foreign.src_descs
    with mock.patch.object(RowBuffer, "MAX_ROWS", 2):
        big = plan_transfer(src, dst, {"p": ([0, 2, 4], [0, 2, 4])})
        assert RowBuffer().rows(big)[0] is big.src_descs


# -- a few pages: Python lists against numpy ---------------------------------------------------------------
def _outcome(fn, *args, **kwargs) -> str:
    try:
        fn(*args, **kwargs)
    except PlanError as exc:
        return str(exc)
    return "ok"


@given(pages=st.lists(st.integers(-3, 45), max_size=40), unique=st.booleans())
def test_few_pages_are_validated_like_many(pages: list[int], unique: bool) -> None:
    pool = Pool("p", [Buffer("a", 64, 40), Buffer("b", 64, 37)], 64)
    arr = np.array(pages, dtype=np.int64)
    with mock.patch.object(pages_mod, "FEW_PAGES", 1 << 30):
        few = _outcome(pages_mod.check_pages, pool, "source", arr, unique=unique)
    with mock.patch.object(pages_mod, "FEW_PAGES", 0):
        many = _outcome(pages_mod.check_pages, pool, "source", arr, unique=unique)
        with mock.patch.object(pages_mod, "_BITMAP_PER_PAGE", 0):  # the sort instead of the bitmap
            many_sorted = _outcome(pages_mod.check_pages, pool, "source", arr, unique=unique)
    # the oracle: bounds first (smallest then largest page), then the smallest repeated page
    if pages and (min(pages) < 0 or max(pages) >= 37):
        bad = min(pages) if min(pages) < 0 else max(pages)
        want = f"source page {bad} is out of range"
    elif unique and len(set(pages)) < len(pages):
        want = f"source page {min(p for p in pages if pages.count(p) > 1)} appears more than once"
    else:
        want = "ok"
    assert few == many == many_sorted
    assert want in few


@given(st.lists(st.tuples(st.integers(0, 30), st.integers(0, 30)), min_size=1, max_size=80))
def test_few_pages_give_the_same_runs_as_many(pairs: list[tuple[int, int]]) -> None:
    src = np.array([p[0] for p in pairs], dtype=np.int64)
    dst = np.array([p[1] for p in pairs], dtype=np.int64)
    with mock.patch.object(planner, "FEW_PAGES", 1 << 30):
        few = joint_runs(src, dst)
    with mock.patch.object(planner, "FEW_PAGES", 0):
        many = joint_runs(src, dst)
    np.testing.assert_array_equal(few, many)
    # oracle: a run continues while both sides step by one
    starts = [i for i in range(len(pairs)) if i == 0 or (src[i] != src[i - 1] + 1 or dst[i] != dst[i - 1] + 1)]
    lengths = np.diff([*starts, len(pairs)])
    np.testing.assert_array_equal(many, [src[starts], dst[starts], lengths])
    assert not many.flags.writeable


# -- the region check: runs for the planner's plans, rows for everything else -----------------------------
def _rows_ok(plan) -> bool:
    try:
        check_rows_in_regions(plan.src_descs, plan.src_memory, "source", "peer", "t")
        check_rows_in_regions(plan.dst_descs, plan.dst_memory, "destination", "peer", "t")
    except TransportError:
        return False
    return True


def _with_runs(plan: TransferPlan, runs: list[np.ndarray]) -> TransferPlan:
    """The plan with each pool's runs replaced (pages and vectors kept): what a bug could hand a transport."""
    pools = tuple(PoolPlan(p.pool, p.buffer_ids, p.src_pages, p.dst_pages, r, p.src, p.dst)
                  for p, r in zip(plan.pools, runs))
    return TransferPlan(plan.src_memory, plan.dst_memory, pools)


@given(data=st.data())
def test_planner_plans_take_the_fast_check_and_pass(data: st.DataObject) -> None:
    src, dst = data.draw(bound_pair())
    req = data.draw(requests(src, dst))
    plan = plan_transfer(src, dst, req, buffers=data.draw(st.none() | st.just([src.layout.buffers[0].name])))
    few = data.draw(st.sampled_from([0, 1 << 30]))
    with mock.patch.object(base, "FEW_RUNS", few):
        assert base._runs_inside(plan, src, dst, selectors=True)
        # fingerprint-equal bindings (a peer's manifest decoded twice) take the fast path too
        assert base._runs_inside(plan, KVMemory(src.layout, src.regions, remote=True),
                                 KVMemory(dst.layout, dst.regions, remote=True), selectors=False)
    check_plan_in_regions(plan, src, dst, "peer", "t", selectors=True)
    assert _rows_ok(plan)


EDGE = [-(2**63), -(2**62), -5, -1, 0, 1, 2, 39, 40, 41, 2**31, 2**62, 2**63 - 1]


@given(data=st.data())
def test_tampered_runs_are_refused_exactly_when_a_row_leaves_its_region(data: st.DataObject) -> None:
    src, dst = data.draw(bound_pair())
    req = data.draw(requests(src, dst))
    plan = plan_transfer(src, dst, req)
    if not plan.pools:
        return
    # Half the time plausible runs only (inside every buffer, or just past the smallest), else wild values.
    start, length = st.integers(0, 6), st.integers(1, 3)
    if data.draw(st.booleans()):
        start = st.one_of(start, st.integers(-3, 45), st.sampled_from(EDGE))
        length = st.one_of(length, st.integers(-3, 45), st.sampled_from(EDGE))
    runs = [np.array(data.draw(st.lists(st.tuples(start, start, length), min_size=1, max_size=12)),
                     dtype=np.int64).T.copy() for _ in plan.pools]
    tampered = _with_runs(plan, runs)
    rows_ok = _rows_ok(tampered)
    for few in (0, 1 << 30):
        with mock.patch.object(base, "FEW_RUNS", few):
            if base._runs_inside(tampered, src, dst, selectors=False):
                assert rows_ok, "the fast check accepted rows outside their regions"
            if rows_ok:
                check_plan_in_regions(tampered, src, dst, "peer", "t")
            else:
                with pytest.raises(TransportError, match="outside every registered"):
                    check_plan_in_regions(tampered, src, dst, "peer", "t")


@pytest.fixture
def small_plan() -> tuple[KVMemory, KVMemory, TransferPlan]:
    layout = Layout([Pool("p", [Buffer("a", 64, 10), Buffer("b", 32, 8)], 64)])
    src, dst = KVMemory.allocate(layout), KVMemory.allocate(layout)
    return src, dst, plan_transfer(src, dst, {"p": ([0, 1, 5], [7, 2, 3])})


@pytest.mark.parametrize("runs", [
    [[0], [7], [9]],           # past the smaller buffer (8 pages)
    [[-1], [0], [1]],          # negative start
    [[0], [0], [0]],           # empty run: a zero-length row
    [[2**63 - 1], [0], [1]],   # start + length wraps int64
    [[1], [0], [-(2**63)]],    # negative length
    [[0, 3], [0, 7], [1, 2]],  # second run leaves the destination buffer
])
def test_runs_outside_a_buffer_are_refused(small_plan, runs) -> None:
    src, dst, plan = small_plan
    tampered = _with_runs(plan, [np.array(runs, dtype=np.int64)])
    for few in (0, 1 << 30):
        with mock.patch.object(base, "FEW_RUNS", few):
            assert not base._runs_inside(tampered, src, dst, selectors=False)
            with pytest.raises(TransportError, match="outside every registered"):
                check_plan_in_regions(tampered, src, dst, "peer", "t")


def test_vectors_from_elsewhere_and_subclasses_get_the_row_check(small_plan) -> None:
    src, dst, plan = small_plan
    pool_plan = plan.pools[0]
    # Vectors equal in value but not the memory's own: the runs alone prove nothing about them.
    shifted = KVMemory(dst.layout, [Region(r.buffer, r.address + (1 << 30), r.nbytes) for r in dst.regions],
                       remote=True)
    foreign = TransferPlan(src, dst, (PoolPlan(pool_plan.pool, pool_plan.buffer_ids, pool_plan.src_pages,
                                               pool_plan.dst_pages, pool_plan.runs, pool_plan.src,
                                               shifted.pool_arrays["p"]),))
    assert not base._runs_inside(foreign, src, dst, selectors=False)
    with pytest.raises(TransportError, match="destination row 0 .* outside every registered destination"):
        check_plan_in_regions(foreign, src, dst, "peer", "t")

    class Subclass(TransferPlan):  # as the fault injector's FaultyPlan: rows of its own
        @property
        def dst_descs(self) -> np.ndarray:
            rows = super().dst_descs.copy()
            rows[-1, 0] += 1 << 30
            return rows

    with pytest.raises(TransportError, match="destination row 5 .* outside every registered destination"):
        check_plan_in_regions(Subclass(src, dst, plan.pools), src, dst, "peer", "t")
    # A plan for other memory than the transport's: the row check, against the transport's memory.
    with pytest.raises(TransportError, match="outside every registered destination"):
        check_plan_in_regions(plan, src, shifted, "peer", "t")


def test_pool_subsets_are_built_once_and_recognised() -> None:
    layout = Layout([Pool("p", [Buffer(f"b{i}", 64, 10) for i in range(4)], 64)])
    src, dst = KVMemory.allocate(layout), KVMemory.allocate(layout)
    one = plan_transfer(src, dst, {"p": ([0], [1])}, buffers=["b1", "b3"])
    two = plan_transfer(src, dst, {"p": ([2], [3])}, buffers=["b3", "b1"])
    assert one.pools[0].src is two.pools[0].src and src.built_here(one.pools[0].src)
    assert one.pools[0].buffer_ids.tolist() == [1, 3]
    assert plan_transfer(src, dst, {"p": ([0], [1])}, buffers=["b0", "b1", "b2", "b3"]).pools[0].src \
        is src.pool_arrays["p"]
    with mock.patch("kvferry.layout.memory._MAX_SUBSETS", 2):
        keys = [["b0"], ["b1"], ["b2"]]
        plans = [plan_transfer(src, dst, {"p": ([0], [1])}, buffers=k) for k in keys]
        assert not src.built_here(plans[0].pools[0].src)  # forgotten: its plans get the row check
        assert src.built_here(plans[2].pools[0].src)
        check_plan_in_regions(plans[0], src, dst, "peer", "t")


def test_every_combination_of_fill_path_and_check_on_a_large_plan() -> None:
    """Large enough for the template and numpy paths by default (the hypothesis tests use small plans)."""
    bufs = [Buffer(f"L{i}.{k}", pb, 3000, layer=i) for i in range(20) for k, pb in (("kv", 656), ("idx", 132))]
    layout = Layout([Pool("kv", bufs, 64)])
    src = KVMemory(layout, _regions(layout, 1 << 40), remote=True)
    dst = KVMemory(layout, _regions(layout, 1 << 44), remote=True)
    rng = np.random.default_rng(3)
    plan = plan_transfer(src, dst, {"kv": (rng.permutation(3000)[:600], rng.permutation(3000)[:600])})
    assert plan.num_descriptors > planner._TEMPLATE_MIN_ROWS and plan.pools[0].runs.shape[1] > base.FEW_RUNS
    want = reference_rows(plan)
    got = RowBuffer().rows(plan)
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_array_equal(got[1], want[1])
    assert base._runs_inside(plan, src, dst, selectors=True)
    for k, n in itertools.product(range(3), (0, 599)):
        runs = plan.pools[0].runs.copy()
        runs[k, n] = 3001 if k < 2 else 0
        assert not base._runs_inside(_with_runs(plan, [runs]), src, dst, selectors=False)


def _regions(layout: Layout, base_addr: int) -> list[Region]:
    out, addr = [], base_addr
    for b in layout.buffers:
        out.append(Region(b.name, addr, b.nbytes))
        addr += b.nbytes + 4096
    return out


# -- page indices: what NixlTransport posts into its prepared per-page lists ------------------------------
@given(data=st.data())
def test_fill_selectors_gives_page_selectors_as_int32(data: st.DataObject) -> None:
    plan = _draw_plan(data)
    want_src, want_dst = plan.page_selectors()
    got = np.full((2, plan.num_selectors), -7, dtype=np.int32)
    plan.fill_selectors(got[0], got[1])
    np.testing.assert_array_equal(got[0], want_src)
    np.testing.assert_array_equal(got[1], want_dst)
    for few in (0, 1 << 30):  # Python lists and the reused int32 buffer
        with mock.patch.object(base, "FEW_SELECTORS", few):
            sel = RowBuffer().selectors(plan)
        np.testing.assert_array_equal(sel[0], want_src)
        np.testing.assert_array_equal(sel[1], want_dst)
    # the fast check that allows posting indices accepts every planner-built plan
    assert base.pages_in_regions(plan, plan.src_memory, plan.dst_memory)


def test_fill_selectors_refuses_a_wrong_buffer() -> None:
    layout = Layout([Pool("p", [Buffer("b", 64, 8)], 64)])
    plan = plan_transfer(KVMemory.allocate(layout), KVMemory.allocate(layout), {"p": ([0, 3], [1, 2])})
    good = np.empty(2, dtype=np.int32)
    for bad in (np.empty(3, np.int32), np.empty(2, np.int64), np.empty((2, 2), np.int32)[:, 0]):
        with pytest.raises(PlanError, match="fill_selectors needs"):
            plan.fill_selectors(bad, good)
    for bad in (np.empty((2, 3), np.int32), np.empty((2, 2), np.int64), np.empty((2, 2), np.int32).T.copy().T):
        with pytest.raises(PlanError, match="fill_selector_pair needs"):
            plan.fill_selector_pair(bad)


@pytest.mark.parametrize("many", [False, True])
@pytest.mark.parametrize("side,page", [(0, 8), (1, 10), (0, -1), (1, -(2**63)), (1, 2**40)])
def test_pages_outside_a_capacity_never_get_indices(small_plan, many: bool, side: int, page: int) -> None:
    """A plan whose runs are fine but whose pages are not (tampered) may be posted as rows, never as page
    indices: an index past a buffer's capacity would select a page of the next buffer."""
    src, dst, plan = small_plan
    pool_plan = plan.pools[0]
    pages = [pool_plan.src_pages.copy(), pool_plan.dst_pages.copy()]
    if many:
        pages = [np.resize(p, 3 * base.FEW_RUNS) for p in pages]
    pages[side][-1] = page
    tampered = TransferPlan(src, dst, (PoolPlan(pool_plan.pool, pool_plan.buffer_ids, pages[0], pages[1],
                                                pool_plan.runs, pool_plan.src, pool_plan.dst),))
    assert base.pages_in_regions(plan, plan.src_memory, plan.dst_memory)
    assert not base.pages_in_regions(tampered, src, dst)
    # The same pages kept as ints (what a few-page plan posts as indices) are checked as such.
    as_ints = PoolPlan.from_lists(pool_plan.pool, tuple(pages[0].tolist()), tuple(pages[1].tolist()),
                                  tuple(tuple(r) for r in pool_plan.runs.tolist()), pool_plan.src, pool_plan.dst)
    assert not base.pages_in_regions(TransferPlan(src, dst, (as_ints,)), src, dst)


def test_a_few_pages_plan_keeps_ints_and_is_immutable(small_plan) -> None:
    src, dst, general = small_plan
    plan = plan_transfer(src, dst, {"p": (np.array([0, 1, 5]), np.array([7, 2, 3]))})
    pool_plan = plan.pools[0]
    assert general.pools[0].page_lists is None and pool_plan.page_lists is not None
    assert pool_plan.page_lists == (tuple(pool_plan.src_pages.tolist()), tuple(pool_plan.dst_pages.tolist()))
    assert pool_plan.run_lists == tuple(tuple(r) for r in pool_plan.runs.tolist())
    assert plan.num_descriptors == sum(p.num_rows for p in plan.pools)
    assert plan.num_selectors == sum(len(p.src_pages) * len(p.buffer_ids) for p in plan.pools)
    with pytest.raises(AttributeError, match="immutable"):
        pool_plan.page_lists = ((0,), (0,))
    with pytest.raises(ValueError):
        pool_plan.src_pages[0] = 1


def test_short_runs_picks_indices_only_for_planner_plans_with_short_runs() -> None:
    layout = Layout([Pool("p", [Buffer("a", 64, 100), Buffer("b", 32, 100)], 64)])
    src, dst = KVMemory.allocate(layout), KVMemory.allocate(layout)
    scattered = plan_transfer(src, dst, {"p": (list(range(0, 40, 2)), list(range(0, 40, 2)))})
    long_runs = plan_transfer(src, dst, {"p": (list(range(40)), list(range(40, 80)))})
    assert base.short_runs(scattered) and not base.short_runs(long_runs)

    class Subclass(TransferPlan):
        pass

    assert not base.short_runs(Subclass(src, dst, scattered.pools))


# -- plan_transfer's path for a few pages --------------------------------------------------------------------
def _plan_or_error(src: KVMemory, dst: KVMemory, req: dict, few: bool) -> object:
    with mock.patch.object(planner, "_plan_few", planner._plan_few if few else (lambda *_: None)):
        try:
            plan = plan_transfer(src, dst, req)
        except PlanError as exc:
            return str(exc)
    return [(p.pool, p.buffer_ids.tolist(), p.src_pages.tolist(), p.dst_pages.tolist(), p.runs.tolist(),
             p.src is src.pool_arrays[p.pool], p.dst is dst.pool_arrays[p.pool], p.src_pages.dtype.str,
             p.src_pages.flags.writeable, p.runs.flags.writeable) for p in plan.pools]


PAGE = st.one_of(st.integers(-3, 45), st.sampled_from([2**31, 2**63 - 1]))


@given(data=st.data())
def test_the_few_pages_path_plans_and_refuses_as_the_general_path(data: st.DataObject) -> None:
    src, dst = data.draw(bound_pair())
    if data.draw(st.booleans()):
        req = data.draw(requests(src, dst, max_pages=40))   # valid; some above FEW_PAGES
    else:                                                     # anything: out of range, repeats, lengths
        pools = [p.name for p in src.layout.pools] + ["nope"]
        req = {name: (data.draw(st.lists(PAGE, max_size=6)), data.draw(st.lists(PAGE, max_size=6)))
               for name in data.draw(st.lists(st.sampled_from(pools), unique=True, min_size=1))}
    dtype = data.draw(st.sampled_from([np.int64, np.int32, np.uint64, None]))
    if dtype is not None:
        try:
            req = {k: (np.array(s, dtype=dtype), np.array(d, dtype=dtype)) for k, (s, d) in req.items()}
        except OverflowError:
            return
    assert _plan_or_error(src, dst, req, few=True) == _plan_or_error(src, dst, req, few=False)
