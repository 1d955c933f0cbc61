"""vLLM's KV cache events, as the KV-aware proxy reads them: decoding and a subscriber per stream.

vLLM publishes them when started with `--kv-events-config '{"enable_kv_cache_events": true,
"publisher": "zmq", "endpoint": "tcp://*:5557", "topic": "kv-events"}'`
(vllm/distributed/kv_events.py: ZmqEventPublisher): a ZMQ PUB socket sending, per scheduler step
with events, the multipart message [topic, seq (8 bytes, big-endian), payload]. The payload is a
`KVEventBatch` encoded by msgspec's msgpack encoder: an array [ts, events, data_parallel_rank]
(the batch is an `array_like` struct) whose events are maps tagged by "type":

    {"type": "BlockStored", "block_hashes": [...], "parent_block_hash": h | None,
     "token_ids": [...], "block_size": n, "medium": "GPU" | "CPU" | "STORAGE" | None,
     "extra_keys": [per block: None | [lora name, (mm id, offset), cache salt, ...]], ...}
    {"type": "BlockRemoved", "block_hashes": [...], "medium": ...}
    {"type": "AllBlocksCleared"}

A block hash is bytes (sha256 by default) or, with VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES, a 64-bit int.

Decoded here with plain msgpack (msgspec without a schema) into the three dataclasses below, not
with vLLM's own msgspec classes: the proxy runs where vLLM may not be installed, starts in a
second instead of vLLM's import time, and reads the fields it needs by name, so a backend on a
newer vLLM that adds fields (as 0.32 added `group_idx`, `locality`, ...) still decodes. The tests
encode their batches with vLLM's classes and encoder, so a change of vLLM's format fails them.
Fields the proxy does not use (lora_id, group_idx, locality, ownership, session_id) are ignored.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

logger = logging.getLogger("lmcache_triton.proxy")

BlockHash = bytes | int


@dataclass(frozen=True)
class BlockStored:
    block_hashes: tuple[BlockHash, ...]
    parent_block_hash: BlockHash | None
    token_ids: tuple[int, ...]       # every block's tokens, in order; may be empty (a tier that sent none)
    block_size: int
    medium: str | None
    extra_keys: tuple[tuple | None, ...] | None = None  # one per block: LoRA name, mm ids, cache salt


@dataclass(frozen=True)
class BlockRemoved:
    block_hashes: tuple[BlockHash, ...]
    medium: str | None


@dataclass(frozen=True)
class AllBlocksCleared:
    pass


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class MalformedBatch(ValueError):
    """A payload that is not a KVEventBatch as vLLM encodes it."""


def _hash(value: object, what: str) -> BlockHash:
    if isinstance(value, (bytes, int)) and not isinstance(value, bool):
        return value
    raise MalformedBatch(f"{what} is {type(value).__name__}, not bytes or int")


def _freeze(value: object) -> object:
    """msgpack arrays as tuples, so that extra keys can be compared and hashed."""
    return tuple(_freeze(v) for v in value) if isinstance(value, list) else value


def _event(raw: object) -> KVEvent | None:
    if not isinstance(raw, dict):
        raise MalformedBatch(f"an event is {type(raw).__name__}, not a tagged map")
    kind = raw.get("type")
    try:
        if kind == "BlockStored":
            hashes = tuple(_hash(h, "a block hash") for h in raw["block_hashes"])
            parent = raw.get("parent_block_hash")
            tokens = raw.get("token_ids") or []
            extra = raw.get("extra_keys")
            if not all(isinstance(t, int) for t in tokens):
                raise MalformedBatch("token_ids holds a non-integer")
            return BlockStored(hashes, None if parent is None else _hash(parent, "parent_block_hash"),
                               tuple(tokens), int(raw["block_size"]), raw.get("medium"),
                               None if extra is None else tuple(_freeze(e) for e in extra))
        if kind == "BlockRemoved":
            return BlockRemoved(tuple(_hash(h, "a block hash") for h in raw["block_hashes"]), raw.get("medium"))
    except (KeyError, TypeError, ValueError) as e:
        if isinstance(e, MalformedBatch):
            raise
        raise MalformedBatch(f"a {kind} event lacks or mistypes a field: {e!r}") from None
    if kind == "AllBlocksCleared":
        return AllBlocksCleared()
    return None  # an event type this proxy does not know: skipped, the rest of the batch still counts


def decode_batch(payload: bytes) -> list[KVEvent]:
    """The events of one KVEventBatch payload, in order; MalformedBatch when it is not one."""
    import msgspec

    try:
        raw = msgspec.msgpack.decode(payload)
    except msgspec.DecodeError as e:
        raise MalformedBatch(f"not msgpack: {e}") from None
    if not isinstance(raw, list) or len(raw) < 2 or not isinstance(raw[1], list):
        raise MalformedBatch("not a KVEventBatch ([ts, events, dp_rank])")
    return [e for e in map(_event, raw[1]) if e is not None]


@dataclass
class StreamStats:
    """What one event stream delivered (read by GET /proxy/stats)."""
    batches: int = 0
    malformed: int = 0
    gaps: int = 0            # batches the sequence numbers say were missed
    restarts: int = 0        # the sequence started over: the publisher (vLLM) restarted
    last_seq: int | None = None
    last_batch_at: float | None = None  # time.monotonic()


@dataclass
class EventSubscriber:
    """One ZMQ SUB socket on one backend's event stream, read by a thread of its own.

    `on_events(events, restarted)` gets each decoded batch (`restarted`: the sequence numbers
    started over, so the backend lost what it held in memory); a malformed batch is logged, counted
    and skipped. ZMQ reconnects by itself when the publisher goes away and comes back; until then
    the backend simply gets no events (and is routed round-robin). `close()` stops the thread.
    """
    endpoint: str
    on_events: Callable[[list[KVEvent], bool], None]
    stats: StreamStats = field(default_factory=StreamStats)
    poll_ms: int = 100

    def __post_init__(self) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"kv-events {self.endpoint}", daemon=True)

    def start(self) -> EventSubscriber:
        self._thread.start()
        return self

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        import zmq

        ctx = zmq.Context()
        sock = ctx.socket(zmq.SUB)
        try:
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.RECONNECT_IVL_MAX, 2000)
            sock.setsockopt(zmq.SUBSCRIBE, b"")  # every topic: one publisher per socket
            sock.connect(self.endpoint)
            while not self._stop.is_set():
                if sock.poll(self.poll_ms):
                    self.handle(sock.recv_multipart())
        except Exception:  # the subscriber dies, the proxy stays up and routes round-robin
            logger.exception("the KV event subscriber of %s stopped", self.endpoint)
        finally:
            sock.close(0)
            ctx.term()

    def handle(self, frames: list[bytes]) -> None:
        """One multipart message [topic, seq, payload]."""
        import time

        if len(frames) != 3 or len(frames[1]) != 8:
            self._malformed(f"{len(frames)} frames, expected [topic, 8-byte seq, payload]")
            return
        seq = int.from_bytes(frames[1], "big", signed=True)
        try:
            events = decode_batch(frames[2])
        except MalformedBatch as e:
            self._malformed(str(e))
            return
        s = self.stats
        restarted = s.last_seq is not None and seq <= s.last_seq
        if restarted:
            s.restarts += 1
            logger.info("the KV event stream of %s started over (seq %d after %d): its backend restarted",
                        self.endpoint, seq, s.last_seq)
        elif s.last_seq is not None and seq > s.last_seq + 1:
            s.gaps += seq - s.last_seq - 1
            logger.warning("missed %d KV event batches from %s (seq %d after %d): routing may miss what they said",
                           seq - s.last_seq - 1, self.endpoint, seq, s.last_seq)
        s.last_seq, s.batches, s.last_batch_at = seq, s.batches + 1, time.monotonic()
        self.on_events(events, restarted)

    def _malformed(self, why: str) -> None:
        self.stats.malformed += 1
        logger.warning("ignored a malformed KV event batch from %s (%s); %d so far", self.endpoint, why,
                       self.stats.malformed)
