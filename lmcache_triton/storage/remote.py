"""The remote tier: `lm://host:port` (our cache server) and `redis://`, `rediss://`, `valkey://`.

Values on the wire are serde bytes (safetensors + checksums, optionally lz4). What every remote
shares (fail-soft calls, back-off, checks, counting) is RemoteChunkBackend in remote_base.py; this
module is the lm:// client and the factory for every scheme.
"""

from __future__ import annotations

import itertools
import json
import socket
import threading
import time
from collections.abc import Sequence
from urllib.parse import urlsplit

import zmq

from lmcache_triton.metadata import LMCacheEngineMetadata
from lmcache_triton.remote_url import CLUSTER_PROTOCOLS, REMOTE_SCHEMES, redact_url, remote_url_forms
from lmcache_triton.server import wire
from lmcache_triton.server.wire import Command, Limits, Status
from lmcache_triton.storage import serde
from lmcache_triton.storage.base import StorageBackend
from lmcache_triton.storage.remote_base import (  # RemoteError, RemoteUnavailable: raised to this module's callers
    CONNECT_TIMEOUT_S,
    RemoteChunkBackend,
    RemoteError,
    RemoteUnavailable,
)

# ---- lm:// --------------------------------------------------------------------------------------
_LIVENESS_SLICE_MS = 50  # how often a request waiting for its reply checks the connection is still up


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
        behind those expired before a prompt kept in the CPU tier was counted."""
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
            raise RemoteUnavailable(f"{self.endpoint}: another request had the client past the timeout")
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
            # A server that dies while a request is in flight would otherwise cost the whole
            # timeout: ZMQ drops the request with the connection and tells the socket nothing.
            # With IMMEDIATE, a socket whose only connection is gone has no pipe to send on, so
            # the wait is cut into slices that check it can still send: a request sent just as the
            # server was killed waited 5.0 s (blocking_timeout_secs) on every try, now ~50 ms. (A
            # socket monitor tells it in 2 ms, but costs two more sockets per client: a test run
            # creating many clients reached the ZMQ context's 1023-socket limit.)
            if not sock.poll(min(remaining_ms(), _LIVENESS_SLICE_MS), zmq.POLLIN):
                if remaining_ms() <= 0:
                    self._reset()
                    raise RemoteUnavailable(f"{self.endpoint}: no reply to {command.name} within the timeout")
                if not sock.poll(0, zmq.POLLOUT):
                    self._reset()
                    raise RemoteUnavailable(f"{self.endpoint}: connection lost before the reply to {command.name}")
                continue
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
        # ... and a lookup's presence question on its own: a load cut short at its deadline leaves
        # its GET on the wire (its chunk lands for the next request), and the next lookup must not
        # wait for it (one more connection: a slow remote's reads cost the next lookup nothing).
        self.asker = CacheServerClient(host, port, timeout_s=timeout_s, auth_token=auth_token, limits=limits)
        self.client.connect()  # in the background: by the first lookup the connection is usually up
        self.asker.connect()

    def _put_bytes(self, key: str, data: bytes) -> None:
        self.writer.put(key.encode(), data)

    def _exists_before_put(self, key: str) -> list[bool]:
        return self.writer.exists([key.encode()])

    def _get_bytes(self, key: str) -> memoryview | None:
        return self.client.get(key.encode())

    def _exists(self, keys: Sequence[str]) -> list[bool]:
        return self.asker.exists([k.encode() for k in keys])

    def _delete(self, key: str) -> bool:
        return self.client.delete(key.encode())

    def _close(self) -> None:
        self.client.close()
        self.writer.close()
        self.asker.close()


def parse_lm_url(url: str) -> tuple[str, int]:
    parts = urlsplit(url)
    if parts.scheme != "lm" or not parts.hostname or parts.port is None:
        raise ValueError(f"cache server url must look like lm://host:port, got {redact_url(url)!r}")
    return parts.hostname, parts.port


def create_remote_backend(url: str, metadata: LMCacheEngineMetadata | None, *, compression: str = "naive",
                          timeout_s: float = 10.0, auth_token: str | None = None) -> StorageBackend:
    """The backend for `url` (config `remote_url`): lm://, redis://, rediss://, valkey://, or a cluster's
    redis-cluster:// (rediss-, valkey-, valkeys-cluster://)."""
    scheme = url.partition("://")[0].lower() if "://" in url else ""
    if scheme == "lm":
        host, port = parse_lm_url(url)
        return CacheServerBackend(host, port, metadata, compression=compression, timeout_s=timeout_s,
                                  auth_token=auth_token)
    if REMOTE_SCHEMES.get(scheme) in ("redis", "rediss"):
        from lmcache_triton.storage.redis_backend import RedisBackend  # imports the redis package lazily

        return RedisBackend(url, metadata, compression=compression, timeout_s=timeout_s, auth_token=auth_token)
    if REMOTE_SCHEMES.get(scheme) in CLUSTER_PROTOCOLS:
        from lmcache_triton.storage.redis_cluster import RedisClusterBackend

        return RedisClusterBackend(url, metadata, compression=compression, timeout_s=timeout_s,
                                   auth_token=auth_token)
    raise ValueError(f"unsupported remote url scheme {scheme!r} in {redact_url(url)!r}; use {remote_url_forms()}")
