"""The protocol core (``kvferry.control.core``) on its own, and how the endpoints treat its verdicts.

State tables: every state reachable, terminal states final, an illegal move an ``InternalError`` (a kvferry
bug) that fails the request closed and is logged at ERROR, never counted as a peer's bad message.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Iterator

import numpy as np
import pytest

from kvferry import KVMemory
from kvferry.control import DecodeEndpoint, EndpointOptions, PrefillEndpoint, RequestState, wire
from kvferry.control.core.links import Link
from kvferry.control.core.states import (
    LINK_TRANSITIONS,
    SESSION_TRANSITIONS,
    TRANSITIONS,
    LinkState,
    SessionState,
    check_transition,
)
from kvferry.control.core.timers import GraceClock, Liveness, PeerClock
from kvferry.errors import EndpointClosed, HandshakeError, IncompatiblePeer, InternalError, RequestFailed

from .control_peer import fill, make_layout

OPTS = EndpointOptions(heartbeat_interval=0.1, peer_timeout=0.6, lease_grace=0.4, request_timeout=20.0)


# -- state tables ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("table", [TRANSITIONS, SESSION_TRANSITIONS, LINK_TRANSITIONS],
                         ids=["request", "session", "link"])
def test_every_state_is_in_its_table_and_reachable_from_the_first(table: dict) -> None:
    states = list(type(next(iter(table))))
    assert set(table) == set(states)
    seen, todo = {states[0]}, [states[0]]
    while todo:
        for nxt in table[todo.pop()]:
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    assert seen == set(states)
    assert any(not targets for targets in table.values())   # something ends


def test_a_link_or_session_never_comes_back() -> None:
    link = Link("tcp://127.0.0.1:1", 0.0, PeerClock(0.0, 0.1, 0.6), "s", b"n")
    link.move(LinkState.ESTABLISHED)
    link.move(LinkState.DEAD)
    with pytest.raises(InternalError, match=r"link to prefill tcp://127.0.0.1:1: illegal state transition dead -> "
                                            r"established"):
        link.move(LinkState.ESTABLISHED)
    with pytest.raises(InternalError, match="session x: illegal state transition dead -> established"):
        check_transition(SESSION_TRANSITIONS, SessionState.DEAD, SessionState.ESTABLISHED, "session x")
    with pytest.raises(InternalError):   # a handshake that failed is not revived either
        check_transition(LINK_TRANSITIONS, LinkState.FAILED, LinkState.ESTABLISHED, "link")


# -- how the endpoints treat an internal error ---------------------------------------------------------------
def _memories() -> tuple[KVMemory, KVMemory]:
    src, dst = KVMemory.allocate(make_layout("prefill")), KVMemory.allocate(make_layout("decode"))
    fill(src, 7)
    fill(dst, 999)
    return src, dst


@pytest.fixture
def pair() -> Iterator[tuple[PrefillEndpoint, DecodeEndpoint]]:
    src, dst = _memories()
    prefill = PrefillEndpoint(src, "local", options=OPTS)
    decode = DecodeEndpoint(dst, "local", options=OPTS)
    decode.connect(prefill.address)
    yield prefill, decode
    decode.close()
    prefill.close()


def test_an_illegal_transition_fails_the_request_closed_and_loudly(
        pair: tuple[PrefillEndpoint, DecodeEndpoint], caplog: pytest.LogCaptureFixture) -> None:
    _, decode = pair
    decode.announce("r1", {"main": np.array([1, 2])})
    rec = decode.core.records["r1"]
    with caplog.at_level(logging.ERROR, "kvferry.control"), decode._lock, \
            pytest.raises(InternalError, match=r"request 'r1': illegal state transition "
                                               r"(bootstrapping|waiting_for_input) -> done"):
        decode.core.set_state(rec, RequestState.DONE)   # DONE without a byte landed: a bug, caught
    assert decode.poll("r1") is RequestState.FAILED
    with pytest.raises(RequestFailed) as info:
        decode.wait("r1", 1)
    assert isinstance(info.value.__cause__, InternalError)
    assert decode.num_internal_errors == 1 and decode.counters()["bad_messages"] == 0
    assert any(r.levelno == logging.ERROR and "'r1'" in r.getMessage() and "-> done" in r.getMessage()
               for r in caplog.records)
    # Failed closed on both sides: prefill was told (Abort), settled it, and the lease ended.
    deadline = time.monotonic() + 5
    while decode.holds_lease("r1"):
        assert time.monotonic() < deadline, "the lease of the failed request never ended"
        time.sleep(0.01)


def test_an_internal_error_in_a_handler_is_not_a_bad_message(
        pair: tuple[PrefillEndpoint, DecodeEndpoint], caplog: pytest.LogCaptureFixture,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A bug met while handling a peer's message is logged at ERROR and counted apart; the peer is not
    blamed (its bad-message count stays 0) and the loop goes on."""
    prefill, decode = pair

    def broken(session: object, msg: object) -> None:
        if isinstance(msg, wire.Announce):
            raise InternalError("planted: a bug in the announce handler")

    monkeypatch.setattr(prefill.core.announces, "on_message", broken)
    with caplog.at_level(logging.ERROR, "kvferry.control"):
        decode.announce("r1", {"main": np.array([1, 2])})
        deadline = time.monotonic() + 5
        while not any("planted" in r.getMessage() for r in caplog.records):
            assert time.monotonic() < deadline, "the internal error was not logged"
            time.sleep(0.01)
    assert prefill.counters()["bad_messages"] == 0
    assert any(r.levelno == logging.ERROR and "planted" in r.getMessage() for r in caplog.records)


