"""The kernel bench's own logic: the target verdicts and the staged alternative it times."""

from __future__ import annotations

import torch

from bench.kernels import Row, _staged, check_targets
from lmcache_triton.kernels import paged_gather_ref
from lmcache_triton.tools.testing import make_kv_caches, random_slot_mapping


def _row(**kw) -> Row:
    base = dict(model="llama3-8b", layout="vllm_packed", block_size=16, tokens=256, scope="all-layers",
                direction="gather", chunk_on="device", path="triton", bytes=1, ms=1.0, gbps=1.0, ref_gbps=1.0,
                copy_gbps=1.0, vs_ref=3.0, vs_copy=0.85)
    return Row(**(base | kw))


def test_targets_judge_the_256_token_32_layer_rows():
    rows = [_row(), _row(direction="scatter", vs_copy=0.79, vs_ref=1.5),
            _row(chunk_on="pinned-host", vs_copy=0.93), _row(chunk_on="pinned-host", direction="scatter", vs_copy=0.5),
            _row(tokens=2048, vs_copy=0.1), _row(scope="one-layer", vs_copy=0.1),
            _row(model="deepseek-v3-mla", vs_copy=0.1), _row(path="torch", vs_copy=0.1)]
    got = {(t["target"].split(" >=")[0], t["direction"]): t["ok"] for t in check_targets(rows)}
    assert got == {("device chunk", "gather"): True, ("device chunk", "scatter"): False,
                   ("pinned-host chunk", "gather"): True, ("pinned-host chunk", "scatter"): False}
    ref = [t for t in check_targets(rows) if "torch reference" in t["target"]]
    assert [(t["direction"], t["ok"]) for t in ref] == [("gather", True), ("scatter", False)]


def test_staged_alternative_moves_the_same_bytes():
    g = torch.Generator().manual_seed(0)
    caches = make_kv_caches("flash_attn", num_layers=3, num_blocks=6, block_size=4, num_kv_heads=2, head_size=8,
                            generator=g)
    slots = random_slot_mapping(10, num_blocks=6, block_size=4, generator=g)
    host = torch.zeros(2, 3, 10, 16, dtype=torch.bfloat16)
    _staged(host, caches, slots, "flash_attn", "all-layers", "gather")()
    assert torch.equal(host, paged_gather_ref(caches, slots, "flash_attn"))
    empty = make_kv_caches("flash_attn", num_layers=3, num_blocks=6, block_size=4, num_kv_heads=2, head_size=8,
                           fill=0)
    _staged(host, empty, slots, "flash_attn", "all-layers", "scatter")()
    assert torch.equal(paged_gather_ref(empty, slots, "flash_attn"), host)
    layer = torch.zeros(10, 2, 16, dtype=torch.bfloat16)
    _staged(layer, caches, slots, "flash_attn", "one-layer", "gather")()
    assert torch.equal(layer, paged_gather_ref(caches, slots, "flash_attn")[:, 0].permute(1, 0, 2))
