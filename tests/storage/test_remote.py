"""CacheServerBackend (lm://) against a real server subprocess: round trips, outages, corruption."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import torch

from lmcache_triton.storage import serde
from lmcache_triton.storage.redis_backend import RedisBackend
from lmcache_triton.storage.remote import CacheServerBackend, CacheServerClient, create_remote_backend

pytestmark = pytest.mark.slow

TIMEOUT_S = 0.5
SLACK_S = 0.5


def backend_for(server, metadata=None, **kw) -> CacheServerBackend:
    kw.setdefault("timeout_s", TIMEOUT_S)
    return create_remote_backend(server.url, metadata, **kw)


def raw_client(server, **kw) -> CacheServerClient:
    return CacheServerClient("127.0.0.1", server.port, timeout_s=2.0, **kw)


def wait_until(cond, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.05)
    return False


@pytest.mark.parametrize("compression", ["naive", "lz4"])
def test_chunk_round_trip_exact_bytes(cache_server, pool, make_chunk, kv_metadata, compression) -> None:
    b = backend_for(cache_server, kv_metadata, compression=compression)
    obj, key = make_chunk(pool, seed=1)
    assert not b.contains(key)
    assert b.put(key, obj)
    assert b.contains(key)
    # what the server holds is exactly the serde bytes of the chunk
    stored = raw_client(cache_server).get(key.to_string().encode())
    assert bytes(stored) == serde.serialize(key, obj.tensor, obj.fmt, compression)
    got = b.get(key, pool.allocate)
    assert got is not None and got is not obj
    assert got.fmt == obj.fmt and got.dtype == obj.dtype
    assert torch.equal(got.tensor.view(torch.uint8), obj.tensor.view(torch.uint8))  # bit-exact
    assert b.remove(key) and not b.contains(key) and b.get(key, pool.allocate) is None
    s = b.stats()
    assert (s.puts, s.hits, s.misses, s.errors, s.corrupt) == (1, 1, 1, 0, 0)
    assert (s.chunks, s.used_bytes, s.capacity_bytes, s.evictions) == (None,) * 4, "not known to a client"
    # the bytes it moved are the stored chunk's (compressed, header included), once each way
    assert s.written_bytes == s.read_bytes == len(stored)
    assert s.write_seconds > 0 and s.read_seconds > 0
    b.close()


def test_batched_contains_many_keys(cache_server, pool, make_chunk) -> None:
    b = backend_for(cache_server)
    obj, key = make_chunk(pool, seed=2)
    assert b.put(key, obj)
    others = [key.__class__(key.model_name, 1, 0, key.dtype, key.fmt, f"{i:032x}") for i in range(5000, 10000)]
    found = b.batched_contains(others[:2500] + [key] + others[2500:])  # 5001 keys: two EXISTS requests
    assert found == [False] * 2500 + [True] + [False] * 2500
    assert b.batched_contains([]) == []


def test_two_processes_share_chunks(cache_server, two_hosts) -> None:
    two_hosts(cache_server.url, backend_for(cache_server))


def _assert_fail_soft(b, pool, obj, key) -> None:
    """Every call returns a miss/False within the timeout (+ slack), never an exception."""
    for call, expected in [
        (lambda: b.put(key, obj), False),
        (lambda: b.get(key, pool.allocate), None),
        (lambda: b.contains(key), False),
        (lambda: b.batched_contains([key, key]), [False, False]),
        (lambda: b.remove(key), False),
    ] * 4:
        t = time.monotonic()
        assert call() == expected
        assert time.monotonic() - t < TIMEOUT_S + SLACK_S


def test_server_killed_mid_run_then_restarted(cache_server, pool, make_chunk) -> None:
    b = backend_for(cache_server)
    obj, key = make_chunk(pool, seed=3)
    assert b.put(key, obj)
    cache_server.kill()
    _assert_fail_soft(b, pool, obj, key)
    assert b.stats().errors >= 1
    assert pool.used_bytes == obj.nbytes  # a failed get leaves nothing allocated
    cache_server.start()  # same port, empty (no --disk)
    assert wait_until(lambda: b.put(key, obj)), "backend did not reconnect to the restarted server"
    got = b.get(key, pool.allocate)
    assert got is not None and torch.equal(got.tensor, obj.tensor)


def test_frozen_server_costs_timeouts_not_hangs(cache_server, pool, make_chunk) -> None:
    b = backend_for(cache_server)
    obj, key = make_chunk(pool, seed=4)
    assert b.put(key, obj)
    os.kill(cache_server.proc.pid, signal.SIGSTOP)  # connected, but never answers
    try:
        _assert_fail_soft(b, pool, obj, key)
    finally:
        os.kill(cache_server.proc.pid, signal.SIGCONT)
    assert wait_until(lambda: b.get(key, pool.allocate) is not None)


def test_a_frozen_server_is_skipped_for_as_long_as_its_timeout_cost(cache_server, pool, make_chunk) -> None:
    """A call that waited out the whole timeout backs the remote off for at least that long: the
    next caller, even one that comes after the 0.1 s minimum back-off, misses at once instead of
    waiting the timeout again."""
    b = backend_for(cache_server, timeout_s=1.0)
    obj, key = make_chunk(pool, seed=6)
    assert b.put(key, obj)
    os.kill(cache_server.proc.pid, signal.SIGSTOP)  # connected, but never answers
    try:
        t = time.monotonic()
        assert b.get(key, pool.allocate) is None
        assert time.monotonic() - t >= 0.9, "the first call waits for the timeout"
        time.sleep(0.3)  # past the minimum back-off
        t = time.monotonic()
        assert b.get(key, pool.allocate) is None
        assert time.monotonic() - t < 0.3, "backed off: no second wait"
    finally:
        os.kill(cache_server.proc.pid, signal.SIGCONT)
    assert wait_until(lambda: b.get(key, pool.allocate) is not None)


def test_persisted_chunks_survive_server_restart(start_cache_server, tmp_path, pool, make_chunk) -> None:
    server = start_cache_server("--disk", str(tmp_path))
    b = backend_for(server)
    obj, key = make_chunk(pool, seed=5)
    assert b.put(key, obj)
    server.kill()
    assert b.get(key, pool.allocate) is None
    server.start()
    got = None

    def hit() -> bool:
        nonlocal got
        got = b.get(key, pool.allocate)
        return got is not None

    assert wait_until(hit)
    assert torch.equal(got.tensor, obj.tensor)


def test_unreachable_from_start_is_quick_misses(free_port, pool, make_chunk) -> None:
    # the config's default 10 s timeout: waiting for a connection is capped at 1 s, then back-off
    b = create_remote_backend(f"lm://127.0.0.1:{free_port()}", None, timeout_s=10.0)
    obj, key = make_chunk(pool, seed=6)
    t = time.monotonic()
    for _ in range(50):
        assert b.get(key, pool.allocate) is None
        assert not b.put(key, obj)
        assert not b.contains(key)
    assert time.monotonic() - t < 1.0 + SLACK_S
    s = b.stats()
    assert s.misses == 50 and s.put_failures == 50 and s.skipped_unavailable > 100


def test_corrupt_payload_is_a_counted_miss(cache_server, pool, make_chunk, kv_metadata) -> None:
    b = backend_for(cache_server, kv_metadata)
    raw = raw_client(cache_server)
    obj, key = make_chunk(pool, seed=7)
    k = key.to_string().encode()
    good = serde.serialize(key, obj.tensor, obj.fmt)
    flipped = bytearray(good)
    flipped[-100] ^= 0x01  # one bit in the payload
    used = pool.used_bytes
    for bad in (bytes(flipped), good[:-1], b"not a safetensors file"):
        raw.put(k, bad)
        assert b.get(key, pool.allocate) is None
        assert pool.used_bytes == used  # the object allocated for it was freed
        assert raw.get(k) is None  # deleted, so the next store of this chunk is not blocked by it
    # a valid chunk under the wrong key is not served either
    raw.put(k, serde.serialize(key.__class__("test/model", 1, 0, "bfloat16", "KV_2LTD", "f" * 32), obj.tensor, obj.fmt))
    assert b.get(key, pool.allocate) is None
    s = b.stats()
    assert s.corrupt == 4 and s.misses == 4 and s.hits == 0


def test_chunk_of_another_engine_is_a_miss(cache_server, pool, make_chunk, kv_metadata) -> None:
    obj, key = make_chunk(pool, seed=8, tokens=32)  # more tokens than the engine's chunk_size of 16
    assert backend_for(cache_server).put(key, obj)
    b = backend_for(cache_server, kv_metadata)
    assert b.get(key, pool.allocate) is None and b.stats().corrupt == 1


def test_no_room_in_cpu_tier_is_a_plain_miss(cache_server, pool, make_chunk) -> None:
    b = backend_for(cache_server)
    obj, key = make_chunk(pool, seed=9)
    assert b.put(key, obj)
    assert b.get(key, lambda *a: None) is None
    s = b.stats()
    assert s.misses == 1 and s.corrupt == 0 and s.errors == 0
    assert b.contains(key)


def test_wrong_auth_token_is_fail_soft(start_cache_server, pool, make_chunk) -> None:
    server = start_cache_server("--auth-token", "right")
    obj, key = make_chunk(pool, seed=12)
    bad = backend_for(server, auth_token="wrong")
    assert not bad.put(key, obj) and bad.get(key, pool.allocate) is None and not bad.contains(key)
    assert bad.stats().errors == 3
    good = backend_for(server, auth_token="right")
    assert good.put(key, obj) and good.get(key, pool.allocate) is not None


def test_threads_share_one_backend(cache_server, pool, make_chunk) -> None:
    b = backend_for(cache_server, timeout_s=5.0)
    chunks = [make_chunk(pool, seed=100 + i) for i in range(16)]
    errors: list[str] = []

    def work(i: int) -> None:
        obj, key = chunks[i]
        for _ in range(5):
            if not b.put(key, obj):
                errors.append(f"put {i}")
            got = b.get(key, pool.allocate)
            if got is None or not torch.equal(got.tensor, obj.tensor):
                errors.append(f"get {i}")
            elif got is not None:
                got.free()

    threads = [threading.Thread(target=work, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and b.stats().errors == 0


def test_create_remote_backend_dispatch() -> None:
    assert isinstance(create_remote_backend("lm://127.0.0.1:1", None), CacheServerBackend)
    for url in ("redis://127.0.0.1:1/0", "rediss://127.0.0.1:1", "valkey://127.0.0.1:1"):
        assert isinstance(create_remote_backend(url, None), RedisBackend)
    with pytest.raises(ValueError, match="unsupported remote url scheme 'http'"):
        create_remote_backend("http://x:1", None)
    with pytest.raises(ValueError, match="lm://host:port"):
        create_remote_backend("lm://hostonly", None)
    with pytest.raises(ValueError, match="compression"):
        create_remote_backend("lm://127.0.0.1:1", None, compression="zstd")


def test_malformed_replies_raise_remote_error_only() -> None:
    """A server answering well-framed nonsense (a bitmap of the wrong size, STATS that is not JSON)
    gives the client's callers a RemoteError, the one exception its contract names."""
    import threading

    import zmq

    from lmcache_triton.server import wire
    from lmcache_triton.storage.remote import CacheServerClient, RemoteError

    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            if not sock.poll(50):
                continue
            identity, *frames = sock.recv_multipart()
            req = wire.decode_request(frames, wire.Limits())
            sock.send_multipart([identity, *wire.encode_reply(wire.Status.OK, req.command, req.request_id,
                                                              [b"\xff" * 100], 0)])

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    client = CacheServerClient("127.0.0.1", port, timeout_s=2)
    try:
        with pytest.raises(RemoteError, match="EXISTS"):
            client.exists([b"a", b"b"])
        with pytest.raises(RemoteError, match="STATS"):
            client.stats()
    finally:
        client.close()
        stop.set()
        thread.join(2)
        sock.close(0)
        ctx.term()


