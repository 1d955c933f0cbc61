"""LMCacheEngine: token ids -> chunk keys -> GPU connector (gather/scatter) -> StorageManager."""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import Counter
from collections.abc import Callable, Generator, Sequence
from typing import Any

import torch

from lmcache_triton.observability import prometheus as metrics
from lmcache_triton.config import LMCacheEngineConfig
from lmcache_triton.engine.gpu_connector import GPUConnectorInterface, VLLMPagedMemLayerwiseGPUConnector
from lmcache_triton.storage.memory import MemoryObj
from lmcache_triton.metadata import LMCacheEngineMetadata
from lmcache_triton.observability.stats import LMCStatsMonitor
from lmcache_triton.engine.reservations import LookupReservations
from lmcache_triton.storage.manager import MISS_BLEND, MISS_CORRUPT, MISS_PARTIAL, MISS_REFUSED, StorageManager
from lmcache_triton.engine.token_database import CacheEngineKey, ChunkedTokenDatabase

logger = logging.getLogger("lmcache_triton")

Tokens = torch.Tensor | Sequence[int]


def _drain(gen: Generator[Any, None, Any]) -> Any:
    """Runs a generator to its end and returns its return value."""
    while True:
        try:
            next(gen)
        except StopIteration as stop:
            return stop.value


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


