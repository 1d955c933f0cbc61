"""The torch path of a CPU cache (kernels/reference.py: where numba is missing) at the block sizes
vLLM uses, against the oracle. (The compiled copy that serves where numba is there, i.e. always
with vLLM: test_cpu_copy.py.)

Every layout vLLM hands over (vllm_packed in each of its six stride orders, vllm_cpu, flash_attn,
flashinfer, mla), block sizes 16 and 128, both directions and both chunk formats, into
sentinel-filled destinations, bit for bit against kernels/naive.py. reference.path_counts proves
that whole blocks moved as whole blocks in both directions, whatever the layout, and that what is
not a whole block (a partial block, -1 padding, an unaligned run) went token by token. Speed is
measured by `python -m bench.engine`, never here.
"""

from __future__ import annotations

import pytest
import torch

from lmcache_triton.kernels import paged_copy, paged_gather, paged_gather_layer, paged_scatter, paged_scatter_layer
from lmcache_triton.kernels import reference
from lmcache_triton.kernels.naive import naive_gather, naive_gather_layer, naive_scatter, naive_scatter_layer
from lmcache_triton.tools.testing import PACKED_ORDERS

from test_paged_copy import bits, make_caches, rand_tensor, sentinel_tensor  # tests/kernels is on sys.path

LAYOUTS = [("vllm_packed", o) for o in PACKED_ORDERS] + [(x, None) for x in ("vllm_cpu", "flash_attn", "flashinfer",
                                                                              "mla")]
LAYOUT_PARAMS = [pytest.param(l, o, id=f"{l}-{o}" if o else l) for l, o in LAYOUTS]
NUM_BLOCKS, NUM_LAYERS = 6, 3


def whole(block: int, bs: int) -> list[int]:
    return [block * bs + o for o in range(bs)]


# name -> (slots for block size bs, how many of its aligned groups of bs tokens fill one block in order)
PATTERNS = {
    "whole-permuted": lambda bs: (whole(4, bs) + whole(1, bs) + whole(5, bs) + whole(0, bs), 4),
    "whole-then-partial": lambda bs: (whole(3, bs) + whole(2, bs) + whole(1, bs)[: bs // 2 + 1], 2),
    "padded": lambda bs: (whole(2, bs) + [-1] * bs + whole(0, bs) + [-1, -1] + whole(5, bs)[:3], 2),
    "unaligned": lambda bs: (whole(2, bs)[3:] + whole(4, bs) + whole(1, bs)[::-1], 0),
}


def geometry(layout: str) -> tuple[int, int]:
    """(heads, head_size): odd on purpose, and a latent for MLA."""
    return (1, 20) if layout == "mla" else (3, 12)


def caches_of(layout, order, bs, dtype, fill):
    heads, head_size = geometry(layout)
    return make_caches(layout, order, NUM_LAYERS, NUM_BLOCKS, bs, heads, head_size, dtype, "cpu", fill)


def chunk_shape(layout: str, scope: str, num_tokens: int) -> tuple[int, ...]:
    heads, head_size = geometry(layout)
    num_kv, hidden = (1 if layout == "mla" else 2), heads * head_size
    if scope == "all-layers":
        return num_kv, NUM_LAYERS, num_tokens, hidden
    return (num_tokens, hidden) if layout == "mla" else (num_tokens, 2, hidden)


@pytest.fixture(autouse=True)
def torch_path(monkeypatch):
    """What a CPU host without TRITON_INTERPRET and numba runs: the launchers' torch path."""
    monkeypatch.setattr(paged_copy, "use_triton", lambda device: False)
    monkeypatch.setattr(paged_copy, "_cpu_copy", False)


def moved(fn) -> dict[str, int]:
    before = dict(reference.path_counts)
    fn()
    return {k: v - before.get(k, 0) for k, v in reference.path_counts.items() if v != before.get(k, 0)}


def run(layout, order, bs, dtype, direction, scope, slots) -> dict[str, int]:
    """The launcher and the oracle on identical inputs into sentinel-filled destinations; returns
    which paths the launcher took."""
    gen = torch.Generator().manual_seed(bs + len(slots))
    shape = chunk_shape(layout, scope, len(slots))
    layer = 1
    if direction == "gather":
        caches = caches_of(layout, order, bs, dtype, lambda s: rand_tensor(s, dtype, "cpu", gen))
        got, want = (sentinel_tensor(shape, dtype, "cpu") for _ in range(2))
        if scope == "all-layers":
            paths = moved(lambda: paged_gather(caches, slots, layout, out=got))
            naive_gather(caches, slots, layout, out=want)
        else:
            paths = moved(lambda: paged_gather_layer(caches[layer], slots, layout, out=got))
            naive_gather_layer(caches[layer], slots, layout, out=want)
        assert torch.equal(bits(got), bits(want))
        return paths
    chunk = rand_tensor(shape, dtype, "cpu", gen)
    got, want = (caches_of(layout, order, bs, dtype, lambda s: sentinel_tensor(s, dtype, "cpu")) for _ in range(2))
    if scope == "all-layers":
        paths = moved(lambda: paged_scatter(chunk, got, slots, layout))
        naive_scatter(chunk, want, slots, layout)
    else:
        paths = moved(lambda: paged_scatter_layer(chunk, got[layer], slots, layout))
        naive_scatter_layer(chunk, want[layer], slots, layout)
    for l, (a, b) in enumerate(zip(got, want)):
        assert torch.equal(bits(a), bits(b)), f"layer {l} differs from the oracle"
    return paths


@pytest.mark.parametrize("pattern", list(PATTERNS))
@pytest.mark.parametrize("scope", ["all-layers", "one-layer"])
@pytest.mark.parametrize("direction", ["gather", "scatter"])
@pytest.mark.parametrize("bs", [16, 128])
@pytest.mark.parametrize("layout,order", LAYOUT_PARAMS)
def test_whole_blocks_both_directions(layout, order, bs, direction, scope, pattern):
    slot_list, groups = PATTERNS[pattern](bs)
    slots = torch.tensor(slot_list, dtype=torch.int64)
    paths = run(layout, order, bs, torch.bfloat16, direction, scope, slots)
    valid = int((slots >= 0).sum())
    assert paths.get(f"{direction}.blocks", 0) == groups * bs, paths
    assert paths.get(f"{direction}.tokens", 0) == valid - groups * bs, paths


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.uint8, torch.float8_e4m3fn],
                         ids=["fp16", "fp32", "u8", "fp8"])
