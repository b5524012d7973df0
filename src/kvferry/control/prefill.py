"""The prefill endpoint: the shell around ``core.prefill.PrefillCore``.

The top of the control plane (with ``decode``). Prefill binds a ZMQ ROUTER; each decode connects,
handshakes and announces requests with destination pages; the engine calls ``send`` as KV becomes ready.
What to do about each of those is ``PrefillCore``'s decision (the protocol, in ``control.core``); this
module does what the core cannot: it owns the socket (``router.RouterPort``), the progress thread, the
clock, the transport and the transfer handles (``inflight.InFlight``). It feeds the core events (frames,
commands, writes posted and settled, a transport peer added, a process found gone, a dropped connection,
ticks) and carries out the actions the core queues (messages, writes, ``AddPeer``, ``RemovePeer``,
``CheckProcess``, ``FlushNow``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections.abc import Iterable, Mapping
from typing import Any

from kvferry.control import wire
from kvferry.control.core.admission import as_secret
from kvferry.control.core.base import AddPeer, CheckProcess, Effect, RemovePeer, Transfer
from kvferry.control.core.digests import source_digests
from kvferry.control.core.prefill import PrefillCore, PrefillSetup
from kvferry.control.core.prefill_requests import (
    ChunkSpec,
    Planned,
    PrefillRequest,
    chunk_pairs,
    make_spec,
    may_free,
    source_in_use,
)
from kvferry.control.endpoints import EndpointBase, EndpointOptions, entropy
from kvferry.control.inflight import InFlight
from kvferry.control.liveness import is_gone, this_process
from kvferry.control.pull import ACCEPTED_BY_DEFAULT, accepted_modes
from kvferry.control.router import RouterPort
from kvferry.errors import KVFerryError, TransportError, UsageError
from kvferry.integrity.binding import as_binding
from kvferry.integrity.sampling import PageSampler
from kvferry.layout.memory import KVMemory
from kvferry.transport import Transport

__all__ = ["PrefillEndpoint"]

log = logging.getLogger("kvferry.control")


class PrefillEndpoint(EndpointBase):
    """Prefill side of kvferry. Binds at construction; ``address`` is what decode passes to ``connect``.

    ``host``/``port`` (port 0: ephemeral) choose where to listen, loopback by default. ``transport``,
    ``secret``, ``digest_mode`` and ``options`` are as for ``DecodeEndpoint``; the stronger digest mode
    of the two sides is used. ``mode``: the transfer mode, or modes, accepted from decode (``"push"``:
    this side writes; ``"pull"``: decode reads this side's pages, see ``holds_source``; both by default,
    decode choosing); a decode asking for another is refused at the handshake (it raises ``ModeMismatch``).
    """

    _role = "prefill"
    core: PrefillCore
    _port: RouterPort

    def __init__(self, memory: KVMemory, transport: str | Transport = "nixl", *, host: str = "127.0.0.1",
                 port: int = 0, secret: str | bytes | None = None, digest_mode: Any = "sampled",
                 options: EndpointOptions | None = None, mode: str | Iterable[str] = ACCEPTED_BY_DEFAULT) -> None:
        self.modes = accepted_modes(mode)
        self._secret = as_secret(secret)
        self._listen = (host, port)   # bound by _make_port, before the thread starts
        super().__init__(memory, transport, digest_mode=digest_mode, options=options)
        self.address: str = self._port.address
        self.core.setup = dataclasses.replace(self.core.setup, address=self.address)   # known once bound
        self._writes = InFlight()   # posted writes, in order (the handle is the core's ticket)
        self._sampler = PageSampler()  # sampling for send()'s digests
        self._thread.start()

    def _make_core(self) -> PrefillCore:
        setup = PrefillSetup("", self.transport.name, getattr(self.transport, "descriptors", "dlist"),
                             self.transport_metadata, this_process(), self._secret, self.modes)
        return PrefillCore(self.memory, setup, self.options, self.digest_mode, self._stats, entropy)

    def _make_port(self) -> RouterPort:
        host, port = self._listen
        return RouterPort(self._sockets, self.core, host, port)

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
        if self.core.hash_in_send:
            # Read without the lock (the core keeps the answer as sessions come and go): taking it here
            # made send wait for the progress thread's iteration, NIXL write included, before it could
            # hash. A stale answer moves only where a chunk's digests are made, never whether.
            spec.digests = source_digests(self.memory, self.digest_mode, spec.src, spec.buffers,
                                          self._sampler)
        self._preplan(request_id, spec)
        with self._lock:
            self._check_open()
            self.core.send(time.monotonic(), request_id, spec, bound)
            self._done_with_call()

    def issue(self, request_id: str) -> None:
        """Non-blocking: say that ``request_id`` is handed out to decode and its ``send`` will follow. With
        ``options.refuse_unissued`` an announce for an id neither issued nor sent is refused at once
        (``UnknownRequest``); an issued one waits for its send as usual. Idempotent; no deadline starts."""
        if not isinstance(request_id, str) or not 0 < len(request_id) <= wire.MAX_ID_LEN:
            raise UsageError(f"a request id is a str of 1 to {wire.MAX_ID_LEN} characters, got {request_id!r}")
        with self._lock:
            self.core.issue(request_id)

    def _preplan(self, request_id: str, spec: ChunkSpec) -> None:
        """Plan the chunk here, on the caller's thread, when decode has announced the request already (as
        engines mostly do: decode leases pages before prefill has computed them). The progress thread's
        time bounds push mode's throughput; it then only checks that the plan still matches the record
        (``Planned.matches``) and posts it. Anything unusual (no announce yet, a group of decode ranks,
        another TP size, a chunk outside the lease) is left to the progress thread, which plans (or
        fails the request) as before."""
        with self._lock:
            target = self.core.preplan_target(request_id)
        if target is None:
            return
        session, generation, dst = target
        try:
            pairs = chunk_pairs(request_id, dst, spec)
        except KVFerryError:
            return
        # Outside the lock: the record may move on meanwhile, which Planned.matches notices at posting.
        spec.planned = Planned(session, generation, dst, pairs, self.core.plan(session, pairs, spec.buffer_ids))

    def abort(self, request_id: str, reason: str = "aborted") -> None:
        """Non-blocking: fail the request and stop writing it. Decode hears of it (and frees its pages)
        only once every write already posted has settled. No-op for a request already ended. A request no
        decode announced yet (this side may never have heard of it) is kept FAILED, so a later announce is
        refused at once, and every decode peer is told now (``wire.Cancel``): its engine stops waiting for
        it within a message, not at its announce or timeout."""
        with self._lock:
            self.core.abort(time.monotonic(), request_id, reason)
            self._done_with_call()

    def decode_prefix(self, request_id: str) -> dict[str, int] | None:
        """What decode announced it already holds of ``request_id`` (pool -> leading pages; pools left out
        hold none), or None before decode announced it. ``send`` may start its pages there (``offset``) or
        at 0: positions before the prefix are skipped either way."""
        with self._lock:
            rec = self.core.records.get(request_id)
            if not isinstance(rec, PrefillRequest) or rec.session is None:
                return None
            return dict(rec.prefix)

    def decode_prefix_tokens(self, request_id: str) -> dict[str, int] | None:
        """``decode_prefix`` in tokens (pool -> leading tokens decode holds: its pages times decode's tokens
        per page, which may differ from this side's), or None before decode announced it. A pool without
        token pages (state) counts its pages."""
        with self._lock:
            rec = self.core.records.get(request_id)
            if not isinstance(rec, PrefillRequest) or rec.session is None:
                return None
            remote = rec.session.remote
            per_page = {p.name: p.tokens_per_page or 1 for p in remote.layout.pools} if remote is not None else {}
            return {pool: pages * per_page.get(pool, 1) for pool, pages in rec.prefix.items()}

    def holds_source(self, request_id: str) -> bool:
        """Non-blocking: whether the request's source pages may still be read (pull mode: until decode
        said it is done with them, see ``core.holds``; push mode: while a write of them is in flight).
        While True the caller must not reuse those pages. False for an unknown id."""
        with self._lock:
            rec = self.core.records.get(request_id)
            if not isinstance(rec, PrefillRequest):
                return False
            return source_in_use(rec)

    def may_free(self, request_id: str) -> bool:
        """Non-blocking: whether the engine may reuse ``request_id``'s source pages now: the request ended
        (DONE or FAILED) and nothing of it can still be read, by this side's writes (push) or by decode's
        reads (pull, until its verdict or the hold ends: docs/fencing.md). Per request: a failed request's
        own writes in flight keep its pages, nobody else's. True for an id this endpoint does not know
        (nothing was ever handed over)."""
        with self._lock:
            rec = self.core.records.get(request_id)
            return not isinstance(rec, PrefillRequest) or may_free(rec)

    @property
    def num_live_handles(self) -> int:
        """Transfer handles not yet released (a leak check: 0 when idle)."""
        with self._lock:
            return sum(len(r.handles) for r in self.core.active)

    @property
    def peers(self) -> list[str]:
        """Session ids of the decode peers currently connected."""
        with self._lock:
            return [s.hello.session for s in self.core.sessions.values() if s.established]

    def counters(self) -> dict[str, int]:
        """Leak-check figures: all zero on an idle endpoint (except the bad-message count)."""
        with self._lock:
            core = self.core
            return {"live_requests": sum(r.is_live for r in core.active),
                    "live_leases": 0, "live_handles": sum(len(r.handles) for r in core.active),
                    "peers": sum(s.established for s in core.sessions.values()),
                    "bad_messages": core.num_bad_messages,
                    "source_holds": len(core.holds)}

    # -- carrying out the core's actions (progress thread, under the lock) ------------------------------
    def _carry_out(self, transfer: Transfer) -> None:
        """Post one write the core decided, between events, with the endpoint's lock let go
        (``ActionRunner.unlocked``): on one host (cma) the copy runs inside this call, hundreds of
        microseconds with the GIL released, and callers' ``send`` (hashing, queueing the next chunk) and
        ``wait`` then proceed alongside it rather than queue behind the whole iteration. The core checks
        each record again first (``start_write``: the lock was free since the decision); a write that
        fails to post fails every record in it.

        Only this thread touches the transport and posts or settles writes, so what a caller may do in
        the meantime cannot race the write: ``send`` queues, ``abort`` fails the record (its settled
        Fail is sent once the write settled), and ``holds_source`` counts ``posting`` as a write in flight."""
        write = self.core.start_write(time.monotonic(), transfer)
        if write is None:
            return
        try:
            handle = self._actions.unlocked(write.records, lambda: self.transport.write(
                write.plan, write.agent, write.notification, label=write.label))
        except KVFerryError as exc:
            self.core.write_failed(time.monotonic(), write, exc)
            return
        handle = self._stats.posted(write.plan, handle)
        self._writes.add(handle)
        self.core.write_posted(write, handle)

    def _apply(self, effect: Effect) -> None:
        core = self.core
        if isinstance(effect, AddPeer):
            try:
                agent = self.transport.add_peer(effect.meta)
            except (KVFerryError, ValueError) as exc:
                core.peer_added(time.monotonic(), effect.peer, None, str(exc))
            else:
                core.peer_added(time.monotonic(), effect.peer, agent, None)
        elif isinstance(effect, RemovePeer):
            with contextlib.suppress(TransportError):
                self.transport.remove_peer(effect.agent)
        elif isinstance(effect, CheckProcess):
            if is_gone(effect.process) is True:
                core.process_gone(time.monotonic(), effect.process)
        else:
            super()._apply(effect)

    def _pump(self) -> bool:
        try:
            self.transport.get_notifications()  # prefill expects none; the call drives the backend's progress
        except KVFerryError as exc:  # handles report their own failures; the loop goes on
            log.warning("prefill: driving the transport failed: %s", exc)
        self._writes.settle(time.monotonic(), self.core.write_settled)
        return self.core.settle_dirty(time.monotonic())

    def _shutdown_step(self) -> bool:
        self._pump()
        return super()._shutdown_step()
