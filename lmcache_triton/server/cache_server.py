"""The standalone cache server behind `lm://host:port`: an LRU map of opaque values over ZMQ.

    python -m lmcache_triton.server.cache_server --host 127.0.0.1 --port 65432 \
        [--max-size-gb N] [--max-value-mb M] [--max-pending-reply-mb P] [--disk DIR] [--auth-token T] \
        [--admin-port A]

One ROUTER socket and one thread. The loop never waits on a client: requests arrive whole (ZMQ's
I/O thread assembles them; ZMQ_MAXMSGSIZE disconnects a peer that sends an oversized frame, RCVHWM
bounds what queues), every reply is sent with NOBLOCK on a ROUTER_MANDATORY socket with a bounded
SNDHWM, and a client whose queue is full (it stopped reading) loses that reply, which is counted
(`dropped_replies`) and which its own timeout turns into a miss. So a slow or hostile client costs
the others nothing but its share of the loop. The wire format is in `wire.py` and docs/wire-format.md.

A GET reply is a zero-copy view of the stored value, and a queued one keeps the value alive after
its eviction: the values that queued replies hold are bounded by --max-pending-reply-mb, beyond
which GETs are answered BUSY (`refused_replies`), so memory stays near capacity + that budget.

Eviction is least-recently-used (GET and PUT refresh an entry) and the sum of key and value bytes
never exceeds the capacity. With --disk, every PUT of a chunk (the serde bytes lmcache_triton
clients store under the chunk's key) is written through as a chunk file: the disk tier's format
and code (storage/chunk_files.py), so a server's folder and an engine's `local_disk` folder hold
the same files. Other values live in memory only (`not_persisted`). At start the most recently used
files that fit are reloaded, and the older ones deleted unread.

With --admin-port, an HTTP admin API (admin_http.py) listens on the same host; its threads hand
their work to this loop (loop_calls.py), which runs it between two messages: one thread, no lock.
"""

from __future__ import annotations

import argparse
import hmac
import ipaddress
import itertools
import json
import logging
import os
import signal
import sys
import time
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, fields
from typing import BinaryIO

import zmq

from lmcache_triton import __version__
from lmcache_triton.server import wire
from lmcache_triton.server.admin_http import AdminAPI, AdminHTTPServer
from lmcache_triton.server.loop_calls import LoopCalls
from lmcache_triton.server.wire import Command, Limits, Status
from lmcache_triton.storage.chunk_files import ChunkFiles
from lmcache_triton.storage.chunk_header import RawHeader, SerdeError, read_raw_header
from lmcache_triton.storage.lru import LRU

logger = logging.getLogger("lmcache_triton")

AUTH_TOKEN_ENV = "LMCACHE_REMOTE_AUTH_TOKEN"
DEFAULT_PORT = 65432
LIST_DEFAULT = 1000
_SNDHWM = 1000  # replies queued per client before further replies to it are dropped (zmq default)
_RCVHWM = 1024
_DEFAULT_PENDING_REPLY_BYTES = 256 << 20
CLIENT_WINDOW_S = 60.0  # STATS `clients`: connections that sent a request within this many seconds


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = DEFAULT_PORT
    max_size_bytes: int = 4 << 30
    limits: Limits = Limits()
    disk_dir: str | None = None
    auth_token: str | None = field(default=None, repr=False)
    # stored values that queued GET replies may keep alive; None: min(256 MiB, max_size_bytes)
    max_pending_reply_bytes: int | None = None
    admin_port: int | None = None  # the HTTP admin API's port (0: any free one); None: no admin API

    def __post_init__(self) -> None:
        if self.max_size_bytes <= 0:
            raise ValueError(f"cache server max size must be positive, got {self.max_size_bytes} bytes")
        if self.max_pending_reply_bytes is not None and self.max_pending_reply_bytes <= 0:
            raise ValueError(f"cache server pending-reply budget must be positive, got "
                             f"{self.max_pending_reply_bytes} bytes")
        for what, port in (("port", self.port), ("admin port", self.admin_port)):
            if port is not None and not 0 <= port <= 65535:
                raise ValueError(f"cache server {what} must be in [0, 65535], got {port}")

    @property
    def pending_reply_budget(self) -> int:
        if self.max_pending_reply_bytes is not None:
            return self.max_pending_reply_bytes
        return min(_DEFAULT_PENDING_REPLY_BYTES, self.max_size_bytes)


