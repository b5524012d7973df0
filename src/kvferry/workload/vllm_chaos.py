"""Faults at the engine level: ``vllm serve`` processes killed, stalled and restarted under online load.

A test harness, not library code: part of the workload layer (with the demo's, stress's and chaos's harnesses),
beside ``integrations`` (it starts ``kvferry vllm-proxy``, ``integrations.vllm.proxy``, in front of the
servers, as a command), below the ``kvferry vllm-chaos`` command; the tests of docs/vllm.md's "Faults" drive
the same pieces. It lived in ``integrations.vllm`` until issue 29 moved it out of the library's import path.
Nothing here
imports vLLM: the servers are processes (``python -m vllm.entrypoints.openai.api_server``), the load is HTTP
(aiohttp, a vLLM dependency, imported in the functions that need it).

* ``Server``: one ``vllm serve`` process in a process group of its own, so that a kill or a stop reaches
  its engine core too (as a container's OOM kill or a stalled host would); restarted on the same port.
* ``run_load``: multi-turn sessions through the proxy, every answer recorded (tokens, error, time).
* ``fault_schedule`` / ``run_faults``: a seeded schedule of kills + restarts and stalls of either server.
* ``check_answers``: each answered prompt sent again to one plain instance (no disaggregation), greedy
  tokens compared; ``idle_state``: what the servers' own ``/metrics`` say once the load stopped.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from kvferry.errors import KVFerryError, PeerLost, UsageError

__all__ = ["Answer", "Fault", "LoadSpec", "Server", "ServerSpec", "SoakConfig", "check_answers", "fault_schedule",
           "free_port", "idle_state", "kvferry_config", "kvferry_gauges", "nixl_config", "proxy_command",
           "quarantine_peak", "run_faults", "run_load", "run_soak", "server_metrics", "start_servers", "summarize",
           "wait_idle", "write_model"]

BLOCK_SIZE = 32
# What vLLM-CPU needs on a small machine (docs/vllm.md); LD_PRELOAD is added by Server when it can be found.
ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind", "HF_HUB_OFFLINE": "1",
       "TORCHDYNAMO_DISABLE": "1", "KMP_BLOCKTIME": "0", "VLLM_ENABLE_V1_MULTIPROCESSING": "1"}
ROLES = ("prefill", "decode", "plain")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def write_model(path: Path) -> Path:
    """A 2-layer Llama with random weights (greedy tokens depend on the context, so KV that did not arrive
    intact shows in the tokens), as tests/vllm_pd.py writes it. About 2 MB."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=1000, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=2048,
                         initializer_range=0.2, tie_word_embeddings=False)
    LlamaForCausalLM(config).save_pretrained(path, safe_serialization=True)
    return path


def kvferry_config(role: str, policy: str = "fail", **extra: Any) -> dict[str, Any]:
    """kvferry's connector for a ``prefill`` or ``decode`` server; ``extra``: ``kv_connector_extra_config``."""
    return {"kv_connector": "KVFerryConnector", "kv_connector_module_path": "kvferry.integrations.vllm",
            "kv_role": "kv_producer" if role == "prefill" else "kv_consumer", "kv_load_failure_policy": policy,
            "kv_connector_extra_config": extra}


def nixl_config(role: str, policy: str = "fail") -> dict[str, Any]:
    """vLLM's own NixlConnector (decode pulls prefill's blocks), for the comparison."""
    return {"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_buffer_device": "cpu",
            "kv_load_failure_policy": policy}


@dataclass(frozen=True)
class ServerSpec:
    """One ``vllm serve``: its role, HTTP port, ``kv_transfer_config`` (None: a plain instance) and extra
    environment (NixlConnector's side-channel port)."""

    role: str
    port: int
    model: Path
    kv_transfer_config: Mapping[str, Any] | None = None
    env: Mapping[str, str] = field(default_factory=dict)
    max_num_seqs: int = 64
    prefix_caching: bool = True

    def command(self) -> list[str]:
        # Through the server module: vllm-cpu 0.32.0's `vllm` command looks for a distribution named vllm.
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(self.model),
               "--host", "127.0.0.1", "--port", str(self.port), "--skip-tokenizer-init", "--enforce-eager",
               "--dtype", "float32", "--block-size", str(BLOCK_SIZE),
               "--enable-prefix-caching" if self.prefix_caching else "--no-enable-prefix-caching",
               "--max-model-len", "1024", "--gpu-memory-utilization", "0.15", "--max-num-seqs", str(self.max_num_seqs)]
        if self.kv_transfer_config is not None:
            cmd += ["--kv-transfer-config", json.dumps(dict(self.kv_transfer_config))]
        return cmd


