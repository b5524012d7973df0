"""Prefill's judgement of its decode peers over time: heartbeats, silence, and a session's end.

Part of ``core.prefill`` (no I/O), above ``timers`` and ``sessions``. A session is lost when decode is silent
past ``peer_timeout`` (or, with ``transport_liveness``, when its connection dropped), or when this process
was silent that long (a stall: decode has declared us dead). A dead session's requests fail, its writes in
flight finish (never cancelled blind), and its transport peer is forgotten only once none is in flight.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvferry.control import wire
from kvferry.control.core.base import RemovePeer
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
        if session.state is SessionState.CHALLENGED and now > session.deadline:
            core.sessions.pop(session.identity, None)
        elif not session.established:
            return
        elif session.suspect:
            self.session_dead(session, PeerLost(f"{session.label} heard nothing from this prefill for more than "
                                                f"peer_timeout {core.options.peer_timeout} s (this process "
                                                "stalled): it has declared us dead"))
        elif session.clock.peer_lost(now, self.connected_for(session)):
            self.session_dead(session, PeerLost(f"{session.label} silent for {session.clock.silent_for(now):.2f} s "
                                                f"(peer_timeout {core.options.peer_timeout} s)"))
        elif session.clock.heartbeat_due(now):
            core.send_msg(session, wire.Heartbeat())

    def connected_for(self, session: Session) -> bool | None:
        """With ``transport_liveness``: True while no connection dropped since we last heard ``session`` (its
        own still stands, with libzmq's heartbeats answered); None (silence decides) otherwise."""
        core = self.core
        if not core.options.transport_liveness:
            return None
        return True if session.clock.last_seen > core.last_drop else None

    def session_dead(self, session: Session, error: KVFerryError) -> None:
        """Fail the session's requests, forget the peer once no write to it is in flight; others go on."""
        core = self.core
        if not session.established:
            return
        # Best effort: a decode that still hears us learns it was dropped, and quarantines its leases.
        core.send_msg(session, wire.Bye(str(error)[:wire.MAX_REASON_LEN]))
        session.move(SessionState.DEAD)
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
