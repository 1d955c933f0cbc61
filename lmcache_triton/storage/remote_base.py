"""The fail-soft half of every remote tier: chunk <-> bytes, checks, counting, back-off.

A remote that is down, slow, or returns garbage costs misses and failed puts, never an exception
or a hang in vLLM:
- every call is bounded by `timeout_s` (config `blocking_timeout_secs`), and waiting for a
  connection by min(timeout_s, 1 s), so a remote that is not there costs at most 1 s, not 10,
  and a host that refuses the port (the server process is gone) costs a TCP round trip (lm://: a
  server that dies while a request waits for its reply costs ~50 ms, not the timeout);
- after an I/O failure the backend stops trying for a short, growing back-off (0.1 s doubling to
  2 s), so a dead remote costs one timeout, then instant misses, until it answers again;
- what the remote returns is checked (serde checksums, key, and the engine's shape when metadata is
  given); a chunk that fails is a miss counted as `corrupt`, and is deleted so it can be re-stored.

Values on the wire are serde bytes (safetensors + checksums, optionally lz4). Subclasses (remote.py:
lm://, redis_backend.py: redis:// and valkey://) only move bytes.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any, TypeVar

from lmcache_triton.keys import CacheEngineKey
from lmcache_triton.metadata import LMCacheEngineMetadata
from lmcache_triton.storage import serde
from lmcache_triton.storage.base import AllocateFn, StorageBackend
from lmcache_triton.storage.memory import MemoryObj
from lmcache_triton.storage.tier_stats import RemoteStats

logger = logging.getLogger("lmcache_triton")

T = TypeVar("T")

_BACKOFF_MIN_S = 0.1
_BACKOFF_MAX_S = 2.0
CONNECT_TIMEOUT_S = 1.0  # cap on waiting for a connection (never more than the call's timeout)


class RemoteError(Exception):
    """The remote did not do what was asked (unreachable, timed out, rejected, malformed reply)."""


class RemoteUnavailable(RemoteError):
    """Not connected, timed out, or the connection broke: worth backing off."""


class RemoteChunkBackend(StorageBackend):
    """The chunk <-> bytes logic shared by every remote; subclasses move bytes and may raise.

    Subclass hooks take and return string keys and raw bytes; any exception they raise becomes a
    counted error and a miss/False here.
    """

    name = "RemoteBackend"
    locality = "REMOTE"

    def __init__(self, *, url: str, metadata: LMCacheEngineMetadata | None, compression: str,
                 timeout_s: float) -> None:
        if compression not in serde.COMPRESSIONS:
            raise ValueError(f"remote compression must be one of {serde.COMPRESSIONS}, got {compression!r}")
        if not timeout_s > 0:
            raise ValueError(f"remote timeout_s must be positive, got {timeout_s}")
        self.url = url
        self.metadata = metadata
        self.compression = compression
        self.timeout_s = timeout_s
        # What a client cannot see of the remote (its chunks, bytes, evictions) is None, not 0.
        self._stats = RemoteStats(chunks=None, used_bytes=None, capacity_bytes=None, held_chunks=None,
                                  evictions=None)
        self._lock = threading.Lock()  # stats and back-off state only; I/O locking is the subclass's
        self._down_until = 0.0
        self._backoff = _BACKOFF_MIN_S
        self._failing = False
        self._closed = False

    # ---- subclass hooks (raise on failure) -----------------------------------------------------
    def _put_bytes(self, key: str, data: bytes) -> None:
        raise NotImplementedError

    def _get_bytes(self, key: str) -> Any:
        """The stored bytes (any buffer), or None when the key is not stored."""
        raise NotImplementedError

    def _exists(self, keys: Sequence[str]) -> list[bool]:
        raise NotImplementedError

    def _delete(self, key: str) -> bool:
        raise NotImplementedError

    def _exists_before_put(self, key: str) -> list[bool]:
        return self._exists([key])

    def _close(self) -> None:
        raise NotImplementedError

    # ---- fail-soft plumbing --------------------------------------------------------------------
    def _count(self, field: str, n: int = 1) -> None:
        with self._lock:
            setattr(self._stats, field, getattr(self._stats, field) + n)

    def _moved(self, bytes_field: str, nbytes: int, seconds_field: str, seconds: float) -> None:
        with self._lock:
            setattr(self._stats, bytes_field, getattr(self._stats, bytes_field) + nbytes)
            setattr(self._stats, seconds_field, getattr(self._stats, seconds_field) + seconds)

    def _call(self, what: str, fn: Callable[[], T],
              passthrough: type[Exception] | tuple[type[Exception], ...] = ()) -> tuple[bool, T | None]:
        """(True, result) or (False, None) after counting and (once per outage) logging the error;
        exceptions of the `passthrough` types reach the caller (who counts them)."""
        if self._closed:
            return False, None
        with self._lock:
            if time.monotonic() < self._down_until:
                self._stats.skipped_unavailable += 1
                return False, None
        started = time.monotonic()
        try:
            result = fn()
        except passthrough:
            raise
        except Exception as e:  # fail-soft is the contract: nothing from the remote reaches vLLM
            with self._lock:
                self._stats.errors += 1
                if isinstance(e, RemoteUnavailable) or _is_connection_error(e):
                    # Skipped for at least as long as the failure cost: a remote that hangs until
                    # the timeout (a frozen server or PD decoder) takes at most half of the callers'
                    # time, where the 0.1 s back-off alone let every later request wait it out again.
                    now = time.monotonic()
                    self._down_until = now + max(self._backoff, now - started)
                    self._backoff = min(self._backoff * 2, _BACKOFF_MAX_S)
                first = not self._failing
                self._failing = True
            if first:
                logger.warning("remote %s: %s failed, serving misses until it answers: %s: %s",
                               self.url, what, type(e).__name__, e)
            return False, None
        with self._lock:
            recovered = self._failing
            self._failing = False
            self._backoff = _BACKOFF_MIN_S
        if recovered:
            logger.info("remote %s answers again", self.url)
        return True, result

    # ---- StorageBackend ------------------------------------------------------------------------
    def contains(self, key: CacheEngineKey) -> bool:
        return self.batched_contains([key])[0]

    def batched_contains(self, keys: Sequence[CacheEngineKey]) -> list[bool]:
        found = self.try_batched_contains(keys)
        return [False] * len(keys) if found is None else found

    def try_batched_contains(self, keys: Sequence[CacheEngineKey]) -> list[bool] | None:
        if not keys:
            return []
        started = time.perf_counter()
        ok, found = self._call("exists", lambda: self._exists([k.to_string() for k in keys]))
        if not ok or found is None or len(found) != len(keys):
            return None
        self.cost.observe_round_trip(time.perf_counter() - started)
        return found

    def put(self, key: CacheEngineKey, obj: MemoryObj) -> bool:
        """Runs on the StorageManager's writer threads, never in vLLM's step: so the duplicate
        check is here (one EXISTS round trip, cheap next to the PUT it may save), not in `store`."""
        self._count("puts")
        k = key.to_string()
        ok, present = self._call("exists", lambda: self._exists_before_put(k))
        if not ok:  # down or failing: the PUT would fail the same way
            self._count("put_failures")
            return False
        if present and present[0]:  # keys name their content: already stored
            return True
        serializing = time.perf_counter()
        try:
            data = serde.serialize(k, obj.tensor, obj.fmt, self.compression)
        except Exception as e:  # not a chunk serde can write (a caller bug), but put never raises
            self._count("put_failures")
            logger.warning("remote %s: cannot serialize chunk %s: %s: %s", self.url, k, type(e).__name__, e)
            return False
        started = time.perf_counter()
        ok, _ = self._call("put", lambda: self._put_bytes(k, data))
        if not ok:
            self._count("put_failures")
        else:  # the link's speed before any load: a chunk's bytes (in memory) over this call
            done = time.perf_counter()
            self.cost.observe_transfer(obj.nbytes, done - started)
            self._moved("written_bytes", len(data), "write_seconds", done - serializing)
        return ok

    def get(self, key: CacheEngineKey, allocate: AllocateFn) -> MemoryObj | None:
        k = key.to_string()
        obj = None
        started = time.perf_counter()
        try:
            # a value that cannot be ours (e.g. larger than any chunk) raises SerdeError: corrupt
            ok, data = self._call("get", lambda: self._get_bytes(k), passthrough=serde.SerdeError)
            if not ok or data is None:
                self._count("misses")
                return None
            header = serde.read_header(data)
            if header.key != k:
                raise serde.SerdeError(f"remote returned chunk {header.key!r} for key {k!r}")
            if self.metadata is not None:
                serde.check_fits(header, self.metadata)
            obj = allocate(header.shape, header.dtype, header.fmt)
            if obj is None:  # no room in the CPU tier: a miss, not an error
                self._count("misses")
                return None
            serde.deserialize(data, out=obj.tensor, expected_key=k)
        except serde.SerdeError as e:
            if obj is not None:
                obj.free()
            self._count("corrupt")
            self._count("misses")
            logger.warning("remote %s: chunk %s is unusable, treated as a miss: %s", self.url, k, e)
            if not isinstance(e, serde.UnsupportedVersionError):  # a newer writer's chunk is not ours to delete
                self._call("delete corrupt", lambda: self._delete(k))
                self._dropped(key)
            return None
        except Exception as e:  # e.g. an allocator or buffer problem on our side: still only a miss
            if obj is not None:
                obj.free()
            self._count("errors")
            self._count("misses")
            logger.warning("remote %s: reading chunk %s failed, treated as a miss: %s: %s",
                           self.url, k, type(e).__name__, e)
            return None
        self._count("hits")
        # a load from this tier: the call and the checks that make its bytes a chunk
        seconds = time.perf_counter() - started
        self.cost.observe_transfer(obj.nbytes, seconds)
        self._moved("read_bytes", memoryview(data).nbytes, "read_seconds", seconds)
        return obj

    def remove(self, key: CacheEngineKey) -> bool:
        ok, removed = self._call("delete", lambda: self._delete(key.to_string()))
        if ok and removed:
            self._dropped(key)
        return bool(ok and removed)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self._close()
        except Exception as e:
            logger.debug("remote %s: error while closing: %s", self.url, e)

    def stats(self) -> RemoteStats:
        with self._lock:
            return replace(self._stats)


def _is_connection_error(e: Exception) -> bool:
    # redis-py's ConnectionError/TimeoutError, and the builtins, are what deserve a back-off
    return isinstance(e, (ConnectionError, TimeoutError, OSError)) or type(e).__name__ in (
        "ConnectionError", "TimeoutError", "BusyLoadingError")
