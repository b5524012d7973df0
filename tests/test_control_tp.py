"""Endpoints across tensor-parallel sizes: every decode rank gets exactly its heads from every prefill rank
it needs, verified; a failing prefill rank fails the request only where it was needed.

In-process tests run all ranks as endpoints (each with its progress thread) over ``LocalTransport``; the
NIXL test runs each side in its own OS process (see ``tp_endpoint_peer.py`` for why one per side).
"""

from __future__ import annotations

import ctypes
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvferry import IncompatiblePeer, Layout, PeerLost
from kvferry.control import DecodeEndpoint, EndpointOptions, PrefillEndpoint
from kvferry.errors import IntegrityError, PageMismatchError, RequestFailed
from kvferry.integrity import digest_plan, verify_digests
from kvferry.plan import plan_decode_rank, source_ranks
from kvferry.transport import LocalTransport

from .conftest import memmove_plan
from .netns_peer import check_rank, full_arrays, llama_like, rank_memory
from .tp_endpoint_peer import Req, send, small_model, workload

OPTS = EndpointOptions(heartbeat_interval=0.1, peer_timeout=0.6, lease_grace=0.4, request_timeout=20.0)
SEED = 11


# -- a cluster of rank endpoints in one process ---------------------------------------------------------------
@dataclass
class Cluster:
    full: Layout
    data: dict[str, np.ndarray]
    prefills: list[PrefillEndpoint]
    decodes: list[DecodeEndpoint]

    @property
    def ptp(self) -> int:
        return len(self.prefills)

    @property
    def dtp(self) -> int:
        return len(self.decodes)


@contextmanager
def cluster(ptp: int, dtp: int, *, major: str = "head", digest_mode: str = "full",
            transport: Any = "local", mode: str = "push", decode_transport: Any = "local") -> Iterator[Cluster]:
    """``ptp`` prefill and ``dtp`` decode rank endpoints; every decode rank connected to the ranks it needs, in
    ``mode`` (push: prefill ranks write; pull: decode ranks read)."""
    full = small_model(major)
    data = full_arrays(full, SEED)
    with ExitStack() as stack:
        prefills = [stack.enter_context(PrefillEndpoint(rank_memory(full, ptp, r, data), transport(r) if callable(
            transport) else transport, options=OPTS, digest_mode=digest_mode, mode=mode)) for r in range(ptp)]
        decodes = [stack.enter_context(DecodeEndpoint(rank_memory(full, dtp, d, None), decode_transport(d) if callable(
            decode_transport) else decode_transport, options=OPTS, digest_mode=digest_mode, mode=mode))
            for d in range(dtp)]
        addresses = [p.address for p in prefills]
        for d, dec in enumerate(decodes):
            assert dec.connect_all(addresses) == [addresses[r] for r in source_ranks(d, ptp, dtp)]
        yield Cluster(full, data, prefills, decodes)


def check_decode_rank(c: Cluster, d: int, reqs: list[Req]) -> None:
    """Decode rank ``d`` holds, byte for byte, its heads of the full (TP 1) KV in every requested page, and
    nothing anywhere else."""
    assert check_rank(c.decodes[d].memory, c.full, c.data, c.dtp, d, _pages(reqs)) == []


def idle(*eps: Any, timeout: float = 5.0) -> None:
    """No request, lease or handle left on any endpoint (after the last messages in flight arrived)."""
    def quiet(ep: Any) -> bool:
        k = ep.counters()
        return k["live_requests"] == k["live_leases"] == k["live_handles"] == 0

    deadline = time.monotonic() + timeout
    while not all(quiet(ep) for ep in eps) and time.monotonic() < deadline:
        time.sleep(0.005)
    for ep in eps:
        assert quiet(ep), ep.counters()
        assert ep.counters().get("stray_notifications", 0) == 0


def outcome(ep: Any, rid: str, timeout: float = 10.0) -> str:
    try:
        ep.wait(rid, timeout)
        return "done"
    except RequestFailed as exc:
        return type(exc.__cause__).__name__


