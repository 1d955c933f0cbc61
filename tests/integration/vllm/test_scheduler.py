"""The connector's scheduler side (integration/vllm/scheduler.py, request_state.py) without vLLM:
a stub lookup client and requests and scheduler outputs shaped like vLLM's (scheduler_stubs.py).
What a lookup decides, what the workers are told to load and save, and that a request's state ends
with the request, whatever way it ends."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from scheduler_stubs import (
    BLOCK,
    CHUNK,
    cached_step,
    decode,
    idle_step,
    new_req,
    output,
    prefill,
    request,
    scheduler,
)

from lmcache_triton import keys as keys_module
from lmcache_triton.integration.vllm.scheduler import adapter_identity
from lmcache_triton.integration.vllm.specs import LoadSpec, SaveSpec
from lmcache_triton.keys import TokenChain

ROOT = Path(__file__).resolve().parents[3]


# ---- the load: exactly the tokens between vLLM's own prefix cache and ours ------------------------
def test_vllm_accepting_fewer_tokens_clamps_the_load():
    side = scheduler(hit=3 * CHUNK)
    req = request()
    assert side.get_num_new_matched_tokens(req, 0) == (3 * CHUNK, False)
    side.update_state_after_alloc(req, None, CHUNK + 3)
    assert side.requests["r"].load_spec.lmcache_cached_tokens == CHUNK + 3
    full = request("f", n=3 * CHUNK)
    assert side.get_num_new_matched_tokens(full, 0) == (3 * CHUNK - 1, False)
    side.update_state_after_alloc(full, None, 3 * CHUNK - 1)
    assert side.requests["f"].load_spec.lmcache_cached_tokens == 3 * CHUNK, "the last token of a full hit rides along"


@pytest.mark.parametrize("vllm_holds, accepted", [(CHUNK, 2 * CHUNK), (CHUNK, CHUNK + 8), (BLOCK, 3 * CHUNK - BLOCK)],
                         ids=["a-chunk-all-accepted", "a-chunk-fewer-accepted", "a-block-all-accepted"])
def test_a_partial_local_hit_loads_exactly_the_tokens_between_vllms_hit_and_ours(vllm_holds, accepted):
    """vLLM's prefix cache holds the first `vllm_holds` tokens, ours 3 chunks of a 4-chunk prompt:
    the rest of our hit is offered, and what vLLM accepts (counted from its own hit) is loaded,
    into the slots of exactly those tokens. A clamp that forgets vLLM's hit loads too little: KV
    that vLLM then treats as computed is never written (wrong tokens)."""
    side = scheduler(hit=3 * CHUNK)
    req = request()
    assert side.get_num_new_matched_tokens(req, vllm_holds) == (3 * CHUNK - vllm_holds, False), \
        "the tokens past vLLM's own hit are offered"
    side.update_state_after_alloc(req, None, accepted)
    computed = vllm_holds + accepted
    meta = side.build_connector_meta(output(new=[new_req(req, range(8), computed)],
                                            scheduled={"r": 4 * CHUNK - computed}))
    (sent,) = meta.requests
    assert sent.load_spec == LoadSpec(vllm_cached_tokens=vllm_holds, lmcache_cached_tokens=computed, can_load=True)
    first = vllm_holds // CHUNK * CHUNK  # the load starts at the chunk holding vLLM's last cached token
    assert sent.token_offset == first and sent.num_tokens >= computed
    torch.testing.assert_close(sent.slots(vllm_holds, computed), torch.arange(vllm_holds, computed)), \
        "the slots of the tokens to load (blocks 0..7 in order)"
    assert sent.chunk_hashes.first == first // CHUNK
    assert sent.save_spec.skip_leading_tokens == computed, "what vLLM holds or we load is not saved again"


def test_no_load_is_offered_below_vllms_own_hit():
    side = scheduler(hit=2 * CHUNK)
    req = request()
    assert side.get_num_new_matched_tokens(req, 3 * CHUNK) == (0, False)
    side.update_state_after_alloc(req, None, 0)
    meta = side.build_connector_meta(output(new=[new_req(req, range(8), 3 * CHUNK)], scheduled={"r": CHUNK}))
    assert all(r.load_spec is None or not r.load_spec.can_load for r in meta.requests)


def test_prompt_embeds_are_never_looked_up_or_saved():
    side = scheduler(hit=3 * CHUNK)
    req = request(prompt_embeds=torch.zeros(4, 8))
    assert side.get_num_new_matched_tokens(req, 0) == (0, False)
    assert side.lookup_client.calls == []
    assert side.requests["r"].uncacheable
    side.update_state_after_alloc(req, None, 0)
    meta = side.build_connector_meta(output(new=[new_req(req, range(8))], scheduled={"r": 4 * CHUNK}))
    assert meta.requests == (), "nothing saved"
    assert meta.declined == (("prompt_embeds", 4 * CHUNK),), "counted once, with the prompt's tokens"


def test_prompt_logprobs_are_never_loaded_but_saved_and_counted_once():
    """vLLM's own prefix cache skips a request that wants its prompt's logprobs: so do we (only a
    prefill of every prompt token gives them); the KV it computes is exact, so it is saved."""
    from types import SimpleNamespace

    side = scheduler(hit=3 * CHUNK)
    req = request(sampling_params=SimpleNamespace(prompt_logprobs=0), skip_reading_prefix_cache=True)
    for _ in range(3):  # vLLM asks again while the request waits: one decline
        assert side.get_num_new_matched_tokens(req, 0) == (0, False)
    assert side.lookup_client.calls == []
    side.update_state_after_alloc(req, None, 0)
    meta = side.build_connector_meta(output(new=[new_req(req, range(8))], scheduled={"r": 4 * CHUNK}))
    assert meta.declined == (("prompt_logprobs", 4 * CHUNK),)
    (saved,) = meta.requests
    assert saved.save_spec.can_save and saved.load_spec is None
    assert side.build_connector_meta(output()).declined == (), "each decline is sent once"


def test_prompt_logprob_token_ids_are_prompt_logprobs_too(caplog, monkeypatch):
    """vLLM 0.32's other way to ask for prompt logprobs (of given tokens) is declined alike, and a
    decline says why in one line: at INFO the first time its reason occurs, at DEBUG after that."""
    from types import SimpleNamespace

    from lmcache_triton.integration.vllm import declines

    monkeypatch.setattr(declines, "_logged", set())
    side = scheduler(hit=3 * CHUNK)
    params = SimpleNamespace(prompt_logprobs=None, prompt_logprob_token_ids=[[5]])
    with caplog.at_level("DEBUG", logger="lmcache_triton"):
        for req_id in ("a", "b"):
            req = request(req_id=req_id, sampling_params=params, skip_reading_prefix_cache=True)
            assert side.get_num_new_matched_tokens(req, 0) == (0, False)
    assert side.lookup_client.calls == []
    assert side.declined_in_step == [("prompt_logprobs", 4 * CHUNK)] * 2
    lines = [(r.levelname, r.getMessage()) for r in caplog.records if "not loaded" in r.getMessage()]
    assert [level for level, _ in lines] == ["INFO", "DEBUG"], lines
    assert "request a is not loaded, it wants its prompt's logprobs" in lines[0][1]
    assert "reason 'prompt_logprobs'" in lines[0][1]


def test_a_declined_request_is_counted_by_rank_0_as_a_miss_of_its_reason(closing):
    from lmcache_triton.integration.vllm.specs import LMCacheConnectorMetadata
    from worker_stubs import real_engine, worker

    engine = real_engine(closing)
    meta = LMCacheConnectorMetadata(declined=(("prompt_logprobs", 100),))
    side = worker(meta, engine)
    side.before_step(meta)
    stats = engine.get_stats()
    assert stats.miss_tokens == {"prompt_logprobs": 100} and stats.lookup_tokens == 100 and stats.hit_tokens == 0


def test_lookup_carries_salt_adapter_and_multimodal_spans(tmp_path):
    (tmp_path / "adapter_config.json").write_text(json.dumps({"r": 8}))
    (tmp_path / "adapter_model.safetensors").write_bytes(b"weights-1")
    from types import SimpleNamespace

    lora = SimpleNamespace(lora_name="a", lora_int_id=1, lora_path=str(tmp_path))
    mm = [SimpleNamespace(identifier="img-hash", mm_position=SimpleNamespace(offset=5, length=3))]
    side = scheduler(hit=0)
    side.get_num_new_matched_tokens(request(cache_salt="salt", lora_request=lora, mm_features=mm), 0)
    call = side.lookup_client.calls[0]
    assert call["namespace"] == "salt" and call["adapter"].startswith("lora:a:")
    prompt = list(range(4 * CHUNK))
    assert call["chunk_hashes"] == TokenChain(CHUNK, [(5, 3, "img-hash")]).chunk_hashes(prompt), \
        "the multimodal inputs are folded into the prompt's chain"
    assert call["chunk_hashes"] != TokenChain(CHUNK).chunk_hashes(prompt)


def test_adapter_identity_follows_the_weights_not_just_the_name(tmp_path):
    from types import SimpleNamespace

    def adapter(folder, weights):
        folder.mkdir()
        (folder / "adapter_config.json").write_text("{}")
        (folder / "adapter_model.safetensors").write_bytes(weights)
        return SimpleNamespace(lora_request=SimpleNamespace(lora_name="same-name", lora_path=str(folder)))

    one, two = adapter(tmp_path / "one", b"w1"), adapter(tmp_path / "two", b"w2")
    copy = adapter(tmp_path / "copy", b"w1")
    assert adapter_identity(one) != adapter_identity(two)
    assert adapter_identity(one) == adapter_identity(copy), "the same adapter in another folder shares KV"
    assert adapter_identity(SimpleNamespace(lora_request=None)) == ""


def test_verify_hit_rate_recomputes_and_schedules_a_check():
    side = scheduler(hit=2 * CHUNK, verify_hit_rate=1.0)
    req = request()
    assert side.get_num_new_matched_tokens(req, 0) == (0, False), "vLLM computes the hit itself"
    side.update_state_after_alloc(req, None, 0)
    meta = side.build_connector_meta(output(new=[new_req(req, range(8))], scheduled={"r": 4 * CHUNK}))
    assert [m.verify_tokens for m in meta.requests] == [2 * CHUNK]
    assert [m.verify_tokens for m in decode(side, req).requests] in ([], [0]), "a check is sent once"


def test_a_new_lookup_replaces_the_last_ones_decisions():
    """vLLM asks again while a request waits (no blocks yet): the last answer decides."""
    side = scheduler(hit=3 * CHUNK)
    req = request()
    side.get_num_new_matched_tokens(req, 0)
    side.lookup_client.hit = 0
    assert side.get_num_new_matched_tokens(req, 0) == (0, False)
    assert side.requests["r"].load_spec == LoadSpec(0, 0, False)


def test_aborted_async_lookup_is_released_with_the_next_step():
    side = scheduler(hit=None, enable_async_loading=True)
    req = request()
    assert side.get_num_new_matched_tokens(req, 0) == (None, False)
    side.request_finished(req, [])
    assert idle_step(side, finished={"r"}).lookup_requests_in_step == ("r",)
    assert idle_step(side).lookup_requests_in_step == (), "released once"


def test_scheduler_hashes_a_prompt_once_and_ships_only_each_steps_chunks(monkeypatch):
    side = scheduler(hit=0)
    n = 10 * CHUNK + 5
    req = request(n=n, cache_salt="salt")
    calls = []
    real = keys_module.hashlib.sha256  # one per chunk hashed (the chain's hash function)
    monkeypatch.setattr(keys_module.hashlib, "sha256", lambda *a: calls.append(1) or real(*a))
    assert side.get_num_new_matched_tokens(req, 0) == (0, False)
    assert len(calls) == 11, "10 whole chunks and the partial tail, at the first lookup"
    side.lookup_client.hit = None  # vLLM asks again while the request waits
    side.get_num_new_matched_tokens(req, 0)
    assert len(calls) == 11, "a repeated lookup of the request hashes nothing"
    sent = side.lookup_client.calls
    assert sent[0]["chunk_hashes"] is sent[1]["chunk_hashes"] and len(sent[0]["chunk_hashes"].hashes) == 11
    side.lookup_client.hit = 0
    metas = prefill(side, req, range(n // BLOCK + 1), step=3 * CHUNK)
    assert len(calls) == 11, "the tracker carries on with the lookup's chain"
    saved = [m.requests[0] for m in metas if m.requests]
    assert [(r.token_offset, r.num_tokens) for r in saved] == [(0, 96), (96, 192), (192, 288), (288, 320)]
    assert all(r.token_ids == () and len(r.chunk_hashes.hashes) == (r.num_tokens - r.token_offset) // CHUNK
               for r in saved), "each step ships the slots and 16 bytes a chunk of its new chunks only"
    assert all(r.namespace == "salt" for r in saved)


def test_scheduler_reads_the_proxys_disagg_spec_only_as_a_sender():
    params = {"disagg_spec": {"receiver_host": "127.0.0.1", "receiver_init_port": [7300]}}
    for role, expect in [("sender", True), ("receiver", False)]:
        extra = dict(pd_peer_host="127.0.0.1", pd_peer_init_port=7300) if role == "receiver" else {}
        side = scheduler(hit=0, enable_pd=True, pd_role=role, **extra)
        req = request(n=2 * CHUNK + 3, kv_transfer_params=params)
        side.get_num_new_matched_tokens(req, 0)
        side.update_state_after_alloc(req, None, 0)
        meta = side.build_connector_meta(output(new=[new_req(req, range(5))], scheduled={"r": 2 * CHUNK + 3}))
        sent = [r for r in meta.requests if r.disagg_spec is not None]
        assert bool(sent) == expect, role
        if expect:
            assert sent[0].disagg_spec.receiver_init_port == (7300,) and sent[0].num_tokens == 2 * CHUNK + 3
            assert all(r.disagg_spec is None for r in decode(side, req).requests), "sent once"
    bad = scheduler(hit=0, enable_pd=True, pd_role="sender")
    req = request(n=CHUNK, kv_transfer_params={"disagg_spec": {"receiver_host": ""}})
    bad.update_state_after_alloc(req, None, 0)
    meta = bad.build_connector_meta(output(new=[new_req(req, range(2))], scheduled={"r": CHUNK}))
    assert all(r.disagg_spec is None for r in meta.requests), \
        "a spec that cannot be read costs the transfer, not the request"



# ---- load or recompute: what the request asks, and what the workers time ---------------------------
def _with_params(req_id: str, params: dict):
    """A request whose kv_transfer_params (in its sampling params' extra_args, where vLLM keeps
    them) are `params`."""
    from types import SimpleNamespace

    return request(req_id, sampling_params=SimpleNamespace(extra_args={"kv_transfer_params": params}),
                   kv_transfer_params=params)


@pytest.mark.parametrize("value", [pytest.param(True, id="true"), pytest.param("true", id="string-true"),
                                   pytest.param("Yes", id="string-yes"), pytest.param(1, id="one")])
def test_a_request_that_asks_to_skip_the_load_matches_nothing_and_is_not_looked_up(value):
    side = scheduler(hit=3 * CHUNK)
    req = _with_params("skip", {"lmcache.skip_load": value})
    assert side.get_num_new_matched_tokens(req, 0) == (0, False)
    assert side.lookup_client.calls == [], "the lookup client was asked"
    side.update_state_after_alloc(req, None, 0)
    meta = side.build_connector_meta(output(new=[new_req(req, range(8))], scheduled={"skip": 4 * CHUNK}))
    (sent,) = meta.requests
    assert sent.load_spec is None or not sent.load_spec.can_load
    assert sent.save_spec.can_save, "it still saves what it computes"


@pytest.mark.parametrize("params", [pytest.param({"lmcache.skip_load": False}, id="false"),
                                    pytest.param({"lmcache.skip_load": "false"}, id="string-false"),
                                    pytest.param({"other": True}, id="not-asked")])
def test_a_request_that_does_not_ask_to_skip_is_looked_up(params):
    side = scheduler(hit=3 * CHUNK)
    assert side.get_num_new_matched_tokens(_with_params("r", params), 0) == (3 * CHUNK, False)
    assert len(side.lookup_client.calls) == 1


def test_the_metadata_carries_the_steps_scheduled_tokens():
    """The workers time each forward against the tokens it ran (step_timing.py): every request's."""
    side = scheduler(hit=0)
    b = request("b", n=2 * CHUNK)
    assert [m.num_scheduled_tokens for m in prefill(side, b, range(4), step=CHUNK)] == [CHUNK, CHUNK]
    a = request("a", n=3 * CHUNK)
    side.get_num_new_matched_tokens(a, 0)
    side.update_state_after_alloc(a, None, 0)
    b.all_token_ids.append(7)  # b decodes its first sampled token
    b.num_tokens += 1
    both = output(new=[new_req(a, range(4, 10))], cached=cached_step("b", 2 * CHUNK),
                  scheduled={"a": 3 * CHUNK, "b": 1})
    assert side.build_connector_meta(both).num_scheduled_tokens == 3 * CHUNK + 1, "a's prefill and b's decode"
    assert idle_step(side).num_scheduled_tokens == 0

