"""bench/lmcache_side.py's own reading of the caches (it runs in LMCache's venv, without our
kernels), checked against our oracle: a comparison is only fair if both sides move the same bytes."""

from __future__ import annotations

import pytest
import torch

from bench.lmcache_side import _packed_rows, make_packed_caches
from lmcache_triton.kernels.naive import naive_gather


@pytest.mark.parametrize("separate", [False, True], ids=["one-allocation", "separate-layers"])
@pytest.mark.parametrize("layout,block_size", [("vllm_packed", 16), ("vllm_cpu", 16), ("vllm_cpu", 128)])
def test_rows_are_the_oracles(layout, block_size, separate):
    spec = {"block_size": block_size, "heads": 2, "head_size": 8, "layers": 3, "tokens": 2 * block_size + 5,
            "layout": layout, "separate_layers": separate}
    caches = make_packed_caches(spec, torch.Generator().manual_seed(0))
    if separate:
        assert len({c.untyped_storage().data_ptr() for c in caches}) == 3
    slots = torch.tensor([3, 2 * block_size + 1, block_size + 7, 0, 5 * block_size - 1])
    want = naive_gather(caches, slots, layout)                  # [2, layers, tokens, heads * head_size]
    for layer, rows in enumerate(_packed_rows(caches, slots, layout)):  # [tokens, heads, 2 * head_size]
        k, v = rows.view(torch.bfloat16).split(8, dim=-1)
        assert torch.equal(k.reshape(len(slots), -1), want[0, layer])
        assert torch.equal(v.reshape(len(slots), -1), want[1, layer])
