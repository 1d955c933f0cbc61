"""`lmcache-triton serve` as a user runs it: vLLM's OpenAI-compatible server with the connector,
asked through the `openai` client package (a dependency of vLLM).

The end-to-end test starts `lmcache-triton serve MODEL --port P --max-model-len 4096` (the console
script, with nothing but the connector's metrics port set, through `LMCACHE_PROMETHEUS_PORT`, and
vLLM's request log on, which names aborted requests) on
the tiny random Llama, sends a ~1000-token prompt cold, warm and streamed, and checks the three
outputs are identical, that the warm requests were served by the connector (its
lmcache_triton_hit_tokens_total on the metrics port, vLLM's external prefix-cache hits on the
server's /metrics, and our own series there, labelled as vLLM's) and that the server answers
OpenAI's model list. The same server, sent another prompt twice, is then scraped by a real
Prometheus (Debian's `prometheus`; that test skips without it), which must find the connector's
series on vLLM's own /metrics with vLLM's labels (model_name, engine). Last, streamed requests
whose clients hang up while their prompt loads or saves: the server goes on serving, outputs equal
a fresh computation, and no hold (the CPU tier's, vLLM's blocks) outlives them.
"""

from __future__ import annotations

import http.client
import json
import os
import socket
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from urllib.parse import urlsplit
from types import SimpleNamespace

import pytest

from bench.dashboard import Prometheus, free_port
from lmcache_triton.tools.models import random_prompt
from lmcache_triton.tools.testing import stop_session

CHUNK = 256  # the connector's default chunk_size: only whole chunks are saved and loaded
PROMETHEUS = shutil.which("prometheus")


def _get(url: str, timeout: float = 5.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read().decode()


def _metric(text: str, name: str, labels: str = "") -> float:
    """The sum over label sets of one metric in a Prometheus text exposition (those whose labels
    include `labels`, e.g. 'tier="cpu"', when given)."""
    values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if line.startswith((name + "{", name + " ")) and labels in line]
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


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    """`lmcache-triton serve` on the tiny model, started once for this module's tests."""
    openai = pytest.importorskip("openai")
    port, metrics_port = free_port(), free_port()
    script = Path(sys.executable).with_name("lmcache-triton")
    cmd = [str(script)] if script.exists() else [sys.executable, "-m", "lmcache_triton.tools.cli"]
    cmd += ["serve", tiny_model, "--host", "127.0.0.1", "--port", str(port), "--max-model-len", "4096",
            "--enable-log-requests", "--max-log-len", "40"]  # the log says which requests were aborted
    # As a user's shell: no VLLM_CPU_KVCACHE_SPACE (serve's default applies), no LMCACHE_* but the
    # metrics port and a small CPU tier (the default preallocates 5 GB).
    env = {k: v for k, v in os.environ.items() if not k.startswith("LMCACHE_") and k != "VLLM_CPU_KVCACHE_SPACE"}
    env.pop("TRITON_INTERPRET", None)
    env.update(LMCACHE_PROMETHEUS_PORT=str(metrics_port), LMCACHE_MAX_LOCAL_CPU_SIZE="0.25")
    env["VLLM_LOG_STATS_INTERVAL"] = "1"  # vLLM's periodic log line every second, not 10: read below
    log = tmp_path_factory.mktemp("serve") / "server.log"
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
        yield SimpleNamespace(base=base, port=port, client=client, model=client.models.list().data[0].id,
                              lmct_metrics=f"http://127.0.0.1:{metrics_port}/metrics", log=log)
    finally:
        stop_session(proc)


