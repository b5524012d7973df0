"""The transfer planner: page lists in, the fewest bounds-checked descriptors out.

Layer 3 of kvferry (above ``memory``). ``plan_transfer`` validates everything before it produces a row,
coalesces page runs jointly (a run continues only while source *and* destination pages are consecutive),
and keeps the plan compact: per pool, the runs and the per-buffer vectors. The N x 3 descriptor arrays a
transport posts are materialised on first use, by broadcasting runs over buffers in numpy. No Python loop
runs per page or per buffer; the only loop is over the pools named in the request.

Row order: pool by pool (in request order), buffer by buffer within a pool (layout order), run by run.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import numpy as np

from .arrays import cat_int, readonly
from .errors import PlanError
from .layout import shape_difference
from .memory import KVMemory, PoolArrays

# The validation helpers are public so every planner (``plan_transfer``, ``tp.TPPlanner``) refuses the same
# inputs with the same messages.
__all__ = ["PoolPlan", "Row", "TransferPlan", "as_pages", "check_bounds", "check_unique", "coalesce_runs",
           "plan_transfer"]


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
            raise IndexError(f"row {index} out of range 0..{self.num_descriptors - 1}")
        k = int(np.searchsorted(self._row_offsets, index, side="right")) - 1
        pp = self.pools[k]
        b, r = divmod(index - int(self._row_offsets[k]), len(pp.run_len))
        pb = int(pp.src.page_bytes[b])
        return Row(
            index=index, pool=pp.pool, buffer=self.src_memory.layout.buffers[int(pp.buffer_ids[b])].name,
            src_page=int(pp.run_src[r]), dst_page=int(pp.run_dst[r]), num_pages=int(pp.run_len[r]),
            src_addr=int(pp.src.base[b]) + int(pp.run_src[r]) * pb,
            dst_addr=int(pp.dst.base[b]) + int(pp.run_dst[r]) * pb,
            nbytes=int(pp.run_len[r]) * pb,
        )

    def rows(self) -> Iterable[Row]:
        """Every row, traced back (diagnostics and plan dumps; not for hot paths)."""
        return (self.row(i) for i in range(self.num_descriptors))

    def buffer_rows(self, buffer: str) -> slice:
        """The contiguous slice of rows that belongs to ``buffer`` (empty if not in the plan)."""
        start = 0
        gid = _buffer_index(self.src_memory, buffer)
        for pp in self.pools:
            hits = np.flatnonzero(pp.buffer_ids == gid)
            if len(hits):
                first = start + int(hits[0]) * len(pp.run_len)
                return slice(first, first + len(pp.run_len))
            start += pp.num_rows
        return slice(0, 0)

    def page_selectors(self) -> tuple[np.ndarray, np.ndarray]:
        """Indices into ``src_memory.page_descs()`` and ``dst_memory.page_descs()``, one per (buffer, page).

        Each buffer's block offset is the prefix sum of the capacities before it *on that side*: never a
        slot count borrowed from buffer 0. Order: pool, buffer, page (request order).
        """
        src = [(pp.src.flat_start[:, None] + pp.src_pages[None, :]).ravel() for pp in self.pools]
        dst = [(pp.dst.flat_start[:, None] + pp.dst_pages[None, :]).ravel() for pp in self.pools]
        return cat_int(src), cat_int(dst)

    def __repr__(self) -> str:
        return (f"TransferPlan({len(self.pools)} pools, {self.num_descriptors} rows, "
                f"{self.nbytes / 2**20:.2f} MiB)")


PagesArg = Mapping[str, tuple[Any, Any]]


def plan_transfer(src: KVMemory, dst: KVMemory, pages: PagesArg,
                  buffers: Iterable[str] | None = None) -> TransferPlan:
    """Plan the copy of ``pages`` (pool -> (source pages, destination pages)) from ``src`` to ``dst``.

    Pools not named are not transferred; ``buffers`` restricts the plan to those buffers (layer-by-layer
    sends). Raises ``PlanError`` naming the pool, buffer, page and bound before any row exists when the
    shapes differ, lengths differ, a destination page repeats, or a page is outside any buffer's capacity
    on its side.
    """
    _check_shapes(src, dst)
    selected = _select_buffers(src, buffers)
    plans = []
    for pool_name, pair in pages.items():
        pp = _plan_pool(src, dst, pool_name, pair, selected)
        if pp is not None:
            plans.append(pp)
    return TransferPlan(src, dst, tuple(plans))


# -- validation ----------------------------------------------------------------------------------------
def _check_shapes(src: KVMemory, dst: KVMemory) -> None:
    if src.layout.shape_fingerprint != dst.layout.shape_fingerprint:
        diff = shape_difference(src.layout, dst.layout)
        raise PlanError(f"source and destination layouts differ in shape: {diff}")


def _buffer_index(mem: KVMemory, name: str) -> int:
    try:
        return mem.buffer_index[name]
    except KeyError:
        raise PlanError(f"no buffer {name!r} in layout") from None


def _select_buffers(mem: KVMemory, buffers: Iterable[str] | None) -> np.ndarray | None:
    if buffers is None:
        return None
    names = [buffers] if isinstance(buffers, str) else list(buffers)
    return np.array([_buffer_index(mem, n) for n in names], dtype=np.int64)


def as_pages(pool: str, side: str, value: Any, err: type[Exception] = PlanError) -> np.ndarray:
    """``value`` as a fresh 1-D int64 page array, or ``err`` naming the pool and side."""
    arr = np.asarray(value)
    if arr.ndim != 1:
        raise err(f"pool {pool!r}: {side} pages must be a 1-D sequence, got shape {arr.shape}")
    if arr.size == 0:
        return np.zeros(0, dtype=np.int64)
    if not np.issubdtype(arr.dtype, np.integer):
        raise err(f"pool {pool!r}: {side} pages must be integers, got dtype {arr.dtype}")
    if arr.dtype == np.uint64 and int(arr.max()) > np.iinfo(np.int64).max:
        raise err(f"pool {pool!r}: {side} page {int(arr.max())} is out of range")
    # A copy: the plan freezes its page arrays and must not freeze (or alias) the caller's.
    return arr.astype(np.int64)


def check_bounds(pool: str, side: str, pages: np.ndarray, arrays: PoolArrays, mem: KVMemory) -> None:
    lo, hi = int(pages.min()), int(pages.max())
    if lo >= 0 and hi < arrays.min_pages:
        return
    # Slow path, only on error: name the page and the first buffer it falls outside of.
    bad_page = lo if lo < 0 else hi
    caps = arrays.num_pages
    b = int(np.argmax(caps <= bad_page)) if bad_page >= 0 else 0
    name = mem.layout.buffers[int(arrays.buffer_ids[b])].name
    raise PlanError(f"pool {pool!r}, buffer {name!r}: {side} page {bad_page} is out of range "
                    f"(this buffer has {int(caps[b])} pages on the {side} side, valid 0..{int(caps[b]) - 1})")


def check_unique(pool: str, dst_pages: np.ndarray) -> None:
    srt = np.sort(dst_pages)
    dup = np.flatnonzero(srt[1:] == srt[:-1])
    if len(dup):
        raise PlanError(f"pool {pool!r}: destination page {int(srt[dup[0]])} appears more than once; "
                        "two writes to one page would race")


# -- planning ------------------------------------------------------------------------------------------
def _plan_pool(src: KVMemory, dst: KVMemory, pool: str, pair: Any,
               selected: np.ndarray | None) -> PoolPlan | None:
    if pool not in src.pool_arrays:
        raise PlanError(f"no pool {pool!r} in layout (pools: {list(src.pool_arrays)})")
    try:
        raw_src, raw_dst = pair
    except (TypeError, ValueError):
        raise PlanError(f"pool {pool!r}: expected (source pages, destination pages)") from None
    s, d = as_pages(pool, "source", raw_src), as_pages(pool, "destination", raw_dst)
    if len(s) != len(d):
        raise PlanError(f"pool {pool!r}: {len(s)} source pages but {len(d)} destination pages")
    sa, da = src.pool_arrays[pool], dst.pool_arrays[pool]
    if len(s) == 0:
        return None
    check_bounds(pool, "source", s, sa, src)
    check_bounds(pool, "destination", d, da, dst)
    check_unique(pool, d)
    keep = None if selected is None else np.isin(sa.buffer_ids, selected)
    if keep is not None and not keep.any():
        return None
    run_src, run_dst, run_len = coalesce_runs(s, d)
    return PoolPlan(pool, _take(sa.buffer_ids, keep), readonly(s), readonly(d), run_src, run_dst, run_len,
                    _restrict(sa, keep), _restrict(da, keep))


def coalesce_runs(s: np.ndarray, d: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Joint runs: a run breaks wherever either side's page is not the previous page + 1."""
    brk = np.empty(len(s), dtype=bool)
    brk[0] = True
    np.not_equal(s[1:], s[:-1] + 1, out=brk[1:])
    brk[1:] |= d[1:] != d[:-1] + 1
    starts = np.flatnonzero(brk)
    lengths = np.diff(np.append(starts, len(s)))
    return readonly(s[starts]), readonly(d[starts]), readonly(lengths)


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
    for pp in pools:
        arrays: PoolArrays = getattr(pp, side)
        starts = (pp.run_src if side == "src" else pp.run_dst).astype(np.uint64)
        n = pp.num_rows
        block = out[row:row + n].reshape(len(pp.buffer_ids), len(pp.run_len), 3)
        pb = arrays.page_bytes[:, None]
        block[:, :, 0] = arrays.base[:, None] + starts[None, :] * pb
        block[:, :, 1] = pp.run_len.astype(np.uint64)[None, :] * pb
        block[:, :, 2] = arrays.device_id[:, None]
        row += n
    return readonly(out)
