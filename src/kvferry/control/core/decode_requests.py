"""Decode's request records: one ``DecodeRequest`` per announced request, one ``Part`` per prefill rank writing it.

Part of the control plane, above ``endpoints`` and ``links``, below ``decode``. At equal TP a request has one
part; when decode runs fewer TP ranks than prefill, each prefill rank it needs writes its heads and is tracked
apart. A part is *settled* once no write of it can still land (every chunk's notification arrived, the rank
confirmed with a settled Fail, or it is certainly gone and ``lease_grace`` passed since); the request's lease
ends only when every part is (until then a failed request's pages are quarantined, see ``quarantine``).
Records are mutated only under the endpoint's lock.
"""

from __future__ import annotations

from typing import Any

from kvferry.control import wire
from kvferry.control.core.base import RequestRecord
from kvferry.control.core.links import Link
from kvferry.control.core.states import RequestState
from kvferry.control.core.timers import GraceClock

__all__ = ["DecodeRequest", "Part"]


class Part:
    """One prefill rank's share of a request on this decode rank. ``settled``: no write of it can land."""

    __slots__ = ("chunks_seen", "grace", "link", "num_chunks", "posting", "reads", "settled", "told")

    def __init__(self, link: Link, lease_grace: float) -> None:
        self.link = link
        self.chunks_seen: set[int] = set()
        self.num_chunks: int | None = None
        self.settled = False
        self.told = False   # that prefill knows the request ended: it failed it, or we sent Abort/Result
        self.grace = GraceClock(lease_grace)   # quarantined: settled lease_grace after the writer is certainly gone
        self.reads: list[Any] = []   # pull mode: this side's reads in flight (pull_reads.Read)
        # Pull mode: a read of this part is decided and not yet posted, or being posted with the endpoint's
        # lock let go (DecodeEndpoint._carry_out): in flight, with no handle yet; the lease may not end under it.
        self.posting = False

    @property
    def is_complete(self) -> bool:
        """Every chunk's notification arrived (the transport delivers it after the chunk's bytes)."""
        return self.num_chunks is not None and len(self.chunks_seen) >= self.num_chunks

    def see(self, msg: wire.Chunk) -> bool:
        """Count a chunk's notification (the last one carries the count); False for a repeat."""
        if msg.chunk in self.chunks_seen:
            return False
        self.chunks_seen.add(msg.chunk)
        if msg.last:
            self.num_chunks = msg.num_chunks
        return True


class DecodeRequest(RequestRecord):
    """A request on this decode rank: one lease (its id is ``generation``), one part per prefill rank it
    needs (one at equal TP)."""

    __slots__ = ("generation", "parts", "prefix")

    def __init__(self, request_id: str, deadline: float, generation: int, links: list[Link],
                 lease_grace: float, now: float, prefix: dict[str, int] | None = None) -> None:
        super().__init__(request_id, RequestState.BOOTSTRAPPING, deadline, now)
        self.generation = generation
        self.parts = {link: Part(link, lease_grace) for link in links}
        # Pool -> leading pages of the request this decode holds (its announce's prefix): where a pull read
        # between page sizes begins in decode's tokens.
        self.prefix: dict[str, int] = prefix or {}

    def settle(self, part: Part) -> bool:
        """``part`` can write no more; True once every part is settled (the lease may end)."""
        part.settled = True
        return all(p.settled for p in self.parts.values())
