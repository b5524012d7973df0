"""The control plane's wire protocol: typed, versioned msgspec messages over ZMQ (and NIXL notifications).

Part of the control plane, above ``codec`` and ``errors``, below every module that sends. Every message is an
``Envelope`` ``[version, kind, body]``; decoding takes two steps: the envelope first (so a peer speaking
another protocol version is answered with a ``Reject`` it can still read), then the body, typed by ``kind``.
Everything received is untrusted: msgspec checks types and the size caps below; manifests are re-validated by
``KVMemory.from_manifest``; page lists by the lease table and the planner.

Flow (decode D, prefill P)::

    D -> P  Hello (manifest, transport metadata, nonce)      P -> D  Challenge (nonce), if P has a secret
    D -> P  Auth (HMAC over both nonces and the Hello)       P -> D  Welcome (manifest, metadata, proof) | Reject
    D -> P  Announce (request, generation, pages, prefix, binding)
                                                             P -> D  Ack (only if no chunk is posted at once) | Fail
                                                                     (Fail at once: the bindings differ, or
                                                                     prefill never issued the id)
    NIXL    Chunk (request, generation, chunk, last, digests), delivered after the chunk's write landed;
            a Batch of Chunks when one write carried several requests' chunks (prefill under load)
    P -> D  Ready (request, generation, chunk, source pages, digests)   pull mode, instead of a write + Chunk
    D -> P  Cancel (request): decode will not announce it   P fails it at once
    P -> D  Cancel (request): P failed it before any decode announced it   D keeps it FAILED (refuses nothing)
    D -> P  Result (ok or not, after digests verified)       either  Abort / Fail (settled: no write can land)
    either  Heartbeat, Bye
    P -> D  Heartbeat (probe n), after prefill's own stall   D -> P  Heartbeat (echo n), if D still holds the link
    either  Batch (several of the messages above, once established: see below)

Batching: under load one progress-loop iteration often has several messages for one peer (decode's Results
and Announces, prefill's Readys). The loop queues them and sends them at the end of the iteration, more
than one as a ``Batch``: one ZMQ frame holding each message's own envelope bytes. Each is decoded as if it
had come alone (version checked, typed, capped), in order; a bad one is dropped and counted without
dropping the rest. A Batch is accepted only on an established session, never holds a Batch, and holds at
most ``MAX_BATCH`` messages (more is refused by name); one ZMQ message per iteration instead of one per
request saves a wake-up of libzmq's I/O thread on both sides. Prefill under load also posts the chunks
ready in one iteration for one decode as one write (``write_batch``); that write's notification is a Batch
of their Chunks (``batch_frame``), which decode reads as if each Chunk had come with a write of its own.

Modes (docs/fencing.md): in push mode prefill writes into decode's pages; in pull mode decode reads prefill's
pages after a Ready, verifies them, and its Result (or Abort) lets prefill release them. Hello names the mode
decode asks for, and prefill refuses one it does not accept (a Reject saying "transfer mode differs").

Fencing (docs/fencing.md): the Welcome names prefill's process (host, pid, start time) so decode can tell
when the writer is gone. A decode that reconnects to a prefill it declared dead sends an Abort for every
(request, generation) it quarantined with that prefill; prefill answers each with ``Fail(settled=True)``
once no write of that generation is in flight, from any of its sessions with that decode. Prefill answers a
frame from a session it no longer knows (declared dead, or never seen) with a Bye: the stale decode must
handshake again rather than be heard silently.
"""

from __future__ import annotations

from typing import Annotated

import msgspec
import numpy as np

from kvferry.codec import check_version, decode_struct
from kvferry.errors import (
    BindingMismatch,
    IntegrityError,
    KVFerryError,
    LeaseError,
    PeerLost,
    PlanError,
    ProtocolError,
    RequestAborted,
    TransferTimeout,
    TransportError,
    UnknownRequest,
)
from kvferry.integrity.binding import MAX_BINDING_BLOCKS, MAX_ENTRY_BYTES, Binding

