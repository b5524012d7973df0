"""Prefill's chunks between page sizes: a chunk's token spans past decode's prefix, and their coverage.

Part of ``core.prefill`` (no I/O), above ``prefill_requests`` and ``plan.tokens``; used by ``prefill_writer``
for a session whose pools' page sizes differ from decode's (``Session.translator``). A chunk's source pages
sit at prefill page positions of the whole request, so they hold tokens ``[pos x Ts, (pos + n) x Ts)``; they
land by token in decode's leased pages, which begin past its prefix (``prefix x Td`` tokens). A decode page
may then be split between two chunks, so what equal page sizes count in destination positions is counted
here in decode's tokens: which a chunk writes (twice is refused), and on the last chunk, that every leased
page received every token prefill sent up to its end, and that decode's prefix is not past the request.
"""

from __future__ import annotations

from kvferry.control.core.prefill_requests import ChunkSpec, PrefillRequest, note_request_end
from kvferry.errors import PlanError
from kvferry.layout.spec import Layout
from kvferry.plan.prefix import prefix_past_request
from kvferry.plan.tokens import PageSizePlanner, TokenSpan

__all__ = ["chunk_spans", "cover_tokens"]


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
    """Mark the tokens of decode's lease ``spans`` write (per pool and buffer, one bit per token past the
    prefix), ``PlanError`` for a token written twice; on the last chunk, for a leased page that did not
    receive every token prefill sent (``rec.request_pages``) up to its end."""
    for pool, span in spans.items():
        assert span.start is not None and span.stop is not None
        cov = _coverage(layout, rec, pool)
        bits = ((1 << (span.stop - span.start)) - 1) << (span.start - span.dst_first)
        rows = _rows(layout, pool, spec.buffers)
        if any(cov[b] & bits for b in rows):
            raise PlanError(f"request {rec.request_id!r}, pool {pool!r}: a chunk rewrites tokens "
                            f"[{span.start}, {span.stop}) of decode's pages an earlier chunk already wrote")
        for b in rows:
            cov[b] |= bits
    if spec.last:
        _check_covered(layout, planner, rec)


def _coverage(layout: Layout, rec: PrefillRequest, pool: str) -> list[int]:
    cov = rec.coverage.get(pool)
    if cov is None:
        cov = rec.coverage[pool] = [0] * len(layout.pool(pool).buffers)
    return cov


def _rows(layout: Layout, pool: str, buffers: tuple[str, ...] | None) -> list[int]:
    bufs = layout.pool(pool).buffers
    return [b for b, buf in enumerate(bufs) if buffers is None or buf.name in buffers]


def _check_covered(layout: Layout, planner: PageSizePlanner, rec: PrefillRequest) -> None:
    """Every leased token up to the end of what prefill sent is written, and every leased page got some."""
    for pool, dst in rec.dst.items():
        ts, td = planner.page_tokens(pool)
        first = rec.prefix.get(pool, 0) * td
        sent = rec.request_pages.get(pool, 0) * ts - first     # tokens prefill has past the prefix
        leased = len(dst) * td
        need = min(leased, max(sent, 0))
        full = (1 << need) - 1
        cov = _coverage(layout, rec, pool)
        gaps = [full & ~written for written in cov]
        if need <= leased - td or any(gaps):
            b = next((i for i, gap in enumerate(gaps) if gap), 0)
            # a gap, or else the first leased page prefill's tokens never reached
            token = (gaps[b] & -gaps[b]).bit_length() - 1 if gaps[b] else -(-need // td) * td
            buf = layout.pool(pool).buffers[b].name
            raise PlanError(f"request {rec.request_id!r}: last chunk sent but pool {pool!r}, buffer {buf!r}, "
                            f"destination page {int(dst[token // td])} was never written in full (token "
                            f"{first + token} of the request missing; prefill sent {rec.request_pages.get(pool, 0)} "
                            f"pages of {ts} tokens, decode leased {len(dst)} pages of {td} past a prefix of "
                            f"{rec.prefix.get(pool, 0)})")
