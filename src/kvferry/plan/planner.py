"""The transfer planner: page lists in, the fewest bounds-checked descriptors out.

The core of the plan layer, above ``plan.pages`` (validation) and ``layout``, below the TP planner and the
transports. ``plan_transfer`` validates everything (through ``plan.pages``) before it produces a row,
coalesces page runs jointly (a run continues only while source *and* destination pages are consecutive),
and keeps the plan compact: per pool, the runs and the per-buffer vectors. The N x 3 descriptor arrays are
materialised on first use (``src_descs``/``dst_descs``) or written into a transport's reused buffer
(``fill_rows``), by broadcasting runs over buffers in numpy. No Python loop
runs per page or per buffer; the only loop is over the pools named in the request. ``plan_pages`` is the
same planner for input validated at the edge: the control plane calls it and nothing is checked twice.

Row order: pool by pool (in request order), buffer by buffer within a pool (layout order), run by run.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from kvferry.arrays import cat_int, readonly
from kvferry.errors import PlanError
from kvferry.layout.compare import shape_difference
from kvferry.layout.memory import KVMemory, PoolArrays
from kvferry.plan.pages import FEW_PAGES, PagesArg, validate_pairs

__all__ = ["PoolPlan", "Row", "TransferPlan", "coalesce_runs", "concat_plans", "joint_runs", "plan_pages",
           "plan_transfer", "select_buffers"]


class PoolPlan:
    """The validated, coalesced part of a plan for one pool (read-only numpy arrays). Immutable.

    Not a dataclass, for one reason: a plan of a few pages (``plan_transfer``'s common small request)
    keeps its validated pages and runs as tuples of Python ints (``page_lists``, ``run_lists``) and makes
    the arrays only when something asks for them. A transport's page check and its page indices read the
    ints, so a small write makes no numpy call for its pages; right after a copy has evicted the caches
    each such call costs 1-4 us, a tenth of what kvferry adds to a 1 MiB write (``bench/overhead.py``).
    """

    pool: str
    buffer_ids: np.ndarray    # int64 [B]: buffers moved, as indices into Layout.buffers
    src: PoolArrays           # per-buffer vectors of the source side, restricted to buffer_ids
    dst: PoolArrays
    # (source pages, destination pages) as Python ints, for plans made from a few pages; else None.
    page_lists: tuple[tuple[int, ...], tuple[int, ...]] | None
    # (first source pages, first destination pages, lengths) of the runs, likewise; else None.
    run_lists: tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]] | None
    num_runs: int

    def __init__(self, pool: str, buffer_ids: np.ndarray, src_pages: np.ndarray, dst_pages: np.ndarray,
                 runs: np.ndarray, src: PoolArrays, dst: PoolArrays) -> None:
        self._set(pool=pool, buffer_ids=buffer_ids, src=src, dst=dst, page_lists=None, run_lists=None,
                  num_runs=runs.shape[1], _arrays=(src_pages, dst_pages, runs))

    @classmethod
    def from_lists(cls, pool: str, src_pages: tuple[int, ...], dst_pages: tuple[int, ...],
                   runs: tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]], src: PoolArrays,
                   dst: PoolArrays) -> PoolPlan:
        """A plan of a few validated pages, kept as ints; the arrays are made on first use."""
        plan = cls.__new__(cls)
        plan._set(pool=pool, buffer_ids=src.buffer_ids, src=src, dst=dst, page_lists=(src_pages, dst_pages),
                  run_lists=runs, num_runs=len(runs[2]), _arrays=None)
        return plan

    def _set(self, **values: object) -> None:
        self.__dict__.update(values)  # one call: a frozen dataclass's __init__ makes one per field

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"PoolPlan is immutable: cannot set {name!r}")

    def _make_arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(source pages, destination pages, runs) from the ints, once; two threads racing here both build
        equal read-only arrays."""
        assert self.page_lists is not None and self.run_lists is not None
        n, r = len(self.page_lists[0]), self.num_runs
        packed = readonly(np.array(self.page_lists[0] + self.page_lists[1] + self.run_lists[0]
                                   + self.run_lists[1] + self.run_lists[2], dtype=np.int64))
        arrays = (packed[:n], packed[n:2 * n], packed[2 * n:].reshape(3, r))
        self._set(_arrays=arrays)
        return arrays

    @property
    def src_pages(self) -> np.ndarray:
        """int64 [P]: validated source pages, in request order."""
        arrays = self._arrays
        return (arrays if arrays is not None else self._make_arrays())[0]

    @property
    def dst_pages(self) -> np.ndarray:
        """int64 [P]: validated destination pages."""
        arrays = self._arrays
        return (arrays if arrays is not None else self._make_arrays())[1]

    @property
    def runs(self) -> np.ndarray:
        """int64 [3, R]: joint runs, rows (first source page, first destination page, pages)."""
        arrays = self._arrays
        return (arrays if arrays is not None else self._make_arrays())[2]

    @property
    def run_src(self) -> np.ndarray:
        """int64 [R]: first source page of each joint run."""
        return self.runs[0]

    @property
    def run_dst(self) -> np.ndarray:
        """int64 [R]: first destination page of each joint run."""
        return self.runs[1]

    @property
    def run_len(self) -> np.ndarray:
        """int64 [R]: pages in each run."""
        return self.runs[2]

    @property
    def num_rows(self) -> int:
        return len(self.buffer_ids) * self.num_runs

    @property
    def num_pages(self) -> int:
        """Pages moved (per buffer), without making the arrays of a plan kept as ints."""
        lists = self.page_lists
        return len(lists[0]) if lists is not None else len(self.src_pages)

    def __repr__(self) -> str:
        return f"PoolPlan({self.pool!r}, {len(self.buffer_ids)} buffers, {self.num_runs} runs)"


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

    @classmethod
    def with_counts(cls, src: KVMemory, dst: KVMemory, pools: tuple[PoolPlan, ...], rows: int,
                    selectors: int) -> TransferPlan:
        """A plan whose ``num_descriptors`` and ``num_selectors`` the caller already counted (the few-page
        planner counts them as it goes). Why: the first access of a ``functools.cached_property`` takes a
        lock on Python 3.11, ~1-2 us each right after a copy evicted the caches, on every small write."""
        plan = cls.__new__(cls)  # the fields and the two counts in one call (no __post_init__ to skip)
        plan.__dict__.update(src_memory=src, dst_memory=dst, pools=pools, num_descriptors=rows,
                             num_selectors=selectors)
        return plan

    @cached_property
    def num_descriptors(self) -> int:
        return sum(p.num_rows for p in self.pools)

    @property
    def nbytes(self) -> int:
        # Not cached: O(pools) with no numpy call, cheaper than cached_property's lock (see with_counts).
        return sum(p.num_pages * p.src.page_bytes_sum for p in self.pools)

    @cached_property
    def num_pages(self) -> dict[str, int]:
        """Pages moved per pool (each page counted once, whatever the number of its buffers)."""
        out: dict[str, int] = {}
        for p in self.pools:  # a pool repeats in a plan of several requests (concat_plans)
            out[p.pool] = out.get(p.pool, 0) + p.num_pages
        return out

    @cached_property
    def buffer_names(self) -> tuple[str, ...]:
        """Buffers this plan writes, in row order."""
        names = [b.name for b in self.src_memory.layout.buffers]
        return tuple(names[i] for p in self.pools for i in p.buffer_ids)

    @cached_property
    def src_descs(self) -> np.ndarray:
        return self._descs[0]

    @cached_property
    def dst_descs(self) -> np.ndarray:
        return self._descs[1]

    @cached_property
    def _descs(self) -> np.ndarray:
        # Both sides in one allocation: two fresh ~1 MB arrays alive together cost page faults each time.
        out = np.empty((2, self.num_descriptors, 3), dtype=np.uint64)
        self.fill_rows(out[0], out[1])
        return readonly(out)

    def fill_rows(self, src_out: np.ndarray, dst_out: np.ndarray) -> None:
        """Write the rows of ``src_descs`` and ``dst_descs`` into caller-owned N x 3 uint64 C-contiguous
        arrays (a transport's reused buffer: no allocation, no page faults). Same values, same order."""
        n = self.num_descriptors
        for out in (src_out, dst_out):
            if out.shape != (n, 3) or out.dtype is not _U64 or not out.flags.c_contiguous:
                raise PlanError(f"fill_rows needs C-contiguous ({n}, 3) uint64 arrays, got {out.shape} {out.dtype}")
        row = 0
        for pool_plan in self.pools:
            end = row + pool_plan.num_rows
            b, r = len(pool_plan.buffer_ids), pool_plan.runs.shape[1]
            # Views: a C-contiguous slice of rows reshapes without a copy.
            src_block, dst_block = src_out[row:end], dst_out[row:end]
            if b * r <= _MATMUL_MAX_ROWS:
                # Row (b, r) = row_basis[b] @ matrix[:, r]: one call per side, whatever the shape.
                matrices = _run_matrices(pool_plan.runs)
                np.matmul(pool_plan.src.row_basis, matrices[0], out=src_block.reshape(b, r * 3))
                np.matmul(pool_plan.dst.row_basis, matrices[1], out=dst_block.reshape(b, r * 3))
            else:
                _fill_side(src_block.reshape(b, r, 3), pool_plan.src, pool_plan.run_src, pool_plan.run_len)
                _fill_side(dst_block.reshape(b, r, 3), pool_plan.dst, pool_plan.run_dst, pool_plan.run_len)
            row = end

    @cached_property
    def num_selectors(self) -> int:
        """Entries per side of ``page_selectors()``: one per (buffer, page)."""
        return sum(len(p.src_pages) * len(p.buffer_ids) for p in self.pools)

    def fill_selectors(self, src_out: np.ndarray, dst_out: np.ndarray) -> None:
        """Write ``page_selectors()`` as int32 (what NIXL's ``make_prepped_xfer`` takes) into caller-owned
        C-contiguous arrays of ``num_selectors`` entries. Same values, same order. ``fill_selector_pair``
        writes both sides with fewer calls, into one (2, n) array."""
        n = self.num_selectors
        for out in (src_out, dst_out):
            if out.shape != (n,) or out.dtype is not _I32 or not out.flags.c_contiguous:
                raise PlanError(f"fill_selectors needs C-contiguous ({n},) int32 arrays, got {out.shape} {out.dtype}")
        both = np.empty((2, n), dtype=_I32)
        self.fill_selector_pair(both)
        src_out[...], dst_out[...] = both

    def fill_selector_pair(self, out: np.ndarray) -> None:
        """``page_selectors()`` as int32 into a caller-owned C-contiguous (2, ``num_selectors``) array (a
        transport's reused buffer): row 0 the source side, row 1 the destination side.

        The caller guarantees that every index fits int32 (the transport posts indices only into lists of
        fewer than 2**31 pages, for plans whose pages it checked against the capacities): the additions run
        in int32, one broadcast add per pool for both sides, contiguous along the pages.
        """
        n = self.num_selectors
        if out.shape != (2, n) or out.dtype is not _I32 or not out.flags.c_contiguous:
            raise PlanError(f"fill_selector_pair needs a C-contiguous (2, {n}) int32 array, got {out.shape} "
                            f"{out.dtype}")
        pos = 0
        for pool_plan in self.pools:
            b, p = len(pool_plan.buffer_ids), len(pool_plan.src_pages)
            end = pos + b * p
            # (2, B, 1) first pages + (2, 1, P) pages: both sides in one call (a view: no copy).
            firsts = np.array((pool_plan.src.flat_start, pool_plan.dst.flat_start), dtype=_I32)
            pages = np.array((pool_plan.src_pages, pool_plan.dst_pages), dtype=_I32)
            block = out[:, pos:end]
            block.shape = (2, b, p)  # raises rather than copy: the add must land in ``out``
            np.add(firsts[:, :, None], pages[:, None, :], out=block)
            pos = end

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
    if buffers is None and type(pages) is dict:
        plan = _plan_few(src, dst, pages)
        if plan is not None:
            return plan
    _check_shapes(src, dst)
    selected = select_buffers(src, buffers)
    return plan_pages(src, dst, validate_pairs(src.layout, dst.layout, pages), selected)


def concat_plans(plans: Sequence[TransferPlan]) -> TransferPlan:
    """Several plans between the same two memories as one: one transfer for several requests (the control
    plane's batched writes). The parts' pool plans over the same buffers (the same per-buffer vectors on
    both sides) become one, their pages and runs concatenated in the order given: a transport then checks
    and indexes a few pools, not one per request. Nothing is planned twice, and runs are not re-coalesced
    across parts. Rows come pool by pool in order of first appearance, so a pool may appear more than once
    (parts restricted to different buffers); ``buffer_rows`` then names its first appearance only."""
    first = plans[0]
    joined: dict[tuple[int, int], list[PoolPlan]] = {}
    for plan in plans:
        if type(plan) is not TransferPlan or plan.src_memory is not first.src_memory \
                or plan.dst_memory is not first.dst_memory:
            raise PlanError(f"concat_plans joins whole-page plans between the same two memories, got {plan!r}")
        for pool_plan in plan.pools:
            joined.setdefault((id(pool_plan.src), id(pool_plan.dst)), []).append(pool_plan)
    return TransferPlan.with_counts(first.src_memory, first.dst_memory, tuple(map(_join_pools, joined.values())),
                                    sum(p.num_descriptors for p in plans), sum(p.num_selectors for p in plans))


def _join_pools(parts: list[PoolPlan]) -> PoolPlan:
    if len(parts) == 1:
        return parts[0]
    head = parts[0]
    return PoolPlan(head.pool, head.buffer_ids, readonly(np.concatenate([p.src_pages for p in parts])),
                    readonly(np.concatenate([p.dst_pages for p in parts])),
                    readonly(np.concatenate([p.runs for p in parts], axis=1)), head.src, head.dst)


def _plan_few(src: KVMemory, dst: KVMemory, pages: dict) -> TransferPlan | None:
    """``plan_transfer``'s result for the common small request, in one function; None for anything else.

    Accepts only what the general path accepts without a word: pools of both layouts, each a pair of 1-D
    integer ndarrays of equal length, at most ``FEW_PAGES`` pages, every page below the pool's smallest
    capacity on its side, destinations distinct. Anything else (lists, other types, any doubt) gets None
    and the general path plans it or raises its ``PlanError``. Why a copy of that path's checks: right
    after a transfer has evicted the caches, each of its ~15 functions and ~12 numpy calls costs 2-3x its
    warm time, and for a request of a few pages that is most of what kvferry adds to the copy
    (``bench/overhead.py --posting``); ``tests/test_plan_fast_paths.py`` checks the two agree.
    """
    if src.layout.shape_fingerprint != dst.layout.shape_fingerprint:
        return None
    src_pools, dst_pools = src.pool_arrays, dst.pool_arrays
    plans = []
    rows = selectors = 0
    for name, pair in pages.items():
        src_arrays, dst_arrays = src_pools.get(name), dst_pools.get(name)
        if src_arrays is None or dst_arrays is None or type(pair) is not tuple or len(pair) != 2:
            return None
        s, d = pair
        if (type(s) is not np.ndarray or type(d) is not np.ndarray or s.ndim != 1 or d.ndim != 1
                or len(s) != len(d) or len(s) > FEW_PAGES or s.dtype.kind not in "iu" or d.dtype.kind not in "iu"):
            return None
        if not len(s):
            continue  # an empty pool plans nothing (the general path drops it too)
        src_list, dst_list = s.tolist(), d.tolist()
        if (min(src_list) < 0 or max(src_list) >= src_arrays.min_pages or min(dst_list) < 0
                or max(dst_list) >= dst_arrays.min_pages or len(set(dst_list)) != len(dst_list)):
            return None
        runs = _joint_runs_few(src_list, dst_list)
        pool_plan = PoolPlan.from_lists(name, tuple(src_list), tuple(dst_list), runs, src_arrays, dst_arrays)
        plans.append(pool_plan)
        num_buffers = len(src_arrays.flat_start_ints)
        rows += num_buffers * len(runs[2])
        selectors += num_buffers * len(src_list)
    return TransferPlan.with_counts(src, dst, tuple(plans), rows, selectors)


def plan_pages(src: KVMemory, dst: KVMemory, pairs: Mapping[str, tuple[np.ndarray, np.ndarray]],
               selected: np.ndarray | None = None) -> TransferPlan:
    """``plan_transfer`` for pages already validated (``pages.validate_pairs`` or the control plane's
    announce and ``send`` checks) between layouts of one shape (the handshake compared them): it trusts
    its input and checks nothing again. ``selected``: buffer indices (``select_buffers``), or all."""
    mask = None
    if selected is not None:
        mask = np.zeros(len(src.layout.buffers), dtype=bool)
        mask[selected] = True
    plans = [pool_plan for name, (src_pages, dst_pages) in pairs.items()
             if (pool_plan := _plan_pool(src, dst, name, src_pages, dst_pages, mask))]
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
# Rows per side up to which a pool's rows are two matrix products (``_run_matrices``): numpy's integer
# matmul is a plain loop, ~7 ns a row, but one call; broadcasting costs ~6 us of calls per side first.
_MATMUL_MAX_ROWS = 768
# Rows per side from which buffers sharing a page size and device are filled from one template per kind
# (a copy and an add per row) rather than per buffer (two multiplies and an add per row): below it the
# extra numpy calls cost more than they save.
_TEMPLATE_MIN_ROWS = 2048


def _plan_pool(src: KVMemory, dst: KVMemory, pool: str, src_pages: np.ndarray, dst_pages: np.ndarray,
               mask: np.ndarray | None) -> PoolPlan | None:
    if len(src_pages) == 0:
        return None
    src_arrays, dst_arrays = src.pool_arrays[pool], dst.pool_arrays[pool]
    if mask is not None:
        keep = mask[src_arrays.buffer_ids]
        kept = np.count_nonzero(keep)
        if kept == 0:
            return None
        if kept < len(keep):
            src_arrays, dst_arrays = src.pool_subset(pool, keep), dst.pool_subset(pool, keep)
    return PoolPlan(pool, src_arrays.buffer_ids, readonly(src_pages), readonly(dst_pages),
                    joint_runs(src_pages, dst_pages), src_arrays, dst_arrays)


def joint_runs(src_pages: np.ndarray, dst_pages: np.ndarray) -> np.ndarray:
    """Joint runs as one read-only int64 [3, R] array: rows (first source page, first destination page,
    length). A run breaks wherever either side's page is not the previous page + 1. Needs >= 1 page."""
    n = len(src_pages)
    if n <= FEW_PAGES:
        return readonly(np.array(_joint_runs_few(src_pages.tolist(), dst_pages.tolist()), dtype=np.int64))
    brk = np.empty(n, dtype=bool)
    brk[0] = True
    if n > 1:
        np.not_equal(src_pages[1:] - src_pages[:-1], 1, out=brk[1:])
        brk[1:] |= (dst_pages[1:] - dst_pages[:-1]) != 1
    starts = brk.nonzero()[0]
    runs = np.empty((3, len(starts)), dtype=np.int64)
    runs[0] = src_pages[starts]
    runs[1] = dst_pages[starts]
    np.subtract(starts[1:], starts[:-1], out=runs[2, :-1])
    runs[2, -1] = n - starts[-1]
    return readonly(runs)


def _joint_runs_few(src: list[int], dst: list[int]) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """``joint_runs`` on Python lists, as (first source pages, first destination pages, lengths): for a
    few pages, fewer calls than numpy needs."""
    src_firsts, dst_firsts, lengths = [src[0]], [dst[0]], []
    start = 0
    for i in range(1, len(src)):
        if src[i] != src[i - 1] + 1 or dst[i] != dst[i - 1] + 1:
            src_firsts.append(src[i])
            dst_firsts.append(dst[i])
            lengths.append(i - start)
            start = i
    lengths.append(len(src) - start)
    return tuple(src_firsts), tuple(dst_firsts), tuple(lengths)


def coalesce_runs(src_pages: np.ndarray, dst_pages: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Joint runs as (first source pages, first destination pages, lengths); see ``joint_runs``."""
    if len(src_pages) == 0:
        empty = readonly(np.zeros(0, dtype=np.int64))
        return empty, empty, empty
    runs = joint_runs(src_pages, dst_pages)
    return runs[0], runs[1], runs[2]


def _run_matrices(runs: np.ndarray) -> np.ndarray:
    """uint64 [2, 3, R * 3], one matrix per side: column (r, j) turns ``PoolArrays.row_basis``
    ``(page_bytes, base, device)`` into entry j of run r's row: ``(start, 1, 0)`` gives the address,
    ``(length, 0, 0)`` the length, ``(0, 0, 1)`` the device."""
    num_runs = runs.shape[1]
    pattern = _MATRIX_PATTERN if num_runs <= _MATRIX_PATTERN.shape[2] else _matrix_pattern(num_runs)
    m = pattern[:, :, :num_runs].copy()  # the constant entries, copied: fewer calls than setting them
    u = runs.view(np.uint64)  # validated non-negative: exact
    m[:, 0, :, 0] = u[:2]
    m[:, 0, :, 1] = u[2]
    return m.reshape(2, 3, num_runs * 3)


def _matrix_pattern(max_runs: int) -> np.ndarray:
    m = np.zeros((2, 3, max_runs, 3), dtype=np.uint64)
    m[:, 1, :, 0] = 1
    m[:, 2, :, 2] = 1
    return readonly(m)


_U64 = np.dtype(np.uint64)
_I32 = np.dtype(np.int32)
_MATRIX_PATTERN = _matrix_pattern(_MATMUL_MAX_ROWS)  # a pool on the matmul path has at most this many runs


def _fill_side(block: np.ndarray, arrays: PoolArrays, starts: np.ndarray, lengths: np.ndarray) -> None:
    """Rows of one pool on one side into ``block`` (B x R x 3, a view): row (b, r) is
    ``(base[b] + starts[r] * page_bytes[b], lengths[r] * page_bytes[b], device_id[b])``."""
    num_buffers, num_runs = block.shape[:2]
    # Pages are validated non-negative: the uint64 views are exact (int64 x uint64 would give float64).
    su, lu = starts.view(np.uint64), lengths.view(np.uint64)
    num_kinds = len(arrays.kinds)
    if num_kinds < num_buffers and num_buffers * num_runs >= _TEMPLATE_MIN_ROWS:
        # One template of rows per kind (page size, device), copied to each buffer of that kind, then the
        # buffer's base added to the address column.
        kpb = arrays.kinds[:, 0, None]
        tmpl = np.empty((num_kinds, num_runs, 3), dtype=np.uint64)
        np.multiply(su[None, :], kpb, out=tmpl[:, :, 0])
        np.multiply(lu[None, :], kpb, out=tmpl[:, :, 1])
        tmpl[:, :, 2] = arrays.kinds[:, 1, None]
        np.take(tmpl.reshape(num_kinds, num_runs * 3), arrays.kind, axis=0,
                out=block.reshape(num_buffers, num_runs * 3), mode="clip")
    else:
        pb = arrays.page_bytes[:, None]
        np.multiply(su[None, :], pb, out=block[:, :, 0])
        np.multiply(lu[None, :], pb, out=block[:, :, 1])
        block[:, :, 2] = arrays.device_id[:, None]
    np.add(block[:, :, 0], arrays.base[:, None], out=block[:, :, 0])
