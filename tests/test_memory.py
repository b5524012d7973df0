from __future__ import annotations

import numpy as np
import pytest

from kvferry import Buffer, KVMemory, Layout, LayoutError, Pool


def _layout() -> Layout:
    return Layout([
        Pool("c4", [Buffer("kv", 48, 10, "fp8", "kv", 0), Buffer("idx", 256, 6, "bf16", "index_k", 0)], 256),
        Pool("c128", [Buffer("c128", 7, 3)], 128),
    ])


def test_allocate_gives_zeroed_writable_views_of_each_buffer() -> None:
    mem = KVMemory.allocate(_layout())
    for buf in mem.layout.buffers:
        arr = mem.array(buf.name)
        assert arr.shape == (buf.num_pages, buf.page_bytes)
        assert arr.dtype == np.uint8 and not arr.any()
        assert mem.address(buf.name) == arr.ctypes.data
    mem.array("idx")[5, -1] = 9
    assert mem.array("idx")[5, -1] == 9


def test_page_descs_blocks_start_at_prefix_sums_of_own_capacities() -> None:
    mem = KVMemory.allocate(_layout())
    descs = mem.page_descs()
    assert descs.shape == (10 + 6 + 3, 3) and descs.dtype == np.uint64
    # Buffer idx's block starts at 10 (kv's capacity), not at a multiple of anything else.
    assert descs[10, 0] == mem.address("idx") and descs[10, 1] == 256
    assert descs[15, 0] == mem.address("idx") + 5 * 256
    assert descs[16, 0] == mem.address("c128") and descs[18, 1] == 7


def test_from_pointers_takes_each_slot_count_from_its_own_region() -> None:
    layout = _layout()
    arrays = {b.name: np.zeros(b.nbytes, np.uint8) for b in layout.buffers}
    ptrs = [arrays[b.name].ctypes.data for b in layout.buffers]
    lens = [b.nbytes for b in layout.buffers]
    items = [b.page_bytes for b in layout.buffers]
    mem = KVMemory.from_pointers(layout, ptrs, lens, items)
    mem.array("idx")[2] = 1
    assert arrays["idx"][512:768].all() and arrays["idx"].sum() == 256
    with pytest.raises(LayoutError, match="buffer 'idx': region of 1000 bytes is not a whole number of 256-byte"):
        KVMemory.from_pointers(layout, ptrs, [lens[0], 1000, lens[2]], items)
    with pytest.raises(LayoutError, match="buffer 'idx': region holds 10 pages of 256 bytes but the layout declares 6"):
        KVMemory.from_pointers(layout, ptrs, [lens[0], 2560, lens[2]], items)
    with pytest.raises(LayoutError, match="buffer 'kv': item length 64 != layout page_bytes 48"):
        KVMemory.from_pointers(layout, ptrs, lens, [64, 256, 7])
    with pytest.raises(LayoutError, match="3 buffers but 2 pointers"):
        KVMemory.from_pointers(layout, ptrs[:2], lens, items)


def test_from_arrays_accepts_any_dtype_and_torch_cpu_tensors() -> None:
    torch = pytest.importorskip("torch")
    layout = _layout()
    arrays = {
        "kv": torch.zeros(10, 24, dtype=torch.bfloat16),
        "idx": np.zeros((6, 64), np.float32),
        "c128": np.zeros(21, np.uint8),
    }
    mem = KVMemory.from_arrays(layout, arrays)
    assert mem.region("kv").device == "cpu" and mem.region("kv").nbytes == 480
    mem.array("kv")[9, :] = 0xFF
    assert torch.isnan(arrays["kv"][9]).all()
    with pytest.raises(LayoutError, match="buffer 'kv': region of 400 bytes is not a whole number of 48-byte"):
        KVMemory.from_arrays(layout, {**arrays, "kv": np.zeros(400, np.uint8)})
    with pytest.raises(LayoutError, match="must be C-contiguous"):
        KVMemory.from_arrays(layout, {**arrays, "idx": np.zeros((64, 12), np.float32)[:, ::2]})
    with pytest.raises(LayoutError, match="missing buffers \\['c128'\\]"):
        KVMemory.from_arrays(layout, {"kv": arrays["kv"], "idx": arrays["idx"]})


def test_overlapping_regions_are_refused() -> None:
    layout = _layout()
    big = np.zeros(10_000, np.uint8)
    base = big.ctypes.data
    with pytest.raises(LayoutError, match="buffers 'kv' and 'idx' overlap in memory"):
        KVMemory.from_pointers(layout, [base, base + 100, base + 5000], [480, 1536, 21], [48, 256, 7])


def test_manifest_gives_a_remote_binding_with_the_same_addresses() -> None:
    mem = KVMemory.allocate(_layout())
    remote = KVMemory.from_manifest(mem.manifest())
    assert remote.remote and remote.regions == mem.regions
    assert remote.layout == mem.layout
    np.testing.assert_array_equal(remote.page_descs(), mem.page_descs())
    with pytest.raises(LayoutError, match="buffer 'kv' is a peer's memory"):
        remote.array("kv")
    with pytest.raises(LayoutError, match="malformed manifest"):
        KVMemory.from_manifest(mem.manifest()[:-3])
