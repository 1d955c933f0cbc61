"""The remote tier: `lm://host:port` (our cache server) and `redis://`, `rediss://`, `valkey://`.

A remote that is down, slow, or returns garbage costs misses and failed puts, never an exception
or a hang in vLLM:
- every call is bounded by `timeout_s` (config `blocking_timeout_secs`), and waiting for a
  connection by min(timeout_s, 1 s), so a remote that is not there costs at most 1 s, not 10,
  and a host that refuses the port (the server process is gone) costs a TCP round trip;
- after an I/O failure the backend stops trying for a short, growing back-off (0.1 s doubling to
  2 s), so a dead remote costs one timeout, then instant misses, until it answers again;
- what the remote returns is checked (serde checksums, key, and the engine's shape when metadata is
  given); a chunk that fails is a miss counted as `corrupt`, and is deleted so it can be re-stored.

Values on the wire are serde bytes (safetensors + checksums, optionally lz4).
"""

from __future__ import annotations

import itertools
import json
import logging
import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any, TypeVar
from urllib.parse import urlsplit

import zmq

from lmcache_triton.storage.memory import MemoryObj
from lmcache_triton.metadata import LMCacheEngineMetadata
from lmcache_triton.storage import serde
from lmcache_triton.server import wire
from lmcache_triton.storage.base import AllocateFn, StorageBackend
from lmcache_triton.server.wire import Command, Limits, Status
from lmcache_triton.engine.token_database import CacheEngineKey

logger = logging.getLogger("lmcache_triton")

T = TypeVar("T")

_BACKOFF_MIN_S = 0.1
_BACKOFF_MAX_S = 2.0
CONNECT_TIMEOUT_S = 1.0  # cap on waiting for a connection (never more than the call's timeout)


class RemoteError(Exception):
    """The remote did not do what was asked (unreachable, timed out, rejected, malformed reply)."""


class RemoteUnavailable(RemoteError):
    """Not connected, timed out, or the connection broke: worth backing off."""


@dataclass
class RemoteCounters:
    puts: int = 0
    put_failures: int = 0
    gets: int = 0
    hits: int = 0
    misses: int = 0
    corrupt: int = 0
    errors: int = 0
    skipped_unavailable: int = 0  # calls answered locally during a back-off
    skipped_duplicates: int = 0   # puts of chunks the remote already held
    evictions: int = 0            # the remote evicts on its own; not observed from here
    used_bytes: int = 0           # unknown from the client side (see the server's STATS)
    capacity_bytes: int = 0


class RemoteChunkBackend(StorageBackend):
    """The chunk <-> bytes logic shared by every remote; subclasses move bytes and may raise.

    Subclass hooks take and return string keys and raw bytes; any exception they raise becomes a
    counted error and a miss/False here.
    """

    name = "RemoteBackend"

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
        self._counters = RemoteCounters()
        self._lock = threading.Lock()  # counters and back-off state only; I/O locking is the subclass's
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
            setattr(self._counters, field, getattr(self._counters, field) + n)

    def _call(self, what: str, fn: Callable[[], T],
              passthrough: type[Exception] | tuple[type[Exception], ...] = ()) -> tuple[bool, T | None]:
        """(True, result) or (False, None) after counting and (once per outage) logging the error;
        exceptions of the `passthrough` types reach the caller (who counts them)."""
        if self._closed:
            return False, None
        with self._lock:
            if time.monotonic() < self._down_until:
                self._counters.skipped_unavailable += 1
                return False, None
        try:
            result = fn()
        except passthrough:
            raise
        except Exception as e:  # fail-soft is the contract: nothing from the remote reaches vLLM
            with self._lock:
                self._counters.errors += 1
                if isinstance(e, RemoteUnavailable) or _is_connection_error(e):
                    self._down_until = time.monotonic() + self._backoff
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
        ok, found = self._call("exists", lambda: self._exists([k.to_string() for k in keys]))
        if not ok or found is None or len(found) != len(keys):
            return None
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
        if present and present[0]:
            self._count("skipped_duplicates")
            return True
        try:
            data = serde.serialize(k, obj.tensor, obj.fmt, self.compression)
        except Exception as e:  # not a chunk serde can write (a caller bug), but put never raises
            self._count("put_failures")
            logger.warning("remote %s: cannot serialize chunk %s: %s: %s", self.url, k, type(e).__name__, e)
            return False
        ok, _ = self._call("put", lambda: self._put_bytes(k, data))
        if not ok:
            self._count("put_failures")
        return ok

    def get(self, key: CacheEngineKey, allocate: AllocateFn) -> MemoryObj | None:
        self._count("gets")
        k = key.to_string()
        obj = None
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
        return obj

    def remove(self, key: CacheEngineKey) -> bool:
        ok, removed = self._call("delete", lambda: self._delete(key.to_string()))
        return bool(ok and removed)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self._close()
        except Exception as e:
            logger.debug("remote %s: error while closing: %s", self.url, e)

    def stats(self) -> dict[str, int | float]:
        with self._lock:
            return asdict(self._counters)


