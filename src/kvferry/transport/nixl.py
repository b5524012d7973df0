"""NIXL transport: one ``nixl_agent`` with the UCX backend moves plan rows between processes or hosts.

Part of the transport layer, above ``base``, beside ``local``. ``nixl`` is imported at the first ``register``
call, never at module import, and ``torch`` only when the memory registered is CUDA memory.

Choices, measured on a 2-core CPU-only host with nixl 1.5.1 (numbers in ``bench/RESULTS-transport.md``):

* **Progress thread off** (``progress_thread=False``). The wrapper's thread spins a full core per agent;
  with it on, 256 MiB host writes ran at ~6 GB/s instead of ~13 GB/s and 4 KiB notification latency had a
  p90 of ~16 ms instead of ~40 us. The price: the *receiving* side must call ``get_notifications``
  regularly (it drives UCX progress), or the first write to it never completes.
* **UCX is left at its own defaults.** ``UCX_TLS`` unset picks ``cma`` for data and ``tcp`` for wire-up
  between processes on one host, as fast as any explicit list we tried; pinning it would disable RDMA and
  ``cuda_ipc`` on GPU machines. ``UCX_TLS=tcp`` is ~5x slower; lists without ``tcp`` (``shm``, ``cma``)
  make backend creation fail (NIXL asks for peer-failure handling, which only ``tcp`` provides here).
  ``UCX_RNDV_THRESH=inf``, ``UCX_RNDV_SCHEME=put_zcopy``, ``UCX_ZCOPY_THRESH=inf`` and
  ``UCX_CMA_SEG_SIZE`` were each slower; ``UCX_PROTO_ENABLE=n`` breaks backend creation.
* **Environment defaults**, set only when the variable is unset: ``NIXL_LOG_LEVEL=WARN`` (the Python
  wrapper otherwise logs every agent and backend creation at INFO level to *stdout*, where a CLI's
  ``--json`` output goes).
* **Descriptors**: ``descriptors="dlist"`` posts the plan's coalesced rows as a per-request descriptor
  list; ``"prepped"`` indexes per-page lists prepared once per side (``prep_xfer_dlist`` +
  ``make_prepped_xfer`` with ``plan.page_selectors()``); ``"auto"`` (default) picks per plan. The per-page
  lists are prepared from one *strided* row per buffer (NIXL's N x 5 form, ``(address, page_bytes,
  device, page_bytes, pages)``): ~45 us and no per-page state, even for a 3.7M-page pool. Throughput is
  the same either way (NIXL merges adjacent pages into one transfer); what differs is the cost of building
  the handle. ``make_prepped_xfer`` costs ~16 ns per page index where rows cost kvferry ~3 ns to write
  plus NIXL ~80 ns (``get_xfer_descs`` twice and ``initialize_xfer``): for the DeepSeek-V3.2 request of
  ``bench/plan.py`` (512 pages in runs of ~2.5, 183 buffers) 1.5 ms against 3.1 ms. ``"auto"`` posts
  indices for planner-built whole-page plans whose runs average at most ``base.INDEX_MAX_MEAN_RUN`` pages and
  rows for everything else (long runs, TP slices, the fault injector's plans).

Behaviour callers must know:

* On one host (``cma``) the copy runs *inside* ``write`` (the GIL is released); ``write`` returns a handle
  that is usually already done. A deadline therefore bounds the wait for completion and notification,
  not the copy of a large request.
* A write outside the peer's registered regions, as its manifest describes them, is refused with
  ``TransportError`` before anything is posted (``base.check_plan_in_regions``: the planner's plans by
  their page runs, every other plan row by row). NIXL checks bounds too, but only against the metadata
  it holds, which can be stale.
* Per-request cost (issue 13): a planner-built plan's rows are written into one buffer the transport
  reuses (``base.RowBuffer``; NIXL copies them into its own lists), so a write allocates no N x 3 arrays;
  nothing is formatted unless something failed.
* A dead peer surfaces as ``PeerLost`` from ``write``, ``poll`` or ``send_notification``. A connection
  NIXL reports as disconnected stays poisoned, even when the peer is alive (for example after a write
  into memory the peer had unmapped): ``remove_peer`` and ``add_peer`` again with fresh metadata.
"""

