"""The prefill endpoint: accepts decode peers, matches their announcements with ready KV, writes it.

Part of the control plane (layer 5). Prefill binds a ZMQ ROUTER; each decode connects, handshakes (layout
shapes compared, optional HMAC challenge) and announces requests with destination pages. The engine calls
``send`` as KV becomes ready: all at once, in chunks (an offset into decode's page list, the last one
marked), or restricted to some buffers (layer by layer). Either may come first. Each chunk becomes one
transport write whose notification carries the chunk's digests. A request is ``DONE`` here once every
write completed and decode reported the bytes verified. Whenever a request fails, decode is told with
``Fail(settled=True)`` only after every write of it has settled, because decode frees the pages then.
"""

from __future__ import annotations

import contextlib
import hmac
import secrets
import time
from collections import deque
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
import zmq

from ..errors import (
    IntegrityError,
    KVFerryError,
    LayoutError,
    PeerLost,
    PlanError,
    RequestFailed,
    TransferTimeout,
    TransportError,
)
from ..layout import Pool, model_difference, shape_difference
from ..memory import KVMemory
from ..plan import TransferPlan, plan_transfer
from ..tp import TPPlan, TPPlanner, source_ranks
from ..transport import TransferHandle, Transport
from . import wire
from .endpoints import (
    EndpointBase,
    EndpointOptions,
    RequestRecord,
    as_secret,
    auth_mac,
    integrity_module,
    stronger,
)
from .leases import as_page_array, check_pages
from .states import RequestState

__all__ = ["PrefillEndpoint"]

S = RequestState
MAX_HALF_OPEN = 256   # handshakes in progress; more are dropped (oldest first) so a flood cannot grow memory


class _Session:
    """One decode peer, keyed by its ZMQ identity. ``state``: challenged -> established -> dead."""

    def __init__(self, identity: bytes, hello: wire.Hello, hello_bytes: bytes, deadline: float) -> None:
        self.identity = identity
        self.hello = hello
        self.hello_bytes = hello_bytes
        self.nonce = secrets.token_bytes(32)
        self.state = "challenged"
        self.deadline = deadline
        self.remote: KVMemory | None = None
        self.agent = ""
        self.digest_mode = "off"
        # Set at the handshake when decode runs another TP size: plans (and digests) are per head slice.
        self.planner: TPPlanner | None = None
        self._writes: dict[str, np.ndarray] = {}
        self.last_seen = self.last_sent = time.monotonic()

    @property
    def label(self) -> str:
        return f"decode {self.hello.session[:12]}"

    @property
    def decode_rank(self) -> int:
        return 0 if self.remote is None else self.remote.layout.tp_rank

    def writes(self, pool: Pool) -> np.ndarray:
        """Bool per buffer of ``pool``: whether this prefill rank writes it to this decode rank (all, at
        equal TP; across TP a rank skips replicated buffers another rank sends)."""
        if self.planner is None:
            return np.ones(len(pool.buffers), dtype=bool)
        mask = self._writes.get(pool.name)
        if mask is None:  # once per pool and session: no per-buffer Python work per chunk
            mask = self._writes[pool.name] = np.array([b.name in self.planner.slices for b in pool.buffers])
        return mask


class _ChunkSpec:
    __slots__ = ("buffers", "digests", "last", "offsets", "src")

    def __init__(self, src: dict[str, np.ndarray], offsets: dict[str, int], last: bool,
                 buffers: tuple[str, ...] | None) -> None:
        self.src, self.offsets, self.last, self.buffers = src, offsets, last, buffers
        self.digests: Any = None   # integrity.SourceDigests hashed by send(), keyed once decode's pages are known