def test_a_prefill_that_cannot_bind_leaks_no_context_or_pipe() -> None:
    """The constructor's ZMQ context and wake pipe are closed when binding fails (issue 29's clean-up)."""
    src, _ = _memories()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        before = len(os.listdir("/proc/self/fd"))
        for _ in range(5):
            with pytest.raises(EndpointClosed, match=f"cannot listen on tcp://127.0.0.1:{port}"):
                PrefillEndpoint(src, "local", port=port, options=OPTS)
        assert len(os.listdir("/proc/self/fd")) <= before


# -- liveness on a fake clock: exact, no sleep -----------------------------------------------------------------
HB, PT = 0.5, 5.0


def test_heartbeats_fall_due_exactly_every_interval_of_our_silence() -> None:
    clock = PeerClock(100.0, HB, PT)
    assert clock.judge(100.0) is Liveness.OK and clock.next_deadline() == 100.0 + HB
    assert clock.judge(100.0 + HB - 1e-9) is Liveness.OK
    assert clock.judge(100.0 + HB) is Liveness.HEARTBEAT_DUE
    clock.sent(100.0 + HB)                        # the heartbeat left: the next one is an interval later
    clock.heard(100.0 + HB)
    assert clock.judge(100.0 + HB) is Liveness.OK and clock.next_deadline() == 100.0 + 2 * HB


@pytest.mark.parametrize("silence", [PT / 2, PT, PT + 1e-6, 3600.0])
def test_a_peer_that_answers_nothing_is_lost_strictly_after_peer_timeout(silence: float) -> None:
    """The peer says nothing for ``silence`` seconds of simulated time while we keep sending heartbeats."""
    clock = PeerClock(0.0, HB, PT)
    now = 0.0
    while now < silence:
        now = min(clock.next_deadline(), silence)
        verdict = clock.judge(now)
        if verdict is Liveness.HEARTBEAT_DUE:
            clock.sent(now)
        elif verdict is Liveness.PEER_SILENT:
            break
    assert now == min(silence, np.nextafter(PT, np.inf))
    assert clock.judge(now) is (Liveness.PEER_SILENT if silence > PT else Liveness.OK)


@pytest.mark.parametrize("stall", [PT - 0.25, PT + 0.25, 60.0, 86400.0])
def test_a_stall_of_any_length_on_our_side_is_known_before_anything_is_read(stall: float) -> None:
    """This process stalls for ``stall`` seconds (nothing of ours leaves), while the peer's frames queue up.
    Past peer_timeout the peer has given up on us, whatever those frames say: reading them (``heard``)
    must not make the session look current again."""
    clock = PeerClock(0.0, HB, PT)
    clock.sent(0.0)
    resumed = stall
    clock.heard(resumed)                      # the frames queued meanwhile are read on resuming
    verdict = clock.judge(resumed)
    if stall > PT:
        assert verdict is Liveness.WE_WERE_SILENT
        assert clock.we_were_silent(resumed, limit=PT / 2)   # a tighter fence (pull mode) tripped too
    else:
        assert verdict is Liveness.HEARTBEAT_DUE   # overdue, not yet given up on
        assert not clock.we_were_silent(resumed)


def test_next_deadline_is_exactly_when_the_verdict_can_change() -> None:
    """Against random histories of frames in and out: the verdict holds until ``next_deadline`` and no
    longer, so a shell that ticks then (and on every frame) misses no timer and polls for none."""
    rng = np.random.default_rng(29)
    for _ in range(2000):
        clock = PeerClock(0.0, HB, PT)
        now = 0.0
        for _ in range(int(rng.integers(1, 6))):
            now += float(rng.choice([0.0, 0.125, 0.5, 2.0, 5.0, 7.5]))
            (clock.heard if rng.random() < 0.5 else clock.sent)(now)
        due = clock.next_deadline()
        assert due > now or clock.judge(now) is not Liveness.OK
        before = np.nextafter(due, -np.inf)
        if before >= now:
            assert clock.judge(before) is clock.judge(now)
        assert clock.judge(due) is not clock.judge(now) or clock.judge(now) is not Liveness.OK


