"""vLLM with LMCacheTritonConnectorV1: loads instead of recomputes, with identical outputs.

Greedy sampling, vLLM's own prefix cache off, a tiny random Llama (2 layers, head_dim 32) with
vLLM's CPU block size 128 and lmcache chunk 256. `cached` is vLLM's RequestOutput.num_cached_tokens:
with the prefix cache off, every cached token was loaded through the connector.
"""

import os
import re
import signal
import subprocess
import sys
import time

import pytest

from lmcache_triton.tools.models import random_prompt

pytestmark = pytest.mark.slow

P = random_prompt(600, seed=1)            # 2 whole chunks (512 tokens) + a partial one
Q = P[:300] + random_prompt(300, seed=2)  # shares one whole chunk (256 tokens) with P


@pytest.fixture(scope="module")
def run_vllm(run_vllm_in_process):
    """Engine core in process (half the start time); test_second_request_loads_and_outputs_match
    keeps vLLM's default multiprocess engine, as deployed."""
    return run_vllm_in_process


@pytest.fixture(scope="module")
def baseline(run_vllm, tiny_model, tmp_path_factory):
    """Outputs of vLLM without the connector."""
    r = run_vllm(tmp_path_factory.mktemp("baseline"),
                 {"model": tiny_model, "connector": None, "steps": [{"prompt": P}, {"prompt": Q}]})
    return {"P": r["steps"][0]["tokens"], "Q": r["steps"][1]["tokens"]}


def _conn(**extra):
    return {f"lmcache.{k}": v for k, v in ({"max_local_cpu_size": 0.25} | extra).items()}


def test_second_request_loads_and_outputs_match(run_vllm, tiny_model, baseline, tmp_path, free_port):
    port = free_port()
    r = run_vllm(tmp_path, {"model": tiny_model, "connector": _conn(prometheus_port=port), "steps": [
        {"prompt": P}, {"prompt": P}, {"prompt": Q}, {"prompt": P, "cache_salt": "tenant-b"},
        {"scrape": f"http://127.0.0.1:{port}/metrics"}]}, in_process=False)  # as deployed
    cold, warm, prefix, other_ns, scrape = r["steps"]
    assert cold["cached"] == 0 and cold["tokens"] == baseline["P"]
    assert warm["cached"] == 512, "the two whole chunks of P are loaded"
    assert warm["tokens"] == baseline["P"]
    assert prefix["cached"] == 256 and prefix["tokens"] == baseline["Q"], "only the shared chunk loads"
    assert other_ns["cached"] == 0 and other_ns["tokens"] == baseline["P"], "another namespace loads nothing"
    assert r["metrics"].get("vllm:external_prefix_cache_hits") == 512 + 256
    # the worker's lmcache_triton_* metrics, scraped from the running vLLM
    hits = [line for line in scrape["scrape"].splitlines() if line.startswith("lmcache_triton_hit_tokens_total{")]
    assert hits and float(hits[0].rsplit(" ", 1)[1]) == 512 + 256, hits
    assert "lmcache_triton_retrieve_seconds_bucket" in scrape["scrape"]


def test_async_saves_hold_blocks_only_until_stored(run_vllm, tiny_model, baseline, tmp_path):
    """Saves run after the step and vLLM holds a finished request's blocks until they are stored.
    A KV pool of 12 blocks of 128 tokens holds two 600-token requests: had any finished request's
    hold never been released, the pool would run dry within a few requests and vLLM would stall
    (this run has a time limit). The first prompt, sent again last, loads its saved chunks."""
    others = [{"prompt": random_prompt(600, seed=100 + i)} for i in range(5)]
    r = run_vllm(tmp_path, {"model": tiny_model, "connector": _conn(), "max_model_len": 1024,
                            "llm_args": {"kv_cache_memory_bytes": 12 * 128 * 512},  # 512 B of KV per token
                            "steps": [{"prompt": P}, {"prompt": Q}, *others, {"prompt": P}]})
    first, second, *middle, again = r["steps"]
    assert first["tokens"] == again["tokens"] == baseline["P"] and second["tokens"] == baseline["Q"]
    assert again["cached"] == 512, "P's chunks were saved and load"
    assert [s["cached"] for s in middle] == [0] * 5


