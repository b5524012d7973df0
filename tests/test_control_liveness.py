"""Slow is not dead (issue 29): liveness decided from what CPU starvation cannot fake.

On the core's fake clock first: a peer that says nothing at the application level for a long stretch of
simulated time while its connection stands (libzmq's ZMTP heartbeats, answered without the GIL, still come
back) is *suspect*, never lost, and the request rides it out; the same silence with the connection dropped
is lost at the first tick after the drop. Then with real endpoints over TCP: a decode process whose Python
is starved (one thread holds the GIL) for several ``peer_timeout``s, while its libzmq still answers, costs
no request with ``transport_liveness``, and is declared lost without it (today's behaviour, kept as the
control)."""

from __future__ import annotations

import numpy as np
import pytest

from kvferry.control.core.timers import Liveness, PeerClock

HB, PT, RT = 0.2, 1.0, 30.0


def simulate(silence: float, connected_until: float, *, transport: bool) -> tuple[float, Liveness]:
    """One request, created at 0 with deadline ``RT``: the peer answers nothing at the application level for
    ``silence`` seconds (a starved Python), then answers everything. Its connection is up until
    ``connected_until`` (then dropped: SIGSTOPped or gone), as the transport reports when ``transport``;
    without it the shell knows nothing (None). We tick exactly at each ``next_deadline`` (and the request's),
    as the shells do, sending heartbeats when due. Returns when and why the request ended."""
    clock = PeerClock(0.0, HB, PT)
    now = 0.0
    while True:
        events = [clock.next_deadline(now), RT, silence if now < silence else np.inf,
                  connected_until if transport and now < connected_until else np.inf]
        now = min(e for e in events if e > now)   # each event once: a verdict never needs the same tick twice
        if now >= silence and now < connected_until:
            return now, Liveness.OK   # the peer spoke again: its chunk arrives, the request completes
        connected = (now < connected_until) if transport else None
        if clock.peer_lost(now, connected):
            return now, clock.judge(now, connected)
        if now >= RT:
            return now, Liveness.PEER_SUSPECT   # the request's own deadline: TransferTimeout, not PeerLost
        if clock.heartbeat_due(now):
            clock.sent(now)


@pytest.mark.parametrize("silence", [PT / 2, PT + 1e-6, 5 * PT, 25.0])
def test_a_starved_peer_whose_connection_stands_is_ridden_out(silence: float) -> None:
    ended, verdict = simulate(silence, np.inf, transport=True)
    assert (ended, verdict) == (silence, Liveness.OK)


@pytest.mark.parametrize("silence", [PT + 1e-6, 5 * PT, 25.0])
def test_without_transport_liveness_the_same_starvation_fails_the_request(silence: float) -> None:
    """The control, today's rule: silence past peer_timeout is loss."""
    ended, verdict = simulate(silence, np.inf, transport=False)
    assert verdict is Liveness.PEER_SILENT and ended == np.nextafter(PT, np.inf)


def test_a_silence_past_the_request_deadline_still_ends_it_by_its_deadline() -> None:
    ended, verdict = simulate(RT + 10.0, np.inf, transport=True)
    assert ended == RT and verdict is Liveness.PEER_SUSPECT


@pytest.mark.parametrize("drop", [0.1, PT, 7.3])
def test_a_dropped_connection_fails_closed_at_the_drop(drop: float) -> None:
    """The peer is silent and, at ``drop``, its connection goes (libzmq's heartbeats unanswered for
    peer_timeout: SIGSTOP, a crash, a cut cable): lost at that tick, whatever the silence so far."""
    ended, verdict = simulate(np.inf, drop, transport=True)
    assert (ended, verdict) == (drop, Liveness.GONE)


def test_the_verdict_table() -> None:
    clock = PeerClock(0.0, HB, PT)
    quiet = np.nextafter(PT, np.inf)
    clock.sent(quiet)   # we kept talking: only the peer went quiet
    assert clock.judge(quiet, None) is Liveness.PEER_SILENT and clock.peer_lost(quiet, None)
    assert clock.judge(quiet, True) is Liveness.PEER_SUSPECT and not clock.peer_lost(quiet, True)
    assert clock.judge(quiet, False) is Liveness.GONE and clock.peer_lost(quiet, False)
    assert clock.judge(0.1, False) is Liveness.GONE      # a drop needs no silence
    assert not clock.peer_lost(PT, True) and not clock.peer_lost(PT, None)
    # Our own stall outranks everything: it is what prefill must act on before reading.
    stalled = PeerClock(0.0, HB, PT)
    assert stalled.judge(quiet, True) is Liveness.WE_WERE_SILENT


