"""LMCacheEngine: token ids -> chunk keys -> GPU connector (gather/scatter) -> StorageManager.

One store loop and one retrieve loop serve both modes: the GPU connector says how many steps a
move takes (1 for all layers at once, L for layerwise) and the engine yields between them, so
`store`/`retrieve` run the loops to the end and `store_layer`/`retrieve_layer` hand them to a
caller that interleaves them with the model's layers.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import Counter
from collections.abc import Generator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypedDict

import torch

from lmcache_triton.config import LMCacheEngineConfig
from lmcache_triton.engine.gpu_connector import GPUConnectorInterface, KeyRotation, KVTarget
from lmcache_triton.engine.load_policy import LOAD, RECOMPUTE, TIER_SLOW, ChunkAt, PrefillEstimate, decide
from lmcache_triton.engine.reservations import LookupReservations
from lmcache_triton.engine.token_database import ChunkedTokenDatabase, TokenDatabase, num_tokens
from lmcache_triton.keys import CacheEngineKey, ChunkHashes, KeyScope, MMSpan
from lmcache_triton.metadata import LMCacheEngineMetadata
from lmcache_triton.observability.stats import EngineSnapshot, LMCStatsMonitor
from lmcache_triton.storage.base import StorageBackend
from lmcache_triton.storage.manager import (
    CPU_TIER,
    MISS_BLEND,
    MISS_CORRUPT,
    MISS_DEADLINE,
    MISS_PARTIAL,
    MISS_RECOMPUTE_CHEAPER,
    MISS_REFUSED,
    Hold,
    StorageManager,
)
from lmcache_triton.storage.memory import MemoryObj

if TYPE_CHECKING:
    from typing import Unpack

logger = logging.getLogger("lmcache_triton")

Tokens = torch.Tensor | Sequence[int]
# Token ids from position 0, or (prefix mode, with `chunk_hashes`) only how many there are.
TokensOrCount = Tokens | int


class KeyScopeArgs(TypedDict, total=False):
    """The keyword arguments that name a request's keys besides its tokens (see `KeyScope`)."""

    namespace: str
    adapter: str
    mm_spans: Sequence[MMSpan] | None
    extra_hashes: Sequence[bytes] | None
    chunk_hashes: ChunkHashes | Sequence[bytes] | None


_NO_SCOPE = KeyScope()


def _scope(args: KeyScopeArgs) -> KeyScope:
    """The request's KeyScope; one shared instance for the usual call with none (frozen)."""
    return KeyScope(**args) if args else _NO_SCOPE


def _drain(gen: Generator) -> object:
    """Runs a generator to its end and returns its return value."""
    while True:
        try:
            next(gen)
        except StopIteration as stop:
            return stop.value


def _stepwise_inference(gen: Generator):
    """`gen`'s steps, each run in inference mode and only while it runs: a `with` around a `yield`
    would leave the caller's thread in inference mode while the generator waits (and for good if
    it is dropped unfinished), so tensors the caller makes meanwhile could not be written in place."""
    try:
        while True:
            with torch.inference_mode():
                try:
                    item = next(gen)
                except StopIteration as stop:
                    return stop.value
            yield item
    finally:  # closed early (vLLM gave up on the step): the steps' own cleanup runs now
        with torch.inference_mode():
            gen.close()


def _relative_error(fresh: torch.Tensor, stored: torch.Tensor) -> float:
    a, b = fresh.float(), stored.float()
    if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
        return math.inf if not torch.equal(a.nan_to_num(), b.nan_to_num()) else 0.0
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-6))


def _sync(kvcaches: Sequence[torch.Tensor] | None) -> None:
    """Waits for queued copies: a chunk is visible to other readers only once its bytes landed."""
    if kvcaches and kvcaches[0].is_cuda:
        torch.cuda.current_stream(kvcaches[0].device).synchronize()


_VERIFY_TOLERANCE = {  # max |fresh - stored| / max |stored| per chunk: recomputation in another
    torch.float32: 1e-3,   # batch may round differently, corrupt or foreign KV differs by O(1)
    torch.float16: 1e-2,
    torch.bfloat16: 4e-2,
}
_VERIFY_TOLERANCE_1BYTE = 0.25  # fp8 caches


