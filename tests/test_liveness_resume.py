"""A prefill back from a stall inside its progress loop judges the decode that reconnected meanwhile fairly.

Seen on a loaded 2-core host (test_fencing's SIGSTOPped prefill, over Mooncake): prefill stopped inside a
write it posted while draining its socket; decode declared it dead and reconnected, and that Hello waited in
prefill's socket. Back from the stall, the rest of the drain read the Hello stamped with the time of the poll
*before* the stall, so the new session looked silent for the whole stall and prefill ended it ("silent for
6.01 s") at the next dropped connection (the old one), right after it had settled decode's quarantine over
it; with nothing left in quarantine, decode had no reason to reconnect again.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np
import pytest

from kvferry import KVMemory
from kvferry.control import DecodeEndpoint, EndpointOptions, PrefillEndpoint, wire
from kvferry.control.core.prefill_liveness import Liveness
from kvferry.control.core.states import SessionState
from kvferry.control.core.timers import PeerClock
from kvferry.errors import KVFerryError, RequestFailed
from kvferry.plan import TransferPlan
from kvferry.transport import LocalTransport
from kvferry.transport.local import LocalHandle

from .control_peer import fill, make_layout
from .test_control_local import _until

PAGES = {"main": np.array([10, 11, 12, 13]), "c4": np.array([5])}
SRC = {"main": np.array([0, 1, 2, 3]), "c4": np.array([0])}


class StallingTransport(LocalTransport):
    """The first write sleeps ``stall`` seconds first: prefill's progress thread stands still inside the
    drain that read the announce (a stopped process, or one starved of CPU)."""

    def __init__(self, stall: float) -> None:
        super().__init__()
        self.stall = stall
        self.resumed = threading.Event()
        self._stalled = False

    def write(self, plan: TransferPlan, peer: str, notif: bytes, label: str = "") -> LocalHandle:
        if not self._stalled:
            self._stalled = True
            time.sleep(self.stall)
            self.resumed.set()
        return super().write(plan, peer, notif, label)


class NoGuarantee(LocalTransport):
    """Promises nothing about a writer: only prefill's acknowledgement ends decode's quarantine."""

    def peer_may_write(self, peer: str) -> bool:
        return True


def _memory(side: str, seed: int) -> KVMemory:
    mem = KVMemory.allocate(make_layout(side))
    fill(mem, seed)
    return mem


def test_a_hello_read_after_a_stall_inside_the_drain_opens_a_live_session(monkeypatch: pytest.MonkeyPatch) -> None:
    # Silence decides (a stall here stands for a stopped process), so a session judged by a stale stamp
    # ends at prefill's very next tick, not at a dropped connection that may or may not come first.
    opts = EndpointOptions(heartbeat_interval=0.1, peer_timeout=0.5, lease_grace=0.2, request_timeout=30.0,
                           transport_liveness=False)
    stalling, plain = StallingTransport(1.5), NoGuarantee()
    with PrefillEndpoint(_memory("prefill", 7), stalling, options=opts) as prefill, \
            DecodeEndpoint(_memory("decode", 999), plain, options=opts) as decode:
        decode.connect(prefill.address)
        first = prefill.core.sessions[next(iter(prefill.core.sessions))].hello.session
        ended: list[tuple[str, str]] = []
        session_dead = prefill.core.liveness.session_dead

        def record(session: Any, error: KVFerryError) -> None:
            ended.append((session.hello.session, str(error)))
            session_dead(session, error)

        monkeypatch.setattr(prefill.core.liveness, "session_dead", record)
        prefill.send("a", SRC)
        decode.announce("a", PAGES)       # prefill posts the write from the drain that read this: 1.5 s stall
        with pytest.raises(RequestFailed):
            decode.wait("a", 5)           # silent past peer_timeout: declared dead, its pages quarantined
        assert stalling.resumed.wait(5)
        # Decode reconnected during the stall; prefill settles the quarantine over that session.
        _until(lambda: decode.num_quarantined_pages == 0, 5)
        # Not a fixed wait: until prefill has read decode's heartbeats on the re-made session for a whole
        # peer_timeout past the settle (its ticks ran meanwhile: a stale stamp would have ended it by then).
        settled = time.monotonic()
        _until(lambda: any(s.hello.session != first and s.clock.last_seen > settled + opts.peer_timeout
                           for s in list(prefill.core.sessions.values())), 5)
        assert prefill.address in decode.peers
        assert len(prefill.peers) == 1
        # Only the session decode itself gave up on may end for silence; the one it re-made during the
        # stall is judged from when it was read, never from before the stall.
        silent = [(who, why) for who, why in ended if who != first and "silent" in why]
        assert not silent, silent
    stalling.close()
    plain.close()


class _Core:
    """What ``prefill_liveness.Liveness`` reads of its core: options, messages out, effects, the probe count."""

    def __init__(self, options: EndpointOptions) -> None:
        self.options = options
        self.sent: list[Any] = []
        self.effects: list[Any] = []
        self.num_probes = 0

    def send_msg(self, session: Any, msg: Any) -> None:
        self.sent.append(msg)


def _session(now: float, opts: EndpointOptions) -> Any:
    return type("S", (), {"state": SessionState.ESTABLISHED, "clock": PeerClock(now, opts.heartbeat_interval,
                                                                                  opts.peer_timeout),
                          "probe": 0, "probe_deadline": 0.0, "identity": b"d", "label": "decode d"})()


def test_a_stall_after_the_silence_check_is_probed_at_the_tick_not_hidden_by_a_heartbeat() -> None:
    """The loop judged our silence at its start; a stall later in the same iteration (in a post, or the
    transport's progress call) is still seen at its tick: a probe goes out, not a plain heartbeat that
    would make the next check miss the stall while writes went on for a session decode may have dropped."""
    opts = EndpointOptions(heartbeat_interval=0.1, peer_timeout=0.5, transport_liveness=False)
    core = _Core(opts)
    session = _session(0.0, opts)
    session.clock.heard(0.9)                      # decode's heartbeats were read: decode is not silent
    Liveness(core).tick_session(session, 0.9)     # ... but we sent nothing for 0.9 s > peer_timeout
    assert session.probe == 1 and [type(m) for m in core.sent] == [wire.Heartbeat] and core.sent[0].probe == 1
    assert session.probe_deadline == 0.9 + opts.peer_timeout


def test_a_tick_within_our_own_heartbeats_sends_a_plain_heartbeat() -> None:
    opts = EndpointOptions(heartbeat_interval=0.1, peer_timeout=0.5, transport_liveness=False)
    core = _Core(opts)
    session = _session(0.0, opts)
    session.clock.heard(0.2)
    Liveness(core).tick_session(session, 0.2)
    assert session.probe == 0 and len(core.sent) == 1 and core.sent[0].probe == 0