# -- byte-exact across TP sizes -----------------------------------------------------------------------------------
@pytest.mark.parametrize("ptp, dtp, major, mode", [
    (4, 2, "head", "push"), (2, 4, "head", "push"), (4, 2, "token", "push"), (2, 4, "token", "push"),
    (2, 1, "head", "pull"), (1, 2, "head", "pull"), (4, 2, "token", "pull"), (2, 4, "head", "pull")])
def test_every_decode_page_is_byte_exact(ptp: int, dtp: int, major: str, mode: str) -> None:
    """Push: each prefill rank writes its heads into the decode ranks that need them; pull: each decode rank
    reads its heads from the prefill ranks that hold them. Either way every byte lands exactly, nothing else,
    and prefill's source holds end (pull) with no lease left."""
    reqs = workload(6, seed=ptp * 10 + dtp)
    with cluster(ptp, dtp, major=major, mode=mode) as c:
        for req in reqs[:3]:                      # decode first for half of them...
            for dec in c.decodes:
                dec.announce(req.rid, req.dst)
        for k in range(2):                        # ...prefill ranks send chunk by chunk, round-robin
            for req in reqs:
                for pre in c.prefills:
                    send(pre, req, req.sends[k:k + 1])
        for req in reqs[3:]:                      # ...and prefill first for the rest
            for dec in c.decodes:
                dec.announce(req.rid, req.dst)
        for ep in c.decodes + c.prefills:
            assert {outcome(ep, r.rid) for r in reqs} == {"done"}
        for d in range(dtp):
            check_decode_rank(c, d, reqs)
        idle(*c.prefills, *c.decodes)
        writers = c.decodes if mode == "pull" else c.prefills
        assert all(ep.stats().to_dict().get("posted_bytes", 0) > 0 for ep in writers)
        others = c.prefills if mode == "pull" else c.decodes
        assert all(ep.stats().to_dict().get("posted_bytes", 0) == 0 for ep in others)
        assert all(ep.counters().get("source_holds", 0) == 0 for ep in c.prefills)


# -- failures fail exactly the decode ranks that needed the rank --------------------------------------------------
def test_cross_tp_sends_skip_whole_page_source_digests(monkeypatch: pytest.MonkeyPatch) -> None:
    """Cross-TP chunks carry slice digests made from the plan: hashing whole source pages in send() as
    well would read every byte twice in full mode."""
    from kvferry.control import prefill as prefill_mod

    calls: list[str] = []
    real = prefill_mod.source_digests
    monkeypatch.setattr(prefill_mod, "source_digests", lambda *a, **k: calls.append("x") or real(*a, **k))
    reqs = workload(2, seed=5)
    with cluster(4, 2) as c:
        for req in reqs:
            for dec in c.decodes:
                dec.announce(req.rid, req.dst)
            for pre in c.prefills:
                send(pre, req, req.sends)
        assert {outcome(dec, req.rid) for dec in c.decodes for req in reqs} == {"done"}
        for d in range(2):
            check_decode_rank(c, d, reqs)
    assert calls == []


def test_aborted_prefill_rank_fails_only_the_decode_rank_that_needed_it() -> None:
    req = workload(2, seed=5)[1]               # two chunks
    with cluster(4, 2) as c:
        for dec in c.decodes:
            dec.announce(req.rid, req.dst)
        for r, pre in enumerate(c.prefills):
            send(pre, req, req.sends if r != 3 else req.sends[:1])
        c.prefills[3].abort(req.rid, "engine evicted it")     # rank 3: only decode rank 1 needs it
        assert outcome(c.decodes[0], req.rid) == "done"
        assert outcome(c.decodes[1], req.rid) == "RequestAborted"   # the abort's own type, across the wire
        assert "engine evicted it" in str(c.decodes[1].failure(req.rid))
        # Decode 1 told rank 2 (its other source) to stop; ranks 0 and 1 saw decode 0 verify their bytes.
        assert [outcome(p, req.rid) for p in c.prefills] == ["done", "done", "RequestAborted", "RequestAborted"]
        check_decode_rank(c, 0, [req])
        idle(*c.prefills, *c.decodes)         # decode 1's lease ended with both ranks' settled Fails


