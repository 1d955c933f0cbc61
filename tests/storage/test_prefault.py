"""The CPU tier's pool commits its pages ahead in a background thread (issue #14): it finishes, stops
on close, never changes a byte the request path wrote, and falls back where the kernel cannot."""

import gc
import logging
import sys
import threading

import pytest
import torch

from lmcache_triton.storage import memory
from lmcache_triton.storage.local_cpu import LocalCPUBackend
from lmcache_triton.storage.memory import MemoryFormat, TensorMemoryPool

F = MemoryFormat.KV_2LTD
MB = 1 << 20


def _thread(pool: TensorMemoryPool) -> threading.Thread:
    return pool._prefaulter._thread


def _smaps(pool: TensorMemoryPool) -> tuple[str, int] | None:
    """Permissions and resident bytes of the mapping behind the pool's buffer, from /proc/self/smaps
    (Linux; None elsewhere)."""
    start = f"{pool.buffer.data_ptr():x}-"
    try:
        lines = open("/proc/self/smaps").read().splitlines()
    except OSError:
        return None
    for i, line in enumerate(lines):
        if line.startswith(start):
            rss = next(x for x in lines[i + 1:] if x.startswith("Rss:"))
            return line.split()[1], int(rss.split()[1]) * 1024
    return None


@pytest.fixture(params=["populate", "touch"])
def how(request, monkeypatch):
    """Both ways of committing: MADV_POPULATE_WRITE (Linux 5.14+), and writing one byte per free
    page where the kernel has no such advice."""
    if request.param == "touch":
        monkeypatch.setattr(memory, "_MADV_POPULATE_WRITE", None)
    elif memory._MADV_POPULATE_WRITE is None:
        pytest.skip("no MADV_POPULATE_WRITE on this platform")
    return request.param


def test_prefault_commits_the_whole_pool_and_its_thread_ends(how):
    pool = TensorMemoryPool(16 * MB + 512, pin_memory=False)
    assert pool.wait_prefault(timeout=30)
    assert pool.prefaulted_bytes == pool.capacity
    _thread(pool).join(timeout=5)
    assert not _thread(pool).is_alive()
    mapping = _smaps(pool)
    if mapping is not None:
        perms, rss = mapping
        assert perms == "rw-p", "a private mapping: MAP_SHARED would be shared memory, shared with forks"
        assert rss >= pool.capacity - 4096, "the pages must be resident before any store"
    pool.close()  # after the end: nothing to stop, no error


def test_close_stops_the_thread_midway(monkeypatch, how):
    monkeypatch.setattr(memory, "_PREFAULT_STEP", 64 << 10)
    monkeypatch.setattr(memory, "_TOUCH_STEP", 64 << 10)
    pool = TensorMemoryPool(256 * MB, pin_memory=False)
    pool.close()
    assert not _thread(pool).is_alive() and pool.wait_prefault(timeout=0)
    pool.close()  # idempotent
    obj = pool.allocate((MB,), torch.uint8, F)  # the buffer outlives the thread
    obj.tensor.fill_(7)
    assert int(obj.tensor.sum()) == 7 * MB


def test_backend_close_stops_its_pool_thread():
    be = LocalCPUBackend(64 * MB, pin_memory=False)
    be.close()
    assert not _thread(be.pool).is_alive()


def test_dropping_an_unclosed_pool_stops_its_thread(monkeypatch):
    monkeypatch.setattr(memory, "_PREFAULT_STEP", 64 << 10)
    pool = TensorMemoryPool(256 * MB, pin_memory=False)
    thread = _thread(pool)
    del pool
    gc.collect()
    thread.join(timeout=10)
    assert not thread.is_alive()


def test_bytes_are_exact_while_the_pool_is_being_committed(monkeypatch, how):
    """Allocate, fill, free and refill chunks while the thread runs over the same pages; every
    chunk reads back exactly what was written, also after the thread has passed."""
    monkeypatch.setattr(memory, "_PREFAULT_STEP", 256 << 10)  # a slow sweep, so the two overlap
    monkeypatch.setattr(memory, "_TOUCH_STEP", 64 << 10)
    pool = TensorMemoryPool(64 * MB, pin_memory=False)
    g = torch.Generator().manual_seed(0)
    base = torch.randint(0, 256, (300 * 1024 + 7,), dtype=torch.uint8, generator=g)
    kept = []
    for i in range(200):
        n = int(torch.randint(1, 300, (1,), generator=g)) * 1024 + 7
        obj = pool.allocate((n,), torch.uint8, F)
        if obj is None:
            break
        data = base[:n] + i  # distinct bytes per chunk (uint8 wraps)
        obj.tensor.copy_(data)
        kept.append((obj, data))
        if i % 3 == 0:  # free some, so later chunks reuse ranges the thread may be touching
            old, _ = kept.pop(0)
            old.free()
    assert pool.wait_prefault(timeout=60)
    assert all(torch.equal(obj.tensor, data) for obj, data in kept)
    for obj, _ in kept:
        obj.free()
    assert pool.used_bytes == 0


