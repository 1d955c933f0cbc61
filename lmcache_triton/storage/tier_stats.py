"""TierStats: what every tier reports through `stats()` (CPU, disk, remote), the same fields for all.

Its own module, free of torch, because the cache server reports its `--disk` folder with it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class TierStats:
    """A snapshot of one tier. Counters only grow. None: a figure this tier cannot know (a
    remote store keeps, bounds and evicts its chunks itself), never a zero that means "unknown"."""

    chunks: int | None = 0
    used_bytes: int | None = 0       # disk: its files and the writes in flight
    capacity_bytes: int | None = 0
    held_chunks: int | None = 0      # not evictable now: CPU: read, written through or reserved; disk: being written
    evictions: int | None = 0
    puts: int = 0
    put_failures: int = 0            # not stored: no room (CPU: a tier full of held chunks), or a failed write
    hits: int = 0
    misses: int = 0                  # every failed read too: a read of this tier is a hit or a miss
    errors: int = 0                  # failed I/O or calls (disk: OS errors; remote: down, timed out, rejected)
    corrupt: int = 0                 # chunks that failed their checks (a miss; deleted where ours)
    # What a tier below the CPU one moved: chunks read into the CPU tier (checks included) and
    # written to the tier, in bytes of KV and the seconds those calls took. The CPU tier's own
    # copies, to and from vLLM's cache, are the engine's (LMCacheStats retrieved/stored bytes).
    read_bytes: int = 0
    read_seconds: float = 0.0
    written_bytes: int = 0
    write_seconds: float = 0.0

    def get(self, name: str, default: int = 0) -> int:
        """`name` as the per-tier dicts of `StorageManager.usage()` gave it (unknown: `default`).
        Transitional: for the readers of those dicts until they read the fields."""
        value = getattr(self, name, None)
        return default if value is None else value


@dataclass
class RemoteStats(TierStats):
    skipped_unavailable: int = 0     # calls answered locally (a miss) during a back-off from a failing remote
