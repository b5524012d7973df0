"""Fault injection: the buffer-0 slot-count sender and the byte flipper, and that kvferry catches both."""

from __future__ import annotations

import numpy as np
import pytest

from kvferry import KVMemory, Layout, LayoutError, TransportError, plan_transfer
from kvferry.diagnostics.diff import diff_pages
from kvferry.diagnostics.faults import (
    FaultKind,
    FaultSpec,
    FaultSpecError,
    FaultyPlan,
    buffer0_slot_count_descs,
    flip_bytes,
)
from kvferry.errors import PageMismatchError
from kvferry.integrity import digest_plan, verify_digests
from kvferry.layout.presets import token_salad
from kvferry.transport import LocalTransport

from .conftest import fill_random, memmove_plan, snapshot

# token_salad(16): c4.kv.L0, c4.kv.L2 (16 pages), c4.idx.L0, c4.idx.L2 (8 pages, bf16), c128.kv.L1, c128.kv.L3
PAGES = {"c4": (np.array([1, 2, 3, 6]), np.array([5, 6, 7, 0])), "c128": (np.array([4, 9]), np.array([10, 2]))}


@pytest.fixture
def salad() -> tuple[KVMemory, KVMemory]:
    layout: Layout = token_salad(num_pages=16)
    assert [b.num_pages for b in layout.pool("c4").buffers] == [16, 16, 8, 8]
    src, dst = KVMemory.allocate(layout), KVMemory.allocate(layout)
    fill_random(src, 11)
    return src, dst


def post(plan, src: KVMemory, dst: KVMemory) -> None:
    """Execute through the reference transport, as the control plane would."""
    with LocalTransport() as prefill, LocalTransport() as decode:
        prefill.register(src)
        peer = prefill.add_peer(decode.register(dst))
        prefill.write(plan, peer, b"done").wait(5.0)
        assert decode.get_notifications() == [(prefill.agent_name, b"done")]


def test_kvferry_plan_is_clean_on_the_same_request(salad) -> None:
    src, dst = salad
    plan = plan_transfer(src, dst, PAGES)
    post(plan, src, dst)
    assert diff_pages(src, dst, PAGES).clean
    verify_digests(dst, digest_plan(plan, "full"))
    for pool, (s, d) in PAGES.items():
        for buf in src.layout.pool(pool).buffers:
            np.testing.assert_array_equal(dst.array(buf.name)[d], src.array(buf.name)[s])


def test_buffer0_slots_rows_hit_the_wrong_block_from_the_second_index_buffer(salad) -> None:
    src, dst = salad
    fp = buffer0_slot_count_descs(src, dst, PAGES)
    assert isinstance(fp, FaultyPlan)
    descs = dst.page_descs()
    # c4.idx.L2 is buffer 3: buggy index 3 * 16 + p lands in c128.kv.L1 (block start 16+16+8+8 = 48).
    rows = fp.buffer_rows("c4.idx.L2")
    expect = [int(descs[48 + p, 0]) for p in PAGES["c4"][1]]
    assert fp.dst_descs[rows, 0].tolist() == expect
    # The first index buffer still starts where 2 x 16 says: its rows are right.
    idx0 = fp.buffer_rows("c4.idx.L0")
    want = [dst.address("c4.idx.L0") + int(p) * 64 * 256 for p in PAGES["c4"][1]]
    assert fp.dst_descs[idx0, 0].tolist() == want
    # c128.kv.L3 (buffer 5) indexes past the 80-entry list: NIXL would refuse; those rows are dropped.
    assert fp.dropped == 2 and len(fp.page_selectors()[0]) == fp.num_descriptors


