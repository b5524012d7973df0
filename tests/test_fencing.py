"""No late write, ever (issue 11): a stalled prefill's writes land only in quarantined pages, and every
blocking call keeps its own deadline whatever the progress loop does. Every test checks bytes or clocks.

Defect 1: decode declares a stalled prefill dead, fails its request, and (before) freed the pages one
``lease_grace`` later for a request of a second prefill; the first prefill then resumed and wrote into them.
Now the pages are quarantined until the first prefill acknowledges (after decode reconnects to it) or is
certainly gone. Defect 2: an answer above ``max_message_bytes`` made libzmq drop the connection, a send
then raised ``zmq.Again``, the loop died and ``connect`` ignored its timeout.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import zmq

from kvferry import HandshakeError, KVMemory, LeaseError, PeerLost, TransferTimeout
from kvferry.control import DecodeEndpoint, EndpointOptions, PrefillEndpoint, wire
from kvferry.control.core.states import LinkState
from kvferry.errors import EndpointClosed, RequestFailed
from kvferry.plan import TransferPlan
from kvferry.transport import LocalTransport
from kvferry.transport.local import LocalHandle

from .control_peer import fill, make_layout
from .test_control_wire import FakePrefill  # a ROUTER speaking just enough protocol to be accepted

SEED_1, SEED_2 = 7, 8          # the two prefills hold different bytes: a late write shows
PAGES_A = {"main": np.array([10, 11, 12, 13]), "c4": np.array([5])}      # decode's pages X
SRC_A = {"main": np.array([0, 1, 2, 3]), "c4": np.array([0])}
NUM_X = 5
# (peer_timeout, lease_grace, stall): the figures, and the same story three times faster.
DESCRIBED = pytest.param((2.5, 1.0, 6.0), id="as-described", marks=pytest.mark.slow)
SCALED = pytest.param((0.8, 0.3, 2.0), id="scaled")


def _options(cfg: tuple[float, float, float]) -> EndpointOptions:
    peer_timeout, lease_grace, _ = cfg
    # These stalls are a thread's (the process's libzmq keeps answering: starvation, which the default
    # transport_liveness rides out); here they stand for a stopped process, judged by silence.
    return EndpointOptions(heartbeat_interval=peer_timeout / 5, peer_timeout=peer_timeout,
                           lease_grace=lease_grace, request_timeout=30.0, transport_liveness=False)


def _memory(side: str, seed: int) -> KVMemory:
    mem = KVMemory.allocate(make_layout(side))
    fill(mem, seed)
    return mem


def _block(i: int) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """Source and destination pages of the second prefill's requests: four blocks of decode pages, reused."""
    k = i % 4
    dst = {"main": np.arange(20 + 4 * k, 24 + 4 * k), "c4": np.array([20 + k])}
    src = {"main": np.arange(50 + 4 * (i % 7), 54 + 4 * (i % 7)), "c4": np.array([30 + i % 9])}
    return src, dst


def _holds(dst: KVMemory, src: KVMemory, dst_pages: dict[str, np.ndarray], src_pages: dict[str, np.ndarray]) -> bool:
    """Whether every buffer's ``dst_pages`` hold exactly ``src``'s ``src_pages``."""
    return all(np.array_equal(dst.array(b.name)[dst_pages[pool.name]], src.array(b.name)[src_pages[pool.name]])
               for pool in dst.layout.pools for b in pool.buffers)


def _until(pred: Any, timeout: float) -> float:
    t0 = time.monotonic()
    while not pred():
        assert time.monotonic() - t0 < timeout, "condition not reached in time"
        time.sleep(0.005)
    return time.monotonic() - t0


class StallingTransport(LocalTransport):
    """The first write sleeps ``stall`` seconds before copying: prefill's progress thread stalls exactly
    between its last check (session alive, generation current) and its post."""

    def __init__(self, stall: float) -> None:
        super().__init__()
        self.stall = stall
        self.stalled = threading.Event()
        self.resumed = threading.Event()

    def write(self, plan: TransferPlan, peer: str, notif: bytes, label: str = "") -> LocalHandle:
        if not self.stalled.is_set():
            self.stalled.set()
            time.sleep(self.stall)
            self.resumed.set()
        return super().write(plan, peer, notif, label)


