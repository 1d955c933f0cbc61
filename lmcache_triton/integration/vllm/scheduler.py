"""The connector's scheduler side: lookups, load/save decisions, the per-step metadata.

Each request's state is one `RequestState` (request_state.py); what a step sends for it is decided
by `step_plan.plan_step`, a pure function of that state, and applied here.

A request's token chain (`keys.TokenChain`: scope-free hashes over its token ids and multimodal
inputs) is computed here, once: at its first lookup over the prompt (kept in its state, so the
questions vLLM repeats while a request waits cost nothing), then extended by its tracker as
prefill and decode go on. Lookups and the per-step metadata send 16 bytes a chunk instead of the
token ids; the workers fold the namespace and identity into each key.
"""

from __future__ import annotations

import hashlib
import logging
import random
from dataclasses import replace
from functools import lru_cache
from pathlib import Path
from typing import Any

from lmcache_triton.config import LMCacheEngineConfig
from lmcache_triton.config_fields import TRUE_WORDS
from lmcache_triton.integration.vllm.common import engine_id, world_size
from lmcache_triton.integration.vllm.declines import also_unsaved, declines_figures, load_decline, log_decline
from lmcache_triton.integration.vllm.kv_events import SchedulerKVEvents, kv_events_enabled
from lmcache_triton.integration.vllm.lookup.client import LookupClientFactory
from lmcache_triton.integration.vllm.request_state import RequestState
from lmcache_triton.integration.vllm.specs import (
    DisaggSpec,
    LMCacheConnectorMetadata,
    LoadSpec,
    ReqMeta,
    RequestTracker,
    mm_spans,
)
from lmcache_triton.integration.vllm.step_plan import StepRules, plan_step
from lmcache_triton.keys import TokenChain

logger = logging.getLogger("lmcache_triton")


def _mm_features(request: Any) -> tuple[list[str] | None, list[Any] | None]:
    feats = getattr(request, "mm_features", None) or []
    if not feats:
        return None, None
    return [f.identifier for f in feats], [f.mm_position for f in feats]


@lru_cache(maxsize=256)
def _adapter_key(name: str, lora_id: int, path: str) -> str:
    """Once per adapter (vLLM itself loads an adapter's files once per id): its name and a blake2b
    of its folder's adapter files, so the same name with other weights is another adapter and the
    same weights in another folder share KV. Later requests under it cost a dict lookup, no I/O on
    the scheduler's step. ~0.7 s per GB of adapter, the first time."""
    h = hashlib.blake2b(digest_size=16)
    try:
        files = sorted(p for p in Path(path).iterdir() if p.is_file() and p.name.startswith("adapter_"))
        for f in files:
            h.update(f.name.encode() + b"\x00")
            with open(f, "rb") as fh:
                while block := fh.read(1 << 20):
                    h.update(block)
    except OSError:  # not a local folder (vLLM resolved it elsewhere): the name and path name it
        files = []
    return f"lora:{name}:{h.hexdigest() if files else path}"


def adapter_identity(request: Any) -> str:
    """What the keys of a request under a LoRA adapter carry of it ("" for the base model). vLLM's
    own prefix cache keys blocks by the adapter too."""
    lora = getattr(request, "lora_request", None)
    if lora is None:
        return ""
    name = str(getattr(lora, "lora_name", "") or getattr(lora, "name", ""))
    path = str(getattr(lora, "lora_path", "") or getattr(lora, "path", "") or "")
    return _adapter_key(name, int(getattr(lora, "lora_int_id", 0) or 0), path)


def _request_configs(request: Any) -> dict | None:
    params = getattr(request, "sampling_params", None)
    extra = getattr(params, "extra_args", None) or {}
    kv_params = extra.get("kv_transfer_params") or {}
    configs = {k: v for k, v in kv_params.items() if str(k).startswith("lmcache.")}
    return configs or None


def _disagg_spec(request: Any) -> DisaggSpec | None:
    """A PD sender's request: where its prompt's chunks go (the proxy's disagg_spec). A spec that
    cannot be read costs the transfer, never the request: the decoder computes."""
    try:
        return DisaggSpec.from_params(request.request_id, getattr(request, "kv_transfer_params", None))
    except ValueError as e:
        logger.warning("lmcache_triton: request %s is not sent to a decoder: %s", request.request_id, e)
        return None


def _truthy(value: Any) -> bool:
    return value is True or (isinstance(value, (str, int)) and str(value).strip().lower() in TRUE_WORDS)