def server_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    env = {**os.environ, **ENV, **(extra or {})}
    iomp = Path(sys.executable).resolve().parents[1] / "lib" / "libiomp5.so"
    if "LD_PRELOAD" not in env and iomp.exists():
        env["LD_PRELOAD"] = str(iomp)
    return env


class Server:
    """A ``vllm serve`` process (or any command) in its own process group, restartable on the same port.
    Its output goes to ``log_dir/<name>.<start>.log``."""

    def __init__(self, name: str, command: Sequence[str], log_dir: Path, env: Mapping[str, str] | None = None,
                 url: str | None = None) -> None:
        self.name, self.command, self.log_dir, self.url = name, list(command), log_dir, url
        self.env = dict(env) if env is not None else server_env()
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0
        self.stopped = False

    @classmethod
    def vllm(cls, name: str, spec: ServerSpec, log_dir: Path) -> Server:
        return cls(name, spec.command(), log_dir, server_env(spec.env), f"http://127.0.0.1:{spec.port}")

    @property
    def log(self) -> Path:
        return self.log_dir / f"{self.name}.{self.starts}.log"

    def start(self) -> None:
        self.starts += 1
        self.log_dir.mkdir(parents=True, exist_ok=True)
        with self.log.open("wb") as out:
            self.proc = subprocess.Popen(self.command, stdout=out, stderr=subprocess.STDOUT, env=self.env,
                                         start_new_session=True)
        self.stopped = False

    def signal(self, signum: int) -> None:
        """Send ``signum`` to the whole process group (the API server and its engine core)."""
        if self.proc is None:
            raise UsageError(f"server {self.name} was never started")
        try:
            os.killpg(self.proc.pid, signum)
        except ProcessLookupError:
            return
        self.stopped = signum == signal.SIGSTOP or (self.stopped and signum != signal.SIGCONT)

    def kill(self) -> None:
        """SIGKILL the group and reap the leader; the group's other processes die with it."""
        self.signal(signal.SIGKILL)
        if self.proc is not None:
            self.proc.wait(timeout=30)
        self._wait_group_gone(10.0)

    def terminate(self, timeout: float = 60.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            self._wait_group_gone(1.0)
            return
        if self.stopped:
            self.signal(signal.SIGCONT)
        self.signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.signal(signal.SIGKILL)
            self.proc.wait(timeout=30)
        self._wait_group_gone(10.0)

    def _wait_group_gone(self, timeout: float) -> None:
        """Orphans of the group (vLLM's engine core) may outlive the leader by a moment: wait them out, so
        that a restart finds its port free; SIGKILL what is left at the end."""
        if self.proc is None:
            return
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                os.killpg(self.proc.pid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.1)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def wait_healthy(self, timeout: float = 300.0) -> float:
        """Block until ``/health`` answers 200; returns the seconds it took. ``PeerLost`` naming the server
        and its log when it exits or does not answer within ``timeout``."""
        if self.url is None:
            raise UsageError(f"server {self.name} has no URL to check")
        started = time.monotonic()
        while True:
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as answer:
                    if answer.status == 200:
                        return time.monotonic() - started
            except OSError:
                pass
            if not self.alive():
                raise PeerLost(f"server {self.name} ({self.url}) exited with {self.proc and self.proc.returncode} "
                               f"before it was healthy; see {self.log}")
            if time.monotonic() - started > timeout:
                raise PeerLost(f"server {self.name} ({self.url}) not healthy within {timeout:.0f} s; see {self.log}")
            time.sleep(0.25)


def proxy_command(port: int, prefills: Sequence[str], decodes: Sequence[str], *, timeout: float,
                  prefill_timeout: float, fallback: str = "error", down_for: float = 2.0) -> list[str]:
    cmd = [sys.executable, "-m", "kvferry", "vllm-proxy", "--port", str(port), "--timeout", str(timeout),
           "--prefill-timeout", str(prefill_timeout), "--fallback", fallback, "--down-for", str(down_for)]
    for url in prefills:
        cmd += ["--prefill", url]
    for url in decodes:
        cmd += ["--decode", url]
    return cmd


# -- the load ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class LoadSpec:
    """``sessions`` concurrent multi-turn sessions of ``turns`` turns, each new session seeded from ``seed``;
    greedy answers of ``max_tokens``; a turn that failed is asked again after ``retry_after`` seconds
    (``attempts`` times at most, then the session ends). ``client_timeout`` bounds one request."""

    url: str
    model: str
    sessions: int = 32
    turns: int = 4
    max_tokens: int = 16
    seed: int = 0
    retry_after: float = 1.0
    attempts: int = 3
    client_timeout: float = 120.0


@dataclass
class Answer:
    """One request through the proxy: its prompt, the tokens or the error, when it started (seconds from the
    load's start) and how long it took."""

    prompt: list[int]
    started: float
    elapsed: float
    tokens: list[int] | None = None
    error: str | None = None
    verdict: str = "unchecked"   # "equal", "other" (tokens differ from one plain instance), "error"


def session_turns(rng: np.random.Generator, turns: int) -> list[list[int]]:
    """One session's user tokens: a first prompt of 16-200 tokens, then 8-64 per later turn."""
    return [rng.integers(3, 1000, int(rng.integers(16, 200))).tolist()] + \
           [rng.integers(3, 1000, int(rng.integers(8, 64))).tolist() for _ in range(turns - 1)]


async def run_load(spec: LoadSpec, until: Callable[[], bool], answers: list[Answer]) -> None:
    """Run ``spec.sessions`` sessions at once until ``until()`` is true, each worker starting a new session
    when its last one ended; every request appended to ``answers``."""
    import aiohttp

    t0 = time.monotonic()
    limits = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=limits) as http:
        async def worker(index: int) -> None:
            rng = np.random.default_rng([spec.seed, index])
            while not until():
                await _session(http, spec, session_turns(rng, spec.turns), until, answers, t0)

        await asyncio.gather(*(worker(i) for i in range(spec.sessions)))


