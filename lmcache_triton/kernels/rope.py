"""RoPE re-rotation of cached K for CacheBlend: K rotated at old positions -> K as if rotated at new ones.

A chunk of KV reused at a different place in the prompt (non-prefix reuse) carries K that RoPE rotated
at the positions it had when it was computed. Rotations compose, R(new) = R(new - old) R(old), so it
is enough to rotate the cached K once more by delta = new - old. Negative deltas use
cos(-x) = cos(x), sin(-x) = -sin(x): the cache row |delta| is read and the sin sign flipped, so the
cos/sin cache vLLM already holds (``RotaryEmbedding.cos_sin_cache``, [max_position, rotary_dim], cos
half then sin half) serves every delta with |delta| < max_position.

Styles, as vLLM's ``_apply_rotary_emb_torch`` (pair i uses cos[i], sin[i], i < rotary_dim / 2):
    is_neox=True   x1 = x[..., :rot/2],  x2 = x[..., rot/2:rot]     (rotate halves)
    is_neox=False  x1 = x[..., 0:rot:2], x2 = x[..., 1:rot:2]       (GPT-J, interleaved pairs)
    o1 = x1 * cos - x2 * sin;  o2 = x2 * cos + x1 * sin
Dimensions >= rotary_dim pass through bit for bit. Math in fp32, result in the dtype of k.

Kernel: the (token, head) pairs are flattened into rows; each program handles BLOCK_R rows x rot/2
pairs (tiling over tokens, never one program per token). Every program reads all of its inputs before
it writes, and tiles are disjoint, so ``out`` may be ``k`` itself (in place). Addresses are int64.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import common
from .common import on_device, use_triton

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_TILE_ELEMS = 2048  # per operand tile (x1, x2, cos, sin each): keeps registers modest on a GPU


@triton.jit(do_not_specialize=["num_rows", "num_positions"])
def _rope_rerotate_kernel(k_ptr, out_ptr, delta_ptr, cache_ptr, num_rows, num_positions,
                          k_stride_t, k_stride_h, k_stride_d,
                          o_stride_t, o_stride_h, o_stride_d,
                          c_stride_p, c_stride_d,
                          NUM_HEADS: tl.constexpr, HALF: tl.constexpr, PASS: tl.constexpr,
                          COPY_PASS: tl.constexpr, IS_NEOX: tl.constexpr,
                          HALF_PAD: tl.constexpr, PASS_PAD: tl.constexpr, BLOCK_R: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    row = pid * BLOCK_R + tl.arange(0, BLOCK_R).to(tl.int64)
    row_ok = row < num_rows
    tok = row // NUM_HEADS
    head = row % NUM_HEADS

    delta = tl.load(delta_ptr + tok, mask=row_ok, other=0).to(tl.int64)
    pos = tl.where(delta < 0, -delta, delta)
    sign = tl.where(delta < 0, -1.0, 1.0)
    row_ok = row_ok & (pos < num_positions)  # not checked on the host for GPU positions: never read past the table

    i = tl.arange(0, HALF_PAD).to(tl.int64)
    # Masks from tensor comparisons only (the 3.9 interpreter rejects tensor & scalar bool).
    mask = row_ok[:, None] & (i < HALF)[None, :]
    cache_row = cache_ptr + (pos * c_stride_p)[:, None]
    cos = tl.load(cache_row + (i * c_stride_d)[None, :], mask=mask, other=0.0).to(tl.float32)
    sin = tl.load(cache_row + ((i + HALF) * c_stride_d)[None, :], mask=mask, other=0.0).to(tl.float32)
    sin = sin * sign[:, None]

    k_row = k_ptr + (tok * k_stride_t + head * k_stride_h)[:, None]
    o_row = out_ptr + (tok * o_stride_t + head * o_stride_h)[:, None]
    if IS_NEOX:
        x1 = tl.load(k_row + (i * k_stride_d)[None, :], mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(k_row + ((i + HALF) * k_stride_d)[None, :], mask=mask, other=0.0).to(tl.float32)
        o1 = x1 * cos - x2 * sin
        o2 = x2 * cos + x1 * sin
        tl.store(o_row + (i * o_stride_d)[None, :], o1.to(out_ptr.dtype.element_ty), mask=mask)
        tl.store(o_row + ((i + HALF) * o_stride_d)[None, :], o2.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        # GPT-J pairs (2i, 2i+1) are adjacent: load the rotary dims as one contiguous row and split
        # it, rather than two stride-2 loads; the sm_90 PTX then has 16-byte stores (none before).
        j = tl.arange(0, 2 * HALF_PAD).to(tl.int64)
        rmask = row_ok[:, None] & (j < 2 * HALF)[None, :]
        x = tl.load(k_row + (j * k_stride_d)[None, :], mask=rmask, other=0.0).to(tl.float32)
        x1, x2 = tl.split(tl.reshape(x, [BLOCK_R, HALF_PAD, 2]))
        o1 = x1 * cos - x2 * sin
        o2 = x2 * cos + x1 * sin
        o = tl.reshape(tl.join(o1, o2), [BLOCK_R, 2 * HALF_PAD])
        tl.store(o_row + (j * o_stride_d)[None, :], o.to(out_ptr.dtype.element_ty), mask=rmask)

    if COPY_PASS:  # dims >= rotary_dim, copied unconverted (bit-exact); skipped when out is k
        j = tl.arange(0, PASS_PAD).to(tl.int64)
        pmask = row_ok[:, None] & (j < PASS)[None, :]
        col = 2 * HALF + j
        v = tl.load(k_row + (col * k_stride_d)[None, :], mask=pmask)
        tl.store(o_row + (col * o_stride_d)[None, :], v, mask=pmask)


def _check(k, old_positions, new_positions, cos_sin_cache, rotary_dim, out) -> tuple[int, torch.Tensor]:
    """Validate; return (rotary_dim, delta int64 [T]). Raises ValueError naming the bad argument."""
    if not isinstance(k, torch.Tensor):
        raise ValueError(f"k must be a torch.Tensor, got {type(k).__name__}")
    if k.dim() != 3:
        raise ValueError(f"k must be [num_tokens, num_heads, head_size], got shape {tuple(k.shape)}")
    if k.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"k must be float16/bfloat16/float32, got {k.dtype}")
    num_tokens, _, head_size = k.shape
    for name, p in (("old_positions", old_positions), ("new_positions", new_positions)):
        if not isinstance(p, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(p).__name__}")
        if p.dim() != 1 or p.numel() != num_tokens:
            raise ValueError(f"{name} must have shape ({num_tokens},) (one per token of k), got {tuple(p.shape)}")
        if p.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{name} must be int32/int64, got {p.dtype}")
        if p.device != k.device:
            raise ValueError(f"{name} is on {p.device}, k on {k.device}: they must be on one device")
    if rotary_dim is None:
        rotary_dim = head_size
    if not isinstance(rotary_dim, int) or rotary_dim <= 0 or rotary_dim > head_size or rotary_dim % 2:
        raise ValueError(f"rotary_dim must be an even int in (0, head_size={head_size}], got {rotary_dim!r}")
    if not isinstance(cos_sin_cache, torch.Tensor):
        raise ValueError(f"cos_sin_cache must be a torch.Tensor, got {type(cos_sin_cache).__name__}")
    if cos_sin_cache.dim() != 2 or cos_sin_cache.shape[1] != rotary_dim:
        raise ValueError(f"cos_sin_cache must be [max_position, rotary_dim={rotary_dim}] (cos half, then sin "
                         f"half), got shape {tuple(cos_sin_cache.shape)}")
    if cos_sin_cache.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"cos_sin_cache must be float16/bfloat16/float32, got {cos_sin_cache.dtype}")
    if cos_sin_cache.device != k.device:
        raise ValueError(f"cos_sin_cache is on {cos_sin_cache.device}, k on {k.device}: they must be on one device")
    if out is not None:
        if not isinstance(out, torch.Tensor):
            raise ValueError(f"out must be a torch.Tensor, got {type(out).__name__}")
        if out.shape != k.shape or out.dtype != k.dtype or out.device != k.device:
            raise ValueError(f"out must match k ({tuple(k.shape)}, {k.dtype}, {k.device}), got "
                             f"({tuple(out.shape)}, {out.dtype}, {out.device})")
    delta = new_positions.long() - old_positions.long()
    if num_tokens and common.in_host_memory(delta):
        # Checked where it is free. On a GPU it would wait for the device, per layer in the blender;
        # there the kernel leaves a row whose |delta| is past the table unwritten instead of reading
        # past it (positions the model rotated q/k at are rows of its own table).
        max_delta = int(delta.abs().max())
        if max_delta >= cos_sin_cache.shape[0]:
            raise ValueError(f"new_positions - old_positions reaches |delta| = {max_delta}, but cos_sin_cache "
                             f"has only max_position = {cos_sin_cache.shape[0]} rows")
    return rotary_dim, delta


def _rerotate_ref(k, delta, cos_sin_cache, is_neox, rotary_dim, out) -> torch.Tensor:
    half = rotary_dim // 2
    rows = cos_sin_cache.index_select(0, delta.abs()).float()
    cos = rows[:, None, :half]
    sin = rows[:, None, half:] * torch.where(delta < 0, -1.0, 1.0).to(rows.device)[:, None, None]
    if is_neox:
        x1, x2 = k[..., :half].float(), k[..., half:rotary_dim].float()
    else:
        x1, x2 = k[..., 0:rotary_dim:2].float(), k[..., 1:rotary_dim:2].float()
    o1 = (x1 * cos - x2 * sin).to(k.dtype)
    o2 = (x2 * cos + x1 * sin).to(k.dtype)
    if is_neox:
        rot = torch.cat([o1, o2], dim=-1)
    else:
        rot = torch.stack([o1, o2], dim=-1).flatten(-2)
    if out is None:
        out = torch.empty_like(k)
    if rotary_dim < k.shape[-1] and out.data_ptr() != k.data_ptr():
        out[..., rotary_dim:] = k[..., rotary_dim:]
    out[..., :rotary_dim] = rot  # rot is a fresh tensor: safe when out is k
    return out


def rope_rerotate_ref(k: torch.Tensor, old_positions: torch.Tensor, new_positions: torch.Tensor,
                      cos_sin_cache: torch.Tensor, *, is_neox: bool, rotary_dim: int | None = None,
                      out: torch.Tensor | None = None) -> torch.Tensor:
    """Pure-torch reference of :func:`rope_rerotate` (same arguments, same result)."""
    rotary_dim, delta = _check(k, old_positions, new_positions, cos_sin_cache, rotary_dim, out)
    return _rerotate_ref(k, delta, cos_sin_cache, bool(is_neox), rotary_dim, out)


def rope_rerotate(k: torch.Tensor, old_positions: torch.Tensor, new_positions: torch.Tensor,
                  cos_sin_cache: torch.Tensor, *, is_neox: bool, rotary_dim: int | None = None,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """K [T, num_heads, head_size] rotated by RoPE at ``old_positions`` -> K as if rotated at
    ``new_positions`` (int [T] each), using vLLM's ``cos_sin_cache`` [max_position, rotary_dim].

    ``is_neox`` picks rotate-halves (True) or GPT-J interleaved pairs (False); dims >= ``rotary_dim``
    (default head_size) pass through unchanged. Computes in fp32, writes k's dtype into ``out``
    (a new tensor when None; may be ``k`` for in place) and returns it. Raises ValueError naming the
    bad argument, including when any |new - old| >= max_position for positions in host memory (on a
    GPU that check would wait for the device: the kernel leaves such a row of ``out`` unwritten).
    CUDA tensors run the Triton kernel; CPU tensors the torch reference (or the kernel under
    TRITON_INTERPRET=1).
    """
    rotary_dim, delta = _check(k, old_positions, new_positions, cos_sin_cache, rotary_dim, out)
    if not use_triton(k.device):
        return _rerotate_ref(k, delta, cos_sin_cache, bool(is_neox), rotary_dim, out)
    if out is None:
        out = torch.empty_like(k)
    num_tokens, num_heads, head_size = k.shape
    num_rows = num_tokens * num_heads
    if num_rows == 0:
        return out
    half = rotary_dim // 2
    passthrough = head_size - rotary_dim
    half_pad = triton.next_power_of_2(half)
    # Keyed on constexpr sizes only, never on T: no recompiles as the token count changes.
    block_r = max(1, min(_TILE_ELEMS // half_pad, 128))
    grid = (triton.cdiv(num_rows, block_r),)
    in_place = out.data_ptr() == k.data_ptr() and out.stride() == k.stride()
    with on_device(k.device):
        _rope_rerotate_kernel[grid](
            k, out, delta, cos_sin_cache, num_rows, cos_sin_cache.shape[0],
            *k.stride(), *out.stride(), *cos_sin_cache.stride(),
            NUM_HEADS=num_heads, HALF=half, PASS=passthrough,
            COPY_PASS=passthrough > 0 and not in_place, IS_NEOX=bool(is_neox),
            HALF_PAD=half_pad, PASS_PAD=triton.next_power_of_2(max(passthrough, 1)),
            BLOCK_R=block_r, num_warps=4,
        )
    return out