def test_offload_server_of_a_live_worker_stores_what_a_later_request_finds(run_vllm, tiny_model, tmp_path):
    """Another process (this one) asks the running worker's offload server to store 512 slots of
    its paged cache under the token-chain hashes of a prompt vLLM has never seen: that prompt's
    request then loads two whole chunks (its own keys), the same prompt in another namespace none.
    The bytes are whatever the slots held: what is stored under a hash is the caller's word."""
    import threading

    from lmcache_triton.integration.vllm.offload_server import OffloadClient
    from lmcache_triton.keys import TokenChain

    never_seen = random_prompt(600, seed=77)
    ready, go, engine_id = tmp_path / "ready", tmp_path / "go", f"offload-e2e-{os.getpid()}"
    reply: dict = {}

    def offload_when_ready() -> None:
        t = time.monotonic()
        while not ready.exists() and time.monotonic() - t < 240:
            time.sleep(0.05)
        client = OffloadClient(engine_id, 0, timeout_s=30)
        hashes = TokenChain(256).chunk_hashes(never_seen[:512]).hashes
        reply.update(ok=client.offload(hashes, list(range(512)), [256, 256]), error=client.last_error,
                     stored=client.last_stored)
        client.close()
        go.touch()

    helper = threading.Thread(target=offload_when_ready, daemon=True)
    helper.start()
    r = run_vllm(tmp_path, {"model": tiny_model, "connector": _conn(enable_offload_server=True), "engine_id": engine_id,
                            "steps": [{"prompt": P}, {"touch": str(ready)}, {"wait_file": str(go), "timeout": 120},
                                      {"prompt": never_seen}, {"prompt": never_seen, "cache_salt": "tenant-b"}]})
    helper.join(5)
    assert reply == {"ok": True, "error": "", "stored": 512}, reply
    first, _, waited, offloaded, other_ns = r["steps"]
    assert waited["found"] and first["cached"] == 0
    assert offloaded["cached"] == 512, "the offloaded chunks are found under the prompt's own keys"
    assert other_ns["cached"] == 0, "and in its namespace only"


def test_layerwise(run_vllm, tiny_model, baseline, tmp_path):
    r = run_vllm(tmp_path, {"model": tiny_model, "connector": _conn(use_layerwise=True),
                            "steps": [{"prompt": P}, {"prompt": P}]})
    assert r["steps"][1]["cached"] == 512
    assert [s["tokens"] for s in r["steps"]] == [baseline["P"]] * 2


def test_disk_tier_survives_restart_and_corruption_is_a_miss(run_vllm, tiny_model, baseline, tmp_path):
    disk = tmp_path / "kv"
    conn = _conn(local_disk=str(disk), max_local_disk_size=0.5)
    first = run_vllm(tmp_path, {"model": tiny_model, "connector": conn, "steps": [{"prompt": P}]})
    assert first["steps"][0]["tokens"] == baseline["P"]
    second = run_vllm(tmp_path, {"model": tiny_model, "connector": conn, "steps": [{"prompt": P}]})
    assert second["steps"][0]["cached"] == 512 and second["steps"][0]["tokens"] == baseline["P"]
    third = run_vllm(tmp_path, {"model": tiny_model, "connector": conn, "steps": [
        {"corrupt_dir": str(disk)}, {"prompt": P}, {"prompt": P}, {"prompt": P}]})
    corrupted, *runs = third["steps"]
    assert corrupted["corrupted"] == 2
    assert all(r["tokens"] == baseline["P"] for r in runs), "corrupt chunks are never used"
    # A chunk is read (and checked) only when the prefix before it is hit: the first request finds
    # chunk 0 corrupt (a miss; it is deleted and stored afresh), the second finds chunk 1 corrupt.
    assert [r["cached"] for r in runs] == [0, 256, 512]


