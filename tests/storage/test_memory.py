import pytest
import torch

from lmcache_triton.storage.memory import MemoryFormat, TensorMemoryPool
from lmcache_triton.storage.local_cpu import LocalCPUBackend
from lmcache_triton.keys import CacheEngineKey

F = MemoryFormat.KV_2LTD


def _key(i: int) -> CacheEngineKey:
    return CacheEngineKey("m", 1, 0, "bfloat16", "KV_2LTD", f"{i:032x}")


def test_pool_is_bounded_and_coalesces():
    pool = TensorMemoryPool(4096, pin_memory=False, alignment=512)
    objs = [pool.allocate((512,), torch.uint8, F) for _ in range(8)]
    assert all(o is not None for o in objs) and pool.free_bytes == 0
    assert pool.allocate((1,), torch.uint8, F) is None
    for o in objs[2:5]:  # free a run of three neighbours in the middle
        o.free()
    big = pool.allocate((3 * 512,), torch.uint8, F)
    assert big is not None, "freed neighbours must coalesce into one range"
    assert big.tensor.data_ptr() == objs[2].tensor.data_ptr()


def test_pool_views_have_the_requested_shape_and_do_not_overlap():
    pool = TensorMemoryPool(1 << 16, pin_memory=False)
    a = pool.allocate((2, 3, 5, 7), torch.bfloat16, F)
    b = pool.allocate((2, 3, 5, 7), torch.bfloat16, F)
    assert a.shape == (2, 3, 5, 7) and a.dtype == torch.bfloat16 and a.num_tokens == 5
    a.tensor.fill_(1)
    b.tensor.fill_(2)
    assert torch.all(a.tensor == 1) and torch.all(b.tensor == 2)


def _backend(n_objs: int) -> LocalCPUBackend:
    return LocalCPUBackend(n_objs * 1024, pin_memory=False)


def _put(backend: LocalCPUBackend, i: int) -> bool:
    obj = backend.allocate((1024,), torch.uint8, F)
    if obj is None:
        return False
    obj.tensor.fill_(i % 256)
    backend.put(_key(i), obj)
    return True


def test_lru_evicts_the_oldest_chunk_not_held():
    be = _backend(3)
    for i in range(3):
        _put(be, i)
    obj = be.get(_key(0))  # touch 0: now 1 is the oldest
    obj.unhold()
    _put(be, 3)
    assert [be.contains(_key(i)) for i in range(4)] == [True, False, True, True]
    assert be.stats().evictions == 1
    s = be.stats()
    assert (s.chunks, s.used_bytes, s.capacity_bytes, s.held_chunks) == (3, 3 * 1024, 3 * 1024, 0)
    assert (s.puts, s.hits, s.misses, s.evictions, s.put_failures, s.errors, s.corrupt) == (4, 1, 0, 1, 0, 0, 0)


def test_held_chunk_is_never_evicted_and_a_tier_full_of_held_chunks_refuses():
    be = _backend(2)
    _put(be, 0)
    _put(be, 1)
    assert be.get(_key(0)) is not None  # held by a lookup
    _put(be, 2)
    assert be.contains(_key(0)) and not be.contains(_key(1)) and be.contains(_key(2))
    held = be.get(_key(2))  # now everything is held
    assert not _put(be, 3), "a tier full of held chunks refuses instead of evicting them"
    assert be.stats().put_failures == 1 and be.contains(_key(0)) and be.contains(_key(2))
    assert be.stats().put_failures == 1 and be.stats().held_chunks == 2
    assert torch.all(held.tensor == 2)
    held.unhold()
    assert _put(be, 3) and not be.contains(_key(2))