from __future__ import annotations

import importlib
import importlib.util
import itertools
import logging
import os
import socket
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, Literal

import msgspec
import numpy as np

from kvferry.codec import decode_versioned, encode
from kvferry.errors import PeerLost, TransportError, UsageError
from kvferry.layout.memory import KVMemory, distinct_regions
from kvferry.plan.contract import Plan
from kvferry.transport.base import (
    BackendHandle,
    RowBuffer,
    Transport,
    already_registered,
    check_plan_in_regions,
    pages_in_regions,
    short_runs,
)

__all__ = ["ENV_DEFAULTS", "NixlHandle", "NixlTransport"]

log = logging.getLogger(__name__)

# Applied with os.environ.setdefault before nixl is first imported; a user's own setting always wins.
#
# UCX_MODULES="^efa": the nixl wheel bundles UCX with its own libibverbs and libnl-route (renamed copies),
# but its EFA module (libuct_ib_efa) links the system's libefa, which pulls the system's libibverbs and
# libnl-route into the same dlopen group. Symbol lookup in that group finds the bundled libnl-route
# first, so the system copy's constructors register its traffic-control ops in the bundled copy's list
# and its destructors unregister them there at exit: SIGSEGV in rtnl_tc_unregister() from _dl_fini, in
# every process that created an agent on a host with Debian's libibverbs1/ibverbs-providers (every
# InfiniBand/RoCE host). UCX reads this variable when libucs loads, i.e. at the first agent, not at
# import. Skipping only the EFA module keeps ib/mlx5/tcp/shm; AWS EFA users who want UCX's EFA transport
# set UCX_MODULES themselves (and meet the crash at exit until the wheel stops mixing the copies).
ENV_DEFAULTS: dict[str, str] = {"NIXL_LOG_LEVEL": "WARN", "UCX_MODULES": "^efa"}

# Bump when _Metadata's fields or their meaning change.
METADATA_VERSION = 1

Descriptors = Literal["auto", "dlist", "prepped"]
# What a write posts (``NixlTransport._check_plan``).
_ROWS, _FAST_INDICES, _PLAN_INDICES = "rows", "fast indices", "plan indices"
# make_prepped_xfer takes int32 indices: lists of more pages than this are never indexed.
_MAX_INDEXED_PAGES = (1 << 31) - 1
_COUNTER = itertools.count()
_MEM_TYPE = {"cpu": "DRAM", "cuda": "VRAM"}


class _Metadata(msgspec.Struct, forbid_unknown_fields=True):
    version: int
    agent: str
    nixl: bytes       # nixl_agent.get_agent_metadata(): connection info and registered regions
    manifest: bytes   # KVMemory.manifest(): what the peer's buffers are and where they live


# -- loading nixl --------------------------------------------------------------------------------------
def _load_nixl(need_cuda: bool) -> ModuleType:
    """Return nixl's ``_api`` module, importing as little as possible.

    ``import nixl`` picks the ``nixl_cuXX`` build matching the CUDA stack and, with a CPU-only torch
    installed, imports torch to find out (~1.1 s and ~200 MiB RSS). For host memory in a process with no
    CUDA library loaded we make the same choice without torch: the CUDA major read from torch's
    ``version.py`` on disk, else the first build installed, in nixl's own order.
    """
    for key, value in ENV_DEFAULTS.items():
        os.environ.setdefault(key, value)
    if "nixl._api" in sys.modules:
        return sys.modules["nixl._api"]
    cuda_loaded = any(m in sys.modules for m in ("torch", "cuda.bindings", "cupy"))
    if need_cuda or cuda_loaded:
        importlib.import_module("nixl")
        return sys.modules["nixl._api"]
    try:
        return importlib.import_module(f"{_backend_package()}._api")
    except ImportError as exc:
        raise TransportError(f"the NIXL transport needs the 'nixl' package (pip install 'kvferry[nixl]'): "
                             f"{exc}") from exc


