"""Decode's quarantine: the pages of failed requests whose writer may still write, counted by lease.

Part of the protocol core (no I/O), below ``core.decode``. A request that fails on decode while a prefill may
still write it (an abort, a deadline, a peer silent or lost) keeps its lease: its pages are *quarantined*,
not reusable, until every prefill rank writing it either acknowledged (``Fail(settled=True)`` for that
request and generation: its posted writes completed or cancelled) or certainly cannot write any more (the
shell answers ``DecodeCore``'s ``CheckWriter``: ``control.quarantine.writer_gone``). Only then does
``options.lease_grace`` start (``timers.GraceClock``), bounding how long after a confirmed death decode still
waits. No timer alone ends a quarantine: a stalled writer resumes whenever it likes, and one-sided writes
need no help from decode (docs/fencing.md).
"""

from __future__ import annotations

__all__ = ["Quarantine"]


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
