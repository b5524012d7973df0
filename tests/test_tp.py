"""Head geometry in layouts, and planning across tensor-parallel sizes (``kvferry.plan.tp``)."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvferry import Buffer, KVMemory, Layout, LayoutError, PlanError, Pool, plan_transfer
from kvferry.layout import HeadGeometry, model_difference, shape_difference, tp_compatible
from kvferry.plan import (
    TPPlan,
    TPPlanner,
    plan_decode_rank,
    plan_tp_transfer,
    replica_source,
    shard_layout,
    source_ranks,
)
from kvferry.transport import LocalTransport, check_rows_in_regions

from .conftest import memmove_plan
from .netns_peer import check_rank, full_arrays, llama_like, rank_memory, rank_pages, request_pages, run_pair

TPS = (1, 2, 4, 8)


# -- helpers -------------------------------------------------------------------------------------------
def small_layout(heads: int, head_bytes: int, tokens: int, major: str, layers: int, pages: int,
                 replicated: bool) -> Layout:
    bufs = []
    for i in range(layers):
        geo = HeadGeometry(heads, head_bytes, tokens, major)
        bufs += [Buffer(f"L{i}.{r}", geo.page_bytes, pages + r_i, "bf16", r, i, geo)
                 for r_i, r in enumerate(("k", "v"))]
        if replicated:
            rep = HeadGeometry(1, 5, tokens, major, replicated=True)
            bufs.append(Buffer(f"L{i}.idx", rep.page_bytes, pages, "fp8", "index_k", i, rep))
    pools = [Pool("kv", bufs, tokens)]
    if replicated:
        pools.append(Pool("state", [Buffer("state", 24, 4, "uint8", "state", None, HeadGeometry.whole_page(24))]))
    return Layout(pools)


def coverage(plans: list[TPPlan], dst: KVMemory) -> dict[str, np.ndarray]:
    """How many times each destination byte is written by ``plans`` (difference arrays, vectorised)."""
    bufs = dst.layout.buffers
    sizes = np.array([b.nbytes for b in bufs], dtype=np.int64)
    flat_off = np.concatenate(([0], np.cumsum(sizes)[:-1]))
    diff = np.zeros(int(sizes.sum()) + 1, dtype=np.int64)
    bases = np.array([r.address for r in dst.regions], dtype=np.int64)
    for plan in plans:
        ids = plan.row_buffer_ids
        start = flat_off[ids] + plan.dst_descs[:, 0].astype(np.int64) - bases[ids]
        np.add.at(diff, start, 1)
        np.add.at(diff, start + plan.dst_descs[:, 1].astype(np.int64), -1)
    cover = np.cumsum(diff)[:-1]
    return {b.name: cover[o:o + b.nbytes].reshape(b.num_pages, b.page_bytes) for b, o in zip(bufs, flat_off)}


def run_all_decode_ranks(full: Layout, ptp: int, dtp: int, seed: int = 0) -> None:
    """Plan and memmove every decode rank's plans; check bytes, coverage and bounds; and the union."""
    data = full_arrays(full, seed)
    dst_full = full.with_capacities({b.name: b.num_pages + 3 for b in full.buffers})
    srcs = [rank_memory(full, ptp, r, data) for r in range(ptp)]
    pages = request_pages(full, dst_full, seed)
    decoded = []
    for d in range(dtp):
        dst = rank_memory(dst_full, dtp, d, None)
        plans = plan_decode_rank(srcs, dst, pages)
        assert set(plans) <= set(source_ranks(d, ptp, dtp))
        for plan in plans.values():
            check_rows_in_regions(plan.src_descs, plan.src_memory, "source", "p", "t")
            check_rows_in_regions(plan.dst_descs, dst, "destination", "p", "t")
        cover = coverage(list(plans.values()), dst)
        for pool in full.pools:
            dpages = np.asarray(pages[pool.name][1])
            for b in pool.buffers:  # every requested byte exactly once (replicated too), nothing else
                want = np.zeros_like(cover[b.name])
                want[dpages] = 1
                assert np.array_equal(cover[b.name], want), (b.name, d)
        for plan in plans.values():
            memmove_plan(plan)
        assert check_rank(dst, full, data, dtp, d, pages) == []
        decoded.append(dst)
    assert_union_is_full(full, dtp, decoded, data, pages)


