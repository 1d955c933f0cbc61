"""Each GPU connector x each vLLM layout, through the real engine: exact bytes, nothing else touched.

The oracle is the torch reference (`*_ref`); the connectors move bytes with the Triton kernels
(through the interpreter on a CPU host, see the root conftest). On a CUDA host the `cuda` cases
(marked `gpu`) run the same round trips natively: caches on the GPU, chunks in the engine's pinned
host pool, the layerwise connectors on their side stream.
"""

from __future__ import annotations

import pytest
import torch

from lmcache_triton import LMCacheEngineBuilder, LMCacheEngineConfig, LMCacheEngineMetadata, create_gpu_connector
from lmcache_triton.engine.gpu_connector import (VLLMBufferLayerwiseGPUConnector, VLLMPagedMemGPUConnectorV2,
                                          VLLMPagedMemLayerwiseGPUConnector)
from lmcache_triton.kernels import paged_gather_layer_ref, paged_gather_ref
from lmcache_triton.tools.testing import PACKED_ORDERS, make_kv_caches, random_slot_mapping

CHUNK, LAYERS, HEADS, HEAD, MLA_C = 16, 2, 2, 16, 40
BLOCK, BLOCKS = 8, 12
NUM_TOKENS = 2 * CHUNK + 5          # a partial last chunk (kept: save_unfull_chunk)
SENTINEL = -7.0

LAYOUTS = [pytest.param(layout, order, id=f"{layout}-{order}" if layout == "vllm_packed" else layout)
           for layout, order in ([("vllm_packed", order) for order in PACKED_ORDERS]
                                 + [("vllm_cpu", "LBNHC"), ("flash_attn", "LBNHC"), ("flashinfer", "LBNHC"),
                                    ("mla", "LBNHC")])]
DEVICES = [pytest.param("cpu", id="cpu"),
           pytest.param("cuda", id="cuda", marks=(pytest.mark.gpu, pytest.mark.skipif(
               not torch.cuda.is_available(), reason="needs a CUDA device")))]
CONNECTORS = {
    "v2": (VLLMPagedMemGPUConnectorV2, dict()),
    "layerwise": (VLLMPagedMemLayerwiseGPUConnector, dict(use_layerwise=True)),
    "buffer": (VLLMBufferLayerwiseGPUConnector, dict(use_layerwise=True, enable_blending=True)),
}


@pytest.fixture(autouse=True)
def _destroy_engines():
    yield
    LMCacheEngineBuilder.destroy_all()


def setup(kind: str, layout: str, order: str, device: str = "cpu"):
    mla = layout == "mla"
    heads, head = (1, MLA_C) if mla else (HEADS, HEAD)
    cls, flags = CONNECTORS[kind]
    config = LMCacheEngineConfig.from_defaults(chunk_size=CHUNK, max_local_cpu_size=0.02, save_unfull_chunk=True,
                                               **flags)
    metadata = LMCacheEngineMetadata(model_name="test/conn", world_size=1, worker_id=0, kv_dtype=torch.bfloat16,
                                     kv_shape=(LAYERS, 1 if mla else 2, CHUNK, heads, head), use_mla=mla)
    connector = create_gpu_connector(config, metadata, layout)
    assert type(connector) is cls
    engine = LMCacheEngineBuilder.get_or_create(f"conn-{kind}-{layout}-{order}-{device}", config, metadata,
                                                connector)
    geo = dict(num_layers=LAYERS, num_blocks=BLOCKS, block_size=BLOCK, num_kv_heads=heads, head_size=head,
               dtype=torch.bfloat16, order=order, device=device)
    return engine, connector, (lambda fill=None, g=None: make_kv_caches(layout, fill=fill, generator=g, **geo))


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16)


def run_steps(gen):
    """(what each step yielded, the generator's return value): a layerwise load's steps and its mask."""
    steps = []
    while True:
        try:
            steps.append(next(gen))
        except StopIteration as end:
            return steps, end.value


