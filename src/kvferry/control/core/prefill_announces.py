"""Prefill's requests as decode announces, verifies, aborts and cancels them, and as the engine sends them.

Part of ``core.prefill`` (no I/O), above ``prefill_requests``. An announce is checked (pages, prefix,
binding, whether prefill ever issued the id) and matched with the engine's ``send`` (either may come
first); across TP several decode ranks join one request group. Decode's Result, Abort and Cancel end what
they name; the writes themselves are ``prefill_writer``'s.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

import numpy as np

from kvferry.control import wire
from kvferry.control.core.prefill_requests import ChunkSpec, PrefillRequest, can_join, num_decode_ranks
from kvferry.control.core.sessions import Session
from kvferry.control.core.states import RequestState
from kvferry.errors import (
    IntegrityError,
    KVFerryError,
    PeerLost,
    PlanError,
    ProtocolError,
    RequestAborted,
    UnknownRequest,
    UsageError,
)
from kvferry.integrity.binding import Binding, check_binding
from kvferry.plan.pages import validate_pages
from kvferry.plan.prefix import check_prefix

if TYPE_CHECKING:
    from kvferry.control.core.prefill import PrefillCore

__all__ = ["Announces"]


class Announces:
    """Matching announces with sends, and the messages that end requests."""

    def __init__(self, core: PrefillCore) -> None:
        self.core = core

    def on_message(self, session: Session, msg: Any) -> None:
        if isinstance(msg, wire.Announce):
            self.on_announce(session, msg)
        elif isinstance(msg, wire.Result):
            self.on_result(session, msg)
        elif isinstance(msg, wire.Abort):
            self.on_abort(session, msg)
        elif isinstance(msg, wire.Cancel):
            self.on_cancel(session, msg)
        elif isinstance(msg, wire.Bye):
            self.core.liveness.session_dead(session, PeerLost(f"{session.label} left: {msg.reason}"))
        elif isinstance(msg, wire.Heartbeat):
            if msg.echo:
                self.core.liveness.answered(session, msg.echo)
        else:
            raise ProtocolError(f"unexpected {type(msg).__name__} from {session.label}")

    def on_announce(self, session: Session, msg: wire.Announce) -> None:
        core = self.core
        if msg.generation <= session.last_generation:
            # Not answered: a Fail names the generation, and this one may be live (the copy of an announce
            # being written) or ended, its pages since leased again; either way nothing new is asked.
            raise ProtocolError(f"announce of {msg.request_id!r} generation {msg.generation} from "
                                f"{session.label}: not above its last, {session.last_generation} (a copy)")
        session.last_generation = msg.generation
        try:
            dst = self.check_announce(session, msg)
            prefix = check_prefix(session.remote.layout, msg.prefix, f"announce from {session.label}")
        except KVFerryError as exc:
            self.refuse(session, msg, exc)
            return
        theirs = wire.announced_binding(msg)
        rec = core.records.get(msg.request_id)
        unknown = self.unissued(msg.request_id, cast("PrefillRequest | None", rec))
        if unknown is not None:
            self.refuse(session, msg, unknown)
            return
        if isinstance(rec, PrefillRequest):
            error = check_binding(msg.request_id, theirs, rec.leader.binding)
            if error is not None:   # refused before any byte moves, on both sides
                if rec.is_live and rec.session is None:
                    core.fail_req(rec, error)
                self.refuse(session, msg, error)
                return
        if isinstance(rec, PrefillRequest) and rec.is_live and rec.session is not None:
            if not can_join(rec, session):
                self.refuse(session, msg, PlanError(f"request {msg.request_id!r} is already announced and live"))
                return
            self.join(rec, session, msg.generation, dst, prefix)
            rec.group[-1].decode_binding = theirs
            self.post_and_ack(rec.group[-1], msg)
            return
        if isinstance(rec, PrefillRequest) and rec.state is RequestState.FAILED and rec.session is None:
            self.refuse(session, msg, rec.error or KVFerryError("failed before it was announced"))
            return
        if not isinstance(rec, PrefillRequest) or not rec.is_live:
            rec = self.new_request(msg.request_id, RequestState.WAITING_FOR_INPUT)
        self.bind(rec, session, msg.generation, dst, prefix)
        rec.decode_binding = theirs
        self.post_and_ack(rec, msg)

    def post_and_ack(self, rec: PrefillRequest, msg: wire.Announce) -> None:
        """Post what is queued; acknowledge only when nothing was: a posted chunk's notification tells
        decode as much, and one ZMQ message fewer per request is CPU saved on both sides."""
        core = self.core
        core.writer.post_ready(rec)
        if rec.next_chunk == 0 and rec.is_live and rec.session is not None:
            core.send_msg(rec.session, wire.Ack(msg.request_id, msg.generation))

    def check_announce(self, session: Session, msg: wire.Announce) -> dict[str, np.ndarray]:
        assert session.remote is not None
        # Decode's own lease table checked these; a peer's pages are untrusted input all the same.
        return validate_pages(session.remote.layout, "destination", wire.decode_pages(msg.pages), PlanError,
                              unique=True)

    def refuse(self, session: Session, msg: wire.Announce, error: KVFerryError) -> None:
        # Nothing was or will be written under this generation, so decode may free the pages at once.
        self.core.send_msg(session, wire.Fail(msg.request_id, msg.generation, str(error)[:wire.MAX_REASON_LEN],
                                         wire.error_kind(error), True))

    def on_result(self, session: Session, msg: wire.Result) -> None:
        core = self.core
        rec = self.match(session, msg.request_id, msg.generation)
        # Pull mode: decode reads no more of it, whatever its verdict. Looked up among the holds too, as for
        # an Abort: a record no longer the request id's current one (another decode rank's late announce, or a
        # retry, made a new one meanwhile) still holds its pages until this verdict.
        held = rec if rec is not None else core.holds.held_for(session, msg.request_id, msg.generation)
        if held is not None:
            core.writer.release_source(held)
        if rec is None:
            return
        if not session.read_once:
            session.read_once = True
            core.cold.discard(session)
        if msg.ok:
            rec.decode_ok = True
            core.dirty.add(rec)
        else:
            core.fail_req(rec, IntegrityError(f"{session.label} rejected the bytes: {msg.reason}"))

    def on_abort(self, session: Session, msg: wire.Abort) -> None:
        core = self.core
        held = core.holds.held_for(session, msg.request_id, msg.generation)
        if held is not None:  # pull mode: decode reads no more of it (it failed it, or acknowledges our Fail)
            core.writer.release_source(held)
        rec = self.match(session, msg.request_id, msg.generation) or self.in_flight(session, msg)
        if rec is None:  # no write of this generation is in flight, from any session with this decode
            core.send_msg(session, wire.Fail(msg.request_id, msg.generation, "unknown request or settled", "error",
                                             True))
            return
        core.fail_req(rec, RequestAborted(f"aborted by {session.label}: {msg.reason}"))
        rec.session = session  # a reconnected decode asking about its old session: answer on this one
        rec.fail_sent = False  # decode waits for a settled Fail for this generation, even a repeated one
        core.active.add(rec)
        core.dirty.add(rec)

    def on_cancel(self, session: Session, msg: wire.Cancel) -> None:
        """Decode will never announce the request: fail it now (a record not yet announced by any decode),
        or remember the failure for a ``send`` still to come. A record another decode announced is not
        this decode's to end."""
        core = self.core
        rec = core.records.get(msg.request_id)
        if isinstance(rec, PrefillRequest) and rec.is_live and rec.session not in (None, session):
            return
        if not isinstance(rec, PrefillRequest) or not rec.is_live:
            if rec is not None:
                return   # ended already: nothing held for it
            rec = self.new_request(msg.request_id, RequestState.BOOTSTRAPPING)
        core.fail_req(rec, RequestAborted(f"cancelled by {session.label} before it announced the request: "
                                          f"{msg.reason}"))

    def in_flight(self, session: Session, msg: wire.Abort) -> PrefillRequest | None:
        """A record still writing this generation to this decode (its agent), in any session: an older
        session's, or an older incarnation of the request id that ``match`` does not see."""
        for rec in self.core.active:
            old = rec.session
            if ((rec.handles or rec.posting) and rec.request_id == msg.request_id and rec.generation == msg.generation
                    and old is not None and old.agent == session.agent):
                return rec
        return None

    def match(self, session: Session, request_id: str, generation: int) -> PrefillRequest | None:
        rec = self.core.records.get(request_id)
        for member in rec.group if isinstance(rec, PrefillRequest) else ():
            if member.session is session and member.generation == generation:
                return member
        return None

    def new_request(self, request_id: str, state: RequestState) -> PrefillRequest:
        core = self.core
        rec = PrefillRequest(request_id, state, core.now + core.options.request_timeout, core.now)
        core.remember(rec)
        core.active.add(rec)
        core.changed = True
        return rec

    def unissued(self, request_id: str, rec: PrefillRequest | None) -> UnknownRequest | None:
        """Why an announce for ``request_id`` is refused at once under ``options.refuse_unissued``, or None."""
        core = self.core
        if not core.options.refuse_unissued:
            return None
        address = core.setup.address
        if rec is None and request_id not in core.issued:
            return UnknownRequest(f"request {request_id!r}: prefill {address} never issued it (no issue() nor "
                                  "send for it, or one so long ago that it is forgotten; refuse_unissued is on): "
                                  "refused at once, not at request_timeout")
        if rec is not None and rec.state is RequestState.DONE:
            return UnknownRequest(f"request {request_id!r}: prefill {address} served it already (done): an "
                                  "announce for it again (a replay) is refused")
        return None

    def refused_binding(self, rec: PrefillRequest, bound: Binding | None) -> bool:
        """Record prefill's binding of ``rec``, and fail the request when a decode already announced it bound
        to other tokens (nothing of it was written yet: this runs before any chunk is queued for it)."""
        leader = rec.leader
        if bound is not None and leader.binding is None:
            leader.binding = bound
        elif bound is not None and bound != leader.binding:
            raise UsageError(f"request {rec.request_id!r}: a binding differing from the one it was sent with first")
        for member in leader.group:
            error = check_binding(rec.request_id, member.decode_binding, leader.binding)
            if error is not None:
                self.core.fail_req(leader, error)
                return True
        return False

    def queue(self, rec: PrefillRequest, spec: ChunkSpec) -> None:
        """Queue a chunk for every decode rank of the request, and keep it for those not yet announced."""
        core = self.core
        if rec.history is not None:
            rec.history.append(spec)
        rec.last_queued = spec.last
        for member in rec.group:
            member.pending.append(spec)
            member.last_queued = spec.last
            # Not announced yet: the announcement posts the queue, so waking the loop now is wasted.
            if member.session is not None:
                core.call_soon(lambda m=member: core.writer.post_ready(m))

    def join(self, leader: PrefillRequest, session: Session, generation: int, dst: dict[str, np.ndarray],
             prefix: dict[str, int]) -> None:
        """Another decode rank announced a request this rank already serves (decode TP > prefill TP): a
        record of its own, given every chunk queued so far; the leader is DONE only once all are."""
        core = self.core
        rec = PrefillRequest(leader.request_id, RequestState.WAITING_FOR_INPUT, leader.deadline, core.now)
        rec.group = leader.group
        rec.group.append(rec)
        rec.pending.extend(leader.history or ())
        rec.last_queued = leader.last_queued
        core.active.add(rec)
        self.bind(rec, session, generation, dst, prefix)
        if len(rec.group) >= leader.expected:
            leader.history = None  # every decode rank has its copy of the queue

    def bind(self, rec: PrefillRequest, session: Session, generation: int, dst: dict[str, np.ndarray],
             prefix: dict[str, int]) -> None:
        core = self.core
        rec.session, rec.generation, rec.dst = session, generation, dst
        rec.prefix, rec.request_pages = prefix, {}
        rec.coverage = {}   # made per pool when a chunk needs it (see coverage.cover)
        if rec.leader is rec:
            rec.expected = num_decode_ranks(core.memory.layout, session)
        if rec.state is RequestState.BOOTSTRAPPING:
            core.set_state(rec, RequestState.WAITING_FOR_INPUT)

    def cancel_everywhere(self, request_id: str, reason: str) -> None:
        """Tell every decode peer that this prefill failed ``request_id`` before any announced it: which
        decode will ask for it is not known yet."""
        core = self.core
        data = wire.encode(wire.Cancel(request_id, f"aborted by prefill: {reason}"[:wire.MAX_REASON_LEN]))
        for session in core.sessions.values():
            if session.established:
                core.queue_out(session.identity, data)
