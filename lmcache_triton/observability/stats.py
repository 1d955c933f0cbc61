"""LMCStatsMonitor: the engine's counters and timings, read by tests, the bench and Prometheus.

This module imports nothing of the engine's: the engine fills a monitor, and an exporter reads an
`EngineSnapshot` and may attach an `observer` for per-operation timings.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field

from lmcache_triton.storage.tier_stats import TierStats
from lmcache_triton.storage.transfer_cost import TransferCost


@dataclass(frozen=True)
class LMCacheStats:
    lookup_requests: int
    lookup_tokens: int
    lookup_hit_tokens: int
    retrieve_requests: int
    requested_tokens: int
    hit_tokens: int
    store_requests: int
    stored_tokens: int
    stored_bytes: int
    retrieved_bytes: int
    store_time_s: float
    retrieve_time_s: float
    store_refusals: int
    verify_checked: int = 0
    verify_mismatches: int = 0
    lookup_misses: int = 0  # lookups that found none of their tokens (a request that missed entirely)
    # Tokens lookups did not find, by why (lmcache_triton.storage.manager.MISS_REASONS).
    miss_tokens: dict[str, int] = field(default_factory=dict)
    # Load-or-recompute decisions (engine/load_policy.py): "decision/reason" -> lookups, and the
    # tokens they covered. A lookup that loads part of its hit counts one of each.
    load_decisions: dict[str, int] = field(default_factory=dict)
    load_decision_tokens: dict[str, int] = field(default_factory=dict)
    load_deadline_stops: int = 0  # loads cut short at their deadline (what arrived was used)

    @property
    def retrieve_hit_rate(self) -> float:
        """Share of the tokens asked of `retrieve` that were loaded. Retrieve is only asked for what
        a lookup found, so this is near 1 even when most requests miss: see `lookup_hit_rate`."""
        return self.hit_tokens / self.requested_tokens if self.requested_tokens else 0.0

    hit_rate = retrieve_hit_rate  # the older name

    @property
    def lookup_hit_rate(self) -> float:
        """Share of the tokens asked about by lookups (every prompt) that were found cached."""
        return self.lookup_hit_tokens / self.lookup_tokens if self.lookup_tokens else 0.0

    @property
    def store_gbps(self) -> float:
        return self.stored_bytes / self.store_time_s / 1e9 if self.store_time_s else 0.0

    @property
    def retrieve_gbps(self) -> float:
        return self.retrieved_bytes / self.retrieve_time_s / 1e9 if self.retrieve_time_s else 0.0

    def to_dict(self) -> dict[str, float]:
        d: dict[str, float] = asdict(self)
        d.update(hit_rate=self.hit_rate, retrieve_hit_rate=self.retrieve_hit_rate,
                 lookup_hit_rate=self.lookup_hit_rate, store_gbps=self.store_gbps, retrieve_gbps=self.retrieve_gbps)
        return d


@dataclass(frozen=True)
class EngineSnapshot:
    """What an exporter reads of one engine, taken at one time."""

    model: str
    rank: int
    stats: LMCacheStats
    tiers: Mapping[str, TierStats]  # tier name -> its stats (`StorageManager.usage()`), CPU first
    expired_reservations: int  # lookup reservations released by their lease, not by a load
    # What loading costs per tier now (`StorageManager.costs()`), and vLLM's prefill per token
    # (None: not measured yet): what the load-or-recompute decision reads.
    costs: Mapping[str, TransferCost] = field(default_factory=dict)
    prefill_seconds_per_token: float | None = None


# (operation, seconds, bytes moved or None): "lookup", "retrieve" or "store"
Observer = Callable[[str, float, "int | None"], None]


_MAPS = ("miss_tokens", "load_decisions", "load_decision_tokens")  # the stats fields that count by label


class LMCStatsMonitor:
    """Thread-safe accumulators; `get_stats()` returns an immutable snapshot. An `observer`
    (set by an exporter) also sees each operation's time and bytes."""

    _MAPS = _MAPS
    _FIELDS = tuple(f for f in LMCacheStats.__dataclass_fields__ if f not in _MAPS)

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.observer: Observer | None = None
        self.reset()

    def reset(self) -> None:
        with self._lock:
            self._values: dict[str, float] = {f: 0 for f in self._FIELDS}
            self._maps: dict[str, dict[str, int]] = {m: {} for m in self._MAPS}

    def _add(self, **deltas: float) -> None:
        with self._lock:
            for k, v in deltas.items():
                self._values[k] += v

    def _observe(self, op: str, seconds: float, nbytes: int | None = None) -> None:
        if self.observer is not None:
            self.observer(op, seconds, nbytes)

    def on_lookup(self, num_tokens: int, hit_tokens: int, seconds: float = 0.0,
                  misses: Mapping[str, int] | None = None) -> None:
        self._add(lookup_requests=1, lookup_tokens=num_tokens, lookup_hit_tokens=hit_tokens,
                  lookup_misses=0 if hit_tokens else 1)
        if misses:
            with self._lock:
                counts = self._maps["miss_tokens"]
                for reason, n in misses.items():
                    if n > 0:
                        counts[reason] = counts.get(reason, 0) + n
        self._observe("lookup", seconds)

    def on_load_decision(self, decision: str, reason: str, tokens: int) -> None:
        label = f"{decision}/{reason}"
        with self._lock:
            for name, n in (("load_decisions", 1), ("load_decision_tokens", tokens)):
                counts = self._maps[name]
                counts[label] = counts.get(label, 0) + n

    def on_deadline_stop(self) -> None:
        self._add(load_deadline_stops=1)

    def on_verify(self, checked: int, mismatched: int) -> None:
        self._add(verify_checked=checked, verify_mismatches=mismatched)

    def on_retrieve(self, requested_tokens: int, hit_tokens: int, nbytes: int, seconds: float) -> None:
        self._add(retrieve_requests=1, requested_tokens=requested_tokens, hit_tokens=hit_tokens,
                  retrieved_bytes=nbytes, retrieve_time_s=seconds)
        self._observe("retrieve", seconds, nbytes)

    def on_store(self, stored_tokens: int, nbytes: int, seconds: float, refusals: int = 0) -> None:
        self._add(store_requests=1, stored_tokens=stored_tokens, stored_bytes=nbytes,
                  store_time_s=seconds, store_refusals=refusals)
        self._observe("store", seconds, nbytes)

    def get_stats(self) -> LMCacheStats:
        with self._lock:
            return LMCacheStats(**self._values, **{m: dict(counts) for m, counts in self._maps.items()})
