import subprocess
import sys

import numpy as np
import pytest
import torch

from lmcache_triton.metadata import LMCacheEngineMetadata
from lmcache_triton.engine.token_database import ChunkedTokenDatabase
from lmcache_triton.keys import CacheEngineKey, KeyScope


def _db(chunk_size=4, save_unfull_chunk=False, **meta):
    m = dict(model_name="org/model-7b", world_size=2, worker_id=1, kv_dtype=torch.bfloat16,
             kv_shape=(2, 2, chunk_size, 2, 32))
    m.update(meta)
    return ChunkedTokenDatabase(chunk_size, LMCacheEngineMetadata(**m), save_unfull_chunk=save_unfull_chunk)


def test_chunks_and_partial_tail():
    tokens = torch.arange(10)
    assert [(s, e) for s, e, _ in _db().process_tokens(tokens)] == [(0, 4), (4, 8)]
    assert [(s, e) for s, e, _ in _db(save_unfull_chunk=True).process_tokens(tokens)] == [(0, 4), (4, 8), (8, 10)]


def test_prefix_chain_same_prefix_same_keys_divergence_changes_all_later():
    db = _db()
    a = [k for *_, k in db.process_tokens(torch.arange(12))]
    b_tokens = torch.arange(12)
    b_tokens[5] = 999
    b = [k for *_, k in db.process_tokens(b_tokens)]
    assert a[0] == b[0]
    assert a[1] != b[1] and a[2] != b[2]  # chunk 2's tokens are equal but its prefix is not
    first = torch.arange(12)
    first[0] = 7
    assert all(x != y for x, y in zip(a, [k for *_, k in db.process_tokens(first)]))


def test_list_and_tensor_tokens_hash_alike():
    db = _db()
    assert [k for *_, k in db.process_tokens(list(range(8)))] == [k for *_, k in db.process_tokens(torch.arange(8, dtype=torch.int32))]


def test_key_names_everything_and_round_trips():
    key = next(iter(_db().process_tokens(torch.arange(4), scope=KeyScope(namespace="tenant/a@b"))))[2]
    assert (key.model_name, key.world_size, key.worker_id, key.dtype, key.fmt) == ("org/model-7b", 2, 1, "bfloat16", "KV_2LTD")
    assert key.namespace and "tenant" not in key.to_string(), "keys carry a digest of the salt, never the salt"
    assert key.namespace == next(iter(_db().process_tokens(torch.arange(4), scope=KeyScope(namespace="tenant/a@b"))))[2].namespace
    s = key.to_string()
    assert CacheEngineKey.from_string(s) == key
    layer = key.with_layer(3)
    assert CacheEngineKey.from_string(layer.to_string()) == layer and layer != key
    with pytest.raises(ValueError, match="not a lmcache_triton key"):
        CacheEngineKey.from_string("garbage")


@pytest.mark.parametrize("field,value", [("model_name", "other"), ("worker_id", 0), ("kv_dtype", torch.float16)],
                         ids=["model", "rank", "dtype"])
def test_keys_differ_by_model_rank_dtype(field, value):
    base = [k for *_, k in _db().process_tokens(torch.arange(8))]
    other = [k for *_, k in _db(**{field: value}).process_tokens(torch.arange(8))]
    assert all(a.to_string() != b.to_string() for a, b in zip(base, other))


def test_namespaces_isolate():
    db = _db()
    a = [k for *_, k in db.process_tokens(torch.arange(8), scope=KeyScope(namespace="alice"))]
    b = [k for *_, k in db.process_tokens(torch.arange(8), scope=KeyScope(namespace="bob"))]
    assert all(x.chunk_hash != y.chunk_hash for x, y in zip(a, b))


def test_mask_skips_chunk_aligned_prefix_but_keys_keep_the_chain():
    db = _db()
    full = list(db.process_tokens(torch.arange(12)))
    mask = torch.tensor([False] * 4 + [True] * 8)
    masked = list(db.process_tokens(torch.arange(12), mask))
    assert masked == full[1:]
    with pytest.raises(ValueError, match="chunk-aligned"):
        list(db.process_tokens(torch.arange(12), torch.tensor([False] * 3 + [True] * 9)))
    with pytest.raises(ValueError, match="run of False"):
        list(db.process_tokens(torch.arange(12), torch.tensor([True] * 4 + [False] * 4 + [True] * 4)))


