"""What each tier gained and lost, for whoever publishes it (vLLM's KV events: integration/vllm/kv_events.py).

The tiers report by key, from whatever thread changes them (a save, a write-through, an eviction
under the CPU tier's lock): an append to a bounded deque, never a wait. The reader drains it once a
step. When the reader falls behind by `limit` events the oldest are dropped and counted: a router
then misses a placement (a hint), never a chunk.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Literal

from lmcache_triton.keys import CacheEngineKey

STORED = "stored"
REMOVED = "removed"  # evicted, removed, dropped by a check (checksum, canary), or cleared


@dataclass(frozen=True, slots=True)
class TierEvent:
    kind: Literal["stored", "removed"]
    tier: str
    key: CacheEngineKey


class TierEventLog:
    def __init__(self, limit: int = 1 << 16) -> None:
        self._events: deque[TierEvent] = deque()
        self.limit = limit
        self.dropped = 0

    def add(self, kind: Literal["stored", "removed"], tier: str, key: CacheEngineKey) -> None:
        # deque.append/popleft are atomic: writers on several threads need no lock
        self._events.append(TierEvent(kind, tier, key))
        while len(self._events) > self.limit:
            try:
                self._events.popleft()
                self.dropped += 1
            except IndexError:
                break

    def drain(self) -> list[TierEvent]:
        out = []
        while True:
            try:
                out.append(self._events.popleft())
            except IndexError:
                return out
