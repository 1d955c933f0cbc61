"""Paged KV cache <-> chunk tensors, all layers in one Triton launch.

Grid: (cdiv(T, BLOCK_T), num_layers * num_kv, cdiv(hidden, BLOCK_D)); each program copies a
BLOCK_T x BLOCK_D tile (tokens x hidden columns) of one layer's K or V. For a chunk in pinned host
memory (zero-copy, over PCIe) the grid is capped (`zero_copy_max_programs`, `capped_grid`) and each
program loops over tiles p, p + P, ... of the axes that got fewer programs than tiles (the LOOP
variant; the full grid keeps the straight-line one).

Multi-layer addressing: the layers are separate tensors (views of one allocation in vLLM, separate
allocations in older releases). The kernel gets layer 0's K view as its pointer and an int64 tensor
of per-layer element offsets relative to it (``(data_ptr(l) - data_ptr(0)) // itemsize``). This
is plain pointer arithmetic on real addresses, so it is valid on CUDA and also works in the CPU
interpreter (which hands the kernel real host addresses), whereas int->pointer casts from a pointer
table are not portable across the two. Caveat: with TRITON_INTERPRET=1 and *CUDA* tensors the
interpreter copies only the argument storages to the host, so layers in other allocations would be
read from the wrong place; that combination is unsupported (tests set TRITON_INTERPRET only
without CUDA).

Every address is int64: program ids and loaded slots are cast, strides and offsets multiply int64
values, so caches of more than 2**31 elements work. Data is moved as the integer type of its width
(uint8/int16/int32), so copies are bit-exact for fp16, bf16, fp32, fp8 and uint8.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import triton
import triton.language as tl

from . import tuning
from .common import (Layers, as_bits, check_chunk, chunk_shape, layer_chunk_shape, on_device,
                     prepare_layers, prepare_slots, use_triton)
from .reference import as_2ltd, gather_into_ref, gather_spans_ref, scatter_from_ref, scatter_spans_ref


@triton.jit
def _copy_tile(t, lk, d, cache_ptr, layer_off_ptr, slot_ptr, slot_start, chunk_ptr, num_tokens, num_slots, kv_off,
               stride_b, stride_o, stride_h, stride_d, v_stride_b, v_stride_o, v_stride_h, v_stride_d,
               c_stride_kv, c_stride_l, c_stride_t, c_stride_c,
               BLOCK_SIZE: tl.constexpr, HEAD_SIZE: tl.constexpr, HIDDEN: tl.constexpr, NUM_KV: tl.constexpr,
               VEC: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, TO_CHUNK: tl.constexpr):
    """Copies tile (token tile t, layer x K/V lk, column tile d); all three are int64."""
    layer = lk // NUM_KV
    kv = lk % NUM_KV

    tok = t * BLOCK_T + tl.arange(0, BLOCK_T).to(tl.int64)
    slot = tl.load(slot_ptr + slot_start + tok, mask=tok < num_tokens, other=-1).to(tl.int64)
    blk = slot // BLOCK_SIZE
    off = slot % BLOCK_SIZE
    col = d * BLOCK_D + tl.arange(0, BLOCK_D).to(tl.int64)
    head = col // HEAD_SIZE
    dim = col % HEAD_SIZE
    # Masks from tensor comparisons only (the 3.9 interpreter rejects tensor & scalar bool).
    # slot >= 0 also excludes tokens past the end (loaded as -1). slot < num_slots (num_blocks *
    # block_size) is there because nothing else bounds a slot on the GPU path: the launchers check
    # the range only where it is free (a CPU slot_mapping), never with a device->host sync, and an
    # out-of-range slot would otherwise read or write whatever memory lies past the cache (the next
    # layer, another tensor). The compare is free next to the copy; such a slot is treated like
    # padding: nothing is read from or written to the cache for it, its chunk row is left untouched.
    mask = ((slot >= 0) & (slot < num_slots))[:, None] & (col < HIDDEN)[None, :]

    # VEC (checked on the host) is a common divisor of base alignment, layer offsets, kv_off, strides
    # and HEAD_SIZE: rows start VEC-aligned and columns run contiguously in groups of VEC, which lets
    # the compiler emit 16-byte accesses although the layer offsets and slots are loaded values.
    # K and V may be strided differently (vLLM's CPU backend keeps K transposed in each block);
    # kv is 0 or 1, so this picks K's or V's strides without a branch.
    stride_b = stride_b + kv * (v_stride_b - stride_b)
    stride_o = stride_o + kv * (v_stride_o - stride_o)
    stride_h = stride_h + kv * (v_stride_h - stride_h)
    stride_d = stride_d + kv * (v_stride_d - stride_d)
    row = tl.load(layer_off_ptr + layer) + kv * kv_off + blk * stride_b + off * stride_o
    row = tl.multiple_of(row, VEC)
    col_off = tl.max_contiguous(tl.multiple_of(head * stride_h + dim * stride_d, VEC), VEC)
    cache_addr = cache_ptr + row[:, None] + col_off[None, :]
    chunk_addr = (chunk_ptr + kv * c_stride_kv + layer * c_stride_l
                  + (tok * c_stride_t)[:, None] + (col * c_stride_c)[None, :])
    if TO_CHUNK:
        tl.store(chunk_addr, tl.load(cache_addr, mask=mask), mask=mask)
    else:
        tl.store(cache_addr, tl.load(chunk_addr, mask=mask), mask=mask)


@triton.jit
def _copy_tiles(cache_ptr, layer_off_ptr, slot_ptr, slot_start, chunk_ptr, num_tokens, num_slots, num_lk, kv_off,
                stride_b, stride_o, stride_h, stride_d, v_stride_b, v_stride_o, v_stride_h, v_stride_d,
                c_stride_kv, c_stride_l, c_stride_t, c_stride_c,
                BLOCK_SIZE: tl.constexpr, HEAD_SIZE: tl.constexpr, HIDDEN: tl.constexpr, NUM_KV: tl.constexpr,
                VEC: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, TO_CHUNK: tl.constexpr,
                LOOP: tl.constexpr):
    pid_t = tl.program_id(0).to(tl.int64)
    pid_lk = tl.program_id(1).to(tl.int64)
    pid_d = tl.program_id(2).to(tl.int64)
    if LOOP:
        # A capped grid (zero-copy: a chunk in pinned host memory, see `zero_copy_max_programs`):
        # program p of an axis of P programs copies tiles p, p + P, p + 2P, ... A separate variant,
        # so that the full grid of device-resident chunks keeps its straight-line kernel (no loops
        # for the compiler to pipeline, one tile per program).
        for t in range(pid_t, tl.cdiv(num_tokens, BLOCK_T), tl.num_programs(0).to(tl.int64)):
            for lk in range(pid_lk, num_lk, tl.num_programs(1).to(tl.int64)):
                for d in range(pid_d, tl.cdiv(HIDDEN, BLOCK_D), tl.num_programs(2).to(tl.int64)):
                    _copy_tile(t, lk, d, cache_ptr, layer_off_ptr, slot_ptr, slot_start, chunk_ptr, num_tokens,
                               num_slots, kv_off, stride_b, stride_o, stride_h, stride_d,
                               v_stride_b, v_stride_o, v_stride_h, v_stride_d,
                               c_stride_kv, c_stride_l, c_stride_t, c_stride_c,
                               BLOCK_SIZE, HEAD_SIZE, HIDDEN, NUM_KV, VEC, BLOCK_T, BLOCK_D, TO_CHUNK)
    else:
        _copy_tile(pid_t, pid_lk, pid_d, cache_ptr, layer_off_ptr, slot_ptr, slot_start, chunk_ptr, num_tokens,
                   num_slots, kv_off, stride_b, stride_o, stride_h, stride_d,
                   v_stride_b, v_stride_o, v_stride_h, v_stride_d,
                   c_stride_kv, c_stride_l, c_stride_t, c_stride_c,
                   BLOCK_SIZE, HEAD_SIZE, HIDDEN, NUM_KV, VEC, BLOCK_T, BLOCK_D, TO_CHUNK)


# num_tokens and slot_start (where a chunk's slots begin in the request's) change every call,
# num_slots with the cache size: no value specialization (== 1, % 16 == 0) on them, so no recompiles.
@triton.jit(do_not_specialize=["slot_start", "num_tokens", "num_slots"])
def _paged_gather_kernel(cache_ptr, layer_off_ptr, slot_ptr, slot_start, chunk_ptr, num_tokens, num_slots, num_lk,
                         kv_off, stride_b, stride_o, stride_h, stride_d, v_stride_b, v_stride_o, v_stride_h,
                         v_stride_d, c_stride_kv, c_stride_l, c_stride_t, c_stride_c,
                         BLOCK_SIZE: tl.constexpr, HEAD_SIZE: tl.constexpr, HIDDEN: tl.constexpr,
                         NUM_KV: tl.constexpr, VEC: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
                         LOOP: tl.constexpr):
    _copy_tiles(cache_ptr, layer_off_ptr, slot_ptr, slot_start, chunk_ptr, num_tokens, num_slots, num_lk, kv_off,
                stride_b, stride_o, stride_h, stride_d, v_stride_b, v_stride_o, v_stride_h, v_stride_d,
                c_stride_kv, c_stride_l, c_stride_t, c_stride_c,
                BLOCK_SIZE, HEAD_SIZE, HIDDEN, NUM_KV, VEC, BLOCK_T, BLOCK_D, True, LOOP)


@triton.jit(do_not_specialize=["slot_start", "num_tokens", "num_slots"])
def _paged_scatter_kernel(cache_ptr, layer_off_ptr, slot_ptr, slot_start, chunk_ptr, num_tokens, num_slots, num_lk,
                          kv_off, stride_b, stride_o, stride_h, stride_d, v_stride_b, v_stride_o, v_stride_h,
                          v_stride_d, c_stride_kv, c_stride_l, c_stride_t, c_stride_c,
                          BLOCK_SIZE: tl.constexpr, HEAD_SIZE: tl.constexpr, HIDDEN: tl.constexpr,
                          NUM_KV: tl.constexpr, VEC: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
                          LOOP: tl.constexpr):
    _copy_tiles(cache_ptr, layer_off_ptr, slot_ptr, slot_start, chunk_ptr, num_tokens, num_slots, num_lk, kv_off,
                stride_b, stride_o, stride_h, stride_d, v_stride_b, v_stride_o, v_stride_h, v_stride_d,
                c_stride_kv, c_stride_l, c_stride_t, c_stride_c,
                BLOCK_SIZE, HEAD_SIZE, HIDDEN, NUM_KV, VEC, BLOCK_T, BLOCK_D, False, LOOP)


_TILE_ELEMS = 4096


def tile(hidden: int, element_size: int = 2, direction: str = "gather", placement: str = "device",
         device_name: str | None = None) -> tuple[int, int, int]:
    """(BLOCK_T, BLOCK_D, num_warps), keyed on constexpr sizes only (never on T, so no recompiles):
    the config `bench.kernels --tune` measured for this key (and the chunk's placement, ``device``
    or ``pinned``) if the tuning file has one and was tuned on ``device_name`` (None: not checked),
    else a heuristic."""
    tuned = tuning.lookup(direction, hidden, element_size, placement, device_name)
    if tuned is not None:
        return tuned.block_t, tuned.block_d, tuned.num_warps
    pow2_divisor = hidden & -hidden
    if hidden <= 1024:              # a row in one tile, padded: 576 -> 1024, 120 -> 128, 1024 -> 1024
        # One program per row beats whole tiles of its power-of-two part: MLA's 576 ran at 0.98x
        # (gather) / 0.95x (scatter) of a device copy in one padded tile of 1024, 0.85x / 0.84x in
        # nine tiles of 64, 0.83x / 0.78x in two of 512 (H200, 2048 tokens x 61 layers on random
        # blocks, `bench.gpu_check` layouts' MLA case with each tile set by `tuning.using`)
        block_d = triton.next_power_of_2(hidden)
    elif pow2_divisor >= 64:        # 4096 -> 1024, 1536 -> 512: no masked-off columns
        block_d = min(pow2_divisor, 1024)
    else:                           # odd sizes above 1024: padded tiles of 1024 columns
        block_d = 1024
    return max(1, _TILE_ELEMS // block_d), block_d, 4


def vector_width(layers: Layers, kv_off: int) -> int:
    """Elements per vector access on the cache side: the widest power of two up to 16 bytes that
    divides the base alignment, every stride, layer offset, kv_off and the head size; else 1."""
    k0 = layers.k[0]
    size = k0.element_size()
    strides = [k0.stride()] + ([] if layers.v is None else [layers.v[0].stride()])
    if any(st[3] != 1 for st in strides):
        return 1
    base = k0.data_ptr()
    elems = [x for st in strides for x in st[:3]] + [layers.geometry.head_size, kv_off]
    byte_offsets = [base] + [k.data_ptr() - base for k in layers.k]
    vec = 16 // size
    while vec > 1 and not (all(x % vec == 0 for x in elems) and all(b % (vec * size) == 0 for b in byte_offsets)):
        vec //= 2
    return vec


_offsets_cache: dict[tuple[torch.device, tuple[int, ...]], torch.Tensor] = {}


def _layer_offsets(layers: Layers) -> torch.Tensor:
    size = layers.k[0].element_size()
    base = layers.k[0].data_ptr()
    offs = []
    for i, k in enumerate(layers.k):
        diff = k.data_ptr() - base
        if diff % size:
            raise ValueError(f"kv_caches[{i}] is not element-aligned relative to kv_caches[0]")
        offs.append(diff // size)
    key = (layers.device, tuple(offs))
    t = _offsets_cache.get(key)
    if t is None:
        if len(_offsets_cache) > 256:
            _offsets_cache.clear()
        t = _offsets_cache[key] = torch.tensor(offs, dtype=torch.int64, device=layers.device)
    return t


# ---------------------------------------------------------------- the grid: full, or capped for zero-copy

# Programs a launch on a chunk in pinned host memory (zero-copy: the kernel reads or writes it over
# PCIe) may have, per SM of the GPU, and at least. Why: a full grid (thousands of programs of
# 4 tokens x 1024 columns) puts programs on every SM that then wait on PCIe, and the model's
# compute beside the copy gets what is left. PCIe needs far fewer: Gen5 x16 reaches ~50 GB/s at a
# round trip of ~1-2 us, i.e. ~100 KB in flight (Little's law); a program keeps one tile in flight
# (BLOCK_T x BLOCK_D = 4096 elements: 8 KiB of bf16, 4 KiB of fp8, in 16-byte accesses) and
# alternates loads and stores, so a few dozen programs keep PCIe saturated. Half the SM count
# (66 on H100 / H200, 54 on A100) is ~0.5 MB in flight, several times that, while one program of 4
# warps takes ~1/16 of one SM's warp slots on at most half the SMs; 32 at least for small GPUs.
ZERO_COPY_PROGRAMS_PER_SM = 0.5
ZERO_COPY_MIN_PROGRAMS = 32
# Tests: when set, every launch (any placement, CPU tensors too) is capped at this many programs,
# so the capped grid's loops run in the interpreter.
_FORCE_MAX_PROGRAMS: int | None = None


def zero_copy_max_programs(sm_count: int) -> int:
    """The most programs a zero-copy launch has on a GPU of ``sm_count`` SMs (see above)."""
    return max(ZERO_COPY_MIN_PROGRAMS, int(sm_count * ZERO_COPY_PROGRAMS_PER_SM))


def max_programs(placement: str, sm_count: int | None) -> int | None:
    """The cap on a launch's programs for a chunk's placement: None (the full grid) for a
    device-resident chunk; for a pinned host chunk, `zero_copy_max_programs`."""
    if placement == "device":
        return None
    if placement != "pinned":
        raise ValueError(f"placement must be one of {tuning.PLACEMENTS}, got {placement!r}")
    return zero_copy_max_programs(sm_count or 0)


def capped_grid(tiles: tuple[int, int, int], cap: int | None) -> tuple[int, int, int]:
    """The grid for (token tiles, layers x K/V, column tiles) with at most ``cap`` programs in all
    (None: one program per tile). The kernel's grid-stride loops cover the tiles of every axis
    that gets fewer programs than tiles. Columns and layers keep their programs first (few: a
    column tile is up to 1024 columns, layers x 2 at most a few hundred), the token axis, the long
    one, loops; the layer axis loops too where layers x column tiles alone exceed the cap."""
    n_t, n_lk, n_d = tiles
    if cap is None or n_t * n_lk * n_d <= cap:
        return n_t, n_lk, n_d
    p_d = max(1, min(n_d, cap))
    p_lk = max(1, min(n_lk, cap // p_d))
    return max(1, min(n_t, cap // (p_d * p_lk))), p_lk, p_d


def _check_chunk_device(t: torch.Tensor, name: str, layers: Layers) -> str:
    """The chunk's placement, ``device`` or ``pinned`` (a pinned host chunk for a CUDA cache),
    or ValueError."""
    if t.device == layers.device:
        return "device"
    if layers.device.type == "cuda" and t.device.type == "cpu" and t.is_pinned():
        return "pinned"  # the kernel reads/writes pinned host memory directly via UVA
    raise ValueError(f"{name} is on {t.device}, the cache on {layers.device}: {name} must be on the "
                     f"cache device or (for a CUDA cache) in pinned host memory")


@dataclass(frozen=True)
class LaunchPlan:
    """What a launch on one cache needs besides the slots and the chunk, worked out once per
    (cache, direction) and kept with the cache's `Layers`: vLLM hands over the same tensors every
    call. Working it out per call (layer offsets, vector width, strides, the tuned tile) cost
    ~130 us of Python per all-layers call, 32 layers, on this 2-core host: several times a
    ~20 us kernel on an H100 (bench.kernels --host-cost has the figure now)."""

    cache_bits: torch.Tensor       # layer 0's K view as integers of the element's width
    layer_offsets: torch.Tensor    # int64 [L] on the cache's device, elements from layer 0's base
    num_slots: int
    kv_off: int
    cache_strides: tuple[int, ...]  # K's 4 strides, then V's (K's again for MLA)
    constexprs: dict
    block_t: int
    grid_lk: int                    # layers x (K, V)
    grid_d: int
    max_programs: int | None        # the cap on the grid (zero-copy), None: the full grid
    generation: int                 # tuning.generation() it was made under


def _sm_count(device: torch.device) -> int | None:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else None


def launch_plan(layers: Layers, direction: str, placement: str = "device") -> LaunchPlan:
    key = ("launch_plan", direction, placement)
    plan = layers.derived.get(key)
    if plan is None or plan.generation != tuning.generation():  # the tuner tries another tile
        g, k0 = layers.geometry, layers.k[0]
        kv_off = 0 if layers.v is None else (layers.v[0].data_ptr() - k0.data_ptr()) // k0.element_size()
        block_t, block_d, num_warps = tile(g.hidden, k0.element_size(), direction, placement,
                                           tuning.device_name(layers.device))
        plan = layers.derived[key] = LaunchPlan(
            cache_bits=as_bits(k0), layer_offsets=_layer_offsets(layers), num_slots=g.num_blocks * g.block_size,
            kv_off=kv_off, cache_strides=(*k0.stride(), *(k0 if layers.v is None else layers.v[0]).stride()),
            constexprs=dict(BLOCK_SIZE=g.block_size, HEAD_SIZE=g.head_size, HIDDEN=g.hidden, NUM_KV=layers.num_kv,
                            VEC=vector_width(layers, kv_off), BLOCK_T=block_t, BLOCK_D=block_d, num_warps=num_warps,
                            LOOP=False),
            block_t=block_t, grid_lk=layers.num_layers * layers.num_kv, grid_d=triton.cdiv(g.hidden, block_d),
            max_programs=max_programs(placement, _sm_count(layers.device) if placement == "pinned" else None),
            generation=tuning.generation())
    return plan


def _launch(kernel, layers: Layers, slots: torch.Tensor, chunk4: torch.Tensor, start: int, end: int,
            chunk_strides: tuple[int, ...] | None = None, placement: str = "device") -> None:
    """`chunk_strides`: the chunk's [num_kv, L, T, hidden] strides where `chunk4` is the chunk in
    another format (its base and dtype are what the kernel takes from it). `placement`: what
    `_check_chunk_device` said of the chunk (a pinned host chunk gets the capped grid)."""
    num_tokens = end - start
    if num_tokens <= 0:
        return
    plan = launch_plan(layers, "gather" if kernel is _paged_gather_kernel else "scatter", placement)
    grid = (-(-num_tokens // plan.block_t), plan.grid_lk, plan.grid_d)
    constexprs = plan.constexprs  # LOOP=False: one tile per program
    if plan.max_programs is not None or _FORCE_MAX_PROGRAMS is not None:  # zero-copy (or a test)
        grid = capped_grid(grid, _FORCE_MAX_PROGRAMS or plan.max_programs)
        constexprs = {**constexprs, "LOOP": True}
    with on_device(layers.device):
        kernel[grid](plan.cache_bits, plan.layer_offsets, slots, start, as_bits(chunk4), num_tokens, plan.num_slots,
                     plan.grid_lk, plan.kv_off, *plan.cache_strides, *(chunk_strides or chunk4.stride()),
                     **constexprs)


_cpu_copy = None  # kernels.cpu_copy once imported (numba is imported on the first CPU copy, not here)


def host_copy(gather: bool, layers: Layers, slots: torch.Tensor, chunks4: Sequence[torch.Tensor],
              spans: Sequence[tuple[int, int]]) -> bool:
    """The CPU cache's copy by ``cpu_copy`` (compiled, at memory speed) where it applies: chunks in
    host memory with dense rows, numba importable. False: the caller takes the torch path."""
    if not host_copy_available() or layers.device.type != "cpu" or \
            any(c.device.type != "cpu" or (c.stride(3) != 1 and c.shape[3] > 1) for c in chunks4):
        return False
    _cpu_copy.move(gather, layers, slots, chunks4, spans)
    return True


def warm_up_host_copy() -> bool:
    """Compiles the CPU copy now (a vLLM worker on a CPU cache calls it at start-up) rather than on
    the first request. False where numba is missing (the torch path serves)."""
    if not host_copy_available():
        return False
    _cpu_copy.warm_up()
    return True


def host_copy_available() -> bool:
    global _cpu_copy
    if _cpu_copy is None:
        try:
            from . import cpu_copy
        except ImportError:  # numba missing or broken: the torch path serves, slower
            _cpu_copy = False
        else:
            _cpu_copy = cpu_copy
    return _cpu_copy is not False


def gather_into(layers: Layers, slots: torch.Tensor, out4: torch.Tensor, start: int = 0, end: int | None = None) -> None:
    """The launchers' dispatch below their argument checks: Triton kernel, the CPU copy or the torch reference, for
    slots[start:end] (the kernel reads from `start` on: no slice per chunk). ``out4`` is any chunk
    format as a [num_kv, L, T, hidden] view (``reference.as_2ltd``)."""
    end = len(slots) if end is None else end
    if use_triton(layers.device):
        placement = _check_chunk_device(out4, "out", layers)
        _launch(_paged_gather_kernel, layers, slots, out4, start, end, placement=placement)
    elif not host_copy(True, layers, slots, [out4], [(start, end)]):
        gather_into_ref(layers, slots[start:end], out4)


def scatter_from(layers: Layers, slots: torch.Tensor, chunk4: torch.Tensor, start: int = 0,
                 end: int | None = None) -> None:
    """The scatter counterpart of :func:`gather_into`."""
    end = len(slots) if end is None else end
    if use_triton(layers.device):
        placement = _check_chunk_device(chunk4, "chunk", layers)
        _launch(_paged_scatter_kernel, layers, slots, chunk4, start, end, placement=placement)
    elif not host_copy(False, layers, slots, [chunk4], [(start, end)]):
        scatter_from_ref(layers, slots[start:end], chunk4)


@dataclass(frozen=True)
class PagedTarget:
    """A paged cache and a request's slots on its device, both checked once (for a store or a
    load of many chunks): each chunk's copy is then a slice of the slots and one launch. The
    public launchers below check everything per call (~55 us of Python for 32 layers here);
    through this, a chunk's copy costs ~10 us before Triton's launch (bench.kernels --host-cost)."""

    layers: Layers
    slots: torch.Tensor  # slot of token i at index i (-1: padding)
    _per_layer: dict = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def of(cls, kv_caches: Sequence[torch.Tensor], slot_mapping: torch.Tensor, layout: str) -> PagedTarget:
        layers = prepare_layers(kv_caches, layout)
        return cls(layers, prepare_slots(slot_mapping, layers))

    def layer(self, i: int) -> PagedTarget:
        """The same slots in layer `i` alone (for the per-layer chunk format)."""
        target = self._per_layer.get(i)
        if target is None:
            layers = self.layers
            one = layers.derived.get(("layer", i))
            if one is None:
                if not 0 <= i < layers.num_layers:
                    raise ValueError(f"layer {i} out of range for a cache of {layers.num_layers} layers")
                one = layers.derived[("layer", i)] = Layers(
                    layers.layout, layers.geometry, [layers.k[i]], None if layers.v is None else [layers.v[i]],
                    layers.dtype, layers.device)
            target = self._per_layer[i] = PagedTarget(one, self.slots)
        return target

    def _move(self, kernel, chunk: torch.Tensor, start: int, end: int, name: str) -> None:
        if not 0 <= start <= end <= len(self.slots):
            raise ValueError(f"slot_mapping (length {len(self.slots)}) does not cover tokens [{start}, {end})")
        layers = self.layers
        per_layer = layers.num_layers == 1 and chunk.dim() < 4
        shape = (layer_chunk_shape if per_layer else chunk_shape)(layers, end - start)
        check_chunk(chunk, name, shape, layers.dtype)
        if not use_triton(layers.device):
            chunk4 = as_2ltd(chunk, per_layer, layers.geometry.use_mla)
            gather = kernel is _paged_gather_kernel
            if not host_copy(gather, layers, self.slots, [chunk4], [(start, end)]):
                (gather_into_ref if gather else scatter_from_ref)(layers, self.slots[start:end], chunk4)
            return
        placement = _check_chunk_device(chunk, name, layers)
        # The [num_kv, L, T, hidden] strides of a per-layer chunk, without making its view (two
        # torch ops, ~5 us a launch here): KV_T2D [T, 2, H] and MLA [T, C]; L is 1.
        st = chunk.stride()
        strides = None if not per_layer else (0, 0, st[0], st[1]) if layers.geometry.use_mla else (st[1], 0, st[0], st[2])
        _launch(kernel, layers, self.slots, chunk, start, end, strides, placement)

    def _move_many(self, kernel, chunks: Sequence[torch.Tensor], spans: Sequence[tuple[int, int]], name: str) -> None:
        layers = self.layers
        # Triton launches are per chunk anyway; one layer may come in the per-layer formats (_move)
        if use_triton(layers.device) or (layers.num_layers == 1 and any(c.dim() < 4 for c in chunks)) or len(spans) < 2:
            for chunk, (start, end) in zip(chunks, spans, strict=True):
                self._move(kernel, chunk, start, end, name)
            return
        if len(chunks) != len(spans):
            raise ValueError(f"{len(chunks)} chunks for {len(spans)} spans of tokens")
        for chunk, (start, end) in zip(chunks, spans):
            if not 0 <= start <= end <= len(self.slots):
                raise ValueError(f"slot_mapping (length {len(self.slots)}) does not cover tokens [{start}, {end})")
            check_chunk(chunk, name, chunk_shape(layers, end - start), layers.dtype)
        gather = kernel is _paged_gather_kernel
        if not host_copy(gather, layers, self.slots, chunks, spans):
            (gather_spans_ref if gather else scatter_spans_ref)(layers, self.slots, spans, chunks)

    def gather_many(self, spans: Sequence[tuple[int, int]], outs: Sequence[torch.Tensor]) -> None:
        """`gather` of each span of tokens into its chunk (KV_2LTD / KV_MLA): on CPU tensors the
        slots of consecutive chunks are checked once for all of them (reference.gather_spans_ref)."""
        self._move_many(_paged_gather_kernel, outs, spans, "out")

    def scatter_many(self, spans: Sequence[tuple[int, int]], chunks: Sequence[torch.Tensor]) -> None:
        """`scatter` of each chunk into its span of tokens (as `gather_many`)."""
        self._move_many(_paged_scatter_kernel, chunks, spans, "chunk")

    def gather(self, start: int, end: int, out: torch.Tensor) -> None:
        """Tokens [start, end) -> `out` (KV_2LTD / KV_MLA, or per layer KV_T2D / [T, C])."""
        self._move(_paged_gather_kernel, out, start, end, "out")

    def scatter(self, start: int, end: int, chunk: torch.Tensor) -> None:
        """`chunk` -> the slots of tokens [start, end) (padding slots skipped)."""
        self._move(_paged_scatter_kernel, chunk, start, end, "chunk")


def paged_gather(kv_caches: Sequence[torch.Tensor], slot_mapping: torch.Tensor, layout: str,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """Paged cache (all layers) -> KV_2LTD chunk [2, L, T, hidden] (MLA: [1, L, T, C]).

    Rows of padding slots (-1) are left untouched in ``out`` (zeros when ``out`` is None).
    """
    layers = prepare_layers(kv_caches, layout)
    slots = prepare_slots(slot_mapping, layers)
    shape = chunk_shape(layers, slots.numel())
    if out is None:
        out = torch.zeros(shape, dtype=layers.dtype, device=layers.device)
    check_chunk(out, "out", shape, layers.dtype)
    gather_into(layers, slots, out)
    return out


def paged_scatter(chunk: torch.Tensor, kv_caches: Sequence[torch.Tensor], slot_mapping: torch.Tensor,
                  layout: str) -> None:
    """KV_2LTD chunk [2, L, T, hidden] (MLA: [1, L, T, C]) -> paged cache, skipping slot -1."""
    layers = prepare_layers(kv_caches, layout)
    slots = prepare_slots(slot_mapping, layers)
    check_chunk(chunk, "chunk", chunk_shape(layers, slots.numel()), layers.dtype)
    scatter_from(layers, slots, chunk)


def paged_gather_layer(kv_cache: torch.Tensor, slot_mapping: torch.Tensor, layout: str,
                       out: torch.Tensor | None = None) -> torch.Tensor:
    """One layer -> KV_T2D [T, 2, hidden] (MLA: [T, C])."""
    layers = prepare_layers([kv_cache], layout, name="kv_cache")
    slots = prepare_slots(slot_mapping, layers)
    shape = layer_chunk_shape(layers, slots.numel())
    if out is None:
        out = torch.zeros(shape, dtype=layers.dtype, device=layers.device)
    check_chunk(out, "out", shape, layers.dtype)
    gather_into(layers, slots, as_2ltd(out, True, layers.geometry.use_mla))
    return out


def paged_scatter_layer(chunk: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
                        layout: str) -> None:
    """KV_T2D [T, 2, hidden] (MLA: [T, C]) -> one layer of the paged cache, skipping slot -1."""
    layers = prepare_layers([kv_cache], layout, name="kv_cache")
    slots = prepare_slots(slot_mapping, layers)
    check_chunk(chunk, "chunk", layer_chunk_shape(layers, slots.numel()), layers.dtype)
    scatter_from(layers, slots, as_2ltd(chunk, True, layers.geometry.use_mla))
