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