@pytest.mark.parametrize("layout,order", LAYOUT_PARAMS)
def test_whole_blocks_every_dtype(layout, order, dtype):
    """Whole blocks in permuted order in both directions, for each element width (the copies move
    bytes as integers, as wide as the layout allows)."""
    slot_list, groups = PATTERNS["whole-permuted"](16)
    slots = torch.tensor(slot_list, dtype=torch.int32)
    for direction in ("gather", "scatter"):
        paths = run(layout, order, 16, dtype, direction, "all-layers", slots)
        assert paths.get(f"{direction}.blocks", 0) == groups * 16, paths
        assert paths.get(f"{direction}.tokens", 0) == 0, paths


@pytest.mark.parametrize("layout,order", [pytest.param("vllm_packed", "LBHNC", id="packed-LBHNC"),
                                          pytest.param("vllm_cpu", None, id="vllm_cpu"),
                                          pytest.param("flash_attn", None, id="flash_attn")])
def test_head_size_of_whole_words(layout, order):
    """head_size 128 (a whole number of 8-byte words per row) and 8 heads, as vLLM's models have:
    the widest integer view of the rows, round trip through a strided (layerwise) chunk too."""
    gen = torch.Generator().manual_seed(5)
    bs, heads, head_size = 16, 8, 128
    caches = make_caches(layout, order, 2, 5, bs, heads, head_size, torch.bfloat16, "cpu",
                         lambda s: rand_tensor(s, torch.bfloat16, "cpu", gen))
    slots = torch.tensor(whole(3, bs) + whole(0, bs) + whole(4, bs)[:5] + [-1], dtype=torch.int64)
    got = sentinel_tensor((2, 2, len(slots), heads * head_size), torch.bfloat16, "cpu")
    want = naive_gather(caches, slots, layout, out=sentinel_tensor(got.shape, torch.bfloat16, "cpu"))
    paths = moved(lambda: paged_gather(caches, slots, layout, out=got))
    assert torch.equal(bits(got), bits(want)) and paths["gather.blocks"] == 2 * bs
    for direction_layer in (0, 1):
        fresh = make_caches(layout, order, 2, 5, bs, heads, head_size, torch.bfloat16, "cpu",
                            lambda s: sentinel_tensor(s, torch.bfloat16, "cpu"))
        expected = make_caches(layout, order, 2, 5, bs, heads, head_size, torch.bfloat16, "cpu",
                               lambda s: sentinel_tensor(s, torch.bfloat16, "cpu"))
        layer_chunk = got[:, direction_layer].transpose(0, 1).contiguous()  # KV_T2D [T, 2, hidden]
        paths = moved(lambda: paged_scatter_layer(layer_chunk, fresh[direction_layer], slots, layout))
        naive_scatter_layer(layer_chunk, expected[direction_layer], slots, layout)
        assert paths["scatter.blocks"] == 2 * bs
        for a, b in zip(fresh, expected):
            assert torch.equal(bits(a), bits(b))


