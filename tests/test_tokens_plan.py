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
from kvferry.errors import LayoutError
from kvferry.layout import HeadGeometry, shape_difference
from kvferry.layout.compare import translation_difference
from kvferry.plan.tokens import TokenPlanner, TokenSpan, chunk_span, plan_token_transfer
from kvferry.transport import LocalTransport, check_rows_in_regions

from .conftest import fill_random, memmove_plan, snapshot

# A head's block as vLLM's CPU kernel keeps it, scaled down (head_bytes 8): 2 rows of 2 bytes (K's dims, each
# a row of tokens), then one of 4 (V, token by token)
KERNEL_PARTS = ((2, 2), (1, 4))


def layout(tokens: int, *, heads: int = 2, head_bytes: int = 8, major: str = "head", per_entry: int = 1,
           pages: int = 24, layers: int = 2, extra_pool: bool = False,
           parts: tuple[tuple[int, int], ...] | None = ()) -> Layout:
    """A pool of K/V buffers (and an fp8 indexer buffer of another page count) at ``tokens`` per page;
    ``parts``: the K/V buffers' order inside a head's block (``HeadGeometry.parts``)."""
    entries = tokens // per_entry
    bufs = []
    for i in range(layers):
        geo = HeadGeometry(heads, head_bytes, entries, major, parts=parts)
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
                for (so, do, n) in token_pieces(sh, dh, h, se, de):
                    out[db.name][dpage, do:do + n] = src_arr[spage, so:so + n]
    return out


def token_pieces(sh: HeadGeometry, dh: HeadGeometry, h: int, se: int, de: int) -> list[tuple[int, int, int]]:
    """Head ``h`` of entry ``se`` of a source page and ``de`` of a destination page: (source offset,
    destination offset, bytes) per piece, spelled out per layout."""
    hb, ts, td = sh.head_bytes, sh.tokens_per_page, dh.tokens_per_page
    if sh.major == "token":
        return [((se * sh.num_heads + h) * hb, (de * dh.num_heads + h) * hb, hb)]
    if not sh.parts:
        return [(h * ts * hb + se * hb, h * td * hb + de * hb, hb)]
    pieces, before = [], 0   # before: bytes of a token in the parts before this one
    for rows, unit in sh.parts:
        for r in range(rows):
            pieces.append((h * ts * hb + ts * (before + r * unit) + se * unit,
                           h * td * hb + td * (before + r * unit) + de * unit, unit))
        before += rows * unit
    return pieces


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
    parts = draw(st.sampled_from(((), KERNEL_PARTS, ((1, 2), (3, 2))))) if major == "head" else ()
    heads = draw(st.integers(1, 3))
    src_l = layout(ts, heads=heads, major=major, per_entry=per_entry, pages=20, parts=parts)
    dst_l = layout(td, heads=heads, major=major, per_entry=per_entry, pages=30, parts=parts)
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


def test_a_head_blocks_parts_are_declared_carried_and_compared() -> None:
    """Parts round-trip through the manifest (a geometry without them keeps version 2's five fields and its
    fingerprint), must add up to the head's bytes, and a page size is translated only between equal,
    declared parts."""
    with_parts = layout(32, parts=KERNEL_PARTS)
    assert Layout.from_manifest(with_parts.to_manifest()) == with_parts
    assert Layout.from_manifest(layout(32, parts=None).to_manifest()) == layout(32, parts=None)
    plain = layout(32)
    assert Layout.from_manifest(plain.to_manifest()) == plain
    assert b"parts" not in repr(plain.shape_key()).encode()
    assert with_parts.shape_fingerprint != plain.shape_fingerprint
    with pytest.raises(LayoutError, match=r"parts \[\(2, 2\), \(1, 2\)\] hold 6 bytes per token, head_bytes is 8"):
        HeadGeometry(2, 8, 32, parts=((2, 2), (1, 2)))
    with pytest.raises(LayoutError, match="parts describe a head's block of a head-major page, major is 'token'"):
        HeadGeometry(2, 8, 32, "token", parts=KERNEL_PARTS)
    with pytest.raises(LayoutError, match=r"part 1: unit bytes must be in 1\.\."):
        HeadGeometry(2, 8, 32, parts=((2, 4), (1, 0)))
    with pytest.raises(LayoutError, match="pieces per token, more than the limit"):
        HeadGeometry(1 << 20, 8, 32, parts=((8, 1),))
    assert translation_difference(with_parts, layout(64, parts=KERNEL_PARTS)) is None
    diff = translation_difference(with_parts, layout(64))
    assert diff == ("pool 'kv': buffer 'L0.k': parts (tokens per page differ, each token's bytes must not) cannot "
                    "be translated: local ((2, 2), (1, 4)), remote ()")
    diff = translation_difference(layout(32, parts=None), layout(64, parts=None))
    assert diff == ("pool 'kv': tokens_per_page (buffer 'L0.k': its kernel's order of a token's bytes inside a head "
                    "is not declared, head geometry parts None) cannot be translated: local 32, remote 64")
    # equal page sizes move whole pages: undeclared parts are no obstacle
    assert translation_difference(layout(32, parts=None), layout(32, parts=None)) is None


def test_a_chunk_straddling_a_prefix_that_holds_the_whole_request_moves_nothing() -> None:
    """Decode holds every token of a 104-token request (SGLang's decode radix cache matched the whole input,
    page 1) and leased nothing; prefill (page 16) starts at its page of token 96: that page's tokens past 104
    are its garbage tail, nothing to move. A second page, beginning past the prefix, is refused by name."""
    straddling = chunk_span("kv", (16, 1), np.array([6]), 6, None, 104, "r")
    assert straddling is None
    assert chunk_span("kv", (16, 1), np.array([6]), 6, np.array([], dtype=np.int64), 104, "r") is None
    with pytest.raises(PlanError, match=r"request 'r', pool 'kv': decode leased no pages .* prefix of 104"):
        chunk_span("kv", (16, 1), np.array([6, 7]), 6, None, 104, "r")
    # one token leased past the prefix: the straddling page moves exactly it
    span = chunk_span("kv", (16, 1), np.array([6]), 6, np.array([9]), 103, "r")
    assert span is not None and (span.start, span.stop, span.dst_first) == (103, 104, 103)