def test_prefill_rank_shut_down_mid_request() -> None:
    """TP 2 -> 4: decode ranks 2 and 3 need only prefill rank 1; it closes after the first chunk."""
    req = workload(2, seed=6)[1]
    with cluster(2, 4) as c:
        for dec in c.decodes:
            dec.announce(req.rid, req.dst)
        send(c.prefills[0], req, req.sends)
        send(c.prefills[1], req, req.sends[:1])
        for d in (0, 1):
            assert outcome(c.decodes[d], req.rid) == "done"
        c.prefills[1].close()
        for d in (2, 3):
            assert outcome(c.decodes[d], req.rid) in ("KVFerryError", "PeerLost")
            _until(lambda d=d: not c.decodes[d].holds_lease(req.rid))   # rank 1 settled its writes first
        assert outcome(c.prefills[0], req.rid) == "done"
        idle(c.prefills[0], *c.decodes)


def test_corrupted_slice_fails_the_request_on_that_decode_rank() -> None:
    """A transport that corrupts one byte of prefill rank 2's writes: decode rank 1's digests catch it."""
    req = workload(1, seed=7)[0]
    with cluster(4, 2, transport=lambda r: _CorruptingTransport() if r == 2 else "local") as c:
        for dec in c.decodes:
            dec.announce(req.rid, req.dst)
        for pre in c.prefills:
            try:
                send(pre, req, req.sends)
            except RequestFailed:
                # Rank 3 writes to decode 1 too: when rank 2's bad bytes were caught before its send (a
                # loaded machine), decode 1 had already aborted the request on both its ranks.
                assert pre is c.prefills[3]
        assert outcome(c.decodes[0], req.rid) == "done"
        assert outcome(c.decodes[1], req.rid) in ("IntegrityError", "PageMismatchError")
        assert "differ from what was sent" in str(c.decodes[1].failure(req.rid))
        assert outcome(c.prefills[2], req.rid) == "IntegrityError"   # decode 1 said so in its Result
        idle(*c.prefills, *c.decodes)


def test_pull_across_tp_a_corrupted_read_fails_that_decode_rank_only() -> None:
    """Pull at TP 4 -> 2: decode rank 1's reads (from prefill ranks 2 and 3) flip a byte of what they copy;
    its slice digests catch it, decode rank 0 finishes, and no lease or source hold is left."""
    req = workload(1, seed=7)[0]
    with cluster(4, 2, mode="pull", decode_transport=lambda d: _CorruptingTransport() if d == 1 else "local") as c:
        for dec in c.decodes:
            dec.announce(req.rid, req.dst)
        for pre in c.prefills:
            try:
                send(pre, req, req.sends)
            except RequestFailed:   # decode 1's verdict may reach prefill rank 3 before its send
                assert pre is c.prefills[3]
        assert outcome(c.decodes[0], req.rid) == "done"
        assert outcome(c.decodes[1], req.rid) in ("IntegrityError", "PageMismatchError")
        assert "differ from what was sent" in str(c.decodes[1].failure(req.rid))
        idle(*c.prefills, *c.decodes)
        _until(lambda: all(ep.counters().get("source_holds", 0) == 0 for ep in c.prefills))


class _CorruptingTransport(LocalTransport):
    """Flips the first source byte of every write or read while it is copied (after prefill took its digests)."""

    def write(self, plan: Any, peer: str, notif: bytes, label: str = "") -> Any:
        with self._flipped(plan):
            return super().write(plan, peer, notif, label)

    def read(self, plan: Any, peer: str, label: str = "") -> Any:
        with self._flipped(plan):
            return super().read(plan, peer, label)

    @staticmethod
    @contextmanager
    def _flipped(plan: Any) -> Iterator[None]:
        if plan.num_descriptors == 0:
            yield
            return
        byte = ctypes.c_uint8.from_address(int(plan.src_descs[0, 0]))
        byte.value ^= 0xFF
        try:
            yield
        finally:
            byte.value ^= 0xFF


