"""The memory pool (TensorMemoryPool, MemoryObj's holds) and its pinned host buffer."""

import pytest
import torch

from lmcache_triton.storage.memory import MemoryFormat, TensorMemoryPool

F = MemoryFormat.KV_2LTD


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