def _backend_package() -> str:
    major = None
    try:
        from nixl_meta_utils import _torch_cuda_version_from_disk  # private: guarded below

        version = _torch_cuda_version_from_disk()
        major = int(version.split(".")[0]) if version else None
    except (ImportError, AttributeError, ValueError):
        pass
    candidates = [f"nixl_cu{major}"] if major else ["nixl_cu13", "nixl_cu12", "nixl_rocm"]
    for name in candidates:
        if importlib.util.find_spec(name) is not None:
            return name
    raise ImportError(f"none of {candidates} is installed")


# -- error translation: the one place NIXL's exceptions become kvferry's --------------------------------
def _is_backend_error(exc: BaseException) -> bool:
    # The bindings raise one class per status (nixlNotFoundError, nixlRemoteDisconnectError, ...) with no
    # common base; they all live in the bindings module.
    return type(exc).__module__.endswith("._bindings") and type(exc).__name__.startswith("nixl")


def _translate(exc: BaseException | None, status: str, what: str, peer: str) -> TransportError:
    name = type(exc).__name__ if exc is not None else status
    if name == "nixlRemoteDisconnectError":
        return PeerLost(f"{what}: peer {peer!r} disconnected (NIXL_ERR_REMOTE_DISCONNECT); the connection "
                        f"stays unusable until remove_peer and add_peer with fresh metadata")
    if name == "nixlNotFoundError":
        return TransportError(f"{what}: NIXL found no registration or metadata for it on peer {peer!r} "
                              f"(NIXL_ERR_NOT_FOUND): unknown peer, or memory not registered")
    detail = f"{name}: {exc}" if exc is not None else f"status {status}"
    return TransportError(f"{what}: NIXL failed ({detail}) with peer {peer!r}")


def _what(label: str, notif: bytes) -> str:
    return f"write {label or notif[:32]!r}"


@contextmanager
def _nixl_errors(what: str, peer: str) -> Iterator[None]:
    """Run a NIXL call; its backend errors leave as ``TransportError``/``PeerLost`` naming ``what``."""
    try:
        yield
    except Exception as exc:
        if not _is_backend_error(exc):
            raise
        raise _translate(exc, "", what, peer) from exc


# -- handle --------------------------------------------------------------------------------------------
class NixlHandle(BackendHandle):
    """One posted NIXL write. ``poll`` drives this side's progress; see ``TransferHandle``."""

    def __init__(self, transport: NixlTransport, xfer: Any, peer: str, label: str, done: bool) -> None:
        super().__init__(transport, peer, label, done)
        self._transport: NixlTransport = transport
        self._xfer = xfer          # nixl_xfer_handle, or None for an empty plan

    def _progress(self) -> bool:
        status = "ERR"
        try:
            with _nixl_errors(f"write {self.label!r}", self.peer):
                status = self._transport._agent.check_xfer_state(self._xfer)
        except TransportError as exc:
            self._error = exc
            raise
        if status == "ERR":
            self._error = _translate(None, status, f"write {self.label!r}", self.peer)
            raise self._error
        self._done = status == "DONE"
        return self._done

    def _free(self) -> None:
        if self._xfer is None:
            return
        try:
            self._xfer.release()  # cancels a transfer still in flight where UCX can
        except Exception as exc:
            # NIXL keeps a handle it could not cancel and frees it when the agent goes; nothing the
            # caller can do now, and raising from release() (often in a finally) would hide the cause.
            log.warning("write %r to peer %r: NIXL could not release its handle: %s",
                        self.label, self.peer, exc)


# -- transport -----------------------------------------------------------------------------------------
@dataclass(eq=False)
class _Peer:
    name: str
    memory: KVMemory                       # from the peer's manifest: addresses only
    prepped: Any = None                    # nixl_prepped_dlist_handle over memory.page_descs(), lazily
    mem_type: str = field(default="DRAM")
    indexable: bool = False                # its per-page list has int32 indices (< 2**31 pages)


