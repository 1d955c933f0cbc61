"""Which models the connector serves: it restores all of a request's state, or it declines the model.

vLLM hands both sides of the connector the model's `KVCacheConfig`. The connector keeps one thing
per request: the paged attention KV of its tokens, one block table, every block holding its tokens
until the request ends. So it serves exactly one KV cache group whose spec is plain attention
(`FullAttentionSpec`, `MLAAttentionSpec`), and declines the whole model otherwise
(`declines.DECLINE_UNSUPPORTED_MODEL`: no lookup, no load, no save; the workers build no engine):

- several groups (a hybrid: Mamba or linear attention beside attention, as Jamba, Bamba,
  Granite-4, Qwen3-Next; or vLLM's hybrid allocator's groups): a hit would restore one group's
  state and leave the others' (a recurrent state, other layers' blocks) uncomputed;
- one group of another kind (`MambaSpec`, `ChunkedLocalAttentionSpec`, a sink or encoder spec,
  ...): not per-token KV in one block table;
- non-causal attention (a prefix LM): a token's KV depends on tokens after it, not on its prefix;
- a block size other than the scheduler's `cache_config.block_size`, which the slots are computed from.

Sliding-window attention (`SlidingWindowSpec`, every layer sliding, as Mistral-7B-v0.1): while a
request runs vLLM frees the blocks that leave its window (`SlidingWindowManager.remove_skipped_blocks`)
and may hand them to another request at once, and a request loaded past the window gets vLLM's
null block for its first blocks. The saves read a request's blocks after its step (saver.py) and the
loads write every loaded token's slot, so neither is correct once a block can be freed: a request
whose prompt plus `max_tokens` exceeds the window is declined (`DECLINE_SLIDING_WINDOW`, per request);
shorter ones never lose a block and are served as with full attention. A window at least
`max_model_len` frees nothing. Models that mix sliding and full layers (Gemma-2, Gemma-3) reach the
connector as one `FullAttentionSpec` group: vLLM turns its hybrid allocator off for a connector that
does not declare it (`SupportsHMA`), keeps every block, and still computes the window.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from lmcache_triton.integration.vllm.declines import DECLINE_SLIDING_WINDOW, DECLINE_UNSUPPORTED_MODEL

logger = logging.getLogger("lmcache_triton")

_ATTENTION = ("FullAttentionSpec", "MLAAttentionSpec")  # exact types: their subclasses change what a block holds
_SLIDING = "SlidingWindowSpec"


@dataclass(frozen=True)
class ModelSupport:
    decline: str | None = None        # the whole model is left to vLLM for this reason
    why: str = ""                     # what about its KV cache (the log line)
    sliding_window: int | None = None  # a request longer than this (prompt + max_tokens) is left to vLLM


def _group(i: int, group: Any) -> str:
    spec = group.kv_cache_spec
    layers = len(getattr(group, "layer_names", ()) or ())
    return f"group {i}: {type(spec).__name__} ({layers} layers)"


def check_model(vllm_config: Any, kv_cache_config: Any) -> ModelSupport:
    """What the connector can serve of the model whose KV cache vLLM describes in `kv_cache_config`
    (None: vLLM said nothing, so it is served as before). A config it cannot read (another vLLM's
    shape) declines the model rather than fail vLLM's start."""
    try:
        return _check(vllm_config, kv_cache_config)
    except Exception as e:
        return ModelSupport(DECLINE_UNSUPPORTED_MODEL, f"a KV cache config the connector cannot read ({e!r})")


def _check(vllm_config: Any, kv_cache_config: Any) -> ModelSupport:
    if kv_cache_config is None:
        return ModelSupport()
    groups = list(getattr(kv_cache_config, "kv_cache_groups", None) or ())
    if not groups:
        return ModelSupport(DECLINE_UNSUPPORTED_MODEL, "no KV cache groups (an attention-free model)")
    if len(groups) > 1:
        return ModelSupport(DECLINE_UNSUPPORTED_MODEL, f"{len(groups)} KV cache groups ("
                            + "; ".join(_group(i, g) for i, g in enumerate(groups))
                            + "): a hit would restore one group's state and not the others'")
    spec = groups[0].kv_cache_spec
    kind = type(spec).__name__
    if kind not in _ATTENTION and kind != _SLIDING:
        return ModelSupport(DECLINE_UNSUPPORTED_MODEL, f"{_group(0, groups[0])}: not paged attention KV")
    if getattr(spec, "non_causal", False):
        return ModelSupport(DECLINE_UNSUPPORTED_MODEL, f"{_group(0, groups[0])} with non-causal attention: "
                            "a token's KV depends on the tokens after it")
    block_size = vllm_config.cache_config.block_size
    if spec.block_size != block_size:
        return ModelSupport(DECLINE_UNSUPPORTED_MODEL, f"{_group(0, groups[0])} with block size {spec.block_size}, "
                            f"not the scheduler's {block_size}")
    if kind == _SLIDING:
        window, max_len = int(spec.sliding_window), int(vllm_config.model_config.max_model_len)
        if window < max_len:
            return ModelSupport(why=f"sliding-window attention (window {window} < max_model_len {max_len}): vLLM "
                                "frees the blocks that leave the window", sliding_window=window)
    return ModelSupport()


def log_support(support: ModelSupport, vllm_config: Any) -> None:
    """One line, from the scheduler side, when the model is not fully served."""
    model = getattr(getattr(vllm_config, "model_config", None), "model", "?")
    if support.decline is not None:
        logger.warning("lmcache_triton: model %s is left to vLLM (no lookup, load or save; miss reason %r): "
                       "its KV cache has %s", model, support.decline, support.why)
    elif support.sliding_window is not None:
        logger.warning("lmcache_triton: model %s has %s: requests whose prompt plus max_tokens exceed %d tokens "
                       "are left to vLLM (miss reason %r)", model, support.why, support.sliding_window,
                       DECLINE_SLIDING_WINDOW)
