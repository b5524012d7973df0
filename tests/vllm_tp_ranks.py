"""One process per vLLM TP rank, for tests/test_vllm_tp.py: kvferry's connector halves without vLLM.

Each rank is a child process holding one worker-side half (``WorkerSide``) over numpy "KV caches" shaped as
vLLM-CPU's (``[num_blocks, kv_heads of this rank, block_size, 2 x head_size]``, head-major), bound through the
connector's own ``memory_from_kv_caches`` with the rank's ``RankPlace``. The test process plays vLLM's engine
core: it runs the scheduler-side halves (``SchedulerSide``) and hands every rank of an instance the same
``StepPlan``, as vLLM broadcasts connector metadata to its workers; a request is finished for vLLM when every
rank reported it (vLLM's ``KVOutputAggregator``), and failed when any did.

Prefill's KV is one global array per layer, ``[blocks, all KV heads, block_size, 2 x head_size]``, made from
a seed; rank ``r`` of ``P`` holds heads ``[r H/P, (r+1) H/P)``. Decode's untouched blocks hold ``SENTINEL``.
"""

from __future__ import annotations

import multiprocessing as mp
import time
import traceback
from dataclasses import dataclass
from typing import Any

import numpy as np

LAYERS = ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn")
BLOCK_SIZE = 16
HEAD_SIZE = 8
NUM_BLOCKS = {"producer": 160, "consumer": 128}
SENTINEL = -7.0
LATENT = 576   # vLLM-CPU's MLA latent width (kv_lora_rank 512 + rope 64)


@dataclass(frozen=True)
class RankSpec:
    role: str              # "producer" (prefill) or "consumer" (decode)
    tp_size: int
    tp_rank: int
    total_heads: int       # the model's KV heads
    transport: str = "nixl"
    fault: str | None = None   # a FaultyTransport spec for this rank's prefill writes ("flip:<buffer>")
    seed: int = 5
    mode: str = "push"         # a consumer's transfer mode
    mla: bool = False          # MLA: one latent cache, the same on every rank (``[blocks, block_size, LATENT]``)


def global_kv(seed: int, total_heads: int, layer: int, mla: bool = False) -> np.ndarray:
    """Prefill's KV of one layer for the whole TP group (MLA: the one latent cache every rank holds)."""
    rng = np.random.default_rng(seed * 100 + layer)
    shape = ((NUM_BLOCKS["producer"], BLOCK_SIZE, LATENT) if mla
             else (NUM_BLOCKS["producer"], total_heads, BLOCK_SIZE, 2 * HEAD_SIZE))
    return rng.standard_normal(shape).astype(np.float32)


def head_slice(total_heads: int, tp_size: int, tp_rank: int) -> slice:
    per = total_heads // tp_size
    return slice(tp_rank * per, (tp_rank + 1) * per)


def rank_caches(spec: RankSpec) -> dict[str, np.ndarray]:
    if spec.mla:   # replicated: every prefill rank the same bytes
        if spec.role == "producer":
            return {name: global_kv(spec.seed, 0, i, mla=True) for i, name in enumerate(LAYERS)}
        return {name: np.full((NUM_BLOCKS["consumer"], BLOCK_SIZE, LATENT), SENTINEL, dtype=np.float32)
                for name in LAYERS}
    heads = head_slice(spec.total_heads, spec.tp_size, spec.tp_rank)
    if spec.role == "producer":
        return {name: np.ascontiguousarray(global_kv(spec.seed, spec.total_heads, i)[:, heads])
                for i, name in enumerate(LAYERS)}
    shape = (NUM_BLOCKS["consumer"], heads.stop - heads.start, BLOCK_SIZE, 2 * HEAD_SIZE)
    return {name: np.full(shape, SENTINEL, dtype=np.float32) for name in LAYERS}


_FAULT: list[str] = []   # this child's fault, read by ``faulty`` when the connector builds its transport


def faulty(side: str) -> Any:
    """``WorkerConfig.transport = "tests.vllm_tp_ranks:faulty"``: NIXL, with this rank's prefill writes
    corrupted in flight as ``_FAULT`` says (source bytes flipped while the write reads them, then restored)."""
    from kvferry.transport import make_transport
    from kvferry.workload.faults import FaultyTransport

    inner = make_transport("nixl")
    return FaultyTransport(inner, _FAULT[0]) if side == "prefill" and _FAULT else inner


