"""The plan contract: what every planner produces and every transport posts.

Part of the plan layer, above ``layout``, below ``planner`` and ``tp`` (which meet it), the fault injector's
``FaultyPlan`` (which meets it too) and the transports (whose ``write`` takes it). A plan is built once,
frozen, and posted as it is.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Protocol

import numpy as np

from kvferry.layout.memory import KVMemory

__all__ = ["Plan", "RowsPlan"]


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


@dataclass(frozen=True, eq=False)
class RowsPlan:
    """A plan built from explicit rows that are pieces of pages (head slices across TP sizes, token ranges
    between page sizes): what ``Plan`` asks of it but the selectors, which each kind refuses in its own words.
    ``row_buffer_ids``: int64 [N], each row's buffer as an index into ``Layout.buffers``."""

    src_memory: KVMemory
    dst_memory: KVMemory
    src_descs: np.ndarray      # uint64 [N, 3] (address, length, device), read-only
    dst_descs: np.ndarray
    row_buffer_ids: np.ndarray

    @property
    def num_descriptors(self) -> int:
        return len(self.src_descs)

    @cached_property
    def nbytes(self) -> int:
        return int(self.src_descs[:, 1].sum())

    @cached_property
    def buffer_names(self) -> tuple[str, ...]:
        """Buffers this plan writes, in row order."""
        names = [b.name for b in self.src_memory.layout.buffers]
        return tuple(names[i] for i in dict.fromkeys(self.row_buffer_ids.tolist()))

    @property
    def whole_pages(self) -> bool:
        return False
