"""The offload server (the seed's ZMQOffloadServer): another process on the host asks a worker rank
to store given slots of its paged KV cache under given chunk hashes.

Endpoint: an IPC socket per vLLM engine id and rank (`socket_path`), readable and writable by its
owner only (0600), started when the config sets `enable_offload_server` (it is off by default:
whoever can reach it decides which KV is stored under which hash).

Request, one frame, a msgpack map with LMCache's `OffloadMsg` fields and two of ours:
  hashes        per chunk, its token-chain hash (`keys.TokenChain`: 16 bytes; an int, as LMCache
                clients send, is taken as its 16-byte little-endian two's complement)
  slot_mapping  the paged-cache slot of every token, in token order (sum(offsets) of them)
  offsets       per chunk, its token count: chunk_size for every chunk but the last (<= chunk_size)
  namespace     optional: the requests' cache_salt (the keys carry a keyed digest of it)
  adapter       optional: the LoRA adapter's key part, as a request's (`scheduler.adapter_key`)
Reply, one frame, a msgpack map: {"success": bool, "stored": tokens stored now, "error": why not}.

The key contract: chunk i is stored under the key a request's chunk i gets when its scheduler
ships the same token-chain hashes in the same namespace and adapter (`KeyScope.chunk_hashes`), so a
lookup by those hashes, or by the token ids they were computed from, hits. A hash that is not the
chain hash of the tokens whose KV the slots hold stores wrong KV under it: the caller vouches for
that, which is why the server is opt-in and owner-only.
"""

from __future__ import annotations

import logging
import os
import threading
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import zmq

from lmcache_triton.integration.vllm.common import ipc_path
from lmcache_triton.keys import ChunkHashes

logger = logging.getLogger("lmcache_triton")

HASH_BYTES = 16
MAX_REQUEST_BYTES = 64 << 20


def socket_path(engine_id: str, rank: int) -> str:
    return ipc_path("offload", engine_id, rank)


class OffloadError(ValueError):
    """A request the server refuses; the reply's "error" says why."""


@dataclass
class OffloadMsg:
    hashes: list[bytes]
    slot_mapping: list[int]
    offsets: list[int]
    namespace: str = ""
    adapter: str = ""

    def chunk_hashes(self, chunk_size: int) -> ChunkHashes:
        return ChunkHashes(0, tuple(self.hashes), sum(self.offsets), chunk_size)


def _hash_bytes(h, i: int) -> bytes:
    if isinstance(h, bool):
        raise OffloadError(f"hashes[{i}] is a bool, not a hash")
    if isinstance(h, int):
        try:
            return h.to_bytes(HASH_BYTES, "little", signed=True)
        except OverflowError:
            raise OffloadError(f"hashes[{i}] does not fit in {HASH_BYTES} bytes") from None
    if isinstance(h, (bytes, bytearray, memoryview)) and len(h) == HASH_BYTES:
        return bytes(h)
    raise OffloadError(f"hashes[{i}] must be {HASH_BYTES} bytes or an int, got {type(h).__name__}"
                       + (f" of {len(h)} bytes" if isinstance(h, (bytes, bytearray, memoryview)) else ""))


def decode_request(frame: bytes, chunk_size: int, num_slots: int) -> OffloadMsg:
    """The request, checked against this rank's chunk size and paged cache; OffloadError names
    the field that is wrong."""
    import msgspec

    try:
        raw = msgspec.msgpack.decode(frame)
    except msgspec.DecodeError as e:
        raise OffloadError(f"not a msgpack message: {e}") from None
    if not isinstance(raw, dict):
        raise OffloadError(f"expected a msgpack map, got {type(raw).__name__}")
    for name in ("hashes", "slot_mapping", "offsets"):
        if not isinstance(raw.get(name), list):
            raise OffloadError(f"{name!r} is missing or not a list")
    offsets = raw["offsets"]
    if not offsets or len(offsets) != len(raw["hashes"]):
        raise OffloadError(f"{len(raw['hashes'])} hashes for {len(offsets)} offsets: one hash per chunk")
    for i, n in enumerate(offsets):
        last = i == len(offsets) - 1
        if not isinstance(n, int) or isinstance(n, bool) or not (0 < n <= chunk_size) or (not last and n != chunk_size):
            raise OffloadError(f"offsets[{i}] = {n!r}: every chunk but the last has chunk_size={chunk_size} tokens, "
                               f"the last 1..{chunk_size}")
    slots = raw["slot_mapping"]
    if len(slots) != sum(offsets):
        raise OffloadError(f"slot_mapping has {len(slots)} slots for {sum(offsets)} tokens (the sum of offsets)")
    if not all(isinstance(s, int) and not isinstance(s, bool) and 0 <= s < num_slots for s in slots):
        bad = next(s for s in slots if not (isinstance(s, int) and not isinstance(s, bool) and 0 <= s < num_slots))
        raise OffloadError(f"slot {bad!r} is not a slot of this rank's paged cache (0..{num_slots - 1})")
    for name in ("namespace", "adapter"):
        if not isinstance(raw.get(name, ""), str):
            raise OffloadError(f"{name!r} must be a string")
    return OffloadMsg([_hash_bytes(h, i) for i, h in enumerate(raw["hashes"])], slots, offsets,
                      raw.get("namespace", ""), raw.get("adapter", ""))


