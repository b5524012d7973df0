"""Run a workload end to end: a decode side and a prefill side, real transfers, every byte verified.

Top layer beside ``cli`` (it drives ``sim`` over the control plane). ``run_workload(config)`` starts decode
and prefill as two OS processes (``multiprocessing`` spawn) over NIXL, or, with ``transport="local"``, as
two threads of this process over ``LocalTransport`` (fast tests). The parent only orchestrates: it
relays nothing on the data path, shows a progress bar, enforces one deadline, and always cleans up.

Who talks to whom::

    prefill --(router pipe: its address)--> decode          decode --(control plane)--> prefill
    decode  --(router pipe: "start request i")--> prefill   (the router a serving stack has anyway)
    each side --(parent pipe: progress, result, error)--> parent

Decode is the scheduler: it admits a session's next turn when the previous one finished and its pages
fit, leases destination pages, tells prefill to start, and when the request completes checks every page
of every buffer against ``sim``'s expected pattern (independently of kvferry's digests), then frees the
pages for reuse. Prefill allocates its own pages, writes the pattern (standing in for the model's
forward pass) and sends. Both sides derive the same schedule from the seed, so only request indices
cross the router pipe.
"""

from __future__ import annotations

import contextlib
import heapq
import multiprocessing as mp
import multiprocessing.connection
import os
import re
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from .audit import audit
from .errors import KVFerryError, PeerLost, RequestFailed, TransferTimeout
from .layout import Layout
from .memory import KVMemory
from .plan import TransferPlan
from .presets import DEFAULT_PRESET, get_preset
from .sim import (
    OutOfPages,
    PageAllocator,
    RequestSpec,
    WorkloadSpec,
    build_schedule,
    check_pages,
    fill_pages,
    page_keys,
    pages_needed,
    windows_for,
)
from .transport.base import TransferHandle, Transport

__all__ = ["DEFAULT_BUDGET", "WorkloadConfig", "WorkloadResult", "run_workload"]

# Per side: small enough for two copies plus the pattern work on a 2-core, 8 GiB CI box, large enough
# that the default workload keeps a dozen requests in flight and reuses every page many times.
DEFAULT_BUDGET = 512 << 20


@dataclass(frozen=True, slots=True)
class WorkloadConfig:
    """What to run. Picklable (it crosses to spawned processes); validated by ``run_workload``.

    ``num_pages`` or ``budget_bytes`` sizes the preset (``DEFAULT_BUDGET`` when neither is given);
    ``knobs`` are extra preset keyword arguments. ``inject`` names a fault from ``kvferry.faults``,
    applied on the prefill side only. ``timeout_s`` bounds the whole run, startup included;
    ``request_timeout_s`` bounds each request from announce to completion.
    """

    workload: WorkloadSpec = field(default_factory=WorkloadSpec)
    preset: str = DEFAULT_PRESET
    num_pages: int | None = None
    budget_bytes: int | None = None
    knobs: tuple[tuple[str, Any], ...] = ()
    transport: str = "nixl"
    digest_mode: str = "full"
    inject: str | None = None
    timeout_s: float = 600.0
    request_timeout_s: float = 60.0

    def layout(self) -> Layout:
        """The preset layout both sides allocate (same shape and capacity)."""
        sizing: dict[str, int] = ({"num_pages": self.num_pages} if self.num_pages is not None
                                  else {"budget_bytes": self.budget_bytes or DEFAULT_BUDGET})
        return get_preset(self.preset, **sizing, **dict(self.knobs))

    def windows(self) -> dict[str, int]:
        return windows_for(self.preset)