# -- processes: a decode whose Python is starved while its libzmq answers ------------------------------------
@pytest.mark.nixl
@pytest.mark.parametrize("transport_liveness", [True, pytest.param(False, marks=pytest.mark.slow)])   # control: slow
def test_a_gil_starved_decode_process_is_ridden_out(transport_liveness: bool) -> None:
    """Decode in a child process; right after its announces, one of its threads holds the GIL for ~4 s
    (4 x peer_timeout): its progress loop sends nothing, reads nothing. Prefill (here) writes meanwhile and
    waits for decode's verdicts. With ``transport_liveness`` the session is only suspect, the verdicts come
    once decode runs again, and every byte checks; without it prefill declares decode lost at peer_timeout
    (the failure measured under load, kept here as the control that this test can fail)."""
    pytest.importorskip("nixl")
    pytest.importorskip("kvferry.transport.nixl")
    from kvferry import KVMemory
    from kvferry.control import EndpointOptions, PrefillEndpoint
    from kvferry.errors import RequestFailed

    from .control_peer import fill, make_layout, run_prefill, wait_all, workload
    from .test_control_nixl import SEED, TIMEOUTS, Peer

    timeouts = {**TIMEOUTS, "transport_liveness": transport_liveness}
    src = KVMemory.allocate(make_layout("prefill"))
    fill(src, SEED)
    prefill = PrefillEndpoint(src, "nixl", options=EndpointOptions(**timeouts))
    decode = Peer("decode", options=timeouts)
    try:
        decode("connect", address=prefill.address)
        reqs = workload(4, seed=21)
        decode("announce", n=4, seed=21)
        decode("hog", seconds=4 * timeouts["peer_timeout"])
        try:
            run_prefill(prefill, reqs)
        except RequestFailed:   # the control: a later send of a request already failed by the lost session
            assert not transport_liveness
        results = wait_all(prefill, [r.rid for r in reqs], 30)
        if transport_liveness:
            assert set(results.values()) == {"done"}, results
            assert set(decode("wait_all")["results"].values()) == {"done"}
            decode("verify")   # every byte that arrived, checked against the source's fill
        else:
            assert any("PeerLost" in v and "silent" in v for v in results.values()), results
    finally:
        decode.close()
        prefill.close()


@pytest.mark.nixl
@pytest.mark.parametrize("transport_liveness", [True, pytest.param(False, marks=pytest.mark.slow)])   # control: slow
def test_a_gil_starved_prefill_process_is_ridden_out(transport_liveness: bool) -> None:
    """Prefill in a child process; after decode's announces, one of its threads holds the GIL for ~4 s
    (4 x peer_timeout) before its engine sends. On resuming, prefill finds it sent decode nothing for that
    long: it probes the session and writes nothing until decode echoes. With ``transport_liveness`` decode
    kept the link (libzmq still answered), echoes, and every request completes, byte for byte; without it
    decode declared prefill lost at peer_timeout, no echo comes, and the requests fail (the control)."""
    pytest.importorskip("nixl")
    pytest.importorskip("kvferry.transport.nixl")
    from kvferry import KVMemory
    from kvferry.control import DecodeEndpoint, EndpointOptions

    from .control_peer import announce, fill, make_layout, verify, wait_all, workload
    from .test_control_nixl import SEED, TIMEOUTS, Peer

    timeouts = {**TIMEOUTS, "transport_liveness": transport_liveness}
    dst = KVMemory.allocate(make_layout("decode"))
    fill(dst, 999)
    before = {b.name: dst.array(b.name).copy() for b in dst.layout.buffers}
    decode = DecodeEndpoint(dst, "nixl", options=EndpointOptions(**timeouts))
    prefill = Peer("prefill", options=timeouts)
    try:
        decode.connect(prefill.address)
        reqs = workload(4, seed=21)
        announce(decode, reqs)
        prefill("hog", seconds=4 * timeouts["peer_timeout"])
        try:
            prefill("serve", n=4, seed=21, timeout=60)   # handled once the hog lets go of the GIL
        except AssertionError:   # the control: its engine's send of a request the lost session failed raises
            assert not transport_liveness
        results = wait_all(decode, [r.rid for r in reqs], 30)
        if transport_liveness:
            assert set(results.values()) == {"done"}, results
            verify(dst, SEED, reqs, before)
        else:
            assert all(v != "done" for v in results.values()), results
    finally:
        prefill.close()
        decode.close()


@pytest.mark.nixl
def test_a_stopped_prefill_process_is_lost_within_its_bound() -> None:
    """The other half: a prefill process under SIGSTOP answers not even libzmq's heartbeats, so with
    ``transport_liveness`` decode's connection drops and the link is lost, well before the request's own
    deadline (bound: heartbeat_interval + peer_timeout for libzmq to drop it, plus scheduling slack)."""
    import signal
    import time

    pytest.importorskip("nixl")
    pytest.importorskip("kvferry.transport.nixl")
    from kvferry import KVMemory
    from kvferry.control import DecodeEndpoint, EndpointOptions
    from kvferry.errors import PeerLost, RequestFailed

    from .control_peer import announce, fill, make_layout, workload
    from .test_control_nixl import TIMEOUTS, Peer

    timeouts = {**TIMEOUTS, "transport_liveness": True}
    dst = KVMemory.allocate(make_layout("decode"))
    fill(dst, 999)
    decode = DecodeEndpoint(dst, "nixl", options=EndpointOptions(**timeouts))
    prefill = Peer("prefill", options=timeouts)
    try:
        decode.connect(prefill.address)
        reqs = workload(2, seed=21)
        announce(decode, reqs)
        prefill.proc.send_signal(signal.SIGSTOP)
        t0 = time.monotonic()
        with pytest.raises(RequestFailed) as failed:
            decode.wait(reqs[0].rid, timeout=15.0)
        took = time.monotonic() - t0
        assert isinstance(failed.value.__cause__, PeerLost), failed.value
        assert "connection dropped" in str(failed.value.__cause__), failed.value
        assert took < 15.0 < timeouts["request_timeout"]
    finally:
        prefill.proc.send_signal(signal.SIGCONT)
        prefill.close()
        decode.close()
