"""A fault-injected storage tier for the tests of loads against a deadline (tests/storage,
tests/engine, the lookup server's): a real tier whose reads of chosen keys wait, until a gate is
set or for a delay. What a disk or remote that slows down mid-load looks like to the StorageManager.

On sys.path with tests/conftest.py (no __init__.py): `from slow_tier import SlowTier, slow_down`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable

from lmcache_triton.keys import CacheEngineKey
from lmcache_triton.storage.base import AllocateFn, StorageBackend
from lmcache_triton.storage.memory import MemoryObj
from lmcache_triton.storage.tier_stats import TierStats

GATE_WAIT_S = 10.0  # a gated read gives up after this: a failing test must not hang its teardown


class SlowTier(StorageBackend):
    """`inner` (a real tier) whose reads of the keys in `slow` wait until `gate` is set, or for
    `delay_s` when given. Everything else is the inner tier's; it keeps its own transfer estimate
    (`cost`, by its own name), the one the StorageManager's deadlines mark."""

    name = "SlowTier"
    indexed_in_memory = True

    def __init__(self, inner: StorageBackend, slow: Iterable[CacheEngineKey] = (), *, delay_s: float | None = None
                 ) -> None:
        self.inner = inner
        self.slow = set(slow)
        self.delay_s = delay_s
        self.gate = threading.Event()
        self.reads: list[CacheEngineKey] = []  # every get, in the order they began
        self._lock = threading.Lock()

    def get(self, key: CacheEngineKey, allocate: AllocateFn) -> MemoryObj | None:
        with self._lock:
            self.reads.append(key)
        if key in self.slow:
            if self.delay_s is not None:
                time.sleep(self.delay_s)
            else:
                self.gate.wait(GATE_WAIT_S)
        return self.inner.get(key, allocate)

    def contains(self, key: CacheEngineKey) -> bool:
        return self.inner.contains(key)

    def put(self, key: CacheEngineKey, obj: MemoryObj) -> bool:
        return self.inner.put(key, obj)

    def remove(self, key: CacheEngineKey) -> bool:
        return self.inner.remove(key)

    def close(self) -> None:
        self.gate.set()
        self.inner.close()

    def stats(self) -> TierStats:
        return self.inner.stats()


def slow_down(manager, slow: Iterable[CacheEngineKey] = (), **kw) -> SlowTier:
    """Puts a SlowTier in front of `manager`'s first lower tier (a StorageManager's) and returns it."""
    tier = SlowTier(manager.tiers[0], slow, **kw)
    manager.tiers[0] = tier
    return tier


def open_gates(manager) -> None:
    """Lets every gated read of `manager`'s slow tiers finish (before closing it: a close waits for them)."""
    for tier in manager.tiers:
        if isinstance(tier, SlowTier):
            tier.gate.set()


def wait_until(cond, timeout_s: float = 5.0) -> bool:
    """Polls `cond` until true or `timeout_s` passed; its last answer."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.02)
    return cond()
