"""Decode's prefix cache in ``kvferry stress --reuse-prefix``: what decode keeps of a session between turns.

Part of the workload layer, above ``sim`` (pure logic, no endpoints), below ``side``, ``decode`` and
``prefill``. Turn k's prompt is turn k-1's prompt plus more, so decode keeps the pages of the previous
context that are whole and will not change, announces only the pages it lacks (``announce(...,
prefix=...)``), and checks the kept pages again when the next turn lands: they must still hold the bytes
of the turn that wrote them.

Which pages are kept, per pool:

* token pools (``tokens_per_page`` set, no window): the whole pages before the prompt's last token. An
  engine always computes the last token (vLLM caps a prefix hit at ``prompt_len - 1``), and a partial page
  changes as the context grows, so each token pool receives at least one page every turn;
* sliding-window pools: none. A turn's window pages are the pages under its last ``window_tokens`` tokens;
  after a turn adds more than a window (the usual case here) none of the previous ones is in the new window,
  and where some are their positions shift, so they move whole every turn (2-3 pages);
* state-slot pools (``tokens_per_page`` None): none; the state is the latest one, so it moves whole.

``Held`` tracks, per kept page, which turn's bytes it holds (its ``writer``): page content is keyed on
(request, position), so ``expected_keys`` gives every position of a turn its writer's key and a page that
the next turn's transfer overwrote, or that another request's write hit, fails the byte check.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvferry.layout.spec import Layout, Pool
from kvferry.workload.sim import page_keys

__all__ = ["Held", "TurnTally", "announce_prefix", "expected_keys", "kept_counts", "reusable"]


def reusable(pool: Pool) -> bool:
    """Whether decode keeps this pool's leading pages between turns (token pools without a window)."""
    return pool.tokens_per_page is not None and not pool.window_tokens


def kept_counts(layout: Layout, num_tokens: int) -> dict[str, int]:
    """Leading pages per reusable pool that decode keeps after a turn of ``num_tokens`` tokens: the whole
    pages before the last token (zeros left out)."""
    out = {p.name: (num_tokens - 1) // p.tokens_per_page for p in layout.pools
           if reusable(p) and p.tokens_per_page is not None}
    return {name: n for name, n in out.items() if n}


def announce_prefix(layout: Layout, counts: Mapping[str, int]) -> int | dict[str, int] | None:
    """The ``prefix=`` argument of an announce for ``counts`` kept pages: None when nothing is kept; a
    token count where one names exactly these pages in every pool the library turns tokens into pages
    (layouts without a window pool whose token pools keep the same tokens: llama, qwen3-next, V3.2); the
    pages per pool otherwise (a window pool, or pools of different page sizes keeping different tokens)."""
    counts = {p: n for p, n in counts.items() if n}
    if not counts:
        return None
    token_pools = [p for p in layout.pools if p.tokens_per_page is not None]
    tokens = {counts.get(p.name, 0) * p.tokens_per_page for p in token_pools if p.tokens_per_page is not None}
    if len(tokens) == 1 and all(reusable(p) for p in token_pools):
        return tokens.pop()
    return dict(counts)


def expected_keys(seed: int, buffer_ids: np.ndarray, writers: np.ndarray) -> np.ndarray:
    """``[len(buffer_ids), len(writers)]`` keys: position ``i`` of a turn's page list holds request
    ``writers[i]``'s bytes at position ``i``. One ``page_keys`` call per distinct writer (a few turns), not
    per page."""
    out = np.empty((len(buffer_ids), len(writers)), dtype=np.uint64)
    for writer in np.unique(writers).tolist():
        cols = np.flatnonzero(writers == writer)
        out[:, cols] = page_keys(seed, int(writer), buffer_ids, int(cols[-1]) + 1)[:, cols]
    return out


@dataclass
class Held:
    """What decode holds of one session between turns: leading pages per reusable pool, and per page the
    schedule index of the turn whose bytes it holds."""

    pages: dict[str, np.ndarray] = field(default_factory=dict)
    writers: dict[str, np.ndarray] = field(default_factory=dict)

    @property
    def counts(self) -> dict[str, int]:
        return {pool: len(ids) for pool, ids in self.pages.items()}

    def joined(self, new: Mapping[str, np.ndarray], index: int) -> tuple[dict[str, np.ndarray],
                                                                           dict[str, np.ndarray]]:
        """A turn's whole page list per pool (kept pages, then ``new`` ones) and each position's writer
        (request ``index`` for the new pages)."""
        pages, writers = {}, {}
        none = np.empty(0, dtype=np.int64)
        for pool in dict.fromkeys([*self.pages, *new]):  # a pool with kept pages and none new stays too
            kept, ids = self.pages.get(pool, none), new.get(pool, none)
            pages[pool] = np.concatenate([kept, ids])
            old = self.writers.get(pool, none)
            writers[pool] = np.concatenate([old, np.full(len(ids), index, dtype=np.int64)])
        return pages, writers


@dataclass
class TurnTally:
    """Per turn (0-based): requests done, how many had a prefix, pool pages and bytes moved against those of
    the whole prompt's KV."""

    requests: int = 0
    prefix_hits: int = 0
    pages_moved: int = 0
    pages_whole: int = 0
    bytes_moved: int = 0
    bytes_whole: int = 0

    def add(self, hit: bool, pages_moved: int, pages_whole: int, bytes_moved: int, bytes_whole: int) -> None:
        self.requests += 1
        self.prefix_hits += int(hit)
        self.pages_moved += pages_moved
        self.pages_whole += pages_whole
        self.bytes_moved += bytes_moved
        self.bytes_whole += bytes_whole

    def row(self, turn: int) -> dict[str, Any]:
        ratio = self.bytes_moved / self.bytes_whole if self.bytes_whole else 0.0
        return {"turn": turn, "requests": self.requests, "prefix_hits": self.prefix_hits,
                "pages_moved": self.pages_moved, "pages_whole": self.pages_whole,
                "bytes_moved": self.bytes_moved, "bytes_whole": self.bytes_whole, "moved_fraction": ratio}
