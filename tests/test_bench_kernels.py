"""The kernel bench's own logic: the target verdicts, the staged alternative it times, and the oracle
check of every output before it is timed (bench.kernels, bench.blend_kernels, the tuner)."""

from __future__ import annotations

import json

import pytest
import torch

import bench.common as bench_common
import bench.kernels as bench_kernels
from bench import blend_kernels
from bench.kernels import MODELS, Model, Row, _staged, check_targets
from lmcache_triton.kernels import paged_copy, paged_gather_ref, tuning, use_triton
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


# ---------------------------------------------------------------- outputs are checked before they are timed

TINY = Model("tiny", num_layers=3, num_kv_heads=2, head_size=8, layout="flash_attn")


def _flip_first_byte(t: torch.Tensor) -> None:
    t.view(torch.uint8).view(-1)[0] ^= 1


@pytest.fixture
def tiny_bench(tmp_path, monkeypatch):
    """A three-layer model in MODELS, results written under tmp_path, no user tuning file read."""
    monkeypatch.setitem(MODELS, TINY.name, TINY)
    monkeypatch.setattr(bench_common, "RESULTS", tmp_path)
    monkeypatch.setattr(bench_kernels, "RESULTS", tmp_path)
    (tmp_path / "tuning.json").write_text(json.dumps({"version": 1, "configs": {}}))
    monkeypatch.setenv(tuning.ENV_VAR, str(tmp_path / "tuning.json"))
    tuning.reset()
    yield tmp_path
    tuning.reset()


@pytest.mark.parametrize("launcher,bad_row", [
    pytest.param("paged_gather", ("all-layers", "gather"), id="gather-all-layers"),
    pytest.param("paged_scatter_layer", ("one-layer", "scatter"), id="scatter-one-layer"),
])
def test_a_wrong_copy_is_a_fail_row_and_exit_1(tiny_bench, monkeypatch, capsys, launcher, bad_row):
    real = getattr(bench_kernels, launcher)

    def corrupting(*args, **kwargs):  # one byte wrong: in the chunk a gather wrote, or the layer a scatter wrote
        out = real(*args, **kwargs)
        _flip_first_byte(out if launcher == "paged_gather" else args[1])
        return out

    monkeypatch.setattr(bench_kernels, launcher, corrupting)
    rc = bench_kernels.main(["--models", "tiny", "--tokens", "20", "--block-sizes", "4", "--repeats", "1"])
    assert rc == 1
    printed = capsys.readouterr().out
    assert "oracle check: FAIL, 1 of 4 rows differ from the oracle" in printed
    data = json.loads(next(tiny_bench.glob("kernels-*.json")).read_text())
    checks = {(r["scope"], r["direction"]): r["check"] for r in data["rows"]}
    assert checks.pop(bad_row).startswith("FAIL: launcher: ")   # the torch reference beside it is right
    assert set(checks.values()) == {"ok"}
    assert data["oracle_check"]["failed"] == 1


def test_a_right_sweep_exits_0(tiny_bench, capsys):
    assert bench_kernels.main(["--models", "tiny", "--tokens", "9", "--block-sizes", "4", "--repeats", "1"]) == 0
    assert "oracle check: all 4 rows bit-exact" in capsys.readouterr().out


def test_tune_rejects_a_wrong_tile(tiny_bench, monkeypatch, capsys):
    """bench.kernels.tune (here on CPU, in the interpreter when TRITON_INTERPRET=1): the tile whose
    output is one byte off is reported and never written, whatever its speed."""
    if not use_triton(torch.device("cpu")):
        pytest.skip("the tiles are Triton's: on a CPU host they run only in the interpreter")
    monkeypatch.setattr(bench_kernels, "TUNE_SPACE", dict(block_t=[2, 4], block_d=[16], num_warps=[1]))
    real = paged_copy.gather_into

    def broken_at_4x16(layers, slots, out4, *span):
        real(layers, slots, out4, *span)
        if paged_copy.tile(16, 2, "gather") == (4, 16, 1):
            _flip_first_byte(out4)

    monkeypatch.setattr(paged_copy, "gather_into", broken_at_4x16)
    best, wrong = bench_kernels.tune(["tiny"], 1, tiny_bench / "tuned.json", num_tokens=24, device="cpu")
    assert best == {"gather/16/2": tuning.TileConfig(2, 16, 1), "scatter/16/2": best["scatter/16/2"]}
    assert len(wrong) == 1 and wrong[0].startswith("gather/16/2 {'BLOCK_T': 4, 'BLOCK_D': 16, 'num_warps': 1}: ")
    assert "FAIL, rejected gather/16/2" in capsys.readouterr().out
    assert tuning.load(tiny_bench / "tuned.json") == best


def test_blend_bench_checks_before_timing(monkeypatch):
    real = blend_kernels.selective_write

    def corrupting(dst, src, idx):
        real(dst, src, idx)
        _flip_first_byte(dst)

    monkeypatch.setattr(blend_kernels, "selective_write", corrupting)
    rows = {r["op"]: r["check"] for r in blend_kernels.run(16, 0.25, 1, "cpu")}
    assert rows.pop("selective_write").startswith("FAIL: ")
    assert set(rows.values()) == {"ok"}
