"""Prefill's half of pull mode: the source holds (which records' pages decode may still read, and until when).

Part of the protocol core (no I/O), above ``pull``, ``sessions`` and ``prefill_requests``, below
``core.prefill``. In pull mode a chunk becomes a ``Ready`` message instead of a write: prefill never touches
decode's memory. Decode reads the pages itself, so prefill must not reuse them while decode may still read
them and accept what it read: the record's *source hold* (``holds_source``) lasts until one of

* decode's ``Result`` for the generation (ok: it read and verified everything; not ok: it failed it),
* decode's ``Abort`` for it (decode failed the request, or acknowledges prefill's own failure),
* ``pull.source_hold_s`` after prefill declared the session dead (decode, fenced by its own clock, accepts
  no read that late: docs/fencing.md), or as soon as the session is dead and decode's process (named in its
  Hello) is certainly gone on this host (the shell answers ``CheckProcess``), or this endpoint's ``close``.
"""

from __future__ import annotations

import math

from kvferry.control.core.ordered import OrderedSet
from kvferry.control.core.prefill_requests import PrefillRequest
from kvferry.control.core.process import ProcessIdentity
from kvferry.control.core.sessions import Session
from kvferry.control.pull import source_hold_s

__all__ = ["SourceHolds"]

# How often the process table is asked about a dead session's decode (CheckProcess): 20 times a second.
GONE_CHECK_S = 0.05


class SourceHolds:
    """The records whose source pages decode may still read (``held``), and when each hold ends."""

    def __init__(self, peer_timeout: float, lease_grace: float) -> None:
        self.peer_timeout = peer_timeout
        self.lease_grace = lease_grace
        self.held: OrderedSet[PrefillRequest] = OrderedSet()
        self.next_gone_check = 0.0

    def __len__(self) -> int:
        return len(self.held)

    def hold(self, rec: PrefillRequest) -> None:
        rec.source_held, rec.release_at = True, None
        self.held.add(rec)

    def release(self, rec: PrefillRequest) -> bool:
        """Decode is done with the record's source pages (or can no longer accept what it reads); False
        when they were not held."""
        if not rec.source_held:
            return False
        rec.source_held, rec.release_at = False, None
        self.held.discard(rec)
        return True

    def after_death(self, session: Session, now: float) -> None:
        """``session`` was declared dead: its holds end ``source_hold_s`` from now, unless answered first
        or its decode process is certainly gone (a process that no longer exists accepts nothing)."""
        until = now + source_hold_s(self.peer_timeout, session.peer_timeout, self.lease_grace)
        for rec in self.held:
            if rec.session is session and rec.release_at is None:
                rec.release_at = until

    def due(self, now: float) -> tuple[list[PrefillRequest], list[ProcessIdentity]]:
        """The holds that end at ``now``, and the processes to ask about (dead sessions' decodes, at most
        every ``GONE_CHECK_S``)."""
        ended: list[PrefillRequest] = []
        ask: dict[ProcessIdentity, None] = {}
        check = now >= self.next_gone_check
        for rec in self.held:
            if rec.release_at is None:
                continue
            if now >= rec.release_at:
                ended.append(rec)
            elif check and rec.session is not None and rec.session.process is not None:
                ask[rec.session.process] = None
        if ask:
            self.next_gone_check = now + GONE_CHECK_S
        return ended, list(ask)

    def of_process(self, process: ProcessIdentity) -> list[PrefillRequest]:
        """Dead sessions' holds whose decode is ``process`` (certainly gone: they end now)."""
        return [rec for rec in self.held if rec.release_at is not None and rec.session is not None
                and rec.session.process == process]

    def held_for(self, session: Session, request_id: str, generation: int) -> PrefillRequest | None:
        """A held record of this (request, generation) for ``session``'s decode agent, in any session."""
        for rec in self.held:
            old = rec.session
            if (rec.request_id == request_id and rec.generation == generation and old is not None
                    and old.agent == session.agent):
                return rec
        return None

    def next_deadline(self) -> float:
        """When the earliest timed hold ends (``math.inf``: none runs)."""
        earliest = math.inf
        for rec in self.held:
            t = rec.release_at
            if t is not None and t < earliest:
                earliest = t
        return earliest
