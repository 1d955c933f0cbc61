"""Tuned tile configs (kernels/tuning.py) reach the launchers; bad files fall back with one warning;
the tuner never selects a tile whose output differs from the oracle."""

from __future__ import annotations

import json
import math
import warnings

import pytest
import torch

from lmcache_triton.kernels import paged_copy, paged_gather, paged_gather_ref, paged_scatter, paged_scatter_ref
from lmcache_triton.kernels import tuning
from lmcache_triton.kernels.naive import naive_gather
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
    assert paged_copy.tile(64, 2, "gather") == (2, 16, 1)
    assert paged_copy.tile(64, 2, "scatter") == (64, 64, 4)    # the heuristic's choice     # other direction: no entry
    assert paged_copy.tile(64, 4, "gather") == paged_copy.tile(64, 4, "scatter")  # other dtype size
    assert paged_copy.tile(128, 2, "gather") != (2, 16, 1)     # other hidden


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
    assert paged_copy.tile(64, 2, "scatter") == (2, 16, 1)
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
        tile = paged_copy.tile(64, 2, "gather")
    assert tile == (64, 64, 4)                              # the heuristic's choice
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert paged_copy.tile(64, 2, "gather") == tile    # loaded once: no second warning


def test_missing_file(tuning_path, monkeypatch):
    with pytest.warns(RuntimeWarning):                     # named by the env var, but absent
        paged_copy.tile(64, 2, "gather")
    monkeypatch.delenv(tuning.ENV_VAR)
    monkeypatch.setenv("HOME", str(tuning_path.parent))    # default path, absent: the normal case
    tuning.reset()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert paged_copy.tile(64, 2, "gather") == (64, 64, 4)


# ---------------------------------------------------------------- the tuner checks before it times

def test_tuner_rejects_a_tile_whose_output_is_wrong(tuning_path, monkeypatch):
    """A kernel that is wrong under one tile only (one byte flipped) is rejected although it is the
    fastest; so is a tile that fails to run. The fastest correct tile wins, and the trials say why."""
    write(tuning_path, {})
    layout, key = "flash_attn", tuning.config_key("gather", 64, 2)
    caches = make_kv_caches(layout, num_layers=2, num_blocks=6, block_size=16, num_kv_heads=HEADS,
                            head_size=HEAD_SIZE, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(2))
    slots = torch.tensor([48, 49, 50, -1, 3, 70, 71, 20, 21, 22, 23, -1, 90], dtype=torch.int64)
    shape = (2, 2, len(slots), 64)
    expected = naive_gather(caches, slots, layout, out=torch.full(shape, 7.0, dtype=torch.bfloat16))
    fast_but_wrong, failing = tuning.TileConfig(4, 32, 2), tuning.TileConfig(1, 16, 1)
    correct = [tuning.TileConfig(2, 16, 1), tuning.TileConfig(8, 64, 4)]

    def current() -> tuning.TileConfig:
        return tuning.TileConfig(*paged_copy.tile(64, 2, "gather"))

    real = paged_copy.gather_into

    def broken(layers, slots, out4):
        if current() == failing:
            raise RuntimeError("out of shared memory")
        real(layers, slots, out4)
        if current() == fast_but_wrong:
            out4.view(torch.uint8).view(-1)[5] ^= 1

    monkeypatch.setattr(paged_copy, "gather_into", broken)
    out = torch.empty(shape, dtype=torch.bfloat16)

    def check():
        out.fill_(7.0)
        paged_gather(caches, slots, layout, out=out)
        same = torch.equal(out.view(torch.int16), expected.view(torch.int16))
        return None if same else "differs from the oracle"

    ms = {fast_but_wrong: 1.0, failing: 0.5, correct[0]: 3.0, correct[1]: 2.0}
    best, trials = tuning.pick(key, [fast_but_wrong, failing, *correct], check, lambda: ms[current()])
    assert best == correct[1]
    why = {t.config: t.rejected for t in trials}
    assert why == {fast_but_wrong: "differs from the oracle", failing: "RuntimeError: out of shared memory",
                   correct[0]: "", correct[1]: ""}
    assert [t.ms for t in trials] == [math.inf, math.inf, 3.0, 2.0]
    assert [t.raised for t in trials] == [False, True, False, False]
    assert paged_copy.tile(64, 2, "gather") == (64, 64, 4)   # the candidates are gone again
    assert tuning.pick(key, [fast_but_wrong], check, lambda: 1.0)[0] is None
