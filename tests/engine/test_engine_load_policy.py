"""Load or recompute through a real engine (engine.py's lookup over load_policy.py): the CPU
connector, the CPU tier and a real disk tier in tmp_path. What a lookup reports, holds, reads and
counts when loading a hit is estimated slower than computing it, and when a lower tier's reads
run past their deadline (the disk behind a `get` that waits: tests/slow_tier.py)."""

from __future__ import annotations

import time

import pytest
import torch
from slow_tier import open_gates, slow_down, wait_until

from lmcache_triton import LMCacheEngineBuilder, LMCacheEngineConfig, LMCacheEngineMetadata, create_gpu_connector
from lmcache_triton.keys import KeyScope
from lmcache_triton.storage.manager import CPU_TIER
from lmcache_triton.storage.transfer_cost import SLOW_AFTER_MISSES
from lmcache_triton.tools.testing import make_kv_caches, random_slot_mapping

CHUNK = 256               # a chunk: 256 KiB, large enough that a read measures the disk's bytes
LAYERS, HEADS, HEAD = 2, 2, 64
BLOCK, BLOCKS = 16, 72
N = 4 * CHUNK
GEO = dict(num_layers=LAYERS, num_blocks=BLOCKS, block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD,
           dtype=torch.bfloat16)
CHUNK_BYTES = CHUNK * 2 * LAYERS * HEADS * HEAD * 2


@pytest.fixture(autouse=True)
def _destroy_engines():
    yield
    for instance in LMCacheEngineBuilder.instance_ids():
        open_gates(LMCacheEngineBuilder.get(instance).storage_manager)  # a failed test's reads end now
    LMCacheEngineBuilder.destroy_all()


def _stored(tmp_path, *, layerwise=False, instance="lp", **config):
    """An engine with a disk tier holding the 4 chunks of a prompt (written through, flushed):
    the engine, the prompt, and each chunk's storage keys (one, or one per layer)."""
    config = LMCacheEngineConfig.from_defaults(chunk_size=CHUNK, max_local_cpu_size=0.05, use_layerwise=layerwise,
                                               local_disk=str(tmp_path / instance), max_local_disk_size=0.05,
                                               **config)
    metadata = LMCacheEngineMetadata(model_name="test/model", world_size=1, worker_id=0, kv_dtype=torch.bfloat16,
                                     kv_shape=(LAYERS, 2, CHUNK, HEADS, HEAD))
    engine = LMCacheEngineBuilder.get_or_create(instance, config, metadata,
                                                create_gpu_connector(config, metadata, "vllm_cpu"))
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 1000, (N,), generator=g)
    slots = random_slot_mapping(N, num_blocks=BLOCKS, block_size=BLOCK, generator=g)
    assert engine.store(tokens, kvcaches=make_kv_caches("vllm_cpu", generator=g, **GEO), slot_mapping=slots) == N
    engine.storage_manager.flush(timeout=10)
    chunk_keys = [engine._object_keys(key) for _, _, key in engine.token_database.process_tokens(tokens, None,
                                                                                                   KeyScope())]
    assert len(chunk_keys) == 4
    return engine, tokens, chunk_keys


def _on_disk_only(engine, chunk_keys) -> None:
    for keys in chunk_keys:
        for key in keys:
            assert engine.storage_manager.cpu.remove(key)


def _disk(engine):
    return engine.storage_manager.tiers[0]


def _seed_disk(engine, seconds_per_chunk: float) -> None:
    """The disk's estimate as if its reads had each taken `seconds_per_chunk`."""
    for _ in range(20):
        _disk(engine).cost.observe_transfer(CHUNK_BYTES, seconds_per_chunk)


