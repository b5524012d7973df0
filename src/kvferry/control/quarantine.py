"""Decode's quarantine: the pages of failed requests whose writer may still write, and when they leave it.

Part of the control plane, above ``links``, ``liveness`` and the transports, below ``decode``. A request that
fails on decode while a prefill may still write it (an abort, a deadline, a peer silent or lost) keeps its
lease: its pages are *quarantined*, not reusable, until every prefill rank writing it either acknowledged
(``Fail(settled=True)`` for that request and generation: its posted writes completed or cancelled) or
certainly cannot write any more (``writer_gone``). Only then does ``options.lease_grace`` start, bounding
how long after a confirmed death decode still waits. No timer alone ends a quarantine: a stalled writer
resumes whenever it likes, and one-sided writes need no help from decode (docs/fencing.md).
Mutated only under the endpoint's lock.
"""

from __future__ import annotations

from kvferry.control.core.links import Link
from kvferry.control.liveness import is_gone
from kvferry.transport import Transport

__all__ = ["Quarantine", "writer_gone"]


class Quarantine:
    """Pages held by failed requests' leases, by lease (generation), with the peak for reports."""

    def __init__(self) -> None:
        self._pages: dict[int, int] = {}
        self.num_pages = 0
        self.peak_pages = 0

    @property
    def num_leases(self) -> int:
        return len(self._pages)

    def add(self, generation: int, pages: int) -> None:
        if generation in self._pages:
            return
        self._pages[generation] = pages
        self.num_pages += pages
        self.peak_pages = max(self.peak_pages, self.num_pages)

    def remove(self, generation: int) -> None:
        self.num_pages -= self._pages.pop(generation, 0)


def writer_gone(transport: Transport, link: Link) -> bool:
    """True only when the prefill behind ``link`` certainly cannot write here any more: the transport
    guarantees it (a closed local peer, or one that dropped us), or its process is gone on this host."""
    if link.agent and not transport.peer_may_write(link.agent):
        return True
    return link.process is not None and is_gone(link.process) is True
