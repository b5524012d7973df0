"""Decode's protocol core on a fake clock: every timer exact, no thread, socket, sleep or wall clock.

``DecodeCore`` is driven here the way its shell drives it (``control.decode``): the user's commands,
frames from a link, transport notifications, reads posted and settled by hand, effects answered by hand,
ticks at chosen times. The prefill peer is played by this test with wire messages. What each test asserts
is a decision: a message queued, an effect, a request's state, a lease held or freed.
"""

from __future__ import annotations

import itertools
import math
from typing import Any

import numpy as np
import pytest

from kvferry import KVMemory
from kvferry.control import EndpointOptions, RequestState, wire
from kvferry.control.core.base import AddPeer, FlushNow, RemovePeer
from kvferry.control.core.decode import (
    CheckWriter,
    CloseLink,
    DecodeCore,
    DecodeSetup,
    OpenLink,
    TakeNotifications,
)
from kvferry.control.core.links import Link
from kvferry.control.core.process import ProcessIdentity
from kvferry.control.core.pull_reads import ReadJob
from kvferry.control.core.states import LinkState
from kvferry.control.pull import fence_s
from kvferry.control.stats import NullRecorder
from kvferry.errors import HandshakeError, PeerLost, RequestAborted, TransferTimeout
from kvferry.integrity import DigestMode

from .control_peer import make_layout
from .core_shell import between_events

# The silence rule, exact (with transport_liveness, the default, silence alone never ends a link whose
# connection stands: test_control_liveness).
OPTS = EndpointOptions(heartbeat_interval=0.1, peer_timeout=0.6, lease_grace=0.4, request_timeout=20.0,
                       handshake_timeout=2.0, transport_liveness=False)
PREFILL = ProcessIdentity("host-a", 1, 1)
ADDRESS = "tcp://prefill"
PAGES = {"main": np.array([3, 4]), "c4": np.array([1])}
SRC = {"main": np.array([10, 11]), "c4": np.array([5])}


def _after(t: float) -> float:
    return math.nextafter(t, math.inf)


def _before(t: float) -> float:
    return math.nextafter(t, -math.inf)


