"""Our figures in vLLM's own metrics (vllm_stats.py, and the classes connector.py hands vLLM):
what a worker reports after each step from a real engine with a real disk tier, only what changed;
and, through vLLM's own classes, the payload's trip across processes, its sum over ranks, the log
line vLLM prints and the counters in vLLM's Prometheus registry with vLLM's labels.
The end-to-end check, a real vLLM server scraped by a real Prometheus, is
tests/e2e/test_openai_serve_e2e.py."""

from __future__ import annotations

import pickle

import pytest
import torch

from lmcache_triton import LMCacheEngineBuilder, LMCacheEngineConfig, LMCacheEngineMetadata, create_gpu_connector
from lmcache_triton.integration.vllm.specs import LMCacheConnectorMetadata
from lmcache_triton.integration.vllm.vllm_stats import SERIES, StatsTracker, summary
from lmcache_triton.storage.manager import CPU_TIER
from lmcache_triton.tools.testing import make_kv_caches, random_slot_mapping
from worker_stubs import worker

CHUNK, LAYERS, HEADS, HEAD = 64, 2, 2, 16
BLOCK, BLOCKS = 16, 40
GEO = dict(num_layers=LAYERS, num_blocks=BLOCKS, block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD,
           dtype=torch.bfloat16)
BYTES_PER_TOKEN = 2 * LAYERS * HEADS * HEAD * 2  # K and V, bf16
DISK = "LocalDiskBackend"


@pytest.fixture
def engine(tmp_path):
    config = LMCacheEngineConfig.from_defaults(chunk_size=CHUNK, max_local_cpu_size=0.01,
                                               local_disk=str(tmp_path / "disk"), max_local_disk_size=0.01)
    metadata = LMCacheEngineMetadata(model_name="stats/model", world_size=1, worker_id=0, kv_dtype=torch.bfloat16,
                                     kv_shape=(LAYERS, 2, CHUNK, HEADS, HEAD))
    yield LMCacheEngineBuilder.get_or_create("vllm-stats", config, metadata,
                                             create_gpu_connector(config, metadata, "vllm_cpu"))
    LMCacheEngineBuilder.destroy_all()


def _prompt(n: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(0, 1000, (n,), generator=g),
            random_slot_mapping(n, num_blocks=BLOCKS, block_size=BLOCK, generator=g),
            make_kv_caches("vllm_cpu", generator=g, **GEO))


def test_a_worker_reports_what_changed_since_its_last_report_and_nothing_when_nothing_did(engine):
    side = worker(LMCacheConnectorMetadata(), engine)
    tokens, slots, caches = _prompt(3 * CHUNK + 10, seed=1)
    assert side.take_stats() is None, "a fresh engine has nothing to report"

    assert engine.lookup(tokens) == 0  # cold: 3 chunks never stored, a partial chunk never will be
    assert engine.store(tokens, kvcaches=caches, slot_mapping=slots) == 3 * CHUNK
    engine.storage_manager.flush(timeout=10)
    first = side.take_stats()
    file_bytes = sum(n for _, n in engine.storage_manager.tiers[0].files())
    assert first["lookups"] == 1 and first["lookup_tokens"] == 3 * CHUNK + 10
    assert "lookup_hits" not in first and "hit_tokens" not in first, "what did not change is left out"
    assert first["miss_tokens"] == {"never_stored": 3 * CHUNK, "partial_chunk": 10}
    assert first["stored_tokens"] == 3 * CHUNK and "loaded_tokens" not in first
    assert first["store_bytes"] == {CPU_TIER: 3 * CHUNK * BYTES_PER_TOKEN, DISK: file_bytes}
    assert file_bytes > 3 * CHUNK * BYTES_PER_TOKEN, "the disk's bytes are its files': headers included"
    assert first["store_seconds"][CPU_TIER] > 0 and first["store_seconds"][DISK] > 0
    assert "load_bytes" not in first, "nothing was loaded"
    assert side.take_stats() is None, "a second report without new work is empty"

    # warm, with the chunks on the disk only: read into the CPU tier, then into vLLM's cache
    assert engine.storage_manager.clear() == 3
    assert engine.lookup(tokens, reserve=True, lookup_id="r") == 3 * CHUNK
    loaded = engine.retrieve(tokens, kvcaches=make_kv_caches("vllm_cpu", fill=0.0, **GEO), slot_mapping=slots)
    engine.release_reservation("r")
    assert int(loaded.sum()) == 3 * CHUNK
    second = side.take_stats()
    assert {k: second[k] for k in ("lookups", "lookup_hits", "lookup_tokens", "hit_tokens", "miss_tokens")} == {
        "lookups": 1, "lookup_hits": 1, "lookup_tokens": 3 * CHUNK + 10, "hit_tokens": 3 * CHUNK,
        "miss_tokens": {"partial_chunk": 10}}, "only the second lookup: the first was reported"
    assert second["loaded_tokens"] == 3 * CHUNK and "stored_tokens" not in second
    assert second["load_bytes"] == {CPU_TIER: 3 * CHUNK * BYTES_PER_TOKEN, DISK: file_bytes}
    assert second["load_seconds"][DISK] > 0 and second["load_seconds"][CPU_TIER] > 0
    assert "store_bytes" not in second


