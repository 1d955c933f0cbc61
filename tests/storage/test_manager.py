"""StorageManager over real tiers: CPU pool -> LocalDiskBackend (tmp_path) -> cache server subprocess."""

import time

import pytest
import torch

from lmcache_triton.config import LMCacheEngineConfig
from lmcache_triton.storage.manager import MISS_REMOTE, StorageManager

CPU_GB = 4 / 1024  # 4 MiB: room for hundreds of the 16 KiB chunks of `make_chunk`
DISK_GB = 4 / 1024


def _manager(kv_metadata, *, disk=None, remote=None, local_cpu=True, timeout=10.0) -> StorageManager:
    kwargs = dict(chunk_size=16, local_cpu=local_cpu, max_local_cpu_size=CPU_GB, blocking_timeout_secs=timeout)
    if disk is not None:
        kwargs.update(local_disk=str(disk), max_local_disk_size=DISK_GB)
    if remote is not None:
        kwargs.update(remote_url=remote)
    return StorageManager(LMCacheEngineConfig.from_defaults(**kwargs), kv_metadata, pin_memory=False)


@pytest.fixture
def managers():
    """Closes every manager a test makes, even when it fails."""
    made = []
    yield made
    for m in made:
        m.close()


def _put(manager, make_chunk, seed):
    """Puts chunk `seed` into `manager`; returns its key and a copy of its bytes."""
    obj, key = make_chunk(manager, seed)
    expected = obj.tensor.clone()
    manager.put(key, obj)
    return key, expected


def _disk(manager):
    return manager.tiers[0]


def test_write_through_to_disk_and_found_by_a_new_manager(kv_metadata, make_chunk, managers, tmp_path):
    first = _manager(kv_metadata, disk=tmp_path)
    managers.append(first)
    keys, expected = zip(*[_put(first, make_chunk, seed) for seed in range(3)])
    assert first.contains(list(keys), io=True, prefix=True) == 3, "a put is visible in the CPU tier at once"
    first.flush(timeout=10)
    assert all(_disk(first).contains(k) for k in keys), "flush() waits for the write-through to disk"
    assert first.cpu.num_held == 0, "finished writes leave nothing held"

    second = _manager(kv_metadata, disk=tmp_path)
    managers.append(second)
    assert len(second.cpu) == 0
    assert second.contains(list(keys), io=True, prefix=True) == 3
    assert second.contains(list(keys), io=True, prefix=False) == [True] * 3
    assert len(second.cpu) == 0, "contains without hold promotes nothing"
    obj = second.get(keys[1])
    assert obj is not None and torch.equal(obj.tensor.view(torch.uint8), expected[1].view(torch.uint8))
    assert second.cpu.keeps(keys[1], obj), "a disk hit is promoted into the CPU tier"
    second.release(keys[1], obj)
    assert second.cpu.contains(keys[1]) and not obj.is_held, "release keeps the promoted chunk resident"
    again = second.get(keys[1])
    assert again is obj, "the second get is served from the CPU tier"
    second.release(keys[1], again)
    assert second.cpu.num_held == 0


def test_prefix_count_stops_at_the_first_missing_chunk(kv_metadata, make_chunk, managers, tmp_path):
    m = _manager(kv_metadata, disk=tmp_path)
    managers.append(m)
    keys = [_put(m, make_chunk, seed)[0] for seed in range(4)]
    m.flush(timeout=10)
    m.cpu.remove(keys[1])  # only on disk now
    m.remove(keys[2])      # nowhere
    assert m.contains(keys, io=True, prefix=True) == 2
    assert m.contains(keys, io=True, prefix=False) == [True, True, False, True]


