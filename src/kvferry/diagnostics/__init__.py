"""The diagnostics layer: layout audits, byte diffs, plan dumps, indexer top-k Jaccard, fault injection.

Above ``integrity`` and ``plan``, beside ``control`` (neither imports the other); below ``workload`` and
``cli``. Inside: ``audit`` (per-buffer geometry and warnings), ``diff`` (which pages differ and how),
``render`` (rich tables of those), ``faults`` (the buffer-0 slot-count sender and byte flips).
"""

from kvferry.diagnostics.audit import AuditReport, SizingReport, audit, sizing
from kvferry.diagnostics.diff import DiffReport, diff_pages, indexer_topk_jaccard, plan_dump
from kvferry.diagnostics.faults import FaultKind, FaultSpec, FaultyPlan

__all__ = ["AuditReport", "DiffReport", "FaultKind", "FaultSpec", "FaultyPlan", "SizingReport", "audit",
           "diff_pages", "indexer_topk_jaccard", "plan_dump", "sizing"]