def test_two_vllm_processes_share_through_the_cache_server(run_vllm, tiny_model, baseline, tmp_path, free_port):
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "lmcache_triton.server.cache_server", "--host", "127.0.0.1",
                               "--port", str(port), "--max-size-gb", "0.5"])
    try:
        conn = _conn(remote_url=f"lm://127.0.0.1:{port}", blocking_timeout_secs=2)
        writer = run_vllm(tmp_path, {"model": tiny_model, "connector": conn, "steps": [{"prompt": P}]})
        assert writer["steps"][0]["tokens"] == baseline["P"]
        reader = run_vllm(tmp_path, {"model": tiny_model, "connector": conn, "steps": [
            {"prompt": P}, {"kill_pid": server.pid}, {"prompt": Q}, {"prompt": Q}]})
        hit, _, q_after_kill, q_again = reader["steps"]
        assert hit["cached"] == 512 and hit["tokens"] == baseline["P"], "a second vLLM finds the first one's KV"
        # the server is gone: Q's shared chunk is still in this process's CPU tier, the rest is recomputed
        assert q_after_kill["tokens"] == baseline["Q"] and q_again["tokens"] == baseline["Q"]
    finally:
        server.send_signal(signal.SIGKILL)
        server.wait()


def test_chunked_prefill_and_async_lookup(run_vllm, tiny_model, baseline, tmp_path):
    """The prompt is prefilled 256 tokens per step; each completed chunk is saved as it lands.
    With enable_async_loading the scheduler gets no answer (None) until the lookup is done."""
    r = run_vllm(tmp_path, {"model": tiny_model, "connector": _conn(enable_async_loading=True),
                            "llm_args": {"max_num_batched_tokens": 256},
                            "steps": [{"prompt": P}, {"prompt": P}]})
    assert [s["cached"] for s in r["steps"]] == [0, 512]
    assert [s["tokens"] for s in r["steps"]] == [baseline["P"]] * 2


def test_producer_saves_consumer_loads(run_vllm, tiny_model, baseline, tmp_path):
    conn = _conn(local_disk=str(tmp_path / "kv"), max_local_disk_size=0.5)
    producer = run_vllm(tmp_path, {"model": tiny_model, "connector": conn, "kv_role": "kv_producer",
                                   "steps": [{"prompt": P}, {"prompt": P}]})
    assert [s["cached"] for s in producer["steps"]] == [0, 0], "a producer never loads"
    consumer = run_vllm(tmp_path, {"model": tiny_model, "connector": conn, "kv_role": "kv_consumer",
                                   "steps": [{"prompt": P}, {"prompt": Q}, {"prompt": Q}]})
    assert [s["cached"] for s in consumer["steps"]] == [512, 256, 256], "a consumer loads but never saves"
    assert [s["tokens"] for s in consumer["steps"]] == [baseline["P"], baseline["Q"], baseline["Q"]]


def _rag_prompts() -> tuple[list[int], list[int]]:
    sep = [3, 3]
    d1, d2, d3 = (random_prompt(200, seed=s) for s in (11, 12, 13))
    first = d1 + sep + d2 + sep + d3 + sep + random_prompt(20, seed=14)
    second = d3 + sep + d1 + sep + d2 + sep + random_prompt(20, seed=15)
    return first, second


