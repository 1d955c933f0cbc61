"""The workers' side of lookups: a thread answering "how many leading tokens are cached"."""

from __future__ import annotations

import logging
import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import zmq

from lmcache_triton.engine.engine import LMCacheEngine
from lmcache_triton.integration.vllm.lookup import protocol

logger = logging.getLogger("lmcache_triton")


class LMCacheLookupServer:
    """Answers each lookup in its own thread, in order. The chunks it reports stay held in the
    CPU tier (under the lookup id) until the worker has loaded them and calls `release_reservation`."""

    def __init__(self, engine: LMCacheEngine, engine_id: str, rank: int) -> None:
        self.engine = engine
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
        header, tokens, mm_spans = protocol.decode_request(frames)
        deadline = header.get("deadline")
        if deadline is not None and time.time() > float(deadline):
            # The scheduler has given up on it (a miss there): running it would only hold chunks
            # nobody loads and keep later lookups queued behind a slow remote.
            self.skipped_expired += 1
            return protocol.encode_reply(header["seq"], 0)
        try:
            hit = self.engine.lookup(tokens, reserve=True, lookup_id=header["id"], namespace=header.get("ns") or "",
                                     adapter=header.get("adapter") or "", mm_spans=mm_spans)
        except Exception:  # a failing lookup is a miss, never a dead server
            logger.exception("lmcache_triton lookup failed; answering 0")
            hit = 0
        return protocol.encode_reply(header["seq"], hit)

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
    tier's round trip) never holds up the next request (`enable_async_loading`)."""

    def __init__(self, engine: LMCacheEngine, engine_id: str, rank: int, workers: int = 2) -> None:
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="lmct-lookup-async")
        self._done: queue.SimpleQueue[list[bytes]] = queue.SimpleQueue()
        super().__init__(engine, engine_id, rank)

    def _finish(self, identity: bytes, frames: list[bytes]) -> None:
        try:
            self._done.put([identity, *self._answer(frames)])
        except Exception as e:
            logger.warning("lmcache_triton lookup server: bad request (%s)", e)

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        while not self._stop.is_set():
            events = dict(poller.poll(5))
            while True:  # replies are sent from this thread only: zmq sockets are not thread-safe
                try:
                    self._send(self._done.get_nowait())
                except queue.Empty:
                    break
            if events:
                identity, *frames = self._sock.recv_multipart()
                self._pool.submit(self._finish, identity, frames)

    def close(self) -> None:
        super().close()
        self._pool.shutdown(wait=False, cancel_futures=True)
