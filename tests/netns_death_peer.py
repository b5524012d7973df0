"""One side of the cross-host death measurement (``tests/test_netns_death.py``), in its own process and
network namespace; prefill also in a UTS namespace of its own, so its host identity (hostname and boot id,
``control.liveness``) differs from decode's as another machine's would.

Run as ``python tests/netns_death_peer.py '<json>'`` with ``role``, ``n``, ``seed``; prefill takes ``host``,
decode ``address`` and ``mode`` (``push``, ``pull`` or ``auto``). JSON lines on stdout:

* prefill: ``{"address": ...}`` once bound; after a line on stdin, sends each request's first chunk only
  (the rest never comes: it is killed with its requests half written), prints ``{"sent": n}`` and sleeps;
* decode: connects, announces every request, prints ``{"announced": true, "mode": <the mode asked>}``; then
  every 0.25 s, for ``watch`` seconds, ``{"t", "quarantined", "leased", "failed"}``: its quarantined and
  leased pages and requests failed so far.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script: the helpers are siblings

from kvferry.control import DecodeEndpoint, EndpointOptions, PrefillEndpoint, RequestState
from kvferry.control.pull import mode_for
from netns_endpoint_peer import _reply
from netns_peer import full_arrays, rank_memory
from tp_endpoint_peer import send, small_model, workload

SEED = 11
OPTIONS = {"heartbeat_interval": 0.2, "peer_timeout": 1.5, "lease_grace": 0.5, "request_timeout": 60.0}


def run_prefill(cfg: dict[str, Any]) -> None:
    full = small_model("head")
    ep = PrefillEndpoint(rank_memory(full, 1, 0, full_arrays(full, SEED)), "nixl", host=cfg["host"],
                         options=EndpointOptions(**OPTIONS), digest_mode="full")
    _reply({"address": ep.address})
    sys.stdin.readline()
    reqs = workload(cfg["n"], cfg["seed"])
    for req in reqs:
        send(ep, req, req.sends[:1] if len(req.sends) > 1 else [])
    _reply({"sent": len(reqs)})
    time.sleep(3600)   # killed by the test


def run_decode(cfg: dict[str, Any]) -> None:
    full = small_model("head")
    ep = DecodeEndpoint(rank_memory(full, 1, 0, None), "nixl", options=EndpointOptions(**OPTIONS),
                        digest_mode="full", mode=cfg["mode"])
    try:
        ep.connect(cfg["address"])
        reqs = workload(cfg["n"], cfg["seed"])
        for req in reqs:
            ep.announce(req.rid, req.dst)
        _reply({"announced": True, "mode": mode_for(cfg["mode"], cfg["address"])})
        start = time.monotonic()
        while time.monotonic() - start < cfg["watch"]:
            failed = sum(ep.poll(r.rid) is RequestState.FAILED for r in reqs)
            k = ep.counters()
            _reply({"t": round(time.monotonic() - start, 2), "quarantined": k["quarantined_pages"],
                    "leased": k["leased_pages"], "failed": failed})
            time.sleep(0.25)
    finally:
        ep.close()


if __name__ == "__main__":
    config = json.loads(sys.argv[1])
    (run_prefill if config["role"] == "prefill" else run_decode)(config)