def assert_union_is_full(full: Layout, dtp: int, decoded: list[KVMemory], data: dict[str, np.ndarray],
                         pages: dict[str, tuple[list[int], list[int]]]) -> None:
    """Head by head: the decode ranks' pages put side by side are the source pages of the full KV."""
    for pool in full.pools:
        src, dst = (np.asarray(x) for x in pages[pool.name])
        for b in pool.buffers:
            h = b.heads
            parts = [m.array(b.name)[dst] for m in decoded]
            if h.replicated or dtp == 1:
                assert all(np.array_equal(p, data[b.name][src]) for p in parts)
                continue
            n = len(src)
            if h.major == "head":
                union = np.concatenate([p.reshape(n, -1, h.tokens_per_page * h.head_bytes) for p in parts], 1)
            else:
                union = np.concatenate([p.reshape(n, h.tokens_per_page, -1, h.head_bytes) for p in parts], 2)
            assert np.array_equal(union.reshape(n, -1), data[b.name][src]), b.name


# -- head geometry in the layout -------------------------------------------------------------------------
def test_head_geometry_is_checked() -> None:
    geo = HeadGeometry(8, 256, 16)
    assert geo.page_bytes == 8 * 256 * 16
    with pytest.raises(LayoutError, match="page_bytes 100 != 8 heads x 256 B x 16 tokens"):
        Buffer("k", 100, 4, heads=geo)
    with pytest.raises(LayoutError, match="major must be one of"):
        HeadGeometry(8, 256, 16, "row")
    with pytest.raises(LayoutError, match="replicated must be a bool"):
        HeadGeometry(8, 256, 16, "head", 1)  # type: ignore[arg-type]
    with pytest.raises(LayoutError, match="num_heads must be in"):
        HeadGeometry(0, 256, 16)
    with pytest.raises(LayoutError, match="tp_rank must be an int in 0..1"):
        Layout([Pool("p", [Buffer("a", 8, 1)])], tp_size=2, tp_rank=2)


def test_manifest_round_trips_heads_and_tp() -> None:
    layout = shard_layout(llama_like(), 4, 3)
    again = Layout.from_manifest(layout.to_manifest())
    assert again == layout and (again.tp_size, again.tp_rank) == (4, 3)
    assert again.buffer("L0.k").heads == HeadGeometry(2, 256, 16, "head")
    mem = KVMemory.allocate(layout)
    remote = KVMemory.from_manifest(mem.manifest())
    assert remote.layout == layout and remote.regions == mem.regions


def test_fingerprints_across_tp_sizes() -> None:
    full = llama_like()
    tp2, tp4 = shard_layout(full, 2, 1), shard_layout(full, 4, 0)
    assert shape_difference(tp2, tp4).startswith("tp_size differs: local 2, remote 4")
    assert tp2.shape_fingerprint != tp4.shape_fingerprint
    assert shard_layout(full, 4, 0).shape_fingerprint == shard_layout(full, 4, 3).shape_fingerprint
    assert tp2.model_fingerprint == tp4.model_fingerprint == full.model_fingerprint
    assert tp_compatible(tp2, tp4) and model_difference(tp2, full) is None
    # Without head geometry and TP, fingerprints are what they were before either existed.
    plain = Layout([Pool("p", [Buffer("a", 64, 4, "bf16", "kv", 0)], 16)])
    assert plain.shape_fingerprint == Layout(plain.pools, 1, 0).shape_fingerprint
    assert plain.shape_key() == (("p", 16, (("a", 64, "bf16", "kv", 0),)),)


@pytest.mark.parametrize("other, message", [
    (lambda: llama_like(heads=16), "total heads \\(num_heads x tp_size\\) differs: local 8, remote 16"),
    (lambda: llama_like(major="token"), "major differs: local 'head', remote 'token'"),
    (lambda: llama_like(head_bytes=128), "head_bytes differs: local 256, remote 128"),
    (lambda: llama_like(tokens=32), "tokens_per_page differs"),
])
def test_other_models_are_refused(other, message) -> None:
    with pytest.raises(PlanError, match=message):
        TPPlanner(KVMemory.allocate(shard_layout(llama_like(), 2, 0)), KVMemory.allocate(other()))


