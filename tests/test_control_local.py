"""Control plane in one process over the local transport: lifecycle, chunking, refusals, aborts, faults."""

from __future__ import annotations

import ctypes
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from kvferry import IncompatiblePeer, IntegrityError, KVMemory, LeaseError, PeerLost, TransferTimeout
from kvferry.control import DecodeEndpoint, EndpointOptions, PrefillEndpoint, RequestState
from kvferry.errors import (
    EndpointClosed,
    HandshakeError,
    KVFerryError,
    PlanError,
    RequestFailed,
    TransportError,
    UsageError,
)
from kvferry.plan import TransferPlan
from kvferry.transport import LocalTransport
from kvferry.transport.local import LocalHandle

from .control_peer import announce, fill, make_layout, run_prefill, snapshot, verify, wait_all, workload

OPTS = EndpointOptions(heartbeat_interval=0.1, peer_timeout=0.6, lease_grace=0.4, request_timeout=20.0)
SEED = 7


def _memories() -> tuple[KVMemory, KVMemory]:
    src, dst = KVMemory.allocate(make_layout("prefill")), KVMemory.allocate(make_layout("decode"))
    fill(src, SEED)
    fill(dst, 999)
    return src, dst


def _idle(ep: Any) -> bool:
    c = ep.counters()
    return c["live_requests"] == c["live_leases"] == c["live_handles"] == 0


def _assert_idle(*eps: Any) -> None:
    """No request, lease or handle left (after the last messages in flight arrived)."""
    for ep in eps:
        deadline = time.monotonic() + 5
        while not _idle(ep) and time.monotonic() < deadline:
            time.sleep(0.005)
        assert _idle(ep), ep.counters()


@pytest.fixture
def pair() -> Iterator[tuple[PrefillEndpoint, DecodeEndpoint]]:
    src, dst = _memories()
    prefill = PrefillEndpoint(src, "local", options=OPTS)
    decode = DecodeEndpoint(dst, "local", options=OPTS)
    decode.connect(prefill.address)
    yield prefill, decode
    decode.close()
    prefill.close()


@pytest.mark.parametrize("digest_mode", ["sampled", "full"])
def test_many_requests_chunked_and_layered(digest_mode: str) -> None:
    src, dst = _memories()
    before = snapshot(dst)
    reqs = workload(64, seed=1)
    with PrefillEndpoint(src, "local", options=OPTS, digest_mode=digest_mode) as prefill, \
            DecodeEndpoint(dst, "local", options=OPTS, digest_mode=digest_mode) as decode:
        decode.connect(prefill.address)
        announce(decode, reqs[:32])                       # decode first for half of them...
        sender = threading.Thread(target=run_prefill, args=(prefill, reqs))
        sender.start()
        announce(decode, reqs[32:])                       # ...prefill first (or racing) for the rest
        sender.join()
        assert set(wait_all(decode, [r.rid for r in reqs], 20).values()) == {"done"}
        assert set(wait_all(prefill, [r.rid for r in reqs], 20).values()) == {"done"}
        verify(dst, SEED, reqs, before)
        _assert_idle(prefill, decode)
        assert decode.counters()["stray_notifications"] == 0


def test_states_move_forward(pair: tuple[PrefillEndpoint, DecodeEndpoint]) -> None:
    prefill, decode = pair
    req = workload(1, seed=2)[0]
    prefill.send(req.rid, {"main": req.src["main"][:2]}, last=False)
    assert prefill.poll(req.rid) is RequestState.BOOTSTRAPPING
    decode.announce(req.rid, req.dst)
    _until(lambda: decode.poll(req.rid) is RequestState.TRANSFERRING)
    assert prefill.poll(req.rid) is RequestState.TRANSFERRING
    prefill.send(req.rid, {"main": req.src["main"][2:], "c4": req.src["c4"]}, offset={"main": 2}, last=True)
    decode.wait(req.rid, 5)
    prefill.wait(req.rid, 5)
    assert decode.poll(req.rid) is prefill.poll(req.rid) is RequestState.DONE
    with pytest.raises(ValueError, match="already done"):
        prefill.send(req.rid, {"main": [0]}, last=True)


