"""Remote tier throughput over loopback: `python -m bench.storage_remote [--reps N] [--no-redis]`.

One 32 MiB chunk (Llama-3-8B, 256 tokens: [2, 32 layers, 256, 8 heads * 128] bfloat16) through:
- lm:// raw zmq   a bare ROUTER that keeps/returns the bytes (the transport's ceiling)
- lm:// client    CacheServerClient put/get of the serde bytes (wire format + server, no serde)
- lm:// backend   CacheServerBackend put/get of a MemoryObj (serialize; read back, checksum, copy)
- redis raw       redis-py SET/GET of the serde bytes
- redis backend   RedisBackend put/get of a MemoryObj
- cluster raw     redis-py's cluster client SET/GET on a three-master Redis Cluster (redis-cli --cluster create)
- cluster backend RedisClusterBackend put/get of a MemoryObj on that cluster
GB/s = chunk bytes / median seconds per call; every row is measured in the same run.
"""

from __future__ import annotations

import argparse
import itertools
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import zmq

from bench.common import context, median_seconds, write_json
from lmcache_triton.storage.memory import MemoryFormat, TensorMemoryPool
from lmcache_triton.storage import serde
from lmcache_triton.storage.remote import CacheServerClient, create_remote_backend
from lmcache_triton.keys import CacheEngineKey

SHAPE = (2, 32, 256, 1024)  # Llama-3-8B: 32 layers, 8 KV heads x 128, 256 tokens
DTYPE = torch.bfloat16