def test_a_cheap_prefill_makes_a_measured_lower_tier_hit_a_recompute(tmp_path):
    """First lookup: the disk never measured, so its chunks are loaded (reason "unmeasured"), and
    reading them measures it. With vLLM's prefill measured as nearly free, the next lookup of the
    same chunks on the disk loads none of them, and says why."""
    engine, tokens, chunk_keys = _stored(tmp_path)
    sm = engine.storage_manager
    _on_disk_only(engine, chunk_keys)
    assert engine.lookup(tokens, reserve=True, lookup_id="first") == N
    assert engine.get_stats().load_decisions == {"load/unmeasured": 1}
    assert sm.costs()[_disk(engine).name].bytes_per_s is not None, "the reads measured the disk"
    engine.release_reservation("first")
    _on_disk_only(engine, chunk_keys)
    hits = _disk(engine).stats().hits

    engine.prefill.calibrate(1e-12)
    _seed_disk(engine, 1.0)  # the disk measured slow (a read on this host takes too little to lose)
    assert engine.lookup(tokens, reserve=True, lookup_id="second") == 0
    stats = engine.get_stats()
    assert stats.load_decisions == {"load/unmeasured": 1, "recompute/recompute_cheaper": 1}
    assert stats.load_decision_tokens == {"load/unmeasured": N, "recompute/recompute_cheaper": N}
    assert stats.miss_tokens.get("recompute_cheaper") == N
    assert _disk(engine).stats().hits == hits and len(sm.cpu) == 0, "nothing read for a recompute"
    assert sm.cpu.num_held == 0
    engine.release_reservation("second")


@pytest.mark.parametrize("layerwise", [pytest.param(False, id="all-layers"), pytest.param(True, id="layerwise")])
def test_a_cpu_part_and_a_slow_disk_part_load_only_the_cpu_part(tmp_path, layerwise):
    engine, tokens, chunk_keys = _stored(tmp_path, layerwise=layerwise)
    sm = engine.storage_manager
    _on_disk_only(engine, chunk_keys[2:])
    _seed_disk(engine, 1.0)         # a second a chunk
    engine.prefill.calibrate(1e-5)  # 2.6 ms a chunk
    steps = len(chunk_keys[0])

    assert engine.lookup(tokens, reserve=True, lookup_id="r") == 2 * CHUNK
    stats = engine.get_stats()
    assert stats.load_decisions == {"load/cheaper": 1, "recompute/recompute_cheaper": 1}
    assert stats.load_decision_tokens == {"load/cheaper": 2 * CHUNK, "recompute/recompute_cheaper": 2 * CHUNK}
    assert stats.miss_tokens.get("recompute_cheaper") == 2 * CHUNK
    assert sm.cpu.num_held == 2 * steps, "the reservation holds the chosen chunks only"
    assert len(sm.cpu) == 2 * steps, "the disk's chunks were not read"
    engine.release_reservation("r")
    assert sm.cpu.num_held == 0

    assert engine.lookup(tokens) == 2 * CHUNK, "without a reservation: the same decision"
    assert sm.cpu.num_held == 0
    snap = engine.snapshot()
    assert set(snap.costs) == {CPU_TIER, _disk(engine).name}
    assert snap.prefill_seconds_per_token == pytest.approx(1e-5)


def test_the_chosen_cpu_part_is_loaded_and_the_copy_measures_the_cpu_tier(tmp_path):
    engine, tokens, chunk_keys = _stored(tmp_path)
    _on_disk_only(engine, chunk_keys[2:])
    _seed_disk(engine, 1.0)
    engine.prefill.calibrate(1e-5)
    assert engine.storage_manager.cpu_cost.samples == 0
    assert engine.lookup(tokens, reserve=True, lookup_id="r") == 2 * CHUNK
    g = torch.Generator().manual_seed(5)
    loaded = engine.retrieve(tokens[:2 * CHUNK], kvcaches=make_kv_caches("vllm_cpu", fill=0, **GEO),
                             slot_mapping=random_slot_mapping(2 * CHUNK, num_blocks=BLOCKS, block_size=BLOCK,
                                                              generator=g))
    engine.release_reservation("r")
    assert loaded.all()
    cpu = engine.storage_manager.costs()[CPU_TIER]
    assert cpu.samples == 1 and cpu.bytes_per_s is not None, "a copy out of the CPU tier feeds its estimate"
    assert engine.storage_manager.cpu.num_held == 0


