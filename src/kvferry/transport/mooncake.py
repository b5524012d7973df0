"""Mooncake transport: Mooncake's Transfer Engine moves plan rows between processes or hosts.

Part of the transport layer, above ``base``, beside ``nixl`` and ``local``. ``mooncake`` is imported at the
first ``register`` call, never at module import (``pip install 'kvferry[mooncake]'``: the
``mooncake-transfer-engine-non-cuda`` wheel on CPU hosts; the CUDA builds keep the same Python API). The wheel
needs the system's ``libibverbs1``, ``librdmacm1`` and ``libnuma1`` to import, even for TCP.

How the contract maps onto the engine (``mooncake.engine.TransferEngine``, 0.3.13):

* **Meeting a peer.** Each transport owns one engine, initialised with ``P2PHANDSHAKE``: no etcd, no
  metadata server; peers address each other as ``host:rpc_port`` and the engines exchange segment
  descriptors on the first transfer. ``register`` returns that session name, the manifest (what the buffers
  are and where they live) and the address of the notification socket (below).
* **Memory.** Every buffer's region is registered with the engine (overlapping or touching regions merged
  first: the engine refuses overlaps). A write or read is refused with ``TransportError`` before anything is
  posted when any row leaves this side's or the peer's registered regions, the peer's as its manifest
  describes them (``base.check_plan_in_regions``, as for NIXL). The engine checks again on the receiving
  side against what that side registered.
* **Posting.** A plan's rows go to the engine as batches (``batch_transfer_async_write`` for push,
  ``batch_transfer_async_read`` for pull) of at most ``MAX_BATCH_ROWS`` rows: the engine's TCP transport
  queues at most 1024 items per peer (plus 1024 awaiting admission) and fails every task past that
  ("TCP lane queue-full rejection": a 4096-row batch of 4 KiB rows failed here). One request's rows in
  one batch when they fit, which is every planner-built request of a sane size (rows are coalesced page
  runs per buffer).
* **Polling.** The engine's Python API has no non-blocking status for a whole batch:
  ``get_batch_transfer_status`` returns once every task of the batches it is given finished (0) or one
  failed or timed out (-1), spinning meanwhile with the GIL released, and ``transfer_check_status`` looks
  at the first task only. So each peer has one worker thread that submits a request's batches in turn
  and waits for each (one batch in flight per peer, which also keeps its queue bounded), and the handle's
  ``poll`` reads that work's result without blocking. The first transfer to a peer opens the engine's
  segment for it (a handshake with the peer's engine) on that thread too, so ``write`` never blocks on a
  stopped peer. The engine's own limit (``MC_TRANSFER_TIMEOUT``, 30 s unless set; at least 5 s, plus a
  second per GiB) bounds every wait; kvferry's deadlines (``TransferHandle.wait``, the control plane's)
  come first.
* **A failed batch** is reported only once its other rows cannot land any more: the engine's wait returns
  at the first failed row while the rest may still be in flight, so for a peer that is still alive the
  worker waits the engine's own bound on a batch (``MC_TRANSFER_TIMEOUT``, 5 s here) before the handle
  fails; for a peer that is gone (its engine refuses connections) it fails at once. Without this, a
  request whose handle failed could still have bytes landing in pages the control plane had settled
  (seen: rows of a failed write arriving after the test had refilled decode's memory). The batches queued
  behind it for a peer found gone fail at once too, never posted, while its engine still refuses
  connections: the engine would spend up to a second retrying the dead peer on each, one after another,
  while the writer waits for them all.
* **Errors** are translated in one place, ``_translate``: an engine return code (``error.h``) or a failed
  batch becomes ``TransportError``, or ``PeerLost`` when the peer's engine no longer accepts connections.

**Notifications.** NIXL delivers a write's notification after its last byte, through the same agent; the
control plane's completion messages (request id, chunk, digests) ride on it. Mooncake's notify
(``submitTransferWithNotify``) is reachable from Python only through the *synchronous* transfer calls,
which would hold a thread per transfer, and its delivery depends on the transport underneath. So this
transport keeps its own small channel: a ZMQ PULL socket per transport (its address in the metadata) and
a PUSH socket per peer. A write's notification is sent when the engine reports that batch complete (every
byte acknowledged by the peer's engine), from ``poll`` or ``get_notifications`` on the driving thread;
``send_notification`` sends at once. It carries the same bytes NIXL's would, so the control plane (and its
digests, leases and fencing) runs unchanged over either transport. A write released before it completed
never notifies. The price: a notification leaves only when the writer's loop next drives its transport
(the control plane does on every iteration), not from the NIC.

Releasing a batch in flight cannot cancel it (the engine has no cancel); its wait runs to its end, and
``close`` waits for such waits (bounded) before it unregisters memory and drops the engine, so no engine
thread ever touches freed memory from this side. Driven from one thread, like every transport.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import importlib
import itertools
import logging
import os
import socket
import threading
import time
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import msgspec
import zmq

from kvferry.codec import decode_versioned, encode
from kvferry.errors import PeerLost, TransferTimeout, TransportError, UsageError
from kvferry.layout.memory import KVMemory
from kvferry.plan.contract import Plan
from kvferry.transport.base import (
    BackendHandle,
    RowBuffer,
    Transport,
    already_registered,
    check_plan_in_regions,
)

__all__ = ["ENV_DEFAULTS", "PROTOCOLS", "WILDCARDS", "MooncakeHandle", "MooncakeTransport", "check_address"]

PROTOCOLS = ("tcp", "rdma")
# Addresses that bind everywhere but reach nothing: the engine advertises its hostname to its peers.
WILDCARDS = ("0.0.0.0", "::", "")


def check_address(hostname: str, protocol: str, what: str = "") -> None:
    """Refuse a ``protocol`` the engine does not run and a wildcard ``hostname`` (peers are told to reach this
    side there). ``what``: how the caller's user names the two settings (``"mooncake_"``: its config keys)."""
    if protocol not in PROTOCOLS:
        raise UsageError(f"{what}protocol must be one of {PROTOCOLS}, got {protocol!r}")
    if hostname in WILDCARDS:
        raise UsageError(f"{what}host must be an address peers can reach (this host's IP), got the wildcard "
                         f"{hostname!r}")