@dataclass(frozen=True)
class WorkloadResult:
    """What a run did. ``ok`` is the verdict: every request done, no page corrupted, nothing failed.

    ``pages_verified`` and ``corrupted_pages`` count buffer pages (a pool page of a pool with 42 buffers
    is 42 buffer pages); ``bytes`` and ``gbps`` count the bytes of completed requests over ``seconds``,
    the time from the first announce to the last completion (process start-up excluded, reported as
    ``startup_seconds``). ``corrupted_by_buffer`` maps each buffer with a corrupted page to the count, in
    layout order (the first key is where a misaddressing fault starts). ``silent_corruptions`` are
    corrupted pages in requests kvferry reported done: corruption its digests missed.
    """

    preset: str
    transport: str
    digest_mode: str
    inject: str | None
    sessions: int
    turns: int
    requests: int
    requests_expected: int
    failed_requests: int
    pages_verified: int
    corrupted_pages: int
    silent_corruptions: int
    corrupted_by_buffer: dict[str, int]
    bytes: int
    seconds: float
    startup_seconds: float
    gbps: float
    p50_ms: float
    p99_ms: float
    failures: dict[str, int]
    first_failure: str | None
    layout: dict[str, Any]
    error: str | None = None
    latencies_ms: tuple[float, ...] = ()  # per request, announce to verified; left out of to_dict

    @property
    def ok(self) -> bool:
        return (self.error is None and self.corrupted_pages == 0 and self.failed_requests == 0
                and self.requests == self.requests_expected)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready, with ``ok`` included (per-request latencies stay on the object: thousands of them)."""
        out = asdict(self)
        del out["latencies_ms"]
        return {**out, "ok": self.ok}


ProgressFn = Callable[[int, int], None]


def run_workload(config: WorkloadConfig, progress: ProgressFn | None = None) -> WorkloadResult:
    """Run ``config`` to completion or to its deadline; never leaves a process or thread behind.

    ``progress(done, total)`` is called from this thread as requests finish. Errors inside either side
    (a refused handshake, a crash, the deadline) come back as ``WorkloadResult.error``, with whatever the
    other side had measured; errors in ``config`` itself (an unknown preset) raise ``KVFerryError``.
    """
    _validate(config)
    layout = config.layout()
    _check_capacity(config, layout)
    started = time.monotonic()
    reports = _Supervisor(config, progress).run()
    return _result(config, layout, reports, time.monotonic() - started)


def _check_capacity(config: WorkloadConfig, layout: Layout) -> None:
    """Refuse, before any process starts, a workload whose largest request cannot fit even alone."""
    largest = max(spec.num_tokens for spec in build_schedule(config.workload))
    for pool, need in pages_needed(layout, largest, config.windows()).items():
        have = layout.pool(pool).min_pages
        if need > have:
            raise OutOfPages(f"the workload's largest prompt ({largest} tokens) needs {need} pages of pool "
                             f"{pool!r}, which has {have}: raise the capacity (--budget/--pages) or lower "
                             f"--max-tokens")


def _validate(config: WorkloadConfig) -> None:
    if config.transport not in ("nixl", "local"):
        raise ValueError(f"transport must be 'nixl' or 'local', got {config.transport!r}")
    if config.digest_mode not in ("off", "sampled", "full"):
        raise ValueError(f"digest_mode must be 'off', 'sampled' or 'full', got {config.digest_mode!r}")
    if config.timeout_s <= 0 or config.request_timeout_s <= 0:
        raise ValueError("timeout_s and request_timeout_s must be > 0")


# -- result ------------------------------------------------------------------------------------------------
def _result(config: WorkloadConfig, layout: Layout, reports: _Reports, wall_s: float) -> WorkloadResult:
    dec = reports.decode or {}
    seconds = float(dec.get("seconds", 0.0))
    nbytes = int(dec.get("bytes", 0))
    spec = config.workload
    return WorkloadResult(
        preset=config.preset, transport=config.transport, digest_mode=config.digest_mode, inject=config.inject,
        sessions=spec.num_sessions, turns=spec.num_turns,
        requests=int(dec.get("requests", 0)), requests_expected=spec.num_requests,
        failed_requests=int(dec.get("failed_requests", 0)),
        pages_verified=int(dec.get("pages_verified", 0)), corrupted_pages=int(dec.get("corrupted_pages", 0)),
        silent_corruptions=int(dec.get("silent_corruptions", 0)),
        corrupted_by_buffer=dict(dec.get("corrupted_by_buffer", {})),
        bytes=nbytes, seconds=seconds, startup_seconds=max(0.0, wall_s - seconds),
        gbps=nbytes / seconds / 1e9 if seconds > 0 else 0.0,
        p50_ms=float(dec.get("p50_ms", 0.0)), p99_ms=float(dec.get("p99_ms", 0.0)),
        failures=dict(dec.get("failures", {})), first_failure=dec.get("first_failure"),
        layout=layout_summary(layout), error=reports.error,
        latencies_ms=tuple(float(x) for x in dec.get("latencies_ms", ())),
    )


def layout_summary(layout: Layout) -> dict[str, Any]:
    """Pools and their buffers grouped by role (``c4.idx.*``): what the run moved, for tables and JSON."""
    pools = {p.name: {"pool": p.name, "tokens_per_page": p.tokens_per_page, "usable_pages": p.min_pages,
                      "roles": []} for p in layout.pools}
    for r in audit(layout).roles:
        pools[r.pool]["roles"].append({"role": r.role, "kind": r.kind, "dtype": r.dtype,
                                       "buffers": r.num_buffers, "page_bytes": r.page_bytes,
                                       "num_pages": r.num_pages, "bytes": r.total_bytes})
    return {"shape_fingerprint": layout.shape_fingerprint, "bytes_per_side": layout.nbytes,
            "num_buffers": len(layout.buffers), "pools": list(pools.values())}


# -- supervision -------------------------------------------------------------------------------------------
@dataclass
class _Reports:
    decode: dict[str, Any] | None = None
    prefill: dict[str, Any] | None = None
    error: str | None = None


class _Worker:
    """One side, in a spawned process (``nixl``) or a daemon thread (``local``), with its parent pipe."""

    def __init__(self, side: str, config: WorkloadConfig, router: Connection, ctx: Any) -> None:
        self.side = side
        self.conn, child = mp.Pipe() if ctx is None else ctx.Pipe()
        args = (side, config, router, child, ctx is not None)
        if ctx is None:
            self._runner: Any = threading.Thread(target=_side_main, args=args, name=f"kvferry-{side}", daemon=True)
        else:
            self._runner = ctx.Process(target=_side_main, args=args, name=f"kvferry-{side}", daemon=True)

    def start(self) -> None:
        self._runner.start()

    def alive(self) -> bool:
        return self._runner.is_alive()

    def describe_exit(self) -> str:
        code = getattr(self._runner, "exitcode", None)
        return f"the {self.side} side exited (status {code}) without a result"

    def stop(self, grace_s: float) -> None:
        """Join; a process still running after ``grace_s`` is terminated, then killed."""
        if self._runner.ident is None:
            return  # never started (the other side failed to start first)
        self._runner.join(grace_s)
        if isinstance(self._runner, threading.Thread) or not self._runner.is_alive():
            return  # a thread cannot be killed; it saw "stop" and its loop is bounded by the deadline
        self._runner.terminate()
        self._runner.join(2.0)
        if self._runner.is_alive():
            self._runner.kill()
            self._runner.join(2.0)


class _Supervisor:
    """Start both sides, relay progress, enforce the deadline, collect the two reports, clean up."""

    def __init__(self, config: WorkloadConfig, progress: ProgressFn | None) -> None:
        self.config = config
        self.progress = progress
        ctx = mp.get_context("spawn") if config.transport == "nixl" else None
        router_d, router_p = mp.Pipe() if ctx is None else ctx.Pipe()
        self.workers = {"decode": _Worker("decode", config, router_d, ctx),
                        "prefill": _Worker("prefill", config, router_p, ctx)}
        self.reports = _Reports()

    def run(self) -> _Reports:
        deadline = time.monotonic() + self.config.timeout_s
        try:
            for worker in self.workers.values():
                worker.start()
            self._collect(deadline)
        finally:
            self._shutdown()
        return self.reports

    def _collect(self, deadline: float) -> None:
        while not self._have_all() and self.reports.error is None:
            if time.monotonic() > deadline:
                self.reports.error = f"the run did not finish within its {self.config.timeout_s:g} s deadline"
                return
            ready = mp.connection.wait([w.conn for w in self.workers.values()], timeout=0.1)
            for worker in self.workers.values():
                if worker.conn in ready:
                    self._receive(worker)
                elif not worker.alive() and getattr(self.reports, worker.side) is None:
                    # It may have sent its result and exited between wait() and alive(): read first.
                    if worker.conn.poll():
                        self._receive(worker)
                    else:
                        self.reports.error = self.reports.error or worker.describe_exit()

    def _have_all(self) -> bool:
        return self.reports.decode is not None and self.reports.prefill is not None

    def _receive(self, worker: _Worker) -> None:
        try:
            kind, *body = worker.conn.recv()
        except (EOFError, OSError):
            if getattr(self.reports, worker.side) is None:
                self.reports.error = self.reports.error or worker.describe_exit()
            return
        if kind == "progress" and self.progress is not None:
            self.progress(*body)
        elif kind == "result":
            setattr(self.reports, worker.side, body[0])
        elif kind == "error":
            self.reports.error = self.reports.error or body[0]

    def _shutdown(self) -> None:
        # Ask both sides to stop and report what they measured; give them a moment; then end them.
        for worker in self.workers.values():
            with contextlib.suppress(OSError, ValueError):
                worker.conn.send(("stop",))
        grace = time.monotonic() + 5.0
        while not self._have_all() and time.monotonic() < grace and any(w.alive() for w in self.workers.values()):
            ready = mp.connection.wait([w.conn for w in self.workers.values()], timeout=0.1)
            for worker in self.workers.values():
                if worker.conn in ready:
                    self._receive(worker)
        for worker in self.workers.values():
            worker.stop(grace_s=max(0.1, grace - time.monotonic()))
            worker.conn.close()


def _side_main(side: str, config: WorkloadConfig, router: Connection, parent: Connection,
               own_process: bool) -> None:
    """Entry point of one side: run it, send ("result", report) or ("error", text) to the parent."""
    if own_process:
        # Keep stdout for the parent's --json: anything a library prints here goes to stderr.
        os.dup2(2, 1)
    try:
        cls = _DecodeSide if side == "decode" else _PrefillSide
        with cls(config, router, parent) as runner:
            report = runner.run()
        parent.send(("result", report))
    except BaseException as exc:  # report everything, even KeyboardInterrupt, then let the process end
        detail = traceback.format_exc(limit=6) if not isinstance(exc, KVFerryError) else ""
        with contextlib.suppress(OSError, ValueError):
            parent.send(("error", f"{side}: {type(exc).__name__}: {exc}", detail))
    finally:
        router.close()


# -- the two sides -----------------------------------------------------------------------------------------
@dataclass
class _Live:
    """A request one side is working on: its spec, its pages on this side, when it started."""

    spec: RequestSpec
    pages: dict[str, np.ndarray]
    started: float


class _Side:
    """What both sides share: layout, memory, allocators, schedule, pipes, a stop check."""

    role = "side"
    seed_salt = 0

    def __init__(self, config: WorkloadConfig, router: Connection, parent: Connection) -> None:
        self.config = config
        self.router = router
        self.parent = parent
        self.layout = config.layout()
        self.windows = config.windows()
        self.memory = KVMemory.allocate(self.layout)
        self.views = {b.name: self.memory.array(b.name) for b in self.layout.buffers}
        for view in self.views.values():
            view.fill(0)  # touch every page now: first-touch faults would otherwise be timed as transfers
        index = {b.name: i for i, b in enumerate(self.layout.buffers)}
        self.pool_buffer_ids = {p.name: np.array([index[b.name] for b in p.buffers]) for p in self.layout.pools}
        seed = config.workload.seed * 4 + self.seed_salt  # each side its own page order
        self.allocators = {p.name: PageAllocator(p.min_pages, seed=seed, name=f"{self.role}:{p.name}")
                           for p in self.layout.pools}
        self.schedule = build_schedule(config.workload)
        self.live: dict[str, _Live] = {}
        self.stopped = False

    def __enter__(self) -> _Side:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        raise NotImplementedError

    def _allocate(self, spec: RequestSpec) -> dict[str, np.ndarray] | None:
        """This request's pages on this side, or None (nothing taken) when a pool is short."""
        need = {p: n for p, n in pages_needed(self.layout, spec.num_tokens, self.windows).items() if n}
        if not all(self.allocators[p].can_allocate(n) for p, n in need.items()):
            return None
        return {p: self.allocators[p].allocate(n) for p, n in need.items()}

    def _free(self, pages: dict[str, np.ndarray]) -> None:
        for pool, ids in pages.items():
            self.allocators[pool].free(ids)

    def _buffers(self, spec: RequestSpec, pages: dict[str, np.ndarray]) -> Iterator[tuple[str, np.ndarray, np.ndarray]]:
        """(buffer, its pages, their expected keys) for every buffer of every pool the request has pages in."""
        for pool, ids in pages.items():
            names = [b.name for b in self.layout.pool(pool).buffers]
            keys = page_keys(self.config.workload.seed, spec.index, self.pool_buffer_ids[pool], len(ids))
            for name, row in zip(names, keys):
                yield name, ids, row

    def _check_stop(self) -> None:
        """Notice the parent's ("stop",): the run is over (deadline, the other side failed)."""
        if not self.stopped and self.parent.poll():
            self.stopped = self.parent.recv()[0] == "stop"


