"""CacheBlend: reuse the KV of segments that are not a prefix, recomputing only the tokens whose KV
deviates most (Yao et al., "CacheBlend", EuroSys'25; LMCache's `lmcache/v1/compute/blend/`).

Per layer l, for a prompt of T tokens whose cached segments were each computed alone:

1. Load layer l's cached KV `[2, T, kv_hidden]` (rows of uncached tokens, e.g. separators, are
   don't-care) from a `KVSource`.
2. From the first check layer on, re-rotate cached K from the positions it was computed at to the
   positions in this prompt (`rope_rerotate`, in place). Before it, cached KV is never read.
3. Fresh q/k/v for the rows being recomputed. Before the first check layer that is every row (as
   LMCache: the first layers are cheap and give the deviation its meaning).
4. At a check layer (`blend_check_layers`, default [1]): `kv_deviation` between fresh and cached K
   over the rows being recomputed; keep the rows that must be recomputed, uncached tokens (nothing
   to reuse) and the last token (its hidden state gives the logits), plus the `blend_recompute_ratios[i]`
   share of the rows being recomputed taken from the other rows of largest deviation
   (`top_deviation_rows`). Only those rows' hidden states go on.
5. `selective_write` the fresh K/V of the recomputed rows over the cached rows; attention of the
   recomputed rows reads this blended KV, which is also what the source writes back (vLLM's paged
   cache), so decoding sees the same KV the prefill attended to.

Ratio 1.0 recomputes every row at every layer, i.e. a full prefill. A ratio applies to the rows
still being recomputed at its check layer (several check layers narrow the set step by step).
Stored segment KV is kept as if the segment started at position 0 (see `segment_positions`).

Nothing in a layer waits for the device: every size is known on the host (the rows that must be
recomputed are counted once, from the host mask of cached rows, and never leave the set), and no
check reads a GPU tensor's values. What the host hands over (tokens, the mask, positions) goes to
the device from pinned memory without waiting. (`tests/blend/test_host_syncs.py` counts them.)
"""

from __future__ import annotations

import threading
from collections.abc import Generator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from lmcache_triton.blend.llama import as_layerwise
from lmcache_triton.blend.model import LayerwiseModel
from lmcache_triton.kernels import (kv_deviation, num_recompute_tokens, paged_scatter_layer, rope_rerotate,
                                    selective_write, top_deviation_rows)
from lmcache_triton.kernels.common import to_device


class KVSource(Protocol):
    """Per-layer cached KV of one prompt, handed to the blender layer by layer (layer 0 first)."""

    def layer_kv(self, layer: int) -> torch.Tensor:
        """`[2, T, num_kv_heads * head_size]`, writable: the blender blends into it in place."""
        ...

    def layer_done(self, layer: int, kv: torch.Tensor) -> None:
        """`kv` now holds layer `layer`'s blended KV (write it back, keep it, or ignore it)."""
        ...


@dataclass
class TensorKVSource:
    """Cached KV given as tensors, one `[2, T, kv_hidden]` per layer (copied: the caller's stay intact)."""

    kv: list[torch.Tensor]

    def __post_init__(self) -> None:
        self.kv = [t.clone() for t in self.kv]

    def layer_kv(self, layer: int) -> torch.Tensor:
        return self.kv[layer]

    def layer_done(self, layer: int, kv: torch.Tensor) -> None:
        pass


