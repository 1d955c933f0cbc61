"""StorageManager: the ordered tiers behind one interface. The engine uses only this class.

Tiers, first to last: the CPU tier (LocalCPUBackend) -> the local disk (`local_disk`) -> the remote
(`remote_url`). Write policy: a chunk goes into the CPU tier at once and is written through to every
lower tier by a small thread pool, so `store` never waits on a disk or a network; the chunk stays
held (not evictable) until those writes finish. Reads take the first tier that has the chunk and
promote lower-tier hits into the CPU tier. With `local_cpu: false` the CPU pool only stages chunks
on their way down and up; nothing stays in it.

What "hold", "keep", "stage", "reservation" and "pin" mean here: the package docstring
(lmcache_triton/storage/__init__.py).
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence
import time
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor, wait
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Literal, overload

import torch

from lmcache_triton.config import LMCacheEngineConfig
from lmcache_triton.storage import serde
from lmcache_triton.storage.memory import MemoryFormat, MemoryObj
from lmcache_triton.metadata import LMCacheEngineMetadata
from lmcache_triton.storage.local_cpu import LocalCPUBackend
from lmcache_triton.storage.tier_events import REMOVED, STORED, TierEventLog
from lmcache_triton.storage.tier_stats import TierStats
from lmcache_triton.storage.transfer_cost import TransferCost, TransferEstimate
from lmcache_triton.keys import CacheEngineKey

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


# Why a chunk is missing, for the lmcache_triton_miss_tokens_total{reason} counter.
MISS_NEVER_STORED = "never_stored"
MISS_EVICTED = "evicted"
MISS_CORRUPT = "checksum_or_format"
MISS_REMOTE = "remote_error"
MISS_REFUSED = "pinned_tier_refusal"  # every CPU chunk held; the label keeps its old word (dashboards select on it)
MISS_PARTIAL = "partial_chunk"
MISS_BLEND = "blending_ineligible"
# Held by a tier, left to vLLM to compute: loading them was estimated slower (engine/load_policy.py),
# or their load ran past its deadline.
MISS_RECOMPUTE_CHEAPER = "recompute_cheaper"
MISS_DEADLINE = "load_deadline"
MISS_REASONS = (MISS_NEVER_STORED, MISS_EVICTED, MISS_CORRUPT, MISS_REMOTE, MISS_REFUSED, MISS_PARTIAL, MISS_BLEND,
                MISS_RECOMPUTE_CHEAPER, MISS_DEADLINE)
_RECENT_MISSES = 16384  # keys remembered with why they went (or never came): ~2 MB

# One hold: a key and its object, held; `StorageManager.release(key, obj)` ends it.
Hold = tuple[CacheEngineKey, MemoryObj]

CPU_TIER = "cpu"  # the CPU tier's name in `usage()` and `costs()`
# A key no chunk has: what the probe at start asks a remote (its round trip seeds the estimate).
_PROBE_KEY = CacheEngineKey("lmcache_triton-probe", 1, 0, "none", "none", "0" * 32)
_PROMOTIONS_QUEUED = 256  # background promotions waiting at most (each a chunk read)


@dataclass
class Located:
    """Where a prefix of keys is (`StorageManager.locate_prefix`): the first `held` keys are in the
    CPU tier and held for the caller; `lower[i]` names the tier keeping key `held + i`, up to the
    first key no tier keeps."""

    held: int
    lower: list[str] = field(default_factory=list)

    def __len__(self) -> int:
        return self.held + len(self.lower)


class _Read:
    """One lower-tier read a load waits for; abandoned at its deadline, it finishes in the
    background and is released there (its chunk stays in the CPU tier for the next request)."""

    __slots__ = ("key", "future", "lock", "abandoned")

    def __init__(self, key: CacheEngineKey) -> None:
        self.key = key
        self.future: Future | None = None
        self.lock = threading.Lock()
        self.abandoned = False


class StorageManager:
    def __init__(self, config: LMCacheEngineConfig, metadata: LMCacheEngineMetadata | None = None, *,
                 pin_memory: bool | None = None) -> None:
        self.config = config
        size = config.cpu_tier_bytes
        if size <= 0:
            raise ValueError(f"max_local_cpu_size must be > 0 GB to stage chunks, got {config.max_local_cpu_size}")
        self.metadata = metadata
        self.cpu = LocalCPUBackend(size, pin_memory=pin_memory, on_evict=self._on_evict)
        self.tiers = _lower_tiers(config, metadata)
        self._writer = ThreadPoolExecutor(max_workers=2, thread_name_prefix="lmct-write") if self.tiers else None
        # Lower-tier reads for loads (read_prefix) and background promotions: on their own threads,
        # so a load can stop at its deadline while a read is still on the wire.
        self._reader = ThreadPoolExecutor(max_workers=2, thread_name_prefix="lmct-read") if self.tiers else None
        self._promoting: set[CacheEngineKey] = set()
        # Copies out of the CPU tier into vLLM's cache (the engine's retrieve feeds it).
        self.cpu_cost = TransferEstimate()
        self._pending: set[Future] = set()
        self._pending_lock = threading.Lock()
        # With local_cpu off, chunks a reservation read from a lower tier wait here for the load
        # (which then reads memory, not the disk or network again), until their last release.
        self._staged: dict[CacheEngineKey, MemoryObj] = {}
        self._staged_lock = threading.Lock()
        self._recent: OrderedDict[CacheEngineKey, str] = OrderedDict()
        self._recent_lock = threading.Lock()
        self._closed = False
        self.events: TierEventLog | None = None  # see watch()
        for tier in self.tiers:
            if not tier.indexed_in_memory:  # a remote: its round trip seeds its estimate
                self._writer.submit(tier.try_batched_contains, [_PROBE_KEY])

    def watch(self) -> TierEventLog:
        """From now on every tier reports each key it gains or loses to the returned log (read by
        whoever publishes placements: vLLM's KV events). Remotes report only what this process
        sees: its own writes, removals and the corrupt chunks it deletes, not the server's evictions."""
        if self.events is None:
            log = self.events = TierEventLog()
            self.cpu.on_change = lambda kind, key: log.add(kind, CPU_TIER, key)
            for tier in self.tiers:
                tier.on_drop = lambda key, name=tier.name: log.add(REMOVED, name, key)
        return self.events

    # ---- why a miss ------------------------------------------------------------------------------
    def note_miss(self, key: CacheEngineKey, reason: str) -> None:
        with self._recent_lock:
            self._recent[key] = reason
            self._recent.move_to_end(key)
            while len(self._recent) > _RECENT_MISSES:
                self._recent.popitem(last=False)

    def miss_reason(self, key: CacheEngineKey) -> str:
        """Why `key` is not stored, as far as this process saw it go."""
        with self._recent_lock:
            return self._recent.get(key, MISS_NEVER_STORED)

    def _on_evict(self, key: CacheEngineKey, obj: MemoryObj) -> None:
        self.note_miss(key, MISS_EVICTED)

    # ---- allocation ------------------------------------------------------------------------------
    def allocate(self, shape: tuple[int, ...] | torch.Size, dtype: torch.dtype, fmt: MemoryFormat) -> MemoryObj | None:
        return self.cpu.allocate(shape, dtype, fmt)

    # ---- queries ---------------------------------------------------------------------------------
    def defer_prefault(self, seconds: float, *, at_least: bool = False) -> None:
        """Holds off committing the CPU tier's pages ahead for `seconds` (see TensorMemoryPool)."""
        self.cpu.pool.defer_prefault(seconds, at_least=at_least)

    @overload
    def contains(self, keys: Sequence[CacheEngineKey], *, io: bool, prefix: Literal[True],
                 hold_into: list[Hold] | None = None) -> int: ...

    @overload
    def contains(self, keys: Sequence[CacheEngineKey], *, io: bool, prefix: Literal[False]) -> list[bool]: ...

    def contains(self, keys: Sequence[CacheEngineKey], *, io: bool, prefix: bool,
                 hold_into: list[Hold] | None = None) -> int | list[bool]:
        """Which of `keys` the tiers keep.

        io: False asks only what answers without I/O: the CPU tier and the lower tiers that index
        their chunks in memory (the disk). `store` runs inside vLLM's step and asks only this: a
        remote that hangs must not hold up the forward pass (the remote's writers skip the duplicates
        this lets through). True asks every tier, a remote included.
        prefix: True returns how many of `keys`, from the first, some tier keeps (it stops asking
        at the first missing key; with io, that key's miss reason is noted for the metrics);
        False returns one bool per key.
        hold_into (io and prefix only): every counted chunk is held in the CPU tier for the load
        that follows (lower-tier hits are read and promoted into it first) and appended to the
        list as (key, obj) as soon as it is held; the caller `release`s each (a reservation)."""
        if isinstance(keys, CacheEngineKey):
            raise TypeError("StorageManager.contains takes a sequence of keys, got one CacheEngineKey")
        if hold_into is not None and not (io and prefix):
            raise ValueError(f"contains(hold_into=...) needs io=True and prefix=True (got io={io}, "
                             f"prefix={prefix}): holding a lower tier's hit reads it, and holds serve a prefix load")
        if not io:
            return self._prefix_in_memory(keys) if prefix else self._each_in_memory(keys)
        return self._prefix(keys, hold_into) if prefix else self._each(keys)

    def _each_in_memory(self, keys: Sequence[CacheEngineKey]) -> list[bool]:
        found = [self.cpu.contains(k) for k in keys]
        for tier in self.tiers:
            if tier.indexed_in_memory:
                found = [f or tier.contains(k) for f, k in zip(found, keys)]
        return found

    def _prefix_in_memory(self, keys: Sequence[CacheEngineKey]) -> int:
        n = self.cpu.count_prefix(keys)
        indexed = [tier for tier in self.tiers if tier.indexed_in_memory]
        while n < len(keys) and any(tier.contains(keys[n]) for tier in indexed):
            n += 1
        return n

    def _ask_lower_tiers(self, keys: Sequence[CacheEngineKey]) -> tuple[list[bool], bool]:
        """Presence in the lower tiers, asking each once for what is still missing; and whether a
        tier could not answer (unreachable, failing)."""
        found = [False] * len(keys)
        unreachable = False
        for tier in self.tiers:
            missing = [i for i, f in enumerate(found) if not f]
            if not missing:
                break
            answer = tier.try_batched_contains([keys[i] for i in missing])
            if answer is None:
                unreachable = True
                continue
            for i, hit in zip(missing, answer):
                found[i] = hit
        return found, unreachable

    def _each(self, keys: Sequence[CacheEngineKey]) -> list[bool]:
        found = [self.cpu.contains(k) for k in keys]
        missing = [i for i, f in enumerate(found) if not f]
        if missing and self.tiers:
            lower, _ = self._ask_lower_tiers([keys[i] for i in missing])
            for i, hit in zip(missing, lower):
                found[i] = hit
        return found

    def _prefix(self, keys: Sequence[CacheEngineKey], hold_into: list[Hold] | None) -> int:
        if hold_into is None:
            n = self.cpu.count_prefix(keys)
        else:
            n = 0
            for key in keys:
                obj = self.cpu.get(key)
                if obj is None:
                    break
                hold_into.append((key, obj))
                n += 1
        if n == len(keys) or not self.tiers:
            return n
        rest = keys[n:]
        present, unreachable = self._ask_lower_tiers(rest)
        for key, hit in zip(rest, present):
            if not hit:
                if unreachable:
                    self.note_miss(key, MISS_REMOTE)
                break
            if hold_into is not None:
                obj = self.get(key)  # promoted and held; stays held for the caller's load
                if not self._hold_read(key, obj, hold_into):
                    break
            n += 1
        return n

    def _hold_read(self, key: CacheEngineKey, obj: MemoryObj | None, hold_into: list[Hold]) -> bool:
        """A lower-tier read for a load: held for the caller (False: listed, but unreadable or
        failing its checks). With local_cpu off it is staged for the load, freed at its release."""
        if obj is None:
            self.note_miss(key, MISS_CORRUPT)
            return False
        if not self.cpu.keeps(key, obj):
            with self._staged_lock:
                self._staged.setdefault(key, obj)
        hold_into.append((key, obj))
        return True

    def hold_prefix_in_memory(self, keys: Sequence[CacheEngineKey], hold_into: list[Hold]) -> int:
        """`get_in_memory` of each of `keys` in turn until the first one missing, each object held
        and appended to `hold_into` (the caller releases them); how many. The CPU tier alone (no
        chunk staged) answers under its one lock."""
        if not self._staged:
            return self.cpu.hold_prefix(keys, hold_into)
        n = 0
        for key in keys:
            obj = self.get_in_memory(key)
            if obj is None:
                break
            hold_into.append((key, obj))
            n += 1
        return n

    # ---- loads in two steps: where the chunks are, then (as much as is worth it) read them ----------
    def locate_prefix(self, keys: Sequence[CacheEngineKey], hold_into: list[Hold] | None) -> Located:
        """Where the longest kept prefix of `keys` is, reading nothing from a lower tier: the CPU
        tier's part is held at once (appended to `hold_into`; None: a lookup that reserves nothing,
        counted under one lock), each lower tier is asked once what it keeps of the rest (a round
        trip). The first key no tier keeps has its miss reason noted."""
        if hold_into is None and not self._staged:
            held = self.cpu.count_prefix(keys)
        elif hold_into is None:
            counted: list[Hold] = []
            held = self.hold_prefix_in_memory(keys, counted)
            self.release_all(counted)
        else:
            held = self.hold_prefix_in_memory(keys, hold_into)
        located = Located(held)
        rest = keys[held:]
        if not rest or not self.tiers:
            return located
        where: list[str | None] = [None] * len(rest)
        unreachable = False
        for tier in self.tiers:
            missing = [i for i, w in enumerate(where) if w is None]
            if not missing:
                break
            answer = tier.try_batched_contains([rest[i] for i in missing])
            if answer is None:
                unreachable = True
                continue
            for i, hit in zip(missing, answer):
                if hit:
                    where[i] = tier.name
        for key, name in zip(rest, where):
            if name is None:
                if unreachable:
                    self.note_miss(key, MISS_REMOTE)
                break
            located.lower.append(name)
        return located

    def read_prefix(self, keys: Sequence[CacheEngineKey], hold_into: list[Hold], *,
                    deadline: float | None = None) -> tuple[int, bool]:
        """Reads `keys` (kept by lower tiers, as `locate_prefix` said) in order into the CPU tier,
        each held for the caller as it arrives (appended to `hold_into`); stops at the first that
        cannot be read, or at `deadline` (time.monotonic()). A read still on the wire at the deadline
        finishes in the background: its chunk lands in the CPU tier for the next request (with
        local_cpu) and is released there. Returns (keys held, whether the deadline stopped it)."""
        if not keys:
            return 0, False
        if self._reader is None:
            raise RuntimeError("read_prefix: no lower tier to read from")
        # One read at a time, in order: a chunk is read (and checked) only once the prefix before it
        # arrived, as a prefix load needs (the lm:// client moves one request at a time anyway).
        n, late = 0, False
        for key in keys:
            read = _Read(key)
            try:
                read.future = self._reader.submit(self.get, key)
            except RuntimeError:  # closing
                break
            read.future.add_done_callback(lambda f, r=read: self._read_done(r, f))
            timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                obj = read.future.result(timeout=timeout)
            except FutureTimeout:
                late = True
                self._abandon(read)
                break
            except CancelledError:  # closing
                break
            if not self._hold_read(key, obj, hold_into):
                break
            n += 1
        return n, late

    def _abandon(self, read: _Read) -> None:
        if read.future.cancel():
            return
        with read.lock:
            if not read.future.done():
                read.abandoned = True  # _read_done releases it when it arrives
                return
        obj = None if read.future.cancelled() or read.future.exception() else read.future.result()
        if obj is not None:
            self.release(read.key, obj)

    def _read_done(self, read: _Read, future: Future) -> None:
        with read.lock:
            if not read.abandoned:
                return
        obj = None if future.cancelled() or future.exception() else future.result()
        if obj is not None:
            self.release(read.key, obj)

    def promote_later(self, keys: Sequence[CacheEngineKey]) -> int:
        """Reads `keys` into the CPU tier in the background (a slow tier's chunks, for the next
        request), at most _PROMOTIONS_QUEUED waiting; returns how many were queued. Nothing to do
        with local_cpu off (nothing stays in the CPU pool)."""
        if self._reader is None or not self.config.local_cpu or self._closed:
            return 0
        queued = 0
        with self._staged_lock:
            for key in keys:
                if len(self._promoting) >= _PROMOTIONS_QUEUED:
                    break
                if key in self._promoting or self.cpu.contains(key):
                    continue
                self._promoting.add(key)
                try:
                    self._reader.submit(self._promote, key)
                except RuntimeError:  # shut down meanwhile
                    self._promoting.discard(key)
                    break
                queued += 1
        return queued

    def _promote(self, key: CacheEngineKey) -> None:
        try:
            obj = self.get(key)
            if obj is not None:
                self.release(key, obj)
        finally:
            with self._staged_lock:
                self._promoting.discard(key)

    def get(self, key: CacheEngineKey) -> MemoryObj | None:
        """The chunk, held for the caller, from the first tier that has it; `release` it when done."""
        obj = self.get_in_memory(key)
        if obj is not None:
            return obj
        for tier in self.tiers:
            known = tier.indexed_in_memory and tier.contains(key)
            obj = tier.get(key, self.cpu.allocate)
            if obj is None:
                if known and not tier.contains(key):  # indexed, then dropped by its checks
                    self.note_miss(key, MISS_CORRUPT)
                continue
            if not self.config.local_cpu:
                obj.hold()  # in no tier: nobody else can see it yet
                return obj
            if not self.cpu.put(key, obj, holds=1):  # held before other threads can evict it
                return self.cpu.get(key)  # another thread promoted it first; ours was freed
            return obj
        return None

    def get_in_memory(self, key: CacheEngineKey) -> MemoryObj | None:
        """`get` without I/O: the CPU tier, or a chunk a reservation staged (with local_cpu off)."""
        obj = self.cpu.get(key)
        if obj is not None:
            return obj
        with self._staged_lock:
            obj = self._staged.get(key)
            if obj is not None:
                obj.hold()
            return obj

    def release(self, key: CacheEngineKey, obj: MemoryObj) -> None:
        """Ends one hold taken by `get`, `contains(hold_into=...)` or a write-through, and frees an
        object that no tier keeps at its last release (MemoryObj.free is idempotent: two last releases
        racing free once)."""
        obj.unhold()
        if not obj.is_held and not self.cpu.keeps(key, obj):
            self._free_unkept(key, obj)

    def release_all(self, holds: Iterable[Hold]) -> None:
        """`release` of each hold, the CPU tier asked once for those no longer held."""
        unheld = []
        for key, obj in holds:
            obj.unhold()
            if not obj.is_held:
                unheld.append((key, obj))
        if unheld:
            for key, obj in self.cpu.unkept(unheld):
                self._free_unkept(key, obj)

    def _free_unkept(self, key: CacheEngineKey, obj: MemoryObj) -> None:
        with self._staged_lock:
            if obj.is_held:  # get_in_memory took it again meanwhile
                return
            if self._staged.get(key) is obj:
                del self._staged[key]
        obj.free()

    # ---- writes ----------------------------------------------------------------------------------
    def put(self, key: CacheEngineKey, obj: MemoryObj) -> None:
        """Takes ownership of `obj`: into the CPU tier now, written through to lower tiers later.

        Every write-through hold is on the object before any other thread can see it: an eviction
        in between would free memory that a writer has yet to read."""
        writes = len(self.tiers)
        if self.config.local_cpu:
            if not self.cpu.put(key, obj, holds=writes):
                return  # already stored; the duplicate was freed
        else:
            for _ in range(writes):
                obj.hold()
        for tier in self.tiers:
            future = self._writer.submit(self._write, tier, key, obj)
            with self._pending_lock:
                self._pending.add(future)
            future.add_done_callback(self._forget)
        if not self.config.local_cpu and not self.tiers:
            obj.free()

    def receive(self, key: CacheEngineKey, data: bytes | memoryview) -> bool:
        """A chunk another instance sent (prefill/decode disaggregation), as serde bytes: checked
        (its key, its shape against this engine's, its checksum) and put in the CPU tier, whatever
        `local_cpu` says (there it waits for the lookup that claims it). False: no room (every
        chunk held); raises serde.SerdeError for bytes that are not a whole, intact chunk of this
        key, and nothing is stored then."""
        if self.cpu.contains(key):
            return True  # keys name their content
        k = key.to_string()
        header = serde.read_header(data)
        if header.key != k:
            raise serde.SerdeError(f"chunk {header.key!r} sent under key {k!r}")
        if self.metadata is not None:
            serde.check_fits(header, self.metadata)
        obj = self.cpu.allocate(header.shape, header.dtype, header.fmt)
        if obj is None:
            return False
        try:
            serde.deserialize(data, out=obj.tensor, expected_key=k)
        except BaseException:
            obj.free()
            raise
        self.cpu.put(key, obj)
        return True

    def _write(self, tier, key: CacheEngineKey, obj: MemoryObj) -> None:
        try:
            if tier.put(key, obj) and self.events is not None:
                self.events.add(STORED, tier.name, key)
        except Exception:  # a backend bug must not kill the writer thread or leak the hold
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
        """Drops `key` from every tier (a held CPU object is freed at its last release)."""
        removed = self.cpu.remove(key)
        for tier in self.tiers:
            removed = tier.remove(key) or removed
        return removed

    def clear(self) -> int:
        """Drops every chunk of the CPU tier that is not held (lower tiers keep theirs)."""
        return self.cpu.clear()

    def usage(self) -> dict[str, TierStats]:
        """Every tier's stats by tier name, the CPU tier first."""
        return {CPU_TIER: self.cpu.stats(), **{tier.name: tier.stats() for tier in self.tiers}}

    def cost_of(self, tier_name: str) -> TransferEstimate:
        if tier_name == CPU_TIER:
            return self.cpu_cost
        return next(tier.cost for tier in self.tiers if tier.name == tier_name)

    def costs(self) -> dict[str, TransferCost]:
        """Every tier's transfer estimate by tier name, the CPU tier first."""
        return {CPU_TIER: self.cpu_cost.snapshot(), **{tier.name: tier.cost.snapshot() for tier in self.tiers}}

    def close(self) -> None:
        """Drains pending writes, then closes every tier. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._reader is not None:  # reads still running end within the remote's timeout
            self._reader.shutdown(wait=True, cancel_futures=True)
        if self._writer is not None:
            self.flush()
            self._writer.shutdown(wait=True)
        for tier in self.tiers:
            tier.close()
        self.cpu.close()
