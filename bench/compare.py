"""The same engine-level workload on lmcache_triton and on LMCache, in one run, with ratios.

    python -m bench.compare [--cases 8192:32 32768:8] [--repeats 3] [--lmcache-version 0.5.6] [--plot]

Store, lookup and retrieve of a prompt in vLLM's paged layout on the CPU tier, Llama-3-8B-shaped KV
(8 KV heads, head 128, bf16; 128 KiB per token at 32 layers). A case is TOKENS:LAYERS. Defaults:
8K tokens x 32 layers (1 GiB) and 32K tokens x 8 layers (1 GiB): 32K x 32 layers is 4 GiB per copy,
and each side holds three (source cache, CPU tier, destination cache), too much beside the other
jobs on this 16-24 GiB host; `--cases 32768:32` runs it where RAM allows.

The workload lives in bench/lmcache_side.py and runs unchanged on both sides, each in its own
process: lmcache_triton in this interpreter's environment, LMCache in its own virtual environment
(.bench-venvs/lmcache-<version>, created on the first run: torch==<this torch> then lmcache; reused
after). Layout: flash_attn ([2, blocks, block_size, heads, head]), the one paged layout LMCache's
CPU (torch) fallback supports; it has no connector for vLLM's CPU backend layout at all.
An operation LMCache cannot run here is printed as "not comparable: <reason>".
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VENVS = ROOT / ".bench-venvs"
OPS = (("store_gbps", "store GB/s", True), ("retrieve_gbps", "retrieve GB/s", True),
       ("lookup_ms", "lookup ms", False), ("store_first_gbps", "first store GB/s", True))
# If lmcache's full dependency set cannot be installed (its CUDA-only pins), these are what its
# engine imports on the CPU path; installed beside `lmcache --no-deps`.
MINIMAL_DEPS = ["numpy<=2.2.6", "pyyaml", "safetensors", "msgspec", "prometheus_client", "psutil", "py-cpuinfo",
                "sortedcontainers", "aiofiles", "aiofile", "blake3", "pyzmq", "redis", "cachetools", "nvtx", "numba",
                "transformers", "aiohttp", "httpx", "fastapi", "uvicorn", "opentelemetry-api<=1.40.0",
                "opentelemetry-sdk", "opentelemetry-exporter-prometheus<=0.61b0", "cufile-python"]


def torch_pin() -> str:
    import torch

    return f"torch=={torch.__version__.split('+')[0]}"


def ensure_lmcache_venv(version: str) -> tuple[Path, str]:
    """The venv's python and how it was installed. A stamp marks a finished install, so a venv
    cut short (or partly removed) is rebuilt instead of half-used."""
    venv = VENVS / f"lmcache-{version}"
    py, stamp = venv / "bin" / "python", venv / ".bench-installed"
    if py.exists() and stamp.exists():
        return py, stamp.read_text().strip()
    print(f"creating {venv} (once; later runs reuse it) ...", flush=True)
    shutil.rmtree(venv, ignore_errors=True)
    pip = [str(py), "-m", "pip", "install", "-q"]
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    subprocess.run(pip + [torch_pin()], check=True)
    if subprocess.run(pip + [f"lmcache=={version}"]).returncode == 0:
        how = f"pip install {torch_pin()}; pip install lmcache=={version} (full dependencies)"
    else:
        print("full install failed; retrying with --no-deps and the deps its CPU path imports", flush=True)
        subprocess.run(pip + ["--no-deps", f"lmcache=={version}"], check=True)
        subprocess.run(pip + MINIMAL_DEPS, check=True)
        how = f"pip install {torch_pin()}; pip install --no-deps lmcache=={version}; pip install {' '.join(MINIMAL_DEPS)}"
    stamp.write_text(how + "\n")
    return py, how


def _side(python: str, args: list[str], label: str) -> dict:
    """Runs one side in a fresh process (each holds a few GiB; never both at once); the last
    `RESULT {json}` line of its stdout is the answer."""
    t = time.perf_counter()
    proc = subprocess.run([python, *args], cwd=ROOT, capture_output=True, text=True)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if not lines:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-5:]
        reason = f"not comparable: {label} exited {proc.returncode}: {' | '.join(tail)}"
        return {k: reason for k, _, _ in OPS}
    out = json.loads(lines[-1][len("RESULT "):])
    out["wall_s"] = time.perf_counter() - t
    return out


def run_ours(spec_path: str) -> None:
    """The lmcache_triton side (this environment): same workload, our engine and connector."""
    import os

    from bench.lmcache_side import run_workload
    from lmcache_triton import LMCacheEngineBuilder, LMCacheEngineConfig, LMCacheEngineMetadata, create_gpu_connector

    spec = json.loads(Path(spec_path).read_text())
    nbytes = spec["tokens"] * spec["layers"] * 2 * spec["heads"] * spec["head_size"] * 2
    import torch

    config = LMCacheEngineConfig.from_defaults(chunk_size=spec["chunk_size"],
                                               max_local_cpu_size=nbytes * 1.05 / 2**30 + 0.05)
    metadata = LMCacheEngineMetadata(model_name="bench/llama-8b-shaped", world_size=1, worker_id=0,
                                     kv_dtype=torch.bfloat16,
                                     kv_shape=(spec["layers"], 2, spec["chunk_size"], spec["heads"], spec["head_size"]))
    engine = LMCacheEngineBuilder.get_or_create("bench-compare", config, metadata,
                                                create_gpu_connector(config, metadata, "flash_attn"))
    try:
        out = run_workload(spec, engine, engine.storage_manager.clear)
    finally:
        LMCacheEngineBuilder.destroy("bench-compare")
    print("RESULT " + json.dumps({"notes": {"torch": torch.__version__, "connector": "flash_attn"}, **out}), flush=True)
    os._exit(0)


def ratio(ours, theirs, higher_better: bool) -> str | float:
    if isinstance(ours, str):
        return ours
    if isinstance(theirs, str):
        return theirs
    return ours / theirs if higher_better else theirs / ours


def _fmt(v) -> str:
    return f"{v:10.2f}" if isinstance(v, float) else f"{'n/a':>10}"


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--side", nargs=2, metavar=("NAME", "SPEC"), help=argparse.SUPPRESS)
    p.add_argument("--cases", nargs="+", default=["8192:32", "32768:8"], help="TOKENS:LAYERS (default: %(default)s)")
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-size", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--chunk-size", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--lmcache-version", default="0.5.6")
    p.add_argument("--lmcache-python", help="use this interpreter for the LMCache side (skips the venv install)")
    p.add_argument("--plot", action="store_true", help="draw a PNG of the ratios next to the JSON (needs matplotlib)")
    args = p.parse_args(argv)
    if args.side:
        run_ours(args.side[1])
        return {}

    from bench.common import context, plot_bars, progress, write_json

    if args.lmcache_python:
        lmc_py, how = Path(args.lmcache_python), "given with --lmcache-python"
    else:
        lmc_py, how = ensure_lmcache_venv(args.lmcache_version)
    rows = []
    with tempfile.TemporaryDirectory(prefix="lmct-compare-") as tmp:
        for case in progress(args.cases, total=len(args.cases), desc="compare"):
            tokens, layers = (int(v) for v in case.split(":"))
            spec = {"tokens": tokens, "layers": layers, "heads": args.heads, "head_size": args.head_size,
                    "block_size": args.block_size, "chunk_size": args.chunk_size, "repeats": args.repeats}
            sp = Path(tmp) / f"{case.replace(':', '-')}.json"
            sp.write_text(json.dumps(spec))
            ours = _side(sys.executable, ["-m", "bench.compare", "--side", "lmcache_triton", str(sp)], "lmcache_triton")
            theirs = _side(str(lmc_py), [str(ROOT / "bench" / "lmcache_side.py"), str(sp)], "LMCache")
            rows.append({**spec, "lmcache_triton": ours, "lmcache": theirs,
                         "ratios": {k: ratio(ours.get(k, "missing"), theirs.get(k, "missing"), hb) for k, _, hb in OPS}})
    result = {**context(), "layout": "flash_attn", "lmcache_install": how, "rows": rows}
    _print(result)
    path = write_json("compare", result)
    print(f"wrote {path}")
    if args.plot:
        groups = {f"{r['tokens']} tokens x {r['layers']} layers": {label: r["ratios"][k] for k, label, _ in OPS
                                                                   if isinstance(r["ratios"][k], float)} for r in rows}
        png = plot_bars(path.with_suffix(".png"), "lmcache_triton / LMCache per operation (>1: ours faster)",
                        groups, "ratio")
        print(f"wrote {png}")
    return result


def _print(result: dict) -> None:
    r0 = result["rows"][0] if result["rows"] else {}
    print(f"\n{result['device']}  layout flash_attn, CPU tier, bf16, {r0.get('heads')} KV heads x {r0.get('head_size')}, "
          f"block {r0.get('block_size')}, chunk {r0.get('chunk_size')}, median of {r0.get('repeats')}")
    print(f"LMCache: {r0.get('lmcache', {}).get('notes', {})}\n  installed: {result['lmcache_install']}")
    print(f"{'case':<18} {'operation':<17} {'lmcache_triton':>14} {'LMCache':>10} {'ratio (>1: ours faster)':>24}")
    for r in result["rows"]:
        for k, label, _ in OPS:
            o, t, q = r["lmcache_triton"].get(k), r["lmcache"].get(k), r["ratios"][k]
            qs = f"{q:24.2f}x" if isinstance(q, float) else "  " + str(q)
            print(f"{r['tokens']:>6} tok x {r['layers']:>2} L  {label:<17} {_fmt(o):>14} {_fmt(t)} {qs}")
        for side in ("lmcache_triton", "lmcache"):
            s = r[side]
            if "verified" in s or "lookup_hits" in s:
                print(f"{'':18} {side}: retrieved {s.get('retrieved_tokens')} / lookup {s.get('lookup_hits')} of "
                      f"{r['tokens']} tokens, bytes equal: {s.get('verified')}")


if __name__ == "__main__":
    main()
