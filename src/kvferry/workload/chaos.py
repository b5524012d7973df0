"""A chaos run: the stress load over NIXL between two processes while a supervisor breaks things on purpose.

The top of the workload layer (with ``runner``), below the benchmark suite and ``cli``. ``run_chaos(config)``
starts decode and prefill (``chaos_sides``) as spawned processes whose control connection goes through a
``Relay`` in this process, then follows ``fault_schedule(config)``: it SIGSTOPs a side for longer than
``peer_timeout + lease_grace`` and SIGCONTs it, SIGKILLs a side and starts a fresh one, or cuts every
control connection. After ``duration_s`` it stops the faults, lets decode drain and sweep its pages, and
returns a ``ChaosResult``. Requests that a fault breaks fail and are counted as failed; a byte wrong in a
page a DONE request owns, or a lease still held after the drain, is what the run exists to find.

Who talks to whom::

    decode  --(parent pipe: start, finished, recheck, gauge, result)--> parent --(router: start)--> prefill
    prefill --(router: hello with its address)--> parent (which points the relay at it)
    decode  --(control plane, through the relay)--> prefill;  data: NIXL, directly
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import multiprocessing.connection
import os
import select
import signal
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

from kvferry.workload.chaos_plan import ChaosConfig, ChaosResult, FaultEvent, RequestStream, fault_schedule
from kvferry.workload.chaos_sides import chaos_side_main
from kvferry.workload.relay import Relay
from kvferry.workload.supervisor import Worker

__all__ = ["ChaosProgress", "run_chaos"]

ChaosProgress = Callable[[int, int, float], None]   # (requests done, failed, seconds into the run)
PUMP_S = 0.05
MAX_SIDE_ERRORS = 20


@dataclass
class Tally:
    """What the parent has heard, across every incarnation of both sides."""

    done: int = 0
    failed: int = 0
    failures: dict[str, int] = field(default_factory=dict)
    first_failure: str | None = None
    examples: dict[str, str] = field(default_factory=dict)   # the first failure of each kind
    pages_verified: int = 0
    pages_rechecked: int = 0
    wrong_at_completion: int = 0
    wrong_later: int = 0
    wrong_pages: int = 0
    bytes_moved: int = 0
    quarantine_peak: int = 0
    endpoint_quarantine_peak: int = 0
    source_holds: int | None = None    # the current prefill's last report: endpoint holds + pages held
    source_holds_peak: int = 0
    faults: dict[str, int] = field(default_factory=dict)
    fault_log: list[str] = field(default_factory=list)
    restarts: dict[str, int] = field(default_factory=dict)
    side_errors: list[str] = field(default_factory=list)

    def fail(self, kind: str, detail: str) -> None:
        self.failed += 1
        self.failures[kind] = self.failures.get(kind, 0) + 1
        self.first_failure = self.first_failure or detail
        self.examples.setdefault(kind, detail[:300])

    def count(self, table: dict[str, int], key: str) -> None:
        table[key] = table.get(key, 0) + 1

    def error(self, text: str) -> None:
        if len(self.side_errors) < MAX_SIDE_ERRORS:
            self.side_errors.append(text)


class SideProcess:
    """One side's current incarnation: its worker process and the parent's end of its router pipe."""

    def __init__(self, side: str, config: ChaosConfig, relay: str, resume: dict[int, int]) -> None:
        self.side = side
        ctx = mp.get_context("spawn")
        self.router, child = ctx.Pipe()
        self.worker = Worker(side, config, child, ctx, target=chaos_side_main, extra=(relay, resume))
        self.worker.start()
        child.close()  # the child has its copy; ours would keep the pipe open after it dies
        self.report: dict[str, Any] | None = None
        self.stopped = False

    def signal(self, sig: int) -> None:
        pid = self.worker.pid
        if pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)

    def end(self, grace_s: float) -> None:
        """Continue it if stopped (a stopped process ignores all but SIGKILL), join, terminate, kill."""
        self.signal(signal.SIGCONT)
        self.worker.stop(grace_s)
        for conn in (self.worker.conn, self.router):
            conn.close()


class ChaosSupervisor:
    """Runs both sides, relays starts, applies the fault schedule, drains, collects; always cleans up."""

    def __init__(self, config: ChaosConfig, progress: ChaosProgress | None = None) -> None:
        self.config = config
        self.progress = progress
        self.stream = RequestStream(config.workload)
        self.faults = deque(fault_schedule(config))
        self.tally = Tally()
        self.relay = Relay()
        self.sides: dict[str, SideProcess] = {}
        self.outbox: deque[int] = deque()            # starts for prefill, sent when its pipe takes them
        self.in_flight: dict[int, int] = {}          # global index -> session, admitted and not ended
        self.admitted: dict[int, int] = {}           # session -> requests admitted (decode resumes there)
        self.resume_at: tuple[str, float] | None = None   # (side, when) a stopped side gets SIGCONT
        self.final: dict[str, Any] | None = None
        self.draining = False
        self.scribble_at = config.scribble_at_s
        self.error: str | None = None
        self.started = 0.0
        self.last_progress = 0.0

    def run(self) -> ChaosResult:
        self.started = time.monotonic()
        try:
            self.relay.start()
            for side in ("prefill", "decode"):
                self._spawn(side)
            self._chaos_phase(self.started + self.config.duration_s)
            self._drain()
        finally:
            self._shutdown()
        return self._result(time.monotonic() - self.started)

    # -- phases ----------------------------------------------------------------------------------------
    def _chaos_phase(self, end: float) -> None:
        while time.monotonic() < end:
            self._pump(PUMP_S)
            now = time.monotonic() - self.started
            if self.resume_at is not None and now >= self.resume_at[1]:
                self.sides[self.resume_at[0]].signal(signal.SIGCONT)
                self.resume_at = None
            if self.faults and self.resume_at is None and self.faults[0].at_s <= now:
                self._apply(self.faults.popleft(), now)
            if self.scribble_at is not None and now >= self.scribble_at:
                self.scribble_at = None
                self._send(self.sides["decode"].worker.conn, ("scribble",))
        if self.resume_at is not None:  # the duration ended inside a stall
            self.sides[self.resume_at[0]].signal(signal.SIGCONT)
            self.resume_at = None

    def _drain(self) -> None:
        """Decode stops admitting, finishes what is live, waits for leases, sweeps its pages, reports."""
        self.draining = True
        self._send(self.sides["decode"].worker.conn, ("drain",))
        deadline = time.monotonic() + self.config.drain_s
        while self.final is None and time.monotonic() < deadline:
            self._pump(PUMP_S)
        if self.final is None:
            self.error = self.error or f"decode did not finish draining within {self.config.drain_s:g} s"
            return
        self._await_holds()

    def _await_holds(self) -> None:
        """Pull mode: give prefill's source holds one hold period (2 x peer_timeout + lease_grace, plus a
        second) to end after decode drained; what is still held then has leaked."""
        wl = self.config.workload
        if wl.mode != "pull":
            return
        self.tally.source_holds = None   # only a report from after the drain counts
        deadline = time.monotonic() + 2 * float(wl.peer_timeout_s or 0) + float(wl.lease_grace_s or 0) + 1.0
        while time.monotonic() < deadline and self.tally.source_holds != 0:
            self._pump(PUMP_S)

    def _shutdown(self) -> None:
        for proc in self.sides.values():
            self._send(proc.worker.conn, ("stop",))
        for proc in self.sides.values():
            proc.end(grace_s=3.0)
        self.relay.close()

    # -- faults ----------------------------------------------------------------------------------------
    def _apply(self, event: FaultEvent, now: float) -> None:
        self.tally.count(self.tally.faults, f"{event.kind} {event.side}")
        self.tally.fault_log.append(f"{event.describe()} (applied at t+{now:.2f} s)")
        if event.kind == "cut":
            self.relay.cut()
        elif event.kind == "stop":
            self.sides[event.side].signal(signal.SIGSTOP)
            self.resume_at = (event.side, now + event.hold_s)
        else:
            self.sides[event.side].signal(signal.SIGKILL)
            self._restart(event.side, "killed")

    def _restart(self, side: str, why: str) -> None:
        """End the side's process (already dead, or dying) and start a fresh one where the old left off."""
        old = self.sides.pop(side)
        old.worker.stop(grace_s=2.0)
        for conn in (old.worker.conn, old.router):  # what it said before it died still counts
            self._read_remaining(old, conn)
        old.end(grace_s=0.1)
        self.tally.count(self.tally.restarts, side)
        if side == "decode":
            for g in list(self.in_flight):  # its requests die with it: failed, never wrong bytes
                self.in_flight.pop(g)
                self.tally.fail(f"decode {why}", f"{self.stream.spec(g).request_id}: decode {why}")
        else:
            self.outbox.clear()  # starts meant for the dead prefill; decode's requests time out there
        self._spawn(side)

    def _spawn(self, side: str) -> None:
        proc = SideProcess(side, self.config, self.relay.address, dict(self.admitted))
        self.sides[side] = proc
        if self.draining and side == "decode":  # a decode that crashed while draining: its successor drains
            self._send(proc.worker.conn, ("drain",))

    # -- messages --------------------------------------------------------------------------------------
    def _pump(self, timeout: float) -> None:
        conns = {p.worker.conn: p for p in self.sides.values()} | {p.router: p for p in self.sides.values()}
        for conn in mp.connection.wait(list(conns), timeout=timeout):
            proc = conns[conn]  # type: ignore[index]
            if self.sides.get(proc.side) is proc:  # a restart may have replaced it meanwhile
                self._receive(proc, conn)  # type: ignore[arg-type]
        self._flush_outbox()
        self._check_alive()
        self._report_progress()

    def _read_remaining(self, proc: SideProcess, conn: Connection) -> None:
        """Every message still buffered on ``conn`` of a dead process (bounded: it can send no more)."""
        while self._receive(proc, conn):
            pass

    def _receive(self, proc: SideProcess, conn: Connection) -> bool:
        """Handle one message if one is there; False at EOF or when none is waiting."""
        try:
            if not conn.poll():
                return False
            kind, *body = conn.recv()
        except (EOFError, OSError):
            return False  # the process is gone: _check_alive restarts it
        handler = getattr(self, f"_on_{kind}", None)
        if handler is None:
            self.tally.error(f"{proc.side}: unexpected message {kind!r}")
        else:
            handler(proc, *body)
        return True

    def _on_hello(self, proc: SideProcess, address: str) -> None:
        host, port = address.removeprefix("tcp://").rsplit(":", 1)
        self.relay.set_upstream((host, int(port)))
        self.relay.cut()  # connections still open lead to the previous prefill

    def _on_start(self, proc: SideProcess, g: int) -> None:
        session = self.stream.spec(g).session
        self.in_flight[g] = session
        self.admitted[session] = self.admitted.get(session, 0) + 1
        self.outbox.append(g)

    def _on_finished(self, proc: SideProcess, g: int, kind: str | None, detail: str | None, verified: int,
                     wrong_bytes: int, wrong_pages: int, nbytes: int, elapsed: float) -> None:
        self.in_flight.pop(g, None)
        t = self.tally
        if kind is None:
            t.done += 1
            t.bytes_moved += nbytes
        else:
            t.fail(kind, detail or kind)
        t.pages_verified += verified
        t.wrong_at_completion += wrong_bytes
        t.wrong_pages += wrong_pages

    def _on_recheck(self, proc: SideProcess, checked: int, wrong_bytes: int, wrong_pages: int) -> None:
        self.tally.pages_rechecked += checked
        self.tally.wrong_later += wrong_bytes
        self.tally.wrong_pages += wrong_pages

    def _on_gauge(self, proc: SideProcess, quarantined: int, endpoint_q: int, live_leases: int) -> None:
        self.tally.quarantine_peak = max(self.tally.quarantine_peak, quarantined)
        self.tally.endpoint_quarantine_peak = max(self.tally.endpoint_quarantine_peak, endpoint_q)

    def _on_holds(self, proc: SideProcess, endpoint_holds: int, held: int) -> None:
        self.tally.source_holds = endpoint_holds + held
        self.tally.source_holds_peak = max(self.tally.source_holds_peak, endpoint_holds)

    def _on_result(self, proc: SideProcess, report: dict[str, Any]) -> None:
        proc.report = report
        if proc.side == "decode":
            self.final = report
            self._on_recheck(proc, report["rechecked"], report["wrong_bytes"], report["wrong_pages"])

    def _on_error(self, proc: SideProcess, text: str, detail: str = "") -> None:
        self.tally.error(text + (f"\n{detail}" if detail else ""))

    def _flush_outbox(self) -> None:
        prefill = self.sides.get("prefill")
        while self.outbox and prefill is not None and _writable(prefill.router):
            self._send(prefill.router, ("start", self.outbox.popleft()))

    def _check_alive(self) -> None:
        for side, proc in list(self.sides.items()):
            if proc.worker.alive() or proc.report is not None:
                continue
            self._read_remaining(proc, proc.worker.conn)  # its last words (an error) first
            if self.final is None:
                self.tally.error(f"{proc.worker.describe_exit()}; restarted")
                self._restart(side, "crashed")

    def _report_progress(self) -> None:
        now = time.monotonic()
        if self.progress is not None and now - self.last_progress >= 0.2:
            self.last_progress = now
            self.progress(self.tally.done, self.tally.failed, now - self.started)

    @staticmethod
    def _send(conn: Connection, message: tuple[Any, ...]) -> None:
        with contextlib.suppress(OSError, ValueError, BrokenPipeError):
            conn.send(message)

    # -- result ----------------------------------------------------------------------------------------
    def _result(self, seconds: float) -> ChaosResult:
        t, cfg, final = self.tally, self.config, self.final or {}
        wl = cfg.workload
        return ChaosResult(
            seed=cfg.seed, duration_s=cfg.duration_s, seconds=seconds, preset=wl.preset,
            requests_done=t.done, requests_failed=t.failed, failures=dict(t.failures),
            first_failure=t.first_failure, pages_verified=t.pages_verified, pages_rechecked=t.pages_rechecked,
            bytes_wrong=t.wrong_at_completion + t.wrong_later, bytes_wrong_at_completion=t.wrong_at_completion,
            bytes_wrong_later=t.wrong_later, wrong_pages=t.wrong_pages, bytes_moved=t.bytes_moved,
            leaked_leases=final.get("live_leases"), quarantined_pages_peak=t.quarantine_peak,
            endpoint_quarantined_pages_peak=t.endpoint_quarantine_peak, faults=dict(t.faults),
            fault_log=tuple(t.fault_log), restarts=dict(t.restarts), side_errors=tuple(t.side_errors),
            options={"peer_timeout_s": float(wl.peer_timeout_s or 0), "lease_grace_s": float(wl.lease_grace_s or 0),
                     "request_timeout_s": wl.request_timeout_s, "mode": wl.mode},
            error=self.error, extra={"final": final, "failure_examples": dict(t.examples)},
            source_holds_peak=t.source_holds_peak,
            source_holds_left=t.source_holds if wl.mode == "pull" else 0,
        )


def _writable(conn: Connection) -> bool:
    """Whether a small message to ``conn`` will not block (a stopped reader fills the pipe)."""
    try:
        return bool(select.select([], [conn.fileno()], [], 0)[1])
    except (OSError, ValueError):
        return False


def run_chaos(config: ChaosConfig, progress: ChaosProgress | None = None) -> ChaosResult:
    """Run ``config`` for its duration plus the drain; never leaves a process, thread or socket behind."""
    return ChaosSupervisor(config, progress).run()