def _words(tokens: list[int]) -> str:
    return " ".join(f"w{t}" for t in tokens)  # the word-level tokenizer: 1 word, 1 token


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_openai_server_cold_warm_and_streamed_outputs_match(server):
    client, model, lmct_metrics = server.client, server.model, server.lmct_metrics
    prompt = _words(random_prompt(1000, seed=7))

    def complete():
        return client.completions.create(model=model, prompt=prompt, temperature=0, max_tokens=8)

    cold = complete()
    assert cold.usage.prompt_tokens == 1000
    loadable = cold.usage.prompt_tokens // CHUNK * CHUNK
    assert _metric(_get(lmct_metrics), "lmcache_triton_hit_tokens_total") == 0, "the cold request is a miss"
    warm = complete()
    assert _metric(_get(lmct_metrics), "lmcache_triton_hit_tokens_total") == loadable, \
        "the warm request loads the prompt's whole chunks through the connector"
    stream = client.completions.create(model=model, prompt=prompt, temperature=0, max_tokens=8, stream=True)
    streamed = "".join(c.choices[0].text for c in stream if c.choices)
    assert cold.choices[0].text and len(cold.choices[0].text.split()) == 8
    assert cold.choices[0].text == warm.choices[0].text == streamed, "cold, warm and streamed outputs differ"
    assert _metric(_get(lmct_metrics), "lmcache_triton_hit_tokens_total") == 2 * loadable
    # vLLM's own /metrics on the server's port counts the same tokens as external prefix-cache hits,
    # and, from the connector's figures, as ours, under vLLM's labels
    vllm_metrics = server.base + "/metrics"
    _wait_for(lambda: _metric(_get(vllm_metrics), "vllm:external_prefix_cache_hits_total") == 2 * loadable,
              10, "vllm:external_prefix_cache_hits_total")
    ours = f'engine="0",model_name="{model}"'
    _wait_for(lambda: _metric(_get(vllm_metrics), "vllm:lmcache_triton_hit_tokens_total", ours) == 2 * loadable,
              10, "vllm:lmcache_triton_hit_tokens_total")
    text = _get(vllm_metrics)
    assert _metric(text, "vllm:lmcache_triton_lookups_total", ours) == 3
    assert _metric(text, "vllm:lmcache_triton_lookup_tokens_total", ours) == 3000
    assert _metric(text, "vllm:lmcache_triton_miss_tokens_total", 'reason="never_stored"') == loadable
    assert _metric(text, "vllm:lmcache_triton_load_bytes_total", 'tier="cpu"') == \
        _metric(_get(lmct_metrics), "lmcache_triton_retrieved_bytes_total") > 0
    # and vLLM's periodic log line, from the same figures
    line = _wait_for(lambda: next((ln for ln in server.log.read_text().splitlines()
                                   if "KV Transfer metrics: Lookups=" in ln and "Loaded cpu (MiB)=" in ln), None),
                     10, "vLLM's log line of a warm request")
    assert f"Hit tokens={loadable}" in line or f"Hit tokens={2 * loadable}" in line, line


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.skipif(PROMETHEUS is None, reason="no `prometheus` binary: `make test` installs Debian's prometheus "
                    "package (apt-get install prometheus); without root it cannot")
def test_prometheus_finds_our_figures_on_vllms_own_metrics(server, tmp_path):
    """A prompt sent twice (cold, then warm), and a real Prometheus scraping the API server's
    /metrics: the connector's series are there under vLLM's labels, as vLLM's own are."""
    prompt = _words(random_prompt(600, seed=8))  # 2 whole chunks and 88 tokens never saved
    for _ in range(2):
        server.client.completions.create(model=server.model, prompt=prompt, temperature=0, max_tokens=2)
    with Prometheus([f"127.0.0.1:{server.port}"], tmp_path / "prometheus", binary=PROMETHEUS, job="vllm") as prom:
        hits = _wait_for(lambda: prom.query("vllm:lmcache_triton_hit_tokens_total"), 30,
                         "Prometheus' first scrape of vllm:lmcache_triton_hit_tokens_total")
        assert len(hits) == 1, hits
        labels = hits[0]["metric"]
        assert (labels["model_name"], labels["engine"], labels["job"]) == (server.model, "0", "vllm")
        assert float(hits[0]["value"][1]) >= 512, "at least this prompt's warm hit: its 2 whole chunks"
        # the same labels as vLLM's own series, so that one query joins them
        joined = prom.query("vllm:lmcache_triton_hit_tokens_total / on (model_name, engine) "
                            "vllm:external_prefix_cache_hits_total")
        assert len(joined) == 1 and float(joined[0]["value"][1]) == 1.0, "every external hit is ours"
        by_reason = {s["metric"]["reason"] for s in prom.query("vllm:lmcache_triton_miss_tokens_total")}
        assert "partial_chunk" in by_reason and "never_stored" in by_reason
        loaded = prom.query('vllm:lmcache_triton_load_bytes_total{tier="cpu"}')
        assert len(loaded) == 1 and float(loaded[0]["value"][1]) > 0