# ---- holds: vLLM keeps a finished request's blocks while its saves run -----------------------------
def test_scheduler_holds_exactly_the_finished_requests_that_were_sent_a_save():
    side = scheduler(hit=0)
    saved, looked_up = request("saved", n=2 * CHUNK), request("waiting", n=2 * CHUNK)
    (meta,) = prefill(side, saved, range(4), step=2 * CHUNK)
    assert meta.requests[0].save_spec.can_save
    side.get_num_new_matched_tokens(looked_up, 0)          # aborted before it was ever scheduled
    assert side.request_finished(saved, [0, 1, 2, 3]) == (True, None)
    assert side.request_finished(looked_up, []) == (False, None)
    assert side.request_finished(saved, [0, 1, 2, 3]) == (False, None), "held once"

    out = output(preempted={"p2", "p1"})
    assert side.build_connector_meta(out).preempted_req_ids == ("p1", "p2")

    decoded = request("decoded", n=2 * CHUNK)
    prefill(side, decoded, range(4, 8), step=2 * CHUNK)
    assert decode(side, decoded).requests == (), "a decode step saves nothing"
    assert side.request_finished(decoded, [4, 5, 6, 7]) == (True, None), "its prefill's save may still run"

    layerwise = scheduler(hit=0, use_layerwise=True)   # its saves finish inside the forward
    req = request("lw", n=2 * CHUNK)
    prefill(layerwise, req, range(4), step=2 * CHUNK)
    assert layerwise.request_finished(req, [0, 1, 2, 3]) == (False, None)


