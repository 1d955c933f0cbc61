"""What each tier reports it gained and lost (storage/tier_events.py), over real tiers: the CPU
pool, a disk folder. The publisher (vLLM's KV events) trusts these to announce and withdraw
placements: a store is reported once it is readable, every way a chunk leaves is reported."""

from __future__ import annotations

from lmcache_triton.config import LMCacheEngineConfig
from lmcache_triton.storage.manager import CPU_TIER, StorageManager
from lmcache_triton.storage.tier_events import REMOVED, STORED, TierEventLog

CHUNK_BYTES = 2 * 4 * 16 * 64 * 2  # make_chunk's [2, 4, 16, 64] bfloat16


def _manager(kv_metadata, tmp_path=None, cpu_chunks=64, disk_chunks=None):
    kw = dict(chunk_size=16, max_local_cpu_size=cpu_chunks * CHUNK_BYTES / (1 << 30))
    if disk_chunks is not None:
        kw.update(local_disk=str(tmp_path), max_local_disk_size=disk_chunks * (CHUNK_BYTES + 4096) / (1 << 30))
    return StorageManager(LMCacheEngineConfig.from_defaults(**kw), kv_metadata, pin_memory=False)


def _seen(log):
    return [(e.kind, e.tier, e.key.chunk_hash) for e in log.drain()]


def test_cpu_tier_reports_stores_evictions_removals_and_clears(kv_metadata, make_chunk, closing):
    m = _manager(kv_metadata, cpu_chunks=3)
    closing.append(m)
    log = m.watch()
    assert m.watch() is log, "one log per manager"
    keys = []
    for seed in range(2):
        obj, key = make_chunk(m, seed)
        m.put(key, obj)
        keys.append(key)
    obj, dup = make_chunk(m, 0)  # the same key again: nothing new is stored (key 0 is used again)
    m.put(dup, obj)
    obj, key = make_chunk(m, 2)
    m.put(key, obj)
    keys.append(key)
    assert _seen(log) == [(STORED, CPU_TIER, k.chunk_hash) for k in keys]
    obj, fourth = make_chunk(m, 3)  # no room: the least recently used (key 1) goes first
    m.put(fourth, obj)
    assert _seen(log) == [(REMOVED, CPU_TIER, keys[1].chunk_hash), (STORED, CPU_TIER, fourth.chunk_hash)]
    keys[0], keys[1] = keys[1], keys[0]
    assert m.remove(keys[1])
    assert not m.remove(keys[1])
    assert _seen(log) == [(REMOVED, CPU_TIER, keys[1].chunk_hash)]
    m.clear()
    assert sorted(_seen(log)) == sorted((REMOVED, CPU_TIER, k.chunk_hash) for k in (keys[2], fourth))


def test_disk_tier_reports_written_chunks_its_evictions_and_corrupt_files(kv_metadata, make_chunk, closing,
                                                                           tmp_path):
    m = _manager(kv_metadata, tmp_path, disk_chunks=2)
    closing.append(m)
    log = m.watch()
    disk = m.tiers[0].name
    keys = []
    for seed in range(3):
        obj, key = make_chunk(m, seed)
        m.put(key, obj)
        m.flush(timeout=10)  # one write at a time: the disk's LRU order is the put order
        keys.append(key)
    events = _seen(log)
    assert [e for e in events if e[1] == disk] == [
        (STORED, disk, keys[0].chunk_hash), (STORED, disk, keys[1].chunk_hash),
        (REMOVED, disk, keys[0].chunk_hash), (STORED, disk, keys[2].chunk_hash)]
    # a file that fails its checks is deleted when read: reported as gone
    path = m.tiers[0].path_for(keys[1])
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    m.cpu.remove(keys[1])
    log.drain()
    assert m.get(keys[1]) is None
    assert (REMOVED, disk, keys[1].chunk_hash) in _seen(log)


def test_a_failed_write_through_reports_nothing(kv_metadata, make_chunk, closing, tmp_path):
    m = _manager(kv_metadata, tmp_path, disk_chunks=2)
    closing.append(m)
    log = m.watch()
    m.tiers[0].capacity = 0  # no file ever fits: every write-through fails
    obj, key = make_chunk(m, 7)
    m.put(key, obj)
    m.flush(timeout=10)
    assert _seen(log) == [(STORED, CPU_TIER, key.chunk_hash)]


def test_a_full_log_drops_the_oldest_and_counts_them(kv_metadata, make_chunk):
    log = TierEventLog(limit=2)
    from lmcache_triton.keys import CacheEngineKey

    keys = [CacheEngineKey("m", 1, 0, "bfloat16", "KV_2LTD", f"{i:032x}") for i in range(3)]
    for k in keys:
        log.add(STORED, CPU_TIER, k)
    assert [e.key for e in log.drain()] == keys[1:] and log.dropped == 1
