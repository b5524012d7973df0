"""The endpoints' deadlines and limits (``EndpointOptions``): what every timer of the protocol is set by.

Part of the protocol core (no I/O), at its bottom with ``states`` and ``timers``.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvferry.control import wire
from kvferry.errors import UsageError

__all__ = ["EndpointOptions"]


@dataclass(frozen=True, slots=True)
class EndpointOptions:
    """Deadlines and limits. Every wait the endpoint does is bounded by one of these (seconds).

    * ``heartbeat_interval``: how often each side tells the other it is alive.
    * ``peer_timeout``: silence after which the peer is declared dead and its requests fail (``PeerLost``).
    * ``request_timeout``: a request not done by then fails on this side (``TransferTimeout``).
    * ``lease_grace``: how long decode still keeps a failed request's pages after their writer is
      *certainly* gone (its process gone on this host, or the transport guarantees it cannot write). No
      longer a timer after a peer is declared dead: a silent peer may be stalled, not dead, and resume
      writing; its pages stay quarantined until it acknowledges or is certainly gone (docs/fencing.md).
    * ``handshake_timeout``: default bound of ``DecodeEndpoint.connect`` and of a half-open handshake.
    * ``busy_poll``: sleep between progress iterations while something is in flight, right after one
      that found work; each idle iteration doubles it, up to ``busy_poll_max``, and up to ``busy_poll``
      times the number of requests in flight (never below ``busy_poll``): a lone request is polled every
      ``busy_poll``, many share longer sleeps. Under load (``LAZY_WAKE_MIN`` or more in flight) the loop
      sleeps ``busy_poll / 4`` per request in flight, up to ``busy_poll_max``, after every iteration.
    * ``max_message_bytes``: ZMQ drops peers that send larger messages (silently: decode notices the
      drop and fails the link with an error naming this limit).
    * ``batch_chunks``, ``batch_bytes``: under load prefill posts the chunks one iteration has ready for
      one decode as few writes as the caps allow (decode in pull mode, those ready from one prefill as few
      reads), each of at most this many chunks and bytes, and of at most half the requests in flight, so
      that two transfers share the window (``control.write_batch.group_cap``; 1 chunk: every chunk its own
      transfer). Nothing waits to be batched; the bytes cap bounds how long the first chunk of a transfer
      waits for the rest of it to land.
    * ``stats``: keep the running totals ``stats()`` reports (``control.stats``); off only to measure what
      they cost (``bench/control.py --stats``).
    * ``refuse_unissued`` (prefill): an announce for a request id this prefill never issued
      (``PrefillEndpoint.issue``) nor sent is refused at once with ``UnknownRequest`` naming it, and so is one
      for a request already done here (a replay), instead of waiting ``request_timeout`` for a ``send`` that
      will not come. Only for engines whose order makes it true: prefill issues every id before decode can
      be asked about it (vLLM's: the id reaches decode in prefill's response). Off by default.
    * ``transport_liveness``: decide "peer gone" from what CPU starvation cannot fake (issue 29). Each ZMQ
      connection runs libzmq's own ZMTP heartbeats (every ``heartbeat_interval``, dropped after
      ``peer_timeout`` unanswered): libzmq's I/O thread answers them without the GIL, so a busy or
      GIL-starved peer still does, while a stopped, hung-in-the-kernel or dead one does not. A dropped
      connection (that, a reset, a refusal) ends the peer at once; application-level silence past
      ``peer_timeout`` only makes it *suspect* (requests ride it out, bounded by ``request_timeout``).
      A prefill back from its own stall asks decode before writing again (a probe, protocol 8;
      docs/protocol.md, "Slow is not dead"). On by default; off, silence past ``peer_timeout`` is loss
      (the rule before issue 29). Both sides of a pair should agree.
    """

    heartbeat_interval: float = 0.5
    peer_timeout: float = 5.0
    request_timeout: float = 60.0
    lease_grace: float = 5.0
    handshake_timeout: float = 10.0
    busy_poll: float = 50e-6
    busy_poll_max: float = 1e-3
    max_message_bytes: int = 64 << 20
    batch_chunks: int = 64
    batch_bytes: int = 8 << 20
    stats: bool = True
    refuse_unissued: bool = False
    transport_liveness: bool = True

    def __post_init__(self) -> None:
        for name in ("heartbeat_interval", "peer_timeout", "request_timeout", "lease_grace",
                     "handshake_timeout", "busy_poll", "busy_poll_max"):
            if not getattr(self, name) > 0:
                raise UsageError(f"EndpointOptions.{name} must be > 0, got {getattr(self, name)!r}")
        for name in ("batch_chunks", "batch_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise UsageError(f"EndpointOptions.{name} must be an int >= 1, got {value!r}")
        if self.batch_chunks > wire.MAX_BATCH:
            raise UsageError(f"EndpointOptions.batch_chunks must be <= {wire.MAX_BATCH} (wire.MAX_BATCH), "
                             f"got {self.batch_chunks}")
        if self.peer_timeout <= self.heartbeat_interval:
            raise UsageError("peer_timeout must exceed heartbeat_interval, or live peers look dead")