class NoGuarantee(LocalTransport):
    """Decode's transport promising nothing about a writer (NIXL across hosts): only an acknowledgement
    can end a quarantine."""

    def peer_may_write(self, peer: str) -> bool:
        return True


def _serve_until(decode: DecodeEndpoint, p2: PrefillEndpoint, resumed: threading.Event) -> tuple[int, int]:
    """Until prefill 1 resumed: try to lease X to the second prefill (refused: quarantined) and serve
    requests on four reused blocks of other pages, each DONE. Returns (refusals, requests done)."""
    refused = done = 0
    while not resumed.is_set() or done < 4:
        try:
            decode.announce(f"x{refused}", PAGES_A, peer=p2.address)
        except LeaseError as exc:
            assert "leased to live request 'a'" in str(exc)
            refused += 1
        else:  # possible only once prefill 1 resumed and acknowledged: give X back
            assert resumed.is_set() and decode.num_quarantined_pages == 0
            decode.abort(f"x{refused}")
        src, dst = _block(done)
        decode.announce(f"b{done}", dst, peer=p2.address)
        p2.send(f"b{done}", src)
        decode.wait(f"b{done}", 5)
        done += 1
    return refused, done


# -- defect 1, in one process ------------------------------------------------------------------------------
@pytest.mark.parametrize("cfg", [SCALED, DESCRIBED])
def test_stall_between_check_and_post_writes_only_into_quarantine(cfg: tuple[float, float, float]) -> None:
    peer_timeout, lease_grace, stall = cfg
    opts = _options(cfg)
    src1, src2, dst = _memory("prefill", SEED_1), _memory("prefill", SEED_2), _memory("decode", 999)
    stalling, plain = StallingTransport(stall), NoGuarantee()
    with PrefillEndpoint(src1, stalling, options=opts) as p1, PrefillEndpoint(src2, "local", options=opts) as p2, \
            DecodeEndpoint(dst, plain, options=opts, digest_mode="full") as decode:
        decode.connect(p1.address)
        decode.connect(p2.address)
        p1.send("a", SRC_A)
        decode.announce("a", PAGES_A, peer=p1.address)    # prefill 1 posts at once... and stalls
        assert stalling.stalled.wait(5)
        t0 = time.monotonic()
        with pytest.raises(RequestFailed) as info:
            decode.wait("a", peer_timeout + 2)
        assert isinstance(info.value.__cause__, PeerLost)
        assert decode.num_quarantined_pages == NUM_X
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            served = pool.submit(_serve_until, decode, p2, stalling.resumed)
            assert stalling.resumed.wait(stall + 5)
            refused, done = served.result(10)
        # Refused all through the stall (an X lease succeeds only after the resume: see _serve_until),
        # which outlasts the old release time: the old code freed X peer_timeout + lease_grace in.
        assert refused >= 4 and time.monotonic() - t0 >= stall - peer_timeout
        assert stall > peer_timeout + lease_grace
        # The late write lands (the defect's write, still posted) but in quarantined pages only.
        _until(lambda: _holds(dst, src1, PAGES_A, SRC_A), 5)
        for i in range(done - 4, done):                      # the last occupant of each reused block
            assert _holds(dst, src2, _block(i)[1], _block(i)[0]), f"b{i} was overwritten"
        # Decode reconnects by itself; prefill 1 learns what failed and acknowledges it: only then is X
        # free (this decode's transport guarantees nothing, and prefill 1's process is alive).
        _until(lambda: decode.num_quarantined_pages == 0, peer_timeout + 5)
        assert decode.peak_quarantined_pages == NUM_X
        _until(lambda: decode.num_leased_pages == 0, 5)
        src, _ = _block(0)
        decode.announce("reuse", PAGES_A, peer=p2.address)   # X, now free, to the second prefill
        p2.send("reuse", src)
        decode.wait("reuse", 5)
        time.sleep(0.1)                                      # anything still to land from prefill 1 would now
        assert _holds(dst, src2, PAGES_A, src)
        _until(lambda: decode.counters()["live_leases"] == 0, 5)
    stalling.close()
    plain.close()


