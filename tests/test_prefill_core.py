"""Prefill's protocol core on a fake clock: every timer exact, no thread, socket, sleep or wall clock.

``PrefillCore`` is driven here the way its shell drives it (``control.prefill``): frames in, the engine's
commands, writes posted and settled by hand, ticks at chosen times. The decode peer is played by this
test with wire messages. What each test asserts is a decision: a message queued, a write posted or not, a
request's state, an effect. Stalls of any length are a jump of the clock between a decision and its
posting (what SIGSTOP does to a process), so the prefill-stall case runs here exactly, at every length.
"""

from __future__ import annotations

import itertools
import math
from typing import Any

import numpy as np
import pytest

from kvferry import KVMemory
from kvferry.control import EndpointOptions, RequestState, wire
from kvferry.control.core.base import AddPeer, CheckProcess, FlushNow, RemovePeer
from kvferry.control.core.prefill import PrefillCore, PrefillSetup, Write
from kvferry.control.core.prefill_requests import make_spec
from kvferry.control.core.process import ProcessIdentity
from kvferry.control.pull import source_hold_s
from kvferry.control.stats import NullRecorder
from kvferry.errors import PeerLost, ProtocolError, RequestAborted, TransferTimeout
from kvferry.integrity import DigestMode

from .control_peer import make_layout
from .core_shell import between_events

# The silence rule, exact (with transport_liveness, the default, silence alone never ends a session whose
# connection stands: test_control_liveness).
OPTS = EndpointOptions(heartbeat_interval=0.1, peer_timeout=0.6, lease_grace=0.4, request_timeout=20.0,
                       handshake_timeout=2.0, transport_liveness=False)
DECODE = ProcessIdentity("host-a", 4242, 7)
PAGES = {"main": np.array([3, 4]), "c4": np.array([1])}
SRC = {"main": np.array([10, 11]), "c4": np.array([5])}


class Peer:
    """One prefill core and the decode it talks to, on a clock this test moves."""

    def __init__(self, options: EndpointOptions = OPTS, *, secret: bytes | None = None) -> None:
        self.t = 0.0
        self.src = KVMemory.allocate(make_layout("prefill"))
        self.dst = KVMemory.allocate(make_layout("decode"))
        setup = PrefillSetup("tcp://prefill", "local", "dlist", b"prefill-meta", ProcessIdentity("host-a", 1, 1),
                             secret, frozenset({"push", "pull"}))
        self.options = options
        self.core = PrefillCore(self.src, setup, options, DigestMode.OFF,
                                NullRecorder("prefill", self.src.layout), lambda n: bytes(n))
        self.tickets = itertools.count(1)
        self.in_flight: dict[int, Write] = {}
        self.removed: list[str] = []
        self.asked: list[ProcessIdentity] = []
        self.inbox: dict[bytes, list[Any]] = {}    # what decode received, per identity

    # -- the decode side ---------------------------------------------------------------------------------
    def connect(self, identity: bytes = b"d1", mode: str = "push") -> None:
        hello = wire.Hello(identity.hex(), self.dst.manifest(), "local", b"decode-meta", bytes(32), "off",
                           self.options.heartbeat_interval, mode, self.options.peer_timeout, DECODE.host,
                           DECODE.pid, DECODE.started)
        self.frame(identity, hello)
        assert any(isinstance(m, wire.Welcome) for m in self.received(identity))

    def frame(self, identity: bytes, msg: Any) -> None:
        self.core.on_frame(self.t, identity, wire.encode(msg))
        self.carry_out()

    def announce(self, rid: str = "r", generation: int = 1, identity: bytes = b"d1") -> None:
        self.frame(identity, wire.Announce(rid, generation, wire.encode_pages(PAGES)))

    def received(self, identity: bytes = b"d1") -> list[Any]:
        """What decode got since the last call (messages, Batches unpacked)."""
        out = self.inbox.pop(identity, [])
        return [m for m in out if not isinstance(m, wire.Heartbeat)]

    # -- the engine ---------------------------------------------------------------------------------------
    def send(self, rid: str = "r") -> None:
        self.core.send(self.t, rid, make_spec(self.src, SRC, 0, True, None), None)
        self.carry_out()

    # -- the shell's part -----------------------------------------------------------------------------------
    def carry_out(self, *, post: bool = True) -> list[Write]:
        """What the shell does between events: the deferred calls, effects, writes (posted at ``self.t``),
        and the messages (sent at ``self.t``)."""
        posted = between_events(self.core, self.t, self.apply, self.core.start_write, self.posted,
                                lambda write: write.records, post=post)
        self.flush()
        return posted

    def posted(self, write: Write) -> None:
        ticket = next(self.tickets)
        self.core.write_posted(write, ticket)
        self.in_flight[ticket] = write

    def apply(self, effect: Any) -> None:
        if isinstance(effect, AddPeer):
            self.core.peer_added(self.t, effect.peer, "agent-" + effect.peer.decode(), None)
        elif isinstance(effect, RemovePeer):
            self.removed.append(effect.agent)
        elif isinstance(effect, CheckProcess):
            self.asked.append(effect.process)
        elif isinstance(effect, FlushNow):
            self.flush(effect.peer)
            if effect.raw:
                self.inbox.setdefault(effect.peer, []).append(wire.decode(effect.raw))
        else:
            raise AssertionError(effect)

    def flush(self, only: bytes | None = None) -> None:
        for identity in [only] if only is not None else list(self.core.outbox):
            for data in self.core.take_out(identity):
                msg = wire.decode(data)
                self.inbox.setdefault(identity, []).extend(wire.unbatch(msg) if isinstance(msg, wire.Batch) else [msg])
                self.core.frame_sent(self.t, identity)

    def settle(self, ticket: int, error: Any = None) -> None:
        self.in_flight.pop(ticket)
        self.core.write_settled(self.t, ticket, error)
        self.core.settle_dirty(self.t)
        self.carry_out()

    def tick(self, t: float) -> None:
        """The loop's iteration at ``t``: silence checked before any frame, then the timers."""
        self.t = t
        self.core.check_silence(t)
        self.carry_out()
        self.core.settle_dirty(t)
        self.core.tick(t)
        self.carry_out()

    def run_until(self, t: float, *, heard: bool = True, identity: bytes = b"d1") -> None:
        """Tick at every deadline the core names up to ``t``; with ``heard``, decode sends a heartbeat at
        each one (a live peer)."""
        while True:
            nxt = min(self.core.next_deadline(), t)
            self.tick(max(nxt, self.t))
            if heard and identity in self.core.sessions:
                self.frame(identity, wire.Heartbeat())
            if self.t >= t:
                return

    def state(self, rid: str = "r") -> RequestState:
        return self.core.records[rid].state


