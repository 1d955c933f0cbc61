"""Paged gather/scatter kernels vs. their pure-torch references (bit-exact, sentinel-filled).

Both against the independent oracle, kernels/naive.py: test_naive_oracle.py."""

from __future__ import annotations

import math

import pytest
import torch

from lmcache_triton.kernels import (LAYOUTS, kv_geometry, kv_views, paged_gather, paged_gather_layer,
                                    paged_gather_layer_ref, paged_gather_ref, paged_scatter,
                                    paged_scatter_layer, paged_scatter_layer_ref, paged_scatter_ref)
from lmcache_triton.kernels import paged_copy, use_triton
from lmcache_triton.kernels.common import INTERPRETED

from lmcache_triton.tools.testing import PACKED_ORDERS as PERMS  # noqa: E402  vLLM's 6 stride orders
DTYPES = [
    pytest.param(torch.float16, id="fp16"),
    pytest.param(torch.bfloat16, id="bf16"),
    pytest.param(torch.float32, id="fp32"),
    pytest.param(torch.uint8, id="u8"),
    pytest.param(torch.float8_e4m3fn, id="fp8"),
]
SENTINEL = 0x5A  # byte pattern every destination starts with
cuda_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


# ---------------------------------------------------------------- helpers

def bits(t: torch.Tensor) -> torch.Tensor:
    """Integer view of the same width: torch.equal on it is bit equality (NaNs, fp8 included)."""
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def rand_tensor(shape, dtype, device, gen) -> torch.Tensor:
    size = torch.empty(0, dtype=dtype).element_size()
    raw = torch.randint(0, 256, (*shape[:-1], shape[-1] * size), dtype=torch.uint8, generator=gen)
    return raw.view(dtype).to(device)  # random bit patterns, NaN payloads included


def sentinel_tensor(shape, dtype, device) -> torch.Tensor:
    size = torch.empty(0, dtype=dtype).element_size()
    return torch.full((*shape[:-1], shape[-1] * size), SENTINEL, dtype=torch.uint8).view(dtype).to(device)


def make_caches(layout: str, perm: str | None, num_layers: int, num_blocks: int, block_size: int,
                heads: int, head_size: int, dtype, device, fill) -> list[torch.Tensor]:
    """Per-layer tensors as vLLM hands them over. fill(shape) -> tensor of that shape."""
    if layout == "vllm_packed":
        # One allocation in physical order `perm`; layer views of logical shape [B, H, N, 2*hs].
        sizes = dict(L=num_layers, B=num_blocks, N=block_size, H=heads, C=2 * head_size)
        alloc = fill([sizes[a] for a in perm])
        logical = alloc.permute([perm.index(a) for a in "LBHNC"])
        return [logical[l] for l in range(num_layers)]
    if layout == "vllm_cpu":
        alloc = fill([num_layers, num_blocks, heads, 2 * block_size, head_size])
        return [alloc[l] for l in range(num_layers)]
    if layout == "flash_attn":  # separate allocations per layer (older vLLM)
        return [fill([2, num_blocks, block_size, heads, head_size]) for _ in range(num_layers)]
    if layout == "flashinfer":
        return [fill([num_blocks, 2, block_size, heads, head_size]) for _ in range(num_layers)]
    assert layout == "mla" and heads == 1
    alloc = fill([num_layers, num_blocks, block_size, head_size])
    return [alloc[l] for l in range(num_layers)]


