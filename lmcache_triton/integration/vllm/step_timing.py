"""What computing a token costs on this worker: vLLM's forward timed per step, and a calibration
for before the first steps (load_policy.py's `PrefillEstimate` reads both).

vLLM binds the step's connector metadata just before the model's forward and calls `wait_for_save`
just after it (the model runner's KV-connector context), so the time between them is the forward
of the step's scheduled tokens. (`start_load_kv` is no mark: vLLM calls it after the forward when
the step has no synchronous load.) The time our own synchronous loads take in between is taken off
(`exclude`). On a GPU the forward only queues kernels: a pair of CUDA events per step is read once
the GPU has passed them, a later step (no synchronisation on vLLM's path).
"""

from __future__ import annotations

import logging
import statistics
import time
from collections import deque
from typing import Any

import torch

from lmcache_triton.engine.load_policy import PrefillEstimate

logger = logging.getLogger("lmcache_triton")

_PENDING_EVENTS = 64  # steps whose CUDA events are not read yet, at most


class StepTimer:
    def __init__(self, device: torch.device | None = None) -> None:
        self.cuda = device is not None and device.type == "cuda"
        self._begun: tuple[int, Any] | None = None
        self._excluded = 0.0
        self._pending: deque[tuple[int, Any, Any]] = deque()

    def exclude(self, seconds: float) -> None:
        """Time inside the step that is not the forward (a synchronous load, on the CPU path)."""
        self._excluded += seconds

    def forward_begins(self, tokens: int) -> None:
        self._excluded = 0.0
        if tokens <= 0:
            self._begun = None
            return
        if self.cuda:
            start = torch.cuda.Event(enable_timing=True)
            start.record()
            self._begun = (tokens, start)
        else:
            self._begun = (tokens, time.perf_counter())

    def forward_ends(self, prefill: PrefillEstimate) -> None:
        if self._begun is None:
            return
        tokens, start = self._begun
        self._begun = None
        if not self.cuda:
            prefill.observe(tokens, time.perf_counter() - start - self._excluded)
            return
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        self._pending.append((tokens, start, end))
        while self._pending and (self._pending[0][2].query() or len(self._pending) > _PENDING_EVENTS):
            tokens, start, end = self._pending.popleft()
            if end.query():
                prefill.observe(tokens, start.elapsed_time(end) / 1000)


def flops_per_token(hf_config: Any, tensor_parallel: int = 1) -> float | None:
    """Multiply-adds x 2 of one token through the decoder layers (attention projections and MLP)
    on one rank; None when the config does not say (not a Llama-like decoder)."""
    try:
        h = int(hf_config.hidden_size)
        layers = int(hf_config.num_hidden_layers)
        inter = int(hf_config.intermediate_size)
        heads = int(hf_config.num_attention_heads)
        kv_heads = int(getattr(hf_config, "num_key_value_heads", None) or heads)
        head_dim = int(getattr(hf_config, "head_dim", None) or h // heads)
    except (AttributeError, TypeError, ValueError):
        return None
    per_layer = h * heads * head_dim * 2 + h * kv_heads * head_dim * 2 + 3 * h * inter
    return 2.0 * layers * per_layer / max(tensor_parallel, 1)


def calibrate(estimate: PrefillEstimate, hf_config: Any, *, device: torch.device, dtype: torch.dtype,
              tensor_parallel: int = 1, tokens: int = 256) -> float | None:
    """Seeds `estimate` with the seconds per token a matmul of the model's width suggests (a few
    milliseconds at start); the steps vLLM runs replace it. Returns the value, None if unknown."""
    flops = flops_per_token(hf_config, tensor_parallel)
    if flops is None:
        return None
    h, inter = int(hf_config.hidden_size), int(hf_config.intermediate_size)
    try:
        a = torch.randn(tokens, h, device=device).to(dtype)
        b = torch.randn(h, inter, device=device).to(dtype)
        times = []
        for _ in range(5):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t = time.perf_counter()
            a @ b
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            times.append(time.perf_counter() - t)
    except Exception as e:  # a dtype the device cannot multiply: the steps will tell
        logger.debug("lmcache_triton: prefill calibration skipped: %s", e)
        return None
    rate = 2.0 * tokens * h * inter / max(statistics.median(times[1:]), 1e-9)  # flop/s, first run warms up
    per_token = flops / rate
    estimate.calibrate(per_token)
    return per_token