async def _session(http: Any, spec: LoadSpec, user: list[list[int]], until: Callable[[], bool],
                   answers: list[Answer], t0: float) -> None:
    context: list[int] = []
    for tokens in user:
        prompt = context + tokens
        for _attempt in range(spec.attempts):
            if until():
                return
            answer = await _complete(http, spec, prompt, t0)
            answers.append(answer)
            if answer.tokens is not None:
                context = prompt + answer.tokens
                break
            await asyncio.sleep(spec.retry_after)
        else:
            return   # the turn failed every time: this session ends, the worker starts another


async def _complete(http: Any, spec: LoadSpec, prompt: list[int], t0: float) -> Answer:
    import aiohttp

    body = {"model": spec.model, "prompt": prompt, "max_tokens": spec.max_tokens, "temperature": 0.0,
            "ignore_eos": True, "return_token_ids": True}
    started = time.monotonic()
    answer = Answer(prompt, started - t0, 0.0)
    try:
        async with http.post(spec.url + "/v1/completions", json=body,
                             timeout=aiohttp.ClientTimeout(total=spec.client_timeout)) as reply:
            text = await reply.text()
        answer.tokens, answer.error = _parse(reply.status, text)
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        answer.error = f"client: {type(exc).__name__} {exc}"
    answer.elapsed = time.monotonic() - started
    return answer


def _parse(status: int, text: str) -> tuple[list[int] | None, str | None]:
    """Tokens of a complete answer, or why it is an error (an HTTP error, ``finish_reason`` "error")."""
    if status != 200:
        return None, f"HTTP {status}: {text[:200]}"
    try:
        choice = json.loads(text)["choices"][0]
    except (ValueError, KeyError, IndexError, TypeError):
        return None, f"HTTP 200 without a choice: {text[:200]}"
    if choice.get("finish_reason") == "error":
        return None, "finish_reason error"
    # Anything else is an answer: a short or odd one is judged against the plain instance like any other.
    return [int(t) for t in choice.get("token_ids") or []], None


# -- faults --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Fault:
    """At ``at`` seconds into the load: ``kill`` (SIGKILL the server's group, then start it again on the same
    port) or ``stall`` (SIGSTOP the group for ``seconds``, then SIGCONT) the ``target`` server."""

    at: float
    action: str
    target: str
    seconds: float = 0.0

    def describe(self) -> str:
        what = f"stall {self.seconds:.1f} s" if self.action == "stall" else "kill + restart"
        return f"{self.at:7.1f} s  {self.target:<8} {what}"


