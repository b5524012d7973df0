"""Shared workload for the control-plane tests, and a peer process the multi-process tests drive.

As a module: ``make_layout``, ``fill``, ``workload``, ``run_prefill``, ``announce``, ``verify``.
As a program (``python tests/control_peer.py prefill|decode '<options json>'``): builds one endpoint,
prints ``{"event": "ready", "address": ...}``, then answers JSON commands read from stdin, one line each,
with one JSON line on stdout. Commands: ``connect``, ``serve``, ``send`` (one request's pages, given),
``send_rest``, ``announce``, ``wait_all``, ``verify``, ``counters``, ``hog`` (starve this process's Python
threads for ``seconds``), ``exit``; ``serve`` and ``announce`` take
``tokens`` (request id -> token ids) to bind requests (``token_binding``), ``verify`` takes ``only``.
``"mode": "pull"`` makes the endpoint pull (decode reads prefill's pages). With ``"stop_before_write":
true`` a prefill stops itself (SIGSTOP) right before its first transport write, after every check the
endpoint makes: the test sends SIGCONT when it likes (the late write of the fencing tests).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvferry import Buffer, KVMemory, Layout, Pool, token_binding
from kvferry.control import DecodeEndpoint, EndpointOptions, PrefillEndpoint
from kvferry.errors import RequestFailed

# Prefill and decode have the same shape but different capacities, and buffers of one pool differ in
# page size and capacity: the heterogeneity the planner and the lease table must respect.
CAPACITY = {"prefill": (400, 200, 140), "decode": (300, 288, 100)}


def make_layout(side: str, *, idx_dtype: str = "bf16", main_page: int = 512) -> Layout:
    main_pages, idx_pages, c4_pages = CAPACITY[side]
    return Layout([
        Pool("main", [
            Buffer("main.kv.L0", main_page, main_pages, "fp8_e4m3", "kv", 0),
            Buffer("main.idx.L0", 128, idx_pages, idx_dtype, "index_k", 0),
            Buffer("main.kv.L1", main_page, main_pages, "fp8_e4m3", "kv", 1),
            Buffer("main.idx.L1", 128, idx_pages, idx_dtype, "index_k", 1),
        ], tokens_per_page=64),
        Pool("c4", [
            Buffer("c4.kv.L0", 256, c4_pages, "fp8_e4m3", "kv", 0),
            Buffer("c4.kv.L1", 256, c4_pages + 20, "fp8_e4m3", "kv", 1),
        ], tokens_per_page=256),
    ])


LAYERS = {0: ("main.kv.L0", "main.idx.L0", "c4.kv.L0"), 1: ("main.kv.L1", "main.idx.L1", "c4.kv.L1")}


def fill(mem: KVMemory, seed: int) -> None:
    rng = np.random.default_rng(seed)
    for buf in mem.layout.buffers:
        arr = mem.array(buf.name)
        arr[...] = rng.integers(0, 256, size=arr.shape, dtype=np.uint8)


def snapshot(mem: KVMemory) -> dict[str, np.ndarray]:
    return {b.name: mem.array(b.name).copy() for b in mem.layout.buffers}


@dataclass
class Req:
    """One request: source and destination pages per pool, and the sends that carry them."""

    rid: str
    src: dict[str, np.ndarray]
    dst: dict[str, np.ndarray]
    sends: list[dict[str, Any]] = field(default_factory=list)


def workload(n: int, seed: int, *, main_pages: int = 4, prefix: str = "r") -> list[Req]:
    """``n`` requests with disjoint destination pages, each sent in one go, in chunks, or layer by layer."""
    rng = np.random.default_rng(seed)
    dmain, didx, dc4 = CAPACITY["decode"]
    pmain, pidx, pc4 = CAPACITY["prefill"]
    dst_main = rng.permutation(min(dmain, didx))[: n * main_pages].reshape(n, main_pages)
    dst_c4 = rng.permutation(dc4)[:n].reshape(n, 1)
    reqs = []
    for i in range(n):
        src = {"main": rng.choice(min(pmain, pidx), main_pages, replace=False), "c4": rng.integers(0, pc4, 1)}
        dst = {"main": dst_main[i], "c4": dst_c4[i]}
        req = Req(f"{prefix}{i}", src, dst)
        req.sends = _sends(i % 3, src)
        reqs.append(req)
    return reqs


def _sends(mode: int, src: dict[str, np.ndarray]) -> list[dict[str, Any]]:
    if mode == 0:  # one go
        return [{"pages": src, "offset": 0, "last": True, "buffers": None}]
    if mode == 1:  # chunked prefill: main pool in two chunks, the c4 page with the last
        half = len(src["main"]) // 2
        return [{"pages": {"main": src["main"][:half]}, "offset": 0, "last": False, "buffers": None},
                {"pages": {"main": src["main"][half:], "c4": src["c4"]}, "offset": {"main": half, "c4": 0},
                 "last": True, "buffers": None}]
    return [{"pages": src, "offset": 0, "last": layer == 1, "buffers": LAYERS[layer]} for layer in (0, 1)]


def send(prefill: PrefillEndpoint, req: Req, sends: list[dict[str, Any]], binding: Any = None) -> None:
    for s in sends:
        prefill.send(req.rid, s["pages"], offset=s["offset"], last=s["last"], buffers=s["buffers"], binding=binding)


def run_prefill(prefill: PrefillEndpoint, reqs: list[Req], *, hold_last: bool = False,
                tokens: dict[str, list[int]] | None = None) -> None:
    """Send every request's chunks round-robin (all first chunks, then all second...), as engines do;
    ``tokens``: request id -> the token ids its first send binds it to (``token_binding``)."""
    rounds = max(len(r.sends) for r in reqs)
    for k in range(rounds):
        for req in reqs:
            if k < len(req.sends) and not (hold_last and k == len(req.sends) - 1):
                try:
                    send(prefill, req, [req.sends[k]], binding=_bound(tokens, req.rid, "prefill") if k == 0 else None)
                except RequestFailed:
                    if not tokens:
                        raise   # bound requests: a refused one fails at its first send; the rest are moot


def announce(decode: DecodeEndpoint, reqs: list[Req], tokens: dict[str, list[int]] | None = None) -> None:
    for req in reqs:
        decode.announce(req.rid, req.dst, binding=_bound(tokens, req.rid, "decode"))


def _bound(tokens: dict[str, list[int]] | None, rid: str, side: str) -> Any:
    if not tokens or rid not in tokens:
        return None
    return token_binding(tokens[rid], 64, label=f"{side}-{rid}")


def verify(dst: KVMemory, src_seed: int, reqs: list[Req], before: dict[str, np.ndarray]) -> None:
    """Every leased page holds the bytes of its source page; every other page is unchanged."""
    src = KVMemory.allocate(make_layout("prefill"))
    fill(src, src_seed)
    touched = {b.name: np.zeros(b.num_pages, dtype=bool) for b in dst.layout.buffers}
    for req in reqs:
        for pool in dst.layout.pools:
            for buf in pool.buffers:
                got = dst.array(buf.name)[req.dst[pool.name]]
                want = src.array(buf.name)[req.src[pool.name]]
                assert np.array_equal(got, want), f"{req.rid}: buffer {buf.name} differs"
                touched[buf.name][req.dst[pool.name]] = True
    for name, mask in touched.items():
        assert np.array_equal(dst.array(name)[~mask], before[name][~mask]), f"untouched pages of {name} changed"


def wait_all(ep: Any, rids: list[str], timeout: float) -> dict[str, str]:
    """request id -> "done" or the failure's class name and reason."""
    out = {}
    deadline = time.monotonic() + timeout
    for rid in rids:
        try:
            ep.wait(rid, max(0.01, deadline - time.monotonic()))
            out[rid] = "done"
        except Exception as exc:
            cause = exc.__cause__ if exc.__cause__ is not None else exc
            out[rid] = f"{type(cause).__name__}: {cause}"
    return out