@pytest.mark.parametrize("cfg", [SCALED, DESCRIBED])
def test_stall_before_the_check_writes_nothing(cfg: tuple[float, float, float],
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """Stalled as the announce arrives: when it resumes prefill sees its own silence and posts nothing;
    decode ends the quarantine only after the stall (prefill acknowledged, or dropped its route to decode:
    the local transport's guarantee that it cannot write, and ``lease_grace`` after that)."""
    peer_timeout, lease_grace, stall = cfg
    opts = _options(cfg)
    src1, dst = _memory("prefill", SEED_1), _memory("decode", 999)
    before = {b.name: dst.array(b.name).copy() for b in dst.layout.buffers}
    with PrefillEndpoint(src1, "local", options=opts) as p1, \
            DecodeEndpoint(dst, "local", options=opts) as decode:
        decode.connect(p1.address)
        resumed: list[float] = []
        on_announce = p1.core.announces.on_announce

        def stalled(session: Any, msg: Any) -> None:
            time.sleep(stall)
            resumed.append(time.monotonic())
            on_announce(session, msg)

        monkeypatch.setattr(p1.core.announces, "on_announce", stalled)
        p1.send("a", SRC_A)
        decode.announce("a", PAGES_A)
        with pytest.raises(RequestFailed):
            decode.wait("a", peer_timeout + 2)
        assert decode.num_quarantined_pages == NUM_X and decode.holds_lease("a")
        while True:                                        # held through the stall, past peer_timeout + lease_grace
            held = decode.holds_lease("a")
            if resumed:
                break
            assert held
            time.sleep(0.01)
        _until(lambda: decode.num_quarantined_pages == 0, peer_timeout + lease_grace + 5)
        assert all(np.array_equal(dst.array(k), v) for k, v in before.items()), "a late write landed"
        # Prefill probed the session on resuming; decode had given up (its link closed), so no echo came, and
        # the session ended by the probe's deadline or, first, by decode's reconnect replacing it.
        with pytest.raises(RequestFailed, match="declared it dead|replaced by a new session"):
            p1.wait("a", 5)


# -- defect 2: oversize frames, a stalled or dead loop ---------------------------------------------------------
@pytest.fixture
def ctx() -> Iterator[zmq.Context]:
    c = zmq.Context()
    yield c
    c.destroy(linger=0)


LIMIT = 1 << 20
SMALL = EndpointOptions(heartbeat_interval=0.1, peer_timeout=10.0, lease_grace=0.2, max_message_bytes=LIMIT)


def test_oversize_answer_to_hello_fails_connect_in_time(ctx: zmq.Context) -> None:
    raw = FakePrefill(ctx)
    with DecodeEndpoint(_memory("decode", 999), "local", options=SMALL) as decode, \
            concurrent.futures.ThreadPoolExecutor(1) as pool:
        t0 = time.monotonic()
        fut = pool.submit(decode.connect, raw.address, 1.5)
        assert isinstance(raw.recv(), wire.Hello)
        raw.send_raw(b"\x00" * (LIMIT + 1))
        with pytest.raises(HandshakeError, match=f"max_message_bytes={LIMIT}"):
            fut.result(5)
        assert time.monotonic() - t0 < 1.5 + 0.3
        assert decode.peers == []
        with pytest.raises(HandshakeError, match="no handshake answer"):   # the endpoint goes on
            decode.connect("tcp://127.0.0.1:9", timeout=0.3)
    raw.transport.close()


def test_oversize_frame_mid_session_fails_the_link_at_once(ctx: zmq.Context) -> None:
    raw = FakePrefill(ctx)
    with DecodeEndpoint(_memory("decode", 999), "local", options=SMALL, digest_mode="off") as decode, \
            concurrent.futures.ThreadPoolExecutor(1) as pool:
        fut = pool.submit(decode.connect, raw.address, 3.0)
        raw.welcome()
        fut.result(5)
        decode.announce("r", {"main": [1, 2]})
        assert isinstance(raw.recv(), wire.Announce)
        t0 = time.monotonic()
        raw.send_raw(b"\x00" * (LIMIT + 1))
        with pytest.raises(RequestFailed, match=f"max_message_bytes={LIMIT}") as info:
            decode.wait("r", 3)
        assert isinstance(info.value.__cause__, PeerLost)
        assert time.monotonic() - t0 < 1.0                  # the drop itself, not peer_timeout (10 s)
        assert decode.peers == []
        # This fake never added decode as a transport peer: it cannot write, so the quarantine ends.
        _until(lambda: decode.num_leased_pages == 0, 2)
    raw.transport.close()


def test_waits_keep_their_deadlines_while_the_loop_holds_the_lock(monkeypatch: pytest.MonkeyPatch) -> None:
    src, dst = _memory("prefill", SEED_1), _memory("decode", 999)
    opts = EndpointOptions(heartbeat_interval=0.1, peer_timeout=5.0)
    with PrefillEndpoint(src, "local", options=opts) as prefill, \
            DecodeEndpoint(dst, "local", options=opts) as decode:
        decode.connect(prefill.address)
        decode.announce("r", PAGES_A)
        stuck = threading.Event()
        tick = decode.core.tick

        def stalled_tick(now: float) -> None:      # runs under the endpoint's lock
            if not stuck.is_set():
                stuck.set()
                time.sleep(2.0)
            tick(now)

        monkeypatch.setattr(decode.core, "tick", stalled_tick)
        assert stuck.wait(2)
        t0 = time.monotonic()
        with pytest.raises(TransferTimeout):
            decode.wait("r", 0.3)
        assert time.monotonic() - t0 < 0.3 + 0.2
        t0 = time.monotonic()
        with pytest.raises(HandshakeError):
            decode.connect("tcp://127.0.0.1:9", timeout=0.3)
        assert time.monotonic() - t0 < 0.3 + 0.2
        decode.abort("r")


def test_a_dead_loop_fails_every_waiter_and_link_at_once(ctx: zmq.Context, monkeypatch: pytest.MonkeyPatch) -> None:
    src, dst = _memory("prefill", SEED_1), _memory("decode", 999)
    raw = FakePrefill(ctx)                                    # never answers: its handshake stays open
    with PrefillEndpoint(src, "local", options=SMALL) as prefill, \
            DecodeEndpoint(dst, "local", options=SMALL) as decode, \
            concurrent.futures.ThreadPoolExecutor(2) as pool:
        decode.connect(prefill.address)
        decode.announce("r", PAGES_A)
        connecting = pool.submit(decode.connect, raw.address, 10.0)
        waiting = pool.submit(decode.wait, "r", 10.0)
        assert isinstance(raw.recv(), wire.Hello)
        boom = RuntimeError("injected: the loop's own bug")

        def broken_pump() -> bool:
            raise boom

        t0 = time.monotonic()
        monkeypatch.setattr(decode, "_pump", broken_pump)
        with pytest.raises(EndpointClosed, match="progress loop stopped") as closed:
            connecting.result(5)
        assert closed.value.__cause__ is boom
        with pytest.raises(RequestFailed) as failed:
            waiting.result(5)
        assert isinstance(failed.value.__cause__, EndpointClosed) and failed.value.__cause__.__cause__ is boom
        assert time.monotonic() - t0 < 1.0
        with pytest.raises(EndpointClosed):
            decode.announce("s", {"main": [40]})
    raw.transport.close()


# -- defect 1, between processes over NIXL: the prefill process stopped (SIGSTOP) between check and post ------
def _stopped(pid: int) -> bool:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] == "T"


