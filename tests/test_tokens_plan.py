"""Planning between different page sizes (``kvferry.plan.tokens``) and the handshake's translation check.

The property test compares the vectorised planner against a reference that walks every token, head and
buffer in Python: every token's bytes land exactly once where decode's page for that token keeps them, and
no other byte of decode's memory changes.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from kvferry import Buffer, KVMemory, Layout, PlanError, Pool
from kvferry.layout import HeadGeometry, shape_difference
from kvferry.layout.compare import translation_difference
from kvferry.plan.tokens import TokenPlanner, TokenSpan, plan_token_transfer
from kvferry.transport import LocalTransport, check_rows_in_regions

from .conftest import fill_random, memmove_plan, snapshot


def layout(tokens: int, *, heads: int = 2, head_bytes: int = 8, major: str = "head", per_entry: int = 1,
           pages: int = 24, layers: int = 2, extra_pool: bool = False) -> Layout:
    """A pool of K/V buffers (and an fp8 indexer buffer of another page count) at ``tokens`` per page."""
    entries = tokens // per_entry
    bufs = []
    for i in range(layers):
        geo = HeadGeometry(heads, head_bytes, entries, major)
        bufs += [Buffer(f"L{i}.k", geo.page_bytes, pages, "bf16", "k", i, geo),
                 Buffer(f"L{i}.v", geo.page_bytes, pages + 3, "bf16", "v", i, geo)]
        idx = HeadGeometry(1, 4, entries, major)
        bufs.append(Buffer(f"L{i}.idx", idx.page_bytes, pages - 2, "fp8", "index_k", i, idx))
    pools = [Pool("kv", bufs, tokens)]
    if extra_pool:
        pools.append(Pool("state", [Buffer("state", 40, 6, "uint8", "state", None, HeadGeometry.whole_page(40))]))
    return Layout(pools)


def reference(src: KVMemory, dst: KVMemory, span: TokenSpan, pool: str = "kv") -> dict[str, np.ndarray]:
    """Decode's buffers after the span, token by token, head by head (the slow, obvious way)."""
    out = snapshot(dst)
    sp, dp = src.layout.pool(pool), dst.layout.pool(pool)
    ts, td = sp.tokens_per_page, dp.tokens_per_page
    src_end = span.src_first + len(span.src_pages) * ts
    dst_end = span.dst_first + len(span.dst_pages) * td
    start = max(span.src_first, span.dst_first) if span.start is None else span.start
    stop = min(src_end, dst_end) if span.stop is None else span.stop
    for sb, db in zip(sp.buffers, dp.buffers):
        sh, dh = sb.heads, db.heads
        c = ts // sh.tokens_per_page
        stop_c = -(-stop // c) * c
        src_arr = src.array(sb.name)
        for t in range(start, stop_c, c):
            spage = span.src_pages[(t - span.src_first) // ts]
            se = (t - span.src_first) % ts // c
            dpage = span.dst_pages[(t - span.dst_first) // td]
            de = (t - span.dst_first) % td // c
            for h in range(sh.num_heads):
                hb = sh.head_bytes
                if sh.major == "head":
                    so, do = h * sh.tokens_per_page * hb + se * hb, h * dh.tokens_per_page * hb + de * hb
                else:
                    so, do = (se * sh.num_heads + h) * hb, (de * dh.num_heads + h) * hb
                out[db.name][dpage, do:do + hb] = src_arr[spage, so:so + hb]
    return out


def written_once(plan, dst: KVMemory) -> None:
    """No destination byte is written twice."""
    for i, buf in enumerate(dst.layout.buffers):
        rows = plan.dst_descs[plan.row_buffer_ids == i]
        if not len(rows):
            continue
        base = dst.regions[i].address
        count = np.zeros(buf.nbytes + 1, dtype=np.int64)
        np.add.at(count, rows[:, 0].astype(np.int64) - base, 1)
        np.add.at(count, (rows[:, 0] + rows[:, 1]).astype(np.int64) - base, -1)
        assert np.cumsum(count).max() <= 1, f"{buf.name}: a byte written twice"


@st.composite
def cases(draw: st.DrawFn) -> tuple[Layout, Layout, TokenSpan]:
    per_entry = draw(st.sampled_from((1, 1, 4)))
    sizes = [per_entry * k for k in (1, 2, 3, 4, 8, 16)]
    ts, td = draw(st.sampled_from(sizes)), draw(st.sampled_from(sizes))
    major = draw(st.sampled_from(("head", "token")))
    heads = draw(st.integers(1, 3))
    src_l = layout(ts, heads=heads, major=major, per_entry=per_entry, pages=20)
    dst_l = layout(td, heads=heads, major=major, per_entry=per_entry, pages=30)
    src_first = draw(st.integers(0, 3)) * ts
    dst_first = draw(st.integers(0, 3)) * td
    lo = max(src_first, dst_first)
    src_cap = min(b.num_pages for b in src_l.pools[0].buffers)
    dst_cap = min(b.num_pages for b in dst_l.pools[0].buffers)
    room = min(src_first + src_cap * ts, dst_first + dst_cap * td) - lo
    assume(room > 0)
    tokens = draw(st.integers(1, min(room, 160)))
    ns = -(-(lo + tokens - src_first) // ts)
    nd = -(-(lo + tokens - dst_first) // td)
    src_pages = draw(st.lists(st.integers(0, src_cap - 1), min_size=ns, max_size=ns))
    dst_pages = draw(st.permutations(range(dst_cap)))[:nd]
    return src_l, dst_l, TokenSpan(src_pages, dst_pages, src_first, dst_first)


@given(cases())
def test_every_token_lands_once_where_decode_keeps_it_and_nothing_else_changes(case) -> None:
    src_l, dst_l, span = case
    src, dst = KVMemory.allocate(src_l), KVMemory.allocate(dst_l)
    fill_random(src, 1)
    fill_random(dst, 2)
    expected = reference(src, dst, span)
    plan = plan_token_transfer(src, dst, {"kv": span})
    check_rows_in_regions(plan.src_descs, src, "source", "test", "plan")
    check_rows_in_regions(plan.dst_descs, dst, "destination", "test", "plan")
    written_once(plan, dst)
    memmove_plan(plan)
    for name, arr in expected.items():
        assert np.array_equal(dst.array(name), arr), name


def test_rows_are_merged_where_adjacent_on_both_sides() -> None:
    # Equal page sizes: whole pages, one row per (buffer, run of consecutive pages), as plan_transfer posts
    src, dst = KVMemory.allocate(layout(32)), KVMemory.allocate(layout(32))
    plan = plan_token_transfer(src, dst, {"kv": TokenSpan([3, 4, 5, 9], [0, 1, 2, 7])})
    assert plan.num_descriptors == 2 * 6 and plan.nbytes == 4 * sum(b.page_bytes for b in src.layout.buffers)
    # 32 -> 64, head-major: a row per (source page, head), but where one ends a page on both sides and the
    # next begins one: source page 4's last head runs into page 5's first, as decode's page 0 into page 1.
    # The 1-head indexer is token-major in effect: pages 3, 4, 5 are one run into decode's 0 and 1.
    src, dst = KVMemory.allocate(layout(32)), KVMemory.allocate(layout(64))
    plan = plan_token_transfer(src, dst, {"kv": TokenSpan([3, 4, 5, 9], [0, 1])})
    assert np.bincount(plan.row_buffer_ids).tolist() == [7, 7, 2] * 2
    # token-major: source pages 3, 4, 5 run into decode's 0 and 1 whole; 9 is apart in the source
    src = KVMemory.allocate(layout(32, major="token"))
    dst = KVMemory.allocate(layout(64, major="token"))
    plan = plan_token_transfer(src, dst, {"kv": TokenSpan([3, 4, 5, 9], [0, 1])})
    assert np.bincount(plan.row_buffer_ids).tolist() == [2] * 6


def test_a_prefix_decode_holds_is_skipped_exactly() -> None:
    """Decode at 64 tokens a page holds the first 64 tokens; prefill (32 a page) sends its whole list, and only
    tokens 64.. move (prefill's pages 2 and 3 into decode's one page)."""
    src, dst = KVMemory.allocate(layout(32)), KVMemory.allocate(layout(64))
    fill_random(src, 3)
    before = snapshot(dst)
    span = TokenSpan([5, 6, 7, 8], [9], src_first=0, dst_first=64)
    plan = plan_token_transfer(src, dst, {"kv": span})
    memmove_plan(plan)
    after = snapshot(dst)
    assert plan.nbytes == 64 * sum(b.page_bytes // 32 for b in src.layout.buffers)
    for name, arr in reference(src, KVMemory.allocate(layout(64)), span).items():
        assert np.array_equal(after[name][9], arr[9])
        changed = np.flatnonzero((after[name] != before[name]).any(axis=1))
        assert set(changed.tolist()) <= {9}


def test_a_selection_of_buffers_plans_only_those() -> None:
    src, dst = KVMemory.allocate(layout(64)), KVMemory.allocate(layout(32))
    plan = TokenPlanner(src, dst).plan({"kv": TokenSpan([1, 2], [3, 4, 5, 6])}, buffers=["L1.k", "L1.v"])
    assert plan.buffer_names == ("L1.k", "L1.v")


def test_posted_through_a_transport_the_bytes_arrive() -> None:
    src, dst = KVMemory.allocate(layout(16)), KVMemory.allocate(layout(48))
    fill_random(src, 4)
    span = TokenSpan([0, 5, 2, 7, 1], [4, 2])
    expected = reference(src, dst, span)
    prefill, decode = LocalTransport(), LocalTransport()
    try:
        prefill.register(src)
        peer = prefill.add_peer(decode.register(dst))
        plan = plan_token_transfer(src, dst, {"kv": span})
        prefill.write(plan, peer, b"done", "translated")
        assert decode.get_notifications() == [(prefill.agent_name, b"done")]
    finally:
        prefill.close()
        decode.close()
    for name, arr in expected.items():
        assert np.array_equal(dst.array(name), arr), name


# -- refusals ------------------------------------------------------------------------------------------
def test_pages_outside_the_span_or_the_buffers_are_refused() -> None:
    src, dst = KVMemory.allocate(layout(32)), KVMemory.allocate(layout(64))
    planner = TokenPlanner(src, dst)
    with pytest.raises(PlanError, match=r"pool 'kv'.*destination.*page 30"):
        planner.plan({"kv": TokenSpan([1, 2], [30])})
    with pytest.raises(PlanError, match=r"pool .kv.: destination page 5 appears more than once"):
        planner.plan({"kv": TokenSpan([1, 2, 3, 4], [5, 5])})
    with pytest.raises(PlanError, match=r"first token 32 is not a page boundary of 64 tokens"):
        planner.plan({"kv": TokenSpan([1, 2], [5], dst_first=32)})
    with pytest.raises(PlanError, match=r"tokens \[0, 100\) are not covered by both sides' pages"):
        planner.plan({"kv": TokenSpan([1, 2], [5, 6], stop=100)})


def test_the_handshake_check_accepts_what_may_differ_and_names_what_may_not() -> None:
    assert translation_difference(layout(32), layout(64)) is None
    assert "tokens_per_page differs: local 32, remote 64" in shape_difference(layout(32), layout(64))
    assert translation_difference(layout(32, per_entry=4), layout(128, per_entry=4)) is None
    diff = translation_difference(layout(32, major="token"), layout(64))
    assert diff == ("pool 'kv': buffer 'L0.k': major (tokens per page differ, each token's bytes must not) "
                    "cannot be translated: local token, remote head")
    diff = translation_difference(layout(32, heads=2), layout(64, heads=4))
    assert "buffer 'L0.k': num_heads" in diff and "local 2, remote 4" in diff
    diff = translation_difference(layout(32, per_entry=4), layout(64, per_entry=2))
    assert "tokens per entry" in diff and "local 32/8, remote 64/32" in diff
    bare = Layout([Pool("kv", [Buffer("L0", 32 * 16, 8, "bf16", "kv", 0)], 32)])
    bare64 = Layout([Pool("kv", [Buffer("L0", 64 * 16, 8, "bf16", "kv", 0)], 64)])
    diff = translation_difference(bare, bare64)
    assert diff == ("pool 'kv': tokens_per_page (buffer 'L0' has no head geometry: nothing says where a token "
                    "lies in its page) cannot be translated: local 32, remote 64")
    assert translation_difference(layout(32, extra_pool=True), layout(64, extra_pool=True)) is None
    with pytest.raises(PlanError, match="cannot be translated: pool 'kv'"):
        TokenPlanner(KVMemory.allocate(bare), KVMemory.allocate(bare64))
    # a dtype still has to match, whatever the page sizes
    other = Layout([Pool("kv", [Buffer(b.name, b.page_bytes, b.num_pages, "fp8" if b.kind == "k" else b.dtype,
                                       b.kind, b.layer, b.heads) for b in layout(64).buffers], 64)])
    assert translation_difference(layout(32), other) == ("pool 'kv', buffer 'L0.k': dtype differs: local 'bf16', "
                                                         "remote 'fp8'")
