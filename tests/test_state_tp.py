"""State geometry (``layout.state``) and moving Mamba/GDN state pages between TP sizes (``plan.tp``).

The property test checks the vectorised planner against a slow reference written byte by byte: every byte of
every section of every requested decode page written exactly once, from the model channel it stands for,
and nothing else (padding, other pages, other buffers) touched.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvferry import Buffer, KVMemory, Layout, LayoutError, PlanError, Pool
from kvferry.layout import HeadGeometry, model_difference
from kvferry.layout.state import StateGeometry, StateSection
from kvferry.plan import TPPlanner, plan_decode_rank, shard_layout, source_ranks
from kvferry.plan.ranks import state_slice_of
from kvferry.transport import check_rows_in_regions

from .conftest import memmove_plan

PAIRS = [(1, 1), (1, 2), (2, 1), (2, 2), (2, 4), (4, 2), (1, 4), (4, 1)]
SENTINEL = 0xA5
Parts = list[tuple[int, list[tuple[int, int, bool]]]]


def mamba2_conv(x: int, groups_state: int, kernel: int, elem: int, major: str = "SD",
                groups_sharded: bool = True) -> StateGeometry:
    """Mamba2 conv state ``[x | B | C]``: ``SD`` stores ``[conv_dim, kernel-1]``, ``DS`` ``[kernel-1, conv_dim]``."""
    if major == "SD":
        cb = (kernel - 1) * elem
        return StateGeometry.packed([(1, [(x, cb, True), (groups_state, cb, groups_sharded),
                                          (groups_state, cb, groups_sharded)])])
    return StateGeometry.packed([(kernel - 1, [(x, elem, True), (groups_state, elem, groups_sharded),
                                               (groups_state, elem, groups_sharded)])])


def state_layout(parts_per_buffer: list[Parts], pad: int = 0, pages: int = 6, with_kv: bool = True) -> Layout:
    bufs = []
    for i, parts in enumerate(parts_per_buffer):
        geo = StateGeometry.packed(parts)
        bufs.append(Buffer(f"L{i}.state", geo.extent + pad, pages + i, "f32", "state", i, state=geo))
    pools = [Pool("mamba", bufs)]
    if with_kv:
        kv = HeadGeometry(4, 8, 4, "head")
        pools.insert(0, Pool("kv", [Buffer("L9.k", kv.page_bytes, 5, "bf16", "k", 9, kv)], 4))
    return Layout(pools)


# -- geometry ---------------------------------------------------------------------------------------------
def test_sections_are_bounded_and_disjoint() -> None:
    with pytest.raises(LayoutError, match="sections 0 and 1 overlap"):
        StateGeometry((StateSection(0, 4, 4), StateSection(8, 4, 4)))
    with pytest.raises(LayoutError, match="rows would overlap"):
        StateSection(0, 4, 4, repeats=2, stride=8)
    with pytest.raises(LayoutError, match="channels must be in"):
        StateSection(0, 0, 4)
    with pytest.raises(LayoutError, match="sharded must be a bool"):
        StateSection(0, 1, 4, sharded=1)   # type: ignore[arg-type]
    geo = StateGeometry.packed([(1, [(4, 4, True)])])
    with pytest.raises(LayoutError, match="end at byte 16, past the page of 12 bytes"):
        Buffer("s", 12, 2, state=geo)
    with pytest.raises(LayoutError, match="both head geometry and state geometry"):
        Buffer("s", 16, 2, heads=HeadGeometry.whole_page(16), state=geo)
    # interleaved rows of two sections are disjoint
    StateGeometry((StateSection(0, 2, 2, 3, 8), StateSection(4, 2, 2, 3, 8)))


def test_packed_round_trips_and_reshards() -> None:
    conv = mamba2_conv(64, 16, 4, 2, "DS", groups_sharded=False)
    assert conv.parts() == [(3, [(64, 2, True), (16, 2, False), (16, 2, False)])]
    half = conv.resharded(2)
    assert [s.channels for s in half.sections] == [32, 16, 16]
    assert [s.offset for s in half.sections] == [0, 64, 96] and half.sections[0].stride == 128
    with pytest.raises(LayoutError, match="state section 0: 64 channels do not divide evenly over tp_size 3"):
        conv.resharded(3)
    with pytest.raises(LayoutError, match="not packed"):
        StateGeometry((StateSection(4, 2, 2),)).parts()


def test_manifest_round_trips_state_and_keeps_old_buffers_unchanged() -> None:
    layout = shard_layout(state_layout([[(1, [(8, 6, True), (2, 6, False)]), (1, [(4, 32, True)])]], pad=10), 2, 1)
    back = Layout.from_manifest(layout.to_manifest())
    assert back == layout and back.shape_fingerprint == layout.shape_fingerprint
    assert back.buffer("L0.state").state == layout.buffer("L0.state").state
    plain = Layout([Pool("kv", [Buffer("a", 16, 2)], 4)])
    # a layout without state encodes as before (seven elements a buffer)
    import msgspec
    raw = msgspec.msgpack.decode(plain.to_manifest())
    assert len(raw["pools"][0][2][0]) == 7


def test_model_difference_names_pool_buffer_field_and_values() -> None:
    full = state_layout([[(1, [(8, 6, True), (2, 6, False)])]], with_kv=False)
    a, b = shard_layout(full, 2, 0), shard_layout(full, 4, 3)
    assert model_difference(a, b) is None and a.model_fingerprint == b.model_fingerprint
    assert model_difference(full, a) is None
    other = state_layout([[(1, [(8, 6, True), (2, 4, False)])]], with_kv=False)
    assert model_difference(shard_layout(other, 2, 0), a) == (
        "pool 'mamba', buffer 'L0.state': state section 1: channel_bytes differs: local 4, remote 6")
    wider = state_layout([[(1, [(16, 6, True), (2, 6, False)])]], with_kv=False)
    assert "state section 0: model channels (channels x tp_size when sharded) differs: local 16, remote 8" in \
        str(model_difference(shard_layout(wider, 2, 0), a))
    # replicated on one side, sharded over two ranks on the other: refused
    flipped = state_layout([[(1, [(8, 6, True), (4, 6, True)])]], with_kv=False)
    rep = state_layout([[(1, [(8, 6, True), (2, 6, False)])]], with_kv=False)
    msg = model_difference(shard_layout(flipped, 2, 0), shard_layout(rep, 4, 0))
    assert msg is not None and "model channels" in msg
    two = state_layout([[(1, [(8, 6, True), (2, 6, True)])]], with_kv=False)
    assert "state section 1: sharded (over more than one rank on one side only) differs: local True, " \
        "remote False" in str(model_difference(shard_layout(two, 2, 0), rep))
    # sharded at TP 1 is whole: it pairs with the replicated section of a TP-2 rank
    assert model_difference(two, shard_layout(rep, 2, 1)) is None
    with pytest.raises(PlanError, match="not one model"):
        TPPlanner(KVMemory.allocate(shard_layout(two, 2, 0)), KVMemory.allocate(shard_layout(rep, 4, 0)))
    nogeo = Layout([Pool("mamba", [Buffer("L0.state", 120, 6, "f32", "state", 0)])], 2, 0)
    assert "state geometry differs" in str(model_difference(nogeo, a))


# -- planning ---------------------------------------------------------------------------------------------
def logical_state(full: Layout, seed: int) -> dict[str, list[np.ndarray]]:
    """The model's state: per buffer, per section, ``[pages, repeats, model channels, channel_bytes]``."""
    rng = np.random.default_rng(seed)
    out = {}
    for b in full.pools[-1].buffers:
        out[b.name] = [rng.integers(0, 256, (b.num_pages, s.repeats, s.channels, s.channel_bytes), dtype=np.uint8)
                       for s in b.state.sections]
    return out