def _after(t: float) -> float:
    return math.nextafter(t, math.inf)


def _writing() -> tuple[Peer, int]:
    """A connected decode that announced request "r" (generation 1), sent by the engine: its one write in
    flight (the ticket)."""
    peer = Peer()
    peer.connect()
    peer.send()
    peer.announce()
    [ticket] = peer.in_flight
    return peer, ticket


def test_a_session_is_established_and_writes_are_posted_with_their_chunk() -> None:
    peer = Peer()
    peer.connect()
    peer.send()
    peer.announce()
    [write] = list(peer.in_flight.values())
    assert write.agent == "agent-d1" and [r.request_id for r in write.records] == ["r"]
    assert isinstance(wire.decode(write.notification), wire.Chunk)
    assert peer.state() is RequestState.TRANSFERRING
    peer.settle(next(iter(peer.in_flight)))
    peer.frame(b"d1", wire.Result("r", 1, True, ""))
    peer.core.settle_dirty(peer.t)
    assert peer.state() is RequestState.DONE and not peer.core.active


def test_a_silent_decode_is_lost_exactly_after_peer_timeout() -> None:
    """Heartbeats leave every heartbeat_interval; nothing heard for exactly peer_timeout is not yet loss, the
    next representable instant is. ``next_deadline`` names that instant."""
    peer = Peer()
    peer.connect()
    peer.send()
    peer.announce()
    heard_at = peer.core.sessions[b"d1"].clock.last_seen
    lost_at = _after(heard_at + OPTS.peer_timeout)
    peer.run_until(heard_at + OPTS.peer_timeout, heard=False)
    assert b"d1" in peer.core.sessions and peer.state() is RequestState.TRANSFERRING
    assert peer.core.next_deadline() <= lost_at
    peer.tick(lost_at)
    assert b"d1" not in peer.core.sessions
    assert peer.state() is RequestState.FAILED
    assert isinstance(peer.core.records["r"].error, PeerLost)
    assert any(isinstance(m, wire.Bye) for m in peer.received())