__all__ = ["BATCH_BYTES", "KINDS", "MAX_BATCH", "PROTOCOL_VERSION", "Abort", "Ack", "Announce", "Auth", "Batch", "Bye",
           "Cancel", "Challenge", "Chunk", "Envelope", "Fail", "Heartbeat", "Hello", "Ready", "Reject", "Result",
           "Welcome", "announced_binding", "batch_frame", "batches", "binding_fields", "decode", "decode_pages",
           "encode", "encode_pages", "error_from_wire",
           "error_kind", "unbatch"]

# Bump when any message's fields, their meaning, or the flow above changes. Peers with another version are
# refused at the handshake; Envelope and Reject keep their shape across versions so the refusal is readable.
# 2: Welcome names prefill's process; Abort after a reconnect asks for settlement.
# 3: Hello and Welcome state the transfer mode (push or pull) and peer_timeout, Hello names decode's
#    process; Ready (pull mode).
# 4: Batch (several messages in one ZMQ frame).
# 5: a write's NIXL notification may be a Batch of Chunks (one write for several requests).
# 6: Announce names the leading pages of the request decode already holds (its prefix cache), per pool;
#    prefill's chunk positions are positions in the whole request and skip them. Cancel (decode will not
#    announce a request: prefill fails it at once instead of at its deadline; prefill failed one no decode
#    announced: every decode peer records it FAILED at once instead of learning at its announce).
# 7: Announce carries decode's token binding (integrity.binding: per-block entries and decode's name for the
#    request), which prefill compares with its own before any byte moves: a hand-off of another prompt's KV
#    is refused on both sides (Fail kind "binding"). Fail kind "unknown": an announce for an id prefill never
#    issued (EndpointOptions.refuse_unissued). A v6 peer would ignore the binding, so the version changes.
# 8: Heartbeat carries a probe number (prefill -> decode) and its echo (decode -> prefill). A prefill whose
#    own frames paused past peer_timeout (a stall, or a starved progress thread) no longer ends its sessions
#    blind: it defers every post for the session and asks; decode echoes on a link it still holds, and the
#    echo (read after every message decode sent before it: one connection is ordered) lets the posts go on.
#    A v7 decode would ignore the probe and every stalled session would end a peer_timeout later than
#    before, so the version changes.
# 9: a pool's tokens_per_page may differ between the two sides (equal TP sizes, every token's bytes alike):
#    a chunk's positions stay prefill's page positions in the whole request and land by token in decode's
#    leased pages past its prefix (plan.tokens); its digests cover entry ranges of decode's pages (digests
#    version 2); a Ready's offset for such a session is its first source page's position in the request.
PROTOCOL_VERSION = 9

# Caps on untrusted input, far above real use and far below what exhausts memory.
MAX_ID_LEN = 256
MAX_REASON_LEN = 4096
MAX_BLOB = 48 << 20          # manifests and transport metadata of the largest layouts fit easily
MAX_POOLS = 1024
MAX_PAGES_BYTES = 8 << 20    # one million int64 pages per pool per request
MAX_BATCH = 256              # messages in one Batch (a receiver refuses more)
MAX_PROBE = (1 << 63) - 1    # a probe number (an int64 on the wire)
BATCH_BYTES = 1 << 20        # a sender's budget per Batch; a larger message goes alone

Id = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_ID_LEN)]
Reason = Annotated[str, msgspec.Meta(max_length=MAX_REASON_LEN)]
Blob = Annotated[bytes, msgspec.Meta(max_length=MAX_BLOB)]
Nonce = Annotated[bytes, msgspec.Meta(min_length=16, max_length=64)]
Mac = Annotated[bytes, msgspec.Meta(max_length=64)]
Gen = Annotated[int, msgspec.Meta(ge=0, le=(1 << 63) - 1)]
Seconds = Annotated[float, msgspec.Meta(gt=0, le=3600)]
Mode = Annotated[str, msgspec.Meta(max_length=16)]
Timeout = Annotated[float, msgspec.Meta(gt=0, le=1e9)]   # any EndpointOptions.peer_timeout
PageBytes = Annotated[bytes, msgspec.Meta(max_length=MAX_PAGES_BYTES)]
Pages = Annotated[dict[Annotated[str, msgspec.Meta(max_length=256)], PageBytes], msgspec.Meta(max_length=MAX_POOLS)]
BindingBlocks = Annotated[list[Annotated[bytes, msgspec.Meta(min_length=1, max_length=MAX_ENTRY_BYTES)]],
                         msgspec.Meta(max_length=MAX_BINDING_BLOCKS)]
