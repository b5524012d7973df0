"""Decode's protocol: links to prefills, leases, quarantine, chunk notifications, pull-mode reads decided.

Part of the protocol core (no I/O), above every other core module, below ``control.decode`` (its shell).
``DecodeCore`` is fed events, each with ``now``: the user's commands (``start_link``, ``give_up``,
``announce``, ``abort``, ``cancel``), a link's frame (``on_frame``), a link's connection dropped or its send
failed (``dropped``), a transport notification (``on_notification``), a transport peer added
(``peer_added``), a read's outcome (``start_read``, ``read_posted``, ``read_failed``, ``read_settled``), a
writer found gone or alive (``writer_checked``), the notifications drained (``notifications_taken``), frames
that left (``frame_sent``) and ticks (``tick``, ``check_silence``). It answers through ``core.base``'s
queues: messages, reads to post, and effects (``OpenLink``, ``CloseLink``, ``AddPeer``, ``RemovePeer``,
``CheckWriter``, ``TakeNotifications``, ``FlushNow``).

The protocol itself: decode connects to one or more prefills (a link each: Hello, an optional challenge,
Welcome), announces each request with its destination pages (a lease), and reports ``DONE`` only after
every chunk's transport notification arrived (the transport delivers it after the chunk's bytes) and its
digests verified. A lease ends only when no write to its pages can still land: the request completed,
prefill confirmed its writes settled (``Fail(settled=True)``), or prefill certainly cannot write any more
(the shell says so, answering ``CheckWriter``) and ``options.lease_grace`` has passed since. Until then a
failed request's pages are quarantined (``quarantine``); a prefill declared dead is asked to settle them
when decode reconnects to it (a recovery link: ``OpenLink``). In pull mode decode reads prefill's pages
itself (``pull_reads``): a read is accepted only while the link's fence holds, and a failed request's lease
ends once its own reads are terminal.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

from kvferry.control import wire
from kvferry.control.core.backoff import ConnectBackoff
from kvferry.control.core.base import CoreBase, RemovePeer, RequestRecord, Transfer
from kvferry.control.core.deadlines import DeadlineHeap
from kvferry.control.core.decode_effects import CheckWriter, CloseLink, OpenLink, TakeNotifications
from kvferry.control.core.decode_handshake import Handshake
from kvferry.control.core.decode_liveness import Liveness
from kvferry.control.core.decode_messages import Messages
from kvferry.control.core.decode_reader import Reader
from kvferry.control.core.decode_requests import DecodeRequest, Part
from kvferry.control.core.leases import LeaseTable
from kvferry.control.core.links import Link, pick_links
from kvferry.control.core.options import EndpointOptions
from kvferry.control.core.ordered import OrderedSet
from kvferry.control.core.process import ProcessIdentity
from kvferry.control.core.pull_reads import Read, ReadJob, note_send
from kvferry.control.core.quarantine import Quarantine
from kvferry.control.core.states import LinkState, RequestState
from kvferry.control.core.write_batch import group_cap, joined, write_groups
from kvferry.errors import (
    HandshakeError,
    IncompatiblePeer,
    KVFerryError,
    LeaseError,
    ModeMismatch,
    PeerLost,
    ProtocolError,
    RequestAborted,
)
from kvferry.integrity import DigestMode
from kvferry.layout.memory import KVMemory

__all__ = ["CheckWriter", "CloseLink", "DecodeCore", "DecodeSetup",
           "OpenLink", "TakeNotifications"]


DEADLINE_CHECK_S = 0.01     # how often request deadlines are looked at


@dataclass(frozen=True, slots=True)
class DecodeSetup:
    """What the core must know of its shell: its transport and this process."""

    transport: str                 # the transport's name (prefill's must match)
    transport_metadata: bytes
    process: ProcessIdentity       # this process, reported in Hello
    secret: bytes | None


class DecodeCore(CoreBase):
    """Decode's side of the protocol. Mutated only by its shell, under the shell's lock."""

    role = "decode"

    def __init__(self, memory: KVMemory, setup: DecodeSetup, options: EndpointOptions, digest_mode: DigestMode,
                 stats: Any, entropy: Callable[[int], bytes]) -> None:
        super().__init__(options, stats, entropy)
        self.memory = memory
        self.setup = setup
        self.digest_mode = digest_mode
        self.leases = LeaseTable(memory.layout)
        self.links: dict[str, Link] = {}
        self.by_agent: dict[str, Link] = {}
        self.by_gen: dict[int, DecodeRequest] = {}
        self.deadlines = DeadlineHeap()   # by_gen's records by deadline (next_deadline)
        self.quarantine = Quarantine()
        self.next_quarantine_check = 0.0
        self.generations = itertools.count(1)
        self.next_deadline_check = 0.0
        self.num_live = 0   # live records, kept by announce and set_state: the busy test is O(1)
        self.num_stray_notifications = 0
        self.reading: OrderedSet[DecodeRequest] = OrderedSet()   # pull mode: requests with reads in flight
        self.reads: dict[Any, list[tuple[DecodeRequest, Part, Read]]] = {}   # a posted read's ticket -> its parts
        self.to_settle: list[tuple[DecodeRequest, Part]] = []   # settled Fails waiting for the notifications
        # Links welcomed whose transport peer the shell is adding (AddPeer): the messages that came after
        # the Welcome in the same frame, handled once it is added (as if the link had been established).
        self.adding: dict[Link, list[Any]] = {}
        # connect_needed's memory of failed handshakes: addresses -> (retry at, the error, the back-off).
        self.backoff = ConnectBackoff()
        # The decisions, by concern; each part reads and changes this core's state.
        self.handshake = Handshake(self)
        self.messages = Messages(self)
        self.reader = Reader(self)
        self.liveness = Liveness(self)

    def start_link(self, now: float, address: str, timeout: float, expect: tuple[int, int] | None,
                   mode: str) -> Link:
        """The established link to ``address``, or a fresh one whose handshake the next iteration starts."""
        self.now = now
        old = self.links.get(address)
        if old is not None and old.established and old.mode != mode:
            raise ModeMismatch(f"prefill {address} is connected in transfer mode {old.mode!r}, asked for {mode!r}")
        if old is not None and old.established:
            if expect is not None and (old.rank, old.tp_size) != expect:
                raise IncompatiblePeer(f"prefill {address} is rank {old.rank} of TP {old.tp_size}, "
                                       f"expected rank {expect[0]} of TP {expect[1]}")
            return old
        if old is not None and old.connecting:  # e.g. a recovery handshake: this one replaces it
            self.call_soon(lambda: self.handshake.link_failed(old, HandshakeError(f"prefill {address}: handshake "
                                                                         "superseded by a newer connect")))
        link = self.handshake.new_link(address, now + timeout)
        link.expect, link.mode = expect, mode
        self.links[address] = link
        self.call_soon(lambda: self.handshake.open_link(link))
        return link

    def give_up(self, now: float, links: list[Link], error: KVFerryError) -> None:
        """The caller's deadline passed with handshakes still open: fail them now, close them later."""
        self.now = now
        for link in links:
            if link.connecting:
                link.move(LinkState.FAILED)
                link.error = error
                self.call_soon(lambda x=link: self.handshake.close_link(x))

    def announce(self, now: float, request_id: str, pages: Mapping[str, Any], peer: str | Sequence[str] | None,
                 held: Any, bound: Sequence[Any]) -> None:
        """``DecodeEndpoint.announce`` past its checks: lease the pages and queue the Announce."""
        self.now = now
        links = pick_links(self.links, peer, self.memory.layout)
        old = self.records.get(request_id)
        if old is not None and old.is_live:
            raise LeaseError(f"request {request_id!r} is already live ({old.state.value})")
        gen = next(self.generations)
        leased = self.leases.acquire(gen, request_id, pages)
        rec = DecodeRequest(request_id, now + self.options.request_timeout, gen, links, self.options.lease_grace, now,
                            dict(held))
        self.remember(rec)
        self.by_gen[gen] = rec
        self.deadlines.push(rec)
        self.num_live += 1
        # Sent by the progress thread at the end of its next iteration (with the others of that iteration).
        data = wire.encode(wire.Announce(request_id, gen, wire.encode_pages(leased), held, *bound))
        for link in links:
            self.queue_out(link, data)
        self.wake_wanted = True

    def abort(self, now: float, request_id: str, reason: str) -> None:
        """Fail the request now; every prefill rank writing it is told on the next iteration."""
        self.now = now
        rec = cast(DecodeRequest, self.records[request_id])
        if self.fail(rec, RequestAborted(f"aborted by decode: {reason}")):
            self.call_soon(lambda: self.messages.abort_parts(rec, reason))

    def cancel(self, now: float, request_id: str, reason: str, peer: str | Sequence[str] | None) -> None:
        """Tell prefill that this decode will never announce ``request_id``."""
        self.now = now
        links = pick_links(self.links, peer, self.memory.layout)
        old = self.records.get(request_id)
        if old is not None and old.is_live:
            raise LeaseError(f"request {request_id!r} is live here ({old.state.value}): abort it instead")
        data = wire.encode(wire.Cancel(request_id, reason[:wire.MAX_REASON_LEN]))
        for link in links:
            self.queue_out(link, data)
        self.wake_wanted = True

    def peer_added(self, now: float, link: Link, agent: str | None, error: str | None) -> None:
        """The shell added prefill's transport agent (``agent``), or could not (``error``)."""
        self.now = now
        later = self.adding.pop(link, [])
        if agent is None:
            self.handshake.link_failed(link, HandshakeError(f"prefill {link.address}: bad transport metadata: {error}"))
            return
        if not link.connecting:   # failed meanwhile: nothing will use the agent
            self.effects.append(RemovePeer(agent))
            return
        link.agent = agent
        self.by_agent[agent] = link
        link.move(LinkState.ESTABLISHED)
        self.changed = True
        self.handshake.resettle(link)
        if later:
            self.on_batch(later, lambda m: self.messages.on_link_msg(link, m))

    def dropped(self, now: float, link: Link, why: str) -> None:
        """``link``'s connection dropped (the shell's monitor said so), or a send or receive on it failed."""
        self.now = now
        text = (f"prefill {link.address}: connection dropped ({why}): the prefill closed or crashed, or sent a "
                f"message above max_message_bytes={self.options.max_message_bytes} (libzmq drops such a "
                "connection without a word)")
        if link.connecting:
            self.handshake.link_failed(link, HandshakeError(f"{text}, during the handshake"))
        else:
            self.liveness.link_dead(link, PeerLost(text))

    def fail_peers(self, error: KVFerryError) -> None:
        for link in self.links.values():
            if link.state in (LinkState.CONNECTING, LinkState.ESTABLISHED):
                link.move(LinkState.FAILED if link.connecting else LinkState.DEAD)
                link.error = error

    def on_frame(self, now: float, link: Link, data: bytes) -> None:
        """One frame from ``link`` (``now``: when the poll that found it returned)."""
        self.now = now
        try:
            msg = wire.decode(data)
        except ProtocolError as exc:
            if link.connecting:  # e.g. another protocol version: refuse the peer, say why
                self.handshake.link_failed(link, IncompatiblePeer(f"prefill {link.address}: {exc}"))
            raise
        link.clock.heard(now)
        if isinstance(msg, wire.Batch):
            self.on_batch(wire.unbatch(msg), lambda m: self.messages.on_link_msg(link, m))
        else:
            self.messages.on_link_msg(link, msg)

    def notifications_taken(self, now: float) -> None:
        """The notifications waiting when the settled Fails came are in: their parts settle now."""
        self.now = now
        to_settle, self.to_settle = self.to_settle, []
        for rec, part in to_settle:
            self.messages.settle(rec, part)

    def send(self, link: Link, msg: Any) -> None:
        """Queue ``msg`` for ``link``; it leaves with this iteration's next flush."""
        self.queue_out(link, wire.encode(msg))

    def frame_sent(self, now: float, link: Link) -> None:
        """A frame of ours left for ``link`` at ``now``. In pull mode a pause in our messages beyond the
        fence (since the previous one) trips the link's fence first; then its clock advances."""
        note_send(link, now)
        link.clock.sent(now)

    def fail_req(self, rec: DecodeRequest, error: KVFerryError, reason: str) -> None:
        """Fail a live request and tell every prefill rank writing it that does not know yet to stop
        (each answers with a settled Fail, which ends its part of the lease)."""
        if self.fail(rec, error):
            self.messages.abort_parts(rec, reason)

    def fail_closed(self, rec: RequestRecord, error: KVFerryError) -> None:
        if isinstance(rec, DecodeRequest):
            self.fail_req(rec, error, "decode internal error")
        else:   # a cancelled id's record: nothing leased, nobody to tell
            self.fail(rec, error)

    def set_state(self, rec: RequestRecord, state: RequestState) -> None:
        was_live = rec.is_live
        super().set_state(rec, state)
        if was_live and not rec.is_live:
            self.num_live -= 1
            if state is RequestState.FAILED and isinstance(rec, DecodeRequest):
                if any(p.link.mode == "pull" for p in rec.parts.values()):
                    self.reader.pull_failed(rec)  # nobody else writes these pages: no quarantine
                    return
                # Failed with its lease held: a writer may still write it, so its pages are quarantined.
                pages = self.leases.num_pages(rec.generation)
                if pages:
                    self.quarantine.add(rec.generation, pages)

    def on_notification(self, now: float, agent: str, data: bytes) -> None:
        """A transport notification from ``agent``: a write's chunk (or a Batch of them) landed."""
        self.now = now
        link = self.by_agent.get(agent)
        try:
            msg = wire.decode(data)
            if link is None or not isinstance(msg, (wire.Chunk, wire.Batch)):
                raise ProtocolError(f"unexpected notification from {agent!r}")
        except ProtocolError:
            self.num_bad_messages += 1
            return
        if isinstance(msg, wire.Batch):   # one write carried several chunks (prefill's write_batch)
            self.on_batch(wire.unbatch(msg), lambda m: self.messages.on_batched_chunk(link, m))
        else:
            self.messages.on_chunk(link, msg)

    def post_batches(self) -> None:
        """Queue the reads batched in this iteration (``write_batch``): per prefill, those ready go as few
        reads as the caps allow (each checked again right before it is posted, ``start_read``)."""
        cap = group_cap(self.options.batch_chunks, self.num_live)
        for link, queued in self.batches.take():
            for group in write_groups(queued, cap, self.options.batch_bytes):
                self.queue_transfer(link, group, [q.part for q in group])

    def start_read(self, now: float, transfer: Transfer) -> ReadJob | None:
        """The shell is about to post ``transfer``: check each part again (the lock was free since the
        decision: a request that failed, or a link whose fence tripped, is not read) and say what to post,
        or None. ``posting`` stays True on the parts in the job until the shell has posted it."""
        self.now = now
        link: Link = transfer.peer
        group = [q for q in transfer.group if self.reader.still_reading(q, link)]
        if not group:
            return None
        plan, label = joined(group)
        return ReadJob(plan, link.agent, label, group, [q.part for q in group])

    def read_posted(self, job: ReadJob, ticket: Any) -> None:
        """The read is in flight: ``ticket`` names it until ``read_settled``."""
        entries = self.reads.setdefault(ticket, [])
        for q in job.group:
            read = Read(ticket, q.chunk)
            q.part.reads.append(read)
            entries.append((q.rec, q.part, read))
            self.reading.add(q.rec)

    def read_failed(self, now: float, job: ReadJob, error: KVFerryError) -> None:
        """The read could not be posted: every request in it fails (nothing of it is in flight)."""
        self.now = now
        for q in job.group:
            self.reader.read_refused(q.rec, q.part, error)

    def read_settled(self, now: float, ticket: Any, error: KVFerryError | None) -> None:
        """The read ``ticket`` completed (``error`` None) or failed: accept its chunks (if the fence still
        holds at ``now``), and end the leases of failed requests with no read left in flight."""
        self.now = now
        recs: dict[DecodeRequest, None] = {}
        for rec, part, read in self.reads.pop(ticket, ()):
            part.reads.remove(read)
            recs[rec] = None
            if rec.is_live:
                self.reader.read_done(rec, part, read.chunk, error)
        for rec in recs:
            if not any(p.reads for p in rec.parts.values()):
                self.reading.discard(rec)
                if not rec.is_live:
                    self.messages.end_lease(rec)  # its own reads are terminal: nothing else writes these pages

    def num_reads(self) -> int:
        """Reads in flight, one per part in each (a leak check: 0 when idle)."""
        return sum(len(p.reads) for rec in self.reading for p in rec.parts.values())

    def num_waiting(self) -> int:
        # Live requests wait for chunk notifications, which only polling the transport brings in.
        return self.num_live + len(self.reading)

    def tick(self, now: float) -> None:
        self.now = now
        tick_link = self.liveness.tick_link
        for link in list(self.links.values()):
            tick_link(link, now)
        if now >= self.next_deadline_check:
            self.next_deadline_check = now + DEADLINE_CHECK_S
            self.liveness.tick_requests(now)

    def check_silence(self, now: float) -> None:
        """Push mode: nothing before reading (decode posts no writes, so frames queued during its own stall
        can only make it talk to a prefill that dropped it, which answers with Bye). Pull mode: a link whose
        fence tripped (this process stalled) dies before frames queued meanwhile can start reads on it."""
        self.now = now
        self.reader.check_pull_links(now)

    def writer_checked(self, now: float, link: Link, gone: bool) -> None:
        """The shell's answer to ``CheckWriter``: whether the prefill behind ``link`` certainly cannot write
        any more. Gone: its quarantined parts leave ``lease_grace`` from now. Otherwise decode reconnects to
        it (``recover``) to ask for its acknowledgement."""
        self.now = now
        if not gone:
            if not self.closing:
                self.handshake.recover(link, now)
            return
        for rec in list(self.by_gen.values()):
            part = rec.parts.get(link)
            if part is not None and not part.settled and not link.established:
                part.grace.writer_gone(now)

    def earliest_live(self) -> float | None:
        """The least deadline among the live requests (None: none is live)."""
        by_gen = self.by_gen
        return self.deadlines.earliest(lambda rec: rec.is_live and by_gen.get(rec.generation) is rec, len(by_gen))

    def next_deadline(self) -> float:
        """The earliest ``now`` at which ``tick`` may decide something with no other event in between."""
        # One pass over the links: the loop asks this once per iteration.
        now, earliest = self.now, math.inf
        for link in self.links.values():
            state = link.state
            if state is LinkState.ESTABLISHED:
                t = link.clock.next_deadline(now)
            elif state is LinkState.CONNECTING:
                t = math.nextafter(link.deadline, math.inf)
            else:
                continue
            if t < earliest:
                earliest = t
        first = self.earliest_live()
        if first is not None:
            earliest = min(earliest, max(first, self.next_deadline_check))
        if self.quarantine.num_leases:   # looked at with the request deadlines (tick_requests)
            earliest = min(earliest, max(self.next_quarantine_check, self.next_deadline_check))
        return earliest

    def shutdown_step(self, now: float, give_up: bool) -> bool:
        self.now = now
        for rec in list(self.by_gen.values()):  # a pull request's lease may end as it fails
            self.fail_req(rec, KVFerryError("decode endpoint closing"), "decode closing")
        waiting = any(p.link.established and not p.settled
                      for r in self.by_gen.values() for p in r.parts.values())
        if waiting and not give_up:
            return False
        for link in self.links.values():
            if link.established:
                self.send(link, wire.Bye("decode closing"))
        return True

    def done_pages(self, rec: RequestRecord) -> Mapping[str, Any]:
        # Called as the request turns DONE, before its lease ends: the leased pages are what moved.
        return self.leases.pages(cast(DecodeRequest, rec).generation)

    def gauges(self) -> dict[str, int]:
        return {"live_requests": self.num_live, "leases": self.leases.num_leases,
                "leased_pages": self.leases.num_leased_pages, "quarantined_pages": self.quarantine.num_pages,
                "peers": sum(link.established for link in list(self.links.values()))}
