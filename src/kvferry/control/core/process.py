"""Which process a peer is: what each side reports at the handshake (pure data; ``liveness`` checks it).

Part of the protocol core (no I/O). Whether the process is gone is asked of the shell (``CheckProcess``):
reading the process table is I/O.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ProcessIdentity"]


@dataclass(frozen=True, slots=True)
class ProcessIdentity:
    """A process, precisely enough that a reused PID is not mistaken for it.

    ``host``: hostname, boot id and PID-namespace inode (two containers may share a hostname, not all
    three); ``started``: start time in clock ticks since boot (``/proc/<pid>/stat`` field 22), 0 when
    unknown; ``pid`` 0 means "not reported" (an older or foreign peer)."""

    host: str
    pid: int
    started: int