class NixlTransport(Transport):
    """``Transport`` over NIXL/UCX. Host memory registers as DRAM, CUDA memory as VRAM.

    Driven from one thread. ``register`` must come first (it creates the agent); each side registers one
    ``KVMemory`` whose regions are all host or all GPU memory.
    """

    name = "nixl"

    def __init__(self, agent_name: str | None = None, *, descriptors: Descriptors = "auto",
                 progress_thread: bool = False, num_threads: int = 0) -> None:
        if descriptors not in ("auto", "dlist", "prepped"):
            raise UsageError(f"descriptors must be 'auto', 'dlist' or 'prepped', got {descriptors!r}")
        self._name = agent_name or f"kvferry-{socket.gethostname()}-{os.getpid()}-{next(_COUNTER)}"
        self.descriptors: Descriptors = descriptors
        self._progress_thread = progress_thread
        self._num_threads = num_threads
        self._agent: Any = None
        self._memory: KVMemory | None = None
        self._mem_type = "DRAM"
        self._reg_descs: list[Any] = []
        self._local_prepped: Any = None
        self._local_indexable = False
        self._metadata = b""
        self._peers: dict[str, _Peer] = {}
        self._handles: set[NixlHandle] = set()
        self._rows = RowBuffer()
        self._closed = False

    @property
    def agent_name(self) -> str:
        return self._name

    @property
    def agent(self) -> Any:
        """The underlying ``nixl_agent`` (None before ``register``), for baselines and diagnostics that
        post raw NIXL transfers beside kvferry's. Transfers posted on it bypass kvferry's checks."""
        return self._agent

    # -- setup ---------------------------------------------------------------------------------------------
    def register(self, memory: KVMemory) -> bytes:
        """Create the agent, register ``memory``'s regions and return metadata for peers. Once per side."""
        self._check_open()
        if already_registered(self._name, self._memory, memory):
            return self._metadata
        self._mem_type = _memory_type(memory, "local")
        api = _load_nixl(need_cuda=self._mem_type == "VRAM")
        with _nixl_errors(f"creating NIXL agent {self._name!r}", "-"):
            config = api.nixl_agent_config(enable_prog_thread=self._progress_thread,
                                           num_threads=self._num_threads, backends=["UCX"])
            self._agent = api.nixl_agent(self._name, config)
        if "UCX" not in self._agent.backends:
            raise TransportError("NIXL's UCX plugin is not available: cannot move bytes")
        # Aliased buffers (``Pool.aliases``: vLLM's state blocks over its attention blocks) share a region:
        # registered once, their pages' descriptors lie inside it all the same.
        distinct = distinct_regions(memory.regions)
        with _nixl_errors(f"registering {len(distinct)} regions", "-"):
            regs = [(r.address, r.nbytes, r.device_id, "") for r in distinct]
            self._reg_descs.append(self._agent.register_memory(regs, self._mem_type))
            meta = self._agent.get_agent_metadata()
        self._memory = memory
        self._local_indexable = _indexable(memory)
        self._metadata = encode(
            _Metadata(METADATA_VERSION, self._name, bytes(meta), memory.manifest()))
        return self._metadata

    def add_peer(self, metadata: bytes) -> str:
        """Load a peer's metadata (replacing any earlier copy) and start connecting to it."""
        self._check_open()
        if self._agent is None:
            raise TransportError("register memory before adding peers (register creates the NIXL agent)")
        meta = _decode_metadata(metadata)
        remote = KVMemory.from_manifest(meta.manifest)
        if meta.agent in self._peers:
            self.remove_peer(meta.agent)
        with _nixl_errors("loading peer metadata", meta.agent):
            loaded = self._agent.add_remote_agent(meta.nixl)
        loaded = loaded.decode() if isinstance(loaded, bytes) else str(loaded)
        if loaded != meta.agent:
            raise TransportError(f"peer metadata names agent {meta.agent!r} but its NIXL part {loaded!r}")
        self._peers[meta.agent] = _Peer(meta.agent, remote, mem_type=_memory_type(remote, "peer"),
                                        indexable=_indexable(remote))
        return meta.agent

    def remove_peer(self, peer: str) -> None:
        """Forget ``peer``: release its prepared list and drop NIXL's connection to it. Unknown: ignored."""
        state = self._peers.pop(peer, None)
        if state is None or self._agent is None:
            return
        if state.prepped is not None:
            state.prepped.release()
        try:
            with _nixl_errors("removing peer", peer):
                self._agent.remove_remote_agent(peer)
        except TransportError as exc:
            log.warning("%s", exc)  # the peer is forgotten either way

    # -- data path -----------------------------------------------------------------------------------------
    def write(self, plan: Plan, peer: str, notif: bytes, label: str = "") -> NixlHandle:
        """Post ``plan`` as one NIXL WRITE to ``peer`` with ``notif``; see ``Transport.write``.

        Refuses (``TransportError``) before posting when the plan's memories are not this side's and the
        peer's, or any row leaves a registered region. On one host the copy happens inside this call.
        """
        state = self._peer(peer)
        indices = self._check_plan(plan, state, label)
        notif = bytes(notif)
        if plan.num_descriptors == 0:
            self.send_notification(peer, notif)  # nothing to move; the peer still hears "done"
            return self._track(NixlHandle(self, None, peer, label, done=True))
        # Plain try blocks rather than ``_nixl_errors``: this runs per request, and the message is built
        # only when something failed.
        try:
            xfer = self._make_xfer(plan, state, notif, indices)
        except Exception as exc:
            if not _is_backend_error(exc):
                raise
            raise _translate(exc, "", _what(label, notif), peer) from exc
        return self._post(xfer, peer, label, notif)

    def read(self, plan: Plan, peer: str, label: str = "") -> NixlHandle:
        """Post ``plan`` as one NIXL READ from ``peer`` into this side's memory; see ``Transport.read``.

        Refuses (``TransportError``) before posting when the plan's source is not the peer's memory as its
        metadata describes it, its destination not this side's, or any row leaves a registered region. No
        notification is sent: the handle alone says when every byte has landed here.
        """
        state = self._peer(peer)
        indices = self._check_read_plan(plan, state, label)
        if plan.num_descriptors == 0:
            return self._track(NixlHandle(self, None, peer, label, done=True))
        try:
            xfer = self._make_xfer(plan, state, b"", indices, op="READ")
        except Exception as exc:
            if not _is_backend_error(exc):
                raise
            raise _translate(exc, "", f"read {label!r}", peer) from exc
        return self._post(xfer, peer, label, b"", op="read")

    def _post(self, xfer: Any, peer: str, label: str, notif: bytes, op: str = "write") -> NixlHandle:
        # The error text is built only when something failed: this runs per request.
        try:
            status = self._agent.transfer(xfer)
        except Exception as exc:
            xfer.release()
            if not _is_backend_error(exc):
                raise
            raise _translate(exc, "", _what(label, notif) if op == "write" else f"read {label!r}", peer) from exc
        if status == "ERR":
            xfer.release()
            raise _translate(None, status, _what(label, notif) if op == "write" else f"read {label!r}", peer)
        return self._track(NixlHandle(self, xfer, peer, label, done=status == "DONE"))

    def _make_xfer(self, plan: Plan, state: _Peer, notif: bytes, indices: str, op: str = "WRITE") -> Any:
        """A NIXL transfer of ``plan``. WRITE: local source, remote destination; READ: the plan's source
        is the peer's (remote) memory and its destination local, so the two sides' rows swap."""
        agent = self._agent
        if indices is _ROWS:
            # NIXL copies the rows into its own lists, so the reused buffer is free again on return.
            src_rows, dst_rows = self._rows.rows(plan)
            if op == "READ":
                src_rows, dst_rows = dst_rows, src_rows
            local = agent.get_xfer_descs(src_rows, self._mem_type)
            remote = agent.get_xfer_descs(dst_rows, state.mem_type)
            return agent.initialize_xfer(op, local, remote, state.name, notif)
        if indices is _FAST_INDICES:
            # NIXL reads the indices during the call only: the reused buffer is free again on return.
            src_idx, dst_idx = self._rows.selectors(plan)
        else:  # "prepped" forced on a plan the fast check did not vouch for: its own selectors
            src_sel, dst_sel = plan.page_selectors()
            src_idx, dst_idx = src_sel.astype(np.int32), dst_sel.astype(np.int32)
        if op == "READ":
            src_idx, dst_idx = dst_idx, src_idx
        return agent.make_prepped_xfer(op, self._local_list(), src_idx, self._remote_list(state), dst_idx, notif)

    def _lists_ready(self, state: _Peer) -> bool:
        """Both per-page lists prepared (once); False, and rows from then on for this peer, when NIXL
        cannot prepare them (a backend without the strided form for this memory type, say): "auto" then
        behaves as "dlist" rather than failing writes that rows would carry."""
        if state.prepped is not None and self._local_prepped is not None:
            return True
        try:
            self._local_list()
            self._remote_list(state)
        except Exception as exc:
            if not (_is_backend_error(exc) or isinstance(exc, TransportError)):
                raise
            log.warning("peer %r: NIXL could not prepare per-page lists (%s); posting rows instead", state.name, exc)
            state.indexable = False
            return False
        return True

    def _local_list(self) -> Any:
        # One descriptor per page of every local buffer, prepared once: make_prepped_xfer then costs
        # ~0.02 us per page instead of a list built per request.
        if self._local_prepped is None:
            assert self._memory is not None
            with _nixl_errors("preparing the local page list", "-"):
                self._local_prepped = _prep_pages(self._agent, "NIXL_INIT_AGENT", self._memory, self._mem_type)
        return self._local_prepped

    def _remote_list(self, state: _Peer) -> Any:
        if state.prepped is None:
            state.prepped = _prep_pages(self._agent, state.name, state.memory, state.mem_type)
        return state.prepped

    def send_notification(self, peer: str, message: bytes) -> None:
        self._peer(peer)
        with _nixl_errors(f"notification {bytes(message)[:32]!r}", peer):
            self._agent.send_notif(peer, bytes(message))

    def get_notifications(self) -> list[tuple[str, bytes]]:
        """Drain notifications as (peer, message) in arrival order per peer; drives UCX progress."""
        if self._agent is None or self._closed:
            return []
        with _nixl_errors("reading notifications", "*"):
            notifs = self._agent.get_new_notifs()
        return [(_as_str(peer), bytes(msg)) for peer, msgs in notifs.items() for msg in msgs]

    def close(self) -> None:
        """Release handles, prepared lists, peers and registrations; then drop the agent. Idempotent."""
        if self._closed:
            return
        self._closed = True
        for handle in list(self._handles):
            handle.release()
        for peer in list(self._peers):
            self.remove_peer(peer)
        if self._agent is not None:
            self._release_local()
        self._agent = None

    def _release_local(self) -> None:
        try:
            if self._local_prepped is not None:
                self._local_prepped.release()
            for descs in self._reg_descs:
                self._agent.deregister_memory(descs)
        except Exception as exc:
            log.warning("closing NIXL agent %r: %s", self._name, exc)
        self._reg_descs.clear()

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

    def _check_plan(self, plan: Plan, state: _Peer, label: str) -> str:
        """Refuse a plan outside the registered regions; say what to post: ``_ROWS``, ``_FAST_INDICES``
        (int32 page indices written here) or ``_PLAN_INDICES`` (the plan's own ``page_selectors``)."""
        self._check_memories(plan.src_memory, plan.dst_memory, state, label, "write")
        mode = self.descriptors
        if (mode != "dlist" and self._local_indexable and state.indexable
                and (mode == "prepped" or short_runs(plan)) and pages_in_regions(plan, self._memory, state.memory)
                and (mode == "prepped" or self._lists_ready(state))):
            # Every run and page checked against both sides' capacities: each index selects a page of
            # its own buffer, in lists prepared from the registered regions (NIXL refuses an index past
            # a list's end), so the indices are bounds-checked by construction.
            return _FAST_INDICES
        check_plan_in_regions(plan, self._memory, state.memory, state.name, label, selectors=mode == "prepped")
        return _PLAN_INDICES if mode == "prepped" else _ROWS

    def _check_memories(self, local: Any, remote: Any, state: _Peer, label: str, op: str) -> None:
        """The plan's local side must be this transport's memory and its remote side the peer's as its
        metadata describes it (a write's source is local, a read's destination)."""
        if self._memory is None:
            raise TransportError(f"register memory before {'writing' if op == 'write' else 'reading'}")
        here, there = ("source", "destination") if op == "write" else ("destination", "source")
        if not _same_binding(local, self._memory):
            raise TransportError(f"{op} {label!r}: the plan's {here} is not this transport's memory")
        if not _same_binding(remote, state.memory):
            raise TransportError(f"{op} {label!r}: the plan's {there} is not peer {state.name!r}'s memory as "
                                 f"its metadata describes it (stale manifest?)")

    def _check_read_plan(self, plan: Plan, state: _Peer, label: str) -> str:
        """Refuse a read plan outside the registered regions; say what to post (``_ROWS``, or indices into
        the prepared per-page lists: ``_FAST_INDICES`` or the plan's own selectors, ``_PLAN_INDICES``)."""
        self._check_memories(plan.dst_memory, plan.src_memory, state, label, "read")
        mode = self.descriptors
        indexable = self._local_indexable and state.indexable
        # "auto" indexes whole pages only: a cross-TP read (head slices of pages) goes as rows, as its write does
        use_indices = mode == "prepped" or (mode == "auto" and plan.whole_pages and indexable
                                            and self._lists_ready(state))
        # As for a write (_check_plan): pages checked against both sides' capacities make the indices
        # bounds-checked by construction; the source is the peer's memory as its metadata describes it.
        if use_indices and indexable and pages_in_regions(plan, state.memory, self._memory):
            return _FAST_INDICES
        indices = _PLAN_INDICES if use_indices else _ROWS
        # Remote rows against the peer's regions as its metadata describes them, local rows against ours.
        check_plan_in_regions(plan, state.memory, self._memory, state.name, label,
                              selectors=indices is _PLAN_INDICES)
        return indices

    def _track(self, handle: NixlHandle) -> NixlHandle:
        self._handles.add(handle)
        return handle

    def __repr__(self) -> str:
        return (f"NixlTransport({self._name!r}, descriptors={self.descriptors!r}, "
                f"peers={sorted(self._peers)}, closed={self._closed})")


