"""Lookup and key hashing of one long prompt: what the scheduler hashes per new chunk, and what a
worker's lookup costs once the prompt's chunk hashes are known, against re-hashing from token 0.

    python -m bench.lookup [--tokens 131072] [--chunk-size 256] [--step 8192] [--repeats 21]

- scheduler: the prompt's token chain (`keys.TokenChain`), hashed once at its first lookup, and the
  incremental hashing of a chunked prefill (`--step` tokens a step, what `RequestTracker` does for
  each step's `ReqMeta`): time per new chunk; against the old rule, re-hashing the prefix from
  token 0 every step (O(prompt^2) over the prefill).
- worker: `engine.lookup` of the whole prompt, stored in the CPU tier, from its chunk hashes (what
  the lookup server gets: the scope folded into each key, nothing else hashed), with and without
  reserving the chunks as the lookup server does (the load's release of them is timed apart);
  against a lookup from the token ids (the plain API, which hashes the chain from token 0).
- round trip: the scheduler's `LookupClient` to a lookup server (`LMCacheAsyncLookupServer`, what
  the worker runs) over IPC, sending the chunk hashes (protocol v3) or the token ids.

The KV is tiny (1 layer, 1 head of 16): a lookup's cost does not depend on a chunk's bytes. Medians
over `--repeats`.
"""

from __future__ import annotations

import argparse
import time
import uuid

import torch

from bench.common import context, median, median_seconds, write_json
from lmcache_triton import LMCacheEngineConfig, LMCacheEngineMetadata, create_gpu_connector
from lmcache_triton.engine.engine import LMCacheEngine
from lmcache_triton.engine.token_database import ChunkedTokenDatabase
from lmcache_triton.keys import TokenChain
from lmcache_triton.tools.testing import make_kv_caches