def test_cacheblend_reuses_documents_in_another_order(run_vllm, tiny_model, tmp_path, free_port,
                                                      whole_blocks_only):
    """RAG-shaped prompts: documents separated by " # # " (the word-level tokenizer reads "#" as
    <unk>, id 3). The second prompt holds the same documents in another order: they are not a
    prefix, yet the connector reports them as external hits and the worker blends them. On an AMX
    CPU vLLM refuses to start with blending, and says why."""
    first, second = _rag_prompts()
    port = free_port()
    conn = _conn(use_layerwise=True, enable_blending=True, blend_min_tokens=64, blend_check_layers=[1],
                 blend_recompute_ratios=[0.15], prometheus_port=port)
    if whole_blocks_only:
        with pytest.raises(AssertionError, match="enable_blending is not supported by vLLM's CPU backend on AMX"):
            run_vllm(tmp_path, {"model": tiny_model, "connector": conn, "steps": [{"prompt": first}]})
        return
    r = run_vllm(tmp_path, {"model": tiny_model, "connector": conn, "steps": [
        {"prompt": first}, {"prompt": second}, {"scrape": f"http://127.0.0.1:{port}/metrics"}]})
    cold, blended, scrape = r["steps"]
    assert cold["cached"] == 0 and len(cold["tokens"]) == 8
    assert blended["cached"] == len(second) - 1, "every prompt token but the last comes from the blend"
    assert len(blended["tokens"]) == 8
    loaded = [line for line in scrape["scrape"].splitlines() if line.startswith("lmcache_triton_hit_tokens_total{")]
    assert loaded and float(loaded[0].rsplit(" ", 1)[1]) == 600, "the three documents' KV was loaded"


def test_cacheblend_ratio_one_equals_full_prefill(run_vllm, tiny_model, tmp_path, whole_blocks_only):
    """Recomputing every token (ratio 1.0) must give exactly what vLLM computes without the cache:
    this checks the blender's layer-by-layer run of vLLM's own model and the write-back."""
    if whole_blocks_only:
        pytest.skip("vLLM's CPU backend on AMX: CacheBlend is refused at start (the test above checks how)")
    first, second = _rag_prompts()
    full = run_vllm(tmp_path, {"model": tiny_model, "connector": None, "steps": [{"prompt": second}]})
    conn = _conn(use_layerwise=True, enable_blending=True, blend_min_tokens=64, blend_check_layers=[1],
                 blend_recompute_ratios=[1.0])
    r = run_vllm(tmp_path, {"model": tiny_model, "connector": conn, "steps": [{"prompt": first}, {"prompt": second}]})
    assert r["steps"][1]["cached"] == len(second) - 1
    assert r["steps"][1]["tokens"] == full["steps"][0]["tokens"]


def test_demo_command(tiny_model, tmp_path):
    """`make demo`'s main job, on the tiny model: warm loads, outputs match, exit status 0; vLLM's log
    limited to warnings and the summary the last thing printed (after vLLM's shutdown); --plot's PNG."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("LMCACHE_") and k not in ("TRITON_INTERPRET", "VLLM_LOGGING_LEVEL")}
    env.update(VLLM_CPU_KVCACHE_SPACE="1", VLLM_CPU_OMP_THREADS_BIND="nobind")
    try:
        import matplotlib  # noqa: F401
        png = tmp_path / "ttft.png"
    except ImportError:
        png = None
    r = subprocess.run([sys.executable, "-m", "lmcache_triton.tools.cli", "demo", "--model", tiny_model, "--tokens", "1024",
                        *(["--plot", str(png)] if png else [])], capture_output=True, text=True, timeout=400, env=env)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    lines = r.stdout.rstrip().splitlines()
    assert lines[-6].startswith("== lmcache-triton demo: 1024-token prompt"), r.stdout[-2000:]
    assert lines[-5].startswith("cold TTFT:") and lines[-4].startswith("warm TTFT:") and lines[-3].startswith("speedup:")
    assert "(1023 tokens loaded" in lines[-4] and lines[-2] == "outputs match an uncached run: True"
    from lmcache_triton.tools.compute_dtype import host_compute_dtype
    assert lines[-1].startswith(f"dtype:     {host_compute_dtype().dtype} ("), \
        "the summary says which dtype the host computes fastest, and why"
    assert not re.search(r"^(\(\w+ pid=\d+\) )?INFO ", r.stdout + r.stderr, re.M), "vLLM logs warnings only"
    if png:
        assert f"wrote {png}" in r.stdout and png.stat().st_size > 0