PrefixPages = Annotated[dict[Annotated[str, msgspec.Meta(max_length=256)],
                             Annotated[int, msgspec.Meta(ge=0, le=1 << 40)]], msgspec.Meta(max_length=MAX_POOLS)]


class _Msg(msgspec.Struct, array_like=True, forbid_unknown_fields=True, frozen=True):
    pass


class Envelope(_Msg):
    """Stable across versions: ``[version, kind, body]``."""

    version: int
    kind: str
    body: msgspec.Raw


class Hello(_Msg):
    session: Id                 # fresh per decode connection: a restarted decode is a new session
    manifest: Blob              # KVMemory.manifest() of decode's memory
    transport: Id               # transport name ("nixl", "local"); both sides must use the same
    transport_meta: Blob        # Transport.register() output
    nonce: Nonce
    digest_mode: Id             # the strongest digest mode wins between the two sides
    heartbeat_interval: Seconds
    mode: Mode = "push"         # the transfer mode decode asks for; prefill refuses one it does not accept
    peer_timeout: Timeout = 5.0  # decode's: in pull mode prefill holds a dead session's sources for longer
    # Decode's process (liveness.ProcessIdentity): in pull mode prefill releases a dead session's source
    # pages at once when this process is certainly gone. Defaults mean "not reported".
    host: Annotated[str, msgspec.Meta(max_length=512)] = ""
    pid: Annotated[int, msgspec.Meta(ge=0, le=(1 << 31) - 1)] = 0
    started: Annotated[int, msgspec.Meta(ge=0, le=(1 << 63) - 1)] = 0


class Challenge(_Msg):
    nonce: Nonce


class Auth(_Msg):
    mac: Mac


class Welcome(_Msg):
    session: Id
    manifest: Blob
    transport_meta: Blob
    proof: Mac                  # empty without a secret; else HMAC proving prefill knows it too
    heartbeat_interval: Seconds
    digest_mode: Id
    # Prefill's process (liveness.ProcessIdentity): decode ends a quarantine early only when this process is
    # certainly gone. Defaults mean "not reported": only an acknowledgement ends the quarantine then.
    host: Annotated[str, msgspec.Meta(max_length=512)] = ""
    pid: Annotated[int, msgspec.Meta(ge=0, le=(1 << 31) - 1)] = 0
    started: Annotated[int, msgspec.Meta(ge=0, le=(1 << 63) - 1)] = 0
    mode: Mode = "push"          # the mode agreed: decode refuses a Welcome naming another than it asked
    peer_timeout: Timeout = 5.0  # prefill's: decode's pull-mode fence uses the shorter of the two


class Reject(_Msg):
    """Stable across versions (one string field), so any version can read why it was refused."""

    reason: Reason


class Announce(_Msg):
    request_id: Id
    generation: Gen
    pages: Pages                # pool -> little-endian int64 destination pages (the lease)
    # pool -> leading pages of the request decode already holds (prefix cache): the leased pages are those
    # after them, and prefill skips chunk positions before them. Absent pools: none held.
    prefix: PrefixPages = msgspec.field(default_factory=dict)
    # Decode's token binding (integrity.binding): per-block entries, empty when decode states none, and
    # decode's own name for the request. Prefill refuses the announce when its own binding differs.
    binding: BindingBlocks = msgspec.field(default_factory=list)
    binding_label: Annotated[str, msgspec.Meta(max_length=MAX_ID_LEN)] = ""


class Ack(_Msg):
    request_id: Id
    generation: Gen


class Abort(_Msg):
    request_id: Id
    generation: Gen
    reason: Reason


class Cancel(_Msg):
    """D -> P: decode will never announce ``request_id`` (it failed the request before leasing pages):
    prefill fails its record now, or remembers the failure for a ``send`` still to come. P -> D (to every
    decode peer): prefill failed ``request_id`` before any decode announced it; a decode that has not
    announced it records it FAILED, so its engine stops waiting now (an announce that crossed this message
    is refused by prefill as before). Nothing was leased, so nothing needs settling."""

    request_id: Id
    reason: Reason