class Side:
    """One decode core and the prefill it talks to, on a clock this test moves."""

    def __init__(self, options: EndpointOptions = OPTS) -> None:
        self.t = 0.0
        self.options = options
        self.src = KVMemory.allocate(make_layout("prefill"))
        self.dst = KVMemory.allocate(make_layout("decode"))
        setup = DecodeSetup("local", b"decode-meta", ProcessIdentity("host-a", 2, 2), None)
        self.core = DecodeCore(self.dst, setup, options, DigestMode.OFF, NullRecorder("decode", self.dst.layout),
                               lambda n: bytes(n))
        self.agents = itertools.count(1)
        self.tickets = itertools.count(1)
        self.in_flight: dict[int, ReadJob] = {}
        self.opened: list[Link] = []
        self.closed: list[Link] = []
        self.removed: list[str] = []
        self.asked: list[Link] = []
        self.gone: set[str] = set()            # agents whose writer the shell finds gone (CheckWriter)
        self.waiting: list[tuple[str, bytes]] = []   # notifications the transport holds (TakeNotifications)
        self.inbox: dict[str, list[Any]] = {}  # what each prefill received (by address)

    # -- the prefill side ---------------------------------------------------------------------------------
    def connect(self, mode: str = "push") -> Link:
        link = self.core.start_link(self.t, ADDRESS, self.options.handshake_timeout, None, mode)
        self.carry_out()
        assert self.opened[-1] is link and any(isinstance(m, wire.Hello) for m in self.received())
        self.welcome(link, mode)
        assert link.established
        return link

    def welcome(self, link: Link, mode: str = "push") -> None:
        self.frame(link, wire.Welcome("p", self.src.manifest(), b"prefill-meta", b"", self.options.heartbeat_interval,
                                      "off", PREFILL.host, PREFILL.pid, PREFILL.started, mode,
                                      self.options.peer_timeout))

    def frame(self, link: Link, msg: Any) -> None:
        self.core.on_frame(self.t, link, wire.encode(msg))
        self.carry_out()

    def notify(self, link: Link, chunk: int = 0, last: bool = True, rid: str = "r", gen: int = 1) -> None:
        data = wire.encode(wire.Chunk(rid, gen, chunk, last, chunk + 1 if last else 0, b""))
        self.core.on_notification(self.t, link.agent, data)
        self.carry_out()

    def received(self) -> list[Any]:
        """What prefill got since the last call (messages, Batches unpacked; heartbeats left out)."""
        out = self.inbox.pop(ADDRESS, [])
        return [m for m in out if not isinstance(m, wire.Heartbeat)]

    # -- the user ------------------------------------------------------------------------------------------
    def announce(self, rid: str = "r") -> None:
        self.core.announce(self.t, rid, PAGES, None, {}, ())
        self.carry_out()

    # -- the shell's part ----------------------------------------------------------------------------------
    def carry_out(self, *, post: bool = True) -> list[ReadJob]:
        posted = between_events(self.core, self.t, self.apply, self.core.start_read, self.posted,
                                lambda job: job.parts, post=post)
        self.flush()
        return posted

    def posted(self, job: ReadJob) -> None:
        ticket = next(self.tickets)
        self.core.read_posted(job, ticket)
        self.in_flight[ticket] = job

    def apply(self, effect: Any) -> None:
        core = self.core
        if isinstance(effect, OpenLink):
            self.opened.append(effect.link)
            self.deliver(effect.link, effect.hello)
        elif isinstance(effect, CloseLink):
            core.take_out(effect.link)
            self.closed.append(effect.link)
        elif isinstance(effect, AddPeer):
            core.peer_added(self.t, effect.peer, f"agent-{next(self.agents)}", None)
        elif isinstance(effect, RemovePeer):
            self.removed.append(effect.agent)
        elif isinstance(effect, CheckWriter):
            self.asked.append(effect.link)
            core.writer_checked(self.t, effect.link, effect.link.agent in self.gone)
        elif isinstance(effect, TakeNotifications):
            waiting, self.waiting = self.waiting, []
            for agent, data in waiting:
                core.on_notification(self.t, agent, data)
            core.notifications_taken(self.t)
        elif isinstance(effect, FlushNow):
            self.flush(effect.peer)
            if effect.raw:
                self.deliver(effect.peer, effect.raw)
        else:
            raise AssertionError(effect)

    def deliver(self, link: Link, data: bytes) -> None:
        if link in self.closed:
            return
        msg = wire.decode(data)
        self.inbox.setdefault(link.address, []).extend(wire.unbatch(msg) if isinstance(msg, wire.Batch) else [msg])
        self.core.frame_sent(self.t, link)

    def flush(self, only: Link | None = None) -> None:
        for link in [only] if only is not None else list(self.core.outbox):
            for data in self.core.take_out(link):
                self.deliver(link, data)

    def tick(self, t: float) -> None:
        """The loop's iteration at ``t``: silence checked before any frame, then the timers."""
        self.t = t
        self.core.check_silence(t)
        self.carry_out()
        self.core.tick(t)
        self.carry_out()

    def run_until(self, t: float, *, heard: Link | None = None) -> None:
        """Tick at every deadline the core names up to ``t``; ``heard``: prefill sends a heartbeat on that
        link at each one (a live peer)."""
        while True:
            nxt = min(self.core.next_deadline(), t)
            self.tick(max(nxt, self.t))
            if heard is not None and heard.established:
                self.frame(heard, wire.Heartbeat())
            if self.t >= t:
                return

    def rec(self, rid: str = "r") -> Any:
        return self.core.records[rid]


def test_a_request_is_done_when_its_chunks_landed_and_the_lease_ends() -> None:
    side = Side()
    link = side.connect()
    side.announce()
    assert [type(m) for m in side.received()] == [wire.Announce]
    side.notify(link)
    assert side.rec().state is RequestState.DONE and side.core.leases.num_leases == 0
    assert [(m.ok, m.generation) for m in side.received() if isinstance(m, wire.Result)] == [(True, 1)]


def test_a_silent_prefill_is_lost_exactly_after_peer_timeout() -> None:
    """Heartbeats leave every heartbeat_interval; nothing heard for exactly peer_timeout is not yet loss, the
    next representable instant is. ``next_deadline`` names that instant. The request fails and its pages
    are quarantined: the writer may still write them."""
    side = Side()
    link = side.connect()
    side.announce()
    heard_at = link.clock.last_seen
    lost_at = _after(heard_at + OPTS.peer_timeout)
    side.run_until(heard_at + OPTS.peer_timeout)
    assert link.established and side.rec().is_live
    assert side.core.next_deadline() == lost_at
    side.tick(lost_at)
    assert link.state is LinkState.DEAD and link in side.closed and side.removed == [link.agent]
    assert side.rec().state is RequestState.FAILED and isinstance(side.rec().error, PeerLost)
    assert side.core.quarantine.num_pages == 3 and side.core.leases.num_leases == 1


