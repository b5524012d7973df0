"""The transport contract: register memory, meet a peer, post plan writes, hear notifications.

The bottom of the transport layer, above ``plan``, below ``local`` and ``nixl``. A transport moves the
rows of a ``Plan`` from this side's
registered memory into a peer's registered memory and delivers a small notification after the last byte
(push), or reads them from the peer's registered memory into this side's (``read``: pull mode, where only
the reader ever writes its own memory).
Two implementations: ``NixlTransport`` (NVIDIA NIXL over UCX, host or GPU memory) and ``LocalTransport``
(in-process memmove, the reference the tests compare against).

Before posting, every transport refuses rows outside registered memory with ``check_plan_in_regions``
(the last guard: a plan's destination addresses come from a peer's manifest); ``NixlTransport`` posts
the rows a ``RowBuffer`` writes for it.

Threading: a transport is driven from one thread (the control plane's progress loop); it is not
thread-safe. Backend errors are translated into kvferry exceptions inside each implementation, in one
place, naming the peer and the request label.
"""

from __future__ import annotations

import operator
import time
from abc import ABC, abstractmethod
from collections.abc import Sequence
from types import TracebackType
from typing import Any

import numpy as np

from kvferry.errors import TransferTimeout, TransportError
from kvferry.layout.memory import KVMemory
from kvferry.plan.contract import Plan
from kvferry.plan.planner import PoolPlan, TransferPlan

__all__ = ["BackendHandle", "RowBuffer", "TransferHandle", "Transport", "already_registered", "check_plan_in_regions",
           "check_rows_in_regions", "pages_in_regions", "short_runs"]


class TransferHandle(ABC):
    """One posted write. Poll or wait on it, then release it (or use it as a context manager)."""

    peer: str
    label: str

    @abstractmethod
    def poll(self) -> bool:
        """Non-blocking: True once every byte has landed at the peer, False while in flight.

        Raises ``TransportError`` (or ``PeerLost``) if the transfer failed; a failed handle keeps raising.
        """

    def wait(self, timeout: float) -> None:
        """Block until done; raises ``TransferTimeout`` once ``timeout`` seconds pass first."""
        deadline = time.monotonic() + timeout
        delay = 0.0
        while not self.poll():
            if time.monotonic() >= deadline:
                raise TransferTimeout(f"write {self.label!r} to peer {self.peer!r} not done after {timeout:.3f} s")
            time.sleep(delay)
            delay = min(1e-3, delay + 2e-5)  # spin briefly, then back off: small writes finish in microseconds

    @abstractmethod
    def release(self) -> None:
        """Free the backend's resources for this handle. Idempotent.

        Releasing a handle still in flight cancels it where the backend can; the bytes it already wrote
        may have landed, so the caller must keep the destination pages leased until the peer confirms.
        """

    def __enter__(self) -> TransferHandle:
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None) -> None:
        self.release()


class BackendHandle(TransferHandle):
    """A write (or read) a backend posted and this side polls: the state every backend's handle keeps, and
    the order ``poll`` and ``release`` check it in (a failed handle keeps raising; one released is not
    polled). Subclasses say how the backend reports progress (``_progress``) and what it frees (``_free``).
    """

    def __init__(self, transport: Any, peer: str, label: str, done: bool) -> None:
        self.peer = peer
        self.label = label
        self._transport = transport   # its ``_handles``: the handles not released yet
        self._done = done
        self._error: TransportError | None = None
        self._released = False

    def poll(self) -> bool:
        if self._error is not None:
            raise self._error
        if self._done:
            return True
        if self._released:
            raise TransportError(f"{self._describe()} to peer {self.peer!r}: polled after release")
        return self._progress()

    def release(self) -> None:
        if self._released:
            return
        self._released = True
        self._transport._handles.discard(self)
        self._free()

    def _describe(self) -> str:
        return f"write {self.label!r}"

    @abstractmethod
    def _progress(self) -> bool:
        """Ask the backend once: True when done; on failure set ``_error`` and raise it."""

    def _free(self) -> None:
        """Free what the backend holds for this handle (after ``release`` marked it released)."""

    def __repr__(self) -> str:
        state = "released" if self._released else "done" if self._done else "in flight"
        return f"{type(self).__name__}(peer={self.peer!r}, label={self.label!r}, {state})"


