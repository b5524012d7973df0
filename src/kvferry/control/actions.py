"""Between events: carrying out what an endpoint's core queued (messages, effects, transfers).

Part of the control plane's shell, above ``sockets`` and ``control.core``, below ``endpoints`` (each
endpoint's progress thread owns one ``ActionRunner``). A decision (one caller's command, one peer frame, one
iteration's batches) never lets the endpoint's lock go; it only queues what it decided. Between two events
the progress thread, holding the lock, runs ``run``: the effects in order (``FlushNow`` here, the rest by
the endpoint's ``apply``), then each transfer by the endpoint's ``carry_out``, which posts it with the lock
let go (``unlocked``) and feeds the outcome back to the core. ``flush`` sends the messages the core queued.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from kvferry.control import wire
from kvferry.control.core.base import CoreBase, Effect, FlushNow, Transfer
from kvferry.control.sockets import Port

__all__ = ["ActionRunner"]

T = TypeVar("T")


class ActionRunner:
    """Runs the core's queued actions through ``port`` (messages), ``apply`` (an effect other than
    ``FlushNow``) and ``carry_out`` (a transfer). Progress thread only, holding ``lock`` (the endpoint's)."""

    def __init__(self, core: CoreBase, lock: threading.RLock, port: Port, apply: Callable[[Effect], None],
                 carry_out: Callable[[Transfer], None]) -> None:
        self._core = core
        self._lock = lock
        self._port = port
        self._apply = apply
        self._carry_out = carry_out

    def run(self) -> None:
        """Carry out what the last event decided, in order: its effects, then its transfers (each of which
        may queue more effects)."""
        core = self._core
        while core.effects or core.transfers:
            while core.effects:
                self.apply(core.effects.popleft())
            if core.transfers:
                self._carry_out(core.transfers.popleft())

    def apply(self, effect: Effect) -> None:
        """Carry out one of the core's effects (``core.base``)."""
        if isinstance(effect, FlushNow):
            self._flush_peer(effect.peer, effect.raw)
        else:
            self._apply(effect)

    def flush(self) -> None:
        """Send every message the core queued, per peer in order, several as ``wire.Batch`` frames; then
        carry out the effects the sends queued (decode: a send that failed ended its link, which closes
        now)."""
        core = self._core
        for peer in list(core.outbox):
            self._flush_peer(peer, b"")
        while core.effects:
            self.apply(core.effects.popleft())

    def _flush_peer(self, peer: Any, raw: bytes) -> None:
        """``FlushNow``: what is queued for ``peer`` leaves now, then ``raw`` alone (if any)."""
        for frame in wire.batches(self._core.take_out(peer)):
            self._port.send(peer, frame)
        if raw:
            self._port.send_raw(peer, raw)

    def unlocked(self, holders: Sequence[Any], post: Callable[[], T]) -> T:
        """Run ``post`` (a transport call that may copy for hundreds of microseconds with the GIL released)
        with the endpoint's lock let go, so that callers proceed alongside it; ``posting`` stays True on
        ``holders`` until the lock is back. Only from the endpoint's ``carry_out``, between events: no
        decision is in progress, so nothing a caller changes meanwhile is half-decided."""
        self._lock.release()
        try:
            return post()
        finally:
            self._lock.acquire()
            for holder in holders:
                holder.posting = False
