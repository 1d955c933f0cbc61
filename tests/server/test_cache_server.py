"""The cache server as a real subprocess: commands, limits, auth, hostile input, LRU, persistence."""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import zmq

from lmcache_triton.server import wire
from lmcache_triton.server.cache_server import (
    ReplyBudget,
    add_server_parser,
    add_stats_parser,
    config_from_args,
)
from lmcache_triton.server.wire import Command, Status
from lmcache_triton.storage import serde
from lmcache_triton.storage.chunk_files import ChunkFiles
from lmcache_triton.storage.local_disk import LocalDiskBackend
from lmcache_triton.storage.memory import MemoryFormat
from lmcache_triton.storage.remote import CacheServerClient, RemoteError, create_remote_backend

pytestmark = pytest.mark.slow


def client_for(server, **kw) -> CacheServerClient:
    return CacheServerClient("127.0.0.1", server.port, timeout_s=kw.pop("timeout_s", 2.0), **kw)


class RawPeer:
    """A DEALER that sends whatever bytes it is given: the hostile client."""

    def __init__(self, port: int, rcvhwm: int = 1000, rcvbuf: int | None = None) -> None:
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.RCVHWM, rcvhwm)
        if rcvbuf is not None:  # a tiny kernel buffer: what it does not read stays queued in the server
            self.sock.setsockopt(zmq.RCVBUF, rcvbuf)
        self.sock.connect(f"tcp://127.0.0.1:{port}")

    def ask(self, parts: list[bytes], timeout_ms: int = 2000) -> wire.Reply:
        self.sock.send_multipart(parts)
        assert self.sock.poll(timeout_ms), f"no reply to {[p[:20] for p in parts]}"
        return wire.decode_reply(self.sock.recv_multipart())

    def close(self) -> None:
        self.sock.close(0)


def test_commands_round_trip(cache_server) -> None:
    c = client_for(cache_server)
    value = bytes(range(256)) * 1000
    c.put(b"k1", value)
    assert bytes(c.get(b"k1")) == value
    assert c.get(b"missing") is None
    keys = [f"k{i}".encode() for i in range(5000)]  # > 4096: the client splits the EXISTS batch
    found = c.exists(keys)
    assert found[1] and sum(found) == 1 and len(found) == 5000
    c.put(b"k2", b"v2")
    assert c.list(10) == ([b"k2", b"k1"], False)  # most recently used first
    assert c.list(1) == ([b"k2"], True)
    assert c.delete(b"k1") and not c.delete(b"k1")
    stats = c.stats()
    assert stats["keys"] == 1 and stats["hits"] == 1 and stats["misses"] == 1 and stats["exists_keys"] == 5000
    assert c.health()
    c.close()


def test_auth_token(start_cache_server) -> None:
    server = start_cache_server("--auth-token", "s3cret")
    for bad in (client_for(server), client_for(server, auth_token="wrong")):
        with pytest.raises(RemoteError, match="AUTH_FAILED"):
            bad.get(b"k")
        with pytest.raises(RemoteError, match="AUTH_FAILED"):
            bad.put(b"k", b"v")
        assert bad.health()  # HEALTH is open on purpose: it reveals nothing
    good = client_for(server, auth_token="s3cret")
    good.put(b"k", b"v")
    assert bytes(good.get(b"k")) == b"v"
    assert good.stats()["auth_failures"] == 4


def test_auth_token_from_env(start_cache_server) -> None:
    server = start_cache_server(env={"LMCACHE_REMOTE_AUTH_TOKEN": "from-env"})
    with pytest.raises(RemoteError, match="AUTH_FAILED"):
        client_for(server).stats()
    assert client_for(server, auth_token="from-env").stats()["auth_failures"] == 1


def _header(command: int, rid: int, lengths: list[int], *, magic=wire.MAGIC_REQUEST, version=wire.VERSION) -> bytes:
    return (struct.pack("<4sBBHQ32sI", magic, version, command, 0, rid, wire.NO_AUTH, len(lengths))
            + b"".join(struct.pack("<Q", n) for n in lengths))


