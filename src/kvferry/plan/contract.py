"""The plan contract: what every planner produces and every transport posts.

Part of the plan layer, above ``layout``, below ``planner`` and ``tp`` (which meet it), the fault
injector's ``FaultyPlan`` (which meets it too) and the transports (whose ``write`` takes it). A plan is
built once, frozen, and posted as it is: aligned N x 3 uint64 ``(address, length, device)`` rows for each
side, plus what a transport needs to check them and a digest needs to cover them.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from kvferry.layout.memory import KVMemory

__all__ = ["Plan"]


class Plan(Protocol):
    """Rows to copy from ``src_memory`` into ``dst_memory``, row ``i`` of each side aligned."""

    @property
    def src_memory(self) -> KVMemory:
        """The source side's memory (registered where the write is posted)."""

    @property
    def dst_memory(self) -> KVMemory:
        """The destination side's memory, as its manifest describes it."""

    @property
    def src_descs(self) -> np.ndarray:
        """N x 3 uint64 ``(address, length, device)``, read-only."""

    @property
    def dst_descs(self) -> np.ndarray:
        """N x 3 uint64, aligned with ``src_descs`` row by row."""

    @property
    def num_descriptors(self) -> int:
        """N, the rows a transport posts."""

    @property
    def nbytes(self) -> int:
        """Bytes the plan moves."""

    @property
    def buffer_names(self) -> tuple[str, ...]:
        """The buffers the plan writes, in row order."""

    @property
    def whole_pages(self) -> bool:
        """True when every row moves whole pages (equal TP); False when rows are head slices of pages."""

    def page_selectors(self) -> tuple[np.ndarray, np.ndarray]:
        """Indices into each side's ``KVMemory.page_descs()``, one per (buffer, page), for transports that
        post prepared per-page lists; ``PlanError`` where rows are not whole pages."""
        ...
