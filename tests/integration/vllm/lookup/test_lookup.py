"""Lookups over real zmq IPC sockets: LookupClient (scheduler) -> LMCacheLookupServer (workers) -> engines."""

import threading
import time
import uuid

import pytest
import torch
import zmq

from lmcache_triton import LMCacheEngineConfig, LMCacheEngineMetadata, create_gpu_connector
from lmcache_triton.engine.engine import LMCacheEngine
from lmcache_triton.integration.vllm.lookup import protocol
from lmcache_triton.integration.vllm.lookup.client import LookupClient
from lmcache_triton.integration.vllm.lookup.server import LMCacheAsyncLookupServer, LMCacheLookupServer
from lmcache_triton.tools.testing import make_kv_caches, random_slot_mapping

CHUNK = 16
LAYERS, HEADS, HEAD = 2, 2, 16
BLOCK, BLOCKS = 16, 16
TIMEOUT_MS = 500


def _engine_id() -> str:
    return f"test-{uuid.uuid4().hex[:12]}"


def _engine(closing, stored: list[torch.Tensor] = (), namespace: str = "") -> LMCacheEngine:
    config = LMCacheEngineConfig.from_defaults(chunk_size=CHUNK, max_local_cpu_size=0.01)
    metadata = LMCacheEngineMetadata(model_name="test/model", world_size=1, worker_id=0, kv_dtype=torch.bfloat16,
                                     kv_shape=(LAYERS, 2, CHUNK, HEADS, HEAD))
    engine = LMCacheEngine(config, metadata, create_gpu_connector(config, metadata, "vllm_cpu"))
    closing.append(engine)
    caches = make_kv_caches("vllm_cpu", num_layers=LAYERS, num_blocks=BLOCKS, block_size=BLOCK, num_kv_heads=HEADS,
                            head_size=HEAD, generator=torch.Generator().manual_seed(0))
    for tokens in stored:
        slots = random_slot_mapping(len(tokens), num_blocks=BLOCKS, block_size=BLOCK,
                                    generator=torch.Generator().manual_seed(1))
        assert engine.store(tokens, kvcaches=caches, slot_mapping=slots, namespace=namespace) == len(tokens)
    return engine


def _client(closing, engine_id, world_size=1, **kw) -> LookupClient:
    client = LookupClient(engine_id, world_size, timeout_ms=TIMEOUT_MS, **kw)
    closing.append(client)
    return client


def _server(closing, cls, engine, engine_id, rank=0):
    server = cls(engine, engine_id, rank)
    closing.append(server)
    return server


PROMPT = torch.arange(100, 100 + 3 * CHUNK)


def test_hit_miss_namespace_and_pins(closing):
    eid = _engine_id()
    engine = _engine(closing, [PROMPT])
    _server(closing, LMCacheLookupServer, engine, eid)
    client = _client(closing, eid)
    query = PROMPT.tolist() + [7] * (CHUNK + 3)
    assert client.lookup(query, "req-hit") == 3 * CHUNK
    assert engine.storage_manager.cpu.num_held == 3, "the reported chunks are held for the load"
    assert client.lookup([999] + query[1:], "req-first-changed") == 0
    assert client.lookup(PROMPT[: 2 * CHUNK].tolist(), "req-short") == 2 * CHUNK
    assert client.lookup(query, "req-other-ns", namespace="salt") == 0, "keys of one namespace never match another"
    engine.release_reservation("req-short")
    assert engine.storage_manager.cpu.num_held == 3, "req-hit still holds its holds"
    engine.release_reservation("req-hit")
    assert engine.storage_manager.cpu.num_held == 0


def test_namespace_hit(closing):
    eid = _engine_id()
    engine = _engine(closing, [PROMPT], namespace="salt")
    _server(closing, LMCacheLookupServer, engine, eid)
    client = _client(closing, eid)
    assert client.lookup(PROMPT.tolist(), "a", namespace="salt") == 3 * CHUNK
    assert client.lookup(PROMPT.tolist(), "b") == 0


def test_tensor_parallel_takes_the_minimum(closing):
    eid = _engine_id()
    rank0 = _engine(closing, [PROMPT])
    rank1 = _engine(closing, [PROMPT[: 2 * CHUNK]])
    _server(closing, LMCacheLookupServer, rank0, eid, rank=0)
    _server(closing, LMCacheLookupServer, rank1, eid, rank=1)
    assert _client(closing, eid, world_size=1).lookup(PROMPT.tolist(), "r0") == 3 * CHUNK
    assert _client(closing, eid, world_size=2).lookup(PROMPT.tolist(), "tp") == 2 * CHUNK


