"""Transfer handles shared by several records: the shell's side of a batched transfer.

Part of the control plane's shell, above the transports. A batched transfer carries the chunks of several
records; with ``share`` each holds its own handle on it, and the transfer is released once every record let
go. (Neither endpoint needs it since issue 29: each core keys a batched transfer by one ticket, and the
shell releases the handle once it completed.)
"""

from __future__ import annotations

from kvferry.transport import TransferHandle

__all__ = ["share"]


class _Shared:
    __slots__ = ("handle", "refs")

    def __init__(self, handle: TransferHandle, refs: int) -> None:
        self.handle, self.refs = handle, refs


class _Member(TransferHandle):
    """One record's handle on a shared write: polls it; releasing it lets go of one reference (once)."""

    __slots__ = ("_released", "_shared", "label", "peer")

    def __init__(self, shared: _Shared) -> None:
        self._shared, self._released = shared, False
        self.peer, self.label = shared.handle.peer, shared.handle.label

    def poll(self) -> bool:
        return self._shared.handle.poll()

    def release(self) -> None:
        if self._released:
            return
        self._released = True
        self._shared.refs -= 1
        if self._shared.refs == 0:
            self._shared.handle.release()


def share(handle: TransferHandle, count: int) -> list[TransferHandle]:
    """``count`` handles on one transfer, one per record in it; it is released when all are (one record:
    the handle itself)."""
    if count == 1:
        return [handle]
    shared = _Shared(handle, count)
    return [_Member(shared) for _ in range(count)]
