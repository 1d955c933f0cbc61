"""RedisBackend against a real redis-server subprocess (skipped, with the reason, where none is installed)."""

from __future__ import annotations

import builtins
import subprocess
import sys
import time

import pytest
import torch

from lmcache_triton.storage import serde
from lmcache_triton.storage.redis_backend import RedisBackend, redis_url
from lmcache_triton.storage.remote import create_remote_backend

pytestmark = pytest.mark.slow

TIMEOUT_S = 0.5
SLACK_S = 0.5


def raw(server):
    import redis

    return redis.Redis(host="127.0.0.1", port=server.port, socket_timeout=2)


def backend_for(url: str, metadata=None, **kw) -> RedisBackend:
    kw.setdefault("timeout_s", TIMEOUT_S)
    return create_remote_backend(url, metadata, **kw)


@pytest.mark.parametrize("scheme", ["redis", "valkey"])
@pytest.mark.parametrize("compression", ["naive", "lz4"])
def test_round_trip_exact_bytes(redis_server, pool, make_chunk, kv_metadata, scheme, compression) -> None:
    b = backend_for(redis_server.url.replace("redis", scheme, 1), kv_metadata, compression=compression)
    obj, key = make_chunk(pool, seed=1)
    assert not b.contains(key)
    assert b.put(key, obj) and b.contains(key)
    assert raw(redis_server).get("lmct:" + key.to_string()) == serde.serialize(key, obj.tensor, obj.fmt, compression)
    got = b.get(key, pool.allocate)
    assert got is not None and torch.equal(got.tensor.view(torch.uint8), obj.tensor.view(torch.uint8))
    assert b.remove(key) and not b.remove(key) and b.get(key, pool.allocate) is None
    s = b.stats()
    assert (s.hits, s.misses, s.errors, s.corrupt) == (1, 1, 0, 0)
    b.close()


def test_batched_contains_is_one_pipeline(redis_server, pool, make_chunk) -> None:
    b = backend_for(redis_server.url)
    objs = [make_chunk(pool, seed=i) for i in range(3)]
    for obj, key in objs[:2]:
        assert b.put(key, obj)
    keys = [k for _, k in objs]
    assert b.batched_contains(keys * 100) == [True, True, False] * 100


def test_two_processes_share_chunks(redis_server, two_hosts) -> None:
    two_hosts(redis_server.url, backend_for(redis_server.url))


def test_corrupt_payload_is_a_counted_miss(redis_server, pool, make_chunk, kv_metadata) -> None:
    b = backend_for(redis_server.url, kv_metadata)
    r = raw(redis_server)
    obj, key = make_chunk(pool, seed=7)
    good = bytearray(serde.serialize(key, obj.tensor, obj.fmt))
    good[-7] ^= 0x80
    used = pool.used_bytes
    for bad in (bytes(good), b"\x00" * 64):
        r.set("lmct:" + key.to_string(), bad)
        assert b.get(key, pool.allocate) is None
        assert pool.used_bytes == used
        assert not r.exists("lmct:" + key.to_string())  # removed so it can be stored again
    s = b.stats()
    assert s.corrupt == 2 and s.misses == 2 and s.hits == 0


def test_oversized_value_is_refused_without_reading_it(redis_server, pool, make_chunk, kv_metadata) -> None:
    """A value far larger than any chunk of this engine (a valid chunk with 8 MiB of junk after it)
    is a miss, and what redis sends us stays within the engine's largest chunk."""
    b = backend_for(redis_server.url, kv_metadata)
    r = raw(redis_server)
    obj, key = make_chunk(pool, seed=5)
    bound = serde.max_serialized_nbytes(kv_metadata)
    r.set("lmct:" + key.to_string(), serde.serialize(key, obj.tensor, obj.fmt) + bytes(8 << 20))
    used = pool.used_bytes
    sent_before = r.info("stats")["total_net_output_bytes"]
    assert b.get(key, pool.allocate) is None
    sent = r.info("stats")["total_net_output_bytes"] - sent_before
    assert sent < bound + (64 << 10), f"redis sent {sent} bytes for a chunk of at most {bound}"
    assert pool.used_bytes == used
    s = b.stats()
    assert s.misses == 1 and s.hits == 0 and s.errors + s.corrupt == 1
    r.delete("lmct:" + key.to_string())
    assert b.put(key, obj)  # a value within the bound is read as before
    got = b.get(key, pool.allocate)
    assert got is not None and torch.equal(got.tensor, obj.tensor)


def test_killed_and_restarted_redis(redis_server, pool, make_chunk) -> None:
    b = backend_for(redis_server.url)
    obj, key = make_chunk(pool, seed=3)
    assert b.put(key, obj)
    redis_server.kill()
    for call, expected in [(lambda: b.put(key, obj), False), (lambda: b.get(key, pool.allocate), None),
                           (lambda: b.contains(key), False), (lambda: b.remove(key), False)] * 5:
        t = time.monotonic()
        assert call() == expected
        assert time.monotonic() - t < TIMEOUT_S + SLACK_S
    assert b.stats().errors >= 1
    redis_server.start()  # same port, empty: redis-py's pool reconnects by itself
    deadline = time.monotonic() + 5
    while not b.put(key, obj):
        assert time.monotonic() < deadline, "RedisBackend did not reconnect to the restarted server"
        time.sleep(0.05)
    got = b.get(key, pool.allocate)
    assert got is not None and torch.equal(got.tensor, obj.tensor)


def test_unreachable_from_start_is_quick_misses(free_port, pool, make_chunk) -> None:
    pytest.importorskip("redis")
    b = backend_for(f"redis://127.0.0.1:{free_port()}/0", timeout_s=10.0)
    obj, key = make_chunk(pool, seed=6)
    t = time.monotonic()
    for _ in range(50):
        assert b.get(key, pool.allocate) is None and not b.put(key, obj) and not b.contains(key)
    assert time.monotonic() - t < 1.0 + SLACK_S
    assert b.stats().misses == 50


def test_password(start_redis_server, pool, make_chunk) -> None:
    server = start_redis_server("--requirepass", "pw")
    obj, key = make_chunk(pool, seed=4)
    assert not backend_for(server.url).put(key, obj)
    assert backend_for(server.url, auth_token="pw").put(key, obj)
    url = server.url.replace("redis://", "redis://:pw@")
    b = backend_for(url)
    assert b.get(key, pool.allocate) is not None
    assert "pw" not in b.url  # the password never reaches logs or stats


def test_urls() -> None:
    assert redis_url("valkey://h:1/2") == "redis://h:1/2"
    assert redis_url("valkeys://h:1") == "rediss://h:1"
    assert redis_url("rediss://:p@h:1") == "rediss://:p@h:1"
    with pytest.raises(ValueError, match="no host"):
        redis_url("redis:///0")


def test_missing_redis_package_names_the_extra(monkeypatch) -> None:
    real_import = builtins.__import__

    def no_redis(name, *args, **kwargs):
        if name == "redis" or name.startswith("redis."):
            raise ImportError("No module named 'redis'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_redis)
    with pytest.raises(ImportError, match=r"lmcache-triton\[redis\]"):
        RedisBackend("redis://127.0.0.1:1")


def test_package_imports_without_redis() -> None:
    code = ("import sys; sys.modules['redis'] = None; "
            "import lmcache_triton.storage.redis_backend, lmcache_triton.storage.remote; print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "ok", out.stderr
