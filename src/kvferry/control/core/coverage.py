"""Coverage bookkeeping for chunked sends: which (buffer, destination page) cells a request has written.

Part of the control plane, above ``prefill_requests``, below ``prefill``; used by ``prefill`` when it posts a
chunk. A cell written twice is refused at once; on the last chunk, a cell never written is refused too, so a
chunked or layer-by-layer ``send`` cannot leave decode's pages half-filled while reporting DONE. Across TP a
cell is this rank's slice of the page, and buffers this rank does not write to that decode rank count as
written. The tables (``PrefillRequest.coverage``) are made on first use; the common case, the whole request in
one chunk, writes every cell once by construction and makes none.
"""

from __future__ import annotations

from kvferry.control.core.prefill_requests import ChunkSpec, PrefillRequest
from kvferry.errors import PlanError
from kvferry.layout.spec import Layout

__all__ = ["cover"]

# A pool's table is one Python int per buffer, bit i for destination position i: a chunk's check and mark
# are an AND and an OR per buffer. Requests are tens of pages and pools a few buffers, where each numpy call
# (a bool matrix, fancy indexing, argwhere) cost more than the whole check.


def cover(layout: Layout, rec: PrefillRequest, spec: ChunkSpec) -> None:
    """Mark the cells ``spec`` writes for ``rec`` (before ``rec.next_chunk`` counts it), or ``PlanError``
    for a cell written twice, or, on the last chunk, a cell never written."""
    if rec.next_chunk == 0 and spec.last and _is_whole(rec, spec):
        return
    session = rec.session
    assert session is not None
    for pool_name, src in spec.src.items():
        cov = _coverage(layout, rec, pool_name)
        lo = spec.offsets[pool_name]
        bits = (((1 << len(src)) - 1) << lo) & ((1 << len(rec.dst[pool_name])) - 1)   # as a slice clips
        rows = _rows(layout, pool_name, spec.buffers, session.writes(layout.pool(pool_name)).tolist())
        if any(cov[b] & bits for b in rows):
            raise PlanError(f"request {rec.request_id!r}, pool {pool_name!r}: a chunk rewrites destination "
                            "pages an earlier chunk already wrote")
        for b in rows:
            cov[b] |= bits
    if spec.last:
        _check_covered(layout, rec)


def _is_whole(rec: PrefillRequest, spec: ChunkSpec) -> bool:
    """The chunk writes every buffer of every leased page, each once (whole pages, equal TP)."""
    assert rec.session is not None
    if spec.buffers is not None or rec.session.planner is not None or spec.src.keys() != rec.dst.keys():
        return False
    return all(spec.offsets[p] == 0 and len(src) == len(rec.dst[p]) for p, src in spec.src.items())


def _coverage(layout: Layout, rec: PrefillRequest, pool_name: str) -> list[int]:
    """Per buffer of the pool, the destination positions written so far (bits); made on first use."""
    cov = rec.coverage.get(pool_name)
    if cov is None:
        assert rec.session is not None
        full = (1 << len(rec.dst[pool_name])) - 1
        # across TP: buffers another rank sends are not ours, so they count as written
        ours = rec.session.writes(layout.pool(pool_name)).tolist()
        cov = rec.coverage[pool_name] = [0 if mine else full for mine in ours]
    return cov


def _rows(layout: Layout, pool_name: str, buffers: tuple[str, ...] | None, ours: list[bool]) -> list[int]:
    """The buffers of the pool a chunk writes: those it names (None: all) that this rank writes."""
    if buffers is None:
        return [b for b, mine in enumerate(ours) if mine]
    pool = layout.pool(pool_name)
    return [b for b, (buf, mine) in enumerate(zip(pool.buffers, ours)) if mine and buf.name in buffers]


def _check_covered(layout: Layout, rec: PrefillRequest) -> None:
    """On the last chunk: every buffer of every announced page must have been written."""
    for pool_name in rec.dst:
        cov = _coverage(layout, rec, pool_name)
        full = (1 << len(rec.dst[pool_name])) - 1
        gaps = [full & ~written for written in cov]
        if any(gaps):
            b = next(i for i, gap in enumerate(gaps) if gap)   # the first missing cell, buffer by buffer
            pos = (gaps[b] & -gaps[b]).bit_length() - 1
            buf = layout.pool(pool_name).buffers[b].name
            raise PlanError(f"request {rec.request_id!r}: last chunk sent but pool {pool_name!r}, buffer "
                            f"{buf!r}, destination page {int(rec.dst[pool_name][pos])} was never written "
                            f"({sum(gap.bit_count() for gap in gaps)} cells missing)")
