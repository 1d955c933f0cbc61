"""vLLM's paged KV cache as the worker side's parts see it: the engine that moves chunks in and out
of it, its per-layer tensors, and which of a request's tokens have a slot there.

Imports no vLLM: the worker side's parts run (and are tested) without it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from lmcache_triton.kernels.common import to_device

if TYPE_CHECKING:
    from lmcache_triton.integration.vllm.specs import ReqMeta


def adapt_kv_caches(tensors: list[torch.Tensor], *, use_mla: bool, cpu_backend: bool) -> tuple[str, list[torch.Tensor]]:
    """vLLM's per-layer tensors -> (layout name, tensors the kernels read)."""
    t = tensors[0]
    if use_mla:
        if t.dim() != 3:
            raise ValueError(f"MLA KV cache must be [num_blocks, block_size, C], got shape {tuple(t.shape)}")
        return "mla", tensors
    if t.dim() == 5:
        if t.shape[0] == 2:
            return "flash_attn", tensors
        if t.shape[1] == 2:
            return "flashinfer", tensors
    if t.dim() == 4:
        if cpu_backend:
            # Same bytes, the CPU kernel's meaning: per (block, head) block_size rows of K, then of V.
            nb, h, bs, c = t.shape
            return "vllm_cpu", [x.view(nb, h, 2 * bs, c // 2) for x in tensors]
        return "vllm_packed", tensors
    raise ValueError(f"unknown vLLM KV cache layout: per-layer shape {tuple(t.shape)}, strides {t.stride()}")


def valid_slots(slot_mapping: torch.Tensor) -> int:
    """How many leading tokens have a slot (the scheduler pads with -1 where blocks ran out)."""
    bad = (slot_mapping < 0).nonzero()
    return int(bad[0]) if len(bad) else len(slot_mapping)


def tokens_with_slots(req: ReqMeta) -> int:
    """The end of the request's tokens that have a slot this step: none behind a missing one."""
    return min(req.num_tokens, req.token_offset + valid_slots(req.slot_mapping))


@dataclass
class PagedKV:
    """The engine (None until vLLM registers its caches, and after close) and vLLM's per-layer KV
    tensors, shared by every part of the worker side."""

    engine: Any = None
    kvcaches: list[torch.Tensor] = field(default_factory=list)

    def device_slots(self, slots: torch.Tensor) -> torch.Tensor:
        """A request's slots on the cache's device without a host wait: a pageable host tensor's
        copy to a GPU blocks the host until it lands (once per request, and inside save_kv_layer);
        from pinned memory it is queued on the stream like the kernels that read it."""
        return to_device(slots, self.kvcaches[0].device)

    def move_args(self, req: ReqMeta, start: int, end: int) -> tuple[list[int] | int, dict]:
        """(tokens, keyword arguments) of an engine call over the request's tokens [start, end):
        its key scope, the paged cache and the slots of those tokens (the first at `offset`)."""
        tokens, scope = req.engine_tokens(start, end)
        return tokens, dict(kvcaches=self.kvcaches, slot_mapping=self.device_slots(req.slots(start, end)),
                            offset=start, **scope)

    def defer_prefault(self, seconds: float) -> None:
        manager = getattr(self.engine, "storage_manager", None)
        if manager is not None:
            manager.defer_prefault(seconds)
