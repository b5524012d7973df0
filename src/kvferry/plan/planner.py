"""The transfer planner: page lists in, the fewest bounds-checked descriptors out.

The core of the plan layer, above ``plan.pages`` (validation) and ``layout``, below the TP planner and the
transports. ``plan_transfer`` validates everything (through ``plan.pages``) before it produces a row,
coalesces page runs jointly (a run continues only while source *and* destination pages are consecutive),
and keeps the plan compact: per pool, the runs and the per-buffer vectors. The N x 3 descriptor arrays a
transport posts are materialised on first use, by broadcasting runs over buffers in numpy. No Python loop
runs per page or per buffer; the only loop is over the pools named in the request. ``plan_pages`` is the
same planner for input validated at the edge: the control plane calls it and nothing is checked twice.

Row order: pool by pool (in request order), buffer by buffer within a pool (layout order), run by run.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from kvferry.arrays import cat_int, readonly
from kvferry.errors import PlanError
from kvferry.layout.compare import shape_difference
from kvferry.layout.memory import KVMemory, PoolArrays
from kvferry.plan.pages import PagesArg, validate_pairs

__all__ = ["PoolPlan", "Row", "TransferPlan", "coalesce_runs", "plan_pages", "plan_transfer", "select_buffers"]


@dataclass(frozen=True, eq=False)
class PoolPlan:
    """The validated, coalesced part of a plan for one pool (read-only numpy arrays)."""

    pool: str
    buffer_ids: np.ndarray    # int64 [B]: buffers moved, as indices into Layout.buffers
    src_pages: np.ndarray     # int64 [P]: validated source pages, in request order
    dst_pages: np.ndarray     # int64 [P]
    run_src: np.ndarray       # int64 [R]: first source page of each joint run
    run_dst: np.ndarray       # int64 [R]
    run_len: np.ndarray       # int64 [R]: pages in each run
    src: PoolArrays           # per-buffer vectors of the source side, restricted to buffer_ids
    dst: PoolArrays

    @property
    def num_rows(self) -> int:
        return len(self.buffer_ids) * len(self.run_len)


@dataclass(frozen=True, slots=True)
class Row:
    """What one descriptor row moves: a run of pages of one buffer."""

    index: int
    pool: str
    buffer: str
    src_page: int
    dst_page: int
    num_pages: int
    src_addr: int
    dst_addr: int
    nbytes: int


@dataclass(frozen=True, eq=False)
class TransferPlan:
    """An executable transfer: row i of ``src_descs`` is copied to row i of ``dst_descs``."""

    src_memory: KVMemory
    dst_memory: KVMemory
    pools: tuple[PoolPlan, ...]

    @cached_property
    def num_descriptors(self) -> int:
        return sum(p.num_rows for p in self.pools)

    @cached_property
    def nbytes(self) -> int:
        return sum(int(p.run_len.sum()) * int(p.src.page_bytes.sum()) for p in self.pools)

    @cached_property
    def num_pages(self) -> dict[str, int]:
        """Pages moved per pool (each page counted once, whatever the number of its buffers)."""
        return {p.pool: len(p.src_pages) for p in self.pools}

    @cached_property
    def buffer_names(self) -> tuple[str, ...]:
        """Buffers this plan writes, in row order."""
        names = [b.name for b in self.src_memory.layout.buffers]
        return tuple(names[i] for p in self.pools for i in p.buffer_ids)

    @cached_property
    def src_descs(self) -> np.ndarray:
        return _expand(self.pools, "src")

    @cached_property
    def dst_descs(self) -> np.ndarray:
        return _expand(self.pools, "dst")

    @cached_property
    def _row_offsets(self) -> np.ndarray:
        return np.cumsum([0, *(p.num_rows for p in self.pools)])

    def row(self, index: int) -> Row:
        """Map descriptor row ``index`` back to its pool, buffer and page run."""
        if not 0 <= index < self.num_descriptors:
            raise PlanError(f"row {index} out of range 0..{self.num_descriptors - 1}")
        k = int(np.searchsorted(self._row_offsets, index, side="right")) - 1
        pool_plan = self.pools[k]
        b, r = divmod(index - int(self._row_offsets[k]), len(pool_plan.run_len))
        pb = int(pool_plan.src.page_bytes[b])
        return Row(
            index=index, pool=pool_plan.pool, buffer=self.src_memory.layout.buffers[int(pool_plan.buffer_ids[b])].name,
            src_page=int(pool_plan.run_src[r]), dst_page=int(pool_plan.run_dst[r]), num_pages=int(pool_plan.run_len[r]),
            src_addr=int(pool_plan.src.base[b]) + int(pool_plan.run_src[r]) * pb,
            dst_addr=int(pool_plan.dst.base[b]) + int(pool_plan.run_dst[r]) * pb,
            nbytes=int(pool_plan.run_len[r]) * pb,
        )

    def rows(self) -> Iterable[Row]:
        """Every row, traced back (diagnostics and plan dumps; not for hot paths)."""
        return (self.row(i) for i in range(self.num_descriptors))

    def buffer_rows(self, buffer: str) -> slice:
        """The contiguous slice of rows that belongs to ``buffer`` (empty if not in the plan)."""
        start = 0
        (gid,) = select_buffers(self.src_memory, [buffer])
        for pool_plan in self.pools:
            hits = np.flatnonzero(pool_plan.buffer_ids == gid)
            if len(hits):
                first = start + int(hits[0]) * len(pool_plan.run_len)
                return slice(first, first + len(pool_plan.run_len))
            start += pool_plan.num_rows
        return slice(0, 0)

    @property
    def whole_pages(self) -> bool:
        return True

    def page_selectors(self) -> tuple[np.ndarray, np.ndarray]:
        """Indices into ``src_memory.page_descs()`` and ``dst_memory.page_descs()``, one per (buffer, page).

        Each buffer's block offset is the prefix sum of the capacities before it *on that side*: never a
        slot count borrowed from buffer 0. Order: pool, buffer, page (request order).
        """
        src = [(pool_plan.src.flat_start[:, None] + pool_plan.src_pages[None, :]).ravel() for pool_plan in self.pools]
        dst = [(pool_plan.dst.flat_start[:, None] + pool_plan.dst_pages[None, :]).ravel() for pool_plan in self.pools]
        return cat_int(src), cat_int(dst)

    def __repr__(self) -> str:
        return (f"TransferPlan({len(self.pools)} pools, {self.num_descriptors} rows, "
                f"{self.nbytes / 2**20:.2f} MiB)")


def plan_transfer(src: KVMemory, dst: KVMemory, pages: PagesArg,
                  buffers: Iterable[str] | None = None) -> TransferPlan:
    """Plan the copy of ``pages`` (pool -> (source pages, destination pages)) from ``src`` to ``dst``.

    Pools not named are not transferred; ``buffers`` restricts the plan to those buffers (layer-by-layer
    sends). Raises ``PlanError`` naming the pool, buffer, page and bound before any row exists when the
    shapes differ, lengths differ, a destination page repeats, or a page is outside any buffer's capacity
    on its side.
    """
    _check_shapes(src, dst)
    selected = select_buffers(src, buffers)
    return plan_pages(src, dst, validate_pairs(src.layout, dst.layout, pages), selected)


def plan_pages(src: KVMemory, dst: KVMemory, pairs: Mapping[str, tuple[np.ndarray, np.ndarray]],
               selected: np.ndarray | None = None) -> TransferPlan:
    """``plan_transfer`` for pages already validated (``pages.validate_pairs`` or the control plane's
    announce and ``send`` checks) between layouts of one shape (the handshake compared them): it trusts
    its input and checks nothing again. ``selected``: buffer indices (``select_buffers``), or all."""
    plans = [pool_plan for name, (src_pages, dst_pages) in pairs.items()
             if (pool_plan := _plan_pool(src, dst, name, src_pages, dst_pages, selected))]
    return TransferPlan(src, dst, tuple(plans))


# -- validation ----------------------------------------------------------------------------------------
def _check_shapes(src: KVMemory, dst: KVMemory) -> None:
    if src.layout.shape_fingerprint != dst.layout.shape_fingerprint:
        diff = shape_difference(src.layout, dst.layout)
        raise PlanError(f"source and destination layouts differ in shape: {diff}")


def select_buffers(mem: KVMemory, buffers: Iterable[str] | None) -> np.ndarray | None:
    """Indices into ``mem.layout.buffers`` of the named buffers (None: all), or ``PlanError``."""
    if buffers is None:
        return None
    names = [buffers] if isinstance(buffers, str) else list(buffers)
    index = mem.buffer_index
    unknown = [n for n in names if n not in index]
    if unknown:
        raise PlanError(f"no buffer {unknown[0]!r} in layout")
    return np.array([index[n] for n in names], dtype=np.int64)


# -- planning ------------------------------------------------------------------------------------------
def _plan_pool(src: KVMemory, dst: KVMemory, pool: str, src_pages: np.ndarray, dst_pages: np.ndarray,
               selected: np.ndarray | None) -> PoolPlan | None:
    if len(src_pages) == 0:
        return None
    src_arrays, dst_arrays = src.pool_arrays[pool], dst.pool_arrays[pool]
    keep = None if selected is None else np.isin(src_arrays.buffer_ids, selected)
    if keep is not None and not keep.any():
        return None
    run_src, run_dst, run_len = coalesce_runs(src_pages, dst_pages)
    return PoolPlan(pool, _take(src_arrays.buffer_ids, keep), readonly(src_pages), readonly(dst_pages), run_src,
                    run_dst, run_len, _restrict(src_arrays, keep), _restrict(dst_arrays, keep))


def coalesce_runs(src_pages: np.ndarray, dst_pages: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Joint runs: a run breaks wherever either side's page is not the previous page + 1."""
    brk = np.empty(len(src_pages), dtype=bool)
    brk[0] = True
    np.not_equal(src_pages[1:], src_pages[:-1] + 1, out=brk[1:])
    brk[1:] |= dst_pages[1:] != dst_pages[:-1] + 1
    starts = np.flatnonzero(brk)
    lengths = np.diff(np.append(starts, len(src_pages)))
    return readonly(src_pages[starts]), readonly(dst_pages[starts]), readonly(lengths)


