"""vLLM's Python API with lmcache_triton: the second request loads the shared prefix.

    python examples/offline_llm.py --model /path/to/model
"""

import argparse
import time


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    args = p.parse_args()

    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    llm = LLM(model=args.model, enable_prefix_caching=False,  # every reuse goes through lmcache_triton
              kv_transfer_config=KVTransferConfig(
                  kv_connector="LMCacheTritonConnectorV1", kv_role="kv_both",
                  kv_connector_extra_config={"lmcache.chunk_size": 256, "lmcache.max_local_cpu_size": 5}))
    document = "Here is a long document. " * 400
    params = SamplingParams(temperature=0.0, max_tokens=32)
    for question in ("Summarize it.", "What is the first sentence?"):
        t = time.perf_counter()
        out = llm.generate([document + question], params)[0]
        print(f"{time.perf_counter() - t:.2f}s  loaded {out.num_cached_tokens} tokens: {out.outputs[0].text!r}")


if __name__ == "__main__":  # vLLM starts worker processes: keep the guard
    main()