class Transport(ABC):
    """Contract shared by all transports. Called from one thread; every method may raise TransportError."""

    name: str = "abstract"

    @property
    @abstractmethod
    def agent_name(self) -> str:
        """This side's unique name, the one peers see in notifications."""

    @abstractmethod
    def register(self, memory: KVMemory) -> bytes:
        """Register this side's memory (once) and return metadata for peers (opaque bytes)."""

    @abstractmethod
    def add_peer(self, metadata: bytes) -> str:
        """Learn a peer from its ``register`` metadata; returns the peer's agent name. Re-adding replaces."""

    @abstractmethod
    def remove_peer(self, peer: str) -> None:
        """Forget a peer (its connection and cached descriptors). Unknown peers are ignored."""

    @abstractmethod
    def write(self, plan: Plan, peer: str, notif: bytes, label: str = "") -> TransferHandle:
        """Post the plan's rows as a write into ``peer``; ``notif`` reaches the peer after the last byte.

        ``plan.src_memory`` must be the memory registered here, ``plan.dst_memory`` the peer's (as decoded
        from its manifest). A plan with rows outside registered regions on either side is refused here,
        with ``TransportError``, before anything is posted; failures after posting surface from the handle.
        """

    def read(self, plan: Plan, peer: str, label: str = "") -> TransferHandle:
        """Post the plan's rows as a read from ``peer`` into this side's memory (pull mode).

        The mirror of ``write``: ``plan.src_memory`` is the peer's memory (as decoded from its manifest),
        ``plan.dst_memory`` the memory registered here. Rows outside the peer's or this side's registered
        regions are refused with ``TransportError`` before anything is posted. No notification reaches the
        peer: the reader learns completion from the handle, and tells the source side itself when it may
        release its pages. Transports that cannot read raise ``TransportError``.
        """
        raise TransportError(f"the {self.name!r} transport cannot read from peer {peer!r} (pull mode)")

    @abstractmethod
    def send_notification(self, peer: str, message: bytes) -> None:
        """Send a small message to ``peer`` outside any transfer."""

    @abstractmethod
    def get_notifications(self) -> list[tuple[str, bytes]]:
        """Drain received notifications as (peer name, message); also drives the backend's progress.

        The receiving side must call this regularly: with no progress thread, nothing else does.
        """

    def peer_may_write(self, peer: str) -> bool:
        """False only when this transport guarantees that ``peer`` can no longer write into this side's
        memory (decode's quarantine ends on it). The default, True, guarantees nothing: over NIXL a
        one-sided write needs no help from this side, and only the control plane can tell that the
        writer's process is gone."""
        return True

    @abstractmethod
    def close(self) -> None:
        """Release everything. Idempotent."""

    def __enter__(self) -> Transport:
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None) -> None:
        self.close()


def already_registered(name: str, registered: KVMemory | None, memory: KVMemory) -> bool:
    """``register``'s guard, for transports that register one memory per side: True when ``memory`` is the
    one registered already (register again returns the same metadata); ``TransportError`` for another
    memory, or for a peer's manifest (nothing of it is this process's to register)."""
    if registered is not None:
        if memory is registered:
            return True
        raise TransportError(f"transport {name!r} already has memory registered (once per side)")
    if memory.remote:
        raise TransportError("cannot register a peer's (remote) memory binding")
    return False