def test_incomplete_request_fails_on_both_sides(pair: tuple[PrefillEndpoint, DecodeEndpoint]) -> None:
    prefill, decode = pair
    req = workload(1, seed=3)[0]
    decode.announce(req.rid, req.dst)
    prefill.send(req.rid, {"main": req.src["main"]}, last=True)   # the c4 page is never sent
    for ep in (prefill, decode):
        with pytest.raises(RequestFailed, match="never written"):
            ep.wait(req.rid, 5)
    _until(lambda: decode.num_live_leases == 0)
    _assert_idle(prefill, decode)


# -- refusals --------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("kwargs", "needle"), [
    ({"idx_dtype": "fp8_e4m3"}, "dtype differs: local 'bf16', remote 'fp8_e4m3'"),
    ({"main_page": 1024}, "page_bytes differs: local 512, remote 1024"),
])
def test_incompatible_layouts_are_refused(kwargs: dict[str, Any], needle: str) -> None:
    src = KVMemory.allocate(make_layout("prefill"))
    dst = KVMemory.allocate(make_layout("decode", **kwargs))
    with PrefillEndpoint(src, "local", options=OPTS) as prefill, \
            DecodeEndpoint(dst, "local", options=OPTS) as decode:
        with pytest.raises(IncompatiblePeer, match=needle.replace("(", r"\(")) as info:
            decode.connect(prefill.address, timeout=5)
        assert "main.idx.L0" in str(info.value) or "main.kv.L0" in str(info.value)
        assert prefill.peers == [] and decode.peers == []


def test_pool_set_difference_is_named() -> None:
    from kvferry import Layout

    src = KVMemory.allocate(make_layout("prefill"))
    dst = KVMemory.allocate(Layout([make_layout("decode").pools[0]]))
    with PrefillEndpoint(src, "local", options=OPTS) as prefill, \
            DecodeEndpoint(dst, "local", options=OPTS) as decode, \
            pytest.raises(IncompatiblePeer, match=r"pool set differs.*'c4'"):
        decode.connect(prefill.address, timeout=5)


@pytest.mark.parametrize(("server", "client", "needle"), [
    ("s3cret", "wrong", "shared secret does not match"),
    ("s3cret", None, "requires a shared secret"),
    (None, "s3cret", "did not prove the shared secret"),
])
def test_secret_mismatch_is_refused(server: str | None, client: str | None, needle: str) -> None:
    src, dst = _memories()
    with PrefillEndpoint(src, "local", options=OPTS, secret=server) as prefill, \
            DecodeEndpoint(dst, "local", options=OPTS, secret=client) as decode:
        with pytest.raises(IncompatiblePeer, match=needle):
            decode.connect(prefill.address, timeout=5)
        _until(lambda: prefill.peers == [])


def test_right_secret_is_accepted() -> None:
    src, dst = _memories()
    with PrefillEndpoint(src, "local", options=OPTS, secret=b"k" * 32) as prefill, \
            DecodeEndpoint(dst, "local", options=OPTS, secret=b"k" * 32) as decode:
        decode.connect(prefill.address, timeout=5)
        req = workload(1, seed=4)[0]
        decode.announce(req.rid, req.dst)
        run_prefill(prefill, [req])
        decode.wait(req.rid, 5)


def test_connect_to_nobody_times_out() -> None:
    _, dst = _memories()
    with DecodeEndpoint(dst, "local", options=OPTS) as decode, pytest.raises(HandshakeError, match="no handshake"):
        decode.connect("tcp://127.0.0.1:9", timeout=0.3)


