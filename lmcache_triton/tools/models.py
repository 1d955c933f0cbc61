"""Small Llama (and Mistral) models built locally (no downloads), for the demo, the tests and the benches.

- `build_random_llama`: random weights and a word-level tokenizer; for speed and byte-exactness checks.
- `build_random_mistral`: the same with sliding-window attention in every layer.
- `train_llama`: a small Llama trained here on CPU (a few minutes) on the Python standard library's
  sources and docstrings, with a byte-level BPE tokenizer trained on the same text; for quality
  measurements (CacheBlend's), where random weights mean little.

Both are cached under `CACHE_DIR` (`$LMCACHE_TRITON_CACHE`, default ~/.cache/lmcache_triton), in a
folder keyed by what built them, so a change of recipe builds a new model.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import sys
import sysconfig
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

CACHE_DIR = Path(os.environ.get("LMCACHE_TRITON_CACHE", Path.home() / ".cache" / "lmcache_triton"))


@dataclass(frozen=True)
class TinyLlamaSpec:
    hidden_size: int = 128
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 32          # vLLM's CPU backend supports 32, 64, 80, 96, 112, 128, ...
    intermediate_size: int = 256
    vocab_size: int = 1024
    max_position_embeddings: int = 16384
    seed: int = 0


def build_random_llama(path: str | Path, spec: TinyLlamaSpec = TinyLlamaSpec()) -> Path:
    """Writes a bf16 Llama with random weights and a word-level tokenizer ("w4 w5 ...") to `path`,
    once: a folder holding the same spec is reused."""
    return _build_random(path, spec, "llama")


def build_random_mistral(path: str | Path, sliding_window: int, spec: TinyLlamaSpec = TinyLlamaSpec()) -> Path:
    """`build_random_llama`'s model as a Mistral whose every layer attends to its last
    `sliding_window` tokens only (Mistral-7B-v0.1's shape; vLLM gives it a SlidingWindowSpec)."""
    return _build_random(path, spec, "mistral", sliding_window=sliding_window)


def _build_random(path: str | Path, spec: TinyLlamaSpec, arch: str, **extra: int) -> Path:
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, PreTrainedTokenizerFast

    path = Path(path)
    marker = path / "lmcache_triton_spec.json"
    recipe = asdict(spec) | ({"arch": arch, **extra} if arch != "llama" else {})
    if marker.exists() and json.loads(marker.read_text()) == recipe:
        return path
    path.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(spec.seed)
    config_cls, model_cls = (LlamaConfig, LlamaForCausalLM) if arch == "llama" else (MistralConfig, MistralForCausalLM)
    config = config_cls(
        vocab_size=spec.vocab_size, hidden_size=spec.hidden_size, intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers, num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads, head_dim=spec.head_dim,
        max_position_embeddings=spec.max_position_embeddings, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2,
        pad_token_id=0, tie_word_embeddings=False, torch_dtype="bfloat16", **extra)
    model_cls(config).to(torch.bfloat16).save_pretrained(path, safe_serialization=True)
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3} | {f"w{i}": i for i in range(4, spec.vocab_size)}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                            pad_token="<pad>").save_pretrained(path)
    marker.write_text(json.dumps(recipe))
    return path


def random_prompt(num_tokens: int, seed: int, vocab_size: int = 1024) -> list[int]:
    """Token ids of a prompt (ids >= 4: no special tokens)."""
    import random

    rng = random.Random(seed)
    return [rng.randrange(4, vocab_size) for _ in range(num_tokens)]


# ---------------------------------------------------------------------------------------------
# A trained model: the standard library as corpus

TRAIN_CODE_VERSION = 1  # bump when train_llama's procedure changes: the cache key changes with it
SPECIAL_TOKENS = ("<pad>", "<s>", "</s>")  # ids 0, 1, 2 as in the random models


@dataclass(frozen=True)
class TrainRecipe:
    """Everything that decides the trained model (all of it is in the cache key, with the corpus digest)."""

    hidden_size: int = 256
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 64
    intermediate_size: int = 512
    vocab_size: int = 2048      # byte-level BPE trained on the training files
    context: int = 512          # training sequence length, and max_position_embeddings
    batch_size: int = 4
    steps: int = 600
    lr: float = 3e-3
    warmup_steps: int = 30
    min_lr_ratio: float = 0.1   # cosine decay to lr * min_lr_ratio
    weight_decay: float = 0.1
    corpus_max_bytes: int = 0   # 0: every stdlib *.py file; else the first files (sorted) up to this size
    heldout_every: int = 10     # file i (sorted by name) is held out when i % heldout_every == heldout_every - 1
    seed: int = 0


