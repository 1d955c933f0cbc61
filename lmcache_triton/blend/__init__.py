"""CacheBlend for lmcache_triton: segment keys, a layerwise model view, and the blender.

Importing this package loads torch and the kernels, nothing else (no model, no vLLM).
"""

from lmcache_triton.blend.blender import (BlendResult, KVSource, LMCBlender, LMCBlenderBuilder, RetrieverKVSource,
                                          TensorKVSource, segment_positions)
from lmcache_triton.blend.llama import HFLlamaLayerwise, VLLMLlamaLayerwise, as_layerwise
from lmcache_triton.blend.model import LayerwiseModel, RotaryInfo, causal_attention
from lmcache_triton.engine.token_database import SegmentTokenDatabase, separator_ids, split_segments

__all__ = [
    "BlendResult", "KVSource", "LMCBlender", "LMCBlenderBuilder", "RetrieverKVSource", "TensorKVSource",
    "segment_positions", "HFLlamaLayerwise", "VLLMLlamaLayerwise", "as_layerwise", "LayerwiseModel", "RotaryInfo",
    "causal_attention", "SegmentTokenDatabase", "separator_ids", "split_segments",
]
