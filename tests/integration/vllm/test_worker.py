"""The connector's worker side (integration/vllm/worker.py and its parts), without vLLM: stub
engines where a test needs a failure or a slow store on cue, the real engine where it needs the
engine's behaviour. What the worker passes on (namespace, adapter, multimodal spans, the token
chain's hashes), how one request's failure stays that request's, when saves run and when vLLM may
reuse a request's blocks, and the offload server's stores."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import torch
from worker_stubs import BLOCK, CHUNK, GEO, GatedEngine, LayerwiseLoads, StubEngine
from worker_stubs import config as _config
from worker_stubs import real_engine as _real_engine
from worker_stubs import req as _req
from worker_stubs import save as _save
from worker_stubs import worker as _worker

from lmcache_triton.integration.vllm.specs import LMCacheConnectorMetadata, LoadSpec, ReqMeta, SaveSpec
from lmcache_triton.keys import TokenChain


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
    side.load_errors.record(req, torch.ones(20, dtype=torch.bool), torch.zeros(3, dtype=torch.bool))
    assert side.get_block_ids_with_load_errors() == {0}


def test_verify_runs_before_the_save():
    meta = LMCacheConnectorMetadata(requests=[_req("a", 1000, verify_tokens=CHUNK)])
    engine = StubEngine()
    _save(_worker(meta, engine))
    assert [c[0] for c in engine.calls] == ["verify", "store"]
    assert len(engine.calls[0][1][0]) == CHUNK


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
    assert side.requests.loads() == []
    assert side.get_block_ids_with_load_errors() == set(range(CHUNK // BLOCK, 2 * CHUNK // BLOCK)), \
        "the second chunk did not load: its blocks are reported for vLLM to recompute"


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
    assert side.saving.saver.wait(timeout=30)
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
    assert side.saving.saver.idle("a") and [c[0] for c in engine.calls] == ["store"], \
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
        assert side.saving.saver.wait(timeout=30)
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
        side.saving.saver.close(timeout=5)
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



# ---- the worker side runs without vLLM (issue #24) ----------------------------------------------------
_IMPORT_WITHOUT_VLLM = """
import sys
sys.modules["vllm"] = None  # any import of vllm (or of vllm.x) raises ImportError
import lmcache_triton.integration.vllm.worker
from lmcache_triton.integration.vllm import inflight, loading, offload_store, paged, pd, saving, verification
import lmcache_triton.blend.mode
print("imported")
"""


def test_the_worker_side_imports_without_vllm():
    """vLLM is asked only inside what runs under vLLM (register_kv_caches): the worker side and its
    parts import, and are tested, where vLLM is not installed."""
    out = subprocess.run([sys.executable, "-c", _IMPORT_WITHOUT_VLLM], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "imported", out.stderr[-3000:]


# ---- one object per request in flight ----------------------------------------------------------------
def test_a_request_is_forgotten_once_its_step_and_its_saves_are_over():
    """The worker keeps no state of a request past what it must: a load-only request's entry goes
    with its step, a saving one's once vLLM finished it and its saves are done."""
    meta = LMCacheConnectorMetadata(requests=[_req("saves", 1000), _req("loads", 2000, save_from=None, load=CHUNK)])
    engine = GatedEngine()
    side = _worker(meta, engine)
    side.start_load_kv(None)
    side.wait_for_save()
    assert "loads" not in side.requests and "saves" in side.requests, "the hold of a queued save is kept"
    assert side.get_finished(set()) is None and "saves" in side.requests
    engine.gate.set()
    assert side.saving.saver.wait(timeout=30)
    assert side.get_finished({"saves"}) == {"saves"}
    assert len(side.requests) == 0, "a finished request's state outlived it"


# ---- a preempted request's saves read its blocks before the next step (issue #24 bug 3) ----------------
def test_binding_a_steps_metadata_waits_for_the_preempted_requests_saves(clean_lmcache_env):
    """Through vLLM's connector class: vLLM binds the step's metadata, then runs its loads and
    forward on blocks it may have taken from a request it preempted. Binding must wait for that
    request's queued saves (the step's preamble), or they read another request's KV."""
    import threading

    pytest.importorskip("vllm", reason="the connector class is vLLM's KV connector")
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from worker_stubs import vllm_config

    from lmcache_triton.integration.vllm.connector import LMCacheTritonConnectorV1

    connector = LMCacheTritonConnectorV1(vllm_config(extra={"lmcache.chunk_size": CHUNK}), KVConnectorRole.WORKER)
    try:
        engine = GatedEngine()
        connector._worker.engine, connector._worker.kvcaches = engine, [torch.zeros(1)]
        connector.bind_connector_metadata(LMCacheConnectorMetadata(requests=[_req("a", 1000)]))
        connector.wait_for_save()  # a's save is queued, held at the gate (a slow copy)
        connector.clear_connector_metadata()
        threading.Timer(0.3, engine.gate.set).start()
        connector.bind_connector_metadata(LMCacheConnectorMetadata(preempted_req_ids=["a"]))  # vLLM freed a's blocks
        assert connector._worker.saving.idle("a") and [c[0] for c in engine.calls] == ["store"], \
            "the step's metadata was bound while a's save still had to read its freed blocks"
    finally:
        engine.gate.set()
        connector.shutdown()


