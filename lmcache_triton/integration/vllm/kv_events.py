"""vLLM's KV events for the chunks our tiers hold, so a KV-aware router (llm-d, Dynamo) sees them.

vLLM publishes `KVEventBatch`es of `BlockStored` / `BlockRemoved` (`--kv-events-config`); its own
are for the GPU blocks (medium "GPU"). Ours go through the same publisher (the connector's
`take_events`) and speak of the same blocks:

- a chunk of `chunk_size` tokens is `chunk_size / block_size` of vLLM's blocks; a partial chunk
  is the full blocks it covers (its last, partial block is in no event);
- `block_hashes` are the request's own vLLM block hashes (`Request.block_hashes`, converted as
  vLLM converts them), `parent_block_hash` the hash of the block before the chunk, `token_ids`,
  `block_size`, `lora_id`, `lora_name` and `extra_keys` as vLLM's GPU events carry them, so a
  router that matches vLLM's GPU events matches ours;
- `medium` is "CPU" for the CPU tier and "STORAGE" for the disk and remote tiers, with `locality`
  "LOCAL" (disk) or "REMOTE" (a cache server, Redis);
- `BlockStored` once a chunk is in a tier (a save, a write-through, a promotion into the CPU tier);
  `BlockRemoved` when that tier evicts it, drops it (a failed checksum, a canary mismatch, a
  removal) or is cleared: one event per tier and chunk, so a router can count placements per
  medium. A cleared tier is reported as the removals of what it held, not `AllBlocksCleared`,
  which has no medium and would tell a router the GPU blocks went too.

Who knows what: the scheduler has vLLM's `Request` (its hashes, tokens, adapter); the workers'
tiers know keys. So the scheduler sends, with each step's metadata, the blocks of the chunks the
step saves or loads (`ChunkBlocks`, only when vLLM's KV events are on), and rank 0's
`WorkerKVEvents` pairs them with the keys its tiers report (storage/tier_events.py). Rank 0 alone
reports (every rank stores its own shard of a chunk at the same step; counting ranks would need
state across steps for little gain). A tier event whose blocks are not known (yet) waits, bounded;
a chunk in a tier since before this process started (a disk tier's files) is announced once a
request saves or loads it.

A remote tier shared by several instances: each instance announces the chunks it wrote there and
the ones it removed, never the server's own evictions (it is not told). A router should take a
REMOTE placement announced by any instance as loadable by every instance on that remote, and as a
hint: a chunk the server evicted is a miss, which the instance recomputes.

Layerwise keys (one object per layer): a chunk is announced by its layer 0's object.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Any

from lmcache_triton.keys import CacheEngineKey
from lmcache_triton.storage.tier_events import REMOVED, STORED, TierEvent, TierEventLog

logger = logging.getLogger("lmcache_triton")

MEDIUM_CPU = "CPU"          # vllm.distributed.kv_events.MEDIUM_CPU
MEDIUM_STORAGE = "STORAGE"  # vllm.distributed.kv_events.MEDIUM_STORAGE


@dataclass(frozen=True)
class ChunkBlocks:
    """vLLM's full blocks in one chunk of a request: what our events say of it besides the tier."""

    block_hashes: tuple[Any, ...]  # vLLM's ExternalBlockHash: bytes, or int with VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES
    parent_block_hash: Any
    token_ids: tuple[int, ...]
    block_size: int
    lora_id: int | None = None
    lora_name: str | None = None
    extra_keys: tuple[tuple[Any, ...] | None, ...] | None = None


def kv_events_enabled(vllm_config: Any) -> bool:
    config = getattr(vllm_config, "kv_events_config", None)
    return bool(config is not None and getattr(config, "enable_kv_cache_events", False))