def _probe_sent(peer: Peer, identity: bytes = b"d1") -> int:
    """The newest probe number decode received (0: none), from its inbox (left in place)."""
    probes = [m.probe for m in peer.inbox.get(identity, []) if isinstance(m, wire.Heartbeat) and m.probe]
    return probes[-1] if probes else 0


def _stalled_with_a_decided_write(stall: float) -> tuple[Peer, float]:
    """A write decided (not posted), then the process stops ``stall`` seconds before its shell posts it."""
    peer = Peer()
    peer.connect()
    peer.run_until(1.0)
    peer.send()
    peer.core.on_frame(peer.t, b"d1", wire.encode(wire.Announce("r", 1, wire.encode_pages(PAGES))))
    assert len(peer.core.transfers) == 1 and not peer.in_flight   # decided, not yet posted
    last_sent = peer.core.sessions[b"d1"].clock.last_sent
    peer.t += stall
    return peer, last_sent


@pytest.mark.parametrize("stall", [0.0, 0.2, 0.5, 0.6, 0.61, 5.0, 3600.0])
def test_a_stall_of_any_length_writes_nothing_once_decode_gave_up(stall: float) -> None:
    """The prefill-stall case, exact: the write is decided, then the process stalls ``stall`` seconds before
    posting it. It is posted at once only if decode cannot have given up on us by then (our last frame left
    at most peer_timeout before). Otherwise it is held and decode is asked (a probe). A decode that gave up
    closed its connection: nothing of it queued during the stall, nothing answers, so nothing is ever
    written, and the session ends (decode silent, or the probe unanswered) within peer_timeout."""
    peer, last_sent = _stalled_with_a_decided_write(stall)
    posted = peer.carry_out()
    if peer.t - last_sent <= OPTS.peer_timeout:
        assert len(posted) == 1 and peer.state() is RequestState.TRANSFERRING
        return
    assert posted == [] and not peer.in_flight and _probe_sent(peer)
    rec = peer.core.records["r"]
    assert rec.state is RequestState.TRANSFERRING and rec.posting   # held: it may yet be posted
    peer.run_until(peer.t + OPTS.peer_timeout, heard=False)   # decode silent, or the probe unanswered
    assert rec.state is RequestState.FAILED and isinstance(rec.error, PeerLost)
    assert not rec.handles and not rec.posting and not peer.in_flight
    assert b"d1" not in peer.core.sessions and peer.removed == ["agent-d1"]


def test_a_probe_unanswered_for_peer_timeout_ends_the_session() -> None:
    """Decode's heartbeats still come (they queued during the stall), but no echo: a decode of an older
    protocol, or one too starved to answer in time. The session ends exactly peer_timeout after the probe."""
    peer, _ = _stalled_with_a_decided_write(5.0)
    peer.frame(b"d1", wire.Heartbeat())   # queued during the stall, read right after it
    peer.carry_out()
    probe_deadline = peer.t + OPTS.peer_timeout
    peer.run_until(probe_deadline)
    assert b"d1" in peer.core.sessions and not peer.in_flight
    assert peer.core.next_deadline() == _after(probe_deadline)
    peer.tick(_after(probe_deadline))
    rec = peer.core.records["r"]
    assert rec.state is RequestState.FAILED and "did not answer" in str(rec.error)
    assert not rec.posting and not peer.in_flight and b"d1" not in peer.core.sessions


@pytest.mark.parametrize("stall", [0.61, 5.0, 3600.0])
def test_a_starved_prefill_writes_once_decode_answers_that_it_still_holds_the_session(stall: float) -> None:
    """Slow is not dead: decode kept the session through prefill's stall (its transport saw the connection
    stand), so it echoes the probe; only then is the held write posted, and the request completes."""
    peer, _ = _stalled_with_a_decided_write(stall)
    assert peer.carry_out() == []
    probe = _probe_sent(peer)
    peer.t += 0.05
    peer.frame(b"d1", wire.Heartbeat(echo=probe + 1))   # not the probe asked: changes nothing
    assert not peer.in_flight
    peer.frame(b"d1", wire.Heartbeat(echo=probe))
    [ticket] = list(peer.in_flight)
    peer.settle(ticket)
    peer.frame(b"d1", wire.Result("r", 1, True, ""))
    peer.core.settle_dirty(peer.t)
    assert peer.state() is RequestState.DONE and b"d1" in peer.core.sessions
    assert peer.core.num_probes == 1


