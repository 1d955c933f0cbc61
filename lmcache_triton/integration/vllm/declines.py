"""Requests and models the connector leaves to vLLM, and why: each is a counted miss reason.

A decline is decided on the scheduler side, which sees vLLM's request; it is counted by rank 0's
engine (the step's metadata carries it), so the figures reach the connector's Prometheus exporter
and vLLM's own /metrics like any other miss (`lmcache_triton_miss_tokens_total{reason}`).

- `prompt_logprobs`: the request wants the logprobs of its prompt (`prompt_logprobs`, or in vLLM
  0.32 `prompt_logprob_token_ids`), which only a prefill of every prompt token gives. vLLM's own
  prefix cache skips such requests (`skip_reading_prefix_cache`), and so do we: no lookup, no load.
  Their KV is computed exactly, so it is still saved.
- `skip_prefix_cache`: the request asked vLLM to skip its prefix cache for another reason.
- `prompt_embeds`: a prompt given as embeddings has no token ids to key it by: neither loaded nor saved.
- `multimodal`: an image (audio, video) input without vLLM's content hash or placeholder position:
  the keys could not tell it from another input over the same placeholder tokens.
- `unsupported_model`: the model's KV cache is not one the connector can restore (model_support.py):
  every request of it. Its workers build no engine, so these are in the scheduler's log line only.
- `sliding_window`: a sliding-window model's request longer than the window: vLLM frees its blocks
  as they leave the window, before a save could read them (model_support.py).
"""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger("lmcache_triton")

DECLINE_PROMPT_LOGPROBS = "prompt_logprobs"
DECLINE_SKIP_PREFIX_CACHE = "skip_prefix_cache"
DECLINE_PROMPT_EMBEDS = "prompt_embeds"
DECLINE_UNSUPPORTED_MODEL = "unsupported_model"
DECLINE_MULTIMODAL = "multimodal"
DECLINE_SLIDING_WINDOW = "sliding_window"


def _unkeyed_input(request: Any) -> bool:
    """A multimodal input the keys cannot name: without a content hash its placeholder tokens are
    the same for every image."""
    for feature in getattr(request, "mm_features", None) or ():
        position = getattr(feature, "mm_position", None)
        if not getattr(feature, "identifier", None) or getattr(position, "offset", None) is None \
                or getattr(position, "length", None) is None:
            return True
    return False


def load_decline(request: Any, sliding_window: int | None = None) -> str | None:
    """Why `request`'s prompt must not be loaded (None: it may be). `sliding_window`: the model's
    window where vLLM frees the blocks that leave it (model_support.py)."""
    if getattr(request, "prompt_embeds", None) is not None:
        return DECLINE_PROMPT_EMBEDS
    if _unkeyed_input(request):
        return DECLINE_MULTIMODAL
    if sliding_window is not None:
        prompt = getattr(request, "num_prompt_tokens", None) or request.num_tokens
        max_tokens = getattr(request, "max_tokens", None)
        if max_tokens is None or prompt + max_tokens > sliding_window:
            return DECLINE_SLIDING_WINDOW
    params = getattr(request, "sampling_params", None)
    if params is not None and (getattr(params, "prompt_logprobs", None) is not None
                               or getattr(params, "prompt_logprob_token_ids", None) is not None):
        return DECLINE_PROMPT_LOGPROBS
    if getattr(request, "skip_reading_prefix_cache", False):
        return DECLINE_SKIP_PREFIX_CACHE
    return None


_logged: set[str] = set()  # reasons already logged at INFO by this process

_WHY = {
    DECLINE_PROMPT_LOGPROBS: "it wants its prompt's logprobs: vLLM computes every prompt token (its KV is saved)",
    DECLINE_SKIP_PREFIX_CACHE: "it asked vLLM to skip the prefix cache (its KV is saved)",
    DECLINE_PROMPT_EMBEDS: "its prompt is embeddings, with no token ids to key it by (not saved either)",
    DECLINE_UNSUPPORTED_MODEL: "the connector cannot serve this model (not saved either)",
    DECLINE_MULTIMODAL: "the connector cannot key this model's multimodal inputs (not saved either)",
    DECLINE_SLIDING_WINDOW: "it is longer than the model's sliding window, whose blocks vLLM frees (not saved either)",
}


def log_decline(req_id: str, reason: str) -> None:
    """One line saying why a request is left to vLLM: at INFO the first time a reason occurs in
    this process (a server may see thousands of such requests), at DEBUG after that."""
    level = logging.DEBUG if reason in _logged else logging.INFO
    _logged.add(reason)
    logger.log(level, "lmcache_triton: request %s is not loaded, %s; counted as a miss of reason %r%s", req_id,
               _WHY.get(reason, "the connector cannot serve it"), reason,
               "" if level == logging.DEBUG else " (further such requests are logged at DEBUG)")


def also_unsaved(reason: str) -> bool:
    """Whether a request declined for `reason` must not be saved either (its KV is not keyed by
    its token ids alone)."""
    return reason in (DECLINE_PROMPT_EMBEDS, DECLINE_UNSUPPORTED_MODEL, DECLINE_MULTIMODAL, DECLINE_SLIDING_WINDOW)


def count(engine: Any, declined: tuple[tuple[str, int], ...]) -> None:
    """Rank 0's engine counts the step's declined requests: a lookup that found nothing, its prompt's
    tokens missed for the decline's reason."""
    for reason, tokens in declined:
        engine.stats_monitor.on_lookup(tokens, 0, misses={reason: tokens})


def declines_figures(declined: list[tuple[str, int]]) -> dict:
    """Declines as vLLM's metrics read a step's figures (vllm_stats.py): lookups that found nothing."""
    misses: dict[str, int] = {}
    for reason, tokens in declined:
        misses[reason] = misses.get(reason, 0) + tokens
    total = sum(misses.values())
    return {"lookups": len(declined), "lookup_hits": 0, "lookup_tokens": total, "hit_tokens": 0,
            "miss_tokens": misses}
