"""Lookup reservations: the chunks a lookup reported stay held in the CPU tier until the load that
follows, and never longer than a lease.

A lookup (on the worker's lookup-server thread) holds the chunks it reports; the worker releases
them by lookup id once the step that loads them is done. Those two events race: the scheduler's
lookup may time out (`lookup_timeout_ms`) while the worker still waits on a slow disk or remote,
and the step's release then arrives before the lookup has held anything. So:
- holds are recorded as they are taken, not when the lookup ends;
- a release during a lookup cancels it: what it held so far is released now, what it holds later
  is released at once;
- a release before the lookup began leaves a tombstone, so the late lookup holds nothing;
- every lease expires after `lease_s` (config `reservation_lease_secs`), whatever happened to the request
  (aborted, preempted, never scheduled); expiries are counted.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from lmcache_triton.storage.manager import Hold


@dataclass
class Lease:
    lookup_id: str
    deadline: float
    holds: list[Hold] = field(default_factory=list)
    active_lookups: int = 0
    cancelled: bool = False


class LookupReservations:
    def __init__(self, release_all: Callable[[list[Hold]], None], lease_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._release_holds = release_all  # StorageManager.release_all
        self.lease_s = lease_s
        self._clock = clock
        self._lock = threading.Lock()
        self._leases: dict[str, Lease] = {}
        self._tombstones: dict[str, float] = {}  # lookup id -> when it stops mattering
        self.expired_leases = 0
        self.cancelled_lookups = 0

    def begin(self, lookup_id: str) -> Lease | None:
        """A lookup starts holding for `lookup_id`; None when it was already released (hold nothing)."""
        self.reap()
        with self._lock:
            if self._tombstones.pop(lookup_id, None) is not None:
                self.cancelled_lookups += 1
                return None
            lease = self._leases.get(lookup_id)
            if lease is None:
                lease = self._leases[lookup_id] = Lease(lookup_id, self._clock() + self.lease_s)
            else:  # looked up again (preemption) before the last release: one lease, the later bound
                lease.deadline = self._clock() + self.lease_s
            lease.active_lookups += 1
            return lease

    def add(self, lease: Lease, holds: Iterable[Hold]) -> bool:
        """Records holds just taken; False (and they are released now) when the lease is over."""
        holds = list(holds)
        with self._lock:
            live = not lease.cancelled and self._leases.get(lease.lookup_id) is lease
            if live:
                lease.holds.extend(holds)
        if not live:
            self._release_all(holds)
        return live

    def end(self, lease: Lease) -> None:
        with self._lock:
            lease.active_lookups -= 1

    def release(self, lookup_id: str) -> None:
        """The load for `lookup_id` is done (or will never come): release its holds."""
        with self._lock:
            lease = self._leases.pop(lookup_id, None)
            if lease is None:
                self._tombstones[lookup_id] = self._clock() + self.lease_s
                return
            if lease.active_lookups:
                lease.cancelled = True
                self.cancelled_lookups += 1
            holds, lease.holds = lease.holds, []
        self._release_all(holds)

    def reap(self) -> int:
        """Releases the holds of every expired lease; returns how many leases expired now."""
        now = self._clock()
        with self._lock:
            expired = [lease for lease in self._leases.values() if lease.deadline <= now]
            for lease in expired:
                del self._leases[lease.lookup_id]
                lease.cancelled = True
            self.expired_leases += sum(1 for lease in expired if lease.holds)
            holds = [p for lease in expired for p in lease.holds]
            for lease in expired:
                lease.holds = []
            for lookup_id in [i for i, t in self._tombstones.items() if t <= now]:
                del self._tombstones[lookup_id]
        self._release_all(holds)
        return len(expired)

    def release_everything(self) -> None:
        with self._lock:
            holds = [p for lease in self._leases.values() for p in lease.holds]
            for lease in self._leases.values():
                lease.cancelled = True
                lease.holds = []
            self._leases.clear()
            self._tombstones.clear()
        self._release_all(holds)

    @property
    def num_held(self) -> int:
        with self._lock:
            return sum(len(lease.holds) for lease in self._leases.values())

    def _release_all(self, holds: Iterable[Hold]) -> None:
        self._release_holds(list(holds))