class _DecodeSide(_Side):
    """The scheduler: admits turns, leases pages, verifies every received byte, frees pages for reuse."""

    role = "decode"
    seed_salt = 1

    def __init__(self, config: WorkloadConfig, router: Connection, parent: Connection) -> None:
        super().__init__(config, router, parent)
        self.link = _decode_link(config, self.memory)
        by_session: dict[int, list[RequestSpec]] = {}
        for spec in self.schedule:
            by_session.setdefault(spec.session, []).append(spec)
        self.turns = by_session
        # Sessions whose next turn may start, keyed by that turn's schedule index (admission order).
        self.ready = [(turns[0].index, s) for s, turns in by_session.items()]
        heapq.heapify(self.ready)
        self.stats = _DecodeStats()
        self.quarantine: list[_Live] = []
        self.last_progress = 0.0

    def close(self) -> None:
        self.link.close()

    def run(self) -> dict[str, Any]:
        address = _recv(self.router, "hello", self.config.timeout_s)
        self.link.connect(address[0])
        total = len(self.schedule)
        self.stats.first = time.monotonic()
        while self.stats.finished < total and not self.stopped:
            progressed = self._release_quarantine() + self._admit() + self._poll()
            self._report_progress(total)
            self._check_stop()
            if not progressed:
                time.sleep(_IDLE_S)
        self.router.send(("stop",))
        order = {b.name: i for i, b in enumerate(self.layout.buffers)}
        self.stats.corrupted = dict(sorted(self.stats.corrupted.items(), key=lambda kv: order[kv[0]]))
        return self.stats.report()

    def _admit(self) -> int:
        admitted = 0
        while self.ready:
            _, session = self.ready[0]
            spec = self.turns[session][0]
            pages = self._allocate(spec)
            if pages is None:
                break  # first come, first served: a large turn is not overtaken by smaller ones
            heapq.heappop(self.ready)
            self.turns[session].pop(0)
            started = time.monotonic()
            self.link.announce(spec.request_id, pages)
            self.router.send(("start", spec.index))
            self.live[spec.request_id] = _Live(spec, pages, started)
            admitted += 1
        return admitted

    def _poll(self) -> int:
        finished = 0
        now = time.monotonic()
        for rid, live in list(self.live.items()):
            try:
                if not self.link.poll(rid):
                    if now - live.started < self.config.request_timeout_s:
                        continue
                    self.link.abort(rid, "runner deadline")
                    raise RequestFailed(rid, f"not done after {self.config.request_timeout_s:g} s (runner)")
                self._finish(live, None)
            except RequestFailed as exc:
                self._finish(live, exc.reason)
            finished += 1
        return finished

    def _finish(self, live: _Live, failure: str | None) -> None:
        elapsed = time.monotonic() - live.started
        del self.live[live.spec.request_id]
        self._verify(live, failure is None)
        if failure is not None and self.link.lease_held(live.spec.request_id):
            self.quarantine.append(live)  # a write may still land there: reuse only once the lease ends
        else:
            self._free(live.pages)
        self.stats.record(live, elapsed, failure, self._nbytes(live.pages))
        following = self.turns[live.spec.session]
        if following:
            heapq.heappush(self.ready, (following[0].index, live.spec.session))

    def _release_quarantine(self) -> int:
        ended = [q for q in self.quarantine if not self.link.lease_held(q.spec.request_id)]
        for live in ended:
            self.quarantine.remove(live)
            self._free(live.pages)
        return len(ended)

    def _verify(self, live: _Live, reported_done: bool) -> None:
        """Every page of every buffer against the pattern prefill wrote; counts per buffer."""
        for name, ids, keys in self._buffers(live.spec, live.pages):
            bad = int(check_pages(self.views[name], ids, keys).sum())
            self.stats.pages_verified += len(ids)
            if bad:
                self.stats.corrupted[name] = self.stats.corrupted.get(name, 0) + bad
                self.stats.silent += bad if reported_done else 0

    def _nbytes(self, pages: dict[str, np.ndarray]) -> int:
        return sum(len(ids) * sum(b.page_bytes for b in self.layout.pool(p).buffers) for p, ids in pages.items())

    def _report_progress(self, total: int) -> None:
        now = time.monotonic()
        if now - self.last_progress >= _PROGRESS_S or self.stats.finished == total:
            self.last_progress = now
            self.parent.send(("progress", self.stats.finished, total))


