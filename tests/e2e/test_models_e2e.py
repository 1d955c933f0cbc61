"""Models whose KV cache is not plain full attention, on vLLM with the connector (model_support.py).

A tiny random Mistral whose every layer attends to its last 384 tokens (vLLM: one SlidingWindowSpec
group, window < max_model_len): vLLM frees a request's blocks as they leave the window, so the
connector serves the requests that fit in it (prompt + max_tokens <= 384: loaded on a hit, and
after a restart from the disk tier) and declines the longer ones (never loaded or saved, counted as
misses of reason "sliding_window"). Every output equals vLLM's without the connector. Three vLLM
starts, engine core in process (the half-cost start): the baseline, a run with the connector, and a
restart reading the same disk folder.
"""

import re

import pytest

from lmcache_triton.tools.models import build_random_mistral, random_prompt

pytestmark = pytest.mark.slow

WINDOW = 384
FITS = random_prompt(300, seed=11)  # + 8 generated tokens: within the window; one whole chunk
LONG = random_prompt(600, seed=12)  # past the window


@pytest.fixture(scope="module")
def mistral(tmp_path_factory) -> str:
    return str(build_random_mistral(tmp_path_factory.mktemp("models") / "tiny-mistral", sliding_window=WINDOW))


@pytest.fixture(scope="module")
def baseline(run_vllm_in_process, mistral, tmp_path_factory):
    r = run_vllm_in_process(tmp_path_factory.mktemp("baseline"), {
        "model": mistral, "connector": None, "max_model_len": 1024, "steps": [{"prompt": FITS}, {"prompt": LONG}]})
    return {"FITS": r["steps"][0]["tokens"], "LONG": r["steps"][1]["tokens"]}


def _misses(scrape: str, reason: str) -> float:
    found = re.findall(rf'^lmcache_triton_miss_tokens_total{{[^}}]*reason="{reason}"[^}}]*}} (\S+)$', scrape, re.M)
    return float(found[0]) if found else 0.0


def test_sliding_window_model_loads_within_the_window_and_declines_past_it(run_vllm_in_process, mistral, baseline,
                                                                          tmp_path, free_port):
    disk, port = tmp_path / "kv", free_port()
    conn = {"lmcache.max_local_cpu_size": 0.25, "lmcache.local_disk": str(disk), "lmcache.max_local_disk_size": 0.5}
    r = run_vllm_in_process(tmp_path, {
        "model": mistral, "connector": conn | {"lmcache.prometheus_port": port}, "max_model_len": 1024,
        "steps": [{"prompt": FITS}, {"prompt": FITS}, {"prompt": LONG}, {"prompt": LONG},
                  {"scrape": f"http://127.0.0.1:{port}/metrics"}]})
    cold, warm, long1, long2, scrape = r["steps"]
    assert cold["cached"] == 0 and warm["cached"] == 256, "within the window: its whole chunk loads"
    assert cold["tokens"] == warm["tokens"] == baseline["FITS"]
    assert long1["cached"] == long2["cached"] == 0, "past the window: never loaded"
    assert long1["tokens"] == long2["tokens"] == baseline["LONG"]
    assert _misses(scrape["scrape"], "sliding_window") == 2 * len(LONG), "each declined request is counted"
    assert len(list(disk.rglob("*.safetensors"))) == 1, "only the request within the window was saved"

    again = run_vllm_in_process(tmp_path, {"model": mistral, "connector": conn, "max_model_len": 1024,
                                           "steps": [{"prompt": FITS}, {"prompt": LONG}]})
    fits, long3 = again["steps"]
    assert fits["cached"] == 256 and fits["tokens"] == baseline["FITS"], "after a restart, from the disk tier"
    assert long3["cached"] == 0 and long3["tokens"] == baseline["LONG"]