@dataclass(frozen=True)
class CacheMode:
    """How an engine keys and reuses chunks, fixed when it is built.

    Prefix mode (the default): `ChunkedTokenDatabase`, chunks reused behind the same prefix.
    CacheBlend's segment mode: a `SegmentTokenDatabase` and the model's `key_rotation`, which
    stores each segment's K as if it started at position 0 so the blender can move it anywhere."""

    token_database: TokenDatabase
    key_rotation: KeyRotation | None = None

    @classmethod
    def prefix(cls, config: LMCacheEngineConfig, metadata: LMCacheEngineMetadata,
               gpu_connector: GPUConnectorInterface) -> CacheMode:
        return cls(ChunkedTokenDatabase(config.chunk_size, metadata, save_unfull_chunk=config.save_unfull_chunk,
                                        fmt=gpu_connector.fmt, namespace_secret=config.namespace_secret))

    @property
    def prefix_chain(self) -> bool:
        return self.token_database.prefix_chain


class LMCacheEngine:
    """Stores and retrieves the KV of token sequences, chunk by chunk.

    Every call names its keys with `KeyScopeArgs`: `namespace` (the request's cache salt: keys in
    one namespace never match another's; keys carry only a keyed digest of it), `adapter` (the
    LoRA adapter), `mm_spans` (multimodal placeholder spans and hashes) and `extra_hashes`.
    Loads and saves take vLLM's paged cache as `kvcaches`, `slot_mapping` (slot of token
    `offset + i` at index i) and `offset`.

    In prefix mode `chunk_hashes` (the token chain, precomputed by `keys.TokenChain` over the same
    tokens and multimodal spans: what vLLM's scheduler sends) spares hashing the tokens again;
    then `tokens` may be their count alone, and the chunks before the hashes are skipped as by a
    mask. The keys are the same as from the token ids.
    """

    def __init__(self, config: LMCacheEngineConfig, metadata: LMCacheEngineMetadata,
                 gpu_connector: GPUConnectorInterface, *, storage_manager: StorageManager | None = None,
                 mode: CacheMode | None = None) -> None:
        if config.chunk_size != metadata.chunk_size:
            raise ValueError(
                f"config chunk_size={config.chunk_size} differs from metadata kv_shape[2]={metadata.chunk_size}"
            )
        if gpu_connector.num_layers != metadata.num_layers or gpu_connector.hidden_dim_size != metadata.hidden_dim_size:
            raise ValueError("gpu_connector geometry does not match the engine metadata")
        self.config = config
        self.metadata = metadata
        self.gpu_connector = gpu_connector
        self.mode = mode or CacheMode.prefix(config, metadata, gpu_connector)
        if self.mode.token_database.fmt != gpu_connector.fmt.value:
            raise ValueError(f"the token database keys {self.mode.token_database.fmt} objects, "
                             f"the GPU connector moves {gpu_connector.fmt.value}")
        if self.mode.key_rotation is not None:
            if gpu_connector.steps != gpu_connector.num_layers or gpu_connector.use_mla:
                raise ValueError("key_rotation (CacheBlend) needs a layerwise, non-MLA GPU connector")
        self.storage_manager = storage_manager or StorageManager(config, metadata)
        self.stats_monitor = LMCStatsMonitor()
        # vLLM's forward time per token on this worker (the integration feeds it each step): what
        # not loading a chunk costs (load_policy.py).
        self.prefill = PrefillEstimate()
        self.reservations = LookupReservations(self.storage_manager.release_all, config.reservation_lease_secs)
        self._verify_logged: set[CacheEngineKey] = set()
        logger.info(
            "lmcache_triton engine: model=%s rank=%d/%d dtype=%s kv_shape=%s connector=%s layout=%s config: %s",
            metadata.model_name, metadata.worker_id, metadata.world_size, metadata.dtype_name,
            metadata.kv_shape, type(gpu_connector).__name__, gpu_connector.layout, config,
        )

    @property
    def token_database(self) -> TokenDatabase:
        return self.mode.token_database

    @property
    def prefix_chain(self) -> bool:
        return self.mode.prefix_chain

    @property
    def layerwise(self) -> bool:
        """One object per (chunk, layer), moved one layer per step."""
        return self.gpu_connector.steps > 1

    # ---- helpers -------------------------------------------------------------------------------
    def _chunks(self, tokens: TokensOrCount, mask: torch.Tensor | None, scope: KeyScope):
        return self.token_database.process_tokens(tokens, mask, scope)

    def _object_keys(self, key: CacheEngineKey) -> list[CacheEngineKey]:
        """The storage keys of one chunk: one per step (itself, or one per layer)."""
        if self.layerwise:
            return [key.with_layer(layer) for layer in range(self.metadata.num_layers)]
        return [key]

    def _target(self, kvcaches: Sequence[torch.Tensor], slot_mapping: torch.Tensor, offset: int,
                write_paged: bool = True) -> KVTarget:
        self.gpu_connector.check_caches(kvcaches)
        return KVTarget(kvcaches, slot_mapping, offset, write_paged)

    # Committing the CPU tier's pages ahead (storage/memory.py) waits until this long after a
    # store or retrieve: beside them it took their memory bandwidth (256 MiB packed prompts stored
    # and retrieved back to back into a 4 GB tier, 3 s after start: stores 4.6-5.2 GB/s while it
    # committed the rest, 5.1-5.6 held off); it commits in the pauses between them instead.
    _PREFAULT_QUIET_S = 0.25

    def _quiet_prefault(self) -> None:
        self.storage_manager.defer_prefault(self._PREFAULT_QUIET_S, at_least=True)

    def _allocate(self, num_tokens: int) -> MemoryObj | None:
        shape = self.gpu_connector.get_shape(num_tokens)
        obj = self.storage_manager.allocate(shape, self.metadata.kv_dtype, self.gpu_connector.fmt)
        if obj is None and self.reservations.reap():  # expired reservations may be what fills the tier
            obj = self.storage_manager.allocate(shape, self.metadata.kv_dtype, self.gpu_connector.fmt)
        return obj

    # ---- the store loop ------------------------------------------------------------------------
    def _store_steps(self, tokens: TokensOrCount, mask: torch.Tensor | None, target: KVTarget,
                     scope: KeyScope) -> Generator[None, None, int]:
        """Saves every chunk of `tokens` not yet stored, one connector step per `next()`; returns
        the tokens stored. Whether a chunk is stored is asked of memory only (the CPU tier, the
        disk's index), never of a remote: this runs inside vLLM's step."""
        t0 = time.perf_counter()
        self._quiet_prefault()
        steps = self.gpu_connector.steps
        chunks = [(start, end, self._object_keys(key)) for start, end, key in self._chunks(tokens, mask, scope)]
        present = self.storage_manager.contains([k for *_, keys in chunks for k in keys], io=False, prefix=False)
        starts: list[int] = []
        ends: list[int] = []
        keys_by_chunk: list[list[CacheEngineKey]] = []
        objs_by_chunk: list[list[MemoryObj]] = []
        refusals = 0
        complete = False
        mover = None
        try:
            todo = [c for i, c in enumerate(chunks) if not all(present[i * steps:(i + 1) * steps])]
            objs_by_chunk.extend([] for _ in todo)  # freed by the finally below if anything fails
            # Step-major: one step's (layer's) objects of consecutive chunks are consecutive
            # allocations, so the first-fit pool places them side by side and the layerwise
            # connector moves them in one launch per layer (not one per chunk and layer).
            limit = len(todo)
            for step in range(steps):
                for i in range(limit):
                    obj = self._allocate(todo[i][1] - todo[i][0])
                    if obj is None:  # the tier is full of held chunks: later chunks are useless without this one
                        refusals += 1
                        self.storage_manager.note_miss(todo[i][2][step], MISS_REFUSED)
                        limit = i
                        break
                    objs_by_chunk[i].append(obj)
            for objs in objs_by_chunk[limit:]:
                for obj in objs:
                    obj.free()
            del objs_by_chunk[limit:]
            for start, end, keys in todo[:limit]:
                starts.append(start)
                ends.append(end)
                keys_by_chunk.append(keys)
            by_step = [[objs[step] for objs in objs_by_chunk] for step in range(steps)]
            rotation = {} if self.mode.key_rotation is None else {"key_rotation": self.mode.key_rotation}
            mover = self.gpu_connector.batched_from_gpu(by_step, starts, ends, target, **rotation)
            for _ in range(steps):
                next(mover)
                yield
            # One wait for all steps' copies, after the last: a wait per layer would stall the
            # forward between layers. Only then do the chunks become visible to readers. (Closing
            # the mover orders the current stream after a layerwise connector's side stream.)
            mover.close()
            _sync(target.kvcaches)
            for step, objs_of_step in enumerate(by_step):
                self.storage_manager.batched_put([keys[step] for keys in keys_by_chunk], objs_of_step)
            complete = True
        finally:  # closed early or failed: nothing was put, so the objects are still ours to free
            self._quiet_prefault()
            if not complete:
                if mover is not None:
                    mover.close()
                _sync(target.kvcaches)
                for obj in (o for objs in objs_by_chunk for o in objs):
                    obj.free()
        stored = sum(e - s for s, e in zip(starts, ends))
        self.stats_monitor.on_store(stored, stored * self.metadata.bytes_per_token(),
                                    time.perf_counter() - t0, refusals)
        return stored

    @torch.inference_mode()
    def store(self, tokens: TokensOrCount, mask: torch.Tensor | None = None, *, kvcaches: Sequence[torch.Tensor],
              slot_mapping: torch.Tensor, offset: int = 0, **scope: Unpack[KeyScopeArgs]) -> int:
        """Saves the KV of every chunk of `tokens` not yet stored; returns the tokens stored now.
        `mask` (False...False True...True) skips a chunk-aligned prefix vLLM already saved."""
        return _drain(self._store_steps(tokens, mask, self._target(kvcaches, slot_mapping, offset),
                                        _scope(scope)))

    def store_layer(self, tokens: TokensOrCount, mask: torch.Tensor | None = None, *, kvcaches: Sequence[torch.Tensor],
                    slot_mapping: torch.Tensor, offset: int = 0,
                    **scope: Unpack[KeyScopeArgs]) -> Generator[None, None, int]:
        """`store` as a generator for the layerwise connectors: each `next()` saves one layer of
        every new chunk (layer 0 first), so vLLM can call it from `save_kv_layer`."""
        if not self.layerwise:
            raise RuntimeError("store_layer needs a layerwise GPU connector (config use_layerwise: true)")
        target = self._target(kvcaches, slot_mapping, offset)
        return (yield from _stepwise_inference(self._store_steps(tokens, mask, target, _scope(scope))))

    # ---- prefill/decode disaggregation -----------------------------------------------------------
    @torch.inference_mode()
    def send(self, tokens: TokensOrCount, *, to: StorageBackend, kvcaches: Sequence[torch.Tensor],
             slot_mapping: torch.Tensor, offset: int = 0, **scope: Unpack[KeyScopeArgs]) -> int:
        """Sends the chunks of `tokens` to another instance's tier `to` (a PD receiver), first chunk
        first, and waits for each; returns the end of the prefix the receiver now keeps. A chunk
        this tier keeps is sent as stored, any other is gathered from the paged cache. It stops at
        the first chunk that fails (the receiver is gone or full): the chunks after it would be
        useless without it, and the decoder computes them itself."""
        if self.layerwise or not self.prefix_chain:
            raise RuntimeError("sending chunks (prefill/decode disaggregation) needs the all-layers prefix mode")
        target = self._target(kvcaches, slot_mapping, offset)
        held = 0
        for start, end, key in self._chunks(tokens, None, _scope(scope)):
            obj = self.storage_manager.get_in_memory(key)
            if obj is not None:
                try:
                    ok = to.put(key, obj)
                finally:
                    self.storage_manager.release(key, obj)
            else:
                obj = self._allocate(end - start)
                if obj is None:
                    break
                try:
                    _drain(self.gpu_connector.batched_from_gpu([[obj]], [start], [end], target))
                    _sync(kvcaches)
                    ok = to.put(key, obj)
                finally:
                    obj.free()
            if not ok:
                break
            held = end
        return held

    # ---- the retrieve loop ---------------------------------------------------------------------
    def _retrieve_steps(self, tokens: TokensOrCount, mask: torch.Tensor | None, target: KVTarget,
                        scope: KeyScope) -> Generator[None, None, torch.Tensor]:
        """Loads the stored chunks of `tokens` (the longest prefix in prefix mode), one connector
        step per `next()`; returns the bool mask of loaded tokens (StopIteration.value)."""
        t0 = time.perf_counter()
        self._quiet_prefault()
        steps = self.gpu_connector.steps
        ret_mask = torch.zeros(num_tokens(tokens), dtype=torch.bool)
        requested = len(ret_mask) - self.token_database.num_skipped(tokens, mask, scope)
        starts: list[int] = []
        ends: list[int] = []
        held: list[tuple[list[CacheEngineKey], list[MemoryObj]]] = []
        in_memory: list[Hold] = []  # the CPU tier's prefix, held at once; each moves into `held` in turn
        taken = 0
        mover = None
        try:
            chunks = list(self._chunks(tokens, mask, scope))
            if steps == 1:  # one lock for the prefix (128 chunks at 32K tokens: a lock each was ~0.5 ms)
                self.storage_manager.hold_prefix_in_memory([key for _, _, key in chunks], in_memory)
            for start, end, key in chunks:
                keys = self._object_keys(key)
                objs: list[MemoryObj] = []
                held.append((keys, objs))  # released by the finally below, loaded or not
                if taken < len(in_memory) and in_memory[taken][0] == keys[0]:
                    objs.append(in_memory[taken][1])
                    taken += 1
                while len(objs) < steps and (obj := self.storage_manager.get(keys[len(objs)])) is not None:
                    objs.append(obj)
                if len(objs) < steps:
                    held.pop()
                    for k, obj in zip(keys, objs):
                        self.storage_manager.release(k, obj)
                    if self.prefix_chain:
                        break
                    continue
                starts.append(start)
                ends.append(end)
                ret_mask[start:end] = True
            by_step = [[objs[step] for _, objs in held] for step in range(steps)]
            mover = self.gpu_connector.batched_to_gpu(by_step, starts, ends, target)
            for _ in range(steps):
                next(mover)  # the connector orders vLLM's stream after this step's copy
                yield None
        finally:
            self._quiet_prefault()
            # The copies read the objects until they land: one wait, then release every hold
            # (also when the generator is closed early or fails; closing the mover orders the
            # current stream after the layers a layerwise connector queued ahead).
            if mover is not None:
                mover.close()
            _sync(target.kvcaches)
            self.storage_manager.release_all([*(hold for keys, objs in held for hold in zip(keys, objs)),
                                              *in_memory[taken:]])
        hit = int(ret_mask.sum())
        seconds = time.perf_counter() - t0
        if hit:  # what a copy out of the CPU tier costs, for the next decision
            self.storage_manager.cpu_cost.observe_transfer(hit * self.metadata.bytes_per_token(), seconds)
        self.stats_monitor.on_retrieve(requested, hit, hit * self.metadata.bytes_per_token(), seconds)
        return ret_mask

    @torch.inference_mode()
    def retrieve(self, tokens: TokensOrCount, mask: torch.Tensor | None = None, *, kvcaches: Sequence[torch.Tensor],
                 slot_mapping: torch.Tensor, offset: int = 0, **scope: Unpack[KeyScopeArgs]) -> torch.Tensor:
        """Loads the longest stored prefix into the paged cache; returns a bool mask of loaded tokens."""
        return _drain(self._retrieve_steps(tokens, mask, self._target(kvcaches, slot_mapping, offset),
                                           _scope(scope)))

    def retrieve_layer(self, tokens: TokensOrCount, mask: torch.Tensor | None = None, *,
                       kvcaches: Sequence[torch.Tensor], slot_mapping: torch.Tensor, offset: int = 0,
                       write_paged: bool = True,
                       **scope: Unpack[KeyScopeArgs]) -> Generator[None, None, torch.Tensor]:
        """`retrieve` as a generator for the layerwise connectors: yields None after each layer is
        loaded (layer 0 first) and returns the mask of loaded tokens when it ends (StopIteration.value,
        or `yield from`): a step and the result never look alike. vLLM's worker calls `next()`
        before the forward and once per `wait_for_layer_load`. `write_paged=False` (the blender)
        leaves the KV in the buffer connector's layer buffer."""
        if not self.layerwise:
            raise RuntimeError("retrieve_layer needs a layerwise GPU connector (config use_layerwise: true)")
        target = self._target(kvcaches, slot_mapping, offset, write_paged)
        return (yield from _stepwise_inference(self._retrieve_steps(tokens, mask, target, _scope(scope))))

    # ---- lookup --------------------------------------------------------------------------------
    def lookup(self, tokens: TokensOrCount, reserve: bool = False, *, lookup_id: str | None = None,
               deadline: float | None = None, **scope: Unpack[KeyScopeArgs]) -> int:
        """Length of the stored prefix of `tokens` worth loading (a chunk boundary, or the end of a
        saved partial chunk): in prefix mode, the longest stored prefix cut where loading stops
        beating recomputing (config load_policy; load_policy.py); in segment mode, the tokens of the
        stored segments. With `reserve`, the chunks it reports stay held in the CPU tier until
        `release_reservation(lookup_id)`, or at most `reservation_lease_secs`, so the load that
        follows finds them: lower-tier chunks are read into it now, until the load's deadline (and
        `deadline`, time.monotonic(), when the caller stops waiting). Missed tokens are counted by
        why they missed. With `chunk_hashes` (from chunk 0) `tokens` may be their count."""
        t0 = time.perf_counter()
        key_scope = _scope(scope)
        if isinstance(tokens, int) and self.token_database.num_skipped(tokens, None, key_scope):
            raise ValueError("a lookup needs the chunk hashes from the first chunk on")
        lease = self.reservations.begin(lookup_id or "") if reserve else None
        misses: Counter[str] = Counter()
        covered = self.token_database.cached_tokens(tokens)
        try:
            if self.prefix_chain:
                hit, lease = self._lookup_prefix(tokens, key_scope, lease, misses, covered, reserve, deadline)
            else:
                hit, lease = self._lookup_segments(tokens, key_scope, lease, misses)
        finally:
            if lease is not None:
                self.reservations.end(lease)
        # prefix: the tail of a partial chunk (save_unfull_chunk off) is never stored;
        # segments: separators and segments too short to cache
        n = num_tokens(tokens)
        misses[MISS_PARTIAL if self.prefix_chain else MISS_BLEND] += n - covered
        self.stats_monitor.on_lookup(n, hit, time.perf_counter() - t0, misses)
        return hit

    # The answer must reach the scheduler before it stops waiting: reads end this long before.
    # From the reads' stop to the scheduler holding the answer took ~19 ms on the idle 2-core host
    # (tests/integration/vllm/lookup: a lookup cut by a stalled tier answered 19 ms before a 1 s
    # timeout), and more beside a busy neighbour, where a 20 ms margin lost the partial hit.
    _ANSWER_MARGIN_S = 0.05

    def _lookup_prefix(self, tokens: TokensOrCount, scope: KeyScope, lease, misses: Counter[str], covered: int,
                       reserve: bool, deadline: float | None) -> tuple[int, object]:
        started = time.monotonic()
        chunks = list(self._chunks(tokens, None, scope))
        if not chunks:
            return 0, lease
        steps = self.gpu_connector.steps  # objects per chunk: 1, or one per layer
        keys = [k for _, _, key in chunks for k in self._object_keys(key)] if steps > 1 else [key for _, _, key in chunks]
        sm = self.storage_manager
        held: list[Hold] = []
        # the CPU tier's part held (for a reservation), the lower tiers asked
        located = sm.locate_prefix(keys, held if lease is not None else None)
        whole = len(located) // steps
        if whole < len(chunks):  # the rest is unusable behind the first missing chunk
            misses[sm.miss_reason(keys[len(located)])] += covered - chunks[whole][0]
        elif chunks[-1][1] < covered:  # spans the precomputed hashes do not name: not asked
            misses[MISS_PARTIAL] += covered - chunks[-1][1]
        tiers = [CPU_TIER] * located.held + located.lower
        bytes_per_token = self.metadata.bytes_per_token()
        found = [ChunkAt(tiers[(i + 1) * steps - 1], end - start, (end - start) * bytes_per_token, steps)
                 for i, (start, end, _) in enumerate(chunks[:whole])]
        c = self.config
        plan = decide(found, sm.cost_of, self.prefill, policy=c.load_policy, margin=c.load_margin,
                      deadline_factor=c.load_deadline_factor, deadline_ms=c.load_deadline_ms, cpu_tier=CPU_TIER)
        k = plan.chunks
        # CPU-tier holds past the chosen chunks go back now; the rest become the reservation.
        for key, obj in held[k * steps:]:
            sm.release(key, obj)
        del held[k * steps:]
        if lease is None:  # no reservation, or released before this lookup began: hold nothing
            for key, obj in held:
                sm.release(key, obj)
            held = []
        elif not self.reservations.add(lease, held):
            lease = None  # released (timed out, aborted) while we looked: stop holding
        loaded = k
        lower = keys[located.held:k * steps]
        if reserve and lease is not None and lower:  # read the lower tiers' chunks into the CPU tier
            own = None if plan.deadline_s is None else started + plan.deadline_s
            until = own
            if deadline is not None:
                answer_by = deadline - self._ANSWER_MARGIN_S
                until = answer_by if until is None else min(until, answer_by)
            got: list[Hold] = []
            n, late = sm.read_prefix(lower, got, deadline=until)
            if not self.reservations.add(lease, got):
                lease = None
            loaded = (located.held + n) // steps
            if late:
                if own is None or until == own:  # not when its own (later) deadline was not reached
                    sm.cost_of(tiers[located.held + n]).deadline_missed()
                self.stats_monitor.on_deadline_stop()
            else:
                for name in set(tiers[located.held:k * steps]):
                    sm.cost_of(name).deadline_met()
            if loaded < k:
                misses[MISS_DEADLINE if late else MISS_CORRUPT] += chunks[k - 1][1] - chunks[loaded][0]
        if k < whole:
            misses[MISS_RECOMPUTE_CHEAPER] += chunks[whole - 1][1] - chunks[k][0]
            if (plan.rest_reason or plan.reason) == TIER_SLOW:  # for the next request, out of this one's way
                sm.promote_later(keys[k * steps:whole * steps])
        if k:
            self.stats_monitor.on_load_decision(LOAD, plan.reason, chunks[k - 1][1] - chunks[0][0])
        if k < whole:
            self.stats_monitor.on_load_decision(RECOMPUTE, plan.rest_reason or plan.reason,
                                                chunks[whole - 1][1] - chunks[k][0])
        return (chunks[loaded - 1][1] if loaded else 0), lease

    def _lookup_segments(self, tokens: Tokens, scope: KeyScope, lease, misses: Counter[str]) -> tuple[int, object]:
        hit = 0
        for start, end, key in self._chunks(tokens, None, scope):
            keys = self._object_keys(key)
            held: list | None = [] if lease is not None else None
            n = self.storage_manager.contains(keys, io=True, prefix=True, hold_into=held)
            if lease is not None and not self.reservations.add(lease, held):
                lease = None
            if n < len(keys):
                misses[self.storage_manager.miss_reason(keys[n])] += end - start
                continue
            hit += end - start
        return hit, lease

    def release_reservation(self, lookup_id: str | None = None) -> None:
        """Releases the holds a `lookup(reserve=True, lookup_id=...)` took, takes meanwhile, or will take."""
        self.reservations.release(lookup_id or "")

    # ---- verified hits -------------------------------------------------------------------------
    @torch.inference_mode()
    def verify(self, tokens: TokensOrCount, *, kvcaches: Sequence[torch.Tensor], slot_mapping: torch.Tensor,
               offset: int = 0, **scope: Unpack[KeyScopeArgs]) -> tuple[int, int]:
        """Compares each stored chunk of `tokens` held in the CPU tier with the KV vLLM has just
        computed for those tokens (gathered from the paged cache as a store would); returns
        (chunks checked, mismatches). A mismatching chunk is logged once, counted, and removed
        from every tier, so it is never served again."""
        target = self._target(kvcaches, slot_mapping, offset)
        checked = mismatched = 0
        for start, end, key in self._chunks(tokens, None, _scope(scope)):
            keys = self._object_keys(key)
            stored = [self.storage_manager.get_in_memory(k) for k in keys]  # no I/O: this is vLLM's step
            try:
                if any(obj is None for obj in stored):
                    continue
                fresh = [MemoryObj(torch.empty(obj.shape, dtype=obj.dtype), obj.fmt) for obj in stored]
                _drain(self.gpu_connector.batched_from_gpu([[f] for f in fresh], [start], [end], target))
                _sync(kvcaches)
                error = max(_relative_error(f.tensor, obj.tensor) for f, obj in zip(fresh, stored))
            finally:
                for k, obj in zip(keys, stored):
                    if obj is not None:
                        self.storage_manager.release(k, obj)
            checked += 1
            if error > _VERIFY_TOLERANCE.get(self.metadata.kv_dtype, _VERIFY_TOLERANCE_1BYTE):
                mismatched += 1
                if key not in self._verify_logged:
                    self._verify_logged.add(key)
                    logger.warning("lmcache_triton: stored chunk of tokens [%d, %d) differs from the KV the model "
                                   "computed (relative error %.3g); removed from every tier", start, end, error)
                for k in keys:
                    self.storage_manager.remove(k)
                    self.storage_manager.note_miss(k, MISS_CORRUPT)
        self.stats_monitor.on_verify(checked, mismatched)
        return checked, mismatched

    # ---- lifecycle -----------------------------------------------------------------------------
    def get_stats(self):
        return self.stats_monitor.get_stats()

    def snapshot(self) -> EngineSnapshot:
        """Everything an exporter reads, at one time: the stats, each tier's, and the reservations
        (expired leases are reaped first, so a lease past its bound shows as released)."""
        self.reservations.reap()
        return EngineSnapshot(model=self.metadata.model_name, rank=self.metadata.worker_id,
                              stats=self.get_stats(), tiers=self.storage_manager.usage(),
                              expired_reservations=self.reservations.expired_leases,
                              costs=self.storage_manager.costs(), prefill_seconds_per_token=self.prefill.per_token_s)

    def close(self) -> None:
        self.reservations.release_everything()
        self.storage_manager.close()


