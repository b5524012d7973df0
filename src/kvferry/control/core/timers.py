"""A peer's liveness as both sides judge it: heartbeats, silence, and our own stalls, all by ``now`` passed in.

Part of the protocol core (no I/O), below ``sessions`` and ``links``. Each side keeps one ``PeerClock`` per
peer: when it last heard from the peer (a frame read: stamped with the time the poll returned, so frames
that queued up while this process stalled do not make a peer that gave up on us look alive) and when a
frame of ours last left. From those two times alone:

* a heartbeat is due ``heartbeat_interval`` after our last frame (any frame counts as one);
* the peer is *silent* (lost) once nothing came from it for longer than ``peer_timeout``;
* *we* were silent once nothing of ours left for longer than ``peer_timeout`` (this process stalled): the
  peer has declared us dead by its own clock, whatever frames queued meanwhile say, so nothing more may be
  written under that session (prefill), and pull-mode reads stop at the tighter ``fence_s`` (decode).

``next_deadline`` is the earliest time the verdict can change with no frame in between, so a shell (or a
simulator) ticks exactly then instead of polling. ``GraceClock`` is decode's quarantine rule for one part
of a failed request: ``lease_grace`` runs only from the writer's certain death, never from a timeout.
"""

from __future__ import annotations

import math
from enum import Enum

__all__ = ["GraceClock", "Liveness", "PeerClock"]


class Liveness(Enum):
    """``PeerClock.judge``'s verdict, most serious first."""

    WE_WERE_SILENT = "we_were_silent"   # our frames paused past peer_timeout: the peer has given up on us
    PEER_SILENT = "peer_silent"         # nothing from the peer for longer than peer_timeout: it is lost
    HEARTBEAT_DUE = "heartbeat_due"     # nothing of ours left for heartbeat_interval: send one
    OK = "ok"


class PeerClock:
    """When we last heard from one peer and last sent to it; what that means at ``now``."""

    __slots__ = ("heartbeat_interval", "last_seen", "last_sent", "peer_timeout")

    def __init__(self, now: float, heartbeat_interval: float, peer_timeout: float) -> None:
        self.heartbeat_interval = heartbeat_interval
        self.peer_timeout = peer_timeout
        self.last_seen = self.last_sent = now

    def heard(self, now: float) -> None:
        """A frame from the peer was read (``now``: when the poll that found it returned)."""
        self.last_seen = now

    def sent(self, now: float) -> None:
        """A frame of ours left for the peer (not merely queued)."""
        self.last_sent = now

    def silent_for(self, now: float) -> float:
        return now - self.last_seen

    def unheard_for(self, now: float) -> float:
        """How long the peer has heard nothing from us."""
        return now - self.last_sent

    def peer_silent(self, now: float) -> bool:
        return now > self.last_seen + self.peer_timeout

    def we_were_silent(self, now: float, limit: float | None = None) -> bool:
        """Our frames paused past ``limit`` (default ``peer_timeout``): the peer may have given up on us."""
        return now > self.last_sent + (self.peer_timeout if limit is None else limit)

    def heartbeat_due(self, now: float) -> bool:
        return now >= self.last_sent + self.heartbeat_interval

    def judge(self, now: float) -> Liveness:
        if self.we_were_silent(now):
            return Liveness.WE_WERE_SILENT
        if self.peer_silent(now):
            return Liveness.PEER_SILENT
        if self.heartbeat_due(now):
            return Liveness.HEARTBEAT_DUE
        return Liveness.OK

    def next_deadline(self) -> float:
        """The earliest ``now`` at which ``judge`` may answer otherwise than now, if no frame comes or goes:
        the heartbeat falls due, or a silence passes ``peer_timeout`` (strictly: the first representable time
        after it). Exact: each test above compares ``now`` with one of these sums."""
        hb = self.last_sent + self.heartbeat_interval
        silent = min(self.last_seen, self.last_sent) + self.peer_timeout
        return min(hb, _after(silent))


def _after(t: float) -> float:
    """The first float greater than ``t``: a silence of exactly ``peer_timeout`` is not yet too long."""
    return math.nextafter(t, math.inf)


class GraceClock:
    """When one quarantined part of a request may leave quarantine (decode, push mode). No timer alone
    ends a quarantine: a stalled writer resumes whenever it likes and a one-sided write needs no help from
    decode. Only once the writer is *certainly* gone (``writer_gone``: its process gone on this host, or the
    transport says it cannot write) does ``lease_grace`` start; the part is ``due`` that long after.
    ``needs_check``: the shell should ask again whether the writer is gone (it may read ``/proc``)."""

    __slots__ = ("lease_grace", "release_at")

    def __init__(self, lease_grace: float) -> None:
        self.lease_grace = lease_grace
        self.release_at: float | None = None

    @property
    def needs_check(self) -> bool:
        return self.release_at is None

    def writer_gone(self, now: float) -> None:
        """The writer certainly cannot write any more (learned at ``now``); the first answer counts."""
        if self.release_at is None:
            self.release_at = now + self.lease_grace

    def due(self, now: float) -> bool:
        return self.release_at is not None and now >= self.release_at

    def next_deadline(self) -> float | None:
        """When ``due`` turns True; None while the writer may still write (no timer runs)."""
        return self.release_at
