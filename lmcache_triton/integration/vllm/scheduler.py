"""The connector's scheduler side: lookups, load/save decisions, the per-step metadata."""

from __future__ import annotations

import logging
from typing import Any

from lmcache_triton.config import LMCacheEngineConfig
from lmcache_triton.integration.vllm.common import engine_id, world_size
from lmcache_triton.integration.vllm.specs import (
    LMCacheConnectorMetadata,
    LoadSpec,
    ReqMeta,
    RequestTracker,
    chunk_extra_hashes,
)
from lmcache_triton.lookup.client import LookupClientFactory

logger = logging.getLogger("lmcache_triton")


def _mm_features(request: Any) -> tuple[list[str] | None, list[Any] | None]:
    feats = getattr(request, "mm_features", None) or []
    if not feats:
        return None, None
    return [f.identifier for f in feats], [f.mm_position for f in feats]


def _request_configs(request: Any) -> dict | None:
    params = getattr(request, "sampling_params", None)
    extra = getattr(params, "extra_args", None) or {}
    kv_params = extra.get("kv_transfer_params") or {}
    configs = {k: v for k, v in kv_params.items() if str(k).startswith("lmcache.")}
    return configs or None


class SchedulerSide:
    def __init__(self, vllm_config: Any, config: LMCacheEngineConfig) -> None:
        self.config = config
        self.kv_role = vllm_config.kv_transfer_config.kv_role
        self.block_size = vllm_config.cache_config.block_size
        self.chunk_size = config.chunk_size
        self.lookup_client = LookupClientFactory.create_lookup_client(engine_id(vllm_config), world_size(vllm_config),
                                                                      config)
        self.load_specs: dict[str, LoadSpec] = {}
        self.trackers: dict[str, RequestTracker] = {}
        self.unfinished: dict[str, Any] = {}
        self.lookups_in_step: list[str] = []

    # ---- vLLM scheduler hooks ----------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        if self.kv_role == "kv_producer":
            return 0, False
        req_id = request.request_id
        tokens = list(request.prompt_token_ids or [])
        mm_hashes, mm_positions = _mm_features(request)
        try:
            hit = self.lookup_client.lookup(
                tokens, req_id, namespace=getattr(request, "cache_salt", None) or "",
                extra_hashes=chunk_extra_hashes(mm_hashes, mm_positions, len(tokens), self.chunk_size))
        except Exception:  # the cache must never fail a request: a failed lookup is a miss
            logger.exception("lmcache_triton lookup of %s failed", req_id)
            hit = 0
        if hit is None:
            return None, False  # asynchronous lookup still running: vLLM asks again next step
        if req_id not in self.lookups_in_step:
            self.lookups_in_step.append(req_id)
        if self.config.enable_blending:
            # `hit` counts the prompt's tokens inside cached segments. The worker blends them and
            # computes the rest itself, so vLLM only computes the last token. Blending reads the
            # prompt from position 0: with a local prefix hit, leave the request to vLLM.
            if hit < self.config.blend_min_tokens or num_computed_tokens > 0:
                return 0, False
            hit = request.num_tokens
        # vLLM must compute at least one token to produce logits: on a full hit, load all but
        # let vLLM recompute the last one.
        need = hit - num_computed_tokens - (1 if hit == request.num_tokens else 0)
        self.load_specs[req_id] = LoadSpec(vllm_cached_tokens=num_computed_tokens, lmcache_cached_tokens=hit,
                                           can_load=False)
        return max(need, 0), False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        # May run twice for one request: everything here is idempotent.
        self.lookup_client.clear_lookup_status(request.request_id)
        self.unfinished[request.request_id] = request
        spec = self.load_specs.get(request.request_id)
        if spec is not None:
            spec.can_load = num_external_tokens > 0

    def build_connector_meta(self, scheduler_output: Any) -> LMCacheConnectorMetadata:
        meta = LMCacheConnectorMetadata(lookup_requests_in_step=self.lookups_in_step)
        self.lookups_in_step = []
        for req_id in scheduler_output.finished_req_ids:
            self.trackers.pop(req_id, None)
            self.unfinished.pop(req_id, None)
            self.load_specs.pop(req_id, None)
        skip_all_saves = self.kv_role == "kv_consumer"

        for new in scheduler_output.scheduled_new_reqs:
            load_spec = self.load_specs.pop(new.req_id, None)
            request = self.unfinished.get(new.req_id)
            mm_hashes, mm_positions = _mm_features(request) if request is not None else (None, None)
            tracker = RequestTracker.from_new_request(
                new, new.num_computed_tokens + scheduler_output.num_scheduled_tokens[new.req_id],
                load_spec.lmcache_cached_tokens if load_spec else 0,
                skip_save=skip_all_saves,
                namespace=(getattr(request, "cache_salt", None) or "") if request is not None else "",
                mm_hashes=mm_hashes, mm_positions=mm_positions,
                request_configs=_request_configs(new),
            )
            self.trackers[new.req_id] = tracker
            self._add(meta, tracker, load_spec)

        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            tracker = self.trackers.get(req_id)
            request = self.unfinished.get(req_id)
            if tracker is None or request is None:
                continue
            num_new = scheduler_output.num_scheduled_tokens[req_id]
            load_spec = self.load_specs.pop(req_id, None)
            if req_id in cached.resumed_req_ids:
                tracker.reset_after_preemption(list(request.all_token_ids), cached.num_computed_tokens[i] + num_new,
                                               cached.new_block_ids[i],
                                               load_spec.lmcache_cached_tokens if load_spec else 0)
            else:
                start = len(tracker.token_ids)
                tracker.update(list(request.all_token_ids[start:start + num_new]), cached.new_block_ids[i])
            self._add(meta, tracker, load_spec)
        return meta

    def _add(self, meta: LMCacheConnectorMetadata, tracker: RequestTracker, load_spec: LoadSpec | None) -> None:
        req_meta = ReqMeta.from_request_tracker(
            tracker, self.block_size, self.chunk_size, load_spec=load_spec,
            save_unfull_chunk=self.config.save_unfull_chunk, save_decode_cache=self.config.save_decode_cache,
            whole_prompt_only=self.config.enable_blending)
        if req_meta is not None:
            meta.add_request(req_meta)

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict | None]:
        # Saves finish inside the step (wait_for_save), so vLLM may free the blocks at once.
        self.lookup_client.clear_lookup_status(request.request_id)
        self.load_specs.pop(request.request_id, None)
        return False, None

    def close(self) -> None:
        self.lookup_client.close()