@pytest.mark.parametrize("parts, status", [
    pytest.param([b"garbage"], Status.BAD_REQUEST, id="short-header"),
    pytest.param([_header(1, 7, [1, 1], magic=b"XXXX"), b"k", b"v"], Status.BAD_REQUEST, id="bad-magic"),
    pytest.param([_header(1, 7, [1, 1], version=9), b"k", b"v"], Status.BAD_VERSION, id="bad-version"),
    pytest.param([_header(99, 7, [])], Status.UNKNOWN_COMMAND, id="unknown-command"),
    pytest.param([_header(1, 7, [1, 1 << 40]), b"k", b"v"], Status.BAD_REQUEST, id="oversized-declared-length"),
    pytest.param([_header(1, 7, [1, 1]), b"k"], Status.BAD_REQUEST, id="missing-frame"),
    pytest.param([_header(3, 7, [1] * 5000)] + [b"k"] * 5000, Status.TOO_LARGE, id="too-many-keys"),
    pytest.param([_header(2, 7, [2000]), b"k" * 2000], Status.TOO_LARGE, id="key-over-1KiB"),
    pytest.param([_header(1, 7, [1, (1 << 20) + 1]), b"k", b"v" * ((1 << 20) + 1)], Status.TOO_LARGE,
                 id="value-over-max"),
    pytest.param([_header(2, 7, [0]), b""], Status.BAD_REQUEST, id="empty-key"),
    pytest.param([_header(2, 7, [1, 1]), b"k", b"k"], Status.BAD_REQUEST, id="wrong-arity"),
])
def test_rejects_bad_requests_and_keeps_serving(start_cache_server, parts, status) -> None:
    server = start_cache_server("--max-value-mb", "1")
    peer = RawPeer(server.port)
    reply = peer.ask(parts)
    if parts[0][:4] == wire.MAGIC_REQUEST and len(parts[0]) >= 52:
        assert reply.request_id == 7  # the client can match the error to its request
    assert reply.status == status, bytes(reply.frames[0]) if reply.frames else reply
    peer.close()
    good = client_for(server)
    good.put(b"k", b"v")
    assert bytes(good.get(b"k")) == b"v"
    server.check_alive()


def test_frame_over_maxmsgsize_disconnects_only_that_peer(start_cache_server) -> None:
    server = start_cache_server("--max-value-mb", "1")
    good = client_for(server)
    good.put(b"k", b"v")
    peer = RawPeer(server.port)
    peer.sock.send_multipart([_header(1, 1, [1, 3 << 20]), b"k", b"v" * (3 << 20)])  # over ZMQ_MAXMSGSIZE
    assert not peer.sock.poll(300)  # ZMQ drops that connection; no reply, no crash
    assert bytes(good.get(b"k")) == b"v"
    server.check_alive()


