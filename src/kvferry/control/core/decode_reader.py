"""Decode's half of pull mode: a Ready becomes a read into the lease, accepted only while the fence holds.

Part of ``core.decode`` (no I/O), above ``pull_reads``. A read is posted (by the shell) and its result
accepted only while decode's own messages to prefill never paused past ``link.fence_s`` and prefill was
heard within ``peer_timeout``: prefill holds its source pages at least that long after declaring decode
dead (docs/fencing.md). Only decode writes decode's memory here, so a failed request's lease ends once its
own reads are terminal.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvferry.control import wire
from kvferry.control.core.decode_requests import DecodeRequest, Part
from kvferry.control.core.digests import verify_chunk
from kvferry.control.core.links import Link
from kvferry.control.core.pull_reads import fenced, read_plan
from kvferry.control.core.states import RequestState
from kvferry.control.core.write_batch import Queued, joinable
from kvferry.errors import (
    KVFerryError,
    PeerLost,
    ProtocolError,
)

if TYPE_CHECKING:
    from kvferry.control.core.decode import DecodeCore

__all__ = ["Reader"]


class Reader:
    """Pull mode's reads and their fence."""

    def __init__(self, core: DecodeCore) -> None:
        self.core = core

    def on_ready(self, link: Link, msg: wire.Ready) -> None:
        core = self.core
        if link.mode != "pull":
            raise ProtocolError(f"Ready from prefill {link.address} on a push-mode link")
        rec = core.messages.lookup(link, msg.request_id, msg.generation)
        if rec is None or not rec.is_live:
            return  # ended: prefill was answered (Result or Abort), or will release on the session's death
        part = rec.parts[link]
        if msg.chunk in part.chunks_seen or any(r.chunk.chunk == msg.chunk for r in part.reads):
            return
        if any(q.part is part and q.chunk.chunk == msg.chunk for q in core.batches.queued(link)):
            return
        if any(q.part is part and q.chunk.chunk == msg.chunk for t in core.transfers for q in t.group):
            return   # a repeat within one frame: its read is decided, not yet posted
        chunk = wire.Chunk(msg.request_id, msg.generation, msg.chunk, msg.last, msg.num_chunks, msg.digests)
        label = f"{rec.request_id}#{msg.chunk}"
        try:
            plan = read_plan(core.memory, core.leases, rec, link, msg)
            self.check_fence(rec, link)
        except KVFerryError as exc:
            self.read_refused(rec, part, exc)
            return
        queued = Queued(rec, plan, b"", label, part, chunk)
        if core.batches.wanted() and core.options.batch_chunks > 1 and joinable(plan):
            # Read once the messages of this iteration were read: with what else is ready from this prefill.
            part.posting = True
            core.batches.add(link, queued)
            return
        core.queue_transfer(link, [queued], [part])

    def check_fence(self, rec: DecodeRequest, link: Link) -> None:
        why = fenced(link, self.core.now)
        if why is not None:
            raise PeerLost(f"not reading request {rec.request_id!r}: {why}")

    def read_refused(self, rec: DecodeRequest, part: Part, exc: KVFerryError) -> None:
        self.core.messages.reject_part(rec, part, exc)
        self.pull_failed(rec)   # again, harmlessly: an abort() during the failed post left the lease

    def still_reading(self, q: Queued, link: Link) -> bool:
        rec, part = q.rec, q.part
        part.posting = False
        if not rec.is_live:
            self.pull_failed(rec)   # its lease ends once no read of it is in flight
            return False
        try:
            self.check_fence(rec, link)
        except KVFerryError as exc:
            self.read_refused(rec, part, exc)
            return False
        part.posting = True
        return True

    def read_done(self, rec: DecodeRequest, part: Part, chunk: wire.Chunk, error: KVFerryError | None) -> None:
        core = self.core
        link = part.link
        why = fenced(link, core.now)
        if error is None and why is not None:
            core.fail_req(rec, PeerLost(f"read of request {rec.request_id!r} not accepted: {why}"),
                          f"prefill rank {link.rank} ({link.address}): read not accepted")
            return
        if error is None:
            error = verify_chunk(core.memory, core.digest_mode, link, chunk, core.recorder)
        if error is not None:
            core.messages.reject_part(rec, part, error)
            return
        part.see(chunk)
        if rec.state is not RequestState.TRANSFERRING:
            core.set_state(rec, RequestState.TRANSFERRING)
        if part.is_complete:
            core.messages.part_complete(rec, part)

    def pull_failed(self, rec: DecodeRequest) -> None:
        """A pull request failed: no writer but us, so every part is settled, and the lease ends once our
        own reads of it are terminal (now, when none is in flight)."""
        for part in rec.parts.values():
            part.settled = True
        if not any(p.reads or p.posting for p in rec.parts.values()):
            self.core.messages.end_lease(rec)

    def check_pull_links(self, now: float) -> None:
        """Before an iteration reads anything: a pull link whose fence tripped (our own stall) dies now,
        so that frames queued meanwhile cannot start reads on it."""
        core = self.core
        for link in list(core.links.values()):
            if link.mode == "pull" and link.established:
                why = fenced(link, now)
                if why is not None and link.expired:
                    core.liveness.link_dead(link, PeerLost(why))