@pytest.mark.nixl
# The Mooncake case failed 2 of 5 full runs on 2026-12-02 before protocol 8 (the recovered link was not among
# decode's peers; likely prefill, back from its stop, ending its sessions blind, which protocol 8 replaced
# with a probe); since, it passed 12 of 12 on 2026-12-03 (5 alone, 4 beside two busy loops, 3 within the
# fencing, transport and control files); a clean-clone run later that day failed once at the link check
# below (since made an eventual check: see there).
@pytest.mark.parametrize("kind", ["nixl", "mooncake"])
def test_sigstopped_prefill_process_writes_only_into_quarantine(kind: str) -> None:
    pytest.importorskip("nixl")
    if kind == "mooncake":
        pytest.importorskip("mooncake")
    from .test_control_nixl import Peer

    figures = {"heartbeat_interval": 0.5, "peer_timeout": 2.5, "lease_grace": 1.0, "request_timeout": 30.0}
    opts = EndpointOptions(**figures)
    p1 = Peer("prefill", options=figures, seed=SEED_1, stop_before_write=True, transport=kind)
    p2 = Peer("prefill", options=figures, seed=SEED_2, transport=kind)
    src1, src2, dst = _memory("prefill", SEED_1), _memory("prefill", SEED_2), _memory("decode", 999)
    try:
        with DecodeEndpoint(dst, kind, options=opts, digest_mode="full") as decode:
            decode.connect(p1.address)
            decode.connect(p2.address)
            p1("send", rid="a", pages={k: v.tolist() for k, v in SRC_A.items()})
            decode.announce("a", PAGES_A, peer=p1.address)
            _until(lambda: _stopped(p1.proc.pid), 5)         # stopped itself right before posting
            t_stop = time.monotonic()
            with pytest.raises(RequestFailed) as info:
                decode.wait("a", 6)
            assert isinstance(info.value.__cause__, PeerLost)
            assert decode.num_quarantined_pages == NUM_X
            done = 0
            while time.monotonic() - t_stop < 6.0 or done < 4:   # the 6 s stall, serving meanwhile
                with pytest.raises(LeaseError, match="leased to live request 'a'"):
                    decode.announce(f"x{done}", PAGES_A, peer=p2.address)
                src, dst_pages = _block(done)
                decode.announce(f"b{done}", dst_pages, peer=p2.address)
                p2("send", rid=f"b{done}", pages={k: v.tolist() for k, v in src.items()})
                decode.wait(f"b{done}", 5)
                done += 1
            assert decode.num_quarantined_pages == NUM_X     # the writer lives: only its word ends this
            p1.proc.send_signal(signal.SIGCONT)              # it posts its write now, to pages decode gave up
            t_cont = time.monotonic()
            # The defect's write happens (cma needs nothing from decode, and stale metadata still
            # writes), and lands in the quarantined pages only.
            _until(lambda: _holds(dst, src1, PAGES_A, SRC_A), 5)
            late = True
            for i in range(done - 4, done):
                assert _holds(dst, src2, _block(i)[1], _block(i)[0]), f"b{i} was overwritten"
            # Decode reconnects by itself; prefill 1 settles what decode failed: X is free only then.
            _until(lambda: decode.num_quarantined_pages == 0, 10)
            released_after = time.monotonic() - t_cont       # an upper bound: checked after the bytes
            # Settled over a reconnected link (a live writer is never "certainly gone"), and that link stays:
            # prefill once ended it right after the settle, "silent" for the whole stall, having read its
            # Hello stamped from before the stall (EndpointBase._restamp; seen on loaded hosts over Mooncake,
            # where nothing was left in quarantine to make decode reconnect again).
            link = decode.core.links.get(p1.address)
            time.sleep(1.0)
            assert link is not None and link is decode.core.links.get(p1.address) and \
                link.state is LinkState.ESTABLISHED, f"the link that settled did not stay: {link and link.error}"
            assert p1.address in decode.peers
            _until(lambda: decode.num_leased_pages == 0, 5)
            src, _ = _block(0)
            decode.announce("reuse", PAGES_A, peer=p2.address)
            p2("send", rid="reuse", pages={k: v.tolist() for k, v in src.items()})
            decode.wait("reuse", 5)
            time.sleep(0.2)
            assert _holds(dst, src2, PAGES_A, src)
            print(f"late write landed in quarantine: {late}; peak quarantined pages "
                  f"{decode.peak_quarantined_pages}; {done} requests served meanwhile; released "
                  f"{released_after:.2f} s after SIGCONT")
    finally:
        with contextlib.suppress(ProcessLookupError):
            p1.proc.send_signal(signal.SIGCONT)
        p1.close()
        p2.close()