def check_paged(layout, src, src_slots, dst, dst_slots, caches):
    """dst holds src's tokens at dst_slots; every other slot still holds the sentinel."""
    assert torch.equal(bits(paged_gather_ref(dst, dst_slots, layout)), bits(paged_gather_ref(src, src_slots, layout)))
    untouched = torch.ones(BLOCKS * BLOCK, dtype=torch.bool)
    untouched[dst_slots.cpu()] = False
    rest = untouched.nonzero().squeeze(1)
    assert torch.equal(bits(paged_gather_ref(dst, rest, layout)),
                       bits(paged_gather_ref(caches(fill=SENTINEL), rest, layout)))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", list(CONNECTORS))
@pytest.mark.parametrize("layout,order", LAYOUTS)
def test_round_trip(kind, layout, order, device):
    engine, connector, caches = setup(kind, layout, order, device)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 1000, (NUM_TOKENS,), generator=g)
    src, dst = caches(g=g), caches(fill=SENTINEL)
    src_slots = random_slot_mapping(NUM_TOKENS, num_blocks=BLOCKS, block_size=BLOCK, generator=g, device=device)
    dst_slots = random_slot_mapping(NUM_TOKENS, num_blocks=BLOCKS, block_size=BLOCK, generator=g, device=device)
    assert engine.store(tokens, kvcaches=src, slot_mapping=src_slots) == NUM_TOKENS
    if kind == "v2":
        ret = engine.retrieve(tokens, kvcaches=dst, slot_mapping=dst_slots)
    else:
        steps, ret = run_steps(engine.retrieve_layer(tokens, kvcaches=dst, slot_mapping=dst_slots))
        assert steps == [None] * LAYERS
    assert bool(ret.all())
    check_paged(layout, src, src_slots, dst, dst_slots, caches)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout,order", LAYOUTS)
def test_buffer_holds_the_layer_and_flushes_it(layout, order, device):
    engine, connector, caches = setup("buffer", layout, order, device)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 1000, (NUM_TOKENS,), generator=g)
    src, dst = caches(g=g), caches(fill=SENTINEL)
    src_slots = random_slot_mapping(NUM_TOKENS, num_blocks=BLOCKS, block_size=BLOCK, generator=g, device=device)
    dst_slots = random_slot_mapping(NUM_TOKENS, num_blocks=BLOCKS, block_size=BLOCK, generator=g, device=device)
    engine.store(tokens, kvcaches=src, slot_mapping=src_slots)
    gen = engine.retrieve_layer(tokens, kvcaches=dst, slot_mapping=dst_slots, write_paged=False)
    for layer in range(LAYERS):
        assert next(gen) is None
        buf = connector.get_layer_buffer(layer)
        want = paged_gather_layer_ref(src[layer], src_slots, layout)        # [T, 2, H] / MLA [T, C]
        want = want.unsqueeze(0) if layout == "mla" else want.permute(1, 0, 2)
        assert buf.shape == want.shape and connector.buffer_start == 0
        assert torch.equal(bits(buf), bits(want))
        # not flushed yet: the paged cache is all sentinel
        assert bool((paged_gather_layer_ref(dst[layer], torch.arange(BLOCKS * BLOCK), layout) == SENTINEL).all())
        connector.flush_layer_to_paged(layer, dst_slots, dst)
    with pytest.raises(StopIteration) as end:
        next(gen)
    assert bool(end.value.value.all()), "the generator returns the mask of loaded tokens"
    check_paged(layout, src, src_slots, dst, dst_slots, caches)
    with pytest.raises(ValueError, match="slot_mapping"):
        connector.flush_layer_to_paged(LAYERS - 1, dst_slots[:-1], dst)


