"""Instances that come and go under load behind vllm-router (issue 49), with kvferry's vLLM connector.

Two prefill and one decode ``vllm serve`` with kvferry behind ``vllm-router --vllm-pd-disaggregation`` (the
command ``tests/deploy_commands.py`` builds, its own ``--prometheus-port``, and ``--health-check-interval-secs
HEALTH_S``: the default is 60 s) and one plain instance for the reference tokens. In order:

1. ``IN_FLIGHT`` requests kept in flight; one prefill's process group SIGKILLed while serving. Every answer is
   equal to the plain instance's greedy tokens or an HTTP error, none with other tokens; every request sent
   ``RECOVERY_BOUND_S`` after the kill or later succeeds (the router's health check takes the dead prefill out).
2. A new prefill on a new port; vllm-router restarted with it in the list (its ``/add_worker`` is tried first
   and its answer printed: in PD mode it has no way to add a prefill). The new prefill serves requests (the
   answers' ids name it, its ``/metrics`` counts them) and the answers are equal.
3. The decode killed and started again on the same port: once the router sends to it again (within
   ``DECODE_BACK_S``), every answer is equal.
4. No KV left: ``vllm:kv_cache_usage_perc`` 0 and no request running or waiting on every survivor; no request
   took longer than ``REQUEST_BOUND_S`` (the client's timeout is that bound, so one that hung would fail).

What vllm-router 0.1.17 did (measured 2026-12-05): it does not retry a request whose prefill refused the
connection on the other prefill (113 of 989 requests under load failed with HTTP 500 "Transparent proxy request
failed: Network error: Prefill request to ... failed", one router log line each), sent 0.0-4.9 s after the kill;
then its health check (every 2 s, 3 failures) took the prefill out and every later request was equal. With the
default 60 s interval its circuit breaker did not take it out: 749 of 1532 failed, up to 29.6 s after the kill
(the end of the load), and 8 of 16 afterwards; 2 of those were decode 500s, a transfer cut by the kill (decode
"failed=2", no KV left). In PD mode ``/add_worker`` answers HTTP 400 "PD router requires specific
add_prefill_server or add_decode_server methods": the new prefill is added by restarting the router.

Slow: five ``vllm serve`` starts and three routers; ``RUN_S``.
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (make test-vllm)")

from kvferry.workload.vllm_chaos import (
    Answer,
    LoadSpec,
    Server,
    _complete,
    check_answers,
    kvferry_config,
    server_env,
    summarize,
    wait_idle,
)

from .deploy_commands import vllm_router_argv
from .test_vllm_router import ROUTER, pairs
from .vllm_pd import free_port, make_prompts, scrape, scraped, serve_command, write_model, write_tokenizer

RUN_S = "206 s (one run, 2026-12-05, 2 cores, load ~1); 177 s with the default 60 s health interval (fails its bound)"
pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(1200)]

MAX_TOKENS = 12
IN_FLIGHT = 20
NUM_PROMPTS = 48
HEALTH_S = 2              # the router's health-check interval (3 failures in a row take a worker out)
KILL_AFTER_S = 4.0        # load before the prefill is killed
LOAD_AFTER_KILL_S = 25.0  # load after it
RECOVERY_BOUND_S = 15.0   # every request sent this long after the kill or later succeeds
DECODE_BACK_S = 60.0      # the restarted decode serves through the router within this
REQUEST_BOUND_S = 60.0    # no request waits longer (the client's timeout)
IDLE_S = 30.0             # survivors' KV back to 0 within this once the load stopped


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tokenizer(write_model(tmp_path_factory.mktemp("tiny-llama")))


@pytest.fixture(scope="module")
def logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("router-fault-logs")


def vllm_server(name: str, model: Path, logs: Path, role: str | None) -> Server:
    """A ``vllm serve`` with kvferry's connector for ``role`` ("prefill", "decode"), or a plain instance (no
    connector, no prefix cache) for ``None``; not started."""
    port = free_port()
    cmd = serve_command(model, port, "kv_producer", tokenizer=True)
    at = cmd.index("--kv-transfer-config")
    if role is None:
        del cmd[at:at + 2]
        cmd.remove("--enable-prefix-caching")
    else:
        cmd[at + 1] = json.dumps(kvferry_config(role))
    return Server(name, cmd, logs, server_env(), f"http://127.0.0.1:{port}")


def router(prefills: Sequence[Server], decodes: Sequence[Server], logs: Path, name: str) -> Server:
    port = free_port()
    cmd = vllm_router_argv(str(ROUTER), "round_robin", [s.url or "" for s in prefills],
                           [s.url or "" for s in decodes], port, free_port())
    cmd += ["--health-check-interval-secs", str(HEALTH_S)]
    server = Server(name, cmd, logs, dict(os.environ), f"http://127.0.0.1:{port}")
    server.start()
    server.wait_healthy(60)
    return server


class Load:
    """``IN_FLIGHT`` requests at once through ``url`` until ``stop``, in a thread: each worker sends the pool's
    prompts in turn; every answer recorded (``Answer.started`` in ``time.monotonic()``)."""

    def __init__(self, url: str, model: Path, prompts: Sequence[list[int]], phase: str) -> None:
        self.spec = LoadSpec(url, str(model), max_tokens=MAX_TOKENS, client_timeout=REQUEST_BOUND_S)
        self.prompts, self.phase = list(prompts), phase
        self.answers: list[Answer] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)
        self._thread.start()

    async def _run(self) -> None:
        import aiohttp

        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
            async def worker(index: int) -> None:
                turn = index
                while not self._stop.is_set():
                    self.answers.append(await _complete(http, self.spec, self.prompts[turn % len(self.prompts)], 0.0))
                    turn += IN_FLIGHT

            await asyncio.gather(*(worker(i) for i in range(IN_FLIGHT)))

    def stop(self) -> list[Answer]:
        self._stop.set()
        self._thread.join(REQUEST_BOUND_S + 30)
        assert not self._thread.is_alive(), "the load did not end within the request bound"
        return self.answers


def batch(url: str, model: Path, prompts: Sequence[list[int]]) -> list[Answer]:
    """``prompts`` all at once through ``url``."""
    import aiohttp

    spec = LoadSpec(url, str(model), max_tokens=MAX_TOKENS, client_timeout=REQUEST_BOUND_S)

    async def main() -> list[Answer]:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
            return list(await asyncio.gather(*(_complete(http, spec, list(p), 0.0) for p in prompts)))

    return asyncio.run(main())


def answer_ids(url: str, model: Path, prompts: Sequence[list[int]]) -> list[dict[str, Any]]:
    """``prompts`` one after the other, for the ids vllm-router gives the answers (they name the prefill)."""
    out = []
    for prompt in prompts:
        body = json.dumps({"model": str(model), "prompt": prompt, "max_tokens": 2, "temperature": 0.0}).encode()
        request = urllib.request.Request(url + "/v1/completions", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=REQUEST_BOUND_S) as reply:
            out.append({"id": json.loads(reply.read())["id"]})
    return out


def try_add_worker(url: str, worker: str) -> str:
    """vllm-router's ``POST /add_worker?url=...`` (in its binary's routes; not in ``--help``): its answer."""
    request = urllib.request.Request(f"{url}/add_worker?url={worker}", b"", method="POST")
    try:
        with urllib.request.urlopen(request, timeout=30) as reply:
            return f"HTTP {reply.status}: {reply.read().decode()[:200]}"
    except urllib.error.HTTPError as exc:
        return f"HTTP {exc.code}: {exc.read().decode()[:200]}"


def served(server: Server) -> float:
    return scraped(scrape(server.url or ""), "vllm:request_success_total")


@pytest.fixture(scope="module")
def run(model: Path, logs: Path) -> Iterator[dict[str, Any]]:
    prompts = [p["prompt_token_ids"] for p in make_prompts(NUM_PROMPTS, seed=491)]
    servers = {name: vllm_server(name, model, logs, role) for name, role in
               (("prefill0", "prefill"), ("prefill1", "prefill"), ("decode0", "decode"), ("plain", None))}
    routers: list[Server] = []
    out: dict[str, Any] = {"started": time.monotonic()}
    try:
        for server in servers.values():
            server.start()
        for server in servers.values():
            server.wait_healthy()
        p0, p1, d0 = servers["prefill0"], servers["prefill1"], servers["decode0"]
        routers.append(router([p0, p1], [d0], logs, "router-a"))
        url = routers[-1].url or ""
        out["warm"] = batch(url, model, prompts[:8])

        # 1. a prefill killed under load
        load = Load(url, model, prompts, "kill")
        time.sleep(KILL_AFTER_S)
        out["killed_at"] = time.monotonic()
        p0.kill()
        time.sleep(LOAD_AFTER_KILL_S)
        out["kill"] = load.stop()
        out["after_kill"] = batch(url, model, prompts[:16])

        # 2. a new prefill, added by restarting the router
        servers["prefill2"] = p2 = vllm_server("prefill2", model, logs, "prefill")
        p2.start()
        p2.wait_healthy()
        out["add_worker"] = try_add_worker(url, p2.url or "")
        routers[-1].terminate()
        routers.append(router([p1, p2], [d0], logs, "router-b"))
        url = routers[-1].url or ""
        before = served(p2)
        out["added"] = batch(url, model, prompts[:24])
        out["added_ids"] = answer_ids(url, model, prompts[24:28])
        out["p2_served"] = served(p2) - before

        # 3. the decode killed and started again on the same port
        d0.kill()
        d0.start()
        d0.wait_healthy()
        back = time.monotonic()
        while time.monotonic() - back < DECODE_BACK_S:
            probe = batch(url, model, prompts[28:29])
            if probe[0].tokens is not None:
                break
            time.sleep(1.0)
        out["decode_back_s"] = time.monotonic() - back
        out["restarted"] = batch(url, model, prompts[24:48])

        # 4. no KV left on the survivors
        out["idle"] = {s.name: wait_idle(s.url or "", IDLE_S) for s in (p1, p2, d0)}
        answers = [a for key in ("warm", "kill", "after_kill", "added", "restarted") for a in out[key]]
        check_answers(answers, servers["plain"].url or "", str(model), MAX_TOKENS)
        out["run_s"] = time.monotonic() - out["started"]
        yield out
    finally:
        for server in [*routers, *servers.values()]:
            server.terminate()


def test_instances_come_and_go_behind_vllm_router(run: dict[str, Any]) -> None:
    report = {key: summarize(run[key], REQUEST_BOUND_S) for key in ("warm", "kill", "after_kill", "added", "restarted")}
    for key, summary in report.items():
        print(f"{key:11s} {json.dumps(summary)}")
    killed_at = run["killed_at"]
    errors_after = [a.started - killed_at for a in run["kill"] if a.error is not None and a.started >= killed_at]
    late = [a for a in run["kill"] if a.started - killed_at >= RECOVERY_BOUND_S]
    recovery = max(errors_after, default=0.0)
    print(f"kill: errors sent {min(errors_after, default=0):.1f}-{recovery:.1f} s after it; "
          f"{len(late)} requests sent {RECOVERY_BOUND_S:.0f} s after it or later")
    print(f"/add_worker on the running router: {run['add_worker']}")
    print(f"new prefill: {run['p2_served']:.0f} requests served; pairs {dict(pairs(run['added_ids']))}")
    print(f"decode restarted: served through the router {run['decode_back_s']:.1f} s after it was healthy")
    print(f"survivors idle: {run['idle']}")
    print(f"run {run['run_s']:.0f} s")

    assert all(s["other"] == 0 for s in report.values()), "an answer carried other tokens than the plain instance's"
    assert all(report[k]["equal"] == report[k]["answers"] for k in ("warm", "after_kill", "added", "restarted"))
    assert recovery < RECOVERY_BOUND_S and late and all(a.verdict == "equal" for a in late)
    assert run["p2_served"] > 0
    assert run["decode_back_s"] < DECODE_BACK_S
    for name, (state, _) in run["idle"].items():
        assert state["kv_cache_usage"] == 0 and state["running"] == 0 and state["waiting"] == 0, (name, state)
    assert all(s["over_bound"] == 0 for s in report.values())