def test_policy_always_loads_everything(tmp_path):
    engine, tokens, chunk_keys = _stored(tmp_path, load_policy="always")
    sm = engine.storage_manager
    _on_disk_only(engine, chunk_keys[2:])
    _seed_disk(engine, 1.0)
    engine.prefill.calibrate(1e-5)
    assert engine.lookup(tokens, reserve=True, lookup_id="r") == N
    stats = engine.get_stats()
    assert stats.load_decisions == {"load/policy_always": 1}
    assert stats.load_decision_tokens == {"load/policy_always": N}
    assert not stats.miss_tokens.get("recompute_cheaper")
    assert sm.cpu.num_held == 4 and len(sm.cpu) == 4, "the disk's chunks read into the CPU tier and held"
    engine.release_reservation("r")
    assert sm.cpu.num_held == 0 and len(sm.cpu) == 4


@pytest.mark.parametrize("limit", [pytest.param("lookup-deadline", id="the-callers-deadline"),
                                   pytest.param("load_deadline_ms", id="load_deadline_ms")])
def test_a_deadline_bounds_a_lookup_on_a_slow_tier(tmp_path, limit):
    """Chunk 0 in the CPU tier, chunk 1 on the disk, chunks 2 and 3 on a disk that stalls: the
    lookup answers with chunks 0 and 1 once the deadline passes, and the stalled reads, once they
    arrive, leave their chunks in the CPU tier, held by nobody."""
    config = dict(load_deadline_ms=1000) if limit == "load_deadline_ms" else {}
    engine, tokens, chunk_keys = _stored(tmp_path, **config)
    sm = engine.storage_manager
    _on_disk_only(engine, chunk_keys[1:])
    slow = slow_down(sm, [k for keys in chunk_keys[2:] for k in keys])
    deadline = time.monotonic() + 1.0 if limit == "lookup-deadline" else None  # ample for chunk 1's read

    t0 = time.monotonic()
    hit = engine.lookup(tokens, reserve=True, lookup_id="r", deadline=deadline)
    assert time.monotonic() - t0 < 5, "the lookup waited on the stalled reads"
    assert hit == 2 * CHUNK, "the prefix that arrived by the deadline"
    stats = engine.get_stats()
    assert stats.load_deadline_stops == 1
    assert stats.miss_tokens.get("load_deadline") == 2 * CHUNK
    assert stats.load_decisions == {"load/unmeasured": 1}, "the decision was to load; the deadline cut it"
    assert sm.costs()[slow.name].deadline_misses == 1 and not sm.costs()[slow.name].slow
    assert sm.cpu.num_held == 2
    engine.release_reservation("r")
    slow.gate.set()
    assert wait_until(lambda: sm.cpu.num_held == 0 and all(sm.cpu.contains(k) for k in chunk_keys[2])), \
        "the late chunk lands in the CPU tier, released"


def test_a_tier_that_keeps_missing_its_deadlines_is_skipped_and_its_chunks_promoted_for_later(tmp_path):
    engine, tokens, chunk_keys = _stored(tmp_path)
    sm = engine.storage_manager
    _on_disk_only(engine, chunk_keys[2:])
    slow = slow_down(sm, [k for keys in chunk_keys[2:] for k in keys])
    for i in range(SLOW_AFTER_MISSES):
        assert engine.lookup(tokens, reserve=True, lookup_id=f"r{i}", deadline=time.monotonic() + 0.2) == 2 * CHUNK
        engine.release_reservation(f"r{i}")
    assert engine.get_stats().load_deadline_stops == SLOW_AFTER_MISSES
    assert sm.costs()[slow.name].slow

    t0 = time.monotonic()
    assert engine.lookup(tokens, reserve=True, lookup_id="skip", deadline=time.monotonic() + 30) == 2 * CHUNK
    assert time.monotonic() - t0 < 5, "a tier marked slow is not waited on"
    stats = engine.get_stats()
    assert stats.load_decisions.get("recompute/tier_slow") == 1
    assert stats.load_decision_tokens.get("recompute/tier_slow") == 2 * CHUNK
    engine.release_reservation("skip")
    slow.gate.set()  # the disk is back: what was queued for it lands in the CPU tier
    assert wait_until(lambda: all(sm.cpu.contains(k) for keys in chunk_keys for k in keys) and sm.cpu.num_held == 0
                      and not sm._promoting)
    assert engine.lookup(tokens) == N, "the next request finds them all in the CPU tier"
