"""Start-up and the first store: the CPU tier's pages committed ahead (now) or on first use (before).

    python -m bench.startup [--gb 4] [--tokens 8192] [--layers 32] [--rounds 2] [--repeats 3] [--settle 3]

For each way (`prefault=False` on the pool: pages fault in on first use, as before issue #14; the
default: a background thread commits them from start), in alternating rounds and each with a fresh
engine of a `--gb` CPU tier:

- start: creating the engine (its pool included), ms;
- committed: from creating the engine until the whole tier is committed (the prefault thread ends);
- first store at once: one prompt (`--tokens` x `--layers` of Llama-3-8B-shaped KV, bf16: 1 GiB by
  default) stored right after start, while the thread is at work;
- first store: the same into another fresh engine once its tier is committed (the connector creates
  the engine when vLLM registers its KV caches, before vLLM warms up and starts serving);
- warm store: clear, then store again (median of `--repeats`).

Also a plain copy of the same bytes into fresh memory and into the same memory again. Memory: the
tier plus twice the prompt.

Fresh memory is not equally fresh everywhere. In a VM with free page reporting (this one:
page_reporting_order=11), memory the guest freed goes back to the host a second or two later, and
its next first touch faults on the host too: ~0.5-0.7 GB/s, against ~2-3.5 GB/s for memory freed
just before (guest-only faults, as on bare metal). So each engine (and the fresh plain copy) starts
`--settle` seconds after the previous one freed its memory, as a newly started server would, the
two ways alternate, and each figure is the median over `--rounds`.
"""

from __future__ import annotations

import argparse
import gc
import time
from contextlib import contextmanager

import torch

from bench.common import context, median, write_json
from lmcache_triton import LMCacheEngineBuilder, LMCacheEngineConfig, LMCacheEngineMetadata, create_gpu_connector
from lmcache_triton.storage import local_cpu
from lmcache_triton.tools.testing import make_kv_caches, random_slot_mapping

WAYS = ("before", "after")  # prefault off, on


@contextmanager
def _prefault(on: bool):
    """Engines created inside get pools with prefault=`on` (StorageManager does not pass it on)."""
    pool_cls = local_cpu.TensorMemoryPool
    local_cpu.TensorMemoryPool = lambda *a, **kw: pool_cls(*a, **{**kw, "prefault": on})
    try:
        yield
    finally:
        local_cpu.TensorMemoryPool = pool_cls


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _plain_copy(nbytes: int, settle: float) -> tuple[float, float]:
    """GB/s of one copy into fresh memory, then into the same memory again."""
    src = torch.empty(nbytes, dtype=torch.uint8).fill_(1)
    time.sleep(settle)
    dst = torch.empty(nbytes, dtype=torch.uint8)
    fresh = _timed(lambda: dst.copy_(src))
    warm = _timed(lambda: dst.copy_(src))
    return nbytes / fresh / 1e9, nbytes / warm / 1e9


