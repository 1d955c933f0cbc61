"""CacheBlend prefill vs full prefill on a small random Llama, on this machine.

    python -m bench.blend [--doc-tokens 2048] [--docs 3] [--layers 4] [--ratio 0.15] [--repeats 3]
    python -m bench.blend --trained [...]   # quality vs ratio on a trained model: see bench/blend_quality.py

The prompt is `docs` documents of `doc-tokens` tokens joined by a 2-token separator; each document's
KV is computed alone first (what a cache holds), then the prompt is prefilled three ways:
transformers' forward (the baseline), the blender at ratio 1.0 (full prefill through the same
layerwise code, to separate blending's gain from implementation differences) and the blender at
`ratio`. Reported: median seconds of each, speedup, and the last-token logits' deviation from the
full prefill (max abs error, relative L2, top-1 agreement), plus pure reuse (ratio 0) for scale.
Kernel bandwidths are in bench.kernels, not here.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench.common import context, median, write_json
from lmcache_triton.blend import LMCBlender, TensorKVSource, segment_positions
from lmcache_triton.config import LMCacheEngineConfig
from lmcache_triton.tools.models import TinyLlamaSpec, build_random_llama, random_prompt

SEP = [4, 5]


def _kv_alone(model, tokens: list[int]) -> list[torch.Tensor]:
    out = model(torch.tensor([tokens]), use_cache=True)
    return [torch.stack([lay.keys[0].transpose(0, 1).flatten(1), lay.values[0].transpose(0, 1).flatten(1)])
            for lay in out.past_key_values.layers]


def _timed(fn, repeats: int) -> tuple[float, object]:
    times, out = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return median(times), out


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--trained" in argv:  # quality (agreement, perplexity) vs ratio on the stdlib-trained Llama
        from bench.blend_quality import main as quality_main

        return quality_main([a for a in argv if a != "--trained"])
    return speed(argv)


@torch.inference_mode()
def speed(argv: list[str]) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trained", action="store_true",
                   help="quality vs recompute ratio on a Llama trained here (python -m bench.blend --trained --help)")
    p.add_argument("--doc-tokens", type=int, default=2048)
    p.add_argument("--docs", type=int, default=3)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--ratio", type=float, default=0.15)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)
    from transformers import LlamaForCausalLM

    spec = TinyLlamaSpec(hidden_size=512, num_hidden_layers=args.layers, num_attention_heads=8, num_key_value_heads=4,
                         head_dim=64, intermediate_size=1408, vocab_size=4096, seed=0)
    path = build_random_llama(Path(tempfile.gettempdir()) / f"lmcache_triton_bench_blend_{args.layers}l", spec)
    model = LlamaForCausalLM.from_pretrained(path, dtype=torch.float32).eval()

    docs = [[t if t > 5 else 6 for t in random_prompt(args.doc_tokens, seed=100 + i, vocab_size=spec.vocab_size)]
            for i in range(args.docs)]
    tokens, ranges = [], []
    for i, d in enumerate(docs):
        tokens += SEP if i else []
        ranges.append((len(tokens), len(tokens) + len(d)))
        tokens += d
    T = len(tokens)
    kv_dim = spec.num_key_value_heads * spec.head_dim
    cached = [torch.zeros(2, T, kv_dim) for _ in range(spec.num_hidden_layers)]
    for d, (s, e) in zip(docs, ranges):
        for layer, kv in enumerate(_kv_alone(model, d)):
            cached[layer][:, s:e] = kv
    mask, positions = segment_positions(T, ranges)

    def blender(ratio: float) -> LMCBlender:
        cfg = LMCacheEngineConfig.from_defaults(blend_recompute_ratios=[ratio], blend_check_layers=[1])
        return LMCBlender(model, cfg)

    def run_blend(ratio: float, repeats: int):
        b = blender(ratio)
        sources = [TensorKVSource(cached) for _ in range(repeats)]  # the copy is the cache's, not timed
        it = iter(sources)
        return _timed(lambda: b.blend(tokens, next(it), cached_mask=mask, cached_positions=positions,
                                      keep_kv=False), repeats)

    ids = torch.tensor([tokens])
    model(ids[:, :256])  # warm-up: first calls allocate
    full_s, full_out = _timed(lambda: model(ids).logits[0, -1], args.repeats)
    layerwise_full_s, _ = run_blend(1.0, 1)
    blend_s, res = run_blend(args.ratio, args.repeats)
    _, reuse = run_blend(0.0, 1)

    def deviation(logits: torch.Tensor) -> dict:
        d = logits - full_out
        return {"max_abs_err": d.abs().max().item(), "rel_l2_err": (d.norm() / full_out.norm()).item(),
                "top1_agrees": bool(logits.argmax() == full_out.argmax())}

    result = {
        **context(), "tokens": T, "docs": args.docs, "doc_tokens": args.doc_tokens, "layers": args.layers,
        "hidden": spec.hidden_size, "ratio": args.ratio, "recomputed_tokens": len(res.recompute_indices),
        "full_prefill_hf_s": full_s, "full_prefill_layerwise_s": layerwise_full_s, "blend_s": blend_s,
        "speedup_vs_hf": full_s / blend_s, "speedup_vs_layerwise": layerwise_full_s / blend_s,
        "blend": deviation(res.logits), "pure_reuse": deviation(reuse.logits),
    }
    print(f"{T} tokens ({args.docs} x {args.doc_tokens}), {args.layers} layers, hidden {spec.hidden_size}, "
          f"{result['device']}")
    print(f"full prefill (transformers)  {full_s * 1e3:9.1f} ms")
    print(f"full prefill (layerwise)     {layerwise_full_s * 1e3:9.1f} ms")
    print(f"blend ratio {args.ratio:<5}          {blend_s * 1e3:9.1f} ms   speedup {result['speedup_vs_hf']:.2f}x "
          f"(vs layerwise {result['speedup_vs_layerwise']:.2f}x), {result['recomputed_tokens']} tokens recomputed")
    for name in ("blend", "pure_reuse"):
        r = result[name]
        print(f"{name:12s} last-token logits: max abs err {r['max_abs_err']:.3e}  rel L2 {r['rel_l2_err']:.3e}  "
              f"top-1 agrees {r['top1_agrees']}")
    print(f"wrote {write_json('blend', result)}")
    return result


if __name__ == "__main__":
    main()
