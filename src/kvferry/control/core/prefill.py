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
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, cast

import numpy as np

from kvferry.control import wire
from kvferry.control.core.base import CheckProcess, CoreBase, FlushNow, Transfer
from kvferry.control.core.holds import SourceHolds
from kvferry.control.core.options import EndpointOptions
from kvferry.control.core.ordered import OrderedSet, RecordSet
from kvferry.control.core.prefill_announces import Announces
from kvferry.control.core.prefill_handshake import Handshake
from kvferry.control.core.prefill_liveness import Liveness
from kvferry.control.core.prefill_requests import (
    ChunkSpec,
    PrefillRequest,
)
from kvferry.control.core.prefill_writer import Writer
from kvferry.control.core.process import ProcessIdentity
from kvferry.control.core.sessions import Session
from kvferry.control.core.states import RequestState, SessionState
from kvferry.control.core.write_batch import group_cap, joined, write_groups
from kvferry.errors import (
    KVFerryError,
    ProtocolError,
    RequestAborted,
    RequestFailed,
    TransferTimeout,
    UsageError,
)
from kvferry.integrity import DigestMode
from kvferry.integrity.binding import Binding
from kvferry.layout.memory import KVMemory
from kvferry.plan.contract import Plan
from kvferry.plan.planner import plan_pages

__all__ = ["PrefillCore", "PrefillSetup", "Write"]

