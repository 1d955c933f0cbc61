"""The lmcache_triton_* metrics on a real scrape of the process's HTTP endpoint."""

import re
import socket
import urllib.request
from pathlib import Path

import torch

from lmcache_triton import LMCacheEngineBuilder, LMCacheEngineConfig, LMCacheEngineMetadata, create_gpu_connector
from lmcache_triton.observability import prometheus
from lmcache_triton.tools.testing import make_kv_caches, random_slot_mapping


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
    prometheus.export(engine, config.prometheus_port)  # what vLLM's worker does: the engine exports nothing itself
    try:
        caches = make_kv_caches("vllm_cpu", num_layers=2, num_blocks=8, block_size=16, num_kv_heads=2, head_size=32,
                                dtype=torch.float16)
        tokens = torch.arange(48)
        slots = random_slot_mapping(48, num_blocks=8, block_size=16)
        engine.store(tokens, kvcaches=caches, slot_mapping=slots)
        engine.lookup(tokens)
        engine.lookup(torch.arange(200, 232))  # a request that misses entirely: it never reaches retrieve
        engine.retrieve(tokens, kvcaches=caches, slot_mapping=slots)
        engine.retrieve(torch.arange(100, 148), kvcaches=caches, slot_mapping=slots)  # a miss
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    finally:
        LMCacheEngineBuilder.destroy("metrics")
    labels = {"model": "metrics/model", "rank": "0"}
    nbytes = 48 * metadata.bytes_per_token()
    assert _value(text, "lmcache_triton_stored_tokens_total", **labels) == 48
    assert _value(text, "lmcache_triton_stored_bytes_total", **labels) == nbytes
    assert _value(text, "lmcache_triton_lookup_requests_total", **labels) == 2
    assert _value(text, "lmcache_triton_lookup_misses_total", **labels) == 1
    assert _value(text, "lmcache_triton_lookup_tokens_total", **labels) == 80
    assert _value(text, "lmcache_triton_lookup_hit_tokens_total", **labels) == 48
    assert _value(text, "lmcache_triton_lookup_hit_ratio", **labels) == 0.6
    assert _value(text, "lmcache_triton_hit_tokens_total", **labels) == 48
    assert _value(text, "lmcache_triton_requested_tokens_total", **labels) == 96
    assert _value(text, "lmcache_triton_retrieved_bytes_total", **labels) == nbytes
    assert _value(text, "lmcache_triton_retrieve_hit_ratio", **labels) == 0.5
    assert _value(text, "lmcache_triton_retrieve_seconds_count", **labels) == 2
    assert _value(text, "lmcache_triton_retrieve_bytes_per_second_count", **labels) == 1, "a load of 0 bytes"
    assert _value(text, "lmcache_triton_store_refused_chunks_total", **labels) == 0
    assert _value(text, "lmcache_triton_usage_bytes", tier="cpu", **labels) > 0
    assert "lmcache_triton_hit_rate" not in text, "the retrieve-only hit rate read 1.0 on a workload of misses"


def _documented() -> set[str]:
    page = (Path(__file__).parents[2] / "docs" / "metrics.md").read_text()
    section = page.split("\n## The metrics\n", 1)[1].split("\n## ", 1)[0]
    return set(re.findall(r"^\| `(lmcache_triton_[a-z_]+)` \|", section, re.MULTILINE))  # the table's rows


def test_every_exported_metric_is_documented_in_the_docs_and_named_by_the_rules():
    from prometheus_client import REGISTRY, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from lmcache_triton.observability.prometheus import histograms

    histograms()  # registers the collector
    config = LMCacheEngineConfig.from_defaults(chunk_size=16, max_local_cpu_size=0.01)
    metadata = LMCacheEngineMetadata(model_name="metrics/names", world_size=1, worker_id=0, kv_dtype=torch.float16,
                                     kv_shape=(2, 2, 16, 2, 32))
    LMCacheEngineBuilder.get_or_create("metrics-names", config, metadata,
                                       create_gpu_connector(config, metadata, "vllm_cpu"))
    try:
        families = [f for f in text_string_to_metric_families(generate_latest(REGISTRY).decode())
                    if f.name.startswith("lmcache_triton_") and not f.name.endswith("_created")]
    finally:
        LMCacheEngineBuilder.destroy("metrics-names")
    exported = {f.name + ("_total" if f.type == "counter" else ""): f.type for f in families}
    documented = _documented()
    assert len(documented) > 20 and set(exported) == documented, "docs/metrics.md's table lists what is exported"
    units = ("_seconds", "_bytes", "_tokens", "_chunks", "_ratio", "_requests", "_per_second", "_per_token")
    states = {"lmcache_triton_tier_slow"}  # 0 or 1, unitless like Prometheus' own `up`
    for name, kind in exported.items():
        base = name.removesuffix("_total")
        assert (kind == "counter") == name.endswith("_total"), name
        assert kind == "counter" or base.endswith(units) or name in states, \
            f"{name}: a gauge or histogram names its unit"