log = logging.getLogger(__name__)

# Applied with os.environ.setdefault before the engine is first created; a user's own setting always wins.
# MC_LOG_LEVEL=ERROR: the engine logs every connection and batch at INFO to stderr (where a CLI's tables go);
# kvferry's exceptions say what failed. MC_TRANSFER_TIMEOUT: the engine's own bound on one batch (5 s is
# its minimum); kvferry's deadlines are shorter, this only bounds how long a wait thread outlives a
# transfer kvferry already gave up on.
ENV_DEFAULTS: dict[str, str] = {"MC_LOG_LEVEL": "ERROR", "MC_TRANSFER_TIMEOUT": "5"}

# Bump when _Metadata's fields or their meaning change.
METADATA_VERSION = 1
_COUNTER = itertools.count()
MAX_BATCH_ROWS = 1024        # the engine's TCP queue per peer (module docstring)
_CLOSE_WAIT_S = 30.0         # close(): the longest it waits for batches still in flight
_LEAKED: list[Any] = []      # engines kept alive because a wait on them outlived close()

# Mooncake's error.h (transfer engine), for the messages.
_ENGINE_ERRORS = {
    -1: "ERR_INVALID_ARGUMENT", -2: "ERR_TOO_MANY_REQUESTS", -3: "ERR_ADDRESS_NOT_REGISTERED",
    -4: "ERR_BATCH_BUSY", -6: "ERR_DEVICE_NOT_FOUND", -7: "ERR_ADDRESS_OVERLAPPED", -101: "ERR_DNS",
    -102: "ERR_SOCKET", -103: "ERR_MALFORMED_JSON", -104: "ERR_REJECT_HANDSHAKE", -200: "ERR_METADATA",
    -201: "ERR_ENDPOINT", -202: "ERR_CONTEXT", -300: "ERR_NUMA", -301: "ERR_CLOCK", -302: "ERR_MEMORY",
    -303: "ERR_NOT_IMPLEMENTED",
}


class _Metadata(msgspec.Struct, forbid_unknown_fields=True):
    version: int
    agent: str
    session: str      # the engine's "host:rpc_port" (P2PHANDSHAKE)
    notify: str       # ZMQ address of this transport's notification socket
    manifest: bytes   # KVMemory.manifest(): what the buffers are and where they live


