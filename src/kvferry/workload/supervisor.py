"""Supervision of a workload run: start both sides, relay progress, enforce the deadline, clean up.

Part of the workload layer, above both sides, below ``runner`` (``runner.run_workload`` calls
``Supervisor(config, progress).run()``). Each side runs ``side_main`` in a spawned process (``nixl``) or a
daemon thread (``local``); the supervisor only orchestrates: it relays nothing on the data path, and always
ends what it started.

Who talks to whom::

    prefill --(router pipe: its address)--> decode          decode --(control plane)--> prefill
    decode  --(router pipe: "start request i")--> prefill   (the router a serving stack has anyway)
    each side --(parent pipe: progress, result, error)--> parent
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import multiprocessing.connection
import os
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from kvferry.errors import KVFerryError
from kvferry.workload.config import WorkloadConfig
from kvferry.workload.decode import DecodeSide
from kvferry.workload.metrics import side_metrics
from kvferry.workload.prefill import PrefillSide

ProgressFn = Callable[[int, int], None]


@dataclass
class Reports:
    """What the two sides sent back (``None`` until they did), and the first error of the run."""

    decode: dict[str, Any] | None = None
    prefill: dict[str, Any] | None = None
    error: str | None = None


class Worker:
    """One side, in a spawned process (``nixl``) or a daemon thread (``local``), with its parent pipe."""

    def __init__(self, side: str, config: Any, router: Connection, ctx: Any,
                 target: Callable[..., None] | None = None, extra: tuple[Any, ...] = ()) -> None:
        """``target(side, config, router, parent, own_process, *extra)`` runs the side (default ``side_main``)."""
        self.side = side
        self.conn, child = mp.Pipe() if ctx is None else ctx.Pipe()
        args = (side, config, router, child, ctx is not None, *extra)
        target = target or side_main
        if ctx is None:
            self._runner: Any = threading.Thread(target=target, args=args, name=f"kvferry-{side}", daemon=True)
        else:
            self._runner = ctx.Process(target=target, args=args, name=f"kvferry-{side}", daemon=True)

    def start(self) -> None:
        self._runner.start()

    def alive(self) -> bool:
        return self._runner.is_alive()

    @property
    def pid(self) -> int | None:
        """The side's process id (None for a thread, or before ``start``)."""
        return getattr(self._runner, "pid", None)

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


class Supervisor:
    """Start both sides, relay progress, enforce the deadline, collect the two reports, clean up."""

    def __init__(self, config: WorkloadConfig, progress: ProgressFn | None) -> None:
        self.config = config
        self.progress = progress
        ctx = mp.get_context("spawn") if config.transport != "local" else None
        router_d, router_p = mp.Pipe() if ctx is None else ctx.Pipe()
        self.workers = {"decode": Worker("decode", config, router_d, ctx),
                        "prefill": Worker("prefill", config, router_p, ctx)}
        self.reports = Reports()

    def run(self) -> Reports:
        """Blocking: until both sides reported, one failed, or the run's deadline passed; then clean up."""
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

    def _receive(self, worker: Worker) -> None:
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


def side_main(side: str, config: WorkloadConfig, router: Connection, parent: Connection,
              own_process: bool) -> None:
    """Entry point of one side: run it, send ("result", report) or ("error", text) to the parent."""
    if own_process:
        # Keep stdout for the parent's --json: anything a library prints here goes to stderr.
        os.dup2(2, 1)
    try:
        cls = DecodeSide if side == "decode" else PrefillSide
        with cls(config, router, parent) as runner, side_metrics(lambda: runner.link.endpoint):
            report = runner.run()
            report["stats"] = runner.link.endpoint.stats().to_dict()
        parent.send(("result", report))
    except BaseException as exc:  # report everything, even KeyboardInterrupt, then let the process end
        detail = traceback.format_exc(limit=6) if not isinstance(exc, KVFerryError) else ""
        with contextlib.suppress(OSError, ValueError):
            parent.send(("error", f"{side}: {type(exc).__name__}: {exc}", detail))
    finally:
        router.close()
