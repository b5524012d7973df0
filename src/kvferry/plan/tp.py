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

import numpy as np

from kvferry.arrays import readonly
from kvferry.errors import PlanError
from kvferry.layout.compare import model_difference
from kvferry.layout.memory import KVMemory
from kvferry.layout.spec import Buffer
from kvferry.plan.contract import RowsPlan
from kvferry.plan.pages import PagesArg, validate_pairs
from kvferry.plan.planner import coalesce_runs, select_buffers

# The page validation plan_transfer does, reused so both planners refuse the same inputs alike.
from kvferry.plan.ranks import PageSlice, slice_of, source_ranks

__all__ = ["PlannedPool", "SliceRow", "TPPlan", "TPPlanner", "plan_decode_rank", "plan_tp_transfer"]

_U64 = np.uint64
# (pool, buffer selection) pairs a planner keeps compiled; past it, a selection is compiled per plan.
_MAX_COMPILED = 256
_UNCOMPILED = object()


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
        self._compiled: dict[tuple[str, bytes | None], _PoolRows | None] = {}   # (pool, selection) -> rows
        # buffer name -> its slice, for the buffers this pair writes (digests and coverage use it)
        self.slices: dict[str, PageSlice] = {}
        ids = src.buffer_index
        # One pass over buffers per pair, at setup: geometry is per buffer, pages come later.
        for src_pool, dst_pool in zip(src_layout.pools, dst_layout.pools):
            slices = [slice_of(src_buf, dst_buf, ids[src_buf.name], src_layout.tp_rank, dst_layout.tp_rank,
                               src_layout.tp_size, dst_layout.tp_size)
                      for src_buf, dst_buf in zip(src_pool.buffers, dst_pool.buffers)]
            # A state buffer's slice is several pieces (one per channel section): each its own geometry row.
            kept = [part for x in slices if x is not None for part in x.parts]
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
        key = None if selected is None else selected.tobytes()
        for pool, (src_pages, dst_pages) in pairs.items():
            if len(src_pages) == 0:
                continue
            rows = self._compiled.get((pool, key), _UNCOMPILED)
            if rows is _UNCOMPILED:
                rows = self._compile(pool, selected, key)
            if rows is not None:
                parts.append(rows.rows(src_pages, dst_pages))
                moved.append(PlannedPool(pool, src_pages, dst_pages, rows.names))
        return TPPlan.from_parts(self.src, self.dst, parts, tuple(moved), self.slices)

    def _compile(self, pool: str, selected: np.ndarray | None, key: bytes | None) -> _PoolRows | None:
        """The pool's rows for one buffer selection (None: this pair writes none of them), split into their
        whole-page and sliced groups once per (pool, selection): a request's plan then makes only the numpy
        calls that depend on its pages (a third of the time for a request of a few pages)."""
        geo = self._pools.get(pool)
        if geo is not None and selected is not None:
            geo = geo.select(np.isin(geo.buffer_ids, selected))
        rows = None if geo is None or not len(geo.buffer_ids) else _PoolRows(geo, self.src.layout.buffers)
        if len(self._compiled) < _MAX_COMPILED:   # a caller's selections are few (all, one layer at a time)
            self._compiled[(pool, key)] = rows   # two threads racing here store equal rows
        return rows


# -- rows ----------------------------------------------------------------------------------------------
_Rows = tuple[np.ndarray, np.ndarray, np.ndarray]  # (src N x 3, dst N x 3, buffer id per row)


class _PoolRows:
    """One pool's rows for one pair and buffer selection: whole-page buffers first (layout order, run by
    run), then sliced buffers (layout order, page by page in request order, token by token). What does not
    depend on a request's pages (the groups, each buffer's start, stride and device) is computed once, at the
    first plan of the selection (``TPPlanner._compile``); ``rows`` then broadcasts the pages in."""

    def __init__(self, geo: _PoolGeometry, buffers: Sequence[Buffer]) -> None:
        self.names = tuple(dict.fromkeys(buffers[i].name for i in geo.buffer_ids.tolist()))
        self.whole = _WholeRows(geo.select(geo.whole)) if geo.whole.any() else None
        partial = ~geo.whole
        # Sliced rows never merge: a slice that is not the whole page on both sides leaves a gap between one
        # page's (or token's) slice and the next on at least one side. One group per distinct token count
        # (in practice one), so no loop runs per buffer.
        self.sliced = tuple(_SlicedRows(geo.select(partial & (geo.num_tokens == nt)), int(nt))
                            for nt in np.unique(geo.num_tokens[partial]))

    def rows(self, src_pages: np.ndarray, dst_pages: np.ndarray) -> _Rows:
        parts = [] if self.whole is None else [self.whole.rows(src_pages, dst_pages)]
        parts += [group.rows(src_pages, dst_pages) for group in self.sliced]
        return _concat(parts)


