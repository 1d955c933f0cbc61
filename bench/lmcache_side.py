"""The engine-level workload of `bench compare`, and its LMCache side.

    <lmcache venv>/bin/python bench/lmcache_side.py SPEC.json     (prints one `RESULT {json}` line)

Runs in LMCache's own virtual environment (torch + lmcache only: this file imports nothing from
lmcache_triton or bench, so it runs there unchanged). bench/compare.py imports `run_workload` from
here for the lmcache_triton side, so both sides time exactly the same code on the same bytes.

Two workloads, chosen by the spec's "workload" key:

* "flash_attn" (`run_workload`): one prompt of `tokens` tokens in vLLM's paged layout (flash_attn:
  per layer [2, num_blocks, block_size, kv_heads, head_size], bf16, random blocks in the slot
  mapping), CPU tier only. First store into a fresh tier, then `repeats` x (clear, store, lookup,
  retrieve into a zeroed cache); medians. After the last retrieve the scattered blocks must equal
  the source.
* "packed" (`run_packed_workload`): vLLM's packed layout (`vllm_packed`: per layer
  [num_blocks, kv_heads, block_size, 2*head_size], K in the first head_size columns, V after; all
  layers views of one allocation, as vLLM 0.32 and bench/engine.py lay them out; with
  "separate_layers" each layer its own tensor, as older vLLM and other engines hand them over),
  or with "layout": "vllm_cpu" the CPU backend's ([num_blocks, kv_heads, 2*block_size, head_size]
  per layer: a head's K half transposed, [head_size, block_size], then its V half), a fresh engine
  with a `tier_gb` CPU tier; its creation is timed ("start_ms"), then `settle_s` seconds pass
  (a server's start-up after it creates the engine), then the first store. 1 + `prompts` distinct prompts
  of `tokens` tokens, each stored from its own random block order and retrieved into another
  (a new permutation of whole blocks per prompt and direction), then looked up. The first prompt
  is the warm-up and gives the first store into the fresh engine; medians over the rest. Every
  retrieve is checked bit for bit against the source (the tokens it reports retrieved). Every
  store and retrieve sits between two plain torch copies of the same bytes (dense buffers), and is
  also reported as a fraction of their mean ("store_vs_copy", "retrieve_vs_copy": medians), so
  both sides' figures read against the memory speed of their own run.

LMCache on CPU, "flash_attn": its factory (CreateGPUConnector) has no CPU connector for vLLM, and
VLLMPagedMemGPUConnectorV2 creates CUDA streams and asserts a CUDA device. `CPUPagedConnector` is
that class with only those spots replaced (stub streams, no device assert, layer pointers cached
per cache rather than per device); every copy still
goes through LMCache's own device_ops.multi_layer_kv_transfer, which on CPU is its torch fallback.
LMCache on CPU, "packed": `TorchPackedConnector`, LMCache's GPUConnectorInterface implemented with
plain torch indexing a layer at a time (cache[blocks, :, offsets] <-> the chunk's K and V rows),
since LMCache has no CPU connector for this layout either; for "vllm_cpu" the same with the K half
read through its transposed view.
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


# ---------------------------------------------------------------- the packed workload

def make_packed_caches(spec: dict, generator: torch.Generator | None) -> list[torch.Tensor]:
    """The caches as vLLM hands them over (lmcache_triton.tools.testing.make_kv_caches): vllm_packed
    as one allocation [layers, blocks, block_size, heads, 2*head_size] (order LBNHC), each layer a
    [blocks, heads, block_size, 2*head_size] view of it; vllm_cpu as [layers, blocks, heads,
    2*block_size, head_size]; with "separate_layers" each layer cloned into its own tensor (same
    strides). Random (generator) or zeros (None)."""
    bs, heads, hs, layers = spec["block_size"], spec["heads"], spec["head_size"], spec["layers"]
    nb = -(-spec["tokens"] // bs) + 4
    cpu = spec.get("layout") == "vllm_cpu"
    shape = (layers, nb, heads, 2 * bs, hs) if cpu else (layers, nb, bs, heads, 2 * hs)
    if generator is None:
        base = torch.zeros(shape, dtype=torch.bfloat16)
    else:
        base = torch.randn(shape, generator=generator, dtype=torch.float32).to(torch.bfloat16)
    caches = list(base.unbind(0) if cpu else base.permute(0, 1, 3, 2, 4).unbind(0))
    return [c.clone() for c in caches] if spec.get("separate_layers") else caches


def make_packed_inputs(spec: dict) -> dict:
    """Caches, and per prompt (1 warm-up + `prompts`) its tokens and a store and a retrieve slot
    mapping, each whole blocks in a new random order; bit-identical on both sides."""
    bs, n = spec["block_size"], spec["tokens"]
    nb = -(-n // bs) + 4
    g = torch.Generator().manual_seed(0)
    src, dst = make_packed_caches(spec, g), make_packed_caches(spec, None)

    def slots() -> torch.Tensor:
        blocks = torch.randperm(nb, generator=g)[: -(-n // bs)]
        return (blocks[:, None] * bs + torch.arange(bs)[None, :]).reshape(-1)[:n].to(torch.int64)

    prompts = [{"tokens": torch.randint(0, 32000, (n,), generator=g), "store_slots": slots(),
                "retrieve_slots": slots()} for _ in range(1 + spec["prompts"])]
    return {"src": src, "dst": dst, "prompts": prompts,
            "bytes": n * spec["layers"] * 2 * spec["heads"] * spec["head_size"] * 2}


def _cpu_k_view(cache: torch.Tensor) -> torch.Tensor:
    """A vllm_cpu layer's K as [blocks, heads, head_size, block_size]: (token o, dim d) of a head's
    K half sits at d * block_size + o (vLLM's CPU attention kernel keeps K transposed)."""
    nb, heads, bs2, hs = cache.shape
    s0, s1, _, _ = cache.stride()
    return cache.as_strided((nb, heads, hs, bs2 // 2), (s0, s1, bs2 // 2, 1), cache.storage_offset())


def _packed_rows(caches: list[torch.Tensor], slots: torch.Tensor, layout: str = "vllm_packed") -> list[torch.Tensor]:
    """Each layer's [tokens, heads, K and V] values of the slots (bits)."""
    if layout == "vllm_cpu":
        bs = caches[0].shape[2] // 2
        blk, off = slots // bs, slots % bs
        return [torch.cat((_cpu_k_view(c)[blk, :, :, off], c[blk, :, bs + off]), dim=-1).view(torch.int16)
                for c in caches]
    bs = caches[0].shape[2]
    blk, off = slots // bs, slots % bs
    return [c[blk, :, off].view(torch.int16) for c in caches]


def run_packed_workload(spec: dict, make_engine: Callable[[], Any],
                        hashed_lookup: Callable[[Any, torch.Tensor], Callable[[], int]] | None = None) -> dict:
    """The inputs first, then `make_engine()` (a fresh engine), then at once the warm-up prompt:
    its store is the first store. Then `prompts` x (store, lookup, lookup by chunk hashes,
    retrieve) of new prompts; medians. `hashed_lookup(engine, tokens)` hashes the prompt's chunks
    as the side's vLLM scheduler does (once per request, as its tokens arrive: not timed) and
    returns the lookup that is handed those hashes instead of the token ids. An operation that
    raises is "not comparable: <reason>"."""
    x = make_packed_inputs(spec)
    gb = x["bytes"] / 1e9
    out: dict[str, Any] = {"bytes": x["bytes"]}
    a = torch.ones(x["bytes"], dtype=torch.uint8)
    b = torch.zeros_like(a)
    copy = lambda: _timed(lambda: b.copy_(a))[0]  # noqa: E731 - the memory speed of this moment
    store_vs_copy, retrieve_vs_copy = [], []
    t0 = time.perf_counter()
    engine = make_engine()
    out["start_ms"] = (time.perf_counter() - t0) * 1e3
    # A server's first request comes after its start-up (vLLM creates the engine when it registers
    # its KV caches, then warms up for seconds): `settle_s` of that, the same on both sides.
    time.sleep(float(spec.get("settle_s", 0.0)))
    stores, lookups, retrieves, hits, found, verified = [], [], [], [], [], []
    hashed_lookups, hashed_hits = [], []
    for i, p in enumerate(x["prompts"]):
        before = copy() if i else 0.0
        try:
            t, _ = _timed(lambda: engine.store(p["tokens"], kvcaches=x["src"], slot_mapping=p["store_slots"]))
        except Exception as e:  # noqa: BLE001 - the reason is the result
            traceback.print_exc(file=sys.stderr)
            out.setdefault("store_first_gbps", _not_comparable(e))
            return {**out, **{k: _not_comparable(e) for k in ("store_gbps", "lookup_ms", "retrieve_gbps")}}
        t_lookup, n = _timed(lambda: engine.lookup(p["tokens"]))  # right after its store, as a server's
        if hashed_lookup is not None and i:
            try:
                t_hashed, n_hashed = _timed(hashed_lookup(engine, p["tokens"]))
                hashed_lookups.append(t_hashed), hashed_hits.append(int(n_hashed))
            except Exception as e:  # noqa: BLE001
                traceback.print_exc(file=sys.stderr)
                out["lookup_hashes_ms"] = _not_comparable(e)
                hashed_lookup = None
        if i == 0:
            out["store_first_gbps"] = gb / t
        else:
            stores.append(t)
            lookups.append(t_lookup), hits.append(int(n))
            between = copy()
            store_vs_copy.append((before + between) / 2 / t)
        try:
            t, mask = _timed(lambda: engine.retrieve(p["tokens"], kvcaches=x["dst"], slot_mapping=p["retrieve_slots"]))
        except Exception as e:  # noqa: BLE001
            traceback.print_exc(file=sys.stderr)
            out["retrieve_gbps"] = _not_comparable(e)
            retrieves = []
            break
        if i:
            retrieves.append(t), found.append(int(mask.sum()))
            retrieve_vs_copy.append((between + copy()) / 2 / t)
        got = mask.to(torch.bool).cpu()     # the tokens the engine says it retrieved must be the stored bytes
        layout = spec.get("layout", "vllm_packed")
        verified.append(bool(got.any()) and all(
            torch.equal(s[got], d[got]) for s, d in zip(_packed_rows(x["src"], p["store_slots"], layout),
                                                        _packed_rows(x["dst"], p["retrieve_slots"], layout))))
    out |= {"store_gbps": gb / statistics.median(stores), "lookup_ms": statistics.median(lookups) * 1e3,
            "lookup_hits": min(hits), "stores_gbps": [gb / t for t in stores],
            "store_vs_copy": statistics.median(store_vs_copy)}
    if hashed_lookups:
        out |= {"lookup_hashes_ms": statistics.median(hashed_lookups) * 1e3, "lookup_hashes_hits": min(hashed_hits)}
    if retrieves:
        out |= {"retrieve_gbps": gb / statistics.median(retrieves), "retrieved_tokens": min(found),
                "retrieves_gbps": [gb / t for t in retrieves], "verified": all(verified),
                "retrieve_vs_copy": statistics.median(retrieve_vs_copy)}
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


def _torch_packed_connector_cls():
    from lmcache.v1.gpu_connector.gpu_connectors import GPUConnectorInterface

    class TorchPackedConnector(GPUConnectorInterface):
        """vllm_packed caches ([num_blocks, heads, block_size, 2*head_size] per layer) <-> LMCache's
        KV_2LTD memory objects ([2, layers, tokens, heads*head_size]), by plain torch indexing, a
        layer at a time: the chunk's slots -> (block, offset), cache[block, :, offset] is the
        tokens' [heads, 2*head_size] rows (K then V)."""

        def __init__(self, layers: int, heads: int, head_size: int, cpu_layout: bool = False):
            self.num_layers, self.heads, self.head_size = layers, heads, head_size
            self.hidden_dim_size = heads * head_size
            self.cpu_layout = cpu_layout  # vllm_cpu: K through its transposed view, V rows after it
            self.kvcaches = None

        def get_shape(self, num_tokens: int) -> torch.Size:
            return torch.Size([2, self.num_layers, num_tokens, self.hidden_dim_size])

        def _at(self, memory_obj, start: int, end: int, kwargs):
            caches, slots = kwargs["kvcaches"], kwargs["slot_mapping"][start:end]
            bs = caches[0].shape[2] // (2 if self.cpu_layout else 1)
            kv = memory_obj.tensor.view(2, self.num_layers, end - start, self.heads, self.head_size)
            return caches, slots // bs, slots % bs, kv

        def from_gpu(self, memory_obj, start: int, end: int, **kwargs):
            caches, blk, off, kv = self._at(memory_obj, start, end, kwargs)
            d = self.head_size
            if self.cpu_layout:
                bs = caches[0].shape[2] // 2
                for layer, c in enumerate(caches):
                    kv[0, layer].copy_(_cpu_k_view(c)[blk, :, :, off])
                    kv[1, layer].copy_(c[blk, :, bs + off])
                return
            for layer, c in enumerate(caches):
                rows = c[blk, :, off]                       # [tokens, heads, 2*head_size]
                kv[0, layer].copy_(rows[..., :d])
                kv[1, layer].copy_(rows[..., d:])

        def to_gpu(self, memory_obj, start: int, end: int, **kwargs):
            caches, blk, off, kv = self._at(memory_obj, start, end, kwargs)
            if self.cpu_layout:
                bs = caches[0].shape[2] // 2
                for layer, c in enumerate(caches):
                    _cpu_k_view(c)[blk, :, :, off] = kv[0, layer]
                    c[blk, :, bs + off] = kv[1, layer]
                return
            for layer, c in enumerate(caches):
                c[blk, :, off] = torch.cat((kv[0, layer], kv[1, layer]), dim=-1)

        def batched_from_gpu(self, memory_objs, starts, ends, **kwargs):
            for m, s, e in zip(memory_objs, starts, ends):
                self.from_gpu(m, s, e, **kwargs)

        def batched_to_gpu(self, memory_objs=None, starts=None, ends=None, **kwargs):
            for m, s, e in zip(memory_objs, starts, ends):
                self.to_gpu(m, s, e, **kwargs)

    return TorchPackedConnector


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


def run_lmcache_packed(spec: dict) -> dict:
    """The packed workload on a fresh LMCache engine with a `tier_gb` CPU tier and TorchPackedConnector."""
    import lmcache
    from lmcache.v1.cache_engine import LMCacheEngineBuilder
    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.metadata import LMCacheMetadata

    config = LMCacheEngineConfig.from_defaults(chunk_size=spec["chunk_size"], local_cpu=True,
                                               max_local_cpu_size=float(spec["tier_gb"]))
    metadata = LMCacheMetadata(model_name="bench/llama-8b-shaped", world_size=1, local_world_size=1, worker_id=0,
                               local_worker_id=0, kv_dtype=torch.bfloat16,
                               kv_shape=(spec["layers"], 2, spec["chunk_size"], spec["heads"], spec["head_size"]))
    notes = {"lmcache": lmcache.__version__, "torch": torch.__version__,
             "connector": "TorchPackedConnector (plain torch indexing per layer; LMCache has no CPU connector)"}

    def make_engine():
        connector = _torch_packed_connector_cls()(spec["layers"], spec["heads"], spec["head_size"],
                                                  cpu_layout=spec.get("layout") == "vllm_cpu")
        engine = LMCacheEngineBuilder.get_or_create("bench-compare-packed", config, metadata, connector,
                                                    lambda t, r: None, lambda o, r: o)
        engine.post_init()
        return engine

    def hashed_lookup(engine, tokens):
        # what its vLLM scheduler hands over in place of the ids: the prefix hashes and chunk lengths
        spans = list(engine.token_database.process_tokens(tokens, make_key=False))
        hashes, offsets = [h for _, _, h in spans], [e - s for s, e, _ in spans]
        return lambda: engine.lookup(hashes=hashes, offsets=offsets)

    try:
        return {"notes": notes, **run_packed_workload(spec, make_engine, hashed_lookup)}
    finally:
        LMCacheEngineBuilder.destroy("bench-compare-packed")


def main() -> None:
    spec = json.loads(open(sys.argv[1]).read())
    try:
        result = run_lmcache_packed(spec) if spec.get("workload") == "packed" else run_lmcache(spec)
    except Exception as e:  # noqa: BLE001 - e.g. lmcache fails to import on this host
        traceback.print_exc(file=sys.stderr)
        result = {k: _not_comparable(e) for k in ("store_gbps", "lookup_ms", "retrieve_gbps", "store_first_gbps")}
    print("RESULT " + json.dumps(result), flush=True)
    # LMCache leaves non-daemon threads (stats logger, event loop) that would keep us alive.
    os._exit(0)


if __name__ == "__main__":
    main()
