"""Prefill's request records: one ``ChunkSpec`` per ``send``, one ``PrefillRequest`` per decode rank of a request.

Part of the control plane, above ``endpoints`` and ``sessions``, below ``prefill``. ``make_spec`` validates a
``send`` on the caller's thread, before the endpoint's lock. When decode runs more TP ranks than prefill,
several decode ranks need this rank's heads of one request: the records then form a group
(``num_decode_ranks``, ``can_join``, ``group_done``) led by the record ``send`` and ``wait`` see. Records are
mutated only under the endpoint's lock.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from kvferry.control.core.base import RequestRecord
from kvferry.control.core.sessions import Session
from kvferry.control.core.states import RequestState
from kvferry.errors import PlanError
from kvferry.integrity.binding import Binding
from kvferry.layout.memory import KVMemory
from kvferry.layout.spec import Layout
from kvferry.plan.pages import validate_pages
from kvferry.plan.planner import select_buffers
from kvferry.plan.prefix import prefix_past_request, split_prefix
from kvferry.plan.ranks import source_ranks

__all__ = ["ChunkSpec", "Planned", "PrefillRequest", "can_join", "chunk_pairs", "group_done", "make_spec",
           "may_free", "note_request_end", "num_decode_ranks", "past_prefix", "source_in_use"]


class ChunkSpec:
    """One ``send``: source pages per pool, the offset of each into decode's page list, the buffers
    (None: all), whether it is the last, and its source digests (hashed by ``send``)."""

    __slots__ = ("buffer_ids", "buffers", "digests", "last", "offsets", "planned", "src")

    def __init__(self, src: dict[str, np.ndarray], offsets: dict[str, int], last: bool,
                 buffers: tuple[str, ...] | None, buffer_ids: np.ndarray | None) -> None:
        self.src, self.offsets, self.last, self.buffers = src, offsets, last, buffers
        self.buffer_ids = buffer_ids  # the buffers as the planner selects them (plan.planner.select_buffers)
        self.digests: Any = None   # integrity.SourceDigests hashed by send(), keyed once decode's pages are known
        self.planned: Planned | None = None   # planned by send() when decode had announced already


class Planned:
    """A chunk planned by ``send`` on the caller's thread against one announce of the request: valid for
    posting only while the record still has that session, generation and page list (``matches``)."""

    __slots__ = ("dst", "generation", "pairs", "plan", "session")

    def __init__(self, session: Session, generation: int, dst: dict[str, np.ndarray],
                 pairs: dict[str, tuple[np.ndarray, np.ndarray]], plan: Any) -> None:
        self.session, self.generation, self.dst, self.pairs, self.plan = session, generation, dst, pairs, plan

    def matches(self, rec: PrefillRequest) -> bool:
        return self.session is rec.session and self.generation == rec.generation and self.dst is rec.dst


class PrefillRequest(RequestRecord):
    """One request towards one decode rank. When decode runs more TP ranks than prefill, several decode
    ranks need this rank's heads of one request: the first record (the one ``send``/``wait`` see) leads a
    ``group`` of one record per decode rank, each with its own session, lease and writes."""

    __slots__ = ("binding", "coverage", "decode_binding", "decode_ok", "dst", "expected", "fail_sent", "generation",
                 "group", "handles", "history", "last_posted", "last_queued", "next_chunk", "pending", "posting",
                 "prefix", "release_at", "request_pages", "session", "source_held")

    def __init__(self, request_id: str, state: RequestState, deadline: float, now: float) -> None:
        super().__init__(request_id, state, deadline, now)
        self.session: Session | None = None
        self.generation = -1
        self.dst: dict[str, np.ndarray] = {}
        # Decode's prefix (pool -> leading pages it holds, from the announce) and, while it is not empty, the
        # request's pages per pool as far as prefill has sent them (to refuse a prefix past the request).
        self.prefix: dict[str, int] = {}
        self.request_pages: dict[str, int] = {}
        # pool -> what it has written: per buffer, destination positions (bits; coverage.py), or between page
        # sizes one token interval per chunk (page_sizes.TokenCover)
        self.coverage: dict[str, Any] = {}
        self.pending: deque[ChunkSpec] = deque()
        self.handles: list[Any] = []   # tickets of writes in flight (the shell holds the transfer handles)
        # True from the decision to write a chunk of this record until the write is posted (between events,
        # with the endpoint's lock let go: PrefillEndpoint._carry_out): a write in flight with no handle yet,
        # as good as one for holds.
        self.posting = False
        self.next_chunk = 0
        self.last_queued = self.last_posted = self.decode_ok = self.fail_sent = False
        self.group: list[PrefillRequest] = [self]               # shared by the group's records; the leader first
        self.expected = 1                             # decode ranks this request goes to (set at bind)
        self.history: list[ChunkSpec] | None = []     # every chunk so far, for decode ranks still to come
        # Pull mode: decode may still read this record's source pages (core.holds); until when, once the
        # session died.
        self.source_held = False
        self.release_at: float | None = None
        # Token bindings (integrity.binding): prefill's own, from ``send`` (kept on the group's leader), and
        # the one this record's decode announced. None: that side stated none.
        self.binding: Binding | None = None
        self.decode_binding: Binding | None = None

    @property
    def leader(self) -> PrefillRequest:
        return self.group[0]


# -- validating send() (caller's thread) ------------------------------------------------------------------
def make_spec(memory: KVMemory, pages: Mapping[str, Any], offset: int | Mapping[str, int], last: bool,
              buffers: Iterable[str] | None) -> ChunkSpec:
    """``send``'s arguments checked against this side's layout (the edge: nothing below checks them
    again), or ``PlanError`` naming the pool, the source page and the buffer."""
    src = validate_pages(memory.layout, "source", pages, PlanError, unique=False)
    offsets = {p: _offset(offset, p) for p in src}
    names = None if buffers is None else tuple([buffers] if isinstance(buffers, str) else buffers)
    return ChunkSpec(src, offsets, bool(last), names, select_buffers(memory, names))


def _offset(offset: int | Mapping[str, int], pool: str) -> int:
    value = offset.get(pool, 0) if isinstance(offset, Mapping) else offset
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
        raise PlanError(f"pool {pool!r}: offset must be an int >= 0, got {value!r}")
    return int(value)


def past_prefix(rec: PrefillRequest, spec: ChunkSpec) -> ChunkSpec | None:
    """``spec`` without the pages decode already holds (``rec.prefix``), its offsets into decode's leased
    pages; None for a chunk wholly inside the prefix that is not the last (nothing to post). ``spec``
    itself when the prefix does not touch it. The last chunk refuses a prefix past the request.

    A trimmed chunk loses its source digests (hashed by ``send`` over pages that no longer all move): the
    posting hashes its plan instead."""
    if not rec.prefix:
        return spec
    note_request_end(rec, spec)
    if spec.last:
        for pool, held in rec.prefix.items():
            if held > rec.request_pages.get(pool, 0):
                raise prefix_past_request(rec.request_id, pool, held, rec.request_pages.get(pool, 0))
    cut = {pool: split_prefix(src, spec.offsets[pool], rec.prefix.get(pool, 0))
           for pool, src in spec.src.items()}
    # A pool with nothing left to write where decode leased nothing (it holds all of it: a full prefix hit)
    # leaves the chunk; its end position was recorded above.
    cut = {pool: part for pool, part in cut.items() if len(part[0]) or pool in rec.dst}
    if cut.keys() == spec.src.keys() and all(len(src) == len(cut[pool][0]) for pool, src in spec.src.items()) \
            and all(cut[pool][1] == spec.offsets[pool] for pool in spec.src):
        return spec
    if not spec.last and not any(len(pages) for pages, _ in cut.values()):
        return None
    return ChunkSpec({p: pages for p, (pages, _) in cut.items()}, {p: off for p, (_, off) in cut.items()},
                     spec.last, spec.buffers, spec.buffer_ids)


def note_request_end(rec: PrefillRequest, spec: ChunkSpec) -> None:
    """Record how far the request reaches in each pool (``rec.request_pages``: the end of its chunks, in
    prefill's page positions), what the last chunk's prefix check compares decode's prefix with."""
    for pool, src in spec.src.items():
        rec.request_pages[pool] = max(rec.request_pages.get(pool, 0), spec.offsets[pool] + len(src))


def chunk_pairs(request_id: str, dst: Mapping[str, np.ndarray],
                spec: ChunkSpec) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """pool -> (the chunk's source pages, decode's pages ``offset .. offset + count`` of its lease ``dst``),
    or ``PlanError`` when the chunk falls outside the lease."""
    return {pool: (src, _dst_slice(request_id, dst, pool, spec.offsets[pool], len(src)))
            for pool, src in spec.src.items()}


def _dst_slice(request_id: str, dst: Mapping[str, np.ndarray], pool: str, offset: int, count: int) -> np.ndarray:
    pages = dst.get(pool)
    if pages is None:
        raise PlanError(f"request {request_id!r}: decode leased no pages in pool {pool!r}")
    if offset + count > len(pages):
        raise PlanError(f"request {request_id!r}, pool {pool!r}: chunk covers destination positions "
                        f"{offset}..{offset + count - 1} but decode leased {len(pages)} pages")
    return pages[offset:offset + count]


# -- request groups (decode TP > prefill TP) ---------------------------------------------------------------
def num_decode_ranks(local: Layout, session: Session) -> int:
    """How many of ``session``'s decode TP group need this rank's heads of a request: 1 at equal TP
    or when decode runs fewer ranks, ``D / P`` when it runs more (each announces it here)."""
    if session.planner is None or session.remote is None:
        return 1
    dtp = session.remote.layout.tp_size
    return sum(local.tp_rank in source_ranks(d, local.tp_size, dtp) for d in range(dtp))


def can_join(leader: PrefillRequest, session: Session) -> bool:
    """A live request may take one record per decode rank that needs this rank, up to ``expected``."""
    ranks = {m.session.decode_rank for m in leader.group if m.session is not None}
    return (session.planner is not None and leader.is_live and len(leader.group) < leader.expected
            and session.decode_rank not in ranks)


def group_done(rec: PrefillRequest) -> bool:
    """The leader (what ``wait`` sees) is DONE only after every decode rank of the request is."""
    if rec.leader is not rec:
        return True
    return len(rec.group) >= rec.expected and all(m.state is RequestState.DONE for m in rec.group[1:])


# -- the engine's source pages ------------------------------------------------------------------------------
def source_in_use(rec: PrefillRequest) -> bool:
    """Whether any decode rank's record of the request may still read its source pages: a write posted or
    being posted (push), or decode's reads not yet answered for (pull: the source hold)."""
    return any(m.source_held or m.handles or m.posting for m in rec.group)


def may_free(rec: PrefillRequest) -> bool:
    """Whether the engine may reuse the request's source pages: it ended, and nothing of it is in use."""
    return not rec.is_live and not source_in_use(rec)
