"""Decode-side prefixes at the edge: how many leading pages of a request decode already holds, per pool.

Part of the plan layer, beside ``pages`` (above ``layout``). A multi-turn session's decode keeps a prefix
cache, so turn k needs only the KV of the tokens decode has not seen. ``announce(..., prefix=...)`` states
that prefix: a token count (each pool with ``tokens_per_page`` turns it into pages and refuses a count that
is not whole pages; state-slot pools, ``tokens_per_page`` None, always move whole) or pages per pool. The
destination pages announced are those of the rest only; prefill's page positions stay positions in the
whole request, and the positions before the prefix are skipped (``split_prefix``).

Two validators: ``prefix_pages`` for a caller's argument (``UsageError``) and ``check_prefix`` for what a
peer sent (``PlanError``: untrusted input), each naming the pool, the side and the values.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from kvferry.errors import KVFerryError, PlanError, UsageError
from kvferry.layout.spec import Layout

__all__ = ["MAX_PREFIX_PAGES", "Prefix", "check_prefix", "prefix_pages", "prefix_past_request", "split_prefix"]

Prefix = dict[str, int]            # pool -> leading pages of the request decode already holds
MAX_PREFIX_PAGES = 1 << 40         # far above any real request, far below int64 overflow in offsets


def prefix_pages(layout: Layout, pools: Any, prefix: int | Mapping[str, int] | None) -> Prefix:
    """The prefix of an announce over ``pools`` (the pools it leases pages in), as pages per pool with
    zeros left out; ``UsageError`` naming the pool for a token count that is not whole pages, an unknown
    pool, or a negative or non-integer value."""
    if prefix is None:
        return {}
    if isinstance(prefix, Mapping):
        return _checked({str(p): n for p, n in prefix.items()}, layout, UsageError, "decode's announce")
    tokens = _count("prefix", "tokens", prefix, UsageError)
    out: Prefix = {}
    known = {p.name: p for p in layout.pools}
    for name in pools:
        pool = known.get(name)
        per_page = None if pool is None else pool.tokens_per_page  # an unknown pool: the lease refuses it
        if per_page is None or tokens == 0:
            continue  # request-scoped state slots hold the latest state: they move whole every time
        if tokens % per_page:
            raise UsageError(f"pool {name!r}: a prefix of {tokens} tokens is not whole pages of {per_page} "
                             f"tokens ({tokens // per_page} pages and {tokens % per_page} tokens); pass the "
                             "pages per pool instead where a pool holds a partial page")
        out[name] = tokens // per_page
    return out


def check_prefix(layout: Layout, prefix: Mapping[str, int], side: str) -> Prefix:
    """A peer's prefix (decoded from the wire) against ``layout``, or ``PlanError`` naming ``side``."""
    return _checked(dict(prefix), layout, PlanError, side)


def _checked(prefix: Mapping[str, Any], layout: Layout, error: type[KVFerryError], side: str) -> Prefix:
    out: Prefix = {}
    known = {p.name: p for p in layout.pools}
    for name, value in prefix.items():
        if name not in known:
            raise error(f"{side}: prefix names pool {name!r}, which the layout does not have "
                        f"(pools: {', '.join(known)})")
        pages = _count(f"{side}: pool {name!r}: prefix", "pages", value, error)
        if known[name].tokens_per_page is None and pages:
            raise error(f"{side}: pool {name!r} holds request-scoped state slots, which move whole; "
                        f"a prefix of {pages} pages there means nothing")
        if pages:
            out[name] = pages
    return out


def _count(what: str, unit: str, value: Any, error: type[KVFerryError]) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise error(f"{what} must be a whole number of {unit}, got {value!r}")
    if not 0 <= int(value) <= MAX_PREFIX_PAGES:
        raise error(f"{what} must be between 0 and {MAX_PREFIX_PAGES} {unit}, got {int(value)}")
    return int(value)


def split_prefix(src: np.ndarray, offset: int, prefix: int) -> tuple[np.ndarray, int]:
    """The part of a chunk (source pages at request positions ``offset ..``) past decode's ``prefix``
    pages, and its position in decode's announced pages (which start after the prefix). A chunk wholly
    inside the prefix gives no pages."""
    if prefix <= offset:
        return src, offset - prefix
    skip = min(prefix - offset, len(src))
    return src[skip:], 0


def prefix_past_request(request_id: str, pool: str, prefix: int, num_pages: int) -> PlanError:
    """The refusal when decode claims a prefix longer than the request prefill sent."""
    return PlanError(f"request {request_id!r}, pool {pool!r}: decode claims a prefix of {prefix} pages but "
                     f"prefill's request has {num_pages} pages in that pool")