@pytest.mark.parametrize("layout,order,one_allocation,pairs", [
    pytest.param("vllm_packed", "BLNHC", True, 1, id="packed-BLNHC"),
    pytest.param("vllm_packed", "LBHNC", True, 1, id="packed-LBHNC"),
    pytest.param("vllm_cpu", None, True, 2, id="vllm_cpu"),          # K transposed: K and V apart
    pytest.param("flash_attn", None, True, 1, id="flash_attn-one-allocation"),
    pytest.param("flash_attn", None, False, 2 * NUM_LAYERS, id="flash_attn-per-layer"),
    pytest.param("mla", None, True, 1, id="mla"),
])
def test_as_few_ops_as_the_memory_allows(layout, order, one_allocation, pairs):
    """All layers in one op where they lie equally spaced in one allocation, K with V where V lies
    at a fixed offset from K; a pair per layer and K/V where layers are separate allocations."""
    from lmcache_triton.kernels.common import as_bits, prepare_layers
    from lmcache_triton.tools.testing import make_kv_caches

    heads, head_size = geometry(layout)
    if one_allocation:
        caches = make_kv_caches(layout, num_layers=NUM_LAYERS, num_blocks=NUM_BLOCKS, block_size=16,
                                num_kv_heads=heads, head_size=head_size, order=order or "LBNHC")
    else:
        caches = caches_of(layout, order, 16, torch.float16, lambda s: torch.zeros(s, dtype=torch.float16))
    layers = prepare_layers(caches, layout)
    chunk = torch.zeros(chunk_shape(layout, "all-layers", 32), dtype=caches[0].dtype)
    found = reference._block_pairs(layers, as_bits(chunk), 2)
    assert len(found) == pairs
    for x, c in found:
        assert x.shape[1:] == c.shape[1:] and c.shape[0] == 2 and x.shape[0] == NUM_BLOCKS


def test_one_copy_per_block_and_index_copy_agree():
    """Scatter writes big blocks (more elements than torch splits over threads) with one copy each,
    small ones with index_copy_ on the widest words: both against the oracle, in one allocation
    (a copy per block of all layers) and in separate ones (index_copy_ per layer)."""
    from lmcache_triton.tools.testing import make_kv_caches

    gen = torch.Generator().manual_seed(9)
    bs, heads, head_size, layers = 16, 8, 128, 3
    slots = torch.tensor(whole(5, bs) + whole(2, bs) + whole(0, bs)[:3] + [-1], dtype=torch.int64)
    chunk = rand_tensor((2, layers, len(slots), heads * head_size), torch.bfloat16, "cpu", gen)
    for one_allocation, block_copies in ((True, 2), (False, 0)):
        def fresh():
            if one_allocation:
                return make_kv_caches("flash_attn", num_layers=layers, num_blocks=6, block_size=bs,
                                      num_kv_heads=heads, head_size=head_size, fill=0)
            return make_caches("flash_attn", None, layers, 6, bs, heads, head_size, torch.bfloat16, "cpu",
                               lambda s: sentinel_tensor(s, torch.bfloat16, "cpu"))
        got, want = fresh(), fresh()
        paths = moved(lambda: paged_scatter(chunk, got, slots, "flash_attn"))
        naive_scatter(chunk, want, slots, "flash_attn")
        assert all(torch.equal(bits(a), bits(b)) for a, b in zip(got, want))
        assert paths["scatter.blocks"] == 2 * bs and paths["scatter.tokens"] == 3
        assert paths.get("scatter.block_copies", 0) == block_copies


