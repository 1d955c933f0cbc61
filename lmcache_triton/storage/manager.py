"""StorageManager: the ordered tiers behind one interface. The engine uses only this class.

Today it holds the CPU tier; the disk and remote tiers join the same list (CPU -> disk -> remote).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from lmcache_triton.config import LMCacheEngineConfig
from lmcache_triton.memory import MemoryFormat, MemoryObj
from lmcache_triton.storage.local_cpu import LocalCPUBackend
from lmcache_triton.token_database import CacheEngineKey

_GB = 1 << 30


class StorageManager:
    def __init__(self, config: LMCacheEngineConfig, *, pin_memory: bool | None = None) -> None:
        self.config = config
        # Chunks are staged in the CPU pool on their way anywhere, so the pool exists even when
        # local_cpu is False; then it only stages and nothing is kept in it.
        size = int(config.max_local_cpu_size * _GB)
        if size <= 0:
            raise ValueError(f"max_local_cpu_size must be > 0 GB to stage chunks, got {config.max_local_cpu_size}")
        self.cpu = LocalCPUBackend(size, pin_memory=pin_memory)

    # ---- allocation ------------------------------------------------------------------------------
    def allocate(self, shape: tuple[int, ...] | torch.Size, dtype: torch.dtype, fmt: MemoryFormat) -> MemoryObj | None:
        return self.cpu.allocate(shape, dtype, fmt)

    # ---- queries ---------------------------------------------------------------------------------
    def contains(self, key: CacheEngineKey, pin: bool = False) -> bool:
        return self.cpu.contains(key, pin=pin)

    def batched_contains(self, keys: Sequence[CacheEngineKey], pin: bool = False) -> int:
        """How many of `keys`, from the first, are present (a prefix count)."""
        n = 0
        for key in keys:
            if not self.contains(key, pin=pin):
                break
            n += 1
        return n

    def get(self, key: CacheEngineKey) -> MemoryObj | None:
        """The chunk, pinned for the caller (unpin when done), from the first tier that has it."""
        return self.cpu.get(key)

    def batched_get(self, keys: Sequence[CacheEngineKey]) -> list[MemoryObj | None]:
        return [self.get(k) for k in keys]

    def unpin(self, key: CacheEngineKey) -> None:
        self.cpu.unpin(key)

    # ---- writes ----------------------------------------------------------------------------------
    def put(self, key: CacheEngineKey, obj: MemoryObj) -> None:
        if self.config.local_cpu:
            self.cpu.put(key, obj)
        else:
            obj.free()

    def batched_put(self, keys: Sequence[CacheEngineKey], objs: Sequence[MemoryObj]) -> None:
        for key, obj in zip(keys, objs, strict=True):
            self.put(key, obj)

    def remove(self, key: CacheEngineKey) -> bool:
        return self.cpu.remove(key)

    def clear(self) -> int:
        return self.cpu.clear()

    def usage(self) -> dict[str, dict[str, int]]:
        return {
            "cpu": {
                "used_bytes": self.cpu.used_bytes,
                "capacity_bytes": self.cpu.capacity_bytes,
                "chunks": len(self.cpu),
                "pinned_chunks": self.cpu.num_pinned,
                "evictions": self.cpu.num_evictions,
                "refusals": self.cpu.num_refusals,
            }
        }

    def close(self) -> None:
        self.cpu.close()
