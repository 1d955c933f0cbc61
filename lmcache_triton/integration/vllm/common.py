"""What the scheduler and worker sides derive alike from vLLM's config."""

from __future__ import annotations

import logging
from typing import Any

from lmcache_triton.config import LMCacheEngineConfig

logger = logging.getLogger("lmcache_triton")
_PREFIX = "lmcache."


def resolve_config(vllm_config: Any) -> LMCacheEngineConfig:
    """LMCache's resolution (LMCACHE_CONFIG_FILE, then LMCACHE_* variables) with the
    `lmcache.`-prefixed keys of kv_connector_extra_config on top."""
    extra = vllm_config.kv_transfer_config.kv_connector_extra_config or {}
    overrides = {k: v for k, v in extra.items() if k.startswith(_PREFIX)}
    config = LMCacheEngineConfig.load(overrides)
    if is_cpu_platform() and config.save_unfull_chunk:
        # The CPU attention backend stores K transposed inside each block, so only whole blocks
        # can be moved; a partial chunk would end inside a block.
        logger.warning("lmcache_triton: save_unfull_chunk is not supported by vLLM's CPU backend; disabling it")
        config = config.replace(save_unfull_chunk=False)
    return config


def is_cpu_platform() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def engine_id(vllm_config: Any) -> str:
    return str(vllm_config.kv_transfer_config.engine_id)


def world_size(vllm_config: Any) -> int:
    p = vllm_config.parallel_config
    return p.tensor_parallel_size * p.pipeline_parallel_size
