"""Decode's half of pull mode: read prefill's ready pages into the lease, verify, and say when done.

Part of the control plane, above ``pull``, ``links``, ``decode_requests`` and ``digests``, below ``decode``
(``DecodeEndpoint`` mixes ``PullReader`` in; everything here runs on decode's progress thread, under the
endpoint's lock). A ``Ready`` names a chunk's source pages; decode checks them against prefill's layout,
plans the read into its own leased pages and posts it (``Transport.read``). When the read is complete, and
only if the link is still *current* (``_fenced``), it checks the chunk's digests; the last chunk makes the
request DONE and decode's Result tells prefill to release its source pages. Only decode writes decode's
memory here, so a failed request's lease ends as soon as its own reads are terminal: no quarantine.

The fence: a read is accepted only while decode's own messages to prefill never paused for more than
``link.fence_s`` (a stall of this process trips it, whatever it reads afterwards) and prefill was heard
within ``peer_timeout``. Prefill keeps a dead session's source pages long enough (``pull.source_hold_s``)
that every accepted read completed before they are released (docs/fencing.md).
"""

from __future__ import annotations

import time
from typing import Any

from kvferry.control import wire
from kvferry.control.core.decode_requests import DecodeRequest, Part
from kvferry.control.core.digests import verify_chunk
from kvferry.control.core.links import Link
from kvferry.control.core.states import RequestState
from kvferry.control.core.write_batch import Queued, WriteBatches, group_cap, joinable, joined, write_groups
from kvferry.control.endpoints import Transfer
from kvferry.control.handles import share
from kvferry.control.pull import fence_s, welcome_mismatch
from kvferry.control.stats import StatsRecorder
from kvferry.errors import (
    HandshakeError,
    KVFerryError,
    LayoutError,
    PeerLost,
    PlanError,
    ProtocolError,
    TransportError,
)
from kvferry.layout.memory import KVMemory
from kvferry.plan.contract import Plan
from kvferry.plan.pages import validate_pages
from kvferry.plan.planner import plan_pages, select_buffers
from kvferry.transport import TransferHandle

__all__ = ["PullReader", "Read"]

# Within a run of reads, finished ones are concluded (Results sent, waiters woken) at most this often.
PUBLISH_S = 2e-3


class Read:
    """One posted read: its handle and the chunk it brings (digests, index, count)."""

    __slots__ = ("chunk", "handle")

    def __init__(self, handle: TransferHandle, chunk: wire.Chunk) -> None:
        self.handle = handle
        self.chunk = chunk


