"""Engine throughput: store, lookup and retrieve of one long prompt, against a plain copy.

    python -m bench.engine [--tokens 8192] [--layers 32] [--heads 8] [--head-size 128] [--repeats 5]

Defaults are a Llama-3-8B-shaped KV (32 layers, 8 KV heads, head 128, bf16): 128 KiB per token,
1 GiB for 8192 tokens. The baseline is a plain contiguous copy of the same number of bytes in the
same run (the memory bandwidth this machine gives a single copy). Medians over `--repeats`; the
first store is reported apart because it faults in the CPU tier's pages.
"""

from __future__ import annotations

import argparse
import time

import torch

from bench.common import context, median, write_json
from lmcache_triton import LMCacheEngineBuilder, LMCacheEngineConfig, LMCacheEngineMetadata, create_gpu_connector
from lmcache_triton.tools.testing import make_kv_caches, random_slot_mapping


def _timed(fn) -> float:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-size", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--chunk-size", type=int, default=256)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args(argv)

    cuda = torch.cuda.is_available()
    device, layout = ("cuda", "vllm_packed") if cuda else ("cpu", "vllm_cpu")
    dtype = torch.bfloat16
    nbytes = args.tokens * args.layers * 2 * args.heads * args.head_size * dtype.itemsize
    num_blocks = -(-args.tokens // args.block_size) + 4
    config = LMCacheEngineConfig.from_defaults(chunk_size=args.chunk_size, max_local_cpu_size=nbytes * 1.05 / 2**30 + 0.05)
    metadata = LMCacheEngineMetadata(model_name="bench/llama-8b-shaped", world_size=1, worker_id=0, kv_dtype=dtype,
                                     kv_shape=(args.layers, 2, args.chunk_size, args.heads, args.head_size))
    geo = dict(num_layers=args.layers, num_blocks=num_blocks, block_size=args.block_size, num_kv_heads=args.heads,
               head_size=args.head_size, dtype=dtype, device=device)
    g = torch.Generator().manual_seed(0)
    src, dst = make_kv_caches(layout, generator=g, **geo), make_kv_caches(layout, fill=0, **geo)
    tokens = torch.randint(0, 32000, (args.tokens,), generator=g)
    slots = random_slot_mapping(args.tokens, num_blocks=num_blocks, block_size=args.block_size, generator=g,
                                device=device)
    engine = LMCacheEngineBuilder.get_or_create("bench", config, metadata, create_gpu_connector(config, metadata, layout))
    try:
        kw = dict(kvcaches=src, slot_mapping=slots)
        first_store = _timed(lambda: engine.store(tokens, **kw))
        stores, lookups, retrieves = [], [], []
        for _ in range(args.repeats):
            engine.storage_manager.clear()
            stores.append(_timed(lambda: engine.store(tokens, **kw)))
            lookups.append(_timed(lambda: engine.lookup(tokens)))
            retrieves.append(_timed(lambda: engine.retrieve(tokens, kvcaches=dst, slot_mapping=slots)))
        assert engine.lookup(tokens) == args.tokens
    finally:
        LMCacheEngineBuilder.destroy("bench")

    a = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(1)
    b = torch.empty_like(a).fill_(0)
    copies = [_timed(lambda: b.copy_(a)) for _ in range(args.repeats)]

    gb = nbytes / 1e9
    copy_gbps = gb / median(copies)
    result = {
        **context(), "layout": layout, "tokens": args.tokens, "layers": args.layers, "kv_heads": args.heads,
        "head_size": args.head_size, "dtype": "bfloat16", "bytes": nbytes, "repeats": args.repeats,
        "store_gbps": gb / median(stores), "store_first_gbps": gb / first_store,
        "retrieve_gbps": gb / median(retrieves), "lookup_ms": median(lookups) * 1e3,
        "plain_copy_gbps": copy_gbps,
    }
    print(f"{result['device']}  layout={layout}  {args.tokens} tokens x {args.layers} layers x {args.heads} heads x "
          f"{args.head_size} bf16 = {nbytes / 2**30:.2f} GiB  (median of {args.repeats})")
    print(f"  store    {result['store_gbps']:7.2f} GB/s  ({result['store_gbps'] / copy_gbps:.2f}x plain copy; "
          f"first store into fresh pages {result['store_first_gbps']:.2f} GB/s)")
    print(f"  retrieve {result['retrieve_gbps']:7.2f} GB/s  ({result['retrieve_gbps'] / copy_gbps:.2f}x plain copy)")
    print(f"  lookup   {result['lookup_ms']:7.2f} ms for {args.tokens} tokens ({args.tokens // args.chunk_size} chunks)")
    print(f"  plain contiguous copy of the same bytes: {copy_gbps:.2f} GB/s")
    print(f"  wrote {write_json('engine', result)}")
    return result


if __name__ == "__main__":
    main()