@dataclass
class _DecodeStats:
    """Decode's tallies; ``report`` turns them into the plain dict the parent receives."""

    first: float = 0.0
    last: float = 0.0
    finished: int = 0
    done: int = 0
    nbytes: int = 0
    pages_verified: int = 0
    silent: int = 0
    corrupted: dict[str, int] = field(default_factory=dict)
    failures: dict[str, int] = field(default_factory=dict)
    first_failure: str | None = None
    latencies: list[float] = field(default_factory=list)

    def record(self, live: _Live, elapsed: float, failure: str | None, nbytes: int) -> None:
        self.finished += 1
        self.last = time.monotonic()
        if failure is None:
            self.done += 1
            self.nbytes += nbytes
            self.latencies.append(elapsed)
            return
        key = _failure_kind(failure)
        self.failures[key] = self.failures.get(key, 0) + 1
        self.first_failure = self.first_failure or f"{live.spec.request_id}: {failure}"

    def report(self) -> dict[str, Any]:
        lat = np.asarray(self.latencies) * 1e3
        return {
            "requests": self.finished, "failed_requests": self.finished - self.done, "bytes": self.nbytes,
            "seconds": max(0.0, self.last - self.first), "pages_verified": self.pages_verified,
            "corrupted_pages": sum(self.corrupted.values()), "silent_corruptions": self.silent,
            "corrupted_by_buffer": self.corrupted, "failures": dict(self.failures),
            "first_failure": self.first_failure,
            "p50_ms": float(np.percentile(lat, 50)) if len(lat) else 0.0,
            "p99_ms": float(np.percentile(lat, 99)) if len(lat) else 0.0,
            "latencies_ms": lat.tolist(),
        }


