"""LMCacheEngine end to end on CPU tensors in vLLM's layouts (the torch path of the kernels)."""

import pytest
import torch

from lmcache_triton import (
    LMCacheEngineBuilder,
    LMCacheEngineConfig,
    LMCacheEngineMetadata,
    create_gpu_connector,
)
from lmcache_triton.engine.engine import _scope
# The oracle is the torch reference; the engine moves bytes with the Triton kernels (interpreter on CPU).
from lmcache_triton.kernels import paged_gather_ref as paged_gather
from lmcache_triton.tools.testing import make_kv_caches, random_slot_mapping

CHUNK = 16
LAYERS, HEADS, HEAD = 3, 2, 32
BLOCK, BLOCKS = 16, 40


def _setup(layout="vllm_cpu", *, layerwise=False, save_unfull_chunk=False, max_gb=0.05, dtype=torch.bfloat16,
           instance="t"):
    mla = layout == "mla"
    heads, head = (1, 72) if mla else (HEADS, HEAD)
    config = LMCacheEngineConfig.from_defaults(chunk_size=CHUNK, max_local_cpu_size=max_gb, use_layerwise=layerwise,
                                               save_unfull_chunk=save_unfull_chunk)
    metadata = LMCacheEngineMetadata(model_name="test/model", world_size=1, worker_id=0, kv_dtype=dtype,
                                     kv_shape=(LAYERS, 1 if mla else 2, CHUNK, heads, head), use_mla=mla)
    connector = create_gpu_connector(config, metadata, layout)
    engine = LMCacheEngineBuilder.get_or_create(instance, config, metadata, connector)
    geo = dict(num_layers=LAYERS, num_blocks=BLOCKS, block_size=BLOCK, num_kv_heads=heads, head_size=head, dtype=dtype)
    order = "BHLNC" if layout == "vllm_packed" else "LBNHC"
    return engine, (lambda fill=None, g=None: make_kv_caches(layout, order=order, fill=fill, generator=g, **geo))


@pytest.fixture(autouse=True)
def _destroy_engines():
    yield
    LMCacheEngineBuilder.destroy_all()


def _slots(n, seed):
    return random_slot_mapping(n, num_blocks=BLOCKS, block_size=BLOCK, generator=torch.Generator().manual_seed(seed))


LAYOUT_PARAMS = [pytest.param(layout, id=layout) for layout in ("vllm_cpu", "vllm_packed", "flash_attn", "flashinfer", "mla")]


@pytest.mark.parametrize("layerwise", [pytest.param(False, id="all-layers"), pytest.param(True, id="layerwise")])
@pytest.mark.parametrize("layout", LAYOUT_PARAMS)
def test_store_retrieve_exact_bytes(layout, layerwise):
    engine, caches = _setup(layout, layerwise=layerwise)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 1000, (5 * CHUNK,), generator=g)
    src, dst = caches(g=g), caches(fill=-7)
    src_slots, dst_slots = _slots(len(tokens), 2), _slots(len(tokens), 3)
    assert engine.store(tokens, kvcaches=src, slot_mapping=src_slots) == len(tokens)
    assert engine.lookup(tokens) == len(tokens)
    ret = engine.retrieve(tokens, kvcaches=dst, slot_mapping=dst_slots)
    assert ret.all()
    assert torch.equal(paged_gather(dst, dst_slots, layout).view(torch.uint8),
                       paged_gather(src, src_slots, layout).view(torch.uint8))
    # nothing outside the mapping was written
    untouched = torch.ones(BLOCKS * BLOCK, dtype=torch.bool)
    untouched[dst_slots] = False
    sentinel = caches(fill=-7)
    rest = untouched.nonzero().squeeze(1)
    assert torch.equal(paged_gather(dst, rest, layout), paged_gather(sentinel, rest, layout))
    stats = engine.get_stats()
    assert stats.hit_tokens == len(tokens) and stats.stored_tokens == len(tokens) and stats.hit_rate == 1.0


