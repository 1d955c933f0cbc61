"""The KV-aware proxy's routing core: which blocks each backend holds, and where a prompt goes.

Pure Python: no vLLM, no network, no event loop. The event subscribers (kv_events.py) feed
`BackendIndex.apply` from their threads; the proxy calls `KVRouter.choose` from its event loop.

How a prompt is matched without recomputing vLLM's block hashes. vLLM's `BlockStored` event carries,
besides the blocks' hashes, their parent's hash and their token ids. So each backend's index maps
(parent hash, the block's tokens, its extra keys) -> block hash, learned from its own events, and a
prompt is walked block by block from the root: the first block is the one stored with no parent
and the prompt's first `block_size` tokens, the next the one stored under that hash with the next
tokens, and so on until a block is missing. Nothing here depends on vLLM's hash function
(`--prefix-caching-hash-algo`), its seed (PYTHONHASHSEED, random for xxhash) or its version; each
backend's hashes are only ever compared with its own.

What counts as held: a block with a positive count for at least one medium. Counts are per
(hash, medium): GPU for vLLM's own pool, CPU/STORAGE for offloaded tiers (our connector's, vLLM's
CPU offload), so a removal from the GPU pool does not hide a copy in a CPU tier; the same block
stored twice (vLLM keeps duplicates when two requests compute it at once, and each KV cache group
reports its own) needs two removals. `medium` None (unspecified) counts as GPU. `AllBlocksCleared`
(vLLM's prefix-cache reset) carries no medium: it clears that backend's GPU entries and keeps the
CPU/STORAGE ones, which vLLM's reset does not touch. A backend whose event sequence started over
(it restarted) loses its GPU and CPU entries; STORAGE (disk, remote) outlives a restart.

Limits, all costing a worse route, never a wrong answer: a stored event without token ids (or
whose tokens do not fill its blocks) counts presence but cannot be walked to, unless the same
hash was learned with its tokens before; the prompt is cut in the backend's block size (the last
one its events used), so hybrid models with several block sizes match on one of them; a request's
extra keys are its cache_salt only (on the first block, as vLLM does): LoRA and multimodal prompts
do not match the blocks vLLM stored with their adapter or images, and are routed by load.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

from lmcache_triton.tools.kv_events import AllBlocksCleared, BlockHash, BlockRemoved, BlockStored, KVEvent

GPU, CPU, STORAGE = "GPU", "CPU", "STORAGE"
IN_PROCESS = frozenset({GPU, CPU})  # what a restarted vLLM no longer holds


def extra_digest(extra: object) -> bytes | None:
    """A block's extra keys as a digest: the index never keeps a cache salt itself."""
    if extra is None:
        return None
    return hashlib.blake2b(repr(extra).encode(), digest_size=16).digest()


def request_extras(num_blocks: int, cache_salt: str | None) -> list[bytes | None]:
    """The extra keys vLLM gives a plain-text request's blocks: the salt on the first block only."""
    extras: list[bytes | None] = [None] * num_blocks
    if cache_salt and num_blocks:
        extras[0] = extra_digest((cache_salt,))
    return extras


ChainKey = tuple[BlockHash | None, tuple[int, ...], bytes | None]