class RetrieverKVSource:
    """The engine's layerwise retrieve into `VLLMBufferLayerwiseGPUConnector`, for vLLM's worker.

    Layer l's buffer covers tokens [buffer_start, buffer_start + n) of the prompt; it is copied
    into a prompt-wide `[2, T, kv_hidden]` tensor (separators and tokens outside any hit segment stay
    uncached), and after blending that tensor is scattered into vLLM's paged cache at `slot_mapping`
    (all T tokens: recomputed rows included, so the paged cache holds the blended KV).
    The retrieve runs with `write_paged=False`: nothing unblended reaches the paged cache.
    """

    def __init__(self, engine: Any, connector: Any, tokens: torch.Tensor, *, kvcaches: Sequence[torch.Tensor],
                 slot_mapping: torch.Tensor, device: torch.device, **retrieve_kwargs: Any) -> None:
        self.connector, self.kvcaches, self.slot_mapping = connector, kvcaches, slot_mapping
        self.num_tokens = len(tokens)
        self._retriever = engine.retrieve_layer(tokens, write_paged=False, kvcaches=kvcaches,
                                                slot_mapping=slot_mapping, **retrieve_kwargs)
        self._kv = torch.zeros((2, self.num_tokens, connector.hidden_dim_size), dtype=connector.dtype, device=device)
        self._primed = False
        self.ret_mask: torch.Tensor | None = None

    def prime(self) -> list[tuple[int, int]]:
        """Runs the retriever's first step (lookup + load of layer 0); returns the loaded [start, end) ranges."""
        next(self._retriever)
        self._primed = True
        ranges = getattr(self.connector, "loaded_ranges", None)
        if ranges is None:
            raise RuntimeError("blending needs the buffer connector to record `loaded_ranges` "
                               "(the [start, end) of each loaded chunk) in batched_to_gpu")
        return list(ranges)

    def layer_kv(self, layer: int) -> torch.Tensor:
        if layer > 0 or not self._primed:
            next(self._retriever)  # loads layer `layer` into the connector's ring buffer
        buf = self.connector.get_layer_buffer(layer)
        start = self.connector.buffer_start
        self._kv[:, start:start + buf.shape[1]].copy_(buf)
        return self._kv

    def layer_done(self, layer: int, kv: torch.Tensor) -> None:
        paged_scatter_layer(kv.permute(1, 0, 2), self.kvcaches[layer], self.slot_mapping, self.connector.layout)

    def finish(self) -> None:
        """Drains the retriever: releases the storage holds and records the hit in the stats; its
        return value is the mask of loaded tokens."""
        self.ret_mask = _result_of(self._retriever)


def _result_of(steps: Generator) -> Any:
    """Runs a generator of steps to its end and returns its return value."""
    while True:
        try:
            next(steps)
        except StopIteration as stop:
            return stop.value


