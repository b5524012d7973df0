"""Tensor-parallel groups in the simulator: each seed's (prefill TP, decode TP), the ranks' layouts, the
content of every rank's head slice, byte-exact provenance, and the decode group's engine.

Part of ``simulation``, below the nodes and ``cluster``, above ``world``. A deployment is ``SimConfig.prefills``
prefill groups and ``SimConfig.decodes`` decode groups; each group runs ``tp`` ranks, and each rank is a node
of its own (own core, memory, transport agent, process identity: a real deployment's ranks are separate
processes, so faults hit them one at a time). A decode rank connects to the prefill ranks it needs
(``plan.ranks.source_ranks``) and announces each request to exactly those; across TP sizes the prefill
cores plan through the real ``TPPlanner`` (their sessions' planners).

Content: a request's page ``pos`` of buffer ``b`` is one array of bytes of the *whole* model (every head),
``(index + start) % 251 + 1`` with ``index`` the byte's place in the canonical ``[head][token][bytes]`` order
and ``start`` a function of the request id, the position and the buffer. A rank holds its heads' bytes in its
own order (``[head][token][bytes]`` or ``[token][head][bytes]``), so a slice of the wrong head, the wrong rank
or at the wrong offset differs from what decode's rank must hold (two heads' bytes differ by a constant that
is never a multiple of 251). Without head geometry (TP 1 on both sides) the index is the page's own byte
order (the content the simulator gave before TP groups).

State: seeds at other TP pairs also have a state pool (``STATE_POOL``: one slot per request, no tokens) whose
two buffers are cut by channel sections (``layout.state``): a Mamba2-like conv state stored window-major,
``[x | B | C]`` with B and C the same on every rank, beside its SSM heads, and a GDN-like ``[q | k | v]``
conv, each sub-block sharded on its own, beside its recurrent state. A state byte's index is its place in
the whole model's (TP 1) page, so a rank's channels put at another rank's place differ from what decode holds.
"""

from __future__ import annotations

import random
import zlib
from collections.abc import Mapping, Sequence
from functools import lru_cache
from typing import TYPE_CHECKING, Any

import numpy as np

from kvferry.layout.memory import KVMemory
from kvferry.layout.spec import Buffer, HeadGeometry, Layout, Pool
from kvferry.layout.state import StateGeometry
from kvferry.plan.ranks import shard_layout, source_ranks
from kvferry.simulation.config import page_layout, sim_layout

if TYPE_CHECKING:
    from kvferry.simulation.decode_node import DecodeNode

__all__ = ["STATE_POOL", "TP_PAIRS", "TP_SIZES", "WIDE_PAIRS", "DecodeGroup", "SliceProvenance", "all_are",
           "draw_state", "draw_tp", "fill_content", "needed_ranks", "page_content", "page_rows", "rank_layout",
           "rank_name", "token_rows"]

# The (prefill TP, decode TP) pairs every seed draws among: equal sizes (rank to rank, whole pages, pull
# allowed), decode wider (a prefill rank writes one request to two decode ranks: a request group) and prefill
# wider (a decode rank receives one request from two prefill ranks: two parts).
TP_PAIRS: tuple[tuple[int, int], ...] = ((1, 1), (1, 2), (2, 1), (2, 2))
TP_SIZES: tuple[int, ...] = (1, 2, 4, 8)   # what ``SimConfig.tp`` (``--tp P:D``) may set on either side
# The wide pairs a share of the seeds draws instead (``SimConfig.wide_tp``): real deployments' sizes, where a
# decode rank receives one request from up to four prefill ranks (8 -> 2), a prefill rank writes it to up to
# four decode ranks (2 -> 8, 1 -> 4), and the replicated buffers come from one prefill rank of several.
# Weights: a seed with TP 8 on a side costs about twice one at TP 4 (bench/RESULTS.md), so it is drawn half
# as often.
WIDE_PAIRS: tuple[tuple[int, int], ...] = ((4, 4), (2, 4), (4, 2), (1, 4), (4, 1),
                                           (8, 8), (8, 4), (4, 8), (2, 8), (8, 2))