# ---- a load that fails midway or loads part is reported, never a success (issue #24 bug 4) --------------
def test_a_layerwise_load_that_fails_midway_reports_every_block_it_should_have_loaded():
    engine = LayerwiseLoads(num_layers=4, loaded=2 * CHUNK, fail_at=2)
    req = _req("a", 0, 2 * CHUNK, save_from=None, load=2 * CHUNK)
    side = _worker(LMCacheConnectorMetadata(requests=[req]), engine)
    side.start_load_kv(None)
    for layer in range(4):
        side.wait_for_layer_load(f"layer.{layer}")
    side.wait_for_save()
    assert side.get_block_ids_with_load_errors() == set(range(2 * CHUNK // BLOCK)), \
        "layers 2 and 3 never loaded: vLLM must recompute the request's blocks"
    assert side.requests.loads() == []


def _stored_prompt(closing, layerwise: bool, n: int):
    """A real engine holding tokens [0, n) of a prompt, and vLLM's CPU caches the KV came from."""
    from lmcache_triton.tools.testing import make_kv_caches

    engine = _real_engine(closing, layerwise)
    src = make_kv_caches("vllm_cpu", generator=torch.Generator().manual_seed(0), **GEO)
    assert engine.store(list(range(n)), kvcaches=src, slot_mapping=torch.arange(n)) == n
    return engine


def _load_through_the_worker(engine, n: int, expect: int):
    """The worker loads `expect` tokens of the prompt (what the scheduler was told) into blocks 8..;
    returns the blocks it reports as not loaded."""
    from lmcache_triton.tools.testing import make_kv_caches

    req = ReqMeta(req_id="r", token_ids=list(range(n)), slot_mapping=torch.arange(8 * BLOCK, 8 * BLOCK + n),
                  load_spec=LoadSpec(0, expect, True))
    dst = make_kv_caches("vllm_cpu", fill=0, **GEO)
    side = _worker(LMCacheConnectorMetadata(requests=[req]), engine, caches=dst)
    side.start_load_kv(None)
    for layer in range(len(dst) if engine.layerwise else 0):
        side.wait_for_layer_load(f"layer.{layer}")
    side.wait_for_save()
    assert engine.storage_manager.cpu.num_held == 0, "the load left chunks held"
    return side.get_block_ids_with_load_errors()


@pytest.mark.parametrize("layerwise", [False, True], ids=["all-layers", "layerwise"])
def test_a_partial_load_reports_the_blocks_of_the_chunks_it_did_not_find(closing, layerwise):
    """The scheduler was told 3 chunks; the tier lost the third by the time the worker loads: its
    blocks are reported, the first two chunks' are not."""
    engine = _stored_prompt(closing, layerwise, 2 * CHUNK)
    assert _load_through_the_worker(engine, 3 * CHUNK, expect=3 * CHUNK) == set(range(12, 14))


def test_a_real_layerwise_load_whose_copy_fails_at_layer_1_reports_the_request(closing):
    """The engine's retrieve_layer raises at its second step (a kernel or device error): every
    block of the load is reported (layer 1 never landed), and nothing stays held."""
    engine = _stored_prompt(closing, True, 2 * CHUNK)
    conn = engine.gpu_connector
    real = conn.batched_to_gpu

    def fails_after_one_layer(objs, starts, ends, target):
        inner = real(objs, starts, ends, target)
        next(inner)
        yield
        raise RuntimeError("layer 1's copy failed")

    conn.batched_to_gpu = fails_after_one_layer
    assert _load_through_the_worker(engine, 2 * CHUNK, expect=2 * CHUNK) == set(range(8, 12))


# ---- each PD receiver rank listens on its own port (issue #24 bug 5) -----------------------------------
def _set_up(closing, rank: int, engine_id: str, caches, **cfg):
    from worker_stubs import Steps, config, vllm_config

    from lmcache_triton.integration.vllm.worker import WorkerSide

    role = "kv_consumer" if cfg.get("pd_role") == "receiver" else "kv_producer"
    side = WorkerSide(vllm_config(role, engine_id=engine_id, tp=2), config(**cfg), Steps(LMCacheConnectorMetadata()))
    closing.append(side)
    nb, h, bs2, hs = caches[0].shape  # vLLM's CPU backend hands each layer as [blocks, heads, block_size, 2 * head]
    side.set_up({f"layer.{i}": c.view(nb, h, bs2 // 2, 2 * hs) for i, c in enumerate(caches)}, rank=rank,
                cpu_backend=True, blocks_opaque=False)
    return side


def test_the_worker_of_rank_1_listens_on_the_base_port_plus_1_and_the_sender_of_rank_1_reaches_it(
        closing, free_port, clean_lmcache_env):
    """A decoder with TP 2 given one base port: its rank-1 worker listens on base + 1, where the
    prefiller's rank-1 worker sends (each rank moves its own heads). Both worker sides are built
    as vLLM's register_kv_caches builds them, with real engines, and one prompt crosses."""
    from lmcache_triton.integration.vllm.specs import DisaggSpec
    from lmcache_triton.tools.testing import make_kv_caches

    base = free_port() - 1
    src = make_kv_caches("vllm_cpu", generator=torch.Generator().manual_seed(1), **GEO)
    decoder = _set_up(closing, 1, "decoder", make_kv_caches("vllm_cpu", fill=0, **GEO), enable_pd=True,
                      pd_role="receiver", pd_peer_host="127.0.0.1", pd_peer_init_port=(base,))
    assert decoder.pd_receiver.endpoint.endswith(f":{base + 1}"), decoder.pd_receiver.endpoint
    prefiller = _set_up(closing, 1, "prefiller", src, enable_pd=True, pd_role="sender")
    n = 2 * CHUNK + 5
    spec = DisaggSpec("r", receiver_host="127.0.0.1", receiver_init_port=(base,), is_last_prefill=True)
    prefiller.parent.meta = LMCacheConnectorMetadata(requests=[_req("r", 100, n=n, disagg_spec=spec)])
    prefiller.wait_for_save()
    assert decoder.engine.lookup(list(range(100, 100 + n))) == n, "the decoder's rank 1 holds the prompt"