def segment_positions(num_tokens: int, ranges: Sequence[tuple[int, int]], device: torch.device | str = "cpu"
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """(cached_mask, cached_positions) for segments [start, end) each stored as if starting at position 0.
    Built on the host and sent without a wait (the blender reads the mask's values on the host)."""
    mask = torch.zeros(num_tokens, dtype=torch.bool)
    pos = torch.zeros(num_tokens, dtype=torch.int64)
    for s, e in ranges:
        mask[s:e] = True
        pos[s:e] = torch.arange(e - s)
    device = torch.device(device)
    return to_device(mask, device), to_device(pos, device)


@dataclass
class BlendResult:
    kv: list[torch.Tensor]          # per layer [2, T, kv_hidden], blended, K rotated at the prompt's positions
    hidden: torch.Tensor            # [hidden_size] the last token after the final norm
    logits: torch.Tensor            # [vocab] the last token's logits
    recompute_indices: torch.Tensor  # int64 rows recomputed after the last check layer
    num_layers_full: int = 0        # layers computed for every token (before the first check layer)
    layer_rows: list[int] = field(default_factory=list)  # rows recomputed per layer


def _must_recompute(cached_mask: torch.Tensor, num_tokens: int) -> tuple[torch.Tensor, int]:
    """(bool [T] on the host, its count): the rows recomputed whatever their deviation, uncached
    rows and the last one. Read on the host, so that every later size is known there."""
    if not isinstance(cached_mask, torch.Tensor) or cached_mask.shape != (num_tokens,):
        raise ValueError(f"cached_mask must be a tensor of shape ({num_tokens},) (one per token), got "
                         f"{getattr(cached_mask, 'shape', type(cached_mask).__name__)}")
    host = cached_mask.to("cpu", torch.bool).numpy()  # a view, no copy, for a host mask
    must = ~host
    must[-1] = True
    return torch.from_numpy(must), int(must.sum())


class LMCBlender:
    """Blends cached segment KV with selective recompute, layer by layer, on a `LayerwiseModel`."""

    def __init__(self, model: Any, config: Any, engine: Any = None, gpu_connector: Any = None) -> None:
        self.model: LayerwiseModel = as_layerwise(model)
        self.engine, self.gpu_connector = engine, gpu_connector
        self.check_layers = sorted(set(config.blend_check_layers))
        self.ratios = list(config.blend_recompute_ratios)
        bad = [c for c in self.check_layers if c >= self.model.num_layers]
        if bad:
            raise ValueError(f"blend_check_layers {bad} out of range for a model of {self.model.num_layers} layers")
        if not self.ratios:
            raise ValueError("blend_recompute_ratios must not be empty")

    def _ratio(self, i: int) -> float:
        return self.ratios[min(i, len(self.ratios) - 1)]

    @torch.inference_mode()
    def blend_layers(self, tokens: torch.Tensor | Sequence[int], source: KVSource, *, cached_mask: torch.Tensor,
                     cached_positions: torch.Tensor | None = None, positions: torch.Tensor | None = None,
                     keep_kv: bool = True) -> Generator[None, None, BlendResult]:
        """Generator: one `next()` per layer (so vLLM can interleave it with its own per-layer calls);
        returns the `BlendResult` (StopIteration.value; `blend` drains it for you).

        `cached_mask[i]`: row i has cached KV in the source. `cached_positions[i]`: the position row
        i's cached K was rotated at (default: `positions`, i.e. no re-rotation). `positions`: this
        prompt's positions (default 0..T-1, shift it when the prompt follows a prefix vLLM holds).
        `keep_kv=False` leaves `BlendResult.kv` empty (the source already wrote the KV back).
        Give `cached_mask` in host memory: its values are read there (one wait for the device when
        it is a GPU tensor, the only one of the blend).
        """
        m = self.model
        rot = m.rotary
        device = rot.cos_sin_cache.device
        tokens = to_device(torch.as_tensor(tokens, dtype=torch.int64), device)
        T = len(tokens)
        if T == 0:
            raise ValueError("nothing to blend: no tokens")
        must, num_must = _must_recompute(cached_mask, T)
        positions = torch.arange(T, device=device) if positions is None else to_device(positions.long(), device)
        cached = to_device(cached_mask.bool(), device)
        old_pos = positions if cached_positions is None else torch.where(
            cached, to_device(cached_positions.long(), device), positions)
        must = to_device(must, device)   # over the rows being recomputed: rows[i] must stay iff must[i]
        rows = torch.arange(T, device=device)
        first_check = self.check_layers[0] if self.check_layers else m.num_layers
        hidden = m.embed(tokens)
        layer_rows: list[int] = []
        kvs: list[torch.Tensor] = []
        for layer in range(m.num_layers):
            kv = source.layer_kv(layer)
            if kv.shape[:2] != (2, T) or kv.shape[2] != m.num_kv_heads * m.head_size:
                raise ValueError(f"layer {layer}: cached KV must be [2, {T}, {m.num_kv_heads * m.head_size}], "
                                 f"got {tuple(kv.shape)}")
            K = kv[0].view(T, m.num_kv_heads, m.head_size)
            V = kv[1].view(T, m.num_kv_heads, m.head_size)
            q, k, v = m.qkv(layer, hidden, positions[rows])
            if layer >= first_check:
                rope_rerotate(K, old_pos, positions, rot.cos_sin_cache, is_neox=rot.is_neox,
                              rotary_dim=rot.rotary_dim, out=K)
            if layer in self.check_layers:
                n = len(rows)  # a size: known on the host
                dev = kv_deviation(k.to(K.dtype), K if n == T else K[rows])
                # The rows that must be recomputed come first and do not use the budget, which is for
                # cached rows that went stale (uncached rows have no KV to compare).
                budget = min(num_recompute_tokens(self._ratio(self.check_layers.index(layer)), n), n - num_must)
                keep = top_deviation_rows(dev, budget + num_must, first=must)
                rows, must, hidden, q, k, v = rows[keep], must[keep], hidden[keep], q[keep], k[keep], v[keep]
            selective_write(K, k.to(K.dtype), rows)
            selective_write(V, v.to(V.dtype), rows)
            attn = m.attention(layer, q, K.to(q.dtype), V.to(q.dtype), rows)
            hidden = m.finish_layer(layer, attn, hidden)
            source.layer_done(layer, kv)
            if keep_kv:
                kvs.append(kv)
            layer_rows.append(len(rows))
            yield
        normed, logits = m.logits(hidden[-1:])  # rows is sorted and always holds T - 1
        return BlendResult(kv=kvs, hidden=normed[0], logits=logits[0], recompute_indices=rows,
                           num_layers_full=min(first_check, m.num_layers), layer_rows=layer_rows)

    def blend(self, tokens: torch.Tensor | Sequence[int], source: KVSource, **kwargs: Any) -> BlendResult:
        """`blend_layers` run to the end."""
        return _result_of(self.blend_layers(tokens, source, **kwargs))

    def blend_request(self, tokens: torch.Tensor, *, kvcaches: Sequence[torch.Tensor], slot_mapping: torch.Tensor,
                      positions: torch.Tensor | None = None, **retrieve_kwargs: Any) -> BlendResult:
        """vLLM's worker path: layerwise retrieve of the prompt's segments from the engine into the
        buffer connector, blend, write the blended KV into the paged cache at `slot_mapping`.

        Needs the engine to key with `SegmentTokenDatabase` (segments stored at positions 0..n-1)
        and the connector to record `loaded_ranges` (the buffer connector does).
        """
        if self.engine is None or self.gpu_connector is None:
            raise RuntimeError("blend_request needs the blender built with an engine and its gpu_connector")
        device = self.model.rotary.cos_sin_cache.device
        src = RetrieverKVSource(self.engine, self.gpu_connector, tokens, kvcaches=kvcaches,
                                slot_mapping=slot_mapping, device=device, **retrieve_kwargs)
        ranges = src.prime()  # the hits are known once the retriever has looked the segments up
        cached_mask, cached_positions = segment_positions(len(tokens), ranges, device)
        try:
            return self.blend(tokens, src, cached_mask=cached_mask, cached_positions=cached_positions,
                              positions=positions, keep_kv=False)
        finally:
            src.finish()


class LMCBlenderBuilder:
    """Process-wide registry of blenders by instance id (one per vLLM worker), as LMCache's. The
    worker passes vLLM's loaded model (captured by the package's plugin) when it builds one."""

    _blenders: dict[str, LMCBlender] = {}
    _lock = threading.Lock()

    @classmethod
    def get_or_create(cls, instance_id: str, engine: Any, gpu_connector: Any, config: Any,
                      model: Any = None) -> LMCBlender:
        with cls._lock:
            blender = cls._blenders.get(instance_id)
            if blender is None:
                if model is None:  # a clear error at creation, not a crash mid-request (LMCache #4131)
                    raise RuntimeError(f"blending instance {instance_id!r} needs the loaded model: pass model=")
                blender = cls._blenders[instance_id] = LMCBlender(model, config, engine, gpu_connector)
            return blender

    @classmethod
    def get(cls, instance_id: str) -> LMCBlender | None:
        with cls._lock:
            return cls._blenders.get(instance_id)

    @classmethod
    def destroy(cls, instance_id: str) -> None:
        with cls._lock:
            cls._blenders.pop(instance_id, None)