class LMCacheEngineBuilder:
    """Process-wide registry of engines by instance id (one per vLLM worker)."""

    _engines: dict[str, LMCacheEngine] = {}
    _lock = threading.Lock()

    @classmethod
    def get_or_create(cls, instance_id: str, config: LMCacheEngineConfig, metadata: LMCacheEngineMetadata,
                      gpu_connector: GPUConnectorInterface, mode: CacheMode | None = None) -> LMCacheEngine:
        """The engine of `instance_id`, built on first use (in `mode`, prefix reuse by default)."""
        with cls._lock:
            engine = cls._engines.get(instance_id)
            if engine is None:
                engine = LMCacheEngine(config, metadata, gpu_connector, mode=mode)
                cls._engines[instance_id] = engine
            elif engine.config != config or engine.metadata != metadata:
                raise ValueError(
                    f"engine {instance_id!r} already exists with another config or metadata; destroy() it first"
                )
            return engine

    @classmethod
    def get(cls, instance_id: str) -> LMCacheEngine | None:
        with cls._lock:
            return cls._engines.get(instance_id)

    @classmethod
    def instance_ids(cls) -> list[str]:
        with cls._lock:
            return list(cls._engines)

    @classmethod
    def destroy(cls, instance_id: str) -> None:
        with cls._lock:
            engine = cls._engines.pop(instance_id, None)
        if engine is not None:
            engine.close()

    @classmethod
    def destroy_all(cls) -> None:
        for instance_id in cls.instance_ids():
            cls.destroy(instance_id)