def test_bad_pages_are_refused_before_anything_moves(pair: tuple[PrefillEndpoint, DecodeEndpoint]) -> None:
    prefill, decode = pair
    before = snapshot(decode.memory)
    with pytest.raises(LeaseError, match=r"buffer 'main.idx.L0': destination page 290 is out of range"):
        decode.announce("x", {"main": [1, 290]})       # valid for main.kv (300) but not main.idx (288)
    with pytest.raises(LeaseError, match="destination page -1 is out of range"):
        decode.announce("x", {"main": [-1]})
    with pytest.raises(LeaseError, match="destination page 5 appears more than once"):
        decode.announce("x", {"main": [5, 6, 5]})
    with pytest.raises(LeaseError, match="no pool 'nope'"):
        decode.announce("x", {"nope": [1]})
    decode.announce("a", {"main": [10, 11], "c4": [3]})
    with pytest.raises(LeaseError, match="page 11 is leased to live request 'a'"):
        decode.announce("b", {"main": [11, 12]})
    with pytest.raises(LeaseError, match="already live"):
        decode.announce("a", {"main": [50]})
    with pytest.raises(PlanError, match="buffer .main.kv.L0.: source page 400 is out of range"):
        prefill.send("a", {"main": [400, 1]})
    with pytest.raises(PlanError, match="pool 'main': source pages must be a 1-D sequence"):
        prefill.send("a", {"main": [[3, 4]]})
    with pytest.raises(PlanError, match="no buffer 'main.kv.L9' in layout"):
        prefill.send("a", {"main": [3, 4]}, buffers=["main.kv.L9"])
    assert decode.num_live_leases == 1 and decode.num_leased_pages == 3
    decode.abort("a", "test over")
    _until(lambda: decode.num_live_leases == 0)
    decode.announce("b", {"main": [11, 12]})           # reusable once settled
    decode.abort("b")
    _until(lambda: decode.num_live_leases == 0)
    assert all(np.array_equal(decode.memory.array(k), v) for k, v in before.items())
    _assert_idle(prefill, decode)


def test_chunk_beyond_the_lease_fails_the_request(pair: tuple[PrefillEndpoint, DecodeEndpoint]) -> None:
    prefill, decode = pair
    decode.announce("r", {"main": [1, 2]})
    prefill.send("r", {"main": [5, 6]}, offset=1)
    with pytest.raises(RequestFailed, match=r"positions 1..2 but decode leased 2"):
        decode.wait("r", 5)
    _until(lambda: decode.num_live_leases == 0)


def test_a_chunk_that_rewrites_written_cells_fails_the_request(pair: tuple[PrefillEndpoint, DecodeEndpoint]) -> None:
    prefill, decode = pair
    decode.announce("r", {"main": [1, 2, 3]})
    prefill.send("r", {"main": [5, 6]}, last=False, buffers=["main.kv.L0", "main.idx.L0"])
    prefill.send("r", {"main": [6]}, offset=1, last=False, buffers=["main.kv.L1"])        # new cells: fine
    prefill.send("r", {"main": [6, 7]}, offset=1, buffers=["main.idx.L0", "main.idx.L1"])   # main.idx.L0, 1 again
    with pytest.raises(RequestFailed, match=r"pool 'main': a chunk rewrites destination pages an earlier chunk"):
        decode.wait("r", 5)
    _until(lambda: decode.num_live_leases == 0)


def test_a_last_chunk_that_leaves_cells_unwritten_fails_the_request_naming_the_first(
        pair: tuple[PrefillEndpoint, DecodeEndpoint]) -> None:
    prefill, decode = pair
    decode.announce("r", {"main": [1, 2, 3], "c4": [4]})
    prefill.send("r", {"main": [5, 6, 7], "c4": [8]}, last=False, buffers=["main.kv.L0", "main.idx.L0", "c4.kv.L0"])
    prefill.send("r", {"main": [5]}, buffers=["main.kv.L1", "main.idx.L1"])   # positions 1, 2 of L1 never
    # The first missing cell, buffer by buffer then position: main.kv.L1 at position 1 (decode page 2); 4 cells
    # of main (kv.L1 and idx.L1, positions 1 and 2) are missing, c4 is checked after.
    with pytest.raises(RequestFailed, match=r"pool 'main', buffer 'main.kv.L1', destination page 2 was never "
                                            r"written \(4 cells missing\)"):
        decode.wait("r", 5)
    _until(lambda: decode.num_live_leases == 0)


