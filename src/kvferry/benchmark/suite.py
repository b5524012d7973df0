"""The benchmark suite behind ``kvferry bench``: planner, transport and request latency, as one dict.

Above ``workload`` (it drives the planner, the transports and a workload run), below ``cli``. Every figure is
measured in the run that reports it, with its baselines measured in the same run on the same bytes; nothing
here is a constant figure. Three sections:

* **planning**: ``plan_transfer`` against two baselines written as engines commonly write them (one
  descriptor per (buffer, page); coalesce runs, then a Python loop over buffers), on a DeepSeek-V3.2-sized
  layout (61 layers x 3 buffers) with synthetic addresses, for requests of increasing page counts.
* **bandwidth**: a decode process (spawned, its own NIXL agent, progress thread off, busy-polling its
  notifications) receives requests of ~1 MiB to ~1 GiB from this process. Timed from ``plan_transfer``
  to the moment decode sees the notification (both clocks are CLOCK_MONOTONIC). Rows: kvferry over NIXL
  (planned rows of fragmented page runs, as allocators that reuse pages hand them out), raw NIXL (the
  same byte count as one contiguous descriptor per buffer, the best case a hand-written sender can reach),
  raw NIXL posting kvferry's rows (the same fragmented rows without planning or checks, which separates
  kvferry's own cost from the cost of fragmentation) and ``memcpy`` (``np.copyto`` in one process).
* **latency**: request latency in a control-plane run (``kvferry.workload.runner``, as ``kvferry demo`` runs it: a
  multi-session workload, decode and prefill endpoints in two processes over NIXL), and the distribution
  of transport round trips (plan, NIXL write, notification seen by decode) for 4k-token requests, each
  to freshly drawn pages.

Without the ``nixl`` package the two NIXL sections run over ``LocalTransport`` in one process and say so.
``run_suite`` is the entry point; ``bench/plan.py`` reuses the planning functions.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import importlib.util
import multiprocessing as mp
import os
import platform
import statistics
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from kvferry.layout.memory import KVMemory, Region
from kvferry.layout.presets import deepseek_v32
from kvferry.layout.spec import Buffer, Layout, Pool
from kvferry.plan.planner import TransferPlan, plan_transfer
from kvferry.transport.base import RowBuffer, check_plan_in_regions, pages_in_regions, short_runs
from kvferry.version import __version__

__all__ = ["MODES", "SuiteConfig", "bandwidth_sweep", "control_plane_run", "machine", "nixl_available",
           "per_page_descs", "plan_case", "planner_layout", "planning_sweep", "random_runs", "round_trips",
           "run_suite", "runs_loop_descs", "synthetic_memory", "timed_median", "transfer_layout", "transfer_sections"]

MiB = 1 << 20
# The planner layout: DeepSeek V3.2's MLA latent (656 B/token), fp8 indexer keys (132 B/token) and the
# bf16 indexer-key shadow of the token-salad case (256 B/token), 61 layers, 64-token pages.
PLAN_LAYERS = 61
PLAN_TOKENS_PER_PAGE = 64
PLAN_BYTES_PER_TOKEN = {"mla": 656, "idx": 132, "idx_bf16": 256}
# The transfer layout: DeepSeek V3.2 (fp8 indexer) cut to 8 layers, so one page is ~0.38 MiB and a
# request of ~1 MiB is a few pages while ~1 GiB still fits two copies in a CI machine's memory.
XFER_LAYERS = 8
MEAN_RUN = 4.0  # mean length of a page run: allocators that free and reuse pages fragment requests
LATENCY_TOKENS = 4096  # the latency section's request: one 4k-token prompt
ProgressFn = Callable[[str], None]


@dataclass(frozen=True, slots=True)
class SuiteConfig:
    """How much to measure. ``MODES`` holds the three presets: full, quick (< ~60 s on 2 cores), tiny (CI)."""

    mode: str
    sizes_mib: tuple[float, ...]       # bandwidth: request sizes
    plan_pages: tuple[int, ...]        # planning: pages per request
    repeats: int                       # bandwidth: timed repeats per method and size (after one warm-up)
    plan_repeats: int                  # planning: most repeats per measurement
    plan_budget_s: float               # planning: time budget per measurement (at least 5 repeats)
    latency_requests: int              # latency: transport round trips timed
    sessions: int                      # latency: concurrent sessions of the control-plane run (4 turns each)
    workload_mib: int                  # latency: KV memory per side of the control-plane run
    seed: int = 0


MODES: dict[str, SuiteConfig] = {
    "full": SuiteConfig("full", sizes_mib=(1, 4, 16, 64, 256, 1024), plan_pages=(16, 64, 256, 1024, 4096),
                        repeats=7, plan_repeats=300, plan_budget_s=2.0, latency_requests=300, sessions=80,
                        workload_mib=512),
    "quick": SuiteConfig("quick", sizes_mib=(1, 16, 256), plan_pages=(16, 256, 4096), repeats=5,
                         plan_repeats=100, plan_budget_s=0.5, latency_requests=100, sessions=24, workload_mib=256),
    "tiny": SuiteConfig("tiny", sizes_mib=(1, 4), plan_pages=(16, 256), repeats=3, plan_repeats=20,
                        plan_budget_s=0.1, latency_requests=20, sessions=8, workload_mib=128),
}


def run_suite(config: SuiteConfig, progress: ProgressFn | None = None) -> dict[str, Any]:
    """Run every section; return one JSON-ready dict of figures (plus the machine and the config).

    Blocking (about a minute in full mode on 2 cores); spawns child processes (a decode peer for the
    transfer sections, both sides of the control-plane run) and always reaps them. ``progress`` gets a
    short line before each step. Raises ``RuntimeError`` if a run failed or moved the wrong bytes.
    """
    say = progress or (lambda _msg: None)
    started = time.monotonic()
    say("planning")
    planning = planning_sweep(config, say)
    bandwidth, round_trips = transfer_sections(config, say)
    say("control-plane run")
    latency = {"control_plane": control_plane_run(config), "transport": round_trips}
    return {"kvferry_version": __version__, "machine": machine(), "config": asdict(config),
            "planning": planning, "bandwidth": bandwidth, "latency": latency,
            "seconds": time.monotonic() - started}


def machine() -> dict[str, Any]:
    """What ran the figures: CPU model, cores, memory, OS, Python and library versions."""
    versions = {}
    for pkg in ("numpy", "nixl"):
        try:
            versions[pkg] = importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            versions[pkg] = None
    return {"cpu": _cpu_model(), "cores": os.cpu_count(), "memory_gib": _memory_gib(),
            "system": f"{platform.system()} {platform.release()}", "python": platform.python_version(),
            **versions}


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _memory_gib() -> float | None:
    try:
        return round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    except (ValueError, OSError, AttributeError):
        return None


# -- shared helpers --------------------------------------------------------------------------------------
def random_runs(rng: np.random.Generator, num_pages: int, capacity: int, mean_run: float = MEAN_RUN) -> np.ndarray:
    """``num_pages`` distinct pages below ``capacity`` as runs of geometric length (mean ``mean_run``),
    placed at random gaps and listed in random order, as a fragmented free list hands them out."""
    if num_pages > capacity:
        raise ValueError(f"{num_pages} pages do not fit a capacity of {capacity}")
    lengths = []
    left = num_pages
    while left:
        lengths.append(min(int(rng.geometric(1 / mean_run)), left))
        left -= lengths[-1]
    runs = np.array(lengths, dtype=np.int64)
    gaps = np.diff(np.sort(rng.integers(0, capacity - num_pages + 1, len(runs))), prepend=0)
    starts = np.cumsum(np.concatenate(([0], runs[:-1]))) + np.cumsum(gaps)
    order = rng.permutation(len(runs))
    return np.concatenate([np.arange(starts[i], starts[i] + runs[i]) for i in order])


def timed_median(fn: Callable[[], object], max_repeats: int, budget_s: float = float("inf"),
                 min_repeats: int = 5) -> float:
    """Median seconds of ``fn()`` after a warm-up: ``max_repeats`` runs, or fewer once ``budget_s`` is
    spent (never fewer than ``min_repeats``)."""
    fn()
    samples: list[float] = []
    deadline = time.perf_counter() + budget_s
    while len(samples) < max_repeats and (len(samples) < min_repeats or time.perf_counter() < deadline):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


# -- planning --------------------------------------------------------------------------------------------
def planner_layout(num_pages: int, layers: int = PLAN_LAYERS) -> Layout:
    """The planning layout: one pool, ``layers`` x 3 buffers of different page sizes."""
    bufs = [Buffer(f"L{layer}.{role}", PLAN_TOKENS_PER_PAGE * bpt, num_pages, "fp8", role, layer)
            for layer in range(layers) for role, bpt in PLAN_BYTES_PER_TOKEN.items()]
    return Layout([Pool("kv", bufs, PLAN_TOKENS_PER_PAGE)])


def synthetic_memory(layout: Layout, base: int) -> KVMemory:
    """Addresses only (a remote binding): planning never touches the bytes, so none are allocated."""
    regions, addr = [], base
    for b in layout.buffers:
        regions.append(Region(b.name, addr, b.nbytes))
        addr += b.nbytes + 4096
    return KVMemory(layout, regions, remote=True)


def per_page_descs(src: KVMemory, dst: KVMemory, s: np.ndarray, d: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Baseline: one descriptor per (buffer, page), numpy inside a Python loop over buffers."""
    rows_s, rows_d = [], []
    for buf, rs, rd in zip(src.layout.buffers, src.regions, dst.regions):
        a = np.empty((len(s), 3), np.uint64)
        a[:, 0] = rs.address + s.astype(np.uint64) * buf.page_bytes
        a[:, 1] = buf.page_bytes
        a[:, 2] = 0
        b = a.copy()
        b[:, 0] = rd.address + d.astype(np.uint64) * buf.page_bytes
        rows_s.append(a)
        rows_d.append(b)
    return np.concatenate(rows_s), np.concatenate(rows_d)


