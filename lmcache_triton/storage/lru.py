"""The one least-recently-used map: the CPU tier, the disk tier and the cache server each keep
their entries in an `LRU`, and evict with its `evict` or `pop_lru`."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from typing import Generic, TypeVar

K = TypeVar("K")
V = TypeVar("V")


class LRU(Generic[K, V]):
    """key -> value with a size in bytes, least recently used first; `used_bytes` is their sum.

    Not thread-safe: every owner already holds a lock (or a single thread) around its own state.
    `held(value)` marks entries that must not be evicted now (a chunk being read or written).
    """

    def __init__(self) -> None:
        self._items: OrderedDict[K, tuple[V, int]] = OrderedDict()
        self.used_bytes = 0

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, key: object) -> bool:
        return key in self._items

    def count_prefix(self, keys: Iterable[object]) -> int:
        """How many of `keys`, from the first, are present."""
        items, n = self._items, 0
        for key in keys:
            if key not in items:
                break
            n += 1
        return n

    def __iter__(self) -> Iterator[K]:
        """Keys, least recently used first."""
        return iter(self._items)

    def newest(self) -> Iterator[K]:
        """Keys, most recently used first."""
        return reversed(self._items)

    def items(self) -> Iterator[tuple[K, V]]:
        """(key, value), least recently used first."""
        return ((k, v) for k, (v, _) in self._items.items())

    def values(self) -> Iterator[V]:
        """Values, least recently used first."""
        return (v for v, _ in self._items.values())

    def get(self, key: K) -> V | None:
        """The value, leaving the order alone."""
        item = self._items.get(key)
        return None if item is None else item[0]

    def touch(self, key: K) -> V | None:
        """The value, now the most recently used."""
        item = self._items.get(key)
        if item is None:
            return None
        self._items.move_to_end(key)
        return item[0]

    def put(self, key: K, value: V, nbytes: int) -> V | None:
        """Stores `value` as the most recently used; returns the value it replaced, if any."""
        old = self.pop(key)
        self._items[key] = (value, nbytes)
        self.used_bytes += nbytes
        return old

    def pop(self, key: K) -> V | None:
        item = self._items.pop(key, None)
        if item is None:
            return None
        self.used_bytes -= item[1]
        return item[0]

    def pop_lru(self, held: Callable[[V], bool] | None = None) -> tuple[K, V] | None:
        """Removes and returns the least recently used entry that is not held; None if none is."""
        for key, (value, _) in self._items.items():
            if held is None or not held(value):
                self.pop(key)
                return key, value
        return None

    def evict(self, capacity: int, incoming: int = 0,
              held: Callable[[V], bool] | None = None) -> list[tuple[K, V]] | None:
        """Removes least recently used entries that are not held until `incoming` more bytes fit
        in `capacity`, and returns them (the caller frees or deletes what they name). None, with
        nothing removed, when even removing every entry that is not held would not make room:
        a write that can never fit must not empty the cache on its way to failing."""
        need = self.used_bytes + incoming - capacity
        if need <= 0:
            return []
        victims: list[K] = []
        for key, (value, nbytes) in self._items.items():
            if held is None or not held(value):
                victims.append(key)
                need -= nbytes
                if need <= 0:
                    break
        else:
            return None
        return [(k, self.pop(k)) for k in victims]