def _timed(fn):
    t0 = time.monotonic()
    out = fn()
    return out, time.monotonic() - t0


def test_no_server_is_a_quick_miss_and_recovers(closing):
    eid = _engine_id()
    client = _client(closing, eid)
    hit, elapsed = _timed(lambda: client.lookup(PROMPT.tolist(), "early"))
    assert hit == 0 and elapsed < TIMEOUT_MS / 1000 + 1
    engine = _engine(closing, [PROMPT])
    _server(closing, LMCacheLookupServer, engine, eid)
    assert client.lookup(PROMPT.tolist(), "later") == 3 * CHUNK, "the client works once the server is up"


def test_a_missing_rank_is_a_quick_miss(closing):
    eid = _engine_id()
    _server(closing, LMCacheLookupServer, _engine(closing, [PROMPT]), eid, rank=0)
    client = _client(closing, eid, world_size=2)
    hit, elapsed = _timed(lambda: client.lookup(PROMPT.tolist(), "tp-missing"))
    assert hit == 0 and elapsed < TIMEOUT_MS / 1000 + 1
    _server(closing, LMCacheLookupServer, _engine(closing, [PROMPT]), eid, rank=1)
    assert client.lookup(PROMPT.tolist(), "tp-both") == 3 * CHUNK


def test_async_client_polls_and_caches_per_lookup_id(closing):
    eid = _engine_id()
    engine = _engine(closing, [PROMPT])
    _server(closing, LMCacheAsyncLookupServer, engine, eid)
    client = _client(closing, eid, asynchronous=True)
    # The first call sends the question and returns at once: None, or the answer if it is in already
    # (the server wakes to reply as soon as a lookup is done).
    hit = client.lookup(PROMPT.tolist(), "req")
    deadline = time.monotonic() + TIMEOUT_MS / 1000
    while hit is None and time.monotonic() < deadline:
        time.sleep(0.005)
        hit = client.lookup(PROMPT.tolist(), "req")
    assert hit == 3 * CHUNK
    engine.release_reservation("req")
    # the cached answer is served without asking again: it stays even though the engine changed
    engine.storage_manager.clear()
    assert client.lookup(PROMPT.tolist(), "req") == 3 * CHUNK
    client.clear_lookup_status("req")
    hit = client.lookup(PROMPT.tolist(), "req")
    deadline = time.monotonic() + TIMEOUT_MS / 1000
    while hit is None and time.monotonic() < deadline:
        time.sleep(0.005)
        hit = client.lookup(PROMPT.tolist(), "req")
    assert hit == 0, "asked again after clear_lookup_status"


@pytest.mark.parametrize("through", ["socket", "in_process"])
def test_async_server_replies_without_waiting_for_a_poll(closing, through):
    """A finished lookup wakes the server's thread: the round trip is not a multiple of its poll.
    (In one process the client submits to the server's pool: no socket, no serving thread.)"""
    eid = _engine_id()
    server = _server(closing, LMCacheAsyncLookupServer, _engine(closing, [PROMPT]), eid)
    if through == "socket":
        protocol.stop_serving_in_process(server.address, server.submit)
    assert (protocol.in_process(server.address) is not None) == (through == "in_process")
    client = _client(closing, eid)
    assert client.lookup(PROMPT.tolist(), "warm") == 3 * CHUNK
    times = []
    for i in range(20):
        t0 = time.perf_counter()
        assert client.lookup(PROMPT.tolist(), f"r{i}") == 3 * CHUNK
        times.append(time.perf_counter() - t0)
    assert sorted(times)[10] < 0.05, "a reply waited for the serving thread's poll timeout"


def test_in_process_lookups_need_no_socket_and_a_closed_server_is_a_quick_miss(closing):
    """vLLM's engine core runs the scheduler and its one worker in one process: the client hands the
    request to the server's pool. With the serving thread stopped (no socket answers) it still
    hits, sync and async; once the server is closed the client asks the socket: a miss at the timeout."""
    eid = _engine_id()
    server = _server(closing, LMCacheAsyncLookupServer, _engine(closing, [PROMPT]), eid)
    server._stop.set()
    server._thread.join(timeout=2)
    assert not server._thread.is_alive()
    assert _client(closing, eid).lookup(PROMPT.tolist(), "sync") == 3 * CHUNK
    assert _answer(_client(closing, eid, asynchronous=True), "async") == 3 * CHUNK
    server.close()
    assert protocol.in_process(server.address) is None
    hit, t = _timed(lambda: _client(closing, eid).lookup(PROMPT.tolist(), "closed"))
    assert hit == 0 and t < TIMEOUT_MS / 1000 + 0.5


