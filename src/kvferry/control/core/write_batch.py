"""Batched transfers: the chunks one progress iteration has ready for one peer, posted as one transfer.

Part of the protocol core (no I/O), above ``wire`` and ``plan``, below ``core.prefill`` (push mode's
writes) and ``core.decode`` (pull mode's reads, the same way round). Under load the
progress thread finds tens of requests ready per iteration, and each write costs the same fixed work
whatever its size (a NIXL transfer made, posted, polled and released; a notification sent and received):
about 55 us per request on the raw baseline (``bench/control.py --raw-batched``, bench/RESULTS.md). So the
chunks queued for one decode in one iteration go as one write of their joined plans (``concat_plans``),
whose notification is a ``wire.Batch`` of their ``Chunk`` messages. Nothing waits for company: a chunk alone
in its iteration goes alone, as before, with its plain ``Chunk``, and is posted at once unless the previous
iteration posted several (``WriteBatches.wanted``).

Each record still settles, fails and aborts on its own: it holds the shared write's ticket, and the
shell releases the transfer once it completed (pull mode's reads the same way: each part holds the
read's ticket). A failed write fails every record in it (their bytes may
have landed in part). Only whole-page plans join (equal TP; across TP each rank's plan goes alone), and a
group is capped in chunks, bytes moved (the first request's latency is the group's copy), notification
bytes and half the requests in flight (``group_cap``: two transfers share the window, so that decode
finishes one while prefill copies the next).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from kvferry.plan.contract import Plan
from kvferry.plan.planner import TransferPlan, concat_plans

__all__ = ["NOTIF_BYTES", "Queued", "WriteBatches", "group_cap", "joinable", "joined", "write_groups"]

# Notification bytes of one batched write: a chunk's sampled digests are ~1 KB, so tens fit; a chunk with
# larger digests (full mode over many pages) goes alone.
NOTIF_BYTES = 64 << 10


class Queued:
    """One chunk waiting for its iteration's transfer: the record, its plan, its encoded ``Chunk`` (a
    write's notification; empty for a read) and, for a read, decode's part and the chunk it brings."""

    __slots__ = ("chunk", "data", "label", "part", "plan", "rec")

    def __init__(self, rec: Any, plan: Plan, data: bytes, label: str, part: Any = None, chunk: Any = None) -> None:
        self.rec, self.plan, self.data, self.label, self.part, self.chunk = rec, plan, data, label, part, chunk


def joinable(plan: Plan) -> bool:
    """Whether ``plan`` may share a write: a whole-page plan of the planner's own type (a TP plan of head
    slices, or the fault injector's, goes alone)."""
    return type(plan) is TransferPlan


class WriteBatches:
    """The chunks queued in this iteration, per peer (prefill: a decode session; decode: a link), in order
    (progress thread, under the lock)."""

    def __init__(self) -> None:
        self._queued: dict[Any, list[Queued]] = {}
        self._seen = 0          # chunks posted in this iteration, queued or not
        self.batching = False   # the last iteration posted several

    def wanted(self) -> bool:
        """Count one more chunk posted in this iteration; whether to queue it for a shared transfer. Yes
        when the last iteration posted several (under load), or this one already did. At one request in
        flight a chunk is posted at once: queueing it costs a few tens of microseconds there (measured
        at p50, bench/RESULTS.md) and finds no company."""
        self._seen += 1
        return self.batching or self._seen > 1

    def next_iteration(self) -> None:
        self.batching, self._seen = self._seen > 1, 0

    def __bool__(self) -> bool:
        return bool(self._queued)

    def add(self, peer: Any, queued: Queued) -> None:
        group = self._queued.get(peer)
        if group is None:
            self._queued[peer] = [queued]
        else:
            group.append(queued)

    def queued(self, peer: Any) -> list[Queued]:
        return self._queued.get(peer, [])

    def take(self) -> list[tuple[Any, list[Queued]]]:
        """Everything queued, taken off (to be posted now)."""
        out = list(self._queued.items())
        self._queued.clear()
        return out


def group_cap(max_chunks: int, in_flight: int) -> int:
    """Chunks one transfer may carry: ``max_chunks``, and at most half of the requests in flight, so that at
    least two transfers share the window: one side copies one while the other finishes the last (a
    transfer carrying the whole window leaves decode idle while prefill copies, and prefill idle while
    decode checks and announces; bench/RESULTS.md, issue 13, eighth round)."""
    return max(1, min(max_chunks, in_flight // 2))


def write_groups(queued: list[Queued], max_chunks: int, max_bytes: int) -> Iterator[list[Queued]]:
    """``queued`` in order, cut into the groups that go as one write each: up to ``max_chunks`` joinable
    chunks, ``max_bytes`` moved and ``NOTIF_BYTES`` of notification (a group's first chunk may exceed the
    byte caps: it goes alone). A chunk that cannot join goes alone, in its place."""
    group: list[Queued] = []
    moved = notif = 0
    for q in queued:
        if not joinable(q.plan):
            if group:
                yield group
            yield [q]
            group, moved, notif = [], 0, 0
            continue
        nbytes = q.plan.nbytes
        if group and (len(group) >= max_chunks or moved + nbytes > max_bytes or notif + len(q.data) > NOTIF_BYTES):
            yield group
            group, moved, notif = [], 0, 0
        group.append(q)
        moved += nbytes
        notif += len(q.data)
    if group:
        yield group


def joined(group: list[Queued]) -> tuple[Plan, str]:
    """The plan and the label (naming every chunk, for errors) of one transfer carrying ``group``."""
    if len(group) == 1:
        return group[0].plan, group[0].label
    return concat_plans([q.plan for q in group]), ", ".join(q.label for q in group)
