"""Prefill's writes: which chunk goes where, when a write may still be posted, and how a request settles.

Part of ``core.prefill`` (no I/O), above ``prefill_requests``, ``coverage``, ``digests``, ``holds`` and
``write_batch``. A queued chunk is planned (or its plan from ``send`` reused), digested and queued as a
write (push) or offered as a ``Ready`` (pull); right before the shell posts it, the session must still be
alive by our own clock and the request current (``check_current``). A failed request tells decode at once
(unsettled) and again, settled, once no write of it can still land.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from kvferry.control import wire
from kvferry.control.core.base import FlushNow
from kvferry.control.core.coverage import cover
from kvferry.control.core.digests import chunk_digests
from kvferry.control.core.page_sizes import chunk_spans, cover_tokens
from kvferry.control.core.prefill_requests import ChunkSpec, PrefillRequest, chunk_pairs, group_done, past_prefix
from kvferry.control.core.sessions import Session
from kvferry.control.core.states import RequestState
from kvferry.control.core.write_batch import Queued, joinable
from kvferry.errors import KVFerryError, PeerLost

if TYPE_CHECKING:
    from kvferry.control.core.prefill import PrefillCore

__all__ = ["Writer"]


class Writer:
    """Deciding and settling writes (and pull-mode offers)."""

    def __init__(self, core: PrefillCore) -> None:
        self.core = core

    def post_ready(self, rec: PrefillRequest) -> None:
        session = rec.session
        if session is None or not session.established:
            return
        if self.core.liveness.held(session, self.core.now):
            return   # decode may have given up on us during a stall: the chunks wait for its answer
        while rec.pending and rec.is_live:
            spec = rec.pending.popleft()
            try:
                self.post_chunk(rec, spec)
            except KVFerryError as exc:
                self.core.fail_req(rec, exc)

    def post_chunk(self, rec: PrefillRequest, sent: ChunkSpec) -> None:
        core = self.core
        session = rec.session
        assert session is not None and session.remote is not None
        translator = session.translator
        if translator is not None:   # page sizes differ: the chunk's tokens, past decode's prefix
            spans = chunk_spans(translator, rec, sent)
            if spans is None:
                return   # wholly inside decode's prefix: nothing moves, and no chunk is counted
            spec = sent
            pairs = {pool: (span.src_pages, span.dst_pages) for pool, span in spans.items()}
            plan = translator.plan(spans, spec.buffer_ids)
            cover_tokens(core.memory.layout, translator, rec, spec, spans)
            positions = {pool: translator.position(pool, span) for pool, span in spans.items()}
        else:
            spec = past_prefix(rec, sent)
            if spec is None:
                return   # wholly inside decode's prefix: nothing moves, and no chunk is counted
            planned = spec.planned
            if planned is not None and planned.matches(rec):
                pairs, plan = planned.pairs, planned.plan
            else:
                pairs = chunk_pairs(rec.request_id, rec.dst, spec)
                plan = core.plan(session, pairs, spec.buffer_ids)
            cover(core.memory.layout, rec, spec)
            positions = {pool: spec.offsets[pool] for pool in pairs}
        index = rec.next_chunk
        rec.next_chunk += 1
        mode = core.digest_mode.stronger(session.digest_mode)
        digests = chunk_digests(mode, spec.digests, pairs, plan, rec.generation, index)
        chunk = wire.Chunk(rec.request_id, rec.generation, index, spec.last, rec.next_chunk if spec.last else 0,
                           digests)
        self.check_current(rec, session)
        if session.mode == "pull":
            self.offer(rec, session, spec, pairs, positions, chunk)   # decode reads it: this side writes nothing
        else:
            queued = Queued(rec, plan, wire.encode(chunk), f"{rec.request_id}#{index}")
            if core.batches.wanted() and core.options.batch_chunks > 1 and joinable(plan):
                # Posted once the calls, or the messages, of this iteration ran: with what else is ready.
                rec.posting = True
                core.batches.add(session, queued)
            else:
                core.queue_transfer(session, [queued], [rec])
        core.dirty.add(rec)
        rec.last_posted = spec.last
        if rec.is_live and rec.state is not RequestState.TRANSFERRING:
            core.set_state(rec, RequestState.TRANSFERRING)

    def offer(self, rec: PrefillRequest, session: Session, spec: ChunkSpec,
              pairs: dict[str, tuple[np.ndarray, np.ndarray]], positions: dict[str, int], chunk: wire.Chunk) -> None:
        """Pull mode: tell decode the chunk's source pages are ready (instead of writing them); hold them.
        ``positions``: per pool, where decode's read begins (``wire.Ready``'s offsets)."""
        core = self.core
        src = {pool: pages for pool, (pages, _) in pairs.items()}
        ready = wire.Ready(rec.request_id, rec.generation, chunk.chunk, chunk.last, chunk.num_chunks,
                           wire.encode_pages(src), {pool: positions[pool] for pool in src},
                           list(spec.buffers or ()), chunk.digests)
        core.holds.hold(rec)
        if not session.read_once:
            core.cold.add(session)
        core.send_msg(session, ready)
        if len(core.outbox[session.identity]) == 1:
            # The first of this iteration leaves at once (decode may be idle, waiting for it); the rest
            # follow together at the iteration's end.
            core.effects.append(FlushNow(session.identity))

    def check_current(self, rec: PrefillRequest, session: Session) -> None:
        """Right before a write: the session is alive by our own clock and the request still current.

        Not the fence (a stall right after this check still posts; decode's quarantine keeps those pages
        from any other request until we settle), but it keeps a prefill that resumes from a stall from
        writing for a decode that has long given up on it."""
        # Judged by what decode heard from us (its peer_timeout runs from our last message), not by what
        # we heard from it: frames it sent before giving up on us may still be queued here.
        core = self.core
        now = core.now
        unheard = session.clock.unheard_for(now)
        if not session.established or session.probe or session.clock.we_were_silent(now):
            raise PeerLost(f"{session.label} heard nothing from this prefill for {unheard:.2f} s (peer_timeout "
                           f"{core.options.peer_timeout} s) and has declared it dead: not writing request "
                           f"{rec.request_id!r}")
        # Live is current: a record's session is set once, when it is announced, and changes only after it
        # ended (an Abort answered on a reconnected decode's session), and every transfer is queued under its
        # record's session at the time; so a live record's is always the transfer's (docs/fencing.md, "One
        # check, not two").
        if not rec.is_live:
            raise PeerLost(f"request {rec.request_id!r} generation {rec.generation} is no longer current")

    def still_current(self, rec: PrefillRequest, session: Session) -> bool:
        rec.posting = False
        try:
            self.check_current(rec, session)
        except KVFerryError as exc:
            self.core.fail_req(rec, exc)   # a no-op for a record that failed meanwhile; either way it settles
            return False
        rec.posting = True
        return True

    def settle(self, rec: PrefillRequest) -> None:
        """With no write in flight: finish, or tell decode the failure is settled; then forget it."""
        core = self.core
        if rec.handles or rec.posting:   # posting: a chunk queued for this iteration's write
            return
        if rec.is_live and rec.last_posted and rec.decode_ok and group_done(rec):
            core.set_state(rec, RequestState.DONE)
            if rec.leader is not rec:
                core.dirty.add(rec.leader)  # the leader may be waiting for this decode rank only
        if not rec.is_live:
            rec.history = None
        session = rec.session
        if (rec.state is RequestState.FAILED and not rec.fail_sent and session is not None
                and session.established):
            self.send_fail(rec, settled=True)
            rec.fail_sent = True
        if (not rec.is_live and not rec.handles and not rec.source_held
                and (rec.fail_sent or rec.state is RequestState.DONE or session is None
                     or not session.established)):
            core.active.discard(rec)

    def send_fail(self, rec: PrefillRequest, *, settled: bool) -> None:
        core = self.core
        session = rec.session
        if session is None or not session.established:
            return
        err = rec.error or KVFerryError("failed")
        # This endpoint closing is, to decode, its peer leaving: its waiters get PeerLost, as after a Bye.
        kind = "peer_lost" if err is core.close_error else wire.error_kind(err)
        core.send_msg(session, wire.Fail(rec.request_id, rec.generation, str(err)[:wire.MAX_REASON_LEN], kind,
                                         settled))

    def release_source(self, rec: PrefillRequest) -> None:
        """Decode is done with the record's source pages (pull mode), or can no longer accept what it reads."""
        core = self.core
        if core.holds.release(rec):
            core.dirty.add(rec)   # the record may now be forgotten (settle)
            core.changed = True

    def fail_one(self, rec: PrefillRequest, error: KVFerryError) -> None:
        core = self.core
        failed_now = core.fail(rec, error)
        rec.pending.clear()
        core.active.add(rec)   # keep it until its writes settle and decode is told
        core.dirty.add(rec)
        if failed_now and rec.handles and rec.session is not None:
            # Tell decode at once (it must not report DONE for a request we failed), but unsettled: the
            # pages stay leased until the settled Fail follows. A chunk notification that beats this
            # message to decode may still complete the request there, with verified bytes.
            core.call_soon(lambda: self.send_fail(rec, settled=False))
        core.wake_wanted = True
