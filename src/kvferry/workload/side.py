"""What both sides of a workload run share: memory, allocators, the schedule, the pipes, a stop check.

Part of the workload layer, above ``config`` and ``sim``, below ``decode`` and ``prefill`` (which build on
the ``Side`` here). Also the pieces both sides' endpoint links need: the endpoint options a
config implies, and ``check_state``, which turns an endpoint's request state into done / in flight /
``RequestFailed``.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from kvferry.errors import KVFerryError, RequestFailed, TransferTimeout
from kvferry.layout.memory import KVMemory
from kvferry.workload.config import WorkloadConfig
from kvferry.workload.sim import PageAllocator, RequestSpec, build_schedule, page_keys, pages_needed

IDLE_S = 200e-6      # sleep when a loop iteration did nothing: keeps two busy sides off one core's back
PROGRESS_S = 0.1     # progress messages to the parent, and the router's blocking read


@dataclass
class Live:
    """A request one side is working on: its spec, its pages on this side, when it started."""

    spec: RequestSpec
    pages: dict[str, np.ndarray]
    started: float


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

    def _allocate(self, spec: RequestSpec) -> dict[str, np.ndarray] | None:
        """This request's pages on this side, or None (nothing taken) when a pool is short."""
        need = {p: n for p, n in pages_needed(self.layout, spec.num_tokens).items() if n}
        if not all(self.allocators[p].can_allocate(n) for p, n in need.items()):
            return None
        return {p: self.allocators[p].allocate(n) for p, n in need.items()}

    def _free(self, pages: dict[str, np.ndarray]) -> None:
        for pool, ids in pages.items():
            self.allocators[pool].free(ids)

    def _buffers(self, spec: RequestSpec, pages: dict[str, np.ndarray]) -> Iterator[tuple[str, np.ndarray, np.ndarray]]:
        """(buffer, its pages, their expected keys) for every buffer of every pool the request has pages in."""
        for pool, ids in pages.items():
            names = [b.name for b in self.layout.pool(pool).buffers]
            keys = page_keys(self.config.workload.seed, spec.index, self.pool_buffer_ids[pool], len(ids))
            for name, row in zip(names, keys):
                yield name, ids, row

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