def check_plan_in_regions(plan: Plan, src: KVMemory, dst: KVMemory, peer: str, label: str, *,
                          selectors: bool = False) -> None:
    """Refuse a plan with any row outside ``src``'s or ``dst``'s regions: the transports' last guard.

    Fast path: a ``TransferPlan`` (exactly that type: subclasses such as the fault injector's override
    its rows) whose per-buffer vectors are the very arrays built by memories bound like ``src`` and
    ``dst`` (same binding fingerprint, ``KVMemory.built_here``). Its row (b, r) is
    ``base[b] + start[r] * page_bytes[b]``, ``length[r] * page_bytes[b]`` long, and buffer b's region is
    ``num_pages[b] * page_bytes[b]`` bytes from ``base[b]``; so every row lies inside its buffer's
    region exactly when every run lies inside the pool's smallest capacity and is not empty: O(runs),
    a few numpy calls, where checking rows is O(runs x buffers). ``selectors``: the write posts
    ``page_selectors()`` (per-page indices), so the pages are bounded too. Any other plan, a plan whose
    vectors come from elsewhere, and a fast check that fails have their rows checked one by one
    (``check_rows_in_regions``, which names the first bad row).
    """
    if type(plan) is TransferPlan and _runs_inside(plan, src, dst, selectors):
        return
    check_rows_in_regions(plan.src_descs, src, "source", peer, label)
    check_rows_in_regions(plan.dst_descs, dst, "destination", peer, label)


def pages_in_regions(plan: Plan, src: KVMemory, dst: KVMemory) -> bool:
    """True when every *page* of ``plan`` lies inside ``src``'s and ``dst``'s buffers, for a ``TransferPlan``
    (exactly) whose per-buffer vectors are those memories' own (``built_here``, as the fast path of
    ``check_plan_in_regions``): the condition for posting ``page_selectors()`` as indices into lists
    prepared from those regions (an index is a buffer's first page plus a page below the pool's smallest
    capacity, so it selects a page of that very buffer). The runs are not looked at: indices never use
    them, and a plan posted as rows goes through ``check_plan_in_regions``. False means nothing; check the
    rows instead."""
    if type(plan) is not TransferPlan:
        return False
    # Indices come from the pages alone (never from the runs), so the pages and the vectors are checked.
    src_mem, dst_mem = plan.src_memory, plan.dst_memory
    if not (_same_binding(src_mem, src) and _same_binding(dst_mem, dst)):
        return False
    for pool_plan in plan.pools:
        src_arrays, dst_arrays = pool_plan.src, pool_plan.dst
        if not (src_mem.built_here(src_arrays) and dst_mem.built_here(dst_arrays)
                and len(src_arrays.flat_start) == len(dst_arrays.flat_start) == len(pool_plan.buffer_ids)
                and _pool_pages_inside(pool_plan, src_arrays.min_pages, dst_arrays.min_pages)):
            return False
    return True


def _pool_pages_inside(pool_plan: PoolPlan, src_cap: int, dst_cap: int) -> bool:
    lists = pool_plan.page_lists
    if lists is None:
        return (len(pool_plan.src_pages) == len(pool_plan.dst_pages)
                and _pages_inside(pool_plan.src_pages, src_cap, pool_plan.dst_pages, dst_cap))
    # A few pages kept as ints (what ``_few_selectors`` turns into indices): checked as they are.
    src, dst = lists
    return len(src) == len(dst) and _ints_inside(src, src_cap) and _ints_inside(dst, dst_cap)


def _ints_inside(pages: Sequence[int], cap: int) -> bool:
    """Every page in ``0 .. cap - 1`` (Python ints: no wrap-around to guard against)."""
    return not pages or (min(pages) >= 0 and max(pages) < cap)


# A transport that can post page indices (NIXL's prepared lists) does so while a plan's runs average at
# most this many pages: one index costs NIXL's make_prepped_xfer ~16 ns, one row ~80 ns in NIXL
# (get_xfer_descs on both sides, initialize_xfer) plus ~3 ns to write it here (bench/overhead.py).
INDEX_MAX_MEAN_RUN = 4


def short_runs(plan: Plan) -> bool:
    """True for a planner-built plan whose page runs average at most ``INDEX_MAX_MEAN_RUN`` pages."""
    if type(plan) is not TransferPlan:
        return False
    pools = plan.pools
    if len(pools) == 1:
        pool_plan = pools[0]
        return _num_pages(pool_plan) <= INDEX_MAX_MEAN_RUN * pool_plan.num_runs
    return sum(_num_pages(p) for p in pools) <= INDEX_MAX_MEAN_RUN * sum(p.num_runs for p in pools)


