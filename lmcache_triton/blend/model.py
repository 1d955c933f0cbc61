"""The layerwise view of a decoder that the blender drives.

CacheBlend cannot call a model's forward: between computing a layer's fresh K/V and its attention
it swaps in cached KV, and from the check layer on it carries only the selected tokens. So a model
is seen through `LayerwiseModel`, five calls per layer and two outside the loop, small enough for
both transformers' modules (`HFLlamaLayerwise`) and vLLM's (`VLLMLlamaLayerwise`).

Conventions of every implementation:
- `hidden` is the residual stream `[n, hidden_size]` entering a layer (before its input norm); vLLM's
  fused (hidden, residual) pair is folded into it by the adapter.
- q is `[n, num_heads, head_size]`, k and v `[n, num_kv_heads, head_size]`, q and k rotated by RoPE
  at the given positions (and q/k-normed first where the model has q_norm/k_norm, Qwen3).
- Attention is causal by row of the prompt: query row i sees key rows 0..i of the full K/V.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class RotaryInfo:
    """What `rope_rerotate` needs: vLLM's cache layout [max_position, rotary_dim], cos half then sin half."""

    cos_sin_cache: torch.Tensor
    is_neox: bool
    rotary_dim: int


@runtime_checkable
class LayerwiseModel(Protocol):
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_size: int
    rotary: RotaryInfo

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[n] token ids -> [n, hidden_size]: the residual stream entering layer 0."""
        ...

    def qkv(self, layer: int, hidden: torch.Tensor, positions: torch.Tensor
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Input norm, q/k/v projections, RoPE at `positions`, for the rows of `hidden`."""
        ...

    def attention(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  q_rows: torch.Tensor) -> torch.Tensor:
        """q `[n, heads, d]` of prompt rows `q_rows` (ascending) against the full k/v `[T, kv_heads, d]`
        -> `[n, heads * d]`, causal by row."""
        ...

    def finish_layer(self, layer: int, attn_out: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """o_proj, residual add, post-attention norm, MLP, residual add -> the next layer's residual stream."""
        ...

    def logits(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Final norm and lm_head: residual stream [n, hidden] -> (normed hidden, logits [n, vocab])."""
        ...


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_rows: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """Reference attention for adapters: SDPA with GQA, causal by prompt row. When every row is a
    query the plain causal path is used (no [T, T] mask is built)."""
    n, num_heads, head_size = q.shape
    # 4-D [1, heads, rows, d]: with 3-D inputs torch's CPU SDPA takes the math path (~7x slower here)
    qt, kt, vt = (x.transpose(0, 1)[None] for x in (q, k, v))
    gqa = num_heads != k.shape[1]
    if n == k.shape[0]:
        out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, scale=scale, enable_gqa=gqa)
    else:
        mask = torch.arange(k.shape[0], device=q.device)[None, :] <= q_rows.to(q.device)[:, None]
        out = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, scale=scale, enable_gqa=gqa)
    return out[0].transpose(0, 1).reshape(n, num_heads * head_size)