_WIDE_WEIGHTS = tuple(1 if 8 in pair else 2 for pair in WIDE_PAIRS)


def draw_tp(seed: int, wide: float = 0.0) -> tuple[int, int]:
    """Seed ``seed``'s TP pair, from streams of its own: every other draw of the seed is what it was. A share
    ``wide`` of the seeds runs one of ``WIDE_PAIRS``, decided by a stream of its own, so that every other seed
    draws the pair it drew before wide pairs existed (the regression list and the figures name seeds), and a
    seed wide at one share is wide at every larger share."""
    if wide > 0.0:
        rng = random.Random(seed * 4 + (3 << 40))
        if rng.random() < wide:
            return rng.choices(WIDE_PAIRS, _WIDE_WEIGHTS)[0]
    return random.Random(seed * 4 + (2 << 40)).choice(TP_PAIRS)


def draw_state(seed: int, tp: tuple[int, int], share: float) -> bool:
    """Whether seed ``seed`` (at ``tp``) runs with the state pool: a share ``share`` of the seeds at pairs other
    than 1:1, from a stream of its own (every other draw of the seed is what it was)."""
    return tp != (1, 1) and share > 0.0 and random.Random(seed * 4 + (5 << 40)).random() < share


def head_layout(side: str, pages: int, state: bool = False) -> Layout:
    """``config.sim_layout`` with head geometry (TP 1: every head), the same page sizes and capacities:
    head-major and token-major sharded buffers, and replicated ones (an indexer's keys, an MLA-like latent);
    with ``state``, the state pool (``STATE_POOL``) beside them."""
    pools = []
    for pool in sim_layout(side, pages).pools:
        pools.append(Pool(pool.name, [_with_heads(b) for b in pool.buffers], pool.tokens_per_page))
    return Layout([*pools, _state_pool(side, pages)] if state else pools)


STATE_POOL = "s"
# The model's (TP 1) state pages, channels over all ranks: sharded counts divide by every size of TP_SIZES.
# s.L0: Mamba2-like, conv window-major (3 rows of x 16 channels, B and C 2 each, the same on every rank), then
# 8 SSM heads of 4 bytes; s.L1: GDN-like, conv [q 8 | k 8 | v 16] of 3 bytes a channel, then 8 heads of 2.
_STATE_PARTS = {
    "s.L0": [(3, [(16, 1, True), (2, 1, False), (2, 1, False)]), (1, [(8, 4, True)])],
    "s.L1": [(1, [(8, 3, True), (8, 3, True), (16, 3, True)]), (1, [(8, 2, True)])],
}


def _state_pool(side: str, pages: int) -> Pool:
    slots = pages * 5 // 8 if side == "prefill" else pages // 2
    bufs = []
    for layer, (name, parts) in enumerate(_STATE_PARTS.items()):
        geo = StateGeometry.packed(parts)
        bufs.append(Buffer(name, geo.extent, slots + layer, "f32", "state", layer, state=geo))
    return Pool(STATE_POOL, bufs)


# buffer -> (heads, major) of the whole model; None: replicated (every rank holds the whole page). 8 heads,
# so that every size of TP_SIZES shards every buffer evenly (a rank at TP 8 holds one head). A head is
# _HEAD_BYTES a token and a page keeps sim_layout's bytes, so its token rows are page_bytes / 8 (8 in the kv
# pool's buffers, 4 in c.L1). With 4 heads of 16 rows (2 in c.L1) before TP 4 and 8, seeds at TP 1 and 2
# ran the same events and verdicts as now (seeds 0..39 drawn, mutations on seeds 0..7): only the bytes of
# token-major kv.L1 differ, and no draw depends on them.
_HEADS: dict[str, tuple[int, str] | None] = {"kv.L0": (8, "head"), "idx.L0": None, "kv.L1": (8, "token"),
                                              "c.L0": None, "c.L1": (8, "head")}
_HEAD_BYTES = 1   # each head's bytes of a token row: the page's bytes are heads x tokens x 1