def test_lookup_longest_prefix_and_changed_first_token():
    engine, caches = _setup()
    src = caches(g=torch.Generator().manual_seed(0))
    tokens = torch.arange(4 * CHUNK + 5)  # a partial tail, not kept by default
    engine.store(tokens, kvcaches=src, slot_mapping=_slots(len(tokens), 1))
    assert engine.lookup(tokens) == 4 * CHUNK
    longer = torch.cat([tokens[: 2 * CHUNK + 3], torch.full((3 * CHUNK,), 5)])
    assert engine.lookup(longer) == 2 * CHUNK
    changed = tokens.clone()
    changed[0] += 1
    assert engine.lookup(changed) == 0
    dst = caches(fill=0)
    ret = engine.retrieve(longer, kvcaches=dst, slot_mapping=_slots(len(longer), 2))
    assert ret[: 2 * CHUNK].all() and not ret[2 * CHUNK:].any()


def test_partial_chunk_kept_only_with_save_unfull_chunk():
    engine, caches = _setup(save_unfull_chunk=True)
    src = caches(g=torch.Generator().manual_seed(0))
    tokens = torch.arange(2 * CHUNK + 5)
    slots = _slots(len(tokens), 1)
    assert engine.store(tokens, kvcaches=src, slot_mapping=slots) == len(tokens)
    assert engine.lookup(tokens) == len(tokens)
    dst = caches(fill=0)
    dst_slots = _slots(len(tokens), 4)
    assert engine.retrieve(tokens, kvcaches=dst, slot_mapping=dst_slots).all()
    assert torch.equal(paged_gather(dst, dst_slots, "vllm_cpu"), paged_gather(src, slots, "vllm_cpu"))


def test_namespaces_isolate():
    engine, caches = _setup()
    src = caches(g=torch.Generator().manual_seed(0))
    tokens = torch.arange(3 * CHUNK)
    engine.store(tokens, kvcaches=src, slot_mapping=_slots(len(tokens), 1), namespace="tenant-a")
    assert engine.lookup(tokens, namespace="tenant-a") == 3 * CHUNK
    assert engine.lookup(tokens, namespace="tenant-b") == 0
    assert engine.lookup(tokens) == 0
    ret = engine.retrieve(tokens, kvcaches=caches(fill=0), slot_mapping=_slots(len(tokens), 2), namespace="tenant-b")
    assert not ret.any()


def test_mask_skips_prefix_on_store_and_retrieve():
    engine, caches = _setup()
    src = caches(g=torch.Generator().manual_seed(0))
    tokens = torch.arange(4 * CHUNK)
    slots = _slots(len(tokens), 1)
    mask = torch.ones(len(tokens), dtype=torch.bool)
    mask[:CHUNK] = False  # vLLM already holds the first chunk
    assert engine.store(tokens, mask, kvcaches=src, slot_mapping=slots) == 3 * CHUNK
    assert engine.lookup(tokens) == 0, "the first chunk was never stored, so no prefix matches"
    engine.store(tokens, kvcaches=src, slot_mapping=slots)
    assert engine.get_stats().stored_tokens == 4 * CHUNK, "stored chunks are not stored twice"
    dst = caches(fill=0)
    ret = engine.retrieve(tokens, mask, kvcaches=dst, slot_mapping=slots)
    assert not ret[:CHUNK].any() and ret[CHUNK:].all()
    assert torch.equal(paged_gather(dst, slots[CHUNK:], "vllm_cpu"), paged_gather(src, slots[CHUNK:], "vllm_cpu"))
    assert torch.all(paged_gather(dst, slots[:CHUNK], "vllm_cpu") == 0)


