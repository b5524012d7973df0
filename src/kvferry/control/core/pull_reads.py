"""Decode's half of pull mode, the pure parts: the fence, a Welcome's pull terms, a read's plan.

Part of the protocol core (no I/O), above ``pull``, ``links``, ``decode_requests`` and ``leases``, below
``core.decode`` (which handles the Readys and the reads' outcomes with these). A ``Ready`` names a chunk's
source pages; decode checks them against prefill's layout and plans the read into its own leased pages
(``read_plan``); its shell posts it (``Transport.read``). When the read is complete, and only if the link is
still *current* (``fenced``), the core checks the chunk's digests; the last chunk makes the request DONE
and decode's Result tells prefill to release its source pages. Only decode writes decode's memory here, so
a failed request's lease ends as soon as its own reads are terminal: no quarantine.

The fence: a read is accepted only while decode's own messages to prefill never paused for more than
``link.fence_s`` (a stall of this process trips it, whatever it reads afterwards) and prefill was heard
within ``peer_timeout``. Prefill keeps a dead session's source pages long enough (``pull.source_hold_s``)
that every accepted read completed before they are released (docs/fencing.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvferry.control import wire
from kvferry.control.core.decode_requests import DecodeRequest
from kvferry.control.core.leases import LeaseTable
from kvferry.control.core.links import Link
from kvferry.control.core.options import EndpointOptions
from kvferry.control.core.write_batch import Queued
from kvferry.control.pull import fence_s, welcome_mismatch
from kvferry.errors import HandshakeError, KVFerryError, LayoutError, PlanError
from kvferry.layout.memory import KVMemory
from kvferry.plan.contract import Plan
from kvferry.plan.pages import validate_pages
from kvferry.plan.planner import plan_pages, select_buffers

__all__ = ["Read", "ReadJob", "fenced", "note_send", "read_plan", "welcome_pull"]


class Read:
    """One read in flight for one part: the shell's ticket naming it and the chunk it brings."""

    __slots__ = ("chunk", "ticket")

    def __init__(self, ticket: Any, chunk: wire.Chunk) -> None:
        self.ticket = ticket
        self.chunk = chunk


@dataclass(frozen=True, slots=True)
class ReadJob:
    """One read to post (``DecodeCore.start_read``): the plan, prefill's transport agent, a label naming its
    chunks, the queued chunks it carries and their parts (in flight while it is posted)."""

    plan: Plan
    agent: str
    label: str
    group: list[Queued]
    parts: list[Any]


def welcome_pull(options: EndpointOptions, link: Link, msg: wire.Welcome) -> KVFerryError | None:
    """Decode's mode checks of a Welcome; in pull mode the link learns prefill's memory and the fence."""
    if msg.mode != link.mode:
        return welcome_mismatch(link.address, link.mode, msg.mode)
    if link.mode != "pull":
        return None
    try:
        link.remote = KVMemory.from_manifest(msg.manifest)
    except LayoutError as exc:  # check_welcome read it already: unreachable unless that changes
        return HandshakeError(f"prefill {link.address} sent a bad manifest: {exc}")
    link.fence_s = fence_s(options.peer_timeout, msg.peer_timeout, options.heartbeat_interval)
    link.expired = False
    return None


def note_send(link: Link, now: float) -> None:
    """A message to ``link`` leaves at ``now``: a pause in our own messages beyond the fence (judged against
    the previous one) trips it for good (prefill may have declared us dead meanwhile; later messages cannot
    undo that)."""
    if link.mode == "pull" and link.established and link.clock.we_were_silent(now, link.fence_s):
        link.expired = True


def fenced(link: Link, now: float) -> str | None:
    """Why reads on ``link`` may not be posted or accepted at ``now``, or None while it is current."""
    if not link.established:
        return f"prefill {link.address} is {link.state.value}"
    if link.expired or link.clock.we_were_silent(now, link.fence_s):
        link.expired = True
        return (f"decode sent prefill {link.address} nothing for more than {link.fence_s:.2f} s (this "
                "process stalled): prefill may have declared it dead and released its source pages")
    if link.clock.peer_silent(now):
        return f"prefill {link.address} silent for {link.clock.silent_for(now):.2f} s"
    return None


def read_plan(memory: KVMemory, leases: LeaseTable, rec: DecodeRequest, link: Link, msg: wire.Ready) -> Plan:
    """The read of one chunk: prefill's pages (untrusted: checked against its layout) into the leased pages
    from each pool's offset on (bounded by the lease). Across TP sizes, only the head slices this decode rank
    needs from that prefill rank (the link's ``TPPlanner``, built at the handshake), as push writes them.
    Between page sizes, the offset is the first source page's position in the whole request, and its tokens
    land by token past decode's prefix (the link's ``PageSizePlanner``), as push writes them."""
    assert link.remote is not None
    src = validate_pages(link.remote.layout, "source", wire.decode_pages(msg.pages), PlanError, unique=False)
    leased = leases.pages(rec.generation)
    if link.translator is not None:   # page sizes differ: the chunk's tokens (prefill positions) past our prefix
        positions = {pool: msg.offsets.get(pool, 0) for pool in src}
        spans = link.translator.spans(src, positions, leased, rec.prefix, rec.request_id)
        return link.translator.plan(spans, select_buffers(memory, msg.buffers or None))
    pairs = {}
    for pool, pages in src.items():
        dst, offset = leased.get(pool), msg.offsets.get(pool, 0)
        if dst is None or offset + len(pages) > len(dst):
            raise PlanError(f"request {rec.request_id!r}, pool {pool!r}: chunk {msg.chunk} covers positions "
                            f"{offset}..{offset + len(pages) - 1}, lease has {0 if dst is None else len(dst)}")
        pairs[pool] = (pages, dst[offset:offset + len(pages)])
    selected = select_buffers(memory, msg.buffers or None)
    if link.planner is not None:   # across TP sizes: this rank's heads of the prefill rank's pages
        return link.planner.plan_pages(pairs, selected)
    return plan_pages(link.remote, memory, pairs, selected)
