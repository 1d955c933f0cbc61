"""GPU connectors: move one chunk between vLLM's paged KV cache and a chunk tensor (MemoryObj).

They hold the geometry and call the launchers of `lmcache_triton.kernels` (Triton on CUDA tensors,
the torch reference on CPU tensors). The engine picks one from the config, as LMCache does:

- VLLMPagedMemGPUConnectorV2: all layers of a chunk in one launch (KV_2LTD / KV_MLA); the default.
- VLLMPagedMemLayerwiseGPUConnector: one layer per generator step (KV_T2D), so that loading layer
  i+1 overlaps the forward of layer i (use_layerwise).
- VLLMBufferLayerwiseGPUConnector: layerwise into a contiguous buffer the blender reads
  (enable_blending).

Every call takes the kwargs the engine passes through: `kvcaches` (vLLM's per-layer tensors, in
layer order), `slot_mapping` (slot of token `offset + i` at index i) and `offset` (default 0).
"""

from __future__ import annotations

from collections.abc import Generator, Sequence
from typing import Any

import torch

from lmcache_triton.config import LMCacheEngineConfig
from lmcache_triton.kernels import (
    LAYOUTS,
    kv_geometry,
    paged_gather,
    paged_gather_layer,
    paged_scatter,
    paged_scatter_layer,
)
from lmcache_triton.memory import MemoryFormat, MemoryObj
from lmcache_triton.metadata import LMCacheEngineMetadata


def _kwargs(kwargs: dict[str, Any], start: int, end: int) -> tuple[Sequence[torch.Tensor], torch.Tensor]:
    try:
        kvcaches = kwargs["kvcaches"]
        slot_mapping = kwargs["slot_mapping"]
    except KeyError as e:
        raise ValueError(f"GPU connector needs the keyword argument {e.args[0]!r}") from None
    offset = int(kwargs.get("offset", 0))
    if start < offset or end - offset > len(slot_mapping):
        raise ValueError(
            f"slot_mapping (length {len(slot_mapping)}, offset {offset}) does not cover tokens [{start}, {end})"
        )
    return kvcaches, slot_mapping[start - offset:end - offset]


class GPUConnectorInterface:
    fmt: MemoryFormat

    def __init__(self, *, hidden_dim_size: int, num_layers: int, chunk_size: int, dtype: torch.dtype,
                 layout: str, use_mla: bool = False, device: torch.device | str | None = None) -> None:
        if layout not in LAYOUTS:
            raise ValueError(f"unknown KV layout {layout!r}; expected one of {', '.join(LAYOUTS)}")
        if use_mla != (layout == "mla"):
            raise ValueError(f"layout {layout!r} does not fit use_mla={use_mla}: MLA models use layout 'mla'")
        self.hidden_dim_size = hidden_dim_size
        self.num_layers = num_layers
        self.chunk_size = chunk_size
        self.dtype = dtype
        self.layout = layout
        self.use_mla = use_mla
        self.device = torch.device(device) if device is not None else None

    @property
    def kv_count(self) -> int:
        return 1 if self.use_mla else 2

    def check_caches(self, kvcaches: Sequence[torch.Tensor]) -> None:
        """Validates what vLLM handed over against the engine's metadata, naming what differs."""
        if len(kvcaches) != self.num_layers:
            raise ValueError(f"kvcaches has {len(kvcaches)} layers, the engine metadata says {self.num_layers}")
        # fp8 caches may be handed over as their uint8 bytes: 1-byte dtypes are interchangeable here.
        same_bytes = kvcaches[0].element_size() == self.dtype.itemsize == 1
        if kvcaches[0].dtype != self.dtype and not same_bytes:
            raise ValueError(f"kvcaches dtype {kvcaches[0].dtype} does not match the engine's kv_dtype {self.dtype}")
        geo = kv_geometry(kvcaches[0], self.layout)
        if geo.hidden != self.hidden_dim_size:
            raise ValueError(
                f"kvcaches (layout {self.layout!r}) hold {geo.hidden} elements per token per layer, "
                f"the engine metadata says {self.hidden_dim_size}"
            )
        if self.device is None:
            self.device = kvcaches[0].device


