"""A slow link for benchmarks: a loopback TCP relay that delays and rate-limits the bytes it passes.

    link = SlowLink(upstream=("127.0.0.1", server_port), rtt_ms=20, bytes_per_s=4 << 20)
    port = link.start()            # clients connect to 127.0.0.1:port instead of the server
    link.set(bytes_per_s=None)     # at runtime: uncapped from the next bytes on
    link.close()                   # or `with SlowLink(...) as link:`

A relay rather than tc/netem: no root, nothing on the host to restore, one link per bench. It
never parses what it relays (the cache server speaks ZeroMQ over TCP), so any TCP protocol works.

Each direction is one pipe shared by every connection, as a real link is shared: a piece of data
read from one side leaves once the pipe has sent everything reserved before it (bytes_per_s) and
arrives rtt_ms / 2 later. The reading thread sleeps until its piece has left, so TCP's flow
control still holds the sender back and the relay holds only what is in flight, not a whole
transfer. `throttle_after_bytes=N`: the link is a plain relay (no delay, no cap, either way) until
N bytes have gone from upstream to clients, then slow: a tier that turns slow in the middle of a
load, at the same byte every run.
"""

from __future__ import annotations

import queue
import socket
import threading
import time

# Bytes per read: large when uncapped (the relay's own cost is per piece: ~0.5-0.8 GB/s on loopback
# here, against ~1.2-1.5 direct), about 10 ms of the link when capped (a capped piece goes as one burst).
_PIECE = 256 << 10
_UNSET = object()   # set()'s "not given" (None is a value: uncapped, or never throttle)


