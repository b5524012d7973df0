"""The earliest request deadline a core still has to act on, found without a scan of its records.

Part of the protocol core (no I/O), below ``prefill`` and ``decode``. ``next_deadline`` runs once per loop
iteration (the shell's, and the simulator's); scanning every live record there made each iteration cost as
much as the requests in flight. A record's deadline is fixed when it is made, and a record stops counting
for good (it ends, or leaves its core's container), so a heap with entries dropped lazily as they reach the
top gives the same minimum as the scan did.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from typing import Any

__all__ = ["DeadlineHeap"]

_SLACK = 64   # entries beyond twice the counted records before the heap is rebuilt from them


class DeadlineHeap:
    """Records by deadline. ``earliest(counted, size)``: the least deadline among the pushed records that
    ``counted`` still accepts; a record it refuses must never be accepted again unless pushed again."""

    __slots__ = ("_heap", "_seq")

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, Any]] = []
        self._seq = 0   # ties in deadline compare by push order, never by record

    def push(self, rec: Any) -> None:
        heapq.heappush(self._heap, (rec.deadline, self._seq, rec))
        self._seq += 1

    def earliest(self, counted: Callable[[Any], bool], size: int) -> float | None:
        """The least deadline among counted records (``size``: how many may be counted, to bound the heap)."""
        heap = self._heap
        if len(heap) > 2 * size + _SLACK:   # ended records deep in the heap: keep memory bounded
            heap[:] = [entry for entry in heap if counted(entry[2])]
            heapq.heapify(heap)
        while heap:
            entry = heap[0]
            if counted(entry[2]):
                return entry[0]
            heapq.heappop(heap)
        return None

    def __len__(self) -> int:
        return len(self._heap)
