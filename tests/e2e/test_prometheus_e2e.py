"""A real Prometheus (Debian's `prometheus`) scrapes the connector's metrics from a running vLLM,
and PromQL through its HTTP API reads back what the requests did.

The tiny random Llama (2 layers, 2 KV heads, head 32, bf16), chunk 256, vLLM's prefix cache off.
Prometheus scrapes every second; vLLM idles 2 s before the requests (the counters' first samples
are 0, so increase() is exact) and 3.5 s after them (the last values are scraped). The queries are
evaluated at the last scrape, so the series are not yet stale when the run has ended.
"""

import json
import math
import shutil
from pathlib import Path

import pytest

from bench.dashboard import DASHBOARD, Prometheus, panel_queries
from lmcache_triton.tools.models import random_prompt

pytestmark = pytest.mark.slow

PROMETHEUS = shutil.which("prometheus")

A = random_prompt(600, seed=21)  # 2 whole chunks + 88 tokens never saved (a partial chunk)
B = random_prompt(300, seed=22)  # 1 whole chunk + 44
C = random_prompt(100, seed=23)  # shorter than a chunk: nothing to find, nothing saved
# cold A (a miss), A twice warm, cold B (a miss), C (a miss), warm B
STEPS = [{"sleep": 2}, {"prompt": A}, {"prompt": A}, {"prompt": A}, {"prompt": B}, {"prompt": C}, {"prompt": B},
         {"sleep": 3.5}]
LOOKUPS, MISSED_REQUESTS = 6, 3
LOOKUP_TOKENS = 3 * 600 + 2 * 300 + 100
HIT_TOKENS = 2 * 512 + 256
MISS_TOKENS = {"never_stored": 512 + 256, "partial_chunk": 3 * 88 + 2 * 44 + 100}


def _bytes_per_token(model: str) -> int:
    c = json.loads((Path(model) / "config.json").read_text())
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    return c["num_hidden_layers"] * 2 * c["num_key_value_heads"] * head_dim * 2  # K and V, bf16


@pytest.mark.skipif(PROMETHEUS is None, reason="no `prometheus` binary: `make test` installs Debian's prometheus "
                    "package (apt-get install prometheus); without root it cannot")