# -- settling after a reconnect: in-flight writes first ---------------------------------------------------------
def test_reconnected_prefill_settles_only_after_its_writes_finish(monkeypatch: pytest.MonkeyPatch) -> None:
    """Prefill's write is still in flight when decode declares it dead; after the automatic reconnect the
    prefill is alive and talking, yet the pages stay quarantined until that write finished and landed."""
    from .test_control_local import GatedTransport

    opts = EndpointOptions(heartbeat_interval=0.1, peer_timeout=0.6, lease_grace=0.2, request_timeout=30.0,
                           transport_liveness=False)   # a thread stall standing for a stopped process
    src1, dst = _memory("prefill", SEED_1), _memory("decode", 999)
    gated, plain = GatedTransport(), NoGuarantee()
    with PrefillEndpoint(src1, gated, options=opts) as p1, DecodeEndpoint(dst, plain, options=opts) as decode:
        decode.connect(p1.address)
        decode.announce("a", PAGES_A)
        p1.send("a", SRC_A)
        _until(lambda: p1.num_live_handles == 1, 5)
        tick, stalled = p1.core.tick, threading.Event()

        def stalled_tick(now: float) -> None:          # one stall of the progress loop: no heartbeats
            if not stalled.is_set():
                stalled.set()
                time.sleep(1.0)
            tick(now)

        monkeypatch.setattr(p1.core, "tick", stalled_tick)
        with pytest.raises(RequestFailed) as info:
            decode.wait("a", 5)
        assert isinstance(info.value.__cause__, PeerLost)
        _until(lambda: p1.address in decode.peers, 5)   # decode reconnected by itself
        time.sleep(0.5)
        assert decode.num_quarantined_pages == NUM_X and p1.num_live_handles == 1
        gated.gate.set()                                # the write lands, then prefill settles it
        _until(lambda: decode.num_quarantined_pages == 0, 5)
        assert _holds(dst, src1, PAGES_A, SRC_A)        # it landed in the quarantined pages
        assert p1.num_live_handles == 0
    gated.close()
    plain.close()