# -- refusals -----------------------------------------------------------------------------------------------------
def test_refusals_name_the_difference() -> None:
    full = small_model()
    with ExitStack() as stack:
        rank0, rank1, rank2 = (stack.enter_context(PrefillEndpoint(rank_memory(full, 4, r, None), "local",
                                                                   options=OPTS)) for r in range(3))
        dec0 = stack.enter_context(DecodeEndpoint(rank_memory(full, 2, 0, None), "local", options=OPTS))
        # decode rank 0 of 2 needs prefill ranks 0 and 1 of 4, not 2: prefill says so
        with pytest.raises(IncompatiblePeer, match=r"needs prefill ranks \[0, 1\] of TP 4; this prefill is rank 2"):
            dec0.connect(rank2.address, timeout=5)
        # an address list out of rank order is caught at the handshake
        with pytest.raises(IncompatiblePeer, match="it is rank 1 of TP 4, expected rank 0 of TP 4"):
            dec0.connect_all([rank1.address, rank0.address, rank2.address, "tcp://127.0.0.1:9"], timeout=5)
        with pytest.raises(ValueError, match="prefill addresses repeat"):
            dec0.connect_all([rank0.address] * 4)
        dec0.connect(rank0.address)
        # connected to rank 0 only: a request would miss heads 2..3, so it is refused before any lease
        with pytest.raises(PeerLost, match=r"needs prefill ranks \[0, 1\] of TP 4; not connected to rank\(s\) \[1\]"):
            dec0.announce("x", {"kv": [0]})
        assert dec0.num_live_leases == 0
    other = llama_like(num_layers=2, num_pages=24, tokens=4, heads=16, head_bytes=8)
    with PrefillEndpoint(rank_memory(full, 4, 0, None), "local", options=OPTS) as pre, \
            DecodeEndpoint(rank_memory(other, 2, 0, None), "local", options=OPTS) as dec, \
            pytest.raises(IncompatiblePeer, match=r"total heads \(num_heads x tp_size\) differs"):
        dec.connect(pre.address, timeout=5)


# -- slice digests on their own ------------------------------------------------------------------------------------
@pytest.mark.parametrize("major", ["head", "token"])
def test_slice_digests_cover_exactly_the_rank_pairs_bytes(major: str) -> None:
    full = small_model(major)
    data = full_arrays(full, 3)
    srcs = [rank_memory(full, 4, r, data) for r in range(4)]
    dst = rank_memory(full, 2, 1, None)
    pages = {"kv": ([3, 4, 9], [0, 1, 7]), "state": ([2], [5])}
    plans = plan_decode_rank(srcs, dst, pages)
    digests = {r: digest_plan(p, "full") for r, p in plans.items()}
    for p in plans.values():
        memmove_plan(p)
    for r, p in plans.items():
        verify_digests(dst, digests[r], p.slices)
    assert sorted(plans) == [2, 3] and len(digests[2]) > len(digests[3])   # rank 2 also sends replicas
    # Rank 3's heads of L0.k page 1 are the second half of each token row (token-major) or of the page.
    k = dst.array("L0.k")
    byte = k.shape[1] - 1
    k[1, byte] ^= 1
    with pytest.raises(PageMismatchError, match="buffer 'L0.k' \\(layer 0\\), page 1"):
        verify_digests(dst, digests[3], plans[3].slices)
    verify_digests(dst, digests[2], plans[2].slices)                 # not rank 2's slice: still fine
    with pytest.raises(IntegrityError, match="does not write to this decode rank"):
        verify_digests(dst, digests[2], plans[3].slices)          # rank 3 sends no replicated buffer


def _until(pred: Any, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.005)
    return True


# -- NIXL, one OS process per side ----------------------------------------------------------------------------------
PEER = Path(__file__).with_name("tp_endpoint_peer.py")
NIXL_TIMEOUTS = {"heartbeat_interval": 0.2, "peer_timeout": 1.0, "lease_grace": 1.0, "request_timeout": 30.0}
no_nixl = pytest.mark.skipif(importlib.util.find_spec("nixl") is None, reason="nixl is not installed")


