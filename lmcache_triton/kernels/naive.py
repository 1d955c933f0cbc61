"""The oracle of the paged copies: slow, obvious, never used for serving.

The launchers (``paged_copy``) have two implementations, the Triton kernels and the optimized torch
path that serves CPU tensors (``reference``, with whole-block fast paths). Neither can check the
other, so both are checked against this file, bit for bit: the tests on small shapes, the benches
on each configuration they time, the tuner on each tile it tries.

It is written for being read, independently of ``reference`` and ``layouts``: it reads each layer
tensor with the shape vLLM documents for its layout and spells out, per layout, where the element
(K or V, block, offset in block, head, dim) of a token lies. The loops run over layers, tokens and
K/V in Python; the one vectorized axis is a token's row of hidden = heads * head_size columns,
column c being (head c // head_size, dim c % head_size).

Semantics, as the launchers': for token t of slot s, block = s // block_size and offset =
s % block_size, and the chunk row of (K or V, layer l, token t) is that element row of layer l.
A negative slot is padding (vLLM uses -1): gather leaves its chunk row untouched, scatter skips it.
A slot >= num_blocks * block_size raises ValueError before anything is copied, as the launchers do
when the slot mapping is in host memory; ``skip_out_of_range=True`` instead skips it like padding,
which is what the Triton kernels do where the launchers cannot check (a slot mapping on the GPU).
Scatter with a repeated slot leaves the last token's row (the launchers promise nothing there).
Chunks are KV_2LTD ``[2, L, T, hidden]`` (MLA ``[1, L, T, C]``) for all layers, KV_T2D
``[T, 2, hidden]`` (MLA ``[T, C]``) for one layer. Values move as integers of their width, so NaN
payloads and fp8 survive.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

_INT_OF_WIDTH = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(_INT_OF_WIDTH[t.element_size()])


def _shape(kv_cache: torch.Tensor, layout: str) -> tuple[int, int, int, int, int]:
    """(num_blocks, block_size, heads, head_size, num_kv) of one layer tensor."""
    s = tuple(kv_cache.shape)
    if layout == "vllm_packed" and len(s) == 4 and s[3] % 2 == 0:   # [num_blocks, heads, block_size, 2 * head_size]
        return s[0], s[2], s[1], s[3] // 2, 2
    if layout == "vllm_cpu" and len(s) == 4 and s[2] % 2 == 0:      # [num_blocks, heads, 2 * block_size, head_size]
        return s[0], s[2] // 2, s[1], s[3], 2
    if layout == "flash_attn" and len(s) == 5 and s[0] == 2:        # [2, num_blocks, block_size, heads, head_size]
        return s[1], s[2], s[3], s[4], 2
    if layout == "flashinfer" and len(s) == 5 and s[1] == 2:        # [num_blocks, 2, block_size, heads, head_size]
        return s[0], s[2], s[3], s[4], 2
    if layout == "mla" and len(s) == 3:                             # [num_blocks, block_size, C]
        return s[0], s[1], 1, s[2], 1
    raise ValueError(f"naive oracle: a {layout!r} layer of shape {s} is not a layout it knows")


def _index(layout: str, kv: int, block: int, offset: int, head: torch.Tensor, dim: torch.Tensor,
           block_size: int, head_size: int) -> tuple:
    """Index into one layer tensor of the elements (kv, block, offset, head[i], dim[i])."""
    if layout == "vllm_packed":     # a token's row per head: K in its first head_size columns, V after
        return block, head, offset, kv * head_size + dim
    if layout == "vllm_cpu":        # per (block, head): block_size rows of K, then block_size rows of V
        if kv == 1:                 # V is token-major: row block_size + offset
            return block, head, block_size + offset, dim
        # K is stored transposed: (offset, dim) sits at position dim * block_size + offset of the K
        # half read as one run of block_size * head_size elements (vLLM's CPU attention kernel).
        position = dim * block_size + offset
        return block, head, position // head_size, position % head_size
    if layout == "flash_attn":
        return kv, block, offset, head, dim
    if layout == "flashinfer":
        return block, kv, offset, head, dim
    return block, offset, dim       # mla: one latent row per token


def _copy(direction: str, kv_caches: Sequence[torch.Tensor], slot_mapping: torch.Tensor, layout: str,
          row, skip_out_of_range: bool) -> None:
    """The one loop. row(kv, layer, token) -> that chunk row as a [hidden] tensor (a view)."""
    num_blocks, block_size, heads, head_size, num_kv = _shape(kv_caches[0], layout)
    if any(c.shape != kv_caches[0].shape for c in kv_caches):
        raise ValueError("naive oracle: all layers must have one shape")
    slots = [int(s) for s in slot_mapping.tolist()]
    num_slots = num_blocks * block_size
    too_big = [s for s in slots if s >= num_slots]
    if too_big and not skip_out_of_range:
        raise ValueError(f"slot_mapping holds slot {max(too_big)}, but the cache has only {num_slots} slots")
    column = torch.arange(heads * head_size, device=kv_caches[0].device)
    head, dim = column // head_size, column % head_size
    for layer, cache in enumerate(kv_caches):
        x = _bits(cache)
        for token, slot in enumerate(slots):
            if slot < 0 or slot >= num_slots:
                continue
            block, offset = slot // block_size, slot % block_size
            for kv in range(num_kv):
                where = _index(layout, kv, block, offset, head, dim, block_size, head_size)
                r = row(kv, layer, token)
                if direction == "gather":
                    r.copy_(x[where].to(r.device))
                else:
                    x[where] = r.to(x.device)


def _check(chunk: torch.Tensor, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> None:
    if tuple(chunk.shape) != shape or chunk.dtype != dtype:
        raise ValueError(f"{name} must be {shape} of {dtype}, got {tuple(chunk.shape)} of {chunk.dtype}")


def _chunk_shape(kv_caches: Sequence[torch.Tensor], layout: str, num_tokens: int) -> tuple[int, ...]:
    _, _, heads, head_size, num_kv = _shape(kv_caches[0], layout)
    return num_kv, len(kv_caches), num_tokens, heads * head_size


def _layer_shape(kv_cache: torch.Tensor, layout: str, num_tokens: int) -> tuple[int, ...]:
    _, _, heads, head_size, num_kv = _shape(kv_cache, layout)
    return (num_tokens, head_size) if num_kv == 1 else (num_tokens, 2, heads * head_size)


def naive_gather(kv_caches: Sequence[torch.Tensor], slot_mapping: torch.Tensor, layout: str,
                 out: torch.Tensor | None = None, *, skip_out_of_range: bool = False) -> torch.Tensor:
    """All layers -> KV_2LTD [2, L, T, hidden] (MLA [1, L, T, C]); padding rows untouched."""
    shape = _chunk_shape(kv_caches, layout, slot_mapping.numel())
    if out is None:
        out = torch.zeros(shape, dtype=kv_caches[0].dtype, device=kv_caches[0].device)
    _check(out, "out", shape, kv_caches[0].dtype)
    bits = _bits(out)
    _copy("gather", kv_caches, slot_mapping, layout, lambda kv, l, t: bits[kv, l, t], skip_out_of_range)
    return out


def naive_scatter(chunk: torch.Tensor, kv_caches: Sequence[torch.Tensor], slot_mapping: torch.Tensor, layout: str,
                  *, skip_out_of_range: bool = False) -> None:
    """KV_2LTD [2, L, T, hidden] (MLA [1, L, T, C]) -> all layers; padding skipped."""
    _check(chunk, "chunk", _chunk_shape(kv_caches, layout, slot_mapping.numel()), kv_caches[0].dtype)
    bits = _bits(chunk)
    _copy("scatter", kv_caches, slot_mapping, layout, lambda kv, l, t: bits[kv, l, t], skip_out_of_range)


def _layer_row(bits: torch.Tensor):
    # KV_T2D [T, 2, hidden]: row (kv, token) is bits[token, kv]; MLA [T, C]: bits[token].
    return (lambda kv, l, t: bits[t]) if bits.dim() == 2 else (lambda kv, l, t: bits[t, kv])


def naive_gather_layer(kv_cache: torch.Tensor, slot_mapping: torch.Tensor, layout: str,
                       out: torch.Tensor | None = None, *, skip_out_of_range: bool = False) -> torch.Tensor:
    """One layer -> KV_T2D [T, 2, hidden] (MLA [T, C]); padding rows untouched."""
    shape = _layer_shape(kv_cache, layout, slot_mapping.numel())
    if out is None:
        out = torch.zeros(shape, dtype=kv_cache.dtype, device=kv_cache.device)
    _check(out, "out", shape, kv_cache.dtype)
    _copy("gather", [kv_cache], slot_mapping, layout, _layer_row(_bits(out)), skip_out_of_range)
    return out


def naive_scatter_layer(chunk: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor, layout: str,
                        *, skip_out_of_range: bool = False) -> None:
    """KV_T2D [T, 2, hidden] (MLA [T, C]) -> one layer; padding skipped."""
    _check(chunk, "chunk", _layer_shape(kv_cache, layout, slot_mapping.numel()), kv_cache.dtype)
    _copy("scatter", [kv_cache], slot_mapping, layout, _layer_row(_bits(chunk)), skip_out_of_range)


__all__ = ["naive_gather", "naive_scatter", "naive_gather_layer", "naive_scatter_layer"]