def test_buffers_without_geometry_go_only_between_equal_tp() -> None:
    pool = [Pool("p", [Buffer("a", 64, 4)])]
    assert model_difference(Layout(pool, 2, 0), Layout(pool, 2, 1)) is None
    assert "tp_size (the buffer has no head geometry" in model_difference(Layout(pool, 2, 0), Layout(pool, 4, 0))
    with pytest.raises(LayoutError, match="has no head geometry: cannot split it over 2 ranks"):
        shard_layout(Layout(pool), 2, 0)


def test_replicated_must_match_exactly() -> None:
    def with_rep(heads: int, replicated: bool) -> Layout:
        geo = HeadGeometry(heads, 16, 4, "head", replicated)
        return Layout([Pool("p", [Buffer("x", geo.page_bytes, 4, heads=geo)])])

    assert "replicated differs" in model_difference(with_rep(1, True), with_rep(1, False))
    assert "num_heads (replicated) differs" in model_difference(with_rep(1, True), with_rep(2, True))


# -- rank arithmetic -------------------------------------------------------------------------------------
@pytest.mark.parametrize("ptp, dtp, d, ranks, replica", [
    (8, 2, 0, [0, 1, 2, 3], 0), (8, 2, 1, [4, 5, 6, 7], 4), (2, 8, 5, [1], 1), (4, 4, 3, [3], 3),
    (1, 8, 7, [0], 0), (8, 1, 0, list(range(8)), 0),
])
def test_source_ranks(ptp: int, dtp: int, d: int, ranks: list[int], replica: int) -> None:
    assert list(source_ranks(d, ptp, dtp)) == ranks
    assert replica_source(d, ptp, dtp) == replica
    with pytest.raises(PlanError, match="decode rank 8 is not in a TP group of size 8"):
        source_ranks(8, ptp, 8)


# -- property tests --------------------------------------------------------------------------------------
@given(ptp=st.sampled_from(TPS), dtp=st.sampled_from(TPS), per=st.integers(1, 2),
       head_bytes=st.integers(1, 6), tokens=st.integers(1, 4), major=st.sampled_from(["head", "token"]),
       layers=st.integers(1, 2), pages=st.integers(3, 9), replicated=st.booleans(), seed=st.integers(0, 99))
def test_union_of_decode_ranks_is_the_full_kv(ptp: int, dtp: int, per: int, head_bytes: int, tokens: int,
                                              major: str, layers: int, pages: int, replicated: bool,
                                              seed: int) -> None:
    heads = max(ptp, dtp) * per  # TP sizes are powers of two: divisible by both
    full = small_layout(heads, head_bytes, tokens, major, layers, pages, replicated)
    run_all_decode_ranks(full, ptp, dtp, seed)


@given(heads=st.integers(1, 24), tp=st.sampled_from(TPS[1:]), major=st.sampled_from(["head", "token"]))
def test_uneven_heads_are_refused(heads: int, tp: int, major: str) -> None:
    full = small_layout(heads, 4, 2, major, 1, 3, replicated=True)
    if heads % tp == 0:
        assert shard_layout(full, tp, tp - 1).buffer("L0.k").heads.num_heads == heads // tp
        return
    with pytest.raises(LayoutError, match=f"{heads} KV heads do not divide evenly over tp_size {tp}"):
        shard_layout(full, tp, 0)


@given(tp=st.sampled_from(TPS), major=st.sampled_from(["head", "token"]), seed=st.integers(0, 99))
def test_equal_tp_is_plan_transfer(tp: int, major: str, seed: int) -> None:
    """At P == D every rank pair moves whole pages: the rows are exactly plan_transfer's."""
    full = llama_like(1, 12, 4, major, heads=8, head_bytes=4)
    data = full_arrays(full, seed)
    pages = request_pages(full, full, seed)
    for r in range(tp):
        src, dst = rank_memory(full, tp, r, data), rank_memory(full, tp, r, None)
        ours, ref = plan_tp_transfer(src, dst, pages), plan_transfer(src, dst, pages)
        assert np.array_equal(ours.src_descs, ref.src_descs)
        assert np.array_equal(ours.dst_descs, ref.dst_descs)