def test_a_frame_from_a_dropped_session_gets_bye(ctx: zmq.Context) -> None:
    """Prefill dropped a silent decode; a later frame from it does not revive the session: Bye."""
    # Silence decides: a raw socket's libzmq would keep the connection up (starvation, ridden out by default).
    opts = EndpointOptions(heartbeat_interval=0.1, peer_timeout=0.3, transport_liveness=False)
    mem, transport = _memory("decode", 999), LocalTransport()
    meta = transport.register(mem)
    with PrefillEndpoint(_memory("prefill", SEED_1), "local", options=opts) as prefill:
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVTIMEO, 3000)
        sock.connect(prefill.address)
        sock.send(wire.encode(wire.Hello("s" * 16, mem.manifest(), "local", meta, b"n" * 32, "off", 0.1)))
        assert isinstance(wire.decode(sock.recv()), wire.Welcome)
        _until(lambda: prefill.peers == [], 3)          # silent: declared dead
        sock.send(wire.encode(wire.Heartbeat()))
        replies = []
        while not any(isinstance(m, wire.Bye) and "handshake again" in m.reason for m in replies):
            replies.append(wire.decode(sock.recv()))
        assert prefill.peers == []
    transport.close()


# -- the pieces ---------------------------------------------------------------------------------------------
def test_process_identity_tells_gone_from_stalled() -> None:
    import subprocess

    from kvferry.control.liveness import ProcessIdentity, is_gone, this_process

    me = this_process()
    assert is_gone(me) is False
    child = subprocess.Popen(["sleep", "30"])
    try:
        with open(f"/proc/{child.pid}/stat") as f:
            started = int(f.read().rsplit(")", 1)[1].split()[19])
        ident = ProcessIdentity(me.host, child.pid, started)
        child.send_signal(signal.SIGSTOP)
        assert is_gone(ident) is False                  # stopped is alive: it may still write
        assert is_gone(ProcessIdentity(me.host, child.pid, started + 1)) is True   # a reused PID
        assert is_gone(ProcessIdentity("elsewhere", child.pid, started)) is None   # another host: unknown
        child.kill()
        _until(lambda: is_gone(ident) is True, 5)       # a zombie, then nothing
    finally:
        child.kill()
        child.wait(5)
    assert is_gone(ident) is True


def test_local_transport_says_when_a_peer_cannot_write() -> None:
    a, b = LocalTransport(), LocalTransport()
    meta_a = a.register(_memory("decode", 1))
    b.register(_memory("prefill", 2))
    assert not a.peer_may_write(b.agent_name)           # b holds no route to a
    b.add_peer(meta_a)
    assert a.peer_may_write(b.agent_name)
    b.remove_peer(a.agent_name)
    assert not a.peer_may_write(b.agent_name)
    b.add_peer(meta_a)
    b.close()
    assert not a.peer_may_write(b.agent_name)           # closed: write refuses
    a.close()
