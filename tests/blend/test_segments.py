import torch
import pytest

from lmcache_triton.engine.token_database import SegmentTokenDatabase, separator_ids, split_segments
from lmcache_triton.keys import KeyScope
from lmcache_triton.config import LMCacheEngineConfig
from lmcache_triton.metadata import LMCacheEngineMetadata
from lmcache_triton.engine.token_database import ChunkedTokenDatabase
from lmcache_triton.keys import KeyScope

SEP = [7, 8]


def _meta(**kw):
    m = dict(model_name="org/model-7b", world_size=1, worker_id=0, kv_dtype=torch.bfloat16, kv_shape=(2, 2, 4, 2, 32))
    m.update(kw)
    return LMCacheEngineMetadata(**m)


def _db(min_tokens=1, **kw):
    return SegmentTokenDatabase(_meta(**kw), SEP, min_tokens=min_tokens)


def test_split_at_separator():
    doc_a, doc_b, doc_c = [10, 11, 12], [20, 21], [30, 31, 32, 33]
    tokens = doc_a + SEP + doc_b + SEP + doc_c
    assert [(s, e) for s, e, _ in _db().process_tokens(tokens)] == [(0, 3), (5, 7), (9, 13)]
    # separators at the ends and back to back yield no empty segments; overlapping matches count once
    assert split_segments(torch.tensor(SEP + [1, 2] + SEP + SEP), torch.tensor(SEP)) == [(2, 4)]
    assert split_segments(torch.tensor([7, 7, 7, 1]), torch.tensor([7, 7])) == [(2, 4)]
    assert split_segments(torch.tensor([1, 2, 3]), torch.tensor(SEP)) == [(0, 3)]


def test_same_document_same_key_anywhere_different_documents_differ():
    doc, other, q = [40, 41, 42, 43], [50, 51, 52, 53], [60, 61]
    db = _db()
    first = {tuple(tokens[s:e]): k for tokens in [doc + SEP + other + SEP + q]
             for s, e, k in db.process_tokens(tokens)}
    second = {tuple(tokens[s:e]): k for tokens in [q + SEP + other + SEP + doc]
              for s, e, k in db.process_tokens(torch.tensor(tokens))}
    assert first[tuple(doc)] == second[tuple(doc)] and first[tuple(other)] == second[tuple(other)]
    assert len({first[tuple(doc)], first[tuple(other)], first[tuple(q)]}) == 3
    # the key carries model / rank / dtype / format like a chunk key, and never equals one
    key = first[tuple(doc)]
    assert (key.model_name, key.world_size, key.worker_id, key.dtype, key.fmt) == ("org/model-7b", 1, 0, "bfloat16",
                                                                                   "KV_T2D")
    assert key != _db(model_name="org/other").make_key(bytes.fromhex(key.chunk_hash))
    assert [k for *_, k in db.process_tokens(doc, scope=KeyScope(namespace="salt"))][0] != key
    chunk = ChunkedTokenDatabase(4, _meta(), fmt="KV_T2D")
    assert next(iter(chunk.process_tokens(doc)))[2] != key


def test_min_tokens_and_mask():
    tokens = [1] * 5 + SEP + [2] * 2 + SEP + [3] * 4
    assert [(s, e) for s, e, _ in _db(min_tokens=4).process_tokens(tokens)] == [(0, 5), (11, 15)]
    assert list(_db(min_tokens=6).process_tokens(tokens)) == []
    mask = torch.ones(len(tokens), dtype=torch.bool)
    mask[:5] = False  # vLLM holds the first segment already
    assert [(s, e) for s, e, _ in _db(min_tokens=1).process_tokens(tokens, mask)] == [(7, 9), (11, 15)]


def test_from_config_tokenizes_the_separator_without_special_tokens():
    class Tok:
        def encode(self, text, add_special_tokens=True):
            return ([1] if add_special_tokens else []) + [ord(c) for c in text]

    cfg = LMCacheEngineConfig.from_defaults(blend_min_tokens=3)
    db = SegmentTokenDatabase.from_config(cfg, _meta(), Tok())
    assert db.separator.tolist() == [ord(c) for c in " # # "] and db.min_tokens == 3
    assert separator_ids(" # # ", Tok()) == [32, 35, 32, 35, 32]
    assert SegmentTokenDatabase.from_config(cfg, _meta(), separator=SEP).separator.tolist() == SEP
    with pytest.raises(ValueError):
        SegmentTokenDatabase.from_config(cfg, _meta())


def test_multimodal_inputs_change_the_segment_they_sit_in_wherever_it_appears():
    """A document with an image keeps its key when it moves in the prompt (the image moves with
    it), changes when the image changes, and its neighbours never depend on the image."""
    doc, q = [40, 41, 42, 43], [60, 61]
    db = _db()

    def keys(tokens, spans):
        return {tuple(tokens[s:e]): k for s, e, k in db.process_tokens(tokens, scope=KeyScope(mm_spans=spans))}

    first = keys(doc + SEP + q, [(1, 2, "img-a")])           # image inside doc at offset 1
    moved = keys(q + SEP + doc, [(len(q) + 2 + 1, 2, "img-a")])
    other = keys(doc + SEP + q, [(1, 2, "img-b")])
    assert first[tuple(doc)] == moved[tuple(doc)], "the same document with the same image hits anywhere"
    assert first[tuple(doc)] != other[tuple(doc)], "another image is another segment"
    plain = keys(doc + SEP + q, None)
    assert first[tuple(q)] == other[tuple(q)] == plain[tuple(q)], "the question holds no image"


def test_lookup_counts_tokens_outside_cacheable_segments_as_blending_ineligible():
    from lmcache_triton import create_gpu_connector
    from lmcache_triton.engine.engine import CacheMode, LMCacheEngine
    from lmcache_triton.tools.testing import make_kv_caches, random_slot_mapping

    config = LMCacheEngineConfig.from_defaults(chunk_size=4, max_local_cpu_size=0.01, use_layerwise=True,
                                               enable_blending=True, blend_min_tokens=3)
    meta = _meta()
    conn = create_gpu_connector(config, meta, "vllm_cpu")
    engine = LMCacheEngine(config, meta, conn, mode=CacheMode(SegmentTokenDatabase(meta, SEP, min_tokens=3,
                                                                                  fmt=conn.fmt)))
    try:
        doc, short = [40, 41, 42, 43], [60, 61]
        tokens = doc + SEP + short
        caches = make_kv_caches("vllm_cpu", num_layers=2, num_blocks=4, block_size=4, num_kv_heads=2, head_size=32)
        engine.store(doc, kvcaches=caches, slot_mapping=random_slot_mapping(4, num_blocks=4, block_size=4))
        assert engine.lookup(tokens) == len(doc)
        assert engine.get_stats().miss_tokens == {"blending_ineligible": len(SEP) + len(short)}
    finally:
        engine.close()
