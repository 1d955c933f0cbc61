"""The CPU tier: chunks in a bounded pool (page-locked where CUDA exists, else committed ahead in the
background), evicted least-recently-used first."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace

import torch

from lmcache_triton.keys import CacheEngineKey
from lmcache_triton.storage.lru import LRU
from lmcache_triton.storage.memory import MemoryFormat, MemoryObj, TensorMemoryPool
from lmcache_triton.storage.tier_stats import TierStats

logger = logging.getLogger("lmcache_triton")


def _is_held(obj: MemoryObj) -> bool:
    return obj.is_held


class LocalCPUBackend:
    """LRU map key -> MemoryObj over a TensorMemoryPool of `size_bytes`.

    A held object (being read, written through, or reported by a lookup that a load will
    follow) is never evicted. Holds are taken by `get` (or by `put(holds=n)`) and released through
    the object (`StorageManager.release`), never by key: a key may be removed or replaced meanwhile.
    When every object is held and the pool is full, `allocate` refuses (returns None): the caller
    skips storing that chunk, which costs a future miss, never an OOM.
    """

    name = "LocalCPUBackend"

    def __init__(self, size_bytes: int, *, pin_memory: bool | None = None,
                 on_evict: Callable[[CacheEngineKey, MemoryObj], None] | None = None, prefault: bool = True) -> None:
        # prefault: the pool commits its pages in the background from now on (README, Tiers), so
        # the first stores do not fault them in; False for the old behaviour (bench/startup.py).
        self.pool = TensorMemoryPool(size_bytes, pin_memory=pin_memory, prefault=prefault)
        self._objs: LRU[CacheEngineKey, MemoryObj] = LRU()
        self._lock = threading.RLock()
        self._on_evict = on_evict  # the StorageManager remembers why a key went (miss reasons)
        # Told of every key this tier gains ("stored") or loses ("removed"), under its lock: the
        # StorageManager's event log (tier_events.py), when something publishes it.
        self.on_change: Callable[[str, CacheEngineKey], None] | None = None
        self._stats = TierStats(capacity_bytes=self.pool.capacity)

    # ---- queries -------------------------------------------------------------------------------
    def contains(self, key: CacheEngineKey) -> bool:
        with self._lock:
            return key in self._objs

    def count_prefix(self, keys: Sequence[CacheEngineKey]) -> int:
        """How many of `keys`, from the first, this tier keeps: one lock for all (a lookup asks 32
        keys for an 8K-token prompt; a lock and a call per key were 1 us each)."""
        with self._lock:
            return self._objs.count_prefix(keys)

    def get(self, key: CacheEngineKey) -> MemoryObj | None:
        """The object, held for the caller (who must `unhold()` it), and marked recently used."""
        with self._lock:
            obj = self._objs.touch(key)
            if obj is None:
                self._stats.misses += 1
                return None
            self._stats.hits += 1
            obj.hold()
            return obj

    def hold_prefix(self, keys: Sequence[CacheEngineKey], hold_into: list[tuple[CacheEngineKey, MemoryObj]]) -> int:
        """`get` of each of `keys` in turn until the first absent one, under one lock: the objects
        held for the caller, appended to `hold_into` as (key, object); how many. (A reserving
        lookup of 32 chunks and its release, hot, on the 2-core host: 229 us with a lock per chunk
        on each side, 164 us with one.)"""
        n = 0
        with self._lock:
            for key in keys:
                obj = self._objs.touch(key)
                if obj is None:
                    self._stats.misses += 1
                    break
                obj.hold()
                hold_into.append((key, obj))
                n += 1
            self._stats.hits += n
        return n

    def unkept(self, pairs: Iterable[tuple[CacheEngineKey, MemoryObj]]) -> list[tuple[CacheEngineKey, MemoryObj]]:
        """Those of the (key, object) pairs whose object this tier does not keep under its key."""
        with self._lock:
            return [(key, obj) for key, obj in pairs if self._objs.get(key) is not obj]

    def keeps(self, key: CacheEngineKey, obj: MemoryObj) -> bool:
        """Whether `obj` is the object this tier keeps under `key`."""
        with self._lock:
            return self._objs.get(key) is obj

    def keys(self) -> list[CacheEngineKey]:
        with self._lock:
            return list(self._objs)

    def __len__(self) -> int:
        return len(self._objs)

    @property
    def used_bytes(self) -> int:
        return self.pool.used_bytes

    @property
    def capacity_bytes(self) -> int:
        return self.pool.capacity

    @property
    def num_held(self) -> int:
        with self._lock:
            return sum(obj.is_held for obj in self._objs.values())

    def stats(self) -> TierStats:
        with self._lock:
            return replace(self._stats, chunks=len(self._objs), used_bytes=self.pool.used_bytes,
                           held_chunks=self.num_held)

    # ---- writes --------------------------------------------------------------------------------
    def allocate(self, shape: tuple[int, ...] | torch.Size, dtype: torch.dtype, fmt: MemoryFormat) -> MemoryObj | None:
        """Room for a new chunk, evicting unheld LRU objects as needed; None if none can be made.

        Evicts one object at a time until the pool's first-fit allocation succeeds: freed bytes
        are not enough, they must be contiguous, so a byte count cannot tell how many to evict."""
        with self._lock:
            if self.pool.aligned_size(shape, dtype) > self.pool.capacity:
                self._stats.put_failures += 1
                return None
            while (obj := self.pool.allocate(shape, dtype, fmt)) is None:
                victim = self._objs.pop_lru(held=_is_held)
                if victim is None:
                    self._stats.put_failures += 1
                    logger.debug("CPU tier full and every chunk held: refusing %s bytes", shape)
                    return None
                key, old = victim
                old.free()
                self._stats.evictions += 1
                if self._on_evict is not None:
                    self._on_evict(key, old)
                if self.on_change is not None:
                    self.on_change("removed", key)
            return obj

    def put(self, key: CacheEngineKey, obj: MemoryObj, *, holds: int = 0) -> bool:
        """Takes ownership of `obj`, with `holds` holds already on it when another thread can first
        see it (holding after the insert would let an eviction in between free memory the caller
        is about to read). A key already present keeps its object; the new one is freed."""
        with self._lock:
            self._stats.puts += 1
            if self._objs.touch(key) is not None:
                obj.free()
                return False
            for _ in range(holds):
                obj.hold()
            self._objs.put(key, obj, obj.nbytes)
            if self.on_change is not None:
                self.on_change("stored", key)
            return True

    def remove(self, key: CacheEngineKey) -> bool:
        """Drops a key. A held object leaves the map now (no new reader finds it) and its memory
        goes back to the pool at its last release (`StorageManager.release` frees objects that no
        tier keeps)."""
        with self._lock:
            obj = self._objs.pop(key)
            if obj is None:
                return False
            if not obj.is_held:
                obj.free()
            if self.on_change is not None:
                self.on_change("removed", key)
            return True

    def clear(self) -> int:
        """Drops every unheld object; returns how many were dropped."""
        with self._lock:
            dropped = [k for k, obj in self._objs.items() if not obj.is_held]
            for k in dropped:
                self._objs.pop(k).free()
                if self.on_change is not None:
                    self.on_change("removed", k)
            return len(dropped)

    def close(self) -> None:
        with self._lock:
            for obj in self._objs.values():
                obj.free()
            self._objs = LRU()
        self.pool.close()