def test_extra_hashes_change_the_key():
    db = _db()
    plain = [k for *_, k in db.process_tokens(torch.arange(8))]
    image = [k for *_, k in db.process_tokens(torch.arange(8), scope=KeyScope(extra_hashes=[b"", b"image-sha"]))]
    assert plain[0] == image[0] and plain[1] != image[1]


_KEYS_SCRIPT = """
import torch
from lmcache_triton.metadata import LMCacheEngineMetadata
from lmcache_triton.engine.token_database import ChunkedTokenDatabase
from lmcache_triton.keys import KeyScope
m = LMCacheEngineMetadata(model_name="org/model-7b", world_size=2, worker_id=1, kv_dtype=torch.bfloat16,
                          kv_shape=(2, 2, 4, 2, 32))
db = ChunkedTokenDatabase(4, m)
print("|".join(k.to_string() for *_, k in db.process_tokens(torch.arange(100, 112), scope=KeyScope(namespace="ns"))))
"""


def test_keys_equal_across_processes():
    """Python's hash() is salted per process; our keys must not be."""
    outs = {
        subprocess.run([sys.executable, "-c", _KEYS_SCRIPT], capture_output=True, text=True, check=True,
                       env={"PYTHONHASHSEED": seed, "PATH": ""}).stdout.strip()
        for seed in ("1", "2")
    }
    assert len(outs) == 1
    here = "|".join(k.to_string() for *_, k in _db().process_tokens(torch.arange(100, 112), scope=KeyScope(namespace="ns")))
    assert outs == {here}


def test_mm_spans_change_the_chunks_they_overlap_and_those_behind():
    db = _db()
    tokens = torch.arange(12)  # chunks [0,4) [4,8) [8,12)
    a = [k for *_, k in db.process_tokens(tokens, scope=KeyScope(mm_spans=[(5, 2, "img-a")]))]
    b = [k for *_, k in db.process_tokens(tokens, scope=KeyScope(mm_spans=[(5, 2, "img-b")]))]
    assert a[0] == b[0], "a chunk before the image does not depend on it"
    assert a[1] != b[1] and a[2] != b[2], "the chunk holding the image, and the prefix chain behind it"


def test_adapter_and_model_variant_are_part_of_the_key():
    tokens = torch.arange(8)
    base = [k for *_, k in _db().process_tokens(tokens)]
    lora_a = [k for *_, k in _db().process_tokens(tokens, scope=KeyScope(adapter="lora:a:1234"))]
    lora_b = [k for *_, k in _db().process_tokens(tokens, scope=KeyScope(adapter="lora:b:5678"))]
    assert len({base[0], lora_a[0], lora_b[0]}) == 3
    assert lora_a[0].identity and base[0].identity == ""
    quantized = [k for *_, k in _db(kv_identity="quantization='awq'").process_tokens(tokens)]
    assert quantized[0] != base[0] and quantized[0].identity
    assert CacheEngineKey.from_string(lora_a[0].to_string()) == lora_a[0]


def test_salt_never_appears_in_a_key():
    salt = "tenant-secret-XYZ"
    key = next(iter(_db().process_tokens(torch.arange(4), scope=KeyScope(namespace=salt))))[2]
    assert salt not in key.to_string() and "XYZ" not in repr(key)
    other_secret = ChunkedTokenDatabase(4, _db().metadata, namespace_secret="deployment-secret")
    keyed = next(iter(other_secret.process_tokens(torch.arange(4), scope=KeyScope(namespace=salt))))[2]
    assert keyed.namespace != key.namespace, "the digest is keyed by namespace_secret when set"


# ---- precomputed chain hashes (issue #14) ----------------------------------------------------------
from lmcache_triton import keys as keys_module  # noqa: E402
from lmcache_triton.keys import ChunkHashes, TokenChain, scope_seed, scoped_hash  # noqa: E402

_SCOPES = {
    "plain": {},
    "namespace": dict(namespace="tenant-a"),
    "adapter": dict(adapter="lora:a:1234"),
    "mm": dict(mm_spans=[(5, 6, "img-a"), (13, 2, "img-b")]),
    "extra": dict(extra_hashes=[b"", b"x", b"", b"yy"]),
    "everything": dict(namespace="tenant-b", adapter="lora:b:1", mm_spans=[(2, 9, "img")],
                       extra_hashes=[b"e0", b"", b"e2"]),
}


def _keys(db, tokens, mask=None, **scope):
    return [(s, e, k) for s, e, k in db.process_tokens(tokens, mask, KeyScope(**scope))]