class VLLMPagedMemGPUConnectorV2(GPUConnectorInterface):
    """All layers of a chunk per call: KV_2LTD `[2, L, T, hidden]`, or KV_MLA `[1, L, T, C]`."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self.fmt = MemoryFormat.KV_MLA if self.use_mla else MemoryFormat.KV_2LTD

    def get_shape(self, num_tokens: int) -> tuple[int, ...]:
        return (self.kv_count, self.num_layers, num_tokens, self.hidden_dim_size)

    def from_gpu(self, memory_obj: MemoryObj, start: int, end: int, **kwargs: Any) -> None:
        kvcaches, slots = _kwargs(kwargs, start, end)
        paged_gather(kvcaches, slots, self.layout, out=memory_obj.tensor)

    def to_gpu(self, memory_obj: MemoryObj, start: int, end: int, **kwargs: Any) -> None:
        kvcaches, slots = _kwargs(kwargs, start, end)
        paged_scatter(memory_obj.tensor, kvcaches, slots, self.layout)


class VLLMPagedMemLayerwiseGPUConnector(GPUConnectorInterface):
    """One layer per step, KV_T2D `[T, 2, hidden]` (MLA: `[T, C]`) objects, one per (layer, chunk).

    `batched_from_gpu` / `batched_to_gpu` are generators: each `next()` moves one layer of every
    chunk of the request and returns, so the caller interleaves them with the model's layers.
    """

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self.fmt = MemoryFormat.KV_MLA if self.use_mla else MemoryFormat.KV_T2D

    def get_shape(self, num_tokens: int) -> tuple[int, ...]:
        if self.use_mla:
            return (num_tokens, self.hidden_dim_size)
        return (num_tokens, 2, self.hidden_dim_size)

    def batched_from_gpu(self, memory_objs: Sequence[Sequence[MemoryObj]], starts: Sequence[int],
                         ends: Sequence[int], **kwargs: Any) -> Generator[None, None, None]:
        """memory_objs[layer][chunk] <- layer `layer` of the paged cache, one layer per step."""
        for layer, objs in enumerate(memory_objs):
            for obj, start, end in zip(objs, starts, ends, strict=True):
                kvcaches, slots = _kwargs(kwargs, start, end)
                paged_gather_layer(kvcaches[layer], slots, self.layout, out=obj.tensor)
            yield

    def batched_to_gpu(self, memory_objs: Sequence[Sequence[MemoryObj]], starts: Sequence[int],
                       ends: Sequence[int], **kwargs: Any) -> Generator[None, None, None]:
        """memory_objs[layer][chunk] -> layer `layer` of the paged cache, one layer per step."""
        for layer, objs in enumerate(memory_objs):
            for obj, start, end in zip(objs, starts, ends, strict=True):
                kvcaches, slots = _kwargs(kwargs, start, end)
                paged_scatter_layer(obj.tensor, kvcaches[layer], slots, self.layout)
            yield


def create_gpu_connector(config: LMCacheEngineConfig, metadata: LMCacheEngineMetadata, layout: str,
                         device: torch.device | str | None = None) -> GPUConnectorInterface:
    """The connector LMCache would pick for this config: layerwise when use_layerwise (or
    enable_blending, which requires it), else all layers at once (MLA included)."""
    cls = VLLMPagedMemLayerwiseGPUConnector if config.use_layerwise else VLLMPagedMemGPUConnectorV2
    return cls(hidden_dim_size=metadata.hidden_dim_size, num_layers=metadata.num_layers,
               chunk_size=config.chunk_size, dtype=metadata.kv_dtype, layout=layout,
               use_mla=metadata.use_mla, device=device)