def fault_schedule(seed: int, duration: float, mean_gap: float, targets: Sequence[str],
                   stall: tuple[float, float], actions: Sequence[str] = ("kill", "stall")) -> list[Fault]:
    """A seeded schedule: gaps drawn uniformly in [0.5, 1.5] x ``mean_gap`` (counted from the end of the
    previous fault's recovery when run), each fault a kill or a stall of a target, stalls of
    ``stall`` = (shortest, longest) seconds. Every action and target appears when the schedule is long
    enough: the first ``len(actions) x len(targets)`` faults cycle through all pairs, in a seeded order."""
    rng = np.random.default_rng([seed, 26])
    pairs = [(a, t) for a in actions for t in targets]
    order = [pairs[i] for i in rng.permutation(len(pairs))]
    faults: list[Fault] = []
    at = 0.0
    while True:
        at += float(rng.uniform(0.5, 1.5)) * mean_gap
        if at >= duration:
            return faults
        action, target = order[len(faults)] if len(faults) < len(order) else pairs[int(rng.integers(len(pairs)))]
        seconds = float(rng.uniform(*stall)) if action == "stall" else 0.0
        faults.append(Fault(round(at, 1), action, target, round(seconds, 1)))


async def run_faults(faults: Sequence[Fault], servers: Mapping[str, Server], t0: float, log: list[dict[str, Any]],
                     boot_timeout: float = 300.0, stop_at: float = float("inf")) -> None:
    """Carry out ``faults`` against ``servers`` (by target name) in order, each no earlier than its time and
    after the previous one recovered (a restarted server healthy again), none starting after ``stop_at``
    (a ``time.monotonic()``); ``log`` gets what happened."""
    delay = 0.0
    for fault in faults:
        if t0 + fault.at + delay >= stop_at:
            return
        wait = t0 + fault.at + delay - time.monotonic()
        if wait > 0:
            await asyncio.sleep(wait)
        server = servers[fault.target]
        started = time.monotonic()
        entry: dict[str, Any] = {**asdict(fault), "started": round(started - t0, 2)}
        log.append(entry)   # now: a restart still running when the load ends is cancelled, and counts
        if fault.action == "kill":
            await asyncio.to_thread(server.kill)
            server.start()
            entry["restart_s"] = round(await asyncio.to_thread(server.wait_healthy, boot_timeout), 2)
        elif fault.action == "stall":
            server.signal(signal.SIGSTOP)
            await asyncio.sleep(fault.seconds)
            server.signal(signal.SIGCONT)
        else:
            raise UsageError(f"unknown fault action {fault.action!r} (kill, stall)")
        entry["ended"] = round(time.monotonic() - t0, 2)
        delay += time.monotonic() - started   # the schedule's gaps count from each recovery


# -- checks --------------------------------------------------------------------------------------------
def check_answers(answers: Sequence[Answer], reference_url: str, model: str, max_tokens: int,
                  concurrency: int = 32) -> None:
    """Set each answer's verdict: ``error``, or its tokens against one plain instance's for the same prompt
    (``equal`` / ``other``); each distinct prompt is asked once."""
    prompts = {tuple(a.prompt) for a in answers if a.tokens is not None}
    expected = asyncio.run(_reference(sorted(prompts), reference_url, model, max_tokens, concurrency))
    for answer in answers:
        if answer.tokens is None:
            answer.verdict = "error"
        else:
            answer.verdict = "equal" if expected[tuple(answer.prompt)] == answer.tokens else "other"


async def _reference(prompts: list[tuple[int, ...]], url: str, model: str, max_tokens: int,
                     concurrency: int) -> dict[tuple[int, ...], list[int]]:
    import aiohttp

    spec = LoadSpec(url, model, max_tokens=max_tokens, client_timeout=600.0)
    gate = asyncio.Semaphore(concurrency)
    async with aiohttp.ClientSession() as http:
        async def one(prompt: tuple[int, ...]) -> list[int]:
            async with gate:
                answer = await _complete(http, spec, list(prompt), time.monotonic())
            if answer.tokens is None:
                raise PeerLost(f"the plain instance {url} did not answer a prompt of {len(prompt)} tokens: "
                               f"{answer.error}")
            return answer.tokens

        got = await asyncio.gather(*(one(p) for p in prompts))
    return dict(zip(prompts, got))


