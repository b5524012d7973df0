"""One side of a transfer through the real endpoints, in its own OS process (and, for ``test_netns``, its
own network namespace): every TP rank of that side as a ``PrefillEndpoint`` or a ``DecodeEndpoint`` over
``transport="nixl"``, one NIXL agent each.

Run as ``python tests/netns_endpoint_peer.py '<json>'`` with ``role``, ``ptp``, ``dtp``, ``major``, ``n``
and ``seed``; prefill also takes ``host`` (the address it binds, e.g. its veth's), decode ``addresses``
(prefill's, in rank order). It prints JSON lines on stdout:

* prefill: ``{"addresses": [...]}`` once bound; then, after a line on stdin (decode has announced), sends
  every request from every rank (``tp_endpoint_peer.workload``: whole, chunked and layer-by-layer sends),
  waits for each and prints ``{"results": {"rank:request": "done" or the failure's class}}``;
* decode: connects (rank to rank at equal TP sizes, ``connect_all`` across them), announces every request
  and prints ``{"announced": true}``; then waits for each, checks every requested page of every buffer
  byte for byte against the logical KV (``netns_peer.check_rank``) and prints ``{"results", "errors",
  "bytes"}``, ``bytes`` being what landed in its pages.

The layout is ``tp_endpoint_peer.small_model``: sharded K/V, a replicated indexer buffer with fewer pages
than the K/V beside it, and a per-request state pool.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script: the helpers are siblings

from kvferry.control import DecodeEndpoint, EndpointOptions, PrefillEndpoint
from kvferry.errors import KVFerryError
from netns_peer import check_rank, full_arrays, rank_memory
from tp_endpoint_peer import Req, send, small_model, workload

SEED = 11
# Generous for a 2-core host running both sides' UCX progress (a prefill whose loop sent nothing for
# peer_timeout ends its sessions itself, see docs/fencing.md); a stall still fails well inside the test.
OPTIONS = {"heartbeat_interval": 0.2, "peer_timeout": 5.0, "lease_grace": 1.0, "request_timeout": 30.0}


def run_prefill(cfg: dict[str, Any]) -> None:
    full = small_model(cfg["major"])
    data = full_arrays(full, SEED)
    eps = [PrefillEndpoint(rank_memory(full, cfg["ptp"], r, data), "nixl", host=cfg["host"],
                           options=EndpointOptions(**OPTIONS), digest_mode="full") for r in range(cfg["ptp"])]
    try:
        _reply({"addresses": [ep.address for ep in eps]})
        sys.stdin.readline()  # decode has announced: writes can start as soon as each send is queued
        reqs = workload(cfg["n"], cfg["seed"])
        for req in reqs:
            for ep in eps:
                send(ep, req, req.sends)
        _reply({"results": {f"{r}:{q.rid}": _outcome(ep, q.rid) for r, ep in enumerate(eps) for q in reqs}})
    finally:
        for ep in eps:
            ep.close()


def run_decode(cfg: dict[str, Any]) -> None:
    full, ptp, dtp = small_model(cfg["major"]), cfg["ptp"], cfg["dtp"]
    eps = [DecodeEndpoint(rank_memory(full, dtp, d, None), "nixl", options=EndpointOptions(**OPTIONS),
                          digest_mode="full") for d in range(dtp)]
    try:
        reqs = workload(cfg["n"], cfg["seed"])
        for d, ep in enumerate(eps):
            if ptp == dtp:
                ep.connect(cfg["addresses"][d])        # equal TP sizes: rank to rank, shapes must match
            else:
                ep.connect_all(cfg["addresses"])       # across TP sizes: only the ranks this one needs
            for req in reqs:
                ep.announce(req.rid, req.dst)
        _reply({"announced": True})
        results = {f"{d}:{q.rid}": _outcome(ep, q.rid) for d, ep in enumerate(eps) for q in reqs}
        data, pages = full_arrays(full, SEED), _pages(reqs)
        errors = [e for d, ep in enumerate(eps) for e in check_rank(ep.memory, full, data, dtp, d, pages)]
        _reply({"results": results, "errors": errors[:10], "bytes": sum(_landed(ep, reqs) for ep in eps)})
    finally:
        for ep in eps:
            ep.close()


def _outcome(ep: Any, rid: str) -> str:
    try:
        ep.wait(rid, OPTIONS["request_timeout"])
        return "done"
    except KVFerryError as exc:
        return type(exc.__cause__ or exc).__name__


def _pages(reqs: list[Req]) -> dict[str, tuple[list[int], list[int]]]:
    return {p: (np.concatenate([r.src[p] for r in reqs]).tolist(), np.concatenate([r.dst[p] for r in reqs]).tolist())
            for p in ("kv", "state")}


def _landed(ep: DecodeEndpoint, reqs: list[Req]) -> int:
    """Bytes written into this rank's requested pages: every buffer of every pool, at its page size."""
    layout = ep.memory.layout
    return sum(len(r.dst[p.name]) * sum(b.page_bytes for b in p.buffers) for r in reqs for p in layout.pools)


def _reply(obj: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    config = json.loads(sys.argv[1])
    (run_prefill if config["role"] == "prefill" else run_decode)(config)
