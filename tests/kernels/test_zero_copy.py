"""The capped grid of zero-copy launches (a chunk in pinned host memory, a CUDA cache).

CPU torch cannot pin memory here, so the capped kernel path is forced on CPU tensors
(`paged_copy._FORCE_MAX_PROGRAMS`) and run in the interpreter, where it must give the torch
reference's bytes exactly; the choice of the grid itself is a pure function of placement and SM
count (`max_programs`, then `capped_grid`, as the launch plan and `_launch` apply them), tested
directly."""

from __future__ import annotations

import pytest
import torch

from lmcache_triton.kernels import LAYOUTS, PagedTarget, paged_copy, paged_gather, paged_gather_ref, paged_scatter
from lmcache_triton.kernels import paged_scatter_ref, tuning, use_triton
from lmcache_triton.tools.testing import make_kv_caches, random_slot_mapping

SENTINEL = 0x5A
BLOCK_SIZE = 16


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def sentinel(shape, dtype=torch.bfloat16) -> torch.Tensor:
    size = torch.empty(0, dtype=dtype).element_size()
    return torch.full((*shape[:-1], shape[-1] * size), SENTINEL, dtype=torch.uint8).view(dtype)


def geometry(layout: str) -> dict:
    heads, head_size = (1, 72) if layout == "mla" else (2, 32)
    return dict(num_layers=4 if layout == "mla" else 3, block_size=BLOCK_SIZE, num_kv_heads=heads, head_size=head_size, dtype=torch.bfloat16)