def encode_reply(success: bool, stored: int = 0, error: str = "") -> bytes:
    import msgspec

    return msgspec.msgpack.encode({"success": success, "stored": stored, "error": error})


class ZMQOffloadServer:
    """Answers offload requests one at a time in its own thread. `store(msg)` does the store (the
    worker runs it on its save thread, so the engine still sees one store at a time) and returns
    the tokens stored; a failure is a reply with the reason, never a dead server."""

    def __init__(self, store: Callable[[OffloadMsg], int], engine_id: str, rank: int, *, chunk_size: int,
                 num_slots: int, address: str | None = None) -> None:
        self.store = store
        self.chunk_size = chunk_size
        self.num_slots = num_slots
        self.address = address or socket_path(engine_id, rank)
        self.requests = self.failures = 0
        self._ctx = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.REP)
        self._sock.setsockopt(zmq.LINGER, 0)
        # ZMQ drops a larger message before it is allocated: a request names at most a few million
        # slots (~9 bytes each in msgpack), so a bigger one is not a request
        self._sock.setsockopt(zmq.MAXMSGSIZE, MAX_REQUEST_BYTES)
        self._sock.bind(self.address)
        if self.address.startswith("ipc://"):
            os.chmod(self.address[len("ipc://"):], 0o600)  # other users may not choose what is stored
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="lmct-offload", daemon=True)
        self._thread.start()
        logger.info("lmcache_triton offload server listening on %s", self.address)

    def _answer(self, frame: bytes) -> bytes:
        self.requests += 1
        try:
            msg = decode_request(frame, self.chunk_size, self.num_slots)
            return encode_reply(True, int(self.store(msg)))
        except OffloadError as e:
            self.failures += 1
            logger.warning("lmcache_triton offload server: request refused: %s", e)
            return encode_reply(False, error=str(e))
        except Exception as e:
            self.failures += 1
            logger.exception("lmcache_triton offload server: store failed")
            return encode_reply(False, error=f"store failed: {type(e).__name__}: {e}")

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        while not self._stop.is_set():
            if not dict(poller.poll(100)):
                continue
            try:
                frames = self._sock.recv_multipart()
                reply = self._answer(frames[0] if len(frames) == 1 else b"")
                if self._stop.is_set():
                    return
                self._sock.send(reply)
            except zmq.ZMQError as e:
                if self._stop.is_set():
                    return
                logger.warning("lmcache_triton offload server: %s", e)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        self._sock.close(0)


class OffloadClient:
    """Asks one worker rank to store slots under hashes; False (and `last_error`) on refusal or timeout."""

    def __init__(self, engine_id: str, rank: int = 0, *, timeout_s: float = 30.0, address: str | None = None) -> None:
        self.address = address or socket_path(engine_id, rank)
        self.timeout_ms = int(timeout_s * 1000)
        self.last_error = ""
        self.last_stored = 0
        self._ctx = zmq.Context.instance()
        self._sock: zmq.Socket | None = None

    def _socket(self) -> zmq.Socket:
        if self._sock is None:
            self._sock = self._ctx.socket(zmq.REQ)
            self._sock.setsockopt(zmq.LINGER, 0)
            self._sock.connect(self.address)
        return self._sock

    def offload(self, hashes: Sequence[bytes | int], slot_mapping: Sequence[int] | torch.Tensor,
                offsets: Sequence[int], *, namespace: str = "", adapter: str = "") -> bool:
        import msgspec

        if isinstance(slot_mapping, torch.Tensor):
            slot_mapping = slot_mapping.tolist()
        frame = msgspec.msgpack.encode({"hashes": [bytes(h) if not isinstance(h, int) else h for h in hashes],
                                        "slot_mapping": list(slot_mapping), "offsets": list(offsets),
                                        "namespace": namespace, "adapter": adapter})
        sock = self._socket()
        sock.send(frame)
        if not sock.poll(self.timeout_ms, zmq.POLLIN):
            sock.close(0)  # a REQ socket waiting for a reply cannot send again
            self._sock = None
            self.last_error, self.last_stored = f"no reply from {self.address} within {self.timeout_ms} ms", 0
            return False
        reply = msgspec.msgpack.decode(sock.recv())
        self.last_error, self.last_stored = reply.get("error", ""), int(reply.get("stored", 0))
        return bool(reply.get("success"))

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close(0)
            self._sock = None


def new_job_id() -> str:
    return f"offload-{uuid.uuid4().hex}"