def test_a_probe_is_echoed_on_a_link_still_held_and_not_on_one_declared_dead() -> None:
    """Prefill, back from a stall, asks whether decode still holds the session: decode echoes the number on
    a link it holds. A link it declared dead is closed; what arrives on it is never answered."""
    side = Side()
    link = side.connect()
    side.inbox.pop(ADDRESS, None)
    side.frame(link, wire.Heartbeat(probe=7))
    assert [m.echo for m in side.inbox.pop(ADDRESS, []) if isinstance(m, wire.Heartbeat)] == [7]
    side.tick(_after(link.clock.last_seen + OPTS.peer_timeout))   # prefill silent: the link dies
    assert link.state is LinkState.DEAD and link in side.closed
    side.inbox.pop(ADDRESS, None)
    side.frame(link, wire.Heartbeat(probe=8))
    assert not [m for m in side.inbox.get(ADDRESS, []) if isinstance(m, wire.Heartbeat) and m.echo]


@pytest.mark.parametrize("silence", [0.61, 5.0, 3600.0])
def test_a_starved_prefill_whose_connection_stands_is_ridden_out(silence: float) -> None:
    """With transport_liveness (the default) prefill's silence alone, however long, never ends the link
    while its connection stands: the lease waits, and the chunk that lands after the silence completes the
    request. The connection dropping (its libzmq stopped answering) ends the link at once, pages quarantined."""
    side = Side(EndpointOptions(heartbeat_interval=0.1, peer_timeout=0.6, request_timeout=7200.0,
                                handshake_timeout=2.0))
    link = side.connect()
    side.announce()
    side.run_until(side.t + silence)                  # prefill's Python starved: not a frame from it
    assert link.established and side.rec().is_live
    side.notify(link)
    assert side.rec().state is RequestState.DONE and side.core.leases.num_leases == 0

    side.announce("s")
    side.run_until(side.t + 1.0)
    side.core.dropped(side.t, link, "ZMTP heartbeats unanswered")
    side.carry_out()
    assert link.state is LinkState.DEAD and side.rec("s").state is RequestState.FAILED
    assert side.core.quarantine.num_pages == 3


def test_the_handshake_deadline_is_exact() -> None:
    side = Side()
    link = side.core.start_link(0.0, ADDRESS, 1.5, None, "push")
    side.carry_out()
    assert side.core.next_deadline() == _after(1.5)
    side.tick(1.5)
    assert link.connecting
    side.tick(_after(1.5))
    assert link.state is LinkState.FAILED and isinstance(link.error, HandshakeError)
    assert link in side.closed and any(isinstance(m, wire.Bye) for m in side.received())


def test_the_request_deadline_is_exact_to_the_deadline_check() -> None:
    opts = EndpointOptions(heartbeat_interval=0.1, peer_timeout=0.6, request_timeout=3.0)
    side = Side(opts)
    link = side.connect()
    side.announce()
    side.run_until(3.0, heard=link)
    assert side.rec().state is RequestState.BOOTSTRAPPING
    side.run_until(3.02, heard=link)
    assert side.rec().state is RequestState.FAILED and isinstance(side.rec().error, TransferTimeout)
    assert [m.generation for m in side.received() if isinstance(m, wire.Abort)] == [1]
    assert side.core.quarantine.num_pages == 3       # prefill may still write: only its word frees them


def test_a_settled_fail_ends_the_lease_after_the_notifications_waiting() -> None:
    """Prefill's settled Fail frees the pages, but only once the notifications it sent before were taken:
    a chunk that landed before it is no stray write."""
    side = Side()
    link = side.connect()
    side.announce()
    side.core.abort(side.t, "r", "engine gave up")
    side.carry_out()
    assert isinstance(side.rec().error, RequestAborted) and side.core.quarantine.num_pages == 3
    assert [m.generation for m in side.received() if isinstance(m, wire.Abort)] == [1]
    side.waiting.append((link.agent, wire.encode(wire.Chunk("r", 1, 0, False, 0, b""))))
    side.frame(link, wire.Fail("r", 1, "aborted", "aborted", False))
    assert side.core.leases.num_leases == 1           # unsettled: a write may still land
    side.frame(link, wire.Fail("r", 1, "aborted", "aborted", True))
    assert not side.waiting and side.core.num_stray_notifications == 0
    assert side.core.leases.num_leases == 0 and side.core.quarantine.num_pages == 0


