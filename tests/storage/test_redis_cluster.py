"""RedisClusterBackend against a real three-master Redis Cluster (redis-server --cluster-enabled,
joined by `redis-cli --cluster create`), on loopback ports; skipped, with the reason, without them."""

from __future__ import annotations

import shutil
import subprocess
import time
from types import SimpleNamespace

import pytest
import torch

from lmcache_triton.storage import serde
from lmcache_triton.storage.redis_cluster import RedisClusterBackend
from lmcache_triton.storage.remote import create_remote_backend

pytestmark = pytest.mark.slow

TIMEOUT_S = 0.5
SLACK_S = 0.5
MASTERS = 3


def _cluster_state(port: int, password: str | None) -> str:
    import redis

    try:
        info = redis.Redis(host="127.0.0.1", port=port, password=password, socket_timeout=1).cluster("info")
    except redis.RedisError:
        return "unreachable"
    return str(info.get("cluster_state", "?"))


@pytest.fixture
def start_cluster(start_redis_server, free_port, tmp_path):
    """start_cluster(password=None) -> SimpleNamespace(nodes, url, password): MASTERS masters, every
    slot assigned, no replicas, `cluster-require-full-coverage no` (a dead master costs its slots only)."""
    cli = shutil.which("redis-cli")
    if cli is None:
        pytest.skip("redis-cli not installed (Debian: redis-tools): it creates the test cluster")

    def start(password: str | None = None) -> SimpleNamespace:
        auth = ["--requirepass", password, "--masterauth", password] if password else []
        nodes = []
        for i in range(MASTERS):
            d = tmp_path / f"node{i}"
            d.mkdir()
            nodes.append(start_redis_server(
                "--cluster-enabled", "yes", "--cluster-port", str(free_port()), "--dir", str(d),
                "--cluster-config-file", str(d / "nodes.conf"), "--cluster-node-timeout", "2000",
                "--cluster-require-full-coverage", "no", *auth))
        addresses = [f"127.0.0.1:{n.port}" for n in nodes]
        out = subprocess.run([cli, *(["-a", password, "--no-auth-warning"] if password else []), "--cluster",
                              "create", *addresses, "--cluster-replicas", "0", "--cluster-yes"],
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, f"redis-cli --cluster create failed:\n{out.stdout}\n{out.stderr}"
        deadline = time.monotonic() + 20
        while any(_cluster_state(n.port, password) != "ok" for n in nodes):
            assert time.monotonic() < deadline, "the cluster did not reach cluster_state:ok"
            time.sleep(0.1)
        user = f":{password}@" if password else ""
        return SimpleNamespace(nodes=nodes, password=password,
                               url=f"redis-cluster://{user}{addresses[0]},{addresses[1]}")  # two seeds of three

    return start


@pytest.fixture
def cluster(start_cluster):
    return start_cluster()


def backend_for(url: str, metadata=None, **kw) -> RedisClusterBackend:
    kw.setdefault("timeout_s", TIMEOUT_S)
    b = create_remote_backend(url, metadata, **kw)
    assert isinstance(b, RedisClusterBackend)
    return b


def raw(cluster):
    from redis.cluster import ClusterNode, RedisCluster

    return RedisCluster(startup_nodes=[ClusterNode("127.0.0.1", n.port) for n in cluster.nodes],
                        password=cluster.password, socket_timeout=2)


def _chunks(pool, make_chunk, n: int, first_seed: int = 100):
    return [make_chunk(pool, seed=first_seed + i) for i in range(n)]


def _owner_port(r, key) -> int:
    return r.get_node_from_key("lmct:" + key.to_string()).port


@pytest.mark.parametrize("compression", ["naive", "lz4"])
def test_round_trip_exact_bytes_spread_over_every_master(cluster, pool, make_chunk, kv_metadata, compression):
    b = backend_for(cluster.url, kv_metadata, compression=compression)
    r = raw(cluster)
    chunks = _chunks(pool, make_chunk, 12)
    assert b.batched_contains([k for _, k in chunks]) == [False] * 12
    for obj, key in chunks:
        assert b.put(key, obj)
    assert {_owner_port(r, k) for _, k in chunks} == {n.port for n in cluster.nodes}, "keys spread over the slots"
    for obj, key in chunks:
        assert r.get("lmct:" + key.to_string()) == serde.serialize(key, obj.tensor, obj.fmt, compression)
        got = b.get(key, pool.allocate)
        assert got is not None and torch.equal(got.tensor.view(torch.uint8), obj.tensor.view(torch.uint8))
        got.free()
    assert b.batched_contains([k for _, k in chunks]) == [True] * 12
    assert b.remove(chunks[0][1]) and b.get(chunks[0][1], pool.allocate) is None
    s = b.stats()
    assert (s.hits, s.misses, s.errors, s.corrupt) == (12, 1, 0, 0)
    b.close()


def test_two_processes_share_chunks(cluster, two_hosts):
    two_hosts(cluster.url, backend_for(cluster.url))


def test_killed_master_costs_misses_on_its_slots_only(cluster, pool, make_chunk, kv_metadata):
    b = backend_for(cluster.url, kv_metadata)
    r = raw(cluster)
    chunks = _chunks(pool, make_chunk, 15, first_seed=200)
    for obj, key in chunks:
        assert b.put(key, obj)
    victim = cluster.nodes[2]  # not a seed of the URL: the client learns of it from the slot map
    on_victim = [_owner_port(r, k) == victim.port for _, k in chunks]
    assert any(on_victim) and not all(on_victim)
    victim.kill()
    for _ in range(3):  # the failure, then the back-off, then again: never an error, never wrong bytes
        t = time.monotonic()
        assert b.batched_contains([k for _, k in chunks]) == [not v for v in on_victim]
        for (obj, key), dead in zip(chunks, on_victim):
            got = b.get(key, pool.allocate)
            if dead:
                assert got is None
            else:
                assert got is not None and torch.equal(got.tensor.view(torch.uint8), obj.tensor.view(torch.uint8))
                got.free()
        assert time.monotonic() - t < TIMEOUT_S * 3 + SLACK_S * 2, "a dead master costs one timeout, then skips"
        time.sleep(0.3)
    new, new_key = make_chunk(pool, seed=300)
    assert b.put(new_key, new) == (_owner_port(r, new_key) != victim.port)
    assert b.stats().errors >= 1 and b.stats().corrupt == 0


def test_unreachable_cluster_is_quick_misses_and_the_engine_starts(free_port, pool, make_chunk):
    pytest.importorskip("redis")
    b = backend_for(f"redis-cluster://127.0.0.1:{free_port()},127.0.0.1:{free_port()}", timeout_s=10.0)
    obj, key = make_chunk(pool, seed=6)
    t = time.monotonic()
    for _ in range(50):
        assert b.get(key, pool.allocate) is None and not b.put(key, obj) and not b.contains(key)
    assert time.monotonic() - t < 1.0 + SLACK_S
    assert b.stats().misses == 50


def test_password(start_cluster, pool, make_chunk):
    c = start_cluster(password="pw")
    obj, key = make_chunk(pool, seed=4)
    wrong = c.url.replace(":pw@", ":nope@")
    assert not backend_for(wrong).put(key, obj)
    anonymous = c.url.replace(":pw@", "")
    assert not backend_for(anonymous).put(key, obj)
    assert backend_for(anonymous, auth_token="pw").put(key, obj)  # remote_auth_token, as for one Redis
    b = backend_for(c.url)
    got = b.get(key, pool.allocate)
    assert got is not None and torch.equal(got.tensor, obj.tensor)
    assert "pw" not in b.url


_ENGINE = """
import sys, torch
from lmcache_triton import LMCacheEngineBuilder, LMCacheEngineConfig, LMCacheEngineMetadata, create_gpu_connector
url, role, path = sys.argv[1:4]
config = LMCacheEngineConfig.from_defaults(chunk_size=64, max_local_cpu_size=0.05, remote_url=url, remote_serde="lz4")
md = LMCacheEngineMetadata(model_name="test/cluster", world_size=1, worker_id=0, kv_dtype=torch.bfloat16,
                           kv_shape=(2, 2, 64, 2, 32))
engine = LMCacheEngineBuilder.get_or_create(role, config, md, create_gpu_connector(config, md, "flash_attn"))
tokens = torch.arange(1000, 1256)
slots = torch.randperm(32 * 16)[:256]
if role == "writer":
    caches = [torch.randn(2, 32, 16, 2, 32).to(torch.bfloat16) for _ in range(2)]
    engine.store(tokens, kvcaches=caches, slot_mapping=slots)
    engine.storage_manager.flush(30)
    torch.save({"caches": caches, "slots": slots}, path)
else:
    src = torch.load(path)
    slots = src["slots"]
    assert engine.lookup(tokens) == 256, "the other engine's chunks are not all in the cluster"
    dst = [torch.zeros(2, 32, 16, 2, 32, dtype=torch.bfloat16) for _ in range(2)]
    mask = engine.retrieve(tokens, kvcaches=dst, slot_mapping=slots)
    assert int(mask.sum()) == 256
    for a, b in zip(src["caches"], dst):
        flat_a, flat_b = a.flatten(1, 2), b.flatten(1, 2)
        assert torch.equal(flat_a[:, slots], flat_b[:, slots]), "wrong bytes"
LMCacheEngineBuilder.destroy(role)
print("ok")
"""


def test_two_engines_in_two_processes_share_a_prompt(cluster, tmp_path):
    """One engine stores a prompt through the cluster, another in its own process loads it: bit for bit."""
    import sys

    path = str(tmp_path / "kv.pt")
    for role in ("writer", "reader"):
        out = subprocess.run([sys.executable, "-c", _ENGINE, cluster.url, role, path], capture_output=True,
                             text=True, timeout=120)
        assert out.returncode == 0 and out.stdout.strip().endswith("ok"), f"{role}:\n{out.stdout}\n{out.stderr[-3000:]}"
    counts = [raw_node_keys(n.port) for n in cluster.nodes]
    assert sum(counts) == 4 and sum(c > 0 for c in counts) >= 2, f"4 chunks spread over the masters: {counts}"


def raw_node_keys(port: int) -> int:
    import redis

    return redis.Redis(host="127.0.0.1", port=port, socket_timeout=2).dbsize()