def _hang_up(server, prompt: str, *, events: int, wait_s: float = 0.0) -> int:
    """A streamed completion whose client closes its socket after `events` server-sent events (0:
    `wait_s` after sending the request, whatever arrived). Returns the events read."""
    url = urlsplit(server.base)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=60)
    body = {"model": server.model, "prompt": prompt, "max_tokens": 64, "temperature": 0, "stream": True}
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    seen = 0
    if events:
        response = conn.getresponse()
        assert response.status == 200, response.read()[:500]
        while seen < events:
            line = response.fp.readline()
            assert line, "the stream ended before the client hung up"
            seen += line.startswith(b"data: ")
    else:
        time.sleep(wait_s)
    conn.sock.shutdown(socket.SHUT_RDWR)  # the client is gone: vLLM aborts the request
    conn.close()
    return seen


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_clients_that_hang_up_mid_load_or_mid_save_leave_nothing_held_and_outputs_intact(server):
    """Real HTTP streaming, the client closing its socket: (load) a prompt cached first, then asked
    streamed and dropped at once, while its chunks load; (save) long new prompts dropped while their
    prefill runs and right after their first token, while their chunks are being saved. Then each
    prompt again: the server answers, with the output of a fresh computation (the request asks to
    skip the cache: kv_transfer_params lmcache.skip_load) whether it loads the dropped request's
    chunks or not. At the end nothing runs, vLLM's KV pool is empty (a finished request held for its
    saves is let go) and the CPU tier holds no chunk."""
    client, model = server.client, server.model
    loaded, saved_mid_prefill, saved_after_prefill = (_words(random_prompt(n, seed=s))
                                                      for n, s in ((1500, 21), (3500, 22), (3500, 23)))

    def complete(prompt: str, **extra):
        return client.completions.create(model=model, prompt=prompt, temperature=0, max_tokens=8,
                                         **extra).choices[0].text

    def fresh(prompt: str) -> str:
        return complete(prompt, extra_body={"kv_transfer_params": {"lmcache.skip_load": True}})

    vllm_metrics = server.base + "/metrics"
    def aborted() -> int:
        return server.log.read_text().count("Aborted request(s)")

    aborted_before = aborted()
    cold = complete(loaded)  # cached now
    hits = _metric(_get(server.lmct_metrics), "lmcache_triton_hit_tokens_total")
    _hang_up(server, loaded, events=0, wait_s=0.05)  # dropped while its lookup and load run
    _hang_up(server, saved_mid_prefill, events=0, wait_s=0.3)  # dropped while its prefill runs
    assert _hang_up(server, saved_after_prefill, events=1) == 1  # dropped after its first token
    _wait_for(lambda: aborted() - aborted_before == 3, 30, "vLLM to abort the three requests (its log)")
    for prompt in (loaded, saved_mid_prefill, saved_after_prefill):
        assert complete(prompt) == fresh(prompt), "a dropped request's chunks changed a later output"
    assert complete(loaded) == cold
    assert _metric(_get(server.lmct_metrics), "lmcache_triton_hit_tokens_total") > hits, "the later requests load"
    # nothing outlives the dropped requests: vLLM's pool and the CPU tier's holds are back to empty
    _wait_for(lambda: _metric(_get(vllm_metrics), "vllm:num_requests_running") == 0
              and _metric(_get(vllm_metrics), "vllm:kv_cache_usage_perc") == 0, 30, "vLLM's KV pool to empty")
    _wait_for(lambda: _metric(_get(server.lmct_metrics), "lmcache_triton_held_chunks") == 0, 30,
              "the CPU tier's holds to go")
