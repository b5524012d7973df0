"""Faults injected below the control plane for a workload run: a transport that misbehaves on purpose.

Part of the workload layer, above ``diagnostics.faults``, below ``prefill``: ``prefill`` wraps its transport in a
``FaultyTransport`` when the config names a fault (``--inject``), so the endpoints, digests and decode's
byte checks meet the fault exactly as they would meet a broken transport. The faults themselves are
described, parsed and planned in ``kvferry.diagnostics.faults``.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from kvferry.layout.memory import KVMemory
from kvferry.plan.contract import Plan
from kvferry.transport.base import TransferHandle, Transport


class FaultyTransport(Transport):
    """A transport that misbehaves as ``kvferry.diagnostics.faults`` describes, below the control plane.

    ``buffer0-slots``: every plan is re-addressed the way the buffer-0 slot-count sender would. ``flip``:
    source bytes of the named buffer are flipped while the write is posted and restored once it is done,
    so the bytes arriving differ from those the endpoint digested: corruption in flight.
    """

    def __init__(self, inner: Transport, fault: str) -> None:
        from kvferry.diagnostics.faults import FaultSpec

        self.inner = inner
        self.fault = FaultSpec.parse(fault)
        self.name = inner.name  # the handshake compares transport names

    @property
    def agent_name(self) -> str:
        return self.inner.agent_name

    def register(self, memory: KVMemory) -> bytes:
        return self.inner.register(memory)

    def add_peer(self, metadata: bytes) -> str:
        return self.inner.add_peer(metadata)

    def remove_peer(self, peer: str) -> None:
        self.inner.remove_peer(peer)

    def peer_may_write(self, peer: str) -> bool:
        return self.inner.peer_may_write(peer)

    def write(self, plan: Plan, peer: str, notif: bytes, label: str = "") -> TransferHandle:
        from kvferry.diagnostics.faults import FaultKind

        pages = plan_pages(plan)
        if self.fault.kind is FaultKind.BUFFER0_SLOTS:
            plan = self.fault.plan(plan.src_memory, plan.dst_memory, pages, plan.buffer_names)
        if self.fault.kind is not FaultKind.FLIP:
            return self.inner.write(plan, peer, notif, label)
        flips = self._flip(plan.src_memory, pages)
        handle = self.inner.write(plan, peer, notif, label)
        return RestoringHandle(handle, lambda: self._unflip(plan.src_memory, flips))

    def _flip(self, memory: KVMemory, pages: dict[str, tuple[np.ndarray, np.ndarray]]) -> list[tuple[int, int]]:
        from kvferry.diagnostics.faults import flip_bytes

        name = self.fault.buffer or ""
        pool = memory.layout.pool_of.get(name)
        if pool not in pages:
            return []
        src, dst = pages[pool]
        chosen = src if self.fault.pages is None else src[np.isin(dst, self.fault.pages)]
        return flip_bytes(memory, name, chosen.tolist())

    def _unflip(self, memory: KVMemory, flips: list[tuple[int, int]]) -> None:
        view = memory.array(self.fault.buffer or "")
        for page, offset in flips:
            view[page, offset] ^= 0xFF  # XOR twice: the source holds its own bytes again

    def send_notification(self, peer: str, message: bytes) -> None:
        self.inner.send_notification(peer, message)

    def get_notifications(self) -> list[tuple[str, bytes]]:
        return self.inner.get_notifications()

    def close(self) -> None:
        self.inner.close()


def plan_pages(plan: Plan) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Pool -> (source pages, destination pages) a plan touches, aligned: a whole-page plan's pool plans, a
    TP plan's planned pools, or a token plan's segments (between page sizes, or a padded state page's
    sections). A pool named by several parts (a joined plan) keeps its last part's pages."""
    parts = getattr(plan, "pools", None)
    if parts is None:
        parts = getattr(plan, "pool_pages", None)
    if parts is not None:
        return {part.pool: (part.src_pages, part.dst_pages) for part in parts}
    return {seg.pool: (seg.src_page, seg.dst_page) for seg in getattr(plan, "segments", ())}


class RestoringHandle(TransferHandle):
    """A handle that runs ``restore`` once, when its write is done or released."""

    def __init__(self, inner: TransferHandle, restore: Callable[[], None]) -> None:
        self.inner, self.peer, self.label = inner, inner.peer, inner.label
        self._restore: Callable[[], None] | None = restore

    def poll(self) -> bool:
        done = self.inner.poll()
        if done:
            self._run_restore()
        return done

    def release(self) -> None:
        self.inner.release()
        self._run_restore()

    def _run_restore(self) -> None:
        restore, self._restore = self._restore, None
        if restore is not None:
            restore()