def test_touch_skips_allocated_ranges(monkeypatch):
    """Without MADV_POPULATE_WRITE a page is committed by writing to it: only where no chunk is."""
    monkeypatch.setattr(memory, "_MADV_POPULATE_WRITE", None)
    monkeypatch.setattr(memory, "_TOUCH_STEP", 64 << 10)
    pool = TensorMemoryPool(32 * MB, pin_memory=False)
    pool.close()  # stop the thread; drive the touch by hand
    obj = pool.allocate((MB,), torch.uint8, F)
    obj.tensor.fill_(0xAB)
    pool._touch_free(0, 2 * MB)           # overlaps the chunk: skipped
    pool._touch_free(MB, 2 * MB)          # free: touched
    assert bool((obj.tensor == 0xAB).all())


def test_an_old_kernel_falls_back_to_touching(monkeypatch):
    """A kernel before 5.14 answers MADV_POPULATE_WRITE with EINVAL; an unknown advice does too."""
    if not sys.platform.startswith("linux"):
        pytest.skip("Linux madvise semantics")
    monkeypatch.setattr(memory, "_MADV_POPULATE_WRITE", 12345)
    pool = TensorMemoryPool(8 * MB, pin_memory=False)
    assert pool.wait_prefault(timeout=30) and pool.prefaulted_bytes == pool.capacity


def test_a_pool_larger_than_free_memory_commits_only_what_is_available(monkeypatch, caplog):
    monkeypatch.setattr(memory, "_available_bytes", lambda: 4 * MB + 123)
    with caplog.at_level(logging.WARNING, logger="lmcache_triton"):
        pool = TensorMemoryPool(16 * MB, pin_memory=False)
    assert pool.wait_prefault(timeout=30) and pool.prefaulted_bytes == 4 * MB
    assert "exceeds" in caplog.text
    obj = pool.allocate((12 * MB,), torch.uint8, F)  # the whole tier is still usable
    obj.tensor.fill_(1)
    assert int(obj.tensor.sum()) == 12 * MB


def test_available_bytes_is_a_number_or_unknown():
    got = memory._available_bytes()
    assert got is None or got >= 0


def test_prefault_off_is_the_old_pool():
    pool = TensorMemoryPool(8 * MB, pin_memory=False, prefault=False)
    assert pool._prefaulter is None and pool.prefaulted_bytes == 0 and pool.wait_prefault(timeout=0)
    pool.close()
    obj = pool.allocate((1000,), torch.float32, F)
    obj.tensor.fill_(2.5)
    assert float(obj.tensor.sum()) == 2500.0


def test_the_thread_makes_way_for_stores_and_close_cuts_its_pause_short(monkeypatch):
    """An allocation pauses the thread (a store is writing); close() must not wait the pause out."""
    import time

    monkeypatch.setattr(memory, "_STORE_RATE", 1.0)     # any allocation: the longest pause
    monkeypatch.setattr(memory, "_MAX_PAUSE_S", 60.0)
    monkeypatch.setattr(memory, "_PREFAULT_STEP", 64 << 10)
    pool = TensorMemoryPool(256 * MB, pin_memory=False)  # ~4000 steps: far from done when it looks
    obj = pool.allocate((MB,), torch.uint8, F)
    time.sleep(0.05)
    assert not pool.wait_prefault(timeout=0.2), "paused while the store writes"
    t0 = time.monotonic()
    pool.close()
    assert time.monotonic() - t0 < 30 and not _thread(pool).is_alive()
    obj.free()


def test_committing_waits_while_the_host_computes(monkeypatch):
    """vLLM's worker defers committing ahead while a step runs: it competes with the forward for
    the cores. Deferred, the thread makes no progress; once the deferral lapses it finishes."""
    import time

    monkeypatch.setattr(memory, "_PREFAULT_STEP", 256 << 10)
    pool = TensorMemoryPool(128 * MB, pin_memory=False)
    pool.defer_prefault(30)
    time.sleep(0.1)              # a step already under way when deferred ends within ~1 ms
    before = pool.prefaulted_bytes
    time.sleep(0.5)
    assert pool.prefaulted_bytes == before < pool.capacity, "it committed while deferred"
    pool.defer_prefault(0)       # the step ended
    assert pool.wait_prefault(timeout=60) and pool.prefaulted_bytes == pool.capacity
    pool.close()
