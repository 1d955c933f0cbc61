"""The cache server as a real subprocess: commands, limits, auth, hostile input, LRU, persistence."""

from __future__ import annotations

import argparse
import random
import struct
import time

import pytest
import zmq

from lmcache_triton.storage import wire
from lmcache_triton.storage.cache_server import add_server_parser, add_stats_parser, config_from_args
from lmcache_triton.storage.remote import CacheServerClient, RemoteError
from lmcache_triton.storage.wire import Command, Status

pytestmark = pytest.mark.slow


def client_for(server, **kw) -> CacheServerClient:
    return CacheServerClient("127.0.0.1", server.port, timeout_s=kw.pop("timeout_s", 2.0), **kw)


class RawPeer:
    """A DEALER that sends whatever bytes it is given: the hostile client."""

    def __init__(self, port: int, rcvhwm: int = 1000) -> None:
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.RCVHWM, rcvhwm)
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


def test_persistence_survives_restart(start_cache_server, tmp_path) -> None:
    server = start_cache_server("--disk", str(tmp_path / "store"), "--max-size-gb", "0.001")
    c = client_for(server)
    c.put(b"old", b"1" * 300_000)
    c.put(b"mid", b"2" * 300_000)
    c.put(b"new", b"3" * 300_000)
    c.delete(b"mid")
    c.put(b"tmp", b"4")
    assert c.get(b"old") is not None
    server.restart()  # SIGKILL then start on the same port and directory
    c2 = client_for(server)
    assert bytes(c2.get(b"old")) == b"1" * 300_000
    assert bytes(c2.get(b"new")) == b"3" * 300_000
    assert c2.get(b"mid") is None
    assert c2.stats()["keys"] == 3
    assert not list((tmp_path / "store").glob("*.tmp"))


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


def test_cli_parser() -> None:
    parser = argparse.ArgumentParser()
    add_server_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["server", "--port", "1234", "--max-size-gb", "2", "--disk", "/tmp/x"])
    cfg = config_from_args(args)
    assert (cfg.host, cfg.port, cfg.max_size_bytes, cfg.disk_dir) == ("127.0.0.1", 1234, 2_000_000_000, "/tmp/x")
    assert callable(args.func)
    with pytest.raises(ValueError, match="max-size-gb"):
        config_from_args(parser.parse_args(["server", "--max-size-gb", "0"]))


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