def test_buffer_ring_and_growth():
    _, connector, _ = setup("buffer", "vllm_cpu", "LBNHC")
    with pytest.raises(ValueError, match="not in the buffer"):
        connector.get_layer_buffer(0)
    assert isinstance(connector, VLLMPagedMemLayerwiseGPUConnector)  # the engine's layerwise test
    with pytest.raises(ValueError, match="num_buffers"):
        VLLMBufferLayerwiseGPUConnector(hidden_dim_size=32, num_layers=2, chunk_size=16, dtype=torch.bfloat16,
                                        layout="vllm_cpu", num_buffers=2)
    small = connector.ensure_buffer(8, torch.device("cpu"))
    assert connector.ensure_buffer(8, torch.device("cpu")) is small       # reused
    assert connector.ensure_buffer(40, torch.device("cpu")).shape[2] >= 40  # grown


def test_blending_requires_layerwise():
    with pytest.raises(ValueError, match="use_layerwise"):
        LMCacheEngineConfig.from_defaults(chunk_size=CHUNK, enable_blending=True, use_layerwise=False)


def test_kernels_run_in_these_tests():
    """Without CUDA the root conftest turns on Triton's interpreter: the connectors ran the kernels."""
    from lmcache_triton.kernels import use_triton
    assert use_triton(torch.device("cuda" if torch.cuda.is_available() else "cpu"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("stage_min", [pytest.param(0, id="staged"), pytest.param(1 << 40, id="zero-copy")])
def test_pinned_full_chunks_are_staged_and_round_trip(monkeypatch, stage_min):
    """Full chunks in pinned host memory go through a device buffer and one DMA each way; smaller
    ones the kernel reads over PCIe. Both land the same bytes, several chunks deep (the two
    buffers are reused)."""
    from lmcache_triton.engine import gpu_connector

    monkeypatch.setattr(gpu_connector, "STAGE_MIN_BYTES", stage_min)
    calls = {"gather": 0, "scatter": 0}
    for name in calls:
        real = getattr(gpu_connector._Staging, name)
        monkeypatch.setattr(gpu_connector._Staging, name,
                            lambda self, *a, _real=real, _name=name: (calls.__setitem__(_name, calls[_name] + 1),
                                                                      _real(self, *a))[1])
    engine, connector, caches = setup("v2", "vllm_packed", "LBNHC", "cuda")
    g = torch.Generator().manual_seed(3)
    n = 4 * CHUNK + 5
    tokens = torch.randint(0, 1000, (n,), generator=g)
    src, dst = caches(g=g), caches(fill=SENTINEL)
    src_slots = torch.randperm(BLOCKS * BLOCK, generator=g)[:n].cuda()
    dst_slots = torch.randperm(BLOCKS * BLOCK, generator=g)[:n].cuda()
    assert engine.store(tokens, kvcaches=src, slot_mapping=src_slots) == n
    assert bool(engine.retrieve(tokens, kvcaches=dst, slot_mapping=dst_slots).all())
    assert torch.equal(bits(paged_gather_ref(dst, dst_slots, "vllm_packed")),
                       bits(paged_gather_ref(src, src_slots, "vllm_packed")))
    assert (calls["gather"] > 0 and calls["scatter"] > 0) == (stage_min == 0)


def test_a_layerwise_store_and_load_is_one_launch_per_layer(monkeypatch):
    """A step's objects of consecutive chunks are allocated side by side, so each layer of a
    request moves in one launch (was one per chunk and layer), and the bytes are the same."""
    from lmcache_triton.kernels import paged_copy, use_triton

    if not use_triton(torch.device("cpu")):
        pytest.skip("counts Triton launches: on a CPU host they run only in the interpreter")
    launches = []
    real = paged_copy._launch
    monkeypatch.setattr(paged_copy, "_launch", lambda kernel, layers, slots, chunk, start, end, *a:
                        (launches.append((kernel.__name__ if hasattr(kernel, "__name__") else "k", end - start)),
                         real(kernel, layers, slots, chunk, start, end, *a))[1])
    engine, connector, caches = setup("layerwise", "flash_attn", "LBNHC")
    g = torch.Generator().manual_seed(5)
    n = 4 * CHUNK + 5  # four whole chunks and a partial one
    tokens = torch.randint(0, 1000, (n,), generator=g)
    src, dst = caches(g=g), caches(fill=SENTINEL)
    src_slots = torch.randperm(BLOCKS * BLOCK, generator=g)[:n]
    dst_slots = torch.randperm(BLOCKS * BLOCK, generator=g)[:n]
    assert engine.store(tokens, kvcaches=src, slot_mapping=src_slots) == n
    assert [count for _, count in launches] == [n] * LAYERS, "one launch per layer, all five chunks"
    launches.clear()
    _, ret = run_steps(engine.retrieve_layer(tokens, kvcaches=dst, slot_mapping=dst_slots))
    assert bool(ret.all()) and [count for _, count in launches] == [n] * LAYERS
    check_paged("flash_attn", src, src_slots, dst, dst_slots, caches)


def test_runs_merge_only_objects_side_by_side_with_consecutive_tokens():
    from lmcache_triton.engine.gpu_connector import _runs
    from lmcache_triton.storage.memory import MemoryFormat, TensorMemoryPool

    pool = TensorMemoryPool(1 << 20, pin_memory=False, alignment=512)
    shape = lambda t: (t, 2, 64)  # noqa: E731 - KV_T2D rows of 256 bytes
    a, b = pool.allocate(shape(4), torch.bfloat16, MemoryFormat.KV_T2D), pool.allocate(shape(4), torch.bfloat16,
                                                                                         MemoryFormat.KV_T2D)
    gap = pool.allocate(shape(2), torch.bfloat16, MemoryFormat.KV_T2D)
    c = pool.allocate(shape(4), torch.bfloat16, MemoryFormat.KV_T2D)
    for i, obj in enumerate((a, b, c)):
        obj.tensor.fill_(i)
    runs = list(_runs([a, b, c], [(0, 4), (4, 8), (8, 12)]))
    assert [(r[1], r[2]) for r in runs] == [(0, 8), (8, 12)], "c is past a gap: its own launch"
    assert runs[0][0].shape == shape(8) and torch.equal(runs[0][0][4:], b.tensor)
    assert [(r[1], r[2]) for r in _runs([a, b], [(0, 4), (5, 9)])] == [(0, 4), (5, 9)], "tokens not consecutive"
    for obj in (a, b, gap, c):
        obj.free()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("apart", [pytest.param(False, id="one-run"), pytest.param(True, id="objects-apart")])
def test_store_rotates_keys_on_the_cache_device_before_they_leave(device, apart):
    """CacheBlend's key rotation runs on each layer's K where the cache is (on a GPU: in a device
    buffer, before the copy to the host object), with each token's chunk start, offset included."""
    from lmcache_triton.engine.gpu_connector import KVTarget, _drain
    from lmcache_triton.storage.memory import MemoryFormat, TensorMemoryPool

    _, connector, caches = setup("buffer", "flash_attn", "LBNHC", device)
    g = torch.Generator().manual_seed(7)
    src = caches(g=g)
    offset, spans = 3, [(3, 3 + CHUNK), (3 + CHUNK, 3 + 2 * CHUNK), (3 + 2 * CHUNK, 3 + 2 * CHUNK + 5)]
    n = spans[-1][1]
    slots = torch.randperm(BLOCKS * BLOCK, generator=g)[:n - offset].to(device)
    pool = TensorMemoryPool(1 << 20, pin_memory=device == "cuda", alignment=512)
    objs = []
    for _ in range(LAYERS):
        layer = []
        for s, e in spans:
            layer.append(pool.allocate(connector.get_shape(e - s), torch.bfloat16, MemoryFormat.KV_T2D))
            if apart:  # a gap after each object: every chunk is its own run
                pool.allocate(connector.get_shape(1), torch.bfloat16, MemoryFormat.KV_T2D)
        objs.append(layer)
    calls = []

    def rotation(k: torch.Tensor, chunk_starts: torch.Tensor) -> None:
        calls.append((k.device.type, k.shape[0], chunk_starts.tolist()))
        k.add_(chunk_starts[:, None].to(k.dtype))

    _drain(connector.batched_from_gpu(objs, [s for s, _ in spans], [e for _, e in spans],
                                      KVTarget(src, slots, offset), key_rotation=rotation))
    if device == "cuda":
        torch.cuda.synchronize()
    want_starts = [s for s, e in spans for _ in range(e - s)]
    runs = [[(s, e)] for s, e in spans] if apart else [spans]
    assert [c[0] for c in calls] == [device] * LAYERS * len(runs), "rotated where the cache is"
    assert [c[2] for c in calls] == [[s for s, e in run for _ in range(e - s)] for run in runs] * LAYERS
    for layer in range(LAYERS):
        kv = paged_gather_layer_ref(src[layer], slots, "flash_attn").cpu()  # [T, 2, hidden]
        k = kv[:, 0] + torch.tensor(want_starts)[:, None].to(torch.bfloat16)
        for obj, (s, e) in zip(objs[layer], spans):
            got = obj.tensor.cpu()
            assert torch.equal(bits(got[:, 1]), bits(kv[s - offset:e - offset, 1])), "V moves untouched"
            assert torch.equal(bits(got[:, 0]), bits(k[s - offset:e - offset])), "K rotated, token by token"


@pytest.mark.parametrize("kind", ["v2", "layerwise", "buffer"])
def test_moves_never_wait_for_the_device(kind, monkeypatch):
    """A store and a load, step by step, make none of the calls that would make the host wait for a
    GPU (values read back, value-sized outputs): the slots' range check runs only where they are in
    host memory, which this test says they are not, to walk the GPU branch on a CPU."""
    from lmcache_triton.engine.gpu_connector import KVTarget
    from lmcache_triton.kernels import common
    from lmcache_triton.storage.memory import MemoryFormat, TensorMemoryPool
    from lmcache_triton.tools.testing import HostSyncs

    monkeypatch.setattr(common, "in_host_memory", lambda t: False)
    _, connector, caches = setup(kind, "flash_attn", "LBNHC")
    g = torch.Generator().manual_seed(9)
    src, dst = caches(g=g), caches(fill=SENTINEL)
    spans = [(0, CHUNK), (CHUNK, 2 * CHUNK), (2 * CHUNK, 2 * CHUNK + 5)]
    slots = torch.randperm(BLOCKS * BLOCK, generator=g)[:spans[-1][1]]
    pool = TensorMemoryPool(1 << 20, pin_memory=False, alignment=512)
    objs = [[pool.allocate(connector.get_shape(e - s), torch.bfloat16, connector.fmt) for s, e in spans]
            for _ in range(connector.steps)]
    starts, ends = [s for s, _ in spans], [e for _, e in spans]
    with HostSyncs() as syncs:
        for step, _ in enumerate(connector.batched_from_gpu(objs, starts, ends, KVTarget(src, slots))):
            syncs.step = ("store", step)
        for step, _ in enumerate(connector.batched_to_gpu(objs, starts, ends, KVTarget(dst, slots))):
            syncs.step = ("load", step)
    assert syncs.calls == [], f"calls that would wait for a GPU, (call, step): {syncs.calls}"
    check_paged("flash_attn", src, slots, dst, slots, caches)


def test_to_device_keeps_a_tensor_already_there():
    from lmcache_triton.kernels.common import to_device

    t = torch.arange(5)
    assert to_device(t, torch.device("cpu")) is t  # nothing to move: the same tensor, no copy


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_to_device_sends_host_tensors_without_a_wait():
    from lmcache_triton.kernels.common import to_device

    t = torch.arange(5)
    dev = torch.device("cuda", torch.cuda.current_device())
    torch.cuda.set_sync_debug_mode("error")  # a pageable copy, or any other wait, raises
    try:
        got = to_device(t, dev)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert got.device == dev and torch.equal(got.cpu(), t)