def _load_engine_module() -> ModuleType:
    for key, value in ENV_DEFAULTS.items():
        os.environ.setdefault(key, value)
    try:
        return importlib.import_module("mooncake.engine")
    except ImportError as exc:
        raise TransportError(
            f"the Mooncake transport needs Mooncake's Transfer Engine (pip install 'kvferry[mooncake]', and the "
            f"system's libibverbs1, librdmacm1 and libnuma1: scripts/setup.sh installs them): {exc}") from exc


# -- error translation: the one place the engine's failures become kvferry's ----------------------------
def _translate(code: int, what: str, peer: str, session: str = "") -> TransportError:
    """An engine result (a negative return code, or -1 from a batch's wait) as a kvferry exception."""
    if session and not _reachable(session):
        return PeerLost(f"{what}: peer {peer!r} is gone (its Mooncake engine at {session} refuses connections)")
    name = _ENGINE_ERRORS.get(code, f"code {code}")
    return TransportError(f"{what}: Mooncake failed ({name}) with peer {peer!r}")


def _reachable(session: str) -> bool:
    host, _, port = session.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=0.5):
            return True
    except (OSError, ValueError):
        return False


# -- handle --------------------------------------------------------------------------------------------
class MooncakeHandle(BackendHandle):
    """One posted batch. ``poll`` reads its wait's result; see ``TransferHandle``. A batch in flight cannot
    be cancelled: ``release`` frees nothing, and the transport's ``close`` waits for every batch's wait."""

    def __init__(self, transport: MooncakeTransport, wait: concurrent.futures.Future[tuple[int, str]] | None,
                 peer: str, label: str, notif: bytes | None, what: str) -> None:
        super().__init__(transport, peer, label, done=wait is None)
        self._transport: MooncakeTransport = transport
        self._wait = wait            # None: an empty plan, done at once
        self._notif = notif          # sent to the peer once the batch completed (writes only)
        self._what = what

    def _describe(self) -> str:
        return self._what

    def _progress(self) -> bool:
        assert self._wait is not None
        if not self._wait.done():
            return False
        return self._settle()

    def wait(self, timeout: float) -> None:
        """Block on the batch's work itself (no polling interval added to a transfer of a few ms)."""
        if self._wait is not None and not self._done and self._error is None and not self._released:
            try:
                self._wait.result(timeout)
            except concurrent.futures.TimeoutError:
                raise TransferTimeout(f"{self._what} to peer {self.peer!r} not done after {timeout:.3f} s") from None
            except Exception:
                pass   # the work raised: _settle turns it into the handle's error
        if not self.poll():   # released meanwhile, or no work: the base class's loop says why
            super().wait(timeout)

    def _settle(self) -> bool:
        assert self._wait is not None
        try:
            code, detail = self._wait.result()
        except Exception as exc:   # the binding raised on the peer's worker thread
            code, detail = -1, f"the engine raised {exc!r}"
        if code != 0:
            self._error = _translate(code, f"{self._what} ({detail})", self.peer,
                                     self._transport._session_of(self.peer))
            raise self._error
        self._done = True
        if self._notif is not None:
            self._transport._notify(self.peer, self._notif, self._what)
            self._notif = None
        return True


# -- transport -----------------------------------------------------------------------------------------
@dataclass(eq=False)
class _Peer:
    name: str
    memory: KVMemory      # from the peer's manifest: addresses only
    session: str          # its engine's "host:rpc_port"
    push: Any             # zmq PUSH socket to its notification socket
    worker: concurrent.futures.ThreadPoolExecutor   # one thread: this peer's batches, in turn
    # Set (by the worker, the only one to read it) once a batch failed and the peer's engine refused
    # connections: later batches are posted only once it accepts them again (``_run_batches``).
    gone: bool = False


