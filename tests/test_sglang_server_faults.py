"""Servers that die under load: SGLang's prefill server killed (SIGKILL, its whole process group) with
requests in flight and restarted on the same ports while decode keeps running, then the decode server
killed and restarted. Through SGLang's router with kvferry's backend (page 16, decode radix cache on).

What must hold: no answer carries tokens other than the plain server's (a request may fail, never
answer wrong); every request ends (answer or error) within ``BOUND_S``; after each restart both sides
return to 0 tokens in use (SGLang's ``num_used_tokens``) and new requests get the plain server's tokens.
Slow suite (``make test-sglang-slow``): it starts five servers and restarts two.
"""

from __future__ import annotations

import concurrent.futures as cf
import random
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests

pytest.importorskip("sglang.srt.disaggregation.common.conn")
pytest.importorskip("sglang_router")
pytest.importorskip("nixl")
pytestmark = [pytest.mark.sglang, pytest.mark.nixl, pytest.mark.slow, pytest.mark.timeout(1500)]

from tests import sglang_servers as ss  # noqa: E402
from tests.test_sglang_server import NEW_TOKENS, prompt, wait_idle  # noqa: E402

# Every request ends (answer or HTTP error) within this: six times kvferry's peer_timeout (5 s), three times
# its handshake timeout (10 s), the longest a request can wait on a dead or new peer in this backend. SGLang's
# own timeouts (bootstrap, waiting for KV: 300 s) are far longer, so a request unanswered by then is a hang.
# Measured longest (2026-12-02, 2 cores, load average 8-20): 3.7 s (prefill killed), 8.1 s (decode killed).
BOUND_S = 30.0
# How long both sides get to return to 0 tokens in use once the load stops.
IDLE_S = 180.0
FIGURES: dict[str, Any] = {}


def report_lines() -> list[str]:
    return [f"{k:40} {v}" for k, v in FIGURES.items()]


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ss.PD, ss.Server, Path]]:
    root = tmp_path_factory.mktemp("sglang-faults")
    model = ss.write_tiny_model(root / "tiny-llama")
    plain = ss.plain_server(model, 1, root)
    pd = ss.pd_servers(model, 16, "kvferry", root)
    every = [plain, *reversed(pd.all())]
    try:
        ss.start_all(every)
        yield pd, plain, root
    finally:
        for s in every:
            s.kill()


def _references(plain: ss.Server, seed: int) -> dict[tuple[int, ...], list[int]]:
    rng = random.Random(seed)
    prompts = [prompt(rng, rng.choice([5, 17, 40, 100, 300])) for _ in range(40)]
    return {tuple(p): ss.generate(plain.url, p, NEW_TOKENS)["output_ids"] for p in prompts}


def _load(pd: ss.PD, want: dict[tuple[int, ...], list[int]], n: int, stop: threading.Event
          ) -> list[dict[str, Any]]:
    """``n`` clients sending requests back to back until ``stop`` is set: each outcome, checked against the
    plain server's tokens, with its duration."""
    prompts = [list(p) for p in want]
    outcomes: list[dict[str, Any]] = []
    lock = threading.Lock()

    def client(c: int) -> None:
        i = c
        while not stop.is_set():
            p = prompts[i % len(prompts)]
            i += n
            t0 = time.monotonic()
            got: Any = None
            try:
                got = ss.generate(pd.url, p, NEW_TOKENS, timeout=BOUND_S)["output_ids"]
                kind = "equal" if got == want[tuple(p)] else "WRONG"
            except requests.Timeout:
                kind = "timeout"
            except (requests.RequestException, ValueError, KeyError) as e:
                kind = "error"
                got = repr(e)[:200]
            with lock:
                outcomes.append({"kind": kind, "s": time.monotonic() - t0, "got": got, "at": t0})
            if kind != "equal":
                time.sleep(0.5)   # a server is down: do not spin on refused connections

    with cf.ThreadPoolExecutor(n) as pool:
        list(pool.map(client, range(n)))
    return outcomes


def _restart(server: ss.Server) -> float:
    t0 = time.monotonic()
    server.start()
    server.wait_ready(400)
    return time.monotonic() - t0


def _check(name: str, outcomes: list[dict[str, Any]]) -> None:
    kinds = {k: sum(1 for o in outcomes if o["kind"] == k) for k in ("equal", "WRONG", "error", "timeout")}
    longest = max(o["s"] for o in outcomes)
    FIGURES[f"{name}: outcomes"] = kinds
    FIGURES[f"{name}: longest request s"] = round(longest, 1)
    assert kinds["WRONG"] == 0, [o for o in outcomes if o["kind"] == "WRONG"][:3]
    assert kinds["timeout"] == 0 and longest < BOUND_S, (kinds, longest)
    assert kinds["equal"] > 0, kinds


def _kill_during_load(pd: ss.PD, plain: ss.Server, victim: ss.Server, seed: int) -> list[dict[str, Any]]:
    """16 clients; ``victim`` SIGKILLed 5 s into the load, restarted on its ports; the load goes on for 20 s
    after the restarted server is ready."""
    want = _references(plain, seed)
    stop = threading.Event()
    with cf.ThreadPoolExecutor(1) as pool:
        load = pool.submit(_load, pd, want, 16, stop)
        time.sleep(5.0)
        victim.kill()
        killed_at = time.monotonic()
        FIGURES[f"{victim.name} restart s"] = round(_restart(victim), 1)
        ready_at = time.monotonic()
        time.sleep(20.0)
        stop.set()
        outcomes = load.result()
    FIGURES[f"{victim.name} killed: equal after restart"] = sum(
        1 for o in outcomes if o["kind"] == "equal" and o["at"] > ready_at)
    FIGURES[f"{victim.name} killed: failed, started before the kill"] = sum(
        1 for o in outcomes if o["kind"] != "equal" and o["at"] < killed_at)
    return outcomes


def _after(pd: ss.PD, plain: ss.Server, seed: int) -> list[dict[str, Any]]:
    """8 clients for 5 s on the servers as they are now."""
    want = _references(plain, seed)
    stop = threading.Event()
    threading.Timer(5.0, stop.set).start()
    return _load(pd, want, 8, stop)


def test_prefill_killed_under_load_and_restarted(servers: tuple[ss.PD, ss.Server, Path]) -> None:
    pd, plain, _ = servers
    outcomes = _kill_during_load(pd, plain, pd.prefill, seed=1)
    FIGURES["after prefill restart: usage"] = wait_idle(pd, timeout=IDLE_S)
    _check("prefill killed", outcomes)
    after = _after(pd, plain, seed=2)
    assert after and all(o["kind"] == "equal" for o in after), [o for o in after if o["kind"] != "equal"][:3]
    wait_idle(pd)


def test_decode_killed_under_load_and_restarted(servers: tuple[ss.PD, ss.Server, Path]) -> None:
    pd, plain, _ = servers
    outcomes = _kill_during_load(pd, plain, pd.decode, seed=3)
    FIGURES["after decode restart: usage"] = wait_idle(pd, timeout=IDLE_S)
    _check("decode killed", outcomes)
    after = _after(pd, plain, seed=4)
    assert after and all(o["kind"] == "equal" for o in after), [o for o in after if o["kind"] != "equal"][:3]
    wait_idle(pd)