def _failure_kind(reason: str) -> str:
    """A short class for a failure reason: the exception name it carries, or its first words."""
    match = re.search(r"\b([A-Z][A-Za-z]+(?:Error|Lost|Timeout|Failed))\b", reason)
    return match.group(1) if match else " ".join(reason.split()[:4])


class _PrefillSide(_Side):
    """Starts what decode asks for: allocate, write the pattern (the 'forward pass'), send, free when sent."""

    role = "prefill"
    seed_salt = 2

    def __init__(self, config: WorkloadConfig, router: Connection, parent: Connection) -> None:
        super().__init__(config, router, parent)
        self.link = _prefill_link(config, self.memory)
        self.waiting: deque[RequestSpec] = deque()
        self.sent = 0
        self.failed = 0
        self.decode_done = False

    def close(self) -> None:
        self.link.close()

    def run(self) -> dict[str, Any]:
        self.router.send(("hello", self.link.address))
        while not self.stopped and not (self.decode_done and not self.waiting and not self.live):
            if not self.decode_done:
                self._read_router(block=not self.waiting and not self.live)
            progressed = self._start() + self._poll()
            self._check_stop()
            if not progressed and (self.waiting or self.live):
                time.sleep(_IDLE_S)
        return {"sent": self.sent, "failed": self.failed, "abandoned": len(self.live) + len(self.waiting)}

    def _read_router(self, block: bool) -> None:
        timeout = _PROGRESS_S if block else 0
        while not self.decode_done and self.router.poll(timeout):
            timeout = 0
            try:
                kind, *body = self.router.recv()
            except EOFError:
                raise PeerLost("the decode side closed the router pipe before its last request") from None
            if kind == "start":
                self.waiting.append(self.schedule[body[0]])
            elif kind == "stop":
                self.decode_done = True  # nothing follows "stop"; the pipe may close any moment

    def _start(self) -> int:
        started = 0
        while self.waiting:
            spec = self.waiting[0]
            pages = self._allocate(spec)
            if pages is None:
                break  # pages come back as earlier sends complete
            self.waiting.popleft()
            for name, ids, keys in self._buffers(spec, pages):
                fill_pages(self.views[name], ids, keys)
            self.live[spec.request_id] = _Live(spec, pages, time.monotonic())
            self.link.send(spec.request_id, pages)
            started += 1
        return started

    def _poll(self) -> int:
        finished = 0
        for rid, live in list(self.live.items()):
            try:
                if not self.link.poll(rid):
                    continue
                self.sent += 1
            except RequestFailed:
                self.failed += 1
            del self.live[rid]
            self._free(live.pages)  # every write of it has settled (DONE), or it never will read them
            finished += 1
        return finished


