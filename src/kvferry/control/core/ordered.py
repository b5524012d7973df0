"""An insertion-ordered set, for the records and sessions a core iterates over.

Part of the protocol core (no I/O), below ``prefill``, ``holds`` and ``decode``. A built-in ``set`` of objects
iterates in the order of their addresses, so which record the core settles, fails or posts first would
follow the allocator: a seed of the simulator (``kvferry.simulation``) could replay differently after any
unrelated change, and two runs of an endpoint could decide the same events in different orders. The
standard library has no ordered set and a PyPI one is a dependency for twenty lines: this is a dict's keys.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, MutableSet
from typing import Any, TypeVar

from kvferry.control.core.deadlines import DeadlineHeap

__all__ = ["OrderedSet", "RecordSet"]

T = TypeVar("T")


class OrderedSet(MutableSet[T]):
    """A set that iterates in insertion order (re-adding a member keeps its place)."""

    __slots__ = ("_items",)

    def __init__(self, items: Iterable[T] = ()) -> None:
        self._items: dict[T, None] = dict.fromkeys(items)

    def __contains__(self, item: object) -> bool:
        return item in self._items

    def __iter__(self) -> Iterator[T]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def add(self, item: T) -> None:
        self._items[item] = None

    def discard(self, item: T) -> None:
        self._items.pop(item, None)

    def __repr__(self) -> str:
        return f"OrderedSet({list(self._items)!r})"


class RecordSet(OrderedSet[Any]):
    """An ``OrderedSet`` of request records that also keeps them by deadline (``earliest_live``)."""

    __slots__ = ("_by_deadline",)

    def __init__(self) -> None:
        super().__init__()
        self._by_deadline = DeadlineHeap()

    def add(self, item: Any) -> None:
        if item not in self._items:
            self._by_deadline.push(item)
        self._items[item] = None

    def earliest_live(self) -> float | None:
        """The least deadline among the live members (None: none is live)."""
        items = self._items
        return self._by_deadline.earliest(lambda rec: rec.is_live and rec in items, len(items))
