"""Requests the connector leaves to vLLM (integration/vllm/declines.py), as the scheduler side
decides them: a sliding-window model's requests longer than the window, and multimodal inputs the
keys cannot name; and, with vLLM's own Request and MultiModalFeatureSpec, that the same placeholder
token ids with another image are another key."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from scheduler_stubs import CHUNK, new_req, output, request, scheduler, vllm_request

from lmcache_triton.keys import TokenChain


def _first_step(side, req):
    side.update_state_after_alloc(req, None, 0)
    return side.build_connector_meta(output(new=[new_req(req, range(8))], scheduled={req.request_id: 4 * CHUNK}))


# ---- sliding window: vLLM frees the blocks that leave it ----------------------------------------------
@pytest.mark.parametrize("role", ["kv_both", "kv_producer"])
def test_a_request_longer_than_the_sliding_window_is_neither_loaded_nor_saved(role):
    """Prompt plus max_tokens past the window: vLLM frees the request's first blocks while it runs
    (and hands them to others) before its saves read them, so nothing of it is loaded or saved; a
    PD producer, which never loads, does not save it either."""
    side = scheduler(hit=3 * CHUNK, role=role)
    side.sliding_window = 4 * CHUNK + 8
    req = request(n=4 * CHUNK, max_tokens=9)
    assert side.get_num_new_matched_tokens(req, 0) == (0, False)
    assert side.lookup_client.calls == []
    meta = _first_step(side, req)
    assert meta.requests == (), "nothing saved"
    assert meta.declined == ((("sliding_window", 4 * CHUNK),) if role == "kv_both" else ())


def test_a_request_within_the_sliding_window_is_served_as_with_full_attention():
    side = scheduler(hit=3 * CHUNK)
    side.sliding_window = 4 * CHUNK + 8
    req = request(n=4 * CHUNK, max_tokens=8)  # its last token is the window's last: no block is ever freed
    assert side.get_num_new_matched_tokens(req, 0) == (3 * CHUNK, False)
    side.update_state_after_alloc(req, None, 3 * CHUNK)
    meta = side.build_connector_meta(output(new=[new_req(req, range(8), 3 * CHUNK)], scheduled={"r": CHUNK}))
    (sent,) = meta.requests
    assert sent.load_spec.can_load and sent.save_spec.can_save and meta.declined == ()


# ---- multimodal inputs ------------------------------------------------------------------------------------
@pytest.mark.parametrize("feature", [
    SimpleNamespace(identifier=None, mm_position=SimpleNamespace(offset=5, length=3)),
    SimpleNamespace(identifier="", mm_position=SimpleNamespace(offset=5, length=3)),
    SimpleNamespace(identifier="img", mm_position=None),
], ids=["no-hash", "empty-hash", "no-position"])
def test_a_multimodal_input_the_keys_cannot_name_is_neither_loaded_nor_saved(feature):
    side = scheduler(hit=3 * CHUNK)
    req = request(mm_features=[SimpleNamespace(identifier="other", mm_position=SimpleNamespace(offset=0, length=2)),
                               feature])
    assert side.get_num_new_matched_tokens(req, 0) == (0, False)
    assert side.lookup_client.calls == []
    meta = _first_step(side, req)
    assert meta.requests == () and meta.declined == (("multimodal", 4 * CHUNK),)


def test_the_same_placeholder_tokens_with_another_image_are_other_keys():
    """vLLM's Requests with identical token ids (the placeholder ids included) and two images: the
    lookups share the chunk before the placeholder and nothing from the placeholder's chunk on."""
    pytest.importorskip("vllm", reason="vLLM's Request and MultiModalFeatureSpec")
    prompt = [7] * CHUNK + [9] * (3 * CHUNK)  # the image's placeholder ids at [CHUNK + 8, CHUNK + 40)
    side = scheduler(hit=0)
    for req_id, image in (("a", "sha-of-image-a"), ("b", "sha-of-image-b"), ("a2", "sha-of-image-a")):
        side.get_num_new_matched_tokens(vllm_request(req_id, prompt, image, CHUNK + 8, 32), 0)
    a, b, a2 = (call["chunk_hashes"] for call in side.lookup_client.calls)
    assert a == a2, "the same image: the same keys"
    assert a.hashes[0] == b.hashes[0], "the chunk before the image does not depend on it"
    assert all(x != y for x, y in zip(a.hashes[1:], b.hashes[1:])), "every chunk from the image's on differs"
    assert a == TokenChain(CHUNK, [(CHUNK + 8, 32, "sha-of-image-a")]).chunk_hashes(prompt)


def test_vllms_request_within_a_sliding_window_is_measured_by_its_prompt_and_max_tokens():
    pytest.importorskip("vllm", reason="vLLM's Request")
    side = scheduler(hit=0)
    side.sliding_window = 4 * CHUNK + 8
    prompt = list(range(4 * CHUNK))
    side.get_num_new_matched_tokens(vllm_request("fits", prompt, "img", 0, 4, max_tokens=8), 0)
    side.get_num_new_matched_tokens(vllm_request("past", prompt, "img", 0, 4, max_tokens=9), 0)
    assert [c["id"] for c in side.lookup_client.calls] == ["fits"]
    assert side.requests["past"].declined == "sliding_window"
