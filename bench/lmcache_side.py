"""The engine-level workload of `bench compare`, and its LMCache side.

    <lmcache venv>/bin/python bench/lmcache_side.py SPEC.json     (prints one `RESULT {json}` line)

Runs in LMCache's own virtual environment (torch + lmcache only: this file imports nothing from
lmcache_triton or bench, so it runs there unchanged). bench/compare.py imports `run_workload` from
here for the lmcache_triton side, so both sides time exactly the same code on the same bytes.

The workload: one prompt of `tokens` tokens in vLLM's paged layout (flash_attn: per layer
[2, num_blocks, block_size, kv_heads, head_size], bf16, random blocks in the slot mapping), CPU tier
only. First store into a fresh tier, then `repeats` x (clear, store, lookup, retrieve into a zeroed
cache); medians. After the last retrieve the scattered blocks must equal the source.

LMCache on CPU: its factory (CreateGPUConnector) has no CPU connector for vLLM, and
VLLMPagedMemGPUConnectorV2 creates CUDA streams and asserts a CUDA device. `CPUPagedConnector` is
that class with only those spots replaced (stub streams, no device assert, layer pointers cached
per cache rather than per device); every copy still
goes through LMCache's own device_ops.multi_layer_kv_transfer, which on CPU is its torch fallback.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
import traceback
from typing import Any, Callable

import torch


def make_inputs(spec: dict) -> dict:
    """Source/destination caches, slots and tokens, bit-identical on both sides (same seed, same torch)."""
    bs, heads, hs, layers, n = spec["block_size"], spec["heads"], spec["head_size"], spec["layers"], spec["tokens"]
    nb = -(-n // bs) + 4
    g = torch.Generator().manual_seed(0)
    src = torch.randn((layers, 2, nb, bs, heads, hs), generator=g, dtype=torch.float32).to(torch.bfloat16)
    dst = torch.zeros_like(src)
    blocks = torch.randperm(nb, generator=g)[: -(-n // bs)]
    slots = (blocks[:, None] * bs + torch.arange(bs)[None, :]).reshape(-1)[:n].to(torch.int64)
    tokens = torch.randint(0, 32000, (n,), generator=g)
    return {"src": list(src.unbind(0)), "dst": list(dst.unbind(0)), "slots": slots, "tokens": tokens,
            "blocks": blocks, "bytes": n * layers * 2 * heads * hs * src.element_size()}


def _timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    t = time.perf_counter()
    out = fn()
    return time.perf_counter() - t, out


def _not_comparable(e: BaseException) -> str:
    return f"not comparable: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"


def run_workload(spec: dict, engine, clear: Callable[[], Any]) -> dict:
    """Times store / lookup / retrieve on `engine` (LMCache's API, which lmcache_triton keeps).
    An operation that raises is reported as "not comparable: <reason>" rather than failing the run."""
    x = make_inputs(spec)
    gb = x["bytes"] / 1e9
    store = lambda: engine.store(x["tokens"], kvcaches=x["src"], slot_mapping=x["slots"])  # noqa: E731
    out: dict[str, Any] = {"bytes": x["bytes"]}
    try:
        out["store_first_gbps"] = gb / _timed(store)[0]
    except Exception as e:  # noqa: BLE001 - the reason is the result
        traceback.print_exc(file=sys.stderr)
        return {**out, **{k: _not_comparable(e) for k in ("store_gbps", "lookup_ms", "retrieve_gbps")}}
    stores, lookups, retrieves, hits, found = [], [], [], [], []
    for _ in range(spec["repeats"]):
        clear()
        stores.append(_timed(store)[0])
        t, n = _timed(lambda: engine.lookup(x["tokens"]))
        lookups.append(t), hits.append(int(n))
        for d in x["dst"]:
            d.zero_()
        try:
            t, mask = _timed(lambda: engine.retrieve(x["tokens"], kvcaches=x["dst"], slot_mapping=x["slots"]))
        except Exception as e:  # noqa: BLE001
            traceback.print_exc(file=sys.stderr)
            out["retrieve_gbps"] = _not_comparable(e)
            break
        retrieves.append(t), found.append(int(mask.sum()))
    out |= {"store_gbps": gb / statistics.median(stores), "lookup_ms": statistics.median(lookups) * 1e3,
            "lookup_hits": hits[-1]}
    if retrieves:
        b = x["blocks"]
        out |= {"retrieve_gbps": gb / statistics.median(retrieves), "retrieved_tokens": found[-1],
                "verified": all(torch.equal(s[:, b], d[:, b]) for s, d in zip(x["src"], x["dst"]))}
    return out


# ---------------------------------------------------------------- LMCache

def _cpu_connector_cls():
    from lmcache.utils import EngineType
    from lmcache.v1.gpu_connector import gpu_connectors as g
    from lmcache.v1.platform.devices.cpu.stub_cpu_device import StubStream

    class CPUPagedConnector(g.VLLMPagedMemGPUConnectorV2):
        def __init__(self, *args, **kwargs):
            cuda_stream = torch.cuda.Stream
            torch.cuda.Stream = StubStream  # the parent builds two CUDA streams; CPU has none
            try:
                super().__init__(*args, **kwargs)
            finally:
                torch.cuda.Stream = cuda_stream

        def _initialize_pointers(self, kv_caches):
            # The parent's body minus `assert self.device.type == "cuda"`, and the pointer table
            # keyed by the caches' address instead of the device index: vLLM registers its caches
            # once, but this workload retrieves into a second cache, which the parent would miss
            # (it would write into the first one).
            self.device = kv_caches[0].device
            key = kv_caches[0].data_ptr()
            if key in self.kv_cache_pointers_on_gpu:
                return self.kv_cache_pointers_on_gpu[key]
            self.engine_kv_format, kv_caches = g.normalize_kv_and_discover_format(
                kv_caches, EngineType.VLLM, layout_hints=self.layout_hints)
            self.kv_cache_pointers.numpy()[:] = [t.data_ptr() for t in kv_caches]
            self.kv_cache_pointers_on_gpu[key] = self.kv_cache_pointers.clone()
            self.num_blocks = g.get_num_blocks(kv_caches, self.engine_kv_format)
            self.block_size = g.get_block_size(kv_caches, self.engine_kv_format)
            self.page_buffer_size = self.num_blocks * self.block_size
            self.head_size = g.get_head_size(kv_caches, self.engine_kv_format)
            self.block_stride_elems = g.resolve_block_stride_and_log_layout(
                kv_caches, self.engine_kv_format, layer_idx=0, group_idx=0) or 0
            return self.kv_cache_pointers_on_gpu[key]

    return CPUPagedConnector


def run_lmcache(spec: dict) -> dict:
    import lmcache
    from lmcache.utils import EngineType
    from lmcache.v1.cache_engine import LMCacheEngineBuilder
    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.gpu_connector import CreateGPUConnector
    from lmcache.v1.metadata import LMCacheMetadata

    nbytes = spec["tokens"] * spec["layers"] * 2 * spec["heads"] * spec["head_size"] * 2
    config = LMCacheEngineConfig.from_defaults(chunk_size=spec["chunk_size"], local_cpu=True,
                                               max_local_cpu_size=nbytes * 1.05 / 2**30 + 0.05)
    metadata = LMCacheMetadata(model_name="bench/llama-8b-shaped", world_size=1, local_world_size=1, worker_id=0,
                               local_worker_id=0, kv_dtype=torch.bfloat16,
                               kv_shape=(spec["layers"], 2, spec["chunk_size"], spec["heads"], spec["head_size"]))
    notes = {"lmcache": lmcache.__version__, "torch": torch.__version__}
    try:
        CreateGPUConnector(config, metadata, EngineType.VLLM)
        notes["factory"] = "ok"
    except Exception as e:  # noqa: BLE001
        notes["factory"] = f"{type(e).__name__}: {e}"
    try:
        # NHD: with block_size 16 and 8 heads LMCache cannot tell [.., bs, heads, ..] from HND by shape.
        connector = _cpu_connector_cls().from_metadata(metadata, False, torch.device("cpu"),
                                                       layout_hints={"kv_layout": "NHD"})
        connector_name = "VLLMPagedMemGPUConnectorV2 (CUDA streams/assert stubbed; LMCache's torch copy)"
    except Exception as e:  # noqa: BLE001
        reason = _not_comparable(e)
        return {"notes": notes, **{k: reason for k in ("store_gbps", "lookup_ms", "retrieve_gbps")}}
    engine = LMCacheEngineBuilder.get_or_create("bench-compare", config, metadata, connector,
                                                lambda t, r: None, lambda o, r: o)
    try:
        engine.post_init()
        return {"notes": notes | {"connector": connector_name}, **run_workload(spec, engine, engine.clear)}
    finally:
        LMCacheEngineBuilder.destroy("bench-compare")


def main() -> None:
    spec = json.loads(open(sys.argv[1]).read())
    try:
        result = run_lmcache(spec)
    except Exception as e:  # noqa: BLE001 - e.g. lmcache fails to import on this host
        traceback.print_exc(file=sys.stderr)
        result = {k: _not_comparable(e) for k in ("store_gbps", "lookup_ms", "retrieve_gbps")}
    print("RESULT " + json.dumps(result), flush=True)
    # LMCache leaves non-daemon threads (stats logger, event loop) that would keep us alive.
    os._exit(0)


if __name__ == "__main__":
    main()