def make_slots(num_tokens: int, num_blocks: int, block_size: int, gen, dtype=torch.int64) -> torch.Tensor:
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    pad = torch.rand(num_tokens, generator=gen) < 0.15
    if num_tokens > 2:
        pad[num_tokens // 2] = True
    slots[pad] = -1
    return slots.to(dtype)


class Case:
    def __init__(self, layout, perm=None, block_size=16, heads=2, head_size=32, num_tokens=37, num_layers=3):
        self.layout, self.perm, self.block_size = layout, perm, block_size
        self.heads, self.head_size, self.num_tokens, self.num_layers = heads, head_size, num_tokens, num_layers
        # enough blocks for distinct slots, plus spare ones that must stay untouched
        self.num_blocks = math.ceil(num_tokens / block_size) + 3

    def caches(self, dtype, device, fill):
        return make_caches(self.layout, self.perm, self.num_layers, self.num_blocks, self.block_size,
                           self.heads, self.head_size, dtype, device, fill)

    @property
    def num_kv(self):
        return 1 if self.layout == "mla" else 2

    def chunk_shape(self):
        return (self.num_kv, self.num_layers, self.num_tokens, self.heads * self.head_size)

    def layer_shape(self):
        h = self.heads * self.head_size
        return (self.num_tokens, h) if self.layout == "mla" else (self.num_tokens, 2, h)


def setup(case: Case, dtype, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    caches = case.caches(dtype, device, lambda s: rand_tensor(s, dtype, device, gen))
    slots = make_slots(case.num_tokens, case.num_blocks, case.block_size, gen,
                       dtype=torch.int32 if seed % 2 else torch.int64)
    return gen, caches, slots


def clone_caches(caches: list[torch.Tensor]) -> list[torch.Tensor]:
    """Deep copy keeping shapes/strides and the one-allocation structure (clone each base once)."""
    copies = {}
    out = []
    for c in caches:
        base = c._base if c._base is not None else c
        if id(base) not in copies:
            copies[id(base)] = base.clone()
        nb = copies[id(base)]
        out.append(nb.as_strided(c.shape, c.stride(), c.storage_offset()))
    return out


def assert_caches_equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    for l, (x, y) in enumerate(zip(a, b)):
        assert torch.equal(bits(x), bits(y)), f"layer {l} differs"


# ---------------------------------------------------------------- parameter lists

LAYOUT_CASES = [
    *[pytest.param(Case("vllm_packed", p), id=f"vllm_packed-{p}") for p in PERMS],
    pytest.param(Case("vllm_cpu", heads=3, head_size=40), id="vllm_cpu-h3x40"),
    pytest.param(Case("flash_attn"), id="flash_attn"),
    pytest.param(Case("flashinfer", heads=1, head_size=64), id="flashinfer-h1x64"),
    pytest.param(Case("mla", heads=1, head_size=576, num_tokens=21), id="mla-576"),
    pytest.param(Case("mla", heads=1, head_size=72), id="mla-72"),
]

def _shape_cases() -> list:
    """block_size x (heads, head_size) x num_tokens, fully crossed, on every layout family (one dtype).

    vllm_packed rotates through the six stride permutations; MLA sweeps C in (576, 72).
    """
    cases, i = [], 0
    for bs in (16, 48, 64, 128):
        for t in (1, 17, 256, 300):
            layers = 2 if t > 17 else 3
            for h, hs in ((2, 32), (1, 64), (3, 40)):
                perm = PERMS[i % len(PERMS)]
                i += 1
                for layout, p in (("vllm_packed", perm), ("vllm_cpu", None), ("flash_attn", None),
                                  ("flashinfer", None)):
                    name = f"{layout}{'-' + p if p else ''}-bs{bs}-h{h}x{hs}-t{t}"
                    cases.append(pytest.param(Case(layout, p, bs, h, hs, t, layers), id=name))
            for c in (576, 72):
                cases.append(pytest.param(Case("mla", None, bs, 1, c, t, layers), id=f"mla{c}-bs{bs}-t{t}"))
    cases.append(pytest.param(Case("vllm_packed", "BHLNC", num_tokens=0), id="t0"))
    cases.append(pytest.param(Case("mla", None, 16, 1, 72, 0), id="mla-t0"))
    return cases


SHAPE_CASES = _shape_cases()

GPU_CASES = [
    pytest.param(Case(layout, perm, block_size=bs, heads=h, head_size=hs, num_tokens=t, num_layers=nl),
                 id=f"{layout}{'-' + perm if perm else ''}-bs{bs}-h{h}x{hs}-t{t}")
    for layout, perm in [*[("vllm_packed", p) for p in PERMS], ("vllm_cpu", None), ("flash_attn", None),
                         ("flashinfer", None), ("mla", None)]
    for bs in (16, 48, 64, 128)
    for (h, hs) in ([(1, 576), (1, 72)] if layout == "mla" else [(8, 128), (3, 40)])
    for t, nl in ((1, 4), (4097, 8))
]


# ---------------------------------------------------------------- the kernels vs. the references

def check_gather(case: Case, dtype, device, seed=0):
    _, caches, slots = setup(case, dtype, device, seed)
    out = sentinel_tensor(case.chunk_shape(), dtype, device)
    expected = paged_gather_ref(caches, slots, case.layout, out=sentinel_tensor(case.chunk_shape(), dtype, device))
    got = paged_gather(caches, slots, case.layout, out=out)
    assert got is out
    assert torch.equal(bits(out), bits(expected))
    pad = (slots == -1).to(device)
    assert torch.all(bits(out)[:, :, pad] == bits(sentinel_tensor((1,), dtype, device))[0])


def check_scatter(case: Case, dtype, device, seed=0):
    gen, _, slots = setup(case, dtype, device, seed)
    chunk = rand_tensor(case.chunk_shape(), dtype, device, gen)
    caches = case.caches(dtype, device, lambda s: sentinel_tensor(s, dtype, device))
    expected = clone_caches(caches)
    paged_scatter_ref(chunk, expected, slots, case.layout)
    paged_scatter(chunk, caches, slots, case.layout)
    assert_caches_equal(caches, expected)


def check_layerwise(case: Case, dtype, device, seed=0):
    gen, caches, slots = setup(case, dtype, device, seed)
    full = paged_gather_ref(caches, slots, case.layout)
    for l in (0, case.num_layers - 1):
        out = sentinel_tensor(case.layer_shape(), dtype, device)
        expected = paged_gather_layer_ref(caches[l], slots, case.layout,
                                          out=sentinel_tensor(case.layer_shape(), dtype, device))
        paged_gather_layer(caches[l], slots, case.layout, out=out)
        assert torch.equal(bits(out), bits(expected))
        valid = (slots >= 0).to(device)
        per_layer = full[0, l] if case.layout == "mla" else full[:, l].transpose(0, 1)
        assert torch.equal(bits(out)[valid], bits(per_layer)[valid])
    chunk = rand_tensor(case.layer_shape(), dtype, device, gen)
    target = case.caches(dtype, device, lambda s: sentinel_tensor(s, dtype, device))
    expected = clone_caches(target)
    paged_scatter_layer_ref(chunk, expected[1], slots, case.layout)
    paged_scatter_layer(chunk, target[1], slots, case.layout)
    assert_caches_equal(target, expected)  # other layers untouched too


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", LAYOUT_CASES)
def test_gather(case, dtype, device):
    check_gather(case, dtype, device)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", LAYOUT_CASES)
def test_scatter(case, dtype, device):
    check_scatter(case, dtype, device)


@pytest.mark.parametrize("case", LAYOUT_CASES)
def test_layerwise(case, device):
    check_layerwise(case, torch.bfloat16, device)


@pytest.mark.parametrize("case", SHAPE_CASES)
def test_shapes(case, device):
    check_gather(case, torch.float16, device, seed=1)
    check_scatter(case, torch.float16, device, seed=1)
    if case.num_tokens:
        check_layerwise(case, torch.float16, device, seed=1)


@pytest.mark.parametrize("case", LAYOUT_CASES[:1] + LAYOUT_CASES[6:])
def test_round_trip(case, device):
    _, caches, slots = setup(case, torch.float16, device, seed=3)
    chunk = paged_gather(caches, slots, case.layout)
    fresh = case.caches(torch.float16, device, lambda s: sentinel_tensor(s, torch.float16, device))
    paged_scatter(chunk, fresh, slots, case.layout)
    assert torch.equal(bits(paged_gather(fresh, slots, case.layout)), bits(chunk))
    # the mapped slots now hold the original bytes, everything else is still sentinel
    sentinel = bits(sentinel_tensor((1,), torch.float16, device))[0]
    valid = slots[slots >= 0].to(device)
    b, o = valid // case.block_size, valid % case.block_size
    mask = torch.zeros(case.num_blocks, case.block_size, dtype=torch.bool, device=device)
    mask[b, o] = True
    for src, dst in zip(caches, fresh):
        for x, y in zip(kv_views(src, case.layout), kv_views(dst, case.layout)):
            if x is None:
                continue
            assert torch.equal(bits(y)[mask], bits(x)[mask])
            assert torch.all(bits(y)[~mask] == sentinel)


def test_strided_chunks(device):
    """out/chunk need not be contiguous: every stride is read."""
    case = Case("flashinfer", block_size=16, heads=3, head_size=40, num_tokens=33)
    gen, caches, slots = setup(case, torch.bfloat16, device)
    two, nl, t, h = case.chunk_shape()
    out = sentinel_tensor((nl, 2, t, 2 * h), torch.bfloat16, device).transpose(0, 1)[..., ::2]
    paged_gather(caches, slots, case.layout, out=out)
    assert torch.equal(bits(out), bits(paged_gather_ref(caches, slots, case.layout,
                                                        out=sentinel_tensor(out.shape, torch.bfloat16, device))))
    fresh = case.caches(torch.bfloat16, device, lambda s: sentinel_tensor(s, torch.bfloat16, device))
    ref = clone_caches(fresh)
    paged_scatter(out, fresh, slots, case.layout)
    paged_scatter_ref(out.contiguous(), ref, slots, case.layout)
    assert_caches_equal(fresh, ref)
    layer_out = sentinel_tensor((2, t, h), torch.bfloat16, device).transpose(0, 1)
    paged_gather_layer(caches[1], slots, case.layout, out=layer_out)
    assert torch.equal(bits(layer_out), bits(paged_gather_layer_ref(caches[1], slots, case.layout,
                       out=sentinel_tensor(layer_out.shape, torch.bfloat16, device))))


@pytest.mark.parametrize("case,dtype,expected", [
    pytest.param(Case("vllm_packed", "LBNHC", heads=2, head_size=32), torch.float16, 8, id="packed-fp16"),
    pytest.param(Case("vllm_packed", "BHLNC", heads=3, head_size=40), torch.bfloat16, 8, id="packed-h40"),
    pytest.param(Case("vllm_cpu", heads=2, head_size=36), torch.float16, 1, id="cpu-h36-unaligned"),
    pytest.param(Case("flash_attn", heads=2, head_size=36), torch.float32, 4, id="fa-fp32-h36"),
    pytest.param(Case("mla", heads=1, head_size=72), torch.uint8, 8, id="mla72-u8-8bytes"),
    pytest.param(Case("vllm_packed", "LBNHC", heads=3, head_size=36), torch.float16, 4, id="packed-h36-8bytes"),
    pytest.param(Case("flash_attn", heads=1, head_size=34), torch.float16, 2, id="fa-h34-4bytes"),
    pytest.param(Case("flashinfer", heads=1, head_size=33), torch.float16, 1, id="fi-h33-unaligned"),
    pytest.param(Case("mla", heads=1, head_size=576), torch.float8_e4m3fn, 16, id="mla576-fp8"),
])
def test_vector_width_hint(case, dtype, expected):
    """VEC is an alignment promise to the GPU compiler: the widest one every offset keeps."""
    from lmcache_triton.kernels.common import prepare_layers
    caches = case.caches(dtype, "cpu", lambda s: torch.zeros(s, dtype=dtype))
    layers = prepare_layers(caches, case.layout)
    kv_off = 0 if layers.v is None else (layers.v[0].data_ptr() - layers.k[0].data_ptr()) // layers.k[0].element_size()
    assert paged_copy.vector_width(layers, kv_off) == expected
    # a layer view starting one element off a 16-byte boundary never gets the hint
    flat = torch.zeros(sum(c.numel() for c in caches) + 1, dtype=dtype)[1:]
    shifted = flat[:caches[0].numel()].view(caches[0].shape) if caches[0].is_contiguous() else None
    if shifted is not None:
        assert paged_copy.vector_width(prepare_layers([shifted], case.layout), kv_off) == 1


def test_triton_path_is_exercised():
    if torch.cuda.is_available():
        return
    assert INTERPRETED, (
        "lmcache_triton.kernels was imported before TRITON_INTERPRET=1 was set, so the CPU tests "
        "only compare the reference with itself; set it in the first conftest that runs")
    assert use_triton(torch.device("cpu"))


def test_slot_mapping_on_other_device_and_int32(device):
    case = Case("flash_attn")
    _, caches, slots = setup(case, torch.float16, device)
    a = paged_gather(caches, slots.cpu().to(torch.int32), case.layout)
    b = paged_gather_ref(caches, slots.to(device), case.layout)
    assert torch.equal(bits(a), bits(b))


def test_int64_addressing(tmp_path):
    """Addresses past 2**31 elements without the memory: a sparse file mapped as the cache.

    Two MLA uint8 layers, views of one mapping [2, num_blocks, 16, 64] (1 KiB per block) with
    2**21 + 4 blocks each: layer 1 starts 2**31 + 4 KiB elements after layer 0 (the layer offset),
    and slots in the last blocks have block * stride > 2**31. Only the touched pages ever exist.
    """
    num_layers, num_blocks, block_size, c = 2, 2**21 + 4, 16, 64
    path = tmp_path / "cache.bin"
    size = num_layers * num_blocks * block_size * c
    with open(path, "wb") as f:
        f.truncate(size)
    alloc = torch.from_file(str(path), shared=True, size=size, dtype=torch.uint8)
    alloc = alloc.view(num_layers, num_blocks, block_size, c)
    caches = [alloc[0], alloc[1]]
    slots = torch.tensor([(num_blocks - 1) * block_size + 3, -1, (num_blocks - 3) * block_size, 5,
                          (num_blocks - 2) * block_size + 15], dtype=torch.int32)
    gen = torch.Generator().manual_seed(0)
    chunk = torch.randint(0, 256, (1, num_layers, len(slots), c), dtype=torch.uint8, generator=gen)
    paged_scatter(chunk, caches, slots, "mla")
    assert torch.equal(alloc[1, num_blocks - 1, 3], chunk[0, 1, 0])
    assert torch.equal(alloc[0, num_blocks - 2, 15], chunk[0, 0, 4])
    got = paged_gather(caches, slots, "mla")
    valid = slots >= 0
    assert torch.equal(got[:, :, valid], chunk[:, :, valid])
    assert torch.equal(got, paged_gather_ref(caches, slots, "mla"))


# ---------------------------------------------------------------- bad input

def test_bad_layout():
    x = torch.zeros(2, 2, 4, 8)
    with pytest.raises(ValueError, match="layout"):
        paged_gather([x], torch.zeros(1, dtype=torch.int64), "nope")
    with pytest.raises(ValueError, match=r"layout.*'nope'.*\(2, 2, 4, 8\)"):
        kv_views(x, "nope")


@pytest.mark.parametrize("layout,shape", [
    pytest.param("vllm_packed", (2, 2, 4), id="packed-rank3"),
    pytest.param("vllm_packed", (2, 2, 4, 7), id="packed-oddC"),
    pytest.param("vllm_cpu", (2, 2, 5, 8), id="cpu-odd-rows"),
    pytest.param("flash_attn", (3, 2, 4, 2, 8), id="fa-notkv"),
    pytest.param("flashinfer", (2, 3, 4, 2, 8), id="fi-notkv"),
    pytest.param("mla", (2, 4, 1, 8), id="mla-rank4"),
])
def test_bad_shape_for_layout(layout, shape):
    with pytest.raises(ValueError, match=layout) as e:
        kv_views(torch.zeros(shape), layout)
    assert str(tuple(shape)) in str(e.value)


def test_bad_arguments():
    case = Case("flash_attn")
    _, caches, slots = setup(case, torch.float16, "cpu")
    lay = case.layout
    with pytest.raises(ValueError, match="out"):
        paged_gather(caches, slots, lay, out=torch.zeros(case.chunk_shape(), dtype=torch.float32))
    with pytest.raises(ValueError, match="out"):
        paged_gather(caches, slots, lay, out=torch.zeros((2, 3, 1, 64), dtype=torch.float16))
    with pytest.raises(ValueError, match="slot_mapping"):
        paged_gather(caches, slots.float(), lay)
    with pytest.raises(ValueError, match="slot_mapping"):
        paged_gather(caches, slots.view(1, -1), lay)
    with pytest.raises(ValueError, match=r"kv_caches\[1\]"):
        paged_gather([caches[0], caches[1][:, :-1]], slots, lay)
    with pytest.raises(ValueError, match=r"kv_caches\[2\]"):
        paged_gather([caches[0], caches[1], caches[2].float()], slots, lay)
    with pytest.raises(ValueError, match="kv_caches"):
        paged_gather([], slots, lay)
    with pytest.raises(ValueError, match="chunk"):
        paged_scatter(torch.zeros((2, 3, 5, 64), dtype=torch.float16), caches, slots, lay)
    with pytest.raises(ValueError, match="chunk"):
        paged_scatter_layer(torch.zeros(case.layer_shape(), dtype=torch.bfloat16), caches[0], slots, lay)
    with pytest.raises(ValueError, match="out"):
        paged_gather_layer(caches[0], slots, lay, out=torch.zeros(case.chunk_shape(), dtype=torch.float16))


def test_geometry():
    g = kv_geometry(torch.zeros(7, 3, 16, 2 * 40), "vllm_packed")
    assert (g.num_blocks, g.block_size, g.num_kv_heads, g.head_size, g.use_mla, g.hidden) == (7, 16, 3, 40, False, 120)
    g = kv_geometry(torch.zeros(5, 64, 576), "mla")
    assert (g.num_blocks, g.block_size, g.num_kv_heads, g.head_size, g.use_mla, g.hidden) == (5, 64, 1, 576, True, 576)
    g = kv_geometry(torch.zeros(5, 2, 32, 8), "vllm_cpu")
    assert (g.num_blocks, g.block_size, g.num_kv_heads, g.head_size) == (5, 16, 2, 8)
    assert LAYOUTS == ("vllm_packed", "vllm_cpu", "flash_attn", "flashinfer", "mla")


@pytest.mark.parametrize("layout", LAYOUTS)
def test_views_share_storage(layout):
    shapes = {"vllm_packed": (3, 2, 4, 16), "vllm_cpu": (3, 2, 8, 8), "flash_attn": (2, 3, 4, 2, 8),
              "flashinfer": (3, 2, 4, 2, 8), "mla": (3, 4, 16)}
    x = torch.zeros(shapes[layout])
    k, v = kv_views(x, layout)
    k.fill_(1)
    if v is not None:
        assert k.shape == v.shape == (3, 4, 2, 8)
        v.fill_(2)
        assert x.sum() == 1 * k.numel() + 2 * v.numel() == x.numel() * 1.5
    else:
        assert x.sum() == x.numel()


# ---------------------------------------------------------------- GPU: the full matrix, larger shapes

@pytest.mark.gpu
@cuda_only
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", GPU_CASES)
def test_gpu_matrix(case, dtype):
    check_gather(case, dtype, "cuda", seed=5)
    check_scatter(case, dtype, "cuda", seed=5)
    check_layerwise(case, dtype, "cuda", seed=5)


@pytest.mark.gpu
@cuda_only
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_pinned_host_chunk(dtype):
    """CUDA cache <-> pinned host chunk, the kernel touching host memory directly (UVA)."""
    case = Case("vllm_packed", "LBNHC", block_size=16, heads=8, head_size=128, num_tokens=513, num_layers=4)
    _, caches, slots = setup(case, dtype, "cuda")
    out = sentinel_tensor(case.chunk_shape(), dtype, "cpu").pin_memory()
    paged_gather(caches, slots, case.layout, out=out)
    torch.cuda.synchronize()
    expected = paged_gather_ref(caches, slots, case.layout,
                                out=sentinel_tensor(case.chunk_shape(), dtype, "cuda"))
    assert torch.equal(bits(out), bits(expected.cpu()))
    fresh = case.caches(dtype, "cuda", lambda s: sentinel_tensor(s, dtype, "cuda"))
    ref = clone_caches(fresh)
    paged_scatter(out, fresh, slots, case.layout)
    paged_scatter_ref(expected, ref, slots, case.layout)
    assert_caches_equal(fresh, ref)
    with pytest.raises(ValueError, match="out"):
        paged_gather(caches, slots, case.layout, out=torch.zeros(case.chunk_shape(), dtype=dtype))


@pytest.mark.gpu
@cuda_only
def test_gpu_int64_addressing():
    """A real > 2**31-element cache: uint8 MLA, slots in the last blocks."""
    num_blocks, block_size, c = 2**21 + 4, 16, 72   # ~2.4 GB
    cache = torch.zeros(num_blocks, block_size, c, dtype=torch.uint8, device="cuda")
    slots = torch.tensor([(num_blocks - 1) * block_size + 3, -1, 7, (num_blocks - 2) * block_size + 15],
                         device="cuda")
    chunk = torch.randint(0, 256, (1, 1, 4, c), dtype=torch.uint8, device="cuda")
    paged_scatter(chunk, [cache], slots, "mla")
    got = paged_gather([cache], slots, "mla")
    assert torch.equal(got, paged_gather_ref([cache], slots, "mla"))
    assert torch.equal(got[:, :, [0, 2, 3]], chunk[:, :, [0, 2, 3]])
