"""NIXL whose writes wait before they are posted, for tests/test_vllm_faults.py's stall.

Named in ``kv_connector_extra_config={"transport": "tests.vllm_slow_transport:slow_nixl"}`` on prefill. It stands
in for a model whose KV takes a while to move (the tests' tiny model moves a request in well under a
millisecond), so that a prefill stopped at any moment has transfers in flight: the stall must cut some, or
the test would show nothing about where their writes land.
"""

from __future__ import annotations

import time
from typing import Any

from kvferry.transport import Transport

WRITE_DELAY = 0.05   # seconds before each write is posted (prefill's progress thread waits: a busy link)


def slow_nixl(side: str) -> Transport:
    from kvferry.transport.nixl import NixlTransport  # here: the default suite imports this module

    class SlowNixl(NixlTransport):
        def write(self, plan: Any, peer: str, notif: bytes, label: str = "") -> Any:
            time.sleep(WRITE_DELAY)
            return super().write(plan, peer, notif, label)

    return SlowNixl()
