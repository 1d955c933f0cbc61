import subprocess
import sys

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