def rank_state_memory(full: Layout, tp: int, rank: int, model: dict[str, list[np.ndarray]] | None,
                      seed: int, extra_pages: int = 0) -> KVMemory:
    """Rank ``rank`` of ``tp``, its state sections filled from ``model`` byte by byte (slow and plain); other
    bytes random (prefill) or SENTINEL (decode, ``model`` None)."""
    layout = shard_layout(full.with_capacities({b.name: b.num_pages + extra_pages for b in full.buffers}), tp, rank)
    mem = KVMemory.allocate(layout)
    rng = np.random.default_rng(seed + 77 * rank)
    for b in layout.buffers:
        arr = mem.array(b.name)
        arr[...] = SENTINEL if model is None else rng.integers(0, 256, arr.shape, dtype=np.uint8)
        if model is None or b.state is None:
            continue
        for k, s in enumerate(b.state.sections):
            lo = rank * s.channels if s.sharded else 0
            for page in range(b.num_pages):
                for row in range(s.repeats):
                    at = s.offset + row * s.stride
                    arr[page, at:at + s.row_bytes] = model[b.name][k][page, row, lo:lo + s.channels].reshape(-1)
    return mem


def expected_decode(dst: KVMemory, model: dict[str, list[np.ndarray]], pairs: tuple[np.ndarray, np.ndarray],
                    rank: int) -> dict[str, np.ndarray]:
    """The slow reference: decode rank ``rank``'s state buffers after the move, byte by byte."""
    out = {}
    for b in dst.layout.pools[-1].buffers:
        arr = np.full((b.num_pages, b.page_bytes), SENTINEL, dtype=np.uint8)
        for sp, dp in zip(*pairs):
            for k, s in enumerate(b.state.sections):
                lo = rank * s.channels if s.sharded else 0
                for row in range(s.repeats):
                    for c in range(s.channels):
                        at = s.offset + row * s.stride + c * s.channel_bytes
                        arr[dp, at:at + s.channel_bytes] = model[b.name][k][sp, row, lo + c]
        out[b.name] = arr
    return out