@pytest.mark.parametrize("finished_first", [False, True], ids=["request_finished-first", "finished_req_ids-first"])
def test_holds_do_not_depend_on_the_order_vllm_reports_the_end_in(finished_first):
    """vLLM calls request_finished, then lists the id in the next step's finished_req_ids; a
    request sent a save is held, one that was not is freed, and both states end, whichever of the
    two comes first."""
    side = scheduler(hit=0)
    saved, unsaved = request("saved", n=2 * CHUNK), request("unsaved", n=CHUNK - 4)  # no whole chunk
    prefill(side, saved, range(4), step=2 * CHUNK)
    prefill(side, unsaved, range(4, 6), step=CHUNK)
    if finished_first:
        idle_step(side, finished={"saved", "unsaved"})
    held = side.request_finished(saved, [0, 1, 2, 3]), side.request_finished(unsaved, [4, 5])
    if not finished_first:
        idle_step(side, finished={"saved", "unsaved"})
    assert held == ((True, None), (False, None))
    assert side.requests == {}


# ---- a request's state ends with the request, whatever way it ends ------------------------------
def _finish(side, req, *, finished_step: bool = True):
    """vLLM frees the request: request_finished, then the id in the next step's finished_req_ids."""
    side.request_finished(req, [])
    if finished_step:
        idle_step(side, finished={req.request_id})