def _num_pages(pool_plan: PoolPlan) -> int:
    lists = pool_plan.page_lists
    return len(pool_plan.src_pages) if lists is None else len(lists[0])


# Up to this many runs in a pool the fast check runs on Python lists.
FEW_RUNS = 32


def _runs_inside(plan: TransferPlan, src: KVMemory, dst: KVMemory, selectors: bool) -> bool:
    src_mem, dst_mem = plan.src_memory, plan.dst_memory
    if not (_same_binding(src_mem, src) and _same_binding(dst_mem, dst)):
        return False
    for pool_plan in plan.pools:
        runs, src_arrays, dst_arrays = pool_plan.runs, pool_plan.src, pool_plan.dst
        if not (src_mem.built_here(src_arrays) and dst_mem.built_here(dst_arrays)):
            return False
        num_buffers = len(src_arrays.base)
        if (runs.dtype != np.int64 or runs.ndim != 2 or runs.shape[0] != 3 or runs.shape[1] == 0
                or len(dst_arrays.base) != num_buffers or len(pool_plan.buffer_ids) != num_buffers):
            return False
        src_cap, dst_cap = src_arrays.min_pages, dst_arrays.min_pages
        if runs.shape[1] <= FEW_RUNS:
            # Python ints: no wrap-around to guard against, and fewer calls than numpy for a few runs.
            starts, dst_starts, lengths = runs.tolist()
            if (min(starts) < 0 or min(dst_starts) < 0 or min(lengths) < 1
                    or max(map(operator.add, starts, lengths)) > src_cap
                    or max(map(operator.add, dst_starts, lengths)) > dst_cap):
                return False
            continue
        # As uint64 a negative start or length is > 2**63: one max bounds all three rows from both sides,
        # and then start + length cannot wrap.
        u = runs.view(np.uint64)
        hi_src, hi_dst, hi_len = np.maximum.reduce(u, axis=1).tolist()
        if hi_src > src_cap or hi_dst > dst_cap or hi_len > min(src_cap, dst_cap):
            return False
        end_src, end_dst = np.maximum.reduce(u[:2] + u[2], axis=1).tolist()
        if end_src > src_cap or end_dst > dst_cap or int(np.minimum.reduce(u[2])) < 1:
            return False
    if selectors:
        return all(_pages_inside(pool_plan.src_pages, pool_plan.src.min_pages, pool_plan.dst_pages,
                                 pool_plan.dst.min_pages) for pool_plan in plan.pools)
    return True


def _pages_inside(src_pages: np.ndarray, src_cap: int, dst_pages: np.ndarray, dst_cap: int) -> bool:
    for pages, cap in ((src_pages, src_cap), (dst_pages, dst_cap)):
        if pages.dtype != np.int64 or pages.ndim != 1:
            return False
        if len(pages) <= FEW_RUNS:
            if not _ints_inside(pages.tolist(), cap):  # Python ints for a few pages: fewer calls
                return False
        elif int(np.maximum.reduce(pages.view(np.uint64))) >= cap:  # as uint64, negatives are > 2**63
            return False
    return True


def _same_binding(a: KVMemory, b: KVMemory) -> bool:
    return a is b or a.binding_fingerprint == b.binding_fingerprint


def check_rows_in_regions(descs: np.ndarray, memory: KVMemory, side: str, peer: str, label: str) -> None:
    """Refuse any ``(addr, len, dev)`` row not wholly inside one region of ``memory`` (vectorised).

    The planner already guarantees this for plans it built; transports check again at the edge because a
    plan's destination addresses come from a peer's manifest, and a write outside registered memory
    corrupts whatever lives there.
    """
    if len(descs) == 0:
        return
    # Device address spaces do not overlap in practice (CUDA uses one virtual address space per process
    # for host and all GPUs), so one sorted list serves all devices; the device id is checked as well.
    key_start, key_end, key_dev = memory.region_bounds
    addr = np.ascontiguousarray(descs[:, 0])  # searchsorted runs twice as fast on a contiguous column
    length, dev = descs[:, 1], descs[:, 2]
    # Regions are disjoint (KVMemory checks), so the only candidate is the last region starting at or
    # below the row's address: entry idx of key_end/key_dev (entry 0 holds nothing: end 0, no device).
    idx = np.searchsorted(key_start, addr, side="right")
    end = key_end[idx]
    ok = addr < end
    # ``length <= end - addr`` rather than ``addr + length <= end``: the sum can wrap around 2**64. Where
    # ``addr >= end`` the difference wraps instead, but ``ok`` is already False there.
    end -= addr
    ok &= length <= end
    ok &= length > 0
    ok &= key_dev[idx] == dev
    if not ok.all():
        bad = int(np.flatnonzero(~ok)[0])
        raise TransportError(
            f"write {label!r} to peer {peer!r}: {side} row {bad} (addr={int(addr[bad]):#x}, "
            f"len={int(length[bad])}, dev={int(dev[bad])}) is outside every registered {side} region")


