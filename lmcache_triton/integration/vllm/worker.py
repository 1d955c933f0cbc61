"""The connector's worker side: the engine, the lookup server, loads before and saves after the forward.

Every engine call is guarded: a cache failure costs a miss (the blocks are reported to vLLM,
which recomputes them) or a skipped save, never a failed step.

Saves are asynchronous (saver.py) unless the connector is layerwise (whose per-layer stores run
inside the forward): `wait_for_save` queues the step's stores and returns; a finished request that
saved is reported in `finished_sending` once its stores are done (vLLM holds its blocks until
then); a preempted request's stores are waited for before the next step touches any block.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Generator
from dataclasses import dataclass
from typing import Any

import torch

from lmcache_triton.config import LMCacheEngineConfig
from lmcache_triton.engine.engine import CacheMode, LMCacheEngine, LMCacheEngineBuilder
from lmcache_triton.engine.gpu_connector import create_gpu_connector
from lmcache_triton.integration.vllm.common import (
    cpu_blocks_opaque,
    engine_id,
    is_cpu_platform,
    kv_identity,
    world_size,
)
from lmcache_triton.integration.vllm.saver import AsyncSaver
from lmcache_triton.integration.vllm.specs import LMCacheConnectorMetadata, ReqMeta
from lmcache_triton.kernels import kv_geometry
from lmcache_triton.kernels.common import to_device
from lmcache_triton.integration.vllm.lookup.server import LMCacheAsyncLookupServer
from lmcache_triton.integration.vllm.pd import PDReceiver, PDSender, rank_port
from lmcache_triton.integration.vllm.offload_server import OffloadMsg, ZMQOffloadServer, new_job_id
from lmcache_triton.metadata import LMCacheEngineMetadata
from lmcache_triton.observability import prometheus

logger = logging.getLogger("lmcache_triton")


def adapt_kv_caches(tensors: list[torch.Tensor], *, use_mla: bool, cpu_backend: bool) -> tuple[str, list[torch.Tensor]]:
    """vLLM's per-layer tensors -> (layout name, tensors the kernels read)."""
    t = tensors[0]
    if use_mla:
        if t.dim() != 3:
            raise ValueError(f"MLA KV cache must be [num_blocks, block_size, C], got shape {tuple(t.shape)}")
        return "mla", tensors
    if t.dim() == 5:
        if t.shape[0] == 2:
            return "flash_attn", tensors
        if t.shape[1] == 2:
            return "flashinfer", tensors
    if t.dim() == 4:
        if cpu_backend:
            # Same bytes, the CPU kernel's meaning: per (block, head) block_size rows of K, then of V.
            nb, h, bs, c = t.shape
            return "vllm_cpu", [x.view(nb, h, 2 * bs, c // 2) for x in tensors]
        return "vllm_packed", tensors
    raise ValueError(f"unknown vLLM KV cache layout: per-layer shape {tuple(t.shape)}, strides {t.stride()}")


# While a step runs the CPU tier's pages are not committed ahead (it competes with the forward for
# the cores); a step longer than this lets it go on anyway. After a step it waits this long for
# the next one: between steps of a busy server it stays idle, the saves commit what they write.
_STEP_BOUND_S = 30.0
_IDLE_GAP_S = 0.05


def _valid_slots(slot_mapping: torch.Tensor) -> int:
    """How many leading tokens have a slot (the scheduler pads with -1 where blocks ran out)."""
    bad = (slot_mapping < 0).nonzero()
    return int(bad[0]) if len(bad) else len(slot_mapping)


@dataclass
class _Retriever:
    """A request's layerwise load in flight: `first_waited` until the forward's first
    wait_for_layer_load, which start_load_kv's step already answered."""

    req: ReqMeta
    steps: Generator
    expected: torch.Tensor
    first_waited: bool = False


class WorkerSide:
    def __init__(self, vllm_config: Any, config: LMCacheEngineConfig, parent: Any) -> None:
        self.vllm_config = vllm_config
        self.config = config
        self.parent = parent
        self.kv_role = vllm_config.kv_transfer_config.kv_role
        self.engine: LMCacheEngine | None = None
        self.lookup_server: LMCacheAsyncLookupServer | None = None
        self.offload_server: ZMQOffloadServer | None = None
        self.pd_receiver: PDReceiver | None = None
        self.pd_sender: PDSender | None = None
        self.kvcaches: list[torch.Tensor] = []
        self.block_size = vllm_config.cache_config.block_size
        self.retrievers: list[_Retriever] = []
        self.storers: dict[str, Generator] = {}
        self.invalid_block_ids: set[int] = set()
        self.instance_id = ""
        self.blender = None
        # Async saving, decided from the config alone, as the scheduler side decides which
        # finished requests vLLM must hold for us (the two must agree: see `get_finished`).
        self.saver: AsyncSaver | None = None if config.use_layerwise else AsyncSaver(torch.device("cpu"))
        self.saving: set[str] = set()      # requests that queued saves and have not finished
        self.finishing: set[str] = set()   # finished (vLLM holds their blocks), saves not yet done

    # ---- set-up --------------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from vllm.distributed.parallel_state import get_pp_group, get_tensor_model_parallel_rank

        model_config = self.vllm_config.model_config
        layout, self.kvcaches = adapt_kv_caches(list(kv_caches.values()), use_mla=model_config.use_mla,
                                                cpu_backend=is_cpu_platform())
        geo = kv_geometry(self.kvcaches[0], layout)
        chunk = self.config.chunk_size
        if cpu_blocks_opaque() and chunk % geo.block_size:
            raise ValueError(
                f"lmcache chunk_size={chunk} must be a multiple of vLLM's block_size={geo.block_size} on the CPU "
                "backend (it moves whole blocks): set lmcache.chunk_size or --block-size accordingly")
        tp = self.vllm_config.parallel_config.tensor_parallel_size
        rank = get_pp_group().rank_in_group * tp + get_tensor_model_parallel_rank()
        metadata = LMCacheEngineMetadata(
            model_name=str(model_config.model), world_size=world_size(self.vllm_config), worker_id=rank,
            kv_dtype=self.kvcaches[0].dtype,
            kv_shape=(len(self.kvcaches), 1 if geo.use_mla else 2, chunk, geo.num_kv_heads, geo.head_size),
            use_mla=geo.use_mla,
            # AMX blocks hold K in another (unverified) order than the "vec" blocks: never mixed.
            kv_identity=kv_identity(self.vllm_config, f"{layout}-amx" if cpu_blocks_opaque() else layout))
        connector = create_gpu_connector(self.config, metadata, layout, device=self.kvcaches[0].device)
        if self.saver is not None and self.kvcaches[0].is_cuda:
            self.saver.close(timeout=0)
            self.saver = AsyncSaver(self.kvcaches[0].device)
        self.instance_id = f"vllm-{engine_id(self.vllm_config)}-{rank}"
        model = self._blend_model() if self.config.enable_blending else None
        mode = self._blend_mode(metadata, model, connector) if model is not None else None
        self.engine = LMCacheEngineBuilder.get_or_create(self.instance_id, self.config, metadata, connector, mode)
        prometheus.export(self.engine, self.config.prometheus_port)
        if model is not None:
            from lmcache_triton.blend import LMCBlenderBuilder

            self.blender = LMCBlenderBuilder.get_or_create(self.instance_id, self.engine, connector, self.config,
                                                           model=model)
        # Lookups run in a small pool whatever the client's mode: one lookup waiting on a dead or
        # slow remote must not hold up the next, whose chunks may all be in the CPU tier.
        self.lookup_server = LMCacheAsyncLookupServer(
            self.engine, engine_id(self.vllm_config), rank,
            before_lookup=self.saver.flush if self.saver is not None else None)
        if self.config.pd_receiver:
            self.pd_receiver = PDReceiver(self.engine.storage_manager, metadata, host=self.config.pd_peer_host,
                                          port=rank_port(self.config.pd_peer_init_port, rank),
                                          auth_token=self.config.remote_auth_token)
            self.pd_receiver.start()
        elif self.config.pd_sender:
            self.pd_sender = PDSender(metadata, rank=rank, compression=self.config.remote_serde,
                                      timeout_s=self.config.blocking_timeout_secs,
                                      auth_token=self.config.remote_auth_token)
        if self.config.enable_offload_server:
            self.offload_server = ZMQOffloadServer(self.offload, engine_id(self.vllm_config), rank, chunk_size=chunk,
                                                   num_slots=geo.num_blocks * geo.block_size)
        logger.info("lmcache_triton worker ready: %d layers, layout %s, block_size %d", len(self.kvcaches), layout,
                    geo.block_size)

    # ---- CacheBlend ----------------------------------------------------------------------------
    def _blend_model(self) -> Any:
        """The blender runs vLLM's own loaded model layer by layer; fail here, at start, if that
        cannot work, not at the first request."""
        from lmcache_triton.integration.vllm.model_hook import loaded_model

        if cpu_blocks_opaque():
            raise RuntimeError("lmcache_triton: enable_blending is not supported by vLLM's CPU backend on AMX CPUs")
        model = loaded_model()
        if model is None:
            raise RuntimeError(
                "lmcache_triton: enable_blending needs the loaded model, which the lmcache_triton vLLM plugin "
                "captures from the model runner's load_model. It did not run: install lmcache-triton in vLLM's "
                "environment (its vllm.general_plugins entry point), keep VLLM_PLUGINS unset or include "
                "'lmcache_triton', and on vLLM 0.33 CUDA use the V1 model runner (VLLM_USE_V2_MODEL_RUNNER=0)")
        return model

    def _blend_mode(self, metadata: LMCacheEngineMetadata, model: Any, connector: Any) -> CacheMode:
        """Segment keys, and K stored as if each segment started at position 0."""
        from transformers import AutoTokenizer

        from lmcache_triton.blend import SegmentTokenDatabase, as_layerwise
        from lmcache_triton.kernels import rope_rerotate

        mc = self.vllm_config.model_config
        tokenizer = AutoTokenizer.from_pretrained(mc.tokenizer, trust_remote_code=mc.trust_remote_code)
        database = SegmentTokenDatabase.from_config(self.config, metadata, tokenizer, fmt=connector.fmt)
        layerwise = as_layerwise(model)
        rot, heads, head_size = layerwise.rotary, layerwise.num_kv_heads, layerwise.head_size

        tables: dict[torch.device, torch.Tensor] = {}  # the cos/sin table where the stored K lies, copied once

        def to_position_zero(k: torch.Tensor, chunk_starts: torch.Tensor) -> None:
            table = tables.get(k.device)
            if table is None:  # (a copy per call was the whole table per chunk and layer: ~1000 per 8K tokens)
                table = tables[k.device] = rot.cos_sin_cache.to(k.device)
            k3 = k.view(k.shape[0], heads, head_size)
            # Only new - old counts: every token moves back by its chunk's start.
            rope_rerotate(k3, chunk_starts, torch.zeros_like(chunk_starts), table, is_neox=rot.is_neox,
                          rotary_dim=rot.rotary_dim, out=k3)

        return CacheMode(database, key_rotation=to_position_zero)

    def _blend(self, req: ReqMeta, n: int) -> None:
        tokens = torch.tensor(req.token_ids[:n], dtype=torch.int64)  # CacheBlend's metadata has the ids from 0
        slots = self._device_slots(req.slots(0, n))
        self.blender.blend_request(tokens, kvcaches=self.kvcaches, slot_mapping=slots, **req.key_args())

    def _defer_prefault(self, seconds: float) -> None:
        manager = getattr(self.engine, "storage_manager", None)
        if manager is not None:
            manager.defer_prefault(seconds)

    def _device_slots(self, slots: torch.Tensor) -> torch.Tensor:
        """A request's slots on the cache's device without a host wait: a pageable host tensor's
        copy to a GPU blocks the host until it lands (once per request, and inside save_kv_layer);
        from pinned memory it is queued on the stream like the kernels that read it."""
        return to_device(slots, self.kvcaches[0].device)

    # ---- loads ---------------------------------------------------------------------------------
    def _meta(self) -> LMCacheConnectorMetadata:
        return self.parent._get_connector_metadata()

    def before_step(self, meta: LMCacheConnectorMetadata) -> None:
        """Runs as the step's metadata is bound, before its loads and forward: vLLM freed the blocks
        of the requests it preempted at once (no `request_finished`), and this step may hand them to
        another request, so their queued saves must have read them first."""
        self._defer_prefault(_STEP_BOUND_S)  # the tier's pages are committed between steps, not beside them
        preempted = [r for r in getattr(meta, "preempted_req_ids", ()) if r in self.saving]
        if self.saver is not None and preempted and not self.saver.wait(preempted):
            logger.error("lmcache_triton: saves of preempted requests %s did not finish", preempted)

    def _record_failed(self, req: ReqMeta, expected: torch.Tensor, loaded: torch.Tensor | None) -> None:
        """Reports the blocks of `expected` tokens (a mask over tokens 0..) that did not load, so
        vLLM recomputes them. Never raises: it is the error path."""
        try:
            got = torch.zeros(len(expected), dtype=torch.bool)
            if loaded is not None:
                m = min(len(loaded), len(expected))
                got[:m] = loaded[:m].cpu()
            missing = expected.cpu() & ~got
            pos = missing.nonzero().flatten() - req.token_offset  # the slot mapping starts there
            pos = pos[(pos >= 0) & (pos < len(req.slot_mapping))]
            slots = req.slot_mapping[pos]
            slots = slots[slots >= 0]
            if missing.any():
                blocks = (slots // self.block_size).unique().tolist()
                logger.warning("lmcache_triton: request %s failed to load %d tokens; vLLM recomputes %d blocks",
                               req.req_id, int(missing.sum()), len(blocks))
                self.invalid_block_ids.update(int(b) for b in blocks)
        except Exception:
            logger.exception("lmcache_triton: cannot report the failed load of request %s", req.req_id)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        if self.engine is None:
            return
        self._finish_loads()  # a step whose wait_for_save never came: its loads end here
        for req in self._meta().requests:
            spec = req.load_spec
            if spec is None or not spec.can_load:
                continue
            try:  # one request's failure is a miss for that request alone
                self._start_load(req, spec)
            except Exception:
                logger.exception("lmcache_triton: load of request %s failed", req.req_id)

    def _start_load(self, req: ReqMeta, spec: Any) -> None:
        # No more than vLLM accepted and has slots for (the scheduler clamps; this guards).
        n = min(spec.lmcache_cached_tokens, req.num_tokens, req.token_offset + _valid_slots(req.slot_mapping))
        start = spec.vllm_cached_tokens // self.config.chunk_size * self.config.chunk_size
        if n <= 0 or start >= n:
            return
        expected = torch.ones(n, dtype=torch.bool)
        expected[:start] = False
        try:
            if self.blender is not None:  # it reads the prompt from token 0 itself
                self._blend(req, n)
                return
            tokens, scope = req.engine_tokens(start, n)
            kw = dict(kvcaches=self.kvcaches, slot_mapping=self._device_slots(req.slots(start, n)),
                      offset=start, **scope)
            if self.engine.layerwise:
                entry = _Retriever(req, self.engine.retrieve_layer(tokens, expected, **kw), expected)
                self.retrievers.append(entry)
                # Layer 0 now (on a GPU, layer 1 queued behind it); each later wait_for_layer_load
                # takes one more step, so layer j's attention waits for layer j's load alone.
                self._advance(entry)
            else:
                self._record_failed(req, expected, self.engine.retrieve(tokens, expected, **kw))
        except Exception:
            logger.exception("lmcache_triton: load of request %s failed", req.req_id)
            self._record_failed(req, expected, None)

    def _advance(self, entry: _Retriever) -> bool:
        """One step of a layerwise load; False once it is over (its loaded-token mask recorded)."""
        try:
            out = next(entry.steps, False)
        except Exception:
            logger.exception("lmcache_triton: layerwise load of request %s failed", entry.req.req_id)
            self._record_failed(entry.req, entry.expected, None)
            return False
        if isinstance(out, torch.Tensor):  # the final step hands back the loaded-token mask
            self._record_failed(entry.req, entry.expected, out)
            return False
        return out is not False

    def wait_for_layer_load(self, layer_name: str) -> None:
        for entry in self.retrievers:
            if entry.first_waited:
                self._advance(entry)
            else:  # layer 0: start_load_kv's step already ordered it
                entry.first_waited = True

    def _finish_loads(self) -> None:
        """After the forward: the loads' last steps (the one wait for their copies, the holds
        released, the mask of what loaded), and any layer vLLM did not wait for."""
        for entry in self.retrievers:
            while self._advance(entry):
                pass
        self.retrievers = []

    # ---- saves ---------------------------------------------------------------------------------
    def _store_args(self, req: ReqMeta) -> tuple[list[int] | int, torch.Tensor | None, dict] | None:
        """(tokens, mask, keyword arguments) of the engine's store of this step's new chunks, or None."""
        spec = req.save_spec
        if self.kv_role == "kv_consumer" or spec is None or not spec.can_save:
            return None
        chunk = self.config.chunk_size
        skip = spec.skip_leading_tokens // chunk * chunk
        # Tokens without a slot (-1) have no KV to save; nor does anything behind them.
        num_tokens = min(req.num_tokens, req.token_offset + _valid_slots(req.slot_mapping))
        if num_tokens < req.num_tokens:
            num_tokens = num_tokens // chunk * chunk
        if skip >= num_tokens:
            return None
        if self.blender is not None:
            skip = 0  # segments, not a prefix: each is stored once, whatever was loaded
        tokens, scope = req.engine_tokens(skip, num_tokens)
        mask = None
        if skip and not isinstance(tokens, int):  # with chunk hashes from `skip` on, the engine skips the rest
            mask = torch.ones(num_tokens, dtype=torch.bool)
            mask[:skip] = False
        kw = dict(kvcaches=self.kvcaches, slot_mapping=self._device_slots(req.slots(skip, num_tokens)),
                  offset=skip, **scope)
        return tokens, mask, kw

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        if self.engine is None or not self.engine.layerwise:
            return
        for req in self._meta().requests:
            try:
                storer = self.storers.get(req.req_id)
                if storer is None:
                    args = self._store_args(req)
                    if args is None:
                        continue
                    tokens, mask, kw = args
                    storer = self.storers[req.req_id] = self.engine.store_layer(tokens, mask, **kw)
                next(storer, None)
            except Exception:
                logger.exception("lmcache_triton: layerwise save of request %s failed", req.req_id)
                self.storers[req.req_id] = iter(())

    def wait_for_save(self) -> None:
        self._finish_loads()
        meta = self._meta()
        if self.saver is not None:  # whatever happens below: the scheduler holds these requests' blocks
            self.saving.update(r.req_id for r in meta.requests if r.save_spec is not None and r.save_spec.can_save)
        if self.engine is None:
            return
        try:
            for req in meta.requests:
                # Each request on its own: a failure costs that request's save, not the others'.
                try:
                    if req.verify_tokens:
                        self._verify(req)
                    if self.engine.layerwise:
                        storer = self.storers.pop(req.req_id, None)
                        for _ in storer or ():  # finish what the per-layer calls began
                            pass
                    elif (args := self._store_args(req)) is not None:
                        tokens, mask, kw = args
                        if self.saver is None:
                            self.engine.store(tokens, mask, **kw)
                        else:
                            self.saver.submit(req.req_id, functools.partial(self.engine.store, tokens, mask, **kw))
                except Exception:
                    logger.exception("lmcache_triton: save of request %s failed; its chunks stay uncached",
                                     req.req_id)
            for req in meta.requests:  # after every save is queued: the sends wait, the saves need not
                if req.disagg_spec is not None and req.disagg_spec.is_last_prefill:
                    self._send(req)
        finally:
            self._defer_prefault(_IDLE_GAP_S)  # committing ahead resumes once vLLM is idle for a moment
            for storer in self.storers.values():  # requests not in this step's metadata: close them
                close = getattr(storer, "close", None)
                if close is not None:
                    close()
            self.storers = {}
            self.retrievers = []
            for req_id in meta.lookup_requests_in_step:
                try:
                    self.engine.release_reservation(req_id)
                except Exception:
                    logger.exception("lmcache_triton: releasing the lookup holds of %s failed", req_id)

    def _send(self, req: ReqMeta) -> None:
        """PD sender: sends the request's prompt to the receiver its disagg spec names and waits,
        so the transfer is over before the prefill's reply leaves (on the save thread where there
        is one: the engine sees one store at a time, and the chunks this step's save is storing
        are then sent as stored). Never raises: a failed send is the decoder's miss."""
        spec = req.disagg_spec
        if self.pd_sender is None or spec is None:
            return
        try:
            n = min(req.num_tokens, req.token_offset + _valid_slots(req.slot_mapping))
            if req.token_offset or n <= 0:
                return
            tokens, scope = req.engine_tokens(0, n)
            peer = self.pd_sender.peer(spec)
            kw = dict(to=peer, kvcaches=self.kvcaches, slot_mapping=self._device_slots(req.slots(0, n)),
                      **scope)
            sent: dict[str, int] = {}
            job = lambda: sent.setdefault("held", self.engine.send(tokens, **kw))  # noqa: E731
            if self.saver is None:
                job()
            else:
                self.saver.submit(req.req_id, job)
                # a send waits at most its chunks' timeouts: bound the wait by the same, generously
                if not self.saver.wait([req.req_id], timeout=self.config.blocking_timeout_secs * 4 + 30):
                    logger.error("lmcache_triton: sending request %s to %s did not finish in time", req.req_id,
                                 peer.url)
            held = sent.get("held", 0)
            log = logger.debug if held >= n else logger.warning
            log("lmcache_triton: request %s: the decoder at %s holds %d of its %d prompt tokens", req.req_id,
                peer.url, held, n)
        except Exception:
            logger.exception("lmcache_triton: sending request %s to its decoder failed", req.req_id)

    def _verify(self, req: ReqMeta) -> None:
        n = min(req.verify_tokens, req.num_tokens, req.token_offset + _valid_slots(req.slot_mapping))
        if n <= 0:
            return
        tokens, scope = req.engine_tokens(0, n)
        kw = dict(kvcaches=self.kvcaches, slot_mapping=self._device_slots(req.slots(0, n)), **scope)
        checked, mismatched = self.engine.verify(tokens, **kw)
        logger.debug("lmcache_triton: verified %d chunks of request %s, %d mismatched", checked, req.req_id,
                     mismatched)

    def get_finished(self, finished_req_ids: set[str]) -> set[str] | None:
        """The finished requests whose saves are all done (vLLM then frees their blocks). Exactly
        those the scheduler side held: every finished request that was sent a save, and only once."""
        if self.saver is None:
            return None
        self.finishing |= self.saving & finished_req_ids
        self.saving -= finished_req_ids
        done = {r for r in self.finishing if self.saver.idle(r)}
        self.finishing -= done
        return done or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        out, self.invalid_block_ids = self.invalid_block_ids, set()
        return out

    # ---- the offload server ---------------------------------------------------------------------
    def offload(self, msg: OffloadMsg) -> int:
        """Stores the slots `msg` names under its chunk hashes (offload_server.py has the contract);
        on the save thread where there is one, so the engine still sees one store at a time."""
        if self.engine is None:
            raise RuntimeError("the worker has not registered its KV caches yet")
        n = sum(msg.offsets)
        kw = dict(kvcaches=self.kvcaches, chunk_hashes=msg.chunk_hashes(self.config.chunk_size),
                  slot_mapping=torch.tensor(msg.slot_mapping, dtype=torch.long, device=self.kvcaches[0].device),
                  namespace=msg.namespace, adapter=msg.adapter)
        if self.saver is None:
            return self.engine.store(n, **kw)
        done: dict[str, int] = {}
        job = new_job_id()
        self.saver.submit(job, lambda: done.setdefault("stored", self.engine.store(n, **kw)))
        if not self.saver.wait([job], timeout=self.config.blocking_timeout_secs + 30):
            raise TimeoutError("the store did not finish in time (the save thread is busy)")
        if "stored" not in done:
            raise RuntimeError("the store failed (the worker's log has why)")
        return done["stored"]

    def close(self) -> None:
        if self.pd_receiver is not None:
            self.pd_receiver.close()
            self.pd_receiver = None
        if self.pd_sender is not None:
            self.pd_sender.close()
            self.pd_sender = None
        if self.offload_server is not None:
            self.offload_server.close()
            self.offload_server = None
        if self.saver is not None:
            self.saver.close(timeout=self.config.blocking_timeout_secs)
        if self.lookup_server is not None:
            self.lookup_server.close()
            self.lookup_server = None
        if self.instance_id:
            LMCacheEngineBuilder.destroy(self.instance_id)
            self.engine = None