class _PReq(RequestRecord):
    """One request towards one decode rank. When decode runs more TP ranks than prefill, several decode
    ranks need this rank's heads of one request: the first record (the one ``send``/``wait`` see) leads a
    ``group`` of one record per decode rank, each with its own session, lease and writes."""

    __slots__ = ("coverage", "decode_ok", "dst", "expected", "fail_sent", "generation", "group", "handles",
                 "history", "last_posted", "last_queued", "next_chunk", "pending", "session")

    def __init__(self, request_id: str, state: RequestState, deadline: float) -> None:
        super().__init__(request_id, state, deadline)
        self.session: _Session | None = None
        self.generation = -1
        self.dst: dict[str, np.ndarray] = {}
        self.coverage: dict[str, np.ndarray] = {}     # pool -> bool [buffers of pool, destination pages]
        self.pending: deque[_ChunkSpec] = deque()
        self.handles: list[TransferHandle] = []
        self.next_chunk = 0
        self.last_queued = self.last_posted = self.decode_ok = self.fail_sent = False
        self.group: list[_PReq] = [self]              # shared by the group's records; the leader first
        self.expected = 1                             # decode ranks this request goes to (set at bind)
        self.history: list[_ChunkSpec] | None = []    # every chunk so far, for decode ranks still to come

    @property
    def leader(self) -> _PReq:
        return self.group[0]