def runs_loop_descs(src: KVMemory, dst: KVMemory, s: np.ndarray, d: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Baseline: coalesce joint runs once, then a Python loop over buffers emits the rows."""
    brk = np.ones(len(s), dtype=bool)
    brk[1:] = (s[1:] != s[:-1] + 1) | (d[1:] != d[:-1] + 1)
    starts = np.flatnonzero(brk)
    lens = np.diff(np.append(starts, len(s))).astype(np.uint64)
    rs0, rd0 = s[starts].astype(np.uint64), d[starts].astype(np.uint64)
    rows_s, rows_d = [], []
    for buf, rs, rd in zip(src.layout.buffers, src.regions, dst.regions):
        a = np.empty((len(starts), 3), np.uint64)
        a[:, 0] = rs.address + rs0 * buf.page_bytes
        a[:, 1] = lens * buf.page_bytes
        a[:, 2] = 0
        b = a.copy()
        b[:, 0] = rd.address + rd0 * buf.page_bytes
        rows_s.append(a)
        rows_d.append(b)
    return np.concatenate(rows_s), np.concatenate(rows_d)


def plan_case(pages: int, *, capacity: int = 20_000, mean_run: float = MEAN_RUN, seed: int = 0,
              max_repeats: int = 300, budget_s: float = float("inf"), min_repeats: int = 5,
              layers: int = PLAN_LAYERS) -> dict[str, Any]:
    """Median planning times (us) of one request of ``pages`` pages: kvferry and both baselines.

    kvferry is timed four ways: ``plan_transfer`` alone (the compact plan); plus the N x 3 arrays
    materialised on the plan (``src_descs``/``dst_descs``); plus the region check and the rows written
    into a reused buffer (``NixlTransport(descriptors="dlist")``); plus what ``NixlTransport.write`` does
    before NIXL by default (``descriptors="auto"``: page indices for short runs, else the rows).

    Checks first that the runs+loop baseline and kvferry produce the same rows in the same order, so the
    speeds compared are speeds of the same work. Raises ``AssertionError`` if they differ.
    """
    lay = planner_layout(capacity, layers)
    src, dst = synthetic_memory(lay, 1 << 40), synthetic_memory(lay, 1 << 44)
    rng = np.random.default_rng(seed)
    s, d = random_runs(rng, pages, capacity, mean_run), random_runs(rng, pages, capacity, mean_run)
    req = {"kv": (s, d)}
    plan = plan_transfer(src, dst, req)
    base_s, base_d = runs_loop_descs(src, dst, s, d)
    assert np.array_equal(base_s, plan.src_descs) and np.array_equal(base_d, plan.dst_descs)

    def plan_and_expand() -> None:
        p = plan_transfer(src, dst, req)
        p.src_descs, p.dst_descs  # noqa: B018 - materialise both sides

    rows = RowBuffer()
    got_src, got_dst = rows.rows(plan)
    assert np.array_equal(got_src, base_s) and np.array_equal(got_dst, base_d)

    got_sel = rows.selectors(plan)
    want_sel = plan.page_selectors()
    assert np.array_equal(got_sel[0], want_sel[0]) and np.array_equal(got_sel[1], want_sel[1])

    def plan_and_rows() -> None:
        # What NixlTransport(descriptors="dlist").write does before NIXL: the region check, then the rows.
        p = plan_transfer(src, dst, req)
        check_plan_in_regions(p, src, dst, "bench", "bench")
        rows.rows(p)

    def plan_and_post() -> None:
        # What NixlTransport.write does before NIXL by default ("auto"): for short runs, runs and pages
        # checked against the capacities, then int32 page indices into its prepared lists; else rows.
        p = plan_transfer(src, dst, req)
        if short_runs(p) and pages_in_regions(p, src, dst):
            rows.selectors(p)
        else:
            check_plan_in_regions(p, src, dst, "bench", "bench")
            rows.rows(p)

    def us(fn: Callable[[], object]) -> float:
        return timed_median(fn, max_repeats, budget_s, min_repeats) * 1e6

    return {
        "pages": pages, "buffers": len(lay.buffers), "nbytes": plan.nbytes,
        "joint_runs": plan.num_descriptors // len(lay.buffers),
        "per_page_rows": pages * len(lay.buffers), "kvferry_rows": plan.num_descriptors,
        "per_page_us": us(lambda: per_page_descs(src, dst, s, d)),
        "runs_loop_us": us(lambda: runs_loop_descs(src, dst, s, d)),
        "kvferry_plan_us": us(lambda: plan_transfer(src, dst, req)),
        "kvferry_plan_expand_us": us(plan_and_expand),
        "kvferry_plan_rows_us": us(plan_and_rows),
        "kvferry_plan_post_us": us(plan_and_post),
        "kvferry_posts": "page indices" if short_runs(plan) and pages_in_regions(plan, src, dst) else "rows",
        "kvferry_selectors": plan.num_selectors,
    }


def planning_sweep(config: SuiteConfig, say: ProgressFn) -> dict[str, Any]:
    """``plan_case`` for each of ``config.plan_pages``, with the layout described once."""
    rows = []
    for i, pages in enumerate(config.plan_pages):
        say(f"planning: {pages} pages")
        rows.append(plan_case(pages, seed=config.seed + i, max_repeats=config.plan_repeats,
                              budget_s=config.plan_budget_s))
    return {"layout": f"{PLAN_LAYERS} layers x {len(PLAN_BYTES_PER_TOKEN)} buffers, "
                      f"{PLAN_TOKENS_PER_PAGE}-token pages, synthetic addresses",
            "mean_run": MEAN_RUN, "rows": rows}


# -- the decode side in its own process ------------------------------------------------------------------
def transfer_layout(num_pages: int) -> Layout:
    """The bandwidth and latency layout: DeepSeek V3.2 with ``XFER_LAYERS`` layers."""
    return deepseek_v32(num_pages, num_layers=XFER_LAYERS)


def nixl_available() -> bool:
    # find_spec, not import: importing the nixl meta package imports torch (~1 s).
    return importlib.util.find_spec("nixl") is not None


def _decode_main(conn: Connection, manifest: bytes) -> None:
    """Child process: own memory and NIXL agent, then serve ``arrival``/``pages``/``exit`` commands.

    Between commands and while waiting for a notification it calls ``get_notifications``: with the
    progress thread off, the receiving side drives UCX progress or the first write never completes.
    """
    from kvferry.transport.nixl import NixlTransport

    memory = KVMemory.allocate(Layout.from_manifest(manifest))
    for buf in memory.layout.buffers:
        memory.array(buf.name).fill(1)  # fault every page in now, not inside a timed write
    transport = NixlTransport()
    conn.send((transport.register(memory), memory.manifest()))
    seen: dict[bytes, float] = {}
    while True:
        _collect(transport, seen)
        if not conn.poll(1e-4):
            continue
        try:
            verb, *args = conn.recv()
        except EOFError:  # the parent is gone: stop spinning
            break
        if verb == "exit":
            break
        if verb == "arrival":
            conn.send("ready")
            conn.send(_arrival(transport, seen, *args))
        elif verb == "pages":
            conn.send(memory.array(args[0])[args[1]].tobytes())
    transport.close()


def _collect(transport: Any, seen: dict[bytes, float]) -> None:
    notifs = transport.get_notifications()
    # Stamped after the call returns: a call that was descheduled mid-way must not date an arrival early.
    now = time.perf_counter()
    for _peer, msg in notifs:
        seen.setdefault(msg, now)


def _arrival(transport: Any, seen: dict[bytes, float], tag: bytes, timeout: float) -> float | None:
    """Busy-poll until ``tag`` arrived; its arrival time (``perf_counter``), or None after ``timeout``."""
    deadline = time.monotonic() + timeout
    while tag not in seen and time.monotonic() < deadline:
        _collect(transport, seen)
    return seen.pop(tag, None)


PagesArg = dict[str, tuple[np.ndarray, np.ndarray]]


class _Peer(ABC):
    """This process is prefill; the peer is decode. Subclasses: NIXL in a child process, or local."""

    transport = "abstract"
    can_raw = False

    def __init__(self, src: KVMemory) -> None:
        self.src = src
        self.dst: KVMemory = src  # replaced by start()
        self.xport: Any = None
        self.peer = ""
        self._seq = 0

    def write(self, pages: PagesArg) -> Callable[[bytes], None]:
        """A poster that plans ``pages`` and writes them with the kvferry transport, waiting for completion."""
        def post(tag: bytes) -> None:
            plan = plan_transfer(self.src, self.dst, pages)
            with self.xport.write(plan, self.peer, tag, label="bench") as handle:
                handle.wait(60.0)
        return post

    def _tag(self) -> bytes:
        self._seq += 1
        return f"bench-{self._seq}".encode()

    @abstractmethod
    def start(self) -> None:
        """Bring up decode and connect this side's transport to it (sets ``dst``, ``xport``, ``peer``)."""

    @abstractmethod
    def end_to_end(self, post: Callable[[bytes], None]) -> float:
        """Seconds from ``post(tag)`` until decode has seen the notification ``tag``."""

    @abstractmethod
    def dst_pages(self, buffer: str, pages: np.ndarray) -> bytes:
        """The bytes decode holds in ``pages`` of ``buffer``."""

    def raw_write(self, src: np.ndarray, dst: np.ndarray) -> Callable[[bytes], None]:
        """A poster of raw NIXL writes; only where ``can_raw``."""
        raise NotImplementedError(f"no raw writes over {self.transport}")

    @abstractmethod
    def close(self) -> None:
        """Release the transports and stop decode. Idempotent."""


class _NixlPeer(_Peer):
    """Decode in a spawned process with its own NIXL agent (``_decode_main``), driven over a pipe."""

    transport = "nixl"
    can_raw = True

    def start(self) -> None:
        from kvferry.transport.nixl import NixlTransport

        ctx = mp.get_context("spawn")  # no forked NIXL/UCX state in the child
        self.conn, theirs = ctx.Pipe()
        # Decode's own layout where it differs (bench/page_sizes.py: another page size), else prefill's
        layout = getattr(self, "dst_layout", None) or self.src.layout
        self.process = ctx.Process(target=_decode_main, args=(theirs, layout.to_manifest()), daemon=True)
        self.process.start()
        deadline = time.monotonic() + 120
        while not self.conn.poll(0.1):
            if not self.process.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the decode process did not start (exit code {self.process.exitcode})")
        metadata, manifest = self.conn.recv()
        self.xport = NixlTransport()
        self.xport.register(self.src)
        self.peer = self.xport.add_peer(metadata)
        self.dst = KVMemory.from_manifest(manifest)

    def end_to_end(self, post: Callable[[bytes], None]) -> float:
        tag = self._tag()
        self.conn.send(("arrival", tag, 60.0))
        self.conn.recv()  # "ready": decode busy-polls from now on, so its clock is not asleep
        start = time.perf_counter()
        post(tag)
        arrived = self.conn.recv()
        if not isinstance(arrived, float):
            raise RuntimeError(f"notification {tag!r} did not reach the decode process within 60 s")
        return arrived - start  # perf_counter is CLOCK_MONOTONIC: one clock for both processes

    def dst_pages(self, buffer: str, pages: np.ndarray) -> bytes:
        self.conn.send(("pages", buffer, pages.tolist()))
        return self.conn.recv()

    def raw_write(self, src: np.ndarray, dst: np.ndarray) -> Callable[[bytes], None]:
        """Raw NIXL: post the ``N x 3`` rows ``src`` -> ``dst`` as one WRITE; no planning, no checks."""
        from kvferry.transport.nixl import NixlHandle

        # The transport's own agent: same connection and registrations, so only the descriptors differ.
        agent = self.xport.agent

        def post(tag: bytes) -> None:
            xfer = agent.initialize_xfer("WRITE", agent.get_xfer_descs(src, "DRAM"),
                                         agent.get_xfer_descs(dst, "DRAM"), self.peer, tag)
            status = agent.transfer(xfer)
            if status == "ERR":
                xfer.release()
                raise RuntimeError("raw NIXL write failed")
            # NixlHandle only for its wait: the same polling policy as the kvferry row, for a fair race.
            with NixlHandle(self.xport, xfer, self.peer, "raw", done=status == "DONE") as handle:
                handle.wait(60.0)
        return post

    def close(self) -> None:
        if self.xport is not None:
            self.xport.close()
        proc = getattr(self, "process", None)
        if proc is None:
            return
        if proc.is_alive():
            with contextlib.suppress(OSError):  # a pipe the child already closed
                self.conn.send(("exit",))
            proc.join(10)
        if proc.is_alive():
            proc.kill()
            proc.join(5)


class _LocalPeer(_Peer):
    """Without nixl: decode is a ``LocalTransport`` in this process (memmove; no second process)."""

    transport = "local"

    def start(self) -> None:
        from kvferry.transport.local import LocalTransport

        self.dst = KVMemory.allocate(self.src.layout)
        self.receiver = LocalTransport()
        self.xport = LocalTransport()
        self.xport.register(self.src)
        self.peer = self.xport.add_peer(self.receiver.register(self.dst))

    def end_to_end(self, post: Callable[[bytes], None]) -> float:
        tag = self._tag()
        start = time.perf_counter()
        post(tag)
        if tag not in [msg for _, msg in self.receiver.get_notifications()]:
            raise RuntimeError(f"notification {tag!r} was not delivered")
        return time.perf_counter() - start

    def dst_pages(self, buffer: str, pages: np.ndarray) -> bytes:
        return self.dst.array(buffer)[pages].tobytes()

    def close(self) -> None:
        for xport in (self.xport, getattr(self, "receiver", None)):
            if xport is not None:
                xport.close()


def _per_buffer_rows(mem: KVMemory, num_pages: int) -> np.ndarray:
    return np.array([(r.address, num_pages * b.page_bytes, r.device_id)
                     for r, b in zip(mem.regions, mem.layout.buffers)], dtype=np.uint64)


def _fill_pattern(mem: KVMemory) -> None:
    """Page p of buffer i holds the byte ``(7 p + 13 i + 1) % 251``: cheap, and a misplaced page shows."""
    for i, buf in enumerate(mem.layout.buffers):
        values = (np.arange(buf.num_pages, dtype=np.int64) * 7 + 13 * i + 1) % 251
        mem.array(buf.name)[...] = values.astype(np.uint8)[:, None]


def _verify(peer: _Peer, plan: TransferPlan, rng: np.random.Generator) -> None:
    """Spot-check a few pages of a few buffers: a benchmark that moves the wrong bytes reports nothing."""
    pool_plan = plan.pools[0]
    for gid in rng.choice(pool_plan.buffer_ids, size=min(4, len(pool_plan.buffer_ids)), replace=False):
        name = peer.src.layout.buffers[int(gid)].name
        pick = rng.choice(len(pool_plan.src_pages), size=min(8, len(pool_plan.src_pages)), replace=False)
        if peer.dst_pages(name, pool_plan.dst_pages[pick]) != peer.src.array(name)[pool_plan.src_pages[pick]].tobytes():
            raise RuntimeError(f"benchmark write landed the wrong bytes in buffer {name!r}")


# -- bandwidth and latency -------------------------------------------------------------------------------
def _request(rng: np.random.Generator, num_pages: int, capacity: int) -> PagesArg:
    return {"kv": (random_runs(rng, num_pages, capacity), random_runs(rng, num_pages, capacity))}


def bandwidth_sweep(peer: _Peer, config: SuiteConfig, sizes: Sequence[int], say: ProgressFn) -> dict[str, Any]:
    """GB/s per request size (pages) for kvferry, raw NIXL (both forms, when available) and memcpy.

    Raises ``RuntimeError`` when a kvferry write lands the wrong bytes (spot-checked per size).
    """
    rng = np.random.default_rng(config.seed)
    largest = max(sizes) * transfer_layout(1).nbytes
    a, b = np.ones(largest, dtype=np.uint8), np.ones(largest, dtype=np.uint8)  # ones: faulted in now
    rows = [_bandwidth_case(peer, config, rng, num_pages, (a, b), say) for num_pages in sizes]
    return {"layout": _transfer_description(), "transport": peer.transport, "mean_run": MEAN_RUN,
            "repeats": config.repeats, "rows": rows}


def _bandwidth_case(peer: _Peer, config: SuiteConfig, rng: np.random.Generator, num_pages: int,
                    scratch: tuple[np.ndarray, np.ndarray], say: ProgressFn) -> dict[str, Any]:
    capacity = peer.src.layout.pools[0].min_pages
    req = _request(rng, num_pages, capacity)
    plan = plan_transfer(peer.src, peer.dst, req)
    n = plan.nbytes
    say(f"bandwidth: {n / MiB:.1f} MiB")
    a, b = scratch[0][:n], scratch[1][:n]
    times = {"memcpy": timed_median(lambda: np.copyto(b, a), config.repeats, 0, config.repeats)}
    kvferry = peer.write(req)
    peer.end_to_end(kvferry)
    _verify(peer, plan, rng)  # before the raw rows overwrite the first pages of every buffer
    posters = {"kvferry": kvferry}
    if peer.can_raw:
        posters["raw_nixl"] = peer.raw_write(_per_buffer_rows(peer.src, num_pages),
                                             _per_buffer_rows(peer.dst, num_pages))
        posters["raw_nixl_rows"] = peer.raw_write(plan.src_descs, plan.dst_descs)
    repeats = bandwidth_repeats(config.repeats, n)
    times.update(_round_robin(peer, posters, repeats))
    return {**_bandwidth_row(num_pages, plan, times), "repeats": repeats}


# Small requests take microseconds, so they get more rounds, up to this many times ``repeats``: their
# medians move most from run to run (a scheduler tick is a large part of 200 us), and the rounds cost little.
SMALL_REPEATS_FACTOR = 5


def bandwidth_repeats(repeats: int, nbytes: int) -> int:
    """Rounds for a request of ``nbytes``: ``repeats`` from 64 MiB up, proportionally more below, at most
    ``SMALL_REPEATS_FACTOR`` times as many."""
    return repeats * max(1, min(SMALL_REPEATS_FACTOR, (64 * MiB) // max(nbytes, 1)))


def _round_robin(peer: _Peer, posters: dict[str, Callable[[bytes], None]], repeats: int) -> dict[str, float]:
    """Median end-to-end seconds of each poster, one warm-up each, then ``repeats`` rounds taking them in
    turn: load that comes and goes on a shared machine then hits every method alike (timing all of one
    method's repeats before the next lets a burst land on one of them only)."""
    samples: dict[str, list[float]] = {name: [] for name in posters}
    for post in posters.values():
        peer.end_to_end(post)
    for _ in range(repeats):
        for name, post in posters.items():
            samples[name].append(peer.end_to_end(post))
    return {name: statistics.median(s) for name, s in samples.items()}


def _bandwidth_row(num_pages: int, plan: TransferPlan, times: dict[str, float]) -> dict[str, Any]:
    row: dict[str, Any] = {"pages": num_pages, "nbytes": plan.nbytes, "descriptors": plan.num_descriptors}
    for method in ("kvferry", "raw_nixl_rows", "raw_nixl", "memcpy"):
        t = times.get(method)
        row[f"{method}_ms"] = None if t is None else t * 1e3
        row[f"{method}_gbps"] = None if t is None else plan.nbytes / t / 1e9
    return row


def _distribution(samples_ms: np.ndarray) -> dict[str, Any]:
    pct = {f"p{q}_ms": float(np.percentile(samples_ms, q)) for q in (50, 90, 99)}
    return {**pct, "mean_ms": float(samples_ms.mean()), "max_ms": float(samples_ms.max()),
            "samples_ms": [round(float(x), 4) for x in samples_ms]}


def control_plane_run(config: SuiteConfig) -> dict[str, Any]:
    """Request latency in a multi-session workload over the control plane, as ``kvferry demo`` runs it.

    ``kvferry.workload.runner.run_workload``: decode and prefill endpoints as two processes over NIXL (one
    process, local transport, without nixl), ``config.sessions`` sessions of 4 turns on the default
    preset, sampled digests, every page checked. A request's latency is decode's announce to its
    verified completion. Per-request samples come with runners that report ``latencies_ms``; older ones
    give p50 and p99 only. Raises ``RuntimeError`` when the run failed: its figures would mean nothing.
    """
    from kvferry.workload.runner import WorkloadConfig, run_workload
    from kvferry.workload.sim import WorkloadSpec

    transport = "nixl" if nixl_available() else "local"
    run = WorkloadConfig(workload=WorkloadSpec(num_sessions=config.sessions, num_turns=4, seed=config.seed),
                         budget_bytes=config.workload_mib * MiB, transport=transport, digest_mode="sampled",
                         timeout_s=600.0)
    result = run_workload(run)
    if not result.ok:
        raise RuntimeError(f"the control-plane run failed: {result.error or result.first_failure}")
    out: dict[str, Any] = {
        "source": f"control-plane run ({transport}): {result.sessions} sessions x {result.turns} turns of "
                  f"{result.preset}, announce to verified completion on decode",
        "preset": result.preset, "requests": result.requests, "nbytes": result.bytes,
        "mean_request_bytes": result.bytes / max(1, result.requests), "gbps": result.gbps,
        "p50_ms": result.p50_ms, "p99_ms": result.p99_ms, "p90_ms": None, "mean_ms": None, "max_ms": None,
        "samples_ms": None}
    samples = result.latencies_ms
    if samples:
        out.update(_distribution(np.asarray(samples, dtype=np.float64)))
    return out


def round_trips(peer: _Peer, config: SuiteConfig, num_pages: int) -> dict[str, Any]:
    """Per-request time of ``config.latency_requests`` requests of ``num_pages`` pages, each to fresh
    random pages on both sides: plan, write, and the notification seen by decode."""
    rng = np.random.default_rng(config.seed + 1)
    capacity = peer.src.layout.pools[0].min_pages
    reqs = [_request(rng, num_pages, capacity) for _ in range(config.latency_requests + 3)]
    for req in reqs[:3]:  # warm-up
        peer.end_to_end(peer.write(req))
    samples = np.array([peer.end_to_end(peer.write(req)) for req in reqs[3:]]) * 1e3
    nbytes = plan_transfer(peer.src, peer.dst, reqs[0]).nbytes
    return {"source": f"transport round trips ({peer.transport}): plan_transfer, write, notification seen "
                      f"by decode, {LATENCY_TOKENS}-token requests", "layout": _transfer_description(),
            "pages": num_pages, "tokens": LATENCY_TOKENS, "nbytes": nbytes, "mean_request_bytes": nbytes,
            "requests": len(samples), **_distribution(samples)}


def _transfer_description() -> str:
    lay = transfer_layout(1)
    return (f"deepseek_v32 with {XFER_LAYERS} layers: {len(lay.buffers)} buffers, "
            f"{lay.nbytes / MiB:.3f} MiB per 64-token page, page runs of mean length {MEAN_RUN:g}")


def transfer_sections(config: SuiteConfig, say: ProgressFn, *,
                      latency: bool = True) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """Bandwidth and latency (unless ``latency`` is False) over one decode peer (NIXL in a child process
    when nixl is installed)."""
    page = transfer_layout(1).nbytes
    sizes = [max(1, round(s * MiB / page)) for s in config.sizes_mib]
    latency_pages = -(-LATENCY_TOKENS // PLAN_TOKENS_PER_PAGE)
    largest = max(*sizes, latency_pages)
    src = KVMemory.allocate(transfer_layout(largest + max(64, largest // 4)))  # room for gaps between runs
    _fill_pattern(src)
    peer: _Peer = _NixlPeer(src) if nixl_available() else _LocalPeer(src)
    try:
        peer.start()
        say(f"bandwidth over {peer.transport}")
        bandwidth = bandwidth_sweep(peer, config, sizes, say)
        if not latency:
            return bandwidth, None
        say(f"latency over {peer.transport}")
        return bandwidth, round_trips(peer, config, latency_pages)
    finally:
        peer.close()