def _recv(conn: Connection, kind: str, timeout: float) -> list[Any]:
    """The body of the next message on ``conn``, which must be ``kind``; bounded by ``timeout``."""
    if not conn.poll(timeout):
        raise TransferTimeout(f"no {kind!r} message from the other side within {timeout:g} s")
    got, *body = conn.recv()
    if got != kind:
        raise KVFerryError(f"expected a {kind!r} message from the other side, got {got!r}")
    return body


# -- links: each side's control-plane endpoint, as the runner drives it ---------------------------------
_IDLE_S = 200e-6      # sleep when a loop iteration did nothing: keeps two busy sides off one core's back
_PROGRESS_S = 0.1     # progress messages to the parent, and the router's blocking read


def _options(config: WorkloadConfig) -> Any:
    from .control import EndpointOptions

    return EndpointOptions(request_timeout=config.request_timeout_s)


def _check_state(endpoint: Any, request_id: str) -> bool:
    """True when DONE, False while in flight; ``RequestFailed`` (reason: the error's class and message)."""
    from .control import RequestState

    state = endpoint.poll(request_id)
    if state is RequestState.FAILED:
        err = endpoint.failure(request_id)
        raise RequestFailed(request_id, f"{type(err).__name__}: {err}" if err is not None else "failed")
    return state is RequestState.DONE


