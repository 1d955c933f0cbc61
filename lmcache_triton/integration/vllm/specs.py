"""The vocabulary the scheduler side and the workers share: the specs, a request's tracker, the
per-step metadata.

Names and fields follow LMCache's vLLM adapter, so its users find what they know. What a step
sends (`ReqMeta`, `LMCacheConnectorMetadata` and the specs in them) is frozen: the workers may read
a step's metadata after the scheduler has built the next one. The rules that decide it are
`step_plan.plan_step`'s:
- a request's KV is saved in whole chunks as its prefill advances (chunked prefill included);
  the partial tail chunk only at the last prefill step and only with `save_unfull_chunk`;
- decode tokens are saved only with `save_decode_cache`;
- after a preemption the request's blocks change, so the tracker restarts from what is cached;
  after a failed load vLLM takes the request back to its last good block, and so does the tracker;
- the tracker carries the request's token chain (`keys.TokenChain`), extended as tokens arrive, so
  each whole chunk is hashed once; a step's `ReqMeta` ships the slots and the 16-byte chunk hashes
  of the chunks it saves, loads or verifies only, never the prefix before them (a long prompt's
  chunked prefill is O(new tokens) a step, not O(prompt)). With CacheBlend (segments, not a
  prefix chain) it ships the prompt's token ids instead, once, at the last prefill step.
"""

from __future__ import annotations

from dataclasses import dataclass
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

try:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata
except ImportError:
    # Without vLLM (the scheduler side's unit tests, a host that only reads this vocabulary) the
    # metadata needs no base: vLLM's is an empty marker class, and nothing here uses it.
    KVConnectorMetadata = object  # type: ignore[assignment,misc]

from lmcache_triton.keys import ChunkHashes, MMSpan, TokenChain

if TYPE_CHECKING:
    from lmcache_triton.integration.vllm.step_plan import StepPlan


@dataclass(frozen=True)
class LoadSpec:
    """Load tokens [vllm_cached_tokens, lmcache_cached_tokens): vLLM's own prefix cache holds the
    tokens before, lmcache_triton the tokens up to the end."""

    vllm_cached_tokens: int      # tokens vLLM already holds (its own prefix cache)
    lmcache_cached_tokens: int   # tokens lmcache_triton can load
    can_load: bool               # the scheduler allocated blocks for them


@dataclass(frozen=True)
class SaveSpec:
    skip_leading_tokens: int     # already saved: store from here on
    can_save: bool


@dataclass(frozen=True)
class DisaggSpec:
    """Where a prefill instance sends a request's KV: the proxy's `kv_transfer_params.disagg_spec`
    (LMCache's fields). `receiver_init_port` has one port per worker rank, or one base port
    (rank r: base + r)."""

    req_id: str
    receiver_host: str = ""
    receiver_init_port: tuple[int, ...] = ()
    receiver_alloc_port: tuple[int, ...] = ()  # LMCache's two-step transfer; unused here
    receiver_id: str = ""
    is_last_prefill: bool = False    # the step that sends (the tracker keeps it: sent once)
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
    # An input without a position is never keyed: its request is declined (declines.py), this only must not fail.
    return [(int(pos.offset), int(pos.length), str(h)) for h, pos in zip(mm_hashes, mm_positions) if pos is not None]


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

    def rewind(self, num_computed_tokens: int) -> None:
        """vLLM took the request back to `num_computed_tokens` (a load failed: it recomputes the
        blocks from the first one reported, kv_load_failure_policy "recompute"): the tokens after it
        are computed again, and what was cached or saved past it is saved again as they are."""
        self.token_ids = self.token_ids[:num_computed_tokens]
        self.num_saved_tokens = min(self.num_saved_tokens, num_computed_tokens)
        self.is_decode_phase = len(self.token_ids) > self.prompt_len

    def advance(self, plan: StepPlan) -> None:
        """The values after a step whose message was built by `step_plan.plan_step` (and sent)."""
        self.num_saved_tokens = plan.num_saved_tokens
        self.verify_tokens = plan.verify_tokens
        self.disagg_spec = plan.disagg_spec

    def chunk_hashes(self, end: int, start: int = 0) -> ChunkHashes:
        """The chain hashes of the spans of token_ids[:end] from the chunk holding `start` on; only
        chunks not hashed before are hashed."""
        if self.chain is None:
            raise ValueError(f"request {self.req_id} has no token chain")
        return self.chain.chunk_hashes(self.token_ids, end, start)


@dataclass(frozen=True)
class ReqMeta:
    """One request's work in one step. It covers tokens [token_offset, num_tokens): the first chunk
    it saves, loads or verifies up to the last, never the prefix before (that is what makes a long
    prompt's chunked prefill cost O(new tokens) a step). `slot_mapping` has the slot of token
    `token_offset + i` at index i (-1: no block). The keys come from `chunk_hashes` (the token
    chain, scope-free; the worker folds in the namespace and identity), or with CacheBlend, from
    `token_ids` (then token_offset is 0)."""

    req_id: str
    token_ids: Sequence[int]     # ids of tokens [token_offset, num_tokens); empty when chunk_hashes are sent
    slot_mapping: torch.Tensor
    is_last_prefill: bool = False
    save_spec: SaveSpec | None = None
    load_spec: LoadSpec | None = None
    disagg_spec: DisaggSpec | None = None
    request_configs: dict | None = None
    namespace: str = ""
    adapter: str = ""
    mm_spans: Sequence[MMSpan] | None = None
    verify_tokens: int = 0  # compare the stored chunks of tokens [0, verify_tokens) with the computed KV
    token_offset: int = 0
    chunk_hashes: ChunkHashes | None = None  # of the spans of tokens [0, num_tokens), from token_offset
    # With vLLM's KV events on: (chunk index, vLLM's blocks in it) of the chunks covered (kv_events.py)
    chunk_blocks: tuple = ()

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


@dataclass(frozen=True)
class LMCacheConnectorMetadata(KVConnectorMetadata):
    """One scheduler step: what to load and save per request, which requests were looked up
    (their lookup reservations are released by the workers once this step's loads are done), and
    which vLLM preempted (their blocks are free again: the workers finish their queued saves first).
    Its sequences are tuples: a list handed in is copied, so the sender's later changes never reach it."""

    requests: tuple[ReqMeta, ...] = ()
    lookup_requests_in_step: tuple[str, ...] = ()
    preempted_req_ids: tuple[str, ...] = ()
    num_scheduled_tokens: int = 0  # the step's tokens, all requests: the forward the workers time
    declined: tuple[tuple[str, int], ...] = ()  # (reason, prompt tokens) of requests left to vLLM (declines.py)

    def __post_init__(self) -> None:
        for name in ("requests", "lookup_requests_in_step", "preempted_req_ids", "declined"):
            object.__setattr__(self, name, tuple(getattr(self, name)))
