"""Tuned tile configs (kernels/tuning.py) reach the launchers; bad files fall back with one warning.

Also: the whole-block fast path of the pure-torch reference equals a per-token oracle.
"""

from __future__ import annotations

import json
import warnings

import pytest
import torch

from lmcache_triton.kernels import paged_copy, paged_gather, paged_gather_ref, paged_scatter, paged_scatter_ref
from lmcache_triton.kernels import tuning
from lmcache_triton.kernels.layouts import kv_views
from lmcache_triton.tools.testing import make_kv_caches

HEADS, HEAD_SIZE = 2, 32  # hidden 64: the heuristic picks (64, 64, 4)
TUNED = {"BLOCK_T": 2, "BLOCK_D": 16, "num_warps": 1}


@pytest.fixture(autouse=True)
def tuning_path(tmp_path, monkeypatch):
    path = tmp_path / "kernel_tuning.json"
    monkeypatch.setenv(tuning.ENV_VAR, str(path))
    tuning.reset()
    yield path
    tuning.reset()


def write(path, configs, version=1):
    path.write_text(json.dumps({"version": version, "device": "test", "configs": configs}))


def test_tuned_entry_selects_the_tile(tuning_path):
    write(tuning_path, {"gather/64/2": TUNED})
    assert paged_copy._tile(64, 2, "gather") == (2, 16, 1)
    assert paged_copy._tile(64, 2, "scatter") == (64, 64, 4)    # the heuristic's choice     # other direction: no entry
    assert paged_copy._tile(64, 4, "gather") == paged_copy._tile(64, 4, "scatter")  # other dtype size
    assert paged_copy._tile(128, 2, "gather") != (2, 16, 1)     # other hidden


def test_save_round_trips(tuning_path):
    cfg = {tuning.config_key("scatter", 576, 2): tuning.TileConfig(8, 64, 2)}
    tuning.save(cfg, tuning_path, device="test")
    assert tuning.load(tuning_path) == cfg
    with pytest.raises(ValueError, match="block_d"):
        tuning.TileConfig(4, 8, 4)


@pytest.mark.parametrize("layout", ["vllm_packed", "vllm_cpu", "mla"])
def test_non_default_tile_is_bit_exact(tuning_path, layout):
    heads, hs = (1, 64) if layout == "mla" else (HEADS, HEAD_SIZE)
    write(tuning_path, {"gather/64/2": TUNED, "scatter/64/2": TUNED})
    assert paged_copy._tile(64, 2, "scatter") == (2, 16, 1)
    geo = dict(num_layers=2, num_blocks=8, block_size=16, num_kv_heads=heads, head_size=hs, dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(0)
    src = make_kv_caches(layout, generator=g, **geo)
    slots = torch.tensor([17, 18, 19, -1, 40, 3, 64, 65, 66, 67, 100, -1, 5], dtype=torch.int64)
    shape = (1 if layout == "mla" else 2, 2, len(slots), 64)
    got = paged_gather(src, slots, layout, out=torch.full(shape, 7.0, dtype=torch.bfloat16))
    want = paged_gather_ref(src, slots, layout, out=torch.full(shape, 7.0, dtype=torch.bfloat16))
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    dst_k, dst_r = (make_kv_caches(layout, fill=3.0, **geo) for _ in range(2))
    paged_scatter(got, dst_k, slots, layout)
    paged_scatter_ref(got, dst_r, slots, layout)
    for a, b in zip(dst_k, dst_r):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16))


@pytest.mark.parametrize("content", [
    pytest.param("{not json", id="not-json"),
    pytest.param(json.dumps({"version": 99, "configs": {}}), id="bad-version"),
    pytest.param(json.dumps({"version": 1, "configs": {"gather/64/2": {"BLOCK_T": 3, "BLOCK_D": 16,
                                                                       "num_warps": 1}}}), id="not-pow2"),
    pytest.param(json.dumps({"version": 1, "configs": {"sideways/64/2": TUNED}}), id="bad-key"),
])
def test_corrupt_file_falls_back_with_one_warning(tuning_path, content):
    tuning_path.write_text(content)
    with pytest.warns(RuntimeWarning, match="ignoring kernel tuning file"):
        tile = paged_copy._tile(64, 2, "gather")
    assert tile == (64, 64, 4)                              # the heuristic's choice
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert paged_copy._tile(64, 2, "gather") == tile    # loaded once: no second warning


def test_missing_file(tuning_path, monkeypatch):
    with pytest.warns(RuntimeWarning):                     # named by the env var, but absent
        paged_copy._tile(64, 2, "gather")
    monkeypatch.delenv(tuning.ENV_VAR)
    monkeypatch.setenv("HOME", str(tuning_path.parent))    # default path, absent: the normal case
    tuning.reset()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert paged_copy._tile(64, 2, "gather") == (64, 64, 4)


# ---------------------------------------------------------------- reference fast path

def _naive_gather(caches, slots, layout, out):
    for l, c in enumerate(caches):
        for kv, view in enumerate(v for v in kv_views(c, layout) if v is not None):
            for t, s in enumerate(slots.tolist()):
                if s >= 0:
                    out[kv, l, t] = view[s // view.shape[1], s % view.shape[1]].reshape(-1)
    return out


@pytest.mark.parametrize("layout,order", [("vllm_cpu", "LBNHC"), ("vllm_packed", "LBNHC"),
                                          ("vllm_packed", "LBHNC"), ("flash_attn", "LBNHC"), ("mla", "LBNHC")])
def test_reference_whole_block_path(layout, order):
    """Whole aligned blocks, an unaligned run, padding and a partial tail, in one slot mapping."""
    heads, hs = (1, 16) if layout == "mla" else (2, 8)
    geo = dict(num_layers=2, num_blocks=12, block_size=4, num_kv_heads=heads, head_size=hs,
               dtype=torch.float16, order=order)
    src = make_kv_caches(layout, generator=torch.Generator().manual_seed(1), **geo)
    slots = torch.tensor([8, 9, 10, 11,  20, 21, 22, 23,  13, 14, 15, 16,  -1, 1, 2, 3,  44, 45, 46, 47,
                          28, 29], dtype=torch.int64)
    nkv, hidden = (1, 16) if layout == "mla" else (2, 16)
    shape = (nkv, 2, len(slots), hidden)
    got = paged_gather_ref(src, slots, layout, out=torch.full(shape, 5.0, dtype=torch.float16))
    want = _naive_gather(src, slots, layout, torch.full(shape, 5.0, dtype=torch.float16))
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    dst = make_kv_caches(layout, fill=9.0, **geo)
    paged_scatter_ref(got, dst, slots, layout)
    back = paged_gather_ref(dst, slots, layout, out=torch.full(shape, 5.0, dtype=torch.float16))
    assert torch.equal(back.view(torch.int16), got.view(torch.int16))
    untouched = torch.ones(12 * 4, dtype=torch.bool)
    untouched[slots[slots >= 0]] = False
    rest = torch.arange(48)[untouched]
    after = paged_gather_ref(dst, rest, layout)
    assert bool((after == 9.0).all())
