"""Which models the connector serves (integration/vllm/model_support.py), from vLLM's own
KVCacheConfig, KVCacheGroupSpec and spec classes: one group of plain attention is served; several
groups (a hybrid), a recurrent state, non-causal attention or another block size decline the whole
model on both sides; a sliding window shorter than max_model_len declines the requests longer than it."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM's KV cache config classes")

from scheduler_stubs import BLOCK, CHUNK, output, request  # noqa: E402

from lmcache_triton.integration.vllm.model_support import ModelSupport, check_model  # noqa: E402

MAX_LEN = 4096


def _attention(cls_name: str = "FullAttentionSpec", block_size: int = BLOCK, **kw):
    from vllm.v1 import kv_cache_interface as kvi

    return getattr(kvi, cls_name)(block_size=block_size, num_kv_heads=2, head_size=16, dtype=torch.bfloat16, **kw)


def _mamba():
    from vllm.v1.kv_cache_interface import MambaSpec

    return MambaSpec(block_size=BLOCK, shapes=((4, 64), (2, 16, 16)), dtypes=(torch.bfloat16, torch.bfloat16))


def kv_cache_config(*specs, layers: int = 2):
    """vLLM's KVCacheConfig with one group per spec, `layers` layers each."""
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec

    groups = [KVCacheGroupSpec([f"model.layers.{g * layers + i}.attn" for i in range(layers)], spec)
              for g, spec in enumerate(specs)]
    return KVCacheConfig(num_blocks=64, kv_cache_tensors=[], kv_cache_groups=groups)


def vllm_config(role: str = "kv_both", max_model_len: int = MAX_LEN) -> SimpleNamespace:
    return SimpleNamespace(
        kv_transfer_config=SimpleNamespace(kv_role=role, engine_id="model-support-test", kv_connector_extra_config={
            "lmcache.chunk_size": CHUNK, "lmcache.max_local_cpu_size": 0.01}),
        cache_config=SimpleNamespace(block_size=BLOCK),
        parallel_config=SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1),
        model_config=SimpleNamespace(model="org/hybrid-model", max_model_len=max_model_len, use_mla=False))


# ---- what is served, what is declined ----------------------------------------------------------------
def test_one_group_of_plain_attention_is_served():
    assert check_model(vllm_config(), kv_cache_config(_attention())) == ModelSupport()
    assert check_model(vllm_config(), kv_cache_config(_attention("MLAAttentionSpec"))) == ModelSupport()
    assert check_model(vllm_config(), None) == ModelSupport(), "vLLM told nothing: served as before"


def test_sliding_and_full_layers_that_vllm_keeps_as_full_attention_are_served():
    """Gemma-2/3 shapes: with its hybrid allocator off (our connector does not declare it) vLLM
    gives every layer a FullAttentionSpec that records the window, and frees no block."""
    assert check_model(vllm_config(), kv_cache_config(_attention(sliding_window=128))) == ModelSupport()


@pytest.mark.parametrize("specs, named", [
    ((_attention(), _mamba()), ["2 KV cache groups", "group 0: FullAttentionSpec (2 layers)",
                                "group 1: MambaSpec (2 layers)"]),
    ((_attention(), _attention("SlidingWindowSpec", sliding_window=128)), ["SlidingWindowSpec"]),
    ((_mamba(),), ["group 0: MambaSpec", "not paged attention KV"]),
    ((_attention("ChunkedLocalAttentionSpec", attention_chunk_size=64),), ["ChunkedLocalAttentionSpec"]),
    ((_attention("SinkFullAttentionSpec", sink_len=4),), ["SinkFullAttentionSpec"]),
    ((_attention(non_causal=True),), ["non-causal"]),
    ((_attention(block_size=2 * BLOCK),), [f"block size {2 * BLOCK}, not the scheduler's {BLOCK}"]),
    ((), ["no KV cache groups"]),
], ids=["mamba-hybrid", "two-attention-groups", "mamba-only", "chunked-local", "sink", "non-causal",
        "other-block-size", "attention-free"])
def test_a_kv_cache_the_connector_cannot_restore_declines_the_model(specs, named):
    support = check_model(vllm_config(), kv_cache_config(*specs))
    assert support.decline == "unsupported_model"
    assert all(n in support.why for n in named), support.why


