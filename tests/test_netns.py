"""Prefill and decode on different "hosts": two network namespaces joined by a veth pair.

The test builds the namespaces itself (root and ``ip netns`` needed; skipped with the reason otherwise),
gives each end of the veth an address that exists only inside its namespace, and runs one process per side
(``tests/netns_endpoint_peer.py``): the real ``PrefillEndpoint`` bound to its veth address in one namespace,
the real ``DecodeEndpoint`` in the other, over ``transport="nixl"`` with UCX forced onto TCP over the veth
(``UCX_TLS=tcp``, ``UCX_NET_DEVICES=<veth>``). The control plane (ZMQ) and NIXL's data both cross the veth,
as they would cross a NIC between two machines. Decode checks every requested page of every buffer byte
for byte; the endpoints' full digests must agree.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import pytest

from .netns_peer import NetnsUnavailable, Side, ip, make_veth_pair

pytestmark = [pytest.mark.nixl,
              pytest.mark.skipif(importlib.util.find_spec("nixl") is None, reason="nixl is not installed")]

PEER = Path(__file__).with_name("netns_endpoint_peer.py")
NUM_REQUESTS = 6
TIMEOUT_S = 40.0  # the whole exchange; a healthy one takes a few seconds


@pytest.fixture
def veth_pair() -> Iterator[tuple[Side, Side]]:
    try:
        with make_veth_pair(f"{os.getpid() % 100000}") as pair:
            yield pair
    except NetnsUnavailable as exc:
        pytest.skip(str(exc))


class Peer:
    """One side's endpoints in a child process inside ``side``'s namespace; JSON lines on its stdout."""

    def __init__(self, side: Side, cfg: dict[str, Any], log: Path) -> None:
        self.log = log
        env = {**os.environ, "PYTHONPATH": str(PEER.parents[1] / "src")}
        with log.open("wb") as err:  # a file, not a pipe: a chatty UCX cannot fill it and stall the peer
            self.proc = subprocess.Popen([*side.prefix(), sys.executable, str(PEER), json.dumps(cfg)],
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, env=env,
                                         bufsize=0)

    def read(self, deadline: float) -> dict[str, Any]:
        """The next JSON line (other output skipped), or a failure naming the peer's stderr."""
        assert self.proc.stdout is not None
        while time.monotonic() < deadline:
            line = _readline(self.proc.stdout, deadline)
            if line is None:
                break
            if line.startswith(b"{"):
                return json.loads(line)
        pytest.fail(f"peer gave no answer (exit {self.proc.poll()}); stderr:\n{self.log.read_text()[-3000:]}")

    def tell(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line.encode() + b"\n")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)


def _readline(stream: IO[bytes], deadline: float) -> bytes | None:
    """A line from an unbuffered pipe, or None at EOF or the deadline (select, so a hung peer cannot hang us)."""
    import select

    out = bytearray()
    while not out.endswith(b"\n"):
        if not select.select([stream], [], [], max(0.0, deadline - time.monotonic()))[0]:
            return None
        byte = stream.read(1)
        if not byte:
            return None
        out += byte
    return bytes(out)


@pytest.mark.parametrize("ptp, dtp, major", [(1, 1, "head"), (4, 2, "head"), (2, 4, "token")])
def test_endpoints_between_namespaces(veth_pair: tuple[Side, Side], tmp_path: Path, ptp: int, dtp: int,
                                      major: str) -> None:
    pre_ns, dec_ns = veth_pair
    cfg = {"ptp": ptp, "dtp": dtp, "major": major, "n": NUM_REQUESTS, "seed": 31}
    deadline = time.monotonic() + TIMEOUT_S
    before = pre_ns.tx_bytes()
    prefill = Peer(pre_ns, {**cfg, "role": "prefill", "host": pre_ns.ip}, tmp_path / "prefill.log")
    decode = None
    try:
        addresses = prefill.read(deadline)["addresses"]
        assert all(a.startswith(f"tcp://{pre_ns.ip}:") for a in addresses)  # bound to the veth, not loopback
        decode = Peer(dec_ns, {**cfg, "role": "decode", "addresses": addresses}, tmp_path / "decode.log")
        assert decode.read(deadline) == {"announced": True}
        prefill.tell("go")
        verdict = decode.read(deadline)
        sent = prefill.read(deadline)
    finally:
        for peer in (prefill, decode):
            if peer is not None:
                peer.stop()
    assert verdict["errors"] == []
    assert set(verdict["results"].values()) == {"done"} and len(verdict["results"]) == dtp * NUM_REQUESTS
    assert set(sent["results"].values()) == {"done"} and len(sent["results"]) == ptp * NUM_REQUESTS
    # The bytes really crossed the veth (and not, say, shared memory between the two processes).
    assert pre_ns.tx_bytes() - before >= verdict["bytes"] > 0


def test_namespaces_are_removed_even_on_failure() -> None:
    names = set()
    with pytest.raises(RuntimeError, match="boom"), make_veth_pair(f"{os.getpid() % 100000}x") as (pre, dec):
        names = {pre.netns, dec.netns}
        assert names <= set(ip("netns", "list").split())
        raise RuntimeError("boom")
    assert names and not names & set(ip("netns", "list").split())
