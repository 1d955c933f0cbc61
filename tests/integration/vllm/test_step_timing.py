"""What computing a token costs (integration/vllm/step_timing.py), on CPU and without vLLM: the
step timer's samples, the flops of a Llama-like config, the calibration's seed."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch

from lmcache_triton.engine.load_policy import PrefillEstimate
from lmcache_triton.integration.vllm.step_timing import StepTimer, calibrate, flops_per_token


def llama(**over) -> SimpleNamespace:
    """A Llama-7B-like hf_config (multi-head attention)."""
    fields = dict(hidden_size=4096, num_hidden_layers=32, intermediate_size=11008, num_attention_heads=32,
                  num_key_value_heads=32)
    return SimpleNamespace(**(fields | over))


@pytest.mark.parametrize("device", [pytest.param(None, id="no-device"), pytest.param(torch.device("cpu"), id="cpu")])
def test_the_timer_feeds_each_forward_to_the_estimate(device):
    timer, prefill = StepTimer(device), PrefillEstimate()
    assert not timer.cuda
    timer.forward_begins(100)
    time.sleep(0.01)  # the forward
    timer.forward_ends(prefill)
    assert prefill.steps == 1
    # one step of 100 tokens, no calibration: its whole time per token (an upper bound)
    assert prefill.per_token_s is not None and prefill.seconds(100) >= 0.01
    timer.forward_ends(prefill)
    assert prefill.steps == 1, "an end without a beginning observes nothing"


def test_a_step_without_tokens_observes_nothing():
    timer, prefill = StepTimer(), PrefillEstimate()
    timer.forward_begins(100)
    timer.forward_begins(0)  # vLLM ran a step with nothing scheduled (or the metadata said none)
    timer.forward_ends(prefill)
    assert prefill.steps == 0 and prefill.per_token_s is None


def test_flops_per_token_of_a_llama_like_config():
    h, inter, layers = 4096, 11008, 32
    # q, k, v, o projections (h x h each) and the MLP's three (h x inter), two flops a multiply-add
    assert flops_per_token(llama()) == pytest.approx(2 * layers * (4 * h * h + 3 * h * inter))
    gqa = llama(num_key_value_heads=8)  # k and v project to 8 heads of 128
    assert flops_per_token(gqa) == pytest.approx(2 * layers * (2 * h * h + 2 * h * 8 * 128 + 3 * h * inter))
    assert flops_per_token(llama(), tensor_parallel=2) == pytest.approx(flops_per_token(llama()) / 2)
    wide_heads = llama(head_dim=256, num_attention_heads=16, num_key_value_heads=None)  # kv heads = heads
    assert flops_per_token(wide_heads) == pytest.approx(2 * layers * (4 * h * 16 * 256 + 3 * h * inter))


@pytest.mark.parametrize("config", [
    pytest.param(SimpleNamespace(hidden_size=64, num_hidden_layers=2), id="missing-fields"),
    pytest.param(llama(intermediate_size=None), id="a-field-None"),
    pytest.param(llama(hidden_size="wide"), id="a-field-not-a-number"),
])
def test_flops_per_token_of_a_config_that_does_not_say_is_none(config):
    assert flops_per_token(config) is None


def test_calibrate_seeds_the_estimate():
    prefill = PrefillEstimate()
    small = llama(hidden_size=64, num_hidden_layers=2, intermediate_size=128, num_attention_heads=4,
                  num_key_value_heads=4)
    per_token = calibrate(prefill, small, device=torch.device("cpu"), dtype=torch.float32, tokens=32)
    assert per_token is not None and per_token > 0
    assert prefill.calibrated_per_token_s == per_token
    assert prefill.per_token_s == per_token, "before any step, the calibration answers"


def test_calibrate_without_a_model_shape_leaves_the_estimate_unseeded():
    prefill = PrefillEstimate()
    assert calibrate(prefill, SimpleNamespace(), device=torch.device("cpu"), dtype=torch.float32) is None
    assert prefill.calibrated_per_token_s is None