def check_pair(full: Layout, ptp: int, dtp: int, seed: int) -> None:
    model = logical_state(full, seed)
    srcs = [rank_state_memory(full, ptp, r, model, seed) for r in range(ptp)]
    rng = np.random.default_rng(seed)
    state_pool = full.pools[-1]
    n = int(rng.integers(1, state_pool.min_pages + 1))
    src_pages = rng.integers(0, state_pool.min_pages, n)
    dst_pages = rng.permutation(state_pool.min_pages + 2)[:n]
    pages = {state_pool.name: (src_pages, dst_pages)}
    for d in range(dtp):
        dst = rank_state_memory(full, dtp, d, None, seed, extra_pages=2)
        plans = plan_decode_rank(srcs, dst, pages)
        assert set(plans) <= set(source_ranks(d, ptp, dtp))
        counts = {b.name: np.zeros((b.num_pages, b.page_bytes), dtype=np.int64) for b in dst.layout.buffers}
        for plan in plans.values():
            check_rows_in_regions(plan.src_descs, plan.src_memory, "source", "p", "t")
            check_rows_in_regions(plan.dst_descs, dst, "destination", "p", "t")
            for i in range(plan.num_descriptors):   # slow: every row, byte by byte
                row = plan.row(i)
                page_bytes = dst.layout.buffer(row.buffer).page_bytes
                flat = counts[row.buffer].reshape(-1)
                start = row.dst_page * page_bytes + row.dst_offset
                flat[start:start + row.nbytes] += 1
            memmove_plan(plan)
        want = expected_decode(dst, model, (src_pages, dst_pages), d)
        for name, arr in want.items():
            if ptp == dtp:   # one layout on both sides: whole pages rank to rank, padding and all
                arr[dst_pages] = srcs[d].array(name)[src_pages]
                once = np.zeros_like(counts[name])
                once[dst_pages] = 1
                assert np.array_equal(dst.array(name), arr) and np.array_equal(counts[name], once)
                continue
            assert np.array_equal(dst.array(name), arr), (name, ptp, dtp, d)
            geo = dst.layout.buffer(name).state
            mask = np.zeros(arr.shape[1], dtype=bool)
            for s in geo.sections:
                for row in range(s.repeats):
                    mask[s.offset + row * s.stride:s.offset + row * s.stride + s.row_bytes] = True
            once = np.zeros_like(counts[name])
            once[np.ix_(dst_pages, np.flatnonzero(mask))] = 1
            assert np.array_equal(counts[name], once), (name, ptp, dtp, d)
        assert not any(counts[b.name].any() for b in dst.layout.pools[0].buffers if b.state is None)


sections = st.lists(st.tuples(st.integers(1, 3), st.integers(1, 6), st.booleans()), min_size=1, max_size=3)
parts = st.lists(st.tuples(st.integers(1, 3), sections), min_size=1, max_size=2)


@settings(max_examples=25, deadline=None)
@given(st.lists(parts, min_size=1, max_size=2), st.integers(0, 9), st.sampled_from(PAIRS), st.integers(0, 99))
def test_each_decode_rank_gets_exactly_its_channels(buffers: list[Parts], pad: int, pair: tuple[int, int],
                                                    seed: int) -> None:
    # channels as multiples of 4 for sharded sections (every TP size here divides them); replicated as drawn
    scaled = [[(rep, [(c * 4 if sh else c, cb, sh) for c, cb, sh in secs]) for rep, secs in p] for p in buffers]
    check_pair(state_layout(scaled, pad), *pair, seed)


