"""vLLM's KV events for our tiers (integration/vllm/kv_events.py): the ledger that pairs the tiers'
key events with the blocks the scheduler names (no vLLM), and both sides over a real engine, where
the events must carry the request's own vLLM block hashes."""

from __future__ import annotations

import hashlib

import pytest
import torch

from lmcache_triton.integration.vllm.kv_events import (
    ChunkBlocks,
    KVEventLedger,
    SchedulerKVEvents,
    WorkerKVEvents,
)
from lmcache_triton.keys import CacheEngineKey
from lmcache_triton.storage.tier_events import REMOVED, STORED, TierEvent
from scheduler_stubs import BLOCK, CHUNK, prefill, request, scheduler
from worker_stubs import GEO, StubEngine, save
from worker_stubs import worker as stub_worker

TIERS = {"cpu": ("CPU", None), "LocalDiskBackend": ("STORAGE", "LOCAL"), "CacheServerBackend": ("STORAGE", "REMOTE")}


def _key(i: int, layer: int | None = None) -> CacheEngineKey:
    return CacheEngineKey("m", 1, 0, "bfloat16", "KV_2LTD", f"{i:032x}", layer_id=layer)


def _blocks(i: int) -> ChunkBlocks:
    return ChunkBlocks(block_hashes=(bytes([i, 0]), bytes([i, 1])), parent_block_hash=None, token_ids=tuple(range(4)),
                       block_size=2)


def _said(placements):
    return [(p.stored, p.blocks.block_hashes[0][0], p.medium, p.locality) for p in placements]


def test_a_store_is_announced_once_its_blocks_are_named_whichever_comes_first():
    ledger = KVEventLedger(TIERS)
    assert ledger.name(_key(1).chunk_hash, _blocks(1)) == []  # named, in no tier yet
    assert _said(ledger.apply([TierEvent(STORED, "cpu", _key(1))])) == [(True, 1, "CPU", None)]
    # stored before it is named (a promotion during a lookup): announced when the step names it
    assert ledger.apply([TierEvent(STORED, "LocalDiskBackend", _key(2))]) == []
    assert _said(ledger.name(_key(2).chunk_hash, _blocks(2))) == [(True, 2, "STORAGE", "LOCAL")]
    assert ledger.name(_key(2).chunk_hash, _blocks(2)) == [], "named again: nothing new"
    assert ledger.apply([TierEvent(STORED, "cpu", _key(1))]) == [], "a tier announces a chunk once"


def test_removals_are_announced_per_tier_for_announced_chunks_only():
    ledger = KVEventLedger(TIERS)
    ledger.name(_key(1).chunk_hash, _blocks(1))
    ledger.apply([TierEvent(STORED, "cpu", _key(1)), TierEvent(STORED, "CacheServerBackend", _key(1))])
    assert _said(ledger.apply([TierEvent(REMOVED, "cpu", _key(1))])) == [(False, 1, "CPU", None)]
    assert ledger.apply([TierEvent(REMOVED, "cpu", _key(1))]) == [], "gone already"
    assert ledger.apply([TierEvent(REMOVED, "LocalDiskBackend", _key(1))]) == [], "never there"
    assert _said(ledger.apply([TierEvent(REMOVED, "CacheServerBackend", _key(1))])) == [
        (False, 1, "STORAGE", "REMOTE")]
    # in no tier now; stored again later: announced again
    assert _said(ledger.apply([TierEvent(STORED, "cpu", _key(1))])) == [(True, 1, "CPU", None)]
    # a key nobody named that came and went: nothing, and nothing waits for it
    assert ledger.apply([TierEvent(STORED, "cpu", _key(9)), TierEvent(REMOVED, "cpu", _key(9))]) == []
    assert ledger.name(_key(9).chunk_hash, _blocks(9)) == []


def test_layerwise_chunks_are_announced_by_layer_zero_and_unknown_tiers_ignored():
    ledger = KVEventLedger(TIERS)
    ledger.name(_key(1).chunk_hash, _blocks(1))
    assert ledger.apply([TierEvent(STORED, "cpu", _key(1, layer=3))]) == []
    assert len(ledger.apply([TierEvent(STORED, "cpu", _key(1, layer=0))])) == 1
    assert ledger.apply([TierEvent(STORED, "SomeOtherTier", _key(1))]) == []


