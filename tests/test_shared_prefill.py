"""Two decodes on one prefill (issue 49): one decode's dropped connection must not end the other's session.

Seen behind vllm-router at 2P2D under load (~18 on 2 cores): both decodes failed requests at the same
instant while neither prefill had crashed. Prefill's ROUTER serves every decode, and its socket monitor
reports that *a* connection dropped, not whose; before this fix every session not heard from since the last
drop fell back to the silence rule, so a decode whose Python was starved past ``peer_timeout`` (its libzmq
still answering: slow, not dead) was declared lost the moment *another* decode's connection dropped, and
its requests failed with it. Prefill now learns each connection's descriptor from the frames it reads
(``ZMQ_SRCFD``) and the monitor's event names the descriptor that dropped, so only the sessions on that
connection are judged by silence. A request fails only if its own transfer (its own connection) failed.

On the core's fake clock first (exact), then with real processes: decode B in a child process, starved of
the GIL for 4 x ``peer_timeout`` right after its announces; decode A, another child connected to the same
prefill, is killed meanwhile (its connection drops). B's requests must complete, byte for byte.
"""

from __future__ import annotations

import json
import time
from typing import Any

import numpy as np
import pytest

from kvferry import KVMemory
from kvferry.control import EndpointOptions, RequestState, wire
from kvferry.control.core.prefill import PrefillCore, PrefillSetup
from kvferry.control.core.prefill_requests import make_spec
from kvferry.control.core.process import ProcessIdentity
from kvferry.control.stats import NullRecorder
from kvferry.integrity import DigestMode

from .control_peer import make_layout

HB, PT = 0.1, 0.6
PAGES = {"main": np.array([3, 4]), "c4": np.array([1])}
SRC = {"main": np.array([10, 11]), "c4": np.array([5])}


class TwoDecodes:
    """A prefill core (transport_liveness on, the default) and two decodes, ``a`` and ``b``, on a fake clock.
    Writes are posted and settled at once; what each decode receives is kept per identity."""

    def __init__(self) -> None:
        self.t = 0.0
        self.src = KVMemory.allocate(make_layout("prefill"))
        self.dst = KVMemory.allocate(make_layout("decode"))
        self.options = EndpointOptions(heartbeat_interval=HB, peer_timeout=PT, request_timeout=600.0)
        setup = PrefillSetup("tcp://prefill", "local", "dlist", b"meta", ProcessIdentity("h", 1, 1), None,
                             frozenset({"push"}))
        self.core = PrefillCore(self.src, setup, self.options, DigestMode.OFF,
                                NullRecorder("prefill", self.src.layout), lambda n: bytes(n))
        self.inbox: dict[bytes, list[object]] = {}
        self.written: list[str] = []   # request ids, one per write posted for them

    def carry_out(self) -> None:
        from kvferry.control.core.base import AddPeer, FlushNow, RemovePeer

        from .core_shell import between_events

        def apply(effect: object) -> None:
            if isinstance(effect, AddPeer):
                self.core.peer_added(self.t, effect.peer, "agent-" + effect.peer.decode(), None)
            elif isinstance(effect, FlushNow):
                self.flush()
            elif not isinstance(effect, RemovePeer):
                raise AssertionError(effect)

        def posted(write: Any) -> None:
            self.written.extend(rec.request_id for rec in write.records)
            self.core.write_posted(write, id(write))
            self.core.write_settled(self.t, id(write), None)

        between_events(self.core, self.t, apply, self.core.start_write, posted, lambda w: w.records)
        self.core.settle_dirty(self.t)
        self.flush()

    def flush(self) -> None:
        for identity in list(self.core.outbox):
            for data in self.core.take_out(identity):
                msg = wire.decode(data)
                self.inbox.setdefault(identity, []).extend(wire.unbatch(msg) if isinstance(msg, wire.Batch) else [msg])
                self.core.frame_sent(self.t, identity)

    def frame(self, identity: bytes, msg: object) -> None:
        self.core.on_frame(self.t, identity, wire.encode(msg))
        self.carry_out()

    def connect(self, identity: bytes) -> None:
        hello = wire.Hello(identity.hex(), self.dst.manifest(), "local", b"m", bytes(32), "off", HB, "push", PT,
                           "h", 2, 2)
        self.frame(identity, hello)
        assert any(isinstance(m, wire.Welcome) for m in self.inbox.pop(identity))

    def request(self, identity: bytes, rid: str) -> None:
        self.frame(identity, wire.Announce(rid, 1, wire.encode_pages(PAGES)))
        self.core.send(self.t, rid, make_spec(self.src, SRC, 0, True, None), None)
        self.carry_out()

    def tick(self, t: float) -> None:
        self.t = t
        self.core.check_silence(t)
        self.carry_out()
        self.core.tick(t)
        self.carry_out()