def one_way(on: bool, args, x: dict) -> dict:
    config = LMCacheEngineConfig.from_defaults(chunk_size=256, max_local_cpu_size=args.gb)
    metadata = LMCacheEngineMetadata(model_name="bench/llama-8b-shaped", world_size=1, worker_id=0,
                                     kv_dtype=torch.bfloat16,
                                     kv_shape=(args.layers, 2, 256, args.heads, args.head_size))
    store_kw = dict(kvcaches=x["src"], slot_mapping=x["slots"])
    out = {}
    with _prefault(on):
        for case in ("at_once", "committed"):
            gc.collect()  # the previous engine's pool unmapped before the clock starts
            time.sleep(args.settle)
            t0 = time.perf_counter()
            engine = LMCacheEngineBuilder.get_or_create("bench-startup", config, metadata,
                                                        create_gpu_connector(config, metadata, "vllm_cpu"))
            start = time.perf_counter() - t0
            try:
                pool = engine.storage_manager.cpu.pool
                if case == "at_once":
                    out["start_ms"] = start * 1e3
                    out["store_first_at_once_gbps"] = x["gb"] / _timed(lambda: engine.store(x["tokens"], **store_kw))
                    continue
                pool.wait_prefault()
                out["committed_s"] = time.perf_counter() - t0 if on else None
                out["store_first_gbps"] = x["gb"] / _timed(lambda: engine.store(x["tokens"], **store_kw))
                warm = []
                for _ in range(args.repeats):
                    engine.storage_manager.clear()
                    warm.append(_timed(lambda: engine.store(x["tokens"], **store_kw)))
                out["store_warm_gbps"] = x["gb"] / median(warm)
                assert engine.lookup(x["tokens"]) == args.tokens
            finally:
                LMCacheEngineBuilder.destroy("bench-startup")
                engine = pool = None
    return out


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gb", type=float, default=4.0, help="CPU tier size (max_local_cpu_size), GB")
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-size", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--rounds", type=int, default=2, help="before/after pairs, alternating; medians over them")
    p.add_argument("--repeats", type=int, default=3, help="warm stores per engine")
    p.add_argument("--settle", type=float, default=3.0,
                   help="seconds between freeing memory and the next fresh engine (see above)")
    args = p.parse_args(argv)

    dtype = torch.bfloat16
    nbytes = args.tokens * args.layers * 2 * args.heads * args.head_size * dtype.itemsize
    if nbytes > args.gb * 2**30 * 0.95:
        raise SystemExit(f"the prompt ({nbytes / 2**30:.2f} GiB) must fit in the tier (--gb {args.gb})")
    num_blocks = -(-args.tokens // args.block_size) + 4
    g = torch.Generator().manual_seed(0)
    src = make_kv_caches("vllm_cpu", generator=g, num_layers=args.layers, num_blocks=num_blocks,
                         block_size=args.block_size, num_kv_heads=args.heads, head_size=args.head_size,
                         dtype=dtype, device="cpu")
    x = {"src": src, "gb": nbytes / 1e9, "tokens": torch.randint(0, 32000, (args.tokens,), generator=g),
         "slots": random_slot_mapping(args.tokens, num_blocks=num_blocks, block_size=args.block_size, generator=g,
                                      device="cpu")}
    ctx = context()
    print(f"{ctx['device']}  CPU tier {args.gb:g} GB, first store {nbytes / 2**30:.2f} GiB "
          f"({args.tokens} tokens x {args.layers} layers), {args.rounds} rounds")
    runs = {w: [] for w in WAYS}
    copies = []
    for r in range(args.rounds):
        copies.append(_plain_copy(nbytes, args.settle))
        for way in (WAYS if r % 2 == 0 else WAYS[::-1]):
            runs[way].append(one_way(way == "after", args, x))
            print(f"  round {r + 1} {way:6s} " + "  ".join(
                f"{k} {v:.2f}" for k, v in runs[way][-1].items() if v is not None), flush=True)

    def med(way: str, key: str) -> float | None:
        vals = [run[key] for run in runs[way] if run[key] is not None]
        return median(vals) if vals else None

    keys = ("start_ms", "committed_s", "store_first_at_once_gbps", "store_first_gbps", "store_warm_gbps")
    rows = {way: {k: med(way, k) for k in keys} for way in WAYS}
    plain = {"fresh_gbps": median([c[0] for c in copies]), "warm_gbps": median([c[1] for c in copies])}
    print(f"\n  {'':8s} {'start ms':>9s} {'committed s':>12s} {'1st store at once':>18s} {'1st store':>10s} "
          f"{'warm store':>11s}  (GB/s)")
    for way in WAYS:
        v = rows[way]
        committed = "-" if v["committed_s"] is None else f"{v['committed_s']:.2f}"
        print(f"  {way:8s} {v['start_ms']:9.1f} {committed:>12s} {v['store_first_at_once_gbps']:18.2f} "
              f"{v['store_first_gbps']:10.2f} {v['store_warm_gbps']:11.2f}")
    print(f"  plain copy of the same bytes: {plain['fresh_gbps']:.2f} GB/s into fresh memory, "
          f"{plain['warm_gbps']:.2f} into the same memory again")
    result = {**ctx, "gb": args.gb, "bytes": nbytes, "tokens": args.tokens, "layers": args.layers,
              "rounds": args.rounds, "settle_s": args.settle, "before": rows["before"], "after": rows["after"], "plain_copy": plain,
              "runs": runs}
    print(f"  wrote {write_json('startup', result)}")
    return result


if __name__ == "__main__":
    main()
