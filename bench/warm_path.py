"""Where a warm request's time goes: the connector's calls timed inside vLLM, one process.

    python -m bench.warm_path [--tokens 8192] [--requests 8] [--dtype float32] [--model PATH]

vLLM with the connector (a CPU tier of 4x the prompt's KV), its engine core in this process
(VLLM_ENABLE_V1_MULTIPROCESSING=0: the scheduler, the worker and the lookup server share it, as
they do inside vLLM's engine-core process). A prompt is computed and saved once, then sent again
`--requests` times (each loads all but its last token); every call vLLM makes into the connector
is timed (the lookup `get_num_new_matched_tokens`, the metadata, the load `start_load_kv`, ...),
and so is a plain torch copy of the prompt's KV bytes in this process. Prints each call's
milliseconds per request (the median over the requests) next to the requests' median TTFT: the
load against the copy is the kernel's share of the warm path, the rest is the connector's own.
The bench ttft's model (the demo's shape, 40960 positions) unless `--model`.
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import time

# The connector's calls a step makes, scheduler side then worker side.
CALLS = ("get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta", "bind_connector_metadata",
         "start_load_kv", "wait_for_save", "get_finished", "get_block_ids_with_load_errors",
         "get_kv_connector_stats", "get_kv_connector_kv_cache_events", "request_finished", "update_connector_output")


def _time_calls(cls: type, names: tuple[str, ...], into: dict[str, list[float]]) -> None:
    for name in names:
        original = getattr(cls, name)

        def timed(self, *args, _original=original, _name=name, **kwargs):
            t0 = time.perf_counter()
            try:
                return _original(self, *args, **kwargs)
            finally:
                into[_name].append(time.perf_counter() - t0)
        setattr(cls, name, timed)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--model", default=None)
    args = p.parse_args(argv)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"

    import torch

    from bench.common import context, write_json
    from bench.ttft import BENCH_SPEC, _copy_ms, _model_config, kv_bytes_per_token
    from lmcache_triton import LMCacheEngineBuilder
    from lmcache_triton.integration.vllm.connector import LMCacheTritonConnectorV1
    from lmcache_triton.tools.models import build_random_llama, random_prompt
    from lmcache_triton.tools.vllm_demo import CACHE_DIR, start_llm

    calls: dict[str, list[float]] = collections.defaultdict(list)
    _time_calls(LMCacheTritonConnectorV1, CALLS, calls)
    model = args.model or str(build_random_llama(CACHE_DIR / "models" / "ttft-llama-40k", BENCH_SPEC))  # bench ttft's
    # a CPU tier of a few times the prompt's KV: a larger one only commits pages beside the
    # requests (and beside whatever else the host runs)
    tier_gb = max(0.1, round(4 * args.tokens * kv_bytes_per_token(model, args.dtype) / 1e9, 1))
    llm = start_llm(model, connector={"lmcache.max_local_cpu_size": tier_gb}, max_model_len=args.tokens + 64,
                    dtype=args.dtype)
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    def ttft(prompt: list[int]) -> tuple[float, int]:
        t0 = time.perf_counter()
        out = llm.generate([TokensPrompt(prompt_token_ids=prompt)],
                           SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True), use_tqdm=False)[0]
        return time.perf_counter() - t0, out.num_cached_tokens or 0

    vocab = _model_config(model)["vocab_size"]
    ttft(random_prompt(args.tokens, seed=999_999, vocab_size=vocab))  # this length's first-call costs
    prompt = random_prompt(args.tokens, seed=1, vocab_size=vocab)
    ttft(prompt)                      # computed and saved
    time.sleep(1.0)                   # its save lands (after the step, in the background)
    ttft(prompt)                      # the first load
    warm, by_request = [], []
    for _ in range(args.requests):
        time.sleep(0.3)               # vLLM's compute threads idle again, as between requests
        calls.clear()
        warm.append(ttft(prompt))
        by_request.append({name: sum(v) for name, v in calls.items()})  # a call vLLM made twice: both
    nbytes = args.tokens * kv_bytes_per_token(model, args.dtype)
    copy_ms = _copy_ms(nbytes)
    # per call, the median over the requests (a request whose step stalled moves a mean by a third)
    per_request = {name: statistics.median(r.get(name, 0.0) for r in by_request) * 1e3
                   for name in {n for r in by_request for n in r}}
    engines = [LMCacheEngineBuilder.get(i) for i in LMCacheEngineBuilder.instance_ids()]
    stats = engines[0].get_stats() if engines else None  # what a request that loaded less missed, and why
    result = {**context(), "tokens": args.tokens, "dtype": args.dtype, "requests": args.requests,
              "loaded": min(c for _, c in warm), "warm_ms": statistics.median(t for t, _ in warm) * 1e3,
              "copy_ms": copy_ms, "threads": torch.get_num_threads(), "calls_ms_per_request": per_request,
              "miss_tokens": getattr(stats, "miss_tokens", {}), "load_decisions": getattr(stats, "load_decisions", {})}
    print(f"{args.tokens} tokens ({args.dtype}, {result['loaded']} loaded), {args.requests} warm requests, "
          f"{result['threads']} torch threads: TTFT median {result['warm_ms']:.1f} ms; "
          f"a torch copy of the KV bytes ({nbytes / 2**20:.0f} MiB) {copy_ms:.1f} ms")
    for name in CALLS:
        if name in per_request:
            print(f"  {name:36s} {per_request[name]:8.3f} ms per request")
    print(f"  {'the connector in all':36s} {statistics.median(sum(r.values()) for r in by_request) * 1e3:8.3f} "
          f"ms per request")
    print(f"  missed tokens by reason (all requests): {result['miss_tokens']}; decisions: {result['load_decisions']}")
    path = write_json("warm_path", result)
    print(f"wrote {path}")
    return result


if __name__ == "__main__":
    main()
    os._exit(0)  # vLLM's in-process engine leaves threads behind
