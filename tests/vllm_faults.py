"""A transport that corrupts one page per write in flight, for kvferry's vLLM connector tests.

Named in ``kv_connector_extra_config={"transport": "tests.vllm_faults:first_page_flip"}``; no vLLM import, so
the adapter tests in the default suite use it too.
"""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np

from kvferry.diagnostics.faults import FaultSpec, flip_bytes
from kvferry.layout import KVMemory
from kvferry.transport import Transport, make_transport
from kvferry.workload.faults import FaultyTransport

LAYER0 = "model.layers.0.self_attn.attn"


class FirstPageFlip(FaultyTransport):
    """Inverts every byte of one page per write (the request's first block of layer 0) while the write
    reads it, and restores it after: prefill keeps its own KV intact, only decode receives bad bytes. A
    whole page, because a single flipped byte of fp32 KV can leave greedy tokens unchanged."""

    def __init__(self, inner: Transport) -> None:
        super().__init__(inner, f"flip:{LAYER0}")

    def write(self, plan: Any, peer: str, notif: bytes, label: str = "") -> Any:
        self.fault = FaultSpec.parse(f"flip:{LAYER0}:{int(plan.pools[0].dst_pages[0])}")
        return super().write(plan, peer, notif, label)

    def _flip(self, memory: KVMemory, pages: dict[str, tuple[np.ndarray, np.ndarray]]) -> list[tuple[int, int]]:
        src, dst = pages[memory.layout.pool_of[LAYER0]]
        page_bytes = memory.layout.buffer(LAYER0).page_bytes
        return flip_bytes(memory, LAYER0, src[np.isin(dst, self.fault.pages or ())].tolist(), num_bytes=page_bytes)


def first_page_flip(side: str) -> Transport:
    """Over NIXL: the transport vLLM instances in separate processes use."""
    return FirstPageFlip(make_transport("nixl"))


def first_page_flip_local(side: str) -> Transport:
    """In one process (the adapter tests)."""
    return FirstPageFlip(make_transport("local"))


def recording_nixl(side: str) -> Transport:
    """NIXL, plus one JSON line per write in ``$KVFERRY_VLLM_RECORD``: pool -> pages written. The hybrid
    test reads it to see that every KV cache group's pool moved pages (the engines run in other processes)."""
    from kvferry.transport.nixl import NixlTransport  # here: the default suite imports this module

    class RecordingNixl(NixlTransport):
        def write(self, plan: Any, peer: str, notif: bytes, label: str = "") -> Any:
            with open(os.environ["KVFERRY_VLLM_RECORD"], "a") as record:
                record.write(json.dumps({p.pool: len(p.dst_pages) for p in plan.pools}) + "\n")
            return super().write(plan, peer, notif, label)

    return RecordingNixl()