class LMCacheEngine:
    """Stores and retrieves the KV of token sequences, chunk by chunk.

    Keyword arguments of store/retrieve/store_layer/retrieve_layer/lookup go to the GPU connector
    (`kvcaches`, `slot_mapping`, `offset`), except those that name the keys: `namespace` (the
    request's cache salt: keys in one namespace never match another's; keys carry only a keyed
    digest of it), `adapter` (the LoRA adapter: its KV is not the base model's), `mm_spans`
    (multimodal inputs' placeholder spans and hashes) and `extra_hashes` (per-chunk bytes folded
    into the key).
    """

    def __init__(self, config: LMCacheEngineConfig, metadata: LMCacheEngineMetadata,
                 gpu_connector: GPUConnectorInterface, *, storage_manager: StorageManager | None = None,
                 token_database: Any = None) -> None:
        if config.chunk_size != metadata.chunk_size:
            raise ValueError(
                f"config chunk_size={config.chunk_size} differs from metadata kv_shape[2]={metadata.chunk_size}"
            )
        if gpu_connector.num_layers != metadata.num_layers or gpu_connector.hidden_dim_size != metadata.hidden_dim_size:
            raise ValueError("gpu_connector geometry does not match the engine metadata")
        self.config = config
        self.metadata = metadata
        self.gpu_connector = gpu_connector
        self.layerwise = isinstance(gpu_connector, VLLMPagedMemLayerwiseGPUConnector)
        # A ChunkedTokenDatabase (prefix reuse), or CacheBlend's SegmentTokenDatabase: segments are
        # reusable wherever they appear, so a missing one does not end a lookup or a load.
        self.token_database = token_database or ChunkedTokenDatabase(
            config.chunk_size, metadata, save_unfull_chunk=config.save_unfull_chunk, fmt=gpu_connector.fmt,
            namespace_secret=config.namespace_secret,
        )
        self.prefix_chain = self.token_database.prefix_chain
        # Set by CacheBlend: re-rotates a stored segment's K (`[T, hidden]`, computed at positions
        # start..) to positions 0.., so the blender can move it to wherever it appears next.
        self.key_rotation: Callable[[torch.Tensor, int], None] | None = None
        self.storage_manager = storage_manager or StorageManager(config, metadata)
        self.stats_monitor = LMCStatsMonitor(labels=(metadata.model_name, str(metadata.worker_id)))
        self.reservations = LookupReservations(self.storage_manager.release, config.reservation_lease_secs)
        self._verify_logged: set[CacheEngineKey] = set()
        metrics.track(self)
        if config.prometheus_port is not None:
            metrics.serve(config.prometheus_port + metadata.worker_id)
        logger.info(
            "lmcache_triton engine: model=%s rank=%d/%d dtype=%s kv_shape=%s connector=%s layout=%s config: %s",
            metadata.model_name, metadata.worker_id, metadata.world_size, metadata.dtype_name,
            metadata.kv_shape, type(gpu_connector).__name__, gpu_connector.layout, config,
        )

    # ---- helpers -------------------------------------------------------------------------------
    def _chunks(self, tokens: Tokens, mask: torch.Tensor | None, kwargs: dict[str, Any]):
        return self.token_database.process_tokens(
            tokens, mask, namespace=kwargs.pop("namespace", "") or "", extra_hashes=kwargs.pop("extra_hashes", None),
            adapter=kwargs.pop("adapter", "") or "", mm_spans=kwargs.pop("mm_spans", None),
        )

    def _object_keys(self, key: CacheEngineKey) -> list[CacheEngineKey]:
        """The storage keys of one chunk: itself, or one per layer in the layerwise mode."""
        if self.layerwise:
            return [key.with_layer(layer) for layer in range(self.metadata.num_layers)]
        return [key]

    def _check_caches(self, kwargs: dict[str, Any]) -> None:
        if "kvcaches" in kwargs:
            self.gpu_connector.check_caches(kwargs["kvcaches"])

    def _allocate(self, num_tokens: int) -> MemoryObj | None:
        obj = self.storage_manager.allocate(self.gpu_connector.get_shape(num_tokens), self.metadata.kv_dtype,
                                            self.gpu_connector.fmt)
        if obj is None and self.reservations.reap():  # expired lookup holds may be what fills the tier
            obj = self.storage_manager.allocate(self.gpu_connector.get_shape(num_tokens), self.metadata.kv_dtype,
                                                self.gpu_connector.fmt)
        return obj

    # ---- all layers at once --------------------------------------------------------------------
    @torch.inference_mode()
    def store(self, tokens: Tokens, mask: torch.Tensor | None = None, **kwargs: Any) -> int:
        """Saves the KV of every chunk of `tokens` not yet stored; returns the tokens stored now.

        Runs inside vLLM's step: whether a chunk is stored is asked of memory only (the CPU tier,
        the disk's index), never of a remote; the remote's writer skips what it already holds."""
        if self.layerwise:
            return _drain(self.store_layer(tokens, mask, **kwargs))
        self._check_caches(kwargs)
        t0 = time.perf_counter()
        stored: list[tuple[CacheEngineKey, MemoryObj]] = []
        num_tokens = refusals = 0
        chunks = list(self._chunks(tokens, mask, kwargs))
        present = self.storage_manager.contains_in_memory([key for _, _, key in chunks])
        try:
            for (start, end, key), already in zip(chunks, present):
                if already:
                    continue
                obj = self._allocate(end - start)
                if obj is None:  # the tier is full of held chunks: later chunks are useless without this one
                    refusals += 1
                    self.storage_manager.note_miss(key, MISS_REFUSED)
                    break
                stored.append((key, obj))
                self.gpu_connector.from_gpu(obj, start, end, **kwargs)
                num_tokens += end - start
            _sync(kwargs.get("kvcaches"))
        except BaseException:  # nothing was put: the objects are still ours to free
            for _, obj in stored:
                obj.free()
            raise
        nbytes = sum(obj.tensor.nbytes for _, obj in stored)
        self.storage_manager.batched_put([k for k, _ in stored], [o for _, o in stored])
        self.stats_monitor.on_store(num_tokens, nbytes, time.perf_counter() - t0, refusals)
        return num_tokens

    @torch.inference_mode()
    def retrieve(self, tokens: Tokens, mask: torch.Tensor | None = None, **kwargs: Any) -> torch.Tensor:
        """Loads the longest stored prefix into the paged cache; returns a bool mask of loaded tokens."""
        if self.layerwise:
            ret = None
            for ret in self.retrieve_layer(tokens, mask, **kwargs):
                pass
            return ret
        self._check_caches(kwargs)
        t0 = time.perf_counter()
        ret_mask = torch.zeros(len(tokens), dtype=torch.bool)
        requested = len(tokens) - (0 if mask is None else int((~mask.bool()).sum()))
        used: list[tuple[CacheEngineKey, MemoryObj]] = []
        try:
            for start, end, key in self._chunks(tokens, mask, kwargs):
                obj = self.storage_manager.get(key)
                if obj is None:
                    if self.prefix_chain:
                        break
                    continue
                used.append((key, obj))
                self.gpu_connector.to_gpu(obj, start, end, **kwargs)
                ret_mask[start:end] = True
            _sync(kwargs.get("kvcaches"))
        finally:
            for key, obj in used:
                self.storage_manager.release(key, obj)
        hit = int(ret_mask.sum())
        self.stats_monitor.on_retrieve(requested, hit, hit * self.metadata.bytes_per_token(),
                                       time.perf_counter() - t0)
        return ret_mask

    def lookup(self, tokens: Tokens, reserve: bool = False, *, lookup_id: str | None = None, **kwargs: Any) -> int:
        """Length of the longest stored prefix of `tokens` (a chunk boundary, or the end of a saved
        partial chunk). With `reserve`, the chunks it reports stay in the CPU tier until
        `release_reservation(lookup_id)`, or at most `reservation_lease_secs`, so the load that follows finds them.
        Missed tokens are counted by why they missed."""
        t0 = time.perf_counter()
        hit = 0
        lease = self.reservations.begin(lookup_id or "") if reserve else None
        misses: Counter[str] = Counter()
        try:
            for start, end, key in self._chunks(tokens, None, kwargs):
                keys = self._object_keys(key)
                held: list | None = [] if lease is not None else None
                n = self.storage_manager.batched_contains(keys, held=held)
                if lease is not None and not self.reservations.add(lease, held):
                    lease = None  # released (timed out, aborted) while we looked: stop holding
                if n < len(keys):
                    reason = self.storage_manager.miss_reason(keys[n])
                    if self.prefix_chain:
                        misses[reason] += self._chunk_end(tokens) - start  # the rest is unusable behind it
                        break
                    misses[reason] += end - start
                    continue
                hit = end if self.prefix_chain else hit + (end - start)
        finally:
            if lease is not None:
                self.reservations.end(lease)
        if self.prefix_chain:  # the tail of a partial chunk (save_unfull_chunk off) is never stored
            misses[MISS_PARTIAL] += len(tokens) - self._chunk_end(tokens)
        else:  # separators and segments too short to cache
            misses[MISS_BLEND] += len(tokens) - sum(e - s for s, e in self.token_database.segment_bounds(tokens))
        self.stats_monitor.on_lookup(len(tokens), hit, time.perf_counter() - t0, misses)
        return hit

    def _chunk_end(self, tokens: Tokens) -> int:
        bounds = self.token_database.chunk_bounds(len(tokens))
        return bounds[-1][1] if bounds else 0

    def release_reservation(self, lookup_id: str | None = None) -> None:
        """Releases the holds a `lookup(reserve=True, lookup_id=...)` took, took meanwhile, or will take."""
        self.reservations.release(lookup_id or "")

    # ---- verified hits -------------------------------------------------------------------------
    @torch.inference_mode()
    def verify(self, tokens: Tokens, **kwargs: Any) -> tuple[int, int]:
        """Compares each stored chunk of `tokens` held in the CPU tier with the KV vLLM has just
        computed for those tokens (gathered from the paged cache as a store would); returns
        (chunks checked, mismatches). A mismatching chunk is logged once, counted, and removed
        from every tier, so it is never served again."""
        self._check_caches(kwargs)
        checked = mismatched = 0
        for start, end, key in self._chunks(tokens, None, kwargs):
            keys = self._object_keys(key)
            stored = [self.storage_manager.get_in_memory(k) for k in keys]  # no I/O: this is vLLM's step
            try:
                if any(obj is None for obj in stored):
                    continue
                fresh = [MemoryObj(torch.empty(obj.shape, dtype=obj.dtype), obj.fmt) for obj in stored]
                if self.layerwise:
                    _drain(self.gpu_connector.batched_from_gpu([[f] for f in fresh], [start], [end], **kwargs))
                else:
                    self.gpu_connector.from_gpu(fresh[0], start, end, **kwargs)
                _sync(kwargs.get("kvcaches"))
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

    # ---- layerwise -----------------------------------------------------------------------------
    @torch.inference_mode()
    def store_layer(self, tokens: Tokens, mask: torch.Tensor | None = None, **kwargs: Any) -> Generator[None, None, int]:
        """Generator: each `next()` saves one layer of every new chunk (layer 0 first), so vLLM can
        call it from `save_kv_layer` after each layer's forward. One object per (chunk, layer)."""
        if not self.layerwise:
            raise RuntimeError("store_layer needs a layerwise GPU connector (config use_layerwise: true)")
        self._check_caches(kwargs)
        t0 = time.perf_counter()
        num_layers = self.metadata.num_layers
        starts: list[int] = []
        ends: list[int] = []
        keys: list[CacheEngineKey] = []
        objs_by_chunk: list[list[MemoryObj]] = []
        refusals = 0
        for start, end, key in self._chunks(tokens, mask, kwargs):
            layer_keys = self._object_keys(key)
            if all(self.storage_manager.contains_in_memory(layer_keys)):
                continue
            objs = []
            for _ in range(num_layers):
                obj = self._allocate(end - start)
                if obj is None:
                    break
                objs.append(obj)
            if len(objs) < num_layers:
                for obj in objs:
                    obj.free()
                refusals += 1
                self.storage_manager.note_miss(layer_keys[len(objs)], MISS_REFUSED)
                break
            starts.append(start)
            ends.append(end)
            keys.append(key)
            objs_by_chunk.append(objs)
        by_layer = [[objs[layer] for objs in objs_by_chunk] for layer in range(num_layers)]
        mover = self.gpu_connector.batched_from_gpu(by_layer, starts, ends, **kwargs)
        complete = False
        try:
            for layer in range(num_layers):
                next(mover)
                yield
            # One wait for all layers' copies, after the last one: a wait per layer would stall
            # the forward between layers. Only then do the chunks become visible to readers.
            _sync(kwargs.get("kvcaches"))
            for layer in range(num_layers):
                if self.key_rotation is not None:
                    for obj, start in zip(by_layer[layer], starts):
                        self.key_rotation(obj.tensor[:, 0], start)
                self.storage_manager.batched_put([k.with_layer(layer) for k in keys], by_layer[layer])
            complete = True
        finally:  # closed early or failed: nothing was put, so the objects are still ours to free
            if not complete:
                _sync(kwargs.get("kvcaches"))
                for obj in (o for objs in objs_by_chunk for o in objs):
                    obj.free()
        stored = sum(e - s for s, e in zip(starts, ends))
        self.stats_monitor.on_store(stored, stored * self.metadata.bytes_per_token(),
                                    time.perf_counter() - t0, refusals)
        return stored

    @torch.inference_mode()
    def retrieve_layer(self, tokens: Tokens, mask: torch.Tensor | None = None,
                       **kwargs: Any) -> Generator[torch.Tensor | None, None, None]:
        """Generator: yields None after each layer is loaded (layer 0 first), then the ret_mask.

        vLLM's worker calls `next()` before the forward and once per `wait_for_layer_load`."""
        if not self.layerwise:
            raise RuntimeError("retrieve_layer needs a layerwise GPU connector (config use_layerwise: true)")
        self._check_caches(kwargs)
        t0 = time.perf_counter()
        num_layers = self.metadata.num_layers
        ret_mask = torch.zeros(len(tokens), dtype=torch.bool)
        requested = len(tokens) - (0 if mask is None else int((~mask.bool()).sum()))
        starts: list[int] = []
        ends: list[int] = []
        keys: list[CacheEngineKey] = []
        objs_by_chunk: list[list[MemoryObj]] = []
        for start, end, key in self._chunks(tokens, mask, kwargs):
            layer_keys = self._object_keys(key)
            objs = []
            for k in layer_keys:
                obj = self.storage_manager.get(k)
                if obj is None:
                    break
                objs.append(obj)
            if len(objs) < num_layers:
                for k, obj in zip(layer_keys, objs):
                    self.storage_manager.release(k, obj)
                if self.prefix_chain:
                    break
                continue
            starts.append(start)
            ends.append(end)
            keys.append(key)
            objs_by_chunk.append(objs)
            ret_mask[start:end] = True
        by_layer = [[objs[layer] for objs in objs_by_chunk] for layer in range(num_layers)]
        mover = self.gpu_connector.batched_to_gpu(by_layer, starts, ends, **kwargs)
        try:
            for layer in range(num_layers):
                next(mover)  # the connector orders vLLM's stream after this layer's copy
                yield None
        finally:
            # The copies read the objects until they land: one wait, then release every hold (also
            # when the generator is closed early or fails).
            _sync(kwargs.get("kvcaches"))
            for layer in range(num_layers):
                for k, obj in zip(keys, by_layer[layer]):
                    self.storage_manager.release(k.with_layer(layer), obj)
        hit = int(ret_mask.sum())
        self.stats_monitor.on_retrieve(requested, hit, hit * self.metadata.bytes_per_token(),
                                       time.perf_counter() - t0)
        yield ret_mask

    # ---- lifecycle -----------------------------------------------------------------------------
    def get_stats(self):
        return self.stats_monitor.get_stats()

    def close(self) -> None:
        self.reservations.release_everything()
        self.storage_manager.close()


class LMCacheEngineBuilder:
    """Process-wide registry of engines by instance id (one per vLLM worker)."""

    _engines: dict[str, LMCacheEngine] = {}
    _lock = threading.Lock()

    @classmethod
    def get_or_create(cls, instance_id: str, config: LMCacheEngineConfig, metadata: LMCacheEngineMetadata,
                      gpu_connector: GPUConnectorInterface, token_database: Any = None) -> LMCacheEngine:
        with cls._lock:
            engine = cls._engines.get(instance_id)
            if engine is None:
                engine = LMCacheEngine(config, metadata, gpu_connector, token_database=token_database)
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
    def destroy(cls, instance_id: str) -> None:
        with cls._lock:
            engine = cls._engines.pop(instance_id, None)
        if engine is not None:
            engine.close()