def test_a_load_stops_at_the_first_missing_chunk_and_releases_every_hold():
    """The CPU tier's prefix is held at once for the load: a chunk evicted in the middle ends it
    (prefix mode), the chunks before it land bit for bit, those after it stay untouched, and every
    hold the load took is released (a hold another reader has stays)."""
    engine, caches = _setup()
    src = caches(g=torch.Generator().manual_seed(0))
    tokens = torch.arange(4 * CHUNK)
    slots = _slots(len(tokens), 1)
    engine.store(tokens, kvcaches=src, slot_mapping=slots)
    sm = engine.storage_manager
    keys = [key for _, _, key in engine._chunks(tokens, None, _scope({}))]
    sm.cpu.remove(keys[2])
    reader = sm.get_in_memory(keys[0])
    dst = caches(fill=0)
    ret = engine.retrieve(tokens, kvcaches=dst, slot_mapping=slots)
    assert ret[:2 * CHUNK].all() and not ret[2 * CHUNK:].any()
    assert torch.equal(paged_gather(dst, slots[:2 * CHUNK], "vllm_cpu"),
                       paged_gather(src, slots[:2 * CHUNK], "vllm_cpu"))
    assert torch.all(paged_gather(dst, slots[2 * CHUNK:], "vllm_cpu") == 0)
    assert sm.cpu.num_held == 1 and reader.is_held, "only the other reader's hold is left"
    sm.release(keys[0], reader)
    assert sm.cpu.num_held == 0


def test_offset_slot_mapping_covers_only_the_new_tokens():
    engine, caches = _setup()
    src = caches(g=torch.Generator().manual_seed(0))
    tokens = torch.arange(3 * CHUNK)
    slots = _slots(len(tokens), 1)
    engine.store(tokens, kvcaches=src, slot_mapping=slots)
    dst = caches(fill=0)
    mask = torch.ones(len(tokens), dtype=torch.bool)
    mask[:CHUNK] = False
    ret = engine.retrieve(tokens, mask, kvcaches=dst, slot_mapping=slots[CHUNK:], offset=CHUNK)
    assert ret[CHUNK:].all()
    assert torch.equal(paged_gather(dst, slots[CHUNK:], "vllm_cpu"), paged_gather(src, slots[CHUNK:], "vllm_cpu"))


def test_lru_eviction_through_the_engine_and_lookup_reservations():
    chunk_bytes = 2 * LAYERS * CHUNK * HEADS * HEAD * 2
    engine, caches = _setup(max_gb=3.5 * chunk_bytes / 2**30)  # room for three chunks
    src = caches(g=torch.Generator().manual_seed(0))
    a, b = torch.arange(2 * CHUNK), torch.arange(1000, 1000 + 2 * CHUNK)
    engine.store(a, kvcaches=src, slot_mapping=_slots(2 * CHUNK, 1))
    assert engine.lookup(a, reserve=True, lookup_id="req-a") == 2 * CHUNK
    engine.store(b, kvcaches=src, slot_mapping=_slots(2 * CHUNK, 2))
    # b's second chunk found no room: a's chunks are held by the lookup, so they stay
    assert engine.lookup(a) == 2 * CHUNK and engine.lookup(b) == CHUNK
    assert engine.get_stats().store_refusals == 1
    engine.release_reservation("req-a")
    engine.store(b, kvcaches=src, slot_mapping=_slots(2 * CHUNK, 2))
    assert engine.lookup(b) == 2 * CHUNK and engine.lookup(a) == 0  # a's first chunk was the oldest


def test_builder_get_or_create_get_destroy():
    engine, _ = _setup(instance="x")
    assert LMCacheEngineBuilder.get("x") is engine
    assert LMCacheEngineBuilder.get_or_create("x", engine.config, engine.metadata, engine.gpu_connector) is engine
    with pytest.raises(ValueError, match="already exists"):
        LMCacheEngineBuilder.get_or_create("x", engine.config.replace(chunk_size=32), engine.metadata,
                                           engine.gpu_connector)
    LMCacheEngineBuilder.destroy("x")
    assert LMCacheEngineBuilder.get("x") is None


def test_mismatched_caches_are_a_clear_error():
    engine, _ = _setup()
    wrong = make_kv_caches("vllm_cpu", num_layers=LAYERS, num_blocks=BLOCKS, block_size=BLOCK, num_kv_heads=4,
                           head_size=HEAD, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="elements per token"):
        engine.store(torch.arange(CHUNK), kvcaches=wrong, slot_mapping=_slots(CHUNK, 0))
    with pytest.raises(ValueError, match="slot_mapping"):
        engine.store(torch.arange(CHUNK), kvcaches=make_kv_caches(
            "vllm_cpu", num_layers=LAYERS, num_blocks=BLOCKS, block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD),
            slot_mapping=_slots(CHUNK - 1, 0))


