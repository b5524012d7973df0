"""Prefill's judgement of its decode peers over time: heartbeats, silence, and a session's end.

Part of ``core.prefill`` (no I/O), above ``timers`` and ``sessions``. A session is lost when decode is silent
past ``peer_timeout`` (or, with ``transport_liveness``, when its connection dropped). When *this* process was
silent that long (stopped, or only starved of CPU), decode may have declared us dead, or may not: the session
is probed (``Heartbeat(probe=n)``), nothing is posted for it until decode echoes ``n`` on the same connection,
and it ends if no echo comes within ``peer_timeout``. A dead session's requests fail, its writes in flight
finish (never cancelled blind), and its transport peer is forgotten only once none is in flight.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvferry.control import wire
from kvferry.control.core.base import FlushNow, RemovePeer, log
from kvferry.control.core.sessions import Session
from kvferry.control.core.states import RequestState, SessionState
from kvferry.errors import KVFerryError, PeerLost

if TYPE_CHECKING:
    from kvferry.control.core.prefill import PrefillCore

__all__ = ["Liveness"]


class Liveness:
    """Session liveness and endings."""

    def __init__(self, core: PrefillCore) -> None:
        self.core = core

    def tick_session(self, session: Session, now: float) -> None:
        core = self.core
        state = session.state
        if state is not SessionState.ESTABLISHED:
            if state is SessionState.CHALLENGED and now > session.deadline:
                core.sessions.pop(session.identity, None)
            return
        clock = session.clock
        if session.probe and now > session.probe_deadline and not self.still_held(session):
            self.session_dead(session, PeerLost(
                f"{session.label} did not answer within peer_timeout {core.options.peer_timeout} s after this "
                "prefill was silent that long (stopped or starved): it has declared us dead"))
        elif clock.peer_lost(now, self.connected_for(session)):
            self.session_dead(session, PeerLost(f"{session.label} silent for {clock.silent_for(now):.2f} s "
                                                f"(peer_timeout {core.options.peer_timeout} s)"))
        elif clock.we_were_silent(now):
            # A stall inside this iteration, after ``check_silence`` looked (in a post, a transport's progress
            # call): a plain heartbeat now would hide it from the next look, and writes would go on for a
            # session decode may have given up. Ask, as ``check_silence`` would have.
            self.probe(session, now)
        elif clock.heartbeat_due(now):
            core.send_msg(session, wire.Heartbeat(probe=session.probe))

    def probe(self, session: Session, now: float) -> None:
        """This process sent ``session`` nothing for longer than peer_timeout: decode may have declared us
        dead, or (its connection's ZMTP heartbeats answered by libzmq while our Python was starved) may not.
        Ask, and post nothing for the session until it answers this probe (``answered``). Every stall asks
        anew: an echo of an older probe says nothing about what decode decided during the last stall."""
        core = self.core
        core.num_probes += 1
        session.probe = core.num_probes
        session.probe_deadline = now + core.options.peer_timeout
        log.info("prefill: nothing sent to %s for %.2f s (peer_timeout %s s: this process stalled or was "
                 "starved); its writes wait for an answer to probe %d", session.label,
                 session.clock.unheard_for(now), core.options.peer_timeout, session.probe)
        core.send_msg(session, wire.Heartbeat(probe=session.probe))
        core.effects.append(FlushNow(session.identity))

    def held(self, session: Session, now: float) -> bool:
        """Whether posting for ``session`` must wait for decode's answer to a probe: one is out, or this
        process sent the session nothing for longer than peer_timeout (then the probe goes out now)."""
        if session.probe:
            return True
        if not session.clock.we_were_silent(now):
            return False
        self.probe(session, now)
        return True

    def answered(self, session: Session, echo: int) -> None:
        """Decode echoed ``echo``. The echo of the current probe proves decode held the session when it
        answered, after our probe left, and every message it sent before (a Fail, an Abort) has been read:
        the connection is ordered. The deferred posts go on, each checked again as it is posted."""
        if not session.probe or echo != session.probe:
            return   # an older probe's echo, or one we never asked for
        core = self.core
        session.probe = 0
        core.transfers.extend(session.parked)
        session.parked.clear()
        for rec in list(core.active):
            if rec.session is session and rec.pending:
                core.writer.post_ready(rec)
        core.changed = True

    def still_held(self, session: Session) -> bool:
        """Past its probe's deadline with no echo: whether decode certainly still holds ``session`` (a push
        session whose own connection stands, with libzmq's heartbeats answered, since decode was last heard).
        A decode gives a link up only by closing its connection (with transport_liveness it never does so on
        silence), and prefill's monitor names that drop; so a standing connection means decode is slow to
        echo (starved with us under the same load), not gone. Its writes stay held until the echo, bounded
        by request_timeout; the session ends once its connection drops and it is silent. Pull sessions keep
        the deadline (decode's own fence may have tripped)."""
        return session.mode == "push" and self.connected_for(session) is True

    def connected_for(self, session: Session) -> bool | None:
        """With ``transport_liveness``: True while neither its own connection nor one the shell could not name
        dropped since we last heard ``session`` (its own still stands, with libzmq's heartbeats answered);
        None (silence decides) otherwise. Another decode's connection, named, says nothing of this one."""
        core = self.core
        if not core.options.transport_liveness:
            return None
        return True if session.clock.last_seen > max(core.last_drop, session.dropped_at) else None

    def session_dead(self, session: Session, error: KVFerryError) -> None:
        """Fail the session's requests, forget the peer once no write to it is in flight; others go on."""
        core = self.core
        if not session.established:
            return
        # Best effort: a decode that still hears us learns it was dropped, and quarantines its leases.
        core.send_msg(session, wire.Bye(str(error)[:wire.MAX_REASON_LEN]))
        session.move(SessionState.DEAD)
        for transfer in session.parked:   # decided before a stall, never posted: nothing of them is in flight
            for queued in transfer.group:
                queued.rec.posting = False
        session.parked.clear()
        core.cold.discard(session)
        core.holds.after_death(session, core.now)
        for rec in list(core.active):
            if rec.session is session:
                # Decode's verdict may have come in the same frames as its goodbye (a batch, or one drain
                # of the socket): a request that decode verified whole is not lost. It settles DONE once
                # its writes complete (or fails if one does not); only what is still open fails. So does a
                # verified part of a request other decode ranks still owe a verdict on (decode TP >
                # prefill TP): the group decides (its other ranks, or the deadline).
                core.writer.settle(rec)
                if rec.state is RequestState.DONE:
                    continue
                if rec.is_live and rec.decode_ok and rec.last_posted:
                    continue
                core.fail_req(rec, error)
                # Writes still in flight are not cancelled blind: they finish (or fail), and decode keeps
                # the pages quarantined until we tell a reconnected decode they did.
                if not rec.handles and not rec.posting:
                    core.active.discard(rec)
                    core.dirty.discard(rec)
        core.sessions.pop(session.identity, None)
        core.handshake.note_sessions()
        core.unpeer.add(session.agent)
        self.forget_peers()
        core.changed = True

    def forget_peers(self) -> None:
        """Remove from the transport the decode agents no session uses and no write in flight targets
        (removing one under a write in flight could fail it halfway, with no word on what landed)."""
        core = self.core
        in_use = {s.agent for s in core.sessions.values()}
        core.unpeer -= in_use  # a session with that decode again: its own death will ask anew
        writing = {r.session.agent for r in core.active if (r.handles or r.posting) and r.session is not None}
        for agent in core.unpeer - writing:
            core.unpeer.discard(agent)
            core.effects.append(RemovePeer(agent))
