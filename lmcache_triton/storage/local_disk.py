"""The disk tier: one safetensors file per chunk, LRU-evicted by bytes, and found again on restart.

Layout: `<path>/<2 hex>/<32 hex>.safetensors`, the hex being blake2b of the key string, so any
model name (with '/', '@', unicode) makes a safe file name and the 256 shards keep directories
small. Writes go to `.tmp-<stem>-<host>-<pid>-<rand>` in the same shard and are renamed into place
(os.replace is atomic), so a crash never leaves a half-written file under a real name. Several
engines may share the directory, so a start deletes only the temp files of crashed writers: those
named by this host and a pid that no longer runs, and any (another host's too) untouched for
TEMP_STALE_SECONDS.

Restart: the index is rebuilt from the directory by reading each file's header only, in mtime
order (a get touches the file's mtime, so recency survives a restart):
- unreadable header, or size different from what the header says: corrupt -> deleted, counted;
- well-formed but not ours (another model, rank, dtype, shape, or another format version):
  "foreign" -> left alone and never served. Engines of different models may share a directory;
  each counts only its own files against its max_bytes.
- ours but under a name that is not the hash of its key: corrupt (nothing we write does that).
Every get verifies the payload checksum; a bad file is a miss, is counted and deleted.
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
from collections import Counter, OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from lmcache_triton.storage.memory import MemoryObj
from lmcache_triton.metadata import LMCacheEngineMetadata
from lmcache_triton.storage.base import AllocateFn, StorageBackend
from lmcache_triton.storage.serde import (
    COMPRESSIONS,
    SerdeError,
    UnsupportedVersionError,
    check_fits,
    decode_payload,
    header_span,
    read_header,
    serialize_parts,
    verify_checksum,
)
from lmcache_triton.engine.token_database import CacheEngineKey

logger = logging.getLogger("lmcache_triton")

SUFFIX = ".safetensors"
TMP_PREFIX = ".tmp-"
_HEX = frozenset("0123456789abcdef")
# A temp file whose writer cannot be shown dead (another host's, a live pid's here, or a name without
# host and pid) is deleted at start only once it has been untouched this long. A write is one chunk
# (megabytes) and its file's mtime moves with every write call, so a writer that is alive keeps it
# fresh; ten minutes without a change means the writer is gone (killed, its host down, or its pid
# reused by another process), and the file is only wasting space.
TEMP_STALE_SECONDS = 10 * 60
# <stem>-<host>-<pid>-<12 hex>; the host may itself hold '-', the other fields never do.
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


@dataclass
class _Entry:
    path: Path
    nbytes: int


def _read_prefix(path: Path) -> tuple[bytes, int]:
    """The bytes of a chunk file's header, and the file's size."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        head = f.read(8)
        return head + f.read(header_span(head) - 8), size


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class LocalDiskBackend(StorageBackend):
    name = "LocalDiskBackend"
    indexed_in_memory = True  # contains() reads the in-memory index, never the disk

    def __init__(self, path: str | Path, max_bytes: int, metadata: LMCacheEngineMetadata, *,
                 compression: str = "naive", fsync: bool = False) -> None:
        if max_bytes <= 0:
            raise ValueError(f"LocalDiskBackend max_bytes must be positive, got {max_bytes}")
        if compression not in COMPRESSIONS:
            raise ValueError(f"LocalDiskBackend compression must be one of {COMPRESSIONS}, got {compression!r}")
        self.root = Path(path)
        self.max_bytes = int(max_bytes)
        self.metadata = metadata
        self.compression = compression
        self.fsync = fsync
        # Re-entrant: failures are counted (under the lock) both from inside and outside it.
        self._lock = threading.RLock()
        self._index: OrderedDict[CacheEngineKey, _Entry] = OrderedDict()  # oldest first
        self._writing: set[CacheEngineKey] = set()
        self._used = 0      # bytes of the indexed files
        self._reserved = 0  # bytes of writes in flight, counted before they land
        self._counts: Counter[str] = Counter()
        self._logged: set[str] = set()
        self._closed = False
        self._host = _host_tag()
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ValueError(f"LocalDiskBackend cannot create its directory {str(self.root)!r}: {e}") from e
        self._scan()

    # ---- naming ----------------------------------------------------------------------------------
    def path_for(self, key: CacheEngineKey) -> Path:
        h = hashlib.blake2b(key.to_string().encode("utf-8"), digest_size=16).hexdigest()
        return self.root / h[:2] / f"{h}{SUFFIX}"

    # ---- bookkeeping -----------------------------------------------------------------------------
    def _fail(self, counter: str, kind: str, msg: str) -> None:
        """Counts a failure; logs the first of each kind as a warning, the rest at debug level."""
        with self._lock:
            self._counts[counter] += 1
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
            self._fail("io_errors", "unlink", f"cannot delete {path}: {e}")

    def _drop(self, key: CacheEngineKey, entry: _Entry, *, delete: bool) -> None:
        """Forgets `key` if the index still holds this very entry; call with the lock held."""
        if self._index.get(key) is entry:
            del self._index[key]
            self._used -= entry.nbytes
            if delete:
                self._unlink(entry.path)

    def _evict_for(self, nbytes: int) -> bool:
        """Evicts LRU files until `nbytes` more fit; False (evicting nothing) if they never can.
        Call with the lock held: deleting under the lock keeps a re-put of the same key from being
        unlinked by a late eviction."""
        if self._reserved + nbytes > self.max_bytes:
            return False
        while self._used + self._reserved + nbytes > self.max_bytes:
            _, entry = self._index.popitem(last=False)
            self._used -= entry.nbytes
            self._unlink(entry.path)
            self._counts["evictions"] += 1
        return True

    # ---- start -----------------------------------------------------------------------------------
    def _scan(self) -> None:
        found: list[tuple[float, CacheEngineKey, _Entry]] = []
        now = time.time()
        for shard in sorted(self.root.iterdir()):
            if not (len(shard.name) == 2 and set(shard.name) <= _HEX and shard.is_dir()):
                continue  # not ours: a shared or user directory may hold anything else
            for p in shard.iterdir():
                if p.name.startswith(TMP_PREFIX):
                    if self._temp_abandoned(p, now):
                        self._unlink(p)  # a write that never reached os.replace
                        self._counts["temp_cleaned"] += 1
                elif p.name.endswith(SUFFIX) and (item := self._scan_file(p)) is not None:
                    found.append(item)
        found.sort(key=lambda item: item[0])
        for _, key, entry in found:
            self._index[key] = entry
            self._used += entry.nbytes
        while self._used > self.max_bytes:  # max_bytes may have shrunk since the last run
            _, entry = self._index.popitem(last=False)
            self._used -= entry.nbytes
            self._unlink(entry.path)
            self._counts["evictions"] += 1
        if self._index or self._counts:
            logger.info("%s: found %d chunks (%d bytes) in %s; %s", self.name, len(self._index), self._used,
                        self.root, dict(self._counts))

    def _temp_abandoned(self, p: Path, now: float) -> bool:
        """True for a temp file whose writer is gone: named by this host and a pid that no longer
        runs here, or untouched for TEMP_STALE_SECONDS. Other engines' writes in flight (this host's
        live pids, other hosts' recent files) are left alone."""
        writer = _temp_writer(p.name)
        if writer is not None and writer[0] == self._host and not _pid_alive(writer[1]):
            return True
        try:
            return now - p.stat().st_mtime > TEMP_STALE_SECONDS
        except OSError:  # renamed into place or removed meanwhile
            return False

    def _scan_file(self, p: Path) -> tuple[float, CacheEngineKey, _Entry] | None:
        try:
            st = p.stat()
            prefix, size = _read_prefix(p)
            header = read_header(prefix)
        except UnsupportedVersionError:
            self._counts["foreign"] += 1  # a newer (or older) writer's file: not ours to judge
            return None
        except SerdeError as e:
            self._corrupt_at_start(p, str(e))
            return None
        except OSError as e:
            self._fail("io_errors", "scan", f"cannot read {p}: {e}")
            return None
        if size != header.file_nbytes:
            self._corrupt_at_start(p, f"size {size} but its header says {header.file_nbytes}")
            return None
        try:
            check_fits(header, self.metadata)
        except SerdeError:
            self._counts["foreign"] += 1
            return None
        key = CacheEngineKey.from_string(header.key)  # check_fits parsed it already
        if self.path_for(key) != p:
            self._corrupt_at_start(p, f"holds key {header.key!r}, which is not named {p.name}")
            return None
        return st.st_mtime, key, _Entry(p, size)

    def _corrupt_at_start(self, p: Path, why: str) -> None:
        self._fail("corrupt", "corrupt", f"deleting corrupt chunk file {p}: {why}")
        self._unlink(p)

    # ---- StorageBackend --------------------------------------------------------------------------
    def contains(self, key: CacheEngineKey) -> bool:
        with self._lock:
            return not self._closed and key in self._index

    def put(self, key: CacheEngineKey, obj: MemoryObj) -> bool:
        with self._lock:
            if self._closed:
                return False
            self._counts["puts"] += 1
            # Keys are content hashes (prefix chain): a stored key already holds these bytes.
            if key in self._index:
                self._index.move_to_end(key)
                return True
            if key in self._writing:
                return True
        try:
            # The naive payload is a view of obj.tensor, written straight to the file (no copy).
            parts = serialize_parts(key, obj.tensor, obj.fmt, self.compression)
        except (ValueError, TypeError, RuntimeError) as e:
            self._fail("put_failures", "serialize", f"cannot serialize {key}: {e}")
            return False
        size = sum(len(p) for p in parts)
        with self._lock:
            if key in self._index or key in self._writing:
                return True
            if not self._evict_for(size):
                self._counts["refused"] += 1
                self._fail("put_failures", "no_room",
                           f"chunk of {size} bytes does not fit in max_bytes={self.max_bytes} "
                           f"(in flight: {self._reserved} bytes)")
                return False
            self._reserved += size
            self._writing.add(key)
        path = self.path_for(key)
        ok = self._write_atomic(path, parts)
        with self._lock:
            self._reserved -= size
            self._writing.discard(key)
            if not ok:
                return False
            self._index[key] = _Entry(path, size)
            self._used += size
            self._counts["bytes_written"] += size
        return True

    def _write_atomic(self, path: Path, parts: Sequence[bytes | memoryview]) -> bool:
        # Host and pid in the name: another engine's start tells a crashed write from one in flight.
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
            self._fail("put_failures", f"write:{e.errno}", f"cannot write {path}: {e}")
            return False

    def get(self, key: CacheEngineKey, allocate: AllocateFn) -> MemoryObj | None:
        with self._lock:
            if self._closed:
                return None
            self._counts["gets"] += 1
            entry = self._index.get(key)
            if entry is None:
                self._counts["misses"] += 1
                return None
            self._index.move_to_end(key)
        obj = self._read(key, entry, allocate)
        with self._lock:
            self._counts["hits" if obj is not None else "misses"] += 1
            if obj is not None:
                self._counts["bytes_read"] += entry.nbytes
        if obj is not None:
            try:
                os.utime(entry.path)  # recency that survives a restart (the scan orders by mtime)
            except OSError:
                pass
        return obj

    def _read(self, key: CacheEngineKey, entry: _Entry, allocate: AllocateFn) -> MemoryObj | None:
        obj: MemoryObj | None = None
        try:
            with open(entry.path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                head = f.read(8)
                head += f.read(header_span(head) - 8)
                header = read_header(head)
                if size != header.file_nbytes:
                    raise SerdeError(f"file is {size} bytes, its header says {header.file_nbytes}")
                if header.key != key.to_string():
                    raise SerdeError(f"file holds key {header.key!r}, expected {key.to_string()!r}")
                check_fits(header, self.metadata)  # before allocating: the shape comes from the file
                obj = allocate(header.shape, header.dtype, header.fmt)
                if obj is None:
                    with self._lock:
                        self._counts["alloc_failures"] += 1
                    return None
                if header.compression == "naive" and obj.tensor.is_contiguous():
                    # Straight into the caller's buffer, then verified there: one copy instead of
                    # two. Bad bytes never escape: on a mismatch the object is freed below.
                    dst = obj.tensor.reshape(-1).view(torch.uint8).numpy()
                    got = f.readinto(memoryview(dst))
                    verify_checksum(header, dst if got == len(dst) else dst[:got])
                else:
                    decode_payload(header, f.read(header.payload_nbytes), out=obj.tensor)
            return obj
        except FileNotFoundError:
            with self._lock:  # evicted or removed between the index lookup and the open
                self._drop(key, entry, delete=False)
        except UnsupportedVersionError as e:
            with self._lock:  # rewritten by another version's writer: not ours to delete
                self._drop(key, entry, delete=False)
            self._fail("foreign", "version", f"{entry.path}: {e}")
        except SerdeError as e:
            with self._lock:
                self._drop(key, entry, delete=True)
            self._fail("corrupt", "corrupt", f"deleting corrupt chunk file {entry.path}: {e}")
        except OSError as e:
            self._fail("io_errors", f"read:{e.errno}", f"cannot read {entry.path}: {e}")
        except Exception as e:  # a misbehaving allocate, or a bug: still a miss, never a crash
            self._fail("get_errors", f"get:{type(e).__name__}", f"reading {entry.path} failed: {e!r}")
        if obj is not None:
            obj.free()
        return None

    def remove(self, key: CacheEngineKey) -> bool:
        with self._lock:
            entry = self._index.get(key)
            if entry is None:
                return False
            self._drop(key, entry, delete=True)
            return True

    def close(self) -> None:
        with self._lock:
            self._closed = True  # files stay: the next backend on this directory finds them

    def stats(self) -> dict[str, int | float]:
        with self._lock:
            out: dict[str, int | float] = {
                k: self._counts[k] for k in (
                    "puts", "put_failures", "gets", "hits", "misses", "corrupt", "evictions", "refused",
                    "foreign", "temp_cleaned", "alloc_failures", "io_errors", "get_errors",
                    "bytes_written", "bytes_read")
            }
            out.update(used_bytes=self._used, pending_bytes=self._reserved, capacity_bytes=self.max_bytes,
                       chunks=len(self._index))
            return out

    def keys(self) -> list[CacheEngineKey]:
        """Stored keys, least recently used first."""
        with self._lock:
            return list(self._index)

    def __len__(self) -> int:
        return len(self._index)
