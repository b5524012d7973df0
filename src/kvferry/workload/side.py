"""What both sides of a workload run share: memory, allocators, the schedule, the pipes, a stop check.

Part of the workload layer, above ``config`` and ``sim``, below ``decode`` and ``prefill`` (which build on
the ``Side`` here). Also the pieces both sides' endpoint links need: the endpoint options a
config implies, and ``check_state``, which turns an endpoint's request state into done / in flight /
``RequestFailed``.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from kvferry.errors import KVFerryError, RequestFailed, TransferTimeout
from kvferry.layout.memory import KVMemory
from kvferry.workload.config import WorkloadConfig
from kvferry.workload.reuse import expected_keys
from kvferry.workload.sim import PageAllocator, RequestSpec, build_schedule, page_keys, pages_needed

IDLE_S = 200e-6      # sleep when a loop iteration did nothing: keeps two busy sides off one core's back
PROGRESS_S = 0.1     # progress messages to the parent, and the router's blocking read


@dataclass
class Live:
    """A request one side is working on: its spec, its pages on this side, when it started.

    With ``--reuse-prefix`` on decode: ``prefix`` is how many leading pages of ``pages[pool]`` decode
    kept from the session's earlier turns (not announced, not moved), and ``writers[pool]`` the schedule
    index of the turn whose bytes each page must hold (None: this request's, every page).
    """

    spec: RequestSpec
    pages: dict[str, np.ndarray]
    started: float
    prefix: dict[str, int] = field(default_factory=dict)
    writers: dict[str, np.ndarray] | None = None

    def new_pages(self) -> dict[str, np.ndarray]:
        """The pages this request leased and received: those after the kept prefix."""
        return {pool: ids[self.prefix.get(pool, 0):] for pool, ids in self.pages.items()}


class Side:
    """What both sides share: layout, memory, allocators, schedule, pipes, a stop check.

    Subclasses set ``role`` and ``seed_salt`` (each side its own page order), and implement ``run``
    (returns the report sent to the parent) and ``close``.
    """

    role = "side"
    seed_salt = 0

    def __init__(self, config: WorkloadConfig, router: Connection, parent: Connection) -> None:
        self.config = config
        self.router = router
        self.parent = parent
        self.layout = config.layout()
        self.memory = KVMemory.allocate(self.layout)
        self.views = {b.name: self.memory.array(b.name) for b in self.layout.buffers}
        for view in self.views.values():
            view.fill(0)  # touch every page now: first-touch faults would otherwise be timed as transfers
        index = {b.name: i for i, b in enumerate(self.layout.buffers)}
        self.pool_buffer_ids = {p.name: np.array([index[b.name] for b in p.buffers]) for p in self.layout.pools}
        seed = config.workload.seed * 4 + self.seed_salt
        self.allocators = {p.name: PageAllocator(p.min_pages, seed=seed, name=f"{self.role}:{p.name}")
                           for p in self.layout.pools}
        self.schedule = build_schedule(config.workload)
        self.live: dict[str, Live] = {}
        self.stopped = False

    def __enter__(self) -> Side:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def run(self) -> dict[str, Any]:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    def _allocate(self, spec: RequestSpec, have: Mapping[str, int] | None = None) -> dict[str, np.ndarray] | None:
        """This request's pages on this side, or None (nothing taken) when a pool is short; ``have``: the
        leading pages per pool this side holds already (decode's kept prefix), not allocated again."""
        have = have or {}
        need = {p: n - have.get(p, 0) for p, n in pages_needed(self.layout, spec.num_tokens).items()}
        need = {p: n for p, n in need.items() if n}
        if not all(self.allocators[p].can_allocate(n) for p, n in need.items()):
            return None
        return {p: self.allocators[p].allocate(n) for p, n in need.items()}

    def _free(self, pages: dict[str, np.ndarray]) -> None:
        for pool, ids in pages.items():
            self.allocators[pool].free(ids)

    def _buffers(self, spec: RequestSpec, pages: dict[str, np.ndarray], *,
                 writers: Mapping[str, np.ndarray] | None = None, skip: Mapping[str, int] | None = None
                 ) -> Iterator[tuple[str, np.ndarray, np.ndarray]]:
        """(buffer, its pages, their expected keys) for every buffer of every pool the request has pages in.

        ``writers[pool]``: per page, the request whose bytes it holds (decode's kept prefix pages hold an
        earlier turn's); default: ``spec``'s, every page. ``skip[pool]``: leading pages left out (prefill
        filling only the suffix it sends)."""
        seed = self.config.workload.seed
        for pool, ids in pages.items():
            names = [b.name for b in self.layout.pool(pool).buffers]
            bids = self.pool_buffer_ids[pool]
            keys = (page_keys(seed, spec.index, bids, len(ids)) if writers is None
                    else expected_keys(seed, bids, writers[pool]))
            first = (skip or {}).get(pool, 0)
            for name, row in zip(names, keys):
                yield name, ids[first:], row[first:]

    def _check_stop(self) -> None:
        """Notice the parent's ("stop",): the run is over (deadline, the other side failed)."""
        if not self.stopped and self.parent.poll():
            self.stopped = self.parent.recv()[0] == "stop"


def recv_message(conn: Connection, kind: str, timeout: float) -> list[Any]:
    """The body of the next message on ``conn``, which must be ``kind``; bounded by ``timeout``."""
    if not conn.poll(timeout):
        raise TransferTimeout(f"no {kind!r} message from the other side within {timeout:g} s")
    got, *body = conn.recv()
    if got != kind:
        raise KVFerryError(f"expected a {kind!r} message from the other side, got {got!r}")
    return body


# -- what both sides' endpoint links share -----------------------------------------------------------------
def endpoint_options(config: WorkloadConfig) -> Any:
    from kvferry.control import EndpointOptions

    liveness: dict[str, float] = {}
    if config.peer_timeout_s is not None:
        # Four heartbeats per peer_timeout: one late heartbeat on a busy 2-core box must not kill a peer.
        default = EndpointOptions().heartbeat_interval
        liveness.update(peer_timeout=config.peer_timeout_s,
                        heartbeat_interval=min(default, config.peer_timeout_s / 4))
    if config.lease_grace_s is not None:
        liveness["lease_grace"] = config.lease_grace_s
    return EndpointOptions(request_timeout=config.request_timeout_s, **liveness)


def check_state(endpoint: Any, request_id: str) -> bool:
    """True when DONE, False while in flight; ``RequestFailed`` (reason: the error's class and message)."""
    from kvferry.control import RequestState

    state = endpoint.poll(request_id)
    if state is RequestState.FAILED:
        err = endpoint.failure(request_id)
        raise RequestFailed(request_id, f"{type(err).__name__}: {err}" if err is not None else "failed")
    return state is RequestState.DONE