def slots_for(num_tokens: int, num_blocks: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    slots = random_slot_mapping(num_tokens, num_blocks=num_blocks, block_size=BLOCK_SIZE, generator=g)
    pad = torch.rand(num_tokens, generator=g) < 0.2
    pad[num_tokens // 2] = True      # at least one padding slot, also for 1 token
    slots[pad] = -1
    return slots


class GridSpy:
    """Stands in for a kernel: records each launch's grid and launches the real kernel."""

    def __init__(self, kernel) -> None:
        self.kernel, self.grids = kernel, []

    def __getitem__(self, grid):
        self.grids.append(grid)
        return self.kernel[grid]


@pytest.fixture
def spies(monkeypatch):
    if not use_triton(torch.device("cpu")):
        pytest.skip("the capped grid is the Triton kernel's: on a CPU host it runs only in the interpreter")
    spy = {"gather": GridSpy(paged_copy._paged_gather_kernel), "scatter": GridSpy(paged_copy._paged_scatter_kernel)}
    monkeypatch.setattr(paged_copy, "_paged_gather_kernel", spy["gather"])
    monkeypatch.setattr(paged_copy, "_paged_scatter_kernel", spy["scatter"])
    return spy


def tiles(layers, num_tokens: int, direction: str) -> tuple[int, int, int]:
    plan = paged_copy.launch_plan(layers, direction)
    return -(-num_tokens // plan.block_t), plan.grid_lk, plan.grid_d


# (num_tokens, cap, small tile). With the heuristic tile (one column tile): cap 1 is one program
# looping over every token tile and layer x K/V, cap 3 loops over both with a stride of 3 on
# layers x K/V. With an 8 x 32 tile (2-3 column tiles): cap 1 loops over columns too, cap 7 keeps
# the column tiles and loops over tokens and layers x K/V (the interpreter is slow with small
# tiles, so those run at up to 37 tokens).
CASES = [pytest.param(t, cap, False, id=f"t{t}-cap{cap}") for t in (1, 5, 37, 300) for cap in (1, 3)] + [
    pytest.param(t, cap, True, id=f"t{t}-cap{cap}-tile8x32") for t in (1, 5, 37) for cap in (1, 7)]


@pytest.mark.parametrize("num_tokens,cap,small_tile", CASES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_capped_grid_is_bit_exact(spies, monkeypatch, layout, num_tokens, cap, small_tile):
    geo = geometry(layout)
    hidden = geo["num_kv_heads"] * geo["head_size"]
    num_blocks = -(-num_tokens // BLOCK_SIZE) + 3
    order = "BHLNC" if num_tokens % 2 else "LBNHC"
    caches = make_kv_caches(layout, num_blocks=num_blocks, order=order,
                            generator=torch.Generator().manual_seed(num_tokens), **geo)
    slots = slots_for(num_tokens, num_blocks, seed=cap + num_tokens)
    num_kv = 1 if layout == "mla" else 2
    shape = (num_kv, geo["num_layers"], num_tokens, hidden)
    configs = {tuning.config_key(d, hidden, 2): tuning.TileConfig(8, 32, 1) for d in tuning.DIRECTIONS}
    monkeypatch.setattr(paged_copy, "_FORCE_MAX_PROGRAMS", cap)
    with tuning.using(configs if small_tile else {}):
        out = paged_gather(caches, slots, layout, out=sentinel(shape))
        want = paged_gather_ref(caches, slots, layout, out=sentinel(shape))
        assert torch.equal(bits(out), bits(want))
        assert torch.all(bits(out)[:, :, slots == -1] == bits(sentinel((1,)))[0])  # padding rows untouched

        chunk = torch.randn(shape, generator=torch.Generator().manual_seed(7)).to(torch.bfloat16)
        dst = make_kv_caches(layout, num_blocks=num_blocks, order=order, fill=0, **geo)
        ref = make_kv_caches(layout, num_blocks=num_blocks, order=order, fill=0, **geo)
        for c in (*dst, *ref):
            bits(c).fill_(int.from_bytes(bytes([SENTINEL]) * 2, "little"))
        paged_scatter(chunk, dst, slots, layout)
        paged_scatter_ref(chunk, ref, slots, layout)
        for layer, (a, b) in enumerate(zip(dst, ref)):
            assert torch.equal(bits(a), bits(b)), f"layer {layer} differs"  # rows not written keep the sentinel

        from lmcache_triton.kernels.common import prepare_layers
        full = tiles(prepare_layers(caches, layout), num_tokens, "gather")
    for direction in ("gather", "scatter"):
        (grid,) = spies[direction].grids
        assert grid == paged_copy.capped_grid(full, cap)
        assert grid[0] * grid[1] * grid[2] <= cap
    assert full[0] * full[1] * full[2] > cap       # so the kernel looped
    if small_tile and cap == 1:
        assert full[2] > 1                          # over column tiles too


def test_capped_grid_per_layer_chunks(spies, monkeypatch):
    """The engine's path (PagedTarget), one layer in the KV_T2D format, chunk by chunk."""
    geo = geometry("flashinfer")
    caches = make_kv_caches("flashinfer", num_blocks=8, generator=torch.Generator().manual_seed(1), **geo)
    slots = slots_for(77, 8, seed=1)
    target = PagedTarget.of(caches, slots, "flashinfer")
    monkeypatch.setattr(paged_copy, "_FORCE_MAX_PROGRAMS", 2)
    for start, end in ((0, 37), (37, 77)):
        out = sentinel((end - start, 2, 64))
        target.layer(1).gather(start, end, out)
        want = paged_gather_ref(caches, slots[start:end], "flashinfer")[:, 1].transpose(0, 1)
        valid = slots[start:end] >= 0
        assert torch.equal(bits(out)[valid], bits(want)[valid])
        assert torch.all(bits(out)[~valid] == bits(sentinel((1,)))[0])
    assert all(g[0] * g[1] * g[2] <= 2 for g in spies["gather"].grids)


# ---------------------------------------------------------------- which grid a placement gets

def _grid(placement, num_tokens, block_t, grid_lk, grid_d, sm_count):
    """The grid a launch gets: the plan's cap for the placement, applied by `_launch`."""
    return paged_copy.capped_grid((-(-num_tokens // block_t), grid_lk, grid_d),
                                  paged_copy.max_programs(placement, sm_count))


def test_pinned_placement_gets_a_capped_grid_device_the_full_one():
    # Llama-3-8B: 32 layers x K/V, hidden 1024 (one column tile of 1024), 8K tokens in tiles of 4.
    n_t, lk, d = 2048, 64, 1
    assert _grid("device", 8192, 4, lk, d, 132) == (n_t, lk, d)
    assert _grid("device", 8192, 4, lk, d, None) == (n_t, lk, d)
    cap = paged_copy.zero_copy_max_programs(132)
    assert cap == 66                                          # H100 / H200: half the SMs
    grid = _grid("pinned", 8192, 4, lk, d, 132)
    assert grid == (1, 64, 1)                                 # each program loops over the token tiles
    # 80 layers, 4 column tiles: the total is capped, not one axis (layers x K/V loops too)
    grid = _grid("pinned", 8192, 4, 160, 4, 132)
    assert grid[2] == 4 and grid[0] * grid[1] * grid[2] <= cap
    assert _grid("device", 8192, 4, 160, 4, 132) == (2048, 160, 4)
    # a small request already within the cap keeps one program per tile
    assert _grid("pinned", 5, 4, 4, 1, 132) == (2, 4, 1)
    # scales with the SM count, with a floor for small GPUs
    assert paged_copy.zero_copy_max_programs(264) == 132
    assert paged_copy.zero_copy_max_programs(20) == paged_copy.ZERO_COPY_MIN_PROGRAMS
    big = _grid("pinned", 1 << 20, 4, 64, 2, 264)
    assert big[0] * big[1] * big[2] <= 132
    assert paged_copy.max_programs("device", 132) is None
    with pytest.raises(ValueError, match="placement"):
        paged_copy.max_programs("host", 132)


@pytest.mark.parametrize("tiles,cap", [((2048, 64, 1), 66), ((3, 6, 4), 1), ((3, 6, 4), 7), ((1, 500, 8), 5),
                                       ((10, 1, 1), 3), ((4, 2, 2), 16)])
def test_capped_grid_bounds(tiles, cap):
    grid = paged_copy.capped_grid(tiles, cap)
    assert grid[0] * grid[1] * grid[2] <= cap
    assert all(1 <= g <= n for g, n in zip(grid, tiles))
    assert paged_copy.capped_grid(tiles, None) == tiles
