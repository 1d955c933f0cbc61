"""Serde and disk-tier throughput for one 256-token Llama-8B chunk (32 MiB of bf16 KV).

    python -m bench.storage_local [--repeats 5] [--dir /path/on/the/disk] [--fsync]

Serde: serialize / deserialize GB/s (of raw chunk bytes) for naive and lz4, and lz4's ratio, on
two kinds of data: random normal bf16 (near-incompressible: its mantissa bits are noise) and a
smooth function plus small noise (compresses somewhat). Real KV sits in between and varies by
model and layer: measure on a dump of real KV before relying on lz4.

Disk: LocalDiskBackend put / get GB/s next to a plain open/write/(fsync)/close and
open/readinto of the same bytes, in the same run. Reads come from the page cache (dropping it
needs root), so they measure our overhead over a warm read rather than the device.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from bench.common import context, median, median_seconds, write_json
from lmcache_triton.storage.memory import MemoryFormat, MemoryObj, TensorMemoryPool
from lmcache_triton.metadata import LMCacheEngineMetadata
from lmcache_triton.storage.local_disk import LocalDiskBackend
from lmcache_triton.storage.serde import deserialize, serialize
from lmcache_triton.keys import CacheEngineKey

FMT = MemoryFormat.KV_2LTD


def _time_interleaved(fns: list[Callable[[], object]], repeats: int) -> list[float]:
    """Median seconds of each fn, calling them in turn each round, each after an os.sync().

    Without the sync a write's cost depends on the dirty pages its predecessors left (the kernel
    throttles writers during writeback): a plain write measured 0.4 to 5 GB/s here depending on
    what ran before it. Interleaving also spreads any drift over candidate and baseline alike.
    """
    for fn in fns:
        fn()
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for fn, ts in zip(fns, times):
            os.sync()
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
    return [median(ts) for ts in times]


def make_data(kind: str, layers: int, tokens: int, hidden: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    shape = (2, layers, tokens, hidden)
    if kind == "random":
        return torch.randn(shape, generator=g).to(torch.bfloat16)
    # smooth along tokens and channels (rotary-like), plus noise ~1% of the signal
    pos = torch.arange(tokens, dtype=torch.float32)[:, None]
    freq = torch.exp(-torch.arange(hidden, dtype=torch.float32) / hidden * 6.0)[None, :]
    base = torch.sin(pos * freq) + 0.5 * torch.cos(0.37 * pos * freq)
    scale = torch.linspace(0.5, 2.0, layers)[None, :, None, None]
    noisy = base[None, None] * scale + 0.01 * torch.randn(shape, generator=g)
    return noisy.to(torch.bfloat16)


def bench_serde(t: torch.Tensor, kind: str, repeats: int) -> list[dict]:
    rows = []
    nbytes = t.numel() * t.element_size()
    out = torch.empty_like(t)
    for comp in ("naive", "lz4"):
        data = serialize("bench", t, FMT, comp)
        s = median_seconds(lambda: serialize("bench", t, FMT, comp), repeats)
        d = median_seconds(lambda: deserialize(data, out=out), repeats)
        assert torch.equal(out.view(torch.uint8), t.view(torch.uint8))
        rows.append({"bench": "serde", "data": kind, "compression": comp, "raw_bytes": nbytes,
                     "stored_bytes": len(data), "ratio": nbytes / len(data),
                     "serialize_GBps": nbytes / s / 1e9, "deserialize_GBps": nbytes / d / 1e9})
    return rows


def bench_disk(t: torch.Tensor, root: Path, repeats: int, fsync: bool) -> list[dict]:
    layers, tokens, hidden = t.shape[1], t.shape[2], t.shape[3]
    meta = LMCacheEngineMetadata("bench/llama-8b", 1, 0, torch.bfloat16, (layers, 2, tokens, 8, hidden // 8))
    nbytes = t.numel() * t.element_size()
    raw = memoryview(t.reshape(-1).view(torch.uint8).numpy())
    rows = []

    # baseline: the same bytes through plain file calls. Each write makes a new file, as a cache
    # put does: rewriting one file is ~4x faster here, as its freed pages are reused at once.
    plain_dir = root / "plain"
    plain_dir.mkdir()
    names = iter(range(1 << 30))
    buf = bytearray(nbytes)

    def plain_write() -> None:
        with open(plain_dir / f"{next(names)}.bin", "wb") as f:
            f.write(raw)
            if fsync:
                f.flush()
                os.fsync(f.fileno())

    def plain_read() -> None:
        with open(plain_dir / "0.bin", "rb") as f:
            f.readinto(buf)

    pool = TensorMemoryPool(2 * nbytes + (1 << 20), pin_memory=False)
    for comp in ("naive", "lz4"):
        d = root / comp
        backend = LocalDiskBackend(d, 4 * (repeats + 2) * nbytes, meta, compression=comp, fsync=fsync)
        counter = iter(range(1 << 30))
        obj = MemoryObj(t, FMT)

        def put() -> None:  # a fresh key each time: a stored key is not rewritten
            key = CacheEngineKey(meta.model_name, 1, 0, "bfloat16", FMT.value, f"{next(counter):032x}")
            assert backend.put(key, obj)

        key0 = CacheEngineKey(meta.model_name, 1, 0, "bfloat16", FMT.value, "f" * 32)
        backend.put(key0, obj)

        def get() -> None:
            got = backend.get(key0, pool.allocate)
            assert got is not None
            got.free()

        pw, pt = _time_interleaved([plain_write, put], repeats)
        pr, gt = _time_interleaved([plain_read, get], repeats)
        backend.close()
        shutil.rmtree(d)
        for p in plain_dir.glob("*.bin"):
            if p.name != "0.bin":
                p.unlink()
        rows.append({"bench": "disk", "compression": comp, "fsync": fsync, "raw_bytes": nbytes,
                     "put_GBps": nbytes / pt / 1e9, "get_GBps": nbytes / gt / 1e9,
                     "plain_write_GBps": nbytes / pw / 1e9, "plain_read_GBps": nbytes / pr / 1e9,
                     "put_vs_plain_write": pw / pt, "get_vs_plain_read": pr / gt})
    shutil.rmtree(plain_dir)
    return rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--hidden", type=int, default=1024, help="num_kv_heads * head_size (Llama-8B: 8 * 128)")
    p.add_argument("--dir", type=Path, default=None, help="where the disk bench writes (default: a temp dir)")
    p.add_argument("--fsync", action="store_true", help="fsync every write (backend and baseline)")
    args = p.parse_args(argv)

    rows: list[dict] = []
    for kind in ("random", "smooth"):
        t = make_data(kind, args.layers, args.tokens, args.hidden)
        rows += bench_serde(t, kind, args.repeats)
    print(f"serde, chunk {tuple(t.shape)} bf16 = {t.numel() * 2 / 2**20:.0f} MiB, median of {args.repeats}")
    print(f"{'data':8} {'comp':6} {'ser GB/s':>9} {'de GB/s':>8} {'ratio':>6}")
    for r in rows:
        print(f"{r['data']:8} {r['compression']:6} {r['serialize_GBps']:9.2f} {r['deserialize_GBps']:8.2f} "
              f"{r['ratio']:6.3f}")

    tmp = Path(tempfile.mkdtemp(prefix="lmct-bench-", dir=args.dir))
    try:
        disk = bench_disk(make_data("random", args.layers, args.tokens, args.hidden), tmp, args.repeats, args.fsync)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"\ndisk ({tmp.parent}, fsync={args.fsync}; reads warm in the page cache), random bf16")
    print(f"{'comp':6} {'put GB/s':>9} {'plain write':>12} {'get GB/s':>9} {'plain read':>11}")
    for r in disk:
        print(f"{r['compression']:6} {r['put_GBps']:9.2f} {r['plain_write_GBps']:12.2f} {r['get_GBps']:9.2f} "
              f"{r['plain_read_GBps']:11.2f}")
    path = write_json("storage_local", {**context(), "args": {k: str(v) for k, v in vars(args).items()},
                                        "rows": rows + disk})
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
