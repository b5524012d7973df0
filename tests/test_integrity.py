"""Page digests: modes, localisation of corruption, wire round trip and untrusted decoding."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest

from kvferry import Buffer, IntegrityError, KVMemory, Layout, Pool, plan_transfer
from kvferry.errors import PageMismatchError, UsageError
from kvferry.integrity import (
    DigestMode,
    PageDigests,
    PageMismatch,
    digest_pages,
    digest_plan,
    verify_digests,
)
from kvferry.integrity.digests import DIGESTS_VERSION, _DigestsMsg
from kvferry.plan import plan_decode_rank

from .conftest import fill_random, memmove_plan
from .netns_peer import full_arrays, llama_like, rank_memory


def hetero_layout(scale: int = 1) -> Layout:
    """Three pools; buffers differ in page size and in page count within a pool."""
    return Layout([
        Pool("c4", [Buffer("c4.kv.L0", 584 * 8, 30 * scale, "fp8_e4m3", "kv", 0),
                    Buffer("c4.kv.L2", 584 * 8, 30 * scale, "fp8_e4m3", "kv", 2),
                    Buffer("c4.idx.L0", 256 * 8, 17 * scale, "bf16", "index_k", 0),
                    Buffer("c4.idx.L2", 256 * 8, 17 * scale, "bf16", "index_k", 2)], 256),
        Pool("c128", [Buffer("c128.kv.L1", 2 * 584, 12 * scale, "fp8_e4m3", "kv", 1)], 256),
        Pool("state", [Buffer("state.conv", 96, 5 * scale, "bf16", "state"),
                       Buffer("state.ssm", 1000, 7 * scale, "fp32", "state")], None),
    ])


PAGES = {"c4": ([1, 2, 3, 9, 16], [4, 5, 6, 0, 15]), "c128": ([0, 1, 11], [3, 4, 2]), "state": ([2], [4])}


@pytest.fixture
def moved() -> tuple[KVMemory, KVMemory, object]:
    src = KVMemory.allocate(hetero_layout())
    dst = KVMemory.allocate(hetero_layout().with_capacities({"c128.kv.L1": 20}))
    fill_random(src, 3)
    plan = plan_transfer(src, dst, PAGES)
    memmove_plan(plan)
    for pool, (s, d) in PAGES.items():  # the executor did its job: checked, not assumed
        for buf in src.layout.pool(pool).buffers:
            np.testing.assert_array_equal(dst.array(buf.name)[d], src.array(buf.name)[s])
    return src, dst, plan


def test_full_covers_every_page_of_every_buffer_keyed_by_destination(moved) -> None:
    _, dst, plan = moved
    d = digest_plan(plan, "full")
    assert d.mode is DigestMode.FULL and len(d) == 5 * 4 + 3 + 1 * 2
    by_buffer = {name: sorted(d.pages[d.buffer_ids == i].tolist()) for i, name in enumerate(d.buffer_names)}
    assert by_buffer["c4.idx.L2"] == [0, 4, 5, 6, 15] and by_buffer["state.ssm"] == [4]
    verify_digests(dst, d)


def test_sampled_picks_k_pages_per_buffer_reproducibly(moved) -> None:
    _, dst, plan = moved
    d = digest_plan(plan, DigestMode.SAMPLED, seed=5, samples_per_buffer=2)
    counts = np.bincount(d.buffer_ids.astype(np.int64))
    assert counts.tolist() == [2, 2, 2, 2, 2, 1, 1]  # pools with fewer pages than k give all they have
    again = digest_plan(plan, "sampled", seed=5, samples_per_buffer=2)
    np.testing.assert_array_equal(d.pages, again.pages)
    verify_digests(dst, d)


def test_off_digests_and_verifies_nothing(moved) -> None:
    _, dst, plan = moved
    d = digest_plan(plan, "off")
    assert len(d) == 0 and d.mode is DigestMode.OFF
    for buf in dst.layout.buffers:
        dst.array(buf.name)[...] ^= 0x5A  # everything corrupted, and still: off checks nothing
    verify_digests(dst, d)


@pytest.mark.parametrize("name", [b.name for b in hetero_layout().buffers])
def test_full_catches_one_flipped_byte_in_any_buffer_and_names_it(moved, name: str) -> None:
    _, dst, plan = moved
    d = digest_plan(plan, "full")
    pool = dst.layout.pool_of[name]
    page = PAGES[pool][1][-1]
    dst.array(name)[page, dst.layout.buffer(name).page_bytes // 2] ^= 0x01
    with pytest.raises(IntegrityError) as info:
        verify_digests(dst, PageDigests.from_bytes(d.to_bytes()))
    err = info.value
    assert isinstance(err, PageMismatchError)
    buf = dst.layout.buffer(name)
    assert err.mismatches == (PageMismatch(pool, name, buf.layer, page, err.mismatches[0].expected,
                                           err.mismatches[0].actual),)
    assert err.mismatches[0].expected != err.mismatches[0].actual
    assert f"pool {pool!r}, buffer {name!r}" in str(err) and f"page {page}:" in str(err)


@pytest.mark.parametrize("seed", range(5))
def test_sampled_catches_a_whole_corrupted_buffer(moved, seed: int) -> None:
    _, dst, plan = moved
    d = digest_plan(plan, "sampled", seed=seed)
    dst.array("c4.idx.L2")[...] = 0  # the request's pages of this buffer never arrived
    with pytest.raises(PageMismatchError) as info:
        verify_digests(dst, d)
    assert {m.buffer for m in info.value.mismatches} == {"c4.idx.L2"}
    assert len(info.value.mismatches) == 2 and "1 of" not in str(info.value)


def test_all_mismatches_are_listed_and_counted(moved) -> None:
    _, dst, plan = moved
    d = digest_plan(plan, "full")
    dst.array("c4.kv.L0")[[4, 5]] ^= 0xFF
    dst.array("c128.kv.L1")[3, 0] ^= 0xFF
    with pytest.raises(PageMismatchError) as info:
        verify_digests(dst, d)
    got = sorted((m.buffer, m.page) for m in info.value.mismatches)
    assert got == [("c128.kv.L1", 3), ("c4.kv.L0", 4), ("c4.kv.L0", 5)]
    assert str(info.value).startswith(f"3 of {len(d)} pages checked (full digests)")


def test_round_trip_and_merge_of_chunks(moved) -> None:
    src, dst, _ = moved
    first = digest_plan(plan_transfer(src, dst, PAGES, buffers=["c4.kv.L0", "c4.idx.L0"]), "full")
    second = digest_plan(plan_transfer(src, dst, {"c128": PAGES["c128"]}), "sampled", seed=1)
    merged = PageDigests.merge([first, second])
    assert len(merged) == len(first) + len(second) and merged.mode is DigestMode.SAMPLED
    back = PageDigests.from_bytes(merged.to_bytes())
    assert back.buffer_names == merged.buffer_names and back.mode is merged.mode and back.shape == merged.shape
    for attr in ("buffer_ids", "pages", "digests"):
        np.testing.assert_array_equal(getattr(back, attr), getattr(merged, attr))
    verify_digests(dst, back)
    dst.array("c4.idx.L0")[5, 3] ^= 1
    with pytest.raises(PageMismatchError, match="c4.idx.L0"):
        verify_digests(dst, back)


def _msg(**over: object) -> bytes:
    fields = dict(version=DIGESTS_VERSION, mode="full", shape="", buffer_names=["c4.kv.L0"],
                  buffer_ids=np.zeros(2, "<u4").tobytes(), pages=np.array([1, 2], "<i8").tobytes(),
                  digests=np.array([7, 8], "<u8").tobytes())
    fields.update(over)
    return msgspec.msgpack.encode(_DigestsMsg(**fields))


@pytest.mark.parametrize("data", [
    b"", b"\x00\x01garbage", msgspec.msgpack.encode({"version": 1}), msgspec.msgpack.encode([1, 2, 3]),
    _msg(version=99), _msg(mode="most"), _msg(pages=b"\x01" * 12), _msg(digests=b"\x00" * 15),
    _msg(buffer_ids=np.array([0, 1], "<u4").tobytes()), _msg(pages=np.array([1, -2], "<i8").tobytes()),
    _msg(mode="off"), _msg(buffer_names=[""]), _msg(buffer_names=["x" * 300]),
])
def test_malformed_digest_bytes_raise_a_clean_integrity_error(data: bytes) -> None:
    with pytest.raises(IntegrityError):
        PageDigests.from_bytes(data)


def test_digests_naming_unknown_buffers_or_pages_are_refused(moved) -> None:
    _, dst, _ = moved
    for names, page, what in ((["nope"], 1, "nope"), (["c4.idx.L0"], 17, "page 17")):
        d = PageDigests.from_bytes(_msg(buffer_names=names, pages=np.array([1, page], "<i8").tobytes()))
        with pytest.raises(IntegrityError, match=what):
            verify_digests(dst, d)
    wrong_shape = PageDigests.from_bytes(_msg(shape="0" * 32))
    with pytest.raises(IntegrityError, match="layout shape"):
        verify_digests(dst, wrong_shape)


def test_bad_mode_and_sample_count_are_refused(moved) -> None:
    _, _, plan = moved
    with pytest.raises(UsageError, match="unknown digest mode"):
        digest_plan(plan, "most")
    with pytest.raises(UsageError, match="samples_per_buffer"):
        digest_plan(plan, "sampled", samples_per_buffer=0)


@pytest.mark.parametrize("buffers", [None, ["c4.kv.L0", "c4.idx.L0"], ["state.ssm", "c128.kv.L1"]])
@pytest.mark.parametrize("mode", ["off", "sampled", "full"])
def test_digest_pages_keyed_equals_digest_plan(moved, mode: str, buffers: list[str] | None) -> None:
    """What prefill hashes in send(), before decode's pages are known, is what digest_plan gives."""
    src, dst, _ = moved
    for seed in range(3):
        plan = plan_transfer(src, dst, PAGES, buffers=buffers)
        early = digest_pages(src, {p: np.array(s) for p, (s, _) in PAGES.items()}, mode, seed=seed,
                             buffers=buffers)
        keyed = early.keyed({p: np.array(d) for p, (_, d) in PAGES.items()})
        assert keyed.to_bytes() == digest_plan(plan, mode, seed=seed).to_bytes()
        verify_digests(dst, keyed)


