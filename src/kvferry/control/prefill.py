"""The prefill endpoint: accepts decode peers, matches their announcements with ready KV, writes it.

The top of the control plane (with ``decode``), above every other control module. Prefill binds a ZMQ ROUTER;
each decode connects, handshakes (layout shapes compared, optional HMAC challenge) and announces requests with
destination pages. The engine calls ``send`` as KV becomes ready: all at once, in chunks (an offset into
decode's page list, the last one marked), or restricted to some buffers (layer by layer). Either may come
first. Each chunk is written with a notification carrying its digests; the chunks one progress iteration
has ready for one decode go as one write (``write_batch``: under load, tens per iteration), each record
still settling, failing and aborting on its own. A request is
``DONE`` here once every write completed and decode reported the bytes verified. Whenever a request fails,
decode is told with ``Fail(settled=True)`` only after every write of it has settled, because decode frees the
pages then. Right before each write prefill checks that the session is alive and the request current; a
session it declared dead keeps its writes in flight until they finish (never cancelled blind), and a decode
that reconnects is told, generation by generation, once they have (docs/fencing.md).

This module runs the protocol; the parts it drives live beside it: ``sessions`` (the decode peers),
``admission`` (what a Hello must show), ``prefill_requests`` (records, chunk specs, request groups across
TP), ``coverage`` (cells written by chunked sends), ``digests`` (what each notification carries) and
``write_batch`` (several chunks in one write).
"""

from __future__ import annotations

import contextlib
import logging
import math
import secrets
import time
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from typing import Any, cast

import numpy as np
import zmq

from kvferry.control import wire
from kvferry.control.admission import check_auth, check_hello
from kvferry.control.core.states import RequestState, SessionState
from kvferry.control.core.timers import PeerClock
from kvferry.control.coverage import cover
from kvferry.control.digests import chunk_digests, source_digests
from kvferry.control.endpoints import (
    FLUSH_MS,
    EndpointBase,
    EndpointOptions,
    RequestRecord,
    Transfer,
    as_secret,
    auth_mac,
)
from kvferry.control.liveness import this_process
from kvferry.control.prefill_requests import (
    ChunkSpec,
    Planned,
    PrefillRequest,
    can_join,
    chunk_pairs,
    group_done,
    make_spec,
    num_decode_ranks,
    past_prefix,
)
from kvferry.control.pull import DEFAULT_MODE, MODE_REFUSAL, accepted_modes, mode_refusal
from kvferry.control.pull_source import PullSource
from kvferry.control.sessions import Session, drop_half_open
from kvferry.control.write_batch import Queued, group_cap, joinable, joined, share, write_groups
from kvferry.errors import (
    EndpointClosed,
    IntegrityError,
    KVFerryError,
    PeerLost,
    PlanError,
    ProtocolError,
    RequestAborted,
    RequestFailed,
    TransferTimeout,
    TransportError,
    UnknownRequest,
    UsageError,
)
from kvferry.integrity import DigestMode
from kvferry.integrity.binding import Binding, as_binding, check_binding
from kvferry.integrity.sampling import PageSampler
from kvferry.layout.memory import KVMemory
from kvferry.plan.contract import Plan
from kvferry.plan.pages import validate_pages
from kvferry.plan.planner import plan_pages
from kvferry.plan.prefix import check_prefix
from kvferry.transport import TransferHandle, Transport

__all__ = ["PrefillEndpoint"]

log = logging.getLogger("kvferry.control")

MAX_ISSUED = 1 << 16   # ids issue() remembers (see PrefillEndpoint._issued)


