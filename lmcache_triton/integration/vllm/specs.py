"""The scheduler's per-request state and the per-step metadata it sends to the workers.

Names and fields follow LMCache's vLLM adapter, so its users find what they know. The rules:
- a request's KV is saved in whole chunks as its prefill advances (chunked prefill included);
  the partial tail chunk only at the last prefill step and only with `save_unfull_chunk`;
- decode tokens are saved only with `save_decode_cache`;
- after a preemption the request's blocks change, so the tracker restarts from what is cached;
- the tracker carries the request's token chain (`keys.TokenChain`), extended as tokens arrive, so
  each whole chunk is hashed once; a step's `ReqMeta` ships the slots and the 16-byte chunk hashes
  of the chunks it saves, loads or verifies only, never the prefix before them (a long prompt's
  chunked prefill is O(new tokens) a step, not O(prompt)). With CacheBlend (segments, not a
  prefix chain) it ships the prompt's token ids instead, once, at the last prefill step.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from lmcache_triton.keys import ChunkHashes, MMSpan, TokenChain


@dataclass
class LoadSpec:
    vllm_cached_tokens: int      # tokens vLLM already holds (its own prefix cache)
    lmcache_cached_tokens: int   # tokens lmcache_triton can load
    can_load: bool               # the scheduler allocated blocks for them


@dataclass
class SaveSpec:
    skip_leading_tokens: int     # already saved: store from here on
    can_save: bool


@dataclass
class DisaggSpec:
    """Where a prefill instance sends a request's KV: the proxy's `kv_transfer_params.disagg_spec`
    (LMCache's fields). `receiver_init_port` has one port per worker rank, or one base port
    (rank r: base + r)."""

    req_id: str
    receiver_host: str = ""
    receiver_init_port: tuple[int, ...] = ()
    receiver_alloc_port: tuple[int, ...] = ()  # LMCache's two-step transfer; unused here
    receiver_id: str = ""
    is_last_prefill: bool = False    # set on the step that sends
    num_transferred_tokens: int = 0  # what the receiver holds, once sent

    @classmethod
    def from_params(cls, req_id: str, kv_transfer_params: dict | None) -> DisaggSpec | None:
        """The spec in a request's kv_transfer_params, None without one. Raises ValueError naming
        the field that is wrong."""
        raw = (kv_transfer_params or {}).get("disagg_spec")
        if raw is None:
            return None
        if not isinstance(raw, dict):
            raise ValueError(f"kv_transfer_params.disagg_spec must be an object, got {type(raw).__name__}")
        host = raw.get("receiver_host")
        if not isinstance(host, str) or not host:
            raise ValueError(f"kv_transfer_params.disagg_spec.receiver_host must be a host name, got {host!r}")
        return cls(req_id=str(raw.get("req_id") or req_id), receiver_host=host,
                   receiver_init_port=_ports(raw.get("receiver_init_port"), "receiver_init_port"),
                   receiver_alloc_port=_ports(raw.get("receiver_alloc_port") or (), "receiver_alloc_port"),
                   receiver_id=str(raw.get("receiver_id") or ""))


def _ports(value: Any, name: str) -> tuple[int, ...]:
    items = value if isinstance(value, (list, tuple)) else [value]
    if name == "receiver_init_port" and not items:
        raise ValueError("kv_transfer_params.disagg_spec.receiver_init_port is empty")
    if not all(isinstance(p, int) and not isinstance(p, bool) and 0 < p < 65536 for p in items):
        raise ValueError(f"kv_transfer_params.disagg_spec.{name} must be a port or a list of ports, got {value!r}")
    return tuple(items)



def _flatten_block_ids(block_ids: Any) -> list[int]:
    """vLLM gives one list per KV-cache group; the connector serves the single full-attention group."""
    if not block_ids:
        return []
    if isinstance(block_ids, tuple) or isinstance(block_ids[0], list):
        return list(block_ids[0])
    return list(block_ids)


def mm_spans(mm_hashes: list[str] | None, mm_positions: list[Any] | None) -> list[MMSpan] | None:
    """The multimodal inputs as (offset, length, hash) of their placeholder tokens: each key
    folds in the hashes of the inputs its tokens overlap (chunk or CacheBlend segment alike)."""
    if not mm_hashes or not mm_positions:
        return None
    return [(int(pos.offset), int(pos.length), str(h)) for h, pos in zip(mm_hashes, mm_positions)]


@dataclass
class RequestTracker:
    req_id: str
    prompt_len: int
    token_ids: list[int]
    allocated_block_ids: list[int]
    num_saved_tokens: int = 0
    disagg_spec: DisaggSpec | None = None
    mm_hashes: list[str] | None = None
    mm_positions: list[Any] | None = None
    request_configs: dict | None = None
    is_decode_phase: bool = False
    skip_save: bool = False
    namespace: str = ""
    adapter: str = ""            # the LoRA adapter's identity: its KV is not the base model's
    verify_tokens: int = 0       # a hit vLLM recomputes to check the stored KV (verify_hit_rate)
    # The token chain over token_ids (and the multimodal spans), hashed as chunks complete; None:
    # the keys are not a prefix chain (CacheBlend) and ReqMeta carries the token ids instead.
    chain: TokenChain | None = None

    @classmethod
    def from_new_request(cls, new_request: Any, num_tokens_to_compute: int, lmcache_cached_tokens: int,
                         *, skip_save: bool, namespace: str = "", mm_hashes=None, mm_positions=None,
                         request_configs: dict | None = None, adapter: str = "",
                         verify_tokens: int = 0, chain: TokenChain | None = None) -> RequestTracker:
        prompt = list(new_request.prompt_token_ids or [])
        return cls(
            req_id=new_request.req_id,
            prompt_len=len(prompt),
            token_ids=prompt[:num_tokens_to_compute],
            allocated_block_ids=_flatten_block_ids(new_request.block_ids),
            num_saved_tokens=lmcache_cached_tokens,  # what is cached need not be saved again
            mm_hashes=mm_hashes,
            mm_positions=mm_positions,
            request_configs=request_configs,
            skip_save=skip_save,
            namespace=namespace,
            adapter=adapter,
            verify_tokens=verify_tokens,
            chain=chain,
        )

    def update(self, new_token_ids: list[int], new_block_ids: Any) -> None:
        """A running request scheduled again: its new tokens and blocks."""
        self.allocated_block_ids.extend(_flatten_block_ids(new_block_ids))
        self.token_ids.extend(new_token_ids)
        if len(self.token_ids) > self.prompt_len:
            self.is_decode_phase = True

    def reset_after_preemption(self, all_token_ids: list[int], num_tokens_to_compute: int, new_block_ids: Any,
                               lmcache_cached_tokens: int) -> None:
        """A preempted request resumes with new blocks; its KV is recomputed or reloaded from scratch."""
        self.allocated_block_ids = _flatten_block_ids(new_block_ids)
        self.token_ids = list(all_token_ids[:num_tokens_to_compute])
        self.num_saved_tokens = lmcache_cached_tokens
        if self.chain is not None:  # the ids were replaced: hash them anew (once; preemption is rare)
            self.chain = TokenChain(self.chain.chunk_size, self.chain.mm_spans)

    def chunk_hashes(self, end: int, start: int = 0) -> ChunkHashes:
        """The chain hashes of the spans of token_ids[:end] from the chunk holding `start` on; only
        chunks not hashed before are hashed."""
        if self.chain is None:
            raise ValueError(f"request {self.req_id} has no token chain")
        return self.chain.chunk_hashes(self.token_ids, end, start)


@dataclass
class ReqMeta:
    """One request's work in one step. It covers tokens [token_offset, num_tokens): the first chunk
    it saves, loads or verifies up to the last, never the prefix before (that is what makes a long
    prompt's chunked prefill cost O(new tokens) a step). `slot_mapping` has the slot of token
    `token_offset + i` at index i (-1: no block). The keys come from `chunk_hashes` (the token
    chain, scope-free; the worker folds in the namespace and identity), or with CacheBlend, from
    `token_ids` (then token_offset is 0)."""

    req_id: str
    token_ids: list[int]         # ids of tokens [token_offset, num_tokens); empty when chunk_hashes are sent
    slot_mapping: torch.Tensor
    is_last_prefill: bool = False
    save_spec: SaveSpec | None = None
    load_spec: LoadSpec | None = None
    disagg_spec: DisaggSpec | None = None
    request_configs: dict | None = None
    namespace: str = ""
    adapter: str = ""
    mm_spans: list[MMSpan] | None = None
    verify_tokens: int = 0  # compare the stored chunks of tokens [0, verify_tokens) with the computed KV
    token_offset: int = 0
    chunk_hashes: ChunkHashes | None = None  # of the spans of tokens [0, num_tokens), from token_offset

    @property
    def num_tokens(self) -> int:
        """The end of the tokens this step's work covers."""
        return self.token_offset + len(self.slot_mapping)

    def key_args(self) -> dict[str, Any]:
        """What names this request's keys besides its tokens, for every engine call (store,
        retrieve, verify)."""
        return dict(namespace=self.namespace, adapter=self.adapter, mm_spans=self.mm_spans)

    def engine_tokens(self, start: int, end: int) -> tuple[list[int] | int, dict[str, Any]]:
        """(tokens, key arguments) of an engine call that stores, loads or verifies tokens
        [start, end) (`start` chunk-aligned): the count `end` and the chunk hashes from `start` on
        (the engine skips the chunks before them), or without hashes the ids [0, end) (a mask
        skips [0, start))."""
        if self.chunk_hashes is not None:
            return end, dict(self.key_args(), chunk_hashes=self.chunk_hashes.since(start))
        if self.token_offset:
            raise ValueError(f"request {self.req_id}: tokens from {self.token_offset} without chunk hashes")
        return self.token_ids[:end], self.key_args()

    def slots(self, start: int, end: int) -> torch.Tensor:
        """The slots of tokens [start, end)."""
        if start < self.token_offset or end > self.num_tokens:
            raise ValueError(f"request {self.req_id}: slots of tokens [{start}, {end}) outside "
                             f"[{self.token_offset}, {self.num_tokens})")
        return self.slot_mapping[start - self.token_offset:end - self.token_offset]

    @classmethod
    def from_request_tracker(cls, tracker: RequestTracker, block_size: int, chunk_size: int, *,
                             load_spec: LoadSpec | None = None, save_unfull_chunk: bool = False,
                             save_decode_cache: bool = False, whole_prompt_only: bool = False) -> ReqMeta | None:
        """What the workers must do for this request in this step; None when nothing.

        `whole_prompt_only` (CacheBlend): segments end at separators, not chunk boundaries, so the
        prompt is saved once, at its last prefill step."""
        num_tokens = len(tracker.token_ids)
        is_last_prefill = num_tokens >= tracker.prompt_len
        # Save when the new tokens complete a chunk past what is saved (or finish the prefill).
        next_boundary = (tracker.num_saved_tokens // chunk_size + 1) * chunk_size
        request_skip = bool((tracker.request_configs or {}).get("lmcache.skip_save", False))
        skip_save = (
            tracker.skip_save
            or request_skip
            or (tracker.is_decode_phase and not save_decode_cache)
            or (num_tokens < next_boundary and not (is_last_prefill and save_unfull_chunk))
            or (whole_prompt_only and not is_last_prefill)
        )
        verify_tokens = tracker.verify_tokens if num_tokens >= tracker.verify_tokens > 0 else 0
        if verify_tokens:
            tracker.verify_tokens = 0  # once
        # Prefill/decode disaggregation: the step that completes the prompt sends all of it, loaded
        # and locally cached tokens too (the receiver has none of them), once.
        disagg = tracker.disagg_spec
        send = (disagg is not None and is_last_prefill and not tracker.is_decode_phase
                and not disagg.is_last_prefill)
        if send:
            disagg.is_last_prefill = True
            # a copy: the workers may read this step's metadata after the scheduler built the next
            disagg = replace(disagg, is_last_prefill=True)
        if skip_save and load_spec is None and not verify_tokens and not send:
            return None
        if is_last_prefill and save_unfull_chunk and not tracker.is_decode_phase:
            num_to_save = num_tokens
        else:  # mid-prefill a partial chunk would be saved again once it fills: keep whole chunks only
            num_to_save = num_tokens // chunk_size * chunk_size
        save_spec = SaveSpec(skip_leading_tokens=tracker.num_saved_tokens, can_save=not skip_save)
        if not skip_save:
            tracker.num_saved_tokens = max(tracker.num_saved_tokens, num_to_save)

        loading = load_spec is not None and load_spec.can_load
        end = min(max(num_to_save, verify_tokens, load_spec.lmcache_cached_tokens if loading else 0,
                      num_tokens if send else 0), num_tokens)
        use_chain = tracker.chain is not None and not whole_prompt_only
        if use_chain:  # from the first chunk this step saves, loads or verifies
            starts = [save_spec.skip_leading_tokens] if save_spec.can_save else []
            if loading:
                starts.append(load_spec.vllm_cached_tokens)
            if verify_tokens or send:
                starts.append(0)
            start = min(min(starts, default=end), end) // chunk_size * chunk_size
        else:
            start = 0
        return cls(
            req_id=tracker.req_id,
            token_ids=[] if use_chain else tracker.token_ids[:end],
            slot_mapping=_slots(tracker.allocated_block_ids, block_size, start, end),
            is_last_prefill=is_last_prefill,
            save_spec=save_spec,
            load_spec=load_spec,
            disagg_spec=disagg if send else None,
            request_configs=tracker.request_configs,
            namespace=tracker.namespace,
            adapter=tracker.adapter,
            mm_spans=mm_spans(tracker.mm_hashes, tracker.mm_positions),
            verify_tokens=verify_tokens,
            token_offset=start,
            chunk_hashes=tracker.chunk_hashes(end, start) if use_chain else None,
        )


def _slots(block_ids: list[int], block_size: int, start: int, end: int) -> torch.Tensor:
    """The slots of tokens [start, end) in the request's blocks. Never raises in vLLM's scheduler:
    tokens without a block get slot -1 (padding, which no kernel touches); the worker loads and
    saves only tokens that have a slot."""
    first = start // block_size
    blocks = torch.tensor(block_ids[first:-(-end // block_size)], dtype=torch.long)
    slots = (blocks[:, None] * block_size + torch.arange(block_size)[None, :]).reshape(-1)
    slots = slots[start - first * block_size:end - first * block_size]
    if len(slots) < end - start:
        slots = torch.cat([slots, slots.new_full((end - start - len(slots),), -1)])
    return slots


@dataclass
class LMCacheConnectorMetadata(KVConnectorMetadata):
    """One scheduler step: what to load and save per request, which requests were looked up
    (their lookup reservations are released by the workers once this step's loads are done), and
    which vLLM preempted (their blocks are free again: the workers finish their queued saves first)."""

    requests: list[ReqMeta] = field(default_factory=list)
    lookup_requests_in_step: list[str] = field(default_factory=list)
    preempted_req_ids: list[str] = field(default_factory=list)

    def add_request(self, req_meta: ReqMeta) -> None:
        self.requests.append(req_meta)
