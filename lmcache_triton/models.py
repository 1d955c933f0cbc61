"""Small random-weight Llama models built locally (no downloads): for the demo, the tests and the bench."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path


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
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    path = Path(path)
    marker = path / "lmcache_triton_spec.json"
    if marker.exists() and json.loads(marker.read_text()) == asdict(spec):
        return path
    path.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(spec.seed)
    config = LlamaConfig(
        vocab_size=spec.vocab_size, hidden_size=spec.hidden_size, intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers, num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads, head_dim=spec.head_dim,
        max_position_embeddings=spec.max_position_embeddings, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2,
        pad_token_id=0, tie_word_embeddings=False, torch_dtype="bfloat16")
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(path, safe_serialization=True)
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3} | {f"w{i}": i for i in range(4, spec.vocab_size)}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                            pad_token="<pad>").save_pretrained(path)
    marker.write_text(json.dumps(asdict(spec)))
    return path


def random_prompt(num_tokens: int, seed: int, vocab_size: int = 1024) -> list[int]:
    """Token ids of a prompt (ids >= 4: no special tokens)."""
    import random

    rng = random.Random(seed)
    return [rng.randrange(4, vocab_size) for _ in range(num_tokens)]
