"""Diagnostics: which bytes are wrong, where they came from, and whether it matters to the model.

Part of the diagnostics layer, above ``integrity`` and ``plan``, below ``render`` and the CLI. Three tools,
for humans and for tests, none on a hot path:

- ``diff_pages``: a byte-for-byte comparison of a request's pages on both sides, classifying each
  differing destination page as ``zeros`` (never written), ``misplaced`` (holds another source page of the
  request: which buffer, which page, and where that page was meant to go) or ``partial`` (first and last
  differing byte, and how many differ).
- ``indexer_topk_jaccard``: decode sparse-attention indexer keys from both copies and compare the top-k
  tokens a query selects (1.0 when clean): the model-level symptom of a corrupted index-K buffer.
- ``plan_dump``: every row of a plan traced back to pool, buffer, layer, pages and byte ranges.

Rendering to rich tables lives in ``render``; this module imports no terminal code.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from kvferry.errors import LayoutError
from kvferry.integrity.digests import hash_pages
from kvferry.layout.memory import KVMemory
from kvferry.plan.planner import PagesArg, PoolPlan, TransferPlan, plan_transfer

__all__ = ["DiffReport", "PageDiff", "decode_index_keys", "diff_pages", "fp8_e4m3_table", "indexer_topk_jaccard",
           "plan_dump"]

DIFF_KINDS = ("zeros", "misplaced", "partial")


@dataclass(frozen=True, slots=True)
class PageDiff:
    """One destination page that differs from its source page.

    ``kind`` is ``zeros``, ``misplaced`` or ``partial``. For ``misplaced``, ``found_buffer`` and
    ``found_src_page`` name the source page the destination holds instead, and ``found_dst_page`` where
    that page should have gone (-1 when it was not meant for any page of this request).
    ``first_byte``/``last_byte``/``num_bytes`` locate the differing bytes (all kinds).
    """

    pool: str
    buffer: str
    layer: int | None
    src_page: int
    dst_page: int
    kind: str
    first_byte: int
    last_byte: int
    num_bytes: int
    page_bytes: int
    found_buffer: str | None = None
    found_src_page: int = -1
    found_dst_page: int = -1

    def describe(self) -> str:
        if self.kind == "zeros":
            return "all zeros (never written?)"
        if self.kind == "misplaced":
            dest = f", meant for dst page {self.found_dst_page}" if self.found_dst_page >= 0 else ""
            return f"holds src page {self.found_src_page} of {self.found_buffer}{dest}"
        return f"{self.num_bytes}/{self.page_bytes} bytes differ in [{self.first_byte}, {self.last_byte}]"


@dataclass(frozen=True)
class DiffReport:
    """Result of ``diff_pages``: what was compared and every page that differs, in plan order."""

    buffers_compared: tuple[str, ...]
    pages_compared: int
    bytes_compared: int
    diffs: tuple[PageDiff, ...] = field(default=())

    @property
    def clean(self) -> bool:
        return not self.diffs

    def by_buffer(self) -> dict[str, dict[str, int]]:
        """Buffer -> {kind: number of pages}, for buffers with at least one differing page."""
        out: dict[str, dict[str, int]] = {}
        for d in self.diffs:
            counts = out.setdefault(d.buffer, dict.fromkeys(DIFF_KINDS, 0))
            counts[d.kind] += 1
        return out

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (``--json``)."""
        return {"clean": self.clean, "buffers_compared": len(self.buffers_compared),
                "pages_compared": self.pages_compared, "bytes_compared": self.bytes_compared,
                "pages_differing": len(self.diffs), "by_buffer": self.by_buffer(),
                "diffs": [asdict(d) for d in self.diffs]}


# -- byte diff ---------------------------------------------------------------------------------------------
def diff_pages(src: KVMemory, dst: KVMemory, pages: PagesArg, buffers: Iterable[str] | None = None) -> DiffReport:
    """Compare ``pages`` (pool -> (source pages, destination pages)) of every buffer, byte for byte.

    Both bindings must be host memory readable here. Page lists are validated as for a plan. Costs one
    gather of each side's pages per buffer; differing pages are then looked up among all source pages of
    the request (by xxh3 digest, confirmed byte for byte) to spot misplaced ones.
    """
    plan = plan_transfer(src, dst, pages, buffers)
    raw: list[tuple[PoolPlan, int, np.ndarray, np.ndarray]] = []  # (pool, buffer id, diff rows, diff mask)
    names = src.layout.buffers
    for pool_plan in plan.pools:
        for gid in pool_plan.buffer_ids.tolist():
            rows, masks = _differing_rows(src, dst, names[gid].name, pool_plan.src_pages, pool_plan.dst_pages)
            if len(rows):
                raw.append((pool_plan, gid, rows, masks))
    finder = _SourceFinder(plan) if raw else None
    diffs = [_classify(src, dst, pool_plan, gid, int(r), m, finder)
             for pool_plan, gid, rows, masks in raw for r, m in zip(rows.tolist(), masks)]
    num_cells = sum(len(pool_plan.src_pages) * len(pool_plan.buffer_ids) for pool_plan in plan.pools)
    return DiffReport(plan.buffer_names, num_cells, plan.nbytes, tuple(diffs))