@pytest.mark.parametrize("stall", [0.0, PT, 3600.0, 86400.0 * 7])
def test_no_timer_alone_ends_a_quarantine(stall: float) -> None:
    """A writer that may still write (a stalled prefill on another host) keeps its pages quarantined for any
    length of simulated time; lease_grace runs only from its certain death, exactly."""
    lease_grace = 5.0
    grace = GraceClock(lease_grace)
    assert grace.needs_check and grace.next_deadline() is None
    assert not grace.due(stall)                    # however long it has been: no timer runs
    grace.writer_gone(stall)                       # e.g. /proc says the process is gone
    grace.writer_gone(stall + 1.0)                 # a later answer does not move the release
    assert not grace.needs_check and grace.next_deadline() == stall + lease_grace
    assert not grace.due(np.nextafter(stall + lease_grace, -np.inf))
    assert grace.due(stall + lease_grace)


def test_the_protocol_page_shows_the_tables_the_code_enforces() -> None:
    import importlib.util
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    spec = importlib.util.spec_from_file_location("protocol_tables", root / "scripts" / "protocol_tables.py")
    assert spec is not None and spec.loader is not None
    tables = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tables)
    text = tables.DOC.read_text()
    assert text.count("<!-- table:") == 3
    assert tables.render(text) == text, "docs/protocol.md is stale: run scripts/protocol_tables.py"


# -- what engine adapters ask the library -------------------------------------------------------------------
def _dead_address() -> str:
    with socket.socket() as s:   # a port nobody listens on (closed again at once)
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


def test_connect_needed_backs_off_from_a_prefill_that_is_down_and_connects_once_it_is_up() -> None:
    src, dst = _memories()
    with DecodeEndpoint(dst, "local", options=OPTS) as decode:
        dead = _dead_address()
        with pytest.raises(HandshakeError):
            decode.connect_needed([dead], timeout=0.2, retry_after=0.3)
        t0 = time.monotonic()
        with pytest.raises(HandshakeError):           # within the back-off: at once, no handshake
            decode.connect_needed([dead], timeout=0.2, retry_after=0.3)
        assert time.monotonic() - t0 < 0.1
        time.sleep(0.3)
        with pytest.raises(HandshakeError):           # tried again, and failed again: the back-off doubles
            decode.connect_needed([dead], timeout=0.2, retry_after=0.3)
        assert decode.core.backoff.refused[(dead,)][2] == pytest.approx(0.6)
        with PrefillEndpoint(src, "local", options=OPTS) as prefill:
            assert decode.connect_needed([prefill.address]) == prefill.address
            t0 = time.monotonic()
            assert decode.connect_needed([prefill.address]) == prefill.address   # connected: at once
            assert time.monotonic() - t0 < 0.05


def test_connect_needed_never_retries_a_refusal() -> None:
    src, dst = _memories()
    with PrefillEndpoint(src, "local", options=OPTS, secret="s") as prefill, \
            DecodeEndpoint(dst, "local", options=OPTS) as decode:
        with pytest.raises(IncompatiblePeer, match="shared secret"):
            decode.connect_needed([prefill.address], retry_after=0.0)
        first = decode.core.backoff.refused[(prefill.address,)][1]
        with pytest.raises(IncompatiblePeer) as again:
            decode.connect_needed([prefill.address], retry_after=0.0)
        assert again.value is first                   # the remembered refusal, not a new handshake


def test_may_free_answers_per_request(pair: tuple[PrefillEndpoint, DecodeEndpoint]) -> None:
    prefill, decode = pair
    assert prefill.may_free("never-seen")
    decode.announce("r1", {"main": np.array([1, 2])})
    decode.announce("r2", {"main": np.array([3, 4])})
    prefill.send("r1", {"main": np.array([5, 6])})
    prefill.send("r2", {"main": np.array([7, 8])}, last=False)
    decode.wait("r1", 5)
    deadline = time.monotonic() + 5
    while not prefill.may_free("r1"):               # DONE once decode's verdict arrived
        assert time.monotonic() < deadline
        time.sleep(0.005)
    assert prefill.poll("r1") is RequestState.DONE
    assert not prefill.may_free("r2")               # live: its pages may still be written
    prefill.abort("r2", "test")
    while not prefill.may_free("r2"):               # failed, and its own write settled
        assert time.monotonic() < deadline
        time.sleep(0.005)
