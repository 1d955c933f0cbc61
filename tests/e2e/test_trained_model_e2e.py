"""The trained model's folder (train_llama's output, at toy scale) is one vLLM serves."""

import pytest

from lmcache_triton.tools.models import SMOKE_RECIPE, train_llama


@pytest.fixture(scope="module")
def run_vllm(run_vllm_in_process):
    """Engine core in process: half the start time (see run_vllm_in_process)."""
    return run_vllm_in_process


def test_trained_model_loads_in_vllm(run_vllm, tmp_path):
    from transformers import AutoTokenizer

    path = train_llama(SMOKE_RECIPE, tmp_path / "cache", log=lambda msg: None)
    ids = AutoTokenizer.from_pretrained(path)("def main():\n    ", add_special_tokens=False)["input_ids"]
    r = run_vllm(tmp_path, {"model": str(path), "connector": None, "max_model_len": SMOKE_RECIPE.context,
                            "steps": [{"prompt": ids, "max_tokens": 8}]})
    tokens = r["steps"][0]["tokens"]
    assert len(tokens) == 8 and all(0 <= t < SMOKE_RECIPE.vocab_size for t in tokens)
