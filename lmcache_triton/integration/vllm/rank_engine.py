"""What a worker rank builds once vLLM registers its KV caches: the engine over them (its metadata
and GPU connector, read from the caches' layout) and, with CacheBlend, the segment mode and the
blender over vLLM's loaded model. vLLM itself is asked nothing here: the rank and the platform
come from the caller (worker.py's register_kv_caches)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from lmcache_triton.config import LMCacheEngineConfig
from lmcache_triton.engine.engine import LMCacheEngine, LMCacheEngineBuilder
from lmcache_triton.engine.gpu_connector import create_gpu_connector
from lmcache_triton.integration.vllm.common import kv_identity, world_size
from lmcache_triton.integration.vllm.paged import adapt_kv_caches
from lmcache_triton.kernels import kv_geometry
from lmcache_triton.metadata import LMCacheEngineMetadata
from lmcache_triton.observability import prometheus

logger = logging.getLogger("lmcache_triton")


@dataclass
class RankEngine:
    engine: LMCacheEngine
    kvcaches: list[torch.Tensor]   # vLLM's tensors as the kernels read them
    metadata: LMCacheEngineMetadata
    num_slots: int                 # of the paged cache: blocks x block_size
    blender: Any = None            # CacheBlend's, when the config enables blending


def build_rank_engine(vllm_config: Any, config: LMCacheEngineConfig, kv_caches: dict[str, torch.Tensor], *,
                      instance_id: str, rank: int, cpu_backend: bool, blocks_opaque: bool) -> RankEngine:
    """The engine registered under `instance_id` (LMCacheEngineBuilder), exported to Prometheus.
    `blocks_opaque`: vLLM's CPU backend on AMX, which moves whole blocks only and refuses CacheBlend."""
    model_config = vllm_config.model_config
    layout, kvcaches = adapt_kv_caches(list(kv_caches.values()), use_mla=model_config.use_mla,
                                       cpu_backend=cpu_backend)
    geo = kv_geometry(kvcaches[0], layout)
    chunk = config.chunk_size
    if blocks_opaque and chunk % geo.block_size:
        raise ValueError(
            f"lmcache chunk_size={chunk} must be a multiple of vLLM's block_size={geo.block_size} on the CPU "
            "backend (it moves whole blocks): set lmcache.chunk_size or --block-size accordingly")
    metadata = LMCacheEngineMetadata(
        model_name=str(model_config.model), world_size=world_size(vllm_config), worker_id=rank,
        kv_dtype=kvcaches[0].dtype,
        kv_shape=(len(kvcaches), 1 if geo.use_mla else 2, chunk, geo.num_kv_heads, geo.head_size),
        use_mla=geo.use_mla,
        # AMX blocks hold K in another (unverified) order than the "vec" blocks: never mixed.
        kv_identity=kv_identity(vllm_config, f"{layout}-amx" if blocks_opaque else layout))
    connector = create_gpu_connector(config, metadata, layout, device=kvcaches[0].device)
    mode = model = None
    if config.enable_blending:
        from lmcache_triton.blend.mode import blend_cache_mode
        from lmcache_triton.integration.vllm.model_hook import model_for_blending

        model = model_for_blending(blocks_opaque)
        mode = blend_cache_mode(model_config, config, metadata, model, connector)
    engine = LMCacheEngineBuilder.get_or_create(instance_id, config, metadata, connector, mode)
    prometheus.export(engine, config.prometheus_port)
    blender = None
    if model is not None:
        from lmcache_triton.blend import LMCBlenderBuilder

        blender = LMCBlenderBuilder.get_or_create(instance_id, engine, connector, config, model=model)
    logger.info("lmcache_triton worker ready: %d layers, layout %s, block_size %d", len(kvcaches), layout,
                geo.block_size)
    return RankEngine(engine, kvcaches, metadata, geo.num_blocks * geo.block_size, blender)