def test_fuzz_random_and_mutated_frames(start_cache_server) -> None:
    server = start_cache_server("--max-value-mb", "1")
    good = client_for(server)
    good.put(b"stable", b"value-before-fuzz")
    rng = random.Random(1234)
    seeds = [wire.encode_request(cmd, 1, frames) for cmd, frames in [
        (Command.PUT, [b"key", b"value"]), (Command.GET, [b"key"]), (Command.EXISTS, [b"a", b"b", b"c"]),
        (Command.DELETE, [b"key"]), (Command.LIST, [wire.pack_u32(5)]), (Command.STATS, []), (Command.HEALTH, [])]]
    peer = RawPeer(server.port)
    start = time.monotonic()
    for i in range(2000):
        if i % 4 == 0:  # pure noise: 1-4 frames of random bytes
            parts = [rng.randbytes(rng.randint(0, 80)) for _ in range(rng.randint(1, 4))]
        else:  # a valid request with a few bytes flipped, frames dropped or duplicated
            parts = [bytearray(p) for p in rng.choice(seeds)]
            for _ in range(rng.randint(1, 4)):
                target = rng.randrange(len(parts))
                if parts[target] and rng.random() < 0.8:
                    parts[target][rng.randrange(len(parts[target]))] = rng.randrange(256)
                elif rng.random() < 0.5 and len(parts) > 1:
                    parts.pop(target)
                else:
                    parts.append(bytearray(rng.randbytes(rng.randint(0, 16))))
            parts = [bytes(p) for p in parts]
        peer.sock.send_multipart(parts)
        while peer.sock.poll(0):
            peer.sock.recv_multipart()  # replies or not: only the server's survival matters
    # A last good request on the same connection: its reply means every fuzz message was handled.
    # Re-asked now and then, because replies to a peer that reads slower than it writes may be
    # dropped (SNDHWM), by design.
    deadline, answered, rid = time.monotonic() + 10, False, 1_000_000
    while not answered:
        assert time.monotonic() < deadline, "server stopped answering the fuzzing peer"
        rid += 1
        peer.sock.send_multipart(wire.encode_request(Command.HEALTH, rid))
        while not answered and peer.sock.poll(500):
            parts = peer.sock.recv_multipart()
            if parts[0] == b"":  # the fuzzer's empty first frame looked like a REQ delimiter, echoed back
                parts = parts[1:]
            answered = wire.decode_reply(parts).request_id == rid
    peer.close()
    assert time.monotonic() - start < 20
    server.check_alive()
    assert bytes(good.get(b"stable")) == b"value-before-fuzz"
    good.put(b"after", b"fuzz")
    assert bytes(good.get(b"after")) == b"fuzz"
    stats = good.stats()
    assert stats["internal_errors"] == 0, server.log()
    assert stats["bad_requests"] + stats["unknown_commands"] + stats["rejected_too_large"] > 500


def test_lru_never_exceeds_capacity_and_evicts_least_recently_used(start_cache_server) -> None:
    server = start_cache_server("--max-size-gb", "0.001")  # 1 MB
    c = client_for(server)
    value = b"x" * 199_990  # with its 2-byte key, five entries fit in 1 MB
    for i in range(4):
        c.put(f"k{i}".encode(), value)
    assert c.get(b"k0") is not None  # k0 is now the most recently used; k1 the least
    for i in range(4, 12):
        c.put(f"k{i}".encode(), value)
        stats = c.stats()
        assert stats["used_bytes"] <= stats["capacity_bytes"] == 1_000_000
    present = c.exists([f"k{i}".encode() for i in range(12)])
    assert present == [False] * 7 + [True] * 5  # only the five most recent fit
    c.put(b"k7", value)  # refresh order check: get/put of a live key moves it to the front
    assert c.get(b"k8") is not None
    c.put(b"new", value)
    assert c.exists([b"k9", b"k8", b"new"]) == [False, True, True]
    with pytest.raises(RemoteError, match="TOO_LARGE"):
        c.put(b"huge", b"y" * 1_000_001)
    assert c.stats()["evictions"] >= 8


def _chunk(name: str, fill: int, hidden: int = 4096) -> bytes:
    """A chunk as lmcache_triton clients PUT it: serde bytes whose header names `name`
    (hidden=4096: 262_144 bytes of bf16 payload; 15625: 1_000_000)."""
    tensor = torch.full((2, 1, 16, 2 * hidden), fill, dtype=torch.uint8).view(torch.bfloat16)
    return serde.serialize(name, tensor, MemoryFormat.KV_2LTD)


def _chunk_files(root: Path) -> list[Path]:
    return sorted(root.glob("??/*.safetensors"))


