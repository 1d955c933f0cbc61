"""StorageManager's loads in two steps (storage/manager.py): `locate_prefix` (where a prefix is,
reading nothing), `read_prefix` (reading the lower tiers' part, against a deadline), and the
background work around them: late reads released, `promote_later`, close with reads in flight.

Real tiers: the CPU pool, LocalDiskBackend in tmp_path, a cache server subprocess. A slow tier is
the real disk behind a `get` that waits (tests/slow_tier.py): a tier that slowed down mid-load."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

import pytest
import torch
from slow_tier import open_gates, slow_down, wait_until

from lmcache_triton.config import LMCacheEngineConfig
from lmcache_triton.keys import CacheEngineKey
from lmcache_triton.storage.manager import CPU_TIER, MISS_CORRUPT, MISS_REMOTE, Located, StorageManager

CPU_GB = 4 / 1024  # 4 MiB: room for hundreds of the 16 KiB chunks of `make_chunk`
DISK_GB = 4 / 1024
DEADLINE_S = 1.0  # ample for the two quick reads before the stall, on a busy host


def _manager(kv_metadata, *, disk=None, remote=None, local_cpu=True, timeout=10.0) -> StorageManager:
    kwargs = dict(chunk_size=16, local_cpu=local_cpu, max_local_cpu_size=CPU_GB, blocking_timeout_secs=timeout)
    if disk is not None:
        kwargs.update(local_disk=str(disk), max_local_disk_size=DISK_GB)
    if remote is not None:
        kwargs.update(remote_url=remote)
    return StorageManager(LMCacheEngineConfig.from_defaults(**kwargs), kv_metadata, pin_memory=False)


@pytest.fixture
def managers():
    """Makes managers and closes them after the test, even when it fails (slow tiers' gates opened first)."""
    made: list[StorageManager] = []

    def make(kv_metadata, **kw) -> StorageManager:
        m = _manager(kv_metadata, **kw)
        made.append(m)
        return m

    yield make
    for m in made:
        open_gates(m)
        m.close()


def _on_disk_only(m: StorageManager, make_chunk, seeds: Sequence[int]) -> tuple[list[CacheEngineKey], list]:
    """Puts chunks, waits for the disk to have them, and empties the CPU tier: keys, bytes."""
    keys, expected = [], []
    for seed in seeds:
        obj, key = make_chunk(m, seed)
        expected.append(obj.tensor.clone())
        m.put(key, obj)
        keys.append(key)
    m.flush(timeout=10)
    assert m.clear() == (len(seeds) if m.config.local_cpu else 0) and len(m.cpu) == 0 and m.cpu.used_bytes == 0
    return keys, expected


def _in_cpu_tier(m: StorageManager, make_chunk, n: int) -> list[CacheEngineKey]:
    """Puts chunks of seeds 0..n-1: their keys."""
    keys = []
    for seed in range(n):
        obj, key = make_chunk(m, seed)
        m.put(key, obj)
        keys.append(key)
    return keys


def _release(m: StorageManager, holds) -> None:
    for key, obj in holds:
        m.release(key, obj)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


# ---- locate_prefix ---------------------------------------------------------------------------------
def test_locate_holds_the_cpu_prefix_at_once_and_release_all_frees_only_what_no_tier_keeps(kv_metadata, make_chunk,
                                                                                           managers):
    """The CPU tier alone: locate_prefix holds the present prefix under one lock, up to the first
    absent key (a miss counted once). release_all ends every hold; an object the tier dropped while
    held goes back to the pool at its last release, one the tier keeps stays, one still held by
    another reader stays too."""
    m = managers(kv_metadata)
    keys = _in_cpu_tier(m, make_chunk, 4)
    m.cpu.remove(keys[2])
    misses = m.cpu.stats().misses
    held: list = []
    assert m.locate_prefix(keys, held) == Located(2)
    assert [k for k, _ in held] == keys[:2] and all(obj.is_held for _, obj in held)
    assert m.cpu.stats().misses == misses + 1
    used = m.cpu.used_bytes
    dropped, kept = held[0][1], held[1][1]
    m.cpu.remove(keys[0])                      # dropped while held: not freed yet
    assert m.cpu.used_bytes == used
    other = m.get_in_memory(keys[1])           # a second reader of the kept one
    m.release_all(held)
    assert not dropped.is_held and m.cpu.used_bytes < used, "the dropped chunk freed at its last release"
    assert kept.is_held, "still held by the second reader"
    assert m.cpu.contains(keys[1]) and other is kept
    m.release(keys[1], other)
    assert not kept.is_held and m.cpu.num_held == 0


@pytest.mark.slow
def test_locate_holds_the_cpu_part_and_names_the_lower_tiers_reading_nothing(kv_metadata, make_chunk, managers,
                                                                               tmp_path, cache_server):
    """One key in each place: the CPU tier (and below), the disk, the remote only, nowhere, the CPU
    tier again. locate_prefix holds the first, names the tiers of the next two, stops at the fourth."""
    m = managers(kv_metadata, disk=tmp_path, remote=cache_server.url, timeout=1.0)
    disk, remote = m.tiers
    keys, expected = [], []
    for seed in range(5):
        obj, key = make_chunk(m, seed)
        expected.append(obj.tensor.clone())
        m.put(key, obj)
        keys.append(key)
    m.flush(timeout=10)
    m.cpu.remove(keys[1])                    # disk (and remote)
    m.cpu.remove(keys[2])
    disk.remove(keys[2])                     # remote only
    m.remove(keys[3])                        # nowhere
    disk_hits, remote_hits = disk.stats().hits, remote.stats().hits

    held: list = []
    located = m.locate_prefix(keys, held)
    assert located == Located(1, [disk.name, remote.name]) and len(located) == 3
    assert [k for k, _ in held] == keys[:1] and held[0][1].is_held
    assert m.cpu.num_held == 1 and len(m.cpu) == 2, "the CPU part held; nothing read, nothing promoted"
    assert (disk.stats().hits, remote.stats().hits) == (disk_hits, remote_hits), "no lower tier read"
    assert remote.cost.latency_s is not None, "the remote's presence question measured its round trip"

    got: list = []
    assert m.read_prefix(keys[1:3], got) == (2, False)
    assert [k for k, _ in got] == keys[1:3], "read in order"
    assert all(m.cpu.keeps(k, obj) and obj.is_held for k, obj in got), "promoted into the CPU tier, held"
    assert all(_same(obj.tensor, expected[i + 1]) for i, (_, obj) in enumerate(got))
    _release(m, held + got)
    assert m.cpu.num_held == 0 and m.usage()[CPU_TIER].held_chunks == 0
    assert set(m.costs()) == {CPU_TIER, disk.name, remote.name}
    assert m.costs()[disk.name].samples >= 1 and m.costs()[remote.name].samples >= 2, "their reads measured them"

    cache_server.kill()
    m.cpu.remove(keys[2])  # on the (dead) remote only
    held = []
    assert len(m.locate_prefix(keys[2:3], held)) == 0 and held == []
    assert m.miss_reason(keys[2]) == MISS_REMOTE, "a remote that cannot answer is the miss's reason"


def test_locate_without_lower_tiers_and_with_everything_in_the_cpu_tier(kv_metadata, make_chunk, managers):
    m = managers(kv_metadata)
    keys = _in_cpu_tier(m, make_chunk, 3)
    held: list = []
    assert m.locate_prefix(keys, held) == Located(3)
    other = CacheEngineKey("test/model", 1, 0, "bfloat16", "KV_2LTD", "f" * 32)
    assert m.locate_prefix([other, *keys], held) == Located(0), "the prefix ends at the first missing key"
    assert m.cpu.num_held == 3
    _release(m, held)
    assert m.cpu.num_held == 0
    with pytest.raises(RuntimeError, match="no lower tier"):
        m.read_prefix(keys, [])
    assert m.read_prefix([], []) == (0, False)


# ---- read_prefix -----------------------------------------------------------------------------------
def test_read_stops_at_the_first_chunk_that_cannot_be_read_and_releases_those_after_it(kv_metadata, make_chunk,
                                                                                         managers, tmp_path):
    m = managers(kv_metadata, disk=tmp_path)
    keys, expected = _on_disk_only(m, make_chunk, range(4))
    held: list = []
    assert m.locate_prefix(keys, held).lower == [m.tiers[0].name] * 4
    m.tiers[0].remove(keys[1])  # gone between the question and the read
    got: list = []
    assert m.read_prefix(keys, got) == (1, False)
    assert [k for k, _ in got] == keys[:1] and _same(got[0][1].tensor, expected[0])
    assert m.miss_reason(keys[1]) == MISS_CORRUPT, "listed, then unreadable"
    assert wait_until(lambda: m.cpu.num_held == 1), "the reads after the failed one are released"
    _release(m, got)
    assert m.cpu.num_held == 0


@pytest.mark.parametrize("local_cpu", [pytest.param(True, id="local_cpu"), pytest.param(False, id="no-local_cpu")])
def test_a_deadline_stops_the_read_and_the_late_chunks_are_released_when_they_arrive(kv_metadata, make_chunk,
                                                                                       managers, tmp_path, local_cpu):
    """The tier slows down from the third chunk on: the read returns the first two at the deadline;
    the read on the wire then finishes in the background and is released there (with local_cpu its
    chunk stays in the CPU tier for the next request); the later chunks are never read (one read at
    a time, in order)."""
    m = managers(kv_metadata, disk=tmp_path, local_cpu=local_cpu)
    keys, expected = _on_disk_only(m, make_chunk, range(6))
    chunk_bytes = expected[0].numel() * expected[0].element_size()
    slow = slow_down(m, slow=keys[2:])
    got: list = []
    t0 = time.monotonic()
    assert m.read_prefix(keys, got, deadline=time.monotonic() + DEADLINE_S) == (2, True)
    assert time.monotonic() - t0 < 5, "the read waited far past its deadline"
    assert [k for k, _ in got] == keys[:2] and all(_same(o.tensor, e) for (_, o), e in zip(got, expected))

    slow.gate.set()  # the slow reads arrive
    if local_cpu:
        assert wait_until(lambda: m.cpu.contains(keys[2]) and m.cpu.num_held == 2), \
            "the late chunk lands in the CPU tier, released"
        late = m.get_in_memory(keys[2])
        assert late is not None and _same(late.tensor, expected[2])
        m.release(keys[2], late)
    else:
        assert wait_until(lambda: len(slow.reads) == 3 and m.cpu.used_bytes == 2 * chunk_bytes), \
            "the late chunk is freed: kept by no tier, held by nobody"
    time.sleep(0.2)
    assert slow.reads == keys[:3], "the chunks after the one on the wire at the deadline were never read"
    assert not any(m.cpu.contains(k) for k in keys[3:])
    _release(m, got)
    assert m.cpu.num_held == 0 and m.usage()[CPU_TIER].held_chunks == 0
    if not local_cpu:
        assert m.cpu.used_bytes == 0


def test_a_read_done_before_its_deadline_is_not_late(kv_metadata, make_chunk, managers, tmp_path):
    m = managers(kv_metadata, disk=tmp_path)
    keys, _ = _on_disk_only(m, make_chunk, range(3))
    got: list = []
    assert m.read_prefix(keys, got, deadline=time.monotonic() + 30) == (3, False)
    _release(m, got)
    assert m.cpu.num_held == 0 and len(m.cpu) == 3


def test_a_deadline_already_past_reads_nothing_and_leaks_nothing(kv_metadata, make_chunk, managers, tmp_path):
    m = managers(kv_metadata, disk=tmp_path)
    keys, _ = _on_disk_only(m, make_chunk, range(4))
    slow = slow_down(m, slow=keys)
    got: list = []
    assert m.read_prefix(keys, got, deadline=time.monotonic() - 1) == (0, True)
    slow.gate.set()
    assert wait_until(lambda: m.cpu.num_held == 0 and len(m.cpu) == len(slow.reads))
    assert got == []


# ---- promote_later ---------------------------------------------------------------------------------
def test_promote_later_queues_each_chunk_once_and_lands_it_unheld(kv_metadata, make_chunk, managers, tmp_path):
    m = managers(kv_metadata, disk=tmp_path)
    keys, expected = _on_disk_only(m, make_chunk, range(4))
    slow = slow_down(m, slow=keys)
    assert m.promote_later(keys) == 4
    assert m.promote_later(keys) == 0 and m.promote_later(keys[1:2]) == 0, "queued already"
    slow.gate.set()
    assert wait_until(lambda: all(m.cpu.contains(k) for k in keys) and not m._promoting)
    assert m.cpu.num_held == 0, "promoted for the next request, held by nobody"
    assert sorted(slow.reads, key=keys.index) == keys, "each chunk read once"
    assert m.promote_later(keys) == 0, "in the CPU tier already"
    obj = m.get_in_memory(keys[2])
    assert obj is not None and _same(obj.tensor, expected[2])
    m.release(keys[2], obj)


def test_promote_later_does_nothing_without_local_cpu_or_lower_tiers_or_after_close(kv_metadata, make_chunk,
                                                                                      managers, tmp_path):
    staging = managers(kv_metadata, disk=tmp_path / "a", local_cpu=False)
    keys = []
    for seed in range(2):
        obj, key = make_chunk(staging, seed)
        staging.put(key, obj)
        keys.append(key)
    staging.flush(timeout=10)
    assert staging.promote_later(keys) == 0 and staging.cpu.used_bytes == 0, "nothing stays in the CPU pool"
    assert managers(kv_metadata).promote_later(keys) == 0, "no lower tier"
    closed = managers(kv_metadata, disk=tmp_path / "b")
    closed.close()
    assert closed.promote_later(keys) == 0


def test_a_read_after_close_reads_nothing_and_does_not_raise(kv_metadata, make_chunk, managers, tmp_path):
    """A lookup still running while its engine closes (the lookup server's thread) reads nothing."""
    m = managers(kv_metadata, disk=tmp_path)
    keys, _ = _on_disk_only(m, make_chunk, range(2))
    m.close()
    got: list = []
    assert m.read_prefix(keys, got) == (0, False) and got == []


# ---- close -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("what", [pytest.param("read_prefix", id="a-load"),
                                  pytest.param("promote_later", id="promotions")])
def test_close_with_reads_in_flight_neither_hangs_nor_leaks(kv_metadata, make_chunk, managers, tmp_path, what):
    m = managers(kv_metadata, disk=tmp_path)
    keys, _ = _on_disk_only(m, make_chunk, range(6))
    slow = slow_down(m, slow=keys, delay_s=0.5)
    result: list = []
    errors: list = []

    def load() -> None:
        try:
            got: list = []
            result.append(m.read_prefix(keys, got))
            _release(m, got)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    loader = threading.Thread(target=load) if what == "read_prefix" else None
    if loader is not None:
        loader.start()
    else:
        assert m.promote_later(keys) == 6
    assert wait_until(lambda: len(slow.reads) >= 1)
    t0 = time.monotonic()
    m.close()
    assert time.monotonic() - t0 < 5, "close waited on more than the reads on the wire"
    if loader is not None:
        loader.join(5)
        assert not loader.is_alive() and not errors, errors
        (n, late), = result
        assert n < len(keys) and not late, "the queued reads were cancelled by the close"
    assert len(slow.reads) <= 2, "no queued read started after the close"
    assert not [t for t in threading.enumerate() if t.name.startswith("lmct-read") and t.is_alive()]
