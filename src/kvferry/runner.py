"""Run a workload end to end: a decode side and a prefill side, real transfers, every byte verified.

Top layer beside ``cli`` (it drives ``sim`` over the control plane). ``run_workload(config)`` starts decode
and prefill as two OS processes (``multiprocessing`` spawn) over NIXL, or, with ``transport="local"``, as
two threads of this process over ``LocalTransport`` (fast tests). The parent only orchestrates: it
relays nothing on the data path, shows a progress bar, enforces one deadline, and always cleans up.

The runner is five modules, one per concern; this one holds what callers use (``WorkloadConfig``,
``WorkloadResult``, ``run_workload``) and turns the sides' reports into a result:

* ``workload_supervisor``: starts both sides, relays progress, enforces the deadline, cleans up;
* ``workload_side``: what both sides share (memory, allocators, the schedule, pipes);
* ``workload_decode``: the scheduler, which leases pages and checks every received byte against ``sim``'s
  pattern (independently of kvferry's digests), then frees the pages for reuse;
* ``workload_prefill``: allocates its own pages, writes the pattern (standing in for the model's forward
  pass) and sends; ``workload_faults``: the transport wrapper that injects ``--inject`` faults.

Both sides derive the same schedule from the seed, so only request indices cross between them.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any

from .audit import audit
from .layout import Layout
from .presets import DEFAULT_PRESET, get_preset
from .sim import OutOfPages, WorkloadSpec, build_schedule, pages_needed
from .workload_supervisor import ProgressFn, Reports, Supervisor

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
    reports = Supervisor(config, progress).run()
    return _result(config, layout, reports, time.monotonic() - started)


def _check_capacity(config: WorkloadConfig, layout: Layout) -> None:
    """Refuse, before any process starts, a workload whose largest request cannot fit even alone."""
    largest = max(spec.num_tokens for spec in build_schedule(config.workload))
    for pool, need in pages_needed(layout, largest).items():
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
def _result(config: WorkloadConfig, layout: Layout, reports: Reports, wall_s: float) -> WorkloadResult:
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