def test_without_local_cpu_the_pool_only_stages(kv_metadata, make_chunk, managers, tmp_path):
    m = _manager(kv_metadata, disk=tmp_path, local_cpu=False)
    managers.append(m)
    keys, expected = zip(*[_put(m, make_chunk, seed) for seed in range(3)])
    m.flush(timeout=10)
    assert m.cpu.used_bytes == 0 and len(m.cpu) == 0, "written chunks leave the CPU pool"
    assert m.contains(list(keys), io=True, prefix=True) == 3
    obj = m.get(keys[2])
    assert obj is not None and torch.equal(obj.tensor.view(torch.uint8), expected[2].view(torch.uint8))
    assert m.cpu.used_bytes > 0 and len(m.cpu) == 0, "staged for the caller, kept in no tier"
    m.release(keys[2], obj)
    assert m.cpu.used_bytes == 0, "release frees a chunk that no tier keeps"


def test_held_contains_promotes_disk_chunks_until_released(kv_metadata, make_chunk, managers, tmp_path):
    first = _manager(kv_metadata, disk=tmp_path)
    managers.append(first)
    keys = [_put(first, make_chunk, seed)[0] for seed in range(3)]
    first.flush(timeout=10)
    second = _manager(kv_metadata, disk=tmp_path)
    managers.append(second)
    held: list = []
    assert second.contains(keys, io=True, prefix=True, hold_into=held) == 3
    assert [k for k, _ in held] == keys
    assert len(second.cpu) == 3 and second.cpu.num_held == 3, "promoted and held for the coming load"
    assert second.clear() == 0, "held chunks cannot be dropped"
    for k, obj in held:
        second.release(k, obj)
    assert second.cpu.num_held == 0
    assert second.clear() == 3


def test_close_drains_pending_writes_and_is_idempotent(kv_metadata, make_chunk, tmp_path):
    m = _manager(kv_metadata, disk=tmp_path)
    keys = [_put(m, make_chunk, seed)[0] for seed in range(8)]
    m.close()  # no flush before: close itself must wait for the writes
    m.close()
    again = _manager(kv_metadata, disk=tmp_path)
    try:
        assert again.contains(keys, io=True, prefix=False) == [True] * 8
    finally:
        again.close()
        again.close()


def test_remote_write_through_and_a_dead_server(kv_metadata, make_chunk, managers, cache_server):
    timeout = 1.0
    first = _manager(kv_metadata, remote=cache_server.url, timeout=timeout)
    managers.append(first)
    key, expected = _put(first, make_chunk, 1)
    first.flush(timeout=10)
    assert first.tiers[0].contains(key), "written through to the cache server"

    second = _manager(kv_metadata, remote=cache_server.url, timeout=timeout)
    managers.append(second)
    assert second.contains([key], io=True, prefix=True) == 1
    obj = second.get(key)
    assert obj is not None and torch.equal(obj.tensor.view(torch.uint8), expected.view(torch.uint8))
    second.release(key, obj)
    second.cpu.remove(key)  # the next questions must go to the (dead) remote

    cache_server.kill()
    for ask in (lambda: second.contains([key], io=True, prefix=True), lambda: second.get(key)):
        t0 = time.monotonic()
        assert not ask(), "a dead remote is a miss"
        assert time.monotonic() - t0 < timeout + 1.5
    other, other_key = make_chunk(second, 2)
    second.put(other_key, other)  # must not raise
    t0 = time.monotonic()
    second.close()
    assert time.monotonic() - t0 < 2 * timeout + 3, "close() drains without hanging on the dead remote"
    assert second.cpu.used_bytes == 0


def test_held_contains_without_local_cpu_leaks_nothing(kv_metadata, make_chunk, managers, tmp_path):
    m = _manager(kv_metadata, disk=tmp_path, local_cpu=False)
    managers.append(m)
    keys = [_put(m, make_chunk, seed)[0] for seed in range(3)]
    m.flush(timeout=10)
    held: list = []
    assert m.contains(keys, io=True, prefix=True, hold_into=held) == 3
    for k, obj in held:
        m.release(k, obj)
    assert m.cpu.used_bytes == 0, "with local_cpu off, a reservation must not strand staged chunks in the pool"