def test_layerwise_generators_step_one_layer_at_a_time():
    engine, caches = _setup(layerwise=True)
    src, dst = caches(g=torch.Generator().manual_seed(0)), caches(fill=0)
    tokens = torch.arange(2 * CHUNK)
    slots = _slots(len(tokens), 1)
    storer = engine.store_layer(tokens, kvcaches=src, slot_mapping=slots)
    next(storer)
    assert engine.lookup(tokens) == 0, "only layer 0 is stored after one step"
    for _ in range(LAYERS - 1):
        next(storer)
    assert next(storer, "done") == "done" and engine.lookup(tokens) == 2 * CHUNK
    retriever = engine.retrieve_layer(tokens, kvcaches=dst, slot_mapping=slots)
    assert next(retriever) is None
    assert torch.equal(paged_gather(dst[:1], slots, "vllm_cpu"), paged_gather(src[:1], slots, "vllm_cpu"))
    assert torch.all(paged_gather(dst[1:], slots, "vllm_cpu") == 0), "layer 1 is not loaded yet"
    for _ in range(LAYERS - 1):
        assert next(retriever) is None
    with pytest.raises(StopIteration) as end:
        next(retriever)
    assert end.value.value.all(), "the generator returns the mask of loaded tokens"
    assert not torch.is_inference_mode_enabled(), "between steps the caller's thread is as it was"
    assert torch.equal(paged_gather(dst, slots, "vllm_cpu"), paged_gather(src, slots, "vllm_cpu"))
    assert engine.storage_manager.cpu.num_held == 0, "a finished load leaves nothing held"


def test_layerwise_generators_closed_early_leak_nothing():
    engine, caches = _setup(layerwise=True)
    src = caches(g=torch.Generator().manual_seed(0))
    tokens = torch.arange(2 * CHUNK)
    slots = _slots(len(tokens), 1)
    storer = engine.store_layer(tokens, kvcaches=src, slot_mapping=slots)
    next(storer)
    storer.close()  # vLLM gave up on the step: nothing stored, the pool gets its bytes back
    assert engine.lookup(tokens) == 0 and engine.storage_manager.cpu.used_bytes == 0
    engine.store(tokens, kvcaches=src, slot_mapping=slots)
    retriever = engine.retrieve_layer(tokens, kvcaches=caches(fill=0), slot_mapping=slots)
    next(retriever)
    assert not torch.is_inference_mode_enabled(), "a waiting generator leaves the caller out of inference mode"
    assert engine.storage_manager.cpu.num_held > 0
    retriever.close()
    assert engine.storage_manager.cpu.num_held == 0, "a load closed early releases its holds"


class _Boom(RuntimeError):
    pass


def _failing_after(gen_fn, steps_ok):
    """A connector move that runs `steps_ok` steps, then raises (a kernel or device error)."""
    def move(objs, starts, ends, target):
        inner = gen_fn(objs, starts, ends, target)
        for _ in range(steps_ok):
            next(inner)
            yield
        raise _Boom("copy failed")
    return move


