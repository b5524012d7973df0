"""Tensor-parallel arithmetic: which ranks hold which heads, and which slice of a page a rank pair shares.

Part of the plan layer, below the TP planner (``plan.tp``) and the integrity layer's slice digests, above
``layout``. Prefill runs at TP size ``P``, decode at ``D``; rank ``r`` of a sharded buffer holds heads
``[r * H/tp, (r+1) * H/tp)``; replicated buffers hold the same bytes on every rank.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvferry.errors import LayoutError, PlanError
from kvferry.layout.spec import Buffer, HeadGeometry, Layout
from kvferry.layout.state import StateSection

__all__ = ["PageSlice", "replica_source", "shard_layout", "slice_of", "source_ranks", "state_slice_of"]


# -- rank arithmetic -----------------------------------------------------------------------------------
def source_ranks(dst_rank: int, src_tp: int, dst_tp: int) -> range:
    """Prefill ranks whose heads overlap decode rank ``dst_rank``'s (for any evenly divisible head count).

    Rank ``r`` of ``P`` holds the fraction ``[r/P, (r+1)/P)`` of every sharded buffer's heads; the ranks
    that overlap ``[d/D, (d+1)/D)`` are ``floor(d P / D) .. ceil((d+1) P / D) - 1``.
    """
    _check_rank("decode", dst_rank, dst_tp)
    _check_rank("prefill", 0, src_tp)
    return range(dst_rank * src_tp // dst_tp, -(-(dst_rank + 1) * src_tp // dst_tp))


def replica_source(dst_rank: int, src_tp: int, dst_tp: int) -> int:
    """The one prefill rank that writes replicated buffers to decode rank ``dst_rank``.

    ``floor(d P / D)``: the first of ``source_ranks`` (so no extra connection), and it spreads decode ranks
    evenly over prefill ranks when ``D > P``.
    """
    return source_ranks(dst_rank, src_tp, dst_tp)[0]


def _check_rank(side: str, rank: int, tp: int) -> None:
    if not (isinstance(tp, int) and tp > 0 and isinstance(rank, int) and 0 <= rank < tp):
        raise PlanError(f"{side} rank {rank!r} is not in a TP group of size {tp!r}")


# -- layouts -------------------------------------------------------------------------------------------
def shard_layout(layout: Layout, tp_size: int, tp_rank: int) -> Layout:
    """Rank ``tp_rank``'s layout when ``layout`` (holding all heads, ``tp_size`` 1) is split ``tp_size`` ways.

    Sharded buffers keep ``num_heads / tp_size`` heads (page_bytes shrinks with them); replicated buffers
    are unchanged. Raises ``LayoutError`` naming the buffer when a head count does not divide evenly, or a
    buffer has no head geometry (declare ``HeadGeometry.whole_page(page_bytes)`` for buffers every rank
    holds whole).
    """
    if layout.tp_size != 1:
        raise LayoutError(f"shard_layout takes a full (tp_size 1) layout, got tp_size {layout.tp_size}")
    pools = [p.with_buffers([_shard_buffer(b, tp_size) for b in p.buffers]) for p in layout.pools]
    return Layout(pools, tp_size, tp_rank)


def _shard_buffer(buf: Buffer, tp_size: int) -> Buffer:
    if buf.state is not None:   # sharded sections keep 1/tp_size of their channels; padding stays
        state = buf.state.resharded(tp_size)
        pad = buf.page_bytes - buf.state.extent
        return Buffer(buf.name, state.extent + pad, buf.num_pages, buf.dtype, buf.kind, buf.layer, None, state)
    h = buf.heads
    if h is None:
        raise LayoutError(f"buffer {buf.name!r} has no head geometry: cannot split it over {tp_size} ranks "
                          f"(use HeadGeometry.whole_page({buf.page_bytes}) if every rank holds it whole)")
    if h.replicated:
        return buf
    if h.num_heads % tp_size:
        raise LayoutError(f"buffer {buf.name!r}: {h.num_heads} KV heads do not divide evenly over tp_size "
                          f"{tp_size}; shard only evenly, or declare the heads replicated")
    heads = HeadGeometry(h.num_heads // tp_size, h.head_bytes, h.tokens_per_page, h.major, False, h.parts)
    return Buffer(buf.name, heads.page_bytes, buf.num_pages, buf.dtype, buf.kind, buf.layer, heads)


# -- per-pair geometry, built once -----------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class PageSlice:
    """What one buffer contributes to one pair's rows: ``num_tokens`` rows per page of ``nbytes`` each, at
    ``page * page_bytes + token * token_stride + offset`` on each side. Also what a page digest of a
    cross-TP write covers (``kvferry.integrity.digests`` slice digests): those rows, concatenated.

    A state buffer's slice is several such pieces (one per channel section it shares, ``state_slice_of``):
    then ``pieces`` holds them (each a plain slice of the same buffer) and ``nbytes`` their bytes per page;
    its digest covers the pieces' rows in order."""

    buffer_id: int
    num_tokens: int
    nbytes: int
    src_offset: int
    dst_offset: int
    src_stride: int
    dst_stride: int
    whole: bool = False  # the whole page on both sides
    pieces: tuple[PageSlice, ...] = ()

    @property
    def parts(self) -> tuple[PageSlice, ...]:
        """The plain slices the planner turns into rows: the pieces of a state slice, else this one."""
        return self.pieces or (self,)


