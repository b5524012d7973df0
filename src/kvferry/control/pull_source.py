"""Prefill's half of pull mode: offer ready pages to decode, and hold them until decode is done with them.

Part of the control plane, above ``pull``, ``sessions`` and ``prefill_requests``, below ``prefill``
(``PrefillEndpoint`` mixes ``PullSource`` in; everything here runs under the endpoint's lock). In pull mode a
chunk becomes a ``Ready`` message instead of a write: prefill never touches decode's memory. Decode reads the
pages itself, so prefill must not reuse them while decode may still read them and accept what it read: the
record's *source hold* (``holds_source``) lasts until one of

* decode's ``Result`` for the generation (ok: it read and verified everything; not ok: it failed it),
* decode's ``Abort`` for it (decode failed the request, or acknowledges prefill's own failure),
* ``pull.source_hold_s`` after prefill declared the session dead (decode, fenced by its own clock, accepts
  no read that late: docs/fencing.md), or as soon as the session is dead and decode's process (named in its
  Hello) is certainly gone on this host, or this endpoint's ``close``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvferry.control import wire
from kvferry.control.liveness import is_gone
from kvferry.control.prefill_requests import ChunkSpec, PrefillRequest
from kvferry.control.pull import source_hold_s
from kvferry.control.sessions import Session

__all__ = ["PullSource"]


class PullSource:
    """Mixed into ``PrefillEndpoint`` (after ``EndpointBase`` in its bases): offering chunks and the source
    holds. Relies on the endpoint's ``_send``, ``_send_now``, ``_outbox``, ``_dirty``, ``options`` and lock."""

    _holds: set[PrefillRequest]
    _cold: set[Session]
    _dirty: set[PrefillRequest]
    _outbox: dict[Any, list[bytes]]
    options: Any
    _next_gone_check = 0.0

    def _offer(self, rec: PrefillRequest, session: Session, spec: ChunkSpec,
               pairs: dict[str, tuple[np.ndarray, np.ndarray]], chunk: wire.Chunk) -> None:
        """Tell decode the chunk's source pages are ready (instead of writing them); hold them from now."""
        src = {pool: pages for pool, (pages, _) in pairs.items()}
        ready = wire.Ready(rec.request_id, rec.generation, chunk.chunk, chunk.last, chunk.num_chunks,
                           wire.encode_pages(src), {pool: spec.offsets[pool] for pool in src},
                           list(spec.buffers or ()), chunk.digests)
        rec.source_held, rec.release_at = True, None
        self._holds.add(rec)
        if not session.read_once:
            self._cold.add(session)
        self._send(session, ready)
        if len(self._outbox[session.identity]) == 1:
            # The first of this iteration leaves at once (decode may be idle, waiting for it); the rest
            # follow together at the iteration's end.
            self._send_now(session.identity, b"")

    def _release_source(self, rec: PrefillRequest) -> None:
        """Decode is done with the record's source pages (or can no longer accept what it reads)."""
        if not rec.source_held:
            return
        rec.source_held, rec.release_at = False, None
        self._holds.discard(rec)
        self._dirty.add(rec)   # the record may now be forgotten (_settle)
        self._changed = True

    def _hold_after_death(self, session: Session, now: float) -> None:
        """``session`` was declared dead: its holds end ``source_hold_s`` from now, unless answered first
        or its decode process is certainly gone (a process that no longer exists accepts nothing)."""
        until = now + source_hold_s(self.options.peer_timeout, session.peer_timeout, self.options.lease_grace)
        for rec in self._holds:
            if rec.session is session and rec.release_at is None:
                rec.release_at = until

    def _tick_holds(self, now: float) -> None:
        gone: dict[Session, bool] = {}
        for rec in list(self._holds):
            if rec.release_at is None:
                continue
            session = rec.session
            if session is not None and session not in gone and now >= self._next_gone_check:
                gone[session] = session.process is not None and is_gone(session.process) is True
            if now >= rec.release_at or gone.get(session, False):  # type: ignore[arg-type]
                self._release_source(rec)
        if gone:
            self._next_gone_check = now + 0.05   # /proc reads: a few per dead session, 20 times a second

    def _held_for(self, session: Session, request_id: str, generation: int) -> PrefillRequest | None:
        """A held record of this (request, generation) for ``session``'s decode agent, in any session."""
        for rec in self._holds:
            old = rec.session
            if (rec.request_id == request_id and rec.generation == generation and old is not None
                    and old.agent == session.agent):
                return rec
        return None

    def _release_all(self) -> None:
        for rec in list(self._holds):
            self._release_source(rec)