# Up to this many indices per side, ``RowBuffer.selectors`` builds Python lists (NIXL takes them as they
# are): after a transfer has evicted the caches, a few numpy calls cost more than the list itself.
FEW_SELECTORS = 256


def _few_selectors(plan: TransferPlan) -> tuple[list[int], list[int]]:
    src: list[int] = []
    dst: list[int] = []
    for pool_plan in plan.pools:
        lists = pool_plan.page_lists
        src_pages, dst_pages = (pool_plan.src_pages.tolist(), pool_plan.dst_pages.tolist()) if lists is None else lists
        src += [first + page for first in pool_plan.src.flat_start_ints for page in src_pages]
        dst += [first + page for first in pool_plan.dst.flat_start_ints for page in dst_pages]
    return src, dst


class RowBuffer:
    """The N x 3 rows a transport posts, for plans the planner built written into one reused buffer.

    ``TransferPlan.fill_rows`` writes into it: no allocation per write (two fresh ~1 MB arrays cost
    hundreds of microseconds in page faults), no rows cached on the plan. Other plans post their own
    ``src_descs``/``dst_descs``. The rows returned are valid until the next ``rows`` call: the backend
    must copy them first (NIXL's descriptor lists do). Not thread-safe, like the transports.
    """

    # Plans with more rows than this get fresh arrays instead of a buffer kept for the transport's lifetime.
    MAX_ROWS = 1 << 20

    def __init__(self) -> None:
        self._buf = np.empty((2, 0, 3), dtype=np.uint64)
        self._idx = np.empty(0, dtype=np.int32)

    def selectors(self, plan: TransferPlan) -> tuple[np.ndarray | list[int], np.ndarray | list[int]]:
        """(source, destination) ``page_selectors()`` of ``plan``: int32 in a reused buffer (valid until the
        next call, like ``rows``), or Python lists up to ``FEW_SELECTORS``. Only for plans
        ``pages_in_regions`` accepted, indexing lists of fewer than 2**31 pages (``TransferPlan.fill_selectors``)."""
        n = plan.num_selectors
        if n <= FEW_SELECTORS:
            return _few_selectors(plan)
        if 2 * n > len(self._idx):
            if n > 3 * self.MAX_ROWS:
                src, dst = plan.page_selectors()
                return src.astype(np.int32), dst.astype(np.int32)
            self._idx = np.empty(max(2 * n, min(2 * len(self._idx), 6 * self.MAX_ROWS)), dtype=np.int32)
        both = self._idx[:2 * n].reshape(2, n)
        plan.fill_selector_pair(both)
        return both[0], both[1]

    def rows(self, plan: Plan) -> tuple[np.ndarray, np.ndarray]:
        """(source rows, destination rows) of ``plan``, each N x 3 uint64 C-contiguous."""
        if type(plan) is not TransferPlan:
            return plan.src_descs, plan.dst_descs
        n = plan.num_descriptors
        if n > self._buf.shape[1]:
            if n > self.MAX_ROWS:
                return plan.src_descs, plan.dst_descs
            self._buf = np.empty((2, max(n, min(2 * self._buf.shape[1], self.MAX_ROWS)), 3), dtype=np.uint64)
        src, dst = self._buf[0, :n], self._buf[1, :n]
        plan.fill_rows(src, dst)
        return src, dst