MAX_ISSUED = 1 << 16   # ids issue() remembers (see PrefillCore.issued)
DEADLINE_CHECK_S = 0.01   # how often request deadlines are looked at


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
        self.active: RecordSet = RecordSet()   # of PrefillRequest
        self.dirty: OrderedSet[PrefillRequest] = OrderedSet()
        self.holds = SourceHolds(options.peer_timeout, options.lease_grace)
        self.cold: OrderedSet[Session] = OrderedSet()   # pull sessions offered a chunk, no verdict yet (num_waiting)
        self.writes: dict[Any, list[PrefillRequest]] = {}   # a posted write's ticket -> its records
        self.next_deadline_check = 0.0
        # What close() fails live requests with; decode hears of it as PeerLost (see send_fail).
        self.close_error = KVFerryError("prefill endpoint closing")
        self.unpeer: OrderedSet[str] = OrderedSet()    # decode agents to forget once no write to them is in flight
        self.hash_in_send = True         # whether send() hashes source pages (see note_sessions)
        # Ids issued before their send (``issue``), newest last, for ``options.refuse_unissued``; bounded: an
        # id older than MAX_ISSUED issues without its announce has long timed out on decode.
        self.issued: OrderedDict[str, None] = OrderedDict()
        # transport_liveness: when a connection last dropped that the shell could not name (its monitor says
        # that one did; the shell names whose when it knows the connection's descriptor: Session.dropped_at).
        self.last_drop = -math.inf
        # Probes sent (liveness.probe): how often this prefill found itself stalled past peer_timeout; the
        # latest is also the number the newest probe carries.
        self.num_probes = 0
        # The decisions, by concern; each part reads and changes this core's state.
        self.handshake = Handshake(self)
        self.announces = Announces(self)
        self.writer = Writer(self)
        self.liveness = Liveness(self)

    def send(self, now: float, request_id: str, spec: ChunkSpec, bound: Binding | None) -> None:
        """``PrefillEndpoint.send`` past its checks: queue ``spec`` (validated, hashed, maybe planned)."""
        self.now = now
        rec = cast("PrefillRequest | None", self.records.get(request_id))
        if rec is None:
            rec = self.announces.new_request(request_id, RequestState.BOOTSTRAPPING)
        self.issued.pop(request_id, None)   # its record answers for it from now on
        if rec.state is RequestState.DONE:
            raise UsageError(f"request {request_id!r} is already done")
        if rec.state is RequestState.FAILED:
            raise RequestFailed(request_id, str(rec.error)) from rec.error
        if rec.last_queued:
            raise UsageError(f"request {request_id!r}: the last chunk was already sent")
        if self.announces.refused_binding(rec, bound):
            return
        self.announces.queue(rec, spec)

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
            rec = self.announces.new_request(request_id, RequestState.BOOTSTRAPPING)
        rec = cast(PrefillRequest, rec)
        failed_now = rec.is_live
        self.fail_req(rec, RequestAborted(f"aborted by prefill: {reason}"))
        if failed_now and rec.session is None:
            self.call_soon(lambda: self.announces.cancel_everywhere(request_id, reason))

    def preplan_target(self, request_id: str) -> tuple[Session, int, dict[str, np.ndarray]] | None:
        """Where a chunk of ``request_id`` sent now would go, when the caller may plan it on its own thread
        (decode announced it, one rank, equal TP and page sizes, no prefix); None otherwise (the loop plans it)."""
        rec = self.records.get(request_id)
        if not isinstance(rec, PrefillRequest) or not rec.is_live or len(rec.group) > 1 or rec.prefix:
            return None
        session = rec.session
        if session is None or session.planner is not None or session.translator is not None or session.remote is None:
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

    def post_batches(self) -> None:
        """Queue the writes of the chunks batched in this iteration (``write_batch``): per decode, those
        ready go as few writes as the caps allow (each checked again as it is posted, ``start_write``)."""
        # The window: requests some decode announced that have not ended here (a record before its
        # announce, one the caller sent ahead of decode, has no session).
        cap = group_cap(self.options.batch_chunks, sum(1 for rec in self.active if rec.session is not None))
        for session, queued in self.batches.take():
            for group in write_groups(queued, cap, self.options.batch_bytes):
                self.queue_transfer(session, group, [q.rec for q in group])

    def start_write(self, now: float, transfer: Transfer) -> Write | None:
        """The shell is about to post ``transfer``: check each record again (the lock was free since the
        decision: one that failed or lost its session is not written) and say what to post, or None."""
        self.now = now
        session: Session = transfer.peer
        if session.established and self.liveness.held(session, now):
            # A stall between the decision and now: decode may have given up on us. Posted once it
            # answers (checked again then), never before; failed with the session if it does not.
            session.parked.append(transfer)
            return None
        group = [q for q in transfer.group if self.writer.still_current(q.rec, session)]
        if not group:
            return None
        plan, label = joined(group)
        notif = group[0].data if len(group) == 1 else wire.batch_frame([q.data for q in group])
        return Write(plan, session.agent, notif, label, [q.rec for q in group])

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
        if not self.dirty:
            return False
        for rec in list(self.dirty):
            self.writer.settle(rec)
            if not rec.handles or rec not in self.active:
                self.dirty.discard(rec)
                settled = True
        if self.unpeer and settled:
            self.liveness.forget_peers()
        return settled

    def fail_req(self, rec: PrefillRequest, error: KVFerryError) -> None:
        self.writer.fail_one(rec, error)
        for member in rec.group:  # fail closed: one decode rank's failure is the request's
            if member is not rec and member.is_live:
                self.writer.fail_one(member, error)

    def fail_closed(self, rec: Any, error: KVFerryError) -> None:
        self.fail_req(cast(PrefillRequest, rec), error)

    def on_frame(self, now: float, identity: bytes, data: bytes) -> None:
        """One frame from the decode behind ``identity`` (``now``: when the poll that found it returned)."""
        self.now = now
        session = self.sessions.get(identity)
        try:
            msg = wire.decode(data)
        except ProtocolError as exc:
            if session is None or not session.established:
                self.handshake.reject(identity, str(exc))  # e.g. another protocol version: say why, in a Reject
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
            self.handshake.on_hello(identity, session, msg, data)
        elif session is None:
            # A session we declared dead (or never had) must handshake again, not be heard silently.
            self.effects.append(FlushNow(identity, wire.encode(wire.Bye("unknown session: handshake again"))))
            raise ProtocolError(f"{type(msg).__name__} before Hello")
        elif session.state is SessionState.CHALLENGED:
            self.handshake.on_auth(session, msg)
        elif session.established:
            self.announces.on_message(session, msg)

    def peer_added(self, now: float, identity: bytes, agent: str | None, error: str | None) -> None:
        """The shell added decode's transport agent (``agent``), or could not (``error``)."""
        self.now = now
        session = self.sessions.get(identity)
        if session is None or session.state is not SessionState.CHALLENGED:
            return
        if agent is None:
            self.handshake.reject(identity, f"bad transport metadata: {error}")
            return
        session.agent = agent
        self.handshake.establish(session)

    def num_waiting(self) -> int:
        return len(self.dirty) + len(self.cold)

    def tick(self, now: float) -> None:
        self.now = now
        tick_session = self.liveness.tick_session
        for session in list(self.sessions.values()):
            tick_session(session, now)
        if self.holds.held:
            ended, ask = self.holds.due(now)
            for rec in ended:
                self.writer.release_source(rec)
            self.effects.extend(CheckProcess(process) for process in ask)
        if now >= self.next_deadline_check:
            self.next_deadline_check = now + DEADLINE_CHECK_S
            first = self.active.earliest_live()
            if first is not None and now > first:   # else no live deadline passed: nothing to sweep
                for rec in list(self.active):
                    if rec.is_live and now > rec.deadline:
                        self.fail_req(rec, TransferTimeout(f"request {rec.request_id!r} not done within "
                                                           f"{self.options.request_timeout} s"))

    def connection_dropped(self, now: float, identities: Iterable[bytes] | None = None) -> None:
        """The shell's socket monitor saw a connection drop (a reset, or ZMTP heartbeats unanswered): the one
        that carried ``identities``' frames, or (None) one the shell cannot name. Only the sessions named are
        then judged by silence; an unnamed drop makes every session not heard from since suspect, as it
        must when nothing better is known (issue 49: one decode's drop ended another, starved, decode's
        session and failed its requests, both at once)."""
        if identities is None:
            self.last_drop = now
            return
        for identity in identities:
            session = self.sessions.get(identity)
            if session is not None:
                session.dropped_at = now

    def process_gone(self, now: float, process: ProcessIdentity) -> None:
        """``process`` (a dead session's decode) is certainly gone: its source holds end now."""
        self.now = now
        for rec in self.holds.of_process(process):
            self.writer.release_source(rec)

    def check_silence(self, now: float) -> None:
        # Before reading: a session we sent nothing to for longer than peer_timeout (this process stalled)
        # may have been declared dead by its decode, whatever frames queued meanwhile say. It posts nothing
        # until decode answers a probe; what the queued frames report (a verdict, an abort) is still read.
        self.now = now
        for session in self.sessions.values():
            if session.state is SessionState.ESTABLISHED and session.clock.we_were_silent(now):
                self.liveness.probe(session, now)

    def next_deadline(self) -> float:
        """The earliest ``now`` at which ``tick`` may decide something with no other event in between."""
        # One pass, no lists: the loop asks this once per iteration.
        now, earliest = self.now, self.holds.next_deadline()
        for s in self.sessions.values():
            t = s.clock.next_deadline(now) if s.state is SessionState.ESTABLISHED else s.deadline
            if t < earliest:
                earliest = t
            if s.probe and s.probe_deadline >= now:   # one passed with the session still held: no timer
                t = math.nextafter(s.probe_deadline, math.inf)
                if t < earliest:
                    earliest = t
        first = self.active.earliest_live()
        if first is not None:
            return min(earliest, max(first, self.next_deadline_check))
        return earliest

    def frame_sent(self, now: float, identity: bytes) -> None:
        """A frame of ours left for ``identity`` (what decode heard from us: heartbeats, check_current)."""
        session = self.sessions.get(identity)
        if session is not None:
            session.clock.sent(now)

    def fail_peers(self, error: KVFerryError) -> None:
        for session in self.sessions.values():
            session.move(SessionState.DEAD)
        self.handshake.note_sessions()

    def send_msg(self, session: Session, msg: Any) -> None:
        """Queue ``msg`` for ``session``'s decode; it leaves at the end of this iteration."""
        self.queue_out(session.identity, wire.encode(msg))

    def shutdown_step(self, now: float, give_up: bool) -> bool:
        self.now = now
        for rec in list(self.active):
            self.fail_req(rec, self.close_error)
        for rec in [r for r in self.holds.held if r.session is None or not r.session.established]:
            self.writer.release_source(rec)  # no decode left to answer: waiting would only delay the close
        self.settle_dirty(now)
        if self.active and not give_up:
            return False
        for session in list(self.sessions.values()):
            if session.established:
                self.send_msg(session, wire.Bye("prefill closing"))
        for rec in list(self.holds.held):
            self.writer.release_source(rec)  # closed: the engine owns its memory again (docs/fencing.md)
        return True

    def done_pages(self, rec: Any) -> Mapping[str, Any]:
        return cast(PrefillRequest, rec).dst   # decode's pages this record wrote: as many as this side's

    def gauges(self) -> dict[str, int]:
        return {"live_requests": sum(r.is_live for r in list(self.active)), "source_holds": len(self.holds),
                "peers": sum(s.established for s in list(self.sessions.values()))}
