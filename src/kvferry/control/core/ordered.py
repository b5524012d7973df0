"""An insertion-ordered set, for the records and sessions a core iterates over.

Part of the protocol core (no I/O), below ``prefill``, ``holds`` and ``decode``. A built-in ``set`` of objects
iterates in the order of their addresses, so which record the core settles, fails or posts first would
follow the allocator: a seed of the simulator (``kvferry.simulation``) could replay differently after any
unrelated change, and two runs of an endpoint could decide the same events in different orders. The
standard library has no ordered set and a PyPI one is a dependency for twenty lines: this is a dict's keys.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, MutableSet
from typing import TypeVar

__all__ = ["OrderedSet"]

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