class _DecodeLink:
    """A ``DecodeEndpoint``: announce leases the pages, poll reports DONE once digests verified."""

    def __init__(self, config: WorkloadConfig, memory: KVMemory) -> None:
        from .control import DecodeEndpoint

        self.endpoint = DecodeEndpoint(memory, config.transport, digest_mode=config.digest_mode,
                                       options=_options(config))

    def connect(self, address: str) -> None:
        self.endpoint.connect(address)

    def announce(self, request_id: str, pages: dict[str, np.ndarray]) -> None:
        self.endpoint.announce(request_id, pages)

    def poll(self, request_id: str) -> bool:
        return _check_state(self.endpoint, request_id)

    def abort(self, request_id: str, reason: str) -> None:
        self.endpoint.abort(request_id, reason)

    def lease_held(self, request_id: str) -> bool:
        """Whether decode still leases the request's pages (a failed request's writes may be landing)."""
        return self.endpoint.holds_lease(request_id)

    def close(self) -> None:
        self.endpoint.close()


class _PrefillLink:
    """A ``PrefillEndpoint`` over the configured transport, wrapped by the injected fault if any."""

    def __init__(self, config: WorkloadConfig, memory: KVMemory) -> None:
        from .control import PrefillEndpoint
        from .transport import make_transport

        self.transport = make_transport(config.transport)
        wrapped = self.transport if config.inject is None else _FaultyTransport(self.transport, config.inject)
        self.endpoint = PrefillEndpoint(memory, wrapped, digest_mode=config.digest_mode,
                                        options=_options(config))
        self.address = self.endpoint.address

    def send(self, request_id: str, pages: dict[str, np.ndarray]) -> None:
        self.endpoint.send(request_id, pages)

    def poll(self, request_id: str) -> bool:
        return _check_state(self.endpoint, request_id)

    def close(self) -> None:
        self.endpoint.close()
        self.transport.close()  # the endpoint closes only transports it created


