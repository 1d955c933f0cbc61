"""Engine throughput: store, lookup and retrieve of one long prompt, against a plain copy.

    python -m bench.engine [--layout LAYOUT[,LAYOUT...] | all] [--block-size 16[,128]] [--one-block-order]
                           [--allocations one,separate] [--dtype bfloat16[,float32]] [--tokens 8192]
                           [--layers 32] [--heads 8] [--head-size 128] [--repeats 5]

Defaults are a Llama-3-8B-shaped KV (32 layers, 8 KV heads, head 128, bf16): 128 KiB per token,
1 GiB for 8192 tokens, in the layout this host serves with (vllm_cpu on a CPU host, vllm_packed on
CUDA). `--layout all` measures every layout vLLM hands over: vllm_packed in each of its six stride
orders (`vllm_packed:LBHNC`; plain `vllm_packed` is LBNHC), vllm_cpu, flash_attn, flashinfer and mla
(one latent of `--mla-dim` per token). Each layout and block size gets a fresh engine.

`--allocations one` makes all layers' caches one tensor (vLLM 0.32 places every layer in one
backing allocation), `separate` gives each layer its own (older vLLM, other engines); both by
default.

The prompt's slots are whole blocks in a random order (vLLM's mapping of a prompt), a new order for
every store and every retrieve, as consecutive prompts get (`--one-block-order`: one order for
all). The baseline is torch's copy of the same number of bytes between two dense buffers (on CUDA
one on the device, one in pinned host memory, copied the op's way), timed
right before and right after every store and every retrieve (this VM's bandwidth drifts by a third
within minutes): each figure is the median over `--repeats` rounds of the op's speed as a fraction
of the mean of the copies around it. The first store is reported apart because it faults in the CPU
tier's pages. Retrieved bytes are checked against the stored ones with the oracle
(kernels/naive.py) on a sample of tokens.
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from bench.common import context, median, write_json
from lmcache_triton import LMCacheEngineBuilder, LMCacheEngineConfig, LMCacheEngineMetadata, create_gpu_connector
from lmcache_triton.kernels import LAYOUTS, reference
from lmcache_triton.kernels.naive import naive_gather
from lmcache_triton.tools.testing import PACKED_ORDERS, make_kv_caches, random_slot_mapping

ALL_LAYOUTS = [f"vllm_packed:{o}" for o in PACKED_ORDERS] + [x for x in LAYOUTS if x != "vllm_packed"]


def _timed(fn) -> float:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def _layouts(spec: str | None, cuda: bool) -> list[str]:
    if spec is None:
        return ["vllm_packed" if cuda else "vllm_cpu"]
    names = ALL_LAYOUTS if spec == "all" else spec.split(",")
    for name in names:
        layout, _, order = name.partition(":")
        if layout not in LAYOUTS or (order and (layout != "vllm_packed" or order not in PACKED_ORDERS)):
            raise SystemExit(f"unknown layout {name!r}: one of {', '.join(ALL_LAYOUTS)}, or all")
    return names


def _sample_equal(src, src_slots, dst, dst_slots, layout: str, gen: torch.Generator) -> bool:
    """Retrieved == stored on 64 random tokens, read by the oracle."""
    pick = torch.randperm(src_slots.numel(), generator=gen)[:64].to(src_slots.device)
    return torch.equal(naive_gather(src, src_slots[pick], layout).view(torch.uint8),
                       naive_gather(dst, dst_slots[pick], layout).view(torch.uint8))


def run_case(name: str, block_size: int, dtype: torch.dtype, separate: bool, args: argparse.Namespace,
             device: str) -> dict:
    """One fresh engine for one layout, block size, dtype and allocation: first store, then
    `repeats` store / lookup / retrieve rounds, each store and retrieve between two plain copies of
    the same bytes."""
    layout, _, order = name.partition(":")
    mla = layout == "mla"
    heads, head_size = (1, args.mla_dim) if mla else (args.heads, args.head_size)
    nbytes = args.tokens * args.layers * (1 if mla else 2) * heads * head_size * dtype.itemsize
    num_blocks = -(-args.tokens // block_size) + 4
    config = LMCacheEngineConfig.from_defaults(chunk_size=args.chunk_size, max_local_cpu_size=nbytes * 1.05 / 2**30 + 0.05)
    metadata = LMCacheEngineMetadata(model_name="bench/llama-8b-shaped", world_size=1, worker_id=0, kv_dtype=dtype,
                                     kv_shape=(args.layers, 1 if mla else 2, args.chunk_size, heads, head_size),
                                     use_mla=mla)
    geo = dict(num_layers=args.layers, num_blocks=num_blocks, block_size=block_size, num_kv_heads=heads,
               head_size=head_size, dtype=dtype, device=device, order=order or "LBNHC")
    g = torch.Generator().manual_seed(0)
    src, dst = make_kv_caches(layout, generator=g, **geo), make_kv_caches(layout, fill=0, **geo)
    if separate:      # each layer its own tensor (clone keeps a dense layer's strides)
        src, dst = [c.clone() for c in src], [c.clone() for c in dst]
    tokens = torch.randint(0, 32000, (args.tokens,), generator=g)

    def new_slots() -> torch.Tensor:
        return random_slot_mapping(args.tokens, num_blocks=num_blocks, block_size=block_size, generator=g,
                                   device=device)

    store_slots = retrieve_slots = new_slots()
    # The baseline: a plain copy of the same bytes, timed beside each store and retrieve (this VM's
    # memory bandwidth drifts by a third within minutes; a baseline timed apart skews the ratio).
    # On CUDA the tier is pinned host memory, so the copies are the DMA either way: device -> pinned
    # beside a store, pinned -> device beside a retrieve.
    a = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(1)
    b = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True) if device == "cuda" else torch.empty_like(a)
    b.fill_(0)
    engine = LMCacheEngineBuilder.get_or_create("bench", config, metadata, create_gpu_connector(config, metadata, layout))
    counts = dict(reference.path_counts)
    try:
        first_store = _timed(lambda: engine.store(tokens, kvcaches=src, slot_mapping=store_slots))
        stores, lookups, retrieves, copies, store_ratios, retrieve_ratios = [], [], [], [], [], []
        for _ in range(args.repeats):
            engine.storage_manager.clear()
            if not args.one_block_order:
                store_slots, retrieve_slots = new_slots(), new_slots()
            before = _timed(lambda: b.copy_(a))
            stores.append(_timed(lambda: engine.store(tokens, kvcaches=src, slot_mapping=store_slots)))
            between = _timed(lambda: b.copy_(a))
            lookups.append(_timed(lambda: engine.lookup(tokens)))
            back = _timed(lambda: a.copy_(b))
            retrieves.append(_timed(lambda: engine.retrieve(tokens, kvcaches=dst, slot_mapping=retrieve_slots)))
            after = _timed(lambda: a.copy_(b))
            copies += [before, between, back, after]
            store_ratios.append((before + between) / 2 / stores[-1])
            retrieve_ratios.append((back + after) / 2 / retrieves[-1])
        assert engine.lookup(tokens) == args.tokens
        correct = _sample_equal(src, store_slots, dst, retrieve_slots, layout, g)
    finally:
        LMCacheEngineBuilder.destroy("bench")
    paths = {k: v - counts.get(k, 0) for k, v in reference.path_counts.items() if v != counts.get(k, 0)}
    del src, dst, a, b
    gb = nbytes / 1e9
    return {
        "layout": name, "block_size": block_size, "dtype": str(dtype).removeprefix("torch."),
        "allocations": "separate" if separate else "one", "bytes": nbytes, "store_gbps": gb / median(stores),
        "store_first_gbps": gb / first_store, "retrieve_gbps": gb / median(retrieves),
        "lookup_ms": median(lookups) * 1e3, "plain_copy_gbps": gb / median(copies),
        # medians of each round's ratio to the copies timed around it
        "store_vs_copy": median(store_ratios), "retrieve_vs_copy": median(retrieve_ratios),
        "correct": correct, "paths": paths,
    }


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layout", default=None,
                   help="comma-separated layouts, or all (default: vllm_cpu on a CPU host, vllm_packed on CUDA)")
    p.add_argument("--block-size", default="16", help="comma-separated block sizes, e.g. 16,128")
    p.add_argument("--one-block-order", action="store_true",
                   help="one random block order for every store and retrieve (default: a new one per call)")
    p.add_argument("--allocations", default="one,separate",
                   help="one (a tensor holds all layers), separate (a tensor per layer), or both: one,separate")
    p.add_argument("--dtype", default="bfloat16", help="comma-separated cache dtypes, e.g. bfloat16,float32")
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-size", type=int, default=128)
    p.add_argument("--mla-dim", type=int, default=576, help="the latent per token of the mla layout")
    p.add_argument("--chunk-size", type=int, default=256)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args(argv)

    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    block_sizes = [int(x) for x in args.block_size.split(",")]
    dtypes = [getattr(torch, x) for x in args.dtype.split(",")]
    allocations = args.allocations.split(",")
    if not set(allocations) <= {"one", "separate"}:
        raise SystemExit(f"--allocations takes one, separate or both, got {args.allocations!r}")
    cases = [(name, bs, dtype, alloc == "separate") for alloc in allocations for dtype in dtypes
             for bs in block_sizes for name in _layouts(args.layout, cuda)]
    cores = sorted(os.sched_getaffinity(0))
    # the CPU copies run on torch's intra-op threads (vllm-cpu sets them to the worker's cores)
    threads = (f"cores {','.join(map(str, cores))} of this process ({len(cores)}), "
               f"{torch.get_num_threads()} torch threads for the copies")
    ctx = context()
    print(f"{ctx['device']}  {args.tokens} tokens x {args.layers} layers x {args.heads} heads x {args.head_size} "
          f"(mla: {args.mla_dim})  median of {args.repeats}, "
          f"{'one random block order' if args.one_block_order else 'a new random block order per call'}")
    print(f"  {threads}")
    print(f"  {'layout':20s} {'alloc':>8s} {'dtype':>8s} {'block':>5s} {'store GB/s':>11s} {'retrieve GB/s':>14s} "
          f"{'copy GB/s':>10s} {'store/copy':>10s} {'retr/copy':>10s} {'first store':>11s} {'lookup ms':>9s}")
    rows = []
    for name, bs, dtype, separate in cases:
        r = run_case(name, bs, dtype, separate, args, device)
        rows.append(r)
        print(f"  {name:20s} {r['allocations']:>8s} {r['dtype']:>8s} {bs:5d} {r['store_gbps']:11.2f} "
              f"{r['retrieve_gbps']:14.2f} {r['plain_copy_gbps']:10.2f} {r['store_vs_copy']:9.2f}x "
              f"{r['retrieve_vs_copy']:9.2f}x {r['store_first_gbps']:11.2f} "
              f"{r['lookup_ms']:9.2f}{'' if r['correct'] else '  WRONG BYTES'}", flush=True)
    first = rows[0]
    result = {
        **ctx, "threads": threads, "tokens": args.tokens, "layers": args.layers, "kv_heads": args.heads,
        "head_size": args.head_size, "repeats": args.repeats, "one_block_order": args.one_block_order,
        **{k: v for k, v in first.items() if k != "paths"}, "rows": rows,
    }
    print(f"  wrote {write_json('engine', result)}")
    if not all(r["correct"] for r in rows):
        raise SystemExit("retrieved bytes differ from the stored ones (WRONG BYTES above)")
    return result


if __name__ == "__main__":
    main()
