"""`LayerwiseModel` adapters for Llama-shaped decoders: transformers' and vLLM's modules.

Both run on the loaded modules and weights (nothing is copied). Llama-shaped means: RMSNorm before
attention and MLP, RoPE on q/k (rotate-halves in HF), GQA, gated MLP; it covers Llama, Mistral
(full attention only), Qwen2 and Qwen3 (Qwen3's per-head q_norm/k_norm is applied before RoPE).

Rejected at construction, with the reason, rather than blended wrongly:
- sliding-window layers: the blender's attention is plain causal over the whole prompt;
- RoPE whose cos/sin carry a scale (YaRN's attention_scaling != 1) or change with the sequence
  length (dynamic NTK): re-rotating cached K by a position delta is exact only for a fixed rotation.
"""

from __future__ import annotations

from typing import Any

import torch

from lmcache_triton.blend.model import LayerwiseModel, RotaryInfo, causal_attention

_HF_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class HFLlamaLayerwise:
    """transformers' LlamaForCausalLM (and the Mistral/Qwen2/Qwen3 variants) seen layer by layer.

    Matches the model's own forward with the eager/SDPA attention: same modules, same rotary
    embedding module for q/k, attention scale from the attention module.
    """

    def __init__(self, model: Any) -> None:
        cfg = model.config
        if cfg.model_type not in _HF_MODEL_TYPES:
            raise ValueError(f"HFLlamaLayerwise supports model types {_HF_MODEL_TYPES}, got {cfg.model_type!r}")
        layer_types = getattr(cfg, "layer_types", None)
        if layer_types and any(t != "full_attention" for t in layer_types):
            raise NotImplementedError(f"blending needs full attention in every layer; layer_types={layer_types}")
        if cfg.model_type == "mistral" and getattr(cfg, "sliding_window", None):
            raise NotImplementedError(f"blending does not support Mistral's sliding window ({cfg.sliding_window})")
        rot = model.model.rotary_emb
        if float(getattr(rot, "attention_scaling", 1.0)) != 1.0 or "dynamic" in str(getattr(rot, "rope_type", "")):
            raise NotImplementedError(f"blending cannot re-rotate RoPE type {getattr(rot, 'rope_type', '?')!r} "
                                      f"(attention_scaling={getattr(rot, 'attention_scaling', 1.0)})")
        self.model = model
        self.layers = model.model.layers
        attn = self.layers[0].self_attn
        self.num_layers = len(self.layers)
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_size = attn.head_dim
        self.scale = float(attn.scaling)
        self.rotary_dim = 2 * rot.inv_freq.numel()
        if self.rotary_dim != self.head_size:
            raise NotImplementedError(f"partial rotary (rotary_dim={self.rotary_dim} < head_dim={self.head_size})")
        self.max_position = int(cfg.max_position_embeddings)
        self._rotary: RotaryInfo | None = None

    @property
    def rotary(self) -> RotaryInfo:
        # Built on first use, in fp32 on the model's device, from the module's own inv_freq.
        if self._rotary is None:
            inv_freq = self.model.model.rotary_emb.inv_freq.float()
            pos = torch.arange(self.max_position, device=inv_freq.device, dtype=torch.float32)
            freqs = pos[:, None] * inv_freq[None, :]
            cache = torch.cat([freqs.cos(), freqs.sin()], dim=-1)
            self._rotary = RotaryInfo(cache, is_neox=True, rotary_dim=self.rotary_dim)
        return self._rotary

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.model.embed_tokens(input_ids)

    def qkv(self, layer: int, hidden: torch.Tensor, positions: torch.Tensor):
        block = self.layers[layer]
        attn = block.self_attn
        x = block.input_layernorm(hidden)
        n = x.shape[0]
        q = attn.q_proj(x).view(n, -1, self.head_size)
        k = attn.k_proj(x).view(n, -1, self.head_size)
        v = attn.v_proj(x).view(n, -1, self.head_size)
        if hasattr(attn, "q_norm"):  # Qwen3: RMSNorm per head, before RoPE
            q, k = attn.q_norm(q), attn.k_norm(k)
        cos, sin = self.model.model.rotary_emb(x, positions[None].to(x.device))
        cos, sin = cos[0, :, None, :], sin[0, :, None, :]
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin, v

    def attention(self, layer: int, q, k, v, q_rows):
        return causal_attention(q, k, v, q_rows, self.scale)

    def finish_layer(self, layer: int, attn_out: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        block = self.layers[layer]
        h = hidden + block.self_attn.o_proj(attn_out)
        return h + block.mlp(block.post_attention_layernorm(h))

    def logits(self, hidden: torch.Tensor):
        x = self.model.model.norm(hidden)
        return x, self.model.lm_head(x)


class VLLMLlamaLayerwise:
    """vLLM's LlamaForCausalLM (Mistral, Qwen2, Qwen3 share the module names) seen layer by layer.

    UNTESTED: building a vLLM model needs a VllmConfig and initialized distributed state, which the
    CPU test suite does not do. It follows vLLM's LlamaDecoderLayer/LlamaAttention forward: merged
    qkv_proj, `rotary_emb(positions, q, k)`, gate_up_proj inside `mlp`, RMSNorm called without a
    residual (so the residual stream stays one tensor). Under tensor parallelism the head counts are
    per rank and o_proj/down_proj all-reduce, as in vLLM's own forward. Attention is the portable
    SDPA reference; a FlashAttention varlen path is the obvious speed-up on GPU.
    """

    def __init__(self, vllm_model: Any) -> None:
        inner = vllm_model.model
        start, end = getattr(inner, "start_layer", 0), getattr(inner, "end_layer", len(inner.layers))
        if start != 0 or end != len(inner.layers):
            raise NotImplementedError("blending with pipeline parallelism is not supported")
        self.vllm_model = vllm_model
        self.layers = list(inner.layers)
        attn = self.layers[0].self_attn
        if getattr(attn, "sliding_window", None) or getattr(getattr(attn, "attn", None), "sliding_window", None):
            raise NotImplementedError("blending needs full attention in every layer")
        rope = attn.rotary_emb
        self.num_layers = len(self.layers)
        self.num_heads = attn.num_heads
        self.num_kv_heads = attn.num_kv_heads
        self.head_size = attn.head_dim
        self.q_size, self.kv_size = attn.q_size, attn.kv_size
        self.scale = float(attn.scaling)
        self.rotary = RotaryInfo(_fp32_cos_sin(rope), is_neox=bool(rope.is_neox_style),
                                 rotary_dim=int(rope.rotary_dim))

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.vllm_model.model.embed_tokens(input_ids)

    def qkv(self, layer: int, hidden: torch.Tensor, positions: torch.Tensor):
        block = self.layers[layer]
        attn = block.self_attn
        x = block.input_layernorm(hidden)
        qkv, _ = attn.qkv_proj(x)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        n = x.shape[0]
        if hasattr(attn, "q_norm"):  # Qwen3
            q = attn.q_norm(q.reshape(n, -1, self.head_size)).reshape(n, -1)
            k = attn.k_norm(k.reshape(n, -1, self.head_size)).reshape(n, -1)
        q, k = attn.rotary_emb(positions, q, k)
        return (q.reshape(n, -1, self.head_size), k.reshape(n, -1, self.head_size),
                v.reshape(n, -1, self.head_size))

    def attention(self, layer: int, q, k, v, q_rows):
        return causal_attention(q, k, v, q_rows, self.scale)

    def finish_layer(self, layer: int, attn_out: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        block = self.layers[layer]
        o, _ = block.self_attn.o_proj(attn_out)
        h = hidden + o
        return h + block.mlp(block.post_attention_layernorm(h))

    def logits(self, hidden: torch.Tensor):
        x = self.vllm_model.model.norm(hidden)
        return x, self.vllm_model.compute_logits(x)


def as_layerwise(model: Any) -> LayerwiseModel:
    """A `LayerwiseModel` for `model`: itself if it already is one, else the matching adapter."""
    if isinstance(model, LayerwiseModel):
        return model
    try:
        attn = model.model.layers[0].self_attn
    except (AttributeError, IndexError, TypeError):
        raise TypeError(f"cannot blend with {type(model).__name__}: no model.layers[0].self_attn") from None
    if hasattr(attn, "qkv_proj"):
        return VLLMLlamaLayerwise(model)
    if hasattr(attn, "q_proj") and hasattr(model, "lm_head"):
        return HFLlamaLayerwise(model)
    raise TypeError(f"cannot blend with {type(model).__name__}: not a Llama-shaped HF or vLLM model")


def _fp32_cos_sin(rope) -> torch.Tensor:
    """vLLM's cos/sin table in fp32, on its device: recomputed by the rotary module itself where it
    can (`_compute_cos_sin_cache`, fp32 before vLLM casts it to the model's dtype), else the kept
    table widened. K is re-rotated twice (to position 0 when stored, to its new position when
    blended): through a bf16 table each adds rounding to the deviation score."""
    kept = rope.cos_sin_cache
    try:
        exact = rope._compute_cos_sin_cache()
    except Exception:  # noqa: BLE001 - a rotary class without it, or with other needs: widen the kept table
        exact = None
    if not isinstance(exact, torch.Tensor) or exact.shape != kept.shape:
        exact = kept
    return exact.to(device=kept.device, dtype=torch.float32)