def test_what_decode_said_before_its_echo_is_read_first() -> None:
    """Decode failed the request during the stall (its deadline, an abort): that Abort left before the echo
    on the same connection, so it is read first and the held write is never posted."""
    peer, _ = _stalled_with_a_decided_write(2.0)
    peer.carry_out()
    probe = _probe_sent(peer)
    peer.frame(b"d1", wire.Abort("r", 1, "decode deadline passed"))
    peer.frame(b"d1", wire.Heartbeat(echo=probe))
    peer.core.settle_dirty(peer.t)
    peer.carry_out()
    assert not peer.in_flight and peer.state() is RequestState.FAILED
    assert not peer.core.records["r"].posting
    assert any(isinstance(m, wire.Fail) and m.settled for m in peer.received())


def test_an_echo_of_an_earlier_probe_does_not_clear_a_later_stall() -> None:
    """Each stall asks anew: decode's answer to the first probe says nothing of what it decided during the
    second stall."""
    peer, _ = _stalled_with_a_decided_write(2.0)
    peer.carry_out()
    first = _probe_sent(peer)
    peer.t += 3.0                        # stalled again, before the answer was read
    peer.core.check_silence(peer.t)
    peer.carry_out()
    second = _probe_sent(peer)
    assert second != first
    peer.frame(b"d1", wire.Heartbeat(echo=first))
    assert not peer.in_flight
    peer.frame(b"d1", wire.Heartbeat(echo=second))
    assert len(peer.in_flight) == 1


def test_a_stall_before_reading_makes_queued_frames_harmless() -> None:
    """Frames that queued while prefill stalled past peer_timeout do not revive the session: it is judged
    before they are read, and an announce among them posts nothing until decode answers the probe; without
    an answer the session ends."""
    peer = Peer()
    peer.connect()
    peer.send()
    peer.t = 0.0 + OPTS.peer_timeout + 0.5
    peer.core.check_silence(peer.t)
    peer.announce()
    assert not peer.in_flight and peer.state() is not RequestState.FAILED
    peer.tick(_after(peer.t + OPTS.peer_timeout))
    assert b"d1" not in peer.core.sessions and peer.state() is RequestState.FAILED


def test_a_dead_sessions_write_in_flight_keeps_the_agent_until_it_settles() -> None:
    """A session lost with a write in flight: the write is not cancelled blind, the transport peer stays
    until it settles, and a decode that reconnects and asks about the generation hears a settled Fail only
    then (docs/fencing.md)."""
    peer, ticket = _writing()
    peer.run_until(1.0, heard=False)
    assert b"d1" not in peer.core.sessions and peer.removed == []   # the write may still land
    peer.connect(b"d1")                                             # the same decode, a new session
    peer.received()
    peer.frame(b"d1", wire.Abort("r", 1, "decode declared this prefill dead: settle this generation"))
    assert not [m for m in peer.received() if isinstance(m, wire.Fail) and m.settled]
    peer.settle(ticket)
    fails = [m for m in peer.received() if isinstance(m, wire.Fail)]
    assert [(f.request_id, f.generation, f.settled) for f in fails] == [("r", 1, True)]


def test_abort_with_a_write_in_flight_tells_decode_twice() -> None:
    """prefill's abort: decode hears at once (unsettled: it must not report DONE) and again, settled, once
    the write in flight has; only then may it free the pages."""
    peer, ticket = _writing()
    peer.received()
    peer.core.abort(peer.t, "r", "engine gave up")
    peer.carry_out()
    assert [(m.settled, m.error) for m in peer.received() if isinstance(m, wire.Fail)] == [(False, "aborted")]
    assert isinstance(peer.core.records["r"].error, RequestAborted)
    peer.settle(ticket)
    assert [m.settled for m in peer.received() if isinstance(m, wire.Fail)] == [True]
    assert not peer.core.active


