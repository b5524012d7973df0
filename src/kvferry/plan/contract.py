"""The plan contract: what every planner produces and every transport posts.

Part of the plan layer, above ``layout``, below ``planner`` and ``tp`` (which meet it), the fault injector's
``FaultyPlan`` (which meets it too) and the transports (whose ``write`` takes it). A plan is built once,
frozen, and posted as it is.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from kvferry.layout.memory import KVMemory

__all__ = ["Plan"]


class Plan(Protocol):
    """Rows to copy from ``src_memory`` (registered where the write is posted) into ``dst_memory`` (the
    peer's, as its manifest describes it): ``src_descs`` and ``dst_descs`` are N x 3 uint64 ``(address,
    length, device)``, read-only and aligned row by row; ``num_descriptors`` is N, ``nbytes`` the bytes
    moved, ``buffer_names`` the buffers written in row order. ``whole_pages`` is True when every row moves
    whole pages (equal TP), False when rows are head slices of pages; ``page_selectors`` gives indices into
    each side's ``KVMemory.page_descs()`` for prepared per-page lists, or ``PlanError`` for slices."""

    src_memory: KVMemory
    dst_memory: KVMemory
    src_descs: np.ndarray
    dst_descs: np.ndarray
    num_descriptors: int
    nbytes: int
    buffer_names: tuple[str, ...]
    whole_pages: bool

    def page_selectors(self) -> tuple[np.ndarray, np.ndarray]: ...
