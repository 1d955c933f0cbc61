"""Smoke tests of the bench harness: the commands run and write what they promise. No timings are
asserted here (speed is measured by the benches, never in tests)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench.common import percentile
from bench.compare import ratio
from bench.e2e import summarize


def _bench(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)  # what a CPU host runs: the torch path
    # From outside the checkout: `lmcache-triton bench` must find bench/ on its own.
    return subprocess.run([sys.executable, "-m", "lmcache_triton.tools.cli", "bench", *args], capture_output=True,
                          text=True, timeout=180, cwd=cwd, env=env)


def _written(stdout: str) -> list[Path]:
    return [Path(p) for p in re.findall(r"wrote (\S+)", stdout)]


@pytest.mark.slow
def test_bench_engine_writes_json(tmp_path):
    try:
        import matplotlib  # noqa: F401
        plot = ["--plot"]
    except ImportError:
        plot = []
    r = _bench("engine", "--tokens", "512", "--layers", "2", "--repeats", "1", *plot, cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    files = _written(r.stdout)
    try:
        data = json.loads(next(p for p in files if p.suffix == ".json").read_text())
        for key in ("device", "commit", "time", "store_gbps", "retrieve_gbps", "lookup_ms", "plain_copy_gbps"):
            assert key in data, key
        assert data["tokens"] == 512 and data["layers"] == 2
        if plot:
            assert any(p.suffix == ".png" and p.stat().st_size > 0 for p in files)
    finally:
        for p in files:
            p.unlink(missing_ok=True)


@pytest.mark.slow
def test_bench_kernels_quick_tiny_case(tmp_path):
    r = _bench("kernels", "--quick", "--models", "llama3-8b", "--tokens", "32", "--block-sizes", "16",
               "--repeats", "1", cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    files = _written(r.stdout)
    try:
        data = json.loads(next(p for p in files if p.suffix == ".json").read_text())
        assert data["rows"] and {"gbps", "direction", "model"} <= set(data["rows"][0])
    finally:
        for p in files:
            p.unlink(missing_ok=True)


@pytest.mark.parametrize("command, flags", [("e2e", ["--users", "--rounds", "--docs", "--configs"]),
                                            ("compare", ["--cases", "--lmcache-version", "--plot", "--workloads",
                                                         "--packed", "--prompts", "--tier-gb"]),
                                            ("pd", ["--workloads", "--concurrency", "--docs", "--rounds"])])
def test_bench_help(tmp_path, command, flags):
    r = _bench(command, "--help", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert all(f in r.stdout for f in flags)


def test_bench_unknown_command_is_an_error(tmp_path):
    r = _bench("nope", cwd=tmp_path)
    assert r.returncode == 2 and "invalid choice" in r.stderr


def test_percentile_nearest_rank():
    xs = [float(i) for i in range(1, 101)]
    assert percentile(xs, 50) == 50.0 and percentile(xs, 99) == 99.0 and percentile([3.0], 99) == 3.0


def test_e2e_summary_math():
    rec = {"wall_s": {"long_doc_qa": 2.0}, "requests": [
        {"workload": "long_doc_qa", "round": 0, "prompt_tokens": 100, "cached_tokens": 0, "ttft_s": 0.3,
         "generated_tokens": 10},
        {"workload": "long_doc_qa", "round": 1, "prompt_tokens": 100, "cached_tokens": 100, "ttft_s": 0.1,
         "generated_tokens": 10}]}
    s = summarize(rec, "long_doc_qa")
    assert s["hit_rate"] == 0.5 and s["generated_tokens_per_s"] == 10.0 and s["requests_per_s"] == 1.0
    assert s["ttft_mean_ms_by_round"] == pytest.approx([300, 100]) and s["ttft_mean_ms"] == pytest.approx(200)


def test_compare_ratio_keeps_reasons():
    assert ratio(4.0, 2.0, True) == 2.0 and ratio(1.0, 2.0, False) == 2.0
    assert ratio(4.0, "not comparable: x", True) == "not comparable: x"


_PACKED = {"workload": "packed", "tokens": 96, "layers": 2, "heads": 2, "head_size": 8, "block_size": 16,
           "chunk_size": 32, "prompts": 2, "tier_gb": 0.01}


def test_compare_packed_inputs_are_vllm_packed_in_whole_blocks_a_new_order_per_prompt():
    from bench.lmcache_side import make_packed_inputs

    x = make_packed_inputs(_PACKED)
    src = x["src"]
    # vllm_packed: per layer [num_blocks, heads, block_size, 2*head_size], all layers one allocation
    assert [tuple(c.shape) for c in src] == [(10, 2, 16, 16)] * 2
    assert src[0].untyped_storage().data_ptr() == src[1].untyped_storage().data_ptr()
    assert len(x["prompts"]) == 1 + _PACKED["prompts"]
    orders = set()
    for p in x["prompts"]:
        for key in ("store_slots", "retrieve_slots"):
            blocks = p[key].view(-1, 16)
            assert bool((blocks[:, 0] % 16 == 0).all()) and bool((blocks == blocks[:, :1] + torch.arange(16)).all())
            orders.add(tuple((blocks[:, 0] // 16).tolist()))
    assert len(orders) == 2 * len(x["prompts"])    # a new permutation per prompt and direction
    assert len({tuple(p["tokens"].tolist()) for p in x["prompts"]}) == len(x["prompts"])


def test_compare_packed_workload_on_our_engine_round_trips():
    from bench.lmcache_side import run_packed_workload
    from lmcache_triton import LMCacheEngineBuilder, LMCacheEngineConfig, LMCacheEngineMetadata, create_gpu_connector
    from lmcache_triton.keys import TokenChain

    spec = _PACKED
    config = LMCacheEngineConfig.from_defaults(chunk_size=spec["chunk_size"], max_local_cpu_size=spec["tier_gb"])
    metadata = LMCacheEngineMetadata(model_name="test/packed", world_size=1, worker_id=0, kv_dtype=torch.bfloat16,
                                     kv_shape=(spec["layers"], 2, spec["chunk_size"], spec["heads"], spec["head_size"]))
    def hashed_lookup(engine, tokens):
        hashes = TokenChain(spec["chunk_size"]).chunk_hashes(tokens)
        return lambda: engine.lookup(len(tokens), chunk_hashes=hashes)

    try:
        out = run_packed_workload(spec, lambda: LMCacheEngineBuilder.get_or_create(
            "test-compare-packed", config, metadata, create_gpu_connector(config, metadata, "vllm_packed")),
            hashed_lookup)
    finally:
        LMCacheEngineBuilder.destroy("test-compare-packed")
    assert out["verified"] is True and out["retrieved_tokens"] == out["lookup_hits"] == spec["tokens"]
    assert out["lookup_hashes_hits"] == spec["tokens"] and isinstance(out["lookup_hashes_ms"], float)
    assert len(out["stores_gbps"]) == len(out["retrieves_gbps"]) == spec["prompts"]
    assert all(isinstance(out[k], float) for k in ("store_gbps", "retrieve_gbps", "lookup_ms", "store_first_gbps"))


_LMCACHE_PY = Path(__file__).resolve().parents[2] / ".bench-venvs" / "lmcache-0.5.6" / "bin" / "python"


@pytest.mark.slow
@pytest.mark.skipif(not _LMCACHE_PY.exists(), reason="no LMCache venv (`bench compare` creates it on its first run)")
def test_bench_compare_runs_both_workloads_on_both_sides(tmp_path):
    r = _bench("compare", "--packed", "256:2", "--prompts", "1", "--tier-gb", "0.05", "--settle", "0", "--cases", "256:2",
               "--repeats", "1", "--lmcache-python", str(_LMCACHE_PY), cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    files = _written(r.stdout)
    try:
        data = json.loads(next(p for p in files if p.suffix == ".json").read_text())
        assert [row.get("name", row["workload"]) for row in data["rows"]] == ["packed", "packed-separate", "cpu",
                                                                              "flash_attn"]
        for row in data["rows"]:
            for side in ("lmcache_triton", "lmcache"):
                assert row[side]["verified"] is True, (row["workload"], side, row[side])
            assert all(isinstance(v, float) for v in row["ratios"].values()), row["ratios"]
    finally:
        for p in files:
            p.unlink(missing_ok=True)


def test_storage_flags_go_to_the_module_that_has_them():
    from bench.cli import argv_for

    argv = ["--repeats", "2", "--no-redis", "--dir", "/x", "--fsync", "--bogus"]
    assert argv_for("bench.storage_local", argv) == ["--repeats", "2", "--dir", "/x", "--fsync", "--bogus"]
    assert argv_for("bench.storage_remote", argv) == ["--reps", "2", "--no-redis", "--bogus"]


def test_gpu_check_runs_its_sections_apart_and_skips_what_needs_a_gpu(tmp_path):
    """Each section on its own, one verdict line per target, one JSON; no speed asserted (the
    host-cost verdict may say FAIL on a loaded host: only that it was judged is checked)."""
    r = _bench("gpu-check", "--quick", "--sections", "topology,host_cost,pinned,memcheck", cwd=tmp_path)
    lines = r.stdout.splitlines()
    assert any(re.match(r"(PASS|FAIL)  host_cost: host cost per all-layers call < 20 us \(\d+\.\d us\)", ln)
               for ln in lines), r.stdout + r.stderr
    (path,) = [p for p in _written(r.stdout) if p.suffix == ".json"]
    try:
        sections = json.loads(path.read_text())["sections"]
        assert list(sections) == ["topology", "host_cost", "pinned", "memcheck"]
        assert sections["host_cost"]["status"] == "ran" and sections["host_cost"]["us"]["engine_gather_all_layers"] > 0
        if not torch.cuda.is_available():
            assert all(sections[s]["status"] == "skipped" for s in ("topology", "pinned", "memcheck"))
            assert "SKIP  pinned: needs a CUDA device" in r.stdout
    finally:
        path.unlink(missing_ok=True)