def _concat(parts: Sequence[_Rows]) -> _Rows:
    if len(parts) == 1:  # the common case: no copy
        return parts[0]
    src, dst, ids = zip(*parts)
    return np.concatenate(src), np.concatenate(dst), np.concatenate(ids)


class _WholeRows:
    """Whole pages: joint page runs coalesced once per request, then broadcast over buffers (as
    plan_transfer); one row per (buffer, run), buffer-major."""

    def __init__(self, geo: _PoolGeometry) -> None:
        col = (slice(None), None)   # (B,) -> (B, 1): broadcast against a request's runs
        self.src_base, self.dst_base = geo.src_base[col], geo.dst_base[col]
        self.src_page_bytes, self.dst_page_bytes = geo.src_page_bytes[col], geo.dst_page_bytes[col]
        self.nbytes, self.src_dev, self.dst_dev = geo.nbytes[col], geo.src_dev[col], geo.dst_dev[col]
        self.buffer_ids = geo.buffer_ids

    def rows(self, src_pages: np.ndarray, dst_pages: np.ndarray) -> _Rows:
        run_src, run_dst, run_len = (a.astype(_U64) for a in coalesce_runs(src_pages, dst_pages))
        shape = (len(self.buffer_ids), len(run_len), 3)
        out_s, out_d = np.empty(shape, dtype=_U64), np.empty(shape, dtype=_U64)
        out_s[:, :, 0] = self.src_base + run_src * self.src_page_bytes
        out_d[:, :, 0] = self.dst_base + run_dst * self.dst_page_bytes
        out_s[:, :, 1] = out_d[:, :, 1] = run_len * self.nbytes
        out_s[:, :, 2], out_d[:, :, 2] = self.src_dev, self.dst_dev
        return out_s.reshape(-1, 3), out_d.reshape(-1, 3), np.repeat(self.buffer_ids, len(run_len))


class _SlicedRows:
    """One row per (buffer, page, token) of buffers with ``num_tokens`` rows a page: shape (B, pages,
    tokens), broadcast in numpy; each row's start within its page (offset + token * stride) is fixed."""

    def __init__(self, geo: _PoolGeometry, num_tokens: int) -> None:
        tok = np.arange(num_tokens, dtype=_U64)[None, None, :]
        cube = (slice(None), None, None)   # (B,) -> (B, 1, 1)
        self.src_start = geo.src_base[cube] + tok * geo.src_stride[cube]   # (B, 1, tokens)
        self.dst_start = geo.dst_base[cube] + tok * geo.dst_stride[cube]
        self.src_page_bytes, self.dst_page_bytes = geo.src_page_bytes[cube], geo.dst_page_bytes[cube]
        self.nbytes, self.src_dev, self.dst_dev = geo.nbytes[cube], geo.src_dev[cube], geo.dst_dev[cube]
        self.buffer_ids, self.num_tokens = geo.buffer_ids, num_tokens

    def rows(self, src_pages: np.ndarray, dst_pages: np.ndarray) -> _Rows:
        shape = (len(self.buffer_ids), len(src_pages), self.num_tokens, 3)
        out_s, out_d = np.empty(shape, dtype=_U64), np.empty(shape, dtype=_U64)
        out_s[..., 0] = self.src_start + src_pages.astype(_U64)[None, :, None] * self.src_page_bytes
        out_d[..., 0] = self.dst_start + dst_pages.astype(_U64)[None, :, None] * self.dst_page_bytes
        out_s[..., 1] = out_d[..., 1] = self.nbytes
        out_s[..., 2], out_d[..., 2] = self.src_dev, self.dst_dev
        return (out_s.reshape(-1, 3), out_d.reshape(-1, 3),
                np.repeat(self.buffer_ids, len(src_pages) * self.num_tokens))


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
class TPPlan(RowsPlan):
    """An executable transfer between two ranks: row i of ``src_descs`` is copied to row i of ``dst_descs``.

    The same surface as ``TransferPlan`` as far as transports go; built from explicit descriptor arrays.
    ``pool_pages`` and ``slices`` say which (buffer, page) slices the rows cover, for digests
    (``kvferry.integrity.digests.digest_plan``) without tracing rows back.
    """

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