def test_misses_by_reason_expired_leases_and_verify_reach_the_scrape_and_the_stats_command(capsys):
    import json

    from lmcache_triton.tools.cli import main

    port = _free_port()
    config = LMCacheEngineConfig.from_defaults(chunk_size=16, max_local_cpu_size=0.01, prometheus_port=port,
                                               reservation_lease_secs=0.05)
    metadata = LMCacheEngineMetadata(model_name="metrics/misses", world_size=1, worker_id=0, kv_dtype=torch.float16,
                                     kv_shape=(2, 2, 16, 2, 32))
    engine = LMCacheEngineBuilder.get_or_create("metrics-misses", config, metadata,
                                                create_gpu_connector(config, metadata, "vllm_cpu"))
    prometheus.export(engine, config.prometheus_port)
    url = f"http://127.0.0.1:{port}/metrics"
    try:
        caches = make_kv_caches("vllm_cpu", num_layers=2, num_blocks=8, block_size=16, num_kv_heads=2, head_size=32,
                                dtype=torch.float16)
        slots = random_slot_mapping(32, num_blocks=8, block_size=16)
        engine.store(torch.arange(32), kvcaches=caches, slot_mapping=slots)
        engine.lookup(torch.arange(1000, 1040))  # 32 never stored + 8 of a partial chunk
        assert engine.lookup(torch.arange(32), reserve=True, lookup_id="never-released") == 32
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
    assert _value(text, "lmcache_triton_expired_reservations_total", **labels) == 1
    assert _value(text, "lmcache_triton_held_chunks", **labels) == 0, "the scrape reaps expired leases"
    assert _value(text, "lmcache_triton_verify_checked_total", **labels) == 2
    assert _value(text, "lmcache_triton_verify_mismatch_total", **labels) == 0
    shown = json.loads(capsys.readouterr().out)["metrics/misses rank 0"]
    assert shown["miss_tokens"] == {"never_stored": 32.0, "partial_chunk": 8.0}
    assert shown["expired_reservations"] == 1.0


def test_disk_tier_errors_are_exported_as_disk_errors_not_remote(tmp_path):
    """A disk that fails its writes shows in lmcache_triton_disk_errors_total{tier=...}, and the
    remote errors counter (which once counted them) has no sample for the disk tier."""
    import shutil

    from prometheus_client import REGISTRY, generate_latest

    folder = tmp_path / "kv"
    config = LMCacheEngineConfig.from_defaults(chunk_size=16, max_local_cpu_size=0.01, local_disk=str(folder),
                                               max_local_disk_size=0.01)
    metadata = LMCacheEngineMetadata(model_name="metrics/disk", world_size=1, worker_id=0, kv_dtype=torch.float16,
                                     kv_shape=(2, 2, 16, 2, 32))
    engine = LMCacheEngineBuilder.get_or_create("metrics-disk", config, metadata,
                                                create_gpu_connector(config, metadata, "vllm_cpu"))
    prometheus.track(engine)
    try:
        shutil.rmtree(folder)
        folder.write_bytes(b"not a folder")  # every chunk write now fails (ENOTDIR)
        caches = make_kv_caches("vllm_cpu", num_layers=2, num_blocks=8, block_size=16, num_kv_heads=2, head_size=32,
                                dtype=torch.float16)
        engine.store(torch.arange(32), kvcaches=caches, slot_mapping=random_slot_mapping(32, num_blocks=8, block_size=16))
        engine.storage_manager.flush(10)
        text = generate_latest(REGISTRY).decode()
        labels = dict(model="metrics/disk", rank="0", tier="LocalDiskBackend")
        assert _value(text, "lmcache_triton_disk_errors_total", **labels) >= 1
        assert not re.search(r'lmcache_triton_remote_errors_total\{[^}]*model="metrics/disk"', text)
    finally:
        LMCacheEngineBuilder.destroy("metrics-disk")


