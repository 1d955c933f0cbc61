"""Chunk tensors (MemoryObj), their formats, and the bounded pool the CPU tier allocates from."""

from __future__ import annotations

import bisect
import ctypes
import errno
import logging
import mmap
import os
import sys
import threading
import time
import weakref
from enum import Enum
from math import prod

import torch

logger = logging.getLogger("lmcache_triton")

# Prefault: bytes the background thread commits per madvise call. The kernel holds the process's
# mmap lock through one call, which stalls any other thread's mmap/munmap (a malloc of a large
# tensor) meanwhile: 2 MiB is ~1 ms at this VM's 2-4 GB/s, and per-call overhead is lost in it.
_PREFAULT_STEP = 2 << 20
# Without MADV_POPULATE_WRITE the thread writes one byte per page under the pool's lock (see
# _touch_free): steps of the same size, so an allocation waits ~1 ms at most.
_TOUCH_STEP = 2 << 20
# When stores allocate, the thread leaves them the CPU for about as long as writing what they
# allocated takes (at _STORE_RATE, at most _MAX_PAUSE_S), then looks again: a first store racing
# the thread ran at 0.7 GB/s instead of 2.0 (2 cores, bench/startup.py). Lowering the thread's
# priority instead starved it while it held the mmap lock: other threads' mmap/munmap then waited
# up to 400 ms (nice 19) or 90 ms (nice 10) with both cores busy.
_STORE_RATE = 1e9
_MAX_PAUSE_S = 1.0
# Linux 5.14+: fault pages in writable without writing to them, so it is safe on memory the request
# path is already filling. Python's mmap module names it only from 3.13 on.
_MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23) if sys.platform.startswith("linux") else None