def _with_heads(buf: Buffer) -> Buffer:
    spec = _HEADS[buf.name]
    if spec is None:
        heads = HeadGeometry.whole_page(buf.page_bytes)
    else:
        heads = HeadGeometry(spec[0], _HEAD_BYTES, buf.page_bytes // (spec[0] * _HEAD_BYTES), spec[1])
    return Buffer(buf.name, buf.page_bytes, buf.num_pages, buf.dtype, buf.kind, buf.layer, heads)


def rank_layout(side: str, tp: tuple[int, int], rank: int, pages: int, tokens: int | None = None,
                state: bool = False) -> Layout:
    """Rank ``rank``'s layout on ``side`` of a deployment at ``tp`` (prefill TP, decode TP), with the state pool
    when ``state``. At (1, 1) the simulator's original layout (no head geometry): those seeds run as they did
    before TP groups. ``tokens``: a page-size seed's kv pool at that many tokens per page on this side (TP 1:1)."""
    if tokens is not None:
        return page_layout(side, tokens, pages)
    if tp == (1, 1):
        return sim_layout(side, pages)
    size = tp[0] if side == "prefill" else tp[1]
    return shard_layout(head_layout(side, pages, state), size, rank)


def rank_name(kind: str, group: int, rank: int, size: int) -> str:
    """A rank node's name: ``prefill0`` at TP 1 (the names single-rank runs always had), ``prefill0-r1``."""
    return f"{kind}{group}" if size == 1 else f"{kind}{group}-r{rank}"


@lru_cache(maxsize=64)
def needed_ranks(decode_rank: int, tp: tuple[int, int]) -> range:
    """The prefill ranks decode rank ``decode_rank`` needs (``source_ranks``)."""
    return source_ranks(decode_rank, tp[0], tp[1])


# -- content ------------------------------------------------------------------------------------------------
@lru_cache(maxsize=512)
def _canonical_index(page_bytes: int, heads: HeadGeometry | StateGeometry | None, tp_rank: int,
                     tp_size: int = 1) -> np.ndarray:
    """Each byte of a rank's page: its index in the whole model's ``[head][token][bytes]`` page (a state page:
    its place in the model's page, ``_state_index``)."""
    if isinstance(heads, StateGeometry):
        return _state_index(heads, tp_rank, tp_size)
    if heads is None or heads.replicated:
        return np.arange(page_bytes, dtype=np.int64)
    nh, t, hb = heads.num_heads, heads.tokens_per_page, heads.head_bytes
    glob = np.arange(tp_rank * nh, (tp_rank + 1) * nh, dtype=np.int64)
    tok, byte = np.arange(t, dtype=np.int64), np.arange(hb, dtype=np.int64)
    if heads.major == "head":   # [head][token][bytes]
        index = glob[:, None, None] * (t * hb) + tok[None, :, None] * hb + byte[None, None, :]
    else:                       # [token][head][bytes]
        index = glob[None, :, None] * (t * hb) + tok[:, None, None] * hb + byte[None, None, :]
    out = index.reshape(-1)
    out.flags.writeable = False
    return out


def _state_index(geo: StateGeometry, tp_rank: int, tp_size: int) -> np.ndarray:
    """Each byte of a rank's state page (``geo``, packed): its offset in the model's page (sharded sections'
    channels times ``tp_size``, packed), where its section, row and model-wide channel lie."""
    full = StateGeometry.packed([(rep, [(c * tp_size if sh else c, cb, sh) for c, cb, sh in secs])
                                 for rep, secs in geo.parts()])
    out = np.zeros(geo.extent, dtype=np.int64)
    for sec, whole in zip(geo.sections, full.sections):
        first = tp_rank * sec.channels if sec.sharded else 0
        rows = np.arange(sec.repeats, dtype=np.int64)[:, None]
        local = sec.offset + rows * sec.stride + np.arange(sec.row_bytes, dtype=np.int64)[None, :]
        out[local] = whole.offset + rows * whole.stride + first * sec.channel_bytes + \
            np.arange(sec.row_bytes, dtype=np.int64)[None, :]
    out.flags.writeable = False
    return out


@lru_cache(maxsize=512)
def _table(page_bytes: int, heads: HeadGeometry | StateGeometry | None, tp_rank: int,
           tp_size: int = 1) -> np.ndarray:
    """Row ``s``: a page's bytes when its start is ``s`` (one of 251), so a page is a row, not arithmetic."""
    index = _canonical_index(page_bytes, heads, tp_rank, tp_size)
    out = ((index[None, :] + np.arange(251, dtype=np.int64)[:, None]) % 251 + 1).astype(np.uint8)
    out.flags.writeable = False
    return out


@lru_cache(maxsize=4096)
def _rid_start(rid: str) -> int:
    return zlib.crc32(rid.encode()) * 7


def _starts(rid: str, first_pos: int, n: int, buffer_index: int) -> list[int]:
    # Plain ints: a few pages' starts cost less than the numpy calls that would compute them.
    c = _rid_start(rid) + buffer_index * 13
    return [(c + pos * 31) % 251 for pos in range(first_pos, first_pos + n)]


def _geometry(buf: Buffer) -> HeadGeometry | StateGeometry | None:
    return buf.state if buf.state is not None else buf.heads


def page_rows(rid: str, first_pos: int, n: int, buffer_index: int, buf: Buffer, tp_rank: int,
              tp_size: int = 1) -> np.ndarray:
    """The bytes rank ``tp_rank`` (of ``tp_size``) holds of the request's pages ``first_pos .. first_pos + n - 1``
    in ``buf`` (its layout's buffer), one row each."""
    table = _table(buf.page_bytes, _geometry(buf), tp_rank, tp_size)
    return table.take(_starts(rid, first_pos, n, buffer_index), axis=0)


def page_content(rid: str, pos: int, buffer_index: int, buf: Buffer, tp_rank: int, tp_size: int = 1) -> np.ndarray:
    """The bytes rank ``tp_rank`` holds of the request's page ``pos`` in ``buf`` (its layout's buffer)."""
    return page_rows(rid, pos, 1, buffer_index, buf, tp_rank, tp_size)[0]


def fill_content(memory: KVMemory, rid: str, pool: str, pages: np.ndarray, first_pos: int,
                 arrays: Mapping[str, np.ndarray] | None = None, by_token: bool = False) -> None:
    """Write the request's content (this rank's heads) into ``pages`` (positions ``first_pos`` on) of every
    buffer of ``pool``: what the engine's prefill computed. ``arrays``: the memory's buffer views, when the
    caller holds them (``memory.array`` makes a view per call). ``by_token``: each token's bytes a function
    of the token (``token_rows``), whatever the page size."""
    index, rank, size = memory.buffer_index, memory.layout.tp_rank, memory.layout.tp_size
    page_list = pages.tolist()
    for buf in memory.layout.pool(pool).buffers:
        view = memory.array(buf.name) if arrays is None else arrays[buf.name]
        if by_token:
            view[pages] = token_rows(rid, first_pos, len(page_list), index[buf.name], buf)[0]
            continue
        table = _table(buf.page_bytes, _geometry(buf), rank, size)
        # ``page_rows``, a page at a time: a request has a few pages, which numpy's fancy indexing costs more
        for page, start in zip(page_list, _starts(rid, first_pos, len(page_list), index[buf.name])):
            view[page] = table[start]


@lru_cache(maxsize=64)
def _token_index(heads: HeadGeometry) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Each byte of a page of ``heads`` geometry, in the page's own order: (its head, its entry, its byte)."""
    nh, t, hb = heads.num_heads, heads.tokens_per_page, heads.head_bytes
    h, e, b = np.meshgrid(np.arange(nh), np.arange(t), np.arange(hb), indexing="ij")   # [head][entry][byte]
    if heads.major == "token":
        h, e, b = (a.transpose(1, 0, 2) for a in (h, e, b))                            # [entry][head][byte]
    out = tuple(np.ascontiguousarray(a).reshape(-1).astype(np.int64) for a in (h, e, b))
    for a in out:
        a.flags.writeable = False
    return out   # type: ignore[return-value]


def token_rows(rid: str, first_pos: int, n: int, buffer_index: int, buf: Buffer) -> tuple[np.ndarray, np.ndarray]:
    """A page-size seed's content of the request's pages ``first_pos .. first_pos + n - 1`` in ``buf`` (its
    head geometry says where each token lies), one row each, and the request token each byte belongs to.
    Byte ``b`` of head ``h`` at token ``e`` is ``(h x 1009 + e x head_bytes + b + start) % 251 + 1``: a
    function of the token, not of the page, so two page sizes hold the same bytes at each token, and a
    token at the wrong place or of the wrong head differs."""
    assert buf.heads is not None
    h, e, b = _token_index(buf.heads)
    entries = buf.heads.tokens_per_page
    tokens = (np.arange(first_pos, first_pos + n, dtype=np.int64)[:, None] * entries + e[None, :])
    start = _rid_start(rid) + buffer_index * 13
    rows = ((h[None, :] * 1009 + tokens * buf.heads.head_bytes + b[None, :] + start) % 251 + 1).astype(np.uint8)
    return rows, tokens


def all_are(values: np.ndarray, value: int) -> bool:
    """Whether every element of the int64 array ``values`` is ``value``: its bytes against the value's bytes
    repeated (a few hundred elements: several times cheaper than numpy's comparison and ``any``)."""
    assert values.dtype == np.int64
    return values.tobytes() == np.int64(value).tobytes() * values.size


class SliceProvenance:
    """Per buffer and byte, the tag (``World.tag``) of the (request, generation) whose row last wrote it; -1
    never written. Page provenance cannot tell two prefill ranks' slices of one page apart; this can.
    ``World.apply`` marks the rows as they land, through the node's ``slice_tags`` (these arrays)."""

    def __init__(self, memory: KVMemory) -> None:
        layout = memory.layout
        self.tags = {b.name: np.full(b.num_pages * b.page_bytes, -1, dtype=np.int64) for b in layout.buffers}
        self.rows = {b.name: self.tags[b.name].reshape(-1, b.page_bytes) for b in layout.buffers}   # per page

    def first_other(self, buf: str, pages: np.ndarray, tag: int) -> tuple[int, int, int] | None:
        """(page, byte, tag found) of the first byte of ``pages`` not last written by ``tag``, or None."""
        rows = self.rows[buf].take(pages, axis=0)
        if all_are(rows, tag):
            return None
        bad = np.argwhere(rows != tag)
        i, byte = (int(x) for x in bad[0])
        return int(pages[i]), byte, int(rows[i, byte])


# -- the decode group's engine ------------------------------------------------------------------------------
class DecodeGroup:
    """One decode engine over its TP ranks: what it decides once for all of them. A request failed on one
    rank failed for the engine: it aborts the request on the other ranks, and when it retries, announces it
    again on every rank (the cores promise nothing across decode ranks; the engine aggregates them, as
    vLLM's scheduler aggregates its workers' finished sets)."""

    def __init__(self, ranks: Sequence[DecodeNode]) -> None:
        self.ranks = list(ranks)
        self.current: dict[str, int] = {}        # request id -> the attempt the engine is on
        self.outcomes: dict[tuple[str, int], dict[int, Any]] = {}   # (rid, attempt) -> rank -> state

    def is_stale(self, rid: str, attempt: int) -> bool:
        """An attempt the engine has moved past (a rank still waiting to announce it must not)."""
        return attempt < self.current.get(rid, 0)

    def failed(self, node: DecodeNode, rid: str, attempt: int, now: float) -> bool:
        """``node``'s attempt failed: the engine fails it on every other rank. True for the first rank to
        report it (the one that decides whether to announce it again), False after."""
        if self.is_stale(rid, attempt):
            return False
        self.current[rid] = attempt + 1
        for other in self.ranks:
            if other is not node:
                other.engine_abort(now, rid, attempt)
        return True

    def ended(self, rank: int, rid: str, attempt: int, state: Any) -> None:
        self.outcomes.setdefault((rid, attempt), {})[rank] = state

    def num_split(self) -> int:
        """Attempts DONE on some rank and FAILED on another (the engine failed them: counted, not a bug)."""
        return sum(len({s.value for s in by_rank.values()}) > 1 for by_rank in self.outcomes.values())