@dataclass
class ServerStats:
    puts: int = 0
    gets: int = 0
    hits: int = 0
    misses: int = 0
    exists_queries: int = 0
    exists_keys: int = 0
    deletes: int = 0
    evictions: int = 0
    rejected_too_large: int = 0
    auth_failures: int = 0
    bad_requests: int = 0
    unknown_commands: int = 0
    internal_errors: int = 0
    dropped_replies: int = 0
    refused_replies: int = 0  # GETs answered BUSY: the pending-reply budget was full
    not_persisted: int = 0    # --disk: PUTs of values that are not chunks, kept in memory only
    clears: int = 0           # admin API POST /clear calls that emptied the store


# ---- the store ----------------------------------------------------------------------------------
def _claim_any(header: RawHeader) -> str:
    return header.key  # the server serves every model's chunks


def _name(key: bytes) -> str | None:
    """The chunk key `key` spells, the name of its file; None for bytes no chunk key can be."""
    try:
        return key.decode("utf-8")
    except UnicodeDecodeError:
        return None


def _chunk_name(key: bytes, value: memoryview) -> str | None:
    """`key` as the name of a chunk file, when `value` is a whole chunk stored under it (what every
    lmcache_triton client PUTs); None for any other value, which then lives in memory only."""
    if (name := _name(key)) is None:
        return None
    try:
        header = read_raw_header(value)
    except SerdeError:
        return None
    return name if header.key == name and header.file_nbytes == value.nbytes else None


def _read_value(f: BinaryIO, header: RawHeader) -> memoryview:
    """A whole chunk file (its header checked), read with one copy."""
    buf = bytearray(header.file_nbytes)
    f.seek(0)
    if f.readinto(buf) != len(buf):
        raise SerdeError("chunk file shrank while it was read")
    return memoryview(buf)


class Store:
    """key -> value, least recently used first; `used_bytes` (keys + values) <= `capacity` always.

    With `disk`, a value that is a chunk is written through as a chunk file (the disk tier's format
    and code: chunk_files.py), evictions and DELETEs remove it, GETs touch it; `load` reads back,
    least recently used first, what fits in the capacity.
    """

    def __init__(self, capacity: int, stats: ServerStats, disk: ChunkFiles[str] | None = None) -> None:
        self.capacity = capacity
        self._lru: LRU[bytes, memoryview] = LRU()
        self._stats = stats
        self.disk = disk

    def __len__(self) -> int:
        return len(self._lru)

    def __contains__(self, key: bytes) -> bool:
        return key in self._lru

    @property
    def used_bytes(self) -> int:
        return self._lru.used_bytes

    def put(self, key: bytes, value: memoryview) -> bool:
        size = len(key) + value.nbytes
        if size > self.capacity:
            return False
        self.delete(key)  # a PUT replaces: the old value's file must not outlive it
        self._insert(key, value, size)
        if self.disk is not None:
            if (name := _chunk_name(key, value)) is None:
                self._stats.not_persisted += 1
            else:  # memory keeps it even if the write fails: the disk copy is for restarts
                self.disk.store(name, lambda: (value,))
        return True

    def _insert(self, key: bytes, value: memoryview, size: int) -> None:
        victims = self._lru.evict(self.capacity, size) or []  # nothing is held: never None
        for old, _ in victims:
            self._forget_file(old)
        self._stats.evictions += len(victims)
        self._lru.put(key, value, size)

    def get(self, key: bytes) -> memoryview | None:
        value = self._lru.touch(key)
        if value is not None and self.disk is not None and (name := _name(key)) is not None:
            self.disk.touch(name)  # mtime is the order a restart reloads in
        return value

    def delete(self, key: bytes) -> bool:
        found = self._lru.pop(key) is not None
        self._forget_file(key)  # also a file left unread at start (an I/O error): never a stale value
        return found

    def clear(self) -> int:
        """Deletes every entry through `delete` (its file too), and files the start left unread."""
        removed = sum(self.delete(key) for key in list(self._lru))
        if self.disk is not None:
            for name in self.disk.keys():
                self.disk.remove(name)
        return removed

    def keys(self, limit: int) -> tuple[list[bytes], bool]:
        """Up to `limit` keys, most recently used first, and whether there were more."""
        out = list(itertools.islice(self._lru.newest(), limit + 1))
        return out[:limit], len(out) > limit

    def _forget_file(self, key: bytes) -> None:
        if self.disk is not None and (name := _name(key)) is not None:
            self.disk.remove(name)  # a no-op for a value that is not a chunk: it has no file

    def load(self) -> int:
        """Reads back the chunk files the disk's start scan indexed, least recently used first,
        and returns how many. Only the most recent that fit, keys counted, are read: the older
        files are deleted unread (what LRU eviction would have done), so a folder larger than the
        capacity (restarted with a smaller --max-size-gb) costs no more memory than the capacity."""
        if self.disk is None:
            return 0
        fits: LRU[str, None] = LRU()
        for name, nbytes in self.disk.files():
            fits.put(name, None, len(name.encode("utf-8")) + nbytes)
        for name, _ in fits.evict(self.capacity) or []:
            self.disk.remove(name)
        n = 0
        for name in fits:
            value = self.disk.read(name, _read_value)
            if value is not None:
                key = name.encode("utf-8")
                self._insert(key, value, len(key) + value.nbytes)
                n += 1
        return n


