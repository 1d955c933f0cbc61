"""The demo's dtype: the one the host computes fastest, with the reason the summary prints."""

from __future__ import annotations

import time

import pytest
import torch

from lmcache_triton.tools.compute_dtype import choose_compute_dtype, host_compute_dtype


def test_a_gpu_computes_bfloat16():
    choice = choose_compute_dtype(gpu="NVIDIA H200", cpu_capability="AVX2", cpu_native_bf16=False)
    assert choice.dtype == "bfloat16" and "NVIDIA H200" in choice.reason


def test_a_cpu_without_native_bfloat16_computes_float32():
    choice = choose_compute_dtype(gpu=None, cpu_capability="AVX2", cpu_native_bf16=False)
    assert choice.dtype == "float32"
    assert "AVX2" in choice.reason and "no native bfloat16" in choice.reason


def test_a_cpu_with_native_bfloat16_computes_bfloat16():
    choice = choose_compute_dtype(gpu=None, cpu_capability="AVX512", cpu_native_bf16=True)
    assert choice.dtype == "bfloat16" and "AVX512" in choice.reason


def _linear_s(*dtypes: torch.dtype, rounds: int = 30) -> list[float]:
    """Per dtype the best timing of one of the demo model's MLP matmuls (512 tokens, 512 -> 1536),
    the dtypes taking turns round by round: a busy moment of the host (the other test worker) then
    falls on both, where 5 timings of one dtype after the other's could all land in it (an AMX
    host's bfloat16, 0.47 ms against float32's 3.3, measured 4.6 ms once beside a full test run)."""
    pairs = [(torch.randn(512, 512, dtype=d), torch.randn(1536, 512, dtype=d)) for d in dtypes]
    for x, w in pairs:
        torch.nn.functional.linear(x, w)  # first-call costs
    best = [float("inf")] * len(dtypes)
    for _ in range(rounds):
        for i, (x, w) in enumerate(pairs):
            t = time.perf_counter()
            torch.nn.functional.linear(x, w)
            best[i] = min(best[i], time.perf_counter() - t)
    return best


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU host the choice is the GPU's, not this CPU's")
def test_this_cpu_computes_the_chosen_dtype_no_slower():
    """On this host's CPU the chosen dtype is not slower than the other (1.5x of slack for a busy
    machine: on an AVX2 host bfloat16 took ~6x as long as float32, on an AMX host 1/7 as long)."""
    chosen = host_compute_dtype().dtype
    other = "float32" if chosen == "bfloat16" else "bfloat16"
    t_chosen, t_other = _linear_s(getattr(torch, chosen), getattr(torch, other))
    assert t_chosen <= 1.5 * t_other, f"{chosen}: {t_chosen * 1e3:.1f} ms, {other}: {t_other * 1e3:.1f} ms"
