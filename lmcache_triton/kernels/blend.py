"""CacheBlend data movement: per-token K deviation, recompute-token selection, selective row writes.

CacheBlend (LMCache's blending) reuses KV of chunks that are not a prefix of the prompt; on the first
layers it recomputes K for all tokens, compares it with the cached (re-rotated, see ``rope.py``) K,
and from then on recomputes only the tokens whose KV deviates most, writing their fresh KV over the
cached rows:

- :func:`kv_deviation`: float32 [T] = per-token sum over all other dims of (k_new - k_cached)^2,
  in fp32. Triton: one program per BLOCK_T tokens, looping over the row in BLOCK_D columns.
- :func:`select_recompute_tokens`: the ceil(ratio * T) tokens of largest deviation (ties -> lower
  index), plus ``always``; sorted int64 indices. Plain torch on purpose (see the function).
- :func:`top_deviation_rows`: the same order with a count the caller knows and rows forced in
  first (a mask): what the blender uses per layer, because its result has a size known on the host
  and so never waits for the device (``always``'s union has a size only the device knows).
- :func:`selective_write`: ``dst[indices[i]] = src[i]`` along dim 0, -1 skipped, bit-exact for any
  dtype (moved as the integer type of its width), e.g. recomputed tokens' K/V into the blend buffer
  [T, hidden]. For vLLM's *paged* cache no new kernel is needed: the existing
  ``paged_scatter_layer(chunk, kv_cache, slot_mapping[indices], layout)`` is exactly the selective
  write of the recomputed tokens' KV_T2D rows into their slots.

Every launcher validates its inputs and raises ValueError naming the argument; CUDA tensors run the
Triton kernels, CPU tensors the torch references (or the kernels under TRITON_INTERPRET=1). Checks
that read a tensor's values run where they are free, on host tensors: on a GPU they would wait for
the device once per call, per layer in the blender (the kernels bound every index themselves).
"""

from __future__ import annotations

import math
from fractions import Fraction

import torch
import triton
import triton.language as tl

from . import common
from .common import as_bits, on_device, use_triton

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_TILE_ELEMS = 4096