def test_persistence_survives_restart(start_cache_server, tmp_path) -> None:
    store = tmp_path / "store"
    server = start_cache_server("--disk", str(store), "--max-size-gb", "0.001")
    c = client_for(server)
    old, mid, new = _chunk("old", 1), _chunk("mid", 2), _chunk("new", 3)
    c.put(b"old", old)
    c.put(b"mid", mid)
    c.put(b"new", new)
    c.delete(b"mid")
    c.put(b"opaque", b"4")  # not a chunk: served from memory, never written to disk
    c.put(b"liar", new)     # a chunk under another key than its own: not written either
    assert c.get(b"old") is not None
    stats = c.stats()
    assert stats["not_persisted"] == 2 and stats["disk"]["chunks"] == 2 and stats["disk"]["put_failures"] == 0
    server.restart()  # SIGKILL then start on the same port and directory
    c2 = client_for(server)
    assert bytes(c2.get(b"old")) == old and bytes(c2.get(b"new")) == new
    assert c2.get(b"mid") is None and c2.get(b"opaque") is None and c2.get(b"liar") is None
    assert c2.stats()["keys"] == 2
    assert len(_chunk_files(store)) == 2 and not list(store.rglob(".tmp-*"))


def test_a_server_folder_is_a_disk_tier_folder(start_cache_server, tmp_path, pool, make_chunk, kv_metadata) -> None:
    """One format: chunks the server persisted are read by an engine's disk tier, and a server
    started over a disk tier's folder serves that tier's chunks."""
    served = tmp_path / "served"
    server = start_cache_server("--disk", str(served))
    remote = create_remote_backend(server.url, kv_metadata, timeout_s=2.0)
    chunks = [make_chunk(pool, seed) for seed in range(3)]
    for obj, key in chunks:
        assert remote.put(key, obj)
    remote.close()
    server.kill()
    disk = LocalDiskBackend(served, 1 << 20, kv_metadata)
    assert set(disk.keys()) == {key for _, key in chunks}
    for obj, key in chunks:
        got = disk.get(key, pool.allocate)
        assert got is not None and torch.equal(got.tensor.view(torch.uint8), obj.tensor.view(torch.uint8))
    extra, extra_key = make_chunk(pool, seed=9)
    assert disk.put(extra_key, extra)
    disk.close()
    server = start_cache_server("--disk", str(served))
    c = client_for(server)
    assert bytes(c.get(extra_key.to_string().encode())) == serde.serialize(extra_key, extra.tensor, extra.fmt)
    assert c.stats()["keys"] == 4


def test_restart_over_a_larger_disk_folder_reads_only_what_fits(start_cache_server, tmp_path) -> None:
    """60 MB of chunks on disk, 10 MB of capacity: the newest chunks that fit are served, the older
    files are deleted unread, and the server's peak memory is that of the chunks it keeps. The scan
    is the disk tier's: a corrupt file is deleted, another version's is kept, a dead writer's temp
    file is deleted and a live one's kept."""
    store = tmp_path / "store"
    files = ChunkFiles(store, 1 << 30, key_name=str, claim=lambda header: header.key)
    keys = [f"k{i:02d}" for i in range(60)]
    for i, k in enumerate(keys):  # ~1_000_400 bytes each with the key: 9 fit in 10 MB
        assert files.store(k, lambda i=i, k=k: [_chunk(k, i, hidden=15625)])
        os.utime(files.path_for(k), (1_000_000 + i, 1_000_000 + i))  # k59 most recently used
    corrupt = files.path_for("corrupt")
    corrupt.parent.mkdir(exist_ok=True)
    corrupt.write_bytes(_chunk("corrupt", 7)[:-10])  # truncated
    newer = files.path_for("newer")
    newer.parent.mkdir(exist_ok=True)
    newer.write_bytes(_rewrite_version(_chunk("newer", 8), "2"))
    shard = files.path_for(keys[0]).parent
    dead_temp = shard / f".tmp-{'0' * 32}-{_host()}-{_dead_pid()}-{'a' * 12}"
    live_temp = shard / f".tmp-{'0' * 32}-{_host()}-{os.getpid()}-{'b' * 12}"
    dead_temp.write_bytes(b"half a write")
    live_temp.write_bytes(b"a write in flight")

    baseline = start_cache_server("--disk", str(tmp_path / "empty"), "--max-size-gb", "0.01")
    base_peak = _proc_status(baseline.proc.pid, "VmHWM")
    baseline.kill()
    server = start_cache_server("--disk", str(store), "--max-size-gb", "0.01")
    peak = _proc_status(server.proc.pid, "VmHWM")
    assert peak < base_peak + (40 << 20), f"reloading 10 MB of 60 took {(peak - base_peak) >> 20} MiB"

    c = client_for(server)
    assert c.exists([k.encode() for k in keys]) == [False] * 51 + [True] * 9
    assert bytes(c.get(b"k59")) == _chunk("k59", 59, hidden=15625)
    assert bytes(c.get(b"k51")) == _chunk("k51", 51, hidden=15625)
    stats = c.stats()
    assert stats["keys"] == 9 and stats["disk"]["corrupt"] == 1 and stats["disk"]["hits"] == 9
    assert _chunk_files(store) == sorted([files.path_for(k) for k in keys[51:]] + [newer])
    assert not dead_temp.exists() and live_temp.exists()


