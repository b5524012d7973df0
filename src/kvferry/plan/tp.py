"""Planning across tensor-parallel sizes: each decode rank receives exactly its heads.

Part of the plan layer, above ``plan.planner`` and ``plan.ranks``, below the transports. Prefill runs at
TP size ``P``, decode at ``D``. A sharded buffer (GQA/MHA K or V) holds ``H / tp_size`` of a layer's ``H``
KV heads on each rank, rank ``r`` the heads ``[r * H/tp, (r+1) * H/tp)``; a replicated buffer (MLA latent,
indexer keys, state slots) holds the same bytes on every rank. For one (prefill rank, decode rank) pair:

* sharded, head-major pages (``[head][token][bytes]``): the heads the pair shares are one contiguous slice
  of each page on both sides: one row per (page, buffer), merged across a page run when the slice is the
  whole page on both sides (``P == D``);
* sharded, token-major pages (``[token][head][bytes]``): one row per (page, token, buffer), each
  ``shared heads x head_bytes`` long, again merged when the slice is the whole page;
* replicated: the whole page, from exactly one prefill rank per decode rank (``replica_source``), which is
  always a rank the decode rank needs for its sharded heads anyway, so it adds no connection.

``TPPlanner`` derives each buffer's slice once per pair; ``TPPlanner.plan`` is the hot path and is
vectorised: rows are broadcast in numpy with no Python loop per page, token, head or buffer.
``TPPlan`` has the surface transports post (``src_descs``/``dst_descs`` N x 3 uint64, ``src_memory``,
``dst_memory``, ``num_descriptors``, ``nbytes``); it has no per-page selectors, so it goes over NIXL as a
per-request descriptor list (``descriptors="dlist"``), never as indices into prepared per-page lists.

Every engine here shares one page table across its TP ranks, so one ``(source pages, destination pages)``
pair per pool serves every rank pair.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np

from kvferry.arrays import readonly
from kvferry.errors import PlanError
from kvferry.layout.compare import model_difference
from kvferry.layout.memory import KVMemory
from kvferry.plan.pages import PagesArg, validate_pairs
from kvferry.plan.planner import coalesce_runs, select_buffers

# The page validation plan_transfer does, reused so both planners refuse the same inputs alike.
from kvferry.plan.ranks import PageSlice, slice_of, source_ranks

__all__ = ["PlannedPool", "SliceRow", "TPPlan", "TPPlanner", "plan_decode_rank", "plan_tp_transfer"]

_U64 = np.uint64


@dataclass(frozen=True, eq=False)
class _PoolGeometry:
    """Per-buffer vectors of one pool for one pair, aligned (only buffers this pair writes)."""

    buffer_ids: np.ndarray    # int64
    num_tokens: np.ndarray    # int64: rows per page
    nbytes: np.ndarray        # uint64: bytes per row
    src_base: np.ndarray      # uint64: region address + slice offset
    dst_base: np.ndarray
    src_page_bytes: np.ndarray  # uint64
    dst_page_bytes: np.ndarray
    src_stride: np.ndarray    # uint64: bytes between token rows
    dst_stride: np.ndarray
    src_dev: np.ndarray       # uint64
    dst_dev: np.ndarray
    whole: np.ndarray         # bool: the slice is the whole page on both sides

    @classmethod
    def build(cls, slices: list[PageSlice], src: KVMemory, dst: KVMemory) -> _PoolGeometry:
        ids = np.array([s.buffer_id for s in slices], dtype=np.int64)

        def col(attr: str) -> np.ndarray:
            return np.array([getattr(s, attr) for s in slices], dtype=_U64)

        def side(mem: KVMemory, attr: str) -> np.ndarray:
            return np.array([getattr(mem.regions[i], attr) for i in ids], dtype=_U64)

        pages = [(src.layout.buffers[i].page_bytes, dst.layout.buffers[i].page_bytes) for i in ids]
        return cls(ids, col("num_tokens").astype(np.int64), col("nbytes"),
                   side(src, "address") + col("src_offset"), side(dst, "address") + col("dst_offset"),
                   np.array([p[0] for p in pages], dtype=_U64), np.array([p[1] for p in pages], dtype=_U64),
                   col("src_stride"), col("dst_stride"), side(src, "device_id"), side(dst, "device_id"),
                   np.array([s.whole for s in slices], dtype=bool))

    def select(self, keep: np.ndarray) -> _PoolGeometry:
        return _PoolGeometry(*(getattr(self, f)[keep] for f in self.__dataclass_fields__))


class TPPlanner:
    """Plans writes from one prefill rank's memory (``src``) into one decode rank's (``dst``).

    Build once per pair (after the handshake): it checks the two layouts are one model
    (``model_difference``) and derives each buffer's slice. ``plan`` is then cheap and vectorised.
    Ranks and TP sizes come from the layouts (``Layout.tp_size``/``tp_rank``).
    """

    def __init__(self, src: KVMemory, dst: KVMemory) -> None:
        diff = model_difference(src.layout, dst.layout)
        if diff is not None:
            raise PlanError(f"prefill and decode layouts are not one model: {diff}")
        self.src, self.dst = src, dst
        src_layout, dst_layout = src.layout, dst.layout
        self.src_rank, self.dst_rank = src_layout.tp_rank, dst_layout.tp_rank
        self._pools: dict[str, _PoolGeometry] = {}
        # buffer name -> its slice, for the buffers this pair writes (digests and coverage use it)
        self.slices: dict[str, PageSlice] = {}
        ids = src.buffer_index
        # One pass over buffers per pair, at setup: geometry is per buffer, pages come later.
        for src_pool, dst_pool in zip(src_layout.pools, dst_layout.pools):
            slices = [slice_of(src_buf, dst_buf, ids[src_buf.name], src_layout.tp_rank, dst_layout.tp_rank,
                               src_layout.tp_size, dst_layout.tp_size)
                      for src_buf, dst_buf in zip(src_pool.buffers, dst_pool.buffers)]
            kept = [x for x in slices if x is not None]
            self.slices.update({b.name: x for b, x in zip(src_pool.buffers, slices) if x is not None})
            if kept:
                self._pools[src_pool.name] = _PoolGeometry.build(kept, src, dst)

    @property
    def writes_anything(self) -> bool:
        """False when this prefill rank holds nothing the decode rank needs (no plan to send)."""
        return bool(self._pools)

    def plan(self, pages: PagesArg, buffers: Iterable[str] | None = None) -> TPPlan:
        """Plan ``pages`` (pool -> (source pages, destination pages)), like ``plan_transfer``.

        Validation is ``plan_transfer``'s: equal lengths, unique destination pages, every page inside
        every buffer of its pool on its side; ``PlanError`` otherwise, before any row exists.
        ``buffers`` restricts the plan to those buffers (layer-by-layer sends).
        """
        pairs = validate_pairs(self.src.layout, self.dst.layout, pages)
        return self.plan_pages(pairs, select_buffers(self.src, buffers))

    def plan_pages(self, pairs: Mapping[str, tuple[np.ndarray, np.ndarray]],
                   selected: np.ndarray | None = None) -> TPPlan:
        """``plan`` for pages already validated at the edge (``plan.pages``); trusts its input."""
        parts, moved = [], []
        for pool, (src_pages, dst_pages) in pairs.items():
            geo = self._pools.get(pool)
            if geo is None or len(src_pages) == 0:
                continue
            if selected is not None:
                geo = geo.select(np.isin(geo.buffer_ids, selected))
            if len(geo.buffer_ids):
                parts.append(_rows(geo, src_pages, dst_pages))
                names = self.src.layout.buffers
                moved.append(PlannedPool(pool, src_pages, dst_pages,
                                         tuple(names[i].name for i in geo.buffer_ids.tolist())))
        return TPPlan.from_parts(self.src, self.dst, parts, tuple(moved), self.slices)


# -- rows ----------------------------------------------------------------------------------------------
_Rows = tuple[np.ndarray, np.ndarray, np.ndarray]  # (src N x 3, dst N x 3, buffer id per row)


def _rows(geo: _PoolGeometry, src_pages: np.ndarray, dst_pages: np.ndarray) -> _Rows:
    """All rows of one pool: whole-page buffers first (layout order, run by run), then sliced buffers
    (layout order, page by page in request order, token by token)."""
    parts = []
    if geo.whole.any():
        parts.append(_whole_rows(geo.select(geo.whole), src_pages, dst_pages))
    partial = ~geo.whole
    # Sliced rows never merge: a slice that is not the whole page on both sides leaves a gap between one
    # page's (or token's) slice and the next on at least one side. One group per distinct token count
    # (in practice one), so the loop is not per buffer.
    for nt in np.unique(geo.num_tokens[partial]):
        parts.append(_sliced_rows(geo.select(partial & (geo.num_tokens == nt)), src_pages, dst_pages, int(nt)))
    return _concat(parts)


def _concat(parts: Sequence[_Rows]) -> _Rows:
    if len(parts) == 1:  # the common case: no copy
        return parts[0]
    src, dst, ids = zip(*parts)
    return np.concatenate(src), np.concatenate(dst), np.concatenate(ids)


def _whole_rows(geo: _PoolGeometry, src_pages: np.ndarray, dst_pages: np.ndarray) -> _Rows:
    """Whole pages: coalesce joint page runs once, then broadcast runs over buffers (as plan_transfer)."""
    run_src, run_dst, run_len = (a.astype(_U64) for a in coalesce_runs(src_pages, dst_pages))
    src = geo.src_base[:, None] + run_src[None, :] * geo.src_page_bytes[:, None]
    dst = geo.dst_base[:, None] + run_dst[None, :] * geo.dst_page_bytes[:, None]
    n = run_len[None, :] * geo.nbytes[:, None]
    return _stack(src, dst, n, geo, len(run_len))


def _sliced_rows(geo: _PoolGeometry, src_pages: np.ndarray, dst_pages: np.ndarray, nt: int) -> _Rows:
    """One row per (buffer, page, token): shape (B, pages, tokens), broadcast in numpy."""
    tok = np.arange(nt, dtype=_U64)[None, None, :]
    src = (geo.src_base[:, None, None] + src_pages.astype(_U64)[None, :, None] * geo.src_page_bytes[:, None, None]
           + tok * geo.src_stride[:, None, None])
    dst = (geo.dst_base[:, None, None] + dst_pages.astype(_U64)[None, :, None] * geo.dst_page_bytes[:, None, None]
           + tok * geo.dst_stride[:, None, None])
    n = np.broadcast_to(geo.nbytes[:, None, None], src.shape)
    return _stack(src, dst, n, geo, len(src_pages) * nt)


def _stack(src: np.ndarray, dst: np.ndarray, n: np.ndarray, geo: _PoolGeometry, per_buffer: int) -> _Rows:
    """(B, ...) address and length arrays -> N x 3 descriptor arrays, buffer-major."""
    rows = len(geo.buffer_ids) * per_buffer
    out_s, out_d = np.empty((rows, 3), dtype=_U64), np.empty((rows, 3), dtype=_U64)
    out_s[:, 0], out_d[:, 0] = src.reshape(-1), dst.reshape(-1)
    out_s[:, 1] = out_d[:, 1] = n.reshape(-1)
    out_s[:, 2] = np.repeat(geo.src_dev, per_buffer)
    out_d[:, 2] = np.repeat(geo.dst_dev, per_buffer)
    return out_s, out_d, np.repeat(geo.buffer_ids, per_buffer)


@dataclass(frozen=True, slots=True)
class SliceRow:
    """What one row of a ``TPPlan`` moves: ``nbytes`` of one buffer, from a source page offset to a
    destination page offset (a run of whole pages when the offsets are 0 and nbytes spans pages)."""

    index: int
    buffer: str
    src_page: int
    src_offset: int
    dst_page: int
    dst_offset: int
    src_addr: int
    dst_addr: int
    nbytes: int


@dataclass(frozen=True, eq=False)
class PlannedPool:
    """What a ``TPPlan`` moves in one pool: aligned source and destination pages, and the buffers (by
    name, layout order) whose slices of those pages it writes."""

    pool: str
    src_pages: np.ndarray     # int64
    dst_pages: np.ndarray     # int64
    buffers: tuple[str, ...]


@dataclass(frozen=True, eq=False)
class TPPlan:
    """An executable transfer between two ranks: row i of ``src_descs`` is copied to row i of ``dst_descs``.

    The same surface as ``TransferPlan`` as far as transports go; built from explicit descriptor arrays.
    ``pool_pages`` and ``slices`` say which (buffer, page) slices the rows cover, for digests
    (``kvferry.integrity.digests.digest_plan``) without tracing rows back.
    """

    src_memory: KVMemory
    dst_memory: KVMemory
    src_descs: np.ndarray     # uint64 [N, 3] (addr, len, dev), read-only
    dst_descs: np.ndarray
    row_buffer_ids: np.ndarray  # int64 [N]: index into Layout.buffers of each row's buffer
    pool_pages: tuple[PlannedPool, ...] = ()
    slices: Mapping[str, PageSlice] = field(default_factory=dict)  # the planner's: buffer -> its slice

    @classmethod
    def from_parts(cls, src: KVMemory, dst: KVMemory, parts: Sequence[_Rows],
                   pool_pages: tuple[PlannedPool, ...] = (), slices: Mapping[str, PageSlice] | None = None,
                   ) -> TPPlan:
        if not parts:
            empty = np.zeros((0, 3), dtype=_U64)
            parts = [(empty, empty, np.zeros(0, dtype=np.int64))]
        arrays = tuple(readonly(a) for a in _concat(parts))
        return cls(src, dst, *arrays, pool_pages, slices or {})

    @property
    def src_rank(self) -> int:
        return self.src_memory.layout.tp_rank

    @property
    def dst_rank(self) -> int:
        return self.dst_memory.layout.tp_rank

    @property
    def num_descriptors(self) -> int:
        return len(self.src_descs)

    @cached_property
    def nbytes(self) -> int:
        return int(self.src_descs[:, 1].sum())

    @cached_property
    def buffer_names(self) -> tuple[str, ...]:
        """Buffers this plan writes, in row order."""
        names = [b.name for b in self.src_memory.layout.buffers]
        return tuple(names[i] for i in dict.fromkeys(self.row_buffer_ids.tolist()))

    def row(self, index: int) -> SliceRow:
        """Map row ``index`` back to its buffer, pages and offsets (diagnostics, not hot paths)."""
        if not 0 <= index < self.num_descriptors:
            raise PlanError(f"row {index} out of range 0..{self.num_descriptors - 1}")
        gid = int(self.row_buffer_ids[index])
        buf = self.src_memory.layout.buffers[gid]
        s, n, _ = (int(x) for x in self.src_descs[index])
        dst_addr = int(self.dst_descs[index, 0])
        sp, so = divmod(s - self.src_memory.regions[gid].address, buf.page_bytes)
        dp, do = divmod(dst_addr - self.dst_memory.regions[gid].address,
                        self.dst_memory.layout.buffers[gid].page_bytes)
        return SliceRow(index, buf.name, sp, so, dp, do, s, dst_addr, n)

    @property
    def whole_pages(self) -> bool:
        return False

    def page_selectors(self) -> tuple[np.ndarray, np.ndarray]:
        """Not available: TP rows are slices of pages, not whole pages (post with ``descriptors="dlist"``)."""
        raise PlanError("a TP plan moves slices of pages: it cannot index per-page prepared lists; "
                        "use the transport's per-request descriptor lists (NixlTransport descriptors='dlist')")

    def __repr__(self) -> str:
        return (f"TPPlan(rank {self.src_rank} -> {self.dst_rank}, {self.num_descriptors} rows, "
                f"{self.nbytes / 2**20:.2f} MiB)")


# -- entry points --------------------------------------------------------------------------------------
def plan_tp_transfer(src: KVMemory, dst: KVMemory, pages: PagesArg,
                     buffers: Iterable[str] | None = None) -> TPPlan:
    """One pair's plan in one call (``TPPlanner(src, dst).plan(...)``); keep the planner to plan again."""
    return TPPlanner(src, dst).plan(pages, buffers)


def plan_decode_rank(srcs: Sequence[KVMemory], dst: KVMemory, pages: PagesArg,
                     buffers: Iterable[str] | None = None) -> dict[int, TPPlan]:
    """Every plan decode rank ``dst`` needs: prefill rank -> its plan, for the ranks that write anything.

    ``srcs[r]`` is prefill rank ``r``'s memory (its layout says ``tp_rank == r``); all ``P`` are given so
    the caller cannot pick the wrong ones. Together the plans write each byte of ``dst``'s requested
    pages exactly once: sharded heads from the ranks that hold them, replicated buffers from
    ``replica_source`` only.
    """
    ptp = len(srcs)
    for r, mem in enumerate(srcs):
        if (mem.layout.tp_size, mem.layout.tp_rank) != (ptp, r):
            raise PlanError(f"srcs[{r}] is rank {mem.layout.tp_rank} of a TP group of "
                            f"{mem.layout.tp_size}, expected rank {r} of {ptp}")
    out = {}
    for r in source_ranks(dst.layout.tp_rank, ptp, dst.layout.tp_size):
        planner = TPPlanner(srcs[r], dst)
        if planner.writes_anything:
            out[r] = planner.plan(pages, buffers)
    return out
