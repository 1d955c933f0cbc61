"""Chunk tensors (MemoryObj), their formats, and the bounded pool the CPU tier allocates from."""

from __future__ import annotations

import bisect
import logging
import threading
import weakref
from enum import Enum
from math import prod

import torch

logger = logging.getLogger("lmcache_triton")

# cudaHostRegister per call: large single registrations fail on recent drivers (LMCache#5177
# registers in chunks of at most 64 GiB for the same reason).
_REGISTER_CHUNK = 64 << 30


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
    except RuntimeError:
        pass


def pinned_buffer(nbytes: int) -> tuple[torch.Tensor, list[int]]:
    """A page-locked uint8 buffer of exactly `nbytes`, and the addresses registered for it.

    `torch.empty(..., pin_memory=True)` goes through torch's caching host allocator, which rounds
    every block up to a power of two: a 5 GB tier would lock 8 GiB (LMCache#1147, pytorch#150517).
    So: a plain host allocation registered with cudaHostRegister. Where registration fails (a
    driver limit, RLIMIT_MEMLOCK), fall back to torch's pinned allocation and say so.
    """
    if not torch.cuda.is_available():
        raise ValueError("pinned host memory needs a CUDA device; this host has none (pin_memory=False)")
    buf = torch.empty(nbytes, dtype=torch.uint8)
    cudart = torch.cuda.cudart()
    base, done = buf.data_ptr(), []
    for off in range(0, nbytes, _REGISTER_CHUNK):
        err = cudart.cudaHostRegister(base + off, min(_REGISTER_CHUNK, nbytes - off), 0)
        if int(err) != 0:
            _clear_last_cuda_error()
            _unregister(done)
            logger.warning("cudaHostRegister of %d bytes failed (%s); using torch's pinned allocator, "
                           "which rounds the CPU tier up to a power of two", nbytes,
                           cudart.cudaGetErrorString(err))
            return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True), []
        done.append(base + off)
    return buf, done


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
        """Bytes this object holds in its pool (its tensor, rounded up to the pool's alignment)."""
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
    Freed ranges coalesce with their neighbours.
    """

    def __init__(self, size_bytes: int, *, pin_memory: bool | None = None, alignment: int = 512) -> None:
        if size_bytes <= 0:
            raise ValueError(f"pool size_bytes must be positive, got {size_bytes}")
        if pin_memory is None:
            pin_memory = torch.cuda.is_available()
        self.alignment = alignment
        self.capacity = size_bytes - size_bytes % alignment
        if pin_memory:
            # Pinned, of exactly this size; unregistered when the pool (which every MemoryObj
            # references) is collected.
            self.buffer, registered = pinned_buffer(self.capacity)
            if registered:
                weakref.finalize(self, _unregister, registered)
        else:
            # torch.empty does not touch the pages on CPU: a 5 GB tier costs memory only as it fills.
            self.buffer = torch.empty(self.capacity, dtype=torch.uint8)
        self._free: list[tuple[int, int]] = [(0, self.capacity)]  # sorted (offset, size)
        self._used = 0
        self._lock = threading.Lock()

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