# The recipe at toy scale (5 steps on a slice of the stdlib, seconds): for tests of the recipe and of
# what consumes its output (vLLM loads it; bench.blend --trained runs on it). Not a useful model.
SMOKE_RECIPE = TrainRecipe(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                           head_dim=32, intermediate_size=128, vocab_size=512, context=128, batch_size=2, steps=5,
                           warmup_steps=2, corpus_max_bytes=400_000, heldout_every=4)


@dataclass
class Corpus:
    train: list[tuple[str, str]] = field(default_factory=list)    # (file name, text)
    heldout: list[tuple[str, str]] = field(default_factory=list)  # never trained on (nor the tokenizer)
    digest: str = ""


def stdlib_corpus(recipe: TrainRecipe = TrainRecipe(), stdlib: str | Path | None = None) -> Corpus:
    """The running Python's standard library (top-level *.py: sources and docstrings), split by file."""
    root = Path(stdlib or sysconfig.get_paths()["stdlib"])
    files = sorted(root.glob("*.py"))
    if not files:
        raise FileNotFoundError(f"no *.py files in {root}: the standard library's sources are needed to train")
    corpus, total, h = Corpus(), 0, hashlib.sha256()
    for i, f in enumerate(files):
        text = f.read_text(encoding="utf-8", errors="replace")
        if recipe.corpus_max_bytes and total + len(text) > recipe.corpus_max_bytes and corpus.train:
            break
        total += len(text)
        h.update(f.name.encode() + b"\0" + text.encode() + b"\0")
        held = recipe.heldout_every > 0 and i % recipe.heldout_every == recipe.heldout_every - 1
        (corpus.heldout if held else corpus.train).append((f.name, text))
    corpus.digest = h.hexdigest()
    return corpus


def trained_model_dir(recipe: TrainRecipe = TrainRecipe(), corpus: Corpus | None = None,
                      root: str | Path | None = None) -> Path:
    """Where `train_llama(recipe)` keeps its model: keyed by the recipe, the corpus and the procedure."""
    corpus = corpus or stdlib_corpus(recipe)
    key = hashlib.sha256(json.dumps({"recipe": asdict(recipe), "corpus": corpus.digest,
                                     "version": TRAIN_CODE_VERSION}, sort_keys=True).encode()).hexdigest()[:12]
    return Path(root or CACHE_DIR) / "models" / f"stdlib-llama-{key}"


def trained_model_info(path: str | Path) -> dict | None:
    """The training record a trained model folder holds (recipe, loss curve, held-out files), or None."""
    marker = Path(path) / "lmcache_triton_trained.json"
    return json.loads(marker.read_text()) if marker.exists() else None