def _take(a: np.ndarray, keep: np.ndarray | None) -> np.ndarray:
    return a if keep is None else readonly(a[keep])


def _restrict(arrays: PoolArrays, keep: np.ndarray | None) -> PoolArrays:
    if keep is None:
        return arrays
    return PoolArrays(*(_take(getattr(arrays, f), keep) for f in
                        ("buffer_ids", "base", "page_bytes", "num_pages", "device_id", "flat_start")),
                      min_pages=arrays.min_pages)


def _expand(pools: tuple[PoolPlan, ...], side: str) -> np.ndarray:
    """Broadcast runs over buffers: (B x R) rows per pool, buffer-major."""
    total = sum(p.num_rows for p in pools)
    out = np.empty((total, 3), dtype=np.uint64)
    row = 0
    for pool_plan in pools:
        arrays: PoolArrays = getattr(pool_plan, side)
        starts = (pool_plan.run_src if side == "src" else pool_plan.run_dst).astype(np.uint64)
        n = pool_plan.num_rows
        block = out[row:row + n].reshape(len(pool_plan.buffer_ids), len(pool_plan.run_len), 3)
        pb = arrays.page_bytes[:, None]
        block[:, :, 0] = arrays.base[:, None] + starts[None, :] * pb
        block[:, :, 1] = pool_plan.run_len.astype(np.uint64)[None, :] * pb
        block[:, :, 2] = arrays.device_id[:, None]
        row += n
    return readonly(out)
