"""Decode's judgement of its prefill links over time, its requests' deadlines, and the quarantine's checks.

Part of ``core.decode`` (no I/O), above ``timers``, ``links`` and ``quarantine``. A link is lost when prefill
is silent past ``peer_timeout`` (or its connection dropped); its requests fail and their pages stay
quarantined. No timer alone ends a quarantine: the shell is asked whether the writer is certainly gone
(``CheckWriter``), and only then does ``lease_grace`` run.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvferry.control import wire
from kvferry.control.core.base import RemovePeer
from kvferry.control.core.decode_effects import QUARANTINE_CHECK_S, CheckWriter
from kvferry.control.core.links import Link
from kvferry.control.core.states import LinkState
from kvferry.errors import (
    HandshakeError,
    KVFerryError,
    PeerLost,
    TransferTimeout,
)

if TYPE_CHECKING:
    from kvferry.control.core.decode import DecodeCore

__all__ = ["Liveness"]


class Liveness:
    """Link liveness, request deadlines and the quarantine's checks."""

    def __init__(self, core: DecodeCore) -> None:
        self.core = core

    def connected(self) -> bool | None:
        """What ``PeerClock.peer_lost`` is told of an established link's connection: True with
        ``transport_liveness`` (a connection still standing has answered libzmq's heartbeats within
        ``peer_timeout``; a dropped one has already ended the link), None without (silence decides)."""
        return True if self.core.options.transport_liveness else None

    def tick_link(self, link: Link, now: float) -> None:
        core = self.core
        state = link.state
        if state is not LinkState.ESTABLISHED:
            if state is LinkState.CONNECTING and now > link.deadline:
                core.handshake.link_failed(link, HandshakeError(
                    f"no handshake answer from prefill {link.address} within the deadline (if something answers "
                    f"at that address, its answer may exceed max_message_bytes={core.options.max_message_bytes})"))
            return
        clock = link.clock
        if clock.peer_lost(now, self.connected()):
            self.link_dead(link, PeerLost(f"prefill {link.address} silent for {clock.silent_for(now):.2f} s "
                                          f"(peer_timeout {core.options.peer_timeout} s)"))
        elif clock.heartbeat_due(now):
            core.send(link, wire.Heartbeat())

    def tick_requests(self, now: float) -> None:
        core = self.core
        first = core.earliest_live()
        if first is not None and now > first:   # else no live deadline passed: nothing to sweep
            for rec in list(core.by_gen.values()):
                if rec.is_live and now > rec.deadline:
                    core.fail_req(rec, TransferTimeout(f"request {rec.request_id!r} not done within "
                                                       f"{core.options.request_timeout} s"), "decode deadline passed")
        if core.quarantine.num_leases and now >= core.next_quarantine_check:
            core.next_quarantine_check = now + QUARANTINE_CHECK_S
            self.check_quarantine(now)

    def check_quarantine(self, now: float) -> None:
        """A part whose link is gone leaves quarantine ``lease_grace`` after its writer is certainly gone
        (the shell answers ``CheckWriter``); while it may still write, decode keeps reconnecting to it to ask
        for its acknowledgement (``writer_checked``)."""
        core = self.core
        ask: dict[Link, None] = {}
        for rec in list(core.by_gen.values()):
            for part in list(rec.parts.values()):
                link = part.link
                if part.settled or link.established:
                    continue
                if part.grace.needs_check:
                    ask[link] = None
                elif part.grace.due(now):
                    core.messages.settle(rec, part)
        core.effects.extend(CheckWriter(link) for link in ask)

    def link_dead(self, link: Link, error: KVFerryError) -> None:
        """Fail the requests the link writes (and abort them on the other ranks writing them). Their
        pages stay quarantined until that prefill settles them (after a reconnect) or is certainly gone."""
        core = self.core
        if not link.established:
            return
        link.move(LinkState.DEAD)
        link.error = error
        for rec in list(core.by_gen.values()):
            part = rec.parts.get(link)
            if part is not None and not part.settled:
                core.fail_req(rec, error, f"prefill rank {link.rank} ({link.address}) is lost")
        core.handshake.close_link(link)
        if core.by_agent.get(link.agent) is link:
            core.by_agent.pop(link.agent)
        core.effects.append(RemovePeer(link.agent))   # the peer is gone either way
        core.changed = True