@pytest.mark.parametrize("scope", list(_SCOPES.values()), ids=list(_SCOPES))
@pytest.mark.parametrize("unfull", [False, True], ids=["whole-chunks", "partial-tail"])
def test_keys_from_precomputed_hashes_equal_keys_from_tokens(scope, unfull):
    db = _db(save_unfull_chunk=unfull)
    tokens = list(range(500, 518))  # chunks [0,4) [4,8) [8,12) [12,16) [16,18)
    expected = _keys(db, tokens, **scope)
    assert len(expected) == (5 if unfull else 4)
    chain = TokenChain(4, scope.get("mm_spans"), scope.get("extra_hashes"))
    hashes = chain.chunk_hashes(tokens)
    assert _keys(db, len(tokens), **scope, chunk_hashes=hashes) == expected, "from the count and the hashes"
    assert _keys(db, tokens, **scope, chunk_hashes=hashes) == expected, "from the ids and the hashes"
    assert _keys(db, torch.tensor(tokens), **scope, chunk_hashes=list(hashes.hashes)) == expected
    # a window: the hashes from chunk 2 on, the count; the chunks before are skipped as by a mask
    mask = torch.tensor([False] * 8 + [True] * 10)
    assert _keys(db, len(tokens), **scope, chunk_hashes=hashes.since(8)) == expected[2:]
    assert _keys(db, tokens, mask, **scope) == expected[2:]


def test_key_hash_is_the_scope_folded_into_the_token_chain():
    db = _db()
    tokens = list(range(8))
    chain = TokenChain(4).chunk_hashes(tokens)
    ns_hex, identity = db.key_scope("tenant-a", "lora:a:1")
    keys = _keys(db, tokens, namespace="tenant-a", adapter="lora:a:1")
    assert [k.chunk_hash for *_, k in keys] == [scoped_hash(scope_seed(ns_hex, identity), h).hex() for h in chain.hashes]
    assert all(k.to_string().startswith("lmct5@") for *_, k in keys), "the key scheme was bumped"
    old = keys[0][2].to_string().replace("lmct5@", "lmct4@", 1)
    with pytest.raises(ValueError, match="not a lmcache_triton key"):
        CacheEngineKey.from_string(old)


def test_one_chain_many_scopes_keys_never_meet():
    """The chain is scope-free; every scope still gets its own chunk hashes (not only its own key fields)."""
    tokens = list(range(12))
    hashes = TokenChain(4).chunk_hashes(tokens)
    variants = [
        _keys(_db(), 12, chunk_hashes=hashes),
        _keys(_db(), 12, chunk_hashes=hashes, namespace="alice"),
        _keys(_db(), 12, chunk_hashes=hashes, namespace="bob"),
        _keys(_db(), 12, chunk_hashes=hashes, adapter="lora:x:1"),
        _keys(_db(kv_identity="blocks='vllm_cpu-amx'"), 12, chunk_hashes=hashes),
        _keys(ChunkedTokenDatabase(4, _db().metadata, namespace_secret="s"), 12, chunk_hashes=hashes, namespace="alice"),
    ]
    chunk_hashes = [k.chunk_hash for keys in variants for *_, k in keys]
    assert len(set(chunk_hashes)) == len(chunk_hashes) == 6 * 3


