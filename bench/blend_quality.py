"""CacheBlend's quality against a full prefill, on a small Llama trained here (not random weights).

    python -m bench.blend --trained [--ratios 0,0.05,0.15,0.3,0.5,1] [--trials 32] [--docs 3]
                                    [--doc-tokens 128] [--plot [PNG]] [--model DIR]

The model is `lmcache_triton.tools.models.train_llama`'s (4 layers, hidden 256, trained a few minutes on
the standard library's sources; trained on first use, then cached). Each trial draws `docs`
passages of `doc-tokens` tokens from standard-library files the model never saw (held out), caches
each passage's KV alone (from position 0, as a cache holds it), and builds a prompt with them in
another order, joined by the blend separator. Two suffixes follow the documents:

- recall: separator + a `question-tokens` quote from the *first* document of the prompt, then the
  `continuation-tokens` that follow the quote in that document (the answer is in the documents);
- continue: the `continuation-tokens` that follow the *last* document in its file (held-out text).

For each recompute ratio the documents' KV is blended (the blender, check layer `--check-layer`),
then the suffix is run on top of that KV (the same layerwise code), and compared with a full
prefill of documents + suffix by transformers:

- top-1 agreement: share of suffix positions (question and continuation) where the blended and the
  full prefill's next-token argmax agree;
- perplexity of the continuation under the blended KV and under the full prefill's (and with no
  documents at all, for scale); KL(full || blended) per position;
- time: the blend of the documents' prompt per ratio vs transformers' full prefill of it.
Ratio 1.0 recomputes every token at every layer: it must equal the full prefill (a check).
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from bench.common import context, write_json
from lmcache_triton.blend import LMCBlender, TensorKVSource, as_layerwise, segment_positions, separator_ids
from lmcache_triton.config import LMCacheEngineConfig
from lmcache_triton.tools.models import TrainRecipe, stdlib_corpus, train_llama, trained_model_info

DEFAULT_RATIOS = "0,0.05,0.15,0.3,0.5,1.0"


def _kv_alone(model, tokens: list[int]) -> list[torch.Tensor]:
    out = model(torch.tensor([tokens]), use_cache=True, logits_to_keep=1)
    return [torch.stack([lay.keys[0].transpose(0, 1).flatten(1), lay.values[0].transpose(0, 1).flatten(1)])
            for lay in out.past_key_values.layers]


def continue_on_kv(lw, kv: list[torch.Tensor], tokens: list[int]) -> torch.Tensor:
    """Logits [n, vocab] of `tokens` run on top of a prompt's KV (per layer [2, T, kv_hidden]),
    through the same layerwise model the blender drives."""
    T = kv[0].shape[1]
    ids = torch.tensor(tokens, dtype=torch.int64)
    rows = torch.arange(T, T + len(tokens))
    hidden = lw.embed(ids)
    for layer in range(lw.num_layers):
        q, k, v = lw.qkv(layer, hidden, rows)
        K = torch.cat([kv[layer][0].view(T, lw.num_kv_heads, lw.head_size), k.to(kv[layer].dtype)])
        V = torch.cat([kv[layer][1].view(T, lw.num_kv_heads, lw.head_size), v.to(kv[layer].dtype)])
        hidden = lw.finish_layer(layer, lw.attention(layer, q, K.to(q.dtype), V.to(q.dtype), rows), hidden)
    return lw.logits(hidden)[1]


def _trials(args, tokenizer, heldout: list[tuple[str, str]], sep: list[int]) -> list[dict]:
    need = args.doc_tokens + max(args.continuation_tokens, 1)
    files = []
    for name, text in heldout:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(ids) >= need:
            files.append((name, ids))
    if len(files) < args.docs:
        raise SystemExit(f"only {len(files)} held-out files have {need} tokens; use fewer --docs or --doc-tokens")
    if args.doc_tokens < args.question_tokens + args.continuation_tokens:
        raise SystemExit("--doc-tokens must hold --question-tokens + --continuation-tokens (the recall quote)")
    out = []
    for t in range(args.trials):
        rng = random.Random(args.seed * 1000 + t)
        picked = rng.sample(files, args.docs)
        docs, follows, names = [], [], []
        for name, ids in picked:
            s = rng.randrange(0, len(ids) - need + 1)
            docs.append(ids[s:s + args.doc_tokens])
            follows.append(ids[s + args.doc_tokens:s + args.doc_tokens + args.continuation_tokens])
            names.append(name)
        order = list(range(args.docs))
        while args.docs > 1 and order == sorted(order):  # another order than the one they were cached in
            rng.shuffle(order)
        prefix, ranges = [], []
        for i, d in enumerate(order):
            prefix += sep if i else []
            ranges.append((len(prefix), len(prefix) + len(docs[d])))
            prefix += docs[d]
        first = docs[order[0]]
        o = rng.randrange(0, len(first) - args.question_tokens - args.continuation_tokens + 1)
        quote = first[o:o + args.question_tokens]
        answer = first[o + args.question_tokens:o + args.question_tokens + args.continuation_tokens]
        tasks = {
            # suffix tokens; from which suffix index predictions count (agreement); how many at the end are scored (ppl)
            "recall": (sep + quote + answer, len(sep), len(answer)),
            "continue": (follows[order[-1]], 0, len(follows[order[-1]])),
        }
        out.append({"docs": docs, "names": [names[d] for d in order], "prefix": prefix, "ranges": ranges,
                    "tasks": tasks})
    return out


def _score(logits: torch.Tensor, ref: torch.Tensor, suffix: list[int], agree_from: int, scored: int) -> dict:
    """logits/ref [len(suffix), vocab], row i predicting suffix[i]."""
    target = torch.tensor(suffix)
    lp, lq = F.log_softmax(ref.float(), -1), F.log_softmax(logits.float(), -1)
    a = slice(agree_from, len(suffix))
    s = slice(len(suffix) - scored, len(suffix))
    return {"agree": (logits[a].argmax(-1) == ref[a].argmax(-1)).tolist(),
            "nll": F.nll_loss(lq[s], target[s], reduction="none").tolist(),
            "kl": (lp[a].exp() * (lp[a] - lq[a])).sum(-1).tolist()}


def _timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


@torch.inference_mode()
def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(prog="python -m bench.blend --trained", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="a folder train_llama wrote (default: the default recipe's, trained if missing)")
    p.add_argument("--ratios", default=DEFAULT_RATIOS, help=f"comma-separated recompute ratios ({DEFAULT_RATIOS})")
    p.add_argument("--trials", type=int, default=32)
    p.add_argument("--docs", type=int, default=3)
    p.add_argument("--doc-tokens", type=int, default=128)
    p.add_argument("--question-tokens", type=int, default=16)
    p.add_argument("--continuation-tokens", type=int, default=48)
    p.add_argument("--check-layer", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--plot", nargs="?", const="", default=None, metavar="PNG",
                   help="draw quality and time vs ratio (default: beside the JSON result)")
    args = p.parse_args(argv)
    ratios = [float(r) for r in args.ratios.split(",")]
    if args.plot is not None:
        from bench.common import pyplot

        pyplot()  # matplotlib missing: fail before the run
    from transformers import AutoTokenizer, LlamaForCausalLM

    path = Path(args.model) if args.model else train_llama()
    info = trained_model_info(path)
    if info is None:
        raise SystemExit(f"{path} has no lmcache_triton_trained.json: pass a folder train_llama wrote")
    recipe = TrainRecipe(**info["recipe"])
    heldout_names = set(info["heldout_files"])
    heldout = [(n, t) for n, t in stdlib_corpus(recipe, info.get("stdlib")).heldout if n in heldout_names]
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = LlamaForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    lw = as_layerwise(model)
    cfg0 = LMCacheEngineConfig.from_defaults()
    sep = separator_ids(cfg0.blend_special_str, tokenizer)
    trials = _trials(args, tokenizer, heldout, sep)
    prompt_tokens = len(trials[0]["prefix"])
    if prompt_tokens + len(sep) + args.question_tokens + args.continuation_tokens > recipe.context:
        print(f"note: prompts of {prompt_tokens}+ tokens exceed the {recipe.context} tokens the model was trained on")

    blenders = {r: LMCBlender(model, LMCacheEngineConfig.from_defaults(
        blend_recompute_ratios=[r], blend_check_layers=[args.check_layer])) for r in ratios}
    model(torch.tensor([trials[0]["prefix"]]), logits_to_keep=1)  # warm-up: first calls allocate
    stats = {r: {"s": [], "rows": [], **{task: {"agree": [], "nll": [], "kl": []} for task in ("recall", "continue")}}
             for r in ratios}
    full = {"s": [], **{task: {"agree": [], "nll": [], "kl": []} for task in ("recall", "continue")}}
    nodocs = {task: [] for task in ("recall", "continue")}
    for trial in trials:
        prefix, T = trial["prefix"], len(trial["prefix"])
        kv_dim = lw.num_kv_heads * lw.head_size
        cached = [torch.zeros(2, T, kv_dim) for _ in range(lw.num_layers)]
        for s, e in trial["ranges"]:  # each document alone, from position 0
            for layer, kv in enumerate(_kv_alone(model, prefix[s:e])):
                cached[layer][:, s:e] = kv
        mask, positions = segment_positions(T, trial["ranges"])
        secs, _ = _timed(lambda: model(torch.tensor([prefix]), use_cache=True, logits_to_keep=1))
        full["s"].append(secs)
        refs = {}
        for task, (suffix, agree_from, scored) in trial["tasks"].items():
            ref = model(torch.tensor([prefix + suffix])).logits[0, T - 1:T - 1 + len(suffix)]
            refs[task] = ref
            score = _score(ref, ref, suffix, agree_from, scored)
            for k in ("agree", "nll", "kl"):
                full[task][k] += score[k]
            alone = model(torch.tensor([sep + suffix])).logits[0, len(sep) - 1:len(sep) - 1 + len(suffix)]
            nodocs[task] += _score(alone, ref, suffix, agree_from, scored)["nll"]
        for r in ratios:
            source = TensorKVSource(cached)  # the copy is the cache's, not timed
            secs, res = _timed(lambda: blenders[r].blend(prefix, source, cached_mask=mask, cached_positions=positions))
            stats[r]["s"].append(secs)
            stats[r]["rows"].append(len(res.recompute_indices))
            for task, (suffix, agree_from, scored) in trial["tasks"].items():
                logits = torch.cat([res.logits[None], continue_on_kv(lw, res.kv, suffix[:-1])]) if len(suffix) > 1 \
                    else res.logits[None]
                score = _score(logits, refs[task], suffix, agree_from, scored)
                for k in ("agree", "nll", "kl"):
                    stats[r][task][k] += score[k]

    def summary(d: dict) -> dict:
        return {"top1_agreement": sum(d["agree"]) / len(d["agree"]), "perplexity": math.exp(statistics.mean(d["nll"])),
                "kl": statistics.mean(d["kl"]), "positions": len(d["agree"]), "scored_tokens": len(d["nll"])}

    full_s = statistics.median(full["s"])
    rows = []
    for r in ratios:
        blend_s = statistics.median(stats[r]["s"])
        rows.append({"ratio": r, "recomputed_tokens": statistics.mean(stats[r]["rows"]), "blend_s": blend_s,
                     "speedup_vs_full": full_s / blend_s,
                     **{task: summary(stats[r][task]) for task in ("recall", "continue")}})
    result = {
        **context(), "model": str(path), "recipe": info["recipe"], "train_s": info.get("train_s"),
        "heldout_loss": info.get("heldout_loss"), "trials": args.trials, "docs": args.docs,
        "doc_tokens": args.doc_tokens, "prompt_tokens": prompt_tokens, "question_tokens": args.question_tokens,
        "continuation_tokens": args.continuation_tokens, "check_layer": args.check_layer,
        "full_prefill_s": full_s, "full": {task: summary(full[task]) for task in ("recall", "continue")},
        "no_documents_perplexity": {task: math.exp(statistics.mean(v)) for task, v in nodocs.items()},
        "rows": rows,
    }
    rec = info["recipe"]
    print(f"CacheBlend vs full prefill on the trained stdlib Llama ({rec['num_hidden_layers']} layers, hidden "
          f"{rec['hidden_size']}, {rec['steps']} steps, held-out loss {info.get('heldout_loss') or float('nan'):.2f})")
    print(f"{args.trials} trials: {args.docs} held-out passages x {args.doc_tokens} tokens cached alone, used in another "
          f"order ({prompt_tokens} tokens); check layer {args.check_layer}; {result['device']}")
    print(f"full prefill (transformers) {full_s * 1e3:.1f} ms;  perplexity: recall {result['full']['recall']['perplexity']:.2f}"
          f", continue {result['full']['continue']['perplexity']:.2f};  with no documents: recall "
          f"{result['no_documents_perplexity']['recall']:.2f}, continue {result['no_documents_perplexity']['continue']:.2f}")
    print(f"{'ratio':>6} {'recomputed':>10} {'blend ms':>9} {'speedup':>7} | {'recall top-1':>12} {'ppl':>7} {'KL':>7} |"
          f" {'continue top-1':>14} {'ppl':>7} {'KL':>7}")
    for row in rows:
        rc, co = row["recall"], row["continue"]
        print(f"{row['ratio']:6.2f} {row['recomputed_tokens']:10.0f} {row['blend_s'] * 1e3:9.1f} "
              f"{row['speedup_vs_full']:6.2f}x | {rc['top1_agreement']:12.3f} {rc['perplexity']:7.2f} {rc['kl']:7.4f} |"
              f" {co['top1_agreement']:14.3f} {co['perplexity']:7.2f} {co['kl']:7.4f}")
    out = write_json("blend_quality", result)
    print(f"wrote {out}")
    result["json"] = str(out)
    if args.plot is not None:
        png = Path(args.plot) if args.plot else out.with_suffix(".png")
        print(f"wrote {plot(result, png)}")
        result["png"] = str(png)
    return result


def plot(result: dict, png: Path) -> Path:
    from bench.common import pyplot

    plt = pyplot()
    rows = result["rows"]
    xs = [r["ratio"] for r in rows]
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    colors = {"recall": "#1565c0", "continue": "#e65100"}
    for task, c in colors.items():
        axes[0].plot(xs, [r[task]["top1_agreement"] for r in rows], "o-", color=c, label=task)
        axes[1].plot(xs, [r[task]["perplexity"] for r in rows], "o-", color=c, label=f"{task}: blended")
        axes[1].axhline(result["full"][task]["perplexity"], color=c, ls="--", lw=1, label=f"{task}: full prefill")
        axes[1].axhline(result["no_documents_perplexity"][task], color=c, ls=":", lw=1,
                        label=f"{task}: no documents")
    axes[0].set_ylabel("top-1 agreement with full prefill")
    axes[0].set_ylim(min(0.9, min(r[t]["top1_agreement"] for r in rows for t in colors) - 0.02), 1.005)
    axes[1].set_ylabel("perplexity of the continuation")
    axes[2].plot(xs, [r["blend_s"] * 1e3 for r in rows], "o-", color="#2e7d32", label="blend (documents' prompt)")
    axes[2].axhline(result["full_prefill_s"] * 1e3, color="#616161", ls="--", lw=1, label="full prefill (transformers)")
    axes[2].set_ylabel("ms")
    axes[2].set_ylim(bottom=0)
    for ax in axes:
        ax.set_xlabel("recompute ratio")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    rec = result["recipe"]
    fig.suptitle(f"CacheBlend vs full prefill: {result['trials']} trials of {result['docs']} x {result['doc_tokens']}-token "
                 f"held-out passages, reordered; Llama {rec['num_hidden_layers']} layers x {rec['hidden_size']} trained "
                 f"on the Python stdlib; {result['device']}", fontsize=9)
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return png


if __name__ == "__main__":
    main()