# -- the peer process ------------------------------------------------------------------------------------
def _endpoint(role: str, cfg: dict[str, Any]) -> Any:
    opts = EndpointOptions(**cfg.get("options", {}))
    mem = KVMemory.allocate(make_layout(role))
    fill(mem, cfg.get("seed", 0) if role == "prefill" else 999)
    kwargs = {"secret": cfg.get("secret"), "digest_mode": cfg.get("digest_mode", "sampled"), "options": opts,
              "mode": cfg.get("mode", "push")}
    if role == "prefill":
        transport: Any = cfg.get("transport", "nixl")
        if cfg.get("stop_before_write"):
            transport = _stop_before_first_write(transport)
        return PrefillEndpoint(mem, transport, **kwargs)
    return DecodeEndpoint(mem, cfg.get("transport", "nixl"), **kwargs)


def _stop_before_first_write(kind: str) -> Any:
    """A transport whose first ``write`` stops this process (SIGSTOP) before posting: a stall at exactly
    the instruction between prefill's last check and its post."""
    from kvferry.transport import make_transport

    transport = make_transport(kind)
    inner = transport.write
    fired: list[bool] = []

    def write(*args: Any, **kwargs: Any) -> Any:
        if not fired:
            fired.append(True)
            os.kill(os.getpid(), signal.SIGSTOP)
        return inner(*args, **kwargs)

    transport.write = write  # type: ignore[method-assign]
    return transport