class PrefillEndpoint(EndpointBase, PullSource):
    """Prefill side of kvferry. Binds at construction; ``address`` is what decode passes to ``connect``.

    ``host``/``port`` (port 0: ephemeral) choose where to listen, loopback by default. ``transport``,
    ``secret``, ``digest_mode`` and ``options`` are as for ``DecodeEndpoint``; the stronger digest mode
    of the two sides is used. ``mode``: the transfer mode, or modes, accepted from decode (``"push"``:
    this side writes; ``"pull"``: decode reads this side's pages, see ``holds_source``); a decode asking
    for another is refused at the handshake (it raises ``ModeMismatch``).
    """

    _role = "prefill"

    def __init__(self, memory: KVMemory, transport: str | Transport = "nixl", *, host: str = "127.0.0.1",
                 port: int = 0, secret: str | bytes | None = None, digest_mode: Any = "sampled",
                 options: EndpointOptions | None = None, mode: str | Iterable[str] = DEFAULT_MODE) -> None:
        super().__init__(memory, transport, digest_mode=digest_mode, options=options)
        self._holds: set[PrefillRequest] = set()   # pull mode: records whose source pages decode may read
        self._cold: set[Session] = set()   # pull sessions offered a chunk, with no verdict yet (see _num_waiting)
        try:
            self.modes = accepted_modes(mode)
            self._secret = as_secret(secret)
            self._sock = self._new_socket(zmq.ROUTER)
            try:
                self._sock.bind(f"tcp://{host}:{port}")
            except zmq.ZMQError as exc:
                self._sock.close(0)
                raise EndpointClosed(f"prefill: cannot listen on tcp://{host}:{port}: {exc}") from exc
        except BaseException:
            self._release_resources()   # the thread never started: nothing else would close them
            raise
        self.address: str = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._poller.register(self._sock, zmq.POLLIN)
        # transport_liveness: libzmq's monitor says a connection dropped (a reset, or ZMTP heartbeats
        # unanswered for peer_timeout), not whose: ROUTER_NOTIFY, which would, is a draft API. So every
        # session not heard from since the last drop falls back to the silence rule (``_connected_for``).
        self._monitor: Any = None
        self._last_drop = -math.inf
        if self.options.transport_liveness:
            self._monitor = self._sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
            self._poller.register(self._monitor, zmq.POLLIN)
        self._sessions: dict[bytes, Session] = {}
        # Records (by identity: an id may have an old incarnation still settling) that are live, hold
        # handles, or owe decode a Fail; ``_dirty`` is the subset the progress loop must look at now.
        self._active: set[PrefillRequest] = set()
        self._dirty: set[PrefillRequest] = set()
        self._next_deadline_check = 0.0
        self._sampler = PageSampler()  # sampling for send()'s digests
        # What close() fails live requests with; decode hears of it as PeerLost (see _send_fail).
        self._close_error = KVFerryError("prefill endpoint closing")
        self._process = this_process()   # reported in Welcome: decode ends quarantines once it is gone
        self._unpeer: set[str] = set()    # decode agents to forget once no write to them is in flight
        self._hash_in_send = True         # see _may_use_source_digests
        # Ids issued before their send (``issue``), newest last, for ``options.refuse_unissued``; bounded: an
        # id older than MAX_ISSUED issues without its announce has long timed out on decode.
        self._issued: OrderedDict[str, None] = OrderedDict()
        self._thread.start()

    # -- public API: any thread ------------------------------------------------------------------------
    def send(self, request_id: str, pages: Mapping[str, Any], *, offset: int | Mapping[str, int] = 0,
             last: bool = True, buffers: Iterable[str] | None = None, binding: Any = None) -> None:
        """Non-blocking: hand over a request's ready KV (pool -> source pages) to be written.

        ``pages[pool][i]`` is the request's page ``offset + i``: it goes to decode's announced page
        ``dst[pool][offset + i - prefix[pool]]``, where ``prefix`` is what decode announced it already holds
        (``decode_prefix``; none by default). Positions before the prefix are skipped, neither planned,
        moved nor digested, so a caller may send the whole request before decode announced, or only the
        rest (``offset=prefix``); a prefix longer than the request fails it (``PlanError``). Chunked prefill calls
        this once per chunk with growing ``offset`` and ``last=True`` on the final one; layer-by-layer
        calls restrict ``buffers``. Writes start once decode has announced the request. Raises
        ``PlanError`` for pages outside this side's buffers or unknown pools/buffers, ``RequestFailed``
        if the request already failed, ``ValueError`` after the last chunk.

        With digests on, the chunk's source pages are hashed here, on the caller's thread and outside
        the endpoint's lock (sampled: tens of microseconds; full: one read pass over the chunk's bytes),
        so the progress thread only posts writes, and hashing chunk N+1 overlaps the write of chunk N.

        ``binding``: the tokens the KV was computed from (``integrity.binding``: a ``Binding``, or per-block
        entries), stated once, on any send (a later send may repeat it; a different one is a
        ``UsageError``). An announce whose binding differs fails the request on both sides before any
        byte moves (``BindingMismatch``: poll and wait say why).
        """
        bound = as_binding(binding)
        spec = make_spec(self.memory, pages, offset, last, buffers)
        if self._may_use_source_digests():
            spec.digests = source_digests(self.memory, self.digest_mode, spec.src, spec.buffers,
                                          self._sampler)
        self._preplan(request_id, spec)
        with self._lock:
            self._check_open()
            # This endpoint's records are all PrefillRequest: casts for the type checker, not checks.
            rec = cast("PrefillRequest | None", self._records.get(request_id))
            if rec is None:
                rec = cast(PrefillRequest, self._new_request(request_id, RequestState.BOOTSTRAPPING))
            self._issued.pop(request_id, None)   # its record answers for it from now on
            if rec.state is RequestState.DONE:
                raise UsageError(f"request {request_id!r} is already done")
            if rec.state is RequestState.FAILED:
                raise RequestFailed(request_id, str(rec.error)) from rec.error
            if rec.last_queued:
                raise UsageError(f"request {request_id!r}: the last chunk was already sent")
            if self._refused_binding(rec, bound):
                return
            self._queue(rec, spec)

    def issue(self, request_id: str) -> None:
        """Non-blocking: say that ``request_id`` is handed out to decode and its ``send`` will follow. With
        ``options.refuse_unissued`` an announce for an id neither issued nor sent is refused at once
        (``UnknownRequest``); an issued one waits for its send as usual. Idempotent; no deadline starts."""
        if not isinstance(request_id, str) or not 0 < len(request_id) <= wire.MAX_ID_LEN:
            raise UsageError(f"a request id is a str of 1 to {wire.MAX_ID_LEN} characters, got {request_id!r}")
        with self._lock:
            self._issued[request_id] = None
            self._issued.move_to_end(request_id)
            while len(self._issued) > MAX_ISSUED:
                self._issued.popitem(last=False)

    def _unissued(self, request_id: str, rec: PrefillRequest | None) -> UnknownRequest | None:
        """Why an announce for ``request_id`` is refused at once under ``options.refuse_unissued``, or None."""
        if not self.options.refuse_unissued:
            return None
        if rec is None and request_id not in self._issued:
            return UnknownRequest(f"request {request_id!r}: prefill {self.address} never issued it (no issue() nor "
                                  "send for it, or one so long ago that it is forgotten; refuse_unissued is on): "
                                  "refused at once, not at request_timeout")
        if rec is not None and rec.state is RequestState.DONE:
            return UnknownRequest(f"request {request_id!r}: prefill {self.address} served it already (done): an "
                                  "announce for it again (a replay) is refused")
        return None

    def _refused_binding(self, rec: PrefillRequest, bound: Binding | None) -> bool:
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
                self._fail_req(leader, error)
                return True
        return False

    def _preplan(self, request_id: str, spec: ChunkSpec) -> None:
        """Plan the chunk here, on the caller's thread, when decode has announced the request already (as
        engines mostly do: decode leases pages before prefill has computed them). The progress thread's
        time bounds push mode's throughput; it then only checks that the plan still matches the record
        (``Planned.matches``) and posts it. Anything unusual (no announce yet, a group of decode ranks,
        another TP size, a chunk outside the lease) is left to the progress thread, which plans (or
        fails the request) as before."""
        with self._lock:
            rec = self._records.get(request_id)
            if not isinstance(rec, PrefillRequest) or not rec.is_live or len(rec.group) > 1 or rec.prefix:
                return   # (a prefix: the progress thread cuts the chunk first, past_prefix)
            session, generation, dst = rec.session, rec.generation, rec.dst
        if session is None or session.planner is not None or session.remote is None:
            return
        try:
            pairs = chunk_pairs(request_id, dst, spec)
        except KVFerryError:
            return
        # Outside the lock: the record may move on meanwhile, which Planned.matches notices at posting.
        spec.planned = Planned(session, generation, dst, pairs, self._plan(session, pairs, spec.buffer_ids))

    def _may_use_source_digests(self) -> bool:
        """Whole-page digests hashed in ``send`` serve only equal-TP peers; when every connected peer is a
        cross-TP rank they would be thrown away (its chunks get slice digests from the plan), so skip them.
        With no peer yet, hash: the first to announce is most likely an equal-TP decode.

        Read without the lock (the progress thread keeps the answer, ``_note_sessions``): taking it here
        made ``send`` wait for the progress thread's iteration, NIXL write included, before it could hash,
        so the hashing no longer overlapped the write. A stale answer moves only where a chunk's digests
        are made (here, or from the plan when it is posted: ``chunk_digests``), never whether."""
        return self._hash_in_send

    def _note_sessions(self) -> None:
        """After an established session came or went (progress thread, under the lock)."""
        sessions = [s for s in self._sessions.values() if s.established]
        self._hash_in_send = not sessions or any(s.planner is None for s in sessions)

    def abort(self, request_id: str, reason: str = "aborted") -> None:
        """Non-blocking: fail the request and stop writing it. Decode hears of it (and frees its pages)
        only once every write already posted has settled. No-op for a request already ended. A request no
        decode announced yet (this side may never have heard of it) is kept FAILED, so a later announce is
        refused at once, and every decode peer is told now (``wire.Cancel``): its engine stops waiting for
        it within a message, not at its announce or timeout."""
        with self._lock:
            rec = self._records.get(request_id)
            if rec is None:
                if self._closing:
                    return   # closing fails every request anyway, and no decode is told any more
                rec = self._new_request(request_id, RequestState.BOOTSTRAPPING)
            rec = cast(PrefillRequest, rec)
            failed_now = rec.is_live
            self._fail_req(rec, RequestAborted(f"aborted by prefill: {reason}"))
            if failed_now and rec.session is None:
                self._call_soon(lambda: self._cancel_everywhere(request_id, reason))

    def _cancel_everywhere(self, request_id: str, reason: str) -> None:
        """Tell every decode peer that this prefill failed ``request_id`` before any announced it (progress
        thread): which decode will ask for it is not known yet."""
        data = wire.encode(wire.Cancel(request_id, f"aborted by prefill: {reason}"[:wire.MAX_REASON_LEN]))
        for session in self._sessions.values():
            if session.established:
                self._queue_out(session.identity, data)

    def decode_prefix(self, request_id: str) -> dict[str, int] | None:
        """What decode announced it already holds of ``request_id`` (pool -> leading pages; pools left out
        hold none), or None before decode announced it. ``send`` may start its pages there (``offset``) or
        at 0: positions before the prefix are skipped either way."""
        with self._lock:
            rec = self._records.get(request_id)
            if not isinstance(rec, PrefillRequest) or rec.session is None:
                return None
            return dict(rec.prefix)

    def holds_source(self, request_id: str) -> bool:
        """Non-blocking: whether the request's source pages may still be read (pull mode: until decode
        said it is done with them, see ``pull_source``; push mode: while a write of them is in flight).
        While True the caller must not reuse those pages. False for an unknown id."""
        with self._lock:
            rec = self._records.get(request_id)
            if not isinstance(rec, PrefillRequest):
                return False
            return any(m.source_held or m.handles or m.posting for m in rec.group)

    def may_free(self, request_id: str) -> bool:
        """Non-blocking: whether the engine may reuse ``request_id``'s source pages now: the request ended
        (DONE or FAILED) and nothing of it can still be read, by this side's writes (push) or by decode's
        reads (pull, until its verdict or the hold ends: docs/fencing.md). Per request: a failed request's
        own writes in flight keep its pages, nobody else's. True for an id this endpoint does not know
        (nothing was ever handed over)."""
        with self._lock:
            rec = self._records.get(request_id)
            if not isinstance(rec, PrefillRequest):
                return True
            if rec.is_live:
                return False
            return not any(m.source_held or m.handles or m.posting for m in rec.group)

    @property
    def num_live_handles(self) -> int:
        """Transfer handles not yet released (a leak check: 0 when idle)."""
        with self._lock:
            return sum(len(r.handles) for r in self._active)

    @property
    def peers(self) -> list[str]:
        """Session ids of the decode peers currently connected."""
        with self._lock:
            return [s.hello.session for s in self._sessions.values() if s.established]

    def counters(self) -> dict[str, int]:
        """Leak-check figures: all zero on an idle endpoint (except the bad-message count)."""
        with self._lock:
            return {"live_requests": sum(r.is_live for r in self._active),
                    "live_leases": 0, "live_handles": sum(len(r.handles) for r in self._active),
                    "peers": sum(s.established for s in self._sessions.values()),
                    "bad_messages": self.num_bad_messages,
                    "source_holds": len(self._holds)}

    def _done_pages(self, rec: RequestRecord) -> Mapping[str, Any]:
        return cast(PrefillRequest, rec).dst   # decode's pages this record wrote: as many as this side's

    def _gauges(self) -> dict[str, int]:
        return {"live_requests": sum(r.is_live for r in list(self._active)), "source_holds": len(self._holds),
                "peers": sum(s.established for s in list(self._sessions.values()))}

    # -- records and groups (under the lock) ----------------------------------------------------------
    def _new_request(self, request_id: str, state: RequestState) -> PrefillRequest:
        rec = PrefillRequest(request_id, state, time.monotonic() + self.options.request_timeout)
        self._remember(rec)
        self._active.add(rec)
        self._changed = True
        return rec

    def _queue(self, rec: PrefillRequest, spec: ChunkSpec) -> None:
        """Queue a chunk for every decode rank of the request, and keep it for those not yet announced."""
        if rec.history is not None:
            rec.history.append(spec)
        rec.last_queued = spec.last
        for member in rec.group:
            member.pending.append(spec)
            member.last_queued = spec.last
            # Not announced yet: the announcement posts the queue, so waking the thread now is wasted.
            if member.session is not None:
                self._call_soon(lambda m=member: self._post_ready(m))

    def _join(self, leader: PrefillRequest, session: Session, generation: int, dst: dict[str, np.ndarray],
              prefix: dict[str, int]) -> None:
        """Another decode rank announced a request this rank already serves (decode TP > prefill TP): a
        record of its own, given every chunk queued so far; the leader is DONE only once all are."""
        rec = PrefillRequest(leader.request_id, RequestState.WAITING_FOR_INPUT, leader.deadline)
        rec.group = leader.group
        rec.group.append(rec)
        rec.pending.extend(leader.history or ())
        rec.last_queued = leader.last_queued
        self._active.add(rec)
        self._bind(rec, session, generation, dst, prefix)
        if len(rec.group) >= leader.expected:
            leader.history = None  # every decode rank has its copy of the queue

    # -- posting writes (progress thread) --------------------------------------------------------------
    def _post_ready(self, rec: PrefillRequest) -> None:
        if rec.session is None or not rec.session.established:
            return
        while rec.pending and rec.is_live:
            spec = rec.pending.popleft()
            try:
                self._post_chunk(rec, spec)
            except KVFerryError as exc:
                self._fail_req(rec, exc)

    def _post_chunk(self, rec: PrefillRequest, sent: ChunkSpec) -> None:
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
            plan = self._plan(session, pairs, spec.buffer_ids)
        cover(self.memory.layout, rec, spec)
        index = rec.next_chunk
        rec.next_chunk += 1
        mode = self.digest_mode.stronger(session.digest_mode)
        digests = chunk_digests(mode, spec.digests, pairs, plan, rec.generation, index)
        chunk = wire.Chunk(rec.request_id, rec.generation, index, spec.last, rec.next_chunk if spec.last else 0,
                           digests)
        self._check_current(rec, session)
        if session.mode == "pull":
            self._offer(rec, session, spec, pairs, chunk)   # decode reads it: this side writes nothing
        else:
            queued = Queued(rec, plan, wire.encode(chunk), f"{rec.request_id}#{index}")
            if self._batches.wanted() and self.options.batch_chunks > 1 and joinable(plan):
                # Posted once the calls, or the messages, of this iteration ran: with what else is ready.
                rec.posting = True
                self._batches.add(session, queued)
            else:
                self._post_group(session, [queued])
        self._dirty.add(rec)
        rec.last_posted = spec.last
        if rec.is_live and rec.state is not RequestState.TRANSFERRING:
            self._set_state(rec, RequestState.TRANSFERRING)

    def _post_batches(self) -> None:
        """Post the chunks queued in this iteration (``control.write_batch``): per decode, those ready go
        as few writes as the caps allow (each checked again as it is carried out, ``_carry_out``)."""
        # The window: requests some decode announced that have not ended here (a record before its
        # announce, one the caller sent ahead of decode, has no session).
        cap = group_cap(self.options.batch_chunks, sum(1 for rec in self._active if rec.session is not None))
        for session, queued in self._batches.take():
            for group in write_groups(queued, cap, self.options.batch_bytes):
                self._post_group(session, group)

    def _still_current(self, rec: PrefillRequest, session: Session) -> bool:
        rec.posting = False
        try:
            self._check_current(rec, session)
        except KVFerryError as exc:
            self._fail_req(rec, exc)   # a no-op for a record that failed meanwhile; either way it settles
            return False
        rec.posting = True
        return True

    def _post_group(self, session: Session, group: list[Queued]) -> None:
        """Decide one write of ``group``'s chunks (one, or several sharing it): queued, and carried out
        once the event being handled is (``_carry_out``); its records count as writes in flight from now."""
        self._queue_transfer(session, group, [q.rec for q in group])

    def _carry_out(self, transfer: Transfer) -> None:
        """Post one queued write, between events, with the endpoint's lock let go (``_unlocked``): on one
        host (cma) the copy runs inside this call, hundreds of microseconds with the GIL released, and
        callers' ``send`` (hashing, queueing the next chunk) and ``wait`` then proceed alongside it rather
        than queue behind the whole iteration. Each record is checked again first (the lock was free since
        the decision: one that failed or lost its session is not written); a write that fails to post
        fails every record in it.

        Only this thread touches the transport and posts or settles writes, so what a caller may do in
        the meantime cannot race the write: ``send`` queues, ``abort`` fails the record (its settled
        Fail is sent by this thread, after the handle below is recorded, once it settled), and
        ``holds_source`` counts ``posting`` as a write in flight."""
        session: Session = transfer.peer
        group = [q for q in transfer.group if self._still_current(q.rec, session)]
        if not group:
            return
        recs = [q.rec for q in group]
        plan, label = joined(group)
        notif = group[0].data if len(group) == 1 else wire.batch_frame([q.data for q in group])
        try:
            handle = self._unlocked(recs, lambda: self.transport.write(plan, session.agent, notif, label=label))
        except KVFerryError as exc:
            for rec in recs:
                self._fail_req(rec, exc)
            return
        handle = self._stats.posted(plan, handle)
        for rec, member in zip(recs, share(handle, len(recs)), strict=True):
            rec.handles.append(member)

    def _check_current(self, rec: PrefillRequest, session: Session) -> None:
        """Right before a write: the session is alive by our own clock and the request still current.

        Not the fence (a stall right after this check still posts; decode's quarantine keeps those pages
        from any other request until we settle), but it keeps a prefill that resumes from a stall from
        writing for a decode that has long given up on it."""
        # Judged by what decode heard from us (its peer_timeout runs from our last message), not by what
        # we heard from it: frames it sent before giving up on us may still be queued here.
        now = time.monotonic()
        unheard = session.clock.unheard_for(now)
        if not session.established or session.suspect or session.clock.we_were_silent(now):
            raise PeerLost(f"{session.label} heard nothing from this prefill for {unheard:.2f} s (peer_timeout "
                           f"{self.options.peer_timeout} s) and has declared it dead: not writing request "
                           f"{rec.request_id!r}")
        if not rec.is_live or rec.session is not session:
            raise PeerLost(f"request {rec.request_id!r} generation {rec.generation} is no longer current")

    def _plan(self, session: Session, pairs: dict[str, tuple[np.ndarray, np.ndarray]],
              buffer_ids: np.ndarray | None) -> Plan:
        """Whole pages at equal TP; across TP, this rank's head slices through the session's planner.

        Trusting: source pages were validated by ``send`` (``make_spec``), destination pages when the
        announce arrived (``_check_announce``), their counts by ``chunk_pairs``, the shapes at the handshake."""
        assert session.remote is not None
        if session.planner is not None:
            return session.planner.plan_pages(pairs, buffer_ids)
        return plan_pages(self.memory, session.remote, pairs, buffer_ids)

    # -- failure and settling (progress thread or caller, under the lock) ------------------------------
    def _fail_req(self, rec: PrefillRequest, error: KVFerryError) -> None:
        self._fail_one(rec, error)
        for member in rec.group:  # fail closed: one decode rank's failure is the request's
            if member is not rec and member.is_live:
                self._fail_one(member, error)

    def _fail_closed(self, rec: RequestRecord, error: KVFerryError) -> None:
        self._fail_req(cast(PrefillRequest, rec), error)

    def _fail_one(self, rec: PrefillRequest, error: KVFerryError) -> None:
        failed_now = self._fail(rec, error)
        rec.pending.clear()
        self._active.add(rec)   # keep it until its handles settle and decode is told
        self._dirty.add(rec)
        if failed_now and rec.handles and rec.session is not None:
            # Tell decode at once (it must not report DONE for a request we failed), but unsettled: the
            # pages stay leased until the settled Fail follows. A chunk notification that beats this
            # message to decode may still complete the request there, with verified bytes.
            self._call_soon(lambda: self._send_fail(rec, settled=False))
        self._wake()

    def _send_fail(self, rec: PrefillRequest, *, settled: bool) -> None:
        session = rec.session
        if session is None or not session.established:
            return
        err = rec.error or KVFerryError("failed")
        # This endpoint closing is, to decode, its peer leaving: its waiters get PeerLost, as after a Bye.
        kind = "peer_lost" if err is self._close_error else wire.error_kind(err)
        self._send(session, wire.Fail(rec.request_id, rec.generation, str(err)[:wire.MAX_REASON_LEN], kind,
                                      settled))

    def _poll_handles(self, rec: PrefillRequest) -> None:
        still: list[TransferHandle] = []
        for handle in rec.handles:
            try:
                done = handle.poll()
            except TransportError as exc:
                done = True
                self._fail_req(rec, exc)
            if done:
                handle.release()
            else:
                still.append(handle)
        rec.handles = still

    def _settle(self, rec: PrefillRequest) -> None:
        """With no write in flight: finish, or tell decode the failure is settled; then forget it."""
        if rec.handles or rec.posting:   # posting: a chunk queued for this iteration's write
            return
        if rec.is_live and rec.last_posted and rec.decode_ok and group_done(rec):
            self._set_state(rec, RequestState.DONE)
            if rec.leader is not rec:
                self._dirty.add(rec.leader)  # the leader may be waiting for this decode rank only
        if not rec.is_live:
            rec.history = None
        session = rec.session
        if (rec.state is RequestState.FAILED and not rec.fail_sent and session is not None
                and session.established):
            self._send_fail(rec, settled=True)
            rec.fail_sent = True
        if (not rec.is_live and not rec.handles and not rec.source_held
                and (rec.fail_sent or rec.state is RequestState.DONE or session is None
                     or not session.established)):
            self._active.discard(rec)

    def _post_queued(self) -> None:
        if self._batches:
            self._post_batches()

    def _pump(self) -> bool:
        try:
            self.transport.get_notifications()  # prefill expects none; the call drives the backend's progress
        except KVFerryError as exc:  # handles report their own failures; the loop goes on
            log.warning("prefill: driving the transport failed: %s", exc)
        settled = False
        for rec in list(self._dirty):
            if rec.handles:
                self._poll_handles(rec)
            self._settle(rec)
            if not rec.handles or rec not in self._active:
                self._dirty.discard(rec)
                settled = True
        if self._unpeer and settled:
            self._forget_peers()
        return settled

    # -- messages (progress thread) --------------------------------------------------------------------
    def _on_frames(self, sock: Any, frames: list[bytes]) -> None:
        if sock is self._monitor:
            self._last_drop = self._recv_time
            return
        if len(frames) != 2:
            raise ProtocolError(f"expected identity and one frame, got {len(frames)} frames")
        identity, data = frames
        session = self._sessions.get(identity)
        try:
            msg = wire.decode(data)
        except ProtocolError as exc:
            if session is None or not session.established:
                self._reject(identity, str(exc))  # e.g. another protocol version: say why, in a Reject
            raise
        if session is not None:
            session.clock.heard(self._recv_time)
        if isinstance(msg, wire.Batch):
            self._on_batch(wire.unbatch(msg), lambda m: self._on_msg(identity, m, b""))
        else:
            self._on_msg(identity, msg, data)

    def _on_msg(self, identity: bytes, msg: Any, data: bytes) -> None:
        """One message from ``identity``, alone or out of a Batch (``data`` empty: a Batch's, in order, each
        handled as if it had come alone)."""
        session = self._sessions.get(identity)
        if isinstance(msg, wire.Hello):
            if not data:  # the MAC binds a Hello's own frame: it comes alone
                raise ProtocolError("Hello inside a Batch")
            self._on_hello(identity, session, msg, data)
        elif session is None:
            # A session we declared dead (or never had) must handshake again, not be heard silently.
            self._send_now(identity, wire.encode(wire.Bye("unknown session: handshake again")))
            raise ProtocolError(f"{type(msg).__name__} before Hello")
        elif session.state is SessionState.CHALLENGED:
            self._on_auth(session, msg)
        elif session.established:
            self._on_message(session, msg)

    def _on_message(self, session: Session, msg: Any) -> None:
        if isinstance(msg, wire.Announce):
            self._on_announce(session, msg)
        elif isinstance(msg, wire.Result):
            self._on_result(session, msg)
        elif isinstance(msg, wire.Abort):
            self._on_abort(session, msg)
        elif isinstance(msg, wire.Cancel):
            self._on_cancel(session, msg)
        elif isinstance(msg, wire.Bye):
            self._session_dead(session, PeerLost(f"{session.label} left: {msg.reason}"))
        elif not isinstance(msg, wire.Heartbeat):
            raise ProtocolError(f"unexpected {type(msg).__name__} from {session.label}")

    def _on_announce(self, session: Session, msg: wire.Announce) -> None:
        try:
            dst = self._check_announce(session, msg)
            prefix = check_prefix(session.remote.layout, msg.prefix, f"announce from {session.label}")
        except KVFerryError as exc:
            self._refuse(session, msg, exc)
            return
        theirs = wire.announced_binding(msg)
        rec = self._records.get(msg.request_id)
        unknown = self._unissued(msg.request_id, cast("PrefillRequest | None", rec))
        if unknown is not None:
            self._refuse(session, msg, unknown)
            return
        if isinstance(rec, PrefillRequest):
            error = check_binding(msg.request_id, theirs, rec.leader.binding)
            if error is not None:   # refused before any byte moves, on both sides
                if rec.is_live and rec.session is None:
                    self._fail_req(rec, error)
                self._refuse(session, msg, error)
                return
        if isinstance(rec, PrefillRequest) and rec.is_live and rec.session is not None:
            if not can_join(rec, session):
                self._refuse(session, msg, PlanError(f"request {msg.request_id!r} is already announced and live"))
                return
            self._join(rec, session, msg.generation, dst, prefix)
            rec.group[-1].decode_binding = theirs
            self._post_and_ack(rec.group[-1], msg)
            return
        if isinstance(rec, PrefillRequest) and rec.state is RequestState.FAILED and rec.session is None:
            self._refuse(session, msg, rec.error or KVFerryError("failed before it was announced"))
            return
        if not isinstance(rec, PrefillRequest) or not rec.is_live:
            rec = self._new_request(msg.request_id, RequestState.WAITING_FOR_INPUT)
        self._bind(rec, session, msg.generation, dst, prefix)
        rec.decode_binding = theirs
        self._post_and_ack(rec, msg)

    def _post_and_ack(self, rec: PrefillRequest, msg: wire.Announce) -> None:
        """Post what is queued; acknowledge only when nothing was: a posted chunk's notification tells
        decode as much, and one ZMQ message fewer per request is CPU saved on both sides."""
        self._post_ready(rec)
        if rec.next_chunk == 0 and rec.is_live and rec.session is not None:
            self._send(rec.session, wire.Ack(msg.request_id, msg.generation))

    def _check_announce(self, session: Session, msg: wire.Announce) -> dict[str, np.ndarray]:
        assert session.remote is not None
        # Decode's own lease table checked these; a peer's pages are untrusted input all the same.
        return validate_pages(session.remote.layout, "destination", wire.decode_pages(msg.pages), PlanError,
                              unique=True)

    def _bind(self, rec: PrefillRequest, session: Session, generation: int, dst: dict[str, np.ndarray],
              prefix: dict[str, int]) -> None:
        rec.session, rec.generation, rec.dst = session, generation, dst
        rec.prefix, rec.request_pages = prefix, {}
        rec.coverage = {}   # made per pool when a chunk needs it (see coverage.cover)
        if rec.leader is rec:
            rec.expected = num_decode_ranks(self.memory.layout, session)
        if rec.state is RequestState.BOOTSTRAPPING:
            self._set_state(rec, RequestState.WAITING_FOR_INPUT)

    def _refuse(self, session: Session, msg: wire.Announce, error: KVFerryError) -> None:
        # Nothing was or will be written under this generation, so decode may free the pages at once.
        self._send(session, wire.Fail(msg.request_id, msg.generation, str(error)[:wire.MAX_REASON_LEN],
                                      wire.error_kind(error), True))

    def _on_result(self, session: Session, msg: wire.Result) -> None:
        rec = self._match(session, msg.request_id, msg.generation)
        if rec is None:
            return
        self._release_source(rec)  # pull mode: decode reads no more of it, whatever its verdict
        if not session.read_once:
            session.read_once = True
            self._cold.discard(session)
        if msg.ok:
            rec.decode_ok = True
            self._dirty.add(rec)
        else:
            self._fail_req(rec, IntegrityError(f"{session.label} rejected the bytes: {msg.reason}"))

    def _on_abort(self, session: Session, msg: wire.Abort) -> None:
        held = self._held_for(session, msg.request_id, msg.generation)
        if held is not None:  # pull mode: decode reads no more of it (it failed it, or acknowledges our Fail)
            self._release_source(held)
        rec = self._match(session, msg.request_id, msg.generation) or self._in_flight(session, msg)
        if rec is None:  # no write of this generation is in flight, from any session with this decode
            self._send(session, wire.Fail(msg.request_id, msg.generation, "unknown request or settled", "error",
                                          True))
            return
        self._fail_req(rec, RequestAborted(f"aborted by {session.label}: {msg.reason}"))
        rec.session = session  # a reconnected decode asking about its old session: answer on this one
        rec.fail_sent = False  # decode waits for a settled Fail for this generation, even a repeated one
        self._active.add(rec)
        self._dirty.add(rec)

    def _on_cancel(self, session: Session, msg: wire.Cancel) -> None:
        """Decode will never announce the request: fail it now (a record not yet announced by any decode),
        or remember the failure for a ``send`` still to come. A record another decode announced is not
        this decode's to end."""
        rec = self._records.get(msg.request_id)
        if isinstance(rec, PrefillRequest) and rec.is_live and rec.session not in (None, session):
            return
        if not isinstance(rec, PrefillRequest) or not rec.is_live:
            if rec is not None:
                return   # ended already: nothing held for it
            rec = cast(PrefillRequest, self._new_request(msg.request_id, RequestState.BOOTSTRAPPING))
        self._fail_req(rec, RequestAborted(f"cancelled by {session.label} before it announced the request: "
                                           f"{msg.reason}"))

    def _in_flight(self, session: Session, msg: wire.Abort) -> PrefillRequest | None:
        """A record still writing this generation to this decode (its agent), in any session: an older
        session's, or an older incarnation of the request id that ``_match`` does not see."""
        for rec in self._active:
            old = rec.session
            if ((rec.handles or rec.posting) and rec.request_id == msg.request_id and rec.generation == msg.generation
                    and old is not None and old.agent == session.agent):
                return rec
        return None

    def _match(self, session: Session, request_id: str, generation: int) -> PrefillRequest | None:
        rec = self._records.get(request_id)
        for member in rec.group if isinstance(rec, PrefillRequest) else ():
            if member.session is session and member.generation == generation:
                return member
        return None

    # -- handshake (progress thread) -------------------------------------------------------------------
    def _on_hello(self, identity: bytes, session: Session | None, msg: wire.Hello, data: bytes) -> None:
        if session is not None and session.established:
            raise ProtocolError(f"Hello on the established {session.label}")
        self._sessions.pop(identity, None)
        drop_half_open(self._sessions)
        now = time.monotonic()
        session = Session(identity, msg, bytes(data), now + self.options.handshake_timeout,
                          PeerClock(now, self.options.heartbeat_interval, self.options.peer_timeout))
        self._sessions[identity] = session
        if self._secret is not None:
            self._send(session, wire.Challenge(session.nonce))
        else:
            self._establish(session)

    def _on_auth(self, session: Session, msg: Any) -> None:
        if not isinstance(msg, wire.Auth) or self._secret is None:
            raise ProtocolError(f"expected Auth from {session.label}, got {type(msg).__name__}")
        if not check_auth(self._secret, session, msg.mac):
            self._reject(session.identity, "authentication failed: the shared secret does not match")
            return
        self._establish(session)

    def _establish(self, session: Session) -> None:
        problem = check_hello(self.memory, self.transport, session) or self._mode_problem(session)
        if problem is not None:
            self._reject(session.identity, problem)
            return
        for other in list(self._sessions.values()):
            if other is not session and other.agent == session.agent and other.established:
                self._session_dead(other, PeerLost(f"{other.label} replaced by a new session of the same agent"))
        session.digest_mode = DigestMode.from_peer(session.hello.digest_mode)
        session.move(SessionState.ESTABLISHED)
        self._note_sessions()
        proof = b"" if self._secret is None else auth_mac(self._secret, b"prefill", session.hello.nonce,
                                                         session.nonce, session.hello_bytes)
        me = self._process
        self._send(session, wire.Welcome(secrets.token_hex(8), self.memory.manifest(), self.transport_metadata,
                                         proof, self.options.heartbeat_interval,
                                         self.digest_mode.stronger(session.digest_mode), me.host, me.pid,
                                         me.started, session.mode, self.options.peer_timeout))

    def _mode_problem(self, session: Session) -> str | None:
        """Why decode's transfer mode cannot be served, or None: refused before any byte moves."""
        if session.mode not in self.modes:
            return mode_refusal(session.label, session.mode, self.modes)
        if session.mode == "pull" and session.planner is not None:
            decode_tp = session.remote.layout.tp_size if session.remote is not None else "?"
            return (f"{MODE_REFUSAL} 'pull' refused: {session.label}: pull mode is built for equal TP sizes "
                    f"only (prefill TP {self.memory.layout.tp_size}, decode TP {decode_tp}); connect in push mode")
        return None

    def _reject(self, identity: bytes, reason: str) -> None:
        self._sessions.pop(identity, None)
        self._send_now(identity, wire.encode(wire.Reject(reason[:wire.MAX_REASON_LEN])))

    # -- timers (progress thread) ----------------------------------------------------------------------
    def _num_waiting(self) -> int:
        return len(self._dirty) + len(self._cold)

    def _tick(self, now: float) -> None:
        for session in list(self._sessions.values()):
            self._tick_session(session, now)
        if self._holds:
            self._tick_holds(now)
        if now >= self._next_deadline_check:
            self._next_deadline_check = now + 0.01
            for rec in list(self._active):
                if rec.is_live and now > rec.deadline:
                    self._fail_req(rec, TransferTimeout(f"request {rec.request_id!r} not done within "
                                                        f"{self.options.request_timeout} s"))

    def _tick_session(self, session: Session, now: float) -> None:
        if session.state is SessionState.CHALLENGED and now > session.deadline:
            self._sessions.pop(session.identity, None)
        elif not session.established:
            return
        elif session.suspect:
            self._session_dead(session, PeerLost(f"{session.label} heard nothing from this prefill for more than "
                                                 f"peer_timeout {self.options.peer_timeout} s (this process "
                                                 "stalled): it has declared us dead"))
        elif session.clock.peer_lost(now, self._connected_for(session)):
            self._session_dead(session, PeerLost(f"{session.label} silent for {session.clock.silent_for(now):.2f} s "
                                                 f"(peer_timeout {self.options.peer_timeout} s)"))
        elif session.clock.heartbeat_due(now):
            self._send(session, wire.Heartbeat())

    def _connected_for(self, session: Session) -> bool | None:
        """True while no connection dropped since we last heard ``session`` (its own still stands, with
        libzmq's heartbeats answered); None (silence decides, as without transport_liveness) otherwise."""
        connected = self._connected()
        return connected if connected is None or session.clock.last_seen > self._last_drop else None

    def _check_silence(self, now: float) -> None:
        # Before reading: a session we sent nothing to for longer than peer_timeout (this process stalled)
        # has been declared dead by its decode, whatever frames queued meanwhile say. It posts nothing
        # more; what those frames report (a verdict, an abort) is still read, then _tick ends the session.
        for session in self._sessions.values():
            if session.established and session.clock.we_were_silent(now):
                session.suspect = True

    def _socket_failed(self, sock: Any, exc: zmq.ZMQError) -> None:
        # The one ROUTER serves every decode: without it this endpoint cannot go on. Stop the loop, which
        # fails every request and session with the cause.
        raise EndpointClosed(f"prefill: receiving on {self.address} failed: {exc}") from exc

    def _fail_peers(self, error: KVFerryError) -> None:
        for session in self._sessions.values():
            session.move(SessionState.DEAD)
        self._note_sessions()

    def _session_dead(self, session: Session, error: KVFerryError) -> None:
        """Fail the session's requests, release their handles, forget the peer; others go on."""
        if not session.established:
            return
        # Best effort: a decode that still hears us learns it was dropped, and quarantines its leases.
        self._send(session, wire.Bye(str(error)[:wire.MAX_REASON_LEN]))
        session.move(SessionState.DEAD)
        self._cold.discard(session)
        self._hold_after_death(session, time.monotonic())
        for rec in list(self._active):
            if rec.session is session:
                # Decode's verdict may have come in the same frames as its goodbye (a batch, or one drain
                # of the socket): a request whose writes all completed and that decode verified is DONE,
                # not lost. Settle it first; only what is still open fails. A verified part of a request
                # other decode ranks still owe a verdict on (decode TP > prefill TP) has nothing left to
                # write or hear from this session: the group decides (its other ranks, or the deadline).
                self._poll_handles(rec)
                self._settle(rec)
                if rec.state is RequestState.DONE:
                    continue
                if rec.is_live and rec.decode_ok and rec.last_posted and not rec.handles:
                    continue
                self._fail_req(rec, error)
                self._poll_handles(rec)
                # Writes still in flight are not cancelled blind: they finish (or fail) under _pump, and
                # decode keeps the pages quarantined until we tell a reconnected decode they did.
                if not rec.handles and not rec.posting:
                    self._active.discard(rec)
                    self._dirty.discard(rec)
        self._sessions.pop(session.identity, None)
        self._note_sessions()
        self._unpeer.add(session.agent)
        self._forget_peers()
        self._changed = True

    def _forget_peers(self) -> None:
        """Remove from the transport the decode agents no session uses and no write in flight targets
        (removing one under a write in flight could fail it halfway, with no word on what landed)."""
        in_use = {s.agent for s in self._sessions.values()}
        self._unpeer -= in_use  # a session with that decode again: its own death will ask anew
        writing = {r.session.agent for r in self._active if (r.handles or r.posting) and r.session is not None}
        for agent in self._unpeer - writing:
            self._unpeer.discard(agent)
            with contextlib.suppress(TransportError):
                self.transport.remove_peer(agent)

    # -- sockets (progress thread) ---------------------------------------------------------------------
    def _send(self, session: Session, msg: Any) -> None:
        """Queue ``msg`` for ``session``'s decode; it leaves at the end of this iteration (``_flush``)."""
        self._queue_out(session.identity, wire.encode(msg))

    def _send_frame(self, identity: bytes, frame: bytes) -> None:
        self._send_raw(identity, frame)
        session = self._sessions.get(identity)
        if session is not None:  # what decode heard from us, for _check_current and heartbeats
            session.clock.sent(time.monotonic())

    def _send_now(self, identity: bytes, data: bytes) -> None:
        """Send what is queued for ``identity`` now, then ``data`` (if any) alone: a Reject, which any protocol
        version must read."""
        for frame in wire.batches(self._take_out(identity)):
            self._send_frame(identity, frame)
        if data:
            self._send_raw(identity, data)

    def _send_raw(self, identity: bytes, data: bytes) -> None:
        with contextlib.suppress(zmq.ZMQError):  # a vanished peer: heartbeats will notice
            self._sock.send_multipart([identity, data], zmq.NOBLOCK)

    def _shutdown_step(self) -> bool:
        for rec in list(self._active):
            self._fail_req(rec, self._close_error)
        for rec in [r for r in self._holds if r.session is None or not r.session.established]:
            self._release_source(rec)  # no decode left to answer: waiting would only delay the close
        self._pump()
        if self._active and time.monotonic() < self._close_deadline:
            return False
        for session in list(self._sessions.values()):
            if session.established:
                self._send(session, wire.Bye("prefill closing"))
        self._release_all()  # closed: the engine owns its memory again (docs/fencing.md)
        return True

    def _close_sockets(self) -> None:
        if self._monitor is not None:
            with contextlib.suppress(zmq.ZMQError):
                self._sock.disable_monitor()
            self._monitor.close(0)
        self._sock.close(FLUSH_MS)  # let the last Fail and Bye leave; bounded if the peer is gone