@pytest.mark.parametrize("ptp,dtp", PAIRS)
@pytest.mark.parametrize("major", ["SD", "DS"])
def test_mamba2_conv_and_ssm_across_tp(ptp: int, dtp: int, major: str) -> None:
    """Mamba2 as vLLM lays it out (Granite 4.0-H tiny sizes): conv ``[x | B | C]`` with one group (B and C the
    same on every rank), then the SSM state ``[heads, head_dim, d_state]`` in the same padded page."""
    conv = mamba2_conv(256, 16, 4, 4, major, groups_sharded=False)
    ssm = (1, [(4, 64 * 16 * 4, True)])
    parts = [(p[0], p[1]) for p in conv.parts()] + [ssm]
    check_pair(state_layout([parts], pad=64, with_kv=False), ptp, dtp, 3)


def test_gdn_conv_sections_move_each_by_its_own_heads() -> None:
    """Qwen3-Next's GDN conv ``[q | k | v]``: each sub-block sharded on its own (a contiguous cut would hand
    rank 1 the tail of k and the head of v)."""
    parts = [(1, [(16, 12, True), (16, 12, True), (32, 12, True)]), (1, [(8, 64, True)])]
    check_pair(state_layout([parts], with_kv=False), 1, 2, 5)
    full = state_layout([parts], with_kv=False)
    one, two = shard_layout(full, 1, 0), shard_layout(full, 2, 1)
    piece = state_slice_of(one.buffer("L0.state"), two.buffer("L0.state"), 0, 0, 1, 1, 2)
    assert piece is not None
    assert [(p.src_offset, p.dst_offset, p.nbytes) for p in piece.pieces] == [
        (8 * 12, 0, 8 * 12), (16 * 12 + 8 * 12, 8 * 12, 8 * 12), (32 * 12 + 16 * 12, 16 * 12, 16 * 12),
        (64 * 12 + 4 * 64, 32 * 12, 4 * 64)]


def test_equal_tp_moves_whole_pages_rank_to_rank() -> None:
    full = state_layout([[(1, [(8, 6, True), (2, 6, False)])]], pad=7, with_kv=False)
    src, dst = (KVMemory.allocate(shard_layout(full, 2, 1)) for _ in range(2))
    plan = TPPlanner(src, dst).plan({"mamba": ([0, 1, 2], [3, 4, 5])})
    assert plan.num_descriptors == 1 and plan.nbytes == 3 * src.layout.buffers[0].page_bytes   # one run
    assert not TPPlanner(KVMemory.allocate(shard_layout(full, 2, 0)), dst).writes_anything


def test_digests_cover_a_state_slice_section_by_section() -> None:
    """A state slice's digest covers its sections' bytes only: a flipped byte in a section the pair wrote is
    found, one in the padding (never moved across TP) is not."""
    from kvferry.errors import PageMismatchError
    from kvferry.integrity.digests import digest_plan, verify_digests

    parts = [(3, [(8, 2, True), (2, 2, False)]), (1, [(4, 16, True)])]
    full = state_layout([parts], pad=5, with_kv=False)
    model = logical_state(full, 1)
    srcs = [rank_state_memory(full, 1, 0, model, 1)]
    dst = rank_state_memory(full, 2, 1, None, 1, extra_pages=2)
    (_, plan), = plan_decode_rank(srcs, dst, {"mamba": ([1, 4], [7, 2])}).items()
    memmove_plan(plan)
    digests = digest_plan(plan, "full")
    verify_digests(dst, digests, plan.slices)
    arr = dst.array("L0.state")
    arr[2, -1] ^= 1                                    # padding
    verify_digests(dst, digests, plan.slices)
    geo = dst.layout.buffer("L0.state").state
    arr[2, geo.sections[1].offset + geo.sections[1].stride] ^= 1   # section 1 (replicated B), row 1
    with pytest.raises(PageMismatchError, match=r"buffer 'L0.state' \(layer 0\), page 2"):
        verify_digests(dst, digests, plan.slices)


def test_a_manifest_with_too_many_state_rows_is_refused_before_any_is_built() -> None:
    import msgspec

    from kvferry.layout.manifest import MANIFEST_VERSION, BufferMsg, LayoutMsg, PoolMsg, StateSectionMsg

    sections = [StateSectionMsg(i * 8, 1, 4, 1 << 16, 1 << 20, True) for i in range(2)]
    bufs = [BufferMsg(f"b{i}", 1 << 38, 1, "f32", "state", None, None, sections) for i in range(9)]
    data = msgspec.msgpack.encode(LayoutMsg(MANIFEST_VERSION, [PoolMsg("s", None, bufs)]))
    with pytest.raises(LayoutError, match="state section rows, more than the limit"):
        Layout.from_manifest(data)