# -- aborts while writes are in flight -----------------------------------------------------------------------
class GatedTransport(LocalTransport):
    """A local transport whose writes stay in flight (nothing copied, no notification) until ``gate`` opens."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = threading.Event()

    def write(self, plan: TransferPlan, peer: str, notif: bytes, label: str = "") -> LocalHandle:
        outer = self

        class Gated(LocalHandle):
            def poll(self) -> bool:
                if not outer.gate.is_set():
                    return False
                if not getattr(self, "landed", False):
                    self.landed = True
                    LocalTransport.write(outer, plan, peer, notif, label)
                return True

        return Gated(peer, label)


@pytest.fixture
def gated() -> Iterator[tuple[PrefillEndpoint, DecodeEndpoint, GatedTransport]]:
    src, dst = _memories()
    transport = GatedTransport()
    prefill = PrefillEndpoint(src, transport, options=OPTS)
    decode = DecodeEndpoint(dst, "local", options=OPTS)
    decode.connect(prefill.address)
    yield prefill, decode, transport
    decode.close()
    prefill.close()
    transport.close()


@pytest.mark.parametrize("side", ["decode", "prefill"])
def test_abort_keeps_pages_leased_until_the_write_settled(
        gated: tuple[PrefillEndpoint, DecodeEndpoint, GatedTransport], side: str) -> None:
    prefill, decode, transport = gated
    req = workload(1, seed=5)[0]
    decode.announce(req.rid, req.dst)
    run_prefill(prefill, [req])
    _until(lambda: prefill.num_live_handles == 1)
    (decode if side == "decode" else prefill).abort(req.rid, "changed my mind")
    if side == "decode":
        with pytest.raises(RequestFailed, match="aborted by decode"):
            decode.wait(req.rid, 5)
    with pytest.raises(RequestFailed, match=f"aborted by {side}"):
        prefill.wait(req.rid, 5)
    time.sleep(0.3)                                    # several heartbeats: still nothing settles
    assert decode.num_live_leases == 1 and prefill.num_live_handles == 1
    with pytest.raises(LeaseError, match="leased to live request"):
        decode.announce("reuse", {"main": req.dst["main"][:1]})
    transport.gate.set()                               # the write lands, then settles
    with pytest.raises(RequestFailed, match="aborted"):
        decode.wait(req.rid, 5)
    _until(lambda: decode.num_live_leases == 0)
    assert np.array_equal(decode.memory.array("main.kv.L0")[req.dst["main"]],
                          prefill.memory.array("main.kv.L0")[req.src["main"]])
    _assert_idle(prefill, decode)


class CopyingTransport(LocalTransport):
    """Transfers copy inside the call (as NIXL's cma does); the first one, write or read, lasts until
    ``done`` is set, then copies, or raises when ``fail`` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.copying, self.done, self.fail = threading.Event(), threading.Event(), threading.Event()

    def _first_copy(self, label: str) -> None:
        if not self.copying.is_set():
            self.copying.set()
            assert self.done.wait(10)
            if self.fail.is_set():
                raise TransportError(f"transfer {label!r} failed")

    def write(self, plan: TransferPlan, peer: str, notif: bytes, label: str = "") -> LocalHandle:
        self._first_copy(label)
        return super().write(plan, peer, notif, label)

    def read(self, plan: TransferPlan, peer: str, label: str = "") -> LocalHandle:
        self._first_copy(label)
        return super().read(plan, peer, label)


def test_callers_are_served_while_a_write_copies_and_abort_waits_for_it() -> None:
    """Prefill lets go of its lock while a write copies: ``send``, ``abort`` and ``holds_source`` answer
    at once, and an abort that came during the copy still keeps the pages until that write settled."""
    src, dst = _memories()
    before = snapshot(dst)
    transport = CopyingTransport()
    first, second = {"main": [3, 9, 4]}, {"main": [20, 21]}
    with PrefillEndpoint(src, transport, options=OPTS) as prefill, \
            DecodeEndpoint(dst, "local", options=OPTS) as decode:
        decode.connect(prefill.address)
        decode.announce("first", {"main": [7, 1, 30]})
        prefill.send("first", first)
        assert transport.copying.wait(5)
        threading.Timer(2.0, transport.done.set).start()   # so that a prefill holding its lock fails, not hangs
        t0 = time.monotonic()
        prefill.send("second", second)                 # accepted while the first copy runs
        prefill.abort("first", "changed my mind")
        assert prefill.holds_source("first")           # the write is in flight: its pages are not free
        assert prefill.poll("first") is RequestState.FAILED
        assert time.monotonic() - t0 < 1.0
        time.sleep(0.3)                                # several heartbeats: decode keeps the pages leased
        assert decode.num_live_leases == 1
        transport.done.set()
        with pytest.raises(RequestFailed, match="aborted by prefill"):
            prefill.wait("first", 5)
        _until(lambda: not prefill.holds_source("first") and decode.num_live_leases == 0)
        decode.announce("second", {"main": [11, 12]})  # the second request was kept, and goes through
        prefill.wait("second", 5)
        decode.wait("second", 5)
        _assert_idle(prefill, decode)
    for buf in dst.layout.pool("main").buffers:        # the first write landed whole, the second too
        got, want = dst.array(buf.name), src.array(buf.name)
        assert np.array_equal(got[[7, 1, 30, 11, 12]], want[[3, 9, 4, 20, 21]])
        untouched = np.setdiff1d(np.arange(len(got)), [7, 1, 30, 11, 12])
        assert np.array_equal(got[untouched], before[buf.name][untouched])


def test_ended_lists_each_request_once_in_the_order_they_ended(
        pair: tuple[PrefillEndpoint, DecodeEndpoint]) -> None:
    prefill, decode = pair
    before = snapshot(decode.memory)
    for ep in (prefill, decode):
        assert ep.ended() == []                        # starts the record
    reqs = workload(6, seed=3)
    announce(decode, reqs)
    decode.abort(reqs[0].rid, "not needed")
    run_prefill(prefill, reqs[1:])
    seen: dict[str, list[str]] = {"prefill": [], "decode": []}
    deadline = time.monotonic() + 10
    while (len(seen["prefill"]) < 6 or len(seen["decode"]) < 6) and time.monotonic() < deadline:
        for name, ep in (("prefill", prefill), ("decode", decode)):
            seen[name] += ep.ended(0.05)
    for name, ep in (("prefill", prefill), ("decode", decode)):
        assert sorted(seen[name]) == sorted(r.rid for r in reqs), name
        ends = [ep.timing(rid)[1] for rid in seen[name]]
        assert ends == sorted(ends), f"{name}: not in the order they ended"   # type: ignore[type-var]
        assert {ep.poll(r.rid) for r in reqs[1:]} == {RequestState.DONE}
        assert ep.poll(reqs[0].rid) is RequestState.FAILED
    t0 = time.monotonic()
    assert decode.ended(0.1) == [] and time.monotonic() - t0 >= 0.09   # nothing more: it waited, then []
    verify(decode.memory, SEED, reqs[1:], before)     # the aborted request's pages were never written
    _assert_idle(prefill, decode)


def test_ended_keeps_at_most_max_finished_ids(pair: tuple[PrefillEndpoint, DecodeEndpoint],
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """A caller that stops asking leaks nothing: the oldest ids beyond the bound are dropped."""
    from kvferry.control.core import base

    prefill, decode = pair
    monkeypatch.setattr(base, "MAX_FINISHED", 4)
    assert decode.ended() == []
    reqs = workload(6, seed=4)
    for req in reqs:                                   # one after another: they end in this order
        decode.announce(req.rid, req.dst)
        run_prefill(prefill, [req])
        decode.wait(req.rid, 5)
    assert decode.ended() == [r.rid for r in reqs[-4:]]


def test_under_load_calls_do_not_wake_the_loop_yet_leave_within_its_sleep(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """From LAZY_WAKE_MIN requests in flight a caller's call writes no wake-up byte (the spinning loop comes
    round within its busy sleep); below it, it does. Either way every request completes, bytes checked."""
    import os

    from kvferry.control import pacing

    src, dst = _memories()
    before = snapshot(dst)
    opts = EndpointOptions(heartbeat_interval=0.1, peer_timeout=2.0, request_timeout=20.0, busy_poll=2e-3,
                           busy_poll_max=20e-3)
    with PrefillEndpoint(src, "local", options=opts) as prefill, DecodeEndpoint(dst, "local", options=opts) as decode:
        decode.connect(prefill.address)
        wakes: list[int] = []
        write = os.write

        def counting_write(fd: int, data: bytes) -> int:
            if fd == decode._pacer.wake_w:
                wakes.append(fd)
            return write(fd, data)

        monkeypatch.setattr(pacing.os, "write", counting_write)
        n = pacing.LAZY_WAKE_MIN
        reqs = workload(n + 4, seed=11)
        for req in reqs[:n - 1]:
            decode.announce(req.rid, req.dst)          # each one wakes: fewer than n are in flight with it
            deadline = time.monotonic() + 5
            while decode._pacer.pending and time.monotonic() < deadline:
                time.sleep(0.001)                      # the loop drains the byte; the next call writes again
        assert len(wakes) == n - 1
        time.sleep(0.05)                               # spinning now
        t0 = time.monotonic()
        announce(decode, reqs[n - 1:])                 # n to n + 4 in flight: under load
        assert len(wakes) == n - 1                     # not one byte for these five
        run_prefill(prefill, reqs)
        assert wait_all(decode, [r.rid for r in reqs], 10) == {r.rid: "done" for r in reqs}
        # The five announces left with the loop's next round (a sleep of at most busy_poll_max).
        assert max(decode.timing(r.rid)[1] for r in reqs[n - 1:]) - t0 < 5.0   # type: ignore[operator]
        verify(dst, SEED, reqs, before)
        _assert_idle(prefill, decode)


@pytest.mark.parametrize("stale", [False, True])
def test_a_chunk_sent_after_its_announce_is_planned_on_the_callers_thread(
        pair: tuple[PrefillEndpoint, DecodeEndpoint], monkeypatch: pytest.MonkeyPatch, stale: bool) -> None:
    """Decode announced first (as engines mostly do): send() plans the chunk, so the progress thread (whose
    time bounds push mode's throughput) only posts it. A plan that no longer matches the record (here:
    made stale by force) is planned again on the progress thread. Either way the bytes are checked."""
    from kvferry.control.core import prefill as prefill_mod
    from kvferry.control.core.prefill_requests import Planned

    prefill, decode = pair
    before = snapshot(decode.memory)
    planners: list[str] = []
    real = prefill_mod.plan_pages

    def recording(*args: Any, **kwargs: Any) -> Any:
        planners.append(threading.current_thread().name)
        return real(*args, **kwargs)

    monkeypatch.setattr(prefill_mod, "plan_pages", recording)
    if stale:
        monkeypatch.setattr(Planned, "matches", lambda self, rec: False)
    reqs = workload(4, seed=12)
    announce(decode, reqs)
    deadline = time.monotonic() + 5
    for req in reqs:    # prefill has heard every announce
        while time.monotonic() < deadline:
            try:
                if prefill.poll(req.rid) is RequestState.WAITING_FOR_INPUT:
                    break
            except UsageError:   # not heard of yet
                pass
            time.sleep(0.002)
    run_prefill(prefill, reqs)
    assert wait_all(decode, [r.rid for r in reqs], 10) == {r.rid: "done" for r in reqs}
    verify(decode.memory, SEED, reqs, before)
    chunks = sum(len(r.sends) for r in reqs)
    caller = threading.current_thread().name
    assert planners.count(caller) == chunks                      # every chunk planned in send()
    assert planners.count("kvferry-prefill") == (chunks if stale else 0)
    _assert_idle(prefill, decode)


def test_decode_deadline_fails_and_releases(pair: tuple[PrefillEndpoint, DecodeEndpoint]) -> None:
    prefill, decode = pair
    src, dst = prefill.memory, decode.memory
    opts = EndpointOptions(heartbeat_interval=0.1, peer_timeout=0.6, request_timeout=0.3)
    with DecodeEndpoint(KVMemory.allocate(dst.layout), "local", options=opts) as quick:
        quick.connect(prefill.address)
        quick.announce("late", {"main": [1]})
        with pytest.raises(TransferTimeout):
            quick.wait("late", 0.05)                   # the wait's own deadline: the request goes on
        with pytest.raises(RequestFailed) as info:
            quick.wait("late", 5)
        assert isinstance(info.value.__cause__, TransferTimeout)
        _until(lambda: quick.num_live_leases == 0)      # prefill settled the abort
    assert src is prefill.memory


# -- integrity -----------------------------------------------------------------------------------------------
def test_corrupted_bytes_fail_on_both_sides() -> None:
    src, dst = _memories()

    class Flipping(LocalTransport):
        def write(self, plan: TransferPlan, peer: str, notif: bytes, label: str = "") -> LocalHandle:
            # Corrupt the destination right after the copy but before the notification is read.
            handle = super().write(plan, peer, notif, label)
            ctypes.c_uint8.from_address(int(plan.dst_descs[0, 0])).value ^= 0xFF
            return handle

    transport = Flipping()
    with PrefillEndpoint(src, transport, options=OPTS, digest_mode="full") as prefill, \
            DecodeEndpoint(dst, "local", options=OPTS, digest_mode="full") as decode:
        decode.connect(prefill.address)
        req = workload(1, seed=6)[0]
        decode.announce(req.rid, req.dst)
        run_prefill(prefill, [req])
        for ep in (decode, prefill):
            with pytest.raises(RequestFailed) as info:
                ep.wait(req.rid, 5)
            assert isinstance(info.value.__cause__, IntegrityError)
        _until(lambda: decode.num_live_leases == 0)
        _assert_idle(prefill, decode)
    transport.close()


# -- peers leaving and coming back -----------------------------------------------------------------------
def test_prefill_restart_and_reconnect() -> None:
    src, dst = _memories()
    before = snapshot(dst)
    decode = DecodeEndpoint(dst, "local", options=OPTS)
    first = PrefillEndpoint(src, "local", options=OPTS)
    decode.connect(first.address)
    reqs = workload(8, seed=8)
    announce(decode, reqs)
    first.close()                                      # says Bye after failing its requests
    results = wait_all(decode, [r.rid for r in reqs], 5)
    assert all(v.startswith("PeerLost") for v in results.values()), results
    _until(lambda: decode.num_live_leases == 0)
    second = PrefillEndpoint(src, "local", options=OPTS)
    decode.connect(second.address)
    again = workload(8, seed=8, prefix="again")
    announce(decode, again)
    run_prefill(second, again)
    assert set(wait_all(decode, [r.rid for r in again], 5).values()) == {"done"}
    verify(dst, SEED, again, before)
    _assert_idle(second, decode)
    decode.close()
    second.close()


def test_prefill_close_fails_held_requests_with_peer_lost(pair: tuple[PrefillEndpoint, DecodeEndpoint]) -> None:
    """A prefill that closes while it holds requests (announced, some KV sent, not all) is a peer leaving:
    decode's waiters get PeerLost, whether the settled Fail or the Bye reaches decode first."""
    prefill, decode = pair
    reqs = workload(4, seed=10)
    announce(decode, reqs)
    prefill.send(reqs[0].rid, {"main": reqs[0].src["main"][:1]}, last=False)   # one mid-transfer
    _until(lambda: prefill.num_live_requests == 4)
    prefill.close()
    for r in reqs:
        with pytest.raises(RequestFailed) as info:
            decode.wait(r.rid, 5)
        assert isinstance(info.value.__cause__, PeerLost), repr(info.value.__cause__)
        assert "closing" in str(info.value.__cause__)
    _until(lambda: decode.num_live_leases == 0)     # prefill settled its writes before it left
    _assert_idle(decode)


def test_decode_close_fails_prefill_requests(pair: tuple[PrefillEndpoint, DecodeEndpoint]) -> None:
    prefill, decode = pair
    reqs = workload(4, seed=9)
    announce(decode, reqs)
    _until(lambda: prefill.num_live_requests == 4)
    decode.close()
    for r in reqs:
        with pytest.raises(RequestFailed):
            prefill.wait(r.rid, 5)
    _assert_idle(prefill)
    _until(lambda: prefill.peers == [])


def test_closed_endpoint_refuses_calls(pair: tuple[PrefillEndpoint, DecodeEndpoint]) -> None:
    prefill, decode = pair
    decode.close()
    with pytest.raises(EndpointClosed, match="decode endpoint is closed"):
        decode.announce("x", {"main": [1]})
    with pytest.raises(UsageError, match="prefill: unknown request 'never-seen'"):
        prefill.poll("never-seen")
    assert isinstance(PeerLost("x"), KVFerryError)


def _until(pred: Any, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        time.sleep(0.005)