class PrefillEndpoint(EndpointBase):
    """Prefill side of kvferry. Binds at construction; ``address`` is what decode passes to ``connect``.

    ``host``/``port`` (port 0: ephemeral) choose where to listen, loopback by default. ``transport``,
    ``secret``, ``digest_mode`` and ``options`` are as for ``DecodeEndpoint``; the stronger digest mode
    of the two sides is used.
    """

    _role = "prefill"

    def __init__(self, memory: KVMemory, transport: str | Transport = "nixl", *, host: str = "127.0.0.1",
                 port: int = 0, secret: str | bytes | None = None, digest_mode: Any = "sampled",
                 options: EndpointOptions | None = None) -> None:
        super().__init__(memory, transport, digest_mode=digest_mode, options=options)
        self._secret = as_secret(secret)
        self._sock = self._new_socket(zmq.ROUTER)
        self._sock.bind(f"tcp://{host}:{port}")
        self.address: str = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._poller.register(self._sock, zmq.POLLIN)
        self._sessions: dict[bytes, _Session] = {}
        # Records (by identity: an id may have an old incarnation still settling) that are live, hold
        # handles, or owe decode a Fail; ``_dirty`` is the subset the progress loop must look at now.
        self._active: set[_PReq] = set()
        self._dirty: set[_PReq] = set()
        self._next_deadline_check = 0.0
        self._digest_rng = np.random.default_rng()  # sampling for send()'s digests
        # What close() fails live requests with; decode hears of it as PeerLost (see _send_fail).
        self._close_error = KVFerryError("prefill endpoint closing")
        self._thread.start()

    # -- public API: any thread ------------------------------------------------------------------------
    def send(self, request_id: str, pages: Mapping[str, Any], *, offset: int | Mapping[str, int] = 0,
             last: bool = True, buffers: Iterable[str] | None = None) -> None:
        """Non-blocking: hand over a request's ready KV (pool -> source pages) to be written.

        ``pages[pool][i]`` goes to decode's announced page ``dst[pool][offset + i]``. Chunked prefill calls
        this once per chunk with growing ``offset`` and ``last=True`` on the final one; layer-by-layer
        calls restrict ``buffers``. Writes start once decode has announced the request. Raises
        ``PlanError`` for pages outside this side's buffers or unknown pools/buffers, ``RequestFailed``
        if the request already failed, ``ValueError`` after the last chunk.

        With digests on, the chunk's source pages are hashed here, on the caller's thread and outside
        the endpoint's lock (sampled: tens of microseconds; full: one read pass over the chunk's bytes),
        so the progress thread only posts writes, and hashing chunk N+1 overlaps the write of chunk N.
        """
        spec = self._make_spec(pages, offset, last, buffers)
        spec.digests = self._source_digests(spec)
        with self._lock:
            self._check_open()
            rec = self._records.get(request_id)
            if rec is None:
                rec = self._new_request(request_id, S.BOOTSTRAPPING)
            assert isinstance(rec, _PReq)
            if rec.state is S.DONE:
                raise ValueError(f"request {request_id!r} is already done")
            if rec.state is S.FAILED:
                raise RequestFailed(request_id, str(rec.error)) from rec.error
            if rec.last_queued:
                raise ValueError(f"request {request_id!r}: the last chunk was already sent")
            self._queue(rec, spec)

    def abort(self, request_id: str, reason: str = "aborted") -> None:
        """Non-blocking: fail the request and stop writing it. Decode hears of it (and frees its pages)
        only once every write already posted has settled. No-op for a request already ended."""
        with self._lock:
            rec = self._record(request_id)
            assert isinstance(rec, _PReq)
            self._fail_req(rec, KVFerryError(f"aborted by prefill: {reason}"))

    @property
    def num_live_handles(self) -> int:
        """Transfer handles not yet released (a leak check: 0 when idle)."""
        with self._lock:
            return sum(len(r.handles) for r in self._active)

    @property
    def peers(self) -> list[str]:
        """Session ids of the decode peers currently connected."""
        with self._lock:
            return [s.hello.session for s in self._sessions.values() if s.state == "established"]

    def counters(self) -> dict[str, int]:
        """Leak-check figures: all zero on an idle endpoint (except the bad-message count)."""
        with self._lock:
            return {"live_requests": sum(r.is_live for r in self._active),
                    "live_leases": 0, "live_handles": sum(len(r.handles) for r in self._active),
                    "peers": len(self.peers), "bad_messages": self.num_bad_messages}

    # -- validation of send() (caller's thread) --------------------------------------------------------
    def _make_spec(self, pages: Mapping[str, Any], offset: int | Mapping[str, int], last: bool,
                   buffers: Iterable[str] | None) -> _ChunkSpec:
        layout = self.memory.layout
        src: dict[str, np.ndarray] = {}
        for pool_name, value in pages.items():
            try:
                pool = layout.pool(pool_name)
            except LayoutError as exc:
                raise PlanError(str(exc)) from None
            arr = as_page_array(pool_name, value)
            check_pages(pool, arr, PlanError, unique=False)
            src[pool_name] = arr
        offsets = {p: _offset(offset, p) for p in src}
        names = None if buffers is None else tuple([buffers] if isinstance(buffers, str) else buffers)
        for name in names or ():
            if name not in self.memory.buffer_index:
                raise PlanError(f"no buffer {name!r} in layout")
        return _ChunkSpec(src, offsets, bool(last), names)

    def _source_digests(self, spec: _ChunkSpec) -> Any:
        """The chunk's source digests in this side's mode (None when off); keyed at posting time.

        Sampling draws from one endpoint generator (numpy's generators lock themselves, so callers on
        several threads are safe): a fresh choice per chunk, without seeding a generator per call."""
        if self.digest_mode == "off":
            return None
        integrity = integrity_module()
        return integrity.digest_pages(self.memory, spec.src, self.digest_mode, seed=self._digest_rng,
                                      buffers=spec.buffers)

    def _new_request(self, request_id: str, state: RequestState) -> _PReq:
        rec = _PReq(request_id, state, time.monotonic() + self.options.request_timeout)
        self._remember(rec)
        self._active.add(rec)
        self._changed = True
        return rec

    def _queue(self, rec: _PReq, spec: _ChunkSpec) -> None:
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

    def _join(self, leader: _PReq, session: _Session, generation: int, dst: dict[str, np.ndarray]) -> None:
        """Another decode rank announced a request this rank already serves (decode TP > prefill TP): a
        record of its own, given every chunk queued so far; the leader is DONE only once all are."""
        rec = _PReq(leader.request_id, S.WAITING_FOR_INPUT, leader.deadline)
        rec.group = leader.group
        rec.group.append(rec)
        rec.pending.extend(leader.history or ())
        rec.last_queued = leader.last_queued
        self._active.add(rec)
        self._bind(rec, session, generation, dst)
        if len(rec.group) >= leader.expected:
            leader.history = None  # every decode rank has its copy of the queue

    def _num_decode_ranks(self, session: _Session) -> int:
        """How many of ``session``'s decode TP group need this rank's heads of a request: 1 at equal TP
        or when decode runs fewer ranks, ``D / P`` when it runs more (each announces it here)."""
        if session.planner is None or session.remote is None:
            return 1
        local, dtp = self.memory.layout, session.remote.layout.tp_size
        return sum(local.tp_rank in source_ranks(d, local.tp_size, dtp) for d in range(dtp))

    def _can_join(self, leader: _PReq, session: _Session) -> bool:
        """A live request may take one record per decode rank that needs this rank, up to ``expected``."""
        ranks = {m.session.decode_rank for m in leader.group if m.session is not None}
        return (session.planner is not None and leader.is_live and len(leader.group) < leader.expected
                and session.decode_rank not in ranks)

    # -- posting writes (progress thread) --------------------------------------------------------------
    def _post_ready(self, rec: _PReq) -> None:
        if rec.session is None or rec.session.state != "established":
            return
        while rec.pending and rec.is_live:
            spec = rec.pending.popleft()
            try:
                self._post_chunk(rec, spec)
            except KVFerryError as exc:
                self._fail_req(rec, exc)

    def _post_chunk(self, rec: _PReq, spec: _ChunkSpec) -> None:
        session = rec.session
        assert session is not None and session.remote is not None
        pairs = {pool: (src, self._dst_slice(rec, pool, spec.offsets[pool], len(src)))
                 for pool, src in spec.src.items()}
        plan = self._plan(session, pairs, spec.buffers)
        self._cover(rec, spec)
        index = rec.next_chunk
        rec.next_chunk += 1
        chunk = wire.Chunk(rec.request_id, rec.generation, index, spec.last, rec.next_chunk if spec.last else 0,
                           self._chunk_digests(spec, pairs, plan, session, rec, index))
        handle = self.transport.write(plan, session.agent, wire.encode(chunk), label=f"{rec.request_id}#{index}")
        rec.handles.append(handle)
        self._dirty.add(rec)
        rec.last_posted = spec.last
        if rec.state is not S.TRANSFERRING:
            self._set_state(rec, S.TRANSFERRING)

    def _dst_slice(self, rec: _PReq, pool: str, offset: int, count: int) -> np.ndarray:
        dst = rec.dst.get(pool)
        if dst is None:
            raise PlanError(f"request {rec.request_id!r}: decode leased no pages in pool {pool!r}")
        if offset + count > len(dst):
            raise PlanError(f"request {rec.request_id!r}, pool {pool!r}: chunk covers destination positions "
                            f"{offset}..{offset + count - 1} but decode leased {len(dst)} pages")
        return dst[offset:offset + count]

    def _plan(self, session: _Session, pairs: dict[str, tuple[np.ndarray, np.ndarray]],
              buffers: tuple[str, ...] | None) -> TransferPlan | TPPlan:
        """Whole pages at equal TP; across TP, this rank's head slices through the session's planner."""
        assert session.remote is not None
        if session.planner is not None:
            return session.planner.plan(pairs, buffers)
        return plan_transfer(self.memory, session.remote, pairs, buffers=buffers)

    def _cover(self, rec: _PReq, spec: _ChunkSpec) -> None:
        """Mark the (buffer, destination page) cells this chunk writes; a cell written twice is refused, and
        on the last chunk a cell never written is too.

        Across TP a cell is this rank's slice of the page: other ranks' slices are theirs to check, and
        buffers this rank does not write to this decode rank count as written. The common case, the whole
        request in one chunk, writes every cell exactly once by construction and needs no bookkeeping."""
        if rec.next_chunk == 0 and spec.last and self._is_whole(rec, spec):
            return
        session = rec.session
        assert session is not None
        for pool_name, src in spec.src.items():
            cov = self._coverage(rec, pool_name)
            mask = self._buffer_mask(pool_name, spec.buffers) & session.writes(self.memory.layout.pool(pool_name))
            cols = slice(spec.offsets[pool_name], spec.offsets[pool_name] + len(src))
            if cov[mask, cols].any():
                raise PlanError(f"request {rec.request_id!r}, pool {pool_name!r}: a chunk rewrites destination "
                                "pages an earlier chunk already wrote")
            cov[mask, cols] = True
        if spec.last:
            self._check_covered(rec)

    @staticmethod
    def _is_whole(rec: _PReq, spec: _ChunkSpec) -> bool:
        """The chunk writes every buffer of every leased page, each once (whole pages, equal TP)."""
        assert rec.session is not None
        if spec.buffers is not None or rec.session.planner is not None or spec.src.keys() != rec.dst.keys():
            return False
        return all(spec.offsets[p] == 0 and len(src) == len(rec.dst[p]) for p, src in spec.src.items())

    def _coverage(self, rec: _PReq, pool_name: str) -> np.ndarray:
        """Bool [buffers of the pool, leased pages]: cells written so far; made on first use."""
        cov = rec.coverage.get(pool_name)
        if cov is None:
            assert rec.session is not None
            pool = self.memory.layout.pool(pool_name)
            cov = rec.coverage[pool_name] = np.zeros((len(pool.buffers), len(rec.dst[pool_name])), dtype=bool)
            cov[~rec.session.writes(pool)] = True  # across TP: buffers another rank sends are not ours
        return cov

    def _buffer_mask(self, pool_name: str, buffers: tuple[str, ...] | None) -> np.ndarray:
        names = [b.name for b in self.memory.layout.pool(pool_name).buffers]
        if buffers is None:
            return np.ones(len(names), dtype=bool)
        return np.isin(names, buffers)

    def _check_covered(self, rec: _PReq) -> None:
        """On the last chunk: every buffer of every announced page must have been written."""
        for pool_name in rec.dst:
            cov = self._coverage(rec, pool_name)
            missing = np.argwhere(~cov)
            if len(missing):
                b, pos = (int(x) for x in missing[0])
                buf = self.memory.layout.pool(pool_name).buffers[b].name
                raise PlanError(f"request {rec.request_id!r}: last chunk sent but pool {pool_name!r}, buffer "
                                f"{buf!r}, destination page {int(rec.dst[pool_name][pos])} was never written "
                                f"({len(missing)} cells missing)")

    def _chunk_digests(self, spec: _ChunkSpec, pairs: Mapping[str, tuple[np.ndarray, np.ndarray]],
                       plan: TransferPlan | TPPlan, session: _Session, rec: _PReq, index: int) -> bytes:
        """Digest bytes for the chunk's notification: send()'s source digests keyed by decode's pages
        when they fit (whole pages, the mode this session needs), else hashed here from the plan."""
        mode = stronger(self.digest_mode, session.digest_mode)
        src = spec.digests
        if src is None or mode == "off" or isinstance(plan, TPPlan) or src.mode.value != mode:
            return self._digests(plan, session, rec, index)
        return bytes(src.keyed({pool: dst for pool, (_, dst) in pairs.items()}).to_bytes())

    def _digests(self, plan: TransferPlan | TPPlan, session: _Session, rec: _PReq, index: int) -> bytes:
        mode = stronger(self.digest_mode, session.digest_mode)
        if mode == "off":
            return b""
        integrity = integrity_module()
        seed = (rec.generation << 16) ^ index
        # A TPPlan gets slice digests: across TP a decode page is written by several prefill ranks.
        return bytes(integrity.digest_plan(plan, integrity.DigestMode(mode), seed=seed).to_bytes())

    # -- failure and settling (progress thread or caller, under the lock) ------------------------------
    def _group_done(self, rec: _PReq) -> bool:
        """The leader (what ``wait`` sees) is DONE only after every decode rank of the request is."""
        if rec.leader is not rec:
            return True
        return len(rec.group) >= rec.expected and all(m.state is S.DONE for m in rec.group[1:])

    def _fail_req(self, rec: _PReq, error: KVFerryError) -> None:
        self._fail_one(rec, error)
        for member in rec.group:  # fail closed: one decode rank's failure is the request's
            if member is not rec and member.is_live:
                self._fail_one(member, error)

    def _fail_one(self, rec: _PReq, error: KVFerryError) -> None:
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

    def _send_fail(self, rec: _PReq, *, settled: bool) -> None:
        session = rec.session
        if session is None or session.state != "established":
            return
        err = rec.error or KVFerryError("failed")
        # This endpoint closing is, to decode, its peer leaving: its waiters get PeerLost, as after a Bye.
        kind = "peer_lost" if err is self._close_error else wire.error_kind(err)
        self._send(session, wire.Fail(rec.request_id, rec.generation, str(err)[:wire.MAX_REASON_LEN], kind,
                                      settled))

    def _poll_handles(self, rec: _PReq) -> None:
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

    def _settle(self, rec: _PReq) -> None:
        """With no write in flight: finish, or tell decode the failure is settled; then forget it."""
        if rec.handles:
            return
        if rec.is_live and rec.last_posted and rec.decode_ok and self._group_done(rec):
            self._set_state(rec, S.DONE)
            if rec.leader is not rec:
                self._dirty.add(rec.leader)  # the leader may be waiting for this decode rank only
        if not rec.is_live:
            rec.history = None
        session = rec.session
        if rec.state is S.FAILED and not rec.fail_sent and session is not None and session.state == "established":
            self._send_fail(rec, settled=True)
            rec.fail_sent = True
        if not rec.is_live and (rec.fail_sent or rec.state is S.DONE or session is None
                                or session.state != "established"):
            self._active.discard(rec)

    def _pump(self) -> bool:
        self.transport.get_notifications()  # prefill expects none; the call drives the backend's progress
        settled = False
        for rec in list(self._dirty):
            if rec.handles:
                self._poll_handles(rec)
            self._settle(rec)
            if not rec.handles or rec not in self._active:
                self._dirty.discard(rec)
                settled = True
        return settled

    # -- messages (progress thread) --------------------------------------------------------------------
    def _on_frames(self, sock: Any, frames: list[bytes]) -> None:
        if len(frames) != 2:
            raise wire.ProtocolError(f"expected identity and one frame, got {len(frames)} frames")
        identity, data = frames
        session = self._sessions.get(identity)
        try:
            msg = wire.decode(data)
        except wire.ProtocolError as exc:
            if session is None or session.state != "established":
                self._reject(identity, str(exc))  # e.g. another protocol version: say why, in a Reject
            raise
        if session is not None:
            session.last_seen = time.monotonic()
        if isinstance(msg, wire.Hello):
            self._on_hello(identity, session, msg, data)
        elif session is None:
            raise wire.ProtocolError(f"{type(msg).__name__} before Hello")
        elif session.state == "challenged":
            self._on_auth(session, msg)
        elif session.state == "established":
            self._on_message(session, msg)

    def _on_message(self, session: _Session, msg: Any) -> None:
        if isinstance(msg, wire.Announce):
            self._on_announce(session, msg)
        elif isinstance(msg, wire.Result):
            self._on_result(session, msg)
        elif isinstance(msg, wire.Abort):
            self._on_abort(session, msg)
        elif isinstance(msg, wire.Bye):
            self._session_dead(session, PeerLost(f"{session.label} left: {msg.reason}"))
        elif not isinstance(msg, wire.Heartbeat):
            raise wire.ProtocolError(f"unexpected {type(msg).__name__} from {session.label}")

    def _on_announce(self, session: _Session, msg: wire.Announce) -> None:
        try:
            dst = self._check_announce(session, msg)
        except KVFerryError as exc:
            self._refuse(session, msg, exc)
            return
        rec = self._records.get(msg.request_id)
        if isinstance(rec, _PReq) and rec.is_live and rec.session is not None:
            if not self._can_join(rec, session):
                self._refuse(session, msg, PlanError(f"request {msg.request_id!r} is already announced and live"))
                return
            self._join(rec, session, msg.generation, dst)
            self._post_and_ack(rec.group[-1], msg)
            return
        if isinstance(rec, _PReq) and rec.state is S.FAILED and rec.session is None:
            self._refuse(session, msg, rec.error or KVFerryError("failed before it was announced"))
            return
        if not isinstance(rec, _PReq) or not rec.is_live:
            rec = self._new_request(msg.request_id, S.WAITING_FOR_INPUT)
        self._bind(rec, session, msg.generation, dst)
        self._post_and_ack(rec, msg)

    def _post_and_ack(self, rec: _PReq, msg: wire.Announce) -> None:
        """Post what is queued; acknowledge only when nothing was: a posted chunk's notification tells
        decode as much, and one ZMQ message fewer per request is CPU saved on both sides."""
        self._post_ready(rec)
        if rec.next_chunk == 0 and rec.is_live and rec.session is not None:
            self._send(rec.session, wire.Ack(msg.request_id, msg.generation))

    def _check_announce(self, session: _Session, msg: wire.Announce) -> dict[str, np.ndarray]:
        assert session.remote is not None
        dst = wire.decode_pages(msg.pages)
        for pool_name, arr in dst.items():
            try:
                pool = session.remote.layout.pool(pool_name)
            except LayoutError as exc:
                raise PlanError(str(exc)) from None
            check_pages(pool, arr, PlanError)
        return dst

    def _bind(self, rec: _PReq, session: _Session, generation: int, dst: dict[str, np.ndarray]) -> None:
        rec.session, rec.generation, rec.dst = session, generation, dst
        rec.coverage = {}   # made per pool when a chunk needs it (see _cover)
        if rec.leader is rec:
            rec.expected = self._num_decode_ranks(session)
        if rec.state is S.BOOTSTRAPPING:
            self._set_state(rec, S.WAITING_FOR_INPUT)

    def _refuse(self, session: _Session, msg: wire.Announce, error: KVFerryError) -> None:
        # Nothing was or will be written under this generation, so decode may free the pages at once.
        self._send(session, wire.Fail(msg.request_id, msg.generation, str(error)[:wire.MAX_REASON_LEN],
                                      wire.error_kind(error), True))

    def _on_result(self, session: _Session, msg: wire.Result) -> None:
        rec = self._match(session, msg.request_id, msg.generation)
        if rec is None:
            return
        if msg.ok:
            rec.decode_ok = True
            self._dirty.add(rec)
        else:
            self._fail_req(rec, IntegrityError(f"{session.label} rejected the bytes: {msg.reason}"))

    def _on_abort(self, session: _Session, msg: wire.Abort) -> None:
        rec = self._match(session, msg.request_id, msg.generation)
        if rec is None:  # never bound under this generation: nothing of it can land
            self._send(session, wire.Fail(msg.request_id, msg.generation, "unknown request", "error", True))
            return
        self._fail_req(rec, KVFerryError(f"aborted by {session.label}: {msg.reason}"))
        rec.fail_sent = False  # decode waits for a settled Fail for this generation, even a repeated one

    def _match(self, session: _Session, request_id: str, generation: int) -> _PReq | None:
        rec = self._records.get(request_id)
        for member in rec.group if isinstance(rec, _PReq) else ():
            if member.session is session and member.generation == generation:
                return member
        return None

    # -- handshake (progress thread) -------------------------------------------------------------------
    def _on_hello(self, identity: bytes, session: _Session | None, msg: wire.Hello, data: bytes) -> None:
        if session is not None and session.state == "established":
            raise wire.ProtocolError(f"Hello on the established {session.label}")
        self._sessions.pop(identity, None)
        self._drop_half_open()
        session = _Session(identity, msg, bytes(data), time.monotonic() + self.options.handshake_timeout)
        self._sessions[identity] = session
        if self._secret is not None:
            self._send(session, wire.Challenge(session.nonce))
        else:
            self._establish(session)

    def _on_auth(self, session: _Session, msg: Any) -> None:
        if not isinstance(msg, wire.Auth) or self._secret is None:
            raise wire.ProtocolError(f"expected Auth from {session.label}, got {type(msg).__name__}")
        want = auth_mac(self._secret, b"decode", session.nonce, session.hello.nonce, session.hello_bytes)
        if not hmac.compare_digest(msg.mac, want):
            self._reject(session.identity, "authentication failed: the shared secret does not match")
            return
        self._establish(session)

    def _establish(self, session: _Session) -> None:
        problem = self._check_hello(session)
        if problem is not None:
            self._reject(session.identity, problem)
            return
        for other in list(self._sessions.values()):
            if other is not session and other.agent == session.agent and other.state == "established":
                self._session_dead(other, PeerLost(f"{other.label} replaced by a new session of the same agent"))
        session.digest_mode = session.hello.digest_mode if session.hello.digest_mode in ("sampled", "full") \
            else "off"
        session.state = "established"
        proof = b"" if self._secret is None else auth_mac(self._secret, b"prefill", session.hello.nonce,
                                                         session.nonce, session.hello_bytes)
        self._send(session, wire.Welcome(secrets.token_hex(8), self.memory.manifest(), self.transport_metadata,
                                         proof, self.options.heartbeat_interval,
                                         stronger(self.digest_mode, session.digest_mode)))

    def _check_hello(self, session: _Session) -> str | None:
        hello = session.hello
        if hello.transport != self.transport.name:
            return f"transport differs: prefill uses {self.transport.name!r}, decode {hello.transport!r}"
        try:
            session.remote = KVMemory.from_manifest(hello.manifest)
        except LayoutError as exc:
            return f"malformed manifest: {exc}"
        problem = self._check_ranks(session, session.remote)
        if problem is not None:
            return problem
        try:
            session.agent = self.transport.add_peer(hello.transport_meta)
        except (KVFerryError, ValueError) as exc:
            return f"bad transport metadata: {exc}"
        return None

    def _check_ranks(self, session: _Session, remote: KVMemory) -> str | None:
        """Equal TP sizes: the shapes must match. Different: one model, and the session gets a planner
        that writes this rank's head slices. Either way decode's rank must need this prefill rank."""
        local, other = self.memory.layout, remote.layout
        cross = local.tp_size != other.tp_size
        diff = model_difference(local, other) if cross else shape_difference(local, other)
        if diff is not None:
            return f"layouts differ (local: prefill, remote: decode): {diff}"
        need = source_ranks(other.tp_rank, local.tp_size, other.tp_size)
        if local.tp_rank not in need:
            return (f"decode rank {other.tp_rank} of TP {other.tp_size} needs prefill ranks {list(need)} of TP "
                    f"{local.tp_size}; this prefill is rank {local.tp_rank}")
        if cross:
            if getattr(self.transport, "descriptors", "dlist") != "dlist":
                return "cross-TP writes move slices of pages: the transport must use descriptors='dlist'"
            session.planner = TPPlanner(self.memory, remote)  # slices derived once per session
        return None

    def _reject(self, identity: bytes, reason: str) -> None:
        self._sessions.pop(identity, None)
        self._send_raw(identity, wire.encode(wire.Reject(reason[:wire.MAX_REASON_LEN])))

    def _drop_half_open(self) -> None:
        half = [k for k, s in self._sessions.items() if s.state == "challenged"]
        for key in half[:max(0, len(half) - MAX_HALF_OPEN + 1)]:
            del self._sessions[key]

    # -- timers (progress thread) ----------------------------------------------------------------------
    def _is_busy(self) -> bool:
        return bool(self._dirty)

    def _tick(self, now: float) -> None:
        for session in list(self._sessions.values()):
            self._tick_session(session, now)
        if now >= self._next_deadline_check:
            self._next_deadline_check = now + 0.01
            for rec in list(self._active):
                if rec.is_live and now > rec.deadline:
                    self._fail_req(rec, TransferTimeout(f"request {rec.request_id!r} not done within "
                                                        f"{self.options.request_timeout} s"))

    def _tick_session(self, session: _Session, now: float) -> None:
        if session.state == "challenged" and now > session.deadline:
            self._sessions.pop(session.identity, None)
        elif session.state == "established":
            if now - session.last_seen > self.options.peer_timeout:
                self._session_dead(session, PeerLost(f"{session.label} silent for {now - session.last_seen:.2f} s "
                                                     f"(peer_timeout {self.options.peer_timeout} s)"))
            elif now - session.last_sent >= self.options.heartbeat_interval:
                self._send(session, wire.Heartbeat())

    def _session_dead(self, session: _Session, error: KVFerryError) -> None:
        """Fail the session's requests, release their handles, forget the peer; others go on."""
        if session.state != "established":
            return
        # Best effort: a decode that still hears us learns it was dropped, and quarantines its leases.
        self._send(session, wire.Bye(str(error)[:wire.MAX_REASON_LEN]))
        session.state = "dead"
        for rec in list(self._active):
            if rec.session is session:
                self._fail_req(rec, error)
                self._poll_handles(rec)
                for handle in rec.handles:  # decode treats us as dead too and keeps its pages lease_grace
                    handle.release()
                rec.handles = []
                self._active.discard(rec)
                self._dirty.discard(rec)
        self._sessions.pop(session.identity, None)
        with contextlib.suppress(TransportError):
            self.transport.remove_peer(session.agent)
        self._changed = True

    # -- sockets (progress thread) ---------------------------------------------------------------------
    def _send(self, session: _Session, msg: Any) -> None:
        self._send_raw(session.identity, wire.encode(msg))
        session.last_sent = time.monotonic()

    def _send_raw(self, identity: bytes, data: bytes) -> None:
        with contextlib.suppress(zmq.ZMQError):  # a vanished peer: heartbeats will notice
            self._sock.send_multipart([identity, data], zmq.NOBLOCK)

    def _shutdown_step(self) -> bool:
        for rec in list(self._active):
            self._fail_req(rec, self._close_error)
        self._pump()
        if self._active and time.monotonic() < self._close_deadline:
            return False
        for session in list(self._sessions.values()):
            if session.state == "established":
                self._send(session, wire.Bye("prefill closing"))
        return True

    def _close_sockets(self) -> None:
        self._sock.close(0)


def _offset(offset: int | Mapping[str, int], pool: str) -> int:
    value = offset.get(pool, 0) if isinstance(offset, Mapping) else offset
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
        raise PlanError(f"pool {pool!r}: offset must be an int >= 0, got {value!r}")
    return int(value)

