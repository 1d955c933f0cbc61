"""The interface every tier below the CPU one implements (local disk, remote stores).

Backends are synchronous and thread-safe; the StorageManager runs their writes on its own thread
pool and promotes their hits into the CPU tier. A backend turns every I/O or data problem into a
failed put or a miss (and counts it): a broken disk or store must never crash or hang vLLM.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Sequence
from functools import cached_property

import torch

from lmcache_triton.keys import CacheEngineKey
from lmcache_triton.storage.memory import MemoryFormat, MemoryObj
from lmcache_triton.storage.tier_stats import TierStats
from lmcache_triton.storage.transfer_cost import TransferEstimate

# Gives the backend room for a chunk it is about to read (e.g. the CPU pool's allocate);
# None when there is no room, which the backend reports as a miss.
AllocateFn = Callable[[tuple[int, ...], torch.dtype, MemoryFormat], MemoryObj | None]


class StorageBackend(abc.ABC):
    name: str
    # True when `contains` answers from memory (no I/O): `store`, on vLLM's per-step path, may ask.
    indexed_in_memory: bool = False
    # Where the tier keeps its chunks relative to this host (vLLM's KV events' `locality`): a
    # remote is shared with other instances and evicts without telling them.
    locality: str = "LOCAL"
    # Told of every key this tier drops that it knows of (removed, deleted as corrupt, evicted
    # where the tier evicts itself): the StorageManager's event log, when something publishes it.
    on_drop: Callable[[CacheEngineKey], None] | None = None

    def _dropped(self, key: CacheEngineKey) -> None:
        if self.on_drop is not None:
            self.on_drop(key)

    @cached_property
    def cost(self) -> TransferEstimate:
        """What reading from this tier costs now (transfer_cost.py): fed by the backend's own
        transfers, where the bytes move, read by the load-or-recompute decision."""
        return TransferEstimate()

    @abc.abstractmethod
    def contains(self, key: CacheEngineKey) -> bool:
        """Whether `key` is stored (a hint: a later get may still miss)."""

    def batched_contains(self, keys: Sequence[CacheEngineKey]) -> list[bool]:
        return [self.contains(k) for k in keys]

    def try_batched_contains(self, keys: Sequence[CacheEngineKey]) -> list[bool] | None:
        """`batched_contains`, or None when the backend could not be asked (down, failing)."""
        return self.batched_contains(keys)

    @abc.abstractmethod
    def put(self, key: CacheEngineKey, obj: MemoryObj) -> bool:
        """Stores `obj.tensor` under `key`, synchronously; `obj` stays held (the caller's hold) meanwhile.

        False on failure (logged once per kind, counted); never raises for I/O problems.
        """

    @abc.abstractmethod
    def get(self, key: CacheEngineKey, allocate: AllocateFn) -> MemoryObj | None:
        """Reads the chunk into a MemoryObj obtained from `allocate`; the caller owns it (no tier keeps it yet).

        Missing, corrupt, checksum/version/shape/dtype mismatch, I/O error: frees the object if one
        was allocated, counts, and returns None (a miss).
        """

    @abc.abstractmethod
    def remove(self, key: CacheEngineKey) -> bool:
        """Deletes `key`; False if it was not stored."""

    @abc.abstractmethod
    def close(self) -> None:
        """Releases the backend's resources; idempotent."""

    @abc.abstractmethod
    def stats(self) -> TierStats:
        """A snapshot of this tier's counters and occupancy."""