def test_a_finished_request_is_forgotten():
    side = scheduler(hit=CHUNK)
    req = request()
    prefill(side, req, range(8), step=CHUNK)
    decode(side, req)
    assert set(side.requests) == {"r"}
    _finish(side, req)
    assert side.requests == {}


@pytest.mark.parametrize("hit", [0, 2 * CHUNK, None], ids=["miss", "hit", "lookup-pending"])
def test_a_request_aborted_before_it_was_scheduled_is_forgotten(hit):
    side = scheduler(hit=hit)
    req = request()
    side.get_num_new_matched_tokens(req, 0)
    if hit is not None:  # blocks allocated, then aborted before its first step
        side.update_state_after_alloc(req, None, hit)
    _finish(side, req)
    assert side.requests == {}


def test_a_request_preempted_then_resumed_then_finished_is_forgotten():
    side = scheduler(hit=0)
    req = request(n=3 * CHUNK)
    prefill(side, req, range(6), step=3 * CHUNK)
    decode(side, req)
    idle_step(side)  # preempted: vLLM freed its blocks and put it back to wait
    assert side.build_connector_meta(output(preempted={"r"})).preempted_req_ids == ("r",)
    side.lookup_client.hit = 3 * CHUNK  # its saves are found on resumption
    assert side.get_num_new_matched_tokens(req, 0) == (3 * CHUNK, False)
    side.update_state_after_alloc(req, None, 3 * CHUNK)
    meta = side.build_connector_meta(output(cached=cached_step("r", 3 * CHUNK, range(10, 17), resumed=True),
                                            scheduled={"r": 1}))
    (resumed,) = meta.requests
    assert resumed.load_spec == LoadSpec(0, 3 * CHUNK, True) and resumed.slots(0, CHUNK)[0] == 10 * BLOCK, \
        "the resumed request loads into its new blocks"
    assert not resumed.save_spec.can_save
    assert side.request_finished(req, []) == (True, None), "held: it was sent a save before the preemption"
    idle_step(side, finished={"r"})
    assert side.requests == {}


