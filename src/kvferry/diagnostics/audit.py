"""Layout audit and sizing: per-buffer geometry, bytes per token, and warnings for risky layouts.

Part of the diagnostics layer: reads a ``Layout`` (never memory) and returns frozen reports with plain
fields, which the CLI renders as tables or JSON (``to_dict``). The warnings name the layouts that invite
the buffer-0 mistake: a sender that derives every buffer's slot count or stride from the first buffer of
a pool writes index-K pages to the wrong addresses when the pool's buffers differ.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import asdict, dataclass

from kvferry.errors import LayoutError
from kvferry.layout.spec import Buffer, Layout, Pool
from kvferry.layout.state import StateGeometry

__all__ = ["AuditReport", "BufferRow", "PoolSizing", "RoleRow", "SizingReport", "audit", "buffer_role",
           "describe_state", "sizing"]

# A layer tag as a whole dot-separated component: "L12" in "c4.kv.L12" or "L12.k".
_LAYER_TAG = re.compile(r"(?<![^.])L\d+(?![^.])")


def buffer_role(name: str) -> str:
    """The buffer's name with its layer tag replaced by ``*``: ``c4.kv.L12`` -> ``c4.kv.*``."""
    return _LAYER_TAG.sub("*", name)


@dataclass(frozen=True, slots=True)
class BufferRow:
    """One buffer's geometry. ``bytes_per_token`` is None in state pools (no tokens per page)."""

    pool: str
    buffer: str
    kind: str
    dtype: str
    layer: int | None
    page_bytes: int
    num_pages: int
    bytes_per_token: float | None
    total_bytes: int


@dataclass(frozen=True, slots=True)
class RoleRow:
    """Buffers of one pool that share a role and a geometry, collapsed across their layers."""

    pool: str
    role: str
    kind: str
    dtype: str
    layers: tuple[int, ...]
    num_buffers: int
    page_bytes: int
    num_pages: int
    bytes_per_token: float | None
    total_bytes: int


@dataclass(frozen=True, slots=True)
class StatePool:
    """A per-request state pool (Mamba/GDN conv and SSM state): what one request holds in it, whatever its
    length (one slot of every buffer), and how many slots it has (its fewest-page buffer's)."""

    pool: str
    bytes_per_request: int
    slots: int
    # per role of its buffers with channel sections (``Buffer.state``): how a page is cut across TP ranks
    # (``describe_state``), in first-seen order; a role without sections moves whole, between equal TP only
    cut: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True, slots=True)
class AuditReport:
    """What ``audit`` found: a row per buffer (layout order), the same collapsed by role, warnings, and
    the state pools' bytes per request."""

    rows: tuple[BufferRow, ...]
    roles: tuple[RoleRow, ...]
    warnings: tuple[str, ...]
    total_bytes: int
    shape_fingerprint: str
    state_pools: tuple[StatePool, ...] = ()

    def to_dict(self) -> dict[str, object]:
        """Plain JSON-ready data (lists, dicts, numbers, strings)."""
        return {
            "shape_fingerprint": self.shape_fingerprint,
            "total_bytes": self.total_bytes,
            "buffers": [asdict(r) for r in self.rows],
            "roles": [{**asdict(r), "layers": list(r.layers)} for r in self.roles],
            "warnings": list(self.warnings),
            "state_pools": [asdict(sp) for sp in self.state_pools],
        }


def audit(layout: Layout) -> AuditReport:
    """Describe every buffer of ``layout`` and warn where pool buffers differ in page count or size."""
    rows = tuple(_row(pool, buf) for pool in layout.pools for buf in pool.buffers)
    warnings = tuple(w for pool in layout.pools for w in _pool_warnings(pool))
    states = tuple(StatePool(pool.name, sum(b.page_bytes for b in pool.buffers), pool.min_pages, _state_cut(pool))
                   for pool in layout.pools if pool.tokens_per_page is None)
    return AuditReport(rows, _collapse(rows), warnings, layout.nbytes, layout.shape_fingerprint, states)


def _state_cut(pool: Pool) -> tuple[tuple[str, str], ...]:
    cut: dict[str, str] = {}
    for buf in pool.buffers:
        if buf.state is not None:
            cut.setdefault(buffer_role(buf.name), describe_state(buf.state))
    return tuple(cut.items())


def describe_state(state: StateGeometry) -> str:
    """A state page's channel sections in one line, each part's sections between brackets: ``[2048 | 2048 |
    4096] channels x 6 B, each sharded`` (a part of several rows: ``3 rows of [...]``; a replicated section
    marked ``=``, the same on every rank)."""
    out = []
    for repeats, secs in _parts(state):
        units = {b for _, b, _ in secs}
        inner = " | ".join(f"{c}{'' if sh else '='}" for c, _, sh in secs)
        unit = f"{units.pop()} B" if len(units) == 1 else "/".join(f"{b} B" for _, b, _ in secs)
        rows = f"{repeats} rows of " if repeats > 1 else ""
        out.append(f"{rows}[{inner}] channels x {unit}")
    if all(s.sharded for s in state.sections):
        return f"{'; '.join(out)}, each sharded"
    return f"{'; '.join(out)}, each sharded but those marked = (replicated)"