class PullReader:
    """Mixed into ``DecodeEndpoint`` (after ``EndpointBase`` in its bases): the pull-mode handlers. Relies
    on the endpoint's lease table, transport, options and request bookkeeping (``_lookup``, ``_fail_req``,
    ``_reject_part``, ``_part_complete``, ``_end_lease``, ``_link_dead``, ``set_state``)."""

    _reading: set[DecodeRequest]
    _num_live: int
    batches: WriteBatches
    _published_at: float
    _publish: Any
    _queue_transfer: Any
    transfers: Any
    _unlocked: Any
    memory: KVMemory
    transport: Any
    options: Any
    digest_mode: Any
    _leases: Any
    _stats: StatsRecorder

    # -- handshake ------------------------------------------------------------------------------------
    def _welcome_pull(self, link: Link, msg: wire.Welcome) -> KVFerryError | None:
        """Decode's mode checks of a Welcome; in pull mode the link learns prefill's memory and the fence."""
        if msg.mode != link.mode:
            return welcome_mismatch(link.address, link.mode, msg.mode)
        if link.mode != "pull":
            return None
        try:
            link.remote = KVMemory.from_manifest(msg.manifest)
        except LayoutError as exc:  # check_welcome read it already: unreachable unless that changes
            return HandshakeError(f"prefill {link.address} sent a bad manifest: {exc}")
        opts = self.options
        link.fence_s = fence_s(opts.peer_timeout, msg.peer_timeout, opts.heartbeat_interval)
        link.expired = False
        return None

    # -- the fence --------------------------------------------------------------------------------------
    def _note_send(self, link: Link, now: float) -> None:
        """Before a message to ``link`` leaves: a pause in our own messages beyond the fence trips it for
        good (prefill may have declared us dead meanwhile; later messages cannot undo that)."""
        if link.mode == "pull" and link.established and link.clock.we_were_silent(now, link.fence_s):
            link.expired = True

    def _fenced(self, link: Link, now: float) -> str | None:
        """Why reads on ``link`` may not be posted or accepted now, or None while it is current."""
        if not link.established:
            return f"prefill {link.address} is {link.state.value}"
        if link.expired or link.clock.we_were_silent(now, link.fence_s):
            link.expired = True
            return (f"decode sent prefill {link.address} nothing for more than {link.fence_s:.2f} s (this "
                    "process stalled): prefill may have declared it dead and released its source pages")
        if link.clock.peer_silent(now):
            return f"prefill {link.address} silent for {link.clock.silent_for(now):.2f} s"
        return None

    def _check_pull_links(self, links: list[Link], now: float) -> None:
        """Before an iteration reads anything: a pull link whose fence tripped (our own stall) dies now,
        so that frames queued meanwhile cannot start reads on it."""
        for link in links:
            if link.mode == "pull" and link.established:
                why = self._fenced(link, now)
                if why is not None and link.expired:
                    self._link_dead(link, PeerLost(why))

    # -- Ready -> read --------------------------------------------------------------------------------
    def _on_ready(self, link: Link, msg: wire.Ready) -> None:
        if link.mode != "pull":
            raise ProtocolError(f"Ready from prefill {link.address} on a push-mode link")
        rec = self._lookup(link, msg.request_id, msg.generation)
        if rec is None or not rec.is_live:
            return  # ended: prefill was answered (Result or Abort), or will release on the session's death
        part = rec.parts[link]
        if msg.chunk in part.chunks_seen or any(r.chunk.chunk == msg.chunk for r in part.reads):
            return
        if any(q.part is part and q.chunk.chunk == msg.chunk for q in self.batches.queued(link)):
            return
        if any(q.part is part and q.chunk.chunk == msg.chunk for t in self.transfers for q in t.group):
            return   # a repeat within one frame: its read is decided, not yet posted
        chunk = wire.Chunk(msg.request_id, msg.generation, msg.chunk, msg.last, msg.num_chunks, msg.digests)
        label = f"{rec.request_id}#{msg.chunk}"
        try:
            plan = self._read_plan(rec, link, msg)
            self._check_fence(rec, link)
        except KVFerryError as exc:
            self._read_failed(rec, part, exc)
            return
        queued = Queued(rec, plan, b"", label, part, chunk)
        if self.batches.wanted() and self.options.batch_chunks > 1 and joinable(plan):
            # Read once the messages of this iteration were read: with what else is ready from this prefill.
            part.posting = True
            self.batches.add(link, queued)
            return
        self._post_read_group(link, [queued])

    def _check_fence(self, rec: DecodeRequest, link: Link) -> None:
        why = self._fenced(link, time.monotonic())
        if why is not None:
            raise PeerLost(f"not reading request {rec.request_id!r}: {why}")

    def _read_failed(self, rec: DecodeRequest, part: Part, exc: KVFerryError) -> None:
        self._reject_part(rec, part, exc)
        self._pull_failed(rec)   # again, harmlessly: an abort() during the failed post left the lease

    def _publish_now_and_then(self) -> None:
        if time.monotonic() - self._published_at >= PUBLISH_S:
            # A long run of reads (one frame can carry dozens of Readys): conclude the finished ones now
            # and let their Results and waiters go, so that prefill and the engine work on the next
            # requests while this thread reads on. Not after every read: several Results share a frame.
            self._pump_reads()
            self._publish()

    def _post_reads(self) -> None:
        """Post the reads queued in this iteration (``control.write_batch``): per prefill, those ready go as
        few reads as the caps allow. Each is checked again right before (``posting`` kept its lease from
        ending meanwhile): a request that failed, or a link whose fence tripped, is not read."""
        cap = group_cap(self.options.batch_chunks, self._num_live)
        for link, queued in self.batches.take():
            for group in write_groups(queued, cap, self.options.batch_bytes):
                self._post_read_group(link, group)

    def _still_reading(self, q: Queued, link: Link) -> bool:
        rec, part = q.rec, q.part
        part.posting = False
        if not rec.is_live:
            self._pull_failed(rec)   # its lease ends once no read of it is in flight
            return False
        try:
            self._check_fence(rec, link)
        except KVFerryError as exc:
            self._read_failed(rec, part, exc)
            return False
        part.posting = True
        return True

    def _post_read_group(self, link: Link, group: list[Queued]) -> None:
        """Decide one read of ``group``'s chunks (one, or several sharing it): queued, and carried out once
        the event being handled is (``_carry_out_read``); its parts count as reads in flight from now."""
        self.queue_transfer(link, group, [q.part for q in group])

    def _carry_out_read(self, transfer: Transfer) -> None:
        """Post one queued read (decode's ``_carry_out``), between events, with the endpoint's lock let go
        (``_unlocked``): on one host (cma) the copy runs inside this call, with the GIL released, and
        callers (``announce`` above all) proceed alongside it rather than queue behind the whole
        iteration. Each part is checked again first (the request still live, the fence still holding).
        Only this thread posts and settles reads; an ``abort`` meanwhile fails the request, but its lease
        cannot end under the read (``posting`` counts as a read in flight, ``_pull_failed``): it ends once
        the read is terminal, as for any read in flight. A read that fails to post fails every request in
        it."""
        link: Link = transfer.peer
        group = [q for q in transfer.group if self._still_reading(q, link)]
        if not group:
            return
        parts = [q.part for q in group]
        plan, label = joined(group)
        try:
            handle = self._unlocked(parts, lambda: self.transport.read(plan, link.agent, label=label))
        except KVFerryError as exc:
            for q in group:
                self._read_failed(q.rec, q.part, exc)
            return
        handle = self._stats.posted(plan, handle)
        for q, member in zip(group, share(handle, len(group)), strict=True):
            q.part.reads.append(Read(member, q.chunk))
            self._reading.add(q.rec)
        self._publish_now_and_then()

    def _read_plan(self, rec: DecodeRequest, link: Link, msg: wire.Ready) -> Plan:
        """The read of one chunk: prefill's pages (untrusted: checked against its layout) into the
        leased pages from each pool's offset on (bounded by the lease)."""
        assert link.remote is not None
        src = validate_pages(link.remote.layout, "source", wire.decode_pages(msg.pages), PlanError, unique=False)
        leased = self._leases.pages(rec.generation)
        pairs = {}
        for pool, pages in src.items():
            dst, offset = leased.get(pool), msg.offsets.get(pool, 0)
            if dst is None or offset + len(pages) > len(dst):
                raise PlanError(f"request {rec.request_id!r}, pool {pool!r}: chunk {msg.chunk} covers positions "
                                f"{offset}..{offset + len(pages) - 1}, lease has {0 if dst is None else len(dst)}")
            pairs[pool] = (pages, dst[offset:offset + len(pages)])
        return plan_pages(link.remote, self.memory, pairs, select_buffers(self.memory, msg.buffers or None))

    # -- completions ----------------------------------------------------------------------------------
    def _pump_reads(self) -> bool:
        """Poll every read in flight; True when one ended."""
        news = False
        now = time.monotonic()
        for rec in list(self._reading):
            for part in list(rec.parts.values()):
                news |= self._poll_reads(rec, part, now)
            if not any(p.reads for p in rec.parts.values()):
                self._reading.discard(rec)
                if not rec.is_live:
                    self._end_lease(rec)  # its own reads are terminal: nothing else writes these pages
        return news

    def _poll_reads(self, rec: DecodeRequest, part: Part, now: float) -> bool:
        still, ended = [], False
        for read in part.reads:
            error: KVFerryError | None = None
            try:
                if not read.handle.poll():
                    still.append(read)
                    continue
            except TransportError as exc:
                error = exc
            read.handle.release()
            ended = True
            if rec.is_live:
                self._read_done(rec, part, read.chunk, error, now)
        part.reads = still
        return ended

    def _read_done(self, rec: DecodeRequest, part: Part, chunk: wire.Chunk, error: KVFerryError | None,
                   now: float) -> None:
        link = part.link
        why = self._fenced(link, now)
        if error is None and why is not None:
            self._fail_req(rec, PeerLost(f"read of request {rec.request_id!r} not accepted: {why}"),
                           f"prefill rank {link.rank} ({link.address}): read not accepted")
            return
        if error is None:
            error = verify_chunk(self.memory, self.digest_mode, link, chunk, self._stats)
        if error is not None:
            self._reject_part(rec, part, error)
            return
        part.see(chunk)
        if rec.state is not RequestState.TRANSFERRING:
            self.set_state(rec, RequestState.TRANSFERRING)
        if part.is_complete:
            self._part_complete(rec, part)

    def _pull_failed(self, rec: DecodeRequest) -> None:
        """A pull request failed: no writer but us, so every part is settled, and the lease ends once our
        own reads of it are terminal (now, when none is in flight)."""
        for part in rec.parts.values():
            part.settled = True
        if not any(p.reads or p.posting for p in rec.parts.values()):
            self._end_lease(rec)

    def _num_reads(self) -> int:
        return sum(len(p.reads) for rec in self._reading for p in rec.parts.values())