def test_inference_tensors_from_inference_mode():
    """The engine copies under torch.inference_mode, into and out of inference tensors (vLLM's
    caches are made there too): the copy threads must copy in that mode as well."""
    bs = 16
    slots = torch.tensor(whole(2, bs) + whole(0, bs) + [-1, 5 * bs + 1], dtype=torch.int64)
    with torch.inference_mode():
        gen = torch.Generator().manual_seed(11)
        caches = caches_of("flash_attn", None, bs, torch.float16, lambda s: rand_tensor(s, torch.float16, "cpu", gen))
        out = paged_gather(caches, slots, "flash_attn")
        fresh = caches_of("flash_attn", None, bs, torch.float16, lambda s: sentinel_tensor(s, torch.float16, "cpu"))
        paged_scatter(out, fresh, slots, "flash_attn")
        assert torch.equal(bits(paged_gather(fresh, slots, "flash_attn")), bits(out))


def test_layers_are_prepared_once_for_the_same_tensors():
    """The launchers prepare the same Layers (and the CPU path's block views with them) for the same
    tensors, and anew for other tensors, moved ones included; an entry goes with its tensors."""
    import gc

    from lmcache_triton.kernels import common
    from lmcache_triton.tools.testing import make_kv_caches

    common._prepared.clear()                                   # a cache: room for this test's entries
    caches = make_kv_caches("flash_attn", num_layers=2, num_blocks=4, block_size=16, num_kv_heads=2, head_size=8)
    first = common.prepare_layers(caches, "flash_attn")
    assert common.prepare_layers(tuple(caches), "flash_attn") is first
    others = [c.view(c.shape) for c in caches]                 # the same memory, other tensor objects
    assert common.prepare_layers(others, "flash_attn") is not first
    roots = make_caches("flash_attn", None, 2, 4, 16, 2, 8, torch.float16, "cpu", torch.zeros)  # not views
    common.prepare_layers(roots, "flash_attn")
    keys = [("flash_attn", *map(id, others)), ("flash_attn", *map(id, roots))]
    assert all(k in common._prepared for k in keys)
    del others, roots
    gc.collect()
    assert not any(k in common._prepared for k in keys)
    caches[1].set_(torch.zeros_like(caches[1]))               # moved to other memory: prepared anew
    moved = common.prepare_layers(caches, "flash_attn")
    assert moved is not first and moved.k[1].data_ptr() != first.k[1].data_ptr()
    slots = torch.tensor(whole(2, 16), dtype=torch.int64)
    got = paged_gather(caches, slots, "flash_attn")
    assert torch.equal(bits(got), bits(naive_gather(caches, slots, "flash_attn")))


# A request's chunks as the engine moves them: spans of tokens (start, end) over one slot mapping,
# and how their chunk tensors lie: "pool" equally spaced in one allocation (the engine's first-fit
# pool), "apart" separate allocations. Slots for block size 16 over 14 blocks.
MANY = {
    "whole-permuted": ([9, 2, 7, 0, 13, 4, 11, 5], [(0, 32), (32, 64), (64, 96), (96, 128)], 8),
    "short-last-whole": ([3, 8, 1, 12, 6], [(0, 32), (32, 64), (64, 80)], 5),
    "partial-last": ([3, 8, 1, 12, 6], [(0, 32), (32, 64), (64, 71)], 4),
    "gap": ([10, 2, 6, 0, 9, 4], [(0, 32), (64, 96)], 4),
    "padded-inside": ([10, 2, -1, 0, 9, 4], [(0, 32), (32, 64), (64, 96)], 5),
}


def many_slots(blocks: list[int], bs: int = 16) -> torch.Tensor:
    return torch.tensor([s for b in blocks for s in (whole(b, bs) if b >= 0 else [-1] * bs)], dtype=torch.int64)


