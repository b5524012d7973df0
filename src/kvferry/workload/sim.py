"""The workload model behind ``kvferry stress`` and ``kvferry demo``: sessions, page allocators, page content.

The bottom of the workload layer, above ``layout``: it reads layouts (never transports or endpoints)
and is pure, deterministic logic. ``runner`` drives it on both sides of a real transfer.

* ``PageAllocator``: one per pool and side. A numpy free list that frees and reuses pages the way engine
  allocators do (freed pages wait in a released list, merged and sorted back when the free list runs
  short, as SGLang's ``merge_and_sort_free``), so requests get fragmented runs and pages that an earlier
  request used: reuse is where aliasing bugs live. It raises on a double allocation or a double free.
* ``WorkloadSpec`` and ``build_schedule``: many concurrent multi-turn sessions; each turn's prompt
  extends the previous one by a seeded log-normal amount. The schedule is a deterministic tuple of
  ``RequestSpec`` (same seed, same requests, on both sides of the run).
* ``pages_needed``: pages per pool for a prompt: ``ceil(tokens / tokens_per_page)``, one slot in state
  pools, and only the pages under the last ``window_tokens`` in sliding-window pools (the layout says
  which: ``Pool.window_tokens``).
* ``page_keys``, ``fill_pages``, ``check_pages``: page content derived from (seed, request, buffer,
  page position) with a vectorised splitmix64, so the decode side verifies every byte it received without
  seeing prefill memory. Each 8-byte word of a page is ``key ^ (word_index * ODD)``: a page from another
  request, another position, another buffer, a stale or zero page or a shifted copy all fail the check.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from kvferry.arrays import readonly
from kvferry.errors import OutOfPages, UsageError
from kvferry.layout.presets import get_preset
from kvferry.layout.spec import Layout, Pool

__all__ = ["OutOfPages", "PageAllocator", "RequestSpec", "WorkloadSpec", "build_schedule", "check_pages",
           "fill_pages", "page_keys", "pages_needed", "windows_for"]

_U64 = np.uint64
_MASK = (1 << 64) - 1
_WORD_MUL = _U64(0x9E3779B97F4A7C15)  # odd: word i of a page differs from word j for every i != j
_CHUNK_BYTES = 256 << 10


# -- allocator ---------------------------------------------------------------------------------------------
class PageAllocator:
    """Pages ``0..num_pages-1`` of one pool on one side. Not thread-safe: one driver per side.

    ``allocate(n)`` returns ``n`` distinct free pages (int64, in free-list order, so runs fragment as pages
    are freed in other orders); ``free(pages)`` returns them. Freed pages are reused only after the free
    list is exhausted and the released pages are merged back in sorted order. ``seed`` shuffles the
    initial free list, so two sides of a run hand out different page ids from the first request on.
    """

    def __init__(self, num_pages: int, *, seed: int | None = None, name: str = "pool") -> None:
        if num_pages < 1:
            raise UsageError(f"allocator {name!r}: num_pages must be >= 1, got {num_pages}")
        self.name = name
        self.num_pages = num_pages
        pages = np.arange(num_pages, dtype=np.int64)
        if seed is not None:
            np.random.default_rng(seed).shuffle(pages)
        self._free = pages
        self._released: list[np.ndarray] = []
        self._num_released = 0
        self._live = np.zeros(num_pages, dtype=bool)

    @property
    def num_free(self) -> int:
        return len(self._free) + self._num_released

    @property
    def num_live(self) -> int:
        return self.num_pages - self.num_free

    def can_allocate(self, n: int) -> bool:
        return n <= self.num_free

    def allocate(self, n: int) -> np.ndarray:
        """``n`` free pages, now live; raises ``OutOfPages`` when fewer than ``n`` are free."""
        if n > len(self._free):
            if n > self.num_free:
                raise OutOfPages(f"allocator {self.name!r}: {n} pages asked, {self.num_free} free "
                                 f"of {self.num_pages}")
            self._merge_released()
        pages, self._free = self._free[:n].copy(), self._free[n:]
        if self._live[pages].any():  # cannot happen unless the free list is corrupt: fail loudly
            raise AssertionError(f"allocator {self.name!r} handed out a live page: {pages[self._live[pages]][:5]}")
        self._live[pages] = True
        return pages

    def free(self, pages: np.ndarray) -> None:
        """Return live ``pages``; raises ``ValueError`` for a page not live (double free) or repeated."""
        pages = np.asarray(pages, dtype=np.int64)
        if len(pages) == 0:
            return
        if len(np.unique(pages)) != len(pages) or not self._live[pages].all():
            raise UsageError(f"allocator {self.name!r}: freeing pages that are not live or repeated")
        self._live[pages] = False
        self._released.append(pages.copy())
        self._num_released += len(pages)

    def _merge_released(self) -> None:
        # Sorted merge, as SGLang does: later requests get low, often contiguous, page ids again.
        self._free = np.sort(np.concatenate([self._free, *self._released]))
        self._released.clear()
        self._num_released = 0


# -- sessions ----------------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class WorkloadSpec:
    """Sessions, turns and prompt-length distributions; everything else follows from ``seed``.

    The first prompt of a session has a log-normal length (median ``first_tokens``, spread
    ``first_sigma``), clipped to ``[min_tokens, max_tokens]``; each later turn adds a log-normal number of
    tokens (median ``turn_tokens``), the previous answer and the next user message, and is clipped at
    ``max_tokens``, the context limit.
    """

    num_sessions: int = 80
    num_turns: int = 4
    seed: int = 0
    first_tokens: int = 1024
    first_sigma: float = 0.6
    turn_tokens: int = 256
    turn_sigma: float = 0.8
    min_tokens: int = 16
    max_tokens: int = 16384

    def __post_init__(self) -> None:
        for name in ("num_sessions", "num_turns", "first_tokens", "turn_tokens", "min_tokens", "max_tokens"):
            if getattr(self, name) < 1:
                raise UsageError(f"WorkloadSpec.{name} must be >= 1, got {getattr(self, name)}")
        if self.min_tokens > self.max_tokens:
            raise UsageError(f"WorkloadSpec: min_tokens {self.min_tokens} > max_tokens {self.max_tokens}")

    @property
    def num_requests(self) -> int:
        return self.num_sessions * self.num_turns


@dataclass(frozen=True, slots=True)
class RequestSpec:
    """One request: turn ``turn`` of session ``session``, a prompt of ``num_tokens`` tokens.

    ``index`` is its position in the schedule (turn-major: every session's turn 0, then turn 1...), the
    number the page content is keyed on.
    """

    index: int
    session: int
    turn: int
    num_tokens: int

    @property
    def request_id(self) -> str:
        return f"s{self.session}-t{self.turn}"


def build_schedule(spec: WorkloadSpec) -> tuple[RequestSpec, ...]:
    """Every request of the workload, turn-major, sessions in a seeded order within each turn.

    Deterministic in ``spec``. A session's prompt never shrinks from one turn to the next.
    """
    tokens = session_tokens(spec)
    rng = np.random.default_rng([spec.seed, 1])
    out: list[RequestSpec] = []
    for turn in range(spec.num_turns):
        for session in rng.permutation(spec.num_sessions).tolist():
            out.append(RequestSpec(len(out), session, turn, int(tokens[session, turn])))
    return tuple(out)


def session_tokens(spec: WorkloadSpec) -> np.ndarray:
    """``[num_sessions, num_turns]`` prompt lengths: cumulative, clipped, non-decreasing along turns."""
    rng = np.random.default_rng([spec.seed, 0])
    first = rng.lognormal(math.log(spec.first_tokens), spec.first_sigma, size=(spec.num_sessions, 1))
    growth = rng.lognormal(math.log(spec.turn_tokens), spec.turn_sigma,
                           size=(spec.num_sessions, spec.num_turns - 1))
    total = np.cumsum(np.concatenate([first, growth], axis=1), axis=1)
    return np.clip(np.rint(total), spec.min_tokens, spec.max_tokens).astype(np.int64)


def windows_for(preset: str) -> dict[str, int]:
    """The sliding-window pools of a preset, pool -> window tokens, as its layout declares them."""
    return {p.name: p.window_tokens for p in get_preset(preset, num_pages=1).pools if p.window_tokens}


def pages_needed(layout: Layout, num_tokens: int, windows: Mapping[str, int] | None = None) -> dict[str, int]:
    """Pages per pool that a prompt of ``num_tokens`` occupies (and that decode must receive).

    State pools (``tokens_per_page`` None): one slot. Sliding-window pools (``Pool.window_tokens``, or
    ``windows[pool]``, which overrides it): the pages holding the last ``window`` tokens. Others:
    ``ceil(num_tokens / tokens_per_page)``.
    """
    if num_tokens < 1:
        raise UsageError(f"pages_needed: num_tokens must be >= 1, got {num_tokens}")
    windows = windows or {}
    return {pool.name: _pool_pages(pool, num_tokens, windows.get(pool.name, pool.window_tokens))
            for pool in layout.pools}


def _pool_pages(pool: Pool, num_tokens: int, window: int | None) -> int:
    tpp = pool.tokens_per_page
    if tpp is None:
        return 1
    if window is None:
        return -(-num_tokens // tpp)
    first = max(0, num_tokens - window)
    return (num_tokens - 1) // tpp - first // tpp + 1


# -- page content ------------------------------------------------------------------------------------------
def _splitmix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser over a uint64 array (wrapping arithmetic): a bijective, well-mixed hash."""
    with np.errstate(over="ignore"):
        x = x + _U64(0x9E3779B97F4A7C15)
        x = (x ^ (x >> _U64(30))) * _U64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> _U64(27))) * _U64(0x94D049BB133111EB)
        return x ^ (x >> _U64(31))