class _Pipe:
    """One direction's bandwidth: the time its last reserved byte leaves."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._free_at = 0.0

    def reserve(self, n: int, bytes_per_s: float | None) -> float:
        """When n bytes read now have left the link (now, uncapped)."""
        now = time.monotonic()
        if bytes_per_s is None:
            return now
        with self._lock:  # every connection queues behind the same clock: the cap is shared
            self._free_at = max(now, self._free_at) + n / bytes_per_s
            return self._free_at


class _Conn:
    """One client connection and its upstream connection: four threads, a reader and a writer per
    direction, joined by a queue of (arrival time, bytes) so that the delay pipelines."""

    def __init__(self, link: SlowLink, client: socket.socket, upstream: socket.socket) -> None:
        self.link, self.socks = link, (client, upstream)
        self.dead = threading.Event()  # aborted: every sleep of its threads ends at once
        self._lock = threading.Lock()
        self._running = 4
        for src, dst, down in ((client, upstream, False), (upstream, client, True)):
            q: queue.SimpleQueue = queue.SimpleQueue()
            link._spawn(self._read, src, q, down)
            link._spawn(self._write, q, dst)

    def _sleep_until(self, t: float) -> bool:
        return not self.dead.wait(max(0.0, t - time.monotonic()))

    def _read(self, src: socket.socket, q: queue.SimpleQueue, down: bool) -> None:
        pipe = self.link._pipes[down]
        try:
            while data := src.recv(self.link._piece_bytes()):
                view = memoryview(data)
                while view:  # split at the throttling threshold, so that it falls on its exact byte
                    n, slow = self.link._account(len(view), down)
                    piece, view = view[:n], view[n:]
                    rtt_ms, rate = (self.link.rtt_ms, self.link.bytes_per_s) if slow else (0.0, None)
                    left = pipe.reserve(n, rate)
                    if not self._sleep_until(left):
                        return
                    q.put((left + rtt_ms / 2000, piece))
            # the sender's FIN travels with the same delay as its last bytes
            q.put((time.monotonic() + self.link.rtt_ms / 2000, None))
        except OSError:
            self.abort()
        finally:
            q.put((0.0, None))  # a writer still waiting ends (after an EOF already queued, a no-op)
            self._exit()

    def _write(self, q: queue.SimpleQueue, dst: socket.socket) -> None:
        try:
            while True:
                at, data = q.get()
                if not self._sleep_until(at):
                    return
                if data is None:
                    dst.shutdown(socket.SHUT_WR)  # half-close: the other direction may still have bytes
                    return
                dst.sendall(data)
        except OSError:  # the receiver is gone: so is the connection
            self.abort()
        finally:
            self._exit()

    def abort(self) -> None:
        self.dead.set()
        for s in self.socks:
            try:
                s.shutdown(socket.SHUT_RDWR)  # wakes a thread blocked in recv or sendall
            except OSError:
                pass

    def _exit(self) -> None:
        with self._lock:
            self._running -= 1
            last = self._running == 0
        if last:  # the sockets close once nothing uses them, whichever side ended first
            for s in self.socks:
                s.close()
            self.link._forget(self)


class SlowLink:
    """A relay on 127.0.0.1 to `upstream` with a one-way delay of rtt_ms / 2 and a per-direction
    cap of bytes_per_s (None: uncapped); see the module doc."""

    def __init__(self, upstream: tuple[str, int], rtt_ms: float = 0.0, bytes_per_s: float | None = None,
                 throttle_after_bytes: int | None = None) -> None:
        self.upstream = upstream
        self.rtt_ms, self.bytes_per_s, self.throttle_after_bytes = float(rtt_ms), bytes_per_s, throttle_after_bytes
        self.bytes_up = self.bytes_down = 0  # relayed so far: clients -> upstream, upstream -> clients
        self.port: int | None = None
        self._pipes = {False: _Pipe(), True: _Pipe()}
        self._lock = threading.Lock()
        self._conns: set[_Conn] = set()
        self._threads: list[threading.Thread] = []
        self._closed = threading.Event()
        self._listener: socket.socket | None = None

    def set(self, *, rtt_ms=_UNSET, bytes_per_s=_UNSET, throttle_after_bytes=_UNSET) -> None:
        """Changes the settings for the bytes read from now on (throttle_after_bytes counts from the
        link's start: `throttle_after_bytes=link.bytes_down + n` means after n more bytes)."""
        if rtt_ms is not _UNSET:
            self.rtt_ms = float(rtt_ms)
        if bytes_per_s is not _UNSET:
            self.bytes_per_s = bytes_per_s
        if throttle_after_bytes is not _UNSET:
            self.throttle_after_bytes = throttle_after_bytes

    def start(self) -> int:
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(0.1)  # accept() wakes to see close(): closing alone does not wake it
        self.port = self._listener.getsockname()[1]
        self._spawn(self._accept)
        return self.port

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            client.settimeout(None)
            try:
                upstream = socket.create_connection(self.upstream, timeout=5)
                upstream.settimeout(None)
            except OSError:  # upstream down: the client sees its connection closed, as with no relay
                client.close()
                continue
            for s in (client, upstream):
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # no Nagle wait on top of ours
            with self._lock:
                if self._closed.is_set():
                    client.close()
                    upstream.close()
                    return
                self._threads = [t for t in self._threads if t.is_alive()]
                self._conns.add(_Conn(self, client, upstream))

    def _piece_bytes(self) -> int:
        rate = self.bytes_per_s
        return _PIECE if rate is None else max(4096, min(_PIECE, int(rate / 100)))

    def _account(self, n: int, down: bool) -> tuple[int, bool]:
        """(how many of the next n bytes go as one piece, whether the link is slow for them)."""
        with self._lock:
            left = None if self.throttle_after_bytes is None else self.throttle_after_bytes - self.bytes_down
            slow = left is None or left <= 0
            if down:
                n = n if slow else min(n, left)
                self.bytes_down += n
            else:
                self.bytes_up += n
            return n, slow

    def _spawn(self, target, *args) -> None:
        t = threading.Thread(target=target, args=args, daemon=True, name=f"slow-link-{self.port}")
        self._threads.append(t)
        t.start()

    def _forget(self, conn: _Conn) -> None:
        with self._lock:
            self._conns.discard(conn)

    def close(self) -> None:
        """Closes the listener and every connection, and waits for every thread."""
        with self._lock:
            self._closed.set()
            conns = list(self._conns)
        for c in conns:
            c.abort()
        for t in list(self._threads):
            t.join(timeout=10)
        if self._listener is not None:
            self._listener.close()

    def __enter__(self) -> SlowLink:
        if self.port is None:
            self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()
