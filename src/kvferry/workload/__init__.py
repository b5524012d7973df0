"""The workload layer: many multi-turn sessions over real page allocators, prefill and decode as two
processes, every page verified.

Above ``control`` and ``diagnostics``; below the benchmark suite and ``cli``. Inside, bottom to top: ``sim``
(allocators, the schedule, page contents), ``reuse`` (decode's prefix cache for ``--reuse-prefix``: which
pages it keeps between turns, and whose bytes they hold), ``config`` (what a run is given and reports),
``faults`` (the transport wrapper that injects faults), ``side`` (what both sides share), ``decode`` and
``prefill`` (each side's loop), ``supervisor`` (processes, deadline, clean-up), ``runner``
(``run_workload``). The chaos run
builds on them: ``relay`` (a loopback TCP relay that can cut connections), ``chaos_plan`` (its config, fault
schedule, request stream and result), ``chaos_sides`` (restartable sides and the page ledger), ``chaos``
(``run_chaos``: the supervisor that stalls, kills and cuts).
"""

from kvferry.workload.config import DEFAULT_BUDGET, WorkloadConfig, WorkloadResult
from kvferry.workload.runner import run_workload

__all__ = ["DEFAULT_BUDGET", "WorkloadConfig", "WorkloadResult", "run_workload"]
