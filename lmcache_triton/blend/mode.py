"""The engine's CacheBlend mode: segment keys (the prompt split at `blend_special_str`, each segment
keyed on its own tokens) and K stored as if each segment started at position 0, so the blender can
re-rotate it to wherever the segment sits in a later prompt.

Imported by whoever builds a blending engine (vLLM's worker side), not by the package: it loads the
engine and, when called, the model's tokenizer.
"""

from __future__ import annotations

from typing import Any

import torch

from lmcache_triton.blend.llama import as_layerwise
from lmcache_triton.blend.model import RotaryInfo
from lmcache_triton.engine.engine import CacheMode
from lmcache_triton.engine.gpu_connector import KeyRotation
from lmcache_triton.engine.token_database import SegmentTokenDatabase
from lmcache_triton.kernels import rope_rerotate
from lmcache_triton.metadata import LMCacheEngineMetadata


def to_position_zero(rot: RotaryInfo, num_kv_heads: int, head_size: int) -> KeyRotation:
    """The store's key rotation: each token's K moves back by its chunk's start (only new - old
    positions count), in place, with the cos/sin table copied once to each device it meets."""
    tables: dict[torch.device, torch.Tensor] = {}

    def rotate(k: torch.Tensor, chunk_starts: torch.Tensor) -> None:
        table = tables.get(k.device)
        if table is None:  # (a copy per call was the whole table per chunk and layer: ~1000 per 8K tokens)
            table = tables[k.device] = rot.cos_sin_cache.to(k.device)
        k3 = k.view(k.shape[0], num_kv_heads, head_size)
        rope_rerotate(k3, chunk_starts, torch.zeros_like(chunk_starts), table, is_neox=rot.is_neox,
                      rotary_dim=rot.rotary_dim, out=k3)

    return rotate


def blend_cache_mode(model_config: Any, config: Any, metadata: LMCacheEngineMetadata, model: Any,
                     connector: Any) -> CacheMode:
    """The mode of an engine that serves CacheBlend for `model` (vLLM's loaded model, or any
    `as_layerwise` takes): `model_config` names the tokenizer (`tokenizer`, `trust_remote_code`,
    as vLLM's ModelConfig), whose encoding of `blend_special_str` separates the segments."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_config.tokenizer, trust_remote_code=model_config.trust_remote_code)
    database = SegmentTokenDatabase.from_config(config, metadata, tokenizer, fmt=connector.fmt)
    layerwise = as_layerwise(model)
    return CacheMode(database, key_rotation=to_position_zero(layerwise.rotary, layerwise.num_kv_heads,
                                                             layerwise.head_size))