class _FaultyTransport(Transport):
    """A transport that misbehaves as ``kvferry.faults`` describes, below the control plane.

    ``buffer0-slots``: every plan is re-addressed the way the buffer-0 slot-count sender would. ``flip``:
    source bytes of the named buffer are flipped while the write is posted and restored once it is done,
    so the bytes arriving differ from those the endpoint digested: corruption in flight.
    """

    def __init__(self, inner: Transport, fault: str) -> None:
        from .faults import FaultSpec

        self.inner = inner
        self.fault = FaultSpec.parse(fault)
        self.name = inner.name  # the handshake compares transport names

    @property
    def agent_name(self) -> str:
        return self.inner.agent_name

    def register(self, memory: KVMemory) -> bytes:
        return self.inner.register(memory)

    def add_peer(self, metadata: bytes) -> str:
        return self.inner.add_peer(metadata)

    def remove_peer(self, peer: str) -> None:
        self.inner.remove_peer(peer)

    def write(self, plan: TransferPlan, peer: str, notif: bytes, label: str = "") -> TransferHandle:
        from .faults import FaultKind

        pages = {pp.pool: (pp.src_pages, pp.dst_pages) for pp in plan.pools}
        if self.fault.kind is FaultKind.BUFFER0_SLOTS:
            plan = self.fault.plan(plan.src_memory, plan.dst_memory, pages, plan.buffer_names)
        if self.fault.kind is not FaultKind.FLIP:
            return self.inner.write(plan, peer, notif, label)
        flips = self._flip(plan.src_memory, pages)
        handle = self.inner.write(plan, peer, notif, label)
        return _RestoringHandle(handle, lambda: self._unflip(plan.src_memory, flips))

    def _flip(self, memory: KVMemory, pages: dict[str, tuple[np.ndarray, np.ndarray]]) -> list[tuple[int, int]]:
        from .faults import flip_bytes

        name = self.fault.buffer or ""
        pool = memory.layout.pool_of.get(name)
        if pool not in pages:
            return []
        src, dst = pages[pool]
        chosen = src if self.fault.pages is None else src[np.isin(dst, self.fault.pages)]
        return flip_bytes(memory, name, chosen.tolist())

    def _unflip(self, memory: KVMemory, flips: list[tuple[int, int]]) -> None:
        view = memory.array(self.fault.buffer or "")
        for page, offset in flips:
            view[page, offset] ^= 0xFF  # XOR twice: the source holds its own bytes again

    def send_notification(self, peer: str, message: bytes) -> None:
        self.inner.send_notification(peer, message)

    def get_notifications(self) -> list[tuple[str, bytes]]:
        return self.inner.get_notifications()

    def close(self) -> None:
        self.inner.close()


class _RestoringHandle(TransferHandle):
    """A handle that runs ``restore`` once, when its write is done or released."""

    def __init__(self, inner: TransferHandle, restore: Callable[[], None]) -> None:
        self.inner, self.peer, self.label = inner, inner.peer, inner.label
        self._restore: Callable[[], None] | None = restore

    def poll(self) -> bool:
        done = self.inner.poll()
        if done:
            self._run_restore()
        return done

    def release(self) -> None:
        self.inner.release()
        self._run_restore()

    def _run_restore(self) -> None:
        restore, self._restore = self._restore, None
        if restore is not None:
            restore()


def _decode_link(config: WorkloadConfig, memory: KVMemory) -> _DecodeLink:
    return _DecodeLink(config, memory)


def _prefill_link(config: WorkloadConfig, memory: KVMemory) -> _PrefillLink:
    return _PrefillLink(config, memory)