# -- across TP sizes: digests of the slice of each page a rank pair moves ------------------------------------
@pytest.mark.parametrize("major", ["head", "token"])
def test_tp_plans_digest_their_slices_and_verify_with_the_links_slices(major: str) -> None:
    full = llama_like(num_layers=2, num_pages=24, tokens=4, major=major, heads=8, head_bytes=8)
    data = full_arrays(full, 5)
    srcs = [rank_memory(full, 2, r, data) for r in range(2)]
    dst = rank_memory(full, 4, 3, None)     # needs prefill rank 1's heads only
    (rank, plan), = plan_decode_rank(srcs, dst, {"kv": ([3, 4, 9], [0, 1, 7]), "state": ([2], [5])}).items()
    memmove_plan(plan)
    sampled = digest_plan(plan, "sampled", seed=4, samples_per_buffer=2)
    assert sampled.shape == dst.layout.shape_fingerprint        # checked on decode's layout, not prefill's
    assert np.bincount(sampled.buffer_ids).tolist() == [2] * 6 + [1]  # k per buffer; the state pool has 1 page
    full_digests = digest_plan(plan, "full")
    for digests in (sampled, full_digests):
        verify_digests(dst, digests, plan.slices)
    dst.array("L1.v")[7, -1] ^= 1                # a byte of the slice rank 1 wrote to page 7
    with pytest.raises(PageMismatchError, match=r"buffer 'L1.v' \(layer 1\), page 7"):
        verify_digests(dst, full_digests, plan.slices)
    with pytest.raises(IntegrityError, match="does not write to this decode rank"):
        verify_digests(dst, full_digests, {n: s for n, s in plan.slices.items() if n != "state"})
    assert rank == 1