_SAMPLE = re.compile(r'^([a-zA-Z_:][\w:]*)(\{[^}]*\})?\s+(\S+)$')


def server_metrics(url: str, timeout: float = 10.0) -> dict[str, float]:
    """A ``vllm serve``'s Prometheus ``/metrics``, samples without labels keyed by name and with labels by
    ``name{labels}``; ``num_blocks`` from ``vllm:cache_config_info`` when it carries it."""
    with urllib.request.urlopen(url + "/metrics", timeout=timeout) as answer:
        text = answer.read().decode()
    samples: dict[str, float] = {}
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if match is None:
            continue
        name, labels, value = match.groups()
        try:
            number = float(value)
        except ValueError:
            continue
        if labels:
            blocks = re.search(r'num_gpu_blocks="(\d+)"', labels)
            if name == "vllm:cache_config_info" and blocks:
                samples["num_blocks"] = float(blocks.group(1))
            samples[name + labels] = number
            # One engine per server here: its gauge is the server's, whatever the labels say.
            samples.setdefault(name, 0.0)
            samples[name] += number
        else:
            samples[name] = number
    return samples


def idle_state(url: str) -> dict[str, float]:
    """What a server's own metrics say about its KV cache and requests: blocks in use, requests running or
    waiting. Free blocks = num_blocks x (1 - usage)."""
    metrics = server_metrics(url)
    usage = metrics.get("vllm:kv_cache_usage_perc", metrics.get("vllm:gpu_cache_usage_perc", float("nan")))
    blocks = metrics.get("num_blocks", float("nan"))
    return {"kv_cache_usage": usage, "num_blocks": blocks, "free_blocks": round(blocks * (1 - usage), 3),
            "running": metrics.get("vllm:num_requests_running", float("nan")),
            "waiting": metrics.get("vllm:num_requests_waiting", float("nan"))}


def kvferry_gauges(url: str) -> dict[str, float]:
    """kvferry's own gauges on a server's ``/metrics`` (``vllm:kvferry_*``: leases, quarantined pages, ...;
    empty with another connector), summed over their labels."""
    return {name: value for name, value in server_metrics(url).items()
            if name.startswith("vllm:kvferry_") and "{" not in name and not name.endswith(("_total", "_created"))}


def wait_idle(url: str, timeout: float) -> tuple[dict[str, float], float]:
    """Poll ``idle_state`` until no request runs or waits and no block is in use, or ``timeout``; returns
    the last state and the seconds it took."""
    started = time.monotonic()
    while True:
        state = idle_state(url)
        if (state["running"] == 0 and state["waiting"] == 0 and state["kv_cache_usage"] == 0) or \
                time.monotonic() - started > timeout:
            return state, round(time.monotonic() - started, 2)
        time.sleep(0.5)


def quarantine_peak(logs: Sequence[Path]) -> int:
    """The largest 'quarantined pages: N now, P at the peak' kvferry's decode logged (0 when none)."""
    peak = 0
    for path in logs:
        if path.exists():
            for match in re.finditer(rb"quarantined pages: \d+ now, (\d+) at the peak", path.read_bytes()):
                peak = max(peak, int(match.group(1)))
    return peak


def summarize(answers: Sequence[Answer], bound: float) -> dict[str, Any]:
    """Counts of verdicts, request times, and the answers open longer than ``bound`` seconds."""
    counts = {v: sum(a.verdict == v for a in answers) for v in ("equal", "error", "other", "unchecked")}
    times = np.array([a.elapsed for a in answers]) if answers else np.zeros(1)
    errors: dict[str, int] = {}
    for a in answers:
        if a.error is not None:
            message = re.sub(r'\{"error": ?\{"message": ?"', "", a.error)
            key = re.sub(r"\d+", "N", message)[:100]
            errors[key] = errors.get(key, 0) + 1
    return {"answers": len(answers), **counts, "max_request_s": round(float(times.max()), 2),
            "p50_request_s": round(float(np.percentile(times, 50)), 3),
            "p99_request_s": round(float(np.percentile(times, 99)), 3),
            "over_bound": int((times > bound).sum()), "bound_s": bound,
            "errors_by_kind": dict(sorted(errors.items(), key=lambda kv: -kv[1])[:8])}


