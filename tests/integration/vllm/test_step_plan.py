"""The scheduler's save/load/verify/send rules (integration/vllm/step_plan.py): a pure function
from a request's tracker to the step's ReqMeta and the tracker's next values. Without vLLM."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch

from lmcache_triton import keys as keys_module
from lmcache_triton.integration.vllm.specs import DisaggSpec, LoadSpec, RequestTracker
from lmcache_triton.integration.vllm.step_plan import StepRules, plan_step
from lmcache_triton.keys import TokenChain

BLOCK, CHUNK = 16, 32


@pytest.fixture(params=[True, False], ids=["chain", "token-ids"])
def chain(request):
    """With a token chain (prefix mode: ReqMeta ships chunk hashes) or without (CacheBlend: token ids)."""
    return request.param


def _tracker(prompt_len=100, computed=40, cached=0, blocks=8, chain=True, spans=None):
    new = SimpleNamespace(req_id="r", prompt_token_ids=list(range(prompt_len)), block_ids=([*range(blocks)],))
    return RequestTracker.from_new_request(new, computed, cached, skip_save=False,
                                           chain=TokenChain(CHUNK, spans) if chain else None)


def _meta(tracker, load_spec=None, **rules):
    """One step as the scheduler takes it: plan, then apply."""
    plan = plan_step(tracker, StepRules(BLOCK, CHUNK, **rules), load_spec)
    tracker.advance(plan)
    return plan.meta


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
        assert m.token_offset == 32 and m.token_ids == ()
        torch.testing.assert_close(m.slot_mapping, torch.arange(32, 96))  # blocks 2..5, in order
        assert (m.chunk_hashes.first, len(m.chunk_hashes.hashes)) == (1, 2)
    else:  # CacheBlend: the ids and slots from token 0
        assert m.token_offset == 0 and m.token_ids == tuple(range(96)) and m.chunk_hashes is None
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


def test_a_load_after_vllms_own_hit_starts_at_its_chunk():
    t = _tracker(computed=100, cached=96)
    m = _meta(t, load_spec=LoadSpec(vllm_cached_tokens=48, lmcache_cached_tokens=96, can_load=True))
    assert (m.token_offset, m.num_tokens) == (32, 96) and m.chunk_hashes.first == 1
    torch.testing.assert_close(m.slots(48, 96), torch.arange(48, 96))


def test_whole_prompt_only_saves_at_the_last_prefill_step(chain):
    t = _tracker(computed=40, chain=chain)
    assert _meta(t, whole_prompt_only=True, save_unfull_chunk=True) is None
    t.update(list(range(40, 100)), None)
    m = _meta(t, whole_prompt_only=True, save_unfull_chunk=True)
    assert m.num_tokens == 100 and m.token_ids == tuple(range(100)) and m.chunk_hashes is None, \
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


@pytest.mark.parametrize("chain", [True, False], ids=["chain", "token-ids"])
def test_too_few_blocks_never_raise_in_the_scheduler(chain):
    new = SimpleNamespace(req_id="r", prompt_token_ids=list(range(100)), block_ids=([0, 1],))
    tracker = RequestTracker.from_new_request(new, 100, 0, skip_save=False, chain=TokenChain(CHUNK) if chain else None)
    meta = _meta(tracker, load_spec=LoadSpec(0, 96, True))
    assert len(meta.slot_mapping) == meta.num_tokens == 96 and len(meta.token_ids) == (0 if chain else 96)
    assert (meta.slot_mapping[:2 * BLOCK] >= 0).all() and (meta.slot_mapping[2 * BLOCK:] == -1).all()


# ---- PD: the last prefill step sends the whole prompt, once -----------------------------------------
def test_the_last_prefill_step_sends_the_whole_prompt_once():
    n = 4 * CHUNK + 5
    spec = DisaggSpec("r", receiver_host="h", receiver_init_port=(7300,))
    tracker = RequestTracker(req_id="r", prompt_len=n, token_ids=[], allocated_block_ids=list(range(n // BLOCK + 1)),
                             chain=TokenChain(CHUNK), disagg_spec=spec)
    prompt = list(range(n))

    def step(upto):
        tracker.update(prompt[len(tracker.token_ids):upto], [])
        return _meta(tracker, save_unfull_chunk=True)

    tracker.num_saved_tokens = 2 * CHUNK  # loaded from the prefiller's own cache: not saved, but sent
    first = step(3 * CHUNK)
    assert first.disagg_spec is None, "mid-prefill: nothing sent yet"
    last = step(n)
    assert last.disagg_spec is not None and last.disagg_spec.is_last_prefill
    assert (last.token_offset, last.num_tokens) == (0, n), "the prompt from token 0"
    assert len(last.chunk_hashes.hashes) == 5 and last.chunk_hashes.first == 0
    assert last.save_spec.skip_leading_tokens == 3 * CHUNK, "the save still stores only the new chunks"
    assert spec.is_last_prefill is False, "the step's copy: the proxy's spec is not changed"
    tracker.update([99], [])  # the first decode step
    assert _meta(tracker, save_unfull_chunk=True) is None
    assert last.disagg_spec.is_last_prefill, "what was sent stays as sent"


# ---- the rules decide; the scheduler applies --------------------------------------------------------
def _state(tracker: RequestTracker) -> dict:
    fields = dict(vars(tracker))
    fields["token_ids"], fields["allocated_block_ids"] = list(tracker.token_ids), list(tracker.allocated_block_ids)
    fields.pop("chain")  # a memo of hashes: asking twice hashes once, and gives the same hashes
    return copy.deepcopy(fields)


@pytest.mark.parametrize("case", ["save", "verify", "send", "load"])
def test_planning_a_step_changes_nothing_until_it_is_applied(case):
    n = 3 * CHUNK + 5
    tracker = RequestTracker(req_id="r", prompt_len=n, token_ids=list(range(n)),
                             allocated_block_ids=list(range(n // BLOCK + 1)), chain=TokenChain(CHUNK),
                             verify_tokens=2 * CHUNK if case == "verify" else 0,
                             skip_save=case != "save",
                             disagg_spec=DisaggSpec("r", receiver_host="h", receiver_init_port=(1,))
                             if case == "send" else None)
    load = LoadSpec(0, 2 * CHUNK, True) if case == "load" else None
    rules = StepRules(BLOCK, CHUNK)
    before = _state(tracker)
    plan = plan_step(tracker, rules, load)
    again = plan_step(tracker, rules, load)
    assert _state(tracker) == before, "plan_step changed the tracker"
    assert plan.meta is not None and again.meta.num_tokens == plan.meta.num_tokens
    assert again.meta.chunk_hashes == plan.meta.chunk_hashes
    tracker.advance(plan)
    after = plan_step(tracker, rules, None)
    if case == "save":
        assert tracker.num_saved_tokens == 3 * CHUNK and after.meta is None
    elif case == "verify":
        assert plan.meta.verify_tokens == 2 * CHUNK and tracker.verify_tokens == 0 and after.meta is None
    elif case == "send":
        assert plan.meta.disagg_spec.is_last_prefill and tracker.disagg_spec.is_last_prefill and after.meta is None
    else:
        assert plan.meta.load_spec == load and after.meta is None


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
            assert m.token_ids == () and len(m.slot_mapping) == m.num_tokens - m.token_offset
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
