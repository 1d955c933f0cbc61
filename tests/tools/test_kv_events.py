"""vLLM's KV event batches decoded as the KV-aware proxy reads them: payloads encoded by vLLM's own
msgspec classes and encoder, and a live stream from vLLM's own ZMQ publisher."""

from __future__ import annotations

import logging
import time

import pytest

from lmcache_triton.tools.kv_events import (AllBlocksCleared, BlockRemoved, BlockStored, EventSubscriber,
                                            MalformedBatch, decode_batch)

kv_events = pytest.importorskip("vllm.distributed.kv_events")


def encode(*events, ts: float = 1.0) -> bytes:
    """A payload exactly as vLLM's ZmqEventPublisher sends it."""
    import msgspec

    return msgspec.msgpack.Encoder().encode(kv_events.KVEventBatch(ts=ts, events=list(events)))


def stored(hashes, tokens, *, parent=None, block_size=4, medium="GPU", extra=None):
    return kv_events.BlockStored(block_hashes=list(hashes), parent_block_hash=parent, token_ids=list(tokens),
                                 block_size=block_size, lora_id=None, medium=medium, lora_name=None,
                                 extra_keys=extra)


def test_every_event_type_decodes_with_its_fields():
    h0, h1 = b"\x01" * 32, b"\x02" * 32
    payload = encode(stored([h0, h1], range(8), extra=[("salt",), None]),
                     kv_events.BlockRemoved(block_hashes=[h1], medium="CPU"),
                     kv_events.AllBlocksCleared(),
                     stored([7], [1, 2, 3, 4], parent=5, medium=None))  # VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES
    assert decode_batch(payload) == [
        BlockStored((h0, h1), None, tuple(range(8)), 4, "GPU", (("salt",), None)),
        BlockRemoved((h1,), "CPU"),
        AllBlocksCleared(),
        BlockStored((7,), 5, (1, 2, 3, 4), 4, None, None),
    ]


def test_fields_vllm_added_later_do_not_matter():
    """vLLM 0.32's group_idx, locality, ownership, session_id: decoded past, not needed."""
    e = stored([b"h"], [1, 2, 3, 4])
    e.group_idx, e.locality, e.session_id = 1, "REMOTE", "s"
    assert decode_batch(encode(e)) == [BlockStored((b"h",), None, (1, 2, 3, 4), 4, "GPU", None)]


@pytest.mark.parametrize("payload", [
    pytest.param(b"\xc1", id="not-msgpack"),
    pytest.param(b"\x93\xcb\x00\x00\x00\x00\x00\x00\x00\x00\xc0\xc0", id="events-not-a-list"),
    pytest.param(None, id="stored-without-block-size"),
    pytest.param(b"", id="empty"),
])
def test_a_malformed_payload_is_a_clear_error(payload):
    if payload is None:
        import msgspec

        payload = msgspec.msgpack.encode([1.0, [{"type": "BlockStored", "block_hashes": [b"h"]}], None])
    with pytest.raises(MalformedBatch):
        decode_batch(payload)


def test_an_unknown_event_type_is_skipped_and_the_rest_kept():
    import msgspec

    payload = msgspec.msgpack.encode([1.0, [{"type": "BlockPinned", "x": 1}, {"type": "AllBlocksCleared"}], None])
    assert decode_batch(payload) == [AllBlocksCleared()]


def test_a_malformed_batch_is_logged_and_skipped_the_next_one_counts(caplog):
    got = []
    sub = EventSubscriber("tcp://127.0.0.1:1", lambda events, restarted: got.append((events, restarted)))
    with caplog.at_level(logging.WARNING, logger="lmcache_triton.proxy"):
        sub.handle([b"kv-events", (0).to_bytes(8, "big"), b"garbage"])
        sub.handle([b"kv-events", b"\x00"])
    assert sub.stats.malformed == 2 and not got
    assert "ignored a malformed KV event batch from tcp://127.0.0.1:1" in caplog.text
    sub.handle([b"kv-events", (1).to_bytes(8, "big"), encode(kv_events.AllBlocksCleared())])
    assert got == [([AllBlocksCleared()], False)] and sub.stats.batches == 1


def test_sequence_numbers_tell_gaps_and_restarts():
    got = []
    sub = EventSubscriber("tcp://127.0.0.1:1", lambda events, restarted: got.append(restarted))
    for seq in (0, 1, 4, 0):
        sub.handle([b"", seq.to_bytes(8, "big"), encode()])
    assert got == [False, False, False, True]
    assert (sub.stats.gaps, sub.stats.restarts, sub.stats.last_seq) == (2, 1, 0)


def test_a_live_stream_from_vllms_own_publisher(free_port):
    """vLLM's ZmqEventPublisher binds, our subscriber connects and receives every batch in order."""
    port = free_port()
    got = []
    sub = EventSubscriber(f"tcp://127.0.0.1:{port}", lambda events, restarted: got.extend(events)).start()
    pub = kv_events.ZmqEventPublisher(0, endpoint=f"tcp://*:{port}", topic="kv-events")
    try:
        deadline = time.monotonic() + 10
        n = 0
        while not got and time.monotonic() < deadline:  # a SUB joins late: the first batches may be dropped
            pub.publish(kv_events.KVEventBatch(ts=time.time(), events=[stored([n], [1, 2, 3, 4])]))
            n += 1
            time.sleep(0.05)
        assert got, "no batch arrived within 10 s"
        first = got[0].block_hashes[0]
        pub.publish(kv_events.KVEventBatch(ts=time.time(), events=[kv_events.BlockRemoved(block_hashes=[first],
                                                                                          medium="GPU")]))
        while BlockRemoved((first,), "GPU") not in got and time.monotonic() < deadline:
            time.sleep(0.02)
        assert got[-1] == BlockRemoved((first,), "GPU")
        assert sub.stats.gaps == 0 and sub.stats.malformed == 0
    finally:
        pub.shutdown()
        sub.close()