def require(condition: bool, message: str) -> None:
    if not condition:
        raise KVFerryError(message)


# -- the soak ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class SoakConfig:
    """A prefill and a decode ``vllm serve`` behind ``kvferry vllm-proxy``, the load, the faults, the deadlines.

    ``connector``: ``"kvferry"`` or ``"nixl"`` (vLLM's NixlConnector, for comparison). ``policy``: vLLM's
    ``kv_load_failure_policy`` on decode. ``targets``: which servers the faults hit. kvferry's prefill listens
    on a fixed port, so a restarted prefill has the same address and decode reconnects to it.
    ``fallback``: the proxy's, when no prefill answers. Times in seconds."""

    work_dir: Path
    model: Path | None = None
    connector: str = "kvferry"
    policy: str = "fail"
    duration: float = 60.0
    sessions: int = 32
    turns: int = 4
    max_tokens: int = 16
    seed: int = 0
    mean_gap: float = 20.0
    targets: tuple[str, ...] = ("prefill", "decode")
    actions: tuple[str, ...] = ("kill", "stall")
    stall: tuple[float, float] = (4.0, 8.0)
    peer_timeout: float = 2.0
    heartbeat_interval: float = 0.5
    lease_grace: float = 1.0
    request_timeout: float = 20.0
    handshake_timeout: float = 3.0
    prefill_timeout: float = 10.0
    fallback: str = "error"
    digest_mode: str = "sampled"
    prefix_caching: bool = True
    multiprocessing: bool = True   # vLLM's engine core in a process of its own (off: in the API server's)
    prefill_transport: str | None = None   # kvferry's ``transport`` key on prefill (tests slow its writes)

    @property
    def bound(self) -> float:
        """The longest a request may take (seconds; docs/vllm.md, "Faults"): its prefill hop (at most
        ``prefill_timeout``), then decode waiting for its KV (at most ``request_timeout``, or a stall's end
        past ``peer_timeout`` when that is later), a handshake with a restarted prefill inside decode's step
        (``handshake_timeout``), and 5 s for the 16 tokens on a loaded 2-core machine."""
        wait_kv = max(self.request_timeout, self.peer_timeout + self.stall[1])
        return self.prefill_timeout + wait_kv + self.handshake_timeout + 5.0

    def transfer_config(self, role: str, port: int) -> dict[str, Any]:
        if self.connector == "nixl":
            return nixl_config(role, self.policy)
        if self.connector != "kvferry":
            raise UsageError(f"connector must be kvferry or nixl, got {self.connector!r}")
        extra: dict[str, Any] = {"peer_timeout": self.peer_timeout, "heartbeat_interval": self.heartbeat_interval,
                                 "lease_grace": self.lease_grace, "request_timeout": self.request_timeout,
                                 "handshake_timeout": self.handshake_timeout, "digest_mode": self.digest_mode}
        if role == "prefill":
            extra["port"] = port
            if self.prefill_transport is not None:
                extra["transport"] = self.prefill_transport
        return kvferry_config(role, self.policy, **extra)


def start_servers(config: SoakConfig, model: Path) -> dict[str, Server]:
    """Prefill, decode and the proxy, started (not yet healthy)."""
    logs = config.work_dir / "logs"
    ports = {name: free_port() for name in ("prefill", "decode", "proxy", "kv", "side_p", "side_d")}
    servers: dict[str, Server] = {}
    for role, side in (("prefill", "side_p"), ("decode", "side_d")):
        env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "1" if config.multiprocessing else "0"}
        if config.connector == "nixl":
            env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(ports[side])
        spec = ServerSpec(role, ports[role], model, config.transfer_config(role, ports["kv"]), env,
                          prefix_caching=config.prefix_caching)
        servers[role] = Server.vllm(role, spec, logs)
    urls = [servers["prefill"].url or "", servers["decode"].url or ""]
    servers["proxy"] = Server("proxy", proxy_command(ports["proxy"], urls[:1], urls[1:], timeout=config.bound + 30,
                                                     prefill_timeout=config.prefill_timeout,
                                                     fallback=config.fallback),
                              logs, url=f"http://127.0.0.1:{ports['proxy']}")
    for server in servers.values():
        server.start()
    return servers


