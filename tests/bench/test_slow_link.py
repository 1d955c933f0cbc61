"""bench/slow_link.py: bytes go through intact and in order, and the link is never faster than its
settings (lower bounds only: speed is measured by the benches, never asserted here)."""

from __future__ import annotations

import os
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from bench.slow_link import SlowLink
from lmcache_triton.storage import serde
from lmcache_triton.storage.remote import CacheServerClient, create_remote_backend

MiB = 1 << 20


class Server:
    """A loopback TCP server, a thread per connection: `echo` sends back what it reads; with
    `send=N` it sends N pattern bytes to each client instead (then closes)."""

    def __init__(self, send: int | None = None) -> None:
        self.send = send
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.threads = [threading.Thread(target=self._accept)]
        self.threads[0].start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            t = threading.Thread(target=self._serve, args=(conn,))
            self.threads.append(t)
            t.start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            try:
                if self.send is not None:
                    conn.sendall(pattern(self.send))
                    return
                while data := conn.recv(1 << 16):
                    conn.sendall(data)
            except OSError:
                pass

    def close(self) -> None:
        self.sock.shutdown(socket.SHUT_RDWR)  # wakes accept()
        self.sock.close()
        for t in self.threads:
            t.join(10)


def pattern(n: int, seed: int = 0) -> bytes:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen).numpy().tobytes()


def recv_exactly(s: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        data = s.recv(min(1 << 20, n - len(buf)))
        assert data, f"connection closed after {len(buf)} of {n} bytes"
        buf += data
    return bytes(buf)


def echo_through(port: int, payload: bytes) -> bytes:
    """Sends payload and reads as many bytes back, both at once (a full buffer must not deadlock)."""
    with socket.create_connection(("127.0.0.1", port)) as s:
        sender = threading.Thread(target=s.sendall, args=(payload,))
        sender.start()
        got = recv_exactly(s, len(payload))
        sender.join()
        s.shutdown(socket.SHUT_WR)
        assert s.recv(1) == b""  # the half-close went through, and the echo's close came back
    return got


@pytest.fixture
def echo():
    server = Server()
    yield server
    server.close()


def test_bytes_arrive_intact_and_in_order_over_concurrent_connections(echo):
    payloads = [pattern(n, seed=i) for i, n in enumerate([1, 1000, 3 * MiB + 7, 8 * MiB, 5 * MiB + 1])]
    with SlowLink(("127.0.0.1", echo.port), rtt_ms=2) as link, ThreadPoolExecutor(len(payloads)) as pool:
        got = list(pool.map(lambda p: echo_through(link.port, p), payloads))
        assert link.bytes_up == link.bytes_down == sum(map(len, payloads))
    assert got == payloads


def test_a_capped_transfer_takes_at_least_bytes_over_rate_and_the_cap_is_shared(echo):
    rate, n = 4 * MiB, MiB
    with SlowLink(("127.0.0.1", echo.port), bytes_per_s=rate) as link:
        t = time.monotonic()
        assert echo_through(link.port, pattern(n)) == pattern(n)
        assert time.monotonic() - t >= n / rate
        # two connections at once share the one cap: 2n bytes each way through the same pipe
        t = time.monotonic()
        with ThreadPoolExecutor(2) as pool:
            assert all(pool.map(lambda i: echo_through(link.port, pattern(n, i)) == pattern(n, i), range(2)))
        assert time.monotonic() - t >= 2 * n / rate


def test_a_round_trip_takes_at_least_rtt_and_set_applies_at_once(echo):
    with SlowLink(("127.0.0.1", echo.port), rtt_ms=100) as link, \
            socket.create_connection(("127.0.0.1", link.port)) as s:
        for rtt_ms in (100, 250, 0):
            link.set(rtt_ms=rtt_ms)
            t = time.monotonic()
            s.sendall(b"x")
            assert s.recv(1) == b"x"
            assert time.monotonic() - t >= rtt_ms / 1e3


def test_throttle_after_bytes_caps_only_the_rest():
    total, first, rate = 3 * MiB, 2 * MiB, 2 * MiB
    server = Server(send=total)
    try:
        with SlowLink(("127.0.0.1", server.port), rtt_ms=50, bytes_per_s=rate, throttle_after_bytes=first) as link, \
                socket.create_connection(("127.0.0.1", link.port)) as s:
            head = recv_exactly(s, first)
            t = time.monotonic()
            tail = recv_exactly(s, total - first)
            assert time.monotonic() - t >= (total - first) / rate  # the rest went through the cap
            assert head + tail == pattern(total) and s.recv(1) == b""
            assert link.bytes_down == total
    finally:
        server.close()


def _socket_fds() -> int:
    return sum(os.readlink(f"/proc/self/fd/{fd}").startswith("socket:") for fd in os.listdir("/proc/self/fd")
               if os.path.exists(f"/proc/self/fd/{fd}"))


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts sockets in /proc")
def test_close_leaves_no_thread_or_socket(echo):
    sockets, threads = _socket_fds(), set(threading.enumerate())
    link = SlowLink(("127.0.0.1", echo.port), rtt_ms=20, bytes_per_s=MiB)
    port = link.start()
    clients = [socket.create_connection(("127.0.0.1", port)) for _ in range(3)]
    clients[0].sendall(pattern(MiB))  # bytes in flight, a reader asleep on the cap
    time.sleep(0.2)
    link.close()
    for c in clients:  # each client sees its connection end
        c.settimeout(5)
        try:
            while c.recv(1 << 16):
                pass
        except ConnectionResetError:
            pass
        c.close()
    assert not [t for t in threading.enumerate() if t not in threads and t.name.startswith("slow-link")]
    assert _socket_fds() == sockets
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=1).close()


@pytest.mark.slow
def test_cache_server_through_the_link(cache_server, pool, make_chunk):
    """The real cache server (ZeroMQ over TCP) behind a slow link: a chunk put and read back through
    the relay is the same chunk, bit for bit, also when the link turns slow in the middle of the read."""
    with SlowLink(("127.0.0.1", cache_server.port), rtt_ms=10, bytes_per_s=16 * MiB) as link:
        backend = create_remote_backend(f"lm://127.0.0.1:{link.port}", None, compression="naive",
                                        timeout_s=30.0, auth_token=None)
        direct = CacheServerClient("127.0.0.1", cache_server.port, timeout_s=5.0)
        try:
            obj, key = make_chunk(pool, seed=7, tokens=16 * 64)  # 1 MiB of bfloat16
            assert backend.put(key, obj)
            assert bytes(direct.get(key.to_string().encode())) == serde.serialize(key, obj.tensor, obj.fmt)
            got = backend.get(key, pool.allocate)
            assert got is not None and torch.equal(got.tensor.view(torch.uint8), obj.tensor.view(torch.uint8))
            got.free()
            link.set(rtt_ms=0, bytes_per_s=4 * MiB, throttle_after_bytes=link.bytes_down + obj.nbytes // 2)
            got = backend.get(key, pool.allocate)  # fast for half the chunk, then 4 MiB/s
            assert got is not None and torch.equal(got.tensor.view(torch.uint8), obj.tensor.view(torch.uint8))
            assert link.bytes_down > link.throttle_after_bytes
            got.free()
        finally:
            backend.close()
            direct.close()