@pytest.mark.parametrize("silence", [0.61, 5.0, 3600.0])
def test_a_starved_decode_whose_connection_stands_is_ridden_out(silence: float) -> None:
    """With transport_liveness (the default) decode's silence alone, however long, never ends the session
    while its connection stands: the write goes on, and decode's verdict after the silence completes the
    request. A connection drop, with decode unheard since, ends it at once."""
    opts = EndpointOptions(heartbeat_interval=0.1, peer_timeout=0.6, request_timeout=7200.0)
    peer = Peer(opts)
    peer.connect()
    peer.send()
    peer.announce()
    [ticket] = list(peer.in_flight)
    peer.settle(ticket)
    peer.run_until(peer.t + silence, heard=False)     # decode's Python starved: not a frame from it
    assert b"d1" in peer.core.sessions and peer.state() is RequestState.TRANSFERRING
    peer.frame(b"d1", wire.Result("r", 1, True, ""))
    peer.core.settle_dirty(peer.t)
    assert peer.state() is RequestState.DONE

    peer.connect(b"d2")
    peer.run_until(peer.t + 1.0, heard=False)
    peer.core.connection_dropped(peer.t)             # d2's libzmq stopped answering (SIGSTOP, a crash)
    peer.tick(peer.t)
    assert b"d2" not in peer.core.sessions


def test_the_request_deadline_is_exact_to_the_deadline_check() -> None:
    opts = EndpointOptions(heartbeat_interval=0.1, peer_timeout=0.6, request_timeout=3.0)
    peer = Peer(opts)
    peer.connect()
    peer.send()
    peer.run_until(3.0)
    assert peer.state() is RequestState.BOOTSTRAPPING
    peer.run_until(3.02)
    assert peer.state() is RequestState.FAILED and isinstance(peer.core.records["r"].error, TransferTimeout)


def test_a_half_open_handshake_is_forgotten_at_its_deadline() -> None:
    peer = Peer(secret=b"s3cret")
    hello = wire.Hello("x", peer.dst.manifest(), "local", b"m", bytes(32), "off", 0.1, "push", 0.6)
    peer.frame(b"d1", hello)
    assert [type(m) for m in peer.received()] == [wire.Challenge]
    peer.tick(OPTS.handshake_timeout)
    assert b"d1" in peer.core.sessions
    peer.tick(_after(OPTS.handshake_timeout))
    assert b"d1" not in peer.core.sessions


@pytest.mark.parametrize("gone", [True, False])
def test_a_pull_hold_ends_when_decode_is_gone_or_at_source_hold(gone: bool) -> None:
    """Pull mode: decode reads prefill's pages, so they are held. A dead session's holds end once its
    decode's process is certainly gone (the shell answers CheckProcess), else at ``source_hold_s``."""
    peer = Peer()
    peer.connect(mode="pull")
    peer.send()
    peer.announce()
    assert any(isinstance(m, wire.Ready) for m in peer.received())
    rec = peer.core.records["r"]
    assert rec.source_held
    peer.run_until(1.0, heard=False)
    dead_at = rec.release_at - source_hold_s(OPTS.peer_timeout, OPTS.peer_timeout, OPTS.lease_grace)
    assert peer.asked and set(peer.asked) == {DECODE}
    if gone:
        peer.core.process_gone(peer.t, DECODE)
        assert not rec.source_held
        return
    end = rec.release_at
    peer.run_until(end - 1e-6, heard=False)
    assert rec.source_held and dead_at < end
    peer.tick(end)
    assert not rec.source_held and rec not in peer.core.active


def test_a_copy_of_an_announce_is_dropped_unanswered_live_or_ended() -> None:
    """A decode's generations rise with each announce on its connection, so an announce not above the last
    is a copy (a replay, a duplicate): dropped as a bad message, never answered. A Fail for it would name
    the live generation and tell decode nothing will be written under it (decode frees the pages being
    written); a late copy of an ended one must not start a write into pages decode has leased again."""
    peer, ticket = _writing()
    peer.received()
    with pytest.raises(ProtocolError, match="a copy"):
        peer.announce()                       # the copy, while generation 1 is being written
    peer.carry_out()
    assert peer.received() == [] and list(peer.in_flight) == [ticket]
    peer.settle(ticket)
    peer.frame(b"d1", wire.Result("r", 1, True, ""))
    peer.core.settle_dirty(peer.t)
    assert peer.state() is RequestState.DONE
    with pytest.raises(ProtocolError, match="a copy"):
        peer.announce()                       # a late copy, the request ended
    peer.carry_out()
    assert peer.received() == [] and not peer.in_flight and not peer.core.active
    assert peer.state() is RequestState.DONE
    peer.announce("r2", 2)                    # the next generation is a new hand-off
    assert peer.core.records["r2"].is_live and peer.received()[0] == wire.Ack("r2", 2)