# ---- queued replies -----------------------------------------------------------------------------
class ReplyBudget:
    """Bytes of stored values that GET replies still queued in ZMQ keep alive, at most `limit`.

    A reply is a zero-copy view of the stored value: while ZMQ queues it for a client that does
    not read (up to SNDHWM replies per client), the value outlives its eviction: a 20 MB server
    peaked at 776 MiB RSS without this bound, 63 MiB with it (the budget test in tests/server/test_cache_server.py).
    Each distinct value counts once however many replies share it, from its GET until ZMQ has
    released every such reply (their MessageTrackers are done).
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.pending_bytes = 0
        # id(value) -> (value, trackers of the replies carrying it); holding the value keeps the id unique
        self._values: dict[int, tuple[memoryview, deque[zmq.MessageTracker]]] = {}

    def admit(self, value: memoryview) -> bool:
        """Whether a reply carrying `value` fits. With nothing pending one always fits, so a value
        larger than the budget can still be read (memory then stays below capacity + that value)."""
        if id(value) in self._values:
            return True  # already counted: one more view of the same memory costs nothing
        if self.pending_bytes and self.pending_bytes + value.nbytes > self.limit:
            self.sweep()  # only when it matters: between sweeps the count can only be too high
        return not self.pending_bytes or self.pending_bytes + value.nbytes <= self.limit

    def frame(self, value: memoryview) -> zmq.Frame:
        """The zero-copy, tracked frame that sends `value`, counted until ZMQ releases it. A frame
        that is never sent (the client's queue was full) is released when it is garbage."""
        frame = zmq.Frame(value, copy=False, track=True)  # copy=False: tracked even under COPY_THRESHOLD
        entry = self._values.get(id(value))
        if entry is None:
            entry = self._values[id(value)] = (value, deque())
            self.pending_bytes += value.nbytes
        entry[1].append(frame.tracker)
        return frame

    def sweep(self) -> None:
        for vid, (value, trackers) in list(self._values.items()):
            while trackers and trackers[0].done:
                trackers.popleft()
            if not trackers:
                del self._values[vid]
                self.pending_bytes -= value.nbytes


class RecentPeers:
    """The ZMQ identities (one per client connection) that sent a request within `window_s`."""

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self._seen: OrderedDict[bytes, float] = OrderedDict()  # oldest first

    def saw(self, identity: bytes, now: float) -> None:
        self._seen[identity] = now
        self._seen.move_to_end(identity)
        self.count(now)  # forgets the stale ones as it goes: memory follows the window, not the uptime

    def count(self, now: float) -> int:
        while self._seen and next(iter(self._seen.values())) < now - self.window_s:
            self._seen.popitem(last=False)
        return len(self._seen)


# ---- the server ---------------------------------------------------------------------------------
class CacheServer:
    kind = "cache server"  # what its log lines call it
    counters = tuple(f.name for f in fields(ServerStats))  # the STATS fields that only grow

    def __init__(self, config: ServerConfig, context: zmq.Context | None = None) -> None:
        self.config = config
        self.limits = config.limits
        self.stats = ServerStats()
        self._auth = wire.auth_digest(config.auth_token) if config.auth_token else None
        disk = None
        if config.disk_dir:
            # Never evicts by itself: its files are a subset of the memory's entries, which bound it
            disk = ChunkFiles(config.disk_dir, config.max_size_bytes, key_name=str, claim=_claim_any,
                              name="cache server --disk")
        self.store = Store(config.max_size_bytes, self.stats, disk)
        self.replies = ReplyBudget(config.pending_reply_budget)
        self.peers = RecentPeers(CLIENT_WINDOW_S)
        self.calls = LoopCalls()  # what the admin API's threads ask this loop to run
        self.admin: AdminHTTPServer | None = None
        self._ctx = context or zmq.Context.instance()
        self._sock: zmq.Socket | None = None
        self._stop = False
        self._started = time.monotonic()
        self.endpoint = ""

    # -- lifecycle --
    def bind(self) -> str:
        sock = self._ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, self.limits.max_frame_bytes)
        sock.setsockopt(zmq.SNDHWM, _SNDHWM)
        sock.setsockopt(zmq.RCVHWM, _RCVHWM)
        # Unroutable or full peers raise instead of silently blocking/dropping: we count and move on.
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        host = self.config.host
        if self.config.port == 0:
            port = sock.bind_to_random_port(f"tcp://{_zmq_host(host)}")
        else:
            sock.bind(f"tcp://{_zmq_host(host)}:{self.config.port}")
            port = self.config.port
        if self.config.admin_port is not None:
            api = AdminAPI(self, self.calls, token=self.config.auth_token, loopback=_is_loopback(host))
            try:
                self.admin = AdminHTTPServer(host, self.config.admin_port, api)
            except OSError:
                sock.close(0)
                raise
            self.admin.start()
        self._sock = sock
        self.endpoint = f"{host}:{port}"
        reloaded = self.store.load()
        logger.info(
            "lmcache-triton %s on tcp://%s (capacity %.3g GB, max value %.3g MB, disk %s, auth %s, %d entries "
            "reloaded, admin API %s)", self.kind, self.endpoint, self.config.max_size_bytes / 1e9,
            self.limits.max_value_bytes / 1e6, self.config.disk_dir or "off", "on" if self._auth else "off", reloaded,
            f"http://{_zmq_host(host)}:{self.admin.port}" if self.admin else "off")
        if not _is_loopback(host) and self._auth is None:
            logger.warning("%s listens on non-loopback %s without an auth token", self.kind, host)
        return self.endpoint

    def stop(self) -> None:
        self._stop = True

    def serve_forever(self) -> None:
        if self._sock is None:
            self.bind()
        sock = self._sock
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(self.calls.fileno(), zmq.POLLIN)
        try:
            while not self._stop:
                if not poller.poll(200):  # wake up now and then to notice stop()
                    continue
                self.calls.run_pending()  # the admin API's requests, between two messages
                # drain what is queued, but bounded, so stop() is noticed under constant load
                for _ in range(256):
                    try:
                        parts = sock.recv_multipart(zmq.NOBLOCK, copy=False)
                    except zmq.Again:
                        break
                    self._handle(parts)
        finally:
            self.calls.close()  # first: HTTP requests still waiting get their 503 now
            if self.admin is not None:
                self.admin.close()
            sock.close(0)
            self._sock = None

    # -- one message --
    def _handle(self, parts: list[zmq.Frame]) -> None:
        identity = parts[0].bytes
        self.peers.saw(identity, time.monotonic())
        body = parts[1:]
        envelope: list[bytes] = [identity]
        if len(body) > 1 and len(body[0]) == 0:  # a REQ client's empty delimiter: echo it back
            envelope.append(b"")
            body = body[1:]
        command, request_id = 0, 0
        try:
            req = wire.decode_request([f.buffer for f in body], self.limits)
            command, request_id = int(req.command), req.request_id
            status, frames, flags = self._dispatch(req)
        except wire.WireError as e:
            # errors raised by handlers carry no id; those from decoding carry whatever was parsed
            status, frames, flags = e.status, [str(e).encode()], 0
            request_id = request_id or e.request_id
            if e.status == Status.UNKNOWN_COMMAND:
                self.stats.unknown_commands += 1
            elif e.status == Status.TOO_LARGE:
                self.stats.rejected_too_large += 1
            else:
                self.stats.bad_requests += 1
            logger.debug("cache server: rejected request: %s", e)
        except Exception as e:  # a bug must cost one reply, not the server
            self.stats.internal_errors += 1
            logger.exception("cache server: internal error handling command %s", command)
            status, frames, flags = Status.INTERNAL, [f"internal error: {type(e).__name__}".encode()], 0
        reply = wire.encode_reply(status, command, request_id, frames, flags)
        try:
            self._sock.send_multipart(envelope + reply, zmq.NOBLOCK, copy=False)
        except zmq.Again:  # that client's queue is full: it is not reading; never wait for it
            self.stats.dropped_replies += 1
        except zmq.ZMQError as e:
            if e.errno != zmq.EHOSTUNREACH:  # EHOSTUNREACH: it disconnected before its reply
                raise
            self.stats.dropped_replies += 1

    def _dispatch(self, req: wire.Request) -> tuple[Status, list, int]:
        if req.command == Command.HEALTH:  # unauthenticated on purpose: probes carry no token, it reveals nothing
            return Status.OK, [b"ok"], 0
        if self._auth is not None and not hmac.compare_digest(req.auth, self._auth):
            self.stats.auth_failures += 1
            return Status.AUTH_FAILED, [b"authentication failed: wrong or missing token"], 0
        handler = _HANDLERS[req.command]
        return handler(self, req.frames)

    def _key(self, frame) -> bytes:
        view = memoryview(frame)
        if view.nbytes == 0:
            raise wire.WireError(Status.BAD_REQUEST, "empty key")
        if view.nbytes > self.limits.max_key_bytes:
            raise wire.WireError(Status.TOO_LARGE, f"key of {view.nbytes} bytes, limit {self.limits.max_key_bytes}")
        return bytes(view)

    @staticmethod
    def _arity(frames: Sequence, n: int, what: str) -> None:
        if len(frames) != n:
            raise wire.WireError(Status.BAD_REQUEST, f"{what} takes {n} payload frames, got {len(frames)}")

    def _put(self, frames: Sequence) -> tuple[Status, list, int]:
        self._arity(frames, 2, "PUT")
        key, value = self._key(frames[0]), memoryview(frames[1])
        if value.nbytes > self.limits.max_value_bytes:
            raise wire.WireError(Status.TOO_LARGE,
                                 f"value of {value.nbytes} bytes, limit {self.limits.max_value_bytes}")
        self.stats.puts += 1
        if not self.store.put(key, value):
            raise wire.WireError(Status.TOO_LARGE,
                                 f"entry of {len(key) + value.nbytes} bytes exceeds capacity {self.store.capacity}")
        return Status.OK, [], 0

    def _get(self, frames: Sequence) -> tuple[Status, list, int]:
        self._arity(frames, 1, "GET")
        self.stats.gets += 1
        value = self.store.get(self._key(frames[0]))
        if value is None:
            self.stats.misses += 1
            return Status.NOT_FOUND, [], 0
        if not self.replies.admit(value):
            self.stats.refused_replies += 1
            return Status.BUSY, [f"{self.replies.pending_bytes} bytes of replies are queued for clients "
                                 f"that do not read them (limit {self.replies.limit}); retry later".encode()], 0
        self.stats.hits += 1
        return Status.OK, [self.replies.frame(value)], 0

    def _exists(self, frames: Sequence) -> tuple[Status, list, int]:
        keys = [self._key(f) for f in frames]
        self.stats.exists_queries += 1
        self.stats.exists_keys += len(keys)
        return Status.OK, [wire.pack_bits([k in self.store for k in keys])], 0

    def _delete(self, frames: Sequence) -> tuple[Status, list, int]:
        self._arity(frames, 1, "DELETE")
        self.stats.deletes += 1
        return (Status.OK if self.store.delete(self._key(frames[0])) else Status.NOT_FOUND), [], 0

    def _list(self, frames: Sequence) -> tuple[Status, list, int]:
        if len(frames) > 1:
            raise wire.WireError(Status.BAD_REQUEST, f"LIST takes 0 or 1 payload frames, got {len(frames)}")
        limit = wire.unpack_u32(frames[0]) if frames else LIST_DEFAULT
        limit = min(limit, self.limits.max_keys_per_request)
        keys, truncated = self.store.keys(limit)
        return Status.OK, keys, wire.FLAG_TRUNCATED if truncated else 0

    def _stats(self, frames: Sequence) -> tuple[Status, list, int]:
        self._arity(frames, 0, "STATS")
        return Status.OK, [json.dumps(self.stats_dict()).encode()], 0

    # -- the admin API's calls (admin_http.AdminTarget), run on this loop's thread --
    def clear(self) -> int:
        removed = self.store.clear()
        self.stats.clears += 1
        logger.info("%s: the admin API's /clear removed %d entries", self.kind, removed)
        return removed

    def note_auth_failure(self) -> None:
        self.stats.auth_failures += 1

    def stats_dict(self) -> dict[str, int | float | str]:
        self.replies.sweep()
        now = time.monotonic()
        return {
            **asdict(self.stats),
            "keys": len(self.store),
            "clients": self.peers.count(now),
            "clients_window_s": self.peers.window_s,
            "used_bytes": self.store.used_bytes,
            "capacity_bytes": self.store.capacity,
            "pending_reply_bytes": self.replies.pending_bytes,
            "max_pending_reply_bytes": self.replies.limit,
            "max_value_bytes": self.limits.max_value_bytes,
            "uptime_s": round(now - self._started, 3),
            "version": __version__,
            "protocol_version": wire.VERSION,
            "persistent": self.store.disk is not None,
            "disk": None if self.store.disk is None else asdict(self.store.disk.stats()),
        }


