"""Tuned tile configs (kernels/tuning.py) reach the launchers, by the chunk's placement and only on
the device they were tuned on; version-1 files are read as placement `device`; bad files fall back
with one warning; the tuner never selects a tile whose output differs from the oracle."""

from __future__ import annotations

import json
import math
import warnings

import pytest
import torch

from lmcache_triton.kernels import paged_copy, paged_gather, paged_gather_ref, paged_scatter, paged_scatter_ref
from lmcache_triton.kernels import tuning
from lmcache_triton.kernels.common import prepare_layers
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


def write(path, configs, version=2, device="cpu"):
    """A tuning file; device "cpu" is what the launchers match on a CPU host (tuning.device_name)."""
    payload = {"version": version, "configs": configs}
    if device is not None:
        payload["device"] = device
    path.write_text(json.dumps(payload))


def test_tuned_entry_selects_the_tile(tuning_path):
    write(tuning_path, {"gather/device/64/2": TUNED})
    assert paged_copy.tile(64, 2, "gather") == (2, 16, 1)
    assert paged_copy.tile(64, 2, "scatter") == (64, 64, 4)    # the heuristic's choice     # other direction: no entry
    assert paged_copy.tile(64, 4, "gather") == paged_copy.tile(64, 4, "scatter")  # other dtype size
    assert paged_copy.tile(128, 2, "gather") != (2, 16, 1)     # other hidden


def test_save_round_trips(tuning_path):
    cfg = {tuning.config_key("scatter", 576, 2): tuning.TileConfig(8, 64, 2)}
    tuning.save(cfg, tuning_path, device="test")
    assert tuning.load(tuning_path) == cfg
    assert list(cfg) == ["scatter/device/576/2"]
    with pytest.raises(ValueError, match="block_d"):
        tuning.TileConfig(4, 8, 4)


@pytest.mark.parametrize("layout", ["vllm_packed", "vllm_cpu", "mla"])
def test_non_default_tile_is_bit_exact(tuning_path, layout):
    heads, hs = (1, 64) if layout == "mla" else (HEADS, HEAD_SIZE)
    write(tuning_path, {"gather/device/64/2": TUNED, "scatter/device/64/2": TUNED})
    assert paged_copy.tile(64, 2, "scatter", "device", "cpu") == (2, 16, 1)
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
    pytest.param(json.dumps({"version": 2, "device": "cpu", "configs": {"gather/64/2": TUNED}}), id="v1-key-in-v2"),
    pytest.param(json.dumps({"version": 2, "device": "cpu", "configs": {"gather/host/64/2": TUNED}}),
                 id="bad-placement"),
    pytest.param(json.dumps({"version": 2, "configs": {"gather/device/64/2": TUNED}}), id="v2-no-device"),
    pytest.param(json.dumps({"version": 1, "device": 7, "configs": {}}), id="device-not-a-name"),
])
def test_corrupt_file_falls_back_with_one_warning(tuning_path, content):
    tuning_path.write_text(content)
    with pytest.warns(RuntimeWarning, match="ignoring kernel tuning file"):
        tile = paged_copy.tile(64, 2, "gather")
    assert tile == (64, 64, 4)                              # the heuristic's choice
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert paged_copy.tile(64, 2, "gather") == tile    # loaded once: no second warning


# ---------------------------------------------------------------- keys by placement, files by device

def test_new_key_format_round_trips(tuning_path):
    assert tuning.config_key("gather", 4096, 2, "pinned") == "gather/pinned/4096/2"
    assert tuning.config_key("scatter", 576, 1) == "scatter/device/576/1"
    with pytest.raises(ValueError, match="placement"):
        tuning.config_key("gather", 4096, 2, "host")
    cfg = {tuning.config_key(d, 4096, 2, p): tuning.TileConfig(2 ** i, 64, 2)
           for i, (d, p) in enumerate((d, p) for d in tuning.DIRECTIONS for p in tuning.PLACEMENTS)}
    tuning.save(cfg, tuning_path, device="NVIDIA H200", triton="3.9.0")
    payload = json.loads(tuning_path.read_text())
    assert payload["version"] == 2 and payload["device"] == "NVIDIA H200" and payload["triton"] == "3.9.0"
    assert sorted(payload["configs"]) == ["gather/device/4096/2", "gather/pinned/4096/2",
                                          "scatter/device/4096/2", "scatter/pinned/4096/2"]
    assert tuning.load_file(tuning_path) == ("NVIDIA H200", cfg)
    with pytest.raises(ValueError, match="device"):
        tuning.save(cfg, tuning_path)               # a file must say which GPU it was tuned on