def _tile(width: int) -> tuple[int, int]:
    """(BLOCK_T, BLOCK_D), keyed on the row width only (never on T: no recompiles)."""
    block_d = min(triton.next_power_of_2(max(width, 1)), 1024)
    return max(1, _TILE_ELEMS // block_d), block_d


# ------------------------------------------------------------------------------ kv_deviation

@triton.jit(do_not_specialize=["num_tokens"])
def _kv_deviation_kernel(a_ptr, b_ptr, out_ptr, num_tokens, width,
                         a_stride_t, a_stride_d, b_stride_t, b_stride_d,
                         BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    tok = pid * BLOCK_T + tl.arange(0, BLOCK_T).to(tl.int64)
    tok_ok = tok < num_tokens
    acc = tl.zeros([BLOCK_T, BLOCK_D], dtype=tl.float32)
    for d0 in range(0, width, BLOCK_D):
        col = d0 + tl.arange(0, BLOCK_D).to(tl.int64)
        mask = tok_ok[:, None] & (col < width)[None, :]
        a = tl.load(a_ptr + (tok * a_stride_t)[:, None] + (col * a_stride_d)[None, :], mask=mask, other=0.0)
        b = tl.load(b_ptr + (tok * b_stride_t)[:, None] + (col * b_stride_d)[None, :], mask=mask, other=0.0)
        diff = a.to(tl.float32) - b.to(tl.float32)
        acc += diff * diff
    tl.store(out_ptr + tok, tl.sum(acc, axis=1), mask=tok_ok)


def _check_deviation(k_new, k_cached) -> None:
    for name, t in (("k_new", k_new), ("k_cached", k_cached)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() < 1:
            raise ValueError(f"{name} must be [T, ...], got a 0-d tensor")
        if t.dtype not in _FLOAT_DTYPES:
            raise ValueError(f"{name} must be float16/bfloat16/float32, got {t.dtype}")
    if k_cached.shape != k_new.shape or k_cached.dtype != k_new.dtype or k_cached.device != k_new.device:
        raise ValueError(f"k_cached ({tuple(k_cached.shape)}, {k_cached.dtype}, {k_cached.device}) must match "
                         f"k_new ({tuple(k_new.shape)}, {k_new.dtype}, {k_new.device})")


def kv_deviation_ref(k_new: torch.Tensor, k_cached: torch.Tensor) -> torch.Tensor:
    """Pure-torch reference of :func:`kv_deviation`."""
    _check_deviation(k_new, k_cached)
    diff = k_new.float() - k_cached.float()
    return (diff * diff).reshape(k_new.shape[0], math.prod(k_new.shape[1:])).sum(dim=1)


def kv_deviation(k_new: torch.Tensor, k_cached: torch.Tensor) -> torch.Tensor:
    """[T, ...] x2 (same shape and dtype) -> float32 [T]: per token, the sum over all other dims of
    (k_new - k_cached)^2, computed in fp32."""
    _check_deviation(k_new, k_cached)
    if not use_triton(k_new.device):
        return kv_deviation_ref(k_new, k_cached)
    num_tokens = k_new.shape[0]
    width = math.prod(k_new.shape[1:])
    a = k_new.reshape(num_tokens, width)  # a view whenever the trailing dims allow, else a copy
    b = k_cached.reshape(num_tokens, width)
    out = torch.empty(num_tokens, dtype=torch.float32, device=k_new.device)
    if num_tokens == 0:
        return out
    block_t, block_d = _tile(width)
    with on_device(k_new.device):
        _kv_deviation_kernel[(triton.cdiv(num_tokens, block_t),)](
            a, b, out, num_tokens, width, *a.stride(), *b.stride(),
            BLOCK_T=block_t, BLOCK_D=block_d, num_warps=4)
    return out


# ------------------------------------------------------------------------------ selection

def num_recompute_tokens(ratio: float, num_tokens: int) -> int:
    """ceil(ratio * num_tokens), with ``ratio`` taken as the decimal it prints as, so that
    0.15 * 100 gives 15 rather than the 16 that float rounding (15.000000000000002) would."""
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0.0 <= ratio <= 1.0:
        raise ValueError(f"ratio must be a number in [0, 1], got {ratio!r}")
    return min(num_tokens, math.ceil(Fraction(repr(float(ratio))) * num_tokens))


def _check_scores(deviation) -> None:
    if not isinstance(deviation, torch.Tensor):
        raise ValueError(f"deviation must be a torch.Tensor, got {type(deviation).__name__}")
    if deviation.dim() != 1 or not deviation.is_floating_point():
        raise ValueError(f"deviation must be a 1-D float tensor [T], got {deviation.dtype} "
                         f"of shape {tuple(deviation.shape)}")


def _check_selection(deviation, ratio, always) -> tuple[int, torch.Tensor | None]:
    _check_scores(deviation)
    num_tokens = deviation.numel()
    k = num_recompute_tokens(ratio, num_tokens)
    if always is None:
        return k, None
    if not isinstance(always, torch.Tensor):
        raise ValueError(f"always must be a torch.Tensor of token indices, got {type(always).__name__}")
    if always.dtype not in (torch.int32, torch.int64) or always.dim() > 1:
        raise ValueError(f"always must be a 0-d/1-D int32/int64 tensor, got {always.dtype} "
                         f"of shape {tuple(always.shape)}")
    always = always.reshape(-1).to(deviation.device, torch.int64)
    if always.numel() and (int(always.min()) < 0 or int(always.max()) >= num_tokens):  # its union syncs anyway
        raise ValueError(f"always must hold token indices in [0, {num_tokens}), got "
                         f"[{int(always.min())}, {int(always.max())}]")
    return k, always


def select_recompute_tokens_ref(deviation: torch.Tensor, ratio: float, *,
                                always: torch.Tensor | None = None) -> torch.Tensor:
    """Reference of :func:`select_recompute_tokens`, written independently: a Python sort on
    (-deviation, index), NaN counted as +inf."""
    k, always = _check_selection(deviation, ratio, always)
    dev = [math.inf if math.isnan(x) else x for x in deviation.double().cpu().tolist()]
    chosen = set(sorted(range(len(dev)), key=lambda i: (-dev[i], i))[:k])
    if always is not None:
        chosen.update(always.cpu().tolist())
    return torch.tensor(sorted(chosen), dtype=torch.int64, device=deviation.device)


def select_recompute_tokens(deviation: torch.Tensor, ratio: float, *,
                            always: torch.Tensor | None = None) -> torch.Tensor:
    """int64 indices, ascending, of the ceil(ratio * T) tokens with the largest ``deviation`` (float [T]);
    ties go to the lower index, NaN counts as +inf (a broken row is recomputed). ``always`` (int token
    indices in [0, T), e.g. the last token) are added when not already selected. ratio in [0, 1] else
    ValueError; ratio 0 -> only ``always``, ratio 1 -> all tokens. See :func:`num_recompute_tokens`.

    Without ``always`` nothing waits for the device. With it, the union's size is known only there
    (one host sync); :func:`top_deviation_rows` is the sync-free form.
    """
    k, always = _check_selection(deviation, ratio, always)
    chosen = top_deviation_rows(deviation, k)
    if always is not None and always.numel():
        chosen = torch.unique(torch.cat([chosen, always]), sorted=True)
    return chosen


def _sort_key(deviation: torch.Tensor, first: torch.Tensor | None) -> torch.Tensor:
    # NaN and +inf both become the largest finite float (a broken row ranks above every real one,
    # ties to the lower index), so that +inf is free to mark the forced rows above them all.
    key = torch.nan_to_num(deviation.float(), nan=_FMAX, posinf=_FMAX)
    return key if first is None else key.masked_fill(first, math.inf)


_FMAX = torch.finfo(torch.float32).max


def _check_top(deviation, n, first) -> None:
    _check_scores(deviation)
    if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= deviation.numel():
        raise ValueError(f"n must be an int in [0, {deviation.numel()}] (the rows to keep), got {n!r}")
    if first is not None and (not isinstance(first, torch.Tensor) or first.dtype != torch.bool
                              or first.shape != deviation.shape or first.device != deviation.device):
        raise ValueError(f"first must be a bool mask of deviation's shape {tuple(deviation.shape)} on "
                         f"{deviation.device}, got {getattr(first, 'dtype', type(first).__name__)} of shape "
                         f"{tuple(getattr(first, 'shape', ()))} on {getattr(first, 'device', None)}")


def top_deviation_rows_ref(deviation: torch.Tensor, n: int, *, first: torch.Tensor | None = None) -> torch.Tensor:
    """Reference of :func:`top_deviation_rows`, written independently: a Python sort."""
    _check_top(deviation, n, first)
    dev = [math.inf if math.isnan(x) else x for x in deviation.double().cpu().tolist()]
    forced = [False] * len(dev) if first is None else first.cpu().tolist()
    order = sorted(range(len(dev)), key=lambda i: (not forced[i], -dev[i], i))
    return torch.tensor(sorted(order[:n]), dtype=torch.int64, device=deviation.device)


def top_deviation_rows(deviation: torch.Tensor, n: int, *, first: torch.Tensor | None = None) -> torch.Tensor:
    """int64 indices, ascending, of ``n`` rows of ``deviation`` (float [T]): the rows of the bool
    mask ``first`` before any other (in index order), then the largest deviations (ties to the lower
    index, NaN as +inf). With as many ``first`` rows as the caller counts on the host, ``n = k +
    that count`` keeps all of them plus the k largest of the rest, in a size known without waiting
    for the device: the blender's selection, per check layer, sync-free.
    """
    # Plain torch on purpose: this is a selection over T scalars (a few thousand per layer), one
    # sort of T floats, microseconds on a GPU, dwarfed by the attention it saves. A Triton top-k would
    # add code and no speed. It must be exact and deterministic: torch.topk does not promise an order
    # among equal values, so a *stable* descending sort is used, which keeps equal values in index
    # order (lower index first); the first n of that order are the answer.
    _check_top(deviation, n, first)
    order = torch.sort(_sort_key(deviation, first), descending=True, stable=True).indices
    return torch.sort(order[:n]).values.to(torch.int64)


# ------------------------------------------------------------------------------ selective_write

# num_rows and num_dst_rows change with every request: no value specialization, no recompiles.
@triton.jit(do_not_specialize=["num_rows", "num_dst_rows"])
def _selective_write_kernel(dst_ptr, src_ptr, idx_ptr, num_rows, num_dst_rows, width,
                            d_stride_t, d_stride_c, s_stride_t, s_stride_c,
                            BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    pid_t = tl.program_id(0).to(tl.int64)
    pid_d = tl.program_id(1).to(tl.int64)
    row = pid_t * BLOCK_T + tl.arange(0, BLOCK_T).to(tl.int64)
    dst_row = tl.load(idx_ptr + row, mask=row < num_rows, other=-1).to(tl.int64)
    col = pid_d * BLOCK_D + tl.arange(0, BLOCK_D).to(tl.int64)
    # dst_row >= 0 also excludes rows past the end (loaded as -1). dst_row < num_dst_rows keeps an
    # out-of-range index from writing past dst even where the launcher's host check is bypassed
    # (it is free here): such a row is skipped like -1.
    mask = ((dst_row >= 0) & (dst_row < num_dst_rows))[:, None] & (col < width)[None, :]
    v = tl.load(src_ptr + (row * s_stride_t)[:, None] + (col * s_stride_c)[None, :], mask=mask)
    tl.store(dst_ptr + (dst_row * d_stride_t)[:, None] + (col * d_stride_c)[None, :], v, mask=mask)


def _check_write(dst, src, indices) -> None:
    for name, t in (("dst", dst), ("src", src), ("indices", indices)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if dst.dim() < 1:
        raise ValueError("dst must be [N, ...], got a 0-d tensor")
    if indices.dim() != 1 or indices.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"indices must be a 1-D int32/int64 tensor, got {indices.dtype} "
                         f"of shape {tuple(indices.shape)}")
    want = (indices.numel(), *dst.shape[1:])
    if tuple(src.shape) != want:
        raise ValueError(f"src must have shape {want} (one row per index, dst's row shape), got {tuple(src.shape)}")
    if src.dtype != dst.dtype:
        raise ValueError(f"src must have dst's dtype {dst.dtype}, got {src.dtype}")
    if src.device != dst.device or indices.device != dst.device:
        raise ValueError(f"src ({src.device}) and indices ({indices.device}) must be on dst's device {dst.device}")
    if dst.element_size() not in (1, 2, 4, 8):
        raise ValueError(f"dst has unsupported dtype {dst.dtype}")
    if indices.numel() and common.in_host_memory(indices):
        # Checked where it is free. On a GPU it would wait for the device, per layer in the blender;
        # the kernel skips a row outside dst itself (tests/kernels/test_slot_bounds.py).
        lo, hi = int(indices.min()), int(indices.max())
        if lo < -1 or hi >= dst.shape[0]:
            raise ValueError(f"indices must lie in [0, {dst.shape[0]}) or be -1 (skip), got [{lo}, {hi}]")


def selective_write_ref(dst: torch.Tensor, src: torch.Tensor, indices: torch.Tensor) -> None:
    """Reference of :func:`selective_write`."""
    _check_write(dst, src, indices)
    valid = (indices >= 0).nonzero().squeeze(1)
    if valid.numel():
        as_bits(dst)[indices[valid].long()] = as_bits(src)[valid]


def selective_write(dst: torch.Tensor, src: torch.Tensor, indices: torch.Tensor) -> None:
    """``dst[indices[i]] = src[i]`` along dim 0 for every i with ``indices[i] >= 0`` (-1 is skipped).

    dst [N, ...] and src [len(indices), ...] share the row shape and dtype (any dtype; moved bit for
    bit). indices must be unique (duplicates leave an unspecified winner) and in [0, N) or -1: host
    indices are checked (ValueError), on a GPU a row outside dst is skipped (a check there would wait
    for the device). Rows of dst not named are left untouched.
    """
    _check_write(dst, src, indices)
    if not use_triton(dst.device):
        selective_write_ref(dst, src, indices)
        return
    num_rows = indices.numel()
    if num_rows == 0 or dst[0].numel() == 0:
        return
    try:
        d2 = as_bits(dst).view(dst.shape[0], math.prod(dst.shape[1:]))  # must be a view: the kernel writes through it
    except RuntimeError:
        raise ValueError(f"dst's row dims must be flattenable without a copy, got shape "
                         f"{tuple(dst.shape)} / stride {dst.stride()}") from None
    s2 = as_bits(src).reshape(num_rows, math.prod(src.shape[1:]))
    width = d2.shape[1]
    block_t, block_d = _tile(width)
    grid = (triton.cdiv(num_rows, block_t), triton.cdiv(width, block_d))
    with on_device(dst.device):
        _selective_write_kernel[grid](d2, s2, indices.contiguous(), num_rows, d2.shape[0], width,
                                      *d2.stride(), *s2.stride(),
                                      BLOCK_T=block_t, BLOCK_D=block_d, num_warps=4)