@pytest.mark.parametrize("gone_after", [None, 5.0])
def test_a_quarantine_never_ends_on_a_timer_while_the_writer_may_live(gone_after: float | None) -> None:
    """A dead link's quarantined pages stay however long the writer may live (the shell says it may, at
    every check); once the shell finds it gone, they leave exactly lease_grace later."""
    side = Side()
    link = side.connect()
    side.announce()
    side.run_until(1.0)
    assert link.state is LinkState.DEAD and side.core.quarantine.num_pages == 3
    side.run_until(gone_after if gone_after is not None else 60.0)
    assert side.asked and set(side.asked) == {link} and side.core.leases.num_leases == 1
    if gone_after is None:
        return
    side.gone.add(link.agent)
    asked = len(side.asked)
    side.run_until(side.core.next_deadline())          # the next check asks, and hears it is gone
    assert len(side.asked) == asked + 1
    gone_at = side.t
    [part] = side.rec().parts.values()
    assert part.grace.release_at == gone_at + OPTS.lease_grace and side.core.leases.num_leases == 1
    side.run_until(_before(gone_at + OPTS.lease_grace))
    assert side.core.leases.num_leases == 1
    side.run_until(gone_at + OPTS.lease_grace + 0.05)   # the first quarantine check once the grace passed
    assert side.core.leases.num_leases == 0 and side.core.quarantine.num_pages == 0


def test_a_recovery_link_reasks_the_old_generation_and_its_settled_fail_frees_the_pages() -> None:
    """The writer may live: decode reconnects (a recovery link, every peer_timeout), asks the same prefill
    (same transport agent) to settle the quarantined generation (Abort), and its settled Fail frees it."""
    side = Side()
    agents = iter(["agent-p", "agent-p"])
    side.agents = agents   # type: ignore[assignment]   # the same prefill answers the recovery link
    link = side.connect()
    side.announce()
    side.received()
    side.run_until(1.0)
    assert link.state is LinkState.DEAD
    opened = [x for x in side.opened if x is not link]
    assert len(opened) == 1 and opened[0].connecting and opened[0].address == ADDRESS
    again = opened[0]
    assert any(isinstance(m, wire.Hello) for m in side.received())
    side.welcome(again)
    assert again.established and side.core.links[ADDRESS] is again
    aborts = [m for m in side.received() if isinstance(m, wire.Abort)]
    assert [(m.request_id, m.generation) for m in aborts] == [("r", 1)]
    assert side.core.leases.num_leases == 1
    side.frame(again, wire.Fail("r", 1, "unknown request or settled", "error", True))
    assert side.core.leases.num_leases == 0 and side.core.quarantine.num_pages == 0


def _pulling(side: Side) -> Link:
    link = side.connect("pull")
    side.announce()
    side.received()
    assert link.fence_s == fence_s(OPTS.peer_timeout, OPTS.peer_timeout, OPTS.heartbeat_interval)
    return link


def _ready(link: Link, side: Side) -> None:
    side.frame(link, wire.Ready("r", 1, 0, True, 1, wire.encode_pages(SRC), {}, [], b""))


@pytest.mark.parametrize("stall", [0.0, 0.3, 0.5, 0.51, 3.0])
def test_pull_a_stall_of_our_own_messages_beyond_the_fence_refuses_the_read(stall: float) -> None:
    """Pull mode: a read posted, then this process stalls ``stall`` seconds (no frame of ours leaves) before
    the read's completion is seen. Accepted only while our last frame left within the fence."""
    side = Side()
    link = _pulling(side)
    _ready(link, side)
    [ticket] = side.in_flight
    last_sent = link.clock.last_sent
    side.t += stall
    side.core.read_settled(side.t, ticket, None)
    side.carry_out()
    if side.t - last_sent <= link.fence_s:
        assert side.rec().state is RequestState.DONE
        assert [m.ok for m in side.received() if isinstance(m, wire.Result)] == [True]
        return
    rec = side.rec()
    assert rec.state is RequestState.FAILED and "this process stalled" in str(rec.error)
    assert side.core.leases.num_leases == 0          # only decode wrote these pages: no quarantine


def test_pull_a_tripped_fence_kills_the_link_before_queued_frames_are_read() -> None:
    side = Side()
    link = _pulling(side)
    side.t = link.clock.last_sent + link.fence_s + 0.01
    side.core.check_silence(side.t)
    side.carry_out()
    assert link.state is LinkState.DEAD and side.rec().state is RequestState.FAILED
    _ready(link, side)                               # queued while we stalled: reads nothing
    assert not side.in_flight


def test_a_notification_for_no_lease_is_counted_as_stray() -> None:
    side = Side()
    link = side.connect()
    side.announce()
    side.notify(link, rid="r", gen=7)                # no lease of generation 7
    side.notify(link, rid="other", gen=1)            # generation 1 is another request's
    assert side.core.num_stray_notifications == 2 and side.rec().is_live
    side.core.on_notification(side.t, "agent-unknown", wire.encode(wire.Chunk("r", 1, 0, True, 1, b"")))
    assert side.core.num_bad_messages == 1 and side.rec().is_live