def test_refused_port_is_told_at_once_not_after_the_connect_wait(cache_server, free_port) -> None:
    """A killed server's port refuses connections: the client says so instead of waiting out ZMQ's
    silent retries (which made every lookup that reached a dead server cost the connect timeout)."""
    from lmcache_triton.storage.remote import RemoteUnavailable
    from lmcache_triton.server.wire import Command

    dead = CacheServerClient("127.0.0.1", free_port(), timeout_s=5.0, connect_timeout_s=5.0)
    with pytest.raises(RemoteUnavailable, match="connection refused"):
        dead.request(Command.HEALTH)
    live = CacheServerClient("127.0.0.1", cache_server.port, timeout_s=5.0, connect_timeout_s=5.0)
    assert live.health()
    cache_server.kill()
    with pytest.raises(RemoteUnavailable, match="refused|no reply|broke|lost"):
        live.request(Command.HEALTH)  # the open connection notices first, or the reconnect is refused
    with pytest.raises(RemoteUnavailable, match="connection refused"):
        live.request(Command.HEALTH)
    dead.close(), live.close()


def test_server_dying_mid_request_is_told_at_once_not_after_the_timeout(cache_server) -> None:
    """A request in flight when its server dies is lost with the connection; ZMQ says nothing to
    the socket, so without the disconnect monitor it waited out the whole timeout (in the fault
    suite: 5 s of lookups stuck behind it, every prompt after the kill a miss)."""
    import threading
    from lmcache_triton.storage.remote import RemoteUnavailable
    from lmcache_triton.server.wire import Command

    client = CacheServerClient("127.0.0.1", cache_server.port, timeout_s=20.0)
    assert client.health()
    os.kill(cache_server.proc.pid, signal.SIGSTOP)  # the next request is sent, and never answered
    outcome: dict = {}

    def ask() -> None:
        t = time.monotonic()
        try:
            client.request(Command.HEALTH)
        except RemoteUnavailable as e:
            outcome["error"] = str(e)
        outcome["seconds"] = time.monotonic() - t

    asker = threading.Thread(target=ask)
    asker.start()
    time.sleep(0.3)  # the request is on the wire
    assert "seconds" not in outcome, "a stopped server answered"
    cache_server.kill()
    asker.join(10)
    assert not asker.is_alive(), "the request waited past the server's death"
    assert "connection lost" in outcome.get("error", ""), outcome
    assert outcome["seconds"] < 0.3 + 3.0, outcome
    with pytest.raises(RemoteUnavailable, match="connection refused"):
        client.request(Command.HEALTH)  # and the dead port is then told at once
    client.close()
