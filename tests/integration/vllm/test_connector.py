"""Both sides of the connector together, without vLLM: the scheduler side's metadata drives the
worker side over a real engine (stubs stand in for vLLM's objects and the lookup client only),
and what the keys carry of vLLM's config."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from lmcache_triton.integration.vllm.scheduler import adapter_identity
from scheduler_stubs import BLOCK, CHUNK, prefill, request, scheduler
from worker_stubs import GEO, StubEngine, real_engine, save
from worker_stubs import worker as stub_worker


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
    engine = real_engine(closing, layerwise)
    src = make_kv_caches("vllm_cpu", generator=torch.Generator().manual_seed(0), **GEO)

    def worker(meta, caches):
        side = stub_worker(meta, StubEngine())
        side.engine, side.kvcaches = engine, caches
        side.start_load_kv(None)
        for layer in range(len(caches) if layerwise else 0):  # vLLM's forward, layer by layer
            side.wait_for_layer_load(f"layer.{layer}")
            side.save_kv_layer(f"layer.{layer}", caches[layer], None)
        return save(side)

    sched = scheduler(hit=0)
    first = request("r1", n=n, cache_salt="salt", lora_request=lora, mm_features=mm)
    for meta in prefill(sched, first, range(11), step=CHUNK + CHUNK // 2):
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

    sched.lookup_client.hit = 5 * CHUNK
    second = request("r2", n=n, cache_salt="salt", lora_request=lora, mm_features=mm)
    dst = make_kv_caches("vllm_cpu", fill=0, **GEO)
    blocks = range(16, 27)
    (meta,) = prefill(sched, second, blocks, step=n)
    (req,) = meta.requests
    assert req.load_spec.lmcache_cached_tokens == 5 * CHUNK and req.chunk_hashes is not None
    side = worker(meta, dst)
    assert side.get_block_ids_with_load_errors() == set()
    assert engine.get_stats().hit_tokens == 5 * CHUNK
    slots = lambda first_block: torch.arange(first_block * BLOCK, first_block * BLOCK + 5 * CHUNK)  # noqa: E731
    assert torch.equal(paged_gather(dst, slots(16), "vllm_cpu"), paged_gather(src, slots(0), "vllm_cpu"))


# ---- a failed load is a miss vLLM recomputes, never a failed request (unless the config says fail) ------
class _Frozen:
    """A config whose fields cannot be set (a frozen dataclass, a pydantic model)."""

    kv_load_failure_policy = "fail"

    def __setattr__(self, name, value):
        raise AttributeError(f"{name} is frozen")


@pytest.mark.parametrize("given, ours, expect", [
    pytest.param(SimpleNamespace(kv_load_failure_policy="fail"), "recompute", "recompute", id="fail-becomes-recompute"),
    pytest.param(SimpleNamespace(kv_load_failure_policy="recompute"), "recompute", "recompute", id="recompute-stays"),
    pytest.param(SimpleNamespace(kv_load_failure_policy="recompute"), "fail", "fail", id="lmcache-fail-is-vllms"),
    pytest.param(SimpleNamespace(kv_load_failure_policy="fail"), "fail", "fail", id="fail-stays"),
    pytest.param(_Frozen(), "recompute", "fail", id="frozen-config-keeps-vllms-policy"),
])
def test_the_connectors_kv_load_failure_policy_is_the_one_vllm_applies(given, ours, expect, caplog):
    """vLLM's field defaults to "fail" and cannot say whether a user gave it: the connector's config
    (`kv_load_failure_policy`, default "recompute") decides, and the log says which one applies."""
    pytest.importorskip("vllm", reason="connector.py is vLLM's KV connector class")
    from lmcache_triton.integration.vllm.connector import _apply_load_failure_policy

    with caplog.at_level("INFO", logger="lmcache_triton"):
        _apply_load_failure_policy(given, ours)
    assert given.kv_load_failure_policy == expect
    if isinstance(given, _Frozen):
        assert '"kv_load_failure_policy": "recompute" in --kv-transfer-config' in caplog.text, \
            "the user is told how to set it"
    elif expect == "fail":
        assert "ends with an error" in caplog.text, "the log says a failed load fails its request"


def test_a_config_without_the_policy_is_left_alone():
    pytest.importorskip("vllm", reason="connector.py is vLLM's KV connector class")
    from lmcache_triton.integration.vllm.connector import _apply_load_failure_policy

    older = SimpleNamespace(kv_role="kv_both")  # a vLLM before kv_load_failure_policy
    _apply_load_failure_policy(older, "recompute")
    assert not hasattr(older, "kv_load_failure_policy")


# ---- multimodal: the same placeholder tokens with another image never share KV -----------------------------
class EngineLookup:
    """The lookup client asking the real engine itself (the lookup server's call, without its socket)."""

    def __init__(self, engine) -> None:
        self.engine = engine

    def lookup(self, tokens, lookup_id, **scope):
        return self.engine.lookup(tokens, **scope)

    def clear_lookup_status(self, lookup_id):
        pass

    def close(self):
        pass


def test_a_request_with_another_image_loads_only_the_chunks_before_it(closing):
    """vLLM's Requests with the same token ids (the image's placeholder ids too) and two images,
    through both sides and a real engine: image A's prompt is stored; with image B the lookup finds
    and the worker loads the chunk before the placeholder only, never A's chunks from the
    placeholder's on; image A again loads them all, byte for byte."""
    pytest.importorskip("vllm", reason="vLLM's Request and MultiModalFeatureSpec")
    from scheduler_stubs import vllm_request

    from lmcache_triton.kernels import paged_gather
    from lmcache_triton.tools.testing import make_kv_caches

    n, image_at = 4 * CHUNK + 5, CHUNK + 8
    prompt = [7] * image_at + [9] * 32 + [11] * (n - image_at - 32)  # [9] * 32: the placeholder ids
    engine = real_engine(closing)
    src = make_kv_caches("vllm_cpu", generator=torch.Generator().manual_seed(0), **GEO)
    sched = scheduler(hit=0)
    sched.lookup_client = EngineLookup(engine)

    def run(req, caches, first_block):
        for meta in prefill(sched, req, range(first_block, first_block + n // BLOCK + 1), step=n):
            side = stub_worker(meta, StubEngine())
            side.engine, side.kvcaches = engine, caches
            side.start_load_kv(None)
            save(side)
        return engine.get_stats().hit_tokens

    run(vllm_request("a", prompt, "image-a", image_at, 32), src, 0)
    assert engine.get_stats().stored_tokens == 4 * CHUNK
    slots = lambda first_block, start, end: torch.arange(first_block * BLOCK + start, first_block * BLOCK + end)  # noqa: E731

    other = make_kv_caches("vllm_cpu", fill=0, **GEO)
    assert run(vllm_request("b", prompt, "image-b", image_at, 32), other, 16) == CHUNK, \
        "image B hits the chunk before its placeholder only"
    assert torch.equal(paged_gather(other, slots(16, 0, CHUNK), "vllm_cpu"), paged_gather(src, slots(0, 0, CHUNK),
                                                                                         "vllm_cpu"))
    assert not paged_gather(other, slots(16, CHUNK, 4 * CHUNK), "vllm_cpu").any(), "none of A's chunks from the image on"

    same = make_kv_caches("vllm_cpu", fill=0, **GEO)
    assert run(vllm_request("a2", prompt, "image-a", image_at, 32), same, 16) == CHUNK + 4 * CHUNK
    assert torch.equal(paged_gather(same, slots(16, 0, 4 * CHUNK), "vllm_cpu"),
                       paged_gather(src, slots(0, 0, 4 * CHUNK), "vllm_cpu"))