@pytest.mark.parametrize("silence", [PT + 0.01, 5 * PT, 100.0])   # all below request_timeout
def test_a_drop_of_one_decodes_connection_leaves_a_starved_decode_alone(silence: float) -> None:
    peer = TwoDecodes()
    peer.connect(b"a")
    peer.connect(b"b")
    peer.request(b"a", "ra")
    peer.request(b"b", "rb")
    assert peer.core.records["rb"].state is RequestState.TRANSFERRING   # written; decode b's verdict to come
    # b's Python is starved from now on (not a frame from it, its connection up); a talks until its
    # connection drops, at PT / 2 (the monitor's event, named by the shell: a's descriptor).
    t = 0.0
    while t < silence:
        t = min(t + HB, silence)
        peer.tick(t)
        if t < PT / 2:
            peer.frame(b"a", wire.Heartbeat())
        elif t - HB < PT / 2:
            peer.core.connection_dropped(t, [b"a"])
        if t > 2 * PT:   # a, silent since its own drop, is lost within peer_timeout of it
            assert b"a" not in peer.core.sessions and peer.core.records["ra"].state is RequestState.FAILED
    peer.tick(silence + HB)
    assert b"b" in peer.core.sessions and peer.core.records["rb"].state is RequestState.TRANSFERRING
    peer.frame(b"b", wire.Result("rb", 1, True, ""))   # b runs again: its verdict completes its request
    peer.core.settle_dirty(peer.t)
    assert peer.core.records["rb"].state is RequestState.DONE


def test_a_drop_of_a_decodes_own_connection_still_ends_it_when_silent() -> None:
    """The other half: the connection that dropped is the silent decode's own: lost at the first tick."""
    peer = TwoDecodes()
    peer.connect(b"a")
    peer.connect(b"b")
    peer.request(b"b", "rb")
    peer.tick(PT + 0.05)   # b silent past peer_timeout: suspect only, its connection stands
    assert b"b" in peer.core.sessions
    peer.core.connection_dropped(peer.t, [b"b"])
    peer.tick(peer.t + 0.01)
    assert b"b" not in peer.core.sessions and peer.core.records["rb"].state is RequestState.FAILED


def test_an_unattributed_drop_keeps_the_old_rule() -> None:
    """A drop whose connection the shell cannot name (no descriptor known) makes every session not heard
    from since it suspect, as before: fail-closed where nothing better is known."""
    peer = TwoDecodes()
    peer.connect(b"b")
    peer.tick(PT + 0.05)
    peer.core.connection_dropped(peer.t)
    peer.tick(peer.t + 0.01)
    assert b"b" not in peer.core.sessions


def _probed(peer: TwoDecodes, identity: bytes) -> int:
    probes = [m.probe for m in peer.inbox.pop(identity, []) if isinstance(m, wire.Heartbeat) and m.probe]
    assert probes, f"no probe sent to {identity!r}"
    return probes[-1]


def _run(peer: TwoDecodes, until: float) -> None:
    """Prefill's loop ticking every heartbeat up to ``until`` (so it stalls no more), decode a talking."""
    while peer.t < until:
        peer.tick(min(peer.t + HB, until))
        peer.frame(b"a", wire.Heartbeat())


@pytest.mark.parametrize("dropped", [False, True])
def test_a_decode_starved_with_its_prefill_is_waited_for_past_the_probe(dropped: bool) -> None:
    """Prefill stalls past peer_timeout (its Python starved), so it probes each session and writes nothing
    until decode echoes; decode b, starved by the same load, echoes only later. Its connection stood all
    along (decode gives a link up only by closing it), so b still holds the session: prefill waits past the
    probe's deadline, posting nothing, and b's request completes once it echoes. With b's connection
    dropped (named by the shell), the probe's deadline ends the session as before (the control)."""
    peer = TwoDecodes()
    peer.connect(b"a")
    peer.connect(b"b")
    peer.frame(b"b", wire.Announce("rb", 1, wire.encode_pages(PAGES)))
    stall = 2 * PT
    peer.tick(stall)   # the first look after the stall: both sessions probed
    probe_a, probe_b = _probed(peer, b"a"), _probed(peer, b"b")
    peer.core.send(peer.t, "rb", make_spec(peer.src, SRC, 0, True, None), None)
    peer.carry_out()
    peer.frame(b"a", wire.Heartbeat(echo=probe_a))   # a answers at once
    if dropped:
        peer.core.connection_dropped(peer.t, [b"b"])
    _run(peer, stall + PT + HB)   # past b's probe deadline, b still silent; prefill runs (no new stall)
    assert peer.written == []    # nothing posted for b without its echo
    if dropped:
        assert b"b" not in peer.core.sessions and peer.core.records["rb"].state is RequestState.FAILED
        return
    assert b"b" in peer.core.sessions and peer.core.records["rb"].is_live
    _run(peer, stall + 10 * PT)   # however long b stays starved (within request_timeout)
    assert b"b" in peer.core.sessions and peer.written == [] and peer.core.sessions[b"b"].probe == probe_b
    peer.frame(b"b", wire.Heartbeat(echo=probe_b))   # b runs again: it still held the session
    assert peer.written == ["rb"]
    peer.frame(b"b", wire.Result("rb", 1, True, ""))
    peer.core.settle_dirty(peer.t)
    assert peer.core.records["rb"].state is RequestState.DONE


