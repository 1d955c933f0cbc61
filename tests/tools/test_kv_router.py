"""The KV-aware proxy's routing core: per-backend block indexes built from event batches encoded as
vLLM encodes them (vLLM's msgspec classes and encoder, decoded by the proxy's decoder), the longest
cached prefix, the load tie-break and round-robin. Where vLLM is importable, the batches carry
vLLM's real block hashes (its hash function and NONE_HASH), as a backend's would."""

from __future__ import annotations

import pytest

from lmcache_triton.tools.kv_events import decode_batch
from lmcache_triton.tools.kv_router import BackendIndex, KVRouter

kv_events = pytest.importorskip("vllm.distributed.kv_events")
BS = 4  # block size


def vllm_hashes(tokens: list[int], extra_first: tuple | None = None) -> list[bytes]:
    """The block hash chain vLLM computes for a prompt (sha256_cbor, its default, and its NONE_HASH)."""
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core import kv_cache_utils as kcu

    fn = get_hash_fn_by_name("sha256_cbor")
    kcu.init_none_hash(fn)
    out, parent = [], None
    for i in range(len(tokens) // BS):
        extra = (("cache_salt", extra_first[0]),) if extra_first and i == 0 else None
        parent = kcu.hash_block_tokens(fn, parent, tokens[i * BS:(i + 1) * BS], extra)
        out.append(bytes(parent))
    return out


def batch(*events) -> list:
    import msgspec

    return decode_batch(msgspec.msgpack.Encoder().encode(kv_events.KVEventBatch(ts=0.0, events=list(events))))


def stored(tokens, *, first_block=0, medium="GPU", salt=None, with_tokens=True):
    """vLLM's BlockStored for blocks [first_block, len(tokens) // BS) of a prompt, as vLLM sends it."""
    hashes = vllm_hashes(tokens, (salt,) if salt else None)
    blocks = range(first_block, len(tokens) // BS)
    extra = [((salt,) if salt and i == 0 else None) for i in blocks]
    return kv_events.BlockStored(
        block_hashes=[hashes[i] for i in blocks], parent_block_hash=hashes[first_block - 1] if first_block else None,
        token_ids=list(tokens[first_block * BS:len(tokens) // BS * BS]) if with_tokens else [],
        block_size=BS, lora_id=None, medium=medium, lora_name=None, extra_keys=extra)


def removed(tokens, blocks, medium="GPU"):
    hashes = vllm_hashes(tokens)
    return kv_events.BlockRemoved(block_hashes=[hashes[i] for i in blocks], medium=medium)


A = list(range(100, 124))           # 6 blocks
B = list(range(200, 224))


def test_the_longest_prefix_is_found_block_by_block():
    ix = BackendIndex()
    ix.apply(batch(stored(A[:8])))                    # blocks 0-1
    ix.apply(batch(stored(A[:16], first_block=2)))    # blocks 2-3, after their parent
    assert ix.matched_blocks(A) == 4
    assert ix.matched_blocks(A[:10]) == 2             # a partial last block never matches
    assert ix.matched_blocks(A[:4] + B) == 1          # diverges after the first block
    assert ix.matched_blocks(B) == 0
    assert ix.block_size == BS


def test_a_block_whose_parent_differs_does_not_match():
    """The same tokens under another prefix are another block (vLLM's chain hash)."""
    ix = BackendIndex()
    ix.apply(batch(stored(B[:4] + A[4:12])))
    assert ix.matched_blocks(A[:12]) == 0


def test_removal_from_the_gpu_keeps_a_cpu_copy_and_removing_both_forgets():
    ix = BackendIndex()
    ix.apply(batch(stored(A[:16]), stored(A[:16], medium="CPU")))
    ix.apply(batch(removed(A, [2, 3], "GPU")))
    assert ix.matched_blocks(A) == 4, "the CPU tier still holds blocks 2-3"
    ix.apply(batch(removed(A, [3], "CPU")))
    assert ix.matched_blocks(A) == 3
    assert ix.summary()["blocks"] == 3


def test_a_block_stored_twice_needs_two_removals():
    ix = BackendIndex()
    ix.apply(batch(stored(A[:8]), stored(A[:8])))
    ix.apply(batch(removed(A, [1])))
    assert ix.matched_blocks(A) == 2
    ix.apply(batch(removed(A, [1])))
    assert ix.matched_blocks(A) == 1


def test_a_removal_of_an_unknown_block_is_harmless():
    ix = BackendIndex()
    ix.apply(batch(removed(A, [0, 1]), stored(A[:8])))
    assert ix.matched_blocks(A) == 2


def test_all_blocks_cleared_drops_the_gpu_pool_only():
    ix = BackendIndex()
    ix.apply(batch(stored(A[:16]), stored(B[:8], medium="STORAGE")))
    ix.apply(batch(kv_events.AllBlocksCleared()))
    assert ix.matched_blocks(A) == 0 and ix.matched_blocks(B) == 2


def test_a_restart_drops_what_lived_in_the_process():
    ix = BackendIndex()
    ix.apply(batch(stored(A[:8]), stored(A[:8], medium="CPU"), stored(B[:8], medium="STORAGE")))
    ix.apply([], restarted=True)
    assert ix.matched_blocks(A) == 0 and ix.matched_blocks(B) == 2


def test_a_tier_that_sends_no_tokens_counts_once_the_hash_was_learned():
    """A connector tier's event may carry hashes only: it keeps a block walkable after the GPU copy
    is evicted, as long as the hash was learned with its tokens."""
    ix = BackendIndex()
    ix.apply(batch(stored(A[:8]), stored(A[:8], medium="CPU", with_tokens=False)))
    ix.apply(batch(removed(A, [0, 1], "GPU")))
    assert ix.matched_blocks(A) == 2
    unseen = BackendIndex()
    unseen.apply(batch(stored(A[:8], medium="CPU", with_tokens=False)))
    assert unseen.matched_blocks(A) == 0 and unseen.summary()["blocks"] == 2


def test_cache_salt_matches_only_the_same_salt():
    ix = BackendIndex()
    ix.apply(batch(stored(A[:8], salt="s1")))
    assert ix.matched_blocks(A, "s1") == 2
    assert ix.matched_blocks(A, "s2") == 0 and ix.matched_blocks(A) == 0


def test_int_block_hashes_work_alike():
    """VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES: 64-bit ints instead of bytes."""
    ix = BackendIndex()
    ix.apply(batch(kv_events.BlockStored(block_hashes=[11, 12], parent_block_hash=None, token_ids=A[:8],
                                         block_size=BS, lora_id=None, medium="GPU", lora_name=None)))
    assert ix.matched_blocks(A) == 2


def router(n: int = 3) -> KVRouter:
    return KVRouter([BackendIndex() for _ in range(n)])


def test_the_backend_with_the_longest_prefix_wins_whatever_its_load():
    r = router()
    r.indexes[0].apply(batch(stored(A[:8])))
    r.indexes[2].apply(batch(stored(A[:16])))
    r.loads[2].in_flight = 5
    d = r.choose(A)
    assert (d.backend, d.matched_tokens, d.kv_routed) == (2, 16, True)
    assert (r.kv_routed, r.round_robin, r.loads[2].kv_routed) == (1, 0, 1)


def test_equal_prefixes_go_to_the_least_loaded():
    r = router()
    for i in (0, 1):
        r.indexes[i].apply(batch(stored(A[:8])))
    r.loads[0].in_flight = 2
    assert r.choose(A).backend == 1
    r.loads[1].in_flight = 3
    assert r.choose(A).backend == 0


def test_nothing_cached_goes_round_robin_and_kv_routing_does_not_skip_a_turn():
    r = router()
    r.indexes[1].apply(batch(stored(A[:8])))
    picks = [r.choose(B).backend, r.choose(A).backend, r.choose(B).backend, r.choose(None).backend,
             r.choose(B[:3]).backend]
    assert picks == [0, 1, 1, 2, 0]
    assert (r.kv_routed, r.round_robin) == (1, 4)


def test_a_silent_backend_is_still_reached_by_round_robin():
    r = router(2)
    r.indexes[0].apply(batch(stored(A[:8])))
    assert [r.choose(B).backend for _ in range(4)] == [0, 1, 0, 1]


def test_the_router_needs_a_backend():
    with pytest.raises(ValueError, match="at least one backend"):
        KVRouter([])
