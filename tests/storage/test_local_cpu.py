"""The CPU tier (LocalCPUBackend): LRU eviction that never takes a held chunk, its stats, remove,
clear and a duplicate put."""

import torch

from lmcache_triton.keys import CacheEngineKey
from lmcache_triton.storage.local_cpu import LocalCPUBackend
from lmcache_triton.storage.memory import MemoryFormat

F = MemoryFormat.KV_2LTD


def _key(i: int) -> CacheEngineKey:
    return CacheEngineKey("m", 1, 0, "bfloat16", "KV_2LTD", f"{i:032x}")


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