def test_a_request_preempted_then_aborted_while_waiting_is_forgotten():
    side = scheduler(hit=0)
    req = request(n=3 * CHUNK)
    prefill(side, req, range(6), step=3 * CHUNK)
    side.build_connector_meta(output(preempted={"r"}))
    side.lookup_client.hit = None
    side.get_num_new_matched_tokens(req, 0)
    _finish(side, req)
    assert side.requests == {} and idle_step(side).lookup_requests_in_step == ()


def test_a_request_vllm_takes_back_after_a_failed_load_saves_its_chunks_again_as_recomputed():
    """The worker reported chunk 1's blocks as not loaded: vLLM keeps chunk 0 and computes the rest
    again (kv_load_failure_policy recompute). The tracker follows it back: the next step saves the
    chunks from 1 on as vLLM computes them now (none was saved in the failed step), from the
    request's own blocks, and loads nothing."""
    side = scheduler(hit=3 * CHUNK)
    req = request(n=4 * CHUNK + 10)
    assert side.get_num_new_matched_tokens(req, 0) == (3 * CHUNK, False)
    side.update_state_after_alloc(req, None, 3 * CHUNK)
    first = side.build_connector_meta(output(new=[new_req(req, range(9), 3 * CHUNK)], scheduled={"r": CHUNK + 10}))
    (loads,) = first.requests
    assert loads.load_spec.can_load and loads.save_spec.skip_leading_tokens == 3 * CHUNK
    # vLLM: blocks 2.. did not load; num_computed_tokens back to chunk 0's end, the rest scheduled again
    again = side.build_connector_meta(output(cached=cached_step("r", CHUNK), scheduled={"r": 3 * CHUNK + 10}))
    (recomputed,) = again.requests
    assert recomputed.load_spec is None
    assert recomputed.save_spec == SaveSpec(CHUNK, True) and recomputed.num_tokens == 4 * CHUNK
    assert recomputed.slots(CHUNK, 4 * CHUNK).tolist() == list(range(CHUNK, 4 * CHUNK)), "the request's own blocks"
    assert recomputed.chunk_hashes.hashes == TokenChain(CHUNK).chunk_hashes(req.prompt_token_ids[:4 * CHUNK]
                                                                            ).since(CHUNK).hashes


