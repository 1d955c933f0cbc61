"""The connector's scheduler side: lookups, load/save decisions, the per-step metadata.

A request's token chain (`keys.TokenChain`: scope-free hashes over its token ids and multimodal
inputs) is computed here, once: at its first lookup over the prompt (kept per request id, so the
questions vLLM repeats while a request waits cost nothing), then extended by its tracker as
prefill and decode go on. Lookups and the per-step metadata send 16 bytes a chunk instead of the
token ids; the workers fold the namespace and identity into each key.
"""

from __future__ import annotations

import hashlib
import logging
import random
from functools import lru_cache
from pathlib import Path
from typing import Any

from lmcache_triton.config import LMCacheEngineConfig
from lmcache_triton.integration.vllm.common import engine_id, world_size
from lmcache_triton.integration.vllm.specs import (
    DisaggSpec,
    LMCacheConnectorMetadata,
    LoadSpec,
    ReqMeta,
    RequestTracker,
    mm_spans,
)
from lmcache_triton.integration.vllm.lookup.client import LookupClientFactory
from lmcache_triton.keys import ChunkHashes, MMSpan, TokenChain

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
        self.pending_lookups: set[str] = set()   # asynchronous lookups not answered yet
        self.uncacheable: set[str] = set()       # prompts given as embeddings: never loaded or saved
        self.verify_tokens: dict[str, int] = {}  # hits vLLM recomputes to check (verify_hit_rate)
        # CacheBlend keys segments, not a prefix chain: its lookups and metadata carry token ids.
        self.use_chains = not config.enable_blending
        # Per request: its token chain and the hashes of its prompt's spans (what a lookup sends).
        self.prompt_chains: dict[str, tuple[TokenChain, ChunkHashes]] = {}
        # Saves run after the step (worker.py): a finished request that was sent a save keeps its
        # blocks until the workers report its saves done. Layerwise saves finish inside the forward.
        self.async_saves = not config.use_layerwise
        self.saving: set[str] = set()

    def _prompt_chain(self, request: Any, spans: list[MMSpan] | None) -> tuple[TokenChain, ChunkHashes]:
        """The request's chain and its prompt's span hashes, hashed at its first lookup only."""
        req_id = request.request_id
        prompt = request.prompt_token_ids or []
        entry = self.prompt_chains.get(req_id)
        if entry is None or entry[1].num_tokens != len(prompt):
            chain = TokenChain(self.chunk_size, spans)
            entry = self.prompt_chains[req_id] = (chain, chain.chunk_hashes(prompt))
        return entry

    # ---- vLLM scheduler hooks ----------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        if self.kv_role == "kv_producer":
            return 0, False
        req_id = request.request_id
        if getattr(request, "prompt_embeds", None) is not None:
            # The tokens' KV comes from embeddings we cannot key by token ids: never served, never saved.
            self.uncacheable.add(req_id)
            return 0, False
        tokens = request.prompt_token_ids or []
        try:
            spans = mm_spans(*_mm_features(request))
            scope = dict(namespace=getattr(request, "cache_salt", None) or "", adapter=adapter_identity(request))
            if self.use_chains:  # 16 bytes a chunk, hashed once per request
                hit = self.lookup_client.lookup(tokens, req_id, chunk_hashes=self._prompt_chain(request, spans)[1],
                                                **scope)
            else:
                hit = self.lookup_client.lookup(list(tokens), req_id, mm_spans=spans, **scope)
        except Exception:  # the cache must never fail a request: a failed lookup is a miss
            logger.exception("lmcache_triton lookup of %s failed", req_id)
            hit = 0
        if hit is None:
            self.pending_lookups.add(req_id)
            return None, False  # asynchronous lookup still running: vLLM asks again next step
        self.pending_lookups.discard(req_id)
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
            self.verify_tokens[req_id] = hit
            return 0, False
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
            # Load no more than vLLM accepted (it may take fewer tokens than offered): the last
            # prompt token of a full hit rides along, vLLM recomputes it anyway.
            full_hit = spec.lmcache_cached_tokens == request.num_tokens
            accepted = spec.vllm_cached_tokens + num_external_tokens + (1 if full_hit else 0)
            spec.lmcache_cached_tokens = min(spec.lmcache_cached_tokens, accepted)

    def build_connector_meta(self, scheduler_output: Any) -> LMCacheConnectorMetadata:
        meta = LMCacheConnectorMetadata(lookup_requests_in_step=self.lookups_in_step,
                                        preempted_req_ids=sorted(getattr(scheduler_output, "preempted_req_ids",
                                                                         None) or ()))
        self.lookups_in_step = []
        for req_id in scheduler_output.finished_req_ids:
            self._forget(req_id)
        skip_all_saves = self.kv_role == "kv_consumer"

        for new in scheduler_output.scheduled_new_reqs:
            load_spec = self.load_specs.pop(new.req_id, None)
            request = self.unfinished.get(new.req_id)
            mm_hashes, mm_positions = _mm_features(request) if request is not None else (None, None)
            chain = None
            if self.use_chains:  # the chain its lookup began, else a new one
                entry = self.prompt_chains.get(new.req_id)
                chain = entry[0] if entry is not None else TokenChain(self.chunk_size,
                                                                      mm_spans(mm_hashes, mm_positions))
            disagg_spec = self._disagg_spec(request) if request is not None else None
            tracker = RequestTracker.from_new_request(
                new, new.num_computed_tokens + scheduler_output.num_scheduled_tokens[new.req_id],
                load_spec.lmcache_cached_tokens if load_spec else 0,
                skip_save=skip_all_saves or new.req_id in self.uncacheable,
                namespace=(getattr(request, "cache_salt", None) or "") if request is not None else "",
                mm_hashes=mm_hashes, mm_positions=mm_positions,
                request_configs=_request_configs(new),
                adapter=adapter_identity(new),
                verify_tokens=self.verify_tokens.pop(new.req_id, 0),
                chain=chain,
            )
            tracker.disagg_spec = disagg_spec
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

    def _disagg_spec(self, request: Any) -> DisaggSpec | None:
        """A PD sender's request: where its prompt's chunks go (the proxy's disagg_spec). A spec
        that cannot be read costs the transfer, never the request: the decoder computes."""
        if not self.config.pd_sender:
            return None
        try:
            return DisaggSpec.from_params(request.request_id, getattr(request, "kv_transfer_params", None))
        except ValueError as e:
            logger.warning("lmcache_triton: request %s is not sent to a decoder: %s", request.request_id, e)
            return None

    def _forget(self, req_id: str) -> None:
        self.trackers.pop(req_id, None)
        self.unfinished.pop(req_id, None)
        self.load_specs.pop(req_id, None)
        self.uncacheable.discard(req_id)
        self.verify_tokens.pop(req_id, None)
        self.prompt_chains.pop(req_id, None)

    def _add(self, meta: LMCacheConnectorMetadata, tracker: RequestTracker, load_spec: LoadSpec | None) -> None:
        try:
            req_meta = ReqMeta.from_request_tracker(
                tracker, self.block_size, self.chunk_size, load_spec=load_spec,
                save_unfull_chunk=self.config.save_unfull_chunk, save_decode_cache=self.config.save_decode_cache,
                whole_prompt_only=self.config.enable_blending)
        except Exception:  # one request's bad state must not fail vLLM's scheduler step
            logger.exception("lmcache_triton: request %s left out of this step's metadata", tracker.req_id)
            return
        if req_meta is not None:
            meta.add_request(req_meta)
            if self.async_saves and req_meta.save_spec is not None and req_meta.save_spec.can_save:
                self.saving.add(tracker.req_id)

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict | None]:
        """True: vLLM holds the blocks until the workers report the request's saves done (they
        report exactly the requests sent a save, as this does); False: free them now."""
        req_id = request.request_id
        held = req_id in self.saving
        self.saving.discard(req_id)
        self.lookup_client.clear_lookup_status(req_id)
        self.load_specs.pop(req_id, None)
        self.prompt_chains.pop(req_id, None)
        if req_id in self.pending_lookups:
            # Aborted while its lookup ran: the workers' holds for it are released with the next
            # step's metadata (or, if no step comes, by their lease).
            self.pending_lookups.discard(req_id)
            if req_id not in self.lookups_in_step:
                self.lookups_in_step.append(req_id)
        return held, None

    def close(self) -> None:
        self.lookup_client.close()
