"""The trained model's recipe (`lmcache_triton.tools.models.train_llama`) at toy scale: 5 steps on a slice
of the standard library (seconds; the real recipe's few minutes of training never run in the suite).
Checks that the recipe runs, that its output is a standard transformers folder with a working
tokenizer, that the cache is keyed by the recipe, and that `bench.blend --trained` runs on it
(ratio 1.0 must equal the full prefill)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import asdict, replace
from pathlib import Path

import pytest
import torch

from lmcache_triton.tools.models import SMOKE_RECIPE, stdlib_corpus, train_llama, trained_model_dir, trained_model_info

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def smoke_model(tmp_path_factory) -> Path:
    return train_llama(SMOKE_RECIPE, tmp_path_factory.mktemp("cache"), log=lambda msg: None)


def test_recipe_trains_a_model_transformers_loads(smoke_model):
    from transformers import AutoTokenizer, LlamaForCausalLM

    info = trained_model_info(smoke_model)
    assert info["recipe"] == asdict(SMOKE_RECIPE)
    assert [s for s, _ in info["loss_curve"]] == [1, 5] and all(loss > 0 for _, loss in info["loss_curve"])
    corpus = stdlib_corpus(SMOKE_RECIPE)
    assert info["heldout_files"] == [n for n, _ in corpus.heldout] and info["heldout_files"]
    assert not set(info["heldout_files"]) & {n for n, _ in corpus.train}, "held-out files are never trained on"
    tok = AutoTokenizer.from_pretrained(smoke_model)
    model = LlamaForCausalLM.from_pretrained(smoke_model, dtype=torch.float32).eval()
    text = 'def f(x):\n    """Return x plus one."""\n    return x + 1\n'
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == text, "byte-level BPE round-trips any text"
    assert max(ids) < model.config.vocab_size and (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (1, 2, 0)
    assert model.config.max_position_embeddings == SMOKE_RECIPE.context
    with torch.no_grad():
        assert model(torch.tensor([ids])).logits.shape == (1, len(ids), model.config.vocab_size)


def test_cache_is_keyed_by_the_recipe(smoke_model):
    root = smoke_model.parent.parent
    marker = smoke_model / "lmcache_triton_trained.json"
    before = marker.stat().st_mtime_ns
    assert train_llama(SMOKE_RECIPE, root, log=lambda msg: None) == smoke_model
    assert marker.stat().st_mtime_ns == before, "a cached model is not retrained"
    assert trained_model_dir(SMOKE_RECIPE, root=root) == smoke_model
    assert trained_model_dir(replace(SMOKE_RECIPE, steps=6), root=root) != smoke_model
    assert trained_model_dir(replace(SMOKE_RECIPE, seed=1), root=root) != smoke_model


def test_bench_blend_quality_runs_on_a_trained_model(smoke_model):
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)  # what a CPU host runs: the torch path
    r = subprocess.run([sys.executable, "-m", "bench.blend", "--trained", "--model", str(smoke_model), "--trials", "2",
                        "--docs", "2", "--doc-tokens", "40", "--question-tokens", "4", "--continuation-tokens", "8",
                        "--ratios", "0,0.3,1"], capture_output=True, text=True, timeout=300, cwd=REPO, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    out = Path(re.findall(r"wrote (\S+)", r.stdout)[0])
    try:
        data = json.loads(out.read_text())
    finally:
        out.unlink(missing_ok=True)
    rows = {row["ratio"]: row for row in data["rows"]}
    assert set(rows) == {0.0, 0.3, 1.0} and data["prompt_tokens"] > 80
    for task in ("recall", "continue"):
        full, one = data["full"][task], rows[1.0][task]
        assert one["top1_agreement"] == 1.0, f"{task}: ratio 1.0 is a full prefill"
        assert one["perplexity"] == pytest.approx(full["perplexity"], rel=1e-3)
        assert one["kl"] < 1e-4
        assert rows[0.0][task]["positions"] == full["positions"] > 0
    assert rows[0.0]["recomputed_tokens"] < rows[1.0]["recomputed_tokens"] == data["prompt_tokens"]


def test_trains_under_a_callers_inference_mode(tmp_path):
    """`bench.blend --trained` asks for the model inside inference_mode: training must still have
    autograd (a fresh machine's first run failed in backward())."""
    with torch.inference_mode():
        path = train_llama(SMOKE_RECIPE, tmp_path, log=lambda msg: None)
    assert trained_model_info(path)["loss_curve"], "trained"


def test_random_mistral_attends_to_its_window_and_is_kept_apart_from_the_llama(tmp_path):
    """A sliding-window Mistral transformers loads, whose window changes the logits of a prompt
    longer than it; the folder's marker names the architecture and window, so the same folder
    rebuilds for another window and never passes for the Llama."""
    from transformers import MistralForCausalLM

    from lmcache_triton.tools.models import TinyLlamaSpec, build_random_llama, build_random_mistral

    spec = TinyLlamaSpec(num_hidden_layers=1)
    path = build_random_mistral(tmp_path / "m", sliding_window=8, spec=spec)
    model = MistralForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    assert model.config.sliding_window == 8
    ids = torch.arange(4, 36).unsqueeze(0)
    full = MistralForCausalLM.from_pretrained(path, dtype=torch.float32, sliding_window=None).eval()
    with torch.no_grad():
        assert not torch.allclose(model(ids).logits[0, -1], full(ids).logits[0, -1]), "the window matters"
    marker = path / "lmcache_triton_spec.json"
    assert json.loads(marker.read_text())["sliding_window"] == 8
    build_random_mistral(path, sliding_window=16, spec=spec)
    assert json.loads(marker.read_text())["sliding_window"] == 16, "another window: rebuilt"
    build_random_llama(path, spec)
    assert "arch" not in json.loads(marker.read_text()), "the Llama's folder is the Llama's"