_HANDLERS = {
    Command.PUT: CacheServer._put,
    Command.GET: CacheServer._get,
    Command.EXISTS: CacheServer._exists,
    Command.DELETE: CacheServer._delete,
    Command.LIST: CacheServer._list,
    Command.STATS: CacheServer._stats,
}


def _zmq_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


# ---- command line -------------------------------------------------------------------------------
def _configure(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("--host", default="127.0.0.1",
                   help="address to bind (default loopback; 0.0.0.0 exposes it to the network)")
    p.add_argument("--port", type=int, default=DEFAULT_PORT)
    p.add_argument("--max-size-gb", type=float, default=4.0, help="capacity; LRU eviction beyond it")
    p.add_argument("--max-value-mb", type=float, default=1024.0, help="largest value one PUT may carry")
    p.add_argument("--max-pending-reply-mb", type=float, default=None,
                   help="bound on stored values that queued GET replies keep alive after eviction; beyond it "
                        "GETs are answered BUSY (default: min(256, capacity in MiB))")
    p.add_argument("--disk", default=None, metavar="DIR",
                   help="write chunks through to DIR (the disk tier's chunk files) and reload them at start")
    p.add_argument("--auth-token", default=None,
                   help=f"require this token from clients (default: ${AUTH_TOKEN_ENV}, else no auth)")
    p.add_argument("--admin-port", type=int, default=None, metavar="PORT",
                   help="serve the HTTP admin API (/healthcheck, /status, /metrics, POST /clear) on --host:PORT "
                        "(default: off; docs/wire-format.md)")
    p.add_argument("--log-level", default="INFO")
    p.set_defaults(func=run_server)
    return p


def add_server_parser(subparsers) -> argparse.ArgumentParser:
    """`lmcache-triton server ...`: the CLI hands its subparsers here."""
    return _configure(subparsers.add_parser("server", help="run the remote cache server (lm://host:port)",
                                            description=__doc__,
                                            formatter_class=argparse.RawDescriptionHelpFormatter))


def add_stats_parser(subparsers) -> argparse.ArgumentParser:
    """`lmcache-triton stats lm://host:port | http://host:port/metrics | --admin http://host:port`: a
    running server's STATS (over ZMQ, or its admin API's /status), or a vLLM worker's cache metrics
    (hits, misses by reason, reservations, verified hits, load-or-recompute decisions and the
    estimates behind them), as JSON."""
    p = subparsers.add_parser("stats", help="print a cache server's or a vLLM worker's cache statistics (JSON)")
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("url", nargs="?", help="lm://host:port (a cache server), or http://host:port/metrics (a "
                                             "worker's prometheus_port)")
    what.add_argument("--admin", metavar="URL", help="http://host:port: a cache server's admin API "
                                                     "(its --admin-port); prints its /status")
    p.add_argument("--auth-token", default=None, help=f"default: ${AUTH_TOKEN_ENV}")
    p.add_argument("--timeout", type=float, default=5.0, help="seconds")
    p.add_argument("--watch", type=float, metavar="SECONDS", default=None,
                   help="a live view: print the statistics again every SECONDS until interrupted")
    p.add_argument("--count", type=int, default=None, help="with --watch: stop after this many views")
    p.set_defaults(func=run_stats)
    return p


def run_stats(args: argparse.Namespace) -> int:
    from lmcache_triton.storage.remote import CacheServerClient, RemoteError, parse_lm_url

    token = args.auth_token or os.environ.get(AUTH_TOKEN_ENV)
    if args.admin is not None:
        from lmcache_triton.server.admin_http import fetch_status

        fetch, errors, close = (lambda: fetch_status(args.admin, token, args.timeout)), (OSError, ValueError), None
    elif args.url.startswith(("http://", "https://")):
        from lmcache_triton.observability.prometheus import scrape_engine_stats

        fetch, errors, close = (lambda: scrape_engine_stats(args.url, args.timeout)), (OSError, ValueError), None
    else:
        try:
            host, port = parse_lm_url(args.url)
        except ValueError as e:
            print(f"lmcache-triton stats: {e}", file=sys.stderr)
            return 2
        client = CacheServerClient(host, port, timeout_s=args.timeout, auth_token=token)
        fetch, errors, close = client.stats, RemoteError, client.close
    views = 0
    try:
        while True:
            try:
                stats = fetch()
            except errors as e:
                print(f"lmcache-triton stats: {e}", file=sys.stderr)
                if args.watch is None:
                    return 1
            else:
                if args.watch is not None:
                    print(time.strftime("%H:%M:%S"), flush=True)
                print(json.dumps(stats, indent=2), flush=True)
            views += 1
            if args.watch is None or (args.count is not None and views >= args.count):
                return 0
            time.sleep(args.watch)
    except KeyboardInterrupt:
        return 0
    finally:
        if close is not None:
            close()


def config_from_args(args: argparse.Namespace) -> ServerConfig:
    if args.max_size_gb <= 0 or args.max_value_mb <= 0:
        raise ValueError(f"--max-size-gb and --max-value-mb must be positive, got {args.max_size_gb} and "
                         f"{args.max_value_mb}")
    pending = args.max_pending_reply_mb
    if pending is not None and pending <= 0:
        raise ValueError(f"--max-pending-reply-mb must be positive, got {pending}")
    return ServerConfig(
        host=args.host, port=args.port, max_size_bytes=int(args.max_size_gb * 1e9),
        limits=Limits(max_value_bytes=int(args.max_value_mb * (1 << 20))),
        disk_dir=args.disk, auth_token=args.auth_token or os.environ.get(AUTH_TOKEN_ENV) or None,
        max_pending_reply_bytes=None if pending is None else int(pending * (1 << 20)),
        admin_port=args.admin_port)


def run_server(args: argparse.Namespace) -> int:
    if not logging.getLogger().handlers:
        logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        server = CacheServer(config_from_args(args))
        server.bind()
    except (ValueError, zmq.ZMQError, OSError) as e:
        print(f"lmcache-triton server: cannot start on {args.host}:{args.port}: {e}", file=sys.stderr)
        return 2

    def _stop(signum, _frame) -> None:
        server.stop()

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    server.serve_forever()
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _configure(argparse.ArgumentParser(prog="python -m lmcache_triton.server.cache_server",
                                              description=__doc__,
                                              formatter_class=argparse.RawDescriptionHelpFormatter)).parse_args(argv)
    return run_server(args)


if __name__ == "__main__":
    sys.exit(main())
