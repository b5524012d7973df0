"""Destination-page leases: which request owns which decode pages, until no write to them can land.

Part of the protocol core (no I/O), above the plan layer's page validator, below ``core.decode``. Decode
leases its pages to a request when it announces it; the lease ends only when nothing more can be written there
(every write confirmed done, the writer confirmed its handles settled, or the writer is certainly gone and
``lease_grace`` passed since: see ``quarantine``). Reusing a page while a write to it is still in flight is
the bug this table exists to make impossible: ``acquire`` refuses, before anything moves, pages that are
out of range, repeated, or held by a live lease.

Pools that share a page space (``Pool.aliases``: vLLM's Mamba state blocks over its attention blocks, told
apart only by which group owns the block id) share one owner array: a page leased in one is taken in the
other, and one request may not name a page in both. So "no state write into an attention block" is checked
here, not only assumed from the engine's block pool.

Not thread-safe on its own: the core is mutated only under its shell's lock.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from kvferry.errors import LeaseError
from kvferry.layout.spec import Layout
from kvferry.plan.pages import validate_pages

__all__ = ["FREE", "LeaseTable"]

FREE = -1


class LeaseTable:
    """Per pool, the lease id owning each page (``FREE`` when none). One lease per request incarnation."""

    def __init__(self, layout: Layout) -> None:
        self.layout = layout
        # Sized by the pool's smallest buffer: a page must be valid in every buffer of its pool. Aliased
        # pools share their page space's array (sized for the largest of them; each pool's own bound is
        # checked by the page validator).
        space = {p.name: p.aliases or p.name for p in layout.pools}
        sizes: dict[str, int] = {}
        for p in layout.pools:
            sizes[space[p.name]] = max(sizes.get(space[p.name], 0), p.min_pages)
        arrays = {name: np.full(size, FREE, dtype=np.int64) for name, size in sizes.items()}
        self._owner = {p.name: arrays[space[p.name]] for p in layout.pools}
        self._space = space
        self._aliased = len(arrays) < len(layout.pools)
        self._leases: dict[int, tuple[str, dict[str, np.ndarray]]] = {}
        # Kept as leases come and go, so that stats() can read it from any thread without iterating.
        self._num_leased_pages = 0

    def owners(self, pool: str) -> np.ndarray:
        """The lease id owning each page of ``pool`` (``FREE`` when none): a read-only view, for checkers
        (the simulator's lease invariant) that must see exactly what the table decides by."""
        view = self._owner[pool].view()
        view.flags.writeable = False
        return view

    @property
    def num_leases(self) -> int:
        return len(self._leases)

    @property
    def num_leased_pages(self) -> int:
        return self._num_leased_pages

    def num_pages(self, lease_id: int) -> int:
        """Pages held by ``lease_id`` (0 when it holds none)."""
        entry = self._leases.get(lease_id)
        return 0 if entry is None else sum(len(p) for p in entry[1].values())

    def pages(self, lease_id: int) -> dict[str, np.ndarray]:
        """The pages ``lease_id`` holds, pool -> page array in announce order (empty when it holds none)."""
        entry = self._leases.get(lease_id)
        return {} if entry is None else entry[1]

    def holds(self, lease_id: int) -> bool:
        return lease_id in self._leases

    def acquire(self, lease_id: int, request_id: str, pages: Mapping[str, Any]) -> dict[str, np.ndarray]:
        """Lease ``pages`` (pool -> page list) to ``lease_id``; all or nothing.

        Returns the validated int64 page arrays. Raises ``LeaseError`` naming the pool, buffer, page and the
        request holding it, when a pool is unknown, a page is out of range or repeated, a page is held by
        another live lease, or no page is given at all.
        """
        if lease_id in self._leases:
            raise LeaseError(f"lease {lease_id} already exists")
        checked = self._validate(request_id, pages)
        if self._aliased:
            self._check_shared_spaces(request_id, checked)
        for pool_name, arr in checked.items():
            taken = self._owner[pool_name][arr] != FREE
            if np.logical_or.reduce(taken):   # the ufunc: flatnonzero and .any() add Python wrappers per call
                owners, busy = self._owner[pool_name][arr], taken.nonzero()[0]
                page, holder = int(arr[busy[0]]), int(owners[busy[0]])
                raise LeaseError(f"request {request_id!r}: pool {pool_name!r} page {page} is leased to live "
                                 f"request {self._leases[holder][0]!r}{self._held_in(holder, pool_name, page)} "
                                 "(a write to it may still land)")
        for pool_name, arr in checked.items():
            self._owner[pool_name][arr] = lease_id
        self._leases[lease_id] = (request_id, checked)
        self._num_leased_pages += sum(len(arr) for arr in checked.values())
        return checked

    def _check_shared_spaces(self, request_id: str, checked: Mapping[str, np.ndarray]) -> None:
        """One request's pages in pools of one page space must not repeat across them: a state block that is
        also one of the request's attention blocks would be written under two geometries."""
        first: dict[str, tuple[str, np.ndarray]] = {}
        for pool_name, arr in checked.items():
            space = self._space[pool_name]
            if space not in first:
                first[space] = (pool_name, arr)
                continue
            other, seen = first[space]
            both = np.intersect1d(seen, arr)
            if both.size:
                raise LeaseError(f"request {request_id!r}: pool {pool_name!r} page {int(both[0])} is also its "
                                 f"page in pool {other!r}, which shares that page space (pool aliases)")
            first[space] = (f"{other}+{pool_name}", np.concatenate((seen, arr)))

    def _held_in(self, holder: int, pool_name: str, page: int) -> str:
        """Where the holder leased ``page``, when in another pool of the same page space."""
        if not self._aliased:
            return ""
        for name, arr in self._leases[holder][1].items():
            if name != pool_name and self._space[name] == self._space[pool_name] and page in arr:
                return f" in pool {name!r}"
        return ""

    def release(self, lease_id: int) -> None:
        """End a lease. The caller guarantees no write to its pages can still land. Unknown ids: ignored."""
        entry = self._leases.pop(lease_id, None)
        if entry is None:
            return
        for pool_name, arr in entry[1].items():
            self._owner[pool_name][arr] = FREE
            self._num_leased_pages -= len(arr)

    def _validate(self, request_id: str, pages: Mapping[str, Any]) -> dict[str, np.ndarray]:
        if not isinstance(pages, Mapping) or not pages:
            raise LeaseError(f"request {request_id!r}: pages must be a non-empty mapping pool -> pages")
        checked = {name: arr for name, arr in validate_pages(self.layout, "destination", pages, LeaseError,
                                                               unique=True).items() if len(arr)}
        if not checked:
            raise LeaseError(f"request {request_id!r}: no pages to lease")
        return checked
