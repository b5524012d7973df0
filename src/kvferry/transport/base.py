"""The transport contract: register memory, meet a peer, post plan writes, hear notifications.

The bottom of the transport layer, above ``plan``, below ``local`` and ``nixl``. A transport moves the
rows of a ``Plan`` from this side's
registered memory into a peer's registered memory and delivers a small notification after the last byte.
Two implementations: ``NixlTransport`` (NVIDIA NIXL over UCX, host or GPU memory) and ``LocalTransport``
(in-process memmove, the reference the tests compare against).

Threading: a transport is driven from one thread (the control plane's progress loop); it is not
thread-safe. Backend errors are translated into kvferry exceptions inside each implementation, in one
place, naming the peer and the request label.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from types import TracebackType

import numpy as np

from kvferry.errors import TransferTimeout, TransportError
from kvferry.layout.memory import KVMemory
from kvferry.plan.contract import Plan

__all__ = ["TransferHandle", "Transport", "check_rows_in_regions"]


class TransferHandle(ABC):
    """One posted write. Poll or wait on it, then release it (or use it as a context manager)."""

    peer: str
    label: str

    @abstractmethod
    def poll(self) -> bool:
        """Non-blocking: True once every byte has landed at the peer, False while in flight.

        Raises ``TransportError`` (or ``PeerLost``) if the transfer failed; a failed handle keeps raising.
        """

    def wait(self, timeout: float) -> None:
        """Block until done; raises ``TransferTimeout`` once ``timeout`` seconds pass first."""
        deadline = time.monotonic() + timeout
        delay = 0.0
        while not self.poll():
            if time.monotonic() >= deadline:
                raise TransferTimeout(f"write {self.label!r} to peer {self.peer!r} not done after {timeout:.3f} s")
            time.sleep(delay)
            delay = min(1e-3, delay + 2e-5)  # spin briefly, then back off: small writes finish in microseconds

    @abstractmethod
    def release(self) -> None:
        """Free the backend's resources for this handle. Idempotent.

        Releasing a handle still in flight cancels it where the backend can; the bytes it already wrote
        may have landed, so the caller must keep the destination pages leased until the peer confirms.
        """

    def __enter__(self) -> TransferHandle:
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None) -> None:
        self.release()


class Transport(ABC):
    """Contract shared by all transports. Called from one thread; every method may raise TransportError."""

    name: str = "abstract"

    @property
    @abstractmethod
    def agent_name(self) -> str:
        """This side's unique name, the one peers see in notifications."""

    @abstractmethod
    def register(self, memory: KVMemory) -> bytes:
        """Register this side's memory (once) and return metadata for peers (opaque bytes)."""

    @abstractmethod
    def add_peer(self, metadata: bytes) -> str:
        """Learn a peer from its ``register`` metadata; returns the peer's agent name. Re-adding replaces."""

    @abstractmethod
    def remove_peer(self, peer: str) -> None:
        """Forget a peer (its connection and cached descriptors). Unknown peers are ignored."""

    @abstractmethod
    def write(self, plan: Plan, peer: str, notif: bytes, label: str = "") -> TransferHandle:
        """Post the plan's rows as a write into ``peer``; ``notif`` reaches the peer after the last byte.

        ``plan.src_memory`` must be the memory registered here, ``plan.dst_memory`` the peer's (as decoded
        from its manifest). A plan with rows outside registered regions on either side is refused here,
        with ``TransportError``, before anything is posted; failures after posting surface from the handle.
        """

    @abstractmethod
    def send_notification(self, peer: str, message: bytes) -> None:
        """Send a small message to ``peer`` outside any transfer."""

    @abstractmethod
    def get_notifications(self) -> list[tuple[str, bytes]]:
        """Drain received notifications as (peer name, message); also drives the backend's progress.

        The receiving side must call this regularly: with no progress thread, nothing else does.
        """

    def peer_may_write(self, peer: str) -> bool:
        """False only when this transport guarantees that ``peer`` can no longer write into this side's
        memory (decode's quarantine ends on it). The default, True, guarantees nothing: over NIXL a
        one-sided write needs no help from this side, and only the control plane can tell that the
        writer's process is gone."""
        return True

    @abstractmethod
    def close(self) -> None:
        """Release everything. Idempotent."""

    def __enter__(self) -> Transport:
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None) -> None:
        self.close()


def check_rows_in_regions(descs: np.ndarray, memory: KVMemory, side: str, peer: str, label: str) -> None:
    """Refuse any ``(addr, len, dev)`` row not wholly inside one region of ``memory`` (vectorised).

    The planner already guarantees this for plans it built; transports check again at the edge because a
    plan's destination addresses come from a peer's manifest, and a write outside registered memory
    corrupts whatever lives there.
    """
    if len(descs) == 0:
        return
    # Device address spaces do not overlap in practice (CUDA uses one virtual address space per process
    # for host and all GPUs), so one sorted list serves all devices; the device id is checked as well.
    key_start, key_end, key_dev = memory.region_bounds
    addr, length, dev = descs[:, 0], descs[:, 1], descs[:, 2]
    # Regions are disjoint (KVMemory checks), so the only candidate is the last region starting at or
    # below the row's address.
    idx = np.searchsorted(key_start, addr, side="right").astype(np.int64) - 1
    ok = idx >= 0
    idx_c = np.clip(idx, 0, len(key_start) - 1)
    end = key_end[idx_c]
    ok &= key_dev[idx_c] == dev
    ok &= addr < end
    # ``length <= end - addr`` rather than ``addr + length <= end``: the sum can wrap around 2**64.
    ok &= length <= np.where(addr < end, end - addr, 0)
    ok &= length > 0
    if not ok.all():
        bad = int(np.flatnonzero(~ok)[0])
        raise TransportError(
            f"write {label!r} to peer {peer!r}: {side} row {bad} (addr={int(addr[bad]):#x}, "
            f"len={int(length[bad])}, dev={int(dev[bad])}) is outside every registered {side} region")