def test_only_rank_0_reports_requests_and_tokens_every_rank_its_bytes(engine):
    """Every rank looks up, loads and stores the same tokens (its own shard): summed over ranks,
    rank 0's requests and tokens count each once, every rank's bytes count all that moved."""
    tokens, slots, caches = _prompt(2 * CHUNK, seed=2)
    engine.lookup(tokens)
    engine.store(tokens, kvcaches=caches, slot_mapping=slots)
    engine.storage_manager.flush(timeout=10)
    rank0, rank1 = StatsTracker(0).take(engine), StatsTracker(1).take(engine)
    assert set(rank1) == {"store_bytes", "store_seconds"}
    assert rank1["store_bytes"] == rank0["store_bytes"]
    assert {"lookups", "lookup_tokens", "miss_tokens", "stored_tokens", "store_bytes"} <= set(rank0)


def test_the_summary_vllm_logs_reads_the_hit_rate_misses_and_traffic_per_tier():
    figures = {"lookups": 4, "lookup_hits": 2, "lookup_tokens": 2048, "hit_tokens": 1024,
               "miss_tokens": {"never_stored": 1000, "partial_chunk": 24}, "loaded_tokens": 1024,
               "load_bytes": {"cpu": 12 * 2**20, DISK: 6 * 2**20}, "load_seconds": {"cpu": 0.03, DISK: 0.5},
               "store_failures": {"cpu": 3}}
    assert summary(figures) == {
        "Lookups": 4, "Lookup hits": 2, "Hit tokens": 1024, "Lookup tokens": 2048, "Hit rate (%)": 50.0,
        "Missed tokens (never_stored)": 1000, "Missed tokens (partial_chunk)": 24, "Loaded tokens": 1024,
        "Loaded cpu (MiB)": 12.0, "Loaded cpu (s)": 0.03, f"Loaded {DISK} (MiB)": 6.0, f"Loaded {DISK} (s)": 0.5,
        "Store failures cpu": 3}
    assert summary({"store_bytes": {"cpu": 2**20}, "store_seconds": {"cpu": 0.25}}) == {
        "Stored cpu (MiB)": 1.0, "Stored cpu (s)": 0.25}, "a rank > 0's figures: no lookup part"


# ---- through vLLM's own classes ------------------------------------------------------------------
RANK0 = {"lookups": 2, "lookup_hits": 1, "lookup_tokens": 1200, "hit_tokens": 512,
         "miss_tokens": {"never_stored": 512, "partial_chunk": 176}, "loaded_tokens": 512,
         "load_bytes": {"cpu": 4096}, "load_seconds": {"cpu": 0.5}}
RANK1 = {"load_bytes": {"cpu": 4096}, "load_seconds": {"cpu": 0.25}, "store_failures": {DISK: 1}}


@pytest.fixture
def connector():
    pytest.importorskip("vllm")
    from vllm.v1.metrics.prometheus import unregister_vllm_metrics

    from lmcache_triton.integration.vllm.connector import LMCacheTritonConnectorV1
    from lmcache_triton.integration.vllm.plugin import register

    register()  # vLLM's factory finds the connector by name, as in a served vLLM
    unregister_vllm_metrics()
    yield LMCacheTritonConnectorV1
    unregister_vllm_metrics()


