"""Decode's requests as prefill's messages and chunk notifications move them, and how their leases end.

Part of ``core.decode`` (no I/O), above ``decode_requests``, ``digests``, ``leases`` and ``quarantine``. A
chunk's notification arrives after its bytes; it is checked against its digests, and the last rank's last
chunk makes the request DONE (``Result(ok)`` to every rank). A failed request's pages stay leased
(quarantined) until every rank writing it settled (``Fail(settled=True)``) or is certainly gone.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvferry.control import wire
from kvferry.control.core.base import RequestRecord
from kvferry.control.core.decode_effects import TakeNotifications
from kvferry.control.core.decode_requests import DecodeRequest, Part
from kvferry.control.core.digests import verify_chunk
from kvferry.control.core.links import Link
from kvferry.control.core.states import RequestState
from kvferry.errors import (
    IntegrityError,
    KVFerryError,
    PeerLost,
    ProtocolError,
    RequestAborted,
)

if TYPE_CHECKING:
    from kvferry.control.core.decode import DecodeCore

__all__ = ["Messages"]


class Messages:
    """Prefill's messages and chunk notifications, and how a request's lease ends."""

    def __init__(self, core: DecodeCore) -> None:
        self.core = core

    def on_link_msg(self, link: Link, msg: Any) -> None:
        """One message from ``link``, alone or out of a Batch (in order, each as if it had come alone: a
        link that failed or died earlier in the batch hears no more)."""
        core = self.core
        later = core.adding.get(link)
        if later is not None:
            later.append(msg)
        elif link.connecting:
            core.handshake.on_handshake(link, msg)
        elif link.established:
            self.on_message(link, msg)

    def on_message(self, link: Link, msg: Any) -> None:
        core = self.core
        if isinstance(msg, wire.Heartbeat):
            if msg.probe:   # prefill stalled and asks whether we still hold this link: we do
                core.send(link, wire.Heartbeat(echo=msg.probe))
            return
        if isinstance(msg, wire.Ack):
            rec = self.lookup(link, msg.request_id, msg.generation)
            if rec is not None and rec.state is RequestState.BOOTSTRAPPING:
                core.set_state(rec, RequestState.WAITING_FOR_INPUT)
        elif isinstance(msg, wire.Ready):
            core.reader.on_ready(link, msg)
        elif isinstance(msg, wire.Fail):
            self.on_fail(link, msg)
        elif isinstance(msg, wire.Cancel):
            self.on_cancel(link, msg)
        elif isinstance(msg, wire.Bye):
            core.liveness.link_dead(link, PeerLost(f"prefill {link.address} left: {msg.reason}"))
        else:
            raise ProtocolError(f"unexpected {type(msg).__name__} from prefill {link.address}")

    def on_fail(self, link: Link, msg: wire.Fail) -> None:
        core = self.core
        rec = self.lookup(link, msg.request_id, msg.generation)
        if rec is None:
            return
        part = rec.parts[link]
        error = wire.error_from_wire(msg.error, msg.reason, f"prefill {link.address}")
        reason = f"prefill rank {link.rank} ({link.address}) failed it"
        if link.mode == "pull":
            # Prefill failed it; our Abort (sent by fail_req) tells it we read no more, so it may release
            # its source pages. The lease ends once our own reads of it are terminal.
            core.fail_req(rec, error, reason)
            return
        part.told = True  # it failed the request itself: no Abort owed
        core.fail_req(rec, error, reason)
        if msg.settled:  # this prefill has no write to these pages that can still land
            # Its chunk notifications sent before this message may still wait in the transport (ZMQ is
            # read first): they are taken first, or they would count as writes landing with no lease.
            core.to_settle.append((rec, part))
            core.effects.append(TakeNotifications())

    def on_cancel(self, link: Link, msg: wire.Cancel) -> None:
        """Prefill failed a request before any decode announced it: keep it FAILED here so ``poll`` says so
        now (nothing is leased for it). A request this decode already knows is left alone: one announced and
        live hears from prefill itself (its announce is refused), one ended ended on its own."""
        core = self.core
        if msg.request_id in core.records:
            return
        rec = RequestRecord(msg.request_id, RequestState.BOOTSTRAPPING, core.now, core.now)
        core.remember(rec)
        core.num_live += 1   # set_state counts it out as it fails, as for an announced request
        core.fail(rec, RequestAborted(f"prefill {link.address}: {msg.reason}"))

    def lookup(self, link: Link, request_id: str, generation: int) -> DecodeRequest | None:
        """The record a message from ``link`` is about, or None (an ended request: a late Ack or a
        repeated Fail is normal)."""
        rec = self.core.by_gen.get(generation)
        if rec is None or link not in rec.parts or rec.request_id != request_id:
            return None
        return rec

    def on_batched_chunk(self, link: Link, msg: Any) -> None:
        if not isinstance(msg, wire.Chunk):
            raise ProtocolError(f"{type(msg).__name__} in the notification of a write from prefill {link.address}")
        self.on_chunk(link, msg)

    def on_chunk(self, link: Link, msg: wire.Chunk) -> None:
        core = self.core
        rec = self.lookup(link, msg.request_id, msg.generation)
        if rec is None:
            # A write landed for no lease we hold: a prefill bug (or a forged notification). Counted,
            # since the leak checks must see it.
            core.num_stray_notifications += 1
            return
        part = rec.parts[link]
        if not part.see(msg):
            return
        if not rec.is_live:
            # Failed while writes were in flight: this rank's part of the lease waits for its settled
            # Fail, or for its last notification (then every write of it has landed).
            if part.is_complete and max(part.chunks_seen) < (part.num_chunks or 0):
                self.settle(rec, part)
            return
        error = verify_chunk(core.memory, core.digest_mode, link, msg, core.recorder)
        if error is not None:
            self.reject_part(rec, part, error)
            return
        if rec.state is not RequestState.TRANSFERRING:
            core.set_state(rec, RequestState.TRANSFERRING)
        if part.is_complete:
            self.part_complete(rec, part)

    def reject_part(self, rec: DecodeRequest, part: Part, error: KVFerryError) -> None:
        """This rank's bytes did not check out: fail the request, tell it (Result), abort the others."""
        core = self.core
        part.told = True
        core.fail_req(rec, error, f"prefill rank {part.link.rank} ({part.link.address}) sent bad bytes")
        core.send(part.link, wire.Result(rec.request_id, rec.generation, False, str(error)[:wire.MAX_REASON_LEN]))

    def part_complete(self, rec: DecodeRequest, part: Part) -> None:
        """Every chunk of one rank arrived and verified; the request is DONE once every rank's has."""
        core = self.core
        assert part.num_chunks is not None
        if max(part.chunks_seen) >= part.num_chunks:
            self.reject_part(rec, part, IntegrityError(
                f"prefill {part.link.address} sent chunk {max(part.chunks_seen)} of {part.num_chunks} for "
                f"request {rec.request_id!r}"))
            return
        part.settled = True  # every write of this rank has landed
        if not all(p.is_complete for p in rec.parts.values()):
            return
        core.set_state(rec, RequestState.DONE)
        self.end_lease(rec)  # every chunk's notification arrived, so every write has landed
        for p in rec.parts.values():
            core.send(p.link, wire.Result(rec.request_id, rec.generation, True, ""))

    def abort_parts(self, rec: DecodeRequest, reason: str) -> None:
        msg = wire.Abort(rec.request_id, rec.generation, reason[:wire.MAX_REASON_LEN])
        for part in rec.parts.values():
            # A rank whose part completed is told too: it waits for our verdict, and would time out.
            if not part.told and part.link.established:
                part.told = True
                self.core.send(part.link, msg)

    def settle(self, rec: DecodeRequest, part: Part) -> None:
        """``part`` can write no more; the lease ends once every part of the request is settled."""
        if rec.settle(part):
            self.end_lease(rec)

    def end_lease(self, rec: DecodeRequest) -> None:
        core = self.core
        core.quarantine.remove(rec.generation)
        core.leases.release(rec.generation)
        core.by_gen.pop(rec.generation, None)
        core.changed = True