class BackendIndex:
    """The blocks one backend holds, as its events said. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: dict[BlockHash, dict[str, int]] = {}   # hash -> medium -> count
        self._chain: dict[ChainKey, BlockHash] = {}          # (parent, tokens, extra) -> hash
        self._key_of: dict[BlockHash, ChainKey] = {}
        self.block_size: int | None = None

    def apply(self, events: Sequence[KVEvent], restarted: bool = False) -> None:
        with self._lock:
            if restarted:
                self._drop_media(IN_PROCESS)
            for event in events:
                if isinstance(event, BlockStored):
                    self._stored(event)
                elif isinstance(event, BlockRemoved):
                    medium = event.medium or GPU
                    for h in event.block_hashes:
                        self._decrement(h, medium)
                elif isinstance(event, AllBlocksCleared):
                    self._drop_media({GPU})

    def _stored(self, e: BlockStored) -> None:
        medium, n, bs = e.medium or GPU, len(e.block_hashes), e.block_size
        walkable = n > 0 and bs > 0 and len(e.token_ids) == n * bs
        if walkable:
            self.block_size = bs
        parent = e.parent_block_hash
        for i, h in enumerate(e.block_hashes):
            media = self._counts.setdefault(h, {})
            media[medium] = media.get(medium, 0) + 1
            if walkable and h not in self._key_of:
                extra = e.extra_keys[i] if e.extra_keys and i < len(e.extra_keys) else None
                key = (parent, tuple(e.token_ids[i * bs:(i + 1) * bs]), extra_digest(extra))
                self._chain[key] = h
                self._key_of[h] = key
            parent = h

    def _decrement(self, h: BlockHash, medium: str) -> None:
        media = self._counts.get(h)
        if not media or medium not in media:
            return  # a removal of something stored before the proxy listened
        media[medium] -= 1
        if media[medium] <= 0:
            del media[medium]
        if not media:
            self._forget(h)

    def _drop_media(self, media: set[str] | frozenset[str]) -> None:
        for h in [h for h, m in self._counts.items() if m.keys() & media]:
            for medium in media:
                self._counts[h].pop(medium, None)
            if not self._counts[h]:
                self._forget(h)

    def _forget(self, h: BlockHash) -> None:
        del self._counts[h]
        key = self._key_of.pop(h, None)
        if key is not None and self._chain.get(key) == h:
            del self._chain[key]

    def matched_blocks(self, token_ids: Sequence[int], cache_salt: str | None = None) -> int:
        """How many leading whole blocks of the prompt this backend holds (any medium)."""
        with self._lock:
            bs = self.block_size
            if not bs or not self._chain:
                return 0
            n = len(token_ids) // bs
            extras = request_extras(n, cache_salt)
            parent: BlockHash | None = None
            for i in range(n):
                h = self._chain.get((parent, tuple(token_ids[i * bs:(i + 1) * bs]), extras[i]))
                if h is None:
                    return i
                parent = h
            return n

    def summary(self) -> dict:
        with self._lock:
            media: dict[str, int] = {}
            for m in self._counts.values():
                for medium in m:
                    media[medium] = media.get(medium, 0) + 1
            return {"blocks": len(self._counts), "walkable_blocks": len(self._chain), "by_medium": media,
                    "block_size": self.block_size}

    def empty(self) -> bool:
        with self._lock:
            return not self._chain


@dataclass(frozen=True)
class Decision:
    backend: int              # index into the router's backends
    matched_tokens: int       # the prompt's tokens that backend holds (0: round-robin)
    kv_routed: bool


@dataclass
class BackendLoad:
    in_flight: int = 0
    requests: int = 0
    kv_routed: int = 0


@dataclass
class KVRouter:
    """Longest cached prefix wins; among equals the fewest requests in flight, then the turn of the
    round-robin; a prompt no backend holds any block of goes round-robin."""
    indexes: list[BackendIndex]
    loads: list[BackendLoad] = field(default_factory=list)
    _next: int = 0

    def __post_init__(self) -> None:
        if not self.indexes:
            raise ValueError("the router needs at least one backend")
        self.loads = self.loads or [BackendLoad() for _ in self.indexes]
        self.kv_routed = self.round_robin = 0

    def any_blocks(self) -> bool:
        return any(not ix.empty() for ix in self.indexes)

    def choose(self, token_ids: Sequence[int] | None, cache_salt: str | None = None) -> Decision:
        """`token_ids` None: the prompt could not be tokenized; it goes round-robin."""
        n = len(self.indexes)
        matched = [ix.matched_blocks(token_ids, cache_salt) * (ix.block_size or 0) for ix in self.indexes] \
            if token_ids else [0] * n
        best = max(matched)
        if best == 0:
            decision = Decision(self._next, 0, False)
            self._next = (self._next + 1) % n
            self.round_robin += 1
        else:
            tied = [i for i in range(n) if matched[i] == best]
            pick = min(tied, key=lambda i: (self.loads[i].in_flight, (i - self._next) % n))
            decision = Decision(pick, best, True)
            self.kv_routed += 1
            self.loads[pick].kv_routed += 1
        return decision

    def order_after(self, first: int) -> list[int]:
        """Every backend, `first` first, then the others in turn: where to go when one is down."""
        n = len(self.indexes)
        return [(first + k) % n for k in range(n)]