def _differing_rows(src: KVMemory, dst: KVMemory, name: str, src_pages: np.ndarray,
                    dst_pages: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Indices into the page lists whose pages differ, with their byte masks (``rows x page_bytes``)."""
    neq = src.array(name)[src_pages] != dst.array(name)[dst_pages]
    rows = np.flatnonzero(neq.any(axis=1))
    return rows, neq[rows]


def _classify(src: KVMemory, dst: KVMemory, pool_plan: PoolPlan, gid: int, row: int, mask: np.ndarray,
              finder: _SourceFinder | None) -> PageDiff:
    buf = src.layout.buffers[gid]
    s, d = int(pool_plan.src_pages[row]), int(pool_plan.dst_pages[row])
    where = np.flatnonzero(mask)
    base = dict(pool=pool_plan.pool, buffer=buf.name, layer=buf.layer, src_page=s, dst_page=d,
                first_byte=int(where[0]), last_byte=int(where[-1]), num_bytes=len(where), page_bytes=buf.page_bytes)
    page = dst.array(buf.name)[d]
    if not page.any():
        return PageDiff(kind="zeros", **base)
    found = finder.find(page, exclude=(gid, s)) if finder else None
    if found is not None:
        return PageDiff(kind="misplaced", found_buffer=found[0], found_src_page=found[1],
                        found_dst_page=found[2], **base)
    return PageDiff(kind="partial", **base)


class _SourceFinder:
    """Every source page of a request, indexed by digest, to say where a misplaced page came from."""

    def __init__(self, plan: TransferPlan) -> None:
        self._src = plan.src_memory
        self._index: dict[tuple[int, int], list[tuple[str, int, int]]] = {}
        names = self._src.layout.buffers
        for pool_plan in plan.pools:
            for gid in pool_plan.buffer_ids.tolist():
                name = names[gid].name
                digests = hash_pages(self._src, name, pool_plan.src_pages)
                for h, s, d in zip(digests.tolist(), pool_plan.src_pages.tolist(), pool_plan.dst_pages.tolist()):
                    self._index.setdefault((names[gid].page_bytes, h), []).append((name, s, d))

    def find(self, page: np.ndarray, exclude: tuple[int, int]) -> tuple[str, int, int] | None:
        """(buffer, source page, its destination page) whose bytes equal ``page``, other than ``exclude``."""
        from xxhash import xxh3_64_intdigest

        skip = (self._src.layout.buffers[exclude[0]].name, exclude[1])
        for name, s, d in self._index.get((len(page), xxh3_64_intdigest(page, 0)), []):
            if (name, s) != skip and np.array_equal(self._src.array(name)[s], page):
                return name, s, d
        return None


# -- indexer keys ------------------------------------------------------------------------------------------
def fp8_e4m3_table() -> np.ndarray:
    """float32 value of each of the 256 fp8 e4m3fn codes (bias 7, no infinities, S.1111.111 is NaN)."""
    code = np.arange(256, dtype=np.int64)
    sign = np.where(code & 0x80, -1.0, 1.0)
    exp, man = (code >> 3) & 0xF, code & 0x7
    value = np.where(exp == 0, man / 8.0 * 2.0**-6, (1 + man / 8.0) * 2.0 ** (exp - 7))
    value = np.where((exp == 0xF) & (man == 0x7), np.nan, value)
    return (sign * value).astype(np.float32)


_FP8_TABLE = fp8_e4m3_table()


def decode_index_keys(pages: np.ndarray, dtype: str = "bf16", head_dim: int = 128) -> np.ndarray:
    """Index-K pages (``P x page_bytes`` uint8) -> keys (``P * tokens_per_page x head_dim`` float32).

    ``bf16``: ``head_dim`` bf16 values per token. ``fp8``: each page holds ``head_dim`` fp8 e4m3 bytes
    per token for all its tokens, then one fp32 scale per token (132 B/token at head_dim 128): the paged
    layout vLLM's DeepSeek V3.2 indexer cache uses. Raises LayoutError when a page is not whole tokens.
    """
    token_bytes = {"bf16": 2 * head_dim, "fp8": head_dim + 4}.get(dtype)
    if token_bytes is None:
        raise LayoutError(f"indexer dtype must be 'bf16' or 'fp8', got {dtype!r}")
    num_pages, page_bytes = pages.shape
    if page_bytes % token_bytes:
        raise LayoutError(f"index-K page of {page_bytes} B is not a whole number of {dtype} keys "
                          f"({token_bytes} B each at head_dim {head_dim})")
    tokens = page_bytes // token_bytes
    if dtype == "bf16":
        bits = np.ascontiguousarray(pages).view(np.uint16).astype(np.uint32) << 16
        return bits.view(np.float32).reshape(num_pages * tokens, head_dim)
    values = _FP8_TABLE[pages[:, :tokens * head_dim]].reshape(num_pages, tokens, head_dim)
    scales = np.ascontiguousarray(pages[:, tokens * head_dim:]).view("<f4").reshape(num_pages, tokens, 1)
    return (values * scales).reshape(num_pages * tokens, head_dim)


def indexer_topk_jaccard(src: KVMemory, dst: KVMemory, pages: PagesArg, queries: np.ndarray, k: int,
                         dtype: str = "bf16", head_dim: int = 128,
                         buffers: Iterable[str] | None = None) -> dict[str, float]:
    """Per index-K buffer (kind ``index_k``), the mean over queries of |A ∩ B| / |A ∪ B|, where A and B
    are the top-``k`` token indices selected by ``keys @ query`` from the prefill and decode copies.

    ``queries`` is ``(head_dim,)`` or ``(Q, head_dim)``. Tokens run over the request's pages in request
    order, so a misplaced page moves selections just as it would in the model. Non-finite scores (from
    corrupted bytes) never win a selection. 1.0 means both sides select alike.
    """
    q = np.atleast_2d(np.asarray(queries, dtype=np.float32))
    if k < 1:
        raise LayoutError(f"top-k needs k >= 1, got {k}")
    if q.shape[1] != head_dim:
        raise LayoutError(f"queries have dimension {q.shape[1]}, expected head_dim {head_dim}")
    plan = plan_transfer(src, dst, pages, buffers)
    out: dict[str, float] = {}
    for pool_plan in plan.pools:
        for gid in pool_plan.buffer_ids.tolist():
            buf = src.layout.buffers[gid]
            if buf.kind == "index_k":
                a = _topk(decode_index_keys(src.array(buf.name)[pool_plan.src_pages], dtype, head_dim), q, k)
                b = _topk(decode_index_keys(dst.array(buf.name)[pool_plan.dst_pages], dtype, head_dim), q, k)
                out[buf.name] = float(np.mean([_jaccard(x, y) for x, y in zip(a, b)]))
    return out


def _topk(keys: np.ndarray, queries: np.ndarray, k: int) -> list[np.ndarray]:
    with np.errstate(all="ignore"):
        scores = keys @ queries.T  # tokens x queries
    scores = np.where(np.isfinite(scores), scores, -np.inf)
    k = min(k, len(keys))
    top = np.argpartition(-scores, k - 1, axis=0)[:k]
    return [top[:, j] for j in range(queries.shape[0])]


def _jaccard(a: np.ndarray, b: np.ndarray) -> float:
    union = len(np.union1d(a, b))
    return len(np.intersect1d(a, b)) / union if union else 1.0


# -- plan dump ---------------------------------------------------------------------------------------------
def plan_dump(plan: TransferPlan) -> list[dict[str, Any]]:
    """One dict per descriptor row: pool, buffer, layer, pages, and byte ranges (absolute and within the
    buffer) on both sides. Works on any ``TransferPlan``, including a ``faults.FaultyPlan``, whose rows
    show the buffer and pages they were meant for and the addresses they really hit."""
    layout, src, dst = plan.src_memory.layout, plan.src_memory, plan.dst_memory
    out = []
    for row in plan.rows():
        out.append({
            "row": row.index, "pool": row.pool, "buffer": row.buffer, "layer": layout.buffer(row.buffer).layer,
            "src_pages": [row.src_page, row.src_page + row.num_pages - 1],
            "dst_pages": [row.dst_page, row.dst_page + row.num_pages - 1],
            "nbytes": row.nbytes,
            "src_range": [row.src_addr, row.src_addr + row.nbytes],
            "dst_range": [row.dst_addr, row.dst_addr + row.nbytes],
            "src_offset": row.src_addr - src.address(row.buffer),
            "dst_offset": row.dst_addr - dst.address(row.buffer),
            "src_hits": _locate(src, row.src_addr),
            "dst_hits": _locate(dst, row.dst_addr),
        })
    return out


def _locate(memory: KVMemory, address: int) -> str:
    """``"buffer[page]"`` holding ``address`` (``"?"`` outside every region): where a row really lands."""
    for region in memory.regions:
        if region.address <= address < region.end:
            page_bytes = memory.layout.buffer(region.buffer).page_bytes
            return f"{region.buffer}[{(address - region.address) // page_bytes}]"
    return "?"
