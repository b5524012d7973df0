"""A peer's liveness as both sides judge it: heartbeats, silence, and our own stalls, all by ``now`` passed in.

Part of the protocol core (no I/O), below ``sessions`` and ``links``. Each side keeps one ``PeerClock`` per
peer: when it last heard from the peer (a frame read: stamped with the time the poll returned, so frames
that queued up while this process stalled do not make a peer that gave up on us look alive) and when a
frame of ours last left. From those two times alone:

* a heartbeat is due ``heartbeat_interval`` after our last frame (any frame counts as one);
* the peer is *silent* once nothing came from it for longer than ``peer_timeout``. Silence alone makes it
  *suspect*, not lost, when its connection is known to be up (``connected=True``: libzmq's own ZMTP
  heartbeats, answered by its I/O thread without the GIL, still come back, so the peer is slow, not gone;
  a SIGSTOPped or dead process answers none and libzmq drops the connection, which ends it at once). With
  no such knowledge (``connected=None``) silence means lost, as before;
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
    GONE = "gone"                       # the connection is down (refused, reset, ZMTP heartbeats unanswered)
    PEER_SILENT = "peer_silent"         # nothing from the peer for longer than peer_timeout: it is lost
    PEER_SUSPECT = "peer_suspect"       # silent that long, but its connection is up: slow, not gone
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

    def peer_lost(self, now: float, connected: bool | None = None) -> bool:
        """Whether the peer is gone at ``now``: its connection is down (``connected=False``), or it is
        silent past ``peer_timeout`` with nothing telling us it is up (``connected=None``). Silence with
        ``connected=True`` is never loss: a starved peer resumes, and requests are bounded by their own
        deadline (``request_timeout``), not by this."""
        if connected is False:
            return True
        return connected is None and self.peer_silent(now)

    def judge(self, now: float, connected: bool | None = None) -> Liveness:
        """The verdict at ``now``. ``connected``: what the transport below says of the peer's connection
        (True: up and its keepalives answered; False: down; None: not known, silence decides)."""
        if self.we_were_silent(now):
            return Liveness.WE_WERE_SILENT
        if connected is False:
            return Liveness.GONE
        if self.peer_silent(now):
            return Liveness.PEER_SILENT if connected is None else Liveness.PEER_SUSPECT
        if self.heartbeat_due(now):
            return Liveness.HEARTBEAT_DUE
        return Liveness.OK

    def next_deadline(self, now: float | None = None) -> float:
        """The earliest ``now`` at which ``judge`` may answer otherwise than now, if no frame comes or goes:
        the heartbeat falls due, or a silence passes ``peer_timeout`` (strictly: the first representable time
        after it). Exact: each test above compares ``now`` with one of these sums. Given ``now``, a peer
        silence already passed is left out: a *suspect* peer (its connection up) is not lost by it, and the
        heartbeats we still owe it are the next thing to happen."""
        hb = self.last_sent + self.heartbeat_interval
        ours = _after(self.last_sent + self.peer_timeout)
        peer = _after(self.last_seen + self.peer_timeout)
        if now is not None and peer <= now:
            peer = math.inf
        return min(hb, ours, peer)


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