def test_prometheus_scrapes_vllm_and_promql_reads_what_the_requests_did(run_vllm, tiny_model, tmp_path, free_port):
    metrics_port = free_port()
    conn = {"lmcache.max_local_cpu_size": 0.25, "lmcache.prometheus_port": metrics_port}
    with Prometheus([f"127.0.0.1:{metrics_port}"], tmp_path / "prometheus", port=free_port(),
                    binary=PROMETHEUS) as prom:
        r = run_vllm(tmp_path, {"model": tiny_model, "connector": conn, "steps": STEPS}, timeout=240)
        assert [s["cached"] for s in r["steps"] if "cached" in s] == [0, 512, 512, 0, 0, 256]

        times = prom.sample_times("lmcache_triton_lookup_requests_total")
        assert len(times) >= 5, f"Prometheus scraped the worker {len(times)} times"
        at = times[-1]  # the last scrape, while vLLM was still up

        def v(expr: str) -> float:
            return prom.value(expr, at)

        assert v('up{job="lmcache_triton"}') == 1
        # requests: every lookup, and those that found nothing at all
        assert v("sum(lmcache_triton_lookup_requests_total)") == LOOKUPS
        assert v("sum(lmcache_triton_lookup_misses_total)") == MISSED_REQUESTS
        assert v("increase(lmcache_triton_lookup_requests_total[5m])") == pytest.approx(LOOKUPS, abs=0.01)
        # lookup hit ratio: tokens found / tokens asked, counting the misses
        assert v("sum(lmcache_triton_lookup_tokens_total)") == LOOKUP_TOKENS
        assert v("sum(lmcache_triton_lookup_hit_tokens_total)") == HIT_TOKENS, "warm hits are whole chunks"
        ratio = HIT_TOKENS / LOOKUP_TOKENS
        assert v("sum(lmcache_triton_lookup_hit_tokens_total) / sum(lmcache_triton_lookup_tokens_total)") \
            == pytest.approx(ratio)
        assert v("lmcache_triton_lookup_hit_ratio") == pytest.approx(ratio)
        assert v("sum(rate(lmcache_triton_lookup_hit_tokens_total[5m])) / "
                 "sum(rate(lmcache_triton_lookup_tokens_total[5m]))") == pytest.approx(ratio)
        # retrieve: asked only for what lookups found, all of it loaded
        assert v("sum(lmcache_triton_hit_tokens_total)") == HIT_TOKENS
        assert v("sum(lmcache_triton_requested_tokens_total)") == HIT_TOKENS
        assert v("lmcache_triton_retrieve_hit_ratio") == 1.0
        assert v("sum(lmcache_triton_retrieve_requests_total)") == 3, "misses never reach retrieve"
        # every token a lookup asked about is a hit or a miss with a reason
        misses = {s["metric"]["reason"]: float(s["value"][1])
                  for s in prom.query("sum by (reason) (lmcache_triton_miss_tokens_total)", at)}
        assert misses == MISS_TOKENS
        assert v("sum(lmcache_triton_miss_tokens_total) + sum(lmcache_triton_lookup_hit_tokens_total)") \
            == LOOKUP_TOKENS
        # bytes, throughput and latency from the counters and histograms
        bpt = _bytes_per_token(tiny_model)
        assert v("sum(lmcache_triton_stored_tokens_total)") == 512 + 256
        assert v("sum(lmcache_triton_stored_bytes_total)") == (512 + 256) * bpt
        assert v("sum(lmcache_triton_retrieved_bytes_total)") == HIT_TOKENS * bpt
        assert v('sum(lmcache_triton_usage_bytes{tier="cpu"})') >= (512 + 256) * bpt
        assert v("sum(lmcache_triton_retrieve_seconds_count)") == 3
        busy = v("sum(lmcache_triton_retrieve_seconds_sum)")
        gbps = v("sum(rate(lmcache_triton_retrieved_bytes_total[5m])) / "
                 "sum(rate(lmcache_triton_retrieve_seconds_sum[5m])) / 1e9")
        assert gbps == pytest.approx(HIT_TOKENS * bpt / busy / 1e9, rel=1e-6) and gbps > 0
        p50, p99 = (v(f"histogram_quantile({q}, sum by (le) (rate(lmcache_triton_retrieve_seconds_bucket[5m])))")
                    for q in (0.5, 0.99))
        assert 0 < p50 <= p99 <= 5.0, (p50, p99)
        assert v("sum(lmcache_triton_held_chunks)") == 0
        assert v("sum(lmcache_triton_verify_mismatch_total)") == 0
        # query_range, as the dashboard reads it: the counter climbs from 0 to every lookup
        series = prom.query_range("sum(lmcache_triton_lookup_requests_total)", times[0], at, 1)
        values = [float(x) for _, x in series[0]["values"]]
        assert values[0] == 0 and values[-1] == LOOKUPS and values == sorted(values)
        # every query of the Grafana dashboard is valid PromQL over these series; the main panels have data
        dashboard = json.loads(DASHBOARD.read_text())
        titles = tuple(p["title"] for p in dashboard["panels"] if p["type"] == "timeseries")
        for panel, targets in panel_queries(dashboard, titles, "5m"):
            answers = [prom.query(expr, at) for expr, _ in targets]
            if panel["title"] in ("Hit ratio: lookup vs retrieve", "Latency p50 / p99", "Tier usage and capacity",
                                  "Store / retrieve throughput (while busy)"):
                assert all(answers), f"{panel['title']}: no data"
                assert all(not math.isnan(float(s["value"][1])) for a in answers for s in a), panel["title"]
        for p in dashboard["panels"]:
            if p["type"] == "stat":
                for t in p["targets"]:
                    prom.query(t["expr"].replace("$model", ".*").replace("$rank", ".*"), at)