def test_incremental_chain_hashes_each_chunk_once(monkeypatch):
    prompt = list(range(1000, 1000 + 4 * 25 + 3))  # 25 whole chunks and a partial one
    reference = TokenChain(4).chunk_hashes(prompt)
    calls = []
    real = keys_module.hashlib.sha256  # one per chunk hashed (the chain's hash function)
    monkeypatch.setattr(keys_module.hashlib, "sha256", lambda *a: calls.append(1) or real(*a))
    chain = TokenChain(4)
    tokens: list[int] = []
    for end in range(7, len(prompt) + 7, 7):  # a chunked prefill, 7 tokens a step
        end = min(end, len(prompt))
        start = len(tokens) // 4 * 4
        tokens.extend(prompt[len(tokens):end])
        got = chain.chunk_hashes(tokens, end // 4 * 4, start)  # what each step's ReqMeta carries
        assert got.first == start // 4 and got.num_tokens == end // 4 * 4
    assert len(calls) == 25, "each whole chunk hashed once over the whole prefill"
    assert chain.chunk_hashes(prompt, start=96).hashes == reference.hashes[24:]
    assert len(calls) == 26, "the partial tail is hashed when asked for, the chain not again"
    assert tuple(chain.hashes) == reference.hashes[:25]


def test_a_span_the_hashes_do_not_name_is_hashed_from_the_ids_or_left_out():
    db = _db(save_unfull_chunk=True)
    tokens = list(range(18))
    hashes = TokenChain(4).chunk_hashes(tokens)       # spans of 18 tokens: the last is [16, 18)
    expected = _keys(db, tokens[:14])                 # spans of 14 tokens: the last is [12, 14)
    assert _keys(db, tokens[:14], chunk_hashes=hashes) == expected, "the partial [12, 14) hashed from its ids"
    assert _keys(db, 14, chunk_hashes=hashes) == expected[:3], "without ids it cannot be keyed: left out"
    with pytest.raises(ValueError, match="need KeyScope.chunk_hashes"):
        _keys(db, 14)
    with pytest.raises(ValueError, match="chunk_size"):
        _keys(db, 16, chunk_hashes=TokenChain(8).chunk_hashes(tokens[:16]))
    with pytest.raises(ValueError, match="exceed"):
        ChunkHashes(0, hashes.hashes, 8, 4)


def test_segment_keys_fold_the_scope_and_refuse_chunk_hashes():
    from lmcache_triton.engine.token_database import SegmentTokenDatabase

    seg = SegmentTokenDatabase(_db().metadata, [0], min_tokens=2)
    tokens = [5, 6, 7, 0, 8, 9]
    plain, salted = _keys(seg, tokens), _keys(seg, tokens, namespace="salt")
    assert [k.chunk_hash for *_, k in plain] != [k.chunk_hash for *_, k in salted]
    with pytest.raises(ValueError, match="segment keys"):
        _keys(seg, tokens, chunk_hashes=TokenChain(4).chunk_hashes(tokens))
    with pytest.raises(ValueError, match="segment keys"):
        _keys(seg, 6)


def test_the_key_cache_is_bounded_and_never_changes_a_key():
    db = _db()
    db.KEY_CACHE_SIZE = 5
    tokens = list(range(40))  # 10 chunks
    hashes = TokenChain(4).chunk_hashes(tokens)
    first = _keys(db, 40, chunk_hashes=hashes, namespace="a")
    assert db._key_cache_len <= 5, "emptied when full"
    again = _keys(db, 40, chunk_hashes=hashes, namespace="a")
    other = _keys(db, 40, chunk_hashes=hashes, namespace="b")
    fresh = _keys(_db(), tokens, namespace="a")
    assert first == again == fresh and all(x[2] != y[2] for x, y in zip(first, other))


def test_token_ids_are_never_another_ids_bytes():
    """Ids are hashed as int64: any id of that range has its own bytes (a negative one, one past
    uint32), and what is not an int64 integer is an error rather than wrapped or truncated."""
    base = TokenChain(4).chunk_hashes([1, 2, 0, 3]).hashes
    for other in (-1, 2**32, 2**32 - 1, 2**63 - 1):
        assert TokenChain(4).chunk_hashes([1, 2, other, 3]).hashes != base, other
    with pytest.raises(ValueError, match="fit in int64"):
        TokenChain(4).chunk_hashes([1, 2, 2**64, 3])
    with pytest.raises(ValueError, match="does not fit in int64"):
        TokenChain(4).chunk_hashes(np.array([1, 2, 2**63, 3], dtype=np.uint64))
    with pytest.raises(ValueError, match="must be integers"):
        TokenChain(4).chunk_hashes(torch.tensor([1.0, 2.0, 0.0, 3.0]))
    with pytest.raises(ValueError, match="must be integers"):
        TokenChain(4).chunk_hashes(np.array([1.0, 2.0, 0.0, 3.0]))


def test_ids_hash_alike_whatever_their_container():
    ids = [5, 70000, 2**31 + 7, 0, 9, 9, 1, 3]
    want = TokenChain(4).chunk_hashes(ids).hashes
    for given in (tuple(ids), np.array(ids, dtype=np.int64), torch.tensor(ids, dtype=torch.int64),
                  np.array(ids, dtype=np.uint32), torch.tensor(ids, dtype=torch.int64)[::1],
                  torch.tensor([0, *ids], dtype=torch.int64)[1:], torch.tensor(ids, dtype=torch.int64).repeat_interleave(2)[::2],
                  np.array(ids, dtype=">i8")):
        assert TokenChain(4).chunk_hashes(given).hashes == want, type(given)
