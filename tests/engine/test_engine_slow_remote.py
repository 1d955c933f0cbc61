"""A prompt split between the CPU tier and a real cache server behind a slow link (bench/slow_link.py):
the engine measures the link from its own write-through, then loads the CPU part only and leaves the
remote part to vLLM, and says so in its decision counters. Nothing about the link is told to the
engine: its estimate comes from the transfers it made."""

from __future__ import annotations

import pytest
import torch

from bench.slow_link import SlowLink
from lmcache_triton import LMCacheEngineBuilder, LMCacheEngineConfig, LMCacheEngineMetadata, create_gpu_connector
from lmcache_triton.keys import KeyScope
from lmcache_triton.tools.testing import make_kv_caches, random_slot_mapping

CHUNK = 256
LAYERS, HEADS, HEAD = 2, 2, 64
BLOCK, BLOCKS = 16, 72
N = 4 * CHUNK
GEO = dict(num_layers=LAYERS, num_blocks=BLOCKS, block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD,
           dtype=torch.bfloat16)
# 256 KiB a chunk: at 2 MiB/s plus 20 ms a round trip, ~150 ms to read; computing it: 2.6 ms
PER_TOKEN_S = 1e-5


@pytest.fixture
def engine_behind_slow_link(cache_server):
    with SlowLink(upstream=("127.0.0.1", cache_server.port), rtt_ms=20, bytes_per_s=2 << 20) as link:
        config = LMCacheEngineConfig.from_defaults(chunk_size=CHUNK, max_local_cpu_size=0.05,
                                                   remote_url=f"lm://127.0.0.1:{link.start()}",
                                                   blocking_timeout_secs=10,
                                                   # the decisions, not the deadline, are tested here: a
                                                   # loaded CI host must not stop the dear load early
                                                   load_deadline_factor=20.0)
        metadata = LMCacheEngineMetadata(model_name="test/model", world_size=1, worker_id=0,
                                         kv_dtype=torch.bfloat16, kv_shape=(LAYERS, 2, CHUNK, HEADS, HEAD))
        engine = LMCacheEngineBuilder.get_or_create("slow-remote", config, metadata,
                                                    create_gpu_connector(config, metadata, "vllm_cpu"))
        try:
            yield engine
        finally:
            LMCacheEngineBuilder.destroy_all()


def test_a_prompt_split_between_the_cpu_tier_and_a_slow_remote_loads_the_cpu_part_only(engine_behind_slow_link):
    engine = engine_behind_slow_link
    sm = engine.storage_manager
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 1000, (N,), generator=g)
    slots = random_slot_mapping(N, num_blocks=BLOCKS, block_size=BLOCK, generator=g)
    assert engine.store(tokens, kvcaches=make_kv_caches("vllm_cpu", generator=g, **GEO), slot_mapping=slots) == N
    sm.flush(timeout=30)  # written through the slow link: what the engine knows of it
    remote = sm.tiers[0]
    assert remote.stats().put_failures == 0
    assert sm.costs()[remote.name].bytes_per_s < 8 << 20, "the write-through measured the link"
    keys = [key for _, _, key in engine.token_database.process_tokens(tokens, None, KeyScope())]
    for key in keys[2:]:  # the CPU tier keeps the first half only
        assert sm.cpu.remove(key)
    engine.prefill.calibrate(PER_TOKEN_S)

    assert engine.lookup(tokens, reserve=True, lookup_id="split") == 2 * CHUNK
    stats = engine.get_stats()
    assert stats.load_decisions == {"load/cheaper": 1, "recompute/recompute_cheaper": 1}
    assert stats.load_decision_tokens == {"load/cheaper": 2 * CHUNK, "recompute/recompute_cheaper": 2 * CHUNK}
    assert stats.miss_tokens.get("recompute_cheaper") == 2 * CHUNK
    assert remote.stats().hits == 0, "nothing was read over the slow link"
    assert sm.cpu.num_held == 2
    engine.release_reservation("split")
    assert sm.cpu.num_held == 0

    # The same prompt where computing is dear (a big model): the remote half is worth its ~300 ms
    # (at 10 ms a token, 5 s to compute: far from the margin even if a loaded host measured the link
    # at a third of its speed).
    engine.prefill.calibrate(1e-2)
    assert engine.lookup(tokens, reserve=True, lookup_id="dear") == N
    assert engine.get_stats().load_decisions["load/cheaper"] == 2
    assert remote.stats().hits == 2
    engine.release_reservation("dear")
    assert sm.cpu.num_held == 0