class SchedulerSide:
    def __init__(self, vllm_config: Any, config: LMCacheEngineConfig) -> None:
        self.config = config
        self.kv_role = vllm_config.kv_transfer_config.kv_role
        self.chunk_size = config.chunk_size
        self.lookup_client = LookupClientFactory.create_lookup_client(engine_id(vllm_config), world_size(vllm_config),
                                                                      config)
        self.requests: dict[str, RequestState] = {}  # the one place a request's state lives (request_state.py)
        # Lookups answered (or abandoned) since the last step: the workers release their
        # reservations once that step's loads are done.
        self.lookups_in_step: list[str] = []
        # Requests left to vLLM since the last step, (reason, prompt tokens): counted by rank 0 (declines.py).
        self.declined_in_step: list[tuple[str, int]] = []
        self.model_decline: str | None = None  # set when the model is one the connector cannot serve
        self.declines_for_stats: list[tuple[str, int]] = []  # with model_decline: for vLLM's metrics
        self.sliding_window: int | None = None  # set when vLLM frees the blocks leaving it (model_support.py)
        # CacheBlend keys segments, not a prefix chain: its lookups and metadata carry token ids.
        self.use_chains = not config.enable_blending
        self.rules = StepRules(block_size=vllm_config.cache_config.block_size, chunk_size=config.chunk_size,
                               save_unfull_chunk=config.save_unfull_chunk, save_decode_cache=config.save_decode_cache,
                               whole_prompt_only=config.enable_blending)
        # Saves run after the step (worker.py); layerwise saves finish inside the forward.
        self.async_saves = not config.use_layerwise
        # vLLM's KV events on: each step names the blocks of the chunks it saves or loads (kv_events.py)
        self.kv_events = (SchedulerKVEvents(config.chunk_size, vllm_config.cache_config.block_size)
                          if kv_events_enabled(vllm_config) else None)

    def _state(self, req_id: str) -> RequestState:
        """The request's state; the one place one is created (request_finished removes it)."""
        state = self.requests.get(req_id)
        if state is None:
            state = self.requests[req_id] = RequestState(req_id)
        return state

    # ---- vLLM scheduler hooks ----------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        req_id = request.request_id
        state = self._state(req_id)
        state.new_lookup()
        reason = self.model_decline or load_decline(request, self.sliding_window)
        if self.kv_role == "kv_producer":  # loads nothing; whether it may save is decided all the same
            state.uncacheable = reason is not None and also_unsaved(reason)
            return 0, False
        if reason is not None:  # left to vLLM, counted once per request (declines.py)
            state.uncacheable = also_unsaved(reason)
            if state.declined is None:
                state.declined = reason
                self.declined_in_step.append((reason, request.num_tokens))
                log_decline(req_id, reason)
            return 0, False
        if _truthy((_request_configs(request) or {}).get("lmcache.skip_load")):
            return 0, False  # the request asked to compute its prompt (kv_transfer_params); it still saves
        tokens = request.prompt_token_ids or []
        try:
            spans = mm_spans(*_mm_features(request))
            scope = dict(namespace=getattr(request, "cache_salt", None) or "", adapter=adapter_identity(request))
            if self.use_chains:  # 16 bytes a chunk, hashed once per request
                hashes = state.prompt_chain(self.chunk_size, tokens, spans)[1]
                hit = self.lookup_client.lookup(tokens, req_id, chunk_hashes=hashes, **scope)
            else:
                hit = self.lookup_client.lookup(list(tokens), req_id, mm_spans=spans, **scope)
        except Exception:  # the cache must never fail a request: a failed lookup is a miss
            logger.exception("lmcache_triton lookup of %s failed", req_id)
            hit = 0
        if hit is None:
            state.lookup_pending = True
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
        elif hit > num_computed_tokens and random.random() < self.config.verify_hit_rate:
            # A canary: vLLM computes the prefix, the worker compares it with what is stored.
            state.verify_tokens = hit
            return 0, False
        # vLLM's own prefix cache holds tokens [0, num_computed_tokens): load the rest of our hit.
        # vLLM must compute at least one token to produce logits: on a full hit, load all but
        # let vLLM recompute the last one.
        need = hit - num_computed_tokens - (1 if hit == request.num_tokens else 0)
        state.load_spec = LoadSpec(vllm_cached_tokens=num_computed_tokens, lmcache_cached_tokens=hit, can_load=False)
        return max(need, 0), False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        # May run twice for one request: everything here is idempotent.
        self.lookup_client.clear_lookup_status(request.request_id)
        state = self._state(request.request_id)
        state.request = request
        spec = state.load_spec
        if spec is not None:
            # Load no more than vLLM accepted (it may take fewer tokens than offered), counted from
            # the tokens its own prefix cache holds: the last prompt token of a full hit rides
            # along, vLLM recomputes it anyway.
            full_hit = spec.lmcache_cached_tokens == request.num_tokens
            accepted = spec.vllm_cached_tokens + num_external_tokens + (1 if full_hit else 0)
            state.load_spec = replace(spec, can_load=num_external_tokens > 0,
                                      lmcache_cached_tokens=min(spec.lmcache_cached_tokens, accepted))

    def build_connector_meta(self, scheduler_output: Any) -> LMCacheConnectorMetadata:
        # scheduler_output.finished_req_ids is not read: request_finished, which vLLM calls first
        # for each of them, has removed their state (request_state.py).
        lookups, self.lookups_in_step = self.lookups_in_step, []
        declined, self.declined_in_step = self.declined_in_step, []
        if self.model_decline is not None:  # no worker has an engine to count them: vLLM's metrics do
            self.declines_for_stats.extend(declined)
            declined = []
        requests: list[ReqMeta] = []
        for new in scheduler_output.scheduled_new_reqs:
            state = self._state(new.req_id)
            num_tokens = new.num_computed_tokens + scheduler_output.num_scheduled_tokens[new.req_id]
            state.tracker = self._new_tracker(new, state, num_tokens, state.load_spec)
            self._plan(state, state.take_load_spec(), requests)

        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            state = self.requests.get(req_id)
            if state is None or state.tracker is None or state.request is None:
                continue
            tracker, request = state.tracker, state.request
            num_new = scheduler_output.num_scheduled_tokens[req_id]
            load_spec = state.take_load_spec()
            if req_id in cached.resumed_req_ids:  # after a preemption: new blocks, a new lookup
                tracker.reset_after_preemption(list(request.all_token_ids), cached.num_computed_tokens[i] + num_new,
                                               cached.new_block_ids[i],
                                               load_spec.lmcache_cached_tokens if load_spec else 0)
                tracker.verify_tokens = state.take_verify_tokens() or tracker.verify_tokens
            else:
                if cached.num_computed_tokens[i] < len(tracker.token_ids):  # taken back after a failed load
                    tracker.rewind(cached.num_computed_tokens[i])
                start = len(tracker.token_ids)
                tracker.update(list(request.all_token_ids[start:start + num_new]), cached.new_block_ids[i])
            self._plan(state, load_spec, requests)
        return LMCacheConnectorMetadata(
            requests=requests, lookup_requests_in_step=lookups,
            preempted_req_ids=sorted(getattr(scheduler_output, "preempted_req_ids", None) or ()), declined=declined,
            num_scheduled_tokens=sum(scheduler_output.num_scheduled_tokens.values()))

    def _new_tracker(self, new: Any, state: RequestState, num_tokens: int, load_spec: LoadSpec | None
                     ) -> RequestTracker:
        request = state.request
        mm_hashes, mm_positions = _mm_features(request) if request is not None else (None, None)
        chain = None
        if self.use_chains:  # the chain its lookup began, else a new one
            chain = state.chain or TokenChain(self.chunk_size, mm_spans(mm_hashes, mm_positions))
        tracker = RequestTracker.from_new_request(
            new, num_tokens, load_spec.lmcache_cached_tokens if load_spec else 0,
            skip_save=self.kv_role == "kv_consumer" or state.uncacheable,
            namespace=(getattr(request, "cache_salt", None) or "") if request is not None else "",
            mm_hashes=mm_hashes, mm_positions=mm_positions,
            request_configs=_request_configs(new),
            adapter=adapter_identity(new),
            verify_tokens=state.take_verify_tokens(),
            chain=chain,
        )
        tracker.disagg_spec = _disagg_spec(request) if request is not None and self.config.pd_sender else None
        return tracker

    def _plan(self, state: RequestState, load_spec: LoadSpec | None, requests: list[ReqMeta]) -> None:
        """This step's message for the request (step_plan.py decides), and its state after it."""
        try:
            plan = plan_step(state.tracker, self.rules, load_spec)
        except Exception:  # one request's bad state must not fail vLLM's scheduler step
            logger.exception("lmcache_triton: request %s left out of this step's metadata", state.req_id)
            return
        state.tracker.advance(plan)
        if plan.meta is not None:
            meta = plan.meta if self.kv_events is None else self.kv_events.name_blocks(plan.meta, state.request)
            requests.append(meta)
            state.saving = state.saving or (self.async_saves and plan.saves)

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict | None]:
        """The one place a request's state is removed (request_state.py says why it is enough).
        True: vLLM holds the blocks until the workers report the request's saves done (they
        report exactly the requests sent a save, as this does); False: free them now."""
        req_id = request.request_id
        self.lookup_client.clear_lookup_status(req_id)
        state = self.requests.pop(req_id, None)
        if state is None:  # never looked up nor scheduled (or a second call): nothing to hold
            return False, None
        if state.lookup_pending and req_id not in self.lookups_in_step:
            # Aborted while its lookup ran: the workers' holds for it are released with the next
            # step's metadata (or, if no step comes, by their lease).
            self.lookups_in_step.append(req_id)
        return state.saving, None

    def take_decline_figures(self) -> dict | None:
        """With the model declined: its requests' declines since the last call, for vLLM's metrics."""
        taken, self.declines_for_stats = self.declines_for_stats, []
        return declines_figures(taken) if taken else None

    def close(self) -> None:
        self.lookup_client.close()