def _parts(state: StateGeometry) -> list[tuple[int, list[tuple[int, int, bool]]]]:
    try:
        return state.parts()
    except LayoutError:   # not packed: each section on its own
        return [(s.repeats, [(s.channels, s.channel_bytes, s.sharded)]) for s in state.sections]


def _row(pool: Pool, buf: Buffer) -> BufferRow:
    per_token = None if pool.tokens_per_page is None else buf.page_bytes / pool.tokens_per_page
    return BufferRow(pool.name, buf.name, buf.kind, buf.dtype, buf.layer, buf.page_bytes, buf.num_pages,
                     per_token, buf.nbytes)


def _collapse(rows: Iterable[BufferRow]) -> tuple[RoleRow, ...]:
    # Keyed by everything but the layer, in first-seen order, so a role whose layers differ in geometry
    # stays split into one row per distinct geometry.
    groups: dict[tuple[object, ...], list[BufferRow]] = {}
    for r in rows:
        key = (r.pool, buffer_role(r.buffer), r.kind, r.dtype, r.page_bytes, r.num_pages, r.bytes_per_token)
        groups.setdefault(key, []).append(r)
    return tuple(
        RoleRow(pool, role, kind, dtype, tuple(r.layer for r in members if r.layer is not None), len(members),
                page_bytes, num_pages, per_token, sum(r.total_bytes for r in members))
        for (pool, role, kind, dtype, page_bytes, num_pages, per_token), members in groups.items()
    )


def _pool_warnings(pool: Pool) -> list[str]:
    warnings = []
    if not pool.uniform_pages:
        warnings.append(
            f"pool {pool.name}: buffers differ in page count ({_by_role(pool, 'num_pages')}) — a sender that "
            f"computes slot counts from buffer 0 ({pool.buffers[0].name}) will write the wrong addresses")
    if len({b.page_bytes for b in pool.buffers}) > 1:
        warnings.append(
            f"pool {pool.name}: buffers differ in page_bytes ({_by_role(pool, 'page_bytes')}) — each buffer "
            f"needs its own stride; one item length for the whole pool addresses the others wrongly")
    return warnings


def _by_role(pool: Pool, attr: str) -> str:
    """``c4.kv.*: 20000, c4.idx.*: 10000``; a role whose layers disagree shows its range ``lo..hi``."""
    values: dict[str, set[int]] = {}
    for buf in pool.buffers:
        values.setdefault(buffer_role(buf.name), set()).add(getattr(buf, attr))
    return ", ".join(f"{role}: {_span(v)}" for role, v in values.items())


def _span(values: set[int]) -> str:
    lo, hi = min(values), max(values)
    return str(lo) if lo == hi else f"{lo}..{hi}"


# -- sizing ------------------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class PoolSizing:
    """What ``tokens`` tokens of one request need in one pool, and how many such requests fit.

    ``bytes_per_token`` sums the pool's buffers (None for state pools). ``pages_needed`` is
    ``ceil(tokens / tokens_per_page)``, or 1 slot in a state pool; ``bytes_needed`` is those pages in
    every buffer. ``capacity_pages`` is the smallest buffer's page count (the bound every page index
    must respect) and ``requests_that_fit`` is ``capacity_pages // pages_needed``.
    """

    pool: str
    tokens_per_page: int | None
    num_buffers: int
    bytes_per_token: float | None
    bytes_per_page: int
    pages_needed: int
    bytes_needed: int
    capacity_pages: int
    requests_that_fit: int


@dataclass(frozen=True, slots=True)
class SizingReport:
    """Per-pool sizing of one request of ``tokens`` tokens; totals across pools."""

    tokens: int
    pools: tuple[PoolSizing, ...]
    bytes_needed: int
    requests_that_fit: int

    def to_dict(self) -> dict[str, object]:
        return {"tokens": self.tokens, "bytes_needed": self.bytes_needed,
                "requests_that_fit": self.requests_that_fit, "pools": [asdict(p) for p in self.pools]}


def sizing(layout: Layout, tokens: int) -> SizingReport:
    """Pages and bytes a request of ``tokens`` tokens needs in each pool of ``layout``.

    Counts every pool in full: a sliding-window pool is sized as if it kept the whole context, an upper
    bound on what an engine that frees out-of-window pages needs. Raises LayoutError if ``tokens < 1``.
    """
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1:
        raise LayoutError(f"sizing: tokens must be an int >= 1, got {tokens!r}")
    pools = tuple(_pool_sizing(pool, tokens) for pool in layout.pools)
    return SizingReport(tokens, pools, sum(p.bytes_needed for p in pools),
                        min(p.requests_that_fit for p in pools))


def _pool_sizing(pool: Pool, tokens: int) -> PoolSizing:
    page_bytes = sum(b.page_bytes for b in pool.buffers)
    tpp = pool.tokens_per_page
    pages = 1 if tpp is None else -(-tokens // tpp)
    per_token = None if tpp is None else page_bytes / tpp
    return PoolSizing(pool.name, tpp, len(pool.buffers), per_token, page_bytes, pages, pages * page_bytes,
                      pool.min_pages, pool.min_pages // pages)