def test_the_payload_crosses_vllms_processes_and_sums_over_ranks(connector):
    from vllm.v1.engine import EngineCoreOutputs
    from vllm.v1.metrics.stats import SchedulerStats
    from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

    stats = connector.build_kv_connector_stats(RANK0)
    assert not stats.is_empty() and connector.build_kv_connector_stats(None).is_empty()
    worker_to_core = pickle.loads(pickle.dumps(stats))  # a ModelRunnerOutput from a worker process
    assert worker_to_core.data == RANK0
    # vLLM's executor sums the ranks' stats, the first rank's object accumulating
    summed = worker_to_core.aggregate(connector.build_kv_connector_stats(RANK1))
    assert summed.data["load_bytes"] == {"cpu": 8192} and summed.data["load_seconds"] == {"cpu": 0.75}
    assert summed.data["lookups"] == 2 and summed.data["store_failures"] == {DISK: 1}
    assert RANK0["load_bytes"] == {"cpu": 4096}, "building from a payload copies it"
    # the engine core sends it to the API server inside its SchedulerStats, with msgpack
    wire = MsgpackEncoder().encode(EngineCoreOutputs(scheduler_stats=SchedulerStats(kv_connector_stats=summed.data)))
    assert MsgpackDecoder(EngineCoreOutputs).decode(wire).scheduler_stats.kv_connector_stats == summed.data
    summed.reset()
    assert summed.is_empty()


def test_vllm_logs_one_line_per_interval_summed_over_its_steps(connector):
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorLogging

    logging = KVConnectorLogging(KVTransferConfig(kv_connector="LMCacheTritonConnectorV1", kv_role="kv_both"))
    logging.observe(RANK0)
    logging.observe(RANK0)
    lines = []
    logging.log(log_fn=lambda fmt, *args: lines.append(fmt % args))
    assert lines == ["KV Transfer metrics: Lookups=4, Lookup hits=2, Hit tokens=1024, Lookup tokens=2400, "
                     "Hit rate (%)=42.7, Missed tokens (never_stored)=1024, Missed tokens (partial_chunk)=352, "
                     "Loaded tokens=1024, Loaded cpu (MiB)=0.008, Loaded cpu (s)=1.0"]
    logging.log(log_fn=lines.append)
    assert len(lines) == 1, "nothing new, no line"


def test_vllms_prometheus_logger_counts_the_figures_with_its_labels(connector):
    from types import SimpleNamespace

    from prometheus_client import REGISTRY
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorProm

    # as vLLM's PrometheusStatLogger builds it: labels model_name and engine, one value list per engine
    config = SimpleNamespace(kv_transfer_config=KVTransferConfig(kv_connector="LMCacheTritonConnectorV1",
                                                                 kv_role="kv_both"))
    prom = KVConnectorProm(config, ["model_name", "engine"], {0: ["tiny", "0"], 1: ["tiny", "1"]})
    prom.observe(RANK0, engine_idx=1)
    prom.observe(RANK1, engine_idx=1)
    prom.observe({"lookups": 1}, engine_idx=0)

    def value(series: str, **labels) -> float | None:
        return REGISTRY.get_sample_value(f"vllm:lmcache_triton_{series}_total",
                                         {"model_name": "tiny", "engine": "1", **labels})

    assert value("lookups") == 2 and value("lookups", engine="0") == 1
    assert value("hit_tokens") == 512 and value("lookup_tokens") == 1200 and value("loaded_tokens") == 512
    assert value("miss_tokens", reason="partial_chunk") == 176
    assert value("load_bytes", tier="cpu") == 8192 and value("load_seconds", tier="cpu") == 0.75
    assert value("store_failures", tier=DISK) == 1
    assert value("stored_tokens") is None, "a figure never reported has no series yet"
    names = {m.name for m in REGISTRY.collect()}
    assert {f"vllm:lmcache_triton_{s.key}" for s in SERIES} <= names
    prom.observe({"lookups": 1, "no_such_figure": 5, "miss_tokens": 3}, engine_idx=1)  # never raises
    assert value("lookups") == 3
