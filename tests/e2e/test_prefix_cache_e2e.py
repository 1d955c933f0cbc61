"""vLLM's own prefix cache and ours together: a prompt whose first block vLLM still holds (a
previous request shared it) and whose next chunks only lmcache_triton holds. The connector loads
exactly the tokens between the two hits; the outputs are vLLM's without the connector.

Tiny random Llama, vLLM's CPU block size 128, lmcache chunk 256 (as test_vllm_e2e.py)."""

import pytest

from lmcache_triton.tools.models import random_prompt

pytestmark = pytest.mark.slow

P = random_prompt(600, seed=1)              # 2 whole chunks (512 tokens) + a partial one
SHARES_A_BLOCK = P[:200] + random_prompt(400, seed=3)  # vLLM's block 0 (P[:128]) only, none of our chunks


def test_a_partial_local_hit_loads_the_rest_and_outputs_match(run_vllm_in_process, tiny_model, tmp_path):
    run = run_vllm_in_process
    prefix_on = {"enable_prefix_caching": True}
    baseline = run(tmp_path, {"model": tiny_model, "connector": None, "llm_args": prefix_on,
                              "steps": [{"prompt": P}]})["steps"][0]["tokens"]
    conn = {"lmcache.max_local_cpu_size": 0.25, "lmcache.local_disk": str(tmp_path / "kv"),
            "lmcache.max_local_disk_size": 0.5}
    # A first vLLM computes P: our disk tier keeps its two whole chunks.
    first = run(tmp_path, {"model": tiny_model, "connector": conn, "llm_args": prefix_on, "steps": [{"prompt": P}]})
    assert first["steps"][0]["tokens"] == baseline
    # A second vLLM: its prefix cache gets P's first block from another prompt; ours has [0, 512).
    r = run(tmp_path, {"model": tiny_model, "connector": conn, "llm_args": prefix_on,
                       "steps": [{"prompt": SHARES_A_BLOCK}, {"prompt": P}]})
    other, both = r["steps"]
    assert other["cached"] == 0
    assert both["cached"] == 512, "128 tokens from vLLM's prefix cache, the next 384 loaded"
    assert r["metrics"].get("vllm:prefix_cache_hits") == 128, r["metrics"]
    assert r["metrics"].get("vllm:external_prefix_cache_hits") == 384, "the tokens past vLLM's hit, loaded"
    assert both["tokens"] == baseline, "the loaded KV is P's: outputs as vLLM's without the connector"
