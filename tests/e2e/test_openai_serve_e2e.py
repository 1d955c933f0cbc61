"""`lmcache-triton serve` as a user runs it: vLLM's OpenAI-compatible server with the connector,
asked through the `openai` client package (a dependency of vLLM).

The end-to-end test starts `lmcache-triton serve MODEL --port P --max-model-len 4096` (the console
script, with nothing but the connector's metrics port set, through `LMCACHE_PROMETHEUS_PORT`) on
the tiny random Llama, sends a ~1000-token prompt cold, warm and streamed, and checks the three
outputs are identical, that the warm requests were served by the connector (its
lmcache_triton_hit_tokens_total on the metrics port, vLLM's external prefix-cache hits on the
server's /metrics) and that the server answers OpenAI's model list.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from lmcache_triton.tools.models import random_prompt
from lmcache_triton.tools.testing import stop_session

CHUNK = 256  # the connector's default chunk_size: only whole chunks are saved and loaded


def _get(url: str, timeout: float = 5.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read().decode()


def _metric(text: str, name: str) -> float:
    """The sum over label sets of one metric in a Prometheus text exposition."""
    values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if line.startswith((name + "{", name + " "))]
    assert values, f"{name} not exported"
    return sum(values)


def _wait_for(check, deadline_s: float, what: str):
    end = time.monotonic() + deadline_s
    while True:
        try:
            value = check()
            if value:
                return value
        except (OSError, AssertionError):
            if time.monotonic() > end:
                raise
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.5)


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_openai_server_cold_warm_and_streamed_outputs_match(tiny_model, free_port, tmp_path):
    openai = pytest.importorskip("openai")
    port, metrics_port = free_port(), free_port()
    script = Path(sys.executable).with_name("lmcache-triton")
    cmd = [str(script)] if script.exists() else [sys.executable, "-m", "lmcache_triton.tools.cli"]
    cmd += ["serve", tiny_model, "--host", "127.0.0.1", "--port", str(port), "--max-model-len", "4096"]
    # As a user's shell: no VLLM_CPU_KVCACHE_SPACE (serve's default applies), no LMCACHE_* but the
    # metrics port and a small CPU tier (the default preallocates 5 GB).
    env = {k: v for k, v in os.environ.items() if not k.startswith("LMCACHE_") and k != "VLLM_CPU_KVCACHE_SPACE"}
    env.pop("TRITON_INTERPRET", None)
    env.update(LMCACHE_PROMETHEUS_PORT=str(metrics_port), LMCACHE_MAX_LOCAL_CPU_SIZE="0.25")
    log = tmp_path / "server.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        def healthy():
            if proc.poll() is not None:
                raise RuntimeError(f"the server exited with {proc.returncode}:\n{log.read_text()[-6000:]}")
            try:
                return _get(base + "/health", timeout=2) is not None
            except (urllib.error.URLError, OSError):
                return False

        _wait_for(healthy, 300, "the server's /health")
        client = openai.OpenAI(base_url=base + "/v1", api_key="x", timeout=120, max_retries=0)
        model = client.models.list().data[0].id
        prompt = " ".join(f"w{t}" for t in random_prompt(1000, seed=7))  # the word-level tokenizer: 1 word, 1 token

        def complete():
            return client.completions.create(model=model, prompt=prompt, temperature=0, max_tokens=8)

        cold = complete()
        assert cold.usage.prompt_tokens == 1000
        loadable = cold.usage.prompt_tokens // CHUNK * CHUNK
        lmct_metrics = f"http://127.0.0.1:{metrics_port}/metrics"
        assert _metric(_get(lmct_metrics), "lmcache_triton_hit_tokens_total") == 0, "the cold request is a miss"
        warm = complete()
        assert _metric(_get(lmct_metrics), "lmcache_triton_hit_tokens_total") == loadable, \
            "the warm request loads the prompt's whole chunks through the connector"
        stream = client.completions.create(model=model, prompt=prompt, temperature=0, max_tokens=8, stream=True)
        streamed = "".join(c.choices[0].text for c in stream if c.choices)
        assert cold.choices[0].text and len(cold.choices[0].text.split()) == 8
        assert cold.choices[0].text == warm.choices[0].text == streamed, "cold, warm and streamed outputs differ"
        assert _metric(_get(lmct_metrics), "lmcache_triton_hit_tokens_total") == 2 * loadable
        # vLLM's own /metrics on the server's port counts the same tokens as external prefix-cache hits
        _wait_for(lambda: _metric(_get(base + "/metrics"), "vllm:external_prefix_cache_hits_total") == 2 * loadable,
                  10, "vllm:external_prefix_cache_hits_total")
    finally:
        stop_session(proc)