def slice_of(sb: Buffer, db: Buffer, gid: int, r: int, d: int, ptp: int, dtp: int) -> PageSlice | None:
    """The part of buffer ``sb`` (prefill rank ``r``) that decode rank ``d`` needs, or None."""
    whole = PageSlice(gid, 1, sb.page_bytes, 0, 0, 0, 0, whole=True)
    if sb.state is not None and db.state is not None:
        if ptp == dtp and sb.page_bytes == db.page_bytes and sb.state == db.state:
            return whole if r == d else None   # one layout on both ranks: rank to rank, padding and all
        return state_slice_of(sb, db, gid, r, d, ptp, dtp)
    sh, dh = sb.heads, db.heads
    if sh is None or dh is None:  # only between equal TP sizes (model_difference), rank to rank
        return whole if r == d else None
    if sh.replicated:
        return whole if r == replica_source(d, ptp, dtp) else None
    lo, hi = max(r * sh.num_heads, d * dh.num_heads), min((r + 1) * sh.num_heads, (d + 1) * dh.num_heads)
    if lo >= hi:
        return None
    shared, hs, hd, hb = hi - lo, lo - r * sh.num_heads, lo - d * dh.num_heads, sh.head_bytes
    if shared == sh.num_heads == dh.num_heads:
        return whole  # the whole page on both sides: rows merge across page runs
    if sh.major == "head":
        t = sh.tokens_per_page
        return PageSlice(gid, 1, shared * t * hb, hs * t * hb, hd * t * hb, 0, 0)
    return PageSlice(gid, sh.tokens_per_page, shared * hb, hs * hb, hd * hb, sh.num_heads * hb, dh.num_heads * hb)


def _channel_range(sec: StateSection, rank: int) -> tuple[int, int]:
    """The model-wide channels ``[lo, hi)`` of ``sec`` that ``rank`` holds (all of them when replicated)."""
    return (rank * sec.channels, (rank + 1) * sec.channels) if sec.sharded else (0, sec.channels)


def state_slice_of(sb: Buffer, db: Buffer, gid: int, r: int, d: int, ptp: int, dtp: int) -> PageSlice | None:
    """The channels of state buffer ``sb`` (prefill rank ``r``) that decode rank ``d`` needs, section by section.

    Per section: decode rank ``d`` needs its channels (all, when replicated there); a sharded prefill section
    gives the channels it holds of those, a replicated one gives them from ``replica_source`` only, so every
    destination byte has one writer. One piece per section the pair shares, ``repeats`` rows each. None when
    the pair shares no channel."""
    assert sb.state is not None and db.state is not None
    replica = r == replica_source(d, ptp, dtp)
    pieces = []
    for ss, ds in zip(sb.state.sections, db.state.sections):
        if not ss.sharded and not replica:
            continue
        (slo, shi), (dlo, dhi) = _channel_range(ss, r), _channel_range(ds, d)
        lo, hi = max(slo, dlo), min(shi, dhi)
        if lo >= hi:
            continue
        cb = ss.channel_bytes
        pieces.append(PageSlice(gid, ss.repeats, (hi - lo) * cb, ss.offset + (lo - slo) * cb,
                                ds.offset + (lo - dlo) * cb, ss.stride, ds.stride))
    if not pieces:
        return None
    return PageSlice(gid, 1, sum(p.nbytes * p.num_tokens for p in pieces), 0, 0, 0, 0, pieces=tuple(pieces))