def test_remove_clear_and_duplicate_put():
    be = _backend(4)
    _put(be, 0)
    _put(be, 1)
    dup = be.allocate((1024,), torch.uint8, F)
    dup.tensor.fill_(99)
    assert not be.put(_key(0), dup)
    got = be.get(_key(0))
    assert torch.all(got.tensor == 0), "the first stored object wins"
    used = be.used_bytes
    assert be.remove(_key(0)) and not be.contains(_key(0)), "a removed key is gone for new readers at once"
    assert be.used_bytes == used and torch.all(got.tensor == 0), "its memory stays with its reader"
    got.unhold()
    got.free()  # what StorageManager.release does for an object no tier holds
    assert be.used_bytes < used
    assert be.clear() == 1 and len(be) == 0 and be.used_bytes == 0


def test_oversized_chunk_is_refused():
    be = _backend(1)
    assert be.allocate((4096,), torch.uint8, F) is None and be.stats().put_failures == 1


def test_unhold_without_hold_is_an_error():
    pool = TensorMemoryPool(1024, pin_memory=False)
    with pytest.raises(RuntimeError, match="not held"):
        pool.allocate((8,), torch.uint8, F).unhold()


def test_pinned_pool_without_cuda_is_a_clear_error():
    if torch.cuda.is_available():
        pytest.skip("this host has CUDA")
    with pytest.raises(ValueError, match="pinned host memory needs a CUDA device"):
        TensorMemoryPool(4096, pin_memory=True)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_pinned_pool_locks_exactly_its_size():
    """5 MiB + 512 B pinned: torch's host allocator would round it up to 8 MiB; the pool registers
    exactly its own buffer, which copies and kernels then use as pinned memory."""
    from lmcache_triton.storage.memory import pinned_buffer
    size = (5 << 20) + 512
    before = torch.cuda.host_memory_stats()["allocated_bytes.current"]
    pool = TensorMemoryPool(size)
    assert pool.buffer.is_pinned() and pool.buffer.numel() == size
    assert torch.cuda.host_memory_stats()["allocated_bytes.current"] == before  # not torch's allocator
    obj = pool.allocate((2, 3, 17, 64), torch.bfloat16, F)
    src = torch.randn(obj.shape, device="cuda").to(torch.bfloat16)
    obj.tensor.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(obj.tensor.cuda(), src)
    buf, registered = pinned_buffer(4096)
    assert buf.is_pinned() and registered == [buf.data_ptr()]
    torch.cuda.cudart().cudaHostUnregister(registered[0])


class _DriverWithALimit:
    """cudaHostRegister as a driver that refuses single registrations above `limit` bytes: the
    pieces' fallback is our logic, run here on any host (a real GPU's limit cannot be set)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.registered: dict[int, int] = {}

    def cudaHostRegister(self, ptr, size, flags):
        if size > self.limit:
            return 1
        self.registered[ptr] = size
        return 0

    def cudaHostUnregister(self, ptr):
        del self.registered[ptr]
        return 0

    def cudaGetErrorString(self, err):
        return "limit"


def test_pinned_buffer_registers_in_smaller_pieces_where_a_large_one_fails(monkeypatch):
    from lmcache_triton.storage import memory

    driver = _DriverWithALimit(limit=300 << 10)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: driver)
    monkeypatch.setattr(memory, "_REGISTER_CHUNK", 1 << 20)
    monkeypatch.setattr(memory, "_MIN_REGISTER_CHUNK", 64 << 10)
    size = (3 << 20) + 4096
    buf, registered = memory.pinned_buffer(size)
    assert buf.numel() == size and registered == sorted(driver.registered)
    assert sum(driver.registered.values()) == size, "every byte registered once"
    assert max(driver.registered.values()) == 256 << 10, "1 MiB pieces failed, then 256 KiB ones worked"
    driver.limit = 1 << 10  # no piece size works: torch's pinned allocator is the last resort
    monkeypatch.setattr(torch, "empty", lambda *a, pin_memory=False, **k: ("torch-pinned" if pin_memory else
                                                                           torch.zeros(*a, **k)))
    assert memory.pinned_buffer(size) == ("torch-pinned", [])
    assert sum(driver.registered.values()) == size, "the failed attempt left nothing registered"