def _rewrite_version(data: bytes, version: str) -> bytes:
    """A chunk as a writer of another format version would leave it (its header checksum redone)."""
    n = struct.unpack_from("<Q", data)[0]
    header = json.loads(data[8:8 + n])
    meta = header["__metadata__"]
    meta["version"] = version
    del meta["header_crc"]
    meta["header_crc"] = serde._crc(serde._canonical(header))
    hb = serde._canonical(header)
    hb += b" " * (-len(hb) % 8)
    return struct.pack("<Q", len(hb)) + hb + data[8 + n:]


def _host() -> str:
    return re.sub(r"[^A-Za-z0-9._-]", "_", socket.gethostname())[:64] or "unknown"


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_slow_reader_does_not_stall_others(start_cache_server) -> None:
    server = start_cache_server()
    good = client_for(server)
    good.put(b"big", b"z" * (1 << 20))
    slow = RawPeer(server.port, rcvhwm=1)  # never reads: its replies pile up, then get dropped
    get_big = wire.encode_request(Command.GET, 1, [b"big"])
    for _ in range(2500):  # more than the server's SNDHWM (1000) can queue for it
        slow.sock.send_multipart(get_big)
    time.sleep(0.5)
    t = time.monotonic()
    for i in range(20):
        assert len(good.get(b"big")) == 1 << 20
    assert time.monotonic() - t < 2.0
    assert good.stats()["dropped_replies"] > 0
    slow.close()


def _proc_status(pid: int, field: str) -> int:
    """A /proc/PID/status memory field (VmRSS, VmHWM: the peak) in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no {field} in /proc/{pid}/status")


def _wait_for_gets(client: CacheServerClient, n: int) -> None:
    deadline = time.monotonic() + 5
    while client.stats()["gets"] < n:
        assert time.monotonic() < deadline, "the server did not handle the GETs"
        time.sleep(0.01)


def test_replies_a_client_does_not_read_stay_within_the_budget(start_cache_server) -> None:
    """A client that sends GETs and never reads their replies must not keep evicted values alive
    beyond the pending-reply budget: the server's memory stays near capacity + budget."""
    capacity = budget = 20_000_000  # the default budget is min(256 MiB, capacity)
    server = start_cache_server("--max-size-gb", "0.02")
    good = client_for(server)
    hostile = RawPeer(server.port, rcvhwm=1, rcvbuf=4096)
    value, per_round, rounds = b"v" * 990_000, 20, 40  # ~800 MB of values pass through a 20 MB cache
    t = time.monotonic()
    for r in range(rounds):
        keys = [f"r{r}-{i}".encode() for i in range(per_round)]
        for k in keys:
            good.put(k, value)  # evicts the previous round
        for i, k in enumerate(keys):
            hostile.sock.send_multipart(wire.encode_request(Command.GET, r * per_round + i, [k]))
        _wait_for_gets(good, (r + 1) * per_round)  # so they hit before the next round evicts them
    peak = _proc_status(server.proc.pid, "VmHWM")
    stats = good.stats()
    assert peak < capacity + budget + (150 << 20), f"server peak RSS {peak >> 20} MiB for a 20 MB cache"
    assert stats["refused_replies"] > 0 and stats["pending_reply_bytes"] <= budget
    assert stats["hits"] + stats["refused_replies"] == stats["gets"] == rounds * per_round
    hostile.close()  # ZMQ drops its queue: the budget frees up and GETs are served again
    deadline = time.monotonic() + 5
    while True:
        try:
            assert bytes(good.get(keys[-1])) == value
            break
        except RemoteError as e:
            assert "BUSY" in str(e) and time.monotonic() < deadline, e
            time.sleep(0.05)
    assert time.monotonic() - t < 20
    server.check_alive()