class MooncakeTransport(Transport):
    """``Transport`` over Mooncake's Transfer Engine (``P2PHANDSHAKE``, no metadata server).

    ``hostname``: the address peers reach this side's engine and notification socket at (loopback by
    default); ``protocol``: the engine's transport (``"tcp"``, or ``"rdma"`` with ``device`` naming the NICs,
    empty for all). Driven from one thread; ``register`` comes first (it creates the engine).
    """

    name = "mooncake"

    def __init__(self, agent_name: str | None = None, *, hostname: str = "127.0.0.1", protocol: str = "tcp",
                 device: str = "") -> None:
        check_address(hostname, protocol)
        self._name = agent_name or f"kvferry-mc-{socket.gethostname()}-{os.getpid()}-{next(_COUNTER)}"
        self._hostname = hostname
        self._protocol = protocol
        self._device = device
        self._engine: Any = None
        self._session = ""
        self._memory: KVMemory | None = None
        self._registered: list[int] = []
        self._metadata = b""
        self._peers: dict[str, _Peer] = {}
        self._handles: set[MooncakeHandle] = set()
        self._pending: set[concurrent.futures.Future[tuple[int, str]]] = set()
        self._workers: list[concurrent.futures.ThreadPoolExecutor] = []
        self._zmq: Any = None
        self._pull: Any = None
        self._rows = RowBuffer()
        self._closed = False
        self._lock = threading.Lock()   # guards _pending (wait threads remove themselves)

    @property
    def agent_name(self) -> str:
        return self._name

    @property
    def engine(self) -> Any:
        """The underlying ``TransferEngine`` (None before ``register``), for baselines that post raw batches
        beside kvferry's. Batches posted on it bypass kvferry's checks."""
        return self._engine

    # -- setup ---------------------------------------------------------------------------------------------
    def register(self, memory: KVMemory) -> bytes:
        """Create the engine, register ``memory``'s regions and return metadata for peers. Once per side."""
        self._check_open()
        if already_registered(self._name, self._memory, memory):
            return self._metadata
        kinds = {r.device for r in memory.regions}
        if len(kinds) > 1:
            raise TransportError(f"memory mixes {sorted(kinds)} regions; register one kind per side")
        api = _load_engine_module()
        engine = api.TransferEngine()
        code = engine.initialize(self._hostname, "P2PHANDSHAKE", self._protocol, self._device)
        if code != 0:
            raise _translate(code, f"initialising the Mooncake engine on {self._hostname} ({self._protocol})", "-")
        self._engine = engine
        self._session = f"{self._hostname}:{engine.get_rpc_port()}"
        location = "*"
        if kinds == {"cuda"}:
            location = f"cuda:{memory.regions[0].device_id}"
        for start, size in _merged(memory):
            code = engine.register_memory(start, size, location)
            if code != 0:
                raise _translate(code, f"registering {size} bytes at {start:#x}", "-")
            self._registered.append(start)
        self._zmq = zmq.Context.instance()
        self._pull = self._zmq.socket(zmq.PULL)
        self._pull.setsockopt(zmq.LINGER, 0)
        port = self._pull.bind_to_random_port(f"tcp://{self._hostname}")
        self._memory = memory
        self._metadata = encode(_Metadata(METADATA_VERSION, self._name, self._session,
                                          f"tcp://{self._hostname}:{port}", memory.manifest()))
        return self._metadata

    def add_peer(self, metadata: bytes) -> str:
        """Learn a peer from its metadata (replacing any earlier copy)."""
        self._check_open()
        if self._engine is None:
            raise TransportError("register memory before adding peers (register creates the Mooncake engine)")
        meta = decode_versioned(metadata, _Metadata, version=METADATA_VERSION, what="Mooncake peer metadata",
                                error=TransportError)
        remote = KVMemory.from_manifest(meta.manifest)
        if meta.agent in self._peers:
            self.remove_peer(meta.agent)
        push = self._zmq.socket(zmq.PUSH)
        push.setsockopt(zmq.LINGER, 0)
        push.setsockopt(zmq.SNDHWM, 0)
        push.connect(meta.notify)
        worker = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"mooncake-{meta.agent}")
        self._workers.append(worker)
        self._peers[meta.agent] = _Peer(meta.agent, remote, meta.session, push, worker)
        return meta.agent

    def remove_peer(self, peer: str) -> None:
        """Forget ``peer`` and close its notification socket. Unknown peers are ignored. Its batches in flight
        run to their end on its worker (``close`` waits for them)."""
        state = self._peers.pop(peer, None)
        if state is not None:
            state.push.close(0)
            state.worker.shutdown(wait=False)

    # -- data path -----------------------------------------------------------------------------------------
    def write(self, plan: Plan, peer: str, notif: bytes, label: str = "") -> MooncakeHandle:
        """Post ``plan`` as one batch write into ``peer``; ``notif`` follows its completion (module docstring)."""
        state = self._peer(peer)
        self._check_memories(plan.src_memory, plan.dst_memory, state, label, "write")
        check_plan_in_regions(plan, self._memory, state.memory, state.name, label)  # type: ignore[arg-type]
        what = f"write {label or bytes(notif)[:32]!r}"
        if plan.num_descriptors == 0:
            self._notify(peer, bytes(notif), what)   # nothing to move; the peer still hears "done"
            return self._track(MooncakeHandle(self, None, peer, label, None, what))
        src, dst = self._rows.rows(plan)
        return self._post(state, src, dst, label, bytes(notif), what, read=False)

    def read(self, plan: Plan, peer: str, label: str = "") -> MooncakeHandle:
        """Post ``plan`` as one batch read from ``peer`` into this side's memory; see ``Transport.read``."""
        state = self._peer(peer)
        self._check_memories(plan.dst_memory, plan.src_memory, state, label, "read")
        check_plan_in_regions(plan, state.memory, self._memory, state.name, label)  # type: ignore[arg-type]
        what = f"read {label!r}"
        if plan.num_descriptors == 0:
            return self._track(MooncakeHandle(self, None, peer, label, None, what))
        src, dst = self._rows.rows(plan)
        return self._post(state, dst, src, label, None, what, read=True)

    def _post(self, state: _Peer, local: Any, remote: Any, label: str, notif: bytes | None, what: str, *,
              read: bool) -> MooncakeHandle:
        # Python lists copied now: the reused row buffer is free again on return.
        local_addrs, remote_addrs, lengths = local[:, 0].tolist(), remote[:, 0].tolist(), local[:, 1].tolist()
        work = state.worker.submit(_run_batches, self._engine, state, read, local_addrs, remote_addrs, lengths)
        with self._lock:
            self._pending.add(work)
        work.add_done_callback(self._forget)
        return self._track(MooncakeHandle(self, work, state.name, label, notif, what))

    def _forget(self, work: concurrent.futures.Future[tuple[int, str]]) -> None:
        with self._lock:
            self._pending.discard(work)

    # -- notifications -------------------------------------------------------------------------------------
    def _notify(self, peer: str, message: bytes, what: str) -> None:
        state = self._peers.get(peer)
        if state is None:
            raise TransportError(f"{what}: peer {peer!r} was removed before its notification could be sent")
        try:
            state.push.send_multipart([self._name.encode(), message], zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            raise TransportError(f"{what}: sending the notification to peer {peer!r} failed: {exc}") from exc

    def send_notification(self, peer: str, message: bytes) -> None:
        self._peer(peer)
        self._notify(peer, bytes(message), f"notification {bytes(message)[:32]!r}")

    def get_notifications(self) -> list[tuple[str, bytes]]:
        """Drain received notifications as (peer, message); first sends those of writes that completed."""
        if self._pull is None or self._closed:
            return []
        for handle in [h for h in self._handles if h._notif is not None and h._wait is not None and h._wait.done()]:
            with contextlib.suppress(TransportError):   # the handle keeps its error for its owner's poll
                handle.poll()
        out: list[tuple[str, bytes]] = []
        while True:
            try:
                sender, message = self._pull.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return out
            except ValueError:   # not two frames: not from a kvferry transport
                continue
            out.append((sender.decode(errors="replace"), message))

    # -- teardown ------------------------------------------------------------------------------------------
    def close(self) -> None:
        """Wait (bounded) for batches in flight, then unregister memory, drop the engine and sockets."""
        if self._closed:
            return
        self._closed = True
        self._handles.clear()
        with self._lock:
            pending = set(self._pending)
        _, still = concurrent.futures.wait(pending, timeout=_CLOSE_WAIT_S)
        for state in list(self._peers.values()):
            state.push.close(0)
        self._peers.clear()
        for worker in self._workers:
            worker.shutdown(wait=False)
        if self._pull is not None:
            self._pull.close(0)
            self._pull = None
        if self._engine is None:
            return
        if still:
            # An engine thread may still write into this memory: neither unregister it nor free the engine.
            log.warning("closing Mooncake transport %r: %d batches still in flight after %.0f s; its engine is "
                        "kept alive", self._name, len(still), _CLOSE_WAIT_S)
            _LEAKED.append(self._engine)
        else:
            for start in self._registered:
                code = self._engine.unregister_memory(start)
                if code != 0:
                    log.warning("closing Mooncake transport %r: %s", self._name,
                                _translate(code, f"unregistering {start:#x}", "-"))
        self._registered.clear()
        self._engine = None

    # -- checks ----------------------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise TransportError(f"transport {self._name!r} is closed")

    def _peer(self, peer: str) -> _Peer:
        self._check_open()
        state = self._peers.get(peer)
        if state is None:
            raise TransportError(f"unknown peer {peer!r} (add_peer first; known: {sorted(self._peers)})")
        return state

    def _session_of(self, peer: str) -> str:
        state = self._peers.get(peer)
        return state.session if state is not None else ""

    def _check_memories(self, local: KVMemory, remote: KVMemory, state: _Peer, label: str, op: str) -> None:
        if self._memory is None:
            raise TransportError(f"register memory before {'writing' if op == 'write' else 'reading'}")
        here, there = ("source", "destination") if op == "write" else ("destination", "source")
        if not _same_binding(local, self._memory):
            raise TransportError(f"{op} {label!r}: the plan's {here} is not this transport's memory")
        if not _same_binding(remote, state.memory):
            raise TransportError(f"{op} {label!r}: the plan's {there} is not peer {state.name!r}'s memory as "
                                 f"its metadata describes it (stale manifest?)")

    def _track(self, handle: MooncakeHandle) -> MooncakeHandle:
        self._handles.add(handle)
        return handle

    def __repr__(self) -> str:
        return (f"MooncakeTransport({self._name!r}, {self._protocol}, session={self._session!r}, "
                f"peers={sorted(self._peers)}, closed={self._closed})")


def _run_batches(engine: Any, peer: _Peer, read: bool, local: list[int], remote: list[int],
                 lengths: list[int]) -> tuple[int, str]:
    """On the peer's worker thread: submit the rows in batches of ``MAX_BATCH_ROWS``, each after the last
    completed. (0, "") when every byte landed; else the engine's result and which batch failed."""
    session = peer.session
    n = len(lengths)
    if peer.gone:
        # An earlier batch found the peer's engine refusing connections. Posted, this one would only have
        # the engine retry the dead peer (up to about a second per batch over TCP, 0.3.13) while the writer
        # waits for each in turn: a decode killed with a few writes queued kept prefill busy for seconds.
        # Asked again (a refused connect answers at once), so that a peer back from a passing outage is
        # written to again rather than failed for good. Nothing of it was posted: nothing of it can land.
        if not _reachable(session):
            return -1, f"rows 0..{n - 1} of {n} not posted: the peer's engine refuses connections"
        peer.gone = False
    post = engine.batch_transfer_async_read if read else engine.batch_transfer_async_write
    for start in range(0, n, MAX_BATCH_ROWS):
        end = min(n, start + MAX_BATCH_ROWS)
        batch = post(session, local[start:end], remote[start:end], lengths[start:end])
        if batch in (0, (1 << 64) - 1, -1):   # 0: refused; all ones: -1 through the uint64 batch id
            return -1, f"the engine refused rows {start}..{end - 1} of {n}"
        code = int(engine.get_batch_transfer_status([batch]))
        if code != 0:
            # The wait returns at the first failed row; the batch's other rows may still be landing. Report
            # the failure only once they cannot: a live peer gets the engine's own bound on a batch (a dead
            # one's memory is gone with it), so no byte of this request lands after its handle failed.
            peer.gone = not _reachable(session)
            drain = 0.0 if peer.gone else _drain_seconds()
            time.sleep(drain)
            return code, f"rows {start}..{end - 1} of {n} failed; reported after {drain:g} s for the rest to settle"
    return 0, ""


def _drain_seconds() -> float:
    try:
        return max(5.0, float(os.environ.get("MC_TRANSFER_TIMEOUT", "30")))   # the engine's minimum is 5 s
    except ValueError:
        return 30.0


def _same_binding(a: KVMemory, b: KVMemory) -> bool:
    return a is b or a.binding_fingerprint == b.binding_fingerprint


def _merged(memory: KVMemory) -> list[tuple[int, int]]:
    """The regions as disjoint (start, size) ranges, overlapping or touching ones merged: buffers that are
    views of one tensor share bytes, and the engine refuses overlapping registrations."""
    spans = sorted((r.address, r.address + r.nbytes) for r in memory.regions if r.nbytes > 0)
    out: list[list[int]] = []
    for start, end in spans:
        if out and start <= out[-1][1]:
            out[-1][1] = max(out[-1][1], end)
        else:
            out.append([start, end])
    return [(s, e - s) for s, e in out]