def page_keys(seed: int, request_index: int, buffer_ids: np.ndarray, num_pages: int) -> np.ndarray:
    """``[len(buffer_ids), num_pages]`` uint64 keys: one per (buffer, page position) of the request.

    ``buffer_ids`` are indices into ``Layout.buffers`` (the same on both sides of a transfer).
    """
    request = _splitmix64(np.array([(seed * 0x100000001B3 + request_index) & _MASK], dtype=_U64))
    with np.errstate(over="ignore"):
        per_buffer = _splitmix64(request ^ (np.asarray(buffer_ids, dtype=_U64) * _U64(0xD6E8FEB86659FD93)))
        return _splitmix64(per_buffer[:, None] + np.arange(num_pages, dtype=_U64)[None, :])


@functools.lru_cache(maxsize=64)
def _ramp(page_bytes: int) -> np.ndarray:
    """``word_index * _WORD_MUL`` over one page's words: the same for every page of that size."""
    with np.errstate(over="ignore"):
        ramp = np.arange(-(-page_bytes // 8), dtype=_U64) * _WORD_MUL
    return readonly(ramp)


def _expected(keys: np.ndarray, page_bytes: int) -> np.ndarray:
    """``[len(keys), page_bytes]`` uint8: the content each key's page must hold."""
    words = keys[:, None] ^ _ramp(page_bytes)[None, :]
    return words.view(np.uint8)[:, :page_bytes]


def _chunks(num_pages: int, page_bytes: int) -> range:
    # ~256 KiB at a time: the temporaries stay in cache, which measured 2-4x faster than whole requests.
    return range(0, num_pages, max(1, _CHUNK_BYTES // page_bytes))


def fill_pages(pages_view: np.ndarray, pages: np.ndarray, keys: np.ndarray) -> None:
    """Write each key's content into page ``pages[i]`` of ``pages_view`` (``[num_pages, page_bytes]`` u8)."""
    page_bytes = pages_view.shape[1]
    step = max(1, _CHUNK_BYTES // page_bytes)
    for start in _chunks(len(pages), page_bytes):
        pages_view[pages[start:start + step]] = _expected(keys[start:start + step], page_bytes)


def check_pages(pages_view: np.ndarray, pages: np.ndarray, keys: np.ndarray) -> np.ndarray:
    """Bool mask over ``pages``: True where page ``pages[i]`` differs from key ``i``'s content in any byte."""
    page_bytes = pages_view.shape[1]
    step = max(1, _CHUNK_BYTES // page_bytes)
    bad = np.zeros(len(pages), dtype=bool)
    for start in _chunks(len(pages), page_bytes):
        sel = slice(start, start + step)
        got = pages_view[pages[sel]]  # a gathered copy: safe to overwrite below
        if page_bytes % 8:
            bad[sel] = (got != _expected(keys[sel], page_bytes)).any(axis=1)
            continue
        words = got.view(_U64)
        np.bitwise_xor(words, _ramp(page_bytes), out=words)
        bad[sel] = (words != keys[sel, None]).any(axis=1)
    return bad


def wrong_bytes(pages_view: np.ndarray, pages: np.ndarray, keys: np.ndarray) -> np.ndarray:
    """Per page of ``pages``, how many of its bytes differ from key ``i``'s content (int64; 0 where intact).

    ``check_pages`` finds the bad pages (the fast word compare); only those are compared byte by byte.
    """
    counts = np.zeros(len(pages), dtype=np.int64)
    bad = np.flatnonzero(check_pages(pages_view, pages, keys))
    page_bytes = pages_view.shape[1]
    for i in bad.tolist():
        expected = _expected(keys[i:i + 1], page_bytes)[0]
        counts[i] = int(np.count_nonzero(pages_view[pages[i]] != expected))
    return counts