def test_load_or_recompute_decisions_and_tier_estimates_reach_the_scrape_and_the_stats_command(tmp_path, capsys):
    """A real engine with a CPU and a disk tier: lookups decide to load (no estimate yet; then a
    prefill calibrated slow), to recompute (a prefill calibrated faster than the measured copy),
    and to skip a tier that missed its deadlines; the scrape counts each decision by reason, and
    carries the estimates the transfers left (the CPU tier's throughput from a retrieve of 96 KB,
    the disk's latency from its reads of 32 KB chunks: too small to say its throughput)."""
    import json

    from lmcache_triton.tools.cli import main

    port = _free_port()
    config = LMCacheEngineConfig.from_defaults(chunk_size=16, max_local_cpu_size=0.01, prometheus_port=port,
                                               local_disk=str(tmp_path / "kv"), max_local_disk_size=0.01)
    metadata = LMCacheEngineMetadata(model_name="metrics/decisions", world_size=1, worker_id=0,
                                     kv_dtype=torch.float16, kv_shape=(2, 2, 16, 2, 128))  # 2 KiB per token
    engine = LMCacheEngineBuilder.get_or_create("metrics-decisions", config, metadata,
                                                create_gpu_connector(config, metadata, "vllm_cpu"))
    prometheus.export(engine, config.prometheus_port)
    url = f"http://127.0.0.1:{port}/metrics"
    disk = "LocalDiskBackend"
    sm = engine.storage_manager
    try:
        caches = make_kv_caches("vllm_cpu", num_layers=2, num_blocks=8, block_size=16, num_kv_heads=2, head_size=128,
                                dtype=torch.float16)
        tokens = torch.arange(48)  # 3 chunks of 32 KiB
        slots = random_slot_mapping(48, num_blocks=8, block_size=16)
        engine.store(tokens, kvcaches=caches, slot_mapping=slots)
        sm.flush(10)
        assert engine.lookup(tokens) == 48  # load/unmeasured: no prefill estimate yet
        engine.prefill.calibrate(1.0)  # a second per token: any load is cheaper
        assert engine.lookup(tokens) == 48  # load/cheaper
        engine.retrieve(tokens, kvcaches=caches, slot_mapping=slots)  # measures the copy out of the CPU tier
        # ... and a slow one: a load within the policy's noise band (20 ms) counts as worth it even
        # against a free recompute, and the compiled CPU copy moves these 96 KiB in well under that
        sm.cpu_cost.observe_transfer(48 * 2048, 1.0)
        engine.prefill.calibrate(1e-15)  # recomputing is all but free
        assert engine.lookup(tokens) == 0  # recompute/recompute_cheaper
        engine.prefill.calibrate(1.0)
        sm.clear()  # only the disk keeps them now
        assert engine.lookup(tokens, reserve=True, lookup_id="from-disk") == 48  # load/unmeasured: disk never read
        engine.release_reservation("from-disk")
        sm.clear()
        for _ in range(2):  # what two loads cut short at their deadline tell the disk's estimate
            sm.cost_of(disk).deadline_missed()
        assert engine.lookup(tokens) == 0  # recompute/tier_slow
        text = urllib.request.urlopen(url, timeout=5).read().decode()
        assert main(["stats", url]) == 0
    finally:
        LMCacheEngineBuilder.destroy("metrics-decisions")
    labels = {"model": "metrics/decisions", "rank": "0"}
    decisions = {("load", "unmeasured"): (2, 96), ("load", "cheaper"): (1, 48),
                 ("recompute", "recompute_cheaper"): (1, 48), ("recompute", "tier_slow"): (1, 48)}
    for (decision, reason), (lookups, n) in decisions.items():
        assert _value(text, "lmcache_triton_load_decision_total", decision=decision, reason=reason, **labels) == lookups
        assert _value(text, "lmcache_triton_load_decision_tokens_total", decision=decision, reason=reason,
                      **labels) == n
    assert _value(text, "lmcache_triton_miss_tokens_total", reason="recompute_cheaper", **labels) == 96
    assert _value(text, "lmcache_triton_load_deadline_stops_total", **labels) == 0
    assert _value(text, "lmcache_triton_prefill_seconds_per_token", **labels) == 1.0
    assert _value(text, "lmcache_triton_tier_throughput_bytes_per_second", tier="cpu", **labels) > 0
    assert _value(text, "lmcache_triton_tier_latency_seconds", tier=disk, **labels) > 0
    assert 'lmcache_triton_tier_throughput_bytes_per_second{model="metrics/decisions",rank="0",tier="Local' \
        not in text, "no disk read was large enough to measure its throughput: no sample, not a 0"
    assert _value(text, "lmcache_triton_tier_slow", tier=disk, **labels) == 1
    assert _value(text, "lmcache_triton_tier_slow", tier="cpu", **labels) == 0
    assert _value(text, "lmcache_triton_tier_deadline_misses_total", tier=disk, **labels) == 2

    shown = json.loads(capsys.readouterr().out)["metrics/decisions rank 0"]["load_or_recompute"]
    assert shown["prefill_us_per_token"] == 1e6
    assert shown["decisions"] == {f"{d}/{r}": {"lookups": lookups, "tokens": n}
                                  for (d, r), (lookups, n) in decisions.items()}
    assert shown["deadline_stops"] == 0
    assert set(shown["tiers"]) == {"cpu", disk}
    assert shown["tiers"][disk]["slow"] is True and shown["tiers"][disk]["deadline_misses"] == 2
    assert shown["tiers"][disk]["latency_ms"] > 0 and shown["tiers"][disk]["throughput_MB_per_s"] is None
    assert shown["tiers"]["cpu"]["throughput_MB_per_s"] > 0 and shown["tiers"]["cpu"]["slow"] is False