def _libc_madvise():
    """libc's madvise(2) through ctypes, which lets go of the GIL for the call. mmap.madvise holds
    it: populating 256 MB through it held every other Python thread for 160 ms here."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    return fn


_madvise = _libc_madvise() if _MADV_POPULATE_WRITE is not None else None

# cudaHostRegister per call: large single registrations fail on recent drivers (LMCache#5177
# registers in chunks of at most 64 GiB for the same reason).
_REGISTER_CHUNK = 64 << 30
_MIN_REGISTER_CHUNK = 256 << 20


def _unregister(ptrs: list[int]) -> None:
    if not ptrs:
        return
    try:
        cudart = torch.cuda.cudart()
    except Exception:  # interpreter shutdown: the process's memory goes with it
        return
    for ptr in ptrs:
        cudart.cudaHostUnregister(ptr)


def _clear_last_cuda_error() -> None:
    """torch checks cudaGetLastError after its kernel launches, so a failed cudaHostRegister left in
    that slot would surface as the error of some unrelated later op. torch.cuda.cudart() has no
    cudaGetLastError: one tiny launch consumes the error here instead."""
    try:
        torch.empty(1, device="cuda").fill_(0)
    except Exception:  # best effort: nothing to clear without a usable device
        pass


def _register(base: int, nbytes: int) -> list[int] | None:
    """cudaHostRegister of [base, base + nbytes) in pieces of at most _REGISTER_CHUNK; where a piece
    fails (a driver's limit on one registration), again in pieces a quarter the size, down to
    _MIN_REGISTER_CHUNK. The registered addresses, or None (nothing left registered)."""
    cudart = torch.cuda.cudart()
    piece, err = _REGISTER_CHUNK, 0
    while piece >= _MIN_REGISTER_CHUNK:
        done: list[int] = []
        for off in range(0, nbytes, piece):
            err = int(cudart.cudaHostRegister(base + off, min(piece, nbytes - off), 0))
            if err != 0:
                _clear_last_cuda_error()
                _unregister(done)
                break
            done.append(base + off)
        else:
            return done
        logger.info("cudaHostRegister in pieces of %d bytes failed (%s)", piece, cudart.cudaGetErrorString(err))
        piece //= 4
    return None


def pinned_buffer(nbytes: int) -> tuple[torch.Tensor, list[int]]:
    """A page-locked uint8 buffer of exactly `nbytes`, and the addresses registered for it.

    `torch.empty(..., pin_memory=True)` goes through torch's caching host allocator, which rounds
    every block up to a power of two: a 5 GB tier would lock 8 GiB (LMCache#1147, pytorch#150517).
    So: a plain host allocation registered with cudaHostRegister, in smaller pieces where a large
    one fails. Only where no piece size works (RLIMIT_MEMLOCK) fall back to torch's pinned
    allocation, and say so.
    """
    if not torch.cuda.is_available():
        raise ValueError("pinned host memory needs a CUDA device; this host has none (pin_memory=False)")
    buf = torch.empty(nbytes, dtype=torch.uint8)
    done = _register(buf.data_ptr(), nbytes)
    if done is None:
        logger.warning("cudaHostRegister of %d bytes failed in every piece size; using torch's pinned allocator, "
                       "which rounds the CPU tier up to a power of two", nbytes)
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True), []
    return buf, done


def _available_bytes() -> int | None:
    """What this process can still commit without swapping: the kernel's MemAvailable, or what its
    cgroup (v2) limit leaves, whichever is less; None where neither is known."""
    found = []
    try:
        with open("/proc/meminfo") as f:
            found += [int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:")]
    except (OSError, ValueError):
        pass
    try:
        with open("/proc/self/cgroup") as f:
            group = next(line[3:].strip() for line in f if line.startswith("0::"))
        base = f"/sys/fs/cgroup{group.rstrip('/')}"
        with open(f"{base}/memory.max") as lim, open(f"{base}/memory.current") as cur:
            limit = lim.read().strip()
            if limit != "max":
                found.append(int(limit) - int(cur.read()))
    except (OSError, ValueError, StopIteration):
        pass
    return max(0, min(found)) if found else None


def anonymous_buffer(nbytes: int) -> torch.Tensor:
    """A uint8 tensor over a fresh private anonymous mapping of `nbytes`, page-aligned.

    Like torch.empty, nothing is committed yet; unlike it, the mapping is ours alone to madvise
    (malloc may place a buffer amid others). Private: mmap's default on Linux is MAP_SHARED, which
    is shared memory (tmpfs pages, shared with forked children). No MADV_HUGEPAGE: 4 GB committed
    at 2.1-2.5 GB/s in 4 KiB pages and 0.4-1.2 GB/s in huge pages on this VM, with copies into
    either no faster in a way the noise let us see. The tensor keeps the mapping alive: it is
    unmapped with the last view of the buffer."""
    flags = getattr(mmap, "MAP_PRIVATE", None)
    if flags is None:  # Windows: no flags, and its anonymous mappings are private
        return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=torch.uint8)
    return torch.frombuffer(mmap.mmap(-1, nbytes, flags=flags | mmap.MAP_ANONYMOUS), dtype=torch.uint8)


class _Prefaulter:
    """Commits a pool's pages front to back in a daemon thread, so the request path does not fault
    them in: the first 1 GiB store into a fresh 4 GB tier ran at 1.8 GB/s, against 3.6 once the
    thread had committed the tier, 2.1 s after start (bench/startup.py).

    The allocator is first-fit from offset 0, so the first chunks land in the first pages committed.
    It keeps no reference to the pool between steps (a pool dropped without close() stops it) and
    takes no lock the request path takes, except without MADV_POPULATE_WRITE (see _touch_free)."""

    def __init__(self, pool: TensorMemoryPool, limit: int) -> None:
        self.committed = 0  # bytes from offset 0 the thread has passed
        self.done = threading.Event()
        self._stop = threading.Event()
        self._pool = weakref.ref(pool)
        self._thread = threading.Thread(target=self._run, args=(pool.buffer, limit), name="lmct-prefault",
                                        daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join()

    def _run(self, buffer: torch.Tensor, limit: int) -> None:
        # `buffer` keeps the mapping alive while this thread writes to its addresses.
        base, populate = buffer.data_ptr(), _madvise is not None and _MADV_POPULATE_WRITE is not None
        seen = 0  # bytes the pool had allocated in all when last looked at
        try:
            while self.committed < limit and not self._stop.is_set():
                pool = self._pool()
                if pool is None:
                    return
                if (busy := pool._busy_until - time.monotonic()) > 0:  # the host's compute runs: wait
                    del pool
                    self._stop.wait(min(busy, _MAX_PAUSE_S))
                    continue
                if pool._allocated_total != seen:  # a store is under way: leave it the CPU
                    pause = min(_MAX_PAUSE_S, (pool._allocated_total - seen) / _STORE_RATE) + 0.01
                    seen = pool._allocated_total
                    del pool
                    self._stop.wait(pause)
                    continue
                # Skip what stores have already allocated: their own writes commit those pages, and
                # faulting the pages a store is writing only contends with it. Ahead of it, the
                # thread commits what the store writes next.
                start = max(self.committed, -(-pool._allocated_end // mmap.PAGESIZE) * mmap.PAGESIZE)
                if start >= limit:
                    self.committed = limit
                    break
                n = min(_PREFAULT_STEP if populate else _TOUCH_STEP, limit - start)
                if not populate:
                    pool._touch_free(start, start + n)
                elif _madvise(base + start, n, _MADV_POPULATE_WRITE) != 0:
                    err = ctypes.get_errno()
                    if err != errno.EINVAL:  # ENOMEM and the like: the rest faults on use
                        logger.warning("committing the CPU tier ahead stopped at %d of %d bytes: %s",
                                       start, limit, os.strerror(err))
                        return
                    populate = False  # a kernel before 5.14
                    continue
                del pool
                self.committed = start + n
        finally:
            self.done.set()


class MemoryFormat(str, Enum):
    """Layouts of a chunk tensor, as storage sees it (DESIGN.md)."""

    KV_2LTD = "KV_2LTD"  # [2, num_layers, num_tokens, num_kv_heads * head_size]: all layers of one chunk
    KV_T2D = "KV_T2D"    # [num_tokens, 2, hidden]: one layer of one chunk (layerwise mode)
    KV_MLA = "KV_MLA"    # [1, num_layers, num_tokens, C], or [num_tokens, C] for one layer

    def token_dim(self, ndim: int) -> int:
        """Which axis counts tokens for a tensor of this format with `ndim` axes."""
        if self is MemoryFormat.KV_T2D or ndim == 2:
            return 0
        return 2


class MemoryObj:
    """A chunk tensor carved out of a pool, with a hold count that blocks eviction while it is read."""

    __slots__ = ("tensor", "fmt", "_pool", "_offset", "_nbytes", "_holds", "_lock")

    def __init__(self, tensor: torch.Tensor, fmt: MemoryFormat, pool: TensorMemoryPool | None = None,
                 offset: int = 0, nbytes: int | None = None) -> None:
        self.tensor = tensor
        self.fmt = MemoryFormat(fmt)
        self._pool = pool
        self._offset = offset
        self._nbytes = tensor.numel() * tensor.element_size() if nbytes is None else nbytes
        self._holds = 0
        self._lock = threading.Lock()

    @property
    def shape(self) -> torch.Size:
        return self.tensor.shape

    @property
    def dtype(self) -> torch.dtype:
        return self.tensor.dtype

    @property
    def num_tokens(self) -> int:
        return self.tensor.shape[self.fmt.token_dim(self.tensor.dim())]

    @property
    def nbytes(self) -> int:
        """Bytes this object takes in its pool (its tensor, rounded up to the pool's alignment)."""
        return self._nbytes

    def hold(self) -> None:
        with self._lock:
            self._holds += 1

    def unhold(self) -> None:
        with self._lock:
            if self._holds <= 0:
                raise RuntimeError("unhold() of a MemoryObj that is not held")
            self._holds -= 1

    @property
    def is_held(self) -> bool:
        return self._holds > 0

    def free(self) -> None:
        """Returns the bytes to the pool; the tensor must not be used afterwards.

        Atomic and idempotent: two threads releasing the last uses of one object (a reader and
        a write-through, say) must not return its range to the pool twice."""
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool._release(self._offset, self._nbytes)

    def __repr__(self) -> str:
        return f"MemoryObj(fmt={self.fmt.value}, shape={tuple(self.shape)}, dtype={self.dtype}, holds={self._holds})"


class TensorMemoryPool:
    """First-fit allocator over one preallocated byte buffer.

    One allocation at start (pinned where CUDA exists, so GPU<->host copies are DMA) instead of a
    malloc per chunk: the tier's memory is bounded by construction and never fragments the heap.
    Freed ranges coalesce with their neighbours. Unpinned, its pages are committed ahead by a
    background thread from start (`prefault`), so stores do not fault them in; `close()` stops it.
    """

    def __init__(self, size_bytes: int, *, pin_memory: bool | None = None, alignment: int = 512,
                 prefault: bool = True) -> None:
        """`prefault`: commit the pages ahead, in a background thread (unpinned pools only: cudaHostRegister
        commits a pinned pool's pages when it locks them). False: they fault in on first use."""
        if size_bytes <= 0:
            raise ValueError(f"pool size_bytes must be positive, got {size_bytes}")
        if pin_memory is None:
            pin_memory = torch.cuda.is_available()
        self.alignment = alignment
        self.capacity = size_bytes - size_bytes % alignment
        self._prefaulter: _Prefaulter | None = None
        if pin_memory:
            # Pinned, of exactly this size; unregistered when the pool (which every MemoryObj
            # references) is collected.
            self.buffer, registered = pinned_buffer(self.capacity)
            if registered:
                weakref.finalize(self, _unregister, registered)
        elif prefault:
            self.buffer = anonymous_buffer(self.capacity)
        else:
            # torch.empty does not touch the pages on CPU: each faults in on its first write.
            self.buffer = torch.empty(self.capacity, dtype=torch.uint8)
        self._free: list[tuple[int, int]] = [(0, self.capacity)]  # sorted (offset, size)
        self._used = 0
        # read by the prefault thread: the highest end of any allocation so far, bytes allocated in all
        self._allocated_end = 0
        self._allocated_total = 0
        self._busy_until = 0.0  # monotonic time before which the prefault thread waits (defer_prefault)
        self._lock = threading.Lock()
        if prefault and not pin_memory and (limit := self._prefault_limit()):
            self._prefaulter = _Prefaulter(self, limit)
            weakref.finalize(self, self._prefaulter.stop)

    def _prefault_limit(self) -> int:
        """How much to commit ahead: all of it, as configured (LMCache allocates its whole tier at
        start too), unless that exceeds what the host or cgroup has available now: then only that
        much, so that committing ahead is never what runs the host out of memory. The rest then
        faults in on first use, as without prefaulting."""
        available = _available_bytes()
        if available is None or available >= self.capacity:
            return self.capacity
        logger.warning("CPU tier of %.2f GB exceeds the %.2f GB of memory available: committing only that much "
                       "ahead; the tier may not fit in memory", self.capacity / 1e9, available / 1e9)
        return available - available % mmap.PAGESIZE

    @property
    def prefaulted_bytes(self) -> int:
        """Bytes from offset 0 the prefault thread has passed (0 without one): committed by it, or
        skipped because stores had allocated them (their own writes commit those)."""
        return 0 if self._prefaulter is None else self._prefaulter.committed

    def defer_prefault(self, seconds: float, *, at_least: bool = False) -> None:
        """Committing ahead waits until `seconds` from now (replacing any earlier deferral; with
        `at_least`, only ever later). vLLM's worker defers it while a step computes: on 2 cores,
        committing a 4 GB tier beside the forward slowed the cold prefills of the first ~9 s after
        start from 2.4 s to 4-5 s. The engine defers it around its own stores and retrieves."""
        until = time.monotonic() + seconds
        self._busy_until = max(self._busy_until, until) if at_least else until

    def wait_prefault(self, timeout: float | None = None) -> bool:
        """Waits until committing ahead has ended (finished, stopped or failed); True when it has
        (at once where it never ran)."""
        return self._prefaulter is None or self._prefaulter.done.wait(timeout)

    def close(self) -> None:
        """Stops committing ahead (within one 2 MiB step, ~1 ms). The buffer stays usable. Idempotent."""
        if self._prefaulter is not None:
            self._prefaulter.stop()

    def _touch_free(self, start: int, end: int) -> None:
        """Writes one byte per page of [start, end) if that range is wholly free: without
        MADV_POPULATE_WRITE (kernels before 5.14) a write is the only way to commit a page, and a
        write must not land in a chunk someone may have filled. Allocated ranges are skipped (their
        owner's writes commit them). Under the lock, so no allocation takes the range meanwhile;
        _TOUCH_STEP keeps that short."""
        with self._lock:
            i = bisect.bisect_right(self._free, (start, self.capacity + 1)) - 1
            if i >= 0 and self._free[i][0] + self._free[i][1] >= end:
                self.buffer[start:end:mmap.PAGESIZE].fill_(0)

    @property
    def used_bytes(self) -> int:
        return self._used

    @property
    def free_bytes(self) -> int:
        return self.capacity - self._used

    def aligned_size(self, shape: tuple[int, ...] | torch.Size, dtype: torch.dtype) -> int:
        n = prod(shape) * dtype.itemsize
        return -(-n // self.alignment) * self.alignment

    def allocate(self, shape: tuple[int, ...] | torch.Size, dtype: torch.dtype, fmt: MemoryFormat) -> MemoryObj | None:
        """A MemoryObj of that shape, or None when no free range is large enough."""
        size = self.aligned_size(shape, dtype)
        if size == 0:
            raise ValueError(f"cannot allocate an empty chunk of shape {tuple(shape)}")
        with self._lock:
            for i, (off, free_size) in enumerate(self._free):
                if free_size >= size:
                    if free_size == size:
                        del self._free[i]
                    else:
                        self._free[i] = (off + size, free_size - size)
                    self._used += size
                    self._allocated_end = max(self._allocated_end, off + size)
                    self._allocated_total += size
                    break
            else:
                return None
        nbytes = prod(shape) * dtype.itemsize
        tensor = self.buffer[off:off + nbytes].view(dtype).view(tuple(shape))
        return MemoryObj(tensor, fmt, self, off, size)

    def _release(self, offset: int, size: int) -> None:
        with self._lock:
            i = bisect.bisect_left(self._free, (offset, 0))
            self._free.insert(i, (offset, size))
            # merge with the right neighbour, then the left one
            if i + 1 < len(self._free) and offset + size == self._free[i + 1][0]:
                self._free[i] = (offset, size + self._free[i + 1][1])
                del self._free[i + 1]
            if i > 0 and self._free[i - 1][0] + self._free[i - 1][1] == offset:
                self._free[i - 1] = (self._free[i - 1][0], self._free[i - 1][1] + self._free[i][1])
                del self._free[i]
            self._used -= size
