"""What the scheduler and worker sides derive alike from vLLM's config."""

from __future__ import annotations

import logging
import os
import tempfile
from typing import Any

from lmcache_triton.config import LMCacheEngineConfig, connector_overrides

logger = logging.getLogger("lmcache_triton")


def resolve_config(vllm_config: Any) -> LMCacheEngineConfig:
    """LMCache's resolution (LMCACHE_CONFIG_FILE, then LMCACHE_* variables) with the
    `lmcache.`-prefixed keys of kv_connector_extra_config on top; the keys LMCache's connector reads
    there without the prefix (discard_partial_chunks, skip_last_n_tokens, lmcache_rpc_port) are
    mapped or warned about, as config.connector_overrides says."""
    extra = vllm_config.kv_transfer_config.kv_connector_extra_config or {}
    config = LMCacheEngineConfig.load(connector_overrides(extra))
    if cpu_blocks_opaque() and config.save_unfull_chunk and not config.enable_blending:  # blending: worker refuses AMX
        logger.warning("lmcache_triton: save_unfull_chunk is not supported by vLLM's CPU backend on AMX "
                       "CPUs (whole blocks only); disabling it")
        config = config.replace(save_unfull_chunk=False)
    return config


def is_cpu_platform() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def cpu_blocks_opaque() -> bool:
    """On AMX CPUs vLLM's CPU attention kernel packs a block's K in a layout we have not verified
    (the `vllm_cpu` view is checked for its "vec" kernels): there only whole blocks are moved, and
    per-token work on K (CacheBlend) is refused."""
    import torch

    return is_cpu_platform() and bool(torch.cpu._is_amx_tile_supported())


def engine_id(vllm_config: Any) -> str:
    return str(vllm_config.kv_transfer_config.engine_id)


def world_size(vllm_config: Any) -> int:
    p = vllm_config.parallel_config
    return p.tensor_parallel_size * p.pipeline_parallel_size


def kv_identity(vllm_config: Any, block_format: str) -> str:
    """Everything of vLLM's config that changes a token's KV besides the model name, ranks and KV
    dtype (which keys carry on their own): a revision, a quantization, rope or other HF-config
    overrides, the KV cache dtype as configured (fp8 variants share a storage dtype), and the
    cache's block format. Two engines that differ here never share a chunk."""
    mc = vllm_config.model_config
    parts = {
        "revision": getattr(mc, "revision", None),
        "quantization": getattr(mc, "quantization", None),
        "hf_overrides": getattr(mc, "hf_overrides", None),
        "rope": getattr(getattr(mc, "hf_config", None), "rope_scaling", None),
        "rope_theta": getattr(getattr(mc, "hf_config", None), "rope_theta", None),
        "dtype": str(getattr(mc, "dtype", "")),
        "cache_dtype": getattr(vllm_config.cache_config, "cache_dtype", None),
        "blocks": block_format,
    }
    return ";".join(f"{k}={v!r}" for k, v in parts.items() if v not in (None, "", {}, "auto"))


def ipc_path(kind: str, engine_id: str, rank: int) -> str:
    """The IPC endpoint of one worker rank's `kind` server ("lookup", "offload"), named per vLLM
    engine id and rank, so two vLLM instances on one host never answer each other."""
    safe = "".join(c if c.isalnum() or c in "-_" else "_" for c in engine_id)[:80]
    return f"ipc://{os.path.join(tempfile.gettempdir(), f'lmct-{kind}-{safe}-{rank}')}"
