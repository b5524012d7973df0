"""Which pages a sampled digest hashes: ``k`` pages per buffer, drawn without replacement, per buffer.

Part of the integrity layer, under ``digests`` (which hashes the pages drawn here). A draw's *shape* says,
pool by pool, how many buffers it has, how many pages the request moves in it, and how many of those to
hash per buffer; the draw is one row of page positions, pool by pool, buffer by buffer, ascending within a
buffer (so the hashes read memory in page order).

Each buffer's pages are drawn one of two ways, both uniform over k-subsets, chosen by size. Few pages: a
uniform key per page, keeping the ``k`` smallest (``argpartition``): cheapest per call, but a key per page
(~1 ms for a 512-page, 183-buffer request). Many: Floyd's algorithm, vectorised over buffers, ``k`` steps
of one ``integers`` call each whatever the number of pages (~20 us per call of fixed numpy overhead, so
worse on small draws). numpy has no "k of n without replacement, for each of many rows" call:
``Generator.choice`` takes one row.

``PageSampler`` serves prefill's ``send``: it draws rows for many calls of one shape at once and hands them
out one by one, because under load each call's own few-element draws cost more Python than the hashing
they choose for (bench/RESULTS.md, issue 13, eighth round). The rows are as random as per-call draws; a
block is drawn only as a shape is reused (1, 2, 4, ... rows), so a shape seen once costs one row.
"""

from __future__ import annotations

import threading

import numpy as np

from kvferry.arrays import readonly

__all__ = ["PageSampler", "SampleShape", "draw"]

# Per pool: (buffers, pages the request moves in it, pages hashed per buffer <= pages).
SampleShape = tuple[tuple[int, int, int], ...]

_MAX_ROWS = 256           # rows drawn at once for one shape
_MAX_BLOCK_ENTRIES = 1 << 16   # ... and at most this many positions in a block (large requests draw fewer rows)
_MAX_SHAPES = 64          # shapes kept per sampler (request lengths vary; each length is a shape)
_MAX_KEYS = 1536          # up to this many keys in a pool's draw, keys beat Floyd (measured: even at ~2,000)


def draw(rng: np.random.Generator | None, shape: SampleShape, rows: int = 1) -> np.ndarray:
    """``rows`` independent draws for ``shape``: int64 ``[rows, sum(buffers * picks)]`` page positions.
    ``rng`` may be None when every pool is hashed whole (nothing is drawn)."""
    parts = []
    for buffers, pages, picks in shape:
        if picks >= pages:   # every page: nothing to draw
            parts.append(np.broadcast_to(np.tile(np.arange(pages, dtype=np.int64), buffers), (rows, buffers * pages)))
        else:
            assert rng is not None, "a sampled draw needs a generator"
            pick = _smallest_keys if rows * buffers * pages <= _MAX_KEYS else _floyd
            parts.append(pick(rng, rows * buffers, pages, picks).reshape(rows, buffers * picks))
    if not parts:
        return np.zeros((rows, 0), np.int64)
    return np.ascontiguousarray(parts[0]) if len(parts) == 1 else np.concatenate(parts, axis=1)


def _smallest_keys(rng: np.random.Generator, rows: int, n: int, k: int) -> np.ndarray:
    """``k`` distinct values of ``range(n)`` per row, ascending: the ``k`` smallest of uniform keys."""
    chosen = rng.random((rows, n)).argpartition(k - 1, axis=1)[:, :k]
    chosen.sort(axis=1)  # in place, on the view: a method call rather than np.sort's dispatch and copy
    return chosen


def _floyd(rng: np.random.Generator, rows: int, n: int, k: int) -> np.ndarray:
    """``k`` distinct values of ``range(n)`` per row, each k-subset equally likely, ascending (Floyd's
    algorithm: for j in n-k .. n-1 take a uniform t <= j, or j itself when t was already taken)."""
    out = np.empty((rows, k), np.int64)
    for i, j in enumerate(range(n - k, n)):
        t = rng.integers(0, j + 1, size=rows, dtype=np.int64)
        if i:
            t = np.where((out[:, :i] == t[:, None]).any(axis=1), j, t)
        out[:, i] = t
    out.sort(axis=1)
    return out


class PageSampler:
    """Rows of ``draw`` handed out one per call, drawn in blocks per shape. Thread-safe (callers of
    ``send`` may be several threads)."""

    def __init__(self, rng: np.random.Generator | None = None) -> None:
        self.rng = np.random.default_rng() if rng is None else rng
        self._lock = threading.Lock()
        self._blocks: dict[SampleShape, _Block] = {}

    def take(self, shape: SampleShape) -> np.ndarray:
        """The next draw for ``shape`` (a read-only int64 row)."""
        with self._lock:
            block = self._blocks.get(shape)
            if block is None or block.next == len(block.rows):
                block = self._refill(shape, block)
            row = block.rows[block.next]
            block.next += 1
        return row

    def _refill(self, shape: SampleShape, old: _Block | None) -> _Block:
        width = sum(b * p for b, _, p in shape)
        cap = max(1, min(_MAX_ROWS, _MAX_BLOCK_ENTRIES // max(1, width)))
        rows = 1 if old is None else min(cap, 2 * len(old.rows))
        if old is None and len(self._blocks) >= _MAX_SHAPES:
            self._blocks.clear()
        block = self._blocks[shape] = _Block(readonly(draw(self.rng, shape, rows)))
        return block


class _Block:
    __slots__ = ("next", "rows")

    def __init__(self, rows: np.ndarray) -> None:
        self.rows = rows
        self.next = 0