def _prefill_hashing(prompt: list[int], chunk: int, step: int) -> tuple[float, int]:
    """Seconds to hash a chunked prefill incrementally (each step: the new tokens arrive, the step's
    chunk hashes are taken from the first new chunk, as ReqMeta does), and chunks hashed."""
    chain = TokenChain(chunk)
    tokens: list[int] = []
    t0 = time.perf_counter()
    for end in range(step, len(prompt) + step, step):
        end = min(end, len(prompt))
        start = len(tokens) // chunk * chunk
        tokens.extend(prompt[len(tokens):end])
        chain.chunk_hashes(tokens, end // chunk * chunk, start)
    return time.perf_counter() - t0, len(chain.hashes)


def _prefill_rehash(db: ChunkedTokenDatabase, prompt: list[int], step: int) -> float:
    """The old rule: every step re-hashes the prefix from token 0 (the worker got token_ids[:n])."""
    t0 = time.perf_counter()
    for end in range(step, len(prompt) + step, step):
        n = min(end, len(prompt)) // db.chunk_size * db.chunk_size
        for _ in db.process_tokens(prompt[:n]):
            pass
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=131072)
    p.add_argument("--chunk-size", type=int, default=256)
    p.add_argument("--step", type=int, default=8192, help="tokens per chunked-prefill step")
    p.add_argument("--repeats", type=int, default=21)
    p.add_argument("--no-ipc", action="store_true", help="skip the client/server round trip")
    args = p.parse_args(argv)
    chunk, n = args.chunk_size, args.tokens
    n_chunks = n // chunk

    layers, heads, head, block = 1, 1, 16, 16
    num_blocks = -(-n // block) + 4
    nbytes = n * layers * 2 * heads * head * 2
    config = LMCacheEngineConfig.from_defaults(chunk_size=chunk, max_local_cpu_size=nbytes * 1.5 / 2**30 + 0.01)
    metadata = LMCacheEngineMetadata(model_name="bench/lookup", world_size=1, worker_id=0, kv_dtype=torch.bfloat16,
                                     kv_shape=(layers, 2, chunk, heads, head))
    engine = LMCacheEngine(config, metadata, create_gpu_connector(config, metadata, "vllm_cpu"))
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, 128000, (n,), generator=g).tolist()
    caches = make_kv_caches("vllm_cpu", num_layers=layers, num_blocks=num_blocks, block_size=block,
                            num_kv_heads=heads, head_size=head, generator=g)
    slots = torch.arange(n, dtype=torch.long)
    scope = dict(namespace="bench-tenant", adapter="")
    result: dict = {**context(), "tokens": n, "chunk_size": chunk, "chunks": n_chunks, "step": args.step}
    try:
        # ---- scheduler side ----------------------------------------------------------------
        prompt_hash_s = median_seconds(lambda: TokenChain(chunk).chunk_hashes(prompt), max(3, args.repeats // 4))
        hashes = TokenChain(chunk).chunk_hashes(prompt)
        inc = [_prefill_hashing(prompt, chunk, args.step) for _ in range(max(3, args.repeats // 4))]
        inc_s = median([s for s, _ in inc])
        rehash_s = median([_prefill_rehash(engine.token_database, prompt, args.step)
                           for _ in range(max(3, args.repeats // 7))])
        result.update(prompt_hash_ms=prompt_hash_s * 1e3, incremental_us_per_chunk=inc_s / n_chunks * 1e6,
                      prefill_incremental_ms=inc_s * 1e3, prefill_rehash_from_0_ms=rehash_s * 1e3)

        # ---- worker side ---------------------------------------------------------------------
        assert engine.store(n, kvcaches=caches, slot_mapping=slots, chunk_hashes=hashes, **scope) == n
        assert engine.lookup(prompt, **scope) == n, "keys from the hashes differ from keys from the ids"
        lookup_s = median_seconds(lambda: engine.lookup(n, chunk_hashes=hashes, **scope), args.repeats)

        reserved, released = [], []
        for _ in range(args.repeats + 1):  # the lookup server's call; the load's release timed apart
            t0 = time.perf_counter()
            engine.lookup(n, reserve=True, lookup_id="bench", chunk_hashes=hashes, **scope)
            t1 = time.perf_counter()
            engine.release_reservation("bench")
            reserved.append(t1 - t0)
            released.append(time.perf_counter() - t1)
        reserved_s, release_s = median(reserved[1:]), median(released[1:])
        old_list_s = median_seconds(lambda: engine.lookup(prompt, **scope), max(3, args.repeats // 3))
        prompt_t = torch.tensor(prompt)
        old_tensor_s = median_seconds(lambda: engine.lookup(prompt_t, **scope), max(3, args.repeats // 3))
        result.update(lookup_hashes_ms=lookup_s * 1e3, lookup_hashes_reserved_ms=reserved_s * 1e3,
                      release_reservation_ms=release_s * 1e3,
                      lookup_token_ids_ms=old_list_s * 1e3, lookup_token_tensor_ms=old_tensor_s * 1e3)

        # ---- scheduler -> worker round trip ----------------------------------------------
        if not args.no_ipc:
            from lmcache_triton.integration.vllm.lookup.client import LookupClient
            from lmcache_triton.integration.vllm.lookup.server import LMCacheAsyncLookupServer

            eid = f"bench-{uuid.uuid4().hex[:8]}"
            server = LMCacheAsyncLookupServer(engine, eid, 0)
            client = LookupClient(eid, 1, timeout_ms=5000)
            try:
                def round_trips(with_hashes: bool, repeats: int) -> float:
                    times = []
                    for _ in range(repeats + 1):
                        rid = uuid.uuid4().hex
                        kw = dict(chunk_hashes=hashes) if with_hashes else {}
                        t0 = time.perf_counter()
                        assert client.lookup(prompt, rid, **kw, **scope) == n
                        times.append(time.perf_counter() - t0)
                        client.clear_lookup_status(rid)
                        engine.release_reservation(rid)  # what the load does, not timed
                    return median(times[1:])

                result.update(ipc_hashes_ms=round_trips(True, args.repeats) * 1e3,
                              ipc_token_ids_ms=round_trips(False, max(3, args.repeats // 3)) * 1e3)
            finally:
                client.close()
                server.close()
    finally:
        engine.close()

    print(f"{result['device']}  {n} tokens, {n_chunks} chunks of {chunk}, chunked prefill in steps of {args.step}")
    print("scheduler (hashes the token chain once per request):")
    print(f"  prompt's chain at its first lookup     {result['prompt_hash_ms']:8.2f} ms")
    print(f"  chunked prefill, incremental          {result['prefill_incremental_ms']:8.2f} ms "
          f"({result['incremental_us_per_chunk']:.2f} us per new chunk)")
    print(f"  chunked prefill, re-hash from token 0 {result['prefill_rehash_from_0_ms']:8.2f} ms (the old rule: "
          f"every step's ids from 0, hashed again)")
    print("worker lookup of the whole prompt (all chunks stored):")
    print(f"  from its chunk hashes                 {result['lookup_hashes_ms']:8.3f} ms")
    print(f"  from its chunk hashes, reserved       {result['lookup_hashes_reserved_ms']:8.3f} ms (the lookup server; "
          f"the load's release of the holds: {result['release_reservation_ms']:.3f} ms)")
    print(f"  from its token ids (list)             {result['lookup_token_ids_ms']:8.3f} ms (the plain API: "
          f"the chain hashed from token 0)")
    print(f"  from its token ids (tensor)           {result['lookup_token_tensor_ms']:8.3f} ms")
    if "ipc_hashes_ms" in result:
        print("scheduler -> worker lookup round trip (IPC):")
        print(f"  chunk hashes ({16 * len(hashes.hashes)} bytes)           {result['ipc_hashes_ms']:8.3f} ms")
        print(f"  token ids ({8 * n} bytes)              {result['ipc_token_ids_ms']:8.3f} ms")
    print(f"  wrote {write_json('lookup', result)}")
    return result


if __name__ == "__main__":
    main()