@given(ptp=st.sampled_from(TPS), dtp=st.sampled_from(TPS), major=st.sampled_from(["head", "token"]),
       plans=st.lists(st.tuples(st.integers(1, 6), st.sampled_from([None, ("L0.k",), ("L0.idx", "L1.v"),
                                                                     ("L1.k", "L1.v", "state")])),
                      min_size=2, max_size=6), seed=st.integers(0, 99))
def test_one_planner_plans_each_request_as_a_fresh_one(ptp: int, dtp: int, major: str,
                                                     plans: list[tuple[int, tuple[str, ...] | None]],
                                                     seed: int) -> None:
    """``TPPlanner`` keeps what a pool and buffer selection need across requests (``_compile``): requests
    of other sizes and other selections on one planner get exactly the rows a new planner gives each."""
    full = small_layout(8, 3, 2, major, 2, 12, replicated=True)
    rng = np.random.default_rng(seed)
    src, dst = rank_memory(full, ptp, ptp - 1, None), rank_memory(full, dtp, 0, None)
    kept = TPPlanner(src, dst)
    for n, buffers in plans:
        pages = {"kv": (rng.choice(12, n, replace=False), rng.choice(12, n, replace=False)),
                 "state": (rng.choice(4, 1), rng.choice(4, 1))}
        ours, fresh = kept.plan(pages, buffers), TPPlanner(src, dst).plan(pages, buffers)
        for name in ("src_descs", "dst_descs", "row_buffer_ids"):
            assert np.array_equal(getattr(ours, name), getattr(fresh, name)), name
        assert [(p.pool, p.buffers) for p in ours.pool_pages] == [(p.pool, p.buffers) for p in fresh.pool_pages]


# -- descriptor counts -----------------------------------------------------------------------------------
@pytest.mark.parametrize("major", ["head", "token"])
def test_row_counts(major: str) -> None:
    """Head-major: one row per (page, sharded buffer); token-major: one per (page, token, buffer)."""
    full = small_layout(8, 4, 4, major, 2, 16, replicated=False)
    src = rank_memory(full, 8, 5, full_arrays(full, 0))
    dst = rank_memory(full, 2, 1, None)
    pages = {"kv": (np.arange(0, 12, 2), np.arange(6))}  # 6 pages, no source runs
    plan = plan_tp_transfer(src, dst, pages)
    assert plan.num_descriptors == 6 * 4 * (1 if major == "head" else 4)
    assert plan.nbytes == 6 * 4 * 4 * 4  # pages x buffers x tokens x one head of 4 B
    contiguous = plan_tp_transfer(src, dst, {"kv": (np.arange(6), np.arange(6))})
    assert contiguous.num_descriptors == plan.num_descriptors  # slices of pages never merge across pages
    # Prefill rank 5 of 8 holds head 5, decode rank 1 of 2 heads 4..7: local head 1 on the decode side.
    row = plan.row(1)
    if major == "head":  # second row: page 2 -> 1, the head at 1 x (4 tokens x 4 B)
        assert (row.buffer, row.src_page, row.dst_page, row.src_offset, row.dst_offset) == ("L0.k", 2, 1, 0, 16)
    else:  # second row: token 1 of page 0 -> 0: source token stride 1 head, decode 4 heads, + head 1
        assert (row.buffer, row.src_page, row.dst_page, row.src_offset, row.dst_offset) == ("L0.k", 0, 0, 4, 20)