class RankPeer:
    """Prefill ranks ``ranks`` of a TP group of ``ptp`` in a child process (see tests/tp_endpoint_peer.py)."""

    def __init__(self, ptp: int, ranks: list[int], major: str = "head") -> None:
        cfg = {"ptp": ptp, "ranks": ranks, "major": major, "seed": SEED, "options": NIXL_TIMEOUTS}
        env = {**os.environ, "PYTHONPATH": str(PEER.parent.parent / "src")}
        self.proc = subprocess.Popen([sys.executable, str(PEER), json.dumps(cfg)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, env=env)
        self.addresses = {int(r): a for r, a in self._next()["addresses"].items()}

    def _next(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert line, f"rank peer exited with {self.proc.poll()}"
        return json.loads(line)

    def __call__(self, op: str, **args: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"op": op, **args}) + "\n")
        self.proc.stdin.flush()
        return self._next()

    def close(self) -> None:
        if self.proc.poll() is None:
            with suppress(BrokenPipeError, AssertionError):
                self("exit")
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)


@contextmanager
def nixl_decodes(full: Layout, dtp: int) -> Iterator[list[DecodeEndpoint]]:
    opts = EndpointOptions(**NIXL_TIMEOUTS)
    with ExitStack() as stack:
        yield [stack.enter_context(DecodeEndpoint(rank_memory(full, dtp, d, None), "nixl", options=opts,
                                                  digest_mode="full")) for d in range(dtp)]


@pytest.mark.nixl
@no_nixl
@pytest.mark.parametrize("ptp, dtp", [(4, 2), (2, 4)])
def test_nixl_prefill_process_to_decode_ranks(ptp: int, dtp: int) -> None:
    """All prefill ranks in one child process (one NIXL agent each), all decode ranks in this one."""
    full, reqs = small_model(), workload(6, seed=31)
    peer = RankPeer(ptp, list(range(ptp)))
    try:
        with nixl_decodes(full, dtp) as decodes:
            addresses = [peer.addresses[r] for r in range(ptp)]
            for dec in decodes:
                dec.connect_all(addresses)
                for req in reqs:
                    dec.announce(req.rid, req.dst)
            peer("serve", n=6, seed=31)
            for dec in decodes:
                assert {outcome(dec, r.rid) for r in reqs} == {"done"}
            assert set(peer("wait")["results"].values()) == {"done"}
            data = full_arrays(full, SEED)
            for d in range(dtp):
                assert check_rank(decodes[d].memory, full, data, dtp, d, _pages(reqs)) == []
            idle(*decodes)
            assert all(k["live_handles"] == 0 for k in peer("counters")["counters"].values())
    finally:
        peer.close()


@pytest.mark.nixl
@no_nixl
def test_nixl_prefill_ranks_killed_mid_request() -> None:
    """TP 4 -> 2, prefill ranks 0-1 and 2-3 in two processes; SIGKILL the second after its first chunks:
    decode rank 1 (which needs ranks 2 and 3) fails every request with PeerLost and frees its pages after
    the grace; decode rank 0 completes everything."""
    full, reqs = small_model(), workload(6, seed=32)
    low, high = RankPeer(4, [0, 1]), RankPeer(4, [2, 3])
    try:
        with nixl_decodes(full, 2) as decodes:
            addresses = [{**low.addresses, **high.addresses}[r] for r in range(4)]
            for dec in decodes:
                dec.connect_all(addresses)
                for req in reqs:
                    dec.announce(req.rid, req.dst)
            low("serve", n=6, seed=32)
            high("serve", n=6, seed=32, hold_last=True)
            assert {outcome(decodes[0], r.rid) for r in reqs} == {"done"}
            high.proc.send_signal(signal.SIGKILL)
            high.proc.wait(10)
            assert {outcome(decodes[1], r.rid) for r in reqs} == {"PeerLost"}
            assert decodes[1].num_live_leases == len(reqs)      # a write may still be landing...
            idle(*decodes)                                       # ...until lease_grace after the death
            assert set(low("wait")["results"].values()) == {"done"}
            assert check_rank(decodes[0].memory, full, full_arrays(full, SEED), 2, 0, _pages(reqs)) == []
    finally:
        low.close()
        high.close()


def _pages(reqs: list[Req]) -> dict[str, tuple[list[int], list[int]]]:
    return {p: (np.concatenate([r.src[p] for r in reqs]).tolist(), np.concatenate([r.dst[p] for r in reqs]).tolist())
            for p in ("kv", "state")}
