"""Prefill's chunks between page sizes: a chunk's token spans past decode's prefix, and their coverage.

Part of ``core.prefill`` (no I/O), above ``prefill_requests`` and ``plan.tokens``; used by ``prefill_writer``
for a session whose pools' page sizes differ from decode's (``Session.translator``). A chunk's source pages
sit at prefill page positions of the whole request, so they hold tokens ``[pos x Ts, (pos + n) x Ts)``; they
land by token in decode's leased pages, which begin past its prefix (``prefix x Td`` tokens). A decode page
may then be split between two chunks, so what equal page sizes count in destination positions is counted
here in decode's tokens: which a chunk writes (twice is refused), and on the last chunk, that every leased
page received every token prefill sent up to its end, and that decode's prefix is not past the request.
A pool's record is one token interval and one row of buffers per chunk (``TokenCover``): a chunk's check is
a few numpy calls per pool, with no loop over buffers or tokens, and the record holds chunks x buffers bools
whatever the request's length.
"""

from __future__ import annotations

import numpy as np

from kvferry.control.core.prefill_requests import ChunkSpec, PrefillRequest, note_request_end
from kvferry.errors import PlanError
from kvferry.layout.spec import Layout
from kvferry.plan.prefix import prefix_past_request
from kvferry.plan.tokens import PageSizePlanner, TokenSpan

__all__ = ["TokenCover", "chunk_spans", "cover_tokens"]


