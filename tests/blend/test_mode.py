"""CacheBlend's engine mode (blend/mode.py): what vLLM's worker side builds a blending engine with."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from lmcache_triton import LMCacheEngineMetadata, create_gpu_connector
from lmcache_triton.blend import SegmentTokenDatabase, as_layerwise, split_segments
from lmcache_triton.blend.mode import blend_cache_mode
from lmcache_triton.config import LMCacheEngineConfig
from lmcache_triton.kernels import rope_rerotate_ref
from lmcache_triton.tools.models import TinyLlamaSpec, build_random_llama


def test_the_mode_splits_at_the_tokenizers_separator_and_stores_each_segments_k_at_position_zero(tmp_path):
    """The tokenizer vLLM's model config names gives the separator's ids; the key rotation moves
    each token's K back by its chunk's start, so a segment computed at position 40 is stored as if
    it began at 0 (the blender later moves it to wherever the segment sits)."""
    from transformers import LlamaForCausalLM

    path = build_random_llama(tmp_path / "tiny-llama", TinyLlamaSpec(hidden_size=128, num_hidden_layers=2,
                                                                     head_dim=32, seed=1))
    model = LlamaForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    layerwise = as_layerwise(model)
    heads, head_size = layerwise.num_kv_heads, layerwise.head_size
    config = LMCacheEngineConfig.from_defaults(chunk_size=16, use_layerwise=True, enable_blending=True,
                                               blend_special_str=" w7 w9 ", blend_min_tokens=4)
    meta = LMCacheEngineMetadata(model_name="test/mode", world_size=1, worker_id=0, kv_dtype=torch.float32,
                                 kv_shape=(layerwise.num_layers, 2, 16, heads, head_size))
    mode = blend_cache_mode(SimpleNamespace(tokenizer=str(path), trust_remote_code=False), config, meta, model,
                            create_gpu_connector(config, meta, "vllm_packed"))

    assert isinstance(mode.token_database, SegmentTokenDatabase)
    prompt = torch.tensor([10, 11, 12, 13, 14, 7, 9, 20, 21, 22, 23, 24])
    assert split_segments(prompt, mode.token_database.separator) == [(0, 5), (7, 12)], \
        "the segments end at ' w7 w9 ', as the model's tokenizer spells it"

    rot, n = layerwise.rotary, 3
    at_zero = torch.randn(n, heads, head_size, generator=torch.Generator().manual_seed(0))
    starts = torch.full((n,), 40)
    at_forty = rope_rerotate_ref(at_zero.clone(), torch.zeros(n, dtype=torch.long), starts, rot.cos_sin_cache,
                                 is_neox=rot.is_neox, rotary_dim=rot.rotary_dim)
    k = at_forty.reshape(n, heads * head_size).clone()
    mode.key_rotation(k, starts)
    torch.testing.assert_close(k.view(n, heads, head_size), at_zero, atol=1e-4, rtol=0)
    assert not torch.allclose(at_forty, at_zero, atol=1e-2), "the test would not see a missing rotation"
