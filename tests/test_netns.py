"""Prefill and decode on different "hosts": two network namespaces joined by a veth pair.

The test builds the namespaces itself (root and ``ip netns`` needed; skipped with the reason otherwise),
gives each end of the veth an address that exists only inside its namespace, and runs one process per side
(``tests/netns_peer.py``) with UCX forced onto TCP over the veth (``UCX_TLS=tcp``,
``UCX_NET_DEVICES=<veth>``): the control channel (ZMQ) and NIXL's data both cross the veth, as they would
cross a NIC between two machines. Decode checks every requested page of every buffer byte for byte.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Iterator

import pytest

from .netns_peer import NetnsUnavailable, Side, ip, make_veth_pair, run_pair

pytestmark = [pytest.mark.nixl,
              pytest.mark.skipif(importlib.util.find_spec("nixl") is None, reason="nixl is not installed")]


@pytest.fixture
def veth_pair() -> Iterator[tuple[Side, Side]]:
    try:
        with make_veth_pair(f"{os.getpid() % 100000}") as pair:
            yield pair
    except NetnsUnavailable as exc:
        pytest.skip(str(exc))


@pytest.mark.parametrize("ptp, dtp, major", [(4, 2, "head"), (2, 4, "token")])
def test_cross_tp_between_namespaces(veth_pair: tuple[Side, Side], ptp: int, dtp: int, major: str) -> None:
    pre, dec = veth_pair
    before = pre.tx_bytes()
    out = run_pair(["--ptp", str(ptp), "--dtp", str(dtp), "--major", major, "--timeout", "30"],
                   prefill_prefix=pre.prefix(), decode_prefix=dec.prefix(), addr=f"tcp://{dec.ip}:5557")
    assert out["ok"], out
    assert out["decode"]["errors"] == [] and out["decode"]["notifications"] == out["decode"]["expected"]
    # The bytes really crossed the veth (and not, say, shared memory between the two processes).
    assert pre.tx_bytes() - before >= out["bytes"]


def test_namespaces_are_removed_even_on_failure() -> None:
    names = set()
    with pytest.raises(RuntimeError, match="boom"), make_veth_pair(f"{os.getpid() % 100000}x") as (pre, dec):
        names = {pre.netns, dec.netns}
        assert names <= set(ip("netns", "list").split())
        raise RuntimeError("boom")
    assert names and not names & set(ip("netns", "list").split())
