"""How blocking calls wait for an endpoint's progress thread: its news, and its death.

Part of the control plane's shell, beside ``pacing`` and ``sockets``, below ``endpoints`` (each endpoint
owns one ``Waiters``). Waiters sleep on a separate, briefly held condition, not on a condition of the
endpoint's lock: re-acquiring that lock after a wake-up would block for as long as a stalled progress thread
holds it. So every wait is bounded by its own deadline whatever the thread does, and the lock is only ever
taken with a timeout here.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from kvferry.errors import EndpointClosed

__all__ = ["Waiters"]


class Waiters:
    """The progress thread's news to blocking callers (``notify``, ``wait_for``), and why it stopped
    (``crashed``). ``lock`` is the endpoint's; ``role`` names the endpoint in errors."""

    def __init__(self, role: str, lock: threading.RLock) -> None:
        self._role = role
        self._lock = lock
        self._signal = threading.Condition(threading.Lock())
        self._version = 0   # counts the thread's news (notify)
        # Why the progress loop stopped (set under the endpoint's lock, once); None while it runs.
        self.crashed: BaseException | None = None

    def notify(self) -> None:
        """Wake every waiter (``wait_for``): something they may be waiting for changed."""
        with self._signal:
            self._version += 1
            self._signal.notify_all()

    def wait_for(self, done: Callable[[], bool], deadline: float, *, locked: bool = True) -> bool:
        """Block until ``done()`` (run under the endpoint's lock, or without it when ``locked`` is False: a
        ``done`` that reads single fields, as ``wait`` does) is true: True; or until ``deadline``: False.

        Bounded by ``deadline`` alone: the lock is taken with a timeout, the sleep is on a condition of
        its own. Raises ``EndpointClosed`` (cause chained) once the progress thread has died, and whatever
        ``done`` raises. No wake-up is lost either way: the version is read before ``done`` looks, and the
        thread bumps it after every change it reports (``notify``)."""
        while True:
            with self._signal:
                version = self._version
            if locked and not self._lock.acquire(timeout=max(0.0, deadline - time.monotonic())):
                return False
            try:
                if done():  # first: a crash failed every record and link, each with its own answer
                    return True
                self.raise_if_crashed()
            finally:
                if locked:
                    self._lock.release()
            with self._signal:
                while self._version == version:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        return False
                    self._signal.wait(left)

    def raise_if_crashed(self) -> None:
        """``EndpointClosed``, the cause chained, once the progress loop has stopped."""
        if self.crashed is not None:
            raise EndpointClosed(f"{self._role} progress loop stopped: {self.crashed!r}") from self.crashed