def test_plan_validation_and_surface() -> None:
    full = llama_like(1, 8, 4, heads=8, head_bytes=4)
    srcs = [rank_memory(full, 4, r, None) for r in range(4)]
    dst = rank_memory(full, 2, 0, None)
    with pytest.raises(PlanError, match="destination page 1 appears more than once"):
        plan_tp_transfer(srcs[0], dst, {"kv": ([0, 1], [1, 1])})
    with pytest.raises(PlanError, match="buffer 'L0.idx': source page 5 is out of range"):
        plan_tp_transfer(srcs[0], dst, {"kv": ([5], [0])})
    with pytest.raises(PlanError, match="srcs\\[0\\] is rank 3 of a TP group of 4"):
        plan_decode_rank(srcs[::-1], dst, {"kv": ([0], [0])})
    plans = plan_decode_rank(srcs, dst, {"kv": ([0, 1], [2, 3]), "state": ([1], [0])})
    assert sorted(plans) == [0, 1]
    # rank 0 also sends the replicated buffers; whole-page rows come first in each pool
    assert plans[0].buffer_names == ("L0.idx", "L0.k", "L0.v", "state")
    assert plans[1].buffer_names == ("L0.k", "L0.v")
    layer = TPPlanner(srcs[0], dst).plan({"kv": ([0], [0])}, buffers=["L0.v"])
    assert layer.buffer_names == ("L0.v",)
    with pytest.raises(PlanError, match="cannot index per-page prepared lists"):
        plans[0].page_selectors()
    assert "rank 0 -> 0" in repr(plans[0])


# -- transports ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("ptp, dtp", [(4, 2), (2, 4)])
@pytest.mark.parametrize("major", ["head", "token"])
def test_local_transport_across_tp(ptp: int, dtp: int, major: str) -> None:
    """One LocalTransport per rank; each decode rank hears from exactly the ranks it needs."""
    full = llama_like(2, 12, 16, major)
    data = full_arrays(full, 3)
    src_mems = [rank_memory(full, ptp, r, data) for r in range(ptp)]
    dst_mems = [rank_memory(full, dtp, d, None) for d in range(dtp)]
    pre = [LocalTransport() for _ in range(ptp)]
    dec = [LocalTransport() for _ in range(dtp)]
    pre_meta = [t.register(m) for t, m in zip(pre, src_mems)]
    dec_meta = [t.register(m) for t, m in zip(dec, dst_mems)]
    pages = request_pages(full, full, 3)
    try:
        for d, (t, meta) in enumerate(zip(dec, dec_meta)):
            remote = KVMemory.from_manifest(dst_mems[d].manifest())
            srcs_seen = [KVMemory.from_manifest(m.manifest()) for m in src_mems]
            for r, plan in plan_decode_rank(srcs_seen, remote, pages).items():
                peer = pre[r].add_peer(meta)
                t.add_peer(pre_meta[r])
                mine = TPPlanner(src_mems[r], remote).plan(pages)  # prefill plans with its own memory
                assert np.array_equal(mine.dst_descs, plan.dst_descs)
                pre[r].write(mine, peer, f"{r}->{d}".encode()).wait(1.0)
            heard = sorted(m.decode() for _, m in t.get_notifications())
            assert heard == sorted(f"{r}->{d}" for r in source_ranks(d, ptp, dtp))
            assert check_rank(dst_mems[d], full, data, dtp, d, pages) == []
    finally:
        for t in pre + dec:
            t.close()


@pytest.mark.nixl
@pytest.mark.skipif(importlib.util.find_spec("nixl") is None, reason="nixl is not installed")
@pytest.mark.parametrize("ptp, dtp, major", [(4, 2, "head"), (2, 4, "head"), (4, 2, "token")])
def test_nixl_two_processes_across_tp(ptp: int, dtp: int, major: str) -> None:
    """Prefill and decode processes, one NixlTransport per rank; decode checks every page of every buffer."""
    out = run_pair(["--ptp", str(ptp), "--dtp", str(dtp), "--major", major])
    assert out["ok"] and out["decode"]["errors"] == []
    assert out["decode"]["notifications"] == out["decode"]["expected"] > 0


def test_rank_pages_partition_heads() -> None:
    """The test oracle itself: rank slices of a page, side by side, are the page."""
    full = llama_like(1, 6, 4, "token", heads=8, head_bytes=2)
    data = full_arrays(full, 1)["L0.k"]
    buf = full.buffer("L0.k")
    parts = [rank_pages(data, buf, 4, r).reshape(6, 4, 2, 2) for r in range(4)]
    assert np.array_equal(np.concatenate(parts, axis=2).reshape(6, -1), data)