def test_without_local_cpu_the_load_after_a_held_lookup_reads_memory_not_the_disk(kv_metadata, make_chunk,
                                                                                     managers, tmp_path):
    m = _manager(kv_metadata, disk=tmp_path, local_cpu=False)
    managers.append(m)
    puts = [_put(m, make_chunk, seed) for seed in range(2)]
    m.flush(timeout=10)
    held: list = []
    assert m.contains([k for k, _ in puts], io=True, prefix=True, hold_into=held) == 2
    for f in tmp_path.rglob("*.safetensors"):
        f.unlink()  # the disk is gone: the load must not need it
    for key, expected in puts:
        obj = m.get(key)
        assert obj is not None and torch.equal(obj.tensor, expected)
        m.release(key, obj)
    for key, obj in held:
        m.release(key, obj)
    assert m.cpu.used_bytes == 0 and m.get(puts[0][0]) is None


def test_contains_asks_memory_or_every_tier_and_counts_a_prefix_or_each_key(kv_metadata, make_chunk, managers,
                                                                              tmp_path, cache_server):
    """One key in each place: the CPU tier (and below), the disk only, the remote only, nowhere, the
    CPU tier again. io=False answers from memory (the CPU tier, the disk's index), never the remote;
    io=True asks the remote too; prefix counts up to the first miss; hold_into holds the counted
    chunks until each is released."""
    timeout = 1.0
    m = _manager(kv_metadata, disk=tmp_path, remote=cache_server.url, timeout=timeout)
    managers.append(m)
    disk, remote = m.tiers
    keys = [_put(m, make_chunk, seed)[0] for seed in range(5)]
    m.flush(timeout=10)
    m.cpu.remove(keys[1])                                        # disk (and remote)
    m.cpu.remove(keys[2])
    disk.remove(keys[2])                                         # remote only
    m.remove(keys[3])                                            # nowhere
    assert remote.contains(keys[2]) and not disk.contains(keys[2])

    assert m.contains(keys, io=False, prefix=False) == [True, True, False, False, True]
    assert m.contains(keys, io=False, prefix=True) == 2
    assert m.contains(keys, io=True, prefix=False) == [True, True, True, False, True]
    assert m.contains(keys, io=True, prefix=True) == 3
    assert len(m.cpu) == 2 and m.cpu.num_held == 0, "asking without hold_into promotes and holds nothing"

    held: list = []
    assert m.contains(keys, io=True, prefix=True, hold_into=held) == 3
    assert [k for k, _ in held] == keys[:3]
    assert all(m.cpu.keeps(k, obj) for k, obj in held), "disk and remote hits are promoted into the CPU tier"
    assert m.cpu.num_held == 3 and m.clear() == 1, "held hits stay for the load; only the unheld chunk goes"
    for k, obj in held:
        m.release(k, obj)
    assert m.cpu.num_held == 0 and len(m.cpu) == 3, "released hits stay in the CPU tier, no longer held"

    for combination in (dict(io=False, prefix=True), dict(io=True, prefix=False), dict(io=False, prefix=False)):
        with pytest.raises(ValueError, match="hold_into"):
            m.contains(keys, hold_into=[], **combination)
    with pytest.raises(TypeError, match="sequence of keys"):
        m.contains(keys[0], io=True, prefix=True)

    m.clear()
    disk.remove(keys[1])  # keys[1] and keys[2] now on the remote only
    cache_server.kill()
    t0 = time.monotonic()
    assert m.contains(keys, io=False, prefix=False) == [True, False, False, False, True]
    assert m.contains(keys, io=False, prefix=True) == 1
    assert time.monotonic() - t0 < timeout / 2, "io=False never waits on the remote"
    assert m.contains(keys[1:], io=True, prefix=True) == 0
    assert m.miss_reason(keys[1]) == MISS_REMOTE, "a remote that cannot answer is the miss's reason"
