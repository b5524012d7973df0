"""Declared pool aliases: two pools over the same bytes, one page space (vLLM's Mamba state over attention).

``Pool.aliases`` lets a buffer of one pool lie on exactly the region of a buffer of another (same address,
length, page size and count); ``KVMemory`` still refuses every other overlap, the manifest carries the
declaration so a peer's binding checks the same, and the lease table treats both pools as one page space.
"""

from __future__ import annotations

import numpy as np
import pytest

from kvferry.control.core.leases import LeaseTable
from kvferry.errors import LayoutError, LeaseError
from kvferry.layout import Buffer, KVMemory, Layout, Pool, StateGeometry
from kvferry.layout.compare import model_difference, shape_difference
from kvferry.layout.memory import distinct_regions

PAGES, PAGE = 12, 256
STATE = StateGeometry.packed([(1, [(8, 4, True), (4, 4, False)])])


def _layout(aliases: str | None = "blocks", state_pages: int = PAGES, state_page: int = PAGE) -> Layout:
    blocks = Pool("blocks", [Buffer("attn0", PAGE, PAGES, "float32", "kv", 1),
                             Buffer("attn1", PAGE, PAGES, "float32", "kv", 3)], tokens_per_page=16)
    state = Pool("state", [Buffer("mixer0", state_page, state_pages, "int8", "state", 0, state=STATE)],
                 aliases=aliases)
    return Layout([blocks, state])


def _arrays(shared: np.ndarray) -> dict[str, np.ndarray]:
    return {"attn0": shared[0], "attn1": shared[1], "mixer0": shared[0]}


def test_an_alias_on_exactly_an_aliased_pools_region_is_accepted_and_registered_once() -> None:
    shared = np.zeros((2, PAGES, PAGE), np.uint8)
    memory = KVMemory.from_arrays(_layout(), _arrays(shared))
    assert memory.region("mixer0").address == memory.region("attn0").address
    assert len(distinct_regions(memory.regions)) == 2
    memory.array("mixer0")[3, :4] = 7   # the same bytes under the other pool's buffer
    assert (memory.array("attn0")[3, :4] == 7).all()


def test_every_other_overlap_is_still_refused() -> None:
    shared = np.zeros((2, PAGES, PAGE), np.uint8)
    with pytest.raises(LayoutError, match="overlap"):   # not declared
        KVMemory.from_arrays(_layout(aliases=None), _arrays(shared))
    flat = shared.reshape(-1)
    shifted = flat[PAGE:PAGE + PAGES * PAGE].reshape(PAGES, PAGE)   # one page off: not the same region
    with pytest.raises(LayoutError, match="overlap"):
        KVMemory.from_arrays(_layout(), {"attn0": shared[0], "attn1": shared[1], "mixer0": shifted})
    half = flat[:PAGES * PAGE].reshape(PAGES * 2, PAGE // 2)   # the same bytes cut in other pages
    with pytest.raises(LayoutError, match="overlap"):
        KVMemory.from_arrays(_layout(state_pages=PAGES * 2, state_page=PAGE // 2),
                             {"attn0": shared[0], "attn1": shared[1], "mixer0": half})
    two = Layout([_layout().pools[0], Pool("state", [Buffer("m0", PAGE, PAGES, "int8", "state", 0, state=STATE),
                                                     Buffer("m1", PAGE, PAGES, "int8", "state", 2, state=STATE)],
                                           aliases="blocks")])
    with pytest.raises(LayoutError, match="'attn0' and 'm1' overlap"):   # two alias buffers on one region
        KVMemory.from_arrays(two, {"attn0": shared[0], "attn1": shared[1], "m0": shared[0], "m1": shared[0]})
    own = np.zeros((2, PAGES, PAGE), np.uint8)   # attention's two buffers overlapping each other: refused
    with pytest.raises(LayoutError, match="'attn0' and 'attn1' overlap"):
        KVMemory.from_arrays(_layout(), {"attn0": own[0], "attn1": own[0], "mixer0": np.zeros((PAGES, PAGE),
                                                                                              np.uint8)})


def test_the_declaration_must_name_another_pool_of_the_layout() -> None:
    with pytest.raises(LayoutError, match="aliases pool 'nope'"):
        _layout(aliases="nope")
    with pytest.raises(LayoutError, match="cannot alias itself"):
        Pool("state", [Buffer("m", PAGE, PAGES, "int8", "state")], aliases="state")


def test_the_manifest_carries_the_alias_and_a_peers_binding_checks_it() -> None:
    shared = np.zeros((2, PAGES, PAGE), np.uint8)
    memory = KVMemory.from_arrays(_layout(), _arrays(shared))
    remote = KVMemory.from_manifest(memory.manifest())
    assert remote.layout.pool("state").aliases == "blocks"
    assert remote.layout.shape_fingerprint == memory.layout.shape_fingerprint
    assert Layout.from_manifest(_layout().to_manifest()) == _layout()
    plain = _layout(aliases=None)
    assert plain.shape_fingerprint != _layout().shape_fingerprint
    assert shape_difference(plain, _layout()) == "pool 'state': aliases differs: local None, remote blocks"
    assert model_difference(plain, _layout()) is not None


def test_aliased_pools_share_one_page_space_in_the_lease_table() -> None:
    table = LeaseTable(_layout())
    table.acquire(1, "a", {"blocks": [2, 3], "state": [5]})
    assert table.owners("blocks")[5] == 1 and table.owners("state")[3] == 1
    with pytest.raises(LeaseError, match="request 'b': pool 'state' page 3 is leased to live request 'a' in "
                                         "pool 'blocks'"):
        table.acquire(2, "b", {"blocks": [7], "state": [3]})
    with pytest.raises(LeaseError, match="request 'c': pool 'blocks' page 5 is leased to live request 'a' in "
                                         "pool 'state'"):
        table.acquire(3, "c", {"blocks": [5]})
    with pytest.raises(LeaseError, match="request 'd': pool 'state' page 8 is also its page in pool 'blocks'"):
        table.acquire(4, "d", {"blocks": [7, 8], "state": [8]})
    assert table.num_leases == 1 and (table.owners("blocks")[[7, 8]] == -1).all()   # all or nothing
    table.release(1)
    table.acquire(5, "e", {"blocks": [5], "state": [2]})   # freed in both
    plain = LeaseTable(_layout(aliases=None))   # without the declaration: two page spaces
    plain.acquire(1, "a", {"blocks": [2], "state": [2]})
