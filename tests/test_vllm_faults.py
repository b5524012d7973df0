"""Faults at the engine level: vLLM API servers stalled, killed and restarted under load through the proxy.

Skipped unless vLLM is importable (``make test-vllm``). A prefill and a decode ``vllm serve`` with kvferry's
connector (short timeouts: ``peer_timeout`` 2 s, ``lease_grace`` 1 s, ``request_timeout`` 10 s) behind
``kvferry vllm-proxy``; 16 multi-turn sessions run through the proxy while each test does one fault. Every
answer must be an error or tokens equal to what decode computes for the same prompt on its own (no transfer
params: the prompt prefilled on decode, one plain instance's path; the soak, ``kvferry vllm-chaos``, checks
against a separate plain instance); no request may take longer than the bound the soak's config states.
The servers start once for the module; the tests run in file order, the decode kill last.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (make test-vllm)")

from kvferry.workload.vllm_chaos import (
    Answer,
    Fault,
    LoadSpec,
    Server,
    SoakConfig,
    check_answers,
    idle_state,
    quarantine_peak,
    run_load,
    start_servers,
    summarize,
    wait_idle,
    write_model,
)

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

SESSIONS = 16
# Prefill's writes wait 50 ms each (tests/vllm_slow_transport.py): a stall or a kill then always cuts transfers.
CONFIG = dict(prefill_transport="tests.vllm_slow_transport:slow_nixl",
              peer_timeout=2.0, lease_grace=1.0, request_timeout=10.0, handshake_timeout=3.0, prefill_timeout=8.0,
              stall=(5.0, 5.0))


@pytest.fixture(scope="module")
def soak(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[SoakConfig, dict[str, Server]]]:
    work = tmp_path_factory.mktemp("vllm-faults")
    config = SoakConfig(work, model=write_model(work / "model"), sessions=SESSIONS, **CONFIG)  # type: ignore[arg-type]
    servers = start_servers(config, config.model)  # type: ignore[arg-type]
    try:
        for server in servers.values():
            server.wait_healthy(600)
        yield config, servers
    finally:
        for server in servers.values():
            server.terminate()


def load_during(config: SoakConfig, servers: dict[str, Server], fault: Callable[[], Any], seconds: float,
                seed: int, reference: str = "decode") -> tuple[list[Answer], float]:
    """``SESSIONS`` sessions through the proxy; once each had an answer (their requests spread over both
    servers, not all at prefill as at the start), ``fault`` runs in a thread, and the load goes on
    ``seconds`` after it returned. Every answer checked against the ``reference`` server computing the
    prompt itself (no transfer params). Returns the answers and when the fault ended (seconds from the
    load's start, as ``Answer.started``)."""
    spec = LoadSpec(servers["proxy"].url or "", str(config.model), SESSIONS, 3, seed=seed,
                    client_timeout=config.bound + 60)
    answers: list[Answer] = []
    end = [float("inf")]
    t0 = time.monotonic()

    async def both() -> None:
        async def later() -> None:
            deadline = time.monotonic() + 120
            while len(answers) < SESSIONS and time.monotonic() < deadline:
                await asyncio.sleep(0.1)
            await asyncio.to_thread(fault)
            end[0] = time.monotonic() + seconds

        await asyncio.gather(run_load(spec, lambda: time.monotonic() >= end[0], answers), later())

    asyncio.run(both())
    check_answers(answers, servers[reference].url or "", str(config.model), spec.max_tokens)
    report = summarize(answers, config.bound)
    print(report)
    assert report["other"] == 0, f"answers with other tokens than one instance: {report}"
    assert report["over_bound"] == 0, f"requests open longer than {config.bound} s: {report}"
    return answers, end[0] - seconds - t0


def pids(server: Server) -> set[int]:
    """The processes of a server's group (the API server and its engine core)."""
    assert server.proc is not None
    group = os.getpgid(server.proc.pid)
    return {int(p) for p in os.listdir("/proc") if p.isdigit() and _pgid(int(p)) == group}


def _pgid(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except ProcessLookupError:
        return None


# Slow suite: on an idle machine the stall can fall between transfers (the tiny model's take well under a
# millisecond even through the slowed transport), and then there is nothing in flight for it to cut.
@pytest.mark.slow
def test_a_stalled_prefill_is_fenced_and_comes_back(soak: tuple[SoakConfig, dict[str, Server]]) -> None:
    """SIGSTOP prefill for 5 s (past peer_timeout): decode fails the requests it was receiving from it and
    keeps their blocks quarantined until prefill answers again, so a late write lands nowhere decode reused;
    after SIGCONT the same prefill serves again."""
    config, servers = soak
    decode_before = pids(servers["decode"])

    def stall() -> None:
        servers["prefill"].signal(signal.SIGSTOP)
        time.sleep(config.stall[1])
        servers["prefill"].signal(signal.SIGCONT)

    answers, resumed = load_during(config, servers, stall, 6.0, seed=1)
    assert any(a.verdict == "error" for a in answers), "no request failed: the stall hit nothing in flight"
    assert quarantine_peak(sorted((config.work_dir / "logs").glob("decode.*.log"))) > 0, \
        "decode quarantined no page: no transfer was cut by the stall"
    assert sum(a.verdict == "equal" for a in answers if a.started > resumed + 1) > 0, \
        "nothing was served after the stall"
    assert pids(servers["decode"]) == decode_before


@pytest.mark.slow   # two server starts and a kill under load (~110 s idle): make test's budget
def test_a_killed_prefill_fails_its_requests_and_is_reconnected_after_a_restart(
        soak: tuple[SoakConfig, dict[str, Server]]) -> None:
    """SIGKILL prefill's process group mid-load and start it again on the same ports (kvferry's address is
    the same): what it held fails within the bound, and once it is healthy decode (not restarted)
    connects to the new process and every request is served."""
    config, servers = soak
    decode_before = pids(servers["decode"])
    restarted: list[float] = []

    def kill_and_restart() -> None:
        servers["prefill"].kill()
        servers["prefill"].start()
        servers["prefill"].wait_healthy(600)
        restarted.append(time.monotonic())

    answers, _ = load_during(config, servers, kill_and_restart, 1.0, seed=2)
    assert any(a.verdict == "error" for a in answers), "the kill failed no request"
    # The load ran until the restart's end: ask again now, through the restarted prefill.
    after, _ = load_during(config, servers, lambda: None, 4.0, seed=3)
    assert restarted, "prefill did not come back"
    assert after and all(a.verdict == "equal" for a in after), summarize(after, config.bound)
    assert pids(servers["decode"]) == decode_before, "decode restarted"


@pytest.mark.slow   # two server starts and a kill under load (~110 s idle): make test's budget
def test_a_killed_decode_releases_prefills_blocks(soak: tuple[SoakConfig, dict[str, Server]]) -> None:
    """SIGKILL decode mid-load (not restarted): the requests it held fail at the client, and prefill gives
    back every block it held for them (its own /metrics: KV cache usage 0, nothing running) within
    request_timeout plus a margin."""
    config, servers = soak
    # Prefill computes the reference here (decode is gone): a producer prefills a plain request as one instance.
    answers, _ = load_during(config, servers, servers["decode"].kill, 3.0, seed=4, reference="prefill")
    assert any(a.verdict == "error" for a in answers), "the kill failed no request"
    state, seconds = wait_idle(servers["prefill"].url or "", config.request_timeout + 20)
    assert state["kv_cache_usage"] == 0 and state["running"] == 0, (state, seconds)
    print(f"prefill idle {seconds} s after the load, {idle_state(servers['prefill'].url or '')}")


def test_the_fault_soak_command_schedules_every_fault() -> None:
    from kvferry.workload.vllm_chaos import fault_schedule

    faults = fault_schedule(0, 600, 20, ("prefill", "decode"), (4, 8))
    pairs = {(a, t) for a in ("kill", "stall") for t in ("prefill", "decode")}
    assert {(f.action, f.target) for f in faults[:4]} == pairs
    assert faults == fault_schedule(0, 600, 20, ("prefill", "decode"), (4, 8))
    assert all(4 <= f.seconds <= 8 for f in faults if f.action == "stall")


@pytest.mark.slow
@pytest.mark.timeout(1800)   # three server starts and a plain instance; 15 min was not enough at load ~30
def test_with_recompute_and_the_fallback_prefill_faults_cost_no_answer(
        tmp_path_factory: pytest.TempPathFactory) -> None:
    """kv_load_failure_policy="recompute" on decode and the proxy's --fallback decode: while prefill is
    killed, restarted and stalled, every answer equals one plain instance's and none is an error (decode
    prefills what did not arrive, and what no prefill took)."""
    from kvferry.workload.vllm_chaos import run_soak

    work = tmp_path_factory.mktemp("vllm-recompute")
    config = SoakConfig(work, policy="recompute", fallback="decode", duration=40.0, sessions=SESSIONS,
                        **CONFIG)  # type: ignore[arg-type]
    report = run_soak(config, faults=[Fault(10.0, "stall", "prefill", 5.0), Fault(25.0, "kill", "prefill")])
    print(report)
    assert {f["action"] for f in report["faults"]} == {"kill", "stall"}, report["faults"]
    assert report["error"] == 0 and report["other"] == 0 and report["equal"] > 0, report
    assert report["over_bound"] == 0, report


@pytest.mark.slow
@pytest.mark.timeout(1800)   # three server starts and a plain instance; 15 min was not enough at load ~30
def test_the_soak_every_fault_of_either_server(tmp_path_factory: pytest.TempPathFactory) -> None:
    """`kvferry vllm-chaos` in short: a kill + restart and a stall of each server; 0 other tokens, no request
    over the bound, both servers idle with every KV block free (their own /metrics) at the end."""
    from kvferry.cli.vllm_chaos import passed
    from kvferry.workload.vllm_chaos import run_soak

    work = tmp_path_factory.mktemp("vllm-soak")
    faults = [Fault(15.0, "stall", "prefill", 5.0), Fault(30.0, "kill", "prefill"), Fault(45.0, "kill", "decode"),
              Fault(60.0, "stall", "decode", 5.0)]
    report = run_soak(SoakConfig(work, duration=70.0, sessions=32), faults=faults)
    print(report)
    assert [(f["action"], f["target"]) for f in report["faults"]] == [(f.action, f.target) for f in faults]
    assert passed(report), report
    assert all(report["kv_after"][n]["free_blocks"] == report["kv_before"][n]["free_blocks"]
               for n in ("prefill", "decode"))
