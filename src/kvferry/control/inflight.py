"""The transfers an endpoint posted and has not yet seen end: their transport handles, in posting order.

Part of the control plane's shell, above ``transport``, below ``prefill`` (its writes) and ``decode`` (its
pull-mode reads). The core knows each transfer by its handle as a ticket and never touches the handle; only
the progress thread posts, polls and releases them, so this needs no lock of its own.
"""

from __future__ import annotations

from collections.abc import Callable

from kvferry.errors import KVFerryError, TransportError
from kvferry.transport import TransferHandle

__all__ = ["InFlight"]


class InFlight:
    """Handles of posted transfers (progress thread only)."""

    __slots__ = ("_handles",)

    def __init__(self) -> None:
        self._handles: dict[TransferHandle, None] = {}   # a dict: ordered, and O(1) to remove

    def __len__(self) -> int:
        return len(self._handles)

    def add(self, handle: TransferHandle) -> None:
        """A transfer just posted (its handle as the core's ticket)."""
        self._handles[handle] = None

    def settle(self, now: float, settled: Callable[[float, TransferHandle, KVFerryError | None], None]) -> bool:
        """Poll each transfer; release each that ended and tell the core (``settled(now, handle, error)``).
        True when one ended."""
        handles = self._handles
        news = False
        for handle in list(handles):
            error: KVFerryError | None = None
            try:
                if not handle.poll():
                    continue
            except TransportError as exc:
                error = exc
            handle.release()
            del handles[handle]
            news = True
            settled(now, handle, error)
        return news
