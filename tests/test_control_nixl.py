"""Control plane between two OS processes over NIXL: bulk traffic, peers killed mid-transfer, restarts.

The bulk and fault tests run over Mooncake's Transfer Engine too (``KINDS``), where it is installed: a peer
killed mid-transfer or restarted (a new generation) fails closed the same way over either transport."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvferry import KVMemory, PeerLost
from kvferry.control import DecodeEndpoint, EndpointOptions, PrefillEndpoint, RequestState
from kvferry.errors import IncompatiblePeer, RequestFailed, UsageError
from kvferry.transport import mooncake_available
from tests.json_peer import JsonPeer

from .control_peer import announce, fill, make_layout, run_prefill, snapshot, verify, wait_all, workload

pytest.importorskip("nixl")
pytest.importorskip("kvferry.transport.nixl")
pytestmark = pytest.mark.nixl

PEER = Path(__file__).with_name("control_peer.py")
TIMEOUTS = {"heartbeat_interval": 0.2, "peer_timeout": 1.0, "lease_grace": 1.0, "request_timeout": 30.0}
OPTS = EndpointOptions(**TIMEOUTS)
SEED = 7
KINDS = pytest.mark.parametrize("kind", ["nixl", pytest.param("mooncake", marks=pytest.mark.skipif(
    not mooncake_available(), reason="Mooncake's Transfer Engine is not installed (kvferry[mooncake])"))])


class Peer(JsonPeer):
    """An endpoint in a child process, driven by JSON lines (see tests/control_peer.py)."""

    def __init__(self, role: str, **cfg: Any) -> None:
        cfg = {"options": TIMEOUTS, "seed": SEED, **cfg}
        super().__init__(PEER, [role, json.dumps(cfg)], ready_timeout=30, timeout=30)
        self.address = self.first["address"]


@pytest.fixture
def peers() -> Iterator[list[Peer]]:
    started: list[Peer] = []
    yield started
    for peer in started:
        peer.close()


def _decode(kind: str = "nixl") -> tuple[DecodeEndpoint, dict[str, Any]]:
    dst = KVMemory.allocate(make_layout("decode"))
    fill(dst, 999)
    return DecodeEndpoint(dst, kind, options=OPTS), snapshot(dst)


def _idle(ep: Any) -> bool:
    c = ep.counters()
    return c["live_requests"] == c["live_leases"] == c["live_handles"] == 0


def _count(ep: Any, reqs: list[Any], state: RequestState) -> int:
    """Requests in ``state`` (an id prefill has not heard of yet counts as not in it)."""
    n = 0
    for r in reqs:
        with contextlib.suppress(UsageError):
            n += ep.poll(r.rid) is state
    return n


def _until(pred: Any, timeout: float) -> float:
    t0 = time.monotonic()
    while not pred():
        assert time.monotonic() - t0 < timeout, "condition not reached in time"
        time.sleep(0.01)
    return time.monotonic() - t0


def serve_64_and_verify(decode: DecodeEndpoint, prefill: Peer, before: dict[str, Any]) -> None:
    """64 requests (whole, chunked and layer-by-layer sends) between this decode and a prefill process,
    half announced before prefill serves and half after; every byte verified, nothing left in flight."""
    decode.connect(prefill.address)
    reqs = workload(64, seed=21)
    announce(decode, reqs[:32])
    prefill("serve", n=64, seed=21)
    announce(decode, reqs[32:])
    assert set(wait_all(decode, [r.rid for r in reqs], 30).values()) == {"done"}
    assert set(prefill("wait_all")["results"].values()) == {"done"}
    verify(decode.memory, SEED, reqs, before)
    _until(lambda: _idle(decode), 5)
    assert prefill("counters")["counters"]["live_handles"] == 0


@KINDS
def test_many_requests_between_processes(peers: list[Peer], kind: str) -> None:
    prefill = Peer("prefill", digest_mode="full", transport=kind)
    peers.append(prefill)
    decode, before = _decode(kind)
    with decode:
        serve_64_and_verify(decode, prefill, before)


@KINDS
def test_decode_killed_mid_transfer(peers: list[Peer], kind: str) -> None:
    src = KVMemory.allocate(make_layout("prefill"))
    fill(src, SEED)
    with PrefillEndpoint(src, kind, options=OPTS) as prefill:
        doomed = Peer("decode", transport=kind)
        peers.append(doomed)
        doomed("connect", address=prefill.address)
        doomed("announce", n=24, seed=22)
        reqs = workload(24, seed=22)
        run_prefill(prefill, reqs, hold_last=True)       # first chunks land; the last ones are held
        _until(lambda: _count(prefill, reqs, RequestState.TRANSFERRING) == 16, 5)   # chunked + layered ones
        doomed.kill()
        t0 = time.monotonic()
        results = wait_all(prefill, [r.rid for r in reqs], 10)
        assert all(v.startswith("PeerLost") for v in results.values()), results
        assert time.monotonic() - t0 < OPTS.peer_timeout + 1.0
        _until(lambda: _idle(prefill), 5)
        # Prefill keeps serving: a new decode process gets all its bytes.
        fresh = Peer("decode", transport=kind)
        peers.append(fresh)
        fresh("connect", address=prefill.address)
        fresh("announce", n=16, seed=23, prefix="f")
        run_prefill(prefill, workload(16, seed=23, prefix="f"))
        assert set(fresh("wait_all")["results"].values()) == {"done"}
        fresh("verify")
        _until(lambda: _idle(prefill), 5)
        assert len(prefill.peers) == 1                   # the dead session is gone


@KINDS
def test_prefill_killed_mid_transfer_then_restarted(peers: list[Peer], kind: str) -> None:
    first = Peer("prefill", transport=kind)
    peers.append(first)
    decode, before = _decode(kind)
    with decode:
        decode.connect(first.address)
        reqs = workload(24, seed=24)
        announce(decode, reqs)
        first("serve", n=24, seed=24, hold_last=True)
        _until(lambda: any(decode.poll(r.rid) is RequestState.TRANSFERRING for r in reqs), 5)
        first.kill()
        t0 = time.monotonic()
        for r in reqs:
            with pytest.raises(RequestFailed) as info:
                decode.wait(r.rid, 10)
            assert isinstance(info.value.__cause__, PeerLost)
        failed_after = time.monotonic() - t0
        assert failed_after < OPTS.peer_timeout + 1.0
        assert decode.num_live_leases == 24              # a write may still be landing: pages kept...
        held = _until(lambda: decode.num_live_leases == 0, 5)
        assert failed_after + held >= OPTS.lease_grace * 0.9  # ...until the grace after the death passed
        second = Peer("prefill", transport=kind)
        peers.append(second)
        decode.connect(second.address)
        again = workload(24, seed=24, prefix="again")
        announce(decode, again)
        second("serve", n=24, seed=24, prefix="again")
        assert set(wait_all(decode, [r.rid for r in again], 30).values()) == {"done"}
        verify(decode.memory, SEED, again, before)
        _until(lambda: _idle(decode), 5)


@pytest.mark.parametrize("mode", ["push", "pull"])
def test_decode_prefix_between_processes(peers: list[Peer], mode: str) -> None:
    """Decode holds each request's first two main pages (its prefix cache): prefill sends whole requests
    (in one go, chunked and layer by layer) and only the rest moves; the held pages are untouched."""
    prefill = Peer("prefill", digest_mode="full", mode=mode)
    peers.append(prefill)
    dst = KVMemory.allocate(make_layout("decode"))
    fill(dst, 999)
    before = snapshot(dst)
    reqs = workload(32, seed=23)
    rest = [dataclasses.replace(r, src={**r.src, "main": r.src["main"][2:]}, dst={**r.dst, "main": r.dst["main"][2:]})
            for r in reqs]
    with DecodeEndpoint(dst, "nixl", options=OPTS, mode=mode) as decode:
        decode.connect(prefill.address)
        for r in rest:
            decode.announce(r.rid, r.dst, prefix={"main": 2})
        prefill("serve", n=32, seed=23)
        assert set(wait_all(decode, [r.rid for r in reqs], 30).values()) == {"done"}
        assert set(prefill("wait_all")["results"].values()) == {"done"}
        verify(dst, SEED, rest, before)
        _until(lambda: _idle(decode), 5)


@pytest.mark.skipif(not mooncake_available(), reason="Mooncake's Transfer Engine is not installed")
def test_transport_mismatch_is_refused_by_name(peers: list[Peer]) -> None:
    """A decode over Mooncake meeting a prefill over NIXL: the handshake refuses, naming both transports."""
    prefill = Peer("prefill", transport="nixl")
    peers.append(prefill)
    decode, _ = _decode("mooncake")
    with decode, pytest.raises(IncompatiblePeer, match="transport differs: prefill uses 'nixl', decode 'mooncake'"):
        decode.connect(prefill.address, timeout=10)


def test_a_swap_between_two_processes_over_nixl(peers: list[Peer]) -> None:
    """Issue 31 over NIXL: a prefill process binds requests r0 and r1 to two prompts of equal length; this
    decode announces them swapped (and r2 as bound). r0 and r1 fail on both sides with a BindingMismatch
    naming both requests and the first block that differs, before any byte of them moved (their pages keep
    decode's bytes); r2 lands byte-exact; nothing stays leased, held or in flight on either side."""
    prefill = Peer("prefill", digest_mode="full")
    peers.append(prefill)
    decode, before = _decode()
    a = list(range(1, 191))                      # 190 tokens: 3 blocks of 64, the last partial
    b = [*a[:64], 999, *a[65:]]                 # equal length, differs from block 1 on
    with decode:
        decode.connect(prefill.address)
        reqs = workload(3, seed=31)
        announce(decode, reqs, {"r0": b, "r1": a, "r2": a})
        prefill("serve", n=3, seed=31, tokens={"r0": a, "r1": b, "r2": a})
        results = wait_all(decode, [r.rid for r in reqs], 30)
        theirs = prefill("wait_all")["results"]
        assert results["r2"] == theirs["r2"] == "done", (results, theirs)
        for rid in ("r0", "r1"):
            for side in (results[rid], theirs[rid]):
                assert side.startswith("BindingMismatch"), side
                assert f"decode's request 'decode-{rid}'" in side and f"prefill's request 'prefill-{rid}'" in side
                assert "block 1 differs" in side, side
        verify(decode.memory, SEED, [reqs[2]], before)   # r0 and r1's pages untouched
        _until(lambda: _idle(decode), 5)
        counters = prefill("counters")["counters"]
        assert (counters["live_requests"], counters["live_handles"], counters["source_holds"]) == (0, 0, 0)