def _decode_metadata(data: bytes) -> _Metadata:
    return decode_versioned(data, _Metadata, version=METADATA_VERSION, what="NIXL peer metadata",
                            error=TransportError)


def _indexable(memory: KVMemory) -> bool:
    return sum(b.num_pages for b in memory.layout.buffers) <= _MAX_INDEXED_PAGES


def _prep_pages(agent: Any, name: str, memory: KVMemory, mem_type: str) -> Any:
    """A prepared list of every page of every buffer of ``memory``, in ``page_descs()`` order.

    Built from NIXL's strided form, one row ``(address, page_bytes, device, page_bytes, pages)`` per
    buffer: NIXL expands it itself (~45 us for 3.7M pages, against a 3.7M-row array built and handed over
    here). NIXL refuses it when any page lies outside the registered regions it knows for that agent.
    """
    strided = np.array([(r.address, b.page_bytes, r.device_id, b.page_bytes, b.num_pages)
                        for b, r in zip(memory.layout.buffers, memory.regions)], dtype=np.uint64)
    try:
        return agent.prep_xfer_dlist(name, strided, mem_type)
    except (TypeError, ValueError):
        # A NIXL without the strided form (its wrapper hands None on): one row per page, built here. A
        # backend error is raised instead; "auto" then posts rows (``NixlTransport._lists_ready``).
        return agent.prep_xfer_dlist(name, memory.page_descs(), mem_type)


def _memory_type(memory: KVMemory, side: str) -> str:
    # One NIXL descriptor list carries one memory type, so one side's buffers must share it.
    kinds = {r.device for r in memory.regions}
    if len(kinds) != 1:
        raise TransportError(f"{side} memory mixes {sorted(kinds)} regions; NIXL needs one kind per side")
    return _MEM_TYPE[kinds.pop()]


def _same_binding(a: KVMemory, b: KVMemory) -> bool:
    return a is b or a.binding_fingerprint == b.binding_fingerprint


def _as_str(name: str | bytes) -> str:
    return name.decode() if isinstance(name, bytes) else name
