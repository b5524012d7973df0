"""Run a workload end to end: a decode side and a prefill side, real transfers, every byte verified.

The top of the workload layer (it drives ``sim`` over the control plane), below the benchmark suite and
``cli``. ``run_workload(config)`` starts decode and prefill as two OS processes (``multiprocessing`` spawn)
over NIXL, or, with ``transport="local"``, as two threads of this process over ``LocalTransport``. The
parent only orchestrates: it relays nothing on the data path, shows a progress bar, enforces one deadline,
and always cleans up.

The runner is six modules, one per concern; this one holds ``run_workload`` and turns the sides' reports
into a result (``config`` holds ``WorkloadConfig`` and ``WorkloadResult``):

* ``supervisor``: starts both sides, relays progress, enforces the deadline, cleans up;
* ``side``: what both sides share (memory, allocators, the schedule, pipes);
* ``decode``: the scheduler, which leases pages and checks every received byte against ``sim``'s
  pattern (independently of kvferry's digests), then frees the pages for reuse;
* ``prefill``: allocates its own pages, writes the pattern (standing in for the model's forward
  pass) and sends; ``faults``: the transport wrapper that injects ``--inject`` faults.

Both sides derive the same schedule from the seed, so only request indices cross between them.
"""

from __future__ import annotations

import time
from typing import Any

from kvferry.diagnostics.audit import audit
from kvferry.errors import OutOfPages
from kvferry.layout.spec import Layout
from kvferry.workload.config import DEFAULT_BUDGET, WorkloadConfig, WorkloadResult
from kvferry.workload.sim import build_schedule, pages_needed
from kvferry.workload.supervisor import ProgressFn, Reports, Supervisor

__all__ = ["DEFAULT_BUDGET", "WorkloadConfig", "WorkloadResult", "run_workload"]  # the first three from config


def run_workload(config: WorkloadConfig, progress: ProgressFn | None = None) -> WorkloadResult:
    """Run ``config`` to completion or to its deadline; never leaves a process or thread behind.

    ``progress(done, total)`` is called from this thread as requests finish. Errors inside either side
    (a refused handshake, a crash, the deadline) come back as ``WorkloadResult.error``, with whatever the
    other side had measured; errors in ``config`` itself (an unknown preset) raise ``KVFerryError``.
    """
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


# -- result ------------------------------------------------------------------------------------------------
def _result(config: WorkloadConfig, layout: Layout, reports: Reports, wall_s: float) -> WorkloadResult:
    dec = reports.decode or {}
    pre = reports.prefill or {}
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
        latencies_ms=tuple(float(x) for x in dec.get("latencies_ms", ())), mode=config.mode,
        reuse_prefix=config.reuse_prefix, per_turn=tuple(dec.get("per_turn", ())),
        reuse=_reuse(config, dec, pre),
        stats={role: report["stats"] for role, report in (("prefill", pre), ("decode", dec)) if "stats" in report},
    )


def _reuse(config: WorkloadConfig, dec: dict[str, Any], pre: dict[str, Any]) -> dict[str, int]:
    """What decode's prefix cache did (``reuse_prefix`` only): evictions, kept pages rechecked, and how
    prefill sent the requests that had a prefix."""
    if not config.reuse_prefix:
        return {}
    return {"evictions": int(dec.get("evictions", 0)), "pages_rechecked": int(dec.get("pages_rechecked", 0)),
            "whole_sends": int(pre.get("whole_sends", 0)), "suffix_sends": int(pre.get("suffix_sends", 0))}


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