def _answer(client: LookupClient, lookup_id: str) -> int | None:
    """The client's answer, asked again until there is one (an asynchronous client) or the timeout."""
    hit, deadline = client.lookup(PROMPT.tolist(), lookup_id), time.monotonic() + TIMEOUT_MS / 1000
    while hit is None and time.monotonic() < deadline:
        time.sleep(0.002)
        hit = client.lookup(PROMPT.tolist(), lookup_id)
    return hit


def _disk_engine(closing, tmp_path) -> LMCacheEngine:
    """An engine with a CPU tier and a local disk tier, nothing stored."""
    config = LMCacheEngineConfig.from_defaults(chunk_size=CHUNK, max_local_cpu_size=0.01,
                                               local_disk=str(tmp_path), max_local_disk_size=0.01)
    metadata = LMCacheEngineMetadata(model_name="test/model", world_size=1, worker_id=0, kv_dtype=torch.bfloat16,
                                     kv_shape=(LAYERS, 2, CHUNK, HEADS, HEAD))
    engine = LMCacheEngine(config, metadata, create_gpu_connector(config, metadata, "vllm_cpu"))
    closing.append(engine)
    return engine


def _lookup_threads(engine: LMCacheEngine) -> list[int]:
    """The threads that run the engine's lookups, in order, from now on."""
    threads: list[int] = []
    lookup = engine.lookup
    engine.lookup = lambda *a, **kw: threads.append(threading.get_ident()) or lookup(*a, **kw)
    return threads


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
def test_a_memory_only_lookup_runs_in_the_waiting_clients_thread(closing, tmp_path, asynchronous):
    """In one process, a synchronous client's lookup of an engine with the CPU tier alone is
    answered in the client's own thread (no hand-off to wait for); an asynchronous client's, and
    any lookup of an engine with a lower tier (which may wait on a disk or a network), in the pool."""
    eid = _engine_id()
    engine = _engine(closing, [PROMPT])
    threads = _lookup_threads(engine)
    _server(closing, LMCacheAsyncLookupServer, engine, eid)
    assert _answer(_client(closing, eid, asynchronous=asynchronous), "a") == 3 * CHUNK
    assert (threads == [threading.get_ident()]) == (not asynchronous), threads

    eid = _engine_id()
    disk = _disk_engine(closing, tmp_path)
    threads = _lookup_threads(disk)
    _server(closing, LMCacheAsyncLookupServer, disk, eid)
    assert _answer(_client(closing, eid, asynchronous=asynchronous), "b") == 0
    assert len(threads) == 1 and threads[0] != threading.get_ident()


def test_a_hung_in_process_lookup_is_a_miss_at_the_timeout(closing):
    """A lookup stuck in the worker (a remote that does not answer) costs the scheduler its
    timeout, never more, in one process as across processes."""
    release = threading.Event()

    class HungEngine:
        def lookup(self, tokens, reserve=False, **kw):
            release.wait(10)
            return 3 * CHUNK

    eid = _engine_id()
    _server(closing, LMCacheAsyncLookupServer, HungEngine(), eid)
    try:
        hit, t = _timed(lambda: _client(closing, eid).lookup(PROMPT.tolist(), "hung"))
        assert hit == 0 and TIMEOUT_MS / 1000 - 0.05 <= t < TIMEOUT_MS / 1000 + 0.5
    finally:
        release.set()


def test_sync_client_caches_per_lookup_id(closing):
    eid = _engine_id()
    engine = _engine(closing, [PROMPT])
    _server(closing, LMCacheLookupServer, engine, eid)
    client = _client(closing, eid)
    assert client.lookup(PROMPT.tolist(), "req") == 3 * CHUNK
    engine.release_reservation("req")
    engine.storage_manager.clear()
    assert client.lookup(PROMPT.tolist(), "req") == 3 * CHUNK
    client.clear_lookup_status("req")
    assert client.lookup(PROMPT.tolist(), "req") == 0