def _train_tokenizer(texts: list[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")


def train_llama(recipe: TrainRecipe = TrainRecipe(), root: str | Path | None = None, *,
                log: Callable[[str], None] | None = None, stdlib: str | Path | None = None) -> Path:
    """Trains (once) a small LlamaForCausalLM on the standard library's sources and returns its folder.

    A standard transformers folder (safetensors, config, tokenizer files) that vLLM loads. Training
    is fp32 on the CPU threads torch has, AdamW with warmup and cosine decay, random windows of
    `context` tokens from the training files (EOS between files), seeded. The folder also holds
    `lmcache_triton_trained.json`: the recipe, the loss curve, the held-out loss, the time taken and
    the held-out file names (what `bench.blend --trained` draws its documents from).
    """
    import torch

    # Training needs autograd whatever mode the caller runs in (`bench.blend --trained` runs under
    # inference_mode: a fresh machine's first run failed in backward()).
    with torch.inference_mode(False), torch.enable_grad():
        return _train_llama(recipe, root, log=log, stdlib=stdlib)


def _train_llama(recipe: TrainRecipe, root: str | Path | None, *, log: Callable[[str], None] | None,
                 stdlib: str | Path | None) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    corpus = stdlib_corpus(recipe, stdlib)
    path = trained_model_dir(recipe, corpus, root)
    if trained_model_info(path) is not None:
        return path
    t0 = time.perf_counter()
    tokenizer = _train_tokenizer([t for _, t in corpus.train], recipe.vocab_size)
    eos = tokenizer.eos_token_id

    def stream(files: list[tuple[str, str]]) -> torch.Tensor:
        ids: list[int] = []
        for _, text in files:
            ids += tokenizer(text, add_special_tokens=False)["input_ids"] + [eos]
        return torch.tensor(ids, dtype=torch.int64)

    train_ids, heldout_ids = stream(corpus.train), stream(corpus.heldout)
    if len(train_ids) <= recipe.context + 1:
        raise ValueError(f"the training corpus has {len(train_ids)} tokens, fewer than one window of {recipe.context}")
    tokenizer_s = time.perf_counter() - t0
    torch.manual_seed(recipe.seed)
    gen = torch.Generator().manual_seed(recipe.seed)
    config = LlamaConfig(
        vocab_size=recipe.vocab_size, hidden_size=recipe.hidden_size, intermediate_size=recipe.intermediate_size,
        num_hidden_layers=recipe.num_hidden_layers, num_attention_heads=recipe.num_attention_heads,
        num_key_value_heads=recipe.num_key_value_heads, head_dim=recipe.head_dim,
        max_position_embeddings=recipe.context, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, pad_token_id=0,
        tie_word_embeddings=True, torch_dtype="float32")
    model = LlamaForCausalLM(config)
    model.train()
    n_params = sum(p.numel() for p in model.parameters())
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": recipe.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=recipe.lr, betas=(0.9, 0.95))

    def lr_at(step: int) -> float:
        if step < recipe.warmup_steps:
            return recipe.lr * (step + 1) / recipe.warmup_steps
        t = (step - recipe.warmup_steps) / max(1, recipe.steps - recipe.warmup_steps)
        return recipe.lr * (recipe.min_lr_ratio + (1 - recipe.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * t)))

    def batch(ids: torch.Tensor, n: int, g: torch.Generator) -> torch.Tensor:
        starts = torch.randint(0, len(ids) - recipe.context - 1, (n,), generator=g)
        return torch.stack([ids[s:s + recipe.context] for s in starts.tolist()])

    log(f"training a {recipe.num_hidden_layers}-layer Llama (hidden {recipe.hidden_size}, {n_params / 1e6:.1f} M "
        f"parameters) on {len(train_ids)} tokens of the standard library, {recipe.steps} steps of "
        f"{recipe.batch_size} x {recipe.context} tokens, on {torch.get_num_threads()} threads -> {path}")
    curve: list[tuple[int, float]] = []
    window, t_train = [], time.perf_counter()
    for step in range(recipe.steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step)
        x = batch(train_ids, recipe.batch_size, gen)
        loss = model(input_ids=x, labels=x).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        window.append(loss.item())
        if (step + 1) % 10 == 0 or step == 0 or step + 1 == recipe.steps:
            curve.append((step + 1, sum(window) / len(window)))
            window = []
        if (step + 1) % 25 == 0 or step + 1 == recipe.steps:
            log(f"  step {step + 1}/{recipe.steps}  loss {curve[-1][1]:.3f}  ({time.perf_counter() - t_train:.0f} s)")
    train_s = time.perf_counter() - t_train
    model.eval()
    heldout_loss = None
    if len(heldout_ids) > recipe.context + 1:
        with torch.no_grad():
            g = torch.Generator().manual_seed(recipe.seed + 1)
            losses = [model(input_ids=(x := batch(heldout_ids, 1, g)), labels=x).loss.item() for _ in range(8)]
        heldout_loss = sum(losses) / len(losses)
    tmp = path.with_name(path.name + f".tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    info = {"recipe": asdict(recipe), "corpus_digest": corpus.digest, "version": TRAIN_CODE_VERSION,
            "python": sys.version.split()[0], "stdlib": str(stdlib or sysconfig.get_paths()["stdlib"]),
            "train_files": len(corpus.train), "train_tokens": len(train_ids), "heldout_files": [n for n, _ in corpus.heldout],
            "heldout_tokens": len(heldout_ids), "parameters": n_params, "threads": torch.get_num_threads(),
            "tokenizer_s": tokenizer_s, "train_s": train_s, "loss_curve": curve, "heldout_loss": heldout_loss,
            "torch": torch.__version__}
    (tmp / "lmcache_triton_trained.json").write_text(json.dumps(info, indent=1))
    shutil.rmtree(path, ignore_errors=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    os.replace(tmp, path)
    log(f"trained in {train_s:.0f} s (+{tokenizer_s:.0f} s tokenizer): loss {curve[0][1]:.2f} -> {curve[-1][1]:.2f}, "
        f"held-out {heldout_loss if heldout_loss is None else round(heldout_loss, 2)}")
    return path


def main(argv: list[str] | None = None) -> int:
    """`python -m lmcache_triton.tools.models train [--steps N]`: trains (or finds) the stdlib model, prints its folder."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m lmcache_triton.tools.models", description=main.__doc__)
    p.add_argument("command", choices=["train"])
    p.add_argument("--steps", type=int, default=TrainRecipe.steps)
    p.add_argument("--root", help=f"cache folder (default {CACHE_DIR})")
    args = p.parse_args(argv)
    path = train_llama(TrainRecipe(steps=args.steps), args.root)
    info = trained_model_info(path)
    print(path)
    print(json.dumps({k: info[k] for k in ("train_s", "heldout_loss", "train_tokens", "parameters")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
