"""The scheduler's side of lookups."""

from __future__ import annotations

import itertools
import logging
import math
import time
from concurrent import futures
from concurrent.futures import Future
from dataclasses import dataclass, field

import zmq

from lmcache_triton.integration.vllm.lookup import protocol
from lmcache_triton.keys import ChunkHashes

logger = logging.getLogger("lmcache_triton")


@dataclass
class _Pending:
    seq: int
    deadline: float
    answers: dict[int, int] = field(default_factory=dict)
    in_process: dict[int, Future] = field(default_factory=dict)  # rank -> its reply frames, later


class LookupClient:
    """Asks every rank's lookup server; the hit is the minimum over ranks (with tensor parallelism
    a prefix is usable only if every rank holds its shard). A rank that does not answer within
    `timeout_ms` counts as 0: a miss, never a hang.

    Synchronous mode waits for the answers. Asynchronous mode (`enable_async_loading`) returns
    None until every answer is in, so vLLM's scheduler asks again in a later step.
    Results are kept per lookup id until `clear_lookup_status`, so repeated questions about a
    request that could not be scheduled yet cost nothing. With `chunk_hashes` (the prompt's
    token chain, `keys.TokenChain`) the question carries 16 bytes a chunk, not the token ids.
    """

    def __init__(self, engine_id: str, world_size: int, *, timeout_ms: int, asynchronous: bool = False) -> None:
        self.addresses = [protocol.socket_path(engine_id, rank) for rank in range(world_size)]
        self.timeout_s = timeout_ms / 1000
        self.asynchronous = asynchronous
        self._ctx = zmq.Context.instance()
        self._socks: list[zmq.Socket] = []
        self._seq = itertools.count(1)
        self._pending: dict[str, _Pending] = {}
        self._results: dict[str, int] = {}
        self._connect()

    def _connect(self) -> None:
        for sock in self._socks:
            sock.close(0)
        self._socks = []
        for addr in self.addresses:
            sock = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(addr)
            self._socks.append(sock)

    def lookup(self, tokens: list[int], lookup_id: str, *, namespace: str = "", adapter: str = "",
               mm_spans: list | None = None, chunk_hashes: ChunkHashes | None = None) -> int | None:
        if lookup_id in self._results:
            return self._results[lookup_id]
        pending = self._pending.get(lookup_id)
        if pending is None:
            pending = _Pending(next(self._seq), time.monotonic() + self.timeout_s)
            frames = protocol.encode_request(pending.seq, lookup_id, tokens, namespace, adapter, mm_spans,
                                             deadline=time.time() + self.timeout_s, chunk_hashes=chunk_hashes)
            for rank, (sock, address) in enumerate(zip(self._socks, self.addresses)):
                submit = protocol.in_process(address)
                if submit is None:
                    sock.send_multipart(frames, copy=False)
                else:  # the worker's server lives in this process: straight to its pool
                    pending.in_process[rank] = submit(frames, not self.asynchronous)
            self._pending[lookup_id] = pending
        self._collect(wait=not self.asynchronous)
        if len(pending.answers) == len(self._socks):
            hit = min(pending.answers.values())
        elif time.monotonic() >= pending.deadline:
            logger.warning("lmcache_triton lookup %s timed out after %.0f ms: treating it as a miss",
                           lookup_id, self.timeout_s * 1e3)
            hit = 0
            self._connect()  # drop late answers with the sockets that would deliver them
            for other in self._pending.values():
                other.deadline = 0  # their answers are gone too: they resolve to a miss
        else:
            return None
        del self._pending[lookup_id]
        self._results[lookup_id] = hit
        return hit

    def _collect(self, wait: bool) -> None:
        """Reads every answer available; with `wait`, until all pending answers or the deadline."""
        for p in self._pending.values():
            if p.in_process:
                self._collect_in_process(p, wait)
        by_seq = {p.seq: p for p in self._pending.values()}
        poller = zmq.Poller()
        for sock in self._socks:
            poller.register(sock, zmq.POLLIN)
        while True:
            outstanding = [p for p in by_seq.values() if len(p.answers) < len(self._socks)]
            if not outstanding:
                return
            timeout = max(0.0, min(p.deadline for p in outstanding) - time.monotonic()) if wait else 0
            # rounded up: poll(499) for 0.4999 s would wake just before the deadline, and a
            # synchronous lookup would then return None ("not yet") instead of the timeout's 0
            events = dict(poller.poll(math.ceil(timeout * 1000)))
            if not events:
                if wait and time.monotonic() < min(p.deadline for p in outstanding):
                    continue
                return
            for rank, sock in enumerate(self._socks):
                while sock in events and sock.poll(0):
                    seq, hit = protocol.decode_reply(sock.recv_multipart())
                    if seq in by_seq:
                        by_seq[seq].answers[rank] = hit

    @staticmethod
    def _collect_in_process(p: _Pending, wait: bool) -> None:
        if wait:
            futures.wait(p.in_process.values(), timeout=max(0.0, p.deadline - time.monotonic()))
        for rank, future in list(p.in_process.items()):
            if not future.done():
                continue
            del p.in_process[rank]
            try:
                seq, hit = protocol.decode_reply(future.result())
            except Exception:  # the server's pool is gone (closed) or the answer is bad: a miss
                logger.exception("lmcache_triton in-process lookup failed; answering 0")
                seq, hit = p.seq, 0
            if seq == p.seq:
                p.answers[rank] = hit

    def clear_lookup_status(self, lookup_id: str) -> None:
        self._results.pop(lookup_id, None)
        self._pending.pop(lookup_id, None)

    def close(self) -> None:
        for sock in self._socks:
            sock.close(0)
        self._socks = []


class LookupClientFactory:
    @staticmethod
    def create_lookup_client(engine_id: str, world_size: int, config) -> LookupClient:
        return LookupClient(engine_id, world_size, timeout_ms=config.lookup_timeout_ms,
                            asynchronous=config.enable_async_loading)