def test_placement_lookup_picks_the_right_config(tuning_path):
    """The launcher looks the tile up with the chunk's placement: a pinned chunk's launch plan has
    the `pinned` tile (and a capped grid), a device chunk's the `device` one."""
    pinned = {"BLOCK_T": 4, "BLOCK_D": 32, "num_warps": 2}
    write(tuning_path, {"gather/device/64/2": TUNED, "gather/pinned/64/2": pinned, "scatter/pinned/64/2": pinned})
    assert paged_copy.tile(64, 2, "gather", "device", "cpu") == (2, 16, 1)
    assert paged_copy.tile(64, 2, "gather", "pinned", "cpu") == (4, 32, 2)
    assert paged_copy.tile(64, 2, "scatter", "pinned", "cpu") == (4, 32, 2)
    assert paged_copy.tile(64, 2, "scatter", "device", "cpu") == (64, 64, 4)   # no entry: the heuristic
    caches = make_kv_caches("flash_attn", num_layers=2, num_blocks=6, block_size=16, num_kv_heads=HEADS,
                            head_size=HEAD_SIZE, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(4))
    slots = torch.tensor([48, 49, 50, -1, 3, 70, 71, 20, 21, 22, 23, -1, 90], dtype=torch.int64)
    layers = prepare_layers(caches, "flash_attn")
    device_plan = paged_copy.launch_plan(layers, "gather", "device")
    pinned_plan = paged_copy.launch_plan(layers, "gather", "pinned")
    assert (device_plan.block_t, device_plan.constexprs["BLOCK_D"], device_plan.constexprs["num_warps"]) == (2, 16, 1)
    assert (pinned_plan.block_t, pinned_plan.constexprs["BLOCK_D"], pinned_plan.constexprs["num_warps"]) == (4, 32, 2)
    assert device_plan.max_programs is None and pinned_plan.max_programs == paged_copy.ZERO_COPY_MIN_PROGRAMS
    if paged_copy.use_triton(layers.device):  # the pinned plan's launch (capped grid, its tile) on CPU tensors
        out = torch.full((2, 2, len(slots), 64), 7.0, dtype=torch.bfloat16)
        paged_copy._launch(paged_copy._paged_gather_kernel, layers, slots, out, 0, len(slots), placement="pinned")
        want = paged_gather_ref(caches, slots, "flash_attn", out=torch.full_like(out, 7.0))
        assert torch.equal(out.view(torch.int16), want.view(torch.int16))


def test_device_name_mismatch_falls_back_with_one_warning(tuning_path):
    write(tuning_path, {"gather/device/64/2": TUNED, "scatter/device/64/2": TUNED}, device="NVIDIA H100 80GB HBM3")
    caches = make_kv_caches("flash_attn", num_layers=2, num_blocks=4, block_size=16, num_kv_heads=HEADS,
                            head_size=HEAD_SIZE, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(5))
    slots = torch.tensor([3, 17, -1, 40], dtype=torch.int64)
    with pytest.warns(RuntimeWarning, match="tuned on 'NVIDIA H100 80GB HBM3', running on 'cpu'"):
        got = paged_gather(caches, slots, "flash_attn")
    assert torch.equal(got.view(torch.int16), paged_gather_ref(caches, slots, "flash_attn").view(torch.int16))
    layers = prepare_layers(caches, "flash_attn")
    with warnings.catch_warnings():
        warnings.simplefilter("error")                       # once only
        assert paged_copy.launch_plan(layers, "gather").block_t == 64          # the heuristic's tile
        paged_scatter(got, caches, slots, "flash_attn")
        assert paged_copy.tile(64, 2, "gather", "device", "cpu") == (64, 64, 4)
        assert paged_copy.tile(64, 2, "gather", "device", "NVIDIA H100 80GB HBM3") == (2, 16, 1)  # on that GPU
        assert paged_copy.tile(64, 2, "gather") == (2, 16, 1)  # no device named: not checked


def test_v1_file_is_read_as_placement_device(tuning_path):
    """Decision (tuning.py's docstring): version-1 keys mean device-resident chunks, the only ones
    the version-1 tuner timed; the device name is checked as in version 2."""
    write(tuning_path, {"gather/64/2": TUNED}, version=1)
    assert tuning.load_file(tuning_path) == ("cpu", {"gather/device/64/2": tuning.TileConfig(2, 16, 1)})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert paged_copy.tile(64, 2, "gather", "device", "cpu") == (2, 16, 1)
        assert paged_copy.tile(64, 2, "gather", "pinned", "cpu") == (64, 64, 4)
    write(tuning_path, {"gather/64/2": TUNED}, version=1, device="NVIDIA A100-SXM4-80GB")
    tuning.reset()
    with pytest.warns(RuntimeWarning, match="tuned on 'NVIDIA A100-SXM4-80GB'"):
        assert paged_copy.tile(64, 2, "gather", "device", "cpu") == (64, 64, 4)
    write(tuning_path, {"gather/64/2": TUNED}, version=1, device=None)   # v1 did not require a device
    tuning.reset()
    with pytest.warns(RuntimeWarning, match="an unnamed device"):
        assert paged_copy.tile(64, 2, "gather", "device", "cpu") == (64, 64, 4)
    write(tuning_path, {}, version=1, device=None)                      # nothing to apply: silent
    tuning.reset()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert paged_copy.tile(64, 2, "gather", "device", "cpu") == (64, 64, 4)


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
