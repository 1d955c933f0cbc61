"""Layout adapter: one layer's KV tensor as vLLM hands it over -> strided K and V views.

Every kernel in this package works on views of logical shape
``[num_blocks, block_size, num_kv_heads, head_size]`` (MLA: ``[num_blocks, block_size, C]``),
reading the strides; no layout is ever copied or assumed contiguous.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

LAYOUTS: tuple[str, ...] = ("vllm_packed", "vllm_cpu", "flash_attn", "flashinfer", "mla")


@dataclass(frozen=True)
class KVGeometry:
    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_size: int
    use_mla: bool

    @property
    def hidden(self) -> int:
        return self.num_kv_heads * self.head_size


def _bad(layout: str, kv_cache: torch.Tensor, why: str) -> ValueError:
    return ValueError(f"kv_cache of shape {tuple(kv_cache.shape)} cannot be layout {layout!r}: {why}")


def check_layout(layout: str, shape: tuple[int, ...] | None = None) -> None:
    if layout not in LAYOUTS:
        of = "" if shape is None else f" (kv_cache shape {tuple(shape)})"
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}{of}")


def kv_views(kv_cache: torch.Tensor, layout: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Return views K, V of logical shape [num_blocks, block_size, num_kv_heads, head_size].

    For ``"mla"`` returns ``(kv_cache, None)`` with shape [num_blocks, block_size, C].
    The views share storage with ``kv_cache`` (no copies).
    """
    if not isinstance(kv_cache, torch.Tensor):
        raise ValueError(f"kv_cache must be a torch.Tensor, got {type(kv_cache).__name__}")
    check_layout(layout, kv_cache.shape)
    shape = kv_cache.shape
    if layout == "vllm_packed":
        # [num_blocks, heads, block_size, 2 * head_size], any physical axis order.
        if kv_cache.dim() != 4 or shape[3] % 2 != 0:
            raise _bad(layout, kv_cache, "expected [num_blocks, heads, block_size, 2*head_size]")
        x = kv_cache.permute(0, 2, 1, 3)
        hs = shape[3] // 2
        return x[..., :hs], x[..., hs:]
    if layout == "vllm_cpu":
        # [num_blocks, heads, 2 * block_size, head_size]: per (block, head) a K half, then a V half.
        # vLLM's CPU attention kernel (its "vec"/"vec16" ISAs, checked by writing known keys through
        # cpu_attn_reshape_and_cache) keeps V token-major ([block_size, head_size]) but K transposed:
        # key (token o, dim d) sits at position d * block_size + o of the K half. The K view below
        # reads it that way, so chunks hold true per-token K (CacheBlend needs it) and any slot
        # subset round-trips exactly.
        if kv_cache.dim() != 4 or shape[2] % 2 != 0:
            raise _bad(layout, kv_cache, "expected [num_blocks, heads, 2*block_size, head_size]")
        s0, s1, s2, s3 = kv_cache.stride()
        if s2 != shape[3] * s3:
            raise _bad(layout, kv_cache, "each (block, head) half must be one dense [block_size, head_size] slab")
        bs, hs = shape[2] // 2, shape[3]
        k = kv_cache.as_strided((shape[0], bs, shape[1], hs), (s0, s3, s1, bs * s3), kv_cache.storage_offset())
        return k, kv_cache.permute(0, 2, 1, 3)[:, bs:]
    if layout == "flash_attn":
        if kv_cache.dim() != 5 or shape[0] != 2:
            raise _bad(layout, kv_cache, "expected [2, num_blocks, block_size, heads, head_size]")
        return kv_cache[0], kv_cache[1]
    if layout == "flashinfer":
        if kv_cache.dim() != 5 or shape[1] != 2:
            raise _bad(layout, kv_cache, "expected [num_blocks, 2, block_size, heads, head_size]")
        return kv_cache[:, 0], kv_cache[:, 1]
    # mla
    if kv_cache.dim() != 3:
        raise _bad(layout, kv_cache, "expected [num_blocks, block_size, C]")
    return kv_cache, None


def kv_geometry(kv_cache: torch.Tensor, layout: str) -> KVGeometry:
    k, _ = kv_views(kv_cache, layout)
    if layout == "mla":
        nb, bs, c = k.shape
        return KVGeometry(nb, bs, 1, c, True)
    nb, bs, h, hs = k.shape
    return KVGeometry(nb, bs, h, hs, False)
