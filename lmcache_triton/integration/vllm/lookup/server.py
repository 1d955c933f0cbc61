"""The workers' side of lookups: a thread answering "how many leading tokens are cached"."""

from __future__ import annotations

import logging
import queue
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import zmq

from lmcache_triton.engine.engine import LMCacheEngine
from lmcache_triton.integration.vllm.lookup import protocol

logger = logging.getLogger("lmcache_triton")


class LMCacheLookupServer:
    """Answers each lookup in its own thread, in order. The chunks it reports stay held in the
    CPU tier (under the lookup id) until the worker has loaded them and calls `release_reservation`."""

    def __init__(self, engine: LMCacheEngine, engine_id: str, rank: int,
                 before_lookup: Callable[[float], object] | None = None) -> None:
        self.engine = engine
        # Called with the seconds left to the lookup's deadline: the worker finishes its queued
        # saves (memory copies) first, so a prompt saved by the step before is found.
        self.before_lookup = before_lookup
        self.skipped_expired = 0
        self.address = protocol.socket_path(engine_id, rank)
        self._ctx = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(self.address)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="lmct-lookup", daemon=True)
        self._thread.start()
        logger.info("lmcache_triton lookup server listening on %s", self.address)

    def _answer(self, frames: list[bytes]) -> list[bytes]:
        request = protocol.decode_request(frames)
        if request.deadline is not None and time.time() > float(request.deadline):
            # The scheduler has given up on it (a miss there): running it would only hold chunks
            # nobody loads and keep later lookups queued behind a slow remote.
            self.skipped_expired += 1
            return protocol.encode_reply(request.seq, 0)
        try:
            if self.before_lookup is not None:
                left = 1.0 if request.deadline is None else float(request.deadline) - time.time()
                self.before_lookup(max(0.0, min(left, 1.0)))
            tokens, scope = request.lookup_args()
            # the scheduler's wall-clock deadline, on this process's monotonic clock
            until = None if request.deadline is None else time.monotonic() + float(request.deadline) - time.time()
            hit = self.engine.lookup(tokens, reserve=True, lookup_id=request.lookup_id, deadline=until, **scope)
        except Exception:  # a failing lookup is a miss, never a dead server
            logger.exception("lmcache_triton lookup failed; answering 0")
            hit = 0
        return protocol.encode_reply(request.seq, hit)

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        while not self._stop.is_set():
            if not dict(poller.poll(100)):
                continue
            identity, *frames = self._sock.recv_multipart()
            try:
                reply = self._answer(frames)
            except Exception as e:
                logger.warning("lmcache_triton lookup server: bad request (%s)", e)
                continue
            self._send([identity, *reply])

    def _send(self, frames: list[bytes]) -> None:
        if self._stop.is_set():  # closed while a (slow) lookup ran: its socket is gone
            return
        try:
            self._sock.send_multipart(frames)
        except zmq.ZMQError as e:
            logger.debug("lmcache_triton lookup server: reply dropped (%s)", e)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        self._sock.close(0)


class LMCacheAsyncLookupServer(LMCacheLookupServer):
    """Runs lookups in a small pool and replies as each finishes, so a slow lookup (a remote
    tier's round trip) never holds up the next request (`enable_async_loading`). A finished
    lookup wakes the serving thread at once (an inproc socket), so a reply waits for no poll
    timeout: a lookup's round trip is its own time. A client in the same process submits to the
    server directly (`submit`): the same request and answer, two thread hand-offs fewer (an 8K-token
    warm request's lookup took 1.9 ms through the socket, the lookup itself 0.6 ms of it), none
    where it can be answered in the client's thread."""

    def __init__(self, engine: LMCacheEngine, engine_id: str, rank: int, workers: int = 2,
                 before_lookup: Callable[[float], object] | None = None) -> None:
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="lmct-lookup-async")
        self._done: queue.SimpleQueue[list[bytes]] = queue.SimpleQueue()
        ctx = zmq.Context.instance()
        wake = f"inproc://lmct-lookup-done-{uuid.uuid4().hex}"
        self._wake_rx = ctx.socket(zmq.PULL)
        self._wake_rx.setsockopt(zmq.LINGER, 0)
        self._wake_rx.bind(wake)
        self._wake_tx = ctx.socket(zmq.PUSH)  # shared by the pool's threads: used under the lock
        self._wake_tx.setsockopt(zmq.LINGER, 0)
        self._wake_tx.connect(wake)
        self._wake_lock = threading.Lock()
        super().__init__(engine, engine_id, rank, before_lookup)
        protocol.serve_in_process(self.address, self.submit)

    def submit(self, frames: list[bytes], caller_waits: bool = False) -> Future[list[bytes]]:
        """Answers an encoded request from a client in this process: its reply frames. A client
        that waits anyway is answered in its own thread where the lookup can wait on nothing but
        memory (`_memory_only`); else in the pool, which the client stops waiting for at its
        deadline (a hung remote costs the timeout, never more)."""
        if not (caller_waits and self._memory_only()):
            return self._pool.submit(self._answer, frames)
        answered: Future[list[bytes]] = Future()
        try:
            answered.set_result(self._answer(frames))
        except Exception as e:  # noqa: BLE001 - the client's to report, as from the pool
            answered.set_exception(e)
        return answered

    def _memory_only(self) -> bool:
        """The engine keeps chunks in the CPU tier alone (no disk, no remote): its lookup reads
        memory only. Answered in the scheduler's thread, a 2K-token warm request's lookup took
        0.5 ms; handed to the pool and back, 1.2 ms (two thread wake-ups, each waiting for the GIL)."""
        storage = getattr(self.engine, "storage_manager", None)
        return storage is not None and not storage.tiers

    def _finish(self, identity: bytes, frames: list[bytes]) -> None:
        try:
            self._done.put([identity, *self._answer(frames)])
        except Exception as e:
            logger.warning("lmcache_triton lookup server: bad request (%s)", e)
            return
        with self._wake_lock:
            if not self._stop.is_set():
                try:
                    self._wake_tx.send(b"", zmq.NOBLOCK)
                except zmq.ZMQError:  # the serving thread's next poll sends it anyway
                    pass

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._wake_rx, zmq.POLLIN)
        while not self._stop.is_set():
            events = dict(poller.poll(100))
            if self._wake_rx in events:
                while True:
                    try:
                        self._wake_rx.recv(zmq.NOBLOCK)
                    except zmq.Again:
                        break
            while True:  # replies are sent from this thread only: zmq sockets are not thread-safe
                try:
                    self._send(self._done.get_nowait())
                except queue.Empty:
                    break
            if self._sock in events:
                identity, *frames = self._sock.recv_multipart()
                self._pool.submit(self._finish, identity, frames)

    def close(self) -> None:
        protocol.stop_serving_in_process(self.address, self.submit)
        super().close()
        self._pool.shutdown(wait=False, cancel_futures=True)
        with self._wake_lock:
            self._wake_tx.close(0)
        self._wake_rx.close(0)