def _serve(role: str, cfg: dict[str, Any]) -> None:
    ep = _endpoint(role, cfg)
    before = snapshot(ep.memory)
    reqs: list[Req] = []
    _reply({"event": "ready", "address": getattr(ep, "address", None)})
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd["op"]
        if op == "exit":
            ep.close()
            _reply({"ok": True})
            return
        _reply(_command(ep, op, cmd, reqs, before, cfg))


def _command(ep: Any, op: str, cmd: dict[str, Any], reqs: list[Req], before: dict[str, np.ndarray],
             cfg: dict[str, Any]) -> dict[str, Any]:
    if op == "connect":
        return {"peer": ep.connect(cmd["address"])}
    if op in ("serve", "announce"):
        reqs[:] = workload(cmd["n"], cmd["seed"], prefix=cmd.get("prefix", "r"))
        if op == "serve":
            run_prefill(ep, reqs, hold_last=cmd.get("hold_last", False), tokens=cmd.get("tokens"))
        else:
            announce(ep, reqs, cmd.get("tokens"))
        return {"ok": True}
    if op == "send":
        ep.send(cmd["rid"], {pool: np.array(pages) for pool, pages in cmd["pages"].items()})
        return {"ok": True}
    if op == "send_rest":
        for req in reqs:
            send(ep, req, req.sends[-1:])
        return {"ok": True}
    if op == "wait_all":
        return {"results": wait_all(ep, [r.rid for r in reqs], cmd.get("timeout", 30.0))}
    if op == "verify":   # "only": the requests that must have landed (the others' pages must be untouched)
        only = cmd.get("only")
        verify(ep.memory, cfg.get("seed", 0), [r for r in reqs if only is None or r.rid in only], before)
        return {"ok": True}
    if op == "counters":
        return {"counters": ep.counters()}
    if op == "hog":   # starve this process's Python (not its libzmq I/O thread) for about ``seconds``
        return {"calls": _hog(cmd["seconds"])}
    if op == "holds":  # pull mode: how many requests' source pages decode may still read
        return {"holds": sum(ep.holds_source(r.rid) for r in reqs), "total": ep.counters()["source_holds"]}
    return {"error": f"unknown op {op!r}"}


def _hog(seconds: float) -> int:
    """Start a thread that holds the GIL for about ``seconds``: one ``sum`` over a range, a C loop that
    never lets the GIL go, sized from a short calibration. Every Python thread here (the endpoint's progress
    loop) stands still meanwhile; libzmq's I/O thread, which needs no GIL, keeps answering ZMTP heartbeats."""
    import threading

    t0 = time.perf_counter()
    sum(range(2_000_000))
    n = int(2_000_000 * seconds / max(time.perf_counter() - t0, 1e-6))
    threading.Thread(target=sum, args=(range(n),), daemon=True).start()
    return n


def _reply(obj: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    _serve(sys.argv[1], json.loads(sys.argv[2]) if len(sys.argv) > 2 else {})