_RAW_ZMQ_SERVER = """
import sys, zmq
s = zmq.Context().socket(zmq.ROUTER); s.bind("tcp://127.0.0.1:" + sys.argv[1])
stored = b""
while True:
    ident, op, *rest = s.recv_multipart(copy=False)
    if op.bytes == b"P":
        stored = rest[0]
        s.send_multipart([ident, b"ok"], copy=False)
    else:
        s.send_multipart([ident, stored], copy=False)
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_for(cond: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + 10
    while not cond():
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} did not start")
        time.sleep(0.05)


def _bench_backend(url: str, obj, key, pool, reps: int) -> tuple[float, float]:
    b = create_remote_backend(url, None, compression="naive", timeout_s=30.0, auth_token=None)
    # every put under a key not stored yet: a put of a stored key is one EXISTS (keys name their
    # content), which timed the duplicate check, not the transfer (83-153 "GB/s" before)
    fresh = (key._replace(chunk_hash=f"{i:032x}") for i in itertools.count(1))
    stored: list = []

    def put() -> None:
        stored.append(next(fresh))
        assert b.put(stored[-1], obj), f"put to {url} failed: {b.stats()}"

    def get() -> None:
        got = b.get(stored[-1], pool.allocate)
        assert got is not None, f"get from {url} missed: {b.stats()}"
        got.free()

    result = median_seconds(put, reps), median_seconds(get, reps)
    for k in stored:
        b.remove(k)
    b.close()
    return result


def _start_cluster(exe: str, procs: list[subprocess.Popen], tmp: Path, masters: int = 3):
    """A Redis Cluster of `masters` masters on loopback (every slot assigned, no replicas):
    (its redis-cluster:// url, a redis-py cluster client)."""
    import redis
    from redis.cluster import ClusterNode, RedisCluster

    ports = [_free_port() for _ in range(masters)]
    for i, port in enumerate(ports):
        d = tmp / f"node{i}"
        d.mkdir()
        procs.append(subprocess.Popen([exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                                       "--appendonly", "no", "--cluster-enabled", "yes", "--cluster-port",
                                       str(_free_port()), "--dir", str(d), "--cluster-config-file",
                                       str(d / "nodes.conf")], stdout=subprocess.DEVNULL))
    nodes = [redis.Redis(host="127.0.0.1", port=p) for p in ports]

    def answers(r) -> bool:
        try:
            return bool(r.ping())
        except redis.RedisError:
            return False

    for r in nodes:
        _wait_for(lambda: answers(r), "redis-server (cluster node)")
    subprocess.run(["redis-cli", "--cluster", "create", *(f"127.0.0.1:{p}" for p in ports), "--cluster-replicas",
                    "0", "--cluster-yes"], check=True, stdout=subprocess.DEVNULL, timeout=60)
    _wait_for(lambda: all(r.cluster("info").get("cluster_state") == "ok" for r in nodes), "cluster_state:ok")
    return (f"redis-cluster://127.0.0.1:{ports[0]}",
            RedisCluster(startup_nodes=[ClusterNode("127.0.0.1", p) for p in ports]))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.storage_remote", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=11)
    ap.add_argument("--no-redis", action="store_true")
    args = ap.parse_args(argv)

    pool = TensorMemoryPool(3 * 2 * 32 * 256 * 1024 * 2, pin_memory=False)
    obj = pool.allocate(SHAPE, DTYPE, MemoryFormat.KV_2LTD)
    obj.tensor.copy_(torch.randn(SHAPE, generator=torch.Generator().manual_seed(0)))
    key = CacheEngineKey("bench/llama-3-8b", 1, 0, "bfloat16", "KV_2LTD", "0" * 32)
    data = serde.serialize(key, obj.tensor, obj.fmt)
    nbytes = obj.tensor.numel() * obj.tensor.element_size()
    procs: list[subprocess.Popen] = []
    rows: list[dict] = []

    def row(name: str, put_s: float, get_s: float) -> None:
        rows.append({"path": name, "put_GBps": nbytes / put_s / 1e9, "get_GBps": nbytes / get_s / 1e9,
                     "put_ms": put_s * 1e3, "get_ms": get_s * 1e3})

    tmp = Path(tempfile.mkdtemp(prefix="bench-remote-"))
    try:
        # raw zmq ceiling
        port = _free_port()
        procs.append(subprocess.Popen([sys.executable, "-c", _RAW_ZMQ_SERVER, str(port)]))
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(f"tcp://127.0.0.1:{port}")

        def raw_put() -> None:
            sock.send_multipart([b"P", data], copy=False)
            sock.recv_multipart(copy=False)

        def raw_get() -> None:
            sock.send_multipart([b"G"])
            sock.recv_multipart(copy=False)

        row("lm:// raw zmq", median_seconds(raw_put, args.reps), median_seconds(raw_get, args.reps))
        sock.close(0)

        # the cache server
        port = _free_port()
        procs.append(subprocess.Popen([sys.executable, "-m", "lmcache_triton.server.cache_server", "--port",
                                       str(port), "--max-size-gb", "1", "--log-level", "WARNING"]))
        client = CacheServerClient("127.0.0.1", port, timeout_s=30.0)
        _wait_for(lambda: client.health(0.2), "cache server")
        k = key.to_string().encode()
        row("lm:// client", median_seconds(lambda: client.put(k, data), args.reps), median_seconds(lambda: client.get(k), args.reps))
        client.close()
        row("lm:// backend", *_bench_backend(f"lm://127.0.0.1:{port}", obj, key, pool, args.reps))

        # redis
        exe = shutil.which("redis-server")
        if args.no_redis or exe is None:
            print("redis: skipped" + ("" if args.no_redis else " (redis-server not installed)"))
        else:
            import redis

            port = _free_port()
            procs.append(subprocess.Popen([exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                                           "--appendonly", "no"], stdout=subprocess.DEVNULL))
            r = redis.Redis(host="127.0.0.1", port=port)

            def up() -> bool:
                try:
                    return bool(r.ping())
                except redis.RedisError:
                    return False

            _wait_for(up, "redis-server")
            row("redis raw SET/GET", median_seconds(lambda: r.set("raw", data), args.reps),
                median_seconds(lambda: r.get("raw"), args.reps))
            row("redis backend", *_bench_backend(f"redis://127.0.0.1:{port}/0", obj, key, pool, args.reps))
            if shutil.which("redis-cli") is None:
                print("redis cluster: skipped (redis-cli not installed)")
            else:
                url, rc = _start_cluster(exe, procs, tmp)
                row("cluster raw SET/GET", median_seconds(lambda: rc.set("raw", data), args.reps),
                    median_seconds(lambda: rc.get("raw"), args.reps))
                row("cluster backend", *_bench_backend(url, obj, key, pool, args.reps))
    finally:
        for p in procs:
            p.kill()
            p.wait()
        shutil.rmtree(tmp, ignore_errors=True)

    ctx = context()
    print(f"remote tier, one {nbytes / 2**20:.0f} MiB chunk {list(SHAPE)} {DTYPE}, loopback, median of {args.reps}"
          f" ({ctx['device']}, commit {ctx['commit']})")
    print(f"{'path':<20} {'put GB/s':>9} {'get GB/s':>9} {'put ms':>8} {'get ms':>8}")
    for x in rows:
        print(f"{x['path']:<20} {x['put_GBps']:>9.2f} {x['get_GBps']:>9.2f} {x['put_ms']:>8.1f} {x['get_ms']:>8.1f}")
    path = write_json("storage_remote", {**ctx, "chunk_bytes": nbytes, "shape": list(SHAPE), "dtype": str(DTYPE),
                                         "reps": args.reps, "rows": rows})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