def test_request_finished_for_a_request_never_seen_holds_nothing_and_keeps_nothing():
    side = scheduler(hit=0, role="kv_producer")  # a producer never looks up
    req = request()
    assert side.get_num_new_matched_tokens(req, 0) == (0, False)
    assert side.request_finished(req, []) == (False, None)
    assert side.requests == {}


def test_many_requests_leave_no_state_behind():
    side = scheduler(hit=CHUNK)
    for i in range(50):
        req = request(f"r{i}", n=2 * CHUNK + i)
        prefill(side, req, range(2 * CHUNK // BLOCK + 4), step=CHUNK)
        _finish(side, req, finished_step=i % 2 == 0)
    assert side.requests == {}


# ---- without vLLM ---------------------------------------------------------------------------------
def test_the_scheduler_side_imports_and_runs_without_vllm():
    """The scheduler side and its vocabulary need no vLLM (its tests run on a host without it):
    with `vllm` blocked, import them and build a step."""
    code = """
import sys
sys.modules["vllm"] = None  # `import vllm` (and any submodule) raises ImportError
sys.path.insert(0, sys.argv[1])
from scheduler_stubs import new_req, output, request, scheduler
side = scheduler(hit=32)
req = request()
assert side.get_num_new_matched_tokens(req, 0) == (32, False)
side.update_state_after_alloc(req, None, 32)
meta = side.build_connector_meta(output(new=[new_req(req, range(8), 32)], scheduled={"r": 96}))
assert meta.requests[0].load_spec.can_load
assert not any(m == "vllm" or m.startswith("vllm.") for m in sys.modules if sys.modules[m] is not None)
print("ok")
"""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-c", code, str(Path(__file__).parent)], capture_output=True, text=True,
                         timeout=120, env=env, cwd=ROOT)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]
