"""``connect_needed``'s memory of failed handshakes: what to raise again at once, and until when.

Part of the protocol core (no I/O), at its bottom. An engine adapter asks to be connected before every
request; a prefill that refused (layouts, versions, secret or mode differ) will not change its mind, so
the refusal is raised again at once, forever; one that did not answer (it is down) is not asked again
for ``retry_after`` seconds, doubling with each failure in a row up to ``RETRY_MAX``, so a prefill that
is down costs each request nothing, not a handshake timeout.
"""

from __future__ import annotations

from kvferry.errors import IncompatiblePeer, KVFerryError

__all__ = ["RETRY_AFTER", "RETRY_MAX", "ConnectBackoff"]

RETRY_AFTER = 1.0
RETRY_MAX = 30.0


class ConnectBackoff:
    """Failed handshakes per address list: ``refused[key] = (retry at, the error, the back-off)``."""

    def __init__(self) -> None:
        self.refused: dict[tuple[str, ...], tuple[float, KVFerryError, float]] = {}

    def error(self, now: float, key: tuple[str, ...]) -> KVFerryError | None:
        """The remembered failure to raise again at once: a refusal always, another failure until its
        back-off passed; None: try again."""
        refused = self.refused.get(key)
        if refused is not None and (isinstance(refused[1], IncompatiblePeer) or now < refused[0]):
            return refused[1]
        return None

    def failed(self, now: float, key: tuple[str, ...], error: KVFerryError, retry_after: float) -> None:
        """A handshake failed (not a refusal): not tried again for the back-off, doubled from the last one."""
        before = self.refused.get(key)
        wait = min(RETRY_MAX, retry_after if before is None else 2 * before[2])
        self.refused[key] = (now + wait, error, wait)

    def succeeded(self, key: tuple[str, ...]) -> None:
        self.refused.pop(key, None)
