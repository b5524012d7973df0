"""Prefill's protocol: sessions with decode peers, requests matched with announcements, writes decided.

Part of the protocol core (no I/O), above every other core module, below ``control.prefill`` (its shell).
``PrefillCore`` is fed events, each with ``now``: a decode's frame (``on_frame``), the engine's commands
(``send``, ``issue``, ``abort``), a write's outcome (``write_posted``, ``write_failed``, ``write_settled``),
a transport peer added (``peer_added``), a process found gone (``process_gone``), a dropped connection
(``connection_dropped``) and ticks (``tick``, ``check_silence``). It answers through ``core.base``'s
queues: messages, writes to post, effects (``AddPeer``, ``RemovePeer``, ``CheckProcess``, ``FlushNow``).

The protocol itself: each decode says Hello (layout shapes compared, optional HMAC challenge) and announces
requests with destination pages. The engine sends KV as it becomes ready: all at once, in chunks (an offset
into decode's page list, the last one marked), or restricted to some buffers (layer by layer); either may
come first. Each chunk is written with a notification carrying its digests; the chunks one iteration has
ready for one decode go as one write (``write_batch``), each record still settling, failing and aborting
on its own. A request is ``DONE`` here once every write completed and decode reported the bytes verified.
Whenever a request fails, decode is told with ``Fail(settled=True)`` only after every write of it has
settled, because decode frees the pages then. Right before each write the core checks that the session is
alive and the request current; a session it declared dead keeps its writes in flight until they finish
(never cancelled blind), and a decode that reconnects is told, generation by generation, once they have
(docs/fencing.md). In pull mode a chunk is offered (``Ready``) instead, and its pages are held
(``holds``) until decode is done with them.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, cast

import numpy as np

from kvferry.control import wire
from kvferry.control.core.admission import auth_mac, check_auth, check_hello
from kvferry.control.core.base import CheckProcess, CoreBase, Effect, FlushNow, RemovePeer, Transfer
from kvferry.control.core.coverage import cover
from kvferry.control.core.digests import chunk_digests
from kvferry.control.core.holds import SourceHolds
from kvferry.control.core.options import EndpointOptions
from kvferry.control.core.prefill_requests import (
    ChunkSpec,
    PrefillRequest,
    can_join,
    chunk_pairs,
    group_done,
    num_decode_ranks,
    past_prefix,
)
from kvferry.control.core.process import ProcessIdentity
from kvferry.control.core.sessions import Session, drop_half_open
from kvferry.control.core.states import RequestState, SessionState
from kvferry.control.core.timers import PeerClock
from kvferry.control.core.write_batch import Queued, group_cap, joinable, joined, write_groups
from kvferry.control.pull import MODE_REFUSAL, mode_refusal
from kvferry.errors import (
    IntegrityError,
    KVFerryError,
    PeerLost,
    PlanError,
    ProtocolError,
    RequestAborted,
    RequestFailed,
    TransferTimeout,
    UnknownRequest,
    UsageError,
)
from kvferry.integrity import DigestMode
from kvferry.integrity.binding import Binding, check_binding
from kvferry.layout.memory import KVMemory
from kvferry.plan.contract import Plan
from kvferry.plan.pages import validate_pages
from kvferry.plan.planner import plan_pages
from kvferry.plan.prefix import check_prefix

__all__ = ["AddPeer", "PrefillCore", "PrefillSetup", "Write"]

MAX_ISSUED = 1 << 16   # ids issue() remembers (see PrefillCore.issued)
DEADLINE_CHECK_S = 0.01   # how often request deadlines are looked at


@dataclass(frozen=True, slots=True)
class AddPeer(Effect):
    """Add decode's transport agent (``meta``: its transport metadata from the Hello); answer with
    ``PrefillCore.peer_added``."""

    identity: bytes
    meta: bytes


@dataclass(frozen=True, slots=True)
class Write:
    """One write to post (``PrefillCore.start_write``): the plan, decode's transport agent, the
    notification, a label naming its chunks, and the records it carries."""

    plan: Plan
    agent: str
    notification: bytes
    label: str
    records: list[PrefillRequest]


@dataclass(frozen=True, slots=True)
class PrefillSetup:
    """What the core must know of its shell: where it listens and what its transport is."""

    address: str
    transport: str                 # the transport's name (decode's must match)
    descriptors: str               # how the transport posts plans ("prepped" refuses cross-TP)
    transport_metadata: bytes
    process: ProcessIdentity       # this process, reported in Welcome
    secret: bytes | None
    modes: frozenset[str]


class PrefillCore(CoreBase):
    """Prefill's side of the protocol. Mutated only by its shell, under the shell's lock."""

    role = "prefill"

    def __init__(self, memory: KVMemory, setup: PrefillSetup, options: EndpointOptions, digest_mode: DigestMode,
                 stats: Any, entropy: Callable[[int], bytes]) -> None:
        super().__init__(options, stats, entropy)
        self.memory = memory
        self.setup = setup
        self.digest_mode = digest_mode
        self.sessions: dict[bytes, Session] = {}
        # Records (by identity: an id may have an old incarnation still settling) that are live, hold
        # writes, or owe decode a Fail; ``dirty`` is the subset the loop must look at now.
        self.active: set[PrefillRequest] = set()
        self.dirty: set[PrefillRequest] = set()
        self.holds = SourceHolds(options.peer_timeout, options.lease_grace)
        self.cold: set[Session] = set()   # pull sessions offered a chunk, with no verdict yet (num_waiting)
        self.writes: dict[Any, list[PrefillRequest]] = {}   # a posted write's ticket -> its records
        self.next_deadline_check = 0.0
        # What close() fails live requests with; decode hears of it as PeerLost (see send_fail).
        self.close_error = KVFerryError("prefill endpoint closing")
        self.unpeer: set[str] = set()    # decode agents to forget once no write to them is in flight
        self.hash_in_send = True         # whether send() hashes source pages (see note_sessions)
        # Ids issued before their send (``issue``), newest last, for ``options.refuse_unissued``; bounded: an
        # id older than MAX_ISSUED issues without its announce has long timed out on decode.
        self.issued: OrderedDict[str, None] = OrderedDict()
        # transport_liveness: when a connection last dropped (the shell's monitor says that one did, not whose).
        self.last_drop = -math.inf

    # -- the engine's commands ---------------------------------------------------------------------------
    def send(self, now: float, request_id: str, spec: ChunkSpec, bound: Binding | None) -> None:
        """``PrefillEndpoint.send`` past its checks: queue ``spec`` (validated, hashed, maybe planned)."""
        self.now = now
        rec = cast("PrefillRequest | None", self.records.get(request_id))
        if rec is None:
            rec = self.new_request(request_id, RequestState.BOOTSTRAPPING)
        self.issued.pop(request_id, None)   # its record answers for it from now on
        if rec.state is RequestState.DONE:
            raise UsageError(f"request {request_id!r} is already done")
        if rec.state is RequestState.FAILED:
            raise RequestFailed(request_id, str(rec.error)) from rec.error
        if rec.last_queued:
            raise UsageError(f"request {request_id!r}: the last chunk was already sent")
        if self.refused_binding(rec, bound):
            return
        self.queue(rec, spec)

    def issue(self, request_id: str) -> None:
        """``request_id`` is handed out to decode and its ``send`` will follow (``refuse_unissued``)."""
        self.issued[request_id] = None
        self.issued.move_to_end(request_id)
        while len(self.issued) > MAX_ISSUED:
            self.issued.popitem(last=False)

    def abort(self, now: float, request_id: str, reason: str) -> None:
        """Fail the request; a request no decode announced yet is kept FAILED and every decode is told."""
        self.now = now
        rec = self.records.get(request_id)
        if rec is None:
            if self.closing:
                return   # closing fails every request anyway, and no decode is told any more
            rec = self.new_request(request_id, RequestState.BOOTSTRAPPING)
        rec = cast(PrefillRequest, rec)
        failed_now = rec.is_live
        self.fail_req(rec, RequestAborted(f"aborted by prefill: {reason}"))
        if failed_now and rec.session is None:
            self.call_soon(lambda: self.cancel_everywhere(request_id, reason))

    def cancel_everywhere(self, request_id: str, reason: str) -> None:
        """Tell every decode peer that this prefill failed ``request_id`` before any announced it: which
        decode will ask for it is not known yet."""
        data = wire.encode(wire.Cancel(request_id, f"aborted by prefill: {reason}"[:wire.MAX_REASON_LEN]))
        for session in self.sessions.values():
            if session.established:
                self.queue_out(session.identity, data)

    def preplan_target(self, request_id: str) -> tuple[Session, int, dict[str, np.ndarray]] | None:
        """Where a chunk of ``request_id`` sent now would go, when the caller may plan it on its own thread
        (decode announced it, one rank, equal TP, no prefix); None otherwise (the loop plans it)."""
        rec = self.records.get(request_id)
        if not isinstance(rec, PrefillRequest) or not rec.is_live or len(rec.group) > 1 or rec.prefix:
            return None
        session = rec.session
        if session is None or session.planner is not None or session.remote is None:
            return None
        return session, rec.generation, rec.dst

    def plan(self, session: Session, pairs: dict[str, tuple[np.ndarray, np.ndarray]],
             buffer_ids: np.ndarray | None) -> Plan:
        """Whole pages at equal TP; across TP, this rank's head slices through the session's planner.

        Trusting: source pages were validated by ``send`` (``make_spec``), destination pages when the
        announce arrived (``check_announce``), their counts by ``chunk_pairs``, the shapes at the handshake."""
        assert session.remote is not None
        if session.planner is not None:
            return session.planner.plan_pages(pairs, buffer_ids)
        return plan_pages(self.memory, session.remote, pairs, buffer_ids)

    # -- records and groups --------------------------------------------------------------------------------
    def new_request(self, request_id: str, state: RequestState) -> PrefillRequest:
        rec = PrefillRequest(request_id, state, self.now + self.options.request_timeout, self.now)
        self.remember(rec)
        self.active.add(rec)
        self.changed = True
        return rec

    def unissued(self, request_id: str, rec: PrefillRequest | None) -> UnknownRequest | None:
        """Why an announce for ``request_id`` is refused at once under ``options.refuse_unissued``, or None."""
        if not self.options.refuse_unissued:
            return None
        address = self.setup.address
        if rec is None and request_id not in self.issued:
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
                self.fail_req(leader, error)
                return True
        return False

    def queue(self, rec: PrefillRequest, spec: ChunkSpec) -> None:
        """Queue a chunk for every decode rank of the request, and keep it for those not yet announced."""
        if rec.history is not None:
            rec.history.append(spec)
        rec.last_queued = spec.last
        for member in rec.group:
            member.pending.append(spec)
            member.last_queued = spec.last
            # Not announced yet: the announcement posts the queue, so waking the loop now is wasted.
            if member.session is not None:
                self.call_soon(lambda m=member: self.post_ready(m))

    def join(self, leader: PrefillRequest, session: Session, generation: int, dst: dict[str, np.ndarray],
             prefix: dict[str, int]) -> None:
        """Another decode rank announced a request this rank already serves (decode TP > prefill TP): a
        record of its own, given every chunk queued so far; the leader is DONE only once all are."""
        rec = PrefillRequest(leader.request_id, RequestState.WAITING_FOR_INPUT, leader.deadline, self.now)
        rec.group = leader.group
        rec.group.append(rec)
        rec.pending.extend(leader.history or ())
        rec.last_queued = leader.last_queued
        self.active.add(rec)
        self.bind(rec, session, generation, dst, prefix)
        if len(rec.group) >= leader.expected:
            leader.history = None  # every decode rank has its copy of the queue

    def bind(self, rec: PrefillRequest, session: Session, generation: int, dst: dict[str, np.ndarray],
             prefix: dict[str, int]) -> None:
        rec.session, rec.generation, rec.dst = session, generation, dst
        rec.prefix, rec.request_pages = prefix, {}
        rec.coverage = {}   # made per pool when a chunk needs it (see coverage.cover)
        if rec.leader is rec:
            rec.expected = num_decode_ranks(self.memory.layout, session)
        if rec.state is RequestState.BOOTSTRAPPING:
            self.set_state(rec, RequestState.WAITING_FOR_INPUT)

    # -- deciding writes -----------------------------------------------------------------------------------
    def post_ready(self, rec: PrefillRequest) -> None:
        if rec.session is None or not rec.session.established:
            return
        while rec.pending and rec.is_live:
            spec = rec.pending.popleft()
            try:
                self.post_chunk(rec, spec)
            except KVFerryError as exc:
                self.fail_req(rec, exc)

    def post_chunk(self, rec: PrefillRequest, sent: ChunkSpec) -> None:
        session = rec.session
        assert session is not None and session.remote is not None
        spec = past_prefix(rec, sent)
        if spec is None:
            return   # wholly inside decode's prefix: nothing moves, and no chunk is counted
        planned = spec.planned
        if planned is not None and planned.matches(rec):
            pairs, plan = planned.pairs, planned.plan
        else:
            pairs = chunk_pairs(rec.request_id, rec.dst, spec)
            plan = self.plan(session, pairs, spec.buffer_ids)
        cover(self.memory.layout, rec, spec)
        index = rec.next_chunk
        rec.next_chunk += 1
        mode = self.digest_mode.stronger(session.digest_mode)
        digests = chunk_digests(mode, spec.digests, pairs, plan, rec.generation, index)
        chunk = wire.Chunk(rec.request_id, rec.generation, index, spec.last, rec.next_chunk if spec.last else 0,
                           digests)
        self.check_current(rec, session)
        if session.mode == "pull":
            self.offer(rec, session, spec, pairs, chunk)   # decode reads it: this side writes nothing
        else:
            queued = Queued(rec, plan, wire.encode(chunk), f"{rec.request_id}#{index}")
            if self.batches.wanted() and self.options.batch_chunks > 1 and joinable(plan):
                # Posted once the calls, or the messages, of this iteration ran: with what else is ready.
                rec.posting = True
                self.batches.add(session, queued)
            else:
                self.queue_transfer(session, [queued], [rec])
        self.dirty.add(rec)
        rec.last_posted = spec.last
        if rec.is_live and rec.state is not RequestState.TRANSFERRING:
            self.set_state(rec, RequestState.TRANSFERRING)

    def offer(self, rec: PrefillRequest, session: Session, spec: ChunkSpec,
              pairs: dict[str, tuple[np.ndarray, np.ndarray]], chunk: wire.Chunk) -> None:
        """Pull mode: tell decode the chunk's source pages are ready (instead of writing them); hold them."""
        src = {pool: pages for pool, (pages, _) in pairs.items()}
        ready = wire.Ready(rec.request_id, rec.generation, chunk.chunk, chunk.last, chunk.num_chunks,
                           wire.encode_pages(src), {pool: spec.offsets[pool] for pool in src},
                           list(spec.buffers or ()), chunk.digests)
        self.holds.hold(rec)
        if not session.read_once:
            self.cold.add(session)
        self.send_msg(session, ready)
        if len(self.outbox[session.identity]) == 1:
            # The first of this iteration leaves at once (decode may be idle, waiting for it); the rest
            # follow together at the iteration's end.
            self.effects.append(FlushNow(session.identity))

    def post_batches(self) -> None:
        """Queue the writes of the chunks batched in this iteration (``write_batch``): per decode, those
        ready go as few writes as the caps allow (each checked again as it is posted, ``start_write``)."""
        # The window: requests some decode announced that have not ended here (a record before its
        # announce, one the caller sent ahead of decode, has no session).
        cap = group_cap(self.options.batch_chunks, sum(1 for rec in self.active if rec.session is not None))
        for session, queued in self.batches.take():
            for group in write_groups(queued, cap, self.options.batch_bytes):
                self.queue_transfer(session, group, [q.rec for q in group])

    def check_current(self, rec: PrefillRequest, session: Session) -> None:
        """Right before a write: the session is alive by our own clock and the request still current.

        Not the fence (a stall right after this check still posts; decode's quarantine keeps those pages
        from any other request until we settle), but it keeps a prefill that resumes from a stall from
        writing for a decode that has long given up on it."""
        # Judged by what decode heard from us (its peer_timeout runs from our last message), not by what
        # we heard from it: frames it sent before giving up on us may still be queued here.
        now = self.now
        unheard = session.clock.unheard_for(now)
        if not session.established or session.suspect or session.clock.we_were_silent(now):
            raise PeerLost(f"{session.label} heard nothing from this prefill for {unheard:.2f} s (peer_timeout "
                           f"{self.options.peer_timeout} s) and has declared it dead: not writing request "
                           f"{rec.request_id!r}")
        if not rec.is_live or rec.session is not session:
            raise PeerLost(f"request {rec.request_id!r} generation {rec.generation} is no longer current")

    # -- posting, and the writes' outcomes (the shell's events) -------------------------------------------
    def start_write(self, now: float, transfer: Transfer) -> Write | None:
        """The shell is about to post ``transfer``: check each record again (the lock was free since the
        decision: one that failed or lost its session is not written) and say what to post, or None."""
        self.now = now
        session: Session = transfer.peer
        group = [q for q in transfer.group if self.still_current(q.rec, session)]
        if not group:
            return None
        plan, label = joined(group)
        notif = group[0].data if len(group) == 1 else wire.batch_frame([q.data for q in group])
        return Write(plan, session.agent, notif, label, [q.rec for q in group])

    def still_current(self, rec: PrefillRequest, session: Session) -> bool:
        rec.posting = False
        try:
            self.check_current(rec, session)
        except KVFerryError as exc:
            self.fail_req(rec, exc)   # a no-op for a record that failed meanwhile; either way it settles
            return False
        rec.posting = True
        return True

    def write_posted(self, write: Write, ticket: Any) -> None:
        """The write is in flight: ``ticket`` names it until ``write_settled``."""
        self.writes[ticket] = write.records
        for rec in write.records:
            rec.handles.append(ticket)

    def write_failed(self, now: float, write: Write, error: KVFerryError) -> None:
        """The write could not be posted: every record in it fails (nothing of it is in flight)."""
        self.now = now
        for rec in write.records:
            self.fail_req(rec, error)

    def write_settled(self, now: float, ticket: Any, error: KVFerryError | None) -> None:
        """The write ``ticket`` completed (``error`` None) or failed: its records may settle."""
        self.now = now
        for rec in self.writes.pop(ticket, ()):
            rec.handles.remove(ticket)
            if error is not None:
                self.fail_req(rec, error)
            self.dirty.add(rec)

    def settle_dirty(self, now: float) -> bool:
        """Settle every record that may have changed; True when one did (the loop found work)."""
        self.now = now
        settled = False
        for rec in list(self.dirty):
            self.settle(rec)
            if not rec.handles or rec not in self.active:
                self.dirty.discard(rec)
                settled = True
        if self.unpeer and settled:
            self.forget_peers()
        return settled

    # -- failure and settling ------------------------------------------------------------------------------
    def fail_req(self, rec: PrefillRequest, error: KVFerryError) -> None:
        self.fail_one(rec, error)
        for member in rec.group:  # fail closed: one decode rank's failure is the request's
            if member is not rec and member.is_live:
                self.fail_one(member, error)

    def fail_closed(self, rec: Any, error: KVFerryError) -> None:
        self.fail_req(cast(PrefillRequest, rec), error)

    def fail_one(self, rec: PrefillRequest, error: KVFerryError) -> None:
        failed_now = self.fail(rec, error)
        rec.pending.clear()
        self.active.add(rec)   # keep it until its writes settle and decode is told
        self.dirty.add(rec)
        if failed_now and rec.handles and rec.session is not None:
            # Tell decode at once (it must not report DONE for a request we failed), but unsettled: the
            # pages stay leased until the settled Fail follows. A chunk notification that beats this
            # message to decode may still complete the request there, with verified bytes.
            self.call_soon(lambda: self.send_fail(rec, settled=False))
        self.wake_wanted = True

    def send_fail(self, rec: PrefillRequest, *, settled: bool) -> None:
        session = rec.session
        if session is None or not session.established:
            return
        err = rec.error or KVFerryError("failed")
        # This endpoint closing is, to decode, its peer leaving: its waiters get PeerLost, as after a Bye.
        kind = "peer_lost" if err is self.close_error else wire.error_kind(err)
        self.send_msg(session, wire.Fail(rec.request_id, rec.generation, str(err)[:wire.MAX_REASON_LEN], kind,
                                         settled))

    def settle(self, rec: PrefillRequest) -> None:
        """With no write in flight: finish, or tell decode the failure is settled; then forget it."""
        if rec.handles or rec.posting:   # posting: a chunk queued for this iteration's write
            return
        if rec.is_live and rec.last_posted and rec.decode_ok and group_done(rec):
            self.set_state(rec, RequestState.DONE)
            if rec.leader is not rec:
                self.dirty.add(rec.leader)  # the leader may be waiting for this decode rank only
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
            self.active.discard(rec)

    def release_source(self, rec: PrefillRequest) -> None:
        """Decode is done with the record's source pages (pull mode), or can no longer accept what it reads."""
        if self.holds.release(rec):
            self.dirty.add(rec)   # the record may now be forgotten (settle)
            self.changed = True

    # -- frames (the shell's events) -----------------------------------------------------------------------
    def on_frame(self, now: float, identity: bytes, data: bytes) -> None:
        """One frame from the decode behind ``identity`` (``now``: when the poll that found it returned)."""
        self.now = now
        session = self.sessions.get(identity)
        try:
            msg = wire.decode(data)
        except ProtocolError as exc:
            if session is None or not session.established:
                self.reject(identity, str(exc))  # e.g. another protocol version: say why, in a Reject
            raise
        if session is not None:
            session.clock.heard(now)
        if isinstance(msg, wire.Batch):
            self.on_batch(wire.unbatch(msg), lambda m: self.on_msg(identity, m, b""))
        else:
            self.on_msg(identity, msg, data)

    def on_msg(self, identity: bytes, msg: Any, data: bytes) -> None:
        """One message from ``identity``, alone or out of a Batch (``data`` empty: a Batch's, in order, each
        handled as if it had come alone)."""
        session = self.sessions.get(identity)
        if isinstance(msg, wire.Hello):
            if not data:  # the MAC binds a Hello's own frame: it comes alone
                raise ProtocolError("Hello inside a Batch")
            self.on_hello(identity, session, msg, data)
        elif session is None:
            # A session we declared dead (or never had) must handshake again, not be heard silently.
            self.effects.append(FlushNow(identity, wire.encode(wire.Bye("unknown session: handshake again"))))
            raise ProtocolError(f"{type(msg).__name__} before Hello")
        elif session.state is SessionState.CHALLENGED:
            self.on_auth(session, msg)
        elif session.established:
            self.on_message(session, msg)

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
            self.session_dead(session, PeerLost(f"{session.label} left: {msg.reason}"))
        elif not isinstance(msg, wire.Heartbeat):
            raise ProtocolError(f"unexpected {type(msg).__name__} from {session.label}")

    def on_announce(self, session: Session, msg: wire.Announce) -> None:
        try:
            dst = self.check_announce(session, msg)
            prefix = check_prefix(session.remote.layout, msg.prefix, f"announce from {session.label}")
        except KVFerryError as exc:
            self.refuse(session, msg, exc)
            return
        theirs = wire.announced_binding(msg)
        rec = self.records.get(msg.request_id)
        unknown = self.unissued(msg.request_id, cast("PrefillRequest | None", rec))
        if unknown is not None:
            self.refuse(session, msg, unknown)
            return
        if isinstance(rec, PrefillRequest):
            error = check_binding(msg.request_id, theirs, rec.leader.binding)
            if error is not None:   # refused before any byte moves, on both sides
                if rec.is_live and rec.session is None:
                    self.fail_req(rec, error)
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
        self.post_ready(rec)
        if rec.next_chunk == 0 and rec.is_live and rec.session is not None:
            self.send_msg(rec.session, wire.Ack(msg.request_id, msg.generation))

    def check_announce(self, session: Session, msg: wire.Announce) -> dict[str, np.ndarray]:
        assert session.remote is not None
        # Decode's own lease table checked these; a peer's pages are untrusted input all the same.
        return validate_pages(session.remote.layout, "destination", wire.decode_pages(msg.pages), PlanError,
                              unique=True)

    def refuse(self, session: Session, msg: wire.Announce, error: KVFerryError) -> None:
        # Nothing was or will be written under this generation, so decode may free the pages at once.
        self.send_msg(session, wire.Fail(msg.request_id, msg.generation, str(error)[:wire.MAX_REASON_LEN],
                                         wire.error_kind(error), True))

    def on_result(self, session: Session, msg: wire.Result) -> None:
        rec = self.match(session, msg.request_id, msg.generation)
        if rec is None:
            return
        self.release_source(rec)  # pull mode: decode reads no more of it, whatever its verdict
        if not session.read_once:
            session.read_once = True
            self.cold.discard(session)
        if msg.ok:
            rec.decode_ok = True
            self.dirty.add(rec)
        else:
            self.fail_req(rec, IntegrityError(f"{session.label} rejected the bytes: {msg.reason}"))

    def on_abort(self, session: Session, msg: wire.Abort) -> None:
        held = self.holds.held_for(session, msg.request_id, msg.generation)
        if held is not None:  # pull mode: decode reads no more of it (it failed it, or acknowledges our Fail)
            self.release_source(held)
        rec = self.match(session, msg.request_id, msg.generation) or self.in_flight(session, msg)
        if rec is None:  # no write of this generation is in flight, from any session with this decode
            self.send_msg(session, wire.Fail(msg.request_id, msg.generation, "unknown request or settled", "error",
                                             True))
            return
        self.fail_req(rec, RequestAborted(f"aborted by {session.label}: {msg.reason}"))
        rec.session = session  # a reconnected decode asking about its old session: answer on this one
        rec.fail_sent = False  # decode waits for a settled Fail for this generation, even a repeated one
        self.active.add(rec)
        self.dirty.add(rec)

    def on_cancel(self, session: Session, msg: wire.Cancel) -> None:
        """Decode will never announce the request: fail it now (a record not yet announced by any decode),
        or remember the failure for a ``send`` still to come. A record another decode announced is not
        this decode's to end."""
        rec = self.records.get(msg.request_id)
        if isinstance(rec, PrefillRequest) and rec.is_live and rec.session not in (None, session):
            return
        if not isinstance(rec, PrefillRequest) or not rec.is_live:
            if rec is not None:
                return   # ended already: nothing held for it
            rec = self.new_request(msg.request_id, RequestState.BOOTSTRAPPING)
        self.fail_req(rec, RequestAborted(f"cancelled by {session.label} before it announced the request: "
                                          f"{msg.reason}"))

    def in_flight(self, session: Session, msg: wire.Abort) -> PrefillRequest | None:
        """A record still writing this generation to this decode (its agent), in any session: an older
        session's, or an older incarnation of the request id that ``match`` does not see."""
        for rec in self.active:
            old = rec.session
            if ((rec.handles or rec.posting) and rec.request_id == msg.request_id and rec.generation == msg.generation
                    and old is not None and old.agent == session.agent):
                return rec
        return None

    def match(self, session: Session, request_id: str, generation: int) -> PrefillRequest | None:
        rec = self.records.get(request_id)
        for member in rec.group if isinstance(rec, PrefillRequest) else ():
            if member.session is session and member.generation == generation:
                return member
        return None

    # -- handshake -----------------------------------------------------------------------------------------
    def on_hello(self, identity: bytes, session: Session | None, msg: wire.Hello, data: bytes) -> None:
        if session is not None and session.established:
            raise ProtocolError(f"Hello on the established {session.label}")
        self.sessions.pop(identity, None)
        drop_half_open(self.sessions)
        now = self.now
        session = Session(identity, msg, bytes(data), now + self.options.handshake_timeout,
                          PeerClock(now, self.options.heartbeat_interval, self.options.peer_timeout),
                          self.entropy(32))
        self.sessions[identity] = session
        if self.setup.secret is not None:
            self.send_msg(session, wire.Challenge(session.nonce))
        else:
            self.admit(session)

    def on_auth(self, session: Session, msg: Any) -> None:
        secret = self.setup.secret
        if not isinstance(msg, wire.Auth) or secret is None:
            raise ProtocolError(f"expected Auth from {session.label}, got {type(msg).__name__}")
        if not check_auth(secret, session, msg.mac):
            self.reject(session.identity, "authentication failed: the shared secret does not match")
            return
        self.admit(session)

    def admit(self, session: Session) -> None:
        """The Hello (and the secret) checked out so far: check the layouts and the mode, then ask the
        shell to add decode's transport agent (``peer_added`` goes on)."""
        setup = self.setup
        problem = (check_hello(self.memory, setup.transport, setup.descriptors, session)
                   or self.mode_problem(session))
        if problem is not None:
            self.reject(session.identity, problem)
            return
        self.effects.append(AddPeer(session.identity, session.hello.transport_meta))

    def peer_added(self, now: float, identity: bytes, agent: str | None, error: str | None) -> None:
        """The shell added decode's transport agent (``agent``), or could not (``error``)."""
        self.now = now
        session = self.sessions.get(identity)
        if session is None or session.state is not SessionState.CHALLENGED:
            return
        if agent is None:
            self.reject(identity, f"bad transport metadata: {error}")
            return
        session.agent = agent
        self.establish(session)

    def establish(self, session: Session) -> None:
        for other in list(self.sessions.values()):
            if other is not session and other.agent == session.agent and other.established:
                self.session_dead(other, PeerLost(f"{other.label} replaced by a new session of the same agent"))
        session.digest_mode = DigestMode.from_peer(session.hello.digest_mode)
        session.move(SessionState.ESTABLISHED)
        self.note_sessions()
        secret = self.setup.secret
        proof = b"" if secret is None else auth_mac(secret, b"prefill", session.hello.nonce, session.nonce,
                                                   session.hello_bytes)
        me = self.setup.process
        self.send_msg(session, wire.Welcome(self.entropy(8).hex(), self.memory.manifest(),
                                            self.setup.transport_metadata, proof, self.options.heartbeat_interval,
                                            self.digest_mode.stronger(session.digest_mode), me.host, me.pid,
                                            me.started, session.mode, self.options.peer_timeout))

    def mode_problem(self, session: Session) -> str | None:
        """Why decode's transfer mode cannot be served, or None: refused before any byte moves."""
        modes = self.setup.modes
        if session.mode not in modes:
            return mode_refusal(session.label, session.mode, modes)
        if session.mode == "pull" and session.planner is not None:
            decode_tp = session.remote.layout.tp_size if session.remote is not None else "?"
            return (f"{MODE_REFUSAL} 'pull' refused: {session.label}: pull mode is built for equal TP sizes "
                    f"only (prefill TP {self.memory.layout.tp_size}, decode TP {decode_tp}); connect in push mode")
        return None

    def reject(self, identity: bytes, reason: str) -> None:
        self.sessions.pop(identity, None)
        self.effects.append(FlushNow(identity, wire.encode(wire.Reject(reason[:wire.MAX_REASON_LEN]))))

    def note_sessions(self) -> None:
        """After an established session came or went: whether ``send`` should hash source pages. Whole-page
        digests hashed in ``send`` serve only equal-TP peers; when every connected peer is a cross-TP rank
        they would be thrown away (its chunks get slice digests from the plan)."""
        sessions = [s for s in self.sessions.values() if s.established]
        self.hash_in_send = not sessions or any(s.planner is None for s in sessions)

    # -- timers --------------------------------------------------------------------------------------------
    def num_waiting(self) -> int:
        return len(self.dirty) + len(self.cold)

    def tick(self, now: float) -> None:
        self.now = now
        for session in list(self.sessions.values()):
            self.tick_session(session, now)
        if self.holds.held:
            ended, ask = self.holds.due(now)
            for rec in ended:
                self.release_source(rec)
            self.effects.extend(CheckProcess(process) for process in ask)
        if now >= self.next_deadline_check:
            self.next_deadline_check = now + DEADLINE_CHECK_S
            for rec in list(self.active):
                if rec.is_live and now > rec.deadline:
                    self.fail_req(rec, TransferTimeout(f"request {rec.request_id!r} not done within "
                                                       f"{self.options.request_timeout} s"))

    def tick_session(self, session: Session, now: float) -> None:
        if session.state is SessionState.CHALLENGED and now > session.deadline:
            self.sessions.pop(session.identity, None)
        elif not session.established:
            return
        elif session.suspect:
            self.session_dead(session, PeerLost(f"{session.label} heard nothing from this prefill for more than "
                                                f"peer_timeout {self.options.peer_timeout} s (this process "
                                                "stalled): it has declared us dead"))
        elif session.clock.peer_lost(now, self.connected_for(session)):
            self.session_dead(session, PeerLost(f"{session.label} silent for {session.clock.silent_for(now):.2f} s "
                                                f"(peer_timeout {self.options.peer_timeout} s)"))
        elif session.clock.heartbeat_due(now):
            self.send_msg(session, wire.Heartbeat())

    def connected_for(self, session: Session) -> bool | None:
        """With ``transport_liveness``: True while no connection dropped since we last heard ``session`` (its
        own still stands, with libzmq's heartbeats answered); None (silence decides) otherwise."""
        if not self.options.transport_liveness:
            return None
        return True if session.clock.last_seen > self.last_drop else None

    def connection_dropped(self, now: float) -> None:
        """The shell's socket monitor saw a connection drop (a reset, or ZMTP heartbeats unanswered)."""
        self.last_drop = now

    def process_gone(self, now: float, process: ProcessIdentity) -> None:
        """``process`` (a dead session's decode) is certainly gone: its source holds end now."""
        self.now = now
        for rec in self.holds.of_process(process):
            self.release_source(rec)

    def check_silence(self, now: float) -> None:
        # Before reading: a session we sent nothing to for longer than peer_timeout (this process stalled)
        # has been declared dead by its decode, whatever frames queued meanwhile say. It posts nothing
        # more; what those frames report (a verdict, an abort) is still read, then tick ends the session.
        self.now = now
        for session in self.sessions.values():
            if session.established and session.clock.we_were_silent(now):
                session.suspect = True

    def next_deadline(self) -> float:
        """The earliest ``now`` at which ``tick`` may decide something with no other event in between."""
        times = [s.clock.next_deadline(self.now) if s.established else s.deadline for s in self.sessions.values()]
        times.append(self.holds.next_deadline())
        live = [rec.deadline for rec in self.active if rec.is_live]
        if live:
            times.append(max(min(live), self.next_deadline_check))
        return min(times, default=math.inf)

    def frame_sent(self, now: float, identity: bytes) -> None:
        """A frame of ours left for ``identity`` (what decode heard from us: heartbeats, check_current)."""
        session = self.sessions.get(identity)
        if session is not None:
            session.clock.sent(now)

    # -- sessions ending -----------------------------------------------------------------------------------
    def fail_peers(self, error: KVFerryError) -> None:
        for session in self.sessions.values():
            session.move(SessionState.DEAD)
        self.note_sessions()

    def session_dead(self, session: Session, error: KVFerryError) -> None:
        """Fail the session's requests, forget the peer once no write to it is in flight; others go on."""
        if not session.established:
            return
        # Best effort: a decode that still hears us learns it was dropped, and quarantines its leases.
        self.send_msg(session, wire.Bye(str(error)[:wire.MAX_REASON_LEN]))
        session.move(SessionState.DEAD)
        self.cold.discard(session)
        self.holds.after_death(session, self.now)
        for rec in list(self.active):
            if rec.session is session:
                # Decode's verdict may have come in the same frames as its goodbye (a batch, or one drain
                # of the socket): a request that decode verified whole is not lost. It settles DONE once
                # its writes complete (or fails if one does not); only what is still open fails. So does a
                # verified part of a request other decode ranks still owe a verdict on (decode TP >
                # prefill TP): the group decides (its other ranks, or the deadline).
                self.settle(rec)
                if rec.state is RequestState.DONE:
                    continue
                if rec.is_live and rec.decode_ok and rec.last_posted:
                    continue
                self.fail_req(rec, error)
                # Writes still in flight are not cancelled blind: they finish (or fail), and decode keeps
                # the pages quarantined until we tell a reconnected decode they did.
                if not rec.handles and not rec.posting:
                    self.active.discard(rec)
                    self.dirty.discard(rec)
        self.sessions.pop(session.identity, None)
        self.note_sessions()
        self.unpeer.add(session.agent)
        self.forget_peers()
        self.changed = True

    def forget_peers(self) -> None:
        """Remove from the transport the decode agents no session uses and no write in flight targets
        (removing one under a write in flight could fail it halfway, with no word on what landed)."""
        in_use = {s.agent for s in self.sessions.values()}
        self.unpeer -= in_use  # a session with that decode again: its own death will ask anew
        writing = {r.session.agent for r in self.active if (r.handles or r.posting) and r.session is not None}
        for agent in self.unpeer - writing:
            self.unpeer.discard(agent)
            self.effects.append(RemovePeer(agent))

    def send_msg(self, session: Session, msg: Any) -> None:
        """Queue ``msg`` for ``session``'s decode; it leaves at the end of this iteration."""
        self.queue_out(session.identity, wire.encode(msg))

    def shutdown_step(self, now: float, give_up: bool) -> bool:
        self.now = now
        for rec in list(self.active):
            self.fail_req(rec, self.close_error)
        for rec in [r for r in self.holds.held if r.session is None or not r.session.established]:
            self.release_source(rec)  # no decode left to answer: waiting would only delay the close
        self.settle_dirty(now)
        if self.active and not give_up:
            return False
        for session in list(self.sessions.values()):
            if session.established:
                self.send_msg(session, wire.Bye("prefill closing"))
        for rec in list(self.holds.held):
            self.release_source(rec)  # closed: the engine owns its memory again (docs/fencing.md)
        return True

    # -- what the shell's queries read ---------------------------------------------------------------------
    def done_pages(self, rec: Any) -> Mapping[str, Any]:
        return cast(PrefillRequest, rec).dst   # decode's pages this record wrote: as many as this side's

    def gauges(self) -> dict[str, int]:
        return {"live_requests": sum(r.is_live for r in list(self.active)), "source_holds": len(self.holds),
                "peers": sum(s.established for s in list(self.sessions.values()))}