def request_chunk_blocks(request: Any, start: int, end: int, chunk_size: int, block_size: int
                         ) -> tuple[tuple[int, ChunkBlocks], ...]:
    """Scheduler side: (chunk index, blocks) of each chunk of tokens [start, end) (`start`
    chunk-aligned) that covers at least one of vLLM's full, hashed blocks."""
    from vllm.v1.core.kv_cache_utils import (
        generate_block_hash_extra_keys,
        maybe_convert_block_hash,
        to_event_extra_keys,
    )

    hashes = getattr(request, "block_hashes", None) or []
    if not hashes:  # vLLM hashes blocks only with its prefix cache on: nothing to name them by
        return ()
    lora = getattr(request, "lora_request", None)
    tokens = request.all_token_ids
    out = []
    for i in range(start // chunk_size, -(-end // chunk_size)):
        first = i * chunk_size // block_size
        last = min(min((i + 1) * chunk_size, end) // block_size, len(hashes))
        if last <= first:
            continue
        extra = [generate_block_hash_extra_keys(request, b * block_size, (b + 1) * block_size, 0)[0]
                 for b in range(first, last)]
        event_extra = to_event_extra_keys(extra) if any(k is not None for k in extra) else None
        out.append((i, ChunkBlocks(
            block_hashes=tuple(maybe_convert_block_hash(h) for h in hashes[first:last]),
            parent_block_hash=maybe_convert_block_hash(hashes[first - 1]) if first > 0 else None,
            token_ids=tuple(tokens[first * block_size:last * block_size]),
            block_size=block_size,
            lora_id=lora.adapter_id if lora is not None else None,
            lora_name=lora.name if lora is not None else None,
            extra_keys=tuple(event_extra) if event_extra else None)))
    return tuple(out)


@dataclass(frozen=True)
class Placement:
    """One chunk in one tier, as an event says it: what `to_vllm` turns into BlockStored/BlockRemoved."""

    stored: bool
    blocks: ChunkBlocks
    medium: str
    locality: str | None


class KVEventLedger:
    """Pairs the tiers' key events with the blocks the scheduler named; decides what to announce.

    `resident` holds each announced chunk's blocks and tiers until its last tier drops it (then a
    removal is announced per tier, and it is forgotten). Blocks named but not (yet) in a tier, and
    tier events whose blocks are not named yet, wait in bounded LRU maps: a placement missed is a
    router's miss, never a wrong token."""

    def __init__(self, tiers: dict[str, tuple[str, str | None]], limit: int = 1 << 16) -> None:
        self.tiers = tiers  # tier name -> (medium, locality)
        self.limit = limit
        self.resident: dict[str, tuple[ChunkBlocks, set[str]]] = {}
        self._named: OrderedDict[str, ChunkBlocks] = OrderedDict()
        self._waiting: OrderedDict[str, set[str]] = OrderedDict()  # chunk hash -> tiers holding it

    def name(self, chunk_hash: str, blocks: ChunkBlocks) -> list[Placement]:
        """The scheduler named `chunk_hash`'s blocks: announces the tiers that already hold it."""
        if chunk_hash in self.resident:
            return []
        tiers = self._waiting.pop(chunk_hash, None)
        if not tiers:
            self._remember(self._named, chunk_hash, blocks)
            return []
        self._named.pop(chunk_hash, None)
        self.resident[chunk_hash] = (blocks, set(tiers))
        return [self._placement(True, blocks, tier) for tier in sorted(tiers)]

    def apply(self, events: Iterable[TierEvent]) -> list[Placement]:
        out: list[Placement] = []
        for ev in events:
            if ev.tier not in self.tiers or ev.key.layer_id not in (None, 0):
                continue
            h = ev.key.chunk_hash
            if ev.kind == STORED:
                out.extend(self._stored(h, ev.tier))
            elif ev.kind == REMOVED:
                out.extend(self._removed(h, ev.tier))
        return out

    def _stored(self, h: str, tier: str) -> list[Placement]:
        entry = self.resident.get(h)
        if entry is None:
            blocks = self._named.pop(h, None)
            if blocks is None:  # not named yet: announced when the scheduler names it
                self._remember(self._waiting, h, self._waiting.pop(h, set()) | {tier})
                return []
            entry = self.resident[h] = (blocks, set())
        if tier in entry[1]:
            return []
        entry[1].add(tier)
        return [self._placement(True, entry[0], tier)]

    def _removed(self, h: str, tier: str) -> list[Placement]:
        waiting = self._waiting.get(h)
        if waiting is not None:
            waiting.discard(tier)
            if not waiting:
                del self._waiting[h]
        entry = self.resident.get(h)
        if entry is None or tier not in entry[1]:
            return []
        entry[1].discard(tier)
        if not entry[1]:  # in no tier now: its blocks wait to be named again, like any other
            del self.resident[h]
            self._remember(self._named, h, entry[0])
        return [self._placement(False, entry[0], tier)]

    def _placement(self, stored: bool, blocks: ChunkBlocks, tier: str) -> Placement:
        medium, locality = self.tiers[tier]
        return Placement(stored, blocks, medium, locality)

    def _remember(self, lru: OrderedDict, key: str, value: Any) -> None:
        lru[key] = value
        lru.move_to_end(key)
        while len(lru) > self.limit:
            lru.popitem(last=False)


def to_vllm(placements: Iterable[Placement]) -> list[Any]:
    """vLLM's event objects (msgspec structs its publisher encodes)."""
    from vllm.distributed.kv_events import BlockRemoved, BlockStored

    out = []
    for p in placements:
        b = p.blocks
        if p.stored:
            out.append(BlockStored(block_hashes=list(b.block_hashes), parent_block_hash=b.parent_block_hash,
                                   token_ids=list(b.token_ids), block_size=b.block_size, lora_id=b.lora_id,
                                   medium=p.medium, lora_name=b.lora_name,
                                   extra_keys=list(b.extra_keys) if b.extra_keys else None,
                                   group_idx=0, locality=p.locality))
        else:
            out.append(BlockRemoved(block_hashes=list(b.block_hashes), medium=p.medium, group_idx=0,
                                    locality=p.locality))
    return out


class WorkerKVEvents:
    """Rank 0's side: names the keys of the chunks each step saves or loads, and turns its tiers'
    events into vLLM's, once a step (`take`)."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        storage = engine.storage_manager
        self.log: TierEventLog = storage.watch()
        tiers = {tier.name: (MEDIUM_STORAGE, tier.locality) for tier in storage.tiers}
        from lmcache_triton.storage.manager import CPU_TIER
        tiers[CPU_TIER] = (MEDIUM_CPU, None)
        self.ledger = KVEventLedger(tiers)
        self._pending: list[Placement] = []

    def name_step(self, requests: Iterable[Any]) -> None:
        """The step's metadata: each request's chunk blocks, keyed as the engine keys them."""
        from lmcache_triton.keys import KeyScope

        for req in requests:
            blocks = getattr(req, "chunk_blocks", None)
            if not blocks or req.chunk_hashes is None:
                continue
            make = self.engine.token_database.scoped_keys(KeyScope(namespace=req.namespace, adapter=req.adapter))
            hashes, chunk = req.chunk_hashes, req.chunk_hashes.chunk_size
            for i, chunk_blocks in blocks:
                start = i * chunk
                span = hashes.get(i, start, min(start + chunk, hashes.num_tokens))
                if span is not None:
                    key: CacheEngineKey = make(span)
                    self._pending.extend(self.ledger.name(key.chunk_hash, chunk_blocks))

    def take(self) -> list[Any]:
        """vLLM's events since the last call (the tiers' events drained now)."""
        placements, self._pending = self._pending, []
        placements.extend(self.ledger.apply(self.log.drain()))
        return to_vllm(placements) if placements else []


class SchedulerKVEvents:
    """The scheduler's side: names each step's chunk blocks for the workers, and hands vLLM's
    publisher what rank 0 reported (`take_events`)."""

    def __init__(self, chunk_size: int, block_size: int) -> None:
        self.chunk_size, self.block_size = chunk_size, block_size
        self._events: list[Any] = []

    def name_blocks(self, meta: Any, request: Any) -> Any:
        """`meta` (a ReqMeta) with the blocks of the chunks it covers. Never raises: a request whose
        blocks cannot be named is one whose placements go unannounced."""
        if meta.chunk_hashes is None or request is None:
            return meta
        try:
            blocks = request_chunk_blocks(request, meta.token_offset, meta.num_tokens, self.chunk_size,
                                          self.block_size)
        except Exception:
            logger.exception("lmcache_triton: naming the KV event blocks of %s failed", meta.req_id)
            return meta
        return replace(meta, chunk_blocks=blocks) if blocks else meta

    def collect(self, connector_output: Any) -> None:
        events = getattr(connector_output, "kv_cache_events", None)
        if events is not None:
            self._events.extend(events.get_all_events())

    def take(self) -> list[Any]:
        events, self._events = self._events, []
        return events
