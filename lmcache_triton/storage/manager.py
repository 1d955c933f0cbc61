"""StorageManager: the ordered tiers behind one interface. The engine uses only this class.

Tiers, first to last: the CPU tier (LocalCPUBackend) -> the local disk (`local_disk`) -> the remote
(`remote_url`). Write policy: a chunk goes into the CPU tier at once and is written through to every
lower tier by a small thread pool, so `store` never waits on a disk or a network; the chunk stays
pinned (not evictable) until those writes finish. Reads take the first tier that has the chunk and
promote lower-tier hits into the CPU tier. With `local_cpu: false` the CPU pool only stages chunks
on their way down and up; nothing stays in it.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait

import torch

from lmcache_triton.config import LMCacheEngineConfig
from lmcache_triton.memory import MemoryFormat, MemoryObj
from lmcache_triton.metadata import LMCacheEngineMetadata
from lmcache_triton.storage.local_cpu import LocalCPUBackend
from lmcache_triton.token_database import CacheEngineKey

logger = logging.getLogger("lmcache_triton")

_GB = 1 << 30


def _lower_tiers(config: LMCacheEngineConfig, metadata: LMCacheEngineMetadata | None) -> list:
    tiers = []
    if config.local_disk or config.remote_url:
        if metadata is None:
            raise ValueError("the disk and remote tiers need the engine metadata to check what they read")
    if config.local_disk:
        from lmcache_triton.storage.local_disk import LocalDiskBackend

        # The disk keeps chunks uncompressed: lz4 costs more CPU than the local disk saves in bytes.
        tiers.append(LocalDiskBackend(config.local_disk, int(config.max_local_disk_size * _GB), metadata))
    if config.remote_url:
        from lmcache_triton.storage.remote import create_remote_backend

        tiers.append(create_remote_backend(config.remote_url, metadata, compression=config.remote_serde,
                                           timeout_s=config.blocking_timeout_secs,
                                           auth_token=config.remote_auth_token))
    return tiers


class StorageManager:
    def __init__(self, config: LMCacheEngineConfig, metadata: LMCacheEngineMetadata | None = None, *,
                 pin_memory: bool | None = None) -> None:
        self.config = config
        size = int(config.max_local_cpu_size * _GB)
        if size <= 0:
            raise ValueError(f"max_local_cpu_size must be > 0 GB to stage chunks, got {config.max_local_cpu_size}")
        self.cpu = LocalCPUBackend(size, pin_memory=pin_memory)
        self.tiers = _lower_tiers(config, metadata)
        self._writer = ThreadPoolExecutor(max_workers=2, thread_name_prefix="lmct-write") if self.tiers else None
        self._pending: set[Future] = set()
        self._pending_lock = threading.Lock()
        self._closed = False

    # ---- allocation ------------------------------------------------------------------------------
    def allocate(self, shape: tuple[int, ...] | torch.Size, dtype: torch.dtype, fmt: MemoryFormat) -> MemoryObj | None:
        return self.cpu.allocate(shape, dtype, fmt)

    # ---- queries ---------------------------------------------------------------------------------
    def contains(self, key: CacheEngineKey, pin: bool = False) -> bool:
        return self.batched_contains([key], pin=pin) == 1

    def contains_each(self, keys: Sequence[CacheEngineKey]) -> list[bool]:
        """Presence of every key in any tier, asking each lower tier once for what is still missing."""
        found = [self.cpu.contains(k) for k in keys]
        for tier in self.tiers:
            missing = [i for i, f in enumerate(found) if not f]
            if not missing:
                break
            for i, hit in zip(missing, tier.batched_contains([keys[i] for i in missing])):
                found[i] = found[i] or hit
        return found

    def batched_contains(self, keys: Sequence[CacheEngineKey], pin: bool = False) -> int:
        """How many of `keys`, from the first, are present in some tier (a prefix count).

        With `pin`, the counted chunks are pinned in the CPU tier (lower-tier hits are promoted
        into it first, the prefetch path), and stay until `unpin(key)`."""
        n = 0
        for key in keys:
            if not self.cpu.contains(key, pin=pin):
                break
            n += 1
        if n == len(keys) or not self.tiers:
            return n
        rest = keys[n:]
        present = self.contains_each(rest)
        for key, hit in zip(rest, present):
            if not hit:
                break
            if pin:
                obj = self.get(key)  # promoted and pinned; stays pinned for the caller's load
                if obj is None:
                    break
                if not self.cpu.holds(key, obj):  # local_cpu off: no tier keeps it, `unpin` could never
                    self.release(key, obj)        # find it; free it now, the load reads it again
            n += 1
        return n

    def get(self, key: CacheEngineKey) -> MemoryObj | None:
        """The chunk, pinned for the caller, from the first tier that has it; `release` it when done."""
        obj = self.cpu.get(key)
        if obj is not None:
            return obj
        for tier in self.tiers:
            obj = tier.get(key, self.cpu.allocate)
            if obj is None:
                continue
            if self.config.local_cpu and not self.cpu.put(key, obj):
                return self.cpu.get(key)  # another thread promoted it first; ours was freed
            obj.pin()
            return obj
        return None

    def batched_get(self, keys: Sequence[CacheEngineKey]) -> list[MemoryObj | None]:
        return [self.get(k) for k in keys]

    def release(self, key: CacheEngineKey, obj: MemoryObj) -> None:
        """Ends a use begun by `get`: unpins, and frees objects that live in no tier."""
        obj.unpin()
        if not obj.is_pinned and not self.cpu.holds(key, obj):
            obj.free()

    def unpin(self, key: CacheEngineKey) -> None:
        """Releases a pin taken by `contains(pin=True)` / `batched_contains(pin=True)`."""
        self.cpu.unpin(key)

    # ---- writes ----------------------------------------------------------------------------------
    def put(self, key: CacheEngineKey, obj: MemoryObj) -> None:
        """Takes ownership of `obj`: into the CPU tier now, written through to lower tiers later."""
        if self.config.local_cpu:
            if not self.cpu.put(key, obj):
                return  # already stored; the duplicate was freed
        for _ in self.tiers:  # every pin before any write starts: a write that finishes first
            obj.pin()         # would otherwise free (local_cpu off) or expose to eviction an obj
        for tier in self.tiers:  # that the next tier's write has yet to read
            future = self._writer.submit(self._write, tier, key, obj)
            with self._pending_lock:
                self._pending.add(future)
            future.add_done_callback(self._forget)
        if not self.config.local_cpu and not self.tiers:
            obj.free()

    def _write(self, tier, key: CacheEngineKey, obj: MemoryObj) -> None:
        try:
            tier.put(key, obj)
        except Exception:  # a backend bug must not kill the writer thread or leak the pin
            logger.exception("lmcache_triton: write of %s to %s failed", key, tier.name)
        finally:
            self.release(key, obj)

    def _forget(self, future: Future) -> None:
        with self._pending_lock:
            self._pending.discard(future)

    def batched_put(self, keys: Sequence[CacheEngineKey], objs: Sequence[MemoryObj]) -> None:
        for key, obj in zip(keys, objs, strict=True):
            self.put(key, obj)

    def flush(self, timeout: float | None = None) -> None:
        """Waits until every pending write to the lower tiers is done."""
        with self._pending_lock:
            pending = list(self._pending)
        wait(pending, timeout=timeout)

    def remove(self, key: CacheEngineKey) -> bool:
        removed = self.cpu.remove(key)
        for tier in self.tiers:
            removed = tier.remove(key) or removed
        return removed

    def clear(self) -> int:
        """Drops every unpinned chunk of the CPU tier (lower tiers keep theirs)."""
        return self.cpu.clear()

    def usage(self) -> dict[str, dict[str, int | float]]:
        out: dict[str, dict[str, int | float]] = {
            "cpu": {
                "used_bytes": self.cpu.used_bytes,
                "capacity_bytes": self.cpu.capacity_bytes,
                "chunks": len(self.cpu),
                "pinned_chunks": self.cpu.num_pinned,
                "evictions": self.cpu.num_evictions,
                "refusals": self.cpu.num_refusals,
            }
        }
        for tier in self.tiers:
            out[tier.name] = tier.stats()
        return out

    def close(self) -> None:
        """Drains pending writes, then closes every tier. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._writer is not None:
            self.flush()
            self._writer.shutdown(wait=True)
        for tier in self.tiers:
            tier.close()
        self.cpu.close()