@pytest.mark.parametrize("cls", [LMCacheLookupServer, LMCacheAsyncLookupServer])
def test_garbage_does_not_kill_the_server(closing, cls):
    eid = _engine_id()
    engine = _engine(closing, [PROMPT])
    _server(closing, cls, engine, eid)
    raw = zmq.Context.instance().socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    closing.append(raw)
    raw.connect(protocol.socket_path(eid, 0))
    good = protocol.encode_request(1, "x", [1, 2, 3], "", None)
    for frames in ([b"\xff\x00garbage"], [b"not json", b"12345678"], [b"[1, 2]", b""],
                   [b'{"v": 99, "seq": 1}', b""], [b'{"v": 1, "seq": 1}', b"odd"],
                   [good[0], good[1], b"third"], [b'{"v": 1}', b""]):
        raw.send_multipart(frames)
    client = _client(closing, eid)
    assert client.lookup(PROMPT.tolist(), "after-garbage") == 3 * CHUNK, "the server still answers"


def test_lookups_the_scheduler_gave_up_on_are_not_run(closing):
    """A lookup stuck on a slow remote must not leave a queue of expired lookups behind it that
    each hold chunks and wait again: the server answers those 0 at once."""

    class SlowEngine:
        calls: list[str] = []

        def lookup(self, tokens, reserve=False, *, lookup_id=None, **kw):
            self.calls.append(lookup_id)
            time.sleep(1.2)  # past the first client's 500 ms and the second's, sent 500 ms later
            return 0

    engine = SlowEngine()
    eid = _engine_id()
    server = _server(closing, LMCacheLookupServer, engine, eid)
    first, second = _client(closing, eid), _client(closing, eid)
    assert first.lookup(PROMPT.tolist(), "slow") == 0      # times out at 500 ms; the server is busy
    assert second.lookup(PROMPT.tolist(), "queued") == 0   # queued behind it past its own deadline
    time.sleep(1.0)
    assert engine.calls == ["slow"] and server.skipped_expired == 1



def test_a_slow_tier_is_cut_at_the_schedulers_deadline_and_the_prefix_that_arrived_is_the_answer(closing,
                                                                                                    tmp_path):
    """Chunk 0 in the CPU tier, chunk 1 on the disk, chunk 2 on a disk that stalls: the server hands
    the client's deadline to the lookup, whose reads stop before it, so the scheduler gets the two
    chunks in time instead of a timeout's 0."""
    from types import SimpleNamespace

    from slow_tier import open_gates, slow_down, wait_until

    from lmcache_triton.keys import KeyScope

    engine = _disk_engine(closing, tmp_path)
    caches = make_kv_caches("vllm_cpu", num_layers=LAYERS, num_blocks=BLOCKS, block_size=BLOCK, num_kv_heads=HEADS,
                            head_size=HEAD, generator=torch.Generator().manual_seed(0))
    slots = random_slot_mapping(len(PROMPT), num_blocks=BLOCKS, block_size=BLOCK,
                                generator=torch.Generator().manual_seed(1))
    assert engine.store(PROMPT, kvcaches=caches, slot_mapping=slots) == len(PROMPT)
    sm = engine.storage_manager
    sm.flush(timeout=10)
    keys = [key for _, _, key in engine.token_database.process_tokens(PROMPT, None, KeyScope())]
    assert sm.cpu.remove(keys[1]) and sm.cpu.remove(keys[2])
    slow = slow_down(sm, keys[2:])
    closing.append(SimpleNamespace(close=slow.gate.set))  # at teardown the stalled read ends before the engine closes
    eid = _engine_id()
    _server(closing, LMCacheLookupServer, engine, eid)
    client = LookupClient(eid, 1, timeout_ms=1000)
    closing.append(client)
    assert client.lookup(PROMPT.tolist(), "r") == 2 * CHUNK
    assert engine.get_stats().load_deadline_stops == 1
    engine.release_reservation("r")
    open_gates(sm)
    assert wait_until(lambda: sm.cpu.num_held == 0 and sm.cpu.contains(keys[2]))

# ---- chunk hashes instead of token ids (protocol v3, issue #14) -------------------------------------
from lmcache_triton.keys import ChunkHashes, TokenChain  # noqa: E402


def _hashes(tokens) -> ChunkHashes:
    return TokenChain(CHUNK).chunk_hashes(list(tokens))