def _is_connection_error(e: Exception) -> bool:
    # redis-py's ConnectionError/TimeoutError, and the builtins, are what deserve a back-off
    return isinstance(e, (ConnectionError, TimeoutError, OSError)) or type(e).__name__ in (
        "ConnectionError", "TimeoutError", "BusyLoadingError")


# ---- lm:// --------------------------------------------------------------------------------------
class CacheServerClient:
    """A blocking client of the cache server; every method raises RemoteError on failure.

    A DEALER socket tags each request with an id and ignores replies with other ids, so a reply
    that arrives after its request timed out cannot be taken for the next one's. After a timeout
    the socket is closed anyway (dropping whatever it still queues) and recreated on next use.
    IMMEDIATE keeps messages from queueing for a peer that is not connected. One request at a
    time per client (a lock); the lock wait counts against the caller's timeout.
    """

    def __init__(self, host: str, port: int, *, timeout_s: float = 10.0, auth_token: str | None = None,
                 connect_timeout_s: float | None = None, limits: Limits = Limits(),
                 context: zmq.Context | None = None) -> None:
        self.endpoint = f"tcp://{f'[{host}]' if ':' in host else host}:{port}"
        self._address = (host, port)
        self.timeout_s = timeout_s
        # How long a request waits for a connection: a TCP + ZMTP handshake takes milliseconds, so
        # with the 10 s default timeout a server that is simply not there still costs at most 1 s.
        self.connect_timeout_s = (min(timeout_s, CONNECT_TIMEOUT_S) if connect_timeout_s is None
                                  else connect_timeout_s)
        self.limits = limits
        self._auth = wire.auth_digest(auth_token)
        self._ctx = context or zmq.Context.instance()
        self._sock: zmq.Socket | None = None
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._closed = False

    def connect(self) -> None:
        """Starts connecting now (ZMQ connects in the background; this never blocks)."""
        with self._lock:
            if not self._closed:
                self._socket()

    def _socket(self) -> zmq.Socket:
        if self._sock is None:
            s = self._ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.setsockopt(zmq.IMMEDIATE, 1)
            s.setsockopt(zmq.MAXMSGSIZE, self.limits.max_frame_bytes)  # a hostile server cannot flood us
            s.setsockopt(zmq.RECONNECT_IVL, 100)
            s.setsockopt(zmq.RECONNECT_IVL_MAX, 1000)
            s.connect(self.endpoint)
            self._sock = s
        return self._sock

    def _probe(self, timeout_s: float) -> None:
        """Not connected: one plain TCP connect tells a refused port (the server process is gone)
        at once, where ZMQ would retry quietly until the connect timeout. Seen in the fault suite:
        with the server killed, every lookup that reached it waited 1 s, and lookups queued
        behind those expired before a prompt held in the CPU tier was counted."""
        try:
            socket.create_connection(self._address, timeout=max(timeout_s, 0.001)).close()
        except ConnectionRefusedError:
            self._reset()
            raise RemoteUnavailable(f"{self.endpoint}: connection refused") from None
        except OSError:
            pass  # unresolvable, unroutable or slow: ZMQ's own wait below decides

    def _reset(self) -> None:
        if self._sock is not None:
            self._sock.close(0)
            self._sock = None

    def request(self, command: Command, frames: Sequence = (), timeout_s: float | None = None) -> wire.Reply:
        deadline = time.monotonic() + (self.timeout_s if timeout_s is None else timeout_s)
        if not self._lock.acquire(timeout=max(0.0, deadline - time.monotonic())):
            raise RemoteUnavailable(f"{self.endpoint}: another request held the client past the timeout")
        try:
            if self._closed:
                raise RemoteError("client is closed")
            return self._request_locked(command, frames, deadline)
        finally:
            self._lock.release()

    def _request_locked(self, command: Command, frames: Sequence, deadline: float) -> wire.Reply:
        sock = self._socket()
        rid = next(self._ids)
        msg = wire.encode_request(command, rid, frames, self._auth)

        def remaining_ms() -> int:
            return max(0, int((deadline - time.monotonic()) * 1000))

        connect_ms = min(remaining_ms(), int(self.connect_timeout_s * 1000))
        connect_by = time.monotonic() + connect_ms / 1000
        if not sock.poll(0, zmq.POLLOUT):
            self._probe(connect_ms / 1000)
        if not sock.poll(max(0, int((connect_by - time.monotonic()) * 1000)), zmq.POLLOUT):
            self._reset()
            raise RemoteUnavailable(f"{self.endpoint}: not connected within {connect_ms} ms")
        try:
            sock.send_multipart(msg, zmq.NOBLOCK, copy=False)
        except zmq.ZMQError as e:
            self._reset()
            raise RemoteUnavailable(f"{self.endpoint}: send failed: {e}") from None
        while True:
            if not sock.poll(remaining_ms(), zmq.POLLIN):
                self._reset()
                raise RemoteUnavailable(f"{self.endpoint}: no reply to {command.name} within the timeout")
            parts = sock.recv_multipart(copy=False)
            try:
                reply = wire.decode_reply([p.buffer for p in parts])
            except wire.WireError as e:
                self._reset()
                raise RemoteError(f"{self.endpoint}: malformed reply: {e}") from None
            if reply.request_id == rid:
                break  # anything else is a late reply to a request that already timed out
        if reply.status not in (Status.OK, Status.NOT_FOUND):
            detail = bytes(reply.frames[0]).decode("utf-8", "replace") if reply.frames else ""
            raise RemoteError(f"{self.endpoint}: {command.name} rejected: {reply.status.name}: {detail}")
        return reply

    # ---- operations ----------------------------------------------------------------------------
    def put(self, key: bytes, value) -> None:
        self.request(Command.PUT, [key, value])

    def get(self, key: bytes) -> memoryview | None:
        reply = self.request(Command.GET, [key])
        if reply.status == Status.NOT_FOUND:
            return None
        if len(reply.frames) != 1:
            raise RemoteError(f"{self.endpoint}: GET reply has {len(reply.frames)} frames, expected 1")
        return memoryview(reply.frames[0])

    def exists(self, keys: Sequence[bytes]) -> list[bool]:
        out: list[bool] = []
        step = self.limits.max_keys_per_request
        for i in range(0, len(keys), step):
            batch = keys[i:i + step]
            reply = self.request(Command.EXISTS, batch)
            if len(reply.frames) != 1:
                raise RemoteError(f"{self.endpoint}: EXISTS reply has {len(reply.frames)} frames, expected 1")
            try:
                out += wire.unpack_bits(reply.frames[0], len(batch))
            except wire.WireError as e:
                raise RemoteError(f"{self.endpoint}: malformed EXISTS reply: {e}") from None
        return out

    def delete(self, key: bytes) -> bool:
        return self.request(Command.DELETE, [key]).status == Status.OK

    def list(self, limit: int = 1000) -> tuple[list[bytes], bool]:
        reply = self.request(Command.LIST, [wire.pack_u32(limit)])
        return [bytes(f) for f in reply.frames], bool(reply.flags & wire.FLAG_TRUNCATED)

    def stats(self) -> dict:
        reply = self.request(Command.STATS)
        try:
            return json.loads(bytes(reply.frames[0]))
        except (IndexError, ValueError) as e:
            raise RemoteError(f"{self.endpoint}: malformed STATS reply: {e}") from None

    def health(self, timeout_s: float | None = None) -> bool:
        try:
            return self.request(Command.HEALTH, timeout_s=timeout_s).status == Status.OK
        except RemoteError:
            return False

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._reset()


