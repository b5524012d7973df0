"""Coverage bookkeeping for chunked sends: which (buffer, destination page) cells a request has written.

Part of the control plane, above ``prefill_requests``, below ``prefill``; used by ``prefill`` when it posts a
chunk. A cell written twice is refused at once; on the last chunk, a cell never written is refused too, so a
chunked or layer-by-layer ``send`` cannot leave decode's pages half-filled while reporting DONE. Across TP a
cell is this rank's slice of the page, and buffers this rank does not write to that decode rank count as
written. The tables (``PrefillRequest.coverage``) are made on first use; the common case, the whole request in
one chunk, writes every cell once by construction and makes none.
"""

from __future__ import annotations

import numpy as np

from kvferry.control.core.prefill_requests import ChunkSpec, PrefillRequest
from kvferry.errors import PlanError
from kvferry.layout.spec import Layout

__all__ = ["cover"]


def cover(layout: Layout, rec: PrefillRequest, spec: ChunkSpec) -> None:
    """Mark the cells ``spec`` writes for ``rec`` (before ``rec.next_chunk`` counts it), or ``PlanError``
    for a cell written twice, or, on the last chunk, a cell never written."""
    if rec.next_chunk == 0 and spec.last and _is_whole(rec, spec):
        return
    session = rec.session
    assert session is not None
    for pool_name, src in spec.src.items():
        cov = _coverage(layout, rec, pool_name)
        mask = _buffer_mask(layout, pool_name, spec.buffers) & session.writes(layout.pool(pool_name))
        cols = slice(spec.offsets[pool_name], spec.offsets[pool_name] + len(src))
        if cov[mask, cols].any():
            raise PlanError(f"request {rec.request_id!r}, pool {pool_name!r}: a chunk rewrites destination "
                            "pages an earlier chunk already wrote")
        cov[mask, cols] = True
    if spec.last:
        _check_covered(layout, rec)


def _is_whole(rec: PrefillRequest, spec: ChunkSpec) -> bool:
    """The chunk writes every buffer of every leased page, each once (whole pages, equal TP)."""
    assert rec.session is not None
    if spec.buffers is not None or rec.session.planner is not None or spec.src.keys() != rec.dst.keys():
        return False
    return all(spec.offsets[p] == 0 and len(src) == len(rec.dst[p]) for p, src in spec.src.items())


def _coverage(layout: Layout, rec: PrefillRequest, pool_name: str) -> np.ndarray:
    """Bool [buffers of the pool, leased pages]: cells written so far; made on first use."""
    cov = rec.coverage.get(pool_name)
    if cov is None:
        assert rec.session is not None
        pool = layout.pool(pool_name)
        cov = rec.coverage[pool_name] = np.zeros((len(pool.buffers), len(rec.dst[pool_name])), dtype=bool)
        cov[~rec.session.writes(pool)] = True  # across TP: buffers another rank sends are not ours
    return cov


def _buffer_mask(layout: Layout, pool_name: str, buffers: tuple[str, ...] | None) -> np.ndarray:
    names = [b.name for b in layout.pool(pool_name).buffers]
    if buffers is None:
        return np.ones(len(names), dtype=bool)
    return np.array([name in buffers for name in names], dtype=bool)   # np.isin sorts strings: 10x slower


def _check_covered(layout: Layout, rec: PrefillRequest) -> None:
    """On the last chunk: every buffer of every announced page must have been written."""
    for pool_name in rec.dst:
        cov = _coverage(layout, rec, pool_name)
        missing = np.argwhere(~cov)
        if len(missing):
            b, pos = (int(x) for x in missing[0])
            buf = layout.pool(pool_name).buffers[b].name
            raise PlanError(f"request {rec.request_id!r}: last chunk sent but pool {pool_name!r}, buffer "
                            f"{buf!r}, destination page {int(rec.dst[pool_name][pos])} was never written "
                            f"({len(missing)} cells missing)")