def test_protocol_round_trip_with_hashes_and_with_tokens():
    prompt = list(range(100, 100 + 3 * CHUNK + 5))
    hashes = _hashes(prompt)
    frames = protocol.encode_request(7, "req", prompt, "salt", "lora:a:1", None, deadline=123.5, chunk_hashes=hashes)
    assert len(frames[1]) == 16 * 4, "16 bytes per span (3 chunks and the partial tail), no token ids"
    req = protocol.decode_request(frames)
    assert (req.seq, req.lookup_id, req.namespace, req.adapter, req.deadline) == (7, "req", "salt", "lora:a:1", 123.5)
    assert req.chunk_hashes == hashes and req.tokens is None
    assert req.lookup_args() == (len(prompt), dict(namespace="salt", adapter="lora:a:1", chunk_hashes=hashes))
    spans = [(3, 2, "img")]
    req = protocol.decode_request(protocol.encode_request(8, "ids", prompt, "", "", spans))
    assert req.tokens == prompt and req.mm_spans == spans and req.chunk_hashes is None
    assert req.lookup_args() == (prompt, dict(namespace="", adapter="", mm_spans=spans))
    bad = [frames[0], frames[1][:-1]]
    with pytest.raises(ValueError, match="hash frame"):
        protocol.decode_request(bad)
    v2 = [frames[0].replace(b'"v": 3', b'"v": 2'), frames[1]]
    with pytest.raises(ValueError, match="version"):
        protocol.decode_request(v2)
    with pytest.raises(ValueError, match="every span"):
        protocol.encode_request(9, "x", prompt, "", chunk_hashes=hashes.since(CHUNK))


def test_lookup_by_hashes_hits_isolates_namespaces_and_takes_the_tp_minimum(closing):
    eid = _engine_id()
    rank0 = _engine(closing, [PROMPT], namespace="salt")
    rank1 = _engine(closing, [PROMPT[: 2 * CHUNK]], namespace="salt")
    _server(closing, LMCacheLookupServer, rank0, eid, rank=0)
    _server(closing, LMCacheLookupServer, rank1, eid, rank=1)
    query = PROMPT.tolist() + [7] * 5
    one, two = _client(closing, eid), _client(closing, eid, world_size=2)
    assert one.lookup(query, "a", namespace="salt", chunk_hashes=_hashes(query)) == 3 * CHUNK
    assert rank0.storage_manager.cpu.num_held == 3, "the reported chunks are held for the load"
    assert one.lookup(query, "b", chunk_hashes=_hashes(query)) == 0, "another namespace never matches"
    assert one.lookup(query, "c", namespace="salt", adapter="lora:x:1", chunk_hashes=_hashes(query)) == 0
    assert two.lookup(query, "tp", namespace="salt", chunk_hashes=_hashes(query)) == 2 * CHUNK
    changed = [999] + query[1:]
    assert one.lookup(changed, "d", namespace="salt", chunk_hashes=_hashes(changed)) == 0


def test_keys_from_hashes_are_the_keys_from_tokens(closing):
    """A store by token ids is found by a lookup by hashes and the other way round, with the
    same storage keys: the plain API and the scheduler's hashes name chunks alike."""
    by_ids = _engine(closing, [PROMPT], namespace="salt")
    by_hashes = _engine(closing, namespace="salt")
    caches = make_kv_caches("vllm_cpu", num_layers=LAYERS, num_blocks=BLOCKS, block_size=BLOCK, num_kv_heads=HEADS,
                            head_size=HEAD)
    slots = random_slot_mapping(len(PROMPT), num_blocks=BLOCKS, block_size=BLOCK)
    hashes = _hashes(PROMPT)
    stored = by_hashes.store(len(PROMPT), kvcaches=caches, slot_mapping=slots[CHUNK:], offset=CHUNK,
                             namespace="salt", chunk_hashes=hashes.since(CHUNK))
    assert stored == 2 * CHUNK, "from chunk 1 on: the chunks before the hashes are skipped"
    assert by_hashes.store(PROMPT, kvcaches=caches, slot_mapping=slots, namespace="salt") == CHUNK
    assert set(by_ids.storage_manager.cpu.keys()) == set(by_hashes.storage_manager.cpu.keys())
    assert by_ids.lookup(len(PROMPT), namespace="salt", chunk_hashes=hashes) == len(PROMPT)
    assert by_ids.lookup(len(PROMPT), chunk_hashes=hashes) == 0
    with pytest.raises(ValueError, match="from the first chunk"):
        by_ids.lookup(len(PROMPT), namespace="salt", chunk_hashes=hashes.since(CHUNK))