class Fail(_Msg):
    """The sender failed the request; ``settled``: it has no write to decode's pages that can still land."""

    request_id: Id
    generation: Gen
    reason: Reason
    error: Id                   # one of ERROR_KINDS: which exception the waiter's failure carries
    settled: bool


class Result(_Msg):
    """Decode's verdict after the last chunk: prefill reports DONE only on ``ok``."""

    request_id: Id
    generation: Gen
    ok: bool
    reason: Reason


class _ChunkHead(_Msg):
    """The fields a chunk is named by, first in both a pushed chunk's Chunk and a pulled chunk's Ready."""

    request_id: Id
    generation: Gen
    chunk: Annotated[int, msgspec.Meta(ge=0, lt=1 << 20)]
    last: bool
    num_chunks: Annotated[int, msgspec.Meta(ge=0, le=1 << 20)]   # total, meaningful on the last chunk


class Chunk(_ChunkHead):
    """Sent as the NIXL notification of a chunk's write: it arrives only after the chunk's bytes."""

    digests: Blob


class Ready(_ChunkHead):
    """Pull mode, prefill -> decode: a chunk's source pages are ready to be read. ``pages`` are prefill's
    source pages per pool, read into decode's leased pages from ``offsets[pool]`` on (between page sizes:
    ``offsets[pool]`` is the first source page's position in the whole request, read by token); ``buffers`` names
    the buffers the chunk covers (empty: all). Prefill holds these pages until decode's Result or Abort for
    the generation, or until a while after the session died (docs/fencing.md)."""

    pages: Pages
    offsets: Annotated[dict[Annotated[str, msgspec.Meta(max_length=256)], Annotated[int, msgspec.Meta(ge=0)]],
                       msgspec.Meta(max_length=MAX_POOLS)]
    buffers: Annotated[list[Annotated[str, msgspec.Meta(max_length=256)]], msgspec.Meta(max_length=1 << 16)]
    digests: Blob


class Heartbeat(_Msg):
    """Liveness. ``probe`` (prefill, after its own stall): "do you still hold this session?"; decode answers
    with ``echo`` set to the same number on a link it still holds (docs/protocol.md, "Slow is not dead")."""

    probe: Annotated[int, msgspec.Meta(ge=0, le=MAX_PROBE)] = 0
    echo: Annotated[int, msgspec.Meta(ge=0, le=MAX_PROBE)] = 0


class Batch(_Msg):
    """Several messages for one peer in one frame, each its own envelope bytes (see "Batching" above)."""

    messages: Annotated[list[Blob], msgspec.Meta(min_length=1, max_length=MAX_BATCH)]


class Bye(_Msg):
    reason: Reason


KINDS: dict[str, type[_Msg]] = {
    "hello": Hello, "challenge": Challenge, "auth": Auth, "welcome": Welcome, "reject": Reject,
    "announce": Announce, "ack": Ack, "abort": Abort, "cancel": Cancel, "fail": Fail, "result": Result, "chunk": Chunk,
    "ready": Ready,
    "heartbeat": Heartbeat, "bye": Bye, "batch": Batch,
}
_KIND_OF = {cls: kind for kind, cls in KINDS.items()}
_ENCODER = msgspec.msgpack.Encoder()


def encode(msg: _Msg, *, version: int = PROTOCOL_VERSION) -> bytes:
    """One message as envelope bytes."""
    return _ENCODER.encode(Envelope(version, _KIND_OF[type(msg)], msgspec.Raw(_ENCODER.encode(msg))))


def decode(data: bytes | memoryview) -> _Msg:
    """Envelope first, then body. Raises ``ProtocolError``; a version mismatch names both versions.

    A ``Reject`` of any version is decoded, so a peer can always say why it refused us.
    """
    env = decode_struct(data, Envelope, what="envelope", error=ProtocolError)
    body_type = KINDS.get(env.kind)
    if body_type is None:
        raise ProtocolError(f"unknown message kind {env.kind[:64]!r}")
    if env.kind != "reject":
        check_version(env.version, PROTOCOL_VERSION, what="protocol", error=ProtocolError)
    what = f"{env.kind!r} message"
    if body_type is Batch:
        what += f" (at most MAX_BATCH={MAX_BATCH} messages of at most {MAX_BLOB} bytes each)"
    return decode_struct(env.body, body_type, what=what, error=ProtocolError)


