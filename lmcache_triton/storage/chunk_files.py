"""A folder of chunk files, LRU by bytes: the disk tier's, and the cache server's `--disk`.

A chunk file is a serialized chunk (serde: safetensors with checksums), byte for byte what the
remote tiers store, so either folder can be read by the other's code.

Layout: `<root>/<2 hex>/<32 hex>.safetensors`, the hex being blake2b of the key string, so any
model name (with '/', '@', unicode) makes a safe file name and the 256 shards keep directories
small. Writes go to `.tmp-<stem>-<host>-<pid>-<rand>` in the same shard and are renamed into place
(os.replace is atomic), so a crash never leaves a half-written file under a real name. Several
processes may share the folder, so a start deletes only the temp files of crashed writers: those
named by this host and a pid that no longer runs, and any (another host's too) untouched for
TEMP_STALE_SECONDS.

Start: the index is rebuilt from the folder by reading each file's header only, in mtime order (a
read touches the file's mtime, so recency survives a restart), then evicted down to the capacity:
- unreadable header, or size different from what the header says: corrupt -> deleted, counted;
- well-formed but not the owner's (`claim` refuses it: another model, rank, dtype, shape; or
  another format version): "foreign" -> left alone and never served, and not counted against the
  capacity: engines of different models may share a folder;
- claimed, but under a name that is not the hash of its key: corrupt (nothing we write does that).
Every read checks the header, size and key again; a bad file is a miss, is counted and deleted.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import socket
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import BinaryIO, Generic, TypeVar

from lmcache_triton.storage.chunk_header import (
    RawHeader,
    SerdeError,
    UnsupportedVersionError,
    header_span,
    read_raw_header,
)
from lmcache_triton.storage.lru import LRU
from lmcache_triton.storage.tier_stats import TierStats

logger = logging.getLogger("lmcache_triton")

K = TypeVar("K")
T = TypeVar("T")

SUFFIX = ".safetensors"
TMP_PREFIX = ".tmp-"
_HEX = frozenset("0123456789abcdef")
# A temp file whose writer cannot be shown dead (another host's, a live pid's here, or a name without
# host and pid) is deleted at start only once it has been untouched this long. A write is one chunk
# (megabytes) and its file's mtime moves with every write call, so a writer that is alive keeps it
# fresh; ten minutes without a change means the writer is gone (killed, its host down, or its pid
# reused by another process), and the file is only wasting space.
TEMP_STALE_SECONDS = 10 * 60
# <stem>-<host>-<pid>-<12 hex>; the host may itself contain '-', the other fields never do.
_TMP_NAME = re.compile(r"(?P<stem>[0-9a-f]+)-(?P<host>[A-Za-z0-9._-]+)-(?P<pid>[0-9]+)-(?P<rand>[0-9a-f]{12})")


def _host_tag() -> str:
    """This host's name as it goes into temp file names: only [A-Za-z0-9._-], at most 64 chars.
    (Containers that share a directory need distinct host names, as Docker and Kubernetes give
    them: pids are only meaningful within one host's pid namespace.)"""
    return re.sub(r"[^A-Za-z0-9._-]", "_", socket.gethostname())[:64] or "unknown"


def _temp_writer(name: str) -> tuple[str, int] | None:
    """(host, pid) of the writer a temp file name carries, or None for a name without them."""
    m = _TMP_NAME.fullmatch(name[len(TMP_PREFIX):]) if name.startswith(TMP_PREFIX) else None
    return (m["host"], int(m["pid"])) if m else None


def _pid_alive(pid: int) -> bool:
    """False only when this host certainly has no process `pid`; True when it has, or when unsure."""
    if pid <= 0 or os.name != "posix":  # os.kill(pid, 0) would signal a group, or kill on Windows
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # PermissionError: it exists, under another user
        return True
    return True


def _read_prefix(f: BinaryIO) -> bytes:
    """The bytes of a chunk file's header; leaves `f` at the start of the payload."""
    head = f.read(8)
    return head + f.read(header_span(head) - 8)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@dataclass
class _File:
    path: Path
    nbytes: int
    writing: bool = False  # in flight: not readable yet, and never evicted


def _writing(f: _File) -> bool:
    return f.writing


@dataclass
class ScanReport:
    """What the start found besides the chunks it indexed (corrupt files and evictions are in
    the stats)."""

    foreign: int = 0       # well-formed files that are not the owner's: left alone
    temp_cleaned: int = 0  # temp files of dead writers, deleted


class ChunkFiles(Generic[K]):
    """The chunk files under `root`, at most `capacity` bytes of them, least recently used evicted.

    `key_name(key)` is the key string a file's header names; `claim(header)` is the key of a file
    found at start, or raises SerdeError for a file that is not the owner's. Thread-safe: the
    index is changed under a lock, files are written and read outside it.
    """

    def __init__(self, root: str | Path, capacity: int, *, key_name: Callable[[K], str],
                 claim: Callable[[RawHeader], K], fsync: bool = False, name: str = "chunk files") -> None:
        if capacity <= 0:
            raise ValueError(f"{name}: capacity must be positive, got {capacity} bytes")
        self.name = name
        self.root = Path(root)
        self.capacity = int(capacity)
        self.fsync = fsync
        self._key_name = key_name
        self._claim = claim
        # Re-entrant: failures are counted (under the lock) both from inside and outside it.
        self._lock = threading.RLock()
        self._index: LRU[K, _File] = LRU()
        self._writes = 0  # entries of the index being written
        self._stats = TierStats(capacity_bytes=self.capacity)
        self._logged: set[str] = set()
        self._closed = False
        self._host = _host_tag()
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ValueError(f"{name} cannot create its directory {str(self.root)!r}: {e}") from e
        self.found_at_start = self._scan()

    def path_for(self, key: K) -> Path:
        h = hashlib.blake2b(self._key_name(key).encode("utf-8"), digest_size=16).hexdigest()
        return self.root / h[:2] / f"{h}{SUFFIX}"

    # ---- bookkeeping -----------------------------------------------------------------------------
    def _fail(self, counter: str | None, kind: str, msg: str) -> None:
        """Counts a failure; logs the first of each kind as a warning, the rest at debug level."""
        with self._lock:
            if counter is not None:
                setattr(self._stats, counter, getattr(self._stats, counter) + 1)
            first = kind not in self._logged
            self._logged.add(kind)
        if first:
            logger.warning("%s: %s (further %s failures are logged at debug level)", self.name, msg, kind)
        else:
            logger.debug("%s: %s", self.name, msg)

    def _unlink(self, path: Path) -> None:
        try:
            path.unlink()
        except FileNotFoundError:
            pass
        except OSError as e:
            self._fail("errors", "unlink", f"cannot delete {path}: {e}")

    def _evict(self, incoming: int) -> bool:
        """Deletes least recently used files until `incoming` more bytes fit; False, deleting
        nothing, when they never can. Call with the lock held: deleting under it keeps a re-store
        of the same key from being unlinked by a late eviction."""
        victims = self._index.evict(self.capacity, incoming, held=_writing)
        if victims is None:
            return False
        for key, entry in victims:
            self._unlink(entry.path)
            self._dropped(key)
        self._stats.evictions += len(victims)
        return True

    # Told of every key this folder loses (evicted, removed, deleted as corrupt): the disk tier's
    # event log (storage/tier_events.py), when something publishes it.
    on_drop: Callable[[K], None] | None = None

    def _dropped(self, key: K) -> None:
        if self.on_drop is not None:
            self.on_drop(key)

    def _forget(self, key: K, entry: _File, *, delete: bool) -> None:
        """Drops `key` if the index still has this very entry."""
        with self._lock:
            if self._index.get(key) is entry:
                self._index.pop(key)
                if delete:
                    self._unlink(entry.path)
                self._dropped(key)

    # ---- start -----------------------------------------------------------------------------------
    def _scan(self) -> ScanReport:
        report = ScanReport()
        found: list[tuple[float, K, _File]] = []
        now = time.time()
        for shard in sorted(self.root.iterdir()):
            if not (len(shard.name) == 2 and set(shard.name) <= _HEX and shard.is_dir()):
                continue  # not ours: a shared or user directory may contain anything else
            for p in shard.iterdir():
                if p.name.startswith(TMP_PREFIX):
                    if self._temp_abandoned(p, now):
                        self._unlink(p)  # a write that never reached os.replace
                        report.temp_cleaned += 1
                elif p.name.endswith(SUFFIX) and (item := self._scan_file(p, report)) is not None:
                    found.append(item)
        found.sort(key=lambda item: item[0])
        with self._lock:
            for _, key, entry in found:
                self._index.put(key, entry, entry.nbytes)
            self._evict(0)  # the capacity may have shrunk since the last run
        if found or report.foreign or report.temp_cleaned or self._stats.corrupt:
            logger.info("%s: found %d chunks (%d bytes) in %s; %d corrupt and %d evicted, %d foreign kept, "
                        "%d temp files cleaned", self.name, len(self._index), self._index.used_bytes, self.root,
                        self._stats.corrupt, self._stats.evictions, report.foreign, report.temp_cleaned)
        return report

    def _temp_abandoned(self, p: Path, now: float) -> bool:
        """True for a temp file whose writer is gone: named by this host and a pid that no longer
        runs here, or untouched for TEMP_STALE_SECONDS. Other writes in flight (this host's live
        pids, other hosts' recent files) are left alone."""
        writer = _temp_writer(p.name)
        if writer is not None and writer[0] == self._host and not _pid_alive(writer[1]):
            return True
        try:
            return now - p.stat().st_mtime > TEMP_STALE_SECONDS
        except OSError:  # renamed into place or removed meanwhile
            return False

    def _scan_file(self, p: Path, report: ScanReport) -> tuple[float, K, _File] | None:
        try:
            with open(p, "rb") as f:
                st = os.fstat(f.fileno())
                header = read_raw_header(_read_prefix(f))
        except UnsupportedVersionError:
            report.foreign += 1  # a newer (or older) writer's file: not ours to judge
            return None
        except SerdeError as e:
            self._corrupt_at_start(p, str(e))
            return None
        except OSError as e:
            self._fail("errors", "scan", f"cannot read {p}: {e}")
            return None
        if st.st_size != header.file_nbytes:
            self._corrupt_at_start(p, f"size {st.st_size} but its header says {header.file_nbytes}")
            return None
        try:
            key = self._claim(header)
        except SerdeError:
            report.foreign += 1
            return None
        if self.path_for(key) != p:
            self._corrupt_at_start(p, f"names key {header.key!r}, which is not named {p.name}")
            return None
        return st.st_mtime, key, _File(p, st.st_size)

    def _corrupt_at_start(self, p: Path, why: str) -> None:
        self._fail("corrupt", "corrupt", f"deleting corrupt chunk file {p}: {why}")
        self._unlink(p)

    # ---- the index -------------------------------------------------------------------------------
    def contains(self, key: K) -> bool:
        with self._lock:
            entry = self._index.get(key)
            return not self._closed and entry is not None and not entry.writing

    def keys(self) -> list[K]:
        """Stored keys, least recently used first."""
        with self._lock:
            return [k for k, entry in self._index.items() if not entry.writing]

    def files(self) -> list[tuple[K, int]]:
        """(key, file bytes) of the stored chunks, least recently used first."""
        with self._lock:
            return [(k, entry.nbytes) for k, entry in self._index.items() if not entry.writing]

    def __len__(self) -> int:
        with self._lock:
            return len(self._index) - self._writes

    def stats(self) -> TierStats:
        with self._lock:
            return replace(self._stats, chunks=len(self._index) - self._writes, used_bytes=self._index.used_bytes,
                           held_chunks=self._writes)

    def close(self) -> None:
        with self._lock:
            self._closed = True  # files stay: the next owner of this folder finds them

    # ---- writes ----------------------------------------------------------------------------------
    def store(self, key: K, serialize: Callable[[], Sequence[bytes | memoryview]]) -> bool:
        """Writes the chunk `serialize()` makes (the file is the concatenation of its parts),
        evicting least recently used files for room. A key stored or being written is only
        touched: keys name their content, so it already has these bytes. False on failure
        (logged once per kind, counted); never raises for I/O problems."""
        with self._lock:
            if self._closed:
                return False
            self._stats.puts += 1
            if self._index.touch(key) is not None:
                return True
        started = time.perf_counter()
        try:
            parts = serialize()  # outside the lock: the naive payload is a view, lz4 takes a while
        except (ValueError, TypeError, RuntimeError) as e:
            self._fail("put_failures", "serialize", f"cannot serialize {self._key_name(key)}: {e}")
            return False
        size = sum(memoryview(p).nbytes for p in parts)
        with self._lock:
            if self._index.touch(key) is not None:
                return True
            if not self._evict(size):
                self._fail("put_failures", "no_room",
                           f"chunk of {size} bytes does not fit in {self.capacity} bytes "
                           f"({self._writes} writes in flight)")
                return False
            entry = _File(self.path_for(key), size, writing=True)
            self._index.put(key, entry, size)  # counted now: writes in flight never overfill the folder
            self._writes += 1
        ok = self._write_atomic(entry.path, parts)
        with self._lock:
            self._writes -= 1
            if ok:
                entry.writing = False
                self._stats.written_bytes += size
                self._stats.write_seconds += time.perf_counter() - started
                self._index.touch(key)  # written now: the most recent, as if it had been instant
            else:
                self._index.pop(key)
        return ok

    def _write_atomic(self, path: Path, parts: Sequence[bytes | memoryview]) -> bool:
        # Host and pid in the name: another process's start tells a crashed write from one in flight.
        tmp = path.parent / f"{TMP_PREFIX}{path.stem}-{self._host}-{os.getpid()}-{uuid.uuid4().hex[:12]}"
        try:
            path.parent.mkdir(exist_ok=True)
            with open(tmp, "wb") as f:
                for part in parts:
                    f.write(part)
                if self.fsync:
                    f.flush()
                    os.fsync(f.fileno())
            os.replace(tmp, path)
            if self.fsync:
                _fsync_dir(path.parent)  # makes the rename itself durable
            return True
        except OSError as e:
            self._unlink(tmp)
            with self._lock:
                self._stats.put_failures += 1
            self._fail("errors", f"write:{e.errno}", f"cannot write {path}: {e}")
            return False

    def remove(self, key: K) -> bool:
        """Deletes `key`'s file; False if it was not stored (a write in flight is left to land)."""
        with self._lock:
            entry = self._index.get(key)
            if entry is None or entry.writing:
                return False
            self._index.pop(key)
            self._unlink(entry.path)
            self._dropped(key)
            return True

    # ---- reads -----------------------------------------------------------------------------------
    def touch(self, key: K) -> None:
        """Marks `key` recently used, in the index and in its file's mtime (which a restart reads)."""
        with self._lock:
            entry = self._index.touch(key)
        if entry is not None:
            try:
                os.utime(entry.path)
            except OSError:
                pass

    def read(self, key: K, consume: Callable[[BinaryIO, RawHeader], T | None]) -> T | None:
        """`consume(f, header)`'s result, `f` positioned at the payload, once the file's header,
        size and key have checked out; a hit, or a miss when it returns None (nothing wrong with
        the file: e.g. no room to read it into). `consume` raises SerdeError for a chunk that fails
        its checks: a miss, counted as corrupt, the file deleted. Never raises."""
        with self._lock:
            entry = None if self._closed else self._index.touch(key)
            if entry is None or entry.writing:
                self._stats.misses += 1
                return None
        result = None
        started = time.perf_counter()
        try:
            with open(entry.path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                header = read_raw_header(_read_prefix(f))
                if size != header.file_nbytes:
                    raise SerdeError(f"file is {size} bytes, its header says {header.file_nbytes}")
                if header.key != (expected := self._key_name(key)):
                    raise SerdeError(f"file names key {header.key!r}, expected {expected!r}")
                result = consume(f, header)
        except FileNotFoundError:  # evicted or removed between the index lookup and the open
            self._forget(key, entry, delete=False)
        except UnsupportedVersionError as e:  # rewritten by another version's writer: not ours to delete
            self._forget(key, entry, delete=False)
            self._fail(None, "version", f"{entry.path}: {e}")
        except SerdeError as e:
            self._forget(key, entry, delete=True)
            self._fail("corrupt", "corrupt", f"deleting corrupt chunk file {entry.path}: {e}")
        except OSError as e:
            self._fail("errors", f"read:{e.errno}", f"cannot read {entry.path}: {e}")
        except Exception as e:  # a misbehaving consumer (allocator), or a bug: still a miss, never a crash
            self._fail("errors", f"read:{type(e).__name__}", f"reading {entry.path} failed: {e!r}")
        with self._lock:
            if result is None:
                self._stats.misses += 1
            else:
                self._stats.hits += 1
                self._stats.read_bytes += entry.nbytes
                self._stats.read_seconds += time.perf_counter() - started
        if result is not None:
            try:
                os.utime(entry.path)  # recency that survives a restart (the scan orders by mtime)
            except OSError:
                pass
        return result
