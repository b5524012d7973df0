"""Prefill rank endpoints in their own OS process, for the cross-TP endpoint tests over NIXL.

As a module: the shared model and workload (``small_model``, ``workload``, ``send``). As a program
(``python tests/tp_endpoint_peer.py '<json>'`` with ``ptp``, ``ranks``, ``major``, ``seed``): builds one
``PrefillEndpoint`` (own memory, own ``NixlTransport`` agent) per listed rank of a TP group of ``ptp``,
prints ``{"addresses": {rank: address}}``, then answers JSON lines on stdin: ``serve`` (``n``, ``seed``,
``hold_last``: send every request from every rank, the last chunk held back if asked), ``wait``
(request id -> "done" or the failure's class), ``counters``, ``exit``.

Why one process per side (or per half of a side) and not per rank: each rank still has its own memory and
its own NIXL agent, so the data path is the per-rank one; on a 2-core CI host one process per rank would
measure the scheduler (as ``netns_peer.py`` explains).
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script: netns_peer is a sibling

from kvferry import Layout
from kvferry.control import EndpointOptions, PrefillEndpoint
from netns_peer import full_arrays, llama_like, rank_memory

LAYERS = (("L0.k", "L0.v", "L0.idx"), ("L1.k", "L1.v", "L1.idx", "state"))


def small_model(major: str = "head") -> Layout:
    """A GQA layout of 8 KV heads (sharded K/V, a replicated indexer buffer, a replicated state pool)."""
    return llama_like(num_layers=2, num_pages=24, tokens=4, major=major, heads=8, head_bytes=8)


@dataclass
class Req:
    rid: str
    src: dict[str, np.ndarray]
    dst: dict[str, np.ndarray]
    sends: list[dict[str, Any]]


def workload(n: int, seed: int) -> list[Req]:
    """``n`` requests with disjoint destination pages: sent in one go, in two chunks, or layer by layer."""
    rng = np.random.default_rng(seed)
    dst_kv, dst_state = rng.permutation(20)[:n * 3].reshape(n, 3), rng.permutation(6)[:n].reshape(n, 1)
    reqs = []
    for i in range(n):
        src = {"kv": rng.choice(20, 3, replace=False), "state": rng.integers(0, 6, 1)}
        sends = [[{"pages": src, "offset": 0, "last": True, "buffers": None}],
                 [{"pages": {"kv": src["kv"][:1]}, "offset": 0, "last": False, "buffers": None},
                  {"pages": {"kv": src["kv"][1:], "state": src["state"]}, "offset": {"kv": 1}, "last": True,
                   "buffers": None}],
                 [{"pages": src, "offset": 0, "last": k == 1, "buffers": LAYERS[k]} for k in (0, 1)]][i % 3]
        reqs.append(Req(f"r{i}", src, {"kv": dst_kv[i], "state": dst_state[i]}, sends))
    return reqs


def send(prefill: PrefillEndpoint, req: Req, sends: list[dict[str, Any]]) -> None:
    for s in sends:
        prefill.send(req.rid, s["pages"], offset=s["offset"], last=s["last"], buffers=s["buffers"])


def _serve(cfg: dict[str, Any]) -> None:
    full = small_model(cfg.get("major", "head"))
    data = full_arrays(full, cfg["seed"])
    opts = EndpointOptions(**cfg.get("options", {}))
    eps = {r: PrefillEndpoint(rank_memory(full, cfg["ptp"], r, data), "nixl", options=opts, digest_mode="full")
           for r in cfg["ranks"]}
    reqs: list[Req] = []
    _reply({"addresses": {r: ep.address for r, ep in eps.items()}})
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "exit":
            break
        if cmd["op"] == "serve":
            reqs = workload(cmd["n"], cmd["seed"])
            for req in reqs:
                for ep in eps.values():
                    send(ep, req, req.sends[:-1] if cmd.get("hold_last") else req.sends)
            _reply({"ok": True})
        elif cmd["op"] == "wait":
            _reply({"results": {f"{r}:{q.rid}": _outcome(ep, q.rid) for r, ep in eps.items() for q in reqs}})
        elif cmd["op"] == "counters":
            _reply({"counters": {r: ep.counters() for r, ep in eps.items()}})
    for ep in eps.values():
        ep.close()
    _reply({"ok": True})


def _outcome(ep: PrefillEndpoint, rid: str) -> str:
    try:
        ep.wait(rid, 20.0)
        return "done"
    except Exception as exc:
        return type(exc.__cause__ or exc).__name__


def _reply(obj: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    _serve(json.loads(sys.argv[1]))
