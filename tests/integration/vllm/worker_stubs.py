"""What the worker side's tests build it from, without vLLM: vLLM's config as the worker reads it,
step metadata, and engines that stand in for the real one where a test needs a failure or a
slow store on cue (the tests that need the engine's behaviour use the real one: `real_engine`)."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import torch

from lmcache_triton.config import LMCacheEngineConfig
from lmcache_triton.engine.load_policy import PrefillEstimate
from lmcache_triton.integration.vllm.specs import LMCacheConnectorMetadata, LoadSpec, ReqMeta, SaveSpec
from lmcache_triton.integration.vllm.worker import WorkerSide

BLOCK, CHUNK = 16, 32
GEO = dict(num_layers=2, num_blocks=32, block_size=BLOCK, num_kv_heads=2, head_size=16)


def vllm_config(role: str = "kv_both", engine_id: str = "worker-test", extra: dict | None = None, tp: int = 1,
                **model) -> SimpleNamespace:
    return SimpleNamespace(
        kv_transfer_config=SimpleNamespace(kv_role=role, engine_id=engine_id, kv_connector_extra_config=extra or {}),
        cache_config=SimpleNamespace(block_size=BLOCK),
        parallel_config=SimpleNamespace(tensor_parallel_size=tp, pipeline_parallel_size=1),
        model_config=SimpleNamespace(**(dict(model="worker/model", use_mla=False) | model)))


def config(**kw) -> LMCacheEngineConfig:
    return LMCacheEngineConfig.from_defaults(chunk_size=CHUNK, max_local_cpu_size=0.01, **kw)


def req(req_id: str, first_token: int, n: int = 2 * CHUNK, *, save_from: int | None = 0, load: int = 0,
        slots: int | None = None, **kw) -> ReqMeta:
    """A request's step: tokens first_token.. in slots 0.. (-1 from `slots` on), saved from
    `save_from`, `load` tokens to load."""
    slot_mapping = torch.arange(n if slots is None else slots, dtype=torch.long)
    if slots is not None and slots < n:
        slot_mapping = torch.cat([slot_mapping, torch.full((n - slots,), -1, dtype=torch.long)])
    return ReqMeta(req_id=req_id, token_ids=[first_token + i for i in range(n)], slot_mapping=slot_mapping,
                   save_spec=None if save_from is None else SaveSpec(save_from, True),
                   load_spec=LoadSpec(0, load, True) if load else None, **kw)


class Steps:
    """vLLM's connector as the worker side sees it: the metadata bound for the current step."""

    def __init__(self, meta: LMCacheConnectorMetadata) -> None:
        self.meta = meta

    def _get_connector_metadata(self) -> LMCacheConnectorMetadata:
        return self.meta


def worker(meta: LMCacheConnectorMetadata, engine, role: str = "kv_both", caches=None, **cfg) -> WorkerSide:
    side = WorkerSide(vllm_config(role), config(**cfg), Steps(meta))
    side.engine = engine
    side.kvcaches = [torch.zeros(1)] if caches is None else caches
    return side


def save(side: WorkerSide) -> WorkerSide:
    """vLLM's end of a step: wait_for_save queues the stores; then wait for them to run."""
    side.wait_for_save()
    if side.saving.saver is not None:
        assert side.saving.saver.wait(timeout=30)
    return side


def real_engine(closing: list, layerwise: bool = False, **cfg_kw):
    from lmcache_triton import LMCacheEngineMetadata, create_gpu_connector
    from lmcache_triton.engine.engine import LMCacheEngine

    cfg = config(use_layerwise=layerwise, **cfg_kw)
    metadata = LMCacheEngineMetadata(model_name="glue/model", world_size=1, worker_id=0, kv_dtype=torch.bfloat16,
                                     kv_shape=(2, 2, CHUNK, 2, 16))
    engine = LMCacheEngine(cfg, metadata, create_gpu_connector(cfg, metadata, "vllm_cpu"))
    closing.append(engine)
    return engine


class StubEngine:
    """Records every call; `fail_on` request tokens make store/retrieve raise."""

    layerwise = False

    def __init__(self, fail_on: set[int] = frozenset(), loaded_fraction: float = 1.0) -> None:
        self.calls: list[tuple[str, tuple, dict]] = []
        self.fail_on = set(fail_on)
        self.loaded_fraction = loaded_fraction
        self.unpinned: list[str] = []
        self.prefill = PrefillEstimate()  # what the worker's step timer feeds

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


class LayerwiseLoads(StubEngine):
    """retrieve_layer as the engine's: one step per layer, returning the loaded-token mask (or
    raising at step `fail_at`); records how many steps had run at each of vLLM's calls."""

    layerwise = True

    def __init__(self, num_layers: int, loaded: int, fail_at: int | None = None) -> None:
        super().__init__()
        self.num_layers, self.loaded, self.fail_at, self.steps = num_layers, loaded, fail_at, 0

    def retrieve_layer(self, tokens, mask=None, **kw):
        n = tokens if isinstance(tokens, int) else len(tokens)
        for _ in range(self.num_layers):
            if self.steps == self.fail_at:
                raise RuntimeError("a layer's copy failed")
            self.steps += 1
            yield None
        ret = torch.zeros(n, dtype=torch.bool)
        ret[:self.loaded] = True
        return ret


class GatedEngine(StubEngine):
    """Stores wait for `gate` (a slow copy), then run `then` (the real engine's store, or nothing)."""

    def __init__(self, then=None) -> None:
        super().__init__()
        self.gate = threading.Event()
        self.then = then

    def store(self, tokens, mask=None, **kw):
        assert self.gate.wait(30), "the test never opened the gate"
        super().store(tokens, mask, **kw)
        return self.then(tokens, mask, **kw) if self.then is not None else 0
