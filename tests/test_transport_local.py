"""LocalTransport, the reference: bytes land exactly, and rows outside registered memory are refused."""

from __future__ import annotations

import numpy as np
import pytest

from kvferry import KVMemory, Layout, TransportError, plan_transfer
from kvferry.transport import LocalTransport, check_rows_in_regions

from .conftest import fill_random, snapshot


@pytest.fixture
def linked(salad_layout: Layout):
    src = KVMemory.allocate(salad_layout)
    dst = KVMemory.allocate(salad_layout.with_capacities({"c4.idx.L1": 30}))
    fill_random(src, 3)
    fill_random(dst, 4)
    a, b = LocalTransport(), LocalTransport()
    a.register(src)
    peer = a.add_peer(b.register(dst))
    b.add_peer(a.register(src))
    yield src, dst, a, b, peer
    a.close()
    b.close()


def test_write_moves_exactly_the_planned_pages_and_notifies(linked) -> None:
    src, dst, a, b, peer = linked
    before = snapshot(dst)
    remote = KVMemory.from_manifest(dst.manifest())
    plan = plan_transfer(src, remote, {"c4": ([1, 2, 3, 10], [20, 21, 0, 5]), "c128": ([0], [15])})
    with a.write(plan, peer, b"req-1 done", label="req-1") as handle:
        handle.wait(1.0)
    assert b.get_notifications() == [(a.agent_name, b"req-1 done")]
    for pool, (s, d) in {"c4": ([1, 2, 3, 10], [20, 21, 0, 5]), "c128": ([0], [15])}.items():
        for buf in src.layout.pool(pool).buffers:
            before[buf.name][d] = src.array(buf.name)[s]
    for name, want in before.items():
        np.testing.assert_array_equal(dst.array(name), want, err_msg=name)


def test_rows_outside_registered_memory_are_refused(linked) -> None:
    src, dst, a, _b, peer = linked
    remote = KVMemory.from_manifest(dst.manifest())
    plan = plan_transfer(src, remote, {"c4": ([0], [0])})
    region = dst.region("c4.kv.L0")
    cases = {
        "past the end": [region.end - 8, 16, 0],
        "before every region": [1, 16, 0],
        "wraps around 2**64": [region.address + 8, 2**64 - 4, 0],
        "other device": [region.address, 16, 1],
        "zero length": [region.address, 0, 0],
    }
    for what, row in cases.items():
        descs = np.array([row], dtype=np.uint64)
        with pytest.raises(TransportError, match="outside every registered destination region"):
            check_rows_in_regions(descs, dst, "destination", peer, what)
    # The same check guards the write path: a plan whose destination binding lies about the peer's
    # memory (a forged manifest) is refused before a byte moves.
    before = snapshot(dst)
    forged = KVMemory(remote.layout, [type(r)(r.buffer, r.address + (1 << 30), r.nbytes) for r in remote.regions],
                      remote=True)
    with pytest.raises(TransportError, match="outside every registered destination region"):
        a.write(plan_transfer(src, forged, {"c4": ([0], [0])}), peer, b"x")
    for name, want in before.items():
        np.testing.assert_array_equal(dst.array(name), want)
    assert a.write(plan, peer, b"still usable").poll()