def test_cli_parser() -> None:
    parser = argparse.ArgumentParser()
    add_server_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["server", "--port", "1234", "--max-size-gb", "2", "--disk", "/tmp/x"])
    cfg = config_from_args(args)
    assert (cfg.host, cfg.port, cfg.max_size_bytes, cfg.disk_dir) == ("127.0.0.1", 1234, 2_000_000_000, "/tmp/x")
    assert callable(args.func)
    with pytest.raises(ValueError, match="max-size-gb"):
        config_from_args(parser.parse_args(["server", "--max-size-gb", "0"]))
    assert cfg.pending_reply_budget == 256 << 20  # min(256 MiB, capacity)
    small = config_from_args(parser.parse_args(["server", "--max-size-gb", "0.02"]))
    assert small.pending_reply_budget == 20_000_000
    pending = config_from_args(parser.parse_args(["server", "--max-pending-reply-mb", "16"]))
    assert pending.pending_reply_budget == 16 << 20
    with pytest.raises(ValueError, match="max-pending-reply-mb"):
        config_from_args(parser.parse_args(["server", "--max-pending-reply-mb", "0"]))


def test_reply_budget_counts_each_value_once_until_zmq_releases_it() -> None:
    budget = ReplyBudget(100)
    a, b, big = memoryview(b"a" * 60), memoryview(b"b" * 60), memoryview(b"c" * 500)
    assert budget.admit(a)
    frame_a = budget.frame(a)
    again = budget.frame(a)  # a second reply of the same value shares its memory: counted once
    assert budget.pending_bytes == 60 and budget.admit(a)
    assert not budget.admit(b) and not budget.admit(big)
    del frame_a, again  # what ZMQ does once it has sent (or dropped) the replies
    deadline = time.monotonic() + 5
    while not budget.admit(b):
        assert time.monotonic() < deadline, "released frames were not noticed"
        time.sleep(0.01)
    assert budget.pending_bytes == 0 and budget.admit(big)  # nothing pending: one reply always fits


def test_stats_command(cache_server, capsys) -> None:
    parser = argparse.ArgumentParser()
    add_stats_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["stats", cache_server.url])
    assert args.func(args) == 0
    assert '"keys": 0' in capsys.readouterr().out
    args = parser.parse_args(["stats", "lm://nohost"])
    assert args.func(args) == 2 and "lm://host:port" in capsys.readouterr().err
    args = parser.parse_args(["stats", cache_server.url, "--watch", "0.05", "--count", "3"])
    assert args.func(args) == 0
    assert capsys.readouterr().out.count('"keys"') == 3, "a live view prints the statistics again and again"


def test_req_socket_client_works(cache_server) -> None:
    sock = zmq.Context.instance().socket(zmq.REQ)  # adds an empty delimiter frame, which the server echoes
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"tcp://127.0.0.1:{cache_server.port}")
    sock.send_multipart(wire.encode_request(Command.PUT, 5, [b"k", b"v"]))
    assert sock.poll(2000)
    reply = wire.decode_reply(sock.recv_multipart())
    assert (reply.status, reply.request_id, reply.command) == (Status.OK, 5, Command.PUT)
    sock.close(0)


def test_the_server_imports_no_torch() -> None:
    """--disk reads chunk headers without torch: a server process starts in a fraction of a second
    and without torch's ~200 MB."""
    code = ("import sys; import lmcache_triton.server.cache_server; "
            "print(sorted(m for m in ('torch', 'numpy') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "[]", out.stderr