def many_chunks(layout: str, spans, where: str, fill) -> list[torch.Tensor]:
    shapes = [chunk_shape(layout, "all-layers", e - s) for s, e in spans]
    if where == "apart":
        return [fill(sh) for sh in shapes]
    size = max(torch.Size(sh).numel() for sh in shapes)
    pool = fill((len(spans), size))      # one allocation, chunks at equal spacing (a partial last one too)
    return [pool[i, : torch.Size(sh).numel()].view(sh) for i, sh in enumerate(shapes)]


@pytest.mark.parametrize("where", ["pool", "apart"])
@pytest.mark.parametrize("pattern", list(MANY))
@pytest.mark.parametrize("direction", ["gather", "scatter"])
@pytest.mark.parametrize("layout,order", LAYOUT_PARAMS)
def test_many_chunks_at_once(layout, order, direction, pattern, where):
    """PagedTarget.gather_many / scatter_many (a store's or load's chunks in one call) move exactly
    what one call per chunk would: bit for bit against the oracle chunk by chunk, sentinels
    elsewhere; whole blocks as whole blocks, the rest token by token."""
    from lmcache_triton.kernels.paged_copy import PagedTarget

    blocks, spans, whole_groups = MANY[pattern]
    slots = many_slots(blocks)
    dtype, gen = torch.bfloat16, torch.Generator().manual_seed(len(spans))
    heads, head_size = geometry(layout)

    def caches(fill):
        return make_caches(layout, order, NUM_LAYERS, 14, 16, heads, head_size, dtype, "cpu", fill)

    if direction == "gather":
        src = caches(lambda s: rand_tensor(s, dtype, "cpu", gen))
        got = many_chunks(layout, spans, where, lambda s: sentinel_tensor(s, dtype, "cpu"))
        paths = moved(lambda: PagedTarget.of(src, slots, layout).gather_many(spans, got))
        for (s, e), chunk in zip(spans, got):
            want = naive_gather(src, slots[s:e], layout, out=sentinel_tensor(chunk.shape, dtype, "cpu"))
            assert torch.equal(bits(chunk), bits(want)), (s, e)
    else:
        chunks = many_chunks(layout, spans, where, lambda s: rand_tensor(s, dtype, "cpu", gen))
        got, want = (caches(lambda s: sentinel_tensor(s, dtype, "cpu")) for _ in range(2))
        paths = moved(lambda: PagedTarget.of(got, slots, layout).scatter_many(spans, chunks))
        for (s, e), chunk in zip(spans, chunks):
            naive_scatter(chunk, want, slots[s:e], layout)
        for l, (a, b) in enumerate(zip(got, want)):
            assert torch.equal(bits(a), bits(b)), f"layer {l} differs from the oracle"
    assert paths.get(f"{direction}.blocks", 0) == whole_groups * 16, paths
    valid = sum(int((slots[s:e] >= 0).sum()) for s, e in spans)
    assert paths.get(f"{direction}.tokens", 0) == valid - whole_groups * 16, paths
    # chunks of one size equally spaced in one allocation: their views from one view of them all
    stacked = {"whole-permuted": 4, "short-last-whole": 2, "partial-last": 2}.get(pattern, 0) if where == "pool" else 0
    assert paths.get("chunks.stacked", 0) == stacked, paths


def test_many_chunks_checks_each_chunk():
    """A chunk of the wrong shape or a span past the slots is refused before anything moves."""
    from lmcache_triton.kernels.paged_copy import PagedTarget

    src = caches_of("flash_attn", None, 16, torch.float16, lambda s: torch.ones(s, dtype=torch.float16))
    target = PagedTarget.of(src, many_slots([1, 0, 3]), "flash_attn")
    good = torch.zeros(chunk_shape("flash_attn", "all-layers", 16), dtype=torch.float16)
    bad = torch.zeros(chunk_shape("flash_attn", "all-layers", 15), dtype=torch.float16)
    with pytest.raises(ValueError, match="out must have shape"):
        target.gather_many([(0, 16), (16, 32)], [good, bad])
    with pytest.raises(ValueError, match="does not cover tokens"):
        target.gather_many([(0, 16), (40, 56)], [good, good.clone()])
    assert not good.any()