def run_soak(config: SoakConfig, progress: Callable[[str], None] = lambda line: None,
             faults: Sequence[Fault] | None = None) -> dict[str, Any]:
    """The whole soak: servers up, the load with its faults (``faults``, or the seeded schedule) for
    ``duration`` seconds and until the last fault recovered, the servers idle again, every answer checked
    against one plain instance. Returns the report (``summarize`` plus the faults, the servers' KV blocks
    before and after, decode's quarantine peak)."""
    config.work_dir.mkdir(parents=True, exist_ok=True)
    model = config.model or write_model(config.work_dir / "model")
    servers = start_servers(config, model)
    try:
        for server in servers.values():
            server.wait_healthy()
        progress("servers healthy")
        spec = LoadSpec(servers["proxy"].url or "", str(model), config.sessions, config.turns, config.max_tokens,
                        config.seed, client_timeout=config.bound + 60)
        warm = asyncio.run(_one(spec, [1, 2, 3]))
        require(warm.tokens is not None, f"the first request through the proxy failed: {warm.error}")
        before = {name: wait_idle(servers[name].url or "", 30)[0] for name in ("prefill", "decode")}
        scheduled = faults is None   # a schedule is cut at the duration; faults given are all carried out
        if faults is None:
            faults = fault_schedule(config.seed, config.duration, config.mean_gap, config.targets, config.stall,
                                    config.actions)
        started = time.monotonic()
        answers, done = _soak(config, spec, servers, faults, scheduled)
        load_s = round(time.monotonic() - started, 1)
        progress(f"load done: {len(answers)} answers, {len(done)} faults")
        after = {name: wait_idle(servers[name].url or "", config.request_timeout + 30)
                 for name in ("prefill", "decode")}
        peak = quarantine_peak(sorted((config.work_dir / "logs").glob("decode.*.log")))
        gauges = {name: kvferry_gauges(servers[name].url or "") for name in ("prefill", "decode")}
    finally:
        for server in servers.values():
            server.terminate()
    progress("checking answers against one plain instance")
    plain = ServerSpec("plain", free_port(), model, prefix_caching=config.prefix_caching)
    reference = Server.vllm("plain", plain, config.work_dir / "logs")
    reference.start()
    try:
        reference.wait_healthy()
        check_answers(answers, reference.url or "", str(model), config.max_tokens)
    finally:
        reference.terminate()
    with (config.work_dir / "answers.jsonl").open("w") as out:   # every request, for a closer look
        for answer in answers:
            out.write(json.dumps({"started": round(answer.started, 3), "elapsed": round(answer.elapsed, 3),
                                  "verdict": answer.verdict, "prompt_tokens": len(answer.prompt),
                                  "error": answer.error}) + "\n")
    report = summarize(answers, config.bound)
    report.update(connector=config.connector, policy=config.policy, duration_s=config.duration, load_s=load_s,
                  sessions=config.sessions, seed=config.seed, faults=done,
                  restarts={name: servers[name].starts - 1 for name in ("prefill", "decode")},
                  kv_before={k: v for k, v in before.items()},
                  kv_after={k: {**v[0], "idle_after_s": v[1]} for k, v in after.items()},
                  decode_peak_quarantined_pages=peak, kvferry_after=gauges)
    return report


async def _one(spec: LoadSpec, prompt: list[int]) -> Answer:
    import aiohttp

    async with aiohttp.ClientSession() as http:
        return await _complete(http, spec, prompt, time.monotonic())


def _soak(config: SoakConfig, spec: LoadSpec, servers: Mapping[str, Server], faults: Sequence[Fault],
          cut: bool) -> tuple[list[Answer], list[dict[str, Any]]]:
    """The load for ``duration`` seconds and until every fault recovered (a restart still booting at the
    end runs under load too); the faults' log."""
    answers: list[Answer] = []
    done: list[dict[str, Any]] = []

    async def both() -> None:
        t0 = time.monotonic()
        end = t0 + config.duration
        chaos = asyncio.create_task(run_faults(faults, servers, t0, done, stop_at=end if cut else float("inf")))
        await run_load(spec, lambda: time.monotonic() >= end and chaos.done(), answers)
        if chaos.exception() is not None:
            raise chaos.exception()  # type: ignore[misc]

    asyncio.run(both())
    return answers, done