class CacheServerBackend(RemoteChunkBackend):
    """`lm://host:port`: chunks on a `lmcache-triton server`."""

    name = "CacheServerBackend"

    def __init__(self, host: str, port: int, metadata: LMCacheEngineMetadata | None = None, *,
                 compression: str = "naive", timeout_s: float = 10.0, auth_token: str | None = None) -> None:
        super().__init__(url=f"lm://{host}:{port}", metadata=metadata, compression=compression, timeout_s=timeout_s)
        # A GET of more than a chunk can be is cut off by ZMQ (MAXMSGSIZE) before it is allocated.
        limits = Limits(max_value_bytes=serde.max_serialized_nbytes(metadata)) if metadata is not None else Limits()
        # Reads (lookups, loads) and writes (the write-through threads) on separate connections:
        # a client handles one request at a time, and a lookup must not queue behind a PUT of
        # megabytes to a slow server.
        self.client = CacheServerClient(host, port, timeout_s=timeout_s, auth_token=auth_token, limits=limits)
        self.writer = CacheServerClient(host, port, timeout_s=timeout_s, auth_token=auth_token, limits=limits)
        self.client.connect()  # in the background: by the first lookup the connection is usually up

    def _put_bytes(self, key: str, data: bytes) -> None:
        self.writer.put(key.encode(), data)

    def _exists_before_put(self, key: str) -> list[bool]:
        return self.writer.exists([key.encode()])

    def _get_bytes(self, key: str) -> memoryview | None:
        return self.client.get(key.encode())

    def _exists(self, keys: Sequence[str]) -> list[bool]:
        return self.client.exists([k.encode() for k in keys])

    def _delete(self, key: str) -> bool:
        return self.client.delete(key.encode())

    def _close(self) -> None:
        self.client.close()
        self.writer.close()

    def server_stats(self) -> dict | None:
        """The server's STATS (capacity, used bytes, evictions...), or None when unreachable."""
        ok, result = self._call("stats", self.client.stats)
        return result if ok else None


def parse_lm_url(url: str) -> tuple[str, int]:
    parts = urlsplit(url)
    if parts.scheme != "lm" or not parts.hostname or parts.port is None:
        raise ValueError(f"cache server url must look like lm://host:port, got {url!r}")
    return parts.hostname, parts.port


def create_remote_backend(url: str, metadata: LMCacheEngineMetadata | None, *, compression: str = "naive",
                          timeout_s: float = 10.0, auth_token: str | None = None) -> StorageBackend:
    """The backend for `url` (config `remote_url`): lm://, redis://, rediss:// or valkey://."""
    scheme = urlsplit(url).scheme
    if scheme == "lm":
        host, port = parse_lm_url(url)
        return CacheServerBackend(host, port, metadata, compression=compression, timeout_s=timeout_s,
                                  auth_token=auth_token)
    if scheme in ("redis", "rediss", "valkey", "valkeys"):
        from lmcache_triton.storage.redis_backend import RedisBackend  # imports the redis package lazily

        return RedisBackend(url, metadata, compression=compression, timeout_s=timeout_s, auth_token=auth_token)
    raise ValueError(f"unsupported remote url scheme {scheme!r} in {url!r}; "
                     "use lm://host:port, redis://host:port[/db], rediss://... or valkey://...")
