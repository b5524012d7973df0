"""The prefill side of a workload run: allocate, write the pattern (the 'forward pass'), send, free.

Part of the workload layer, above ``side`` and ``faults``, below ``supervisor``. Prefill starts what decode
asks for over the router pipe, allocates its own pages, fills them with ``sim``'s pattern and hands them to a
``PrefillEndpoint`` (``PrefillLink``), under the fault ``faults`` injects when the config names one.

With ``reuse_prefix`` decode's "start" says how many leading pages per pool it already holds. Prefill still
computes (fills) and offers the whole request on even schedule indices, and sends only the rest, from
``offset=`` that prefix, on odd ones: kvferry must skip the prefix either way.
"""

from __future__ import annotations

import time
from collections import deque
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from kvferry.errors import KVFerryError, PeerLost, RequestFailed
from kvferry.layout.memory import KVMemory
from kvferry.workload.config import WorkloadConfig
from kvferry.workload.faults import FaultyTransport
from kvferry.workload.side import IDLE_S, PROGRESS_S, Live, Side, check_state, endpoint_options
from kvferry.workload.sim import RequestSpec, fill_pages


class PrefillSide(Side):
    """Starts what decode asks for: allocate, write the pattern (the 'forward pass'), send, free when sent."""

    role = "prefill"
    seed_salt = 2
    tolerate_failed_sends = False  # the chaos soak's prefill counts a refused send (decode restarted) as failed

    def __init__(self, config: WorkloadConfig, router: Connection, parent: Connection) -> None:
        super().__init__(config, router, parent)
        self.link = PrefillLink(config, self.memory)
        self.waiting: deque[RequestSpec] = deque()
        self.sent = 0
        self.failed = 0
        self.decode_done = False
        self.holding: dict[str, dict[str, np.ndarray]] = {}   # ended, source still readable (pull mode)
        self.prefixes: dict[int, dict[str, int]] = {}  # schedule index -> decode's kept pages per pool
        self.sends = {"whole_sends": 0, "suffix_sends": 0}

    def close(self) -> None:
        self.link.close()

    def run(self) -> dict[str, Any]:
        self.router.send(("hello", self.link.address))
        while not self.stopped and not (self.decode_done and not self.waiting and not self.live):
            if not self.decode_done:
                self._read_router(block=not self.waiting and not self.live)
            progressed = self._start() + self._poll()
            self._check_stop()
            if not progressed and (self.waiting or self.live):
                time.sleep(IDLE_S)
        return {"sent": self.sent, "failed": self.failed, "abandoned": len(self.live) + len(self.waiting),
                **self.sends}

    def _read_router(self, block: bool) -> None:
        timeout = PROGRESS_S if block else 0
        while not self.decode_done and self.router.poll(timeout):
            timeout = 0
            try:
                kind, *body = self.router.recv()
            except EOFError:
                raise PeerLost("the decode side closed the router pipe before its last request") from None
            if kind == "start":
                self.waiting.append(self._spec(body[0]))
                if len(body) > 1 and body[1]:
                    self.prefixes[body[0]] = body[1]
            elif kind == "stop":
                self.decode_done = True  # nothing follows "stop"; the pipe may close any moment

    def _start(self) -> int:
        started = 0
        while self.waiting:
            spec = self.waiting[0]
            pages = self._allocate(spec)
            if pages is None:
                break  # pages come back as earlier sends complete
            self.waiting.popleft()
            prefix = self.prefixes.pop(spec.index, {})
            skip = prefix if spec.index % 2 else {}  # odd: only the suffix is computed and sent
            for name, ids, keys in self._buffers(spec, pages, skip=skip):
                fill_pages(self.views[name], ids, keys)
            try:
                self._send(spec, pages, prefix, skip)
            except KVFerryError:  # decode's announce came and failed already (it was lost or restarted)
                if not self.tolerate_failed_sends:
                    raise
                self.failed += 1
                self._free(pages)
                continue
            self.live[spec.request_id] = Live(spec, pages, time.monotonic())
            started += 1
        return started

    def _send(self, spec: RequestSpec, pages: dict[str, np.ndarray], prefix: dict[str, int],
              skip: dict[str, int]) -> None:
        """The whole request (positions from 0; kvferry skips decode's ``prefix``) or, with ``skip`` (the
        prefix), the pages after it, from that offset. Counts which, for requests with a prefix."""
        if self.config.reuse_prefix:
            self.link.check_prefix(spec.request_id, prefix)
        if skip:
            offset = {p: skip.get(p, 0) for p in pages}
            self.link.send(spec.request_id, {p: ids[offset[p]:] for p, ids in pages.items()}, offset=offset)
        else:
            self.link.send(spec.request_id, pages)
        if prefix:
            self.sends["suffix_sends" if skip else "whole_sends"] += 1

    def _spec(self, index: int) -> RequestSpec:
        """Request ``index`` of this run (both sides derive the same schedule from the seed)."""
        return self.schedule[index]

    def _poll(self) -> int:
        finished = self._release_held()
        for rid, live in list(self.live.items()):
            try:
                if not self.link.poll(rid):
                    continue
                self.sent += 1
            except RequestFailed:
                self.failed += 1
            del self.live[rid]
            if self.link.holds_source(rid):
                self.holding[rid] = live.pages  # decode may still read them (pull mode): not yet reusable
            else:
                self._free(live.pages)  # every write of it settled (DONE), or decode is done reading them
            finished += 1
        return finished

    def _release_held(self) -> int:
        """Free the pages of ended requests whose source hold has ended; returns how many."""
        ended = [rid for rid in self.holding if not self.link.holds_source(rid)]
        for rid in ended:
            self._free(self.holding.pop(rid))
        return len(ended)


class PrefillLink:
    """A ``PrefillEndpoint`` over the configured transport, wrapped by the injected fault if any."""

    def __init__(self, config: WorkloadConfig, memory: KVMemory) -> None:
        from kvferry.control import PrefillEndpoint
        from kvferry.transport import make_transport

        self.transport = make_transport(config.transport)
        wrapped = self.transport if config.inject is None else FaultyTransport(self.transport, config.inject)
        self.endpoint = PrefillEndpoint(memory, wrapped, digest_mode=config.digest_mode,
                                        options=endpoint_options(config), mode=config.mode)
        self.address = self.endpoint.address

    def send(self, request_id: str, pages: dict[str, np.ndarray], offset: dict[str, int] | None = None) -> None:
        if offset is None:
            self.endpoint.send(request_id, pages)
        else:
            self.endpoint.send(request_id, pages, offset=offset)

    def poll(self, request_id: str) -> bool:
        return check_state(self.endpoint, request_id)

    def check_prefix(self, request_id: str, prefix: dict[str, int]) -> None:
        """Where decode's announce arrived already: the prefix it carried must be the one decode's "start"
        named (the router and the wire are two channels; a mismatch means one of them is wrong)."""
        seen = self.endpoint.decode_prefix(request_id)
        if seen is not None and dict(seen) != prefix:
            raise KVFerryError(f"request {request_id!r}: decode announced a prefix of {dict(seen)} pages, its "
                               f"start message said {prefix}")

    def holds_source(self, request_id: str) -> bool:
        """Whether the request's source pages may still be read (a write in flight, or pull mode's hold)."""
        return self.endpoint.holds_source(request_id)

    def close(self) -> None:
        self.endpoint.close()
        self.transport.close()  # the endpoint closes only transports it created
