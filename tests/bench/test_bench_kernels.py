"""The kernel bench's own logic: the target verdicts, the staged alternative it times, and the oracle
check of every output before it is timed (bench.kernels, bench.blend_kernels, the tuner)."""

from __future__ import annotations

import json

import pytest
import torch

import bench.common as bench_common
import bench.kernels as bench_kernels
from bench import blend_kernels
from bench.common import graph_or_eager
from bench.kernels import MODELS, Model, Row, _staged, check_targets, kernel_columns, verdict_lines, write_csv
from lmcache_triton.kernels import paged_copy, paged_gather_ref, tuning, use_triton
from lmcache_triton.tools.testing import make_kv_caches, random_slot_mapping


def _row(**kw) -> Row:
    """A CUDA row, everything graph-timed; the kernel's ratios equal the whole call's unless given."""
    base = dict(model="llama3-8b", layout="vllm_packed", block_size=16, tokens=256, scope="all-layers",
                direction="gather", chunk_on="device", path="triton", bytes=1, ms=1.0, gbps=1.0, ref_gbps=1.0,
                copy_gbps=1.0, vs_ref=3.0, vs_copy=0.85, timing="graph", ref_timing="graph", copy_timing="graph")
    base |= kw
    base.setdefault("kernel_vs_ref", base["vs_ref"])
    base.setdefault("kernel_vs_copy", base["vs_copy"])
    return Row(**base)


def _verdicts(rows: list[Row], judged: str) -> dict:
    return {(t["target"].split(" >=")[0], t["direction"]): t["verdict"] for t in check_targets(rows)
            if t["judged"] == judged and "torch reference" not in t["target"]}


def test_targets_judge_the_256_token_32_layer_rows():
    rows = [_row(), _row(direction="scatter", vs_copy=0.79, vs_ref=1.5),
            _row(chunk_on="pinned-host", vs_copy=0.93), _row(chunk_on="pinned-host", direction="scatter", vs_copy=0.5),
            _row(tokens=2048, vs_copy=0.1), _row(scope="one-layer", vs_copy=0.1),
            _row(model="deepseek-v3-mla", vs_copy=0.1)]
    want = {("device chunk", "gather"): "PASS", ("device chunk", "scatter"): "FAIL",
            ("pinned-host chunk", "gather"): "PASS", ("pinned-host chunk", "scatter"): "FAIL"}
    assert _verdicts(rows, "kernel") == want and _verdicts(rows, "whole call") == want
    ref = [t for t in check_targets(rows) if "torch reference" in t["target"] and t["judged"] == "kernel"]
    assert [(t["direction"], t["ok"]) for t in ref] == [("gather", True), ("scatter", False)]


def test_kernel_pass_whole_call_fail_prints_both_lines():
    """The kernel meets the target in graph replays; the call, with the host's time, does not."""
    targets = [t for t in check_targets([_row(vs_copy=0.4, kernel_vs_copy=0.91, host_us=23.5)])
               if t["target"].startswith("device chunk >= 80%")]
    assert [(t["judged"], t["verdict"], t["value"]) for t in targets] == [("kernel", "PASS", 0.91),
                                                                          ("whole call", "FAIL", 0.4)]
    kernel, call = verdict_lines(targets)
    assert kernel.startswith("PASS  kernel ") and "0.91 (>= 0.8)" in kernel and "host" not in kernel
    assert call.startswith("FAIL  whole call ") and "0.40 (>= 0.8)" in call and "host 23.5 us/call" in call


@pytest.mark.parametrize("kw,why", [
    pytest.param(dict(timing="n/a", ref_timing="n/a", copy_timing="n/a", kernel_vs_copy=None, kernel_vs_ref=None),
                 "needs a GPU", id="no-cuda"),
    pytest.param(dict(timing="eager", kernel_vs_copy=0.1), "the launcher could not be captured", id="launcher-eager"),
    pytest.param(dict(copy_timing="eager", kernel_vs_copy=0.1), "the plain copy could not be captured",
                 id="copy-eager"),
])
def test_kernel_line_without_graph_timing_is_skip_not_fail(kw, why):
    targets = [t for t in check_targets([_row(vs_copy=0.1, **kw)]) if t["target"].startswith("device chunk >= 80%")]
    kernel, call = targets
    assert kernel["judged"] == "kernel" and kernel["verdict"] == "SKIP" and kernel["ok"] is None
    assert why in kernel["why"]
    assert verdict_lines([kernel])[0].startswith("SKIP  kernel ")
    # The whole call is judged on CUDA (FAIL here), and skipped without CUDA.
    assert call["verdict"] == ("SKIP" if kw.get("timing") == "n/a" else "FAIL")