def test_what_waits_is_bounded():
    ledger = KVEventLedger(TIERS, limit=4)
    for i in range(10):
        ledger.name(_key(i).chunk_hash, _blocks(i))
        ledger.apply([TierEvent(STORED, "LocalDiskBackend", _key(100 + i))])
    assert ledger.apply([TierEvent(STORED, "cpu", _key(0))]) == [], "the oldest names were forgotten"
    assert len(ledger.apply([TierEvent(STORED, "cpu", _key(9))])) == 1


# ---- both sides, a real engine, vLLM's event classes -----------------------------------------------
def _vllm_hashes(tokens: list[int]) -> list[bytes]:
    """Stand-ins for vLLM's block hashes: a chain over each full block's tokens."""
    out, prev = [], b""
    for b in range(len(tokens) // BLOCK):
        prev = hashlib.sha256(prev + bytes(str(tokens[b * BLOCK:(b + 1) * BLOCK]), "ascii")).digest()
        out.append(prev)
    return out


def test_both_sides_announce_the_requests_own_block_hashes_and_withdraw_evicted_chunks(closing):
    pytest.importorskip("vllm", reason="the events are vLLM's msgspec classes")
    from vllm.distributed.kv_events import BlockRemoved, BlockStored

    from lmcache_triton import LMCacheEngineMetadata, create_gpu_connector
    from lmcache_triton.engine.engine import LMCacheEngine
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash
    from worker_stubs import config

    cfg = config(save_unfull_chunk=True)
    metadata = LMCacheEngineMetadata(model_name="glue/model", world_size=1, worker_id=0, kv_dtype=torch.bfloat16,
                                     kv_shape=(2, 2, CHUNK, 2, 16))
    engine = LMCacheEngine(cfg, metadata, create_gpu_connector(cfg, metadata, "vllm_cpu"))
    closing.append(engine)
    n = 3 * CHUNK + BLOCK + 5  # three chunks and a partial one: one full block of it
    sched = scheduler(hit=0, save_unfull_chunk=True)
    sched.kv_events = SchedulerKVEvents(CHUNK, BLOCK)
    first = request("r1", n=n)
    first.block_hashes = _vllm_hashes(first.all_token_ids)
    from lmcache_triton.tools.testing import make_kv_caches

    caches = make_kv_caches("vllm_cpu", generator=torch.Generator().manual_seed(0), **GEO)
    side = None
    for meta in prefill(sched, first, range(12), step=2 * CHUNK):
        assert all(r.chunk_blocks for r in meta.requests), "each step names the blocks of its chunks"
        if side is None:
            side = stub_worker(meta, StubEngine(), save_unfull_chunk=True)
            closing.append(side)
        side.parent.meta = meta
        side.engine, side.kvcaches = engine, caches
        if side.kv_events is None:
            side.kv_events = WorkerKVEvents(engine)
        side.before_step(meta)
        side.start_load_kv(None)
        save(side)
    events = side.take_kv_events()
    assert all(isinstance(e, BlockStored) and e.medium == "CPU" and e.block_size == BLOCK for e in events)
    per_chunk = CHUNK // BLOCK
    published = [maybe_convert_block_hash(h) for h in first.block_hashes]  # as vLLM publishes its own
    assert [e.block_hashes for e in events] == [published[0:2], published[2:4], published[4:6], published[6:7]], \
        "one event per chunk, its vLLM blocks; the partial chunk's full block only"
    assert [e.parent_block_hash for e in events] == [None] + [published[i * per_chunk - 1] for i in (1, 2, 3)]
    assert events[1].token_ids == first.all_token_ids[CHUNK:2 * CHUNK]
    assert side.take_kv_events() == [], "each event once"

    stored_keys = engine.storage_manager.cpu.keys()
    engine.storage_manager.remove(stored_keys[1])
    (removed,) = side.take_kv_events()
    assert isinstance(removed, BlockRemoved) and removed.medium == "CPU"
    assert removed.block_hashes in [e.block_hashes for e in events]

    # the scheduler hands vLLM's publisher what rank 0 reported, once
    from types import SimpleNamespace

    sched.kv_events.collect(SimpleNamespace(kv_cache_events=SimpleNamespace(get_all_events=lambda: events)))
    assert sched.kv_events.take() == events and sched.kv_events.take() == []
