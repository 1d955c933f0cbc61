"""The connector's worker side: a coordinator that answers vLLM's worker calls with its parts.

- rank_engine.py: the engine (and CacheBlend's blender) a rank builds over vLLM's caches;
- paged.py: the engine and vLLM's paged cache, shared by every part;
- loading.py: loads before (layerwise: beside) the forward, and the blocks that did not load;
- saving.py (saver.py's thread): the step's stores, off the forward path unless layerwise;
- pd.py: the PD sender's transfer at a request's last prefill step, and the PD receiver;
- verification.py: the canary that checks stored chunks against recomputed KV;
- offload_store.py (offload_server.py): stores another process asks for;
- inflight.py: one `InFlight` per request, from its first load or save to its last save's end;
- vllm_stats.py: what the figures did since the last step, handed to vLLM's metrics and log line;
- blend/mode.py: CacheBlend's engine mode (segment keys, K stored at position 0).

Every engine call is guarded: a cache failure costs a miss (the blocks are reported to vLLM,
which recomputes them) or a skipped save, never a failed step. A finished request that saved is
reported in `finished_sending` once its stores are done (vLLM holds its blocks until then); a
preempted request's stores are waited for before the next step touches any block.

Imports no vLLM at module level: vLLM is asked only in `register_kv_caches`, so everything else
runs (and is tested) without it.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

import torch

from lmcache_triton.config import LMCacheEngineConfig
from lmcache_triton.engine.engine import LMCacheEngineBuilder
from lmcache_triton.integration.vllm.common import cpu_blocks_opaque, engine_id, is_cpu_platform
from lmcache_triton.integration.vllm import declines
from lmcache_triton.integration.vllm.inflight import InFlightRequests
from lmcache_triton.integration.vllm.kv_events import WorkerKVEvents, kv_events_enabled
from lmcache_triton.integration.vllm.loading import Loader, LoadErrors
from lmcache_triton.integration.vllm.lookup.server import LMCacheAsyncLookupServer
from lmcache_triton.integration.vllm.offload_server import ZMQOffloadServer
from lmcache_triton.integration.vllm.offload_store import OffloadStore
from lmcache_triton.integration.vllm.paged import PagedKV
from lmcache_triton.integration.vllm.pd import PDReceiver, PDSender, rank_port
from lmcache_triton.integration.vllm.rank_engine import build_rank_engine
from lmcache_triton.integration.vllm.saving import Saving, nothing_to_store
from lmcache_triton.integration.vllm.step_timing import StepTimer, calibrate
from lmcache_triton.integration.vllm.verification import verify_request
from lmcache_triton.integration.vllm.vllm_stats import Figures, StatsTracker
from lmcache_triton.metadata import LMCacheEngineMetadata

if TYPE_CHECKING:
    from lmcache_triton.integration.vllm.specs import LMCacheConnectorMetadata

logger = logging.getLogger("lmcache_triton")

# While a step runs the CPU tier's pages are not committed ahead (it competes with the forward for
# the cores); a step longer than this lets it go on anyway. After a step it waits this long for
# the next one: between steps of a busy server it stays idle, the saves commit what they write.
_STEP_BOUND_S = 30.0
_IDLE_GAP_S = 0.05


class WorkerSide:
    def __init__(self, vllm_config: Any, config: LMCacheEngineConfig, parent: Any) -> None:
        self.vllm_config, self.config, self.parent = vllm_config, config, parent
        self.paged = PagedKV()
        self.requests = InFlightRequests()
        self.load_errors = LoadErrors(vllm_config.cache_config.block_size, config.kv_load_failure_policy)
        self.loader = Loader(self.paged, config.chunk_size, self.load_errors)
        self.saving = Saving(self.paged, config, vllm_config.kv_transfer_config.kv_role)
        self.offload = OffloadStore(self.paged, self.saving, config.chunk_size, config.blocking_timeout_secs)
        self.lookup_server: LMCacheAsyncLookupServer | None = None
        self.offload_server: ZMQOffloadServer | None = None
        self.pd_receiver: PDReceiver | None = None
        self.pd_sender: PDSender | None = None
        self.step_timer = StepTimer()  # vLLM's forward per step: what recomputing costs (step_timing.py)
        self.kv_events: WorkerKVEvents | None = None  # rank 0, with vLLM's KV events on (kv_events.py)
        self.stats = StatsTracker()  # what vLLM's metrics are handed each step (vllm_stats.py)
        self.instance_id = ""

    # the engine and vLLM's tensors live in `paged`, which every part shares
    engine = property(lambda self: self.paged.engine, lambda self, e: setattr(self.paged, "engine", e))
    kvcaches = property(lambda self: self.paged.kvcaches, lambda self, k: setattr(self.paged, "kvcaches", k))

    # ---- set-up --------------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from vllm.distributed.parallel_state import get_pp_group, get_tensor_model_parallel_rank

        tp = self.vllm_config.parallel_config.tensor_parallel_size
        self.set_up(kv_caches, rank=get_pp_group().rank_in_group * tp + get_tensor_model_parallel_rank(),
                    cpu_backend=is_cpu_platform(), blocks_opaque=cpu_blocks_opaque())

    def set_up(self, kv_caches: dict[str, torch.Tensor], *, rank: int, cpu_backend: bool,
               blocks_opaque: bool) -> None:
        """`register_kv_caches` once it asked vLLM for this worker's rank and platform: the engine
        (rank_engine.py), the parts that use it, and the servers this rank runs."""
        self.instance_id = f"vllm-{engine_id(self.vllm_config)}-{rank}"
        self.stats = StatsTracker(rank)
        built = build_rank_engine(self.vllm_config, self.config, kv_caches, instance_id=self.instance_id, rank=rank,
                                  cpu_backend=cpu_backend, blocks_opaque=blocks_opaque)
        self.paged.engine, self.paged.kvcaches = built.engine, built.kvcaches
        self.saving.on_device(built.kvcaches[0].device)
        self._time_prefill(built.kvcaches[0], built.metadata)
        self.loader.blender = built.blender
        self.saving.blending = built.blender is not None
        self._start_servers(built.metadata, rank, built.num_slots)

    def _time_prefill(self, kvcache: torch.Tensor, metadata: LMCacheEngineMetadata) -> None:
        """The step timer on the caches' device, and a calibration until the first steps are timed."""
        self.step_timer = StepTimer(kvcache.device)
        model_config = getattr(self.vllm_config, "model_config", None)
        hf_config = getattr(model_config, "hf_config", None)
        if hf_config is None:
            return
        try:
            calibrate(self.engine.prefill, hf_config, device=kvcache.device,
                      dtype=getattr(model_config, "dtype", None) or metadata.kv_dtype,
                      tensor_parallel=self.vllm_config.parallel_config.tensor_parallel_size)
        except Exception:
            logger.exception("lmcache_triton: prefill calibration failed; the steps vLLM runs will tell")

    def _start_servers(self, metadata: LMCacheEngineMetadata, rank: int, num_slots: int) -> None:
        config, eid = self.config, engine_id(self.vllm_config)
        # Lookups run in a small pool whatever the client's mode: one lookup waiting on a dead or
        # slow remote must not hold up the next, whose chunks may all be in the CPU tier.
        self.lookup_server = LMCacheAsyncLookupServer(
            self.engine, eid, rank, before_lookup=self.saving.flush if self.saving.is_async else None)
        if config.pd_receiver:  # each rank its own port: the sender's rank r sends to receiver rank r
            self.pd_receiver = PDReceiver(self.engine.storage_manager, metadata, host=config.pd_peer_host,
                                          port=rank_port(config.pd_peer_init_port, rank),
                                          auth_token=config.remote_auth_token)
            self.pd_receiver.start()
        elif config.pd_sender:
            self.pd_sender = PDSender(metadata, rank=rank, compression=config.remote_serde,
                                      timeout_s=config.blocking_timeout_secs, auth_token=config.remote_auth_token)
        if rank == 0 and kv_events_enabled(self.vllm_config):
            self.kv_events = WorkerKVEvents(self.engine)
        if config.enable_offload_server:
            self.offload_server = ZMQOffloadServer(self.offload, eid, rank, chunk_size=config.chunk_size,
                                                   num_slots=num_slots)

    # ---- a step --------------------------------------------------------------------------------
    def _meta(self) -> LMCacheConnectorMetadata:
        return self.parent._get_connector_metadata()

    def before_step(self, meta: LMCacheConnectorMetadata) -> None:
        """Runs as the step's metadata is bound, before its loads and forward: vLLM freed the blocks
        of the requests it preempted at once (no `request_finished`), and this step may hand them to
        another request, so their queued saves must have read them first."""
        self.paged.defer_prefault(_STEP_BOUND_S)  # the tier's pages are committed between steps, not beside them
        self.step_timer.forward_begins(getattr(meta, "num_scheduled_tokens", 0))
        preempted = self.requests.saving(getattr(meta, "preempted_req_ids", ()))
        if preempted and not self.saving.wait(preempted):
            logger.error("lmcache_triton: saves of preempted requests %s did not finish", preempted)
        if self.kv_events is not None:  # before the step's saves and loads change the tiers
            self.kv_events.name_step(meta.requests)
        if getattr(meta, "declined", ()) and self.stats.rank == 0 and self.engine is not None:
            declines.count(self.engine, meta.declined)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        if self.engine is None:
            return
        started = time.perf_counter()
        self._finish_loads()  # a step whose wait_for_save never came: its loads end here
        for req in self._meta().requests:
            load = self.loader.start(req)  # never raises: one request's failure is its miss alone
            if load is not None:
                self.requests.get(req.req_id).load = load
        self.step_timer.exclude(time.perf_counter() - started)  # not the forward's time

    def wait_for_layer_load(self, layer_name: str) -> None:
        for load in self.requests.loads():
            load.before_layer()

    def _finish_loads(self) -> None:
        for load in self.requests.loads():
            load.finish()

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        if self.engine is None or not self.engine.layerwise:
            return
        for req in self._meta().requests:
            entry = self.requests.get(req.req_id)
            try:
                if entry.storer is None:
                    entry.storer = self.saving.start_layerwise(req)
                next(entry.storer, None)
            except Exception:
                logger.exception("lmcache_triton: layerwise save of request %s failed", req.req_id)
                entry.storer = nothing_to_store()

    def wait_for_save(self) -> None:
        if self.engine is not None:
            self.step_timer.forward_ends(self.engine.prefill)
        self._finish_loads()
        meta = self._meta()
        if self.saving.is_async:  # whatever happens below: the scheduler holds these requests' blocks
            for req in meta.requests:
                if req.save_spec is not None and req.save_spec.can_save:
                    self.requests.get(req.req_id).saving = True
        if self.engine is None:
            return
        # The forward ran over whatever a failed load left in these requests' blocks: what it computed
        # for them is neither saved, checked nor sent (a layerwise store left open is closed unused).
        failed = self.load_errors.take_requests()
        try:
            for req in meta.requests:  # each request on its own: a failure costs that request's save
                if req.req_id in failed:
                    continue
                try:
                    if req.verify_tokens:
                        verify_request(self.paged, req)
                    if self.engine.layerwise:
                        for _ in self.requests.take_storer(req.req_id) or ():  # what the per-layer calls began
                            pass
                    else:
                        self.saving.queue(req)
                except Exception:
                    logger.exception("lmcache_triton: save of request %s failed; its chunks stay uncached",
                                     req.req_id)
            for req in meta.requests:  # after every save is queued: the sends wait, the saves need not
                if (self.pd_sender is not None and req.disagg_spec is not None and req.disagg_spec.is_last_prefill
                        and req.req_id not in failed):
                    self.pd_sender.send_request(req, self.paged, self.saving)
        finally:
            self.paged.defer_prefault(_IDLE_GAP_S)  # committing ahead resumes once vLLM is idle for a moment
            self.requests.end_step()
            for req_id in meta.lookup_requests_in_step:
                try:
                    self.engine.release_reservation(req_id)
                except Exception:
                    logger.exception("lmcache_triton: releasing the lookup holds of %s failed", req_id)

    def get_finished(self, finished_req_ids: set[str]) -> set[str] | None:
        """The finished requests whose saves are all done (vLLM then frees their blocks)."""
        if not self.saving.is_async:
            return None
        return self.requests.finished(finished_req_ids, self.saving.idle) or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.load_errors.take()

    def take_kv_events(self) -> list:
        """vLLM's events for what the tiers gained and lost since the last step (rank 0 only)."""
        return self.kv_events.take() if self.kv_events is not None else []
    def take_stats(self) -> Figures | None:
        """What the figures did since the last call, for vLLM's metrics; None: nothing."""
        return None if self.engine is None else self.stats.take(self.engine)

    def close(self) -> None:
        for name in ("pd_receiver", "pd_sender", "offload_server"):
            part = getattr(self, name)
            if part is not None:
                part.close()
                setattr(self, name, None)
        self.saving.close()
        if self.lookup_server is not None:
            self.lookup_server.close()
            self.lookup_server = None
        if self.instance_id:
            LMCacheEngineBuilder.destroy(self.instance_id)
            self.paged.engine = None