@pytest.mark.parametrize("layerwise", [False, True], ids=["all_layers", "layerwise"])
@pytest.mark.parametrize("direction", ["store", "retrieve"])
def test_a_failing_copy_frees_and_releases_everything(layerwise, direction):
    """One store loop and one retrieve loop, each with one try/finally: whichever step of the
    connector fails, no pool memory and no hold outlives the call, and nothing half-copied is stored."""
    engine, caches = _setup(layerwise=layerwise, instance=f"boom-{direction}-{layerwise}")
    conn, cpu = engine.gpu_connector, engine.storage_manager.cpu
    tokens, slots = torch.arange(3 * CHUNK), _slots(3 * CHUNK, 1)
    src = caches(g=torch.Generator().manual_seed(3))
    if direction == "retrieve":
        assert engine.store(tokens, kvcaches=src, slot_mapping=slots) == 3 * CHUNK
    used = cpu.used_bytes
    fail_at = conn.steps - 1  # the last step: every object is allocated or held by then
    name = "batched_from_gpu" if direction == "store" else "batched_to_gpu"
    setattr(conn, name, _failing_after(getattr(conn, name), fail_at))
    with pytest.raises(_Boom):
        if direction == "store":
            engine.store(tokens, kvcaches=src, slot_mapping=slots)
        else:
            engine.retrieve(tokens, kvcaches=caches(fill=0), slot_mapping=_slots(3 * CHUNK, 2))
    assert cpu.used_bytes == used, "pool memory lost to a failed copy"
    assert cpu.num_held == 0, "holds left by a failed copy"
    if direction == "store":
        assert engine.lookup(tokens) == 0, "a chunk whose copy failed was stored"


def test_key_scope_arguments_are_checked():
    """A misspelt key argument is an error, not silently ignored (it used to vanish into **kwargs)."""
    engine, caches = _setup(instance="typo")
    with pytest.raises(TypeError, match="namespce"):
        engine.lookup(torch.arange(CHUNK), namespce="tenant-a")
    with pytest.raises(TypeError, match="pin"):
        engine.lookup(torch.arange(CHUNK), pin=True)


def test_stores_and_retrieves_hold_off_committing_the_tier_ahead():
    """Committing the CPU tier's pages ahead takes memory bandwidth: it waits until a while after
    each store or retrieve, and never cuts short a longer deferral (vLLM's worker defers it for
    a whole step)."""
    import time

    engine, caches = _setup()
    pool = engine.storage_manager.cpu.pool
    tokens = torch.randint(0, 1000, (2 * CHUNK,), generator=torch.Generator().manual_seed(4))
    src, slots = caches(g=torch.Generator().manual_seed(5)), _slots(len(tokens), 6)
    pool.defer_prefault(0)
    engine.store(tokens, kvcaches=src, slot_mapping=slots)
    left = pool._busy_until - time.monotonic()
    assert 0 < left <= engine._PREFAULT_QUIET_S
    pool.defer_prefault(0)
    engine.retrieve(tokens, kvcaches=caches(fill=0), slot_mapping=slots)
    assert 0 < pool._busy_until - time.monotonic() <= engine._PREFAULT_QUIET_S
    pool.defer_prefault(60)      # a step under way
    engine.retrieve(tokens, kvcaches=caches(fill=0), slot_mapping=slots)
    assert pool._busy_until - time.monotonic() > 50


@pytest.mark.parametrize("fault", ["closed-after-one-layer", "rotation-fails-at-layer-1"])
def test_a_blend_store_with_key_rotation_that_stops_halfway_stores_nothing_and_frees_everything(fault):
    """CacheBlend's store rotates K inside the connector's per-layer steps: a store closed early,
    or whose rotation fails on a later layer, puts nothing and gives the pool its bytes back."""
    from lmcache_triton.engine.engine import CacheMode

    base, caches = _setup(layerwise=True)
    calls = []

    def rotation(k, chunk_starts):
        calls.append(k.shape[0])
        if fault == "rotation-fails-at-layer-1" and len(calls) > 1:
            raise _Boom("rotation failed")
        k.neg_()

    mode = CacheMode(base.mode.token_database, key_rotation=rotation)
    engine = LMCacheEngineBuilder.get_or_create("t-rot", base.config, base.metadata, base.gpu_connector, mode)
    src = caches(g=torch.Generator().manual_seed(0))
    tokens = torch.arange(2 * CHUNK)
    slots = _slots(len(tokens), 1)
    storer = engine.store_layer(tokens, kvcaches=src, slot_mapping=slots)
    next(storer)
    if fault == "closed-after-one-layer":
        storer.close()
    else:
        with pytest.raises(_Boom):
            for _ in storer:
                pass
    assert calls, "the rotation ran in the store's steps"
    assert engine.lookup(tokens) == 0 and engine.storage_manager.cpu.used_bytes == 0
    assert engine.storage_manager.cpu.num_held == 0