def unbatch(batch: Batch) -> list[_Msg | ProtocolError]:
    """A ``Batch``'s messages in order, each as ``decode`` reads it; a bad one is its ``ProtocolError`` in its
    place (the caller drops and counts it, and handles the others). A Batch inside a Batch is such an error."""
    out: list[_Msg | ProtocolError] = []
    for item in batch.messages:
        try:
            inner = decode(item)
            if isinstance(inner, Batch):
                raise ProtocolError("a Batch inside a Batch")
            out.append(inner)
        except ProtocolError as exc:
            out.append(exc)
    return out


def batches(messages: list[bytes]) -> list[bytes]:
    """Encoded messages for one peer as the frames to send, in order: one message alone, several as
    ``Batch`` frames of at most ``MAX_BATCH`` messages and about ``BATCH_BYTES``; a message larger than
    that (a manifest) goes alone, between batches."""
    if len(messages) == 1:
        return messages
    frames: list[bytes] = []
    group: list[bytes] = []
    size = 0
    for data in messages:
        if len(data) > BATCH_BYTES // 2 or len(group) == MAX_BATCH or size + len(data) > BATCH_BYTES:
            frames.extend(_frame(group))
            group, size = [], 0
        if len(data) > BATCH_BYTES // 2:
            frames.append(data)
            continue
        group.append(data)
        size += len(data)
    frames.extend(_frame(group))
    return frames


def _frame(group: list[bytes]) -> list[bytes]:
    if len(group) < 2:
        return group
    return [batch_frame(group)]


def batch_frame(messages: list[bytes]) -> bytes:
    """Encoded messages (2 to ``MAX_BATCH``) as one ``Batch`` frame: ``batches`` when the caller has already
    sized the group (the notification of one write carrying several chunks)."""
    return _ENCODER.encode(Envelope(PROTOCOL_VERSION, "batch", msgspec.Raw(_ENCODER.encode(Batch(messages)))))


def encode_pages(pages: dict[str, np.ndarray]) -> dict[str, bytes]:
    return {pool: np.ascontiguousarray(arr, dtype="<i8").tobytes() for pool, arr in pages.items()}


def decode_pages(pages: dict[str, bytes]) -> dict[str, np.ndarray]:
    """Page lists from the wire as int64 arrays; ``ProtocolError`` when a list is not whole int64s."""
    out: dict[str, np.ndarray] = {}
    for pool, raw in pages.items():
        if len(raw) % 8:
            raise ProtocolError(f"pool {pool!r}: page list of {len(raw)} bytes is not a whole number of int64")
        out[pool] = np.frombuffer(raw, dtype="<i8").astype(np.int64)
    return out


# Which exception a request failure carries across the wire; anything else travels as "error".
# Subclasses come before their bases: ``error_kind`` takes the first match.
ERROR_KINDS: dict[str, type[KVFerryError]] = {
    "binding": BindingMismatch, "unknown": UnknownRequest,
    "peer_lost": PeerLost, "timeout": TransferTimeout, "transport": TransportError,
    "integrity": IntegrityError, "lease": LeaseError, "plan": PlanError, "aborted": RequestAborted,
    "error": KVFerryError,
}


def announced_binding(msg: Announce) -> Binding | None:
    """Decode's binding as the announce carried it; None when decode stated none."""
    if not msg.binding:
        return None
    return Binding(tuple(msg.binding), msg.binding_label)


def binding_fields(binding: Binding | None) -> tuple[list[bytes], str]:
    """``Announce``'s ``binding`` and ``binding_label`` for ``binding`` (None: unbound)."""
    if binding is None:
        return [], ""
    return list(binding.blocks), binding.label


def error_kind(exc: BaseException) -> str:
    """The wire name of ``exc``'s most specific known class."""
    for name, cls in ERROR_KINDS.items():
        if isinstance(exc, cls):
            return name
    return "error"


def error_from_wire(kind: str, reason: str, peer: str) -> KVFerryError:
    """The exception a failure reported by ``peer`` is raised as on this side."""
    return ERROR_KINDS.get(kind, KVFerryError)(f"{peer}: {reason}")