# -- processes: decode B starved, decode A's connection dropped, one prefill -----------------------------------
@pytest.mark.nixl
def test_a_starved_decode_survives_another_decodes_drop() -> None:
    """Prefill here, decodes A and B in child processes, both connected and with requests announced. B's
    Python is starved (a thread holding the GIL) for 4 x peer_timeout; meanwhile A is SIGKILLed, so its
    connection drops and prefill's monitor reports it. B's requests complete on both sides and every byte
    that arrived at B checks; A's fail (its own connection is gone). Without the fix, prefill declares B
    lost at A's drop and B's requests fail with it (measured: "decode ... silent for 1.0x s")."""
    pytest.importorskip("nixl")
    pytest.importorskip("kvferry.transport.nixl")
    from kvferry.control import PrefillEndpoint
    from kvferry.errors import RequestFailed

    from .control_peer import fill, run_prefill, wait_all, workload
    from .test_control_nixl import SEED, TIMEOUTS, Peer

    timeouts = {**TIMEOUTS, "transport_liveness": True}
    src = KVMemory.allocate(make_layout("prefill"))
    fill(src, SEED)
    prefill = PrefillEndpoint(src, "nixl", options=EndpointOptions(**timeouts))
    a = Peer("decode", options=timeouts)
    b = Peer("decode", options=timeouts)
    try:
        a("connect", address=prefill.address)
        b("connect", address=prefill.address)
        reqs_a = workload(3, seed=21, prefix="a")
        reqs_b = workload(4, seed=22, prefix="b")
        a("announce", n=3, seed=21, prefix="a")
        b("announce", n=4, seed=22, prefix="b")
        # The hog's thread takes the GIL before B's reply can leave: ask without waiting for the answer.
        assert b.proc.stdin is not None
        b.proc.stdin.write(json.dumps({"op": "hog", "seconds": 4 * timeouts["peer_timeout"]}) + "\n")
        b.proc.stdin.flush()
        time.sleep(0.3)
        a.kill()   # A's process is gone: its connection drops (the monitor's event) while B is silent
        time.sleep(2 * timeouts["peer_timeout"])   # B silent past peer_timeout by now, its connection up
        assert "calls" in b._next(30)   # the hog ended: B runs again
        failed_a = []
        try:
            run_prefill(prefill, reqs_a)
        except RequestFailed:   # A's session is gone: its requests fail, as they must
            failed_a.append(True)
        run_prefill(prefill, reqs_b)   # raises if B's session was ended (the bug)
        results = wait_all(prefill, [r.rid for r in reqs_b], 30)
        assert set(results.values()) == {"done"}, results
        assert set(b("wait_all")["results"].values()) == {"done"}
        b("verify")   # every byte that arrived at B, checked against the source's fill
        ended_a = wait_all(prefill, [r.rid for r in reqs_a], 30)
        assert failed_a or all(v != "done" for v in ended_a.values()), ended_a
    finally:
        b.close()
        a.close()
        prefill.close()


@pytest.mark.nixl
def test_a_prefill_and_its_decode_starved_together_finish_their_requests() -> None:
    """Both sides starved by the same load: prefill (a child) holds its GIL for 4 x peer_timeout, so on
    resuming it probes decode; decode (another child) is starved from before that until well past the
    probe's deadline. Decode's connection stood throughout (libzmq answered), so prefill waits for the echo
    instead of ending the session, and every request completes, byte for byte. Without the wait the probe's
    deadline ended the session and every request failed ("did not answer within peer_timeout")."""
    pytest.importorskip("nixl")
    pytest.importorskip("kvferry.transport.nixl")
    from .test_control_nixl import TIMEOUTS, Peer

    timeouts = {**TIMEOUTS, "transport_liveness": True}
    pt = timeouts["peer_timeout"]
    prefill = Peer("prefill", options=timeouts)
    decode = Peer("decode", options=timeouts)

    def ask(peer: Peer, **cmd: Any) -> None:   # without waiting: the hog's thread holds the reply back
        assert peer.proc.stdin is not None
        peer.proc.stdin.write(json.dumps(cmd) + "\n")
        peer.proc.stdin.flush()

    try:
        decode("connect", address=prefill.address)
        decode("announce", n=4, seed=21)
        ask(prefill, op="hog", seconds=4 * pt)
        ask(prefill, op="serve", n=4, seed=21, timeout=60)   # read once the hog lets go
        time.sleep(1.5 * pt)
        ask(decode, op="hog", seconds=8 * pt)   # starved from before prefill's probe to past its deadline
        assert "calls" in prefill._next(30)
        assert prefill._next(60) == {"ok": True}, "prefill's sends failed: its session with decode ended"
        assert "calls" in decode._next(30)
        assert set(decode("wait_all")["results"].values()) == {"done"}
        decode("verify")   # every byte that arrived, checked against the source's fill
    finally:
        decode.close()
        prefill.close()