def _worker(spec: RankSpec) -> Any:
    from kvferry.integrations.vllm.layout import GroupSpec, RankPlace, memory_from_kv_caches, rank_kv_heads
    from kvferry.integrations.vllm.worker import WorkerConfig, WorkerSide

    caches = rank_caches(spec)
    place = (RankPlace(spec.tp_size, spec.tp_rank, None, replicated=True) if spec.mla
             else RankPlace(spec.tp_size, spec.tp_rank, rank_kv_heads(spec.total_heads, spec.tp_size)))
    memory = memory_from_kv_caches(caches, (GroupSpec(LAYERS, BLOCK_SIZE),), NUM_BLOCKS[spec.role], place=place)
    if spec.fault:
        _FAULT.append(spec.fault)
    extra = {"transport": "tests.vllm_tp_ranks:faulty", "digest_mode": "full", "request_timeout": 30.0,
             "mode": spec.mode}
    return WorkerSide(WorkerConfig.from_extra(spec.role, extra), memory), caches


def serve(spec: RankSpec, conn: Any) -> None:
    """The child: report the address, then answer ``("plan", StepPlan)``, ``("collect", ids, timeout)`` and
    ``("exit",)`` messages."""
    try:
        worker, caches = _worker(spec)
    except Exception as exc:
        conn.send(("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
        return
    conn.send(("ready", worker.address))
    done: set[str] = set()
    failed: dict[str, str] = {}
    report = worker._report_failure

    def record(request_id: str, error: Any) -> None:   # the reason vLLM's log line gives, kept for the test
        failed[request_id] = str(error)
        report(request_id, error)

    worker._report_failure = record
    while True:
        msg = conn.recv()
        if msg[0] == "exit":
            worker.close()
            conn.send(("bye",))
            return
        if msg[0] == "plan":
            try:
                worker.start(msg[1])
                conn.send(("ok",))
            except Exception as exc:
                conn.send(("error", f"{type(exc).__name__}: {exc}"))
        elif msg[0] == "collect":
            conn.send(("collected", *_collect(worker, set(msg[1]), msg[2], done, failed)))
        elif msg[0] == "caches":
            conn.send(("caches", {name: arr.copy() for name, arr in caches.items()}))


def _collect(worker: Any, want: set[str], timeout: float, done: set[str],
             failed: dict[str, str]) -> tuple[set[str], dict[str, str]]:
    deadline = time.monotonic() + timeout
    while not want <= done and time.monotonic() < deadline:
        sending, recving, _ = worker.results()   # failures: recorded by serve's hook, with their reasons
        done |= sending | recving
        time.sleep(0.005)
    return set(done), dict(failed)


class Rank:
    """The test's handle on one rank's process."""

    def __init__(self, spec: RankSpec) -> None:
        ctx = mp.get_context("spawn")
        self.spec = spec
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=serve, args=(spec, child), daemon=True)
        self.proc.start()
        reply = self._reply(60)
        assert reply[0] == "ready", reply
        self.address: str | None = reply[1]

    def _reply(self, timeout: float) -> Any:
        if not self.conn.poll(timeout):
            raise AssertionError(f"rank {self.spec} did not answer in {timeout} s")
        return self.conn.recv()

    def plan(self, plan: Any) -> None:
        self.conn.send(("plan", plan))
        reply = self._reply(30)
        assert reply == ("ok",), reply

    def collect(self, ids: list[str], timeout: float = 30.0) -> tuple[set[str], dict[str, str]]:
        self.conn.send(("collect", ids, timeout))
        reply = self._reply(timeout + 30)
        return reply[1], reply[2]

    def caches(self) -> dict[str, np.ndarray]:
        self.conn.send(("caches",))
        return self._reply(30)[1]

    def close(self) -> None:
        if self.proc.is_alive():
            try:
                self.conn.send(("exit",))
                self._reply(15)
            except (AssertionError, OSError, EOFError):
                pass
            self.proc.join(10)
            if self.proc.is_alive():
                self.proc.kill()