def test_buffer0_slots_through_a_transport_is_caught_and_localised(salad) -> None:
    src, dst = salad
    before = snapshot(dst)
    fp = buffer0_slot_count_descs(src, dst, PAGES)
    post(fp, src, dst)
    # Bytes did move, and where the bug says: c128.kv.L1 page d got c128.kv.L1 page s (c4 page numbers).
    for s, d in zip(*PAGES["c4"]):
        np.testing.assert_array_equal(dst.array("c128.kv.L1")[d], src.array("c128.kv.L1")[s])
    assert not dst.array("c4.idx.L2").any() and (dst.array("c4.idx.L2") == before["c4.idx.L2"]).all()
    report = diff_pages(src, dst, PAGES)
    hit = report.by_buffer()
    assert "c4.idx.L2" in hit and hit["c4.idx.L2"]["zeros"] == 4
    assert not {"c4.kv.L0", "c4.kv.L2", "c4.idx.L0"} & set(hit)
    with pytest.raises(PageMismatchError) as info:
        verify_digests(dst, digest_plan(plan_transfer(src, dst, PAGES), "full"))
    named = {m.buffer for m in info.value.mismatches}
    assert "c4.idx.L2" in named and "c4.idx.L0" not in named
    assert "c4.idx.L2" in str(info.value)


def test_strict_mode_refuses_rows_nixl_would_refuse(salad) -> None:
    src, dst = salad
    with pytest.raises(TransportError, match="c128.kv.L3"):
        buffer0_slot_count_descs(src, dst, PAGES, strict=True)


def test_faulty_rows_stay_inside_registered_memory(salad) -> None:
    src, dst = salad
    fp = buffer0_slot_count_descs(src, dst, PAGES)
    from kvferry.transport import check_rows_in_regions

    check_rows_in_regions(fp.src_descs, src, "source", "peer", "t")
    check_rows_in_regions(fp.dst_descs, dst, "destination", "peer", "t")
    memmove_plan(fp)  # and a plain memmove executes them as well


def test_flip_bytes_flips_and_reports(salad) -> None:
    _, dst = salad
    before = dst.array("c4.idx.L2").copy()
    flips = flip_bytes(dst, "c4.idx.L2", [3, 5], seed=2)
    assert [p for p, _ in flips] == [3, 5]
    changed = np.argwhere(dst.array("c4.idx.L2") != before)
    assert sorted(map(tuple, changed.tolist())) == sorted(flips)
    with pytest.raises(LayoutError, match="outside"):
        flip_bytes(dst, "c4.idx.L2", [8])


@pytest.mark.parametrize(("text", "spec"), [
    ("none", FaultSpec()), ("", FaultSpec()), ("buffer0-slots", FaultSpec(FaultKind.BUFFER0_SLOTS)),
    ("flip:c4.idx.L3", FaultSpec(FaultKind.FLIP, "c4.idx.L3")),
    ("flip:c4.idx.L3:5", FaultSpec(FaultKind.FLIP, "c4.idx.L3", (5,))),
    ("flip:c4.idx.L3:5,9", FaultSpec(FaultKind.FLIP, "c4.idx.L3", (5, 9))),
])
def test_fault_spec_parses_and_prints(text: str, spec: FaultSpec) -> None:
    assert FaultSpec.parse(text) == spec
    assert FaultSpec.parse(str(spec)) == spec


@pytest.mark.parametrize("text", ["flip", "flip:", "flip:x:a", "flip:x:-1", "buffer0-slots:3", "melt"])
def test_fault_spec_rejects_garbage(text: str) -> None:
    with pytest.raises(FaultSpecError):
        FaultSpec.parse(text)


def test_flip_spec_after_write_is_caught_by_digests(salad) -> None:
    src, dst = salad
    spec = FaultSpec.parse("flip:c4.idx.L0")
    plan = spec.plan(src, dst, PAGES)
    post(plan, src, dst)
    flips = spec.after_write(dst, PAGES, seed=1)
    assert sorted(p for p, _ in flips) == sorted(PAGES["c4"][1].tolist())
    with pytest.raises(PageMismatchError) as info:
        verify_digests(dst, digest_plan(plan, "full"))
    assert {(m.buffer, m.page) for m in info.value.mismatches} == {("c4.idx.L0", int(p)) for p in PAGES["c4"][1]}