def test_a_sliding_window_shorter_than_max_model_len_limits_the_requests_served():
    window = _attention("SlidingWindowSpec", sliding_window=3 * CHUNK)
    assert check_model(vllm_config(), kv_cache_config(window)).sliding_window == 3 * CHUNK
    assert check_model(vllm_config(max_model_len=3 * CHUNK), kv_cache_config(window)) == ModelSupport(), \
        "a window of max_model_len or more frees no block"


# ---- through vLLM's connector class: the scheduler declines, the workers build nothing -----------------
def _connector(role_name: str, kv_config):
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from lmcache_triton.integration.vllm.connector import LMCacheTritonConnectorV1

    return LMCacheTritonConnectorV1(vllm_config(), getattr(KVConnectorRole, role_name), kv_config)


def test_a_hybrid_model_is_declined_whole_with_one_log_line(caplog, clean_lmcache_env):
    with caplog.at_level(logging.WARNING, logger="lmcache_triton"):
        connector = _connector("SCHEDULER", kv_cache_config(_attention(), _mamba()))
    try:
        lines = [r.getMessage() for r in caplog.records if r.name == "lmcache_triton"]
        assert len(lines) == 1, lines
        assert "org/hybrid-model" in lines[0] and "'unsupported_model'" in lines[0] and "MambaSpec" in lines[0]
        req = request(n=4 * CHUNK)
        assert connector.get_num_new_matched_tokens(req, 0) == (0, False)
        connector.update_state_after_alloc(req, None, 0)
        meta = connector.build_connector_meta(output(new=[_new(req)], scheduled={"r": 4 * CHUNK}))
        assert meta.requests == (), "nothing loaded or saved"
        assert meta.declined == (), "no worker has an engine to count it"
        stats = connector.get_kv_connector_stats()  # vLLM's metrics count it, from the scheduler side
        assert stats.data["miss_tokens"] == {"unsupported_model": 4 * CHUNK} and stats.data["lookups"] == 1
        assert connector.get_kv_connector_stats() is None, "counted once"
        assert connector.request_finished(req, list(range(8))) == (False, None), "no block held for a save"
    finally:
        connector.shutdown()


def _new(req):
    from scheduler_stubs import new_req

    return new_req(req, range(4 * CHUNK // BLOCK))


def test_the_workers_of_a_declined_model_build_no_engine_and_store_nothing(clean_lmcache_env):
    from lmcache_triton.integration.vllm.specs import LMCacheConnectorMetadata
    from lmcache_triton.tools.testing import make_kv_caches

    connector = _connector("WORKER", kv_cache_config(_attention(), _mamba()))
    try:
        caches = make_kv_caches("vllm_cpu", num_layers=2, num_blocks=8, block_size=BLOCK, num_kv_heads=2,
                                head_size=16)
        connector.register_kv_caches({f"model.layers.{i}.attn": c for i, c in enumerate(caches)})
        assert connector._worker.engine is None and connector._worker.lookup_server is None
        connector.bind_connector_metadata(LMCacheConnectorMetadata(declined=(("unsupported_model", 10),)))
        connector.start_load_kv(None)
        connector.wait_for_save()
        assert connector.get_finished({"r"}) == (None, None)
        assert connector.get_kv_connector_stats() is None
    finally:
        connector.shutdown()


def test_a_sliding_window_model_is_served_within_its_window(caplog, clean_lmcache_env):
    """Mistral-7B-v0.1's shape: every layer sliding, the window shorter than max_model_len."""
    with caplog.at_level(logging.WARNING, logger="lmcache_triton"):
        connector = _connector("SCHEDULER", kv_cache_config(_attention("SlidingWindowSpec", sliding_window=3 * CHUNK)))
    try:
        (line,) = [r.getMessage() for r in caplog.records if r.name == "lmcache_triton"]
        assert "window 96 < max_model_len 4096" in line and "'sliding_window'" in line
        assert connector._scheduler.model_decline is None and connector._scheduler.sliding_window == 3 * CHUNK
    finally:
        connector.shutdown()


def test_a_kv_cache_config_it_cannot_read_declines_rather_than_fails_vllms_start():
    unknown = SimpleNamespace(kv_cache_groups=[SimpleNamespace(kv_cache_spec=object(), layer_names=["l"])])
    assert check_model(vllm_config(), unknown).decline == "unsupported_model"
    broken = SimpleNamespace(kv_cache_groups=7)  # not a list of groups
    support = check_model(vllm_config(), broken)
    assert support.decline == "unsupported_model" and "cannot read" in support.why
