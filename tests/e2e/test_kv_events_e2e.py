"""KV events for a router, as a user deploys them: `lmcache-triton serve` with vLLM's prefix cache on
and `--kv-events-config` (ZMQ), a subscriber decoding with vLLM's own msgspec classes.

One server (the tiny random Llama; a CPU tier of ~4.5 chunks; a cache server as remote tier whose
token the connector gets wrong, so every write to it fails): a prompt A of three chunks and a bit,
then a prompt B of as many, which makes the CPU tier evict A's oldest chunks. Checked:

- the connector's `BlockStored` (medium CPU) carry exactly vLLM's own GPU-medium hashes, parents
  and token ids for the blocks of each saved chunk;
- after the CPU tier evicts, `BlockRemoved` (medium CPU) names exactly the blocks of the evicted
  chunks (the tier's own eviction counter says how many; its LRU order which);
- nothing is published for the remote tier, whose every save failed.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.request

import pytest

from lmcache_triton.tools.models import random_prompt
from lmcache_triton.tools.testing import stop_session
from test_openai_serve_e2e import _get, _metric, _wait_for
from test_pd_e2e import _cli, _healthy, _start

CHUNK = 256
CHUNK_BYTES = 2 * 2 * 2 * 32 * 2 * CHUNK  # K and V, 2 layers, 2 KV heads of 32, bfloat16


class Subscriber:
    """vLLM's KV event stream (ZMQ SUB), decoded with vLLM's own classes, on a thread."""

    def __init__(self, endpoint: str) -> None:
        import msgspec
        import zmq
        from vllm.distributed.kv_events import KVEventBatch

        self._decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.SUB)
        self._sock.setsockopt(zmq.SUBSCRIBE, b"")
        self._sock.setsockopt(zmq.RCVTIMEO, 200)
        # vLLM's publisher binds `tcp://*:P` and connects to `tcp://host:P`: here it connects to
        # the subscriber's loopback port, so nothing listens beyond loopback
        self._sock.bind(endpoint)
        self.events: list = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import zmq

        while not self._stop.is_set():
            try:
                parts = self._sock.recv_multipart()
            except zmq.Again:
                continue
            self.events.extend(self._decoder.decode(parts[-1]).events)

    def of(self, kind: str, medium: str) -> list:
        return [e for e in list(self.events) if type(e).__name__ == kind and e.medium == medium]

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._sock.close(0)
        self._ctx.term()


def _flat(events) -> list:
    return [h for e in events for h in e.block_hashes]


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_router_sees_vllms_own_hashes_for_our_chunks_and_exactly_the_evicted_ones_go(
        tiny_model, free_port, start_cache_server, tmp_path):
    pytest.importorskip("vllm")
    remote = start_cache_server("--auth-token", "the-right-token")
    port, metrics_port, events_port = free_port(), free_port(), free_port()
    endpoint = f"tcp://127.0.0.1:{events_port}"
    cmd = _cli() + ["serve", tiny_model, "--host", "127.0.0.1", "--port", str(port), "--max-model-len", "2048",
                    "--enable-prefix-caching", "--kv-events-config",
                    json.dumps({"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": endpoint, "topic": "kv"})]
    log = tmp_path / "server.log"
    sub = Subscriber(endpoint)
    proc = _start(cmd, dict(LMCACHE_PROMETHEUS_PORT=str(metrics_port),
                            LMCACHE_MAX_LOCAL_CPU_SIZE=str(4.5 * CHUNK_BYTES / (1 << 30)),
                            LMCACHE_REMOTE_URL=remote.url, LMCACHE_REMOTE_AUTH_TOKEN="a-wrong-token",
                            LMCACHE_BLOCKING_TIMEOUT_SECS="2"), log)
    base = f"http://127.0.0.1:{port}"
    try:
        _wait_for(_healthy(proc, base, log), 300, "the server's /health")
        time.sleep(0.5)  # the publisher's connection joins a little after the bind

        def complete(seed: int, n: int) -> list[int]:
            words = random_prompt(n, seed=seed)
            body = json.dumps({"model": tiny_model, "prompt": " ".join(f"w{t}" for t in words), "max_tokens": 1,
                               "temperature": 0}).encode()
            req = urllib.request.Request(base + "/v1/completions", body, {"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=120) as r:
                assert json.loads(r.read())["usage"]["prompt_tokens"] == n
            return words

        n = 3 * CHUNK + 50
        complete(1, n)
        stored_a = _wait_for(lambda: len(sub.of("BlockStored", "CPU")) >= 3 and sub.of("BlockStored", "CPU"), 30,
                             "the connector's BlockStored for A's three chunks")
        gpu = sub.of("BlockStored", "GPU")
        block_size = gpu[0].block_size
        per_chunk = CHUNK // block_size
        gpu_hashes, gpu_tokens = _flat(gpu), [t for e in gpu for t in e.token_ids]
        assert len(stored_a) == 3, "one event per saved chunk (the partial last chunk is not saved)"
        assert _flat(stored_a) == gpu_hashes[:3 * per_chunk], "our blocks carry vLLM's own hashes, in order"
        for i, e in enumerate(stored_a):
            assert e.block_size == block_size and e.lora_name is None and e.medium == "CPU"
            assert e.parent_block_hash == (gpu_hashes[i * per_chunk - 1] if i else None)
            assert list(e.token_ids) == gpu_tokens[i * CHUNK:(i + 1) * CHUNK]

        complete(2, n)  # three more chunks into a tier of ~4.5: A's oldest go
        lmct = f"http://127.0.0.1:{metrics_port}/metrics"
        stored = _wait_for(lambda: len(sub.of("BlockStored", "CPU")) >= 6 and sub.of("BlockStored", "CPU"), 30,
                           "the connector's BlockStored for B's chunks")
        evicted = int(_wait_for(lambda: _metric(_get(lmct), "lmcache_triton_evictions_total", 'tier="cpu"'), 30,
                                "a CPU-tier eviction"))
        _wait_for(lambda: len(_flat(sub.of("BlockRemoved", "CPU"))) >= evicted * per_chunk, 30,
                  "BlockRemoved for the evicted chunks")
        time.sleep(1)  # nothing more may come
        removed = sub.of("BlockRemoved", "CPU")
        assert 1 <= evicted <= 3
        assert sorted(_flat(removed)) == sorted(_flat(stored[:evicted])), \
            "exactly the blocks of the chunks the tier evicted (least recently used first)"
        assert all(e.medium == "CPU" for e in removed)
        assert not [e for e in sub.events if getattr(e, "medium", None) == "STORAGE"], \
            "every write to the remote failed: nothing is published for it"
        assert _metric(_get(lmct), "lmcache_triton_stored_tokens_total") >= 6 * CHUNK
    finally:
        sub.close()
        stop_session(proc)