def test_the_kernel_is_judged_against_the_reference_timed_eager():
    """The torch reference reads slots back to the host, so it never captures; its eager time is
    its real cost, and the graph-timed kernel is judged against it (not skipped)."""
    targets = check_targets([_row(ref_timing="eager")])
    got = [(t["target"].split(" >= ")[1], t["judged"], t["verdict"]) for t in targets]
    assert got == [("80% of the device-to-device copy", "kernel", "PASS"),
                   ("80% of the device-to-device copy", "whole call", "PASS"),
                   ("2x the torch reference", "kernel", "PASS"), ("2x the torch reference", "whole call", "PASS")]
    targets = check_targets([_row(ref_timing="eager", timing="eager")])
    assert "the launcher could not be captured" in targets[2]["why"] and targets[2]["verdict"] == "SKIP"


def test_graph_timer_falls_back_to_eager_when_capture_fails():
    def refuses_capture(fn):
        raise RuntimeError("operation not permitted when stream is capturing\nmore")

    assert graph_or_eager(lambda: None, lambda fn: 2e-6, lambda fn: 9e-6) == (2e-6, "graph", "")
    s, timing, why = graph_or_eager(lambda: None, refuses_capture, lambda fn: 9e-6)
    assert (s, timing) == (9e-6, "eager") and why == "RuntimeError: operation not permitted when stream is capturing"


def test_kernel_columns_and_host_time():
    row = kernel_columns(_row(bytes=10_000, ms=0.05, timing="n/a"), (20e-6, "graph", ""),
                         (100e-6, "eager", "RuntimeError: sync"), (800.0, "graph", ""))
    assert (row.timing, row.ref_timing, row.copy_timing) == ("graph", "eager", "graph")
    assert row.kernel_ms == pytest.approx(0.02) and row.kernel_gbps == pytest.approx(0.5)
    assert row.kernel_vs_ref == pytest.approx(5.0) and row.kernel_vs_copy == pytest.approx(0.5 / 800)
    assert row.host_us == pytest.approx(30.0)          # 50 us whole call - 20 us kernel
    assert row.timing_note == "torch reference not captured, do_bench instead (RuntimeError: sync)"
    eager = kernel_columns(_row(ms=0.05), (40e-6, "eager", "E: x"), (1e-4, "graph", ""), (1.0, "graph", ""))
    assert eager.host_us is None                         # only against a graph-timed kernel


def test_csv_has_the_timing_columns(tmp_path, monkeypatch):
    import csv

    monkeypatch.setattr(bench_kernels, "RESULTS", tmp_path)
    path = write_csv("kernels", [_row(kernel_ms=0.01, host_us=12.5), _row(timing="n/a")], {"device": "x"})
    rows = list(csv.DictReader(path.open()))
    for col in ("timing", "ref_timing", "copy_timing", "kernel_ms", "kernel_gbps", "kernel_vs_copy", "kernel_vs_ref",
                "host_us", "timing_note", "ms", "gbps", "vs_copy"):
        assert col in rows[0], col
    assert (rows[0]["timing"], rows[0]["host_us"]) == ("graph", "12.5")
    assert (rows[1]["timing"], rows[1]["host_us"], rows[1]["kernel_gbps"]) == ("n/a", "", "")


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
    rows = json.loads(next(tiny_bench.glob("kernels-*.json")).read_text())["rows"]
    if not torch.cuda.is_available():
        assert {(r["timing"], r["kernel_ms"], r["host_us"]) for r in rows} == {("n/a", None, None)}


def test_quick_on_cpu_skips_the_kernel_verdicts_and_exits_0(tiny_bench, monkeypatch, capsys):
    """--quick on a CPU host, with a small 32-layer model standing in for Llama-8B (the targets'
    rows: 256 tokens x 32 layers): every target line is SKIP, none FAIL, and the exit code is 0."""
    if torch.cuda.is_available():
        pytest.skip("the CPU behaviour")
    monkeypatch.setitem(MODELS, "tiny32", Model("tiny32", num_layers=32, num_kv_heads=1, head_size=8,
                                                layout="flash_attn"))
    assert bench_kernels.main(["--quick", "--models", "tiny32", "--tokens", "256", "--block-sizes", "16",
                               "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    lines = [line.strip() for line in out.splitlines()
             if line.strip().startswith(("PASS", "FAIL", "SKIP")) and (" kernel " in line or " whole call " in line)]
    # 2 device targets (copy, reference) x gather/scatter x (kernel, whole call); no pinned rows without CUDA
    assert len(lines) == 8 and all(line.startswith("SKIP") for line in lines)
    assert sum(line.startswith("SKIP  kernel ") and "needs a GPU" in line for line in lines) == 4


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
    assert best == {"gather/device/16/2": tuning.TileConfig(2, 16, 1), "scatter/device/16/2": best["scatter/device/16/2"]}
    assert len(wrong) == 1 and wrong[0].startswith("gather/device/16/2 {'BLOCK_T': 4, 'BLOCK_D': 16, 'num_warps': 1}: ")
    assert "FAIL, rejected gather/device/16/2" in capsys.readouterr().out
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