def chunk_spans(planner: PageSizePlanner, rec: PrefillRequest, spec: ChunkSpec) -> dict[str, TokenSpan] | None:
    """``spec``'s spans into ``rec``'s lease past decode's prefix (``PageSizePlanner.spans``), or None for a
    chunk wholly inside the prefix that is not the last (nothing to post). Records how far the request's
    tokens reach (``rec.request_pages``: per pool, the end in prefill pages) and on the last chunk refuses
    a prefix past the request."""
    note_request_end(rec, spec)
    if spec.last:
        for pool, held in rec.prefix.items():
            ts, td = planner.page_tokens(pool)
            if held * td > rec.request_pages.get(pool, 0) * ts:
                raise prefix_past_request(rec.request_id, pool, held, -(-rec.request_pages.get(pool, 0) * ts // td))
    spans = planner.spans(spec.src, spec.offsets, rec.dst, rec.prefix, rec.request_id)
    if not spec.last and not spans:
        return None
    return spans


def cover_tokens(layout: Layout, planner: PageSizePlanner, rec: PrefillRequest, spec: ChunkSpec,
                 spans: dict[str, TokenSpan]) -> None:
    """Record the tokens of decode's lease ``spans`` write (per pool: the chunk's interval and the buffers it
    writes), ``PlanError`` for a token a buffer already received; on the last chunk, for a leased page that
    did not receive every token prefill sent (``rec.request_pages``) up to its end."""
    for pool, span in spans.items():
        assert span.start is not None and span.stop is not None
        if span.stop > span.start:
            cov = _coverage(layout, rec, pool)
            cov.add(layout, rec, pool, span, planner.page_tokens(pool)[1], _rows(layout, pool, spec.buffer_ids))
    if spec.last:
        _check_covered(layout, planner, rec)


class TokenCover:
    """One pool's writes of a request: chunk ``i`` wrote lease tokens ``[starts[i], stops[i])`` (counted from
    decode's first leased token) in the buffers ``rows[i]`` marks. A chunk's check and record are a few numpy
    calls over the chunks so far; as a token written twice is refused, a buffer's intervals are disjoint and
    the tokens it received are the sum of their lengths."""

    __slots__ = ("count", "rows", "starts", "stops")

    def __init__(self, buffers: int) -> None:
        self.count = 0
        self.starts = np.zeros(8, dtype=np.int64)
        self.stops = np.zeros(8, dtype=np.int64)
        self.rows = np.zeros((8, buffers), dtype=bool)

    def add(self, layout: Layout, rec: PrefillRequest, pool: str, span: TokenSpan, td: int, rows: np.ndarray) -> None:
        """Record ``span`` written in ``rows``, or ``PlanError`` naming the first buffer it would write twice
        (``td``: decode's tokens per page, to name the page)."""
        assert span.start is not None and span.stop is not None
        lo, hi, n = span.start - span.dst_first, span.stop - span.dst_first, self.count
        clash = (self.starts[:n] < hi) & (self.stops[:n] > lo) & (self.rows[:n] & rows).any(axis=1)
        if clash.any():
            i = int(np.argmax(clash))
            buf = layout.pool(pool).buffers[int(np.argmax(self.rows[i] & rows))].name
            token = max(lo, int(self.starts[i]))
            first = span.dst_first
            raise PlanError(f"request {rec.request_id!r}, pool {pool!r}, buffer {buf!r}: a chunk writes tokens "
                            f"[{span.start}, {span.stop}) of the request but an earlier chunk wrote "
                            f"[{first + int(self.starts[i])}, {first + int(self.stops[i])}): destination page "
                            f"{int(rec.dst[pool][token // td])} would receive token {first + token} twice")
        if n == len(self.starts):
            self.starts, self.stops = np.resize(self.starts, 2 * n), np.resize(self.stops, 2 * n)
            self.rows = np.concatenate([self.rows, np.zeros_like(self.rows)])
        self.starts[n], self.stops[n], self.rows[n] = lo, hi, rows
        self.count = n + 1

    def written(self, need: int) -> np.ndarray:
        """Per buffer, how many of the lease's first ``need`` tokens it received."""
        n = self.count
        lengths = np.clip(self.stops[:n], 0, need) - np.clip(self.starts[:n], 0, need)
        return lengths @ self.rows[:n]

    def first_gap(self, b: int, need: int) -> int:
        """The first of the lease's first ``need`` tokens buffer ``b`` did not receive (``need`` if none)."""
        mine = self.rows[: self.count, b]
        starts, stops = self.starts[: self.count][mine], self.stops[: self.count][mine]
        order = np.argsort(starts, kind="stable")
        # sorted and disjoint: a gap begins where an interval (or the lease) ends before the next one starts
        ends = np.concatenate([[0], stops[order]])
        gaps = np.flatnonzero((np.concatenate([starts[order], [need]]) > ends) & (ends < need))
        return int(ends[gaps[0]]) if len(gaps) else need


def _coverage(layout: Layout, rec: PrefillRequest, pool: str) -> TokenCover:
    cov = rec.coverage.get(pool)
    if cov is None:
        cov = rec.coverage[pool] = TokenCover(len(layout.pool(pool).buffers))
    assert isinstance(cov, TokenCover)
    return cov


def _rows(layout: Layout, pool: str, buffer_ids: np.ndarray | None) -> np.ndarray:
    """The pool's buffers a chunk writes, as a mask (``buffer_ids``: indices into ``layout.buffers``)."""
    first = 0
    for p in layout.pools:   # a few pools: where this pool's buffers begin in the layout's list
        if p.name == pool:
            break
        first += len(p.buffers)
    n = len(layout.pool(pool).buffers)
    if buffer_ids is None:
        return np.ones(n, dtype=bool)
    mine = buffer_ids[(buffer_ids >= first) & (buffer_ids < first + n)] - first
    rows = np.zeros(n, dtype=bool)
    rows[mine] = True
    return rows


def _check_covered(layout: Layout, planner: PageSizePlanner, rec: PrefillRequest) -> None:
    """Every leased token up to the end of what prefill sent is written, and every leased page got some."""
    for pool, dst in rec.dst.items():
        ts, td = planner.page_tokens(pool)
        first = rec.prefix.get(pool, 0) * td
        sent = rec.request_pages.get(pool, 0) * ts - first     # tokens prefill has past the prefix
        leased = len(dst) * td
        need = min(leased, max(sent, 0))
        cov = rec.coverage.get(pool) or TokenCover(len(layout.pool(pool).buffers))
        short = cov.written(need) < need
        if need <= leased - td or short.any():
            b = int(np.argmax(short))
            # a gap, or else the first leased page prefill's tokens never reached
            token = cov.first_gap(b, need) if short[b] else -(-need // td) * td
            buf = layout.pool(pool).buffers[b].name
            raise PlanError(f"request {rec.request_id!r}: last chunk sent but pool {pool!r}, buffer {buf!r}, "
                            f"destination page {int(dst[token // td])} was never written in full (token "
                            f"{first + token} of the request missing; prefill sent {rec.request_pages.get(pool, 0)} "
                            f"pages of {ts} tokens, decode leased {len(dst)} pages of {td} past a prefix of "
                            f"{rec.prefix.get(pool, 0)})")
