"""The KV-aware proxy as a user deploys it: two `lmcache-triton serve` instances on the tiny random
Llama (vLLM's prefix cache on, the connector on its CPU tier, each publishing vLLM's KV events on a
port of its own) and `lmcache-triton proxy --backend ... --kv-events ...` in front, all real
processes, asked through the proxy's OpenAI API.

A prompt sent cold goes round-robin; sent again (completion, streamed, and as a chat message whose
template renders to the same tokens) it goes to the instance that computed it, found from that
instance's events, and is served from its prefix cache (vLLM's own /metrics), with the same
output. A prompt nobody holds goes round-robin, to the other instance."""

from __future__ import annotations

import json

import pytest

from lmcache_triton.tools.models import random_prompt
from lmcache_triton.tools.testing import stop_session
from test_openai_serve_e2e import _get, _metric, _wait_for
from test_pd_e2e import _cli, _healthy, _start

CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"  # the tiny model has none


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stats(base: str) -> dict:
    return json.loads(_get(base + "/proxy/stats"))


@pytest.fixture(scope="module")
def deployment(tiny_model, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("kv-proxy")
    ports, events, proxy_port = [_free_port(), _free_port()], [_free_port(), _free_port()], _free_port()
    procs, logs = [], []
    try:
        for i, (port, ev) in enumerate(zip(ports, events)):
            config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{ev}",
                      "topic": "kv-events"}
            logs.append(tmp / f"backend{i}.log")
            procs.append(_start([*_cli(), "serve", tiny_model, "--host", "127.0.0.1", "--port", str(port),
                                 "--max-model-len", "1024", "--enable-prefix-caching", "--chat-template",
                                 CHAT_TEMPLATE, "--kv-events-config", json.dumps(config)], {}, logs[-1]))
        logs.append(tmp / "proxy.log")
        procs.append(_start([*_cli(), "proxy", "--port", str(proxy_port),
                             *[a for port, ev in zip(ports, events)
                               for a in ("--backend", f"http://127.0.0.1:{port}", "--kv-events", f"tcp://127.0.0.1:{ev}")]],
                            {}, logs[-1]))
        for proc, port, log in zip(procs, [*ports, proxy_port], logs):
            _wait_for(_healthy(proc, f"http://127.0.0.1:{port}", log), 300, log.name)
        yield {"proxy": f"http://127.0.0.1:{proxy_port}", "backends": [f"http://127.0.0.1:{p}" for p in ports],
               "logs": logs}
    finally:
        for proc in reversed(procs):
            stop_session(proc)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_repeated_prompt_goes_where_it_is_cached(deployment):
    openai = pytest.importorskip("openai")
    proxy, backends = deployment["proxy"], deployment["backends"]
    client = openai.OpenAI(base_url=proxy + "/v1", api_key="x", timeout=120, max_retries=0)
    model = client.models.list().data[0].id
    a = " ".join(f"w{t}" for t in random_prompt(300, seed=11))
    b = " ".join(f"w{t}" for t in random_prompt(300, seed=12))

    def complete(prompt: str, **kw):
        return client.completions.create(model=model, prompt=prompt, temperature=0, max_tokens=8, **kw)

    cold = complete(a)
    assert _stats(proxy)["decisions"] == {"kv_routed": 0, "round_robin": 1}
    first = next(i for i, s in enumerate(_stats(proxy)["backends"]) if s["requests"] == 1)
    # vLLM publishes the prompt's blocks after the step that computed them: wait until they arrived
    _wait_for(lambda: _stats(proxy)["backends"][first]["index"]["walkable_blocks"], 30,
              "the first backend's BlockStored events")
    bs = _stats(proxy)["backends"][first]["index"]["block_size"]
    assert _stats(proxy)["backends"][first]["index"]["walkable_blocks"] >= 300 // bs
    hits_before = _metric(_get(backends[first] + "/metrics"), "vllm:prefix_cache_hits_total")

    warm = complete(a)
    streamed = "".join(c.choices[0].text for c in complete(a, stream=True) if c.choices)
    chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": a}], temperature=0,
                                          max_tokens=8)
    stats = _stats(proxy)
    assert stats["decisions"] == {"kv_routed": 3, "round_robin": 1}, stats
    assert stats["backends"][first]["requests"] == 4 and stats["backends"][first]["kv_routed"] == 3
    assert cold.choices[0].text == warm.choices[0].text == streamed, "cold, warm and streamed outputs differ"
    assert chat.choices[0].message.content == cold.choices[0].text, "the chat template renders the same tokens"
    hits = _metric(_get(backends[first] + "/metrics"), "vllm:prefix_cache_hits_total") - hits_before
    assert hits >= 3 * (299 // bs * bs), "the repeated prompt was served from that backend's prefix cache"

    other = 1 - first
    complete(b)
    stats = _stats(proxy)
    assert stats["decisions"] == {"kv_routed": 3, "round_robin": 2}, "a prompt nobody holds goes round-robin"
    assert stats["backends"][other]["requests"] == 1, "round-robin's next turn: the other backend"
    assert stats["tokenize_failures"] == 0
    assert all(s["kv_events"][0]["malformed"] == 0 for s in stats["backends"])
