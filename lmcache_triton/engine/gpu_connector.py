"""GPU connectors: move chunks between vLLM's paged KV cache and chunk tensors (MemoryObj).

They hold the geometry and call the launchers of `lmcache_triton.kernels` (Triton on CUDA tensors,
the torch reference on CPU tensors). The engine picks one from the config, as LMCache does:

- VLLMPagedMemGPUConnectorV2: all layers of a chunk in one object and one step (KV_2LTD / KV_MLA);
  the default.
- VLLMPagedMemLayerwiseGPUConnector: one object per (chunk, layer), one layer per step (KV_T2D),
  so that loading layer i+1 overlaps the forward of layer i (use_layerwise).
- VLLMBufferLayerwiseGPUConnector: layerwise into a contiguous buffer the blender reads
  (enable_blending).

The engine drives every connector the same way: `batched_from_gpu` / `batched_to_gpu` are
generators over `steps` steps; step i moves object i of every chunk (objs[step][chunk]).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from lmcache_triton.config import LMCacheEngineConfig
from lmcache_triton.kernels import LAYOUTS, PagedTarget, kv_geometry, paged_scatter_layer
from lmcache_triton.kernels.paged_copy import warm_up_host_copy
from lmcache_triton.kernels.common import to_device
from lmcache_triton.metadata import LMCacheEngineMetadata
from lmcache_triton.storage.memory import MemoryFormat, MemoryObj

Steps = Generator[None, None, None]
# CacheBlend: re-rotates a stored chunk's K in place, on the cache's device before it leaves it.
# K is `[n, hidden]` (tokens rotated at their positions in the prompt); `chunk_starts` `[n]` int64,
# on K's device, holds the position of each token's chunk start: K becomes as if its chunk had
# started at position 0.
KeyRotation = Callable[[torch.Tensor, torch.Tensor], None]


@dataclass(frozen=True)
class KVTarget:
    """A request's place in vLLM's paged cache: the per-layer tensors (layer order) and the slot
    of token `offset + i` at index i of `slot_mapping`."""

    kvcaches: Sequence[torch.Tensor]
    slot_mapping: torch.Tensor
    offset: int = 0
    # Loads only: False leaves the KV in the buffer connector's layer buffer, for the blender to
    # blend and then write into the paged cache itself.
    write_paged: bool = True

    def paged(self, layout: str) -> PagedTarget:
        """The caches and slots checked once for the kernels (a store or a load moves many chunks
        through the same target): each chunk's copy is then a slice and a launch. Index i of its
        slots is token `offset + i`."""
        cached = self.__dict__.get("_paged")
        if cached is None or cached[0] != layout:
            cached = (layout, PagedTarget.of(self.kvcaches, self.slot_mapping, layout))
            object.__setattr__(self, "_paged", cached)  # frozen: a cache of derived values only
        return cached[1]

    def slots(self, start: int, end: int) -> torch.Tensor:
        """The slots of tokens [start, end)."""
        if start < self.offset or end - self.offset > len(self.slot_mapping):
            raise ValueError(f"slot_mapping (length {len(self.slot_mapping)}, offset {self.offset}) does not "
                             f"cover tokens [{start}, {end})")
        return self.slot_mapping[start - self.offset:end - self.offset]


class GPUConnectorInterface(ABC):
    """What the engine calls: the object format and shape, how many steps a move takes, and the
    two batched moves."""

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

    @property
    @abstractmethod
    def steps(self) -> int:
        """Steps of one batched move, and objects per chunk: 1 (all layers) or num_layers (layerwise)."""

    @abstractmethod
    def get_shape(self, num_tokens: int) -> tuple[int, ...]:
        """The shape of one object of `num_tokens` tokens."""

    @abstractmethod
    def batched_from_gpu(self, objs: Sequence[Sequence[MemoryObj]], starts: Sequence[int], ends: Sequence[int],
                         target: KVTarget) -> Steps:
        """objs[step][chunk] <- the paged cache, tokens [starts[chunk], ends[chunk]); one step per next()."""

    @abstractmethod
    def batched_to_gpu(self, objs: Sequence[Sequence[MemoryObj]], starts: Sequence[int], ends: Sequence[int],
                       target: KVTarget) -> Steps:
        """objs[step][chunk] -> the paged cache; one step per next()."""

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


def _paged_only(target: KVTarget) -> None:
    if not target.write_paged:
        raise ValueError("write_paged=False (load into a layer buffer only) needs the buffer connector "
                         "(config enable_blending)")


# A pinned host chunk at least this large moves through a device buffer and one DMA (staged);
# smaller ones (partial chunks, small models) the kernel reads or writes over PCIe (zero-copy).
# vLLM measured DMA ahead end to end above ~28 KiB per block; a zero-copy kernel on a 32 MiB chunk
# fills every SM with programs waiting on PCIe for ~0.65 ms and slows the model's compute beside it.
STAGE_MIN_BYTES = 1 << 20


class _Staging:
    """Two device buffers and a copy stream per device: chunk i is gathered into buffer i % 2 on
    the current stream while the DMA of chunk i - 1 runs on the copy stream (and the other way
    round for loads). Events order each buffer's reuse; the current stream is ordered after the
    last DMA, so the caller's one sync covers them all."""

    def __init__(self) -> None:
        self._buffers: dict[torch.device, list[torch.Tensor]] = {}
        self._streams: dict[torch.device, torch.cuda.Stream] = {}

    def applies(self, obj: MemoryObj, kvcaches: Sequence[torch.Tensor]) -> bool:
        t = obj.tensor
        return kvcaches[0].is_cuda and t.device.type == "cpu" and t.nbytes >= STAGE_MIN_BYTES and t.is_pinned()

    def _ring(self, device: torch.device, nbytes: int) -> tuple[list[torch.Tensor], torch.cuda.Stream]:
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = torch.cuda.Stream(device=device)
        ring = self._buffers.get(device)
        if ring is None or ring[0].numel() < nbytes:
            if ring is not None:
                for old in ring:  # the allocator must not hand them out while a DMA still reads them
                    old.record_stream(stream)
            ring = self._buffers[device] = [torch.empty(nbytes, dtype=torch.uint8, device=device) for _ in range(2)]
        return ring, stream

    @staticmethod
    def _view(buf: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        return buf[:like.nbytes].view(like.dtype).view(like.shape)

    def gather(self, chunks: list[tuple[MemoryObj, int, int]], paged: PagedTarget) -> None:
        """obj <- the paged cache, tokens [start, end) of `paged`'s slots, for every (obj, start,
        end): a kernel into a device buffer, then one DMA to the pinned object."""
        device = paged.layers.device
        ring, stream = self._ring(device, max(obj.tensor.nbytes for obj, _, _ in chunks))
        current = torch.cuda.current_stream(device)
        copied: list[torch.cuda.Event | None] = [None, None]
        for i, (obj, start, end) in enumerate(chunks):
            if copied[i % 2] is not None:
                current.wait_event(copied[i % 2])  # that buffer's previous DMA has read it
            staged = self._view(ring[i % 2], obj.tensor)
            paged.gather(start, end, staged)
            stream.wait_stream(current)
            with torch.cuda.stream(stream):
                obj.tensor.copy_(staged, non_blocking=True)
                copied[i % 2] = torch.cuda.Event()
                copied[i % 2].record(stream)
        current.wait_stream(stream)

    def scatter(self, chunks: list[tuple[MemoryObj, int, int]], paged: PagedTarget) -> None:
        """The paged cache at tokens [start, end) of `paged`'s slots <- obj, for every (obj,
        start, end): one DMA from the pinned object into a device buffer, then a kernel from it."""
        device = paged.layers.device
        ring, stream = self._ring(device, max(obj.tensor.nbytes for obj, _, _ in chunks))
        current = torch.cuda.current_stream(device)
        scattered: list[torch.cuda.Event | None] = [None, None]
        stream.wait_stream(current)  # buffers last used by an earlier call's kernels
        for i, (obj, start, end) in enumerate(chunks):
            staged = self._view(ring[i % 2], obj.tensor)
            with torch.cuda.stream(stream):
                if scattered[i % 2] is not None:
                    stream.wait_event(scattered[i % 2])  # that buffer's previous kernel has read it
                staged.copy_(obj.tensor, non_blocking=True)
                landed = torch.cuda.Event()
                landed.record(stream)
            current.wait_event(landed)
            paged.scatter(start, end, staged)
            scattered[i % 2] = torch.cuda.Event()
            scattered[i % 2].record(current)


class VLLMPagedMemGPUConnectorV2(GPUConnectorInterface):
    """All layers of a chunk per object and step: KV_2LTD `[2, L, T, hidden]`, or KV_MLA `[1, L, T, C]`.
    On a GPU, full chunks in pinned host memory are staged (`_Staging`), smaller ones zero-copy."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self.fmt = MemoryFormat.KV_MLA if self.use_mla else MemoryFormat.KV_2LTD
        self._staging = _Staging()

    @property
    def steps(self) -> int:
        return 1

    def get_shape(self, num_tokens: int) -> tuple[int, ...]:
        return (self.kv_count, self.num_layers, num_tokens, self.hidden_dim_size)

    def from_gpu(self, memory_obj: MemoryObj, start: int, end: int, *, kvcaches: Sequence[torch.Tensor],
                 slot_mapping: torch.Tensor, offset: int = 0) -> None:
        """One chunk <- the paged cache (LMCache's single-chunk call)."""
        _drain(self.batched_from_gpu([[memory_obj]], [start], [end], KVTarget(kvcaches, slot_mapping, offset)))

    def to_gpu(self, memory_obj: MemoryObj, start: int, end: int, *, kvcaches: Sequence[torch.Tensor],
               slot_mapping: torch.Tensor, offset: int = 0) -> None:
        """One chunk -> the paged cache (LMCache's single-chunk call)."""
        _drain(self.batched_to_gpu([[memory_obj]], [start], [end], KVTarget(kvcaches, slot_mapping, offset)))

    def _split(self, objs: Sequence[MemoryObj], starts: Sequence[int], ends: Sequence[int], target: KVTarget):
        """(staged, direct) lists of (obj, start, end), as indices into the target's slots."""
        staged, direct = [], []
        for obj, start, end in zip(objs, starts, ends, strict=True):
            chunk = (obj, start - target.offset, end - target.offset)
            (staged if self._staging.applies(obj, target.kvcaches) else direct).append(chunk)
        return staged, direct

    def batched_from_gpu(self, objs: Sequence[Sequence[MemoryObj]], starts: Sequence[int], ends: Sequence[int],
                         target: KVTarget) -> Steps:
        paged = target.paged(self.layout)
        staged, direct = self._split(objs[0], starts, ends, target)
        paged.gather_many([(start, end) for _, start, end in direct], [obj.tensor for obj, _, _ in direct])
        if staged:
            self._staging.gather(staged, paged)
        yield

    def batched_to_gpu(self, objs: Sequence[Sequence[MemoryObj]], starts: Sequence[int], ends: Sequence[int],
                       target: KVTarget) -> Steps:
        _paged_only(target)
        paged = target.paged(self.layout)
        staged, direct = self._split(objs[0], starts, ends, target)
        paged.scatter_many([(start, end) for _, start, end in direct], [obj.tensor for obj, _, _ in direct])
        if staged:
            self._staging.scatter(staged, paged)
        yield


def _drain(steps: Steps) -> None:
    for _ in steps:
        pass


def _runs(objs: Sequence[MemoryObj], spans: Sequence[tuple[int, int]]
          ) -> Generator[tuple[torch.Tensor, int, int], None, None]:
    """(tensor, start, end) per run of per-layer objects that lie side by side in memory and hold
    consecutive tokens: one view over the run, so one launch moves it. The engine allocates a
    step's objects one after another, so a request's chunks usually form one run: an 8K-token
    layerwise store is then one launch per layer, not one per chunk and layer (32 vs 1024)."""
    run: list[tuple[MemoryObj, int, int]] = []

    def view() -> tuple[torch.Tensor, int, int]:
        first = run[0][0].tensor
        if len(run) == 1:
            return first, run[0][1], run[0][2]
        rows = run[-1][2] - run[0][1]
        return first.as_strided((rows, *first.shape[1:]), first.stride()), run[0][1], run[-1][2]

    for obj, (start, end) in zip(objs, spans, strict=True):
        t = obj.tensor
        if run:
            prev, _, prev_end = run[-1]
            p = prev.tensor
            adjacent = (prev_end == start and t.is_contiguous() and p.is_contiguous() and t.dtype == p.dtype
                        and t.device == p.device and t.shape[1:] == p.shape[1:]
                        and t.untyped_storage().data_ptr() == p.untyped_storage().data_ptr()
                        and t.data_ptr() == p.data_ptr() + p.nbytes)
            if not adjacent:
                yield view()
                run = []
        run.append((obj, start, end))
    if run:
        yield view()


class _ChunkStarts:
    """Per token of a run of chunks, the prompt position of its chunk's first token, on the cache's
    device: made once per run of a store (from the host, without a wait) and reused by every layer."""

    def __init__(self, spans: Sequence[tuple[int, int]], offset: int, device: torch.device) -> None:
        self.spans, self.offset, self.device = spans, offset, device
        self._made: dict[tuple[int, int], torch.Tensor] = {}

    def __call__(self, start: int, end: int) -> torch.Tensor:
        made = self._made.get((start, end))
        if made is None:
            inside = [(s, e) for s, e in self.spans if start <= s and e <= end]
            host = torch.cat([torch.full((e - s,), s + self.offset, dtype=torch.int64) for s, e in inside])
            made = self._made[(start, end)] = to_device(host, self.device)
        return made


class VLLMPagedMemLayerwiseGPUConnector(GPUConnectorInterface):
    """One layer per step, KV_T2D `[T, 2, hidden]` (MLA: `[T, C]`) objects, one per (layer, chunk).

    `batched_from_gpu` / `batched_to_gpu` are generators: each `next()` moves one layer of every
    chunk of the request and returns, so the caller interleaves them with the model's layers.

    On CUDA the copies run on a side stream of the connector, one event per layer: step i queues
    layer i (if not yet queued) and, when loading, layer i+1, then makes the *current* stream wait on layer i's
    event, a device-side dependency, not a host sync. So the load of layer i+1 runs while the
    forward of layer i computes, and anything the caller queues after step i (the next layer's
    attention, or a current-stream synchronize before handing a stored chunk to storage) sees the
    bytes of layer i. On CPU every step copies synchronously, as before.
    """

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self.fmt = MemoryFormat.KV_MLA if self.use_mla else MemoryFormat.KV_T2D
        self._streams: dict[torch.device, torch.cuda.Stream] = {}

    @property
    def steps(self) -> int:
        return self.num_layers

    def get_shape(self, num_tokens: int) -> tuple[int, ...]:
        if self.use_mla:
            return (num_tokens, self.hidden_dim_size)
        return (num_tokens, 2, self.hidden_dim_size)

    def _side_stream(self, kvcaches: Sequence[torch.Tensor]) -> torch.cuda.Stream | None:
        dev = kvcaches[0].device
        if dev.type != "cuda":
            return None
        stream = self._streams.get(dev)
        if stream is None:
            stream = self._streams[dev] = torch.cuda.Stream(device=dev)
        return stream

    def _layered(self, num_layers: int, kvcaches: Sequence[torch.Tensor],
                 move_layer: Callable[[int], None], tensors: Callable[[int], Sequence[torch.Tensor]],
                 ahead: int) -> Generator[None, None, None]:
        """Run move_layer(0..num_layers-1), one per step; on CUDA on the side stream, `ahead`
        layers ahead. Loads (ahead=1): the current stream waits for layer i's copy at step i (its
        attention reads it). Stores (ahead=0: layer i+1 is not computed at step i): nothing waits
        per layer, so each layer's copy to the host overlaps the next layers' forward; the
        current stream is ordered after all of them once, at the end (the caller's one sync)."""
        stream = self._side_stream(kvcaches)
        if stream is None:
            for layer in range(num_layers):
                move_layer(layer)
                yield
            return
        current = torch.cuda.current_stream(stream.device)
        events: list[torch.cuda.Event] = []

        def queue(layer: int) -> None:
            # Ordered after everything the caller queued so far (the forward that wrote this
            # layer, a flush of the buffer slot this layer reuses).
            stream.wait_stream(current)
            with torch.cuda.stream(stream):
                move_layer(layer)
                for t in tensors(layer):
                    if t.is_cuda:  # the caching allocator must not hand it out before we are done
                        t.record_stream(stream)
                events.append(torch.cuda.Event())
                events[-1].record(stream)

        try:
            for layer in range(num_layers):
                while len(events) <= min(layer + ahead, num_layers - 1):
                    queue(len(events))
                if ahead:
                    current.wait_event(events[layer])
                yield
        finally:
            # The stores' copies, and when closed early or failed a load's layer queued ahead, may
            # still be reading or writing objects whose holds the caller is about to release. Order
            # the current stream after every queued layer (on the device, no host wait), so the
            # caller's one sync of the current stream covers them.
            for event in events:
                current.wait_event(event)

    def batched_from_gpu(self, objs: Sequence[Sequence[MemoryObj]], starts: Sequence[int], ends: Sequence[int],
                         target: KVTarget, key_rotation: KeyRotation | None = None) -> Steps:
        """On a GPU each layer is gathered into a device buffer, then copied to the host object by
        one DMA; with `key_rotation` (CacheBlend) its K is re-rotated in that buffer first (on a
        CPU cache, gathered into the object and rotated in place)."""
        if key_rotation is not None and self.use_mla:
            raise ValueError("key_rotation (CacheBlend) needs a non-MLA connector: MLA has no separate K")
        paged = target.paged(self.layout)
        spans = [(start - target.offset, end - target.offset) for start, end in zip(starts, ends, strict=True)]
        chunk_starts = _ChunkStarts(spans, target.offset, paged.layers.device)

        def move(layer: int) -> None:
            one = paged.layer(layer)
            for tensor, start, end in _runs(objs[layer], spans):
                # A host object is staged: kernel into a device buffer (allocated on this side
                # stream), then one DMA. Written over PCIe by the kernel instead (zero-copy), the
                # copy holds SMs the forward beside it needs: 1.15x on the layer GEMMs of
                # `bench.gpu_check` layerwise_overlap (H200), GEMMs beside zero-copy saves 1.31x,
                # beside staged ones 0.96x (compute_slowdown).
                on_device = tensor if tensor.device == paged.layers.device else torch.empty(
                    tensor.shape, dtype=tensor.dtype, device=paged.layers.device)
                one.gather(start, end, on_device)
                if key_rotation is not None:
                    key_rotation(on_device[:, 0], chunk_starts(start, end))
                if on_device is not tensor:
                    tensor.copy_(on_device, non_blocking=True)

        yield from self._layered(len(objs), target.kvcaches, move,
                                 lambda layer: [o.tensor for o in objs[layer]], ahead=0)

    def batched_to_gpu(self, objs: Sequence[Sequence[MemoryObj]], starts: Sequence[int], ends: Sequence[int],
                       target: KVTarget) -> Steps:
        _paged_only(target)
        paged = target.paged(self.layout)
        spans = [(start - target.offset, end - target.offset) for start, end in zip(starts, ends, strict=True)]

        def move(layer: int) -> None:
            one = paged.layer(layer)
            for tensor, start, end in _runs(objs[layer], spans):
                # Staged like the stores (one DMA into a device buffer on this side stream, then the
                # kernel from it): a kernel reading over PCIe holds SMs the forward needs.
                on_device = tensor.to(paged.layers.device, non_blocking=True)
                one.scatter(start, end, on_device)

        yield from self._layered(len(objs), target.kvcaches, move,
                                 lambda layer: [o.tensor for o in objs[layer]], ahead=1)


class VLLMBufferLayerwiseGPUConnector(VLLMPagedMemLayerwiseGPUConnector):
    """Layerwise loads into a contiguous device buffer that the blender reads and modifies.

    `batched_to_gpu` step i puts layer i of the request's chunks, in token order, into a buffer
    `[2, T, hidden]` (MLA `[1, T, C]`), T = ends[-1] - starts[0] (buffer row j is token
    starts[0] + j, see `buffer_start`). `get_layer_buffer(layer)` returns it; `flush_layer_to_paged`
    writes it into the paged cache with `paged_scatter_layer`. With `KVTarget.write_paged` (the
    default) each step also flushes, so `engine.retrieve` keeps its meaning (returned tokens are
    in the paged cache); the blender loads with write_paged=False and flushes after blending.

    The buffers are a ring of `num_buffers` layers (default 3: at step i layer i+1 is already being
    loaded and layer i-1 may still be flushing), reused across requests and grown as needed, so a
    layer's buffer is valid until step `layer + num_buffers - 1`. Store (`batched_from_gpu`) is the
    layerwise connector's.
    """

    def __init__(self, *, num_buffers: int = 3, **kw: Any) -> None:
        super().__init__(**kw)
        if num_buffers < 3:
            raise ValueError(f"num_buffers must be >= 3 (loads run one layer ahead), got {num_buffers}")
        self.num_buffers = num_buffers
        self._buffer: torch.Tensor | None = None      # [num_buffers, kv, capacity, hidden]
        self._num_tokens = 0
        self._resident: list[int | None] = [None] * num_buffers
        self.buffer_start = 0
        self.loaded_ranges: list[tuple[int, int]] = []

    def ensure_buffer(self, num_tokens: int, device: torch.device) -> torch.Tensor:
        """The ring of layer buffers, grown (doubling) to hold `num_tokens`; reused otherwise."""
        buf = self._buffer
        if buf is None or buf.shape[2] < num_tokens or buf.device != device:
            cap = max(num_tokens, 2 * buf.shape[2] if buf is not None and buf.device == device else 0)
            buf = self._buffer = torch.empty((self.num_buffers, self.kv_count, cap, self.hidden_dim_size),
                                             dtype=self.dtype, device=device)
        return buf

    def get_layer_buffer(self, layer: int) -> torch.Tensor:
        """Layer `layer` of the last load: `[2, T, hidden]` (MLA `[1, T, C]`), a view of the ring."""
        slot = layer % self.num_buffers
        if self._buffer is None or self._resident[slot] != layer:
            raise ValueError(f"layer {layer} is not in the buffer (resident layers: "
                             f"{sorted(x for x in self._resident if x is not None)})")
        return self._buffer[slot, :, : self._num_tokens]

    def flush_layer_to_paged(self, layer: int, slot_mapping: torch.Tensor,
                             kvcaches: Sequence[torch.Tensor]) -> None:
        """Buffer of `layer` -> paged cache at `slot_mapping` (one slot per buffer token, -1 skips)."""
        buf = self.get_layer_buffer(layer)
        if not isinstance(slot_mapping, torch.Tensor) or slot_mapping.dim() != 1 or len(slot_mapping) != buf.shape[1]:
            raise ValueError(f"slot_mapping must be a 1-D tensor of {buf.shape[1]} slots (the buffer's tokens), "
                             f"got {getattr(slot_mapping, 'shape', type(slot_mapping).__name__)}")
        if not 0 <= layer < len(kvcaches):
            raise ValueError(f"layer {layer} out of range for kvcaches of {len(kvcaches)} layers")
        chunk = buf[0] if self.use_mla else buf.permute(1, 0, 2)  # KV_T2D view [T, 2, hidden]
        paged_scatter_layer(chunk, kvcaches[layer], slot_mapping, self.layout)

    def batched_to_gpu(self, objs: Sequence[Sequence[MemoryObj]], starts: Sequence[int], ends: Sequence[int],
                       target: KVTarget) -> Steps:
        """objs[layer][chunk] -> the layer buffer (and, with target.write_paged, the paged cache),
        one layer per step."""
        kvcaches = target.kvcaches
        parts = [target.slots(start, end) for start, end in zip(starts, ends, strict=True)]
        first = starts[0] if len(starts) else 0
        num_tokens = (ends[-1] - first) if len(ends) else 0
        buf = self.ensure_buffer(num_tokens, kvcaches[0].device)
        self._num_tokens, self.buffer_start = num_tokens, first
        self.loaded_ranges = list(zip(starts, ends))  # the blender's cached rows; gaps stay uncached
        self._resident = [None] * self.num_buffers
        all_slots = torch.cat(parts) if parts else None

        def move(layer: int) -> None:
            slot = layer % self.num_buffers
            dst = buf[slot]
            for obj, start, end in zip(objs[layer], starts, ends, strict=True):
                # From the contiguous (pinned) object into a permuted view of the device buffer:
                # one DMA, then a device-side permute. The other way round (a permuted view of
                # the host object as the source), PyTorch first makes a pageable host copy of it.
                rows = dst[:, start - first:end - first]
                (rows[0] if self.use_mla else rows.permute(1, 0, 2)).copy_(obj.tensor, non_blocking=True)
            self._resident[slot] = layer
            if target.write_paged and all_slots is not None and len(all_slots) == num_tokens:
                self.flush_layer_to_paged(layer, all_slots, kvcaches)

        extra = [buf] if all_slots is None else [buf, all_slots]  # all_slots: made on the current stream
        yield from self._layered(len(objs), kvcaches, move,
                                 lambda layer: [*extra, *(o.tensor for o in objs[layer])], ahead=1)


def create_gpu_connector(config: LMCacheEngineConfig, metadata: LMCacheEngineMetadata, layout: str,
                         device: torch.device | str | None = None) -> GPUConnectorInterface:
    """The connector LMCache would pick for this config: the buffer connector when enable_blending
    (which requires use_layerwise), layerwise when use_layerwise, else all layers at once."""
    if config.enable_blending:
        if not config.use_layerwise:
            raise ValueError("enable_blending requires use_layerwise")
        cls: type[GPUConnectorInterface] = VLLMBufferLayerwiseGPUConnector
    elif config.use_layerwise:
        cls = VLLMPagedMemLayerwiseGPUConnector
    else:
        cls = VLLMPagedMemGPUConnectorV2
    if torch.device(device).type == "cpu" if device is not None else not torch.cuda.is_available():
        warm_up_host_copy()  # the CPU copy compiled now, with the engine, not on its first store
    return cls(hidden_dim_size=metadata.hidden_dim_size, num_layers=metadata.num_layers,
               chunk_size=config.chunk_size, dtype=metadata.kv_dtype, layout=layout,
               use_mla=metadata.use_mla, device=device)
