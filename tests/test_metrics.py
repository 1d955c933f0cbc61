"""The lmcache_triton_* metrics on a real scrape of the process's HTTP endpoint."""

import socket
import urllib.request

import torch

from lmcache_triton import LMCacheEngineBuilder, LMCacheEngineConfig, LMCacheEngineMetadata, create_gpu_connector
from lmcache_triton.testing import make_kv_caches, random_slot_mapping


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _value(text: str, name: str, **labels) -> float:
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name}{{{want}}} not in the scrape")


def test_metrics_scrape_reflects_engine_activity():
    port = _free_port()
    config = LMCacheEngineConfig.from_defaults(chunk_size=16, max_local_cpu_size=0.01, prometheus_port=port)
    metadata = LMCacheEngineMetadata(model_name="metrics/model", world_size=1, worker_id=0, kv_dtype=torch.float16,
                                     kv_shape=(2, 2, 16, 2, 32))
    engine = LMCacheEngineBuilder.get_or_create("metrics", config, metadata,
                                                create_gpu_connector(config, metadata, "vllm_cpu"))
    try:
        caches = make_kv_caches("vllm_cpu", num_layers=2, num_blocks=8, block_size=16, num_kv_heads=2, head_size=32,
                                dtype=torch.float16)
        tokens = torch.arange(48)
        slots = random_slot_mapping(48, num_blocks=8, block_size=16)
        engine.store(tokens, kvcaches=caches, slot_mapping=slots)
        engine.lookup(tokens)
        engine.retrieve(tokens, kvcaches=caches, slot_mapping=slots)
        engine.retrieve(torch.arange(100, 148), kvcaches=caches, slot_mapping=slots)  # a miss
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    finally:
        LMCacheEngineBuilder.destroy("metrics")
    labels = {"model": "metrics/model", "rank": "0"}
    assert _value(text, "lmcache_triton_stored_tokens_total", **labels) == 48
    assert _value(text, "lmcache_triton_hit_tokens_total", **labels) == 48
    assert _value(text, "lmcache_triton_requested_tokens_total", **labels) == 96
    assert _value(text, "lmcache_triton_hit_rate", **labels) == 0.5
    assert _value(text, "lmcache_triton_retrieve_seconds_count", **labels) == 2
    assert _value(text, "lmcache_triton_usage_bytes", tier="cpu", **labels) > 0


def test_misses_by_reason_expired_leases_and_verify_reach_the_scrape_and_the_stats_command(capsys):
    import json

    from lmcache_triton.cli import main

    port = _free_port()
    config = LMCacheEngineConfig.from_defaults(chunk_size=16, max_local_cpu_size=0.01, prometheus_port=port,
                                               pin_lease_secs=0.05)
    metadata = LMCacheEngineMetadata(model_name="metrics/misses", world_size=1, worker_id=0, kv_dtype=torch.float16,
                                     kv_shape=(2, 2, 16, 2, 32))
    engine = LMCacheEngineBuilder.get_or_create("metrics-misses", config, metadata,
                                                create_gpu_connector(config, metadata, "vllm_cpu"))
    url = f"http://127.0.0.1:{port}/metrics"
    try:
        caches = make_kv_caches("vllm_cpu", num_layers=2, num_blocks=8, block_size=16, num_kv_heads=2, head_size=32,
                                dtype=torch.float16)
        slots = random_slot_mapping(32, num_blocks=8, block_size=16)
        engine.store(torch.arange(32), kvcaches=caches, slot_mapping=slots)
        engine.lookup(torch.arange(1000, 1040))  # 32 never stored + 8 of a partial chunk
        assert engine.lookup(torch.arange(32), pin=True, lookup_id="never-released") == 32
        engine.verify(torch.arange(32), kvcaches=caches, slot_mapping=slots)
        import time

        time.sleep(0.1)  # past the lease
        text = urllib.request.urlopen(url, timeout=5).read().decode()
        assert main(["stats", url]) == 0
    finally:
        LMCacheEngineBuilder.destroy("metrics-misses")
    labels = {"model": "metrics/misses", "rank": "0"}
    assert _value(text, "lmcache_triton_miss_tokens_total", reason="never_stored", **labels) == 32
    assert _value(text, "lmcache_triton_miss_tokens_total", reason="partial_chunk", **labels) == 8
    assert _value(text, "lmcache_triton_expired_pin_leases_total", **labels) == 1
    assert _value(text, "lmcache_triton_pinned_chunks", **labels) == 0, "the scrape reaps expired leases"
    assert _value(text, "lmcache_triton_verify_checked_total", **labels) == 2
    assert _value(text, "lmcache_triton_verify_mismatch_total", **labels) == 0
    shown = json.loads(capsys.readouterr().out)["metrics/misses rank 0"]
    assert shown["miss_tokens"] == {"never_stored": 32.0, "partial_chunk": 8.0}
    assert shown["expired_pin_leases"] == 1.0
