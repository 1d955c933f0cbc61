"""What the scheduler side's tests drive it with, shaped like vLLM's (0.32) objects: a stub lookup
client (the only part replaced: the lookup server lives in the workers), requests, and each
step's SchedulerOutput. Nothing here imports vLLM but `vllm_request`, which builds vLLM's own
Request for the tests that have vLLM."""

from __future__ import annotations

from types import SimpleNamespace

from lmcache_triton.config import LMCacheEngineConfig
from lmcache_triton.integration.vllm.scheduler import SchedulerSide
from lmcache_triton.integration.vllm.specs import LMCacheConnectorMetadata

BLOCK, CHUNK = 16, 32


def vllm_config(role: str = "kv_both") -> SimpleNamespace:
    return SimpleNamespace(
        kv_transfer_config=SimpleNamespace(kv_role=role, engine_id="glue-test", kv_connector_extra_config={}),
        cache_config=SimpleNamespace(block_size=BLOCK),
        parallel_config=SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1))


def config(**kw) -> LMCacheEngineConfig:
    return LMCacheEngineConfig.from_defaults(chunk_size=CHUNK, max_local_cpu_size=0.01, **kw)


class StubLookup:
    """Answers every lookup with `hit` (None: an asynchronous lookup still running)."""

    def __init__(self, hit: int | None) -> None:
        self.hit = hit
        self.calls: list[dict] = []

    def lookup(self, tokens, lookup_id, **kw):
        self.calls.append({"tokens": tokens, "id": lookup_id, **kw})
        return self.hit

    def clear_lookup_status(self, lookup_id):
        pass

    def close(self):
        pass


def scheduler(hit: int | None, role: str = "kv_both", **kw) -> SchedulerSide:
    side = SchedulerSide(vllm_config(role), config(**kw))
    side.lookup_client.close()
    side.lookup_client = StubLookup(hit)
    return side


def request(req_id="r", n=4 * CHUNK, **kw) -> SimpleNamespace:
    """vLLM's Request: its id, prompt and (as decode goes on) all its token ids."""
    fields = dict(cache_salt=None, mm_features=None, lora_request=None, prompt_embeds=None) | kw
    prompt = list(range(n))
    return SimpleNamespace(request_id=req_id, prompt_token_ids=prompt, all_token_ids=list(prompt), num_tokens=n,
                           **fields)


def vllm_request(req_id: str, prompt: list[int], image: str, offset: int, length: int, max_tokens: int = 4):
    """vLLM's own Request, with one image (content hash `image`) over tokens [offset, offset + length)."""
    from vllm import SamplingParams
    from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
    from vllm.v1.request import Request

    feature = MultiModalFeatureSpec(data=None, modality="image", identifier=image,
                                    mm_position=PlaceholderRange(offset=offset, length=length), mm_hash=image)
    return Request(req_id, prompt, SamplingParams(max_tokens=max_tokens), None, mm_features=[feature])


def new_req(request, blocks, computed=0) -> SimpleNamespace:
    """vLLM's NewRequestData: `computed` is what vLLM's prefix cache and the connector hold."""
    return SimpleNamespace(req_id=request.request_id, prompt_token_ids=request.prompt_token_ids,
                           block_ids=(list(blocks),), num_computed_tokens=computed,
                           lora_request=request.lora_request, sampling_params=None)


def cached_step(req_id: str, computed: int, new_blocks=None, resumed: bool = False) -> SimpleNamespace:
    """vLLM's CachedRequestData for one running (or, `resumed`, preempted and resumed) request."""
    return SimpleNamespace(req_ids=[req_id], resumed_req_ids={req_id} if resumed else set(),
                           new_block_ids=[None if new_blocks is None else (list(new_blocks),)],
                           num_computed_tokens=[computed])


def no_cached() -> SimpleNamespace:
    return SimpleNamespace(req_ids=[], resumed_req_ids=set(), new_block_ids=[], num_computed_tokens=[])


def output(new=(), cached=None, scheduled=None, finished=(), preempted=()) -> SimpleNamespace:
    """vLLM's SchedulerOutput."""
    return SimpleNamespace(scheduled_new_reqs=list(new), scheduled_cached_reqs=cached or no_cached(),
                           num_scheduled_tokens=dict(scheduled or {}), finished_req_ids=set(finished),
                           preempted_req_ids=set(preempted))


def idle_step(side: SchedulerSide, finished=()) -> LMCacheConnectorMetadata:
    """A step that schedules none of the test's requests."""
    return side.build_connector_meta(output(finished=finished))


def prefill(side: SchedulerSide, request, blocks, step: int, computed: int = 0) -> list[LMCacheConnectorMetadata]:
    """vLLM's scheduler for one request: a lookup (vLLM's own prefix cache holding `computed`
    tokens), then a chunked prefill `step` tokens a step."""
    n = len(request.prompt_token_ids)
    need, _ = side.get_num_new_matched_tokens(request, computed)
    side.update_state_after_alloc(request, None, need)
    computed += need
    metas = []
    first = True
    while computed < n:
        todo = min(step, n - computed)
        out = output(new=[new_req(request, blocks, computed)] if first else [],
                     cached=None if first else cached_step(request.request_id, computed),
                     scheduled={request.request_id: todo})
        metas.append(side.build_connector_meta(out))
        computed += todo
        first = False
    return metas


def decode(side: SchedulerSide, request, token: int = 7) -> LMCacheConnectorMetadata:
    """One decode step: vLLM appends a sampled token and schedules it."""
    request.all_token_ids.append(token)
    request.num_tokens = len(request.all_token_ids)
    computed = len(request.all_token_ids) - 1
    return side.build_connector_meta(output(cached=cached_step(request.request_id, computed),
                                            scheduled={request.request_id: 1}))
