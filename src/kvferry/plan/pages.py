"""Page validation at the edge: the one place a caller's page lists become trusted int64 arrays.

The bottom of the plan layer, above ``layout``: ``plan_transfer``, ``TPPlanner.plan``, the lease table
and the prefill endpoint's ``send`` and announce handling all validate here, and below them nothing checks
a page again (the transport's check of rows against registered regions stays as the last guard).
Every message names the pool, the side (source or destination), the page, the buffer and its bound; the
error type is the caller's (``PlanError`` for plans and sends, ``LeaseError`` for announces).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

import numpy as np

from kvferry.errors import KVFerryError, LayoutError, PlanError
from kvferry.layout.spec import Layout, Pool

__all__ = ["PagesArg", "Side", "as_pages", "check_pages", "validate_pages", "validate_pairs"]

Side = Literal["source", "destination"]
# pool -> (source pages, destination pages), as callers pass them
PagesArg = Mapping[str, tuple[Any, Any]]
_INT64_MAX = np.iinfo(np.int64).max


def as_pages(pool: str, side: Side, value: Any, error: type[KVFerryError] = PlanError) -> np.ndarray:
    """``value`` as a fresh 1-D int64 page array, or ``error`` naming the pool and side."""
    arr = value if type(value) is np.ndarray else np.asarray(value)
    if arr.ndim != 1:
        raise error(f"pool {pool!r}: {side} pages must be a 1-D sequence, got shape {arr.shape}")
    if arr.size == 0:
        return np.zeros(0, dtype=np.int64)
    kind = arr.dtype.kind  # "i"/"u": the integer dtypes (np.issubdtype(..., np.integer), at a sixth of the cost)
    if kind not in "iu":
        raise error(f"pool {pool!r}: {side} pages must be integers, got dtype {arr.dtype}")
    if kind == "u" and arr.dtype.itemsize == 8 and int(np.maximum.reduce(arr)) > _INT64_MAX:
        raise error(f"pool {pool!r}: {side} page {int(np.maximum.reduce(arr))} is out of range")
    # A copy: plans and leases freeze their page arrays and must not freeze (or alias) the caller's.
    return arr.astype(np.int64)


def check_pages(pool: Pool, side: Side, pages: np.ndarray, error: type[KVFerryError] = PlanError, *,
                unique: bool) -> None:
    """Refuse pages outside any buffer of ``pool`` (and repeated pages when ``unique``).

    A page must be valid in *every* buffer of its pool, each against its own capacity: the message names
    the first buffer the page falls outside of, with that buffer's bound.
    """
    n = len(pages)
    if n == 0:
        return
    if n <= FEW_PAGES:
        # A few pages: Python's min, max and set on a list beat numpy's per-call cost (~1 us a call).
        listed = pages.tolist()
        lo, hi = min(listed), max(listed)
        distinct = not unique or len(set(listed)) == n
    else:
        # ufunc reductions directly: ndarray.min/max add a Python wrapper (~40% of a small call).
        lo, hi = int(np.minimum.reduce(pages)), int(np.maximum.reduce(pages))
        distinct = True
    if lo < 0 or hi >= pool.min_pages:
        bad = lo if lo < 0 else hi
        buf = pool.buffers[0] if bad < 0 else next(b for b in pool.buffers if b.num_pages <= bad)
        raise error(f"pool {pool.name!r}, buffer {buf.name!r}: {side} page {bad} is out of range (this buffer "
                    f"has {buf.num_pages} pages on the {side} side, valid 0..{buf.num_pages - 1})")
    if not distinct or (unique and n > FEW_PAGES and not _distinct(pages, hi)):
        srt = np.sort(pages)
        same = srt[1:] == srt[:-1]
        raise error(f"pool {pool.name!r}: {side} page {int(srt[int(np.argmax(same))])} appears more than "
                    "once; two writes to one page would race")


# Up to this many pages, bounds and repeats are checked on a Python list (same results, fewer calls).
FEW_PAGES = 32

# Pages in bounds are distinct iff marking them in a bitmap of max+1 flags marks n flags: O(n + max) and
# three numpy calls, where a sort is O(n log n) (81 us for 4,096 pages here, against ~6 us). Above this
# ratio of bitmap size to pages the sort is used.
_BITMAP_PER_PAGE = 64


def _distinct(pages: np.ndarray, hi: int) -> bool:
    """True when ``pages`` (all in ``0..hi``) holds no value twice."""
    n = len(pages)
    if hi + 1 <= _BITMAP_PER_PAGE * n + 4096:
        seen = np.zeros(hi + 1, dtype=bool)
        seen[pages] = True
        return np.count_nonzero(seen) == n
    srt = np.sort(pages)
    return np.count_nonzero(srt[1:] == srt[:-1]) == 0


def validate_pages(layout: Layout, side: Side, pages: Mapping[str, Any], error: type[KVFerryError] = PlanError,
                   *, unique: bool) -> dict[str, np.ndarray]:
    """pool -> page list, checked against ``layout``; returns fresh int64 arrays (empty lists kept)."""
    if not isinstance(pages, Mapping):
        raise error(f"{side} pages must be a mapping pool -> pages, got {type(pages).__name__}")
    return {name: _checked(layout, side, name, value, error, unique) for name, value in pages.items()}


def validate_pairs(src: Layout, dst: Layout, pages: PagesArg) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """pool -> (source pages, destination pages), each side checked against its own layout, of equal
    lengths, destinations unique. Raises ``PlanError`` before anything is planned."""
    if type(pages) is not dict and not isinstance(pages, Mapping):  # the exact type first: ABC checks are slow
        raise PlanError(f"pages must be a mapping pool -> (source pages, destination pages), "
                        f"got {type(pages).__name__}")
    out = {}
    for name, pair in pages.items():
        _pool(src, name, PlanError)
        try:
            raw_src, raw_dst = pair
        except (TypeError, ValueError):
            raise PlanError(f"pool {name!r}: expected (source pages, destination pages)") from None
        src_pages = _checked(src, "source", name, raw_src, PlanError, False)
        dst_pages = _checked(dst, "destination", name, raw_dst, PlanError, True)
        if len(src_pages) != len(dst_pages):
            raise PlanError(f"pool {name!r}: {len(src_pages)} source pages but {len(dst_pages)} destination pages")
        out[name] = (src_pages, dst_pages)
    return out


def _checked(layout: Layout, side: Side, name: str, value: Any, error: type[KVFerryError],
             unique: bool) -> np.ndarray:
    pool = _pool(layout, name, error)
    arr = as_pages(name, side, value, error)
    check_pages(pool, side, arr, error, unique=unique)
    return arr


def _pool(layout: Layout, name: str, error: type[KVFerryError]) -> Pool:
    try:
        return layout.pool(name)
    except LayoutError:
        raise error(f"no pool {name!r} in layout (pools: {[p.name for p in layout.pools]})") from None
